"""The five workloads of the side-by-side benchmark (issue 5): a model, a batch of data and its
loss each, built the same way for every method.

* ``mlp``, B=256: the seed MLP ``Linear(10,32)-Linear(32,32)-Linear(32,10)`` on scikit-learn's
  diabetes rows, loss = sum of the outputs (as ``gradhooks bench``).
* ``cnn``, B=64: the per-sample-gradients tutorial CNN (``gradhooks.cli.DigitsCNN``) on
  scikit-learn's digits upsampled to 28x28, cross-entropy (mean).
* ``lstm``, B=32, T=32: LSTM language model ``Embedding(100,32) -> LSTM(32,64) ->
  Linear(64,100)`` on the characters of ``argparse.py`` (ships with Python), next-character
  cross-entropy (mean over the ``B x T`` tokens).
* ``transformer``, B=16, T=64: ``nn.TransformerEncoderLayer(128, 4, 512, dropout=0,
  batch_first=True)`` + ``Linear(128, 10)`` head on Gaussian inputs ``(B, 64, 128)``, per-token
  cross-entropy (mean) against random classes.
* ``wide_mlp``, B=128: ``784-512-512-10`` MLP with ReLU on the digits (flattened 28x28),
  cross-entropy (mean).

Every loss reduces over samples as its ``loss_reduction`` says (a token-level mean over
``B x T`` tokens is the mean over samples of each sample's mean over its ``T`` tokens), so the
per-sample gradient of every method is the gradient of sample ``n``'s own loss and can be checked
against :func:`gradhooks.looped_per_sample_grads`. Data is deterministic: the same
``(dtype, batch)`` gives the same batch in every process.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradhooks.cli import DigitsCNN, load_diabetes_batch, load_digits_batch, make_mlp

__all__ = ["Workload", "WORKLOADS", "LSTMLanguageModel", "TransformerBlock", "text_tokens"]

VOCAB = 100  # token ids of the LSTM LM


class LSTMLanguageModel(nn.Module):
    """``Embedding(100, 32) -> LSTM(32, 64, batch_first) -> Linear(64, 100)``:
    tokens ``(B, T)`` (int64) -> next-token logits ``(B, T, 100)``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.lstm = nn.LSTM(32, 64, batch_first=True)
        self.head = nn.Linear(64, VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:
        out, _ = self.lstm(self.emb(tokens))
        return self.head(out)


class TransformerBlock(nn.Module):
    """``TransformerEncoderLayer(128, 4 heads, 512, dropout=0)`` + ``Linear(128, 10)``:
    ``(B, T, 128) -> (B, T, 10)`` per-token logits.

    ``seq_first=True`` computes the same function with the layers in torch's ``(T, B, d)`` layout
    inside (same parameter names and shapes), for Opacus: its ``DPMultiheadAttention`` with
    ``batch_first=True`` computes a different function (opacus 1.6).
    """

    def __init__(self, seq_first: bool = False) -> None:
        super().__init__()
        self.seq_first = seq_first
        self.block = nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, batch_first=not seq_first)
        self.head = nn.Linear(128, 10)

    def forward(self, x: Tensor) -> Tensor:
        if self.seq_first:
            return self.head(self.block(x.transpose(0, 1))).transpose(0, 1)
        return self.head(self.block(x))


def make_wide_mlp() -> nn.Sequential:
    """``(B, 784) -> (B, 10)``: ``Linear(784,512)-ReLU-Linear(512,512)-ReLU-Linear(512,10)``."""
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 10))


@functools.lru_cache(maxsize=1)
def text_tokens() -> Tensor:
    """Characters of ``argparse.py`` (ships with every CPython) as token ids in ``[0, 100)``:
    printable ASCII 32..126 -> 1..95, newline -> 96, anything else -> 0. Shape ``(n_chars,)``."""
    import argparse

    with open(argparse.__file__, encoding="utf-8") as f:
        text = f.read()
    ids = [ord(c) - 31 if 32 <= ord(c) <= 126 else 96 if c == "\n" else 0 for c in text]
    return torch.tensor(ids, dtype=torch.long)


def _text_batch(dtype: torch.dtype, batch: int, steps: int = 32) -> Tuple[Tensor, Tensor]:
    # B consecutive windows of T+1 characters: inputs (B, T) and next-character targets (B, T).
    tokens = text_tokens()
    need = batch * (steps + 1)
    if need > tokens.numel():
        raise ValueError(f"batch {batch} needs {need} characters, the text has {tokens.numel()}")
    windows = tokens[:need].view(batch, steps + 1)
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def _gaussian_batch(dtype: torch.dtype, batch: int, steps: int = 64) -> Tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(batch, steps, 128, generator=gen, dtype=torch.float64).to(dtype)
    y = torch.randint(0, 10, (batch, steps), generator=gen)
    return x, y


def _flat_digits(dtype: torch.dtype, batch: int) -> Tuple[Tensor, Tensor]:
    x, y = load_digits_batch(dtype, batch)
    return x.flatten(1), y


def _sum_of_outputs(out: Tensor, targets: Tensor) -> Tensor:
    return out.sum()


def _token_cross_entropy(out: Tensor, targets: Tensor) -> Tensor:
    # (B, T, C) logits, (B, T) targets: mean over all B*T tokens.
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))


def _outputs_per_sample(out: Tensor, targets: Tensor) -> Tensor:
    return out.sum(1)


def _cross_entropy_per_sample(out: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(out, targets, reduction="none")


def _token_cross_entropy_per_sample(out: Tensor, targets: Tensor) -> Tensor:
    # (B,): each sequence's mean token loss (their mean is _token_cross_entropy).
    return F.cross_entropy(out.transpose(1, 2), targets, reduction="none").mean(1)


@dataclasses.dataclass(frozen=True)
class Workload:
    """One benchmark workload.

    Attributes:
        name: the name used by ``--workloads``.
        title: a few words for plot panels.
        description: one line for the report.
        batch_size: the batch size of the issue's table (the row reported in the table).
        make_model: builds the model in float32 (initialised from torch's global RNG).
        load: ``load(dtype, batch) -> (inputs, targets)``, both batched on dim 0.
        loss_fn: ``loss_fn(outputs, targets) -> scalar`` batch loss.
        loss_reduction: how ``loss_fn`` reduces over samples, ``"mean"`` or ``"sum"``.
        per_sample_loss: ``(outputs, targets) -> (B,)`` each sample's own loss (``loss_fn`` is
            their mean or sum, as ``loss_reduction`` says), for two-pass clipping.
        make_seq_first_model: for Opacus, if set: the same model (same parameter names, the
            state dict of ``make_model()``'s loads into it) with its layers in ``(T, B, ...)``
            layout inside; Opacus then runs with ``batch_first=False``.
    """

    name: str
    title: str
    description: str
    batch_size: int
    make_model: Callable[[], nn.Module]
    load: Callable[[torch.dtype, int], Tuple[Tensor, Tensor]]
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    loss_reduction: str
    per_sample_loss: Callable[[Tensor, Tensor], Tensor]
    make_seq_first_model: Optional[Callable[[], nn.Module]] = None


WORKLOADS: Dict[str, Workload] = {w.name: w for w in (
    Workload("mlp", "seed MLP 10-32-32-10",
             "seed MLP: Linear 10-32-32-10 on sklearn diabetes rows, sum of outputs",
             256, make_mlp, load_diabetes_batch, _sum_of_outputs, "sum", _outputs_per_sample),
    Workload("cnn", "seed CNN (tutorial), digits",
             "seed CNN (per-sample-grads tutorial) on sklearn digits 28x28, cross-entropy",
             64, DigitsCNN, load_digits_batch, F.cross_entropy, "mean",
             _cross_entropy_per_sample),
    Workload("lstm", "LSTM LM, T=32",
             "LSTM LM: Embedding(100,32) -> LSTM(32,64) -> Linear(64,100), T=32, characters of "
             "argparse.py, next-character cross-entropy",
             32, LSTMLanguageModel, _text_batch, _token_cross_entropy, "mean",
             _token_cross_entropy_per_sample),
    Workload("transformer", "Transformer block, T=64, d=128",
             "Transformer block: TransformerEncoderLayer(128, 4 heads, 512, dropout=0) + "
             "Linear(128,10), T=64, Gaussian inputs, per-token cross-entropy",
             16, TransformerBlock, _gaussian_batch, _token_cross_entropy, "mean",
             _token_cross_entropy_per_sample, functools.partial(TransformerBlock, seq_first=True)),
    Workload("wide_mlp", "wide MLP 784-512-512-10",
             "wide MLP: 784-512-512-10 (ReLU) on sklearn digits (flattened 28x28), cross-entropy",
             128, make_wide_mlp, _flat_digits, F.cross_entropy, "mean",
             _cross_entropy_per_sample),
)}
