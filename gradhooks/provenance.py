"""Where a tensor came from: the batch, a shared call, or neither, decided by data flow.

Per-sample gradients need to know which tensors carry the batch. gradhooks never reads that off
a size (a ``(T, T)`` bucket matrix with ``T == B`` would look batched); it follows the data:
while a model's forward runs, a :class:`Provenance` mode (a ``TorchFunctionMode``) tags every
tensor an op computes from the model's top-level inputs as *batched*. A hooked layer whose output
is not batched is a *shared call*: the same for every sample (position ids ``(1, T)`` or
``(T,)``, relative-position buckets ``(T, T)``, a constant mask, a learned query), and its
output is tagged as a *source*; tensors computed from sources but not from the batch carry their
sources along.

Batched tensors carry their *batch dim* too: dim 0 of the top-level inputs (with
``batch_first=False``, dim 1 of those of 2 dims or more, torch's ``(T, B, ...)``), followed
through each op by :func:`batch_dim_after` (a transpose moves it, a view keeps it where the dims
before it keep their product, any other op is replayed on ``meta`` tensors whose batch dims have
a size no other dim has). So where a shared tensor meets the batch, the dim it lines up with is
known from the data flow, not read off a size: a ``(T, 1, D)`` position table added to a
``(T, B, D)`` activation with ``T == B`` is a broadcast over dim 1, never rows of dim 0. A batch
merged with the dims after it (``(B * H, T, d)``, ``(B * T, D)`` rows) is followed as the merged
dim's outer factor; where an op merges it with a dim before it, or reads it otherwise, the batch
dim is lost and the declared layout (``batch_first``) stands in.

Where a tensor ``u`` carrying sources meets the batch (an op with a batched operand), its
gradient is still the sum over the samples; the per-sample part is taken there, before the sum:

* broadcast (``u``'s dims, aligned to the batched operand's on the right, have size 1 or none
  at the batch dim): ``u`` is handed to the op expanded to the batch, ``u_b = u.expand(B, ...)``
  (same values, same result), and a hook on ``u_b`` receives ``(B, *u.shape)``: each sample's
  own cotangent of ``u``;
* rows (``u`` has the batch size on the batch dim, e.g. after an add with a ``(B, 1, 1, T)``
  mask that was built from sizes): the op is row-aligned, so sample ``n``'s cotangent of ``u`` is
  row ``n`` of its gradient, zero elsewhere.

From the cotangents of ``u`` the per-sample cotangents of each source's output follow by one
batched vector-Jacobian product through the ops between them (``torch.autograd.grad(...,
is_grads_batched=True)``), usually a few shape ops. Only ops whose operands are aligned on the
batch dim in these two ways are split (:data:`ROW_ALIGNED`: elementwise arithmetic, ``where``,
``masked_fill``, ``matmul``, ``cat`` / ``stack`` off the batch dim, ``scaled_dot_product_attention``'s
mask); a source meeting the batch in any other op (``einsum``, an op that mixes samples) is
refused at the read with the module, the op and the shapes, never guessed.

Tracking costs a Python call per torch op of the forward (about +5% on a Transformer block's
forward). The recorder runs it on the first forward of each input signature (the top-level
inputs' shapes and dtypes, train/eval mode). What it finds is kept per signature: without shared
calls, nothing more is tracked; when every shared call's output itself meets the batch only by a
broadcast that adds the batch dim as the record's layout does (position ids), or only row by row
(token types of B rows), later forwards follow that plan without tracking (the output handed
downstream as B identical samples, or recorded as an ordinary call); otherwise (T5's buckets,
permuted before they meet the batch; raw parameters) every forward is tracked.
"""
from __future__ import annotations

import math
from typing import Callable, List

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.graph import get_gradient_edge
from torch.overrides import TorchFunctionMode

__all__ = ["Provenance", "ROW_ALIGNED", "shared_layout", "as_batch", "source_cotangent",
           "batch_dim_after", "input_batch_dim"]

_TAG = "_gradhooks_provenance"  # on tensors the forward computes: (token, sources, batch dim)


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
_RECURRENT = _functions(("lstm", "gru", "rnn_tanh", "rnn_relu"), (torch._VF,))
_CELLS = _functions(("lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell"), (torch._VF,))

#: Ops whose operands line up on the batch dim by broadcasting (elementwise, batched matmul) or
#: row by row (``cat`` / ``stack`` along another dim, a recurrent cell's state): where a source
#: meets the batch in one of these, its per-sample cotangents are taken (module docstring); and
#: a recurrent layer's initial states, on their dim 1 (:meth:`Provenance._split`).
ROW_ALIGNED = (_functions(_ELEMENTWISE + _MATMUL + _JOIN, (torch, torch.Tensor))
               | {F.scaled_dot_product_attention} | _CELLS)
_JOINS = _functions(_JOIN, (torch,))
_MATMULS = _functions(_MATMUL, (torch, torch.Tensor))

# Reads of metadata, the most frequent calls: passed through untouched.
_METADATA = frozenset(
    [getattr(torch.Tensor, n) for n in ("size", "dim", "numel", "stride", "is_contiguous",
                                         "is_floating_point", "is_complex", "__len__", "data_ptr",
                                         "element_size", "storage_offset", "get_device")]
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
_TRANSPOSE = _functions(("transpose", "transpose_", "swapaxes", "swapdims"), (torch, torch.Tensor))
_PERMUTE = _functions(("permute",), (torch, torch.Tensor))
_UNSQUEEZE = _functions(("unsqueeze", "unsqueeze_"), (torch, torch.Tensor))
_REDUCE = _functions(("sum", "mean", "amax", "amin", "max", "min", "std", "var", "logsumexp",
                      "norm", "prod", "any", "all", "argmax", "argmin"), (torch, torch.Tensor))

_UNBIND = _functions(("unbind",), (torch, torch.Tensor))
# ops returning pieces along a dim: the position of their dim argument
_PIECES = {**{f: 1 for f in _UNBIND},
           **{f: 2 for f in _functions(("chunk", "split", "tensor_split"), (torch, torch.Tensor))}}
_GETITEM = torch.Tensor.__getitem__
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
    if bd is None:
        return None
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
    if func in _SAME:
        if isinstance(out, Tensor) and out.dim() >= ref.dim():
            return bd + out.dim() - ref.dim()
    elif args and args[0] is ref and isinstance(out, Tensor):
        nd = ref.dim()
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
        if func in _RESHAPE:
            return _flat_batch(ref.shape, bd, 1, out.shape)
        if func is F.linear:
            return bd if bd < nd - 1 else None
        if func in _MATMULS and nd >= 2:  # (ref on the left: its rows and batch dims stay)
            if bd == nd - 1:
                return None  # (contracted)
            other = args[1] if len(args) > 1 else kwargs.get("other")
            if bd == nd - 2:
                return out.dim() - (2 if isinstance(other, Tensor) and other.dim() >= 2 else 1)
            return bd + out.dim() - nd
        if func is _GETITEM:
            got = _index_dim(nd, bd, args[1])
            if got is not False:
                return got
        if func in _SPATIAL:  # (convolutions and pools: the batch on dim 0 of a batched input)
            return 0 if bd == 0 and out.dim() == nd and nd == _SPATIAL[func] + 2 else None
        if func is F.pad:
            pad = args[1] if len(args) > 1 else kwargs["pad"]
            return bd if bd < nd - len(pad) // 2 or not any(pad[2 * (nd - 1 - bd):][:2]) else None
        if func is F.embedding:  # (indices (*), output (*, D))
            return bd
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
    if func in _PIECES and args and args[0] is ref and isinstance(out, (tuple, list)):
        nd = ref.dim()
        d = kwargs.get("dim", args[_PIECES[func]] if len(args) > _PIECES[func] else 0) % nd
        one = None if d == bd else bd - (d < bd and func in _UNBIND)
        return [one] * len(out)
    if func in _JOINS and isinstance(out, Tensor):  # (its other operands may be made from sizes)
        d = _args(args, kwargs, (("dim", 1),))[0] if len(args) > 1 or "dim" in kwargs else 0
        if out.dim() == ref.dim():  # cat
            return bd if d % out.dim() != bd else None
        return bd + (d % out.dim() <= bd)  # stack
    if batched is None or not (isinstance(out, Tensor) or isinstance(out, (tuple, list)) and all(
            isinstance(o, Tensor) for o in out)):
        return None
    return _on_meta(func, args, kwargs, batched, out)


def _index_dim(nd: int, bd: int, index):
    # The batch dim after basic indexing x[index] (ints, slices, None, ...): None if an int or a
    # partial slice takes the batch dim; False for advanced indexing (left to the meta replay).
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
    if func in _RECURRENT:  # (a replay on meta steps through time in Python: seconds)
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


def _recurrent_dims(func, args, dims, out):
    # _VF.lstm(input, hx, weights, bias, layers, dropout, train, bidirectional, batch_first):
    # the output keeps the input's layout, the states are (layers * directions, B, H)
    x = args[0]
    if not isinstance(args[1], (tuple, list)) or len(args) < 9 or x.dim() != 3:
        return None  # (a PackedSequence's data)
    bd = dims.get(id(x))
    if bd != (0 if args[8] else 1):  # (a merged batch is not an int: None)
        return None
    return [bd] + [1] * (len(out) - 1)


def _replay(func, args, kwargs, dims, out):
    # (far above every size, so that no dim the op makes from the others meets it)
    unique = 10007 + 3 * max((n for t in _tensors(args, kwargs) for n in t.shape), default=0)

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


def input_batch_dim(t: Tensor, batch_dim: int) -> int:
    """The batch dim of a top-level input under the declared layout: dim 0, or with
    ``batch_dim == 1`` (``batch_first=False``) dim 1 of one of 2 dims or more (torch's
    ``(T, B, ...)``)."""
    return 0 if batch_dim == 0 or t.dim() < 2 else 1


def shared_layout(x: Tensor, output: Tensor, dim: int = 0) -> str:
    """How a shared call's input ``x`` and output become a batch of ``B`` identical samples with
    the samples on dim ``dim`` (``0``, or ``1`` for a layer that reads ``(T, B, ...)`` with
    ``batch_first=False``): ``"expand"`` when both have size 1 there (it becomes the batch dim:
    ``(1, T) -> (B, T)``), else ``"prepend"`` (a new batch dim: ``(T, T) -> (B, T, T)``); for
    ``dim == 1`` the same with a ``1`` suffix (``(T,) -> (T, B)``, ``(T, 1, D) -> (T, B, D)``)."""
    size1 = all(t.dim() > dim and t.shape[dim] == 1 for t in (x, output))
    return ("expand" if size1 else "prepend") + ("1" if dim else "")


def _layout_dim(how: str) -> int:
    return 1 if how.endswith("1") else 0


def as_batch(t: Tensor, b: int, how: str) -> Tensor:
    """``t`` as ``b`` identical samples in the layout ``how`` (:func:`shared_layout`): a view."""
    d = _layout_dim(how)
    if how.startswith("expand"):
        shape = list(t.shape)
        shape[d] = b
        return t.expand(shape)
    shape = list(t.shape)
    shape.insert(d, b)
    return t.unsqueeze(d).expand(shape)


def source_cotangent(cot: Tensor, how: str) -> Tensor:
    """Per-sample cotangents ``(B, *output.shape)`` of a shared call's output in the layout of
    its input (:func:`shared_layout`): the size-1 dim dropped for ``"expand"``, the samples
    moved to dim 1 for the ``"...1"`` layouts."""
    d = _layout_dim(how)
    if how.startswith("expand"):
        cot = cot.squeeze(d + 1)
    return cot.movedim(0, d) if d else cot


class Provenance(TorchFunctionMode):
    """Tags the tensors of one forward by where they came from (module docstring).

    Args:
        batch_size: ``B``: the first top-level input's size on the batch dim, until the recorder
            sets it from the first hooked call that computes from the batch.
        batch_dim: ``0`` (``batch_first``) or ``1`` (``batch_first=False``: the batch is dim 1
            of a meeting's batched operand of 3 or more dims, dim 0 of one of 1 or 2 dims,
            torch's sequence layout as the Linear rule reads it).
        inputs: the top-level input tensors that carry the batch.
        meet: ``meet(edge, sources, how, shape, grad, dim)``, called in the backward pass with
            the gradient ``grad`` of a source-carrying tensor ``u`` (autograd edge ``edge``,
            shape ``shape``, carrying ``sources``: ``((record, edge of its output, its shape),
            ...)``) where it met the batch: ``u_b``'s shape, the batch dim ``dim`` of size
            ``B``, for ``how == "broadcast"``; ``u``'s own shape for ``"rows"`` and ``"direct"``
            (``u`` is the shared call's output itself), its ``B`` rows on its dim ``dim`` lined
            up with the batch's.
        noted: ``noted(sources, how, u_b, direct, dim)``, called in the forward for each such
            meeting with the operand handed to the op (``direct``: when the operand is the
            shared call's output itself, the number of leading dims the op's broadcast adds to
            it, else ``None``), and as ``noted(sources, "derived", None, None, None)`` for an op
            that computes from sources before they meet the batch.
        refuse: ``refuse(sources, message)``: sources met the batch in an op that cannot be
            split per sample.
        params: ``{id(param): (layer, name)}`` of raw parameters (owned by modules without a
            rule): each is a source of its own, recorded at its first use in the forward by
            ``param_source(param, info)``, which returns the record; its per-sample gradient is
            its cotangent where it meets the batch (``x * gamma``, ``x + pos_embed``, ``cat`` of
            an expanded class token), at the cost of those ops. And ``(layers, None)`` for the
            parameters of hooked layers (``layers``: those that own it): one read in an op while
            none of its layers' forwards has run (:attr:`entered`) is read functionally by
            another module (``F.linear(x, self.qkv.weight)`` in a parent): ``param_source(param,
            (layers, None))`` is told.

    Attributes:
        shared: whether a shared call happened (the signature needs tracking on every forward).
    """

    def __init__(self, batch_size: int, batch_dim: int, inputs: List[Tensor],
                 meet: Callable, refuse: Callable, noted: Callable, params: dict = None,
                 param_source: Callable = None):
        super().__init__()
        self.b, self.bdim = batch_size, batch_dim
        self.inputs = {id(t): input_batch_dim(t, batch_dim) for t in inputs}
        self._keep = inputs  # (the ids above stay theirs while the forward runs)
        self.token = object()
        self.meet, self.refuse, self.noted = meet, refuse, noted
        self.shared = False
        self.depth = 0  # nested calls of the model's forward
        self.params = params or {}  # id(param) -> what param_source needs to record it
        self.param_source = param_source
        self.param_sources: dict = {}  # id(param) -> its sources tuple, made at its first use
        self.entered: set = set()  # ids of the hooked layers whose forward ran in this forward

    # -------------------------------------------------------------- tags
    def batched(self, t) -> bool:
        """Whether tensor ``t`` was computed from the batch in this forward."""
        return isinstance(t, Tensor) and self._look(t)[0]

    def add_source(self, output: Tensor, record) -> None:
        """Tag ``output``, the output of a shared call recorded as ``record``, as a source (with
        the sources its input carried: a shared call on a shared tensor)."""
        self.shared = True
        own = ((record, get_gradient_edge(output), output.shape),)
        _, before, _ = self._look(output)
        setattr(output, _TAG, (self.token, own if before is None else _union(own, before), None))

    def _look(self, t: Tensor):
        # (batched, sources, batch dim) of one tensor (the batch dim: None where unknown)
        if id(t) in self.inputs:
            return True, None, self.inputs[id(t)]
        tag = getattr(t, _TAG, None)
        if tag is None or tag[0] is not self.token:
            info = self.params.get(id(t))
            if info is not None and info[1] is None:  # a hooked layer's parameter
                if not any(id(owner) in self.entered for owner in info[0]):  # read outside
                    self.param_source(t, info)
                return False, None, None
            if info is not None:  # a raw parameter: a source of its own
                src = self.param_sources.get(id(t))
                if src is None:
                    self.shared = True
                    record = self.param_source(t, self.params[id(t)])
                    src = self.param_sources[id(t)] = ((record, get_gradient_edge(t), t.shape),)
                return False, src, None
            return False, None, None
        return tag[1] is None, tag[1], tag[2]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if func in _METADATA:
            return func(*args, **kwargs)
        ref, sources, tainted = None, None, None  # ref: the batched operand of most dims
        batched = None  # [(tensor, its batch dim)]
        for group in (args, kwargs.values()):
            for a in group:
                if isinstance(a, Tensor):
                    items = (a,)
                elif type(a) in (list, tuple):
                    items = a
                else:
                    continue
                for t in items:
                    if not isinstance(t, Tensor):
                        continue
                    is_b, src, bd = self._look(t)
                    if is_b:
                        if ref is None or t.dim() > ref.dim():
                            ref, rbd = t, bd
                        batched = [(t, bd)] if batched is None else batched + [(t, bd)]
                    elif src is not None:
                        sources = src if sources is None else _union(sources, src)
                        tainted = [t] if tainted is None else tainted + [t]
        if ref is not None and tainted:
            args, kwargs = self._split(func, args, kwargs, ref, rbd, tainted, sources)
        out = func(*args, **kwargs)
        if ref is None and tainted and not any(out is t for t in tainted):
            self.noted(sources, "derived", None, None, None)  # (computed from before the meeting;
            # an op that returns its input, .to() of the same dtype, computes nothing)
        if ref is not None:
            if isinstance(out, Tensor):
                _set(out, (self.token, None, batch_dim_after(func, args, kwargs, ref, rbd,
                                                             batched, out)))
            elif type(out) in (tuple, list) or isinstance(out, tuple):
                dims = batch_dim_after(func, args, kwargs, ref, rbd, batched, out)
                for i, o in enumerate(out):
                    if isinstance(o, Tensor):
                        _set(o, (self.token, None, dims[i] if dims is not None else None))
        elif sources is not None:
            tag = (self.token, sources, None)
            if isinstance(out, Tensor):
                _set(out, tag)
            elif type(out) in (tuple, list) or isinstance(out, tuple):
                for o in out:
                    if isinstance(o, Tensor):
                        _set(o, tag)
        return out

    # -------------------------------------------------------------- where sources meet the batch
    def _split(self, func, args, kwargs, ref, bd, tainted, sources):
        # Hand the op each source-carrying operand in a form whose gradient is per sample
        # (module docstring); refuse ops that are not row-aligned. ``bd``: the batch dim of
        # ``ref``, followed from the inputs (batch_dim_after); where an op lost it, the
        # declared layout's.
        name = getattr(func, "__name__", repr(func))
        nd = ref.dim()
        if not isinstance(bd, int):  # (lost, or merged with other dims: the declared layout)
            bd = self.bdim if nd >= 3 else 0
        states = func in _RECURRENT  # (initial states (layers * directions, B, H): batch dim 1)
        if (func not in ROW_ALIGNED and not states) or nd <= bd or ref.shape[bd] != self.b:
            self.refuse(sources, f"op {name} with shapes {_shapes(args, kwargs)}")
            return args, kwargs
        if func in _JOINS:
            dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
            if dim % nd == bd:
                self.refuse(sources, f"{name} along the batch dim with shapes {_shapes(args, kwargs)}")
                return args, kwargs
        swap = {}
        for u in tainted:
            if id(u) in swap or not u.requires_grad:
                continue
            k = 0 if states else nd - u.dim()
            shape = (1,) * k + tuple(u.shape)
            ubd = 1 if states else bd  # (u's dim that lines up with the batch)
            # (matmul: only the dims before the last two broadcast; a vector operand does not)
            matrix = func in _MATMULS and (u.dim() < 2 or bd >= nd - 2)
            if (k < 0 or matrix or len(shape) <= ubd or shape[ubd] not in (1, self.b)
                    or states and (u.dim() != 3 or u is args[0])):
                self.refuse(sources, f"op {name}: an operand of shape {tuple(u.shape)} does not "
                                     f"line up with the batch of shape {tuple(ref.shape)}")
                return args, kwargs
            _, src, _ = self._look(u)
            edge = get_gradient_edge(u)
            # u is the shared call's output itself: the leading dims the op adds to it
            direct = k if (len(src) == 1 and edge.node is src[0][1].node
                           and edge.output_nr == src[0][1].output_nr) else None
            if shape[ubd] == 1:
                full = list(shape)
                full[ubd] = self.b
                u_b, how, d = u.reshape(shape).expand(full), "broadcast", ubd
            else:  # (direct: its B rows lined up with the batch's, on u's dim d)
                u_b, how, d = u.view(u.shape), "rows" if direct is None else "direct", ubd - k
            self.noted(src, how, u_b, direct, d)
            u_b.register_hook(lambda g, e=edge, s=src, h=how, shp=tuple(u.shape), d=d:
                              self.meet(e, s, h, shp, g, d))
            swap[id(u)] = u_b
        if not swap:
            return args, kwargs
        sub = lambda a: swap.get(id(a), a) if isinstance(a, Tensor) else (
            type(a)(swap.get(id(t), t) if isinstance(t, Tensor) else t for t in a)
            if type(a) in (list, tuple) else a)
        return tuple(sub(a) for a in args), {k: sub(v) for k, v in kwargs.items()}


def _set(t: Tensor, tag) -> None:
    try:
        setattr(t, _TAG, tag)
    except (AttributeError, RuntimeError):  # (a tensor type without a __dict__)
        pass


def _union(a: tuple, b: tuple) -> tuple:
    if a is b:
        return a
    seen = {id(s[0]) for s in a}
    return a + tuple(s for s in b if id(s[0]) not in seen)


def _tensors(args, kwargs):
    for group in (args, kwargs.values()):
        for a in group:
            if isinstance(a, Tensor):
                yield a
            elif type(a) in (list, tuple):
                yield from (t for t in a if isinstance(t, Tensor))


def _shapes(args, kwargs) -> str:
    return ", ".join(str(tuple(t.shape)) for t in _tensors(args, kwargs))
