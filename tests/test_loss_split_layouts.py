"""Loss split over padded tokens in any output layout (issue 38, point 3; the limitation "token
counts come from the first (B, T, D) grad_output" made a refusal).

A loss whose split into per-sample terms its graph does not prove (label-smoothed
cross-entropy, a masked MSE) is refused where the samples' valid-token counts differ, whatever
the layout of the output layer's grad_output: a ``Conv1d`` head's ``(B, V, T)``, an output over
``(B * T, D)`` merged rows, a time-first ``(T, B, V)`` model, and a head whose rule gradhooks
knows no position layout of (counted along the dim whose zeros are whole rows). With equal counts, the same losses
are exact against a loop over the samples (float64 1e-10, float32 1e-5), also for B = 1 and
B = 0. The models act on each token alone (Embedding, tanh, a head), so each loop is each
sample alone.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.base.errors import UnsupportedLossError

from conftest import assert_close_to_loop, loop_grads

V, D, T = 7, 6, 5
DTYPES = {"f64": torch.float64, "f32": torch.float32}


class ConvHead(nn.Module):
    """(B, T) ids -> (B, V, T) logits from a Conv1d head (the channels-first layout)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.head = nn.Conv1d(D, V, 1)

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)).transpose(1, 2))


class TimeFirst(nn.Module):
    """(T, B) ids -> (T, B, V) logits (``batch_first=False``)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


class MergedRows(TimeFirst):
    """(B, T) ids -> (B * T, V) logits: the head runs on merged token rows."""

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)).reshape(-1, D))


class Bilinear(nn.Module):
    """A head with no rule (the torch.func fallback): its layout of positions is unknown."""

    def __init__(self):
        super().__init__()
        self.u = nn.Parameter(torch.randn(D, V) / D)
        self.c = nn.Parameter(torch.randn(V) / V)

    def forward(self, h):
        return (h @ self.u) * torch.tanh(self.c)


class FallbackHead(nn.Module):
    """(B, T) ids -> (B, T, V) logits from a head gradhooks replays with ``torch.func``."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.head = Bilinear()

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


def _logits_tokens(out, layout):
    """``(B * T, V)`` rows of the logits, in the samples' token order."""
    if layout == "conv":
        return out.transpose(1, 2).reshape(-1, V)
    if layout == "time-first":
        return out.transpose(0, 1).reshape(-1, V)
    return out.reshape(-1, V)


def smoothed(layout):
    def loss(out, labels):
        return F.cross_entropy(_logits_tokens(out, layout), labels.reshape(-1),
                               label_smoothing=0.1)
    return loss


def masked_mse(layout):
    def loss(out, labels):
        rows, mask = _logits_tokens(out, layout), (labels.reshape(-1) != -100).to(out.dtype)
        return ((rows ** 2).sum(-1) * mask).sum() / mask.sum()
    return loss


def plain_ce(layout):
    def loss(out, labels):
        if layout == "conv":  # (cross_entropy over (B, V, T) directly: nll_loss2d)
            return F.cross_entropy(out, labels)
        return F.cross_entropy(_logits_tokens(out, layout), labels.reshape(-1))
    return loss


LAYOUTS = {"conv": (ConvHead, {}), "merged-rows": (MergedRows, {}),
           "time-first": (TimeFirst, {"batch_first": False}), "fallback": (FallbackHead, {})}
LOSSES = {"label-smoothing": smoothed, "masked-mse": masked_mse, "cross-entropy": plain_ce}
HOW = ["loss.backward", "gh.backward"]


def setup(layout, dtype, valid, seed=1):
    cls, options = LAYOUTS[layout]
    torch.manual_seed(0)
    model = cls().to(dtype)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (len(valid), T), generator=g)
    labels = torch.randint(0, V, (len(valid), T), generator=g)
    for n, k in enumerate(valid):
        labels[n, k:] = -100
    x = ids.t().contiguous() if layout == "time-first" else ids
    return model, options, x, labels


def backward(gh, loss, how):
    if how == "gh.backward":
        gh.backward(loss)
    else:
        loss.backward()


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_unequal_counts_refused_in_every_layout(layout, loss, how, dtype):
    model, options, x, labels = setup(layout, DTYPES[dtype], [5, 3, 2])
    loss_fn = LOSSES[loss](layout)
    with gradhooks.attach(model, **options) as gh:
        with pytest.raises(UnsupportedLossError) as info:
            backward(gh, loss_fn(model(x), labels), how)
            gh.per_sample_grads()
        message = str(info.value)
        assert "per_sample_token_loss" in message, message
        if "does not know" in message:  # (a head of unknown layout: its zero rows found)
            assert layout == "fallback" and "module 'head'" in message, message
            assert "N_n = [5, 3, 2]" in message, message
        elif "N_n = [" in message:
            assert "N_n = [5, 3, 2]" in message, message
        else:
            assert "valid tokens" in message, message


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("valid", [[3, 3, 3], [4], []], ids=["B3", "B1", "B0"])
def test_equal_counts_exact_in_every_layout(layout, loss, how, dtype, valid):
    dtype = DTYPES[dtype]
    model, options, x, labels = setup(layout, dtype, valid)
    loss_fn = LOSSES[loss](layout)
    batch_dim = 1 if layout == "time-first" else 0
    if valid:
        ref = loop_grads(model, loss_fn, x, labels, batch_dim=batch_dim)
    with gradhooks.attach(model, **options) as gh:
        out = model(x)
        if not valid:  # (B = 0: no token to average; the sum of the empty batch's rows)
            backward(gh, (_logits_tokens(out, layout) ** 2).sum(), how)
            assert all(g.shape[0] == 0 for g in gh.per_sample_grads().values())
            return
        backward(gh, loss_fn(out, labels), how)
        assert_close_to_loop(gh.per_sample_grads(), ref, dtype)


def test_zero_rows_without_positions_are_no_padding():
    # A (B, D) output has no token positions: a sample whose gradient row is zero (its hinge
    # satisfied) is no padding, and a mean over the B rows stays exact.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    x = torch.randn(4, 4, dtype=torch.float64)
    y = torch.tensor([0, 1, 0, 1])

    def hinge(out, y):
        return F.multi_margin_loss(out, y, margin=0.0)  # (zero gradient where satisfied)

    ref = loop_grads(model, hinge, x, y)
    with gradhooks.attach(model) as gh:
        hinge(model(x), y).backward()
        assert_close_to_loop(gh.per_sample_grads(), ref, torch.float64)


class Segmenter(nn.Module):
    """(B, 2, H, W) images -> (B, C, H, W) per-pixel logits (a Conv2d head)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Conv2d(2, 4, 3, padding=1)
        self.head = nn.Conv2d(4, 3, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("valid", [[10, 6, 3], [5, 5, 5], [7], []], ids=["unequal", "equal",
                                                                          "B1", "B0"])
def test_ignored_pixels_of_a_segmentation_loss(valid, how, dtype):
    # Pixels are positions too: a cross-entropy mean over the valid pixels (ignore_index) of
    # (B, C, H, W) logits is refused where the samples' valid pixels differ, exact otherwise.
    dtype = DTYPES[dtype]
    torch.manual_seed(0)
    model = Segmenter().to(dtype)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(len(valid), 2, 4, 4, generator=g).to(dtype)
    labels = torch.randint(0, 3, (len(valid), 4, 4), generator=g)
    for n, k in enumerate(valid):
        labels[n].view(-1)[k:] = 255

    def loss_fn(out, lab):
        return F.cross_entropy(out, lab, ignore_index=255, label_smoothing=0.1)

    with gradhooks.attach(model) as gh:
        if not valid:
            backward(gh, (model(x) ** 2).sum(), how)
            assert all(v.shape[0] == 0 for v in gh.per_sample_grads().values())
            return
        if len(set(valid)) > 1:
            with pytest.raises(UnsupportedLossError, match=r"N_n = \[10, 6, 3\]"):
                backward(gh, loss_fn(model(x), labels), how)
                gh.per_sample_grads()
            return
        backward(gh, loss_fn(model(x), labels), how)
        ours = gh.per_sample_grads()
    assert_close_to_loop(ours, loop_grads(model, loss_fn, x, labels), dtype)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("how", HOW)
def test_scattered_zeros_of_an_activation_are_no_padding(how, dtype):
    # A head of unknown layout whose gradient is zero where a ReLU after it is: zeros that form
    # no whole rows along any dim are no padding, so a loss whose split is not proven (a sum
    # over all entries, divided by B) is not refused, and is exact against the loop.
    dtype = DTYPES[dtype]
    model, options, x, labels = setup("fallback", dtype, [T, T, T])

    def loss_fn(out, _):
        return (F.relu(out) ** 2).sum() / out.shape[0]

    ref = loop_grads(model, loss_fn, x, labels)
    with gradhooks.attach(model) as gh:
        out = model(x)
        assert (F.relu(out) == 0).any() and (F.relu(out) != 0).any()
        backward(gh, loss_fn(out, labels), how)
        assert_close_to_loop(gh.per_sample_grads(), ref, dtype)


class OneChannel(nn.Module):
    """(B, 2, H, W) -> (B, 1, H, W): a one-channel output (a density or depth map)."""

    def __init__(self):
        super().__init__()
        self.head = nn.Conv2d(2, 1, 3, padding=1)

    def forward(self, x):
        return self.head(x)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("b", [1, 3])
def test_a_loss_function_over_every_element_counts_no_zero_rows(b, how, dtype):
    # mse_loss over every element of relu(output): each sample has H * W terms whatever zeros
    # the ReLU leaves in its gradient (one channel: each zero is a whole position), so it is
    # not refused, and exact against the loop.
    dtype = DTYPES[dtype]
    torch.manual_seed(0)
    model = OneChannel().to(dtype)
    x, t = torch.randn(b, 2, 5, 5, dtype=dtype), torch.rand(b, 1, 5, 5, dtype=dtype)

    def loss_fn(out, target):
        return F.mse_loss(F.relu(out), target)

    ref = loop_grads(model, loss_fn, x, t)
    with gradhooks.attach(model) as gh:
        out = model(x)
        assert (F.relu(out) == 0).any()
        backward(gh, loss_fn(out, t), how)
        assert_close_to_loop(gh.per_sample_grads(), ref, dtype)


@pytest.mark.parametrize("how", HOW)
def test_a_loss_function_over_selected_entries_is_refused(how):
    # mse_loss over the valid rows selected by a mask: the samples' numbers of terms differ.
    model, options, x, labels = setup("merged-rows", torch.float64, [5, 3, 2])
    mask = labels.reshape(-1) != -100
    with gradhooks.attach(model) as gh:
        with pytest.raises(UnsupportedLossError, match=r"N_n = \[5, 3, 2\]"):
            out = model(x)
            backward(gh, F.mse_loss(out[mask], torch.zeros_like(out[mask])), how)
            gh.per_sample_grads()
