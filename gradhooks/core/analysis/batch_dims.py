"""Where the batch dim goes through an op: :func:`batch_dim_after`, and the tables of torch ops
that :mod:`gradhooks.core.analysis.provenance` sorts by how they treat the batch.

Provenance tags every batched tensor of a tracked forward with its batch dim, so that where a
shared tensor meets the batch the dim it lines up with is known from the data flow, never read
off a size (a ``(T, 1, D)`` position table added to a ``(T, B, D)`` activation with ``T == B``
is a broadcast over dim 1, not rows of dim 0). The common ops are followed by rule (elementwise
ops keep it right-aligned, a transpose moves it, a view keeps it where the dims before it keep
their product, a merge with the dims after it gives ``(dim, inner)``: ``(B * T, D)`` rows; rows
gathered from such a merge by an index, or joined along the batch dim, give :class:`Routed`: each
row's sample); any
other op is replayed on ``meta`` tensors whose batch dims have a size no other dim has (cached
per shapes). Where the batch dim cannot be followed it is ``None`` (lost) and the declared
layout stands in.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ...base import torch_internals
from ...base.segments import per_key_rows
from .einsum import einsum_dim
from .indexing import (
    Routed,
    arange_index_dim,
    assigned,
    assigned_dim,
    index_dim,
    picked_rows,
    strided_dim,
)

__all__ = ["relayout", "batch_dim_after", "operands", "ROW_ALIGNED", "METADATA", "JOINS", "MATMULS",
           "RECURRENT", "Routed", "is_grouped_mm", "recurrent_layout"]


# Grouped matrix products (``out[r] = x[r] @ w[e(r)]``, rows ``offs[e-1] <= r < offs[e]`` of
# group ``e``): torch's and transformers' custom op that stands in for it (its experts).
GROUPED_MM = frozenset(f for f in (torch_internals.grouped_mm,
                                   getattr(F, "grouped_mm", None)) if f is not None)


def is_grouped_mm(func) -> bool:
    """Whether ``func`` is a grouped matrix product of ``(S, I)`` rows by ``(E, I, O)`` groups
    with offsets (:data:`GROUPED_MM`, or transformers' ``grouped_mm_fallback`` custom op)."""
    if func in GROUPED_MM:
        return True
    name = getattr(func, "_qualified_op_name", None)
    if name is None and isinstance(func, torch_internals.OpOverload):
        name = func.name()
    return name == "transformers::grouped_mm_fallback"


def _functions(names, owners) -> frozenset:
    found = set()
    for owner in owners:
        for name in names:
            f = getattr(owner, name, None)
            if f is not None:
                found.add(f)
    return frozenset(found)


_ELEMENTWISE = (
    "add", "add_", "sub", "sub_", "subtract", "mul", "mul_", "multiply", "div", "div_", "divide",
    "true_divide", "floor_divide", "remainder", "fmod", "pow", "pow_", "maximum", "minimum", "fmax",
    "fmin", "where", "masked_fill", "masked_fill_", "addcmul", "addcdiv", "lerp", "atan2",
    "hypot", "logaddexp", "copysign", "clamp", "clip",
    "__add__", "__radd__", "__iadd__", "__sub__", "__rsub__", "__isub__", "__mul__", "__rmul__",
    "__imul__", "__truediv__", "__rtruediv__", "__itruediv__", "__div__", "__rdiv__", "__idiv__",
    "__pow__", "__rpow__", "__ipow__")
_MATMUL = ("matmul", "bmm", "__matmul__", "__rmatmul__")
_JOIN = ("cat", "concat", "concatenate", "stack")

# torch's recurrent kernels: whole layers (states (layers * directions, B, H): batch dim 1) and
# cells (states (B, H), lined up with the input (B, in))
RECURRENT = _functions(("lstm", "gru", "rnn_tanh", "rnn_relu"), (torch_internals.VF,))
_CELLS = _functions(("lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell"), (torch_internals.VF,))

#: Ops whose operands line up on the batch dim by broadcasting (elementwise, batched matmul) or
#: row by row (``cat`` / ``stack`` along another dim, a recurrent cell's state): where a source
#: meets the batch in one of these, its per-sample cotangents are taken
#: (:mod:`gradhooks.core.analysis.provenance`); and a recurrent layer's initial states, on their dim 1.
ROW_ALIGNED = (_functions(_ELEMENTWISE + _MATMUL + _JOIN, (torch, torch.Tensor))
               | {F.scaled_dot_product_attention} | _CELLS)
#: ``cat`` / ``stack``: row-aligned only off the batch dim.
JOINS = _functions(_JOIN, (torch,))
#: ``matmul`` / ``bmm``: only the dims before the last two broadcast.
MATMULS = _functions(_MATMUL, (torch, torch.Tensor))

#: Reads of metadata, the most frequent calls, and factories whose values are constants
#: (``h.new_zeros(K, B, E)``: a fresh tensor, whatever ``h`` holds): provenance passes them
#: through untouched.
METADATA = frozenset(
    [getattr(torch.Tensor, n) for n in ("size", "dim", "numel", "stride", "is_contiguous",
                                         "is_floating_point", "is_complex", "__len__", "data_ptr",
                                         "element_size", "storage_offset", "get_device",
                                         "new_zeros", "new_ones", "new_empty", "new_full")]
    + [getattr(torch.Tensor, n).__get__ for n in ("shape", "dtype", "device", "ndim",
                                                  "requires_grad", "is_cuda", "grad_fn", "layout",
                                                  "_version", "is_sparse", "is_meta", "grad")
       if hasattr(getattr(torch.Tensor, n, None), "__get__")])


# Ops whose output keeps the batched operand's dims, right-aligned (elementwise and unary ops,
# norms over the last dims, casts): the batch dim follows without a replay.
_SAME = _functions(_ELEMENTWISE + (
    "relu", "relu_", "gelu", "gelu_", "silu", "silu_", "tanh", "tanh_", "sigmoid", "sigmoid_",
    "softmax", "log_softmax", "softmin", "dropout", "dropout_", "alpha_dropout",
    "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d", "layer_norm", "rms_norm",
    "group_norm", "batch_norm", "instance_norm", "normalize", "exp", "exp_", "log", "log1p",
    "sqrt", "rsqrt", "neg", "__neg__", "abs", "square", "reciprocal", "sign", "sin", "cos",
    "erf", "softplus", "elu", "leaky_relu", "hardtanh", "hardswish", "hardsigmoid", "mish",
    "celu", "selu", "threshold", "relu6", "prelu", "rrelu", "hardshrink", "softsign",
    "tanhshrink", "logsigmoid", "logit", "tril", "triu", "cumsum", "flip", "roll",
    "masked_fill", "nan_to_num", "clone", "contiguous", "to", "type", "float", "double", "half",
    "bfloat16", "type_as", "detach", "requires_grad_"), (torch, torch.Tensor, F))
_RESHAPE = _functions(("view", "reshape", "view_as", "reshape_as", "expand", "expand_as",
                       "flatten", "unflatten", "broadcast_to"), (torch, torch.Tensor))
# Tensors of a batched operand's shape holding none of its values (T5's shifted labels): its layout.
_LIKE = _functions(("new_zeros", "new_ones", "new_full", "new_empty", "zeros_like", "ones_like",
                    "empty_like", "full_like"), (torch, torch.Tensor))
_TRANSPOSE = _functions(("transpose", "transpose_", "swapaxes", "swapdims"), (torch, torch.Tensor))
_PERMUTE = _functions(("permute",), (torch, torch.Tensor))
_UNSQUEEZE = _functions(("unsqueeze", "unsqueeze_"), (torch, torch.Tensor))
_REDUCE = _functions(("sum", "mean", "amax", "amin", "max", "min", "std", "var", "logsumexp",
                      "norm", "prod", "any", "all", "argmax", "argmin"), (torch, torch.Tensor))

#: Comparisons (boolean masks of rows, e.g. the experts' sentinel rows): elementwise.
_COMPARE = _functions(("eq", "ne", "lt", "le", "gt", "ge", "__eq__", "__ne__", "__lt__",
                       "__le__", "__gt__", "__ge__", "logical_not", "logical_and",
                       "logical_or", "isnan", "isfinite"), (torch, torch.Tensor))
_UNBIND = _functions(("unbind",), (torch, torch.Tensor))
_TOPK = _functions(("topk", "sort"), (torch, torch.Tensor))
_TOPK_K = _functions(("topk",), (torch, torch.Tensor))  # (topk(x, k, dim), sort(x, dim))
# ops returning pieces along a dim: the position of their dim argument
_PIECES = {**{f: 1 for f in _UNBIND},
           **{f: 2 for f in _functions(("chunk", "split", "tensor_split"), (torch, torch.Tensor))}}
_GETITEM = torch.Tensor.__getitem__
_AS_STRIDED = _functions(("as_strided",), (torch, torch.Tensor))
_NARROW = _functions(("narrow",), (torch, torch.Tensor))
_SPATIAL = {f: k for k in (1, 2, 3) for f in _functions(
    (f"conv{k}d", f"conv_transpose{k}d", f"max_pool{k}d", f"avg_pool{k}d",
     f"adaptive_avg_pool{k}d", f"adaptive_max_pool{k}d"), (torch, F))}


def batch_dim_after(func, args, kwargs, ref: Tensor, bd, batched, out):
    """The batch dim of ``out = func(*args, **kwargs)``, followed from its batched operands
    (``batched``: ``[(tensor, its batch dim)]``; ``ref`` the one of most dims, batch dim
    ``bd``), or ``None`` where the op merges it with other dims or drops it. Elementwise ops
    keep it right-aligned, transposes / permutes / unsqueezes move it, views and reshapes keep
    it where the dims before it keep their product; any other op is replayed on ``meta``
    tensors whose batch dims get a size no other dim has, and the batch dim is where that size
    comes out (so a dim whose size happens to equal ``B`` is never taken for it). A list for a
    tuple output.

    A batch merged with the dims after it (``(B, H, T, d) -> (B * H, T, d)``, attention code
    that runs ``bmm`` over samples and heads) is kept as ``(dim, inner)``: dim ``dim`` has size
    ``B * inner`` with the samples as its outer factor; views split it back where the flat
    layout allows (``(T, B * H, d) -> (T, B, H * d)``).
    """
    if func in _INDEX_ADDS and batched is not None:  # (the target may carry no batch dim)
        scattered = _scattered(args, kwargs, batched, out)
        if scattered is not None:
            return scattered
    if func is torch.einsum and batched is not None:
        return einsum_dim(args, batched, out)
    if func is assigned:  # (x[index] = value)
        return assigned_dim(args, batched or ())
    if func in _AS_STRIDED and args and args[0] is ref:
        return strided_dim(ref, bd, out)
    if func in _NARROW and type(bd) is int and args and args[0] is ref:  # (its start / length
        return bd if _args(args, kwargs, (("dim", 1),))[0] % ref.dim() != bd else None  # maybe
        # tensors from the batch: separation_verdict judges them)
    if bd is None:
        return None
    if func is _GETITEM and args and args[0] is ref and not isinstance(bd, Routed):
        routed = _gathered(ref, bd, args[1], out)
        if routed is not None:
            return routed
    if func in JOINS and batched is not None:
        joined = _joined(args, kwargs, batched, out)
        if joined is not None:
            return joined
    if func in _TOPK and args and args[0] is ref:
        ranked = _ranked(ref, bd, out)
        if ranked is not None:
            return ranked
    if isinstance(bd, Routed):
        return _routed_after(func, args, kwargs, ref, bd, batched, out)
    if isinstance(bd, tuple):  # a merged batch: its dim moves as a dim does
        d, inner = bd
        if args and args[0] is ref and func in _RESHAPE and isinstance(out, Tensor):
            return _flat_batch(ref.shape, d, inner, out.shape)
        if func in _SPATIAL:
            return None
        got = _dim_after(func, args, kwargs, ref, d, None, out)
        if isinstance(got, list):
            return [None if g is None else (g, inner) for g in got]
        return None if got is None else (got, inner)
    return _dim_after(func, args, kwargs, ref, bd, batched, out)


def _dim_after(func, args, kwargs, ref: Tensor, bd: int, batched, out):
    # batch_dim_after for a batch dim of its own (``batched`` None: no meta replay)
    if func in _SAME or func in _COMPARE:
        if isinstance(out, Tensor) and out.dim() >= ref.dim():
            return bd + out.dim() - ref.dim()
    elif func in _ADDMM and len(args) > 2 and args[1] is ref and isinstance(out, Tensor):
        return bd if bd == 0 and ref.dim() == out.dim() else None  # (rows of m1 stay rows)
    elif func in _GATHERS and isinstance(out, Tensor) and batched is not None:
        # gather(x, dim, index): the output has index's shape; along another dim than the
        # batch's, row n is read from row n
        dim = _args(args, kwargs, (("dim", _GATHERS[func]),))[0] % max(out.dim(), 1)
        dims = {b for _, b in batched}
        if len(dims) == 1 and bd in dims and bd != dim and all(
                t.dim() == out.dim() for t, _ in batched):
            return bd
    elif func is F.scaled_dot_product_attention and isinstance(out, Tensor) and batched:
        # (a query shared by the batch, its keys and values batched: the batch broadcasts)
        if all(isinstance(b, int) and b < t.dim() - 2 and b - t.dim() == bd - ref.dim()
               for t, b in batched):
            return bd + out.dim() - ref.dim()
    elif func is F.multi_head_attention_forward and isinstance(out, (tuple, list)):
        if bd == 1 and ref.dim() == 3:  # ((L, B, E) in, (L, B, E) out, weights (B, L, S))
            return [1] + [0] * (len(out) - 1)
    elif (func in MATMULS and len(args) > 1 and args[1] is ref and ref.dim() >= 2
          and isinstance(out, Tensor) and batched is not None and len(batched) == 1):
        nd = ref.dim()  # (ref on the right: its columns and batch dims stay; its rows contracted)
        lead = out.dim() - (2 if args[0].dim() >= 2 else 1)  # (the output's broadcast dims)
        return None if bd == nd - 2 else out.dim() - 1 if bd == nd - 1 else lead - nd + 2 + bd
    elif args and args[0] is ref and isinstance(out, Tensor):
        nd = ref.dim()
        if func in _LIKE:
            return bd if out.shape == ref.shape else None
        if func in _TRANSPOSE:
            d0, d1 = (a % nd for a in _args(args, kwargs, (("dim0", 1), ("dim1", 2))))
            return d1 if bd == d0 else d0 if bd == d1 else bd
        if func in _PERMUTE:
            dims = kwargs.get("dims", args[1:] if len(args) > 2 or not isinstance(
                args[1], (tuple, list)) else args[1])
            return [d % nd for d in dims].index(bd)
        if func in _UNSQUEEZE:
            d = _args(args, kwargs, (("dim", 1),))[0] % (nd + 1)
            return bd + (d <= bd)
        if func in _EXPAND:  # (new dims on the left; the batch dim keeps its size)
            d = bd + out.dim() - nd
            return d if out.shape[d] == ref.shape[bd] else None
        if func in _RESHAPE:
            return _flat_batch(ref.shape, bd, 1, out.shape)
        if func is F.linear:
            return bd if bd < nd - 1 else None
        if is_grouped_mm(func):  # ((S, I) rows by groups: the rows stay)
            return bd if bd == 0 and nd == 2 else None
        if func in MATMULS and nd >= 2:  # (ref on the left: its rows and batch dims stay)
            if bd == nd - 1:
                return None  # (contracted)
            other = args[1] if len(args) > 1 else kwargs.get("other")
            if bd == nd - 2:
                return out.dim() - (2 if isinstance(other, Tensor) and other.dim() >= 2 else 1)
            return bd + out.dim() - nd
        if func is _GETITEM:
            got = index_dim(nd, bd, args[1])
            if got is not False:
                return got
            got = arange_index_dim(ref, bd, args[1], out)  # (else: the meta replay)
            if got is not None:
                return got
        if func in _SPATIAL:  # (convolutions and pools: the batch on dim 0 of a batched input)
            return 0 if bd == 0 and out.dim() == nd and nd == _SPATIAL[func] + 2 else None
        if func is F.pad:
            pad = args[1] if len(args) > 1 else kwargs["pad"]
            return bd if bd < nd - len(pad) // 2 or not any(pad[2 * (nd - 1 - bd):][:2]) else None
        if func is F.embedding:  # (indices (*), output (*, D))
            return bd
        if func is F.embedding_bag:  # (bags on dim 0: (B, N) indices, or flat with offsets)
            return 0 if bd == 0 else None
        if func is F.scaled_dot_product_attention:  # (the query's layout)
            return bd + out.dim() - nd if bd < nd - 1 else None
        if func in _REDUCE:
            dims = kwargs.get("dim", args[1] if len(args) > 1 else None)
            if dims is None or not isinstance(dims, (int, tuple, list)):
                return None
            dims = {d % nd for d in ((dims,) if isinstance(dims, int) else dims)}
            if bd in dims or not dims:
                return None
            keep = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
            return bd if keep else bd - sum(d < bd for d in dims)
    if func in _TOPK and args and args[0] is ref and isinstance(out, (tuple, list)):
        dim = kwargs.get("dim", args[2 if func in _TOPK_K else 1] if len(args) > (
            2 if func in _TOPK_K else 1) else -1) % ref.dim()
        return [None if dim == bd else bd] * len(out)
    if func in _PIECES and args and args[0] is ref and isinstance(out, (tuple, list)):
        nd = ref.dim()
        d = kwargs.get("dim", args[_PIECES[func]] if len(args) > _PIECES[func] else 0) % nd
        one = None if d == bd else bd - (d < bd and func in _UNBIND)
        return [one] * len(out)
    if func in JOINS and isinstance(out, Tensor):  # (its other operands may be made from sizes)
        d = _args(args, kwargs, (("dim", 1),))[0] if len(args) > 1 or "dim" in kwargs else 0
        if out.dim() == ref.dim():  # cat
            return bd if d % out.dim() != bd else None
        return bd + (d % out.dim() <= bd)  # stack
    if batched is None or not (isinstance(out, Tensor) or isinstance(out, (tuple, list)) and all(
            isinstance(o, Tensor) for o in out)):
        return None
    return _on_meta(func, args, kwargs, batched, out)


_INDEX_ADDS = _functions(("index_add", "index_add_", "index_copy", "index_copy_"),
                         (torch, torch.Tensor))
_ADDMM = _functions(("addmm",), (torch, torch.Tensor))
_GATHERS = {**{f: 1 for f in _functions(("gather",), (torch, torch.Tensor))},
            **{f: 2 for f in _functions(("take_along_dim",), (torch, torch.Tensor))}}
_EXPAND = _functions(("expand", "expand_as", "broadcast_to"), (torch, torch.Tensor))


def _scattered(args, kwargs, batched, out):
    # out.index_add_(0, index, source) with source rows gathered from a batch by that index
    # (Routed, key ``index``: a mixture of experts' outputs added back to their token rows):
    # row r of the output sums rows of the sample r // inner only, as the batch's B * inner
    # rows. (The target, when it carries the batch, must be in that layout.)
    if len(args) < 4 or not isinstance(out, Tensor) or out.dim() == 0:
        return None
    dim, index, source = args[1], args[2], args[3]
    dims = {id(t): b for t, b in batched}
    routed = dims.get(id(source))
    if dim != 0 or not isinstance(routed, Routed) or routed.key is not index:
        return None
    rows = out.shape[0]
    if not routed.size or rows % routed.size:
        return None
    inner = rows // routed.size
    if not bool(torch.equal(routed.samples, index // inner)):
        return None
    got = 0 if inner == 1 else (0, inner)
    target = dims.get(id(args[0]), None)
    return got if target is None or target == got or id(args[0]) not in dims else None


def _gathered(ref: Tensor, bd, index, out) -> "Routed | None":
    # x[idx] / x[idx, slot, None] on a batch merged with the dims after it on dim 0 (``B *
    # inner`` rows, a mixture of experts' token rows): the output's dim 0 holds the rows idx
    # picks, each of the sample ``idx // inner``. (A gather from B rows, and one of integers
    # (targets), are left to the replay.)
    inner = (bd[1] if isinstance(bd, tuple) and bd[0] == 0 else 1 if bd == 0 and ref.dim() == 2
             else None) if ref.is_floating_point() else None  # ((B, D) rows: T = 1)
    index = index if isinstance(index, tuple) else (index,)
    first = index[0] if index else None
    if isinstance(bd, Routed):  # (rows of rows: each keeps its sample)
        inner = 1
    elif type(bd) is int and ref.is_floating_point():  # (elements picked by sample, position)
        picked = picked_rows(ref, bd, index, out)
        if picked is not None:
            return picked
    if (inner is None or not isinstance(first, Tensor) or first.dim() != 1
            or first.dtype not in (torch.int64, torch.int32) or not isinstance(out, Tensor)
            or out.dim() == 0 or out.shape[0] != first.shape[0]):
        return None
    tensors_at = [i for i, t in enumerate(index) if isinstance(t, Tensor)]
    if tensors_at != list(range(len(tensors_at))) or any(
            index[i].shape != first.shape for i in tensors_at):
        return None  # (advanced indices not all at the front, or broadcast among themselves)
    if isinstance(bd, Routed):
        return Routed(bd.samples[first], first, bd.size)
    return Routed(first // inner, first, ref.shape[0] // inner)


def _row_inner(bd) -> "int | None":
    # rows per sample of a batch on dim 0 (``B`` rows: 1; ``B * inner`` merged rows: inner)
    return bd[1] if isinstance(bd, tuple) and bd[0] == 0 else 1 if bd == 0 else None


def _ranked(ref: Tensor, bd, out) -> "list | None":
    # sort / topk of a 1-D batch (along it: its one dim; the B * inner rows of a merged batch,
    # or routed rows: transformers' grouped experts sort the token-expert pairs' expert ids):
    # values[r] = ref[indices[r]], so both outputs hold, row r, a row of the sample of row
    # indices[r] (the rows a gather by ``indices`` would give; a sort along the batch of rows
    # that carry a gradient is still judged by the whitelist).
    inner = _row_inner(bd)
    if (ref.dim() != 1 or not isinstance(out, (tuple, list)) or len(out) != 2
            or not isinstance(out[1], Tensor) or out[1].dim() != 1
            or (inner is None and not isinstance(bd, Routed))):
        return None
    order = out[1]
    if isinstance(bd, Routed):
        routed = Routed(bd.samples[order], order, bd.size)
    else:
        routed = Routed(order // inner, order, ref.shape[0] // inner)
    return [routed, routed]


def _joined(args, kwargs, batched, out) -> "Routed | None":
    # cat along dim 0 of batches on dim 0 (B rows, or B * inner merged rows; a mixture of
    # experts' load-balancing loss joins every layer's router logits): rows of known samples.
    d = _args(args, kwargs, (("dim", 1),))[0] if len(args) > 1 or "dim" in kwargs else 0
    parts = args[0] if args else kwargs.get("tensors")
    if (d != 0 or not isinstance(out, Tensor) or not out.is_floating_point() or out.dim() < 1
            or not isinstance(parts, (list, tuple)) or len(batched) != len(parts)
            or out.dim() != parts[0].dim()):
        return None
    dims = {id(t): bd for t, bd in batched}
    samples = []
    for t in parts:
        bd = dims.get(id(t))
        inner = _row_inner(bd)
        if inner is None:
            return None
        samples.append(torch.arange(t.shape[0], device=t.device) // inner)
    return Routed(torch.cat(samples), out, parts[0].shape[0] // (
        dims[id(parts[0])][1] if isinstance(dims[id(parts[0])], tuple) else 1))


def _routed_after(func, args, kwargs, ref: Tensor, bd: Routed, batched, out):
    # Rows gathered by an index stay rows of the same samples through ops that keep dim 0:
    # elementwise ops among rows of the same samples, F.linear, a grouped product (its offsets
    # are integers made from the batch's routing), pieces along other dims, basic indexing that
    # keeps dim 0 whole, a gather of their rows; a view once the rows are the samples' in order
    # again (the routing undone) is followed as the merged batch; any other op loses them.
    nd = ref.dim()
    if is_grouped_mm(func) and args and args[0] is ref and nd == 2 and isinstance(out, Tensor):
        return bd
    if func is _GETITEM and args and args[0] is ref:
        gathered = _gathered(ref, bd, args[1], out)
        if gathered is not None:
            return gathered
    if batched is not None and any(not isinstance(d, Routed) or not d.lines_up(bd)
                                   for _, d in batched):
        return None
    if func in _RESHAPE and args and args[0] is ref and isinstance(out, Tensor):
        if out.dim() and out.shape[0] == ref.shape[0]:
            return bd  # (each row reshaped alone: (N, H, d) -> (N, H * d))
        inner = bd.merged_inner()
        return None if inner is None else _flat_batch(ref.shape, 0, inner, out.shape)
    if isinstance(out, Tensor):
        if out.dim() == 0 or out.shape[0] != ref.shape[0]:
            return None
        if (func in _SAME or func in _COMPARE) and out.dim() == nd or func in _REDUCE and args[
                0] is ref and _dim_after(func, args, kwargs, ref, 0, None, out) == 0:
            return bd  # (elementwise, or reduced over other dims)
        if func in _UNSQUEEZE and args and args[0] is ref and out.dim() == nd + 1 and (
                _args(args, kwargs, (("dim", 1),))[0] % (nd + 1)):
            return bd  # (a new dim after the rows)
        if args and args[0] is ref and (func is F.linear and nd >= 2 or func is _GETITEM
                                        and index_dim(nd, 0, args[1]) == 0):
            return bd
        return None
    if func in _PIECES and args and args[0] is ref and isinstance(out, (tuple, list)):
        d = kwargs.get("dim", args[_PIECES[func]] if len(args) > _PIECES[func] else 0) % nd
        return [bd if d != 0 and func not in _UNBIND else None] * len(out)
    return None


def _args(args, kwargs, spec):
    return [kwargs[name] if name in kwargs else args[pos] for name, pos in spec]


def _flat_batch(shape, bd: int, inner: int, out_shape):
    # Where a view of ``shape`` to ``out_shape`` puts the batch (dim ``bd`` of size ``B * inner``,
    # samples outermost): the output dim whose flat layout holds the samples at the same
    # stride with the same dims outside them, as an int (``inner == 1`` there) or
    # ``(dim, inner)``; None if the view mixes the samples with other dims.
    size = shape[bd]
    if not size or size % inner:
        return None
    b = size // inner
    before = math.prod(shape[:bd])
    stride = inner * math.prod(shape[bd + 1:])
    if before == 0 or stride == 0:
        return None
    acc = 1
    for k, n in enumerate(out_shape):
        if acc == before and n % b == 0 and (n // b) * math.prod(out_shape[k + 1:]) == stride:
            return k if n == b else (k, n // b)
        acc *= n
        if acc > before:
            return None
    return None


_REPLAYS: dict = {}  # (func, the operands' shapes, dtypes and batch dims, other args) -> result
_MAX_REPLAYS = 4096


def _replay_key(func, args, kwargs, dims):
    # A hashable key of the op's signature, or None (an argument that is not hashable).
    def one(a):
        if isinstance(a, Tensor):
            return (tuple(a.shape), a.dtype, dims.get(id(a), -1))
        if type(a) in (list, tuple):
            return tuple(one(t) for t in a)
        return a
    try:
        key = (func, tuple(one(a) for a in args), tuple((k, one(v)) for k, v in kwargs.items()))
        hash(key)
    except TypeError:
        return None
    return key


def _on_meta(func, args, kwargs, batched, out):
    dims = {id(t): bd for t, bd in batched}
    if any(not isinstance(bd, int) for bd in dims.values()):
        return None
    if func in RECURRENT:  # (a replay on meta steps through time in Python: seconds)
        return _recurrent_dims(func, args, dims, out)
    if func in _CELLS:  # (h, c) of a (B, in) input
        return ([0] * len(out) if not isinstance(out, Tensor) else 0) if dims.get(
            id(args[0])) == 0 and args[0].dim() == 2 else None
    key = _replay_key(func, args, kwargs, dims)
    if key is not None and key in _REPLAYS:
        return _REPLAYS[key]
    got = _replay(func, args, kwargs, dims, out)
    if key is not None:
        if len(_REPLAYS) >= _MAX_REPLAYS:
            _REPLAYS.clear()
        _REPLAYS[key] = got
    return got


def recurrent_layout(args) -> list:
    """``[(tensor, batch dim)]`` of a recurrent kernel's input and initial states (``_VF.lstm(
    input, hx, ..., batch_first)``): the input's dim 0 or 1 as ``batch_first`` says, the states'
    dim 1; ``[]`` for a packed sequence's rows."""
    if len(args) < 9 or not isinstance(args[0], Tensor) or args[0].dim() != 3:
        return []
    states = args[1] if isinstance(args[1], (tuple, list)) else (args[1],)
    return [(args[0], 0 if args[8] else 1)] + [(h, 1) for h in states if isinstance(h, Tensor)]


def _recurrent_dims(func, args, dims, out):
    # _VF.lstm(input, hx, weights, bias, layers, dropout, train, bidirectional, batch_first):
    # the output keeps the input's layout, the states are (layers * directions, B, H)
    x = args[0]
    if not isinstance(args[1], (tuple, list, Tensor)) or len(args) < 9 or x.dim() != 3:
        return None  # (a PackedSequence's data)
    bd = dims.get(id(x))
    if bd != (0 if args[8] else 1):  # (a merged batch is not an int: None)
        return None
    return [bd] + [1] * (len(out) - 1)


def _replay(func, args, kwargs, dims, out):
    # (far above every size, so that no dim the op makes from the others meets it)
    unique = 10007 + 3 * max((n for t in operands(args, kwargs) for n in t.shape), default=0)

    def meta(t):
        if not isinstance(t, Tensor):
            return t
        shape = list(t.shape)
        if id(t) in dims:
            shape[dims[id(t)]] = unique
        return torch.empty(shape, dtype=t.dtype, device="meta")

    def swap(a):
        return meta(a) if isinstance(a, Tensor) else (
            type(a)(meta(t) for t in a) if type(a) in (list, tuple) else a)

    def find(o):
        hits = [i for i, n in enumerate(o.shape) if n == unique] if isinstance(o, Tensor) else ()
        return hits[0] if len(hits) == 1 else None

    try:
        with torch.no_grad():
            got = func(*(swap(a) for a in args), **{k: swap(v) for k, v in kwargs.items()})
    except Exception:  # (an op meta tensors do not run, or that reads values: unknown)
        return None
    if isinstance(out, Tensor):
        return find(got)
    return [find(o) for o in got] if isinstance(got, (tuple, list)) else None


def operands(args, kwargs):
    """The tensor operands of an op: its tensor arguments and those in list / tuple arguments
    (also :mod:`gradhooks.core.analysis.provenance`'s, for its messages)."""
    for group in (args, kwargs.values()):
        for a in group:
            if isinstance(a, Tensor):
                yield a
            elif type(a) in (list, tuple):
                yield from (t for t in a if isinstance(t, Tensor))


def relayout(t: Tensor, how: tuple) -> Tensor:
    """A position-wise layer's input or grad_output in the layout its rule reads the batch from
    (:attr:`~gradhooks.core.recorder.placement.Placed.swap`): ``("swap", d0, d1)`` transposes two dims (a ``(T, B, D)`` activation
    in a batch-first model), ``("split", d, B, inner)`` unflattens a dim of ``B * inner`` rows
    into ``(B, inner)`` (``(B * T, D)`` rows): views of ``t``; ``("routed", ...)`` lays rows
    gathered by an index out per sample (:func:`~gradhooks.base.segments.routed_layout`, a new tensor)."""
    if how[0] == "swap":
        return t.transpose(how[1], how[2])
    if how[0] == "routed":
        return per_key_rows(t, how)
    return t.unflatten(how[1], how[2:])
