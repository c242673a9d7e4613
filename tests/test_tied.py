"""Weights tied between an input embedding and an output projection (GPT-2, Llama-3.2, Gemma,
T5): norms and book-keeping / two-pass clipping from the factored records (rows + Gram form +
their cross term, ``plan.TIED``), against a loop of batch-of-one passes, in both forms of the
projection's part (Gram and materialised), with the weight stored either way round, padding,
a projection called twice, both reductions, B = 0, 1 and several."""
import pytest
import torch
import torch.nn as nn

import gradhooks
import gradhooks.readers.plan as plan
from gradhooks.base.errors import GradientMismatchError

from conftest import RTOL, loop_grads

V, D, T = 13, 6, 5


class Conv1D(nn.Module):
    """transformers' ``Conv1D`` (weight stored ``(in, out)``), here fed ``(B, T, V)`` scores so
    that its ``(V, D)`` weight can be tied to an ``nn.Embedding(V, D)``."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.3)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        out = torch.addmm(self.bias, x.reshape(-1, x.size(-1)), self.weight)
        return out.view(x.size()[:-1] + (self.nf,))


class TiedLM(nn.Module):
    """Embedding -> Linear -> tanh -> output projection tied to the embedding, the projection
    called twice (all tokens, and the first token again)."""

    def __init__(self, padding_idx=None):
        super().__init__()
        self.emb = nn.Embedding(V, D, padding_idx=padding_idx)
        self.mid = nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        h = torch.tanh(self.mid(self.emb(x)))
        return self.head(h) + self.head(h[:, :1])


class TiedTransposed(nn.Module):
    """Embedding tied to a ``Conv1D`` (weight stored ``(in, out)`` = ``(V, D)``) that reads
    softmax scores over the vocabulary: the tied weight's rows are the projection's inputs."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.proj = Conv1D(D, V)
        self.proj.weight = self.emb.weight
        self.out = nn.Linear(D, V)

    def forward(self, x):
        h = self.emb(x)
        return self.out(torch.tanh(self.proj(torch.softmax(self.out(h), -1)) + h))


def _loss(reduction):
    def loss_fn(out, y):
        loss = nn.functional.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum")
        return loss / out.shape[0] if reduction == "mean" and out.shape[0] else loss
    return loss_fn


def _reference(model, loss_fn, x, y, reduction):
    """Looped per-sample gradients of each sample's own loss, and their float64 norms."""
    ref = loop_grads(model, loss_fn, x, y)
    b = x.shape[0]
    norms_ = torch.stack([torch.cat([g[n].flatten().double() for g in ref.values()]).norm()
                          for n in range(b)]) if b else torch.zeros(0, dtype=torch.float64)
    return ref, norms_


MODELS = {"linear-head": lambda: TiedLM(), "padding": lambda: TiedLM(padding_idx=2),
          "conv1d-transposed": TiedTransposed}


@pytest.mark.parametrize("form", ["gram", "materialised"])
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("b", [0, 1, 4])
def test_tied_norms_and_clipping_match_loop(model_name, form, b, dtype, loss_reduction, monkeypatch):
    monkeypatch.setattr(plan, "use_gram", lambda *a, **k: form == "gram")
    model = MODELS[model_name]().to(dtype)
    x = torch.randint(0, V, (b, T))
    y = torch.randint(0, V, (b, T))
    loss_fn = _loss(loss_reduction)
    ref, ref_norms = _reference(model, loss_fn, x, y, loss_reduction)
    tol = RTOL[dtype] * 10
    with gradhooks.attach(model, loss_reduction=loss_reduction, check="always") as gh:
        gh.backward(loss_fn(model(x), y))
        if b:
            plans, _ = plan.plan(gh.recorder.snapshot("test"))
            assert {p.name: p.kind for p in plans.values()}["emb.weight"] == plan.TIED
        got = gh.per_sample_grad_norms()
        assert got.shape == (b,)
        if b:
            assert (got.double() - ref_norms).abs().max() <= tol * ref_norms.max()
        c_bound = float(ref_norms.median()) if b else 1.0
        scale = ((c_bound / ref_norms).clamp(max=1) if b else ref_norms)
        divisor = b if loss_reduction == "mean" and b else 1
        for clip in ("book-keeping", "two-pass"):
            for p in model.parameters():
                p.grad = None
            out = model(x)
            if clip == "book-keeping":
                gh.backward(loss_fn(out, y))
                gh.clip_and_accumulate(c_bound)
            else:
                losses = nn.functional.cross_entropy(out.transpose(1, 2), y, reduction="none").sum(1)
                gh.clipped_backward(losses, c_bound)
            for name, p in model.named_parameters():
                want = (torch.einsum("n,n...->...", scale.to(dtype), ref[name]) / divisor
                        if b else torch.zeros_like(p))
                err = (p.grad - want).abs().max()
                assert err <= tol * max(float(want.abs().max()), 1e-30), (clip, name, float(err))


def test_tied_check_refuses_a_use_outside_the_modules():
    """The sum check still sees a tied weight also used functionally (x @ emb.weight)."""

    class Leaky(TiedLM):
        def forward(self, x):
            return super().forward(x) + (self.emb(x) @ self.emb.weight.T)

    model = Leaky().double()
    x = torch.randint(0, V, (3, T))
    with gradhooks.attach(model, loss_reduction="sum", check="always") as gh:
        gh.backward(_loss("sum")(model(x), x))
        with pytest.raises(GradientMismatchError, match="emb.weight"):
            gh.per_sample_grad_norms()


def test_tied_cross_term_uneven_rows_per_sample():
    """``tied_cross`` with entries not grouped by sample and uneven counts (padding dropped
    some) against the dense inner product."""
    from gradhooks.base.forms import Rows
    gen = torch.Generator().manual_seed(3)
    n, s, e = 3, 4, 7
    sample = torch.tensor([2, 0, 2, 1, 0, 2, 2])
    row = torch.randint(0, V, (e,), generator=gen)
    values = torch.randn(e, D, generator=gen, dtype=torch.float64)
    p = torch.randn(n, s, V, generator=gen, dtype=torch.float64)
    q = torch.randn(n, s, D, generator=gen, dtype=torch.float64)
    dense_rows = torch.zeros(n, V, D, dtype=torch.float64).index_put_((sample, row), values, accumulate=True)
    dense_lin = torch.einsum("nsv,nsd->nvd", p, q)
    want = (dense_rows * dense_lin).sum((1, 2))
    got = plan.tied_cross(Rows(sample, row, values), p, q)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
