"""Per-sample gradients as sums of row outer products per segment, kept factored until read:
the cotangent of a grouped product's weight (a mixture of experts' ``(E, O, I)`` weight on the
token rows routed to each expert) or of a weight read slice by slice (``weight[e]`` in a loop
over the experts), :mod:`gradhooks.core.analysis.rows`.

Index conventions: ``r`` a row, ``n`` the sample, ``e`` the group (expert), ``k = n * E + e``
the key of a ``(sample, group)`` segment. With rows ``u (R, U)``, ``v (R, V)`` and their keys::

    out[n, e] = sum_{r: key[r] = k} u[r] v[r]^T      (U, V)    (a weight)
    out[n, e] = sum_{r: key[r] = k} u[r]             (U,)      (v = None: a bias)

(Goodfellow 2015, arXiv:1510.01799, sec. 3, per segment). :class:`Segments` holds the rows
instead of the ``(B, E, U, V)`` tensor: a reader that needs each sample's gradient forms it
(:meth:`Segments.dense`: the loss scale on the rows, into a reused buffer); the per-sample norms
(:meth:`Segments.sq_norms`: per segment the Gram form or its small product, Li et al. 2022,
arXiv:2110.05679, sec. 4) and DP clipping's weighted sum (:meth:`Segments.weighted`: one
segment contraction over the groups, the cost of the weight's ordinary gradient) never form
it. A model with ``E / top_k`` times the dense model's parameters per multiply-add would
otherwise write ``E / top_k`` times its per-sample memory on each step.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ._pool import new_empty
from .torch_internals import grouped_mm

__all__ = ["routed_layout", "per_key_rows", "segment_outer", "Segments", "LOOP_KEYS"]

#: Up to this many non-empty segments a contraction into a given buffer runs one ``mm`` per
#: segment (``out=`` its slice of a buffer the pool may hand back: no fresh pages); above it, one
#: grouped kernel into a new tensor (the Python loop would cost more than the pages).
LOOP_KEYS = 1024


def routed_layout(samples: Tensor, size: int) -> tuple:
    """``("routed", order, sample, at, size, longest)`` (:func:`per_key_rows`; the layout of
    :func:`gradhooks.core.recorder.layouts.relayout`) for rows of
    ``samples`` (a :class:`~gradhooks.core.analysis.batch_dims.Routed` batch: row ``r`` of sample
    ``samples[r]``, in any order): the rows laid out per sample, ``(size, longest, ...)``, each
    sample's rows first in their order, zeros after them (a new tensor). A position-wise layer's
    per-sample results are linear in its grad_output, so the zero rows add nothing: an expert
    ``nn.Linear`` on the rows routed to it gets each sample's gradient from its own rows."""
    samples = samples.to(torch.int64)
    counts = torch.bincount(samples, minlength=size)
    order = torch.argsort(samples, stable=True)
    sample = samples[order]
    at = torch.arange(len(order), device=samples.device) - (torch.cumsum(counts, 0) - counts)[sample]
    return ("routed", order, sample, at, size, int(counts.max()) if len(order) else 0)


def per_key_rows(t: Tensor, how: tuple) -> Tensor:
    """``t``'s rows ``(R, ...)`` laid out per key as :func:`routed_layout` says: ``(size,
    longest, ...)``, each key's rows first in their order, zeros after them (a new tensor)."""
    _, order, sample, at, size, longest = how
    out = t.new_zeros((size, longest, *t.shape[1:]))
    out[sample, at] = t[order]
    return out


def _grouped_kernel_takes(*ts: Tensor) -> bool:
    # torch's grouped product over the contracted dim (torch._grouped_mm of (U, S) by (S, V)
    # with offsets): CPU, float32 / bfloat16, rows 16-byte aligned.
    t0 = ts[0]
    return (grouped_mm is not None and t0.device.type == "cpu"
            and t0.dtype in (torch.float32, torch.bfloat16)
            and all(t.dtype == t0.dtype and t.dim() == 2 and t.stride(1) == 1
                    and (t.stride(0) * t.element_size()) % 16 == 0
                    and t.data_ptr() % 16 == 0 for t in ts))


def _in_key_order(key: Tensor, *ts: Optional[Tensor]):
    # (key, ts...) with the rows sorted by key (stable; no gather where they are already)
    order = torch.argsort(key, stable=True)
    if bool((order == torch.arange(len(order), device=order.device)).all()):
        return (key, *ts)
    return (key[order], *(None if t is None else t.index_select(0, order) for t in ts))


def _runs(key: Tensor) -> Tuple[list, list]:
    # ([key], [length]) of the segments of rows sorted by key, in that order
    if not key.numel():
        return [], []
    found, counts = torch.unique_consecutive(key, return_counts=True)
    return found.tolist(), counts.tolist()


def segment_outer(u: Tensor, v: Optional[Tensor], key: Tensor, keys: int,
                  out: Optional[Tensor] = None) -> Tensor:
    """``out[k] = sum_{r: key[r] = k} u[r] v[r]^T``, ``(keys, U, V)``, for rows ``u (S, U)``,
    ``v (S, V)`` and their keys ``key (S,)`` in ``[0, keys)``; ``out[k] = sum_r u[r]``,
    ``(keys, U)``, for ``v=None``. Contracted segment by segment, at the rows' own cost: into
    ``out`` (given, of that shape) by one ``mm`` per segment up to :data:`LOOP_KEYS` segments;
    else by torch's grouped product where it runs (one kernel), else over the
    segments padded to the longest (zeros after each segment's rows)."""
    key = key.to(torch.int64)
    if v is None:
        res = u.new_zeros((keys, u.shape[-1])) if out is None else out.zero_()
        return res.index_add_(0, key, u)
    key, u, v = _in_key_order(key, u.contiguous(), v.contiguous())
    loop = out is not None and u.device.type == "cpu"  # (elsewhere: one kernel, not a launch
    found, counts = _runs(key) if loop else ([], [])     # per segment)
    if loop and len(found) <= LOOP_KEYS:
        if len(found) < keys:
            empty = torch.ones(keys, dtype=torch.bool, device=u.device)
            empty[torch.tensor(found, dtype=torch.int64, device=u.device)] = False
            out.index_fill_(0, torch.nonzero(empty).flatten(), 0)
        outs = out.unbind(0)
        for k, a, b in zip(found, u.split(counts), v.split(counts)):
            torch.mm(a.t(), b, out=outs[k])
        return out
    counts = torch.bincount(key, minlength=keys)
    if keys and _grouped_kernel_takes(u, v):  # (u.t(): the (U, S) operand, strides (1, U))
        return grouped_mm(u.t(), v, offs=torch.cumsum(counts, 0).to(torch.int32))
    how = routed_layout(key, keys)
    return torch.bmm(per_key_rows(u, how).transpose(1, 2), per_key_rows(v, how))


class Segments:
    """A parameter's per-sample gradient ``(B, *param.shape)``, ``param.shape = (E, U, V)`` (or
    ``(E, U)`` for ``v=None``), as the rows of its segments (module docstring), unscaled.

    Args:
        u: ``(R, U)`` rows (a grad_output's or an input's, floating).
        v: ``(R, V)`` the rows they multiply, or ``None`` (a bias).
        key: ``(R,)`` int64, each row's segment ``n * E + e``, in ``[0, B * E)``.
        size: ``B``.
        param_shape: the parameter's shape, ``(E, U, V)`` or ``(E, U)`` (``E = param_shape[0]``).

    It stands where a record holds a grad_output: :attr:`shape`, :attr:`dtype`,
    :attr:`device`, :attr:`requires_grad` as the dense tensor's; ``+`` adds (rows of the same
    layout are concatenated; a tensor gets :meth:`dense` added, torch's error for one of
    another shape). The rows carry no autograd graph (a differentiable read forms the tensor
    in the backward instead, :mod:`gradhooks.core.analysis.rows`).
    """

    __slots__ = ("u", "v", "key", "size", "param_shape")

    def __init__(self, u: Tensor, v: Optional[Tensor], key: Tensor, size: int,
                 param_shape: Tuple[int, ...]):
        self.u, self.v, self.key = u, v, key
        self.size, self.param_shape = size, tuple(param_shape)

    @property
    def groups(self) -> int:
        """``E``: the parameter's dim 0 (experts)."""
        return self.param_shape[0]

    @property
    def shape(self) -> torch.Size:
        """``(B, *param.shape)``: the dense tensor's."""
        return torch.Size((self.size, *self.param_shape))

    @property
    def dtype(self) -> torch.dtype:
        """The rows' dtype (the dense tensor's)."""
        return self.u.dtype

    @property
    def device(self) -> torch.device:
        """The rows' device."""
        return self.u.device

    requires_grad = False

    def __add__(self, other):
        if isinstance(other, Segments) and (other.size, other.param_shape, other.v is None) == (
                self.size, self.param_shape, self.v is None):
            cat = (lambda x, y: torch.cat([x, y.to(x.dtype)]))
            return Segments(cat(self.u, other.u), None if self.v is None else cat(self.v, other.v),
                            torch.cat([self.key, other.key]), self.size, self.param_shape)
        dense = other.dense() if isinstance(other, Segments) else other
        return self.dense() + dense

    __radd__ = __add__

    def dense(self, scale=None) -> Tensor:
        """``(B, *param.shape)``, times ``scale`` (a number or 0-dim tensor, ``None``: 1),
        applied to whichever rows are smaller; the output from the active
        :class:`~gradhooks.base._pool.BufferPool` where it has a free one."""
        u, v = self.u, self.v
        if scale is not None:
            if v is not None and v.shape[-1] < u.shape[-1]:
                v = v * scale
            else:
                u = u * scale
        keys = self.size * self.groups
        if v is None:
            flat = (keys, u.shape[-1])
        else:
            flat = (keys, u.shape[-1], v.shape[-1])
        out = new_empty(self.shape, u)
        into = None if out is None else out.view(flat)
        got = segment_outer(u, v, self.key, keys, into)
        return out if got is into else got.view(self.shape)  # (the buffer, not a view of it:
        # the pool reuses only tensors no other view holds)

    def weighted(self, c: Optional[Tensor] = None) -> Tensor:
        """``sum_n c[n] out[n]``, ``param.shape`` (``c (B,)``; ``None``: the plain sum over the
        samples, what autograd accumulates), by one segment contraction over the ``E`` groups
        (DP clipping's clipped sum, the sum check's total)."""
        u = self.u if c is None else self.u * c.to(self.u.dtype)[self.key // self.groups, None]
        got = segment_outer(u, self.v, self.key % self.groups, self.groups)
        return got.view(self.param_shape)

    def at(self, idx: Tensor) -> Tensor:
        """``(B, K)``: each sample's gradient at the flat (row-major) coordinates ``idx (K,)``
        of the parameter, from the rows alone (the sum check's probes)."""
        e = self.groups
        rest = self.u.shape[-1] * (1 if self.v is None else self.v.shape[-1])
        idx = idx.to(torch.int64)
        group, within = idx // rest, idx % rest
        if self.v is None:
            vals = self.u[:, within]
        else:
            cols = self.v.shape[-1]
            vals = self.u[:, within // cols] * self.v[:, within % cols]
        vals = vals * ((self.key % e)[:, None] == group[None]).to(vals.dtype)
        out = vals.new_zeros((self.size, idx.numel()))
        return out.index_add_(0, self.key // e, vals)

    def sq_norms(self, padded: Optional[bool] = None) -> Tensor:
        """``(B,)``: ``||out[n]||^2``, without forming ``out``: per segment of ``S`` rows the
        Gram form ``sum_{r,s} (u_r . u_s)(v_r . v_s)`` where ``S^2 (U + V) < U V``, else the
        segment's ``(U, V)`` product, one segment at a time; with ``padded`` (the default off
        the CPU, where a launch per segment would cost more) the Gram form of every segment
        at once, its rows padded to the longest with zeros. Float32 at least."""
        keys, e = self.size * self.groups, self.groups
        dt = self.u.dtype if self.u.dtype == torch.float64 else torch.float32
        if self.v is None:
            sq = segment_outer(self.u.to(dt), None, self.key, keys).square().sum(1)
            return sq.view(self.size, e).sum(1)
        if padded or padded is None and self.u.device.type != "cpu":
            how = routed_layout(self.key, keys)
            u, v = per_key_rows(self.u.to(dt), how), per_key_rows(self.v.to(dt), how)
            gram = torch.bmm(u, u.transpose(1, 2)).mul_(torch.bmm(v, v.transpose(1, 2)))
            return gram.sum((1, 2)).view(self.size, e).sum(1)
        key, u, v = _in_key_order(self.key.to(torch.int64), self.u, self.v)
        found, counts = _runs(key)
        dim_u, dim_v = u.shape[-1], v.shape[-1]
        parts, at = [], []
        for k, c, uk, vk in zip(found, counts, u.to(dt).split(counts), v.to(dt).split(counts)):
            if c * c * (dim_u + dim_v) < dim_u * dim_v:
                parts.append(torch.mm(uk, uk.t()).mul_(torch.mm(vk, vk.t())).sum())
            else:
                parts.append(torch.mm(uk.t(), vk).square_().sum())
            at.append(k // e)
        out = torch.zeros(self.size, dtype=dt, device=u.device)
        if parts:
            out.index_add_(0, torch.tensor(at, device=u.device), torch.stack(parts))
        return out
