"""The per-sample gradient reader: ``{name: (B, *param.shape)}`` from a batch's records.

Each record is handed to its layer's rule (:meth:`~gradhooks.registry.LayerRule.per_sample_grads`,
the per-layer math of :mod:`gradhooks.rules`), the ``loss_reduction`` scale of the batch snapshot
is applied to whichever of input, grad_output or result is smallest, calls of one parameter
(a layer called several times, tied weights) are summed, and the sum check
(:mod:`gradhooks.checks`) runs when due.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable, Optional

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from ._pool import using_pool
from .capture import Recorder
from .checks import check_sums
from .errors import GradHooksError, UnsupportedModuleError
from .utils import LOW_PRECISION, compute_dtype, no_autocast, tensors

__all__ = ["per_sample_grads", "call_grads", "carries_graph"]


def per_sample_grads(recorder: Recorder, *, retain_records: bool = False) -> Dict[str, Tensor]:
    """Per-sample gradients of every trainable parameter the backward reached (the reader
    behind :meth:`gradhooks.GradHooks.per_sample_grads`, whose docstring gives the arguments,
    the result ``{name: (B, *param.shape)}`` and the errors).

    The result is cached by the recorder until the next backward pass or batch, and set as
    ``param.grad_sample``. Unless ``retain_records``, each record is released as soon as its
    rule has formed its part, so the read's peak memory is the result plus one layer's records.
    """
    if recorder.result is not None:
        return recorder.result
    batch = recorder.snapshot("per_sample_grads()", release=not retain_records)
    raw: Dict[int, Tensor] = {}
    low: Dict[int, torch.dtype] = {}
    if batch.size == 0:  # an empty (Poisson) batch: (0, *shape), no rule runs
        for cap in batch.records:
            for local in cap.names:
                p = cap.layer.params[local]
                raw[id(p)] = p.new_zeros((0, *p.shape))
            if batch.releasing:
                cap.release()
    differentiable = recorder.differentiable and carries_graph(batch.records)
    with no_autocast(), using_pool(batch.pool):
        for cap in batch.records if batch.size else ():
            layer = cap.layer
            try:  # (no local holds the records: a released cap frees them during the call)
                out = call_grads(layer.rule, layer.module, cap.a, cap.grads_arg(),
                                 batch.batch_first, cap.names, batch.scale,
                                 cap.release if batch.releasing else None, differentiable)
            except GradHooksError as e:
                raise type(e)(f"module {layer.describe()}: {e}") from None
            for local, t in out.items():
                pid = id(layer.params[local])
                if cap.low is not None:
                    low[pid] = cap.low
                if pid in raw:
                    raw[pid].add_(t)  # another call, or a tied module (rules return owned tensors)
                else:
                    raw[pid] = t
    batch.check_unrecorded(raw)
    if batch.check_key is not None and batch.size:
        check_sums([(batch.names[pid], t, batch.totals.get(pid), low.get(pid, t.dtype))
                    for pid, t in raw.items()], batch.scale)
        batch.check_passed()
    result = {}
    for pid in sorted(raw, key=batch.order.__getitem__):
        p = batch.params[pid]
        t = raw[pid]
        if t.dtype != p.dtype:
            t = t.to(p.dtype)
        result[batch.names[pid]] = t
        p.grad_sample = t
    return recorder.keep_result(result)


def carries_graph(records) -> bool:
    """Whether any of the batch's records carries an autograd graph (``attach(...,
    differentiable=True)`` and a ``backward(create_graph=True)``): the read is differentiable."""
    return any(isinstance(t, Tensor) and t.requires_grad
               for cap in records for t in tensors((cap.a, cap.grads)))


def call_grads(rule, module: nn.Module, a, grads, batch_first: bool,
               names: Iterable[str], scale: Optional[float],
               release: Optional[Callable[[], None]] = None,
               differentiable: bool = False) -> Dict[str, Tensor]:
    """Per-sample gradients of one recorded call, with the ``loss_reduction`` scale applied.

    Args:
        rule: the module's :class:`~gradhooks.registry.LayerRule`.
        module: the layer.
        a: the call's input activations (a :class:`~gradhooks.forms.Call` for ``multi_io``
            rules).
        grads: the grad_outputs of every backward pass through the call (summed: the
            gradients are linear in the grad_output); for ``multi_io`` rules, the output's
            structure holding each output tensor's summed grad_output or ``None``.
        batch_first: as given to :func:`gradhooks.attach`.
        names: the parameters wanted.
        scale: from :attr:`~gradhooks.capture.Batch.scale` (``None``: no scaling).
        release: called once the rule no longer needs the caller's references to ``a`` and
            ``grads`` (after scaled copies are made): the caller drops its records there, so
            that an unscaled grad_output is not held beside its copy while the rule runs.
        differentiable: a differentiable read (``attach(..., differentiable=True)`` records,
            ``create_graph``): the result carries the autograd graph of ``a`` and ``grads``.

    Returns:
        ``{name: (B, *param.shape)}``, scaled. The scale is applied to whichever is smaller,
        the grad_output or the per-sample result (for a Linear on ``(B, in)`` the grad_output
        is ``in`` times smaller, which saves a full pass over the result). Inputs and
        grad_outputs of lower precision than float32 (autocast) are promoted to float32 first.

    Raises:
        UnsupportedModuleError: for a differentiable read and a rule without a differentiable
            path (:attr:`~gradhooks.registry.LayerRule.differentiable`: one that reads its
            module's parameters itself, a replay, would drop their graph).
    """
    names = tuple(names)
    if differentiable:
        if not rule.differentiable:
            raise UnsupportedModuleError(
                f"{type(module).__name__}'s rule has no differentiable path, so its per-sample "
                f"result would drop the autograd graph this read was asked to keep "
                f"(differentiable=True with create_graph); differentiable reads cover Linear, "
                f"Conv1D, Conv, Embedding and the affine norm layers: freeze this module's "
                f"parameters for the read, or use torch.func for it")
        with torch.enable_grad():
            return _call_grads(rule, module, a, grads, batch_first, names, scale, release)
    return _call_grads(rule, module, a, grads, batch_first, names, scale, release)


def _call_grads(rule, module: nn.Module, a, grads, batch_first: bool, names: tuple,
                scale: Optional[float], release: Optional[Callable[[], None]]
                ) -> Dict[str, Tensor]:
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
    if a.dtype != g.dtype or a.dtype in LOW_PRECISION:
        dt = compute_dtype(a, g)
        a, g = a.to(dt), g.to(dt)
    scale_a = scale_g = False
    if scale is not None:
        own = module._parameters  # (faster than nn.Module.__getattr__)
        out_numel = g.shape[0] * sum((own[n] if n in own else module.get_parameter(n)).numel()
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

