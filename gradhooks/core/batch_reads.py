"""How a reader gets a batch from a recorder: validated once, then handed over as a read-only
:class:`~gradhooks.core.records.Batch` snapshot (records, ``B``, the own-loss scale, the
``GradScaler``'s scale, whether the sum check is due).

The validation is the recorder's side of every read (:func:`refusal`, then the placement's and
the records' own): records released by an earlier read, stale (a backward after the release),
none reached, a ``create_graph`` pass, a model changed since the forward, a shared call refused
by the placement, an input modified in place. Where the sum check is due, the snapshot also
reads the precision each module computes in off its parameters' gradients
(:func:`~gradhooks.core.checks.module_precision`), for the check's tolerance.
"""
from __future__ import annotations

import math
import warnings
from typing import List, Optional

import torch
from torch import Tensor

from ..base.errors import (GradHooksError, GradientMismatchError, HigherOrderGradError,
                           LossScaleWarning, NoBackwardError, RecordsReleasedError)
from .checks import module_precision
from .records import Batch, Record

__all__ = ["BatchReads", "is_loss_scale", "refusal"]


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
            f"and the per-sample results sum over the forwards. Otherwise (different samples in "
            f"each forward, or negatives drawn from other samples) run one forward per backward: "
            f"concatenate the inputs, model(torch.cat([x1, x2])), and split the output")
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
    :class:`~gradhooks.core.capture.Recorder`, whose batch state it validates and whose sum check
    it keeps)."""

    def __init__(self, recorder):
        self._recorder = recorder
        self._scale_warned = False  # LossScaleWarning: once per attachment
        self._seen_warned = False  # the same, for a scale read from the loss
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
                :attr:`~gradhooks.core.records.Batch.result`, without validation (as the result was
                validated when formed).

        Raises:
            RecordsReleasedError: if an earlier read released the records (or one that did
                failed), or a backward pass reached the hooked layers after that.
            NoBackwardError: if no backward pass reached a hooked layer in this batch.
            HigherOrderGradError: if a backward pass with ``create_graph=True`` did.
            BatchSizeError: if a shared call's output met the batch where it cannot be split
                per sample (:meth:`gradhooks.core.placement.Placement.refusal`).
            GradientMismatchError: if a recorded input was modified in place since its forward.
        """
        recorder = self._recorder
        if result and recorder._released and recorder.result is not None:
            return Batch.of(recorder, (), None, False, self.grad_scale())
        reached = recorder._records
        # (A model that is itself a hooked layer, a cell called per time step, is a layer
        # called several times: its calls see the same samples.)
        forwards = len({record.forward for record in reached})
        error = refusal(
            read, attached=recorder._attached, changed=recorder.attachment.changed,
            stale=recorder._stale, released=recorder._released, reached=len(reached),
            calls=recorder._calls, backward_reached_params=bool(recorder.totals),
            forwards=forwards if recorder.forwards == "one"
            and id(recorder.model) not in recorder._layer_of else 1,
            higher_order=recorder._higher_order)
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
        checking = sum_check and bool(recorder.check) and recorder._sum_check != "skip"
        key = None
        if checking:
            structure = self._structure()
            if recorder._sum_check == "due" or recorder.sum_check.read_due(structure):
                key = structure
                self._precision(reached)
        releasing = release and recorder.result is None  # (a kept result: nothing is formed)
        batch = Batch.of(recorder, records, key, checking, scale, releasing)
        if releasing:
            recorder._released = True
        return batch

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
        recorder.sum_check.passed(key, recorder._drive_key)
        recorder._sum_check = None

    def _structure(self) -> tuple:
        # What the sum check's verdict depends on: the calls and backward passes each module
        # received, and the passes in which autograd reached each parameter.
        recorder = self._recorder
        calls = tuple((id(record.layer), record.names, record.hits)
                      for record in recorder._records)
        return calls, tuple(sorted(recorder._param_passes.items()))
