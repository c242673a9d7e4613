"""KFAC factors, sum of squared gradients and variance against definitions built by looped autograd.

The reference (``_gather`` / ``_reference``) runs the model on one sample at a time, records
every Linear/Conv call's input and the gradient its output receives, gets convolution patches
as the Jacobian of the output w.r.t. the weight (not by unfolding), and forms ``A`` and ``G``
from the formulas of the issue with explicit sums of outer products.
"""
import math
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks import (
    BatchSizeError,
    GradHooksError,
    GradientMismatchError,
    HigherOrderGradError,
    KFACFactors,
    NoBackwardError,
    UnsupportedLossError,
    kfac,
)

from conftest import RTOL, loop_grads

KFAC_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
ERRORS = {}  # largest relative factor error per (layer kind, dtype), printed at the end


def _rel(ours, ref):
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def _record(kind, dtype, err):
    ERRORS[(kind, dtype)] = max(ERRORS.get((kind, dtype), 0.0), err)




@pytest.fixture(scope="module", autouse=True)
def _report_errors():
    yield
    for (kind, dtype), err in sorted(ERRORS.items(), key=str):
        print(f"\nlargest relative factor error: {kind:>9} {dtype}: {err:.2e}", end="")


# --------------------------------------------------------------------------- reference
def _gather(model, x, y, loss_fn, fisher, batch_first=True):
    """Per sample: {module name: [(input of the call, [grad_output for each vector])]}.

    ``fisher="empirical"``: the vector is the gradient of the sample's own loss (a batch of one);
    ``"type-2"``: the columns ``V sqrt(lambda)`` of the eigendecomposition of the Hessian of the
    sample's loss w.r.t. the model output (autograd), backpropagated one by one.
    """
    layers = {n: m for n, m in model.named_modules() if isinstance(m, KFAC_LAYERS)}
    bdim = 0 if batch_first or x.dim() < 3 else 1
    samples = []
    for n in range(x.shape[bdim]):
        records = []  # (name, input, output, grads) in forward order
        handles = [m.register_forward_hook(
            lambda mod, inp, out, name=name: records.append((name, inp[0].detach(), out, [])))
            for name, m in layers.items()]
        f = model(x.narrow(bdim, n, 1))
        for h in handles:
            h.remove()
        yn = y[n:n + 1]
        if fisher == "empirical":
            vecs = [torch.autograd.grad(loss_fn(f, yn), f, retain_graph=True)[0]]
        else:
            hess = torch.autograd.functional.hessian(lambda z: loss_fn(z, yn), f.detach())
            lam, vec = torch.linalg.eigh(hess.reshape(f.numel(), f.numel()))
            vecs = [(vec[:, k] * lam[k].clamp(min=0).sqrt()).reshape(f.shape)
                    for k in range(len(lam))]
        for v in vecs:
            grads = torch.autograd.grad(f, [r[2] for r in records], v, retain_graph=True)
            for r, g in zip(records, grads):
                r[3].append(g)
        calls = {name: [] for name in layers}
        for name, a, _, gs in records:
            calls[name].append((a, gs))
        samples.append(calls)
    return layers, samples


def _patches(module, a):
    """Per group, the inputs (R, I) of one call of one sample at every output position.

    Linear: the input rows. Convolution: the patch at output position s is d y[o, s] / d W[o]
    (Jacobian of the convolution w.r.t. its weight), o the first output channel of the group.
    """
    if isinstance(module, nn.Linear):
        return [a.reshape(-1, a.shape[-1])]
    jac = torch.func.jacrev(lambda w: module._conv_forward(a, w, None))(module.weight.detach())
    c_out, per = module.out_channels, module.out_channels // module.groups
    jac = jac.reshape(c_out, -1, c_out, module.weight[0].numel())  # (o, s, o', c k)
    return [jac[o, :, o, :] for o in range(0, c_out, per)]


def _out_rows(module, g):
    """Per group, the grad_output (R, O) of one call of one sample at every output position."""
    if isinstance(module, nn.Linear):
        return [g.reshape(-1, g.shape[-1])]
    per = module.out_channels // module.groups
    rows = g.reshape(module.out_channels, -1)
    return [rows[o:o + per].T for o in range(0, module.out_channels, per)]


def _reference(module, samples_calls, approx, w, bias):
    """A, G of one module from the definitions (sums of outer products), stacked over groups."""
    groups = getattr(module, "groups", 1)
    # per sample, per group: inputs (R, I') and per vector output grads (R, O), R = all positions
    per_sample = []
    for calls in samples_calls:
        patches = [_patches(module, a) for a, _ in calls]
        rows = [torch.cat([p[grp] for p in patches]) for grp in range(groups)]
        if bias:
            rows = [torch.cat([r, torch.ones(len(r), 1, dtype=r.dtype)], 1) for r in rows]
        outs = [[torch.cat([_out_rows(module, gs[j])[grp] for _, gs in calls])
                 for grp in range(groups)] for j in range(len(calls[0][1]))]
        per_sample.append((rows, outs))
    a_out, g_out = [], []
    for grp in range(groups):
        a_fac, g_fac, count = 0.0, 0.0, 0
        for rows, outs in per_sample:
            if approx == "expand":
                for r in rows[grp]:
                    a_fac = a_fac + torch.outer(r, r)
                    count += 1
                for e in outs:
                    for r in e[grp]:
                        g_fac = g_fac + torch.outer(r, r)
            else:
                mean = rows[grp].mean(0)
                a_fac = a_fac + torch.outer(mean, mean)
                count += 1
                for e in outs:
                    total = e[grp].sum(0)
                    g_fac = g_fac + torch.outer(total, total)
        a_out.append(a_fac / count)
        g_out.append(g_fac * w)
    if groups == 1:
        return a_out[0], g_out[0]
    return torch.stack(a_out), torch.stack(g_out)


def _check(results, model, x, y, make_loss, fisher, dtype, batch_first=True, kind=None):
    """Compare ``results`` ``{(approx, reduction): factors}`` with the looped definition.

    The gathered per-sample inputs / output gradients do not depend on the approximation; for
    cross-entropy they do not depend on the reduction either (a batch of one reduces the same),
    so they are gathered once; MSE / BCE with 'mean' also average over the outputs."""
    gathered = {}
    for (approx, reduction), ours in results.items():
        key = None if make_loss is nn.CrossEntropyLoss else reduction
        if key not in gathered:
            gathered[key] = _gather(model, x, y, make_loss(reduction=reduction), fisher, batch_first)
        layers, samples = gathered[key]
        n = len(samples)
        w = 1.0 / n if reduction == "mean" else 1.0
        assert list(ours) == list(layers), (list(ours), list(layers))
        for name, module in layers.items():
            f = ours[name]
            assert isinstance(f, KFACFactors) and f.module == name and f.kfac_approx == approx
            bias = module.bias is not None
            assert f.params == tuple(f"{name}.{p}" for p in ("weight", "bias")
                                     if getattr(module, p) is not None)
            a_ref, g_ref = _reference(module, [s[name] for s in samples], approx, w, bias)
            assert f.A.shape == a_ref.shape and f.G.shape == g_ref.shape, name
            assert f.A.dtype == dtype and f.G.dtype == dtype
            for ours_t, ref_t, which in ((f.A, a_ref, "A"), (f.G, g_ref, "G")):
                err = _rel(ours_t, ref_t)
                _record(kind or type(module).__name__, str(dtype).replace("torch.", ""), err)
                assert err <= RTOL[dtype], f"{approx} {reduction} {name}.{which}: rel err {err:.3e}"


def _all_options(model, x, y, make_loss, fisher, batch_first=True, approxes=("expand", "reduce"),
                 reductions=("mean", "sum")):
    return {(ap, red): kfac(model, x, y, make_loss(reduction=red), fisher=fisher, kfac_approx=ap,
                            batch_first=batch_first)
            for ap in approxes for red in reductions}


# --------------------------------------------------------------------------- models
class SeqFirst(nn.Module):
    """A Linear on (T, B, in) inputs (batch_first=False), then a head on (B, T * hidden)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.head = nn.Linear(9, 3)

    def forward(self, x):
        h = torch.tanh(self.lin(x))  # (T, B, 3)
        return self.head(h.transpose(0, 1).flatten(1))


class CalledTwice(nn.Module):
    """One Linear called on two slices with different numbers of positions (2 and 3)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.head = nn.Linear(15, 3)

    def forward(self, x):
        h = torch.cat([self.lin(x[:, :2]), torch.sin(self.lin(x[:, 2:] * 2))], 1)
        return self.head(torch.tanh(h).flatten(1))


def _head(body, features):
    return nn.Sequential(body, nn.Tanh(), nn.Flatten(), nn.Linear(features, 3))


# name: (model builder, input shape without batch, batch_first)
CONFIGS = {
    "linear2d": (lambda: _head(nn.Linear(5, 4), 4), (5,), True),
    "linear2d-nobias": (lambda: _head(nn.Linear(5, 4, bias=False), 4), (5,), True),
    "linear3d": (lambda: _head(nn.Linear(5, 4), 12), (3, 5), True),
    "linear4d-nobias": (lambda: _head(nn.Linear(5, 4, bias=False), 16), (2, 2, 5), True),
    "linear-batch-second": (SeqFirst, (3, None, 4), False),
    "linear-called-twice": (CalledTwice, (5, 4), True),
    "conv1d-stride-pad": (lambda: _head(nn.Conv1d(2, 3, 3, stride=2, padding=1), 12), (2, 7), True),
    "conv2d-groups-dilation-nobias": (
        lambda: _head(nn.Conv2d(4, 6, 2, dilation=2, groups=2, bias=False), 6 * 3 * 2),
        (4, 5, 4), True),
    "conv2d-same-reflect": (
        lambda: _head(nn.Conv2d(2, 3, (3, 2), padding="same", padding_mode="reflect"), 3 * 4 * 3),
        (2, 4, 3), True),
    "conv2d-depthwise-stride": (
        lambda: _head(nn.Conv2d(3, 3, 3, stride=2, groups=3), 3 * 2 * 2), (3, 5, 5), True),
    "conv3d-stride-pad": (
        lambda: _head(nn.Conv3d(2, 2, 2, stride=(1, 2, 1), padding=1), 2 * 4 * 2 * 3),
        (2, 3, 2, 2), True),
}


def _inputs(shape, batch, dtype):
    if None in shape:  # (T, B, in)
        return torch.randn(*[batch if s is None else s for s in shape], dtype=dtype)
    return torch.randn(batch, *shape, dtype=dtype)


def _build(config, batch, dtype):
    make, shape, batch_first = CONFIGS[config]
    model = make().to(dtype)
    x = _inputs(shape, batch, dtype)
    y = torch.randint(0, 3, (batch,))
    return model, x, y, batch_first


# --------------------------------------------------------------------------- brute force
def _kind(config):
    return "Linear" if config.startswith("linear") else config.split("-")[0].capitalize()


@pytest.mark.parametrize("fisher", ["empirical", "type-2"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_factors_match_definition(config, fisher):
    """Every layer type and option, cross-entropy, float64, expand and reduce, mean and sum:
    A and G equal the definitions."""
    model, x, y, batch_first = _build(config, 3, torch.float64)
    results = _all_options(model, x, y, nn.CrossEntropyLoss, fisher, batch_first)
    _check(results, model, x, y, nn.CrossEntropyLoss, fisher, torch.float64, batch_first, _kind(config))


@pytest.mark.parametrize("batch", [1, 4], ids=["B1", "B4"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_factors_float32(config, batch):
    """float32 within 1e-5 of the float32 definition (empirical, expand, mean)."""
    model, x, y, batch_first = _build(config, batch, torch.float32)
    results = _all_options(model, x, y, nn.CrossEntropyLoss, "empirical", batch_first,
                           ("expand",), ("mean",))
    _check(results, model, x, y, nn.CrossEntropyLoss, "empirical", torch.float32, batch_first,
           _kind(config))


LOSSES = {
    "ce": (nn.CrossEntropyLoss, lambda b: torch.randint(0, 3, (b,))),
    "mse": (nn.MSELoss, lambda b: torch.randn(b, 3, dtype=torch.float64)),
    "bce": (nn.BCEWithLogitsLoss, lambda b: torch.rand(b, 3, dtype=torch.float64)),
}


@pytest.mark.parametrize("batch", [1, 4], ids=["B1", "B4"])
@pytest.mark.parametrize("fisher", ["empirical", "type-2"])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_losses_match_definition(loss, fisher, batch):
    """CE / MSE / BCEWithLogits with mean and sum: the Hessian (type-2) and the per-sample loss
    scale (MSE / BCE 'mean' also average over the 3 outputs) are those of the user's loss."""
    make, targets = LOSSES[loss]
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(batch, 4, dtype=torch.float64), targets(batch)
    results = _all_options(model, x, y, make, fisher, approxes=("expand",))
    _check(results, model, x, y, make, fisher, torch.float64)


def test_kfac_factors_after_plain_backward_equals_empirical():
    """gh.kfac_factors() after the training loss.backward() is kfac(fisher='empirical')."""
    model, x, y, _ = _build("conv2d-groups-dilation-nobias", 3, torch.float64)
    with gradhooks.attach(model) as gh:
        F.cross_entropy(model(x), y).backward()
        ours = gh.kfac_factors("reduce")
    ref = kfac(model, x, y, nn.CrossEntropyLoss(), kfac_approx="reduce")
    for name in ref:
        assert torch.equal(ours[name].A, ref[name].A) and torch.equal(ours[name].G, ref[name].G)


# --------------------------------------------------------------------------- exact cases
def _flat_grad(model, names):
    params = dict(model.named_parameters())
    return torch.cat([params[n].grad.reshape(-1) for n in names])


def _group_mask(f):
    """(P, P) True where two entries of the parameters belong to the same group."""
    labels = {}
    per = f.G.shape[-1]
    if f.weight is not None:
        rows = torch.arange(f.weight_shape[0]) // per
        labels[f.weight] = rows.reshape(-1, *[1] * (len(f.weight_shape) - 1)).expand(f.weight_shape)
    if f.bias is not None:
        labels[f.bias] = torch.arange(per * f.groups) // per
    flat = torch.cat([labels[n].reshape(-1) for n in f.params])
    return flat[:, None] == flat[None, :]


@pytest.mark.parametrize("layer", [
    pytest.param(lambda: nn.Linear(4, 3), id="linear"),
    pytest.param(lambda: nn.Linear(4, 3, bias=False), id="linear-nobias"),
    pytest.param(lambda: nn.Conv2d(4, 6, (3, 2)), id="conv2d-full-kernel"),
    pytest.param(lambda: nn.Conv2d(4, 6, (3, 2), groups=2), id="conv2d-groups-full-kernel"),
])
def test_exact_single_sample(layer, loss_reduction):
    """One sample, no weight sharing (a convolution whose kernel covers its input): A ⊗ G is
    the outer product of the gradient, the exact empirical Fisher (for groups: its blocks within
    a group; one factor pair per group keeps no cross-group block)."""
    model = layer().double()
    shape = (1, 4) if isinstance(model, nn.Linear) else (1, 4, 3, 2)
    x = torch.randn(*shape, dtype=torch.float64)
    with gradhooks.attach(model, loss_reduction=loss_reduction) as gh:
        (model(x) ** 3).sum().backward()  # B = 1: 'mean' and 'sum' reduce the same
        f = gh.kfac_factors()[""]
    grad = _flat_grad(model, f.params)
    exact = torch.outer(grad, grad) * _group_mask(f)
    err = _rel(f.dense(), exact)
    _record("exact EF", "float64", err)
    assert err <= 1e-12


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_exact_copies_of_one_sample(approx, loss_reduction):
    """N copies of one sample: A ⊗ G equals the empirical Fisher w sum_n g_n g_n^T of the
    looped per-sample gradients (N g g^T for 'sum', g g^T for 'mean')."""
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x = torch.randn(1, 4, dtype=torch.float64).expand(6, 4)
    y = torch.tensor([2] * 6)
    factors = kfac(model, x, y, nn.CrossEntropyLoss(reduction=loss_reduction), kfac_approx=approx)
    per = loop_grads(model, nn.CrossEntropyLoss(), x, y)
    w = 1 / 6 if loss_reduction == "mean" else 1.0
    for name, f in factors.items():
        g = torch.cat([per[p].flatten(1) for p in f.params], 1)  # (N, P)
        exact = w * g.T @ g
        err = _rel(f.dense(), exact)
        _record("exact EF", "float64", err)
        assert err <= 1e-12, name


@pytest.mark.parametrize("depth", [1, 2], ids=["linear", "linear-linear"])
def test_type2_equals_ggn_of_linear_model_with_mse(depth, loss_reduction):
    """Linear model, MSE: the GGN's diagonal blocks are exactly Kronecker; type-2 KFAC equals
    them (GGN = J^T H J with J from torch.func.jacrev and H the autograd Hessian w.r.t. the
    outputs of the batch loss)."""
    layers = [nn.Linear(4, 3)] + [nn.Linear(3, 2)] * (depth - 1)
    model = nn.Sequential(*layers).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    y = torch.randn(5, layers[-1].out_features, dtype=torch.float64)
    loss_fn = nn.MSELoss(reduction=loss_reduction)
    factors = kfac(model, x, y, loss_fn, fisher="type-2")
    params = dict(model.named_parameters())
    out = model(x).detach()
    hess = torch.autograd.functional.hessian(lambda z: loss_fn(z, y), out).reshape(out.numel(), -1)
    for name, f in factors.items():
        def fn(*ps):
            out = torch.func.functional_call(model, {**params, **dict(zip(f.params, ps))}, (x,))
            return out.reshape(-1)
        jac = torch.func.jacrev(fn, argnums=tuple(range(len(f.params))))(*[params[p] for p in f.params])
        jac = torch.cat([j.reshape(out.numel(), -1) for j in jac], 1)
        ggn = jac.T @ hess @ jac
        err = _rel(f.dense(), ggn)
        _record("GGN", "float64", err)
        assert err <= 1e-12, name


# --------------------------------------------------------------------------- Monte-Carlo
MC_TOL = 0.06  # rel. Frobenius error of G at 4000 samples: measured 0.003-0.028 (8 seeds x 3 losses)


@pytest.mark.parametrize("loss", list(LOSSES))
def test_mc_converges_to_type2(loss):
    """MC Fisher factors approach the type-2 ones: the relative Frobenius error of G decays
    like 1/sqrt(mc_samples). Statistical test with generator seed 0: at 4000 samples the error
    must be below MC_TOL (twice the largest of 24 measured draws), and at 10 samples more than
    twice the error at 4000 (MSE / BCE with 'mean' also check the sqrt(D) rescaling)."""
    make, targets = LOSSES[loss]
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(4, 4, dtype=torch.float64), targets(4)
    loss_fn = make(reduction="mean")
    exact = kfac(model, x, y, loss_fn, fisher="type-2")
    errs = {}
    for m in (10, 4000):
        mc = kfac(model, x, y, loss_fn, fisher="mc", mc_samples=m,
                  generator=torch.Generator().manual_seed(0))
        errs[m] = max(((mc[k].G - exact[k].G).norm() / exact[k].G.norm()).item() for k in exact)
        for k in exact:
            assert torch.equal(mc[k].A, exact[k].A)
    assert errs[4000] <= MC_TOL, errs
    assert errs[10] > 2 * errs[4000], errs


def test_mc_reproducible_with_generator():
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    run = lambda seed: kfac(model, x, y, nn.CrossEntropyLoss(), fisher="mc", mc_samples=2,  # noqa: E731
                            generator=torch.Generator().manual_seed(seed))
    a, b, c = run(1), run(1), run(2)
    assert all(torch.equal(a[k].G, b[k].G) for k in a)
    assert not all(torch.equal(a[k].G, c[k].G) for k in a)


# --------------------------------------------------------------------------- several passes
@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_backward_passes_accumulate(approx):
    """Two backward passes through one forward (retain_graph): G is the sum of the passes'
    G (or their mean with backward_passes='mean'); A is unchanged."""
    model, x, y, _ = _build("linear-called-twice", 3, torch.float64)
    w = torch.rand(3, dtype=torch.float64)
    losses = [lambda out: F.cross_entropy(out, y, reduction="sum"),  # (loss_reduction="sum")
              lambda out: (w[:, None] * out ** 2).sum()]
    single = []
    for loss in losses:
        with gradhooks.attach(model, loss_reduction="sum") as gh:
            loss(model(x)).backward()
            single.append(gh.kfac_factors(approx))
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        out = model(x)
        losses[0](out).backward(retain_graph=True)
        losses[1](out).backward()
        both, mean = gh.kfac_factors(approx), gh.kfac_factors(approx, backward_passes="mean")
    for k in both:
        assert torch.allclose(both[k].A, single[0][k].A, rtol=1e-13, atol=0)
        assert torch.allclose(both[k].G, single[0][k].G + single[1][k].G, rtol=1e-12, atol=0)
        assert torch.allclose(mean[k].G, both[k].G / 2, rtol=1e-13, atol=0)


# --------------------------------------------------------------------------- options, layout
def test_bias_only_and_max_dense_and_modules():
    model, x, y, _ = _build("conv2d-depthwise-stride", 3, torch.float64)
    full = kfac(model, x, y, nn.CrossEntropyLoss())
    diag = kfac(model, x, y, nn.CrossEntropyLoss(), max_dense=4)
    assert diag["0"].diagonal_A and diag["0"].diagonal_G is False  # A: 9+1 > 4, G: 1
    assert diag["3"].diagonal_A and not diag["3"].diagonal_G  # A: 13 > 4, G: 3
    for k in full:
        a = full[k].A.diagonal(dim1=-2, dim2=-1) if diag[k].diagonal_A else full[k].A
        assert torch.allclose(diag[k].A, a, rtol=1e-13, atol=0)
        assert torch.allclose(diag[k].dense().diagonal(), full[k].dense().diagonal(), rtol=1e-13, atol=0)
    only = kfac(model, x, y, nn.CrossEntropyLoss(), modules=["3"])
    assert list(only) == ["3"] and torch.equal(only["3"].G, full["3"].G)
    model[0].weight.requires_grad_(False)
    bias_only = kfac(model, x, y, nn.CrossEntropyLoss())["0"]
    assert bias_only.params == ("0.bias",) and bias_only.weight is None
    assert torch.equal(bias_only.A, torch.ones(3, 1, 1, dtype=torch.float64))
    assert torch.allclose(bias_only.G, full["0"].G, rtol=1e-13, atol=0)


def test_grad_matrix_split_roundtrip_and_kfac_step():
    """grad_matrix / split invert each other; G^-1 V A^-1 solves the dense KFAC system."""
    model, x, y, _ = _build("conv2d-groups-dilation-nobias", 3, torch.float64)
    model[3].weight.data.normal_()
    factors = kfac(model, x, y, nn.CrossEntropyLoss(), fisher="type-2")
    grads = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    for f in factors.values():
        mat = f.grad_matrix(grads)
        back = f.split(mat)
        assert all(torch.equal(back[n], grads[n]) for n in f.params)
        damp = 1e-3 * torch.eye(f.A.shape[-1], dtype=torch.float64)
        dgg = 1e-3 * torch.eye(f.G.shape[-1], dtype=torch.float64)
        step = torch.linalg.solve(f.G + dgg, mat) @ torch.linalg.inv(f.A + damp)
        damped = KFACFactors(f.A + damp, f.G + dgg, f.module, f.weight, f.bias, f.weight_shape,
                             f.groups)
        dense = damped.dense()
        flat = torch.cat([grads[n].reshape(-1) for n in f.params])
        want = torch.linalg.solve(dense, flat)
        got = torch.cat([t.reshape(-1) for t in f.split(step).values()])
        assert _rel(got, want) <= 1e-9
    assert "A=(2, 8, 8)" in repr(factors["0"])


def test_autocast_bfloat16_computes_in_float32(device):
    model, x, y, _ = _build("conv2d-same-reflect", 4, torch.float32)
    model, x, y = model.to(device), x.to(device), y.to(device)
    ref = kfac(model, x, y, nn.CrossEntropyLoss())
    with torch.autocast(device.type, dtype=torch.bfloat16):
        low = kfac(model, x, y, nn.CrossEntropyLoss())
    for k in ref:
        assert low[k].A.dtype == torch.float32 and low[k].G.dtype == torch.float32
        assert _rel(low[k].A, ref[k].A) < 5e-2 and _rel(low[k].G, ref[k].G) < 1e-1


# --------------------------------------------------------------------------- errors
def test_unsupported_losses():
    model = nn.Linear(3, 2)
    x, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    bad = [
        (nn.L1Loss(), "supports nn.CrossEntropyLoss"),
        (F.cross_entropy, "supports nn.CrossEntropyLoss"),
        (nn.CrossEntropyLoss(reduction="none"), "reduction='none'"),
        (nn.CrossEntropyLoss(weight=torch.ones(2)), "weight"),
        (nn.BCEWithLogitsLoss(pos_weight=torch.ones(2)), "pos_weight"),
        (nn.CrossEntropyLoss(label_smoothing=0.1), "label_smoothing"),
    ]
    for loss_fn, match in bad:
        with pytest.raises(UnsupportedLossError, match=match):
            kfac(model, x, y, loss_fn)
    with pytest.raises(UnsupportedLossError, match="ignore_index"):
        kfac(model, x, torch.tensor([0, 1, -100, 1]), nn.CrossEntropyLoss())


def test_cross_entropy_needs_batch_by_classes_output():
    model = nn.Conv1d(2, 3, 1)  # output (B, C, L)
    with pytest.raises(UnsupportedLossError, match=r"shape \(B, C\)"):
        kfac(model, torch.randn(4, 2, 5), torch.randint(0, 3, (4, 5)), nn.CrossEntropyLoss())

    class Transposed(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x):
            return self.lin(x).T  # (C, B)

    with pytest.raises(BatchSizeError, match="batched on dim 0"):
        kfac(Transposed(), torch.randn(5, 3), torch.randint(0, 2, (5,)), nn.CrossEntropyLoss())


def test_bad_options():
    model, x, y = nn.Linear(3, 2), torch.randn(4, 3), torch.randint(0, 2, (4,))
    loss_fn = nn.CrossEntropyLoss()
    with pytest.raises(ValueError, match="fisher must be one of"):
        kfac(model, x, y, loss_fn, fisher="exact")
    with pytest.raises(ValueError, match="kfac_approx must be one of"):
        kfac(model, x, y, loss_fn, kfac_approx="full")
    with pytest.raises(ValueError, match="mc_samples must be a positive int"):
        kfac(model, x, y, loss_fn, fisher="mc", mc_samples=0)
    with pytest.raises(ValueError, match="only meaningful for fisher='mc'"):
        kfac(model, x, y, loss_fn, mc_samples=3)
    with pytest.raises(ValueError, match="not hooked layers of the model"):
        kfac(model, x, y, loss_fn, modules=["fc9"])
    with pytest.raises(GradHooksError, match="initialised torch.distributed"):
        kfac(model, x, y, loss_fn, all_reduce=True)
    with gradhooks.attach(model) as gh:
        loss_fn(model(x), y).backward()
        with pytest.raises(ValueError, match="backward_passes"):
            gh.kfac_factors(backward_passes="max")
        with pytest.raises(ValueError, match="max_dense"):
            gh.kfac_factors(max_dense=0)


def test_kfac_factors_before_backward():
    model = nn.Linear(3, 2)
    with gradhooks.attach(model) as gh:
        with pytest.raises(NoBackwardError, match="before kfac_factors"):
            gh.kfac_factors()
        model(torch.randn(4, 3))
        with pytest.raises(NoBackwardError):
            gh.kfac_factors()
        with pytest.raises(NoBackwardError):
            gh.sum_grad_squared()


def test_kfac_factors_refuses_modified_input_and_create_graph():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    with gradhooks.attach(model) as gh:
        x = torch.randn(4, 3)
        model(x).sum().backward()
        x.mul_(2)  # e.g. the input buffer refilled with the next batch before reading the factors
        with pytest.raises(GradientMismatchError, match="modified in place"):
            gh.kfac_factors()
    with gradhooks.attach(model) as gh:
        x = torch.randn(4, 3, requires_grad=True)
        (gx,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
        gx.pow(2).sum().backward()
        with pytest.raises(HigherOrderGradError):
            gh.kfac_factors()


# --------------------------------------------------------------------------- first-order stats
@pytest.mark.parametrize("batch", [1, 5], ids=["B1", "B5"])
@pytest.mark.parametrize("model_kind", ["mlp", "cnn"])
def test_sum_grad_squared_and_variance_match_loop(model_kind, batch, loss_reduction, dtype):
    """sum_n g_n^2 and 1/N sum_n (g_n - mean)^2 of the own-loss per-sample gradients g_n."""
    if model_kind == "mlp":
        model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(dtype)
        x = torch.randn(batch, 4, dtype=dtype)
    else:
        model = _head(nn.Conv2d(2, 3, 3, padding=1, groups=1), 3 * 4 * 4).to(dtype)
        x = torch.randn(batch, 2, 4, 4, dtype=dtype)
    y = torch.randint(0, 3, (batch,))
    per = loop_grads(model, nn.CrossEntropyLoss(), x, y)
    with gradhooks.attach(model, loss_reduction=loss_reduction) as gh:
        F.cross_entropy(model(x), y, reduction=loss_reduction).backward()
        sgs, var = gh.sum_grad_squared(), gh.variance()
    assert list(sgs) == list(per) == list(var)
    for n, g in per.items():
        want_sgs = (g ** 2).sum(0)
        want_var = ((g - g.mean(0)) ** 2).sum(0) / batch
        assert sgs[n].shape == g.shape[1:] and var[n].shape == g.shape[1:]
        assert (sgs[n] - want_sgs).abs().max() <= RTOL[dtype] * want_sgs.abs().max()
        if batch == 1:
            assert torch.count_nonzero(var[n]) == 0
        else:
            assert (var[n] - want_var).abs().max() <= RTOL[dtype] * want_var.abs().max()


# --------------------------------------------------------------------------- the example
def test_kfac_optimizer_example_runs(tmp_path):
    script = pathlib.Path(__file__).resolve().parent.parent / "examples" / "kfac_optimizer.py"
    png = tmp_path / "curves.png"
    done = subprocess.run([sys.executable, str(script), "--steps", "4", "--eval-every", "2",
                           "--batch", "16", "--train-size", "64", "--threads", "1", "--out", str(png)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| optimizer"))
    rows = [line for line in lines[header + 2:header + 5]]
    assert [r.split("|")[1].strip().split()[0] for r in rows] == ["SGD", "Adam", "KFAC"], done.stdout
    for r in rows:
        cells = [c.strip() for c in r.split("|")[1:-1]]
        assert cells[1] == "4" and math.isfinite(float(cells[3])) and 0 <= float(cells[4]) <= 1, r


# --------------------------------------------------------------------------- every layer with a rule
class Unrolled(nn.Module):
    """A one-layer LSTM / GRU / RNN (tanh) written with two nn.Linear: ``ih`` on every step at
    once, ``hh`` called once per step; the same weights as ``rnn``. Its Linear factors (checked
    against the definitions above) are what the recurrent rule's parts must give."""

    def __init__(self, rnn):
        super().__init__()
        self.mode = rnn.mode
        gh, hidden = rnn.weight_ih_l0.shape[0], rnn.hidden_size
        self.ih, self.hh = nn.Linear(rnn.input_size, gh), nn.Linear(hidden, gh)
        with torch.no_grad():
            for lin, kind in ((self.ih, "ih"), (self.hh, "hh")):
                lin.weight.copy_(getattr(rnn, f"weight_{kind}_l0"))
                lin.bias.copy_(getattr(rnn, f"bias_{kind}_l0"))

    def forward(self, x, h0):
        pre, h, c, out = self.ih(x), h0[0], torch.zeros_like(h0[0]), []
        for t in range(x.shape[1]):
            gi, gh = pre[:, t], self.hh(h)
            if self.mode == "LSTM":
                i, f, g, o = (gi + gh).chunk(4, -1)
                c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h = torch.sigmoid(o) * torch.tanh(c)
            elif self.mode == "GRU":
                (ir, iz, i_n), (hr, hz, hn) = gi.chunk(3, -1), gh.chunk(3, -1)
                r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
                h = (1 - z) * torch.tanh(i_n + r * hn) + z * h
            else:
                h = torch.tanh(gi + gh)
            out.append(h)
        return torch.stack(out, 1)


class RNNModel(nn.Module):
    def __init__(self, make, steps=3):
        super().__init__()
        self.rnn, self.head = make(), nn.Linear(steps * 4, 3)

    def forward(self, x):
        # (made from x, so the unrolled reference's first hh call computes from the batch: a
        # state made from sizes alone is a shared call, recorded as B identical samples,
        # whose factors count every row for every sample; gradhooks.core.analysis.provenance)
        h0 = torch.linspace(-1, 1, 4, dtype=x.dtype) + 0 * x[None, :, :1, 0]
        if isinstance(self.rnn, Unrolled):
            h = self.rnn(x, h0)
        elif self.rnn.mode == "LSTM":
            h = self.rnn(x, (h0, torch.zeros_like(h0)))[0]
        else:
            h = self.rnn(x, h0)[0]
        return self.head(torch.tanh(h).flatten(1))


RNNS = {"lstm": lambda: nn.LSTM(3, 4, batch_first=True),
        "gru": lambda: nn.GRU(3, 4, batch_first=True),
        "rnn": lambda: nn.RNN(3, 4, batch_first=True)}


@pytest.mark.parametrize("fisher", ["empirical", "type-2"])
@pytest.mark.parametrize("mode", list(RNNS))
def test_recurrent_parts_equal_unrolled_linear_layers(mode, fisher, dtype):
    """Each recurrent weight with its bias is a Linear layer with the time steps as shared
    positions (Martens, Ba & Johnson 2018): its factors equal those of the unrolled model's
    ``ih`` / ``hh`` Linear (expand and reduce, mean and sum, B = 0, 1, 4)."""
    torch.manual_seed(0)
    model = RNNModel(RNNS[mode]).to(dtype)
    ref_model = RNNModel(lambda: Unrolled(model.rnn)).to(dtype)
    ref_model.head.load_state_dict(model.head.state_dict())
    for batch in (1, 4):
        x, y = torch.randn(batch, 3, 3, dtype=dtype), torch.randint(0, 3, (batch,))
        for (ap, red), ours in _all_options(model, x, y, nn.CrossEntropyLoss, fisher).items():
            ref = kfac(ref_model, x, y, nn.CrossEntropyLoss(reduction=red), fisher=fisher,
                       kfac_approx=ap)
            assert list(ours) == ["rnn.weight_ih_l0", "rnn.weight_hh_l0", "head"]
            for kind in ("ih", "hh"):
                f, r = ours[f"rnn.weight_{kind}_l0"], ref[f"rnn.{kind}"]
                assert f.params == (f"rnn.weight_{kind}_l0", f"rnn.bias_{kind}_l0")
                for t, u in ((f.A, r.A), (f.G, r.G)):
                    err = _rel(t, u)
                    _record(f"{mode}", str(dtype).replace("torch.", ""), err)
                    assert err <= RTOL[dtype], (ap, red, kind, err)


class Attention(nn.Module):
    """MultiheadAttention, self- or cross-attention, packed or separate projections; and its
    reference written with nn.Linear projections and scaled_dot_product_attention."""

    def __init__(self, cross, kdim=None, reference=None):
        super().__init__()
        self.cross, self.reference = cross, reference is not None
        if reference is None:
            self.att = nn.MultiheadAttention(4, 2, batch_first=True, kdim=kdim, vdim=kdim)
        else:
            att, e = reference.att, 4
            self.q, self.k, self.v = (nn.Linear(e if i == 0 else (kdim or e), e) for i in range(3))
            self.out = nn.Linear(e, e)
            with torch.no_grad():
                ws = ([att.q_proj_weight, att.k_proj_weight, att.v_proj_weight]
                      if att.in_proj_weight is None else att.in_proj_weight.chunk(3))
                for lin, w, b in zip((self.q, self.k, self.v), ws, att.in_proj_bias.chunk(3)):
                    lin.weight.copy_(w)
                    lin.bias.copy_(b)
                self.out.load_state_dict(att.out_proj.state_dict())
        self.head = nn.Linear(3 * 4, 3)

    def forward(self, x):
        q, kv = x[:, :3, :4], (x[:, 3:, :] if self.cross else x[:, :3, :4])
        if not self.reference:
            h = self.att(q, kv, kv, need_weights=False)[0]
        else:
            split = lambda t: t.unflatten(-1, (2, 2)).transpose(1, 2)  # noqa: E731
            c = F.scaled_dot_product_attention(split(self.q(q)), split(self.k(kv)), split(self.v(kv)))
            h = self.out(c.transpose(1, 2).flatten(2))
        return self.head(torch.tanh(h).flatten(1))


@pytest.mark.parametrize("case", ["self-packed", "cross-packed", "cross-separate"])
def test_attention_parts_equal_linear_projections(case, dtype):
    """The projections of MultiheadAttention are Linear layers on the tokens: packed
    self-attention one block of 3E rows (G over q, k, v together), cross-attention three groups
    (q from the query, k and v from the key), separate weights one entry each and in_proj_bias
    alone; out_proj as a Linear. Compared with the factors of explicit nn.Linear projections."""
    torch.manual_seed(0)
    cross, kdim = case.startswith("cross"), (5 if case.endswith("separate") else None)
    model = Attention(cross, kdim).to(dtype)
    ref_model = Attention(cross, kdim, reference=model).to(dtype)
    ref_model.head.load_state_dict(model.head.state_dict())
    x = torch.randn(3, 5, kdim or 4, dtype=dtype) if cross else torch.randn(3, 3, 4, dtype=dtype)
    if cross and kdim is None:
        x = torch.randn(3, 5, 4, dtype=dtype)
    y = torch.randint(0, 3, (3,))
    for ap in ("expand", "reduce"):
        ours = kfac(model, x, y, nn.CrossEntropyLoss(), fisher="type-2", kfac_approx=ap)
        ref = kfac(ref_model, x, y, nn.CrossEntropyLoss(), fisher="type-2", kfac_approx=ap)
        out = ours["att.out_proj.weight"]
        pairs = [(out.A, ref["out"].A), (out.G, ref["out"].G)]
        if case == "self-packed":
            f = ours["att.in_proj_weight"]
            assert f.groups == 1 and f.G.shape == (12, 12)
            pairs += [(f.A, ref["q"].A), (f.A, ref["k"].A)]
            gq = f.G[:4, :4], f.G[4:8, 4:8], f.G[8:, 8:]
            pairs += [(g, ref[n].G) for g, n in zip(gq, "qkv")]
        elif case == "cross-packed":
            f = ours["att.in_proj_weight"]
            assert f.groups == 3
            pairs += [(f.A[i], ref[n].A) for i, n in enumerate("qkv")]
            pairs += [(f.G[i], ref[n].G) for i, n in enumerate("qkv")]
        else:
            for n in "qkv":
                f = ours[f"att.{n}_proj_weight"]
                assert f.bias is None
                pairs += [(f.A, ref[n].A[:-1, :-1]), (f.G, ref[n].G)]
            b = ours["att.in_proj_bias"]
            assert b.weight is None and b.groups == 3
            pairs += [(b.G[i], ref[n].G) for i, n in enumerate("qkv")]
        # the keys' gradients sum to zero over the key positions (softmax is shift invariant),
        # so reduce's G of k is zero up to rounding: errors relative to out_proj's G
        floor = ref["out"].G.abs().max()
        for t, u in pairs:
            assert t.shape == u.shape
            err = ((t - u).abs().max() / torch.maximum(u.abs().max(), floor)).item()
            _record("MHA", str(dtype).replace("torch.", ""), err)
            assert err <= RTOL[dtype], (case, ap, err)


def _one_hot_linear(emb):
    """The Linear layer on one-hot inputs that an Embedding is (zero input at padding_idx)."""
    lin = nn.Linear(emb.num_embeddings, emb.embedding_dim, bias=False)
    with torch.no_grad():
        lin.weight.copy_(emb.weight.t())
    pad = emb.padding_idx

    def forward(x):
        hot = F.one_hot(x, emb.num_embeddings).to(lin.weight.dtype)
        if pad is not None:
            hot = hot * (x != pad).unsqueeze(-1)
        return lin(hot)
    return lin, forward


class EmbModel(nn.Module):
    def __init__(self, emb, one_hot=False):
        super().__init__()
        self.emb, self.head = emb, nn.Linear(4 * 4, 3)
        self.lin, self.lookup = _one_hot_linear(emb) if one_hot else (None, emb)

    def forward(self, x):
        return self.head(torch.tanh(self.lookup(x)).flatten(1))


@pytest.mark.parametrize("padding_idx", [None, 2], ids=["nopad", "pad"])
def test_embedding_equals_one_hot_linear(padding_idx, dtype):
    """nn.Embedding is a Linear layer without bias on one-hot inputs (zero at padding_idx):
    its factors equal that Linear's (A diagonal for expand: the index counts), B = 1, 5; and
    zeros for B = 0."""
    torch.manual_seed(0)
    model = EmbModel(nn.Embedding(6, 4, padding_idx=padding_idx)).to(dtype)
    ref_model = EmbModel(model.emb, one_hot=True).to(dtype)
    ref_model.head.load_state_dict(model.head.state_dict())
    with gradhooks.attach(model, loss_reduction="sum") as gh:  # B = 0: zeros, not 0/0
        model(torch.randint(0, 6, (0, 4))).sum().backward()
        for ap in ("expand", "reduce"):
            f = gh.kfac_factors(ap)["emb"]
            a = torch.diag_embed(f.A) if f.diagonal_A else f.A
            assert a.shape == (6, 6) and f.G.shape == (4, 4) and not a.any() and not f.G.any()
    for batch in (1, 5):
        x, y = torch.randint(0, 6, (batch, 4)), torch.randint(0, 3, (batch,))
        for fisher in ("empirical", "type-2"):
            for (ap, red), ours in _all_options(model, x, y, nn.CrossEntropyLoss, fisher).items():
                ref = kfac(ref_model, x, y, nn.CrossEntropyLoss(reduction=red), fisher=fisher,
                           kfac_approx=ap)
                f, r = ours["emb"], ref["lin"]
                assert f.weight_transposed and f.params == ("emb.weight",)
                assert f.diagonal_A == (ap == "expand")
                a = torch.diag_embed(f.A) if f.diagonal_A else f.A
                for t, u in ((a, r.A), (f.G, r.G)):
                    err = _rel(t, u)
                    _record("Embedding", str(dtype).replace("torch.", ""), err)
                    assert err <= RTOL[dtype], (batch, fisher, ap, red, err)
                # dense() in the embedding's own (V, D) layout is the Linear's block transposed
                perm = torch.arange(24).reshape(4, 6).t().reshape(-1)
                assert _rel(f.dense(), r.dense()[perm][:, perm]) <= RTOL[dtype]


def _ct_patches(module, a):
    """Per group, the inputs (P, C_in/G * K) of a transposed convolution at each output
    position: d y[o, p] / d W[:, o] (the Jacobian w.r.t. the weight), o the group's first."""
    conv_t = getattr(F, f"conv_transpose{len(module.kernel_size)}d")
    fn = lambda w: conv_t(a, w, None, module.stride, module.padding,  # noqa: E731
                          module.output_padding, module.groups, module.dilation)
    jac = torch.func.jacrev(fn)(module.weight.detach())  # (1, C_out, *Y, C_in, C_out/G, *K)
    c_out, per_out = module.out_channels, module.out_channels // module.groups
    c_in, per_in = module.in_channels, module.in_channels // module.groups
    jac = jac.reshape(c_out, -1, c_in, per_out, math.prod(module.kernel_size))
    return [jac[o, :, (o // per_out) * per_in:(o // per_out + 1) * per_in, o % per_out].reshape(jac.shape[1], -1)
            for o in range(0, c_out, per_out)]


CT_CONFIGS = {
    "convtranspose1d-stride-pad-outpad": (lambda: nn.ConvTranspose1d(2, 3, 3, stride=2, padding=1,
                                                                     output_padding=1), (2, 4)),
    "convtranspose2d-groups-dilation": (lambda: nn.ConvTranspose2d(4, 2, 2, groups=2, dilation=2,
                                                                   bias=False), (4, 2, 3)),
    "convtranspose3d-stride": (lambda: nn.ConvTranspose3d(2, 2, 2, stride=(1, 2, 1)), (2, 2, 2, 1)),
}


@pytest.mark.parametrize("fisher", ["empirical", "type-2"])
@pytest.mark.parametrize("config", list(CT_CONFIGS))
def test_conv_transpose_matches_definition(config, fisher, dtype, monkeypatch):
    """ConvTranspose1d/2d/3d: A from the inputs each output position sees (the Jacobian of the
    output w.r.t. the weight, not the rule's patches), G from the grad_outputs, as for Conv."""
    torch.manual_seed(0)
    make, shape = CT_CONFIGS[config]
    layer = make()
    out_numel = layer(torch.randn(1, *shape))[0].numel()
    model = _head(layer, out_numel).to(dtype)
    x, y = torch.randn(3, *shape, dtype=dtype), torch.randint(0, 3, (3,))
    monkeypatch.setattr(sys.modules[__name__], "KFAC_LAYERS", KFAC_LAYERS + (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d))
    orig = _patches
    monkeypatch.setattr(sys.modules[__name__], "_patches",
                        lambda m, a: _ct_patches(m, a) if "Transpose" in type(m).__name__ else orig(m, a))
    _check(_all_options(model, x, y, nn.CrossEntropyLoss, fisher), model, x, y,
           nn.CrossEntropyLoss, fisher, dtype, kind="ConvT")
    f = kfac(model, x, y, nn.CrossEntropyLoss())["0"]
    grads = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    assert all(torch.equal(t, grads[n]) for n, t in f.split(f.grad_matrix(grads)).items())


@pytest.mark.parametrize("layer", [
    pytest.param(lambda: nn.Embedding(5, 3), id="embedding"),
    pytest.param(lambda: nn.ConvTranspose2d(3, 4, 1), id="convtranspose-1x1"),
    pytest.param(lambda: nn.LSTM(3, 4, batch_first=True), id="lstm-one-step"),
    pytest.param(lambda: nn.GRUCell(3, 4), id="grucell"),
    pytest.param(lambda: nn.MultiheadAttention(4, 2, batch_first=True), id="attention-one-token"),
])
def test_exact_single_sample_every_layer(layer, loss_reduction):
    """One sample, one position: every Kronecker block equals the outer product of its
    parameters' gradient (the exact empirical Fisher)."""
    torch.manual_seed(0)
    module = layer().double()
    if isinstance(module, nn.Embedding):
        x, call = torch.tensor([[3]]), lambda m, x: m(x)
    elif isinstance(module, nn.ConvTranspose2d):
        x, call = torch.randn(1, 3, 1, 1, dtype=torch.float64), lambda m, x: m(x)
    elif isinstance(module, nn.LSTM):
        h0 = (torch.randn(1, 1, 4, dtype=torch.float64), torch.randn(1, 1, 4, dtype=torch.float64))
        x, call = torch.randn(1, 1, 3, dtype=torch.float64), lambda m, x: m(x, h0)[0]
    elif isinstance(module, nn.GRUCell):
        h0 = torch.randn(1, 4, dtype=torch.float64)
        x, call = torch.randn(1, 3, dtype=torch.float64), lambda m, x: m(x, h0)
    else:
        x, call = torch.randn(1, 1, 4, dtype=torch.float64), lambda m, x: m(x, x, x)[0]
    with gradhooks.attach(module, loss_reduction=loss_reduction) as gh:
        (call(module, x) ** 3).sum().backward()
        factors = gh.kfac_factors()
    for key, f in factors.items():
        grad = _flat_grad(module, f.params)
        exact = torch.outer(grad, grad)
        if f.groups > 1:
            exact = exact * _group_mask(f)
        err = _rel(f.dense(), exact)
        _record("exact EF", "float64", err)
        assert err <= 1e-12, key


class NormModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.norm = nn.Linear(4, 5), nn.LayerNorm(5)
        self.prelu, self.head = nn.PReLU(5), nn.Linear(5, 3)

    def forward(self, x):
        h = self.norm(self.lin(x))
        return self.head(self.prelu(h + self.norm(h)))  # norm called twice: grads sum per sample


@pytest.mark.filterwarnings("ignore::gradhooks.FallbackWarning")
@pytest.mark.parametrize("batch", [0, 1, 4], ids=["B0", "B1", "B4"])
def test_diagonal_blocks_match_loop(batch, loss_reduction, dtype):
    """Layers without a Kronecker form (LayerNorm called twice, the fallback's PReLU) get the
    diagonal w sum_n g_n^2 of the looped per-sample gradients (empirical), and the GGN diagonal
    sum_n diag(J_n^T H_n J_n) (type-2, J_n by torch.func.jacrev per sample)."""
    torch.manual_seed(0)
    model = NormModel().to(dtype)
    x, y = torch.randn(batch, 4, dtype=dtype), torch.randint(0, 3, (batch,))
    loss_fn = nn.CrossEntropyLoss(reduction=loss_reduction)
    if batch == 0:  # (gradhooks.kfac's loss model needs a sample): the records' reader, zeros
        with gradhooks.attach(model, loss_reduction="sum") as gh:
            model(x).sum().backward()
            d = gh.kfac_factors()["norm"].diagonal
        assert d["norm.weight"].shape == (5,) and not any(t.any() for t in d.values())
        return
    w = 1.0 / batch if loss_reduction == "mean" else 1.0
    names = ["norm.weight", "norm.bias", "prelu.weight"]
    params = dict(model.named_parameters())
    want_ef = {n: torch.zeros_like(params[n]) for n in names}
    want_ggn = {n: torch.zeros_like(params[n]) for n in names}
    for i in range(batch):
        xi, yi = x[i:i + 1], y[i:i + 1]
        gs = torch.autograd.grad(F.cross_entropy(model(xi), yi), [params[n] for n in names])
        out = lambda *ps: torch.func.functional_call(model, {**params, **dict(zip(names, ps))}, (xi,))[0]  # noqa: E731
        jac = torch.func.jacrev(out, argnums=(0, 1, 2))(*[params[n] for n in names])
        f = model(xi)[0].detach()
        hess = torch.autograd.functional.hessian(lambda z: F.cross_entropy(z[None], yi), f)
        for n, g, j in zip(names, gs, jac):
            want_ef[n] += w * g ** 2
            j = j.reshape(3, -1)
            want_ggn[n] += w * torch.einsum("cp,cd,dp->p", j, hess, j).reshape(params[n].shape)
    for fisher, want in (("empirical", want_ef), ("type-2", want_ggn)):
        ours = kfac(model, x, y, loss_fn, fisher=fisher)
        assert list(ours) == ["lin", "norm", "prelu", "head"]
        assert isinstance(ours["norm"], gradhooks.DiagonalFactors)
        got = {**ours["norm"].diagonal, **ours["prelu"].diagonal}
        for n in names:
            assert got[n].shape == params[n].shape and got[n].dtype == dtype
            scale = want[n].abs().max().clamp_min(1e-30)
            err = ((got[n] - want[n]).abs().max() / scale).item()
            _record("diagonal", str(dtype).replace("torch.", ""), err)
            assert err <= RTOL[dtype], (fisher, n, err)
        d = ours["norm"]
        assert torch.equal(d.dense().diagonal(), torch.cat([got["norm.weight"], got["norm.bias"]]))


def test_several_passes_need_the_pass_by_pass_reader():
    """kfac_factors() after two backward passes through a model with an Embedding (whose records
    sum the passes) refuses, naming the module; gradhooks.kfac(type-2) reads pass by pass."""
    model = EmbModel(nn.Embedding(6, 4))
    x = torch.randint(0, 6, (3, 4))
    with gradhooks.attach(model) as gh:
        out = model(x)
        out.sum().backward(retain_graph=True)
        out.pow(2).sum().backward()
        with pytest.raises(GradHooksError, match=r"'emb' \(Embedding\).*gradhooks.kfac"):
            gh.kfac_factors()


def test_kfac_optimizer_example_steps_with_diagonal_blocks():
    """The example's KFAC optimizer preconditions a LayerNorm (a diagonal block, DiagonalFactors)
    beside the Linear layers' Kronecker factors: the LayerNorm's update is its gradient over
    (diagonal + damping), and training goes down."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "kfac_optimizer.py"
    spec = importlib.util.spec_from_file_location("kfac_optimizer_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3)).double()
    x, y = torch.randn(32, 4, dtype=torch.float64), torch.randint(0, 3, (32,))
    opt = example.KFAC(model, lr=0.05, factor_every=1, inv_every=1, momentum=0.0,
                       fisher="empirical", generator=torch.Generator().manual_seed(0))
    try:
        before = model[1].weight.detach().clone()
        first = opt.step(x, y)
        diag = opt.factors["1"]
        assert isinstance(diag, gradhooks.DiagonalFactors) and "1" in opt.diagonal
        want = before - 0.05 * model[1].weight.grad / (diag.diagonal["1.weight"] + opt.damping)
        torch.testing.assert_close(model[1].weight.detach(), want, rtol=1e-12, atol=1e-14)
        for _ in range(20):
            last = opt.step(x, y)
        assert last < first
    finally:
        opt.gh.detach()
