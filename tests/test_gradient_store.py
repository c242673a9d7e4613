"""The projected gradient store (gradhooks.readers.attribution.gradient_store) and what goes into it
(gradhooks.readers.attribution.output_functions): rows against per-sample gradients from a float64 loop
projected by the same matrices (P_g [dW_n db_n] P_a^T for linear layers, R vec(d theta_n) for
the others), in batches of 0, 1 and several samples; resuming; spec errors; float16; TRAK's
margin and out-to-loss weights; LESS's Adam transform against a real optimizer state; scores."""
import math
import sys

import numpy as np
import pytest
import torch
from test_ggn import close
from test_gram import CASES, _loss
from torch import nn

import gradhooks
from gradhooks.base.errors import GradHooksError
from gradhooks.readers.attribution.gradient_store import GradientStore, StoreSpecError
from gradhooks.readers.attribution.output_functions import (
    AdamDirection,
    Identity,
    margin_output,
    project_batch,
    trak_margins,
    trak_out_to_loss,
)
from gradhooks.readers.attribution.projections import project_features, projection

from conftest import loop_grads

KI, KO, SEED = 3, 2, 7


class Conv1D(nn.Module):
    """transformers' Conv1D (GPT-2): ``y = x @ W + b``, weight stored ``(in, out)``; recognised
    by name (gradhooks.rules.known), so the test needs no transformers import."""

    def __init__(self, nx, nf):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.2)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], self.nf)


def layouts():
    """Every layout of ``[W b]``: grouped conv, transposed weight (Conv1D), no bias, a bias
    alone (frozen weight), and a dense parameter (LayerNorm)."""
    model = nn.Sequential(nn.Conv2d(2, 4, 3, groups=2), nn.ReLU(), nn.Flatten(), Conv1D(64, 6),
                          nn.Tanh(), nn.Linear(6, 5, bias=False), nn.LayerNorm(5), nn.Linear(5, 3))
    model[7].weight.requires_grad_(False)
    return model


ALL = dict(CASES, layouts=(layouts, lambda b: torch.randn(b, 2, 6, 6)))
N_CLASSES = {"tied": 3, "lm": 7, "layouts": 3}


def _setup(case, dtype, n=5, seed=0):
    torch.manual_seed(seed)
    make, data = ALL[case]
    model = make().to(dtype)
    x = data(n)
    x = x.to(dtype) if x.is_floating_point() else x
    y = torch.randint(0, N_CLASSES.get(case, 4), (n,))
    return model, x, y


def _loader(x, y, sizes):
    out, lo = [], 0
    for b in sizes:
        out.append((x[lo:lo + b], y[lo:lo + b]))
        lo += b
    assert lo == x.shape[0]
    return out


def _losses(case):
    # per-sample losses (B,): each sample's own loss
    fn = _loss(case)

    def losses(model, batch):
        out, y = model(batch[0]), batch[1]
        return torch.stack([fn(out[i:i + 1], y[i:i + 1]) for i in range(out.shape[0])])
    return losses


def _matrix(model, path, ref):
    """The looped per-sample gradient of a linear layer as the (N, G, O, I') matrices [W b]."""
    m = model.get_submodule(path)
    key = f"{path}." if path else ""
    parts = []
    groups = getattr(m, "groups", 1)
    if m.weight.requires_grad:
        w = ref[f"{key}weight"]
        if isinstance(m, Conv1D):
            w = w.transpose(1, 2)
        parts.append(w.reshape(w.shape[0], groups, w.shape[1] // groups, -1))
    if m.bias is not None and m.bias.requires_grad:
        b = ref[f"{key}bias"]
        parts.append(b.reshape(b.shape[0], groups, -1, 1))
    return torch.cat(parts, -1)


def _reference(model, feats, ref, transform=lambda key, t: t):
    """(N, K) projections of the looped gradients, in the store's column order."""
    parts = []
    for path in feats.linear:
        mat = transform(path, _matrix(model, path, ref))  # (N, G, O, I')
        pa = projection(path, "a", KI, mat.shape[-1], SEED, mat.dtype)
        pg = projection(path, "g", KO, mat.shape[-2], SEED, mat.dtype)
        parts.append((pg @ mat @ pa.t()).flatten(1))
    for name in feats.dense:
        flat = transform(name, ref[name]).flatten(1)
        parts.append(flat @ projection(name, "dense", KI * KO, flat.shape[1], SEED, flat.dtype).t())
    return torch.cat(parts, 1)


def _features(model, x, y, case, reduction="mean"):
    with gradhooks.attach(model, loss_reduction=reduction) as gh:
        gh.backward(_loss(case)(model(x), y) * (x.shape[0] if reduction == "sum" else 1))
        return gh.gradient_features()


SIZES = {"B5": [5], "B1": [1] * 5, "B2-0-3": [2, 0, 3]}


@pytest.mark.parametrize("sizes", list(SIZES))
@pytest.mark.parametrize("case", list(ALL))
def test_store_rows_match_projected_loop(case, sizes, tmp_path):
    model, x, y = _setup(case, torch.float64)
    ref = loop_grads(model, _loss(case), x, y)
    feats = _features(model, x, y, case)
    expected = _reference(model, feats, ref)
    store = GradientStore(tmp_path / "s", 5, k_in=KI, k_out=KO, seed=SEED, dtype=torch.float32)
    with gradhooks.attach(model) as gh:
        store.fill(gh, _loader(x, y, SIZES[sizes]), _losses(case), progress=False)
        # float64 projections of one batch (before the float32 storage): tight
        gh.backward(_loss(case)(model(x), y))
        ours = store.project(gh.gradient_features())
    close(ours, expected, torch.float64, "project() vs loop")
    assert store.complete and store.rows == 5 and store.dim == expected.shape[1]
    close(store.features(dtype=torch.float64), expected, torch.float32, "stored rows vs loop")
    assert np.load(tmp_path / "s" / "grads.npy").shape == (5, expected.shape[1])  # a plain .npy


@pytest.mark.parametrize("case", list(ALL))
def test_factored_and_materialised_equal_project_features(case):
    """The transform path (per-sample matrices) with the identity equals the factored LoGra
    form, which equals project_features / gh.projected_grads."""
    model, x, y = _setup(case, torch.float64, n=4)
    feats = _features(model, x, y, case)
    plain = project_features(feats, KI, KO, SEED)
    close(project_batch(feats, KI, KO, SEED), plain, torch.float64, "factored")
    close(project_batch(feats, KI, KO, SEED, transform=Identity(), model=model, chunk_numel=7),
          plain, torch.float64, "materialised, chunked")


def _fill(path, model, x, y, sizes, case="mlp", **kw):
    store = GradientStore(path, x.shape[0], k_in=KI, k_out=KO, seed=SEED, **kw)
    with gradhooks.attach(model) as gh:
        store.fill(gh, _loader(x, y, sizes), _losses(case), progress=False)
    return store


@pytest.mark.parametrize("written", [2, 3], ids=["batch-boundary", "mid-batch"])
def test_resume_equals_one_shot(written, tmp_path):
    model, x, y = _setup("mlp", torch.float32, n=6)
    one_shot = _fill(tmp_path / "a", model, x, y, [2, 2, 2]).features()
    part = GradientStore(tmp_path / "b", 6, k_in=KI, k_out=KO, seed=SEED)
    with gradhooks.attach(model) as gh:
        gh.backward(_loss("mlp")(model(x[:written]), y[:written]))
        part.add(gh.gradient_features())
    del part
    again = GradientStore(tmp_path / "b", 6, k_in=KI, k_out=KO, seed=SEED)
    assert again.rows == written and not again.complete
    calls = []
    fn = _losses("mlp")
    with gradhooks.attach(model) as gh:
        again.fill(gh, _loader(x, y, [2, 2, 2]),
                   lambda m, b: calls.append(b[0].shape[0]) or fn(m, b), progress=False)
    assert calls == [2, 2]  # batches already written get no forward
    assert torch.equal(again.features(), one_shot)
    assert torch.equal(GradientStore(tmp_path / "b", 6, k_in=KI, k_out=KO, seed=SEED).features(),
                       one_shot)


@pytest.mark.parametrize("field,value", [("k_in", 4), ("seed", 8), ("dtype", torch.float32),
                                         ("size", 7), ("output", "margin"), ("transform", "adam")],
                         ids=lambda v: str(v))
def test_spec_mismatch_names_the_field(field, value, tmp_path):
    model, x, y = _setup("mlp", torch.float32, n=4)
    _fill(tmp_path / "s", model, x[:2], y[:2], [2])
    kw = dict(size=2, k_in=KI, k_out=KO, seed=SEED)
    kw[field] = value
    size = kw.pop("size")
    with pytest.raises(StoreSpecError, match=f"{field}: stored") as info:
        GradientStore(tmp_path / "s", size, **kw)
    assert "overwrite=True" in str(info.value)
    fresh = GradientStore(tmp_path / "s", size, overwrite=True, **kw)
    assert fresh.rows == 0


def test_empty_batches(tmp_path):
    model, x, y = _setup("mlp", torch.float64, n=2)
    store = GradientStore(tmp_path / "s", 2, k_in=KI, k_out=KO, seed=SEED, dtype=torch.float32)
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        assert store.add_batch(gh, (x[:0], y[:0]), _losses("mlp")) == 0  # no forward, no row
        gh.backward(model(x[:0]).sum())
        assert store.add(gh.gradient_features()) == 0 and store.dim == 12  # the file exists
        assert store.add_batch(gh, (x, y), _losses("mlp")) == 2
    assert store.complete and store.features().shape == (2, 12)


def test_layer_and_width_mismatch(tmp_path):
    model, x, y = _setup("mlp", torch.float32, n=4)
    store = GradientStore(tmp_path / "s", 4, k_in=KI, k_out=KO, seed=SEED)
    with gradhooks.attach(model) as gh:
        gh.backward(_loss("mlp")(model(x[:2]), y[:2]))
        store.add(gh.gradient_features())
        model[0].weight.requires_grad_(False)
        model[0].bias.requires_grad_(False)
        gh.backward(_loss("mlp")(model(x[2:]), y[2:]))
        with pytest.raises(StoreSpecError, match=r"missing \['0'\]"):
            store.add(gh.gradient_features())
    with pytest.raises(StoreSpecError, match="K = 5"):
        store.add(torch.zeros(2, 5))
    with pytest.raises(StoreSpecError, match="pass the store's"):
        store.add(torch.zeros(3, store.dim))
    with pytest.raises(StoreSpecError, match="every batch"):
        store.add(torch.zeros(1, store.dim), torch.ones(1))


def test_float16_within_its_rounding(tmp_path):
    model, x, y = _setup("cnn", torch.float32, n=6)
    f32 = _fill(tmp_path / "a", model, x, y, [4, 2], dtype=torch.float32, case="cnn").features()
    f16 = _fill(tmp_path / "b", model, x, y, [4, 2], dtype=torch.float16, case="cnn")
    assert f16.array.dtype == np.float16
    diff = (f16.features() - f32).abs()
    assert bool((diff <= 2.0 ** -11 * f32.abs() + 6e-8).all()), diff.max()
    with pytest.raises(GradHooksError, match="float32"):
        f16b = GradientStore(tmp_path / "c", 1, k_in=1, k_out=1)
        f16b.add(torch.full((1, 1), 1e6))


def test_trak_margin_gradient_and_out_to_loss(tmp_path):
    model, x, y = _setup("mlp", torch.float64, n=5)
    logits = model(x).detach()
    p = logits.softmax(1).gather(1, y[:, None])[:, 0]
    close(trak_margins(logits, y), torch.log(p / (1 - p)), torch.float64, "margin")
    close(trak_out_to_loss(logits, y), 1 - p, torch.float64, "Q")
    ref = loop_grads(model, lambda out, t: trak_margins(out, t).sum(), x, y)
    feats = _features(model, x, y, "mlp")
    expected = _reference(model, feats, ref)
    store = GradientStore(tmp_path / "s", 5, k_in=KI, k_out=KO, seed=SEED, dtype=torch.float32,
                          output="margin")
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        store.fill(gh, _loader(x, y, [3, 2]), margin_output, progress=False)
        gh.backward(trak_margins(model(x), y).sum())
        close(store.project(gh.gradient_features()), expected, torch.float64, "margin grads")
    close(store.features(dtype=torch.float64), expected, torch.float32, "stored margin grads")
    close(store.out_to_loss.double(), 1 - p, torch.float32, "stored Q")
    q = torch.randn(2, store.dim, dtype=torch.float64)
    close(store.scores(q, out_to_loss=True), (q @ store.features(dtype=torch.float64).T) * (1 - p),
          torch.float32, "scores with Q")
    with pytest.raises(GradHooksError, match="labels"):
        trak_margins(logits, y.double())


def _adam_state(model, x, y, case, steps=3, opt=torch.optim.Adam, **kw):
    optimizer = opt([p for p in model.parameters() if p.requires_grad], lr=1e-2, **kw)
    for i in range(steps):
        optimizer.zero_grad()
        _loss(case)(model(x), y).backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def _less_loop(optimizer, model, convention):
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())

    def state(name):
        st = optimizer.state[params[name]]
        b1, b2 = optimizer.param_groups[0]["betas"]
        return st["exp_avg"], st["exp_avg_sq"], b1, b2, optimizer.param_groups[0]["eps"], int(st["step"]) + 1

    def direction(name, g):  # g (N, *shape): LESS's obtain_gradients_with_adam, entry by entry
        m, v, b1, b2, eps, t = state(name)
        m_n, v_n = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g ** 2
        if convention == "less":
            return m_n / torch.sqrt(v_n + eps)
        return (m_n / (1 - b1 ** t)) / (torch.sqrt(v_n / (1 - b2 ** t)) + eps)

    def transform(key, t):
        if key in params:
            return direction(key, t)
        m = modules[key]
        pre = f"{key}." if key else ""
        fake = {}
        if m.weight.requires_grad:
            w = t[..., :-1] if (m.bias is not None and m.bias.requires_grad) else t
            if isinstance(m, Conv1D):
                fake[f"{pre}weight"] = direction(f"{pre}weight", w[:, 0].transpose(1, 2))
            else:
                fake[f"{pre}weight"] = direction(f"{pre}weight", w.reshape(w.shape[0], *m.weight.shape))
        if m.bias is not None and m.bias.requires_grad:
            fake[f"{pre}bias"] = direction(f"{pre}bias", t[..., -1].reshape(t.shape[0], -1))
        return _matrix(model, key, fake)

    return transform


@pytest.mark.parametrize("convention", ["less", "adam"])
@pytest.mark.parametrize("case", ["mlp", "layouts", "tied", "lm"])
def test_less_adam_transform_against_loop(case, convention, tmp_path):
    model, x, y = _setup(case, torch.float64, n=4)
    optimizer = _adam_state(model, x, y, case, opt=torch.optim.AdamW, weight_decay=0.1)
    ref = loop_grads(model, _loss(case), x, y)
    feats = _features(model, x, y, case)
    expected = _reference(model, feats, ref, _less_loop(optimizer, model, convention))
    ours = project_batch(feats, KI, KO, SEED, transform=AdamDirection(optimizer, convention),
                         model=model, chunk_numel=50)
    close(ours, expected, torch.float64, f"LESS {convention}")
    store = GradientStore(tmp_path / "s", 4, k_in=KI, k_out=KO, seed=SEED, dtype=torch.float32,
                          transform="adam")
    with gradhooks.attach(model) as gh:
        store.fill(gh, _loader(x, y, [1, 3]), _losses(case),
                   transform=AdamDirection(optimizer, convention), progress=False)
    close(store.features(dtype=torch.float64), expected, torch.float32, "stored LESS rows")


def test_adam_convention_is_torchs_next_step():
    """With one sample, convention="adam" is the direction torch's Adam (no weight decay) moves
    the parameters at its next step: -delta / lr."""
    model, x, y = _setup("mlp", torch.float64, n=4)
    optimizer = _adam_state(model, x, y, "mlp")
    feats = _features(model, x[:1], y[:1], "mlp")
    ours = project_batch(feats, KI, KO, SEED, transform=AdamDirection(optimizer, "adam"), model=model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer.zero_grad()
    _loss("mlp")(model(x[:1]), y[:1]).backward()
    optimizer.step()
    step = {n: ((before[n] - p.detach()) / 1e-2)[None] for n, p in model.named_parameters()}
    close(ours, _reference(model, feats, step), torch.float64, "next Adam step")


def test_adam_direction_errors():
    model, x, y = _setup("mlp", torch.float64, n=2)
    feats = _features(model, x, y, "mlp")
    fresh = torch.optim.Adam(model.parameters())
    with pytest.raises(GradHooksError, match="step the optimizer"):
        project_batch(feats, KI, KO, SEED, transform=AdamDirection(fresh), model=model)
    with pytest.raises(GradHooksError, match="model="):
        project_batch(feats, KI, KO, SEED, transform=AdamDirection(fresh))
    with pytest.raises(GradHooksError, match="convention"):
        AdamDirection(fresh, "sgd")
    with pytest.raises(GradHooksError, match="amsgrad"):
        AdamDirection(torch.optim.Adam(model.parameters(), amsgrad=True))
    with pytest.raises(GradHooksError, match="betas"):
        AdamDirection(torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("case", ["mlp", "lm"])
def test_scores_are_projected_inner_products(case, tmp_path, monkeypatch):
    model, x, y = _setup(case, torch.float64, n=6)
    xq, yq = x[:2] + 0.5 if x.is_floating_point() else x[:2].flip(1), y[:2]
    monkeypatch.setattr("gradhooks.readers.attribution.gradient_store.CHUNK_ROWS", 4)
    store = _fill(tmp_path / "s", model, x, y, [4, 2], dtype=torch.float32, case=case)
    train = project_features(_features(model, x, y, case), KI, KO, SEED)
    query = project_features(_features(model, xq, yq, case), KI, KO, SEED)
    close(store.scores(query), query @ train.T, torch.float32, "q Φ^T")
    phi = store.features(dtype=torch.float64)
    close(store.kernel(), phi.T @ phi, torch.float64, "Φ^T Φ")
    lam = 1e-3
    trak = query @ torch.linalg.solve(phi.T @ phi + lam * torch.eye(phi.shape[1], dtype=torch.float64),
                                      phi.T)
    close(store.scores(query, damping=lam), trak, torch.float64, "TRAK kernel")
    assert store.scores(query.float()).dtype == torch.float32


def test_errors(tmp_path, monkeypatch):
    model, x, y = _setup("mlp", torch.float32, n=4)
    with pytest.raises(GradHooksError, match="dtype must be torch.float16, torch.float32 or"):
        GradientStore(tmp_path / "a", 4, dtype=torch.bfloat16)
    with pytest.raises(GradHooksError, match="k_in"):
        GradientStore(tmp_path / "a", 4, k_in=0)
    (tmp_path / "file").write_text("")
    with pytest.raises(GradHooksError, match="folder"):
        GradientStore(tmp_path / "file", 4)
    store = GradientStore(tmp_path / "b", 4, k_in=KI, k_out=KO, seed=SEED)
    with pytest.raises(GradHooksError, match="nothing written"):
        store.scores(torch.zeros(1, 3))
    monkeypatch.setitem(sys.modules, "tqdm", None)  # tqdm absent: no bar, no error
    with gradhooks.attach(model) as gh:
        with pytest.raises(GradHooksError, match="gave 2 samples"):
            store.fill(gh, _loader(x[:2], y[:2], [2]), _losses("mlp"))
        with pytest.raises(StoreSpecError, match=r"\(B,\)"):
            store.fill(gh, _loader(x, y, [4]), lambda m, b: m(b[0]))
    with pytest.raises(GradHooksError, match=r"\(M, 12\)"):
        store.scores(torch.zeros(1, 3))
    with pytest.raises(GradHooksError, match="out_to_loss"):
        store.scores(torch.zeros(1, store.dim), out_to_loss=True)
    with pytest.raises(GradHooksError, match="singular"):
        store.scores(torch.zeros(1, store.dim), damping=0.0)
    assert math.isfinite(float(store.scores(torch.ones(1, store.dim), damping=1.0).sum()))
