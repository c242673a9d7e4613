"""Shared (unbatched) index inputs: a position Embedding called on (1, T) ids broadcast over the
batch, as transformers' models do by default. Its output is expanded to the batch, so each
sample's gradient is recorded before the broadcast sums it. Float64 against a loop."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks

from conftest import assert_close_to_loop, loop_grads


class Positions(nn.Module):
    def __init__(self, vocab=11, max_len=8, dim=6):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.head = nn.Linear(dim, 3)
        self.register_buffer("ids", torch.arange(max_len)[None], persistent=False)  # (1, L)

    def forward(self, tokens):
        h = self.tok(tokens) + self.pos(self.ids[:, :tokens.shape[1]])
        return self.head(torch.tanh(h).mean(1))


@pytest.mark.parametrize("batch,length", [(1, 5), (4, 5), (5, 5)], ids=["B1", "B4", "T_eq_B"])
def test_shared_position_ids_match_loop(batch, length, dtype):
    torch.manual_seed(0)
    model = Positions().to(dtype)
    x, y = torch.randint(0, 11, (batch, length)), torch.randint(0, 3, (batch,))
    ref = loop_grads(model, F.cross_entropy, x, y)
    norms = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in ref.values()))
    with gradhooks.attach(model) as gh:
        out = model(x)
        assert out.shape == (batch, 3)
        F.cross_entropy(out, y).backward()
        torch.testing.assert_close(gh.per_sample_grad_norms(), norms,
                                   rtol=1e-9 if dtype == torch.float64 else 1e-4, atol=0)
        assert_close_to_loop(gh.per_sample_grads(), ref, dtype)


def test_a_float_input_of_one_row_is_still_refused():
    """Only index inputs are read as shared: a float call on one row of a batch of 4 may be
    part of the batch (a shrinking PackedSequence step), so it is refused, not expanded."""
    class OneRow(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

        def forward(self, x):
            return self.a(x) + self.b(x[:1])

    model = OneRow()
    with gradhooks.attach(model):
        with pytest.raises(gradhooks.BatchSizeError, match="sees batch size 1"):
            model(torch.randn(4, 3))


def test_position_ids_are_planned_after_the_first_forward(dtype):
    """The first forward of a signature is tracked and plans the position lookup ("expand": its
    output meets the batch by a broadcast that adds the batch dim); the second follows the plan
    without tracking, and is as exact."""
    torch.manual_seed(0)
    model = Positions().to(dtype)
    x, y = torch.randint(0, 11, (4, 5)), torch.randint(0, 3, (4,))
    ref = loop_grads(model, F.cross_entropy, x, y)
    tracked = []
    with gradhooks.attach(model) as gh:
        placement = gh.recorder.placement
        model.head.register_forward_hook(
            lambda *_: tracked.append(placement.provenance is not None))
        for _ in range(2):
            F.cross_entropy(model(x), y).backward()
            assert_close_to_loop(gh.per_sample_grads(), ref, dtype)
        pos = next(layer for layer in gh.recorder.layers if layer.module is model.pos)
        assert list(placement.signatures.values()) == [{(id(pos), 1): "expand"}]
    assert tracked == [True, False]


class PromptTuned(nn.Module):
    """Prompt tuning (peft's PromptTuning): the only trainable layer is an Embedding of ``k``
    virtual tokens, called on ``arange(k)`` expanded to the batch, prepended to a frozen model's
    token embeddings; or (``raw``) a raw prompt parameter, expanded."""

    def __init__(self, raw=False, k=2, vocab=11, dim=6):
        super().__init__()
        self.raw, self.k = raw, k
        if raw:
            self.prompt = nn.Parameter(torch.randn(k, dim))
        else:
            self.prompt = nn.Embedding(k, dim)
        self.tok = nn.Embedding(vocab, dim).requires_grad_(False)
        self.body = nn.Linear(dim, dim).requires_grad_(False)
        self.head = nn.Linear(dim, 3).requires_grad_(False)

    def forward(self, tokens):
        b = tokens.shape[0]
        p = (self.prompt.expand(b, -1, -1) if self.raw
             else self.prompt(torch.arange(self.k).unsqueeze(0).expand(b, -1)))
        h = torch.cat([p, self.tok(tokens)], 1)
        return self.head(torch.tanh(self.body(h)).mean(1))


@pytest.mark.parametrize("raw", [False, True], ids=["embedding", "raw"])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_prompt_the_only_trainable_part(raw, batch, dtype):
    """No hooked call sees the batch: its size is the model's input's (was a raw TypeError)."""
    model = PromptTuned(raw).to(dtype)
    tokens, y = torch.randint(0, 11, (batch, 5)), torch.randint(0, 3, (batch,))
    ref = loop_grads(model, F.cross_entropy, tokens, y)
    with gradhooks.attach(model) as gh:
        F.cross_entropy(model(tokens), y).backward()
        assert_close_to_loop(gh.per_sample_grads(), ref, dtype)
        norms = gh.per_sample_grad_norms()
    expected = ref["prompt" if raw else "prompt.weight"].flatten(1).norm(dim=1)
    torch.testing.assert_close(norms, expected.to(norms.dtype),
                               rtol=1e-9 if dtype == torch.float64 else 1e-4, atol=0)


class LatentQueries(nn.Module):
    """A Perceiver's cross-attention: learned latent queries, not from the batch, meet the
    batch's keys in an einsum; ``via``: the queries are a raw parameter, or the output of
    ``proj`` called on them (a shared call) while ``proj`` is called on the batch too, or both
    operands swapped in the equation (``swapped``)."""

    def __init__(self, via, q=2, d=6):
        super().__init__()
        self.via = via
        self.q, self.proj = nn.Parameter(torch.randn(q, d)), nn.Linear(d, d)
        self.head = nn.Linear(q * d, 3)

    def forward(self, x):
        k = self.proj(x)  # (B, T, d)
        q = self.q if self.via == "raw" else self.proj(self.q)
        scores = (torch.einsum("btd,qd->bqt", k, q) if self.via == "swapped"
                  else torch.einsum("qd,btd->bqt", q, k))
        # (tanh, not a softmax: one over the keys would leave proj's bias, one over the queries
        # followed by their mean the queries, exactly without gradient)
        return self.head((scores.tanh() @ x).flatten(1))


@pytest.mark.parametrize("via", ["raw", "shared_call", "swapped"])
@pytest.mark.parametrize("batch", [0, 1, 3])
def test_shared_queries_meeting_the_batch_in_einsum_are_exact(via, batch, dtype):
    """The shared operand is given the batch letter and passed as B copies: its gradient per
    sample (a BatchSizeError before 2026-12-08)."""
    torch.manual_seed(0)
    model = LatentQueries(via).to(dtype)
    x, y = torch.randn(batch, 4, 6, dtype=dtype), torch.randint(0, 3, (batch,))
    loss = lambda out, t: F.cross_entropy(out, t, reduction="sum")
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        loss(model(x), y).backward()
        ours = gh.per_sample_grads()
    if not batch:
        assert {n: t.shape for n, t in ours.items()} == {
            n: (0, *p.shape) for n, p in model.named_parameters()}
        return
    assert_close_to_loop(ours, loop_grads(model, loss, x, y), dtype)


class SamplesSummed(nn.Module):
    def __init__(self, d=6):
        super().__init__()
        self.q, self.head = nn.Parameter(torch.randn(2, d)), nn.Linear(d, 3)

    def forward(self, x):  # (the batch letter contracted: the samples summed, then broadcast)
        pooled = torch.einsum("qd,btd->qd", self.q, x)
        return self.head(x.mean(1) + pooled.sum(0))


def test_a_shared_operand_in_an_einsum_that_sums_the_samples_is_refused():
    model = SamplesSummed().double()
    x = torch.randn(3, 4, 6, dtype=torch.float64)
    with gradhooks.attach(model) as gh:
        model(x).square().sum().backward()
        with pytest.raises(gradhooks.GradHooksError, match="einsum"):
            gh.per_sample_grads()
