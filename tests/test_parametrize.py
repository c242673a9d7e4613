"""Parametrized layers (torch.nn.utils.parametrize: weight_norm, spectral_norm, orthogonal,
a custom parametrization): per-sample gradients of the originals by the chain rule through the
parametrization (gradhooks/rules/parametrize.py), against looped autograd."""
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize

import gradhooks
from gradhooks.base.errors import FallbackWarning
from gradhooks.rules.parametrize import ParametrizedRule

from conftest import check_against_loop


class Symmetric(nn.Module):
    """A custom parametrization: W = X + X^T (torch's parametrize tutorial)."""

    def forward(self, x):
        return x.triu() + x.triu(1).transpose(-1, -2)


def weight_norm_conv():
    # as Wav2Vec2's positional conv embedding: weight_norm over dim 2, grouped, padded
    return parametrizations.weight_norm(nn.Conv1d(4, 4, 3, padding=1, groups=2), name="weight", dim=2)


# id: (factory of the model, input shape with 0 at the batch dim)
CASES = {
    "linear-weight_norm": (lambda: nn.Sequential(parametrizations.weight_norm(nn.Linear(4, 3)), nn.Tanh()), (0, 4)),
    "linear-weight_norm-BTd": (lambda: nn.Sequential(parametrizations.weight_norm(nn.Linear(4, 3)), nn.Tanh()), (0, 5, 4)),
    "conv1d-weight_norm-dim2-groups": (lambda: nn.Sequential(weight_norm_conv(), nn.Tanh()), (0, 4, 6)),
    "conv2d-weight_norm": (lambda: nn.Sequential(parametrizations.weight_norm(nn.Conv2d(2, 3, 3)), nn.Tanh()), (0, 2, 5, 5)),
    "linear-spectral_norm-eval": (lambda: nn.Sequential(parametrizations.spectral_norm(nn.Linear(4, 3)), nn.Tanh()).eval(), (0, 4)),
    "linear-orthogonal": (lambda: nn.Sequential(parametrizations.orthogonal(nn.Linear(4, 4)), nn.Tanh()), (0, 4)),
    "linear-symmetric-custom": (lambda: nn.Sequential(sym(nn.Linear(4, 4)), nn.Tanh()), (0, 4)),
    "mlp-two-parametrized": (lambda: nn.Sequential(parametrizations.weight_norm(nn.Linear(4, 5)), nn.Tanh(),
                                                   parametrizations.orthogonal(nn.Linear(5, 5)), nn.Tanh()), (0, 4)),
    "bias-parametrized": (lambda: nn.Sequential(sym_bias(nn.Linear(4, 3)), nn.Tanh()), (0, 4)),
}


def sym(layer):
    parametrize.register_parametrization(layer, "weight", Symmetric())
    return layer


class Softplus(nn.Module):
    def forward(self, x):
        return nn.functional.softplus(x)


def sym_bias(layer):
    parametrize.register_parametrization(layer, "bias", Softplus())
    return layer


@pytest.mark.parametrize("batch", [1, 3], ids=["B1", "B3"])
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_parametrized_matches_loop(case, batch, loss_reduction, dtype):
    make, shape = case
    model = make().to(dtype)
    shape = (batch, *shape[1:])
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        ours = check_against_loop(model, torch.randn(*shape), torch.rand(batch) + 0.5,
                                  loss_reduction=loss_reduction, dtype=dtype)
    originals = [n for n, _ in model.named_parameters() if ".original" in n]
    assert originals and all(n in ours for n in originals)


def test_parametrized_layer_gets_the_wrapped_rule_and_no_list_hook():
    model = nn.Sequential(weight_norm_conv())
    with gradhooks.attach(model) as gh:
        paths = {layer.path: layer for layer in gh.recorder.layers}
    assert list(paths) == ["0"]  # the ParametrizationList is claimed, not hooked
    assert isinstance(paths["0"].rule, ParametrizedRule)
    assert set(paths["0"].params) == {"bias", "parametrizations.weight.original0",
                                      "parametrizations.weight.original1"}


def test_norms_and_clipping_of_originals():
    """Norms and ghost clipping of the originals (materialised: no linear form) equal the
    per-sample gradients' and materialised clipping."""
    model = nn.Sequential(parametrizations.weight_norm(nn.Linear(4, 5)), nn.Tanh(), nn.Linear(5, 2)).double()
    x = torch.randn(4, 4, dtype=torch.float64)
    with gradhooks.attach(model) as gh:
        (model(x) ** 2).mean().backward()
        norms = gh.per_sample_grad_norms()
        gh.clip_and_accumulate(0.1)
        ghost = [p.grad.clone() for p in model.parameters()]
        ps = gh.per_sample_grads()
    want = torch.cat([t.reshape(4, -1) for t in ps.values()], 1).norm(dim=1)
    torch.testing.assert_close(norms, want, rtol=1e-12, atol=0)
    c = (0.1 / want).clamp(max=1.0)  # (gradhooks clips by min(1, C / norm))
    for p, g, t in zip(model.parameters(), ghost, ps.values()):
        torch.testing.assert_close(g, torch.tensordot(c, t, 1) / 4, rtol=1e-10, atol=1e-14)
