"""Weighted sums of the per-sample gradients from the records, none materialised: the clipped
sum of book-keeping ghost clipping (Bu et al. 2023, arXiv:2210.00038, sec. 3; Li et al. 2022,
arXiv:2110.05679, sec. 4), the weighted-sums step of
:func:`gradhooks.readers.dp.clipping.clip_and_accumulate`; and the random-sign sums of the sample
check (:mod:`gradhooks.readers.sample_check`).

Index conventions: ``n`` sample (``N``), ``s`` shared position, ``c_n`` the clipping factor
(weight) of sample ``n``; ``a: (N, S, I)`` and ``g: (N, S, O)`` a block's recorded inputs and
grad_outputs (:mod:`gradhooks.base.forms`)::

    sum_n c_n dW_n = sum_{n,s} (c_n g[n,s]) a[n,s]^T     (one matmul / one conv weight-backward)
    sum_n c_n db_n = sum_{n,s} c_n g[n,s]
"""
from __future__ import annotations

from typing import Dict, Optional, Union

import torch
from torch import Tensor

from ..core.recorder.capture import Batch
from .canonical import call_grads, summed
from .distributed import is_sharded
from .plan import CLOSED, FORMS, GENERIC, GRAM, ROWS, TIED, Forms, PlannedParam, factored

__all__ = ["ghost_sums"]


def _no_dest(pid: int, dtype: torch.dtype) -> Optional[Tensor]:
    return None


def _forms_weighted(batch: Batch, p: PlannedParam, forms: Forms, c: Tensor, dest=_no_dest) -> Tensor:
    """``sum_n c_n d(param)_n`` of a parameter in factored form: per block one matmul
    ``sum_{n,s} (c_n g[n,s]) a[n,s]^T`` (or ``sum_{n,s} c_n g[n,s]``), rows concatenated;
    written into ``dest(id(param), dtype)`` when that gives a tensor (one block only)."""
    shape = batch.params[p.pid].shape
    blocks = forms.blocks(p)
    if blocks is None:
        t = forms.materialised(p, shape)
        return torch.tensordot(c.to(t.dtype), t, 1)
    if not blocks:  # no backward reached this path of the layer
        return torch.zeros(shape, dtype=c.dtype, device=c.device)
    parts = []
    for b in blocks:
        cw = c.to(b.g.dtype)
        if b.a is None:
            parts.append((b.g.sum(1).t(), cw))  # (O, N) @ (N,)
            continue
        if b.a.numel() < b.g.numel():  # weigh the smaller (the sum is linear in both)
            a, g = b.a * cw.view(-1, 1, 1), b.g
        else:
            a, g = b.a, b.g * cw.view(-1, 1, 1)
        if a.stride(0) < a.stride(1) and g.stride(0) < g.stride(1):
            # stored position-major (a recurrent replay's (T, B, .)): the sum over (n, s) does
            # not care for the order, and flattening that way needs no copy
            a, g = a.transpose(0, 1), g.transpose(0, 1)
        parts.append((g.reshape(-1, g.shape[-1]).t(), a.reshape(-1, a.shape[-1])))
    if len(parts) == 1:
        m, v = parts[0]
        into = dest(p.pid, m.dtype)
        if into is not None:
            into = into.view(m.shape[0], *v.shape[1:])
        return torch.matmul(m, v, out=into).view(shape)
    return torch.cat([(m @ v).reshape(m.shape[0], -1) for m, v in parts], 0).reshape(shape)


def ghost_sums(batch: Batch, plans: Dict[int, PlannedParam], c: Union[Tensor, Dict[int, Tensor]],
                assign, forms: Forms, into_grad: bool = True) -> None:
    """``sum_n c_n d(param)_n`` (unscaled per-sample gradients) for each parameter, ``c`` one
    ``(N,)`` weight vector or one per parameter id (group-wise clipping), from the
    records: :meth:`~gradhooks.base.registry.LayerRule.weighted_sum` for rules with a linear form
    (Linear, Conv), one matmul per block for factored forms, one ``index_add`` for row
    scatters, one materialised layer at a time otherwise. Calls
    ``assign(pid, sum)`` as soon as a parameter's sum is complete (so that its old ``.grad`` can
    be freed before the next layer is processed). Linear weights and biases and single-block
    factored forms are written straight into the parameter's ``.grad`` when it has the
    parameter's shape, the computation's dtype and a contiguous layout (no second tensor of the
    parameter's size: ghost clipping's peak stays at plain training's); with ``into_grad=False``
    (the sample check) no ``.grad`` is touched.

    Args:
        batch: the records (:class:`~gradhooks.core.recorder.capture.Batch`), ``N`` rows.
        plans, forms: the norm plan and its forms (:func:`~gradhooks.readers.plan.plan`,
            :class:`~gradhooks.readers.plan.Forms`), after the norms were formed (the forms are
            consumed).
        c: ``(N,)`` weights, or ``{id(param): (N,)}``.
        assign: ``assign(id(param), sum)``, ``sum`` of the parameter's shape.
        into_grad: whether a parameter's ``.grad`` may be reused as the output.
    """
    # a TIED weight's row scatters count as one contribution, added last (in place)
    left = {pid: len(p.entries) if p.kind != TIED
            else 1 + sum(not cap.layer.rule.has_rows for cap, _ in p.entries)
            for pid, p in plans.items()}
    partial: Dict[int, Tensor] = {}
    offered: set = set()
    weights = (lambda pid: c) if isinstance(c, Tensor) else c.__getitem__

    def dest(pid: int, dtype: torch.dtype) -> Optional[Tensor]:
        # The parameter's current .grad, for its first contribution only (later ones add to it).
        if pid in offered or not into_grad:
            return None
        offered.add(pid)
        grad = batch.params[pid].grad
        if (grad is None or is_sharded(grad) or grad.dtype != dtype
                or grad.layout != torch.strided or grad.shape != batch.params[pid].shape
                or not grad.is_contiguous()):
            return None
        return grad

    def add(pid: int, t: Tensor) -> None:  # ``t`` is a new tensor
        if pid in partial:
            t = partial.pop(pid).add_(t)
        left[pid] -= 1
        if left[pid]:
            partial[pid] = t
        else:
            assign(pid, t)

    kept = forms.kept  # materialised for the norms and kept (Forms.offer): one tensordot each
    for pid in list(kept):
        t = kept.pop(pid)
        into = dest(pid, t.dtype)  # (into the existing .grad where it fits, as below)
        assign(pid, torch.tensordot(weights(pid).to(t.dtype), t, 1, out=into))
        left[pid] = 0
        del t
    for pid, p in plans.items():
        if p.kind == FORMS:
            assign(pid, _forms_weighted(batch, p, forms, weights(pid), dest))
        elif p.kind == ROWS:  # sum_n c_n d(param)_n: one index_add of the weighted entries
            r = forms.rows(p)
            out = r.values.new_zeros(batch.params[pid].shape)
            cw = weights(pid).to(r.values.dtype)
            assign(pid, out.index_add_(0, r.row, r.values * cw[r.sample, None]))
    tied = {pid: forms.rows(p) for pid, p in plans.items() if p.kind == TIED}  # (the norms')
    forms.calls.clear()
    forms.joined.clear()
    forms.scatters.clear()
    for cap in batch.records:
        layer = cap.layer
        names = [n for n in cap.names if left[id(layer.params[n])]]  # (kept ones are done)
        kinds = [plans[id(layer.params[n])].kind for n in names]
        closed = [n for n, k in zip(names, kinds)
                  if k in (GRAM, CLOSED) or (k == TIED and not layer.rule.has_rows)]
        generic = [n for n, k in zip(names, kinds) if k == GENERIC]
        if generic and factored(cap, plans[id(layer.params[generic[0]])]):
            pid = id(layer.params[generic[0]])  # (a grouped product's weight: one contraction)
            offered.add(pid)
            add(pid, cap.grads[0].weighted(weights(pid)))
            generic = []
        if closed:
            a, g = summed(cap)
            dt = a.dtype
            by_weights: Dict[int, list] = {}  # the call's parameters by their weight vector
            for n in closed:
                by_weights.setdefault(id(weights(id(layer.params[n]))), []).append(n)
            for names in by_weights.values():
                into = {n: dest(id(layer.params[n]), dt) for n in names}
                sums = layer.rule.weighted_sum(
                    layer.module, a, g, weights(id(layer.params[names[0]])).to(dt),
                    batch.batch_first, names, {n: t for n, t in into.items() if t is not None})
                for local, t in sums.items():
                    add(id(layer.params[local]), t)
            del a, g
        if generic:
            out = call_grads(layer.rule, layer.module, cap.a, cap.grads_arg(), batch.batch_first,
                             generic, None)
            for local, t in out.items():
                pid = id(layer.params[local])
                offered.add(pid)
                add(pid, torch.tensordot(weights(pid).to(t.dtype), t, 1))
    for pid, r in tied.items():  # the output projections' sum so far, plus the rows' index_add
        out = partial.pop(pid)
        cw = weights(pid).to(r.values.dtype)
        out.index_add_(0, r.row, (r.values * cw[r.sample, None]).to(out.dtype))
        assign(pid, out)
