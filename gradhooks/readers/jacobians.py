"""The per-sample Jacobian reader: ``d f(x_n) / d theta`` for every sample, from one forward and
one backward pass per output coordinate.

Index conventions: ``n`` sample (``B``), ``k`` output coordinate of one sample (the flattened
``S`` of an output ``(B, *S)``: ``C`` classes, or ``T x C`` tokens and classes of a language
model), ``p`` parameter entry (``P`` of them: the hooked trainable parameters, in
``model.named_parameters()`` order, each flattened).

Pass ``k`` sends ``e_k`` into every sample's output (:mod:`gradhooks.readers.passes`); each rule then
forms ``d f_k(x_n) / d theta`` for every ``n`` at once (Goodfellow 2015, arXiv:1510.01799; the
loop over output dimensions of ASDL's ``batch_jacobian`` and BackPACK's ``SqrtGGNExact``).
No ``loss_reduction`` scale is applied: the output is not a loss.
"""
from __future__ import annotations

import math
from typing import Dict, List, Tuple, Union

import torch
from torch import Tensor

from ..base._pool import using_pool
from ..base.errors import GradHooksError
from ..base.utils import no_autocast
from ..core.recorder.capture import Recorder
from .canonical import call_grads
from .passes import PassCall, run_passes

__all__ = ["per_sample_jacobians", "pass_grads", "trainable_params", "unit_cotangents"]


def trainable_params(source) -> List[Tuple[int, str, Tensor]]:
    """``[(id, name, param)]`` of the hooked parameters that require grad, in
    ``model.named_parameters()`` order (the order of the flat ``P`` axis). ``source``: a
    :class:`~gradhooks.core.recorder.records.Batch`, or the recorder of a multi-pass driver (its ``params``,
    ``order`` and ``names``)."""
    found = [(pid, p) for pid, p in source.params.items() if p.requires_grad]
    found.sort(key=lambda item: source.order[item[0]])
    return [(pid, source.names[pid], p) for pid, p in found]


def unit_cotangents(output: Tensor):
    """The ``K`` cotangents ``e_k`` of an output ``(B, *S)`` (``K = prod(S)``): ones at
    coordinate ``k`` of every sample, made one at a time."""
    b, k = output.shape[0], math.prod(output.shape[1:])  # (B = 0 too)
    for i in range(k):
        cot = output.new_zeros(b, k)
        cot[:, i] = 1
        yield cot.view(output.shape)


def pass_grads(calls: List[PassCall], batch_first: bool, scale=None,
               differentiable: bool = False) -> Dict[int, Tensor]:
    """Per-sample gradients ``{id(param): (B, *param.shape)}`` of one backward pass's calls
    (:func:`gradhooks.readers.passes.run_passes`), summed over the calls of a parameter (a module
    called twice, tied weights); ``scale`` and ``differentiable`` as
    :func:`gradhooks.readers.canonical.call_grads`."""
    out: Dict[int, Tensor] = {}
    for call in calls:
        layer = call.layer
        try:
            got = call_grads(layer.rule, layer.module, call.a, call.grads, batch_first,
                             call.names, scale, differentiable=differentiable)
        except GradHooksError as e:
            if f"module {layer.describe()}" in str(e):  # (named by the rule)
                raise
            raise type(e)(f"module {layer.describe()}: {e}") from None
        for local, t in got.items():
            pid = id(layer.params[local])
            if pid in out:
                out[pid].add_(t)
            else:
                out[pid] = t
    return out


def per_sample_jacobians(recorder: Recorder, output: Tensor, *, flat: bool = False,
                         create_graph: bool = False) -> Union[Dict[str, Tensor], Tensor]:
    """Per-sample Jacobians of the model output w.r.t. the hooked trainable parameters.

    Call it after the forward that made ``output`` and before any backward pass through it: it
    runs ``K`` backward passes itself (``retain_graph`` until the last), one per coordinate of a
    sample's output, and reads each pass. For an output ``(B, C)`` that is ``C`` passes; for a
    language model's ``(B, T, C)`` it is ``T C``: pass a selection instead, e.g.
    ``output[:, -1]`` (the last position's logits, ``C`` passes) or ``output[:, :, :5]``, since
    any view of the output is differentiated the same way.

    Args:
        recorder: the :class:`~gradhooks.core.recorder.capture.Recorder` of an attached
            :class:`~gradhooks.GradHooks`.
        output: ``(B, *S)``, made from the current batch by the hooked model; every sample's
            output must depend on that sample only (as for every per-sample result).
        flat: return one ``(B, *S, P)`` tensor instead of the dict.
        create_graph: keep the result differentiable w.r.t. the parameters and the inputs (a
            Jacobian penalty, a differentiable NTK): the passes run with ``create_graph=True``
            and the rules on records that keep their graphs; needs
            ``attach(..., differentiable=True)``. The graph of ``output`` is kept.

    Returns:
        ``{name: (B, *S, *param.shape)}`` in ``model.named_parameters()`` order, entry
        ``[n, k]`` being ``d output[n, k] / d param``; or with ``flat`` the ``(B, *S, P)``
        tensor whose last axis runs over those parameters flattened and concatenated (the dict
        entries are views of it). Parameters the output does not depend on get zeros. In each
        parameter's dtype (a common dtype for ``flat``).

    Raises:
        GradHooksError: if ``output`` does not require grad, or a backward pass already
            reached the hooked layers after the forward (run the forward again).
        BatchSizeError: if ``output`` is not batched on dim 0 like the hooked layers' inputs.
        HigherOrderGradError, GradientMismatchError: as :meth:`~gradhooks.GradHooks.per_sample_grads`.
        GradHooksError: ``create_graph`` without ``attach(..., differentiable=True)``.
        UnsupportedModuleError: ``create_graph`` with a layer whose rule has no
            differentiable path (:attr:`~gradhooks.base.registry.LayerRule.differentiable`).

    Afterwards the batch's records are released (their grad_outputs were the Jacobian passes):
    later reads of the batch raise :class:`~gradhooks.base.errors.RecordsReleasedError`.
    """
    params = trainable_params(recorder)
    if not params:
        raise GradHooksError("per_sample_jacobians(): no hooked parameter requires grad")
    b, shape = output.shape[0], tuple(output.shape[1:])
    k = math.prod(shape)
    sizes = [p.numel() for _, _, p in params]
    dtype = params[0][2].dtype
    for _, _, p in params[1:]:
        dtype = torch.promote_types(dtype, p.dtype)
    jac = output.new_zeros((b, k, sum(sizes)), dtype=dtype)
    offsets, start = {}, 0
    for (pid, _, _), size in zip(params, sizes):
        offsets[pid] = (start, start + size)
        start += size
    cotangents = unit_cotangents(output)
    with no_autocast(), using_pool(recorder.pool):
        for c, calls in enumerate(run_passes(recorder, output, cotangents, k,
                                             "per_sample_jacobians()", create_graph)):
            for pid, t in (pass_grads(calls, recorder.batch_first, None, create_graph)
                           if b else {}).items():
                lo, hi = offsets[pid]  # (an empty batch: no rule runs, as per_sample_grads)
                jac[:, c, lo:hi] = t.reshape(b, hi - lo)
    jac = jac.view(b, *shape, jac.shape[-1])
    if flat:
        return jac
    return {name: jac[..., offsets[pid][0]:offsets[pid][1]].view(b, *shape, *p.shape).to(p.dtype)
            for pid, name, p in params}
