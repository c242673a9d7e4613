"""The norms reader: per-sample gradient norms without materialising the per-sample gradients.

A Linear or Conv call in the canonical form of :mod:`gradhooks.readers.canonical` computes
``y[n,g,s] = W[g] a[n,g,s] + b[g]``, so sample ``n``'s gradient is ``dW_n[g] = sum_s g[n,g,s]
a[n,g,s]^T``, with ``g`` the recorded grad_output (for ``loss_reduction="mean"`` multiplied by
``B``, the gradient of the sample's own loss, as in :meth:`~gradhooks.GradHooks.per_sample_grads`).
Its squared norm is formed without ``dW_n`` where that is cheaper, in the Gram form ("ghost
norm")::

    ||dW_n||^2 = sum_g sum_{s,t} (a[n,g,s] . a[n,g,t]) (g[n,g,s] . g[n,g,t])

(Goodfellow 2015, arXiv:1510.01799, for ``S = 1``; Li et al. 2022, arXiv:2110.05679, sec. 4, for
``S > 1``); factored forms (recurrent layers, attention) block by block, row scatters
(embeddings) per ``(sample, row)`` pair, tied input / output embeddings with their cross term,
every other layer materialised one layer at a time. Which form each parameter takes, the cost
model and its measurements, and the sum checks are :mod:`gradhooks.readers.plan`'s (:func:`plan`,
:func:`use_gram`, :func:`squared_norms`, also used by :mod:`gradhooks.readers.dp.clipping`); this module
reads a batch with them and scales the result.

**Checks.** As :meth:`~gradhooks.GradHooks.per_sample_grads` does (``check=True``: on each new
call structure and every 100th read; ``check="always"``: every read; ``check=False``: never),
the per-sample gradients must sum to the gradient autograd computed (a parameter also used
outside its module would otherwise get a silently wrong norm and an unclipped share).
"""
from __future__ import annotations

from typing import Dict, Union

from torch import Tensor

from ..base.utils import compute_dtype, no_autocast, tf32_products
from ..core.recorder.records import Batch
from .plan import Forms, add_up, plan, result_sq_norms, squared_norms
from .verify import Evidence

__all__ = ["per_sample_grad_norms"]


def per_sample_grad_norms(batch: Batch, *, per_param: bool = False) -> Union[Tensor, Dict[str, Tensor]]:
    """L2 norms of the per-sample gradients over all trainable parameters the backward reached,
    without materialising them where a cheaper closed form exists.

    Args:
        batch: ``recorder.snapshot("per_sample_grad_norms()", result=True)`` (called as
            ``gh.per_sample_grad_norms()``).
        per_param: if ``True`` return the norm of each parameter's per-sample gradient instead.

    Returns:
        ``(B,)``: ``||dtheta_n||_2`` over the concatenation of all trainable parameters the
        backward passes of this batch reached (frozen and unreached parameters contribute 0);
        ``dtheta_n`` is what :meth:`~gradhooks.GradHooks.per_sample_grads` returns for sample
        ``n`` (for ``loss_reduction="mean"`` the gradient of the sample's own loss, i.e. ``B``
        times the recorded one). With ``per_param=True``: ``{name: (B,)}`` in the order of
        ``model.named_parameters()`` (a tied parameter once). Dtype: the promoted dtype of the
        records, at least float32. Linear/Conv weights use the Gram form when cheaper (Li et al.
        2022, arXiv:2110.05679, sec. 4), other parameters are materialised one layer at a time;
        see the module docstring. Not cached: each call recomputes. After
        :meth:`~gradhooks.GradHooks.per_sample_grads` released the records (its default), the
        norms of its result.

    Raises:
        NoBackwardError: if no backward pass reached a hooked layer since the batch started.
        HigherOrderGradError: if a backward pass ran with ``create_graph=True`` through a hooked
            layer.
        GradientMismatchError: if a recorded input was modified in place, or (``check=True``)
            the per-sample gradients do not sum to autograd's gradient.
    """
    if batch.released:  # per_sample_grads() formed the result and released the records
        sq_of = result_sq_norms(batch.result)
        if per_param:
            return {name: t.sqrt_() for name, t in sq_of.items()}
        return add_up(sq_of.values()).sqrt_()
    if batch.size == 0:  # an empty (Poisson) batch
        empty = {batch.names[pid]: p.new_zeros(0, dtype=compute_dtype(p))
                 for pid, p in batch.params.items() if p.requires_grad}
        return empty if per_param else next(iter(empty.values()))
    plans, units = plan(batch)
    with no_autocast(), tf32_products(batch.low):
        evidence = Evidence(batch)
        sq = squared_norms(batch, plans, units, Forms(batch, plans), evidence)
        evidence.judge()
    if per_param:
        return {p.name: sq[pid].sqrt().mul_(batch.factor) for pid, p in plans.items()}
    return add_up(sq.values()).sqrt_().mul_(batch.factor)
