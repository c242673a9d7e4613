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
forward is seen there (:mod:`gradhooks.core.analysis.token_means`); ``loss.backward()`` on a loss
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
   grad_output of the pass that is ``(B, T', V)`` rows with the loss's ``V`` arrives (in the
   call's layout, :func:`position_rows`) (the output
   layer's, usually), ``N_n`` is the count of its nonzero rows per sample. The count stays on
   the device (no sync in the backward); the read compares
   (:meth:`gradhooks.core.analysis.token_means.TokenMeans.refusal`), and equal counts pass.

4. **Any other loss** (:func:`split_of`, issue 38): its split into per-sample terms is proven
   only where its top op (below constant scalings) is ``.mean()`` / ``.sum()`` of a ``(B,)``
   tensor. Otherwise (class weights, label smoothing, a z-loss or other auxiliary term, a sum
   divided by ``num_items_in_batch``, a masked mean, an MSE over tokens ...) the first hooked
   grad_output of the pass gives the counts of nonzero token rows per sample, laid out as
   gradhooks knows that call (:func:`position_rows`: the placement's relayout, the rule's
   canonical form, the declared layout; the dim whose zeros are whole rows where it is
   unknown) and counted by :func:`row_counts` (padding's rows are exactly zero), refused at
   the read where they differ (not where :func:`fixed_normaliser` shows a loss function's
   mean over every element of the output, which gives every sample as many terms); a
   class-weighted ``nll_loss`` mean is refused whatever the counts (it divides by the batch's
   total target weight, which the freed target no longer gives). A
   constant scaling above the reduction is noted: its factor is freed, so the DP reads refuse
   (:meth:`gradhooks.core.analysis.token_means.TokenMeans.dp_factor`).

Cost: one frame walk (some tens of frames) and a walk of at most :data:`_CAP` nodes (plus
:data:`_SEARCH` below a loss that is not a proven split) per backward pass, and one
compare-and-sum over one grad_output where the split is not proven. Not seen (nothing said): a
model whose output layer is not hooked and whose first hooked grad_output has no position dims
(``(B, D)``: a zero row there is a sample's zero gradient, not padding), or carries routed rows.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from ...base import torch_internals
from ...base.errors import GradHooksError
from ...base.torch_internals import current_frames, getframe, saved
from .batch_dims import relayout

__all__ = ["Finding", "Split", "backward_roots", "constant_of", "flattened_logits",
           "fixed_normaliser", "ignore_index_of", "loss_of", "position_rows", "row_counts",
           "split_of",
           "valid_rows"]

#: The function whose frame holds a backward pass's root tensors (argument ``t_outputs``).
ENGINE_FRAME = torch_internals.ENGINE_FRAME
#: Nodes looked through at most, from a root down to its ``nll_loss``.
_CAP = 16
#: One-input nodes that keep the loss a constant multiple of what lies below.
_PASS = frozenset({"ToCopyBackward0", "CloneBackward0", "AliasBackward0", "ViewBackward0",
                   "UnsafeViewBackward0", "SqueezeBackward0", "SqueezeBackward1",
                   "UnsqueezeBackward0", "PosBackward0", "MulBackward0", "DivBackward0"})
#: Constant scalings (one input: the other operand is a constant), whose factor is freed.
_SCALE = frozenset({"MulBackward0", "DivBackward0"})
#: Loss functions with a ``reduction`` argument (0 none, 1 mean, 2 sum).
_LOSS_FUNCTIONS = frozenset({"NllLossBackward0", "MseLossBackward0", "L1LossBackward0",
                             "SmoothL1LossBackward0", "HuberLossBackward0",
                             "BinaryCrossEntropyBackward0",
                             "BinaryCrossEntropyWithLogitsBackward0", "SoftMarginLossBackward0"})
_FULL = {"SumBackward0": "sum", "MeanBackward0": "mean"}
#: The functions behind the loss nodes, for messages.
_CALLS = {"NllLossBackward0": "cross_entropy / nll_loss", "MseLossBackward0": "mse_loss",
          "L1LossBackward0": "l1_loss", "SmoothL1LossBackward0": "smooth_l1_loss",
          "HuberLossBackward0": "huber_loss", "BinaryCrossEntropyBackward0": "binary_cross_entropy",
          "BinaryCrossEntropyWithLogitsBackward0": "binary_cross_entropy_with_logits",
          "SoftMarginLossBackward0": "soft_margin_loss"}
#: Between ``nll_loss`` and the flattening of the logits.
_ROW_OPS = frozenset({"LogSoftmaxBackward0", "ToCopyBackward0", "CloneBackward0"})
_FLATTEN = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"})


def backward_roots() -> Optional[tuple]:
    """The root tensors of the backward pass running now (module docstring, step 1), or
    ``None`` where no single engine frame is found."""
    frame = getframe(1)
    while frame is not None:
        if frame.f_code.co_name == ENGINE_FRAME:
            return _roots_of(frame)
        frame = frame.f_back
    found = []
    for frame in current_frames().values():  # (a device thread runs the hooks)
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


class Finding(NamedTuple):
    """What :func:`loss_of` saw below a backward pass's root.

    Attributes:
        kind: ``"tokens"`` (a token-level mean over ``(B, T', V)`` logits: ``tokens`` ``T'``,
            ``classes`` ``V``), or ``"sum"`` / ``"mean"`` (a reduction over the batch's rows).
        what: the loss, in words (for the message).
        node: for ``"sum"`` / ``"mean"`` of a loss function on a tensor of unknown rows: the
            autograd node of that tensor, established as ``B`` rows when it is a hooked output
            whose grad_output has ``B`` leading rows; ``None`` where the rows are known.
    """
    kind: str
    what: str
    tokens: int = 0
    classes: int = 0
    node: object = None


def loss_of(roots: tuple, batch_size: int) -> Optional[Finding]:
    """What a backward pass's one 0-dim root is, if recognised (module docstring, step 2):

    * a token-level mean ``nll_loss`` over ``(B, T', V)`` logits flattened batch first, through
      casts, copies and constant scalings (:class:`Finding` ``"tokens"``);
    * a reduction over the batch with nothing but casts and copies above it (constant scalings
      are freed, so their factor is unknown): ``.sum()`` / ``.mean()`` of ``(B,)`` losses of a
      loss function with ``reduction="none"``, or a loss function's ``reduction="sum"`` /
      ``"mean"`` itself (its input's rows then established by the hooked output it reads,
      :attr:`Finding.node`);

    else ``None``. Reads only what autograd keeps of nodes that have run."""
    if len(roots) != 1 or roots[0].dim() != 0 or batch_size < 2:
        return None
    node, scaled = roots[0].grad_fn, False
    try:
        for _ in range(_CAP):
            if node is None:
                return None
            name = type(node).__name__
            if name == "NllLossBackward0" and saved(node, "reduction") == 1:
                found = _rows(node, batch_size)
                if found is not None:
                    return found
            if name in _LOSS_FUNCTIONS or name in _FULL:
                return None if scaled else _reduction(node, name, batch_size)
            nexts = [n for n, _ in node.next_functions if n is not None]
            if name not in _PASS or len(nexts) != 1:
                return None
            scaled = scaled or name in _SCALE
            node = nexts[0]
    except (RuntimeError, AttributeError):  # (an attribute autograd freed or never had)
        return None
    return None


def _reduction(node, name: str, batch_size: int) -> Optional[Finding]:
    if name in _FULL:  # .sum() / .mean() of (B,) losses of reduction="none"
        below = node.next_functions[0][0]
        if (tuple(saved(node, "self_sym_sizes")) != (batch_size,) or below is None
                or type(below).__name__ not in _LOSS_FUNCTIONS or saved(below, "reduction") != 0):
            return None
        return Finding(_FULL[name], f"{name[:-len('Backward0')].lower()}() of the (B,) = "
                                    f"({batch_size},) per-sample losses of "
                                    f"{_CALLS[type(below).__name__]}(reduction='none')")
    reduction = {1: "mean", 2: "sum"}.get(saved(node, "reduction"))
    if reduction is None or saved(node, "weight", None) is not None:
        return None
    below = node.next_functions[0][0]
    for _ in range(4):  # (cross_entropy: nll_loss of log_softmax; casts)
        if below is None or type(below).__name__ not in _ROW_OPS:
            break
        below = below.next_functions[0][0]
    if below is None:
        return None
    return Finding(reduction, f"{_CALLS[name]}(reduction={reduction!r}) over the batch's rows",
                   node=below)


def ignore_index_of(node) -> int:
    """The ``ignore_index`` an ``nll_loss`` node saved (as an unsigned 64-bit integer)."""
    ignore = int(saved(node, "ignore_index"))
    return ignore - 2 ** 64 if ignore >= 2 ** 63 else ignore


def flattened_logits(node) -> Optional[tuple]:
    """The sizes an ``nll_loss`` node's input rows were flattened from: those the first
    ``view`` / ``reshape`` below it (through ``log_softmax``, casts and copies) saved, e.g.
    ``(B, T, V)``; ``None`` if another node comes first. Non-tensor attributes only (autograd
    keeps them after the node ran)."""
    below = node.next_functions[0][0]
    for _ in range(4):
        if below is None:
            return None
        name = type(below).__name__
        if name in _FLATTEN:
            return tuple(saved(below, "self_sym_sizes"))
        if name not in _ROW_OPS:
            return None
        below = below.next_functions[0][0]
    return None


def _rows(node, batch_size: int) -> Optional[Finding]:
    if saved(node, "weight") is not None:
        return None
    sizes = flattened_logits(node)
    if sizes is None or len(sizes) != 3 or sizes[0] != batch_size:
        return None
    what = (f"cross_entropy / nll_loss(reduction='mean', ignore_index={ignore_index_of(node)}) "
            f"over the {sizes} logits flattened to token rows, computed after the model's "
            f"forward,")
    return Finding("tokens", what, int(sizes[1]), int(sizes[2]))


def valid_rows(rows: Tensor, tokens: int, classes: int) -> Optional[Tensor]:
    """The valid-token counts ``N_n``, shape ``(B,)`` int64, from the logits' grad_output laid
    out as rows ``(B, S, F)`` (:func:`position_rows`, module docstring step 3); ``None`` if
    they are not ``(B, S >= T', V)`` rows."""
    if rows.shape[2] != classes or rows.shape[1] < tokens:
        return None
    return row_counts(rows)


# ---------------------------------------------------------------------- the split, in general
#: Nodes searched at most below a loss whose split is not proven, for its loss functions.
_SEARCH = 16
#: The nodes that search descends through: those that combine loss terms (a model's own ops end
#: it, so a pseudo-loss such as ``model(x).sum()`` costs a node or two per backward pass).
_TERMS = frozenset({"AddBackward0", "AddBackward1", "SubBackward0", "SubBackward1",
                    "RsubBackward1", "MulBackward0", "MulBackward1", "DivBackward0",
                    "DivBackward1", "NegBackward0", "SumBackward0", "SumBackward1",
                    "MeanBackward0", "MeanBackward1", "ToCopyBackward0", "CloneBackward0",
                    "ViewBackward0", "UnsafeViewBackward0", "SqueezeBackward0",
                    "SqueezeBackward1", "UnsqueezeBackward0", "IndexBackward0",
                    "WhereBackward0", "MaskedSelectBackward0"})
#: Scalings by a Python number that autograd keeps as a non-tensor attribute (still readable
#: after the node ran).
_SCALAR = frozenset({"MulBackward1", "DivBackward1"})
_NLL = frozenset({"NllLossBackward0", "NllLoss2DBackward0"})


class Split(NamedTuple):
    """How a 0-dim loss splits into per-sample terms, as its graph shows (:func:`split_of`).

    Attributes:
        proven: the loss is, through constant scalings, ``.mean()`` / ``.sum()`` of a ``(B,)``
            tensor (per-sample losses: each entry is one sample's term).
        what: the loss in words (its top op and the loss functions below it), for messages.
        reduction: ``"mean"`` / ``"sum"`` of the ``(B,)`` tensor where ``proven``, else ``None``.
        scaled: constant scalings (``loss / k``, ``loss * c``) lie above the reduction.
        factor: their product; ``None`` where one is not readable (``loss.backward()``: autograd
            freed the saved operand before any hook runs; a scalar on an accelerator).
        weighted: a class-weighted ``nll_loss`` / ``cross_entropy`` with ``reduction="mean"``
            lies below (it divides by the batch's total weight of the targets).
        losses: the ``nll_loss`` nodes below (their saved targets give the valid-token counts
            while the graph is alive: :func:`target_counts`).
        top: ``"mean"`` / ``"sum"`` where the top op is a reduction of that kind (``.mean()``,
            ``.sum()``, a loss function's ``reduction``), else ``None``.
        length: ``L`` where the top op reduces an ``(L,)`` tensor of another length than ``B``
            (``G`` per-sample losses of rows grouped by ``gh.set_sample_ids`` declared after the
            backward: the reads judge it then), else ``None``.
        node: where ``proven``, the reduction's autograd node (its input gradient is the
            ``(B,)`` per-sample losses' gradient: :mod:`gradhooks.readers.sample_check` masks it
            to one sample), else ``None``.
    """
    proven: bool
    what: str
    reduction: Optional[str] = None
    scaled: bool = False
    factor: Optional[float] = 1.0
    weighted: bool = False
    losses: tuple = ()
    top: Optional[str] = None
    length: Optional[int] = None
    node: object = None


def constant_of(node, name: str):
    """The constant ``c`` of a scaling node (``MulBackward0/1``, ``DivBackward0/1``) as a factor
    (``c``, or ``1/c`` for a division); ``None`` if not readable (freed, or on an accelerator:
    no device sync), ``False`` if the node is no scaling by one number."""
    first, second = (list(n for n, _ in node.next_functions) + [None])[:2]
    if name in _SCALAR:
        c = saved(node, "other")
        if not isinstance(c, (int, float)):
            return False
        v = float(c)
    else:
        if name == "DivBackward0" and second is not None:
            return False
        try:
            c = saved(node, "other") if second is None else saved(node, "self")
        except RuntimeError:  # (freed by the pass that is running)
            return None
        if not isinstance(c, Tensor) or c.numel() != 1 or c.requires_grad:
            return False
        if c.device.type != "cpu":
            return None
        v = float(c.item())
    if name.startswith("Div"):
        return 1.0 / v if v != 0 else False
    return v


def split_of(node, batch_size: int, scaler: bool = False) -> Optional[Split]:
    """How the loss whose ``grad_fn`` is ``node`` splits into per-sample terms: down through
    casts, copies and constant scalings to its top op, which proves the split where it is
    ``.mean()`` / ``.sum()`` of a ``(B,)`` tensor; else the loss functions below it are looked
    for (at most :data:`_SEARCH` nodes). Reads node types and what autograd keeps of nodes that
    ran (saved tensors only while alive). ``scaler``: a ``GradScaler`` was declared, so a
    ``MulBackward0`` at the top is its ``scaler.scale(loss)`` (the reads divide it out), not a
    factor. ``None`` for no graph."""
    factor: Optional[float] = 1.0
    scaled = False
    for _ in range(_CAP):
        if node is None:
            return None
        name = type(node).__name__
        nexts = [n for n, _ in node.next_functions if n is not None]
        if len(nexts) != 1 or (name not in _PASS and name not in _SCALAR):
            break
        if scaler and name == "MulBackward0":
            pass  # (the top node: GradScaler.scale's loss * S)
        elif name in _SCALE or name in _SCALAR:
            c = constant_of(node, name)
            if c is False:
                break
            scaled = True
            factor = None if c is None or factor is None else factor * c
        node, scaler = nexts[0], False
    name = type(node).__name__
    sizes: tuple = ()
    if name in _FULL:
        try:
            sizes = tuple(saved(node, "self_sym_sizes"))
        except (RuntimeError, AttributeError):
            sizes = ()
        if sizes == (batch_size,):
            return Split(True, f"{name[:-len('Backward0')].lower()}() of a (B,) = "
                               f"({batch_size},) tensor of per-sample losses",
                         _FULL[name], scaled, factor, top=_FULL[name], node=node)
    found, weighted, seen, todo = [], False, set(), [node]
    while todo and len(seen) < _SEARCH:
        n = todo.pop(0)
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        kind = type(n).__name__
        if kind in _NLL:
            found.append(n)
            try:
                w = saved(n, "weight") is not None
            except RuntimeError:  # (a weight tensor, freed)
                w = True
            weighted = weighted or (w and saved(n, "reduction") == 1)
            continue
        if kind in _LOSS_FUNCTIONS:
            found.append(n)
        elif kind in _TERMS:
            todo.extend(m for m, _ in n.next_functions)
    below = sorted({_CALLS.get(type(n).__name__, type(n).__name__) for n in found})
    what = (f"{name}" + (f" over {', '.join(below)}" if below else "")
            + (", class-weighted" if weighted else "")
            + (", scaled by a constant" if scaled else ""))
    top = _FULL.get(name)
    if name in _LOSS_FUNCTIONS:
        try:
            top = {1: "mean", 2: "sum"}.get(saved(node, "reduction"))
        except (RuntimeError, AttributeError):
            top = None
    return Split(False, what, None, scaled, factor, weighted, tuple(found), top,
                 int(sizes[0]) if len(sizes) == 1 else None)


def position_rows(grad: Tensor, record, batch_size: int, batch_first: bool,
                  classes: Optional[int] = None) -> Optional[Tuple[Tensor, bool]]:
    """A hooked call's grad_output ``grad`` as ``(B, S, F)`` rows: ``S`` positions (token rows,
    pixels) of ``F`` features each, and whether the layout was not known (then ``(B, ...)``);
    ``None`` where ``grad`` has no position dims (``(B, D)``) or no dim
    of ``B`` samples. A view where the layout allows.

    Where the batch and the positions sit is read from what gradhooks knows of the call, not
    from the shape alone: its placement's relayout (:attr:`~gradhooks.core.recorder.records.Record.swap`:
    ``(T, B, D)`` activations of a batch-first model, ``(B * T, D)`` merged rows), then the
    rule's canonical form (:meth:`~gradhooks.base.registry.LayerRule.linear_form`: ``(N, G, S,
    O)``, so that a ``Conv1d`` head's ``(B, V, T)`` has its ``T`` positions), or a
    position-wise rule's trailing feature dim at the declared layout's batch dim. For any other
    rule (a layout of positions and features gradhooks does not know) ``grad`` is returned
    ``(B, ...)`` with ``True``: :func:`row_counts` then finds the dim whose zeros are whole rows
    (padding) rather than assume one; unless the loss's own view of the logits shows their
    trailing dim to be its ``classes`` (a token-level mean over ``(B, T', V)`` logits)."""
    if grad.dim() < 2:
        return None
    how = record.swap
    if how is not None:
        if how[0] not in ("swap", "split"):
            return None  # (routed rows, a fallback's own dims: no position layout to count)
        grad = relayout(grad, how)
    if grad.dim() < 3:
        return None  # (no positions: a zero row is a sample's zero gradient, no padding)
    rule, module = record.layer.rule, record.layer.module
    if rule.has_linear_form and not rule.multi_io:
        try:
            g = rule.linear_form(module, None, grad, batch_first)[1]  # (N, G, S, O)
        except (GradHooksError, RuntimeError):
            g = None
        if g is not None and g.shape[0] == batch_size:
            return g.transpose(1, 2).flatten(2), False
    dim = 0 if batch_first else 1
    if grad.shape[dim] != batch_size:
        return None
    grad = grad.movedim(dim, 0)
    if (not rule.position_wise or rule.multi_io) and grad.shape[-1] != classes:
        return grad, True  # (B, ...): row_counts finds a dim whose zeros are whole rows
    return grad.reshape(batch_size, -1, grad.shape[-1]), False


def row_counts(rows: Tensor, unknown: bool = False) -> Tensor:
    """Per-sample counts ``(B,)`` int64 of the rows of ``rows`` ``(B, S, F)``
    (:func:`position_rows`) with a nonzero gradient (a padded position, whose loss terms are
    masked out, gets an exactly zero gradient over all its features). Stays on the device (the
    read compares).

    ``unknown``: ``rows`` is ``(B, ...)`` of a layout gradhooks does not know. Padding makes
    whole rows zero along the features, wherever they are, while the zeros of an activation
    (a ReLU's) are scattered: so each dim is tried as the features, and the counts of the first
    dim along which every zero is a whole row and the samples' counts differ are returned
    (equal counts, nothing refused, where no dim shows that: no padding to see)."""
    with torch.no_grad():  # (one reduction, no (B, S, F) temporary)
        if not unknown:
            return (torch.linalg.vector_norm(rows, float("inf"), dim=2) != 0).sum(1)
        zero, counts, flags = rows == 0, [], []
        for d in range(1, rows.dim()):
            whole, some = zero.all(d), zero.any(d)
            n = (~whole).flatten(1).sum(1)
            counts.append(n)
            flags.append((whole == some).all() & (n != n[:1]).any())
        counts, flags = torch.stack(counts), torch.stack(flags)
        first = counts[flags.to(torch.uint8).argmax()]
        return torch.where(flags.any(), first, torch.zeros_like(first))


#: Loss functions whose mean / sum runs over every element of their input (no
#: ``ignore_index``, no class weights): the normaliser counts every sample's elements alike.
_ELEMENTWISE = _LOSS_FUNCTIONS - {"NllLossBackward0"}
#: Ops that select entries of a tensor (by a boolean mask or an index; slices, which may keep
#: some samples only): below a loss they can make the samples' element counts differ.
_SELECT = frozenset({"IndexBackward0", "MaskedSelectBackward0", "IndexSelectBackward0",
                     "GatherBackward0", "TakeBackward0", "SliceBackward0", "SelectBackward0",
                     "AsStridedBackward0", "UnbindBackward0", "SplitBackward0",
                     "SplitWithSizesBackward0"})


def fixed_normaliser(split: Split, hooked) -> bool:
    """Whether the unproven ``split`` is nonetheless a loss function's own mean / sum over every
    element (:data:`_ELEMENTWISE`: ``mse_loss``, ``l1_loss`` ...; unscaled) of a tensor computed
    from the hooked output whose autograd node is ``hooked`` through no op that selects entries
    (:data:`_SELECT`): then every sample has the same number of terms in it, whatever zeros its
    gradient shows (a ReLU after a one-channel output), and the zero rows are not counted.
    Reads node types only (at most :data:`_SEARCH` nodes); ``False`` where not shown."""
    if (split.scaled or split.top is None or len(split.losses) != 1 or hooked is None
            or type(split.losses[0]).__name__ not in _ELEMENTWISE):
        return False
    todo, seen, reached = [split.losses[0]], set(), False
    while todo:
        node = todo.pop()
        if node is hooked:
            reached = True
            continue
        if id(node) in seen:
            continue
        if len(seen) >= _SEARCH or type(node).__name__ in _SELECT:
            return False
        seen.add(id(node))
        todo.extend(n for n, _ in node.next_functions
                    if n is not None and type(n).__name__ != "AccumulateGrad")
    return reached


def target_counts(node, batch_size: int) -> Optional[Tensor]:
    """The valid-target counts per sample ``(B,)`` of an ``nll_loss`` node whose saved target
    is alive and holds batch-first rows (``(B,)``, ``(B, T)`` or ``(B * T,)`` flattened from
    ``(B, T, V)`` logits); for a class-weighted mean, the sums of the targets' class weights
    instead (its normaliser). ``None`` where that is not established."""
    try:
        target, weight = saved(node, "target"), saved(node, "weight")
    except RuntimeError:
        return None
    if not isinstance(target, Tensor) or target.numel() % max(batch_size, 1):
        return None
    if target.dim() == 1 and target.numel() != batch_size:
        sizes = flattened_logits(node)
        if sizes is None or sizes[0] != batch_size:
            return None
    elif target.dim() > 1 and target.shape[0] != batch_size:
        return None
    ignore = ignore_index_of(node)
    with torch.no_grad():
        rows = target.reshape(batch_size, -1)
        valid = rows != ignore
        if weight is None or saved(node, "reduction") != 1:
            return valid.sum(1)
        return torch.where(valid, weight[torch.where(valid, rows, 0)], 0).sum(1)
