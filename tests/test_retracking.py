"""A forward whose structure changes with the same input shapes (a branch on a flag, on a tensor's
value), and a parameter used outside its module only in some steps. The forward-separation
analysis (provenance) runs on each input signature's first forward and again on every
``SumCheck.EVERY``-th (100th) forward of it, on every forward with ``attach(..., check="always")``.

- A mixing op that only later forwards take is refused from the first tracked forward that
  takes it, and from then on on every forward of the signature (the verdict is kept: the
  untracked forwards may take either branch).
- Before that forward, the default policy leaves a window of at most ``SumCheck.EVERY - 1``
  forwards (the limitations page states it); ``check="always"`` has none.
- A parameter of a hooked module used outside it only in later steps is refused by the sum
  check on the first read it runs on: every read with ``check="always"``.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.core.recorder.check_policy import SumCheck

from conftest import assert_close_to_loop, loop_grads
from test_mixing import _read


class Switch(nn.Module):
    """``b(tanh(a(x)))``; with ``mix`` set, the hidden rows are centred over the batch between
    the layers (a mixing op), with ``tie`` set ``b``'s weight is also used outside ``b``."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)
        self.mix = self.tie = False

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.mix:
            h = h - h.mean(0, keepdim=True)
        out = self.b(h)
        if self.tie:
            out = out + F.linear(h * h, self.b.weight)
        return out


def _batch(b, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, 4, generator=g, dtype=torch.float64).to(dtype),
            torch.randint(0, 3, (b,), generator=g))


def _step(model, b, seed, dtype):
    x, y = _batch(b, seed, dtype)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    return x, y


@pytest.mark.parametrize("b", [1, 3], ids=["B1", "B3"])
@pytest.mark.parametrize("read", ["per_sample_grads", "norms", "clip_and_accumulate"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_check_always_refuses_a_branch_that_mixes_on_a_later_forward(dtype, read, b):
    model = Switch().to(dtype)
    with gradhooks.attach(model, check="always") as gh:
        x, y = _step(model, b, 0, dtype)  # the signature's first forward: no mixing
        ours = gh.per_sample_grads()
        assert_close_to_loop(ours, loop_grads(model, F.cross_entropy, x, y), dtype)
        model.mix = True  # same input shapes, another structure
        _step(model, b, 1, dtype)
        with pytest.raises(gradhooks.SampleMixingError) as info:
            _read(gh, read)
        message = str(info.value)
        assert "mean" in message and "test_retracking.py" in message, message


@pytest.mark.parametrize("every", [SumCheck.EVERY, 4], ids=["default", "every4"])
def test_a_later_mixing_branch_is_refused_from_the_scheduled_forward_on(every, monkeypatch):
    """Default ``check``: the forward that takes the branch first is refused when it is the
    signature's ``every``-th after its first, and every forward after it (untracked ones too,
    whichever branch they take) is refused as well."""
    monkeypatch.setattr(SumCheck, "EVERY", every)
    model = Switch().double()
    refused = []
    with gradhooks.attach(model) as gh:
        for step in range(every + 3):
            model.mix = step >= 1 and step != every + 2  # (the last forward takes the other branch)
            _step(model, 3, step, torch.float64)
            try:
                gh.per_sample_grad_norms()
            except gradhooks.SampleMixingError as e:
                assert "mean" in str(e), str(e)
                refused.append(step)
    assert refused == [every, every + 1, every + 2], refused


@pytest.mark.parametrize("b", [1, 3], ids=["B1", "B3"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_check_always_refuses_a_parameter_used_outside_its_module_from_a_later_step(dtype, b):
    """``b.weight`` used outside ``b`` from the second step on: with ``check="always"`` the
    sum check runs on every read and refuses that step, naming the parameter (by default it
    runs on each read structure once and every 100th read: the limitations page's window)."""
    model = Switch().to(dtype)
    with gradhooks.attach(model, check="always") as gh:
        x, y = _step(model, b, 0, dtype)
        ours = gh.per_sample_grads()
        assert_close_to_loop(ours, loop_grads(model, F.cross_entropy, x, y), dtype)
        model.tie = True
        _step(model, b, 1, dtype)
        with pytest.raises(gradhooks.GradientMismatchError, match="'b.weight'"):
            gh.per_sample_grads()


def test_an_empty_batch_of_a_changed_structure_reads_empty_rows():
    """B = 0 on a later forward of a tracked signature (another signature: its own first
    forward is tracked): the reads give ``(0, ...)`` per-sample gradients and no error."""
    model = Switch().double()
    with gradhooks.attach(model, check="always") as gh:
        _step(model, 3, 0, torch.float64)
        gh.per_sample_grads()
        model.tie = True
        _step(model, 0, 1, torch.float64)
        grads = gh.per_sample_grads()
    assert all(g.shape[0] == 0 for g in grads.values())
