"""After detach() nothing of gradhooks acts, also on graphs built before it (between forward and
backward, at the end of a `with` block, during the backward); reads after it say why."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    return model, torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))


def _plain_grads(model, x, y):
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return grads


def test_detach_between_forward_and_backward():
    model, x, y = _setup()
    expected = _plain_grads(model, x, y)
    gh = gradhooks.attach(model)
    loss = F.cross_entropy(model(x), y)
    gh.detach()
    loss.backward()  # graph built while attached: its hooks do nothing now
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, expected[n]), n
        assert not hasattr(p, "grad_sample")
    with pytest.raises(gradhooks.GradHooksError, match="detached"):
        gh.per_sample_grads()


def test_backward_after_the_with_block():
    model, x, y = _setup()
    expected = _plain_grads(model, x, y)
    with gradhooks.attach(model) as gh:
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, expected[n]), n
    with pytest.raises(gradhooks.GradHooksError, match="with gradhooks.attach"):
        gh.per_sample_grad_norms()


def test_detach_during_backward():
    model, x, y = _setup()
    expected = _plain_grads(model, x, y)
    gh = gradhooks.attach(model)
    out = model(x)
    out.register_hook(lambda g: gh.detach())  # runs first in the backward
    F.cross_entropy(out, y).backward()
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, expected[n]), n
    assert not gh.recorder.records


def test_suspended_records_nothing_and_resumes():
    """Recorder.suspended() (for benchmarks timing other methods in one process) removes the
    global module hooks and keeps the state: nothing is recorded inside, recording goes on
    after."""
    from torch.nn.modules import module as torch_module

    model, x, y = _setup()
    with gradhooks.attach(model) as gh:
        before = len(torch_module._global_forward_hooks)
        with gh.recorder.suspended():
            assert len(torch_module._global_forward_hooks) == before - 1
            F.cross_entropy(model(x), y).backward()
            assert not gh.recorder.records
        assert len(torch_module._global_forward_hooks) == before
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        ref = gradhooks.looped_per_sample_grads(model, F.cross_entropy, x, y)
        ours = gh.per_sample_grads()
        for n in ref:
            torch.testing.assert_close(ours[n], ref[n], rtol=1e-10, atol=1e-14)
