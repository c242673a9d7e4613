"""Batch placement: where the batch sits in each hooked call, and whether the call is shared.

The recorder (:mod:`gradhooks.core.capture`) records every call of a hooked layer; before it builds
the record it asks its :class:`Placement` one question per call (:meth:`Placement.place`): is
this call *batched* (its inputs carry the batch, in the layout its rule reads or after a
relayout), *shared* (the same for every sample: position ids, relative-position buckets, a
learned query; :mod:`gradhooks.core.provenance` found that the batch did not reach its output), or
*planned* (a shared call of an input signature whose tracked forward found its output meets the
batch only in ways a plan replays without tracking)? The answer is a :class:`Placed`.

Every hard case of per-sample recording lands here, because each is a place where sizes lie
about where the batch is and only the data flow tells:

* ``T == B``: a ``(T, B, D)`` activation inside a batch-first model (FSMT transposes), or a
  ``(T, T)`` bucket matrix, has the batch size on a dim that is not the batch's. Provenance
  follows the batch dim from the inputs; :meth:`Placement.place` moves a position-wise layer's
  records so that its rule reads the right dim, and a shared call is shared whatever its sizes.
* ``(B * T, D)`` rows (OPT flattens before its feed-forward): the batch merged with the
  positions; the records are unflattened into ``(B, T, D)``.
* learned initial states and a ``(B, ...)`` state made from the batch size: a shared call whose
  output meets the batch row by row, itself, is recorded as an ordinary call on its ``B`` rows
  (:meth:`Placement.on_noted`), any other meeting makes it ``B`` identical samples.
* DP LSTM zero states (Opacus' ``DPLSTM`` builds its initial state from sizes and runs its cells
  on fewer samples at later steps): such calls cover part of the batch, and the refusal names
  the fix (:func:`partial_batch_hint`).
* raw parameters of containers (ViT's class token, a block's layer scale) and a hooked layer's
  parameter read functionally by its parent (Swin's ``F.linear(x, self.qkv.weight)``): sources
  of their own (:meth:`Placement.param_source`).

Index conventions: ``B`` the batch size, ``T`` positions, ``D`` features.
"""
from __future__ import annotations

from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor, nn

from ..base import utils
from ..base.errors import BatchSizeError, GradHooksError
from ..base.forms import Call
from ..base.utils import detached, flatten, is_functorch_wrapped, tensors
from ..rules.fallback import FallbackRule
from .graph import mark
from .mixing import Mixing
from .provenance import (Provenance, as_batch, input_batch_dim, meeting_cotangent, shared_layout,
                         source_cotangent)
from .records import Layer, Record

__all__ = ["Placement", "Placed", "BATCHED", "SHARED", "PLANNED", "relayout", "reads_batch_at",
           "partial_batch_hint", "layout_swap", "shared_call_layout", "recomputed_error",
           "meeting_cotangent"]

#: :attr:`Placed.kind` of a call whose inputs carry the batch (under tracking).
BATCHED = "batched"
#: :attr:`Placed.kind` of a call provenance found the batch did not reach: the same for every
#: sample, recorded by :meth:`Placement.record_shared`.
SHARED = "shared"
#: :attr:`Placed.kind` of a shared call an untracked forward follows from its signature's plan.
PLANNED = "planned"


class Placed(NamedTuple):
    """Where the batch sits in one hooked call: :meth:`Placement.place`'s answer.

    Attributes:
        kind: :data:`BATCHED`, :data:`SHARED` or :data:`PLANNED`.
        size: ``B`` where the placement knows it: for a planned call, the plan's (the first
            top-level input's size on the batch dim; the recorder prefers the size this forward's
            batched calls set); ``None`` otherwise (the rule reads it from a batched call, a
            shared call takes the tracked forward's at :meth:`Placement.record_shared`).
        swap: for a batched call, how to lay out its input so that its rule reads the batch
            (:func:`relayout`: ``("swap", d0, d1)`` for ``T == B`` layouts, ``("split", 0, B,
            T)`` for ``(B * T, D)`` rows), or ``None`` (as it is).
        ordinal: the call's number among its layer's calls in this forward (1, 2, ...; 0 when
            the forward is neither tracked nor planned): the key of a plan's entry.
        layout: for a planned call, the :func:`~gradhooks.core.provenance.as_batch` layout its input
            and output are expanded to (``"expand"``, ``"prepend"``, ...); else ``None``.
    """

    kind: str
    size: Optional[int]
    swap: Optional[tuple]
    ordinal: int
    layout: Optional[str]


def relayout(t: Tensor, how: tuple) -> Tensor:
    """A position-wise layer's input or grad_output in the layout its rule reads the batch from
    (:attr:`Placed.swap`): ``("swap", d0, d1)`` transposes two dims (a ``(T, B, D)`` activation
    in a batch-first model), ``("split", d, B, inner)`` unflattens a dim of ``B * inner`` rows
    into ``(B, inner)`` (``(B * T, D)`` rows). A view of ``t``."""
    if how[0] == "swap":
        return t.transpose(how[1], how[2])
    return t.unflatten(how[1], how[2:])


def reads_batch_at(layer: Layer, shape, dtype, dim: int, batch_first: bool = False) -> bool:
    """Whether ``layer``'s rule reads the batch of an input of ``shape`` from dim ``dim``.

    Asked on a ``meta`` tensor whose dim ``dim`` has a size no other dim has, so that a size
    that happens to equal ``B`` never decides (``T == B``). A rule that refuses the shape
    (:class:`GradHooksError`) reads it from nowhere: ``False``."""
    shape = list(shape)
    shape[dim] = max(shape) + 1
    try:
        return layer.rule.batch_size(layer.module, torch.empty(shape, dtype=dtype, device="meta"),
                                     batch_first) == shape[dim]
    except GradHooksError:
        return False


def partial_batch_hint(module: nn.Module, default: str) -> str:
    """What to do about a call that does not see the whole batch: for Opacus' DP RNN cells
    (``RNNLinear``: a DP LSTM's zero initial state made from sizes, and fewer samples at later
    steps of a ``PackedSequence``), use torch's recurrent layers; for any other module,
    ``default``."""
    if type(module).__module__.startswith("opacus."):
        return ("Opacus' DPLSTM / DPGRU / DPRNN run their cells on fewer samples at later time "
                "steps of a PackedSequence, and on an initial state made from sizes, so these "
                "calls cover only part of the batch: use torch's nn.LSTM / nn.GRU / nn.RNN "
                "(gradhooks' recurrent rule takes PackedSequence), or padded inputs.")
    return default


def layout_swap(prov: Provenance, layer: Layer, x: Tensor, batch_first: bool) -> Optional[tuple]:
    """How to lay out the records of a position-wise layer's call on ``x`` so that its rule
    reads the batch (:func:`relayout`'s ``how``), or ``None`` (as they are).

    For a layer (Linear, LayerNorm ...) whose input carries the batch on another dim than the
    one its rule reads under the declared layout (a batch-first model that transposes to
    ``(T, B, D)`` inside, as FSMT does), or merged into rows (OPT's ``(B * T, D)`` before its
    feed-forward). Decided by the batch dim ``prov`` followed from the inputs; with ``T == B``
    the declared layout would silently read the positions as samples. Marks ``prov.swapped``
    (such a signature is tracked on every forward: no plan)."""
    _, _, batch_dim = prov.look(x)
    if isinstance(batch_dim, tuple):  # samples merged with the dims after them: rows
        dim, inner = batch_dim
        if dim != 0 or not batch_first or x.shape[0] % inner:
            return None
        swap = ("split", 0, x.shape[0] // inner, inner)
        if not reads_batch_at(layer, relayout(x, swap).shape, x.dtype, 0, batch_first):
            return None
        prov.swapped = True
        return swap
    want = 0 if batch_first or x.dim() < 3 else 1  # (the Linear rule's convention)
    if batch_dim is None or batch_dim == want or x.dim() < 3:  # (the common case: no probe)
        return None
    if (reads_batch_at(layer, x.shape, x.dtype, batch_dim, batch_first)
            or not reads_batch_at(layer, x.shape, x.dtype, want, batch_first)):
        return None
    prov.swapped = True  # (its signature is tracked on every forward: no plan)
    return ("swap", batch_dim, want)


def shared_call_layout(layer: Layer, x: Tensor, output: Tensor, args, kwargs,
                       batch_first: bool) -> str:
    """Where a shared call's samples go (:func:`~gradhooks.core.provenance.shared_layout`):
    dim 0; with ``batch_first=False`` the dim the layer's rule reads the batch from, found by
    asking the rule on a shape whose candidate dim has a size no other dim has (never by a
    size that happens to equal ``B``: ``T == B``). The fallback's replay takes the samples
    on dim 0.

    Raises:
        BatchSizeError: if the rule reads the batch from neither dim 0 nor dim 1.
    """
    if batch_first or isinstance(layer.rule, FallbackRule):
        return shared_layout(x, output)
    for dim in (1, 0):
        how = shared_layout(x, output, dim)
        shape = as_batch(torch.empty(x.shape, dtype=x.dtype, device="meta"), 1, how).shape
        if reads_batch_at(layer, shape, x.dtype, dim):
            return how
    shapes = ", ".join(str(tuple(t.shape)) for t in tensors((args, kwargs)))
    raise BatchSizeError(
        f"module {layer.describe()} is called on inputs that do not come from the batch "
        f"(shapes {shapes}), and its rule reads no batch dim gradhooks can add to them "
        f"(batch_first=False). " + partial_batch_hint(
            layer.module, "Pass the inputs batched (e.g. position ids expanded to (T, B)), "
                          "or keep the module frozen."))


def recomputed_error(layer: Layer) -> BatchSizeError:
    """The error for a layer recomputed in the backward (a checkpointed region) after a
    shared call in its forward: a recomputation does not replay the meetings the shared
    call's per-sample part is taken from."""
    return BatchSizeError(
        f"module {layer.describe()} is recomputed in the backward pass (a checkpointed "
        f"region) after a call on shared inputs in its forward; gradhooks takes a shared "
        f"call's per-sample part where it meets the batch in the forward, which a "
        f"recomputation does not replay. Leave the layers that make position biases / "
        f"learned queries outside torch.utils.checkpoint")


class Placement:
    """The batch placement of one recorder: owns the provenance of the forward running now,
    what each input signature's tracked forward found, and the shared calls of the batch.

    Provenance (:mod:`gradhooks.core.provenance`) costs a Python call per torch op, so it runs only on
    the first forward of each input signature and on those of signatures that need it; the
    others follow the signature's plan (:attr:`signatures`) or nothing.

    Per call it answers :meth:`place` (a :class:`Placed`: batched, shared or planned; ``B``;
    the relayout; the call's ordinal) and records shared calls (:meth:`record_shared`); per
    forward it starts (:meth:`start`) and ends (:meth:`end_forward`) the tracking; in between,
    provenance calls it back where sources meet the batch (:meth:`on_noted`,
    :meth:`on_meeting`), where they cannot be split (:meth:`refuse_shared`) and where a raw
    parameter is first used (:meth:`param_source`). The module docstring lists the hard cases
    (``T == B``, ``(B * T, D)`` rows, learned initial states, DP LSTM zero states).

    Args:
        recorder: the :class:`~gradhooks.core.capture.Recorder` (duck-typed: this module sits below
            it), whose hooked layers, batch counters and layout the placement reads and whose
            records and call count it adds to.
        demote: ``demote(layer)``: hand a hooked layer whose parameters its parent reads
            functionally to the parent's replay
            (:meth:`gradhooks.core.attachment.Attachment.demote`).

    Attributes:
        provenance: the :class:`~gradhooks.core.provenance.Provenance` of the forward running now, or
            ``None`` (not tracked).
        signatures: per input signature (the top-level inputs' shapes and dtypes, train/eval
            mode), what its tracked forward found: ``"mode"`` (track every forward: sources that
            meet the batch after other ops, raw parameters, relayouted records), or the plan
            ``{(id(layer), ordinal): layout}`` of its shared calls whose outputs themselves meet
            the batch only by broadcasts (``"expand"`` / ``"prepend"``: later forwards hand them
            downstream as ``B`` identical samples, :func:`~gradhooks.core.records.expand_call`) or
            only row by row (``"rows"``: their ``B`` rows are the samples', an ordinary call);
            ``{}`` without shared calls.
        plan: the plan of the forward running now (``None``: none, or an empty one).
        plan_size: ``B`` of the planned forward running now (its first input's batch dim).
        ordinals: ``{id(layer): calls so far}`` in this forward (tracked or planned).
        shared_layers: ids of the layers with a shared call in this batch.
        met: a shared call's output or a raw parameter met the batch in this batch (their
            per-sample parts come from hooks on the meeting operands: no listener in
            :meth:`~gradhooks.core.capture.Recorder.drive`).
        refused: ``{id(record): (record, where)}``: shared calls whose outputs met the batch
            where they cannot be split per sample (the batch's reads raise, :meth:`refusal`).
        pulling: a per-sample pull-back to shared sources is running (:meth:`on_meeting`): the
            parameters' gradient hooks see a pass that is not the user's.
        mixing: the :class:`~gradhooks.core.mixing.Mixing` verdicts: ops of a signature's
            forward that mix the samples (refused at the read, :meth:`refusal`).
    """

    def __init__(self, recorder, demote: Callable[[Layer], None]):
        self._recorder = recorder
        self._demote = demote
        self.provenance: Optional[Provenance] = None
        self.signatures: Dict[tuple, object] = {}
        self.plan: Optional[dict] = None
        self.plan_size = 0
        self.ordinals: Dict[int, int] = {}
        self.pulling = False
        self.mixing = Mixing(recorder)  # (per signature and per batch: ops that mix samples)
        self.reset_batch()

    def reset_batch(self) -> None:
        """Forget the batch's shared calls, meetings and refusals (a new batch starts)."""
        self.shared_layers: set = set()
        self.met = False
        self.refused: Dict[int, Tuple[Record, str]] = {}
        self.mixing.reset_batch()

    # ------------------------------------------------------------------ forward lifecycle
    def start(self, inputs: List[Tensor], training: bool) -> None:
        """At the model's forward: follow its signature's plan, or start tracking it.

        Tracking starts when the signature (``inputs``' shapes and dtypes, ``training``) is new
        or needs it (``"mode"``); the batch is what the top-level inputs carry on the batch dim
        (``batch_first=False``: dim 1 of an input of 2 dims or more, torch's ``(T, B, ...)``).
        Inputs under ``torch.func`` transforms are not tracked (their batch is vmap's)."""
        self.plan, self.ordinals = None, {}
        first = next((t for t in inputs if t.dim() > 0), None)
        if first is None or any(is_functorch_wrapped(t) for t in inputs):
            return
        recorder = self._recorder
        layout = 0 if recorder.batch_first else 1
        batch_dim = input_batch_dim(first, layout)
        key = (tuple((tuple(t.shape), t.dtype) for t in inputs), training)
        known = self.signatures.get(key)
        if isinstance(known, dict):  # (empty: no shared calls)
            self.plan, self.plan_size = known or None, first.shape[batch_dim]
            self.mixing.untracked_start(key, self.plan_size)  # (joins the batch at its end)
            return
        # The top-level inputs are the batch (all of them: EmbeddingBag's offsets too); its size
        # is the first hooked call's on them (the first input's batch dim until then).
        owners: Dict[int, tuple] = {}  # (tied parameters have several)
        for layer in recorder.layers:
            for p in layer.params.values():
                owners[id(p)] = owners.get(id(p), ()) + (layer,)
        raw = {pid: (layers, None) for pid, layers in owners.items()}
        raw.update((pid, info) for pid, info in recorder.attachment.raw_params.items()
                   if info[0].params[info[1]].requires_grad)
        prov = Provenance(first.shape[batch_dim], layout, inputs, self.on_meeting,
                          self.refuse_shared, self.on_noted, raw, self.param_source)
        prov.signature, prov.depth = key, 1
        self.provenance = prov
        prov.__enter__()

    def nest(self) -> bool:
        """Whether a forward is tracked now; if so the model's forward was called again from
        inside it (a model that calls itself), and the tracking ends with the outer call."""
        prov = self.provenance
        if prov is None:
            return False
        prov.depth += 1
        return True

    def enter(self, layer: Layer) -> None:
        """A hooked layer's forward starts (under tracking): its parameters read from now on
        are read by it, not functionally by another module (:meth:`param_source`)."""
        self.provenance.entered.add(id(layer))

    def end_forward(self, completed: bool, forward_id: int) -> None:
        """The model's forward ``forward_id`` returned (``completed``) or raised.

        Calls outside the model's forward follow no plan. A tracked forward's outermost call
        stops the tracking; one that returned settles its raw parameters
        (:meth:`_settle_params`) and tells its signature's plan (:meth:`_learn`); one that raised
        drops its refusals (its records are never read)."""
        prov = self.provenance
        if prov is None:
            self.plan = None
            self.mixing.untracked_end(completed)
            return
        prov.depth -= 1
        if prov.depth:
            return
        self.provenance = None
        prov.__exit__(None, None, None)
        if not completed:
            self.refused = {k: v for k, v in self.refused.items() if v[0].forward != forward_id}
        else:
            self._settle_params(prov)
            self._learn(prov)

    def stop(self) -> None:
        """End the tracking of a forward that :meth:`~gradhooks.core.capture.Recorder.detach` or
        :meth:`~gradhooks.core.capture.Recorder.suspended` interrupted (the mode must not outlive
        the hooks)."""
        prov, self.provenance = self.provenance, None
        self.mixing.stop()
        if prov is not None:
            prov.__exit__(None, None, None)

    def forget_signatures(self) -> None:
        """Drop every signature's plan: the model changed (a resync), so the layers the plans
        name may be others."""
        self.signatures.clear()
        self.mixing.forget()

    def _learn(self, prov: Provenance) -> None:
        # What a tracked forward that returned tells about its signature (see signatures): a
        # plan only when every shared call's output met the batch in one replayable way (a
        # broadcast that adds the batch dim as the record does: position ids; or row by row,
        # itself: an initial state made from the batch size), no raw parameter, no relayout.
        plan = {key: "rows" if prov.kinds.get(id(cap)) == "direct" else how
                for cap, key, how in prov.shared_calls}
        if (prov.param_sources or prov.plain or prov.swapped
                or len(plan) < len(prov.shared_calls)):
            plan = "mode"
        before = self.signatures.get(prov.signature)
        self.signatures[prov.signature] = (plan if before is None or before == plan
                                           else "mode")
        self.mixing.learned(prov.signature, prov.mixing, prov.token_losses)

    def _settle_params(self, prov: Provenance) -> None:
        # At the end of a tracked forward: a raw parameter (ViT's class token, a layer scale)
        # whose uses all met the batch in ops that split per sample takes its per-sample
        # gradients from there, and its module's torch.func replay drops it (a module left with
        # no parameter to replay records nothing); one that met the batch otherwise (refused)
        # stays with the replay.
        for sources in prov.param_sources.values():
            record = sources[0][0]
            name = record.names[0]
            if self.refused.pop(id(record), None) is not None:
                record.names = ()
                continue
            for call in prov.fallback_calls:
                if call.layer.module is record.layer.module:  # (the Layer may be a demotion's)
                    call.names = tuple(n for n in call.names if n != name)

    # ------------------------------------------------------------------ per call
    def place(self, layer: Layer, x: Tensor, output, leaves: Optional[list],
              args: tuple) -> Optional[Placed]:
        """Where the batch sits in this call of ``layer`` (input ``x``, the first of ``args``;
        ``output``, or its tensor ``leaves`` for ``multi_io`` rules).

        Returns ``None`` for an ordinary call (neither tracked nor planned: the rule reads
        ``B`` from it, and no allocation is made on this path, which runs on every call), else
        a :class:`Placed`. Under tracking, a call whose output the batch did not reach is
        :data:`SHARED` whatever its sizes (``T == B`` buckets); a position-wise layer whose input
        carries the batch on another dim than its rule reads (``T == B`` after a transpose) or
        merged into ``(B * T, D)`` rows gets a :attr:`Placed.swap`."""
        prov, plan = self.provenance, self.plan
        if prov is None and not plan:
            return None
        ordinal = self.ordinals[id(layer)] = self.ordinals.get(id(layer), 0) + 1
        if prov is None:
            layout = plan.get((id(layer), ordinal))
            if layout is None or layout == "rows":  # (its B rows are the samples': ordinary)
                return None
            return Placed(PLANNED, self.plan_size, None, ordinal, layout)
        rule = layer.rule
        if not any(prov.batched(t) for t in (leaves if rule.multi_io else (output,))):
            return Placed(SHARED, None, None, ordinal, None)
        swap = None
        if rule.position_wise and x.dim() >= 2 and args and args[0] is x:
            swap = layout_swap(prov, layer, x, self._recorder.batch_first)
        return Placed(BATCHED, None, swap, ordinal, None)

    def batched_call(self, size: int) -> None:
        """A batched call under tracking set ``B`` to ``size``: the size later shared calls are
        expanded to, and meetings line up with."""
        self.provenance.batch_size = size

    def batched_record(self, record: Record) -> None:
        """A batched ``multi_io`` call under tracking was recorded as ``record``: a fallback
        record may own raw parameters that provenance covers, which its replay then drops
        (:meth:`_settle_params`)."""
        if isinstance(record.layer.rule, FallbackRule):
            self.provenance.fallback_calls.append(record)

    def record_shared(self, layer: Layer, args, kwargs, output, names: tuple, x,
                      ordinal: int) -> Record:
        """Record a :data:`SHARED` call: its input as a batch of ``B`` identical samples
        (:func:`~gradhooks.core.provenance.as_batch`, in the layout :func:`shared_call_layout`
        finds), its output tagged as a source; its per-sample grad_outputs come from where it
        meets the batch (:meth:`on_meeting`). Returns the record.

        Raises:
            BatchSizeError: if the call has more than one tensor input or output (or its rule
                reads no batch dim gradhooks can add, :func:`shared_call_layout`).
        """
        if not isinstance(output, Tensor) or not isinstance(x, Tensor):
            raise BatchSizeError(
                f"module {layer.describe()} is called on inputs that do not come from the batch "
                f"(shapes {[tuple(t.shape) for t in tensors((args, kwargs))]}), and gradhooks "
                f"splits such shared calls per sample only for one tensor input and one tensor "
                "output. " + partial_batch_hint(
                    layer.module, "Pass the inputs batched (e.g. position ids expanded to (B, "
                                  "T)), or keep the module frozen."))
        recorder, prov = self._recorder, self.provenance
        size = prov.batch_size
        how = shared_call_layout(layer, x, output, args, kwargs, recorder.batch_first)
        x_b = as_batch(x, size, how)
        if layer.rule.multi_io:
            _, spec = flatten(as_batch(output, size, how))
            call_args = (x_b.detach(), *detached(tuple(args[1:]))) if args else ()
            call_kwargs = detached(dict(kwargs))
            if not args:
                call_kwargs[next(iter(call_kwargs))] = x_b.detach()
            record = Record(layer, Call(call_args, call_kwargs, None, how), names, recorder._step,
                            spec, [None])
        else:
            record = Record(layer, x_b.detach(), names, recorder._step)
        record.forward = recorder._forward_id
        record.shared = how
        prov.shared_calls.append((record, (id(layer), ordinal), how))
        if isinstance(layer.rule, FallbackRule):
            prov.fallback_calls.append(record)
        recorder._calls += 1
        self.shared_layers.add(id(layer))
        prov.add_source(output, record)
        return record

    # ------------------------------------------------------------------ provenance callbacks
    def param_source(self, param: Tensor, info: tuple) -> Optional[Record]:
        """Provenance's ``param_source``: the record of a raw parameter at its first use in a
        tracked forward (ViT's class token, a layer scale: a source of its own, its per-sample
        gradient taken where it meets the batch); or, for ``info == (layers, None)``, a hooked
        layer's parameter read outside its forward (Swin's ``F.linear(x, self.qkv.weight)`` in
        the parent), which hands the layer to its parent's replay (``demote``) and returns
        ``None``."""
        layer, name = info
        if name is None:
            return self._demote(layer[0]) if len(layer) == 1 else None
        recorder = self._recorder
        record = Record(layer, Call((), {}, None, "param"), (name,), recorder._step,
                        flatten(param)[1], [None])
        record.forward, record.shared = recorder._forward_id, "param"
        recorder._calls += 1
        return record

    def on_noted(self, sources: tuple, how: str, u_b: Optional[Tensor],
                 direct: Optional[int], dim: Optional[int]) -> None:
        """Provenance's ``noted``: in the forward, where a shared call's output meets the batch
        (as ``u_b``).

        The output-edges pass of ``gh.backward`` asks for the gradient below ``u_b``, so that
        autograd runs its hook. A call on ``B`` rows whose output meets the batch only row by
        row, itself (a learned initial state, or one made from the batch size), is recorded as
        an ordinary call on its ``B`` rows (``"rows"``: no ``B x B`` expansion); any other
        meeting makes it ``B`` identical samples again. Only a call whose output itself meets
        the batch, always by broadcasts that add the batch dim as its record's layout does, or
        always row by row, can be planned (else it is added to ``plain``)."""
        prov, recorder = self.provenance, self._recorder
        kinds = prov.kinds
        for source in sources:
            record = source[0]
            fits = (how == "direct" or how == "broadcast" and recorder.batch_first
                    and direct == {"expand": 0, "prepend": 1}.get(record.shared))
            if direct is None or not fits or kinds.setdefault(id(record), how) != how:
                prov.plain.add(id(record))
        if u_b is None:
            return
        self.met = True
        if recorder._driven:
            recorder._edges_complete &= mark(recorder, sources[0][0], [], u_b.grad_fn)
        for record, _, _ in sources:
            if record.spec is not None:
                continue
            layout = record.shared
            if how == "direct" and layout.startswith("prepend") and not record.met:
                # (its input has B rows, lined up with the batch where its output meets it)
                rows_dim = 1 if layout == "prepend1" else 0
                one = record.a.select(rows_dim, 0) if record.a.shape[rows_dim] else None
                if (one is not None and one.dim() > dim
                        and one.shape[dim] == record.a.shape[rows_dim]
                        and reads_batch_at(record.layer, one.shape, one.dtype, dim,
                                           recorder.batch_first)):
                    record.a, record.shared, record.rows = one, "rows", layout
            elif how != "direct" and record.shared == "rows":
                record.a = as_batch(record.a, record.a.shape[0], record.rows)
                record.shared = record.rows
            record.met = True

    def refuse_shared(self, sources: tuple, message: str) -> None:
        """Provenance's ``refuse``: sources met the batch in an op that is not split per sample
        (``message`` says where); the batch's reads raise (:meth:`refusal`)."""
        for record, *_ in sources:
            self.refused.setdefault(id(record), (record, message))
            self.provenance.plain.add(id(record))

    def refusal(self, read: str) -> Optional[GradHooksError]:
        """The error a read of this batch raises for a refused shared call (a
        :class:`BatchSizeError`) or a mixing op (:meth:`~gradhooks.core.mixing.Mixing.refusal`), or
        ``None``."""
        for record, where in self.refused.values():
            return BatchSizeError(
                f"module {record.layer.describe()} is called on inputs that do not come from the "
                f"batch (a shared call: the same for every sample), and its output meets the "
                f"batch in {where}, which gradhooks cannot split per sample; {read} would be "
                f"wrong. Make the shared tensor meet the batch by broadcasting (+, *, where, "
                f"matmul, cat off the batch dim), or pass the module's inputs batched (B, ...)")
        return self.mixing.refusal(read)

    def on_meeting(self, edge, sources: tuple, how: str, shape: tuple, grad: Tensor,
                   dim: int) -> None:
        """Provenance's ``meet`` (a tensor hook in the backward): the gradient ``grad`` of a
        source-carrying tensor of ``shape`` where it met the batch (on dim ``dim``); its
        per-sample part, pulled back to each source's output and handed to the recorder.

        The per-sample cotangents are :func:`meeting_cotangent`'s; ``"direct"`` for a call
        recorded on its rows (learned initial states): ``grad`` is its ordinary grad_output."""
        recorder = self._recorder
        if utils.PAUSED or recorder._muted or not recorder._attached:
            return None
        first = sources[0][0]
        if how == "direct" and first.shared == "rows":
            if first.step == recorder._step:
                recorder.backward_pass.receive(first, None, grad)
            return None
        cotangent = meeting_cotangent(grad, how, shape, dim)
        size = cotangent.shape[0]
        live = [s for s in sources if s[0].step == recorder._step]
        if not live:
            return None
        # (u itself is a source: its cotangent as it is; autograd would hand back the batched
        # grad_output unwrapped from its vmap)
        same = [e.node is edge.node and e.output_nr == edge.output_nr for _, e, _ in live]
        pulled = [cotangent if s else None for s in same]
        rest = [i for i, s in enumerate(same) if not s]
        if rest and size == 0:  # (autograd's batched grad needs a sample)
            for i in rest:
                pulled[i] = cotangent.new_zeros((0, *live[i][2]))
        elif rest:
            self.pulling = True  # (a raw parameter's gradient hooks see this pass: not theirs)
            try:
                got = torch.autograd.grad([edge], [live[i][1] for i in rest], [cotangent],
                                          retain_graph=True, allow_unused=True,
                                          is_grads_batched=True)
            finally:
                self.pulling = False
            for i, g in zip(rest, got):
                pulled[i] = g
        receive = recorder.backward_pass.receive
        for (record, _, _), g in zip(live, pulled):
            if g is not None:
                receive(record, 0 if record.spec is not None else None,
                        source_cotangent(g, record.shared))
        return None
