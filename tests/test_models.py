"""Whole models end to end against looped autograd: the models people train, unchanged.

Each model except the last is attached with ``strict=True``: every module with parameters must
have a dedicated rule (no fallback).
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import gradhooks
from gradhooks.tools.workloads import CharLSTM

from conftest import assert_close_to_loop


class BiGRUClassifier(nn.Module):
    """Embedding -> bidirectional GRU over a padded PackedSequence -> Linear on [h_fwd, h_bwd]."""

    def __init__(self, vocab=12, dim=6, hidden=5, classes=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.gru = nn.GRU(dim, hidden, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * hidden, classes)

    def forward(self, tokens, lengths):
        packed = pack_padded_sequence(self.embed(tokens), lengths, batch_first=True, enforce_sorted=False)
        _, h = self.gru(packed)
        return self.head(torch.cat([h[0], h[1]], dim=1))


class TransformerClassifier(nn.Module):
    """Embedding -> 2-layer TransformerEncoder (batch_first, padding mask) -> mean pool -> Linear."""

    def __init__(self, vocab=12, dim=8, heads=2, classes=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        layer = nn.TransformerEncoderLayer(dim, heads, 16, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens, lengths):
        pad = torch.arange(tokens.shape[1]) >= lengths[:, None]
        h = self.encoder(self.embed(tokens), src_key_padding_mask=pad)
        h = h.masked_fill(pad[..., None], 0.0).sum(1) / lengths[:, None].to(h.dtype)
        return self.head(h)


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.gn1 = nn.GroupNorm(2, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.gn2 = nn.GroupNorm(2, cout)
        self.short = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.GroupNorm(2, cout))
                      if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        h = F.relu(self.gn1(self.conv1(x)), inplace=True)
        return F.relu(self.gn2(self.conv2(h)) + self.short(x))


class SmallResNet(nn.Module):
    def __init__(self, classes=3):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(inplace=True))
        self.blocks = nn.Sequential(BasicBlock(4, 4, 1), BasicBlock(4, 8, 2))
        self.head = nn.Linear(8, classes)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class LearnedTemperature(nn.Module):
    """A custom layer only the fallback covers: softplus-parametrised per-class temperature."""

    def __init__(self, classes):
        super().__init__()
        self.raw = nn.Parameter(torch.randn(classes))

    def forward(self, logits):
        return logits / F.softplus(self.raw)


def _tokens(b, t, vocab=12):
    lengths = torch.randint(1, t + 1, (b,))
    lengths[0] = t
    tokens = torch.randint(1, vocab, (b, t)).masked_fill(torch.arange(t) >= lengths[:, None], 0)
    return tokens, lengths


def _lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _looped(model, loss_fn, inputs, targets):
    """One forward + backward per sample (inputs: tuple of tensors batched on dim 0)."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    rows = {n: [] for n in params}
    for i in range(targets.shape[0]):
        model.zero_grad(set_to_none=True)
        loss_fn(model(*(x[i:i + 1] for x in inputs)), targets[i:i + 1]).backward()
        for n, p in params.items():
            rows[n].append(torch.zeros_like(p) if p.grad is None else p.grad.clone())
    model.zero_grad(set_to_none=True)
    return {n: torch.stack(r) for n, r in rows.items()}


def _case(name, batch):
    if name == "char-lstm-lm-tied":
        model = CharLSTM(vocab=15, dim=6, layers=2)
        tokens = torch.randint(0, 15, (batch, 7))
        return model, (tokens[:, :-1],), tokens[:, 1:], _lm_loss, True
    if name == "bigru-packed":
        tokens, lengths = _tokens(batch, 6)
        return BiGRUClassifier(), (tokens, lengths), torch.randint(0, 3, (batch,)), F.cross_entropy, True
    if name == "transformer-classifier":
        tokens, lengths = _tokens(batch, 5)
        return TransformerClassifier(), (tokens, lengths), torch.randint(0, 3, (batch,)), F.cross_entropy, True
    if name == "resnet-groupnorm":
        return SmallResNet(), (torch.randn(batch, 2, 6, 6),), torch.randint(0, 3, (batch,)), F.cross_entropy, True
    if name == "custom-fallback":
        model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3), LearnedTemperature(3))
        return model, (torch.randn(batch, 4),), torch.randint(0, 3, (batch,)), F.cross_entropy, False
    raise KeyError(name)


MODELS = ["char-lstm-lm-tied", "bigru-packed", "transformer-classifier", "resnet-groupnorm", "custom-fallback"]


@pytest.mark.filterwarnings("ignore::gradhooks.FallbackWarning")
@pytest.mark.parametrize("batch", [1, 4], ids=["B1", "B4"])
@pytest.mark.parametrize("name", MODELS)
def test_whole_model_matches_loop(name, batch, dtype):
    model, inputs, targets, loss_fn, strict = _case(name, batch)
    model = model.to(dtype)
    inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)
    ref = _looped(model, loss_fn, inputs, targets)
    with gradhooks.attach(model, loss_reduction="mean", strict=strict) as gh:
        loss_fn(model(*inputs), targets).backward()
        ours = gh.per_sample_grads()
    ref = {n: r for n, r in ref.items() if n in ours or r.abs().max() > 0}
    assert_close_to_loop(ours, ref, dtype)


def test_the_tied_lm_has_one_entry_for_the_tied_weight():
    model = CharLSTM(vocab=15, dim=6, layers=2)
    tokens = torch.randint(0, 15, (3, 5))
    with gradhooks.attach(model, strict=True) as gh:
        _lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        names = list(gh.per_sample_grads())
        assert model.decoder.weight.grad_sample.shape == (3, 15, 6)  # the same Parameter object
    assert "embed.weight" in names and "decoder.weight" not in names
