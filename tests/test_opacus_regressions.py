"""Opacus' DP-SGD bugs as our tests.

* Opacus issue 664: the clipped sum must change with the clipping bound ``C`` where samples
  exceed it (two ``C`` on one batch give different ``.grad``), and with ``C`` above every
  per-sample norm it is the unclipped sum (autograd's gradient of the batch loss).
* Opacus issue 662: clipping under DDP must equal clipping in one process. Already covered for
  ``loss_reduction="mean"`` with noise against a looped reference by
  ``tests/test_training_setups.py::test_ddp_clipping_two_processes_gloo``; here the direct
  equality: DDP over 2 ranks with half the batch each == one process clipping the whole batch,
  float64, both reductions.
"""
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks

import two_process
from conftest import loop_grads

F64 = torch.float64
METHODS = ["ghost", "materialize", "two_pass"]


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _batch(n=8, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=g, dtype=F64), torch.randint(0, 3, (n,), generator=g)


def _clip(gh, model, x, y, c, method, reduction):
    """One step's clipped ``.grad`` ({name: tensor}) and the norms."""
    model.zero_grad(set_to_none=True)
    out = model(x)
    if method == "two_pass":
        norms = gh.clipped_backward(F.cross_entropy(out, y, reduction="none"), c)
    else:
        F.cross_entropy(out, y, reduction=reduction).backward()
        norms = gh.clip_and_accumulate(c, method=method)
    return {n: p.grad.clone() for n, p in model.named_parameters()}, norms


def _expected(ref, c, reduction):
    norms = torch.sqrt(sum(t.flatten(1).square().sum(1) for t in ref.values()))
    factors = (c / norms).clamp(max=1)
    div = len(norms) if reduction == "mean" else 1
    return {n: (t * factors.view(-1, *[1] * (t.dim() - 1))).sum(0) / div
            for n, t in ref.items()}, norms


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("method", METHODS)
def test_opacus_664_clipped_sum_changes_with_c(method, reduction):
    model = _mlp()
    x, y = _batch()
    ref = loop_grads(model, functools.partial(F.cross_entropy, reduction=reduction), x, y)
    _, norms = _expected(ref, 1.0, reduction)
    small, large = float(norms.median()), float(norms.max()) * 0.9  # both clip some samples
    with gradhooks.attach(model, loss_reduction=reduction) as gh:
        got_small, _ = _clip(gh, model, x, y, small, method, reduction)
        got_large, _ = _clip(gh, model, x, y, large, method, reduction)
    for c, got in ((small, got_small), (large, got_large)):
        want, _ = _expected(ref, c, reduction)
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-10, atol=1e-12)
    assert any(not torch.allclose(got_small[n], got_large[n], rtol=1e-6, atol=0)
               for n in got_small)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("method", METHODS)
def test_opacus_664_c_above_every_norm_is_the_unclipped_sum(method, reduction):
    model = _mlp()
    x, y = _batch()
    model.zero_grad()
    F.cross_entropy(model(x), y, reduction=reduction).backward()
    unclipped = {n: p.grad.clone() for n, p in model.named_parameters()}
    ref = loop_grads(model, functools.partial(F.cross_entropy, reduction=reduction), x, y)
    _, norms = _expected(ref, 1.0, reduction)
    with gradhooks.attach(model, loss_reduction=reduction) as gh:
        got, _ = _clip(gh, model, x, y, 10 * float(norms.max()), method, reduction)
    for n in unclipped:
        torch.testing.assert_close(got[n], unclipped[n], rtol=1e-10, atol=1e-12)


def _check_ddp_equals_one_process(reduction, rank, world):
    model = _mlp()
    single = _mlp()
    x_all, y_all = _batch(8)
    half = len(x_all) // world
    x, y = x_all[rank * half:(rank + 1) * half], y_all[rank * half:(rank + 1) * half]
    _, ref_norms = _expected(loop_grads(single, functools.partial(
        F.cross_entropy, reduction=reduction), x_all, y_all), 1.0, reduction)
    c = float(ref_norms.median())  # some samples clipped, some not
    with gradhooks.attach(single, loss_reduction=reduction) as gh:
        want, want_norms = _clip(gh, single, x_all, y_all, c, "ghost", reduction)
    ddp = nn.parallel.DistributedDataParallel(model)
    with gradhooks.attach(ddp, loss_reduction=reduction) as gh:
        for method in METHODS:
            got, norms = _clip(gh, ddp, x, y, c, method, reduction)
            torch.testing.assert_close(norms, want_norms[rank * half:(rank + 1) * half],
                                       rtol=1e-10, atol=0)
            for n in want:
                torch.testing.assert_close(got[f"module.{n}"], want[n], rtol=1e-10, atol=1e-12,
                                           msg=lambda m: f"{method} {n}: {m}")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_opacus_662_ddp_clipping_equals_one_process_two_processes_gloo(reduction):
    two_process.run(functools.partial(_check_ddp_equals_one_process, reduction))
