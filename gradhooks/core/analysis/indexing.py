"""Rows of a batch picked by an index (:class:`Routed`), and ``x[index]`` read by its index: where
the batch dim goes through basic indexing and through advanced indexing by the batch's own rows
in order (:mod:`gradhooks.core.analysis.batch_dims`)."""
from __future__ import annotations

from contextvars import ContextVar

import torch
from torch import Tensor

__all__ = ["Routed", "index_dim", "arange_index_dim", "IN_ORDER", "IN_ORDER_NOTES", "assigned",
           "assigned_dim", "strided_dim", "picked_rows", "dim_of"]

#: Not a verdict: rows gathered or sorted from the batch by an index were found in the samples'
#: own order (:meth:`Routed.merged_inner`), a fact of this batch's values: another batch of the
#: input signature may be in another order, so every forward of it is analysed (the placement's
#: plan ``"mode"``).
IN_ORDER = "in_order"
#: The list the analysed forward's notes go to (its ``Provenance.mixing``, set when it starts).
IN_ORDER_NOTES: ContextVar = ContextVar("gradhooks_in_order_notes", default=None)


class Routed:
    """The batch dim of rows gathered from a batch by a data-dependent index (a mixture of
    experts' ``hidden[token_idx]``, ``weights[token_idx, slot]``): dim 0, row ``r`` of sample
    ``samples[r]`` (int64), of a batch of ``size`` samples. ``key`` is the index tensor the rows
    were gathered by: two operands are lined up row by row when they were gathered by the same
    one, or when their rows' samples are equal (transformers' grouped experts gather the token
    rows by ``perm // top_k`` and their routing weights by ``perm``: different rows, the same
    sample for each)."""

    __slots__ = ("samples", "key", "size")

    def __init__(self, samples: Tensor, key: Tensor, size: int):
        self.samples, self.key, self.size = samples, key, size

    def lines_up(self, other: "Routed") -> bool:
        """Whether ``other``'s row ``r`` belongs to the same sample as this one's, every ``r``."""
        return other.key is self.key or (
            other.size == self.size and other.samples.shape == self.samples.shape
            and bool(torch.equal(other.samples, self.samples)))

    def merged_inner(self) -> "int | None":
        """``inner`` when the rows are the samples' in order, ``inner`` each (the layout of a
        batch merged with the dims after it, ``(B * inner, ...)``: the routing undone), else
        ``None``. Found by the index's values: noted (:data:`IN_ORDER`) where a forward is
        analysed."""
        rows = self.samples.shape[0]
        if not rows or rows % self.size:
            return None
        inner = rows // self.size
        order = torch.arange(rows, device=self.samples.device) // inner
        if not bool(torch.equal(order, self.samples)):
            return None
        notes = IN_ORDER_NOTES.get()
        if notes is not None and not any(kind == IN_ORDER for kind, _ in notes):
            notes.append((IN_ORDER, "rows gathered or sorted from the batch by an index were in "
                                    "the samples' own order on this batch"))
        return inner


def index_dim(nd: int, bd: int, index):
    """The batch dim ``bd`` of a tensor of ``nd`` dims after basic indexing ``x[index]`` (ints,
    slices, ``None``, ``...``): ``None`` where an int or a partial slice takes the batch dim;
    ``False`` for advanced indexing (tensor indices: :func:`arange_index_dim`)."""
    index = index if isinstance(index, tuple) else (index,)
    if any(not (i is None or i is Ellipsis or isinstance(i, slice)
                or (isinstance(i, int) and not isinstance(i, bool))) for i in index):
        return False
    named = sum(1 for i in index if i is not None and i is not Ellipsis)
    src = dst = 0
    for i in index:
        if i is Ellipsis:
            skip = nd - named
            if src <= bd < src + skip:
                return dst + bd - src
            src, dst = src + skip, dst + skip
        elif i is None:
            dst += 1
        elif src == bd:
            return dst if i == slice(None) else None
        else:
            src, dst = src + 1, dst + (isinstance(i, slice))
    return dst + bd - src


def arange_index_dim(ref: Tensor, bd: int, index, out) -> "int | None":
    """The batch dim of ``out = ref[index]`` where ``index`` indexes the batch dim ``bd`` (of
    size ``B`` > 1) by the batch's own rows in order: an integer tensor holding ``arange(B)``
    along its one dim of size ``B`` (size 1 elsewhere; transformers' masks read
    ``padding_mask[batch_arange[:, None, None, None], kv_arange[None, None, None, :]]``), the
    other entries full slices or integer tensors. Position ``p`` of the output along that dim
    reads row ``p``, sample ``p``'s, whatever the other indices pick within it (``x[arange(B),
    labels]``). The indices' broadcast shape goes where torch puts it: at the first tensor
    index where the tensor indices are adjacent, else in front. ``None`` for any other index
    (ints, ``None``, ``...``, masks: not proven here, the batch dim is lost)."""
    index = index if isinstance(index, tuple) else (index,)
    size = ref.shape[bd] if ref.dim() > bd else 0
    if (size <= 1 or len(index) <= bd or len(index) > ref.dim() or not isinstance(out, Tensor)
            or any(not (isinstance(i, Tensor) and not i.is_floating_point()
                        and i.dtype is not torch.bool or i == slice(None)) for i in index)):
        return None
    tensors = [k for k, i in enumerate(index) if isinstance(i, Tensor)]
    rows = index[bd]
    if not isinstance(rows, Tensor) or rows.numel() != size or [n for n in rows.shape
                                                                  if n != 1] != [size]:
        return None
    try:
        shape = torch.broadcast_shapes(*(index[k].shape for k in tensors))
    except RuntimeError:
        return None
    at = list(rows.shape).index(size) + len(shape) - rows.dim()
    dim = at + (tensors[0] if tensors == list(range(tensors[0], tensors[-1] + 1)) else 0)
    if out.dim() <= dim or out.shape[dim] != size or not bool(torch.equal(
            rows.reshape(-1), torch.arange(size, device=rows.device, dtype=rows.dtype))):
        return None
    return dim


def assigned(target: Tensor, index, value) -> Tensor:
    """``target[index] = value``, returning ``target``: how provenance sees an assignment that
    writes the batch's values (``Tensor.__setitem__`` returns nothing, so the target kept the
    tag it had, and a batch's rows written into a fresh tensor looked like constants)."""
    target[index] = value
    return target


assigned.__name__ = assigned.__qualname__ = "__setitem__"  # (as messages name the op)


def assigned_dim(args, batched) -> "int | tuple | None":
    """The batch dim of ``target`` after ``target[index] = value`` (``args``; ``batched``:
    ``[(tensor, batch dim)]`` of the operands that carry the batch): the target's own where
    the value carries no batch (a parameter's values written into it); where basic indexing
    keeps the target's batch dim whole and the value's batch dim lands on it (the target's
    own, or, for a target without one, its dim of the value's batch size that does; a batch
    merged with the dims after it, ``(dim, inner)``, stays merged: Longformer's chunked
    scores; a value whose batch dim was lost upstream, taken on the target's rows where its
    sizes fit them, is checked by the forward-alone check:
    :func:`~.separation.separation_verdict`); ``None`` (lost: judged where it meets the
    batch) for any other assignment, an advanced index among them (rows written to other
    rows)."""
    target, index, value = args[0], args[1], args[2]
    dims = {id(t): d for t, d in batched}
    if id(value) not in dims:  # (no sample's values written: each row keeps its own)
        return dims.get(id(target))
    value_bd, target_bd = dims[id(value)], dims.get(id(target))
    if isinstance(value_bd, Routed):  # (rows picked from the batch, put back by an index
        # whose sample coordinate is each row's sample: Longformer's global tokens)
        at = None if isinstance(target_bd, Routed) else _sample_coordinate(
            target, index, value_bd, target_bd)
        return at if at is not None and (id(target) not in dims or at == target_bd) else None
    if isinstance(target_bd, Routed) or index_dim(target.dim(), 0, index) is False:
        return None
    shape = target[index].shape  # (a view: basic indexing)
    lead = len(shape) - value.dim()  # (value broadcast to the view, right-aligned)
    v, t = dim_of(value_bd), dim_of(target_bd)
    if v is None:  # (lost upstream: taken where the target's rows are, if they hold B
        # values of the value; separation_verdict has the forward checked alone)
        at = None if t is None else index_dim(target.dim(), t[0], index)
        if at is None or at < lead or value.shape[at - lead] != shape[at]:
            return None
        v = (at - lead, t[1])
    size = value.shape[v[0]]
    if id(target) in dims:
        candidates = [t[0]] if t is not None and t[1] == v[1] else []
    else:
        candidates = [d for d in range(target.dim()) if target.shape[d] == size]
    for d in candidates:
        if index_dim(target.dim(), d, index) == v[0] + lead and shape[v[0] + lead] == size:
            return d if v[1] == 1 else (d, v[1])
    return None


def _advanced(index) -> "list | None":
    # The tensor entries of an advanced index whose result holds its rows on dim 0: 1-D
    # integer tensors of one length, adjacent from the first entry or apart, the other
    # entries full slices; else None.
    index = index if isinstance(index, tuple) else (index,)
    at = [i for i, t in enumerate(index) if isinstance(t, Tensor)]
    if len(at) < 2 or any(not isinstance(index[i], Tensor) and index[i] != slice(None)
                          for i in range(len(index))):
        return None
    tensors = [index[i] for i in at]
    if any(t.dim() != 1 or t.dtype not in (torch.int64, torch.int32)
           or t.shape != tensors[0].shape for t in tensors):
        return None
    if at == list(range(at[0], at[0] + len(at))) and at[0] != 0:
        return None  # (adjacent, not first: their dim lands where the first is)
    return list(index)


def picked_rows(ref: Tensor, bd, index, out) -> "Routed | None":
    """``ref[index]`` by two or more 1-D integer tensors, one of them on ``ref``'s batch dim
    ``bd`` (an int): the output's dim 0 holds the picked elements, row ``r`` of the sample
    ``index[bd][r]`` (Longformer's ``key_vectors[batch_ids, positions]``); else ``None``."""
    entries = _advanced(index)
    if (entries is None or type(bd) is not int or bd >= len(entries)
            or not isinstance(entries[bd], Tensor) or not isinstance(out, Tensor)
            or out.dim() == 0 or out.shape[0] != entries[bd].shape[0]):
        return None
    return Routed(entries[bd], entries[bd], ref.shape[bd])


def _sample_coordinate(target: Tensor, index, routed: Routed, t_bd) -> "int | None":
    # The dim of ``target`` that ``target[index] = rows`` (``rows`` routed) writes each row
    # into its own sample's slice of: the index's entry there equals the rows' samples.
    entries = _advanced(index)
    if entries is None or entries[0].shape[0] != routed.samples.shape[0]:
        return None
    for d, t in enumerate(entries):
        if (isinstance(t, Tensor) and d < target.dim() and target.shape[d] == routed.size
                and (t_bd is None or d == t_bd) and bool(torch.equal(t, routed.samples))):
            return d
    return None


def dim_of(bd) -> "tuple | None":
    """``(dim, inner)`` of a batch dim as provenance tags it: ``(bd, 1)`` for an int, the pair
    itself for a batch merged with the dims after it; ``None`` for rows gathered by an index
    (:class:`Routed`) or a lost batch dim."""
    if type(bd) is int:
        return bd, 1
    return bd if isinstance(bd, tuple) else None


def strided_dim(ref: Tensor, bd, out) -> "int | tuple | None":
    """The batch dim of ``out = ref.as_strided(size, stride)`` for ``ref`` with its batch on
    dim 0 (``bd``: ``0`` or a merged ``(0, inner)``): kept where ``ref`` fills its span of
    storage (a permutation of a contiguous tensor) and ``out`` reads within it, the view keeps
    dim 0's size, stride ``s0`` and offset, and, in ``ref`` and ``out`` alike, the row of every element is
    the one its offset says: each other dim's stride is either a multiple of ``N * s0`` (``N``
    rows: whole blocks of rows) or small, the small ones' extent ``sum((n_i - 1) * stride_i)``
    below ``s0`` (Longformer's sliding chunks over ``(B * H, T, d)`` rows, laid out
    ``(T, B * H, d)`` in memory); else ``None``."""
    parts = dim_of(bd)
    if parts is None or parts[0] != 0 or not isinstance(out, Tensor) or not out.dim() or (
            not ref.dim()):
        return None
    s0 = ref.stride(0)
    if (out.shape[0] != ref.shape[0] or out.stride(0) != s0 or s0 <= 0
            or out.storage_offset() != ref.storage_offset()):
        return None
    reach = sum((n - 1) * st for n, st in zip(out.shape, out.stride()))  # (its last offset)
    if not _dense(ref) or out.numel() and reach >= ref.numel():
        return None  # (it may read memory that is not ref's: another tensor's in its base)
    return bd if _rows_apart(ref, s0) and _rows_apart(out, s0) else None


def _dense(t: Tensor) -> bool:
    # Whether t's elements fill their span of storage once each (a permutation of a
    # contiguous tensor): every offset in [offset, offset + numel) is one of its elements.
    size = 1
    for st, n in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if st != size:
            return False
        size *= n
    return True


def _rows_apart(t: Tensor, s0: int) -> bool:
    # strided_dim's condition on one tensor: its elements' offsets determine their row
    if any(n == 0 for n in t.shape):
        return True
    block, small = t.shape[0] * s0, 0
    for n, s in zip(t.shape[1:], t.stride()[1:]):
        if n > 1 and not (s > 0 and s % block == 0):
            small += (n - 1) * s
    return small < s0
