"""DP clipping of a model sharded by FSDP2 (``torch.distributed.fsdp.fully_shard``), 2 gloo
processes on CPU: every rank's gradient shards are those of the clipped, noised mean over the
ranks' concatenated batch, computed in one process from a looped reference (float64).

Checked: two-pass clipping (``clipped_backward``: its second pass is an ordinary backward, so
FSDP's reduce-scatter sums the clipped gradients), book-keeping clipping after
``loss.backward()``, flat and group-wise (per-layer bounds), each with unequal local batches
and with one rank's local batch empty (its reduce-scatters must still run). Per-sample norms
need no communication: FSDP gathers each layer whole for its forward and backward, so each rank
records whole layers for its own samples.
"""
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

import gradhooks

import two_process
from conftest import loop_grads

SIGMA = 0.7
LAYERS = ("0", "2", "4")


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 6), nn.Tanh(),
                         nn.Linear(6, 3)).double()


def batches(sizes):
    out = []
    for r, b in enumerate(sizes):
        g = torch.Generator().manual_seed(300 + r)
        out.append((torch.randn(b, 5, generator=g, dtype=torch.float64),
                    torch.randint(0, 3, (b,), generator=g)))
    return out


def expected_grads(ref, groups, bounds):
    """``(sum_n sum_k min(1, C_k / ||g_n,k||) g_n,k + sigma C z) / N`` from the looped
    per-sample gradients ``ref`` of the concatenated batch, ``C = sqrt(sum_k C_k^2)``, ``z``
    drawn parameter by parameter from ``Generator().manual_seed(5)``."""
    n = len(next(iter(ref.values())))
    gen = torch.Generator().manual_seed(5)
    c_total = sum(b * b for b in bounds) ** 0.5
    out = {}
    for names, bound in zip(groups, bounds):
        norms = torch.sqrt(sum(ref[m].flatten(1).square().sum(1) for m in names))
        for m in names:
            out[m] = (ref[m] * (bound / norms).clamp(max=1).view(-1, *[1] * (ref[m].dim() - 1))).sum(0)
    for m in ref:  # the noise in named_parameters() order
        out[m] = (out[m] + SIGMA * c_total * torch.randn(ref[m].shape[1:], generator=gen,
                                                         dtype=torch.float64)) / n
    return out


class Conv1D(nn.Module):
    """transformers' GPT-2 ``Conv1D`` (``x @ weight + bias``, weight ``(in, out)``), by name:
    :mod:`gradhooks.rules.known` recognises it by its class name and a probe forward."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out, dtype=torch.float64))
        self.bias = nn.Parameter(torch.randn(n_out, dtype=torch.float64))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(
            *x.shape[:-1], -1)


def _probe_of_sharded_layer():
    """A known layer sharded by FSDP2 is recognised: its probe runs on the gathered parameters
    (on the DTensor shards it failed, and the layer fell back to a replay that fails too)."""
    from gradhooks.rules.known import recognise_known
    from gradhooks.rules.linear import TransposedLinearRule
    torch.manual_seed(0)
    block = fully_shard(nn.Sequential(Conv1D(6, 4), nn.Tanh()))  # (as GPT2Block holds Conv1D)
    conv = block[0]
    assert conv.weight.to_local().numel() < conv.weight.numel()  # sharded
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no FallbackWarning)
        assert isinstance(recognise_known(conv, "conv"), TransposedLinearRule)


def _check(sizes, rank, world):
    _probe_of_sharded_layer()
    model = mlp()
    for name in LAYERS:
        fully_shard(model.get_submodule(name))
    fully_shard(model)
    data = batches(sizes)
    x_all, y_all = torch.cat([b[0] for b in data]), torch.cat([b[1] for b in data])
    ref = loop_grads(mlp(), F.cross_entropy, x_all, y_all)
    flat_norms = torch.sqrt(sum(t.flatten(1).square().sum(1) for t in ref.values()))
    c = float(flat_norms.median())
    per_layer = [[f"{m}.weight", f"{m}.bias"] for m in LAYERS]
    bounds = [float(torch.sqrt(sum(ref[m].flatten(1).square().sum(1) for m in g)).median())
              for g in per_layer]
    flat = expected_grads(ref, [list(ref)], [c])
    grouped = expected_grads(ref, per_layer, bounds)
    x, y = data[rank]
    with gradhooks.attach(model, check=False) as gh:
        for method in ("two_pass", "ghost", "ghost_per_layer", "materialize_per_layer"):
            model.zero_grad()
            out = model(x)
            noise = torch.Generator().manual_seed(5)
            if method == "two_pass":
                gh.clipped_backward(F.cross_entropy(out, y, reduction="none"), c,
                                    noise_multiplier=SIGMA, generator=noise)
                expected = flat
            else:
                F.cross_entropy(out, y).backward()
                kind, _, grouping = method.partition("_")
                per = grouping == "per_layer"
                gh.clip_and_accumulate(bounds if per else c, method=kind, noise_multiplier=SIGMA,
                                       generator=noise, groups=per_layer if per else None)
                expected = grouped if per else flat
            for name, p in model.named_parameters():
                assert p.grad.to_local().numel() < p.numel()  # a shard, not the whole gradient
                torch.testing.assert_close(p.grad.full_tensor(), expected[name], rtol=1e-10,
                                           atol=1e-12, msg=lambda m: f"{method} {name}: {m}")
    # With the sum check on, clipping says to attach with check=False (it would otherwise report
    # every sharded parameter as missing its gradient).
    with gradhooks.attach(model) as gh:
        F.cross_entropy(model(x), y).backward()
        with pytest.raises(gradhooks.GradHooksError, match="check=False"):
            gh.clip_and_accumulate(c)


@pytest.mark.parametrize("sizes", [(3, 4), (4, 0)], ids=["unequal", "one-empty"])
def test_fsdp2_clipping_two_processes_gloo(sizes):
    """Also: with the sum check on, clipping refuses and says to attach with check=False; a
    known layer (transformers' Conv1D) sharded by FSDP2 is recognised by its probe."""
    two_process.run(functools.partial(_check, sizes))
