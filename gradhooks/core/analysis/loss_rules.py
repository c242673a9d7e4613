"""The table :mod:`gradhooks.core.analysis.loss_graph` proves a loss's split with: for each
autograd node type, what its outputs are given what its inputs are.

What a tensor of the loss's graph is (``None``: it does not depend on the model's outputs):

* :class:`Rows` ``(dim, unit)``: the batch's rows on ``dim``, ``B * unit`` of them, sample ``b``
  owning rows ``[b * unit, (b + 1) * unit)``; ``unit = 0``: each row (each slice along ``dim``)
  belongs to one sample, which one is not known (the batch sliced, reordered or concatenated);
* :class:`One`: the whole tensor depends on one sample (``z[0]``, a loss of one sample),
  known (``sample``) or not;
* :data:`ELEMENTS`: each element depends on one sample, where it sits is not known (advanced
  indexing, ``masked_select``, ``gather`` along the batch dim);
* :data:`LINEAR`: a linear combination of per-sample terms, no batch dim (a sum or mean over the
  samples; a tensor of the forward whose batch dim is not known).

The rules (``B > 1``):

* pointwise ops: one operand that depends on the outputs keeps what it is (lined up after
  broadcasting; a non-linear op on :data:`LINEAR` mixes the samples: ``z.mean() ** 2``);
  several must be aligned rows on one dim (``z - z.mean(0)``, ``z * z.flip(0)`` are not),
  or, for ``+`` / ``-`` / ``where``, sums (:data:`LINEAR`) and one-sample tensors
  (:class:`One`) of any samples, which add up to :data:`LINEAR`; any op on tensors of one
  and the same sample keeps it; other mixes of kinds pair
  samples, proven (``SampleMixingError``) or possibly (unproven);
* reductions: ``sum`` / ``mean`` over the rows' dim (or over every dim) give :data:`LINEAR`;
  every other reduction over it, and every op along it (``softmax``, ``logsumexp``, ``sort``,
  ``cumsum``, ``max``, ``std`` ...) mixes the samples; over other dims they keep the rows;
* moves: views, ``permute``, ``expand`` move the rows' dim; ``select`` along it gives
  :class:`One`, slices, ``split`` and ``cat`` along it follow each row's sample,
  ``index_select`` gives rows of samples not known, ``gather`` along it and advanced indexing :data:`ELEMENTS`;
* products: the rows in an output dim of one operand (or the batched dim of both, aligned);
  contracted against a constant, :data:`LINEAR`; two operands that depend on the outputs in
  other dims pair the samples (``z @ z.T``);
* losses over rows of class scores (``nll_loss``, margins: never the batch on the class
  dim) and elementwise losses (MSE, L1, Huber, BCE, KL ...): rows kept with
  ``reduction="none"``, :data:`LINEAR` otherwise; ``ctc_loss`` with the batch on dim 1;
* layers after the model (``layer_norm`` over other dims, convolutions, ``group_norm``,
  ``batch_norm`` in eval mode) with the rows on dim 0 and constant parameters;
* any other node with an input that depends on the outputs (an unknown op, a custom
  ``autograd.Function``, an in-place op on a view (``CopySlices``), whose op autograd does not
  name): not proven.

Only what autograd keeps after running a node is read: its type, saved sizes and dims
(:data:`gradhooks.base.torch_internals.SAVED`), the shapes of its inputs and outputs.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, NamedTuple, Optional, Union

import torch
from torch import Tensor
from torch.autograd.function import BackwardCFunction

from ...base.torch_internals import saved

__all__ = ["Rows", "One", "ELEMENTS", "LINEAR", "Unproven", "apply", "rows", "averaged"]


class Rows(NamedTuple):
    """The batch's rows on ``dim``; ``ids``: ``(size of dim,)`` int64, the sample of each row
    (``None``: each row is of one sample, which is not known)."""
    dim: int
    ids: Optional[Tensor]


class One(NamedTuple):
    """The whole tensor depends on one sample: ``sample`` (``None``: which is not known)."""
    sample: Optional[int]
#: Each element depends on one sample; which, and where it sits, is not known.
ELEMENTS = "elements"
#: A linear combination of per-sample terms (any shape, no batch dim).
LINEAR = "linear"

Info = Union[Rows, str, None]


class Unproven(Exception):
    """Node ``node`` (an autograd node's name, e.g. ``MmBackward0``) does not keep the samples
    apart, or no rule proves it does (``why``); ``mixes``: proven to pair or mix them."""

    def __init__(self, node: str, why: str, mixes: bool):
        super().__init__(f"{node}: {why}")
        self.node, self.why, self.mixes = node, why, mixes


def rows(dim: int, ids: Optional[Tensor]) -> Info:
    """:class:`Rows` on ``dim`` with ``ids``; :class:`One` where every row is of one sample."""
    if ids is not None and ids.numel() and bool((ids == ids[0]).all()):
        return One(int(ids[0]))
    return Rows(dim, ids)


def apply(name: str, node, ins: list, outs: list) -> List[Info]:
    """What the outputs of ``node`` (named ``name``) are, given its inputs ``ins``
    (``[(info, shape)]``, by edge; ``(None, None)`` for one without gradient) and its outputs'
    shapes ``outs``.

    Raises:
        Unproven: the node mixes the samples, or no rule proves it keeps them apart."""
    # (a custom autograd.Function's node is a Python class named after it: never a torch op's
    # rule, whatever its name)
    rule = None if isinstance(node, BackwardCFunction) else _RULES.get(name.rstrip("0123456789"))
    if rule is None:
        shape = next(s for i, s in ins if i is not None)
        _fail(name, f"an op no rule proves keeps the samples apart, on a tensor of shape "
                    f"{tuple(shape or ())} that depends on the model's outputs", False)
    return rule(node, name, ins, outs)


def averaged(name: str, node, ins: list) -> Optional[Tensor]:
    """The sample of each row a *mean* over the batch's rows averages (``mean`` over the rows'
    dim or every dim, a loss function's ``reduction="mean"``), where its input's rows and their
    samples are known (:class:`Rows` with ``ids``); else ``None``. A mean is each sample's own
    share (``1/B`` of its terms) only where it counts every sample's rows equally often: over
    a slice of the batch (``F.cross_entropy(z[:k], y[:k])``) it is ``1/k``."""
    carried = _carried(ins)
    if not carried or not isinstance(carried[0][0], Rows) or carried[0][0].ids is None:
        return None
    (info, shape), base = carried[0], name.rstrip("0123456789")
    if base == "MeanBackward":
        dims = _dims(node, len(shape))
        return info.ids if dims is None or info.dim in dims else None
    if _RULES.get(base) in _LOSSES and saved(node, "reduction", None) == 1:
        return info.ids
    return None


# ---------------------------------------------------------------------------------- helpers
def _fail(name: str, why: str, mixes: bool = True):
    raise Unproven(name, why, mixes)


def _signed(v):
    return v - 2 ** 64 if isinstance(v, int) and v >= 2 ** 63 else v


def _norm(dim: int, nd: int) -> int:
    return dim + nd if dim < 0 else dim


def _carried(ins: list) -> list:
    return [(i, s or []) for i, s in ins if i is not None]


def _first(ins: list):
    return _carried(ins)[0]


def _dims(node, nd: int) -> Optional[List[int]]:
    # A reduction's dims (None: every dim), normalised.
    dims = saved(node, "dim", None)
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        return None
    dims = [dims] if isinstance(dims, int) else dims
    return [_norm(int(d), max(nd, 1)) for d in dims]


def _drop(info: Rows, dims: List[int]) -> Rows:
    return Rows(info.dim - sum(d < info.dim for d in dims), info.ids)


def _same(infos: List[Rows]) -> Optional[bool]:
    # Whether rows line up (one dim, the same sample in each position); None: not known.
    if len({r.dim for r in infos}) > 1:
        return False
    if any(r.ids is None for r in infos):
        return None
    first = infos[0].ids
    return all(r.ids.shape == first.shape and bool(torch.equal(r.ids, first)) for r in infos)


# ---------------------------------------------------------------------------------- pointwise
_ADDS = ("Add", "Sub", "Rsub", "Where", "MaskedFill")


def _pointwise(node, name, ins, outs, linear: bool = False) -> List[Info]:
    """Operands lined up after broadcasting; ``linear``: linear in its one operand that depends
    on the outputs (a product with a constant, a cast), or in each (``+``, ``-``, ``where``)."""
    out = outs[0]
    kinds = []
    for info, shape in _carried(ins):
        if isinstance(info, Rows):
            at = info.dim + len(out) - len(shape)
            if shape[info.dim] != out[at]:
                _fail(name, f"the batch dim of a {tuple(shape)} operand is broadcast to "
                            f"{tuple(out)}")
            info = Rows(at, info.ids)
        kinds.append(info)
    if len(kinds) == 1:
        if kinds[0] == LINEAR and not linear:
            _fail(name, "a non-linear function of a sum over the samples (a reduction over the "
                        "batch dim): the loss does not split into per-sample terms")
        return [kinds[0]] * len(outs)
    if all(k == LINEAR or isinstance(k, One) for k in kinds):
        known = {k.sample for k in kinds if isinstance(k, One)}
        if len(known) == 1 and None not in known and LINEAR not in kinds:
            return [kinds[0]] * len(outs)  # (every operand of the same sample)
        if linear and name.startswith(_ADDS):
            return [LINEAR] * len(outs)
        _fail(name, "a product (or other non-linear function) of terms of different samples, or "
                    "of a sum over the samples", LINEAR in kinds or None not in known)
    found = [k for k in kinds if isinstance(k, Rows)]
    if len(found) == len(kinds):
        same = _same(found)
        if same:
            return [found[0]] * len(outs)
        if same is False:
            _fail(name, f"its operands carry rows of different samples in the same places of "
                        f"its {tuple(out)} output: it pairs them")
    elif found and any(k == LINEAR or isinstance(k, One) for k in kinds):
        _fail(name, "a sum over the samples, or one sample's value, meets the batch's rows: "
                    "each sample's term then depends on the others")
    _fail(name, "it combines tensors whose samples are not known to line up (the batch "
                "reordered or indexed): it may pair rows of different samples", False)


def _mul_div(node, name, ins, outs) -> List[Info]:
    carrying = [k for k, (info, _) in enumerate(ins) if info is not None]
    linear = len(carrying) == 1 and not (name.startswith("Div") and carrying == [1])
    return _pointwise(node, name, ins, outs, linear=linear)


def _linear(node, name, ins, outs):
    return _pointwise(node, name, ins, outs, linear=True)


def _nonlinear(node, name, ins, outs):
    return _pointwise(node, name, ins, outs, linear=False)


# ---------------------------------------------------------------------------------- reductions
def _reduction(linear: bool):
    def rule(node, name, ins, outs):
        info, shape = _first(ins)
        if isinstance(info, One):
            return [info] * len(outs)
        if not isinstance(info, Rows):
            if linear:
                return [LINEAR] * len(outs)
            _fail(name, "a non-linear reduction of a sum over the samples or of elements of "
                        "samples not known", info == LINEAR)
        dims = _dims(node, len(shape))
        if dims is None or info.dim in dims:
            if linear:
                return [LINEAR] * len(outs)
            _fail(name, f"a non-linear reduction over the batch dim ({info.dim} of "
                        f"{tuple(shape)}): the samples' terms do not add up",
                  info.ids is not None)
        keep = bool(saved(node, "keepdim"))
        return [info if keep else _drop(info, dims)] * len(outs)
    return rule


def _along(node, name, ins, outs):
    # an op along one dim that keeps the shape (softmax, cumsum, sort, flip ...)
    info, shape = _first(ins)
    if isinstance(info, One):
        return [info] * len(outs)
    if not isinstance(info, Rows):
        _fail(name, "an op along a dim of a sum over the samples, or of elements of samples "
                    "not known", info == LINEAR)
    dims = saved(node, "dim", saved(node, "dims", None))
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    if not dims or any(_norm(int(d), len(shape)) == info.dim for d in dims):
        _fail(name, f"an op along the batch dim ({info.dim} of {tuple(shape)}): each sample's "
                    f"value depends on the others", info.ids is not None and bool(dims))
    return [info] * len(outs)


# ---------------------------------------------------------------------------------- moves
def _view(node, name, ins, outs):
    info, shape = _first(ins)
    if not isinstance(info, Rows):
        return [info] * len(outs)
    out, ids = outs[0], info.ids
    if len(out) > len(shape) and out[len(out) - len(shape):] == shape:  # (expand, unsqueeze(0))
        return [Rows(info.dim + len(out) - len(shape), ids)] * len(outs)
    before, size = math.prod(shape[:info.dim]), shape[info.dim]
    for at in range(len(out)):
        if math.prod(out[:at]) > before:
            break
        n = out[at]
        if math.prod(out[:at]) != before or (n == 1 and size > 1):
            continue
        if math.prod(out) != math.prod(shape):  # (an expand: the batch dim kept, or broadcast)
            if n == size:
                return [Rows(at, ids)] * len(outs)
            break
        if n % size == 0:  # (merged with the dims after it: each sample's rows batch-major)
            return [rows(at, None if ids is None else ids.repeat_interleave(n // size))] * len(outs)
        if size % n == 0 and ids is not None:  # (split: whole blocks of one sample each)
            blocks = ids.view(n, size // n)
            if bool((blocks == blocks[:, :1]).all()):
                return [rows(at, blocks[:, 0].contiguous())] * len(outs)
        break
    _fail(name, f"a view of {tuple(shape)} as {tuple(out)} splits the batch dim ({info.dim}) "
                f"across samples or moves it behind another", False)


def _permute(node, name, ins, outs):
    info, shape = _first(ins)
    if not isinstance(info, Rows):
        return [info]
    nd = len(shape)
    order = list(range(nd))
    if name.startswith("TBackward"):
        order.reverse()
    elif name.startswith("Transpose"):
        a, b = _norm(saved(node, "dim0"), nd), _norm(saved(node, "dim1"), nd)
        order[a], order[b] = order[b], order[a]
    else:
        order = [_norm(int(d), nd) for d in saved(node, "dims")]
    return [Rows(order.index(info.dim), info.ids)]


def _index_dim(node, name, ins, outs):
    # select / slice / index_select / gather / split / unbind along one dim
    info, shape = _first(ins)
    if not isinstance(info, Rows):
        return [info] * len(outs)
    dim = _norm(int(saved(node, "dim")), len(shape))
    drops = name.startswith(("Select", "Unbind"))
    if dim != info.dim:
        if drops:
            return [_drop(info, [dim])] * len(outs)
        for out in outs:
            if out[info.dim] != shape[info.dim]:
                _fail(name, f"its {tuple(out)} output does not keep the batch dim of "
                            f"{tuple(shape)}", False)
        return [info] * len(outs)
    ids = info.ids
    if drops:  # (one row: one sample's)
        if ids is None:
            return [One(None)] * len(outs)
        if name.startswith("Select"):
            return [One(int(ids[int(saved(node, "index"))]))]
        return [One(int(i)) for i in ids[:len(outs)]]
    if name.startswith("Gather"):
        return [ELEMENTS] * len(outs)  # (each column picks its own rows)
    if ids is None or name.startswith("IndexSelect"):
        return [Rows(dim, None)] * len(outs)  # (whole rows, of samples not known)
    if name.startswith("Slice"):
        # (a negative start / end is kept as its unsigned 64-bit value: z[:-1]'s end 2**64 - 1)
        start, end, step = (_signed(saved(node, k)) for k in ("start", "end", "step"))
        taken = ids[slice(start, end if end is None else min(end, len(ids)), step)]
        if taken.numel() != outs[0][dim]:
            _fail(name, "its rows along the batch dim could not be followed", False)
        return [rows(dim, taken)]
    found, at = [], 0  # (split: consecutive pieces)
    for out in outs:
        found.append(rows(dim, ids[at:at + out[dim]]))
        at += out[dim]
    return found


def _elements(node, name, ins, outs):
    # advanced indexing, masked_select, take: elements each of one sample, moved
    info, _ = _first(ins)
    return [info if info == LINEAR or isinstance(info, One) else ELEMENTS] * len(outs)


def _index_add(node, name, ins, outs):
    # index_add(self, dim, index, source): rows of source added into rows of self by index
    (base, _), (source, shape) = ins[0], ins[1] if len(ins) > 1 else (None, None)
    if base is not None or not isinstance(source, Rows):
        _fail(name, "index_add onto a tensor that depends on the model's outputs, or of "
                    "elements of samples not known", False)
    dim = _norm(int(saved(node, "dim")), len(shape or []))
    if dim == source.dim:
        return [LINEAR]  # (each row a sum of rows' terms: of the same sample or not)
    if outs[0][source.dim] != shape[source.dim]:
        _fail(name, "its output does not keep the batch dim", False)
    return [source]


def _cat(node, name, ins, outs, stack: bool = False):
    out = outs[0]
    dim = _norm(int(saved(node, "dim")), len(out))
    found, along = [], []
    for info, shape in ins:
        if info is None:
            along.append(None)
            continue
        if not isinstance(info, Rows):
            _fail(name, "joins a sum over the samples, one sample's tensor or moved elements to "
                        "other tensors", info == LINEAR)
        at = info.dim + (1 if stack and dim <= info.dim else 0)
        found.append(Rows(at, info.ids))
        along.append(info.ids)
    if not stack and all(r.dim == dim for r in found):  # (joined along the batch dim)
        if any(a is None for a in along):
            _fail(name, "joins rows of samples not known, or constant rows, to the batch", False)
        return [rows(dim, torch.cat(along))]
    same = _same(found)
    if not same:
        _fail(name, "joins tensors whose rows do not line up", same is False)
    return [found[0]]


# ---------------------------------------------------------------------------------- products
#: The letters of each product's operands (edges in order) and output.
_PRODUCTS = {"Mm": ("nk", "km", "nm"), "Mv": ("nk", "k", "n"), "Dot": ("k", "k", ""),
             "Bmm": ("bnk", "bkm", "bnm"), "Addmm": ("nm", "nk", "km", "nm"),
             "Addmv": ("n", "nk", "k", "n")}


def _product(node, name, ins, outs):
    letters = _PRODUCTS[name.rstrip("0123456789")[:-len("Backward")]]
    found: Dict[str, list] = {}
    kinds = []
    for (info, shape), mine in zip(ins, letters):
        if info is None:
            continue
        kinds.append(info)
        if isinstance(info, Rows):
            if len(shape or []) != len(mine):
                _fail(name, f"a broadcast operand of shape {tuple(shape or ())} carries the "
                            f"batch", False)
            found.setdefault(mine[info.dim], []).append(info)
    if len(kinds) == 1 and (kinds[0] == LINEAR or isinstance(kinds[0], One)):
        return [kinds[0]]
    if len(kinds) != sum(len(v) for v in found.values()):
        _fail(name, "a product of a sum over the samples, one sample's tensor or moved elements "
                    "with another tensor that depends on the model's outputs",
              any(k == LINEAR for k in kinds))
    if len(found) > 1:
        _fail(name, "a product of two tensors that carry the batch in different dims: it pairs "
                    "every sample with every other (z @ z.T)")
    (letter, infos), = found.items()
    if letter not in letters[-1]:
        if len(infos) > 1:
            _fail(name, "a product that contracts the batch dims of two operands")
        return [LINEAR]  # (a weighted sum over the samples)
    if len(infos) > 1 and (letter != "b" or not _same(infos)):
        _fail(name, "a product whose two operands carry the batch in dims that do not line up",
              _same(infos) is False)
    return [Rows(letters[-1].index(letter), infos[0].ids)]


# ---------------------------------------------------------------------------------- losses
def _loss(classes: bool = False):
    """A loss function's node: elementwise over its operands (lined up), or with ``classes``
    over rows of class scores (dim 1 of ``(N, C, *d)``, dim 0 of ``(C,)``: never the batch's);
    ``reduction`` 0 (none) keeps the rows, the others sum (or average) them."""
    def rule(node, name, ins, outs):
        reduction = saved(node, "reduction", None)
        if reduction is None:
            _fail(name, "its reduction is not readable", False)
        if classes:
            info, shape = _first(ins)
            if isinstance(info, One):
                return [info] * len(outs)
            channel = 1 if len(shape) > 1 else 0
            if not isinstance(info, Rows) or info.dim == channel:
                _fail(name, f"its class dim ({channel} of {tuple(shape)}) is not per sample: "
                            f"the batch's", info == LINEAR or isinstance(info, Rows))
            if reduction != 0:
                return [LINEAR] * len(outs)
            if info.dim == 0 and outs[0] and outs[0][0] == shape[0]:
                return [info] * len(outs)
            _fail(name, "its per-row output does not keep the batch dim", False)
        first = [s for i, s in ins if s][:1]
        kept = _pointwise(node, name, ins, [list(first[0])] if first else outs)
        if reduction == 0 or isinstance(kept[0], One):
            return [kept[0]] * len(outs)
        return [LINEAR] * len(outs)
    return rule


def _ctc(node, name, ins, outs):
    info, shape = _first(ins)
    if isinstance(info, One):
        return [info] * len(outs)
    if not isinstance(info, Rows) or len(shape) != 3 or info.dim != 1:
        _fail(name, "ctc_loss's samples are dim 1 of its (T, B, C) log-probabilities, the "
                    "batch is not", False)
    return [Rows(0, info.ids)] * len(outs)


def _layer(node, name, ins, outs):
    # A layer's node after the model (layer_norm, group_norm, batch_norm, a convolution): the
    # samples on dim 0 of its input, its parameters independent of the model's outputs.
    (info, shape), rest = ins[0], ins[1:]
    shape = shape or []
    weight = rest[0][1] if rest else None
    if any(i is not None for i, _ in rest) or not (isinstance(info, One) or isinstance(
            info, Rows) and info.dim == 0):
        _fail(name, "a layer whose input does not carry the batch on dim 0, or whose "
                    "parameters depend on the model's outputs", False)
    if not isinstance(info, One):
        if name.startswith("NativeLayerNorm") and len(
                list(saved(node, "normalized_shape"))) >= len(shape):
            _fail(name, f"layer_norm over every dim of {tuple(shape)}, the batch dim too")
        if name.startswith("Convolution") and weight is not None and len(shape) != len(weight):
            _fail(name, f"an unbatched convolution: dim 0 of {tuple(shape)} is its channels")
        if name.startswith("NativeBatchNorm") and saved(node, "training", True):
            _fail(name, "batch normalisation with the batch's statistics")
    return [info] + [None] * (len(outs) - 1)


_LINEAR_OPS = ("Add", "Sub", "Neg", "Rsub", "ToCopy", "Clone", "Alias", "Conj", "MaskedFill",
               "Where")
_NONLINEAR_OPS = (
    "Exp", "Exp2", "Expm1", "Log", "Log1p", "Log2", "Log10", "Pow", "Sqrt", "Rsqrt",
    "Sigmoid", "LogSigmoid", "Tanh", "Relu", "Gelu", "Silu", "Mish", "Softplus", "Elu",
    "LeakyRelu", "Hardtanh", "Hardsigmoid", "Hardswish", "Threshold", "Abs", "Sign", "Sgn",
    "Clamp", "ClampMin", "ClampMax", "Sin", "Cos", "Tan", "Sinh", "Cosh", "Asin", "Acos",
    "Atan", "Atan2", "Erf", "Erfc", "Erfinv", "Reciprocal", "Maximum", "Minimum", "Fmax",
    "Fmin", "Xlogy", "SpecialXlog1py", "Logit", "Lgamma", "Digamma", "Floor", "Ceil", "Round",
    "Trunc", "Frac", "NanToNum", "Hypot", "Celu", "Rrelu", "Prelu", "Softshrink", "Hardshrink",
    "NativeDropout", "Sinc", "Logaddexp", "Logaddexp2", "Fmod", "Remainder",
    "PreluKernel", "RreluWithNoise", "Lerp")

_RULES: Dict[str, Callable] = {}
_RULES.update((f"{op}Backward", _linear) for op in _LINEAR_OPS)
_RULES.update((f"{op}Backward", _nonlinear) for op in _NONLINEAR_OPS)
_RULES.update({
    "MulBackward": _mul_div, "DivBackward": _mul_div,
    "SumBackward": _reduction(True), "MeanBackward": _reduction(True),
    "NansumBackward": _reduction(True), "NanmeanBackward": _reduction(True),
    "LogsumexpBackward": _reduction(False), "AmaxBackward": _reduction(False),
    "AminBackward": _reduction(False), "MaxBackward": _reduction(False),
    "MinBackward": _reduction(False), "NormBackward": _reduction(False),
    "LinalgVectorNormBackward": _reduction(False), "ProdBackward": _reduction(False),
    "StdBackward": _reduction(False), "VarBackward": _reduction(False),
    "VarMeanBackward": _reduction(False), "StdMeanBackward": _reduction(False),
    "MedianBackward": _reduction(False), "NanmedianBackward": _reduction(False),
    "KthvalueBackward": _reduction(False), "ModeBackward": _reduction(False),
    "SoftmaxBackward": _along, "LogSoftmaxBackward": _along, "CumsumBackward": _along,
    "CumprodBackward": _along, "LogcumsumexpBackward": _along, "CummaxBackward": _along,
    "CumminBackward": _along, "SortBackward": _along, "TopkBackward": _along,
    "FlipBackward": _along, "RollBackward": _along, "GluBackward": _along,
    "ViewBackward": _view, "ReshapeAliasBackward": _view, "UnsafeViewBackward": _view,
    "_UnsafeViewBackward": _view, "SqueezeBackward": _view, "UnsqueezeBackward": _view,
    "ExpandBackward": _view,
    "PermuteBackward": _permute, "TransposeBackward": _permute, "TBackward": _permute,
    "SelectBackward": _index_dim, "UnbindBackward": _index_dim,
    "SliceBackward": _index_dim, "GatherBackward": _index_dim,
    "IndexSelectBackward": _index_dim, "SplitBackward": _index_dim,
    "SplitWithSizesBackward": _index_dim,
    "IndexBackward": _elements, "MaskedSelectBackward": _elements, "TakeBackward": _elements,
    "IndexAddBackward": _index_add,
    "CatBackward": _cat, "StackBackward": lambda *a: _cat(*a, stack=True),
    "MmBackward": _product, "MvBackward": _product, "DotBackward": _product,
    "BmmBackward": _product, "AddmmBackward": _product, "AddmvBackward": _product,
    "CtcLossBackward": _ctc,
    "NativeLayerNormBackward": _layer, "ConvolutionBackward": _layer,
    "NativeGroupNormBackward": _layer, "NativeBatchNormBackward": _layer,
})
_LOSS_RULES = {
    "NllLossBackward": _loss(classes=True), "NllLoss2DBackward": _loss(classes=True),
    "MultiMarginLossBackward": _loss(classes=True),
    "MultilabelMarginLossBackward": _loss(classes=True),
    "MseLossBackward": _loss(), "L1LossBackward": _loss(), "SmoothL1LossBackward": _loss(),
    "HuberLossBackward": _loss(), "BinaryCrossEntropyBackward": _loss(),
    "BinaryCrossEntropyWithLogitsBackward": _loss(), "KlDivBackward": _loss(),
    "SoftMarginLossBackward": _loss(),
}
_RULES.update(_LOSS_RULES)
_LOSSES = frozenset(_LOSS_RULES.values())  # (averaged: a loss function's node)
