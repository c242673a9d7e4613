"""nn.Embedding and nn.EmbeddingBag per-sample gradients against looped autograd, and their
refused calls."""
import copy

import pytest
import torch
from torch import nn

import gradhooks
from gradhooks.rules.embedding import EmbeddingBagRule

from conftest import assert_close_to_loop, weighted_square_loss

V, D = 7, 3  # a small vocabulary: indices repeat within a sample and across samples


def randomised(module, scale=1.0):
    with torch.no_grad():
        module.weight.normal_().mul_(scale)
    return module


def looped(model, sample_loss, batch):
    """Reference: for each sample n, backward of sample_loss(n) alone; {name: (B, *shape)},
    dense (a sparse=True embedding gives sparse .grad)."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    out = {n: [] for n in params}
    for i in range(batch):
        model.zero_grad(set_to_none=True)
        sample_loss(i).backward()
        for n, p in params.items():
            grad = torch.zeros_like(p) if p.grad is None else p.grad
            out[n].append(grad.to_dense() if grad.is_sparse else grad)
    model.zero_grad(set_to_none=True)
    return {n: torch.stack(gs) for n, gs in out.items()}


def check(model, batch_loss, sample_loss, batch, dtype, loss_reduction, batch_first=True):
    ref = looped(model, sample_loss, batch)
    with gradhooks.attach(model, loss_reduction=loss_reduction, batch_first=batch_first) as gh:
        batch_loss().backward()
        ours = gh.per_sample_grads()
    assert_close_to_loop(ours, ref, dtype)
    return ours


# --------------------------------------------------------------------------- nn.Embedding
# id: (index shape with 0 on the batch dim, batch_first, Embedding kwargs)
EMBEDDING = {
    "B": ((0,), True, {}),
    "BT": ((0, 5), True, {}),
    "BTU": ((0, 3, 2), True, {}),
    "TB-seqfirst": ((4, 0), False, {}),
    "B-seqfirst": ((0,), False, {}),
    "BT-padding": ((0, 5), True, dict(padding_idx=2)),
    "BT-padding-negative": ((0, 5), True, dict(padding_idx=-1)),
    "TB-seqfirst-padding": ((4, 0), False, dict(padding_idx=0)),
    "BT-max-norm": ((0, 5), True, dict(max_norm=1.0)),
    "BTU-max-norm-l1-padding": ((0, 3, 2), True, dict(max_norm=1.5, norm_type=1.0, padding_idx=3)),
    "BT-sparse": ((0, 5), True, dict(sparse=True)),
    "TB-seqfirst-sparse-padding": ((4, 0), False, dict(sparse=True, padding_idx=1)),
}


@pytest.mark.parametrize("batch", [1, 3], ids=["B1", "B3"])
@pytest.mark.parametrize("case", list(EMBEDDING.values()), ids=list(EMBEDDING))
def test_embedding_matches_loop(case, batch, loss_reduction, dtype):
    shape, batch_first, kwargs = case
    bdim = 0 if batch_first or len(shape) < 2 else 1
    shape = list(shape)
    shape[bdim] = batch
    emb = randomised(nn.Embedding(V, D, **kwargs), 2.0 if "max_norm" in kwargs else 1.0)
    model = nn.Sequential(emb, nn.Tanh()).to(dtype)
    x = torch.randint(0, V, shape)
    if emb.padding_idx is not None:
        x.view(-1)[::3] = emb.padding_idx  # padding occurs in every sample
    w = torch.rand(batch, dtype=dtype) + 0.5
    loss_fn = weighted_square_loss(loss_reduction, bdim)
    ours = check(model, lambda: loss_fn(model(x), w),
                 lambda i: loss_fn(model(x.narrow(bdim, i, 1)), w[i:i + 1]),
                 batch, dtype, loss_reduction, batch_first)
    assert ours["0.weight"].shape == (batch, V, D)
    if emb.padding_idx is not None:
        assert not ours["0.weight"][:, emb.padding_idx].any()


def test_embedding_into_linear_sequence_first(loss_reduction, dtype):
    """(T, B) indices -> (T, B, D) -> Linear: both layers read the batch on dim 1."""
    model = nn.Sequential(randomised(nn.Embedding(V, D)), nn.Linear(D, 2)).to(dtype)
    x, w = torch.randint(0, V, (4, 3)), torch.rand(3, dtype=dtype) + 0.5
    loss_fn = weighted_square_loss(loss_reduction, 1)
    check(model, lambda: loss_fn(model(x), w), lambda i: loss_fn(model(x[:, i:i + 1]), w[i:i + 1]),
          3, dtype, loss_reduction, batch_first=False)


class TransposedIds(nn.Module):
    """A batch-first model that looks its ids up sequence first, as XLNet does: ``(B, T)`` ids
    transposed to ``(T, B)`` before the embedding, the result back to ``(B, T, D)``."""

    def __init__(self):
        super().__init__()
        self.emb, self.out = randomised(nn.Embedding(V, D)), nn.Linear(D, 2)

    def forward(self, ids):
        return self.out(self.emb(ids.t()).transpose(0, 1))


@pytest.mark.parametrize("tokens", [4, 3], ids=["T4", "T=B"])
def test_embedding_of_transposed_ids_in_a_batch_first_model(tokens, loss_reduction, dtype):
    """Provenance finds the batch on dim 1 of the (T, B) ids; the records are relaid out to
    (B, T) (the embedding is position-wise), exact with T == B too (core/recorder/layouts.py)."""
    model = TransposedIds().to(dtype)
    x, w = torch.randint(0, V, (3, tokens)), torch.rand(3, dtype=dtype) + 0.5
    loss_fn = weighted_square_loss(loss_reduction, 0)
    check(model, lambda: loss_fn(model(x), w), lambda i: loss_fn(model(x[i:i + 1]), w[i:i + 1]),
          3, dtype, loss_reduction, batch_first=True)


# --------------------------------------------------------------------------- nn.EmbeddingBag
class BagNet(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.bag = randomised(nn.EmbeddingBag(V, D, **kwargs), 2.0 if "max_norm" in kwargs else 1.0)

    def forward(self, x, offsets=None, weights=None):
        return torch.tanh(self.bag(x, offsets, per_sample_weights=weights))


def bag_inputs(layout, batch, padding_idx, last):
    """Indices, offsets, per-sample weights and a function giving bag n alone.

    ``layout`` "2d": (B, 4) indices. "offsets": 1-D indices; for B > 1 the bags have lengths
    3, 0 (empty), 4, 2 ... and, with padding, one bag holds only padding.
    """
    if layout == "2d":
        x = torch.randint(0, V, (batch, 4))
        if padding_idx is not None:
            x[:, ::2] = padding_idx
            x[-1] = padding_idx  # a bag of padding only
        weights = torch.rand(batch, 4) + 0.5
        return x, None, weights, lambda i: (x[i:i + 1], None, weights[i:i + 1])
    lengths = [3] if batch == 1 else ([3, 0, 4, 2, 1] * batch)[:batch]
    starts = [sum(lengths[:i]) for i in range(batch)]
    x = torch.randint(0, V, (sum(lengths),))
    if padding_idx is not None:
        x[::3] = padding_idx
        if batch > 1:
            x[starts[-1]:] = padding_idx  # the last bag holds only padding
    offsets = torch.tensor(starts + ([len(x)] if last else []))
    weights = torch.rand(len(x)) + 0.5

    def one(i):
        s, e = starts[i], starts[i] + lengths[i]
        return x[s:e], torch.tensor([0, e - s] if last else [0]), weights[s:e]

    return x, offsets, weights, one


# id: (mode, layout, include_last_offset, extra EmbeddingBag kwargs, per_sample_weights)
BAGS = {}
for _mode in ("sum", "mean", "max"):
    BAGS[f"{_mode}-2d"] = (_mode, "2d", False, {}, False)
    BAGS[f"{_mode}-offsets"] = (_mode, "offsets", False, {}, False)
    BAGS[f"{_mode}-offsets-include-last"] = (_mode, "offsets", True, {}, False)
    BAGS[f"{_mode}-2d-padding"] = (_mode, "2d", False, dict(padding_idx=2), False)
    BAGS[f"{_mode}-offsets-padding"] = (_mode, "offsets", False, dict(padding_idx=0), False)
    BAGS[f"{_mode}-offsets-max-norm"] = (_mode, "offsets", False, dict(max_norm=1.0), False)
BAGS.update({
    "sum-2d-weights": ("sum", "2d", False, {}, True),
    "sum-offsets-weights": ("sum", "offsets", False, {}, True),
    "sum-offsets-include-last-weights-padding": ("sum", "offsets", True, dict(padding_idx=4), True),
    "sum-offsets-sparse": ("sum", "offsets", False, dict(sparse=True), False),
    "mean-2d-sparse-padding": ("mean", "2d", False, dict(sparse=True, padding_idx=1), False),
})


@pytest.mark.parametrize("batch", [1, 4], ids=["B1", "B4"])
@pytest.mark.parametrize("case", list(BAGS.values()), ids=list(BAGS))
def test_embedding_bag_matches_loop(case, batch, loss_reduction, dtype):
    mode, layout, last, kwargs, use_weights = case
    model = BagNet(mode=mode, include_last_offset=last, **kwargs).to(dtype)
    x, offsets, weights, one = bag_inputs(layout, batch, model.bag.padding_idx, last)
    weights = weights.to(dtype) if use_weights else None
    w = torch.rand(batch, dtype=dtype) + 0.5
    loss_fn = weighted_square_loss(loss_reduction)

    def sample_loss(i):
        xi, oi, wi = one(i)
        return loss_fn(model(xi, oi, wi.to(dtype) if use_weights else None), w[i:i + 1])

    ours = check(model, lambda: loss_fn(model(x, offsets, weights), w), sample_loss,
                 batch, dtype, loss_reduction)
    assert ours["bag.weight"].shape == (batch, V, D)


def test_embedding_bag_keyword_call_with_offsets_first(loss_reduction):
    """bag(offsets=..., input=...): the hooks see the offsets first and still get B right."""
    bag = randomised(nn.EmbeddingBag(V, D, mode="sum")).double()
    x, offsets = torch.randint(0, V, (6,)), torch.tensor([0, 2, 2, 5])
    with gradhooks.attach(bag, loss_reduction=loss_reduction) as gh:
        (bag(offsets=offsets, input=x) ** 2).sum().backward()
        assert gh.batch_size == 4
        ours = gh.per_sample_grads()["weight"]
    for i, (s, e) in enumerate([(0, 2), (2, 2), (2, 5), (5, 6)]):
        bag.zero_grad()
        (bag(x[s:e], torch.tensor([0])) ** 2).sum().backward()
        expected = bag.weight.grad * (4 if loss_reduction == "mean" else 1)
        torch.testing.assert_close(ours[i], expected, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------- bfloat16 model
@pytest.mark.parametrize("layer", ["embedding", "embedding-bag-mean", "embedding-bag-max"])
def test_bfloat16_layer_accumulates_in_float32(layer):
    """A bfloat16 table: grad_outputs are bfloat16, accumulated in float32, cast to bfloat16;
    within bfloat16 rounding of the float64 loop on the same (bfloat16-valued) table."""
    if layer == "embedding":
        module, x = nn.Embedding(V, D), torch.randint(0, V, (4, 6))
    else:
        module, x = nn.EmbeddingBag(V, D, mode=layer.rsplit("-", 1)[1]), torch.randint(0, V, (4, 3))
    module = randomised(module).bfloat16()
    ref64 = copy.deepcopy(module).double()
    w = torch.rand(4) + 0.5
    loss_fn = weighted_square_loss("sum")
    expected = looped(ref64, lambda i: loss_fn(torch.tanh(ref64(x[i:i + 1])), w[i:i + 1].double()), 4)
    with gradhooks.attach(module, loss_reduction="sum") as gh:
        loss_fn(torch.tanh(module(x)).float(), w).backward()
        ours = gh.per_sample_grads()["weight"]
    assert ours.dtype == torch.bfloat16
    assert (ours.double() - expected["weight"]).abs().max() <= 2e-2 * expected["weight"].abs().max()


# --------------------------------------------------------------------------- refused calls
@pytest.mark.parametrize("module,args", [
    (nn.Embedding(V, D, scale_grad_by_freq=True), (torch.randint(0, V, (3, 4)),)),
    (nn.EmbeddingBag(V, D, scale_grad_by_freq=True), (torch.randint(0, V, (3, 4)),)),
    (nn.EmbeddingBag(V, D, mode="mean", scale_grad_by_freq=True),
     (torch.randint(0, V, (5,)), torch.tensor([0, 2]))),
], ids=["embedding", "embedding-bag-2d", "embedding-bag-offsets"])
def test_scale_grad_by_freq_is_refused(module, args):
    with gradhooks.attach(nn.Sequential(module)) as gh:
        with pytest.raises(gradhooks.UnsupportedCallError) as e:
            gh.model[0](*args)
    msg = str(e.value)
    assert "'0' (Embedding" in msg and "scale_grad_by_freq=True" in msg
    assert "frequency" in msg or "how often" in msg
    assert "scale_grad_by_freq=False" in msg


def test_include_last_offset_must_end_at_the_input_length():
    bag = nn.EmbeddingBag(V, D, include_last_offset=True)
    with gradhooks.attach(bag) as gh:
        with pytest.raises(gradhooks.UnsupportedCallError,
                           match=r"last offset \(4\) is not the length of the input \(6\)"):
            gh.model(torch.randint(0, V, (6,)), torch.tensor([0, 2, 4]))


def test_unbatched_index_is_refused():
    with gradhooks.attach(nn.Sequential(nn.Embedding(V, D))) as gh:
        with pytest.raises(gradhooks.BatchSizeError, match=r"'0' \(Embedding\).*batch dimension"):
            gh.model(torch.tensor(3))


@pytest.mark.parametrize("x", [torch.zeros(2, 2, 2, dtype=torch.long), torch.zeros(4, dtype=torch.long)],
                         ids=["3d", "1d-without-offsets"])
def test_embedding_bag_batch_size_needs_bags(x):
    """Inputs torch itself refuses never reach the rule; called directly it names what it needs."""
    with pytest.raises(gradhooks.BatchSizeError, match=r"\(B, L\) input or a 1-D input with offsets"):
        EmbeddingBagRule().batch_size(nn.EmbeddingBag(V, D), x, True)
