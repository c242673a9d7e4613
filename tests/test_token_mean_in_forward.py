"""A token-level mean loss computed inside the forward (issue 29, first row): transformers'
``model(ids, labels=labels).loss`` on a padded batch is one mean over all ``N`` valid tokens,
so per-sample gradients read after a plain ``loss.backward()`` would be ``B N_n / N`` times each
sample's own token-mean gradient; the reads refuse them (gradhooks.core.analysis.token_means), on the
tracked first forward and on the untracked later ones of the same input signature. Unpadded
batches (equal counts) are exact against a loop of each sample alone with its own loss.
GPT-2 and BART from tiny configs, float64, no dropout.
"""
import pytest
import torch

import gradhooks
from gradhooks.base.errors import UnsupportedLossError

import zoo_imports

zoo_imports.import_torchvision()
import transformers  # noqa: E402  (the test extra; after the torchvision stub)

V, T = 61, 8
VALID = (7, 4, 2)  # predicted tokens per sample (GPT-2: labels[n, :VALID[n] + 1] kept)


def gpt2():
    torch.manual_seed(0)
    return zoo_imports.tiny_gpt2(V, positions=32)


def bart():
    torch.manual_seed(0)
    cfg = transformers.BartConfig(vocab_size=V, d_model=32, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=2, decoder_attention_heads=2,
                                  encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
                                  dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                                  pad_token_id=1, bos_token_id=0, eos_token_id=2,
                                  decoder_start_token_id=2, forced_eos_token_id=None)
    return transformers.BartForConditionalGeneration(cfg).double()


def batch(keep):
    """ids (B, T) and labels with -100 after each sample's first ``keep[n]`` labels (ids from 3:
    BART's 0-2 are special tokens)."""
    return zoo_imports.padded_batch(keep, V, T, low=3)


GPT2_PADDED = tuple(k + 1 for k in VALID)  # (the shift drops each sample's first label)
READS = {"per_sample_grads": lambda gh: gh.per_sample_grads(),
         "norms": lambda gh: gh.per_sample_grad_norms(),
         "clip_and_accumulate": lambda gh: gh.clip_and_accumulate(1.0)}


def assert_refused(gh):
    for read in READS.values():
        with pytest.raises(UnsupportedLossError) as info:
            read(gh)
        message = str(info.value)
        assert "N_n = [7, 4, 2], N = 13" in message, message
        assert "B N_n / N" in message and "per_sample_token_loss" in message, message
        assert "gh.backward(losses.mean())" in message, message
        assert "gh.clipped_backward(losses, C)" in message, message


def forward_backward(model, ids, labels):
    model.zero_grad()
    model(ids, labels=labels).loss.backward()


def assert_close(ours, ref):
    """1e-6 relative to the largest entry: transformers' loss upcasts the logits with
    ``.float()``, so even a float64 model's loss is computed in float32."""
    assert list(ours) == list(ref)
    for name in ref:
        diff, scale = (ours[name] - ref[name]).abs().max(), ref[name].abs().max()
        assert diff <= 1e-6 * scale, f"{name}: max diff {diff:.3e} vs max |ref| {scale:.3e}"


def looped(model, ids, labels):
    """{name: (B, *shape)}: each sample alone, the gradient of its own token-mean loss."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    rows = []
    for i in range(ids.shape[0]):
        loss = model(ids[i:i + 1], labels=labels[i:i + 1]).loss
        rows.append(torch.autograd.grad(loss, [p for _, p in params], materialize_grads=True))
    return {n: torch.stack([r[k] for r in rows]) for k, (n, _) in enumerate(params)}


@pytest.mark.parametrize("read", list(READS), ids=list(READS))
def test_padded_refused_every_read(read):
    model = gpt2()
    ids, labels = batch(GPT2_PADDED)
    with gradhooks.attach(model, loss_reduction="mean") as gh:
        forward_backward(model, ids, labels)
        with pytest.raises(UnsupportedLossError, match=r"N_n = \[7, 4, 2\], N = 13"):
            READS[read](gh)


def test_padded_refused_on_later_untracked_forwards():
    model = gpt2()
    ids, labels = batch(GPT2_PADDED)
    with gradhooks.attach(model, loss_reduction="mean") as gh:
        forward_backward(model, ids, labels)  # tracked: the signature's first forward
        assert_refused(gh)
        key = next(iter(gh.recorder.placement.signatures))
        assert isinstance(gh.recorder.placement.signatures[key], dict)  # (later: untracked)
        forward_backward(model, ids, labels)
        assert gh.recorder.placement.mixing.tokens.signatures  # (watched)
        assert_refused(gh)
        # an unpadded batch of the same shape, then padded again
        forward_backward(model, ids, ids)
        gh.per_sample_grads()
        forward_backward(model, ids, labels)
        assert_refused(gh)


def test_unpadded_exact_after_padded():
    model = gpt2()
    ids, labels = batch(GPT2_PADDED)
    ref = looped(model, ids, ids)
    with gradhooks.attach(model, loss_reduction="mean") as gh:
        for _ in range(2):
            forward_backward(model, ids, labels)
            assert_refused(gh)
            forward_backward(model, ids, ids)  # equal counts: the mean of the token means
            ours = gh.per_sample_grads()
            assert_close(ours, ref)


def test_unpadded_exact():
    model = gpt2()
    ids, _ = batch(GPT2_PADDED)
    ref = looped(model, ids, ids)
    with gradhooks.attach(model, loss_reduction="mean") as gh:
        for _ in range(2):  # tracked, then untracked
            forward_backward(model, ids, ids)
            assert_close(gh.per_sample_grads(), ref)


def test_sum_over_num_items_refused():
    model = gpt2()
    ids, labels = batch(GPT2_PADDED)
    with gradhooks.attach(model, loss_reduction="mean") as gh:
        for _ in range(2):
            model.zero_grad()
            model(ids, labels=labels, num_items_in_batch=torch.tensor(13)).loss.backward()
            with pytest.raises(UnsupportedLossError, match=r"sum divided by 13"):
                gh.per_sample_grads()


def test_unused_loss_not_refused():
    # The forward computes its loss, but the user differentiates per-sample losses of the
    # logits: exact.
    model = gpt2()
    ids, labels = batch(GPT2_PADDED)
    with gradhooks.attach(model, loss_reduction="mean") as gh:
        for _ in range(2):
            model.zero_grad()
            out = model(ids, labels=labels)
            gh.backward(gradhooks.per_sample_token_loss(out.logits, labels).mean())
            gh.per_sample_grads()


def test_seq2seq_padded_refused():
    model = bart()
    ids, labels = batch(VALID)
    with gradhooks.attach(model, loss_reduction="mean") as gh:
        for _ in range(2):
            model.zero_grad()
            model(input_ids=ids, labels=labels).loss.backward()
            assert_refused(gh)
