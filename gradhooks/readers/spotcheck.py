"""The sample spot check: a few samples of the current batch recomputed alone.

The sum check (:mod:`gradhooks.readers.verify`) cannot see a loss or a model that mixes samples (an
InfoNCE loss over the batch, ``h - h.mean(0)`` inside the model, BatchNorm in training mode under
the fallback): the per-sample results then still add up to the batch gradient, but row ``n`` is
not the gradient of sample ``n``'s own loss. Such set-ups have no per-sample gradients; this
check finds them by the definition: for ``samples`` random rows ``n`` it runs the model on sample
``n`` alone (a batch of one, hooks paused), differentiates ``loss_fn`` of that output with
``torch.autograd.grad`` and compares with row ``n`` of :meth:`~gradhooks.GradHooks.per_sample_grads`.
Cost: ``samples`` forward and backward passes of one sample.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch
from torch import Tensor

from ..base.errors import GradientMismatchError
from ..base.utils import paused
from ..core.analysis import largest_difference, sample_rows
from ..core.recorder.capture import Recorder
from .per_sample import per_sample_grads

__all__ = ["check_samples", "SPOT_CHECK_RTOL"]

#: Relative tolerance of :func:`check_samples` per dtype, against the largest entry of the
#: parameter's two results: a batch of one rounds differently from the batch (and may break a
#: tie at a kink the other way); mixing samples gives errors of order 1.
SPOT_CHECK_RTOL = {torch.float64: 1e-6, torch.float32: 1e-2, torch.bfloat16: 1e-1,
                   torch.float16: 1e-1}

Batch = Union[Tensor, Sequence[Tensor]]


def check_samples(recorder: Recorder, loss_fn: Callable[..., Tensor], inputs: Batch, targets: Batch,
                  *, samples: int = 2, generator: Optional[torch.Generator] = None) -> None:
    """Recompute ``samples`` random samples of the current batch alone and compare.

    Args:
        recorder: the :class:`~gradhooks.core.recorder.capture.Recorder` of a :class:`~gradhooks.GradHooks`
            (called as ``gh.check_samples(...)``), after the batch's backward pass.
        loss_fn: ``loss_fn(model(*inputs_n), targets_n) -> scalar``, the batch loss as the
            training step computed it (reduced as ``loss_reduction`` says; a batch of one
            reduces the same either way).
        inputs: the batch's inputs, a tensor or a tuple of tensors batched on dim 0 (``model``
            is called as ``model(*inputs)``).
        targets: the batch's targets, a tensor or a tuple of tensors batched on dim 0.
        samples: how many rows to recompute (at most ``B``).
        generator: a ``torch.Generator`` (CPU) choosing the rows.

    Raises:
        GradientMismatchError: naming the first sample and parameter whose row differs from the
            recomputed gradient by more than :data:`SPOT_CHECK_RTOL` (relative to the largest
            entry): the loss or the model mixes samples, so per-sample gradients are not defined.
        SampleIdsError: ``sample_ids`` are set for the batch (rows are not its samples).
        The errors of :meth:`~gradhooks.GradHooks.per_sample_grads`.
    """
    recorder.reads.groups("check_samples()")  # (refuses sample_ids: it recomputes rows)
    result = per_sample_grads(recorder.snapshot("per_sample_grads()", release=True, result=True))
    batch = recorder.batch_size or 0
    if batch == 0 or samples < 1:
        return
    rows = torch.randperm(batch, generator=generator)[:samples].tolist()
    named = {name: p for name, p in recorder.model.named_parameters() if name in result}
    names, params = list(named), list(named.values())
    xs = (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)
    with paused(), torch.enable_grad():
        for n in rows:
            loss = loss_fn(recorder.model(*sample_rows(xs, n)), sample_rows(targets, n))
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            for name, alone in zip(names, grads):
                ours = result[name][n]
                alone = torch.zeros_like(ours) if alone is None else alone
                diff, scale = largest_difference(ours, alone)
                if diff > SPOT_CHECK_RTOL.get(ours.dtype, 1e-2) * scale + 1e-30:
                    raise GradientMismatchError(
                        f"sample {n} recomputed alone has another gradient for {name!r} than row "
                        f"{n} of the per-sample gradients (max difference {diff:.3g}, largest "
                        f"entry {scale:.3g}): the loss or the model mixes the samples of a batch "
                        f"(a loss over pairs of samples, batch statistics, h - h.mean(0)), so "
                        f"per-sample gradients are not defined for it. Compute the loss per "
                        f"sample, or use eval-mode / per-sample normalisation")
