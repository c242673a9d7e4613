"""Per-sample Jacobians against a loop (one forward and one autograd.grad per sample and output
coordinate), in float64 and float32, on Linear / Conv / LSTM / attention / embedding models."""
import pytest
import torch
from torch import nn

import gradhooks
from gradhooks.base.errors import BatchSizeError, GradHooksError, RecordsReleasedError

RTOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def loop_jacobians(model, x, select=lambda out: out):
    """{name: (B, *S, *shape)}: d select(model(x[n:n+1]))[0, k] / d param, looped over n, k."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    rows = []
    for i in range(x.shape[0]):
        out = select(model(x[i:i + 1]))[0]
        flat = out.reshape(-1)
        per_k = [torch.autograd.grad(flat[k], [p for _, p in params], retain_graph=True,
                                     allow_unused=True) for k in range(flat.numel())]
        rows.append({n: torch.stack([torch.zeros_like(p) if g[j] is None else g[j]
                                     for g in per_k]).view(*out.shape, *p.shape)
                     for j, (n, p) in enumerate(params)})
    return {n: torch.stack([r[n] for r in rows]) for n, _ in params}


def assert_close(ours, ref, dtype):
    assert list(ours) == list(ref)
    for name in ref:
        assert ours[name].shape == ref[name].shape, name
        scale = ref[name].abs().max().clamp_min(1e-30)
        diff = (ours[name] - ref[name]).abs().max()
        assert diff <= RTOL[dtype] * scale, f"{name}: {diff:.3e} vs {scale:.3e}"


class TinyLM(nn.Module):
    """Embedding -> LSTM -> attention -> Linear, output (B, T, V): every multi_io rule."""

    def __init__(self, vocab=7, dim=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.rnn = nn.LSTM(dim, dim, batch_first=True)
        self.att = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x):
        h, _ = self.rnn(self.emb(x))
        h = self.norm(h + self.att(h, h, h, need_weights=False)[0])
        return self.head(h)


def _cnn():
    return nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(48, 5), nn.Tanh(),
                         nn.Linear(5, 4))


class Tied(nn.Module):
    """One Linear called twice, and a weight shared with a second module."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 3)
        self.c = nn.Linear(4, 3)
        self.c.weight = self.b.weight

    def forward(self, x):
        h = torch.tanh(self.a(torch.tanh(self.a(x))))
        return self.b(h) * self.c(x)


CASES = {
    "cnn": (_cnn, lambda b: torch.randn(b, 1, 6, 6)),
    "tied": (Tied, lambda b: torch.randn(b, 4)),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("batch", [1, 5], ids=["B1", "B5"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_loop(case, batch, dtype):
    torch.manual_seed(0)
    make, data = CASES[case]
    model, x = make().to(dtype), data(batch).to(dtype)
    ref = loop_jacobians(model, x)
    with gradhooks.attach(model) as gh:
        ours = gh.per_sample_jacobians(model(x))
    assert_close(ours, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_language_model_positions(dtype):
    # (B, T, V) output: every position's Jacobian, and a selection (the last position).
    torch.manual_seed(0)
    model = TinyLM().to(dtype)
    x = torch.randint(0, 7, (3, 4))
    with gradhooks.attach(model) as gh:
        ours = gh.per_sample_jacobians(model(x))
        assert_close(ours, loop_jacobians(model, x), dtype)
        last = gh.per_sample_jacobians(model(x)[:, -1])
    assert_close(last, loop_jacobians(model, x, lambda o: o[:, -1]), dtype)


def test_flat_view_and_facts():
    torch.manual_seed(0)
    model = _cnn().double()
    x = torch.randn(4, 1, 6, 6, dtype=torch.double)
    ref = torch.cat([t.flatten(2) for t in loop_jacobians(model, x).values()], 2)
    with gradhooks.attach(model) as gh:
        flat = gh.per_sample_jacobians(model(x), flat=True)
        assert flat.shape == (4, 4, sum(p.numel() for p in model.parameters()))
        assert (flat - ref).abs().max() <= 1e-10 * ref.abs().max()
        # the records were the Jacobian passes: later reads of the batch refuse
        with pytest.raises(RecordsReleasedError):
            gh.per_sample_grads()
        # frozen parameters are left out of P
        model[0].weight.requires_grad_(False)
        flat = gh.per_sample_jacobians(model(x), flat=True)
        assert flat.shape[-1] == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_errors():
    model = _cnn().double()
    x = torch.randn(2, 1, 6, 6, dtype=torch.double)
    with gradhooks.attach(model) as gh:
        out = model(x)
        out.sum().backward(retain_graph=True)
        with pytest.raises(GradHooksError, match="before any backward"):
            gh.per_sample_jacobians(out)
        with pytest.raises(BatchSizeError):
            gh.per_sample_jacobians(model(x).t())
        with pytest.raises(GradHooksError, match="requires grad"):
            gh.per_sample_jacobians(model(x).detach())
