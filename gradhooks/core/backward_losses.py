"""A token-level mean loss computed outside the forward, seen from its own backward pass.

The common fine-tuning loop computes the loss after the model, and calls ``loss.backward()``::

    logits = model(ids).logits
    loss = F.cross_entropy(logits.view(-1, V), labels.view(-1))      # ignore_index=-100
    loss.backward()

That loss is a mean over all ``N = sum_n N_n`` valid tokens of the batch (``N_n``: sample
``n``'s targets that are not ``ignore_index``), so sample ``n``'s per-sample result would be
``B N_n / N`` times the gradient of its own token-mean loss (``loss_reduction="mean"``):
silently rescaled whenever the counts differ (padding). ``gh.backward(loss)`` reads the loss's
graph before the pass (:mod:`gradhooks.readers.loss_reduction`), and a loss computed inside the
forward is seen there (:mod:`gradhooks.core.token_means`); ``loss.backward()`` on a loss
computed outside shows gradhooks neither. So the first hooked grad_output of each backward pass
looks back at the pass's roots:

1. **The roots.** The tensors the pass started from are the ``t_outputs`` argument of
   ``torch.autograd.graph._engine_run_backward`` (the function ``Tensor.backward`` and
   ``torch.autograd.backward`` / ``grad`` call into the C++ engine through), read from its
   frame on this thread's stack (hooks of a CPU pass run on the thread that called backward;
   a pass on an accelerator runs them on a device thread, whose stack does not hold the frame:
   then the one thread whose stack does is taken, if exactly one does). No frame, nothing
   said. ``tests/test_token_mean_outside_forward.py`` pins this internal of torch.
2. **The loss.** From a 0-dim root's ``grad_fn`` down through constant scalings (``loss / k``
   for gradient accumulation, casts, copies) to an ``NllLossBackward0`` (``nll_loss`` /
   ``cross_entropy``) with ``reduction="mean"``, no class weights, over rows flattened from
   ``(B, T, V)`` logits batch first (the ``view`` / ``reshape`` below its ``log_softmax``
   saved those sizes). The roots' nodes have run by then, so only what autograd keeps after
   running a node is read: node types, ``reduction``, ``ignore_index``, saved sizes; never a
   saved tensor (freed).
3. **The counts.** The target is freed, but the gradient says which rows were valid: the
   gradient of a token-level cross-entropy w.r.t. a valid row of logits is
   ``(softmax - onehot) / N``, never all zero (``softmax`` has no zero entry unless a logit gap
   exceeds ~87 in float32), and exactly zero for an ignored row. So when the first hooked
   grad_output of the pass that is ``(B, T', V)`` with the loss's ``V`` arrives (the output
   layer's, usually), ``N_n`` is the count of its nonzero rows per sample. The count stays on
   the device (no sync in the backward); the read compares
   (:meth:`gradhooks.core.token_means.TokenMeans.refusal`), and equal counts pass.

Cost: one frame walk (some tens of frames) and a walk of at most :data:`_CAP` nodes per
backward pass, and one compare-and-sum over the output layer's grad_output where a token mean
was found. Not seen (nothing said, as before): ``reduction="sum"`` divided by a count
(``num_items_in_batch``; the divisor is freed by then), class weights, label smoothing, sums of
loss terms, a 2-D ``(B, V, T)`` loss input, an output layer that is not hooked.
"""
from __future__ import annotations

import sys
from typing import Optional, Tuple

import torch
from torch import Tensor

__all__ = ["backward_roots", "token_mean_rows", "valid_rows"]

#: The function whose frame holds a backward pass's root tensors (argument ``t_outputs``).
ENGINE_FRAME = "_engine_run_backward"
#: Nodes looked through at most, from a root down to its ``nll_loss``.
_CAP = 16
#: One-input nodes that keep the loss a constant multiple of what lies below.
_PASS = frozenset({"ToCopyBackward0", "CloneBackward0", "AliasBackward0", "ViewBackward0",
                   "UnsafeViewBackward0", "SqueezeBackward0", "SqueezeBackward1",
                   "UnsqueezeBackward0", "PosBackward0", "MulBackward0", "DivBackward0"})
#: Between ``nll_loss`` and the flattening of the logits.
_ROW_OPS = frozenset({"LogSoftmaxBackward0", "ToCopyBackward0", "CloneBackward0"})
_FLATTEN = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"})


def backward_roots() -> Optional[tuple]:
    """The root tensors of the backward pass running now (module docstring, step 1), or
    ``None`` where no single engine frame is found."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == ENGINE_FRAME:
            return _roots_of(frame)
        frame = frame.f_back
    found = []
    for frame in sys._current_frames().values():  # (a device thread runs the hooks)
        while frame is not None:
            if frame.f_code.co_name == ENGINE_FRAME:
                found.append(frame)
                break
            frame = frame.f_back
    return _roots_of(found[0]) if len(found) == 1 else None


def _roots_of(frame) -> Optional[tuple]:
    roots = frame.f_locals.get("t_outputs")
    if isinstance(roots, Tensor):
        return (roots,)
    if isinstance(roots, (tuple, list)) and all(isinstance(t, Tensor) for t in roots):
        return tuple(roots)
    return None


def token_mean_rows(roots: tuple, batch_size: int) -> Optional[Tuple[int, int, int, str]]:
    """``(T', V, ignore_index, what)`` when the one 0-dim root is a token-level mean
    ``nll_loss`` over ``(B, T', V)`` logits flattened batch first (module docstring, step 2),
    else ``None``. Reads only what autograd keeps of nodes that have run."""
    if len(roots) != 1 or roots[0].dim() != 0 or batch_size < 2:
        return None
    node = roots[0].grad_fn
    try:
        for _ in range(_CAP):
            if node is None:
                return None
            name = type(node).__name__
            if name == "NllLossBackward0":
                return _rows(node, batch_size)
            nexts = [n for n, _ in node.next_functions if n is not None]
            if name not in _PASS or len(nexts) != 1:
                return None
            node = nexts[0]
    except (RuntimeError, AttributeError):  # (an attribute autograd freed or never had)
        return None
    return None


def _rows(node, batch_size: int) -> Optional[Tuple[int, int, int, str]]:
    if node._saved_reduction != 1 or node._saved_weight is not None:
        return None
    ignore = int(node._saved_ignore_index)
    if ignore >= 2 ** 63:  # (saved as an unsigned 64-bit integer)
        ignore -= 2 ** 64
    below = node.next_functions[0][0]
    for _ in range(4):
        if below is None:
            return None
        name = type(below).__name__
        if name in _FLATTEN:
            sizes = tuple(below._saved_self_sym_sizes)
            if len(sizes) != 3 or sizes[0] != batch_size:
                return None
            what = (f"cross_entropy / nll_loss(reduction='mean', ignore_index={ignore}) over "
                    f"the {sizes} logits flattened to token rows, computed after the model's "
                    f"forward,")
            return int(sizes[1]), int(sizes[2]), ignore, what
        if name not in _ROW_OPS:
            return None
        below = below.next_functions[0][0]
    return None


def valid_rows(grad: Tensor, batch_size: int, tokens: int, classes: int) -> Optional[Tensor]:
    """The valid-token counts ``N_n``, shape ``(B,)`` int64, from a grad_output ``grad`` of the
    logits (module docstring, step 3); ``None`` if ``grad`` is not ``(B, T >= T', V)``."""
    if (grad.dim() != 3 or grad.shape[0] != batch_size or grad.shape[2] != classes
            or grad.shape[1] < tokens):
        return None
    with torch.no_grad():
        return (grad != 0).any(2).sum(1)
