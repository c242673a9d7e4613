"""The loss check of ``gh.backward(loss)`` when rows of the batch are grouped into samples
(``gh.set_sample_ids``): the batch loss must be reduced over the ``G`` samples, not the ``B`` rows.

With ``sample_ids`` a sample's loss is the sum of its rows' terms, and ``loss_reduction="mean"``
reads the batch loss as ``(1/G) sum_k l_k``: a ``.mean()`` over the ``B`` rows (the default of
``F.cross_entropy``) would make every result ``G / B`` times the truth. :func:`check_backward_loss`
judges the loss as :func:`gradhooks.readers.loss_reduction.check_batch_loss` does, over the
``G`` samples, and with ids also refuses an unscaled mean over the ``B`` rows.
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from ..base.errors import UnsupportedLossError
from ..core.analysis import Split, rows_mean_message
from .loss_reduction import _MEAN, _read, check_batch_loss, loss_scale_of
from .sample_check import SampleCheck

__all__ = ["check_backward_loss", "judged_backward"]


def check_backward_loss(loss: Tensor, recorder, gradient: Optional[Tensor]) -> Optional[Split]:
    """Refuse a loss handed to ``gh.backward`` that is not the declared reduction over the
    batch's samples (:func:`~gradhooks.readers.loss_reduction.check_batch_loss` with ``G``, the
    number of samples, with ``sample_ids``), or, with ``sample_ids`` grouping ``B`` rows into
    ``G < B`` samples, a mean over the ``B`` rows not scaled further.

    Args:
        loss: the tensor handed to :meth:`gradhooks.GradHooks.backward`.
        recorder: its :class:`~gradhooks.core.recorder.capture.Recorder` (batch size, ``sample_ids``).
        gradient: the ``gradient`` argument (given: no check).

    Raises:
        UnsupportedLossError: as :func:`~gradhooks.readers.loss_reduction.check_batch_loss`, or
            the mean over rows above.
        SampleIdsError: ids declared for an earlier batch that no read used.
    """
    rows = recorder.batch_size
    samples = recorder.reads.samples()
    split = check_batch_loss(loss, samples, recorder.loss_reduction, gradient,
                             recorder.placement.mixing.tokens, recorder.grad_scaler)
    if (gradient is not None or not rows or samples == rows or not isinstance(loss, Tensor)
            or loss.dim() != 0):
        return split
    found = _read(loss, rows, broadcast=False)
    if found is not None and found[2] == _MEAN and found[1] == 1.0:
        raise UnsupportedLossError(rows_mean_message(type(found[0]).__name__, rows, samples,
                                                     "gh.backward(loss)"))
    return split


def judged_backward(recorder, loss: Tensor, gradient: Optional[Tensor],
                    retain_graph: bool) -> None:
    """The backward pass of :meth:`gradhooks.GradHooks.backward` on ``loss``, judged first
    (:func:`check_backward_loss`; the GradScaler's scale:
    :func:`~gradhooks.readers.loss_reduction.loss_scale_of`) and counted in the pass where its
    split is not proven (``recorder``: the :class:`~gradhooks.core.recorder.capture.Recorder`).

    Where the loss holds per-sample losses, the sample check through the batched graph
    (:class:`~gradhooks.readers.sample_check.SampleCheck`) is taken around the pass; where it
    holds none, the loss's graph after the model must prove its split
    (:mod:`gradhooks.core.analysis.loss_graph`), or the batch's reads refuse it.

    Raises:
        UnsupportedLossError: as :func:`check_backward_loss`.
        SampleMixingError: the sample check failed: the forward or the loss pairs samples."""
    split = check_backward_loss(loss, recorder, gradient)
    recorder.reads.see_scale(loss_scale_of(loss))
    samples = recorder.reads.samples()
    form = SampleCheck.form(recorder, loss, gradient, samples)
    check = SampleCheck.before(recorder, loss, gradient, samples, form)
    # the loss's graph proves its split where it holds no per-sample losses; where it does, an
    # op it shows to pair samples is refused too, whatever the sample check's two rows show
    recorder.backward_pass.judge_graph((loss,), mixing_only=form is not None)
    with recorder.backward_pass.expecting(split):
        recorder.drive(loss, gradient, retain_graph)
    if check is not None:
        check.judge_records()
