"""Per-sample losses of token models: :func:`per_sample_token_loss`.

transformers' causal-LM and seq2seq losses (``model(input_ids, labels=labels).loss``) are one
mean over all valid tokens of the batch, ``(1/N) sum_n sum_t l_nt``: with padding (labels
``ignore_index`` after each sample's end) the samples weigh by their token counts ``N_n`` and
per-sample gradients read from it are ``B N_n / N`` times each sample's own (issue 29;
:mod:`gradhooks.readers.loss_reduction` refuses that loss). This gives the ``(B,)`` per-sample
losses to reduce over samples instead.

Index conventions: ``n`` sample (``B``), ``t`` position (``T``), ``v`` vocabulary entry (``V``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["per_sample_token_loss"]


def per_sample_token_loss(logits: Tensor, labels: Tensor, *, shift: bool = True,
                          ignore_index: int = -100, reduction: str = "mean") -> Tensor:
    """``(B,)`` per-sample cross-entropy losses of token logits, each over its own valid tokens.

    ``l_n = (1/N_n) sum_{t valid} -log softmax(logits[n, t])[labels[n, t]]`` (``"mean"``; ``0``
    for a sample with no valid token) or the sum without ``1/N_n`` (``"sum"``); a label equal
    to ``ignore_index`` is not a valid token. Use it as::

        gh = gradhooks.attach(model, loss_reduction="mean")
        logits = model(input_ids).logits
        losses = gradhooks.per_sample_token_loss(logits, labels)
        gh.backward(losses.mean())      # result n: the gradient of sample n's own token mean
        # or gh.backward(losses.sum()) with loss_reduction="sum", or
        # gh.clipped_backward(losses, max_norm) for DP-SGD

    Args:
        logits: ``(B, T, V)`` scores, batch first.
        labels: ``(B, T)`` integer class indices, ``ignore_index`` where there is no target.
        shift: ``True`` for a causal LM (transformers' convention): ``logits[:, t]`` predicts
            ``labels[:, t + 1]``, so ``logits[:, :-1]`` is paired with ``labels[:, 1:]``.
            ``False`` where the labels are already aligned with the logits (seq2seq models such
            as T5 and BART, whose decoder inputs are the labels shifted right).
        ignore_index: the label of positions without a target.
        reduction: ``"mean"`` (each sample's mean over its own valid tokens) or ``"sum"``.

    Returns:
        ``(B,)`` losses in the logits' dtype promoted to at least float32 (a float16/bfloat16
        model's logits are upcast, as transformers does), differentiable w.r.t. ``logits``.

    Raises:
        ValueError: ``reduction`` not ``"mean"`` or ``"sum"``; ``logits`` not ``(B, T, V)``;
            ``labels`` not integer or not ``(B, T)`` with the logits' ``B`` and ``T``.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"per_sample_token_loss: reduction must be 'mean' or 'sum', got "
                         f"{reduction!r}")
    if not isinstance(logits, Tensor) or logits.dim() != 3:
        raise ValueError(f"per_sample_token_loss: logits must be a (B, T, V) tensor, got "
                         f"{_shape(logits)}")
    if (not isinstance(labels, Tensor) or labels.dim() != 2
            or tuple(labels.shape) != tuple(logits.shape[:2])):
        raise ValueError(f"per_sample_token_loss: labels must be (B, T) = "
                         f"{tuple(logits.shape[:2])} like the logits, got {_shape(labels)}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise ValueError(f"per_sample_token_loss: labels must be integer class indices, got "
                         f"{labels.dtype}")
    labels = labels.to(logits.device)
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    b, t, v = logits.shape
    dtype = torch.promote_types(logits.dtype, torch.float32)
    rows = logits.to(dtype).reshape(b * t, v)
    tokens = F.cross_entropy(rows, labels.reshape(b * t), ignore_index=ignore_index,
                             reduction="none").view(b, t)
    sums = tokens.sum(1)
    if reduction == "sum":
        return sums
    counts = (labels != ignore_index).sum(1).clamp_(min=1).to(dtype)
    return sums / counts


def _shape(x) -> str:
    return str(tuple(x.shape)) if isinstance(x, Tensor) else type(x).__name__
