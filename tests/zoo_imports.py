"""Import torchvision (and with it transformers, whose image utilities import it) in the test
venv, where torchvision 0.28 is a CUDA build paired with a CPU torch: its
``torchvision/_meta_registrations.py`` registers fake kernels for its C++ ops
(``torchvision::nms``, ``roi_align`` ...), which do not exist in this torch, and the import fails
with "operator torchvision::nms does not exist". The model constructors the tests use need none
of those ops, so when (and only when) that import fails, an empty module stands in for
``torchvision._meta_registrations`` and the import is retried. A torchvision that imports
cleanly is left alone."""
import sys
import types

import torch
from torch import nn


def import_torchvision():
    """``torchvision`` (in the ``test`` extra: an ImportError is a broken install, raised)."""
    try:
        import torchvision
        return torchvision
    except RuntimeError as e:
        if "torchvision::" not in str(e):
            raise
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        del sys.modules[name]
    sys.modules["torchvision._meta_registrations"] = types.ModuleType("torchvision._meta_registrations")
    import torchvision
    return torchvision


import_torchvision()


class TokensToLogits(nn.Module):
    """``ids (B, T) -> logits``: a transformers model called as people call it (shared by the
    zoo and the real-size tier). ``batched_positions``: pass ``position_ids`` expanded to the
    batch; ``decoder``: an encoder-decoder whose decoder reads the reversed ids."""

    def __init__(self, model, batched_positions=False, decoder=False):
        super().__init__()
        self.model, self.batched_positions, self.decoder = model, batched_positions, decoder

    def forward(self, ids):
        kwargs = {}
        if self.batched_positions:
            kwargs["position_ids"] = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        if self.decoder:
            kwargs["decoder_input_ids"] = ids.flip(1)
        return self.model(input_ids=ids, **kwargs).logits


class ImageLogits(nn.Module):
    """``pixel_values (B, 3, H, W) -> logits``: a transformers image classifier's default call
    (its output object's logits), for the zoo and the image-model tests."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(pixel_values=x).logits


def tiny_gpt2(vocab: int, positions: int = 16) -> nn.Module:
    """A 2-layer GPT-2 language model from a tiny config (width 32, no dropout), float64: the
    padded-token tests' model (tests/test_token_losses.py, test_loss_reduction.py,
    test_token_mean_in_forward.py)."""
    import transformers
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=vocab,
                                  n_positions=positions, bos_token_id=0, eos_token_id=0,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg).double()


def tiny_t5(vocab: int) -> nn.Module:
    """A 2-layer T5 from a tiny config (width 32, no dropout), float64 (as :func:`tiny_gpt2`)."""
    import transformers
    cfg = transformers.T5Config(vocab_size=vocab, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                num_heads=4, decoder_start_token_id=0, dropout_rate=0.0)
    return transformers.T5ForConditionalGeneration(cfg).double()


def padded_batch(valid, vocab: int, length: int, low: int = 1):
    """Token ids ``(B, length)`` drawn from ``[low, vocab)`` and their labels, ``-100`` after
    each sample's first ``valid[n]`` (transformers' ``ignore_index``)."""
    ids = torch.randint(low, vocab, (len(valid), length))
    labels = ids.clone()
    for n, k in enumerate(valid):
        labels[n, k:] = -100
    return ids, labels


def routing_margin(model, ids) -> float:
    """The smallest gap, over the batch's tokens and the model's top-k routers (modules named
    ``*TopKRouter``, returning ``(logits, ...)``), between the k-th and (k+1)-th router
    probability, in float64. A float32 comparison with a loop of batch-of-one passes is only
    meaningful where rounding cannot change the experts a token goes to (a tie at the top-k's
    kink): float32 rounds the probabilities at about 1e-7."""
    gaps, handles = [], []
    for m in model.modules():
        if type(m).__name__.endswith("TopKRouter"):
            handles.append(m.register_forward_hook(lambda mod, inp, out: gaps.append(
                torch.softmax(out[0].double(), -1).sort(-1, descending=True).values
                [:, mod.top_k - 1:mod.top_k + 1].diff(dim=-1).abs().min())))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    assert gaps, "no *TopKRouter module ran"
    return float(min(gaps))
