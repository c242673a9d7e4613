"""A loss computed after the model and handed to a plain ``loss.backward()``: its split into
per-sample terms is proven from its autograd graph (``gradhooks.core.analysis.loss_graph``), or
every per-sample read of the batch is refused naming the node (issue 38, point 3).

- Losses that are sums of per-sample terms (cross-entropy with label smoothing, MSE, BCE,
  KL distillation, a focal loss, a manual log-sum-exp, a hinge, shifted token logits,
  auxiliary terms ...) are exact against a loop of each sample alone, float64 and float32,
  B = 1 and several.
- Losses that pair or mix the samples after the model (InfoNCE's ``z @ z.T``, a softmax /
  sort / cumsum / max / statistic over the batch, ``z - z.mean(0)``, a non-linear function of
  the batch mean, two halves of the batch paired, advanced indexing, a custom
  ``autograd.Function``, ``cdist``) are refused at every read (per-sample gradients, norms,
  clipping) with the node's name and the ways out; ``allow_sample_mixing=True`` accepts
  them; with one sample nothing is refused (exact).
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.core.analysis import loss_rules

from conftest import assert_close_to_loop, loop_grads
from test_mixing import _read
from test_separation import Square

C = 3


def _mlp(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, C)).to(dtype)


def _data(b, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 5, generator=g, dtype=torch.float64).to(dtype), torch.randint(
        0, C, (b,), generator=g)


def _onehot(z, y):
    return F.one_hot(y, C).to(z.dtype)


# (id, loss of (z, y), loss_reduction): sums of per-sample terms
SEPARABLE = [
    ("cross_entropy", lambda z, y: F.cross_entropy(z, y), "mean"),
    ("label_smoothing", lambda z, y: F.cross_entropy(z, y, label_smoothing=0.1), "mean"),
    ("ce_sum", lambda z, y: F.cross_entropy(z, y, reduction="sum"), "sum"),
    ("ce_none_mean", lambda z, y: F.cross_entropy(z, y, reduction="none").mean(), "mean"),
    ("mse", lambda z, y: F.mse_loss(z, _onehot(z, y)), "mean"),
    ("bce_logits", lambda z, y: F.binary_cross_entropy_with_logits(z, _onehot(z, y)), "mean"),
    ("smooth_l1", lambda z, y: F.smooth_l1_loss(z, _onehot(z, y), reduction="sum"), "sum"),
    ("kl_distill", lambda z, y: F.kl_div(F.log_softmax(z / 2, -1), F.softmax(2 * _onehot(z, y), -1),
                                         reduction="batchmean"), "mean"),
    ("focal", lambda z, y: (-(1 - F.softmax(z, -1)).pow(2) * F.log_softmax(z, -1))
     .gather(1, y[:, None]).mean(), "mean"),
    ("manual_ce", lambda z, y: (z.logsumexp(1) - z.gather(1, y[:, None]).squeeze(1)).mean(),
     "mean"),
    ("hinge", lambda z, y: F.relu(1 - z.gather(1, y[:, None]) + z).sum(1).mean(), "mean"),
    ("normalize_sum", lambda z, y: (F.normalize(z, dim=1) * _onehot(z, y)).sum(), "sum"),
    ("aux_term", lambda z, y: F.cross_entropy(z, y) + 0.1 * z.pow(2).mean(), "mean"),
    ("const_temperature", lambda z, y: F.cross_entropy(z / torch.tensor(2.0, dtype=z.dtype), y),
     "mean"),
    ("cast", lambda z, y: F.cross_entropy(z.double(), y).to(z.dtype), "mean"),
    ("transpose_back", lambda z, y: F.cross_entropy(z.T.contiguous().T, y), "mean"),
    ("cat_classes", lambda z, y: F.cross_entropy(torch.cat([z, z[:, :1] * 0.5], 1), y), "mean"),
    ("stack_sum", lambda z, y: torch.stack([z, 2 * z], 1).pow(2).sum(), "sum"),
    ("view_rows", lambda z, y: F.cross_entropy(z.reshape(-1, 1, C).squeeze(1), y), "mean"),
    ("where_clamp", lambda z, y: torch.where(z > 0, z, 0.1 * z).clamp(max=2.0).exp().sum(),
     "sum"),
    ("index_targets", lambda z, y: -F.log_softmax(z, -1)[torch.arange(len(z)), y].mean(),
     "mean"),
    ("masked_select", lambda z, y: z[_onehot(z, y) > 0].pow(2).sum(), "sum"),
    ("cat_batch", lambda z, y: torch.cat([z, z], 0).softmax(1)[:, 0].sum(), "sum"),
    ("sample_by_sample", lambda z, y: sum(F.cross_entropy(z[i:i + 1], y[i:i + 1], reduction="sum")
                                          for i in range(len(z))), "sum"),
    ("rows_selected", lambda z, y: sum((z[i] ** 2).sum().sqrt() for i in range(len(z))), "sum"),
    # a mean that counts every sample equally often; slices that drop no sample
    ("cat_mean", lambda z, y: F.cross_entropy(torch.cat([z, z]), torch.cat([y, y])), "mean"),
    ("negative_slices", lambda z, y: F.cross_entropy(z[-len(z):][:len(z)], y), "mean"),
]

# (id, loss of (z, y) over a slice or subset of the batch's rows, the node its refusal names):
# a mean whose 1/R is not each sample's own 1/B (issue 38: silently B/k times the gradients)
UNEVEN = [
    ("slice_ce", lambda z, y: F.cross_entropy(z[:2], y[:2]), "NllLossBackward"),
    ("slice_none_mean", lambda z, y: F.cross_entropy(z[1:], y[1:], reduction="none").mean(),
     "MeanBackward"),
    ("slice_mse", lambda z, y: F.mse_loss(z[:-1], _onehot(z, y)[:-1]), "MseLossBackward"),
    ("slice_mean_all", lambda z, y: z[:3].pow(2).mean(), "MeanBackward"),
    ("two_counted_twice", lambda z, y: F.cross_entropy(torch.cat([z, z[:2]]),
                                                       torch.cat([y, y[:2]])), "NllLossBackward"),
]

# (id, loss of (z, y), the node its refusal names, mixes (SampleMixingError) or unproven)
MIXING = [
    ("infonce", lambda z, y: F.cross_entropy(z @ z.T, torch.arange(len(z))), "MmBackward", True),
    ("gram", lambda z, y: (z.T @ z).pow(2).sum(), "MmBackward", True),
    ("einsum_pairs", lambda z, y: torch.einsum("bi,ci->bc", z, z).logsumexp(1).mean(), None,
     True),
    ("centred", lambda z, y: ((z - z.mean(0)) ** 2).sum(), "SubBackward", True),
    ("scaled_by_sum", lambda z, y: (z * z.sum()).sum(), "MulBackward", True),
    ("softmax_batch", lambda z, y: F.softmax(z, 0)[:, 0].sum(), "SoftmaxBackward", True),
    ("log_softmax_batch", lambda z, y: F.log_softmax(z, 0).mean(), "LogSoftmaxBackward", True),
    ("sort_batch", lambda z, y: z.sort(0).values[0].sum(), "SortBackward", True),
    ("cumsum_batch", lambda z, y: z.cumsum(0).pow(2).sum(), "CumsumBackward", True),
    ("max_batch", lambda z, y: z.max(0).values.sum(), "MaxBackward", True),
    ("logsumexp_batch", lambda z, y: z.logsumexp(0).sum(), "LogsumexpBackward", True),
    ("std_batch", lambda z, y: z.std(0).sum(), "StdBackward", True),
    ("mean_squared", lambda z, y: z.mean() ** 2, "PowBackward", True),
    ("product_of_means", lambda z, y: z.mean() * z[:, 0].mean(), "MulBackward", True),
    ("normalize_batch", lambda z, y: F.normalize(z, dim=0).sum(), None, True),
    ("layer_norm_all", lambda z, y: F.layer_norm(z, z.shape).pow(2).sum(), None, True),
    ("halves_paired", lambda z, y: (z[: len(z) // 2] - z[len(z) // 2: 2 * (len(z) // 2)])
     .pow(2).sum(), "SubBackward", True),
    ("minus_first", lambda z, y: (z - z[0]).pow(2).sum(), "SubBackward", True),
    ("two_samples_multiplied", lambda z, y: (z[0] * z[1]).sum(), "MulBackward", True),
    ("gather_over_batch", lambda z, y: (z * z.gather(0, torch.zeros_like(z, dtype=torch.long)))
     .sum(), "MulBackward", False),
    ("chunk_paired", lambda z, y: torch.stack(z[:2].chunk(2)).prod(0).sum(), None, False),
    ("flip_batch", lambda z, y: (z * z.flip(0)).sum(), "FlipBackward", True),
    ("roll_batch", lambda z, y: (z * z.roll(1, 0)).sum(), "RollBackward", True),
    ("permuted", lambda z, y: (z - z[torch.randperm(len(z))]).pow(2).sum(), "SubBackward",
     False),
    ("cdist", lambda z, y: torch.cdist(z, z).sum(), "CdistBackward", False),
    ("cat_then_pairs", lambda z, y: torch.cat([z, z], 0).softmax(0).sum(), "SoftmaxBackward",
     True),
]


class Exp(torch.autograd.Function):  # (named like a torch op: its node is ExpBackward too)
    @staticmethod
    def forward(ctx, z):
        return z.flip(0).exp()  # (pairs samples: row n is sample B - 1 - n's)

    @staticmethod
    def backward(ctx, g):
        return g.flip(0)


MIXING.append(("custom_named_like_torch", lambda z, y: (Exp.apply(z) * z).sum(), "ExpBackward",
               False))
MIXING.append(("custom_function", lambda z, y: Square.apply(z).sum(), "SquareBackward",
               False))
READS = ["per_sample_grads", "norms", "clip_and_accumulate"]


@pytest.mark.parametrize("b", [1, 4], ids=["B1", "B4"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name,loss_fn,reduction", SEPARABLE, ids=[c[0] for c in SEPARABLE])
def test_a_sum_of_per_sample_terms_is_exact(name, loss_fn, reduction, dtype, b):
    model = _mlp(dtype)
    x, y = _data(b, dtype)
    ref = loop_grads(model, loss_fn, x, y)
    with gradhooks.attach(model, loss_reduction=reduction) as gh:
        loss_fn(model(x), y).backward()
        assert_close_to_loop(gh.per_sample_grads(), ref, dtype)
        gh.per_sample_grad_norms()


@pytest.mark.parametrize("read", READS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name,loss_fn,node,mixes", MIXING, ids=[c[0] for c in MIXING])
def test_a_loss_that_pairs_samples_is_refused(name, loss_fn, node, mixes, dtype, read):
    model = _mlp(dtype)
    x, y = _data(4, dtype)
    with gradhooks.attach(model) as gh:
        loss_fn(model(x), y).backward()
        error = gradhooks.SampleMixingError if mixes else gradhooks.UnprovenOpError
        with pytest.raises(error) as info:
            _read(gh, read)
    message = str(info.value)
    assert "loss computed after the model" in message, message
    assert "gh.backward(losses.sum())" in message and "allow_sample_mixing=True" in message, (
        message)
    if node is not None:
        assert node in message, message


@pytest.mark.parametrize("how", ["loss.backward", "gh.backward"])
@pytest.mark.parametrize("way_out", ["slice_sum_over_B", "masked_terms_mean"])
def test_the_ways_out_of_a_mean_over_part_of_the_batch_are_exact(way_out, how):
    """Samples 0 and 1 labelled: their own loss's gradients, zeros for the others."""
    model = _mlp(torch.float64)
    x, y = _data(4, torch.float64)
    ref = loop_grads(model, F.cross_entropy, x[:2], y[:2])
    with gradhooks.attach(model) as gh:
        z = model(x)
        loss = (F.cross_entropy(z[:2], y[:2], reduction="sum") / len(z)
                if way_out == "slice_sum_over_B" else
                (F.cross_entropy(z, y, reduction="none") * (torch.arange(4) < 2)).mean())
        loss.backward() if how == "loss.backward" else gh.backward(loss)
        got = gh.per_sample_grads()
    assert_close_to_loop({n: t[:2] for n, t in got.items()}, ref, torch.float64)
    assert all(bool((t[2:] == 0).all()) for t in got.values())


@pytest.mark.parametrize("how", ["loss.backward", "gh.backward"])
@pytest.mark.parametrize("name,loss_fn,node", UNEVEN, ids=[c[0] for c in UNEVEN])
def test_a_mean_over_part_of_the_batch_is_refused(name, loss_fn, node, how):
    model = _mlp(torch.float64)
    x, y = _data(4, torch.float64)
    with gradhooks.attach(model) as gh:
        loss = loss_fn(model(x), y)
        loss.backward() if how == "loss.backward" else gh.backward(loss)
        for read in READS:
            with pytest.raises(gradhooks.UnprovenOpError) as info:
                _read(gh, read)
            message = str(info.value)
            assert node in message and "counts the samples unequally" in message, message
            assert "gh.backward(losses.sum())" in message, message


@pytest.mark.parametrize("name,loss_fn,node,mixes", MIXING, ids=[c[0] for c in MIXING])
def test_allow_sample_mixing_accepts_it(name, loss_fn, node, mixes):
    model = _mlp(torch.float64)
    x, y = _data(4, torch.float64)
    with gradhooks.attach(model, allow_sample_mixing=True, loss_reduction="sum") as gh:
        loss_fn(model(x), y).backward()
        grads = gh.per_sample_grads()
    # each sample's contribution: they add up to the batch gradient
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n].sum(0), p.grad, rtol=1e-10, atol=1e-12)


SINGLE = [c for c in MIXING if c[0] in ("infonce", "centred", "softmax_batch", "mean_squared",
                                        "cumsum_batch", "custom_function")]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name,loss_fn,node,mixes", SINGLE, ids=[c[0] for c in SINGLE])
def test_one_sample_has_nothing_to_pair(name, loss_fn, node, mixes, dtype):
    model = _mlp(dtype)
    x, y = _data(1, dtype)
    ref = loop_grads(model, loss_fn, x, y)
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        loss_fn(model(x), y).backward()
        assert_close_to_loop(gh.per_sample_grads(), ref, dtype)


def test_empty_batch_is_not_refused():
    model = _mlp(torch.float64)
    x, y = _data(0, torch.float64)
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        z = model(x)
        (z @ z.T).sum().backward()  # (a pairing loss, of no samples)
        grads = gh.per_sample_grads()
    assert all(g.shape[0] == 0 for g in grads.values())


class _Tokens(nn.Module):
    def __init__(self, v=7, d=6):
        super().__init__()
        self.emb, self.out = nn.Embedding(v, d), nn.Linear(d, v)

    def forward(self, ids):
        return self.out(torch.tanh(self.emb(ids)))


def _shifted(z, ids):
    return F.cross_entropy(z[:, :-1].reshape(-1, z.shape[-1]), ids[:, 1:].reshape(-1))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_shifted_token_logits_are_exact(dtype):
    torch.manual_seed(0)
    model = _Tokens().to(dtype)
    ids = torch.randint(0, 7, (3, 5), generator=torch.Generator().manual_seed(2))
    ref = loop_grads(model, _shifted, ids, ids)
    with gradhooks.attach(model) as gh:
        _shifted(model(ids), ids).backward()
        assert_close_to_loop(gh.per_sample_grads(), ref, dtype)


def test_token_rows_softmaxed_over_the_merged_batch_are_refused():
    torch.manual_seed(0)
    model = _Tokens().double()
    ids = torch.randint(0, 7, (3, 5), generator=torch.Generator().manual_seed(2))
    with gradhooks.attach(model) as gh:
        z = model(ids).reshape(-1, 7)  # (B * T, V): batch-major rows
        F.log_softmax(z, 0).mean().backward()  # over every sample's tokens
        with pytest.raises(gradhooks.SampleMixingError, match="LogSoftmaxBackward"):
            gh.per_sample_grads()


class _TimeFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, C)

    def forward(self, x):  # (T, B, 4)
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("dim,mixes", [(0, False), (1, True)], ids=["over_time", "over_batch"])
def test_batch_first_false_puts_the_samples_on_dim_1(dim, mixes):
    torch.manual_seed(0)
    model = _TimeFirst().double()
    x = torch.randn(6, 3, 4, dtype=torch.float64)

    def loss_fn(z, y):
        return F.log_softmax(z, dim).pow(2).sum()

    with gradhooks.attach(model, batch_first=False, loss_reduction="sum") as gh:
        loss_fn(model(x), None).backward()
        if mixes:
            with pytest.raises(gradhooks.SampleMixingError, match="batch dim"):
                gh.per_sample_grads()
            return
        ours = gh.per_sample_grads()
    for i in range(3):
        model.zero_grad()
        loss_fn(model(x[:, i:i + 1]), None).backward()
        for n, p in model.named_parameters():
            torch.testing.assert_close(ours[n][i], p.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dim,mixes", [(0, False), (1, True)], ids=["over_time", "over_batch"])
@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU, nn.RNN])
def test_a_sequence_first_rnn_under_the_default_layout_has_its_own_batch_dim(kind, dim, mixes):
    """A sequence-first RNN attached with the default ``batch_first=True``, T == B: its output's
    batch dim is the kernel's own (dim 1), not the declared layout's dim 0 of the same size (a
    softmax over dim 1 was judged over time and accepted, silently wrong)."""
    torch.manual_seed(0)
    model = kind(2, 4).double()
    x = torch.randn(3, 3, 2, dtype=torch.float64)  # (T, B, I), T == B

    def loss_fn(out):
        return out[0].softmax(dim)[..., 0].pow(2).sum()

    with gradhooks.attach(model, loss_reduction="sum") as gh:
        loss_fn(model(x)).backward()
        if mixes:
            with pytest.raises(gradhooks.SampleMixingError, match=r"batch dim \(1 of"):
                gh.per_sample_grads()
            return
        ours = gh.per_sample_grads()
    for i in range(3):
        model.zero_grad()
        loss_fn(model(x[:, i:i + 1])).backward()
        for n, p in model.named_parameters():
            torch.testing.assert_close(ours[n][i], p.grad, rtol=1e-10, atol=1e-12)


class _Lost(nn.Module):
    """Its output's batch dim is one provenance does not follow (``repeat_interleave`` by a
    tensor of repeats: the meta replay cannot run it), ``(B, B)``; ``transposed``: the batch
    on dim 1."""

    def __init__(self, b, transposed):
        super().__init__()
        self.lin, self.transposed = nn.Linear(3, b), transposed

    def forward(self, x):
        h = self.lin(x)
        h = torch.repeat_interleave(h, torch.ones(h.shape[1], dtype=torch.long), dim=1)
        return h.t() if self.transposed else h


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("transposed", [False, True], ids=["batch_dim0", "batch_dim1"])
@pytest.mark.parametrize("b", [1, 4], ids=["B1", "B4"])
def test_an_output_whose_batch_dim_was_not_followed_is_not_guessed(b, transposed, dtype):
    """Several dims of size B and no batch dim followed: the loss's split is not guessed from
    the declared layout (dim 0: with the batch on dim 1, a softmax over the batch was accepted,
    silently wrong); a plain backward is refused as unproven, per-sample losses through
    ``gh.backward`` are checked through the batched graph (exact where they are per sample).
    (With the batch on dim 1 the check of the forward alone refuses it already.)"""
    torch.manual_seed(0)
    model = _Lost(b, transposed).to(dtype)
    x = torch.randn(b, 3, dtype=dtype)

    def losses_of(out):
        return out.softmax(1)[:, 0].log().neg() if not transposed else out.softmax(1)[0]

    with gradhooks.attach(model, loss_reduction="sum") as gh:
        losses_of(model(x)).sum().backward()
        if b > 1:  # (one sample: nothing to pair, exact)
            with pytest.raises(gradhooks.UnprovenOpError, match=(
                    "the forward alone" if transposed else "batch dim gradhooks did not follow")):
                gh.per_sample_grads()
    if transposed and b > 1:
        return
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        gh.backward(losses_of(model(x)).sum())
        ours = gh.per_sample_grads()
    ref = loop_grads(model, lambda out, _: losses_of(out).sum(), x, torch.zeros(b))
    assert_close_to_loop(ours, ref, dtype)


class _Gathered(nn.Module):
    """The model's output is rows gathered from the batch by an index that skips sample 0 and
    reverses the others: row ``r`` belongs to sample ``index[r]``."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        index = torch.arange(x.shape[0] - 1, 0, -1)
        return self.b(torch.tanh(self.a(x[index])))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_rows_gathered_from_the_batch_meet_the_loss_with_their_samples(dtype):
    """A non-linear loss on rows gathered by an index (row r of sample index[r]) is proven
    row by row with each row's own sample; each sample's gradient is its rows' (none: zero)."""
    torch.manual_seed(0)
    model = _Gathered().to(dtype)
    x = torch.randn(4, 3, dtype=dtype)
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        model(x).softmax(1)[:, 0].log().neg().sum().backward()
        ours = gh.per_sample_grads()
    out = model(x)
    params = dict(model.named_parameters())
    for n in range(4):
        rows = [r for r, s in enumerate(range(3, 0, -1)) if s == n]
        loss = sum(out[r].softmax(0)[0].log().neg() for r in rows) if rows else out.sum() * 0
        ref = torch.autograd.grad(loss, list(params.values()), retain_graph=True)
        for (name, _), g in zip(params.items(), ref):
            torch.testing.assert_close(ours[name][n], g, **(
                dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else {}))


class _WithLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = _mlp(torch.float64)

    def forward(self, x, y):
        return F.cross_entropy(self.net(x), y)


def test_a_loss_computed_in_the_forward_is_judged_by_the_forward_analysis():
    model = _WithLoss()
    x, y = _data(4, torch.float64)
    with gradhooks.attach(model) as gh:
        (model(x, y) * 1.0 + 0.0).backward()
        ours = gh.per_sample_grads()
    ref = loop_grads(model.net, F.cross_entropy, x, y)
    assert_close_to_loop({k[len("net."):]: v for k, v in ours.items()}, ref, torch.float64)


def test_a_node_whose_saved_values_cannot_be_read_is_refused(monkeypatch):
    def broken(node, name, ins, outs, batch):
        raise AttributeError("_saved_dim")

    monkeypatch.setitem(loss_rules._RULES, "SumBackward", broken)
    model = _mlp(torch.float64)
    x, y = _data(4, torch.float64)
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        model(x).sum(1).pow(2).sum().backward()
        with pytest.raises(gradhooks.UnprovenOpError, match="could not be read"):
            gh.per_sample_grads()


def test_a_later_batch_with_a_separable_loss_reads_again():
    model = _mlp(torch.float64)
    x, y = _data(4, torch.float64)
    with gradhooks.attach(model) as gh:
        z = model(x)
        F.cross_entropy(z @ z.T, torch.arange(4)).backward()
        with pytest.raises(gradhooks.SampleMixingError):
            gh.per_sample_grads()
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        assert_close_to_loop(gh.per_sample_grads(), loop_grads(model, F.cross_entropy, x, y),
                             torch.float64)


@pytest.mark.parametrize("name,loss_fn,node,mixes", MIXING, ids=[c[0] for c in MIXING])
def test_gh_backward_of_a_scalar_loss_without_per_sample_losses_is_judged_too(
        name, loss_fn, node, mixes):
    # without (B,) per-sample losses for the sample check to mask (refused at the backward
    # where there are), the loss's graph must prove its split: refused at the read
    model = _mlp(torch.float64)
    x, y = _data(4, torch.float64)
    with gradhooks.attach(model) as gh:
        with pytest.raises(gradhooks.SampleMixingError, match="loss computed after the model|"
                                                              "the sample check"):
            gh.backward(loss_fn(model(x), y))
            gh.per_sample_grads()


def _custom_losses(z, y):
    return Square.apply(z).sum(1)  # (a custom autograd.Function: its ops are not seen)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_an_unproven_loss_is_refused_after_backward_and_checked_through_per_sample_losses(dtype):
    model = _mlp(dtype)
    x, y = _data(4, dtype)
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        _custom_losses(model(x), y).sum().backward()
        with pytest.raises(gradhooks.UnprovenOpError, match="SquareBackward"):
            gh.per_sample_grads()
    ref = loop_grads(model, lambda z, t: _custom_losses(z, t).sum(), x, y)
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        gh.backward(_custom_losses(model(x), y).sum())  # (the sample check judges it)
        assert_close_to_loop(gh.per_sample_grads(), ref, dtype)


# (rows 0, 1 are sample 0 and rows 2, 3 sample 1; the ids declared before or after the backward)
GROUPED = [
    ("pair_within_sample", lambda z: (z[:2] - z[2:]).pow(2).sum(), None),  # (ids 0, 1, 0, 1)
    ("softmax_over_a_samples_rows", lambda z: z.view(2, 2, C).softmax(1)[:, 0].sum(), None),
    ("halves_across_samples", lambda z: (z[:2] - z[2:]).pow(2).sum(), "PowBackward"),
    ("view_across_samples", lambda z: z.view(2, 2, C).softmax(0)[0].sum(), "SoftmaxBackward"),
]


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("name,loss_fn,node", GROUPED, ids=[c[0] for c in GROUPED])
def test_rows_of_one_declared_sample_may_be_combined(name, loss_fn, node, when):
    model = _mlp(torch.float64)
    x, _ = _data(4, torch.float64)
    ids = torch.tensor([0, 1, 0, 1]) if name.startswith("pair") else torch.tensor([0, 0, 1, 1])
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        out = model(x)
        if when == "before":
            gh.set_sample_ids(ids)
        loss_fn(out).backward()
        if when == "after":
            gh.set_sample_ids(ids)
        if node is not None:
            with pytest.raises(gradhooks.SampleMixingError, match=node):
                gh.per_sample_grads()
            return
        ours = gh.per_sample_grads()
    for k in range(2):  # each sample's loss from its own rows: the same loss of the batch with
        model.zero_grad()  # the other sample's rows detached
        keep = (ids == k)[:, None]
        z = model(x)
        loss_fn(torch.where(keep, z, z.detach())).backward()
        for n, p in model.named_parameters():
            torch.testing.assert_close(ours[n][k], p.grad, rtol=1e-10, atol=1e-12)
