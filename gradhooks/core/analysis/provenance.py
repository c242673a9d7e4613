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
``batch_first=False``, dim 1 of those of 2 dims or more; a recurrent kernel's own), followed
through each op by :func:`~gradhooks.core.analysis.batch_dims.batch_dim_after` (a transpose moves it, a view
keeps it where the dims before it keep their product, any other op is replayed on ``meta``
tensors whose batch dims have a size no other dim has). So where a shared tensor meets the
batch, the dim it lines up with is known from the data flow, not read off a size: a ``(T, 1, D)``
position table added to a ``(T, B, D)`` activation with ``T == B`` is a broadcast over dim 1,
never rows of dim 0. A batch merged with the dims after it (``(B * H, T, d)``, ``(B * T, D)``
rows, Swin's ``(B * nW, N, C)`` windows) is followed as the merged dim's outer factor; rows
gathered from it by a data-dependent index (a mixture of experts' ``hidden[token_idx]``) or joined
along it (``cat`` of every layer's router logits) carry their rows' samples
(:class:`~gradhooks.core.analysis.batch_dims.Routed`); where an op merges it with a dim before it, or reads
it otherwise, the batch dim is lost and the declared layout (``batch_first``) stands in.

Where a tensor ``u`` carrying sources meets the batch (an op with a batched operand), its
gradient is still the sum over the samples; the per-sample part is taken there, before the sum:

* broadcast (``u``'s dims, aligned to the batched operand's on the right, have size 1 or none
  at the batch dim): ``u`` is handed to the op expanded to the batch, ``u_b = u.expand(B, ...)``
  (same values, same result), and a hook on ``u_b`` receives ``(B, *u.shape)``: each sample's
  own cotangent of ``u``;
* rows (``u`` has the batch size on the batch dim, e.g. after an add with a ``(B, 1, 1, T)``
  mask that was built from sizes): the op is row-aligned, so sample ``n``'s cotangent of ``u`` is
  row ``n`` of its gradient, zero elsewhere.

On a batch merged with the dims after it (``B * inner`` rows), a broadcast ``u`` gets each
sample's cotangent summed over its ``inner`` rows, and a row-aligned one its own ``inner`` rows.
``F.linear(x, W)`` with ``x`` merged or routed rows and ``W`` a source (a mixture of experts'
router weight, an expert's slice ``w[e]`` of a 3-D parameter: a parameter of a module without a
rule read there is made a source of its own, :func:`~gradhooks.core.analysis.rows.own_weights`) is split
by the linear form instead: sample ``n``'s cotangent of ``W`` is ``sum_r g[r] x[r]^T`` over its
own rows (:mod:`gradhooks.core.analysis.rows`). A module without a rule whose output comes only from its
own parameters (called on no tensor: BEiT's relative position bias; a learned query) makes its
parameters sources the same way (:meth:`Provenance.param_sources_of`).

From the cotangents of ``u`` the per-sample cotangents of each source's output follow by one
batched vector-Jacobian product through the ops between them (``torch.autograd.grad(...,
is_grads_batched=True)``), usually a few shape ops. Only ops whose operands are aligned on the
batch dim in these two ways are split (:data:`ROW_ALIGNED`: elementwise arithmetic, ``where``,
``masked_fill``, ``matmul``, ``cat`` / ``stack`` off the batch dim, ``scaled_dot_product_attention``'s
mask); a source meeting the batch in any other op (``einsum``, an op that mixes samples) is
refused at the read with the module, the op and the shapes, never guessed.

The same data flow shows ops that mix the samples through the parameters (an op along the batch
dim: a softmax or sort over it, batch statistics; or a reduction over it whose result meets the
batch again: ``h - h.mean(0)``): :mod:`gradhooks.core.analysis.mixing` says which, and the batch's reads
refuse them (:attr:`Provenance.mixing`, kept per signature by the placement). Every other op
on tensors that carry the batch and a gradient must be proven to keep the samples apart by the
whitelist of :mod:`gradhooks.core.analysis.separation`; the rest are noted (:attr:`Provenance.unproven`)
and refused unless the forward-alone check (:mod:`gradhooks.core.analysis.alone`) passes.

Tracking costs a Python call per torch op (about +5% on a Transformer block's forward), on each
input signature's first forward, after a forward of a new structure, every 100th (``SumCheck``).
Without shared calls nothing more is tracked; when every shared call's output meets the batch
only by a broadcast that adds the batch dim as the record's layout does (position ids), or only
row by row (token types of B rows), later forwards follow that plan untracked (the output handed
down as B identical samples, or recorded as an ordinary call); otherwise (T5's buckets, permuted
before they meet the batch; raw parameters) every forward is tracked.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, List

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.graph import get_gradient_edge
from torch.overrides import TorchFunctionMode

from ...base.torch_internals import canonical_kwargs, own
from .batch_dims import (
    JOINS,
    MATMULS,
    METADATA,
    RECURRENT,
    ROW_ALIGNED,
    Routed,
    batch_dim_after,
    is_grouped_mm,
    operands,
    recurrent_layout,
)
from .einsum import einsum_shared
from .indexing import IN_ORDER_NOTES, assigned
from .mixing import (
    CONTRACTIONS,
    MIXES,
    MIXING_OPS,
    STAT,
    called_by_gradhooks,
    contraction_mixes,
    mixing_op,
    rows_of_others,
    upstream_of,
    user_line,
)
from .rows import ADDS, gathered_meeting, grouped_meeting, linear_meeting, own_weights
from .separation import custom_function, output_node, separation_verdict
from .token_means import TOKEN_OPS, ForwardLosses

__all__ = ["Provenance", "ROW_ALIGNED", "shared_layout", "as_batch", "source_cotangent",
           "batch_dim_after", "input_batch_dim"]

_GETITEM = torch.Tensor.__getitem__
_SETITEM = torch.Tensor.__setitem__
_TAG = "_gradhooks_provenance"  # on tensors the forward computes: (token, sources, batch dim)
_STAT = "_gradhooks_statistic"  # on statistics of the batch: (token, (kind, what))


def input_batch_dim(t: Tensor, batch_dim: int) -> int:
    """The batch dim of a top-level input under the declared layout: dim 0, or with ``batch_dim
    == 1`` (``batch_first=False``) dim 1 of one of 2 dims or more (torch's ``(T, B, ...)``)."""
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
    d, shape = _layout_dim(how), list(t.shape)
    if how.startswith("expand"):
        shape[d] = b
        return own(t.expand(shape), t)
    shape.insert(d, b)
    return own(t.unsqueeze(d).expand(shape), t)


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
            parameters of hooked layers (``layers``: those that own it): one read while none of
            its layers' forwards runs (:attr:`entered`) is read by another module (``F.linear(x,
            self.qkv.weight)`` in a parent; ProphetNet's ``self.pos._forward(ids)`` after
            ``self.pos(...)``): where shared calls made it a source, it is that source (met where
            it meets the batch), else ``param_source(param, (layers, None))`` is told.

    Attributes:
        batch_size: ``B`` as the forward knows it so far (the placement sets it from each
            batched hooked call): the size shared calls are expanded to and meetings line up with.
        batch_dim: as given.
        shared: whether a shared call happened (the signature needs tracking on every forward).
        depth: nested calls of the model's forward (a model that calls itself); the tracking
            ends when the outermost returns.
        entered: ``Counter`` of ``id(layer)``: the hooked layers' forwards running now.
        param_sources: ``{id(param): sources}`` of the raw parameters used so far (and of the
            parameters of shared calls of modules without a rule, :meth:`param_sources_of`).
        own_params: ids of the records of the latter (no replay covers them: a refused meeting
            stays refused).
        merged: ``[(layer, names)]``: calls of modules without a rule on a batch merged with the
            dims after it, not recorded (:meth:`gradhooks.core.recorder.placement.Placement.merged_call`).
        signature: the input signature this forward tracks (set by the placement).
        shared_calls: ``[(record, (id(layer), ordinal), layout)]`` of this forward's shared calls,
            the material of its signature's plan.
        fallback_calls: this forward's records of modules on the fallback (those that may own
            raw parameters, whose replay drops the parameters provenance covered).
        plain: ids of shared calls' records whose outputs meet the batch in a way no plan can
            replay (derived first, refused, or met in two ways): the signature is tracked on
            every forward.
        kinds: ``{id(record): "broadcast" | "direct"}``: how each shared call's output met the
            batch.
        swapped: a position-wise layer's records had their batch dim moved (``T == B`` or
            ``(B * T, D)`` rows, :meth:`gradhooks.core.recorder.placement.Placement.place`): tracked on every
            forward.
        mixing: ``[(kind, what)]``: the ops of this forward that mix the samples through the
            parameters (:mod:`gradhooks.core.analysis.mixing`: an op along the batch dim, batch
            statistics, or a statistic of the batch that met the batch again), ``what`` naming
            the op, the module upstream and the line of the forward.
        stats: how many statistics of the batch (reductions over it) this forward made.
        unproven: ``{(op, line): (op, what, node)}``: the ops of this forward on a tensor that
            carries the batch and a parameter's gradient that no rule of :mod:`.separation` proves
            keep the samples apart, ``what`` naming the op, the reason, the module upstream and
            the line of the forward, ``node`` its output's autograd node (refused unless the
            forward-alone check passes: :mod:`gradhooks.core.analysis.alone`).
        token_losses: the token-level losses over the batch of this forward
            (:class:`~gradhooks.core.analysis.token_means.ForwardLosses`).
    """

    def __init__(self, batch_size: int, batch_dim: int, inputs: List[Tensor],
                 meet: Callable, refuse: Callable, noted: Callable, params: dict = None,
                 param_source: Callable = None):
        super().__init__()
        self.batch_size, self.batch_dim = batch_size, batch_dim
        self.inputs = {id(t): input_batch_dim(t, batch_dim) for t in inputs}
        self._keep = inputs  # (the ids above stay theirs while the forward runs)
        self.token, self.meet, self.refuse, self.noted = object(), meet, refuse, noted
        self.shared, self.depth = False, 0  # (depth: nested calls of the model's forward)
        self.params, self.param_source = params or {}, param_source  # (id(param) -> its info)
        self.param_sources: dict = {}  # id(param) -> its sources tuple, made at its first use
        self.own_params: set = set()  # ids of the records of shared calls' own parameters
        self.merged: list = []  # [(layer, names)]: calls of modules without a rule on merged rows
        self.met_by_rows: set = set()  # ids of parameters met at a linear / grouped product
        self.entered: Counter = Counter()  # {id(layer): its forwards running now}
        self.signature, self.swapped = (), False
        self.shared_calls, self.fallback_calls, self.plain, self.kinds = [], [], set(), {}
        self.mixing: list = []  # [(kind, what)]: ops of this forward that mix the samples
        IN_ORDER_NOTES.set(self.mixing)  # (and notes of this batch's values: indexing.IN_ORDER)
        self.stats = 0  # statistics of the batch made so far (gradhooks.core.analysis.mixing)
        self.unproven: dict = {}  # (op, line) -> (op, what, node): ops no rule proves keep apart
        self.token_losses = ForwardLosses()

    # -------------------------------------------------------------- tags
    def batched(self, t) -> bool:
        """Whether tensor ``t`` was computed from the batch in this forward."""
        return isinstance(t, Tensor) and self.look(t)[0]

    def add_source(self, output: Tensor, record) -> None:
        """Tag ``output``, the output of a shared call recorded as ``record``, as a source (with
        the sources its input carried: a shared call on a shared tensor)."""
        self.shared = True
        own = ((record, get_gradient_edge(output), output.shape),)
        _, before, _ = self.look(output)
        setattr(output, _TAG, (self.token, own if before is None else _union(own, before), None))

    def param_sources_of(self, params) -> tuple:
        """The sources of ``params`` (``[((layer, name), param)]``: a module's own parameters):
        each parameter a source of its own, recorded by ``param_source`` at its first use in this
        forward (as a raw parameter is), so that several calls of one module share them."""
        sources = ()
        for info, param in params:
            src = self.param_sources.get(id(param))
            if src is None:
                self.shared = True
                record = self.param_source(param, info)
                src = self.param_sources[id(param)] = ((record, get_gradient_edge(param),
                                                        param.shape),)
                self.own_params.add(id(record))
            sources = _union(sources, src)
        return sources

    def retag(self, dims) -> None:
        """Outputs of a hooked layer whose batch dim its rule knows (``[(tensor, dim)]``, ``dim`` an
        int or ``(samples, B)`` of rows on dim 0: a recurrent layer's states, packed rows)."""
        for t, d in ((t, d) for t, d in dims if self.batched(t)):
            _set(t, (self.token, None, d if isinstance(d, int) else Routed(d[0], d[0], d[1])))

    def add_sources(self, outputs, sources: tuple) -> None:
        """Tag ``outputs`` (tensors a shared call computed from its module's own parameters)
        with ``sources`` (:meth:`param_sources_of`), and with the sources they carried."""
        for t in outputs:
            _, before, _ = self.look(t)
            _set(t, (self.token, sources if before is None else _union(sources, before), None))

    def look(self, t: Tensor):
        """``(batched, sources, batch dim)`` of tensor ``t`` in this forward: whether the batch
        reached it, the sources it carries (``None``: none), and its batch dim (an int, a
        ``(dim, inner)`` pair for a batch merged with the dims after it, ``None`` where
        unknown). A raw parameter's first read here records it (``param_source``)."""
        if id(t) in self.inputs:
            return True, None, self.inputs[id(t)]
        tag = getattr(t, _TAG, None)
        if tag is None or tag[0] is not self.token:
            info, src = self.params.get(id(t)), self.param_sources.get(id(t))
            if info is not None and info[1] is None:  # a hooked layer's parameter
                outside = not any(self.entered[id(o)] for o in info[0])
                if outside and src is None:
                    self.param_source(t, info)  # (its layer demoted to its parent, or refused)
                return False, src if outside else None, None  # (src: its shared calls' own)
            if info is not None:  # a raw parameter: a source of its own
                if src is None:
                    self.shared = True
                    record = self.param_source(t, self.params[id(t)])
                    src = self.param_sources[id(t)] = ((record, get_gradient_edge(t), t.shape),)
                return False, src, None
            return False, None, None
        return tag[1] is None, tag[1], tag[2]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = canonical_kwargs(func, kwargs)  # (x.mean(axis=2) reads as dim=2)
        if func is _SETITEM and writes_batch(self, args):  # (x[i] = v, in place: judged as
            self.__torch_function__(assigned, types, args, kwargs)  # assigned(), returning x)
            return None
        if func in METADATA:
            return func(*args, **kwargs)
        if func in RECURRENT:  # (top-level inputs a recurrent kernel reads: its layout counts)
            self.inputs.update((id(t), d) for t, d in recurrent_layout(args) if id(t) in self.inputs)
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
                    is_b, src, bd = self.look(t)
                    if is_b and (bd is None or isinstance(bd, Routed)) and func is _GETITEM and (
                            a is not args[0] and not (t.is_floating_point() or t.is_complex())):
                        is_b = False  # (an index computed from the batch with no batch dim, or
                        # sorted routed rows: the experts a batch's tokens chose; it picks rows)
                    if is_b:
                        if ref is None or t.dim() > ref.dim():
                            ref, rbd = t, bd
                        batched = [(t, bd)] if batched is None else batched + [(t, bd)]
                    elif src is not None:
                        sources = src if sources is None else _union(sources, src)
                        tainted = [t] if tainted is None else tainted + [t]
        linear = None
        if ref is not None and (isinstance(rbd, (tuple, Routed)) and (func is F.linear or is_grouped_mm(
                func)) or tainted and func is F.linear and type(rbd) is int):  # (int: LoKr's kron)
            if not tainted:  # (a weight of a module without a rule, on merged / routed rows)
                tainted, sources = own_weights(self, args, kwargs)
            if tainted:
                linear = (linear_meeting if func is F.linear else grouped_meeting)(
                    self, args, kwargs, ref, rbd, tainted)
        elif ref is not None and not tainted and func in ADDS and isinstance(rbd, Routed):
            linear = gathered_meeting(self, func, args, kwargs, ref, rbd)
        if ref is not None and tainted and linear is None:
            args, kwargs = self._split(func, args, kwargs, ref, rbd, tainted, sources)
        out = func(*args, **kwargs)
        if linear is not None:
            linear(out)
        if ref is None and tainted and not any(out is t for t in tainted):
            self.noted(sources, "derived", None, None, None)  # (computed from before the meeting;
            # an op that returns its input, .to() of the same dtype, computes nothing)
        if ref is not None:
            if func in MIXING_OPS:
                self._mixing(func, args, kwargs, ref, rbd, out)
            elif func in CONTRACTIONS and batched is not None and len(batched) == 2:
                self._mixing(func, args, kwargs, ref, rbd, out, contraction_mixes(batched))
            elif func in ROW_ALIGNED and batched is not None and len(batched) > 1:
                self._mixing(func, args, kwargs, ref, rbd, out, rows_of_others(batched))
            if self.stats:
                self._statistics(func, batched, out)
            if func in TOKEN_OPS:
                self.token_losses.observe(func, args, kwargs, out, self.batch_size,
                                          lambda t: self.look(t)[2])
            single = isinstance(out, Tensor)
            if single or type(out) in (tuple, list) or isinstance(out, tuple):
                dims = batch_dim_after(func, args, kwargs, ref, rbd, batched, out)
                if single:
                    _set(out, (self.token, None, dims))
                else:
                    for i, o in enumerate(out):
                        if isinstance(o, Tensor):
                            _set(o, (self.token, None, dims[i] if dims is not None else None))
                self._separation(func, args, kwargs, ref, rbd, batched, out, dims)
        elif sources is not None:
            tag = (self.token, sources, None)
            if isinstance(out, Tensor):
                _set(out, tag)
            elif type(out) in (tuple, list) or isinstance(out, tuple):
                for o in out:
                    if isinstance(o, Tensor):
                        _set(o, tag)
        return out

    # -------------------------------------------------------------- ops that mix the samples
    def _separation(self, func, args, kwargs, ref, bd, batched, out, dims) -> None:
        # The whitelist (gradhooks.core.analysis.separation): an op on operands that carry the batch and
        # a gradient, with an output that carries a gradient, is noted as unproven unless a
        # rule of the table proves it keeps the samples apart.
        if self.batch_size <= 1:
            return  # (one sample, or none: nothing to mix; a signature's verdict is per B)
        carrying = [(t, d) for t, d in batched if t.requires_grad]
        if not carrying or not any(isinstance(o, Tensor) and o.requires_grad for o in (
                (out,) if isinstance(out, Tensor) else out)):
            return
        why = None
        for t, _ in carrying:
            custom = custom_function(t)
            if custom is not None:
                func, why = custom, (f"the output of the custom autograd.Function {custom} "
                                     f"(its forward ran without gradient: its ops were not "
                                     f"judged)")
                break
        if why is None:
            why = separation_verdict(func, args, kwargs, carrying, ref, bd, out, dims, batched)
            if why is None:
                return
        if called_by_gradhooks(__file__):
            return  # (the hooks' own ops: a shared call's input made a batch)
        name = func if isinstance(func, str) else getattr(func, "__name__", repr(func))
        line = user_line()
        if (name, line) in self.unproven:
            return
        upstream = next((u for u in (upstream_of(t, self.params) for t, _ in carrying)
                         if u is not None), None)
        if upstream is None:
            return  # (computed from the inputs alone: each sample's loss is still its own)
        self.unproven[(name, line)] = (name, f"op {name}: {why}; on a tensor computed from "
                                             f"{upstream}{line}", output_node(out))

    def _mixing(self, func, args, kwargs, ref, bd, out, found=False) -> None:
        # An op on the batch that mixes the samples (gradhooks.core.analysis.mixing; ``found``: what a
        # caller found already): noted, or its output marked as a statistic of the batch, where
        # it requires grad through a recorded parameter.
        found = mixing_op(func, args, kwargs, ref, bd) if found is False else found
        if found is None:
            return
        outs = [o for o in ((out,) if isinstance(out, Tensor) else out)
                if isinstance(o, Tensor) and o.requires_grad]
        if not outs:
            return  # (detached, under no_grad, or integer: no gradient flows back)
        upstream = upstream_of(ref, self.params)
        if upstream is None:
            return  # (computed from the inputs alone: each sample's loss is still its own)
        kind, what = found
        what = f"{what} of a tensor computed from {upstream}{user_line()}"
        if kind != STAT:
            self.mixing.append((kind, what))
            return
        self.stats += 1
        for o in outs:
            _set(o, (self.token, (MIXES, what)), _STAT)

    def _statistics(self, func, batched, out) -> None:
        # A statistic of the batch in this op: one that meets a tensor carrying the batch is
        # broadcast back to the samples (mixing); ops on statistics alone give statistics.
        # (A constant computed from the batch whose batch dim was lost -- a mixture of experts'
        # fraction of tokens per expert, a mean over one_hot(top-k) -- counts as carrying it.)
        stat, carried = None, False
        for t, bd in batched:
            if bd is None:
                tag = getattr(t, _STAT, None)
                if tag is not None and tag[0] is self.token:
                    stat = tag[1] if stat is None else stat
                elif t.dim() and not t.requires_grad:
                    carried = True
            else:
                carried = True
        if stat is None:
            return
        if carried:
            name = getattr(func, "__name__", repr(func))
            self.mixing.append((stat[0], f"{stat[1]}, whose result meets the batch again in "
                                         f"{name}"))
            return
        for o in ((out,) if isinstance(out, Tensor) else out if isinstance(out, (tuple, list))
                  else ()):
            if isinstance(o, Tensor) and o.requires_grad:
                _set(o, (self.token, stat), _STAT)

    # -------------------------------------------------------------- where sources meet the batch
    def _split(self, func, args, kwargs, ref, bd, tainted, sources):
        # Hand the op each source-carrying operand in a form whose gradient is per sample
        # (module docstring; an einsum's: the batch letter put in front, B copies); refuse ops
        # that are not row-aligned. ``bd``: the batch dim of ``ref``, followed from the inputs
        # (batch_dim_after); where an op lost it, the declared layout's.
        name = getattr(func, "__name__", repr(func))
        nd = ref.dim()
        inner = 1  # (a batch merged with the dims after it: B * inner rows, samples outermost)
        if isinstance(bd, tuple) and bd[0] < nd:
            bd, inner = bd
        elif not isinstance(bd, int):  # (lost: the declared layout)
            bd = self.batch_dim if nd >= 3 else 0
        states = func in RECURRENT and inner == 1  # (initial states (layers * dirs, B, H): dim 1)
        rows = self.batch_size * inner
        eq = einsum_shared(args, ref, bd, tainted) if func is torch.einsum and inner == 1 else None
        if (func not in ROW_ALIGNED and not states and eq is None) or nd <= bd or ref.shape[bd] != rows:
            self.refuse(sources, f"op {name} with shapes {_shapes(args, kwargs)}")
            return args, kwargs
        if func in JOINS:
            dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
            if dim % nd == bd:
                self.refuse(sources, f"{name} along the batch dim with shapes {_shapes(args, kwargs)}")
                return args, kwargs
        swap = {}
        for u in tainted:
            if id(u) in swap or not u.requires_grad:
                continue
            k = 1 if eq else 0 if states else nd - u.dim()
            shape = (1,) * k + tuple(u.shape)
            ubd = 0 if eq else 1 if states else bd  # (u's dim that lines up with the batch)
            # (matmul: only the dims before the last two broadcast; a vector operand does not)
            matrix = func in MATMULS and (u.dim() < 2 or bd >= nd - 2)
            if (k < 0 or matrix or len(shape) <= ubd or shape[ubd] not in (1, rows)
                    or states and (u.dim() != 3 or u is args[0])):
                self.refuse(sources, f"op {name}: an operand of shape {tuple(u.shape)} does not "
                                     f"line up with the batch of shape {tuple(ref.shape)}")
                return args, kwargs
            _, src, _ = self.look(u)
            edge = get_gradient_edge(u)
            # u is the shared call's output itself: the leading dims the op adds to it
            direct = k if (len(src) == 1 and edge.node is src[0][1].node and inner == 1
                           and edge.output_nr == src[0][1].output_nr) else None
            if shape[ubd] == 1:  # (a merged batch: each sample's part summed over its rows)
                full = list(shape)
                full[ubd] = rows
                u_b, how, d = own(u.reshape(shape).expand(full), u), "broadcast", ubd
                fold = None if inner == 1 else (ubd, self.batch_size, inner)
            else:  # (direct: its B rows lined up with the batch's, on u's dim d)
                u_b, how, d = own(u.view(u.shape), u), "rows" if direct is None else "direct", ubd - k
                fold = None
            self.noted(src, how, u_b, direct, d)
            u_b.register_hook(lambda g, e=edge, s=src, h=how, shp=tuple(u.shape),
                              d=d if inner == 1 or fold else (d, inner), f=fold:
                              self.meet(e, s, h, shp, g if f is None else
                                        g.unflatten(f[0], f[1:]).sum(f[0] + 1), d))
            swap[id(u)] = u_b
        if not swap:
            return args, kwargs
        sub = lambda a: swap.get(id(a), a) if isinstance(a, Tensor) else (
            type(a)(swap.get(id(t), t) if isinstance(t, Tensor) else t for t in a)
            if type(a) in (list, tuple) else a)
        args = tuple(sub(a) for a in args)
        return (eq, *args[1:]) if eq else args, {k: sub(v) for k, v in kwargs.items()}


def writes_batch(prov: Provenance, args: tuple) -> bool:
    """Whether ``x[index] = value`` (``args``) writes values of the batch or of sources into
    ``x``: a ``value`` that carries either (T5's ``_shift_right`` writes the batch's token ids
    into ``input_ids.new_zeros(...)``). Judged then as :func:`assigned`, whose output is ``x``,
    so that ``x`` carries what was written (before, ``x`` kept its tag: a batch's rows
    written into a fresh tensor were taken for constants)."""
    value = args[2] if len(args) > 2 else None
    if not isinstance(value, Tensor):
        return False
    batched, sources, _ = prov.look(value)
    return batched or sources is not None


def _set(t: Tensor, tag, attr: str = _TAG) -> None:
    try:
        setattr(t, attr, tag)
    except (AttributeError, RuntimeError):  # (a tensor type without a __dict__)
        pass


def _union(a: tuple, b: tuple) -> tuple:
    if a is b:
        return a
    seen = {id(s[0]) for s in a}
    return a + tuple(s for s in b if id(s[0]) not in seen)


def _shapes(args, kwargs) -> str:
    return ", ".join(str(tuple(t.shape)) for t in operands(args, kwargs))
