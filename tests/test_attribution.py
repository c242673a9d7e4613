"""Influence scores (gradhooks.readers.attribution) against a looped reference in float64: per-sample
gradients by one backward per sample, ``H`` built densely per block from the same factors
(``kron(G, A) + λ I`` for KFAC, ``K diag(S + λ) K^T`` for EKFAC, ``diag(d) + λ`` for diagonal
blocks), ``S[m, n] = q_m^T H^-1 g_n`` by a dense solve."""
import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

import gradhooks
from gradhooks.base.errors import GradHooksError
from gradhooks.readers import attribution as attr
from gradhooks.readers.curvature.ekfac import EKFACFactors
from gradhooks.readers.curvature.kfac_results import DiagonalFactors, KFACFactors

import conftest

F64 = torch.float64


class TinyTransformer(nn.Module):
    """Embedding -> Conv1D (transformers) -> LayerNorm -> Tanh -> mean over tokens -> Linear."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.proj = Conv1D(8, 6)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.norm(self.proj(self.emb(x)))).mean(1))


class SeqModel(nn.Module):
    """Embedding -> LayerNorm -> self-attention -> GRU -> Linear: EKFAC per-sample Kronecker
    blocks (embedding, attention, GRU), a diagonal block (LayerNorm), records (head)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 6)
        self.norm = nn.LayerNorm(6)
        self.attn = nn.MultiheadAttention(6, 2, batch_first=True)
        self.rnn = nn.GRU(6, 4, batch_first=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = self.norm(self.emb(x))
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.head(self.rnn(h)[0][:, -1])


def _cnn():
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, groups=2),
                         nn.Flatten(), nn.Linear(16, 3))


MODELS = {
    "mlp": (lambda: nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)),
            lambda b: torch.randn(b, 4, dtype=F64)),
    "cnn": (_cnn, lambda b: torch.randn(b, 2, 4, 4, dtype=F64)),
    "transformer": (TinyTransformer, lambda b: torch.randint(0, 11, (b, 5))),
    "seq": (SeqModel, lambda b: torch.randint(0, 7, (b, 4))),
}
LOSS = nn.CrossEntropyLoss()


def loop_grads(model, x, y):
    """{name: (B, *shape)} own-loss gradients of every parameter, one backward per sample
    (conftest's loop; zeros of B = 0 rows where it has no sample)."""
    got = conftest.loop_grads(model, LOSS, x, y)
    return {n: got.get(n, p.new_zeros(0, *p.shape)) for n, p in model.named_parameters()}


def _vectors_and_h(key, factor, grads, damping):
    """Per-sample vectors (B, D) of a block and its damped dense H (D, D), or H None (identity)."""
    if isinstance(factor, DiagonalFactors):
        d = torch.cat([t.flatten() for t in factor.diagonal.values()])
        lam = 0.1 * d.mean() if damping is None else damping
        vec = torch.cat([grads[n].flatten(1) for n in factor.diagonal], 1)
        return vec, torch.diag(d + lam)
    kf = factor.kfac if isinstance(factor, EKFACFactors) else factor
    b = next(iter(grads.values())).shape[0]
    vec = torch.stack([kf.grad_matrix({n: grads[n][i] for n in kf.params}).flatten()
                       for i in range(b)]) if b else None
    groups = kf.groups
    if isinstance(factor, EKFACFactors):
        blocks = [factor.block(g) for g in range(groups)]
        lam = 0.1 * factor.scaling.mean() if damping is None else damping
    else:
        a = torch.diag_embed(kf.A) if kf.diagonal_A else kf.A
        g = torch.diag_embed(kf.G) if kf.diagonal_G else kf.G
        a, g = (a, g) if groups > 1 else (a[None], g[None])
        blocks = [torch.kron(gg, aa) for gg, aa in zip(g, a)]
        eig = torch.stack([torch.outer(torch.linalg.eigvalsh(gg), torch.linalg.eigvalsh(aa))
                           for gg, aa in zip(g, a)])
        lam = 0.1 * eig.mean() if damping is None else damping
    h = torch.block_diag(*blocks)
    if vec is None:
        vec = h.new_zeros(0, h.shape[0])
    return vec, h + lam * torch.eye(h.shape[0], dtype=h.dtype)


def reference(factors, qgrads, tgrads, damping=None, missing="skip"):
    """({key: (M, N)}, {key: (N,)}) by dense solves; factors None: H = I over every parameter."""
    pair, self_ = {}, {}
    covered = set()
    for key, f in (factors or {}).items():
        q, h = _vectors_and_h(key, f, qgrads, damping)
        t, _ = _vectors_and_h(key, f, tgrads, damping)
        hinv_q = torch.linalg.solve(h, q.T).T if q.shape[0] else q
        pair[key] = hinv_q @ t.T
        self_[key] = ((torch.linalg.solve(h, t.T).T * t).sum(1) if t.shape[0]
                      else t.new_zeros(0))
        covered.update((f.kfac if isinstance(f, EKFACFactors) else f).params)
    rest = [n for n in qgrads if n not in covered]
    if rest and (factors is None or missing == "identity"):
        q = torch.cat([qgrads[n].flatten(1) for n in rest], 1)
        t = torch.cat([tgrads[n].flatten(1) for n in rest], 1)
        pair["rest"], self_["rest"] = q @ t.T, t.square().sum(1)
    return sum(pair.values()), sum(self_.values())


def _batches(name, m, n, dtype=F64):
    torch.manual_seed(0)
    make, data = MODELS[name]
    model = make().to(dtype)
    xq, xt = data(m), data(n)
    if xq.is_floating_point():
        xq, xt = xq.to(dtype), xt.to(dtype)
    yq, yt = torch.randint(0, 3, (m,)), torch.randint(0, 3, (n,))
    return model, (xq, yq), (xt, yt)


def _backward(model, x, y):
    # (an empty batch: the summed loss, which is 0 and still reaches every layer)
    (LOSS if x.shape[0] else nn.CrossEntropyLoss(reduction="sum"))(model(x), y).backward()


def _features(model, strategy, query, train, fit_on=None):
    """(query features, train features, factors of fit_on (default: train))."""
    fit_on = train if fit_on is None else fit_on
    with gradhooks.attach(model) as gh:
        factors = None
        if strategy != "identity":
            LOSS(model(fit_on[0]), fit_on[1]).backward()
            factors = gh.ekfac_factors() if strategy == "ekfac" else gh.kfac_factors()
            gh.clear()
        model.zero_grad()
        _backward(model, *query)
        qf = gh.gradient_features()
        gh.clear()
        _backward(model, *train)
        tf = gh.gradient_features()
    return qf, tf, factors


SIZES = [(3, 5), (1, 1), (2, 1)]


@pytest.fixture(params=["by_cost", "records", "matrices"])
def form(request, monkeypatch):
    """The train records contracted by the cost model's choice, or forced into the direct
    contraction / the chunked per-sample matrices (both exact)."""
    if request.param != "by_cost":
        monkeypatch.setattr(attr, "records_form_cheaper",
                            lambda *a, forced=request.param == "records": forced)
    return request.param


@pytest.mark.parametrize("sizes", SIZES, ids=lambda s: f"M{s[0]}-N{s[1]}")
@pytest.mark.parametrize("strategy", ["identity", "kfac", "ekfac"])
@pytest.mark.parametrize("name", list(MODELS))
def test_scores_match_dense_reference(name, strategy, sizes, form):
    model, query, train = _batches(name, *sizes)
    qf, tf, factors = _features(model, strategy, query, train)
    pre = attr.preconditioner(factors)
    want_pair, want_self = reference(factors, loop_grads(model, *query), loop_grads(model, *train))
    got = attr.pairwise_scores(qf, tf, pre)
    assert got.shape == (sizes[0], sizes[1])
    torch.testing.assert_close(got, want_pair, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(attr.self_scores(tf, pre), want_self, rtol=1e-9, atol=1e-12)
    if strategy == "identity":  # gradient similarity is the Gram matrix
        torch.testing.assert_close(got, gradhooks.readers.gram.gram(qf, tf), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("strategy", ["kfac", "ekfac"])
@pytest.mark.parametrize("name", list(MODELS))
def test_layers_without_factors(name, strategy):
    """KFAC and EKFAC give the embedding a Kronecker pair and the LayerNorm its diagonal block;
    with EKFAC factors of the linear layers only (coverage="linear", kronfluence's), the
    embedding and LayerNorm are skipped by default or taken with H = I (missing="identity").
    Per-layer scores add up to the total."""
    model, query, train = _batches(name, 2, 4)
    qf, tf, factors = _features(model, strategy, query, train)
    qg, tg = loop_grads(model, *query), loop_grads(model, *train)
    for missing in attr.MISSING:
        pre = attr.preconditioner(factors, missing=missing, damping=1e-3)
        per = attr.pairwise_scores(qf, tf, pre, per_layer=True)
        want_pair, want_self = reference(factors, qg, tg, damping=1e-3, missing=missing)
        torch.testing.assert_close(sum(per.values()), want_pair, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(sum(attr.self_scores(tf, pre, per_layer=True).values()),
                                   want_self, rtol=1e-9, atol=1e-12)
        kinds = attr.query_gradients(qf, pre).kinds
        assert set(per) == set(kinds)
        if name == "transformer":
            assert kinds == {"emb": strategy, "proj": strategy, "norm": "diagonal",
                             "head": strategy}
    if name == "transformer" and strategy == "ekfac":
        linear = {k: f for k, f in factors.items() if k in ("proj", "head")}
        for missing in attr.MISSING:
            pre = attr.preconditioner(linear, missing=missing, damping=1e-3)
            want_pair, _ = reference(linear, qg, tg, damping=1e-3, missing=missing)
            torch.testing.assert_close(attr.pairwise_scores(qf, tf, pre), want_pair, rtol=1e-9,
                                       atol=1e-12)
            expected = {"proj": "ekfac", "head": "ekfac"}
            if missing == "identity":
                expected.update({"emb.weight": "identity", "norm.weight": "identity",
                                 "norm.bias": "identity"})
            assert attr.query_gradients(qf, pre).kinds == expected


@pytest.mark.parametrize("name", list(MODELS))
def test_empty_batches(name, form):
    for m, n in [(0, 3), (2, 0)]:
        model, query, train = _batches(name, m, n)
        qf, tf, factors = _features(model, "kfac", query, train, fit_on=_batches(name, 1, 3)[2])
        pre = attr.preconditioner(factors)
        assert attr.pairwise_scores(qf, tf, pre).shape == (m, n)
        assert attr.self_scores(tf, pre).shape == (n,)


def test_chunks_and_query_reuse(form):
    """Train matrices (or records) taken a few samples at a time give the same scores; one
    QueryGradients serves several train batches."""
    model, query, train = _batches("cnn", 3, 7)
    qf, tf, factors = _features(model, "ekfac", query, train)
    pre = attr.preconditioner(factors)
    q = attr.query_gradients(qf, pre)
    full = attr.pairwise_scores(q, tf)
    torch.testing.assert_close(attr.pairwise_scores(q, tf, chunk_numel=1), full, rtol=1e-12,
                               atol=1e-14)
    torch.testing.assert_close(attr.self_scores(tf, pre, chunk_numel=1), attr.self_scores(tf, pre),
                               rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_diagonal_kronecker_factors(name):
    """Factors kept diagonal (kfac_factors(max_dense=...)): their own basis, no rotation."""
    model, query, train = _batches(name, 3, 4)
    with gradhooks.attach(model) as gh:
        _backward(model, *train)
        factors = gh.kfac_factors(max_dense=5)
        tf = gh.gradient_features()
        gh.clear()
        _backward(model, *query)
        qf = gh.gradient_features()
    assert any(f.diagonal_A or f.diagonal_G for f in factors.values())
    want_pair, want_self = reference(factors, loop_grads(model, *query), loop_grads(model, *train))
    pre = attr.preconditioner(factors)
    torch.testing.assert_close(attr.pairwise_scores(qf, tf, pre), want_pair, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(attr.self_scores(tf, pre), want_self, rtol=1e-9, atol=1e-12)


def test_factor_damping():
    """damping=(λ_A, λ_G): H = (G + λ_G I) ⊗ (A + λ_A I) per KFAC block."""
    model, query, train = _batches("mlp", 3, 5)
    qf, tf, factors = _features(model, "kfac", query, train)
    got = attr.pairwise_scores(qf, tf, attr.preconditioner(factors, damping=(0.1, 0.02)))
    qg, tg = loop_grads(model, *query), loop_grads(model, *train)
    want = 0
    for kf in factors.values():
        eye = lambda t: torch.eye(t.shape[-1], dtype=F64)  # noqa: E731
        h = torch.kron(kf.G + 0.02 * eye(kf.G), kf.A + 0.1 * eye(kf.A))
        q = torch.stack([kf.grad_matrix({n: qg[n][i] for n in kf.params}).flatten() for i in range(3)])
        t = torch.stack([kf.grad_matrix({n: tg[n][i] for n in kf.params}).flatten() for i in range(5)])
        want = want + torch.linalg.solve(h, q.T).T @ t.T
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_fit_over_batches(name):
    """FactorFit on one batch equals gh.kfac_factors() / gh.ekfac_factors() (mean reduction);
    on two batches it equals the fit on their concatenation."""
    model, query, train = _batches(name, 2, 6)
    qf, tf, _ = _features(model, "identity", query, train)
    with gradhooks.attach(model) as gh:
        halves = []
        for sl in (slice(0, 2), slice(2, 6)):
            LOSS(model(train[0][sl]), train[1][sl]).backward()
            halves.append(gh.gradient_features())
            gh.clear()
    for strategy in ("kfac", "ekfac"):
        one = attr.FactorFit()
        one.add_covariances(tf)
        one.add_eigenvalues(tf)
        _, _, factors = _features(model, strategy, query, train)
        want = attr.pairwise_scores(qf, tf, attr.preconditioner(factors))
        torch.testing.assert_close(attr.pairwise_scores(qf, tf, one.preconditioner(strategy)),
                                   want, rtol=1e-8, atol=1e-11)
        two = attr.FactorFit()
        for h in halves:
            two.add_covariances(h)
        for h in halves:
            two.add_eigenvalues(h)
        torch.testing.assert_close(attr.pairwise_scores(qf, tf, two.preconditioner(strategy)),
                                   want, rtol=1e-8, atol=1e-11)


@pytest.mark.parametrize("strategy", ["identity", "kfac", "ekfac"])
@pytest.mark.parametrize("name", list(MODELS))
def test_float32(name, strategy):
    model, query, train = _batches(name, 3, 5)
    want_pair, want_self = reference(*_features(model, strategy, query, train)[2:],
                                     loop_grads(model, *query), loop_grads(model, *train))
    model32 = model.float()
    q32 = (query[0].float() if query[0].is_floating_point() else query[0], query[1])
    t32 = (train[0].float() if train[0].is_floating_point() else train[0], train[1])
    qf, tf, factors = _features(model32, strategy, q32, t32)
    pre = attr.preconditioner(factors)
    scale = want_pair.abs().max()
    torch.testing.assert_close(attr.pairwise_scores(qf, tf, pre).double(), want_pair,
                               rtol=1e-3, atol=1e-4 * scale)
    torch.testing.assert_close(attr.self_scores(tf, pre).double(), want_self, rtol=1e-3,
                               atol=1e-4 * want_self.abs().max())


def test_errors():
    model, query, train = _batches("mlp", 2, 3)
    qf, tf, factors = _features(model, "ekfac", query, train)
    with pytest.raises(ValueError, match="missing"):
        attr.preconditioner(factors, missing="diagonal")
    with pytest.raises(ValueError, match="λ_A, λ_G"):
        attr.preconditioner(factors, damping=(0.1, 0.1))
    with pytest.raises(ValueError, match=">= 0"):
        attr.preconditioner(factors, damping=-1.0)
    with pytest.raises(TypeError, match="KFACFactors"):
        attr.preconditioner({"0": torch.eye(2)})
    with pytest.raises(TypeError, match="GradientFeatures"):
        attr.self_scores(torch.zeros(3, 4))
    other = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    _, tf_other, _ = _features(other, "identity", query, train)
    with pytest.raises(GradHooksError, match="shape"):
        attr.pairwise_scores(qf, tf_other, attr.preconditioner(factors))
    with gradhooks.attach(model) as gh:
        jac = gh.jacobian_features(model(train[0]))
    with pytest.raises(GradHooksError, match="passes"):
        attr.self_scores(jac)
    with pytest.raises(ValueError, match="another preconditioner"):
        attr.pairwise_scores(attr.query_gradients(qf), tf, attr.preconditioner(factors))
    with pytest.raises(GradHooksError, match="no parameter"):
        attr.pairwise_scores(qf, tf, attr.Preconditioner({}, "skip"))
    fit = attr.FactorFit()
    with pytest.raises(GradHooksError, match="no sample"):
        fit.preconditioner("kfac")
    fit.add_covariances(tf)
    with pytest.raises(GradHooksError, match="add_eigenvalues"):
        fit.preconditioner("ekfac")
    with pytest.raises(GradHooksError, match="fixed"):
        fit.add_covariances(tf)
    with pytest.raises(ValueError, match="strategy"):
        fit.preconditioner("tracin")
    assert isinstance(next(iter(factors.values())).kfac, KFACFactors)


KRONFLUENCE_MODELS = {
    "mlp": (lambda: nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)), (4,)),
    "cnn": (lambda: nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16, 3)),
            (2, 4, 4)),
}


@pytest.mark.parametrize("name", list(KRONFLUENCE_MODELS))
@pytest.mark.parametrize("strategy", ["identity", "kfac", "ekfac"])
def test_against_kronfluence(strategy, name, tmp_path):
    """kronfluence 1.0 (empirical Fisher, its default heuristic damping 0.1 * mean eigenvalue)
    on an MLP and a CNN, float32: the same pairwise and self scores within float32 precision."""
    import copy
    import warnings

    import torch.nn.functional as F
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.task import Task
    from torch.utils.data import TensorDataset

    class Classification(Task):
        def compute_train_loss(self, batch, model, sample=False):
            return F.cross_entropy(model(batch[0]), batch[1], reduction="sum")

        def compute_measurement(self, batch, model):
            return F.cross_entropy(model(batch[0]), batch[1], reduction="sum")

    torch.manual_seed(0)
    make, shape = KRONFLUENCE_MODELS[name]
    model = make()
    xt, yt = torch.randn(16, *shape), torch.randint(0, 3, (16,))
    xq, yq = torch.randn(3, *shape), torch.randint(0, 3, (3,))
    train, query = TensorDataset(xt, yt), TensorDataset(xq, yq)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        analyzer = Analyzer(analysis_name="t", model=prepare_model(copy.deepcopy(model), Classification()),
                            task=Classification(), output_dir=str(tmp_path), disable_model_save=True,
                            cpu=True, disable_tqdm=True)
        analyzer.fit_all_factors(factors_name="f", dataset=train, per_device_batch_size=16,
                                 factor_args=FactorArguments(strategy=strategy,
                                                             use_empirical_fisher=True))
        score_args = ScoreArguments(damping_factor=None, compute_per_module_scores=True)
        analyzer.compute_pairwise_scores(scores_name="p", factors_name="f", query_dataset=query,
                                         train_dataset=train, per_device_query_batch_size=3,
                                         per_device_train_batch_size=16, score_args=score_args)
        analyzer.compute_self_scores(scores_name="s", factors_name="f", train_dataset=train,
                                     per_device_train_batch_size=16, score_args=score_args)
    theirs_pair, theirs_self = analyzer.load_pairwise_scores("p"), analyzer.load_self_scores("s")
    with gradhooks.attach(model) as gh:  # loss_reduction="mean": kronfluence's normalisation
        F.cross_entropy(model(xt), yt).backward()
        factors = {"identity": lambda: None, "kfac": gh.kfac_factors,
                   "ekfac": gh.ekfac_factors}[strategy]()
        tf = gh.gradient_features()
        gh.clear()
        F.cross_entropy(model(xq), yq).backward()
        qf = gh.gradient_features()
    pre = attr.preconditioner(factors)
    for ours, theirs in ((attr.pairwise_scores(qf, tf, pre, per_layer=True), theirs_pair),
                         (attr.self_scores(tf, pre, per_layer=True), theirs_self)):
        assert set(ours) == set(theirs)
        for path, t in theirs.items():
            # kronfluence's KFAC G is also averaged over the S weight-sharing positions (ours,
            # curvlinops' and the papers' expand sum them): its H is S times smaller
            s = tf.linear[path].a.shape[2] if strategy == "kfac" else 1
            torch.testing.assert_close(ours[path] * s, t, rtol=1e-5, atol=1e-5 * t.abs().max().item())


class TokenModel(nn.Module):
    """A language-model-like stack on (B, T, 4): Linear -> Tanh -> Conv1D -> per-token logits;
    every layer's records hold the T tokens as positions."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.proj = Conv1D(3, 6)

    def forward(self, x):
        return self.proj(torch.tanh(self.lin(x)))


def token_loss(out, y):
    """Sum over tokens, mean over sequences: each sample's own loss is its tokens' sum."""
    return nn.functional.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum") / out.shape[0]


def _token_batches(m, n, t=5, dtype=F64):
    torch.manual_seed(0)
    model = TokenModel().double().to(dtype)
    data = [(torch.randn(b, t, 4, dtype=F64).to(dtype), torch.randint(0, 3, (b, t)))
            for b in (m, n)]
    with gradhooks.attach(model) as gh:
        token_loss(model(data[1][0]), data[1][1]).backward()
        factors = {"kfac": gh.kfac_factors(), "ekfac": gh.ekfac_factors()}
        feats = []
        for x, y in data:
            gh.clear()
            token_loss(model(x), y).backward()
            feats.append(gh.gradient_features())
    return model, data, feats, factors


def _per_token_reference(model, factors, query, train, damping=None):
    """(M, N, T): sum_layers (H^-1 q_m) . vec(g[n,t] ã[n,t]^T) from a loop in float64: each
    train sample's layer inputs and own-loss output gradients by autograd, the per-token
    [W b] gradients placed by KFACFactors.grad_matrix, H^-1 q_m by dense solves."""
    qg = conftest.loop_grads(model, token_loss, *query)
    xt, yt = train
    modules = dict(model.named_modules())
    out = torch.zeros(query[0].shape[0], xt.shape[0], xt.shape[1], dtype=F64)
    for key, f in factors.items():
        kf = f.kfac if isinstance(f, EKFACFactors) else f
        q, h = _vectors_and_h(key, f, qg, damping)
        hinv_q = torch.linalg.solve(h, q.T).T  # (M, D)
        mod = modules[key]
        for n in range(xt.shape[0]):
            seen = {}
            handle = mod.register_forward_hook(lambda m, i, o: seen.update(a=i[0], y=o))
            loss = token_loss(model(xt[n:n + 1]), yt[n:n + 1])
            handle.remove()
            (gy,) = torch.autograd.grad(loss, seen["y"])
            a, g = seen["a"][0], gy[0]  # (T, I), (T, O)
            for t in range(xt.shape[1]):
                w = torch.outer(a[t], g[t]) if isinstance(mod, Conv1D) else torch.outer(g[t], a[t])
                vec = kf.grad_matrix({kf.weight: w, kf.bias: g[t]}).flatten()
                out[:, n, t] += hinv_q @ vec
    return out


@pytest.mark.parametrize("sizes", SIZES, ids=lambda s: f"M{s[0]}-N{s[1]}")
@pytest.mark.parametrize("strategy", ["kfac", "ekfac"])
def test_per_token_scores(strategy, sizes):
    """(M, N, T) per-token scores: each entry against an explicit float64 loop, their sum over
    T the pairwise scores; per_layer gives each block's (M, N, T)."""
    model, (query, train), (qf, tf), factors = _token_batches(*sizes)
    pre = attr.preconditioner(factors[strategy])
    got = attr.pairwise_scores(qf, tf, pre, per_token=True)
    assert got.shape == (sizes[0], sizes[1], 5)
    want = _per_token_reference(model, factors[strategy], query, train)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(got.sum(-1), attr.pairwise_scores(qf, tf, pre), rtol=1e-9,
                               atol=1e-12)
    per = attr.pairwise_scores(qf, tf, pre, per_token=True, per_layer=True, chunk_numel=1)
    assert set(per) == {"lin", "proj"}
    torch.testing.assert_close(sum(per.values()), got, rtol=1e-9, atol=1e-12)


def test_per_token_empty_float32_and_errors():
    for m, n in [(0, 3), (2, 0)]:
        _, _, (qf, tf), factors = _token_batches(m, n)
        pre = attr.preconditioner(factors["ekfac"])
        assert attr.pairwise_scores(qf, tf, pre, per_token=True).shape == (m, n, 5)
    _, _, (qf, tf), factors = _token_batches(2, 3)
    want = attr.pairwise_scores(qf, tf, attr.preconditioner(factors["ekfac"]), per_token=True)
    _, _, (qf32, tf32), f32 = _token_batches(2, 3, dtype=torch.float32)
    got = attr.pairwise_scores(qf32, tf32, attr.preconditioner(f32["ekfac"]), per_token=True)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-3, atol=1e-4 * want.abs().max())
    # a dense parameter (the embedding, the LayerNorm) has no per-position decomposition
    model, query, train = _batches("transformer", 2, 3)
    qf, tf, factors = _features(model, "ekfac", query, train)
    with pytest.raises(GradHooksError, match="'emb.weight'"):
        attr.pairwise_scores(qf, tf, attr.preconditioner(factors), per_token=True)
    linear = attr.preconditioner({k: factors[k] for k in ("proj", "head")})
    with pytest.raises(GradHooksError, match="different numbers of positions"):
        attr.pairwise_scores(qf, tf, linear, per_token=True)  # (proj: 5 tokens, head: 1)
    per = attr.pairwise_scores(qf, tf, linear, per_token=True, per_layer=True)
    assert per["proj"].shape == (2, 3, 5) and per["head"].shape == (2, 3, 1)


def test_fit_over_batches_every_layer():
    """FactorFit with the batches' gh.kfac_factors(): the embedding, attention and GRU blocks
    (Kronecker, EKFAC from their per-sample gradients) and the LayerNorm's diagonal fitted over
    two batches equal gh.kfac_factors() / gh.ekfac_factors() of their concatenation."""
    model, query, train = _batches("seq", 2, 6)
    qf, tf, _ = _features(model, "identity", query, train)
    halves = []
    with gradhooks.attach(model) as gh:
        for sl in (slice(0, 2), slice(2, 6)):
            LOSS(model(train[0][sl]), train[1][sl]).backward()
            halves.append((gh.gradient_features(), gh.kfac_factors()))
            gh.clear()
    for strategy in ("kfac", "ekfac"):
        _, _, factors = _features(model, strategy, query, train)
        want = attr.pairwise_scores(qf, tf, attr.preconditioner(factors), per_layer=True)
        fit = attr.FactorFit()
        for h, f in halves:
            fit.add_covariances(h, f)
        for h, _ in halves:
            fit.add_eigenvalues(h)
        pre = fit.preconditioner(strategy)
        assert pre.kinds == attr.preconditioner(factors).kinds
        got = attr.pairwise_scores(qf, tf, pre, per_layer=True)
        assert set(got) == set(want)
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-8, atol=1e-11)
    with pytest.raises(TypeError, match="KFACFactors"):
        attr.FactorFit().add_covariances(tf, {"x": torch.eye(2)})


@pytest.mark.parametrize("strategy", ["identity", "ekfac"])
def test_per_token_against_kronfluence(strategy, tmp_path):
    """kronfluence 1.0's compute_per_token_scores (its "qio,bti,bto->qbt" on nn.Linear layers
    with (B, T, in) inputs) on a two-layer token model, float32: the same (M, N, T) scores."""
    import copy
    import warnings

    import torch.nn.functional as F
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.task import Task
    from torch.utils.data import TensorDataset

    class Tokens(Task):
        def compute_train_loss(self, batch, model, sample=False):
            return F.cross_entropy(model(batch[0]).flatten(0, 1), batch[1].flatten(), reduction="sum")

        def compute_measurement(self, batch, model):
            return self.compute_train_loss(batch, model)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    xt, yt = torch.randn(8, 5, 4), torch.randint(0, 3, (8, 5))
    xq, yq = torch.randn(3, 5, 4), torch.randint(0, 3, (3, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        analyzer = Analyzer(analysis_name="t", model=prepare_model(copy.deepcopy(model), Tokens()),
                            task=Tokens(), output_dir=str(tmp_path), disable_model_save=True,
                            cpu=True, disable_tqdm=True)
        analyzer.fit_all_factors(factors_name="f", dataset=TensorDataset(xt, yt),
                                 per_device_batch_size=8,
                                 factor_args=FactorArguments(strategy=strategy,
                                                             use_empirical_fisher=True))
        analyzer.compute_pairwise_scores(
            scores_name="p", factors_name="f", query_dataset=TensorDataset(xq, yq),
            train_dataset=TensorDataset(xt, yt), per_device_query_batch_size=3,
            per_device_train_batch_size=8,
            score_args=ScoreArguments(damping_factor=None, compute_per_token_scores=True))
    theirs = analyzer.load_pairwise_scores("p")["all_modules"]
    with gradhooks.attach(model) as gh:
        token_loss(model(xt), yt).backward()
        factors = gh.ekfac_factors() if strategy == "ekfac" else None
        tf = gh.gradient_features()
        gh.clear()
        token_loss(model(xq), yq).backward()
        qf = gh.gradient_features()
    ours = attr.pairwise_scores(qf, tf, attr.preconditioner(factors), per_token=True)
    assert ours.shape == theirs.shape == (3, 8, 5)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6 * theirs.abs().max().item())


@pytest.mark.parametrize("strategy", ["kfac", "ekfac"])
@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_over_loaders_and_saved_factors(name, strategy, tmp_path):
    """fit_factors / pairwise_scores_over / self_scores_over over loaders of several batches
    (the last one short) equal the batch-by-batch calls of FactorFit and the scores of each
    train batch; the factors saved and loaded give the same preconditioner."""
    model, query, train = _batches(name, 3, 7)
    qb = [(query[0][:2], query[1][:2]), (query[0][2:], query[1][2:])]
    tb = [(train[0][:3], train[1][:3]), (train[0][3:6], train[1][3:6]), (train[0][6:], train[1][6:])]

    def loss_fn(batch):
        return LOSS(model(batch[0]), batch[1])

    with gradhooks.attach(model) as gh:
        fit = attr.fit_factors(gh, tb, loss_fn, strategy=strategy, progress=False)
        pre = fit.preconditioner(strategy)
        scores = attr.pairwise_scores_over(gh, qb, tb, loss_fn, pre, progress=False)
        selfs = attr.self_scores_over(gh, tb, loss_fn, pre, progress=False)
        assert all(p.grad is None for p in model.parameters())
        want_fit = attr.FactorFit()
        for x, y in tb:
            loss_fn((x, y)).backward()
            want_fit.add_covariances(gh.gradient_features(), gh.kfac_factors())
            gh.clear()
        if strategy == "ekfac":
            for x, y in tb:
                loss_fn((x, y)).backward()
                want_fit.add_eigenvalues(gh.gradient_features())
                gh.clear()
        want_pre = want_fit.preconditioner(strategy)
        loss_fn(query).backward()
        q = attr.query_gradients(gh.gradient_features(), want_pre)
        gh.clear()
        want, want_self = [], []
        for x, y in tb:
            loss_fn((x, y)).backward()
            f = gh.gradient_features()
            want.append(attr.pairwise_scores(q, f, want_pre))
            want_self.append(attr.self_scores(f, want_pre))
            gh.clear()
    # (query gradients are each sample's own-loss gradient: the same from batches of 2 + 1
    # as from one batch of 3)
    assert scores.shape == (3, 7) and selfs.shape == (7,)
    torch.testing.assert_close(selfs, torch.cat(want_self), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(scores, torch.cat(want, 1), rtol=1e-9, atol=1e-12)
    fit.save(tmp_path / "factors.pt")
    loaded = attr.FactorFit.load(tmp_path / "factors.pt")
    again = loaded.preconditioner(strategy)
    for key, block in pre.blocks.items():
        torch.testing.assert_close(again.blocks[key].inverse, block.inverse, rtol=0, atol=0)
    with pytest.raises(GradHooksError, match="not a file FactorFit.save wrote"):
        torch.save({"x": torch.zeros(1)}, tmp_path / "other.pt")
        attr.FactorFit.load(tmp_path / "other.pt")
