"""Batch placement: where the batch sits in each hooked call, and whether the call is shared.

The recorder (:mod:`gradhooks.core.recorder.capture`) records every call of a hooked layer; before it builds
the record it asks its :class:`Placement` one question per call (:meth:`Placement.place`): is
this call *batched* (its inputs carry the batch, in the layout its rule reads or after a
relayout), *shared* (the same for every sample: position ids, relative-position buckets, a
learned query; :mod:`gradhooks.core.analysis.provenance` found that the batch did not reach its output), or
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
* ``(B * nW, N, C)`` windows (timm's Swin): a module without a rule called on them
  (``WindowAttention``, which owns the relative position bias table) is not recorded
  (:data:`MERGED`); its table is priced at its own ops, and the reads refuse if any of its
  parameters is left (the fallback's replay cannot take one sample's windows). A mixture of
  experts' router and experts on ``(B * T, D)`` token rows the same way, their weights split at
  their ``F.linear`` (:mod:`gradhooks.core.analysis.rows`).
* shared calls with no tensor input (BEiT's and Swin's relative position bias, called on a window
  size; a learned query or prompt returned by its module): the module's own parameters become
  sources (:meth:`Placement.record_shared`).
* raw parameters of containers (ViT's class token, a block's layer scale) and a hooked layer's
  parameter read functionally by its parent (Swin's ``F.linear(x, self.qkv.weight)``): sources
  of their own (:meth:`Placement.param_source`).

Index conventions: ``B`` the batch size, ``T`` positions, ``D`` features.
"""
from __future__ import annotations

from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

from torch import Tensor

from ...base.errors import BatchSizeError, GradHooksError
from ...base.forms import Call
from ...base.utils import detached, flatten, is_functorch_wrapped, tensors
from ...rules.fallback import FallbackRule
from ..analysis import (
    IN_ORDER,
    Mixing,
    Provenance,
    Routed,
    as_batch,
    input_batch_dim,
    meeting_cotangent,
)
from .alone_checks import verify_changed, verify_unproven
from .layouts import (
    fallback_dims,
    layout_swap,
    partial_batch_hint,
    reads_batch_at,
    recomputed_error,
    relayout,
    shared_call_layout,
)
from .meetings import note_meeting, pull_back
from .records import Layer, Record

__all__ = ["Placement", "Placed", "BATCHED", "SHARED", "PLANNED", "MERGED", "relayout",
           "reads_batch_at", "partial_batch_hint", "layout_swap", "shared_call_layout",
           "recomputed_error", "meeting_cotangent"]

#: :attr:`Placed.kind` of a call whose inputs carry the batch (under tracking).
BATCHED = "batched"
#: :attr:`Placed.kind` of a call provenance found the batch did not reach: the same for every
#: sample, recorded by :meth:`Placement.record_shared`.
SHARED = "shared"
#: :attr:`Placed.kind` of a shared call an untracked forward follows from its signature's plan.
PLANNED = "planned"
#: :attr:`Placed.kind` of a call of a module without a rule on a batch merged with the dims after
#: it (timm Swin's ``WindowAttention`` on ``(B * nW, N, C)`` windows): not recorded; its raw
#: parameters are taken at their own ops, and any left makes the batch's reads raise
#: (:meth:`Placement.merged_call`).
MERGED = "merged"


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
            T)`` for ``(B * T, D)`` rows; for a fallback call, ``("dims", inputs, outputs)``:
            where its tensors carry the batch, :func:`~gradhooks.core.recorder.layouts.fallback_dims`), or
            ``None`` (as it is).
        ordinal: the call's number among its layer's calls in this forward (1, 2, ...; 0 when
            the forward is neither tracked nor planned): the key of a plan's entry.
        layout: for a planned call, the :func:`~gradhooks.core.analysis.provenance.as_batch` layout its input
            and output are expanded to (``"expand"``, ``"prepend"``, ...); else ``None``.
    """

    kind: str
    size: Optional[int]
    swap: Optional[tuple]
    ordinal: int
    layout: Optional[str]


def _read_by(prov: Provenance, layer: Layer, args: tuple, batch_first: bool) -> None:
    # A top-level input a position-wise layer reads itself: the batch dim is where its rule
    # reads it (with batch_first=False: dim 1 of 3 dims or more, dim 0 of a (B, D) input, which
    # the declared layout took for a (T, B) one), so that its outputs carry the records' layout.
    x, rule = args[0] if args else None, layer.rule
    if isinstance(x, Tensor) and id(x) in prov.inputs and rule.position_wise and (
            rule.feature_dims and x.dim() > rule.feature_dims):  # (not an embedding's indices)
        prov.inputs[id(x)] = 0 if batch_first or x.dim() <= 2 else 1


def _raw(prov: Provenance, param) -> bool:
    """Whether ``param`` is a raw parameter of a container (a source of its own, once read)."""
    info = prov.params.get(id(param))
    return info is not None and info[1] is not None


def _replayed(prov: Provenance, record: Record) -> bool:
    # Whether a raw parameter's module has a fallback call in the tracked forward (a replay to
    # cover it where its meeting with the batch was refused): never for a parameter holder
    # (an nn.ParameterDict read by its parent, as peft's LoRA on Embedding does).
    return any(call.layer.module is record.layer.module for call in prov.fallback_calls)


def _batch_of_input(recorder, prov: Provenance, forward_id: int) -> None:
    # A tracked forward with no hooked call on the batch (a prompt embedding or a raw parameter
    # the only trainable part): the batch is the model's input's, which those were expanded to.
    if recorder.batch_size is None and (prov.shared_calls or prov.param_sources):
        recorder.batch_size, recorder.batch_forward = prov.batch_size, forward_id
        recorder.batch_source = "the model's input"


def _unsplit(record: Record, where: str, read: str) -> BatchSizeError:
    # The refusal of a shared call's output, or a raw parameter (or a tensor computed from raw
    # parameters alone: peft's LoRA-on-Embedding A), that met the batch where it cannot be split
    what = ("has raw parameters (not read by its own forward): they, or a tensor made of them "
            "alone," if record.shared == "param" else "is called on inputs that do not come "
            "from the batch (a shared call: the same for every sample), and its output")
    return BatchSizeError(
        f"module {record.layer.describe()} {what} meets the batch in {where}, which gradhooks "
        f"cannot split per sample; {read} would be wrong. Make the shared tensor meet the batch "
        f"by broadcasting (+, *, where, matmul, as F.linear's weight, cat off the batch dim), "
        f"pass the module's inputs batched (B, ...), or give the module whose forward does "
        f"this a rule (gradhooks.register_rule)")


class Placement:
    """The batch placement of one recorder: owns the provenance of the forward running now,
    what each input signature's tracked forward found, and the shared calls of the batch.

    Provenance (:mod:`gradhooks.core.analysis.provenance`) costs a Python call per torch op, so
    it runs on the first forward of each input signature, again when the check policy says so
    (:meth:`~gradhooks.core.recorder.check_policy.SumCheck.forward_due`: after a planned forward
    of a structure its signature had not shown, every 100th) and on every forward of
    signatures that need it; the others follow the signature's plan (:attr:`signatures`).

    Per call it answers :meth:`place` (a :class:`Placed`: batched, shared or planned; ``B``;
    the relayout; the call's ordinal) and records shared calls (:meth:`record_shared`); per
    forward it starts (:meth:`start`) and ends (:meth:`end_forward`) the tracking; in between,
    provenance calls it back where sources meet the batch (:meth:`on_noted`,
    :meth:`on_meeting`), where they cannot be split (:meth:`refuse_shared`) and where a raw
    parameter is first used (:meth:`param_source`). The module docstring lists the hard cases
    (``T == B``, ``(B * T, D)`` rows, learned initial states, DP LSTM zero states).

    Args:
        recorder: the :class:`~gradhooks.core.recorder.capture.Recorder` (duck-typed: this module sits below
            it), whose hooked layers, batch counters and layout the placement reads and whose
            records and call count it adds to.
        demote: ``demote(layer)``: hand a hooked layer whose parameters its parent reads
            functionally to the parent's replay, or say why it cannot (:meth:`~gradhooks.core.recorder.attachment.Attachment.demote`).

    Attributes:
        provenance: the :class:`~gradhooks.core.analysis.provenance.Provenance` of the forward running now, or
            ``None`` (not tracked).
        signatures: per input signature (the top-level inputs' shapes and dtypes, train/eval
            mode), what its tracked forward found: ``"mode"`` (track every forward: sources that
            meet the batch after other ops, raw parameters, relayouted records), or the plan
            ``{(id(layer), ordinal): layout}`` of its shared calls whose outputs themselves meet
            the batch only by broadcasts (``"expand"`` / ``"prepend"``: later forwards hand them
            downstream as ``B`` identical samples, :func:`~gradhooks.core.recorder.records.expand_call`) or
            only row by row (``"rows"``: their ``B`` rows are the samples', an ordinary call);
            ``{}`` without shared calls.
        plan: the plan of the forward running now (``None``: none, or an empty one).
        plan_size: ``B`` of the planned forward running now (its first input's batch dim).
        ordinals: ``{id(layer): calls so far}`` in this forward (tracked or planned).
        shared_layers: ids of the layers with a shared call in this batch.
        met: a shared call's output or a raw parameter met the batch in this batch (their
            per-sample parts come from hooks on the meeting operands: no listener in
            :meth:`~gradhooks.core.recorder.capture.Recorder.drive`).
        refused: ``{id(record): (record, where)}``: shared calls whose outputs met the batch
            where they cannot be split per sample (the batch's reads raise, :meth:`refusal`).
        pulling: a per-sample pull-back to shared sources is running (:meth:`on_meeting`): the
            parameters' gradient hooks see a pass that is not the user's.
        mixing: the :class:`~gradhooks.core.analysis.mixing.Mixing` verdicts: ops of a signature's
            forward that mix the samples (refused at the read, :meth:`refusal`).
        verified: ``{signature: {(op, line)}}``: the ops no rule proves keep the samples apart
            (:mod:`gradhooks.core.analysis.separation`) whose forward-alone check passed on a forward of
            that signature (:mod:`gradhooks.core.analysis.alone`); they are not checked again.
    """

    def __init__(self, recorder, demote: Callable[[Layer], Optional[str]]):
        self.recorder = recorder
        self._demote = demote
        self.provenance: Optional[Provenance] = None
        self.signatures: Dict[tuple, object] = {}
        self.signature: Optional[tuple] = None  # the last forward's (start())
        self.plan: Optional[dict] = None
        self.plan_size = 0
        self.ordinals: Dict[int, int] = {}
        self.pulling = False
        self.mixing = Mixing(recorder)  # (per signature and per batch: ops that mix samples)
        self.verified: Dict[tuple, set] = {}  # (signature, SumCheck.structure) -> ops it passed
        self.reset_batch()

    def reset_batch(self) -> None:
        """Forget the batch's shared calls, meetings and refusals (a new batch starts)."""
        self.shared_layers: set = set()
        self.met = False
        self.refused: Dict[int, Tuple[Record, str]] = {}
        self.unsplit: List[Tuple[int, str]] = []  # (forward, message): merged_call's refusals
        self.mixing.reset_batch()

    # ------------------------------------------------------------------ forward lifecycle
    def start(self, inputs: List[Tensor], training: bool) -> None:
        """At the model's forward: follow its signature's plan, or start tracking it.

        Tracking starts when the signature (``inputs``' shapes and dtypes, ``training``) is new,
        needs it (``"mode"``) or is due again (the check policy); the batch is what the top-level inputs carry on the batch dim
        (``batch_first=False``: dim 1 of an input of 2 dims or more, torch's ``(T, B, ...)``).
        Inputs under ``torch.func`` transforms are not tracked (their batch is vmap's)."""
        self.plan, self.ordinals, self.signature = None, {}, None
        first = next((t for t in inputs if t.dim() > 0), None)
        if first is None or any(is_functorch_wrapped(t) for t in inputs):
            return
        recorder = self.recorder
        layout = 0 if recorder.batch_first else 1
        batch_dim = input_batch_dim(first, layout)
        key = (tuple((tuple(t.shape), t.dtype) for t in inputs), training)
        self.signature = key  # (the sample check's structure: readers.sample_check)
        known = self.signatures.get(key)
        if isinstance(known, dict) and not recorder.sum_check.forward_due(key):  # ({}: none shared)
            self.plan, self.plan_size = known or None, first.shape[batch_dim]
            self.mixing.untracked_start(key, self.plan_size)  # (joins the batch at its end)
            recorder.sum_check.forward_start(key, False, inputs)  # (its nodes counted)
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
        recorder.sum_check.forward_start(key, True, inputs)  # (its hashing mode inside prov's)

    def nest(self) -> bool:
        """Whether a forward is tracked now; if so the model's forward was called again from
        inside it (a model that calls itself), and the tracking ends with the outer call."""
        prov = self.provenance
        if prov is None:
            return False
        prov.depth += 1
        return True

    def enter(self, layer: Layer, args: tuple = ()) -> None:
        """A hooked layer's forward starts (under tracking, with ``args``): its parameters read
        until it returns (:meth:`leave`) are read by it, not functionally by another module
        (:meth:`param_source`);
        a top-level input it reads takes the batch dim its rule reads (:func:`_read_by`)."""
        self.provenance.entered[id(layer)] += 1
        _read_by(self.provenance, layer, args, self.recorder.batch_first)

    def leave(self, layer: Layer) -> None:
        """A hooked layer's call returned: its parameters are read outside it now."""
        self.provenance.entered[id(layer)] -= 1

    def end_forward(self, completed: bool, forward_id: int, call: Optional[tuple] = None) -> None:
        """The model's forward ``forward_id`` returned (``completed``) or raised.

        Calls outside the model's forward follow no plan. A tracked forward's outermost call
        stops the tracking; one that returned settles its raw parameters
        (:meth:`_settle_params`) and tells its signature's plan (:meth:`_learn`); one that raised
        drops its refusals (its records are never read). ``call``: ``(args, kwargs, output)``
        of the model's forward, for the forward-alone check of ops no rule proves keep the
        samples apart (:func:`verify_unproven`)."""
        prov = self.provenance
        if prov is None:
            self.plan = None
            self.mixing.untracked_end(completed)
            if self.recorder.sum_check.forward_end(completed, None if call is None else call[2]):
                verify_changed(self, call)
            return
        prov.depth -= 1
        if prov.depth:
            return
        self.provenance = None
        self.recorder.sum_check.forward_end(completed, None if call is None else call[2])
        prov.__exit__(None, None, None)
        if not completed:
            self.refused = {k: v for k, v in self.refused.items() if v[0].forward != forward_id}
            self.unsplit = [u for u in self.unsplit if u[0] != forward_id]
        else:
            self._settle_params(prov)
            _batch_of_input(self.recorder, prov, forward_id)
            if prov.unproven:
                verify_unproven(self, prov, call)
            self._learn(prov)

    def stop(self) -> None:
        """End the tracking of a forward that :meth:`~gradhooks.core.recorder.capture.Recorder.detach` or
        :meth:`~gradhooks.core.recorder.capture.Recorder.suspended` interrupted (the mode must not outlive
        the hooks)."""
        prov, self.provenance = self.provenance, None
        self.mixing.stop()
        self.recorder.sum_check.forward_end(False)
        if prov is not None:
            prov.__exit__(None, None, None)

    def forget_signatures(self) -> None:
        """Drop every signature's plan: the model changed (a resync), so the layers the plans
        name may be others."""
        self.signatures.clear()
        self.verified.clear()
        self.mixing.forget()

    def _learn(self, prov: Provenance) -> None:
        # What a tracked forward that returned tells about its signature (see signatures): a
        # plan only when every shared call's output met the batch in one replayable way (a
        # broadcast that adds the batch dim as the record does: position ids; or row by row,
        # itself: an initial state made from the batch size), no raw parameter, no relayout.
        plan = {key: "rows" if prov.kinds.get(id(cap)) == "direct" else how
                for cap, key, how in prov.shared_calls}
        if (prov.param_sources or prov.plain or prov.swapped or len(plan) < len(prov.shared_calls)
                or any(kind == IN_ORDER for kind, _ in prov.mixing)):  # (verdicts of the values)
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
            if id(record) in prov.own_params:  # (a shared call's own: no replay covers it)
                continue
            if (self.refused.pop(id(record), None) if _replayed(prov, record) else None) is not None:
                record.names = ()  # (a holder no forward calls has no replay: refused stays)
                continue
            for call in prov.fallback_calls:
                if call.layer.module is record.layer.module:  # (the Layer may be a demotion's)
                    call.names = tuple(n for n in call.names if n != name)
        for call in prov.fallback_calls:  # (raw parameters this forward never read: no gradient,
            # as in autograd, where the replay would give zeros the sum check has nothing for)
            call.names = tuple(n for n in call.names if id(call.layer.params[n]) in
                               prov.param_sources or not _raw(prov, call.layer.params[n]))
        for layer, names in prov.merged:
            covered = {s[0][0].names[0] for s in prov.param_sources.values()
                       if s[0][0].names and s[0][0].layer.module is layer.module}
            left = [n for n in names if n not in covered]
            if left:
                self.unsplit.append((self.recorder.forward_id, (
                    f"module {layer.describe()} has no rule and is called on a batch merged with "
                    f"the dims after it ((B * n, ...) rows, as windows are), where its torch.func "
                    f"replay cannot take one sample's rows; its parameter(s) {', '.join(left)} "
                    f"meet the batch in ops gradhooks does not split per sample (a linear map "
                    f"of the rows, F.linear: give the module a rule, or use nn.Linear)")))

    # ------------------------------------------------------------------ per call
    def place(self, layer: Layer, x: Tensor, output, leaves: Optional[list],
              args: tuple, kwargs: Optional[dict] = None) -> Optional[Placed]:
        """Where the batch sits in this call of ``layer`` (input ``x``, the first of ``args``;
        ``output``, or its tensor ``leaves`` for ``multi_io`` rules).

        Returns ``None`` for an ordinary call (neither tracked nor planned: the rule reads
        ``B`` from it, and no allocation is made on this path, which runs on every call), else
        a :class:`Placed`. Under tracking, a call whose output the batch did not reach is
        :data:`SHARED` whatever its sizes (``T == B`` buckets); a position-wise layer whose input
        carries the batch on another dim than its rule reads (``T == B`` after a transpose) or
        merged into ``(B * T, D)`` rows gets a :attr:`Placed.swap`, and so does a fallback call
        whose tensors carry the batch elsewhere than the declared layout says (``kwargs``: the
        call's keyword arguments, whose tensors count too)."""
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
        if isinstance(rule, FallbackRule) and args and args[0] is x and (
                isinstance(prov.look(x)[2], (tuple, Routed))
                or layer.params and all(id(p) in prov.met_by_rows
                                        for p in layer.params.values())):
            # (on merged or routed rows; or every parameter met the batch inside the call, at
            # a linear or grouped product of rows: DeepSeek-V3's router flattens its (B, T, D)
            # input to token rows itself, a mixture of experts' experts take (B, D) rows when
            # T = 1)
            return Placed(MERGED, None, None, ordinal, None)
        swap = None
        if isinstance(rule, FallbackRule):  # (batched tensors where the layout does not say)
            swap = fallback_dims(prov, args, kwargs or {}, leaves, self.recorder.batch_first)
        elif rule.position_wise and x.dim() >= 1 + rule.feature_dims and args and args[0] is x:
            swap = layout_swap(prov, layer, x, self.recorder.batch_first)
        return Placed(BATCHED, None, swap, ordinal, None)

    def merged_call(self, layer: Layer, names: tuple) -> None:
        """A :data:`MERGED` call: recorded nothing; at the end of the forward, the parameters of
        ``names`` that provenance did not take at their own ops make the reads raise
        (:meth:`_settle_params`). Its signature is tracked on every forward."""
        self.provenance.merged.append((layer, names))
        self.provenance.swapped = True

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
                      ordinal: int) -> Optional[Record]:
        """Record a :data:`SHARED` call: its input as a batch of ``B`` identical samples
        (:func:`~gradhooks.core.analysis.provenance.as_batch`, in the layout :func:`shared_call_layout`
        finds), its output tagged as a source; its per-sample grad_outputs come from where it
        meets the batch (:meth:`on_meeting`). Returns the record.

        A call of a module without a rule (the fallback) on no tensor input, or with several
        outputs (BEiT's and Swin's relative position bias tables, called on a window size; a
        learned query or prompt returned by its module): the module's own parameters become
        sources of their own (:meth:`~gradhooks.core.analysis.provenance.Provenance.param_sources_of`), as
        raw parameters are, and its outputs carry them: each parameter's per-sample gradient is
        pulled back from where the outputs meet the batch through the module's own ops. Returns
        ``None`` then.

        Raises:
            BatchSizeError: if the call has more than one tensor input or output (or its rule
                reads no batch dim gradhooks can add, :func:`shared_call_layout`), for a module
                with a rule.
        """
        if not isinstance(output, Tensor) or not isinstance(x, Tensor):
            if isinstance(layer.rule, FallbackRule):
                prov = self.provenance
                sources = prov.param_sources_of([((layer, n), layer.params[n]) for n in names])
                prov.add_sources([t for t in flatten(output)[0] if isinstance(t, Tensor)
                                  and t.requires_grad], sources)
                self.shared_layers.add(id(layer))
                return None
            raise BatchSizeError(
                f"module {layer.describe()} is called on inputs that do not come from the batch "
                f"(shapes {[tuple(t.shape) for t in tensors((args, kwargs))]}), and gradhooks "
                f"splits such shared calls per sample only for one tensor input and one tensor "
                "output. " + partial_batch_hint(
                    layer.module, "Pass the inputs batched (e.g. position ids expanded to (B, "
                                  "T)), or keep the module frozen."))
        recorder, prov = self.recorder, self.provenance
        size = prov.batch_size
        how = shared_call_layout(layer, x, output, args, kwargs, recorder.batch_first)
        x_b = as_batch(x, size, how)
        if layer.rule.multi_io:
            _, spec = flatten(as_batch(output, size, how))
            call_args = (x_b.detach(), *detached(tuple(args[1:]))) if args else ()
            call_kwargs = detached(dict(kwargs))
            if not args:
                call_kwargs[next(iter(call_kwargs))] = x_b.detach()
            record = Record(layer, Call(call_args, call_kwargs, None, how), names, recorder.batch_id,
                            spec, [None])
        else:
            record = Record(layer, x_b.detach(), names, recorder.batch_id)
        record.forward = recorder.forward_id
        record.shared = how
        prov.shared_calls.append((record, (id(layer), ordinal), how))
        if isinstance(layer.rule, FallbackRule):
            prov.fallback_calls.append(record)
        recorder.calls += 1
        self.shared_layers.add(id(layer))
        prov.add_source(output, record)
        return record

    # ------------------------------------------------------------------ provenance callbacks
    def param_source(self, param: Tensor, info: tuple) -> Optional[Record]:
        """Provenance's ``param_source``: the record of a raw parameter at its first use in a
        tracked forward (ViT's class token, a layer scale: a source of its own); or, for ``info
        == (layers, None)``, a hooked layer's parameter read outside its forward, which hands
        the layer to its parent's replay (``demote``), or where it cannot, refuses the batch."""
        layer, name = info
        if name is None:
            why = self._demote(layer[0]) if len(layer) == 1 else None
            return None if why is None else self.unsplit.append((self.recorder.forward_id, why))
        recorder = self.recorder
        record = Record(layer, Call((), {}, None, "param"), (name,), recorder.batch_id,
                        flatten(param)[1], [None])
        record.forward, record.shared = recorder.forward_id, "param"
        recorder.calls += 1
        return record

    def on_noted(self, sources: tuple, how: str, u_b: Optional[Tensor],
                 direct: Optional[int], dim: Optional[int]) -> None:
        """Provenance's ``noted``: in the forward, where a shared call's output meets the batch
        (as ``u_b``): :func:`~gradhooks.core.recorder.meetings.note_meeting`."""
        note_meeting(self, sources, how, u_b, direct, dim)

    def refuse_shared(self, sources: tuple, message: str) -> None:
        """Provenance's ``refuse``: sources met the batch in an op that is not split per sample
        (``message`` says where); the batch's reads raise (:meth:`refusal`)."""
        for record, *_ in sources:
            self.refused.setdefault(id(record), (record, message))
            self.provenance.plain.add(id(record))

    def refusal(self, read: str) -> Optional[GradHooksError]:
        """The error a read of this batch raises for a refused shared call (a
        :class:`BatchSizeError`) or a mixing op (:meth:`~gradhooks.core.analysis.mixing.Mixing.refusal`), or
        ``None``."""
        for _, message in self.unsplit:
            return BatchSizeError(f"{message}; {read} would be wrong")
        for record, where in self.refused.values():
            return _unsplit(record, where, read)
        return self.mixing.refusal(read)

    def on_meeting(self, edge, sources: tuple, how: str, shape: tuple, grad: Tensor,
                   dim) -> None:
        """Provenance's ``meet`` (a tensor hook in the backward): the gradient ``grad`` of a
        source-carrying tensor of ``shape`` where it met the batch, its per-sample part pulled
        back to the sources: :func:`~gradhooks.core.recorder.meetings.pull_back`."""
        pull_back(self, edge, sources, how, shape, grad, dim)
