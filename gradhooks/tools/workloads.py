"""The models, data and losses of the main job (``gradhooks bench``) and of the benchmarks
(``benchmarks/peers.py``): one home for both.

Data is real and ships with the installed packages: scikit-learn's digits and diabetes data
(imported only when loaded: ``pip install gradhooks[job]``) and the text of Python's own
``argparse.py``. Every loss reduces over samples as its workload's ``loss_reduction`` says (a
token-level mean over ``B x T`` tokens is the mean over samples of each sample's mean over its
``T`` tokens), so the per-sample gradient of every method is the gradient of sample ``n``'s own
loss. Data is deterministic: the same ``(dtype, batch)`` gives the same batch in every process.

* :data:`JOB_WORKLOADS` (``gradhooks bench``): ``cnn`` (the per-sample-gradients tutorial CNN on
  64 digits upsampled to 28x28), ``mlp`` (the seed MLP on 256 diabetes rows, sum of outputs),
  ``lstm`` (a character LSTM language model with tied decoder, 32 windows of 32 characters),
  ``transformer`` (a causal Transformer encoder layer, 16 windows of 64 characters).
* :data:`DP_WORKLOADS` (``benchmarks/dp.py``, issue 19): the five of ``BENCH_WORKLOADS``, a
  ResNet with GroupNorm on digits (``resnet_gn``, B=32) and the main job's causal
  ``nn.TransformerEncoder`` on characters (``encoder``, B=16, T=64).
* :data:`BENCH_WORKLOADS` (``benchmarks/peers.py``, issue 5): ``mlp`` and ``cnn`` as above at
  B=256 / 64, ``lstm`` (``Embedding(100,32) -> LSTM(32,64) -> Linear(64,100)``, B=32, T=32),
  ``transformer`` (``TransformerEncoderLayer(128, 4, 512)`` + ``Linear(128, 10)`` on Gaussian
  inputs, B=16, T=64) and ``wide_mlp`` (``784-512-512-10`` with ReLU on the flattened digits,
  B=128).

Not imported by ``import gradhooks``.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Workload", "JOB_WORKLOADS", "BENCH_WORKLOADS", "DP_WORKLOADS", "DigitsCNN", "CharLSTM",
           "CharTransformer", "LSTMLanguageModel", "TransformerBlock", "ResNetGN", "make_mlp",
           "make_wide_mlp",
           "load_digits_batch", "load_diabetes_batch", "load_text_batch", "text_tokens", "VOCAB"]

#: Token ids of the text workloads: the 99 most frequent characters + one for every other.
VOCAB = 100


# ------------------------------------------------------------------------------------ models
class DigitsCNN(nn.Module):
    """The CNN of PyTorch's per-sample-gradients tutorial: ``(B, 1, 28, 28) -> logits (B, 10)``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: Tensor) -> Tensor:
        """``x``: ``(B, 1, 28, 28)``; returns logits ``(B, 10)``."""
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        x = torch.flatten(F.max_pool2d(x, 2), 1)
        return self.fc2(F.relu(self.fc1(x)))


def make_mlp() -> nn.Sequential:
    """The MLP of the Julia forum thread: ``(B, 10) -> (B, 10)``, three Linear layers, no
    activations."""
    return nn.Sequential(nn.Linear(10, 32), nn.Linear(32, 32), nn.Linear(32, 10))


class CharLSTM(nn.Module):
    """Character-level LSTM language model: ``Embedding(100, 64) -> 2-layer LSTM(64, 64) ->
    Linear(64, 100)`` with the decoder weight tied to the embedding (Press & Wolf 2017).

    ``(B, T)`` int64 token ids -> logits ``(B, T, 100)``.
    """

    def __init__(self, vocab: int = VOCAB, dim: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, dim, layers, batch_first=True)
        self.decoder = nn.Linear(dim, vocab)
        self.decoder.weight = self.embed.weight

    def forward(self, tokens: Tensor) -> Tensor:
        """``tokens``: ``(B, T)`` int64; returns logits ``(B, T, vocab)``."""
        return self.decoder(self.lstm(self.embed(tokens))[0])


class CharTransformer(nn.Module):
    """Causal Transformer encoder on characters: token + position ``Embedding`` -> one
    ``TransformerEncoderLayer(128, 4 heads, 512, dropout=0, batch_first)`` -> ``Linear(128, 100)``.

    ``(B, T)`` int64 token ids (``T <= 64``) -> next-character logits ``(B, T, 100)``.
    """

    def __init__(self, vocab: int = VOCAB, dim: int = 128, heads: int = 4, max_len: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True),
            num_layers=1, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        """``tokens``: ``(B, T)`` int64; returns logits ``(B, T, vocab)``."""
        t = tokens.shape[1]
        positions = torch.arange(t, device=tokens.device).expand_as(tokens)
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=tokens.device)
        h = self.encoder(self.embed(tokens) + self.pos(positions), mask=mask, is_causal=True)
        return self.head(h)


class LSTMLanguageModel(nn.Module):
    """``Embedding(100, 32) -> LSTM(32, 64, batch_first) -> Linear(64, 100)``:
    tokens ``(B, T)`` (int64) -> next-token logits ``(B, T, 100)``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.lstm = nn.LSTM(32, 64, batch_first=True)
        self.head = nn.Linear(64, VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:
        """``tokens``: ``(B, T)`` int64; returns logits ``(B, T, 100)``."""
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
        """``x``: ``(B, T, 128)``; returns per-token logits ``(B, T, 10)``."""
        if self.seq_first:
            return self.head(self.block(x.transpose(0, 1))).transpose(0, 1)
        return self.head(self.block(x))


class ResNetGN(nn.Module):
    """A small ResNet with GroupNorm (the norm DP training uses instead of BatchNorm): a
    ``Conv(1, 16) -> GroupNorm(4) -> ReLU`` stem, two basic blocks (16 -> 16, 16 -> 32 with
    stride 2 and a 1x1 projection shortcut; each ``conv-GN-ReLU-conv-GN`` plus the shortcut),
    global average pooling, ``Linear(32, 10)``: ``(B, 1, 28, 28)`` -> logits ``(B, 10)``."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU())
        self.blocks = nn.ModuleList([_GNBlock(16, 16, 1), _GNBlock(16, 32, 2)])
        self.head = nn.Linear(32, 10)

    def forward(self, x: Tensor) -> Tensor:
        """``x``: ``(B, 1, 28, 28)``; returns logits ``(B, 10)``."""
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean((2, 3)))


class _GNBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.gn1 = nn.GroupNorm(4, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.gn2 = nn.GroupNorm(4, cout)
        self.short = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.GroupNorm(4, cout))
                      if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.gn2(self.conv2(F.relu(self.gn1(self.conv1(x))))) + self.short(x))


def make_wide_mlp() -> nn.Sequential:
    """``(B, 784) -> (B, 10)``: ``Linear(784,512)-ReLU-Linear(512,512)-ReLU-Linear(512,10)``."""
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 10))


# -------------------------------------------------------------------------------------- data
def load_digits_batch(dtype: torch.dtype, batch: int = 64) -> Tuple[Tensor, Tensor]:
    """The first ``batch`` handwritten digits of scikit-learn's ``load_digits``, MNIST-like.

    The 8x8 images (values 0..16) are scaled to [0, 1], upsampled bilinearly to 28x28 and
    normalised with MNIST's mean/std. Returns images ``(batch, 1, 28, 28)`` of ``dtype`` and
    labels ``(batch,)`` (int64).
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.as_tensor(digits.images[:batch], dtype=dtype).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=(28, 28), mode="bilinear", align_corners=False)
    return (x - 0.1307) / 0.3081, torch.as_tensor(digits.target[:batch], dtype=torch.long)


def load_diabetes_batch(dtype: torch.dtype, batch: int = 256) -> Tuple[Tensor, Tensor]:
    """The first ``batch`` rows of scikit-learn's ``load_diabetes``: features ``(batch, 10)`` and
    targets ``(batch,)``, both of ``dtype``."""
    from sklearn.datasets import load_diabetes

    data = load_diabetes()
    return (torch.as_tensor(data.data[:batch], dtype=dtype),
            torch.as_tensor(data.target[:batch], dtype=dtype))


@functools.lru_cache(maxsize=1)
def text_tokens() -> Tensor:
    """The characters of the standard library's ``argparse.py`` source (about 100 KB of real
    English/Python text that ships with every CPython) as token ids ``(n_chars,)`` int64, by
    frequency: the 99 most frequent characters get ``0..98``, every other character ``99``."""
    import argparse as source  # (the module whose source file is the text)

    with open(source.__file__, encoding="utf-8") as f:
        text = f.read()
    ids = {c: i for i, (c, _) in enumerate(collections.Counter(text).most_common(VOCAB - 1))}
    return torch.tensor([ids.get(c, VOCAB - 1) for c in text], dtype=torch.long)


def load_text_batch(dtype: torch.dtype, batch: int = 32, length: int = 32) -> Tuple[Tensor, Tensor]:
    """``batch`` windows of :func:`text_tokens` taken at evenly spaced offsets: inputs
    ``(batch, length)`` and next-character targets ``(batch, length)``, both int64 (``dtype``
    is unused: token ids are integers)."""
    tokens = text_tokens()
    starts = torch.linspace(0, len(tokens) - length - 2, batch).long()
    windows = torch.stack([tokens[s:s + length + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def _flat_digits(dtype: torch.dtype, batch: int) -> Tuple[Tensor, Tensor]:
    x, y = load_digits_batch(dtype, batch)
    return x.flatten(1), y


def _gaussian_batch(dtype: torch.dtype, batch: int, steps: int = 64) -> Tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(batch, steps, 128, generator=gen, dtype=torch.float64).to(dtype)
    y = torch.randint(0, 10, (batch, steps), generator=gen)
    return x, y


# ------------------------------------------------------------------------------------ losses
def _sum_of_outputs(out: Tensor, targets: Tensor) -> Tensor:
    return out.sum()


def _outputs_per_sample(out: Tensor, targets: Tensor) -> Tensor:
    return out.sum(1)


def _token_cross_entropy(out: Tensor, targets: Tensor) -> Tensor:
    # (B, T, C) logits, (B, T) targets: mean over all B*T tokens.
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))


def _cross_entropy_per_sample(out: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(out, targets, reduction="none")


def _token_cross_entropy_per_sample(out: Tensor, targets: Tensor) -> Tensor:
    # (B,): each sequence's mean token loss (their mean is _token_cross_entropy).
    return F.cross_entropy(out.transpose(1, 2), targets, reduction="none").mean(1)


# --------------------------------------------------------------------------------- workloads
@dataclasses.dataclass(frozen=True)
class Workload:
    """A model, a batch of real data and its loss.

    Attributes:
        name: the name used by ``--workloads``.
        title: a few words for plot panels.
        description: one line for the report.
        batch_size: the batch size of the report's table.
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


_CNN = Workload("cnn", "seed CNN (tutorial), digits",
                "tutorial CNN, sklearn digits upsampled to 28x28, cross-entropy (mean)",
                64, DigitsCNN, load_digits_batch, F.cross_entropy, "mean",
                _cross_entropy_per_sample)
_MLP = Workload("mlp", "seed MLP 10-32-32-10",
                "seed MLP: Linear(10,32)-Linear(32,32)-Linear(32,10), sklearn diabetes rows, "
                "sum of outputs", 256, make_mlp, load_diabetes_batch, _sum_of_outputs, "sum",
                _outputs_per_sample)

#: The main job's workloads (``gradhooks bench``).
JOB_WORKLOADS: Dict[str, Workload] = {w.name: w for w in (
    _CNN,
    _MLP,
    Workload("lstm", "char LSTM LM, T=32",
             "char LSTM LM (Embedding-2xLSTM(64)-Linear, tied decoder), 32 chars of Python's "
             "argparse.py per sample, token cross-entropy (mean)", 32, CharLSTM,
             load_text_batch, _token_cross_entropy, "mean", _token_cross_entropy_per_sample),
    Workload("transformer", "char Transformer, T=64",
             "causal Transformer encoder layer (d=128, 4 heads), 64 chars of Python's argparse.py "
             "per sample, token cross-entropy (mean)", 16, CharTransformer,
             functools.partial(load_text_batch, length=64), _token_cross_entropy, "mean",
             _token_cross_entropy_per_sample),
)}

#: The side-by-side benchmark's workloads (``benchmarks/peers.py``).
BENCH_WORKLOADS: Dict[str, Workload] = {w.name: w for w in (
    _MLP,
    _CNN,
    Workload("lstm", "LSTM LM, T=32",
             "LSTM LM: Embedding(100,32) -> LSTM(32,64) -> Linear(64,100), T=32, characters of "
             "argparse.py, next-character cross-entropy",
             32, LSTMLanguageModel, load_text_batch, _token_cross_entropy, "mean",
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

#: The DP-clipping benchmark's workloads (``benchmarks/dp.py``): the side-by-side ones, a ResNet
#: with GroupNorm and an ``nn.TransformerEncoder`` language model.
DP_WORKLOADS: Dict[str, Workload] = {**BENCH_WORKLOADS, **{w.name: w for w in (
    Workload("resnet_gn", "ResNet-GN, digits",
             "ResNet with GroupNorm (stem + 2 basic blocks, 16-32 channels) on sklearn digits "
             "upsampled to 28x28, cross-entropy (mean)", 32, ResNetGN, load_digits_batch,
             F.cross_entropy, "mean", _cross_entropy_per_sample),
    dataclasses.replace(JOB_WORKLOADS["transformer"], name="encoder",
                        title="nn.TransformerEncoder LM, T=64"),
)}}
