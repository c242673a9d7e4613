"""EKFAC (George et al. 2018) against per-sample gradients materialised by a loop written here:
the corrected eigenvalues are the second moments of those gradients in the Kronecker eigenbasis,
and with one sample and no weight sharing the EKFAC block is the exact Fisher block."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks

from conftest import loop_grads

F64 = torch.float64
MODELS = {
    "linear": (lambda: nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)), (4,)),
    "linear_nobias": (lambda: nn.Sequential(nn.Linear(4, 5, bias=False), nn.Tanh(),
                                            nn.Linear(5, 3)), (4,)),
    "conv_grouped": (lambda: nn.Sequential(nn.Conv1d(4, 4, 3, groups=2), nn.Tanh(), nn.Flatten(),
                                           nn.Linear(16, 3)), (4, 6)),
    "sequence": (lambda: nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Flatten(),
                                       nn.Linear(15, 3)), (3, 4)),
}


def _matrix(grads, kf, layer_params):
    """(N, groups, O, I') per-sample [W b] of one layer from the loop's gradients."""
    w = grads[kf.weight] if kf.weight else None
    b = grads[kf.bias] if kf.bias else None
    n = (w if w is not None else b).shape[0]
    groups = kf.groups
    parts = []
    if w is not None:
        parts.append(w.reshape(n, groups, w.shape[1] // groups, -1))
    if b is not None:
        parts.append(b.reshape(n, groups, -1, 1))
    return torch.cat(parts, -1)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("batch", [1, 5])
def test_scaling_is_the_eigenbasis_second_moment(name, reduction, batch):
    torch.manual_seed(0)
    make, shape = MODELS[name]
    model = make().double()
    x, y = torch.randn(batch, *shape, dtype=F64), torch.randint(0, 3, (batch,))
    loss = lambda o, t: F.cross_entropy(o, t, reduction=reduction)  # noqa: E731
    ref = loop_grads(model, loss, x, y)
    w = 1.0 / batch if reduction == "mean" else 1.0
    with gradhooks.attach(model, loss_reduction=reduction) as gh:
        loss(model(x), y).backward()
        ours = gh.ekfac_factors()
    assert list(ours) == [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv1d))]
    for path, e in ours.items():
        kf = e.kfac
        qa = e.Q_A if kf.groups > 1 else e.Q_A[None]
        qg = e.Q_G if kf.groups > 1 else e.Q_G[None]
        m = _matrix(ref, kf, None)  # (N, G, O, I')
        expected = w * (qg.transpose(-1, -2) @ m @ qa).square().sum(0)
        torch.testing.assert_close(e.scaling if kf.groups > 1 else e.scaling[None], expected,
                                   rtol=1e-10, atol=1e-14)


def test_one_sample_without_sharing_is_the_exact_fisher_block():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(1, 4, dtype=F64), torch.randint(0, 3, (1,))
    ref = loop_grads(model, F.cross_entropy, x, y)
    with gradhooks.attach(model) as gh:
        F.cross_entropy(model(x), y).backward()
        ours = gh.ekfac_factors()
    for path, e in ours.items():
        v = _matrix(ref, e.kfac, None)[0, 0].reshape(-1)  # [W b] row-major
        torch.testing.assert_close(e.block(), torch.outer(v, v), rtol=1e-9, atol=1e-12)


def test_float32_close_to_float64():
    torch.manual_seed(2)
    model = MODELS["conv_grouped"][0]()
    x, y = torch.randn(6, 4, 6), torch.randint(0, 3, (6,))
    results = {}
    for dt in (torch.float32, F64):
        m = model.to(dt)
        with gradhooks.attach(m) as gh:
            F.cross_entropy(m(x.to(dt)), y).backward()
            results[dt] = {k: e.block() for k, e in gh.ekfac_factors().items()}
    for k in results[F64]:
        ref = results[F64][k]
        assert float((results[torch.float32][k].double() - ref).abs().max()) <= 1e-4 * float(ref.abs().max())


class SeqModel(nn.Module):
    """Embedding -> LayerNorm -> self-attention (nn.MultiheadAttention) -> GRU -> Linear: every
    kind of entry (records, per-sample Kronecker, diagonal)."""

    def __init__(self, rnn=nn.GRU):
        super().__init__()
        self.emb = nn.Embedding(7, 6, padding_idx=0)
        self.norm = nn.LayerNorm(6)
        self.attn = nn.MultiheadAttention(6, 2, batch_first=True)
        self.rnn = rnn(6, 5, batch_first=True)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        h = self.norm(self.emb(x))
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.head(self.rnn(h)[0][:, -1])


SEQ_KINDS = {"emb": "per-sample", "norm": None, "attn.in_proj_weight": "per-sample",
             "attn.out_proj.weight": "per-sample", "rnn.weight_ih_l0": "per-sample",
             "rnn.weight_hh_l0": "per-sample", "head": "records"}


def _rotated_reference(e, ref):
    """(groups, O, I') sum_n (Q_G^T dW_n Q_A)^2 from the looped gradients, in e's eigenbasis."""
    from gradhooks.readers.curvature.ekfac import per_sample_matrices
    kf = e.kfac
    m = per_sample_matrices(kf, ref)  # (N, groups, O, I')
    one = lambda t: t if t is None or kf.groups > 1 else t[None]  # noqa: E731
    qa, qg = one(e.Q_A), one(e.Q_G)
    if qg is not None:
        m = qg.transpose(-1, -2) @ m
    if qa is not None:
        m = m @ qa
    return m.square().sum(0)


@pytest.mark.parametrize("rnn", [nn.GRU, nn.LSTM], ids=["gru", "lstm"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("batch", [1, 4])
def test_every_layer_with_kronecker_factors(rnn, reduction, batch):
    """Embedding, attention and recurrent weights get EKFAC from their per-sample gradients in
    the KFAC eigenbasis, LayerNorm its exact diagonal block: against a loop in float64."""
    torch.manual_seed(3)
    model = SeqModel(rnn).double()
    x, y = torch.randint(0, 7, (batch, 5)), torch.randint(0, 3, (batch,))
    loss = lambda o, t: F.cross_entropy(o, t, reduction=reduction)  # noqa: E731
    ref = loop_grads(model, loss, x, y)
    w = 1.0 / batch if reduction == "mean" else 1.0
    with gradhooks.attach(model, loss_reduction=reduction) as gh:
        loss(model(x), y).backward()
        ours = gh.ekfac_factors()
        kfac = gh.kfac_factors()
    assert list(ours) == list(kfac)
    got_kinds = {k: getattr(e, "source", None) for k, e in ours.items()}
    assert {k: got_kinds[k] for k in SEQ_KINDS} == SEQ_KINDS
    for key, e in ours.items():
        if isinstance(e, gradhooks.DiagonalFactors):
            for name, d in e.diagonal.items():
                torch.testing.assert_close(d, w * ref[name].square().sum(0), rtol=1e-10, atol=1e-14)
            continue
        expected = w * _rotated_reference(e, ref)
        torch.testing.assert_close(e.scaling if e.kfac.groups > 1 else e.scaling[None], expected,
                                   rtol=1e-10, atol=1e-14)
        if e.kfac.diagonal_A:  # the embedding: A diagonal, its own eigenbasis
            assert e.Q_A is None and key == "emb"


def test_embedding_one_sample_is_the_exact_fisher_block():
    """One sample of one token (no weight sharing): the embedding's EKFAC block is the outer
    product of its gradient, as for a Linear."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Embedding(5, 3), nn.Flatten(), nn.Linear(3, 2)).double()
    x, y = torch.tensor([[4]]), torch.tensor([1])
    ref = loop_grads(model, F.cross_entropy, x, y)
    with gradhooks.attach(model) as gh:
        F.cross_entropy(model(x), y).backward()
        e = gh.ekfac_factors()["0"]
    v = e.kfac.grad_matrix({"0.weight": ref["0.weight"][0]}).reshape(-1)
    torch.testing.assert_close(e.block(), torch.outer(v, v), rtol=1e-9, atol=1e-12)


def test_coverage_linear_and_float64_eigh():
    """coverage="linear" keeps kronfluence's layers; the eigenbasis is that of a float64 eigh
    cast back (eigh_dtype=float32 gives eigenvectors of the same factors to float32 precision)."""
    from gradhooks.readers.curvature.ekfac import ekfac_factors
    torch.manual_seed(5)
    model = SeqModel()
    x, y = torch.randint(0, 7, (3, 5)), torch.randint(0, 3, (3,))
    with gradhooks.attach(model) as gh:
        F.cross_entropy(model(x), y).backward()
        batch = gh.recorder.snapshot("t", sum_check=False)
        lin = ekfac_factors(batch, coverage="linear")
        f32 = ekfac_factors(batch, coverage="linear", eigh_dtype=torch.float32)
        with pytest.raises(ValueError, match="coverage"):
            ekfac_factors(batch, coverage="linears")
    assert list(lin) == ["head"]
    e = lin["head"]
    assert e.Q_A.dtype == torch.float32 and e.Q_A.is_contiguous()
    a64 = e.kfac.A.double()
    want = torch.linalg.eigh((a64 + a64.T) / 2).eigenvectors.float()
    torch.testing.assert_close(e.Q_A, want, rtol=0, atol=0)
    torch.testing.assert_close(e.block(), f32["head"].block(), rtol=1e-4, atol=1e-5)
