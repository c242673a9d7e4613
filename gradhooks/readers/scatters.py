"""Row scatters (an embedding's per-sample gradient, :class:`~gradhooks.base.forms.Rows`) and weights
tied between a row scatter and a linear form (GPT-2's token embedding and LM head): the pieces of
their per-sample squared norms and sum checks, without a ``(N, V, D)`` tensor. Tensors in, tensors
out; :mod:`gradhooks.readers.plan` decides when they are used.

Index conventions: ``n`` sample (``N``), ``j`` entry of a scatter (``E`` of them; per sample
after :func:`by_sample`), ``s`` position, ``v`` row of the ``(V, D)`` table. ``p``, the
parameter's plan (:class:`~gradhooks.readers.plan.PlannedParam`), is read for its ``pid``, ``name`` and
``entries`` (``[(record, local name)]``).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..base.forms import Rows, sq_norms
from ..base.utils import compute_dtype
from ..core.recorder.records import Batch
from .canonical import canonical_call
from .verify import no_total

__all__ = ["rows_of", "rows_sq_norms", "rows_probed", "tied_linear", "by_sample", "tied_cross"]


def rows_of(batch: Batch, p) -> Rows:
    """The :class:`~gradhooks.base.forms.Rows` of the parameter planned as ``p`` over all its
    row-scatter calls (entries concatenated: calls of one table add up; the linear-form calls of a
    tied weight are skipped), unscaled, values in the computation dtype (at least float32)."""
    parts = []
    for cap, local in p.entries:
        layer = cap.layer
        if not layer.rule.has_rows:  # the linear-form calls of a TIED weight
            continue
        parts.append(layer.rule.rows(layer.module, cap.a, cap.grads_arg(), batch.batch_first,
                                     [local])[local])
    if len(parts) == 1:
        return parts[0]
    dt = compute_dtype(*(r.values for r in parts))
    return Rows(torch.cat([r.sample for r in parts]), torch.cat([r.row for r in parts]),
                torch.cat([r.values.to(dt) for r in parts]))


def rows_sq_norms(r: Rows, batch: int, num_rows: int) -> Tensor:
    """``(N,)`` squared per-sample norms of a row-scatter gradient (:class:`Rows`): the entries
    summed per ``(sample, row)`` pair (one sort of the ``E`` pair keys and an ``index_add``),
    then their squared norms summed per sample; ``O(E (D + log E))``, no ``(N, V, D)`` tensor."""
    key = r.sample * num_rows + r.row
    pairs, which = torch.unique(key, return_inverse=True)
    sums = r.values.new_zeros(pairs.shape[0], r.values.shape[1]).index_add_(0, which, r.values)
    return r.values.new_zeros(batch).index_add_(0, pairs // num_rows, sq_norms(sums, 1))


def rows_probed(batch: Batch, p, r: Rows) -> tuple:
    """The sum-check item (:func:`~gradhooks.readers.verify.check_sums`) of a row-scatter parameter:
    its per-sample gradients at the probe coordinates ``(N, K)``, formed for the probed rows only
    (at most one per probe) instead of all ``V``.

    Returns:
        ``(name, (N, K) values, (K,) autograd's values, dtype for the tolerance)``.

    Raises:
        GradientMismatchError: autograd computed no gradient for the parameter
            (:func:`~gradhooks.readers.verify.no_total`).
    """
    total = batch.totals.get(p.pid)
    if total is None:
        raise no_total(p.name)
    shape = batch.params[p.pid].shape
    idx = total.probe_index()
    width = shape.numel() // shape[0]
    prow, pcol = idx // width, idx % width
    rows, slot = torch.unique(prow, return_inverse=True)  # the R probed rows
    pos = torch.full((shape[0],), -1, dtype=torch.long, device=idx.device)
    pos[rows] = torch.arange(rows.shape[0], device=idx.device)
    at = pos[r.row]
    keep = at >= 0
    n_rows = rows.shape[0]
    acc = r.values.new_zeros(batch.size * n_rows, r.values.shape[1])
    acc.index_add_(0, r.sample[keep] * n_rows + at[keep], r.values[keep])
    low = next((cap.low for cap, _ in p.entries if cap.low is not None), r.values.dtype)
    return p.name, acc.view(batch.size, n_rows, -1)[:, slot, pcol], total.probe_values(), low


def tied_linear(batch: Batch, p) -> Optional[Tuple[Tensor, Tensor, Tensor, Tensor]]:
    """The linear-form calls of a :data:`~gradhooks.readers.plan.TIED` parameter ``p`` (its plan),
    positions concatenated: canonical ``a`` ``(N, 1, S, I)``, ``g`` ``(N, 1, S, O)`` (unscaled,
    in the computation dtype), and the same as ``p`` ``(N, S, R)``, ``q`` ``(N, S, C)`` with the
    parameter's rows ``R`` first, so that sample ``n``'s gradient of these calls is ``sum_s p[n, s]
    q[n, s]^T`` ``(R, C)`` (``p = g``, ``q = a``; swapped for a weight stored transposed,
    ``(I, O)``: transformers' ``Conv1D``). ``None`` without calls."""
    calls = [(cap, canonical_call(cap, batch.batch_first)) for cap, _ in p.entries
             if not cap.layer.rule.has_rows]
    if not calls:
        return None
    dt = compute_dtype(*(t for _, call in calls for t in call))
    if len(calls) == 1:  # (no copy: an LM head's g is (N, 1, S, V), 411 MB for GPT-2 at 16 x 128)
        a, g = (t.to(dt) for t in calls[0][1])
    else:
        a = torch.cat([c[0].to(dt) for _, c in calls], 2)
        g = torch.cat([c[1].to(dt) for _, c in calls], 2)
    pp, qq = a[:, 0], g[:, 0]
    if not calls[0][0].layer.rule.weight_transposed:
        pp, qq = qq, pp
    return a, g, pp, qq


def by_sample(r: Rows, batch: int) -> Tuple[Tensor, Tensor]:
    """A row scatter's entries laid out per sample, zero-padded to the largest count ``E``:
    rows ``(N, E)`` int64 (0 where padded) and values ``(N, E, D)`` (0 where padded)."""
    counts = torch.bincount(r.sample, minlength=batch)
    width = int(counts.max()) if r.sample.numel() else 0
    order = torch.argsort(r.sample, stable=True)
    sample = r.sample[order]
    starts = torch.cumsum(counts, 0) - counts  # int64 throughout: counts never pass a float
    slot = torch.arange(sample.shape[0], device=sample.device) - starts[sample]
    rows = r.row.new_zeros(batch, width)
    rows[sample, slot] = r.row[order]
    values = r.values.new_zeros(batch, width, r.values.shape[1])
    values[sample, slot] = r.values[order]
    return rows, values


def tied_cross(r: Rows, p: Tensor, q: Tensor) -> Tensor:
    """``(N,)`` inner products ``<R_n, L_n>`` of a tied weight's two per-sample parts: the row
    scatter ``R_n`` (:class:`~gradhooks.base.forms.Rows`, the input embedding) and the linear-form
    gradient ``L_n = sum_s p[n, s] q[n, s]^T`` (``p`` ``(N, S, V)``, ``q`` ``(N, S, D)``: the
    output projection, :func:`tied_linear`), without forming either ``(N, V, D)`` tensor::

        <R_n, L_n> = sum_{j: sample_j = n} values_j . L_n[row_j]
                   = sum_{j, s} p[n, s, row_j] (q[n, s] . values_j)

    (the Gram form of Li et al. 2022, arXiv:2110.05679, sec. 4, between the one-hot inputs of
    the embedding and the output projection's grad_outputs). Cost ``N S E D`` multiply-adds for
    ``E`` entries per sample (GPT-2 small, T = 128: 1.6 G for B = 16, against 79 G for one
    materialised ``(B, V, D)`` gradient)."""
    n = p.shape[0]
    rows, values = by_sample(r, n)
    picked = p.gather(2, rows.unsqueeze(1).expand(n, p.shape[1], rows.shape[1]))  # (N, S, E)
    return (q @ values.to(q.dtype).transpose(1, 2)).mul_(picked).view(n, -1).sum(1)
