"""Gram matrices of per-sample gradients and the empirical NTK, without the ``(B, P)``
per-sample gradients: within a batch and between two batches.

Index conventions: ``n`` / ``m`` samples of the first / second batch (``B1``, ``B2``), ``c`` /
``d`` output coordinates (backward passes: ``1`` for the loss gradient, ``C`` for the NTK),
``g`` group, ``s`` / ``t`` weight-sharing positions, ``i`` / ``o`` in / out features.

What is kept of a batch (:class:`GradientFeatures`): for a layer linear in its weight, the
canonical form of :mod:`gradhooks.base.forms` of all its calls (positions of several calls
concatenated: they share the weight), the input extended by a column of ones when the bias is
covered (``ã = [a; 1]``: ``[W b]`` is then one matrix, whose per-sample gradient is
``sum_s g_s ã_s^T``); for every other layer (recurrent, attention, norm, embedding, the
fallback, and parameters tied between modules) the per-sample gradients, flattened. Then, per
layer (Li et al. 2022, arXiv:2110.05679, sec. 4 for the within-sample case; ASDL's
``(A A^T) ∘ (G G^T)`` for ``S = 1``)::

    K[n, m, c, d] = sum_g sum_{s,t} (ã[n,g,s] . ã'[m,g,t]) (g[c,n,g,s] . g'[d,m,g,t])

or, where that costs more multiply-adds than forming the per-sample ``(O, I)`` matrices and
contracting them (:func:`gram_form_cheaper`: convolutions, token sequences with many passes),
the matrices. The layers' terms add up.

* :func:`gradient_features` after the loss's backward: per-sample gradients of each sample's
  own loss (as :meth:`~gradhooks.GradHooks.per_sample_grads`); :func:`gram` gives
  ``<grad l_n, grad l_m>`` ``(B1, B2)``.
* :func:`jacobian_features` from an output ``(B, C)``: ``C`` backward passes
  (:mod:`gradhooks.readers.passes`); :func:`gram` gives the empirical NTK ``J_n J_m^T`` ``(B1, B2, C,
  C)`` (Jacot et al. 2018; Novak et al. 2022, arXiv:2206.08720, "structured derivatives").
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional

import torch
from torch import Tensor

from ..base._pool import using_pool
from ..base.errors import GradHooksError
from ..base.utils import no_autocast
from ..core.recorder.capture import Recorder
from ..core.recorder.records import Batch
from .canonical import augmented, canonical_call
from .jacobians import pass_grads, unit_cotangents
from .passes import PassCall, check_output, run_passes

__all__ = ["GradientFeatures", "LinearEntry", "gradient_features", "jacobian_features", "gram",
           "gram_form_cheaper"]


class LinearEntry(NamedTuple):
    """A layer linear in its weight: ``a`` ``(N, G, S, I')`` (``I' = I + 1`` with the bias's
    ones column; ``I' = 1``, all ones, for a bias alone), ``g`` ``(C, N, G, S, O)``, own-loss
    scale applied. Per-sample gradient of ``[W b]`` for pass ``c``: ``sum_s g[c,n,:,s] ã[n,:,s]^T``."""

    a: Tensor
    g: Tensor


class GradientFeatures:
    """What :func:`gram` and :func:`~gradhooks.readers.attribution.projections.projected_grads` need of one batch.

    Attributes:
        size: ``B``.
        passes: ``1`` (loss gradients) or ``C`` (Jacobian rows).
        linear: ``{module path: LinearEntry}``, in ``model.named_modules()`` order.
        dense: ``{parameter name: (C, B, *param.shape)}`` per-sample gradients of the other
            parameters, in ``model.named_parameters()`` order.
    """

    def __init__(self, size: int, passes: int, linear: Dict[str, LinearEntry],
                 dense: Dict[str, Tensor]):
        self.size, self.passes, self.linear, self.dense = size, passes, linear, dense

    def __repr__(self) -> str:
        return (f"GradientFeatures(B={self.size}, passes={self.passes}, linear={list(self.linear)}, "
                f"dense={list(self.dense)})")


def _linear_ok(calls: List[PassCall]) -> Dict[int, bool]:
    # Layers whose calls can be kept in canonical form: a linear form, single output, and no
    # parameter shared with another layer (a tied weight's gradient mixes two layers' forms).
    owners: Dict[int, set] = {}
    for call in calls:
        for n in call.names:
            owners.setdefault(id(call.layer.params[n]), set()).add(id(call.layer))
    ok = {}
    for call in calls:
        rule = call.layer.rule
        alone = all(len(owners[id(call.layer.params[n])]) == 1 for n in call.names)
        ok[id(call.layer)] = ok.get(id(call.layer), True) and (
            rule.has_linear_form and not rule.multi_io and alone)
    return ok


def _features(call: PassCall, batch_first: bool, scale: Optional[float], want_a: bool):
    # ``(ã, g)`` of a call (canonical form, own-loss scale on g, the bias's ones column), or
    # ``(None, g)`` for the later passes (the input is the first pass's).
    weight = "weight" in call.names
    a, g = canonical_call(call, batch_first, form_a=want_a and weight, scale=scale)
    if not want_a:
        return None, g
    return augmented(a, g, "bias" in call.names), g


def _collect(source, pass_calls: List[List[PassCall]], scale: Optional[float],
             size: int) -> GradientFeatures:
    # source: the Batch (gradient_features), or the recorder of the multi-pass driver
    # (jacobian_features): its batch_first, names, order and layers. pass_calls: per backward
    # pass, its calls (the same layers reached in every pass). Entries in the model's order
    # (named_modules / named_parameters), whatever order the backward took.
    batch_first, names, order = source.batch_first, source.names, source.order
    layer_rank = {layer.path: i for i, layer in enumerate(source.layers)}
    ok = _linear_ok(pass_calls[0])
    linear_a: Dict[str, List[Tensor]] = {}
    linear_g: Dict[str, List[List[Tensor]]] = {}
    dense: Dict[int, List[Tensor]] = {}
    for p, calls in enumerate(pass_calls):
        other = []
        per_layer: Dict[str, List[Tensor]] = {}
        for call in calls:
            if not ok.get(id(call.layer), False):
                other.append(call)
                continue
            path = call.layer.path
            a, g = _features(call, batch_first, scale, want_a=p == 0)
            if p == 0:
                linear_a.setdefault(path, []).append(a)
            per_layer.setdefault(path, []).append(g)
        for path, gs in per_layer.items():
            linear_g.setdefault(path, []).append(torch.cat(gs, 2) if len(gs) > 1 else gs[0])
        for pid, t in (pass_grads(other, batch_first, scale) if size else _empty(other)).items():
            dense.setdefault(pid, []).append(t)
    linear = {path: LinearEntry(torch.cat(a, 2) if len(a) > 1 else a[0], _stacked(linear_g[path]))
              for path, a in sorted(linear_a.items(), key=lambda item: layer_rank[item[0]])}
    return GradientFeatures(size, len(pass_calls), linear,
                            {names[pid]: _stacked(dense[pid]) for pid in sorted(dense, key=order.get)})


def _stacked(per_pass: List[Tensor]) -> Tensor:
    # (C, ...) over the passes; one pass (loss gradients): a view, not a copy of the batch's g
    # (a copy of every layer's grad_output was 20% of a GPT-2 store step's read)
    return torch.stack(per_pass) if len(per_pass) > 1 else per_pass[0].unsqueeze(0)


def _empty(calls: List[PassCall]) -> Dict[int, Tensor]:
    """``{id(param): (0, *param.shape)}`` zeros for the parameters of an empty batch's calls
    (the rules run on no sample, as in :func:`gradhooks.readers.per_sample.per_sample_grads`)."""
    return {id(p): p.new_zeros((0, *p.shape)) for call in calls
            for p in (call.layer.params[local] for local in call.names)}


def gradient_features(batch: Batch) -> GradientFeatures:
    """The batch's per-sample loss gradients in factored form, after its backward pass(es)
    (summed over passes, own-loss scale applied, as :meth:`~gradhooks.GradHooks.per_sample_grads`).
    The records are kept; the features hold views of them (about their memory, not ``B P``).

    Args:
        batch: ``recorder.snapshot("gradient_features()", sum_check=False)``.
    """
    calls = [PassCall(cap.layer, cap.a, cap.grads_arg(), cap.names) for cap in batch.records]
    with no_autocast(), using_pool(batch.pool):
        return _collect(batch, [calls], batch.scale, batch.size)


def jacobian_features(recorder: Recorder, output: Tensor) -> GradientFeatures:
    """The per-sample Jacobians of ``output`` ``(B, *S)`` in factored form (``K = prod(S)``
    passes, one per coordinate: :func:`~gradhooks.readers.jacobians.per_sample_jacobians`' calling
    rules; the records are released afterwards). Memory: the layers' inputs once and ``K``
    grad_outputs, instead of the ``(B, K, P)`` Jacobian."""
    check_output(recorder, output, "jacobian_features()")
    k = output[0].numel()
    with no_autocast(), using_pool(recorder.pool):
        # (the layers' calls of each pass are kept until all passes ran: _collect stacks them)
        passes = [calls for calls in run_passes(recorder, output, unit_cotangents(output), k,
                                                "jacobian_features()")]
        return _collect(recorder, passes, None, output.shape[0])


def gram_form_cheaper(n: int, m: int, groups: int, s1: int, s2: int, i: int, o: int, c: int,
                      d: int) -> bool:
    """Whether the Gram form of a layer's block of ``K`` costs fewer multiply-adds than forming
    the per-sample ``(O, I)`` matrices and contracting them: ``N M G S1 S2 (I + C D O + C D)``
    (``ã ã'`` per position pair, ``g g'`` per pass pair, their product) against
    ``G O I (C N S1 + D M S2 + C D N M)`` (``C N`` matrices of each batch, then one product of
    ``(C N, G O I)`` by ``(G O I, D M)``). Position pairs must be fewer than the weight's
    entries by the factor ``I + C D O`` over ``C D O I``: a Linear on ``(B, in)`` takes the Gram
    form; a convolution (``S`` output pixels) or a Linear on 8 tokens with ``C = 10`` passes
    forms the matrices (the digits CNN's NTK: 295 ms in the Gram form, below torch.func's 29 ms
    by matrices)."""
    gram = n * m * groups * s1 * s2 * (i + c * d * o + c * d)
    dense = groups * o * i * (c * n * s1 + d * m * s2 + c * d * n * m)
    return gram <= dense


def _linear_gram(e1: LinearEntry, e2: LinearEntry) -> Tensor:
    a1, g1, a2, g2 = e1.a, e1.g, e2.a, e2.g
    n, grp, s1, i = a1.shape
    m, s2, o, c, d = a2.shape[0], a2.shape[2], g1.shape[-1], g1.shape[0], g2.shape[0]
    if gram_form_cheaper(n, m, grp, s1, s2, i, o, c, d):
        if s1 == 1 and s2 == 1:
            aa = torch.einsum("ngi,mgi->nmg", a1[:, :, 0], a2[:, :, 0])
            gg = torch.einsum("cngo,dmgo->nmgcd", g1[:, :, :, 0], g2[:, :, :, 0])
            return torch.einsum("nmg,nmgcd->nmcd", aa, gg)
        aa = torch.einsum("ngsi,mgti->nmgst", a1, a2)
        return torch.einsum("nmgst,cngso,dmgto->nmcd", aa, g1, g2)  # (opt_einsum's order)
    m1 = torch.einsum("cngso,ngsi->cngoi", g1, a1)
    m2 = m1 if e2 is e1 else torch.einsum("cngso,ngsi->cngoi", g2, a2)
    return (m1.reshape(c * n, -1) @ m2.reshape(d * m, -1).T).view(c, n, d, m).permute(1, 3, 0, 2)


def gram(features: GradientFeatures, other: Optional[GradientFeatures] = None) -> Tensor:
    """The Gram matrix of per-sample gradients (or the empirical NTK) of one batch, or between
    two batches of the same model (module docstring).

    Args:
        features: from :func:`gradient_features` or :func:`jacobian_features`.
        other: the second batch's features, of the same kind; default ``features``.

    Returns:
        ``(B1, B2)`` ``<grad l_n, grad l'_m>`` for loss gradients, or ``(B1, B2, C, C)``
        ``K[n, m, c, d] = <d f_c(x_n)/d theta, d f_d(x'_m)/d theta>`` for Jacobians (over the
        parameters of both; a parameter only one batch reached adds nothing).

    Raises:
        GradHooksError: if the two hold different numbers of passes.
    """
    other = features if other is None else other
    if other.passes != features.passes:
        raise GradHooksError(
            f"gram(): the two batches hold {features.passes} and {other.passes} backward passes "
            f"(loss gradients vs Jacobian rows of different outputs)")
    total = None
    with no_autocast():
        for path, e1 in features.linear.items():
            e2 = other.linear.get(path)
            if e2 is not None:
                t = _linear_gram(e1, e2)
                total = t if total is None else total + t
        for name, t1 in features.dense.items():
            t2 = other.dense.get(name)
            if t2 is not None:
                t = torch.einsum("cnp,dmp->nmcd", t1.flatten(2), t2.flatten(2))
                total = t if total is None else total + t
    if total is None:
        raise GradHooksError("gram(): the two batches share no parameter")
    return total[:, :, 0, 0] if features.passes == 1 else total
