"""GGN square root, diagonal (batch and per sample), GGN-vector products and the empirical
Fisher diagonal against dense references: the GGN ``J^T H J`` from looped Jacobians and the
loss's Hessian w.r.t. the whole output (torch.autograd.functional.hessian), and own-loss
per-sample gradients from a loop."""
import pytest
import torch
from test_jacobians import Tied, TinyLM, _cnn, loop_jacobians
from torch import nn

import gradhooks
from gradhooks.readers.curvature.ggn import sqrt_cotangents
from gradhooks.readers.losses import LossModel

RTOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def close(ours, ref, dtype, what=""):
    scale = ref.abs().max().clamp_min(1e-30)
    diff = (ours - ref).abs().max()
    assert diff <= RTOL[dtype] * scale, f"{what}: {diff:.3e} vs {scale:.3e}"


def _flat_jac(model, x):
    jac = loop_jacobians(model, x)  # {name: (B, C, *shape)}
    return torch.cat([t.flatten(2) for t in jac.values()], 2), jac  # (B, C, P)


def reference_ggn(model, x, y, loss_fn):
    """(P, P) GGN of loss_fn(model(x), y): J^T H J with H the Hessian w.r.t. the whole output."""
    jac, _ = _flat_jac(model, x)
    with torch.no_grad():
        out = model(x)
    h = torch.autograd.functional.hessian(lambda f: loss_fn(f, y), out)
    b, c = out.shape[0], out[0].numel()
    j = jac.reshape(b * c, -1)
    return j.t() @ h.reshape(b * c, b * c) @ j


def _mlp():
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 4))


MODELS = {"mlp": (_mlp, lambda b: torch.randn(b, 5)),
          "cnn": (_cnn, lambda b: torch.randn(b, 1, 6, 6)),
          "tied": (Tied, lambda b: torch.randn(b, 4))}
LOSSES = {"ce-mean": lambda: nn.CrossEntropyLoss(), "ce-sum": lambda: nn.CrossEntropyLoss(reduction="sum"),
          "mse-mean": lambda: nn.MSELoss(), "bce-sum": lambda: nn.BCEWithLogitsLoss(reduction="sum")}


def _targets(name, out):
    if name.startswith("ce"):
        return torch.randint(0, out.shape[1], (out.shape[0],))
    return torch.rand_like(out)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("batch", [1, 4], ids=["B1", "B4"])
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("loss_name", ["ce-mean", "mse-mean"])
def test_sqrt_diag_gvp(model_name, loss_name, batch, dtype):
    torch.manual_seed(0)
    make, data = MODELS[model_name]
    model, x = make().to(dtype), data(batch).to(dtype)
    loss_fn = LOSSES[loss_name]()
    with torch.no_grad():
        y = _targets(loss_name, model(x)).to(dtype) if not loss_name.startswith("ce") else \
            _targets(loss_name, model(x))
    ggn = reference_ggn(model, x, y, loss_fn)
    names = [n for n, _ in model.named_parameters()]
    shapes = {n: p.shape for n, p in model.named_parameters()}
    v = {n: torch.randn(shapes[n], dtype=dtype) for n in names}
    with gradhooks.attach(model) as gh:
        sq = gh.ggn_sqrt(model(x), loss_fn)
        diag = gh.ggn_diag(model(x), loss_fn)
        per = gh.ggn_diag(model(x), loss_fn, per_sample=True)
        gv = gh.ggn_vector_product(model(x), loss_fn, v)
    c = model(x).shape[1]
    assert all(t.shape == (c, batch, *shapes[n]) for n, t in sq.items())
    vflat = torch.cat([t.flatten(2) for t in sq.values()], 2)  # (C, B, P)
    close(torch.einsum("cnp,cnq->pq", vflat, vflat), ggn, dtype, "V V^T")
    close(torch.cat([t.flatten() for t in diag.values()]), ggn.diagonal(), dtype, "diag")
    per_flat = torch.cat([t.flatten(1) for t in per.values()], 1)
    close(per_flat, vflat.square().sum(0), dtype, "per-sample diag")
    close(torch.cat([t.flatten() for t in gv.values()]),
          ggn @ torch.cat([t.flatten() for t in v.values()]), dtype, "GGN v")


@pytest.mark.parametrize("loss_name", ["ce-sum", "bce-sum"])
def test_other_losses(loss_name):
    torch.manual_seed(1)
    model, x = _mlp().double(), torch.randn(3, 5, dtype=torch.double)
    loss_fn = LOSSES[loss_name]()
    with torch.no_grad():
        y = _targets(loss_name, model(x))
    ggn = reference_ggn(model, x, y, loss_fn)
    with gradhooks.attach(model) as gh:
        diag = gh.ggn_diag(model(x), loss_fn)
    close(torch.cat([t.flatten() for t in diag.values()]), ggn.diagonal(), torch.float64)


def test_sequence_model_diag():
    # multi_io rules (embedding, LSTM, attention, LayerNorm) through the dense path; the last
    # position's logits as the output.
    torch.manual_seed(0)
    model = TinyLM().double()
    x = torch.randint(0, 7, (3, 4))
    loss_fn = nn.CrossEntropyLoss()
    y = torch.randint(0, 7, (3,))
    jac, _ = _flat_jac(nn.Sequential(model, _Last()), x)
    with torch.no_grad():
        out = model(x)[:, -1]
    h = torch.autograd.functional.hessian(lambda f: loss_fn(f, y), out).reshape(21, 21)
    j = jac.reshape(21, -1)
    ggn = j.t() @ h @ j
    with gradhooks.attach(model) as gh:
        diag = gh.ggn_diag(model(x)[:, -1], loss_fn)
    close(torch.cat([t.flatten() for t in diag.values()]), ggn.diagonal(), torch.float64)


class _Last(nn.Module):
    def forward(self, h):
        return h[:, -1]


def test_monte_carlo_sqrt():
    # V[m, n] = J_n^T cotangent_m (the cotangents drawn from the same generator state).
    torch.manual_seed(0)
    model, x = _mlp().double(), torch.randn(4, 5, dtype=torch.double)
    loss_fn = nn.CrossEntropyLoss()
    jac, _ = _flat_jac(model, x)
    with torch.no_grad():
        out = model(x)
    cots = torch.stack(list(sqrt_cotangents(LossModel(loss_fn, out, 4), out, 3,
                                            torch.Generator().manual_seed(5))))
    with gradhooks.attach(model) as gh:
        sq = gh.ggn_sqrt(model(x), loss_fn, mc_samples=3, generator=torch.Generator().manual_seed(5))
    vflat = torch.cat([t.flatten(2) for t in sq.values()], 2)
    close(vflat, torch.einsum("nkp,mnk->mnp", jac, cots), torch.float64)
    # many samples: the MC GGN approaches the exact one
    exact = reference_ggn(model, x, torch.zeros(4, dtype=torch.long), loss_fn)
    with gradhooks.attach(model) as gh:
        mc = gh.ggn_diag(model(x), loss_fn, mc_samples=2000, generator=torch.Generator().manual_seed(0))
    approx = torch.cat([t.flatten() for t in mc.values()])
    assert (approx - exact.diagonal()).abs().max() < 0.1 * exact.diagonal().abs().max()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_empirical_fisher_diag(model_name, reduction, dtype):
    torch.manual_seed(0)
    make, data = MODELS[model_name]
    model, x = make().to(dtype), data(5).to(dtype)
    loss_fn = nn.CrossEntropyLoss(reduction=reduction)
    y = torch.randint(0, 4 if model_name != "tied" else 3, (5,))
    params = [p for p in model.parameters()]
    ref = []
    for i in range(5):
        grads = torch.autograd.grad(loss_fn(model(x[i:i + 1]), y[i:i + 1]), params)
        ref.append(torch.cat([g.flatten() for g in grads]))
    ref = torch.stack(ref).square().sum(0) / (5 if reduction == "mean" else 1)
    with gradhooks.attach(model, loss_reduction=reduction) as gh:
        loss_fn(model(x), y).backward()
        ours = gh.empirical_fisher_diag()
        close(torch.cat([t.flatten() for t in ours.values()]), ref, dtype)
        sgs = gh.sum_grad_squared()  # the records are kept: the same numbers another way
    close(torch.cat([t.flatten() for t in sgs.values()]) / (5 if reduction == "mean" else 1),
          ref, dtype)


def test_backpack_layout():
    # The same V as BackPACK's SqrtGGNExact (same factorisation of the CE Hessian, same layout).
    import backpack
    from backpack.extensions import SqrtGGNExact
    torch.manual_seed(0)
    model, x, y = _mlp().double(), torch.randn(7, 5, dtype=torch.double), torch.randint(0, 4, (7,))
    other = backpack.extend(_mlp().double())
    other.load_state_dict(model.state_dict())
    with backpack.backpack(SqrtGGNExact()), pytest.warns(UserWarning):
        backpack.extend(nn.CrossEntropyLoss())(other(x), y).backward()
    with gradhooks.attach(model) as gh:
        ours = gh.ggn_sqrt(model(x), nn.CrossEntropyLoss())
    for name, p in other.named_parameters():
        close(ours[name], p.sqrt_ggn_exact, torch.float64, name)
