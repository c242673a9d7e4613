"""gradhooks.readers.distributed on its own: which ranks a model combines over, the global divisor, the
sum of per-rank tensors by placement (DDP all-reduce, FSDP2 reduce-scatter), the noise drawn
once, and KFAC's all-reduce. One process with no group, a gloo group of one process, and two
gloo processes on CPU (tests/two_process.py). The readers' results under DDP / FSDP2 are
tested in test_fsdp.py, test_kfac_distributed.py, test_accumulation.py and
test_training_setups.py."""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from gradhooks import GradHooksError
from gradhooks.readers.distributed import Ranks, is_sharded, ranks_of, ranks_of_group

import two_process


def summand(rank, shape):
    """The tensor rank ``rank`` contributes (float64, reproducible on every rank)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 + rank),
                       dtype=torch.float64)


@pytest.fixture
def one_process_group(tmp_path):
    """A gloo group of one process (a FileStore in tmp_path), destroyed afterwards."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_no_group_is_one_process():
    """Without a process group: no ranks (the readers' local path); a named group refuses."""
    assert not dist.is_initialized()
    model = nn.Linear(3, 2)
    assert ranks_of(model) is None
    assert not is_sharded(model.weight)
    with pytest.raises(GradHooksError, match="init_process_group"):
        ranks_of_group()


def test_group_of_one_process(one_process_group):
    """A world of one: a DDP model still combines nothing (None), a named group is a Ranks whose
    sums are the local tensors, divisor the local batch size."""
    model = nn.Linear(3, 2).double()
    assert ranks_of(nn.parallel.DistributedDataParallel(model)) is None
    ranks = ranks_of_group()
    assert (ranks.size, ranks.rank, ranks.sharded) == (1, 0, False)
    assert ranks.global_divisor("mean", 5) == 5.0
    assert ranks.global_divisor("sum", 5) == 1.0
    t = summand(0, (2, 3))
    expected = t.clone()
    assert ranks.sum_(model.weight, t) is t  # replicated: all-reduced in place
    torch.testing.assert_close(t, expected, rtol=0, atol=0)
    z = ranks.same_noise(model.weight, torch.Generator().manual_seed(7))
    torch.testing.assert_close(z, torch.randn(2, 3, generator=torch.Generator().manual_seed(7),
                                              dtype=torch.float64), rtol=0, atol=0)
    assert torch.equal(Ranks.zeros(model.weight), torch.zeros(2, 3, dtype=torch.float64))
    sums = [summand(0, (2, 2)), summand(1, (3,))]
    before = [s.clone() for s in sums]
    assert ranks.all_reduce_kfac(sums, [4, 1, 2], [("a", (2, 2)), ("b", (3,))]) == [4, 1, 2]
    for s, b in zip(sums, before):
        torch.testing.assert_close(s, b, rtol=0, atol=0)


def _check_ddp_and_kfac(rank, world):
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    ddp = nn.parallel.DistributedDataParallel(model)
    ranks = ranks_of(ddp)
    assert ranks is not None and not ranks.sharded
    assert (ranks.size, ranks.rank) == (world, rank)
    assert ranks.group is ddp.process_group
    assert ranks_of(model) is None  # not the DDP wrapper: nothing to combine
    # the global divisor: the ranks' batch sizes summed ("mean"), 1 without communication
    assert ranks.global_divisor("mean", [3, 4][rank]) == 7.0
    assert ranks.global_divisor("sum", [3, 4][rank]) == 1.0
    # the sum of the per-rank tensors is the manual all-reduce
    t = summand(rank, (2, 3))
    out = ranks.sum_(model.weight, t)
    assert out is t
    torch.testing.assert_close(out, summand(0, (2, 3)) + summand(1, (2, 3)), rtol=0, atol=1e-15)
    # the noise: rank 0's draw, on every rank
    z = ranks.same_noise(model.weight, torch.Generator().manual_seed(10 + rank))
    torch.testing.assert_close(z, torch.randn(2, 3, generator=torch.Generator().manual_seed(10),
                                              dtype=torch.float64), rtol=0, atol=0)
    # KFAC: every rank's sums and counts summed; the ranks must hold the same layout
    kfac = ranks_of_group()
    sums = [summand(rank, (2, 2)), summand(rank, (3,))]
    counts = kfac.all_reduce_kfac(sums, [[3, 4][rank], 5, rank], [("a", (2, 2)), ("b", (3,))])
    assert counts == [7, 10, 1]
    torch.testing.assert_close(sums[0], summand(0, (2, 2)) + summand(1, (2, 2)), rtol=0,
                               atol=1e-15)
    torch.testing.assert_close(sums[1], summand(0, (3,)) + summand(1, (3,)), rtol=0, atol=1e-15)
    with pytest.raises(GradHooksError, match="different layers"):
        kfac.all_reduce_kfac([summand(rank, (2,))], [1], [("a", (2 + rank,))])


def test_ddp_ranks_two_processes_gloo():
    """DDP: the group, the divisor, sum_ = the manual all-reduce, one noise draw, and KFAC's
    all-reduce (sums, counts, and the refusal of different layouts on every rank)."""
    two_process.run(_check_ddp_and_kfac)


def _check_fsdp(rank, world):
    torch.manual_seed(0)
    model = nn.Linear(3, 4).double()
    fully_shard(model)
    ranks = ranks_of(model)
    assert ranks is not None and ranks.sharded
    assert (ranks.size, ranks.rank) == (world, rank)
    weight = model.weight
    assert is_sharded(weight)
    assert ranks.global_divisor("mean", [2, 0][rank]) == 2.0
    # this rank's full-size summand, reduce-scattered into the weight's shards
    t = summand(rank, (4, 3))
    out = ranks.sum_(weight, t)
    assert is_sharded(out) and out.placements == weight.placements
    assert out.to_local().numel() < weight.numel()
    torch.testing.assert_close(out.full_tensor(), summand(0, (4, 3)) + summand(1, (4, 3)),
                               rtol=0, atol=1e-15)
    z = ranks.same_noise(weight, torch.Generator().manual_seed(10 + rank))
    assert is_sharded(z) and z.placements == weight.placements
    torch.testing.assert_close(z.full_tensor(), torch.randn(
        4, 3, generator=torch.Generator().manual_seed(10), dtype=torch.float64), rtol=0, atol=0)
    zeros = Ranks.zeros(weight)
    assert is_sharded(zeros) and not zeros.full_tensor().any()
    local = Ranks.zero_summand(weight)
    assert not is_sharded(local) and local.shape == weight.shape and not local.any()


def test_fsdp2_ranks_two_processes_gloo():
    """FSDP2: the mesh's group, the divisor, sum_ = a reduce-scatter into the parameter's
    shards of the ranks' summands, the noise and zeros placed like the parameter."""
    two_process.run(_check_fsdp)


def test_ranks_of_follows_first_param():
    """The placement of the first of ``params`` decides (the clipping readers pass the hooked
    parameters): plain tensors, no group -> None."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert ranks_of(model, [model[1].weight]) is None
    assert ranks_of(model, []) is None

