"""Rules for normalisations that differ from the stock ones by a formula and take more than one
input: the gated, grouped RMSNorm of Mamba-2 (transformers' ``MambaRMSNormGated``).

The single-input variants (Gemma's ``(1 + weight)`` scale, OLMo-2's weight applied before the
cast back) are ``scale`` variants of :class:`~gradhooks.rules.norm.RMSNormLikeRule`. Not
registered by type (gradhooks does not import transformers): :mod:`gradhooks.rules.known`
recognises the classes by name and checks :meth:`GatedRMSNormRule.formula` against the module's
own forward on a probe input.

Index conventions: ``n`` sample, ``s`` shared position (token), ``k`` group, ``j`` channel of a
group (``D = K * J`` channels, ``J = group_size``).

Forward (Dao & Gu 2024, arXiv:2405.21060, sec. 7.2 "Normalization"; transformers'
``MambaRMSNormGated``, ``norm_before_gate=False``), in float32 and cast back to the input's
dtype::

    z[n, s]       = x[n, s] * silu(gate[n, s])          (z = x without a gate)
    x̂[n, s, k, j] = z[n, s, k, j] / sqrt(mean_j z[n, s, k, j]^2 + eps)
    y[n, s, kj]   = weight[kj] * x̂[n, s, kj]

``x̂`` depends on the input and the gate but not on ``weight``, so with ``g = dL/dy``::

    dL_n/dweight = sum_s g[n, s] x̂[n, s]
"""
from __future__ import annotations

from typing import Dict, Iterable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..base.registry import Call
from .norm import _eps_of, _TrailingNormRule

__all__ = ["GatedRMSNormRule"]


class GatedRMSNormRule(_TrailingNormRule):
    """transformers' ``MambaRMSNormGated`` (Mamba-2): ``forward(hidden_states, gate=None)``, an
    RMSNorm over groups of ``module.group_size`` channels of ``x * silu(gate)``, computed in
    float32 and cast back, times ``weight`` (module docstring).

    ``multi_io``: the hooks record both inputs (:class:`~gradhooks.base.forms.Call`); ``a.args[0]``
    and the gate ``(B, *, D)`` (``batch_first`` as ``nn.Linear``). Returns ``weight``: ``(B, D)``.

    Raises:
        BatchSizeError: for an input without a batch dim.
    """

    multi_io = True
    position_wise = False  # (a relayout of the records would move the input, not the gate)
    differentiable = False  # (the gate's silu is taken in float32 on the detached records)
    param_names = ("weight",)

    @staticmethod
    def normalized_shape(module: nn.Module) -> Tuple[int, ...]:
        return tuple(module.weight.shape)

    def normalised(self, module: nn.Module, x: Tensor, gate: Optional[Tensor] = None) -> Tensor:
        """``x̂`` ``(*, D)`` in the input's dtype, as the module rounds it."""
        z = x.to(torch.float32)
        if gate is not None:
            z = z * F.silu(gate.to(torch.float32))
        *lead, d = z.shape
        grouped = z.view(*lead, d // module.group_size, module.group_size)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + _eps_of(module))
        return grouped.view(*lead, d).to(x.dtype)

    @staticmethod
    def _inputs(a: Call) -> Tuple[Tensor, Optional[Tensor]]:
        x = a.args[0] if a.args else a.kwargs["hidden_states"]
        gate = a.args[1] if len(a.args) > 1 else a.kwargs.get("gate")
        return x, gate

    def per_sample_grads(self, module: nn.Module, a: Call, g, batch_first: bool,
                         names: Iterable[str]) -> Dict[str, Tensor]:
        """``weight``: ``(B, D)`` = ``sum_s g x̂`` (``g`` the output's grad_output)."""
        if "weight" not in names:
            return {}
        x, gate = self._inputs(a)
        if g is None:  # (no backward reached the output)
            return {"weight": x.new_zeros(self.batch_size(module, x, batch_first), *module.weight.shape)}
        xhat = self.normalised(module, x, gate)
        return {"weight": self.per_entry(module, xhat.to(g.dtype).mul_(g), batch_first)}

    def formula(self, module: nn.Module, x: Tensor, gate: Optional[Tensor] = None) -> Tensor:
        """``weight * x̂`` as the module is assumed to compute it."""
        return module.weight * self.normalised(module, x, gate)

    def probe_input(self, module: nn.Module) -> Optional[Tuple[Tensor, Tensor]]:
        """``(x, gate)``, both ``(2, 3, D)`` in float64, or ``None`` unless ``weight`` ``(D,)`` is
        the only parameter and ``group_size`` divides ``D``."""
        w = getattr(module, "weight", None)
        size = getattr(module, "group_size", None)
        if (not isinstance(w, nn.Parameter) or w.dim() != 1 or not isinstance(size, int)
                or size <= 0 or w.shape[0] % size
                or [n for n, _ in module.named_parameters(recurse=False)] != ["weight"]):
            return None
        return (torch.randn(2, 3, w.shape[0], dtype=torch.float64, device=w.device),
                torch.randn(2, 3, w.shape[0], dtype=torch.float64, device=w.device))
