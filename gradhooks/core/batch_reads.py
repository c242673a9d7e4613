"""How a reader gets a batch from a recorder: validated once, then handed over as a read-only
:class:`~gradhooks.core.records.Batch` snapshot (records, ``B``, the own-loss scale, the
``GradScaler``'s scale, whether the sum check is due).

The validation is the recorder's side of every read: records released by an earlier read, stale
(a backward after the release), none reached, a ``create_graph`` pass, a model changed since
the forward, a shared call refused by the placement, an input modified in place.
"""
from __future__ import annotations

import warnings
from typing import List, Optional

import torch

from ..base.errors import GradientMismatchError, LossScaleWarning
from .checks import refusal
from .records import Batch, Record

__all__ = ["BatchReads"]


class BatchReads:
    """The reads of one recorder's batches (``recorder``: the
    :class:`~gradhooks.core.capture.Recorder`, whose batch state it validates and whose sum check
    it keeps)."""

    def __init__(self, recorder):
        self._recorder = recorder
        self._scale_warned = False  # LossScaleWarning: once per attachment

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
        if not self._scale_warned and recorder.grad_scaler is None:
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
        releasing = release and recorder.result is None  # (a kept result: nothing is formed)
        batch = Batch.of(recorder, records, key, checking, self.grad_scale(), releasing)
        if releasing:
            recorder._released = True
        return batch

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
            f"gradhooks.attach(model, ..., grad_scaler=scaler)", LossScaleWarning, stacklevel=5)

    def grad_scale(self) -> float:
        """The loss scale ``S`` of the recorder's ``grad_scaler`` (its current ``get_scale()``,
        the one the last ``scaler.scale(loss).backward()`` used), or ``1.0``: the recorded
        grad_outputs are ``S`` times those of the loss."""
        scaler = self._recorder.grad_scaler
        if scaler is None or not scaler.is_enabled():
            return 1.0
        return float(scaler.get_scale())

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
