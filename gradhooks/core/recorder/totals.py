"""Autograd's gradients of a batch, as the recorder keeps them for the verification.

The recorder takes, in the backward passes of a batch, each parameter's gradient as autograd
computed it (:class:`GradTotal`: whole, or reduced to probe coordinates and a random rank-one
projection), and what its values show of the precision autograd formed it in
(:func:`formed_in`, :func:`module_precision`). That is the evidence; the verdicts (the sum
check, its tolerances and messages) are :mod:`gradhooks.readers.verify`, which judges the
readers' results against it.
"""
from __future__ import annotations

import functools
from typing import Dict, Iterable, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["GradTotal", "bilinear_directions", "SUM_CHECK_PROBES", "formed_in",
           "module_precision", "float32_columns"]

#: Probe coordinates per parameter (evenly spaced; all of a smaller parameter).
SUM_CHECK_PROBES = 256


def float32_columns(values: Tensor) -> Tuple[Tensor, Tensor]:
    # Per float64 value: whether it is exactly a float32 value, and whether it needs more
    # significant bits than float16 / bfloat16 hold (11): a value of float32's precision, not a
    # small integer or a power of two, which every float is.
    exact = values.to(torch.float32).to(torch.float64) == values
    wide = exact & (torch.frexp(values).mantissa * 2048).frac().ne(0)
    return exact, wide


def formed_in(values: Tensor) -> Tensor:
    """Whether autograd's gradient ``values`` (float64, e.g. a parameter's at the probe
    coordinates) were formed in float32: a 0-dim bool tensor, true when every value is exactly a
    float32 value and some value needs more than the 11 significant bits of float16 / bfloat16.

    A float64 value computed in float64 is a float32 value with probability ``2**-29``; autograd
    casts a gradient it formed in float32 up to the parameter's dtype (the backward of
    ``self.weight.float()``): every value is then a float32 value. So a parameter a float64
    model uses in float32 (Gemma's RMSNorm ``1 + self.weight.float()``, Mamba's
    ``self.D.float()``) is judged at float32's tolerance, established from what autograd
    computed, and only such a parameter."""
    if values.dtype != torch.float64 or not values.numel():
        return torch.zeros((), dtype=torch.bool, device=values.device)
    exact, wide = float32_columns(values)
    return exact.all() & wide.any()


@functools.lru_cache(maxsize=256)
def _probe_index(numel: int, probes: int, device: torch.device) -> Tensor:
    """``probes`` evenly spaced flat coordinates of ``[0, numel)``, first and last included, in
    int64 arithmetic (``k (numel - 1) // (probes - 1)``): a float32 ``linspace`` rounds
    ``numel - 1`` to ``numel`` above ``2**24`` elements (every word embedding of a
    pretrained-size language model) and indexes out of range."""
    k = torch.arange(probes, dtype=torch.int64, device=device)
    return k.mul_(numel - 1).div_(max(probes - 1, 1), rounding_mode="floor")


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
    (:func:`gradhooks.readers.verify.check_sums`) and, with 2 or more dims, to ``v^T W u`` and ``||W||`` for the
    directions of :func:`bilinear_directions` (``W`` = the gradient viewed as ``(dim 0, rest)``):
    holding the gradient itself would make autograd copy it into ``param.grad`` instead of
    moving it there, one parameter-sized allocation per step (CNN: 4.8 MB, wide MLP: 2.5 MB).

    It also keeps what the gradient's values show of the precision autograd formed it in
    (:meth:`formed`), per backward pass: a sum over passes is no float32 value any more.
    """

    #: elements from which the gradient is summarised instead of kept.
    SUMMARISE = 1 << 16

    __slots__ = ("full", "shape", "device", "dtype", "probes", "proj", "norm", "hooks", "lower",
                 "module")

    def __init__(self, grad: Tensor):
        self.shape, self.device, self.dtype = grad.shape, grad.device, grad.dtype
        self.full: Optional[Tensor] = None
        #: the user's gradient hooks that ran on the parameter before ours (names), or None
        self.hooks: Optional[str] = None
        #: a float64 gradient: whether a backward pass's gradient was formed in float32
        #: (:func:`formed_in`, a 0-dim bool tensor); None until read (:meth:`read_lower`)
        self.lower: Optional[Tensor] = None
        #: whether the parameter's module computes in float32 (:func:`module_precision`)
        self.module = False
        if grad.numel() < self.SUMMARISE or grad.layout != torch.strided:
            self.full = grad
            return
        self.probes, self.proj, self.norm = self._summary(grad)

    def add(self, grad: Tensor) -> None:
        """Add the gradient of another backward pass."""
        if self.dtype == torch.float64:  # (each pass's precision: their sum no longer shows it)
            dense = grad.layout == torch.strided
            self.lower = self.read_lower() | (dense and formed_in(
                grad.reshape(-1).index_select(0, self.probe_index())))
        if self.full is not None:
            self.full = self.full + grad
            return
        probes, proj, norm = self._summary(grad)
        self.probes = self.probes + probes
        self.proj = None if proj is None else self.proj + proj
        self.norm = None if norm is None else self.norm + norm  # an upper bound of ||sum||

    def formed(self) -> torch.dtype:
        """The precision autograd formed this gradient in, as far as the values establish it:
        float32 for a float64 gradient of which some backward pass's values are all float32
        values (:func:`formed_in`), or whose module computes in float32 (:attr:`module`); else
        the gradient's dtype."""
        if self.dtype != torch.float64:
            return self.dtype
        return torch.float32 if self.module or bool(self.read_lower()) else self.dtype

    def read_lower(self) -> Tensor:
        """:attr:`lower` of a float64 gradient, read from its values if not yet."""
        if self.lower is None:
            self.lower = formed_in(self.probe_values())
        return self.lower

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


def module_precision(modules: Iterable[Sequence[Optional["GradTotal"]]]) -> None:
    """The precision a module computes in, from its parameters' gradients: where autograd
    formed the float64 gradient of one parameter of a module in float32 (:func:`formed_in`: the
    module casts it down, ``self.D.float()``), the module computes in float32, and its other
    float64 parameters are judged at float32 too (:attr:`GradTotal.module`): their gradients are
    float64 sums of values formed in float32, which a rule that recomputes the module per sample
    (the ``torch.func`` fallback) rounds otherwise than the batched forward (the Mamba mixer's
    ``conv1d.bias``, next to ``A_log.float()`` and ``D.float()``).

    Args:
        modules: per module, the :class:`GradTotal` of each of its parameters (``None``: no
            gradient). One sync per device.
    """
    groups = [[t for t in totals if t is not None and t.dtype == torch.float64]
              for totals in modules]
    groups = [g for g in groups if len(g) > 1]
    by_device: Dict[torch.device, list] = {}
    for g in groups:
        for t in g:
            by_device.setdefault(t.device, []).append(t)
    lowered = set()
    for totals in by_device.values():
        flags = torch.stack([t.read_lower() for t in totals]).tolist()
        lowered.update(id(t) for t, flag in zip(totals, flags) if flag)
    for g in groups:
        if any(id(t) in lowered for t in g):
            for t in g:
                t.module = True
