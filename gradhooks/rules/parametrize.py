"""Per-sample gradients of parametrized tensors (``torch.nn.utils.parametrize``).

``torch.nn.utils.parametrize.register_parametrization`` (and what is built on it:
``torch.nn.utils.parametrizations.weight_norm``, ``spectral_norm``, ``orthogonal``) replaces a
module's parameter ``W`` by a property computed from *original* tensors, the trainable
parameters ``module.parametrizations.W.original`` (or ``original0``, ``original1`` ...)::

    W = P(θ)                 (P: the ParametrizationList module.parametrizations.W)

The module's class becomes a subclass ``Parametrized<Class>`` made at run time that keeps the
parent's ``forward``, so the layer's own rule still describes the call: it gives the per-sample
gradient of the effective tensor, ``dL_n/dW`` ``(B, *W.shape)``. The originals' per-sample
gradients follow by the chain rule, the vector-Jacobian product of ``P`` at the current
originals applied to each sample's ``dL_n/dW``::

    dL_n/dθ = (dP/dθ)^T dL_n/dW          vmapped over n (torch.func.vjp + vmap)

``P`` runs once per read (its forward), its backward once per sample, batched. For
``weight_norm`` (``W = g v / ||v||``, Salimans & Kingma 2016, arXiv:1602.07868, eq. 3) this is
exact; for ``spectral_norm`` it differentiates through ``W / sigma(W)`` with the power-iteration
vectors held fixed, which is what autograd does in eval mode (in training mode the forward runs
a power iteration first, changing the buffers ``_u``, ``_v``; the vjp reads them after the
forward, so call the read before the next forward).

The recogniser registered here claims every parametrized module whose original class has a
rule; its parameters are the rule's own ones that are not parametrized plus the originals,
named relative to the module (``"parametrizations.weight.original0"``), so
:func:`gradhooks.core.recorder.records.find_layers` does not hook the ``ParametrizationList`` itself.
"""
from __future__ import annotations

import warnings
from typing import Dict, Iterable, Optional

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap
from torch.nn.utils import parametrize as _parametrize

from ..base.registry import LayerRule, find_type_rule, register_recogniser
from ..base.utils import paused

__all__ = ["ParametrizedRule"]

_PREFIX = "parametrizations."


class ParametrizedRule(LayerRule):
    """The rule of a parametrized module: its original class's rule (``base``) for the effective
    tensors, then the chain rule through each parametrization to its originals.

    ``a``, ``g``, ``batch_first``: as ``base`` takes them. Returns, for the wanted names,
    ``{"parametrizations.<t>.original<k>": (B, *original.shape), <other>: (B, *param.shape)}``.
    Readers get no linear form (the per-sample tensor of the effective weight is formed and
    pulled back), so norms and clipping of these parameters are materialised.
    """

    def __init__(self, base: LayerRule):
        self.base = base
        self.multi_io = base.multi_io
        self.check_always = base.check_always
        self.param_names = base.param_names

    def params_of(self, module: nn.Module) -> Dict[str, nn.Parameter]:
        own = self.base.params_of(module)
        for t, plist in module.parametrizations.items():
            if t in self.base.param_names:
                for k, p in plist.named_parameters(recurse=False):
                    own[f"{_PREFIX}{t}.{k}"] = p
        return own

    def call_batch_size(self, module: nn.Module, args: tuple, kwargs: dict, batch_first: bool) -> int:
        return self.base.call_batch_size(module, args, kwargs, batch_first)

    def batch_size(self, module: nn.Module, x: Tensor, batch_first: bool) -> int:
        return self.base.batch_size(module, x, batch_first)

    def check_call(self, module: nn.Module, args: tuple, kwargs: dict, options: Dict[str, object]) -> None:
        self.base.check_call(module, args, kwargs, options)

    def internal(self, module: nn.Module, args: tuple, kwargs: dict, output) -> Optional[tuple]:
        return self.base.internal(module, args, kwargs, output)

    def per_sample_grads(self, module: nn.Module, a, g, batch_first: bool,
                         names: Iterable[str]) -> Dict[str, Tensor]:
        names = tuple(names)
        pulled = {n.split(".")[1] for n in names if n.startswith(_PREFIX)}
        direct = tuple(n for n in names if not n.startswith(_PREFIX)) + tuple(sorted(pulled))
        out = self.base.per_sample_grads(module, a, g, batch_first, direct)
        for t in pulled:
            grad_w = out.pop(t)  # (B, *W.shape)
            plist = module.parametrizations[t]
            originals = {k: p.detach() for k, p in plist.named_parameters(recurse=False)}
            with paused(), torch.enable_grad(), warnings.catch_warnings():
                # weight_norm's backward has no batching rule: vmap loops over the samples in
                # C++ and says so on every read; the result is exact, the cost is in the README
                warnings.filterwarnings("ignore", message="There is a performance drop")
                w, pull = vjp(lambda o: functional_call(plist, o, ()), originals)
                per = vmap(pull)(grad_w.to(w.dtype))[0]
            for k, v in per.items():
                name = f"{_PREFIX}{t}.{k}"
                if name in names:
                    out[name] = v.detach().contiguous()
        return out


_WRAPPED: Dict[int, ParametrizedRule] = {}


@register_recogniser
def recognise_parametrized(module: nn.Module, path: str) -> Optional[LayerRule]:
    """A :class:`ParametrizedRule` for a module with ``torch.nn.utils.parametrize``
    parametrizations whose original class has a registered rule; ``None`` otherwise (the
    module then goes to the fallback, which cannot replay the parametrization)."""
    if not _parametrize.is_parametrized(module):
        return None
    original = type(module).__bases__[0]
    base = find_type_rule(original, path)
    if base is None or base.multi_io:
        return None
    if id(base) not in _WRAPPED:
        _WRAPPED[id(base)] = ParametrizedRule(base)
    return _WRAPPED[id(base)]
