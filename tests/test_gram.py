"""Gram matrices of per-sample gradients and the empirical NTK, within a batch and between two
batches, against looped per-sample gradients / Jacobians (float64 and float32)."""
import pytest
import torch
from test_ggn import MODELS, close
from test_jacobians import TinyLM, loop_jacobians
from torch import nn

import gradhooks
from gradhooks.base.errors import GradHooksError


def loop_loss_grads(model, loss_fn, x, y):
    """(B, P) own-loss gradients, one forward and backward per sample."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(loss_fn(model(x[i:i + 1]), y[i:i + 1]), params, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).flatten()
                               for g, p in zip(grads, params)]))
    return torch.stack(rows)


CASES = dict(MODELS, lm=(TinyLM, lambda b: torch.randint(0, 7, (b, 4))))


def _loss(case):
    if case == "lm":
        return lambda out, y: nn.functional.cross_entropy(out[:, -1], y)
    return nn.CrossEntropyLoss()


@pytest.fixture(params=["by_cost", "gram_form", "matrices"])
def form(request, monkeypatch):
    """Each layer's block by the cost model, or forced into the Gram form / the per-sample
    matrices (both exact: every layer kind is checked in both)."""
    import gradhooks.readers.gram as gram_mod
    if request.param != "by_cost":
        monkeypatch.setattr(gram_mod, "gram_form_cheaper",
                            lambda *a, forced=request.param == "gram_form": forced)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", list(CASES))
def test_gram_within_and_between(case, dtype, form):
    torch.manual_seed(0)
    make, data = CASES[case]
    model = make().to(dtype)
    x1, x2 = data(4), data(3)
    if x1.is_floating_point():
        x1, x2 = x1.to(dtype), x2.to(dtype)
    classes = {"tied": 3, "lm": 7}.get(case, 4)
    y1, y2 = torch.randint(0, classes, (4,)), torch.randint(0, classes, (3,))
    loss_fn = _loss(case)
    g1, g2 = loop_loss_grads(model, loss_fn, x1, y1), loop_loss_grads(model, loss_fn, x2, y2)
    with gradhooks.attach(model) as gh:
        loss_fn(model(x1), y1).backward()
        first = gh.gradient_features()
        close(gh.gram(), g1 @ g1.t(), dtype, "within")
        model.zero_grad()
        loss_fn(model(x2), y2).backward()
        close(gh.gram(first), g2 @ g1.t(), dtype, "between")
        gh.per_sample_grads()  # still readable: the Gram kept the records


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", list(CASES))
def test_ntk(case, dtype, form):
    torch.manual_seed(0)
    make, data = CASES[case]
    model = make().to(dtype)
    x1, x2 = data(3), data(2)
    if x1.is_floating_point():
        x1, x2 = x1.to(dtype), x2.to(dtype)
    select = (lambda o: o[:, -1]) if case == "lm" else (lambda o: o)
    j1 = torch.cat([t.flatten(2) for t in loop_jacobians(model, x1, select).values()], 2)
    j2 = torch.cat([t.flatten(2) for t in loop_jacobians(model, x2, select).values()], 2)
    with gradhooks.attach(model) as gh:
        close(gh.ntk(select(model(x1))), torch.einsum("ncp,mdp->nmcd", j1, j1), dtype, "within")
        first = gh.jacobian_features(select(model(x1)))
        close(gh.ntk(select(model(x2)), first), torch.einsum("ncp,mdp->nmcd", j2, j1), dtype,
              "between")
        loss = nn.CrossEntropyLoss()(select(model(x1)), torch.zeros(3, dtype=torch.long))
        loss.backward()
        with pytest.raises(GradHooksError, match="passes"):
            gh.gram(first)
