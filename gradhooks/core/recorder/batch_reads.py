"""How a reader gets a batch from a recorder: validated once, then handed over as a read-only
:class:`~gradhooks.core.recorder.records.Batch` snapshot (records, ``B``, the own-loss scale, the
``GradScaler``'s scale, whether the sum check is due).

The validation is the recorder's side of every read (:func:`refusal`, then the placement's and
the records' own): records released by an earlier read, stale (a backward after the release),
none reached, a ``create_graph`` pass, a model changed since the forward, a shared call refused
by the placement, an input modified in place. Where the sum check is due, the snapshot also
reads the precision each module computes in off its parameters' gradients
(:func:`~gradhooks.core.recorder.totals.module_precision`), for the check's tolerance.
"""
from __future__ import annotations

import math
import warnings
from typing import List, Optional

import torch
from torch import Tensor

from ...base.errors import (
    GradHooksError,
    GradientMismatchError,
    HigherOrderGradError,
    LossScaleWarning,
    NoBackwardError,
    RecordsReleasedError,
    SampleIdsError,
)
from ...base.sample_groups import SampleGroups
from .records import Batch, Record
from .totals import module_precision

__all__ = ["BatchReads", "is_loss_scale", "refusal", "GROUPED_READS"]

#: The reads that take ``sample_ids`` (:meth:`BatchReads.groups`): their results are per
#: sample, the rows of a sample summed; every other read refuses a batch with ``sample_ids``.
GROUPED_READS = ("per_sample_grads()", "per_sample_grad_norms()", "clip_and_accumulate()",
                 "clipped_backward()")


def is_loss_scale(value: float) -> bool:
    """Whether ``value`` can be a ``torch.amp.GradScaler``'s scale as gradhooks reads one seen on
    a loss: a power of two of at least 2 (its ``init_scale`` times powers of its growth and
    backoff factors, 2 and 1/2 by default)."""
    return math.isfinite(value) and value >= 2.0 and math.frexp(value)[0] == 0.5


def refusal(read: str, *, attached: bool, changed: Optional[str], stale: Optional[str],
            released: bool, reached: int, calls: int, backward_reached_params: bool,
            forwards: int, higher_order: Optional[str]) -> Optional[GradHooksError]:
    """The error a read of the current batch must raise, or ``None`` if it may go on.

    Args:
        read: the reading call, e.g. ``"per_sample_grad_norms()"``, named in the messages.
        attached: whether the hooks are attached.
        changed: what changed in the model since its forward (a parameter or submodule set on
            it), or ``None``.
        stale: the module a backward pass reached after a read released the records, or
            ``None``.
        released: whether a read released the records.
        reached: how many calls a backward pass reached.
        calls: how many hooked-layer calls the forwards of this batch recorded.
        backward_reached_params: whether autograd computed parameter gradients in this batch.
        forwards: how many top-level forwards the reached calls came from (counted as 1 when
            ``attach(forwards="same_samples")`` or when the model is itself a hooked layer).
        higher_order: the module a ``create_graph=True`` backward reached, or ``None``.
    """
    if not attached:
        return GradHooksError(
            f"{read}: this GradHooks was detached from the model, which dropped its records "
            f"(also at the end of a `with gradhooks.attach(model) as gh:` block): read inside "
            f"the block / before detach(), or attach again and rerun the forward and backward")
    if changed is not None:
        return GradHooksError(
            f"{read}: the model changed after its forward ({changed}), so the records do not "
            f"describe its parameters any more: run the forward and backward again (gradhooks "
            f"follows the change at the next forward)")
    if stale is not None:
        return RecordsReleasedError(
            f"a backward pass reached module {stale} after per_sample_grads() released this "
            f"batch's records (activations and grad_outputs), so its grad_outputs were not "
            f"recorded: to read per-sample results over several backward passes of one forward, "
            f"call per_sample_grads(retain_records=True) before the later passes, or run a new "
            f"forward")
    if released:
        if read == "per_sample_grads()":
            return RecordsReleasedError(
                "per_sample_grads() released this batch's records as it read them and did not "
                "finish (it raised an error): run the forward and backward again, with "
                "per_sample_grads(retain_records=True) to keep the records through a failed read")
        return RecordsReleasedError(
            f"per_sample_grads() released this batch's records (activations and grad_outputs) "
            f"as it read them, and {read} needs them: call {read} before per_sample_grads(), or "
            f"per_sample_grads(retain_records=True) to keep them")
    if not reached:
        if calls == 0 and backward_reached_params:
            return NoBackwardError(
                f"{read}: autograd computed parameter gradients, but no hooked layer's forward "
                f"hook ran: the forward went through code compiled by torch.compile before "
                f"attach (compiled code does not see hooks added later). Attach before "
                f"compiling, or call torch._dynamo.reset() after attach so that it recompiles")
        return NoBackwardError(
            f"no backward pass has reached a hooked layer since the last forward: call "
            f"loss.backward() (or gh.backward(loss)) before {read} (forwards under "
            f"torch.no_grad() or inference_mode() record nothing; a model compiled with "
            f"torch.compile before attach runs without the hooks: attach first)")
    if forwards > 1:
        return GradHooksError(
            f"{read}: the backward reached the records of {forwards} forwards of the model, "
            f"whose rows would be added sample by sample (row n = sample n of every forward). "
            f"This is what a contrastive or two-view loss does (SimCLR / InfoNCE over "
            f"model(view1) and model(view2), a siamese or triplet loss). If every forward saw "
            f"the same samples in the same order (two views or augmentations of one batch, sample "
            f"n's own loss depending on both), declare it: attach(model, forwards='same_samples'), "
            f"and the per-sample results sum over the forwards. If a sample is made of rows of "
            f"several forwards (a DPO pair: its chosen and its rejected completion), run one "
            f"forward of their concatenation, model(torch.cat([x_chosen, x_rejected])), and "
            f"declare which rows make one sample: gh.set_sample_ids(torch.arange(P).repeat(2)) "
            f"after the forward (rows sharing an id are one sample, clipped as one). Concatenating "
            f"without sample_ids would make each row a sample of its own. Per-sample gradients "
            f"of a loss that pairs a sample with other samples (negatives drawn from the batch) "
            f"are not defined")
    if higher_order is not None:
        return HigherOrderGradError(
            f"a backward pass with create_graph=True reached module {higher_order}: the loss "
            f"contains derivatives (a gradient penalty or a Laplacian built with "
            f"torch.autograd.grad(..., create_graph=True)), so each parameter's gradient has "
            f"terms through the derivative graph that grad_output-based rules do not see; "
            f"{read} would be wrong. Compute such per-sample quantities with torch.func (vmap "
            f"over grad of the per-sample loss), or detach the derivative term")
    return None


class BatchReads:
    """The reads of one recorder's batches (``recorder``: the
    :class:`~gradhooks.core.recorder.capture.Recorder`, whose batch state it validates and whose sum check
    it keeps)."""

    def __init__(self, recorder):
        self._recorder = recorder
        self._scale_warned = False  # LossScaleWarning: once per attachment
        self._seen_warned = False  # the same, for a scale read from the loss
        # set_groups: (batch_id it was set for, SampleGroups, whether a read used them)
        self._groups: Optional[tuple] = None
        #: The loss scale seen on this batch's loss (:meth:`see_scale`), or ``None``.
        self.seen: Optional[Tensor] = None

    def snapshot(self, read: str, records: Optional[List[Record]] = None,
                 release: bool = False, sum_check: bool = True, result: bool = False) -> Batch:
        """The batch as a reader sees it, validated once.

        Args:
            read: the reading call, e.g. ``"per_sample_grad_norms()"``, for the messages.
            records: a subset of the records (a group two-pass clipping reduces during its
                backward); default: every record of the batch.
            release: the reader releases each record as it uses it (the records are gone for
                later reads, which then raise :class:`RecordsReleasedError`).
            sum_check: whether the read runs the sum check when it is due (counts as a read for
                the recorder's ``sum_check`` policy); ``False`` for reads that check nothing
                (KFAC factors).
            result: the per-sample gradients an earlier read kept answer this read when that
                read released the records (per-sample gradients, their norms, clipping of
                them, their moments): the batch is then handed over with no records and its
                :attr:`~gradhooks.core.recorder.records.Batch.result`, without validation (as the result was
                validated when formed).

        Raises:
            RecordsReleasedError: if an earlier read released the records (or one that did
                failed), or a backward pass reached the hooked layers after that.
            NoBackwardError: if no backward pass reached a hooked layer in this batch.
            HigherOrderGradError: if a backward pass with ``create_graph=True`` did.
            BatchSizeError: if a shared call's output met the batch where it cannot be split
                per sample (:meth:`gradhooks.core.recorder.placement.Placement.refusal`).
            GradientMismatchError: if a recorded input was modified in place since its forward.
        """
        recorder = self._recorder
        groups = self.groups(read)
        if result and recorder.released and recorder.result is not None:
            return Batch.of(recorder, (), None, False, self.grad_scale(), groups=groups)
        reached = recorder.reached_records
        # (A model that is itself a hooked layer, a cell called per time step, is a layer
        # called several times: its calls see the same samples.)
        forwards = len({record.forward for record in reached})
        error = refusal(
            read, attached=recorder.attached, changed=recorder.attachment.changed,
            stale=recorder.stale, released=recorder.released, reached=len(reached),
            calls=recorder.calls, backward_reached_params=bool(recorder.totals),
            forwards=forwards if recorder.forwards == "one"
            and id(recorder.model) not in recorder.layer_of else 1,
            higher_order=recorder.higher_order)
        if isinstance(error, NoBackwardError):  # (nothing recorded because the forward met the
            # batch where it cannot be split: peft's LoKr, F.linear(x, kron(w1, w2)) of raw
            # parameters; that refusal names the cause)
            error = recorder.placement.refusal(read) or error
        if error is not None:
            raise error
        error = recorder.placement.refusal(read)
        if error is not None:
            raise error
        swapped = recorder.attachment.swapped
        if swapped is not None:
            raise GradientMismatchError(
                f"{read}: the model's forward ran with other tensors in place of its parameters "
                f"(module {swapped}): torch.func.functional_call(model, params, x) (or "
                f"torch.nn.utils.stateless) swaps them in, so autograd's gradients are those of "
                f"the tensors passed in, not of the parameters gradhooks hooks. Call the model "
                f"itself (load other values with model.load_state_dict(params) or "
                f"param.copy_() under torch.no_grad()), or compute per-sample gradients of "
                f"functional_call with torch.func.vmap(torch.func.grad(...))")
        scale = self.grad_scale()  # (read once: a scale seen on an accelerator syncs)
        if not self._scale_warned and recorder.grad_scaler is None and scale == 1.0:
            self._warn_scale(reached)
        records = tuple(reached if records is None else records)
        for record in records:
            record.check_unmodified(read)
        checking = sum_check and bool(recorder.check) and recorder.sum_check_state != "skip"
        key = None
        if checking:
            structure = self._structure()
            if recorder.sum_check_state == "due" or recorder.sum_check.read_due(structure):
                key = structure
                self._precision(reached)
        releasing = release and recorder.result is None  # (a kept result: nothing is formed)
        batch = Batch.of(recorder, records, key, checking, scale, releasing, groups)
        if releasing:
            recorder.released = True
        return batch

    def set_groups(self, sample_ids: Optional[Tensor]) -> None:
        """Declare which rows of the current batch make one sample (``gh.set_sample_ids``):
        rows sharing an id are one sample.

        For a sample made of several rows of one forward: TRL's DPO runs one forward of
        ``[chosen; rejected]`` (``P`` pairs, ``2P`` rows) and a pair is the sample (ids
        ``torch.arange(P).repeat(2)``); augmented views of one image; the options of one
        multiple-choice question; the nodes of one graph (the ``batch`` vector of a batch of
        graphs whose rows are nodes). Call it after the batch's forward and before its reads
        (before ``gh.backward`` / ``gh.clipped_backward`` too, whose loss checks then count
        samples); it holds for this batch only (the next batch starts without ids).

        **Conventions.** The ``G`` samples are the distinct ids in increasing order (sample
        ``k`` is the ``k``-th smallest id, whatever the order of the rows). Sample ``k``'s loss
        is the sum of its rows' terms; with ``loss_reduction="mean"`` the batch loss is the mean
        over the ``G`` samples, ``(1/G) sum_k l_k`` (results are multiplied by ``G``). Its
        per-sample gradient is the gradient of ``l_k``, the sum of its rows' gradients. Then
        (:data:`GROUPED_READS`):

        * ``per_sample_grads()``: ``{name: (G, *param.shape)}``;
        * ``per_sample_grad_norms()``: ``(G,)``, norms of each sample's summed gradient (not
          sums of its rows' norms: the Gram form takes the sample's rows as one sample whose
          weight-sharing positions are all its rows' positions);
        * ``clip_and_accumulate()``: clips each sample (``(G,)`` norms, ``D = G``; micro-batches
          count ``G`` samples each for ``finish_step``);
        * ``clipped_backward(losses)``: ``losses`` ``(G,)``, one per sample in id order;
        * ``sum_grad_squared()``, ``variance()``: over the ``G`` samples.

        Every other read (KFAC, EKFAC, Jacobians, GGN, Gram / NTK, gradient features,
        projections, the empirical Fisher, ``check_samples``) raises
        :class:`~gradhooks.base.errors.SampleIdsError` while ids are set (:meth:`groups`).

        Args:
            sample_ids: ``(B,)`` integer tensor (``torch.int64``; never float or bool) on the
                batch's device, one id per row of dim 0 of the forward's inputs; ``None``
                drops the ids.

        Raises:
            SampleIdsError: as :meth:`gradhooks.base.sample_groups.SampleGroups.of` (no forward
                yet, not a ``(B,)`` integer tensor on the batch's device); or
                ``per_sample_grads()`` already read this batch (also for ``None``). Ids set for a batch
                no read used (set before the forward they were meant for) are refused at the
                next batch's first read (:meth:`groups`).
        """
        recorder = self._recorder
        grouped = self._groups is not None and self._groups[0] == recorder.batch_id
        if sample_ids is None and not grouped:  # (none for this batch: nothing to drop)
            self._groups = None
            return
        if recorder.result is not None or recorder.released:
            raise SampleIdsError(
                f"set_sample_ids({'None' if sample_ids is None else 'ids'}): per_sample_grads() "
                f"already formed this batch's per-sample gradients "
                f"{'per sample' if grouped else 'row by row'}; declare the ids after the forward "
                f"and before the batch's first read")
        if sample_ids is None:
            self._groups = None
            return
        device = next((p.device for p in recorder.params.values()), None)
        groups = SampleGroups.of(sample_ids, recorder.batch_size, device)
        self._groups = (recorder.batch_id, groups, False)

    def declared_samples(self) -> Optional[int]:
        """``G`` where sample_ids were declared for the current batch, else ``None`` (never
        raises: the backward pass asks it to judge its loss's split over the samples)."""
        held = self._groups
        if held is None or held[0] != self._recorder.batch_id:
            return None
        return held[1].count

    def declared_ids(self) -> Optional[Tensor]:
        """``(B,)`` the sample (``0 .. G - 1``) of each row where sample_ids were declared for
        the current batch, else ``None`` (never raises)."""
        held = self._groups
        if held is None or held[0] != self._recorder.batch_id:
            return None
        return held[1].inverse

    def groups(self, read: str) -> Optional[SampleGroups]:
        """The :class:`~gradhooks.base.sample_groups.SampleGroups` the read ``read`` of the current
        batch takes (:meth:`set_groups`), or ``None`` (none declared for this batch).

        Raises:
            SampleIdsError: ids were declared for an earlier batch and no read of it used them
                (declared before the forward they were meant for: the batch started with that
                forward); or ``read`` is not one of :data:`GROUPED_READS` (it cannot group rows).
        """
        held = self._groups
        if held is None:
            return None
        batch_id, groups, used = held
        if batch_id != self._recorder.batch_id:
            self._groups = None
            if used:
                return None  # (the ids of an earlier batch, read there: not this batch's)
            raise SampleIdsError(
                f"{read}: sample_ids were declared for an earlier batch (its forward had run "
                f"when gh.set_sample_ids was called) and no read of that batch used them; the "
                f"current batch has none. Declare the ids after the forward of the batch they "
                f"describe: out = model(x); gh.set_sample_ids(ids); then the backward and reads")
        if read not in GROUPED_READS:
            raise SampleIdsError(
                f"{read}: sample_ids are set for this batch (gh.set_sample_ids: rows sharing an id "
                f"are one sample), and {read} cannot group rows into samples; it reads "
                f"{', '.join(GROUPED_READS)} only. Drop the ids (gh.set_sample_ids(None)) to read "
                f"it per row, or run it on a batch of one row per sample")
        if not used:
            self._groups = (batch_id, groups, True)
        return groups

    def samples(self, read: str = "per_sample_grads()") -> Optional[int]:
        """The number of samples of the current batch as ``read`` counts them: ``G`` with
        ``sample_ids`` (:meth:`groups`), else ``B`` (``None`` before the first forward)."""
        groups = self.groups(read)
        return self._recorder.batch_size if groups is None else groups.count

    def _precision(self, reached: List[Record]) -> None:
        # The sum check is due: the precision each reached module computes in, from its
        # parameters' gradients (checks.module_precision), for the tolerance of its parameters.
        totals, seen = self._recorder.totals, set()
        modules = []
        for record in reached:
            layer = record.layer
            if id(layer) not in seen:
                seen.add(id(layer))
                modules.append([totals.get(id(p)) for p in layer.params.values()])
        module_precision(modules)

    def _warn_scale(self, reached: List[Record]) -> None:
        # A float16 forward (autocast) is usually trained with a GradScaler; undeclared, its
        # scale S multiplies every result (the grad_outputs are S times the loss's).
        first = next((r for r in reached if r.low == torch.float16), None)
        if first is None:
            return
        self._scale_warned = True
        warnings.warn(
            f"the forward ran in float16 (module {first.layer.describe()} had float16 "
            f"grad_outputs, autocast) and attach() was given no grad_scaler: if the loss was "
            f"scaled (scaler.scale(loss).backward() with a torch.amp.GradScaler), every per-sample "
            f"result is scaled by the loss scale (65536 by default). Pass "
            f"gradhooks.attach(model, ..., grad_scaler=scaler), or call "
            f"gh.backward(scaler.scale(loss)), which reads the scale from the loss",
            LossScaleWarning, stacklevel=5)

    def see_scale(self, scale: Optional[Tensor]) -> None:
        """Note the scale tensor of a ``scaler.scale(loss)`` handed to ``gh.backward`` or
        ``gh.clipped_backward`` (:func:`gradhooks.readers.loss_reduction.loss_scale_of`; ``None``:
        none seen, an earlier one stays). A copy is kept (``scaler.update()`` changes the
        scaler's in place) and read only by :meth:`grad_scale` (on an accelerator, the read
        syncs as ``scaler.get_scale()`` does). Dropped with the batch."""
        if scale is not None:
            self.seen = scale.detach().clone()

    def grad_scale(self) -> float:
        """The loss scale ``S`` of the recorder's ``grad_scaler`` (its current ``get_scale()``,
        the one the last ``scaler.scale(loss).backward()`` used); without one, the scale seen on
        this batch's loss (:meth:`see_scale`) where :func:`is_loss_scale`; else ``1.0``: the
        recorded grad_outputs are ``S`` times those of the loss."""
        scaler = self._recorder.grad_scaler
        if scaler is not None:
            return float(scaler.get_scale()) if scaler.is_enabled() else 1.0
        if self.seen is None:
            return 1.0
        value = float(self.seen)
        if not is_loss_scale(value):
            return 1.0
        if not self._seen_warned:  # (the scale is recognised by its form: say so, once)
            self._seen_warned = True
            warnings.warn(
                f"gradhooks read a loss scale of {value:g} from the loss handed to gh.backward / "
                f"gh.clipped_backward (loss * a 0-dim float32 tensor holding a power of two: "
                f"GradScaler.scale's form), and reports the unscaled loss's results. If that "
                f"factor is part of your loss, not a GradScaler's, multiply by a Python number "
                f"instead; to declare the scaler (and silence this), pass "
                f"gradhooks.attach(model, ..., grad_scaler=scaler)", LossScaleWarning,
                stacklevel=5)
        return value

    def check_passed(self, key: tuple) -> None:
        """A read's sum check of structure ``key`` passed (:meth:`Batch.check_passed`): the
        policy counts it, and this batch's due check is done."""
        recorder = self._recorder
        recorder.sum_check.passed(key, recorder.drive_key)
        recorder.sum_check_state = None

    def _structure(self) -> tuple:
        # What the sum check's verdict depends on: the calls and backward passes each module
        # received, and the passes in which autograd reached each parameter.
        recorder = self._recorder
        calls = tuple((id(record.layer), record.names, record.hits)
                      for record in recorder.reached_records)
        return calls, tuple(sorted(recorder.param_passes.items()))
