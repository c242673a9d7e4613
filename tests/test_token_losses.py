"""gradhooks.per_sample_token_loss (issue 29): per-sample token losses of causal-LM (GPT-2) and
seq2seq (T5) models from tiny configs (no dropout), float64, padded labels (-100) with uneven
valid-token counts and an all-padding sample. Per-sample gradients of
``gh.backward(losses.mean())`` against a loop of each sample alone computing its own token-mean
loss (1e-10 relative to the largest entry; T5: 1e-6, see :func:`tolerance`), and the DP clipped
sums (book-keeping and two-pass) against the clipped sum of the looped gradients.
"""
import pytest
import torch
import torch.nn.functional as F

import gradhooks

import zoo_imports
from conftest import RTOL, assert_close_to_loop

zoo_imports.import_torchvision()
import transformers  # noqa: E402,F401  (the test extra; after the torchvision stub)

V, T = 50, 8


def gpt2():
    return zoo_imports.tiny_gpt2(V)


def t5():
    return zoo_imports.tiny_t5(V)


def batch(valid):
    """ids (B, T) and labels with -100 after each sample's first ``valid[n]`` labels."""
    return zoo_imports.padded_batch(valid, V, T)


def logits_of(model, seq2seq, ids, labels):
    if seq2seq:  # the decoder reads the labels shifted right (-100 -> pad), as in training
        return model(input_ids=ids, labels=labels).logits
    return model(ids).logits


def looped(model, seq2seq, ids, labels):
    """{name: (B, *shape)}: each sample alone, the gradient of its own token-mean loss."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    rows = []
    for i in range(ids.shape[0]):
        logits = logits_of(model, seq2seq, ids[i:i + 1], labels[i:i + 1])
        loss = gradhooks.per_sample_token_loss(logits, labels[i:i + 1], shift=not seq2seq)[0]
        rows.append(torch.autograd.grad(loss, [p for _, p in params], materialize_grads=True))
    return {n: torch.stack([r[k] for r in rows]) for k, (n, _) in enumerate(params)}


def clipped_sum(ref, max_norm):
    norms = sum(g.flatten(1).pow(2).sum(1) for g in ref.values()).sqrt()
    factors = (max_norm / norms).clamp(max=1.0)
    return norms, {n: torch.einsum("n,n...->...", factors, g) for n, g in ref.items()}


def between(norms):
    """A clipping bound strictly between the two smallest nonzero norms (no tie)."""
    s = norms[norms > 0].sort().values
    return float(s[0] + s[1]) / 2 if len(s) > 1 else float(s[0]) / 2


def tolerance(seq2seq):
    """1e-10 relative to the largest entry; T5: 1e-6. T5's RMS norm forms its variance in
    float32, so the backward of ``losses.mean()`` carries ``1/B``-scaled gradients through
    float32 ops and the per-sample results (times ``B``) differ from each sample's own gradient
    by float32 rounding (exact for ``B`` a power of two)."""
    return 1e-6 if seq2seq else RTOL[torch.float64]


def assert_close(ours, ref, seq2seq):
    if not seq2seq:
        return assert_close_to_loop(ours, ref, torch.float64)
    assert list(ours) == list(ref)
    for n, g in ref.items():
        assert (ours[n] - g).abs().max() <= tolerance(seq2seq) * g.abs().max(), n


MODELS = {"gpt2": (gpt2, False), "t5": (t5, True)}
# shifted (causal LM) valid counts: 7, 4, 2 (and 0: all padding)
CASES = {"B1": [8], "B3-uneven": [8, 5, 3], "B4-all-padding": [8, 5, 3, 0]}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
@pytest.mark.parametrize("name", MODELS, ids=list(MODELS))
def test_per_sample_grads_of_own_token_mean(name, case):
    build, seq2seq = MODELS[name]
    model = build()
    ids, labels = batch(CASES[case])
    ref = looped(model, seq2seq, ids, labels)
    with gradhooks.attach(model, loss_reduction="mean") as gh:
        losses = gradhooks.per_sample_token_loss(logits_of(model, seq2seq, ids, labels),
                                                 labels, shift=not seq2seq)
        assert losses.shape == (len(CASES[case]),) and losses.dtype == torch.float64
        gh.backward(losses.mean())
        ours = gh.per_sample_grads()
    assert_close(ours, ref, seq2seq)
    if 0 in CASES[case]:
        assert all(g[-1].abs().max() == 0 for g in ours.values())


@pytest.mark.parametrize("name", MODELS, ids=list(MODELS))
def test_sum_reduction(name):
    build, seq2seq = MODELS[name]
    model = build()
    ids, labels = batch([8, 5, 3])
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        logits = logits_of(model, seq2seq, ids, labels)
        sums = gradhooks.per_sample_token_loss(logits, labels, shift=not seq2seq,
                                               reduction="sum")
        gh.backward(sums.sum())
        ours = gh.per_sample_grads()
    params = [(n, p) for n, p in model.named_parameters()]
    rows = []
    for i in range(3):
        logits = logits_of(model, seq2seq, ids[i:i + 1], labels[i:i + 1])
        s = gradhooks.per_sample_token_loss(logits, labels[i:i + 1], shift=not seq2seq,
                                            reduction="sum")[0]
        rows.append(torch.autograd.grad(s, [p for _, p in params], materialize_grads=True))
    ref = {n: torch.stack([r[k] for r in rows]) for k, (n, _) in enumerate(params)}
    assert_close_to_loop(ours, ref, torch.float64)


@pytest.mark.parametrize("how", ["clip_and_accumulate", "clipped_backward"])
@pytest.mark.parametrize("name", MODELS, ids=list(MODELS))
def test_clipped_sum(name, how):
    build, seq2seq = MODELS[name]
    model = build()
    ids, labels = batch([8, 5, 3, 0])
    ref = looped(model, seq2seq, ids, labels)
    norms_ref, _ = clipped_sum(ref, 1.0)
    max_norm = between(norms_ref)
    _, want = clipped_sum(ref, max_norm)
    model.zero_grad(set_to_none=True)
    with gradhooks.attach(model, loss_reduction="mean") as gh:
        losses = gradhooks.per_sample_token_loss(logits_of(model, seq2seq, ids, labels),
                                                 labels, shift=not seq2seq)
        if how == "clipped_backward":
            norms = gh.clipped_backward(losses, max_norm)
        else:
            gh.backward(losses.mean())
            norms = gh.clip_and_accumulate(max_norm)
    tol = tolerance(seq2seq)
    assert (norms - norms_ref).abs().max() <= tol * norms_ref.max()
    assert ((norms_ref < max_norm) & (norms_ref > 0)).any() and (norms_ref > max_norm).any()
    for n, p in model.named_parameters():
        expected = want[n] / ids.shape[0]  # loss_reduction="mean": the clipped sum over B
        assert (p.grad - expected).abs().max() <= tol * expected.abs().max(), n


def test_matches_transformers_losses():
    """The conventions: GPT-2's loss (shift) and T5's (no shift) are the token means of these."""
    ids, labels = batch([8, 5, 3])
    for build, seq2seq in MODELS.values():
        model = build()
        out = model(input_ids=ids, labels=labels)
        sums = gradhooks.per_sample_token_loss(out.logits, labels, shift=not seq2seq,
                                               reduction="sum")
        means = gradhooks.per_sample_token_loss(out.logits, labels, shift=not seq2seq)
        counts = (labels[:, 1:] if not seq2seq else labels).ne(-100).sum(1)
        # (GPT-2's loss casts the logits to float32: logits.float())
        torch.testing.assert_close(out.loss.double(), sums.sum() / counts.sum(), rtol=1e-6,
                                   atol=0)
        torch.testing.assert_close(means * counts, sums, rtol=1e-12, atol=0)


def test_helper_shapes_dtypes_and_errors():
    logits = torch.randn(3, 5, 7, dtype=torch.float16, requires_grad=True)
    labels = torch.randint(0, 7, (3, 5))
    labels[2] = -100
    out = gradhooks.per_sample_token_loss(logits, labels)
    assert out.shape == (3,) and out.dtype == torch.float32 and out[2] == 0
    ref = F.cross_entropy(logits[0, :-1].float(), labels[0, 1:])
    torch.testing.assert_close(out[0], ref)
    out.sum().backward()
    assert logits.grad.shape == logits.shape
    empty = gradhooks.per_sample_token_loss(torch.randn(0, 5, 7), torch.zeros(0, 5).long())
    assert empty.shape == (0,)
    with pytest.raises(ValueError, match="reduction"):
        gradhooks.per_sample_token_loss(logits, labels, reduction="none")
    with pytest.raises(ValueError, match=r"\(B, T, V\)"):
        gradhooks.per_sample_token_loss(logits[0], labels)
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        gradhooks.per_sample_token_loss(logits, labels[:, :4])
    with pytest.raises(ValueError, match="integer"):
        gradhooks.per_sample_token_loss(logits, labels.float())
    assert "per_sample_token_loss" in gradhooks.__all__
