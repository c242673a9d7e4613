"""One call's records in the forms the readers compute from: the canonical ``(a, g)`` of a layer
linear in its weight, or the per-sample gradients of any layer, with the summing over backward
passes, the computation dtype and the ``loss_reduction`` scale handled here, once.

Index conventions: ``n`` sample (``N``), ``g`` group (``G = 1`` except for grouped
convolutions), ``s`` weight-sharing position (tokens, pixels, time steps; ``S = 1`` for a Linear
on ``(N, d_in)``), ``i`` / ``o`` input / output feature of one group.

**Canonical form** (:func:`canonical`; curvlinops' convention with a group axis, the layout of
:mod:`gradhooks.base.forms`)::

    a: (N, G, S, I)   input activations (a convolution's unfolded patches, I = C_in/G prod(k))
    g: (N, G, S, O)   grad_output (O = C_out/G)
    y[n, g, s] = W[g] a[n, g, s] + b[g],   W[g] = weight.view(G, O, I)[g],  b[g] = bias.view(G, O)[g]

so that sample ``n``'s gradients are ``dW_n[g] = sum_s g[n,g,s] a[n,g,s]^T`` (einsum
``'ngsi,ngso->ngoi'``) and ``db_n[g] = sum_s g[n,g,s]`` (Goodfellow 2015, arXiv:1510.01799,
sec. 3; Rochette et al. 2019, arXiv:1912.06015, sec. 3 for convolutions). **Groups**: group
``g`` owns rows ``g O : (g + 1) O`` of the weight's dim 0 and the matching input channels; a
reader contracts per group (batched over ``G``), never across groups, and a weight-shaped result
``(N, G, O, I)`` is the weight's own layout ``(N, *weight.shape)`` (for a weight stored
transposed, :attr:`~gradhooks.base.registry.LayerRule.weight_transposed`, ``W[g]`` is ``weight.T``
and ``G = 1``). **Layout**: ``batch_first`` is the flag given to :func:`gradhooks.attach`; the
rule's :meth:`~gradhooks.base.registry.LayerRule.linear_form` moves the batch to dim 0, so readers
never look at it again.

**Dtype**: the promoted dtype of the tensors given, at least float32
(:func:`~gradhooks.base.utils.compute_dtype`: an autocast forward records bfloat16 / float16); a
tensor already in it is not copied. **Scale**: the records are gradients of the batch loss; the
gradients of each sample's own loss are ``scale`` times them (``scale`` from
:attr:`gradhooks.core.recorder.records.Batch.scale`: ``B`` for ``loss_reduction="mean"``, ``None`` for
``"sum"``, divided by a GradScaler's scale). :func:`canonical` multiplies ``g`` by it (a new
tensor: the records stay as they are); :func:`call_grads` scales the smallest of input,
grad_output and result.

Readers (norms and the plan, clipping, KFAC, EKFAC, Gram / NTK, GGN, projections) import these
instead of calling the rules' forms themselves.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from ..base.errors import UnsupportedModuleError
from ..base.segments import Segments
from ..base.torch_internals import own_parameters
from ..base.utils import LOW_PRECISION, OWNED, compute_dtype
from ..core.recorder.records import Layer

__all__ = ["grad_sum", "summed", "canonical", "canonical_call", "gram_form", "gram_in_cost",
           "canonical_sizes", "identity_form",
           "augmented", "scaled", "call_grads"]

_FULL = (torch.float32, torch.float64)


def grad_sum(grads: Sequence[Tensor]) -> Tensor:
    """The grad_output of a call summed over its backward passes (the gradients are linear in
    it): ``grads[0]`` itself for one pass (no copy), else ``torch.stack(grads).sum(0)``.

    Args:
        grads: one grad_output per backward pass, each in the layer output's layout.
    """
    return grads[0] if len(grads) == 1 else torch.stack(grads).sum(0)


def _dtype(a: Optional[Tensor], g: Tensor) -> torch.dtype:
    # compute_dtype(a, g) (or of g alone), without promoting when both are float32 / float64
    # alike (the common case: a few microseconds per layer, which a small MLP's step notices).
    if a is None:
        return g.dtype if g.dtype in _FULL else compute_dtype(g)
    return a.dtype if a.dtype == g.dtype and a.dtype in _FULL else compute_dtype(a, g)


def summed(call) -> Tuple[Tensor, Tensor]:
    """A single-output call's recorded input and grad_output (summed over backward passes) in
    the computation dtype, in the layout the layer saw them (not canonical): what a rule's
    :meth:`~gradhooks.base.registry.LayerRule.weighted_sum` takes, and the canonical form itself for a
    Linear on ``(N, d_in)`` (:func:`identity_form`).

    Args:
        call: a :class:`~gradhooks.core.recorder.records.Record` or :class:`~gradhooks.readers.passes.PassCall` (its
            ``a`` a tensor, ``grads`` a list of tensors).

    Returns:
        ``(a, g)``, both in :func:`~gradhooks.base.utils.compute_dtype` of the two (the recorded
        tensors themselves when already in it).
    """
    a, g = call.a, grad_sum(call.grads)
    dt = _dtype(a, g)
    if a.dtype != dt:
        a = a.to(dt)
    if g.dtype != dt:
        g = g.to(dt)
    return a, g


def canonical(layer: Layer, a, g, batch_first: bool, *, form_a: bool = True,
              scale: Optional[float] = None, dtype: Optional[torch.dtype] = None,
              kfac: bool = False) -> Tuple[Optional[Tensor], Tensor]:
    """One call's records in the canonical form (module docstring): THE adapter from records to
    ``(a, g)``.

    Args:
        layer: the hooked :class:`~gradhooks.core.recorder.records.Layer` (its rule must have a linear form,
            or with ``kfac`` a KFAC form: :attr:`~gradhooks.base.registry.LayerRule.has_kfac_form`).
        a: the call's recorded input, or ``None`` (then only ``g`` is formed, in ``g``'s dtype).
        g: its grad_output (one pass's, or summed over passes: :func:`grad_sum`), in the layer
            output's layout.
        batch_first: the layout flag given to :func:`gradhooks.attach`.
        form_a: whether to form the canonical ``a`` (a convolution's patches cost an unfold);
            ``False`` returns ``None`` for it, ``a`` then only sets the dtype.
        scale: multiply ``g`` by it (the own-loss scale, :attr:`~gradhooks.core.recorder.records.Batch.scale`;
            ``None``: no scaling). The result is a new tensor; the records are not modified.
        dtype: the dtype to compute in instead of :func:`~gradhooks.base.utils.compute_dtype` of ``a``
            and ``g`` (EKFAC: one dtype over all passes of a call).
        kfac: use :meth:`~gradhooks.base.registry.LayerRule.kfac_form` instead of
            :meth:`~gradhooks.base.registry.LayerRule.linear_form` (layers whose canonical form serves
            KFAC only: transposed convs; embeddings, whose ``a`` is a
            :class:`~gradhooks.base.forms.OneHot`). For a ``multi_io`` rule ``a`` (a
            :class:`~gradhooks.base.forms.Call`) and ``g`` (the output's grad structure) go to the rule
            as recorded: it picks and casts its tensors.

    Returns:
        ``(a, g)``: ``a`` ``(N, G, S, I)`` (``None`` unless ``a`` is given and ``form_a``), ``g``
        ``(N, G, S, O)``, both in the computation dtype; views of the records where the rule's
        reshape allows (a Linear's are).
    """
    rule = layer.rule
    form = rule.kfac_form if kfac else rule.linear_form
    if rule.multi_io:
        a_c, g_c = form(layer.module, a if form_a else None, g, batch_first)
    else:
        dt = dtype or _dtype(a, g)
        if form_a and a is not None:
            a = a if a.dtype == dt else a.to(dt)
        else:
            a = None
        a_c, g_c = form(layer.module, a, g if g.dtype == dt else g.to(dt), batch_first)
    if scale is not None:
        g_c = g_c * scale
    return a_c, g_c


def canonical_call(call, batch_first: bool, *, form_a: bool = True,
                   scale: Optional[float] = None) -> Tuple[Optional[Tensor], Tensor]:
    """:func:`canonical` of a single-output call (a :class:`~gradhooks.core.recorder.records.Record` or
    :class:`~gradhooks.readers.passes.PassCall`), its grad_outputs summed over backward passes: ``a``
    ``(N, G, S, I)`` (``None`` without ``form_a``), ``g`` ``(N, G, S, O)``, in
    :func:`~gradhooks.base.utils.compute_dtype` of the recorded input and grad_output."""
    return canonical(call.layer, call.a, grad_sum(call.grads), batch_first, form_a=form_a,
                     scale=scale)


def gram_form(call, batch_first: bool, *, form_a: bool = False, rule_gram: bool = True
              ) -> Tuple[Optional[Tensor], Optional[Tensor], Tensor]:
    """A single-output call's Gram-form records: ``(a, aa, g)`` with ``g`` ``(N, G, S, O)`` as
    :func:`canonical_call`'s and ``aa`` ``(N, G, S, S)`` its input's Gram matrix from the rule
    (:meth:`~gradhooks.base.registry.LayerRule.input_gram`: a convolution's without its
    patches), or ``None`` where the rule has none or not ``rule_gram`` (form it from ``a``);
    ``a`` the canonical input ``(N, G, S, I)`` when ``form_a`` (the sum check's projection) or
    ``aa`` is ``None``, else ``None``. All in :func:`~gradhooks.base.utils.compute_dtype` of
    the records."""
    layer, g = call.layer, grad_sum(call.grads)
    dt = _dtype(call.a, g)
    x = call.a if call.a.dtype == dt else call.a.to(dt)
    aa = layer.rule.input_gram(layer.module, x, batch_first) if rule_gram else None
    a, g = canonical(layer, x, g, batch_first, form_a=form_a or aa is None, dtype=dt)
    return a, aa, g


def gram_in_cost(call) -> Optional[int]:
    """:meth:`~gradhooks.base.registry.LayerRule.input_gram_cost` of a single-output call's
    recorded input: multiply-adds per ``(sample, group)`` of its rule's ``a a^T`` (``None``:
    the canonical input's ``S^2 I``)."""
    return call.layer.rule.input_gram_cost(call.layer.module, call.a)


def canonical_sizes(layer: Layer, g: Tensor, batch_first: bool) -> Tuple[int, int, int, int]:
    """``(G, S, I, O)`` of a call's canonical form, from one grad_output ``g`` and the weight's
    size, without forming ``a`` and without casting (``I = 0`` for a layer without weight).

    Args:
        layer: a hooked layer whose rule has a linear form.
        g: one backward pass's grad_output of the call, in the layer output's layout.
        batch_first: as given to :func:`gradhooks.attach`.
    """
    _, g = layer.rule.linear_form(layer.module, None, g, batch_first)
    _, groups, positions, o = g.shape
    weight = layer.params.get("weight")
    return groups, positions, (0 if weight is None else weight.numel() // (groups * o)), o


def identity_form(layer: Layer, a: Tensor, g: Tensor, batch_first: bool) -> bool:
    """Whether a call's canonical form (with ``G = S = 1``) is its recorded 2-D input and
    grad_output themselves, ``(N, I)`` and ``(N, O)`` viewed as ``(N, 1, 1, .)`` (a Linear on
    ``(N, d_in)``): then a reader may use the records (:func:`summed`) without the views (a few
    microseconds a layer, which a small MLP's 0.1 ms step notices). Checked on the tensors
    (addresses and strides); a reader keeps the answer per call structure."""
    if a.dim() != 2 or g.dim() != 2:
        return False
    a4, g4 = layer.rule.linear_form(layer.module, a, g, batch_first)
    return all(t4.shape == (t.shape[0], 1, 1, t.shape[1]) and t4.data_ptr() == t.data_ptr()
               and (t4.stride(0), t4.stride(3)) == t.stride() for t, t4 in ((a, a4), (g, g4)))


def augmented(a: Optional[Tensor], g: Tensor, bias: bool) -> Tensor:
    """The canonical input extended by a column of ones for the bias, ``ã = [a; 1]``
    ``(N, G, S, I + 1)``, so that ``[W[g] b[g]]`` is one ``(O, I + 1)`` matrix whose per-sample
    gradient is ``sum_s g[n,g,s] ã[n,g,s]^T`` (the bias sees an input of ones).

    Args:
        a: ``(N, G, S, I)`` canonical input, or ``None`` for a call whose weight is not wanted
            (then ``ã`` is the ones column alone, ``(N, G, S, 1)``).
        g: ``(N, G, S, O)`` its canonical grad_output (gives the shape, dtype and device of the
            ones when ``a`` is ``None``).
        bias: whether the bias is covered (``False``: ``a`` itself is returned).
    """
    if a is None:
        return g.new_ones(*g.shape[:3], 1)
    return torch.cat([a, a.new_ones(*a.shape[:-1], 1)], -1) if bias else a


def scaled(t: Tensor, scale: Optional[float]) -> Tensor:
    """``t * scale`` (a new tensor), or ``t`` itself for ``scale=None`` (``loss_reduction="sum"``
    without a GradScaler)."""
    return t if scale is None else t * scale


# ------------------------------------------------------------------------ per-sample gradients
def call_grads(rule, module: nn.Module, a, grads, batch_first: bool,
               names: Iterable[str], scale: Optional[float],
               release: Optional[Callable[[], None]] = None,
               differentiable: bool = False) -> Dict[str, Tensor]:
    """Per-sample gradients of one recorded call, with the ``loss_reduction`` scale applied.

    Args:
        rule: the module's :class:`~gradhooks.base.registry.LayerRule`.
        module: the layer.
        a: the call's input activations (a :class:`~gradhooks.base.forms.Call` for ``multi_io``
            rules).
        grads: the grad_outputs of every backward pass through the call (summed: the
            gradients are linear in the grad_output); for ``multi_io`` rules, the output's
            structure holding each output tensor's summed grad_output or ``None``.
        batch_first: as given to :func:`gradhooks.attach`.
        names: the parameters wanted.
        scale: from :attr:`~gradhooks.core.recorder.records.Batch.scale` (``None``: no scaling).
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
            path (:attr:`~gradhooks.base.registry.LayerRule.differentiable`: one that reads its
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
        if isinstance(grads, Segments):  # (a raw parameter's factored cotangents: formed here,
            if release is not None:      # the scale on their rows, into a reused buffer)
                release()
            return {names[0]: grads.dense(scale)}
        if (scale is not None and release is not None and getattr(a, "shared", None) == "param"
                and isinstance(grads, Tensor) and getattr(grads, OWNED, False)
                and not grads.requires_grad):
            # A raw parameter's own per-sample cotangents formed by gradhooks for this record
            # alone (OWNED: not a grad_output autograd also hands to other records), the result
            # itself, released by this read: scaled in place, not copied (an expert's
            # (B, E, O, I) weight).
            release()
            out = rule.per_sample_grads(module, a, grads, batch_first, names)
            for t in out.values():
                t.mul_(scale)
            return out
        if scale is not None:
            grads = tree_map(lambda t: t * scale if isinstance(t, Tensor) else t, grads)
            inner = a.internal.get("grad_inputs") if a.internal else None
            if inner is not None:  # gradients recorded inside the call (LayerRule.internal)
                a = a._replace(internal={**a.internal, "grad_inputs": tuple(
                    None if t is None else t * scale for t in inner)})
        if release is not None:
            release()
        return rule.per_sample_grads(module, a, grads, batch_first, names)
    g = grad_sum(grads)
    del grads
    if a.dtype != g.dtype or a.dtype in LOW_PRECISION:
        dt = compute_dtype(a, g)
        a, g = a.to(dt), g.to(dt)
    scale_a = scale_g = False
    if scale is not None:
        own = own_parameters(module)  # (faster than nn.Module.__getattr__)
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
