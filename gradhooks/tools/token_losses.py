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

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["per_sample_token_loss"]


def per_sample_token_loss(logits: Optional[Tensor] = None, labels: Optional[Tensor] = None, *,
                          shift: bool = True, ignore_index: int = -100, reduction: str = "mean",
                          weight: Optional[Tensor] = None, label_smoothing: float = 0.0,
                          z_loss: float = 0.0, token_losses: Optional[Tensor] = None,
                          mask: Optional[Tensor] = None) -> Tensor:
    """``(B,)`` per-sample token losses, each normalised over its own valid tokens only.

    Cross-entropy of token logits (``logits``, ``labels``): with ``c_nt = F.cross_entropy(
    logits[n, t], labels[n, t], weight=weight, label_smoothing=label_smoothing,
    reduction="none")`` (torch's per-token term: ``w_y`` times the smoothed loss) and ``w_nt``
    the class weight of the target (``1`` without ``weight``, ``0`` for an ``ignore_index``
    label),

    ``l_n = sum_t c_nt / sum_t w_nt + z_loss * (1/N_n) sum_{t valid} logsumexp(logits[n, t])^2``

    with ``"mean"`` (torch's batch formula applied to each sample alone: a class-weighted mean
    divides by the sample's own target weights; ``N_n`` the sample's valid tokens; ``0`` for a
    sample with none), or the sums without the divisions with ``"sum"``. The z-loss term (PaLM,
    Chowdhery et al. 2022, sec. 5) is an unweighted mean over the valid tokens.

    Any other token loss: ``token_losses`` ``(B, T)`` (e.g. a focal loss, an MSE per token, a
    loss computed by another library with ``reduction="none"``) and ``mask`` ``(B, T)`` (bool,
    or float weights): ``l_n = sum_t l_nt m_nt / sum_t m_nt`` (``"mean"``, ``0`` where the
    mask is empty) or ``sum_t l_nt m_nt`` (``"sum"``); ``shift`` is not applied.

    Use it as::

        gh = gradhooks.attach(model, loss_reduction="mean")
        logits = model(input_ids).logits
        losses = gradhooks.per_sample_token_loss(logits, labels, weight=w, label_smoothing=0.1)
        gh.backward(losses.mean())      # result n: the gradient of sample n's own token mean
        # or gh.backward(losses.sum()) with loss_reduction="sum", or
        # gh.clipped_backward(losses, max_norm) for DP-SGD

    A batch loss normalised over all the batch's tokens (``F.cross_entropy`` over ``B T`` rows,
    ``num_items_in_batch``) weighs each sample by the batch's counts; gradhooks refuses it where
    they differ (:mod:`gradhooks.core.analysis.token_means`); these losses do not.

    Args:
        logits: ``(B, T, V)`` scores, batch first.
        labels: ``(B, T)`` integer class indices, ``ignore_index`` where there is no target.
        shift: ``True`` for a causal LM (transformers' convention): ``logits[:, t]`` predicts
            ``labels[:, t + 1]``, so ``logits[:, :-1]`` is paired with ``labels[:, 1:]``.
            ``False`` where the labels are already aligned with the logits (seq2seq models such
            as T5 and BART, whose decoder inputs are the labels shifted right).
        ignore_index: the label of positions without a target.
        reduction: ``"mean"`` (each sample's mean over its own valid tokens) or ``"sum"``.
        weight: ``(V,)`` class weights, as ``F.cross_entropy``'s.
        label_smoothing: in ``[0, 1]``, as ``F.cross_entropy``'s.
        z_loss: the coefficient of the z-loss term (``0``: none).
        token_losses: ``(B, T)`` token losses (instead of ``logits`` and ``labels``).
        mask: ``(B, T)`` the valid tokens of ``token_losses`` (bool or float weights).

    Returns:
        ``(B,)`` losses in the logits' (token losses') dtype promoted to at least float32 (a
        float16/bfloat16 model's logits are upcast, as transformers does), differentiable
        w.r.t. ``logits`` (``token_losses``).

    Raises:
        ValueError: ``reduction`` not ``"mean"`` or ``"sum"``; ``logits`` not ``(B, T, V)``;
            ``labels`` not integer or not ``(B, T)`` with the logits' ``B`` and ``T``;
            ``weight`` not ``(V,)``; ``token_losses`` given with ``logits`` / ``labels``, or
            ``token_losses`` and ``mask`` not both ``(B, T)`` of one shape.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"per_sample_token_loss: reduction must be 'mean' or 'sum', got "
                         f"{reduction!r}")
    if token_losses is not None or mask is not None:
        return _masked(logits, labels, token_losses, mask, reduction)
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
    if weight is not None and (not isinstance(weight, Tensor)
                               or tuple(weight.shape) != (logits.shape[2],)):
        raise ValueError(f"per_sample_token_loss: weight must be a (V,) = "
                         f"({logits.shape[2]},) tensor, got {_shape(weight)}")
    labels = labels.to(logits.device)
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    b, t, v = logits.shape
    dtype = torch.promote_types(logits.dtype, torch.float32)
    rows = logits.to(dtype).reshape(b * t, v)
    flat = labels.reshape(b * t)
    w = None if weight is None else weight.to(device=logits.device, dtype=dtype)
    tokens = F.cross_entropy(rows, flat, weight=w, ignore_index=ignore_index,
                             label_smoothing=label_smoothing, reduction="none").view(b, t)
    valid = labels != ignore_index
    sums = tokens.sum(1)
    if z_loss:
        z = torch.where(valid, torch.logsumexp(rows, 1).view(b, t).pow(2), 0).sum(1)
    if reduction == "sum":
        return sums + z_loss * z if z_loss else sums
    if w is None:
        counts = valid.sum(1).to(dtype)
        denominator = counts
    else:
        counts = valid.sum(1).to(dtype)
        denominator = torch.where(valid, w[torch.where(valid, labels, 0)], 0).sum(1)
    out = sums / torch.where(denominator == 0, 1, denominator)
    if z_loss:
        out = out + z_loss * z / counts.clamp(min=1)
    return out


def _masked(logits: Optional[Tensor], labels: Optional[Tensor], token_losses: Optional[Tensor],
            mask: Optional[Tensor], reduction: str) -> Tensor:
    # The general path: any (B, T) token losses and their mask.
    if logits is not None or labels is not None:
        raise ValueError("per_sample_token_loss: pass either logits and labels, or "
                         "token_losses and mask, not both")
    if (not isinstance(token_losses, Tensor) or not isinstance(mask, Tensor)
            or token_losses.dim() != 2 or tuple(mask.shape) != tuple(token_losses.shape)):
        raise ValueError(f"per_sample_token_loss: token_losses and mask must be (B, T) tensors "
                         f"of one shape, got {_shape(token_losses)} and {_shape(mask)}")
    dtype = torch.promote_types(token_losses.dtype, torch.float32)
    m = mask.to(device=token_losses.device, dtype=dtype)
    sums = (token_losses.to(dtype) * m).sum(1)
    if reduction == "sum":
        return sums
    counts = m.sum(1)
    return sums / torch.where(counts == 0, 1, counts)


def _shape(x: object) -> str:
    return str(tuple(x.shape)) if isinstance(x, Tensor) else type(x).__name__
