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
