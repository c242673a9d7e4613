"""kfac_factors(all_reduce=True) under torch.distributed: 2 processes, gloo backend, loopback.

Each rank gets a different share of one batch (3 and 5 samples, so the 'mean' scaling across
ranks matters); the all-reduced factors must equal those of one process over the concatenated
batch (float64, within 1e-12 relative to the largest entry). Every rank checks its own copy.
"""
import gc
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import gradhooks
from gradhooks import GradHooksError, kfac

WORLD = 2
SIZES = (3, 5)  # samples per rank
TOL = 1e-12
# every option twice, each pair of options once (fisher, kfac_approx, loss reduction)
COMBOS = [("empirical", "expand", "mean"), ("empirical", "reduce", "sum"),
          ("type-2", "expand", "sum"), ("type-2", "reduce", "mean")]


def _models():
    """(name, model, inputs of the whole batch, batch_first)."""
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Flatten(), nn.Linear(15, 3))
    yield "linear3d", seq.double(), torch.randn(sum(SIZES), 3, 4, dtype=torch.float64)
    cnn = nn.Sequential(nn.Conv2d(2, 4, 3, stride=2, padding=1, groups=2), nn.ReLU(), nn.Flatten(),
                        nn.Linear(4 * 3 * 3, 3))
    yield "conv2d-groups", cnn.double(), torch.randn(sum(SIZES), 2, 5, 5, dtype=torch.float64)


WORST = [0.0]  # largest relative error seen by this rank (printed with pytest -s)


def _assert_same(ours, ref, what, prefix=""):
    assert list(ours) == [prefix + k for k in ref], (what, list(ours), list(ref))
    for k, f in ref.items():
        for a, b, which in ((ours[prefix + k].A, f.A, "A"), (ours[prefix + k].G, f.G, "G")):
            err = ((a - b).abs().max() / b.abs().max()).item()
            WORST[0] = max(WORST[0], err)
            assert err <= TOL, f"{what} {k}.{which}: rel err {err:.2e}"


def _check_ddp(rank, model, x, y, part):
    """DDP: the training backward (DDP averages param.grad), then the factors of the union.
    A function of its own, so that the DDP wrapper (and its reducer, which holds the process
    group) is gone when it returns."""
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    for reduction in ("mean", "sum"):
        with gradhooks.attach(ddp, loss_reduction=reduction) as gh:
            nn.CrossEntropyLoss(reduction=reduction)(ddp(x[part]), y[part]).backward()
            ours = gh.kfac_factors("reduce", all_reduce=True)
        ref = kfac(model, x, y, nn.CrossEntropyLoss(reduction=reduction), kfac_approx="reduce")
        _assert_same(ours, ref, f"rank {rank} DDP {reduction}", prefix="module.")


def _worker(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        start = sum(SIZES[:rank])
        part = slice(start, start + SIZES[rank])
        for name, model, x in _models():
            y = torch.randint(0, 3, (len(x),), generator=torch.Generator().manual_seed(1))
            for fisher, approx, reduction in COMBOS:
                loss_fn = nn.CrossEntropyLoss(reduction=reduction)
                ours = kfac(model, x[part], y[part], loss_fn, fisher=fisher, kfac_approx=approx,
                            all_reduce=True)
                ref = kfac(model, x, y, loss_fn, fisher=fisher, kfac_approx=approx)
                _assert_same(ours, ref, f"rank {rank} {name} {fisher} {approx} {reduction}")
        _check_ddp(rank, model, x, y, part)
        # ranks holding different layers: every rank gets a clear error, nobody hangs
        with pytest.raises(GradHooksError, match="different layers"):
            kfac(model, x[part], y[part], nn.CrossEntropyLoss(), modules=["0" if rank else "3"],
                 all_reduce=True)
        print(f"rank {rank}: largest relative error of the all-reduced factors {WORST[0]:.2e}")
        gc.collect()  # no object holding the process group outlives destroy_process_group
        dist.barrier()  # nobody leaves while the other still talks to it
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_all_reduced_factors_equal_one_process_over_concatenated_batch():
    mp.spawn(_worker, args=(_free_port(),), nprocs=WORLD, join=True)
