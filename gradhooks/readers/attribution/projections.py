"""Projected per-sample gradients for data attribution (LoGra: Choe et al. 2024,
arXiv:2405.13954, sec. 3): ``(B, k)`` from fixed random projections of each layer's ``a`` and
``g`` applied *before* the outer product, never forming the ``(B, P)`` gradients.

Index conventions as :mod:`gradhooks.readers.gram`. For a layer linear in its weight, with ``ã`` the
input extended by ones when the bias is covered (``[W b]`` one ``(O, I')`` matrix) and fixed
Gaussian matrices ``P_a`` ``(k_in, I')``, ``P_g`` ``(k_out, O)`` (entries ``N(0, 1/k)``)::

    proj_n = P_g (sum_s g[n,s] ã[n,s]^T) P_a^T = sum_s (P_g g[n,s]) (P_a ã[n,s])^T   (k_out, k_in)

flattened row-major, i.e. ``(P_g ⊗ P_a) vec(dW_n)`` with ``vec`` torch's row-major flatten
(the same projections for every group of a grouped convolution, the groups' blocks side by
side). Cost ``O(N S (I' k_in + O k_out + k_in k_out))`` instead of ``O(N S I O)``. Every other
parameter (recurrent, attention, norm, embedding, tied, the fallback) is projected from its
per-sample gradient by a Gaussian ``R`` ``(k_in k_out, numel)``.

Reproducible: each matrix is drawn from a CPU generator seeded by ``seed`` and the layer's
path (or the parameter's name) and its side (:func:`projection`), so the same model and seed
give the same projections in any process and batch.
"""
from __future__ import annotations

import math
import zlib
from typing import Optional

import torch
from torch import Tensor

from ...base.utils import no_autocast
from ...core.recorder.records import Batch
from ..gram import GradientFeatures, gradient_features

__all__ = ["projection", "projected_grads", "project_features"]


def projection(key: str, side: str, k: int, dim: int, seed: int, dtype: torch.dtype,
               device=None) -> Tensor:
    """The fixed ``(k, dim)`` Gaussian matrix (entries ``N(0, 1/k)``) of one layer's side.

    Args:
        key: the module path (linear layers) or parameter name (others).
        side: ``"a"`` (input), ``"g"`` (grad_output) or ``"dense"``.
        k, dim: its shape.
        seed: the user's seed.
        dtype, device: of the result (drawn in float64 on the CPU, then converted, so that it
            does not depend on them beyond rounding).
    """
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}|{key}|{side}".encode()))
    m = torch.randn(k, dim, generator=gen, dtype=torch.float64) / math.sqrt(k)
    return m.to(dtype=dtype, device=device)


def project_features(features: GradientFeatures, k_in: int, k_out: int, seed: int = 0) -> Tensor:
    """Projected per-sample gradients of :class:`~gradhooks.readers.gram.GradientFeatures`.

    Returns:
        ``(B, K)`` for loss gradients, ``(B, C, K)`` for Jacobian features; ``K = k_in k_out``
        per linear layer (``model.named_modules()`` order) and per other parameter
        (``model.named_parameters()`` order), concatenated in that order.
    """
    if k_in < 1 or k_out < 1:
        raise ValueError(f"k_in and k_out must be positive, got {k_in}, {k_out}")
    parts = []
    with no_autocast():
        for path, e in features.linear.items():
            a, g = e.a, e.g  # (N, G, S, I'), (C, N, G, S, O)
            pa = projection(path, "a", k_in, a.shape[-1], seed, a.dtype, a.device)
            pg = projection(path, "g", k_out, g.shape[-1], seed, g.dtype, g.device)
            ap, gp = a @ pa.t(), g @ pg.t()
            if a.shape[2] == 1:
                t = gp[..., 0, :, None] * ap[:, :, 0, None, :]  # (C, N, G, ko, ki)
            else:
                t = gp.transpose(-1, -2) @ ap  # (C, N, G, ko, ki)
            parts.append(t.flatten(2))
        for name, t in features.dense.items():
            flat = t.flatten(2)  # (C, N, numel)
            r = projection(name, "dense", k_in * k_out, flat.shape[-1], seed, flat.dtype,
                           flat.device)
            parts.append(flat @ r.t())
    out = torch.cat(parts, -1).transpose(0, 1)  # (N, C, K)
    return out[:, 0] if features.passes == 1 else out


def projected_grads(batch: Batch, k_in: int = 16, k_out: int = 16, seed: int = 0,
                    features: Optional[GradientFeatures] = None) -> Tensor:
    """``(B, K)`` projected per-sample loss gradients of the current batch (module docstring),
    after its backward pass; own-loss scale as :meth:`~gradhooks.GradHooks.per_sample_grads`.
    The records are kept.

    Args:
        batch: ``recorder.snapshot("projected_grads()", sum_check=False)``.
        k_in, k_out: the projected sizes of each layer's input and output side (LoGra's
            default 16 x 16 gives ``K = 256`` per layer).
        seed: selects the projections (:func:`projection`).
        features: already formed :func:`~gradhooks.readers.gram.gradient_features` of this batch.

    Raises:
        ValueError: if ``k_in`` or ``k_out`` is below 1.
        NoBackwardError, RecordsReleasedError: as ``per_sample_grads``.
    """
    return project_features(features or gradient_features(batch), k_in, k_out, seed)
