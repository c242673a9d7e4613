"""Whether a loss handed to gradhooks is the reduction over samples it is declared to be.

``gh.backward(loss)`` and ``gh.clipped_backward(losses, C)`` see the loss tensor, so its
autograd graph can be read before the backward runs: :func:`check_batch_loss` and
:func:`check_per_sample_losses` follow it from ``loss.grad_fn`` down through constant scalings
(``* c``, ``/ c``, dtype casts, copies; :data:`_PASS`) to the first reduction node, at most
:data:`_CAP` nodes, and never into the model. A plain ``loss.backward()`` shows gradhooks
the loss only from inside its pass, after the loss's nodes ran and freed their saved tensors:
:mod:`gradhooks.core.analysis.backward_losses` judges what is left there (cases (a) and (b) without
constant scalings), and the reads refuse.

Index conventions: ``n`` sample (``B`` of the batch), ``t`` a token of a sample, ``N_n`` the valid
(not ``ignore_index``) tokens of sample ``n``, ``N = sum_n N_n``.

Refused (:class:`~gradhooks.base.errors.UnsupportedLossError`), the rest is said nothing about:

(a) a token-level mean: ``nll_loss`` / ``cross_entropy`` with ``reduction="mean"`` over ``B T``
    rows (``(B, T, V)`` logits flattened, as transformers' causal-LM and seq2seq losses do) whose
    target holds ``ignore_index`` entries with unequal counts ``N_n``. The loss is
    ``(1/N) sum_n N_n mean_n``, so the per-sample results would be ``B N_n / N`` times the
    gradient of each sample's own token mean. Equal counts (no padding) give exactly
    ``(1/B) sum_n mean_n`` and are allowed.
(b) a reduction contradicting the declared ``loss_reduction``: ``"mean"`` declared and a sum over
    the batch not scaled (a loss function's ``reduction="sum"`` over ``B`` leading rows, or
    ``.sum()`` of its ``(B,)`` ``reduction="none"`` losses), or ``"sum"`` declared and such a
    mean not scaled (the results would be ``B`` times, or ``1/B`` times, the own-loss
    gradients). A scaled one (``loss_sum / B``) is not judged, nor ``.sum()`` / ``.mean()`` of
    anything else (``model(x).sum()``, a pseudo-loss of many tests and probes).
(c) per-sample losses (``clipped_backward``) that are one batch loss broadcast to ``(B,)``: each
    entry then depends on every sample and clipping bounds nothing per sample.

(d) a loss scaled by a ``torch.amp.GradScaler`` (``scaler.scale(loss)``: ``loss * scaler._scale``,
    a float32 0-dim tensor): :func:`loss_scale_of` hands its scale tensor to the recorder, which
    reads this batch at it where no ``grad_scaler`` was given to ``attach``
    (:meth:`gradhooks.core.recorder.batch_reads.BatchReads.see_scale`); (a) and (b) judge the loss below it.

(e) a loss whose split into per-sample terms the graph does not prove (issue 38; anything but
    ``.mean()`` / ``.sum()`` of a ``(B,)`` tensor below constant scalings: class weights, label
    smoothing, ``loss + aux``, ``/ num_items_in_batch``, a masked mean): the valid-target counts
    of the ``nll_loss`` nodes below it (their saved targets; a class-weighted mean's per-sample
    weight sums) are noted, and the pass's first ``(B, T, D)`` grad_output gives the nonzero
    token rows per sample (:meth:`gradhooks.core.recorder.backward_pass.BackwardPass.expecting`); the
    reads refuse unequal counts (:meth:`gradhooks.core.analysis.token_means.TokenMeans.unsplit`) unless
    ``token_normalisation="batch"``.
(f) a constant factor ``c`` (``loss / k``, ``loss * c``, a Python number or a CPU tensor) above
    the reduction, relative to the declared ``loss_reduction`` (``losses.sum() / B`` under
    ``"mean"`` is ``c = 1``): noted for the DP reads, which divide it out (:func:`unscaled`); a
    factor that cannot be read (on an accelerator; a pseudo-loss whose reduction is not known)
    makes them refuse.

Not recognised (nothing said): scalings by a tensor that requires grad, reductions over
dimensions, any other node on the way.
The walk reads only node attributes (and, for (a), the saved target once); it keeps no
reference to the graph or its tensors.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..base.errors import UnsupportedLossError
from ..base.torch_internals import saved
from ..core.analysis import (
    TARGETS,
    Split,
    constant_of,
    flattened_logits,
    ignore_index_of,
    split_of,
    target_counts,
)
from ..core.recorder.batch_reads import is_loss_scale

__all__ = ["check_batch_loss", "check_per_sample_losses", "loss_scale_of", "unscaled"]

#: Nodes followed when at most this many lie above the reduction.
_CAP = 16
#: Nodes with one input that keep the loss a constant multiple of it.
_PASS = frozenset({"ToCopyBackward0", "CloneBackward0", "AliasBackward0", "ViewBackward0",
                   "ReshapeAliasBackward0", "UnsafeViewBackward0", "SqueezeBackward0",
                   "SqueezeBackward1", "UnsqueezeBackward0", "PosBackward0"})
#: Constant scalings: ``loss * c``, ``c * loss``, ``loss / c`` (``c`` one number).
_SCALE = frozenset({"MulBackward0", "DivBackward0"})
#: Broadcasts of a scalar to ``(B,)`` (only looked through for per-sample losses).
_BROADCAST = frozenset({"ExpandBackward0", "RepeatBackward0"})
_NLL = frozenset({"NllLossBackward0", "NllLoss2DBackward0"})
#: Losses with a ``reduction`` argument (1 mean, 2 sum) and the input saved as ``self``.
_REDUCING = frozenset({"MseLossBackward0", "L1LossBackward0", "SmoothL1LossBackward0",
                       "HuberLossBackward0", "BinaryCrossEntropyBackward0",
                       "BinaryCrossEntropyWithLogitsBackward0", "SoftMarginLossBackward0"})
_FULL = {"MeanBackward0": 1, "SumBackward0": 2}
_MEAN, _SUM = 1, 2


def check_batch_loss(loss: Tensor, batch_size: Optional[int], loss_reduction: str,
                     gradient: Optional[Tensor] = None, tokens=None,
                     grad_scaler=None) -> Optional[Split]:
    """Refuse a scalar batch loss that is not the declared reduction over samples (cases (a)
    and (b) of the module docstring); note on ``tokens`` what the reads judge (a split not
    proven, case (e); a constant factor, case (f)); say nothing about any loss not recognised.

    Args:
        loss: the tensor handed to :meth:`gradhooks.GradHooks.backward`.
        batch_size: ``B`` of the recorded forward (``None``: nothing recorded, no check).
        loss_reduction: ``"mean"`` or ``"sum"``, as given to :func:`gradhooks.attach`.
        gradient: the ``gradient`` argument (given: the scale is unknown, no check).
        tokens: the recorder's :class:`~gradhooks.core.analysis.token_means.TokenMeans` (``None``: the
            split and the factor are not judged).
        grad_scaler: the ``torch.amp.GradScaler`` given to :func:`gradhooks.attach`, or ``None``.
            A top ``MulBackward0`` by its own scale tensor is its ``scaler.scale(loss)``
            (:func:`_own_scale`), passed over unread: on an accelerator its value is not read
            without a device sync, and the reads divide by ``scaler.get_scale()``.

    Returns:
        The loss's :class:`~gradhooks.core.analysis.backward_losses.Split` where its counts are still to
        be read from the pass's first ``(B, T, D)`` grad_output
        (:meth:`gradhooks.core.recorder.backward_pass.BackwardPass.expecting`), else ``None``.

    Raises:
        UnsupportedLossError: a token-level mean over unequal valid-token counts (unless
            ``token_normalisation="batch"``), or a reduction over the batch that contradicts
            ``loss_reduction``.
    """
    if gradient is not None or not batch_size or loss.dim() != 0:
        return None
    batch_wide = getattr(getattr(tokens, "_recorder", None), "token_normalisation",
                         "sample") == "batch"
    scale = loss_scale_of(loss)
    own = _own_scale(scale, grad_scaler)
    top = loss.grad_fn.next_functions[0][0] if own else loss.grad_fn
    found = _read_node(top, batch_size, broadcast=False) if batch_size > 1 else None
    kind = factor = None
    if found is not None:
        node, factor, kind, counts = found
        if counts is not None and not batch_wide:
            raise UnsupportedLossError(_token_mean_message(counts, loss_reduction))
    seen = (float(scale) if scale is not None and not own and scale.device.type == "cpu"
            else None)
    if found is not None and factor is not None and seen is not None and is_loss_scale(seen):
        factor = factor / seen  # (the GradScaler's scale: the reads divide by it)
    if found is not None and factor == 1.0:
        if loss_reduction == "mean" and kind == _SUM:
            raise UnsupportedLossError(
                f"gh.backward(loss): loss_reduction='mean' was declared, but the loss is a sum "
                f"over the batch ({type(node).__name__}, B = {batch_size}): every per-sample "
                f"result would be {batch_size} (B) times the gradient of the sample's own loss. "
                f"Divide the loss by B (e.g. reduction='mean', or per-sample losses and "
                f"losses.mean()), or attach with loss_reduction='sum'.")
        if loss_reduction == "sum" and kind == _MEAN:
            raise UnsupportedLossError(
                f"gh.backward(loss): loss_reduction='sum' was declared, but the loss is a mean "
                f"over the batch ({type(node).__name__}, B = {batch_size}): every per-sample "
                f"result would be 1/{batch_size} (1/B) times the gradient of the sample's own "
                f"loss. Sum the losses (reduction='sum', or per-sample losses and "
                f"losses.sum()), or attach with loss_reduction='mean'.")
    if tokens is None:
        return None
    try:
        split = split_of(loss.grad_fn, batch_size, scaler=own)
    except RuntimeError:  # (saved tensors freed: autograd's own backward says so)
        return None
    if split is None:
        return None
    if split.scaled and split.factor is None and scale is not None and not own:
        split = split._replace(what=f"{split.what}, times a 0-dim float32 tensor on "
                                    f"{scale.device.type} (GradScaler.scale's form, its value not "
                                    f"read there: declare the scaler, gradhooks.attach(model, ..., "
                                    f"grad_scaler=scaler))")
    _note_factor(split, kind, factor, seen, batch_size, loss_reduction, tokens)
    if split.proven:
        return None
    counts = []
    for n in split.losses:
        c = target_counts(n, batch_size) if type(n).__name__ in _NLL else None
        if c is not None:
            counts.append(c)
        elif split.weighted and saved(n, "weight") is not None and saved(n, "reduction") == _MEAN:
            counts.append(None)
    if split.weighted or counts:
        total = None if any(c is None for c in counts) else sum(counts)
        tokens.unsplit(split.what, total, split.weighted, "" if total is None else TARGETS)
    return None if split.weighted else split


def _note_factor(split: Split, kind, factor, seen, batch_size: int, loss_reduction: str,
                 tokens) -> None:
    # A constant factor on the loss (case (f)): relative to the declared reduction where the
    # reduction below it is known, else not readable (None) and the DP reads refuse.
    if not split.scaled:
        return
    c = split.factor
    if c is not None and seen is not None and is_loss_scale(seen):
        c = c / seen
    reduction = split.top or {_MEAN: "mean", _SUM: "sum"}.get(kind)
    if c is None or reduction is None:
        if c != 1.0:
            tokens.scaled(None, split.what)
        return
    c *= {("sum", "mean"): batch_size, ("mean", "sum"): 1.0 / batch_size}.get(
        (reduction, loss_reduction), 1.0)
    if abs(c - 1.0) > 1e-12:
        tokens.scaled(c, split.what)


def unscaled(batch, recorder, materialize: bool = False):
    """The batch snapshot ``batch`` (:class:`~gradhooks.core.recorder.records.Batch`) of a DP read, read
    as if its loss had not been multiplied by the constant factor its backward passes noted
    (case (f); :meth:`gradhooks.core.analysis.token_means.TokenMeans.dp_factor` of ``recorder``'s): the
    factor joins the grad scale that the readers divide out, so that norms and clipping are
    those of each sample's own unscaled loss and ``.grad`` is written at the loss's scale (as
    for a ``GradScaler``'s).

    Raises:
        UnsupportedLossError: a factor that could not be read, or ``materialize`` with one."""
    factor = recorder.placement.mixing.tokens.dp_factor("clip_and_accumulate()", materialize)
    if factor == 1.0:
        return batch
    grad_scale = batch.grad_scale * factor
    scale = batch.divisor / grad_scale
    return batch._replace(grad_scale=grad_scale, scale=scale, factor=scale)


def check_per_sample_losses(losses: Tensor, batch_size: Optional[int]) -> None:
    """Refuse ``(B,)`` per-sample losses that are one batch loss broadcast to ``B`` entries
    (case (c) of the module docstring); say nothing about anything else.

    Raises:
        UnsupportedLossError: ``losses`` is a scalar reduction over the batch, expanded.
    """
    if not isinstance(losses, Tensor) or not batch_size or losses.dim() != 1:
        return
    found = _read(losses, batch_size, broadcast=True)
    if found is not None:
        raise UnsupportedLossError(
            f"clipped_backward(losses, ...): the losses are one loss reduced over the whole "
            f"batch ({type(found[0]).__name__}) and broadcast to {batch_size} entries, so each "
            f"entry depends on every sample and clipping bounds no sample's contribution. Pass "
            f"per-sample losses: F.cross_entropy(out, y, reduction='none'), or "
            f"gradhooks.per_sample_token_loss(logits, labels) for token losses.")


def loss_scale_of(loss: Tensor) -> Optional[Tensor]:
    """The scale tensor of a ``torch.amp.GradScaler`` that scaled ``loss`` (``scaler.scale(loss)``
    is ``loss * scaler._scale``: the graph's top node a ``MulBackward0`` whose second operand is
    a float32 0-dim leaf that requires no grad, on the loss's device), or ``None``. Its value
    is not read here (no device sync); :func:`gradhooks.core.recorder.batch_reads.is_loss_scale` judges
    it when a read needs it."""
    node = loss.grad_fn if isinstance(loss, Tensor) else None
    if node is None or type(node).__name__ != "MulBackward0":
        return None
    first, second = (n for n, _ in node.next_functions)
    if first is None or second is not None:
        return None
    try:
        c = saved(node, "other")
    except RuntimeError:  # saved tensors already freed by an earlier backward
        return None
    if (not isinstance(c, Tensor) or c.dim() != 0 or c.dtype != torch.float32 or c.requires_grad
            or not c.is_leaf or c.device != loss.device):
        return None
    return c


def _own_scale(scale: Optional[Tensor], grad_scaler) -> bool:
    """Whether ``scale`` (:func:`loss_scale_of` of a loss) is the declared ``grad_scaler``'s own
    scale tensor (the same memory: ``scaler.scale(loss)`` multiplies by it on its device), so
    that the loss's top node is that scaling. Reads no value (no device sync)."""
    own = getattr(grad_scaler, "_scale", None)
    return (scale is not None and isinstance(own, Tensor) and grad_scaler.is_enabled()
            and scale.device == own.device and scale.data_ptr() == own.data_ptr())


def _read(loss: Tensor, batch_size: int, broadcast: bool):
    """:func:`_read_node` of ``loss``'s ``grad_fn``."""
    return _read_node(loss.grad_fn, batch_size, broadcast)


def _read_node(node, batch_size: int, broadcast: bool):
    """``(node, factor, kind, counts)`` of the reduction over the batch below ``node``
    (:func:`_reduction`, :func:`_kind`; ``counts``: the unequal valid-token counts of a
    token-level mean, else ``None``), or ``None`` if none is recognised or the graph's saved
    tensors were freed (autograd's own backward then says so)."""
    try:
        found = _reduction(node, broadcast)
        if found is None:
            return None
        node, factor = found
        kind, rows = _kind(node, batch_size)
        if kind is None:
            return None
        counts = (_unequal_counts(node, rows, batch_size) if kind == _MEAN and rows is not None
                  else None)
    except RuntimeError:  # saved tensors already freed by an earlier backward
        return None
    return node, factor, kind, counts


def _reduction(node, broadcast: bool) -> Optional[Tuple[object, Optional[float]]]:
    """The first reduction node below ``node`` through constant scalings, and the product of
    the scalings (``None`` where one is not known without a device sync); ``None`` if another
    node comes first or the walk passes :data:`_CAP` nodes."""
    factor: Optional[float] = 1.0
    for _ in range(_CAP):
        if node is None:
            return None
        name = type(node).__name__
        if name in _NLL or name in _REDUCING or name in _FULL:
            return node, factor
        nexts = [n for n, _ in node.next_functions if n is not None]
        if len(nexts) != 1:
            return None
        if name in _SCALE:
            c = constant_of(node, name)
            if c is False:
                return None
            factor = None if c is None or factor is None else factor * c
        elif name not in _PASS and not (broadcast and name in _BROADCAST):
            return None
        node = nexts[0]
    return None


def _kind(node, batch_size: int) -> Tuple[Optional[int], Optional[int]]:
    """(mean or sum, rows per sample for an ``nll_loss`` over flattened ``(B, T, V)`` logits,
    else ``None``) of a reduction node over the batch; ``(None, None)`` if it is not one."""
    name = type(node).__name__
    if name in _FULL:  # judged only over (B,) losses of a loss function (reduction='none')
        below = node.next_functions[0][0]
        ok = (tuple(saved(node, "self_sym_sizes")) == (batch_size,) and below is not None
              and (type(below).__name__ in _NLL or type(below).__name__ in _REDUCING)
              and saved(below, "reduction") == 0)
        return (_FULL[name], None) if ok else (None, None)
    reduction = saved(node, "reduction")
    if reduction not in (_MEAN, _SUM):
        return None, None
    if name in _REDUCING:
        x = saved(node, "self", None)
        ok = isinstance(x, Tensor) and x.dim() and x.shape[0] == batch_size
        return (reduction, None) if ok else (None, None)
    if saved(node, "weight") is not None:  # class weights: a weighted mean, not judged
        return None, None
    target = saved(node, "target")
    if target.dim() >= 2 or name != "NllLossBackward0":
        return ((reduction, target[0].numel()) if target.shape[0] == batch_size
                else (None, None))
    rows = target.numel()
    if rows == batch_size:
        return reduction, 1
    if rows % batch_size or not _batch_first_rows(node, rows, batch_size):
        return None, None
    return reduction, rows // batch_size


def _batch_first_rows(node, rows: int, batch_size: int) -> bool:
    """Whether the input rows of an ``nll_loss`` node are ``(B, T, V)`` logits flattened batch
    first (:func:`gradhooks.core.analysis.backward_losses.flattened_logits`)."""
    sizes = flattened_logits(node)
    return (sizes is not None and len(sizes) == 3 and sizes[0] == batch_size
            and sizes[0] * sizes[1] == rows)


def _unequal_counts(node, rows: int, batch_size: int) -> Optional[list]:
    """The valid-token counts ``N_n`` of an ``nll_loss`` node's target, if they differ between
    samples (one comparison: on an accelerator, one sync); ``None`` if they are all equal."""
    ignore = ignore_index_of(node)
    with torch.no_grad():
        counts = (saved(node, "target").reshape(batch_size, rows) != ignore).sum(1)
        if bool((counts == counts[0]).all()):
            return None
        return counts.tolist()


def _token_mean_message(counts: list, loss_reduction: str) -> str:
    b, n = len(counts), sum(counts)
    shown = ", ".join(str(c) for c in counts[:8]) + (", ..." if b > 8 else "")
    scales = ", ".join(f"{b * c / n:.3g}" for c in counts[:8]) + (", ..." if b > 8 else "")
    reduce = "losses.mean()" if loss_reduction == "mean" else "losses.sum()"
    return (
        f"gh.backward(loss): the loss is a mean over all valid tokens of the batch (nll_loss / "
        f"cross_entropy with reduction='mean' and ignore_index), and the samples have different "
        f"numbers of valid tokens N_n = [{shown}] (N = {n}, B = {b}). Per-sample results from it "
        f"would be B N_n / N = [{scales}] times the gradient of each sample's own token-mean "
        f"loss, not that gradient. Pass per-sample losses instead: losses = "
        f"gradhooks.per_sample_token_loss(logits, labels) (shift=False for seq2seq labels) and "
        f"gh.backward({reduce}) (loss_reduction={loss_reduction!r}), or "
        f"gh.clipped_backward(losses, max_norm).")
