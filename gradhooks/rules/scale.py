"""Rules for layer scale: a learned per-channel scale, ``y = x * gamma``.

Covered (by name, through :mod:`gradhooks.rules.known`, which checks :meth:`ScaleRule.formula`
against the module on a probe input): timm's ``LayerScale`` (channels last, ``(B, *, C)``; CaiT,
Touvron et al. 2021, arXiv:2103.17239, sec. 2.1) and ``LayerScale2d`` (NCHW, ``(B, C, *spatial)``).

Index conventions: ``n`` sample, ``s`` shared position (every element of sample ``n`` that
``gamma[c]`` scales), ``c`` channel. Forward ``y[n, s, c] = x[n, s, c] gamma[c]``, so::

    dL_n/dgamma[c] = sum_s g[n, s, c] x[n, s, c]

The ``inplace=True`` option of timm's classes writes the output into the input: the recorded
input is then gone, which the recorder reports (``GradientMismatchError``: input modified in
place); use ``inplace=False`` (timm's default).
"""
from __future__ import annotations

from typing import Dict, Iterable, Optional

import torch
from torch import Tensor, nn

from ..base.errors import BatchSizeError
from ..base.registry import LayerRule

__all__ = ["ScaleRule"]


class ScaleRule(LayerRule):
    """``y = x * gamma`` with ``gamma`` ``(C,)`` on the last dim (``channel_dim=-1``) or on dim 1
    of an NCHW-like input (``channel_dim=1``).

    ``a``: ``(B, *, C)`` (batch on dim 1 of 3-D+ inputs with ``batch_first=False``, as
    ``nn.Linear``) or ``(B, C, *spatial)``; returns ``gamma``: ``(B, C)``.

    Raises:
        BatchSizeError: for an input without a batch dim.
    """

    param_names = ("gamma",)

    def __init__(self, channel_dim: int = -1):
        if channel_dim not in (-1, 1):
            raise ValueError(f"channel_dim must be -1 or 1, got {channel_dim}")
        self.channel_dim = channel_dim

    def _batch_dim(self, x: Tensor, batch_first: bool) -> int:
        return 0 if batch_first or self.channel_dim == 1 or x.dim() < 3 else 1

    def batch_size(self, module: nn.Module, x: Tensor, batch_first: bool) -> int:
        if x.dim() < 2:
            raise BatchSizeError(
                f"got an unbatched input of shape {tuple(x.shape)}; per-sample gradients need a "
                f"batch dimension (e.g. x.unsqueeze(0))"
            )
        return x.shape[self._batch_dim(x, batch_first)]

    def per_sample_grads(
        self, module: nn.Module, a: Tensor, g: Tensor, batch_first: bool, names: Iterable[str]
    ) -> Dict[str, Tensor]:
        if "gamma" not in names:
            return {}
        prod = a * g
        if self.channel_dim == 1:
            return {"gamma": prod.reshape(prod.shape[0], prod.shape[1], -1).sum(-1)}
        if self._batch_dim(a, batch_first) == 1:
            prod = prod.transpose(0, 1)
        return {"gamma": prod.reshape(prod.shape[0], -1, prod.shape[-1]).sum(1)}

    def formula(self, module: nn.Module, x: Tensor) -> Tensor:
        """``x * gamma`` broadcast on the channel dim."""
        gamma = module.gamma
        return x * (gamma if self.channel_dim == -1 else gamma.view(1, -1, *(1,) * (x.dim() - 2)))

    def probe_input(self, module: nn.Module) -> Optional[Tensor]:
        """``(2, 3, C)`` or ``(2, C, 3, 2)``; ``None`` unless ``gamma`` ``(C,)`` is the only
        parameter."""
        gamma = getattr(module, "gamma", None)
        if (not isinstance(gamma, nn.Parameter) or gamma.dim() != 1
                or [n for n, _ in module.named_parameters(recurse=False)] != ["gamma"]):
            return None
        c = gamma.shape[0]
        shape = (2, 3, c) if self.channel_dim == -1 else (2, c, 3, 2)
        return torch.randn(*shape, dtype=gamma.dtype, device=gamma.device)
