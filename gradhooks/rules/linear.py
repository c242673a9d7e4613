"""Rule for ``nn.Linear`` on inputs of any rank ``(B, ..., in)``.

Forward: ``y[n, s] = W a[n, s] + b`` for every position ``s`` of the extra dims. Per-sample
gradients (Goodfellow 2015, arXiv:1510.01799, sec. 3): ``dL_n/dW = sum_s g[n,s] a[n,s]^T``,
``dL_n/db = sum_s g[n,s]`` -- the canonical form of :mod:`gradhooks.forms` with ``G = 1``.
"""
from __future__ import annotations

from typing import Dict, Iterable, Optional, Tuple

import torch
from torch import Tensor, nn

from .._pool import new_empty
from ..forms import bias_grad, weight_grad
from ..errors import BatchSizeError
from ..registry import LayerRule, register_rule


def _batch_dim(x: Tensor, batch_first: bool) -> int:
    # batch_first=False follows torch's sequence layout (T, B, ..., in); a 2-D (B, in) input has
    # only one candidate batch dim whichever the flag (e.g. a head on an RNN's last state).
    return 0 if batch_first or x.dim() < 3 else 1


@register_rule(nn.Linear)
class LinearRule(LayerRule):
    """``nn.Linear``: ``a`` is ``(B, *, in)`` (or ``(T, B, *, in)`` with ``batch_first=False``).

    Returns ``weight``: ``(B, out, in)``, ``bias``: ``(B, out)``; the extra dims ``*`` are
    weight-sharing positions summed per sample.
    """

    weight_linear_in_input = True
    has_linear_form = True

    def batch_size(self, module: nn.Module, x: Tensor, batch_first: bool) -> int:
        if x.dim() < 2:
            raise BatchSizeError(
                f"got an unbatched input of shape {tuple(x.shape)}; per-sample gradients need a "
                f"batch dimension: pass (B, {module.in_features}) (e.g. x.unsqueeze(0))"
            )
        return x.shape[_batch_dim(x, batch_first)]

    def linear_form(self, module: nn.Module, a: Optional[Tensor], g: Tensor, batch_first: bool
                    ) -> Tuple[Optional[Tensor], Tensor]:
        """Canonical form (views where the layout allows): ``a`` ``(N, 1, S, in)``, ``g``
        ``(N, 1, S, out)``, the positions ``S`` being the flattened extra dims."""
        if _batch_dim(g, batch_first) == 1:
            g = g.transpose(0, 1)
            a = None if a is None else a.transpose(0, 1)
        n = g.shape[0]
        return (None if a is None else a.reshape(n, 1, -1, a.shape[-1]),
                g.reshape(n, 1, -1, g.shape[-1]))

    def per_sample_grads(
        self, module: nn.Module, a: Tensor, g: Tensor, batch_first: bool, names: Iterable[str]
    ) -> Dict[str, Tensor]:
        if a.dim() == 2:  # (B, in), S = 1: outer products, without the canonical views
            out = {}
            if "weight" in names:
                w = new_empty((a.shape[0], *module.weight.shape), a)
                out["weight"] = torch.mul(g.unsqueeze(2), a.unsqueeze(1), out=w)
            if "bias" in names:
                out["bias"] = new_empty(g.shape, g).copy_(g)
            return out
        a, g = self.linear_form(module, a, g, batch_first)
        n = a.shape[0]
        out = {}
        if "weight" in names:
            out["weight"] = weight_grad(a, g, (n, *module.weight.shape))
        if "bias" in names:
            out["bias"] = bias_grad(g, (n, *module.bias.shape))
        return out
