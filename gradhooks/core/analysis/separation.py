"""Ops proven to keep the samples of a batch apart: the whitelist :mod:`gradhooks.core.analysis.provenance`
accepts, and the verdict on every other op.

Per-sample gradients exist only where each sample's output depends on the parameters through
that sample alone. :mod:`gradhooks.core.analysis.mixing` recognises the common ops that break this (a
softmax or a statistic over the batch, ``z @ z.T``); this module turns the rule around: while a
forward is tracked, an op that takes a tensor carrying the batch *and* the gradient of a
parameter (``requires_grad``; one that carries the batch but no gradient mixes the samples'
inputs, not their parameters, which per-sample gradients allow) is accepted only where a rule
below shows that it keeps the samples apart. Every other op is *unproven*
(:func:`separation_verdict` returns why), and the reads of its forward's signature refuse it
(:class:`~gradhooks.base.errors.UnprovenOpError`) unless the forward-alone check
(:mod:`gradhooks.core.analysis.alone`) passed on that signature.

The table, for operands that carry the gradient (batch dim ``d`` as provenance follows it):

* pointwise ops (arithmetic, activations, dropout, casts, ``where``, ``clamp`` ...): their
  operands' batch dims line up after broadcasting (right-aligned), none lost (``h + h[0]``,
  ``h.unsqueeze(0) + h.unsqueeze(1)`` are not);
* ops along a dim (``softmax``, ``cumsum``, ``sort``, ``flip``, ``roll``, ``diff``,
  ``normalize`` ...): the dim is not ``d``;
* reductions (``sum``, ``mean``, ``max`` ...): over other dims they keep ``d``; over ``d`` they
  give a statistic of the batch, which :mod:`gradhooks.core.analysis.mixing` follows (refused where it
  meets the batch again, accepted as a loss);
* moves (views, ``permute``, ``transpose``, basic indexing, ``cat`` / ``stack``, ``chunk``,
  ``pad``, copies): the output keeps a batch dim (one that drops or merges it with a dim before
  it is unproven);
* products: ``F.linear`` with ``d`` not the feature dim; ``matmul`` / ``mm`` / ``bmm`` /
  ``addmm`` / ``baddbmm`` with ``d`` a broadcast dim of both operands (lined up), or a row
  (column) dim of one operand only; ``einsum`` whose batch letter is that of every carrying
  operand at its batch dim and of the output; attention (``scaled_dot_product_attention``
  with ``d`` before the last two dims, ``multi_head_attention_forward`` with the batch on dim
  1); recurrent kernels with the batch where their layout puts it;
* spatial ops (convolutions, pools, interpolation, ``unfold``): the batch on dim 0 of an input
  with its spatial dims; norms: ``layer_norm`` / ``rms_norm`` over dims after ``d``,
  ``group_norm`` / ``instance_norm`` with ``d == 0``, ``batch_norm`` (training mode is
  :mod:`gradhooks.core.analysis.mixing`'s);
* indexed ops (``gather``, ``scatter*``, ``index_add``, ``index_select``, ``take_along_dim``
  ...): along a dim other than ``d``, operands lined up; along ``d`` they move rows between
  samples (a batch of graphs pooled into graph rows): unproven, and the way out is a declared
  sample index;
* losses (``F.*_loss``, ``cross_entropy``): accepted here; whether the loss splits into
  per-sample terms is :mod:`gradhooks.core.analysis.token_means`' question.

Unproven as well: an operand that carries the gradient and the batch but whose batch dim was
lost, the output of a custom ``torch.autograd.Function`` (its ``forward`` ran without gradient,
so its ops were not judged), and any op not in the table.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import BackwardCFunction

from .batch_dims import (
    _CELLS,
    _ELEMENTWISE,
    _PIECES,
    _SPATIAL,
    JOINS,
    MATMULS,
    RECURRENT,
    Routed,
    _functions,
    is_grouped_mm,
)
from .einsum import einsum_subscripts
from .indexing import IN_ORDER, IN_ORDER_NOTES, assigned, dim_of

__all__ = ["separation_verdict", "custom_function", "output_node", "SCATTERS", "UNPROVEN",
           "BY_VALUES"]

#: Why an op's verdict holds for one batch only: a move by a size or position the batch's values
#: gave (its forward-alone check is run on every forward, not once per structure).
BY_VALUES = "a size or position computed from the batch"

#: :class:`~gradhooks.core.analysis.mixing.Mixing`'s kind of an op no rule proves keeps samples apart.
UNPROVEN = "unproven"


def output_node(out):
    """The autograd node of an op's output ``out`` (a tensor, or the first of a tuple / list
    that requires grad), or ``None``."""
    outs = (out,) if isinstance(out, torch.Tensor) else out
    return next((o.grad_fn for o in outs if isinstance(o, torch.Tensor) and o.requires_grad),
                None)

_MODS = (torch, torch.Tensor, F, torch.special, torch.linalg)

_UNARY = (
    "relu", "relu_", "gelu", "gelu_", "silu", "silu_", "tanh", "tanh_", "sigmoid", "sigmoid_",
    "exp", "exp_", "exp2", "expm1", "log", "log_", "log1p", "log2", "log10", "sqrt", "sqrt_",
    "rsqrt", "neg", "neg_", "__neg__", "__pos__", "__abs__", "positive", "abs", "abs_",
    "square", "reciprocal", "sign", "sgn", "sin", "cos", "tan", "asin", "acos", "atan", "sinh",
    "cosh", "asinh", "acosh", "atanh", "erf", "erfc", "erfinv", "softplus", "elu", "elu_",
    "leaky_relu", "leaky_relu_", "hardtanh", "hardtanh_", "hardswish", "hardsigmoid", "mish",
    "celu", "selu", "threshold", "relu6", "prelu", "rrelu", "hardshrink", "softshrink",
    "softsign", "tanhshrink", "logsigmoid", "logit", "nan_to_num", "floor", "ceil",
    "round", "trunc", "frac", "clamp_", "clamp_min", "clamp_max", "clip_", "sinc", "lgamma",
    "digamma", "polygamma", "i0", "xlogy", "expit", "float_power", "real", "imag", "conj",
    "angle", "view_as_real", "view_as_complex", "dropout", "dropout_", "alpha_dropout",
    "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d", "clone", "contiguous", "to",
    "type", "float", "double", "half", "bfloat16", "type_as", "detach", "requires_grad_",
    "tril", "triu", "masked_fill", "masked_fill_", "fill_", "zero_", "copy_", "mul_", "add_",
    "sub_", "div_", "__and__", "__or__", "__xor__", "__invert__", "eq", "ne", "lt", "le", "gt",
    "ge", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "isnan", "isinf",
    "isfinite", "logical_not", "logical_and", "logical_or", "bitwise_not", "heaviside",
    "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
    "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__", "cpu", "cuda", "pin_memory")
_POINTWISE = _functions(_ELEMENTWISE + _UNARY, _MODS)
# ops along one dim: the position of the dim argument and its default (None: required)
_ALONG = {**{n: (1, None) for n in ("softmax", "log_softmax", "softmin", "cumsum", "cumprod",
                                    "cummax", "cummin", "logcumsumexp", "cumsum_", "argsort")},
          "sort": (1, -1), "argsort": (1, -1), "msort": (None, 0), "normalize": (2, 1),
          "diff": (2, -1), "flip": (1, None), "fliplr": (None, 1), "flipud": (None, 0),
          "roll": (2, None), "topk": (2, -1), "kthvalue": (2, -1), "cummax": (1, None),
          "glu": (1, -1), "gumbel_softmax": (4, -1)}
_ALONG_OPS = {f: n for n in _ALONG for f in _functions((n,), _MODS)}
_REDUCTIONS = _functions((
    "sum", "mean", "nansum", "nanmean", "std", "var", "prod", "amax", "amin", "max", "min",
    "median", "nanmedian", "var_mean", "std_mean", "logsumexp", "aminmax", "norm",
    "vector_norm", "matrix_norm", "quantile", "nanquantile", "mode", "any", "all", "argmax",
    "argmin", "count_nonzero", "dist", "trace"), _MODS)
_MOVES = _functions((
    "view", "reshape", "view_as", "reshape_as", "expand", "expand_as", "flatten", "unflatten",
    "broadcast_to", "transpose", "transpose_", "swapaxes", "swapdims", "t", "permute",
    "movedim", "moveaxis", "unsqueeze", "unsqueeze_", "squeeze", "squeeze_", "__getitem__",
    "narrow", "select", "chunk", "split", "tensor_split", "unbind", "split_with_sizes", "cat",
    "concat", "concatenate", "stack", "hstack", "vstack", "dstack", "pad", "repeat",
    "repeat_interleave", "tile", "atleast_1d", "atleast_2d", "atleast_3d", "as_strided",
    "unfold", "diagonal", "broadcast_tensors", "__iter__", "__reversed__", "resolve_conj",
    "resolve_neg", "__deepcopy__", "new_zeros", "new_ones", "new_empty", "new_full",
    "new_tensor", "align_to"), (torch, torch.Tensor, F)) | frozenset(
    getattr(torch.Tensor, n).__get__ for n in ("T", "mT", "H", "mH", "real", "imag"))
_PRODUCTS = MATMULS | _functions(("mm", "addmm", "baddbmm", "addbmm", "mv", "addmv", "dot",
                                  "vdot", "inner", "outer", "ger", "kron", "tensordot",
                                  "bilinear", "chain_matmul", "multi_dot", "cross",
                                  "linalg_cross"), _MODS)
_ADDS_PRODUCT = _functions(("addmm", "baddbmm", "addmv"), (torch, torch.Tensor))
_LOSSES = frozenset(getattr(F, n) for n in dir(F) if n.endswith("_loss") or n in (
    "cross_entropy", "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div",
    "nll_loss", "mse_loss"))
_SPATIAL_ALL = frozenset(_SPATIAL) | _functions((
    "interpolate", "upsample", "upsample_nearest", "upsample_bilinear", "pixel_shuffle",
    "pixel_unshuffle", "unfold", "fold", "lp_pool1d", "lp_pool2d", "max_pool1d_with_indices",
    "max_pool2d_with_indices", "max_pool3d_with_indices", "fractional_max_pool2d",
    "adaptive_max_pool1d_with_indices", "adaptive_max_pool2d_with_indices", "grid_sample",
    "local_response_norm", "channel_shuffle", "native_channel_shuffle"), (torch, F))
_LAST_NORMS = _functions(("layer_norm", "rms_norm"), (torch, F))
_SAMPLE_NORMS = _functions(("group_norm", "instance_norm"), (torch, F))
_BATCH_NORMS = _functions(("batch_norm",), (torch, F))
#: Indexed ops that move values along a dim: along the batch dim they move rows between
#: samples (message passing and pooling over a batch of graphs).
SCATTERS = _functions((
    "index_add", "index_add_", "index_copy", "index_copy_", "index_fill", "index_fill_",
    "index_reduce", "index_reduce_", "index_select", "scatter", "scatter_", "scatter_add",
    "scatter_add_", "scatter_reduce", "scatter_reduce_", "gather", "take_along_dim",
    "segment_reduce", "_segment_reduce", "index_put", "index_put_", "put", "put_", "take",
    "masked_scatter", "masked_scatter_", "masked_select", "__setitem__"), (torch, torch.Tensor))
# (the dim argument's position: x.index_add(dim, ...), take_along_dim(x, indices, dim))
_INDEXED_DIM = {f: 2 if getattr(f, "__name__", "") == "take_along_dim" else 1 for f in SCATTERS}
_ATTENTION = {F.scaled_dot_product_attention}
_MHA = {F.multi_head_attention_forward}
_EMBEDDINGS = {F.embedding, F.embedding_bag, F.one_hot}


_INDEX_SELECT = _functions(("index_select",), (torch, torch.Tensor))


def _permutes(index, size: int) -> bool:
    # Whether ``index`` is a permutation of range(size) (reads its values).
    return (isinstance(index, Tensor) and index.dim() == 1 and index.shape[0] == size
            and not index.is_floating_point() and bool(torch.equal(
                index.sort().values, torch.arange(size, device=index.device,
                                                  dtype=index.dtype))))


def custom_function(t: Tensor) -> Optional[str]:
    """The name of the custom ``torch.autograd.Function`` whose output ``t`` is, else ``None``."""
    fn = t.grad_fn
    if fn is None or not isinstance(fn, BackwardCFunction):
        return None
    name = type(fn).__name__
    if name.startswith("GeneratedBackwardFor_"):
        return None  # (a torch.library custom op: provenance saw and judged the op itself)
    return name.removesuffix("Backward")


def _aligned(carrying, out_nd: int, batched=None) -> Optional[str]:
    # Pointwise: every carrying operand's batch dim, right-aligned, is the same output dim; and
    # none that lost it meets an operand that has one (``batched``: every operand carrying the
    # batch, with or without a gradient).
    where = None
    known = any(bd is not None for _, bd in (batched or carrying))
    for t, bd in carrying:
        if isinstance(bd, Routed):
            continue  # (rows gathered by an index: mixing.rows_of_others judges them)
        d = dim_of(bd)
        if d is None and not known:
            continue  # (ops among statistics of the batch: mixing.py follows them)
        if d is None:
            return (f"an operand of shape {tuple(t.shape)} depends on the samples but has lost "
                    f"the batch dim (a reduction, an index or a view took it), and is "
                    f"broadcast against the batch")
        pos = (d[0] + out_nd - t.dim(), d[1])
        if where is not None and pos != where:
            return (f"its operands carry the batch on different dims after broadcasting "
                    f"({where[0]} and {pos[0]} of the output): each sample meets the others' "
                    f"rows (broadcasting of unsqueezed copies)")
        where = pos
    return None


def _dims_arg(func, args, kwargs, pos, default, nd):
    dim = kwargs.get("dim", kwargs.get("dims", args[pos] if pos is not None and len(args) > pos
                                        else default))
    if func in _functions(("roll",), (torch, torch.Tensor)) and dim is None:
        return None  # (roll without dims: the flat tensor)
    if isinstance(dim, int) and not isinstance(dim, bool):
        return {dim % nd} if nd else set()
    if isinstance(dim, (tuple, list)) and all(isinstance(d, int) for d in dim):
        return {d % nd for d in dim} if nd else set()
    return None


def _einsum(args, kwargs, carrying) -> Optional[str]:
    # The batch letter of every carrying operand (the letter at its batch dim) is one letter,
    # appears once in each of them, and in the output.
    parsed = einsum_subscripts(args)
    if parsed is None:
        return "einsum in the sublist form or with an equation that does not fit its operands"
    subs, out, ops = parsed
    dims = {id(t): bd for t, bd in carrying}
    letter, inners = None, {b[1] for b in dims.values() if isinstance(b, tuple)}
    if len(inners) > 1 or inners and any(type(b) is int for b in dims.values()):
        return "einsum of operands whose batch is merged with other dims differently"
    for i, t in enumerate(ops):
        if id(t) not in dims:
            continue
        bd = dims[id(t)][0] if isinstance(dims[id(t)], tuple) else dims[id(t)]
        if not isinstance(bd, int):
            return "einsum of an operand whose batch dim provenance could not place"
        mine = subs[i][bd]
        if subs[i].count(mine) != 1:
            return f"einsum {args[0]!r} takes a diagonal over the batch letter {mine!r}"
        if letter is not None and mine != letter:
            return (f"einsum {args[0]!r} pairs the batch letter {letter!r} of one operand with "
                    f"the letter {mine!r} of another: each sample meets the others")
        letter = mine
    if letter is not None and letter not in out:
        return f"einsum {args[0]!r} contracts (sums over) the batch letter {letter!r}"
    return None


def _product(func, args, kwargs, carrying, out, out_bd) -> Optional[str]:
    name = getattr(func, "__name__", "product")
    if func is F.linear:
        for t, bd in carrying:
            if t is not args[0]:
                return (f"linear with a weight or bias of shape {tuple(t.shape)} computed "
                        f"from the batch")
            if isinstance(bd, int) and bd == t.dim() - 1:
                return "linear over the batch dim (the batch is the feature dim)"
        return None if out_bd is not None else "linear whose output lost the batch dim"
    dims_of = {id(t): b for t, b in carrying}
    if func in _ADDS_PRODUCT:  # (addmm(input, m1, m2): input added to the product)
        mats = args[1:3]
        b = dims_of.get(id(args[0]), 0)
        if id(args[0]) in dims_of and not (isinstance(b, int) and isinstance(out_bd, int)
                                           and b + out.dim() - args[0].dim() == out_bd):
            return f"{name} adding a tensor whose batch dim does not line up with the product's"
    else:
        mats = args[:2]
    dims = []
    for i, t in enumerate(mats):
        if not isinstance(t, Tensor) or id(t) not in dims_of:
            continue
        d = dim_of(dims_of[id(t)])
        if d is None or t.dim() < 2:
            return (f"{name} of an operand of shape {tuple(t.shape)} whose batch dim is a "
                    f"vector's or unknown")
        nd = t.dim()
        broadcast = d[0] < nd - 2
        contracted = (nd - 1) if i == 0 else (nd - 2)
        if d[0] == contracted:
            return f"{name} contracts the batch dim of an operand of shape {tuple(t.shape)}"
        dims.append((broadcast, d[0] - nd, d[1]))
    if len(dims) == 2 and not (dims[0][0] and dims[1][0] and dims[0] == dims[1]):
        return f"{name} of two operands that carry the batch, not lined up on a broadcast dim"
    return None if out_bd is not None else f"{name} whose output lost the batch dim"


def separation_verdict(func, args, kwargs, carrying, ref: Tensor, bd, out, out_bd,
                       batched: list) -> Optional[str]:
    """Why ``out = func(*args, **kwargs)`` is not proven to keep the samples apart, or ``None``
    where a rule of the table (module docstring) proves it does.

    Args:
        carrying: ``[(tensor, batch dim)]`` of the op's operands that carry the batch and
            require grad (non-empty).
        ref: the batched operand of most dims, batch dim ``bd``.
        out: the op's output; ``out_bd``: its batch dim
            (:func:`~gradhooks.core.analysis.batch_dims.batch_dim_after`:
            an int, ``(dim, inner)``, a :class:`~gradhooks.core.analysis.batch_dims.Routed`, ``None``
            where lost; a list for a tuple output).
        batched: ``[(tensor, batch dim)]`` of every operand that carries the batch.
    """
    if all(b is None for t, b in batched if t.is_floating_point() or t.is_complex()):
        return None  # (no operand has a batch dim left to keep: where it was lost was judged;
        # an index that carries one picks rows, it holds no sample's values)
    lost = out_bd is None or (isinstance(out_bd, list) and all(o is None for o in out_bd))
    name = getattr(func, "__name__", None) or repr(func)
    if func in _POINTWISE:
        return _aligned(carrying, out.dim() if isinstance(out, Tensor) else ref.dim(), batched)
    if func in _REDUCTIONS or func in _LOSSES or func in _EMBEDDINGS:
        return None
    if func in _ALONG_OPS:
        pos, default = _ALONG[_ALONG_OPS[func]]
        d = dim_of(bd)
        dims = _dims_arg(func, args, kwargs, pos, default, ref.dim())
        if d is None or dims is None or d[0] in dims:
            return f"{name} along the batch dim (or a dim provenance could not read)"
        return _aligned(carrying, ref.dim())
    if func in _MOVES or func in _PIECES or func in JOINS:
        if any(b is None and not t.is_floating_point() for t, b in batched):
            notes = IN_ORDER_NOTES.get()  # (a fact of this batch's values: every forward of
            if notes is not None and not any(kind == IN_ORDER for kind, _ in notes):  # the
                notes.append((IN_ORDER, f"{name} by {BY_VALUES}"))  # signature is analysed)
            return (f"{name} by {BY_VALUES} (Longformer's narrow to the batch's largest count "
                    f"of global tokens): each sample's slice may depend on the others'")
        own = {dim_of(b) for _, b in carrying if not isinstance(b, Routed)}
        if func in JOINS and len(own) > 1:
            return f"{name} of operands that carry the batch on different dims"
        if lost:
            where = "indexing" if func is torch.Tensor.__getitem__ else name
            return (f"{where} drops the batch dim or merges it with a dim before it, so what "
                    f"follows cannot be followed per sample")
        return None
    if func is torch.einsum:
        return _einsum(args, kwargs, carrying)
    if func in _PRODUCTS or func is F.linear:
        return _product(func, args, kwargs, carrying, out, out_bd)
    if is_grouped_mm(func):
        return None if not lost else f"{name} whose output lost the batch dim"
    d = dim_of(bd)
    if func in _SPATIAL_ALL:
        ok = d is not None and d[0] == 0 and all(dim_of(b) == d for _, b in carrying)
        return None if ok and not lost else (
            f"{name} with the batch on dim {bd} (a spatial op reads dim 0 as the batch)")
    if func in _LAST_NORMS:
        shape = kwargs.get("normalized_shape", args[1] if len(args) > 1 else ())
        k = 1 if isinstance(shape, int) else len(shape)
        ok = d is not None and d[0] < ref.dim() - k and carrying[0][0] is args[0]
        return None if ok else f"{name} over the batch dim"
    if func in _SAMPLE_NORMS:
        ok = d is not None and d[0] == 0 and carrying[0][0] is args[0]
        return None if ok else f"{name} with the batch on dim {bd}"
    if func in _BATCH_NORMS:  # (training mode: mixing.py's; eval: per element)
        return None if carrying[0][0] is args[0] else f"{name} with statistics from the batch"
    if func in _ATTENTION:
        for t, b in carrying:
            e = dim_of(b)
            if e is None or e[0] >= t.dim() - 2:
                return (f"{name} with the batch on the sequence or feature dim of shape "
                        f"{tuple(t.shape)}")
        return None if not lost else f"{name} whose output lost the batch dim"
    if func in _MHA:
        for t, b in carrying:
            if not (t.dim() == 3 and b == 1) and t.dim() >= 3:
                return (f"{name} with the batch on dim {b} of shape {tuple(t.shape)}: it "
                        f"attends over dim 0 (batch_first=False)")
            if t.dim() < 3:
                return f"{name} of an unbatched input: it attends over the samples"
        return None
    if func in RECURRENT:
        x = args[0]
        first = len(args) > 8 and bool(args[8])
        for t, b in carrying:
            want = (0 if first else 1) if t is x else 1
            if b != want:
                return f"{name} with the batch on dim {b} of shape {tuple(t.shape)}"
        return None if not lost else f"{name} whose output lost the batch dim"
    if func in _CELLS:
        ok = all(b == 0 and t.dim() == 2 for t, b in carrying)
        return None if ok else f"{name} of an unbatched input"
    if func is assigned:  # (x[index] = value: assigned_dim proves basic indexing only)
        if lost:
            return ("x[index] = value that writes the batch's values where the batch dims do "
                    "not line up (an advanced index, rows written to other rows)")
        lost_value = any(t is args[2] and b is None for t, b in batched)
        return "x[index] = value whose batch dim was lost before" if lost_value else None
    if func in SCATTERS:
        if not lost and any(isinstance(b, Routed) for _, b in carrying):
            return None  # (rows gathered by an index, added back to their rows: batch_dims)
        dims = _dims_arg(func, args, kwargs, _INDEXED_DIM[func], None, ref.dim())
        if func in _INDEX_SELECT and d is not None and dims == {d[0]} and d[1] == 1 and len(
                carrying) == 1 and _permutes(kwargs.get("index", args[2] if len(args) > 2
                                                    else None), ref.shape[d[0]]):
            return None  # (each row one sample's: a PackedSequence's states put back in order;
            # its batch dim is lost, so where it meets the batch again is judged there)
        if d is None or dims is None or d[0] in dims or lost or _aligned(carrying, ref.dim()):
            return (f"{name} along the batch dim: it moves rows between samples (a batch of "
                    f"graphs pooled by its batch vector makes one row per graph from rows of "
                    f"several samples)")
        return None
    return f"{name} is not in the table of ops proven to keep the samples apart"
