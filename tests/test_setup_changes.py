"""A model that changes after attach is followed at its next forward: a submodule replaced, a
parameter set (peft's lazy materialisation did this to Opacus users, opacus#820), a frozen
parameter unfrozen. A read between such a change and the next forward is refused."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks

from conftest import assert_close_to_loop, loop_grads

F64 = torch.float64


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 3)).double()


def _step(model, gh, x, y):
    F.cross_entropy(model(x), y).backward()
    return gh.per_sample_grads()


@pytest.mark.parametrize("change", ["replace_submodule", "set_parameter", "unfreeze",
                                    "freeze", "add_submodule"])
def test_change_after_attach_is_followed(change):
    model = _model()
    x, y = torch.randn(5, 4, dtype=F64), torch.randint(0, 3, (5,))
    if change == "unfreeze":
        model[2].weight.requires_grad_(False)
    with gradhooks.attach(model) as gh:
        _step(model, gh, x, y)
        if change == "replace_submodule":
            model[2] = nn.Linear(8, 8).double()
        elif change == "set_parameter":
            model[0].weight = nn.Parameter(torch.randn(8, 4, dtype=F64))
        elif change == "unfreeze":
            model[2].weight.requires_grad_(True)
        elif change == "freeze":
            model[4].bias.requires_grad_(False)
        else:
            model[3] = nn.Sequential(nn.Linear(8, 8), nn.Tanh()).double()
        ours = _step(model, gh, x, y)
        ref = loop_grads(model, F.cross_entropy, x, y)
        assert_close_to_loop(ours, ref, F64)
        norms = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in ref.values()))
        F.cross_entropy(model(x), y).backward()
        torch.testing.assert_close(gh.per_sample_grad_norms(), norms, rtol=1e-10, atol=0)
    for m in model.modules():  # detach leaves no hook, also on the new modules
        assert not m._forward_hooks and not m._forward_pre_hooks


def test_change_between_forward_and_read_is_refused():
    model = _model()
    x, y = torch.randn(5, 4, dtype=F64), torch.randint(0, 3, (5,))
    with gradhooks.attach(model) as gh:
        F.cross_entropy(model(x), y).backward()
        model[4].weight = nn.Parameter(torch.randn(3, 8, dtype=F64))
        with pytest.raises(gradhooks.GradHooksError, match="changed after its forward.*weight"):
            gh.per_sample_grads()
        assert_close_to_loop(_step(model, gh, x, y), loop_grads(model, F.cross_entropy, x, y), F64)


def test_changes_to_other_models_are_ignored():
    model, other = _model(), _model()
    x, y = torch.randn(5, 4, dtype=F64), torch.randint(0, 3, (5,))
    with gradhooks.attach(model) as gh:
        F.cross_entropy(model(x), y).backward()
        other[0] = nn.Linear(4, 8)
        assert gh.per_sample_grads()["0.weight"].shape == (5, 8, 4)
