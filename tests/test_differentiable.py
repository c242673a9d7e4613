"""Differentiable reads (``attach(..., differentiable=True)``): per-sample Jacobians with
``create_graph=True`` and per-sample gradients after ``backward(create_graph=True)`` carry the
autograd graph, so a function of them (a Jacobian penalty, a per-sample gradient norm penalty)
can be differentiated w.r.t. the parameters and the inputs. Checked against looped autograd with
``create_graph=True`` (one sample, one output at a time) in float64 and float32, at batch sizes
0, 1 and several; and the refusal for a rule without a differentiable path."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.base.errors import UnsupportedModuleError


class Tokens(nn.Module):
    """Embedding -> LayerNorm -> Linear -> tanh -> mean over tokens -> Linear."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.norm = nn.LayerNorm(4)
        self.lin = nn.Linear(4, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.lin(self.norm(self.emb(x)))).mean(1))


def _model(kind):
    if kind == "mlp":
        return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)), (3,), False
    if kind == "cnn":
        return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(),
                             nn.Linear(3 * 4 * 4, 3)), (2, 4, 4), False
    return Tokens(), (5,), True


def _inputs(kind, shape, tokens, b, dtype):
    if tokens:
        return torch.randint(0, 7, (b, *shape))
    return torch.randn(b, *shape, dtype=dtype, requires_grad=True)


def _reference_jacobians(model, params, x):
    # Looped autograd with create_graph=True, one sample and one output at a time: the plain
    # reference. (vmap(jacrev) composed with outer autograd gave a wrong second derivative
    # through nn.Embedding here, 0.0155 against 0.0392 by finite differences.)
    names = list(params)
    rows = {n: [] for n in names}
    for xi in x:
        out = model(xi.unsqueeze(0))[0]
        per = [torch.autograd.grad(o, list(params.values()), create_graph=True,
                                   allow_unused=True) for o in out]
        for i, n in enumerate(names):
            rows[n].append(torch.stack([g[i] if g[i] is not None else torch.zeros_like(params[n])
                                        for g in per]))
    return {n: torch.stack(r) if r else params[n].new_zeros((0, 3, *params[n].shape))
            for n, r in rows.items()}


TOL = {torch.float64: dict(rtol=1e-9, atol=1e-11), torch.float32: dict(rtol=2e-4, atol=1e-5)}


@pytest.mark.parametrize("b", [0, 1, 3], ids=["B0", "B1", "B3"])
@pytest.mark.parametrize("kind", ["mlp", "cnn", "tokens"])
def test_jacobians_with_create_graph_differentiate_like_a_loop(kind, b, dtype):
    torch.manual_seed(0)
    model, shape, tokens = _model(kind)
    model = model.to(dtype)
    x = _inputs(kind, shape, tokens, b, dtype)
    params = dict(model.named_parameters())
    wrt = list(params.values()) + ([] if tokens else [x])
    ref = _reference_jacobians(model, params, x)
    ref_loss = sum((j ** 2).sum() for j in ref.values()) + sum(j.sum() for j in ref.values())
    ref_grads = torch.autograd.grad(ref_loss, wrt, allow_unused=True) if b else None
    with gradhooks.attach(model, differentiable=True) as gh:
        jac = gh.per_sample_jacobians(model(x), create_graph=True)
        for n, j in jac.items():
            torch.testing.assert_close(j, ref[n], **TOL[dtype])
        if not b:
            return
        loss = sum((j ** 2).sum() for j in jac.values()) + sum(j.sum() for j in jac.values())
        assert loss.requires_grad
        ours = torch.autograd.grad(loss, wrt, allow_unused=True)
    for o, r in zip(ours, ref_grads):
        if o is None and r is None:
            continue
        torch.testing.assert_close(o if o is not None else torch.zeros_like(r),
                                   r if r is not None else torch.zeros_like(o), **TOL[dtype])


@pytest.mark.parametrize("b", [0, 1, 3], ids=["B0", "B1", "B3"])
@pytest.mark.parametrize("kind", ["mlp", "cnn", "tokens"])
def test_per_sample_grads_after_create_graph_backward_are_differentiable(kind, b, dtype):
    """A per-sample gradient-norm penalty (as in gradient-penalty and DP-aware training):
    ``sum_n ||g_n||^2`` from ``per_sample_grads()`` after ``loss.backward(create_graph=True)``,
    differentiated w.r.t. the parameters, against a loop."""
    torch.manual_seed(0)
    model, shape, tokens = _model(kind)
    model = model.to(dtype)
    x = _inputs(kind, shape, tokens, b, dtype)
    y = torch.randint(0, 3, (b,))
    params = dict(model.named_parameters())

    rows = [torch.autograd.grad(F.cross_entropy(model(xi.unsqueeze(0)), yi.unsqueeze(0)),
                                list(params.values()), create_graph=True)
            for xi, yi in zip(x, y)]  # (looped autograd: the reference)
    ref = {n: torch.stack([r[i] for r in rows]) if b else p.new_zeros((0, *p.shape))
           for i, (n, p) in enumerate(params.items())}
    ref_pen = sum((g ** 2).sum() for g in ref.values())
    with gradhooks.attach(model, loss_reduction="sum", differentiable=True) as gh:
        F.cross_entropy(model(x), y, reduction="sum").backward(create_graph=True)
        got = gh.per_sample_grads()
        for n, g in got.items():
            torch.testing.assert_close(g, ref[n], **TOL[dtype])
        if not b:
            return
        pen = sum((g ** 2).sum() for g in got.values())
        ours = torch.autograd.grad(pen, list(params.values()))
    for o, r in zip(ours, torch.autograd.grad(ref_pen, list(params.values()))):
        torch.testing.assert_close(o, r, **TOL[dtype])
    for p in model.parameters():
        p.grad = None


def test_differentiable_read_refuses_a_rule_without_a_differentiable_path():
    model = nn.Sequential(nn.LSTM(3, 4, batch_first=True))
    with gradhooks.attach(model, differentiable=True) as gh:
        out = model(torch.randn(2, 5, 3))[0]
        with pytest.raises(UnsupportedModuleError, match="'0' \\(LSTM\\).*differentiable"):
            gh.per_sample_jacobians(out[:, -1], create_graph=True)


def test_create_graph_needs_a_differentiable_attach():
    model = nn.Linear(3, 2)
    with gradhooks.attach(model) as gh:
        with pytest.raises(gradhooks.GradHooksError, match="differentiable=True"):
            gh.per_sample_jacobians(model(torch.randn(2, 3)), create_graph=True)
