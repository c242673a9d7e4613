"""The per-sample gradient reader: ``{name: (B, *param.shape)}`` from a batch's records.

Each record is handed to its layer's rule (:meth:`~gradhooks.base.registry.LayerRule.per_sample_grads`,
the per-layer math of :mod:`gradhooks.rules`) by :func:`gradhooks.readers.canonical.call_grads` (kept
importable here), the ``loss_reduction`` scale of the batch snapshot
is applied to whichever of input, grad_output or result is smallest, calls of one parameter
(a layer called several times, tied weights) are summed, and the sum check
(:mod:`gradhooks.readers.verify`) runs when due.
"""
from __future__ import annotations

import functools
from typing import Dict

import torch
from torch import Tensor

from ..base._pool import using_pool
from ..base.errors import GradHooksError
from ..base.utils import no_autocast, tensors, tf32_products
from ..core.recorder.records import Batch
from .canonical import call_grads
from .verify import Evidence, check_unrecorded

__all__ = ["per_sample_grads", "call_grads", "carries_graph"]


def per_sample_grads(batch: Batch) -> Dict[str, Tensor]:
    """Per-sample gradients of every trainable parameter the backward reached (the reader
    behind :meth:`gradhooks.GradHooks.per_sample_grads`, whose docstring gives the arguments,
    the result ``{name: (B, *param.shape)}`` and the errors).

    Args:
        batch: ``recorder.snapshot(read, release=..., result=True)``: a result kept by an
            earlier read (:attr:`~gradhooks.core.recorder.records.Batch.result`) is returned as it is.

    With ``sample_ids`` (:attr:`~gradhooks.core.recorder.records.Batch.groups`) each parameter's rows are
    summed per sample (:meth:`~gradhooks.base.sample_groups.SampleGroups.sum_rows`): ``(G,
    *param.shape)``, samples in the order of the sorted unique ids, scaled by ``G`` for
    ``loss_reduction="mean"``.

    The result is kept by the recorder (:meth:`~gradhooks.core.recorder.records.Batch.keep`) until the next
    backward pass or batch, and set as ``param.grad_sample``. When the batch is
    :attr:`~gradhooks.core.recorder.records.Batch.releasing`, each record is released as soon as its rule has
    formed its part, so the read's peak memory is the result plus one layer's records.
    """
    if batch.result is not None:
        return batch.result
    raw: Dict[int, Tensor] = {}
    low: Dict[int, torch.dtype] = {}
    if batch.size == 0:  # an empty (Poisson) batch: (0, *shape), no rule runs
        for cap in batch.records:
            for local in cap.names:
                p = cap.layer.params[local]
                raw[id(p)] = p.new_zeros((0, *p.shape))
            if batch.releasing:
                batch.release(cap)
    differentiable = batch.differentiable and carries_graph(batch.records)
    with no_autocast(), tf32_products(batch.low), using_pool(batch.pool):
        for cap in batch.records if batch.size else ():
            layer = cap.layer
            try:  # (no local holds the records: a released cap frees them during the call)
                out = call_grads(layer.rule, layer.module, cap.a, cap.grads_arg(),
                                 batch.batch_first, cap.names, batch.scale,
                                 functools.partial(batch.release, cap) if batch.releasing
                                 else None, differentiable)
            except GradHooksError as e:
                if f"module {layer.describe()}" in str(e):  # (named by the rule)
                    raise
                raise type(e)(f"module {layer.describe()}: {e}") from None
            for local, t in out.items():
                pid = id(layer.params[local])
                if cap.low is not None:
                    low[pid] = cap.low
                if pid in raw:
                    raw[pid].add_(t)  # another call, or a tied module (rules return owned tensors)
                else:
                    raw[pid] = t
    check_unrecorded(batch, raw)
    if batch.groups is not None:  # rows sharing a sample id: one sample, its rows summed
        raw = {pid: batch.groups.sum_rows(t) for pid, t in raw.items()}
    evidence = Evidence(batch)
    if evidence.due and batch.size:
        for pid, t in raw.items():
            evidence.probe(pid, t, low.get(pid, t.dtype))
        evidence.judge(batch.scale)
    result = {}
    for pid in sorted(raw, key=batch.order.__getitem__):
        p = batch.params[pid]
        t = raw[pid]
        if t.dtype != p.dtype:
            t = t.to(p.dtype)
        result[batch.names[pid]] = t
        p.grad_sample = t
    return batch.keep(result)


def carries_graph(records) -> bool:
    """Whether any of the batch's records carries an autograd graph (``attach(...,
    differentiable=True)`` and a ``backward(create_graph=True)``): the read is differentiable."""
    return any(isinstance(t, Tensor) and t.requires_grad
               for cap in records for t in tensors((cap.a, cap.grads)))
