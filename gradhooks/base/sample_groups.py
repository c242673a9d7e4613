"""Samples made of several rows of the batch: :class:`SampleGroups`, from ``sample_ids``.

A batch's rows are the samples unless the user declares ``sample_ids`` (``(B,)``, one integer id
per row of dim 0 of the top-level inputs, :meth:`gradhooks.GradHooks.set_sample_ids`): rows that
share an id are then one sample -- a concatenated ``[chosen; rejected]`` forward (TRL's DPO, ids
``cat([arange(P), arange(P)])``), augmented views of one image, the options of a multiple-choice
question, the nodes of one graph. The ``G`` samples are the sorted unique ids; sample ``k`` is
the ``k``-th smallest id.

Index conventions: ``n`` row (``B``), ``k`` sample (group, ``G``), ``r`` a row's rank within its
group (its order among the group's rows), ``m = max_k |group k|``. The loss of sample ``k`` is
the sum of its rows' contributions, so its gradient is the sum of the per-row gradients
(``dL_k = sum_{n in k} dL_n``, linear in the grad_outputs); what a reader forms per row becomes
per sample by one ``index_add`` over ``n`` (:meth:`SampleGroups.sum_rows`), and a quantity not
linear in it (a norm) takes the group's rows as one sample whose weight-sharing positions are all
its rows' positions (:meth:`SampleGroups.join_positions`, the Gram form
``||sum_{n in k} sum_s g[n,s] a[n,s]^T||^2 = sum over pairs of the group's (row, position)``).
Weights of the samples (DP clipping factors ``c_k``) reach the rows as ``c_k`` of each row's
group (:meth:`SampleGroups.to_rows`): a clipped sum ``sum_k c_k dL_k = sum_n c_{k(n)} dL_n``.

Everything here is formed once per declaration (one ``torch.unique``, one sort); the readers
only index with it.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .errors import SampleIdsError

__all__ = ["SampleGroups"]


class SampleGroups:
    """The samples (groups of rows) of one batch, from its ``sample_ids``.

    Attributes:
        ids: ``(B,)`` the ids as given (integer dtype, on the batch's device).
        inverse: ``(B,)`` int64, the sample ``k`` of each row: the rank of its id among the
            sorted unique ids.
        count: ``G``, the number of samples (distinct ids).
        most: ``m``, the number of rows of the largest group (0 for an empty batch).
        slot: ``(B,)`` int64, each row's place ``k m + r`` in a ``(G m)`` padded layout, ``r``
            its rank among its group's rows in row order.
        key: ``(B, G, m)``, for the readers' per-structure memos.
    """

    __slots__ = ("ids", "inverse", "count", "most", "slot", "key")

    def __init__(self, ids: Tensor):
        """Form the groups of validated ``ids`` (:meth:`of` validates)."""
        self.ids = ids
        unique, inverse, counts = torch.unique(ids, sorted=True, return_inverse=True,
                                               return_counts=True)
        self.inverse = inverse.long()
        self.count = int(unique.numel())
        self.most = int(counts.max()) if self.count else 0
        order = torch.argsort(self.inverse, stable=True)
        starts = counts.cumsum(0) - counts
        rank = torch.empty_like(self.inverse)
        rank[order] = torch.arange(ids.shape[0], device=ids.device) - starts[self.inverse[order]]
        self.slot = self.inverse * self.most + rank
        self.key = (int(ids.shape[0]), self.count, self.most)

    @classmethod
    def of(cls, sample_ids, batch_size: Optional[int], device: Optional[torch.device]
           ) -> "SampleGroups":
        """Validate ``sample_ids`` against the current batch and form its groups.

        Args:
            sample_ids: ``(B,)`` integer tensor (``torch.int64`` as a rule; any integer dtype,
                never float or bool), one id per row of the batch.
            batch_size: ``B`` of the current batch's forward (``None``: no forward yet).
            device: the device of the batch (its hooked parameters'), or ``None`` to skip.

        Raises:
            SampleIdsError: no forward has run yet; ``sample_ids`` is not a tensor, not 1-D of
                length ``B``, not of an integer dtype, or not on the batch's device.
        """
        if batch_size is None:
            raise SampleIdsError(
                "set_sample_ids(ids): no forward has run yet, so there is no batch whose rows the "
                "ids could describe. Call it after the batch's forward (and before its reads): "
                "out = model(x); gh.set_sample_ids(ids); loss.backward(); gh.per_sample_grads()")
        if not isinstance(sample_ids, Tensor):
            raise SampleIdsError(
                f"set_sample_ids(ids): ids must be a (B,) integer tensor (B = {batch_size}), one "
                f"group id per row of the batch; got a {type(sample_ids).__name__}. E.g. for a "
                f"[chosen; rejected] forward of P pairs: torch.arange(P).repeat(2)")
        if sample_ids.is_floating_point() or sample_ids.is_complex() or sample_ids.dtype == torch.bool:
            raise SampleIdsError(
                f"set_sample_ids(ids): ids must have an integer dtype (torch.int64), got "
                f"{sample_ids.dtype}: a float id may round two samples into one. Pass "
                f"ids.long() of exact integers")
        if sample_ids.dim() != 1 or sample_ids.shape[0] != batch_size:
            raise SampleIdsError(
                f"set_sample_ids(ids): ids must have shape (B,) = ({batch_size},), one id per row "
                f"of dim 0 of the batch's forward; got {tuple(sample_ids.shape)}")
        if device is not None and sample_ids.device != device:
            raise SampleIdsError(
                f"set_sample_ids(ids): ids are on {sample_ids.device}, the batch on {device}: "
                f"move them there (ids.to({str(device)!r}))")
        return cls(sample_ids)

    def sum_rows(self, t: Tensor) -> Tensor:
        """``(G, *rest)``: the rows of ``t`` ``(B, *rest)`` summed per sample (one
        ``index_add`` over ``n``), samples in the order of the sorted unique ids; a new tensor
        (differentiable, as ``index_add``)."""
        return t.new_zeros((self.count, *t.shape[1:])).index_add_(0, self.inverse, t)

    def to_rows(self, c: Tensor) -> Tensor:
        """``(B, *rest)``: each row's entry of its sample, from ``c`` ``(G, *rest)`` (a clipping
        factor ``c_k`` per sample, handed to a reader that weighs rows)."""
        return c.index_select(0, self.inverse)

    def regroup(self, r):
        """A row scatter (:class:`~gradhooks.base.forms.Rows`, entries keyed by row ``n``) with
        its entries keyed by sample ``k`` instead: the scatter of the samples' summed
        gradients (entries of one sample's rows at one table row add up)."""
        return r._replace(sample=self.inverse.index_select(0, r.sample))

    def join_positions(self, t: Tensor, dim: int) -> Tensor:
        """The rows of ``t`` ``(B, ..., S, ...)`` (``S`` at ``dim >= 1``) as ``G`` samples whose
        positions are all their rows' positions: ``(G, ..., m S, ...)``, a group of fewer than
        ``m`` rows padded with zero rows (which add nothing to a Gram form or a sum over
        positions). A new tensor."""
        g, m = self.count, self.most
        padded = t.new_zeros((g * m, *t.shape[1:])).index_copy_(0, self.slot, t)
        padded = padded.view(g, m, *t.shape[1:]).movedim(1, dim)
        shape = (g, *t.shape[1:dim], m * t.shape[dim], *t.shape[dim + 1:])
        return padded.reshape(shape)
