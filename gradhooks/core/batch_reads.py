"""How a reader gets a batch from a recorder: validated once, then handed over as a read-only
:class:`~gradhooks.core.records.Batch` snapshot (records, ``B``, the own-loss scale, the
``GradScaler``'s scale, whether the sum check is due).

The validation is the recorder's side of every read: records released by an earlier read, stale
(a backward after the release), none reached, a ``create_graph`` pass, a model changed since
the forward, a shared call refused by the placement, an input modified in place.
"""
from __future__ import annotations

import math
import warnings
from typing import List, Optional

import torch
from torch import Tensor

from ..base.errors import GradientMismatchError, LossScaleWarning
from .checks import refusal
from .records import Batch, Record

__all__ = ["BatchReads", "is_loss_scale"]


def is_loss_scale(value: float) -> bool:
    """Whether ``value`` can be a ``torch.amp.GradScaler``'s scale as gradhooks reads one seen on
    a loss: a power of two of at least 2 (its ``init_scale`` times powers of its growth and
    backoff factors, 2 and 1/2 by default)."""
    return math.isfinite(value) and value >= 2.0 and math.frexp(value)[0] == 0.5


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
        releasing = release and recorder.result is None  # (a kept result: nothing is formed)
        batch = Batch.of(recorder, records, key, checking, scale, releasing)
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
