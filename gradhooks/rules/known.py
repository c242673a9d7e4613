"""Layers of other libraries that compute what a gradhooks rule computes: the one list of them.

gradhooks imports neither transformers nor timm nor torchvision, so it cannot register their
classes by type. Instead :data:`KNOWN` maps a class *name* to the rules that may describe it,
and :func:`recognise_known` (a recogniser, :func:`gradhooks.base.registry.register_recogniser`) checks,
once per module at :func:`gradhooks.attach`, that the module really computes what the rule
assumes: it runs the module's ``forward`` on a small random probe input (the rule's
``probe_input``; a fixed seed, the caller's random state untouched) and compares the output with
the rule's own ``formula`` to a few units in the last place. The first rule that matches is used;
if none does (a class that only shares the name, an ``inplace`` layer scale), a
:class:`~gradhooks.base.errors.FallbackWarning` names the module and the lookup goes on as
for any other class (usually to the ``torch.func`` fallback, which is exact but costs a
vmapped replay).

Names (and where the classes live): ``Conv1D`` (``transformers.pytorch_utils``, GPT/GPT-2);
``*RMSNorm`` and ``T5LayerNorm`` (transformers' Llama, Qwen2, Mistral ... and T5 models),
``RmsNorm`` (``timm.layers``); ``LayerNorm2d`` (``timm.layers``,
``torchvision.models.convnext``); ``LayerNorm`` (``timm.layers``, an ``nn.LayerNorm`` subclass
with its own forward); ``BatchNormAct2d`` (``timm.layers``); ``LayerScale``, ``LayerScale2d``
(``timm.layers``, ``timm.models.vision_transformer``); ``*ScaledWordEmbedding`` (transformers'
BART, M2M100, NLLB ...: a lookup times ``embed_scale``); ``*RMSNormGated`` (transformers'
Mamba-2 ``MambaRMSNormGated``); ``MambaMixer``, ``Mamba2Mixer`` (transformers' Mamba, Mamba-2). The ``*RMSNorm``
names include Gemma's ``(1 + weight)`` and OLMo-2's scale-before-cast variants
(:class:`~gradhooks.rules.norm.RMSNormLikeRule`'s ``scale``). A probe costs one forward of a
``(2, 3, D)`` or ``(2, C, 3, 2)`` tensor per module and rule tried.
"""
from __future__ import annotations

import warnings
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from ..base.errors import FallbackWarning
from ..base.registry import LayerRule, find_type_rule, register_recogniser
from ..base.torch_internals import DTensor, own_parameters
from ..base.utils import paused
from .embedding import ScaledEmbeddingRule
from .linear import TransposedLinearRule
from .mamba import MambaMixerRule
from .mamba2 import Mamba2MixerRule
from .norm import BatchNormActRule, LayerNorm2dRule, RMSNormLikeRule
from .norm_variants import GatedRMSNormRule
from .scale import ScaleRule

__all__ = ["KNOWN", "SUFFIXES", "recognise_known", "probe_matches"]

#: The RMSNorm variants, the most common first (each costs a probe until one matches):
#: Llama's (and Mamba's, OLMoE's), T5's, timm's; OLMo-2's weight before the cast back; Gemma's
#: ``(1 + weight)`` (Gemma, Gemma-2, Gemma-3).
_RMS = (RMSNormLikeRule("float32"), RMSNormLikeRule("float32-variance"), RMSNormLikeRule("input"),
        RMSNormLikeRule("float32", "weight-float32"),
        RMSNormLikeRule("float32", "one-plus-weight-float32"))

#: Class name -> the rules that may describe it, tried in order.
KNOWN: Dict[str, Tuple[LayerRule, ...]] = {
    "Conv1D": (TransposedLinearRule(),),
    "T5LayerNorm": _RMS,
    "RmsNorm": _RMS,
    "LayerNorm2d": (LayerNorm2dRule(),),
    "LayerNorm": (find_type_rule(nn.LayerNorm),),
    "BatchNormAct2d": (BatchNormActRule(),),
    "LayerScale": (ScaleRule(-1),),
    "LayerScale2d": (ScaleRule(1),),
    "MambaMixer": (MambaMixerRule(),),
    "Mamba2Mixer": (Mamba2MixerRule(),),
}

#: Class-name endings -> rules, for families copied under many model names
#: (``LlamaRMSNorm``, ``Qwen2RMSNorm``, ``MistralRMSNorm`` ...).
SUFFIXES: Dict[str, Tuple[LayerRule, ...]] = {"RMSNorm": _RMS,
                                               "RMSNormGated": (GatedRMSNormRule(),),
                                               "ScaledWordEmbedding": (ScaledEmbeddingRule(),)}


def _whole(module: nn.Module) -> nn.Module:
    """``module``, or where its own parameters are FSDP2 shards (``DTensor``, after
    ``fully_shard`` of a parent, such as a transformer block) a shallow copy holding their full tensors, for the probe
    to run on: one all-gather per parameter, which every rank runs in the same order, as they
    attach the same model. (The copy's ``forward`` is called directly: FSDP's hooks stay out.)"""
    own = own_parameters(module)
    if DTensor is None or not any(isinstance(p, DTensor) for p in own.values()):
        return module
    whole = object.__new__(type(module))  # (FSDP's class swap runs __init__ in __new__)
    whole.__dict__.update(module.__dict__)
    whole.__dict__["_parameters"] = {n: p if not isinstance(p, DTensor) else
                                     nn.Parameter(p.detach().full_tensor(), p.requires_grad)
                                     for n, p in own.items()}
    return whole


def probe_matches(module: nn.Module, rule: LayerRule) -> Tuple[bool, str]:
    """Whether ``module`` computes ``rule.formula`` on ``rule.probe_input(module)`` (a tensor,
    or a tuple of the forward's positional inputs: a gated norm's input and gate).

    The module runs in eval mode (restored after, per submodule) without autograd and with
    every gradhooks hook paused; the random input comes from a fixed seed inside a forked
    random state. Its own parameters, where they are FSDP2 shards, are gathered whole for the
    probe (:func:`_whole`). Returns ``(ok, why)``, ``why`` saying what differed.
    """
    module = _whole(module)
    modes = [(m, m.training) for m in module.modules()]
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=cuda), torch.no_grad(), paused():
            torch.manual_seed(0)
            x = rule.probe_input(module)
            if x is None:
                return False, "its parameters are not the rule's"
            xs = x if isinstance(x, tuple) else (x,)  # (several inputs: a gated norm's gate)
            module.train(False)
            want = rule.formula(module, *xs)
            given = tuple(t.clone() for t in xs)
            got = module.forward(*given)
            if isinstance(got, Tensor) and got.data_ptr() == given[0].data_ptr():
                return False, ("it writes its output into its input (inplace), which destroys "
                               "the recorded input")
    except Exception as e:  # a probe the module cannot take is a mismatch, not an error
        return False, f"the probe raised {type(e).__name__}: {e}"
    finally:
        for m, mode in modes:
            m.training = mode
    if not isinstance(got, Tensor) or got.shape != want.shape or got.dtype != want.dtype:
        return False, (f"it returned {type(got).__name__} {getattr(got, 'shape', '')} "
                       f"{getattr(got, 'dtype', '')}, the rule {tuple(want.shape)} {want.dtype}")
    tol = 64 * torch.finfo(want.dtype).eps
    err = (got - want).abs().max().item()
    scale = want.abs().max().item()
    if not err <= tol * max(scale, 1e-30):
        return False, f"its output differs from the rule's formula by {err:.2g} (max |y| {scale:.2g})"
    return True, ""


@register_recogniser
def recognise_known(module: nn.Module, path: str) -> Optional[LayerRule]:
    """The first rule of :data:`KNOWN` / :data:`SUFFIXES` for ``type(module).__name__`` whose
    probe matches (:func:`probe_matches`), else ``None``, with a
    :class:`~gradhooks.base.errors.FallbackWarning` if the name was known."""
    name = type(module).__name__
    rules = KNOWN.get(name)
    if rules is None:
        rules = next((r for suffix, r in SUFFIXES.items() if name.endswith(suffix)), None)
    if rules is None:
        return None
    if name == "LayerNorm" and not isinstance(module, nn.LayerNorm):
        return None
    why = ""
    for rule in rules:
        ok, why = probe_matches(module, rule)
        if ok:
            return rule
    warnings.warn(
        f"module {path or '<root>'!r} ({type(module).__module__}.{type(module).__qualname__}) is "
        f"named like a layer gradhooks has a rule for ({type(rules[0]).__name__}), but {why}; "
        f"it is treated as an unknown module (usually the torch.func fallback)",
        FallbackWarning, stacklevel=2)
    return None
