"""A token-level mean loss computed after the forward, then a plain ``loss.backward()`` (issue 29,
first row, in the hand-written fine-tuning loop): the loss is a mean over all ``N`` valid tokens
of the batch, so per-sample results would be ``B N_n / N`` times each sample's own token-mean
gradient. The backward's roots show the loss (gradhooks.core.analysis.backward_losses) and the reads
refuse it; equal counts, one sample, and per-sample losses stay exact against a loop of each
sample alone with its own loss. GPT-2 from a tiny config, float64 and float32, no dropout.
"""
import inspect

import pytest
import torch
import torch.nn.functional as F

import gradhooks
from gradhooks.base.errors import UnsupportedLossError
from gradhooks.core.analysis.backward_losses import ENGINE_FRAME

import zoo_imports

zoo_imports.import_torchvision()
import transformers  # noqa: E402,F401  (the test extra; after the torchvision stub)

V, T = 61, 8
KEEP = (8, 5, 3)  # labels kept per sample; the shift predicts (7, 4, 2) tokens
READS = {"per_sample_grads": lambda gh: gh.per_sample_grads(),
         "norms": lambda gh: gh.per_sample_grad_norms(),
         "clip_and_accumulate": lambda gh: gh.clip_and_accumulate(1.0)}


def model_of(dtype):
    torch.manual_seed(0)
    return zoo_imports.tiny_gpt2(V, positions=32).to(dtype)


def sliced(model, logits, labels):
    """The loss of most hand-written loops: shift by slicing, flatten, one cross_entropy."""
    return F.cross_entropy(logits[:, :-1].contiguous().view(-1, V), labels[:, 1:].reshape(-1))


def library(model, logits, labels):
    """transformers' own causal-LM loss (``ForCausalLMLoss``: upcast, pad the labels, flatten),
    called after the forward."""
    return model.loss_function(logits, labels, vocab_size=V)


def accumulated(model, logits, labels):
    """Gradient accumulation over 4 micro-batches: a constant scaling above the mean."""
    return sliced(model, logits, labels) / 4


LOSSES = {"sliced": sliced, "library": library, "accumulated": accumulated}


def step(model, ids, labels, loss_fn):
    model.zero_grad()
    loss_fn(model, model(ids).logits, labels).backward()


def looped(model, ids, labels, loss_fn):
    """{name: (B, *shape)}: each sample alone, the gradient of its own token-mean loss."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    rows = []
    for i in range(ids.shape[0]):
        loss = loss_fn(model, model(ids[i:i + 1]).logits, labels[i:i + 1])
        rows.append(torch.autograd.grad(loss, [p for _, p in params], materialize_grads=True))
    return {n: torch.stack([r[k] for r in rows]) for k, (n, _) in enumerate(params)}


def assert_close(ours, ref, dtype):
    """Relative to each gradient's largest entry: 1e-6 in float64 (transformers' own loss
    upcasts the logits to float32), 1e-4 in float32."""
    tol = 1e-6 if dtype == torch.float64 else 1e-4
    assert list(ours) == list(ref)
    for name in ref:
        diff, scale = (ours[name] - ref[name]).abs().max(), ref[name].abs().max()
        assert diff <= tol * scale, f"{name}: max diff {diff:.3e} vs max |ref| {scale:.3e}"


def test_engine_frame_is_torchs():
    # The roots are read from this function's frame: a torch that renames it or its argument
    # turns the check off silently, so this pins it.
    from torch.autograd import graph
    engine = getattr(graph, ENGINE_FRAME)
    assert list(inspect.signature(engine).parameters)[0] == "t_outputs"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("read", list(READS))
def test_padded_refused(read, loss, dtype):
    model = model_of(dtype)
    ids, labels = zoo_imports.padded_batch(KEEP, V, T)
    with gradhooks.attach(model, loss_reduction="mean") as gh:
        for _ in range(2):  # the tracked first forward, then an untracked one
            step(model, ids, labels, LOSSES[loss])
            with pytest.raises(UnsupportedLossError) as info:
                READS[read](gh)
            message = str(info.value)
            assert "N_n = [7, 4, 2], N = 13" in message, message
            assert "computed after the model's forward" in message, message
            assert "per_sample_token_loss" in message and "B N_n / N" in message, message


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_unpadded_exact(loss, dtype):
    # Equal counts: the batch's token mean is the mean of the samples' token means.
    model = model_of(dtype)
    ids, _ = zoo_imports.padded_batch(KEEP, V, T)
    ref = looped(model, ids, ids, LOSSES[loss])
    with gradhooks.attach(model, loss_reduction="mean") as gh:
        for _ in range(2):
            step(model, ids, ids, LOSSES[loss])
            assert_close(gh.per_sample_grads(), ref, dtype)  # (the loop's losses are / 4 too)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_one_sample_exact(dtype):
    # B = 1: the batch's token mean is the sample's own.
    model = model_of(dtype)
    ids, labels = zoo_imports.padded_batch(KEEP[1:2], V, T)
    ref = looped(model, ids, labels, sliced)
    with gradhooks.attach(model, loss_reduction="mean") as gh:
        step(model, ids, labels, sliced)
        assert_close(gh.per_sample_grads(), ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_per_sample_losses_padded_exact(dtype):
    # The fix the message gives, with a plain loss.backward(): no refusal, exact.
    model = model_of(dtype)
    ids, labels = zoo_imports.padded_batch(KEEP, V, T)

    def own(model, logits, labels):
        return gradhooks.per_sample_token_loss(logits, labels).mean()

    ref = looped(model, ids, labels, own)
    with gradhooks.attach(model, loss_reduction="mean") as gh:
        for _ in range(2):
            step(model, ids, labels, own)
            assert_close(gh.per_sample_grads(), ref, dtype)
