"""First-order statistics of the per-sample gradients (BackPACK's ``SumGradSquared`` and
``Variance``), read from the per-sample reader's result.
"""
from __future__ import annotations

from typing import Dict

import torch
from torch import Tensor

from ..core.recorder.records import Batch
from .per_sample import per_sample_grads

__all__ = ["sum_grad_squared", "variance"]


def sum_grad_squared(batch: Batch) -> Dict[str, Tensor]:
    """Sum over the batch of the squared per-sample gradients (BackPACK's ``SumGradSquared``).

    Convention: the per-sample gradients are those of :meth:`~gradhooks.GradHooks.per_sample_grads`, the
    gradients ``d l_n`` of each sample's *own* loss, whatever the loss reduction::

        sgs[theta] = sum_n (d l_n / d theta)^2

    For ``loss_reduction="sum"`` this equals BackPACK's ``SumGradSquared``; for ``"mean"`` it is
    ``N^2`` times BackPACK's, which squares the ``(1/N)``-scaled contributions to the batch
    gradient. We follow the own-loss convention so that the value does not depend on the
    reduction or the batch size, like every other per-sample quantity of gradhooks. The
    diagonal of the empirical Fisher of the loss as reduced (the convention of
    :func:`gradhooks.readers.curvature.kfac.kfac_factors`) is ``sgs / N`` for ``"mean"`` and ``sgs`` for ``"sum"``.

    Args:
        batch: ``recorder.snapshot("sum_grad_squared()", release=True, result=True)``, as
            :func:`gradhooks.readers.per_sample.per_sample_grads` reads it.

    Returns:
        ``{name: (*param.shape)}`` for the parameters of :meth:`~gradhooks.GradHooks.per_sample_grads`
        (every hooked layer type, not only Linear / Conv).

    Raises:
        The errors of :meth:`~gradhooks.GradHooks.per_sample_grads` (e.g. ``NoBackwardError``).
    """
    return {name: (g * g).sum(0) for name, g in per_sample_grads(batch).items()}


def variance(batch: Batch) -> Dict[str, Tensor]:
    """Per-parameter variance of the per-sample gradients over the batch (BackPACK's ``Variance``).

    Convention: the population variance (``1/N``, as BackPACK) of the own-loss per-sample
    gradients of :meth:`~gradhooks.GradHooks.per_sample_grads`::

        var[theta] = 1/N sum_n (d l_n/d theta - mean_m d l_m/d theta)^2

    Equal to BackPACK's ``Variance`` for ``loss_reduction="sum"``; ``N^2`` times it for
    ``"mean"`` (BackPACK takes the variance of the ``(1/N)``-scaled contributions). Computed
    around the mean (two passes), not as ``E[g^2] - E[g]^2``, which cancels catastrophically.

    Args:
        batch: as :func:`sum_grad_squared`'s.

    Returns:
        ``{name: (*param.shape)}``; zeros for a batch of one, NaN for an empty one (no mean).

    Raises:
        The errors of :meth:`~gradhooks.GradHooks.per_sample_grads` (e.g. ``NoBackwardError``).
    """
    return {name: torch.var(g, dim=0, correction=0) for name, g in per_sample_grads(batch).items()}
