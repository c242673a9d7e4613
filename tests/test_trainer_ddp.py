"""The Trainer's DP step on 2 processes (issue 40, point 2): ``torchrun --nproc_per_node 2``,
DDP through accelerate, gloo on CPU (tests/trainer_two_ranks.py). One Poisson lot over both
ranks (each sample once, with probability ``q = L / N``, ``L`` the per-device batch times the
accumulation steps times the 2 ranks), each rank clipping its share; the step's gradient,
the same on both ranks, equals the one-process loop's clipped sum of that lot over ``L``
(float64, noise 0); the epsilon equals Opacus' accountant's at the one-process rate. With
adaptive clipping (issue 40, point 3) the bound follows the lots' unclipped fraction counted over
both ranks (an empty share's stand-in sample not counted), as the one-process loop's.
"""
import math
import os
import pathlib
import socket
import subprocess
import sys

import pytest
import torch
from opacus.accountants import RDPAccountant  # noqa: E402
from test_trainer import (  # noqa: E402
    C,
    assert_grads_close,
    clipped_reference,
    dataset,
    model_of,
    own_grads,
)

from gradhooks.integrations.transformers import PoissonMicroBatchSampler  # noqa: E402

import zoo_imports  # noqa: F401

HERE = pathlib.Path(__file__).resolve().parent


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# per-device batch x accumulation steps: L = 6 in micro-batches of 0 to 2 samples per rank;
# L = 2, whose first lot has 1 sample: rank 1's share is empty (it joins with a 0-weight sample)
@pytest.mark.parametrize("micro", [(1, 3), (1, 1)], ids=["G3", "one-rank-empty"])
def test_two_ranks_equal_one_process_on_the_same_lot(tmp_path, micro):
    """Book-keeping and two-pass clipping, both ranks against the one-process loop."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)]),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", str(_port()), str(HERE / "trainer_two_ranks.py"), str(tmp_path),
         str(micro[0]), str(micro[1])],
        capture_output=True, text=True, timeout=400, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    data = dataset()
    expected = micro[0] * micro[1] * 2
    assert all(r["world"] == 2 and r["rate"] == expected / len(data) for r in ranks)
    # the lot as one process draws it at that rate, the ranks' shares its two halves
    sampler = PoissonMicroBatchSampler(len(data), expected / len(data), 1, 1,
                                       torch.Generator().manual_seed(0))
    lot = [i for part in sampler for i in part]
    shares = [len(h) for h in torch.tensor_split(torch.tensor(lot), 2)]
    if micro == (1, 1):
        assert shares == [1, 0]
    want = clipped_reference(model_of(), [data[i] for i in lot], expected)
    for clipping in ("book-keeping", "two-pass"):
        assert [r[clipping]["lot_sizes"][0] for r in ranks] == shares
        for r in ranks:
            assert_grads_close(r[clipping]["grads"], want, 1e-10)
    # adaptive clipping: the bound follows the lots' unclipped fraction over both ranks (the
    # loop's float64 norms), each lot clipped at its bound
    sampler = PoissonMicroBatchSampler(len(data), expected / len(data), 2, 1,
                                       torch.Generator().manual_seed(0))
    bound, model = C, model_of()
    for k, lot in enumerate([i for i in part] for part in sampler):
        samples = [data[i] for i in lot]
        want = clipped_reference(model, samples, expected, bound=bound)
        for r in ranks:
            assert_grads_close(r["adaptive"]["grads"][k], want, 1e-10)
        norms = [float(torch.sqrt(sum((v ** 2).sum() for v in own_grads(model, x).values())))
                 for x in samples]
        frac = sum(n <= bound for n in norms) / len(norms) if norms else 0.5
        bound = bound * math.exp(-0.7 * (frac - 0.5))
    assert all(r["adaptive"]["bound"] == pytest.approx(bound, rel=1e-12) for r in ranks)
    acc = RDPAccountant()
    for _ in range(2):
        acc.step(noise_multiplier=1.1, sample_rate=expected / len(data))
    assert all(r["epsilon"] == pytest.approx(acc.get_epsilon(delta=1e-5), rel=1e-12)
               for r in ranks)


def test_processes_other_than_ddp_refused(tmp_path, monkeypatch):
    """Several processes that are not DDP (here: the arguments made to say 2 processes that
    are not distributed, as FSDP / DeepSpeed / other launchers would differ) are refused."""
    import transformers
    from test_trainer import arguments, collate

    from gradhooks.integrations.transformers import DPConfig, DPTrainer
    args = arguments(tmp_path)
    monkeypatch.setattr(type(args), "world_size", property(lambda self: 2))
    with pytest.raises(ValueError, match="processes other than DDP"):
        DPTrainer(model=model_of(), args=args, train_dataset=dataset(), data_collator=collate,
                  dp=DPConfig(max_grad_norm=1.0, noise_multiplier=1.0))
    assert args.parallel_mode != transformers.training_args.ParallelMode.DISTRIBUTED
