"""The loss check of gh.backward(loss) and gh.clipped_backward(losses, C) (issue 29;
gradhooks/readers/loss_reduction.py): a token-level mean over padded samples with unequal
valid-token counts, and a reduction over the batch that contradicts ``loss_reduction``, are
refused with UnsupportedLossError; the matching losses, and any loss not recognised, pass.
"""
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.readers.loss_reduction import check_batch_loss

import zoo_imports
from conftest import assert_close_to_loop, loop_grads, weighted_square_loss

zoo_imports.import_torchvision()
import transformers  # noqa: E402,F401  (the test extra; after the torchvision stub)

V, T, B = 50, 8, 3


def gpt2():
    return zoo_imports.tiny_gpt2(V)


def t5():
    return zoo_imports.tiny_t5(V)


def padded(valid=(8, 5, 3)):
    """ids (B, T), labels -100 after each sample's first ``valid[n]``: shifted counts 7, 4, 2."""
    return zoo_imports.padded_batch(valid, V, T)


def mlp():
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 4)).double()


def data(b=4):
    return torch.randn(b, 5, dtype=torch.float64), torch.randint(0, 4, (b,))


# ------------------------------------------------------------------ (a) token-level means
@pytest.mark.parametrize("build", [gpt2, t5], ids=["gpt2", "t5"])
def test_padded_token_mean_refused(build):
    model = build()
    ids, labels = padded()
    with gradhooks.attach(model, loss_reduction="mean") as gh:
        loss = model(input_ids=ids, labels=labels).loss
        with pytest.raises(gradhooks.UnsupportedLossError) as info:
            gh.backward(loss)
        msg = str(info.value)
        counts = "[7, 4, 2]" if build is gpt2 else "[8, 5, 3]"
        assert f"N_n = {counts}" in msg and "B N_n / N" in msg
        assert "gradhooks.per_sample_token_loss(logits, labels)" in msg
        assert "gh.backward(losses.mean())" in msg
        with pytest.raises(gradhooks.UnsupportedLossError):
            gh.backward(loss * 0.5)  # a constant scaling is seen through
        # the hooks go on: the per-sample losses of the same model pass, in the next forward
        logits = model(input_ids=ids, labels=labels).logits
        gh.backward(gradhooks.per_sample_token_loss(logits, labels, shift=build is gpt2).mean())
        assert gh.per_sample_grads()


def test_refused_under_sum_too():
    model = gpt2()
    ids, labels = padded()
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        with pytest.raises(gradhooks.UnsupportedLossError, match=r"losses\.sum\(\)"):
            gh.backward(model(ids, labels=labels).loss)


def test_unpadded_allowed_and_exact():
    """No padding: the token mean is (1/B) sum_n (own token mean), exact."""
    model = gpt2()
    ids = torch.randint(1, V, (B, T))
    own = lambda logits, y: F.cross_entropy(logits[:, :-1].reshape(-1, V), y[:, 1:].reshape(-1))
    with gradhooks.attach(model, loss_reduction="mean") as gh:
        gh.backward(own(model(ids).logits, ids))
        ours = gh.per_sample_grads()
    ref = loop_grads(model, lambda out, y: own(out.logits, y), ids, ids)
    assert_close_to_loop(ours, ref, torch.float64)
    with gradhooks.attach(model, loss_reduction="mean") as gh:
        gh.backward(model(ids, labels=ids).loss)  # transformers' own loss (in float32)
        for name, g in gh.per_sample_grads().items():
            assert (g - ref[name]).abs().max() <= 1e-5 * ref[name].abs().max(), name


@pytest.mark.parametrize("valid", [(5, 5, 5), (6,)], ids=["equal-counts", "B1"])
def test_padding_with_equal_counts_or_one_sample_allowed(valid):
    model = gpt2()
    ids, labels = padded(valid)
    with gradhooks.attach(model, loss_reduction="mean") as gh:
        gh.backward(model(ids, labels=labels).loss)
        assert gh.per_sample_grads()


def test_loss_backward_of_an_in_forward_token_mean_is_refused_at_the_read():
    """With a plain loss.backward() the loss is not handed to gradhooks, but transformers
    computes it inside the forward, where provenance sees it (gradhooks.core.analysis.token_means):
    the read refuses it (tests/test_token_mean_in_forward.py has the other cases)."""
    model = gpt2()
    ids, labels = padded()
    with gradhooks.attach(model, loss_reduction="mean") as gh:
        model(ids, labels=labels).loss.backward()
        with pytest.raises(gradhooks.UnsupportedLossError, match=r"N_n = \[7, 4, 2\]"):
            gh.per_sample_grads()


def test_per_sample_rows_mean_with_ignored_samples_refused():
    model = mlp()
    x, y = data()
    y[1] = -100
    with gradhooks.attach(model, loss_reduction="mean") as gh:
        with pytest.raises(gradhooks.UnsupportedLossError, match=r"N_n = \[1, 0, 1, 1\]"):
            gh.backward(F.cross_entropy(model(x), y))


# ------------------------------------------------------------------ (b) declared reduction
MEAN_LOSSES = {
    "ce-mean": lambda out, y: F.cross_entropy(out, y),
    "none-mean": lambda out, y: F.cross_entropy(out, y, reduction="none").mean(),
    "mse-mean": lambda out, y: F.mse_loss(out, F.one_hot(y, 4).double()),
    "sum-over-B": lambda out, y: F.cross_entropy(out, y, reduction="sum") / out.shape[0],
}
SUM_LOSSES = {
    "ce-sum": lambda out, y: F.cross_entropy(out, y, reduction="sum"),
    "none-sum": lambda out, y: F.cross_entropy(out, y, reduction="none").sum(),
    "mse-sum": lambda out, y: F.mse_loss(out, F.one_hot(y, 4).double(), reduction="sum"),
}


@pytest.mark.parametrize("declared,losses,wrong", [
    ("mean", SUM_LOSSES, "sum over the batch"), ("sum", MEAN_LOSSES, "mean over the batch")],
    ids=["mean-declared", "sum-declared"])
def test_contradicting_reduction_refused(declared, losses, wrong):
    model = mlp()
    x, y = data()
    with gradhooks.attach(model, loss_reduction=declared) as gh:
        for name, fn in losses.items():
            if name == "sum-over-B":  # scaled by 1/B: not judged
                continue
            with pytest.raises(gradhooks.UnsupportedLossError, match=wrong):
                gh.backward(fn(model(x), y))


@pytest.mark.parametrize("declared,losses", [("mean", MEAN_LOSSES), ("sum", SUM_LOSSES)],
                         ids=["mean", "sum"])
def test_matching_reduction_allowed_and_exact(declared, losses):
    model = mlp()
    x, y = data()
    for name, fn in losses.items():
        ref = loop_grads(model, fn, x, y)  # each sample alone: its own loss
        with gradhooks.attach(model, loss_reduction=declared) as gh:
            gh.backward(fn(model(x), y))
            assert_close_to_loop(gh.per_sample_grads(), ref, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("declared,losses,wrong,factor", [
    ("mean", SUM_LOSSES, "sum over the batch", "4 (B) times"),
    ("sum", MEAN_LOSSES, "mean over the batch", "1/4 (1/B) times")],
    ids=["mean-declared", "sum-declared"])
def test_contradicting_reduction_refused_after_plain_backward(declared, losses, wrong, factor,
                                                              dtype):
    """loss.backward() (gradhooks.core.analysis.backward_losses): the pass's root shows the reduction,
    the read refuses, every read."""
    model = mlp().to(dtype)
    x, y = data()
    x = x.to(dtype)
    with gradhooks.attach(model, loss_reduction=declared) as gh:
        for name, fn in losses.items():
            if name == "sum-over-B":  # scaled by 1/B: not judged
                continue
            model.zero_grad()
            fn(model(x), y).backward()
            for read in (gh.per_sample_grads, gh.per_sample_grad_norms,
                         lambda: gh.clip_and_accumulate(1.0)):
                with pytest.raises(gradhooks.UnsupportedLossError, match=wrong) as info:
                    read()
                assert factor in str(info.value) and f"loss_reduction={declared!r}" in str(
                    info.value)


@pytest.mark.parametrize("b", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("declared,losses", [("mean", MEAN_LOSSES), ("sum", SUM_LOSSES)],
                         ids=["mean", "sum"])
def test_matching_reduction_exact_after_plain_backward(declared, losses, dtype, b):
    """The matching losses (and any with B = 1, where a sum is a mean): no refusal, exact."""
    model = mlp().to(dtype)
    x, y = data(b)
    x = x.to(dtype)
    wrong = SUM_LOSSES if declared == "mean" else MEAN_LOSSES
    for name, fn in list(losses.items()) + (list(wrong.items()) if b == 1 else []):
        if b == 1 and name == "mse-mean":  # (a mean over the 4 outputs, not over samples)
            continue
        ref = loop_grads(model, fn, x, y)  # each sample alone: its own loss
        with gradhooks.attach(model, loss_reduction=declared) as gh:
            model.zero_grad()
            fn(model(x), y).backward()
            assert_close_to_loop(gh.per_sample_grads(), ref, dtype)


@pytest.mark.parametrize("declared", ["mean", "sum"])
def test_weighted_loss_allowed(declared):
    model = mlp()
    x, w = data()[0], torch.rand(4, dtype=torch.float64)
    loss_fn = weighted_square_loss(declared)
    with gradhooks.attach(model, loss_reduction=declared) as gh:
        gh.backward(loss_fn(model(x), w))
        ours = gh.per_sample_grads()
    assert_close_to_loop(ours, loop_grads(model, loss_fn, x, w), torch.float64)


@pytest.mark.parametrize("declared,losses,wrong", [
    ("mean", SUM_LOSSES, "sum over the batch"), ("sum", MEAN_LOSSES, "mean over the batch")],
    ids=["mean-declared", "sum-declared"])
def test_loss_scaled_by_a_grad_scaler_judged_below_the_scale(declared, losses, wrong):
    """scaler.scale(loss) (case (d)): its scale is the GradScaler's, read by the recorder, so the
    loss below it is judged as an unscaled one: contradicting refused, matching exact."""
    model = mlp()
    x, y = data()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    right = MEAN_LOSSES if declared == "mean" else SUM_LOSSES
    with gradhooks.attach(model, loss_reduction=declared) as gh:
        for name, fn in losses.items():
            if name == "sum-over-B":  # scaled by 1/B: not judged
                continue
            with pytest.raises(gradhooks.UnsupportedLossError, match=wrong):
                gh.backward(scaler.scale(fn(model(x), y)))
        for name, fn in right.items():
            gh.backward(scaler.scale(fn(model(x), y)))
            assert_close_to_loop(gh.per_sample_grads(), loop_grads(model, fn, x, y),
                                 torch.float64)


def test_not_recognised_says_nothing():
    """A sum of loss terms, class weights, a batch of one, .sum() of a model output: not
    judged."""
    model = mlp()
    x, y = data()
    with gradhooks.attach(model, loss_reduction="mean") as gh:
        out = model(x)
        gh.backward(F.cross_entropy(out, y, reduction="sum") + 0.0 * out.sum(), retain_graph=True)
        gh.backward(F.cross_entropy(out, y, reduction="sum", weight=torch.ones(4).double()))
        gh.backward(F.cross_entropy(model(x[:1]), y[:1], reduction="sum"))
        gh.backward((model(x) ** 2).sum())  # .sum() of a model output: a pseudo-loss
    check_batch_loss(torch.zeros((), requires_grad=True), 4, "mean")  # a leaf
    check_batch_loss(F.cross_entropy(model(x), y, reduction="sum"), None, "mean")  # no batch


# ------------------------------------------------------------------ (c) clipped_backward
def test_clipped_backward_broadcast_loss_refused():
    model = mlp()
    x, y = data()
    with gradhooks.attach(model, loss_reduction="mean") as gh:
        loss = F.cross_entropy(model(x), y)
        with pytest.raises(gradhooks.UnsupportedLossError, match="broadcast"):
            gh.clipped_backward(loss.expand(4), 1.0)
        norms = gh.clipped_backward(F.cross_entropy(model(x), y, reduction="none"), 1.0)
        assert norms.shape == (4,)


def test_check_keeps_nothing_alive():
    model = gpt2()
    ids, labels = padded()
    with gradhooks.attach(model, loss_reduction="mean") as gh:
        out = model(ids, labels=labels)
        ref = weakref.ref(out.logits)
        with pytest.raises(gradhooks.UnsupportedLossError) as info:
            gh.backward(out.loss)
        del out, info
        gc.collect()
        assert ref() is None


def test_freed_graph_left_to_autograd():
    model = gpt2()
    ids, labels = padded((8, 8, 8))
    with gradhooks.attach(model, loss_reduction="mean") as gh:
        loss = model(ids, labels=labels).loss
        gh.backward(loss)
        with pytest.raises(RuntimeError, match="second time|freed") as info:
            gh.backward(loss)
        assert not isinstance(info.value, gradhooks.UnsupportedLossError)
