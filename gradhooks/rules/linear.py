"""Rule for ``nn.Linear`` on inputs of any rank ``(B, ..., in)``.

Forward: ``y[n, s] = W a[n, s] + b`` for every position ``s`` of the extra dims. Per-sample
gradients (Goodfellow 2015, arXiv:1510.01799, sec. 3): ``dL_n/dW = sum_s g[n,s] a[n,s]^T``,
``dL_n/db = sum_s g[n,s]`` -- the canonical form of :mod:`gradhooks.base.forms` with ``G = 1``.
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, Optional, Tuple

import torch
from torch import Tensor, nn

from ..base._pool import new_empty
from ..base.errors import BatchSizeError
from ..base.forms import bias_grad, weight_grad
from ..base.registry import LayerRule, register_rule


def _batch_dim(x: Tensor, batch_first: bool) -> int:
    # batch_first=False follows torch's sequence layout (T, B, ..., in); a 2-D (B, in) input has
    # only one candidate batch dim whichever the flag (e.g. a head on an RNN's last state).
    return 0 if batch_first or x.dim() < 3 else 1


def _linear_batch_size(x: Tensor, batch_first: bool, fan_in: int) -> int:
    # The batch size of a Linear-like layer's input (B, *, in), or BatchSizeError.
    if x.dim() < 2:
        raise BatchSizeError(
            f"got an unbatched input of shape {tuple(x.shape)}; per-sample gradients need a "
            f"batch dimension: pass (B, {fan_in}) (e.g. x.unsqueeze(0))"
        )
    return x.shape[_batch_dim(x, batch_first)]


@register_rule(nn.Linear)
class LinearRule(LayerRule):
    """``nn.Linear``: ``a`` is ``(B, *, in)`` (or ``(T, B, *, in)`` with ``batch_first=False``).

    Returns ``weight``: ``(B, out, in)``, ``bias``: ``(B, out)``; the extra dims ``*`` are
    weight-sharing positions summed per sample.
    """

    position_wise = True

    differentiable = True

    weight_linear_in_input = True
    has_linear_form = True

    def batch_size(self, module: nn.Module, x: Tensor, batch_first: bool) -> int:
        return _linear_batch_size(x, batch_first, module.in_features)

    def linear_form(self, module: nn.Module, a: Optional[Tensor], g: Tensor, batch_first: bool
                    ) -> Tuple[Optional[Tensor], Tensor]:
        """Canonical form (views where the layout allows): ``a`` ``(N, 1, S, in)``, ``g``
        ``(N, 1, S, out)``, the positions ``S`` being the flattened extra dims."""
        if _batch_dim(g, batch_first) == 1:
            g = g.transpose(0, 1)
            a = None if a is None else a.transpose(0, 1)
        n, s = g.shape[0], math.prod(g.shape[1:-1])  # (explicit S: -1 is ambiguous for B = 0)
        return (None if a is None else a.reshape(n, 1, s, a.shape[-1]),
                g.reshape(n, 1, s, g.shape[-1]))

    def per_sample_grads(
        self, module: nn.Module, a: Tensor, g: Tensor, batch_first: bool, names: Iterable[str]
    ) -> Dict[str, Tensor]:
        # (weight_transposed: a stored (I, O) weight, sum_s a g^T instead of sum_s g a^T)
        out = {}
        if a.dim() == 2:  # (B, in), S = 1: outer products, without the canonical views
            if "weight" in names:
                w = new_empty((a.shape[0], *module.weight.shape), a if a.requires_grad else g)
                left, right = (a, g) if self.weight_transposed else (g, a)
                out["weight"] = torch.mul(left.unsqueeze(2), right.unsqueeze(1), out=w)
            if "bias" in names:
                b = new_empty(g.shape, g)
                out["bias"] = g.clone() if b is None else b.copy_(g)
            return out
        a, g = self.linear_form(module, a, g, batch_first)  # (N, 1, S, in), (N, 1, S, out)
        n = a.shape[0]
        if "weight" in names:
            if self.weight_transposed:
                w = new_empty((n, *module.weight.shape), a if a.requires_grad else g)
                out["weight"] = torch.matmul(a[:, 0].transpose(1, 2), g[:, 0], out=w)
            else:
                out["weight"] = weight_grad(a, g, (n, *module.weight.shape))
        if "bias" in names:
            out["bias"] = bias_grad(g, (n, *module.bias.shape))
        return out


class TransposedLinearRule(LinearRule):
    """A Linear layer that stores its weight transposed: transformers' ``Conv1D`` (GPT, GPT-2;
    Radford et al. 2018/2019), ``y = x @ W + b`` with ``weight`` ``(I, O)`` and ``bias`` ``(O,)``.

    Not registered by type (gradhooks does not import transformers): :mod:`gradhooks.rules.known`
    recognises the class by name and checks :meth:`formula` against the module on a probe input.
    ``a`` is ``(B, *, I)``, ``g`` ``(B, *, O)`` (batch on dim 1 of 3-D+ inputs with
    ``batch_first=False``, as for ``nn.Linear``). The canonical form (:meth:`linear_form`) is
    ``nn.Linear``'s, whose ``W[g]`` is ``weight.T`` here (:attr:`weight_transposed`); per-sample
    gradients (Goodfellow 2015, sec. 3, transposed)::

        dL_n/dweight = sum_s a[n, s] g[n, s]^T   (I, O)        dL_n/dbias = sum_s g[n, s]

    Returns ``weight``: ``(B, I, O)``, ``bias``: ``(B, O)``.

    Raises:
        BatchSizeError: for an input without a batch dim.
    """

    weight_transposed = True

    def batch_size(self, module: nn.Module, x: Tensor, batch_first: bool) -> int:
        return _linear_batch_size(x, batch_first, module.weight.shape[0])

    def formula(self, module: nn.Module, x: Tensor) -> Tensor:
        """What the rule assumes the module computes: ``x @ weight + bias``."""
        y = x @ module.weight
        return y if module.bias is None else y + module.bias

    def probe_input(self, module: nn.Module) -> Optional[Tensor]:
        """A small ``(2, 3, I)`` input for :mod:`gradhooks.rules.known`'s check, or ``None``
        when the parameters are not those of a transposed Linear."""
        w, b = getattr(module, "weight", None), getattr(module, "bias", None)
        if not isinstance(w, nn.Parameter) or w.dim() != 2:
            return None
        if b is not None and (not isinstance(b, nn.Parameter) or b.shape != (w.shape[1],)):
            return None
        if {n for n, _ in module.named_parameters(recurse=False)} - {"weight", "bias"}:
            return None
        return torch.randn(2, 3, w.shape[0], dtype=w.dtype, device=w.device)

    def weighted_sum(self, module: nn.Module, a: Tensor, g: Tensor, c: Tensor, batch_first: bool,
                     names: Iterable[str], out: Optional[Dict[str, Tensor]] = None
                     ) -> Dict[str, Tensor]:
        """``sum_{n,s} c_n a[n,s] g[n,s]^T`` ``(I, O)`` for the weight (one ``mm``), the bias
        as :meth:`LayerRule.weighted_sum` (Bu et al. 2023, sec. 3, book-keeping)."""
        out = out or {}
        names = tuple(names)
        result = {}
        if "bias" in names:
            result.update(super().weighted_sum(module, None, g, c, batch_first, ("bias",), out))
        if "weight" in names:
            a_c, g_c = self.linear_form(module, a, g, batch_first)
            n = a_c.shape[0]
            if a_c.numel() < g_c.numel():
                a_c = a_c * c.view(n, 1, 1, 1)
            else:
                g_c = g_c * c.view(n, 1, 1, 1)
            result["weight"] = torch.mm(a_c.reshape(-1, a_c.shape[-1]).t(), g_c.reshape(-1, g_c.shape[-1]),
                                        out=out.get("weight"))
        return result
