"""Per-sample gradients from the canonical form, and the one place ``loss_reduction`` is applied.

Canonical form (curvlinops' convention, extended by a group axis): every linear-like layer
reshapes what the hooks recorded into

* ``a``: ``(N, G, S, I)`` -- input activations (for a convolution: unfolded patches),
* ``g``: ``(N, G, S, O)`` -- gradient of the loss w.r.t. the layer output (grad_output),

with ``n`` the sample, ``g`` the group (``G = 1`` except for grouped convolutions), ``s`` the
weight-sharing position (``S = 1`` for a Linear on ``(B, in)``), ``i``/``o`` in/out features.
The layer computes ``y[n, g, s] = W[g] a[n, g, s] (+ b[g])``, hence (Goodfellow 2015,
arXiv:1510.01799, sec. 3; Rochette et al. 2019, arXiv:1912.06015, sec. 3 for convolutions)::

    dL_n/dW[g] = sum_s g[n, g, s] a[n, g, s]^T      (einsum 'ngsi,ngso->ngoi')
    dL_n/db[g] = sum_s g[n, g, s]

where ``L_n`` is sample ``n``'s share of the loss as the user reduced it.
"""
from __future__ import annotations

import contextlib
import functools
import sys
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from .registry import Block, GradientMismatchError

__all__ = ["weight_grad", "bias_grad", "from_blocks", "BufferPool", "new_empty", "using_pool", "reduction_scale", "call_grads", "check_sums", "GradTotal",
           "LOSS_REDUCTIONS"]

#: The values ``loss_reduction`` may take.
LOSS_REDUCTIONS = ("mean", "sum")


# ----------------------------------------------------------------------------- buffer pool
class BufferPool:
    """Reuses the per-sample gradient tensors of an earlier read that nothing else references.

    Writing ``B x P`` fresh floats is dominated by page faults on newly mapped memory on CPU
    (the seed CNN's fc1: 302 MB, measured 57 ms fresh against 10 ms into a reused tensor, 2
    cores). When a result is superseded (next batch, or another backward pass) its tensors are
    offered to the pool; a rule that asks :func:`new_empty` for an output of the same shape,
    dtype and device gets one back only if neither the tensor object nor its storage is
    referenced anywhere else (no user variable, no view, no ``grad_sample``), so a result the
    user kept is never overwritten.

    Only CPU tensors of at least :attr:`MIN_BYTES` are kept. Smaller ones cost few page faults,
    and keeping them would add their size to the peak memory of the next forward and backward
    (the pool holds them until the next result is formed): on the LSTM LM benchmark (tensors of
    at most 2 MB) the pool saved no time and cost 3 MB of its 10 MB peak. On CUDA the caching
    allocator already reuses freed blocks without page faults, so a pool there would only hold
    memory.
    """

    #: bytes: smaller tensors are left to the allocator. The Transformer block's 4.2 MB
    #: feed-forward weights still gain from reuse (12.4 against 14.0 ms a step, benchmarks/).
    MIN_BYTES = 4 * 2**20

    #: Results kept for reuse: the last two. In a loop ``grads = gh.per_sample_grads()`` the
    #: variable still holds the previous result while the next one is computed, so only the one
    #: before it is free; keeping two generations lets such loops reuse memory too.
    GENERATIONS = 2

    def __init__(self) -> None:
        # Per generation, the offered tensors by (shape, dtype, device): a lookup, not a scan.
        self._gens: List[Dict[tuple, List[Tensor]]] = []

    def give(self, tensors: Iterable[Tensor]) -> None:
        """Offer ``tensors`` (a result no longer handed out) for reuse; the oldest generation
        beyond :attr:`GENERATIONS` is forgotten."""
        gen: Dict[tuple, List[Tensor]] = {}
        for t in tensors:
            if t.device.type != "cpu" or t.numel() * t.element_size() < self.MIN_BYTES:
                continue
            gen.setdefault((t.shape, t.dtype, t.device), []).append(t)
        self._gens = [gen] + self._gens[: self.GENERATIONS - 1]

    def take(self, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Optional[Tensor]:
        """A free tensor of exactly this ``shape``/``dtype``/``device``, or ``None``."""
        key = (torch.Size(shape), dtype, device)
        for gen in reversed(self._gens):  # oldest first: the least likely to be held
            free = gen.get(key)
            if free:
                for i in range(len(free)):  # no loop variable bound to a tensor: it would count as a holder
                    if _unshared(free, i):
                        return free.pop(i)
        return None

    def clear(self) -> None:
        """Forget every tensor offered (frees their memory if nothing else holds them)."""
        self._gens = []


def _use_count(t: Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _counts(pool: List[Tensor], i: int) -> Tuple[int, int]:
    t = pool[i]
    return sys.getrefcount(t), _use_count(t)


def _calibrate() -> Optional[Tuple[int, int]]:
    # Reference counts of a tensor held by the pool list only, measured through the same code
    # path (they differ between Python and torch versions); None disables reuse.
    try:
        return _counts([torch.empty(2)], 0)
    except Exception:  # a torch without the private storage use count
        return None


_UNSHARED = _calibrate()


def _unshared(pool: List[Tensor], i: int) -> bool:
    return _UNSHARED is not None and _counts(pool, i) == _UNSHARED


_POOL: Optional[BufferPool] = None  # set by the hook manager while it computes a result


@contextlib.contextmanager
def using_pool(pool: Optional[BufferPool]) -> Iterator[None]:
    """Within this context :func:`new_empty` draws from ``pool``."""
    global _POOL
    prev, _POOL = _POOL, pool
    try:
        yield
    finally:
        _POOL = prev


def new_empty(shape: Tuple[int, ...], like: Tensor) -> Tensor:
    """An uninitialised ``like.dtype``/``like.device`` tensor of ``shape`` for a rule's result:
    a reused one from the active :class:`BufferPool` when available, else a new one."""
    shape = tuple(shape)
    if _POOL is not None:
        t = _POOL.take(shape, like.dtype, like.device)
        if t is not None:
            return t
    return like.new_empty(shape)


def weight_grad(a: Tensor, g: Tensor, out_shape: Optional[Tuple[int, ...]] = None) -> Tensor:
    """Per-sample weight gradient from the canonical form.

    Args:
        a: ``(N, G, S, I)`` input activations.
        g: ``(N, G, S, O)`` grad_output.
        out_shape: the shape to return, e.g. ``(N, *weight.shape)`` (same number of elements,
            contiguous layout of ``(N, G, O, I)``); default ``(N, G, O, I)``.

    Returns:
        ``sum_s g[n,g,s,o] a[n,g,s,i]`` (Goodfellow 2015, arXiv:1510.01799, sec. 3; over shared
        positions: Rochette et al. 2019, sec. 3), in a tensor from :func:`new_empty` (not a
        view, so that the :class:`BufferPool` can reuse it). With ``S = 1`` this is an outer
        product (one broadcast multiply); otherwise a batched matmul over ``(N, G)``
        contracting ``S``.
    """
    n, grp, _, i = a.shape
    shape = (n, grp, g.shape[-1], i)
    out = new_empty(out_shape or shape, a)
    target = out.view(shape)
    if a.shape[2] == 1:
        torch.mul(g[:, :, 0, :, None], a[:, :, 0, None, :], out=target)
    else:
        torch.matmul(g.transpose(-1, -2), a, out=target)
    return out


def bias_grad(g: Tensor, out_shape: Optional[Tuple[int, ...]] = None) -> Tensor:
    """Per-sample bias gradient from the canonical form.

    Args:
        g: ``(N, G, S, O)`` grad_output.
        out_shape: the shape to return (default ``(N, G, O)``), as for :func:`weight_grad`.

    Returns:
        ``sum_s g[n, g, s, o]`` (the bias sees an input of ones).
    """
    shape = g.shape[:2] + g.shape[3:]
    out = new_empty(out_shape or shape, g)
    torch.sum(g, dim=2, out=out.view(shape))
    return out


def from_blocks(blocks: Sequence[Block], shape: Tuple[int, ...]) -> Tensor:
    """Materialise a per-sample gradient given in factored form (:class:`Block`).

    Args:
        blocks: disjoint row blocks covering the parameter, in increasing row order.
        shape: ``(N, *param.shape)``.

    Returns:
        ``(N, *param.shape)``: per block :func:`weight_grad` (``a`` given) or :func:`bias_grad`
        (``a = None``) with the block's ``S`` positions as shared positions.
    """
    n = shape[0]
    parts = []
    for b in blocks:
        g = b.g.unsqueeze(1)
        if len(blocks) == 1:
            return bias_grad(g, shape) if b.a is None else weight_grad(b.a.unsqueeze(1), g, shape)
        t = bias_grad(g) if b.a is None else weight_grad(b.a.unsqueeze(1), g)
        parts.append(t.reshape(n, b.g.shape[-1], -1))
    return torch.cat(parts, 1).view(shape)


def reduction_scale(loss_reduction: str, batch_size: int) -> Optional[float]:
    """Factor that turns gradients of the reduced batch loss into per-sample-loss gradients.

    With ``loss_reduction="mean"`` the batch loss is ``(1/B) sum_n l_n``, so what the hooks see
    for sample ``n`` is ``(1/B) dl_n``; multiplying by ``B`` gives ``dl_n``, the gradient of the
    sample's own loss, independent of the batch size (Opacus' convention). With ``"sum"`` no
    scaling is needed and ``None`` is returned.

    Raises:
        ValueError: if ``loss_reduction`` is not ``"mean"`` or ``"sum"``.
    """
    check_loss_reduction(loss_reduction)
    return float(batch_size) if loss_reduction == "mean" else None


def check_loss_reduction(loss_reduction: str) -> None:
    """Raise ``ValueError`` unless ``loss_reduction`` is ``"mean"`` or ``"sum"``."""
    if loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(
            f"loss_reduction must be 'mean' or 'sum' (how the batch loss was reduced over "
            f"samples), got {loss_reduction!r}"
        )


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """The dtype per-sample gradients are accumulated in: the promoted dtype of ``tensors``, at
    least ``float32`` (an autocast forward records bfloat16/float16 grad_outputs)."""
    dt = tensors[0].dtype
    for t in tensors[1:]:
        dt = torch.promote_types(dt, t.dtype)
    return torch.promote_types(dt, torch.float32)


def call_grads(rule, module: nn.Module, a, grads, batch_first: bool,
               names: Iterable[str], scale: Optional[float],
               release: Optional[Callable[[], None]] = None) -> Dict[str, Tensor]:
    """Per-sample gradients of one recorded call, with the ``loss_reduction`` scale applied.

    Args:
        rule: the module's :class:`~gradhooks.registry.LayerRule`.
        module: the layer.
        a: the call's input activations (a :class:`~gradhooks.registry.Call` for ``multi_io``
            rules).
        grads: the grad_outputs of every backward pass through the call (summed: the
            gradients are linear in the grad_output); for ``multi_io`` rules, the output's
            structure holding each output tensor's summed grad_output or ``None``.
        batch_first: as given to :func:`gradhooks.attach`.
        names: the parameters wanted.
        scale: from :func:`reduction_scale` (``None``: no scaling).
        release: called once the rule no longer needs the caller's references to ``a`` and
            ``grads`` (after scaled copies are made): the caller drops its records there, so
            that an unscaled grad_output is not held beside its copy while the rule runs.

    Returns:
        ``{name: (B, *param.shape)}``, scaled. The scale is applied to whichever is smaller,
        the grad_output or the per-sample result (for a Linear on ``(B, in)`` the grad_output
        is ``in`` times smaller, which saves a full pass over the result). Inputs and
        grad_outputs of lower precision than float32 (autocast) are promoted to float32 first.
    """
    names = tuple(names)
    if rule.multi_io:
        if scale is not None:
            grads = tree_map(lambda t: t * scale if isinstance(t, Tensor) else t, grads)
            inner = a.internal.get("grad_inputs") if a.internal else None
            if inner is not None:  # gradients recorded inside the call (LayerRule.internal)
                a = a._replace(internal={**a.internal, "grad_inputs": tuple(
                    None if t is None else t * scale for t in inner)})
        if release is not None:
            release()
        return rule.per_sample_grads(module, a, grads, batch_first, names)
    g = grads[0] if len(grads) == 1 else torch.stack(grads).sum(0)
    del grads
    if a.dtype != g.dtype or a.dtype in _LOW_PRECISION:
        dt = compute_dtype(a, g)
        a, g = a.to(dt), g.to(dt)
    scale_a = scale_g = False
    if scale is not None:
        own = module._parameters  # (faster than nn.Module.__getattr__)
        out_numel = g.shape[0] * sum((own[n] if n in own else getattr(module, n)).numel()
                                     for n in names)
        # The results are linear in g, and for rules with ``weight_linear_in_input`` the
        # weight's is linear in a too (the bias's does not depend on a): scale the smallest of
        # a, g and the results (a Transformer's Linear on (B, T, 128) -> 512: a, 4x smaller).
        scale_a = rule.weight_linear_in_input and a.numel() < min(g.numel(), out_numel)
        scale_g = not scale_a and g.numel() <= out_numel
        if scale_a:
            a = a * scale
        elif scale_g:
            g = g * scale
    if release is not None:
        release()
    out = rule.per_sample_grads(module, a, g, batch_first, names)
    if scale is not None and not scale_g:
        for name, t in out.items():
            if not (scale_a and name == "weight"):
                t.mul_(scale)  # rules return tensors they own
    return out


_LOW_PRECISION = (torch.bfloat16, torch.float16)


# Relative tolerance of check_sums per dtype: the sum of B per-sample values may differ from
# autograd's batch value by rounding, relative to sum_n |value_n| (B * eps in the worst case).
SUM_CHECK_RTOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}
SUM_CHECK_PROBES = 256


@functools.lru_cache(maxsize=256)
def _probe_index(numel: int, probes: int, device: torch.device) -> Tensor:
    return torch.linspace(0, numel - 1, probes, device=device).long()


@functools.lru_cache(maxsize=64)
def bilinear_directions(rows: int, cols: int, dtype: torch.dtype,
                        device: torch.device) -> Tuple[Tensor, Tensor, float]:
    """Fixed random directions for the sum check's projection of a weight viewed as a
    ``(rows, cols)`` matrix (dim 0 by the rest): ``u`` ``(cols,)``, ``v`` ``(rows,)`` and
    ``||u|| ||v||``; the same values for every dtype and device (drawn in float64)."""
    gen = torch.Generator().manual_seed(20240501)
    u = torch.randn(cols, generator=gen, dtype=torch.float64)
    v = torch.randn(rows, generator=gen, dtype=torch.float64)
    return u.to(device, dtype), v.to(device, dtype), float(u.norm() * v.norm())


class GradTotal:
    """Autograd's gradient of one parameter summed over the backward passes of a batch, kept in
    the form the sum check reads it.

    A parameter with fewer than :attr:`SUMMARISE` elements (or a sparse gradient) is kept whole.
    A larger one is reduced at once to its values at the probe coordinates
    (:func:`check_sums`) and, with 2 or more dims, to ``v^T W u`` and ``||W||`` for the
    directions of :func:`bilinear_directions` (``W`` = the gradient viewed as ``(dim 0, rest)``):
    holding the gradient itself would make autograd copy it into ``param.grad`` instead of
    moving it there, one parameter-sized allocation per step (CNN: 4.8 MB, wide MLP: 2.5 MB).
    """

    #: elements from which the gradient is summarised instead of kept.
    SUMMARISE = 1 << 16

    __slots__ = ("full", "shape", "device", "probes", "proj", "norm")

    def __init__(self, grad: Tensor):
        self.shape, self.device = grad.shape, grad.device
        self.full: Optional[Tensor] = None
        if grad.numel() < self.SUMMARISE or grad.layout != torch.strided:
            self.full = grad
            return
        self.probes, self.proj, self.norm = self._summary(grad)

    def add(self, grad: Tensor) -> None:
        """Add the gradient of another backward pass."""
        if self.full is not None:
            self.full = self.full + grad
            return
        probes, proj, norm = self._summary(grad)
        self.probes = self.probes + probes
        self.proj = None if proj is None else self.proj + proj
        self.norm = None if norm is None else self.norm + norm  # an upper bound of ||sum||

    def _summary(self, grad: Tensor):
        flat = grad.reshape(-1)
        probes = flat.index_select(0, self.probe_index())
        if grad.dim() < 2:
            return probes, None, None
        w = grad.reshape(grad.shape[0], -1)
        w = w.to(torch.promote_types(w.dtype, torch.float32))
        u, v, _ = bilinear_directions(w.shape[0], w.shape[1], w.dtype, w.device)
        return probes, torch.dot(v, w @ u), torch.linalg.vector_norm(w)

    def probe_index(self) -> Tensor:
        """The flat coordinates of the probes: :data:`SUM_CHECK_PROBES` evenly spaced ones, or
        all of them for a smaller parameter."""
        numel = self.shape.numel()
        if numel <= SUM_CHECK_PROBES:
            return torch.arange(numel, device=self.device)
        return _probe_index(numel, SUM_CHECK_PROBES, self.device)

    def probe_values(self) -> Tensor:
        """The gradient at :meth:`probe_index`, ``(K,)``."""
        if self.full is None:
            return self.probes
        full = self.full.to_dense() if self.full.layout != torch.strided else self.full
        return full.reshape(-1).index_select(0, self.probe_index())

    def projection(self, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
        """``(v^T W u, ||W||)`` in ``dtype`` (:func:`bilinear_directions`; 2+ dims only)."""
        if self.full is None:
            return self.proj.to(dtype), self.norm.to(dtype)
        w = self.full.reshape(self.shape[0], -1).to(dtype)
        u, v, _ = bilinear_directions(w.shape[0], w.shape[1], dtype, w.device)
        return torch.dot(v, w @ u), torch.linalg.vector_norm(w)


def check_sums(items: Sequence[Tuple], scale: Optional[float]) -> None:
    """Check that per-sample gradients sum to the batch gradient autograd computed.

    ``sum_n grad_n == scale * batch_grad`` must hold for every parameter (linearity of the
    gradient in the loss); it fails when a parameter also receives gradient outside the module
    whose hooks produced ``grad_n``. Checked on :data:`SUM_CHECK_PROBES` evenly spaced
    coordinates per parameter (:meth:`GradTotal.probe_index`), all parameters of a device in one vectorised comparison, within
    :data:`SUM_CHECK_RTOL` relative to ``sum_n |grad_n|`` per coordinate (floored at 1% of the
    largest such bound, so that rounding in coordinates that cancel within a sample passes).

    Args:
        items: ``(name, per_sample (B, *shape), batch_grad[, tol_dtype])`` per parameter;
            ``batch_grad`` is what autograd computed in the same backward passes: a
            :class:`GradTotal`, a tensor already reduced to the probe coordinates of
            ``per_sample`` (``(K,)`` with ``per_sample`` ``(B, K)``), or ``None``;
            ``tol_dtype`` (default: ``per_sample.dtype``) selects the tolerance, e.g. bfloat16
            when the grad_outputs were bfloat16 (autocast).
        scale: the :func:`reduction_scale` already applied to ``per_sample``.

    Raises:
        GradientMismatchError: naming the first parameter that fails, or that has per-sample
            gradients but no autograd gradient (e.g. ``torch.autograd.grad`` w.r.t. the input).
    """
    groups: Dict[torch.device, list] = {}
    for name, t, total, *tol_dtype in items:
        if total is None:
            raise GradientMismatchError(
                f"grad_outputs were recorded for the module owning {name!r}, but autograd "
                f"computed no gradient for {name!r} in those backward passes (e.g. "
                f"torch.autograd.grad with respect to the input only); per-sample gradients of "
                f"the parameters are not defined for such a pass"
            )
        flat = t.reshape(t.shape[0], -1)
        if isinstance(total, GradTotal):
            idx, ref = total.probe_index(), total.probe_values()
            if idx.numel() < flat.shape[1]:
                flat = flat.index_select(1, idx)
        else:
            ref = total.reshape(-1)
        groups.setdefault(t.device, []).append((name, flat, ref, SUM_CHECK_RTOL.get(tol_dtype[0] if tol_dtype else t.dtype, 1e-4)))
    for device, entries in groups.items():
        acc = torch.float64 if any(e[1].dtype == torch.float64 for e in entries) else torch.float32
        per = torch.cat([e[1].to(acc) for e in entries], 1)  # (B, K)
        ref = torch.cat([e[2].to(acc) for e in entries])
        rtol = max(e[3] for e in entries)  # the loosest dtype of the group
        err = per.sum(0).sub_(ref, alpha=1.0 if scale is None else scale).abs_()
        # per coordinate: rtol * sum_n |grad_n|, floored at 1% of that for the largest coordinate
        # (rounding of a coordinate whose per-sample values cancel within each sample)
        tol = per.abs().sum(0).mul_(rtol)
        # NaN-safe: a NaN per-sample value where autograd's gradient is finite is a mismatch
        floor = float(torch.nan_to_num(tol, nan=0.0, posinf=0.0).max()) * 1e-2 + torch.finfo(acc).tiny
        bad = ~(err <= tol.clamp_(min=floor)) & ref.isfinite()
        if bool(bad.any()):
            sizes = [e[1].shape[1] for e in entries]
            first = int(bad.nonzero()[0, 0])
            k = 0
            for (name, *_), size in zip(entries, sizes):
                k += size
                if first < k:
                    break
            raise GradientMismatchError(
                f"the per-sample gradients of {name!r} do not sum to the gradient autograd "
                f"computed for it (largest difference {err.max().item():.3g}). The parameter "
                f"receives gradient outside the module that owns it (a functional use such as "
                f"x @ layer.weight.T, or a module gradhooks does not hook); per-sample gradients "
                f"would be wrong. Use the parameter only through its module."
            )
