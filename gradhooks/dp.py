"""Per-sample gradient norms without materialising, and DP-SGD clipping (ghost or materialised).

Index conventions: ``n`` sample, ``g`` group (``G = 1`` except for grouped convolutions), ``s``,
``t`` weight-sharing positions (tokens, pixels; ``S = 1`` for a Linear on ``(B, in)``), ``i``
input feature, ``o`` output feature. A Linear or Conv call in the canonical form of
:mod:`gradhooks.per_sample` computes ``y[n,g,s] = W[g] a[n,g,s] + b[g]``, so sample ``n``'s
gradient is ``dW_n[g] = sum_s g[n,g,s] a[n,g,s]^T`` and ``db_n[g] = sum_s g[n,g,s]``, with
``g`` the recorded grad_output (for ``loss_reduction="mean"`` multiplied by ``B``, the gradient of
the sample's own loss, as in :meth:`~gradhooks.GradHooks.per_sample_grads`).

**Norms** (:func:`per_sample_grad_norms`). ``||dW_n||^2`` without forming ``dW_n`` (the Gram or
"ghost norm" trick; Goodfellow 2015, arXiv:1510.01799, for ``S = 1``; Li et al. 2022, "Large
language models can be strong differentially private learners", ICLR, arXiv:2110.05679, sec. 4,
for ``S > 1``)::

    ||dW_n||^2 = sum_g sum_{s,t} (a[n,g,s] . a[n,g,t]) (g[n,g,s] . g[n,g,t])

costs ``N G S^2 (I + O)`` multiply-adds and ``N G S^2`` memory; materialising ``dW_n`` costs
``N G S I O`` and ``N G I O``. Per parameter the cheaper by this count is used, the Gram form iff
``S (I + O) < I O`` (:func:`use_gram`; it then needs less memory as well). Measured (2 CPU cores,
torch 2.13, ``N = 32``, medians, ms Gram / materialised, ratio ``S (I + O) / (I O)``): Linear
128x128 S=32 (0.5) 0.13 / 0.24, S=64 (1.0) 0.43 / 0.43, S=128 (2.0) 1.6 / 0.82; 512x512 S=128
(0.5) 6.6 / 23.6; 64->512 S=64 (1.1) 0.90 / 0.91, S=128 (2.3) 3.7 / 2.0; Conv2d 3x3 128->128 on
8x8 (0.56) 21 / 33, on 12x12 (1.25) 44 / 41; 256->256 on 4x4 (0.07) 1.9 / 74; 32->64 on 12x12
(2.75) 62 / 0.8 (a materialised conv uses torch's grouped-convolution weight-backward kernel, a
Gram conv needs the unfolded patches). Bias: ``||db_n||^2 = ||sum_s g[n,s]||^2`` from an
``(N, O)`` tensor. A parameter used by several calls (a layer called twice, weights tied between
layers) has gradient ``sum_calls dW_n``; its Gram form concatenates the calls' positions, which
includes the cross terms between calls. Rules that give their gradients in factored form
(:class:`~gradhooks.registry.Block`: recurrent layers and cells, with the time steps as
positions; MultiheadAttention, with the tokens) are treated the same way, block by block: Gram
form or materialised block per the same count, their replay run once per call for norms and
clipped sum together; blocks that share their grad_output (an LSTM's ``weight_ih`` and
``weight_hh``: the gate gradients) form its Gram matrix once, which counts as ``O / shared``
in the comparison. Rules that give their gradients as row scatters
(:class:`~gradhooks.registry.Rows`: ``nn.Embedding``, ``dW_n[v] = sum_s [x[n,s] = v] g[n,s]``)
need no ``(N, V, D)`` tensor: ``||dW_n||^2`` is the sum of the squared norms of the
grad_output rows summed per ``(sample, row)`` pair (``O(N S D)``: one sort of the pair keys and
an ``index_add``), and the clipped sum is one ``index_add`` of ``c_n g[n,s]`` at row ``x[n,s]``.
Layers with none of these (norm layers, whose per-sample gradients are ``(N, C)`` anyway;
EmbeddingBag, transposed convs, the torch.func fallback, and a parameter tied across layer
types) are materialised with their rule, one layer at a time, and reduced to norms at once.

**Clipping** (:func:`clip_and_accumulate`). DP-SGD (Abadi et al. 2016, arXiv:1607.00133,
algorithm 1) needs ``sum_n c_n dtheta_n`` with ``c_n = min(1, C / ||dtheta_n||)``. Ghost
clipping with book-keeping (Bu et al. 2023, "Differentially private optimization on large model
at small cost", ICML, arXiv:2210.00038, sec. 3; Li et al. 2022, sec. 4) takes the norms as above
and forms the clipped sum directly from the recorded activations and grad_outputs -- no second
backward pass and, for Linear and Conv, no per-sample tensor::

    sum_n c_n dW_n = sum_{n,s} (c_n g[n,s]) a[n,s]^T     (one matmul / one conv weight-backward)
    sum_n c_n db_n = sum_{n,s} c_n g[n,s]

and per block for factored forms. Layers without either are materialised a second time, one
layer at a time, and reduced with the weights ``c_n`` at once.

**Two-pass clipping** (:func:`clipped_backward`; Li et al. 2022, sec. 4): book-keeping keeps
every layer's activations and grad_outputs until all norms are known. From per-sample losses,
a first backward (no weight gradients, graph retained) forms each group of records' norms as soon
as its grad_outputs are in and drops them (:class:`_NormStream`); a second, ordinary backward of
``sum_n c_n loss_n / D`` then gives the clipped sum through autograd's own weight-gradient
kernels. One more backward pass, but no grad_output outlives its layer.

**Checks.** As :meth:`~gradhooks.GradHooks.per_sample_grads` does (``check=True``: on each new
call structure and every 100th read; ``check="always"``: every read; ``check=False``: never),
the per-sample gradients must sum to the gradient autograd computed (a parameter also used
outside its module would otherwise get a silently wrong norm and an unclipped share): materialised
parameters on 256 probe coordinates (:func:`gradhooks.per_sample.check_sums`), Gram-form
parameters on one fixed random rank-one projection ``sum_g v_g^T (sum_n dW_n[g]) u_g``, computed
from the records as ``sum_{n,g,s} (a[n,g,s] . u_g)(g[n,g,s] . v_g)`` (cost ``N G S (I + O)``).
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from .per_sample import (SUM_CHECK_RTOL, GradTotal, bilinear_directions, call_grads, check_sums,
                         compute_dtype, from_blocks, reduction_scale, weight_grad)
from .registry import (Block, GradHooksError, GradientMismatchError, HigherOrderGradError,
                       NoBackwardError, Rows)
from .rules.conv import ConvRule, pad_as_torch, weight_backward
from .rules.linear import LinearRule, _batch_dim

__all__ = ["per_sample_grad_norms", "clip_and_accumulate", "clipped_backward", "use_gram",
           "gram_sq_norms", "CLIP_METHODS"]

#: The values ``method`` of :func:`clip_and_accumulate` may take.
CLIP_METHODS = ("ghost", "materialize")

# How each parameter's per-sample norm and clipped sum are formed.
_GRAM = "gram"          # Linear/Conv weight: Gram-form norm, closed-form clipped sum
_CLOSED = "closed"      # Linear/Conv weight or bias: materialised norm, closed-form clipped sum
_FORMS = "forms"        # rule with factored forms (recurrent, attention): per block as Linear
_ROWS = "rows"          # rule with row scatters (Embedding): per (sample, row) sums, index_add
_GENERIC = "generic"    # any other rule: materialised norm and clipped sum


# ----------------------------------------------------------------------------------- closed forms
def use_gram(positions: int, fan_in: int, fan_out: int, shared: int = 1) -> bool:
    """Whether the Gram form of a weight's per-sample squared norms is the cheaper one.

    Args:
        positions: ``S``, weight-sharing positions per sample and group (summed over the calls
            of a parameter used several times).
        fan_in: ``I``, input features per group (``C_in/G * prod(kernel_size)`` for a conv).
        fan_out: ``O``, output features per group.
        shared: how many weights have this same grad_output (an LSTM's ``weight_ih`` and
            ``weight_hh``: the gate gradients), whose Gram matrix is then formed once for all.

    Returns:
        ``S (I + O / shared) < I O``: the multiply-add counts ``N G S^2 (I + O / shared)``
        (Gram) against ``N G S I O`` (materialised); measurements in the module docstring.
    """
    return positions * (fan_in + fan_out / shared) < fan_in * fan_out


def gram_sq_norms(a: Tensor, g: Tensor) -> Tensor:
    """Squared per-sample weight-gradient norms in the Gram form, without forming the gradients.

    Args:
        a: ``(N, G, S, I)`` activations (canonical form of :mod:`gradhooks.per_sample`).
        g: ``(N, G, S, O)`` grad_outputs.

    Returns:
        ``(N,)``: ``sum_g sum_{s,t} (a[n,g,s] . a[n,g,t]) (g[n,g,s] . g[n,g,t])``, which equals
        ``sum_g ||sum_s g[n,g,s] a[n,g,s]^T||_F^2`` (Li et al. 2022, arXiv:2110.05679, sec. 4;
        for ``S = 1`` the product ``||a_n||^2 ||g_n||^2``, Goodfellow 2015).
    """
    n = a.shape[0]
    if a.shape[2] == 1:
        return (_sq(a, -1) * _sq(g, -1)).view(n, -1).sum(1)
    aa = a @ a.transpose(-1, -2)
    return aa.mul_(g @ g.transpose(-1, -2)).view(n, -1).sum(1)


def _total(parts) -> Optional[Tensor]:
    """Sum of the ``(N,)`` tensors ``parts`` (per-parameter squared norms), ``None`` if empty."""
    total = None
    for t in parts:
        if t is not None:
            total = t if total is None else total + t
    return total


def _sq(t: Tensor, dim) -> Tensor:
    # Sum of squares over ``dim`` without a temporary of ``t``'s size.
    return torch.linalg.vector_norm(t, dim=dim).square_()


def _closed_rule(rule) -> bool:
    # Exact types: a subclass of these rules may compute something else.
    return type(rule) in (LinearRule, ConvRule)


def _summed_grad(cap) -> Tensor:
    return cap.grads[0] if len(cap.grads) == 1 else torch.stack(cap.grads).sum(0)


def _grads_arg(cap):
    return cap.grad_struct() if cap.spec is not None else cap.grads


def _sizes(cap, batch: int) -> Tuple[int, int, int, int]:
    """``(G, S, I, O)`` of a Linear/Conv call's canonical form, without forming it."""
    module, g = cap.layer.module, cap.grads[0]
    if type(cap.layer.rule) is LinearRule:
        o = module.out_features
        return 1, g.numel() // (batch * o), module.in_features, o
    groups = module.groups
    return (groups, g[0, 0].numel(), module.in_channels // groups * math.prod(module.kernel_size),
            module.out_channels // groups)


def _canonical(cap, batch_first: bool) -> Tuple[Tensor, Tensor]:
    """Canonical ``a (N, G, S, I)``, ``g (N, G, S, O)`` of a Linear/Conv call, grads summed."""
    rule = cap.layer.rule
    a, g = cap.a, _summed_grad(cap)
    dt = compute_dtype(a, g)
    a, g = a.to(dt), g.to(dt)
    if type(rule) is LinearRule:
        return rule.canonical(a, g, batch_first)
    return rule.canonical(cap.layer.module, a, g)


def _conv_weight_sum(module: nn.Module, x: Tensor, g: Tensor) -> Tensor:
    """``sum_n dW_n`` of a ``nn.ConvNd`` call with input ``x (N, C_in, *spatial)`` and
    grad_output ``g (N, C_out, *spatial_out)``: torch's convolution weight-backward kernel.
    Returns ``(C_out, C_in/G, *kernel_size)``."""
    x, padding = pad_as_torch(module, x)
    return weight_backward(module, x, g, padding, per_sample=False)


def _no_dest(pid: int, dtype: torch.dtype) -> Optional[Tensor]:
    return None


def _weigh(a: Tensor, g: Tensor, c: Tensor, dim: int) -> Tuple[Tensor, Tensor]:
    """``(a, g)`` with the per-sample weights ``c (N,)`` applied along the batch dim ``dim`` to
    the smaller of the two (the weighted sum is linear in either)."""
    shape = [1] * g.dim()
    shape[dim] = -1
    if a.numel() < g.numel():
        return a * c.view(shape), g
    return a, g * c.view(shape)


def _weighted_closed(cap, names: List[str], c: Tensor, batch_first: bool,
                     dest=_no_dest) -> Dict[str, Tensor]:
    """``sum_n c_n d(param)_n`` for the Linear/Conv parameters ``names`` of one call, from the
    records (no per-sample tensor; the weights ``c (N,)`` scale the smaller of the activations and
    the grad_outputs). Shapes: the parameters'. ``dest(id(param), dtype)``: a tensor of the
    parameter's shape to write a Linear's result into, or ``None`` (a new tensor)."""
    a, g = cap.a, _summed_grad(cap)
    dt = compute_dtype(a, g)
    a, g, c = a.to(dt), g.to(dt), c.to(dt)
    linear = type(cap.layer.rule) is LinearRule
    params = cap.layer.params
    out = {}
    if "weight" in names:
        a, g = _weigh(a, g, c, _batch_dim(a, batch_first) if linear else 0)
        if linear:  # sum over samples and positions, in any order
            out["weight"] = torch.mm(g.reshape(-1, g.shape[-1]).t(), a.reshape(-1, a.shape[-1]),
                                     out=dest(id(params["weight"]), dt))
        else:
            out["weight"] = _conv_weight_sum(cap.layer.module, a, g)
    if "bias" in names:
        out["bias"] = torch.mv(_bias_grads(cap, batch_first).t(), c, out=dest(id(params["bias"]), dt))
    return out


class _Forms:
    """The factored forms (:meth:`~gradhooks.registry.LayerRule.forms`) of the calls of rules
    that have them, computed once per call (the rule's replay runs once for norms and clipped
    sum together) and dropped with this object."""

    def __init__(self, gh, plans: Dict[int, "_Param"]):
        self.gh, self.plans, self.calls, self.joined = gh, plans, {}, {}
        self.uses: Optional[Dict[tuple, int]] = None  # grad_output key -> weight-like blocks
        self.grams: Dict[tuple, Tuple[Tensor, Tensor]] = {}  # key -> (g, g g^T)
        self.scatters: Dict[int, Rows] = {}  # id(param) -> its row scatters (_rows)

    def rows(self, p: "_Param") -> Rows:
        """The parameter's :class:`~gradhooks.registry.Rows` (:func:`_rows`), formed once for
        norms and clipped sum."""
        if p.pid not in self.scatters:
            self.scatters[p.pid] = _rows(self.gh, p)
        return self.scatters[p.pid]

    @staticmethod
    def _key(t: Tensor) -> tuple:
        return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype

    def sharing(self, g: Tensor) -> int:
        """How many weight-like blocks of the factored parameters have the grad_output ``g``
        (the same tensor: an LSTM's ``weight_ih`` and ``weight_hh`` blocks)."""
        if self.uses is None:
            self.uses = {}
            for p in self.plans.values():
                if p.kind == _FORMS:
                    for b in self.blocks(p) or ():
                        if b.a is not None:
                            key = self._key(b.g)
                            self.uses[key] = self.uses.get(key, 0) + 1
        return self.uses.get(self._key(g), 1)

    def gram(self, g: Tensor) -> Tensor:
        """``g g^T`` ``(N, S, S)`` of a shared grad_output ``g`` ``(N, S, O)``, formed once."""
        key = self._key(g)
        if key not in self.grams:
            self.grams[key] = (g, g @ g.transpose(-1, -2))  # g kept: its address stays its own
        return self.grams[key][1]

    def of(self, cap) -> Dict[str, list]:
        forms = self.calls.get(id(cap))
        if forms is None:
            layer = cap.layer
            names = [n for n in cap.names if self.plans[id(layer.params[n])].kind == _FORMS]
            forms = layer.rule.forms(layer.module, cap.a, _grads_arg(cap), self.gh.batch_first, names)
            self.calls[id(cap)] = forms
        return forms

    def blocks(self, p: "_Param") -> Optional[list]:
        """The parameter's blocks with the calls' positions concatenated (``a`` ``(N, S, I)``,
        ``g`` ``(N, S, O)`` summed over calls: their cross terms are part of the norm), or
        ``None`` if the calls' row blocks differ. Computed once per parameter."""
        if p.pid not in self.joined:
            self.joined[p.pid] = self._join(p)
        return self.joined[p.pid]

    def _join(self, p: "_Param") -> Optional[list]:
        per_call = [self.of(cap).get(local) for cap, local in p.entries]
        per_call = [b for b in per_call if b is not None]
        if not per_call:
            return []
        if len(per_call) == 1:
            return per_call[0]
        layout = [[(b.rows, b.a is None) for b in blocks] for blocks in per_call]
        if any(x != layout[0] for x in layout[1:]):
            return None
        out = []
        for parts in zip(*per_call):
            dt = compute_dtype(*(t for b in parts for t in (b.a, b.g) if t is not None))
            a = None if parts[0].a is None else torch.cat([b.a.to(dt) for b in parts], 1)
            out.append(Block(parts[0].rows, a, torch.cat([b.g.to(dt) for b in parts], 1)))
        return out

    def materialised(self, p: "_Param", shape) -> Tensor:
        """``(N, *param.shape)``, the sum over the parameter's calls (when their blocks differ)."""
        total = None
        for cap, local in p.entries:
            blocks = self.of(cap).get(local)
            if blocks:
                t = from_blocks(blocks, (blocks[0].g.shape[0], *shape))
                total = t if total is None else total.add_(t)
        return total


# ------------------------------------------------------------------------------------- the plan
class _Param:
    """One trainable parameter the backward reached: its calls and how it is handled."""

    __slots__ = ("pid", "name", "entries", "kind")

    def __init__(self, pid: int, name: str):
        self.pid, self.name, self.entries, self.kind = pid, name, [], _GENERIC


def _plan(gh, read: str) -> Tuple[Dict[int, _Param], Optional[float]]:
    """Validate the records and decide per parameter: ``({id(param): _Param}, scale)``, in the
    order of ``model.named_parameters()``; ``read`` names the call for the error messages."""
    gh._check_records(read)
    if not gh._reached:
        raise NoBackwardError(
            "no backward pass has reached a hooked layer since the last forward: call "
            "loss.backward() before per-sample norms or clipping (forwards under torch.no_grad() "
            "or inference_mode() record nothing)"
        )
    if gh._higher_order is not None:
        raise HigherOrderGradError(
            f"a backward pass with create_graph=True reached module {gh._higher_order}: the loss "
            f"contains derivatives, whose terms grad_output-based per-sample norms do not see; the "
            f"result would be wrong. Use torch.func (vmap over grad) or detach the derivative term"
        )
    return _plan_caps(gh, gh._reached), reduction_scale(gh.loss_reduction, gh._batch_size)


def _plan_caps(gh, caps) -> Dict[int, _Param]:
    """:func:`_plan` for the records ``caps``, which must hold every call of their parameters.

    The decisions depend only on which layers were called with which parameters and on the
    grad_output shapes, so they are kept per such structure (``gh._plans``) and reused for the
    next batch of the same structure."""
    for cap in caps:
        cap.check_unmodified("per-sample norms")
    key = (gh._batch_size, tuple((id(cap.layer), cap.names, None if cap.spec is not None
                                  else tuple(cap.grads[0].shape)) for cap in caps))
    template = gh._plans.get(key)
    if template is None:
        if len(gh._plans) >= 64:  # structures vary without bound: start over
            gh._plans.clear()
        template = gh._plans[key] = _plan_template(gh, caps)
    plans: Dict[int, _Param] = {}
    for pid, kind, entries in template:
        p = plans[pid] = _Param(pid, gh._names[pid])
        p.kind, p.entries = kind, [(caps[i], local) for i, local in entries]
    if gh.check and gh._sum_check != "skip":
        gh._check_unrecorded(plans)
    return plans


def _plan_template(gh, caps) -> List[Tuple[int, str, List[Tuple[int, str]]]]:
    """Per parameter reached by ``caps``, in the order of ``model.named_parameters()``: ``(id,
    kind, [(index in caps, local name)])``."""
    found: Dict[int, _Param] = {}
    for i, cap in enumerate(caps):
        for local in cap.names:
            pid = id(cap.layer.params[local])
            if pid not in found:
                found[pid] = _Param(pid, gh._names[pid])
            found[pid].entries.append((cap, local, i))
    batch = gh._batch_size
    for p in found.values():
        locals_ = {local for _, local, _ in p.entries}
        rules = [cap.layer.rule for cap, _, _ in p.entries]
        if all(rule.has_forms for rule in rules):
            p.kind = _FORMS
        elif all(rule.has_rows for rule in rules):
            p.kind = _ROWS
        elif len(locals_) == 1 and all(_closed_rule(rule) for rule in rules):
            p.kind = _CLOSED
            if locals_ == {"weight"}:
                sizes = [_sizes(cap, batch) for cap, _, _ in p.entries]
                shapes = {(grp, i, o) for grp, _, i, o in sizes}
                if len(shapes) == 1:
                    _, i, o = shapes.pop()
                    if use_gram(sum(s for _, s, _, _ in sizes), i, o):
                        p.kind = _GRAM
    return [(pid, found[pid].kind, [(i, local) for _, local, i in found[pid].entries])
            for pid in gh._names if pid in found]


# ------------------------------------------------------------------------------------- checks
def _no_total(name: str) -> GradientMismatchError:
    return GradientMismatchError(
        f"grad_outputs were recorded for the module owning {name!r}, but autograd computed no "
        f"gradient for {name!r} in those backward passes (e.g. torch.autograd.grad with respect "
        f"to the input only); per-sample gradients of the parameters are not defined for such a "
        f"pass"
    )


def _projection_terms(name: str, a: Tensor, g: Tensor, total: Optional[GradTotal],
                      rows: Optional[slice] = None) -> Tensor:
    """Sum check of a Gram-form weight on a random rank-one projection (module docstring):
    ``(got, ref, bound)``, with ``got = sum_{n,g,s} (a . u)(g . v_g)`` from the records,
    ``ref = v^T W u`` from autograd's gradient ``W`` (viewed as ``(dim 0, rest)``,
    :meth:`~gradhooks.per_sample.GradTotal.projection`) and ``bound`` the scale of the rounding
    errors of both (``sum |a . u||g . v| + ||W|| ||u|| ||v||``). ``a`` ``(N, G, S, I)``, ``g``
    ``(N, G, S, O)``: the canonical form, or one row block ``rows`` of ``W`` (``G = 1``); then
    ``ref`` and the bound's second term count only for the first block (``rows.start == 0``):
    the blocks' ``got`` add up to the whole projection.

    Raises:
        GradientMismatchError: if autograd computed no gradient for the parameter.
    """
    if total is None:
        raise _no_total(name)
    shape = total.shape
    u, v, uv = bilinear_directions(shape[0], shape.numel() // shape[0], a.dtype, a.device)
    if rows is not None:
        v = v[rows]
    grp, o = a.shape[1], g.shape[-1]
    if grp == 1:  # plain matrix products
        prod = (a.reshape(-1, a.shape[-1]) @ u).mul_(g.reshape(-1, o) @ v)
    else:
        prod = (a @ u).mul_((g * v.view(grp, 1, o)).sum(-1))  # (N, G, S)
    ref, norm = total.projection(a.dtype)
    if rows is not None and rows.start != 0:
        ref, norm = torch.zeros_like(ref), torch.zeros_like(norm)
    return torch.stack([prod.sum(), ref, prod.abs().sum() + norm * uv])


def _check_projections(items: List[Tuple[str, Tensor, torch.dtype]]) -> None:
    """Compare the :func:`_projection_terms` of every Gram-form weight at once.

    Raises:
        GradientMismatchError: naming the first parameter whose projection differs by more than
            ``SUM_CHECK_RTOL[dtype] * bound``.
    """
    summed: Dict[str, list] = {}  # a parameter's row blocks add up
    for name, terms, dt in items:
        if name in summed:
            summed[name][1] = summed[name][1] + terms
        else:
            summed[name] = [name, terms, dt]
    by_device: Dict[torch.device, list] = {}
    for item in summed.values():
        by_device.setdefault(item[1].device, []).append(item)
    for group in by_device.values():
        dt = torch.float64 if any(t.dtype == torch.float64 for _, t, _ in group) else torch.float32
        terms = torch.stack([t.to(dt) for _, t, _ in group])  # (P, 3)
        rtol = terms.new_tensor([SUM_CHECK_RTOL.get(dt, 1e-4) for _, _, dt in group])
        bad = (terms[:, 0] - terms[:, 1]).abs() > rtol * terms[:, 2] + torch.finfo(terms.dtype).tiny
        if bool(bad.any()):
            k = int(bad.nonzero()[0, 0])
            got, ref = terms[k, 0].item(), terms[k, 1].item()
            raise GradientMismatchError(
                f"the per-sample gradients of {group[k][0]!r} do not sum to the gradient autograd "
                f"computed for it (on a random projection: {got:.6g} vs {ref:.6g}). The parameter "
                f"receives gradient outside the module that owns it (a functional use such as "
                f"x @ layer.weight.T, or a module gradhooks does not hook); per-sample norms "
                f"would be wrong. Use the parameter only through its module."
            )


def _probed(name: str, t: Tensor, total: Optional[GradTotal], tol_dtype: torch.dtype,
            rows: Optional[slice] = None) -> Optional[tuple]:
    """A :func:`~gradhooks.per_sample.check_sums` item reduced to the probe coordinates, so that
    ``t`` need not be kept: ``t`` ``(N, *shape)`` is the per-sample gradient of the parameter,
    or of its rows ``rows`` (dim 0); ``None`` if no probe falls in those rows."""
    if total is None:
        raise _no_total(name)
    idx, ref = total.probe_index(), total.probe_values()
    flat = t.reshape(t.shape[0], -1)
    if rows is not None:
        cols = total.shape.numel() // total.shape[0]
        inside = (idx >= rows.start * cols) & (idx < rows.stop * cols)
        idx, ref = idx[inside] - rows.start * cols, ref[inside]
        if not idx.numel():
            return None
    if idx.numel() < flat.shape[1]:
        flat = flat.index_select(1, idx)
    return name, flat, ref, tol_dtype


# ------------------------------------------------------------------------------------- the passes
def _bias_grads(cap, batch_first: bool) -> Tensor:
    """Per-sample bias gradient ``(N, C_out)`` of a Linear/Conv call: ``sum_s g[n, s]``."""
    g = _summed_grad(cap)
    g = g.to(compute_dtype(g))
    if type(cap.layer.rule) is LinearRule:
        if g.dim() == 2:
            return g  # S = 1: the grad_output itself
        g = g.movedim(_batch_dim(cap.a, batch_first), 0)
        return g.reshape(g.shape[0], -1, g.shape[-1]).sum(1)
    return g.reshape(g.shape[0], g.shape[1], -1).sum(-1)


def _sq_norms(gh, plans: Dict[int, _Param], forms: _Forms, caps=None) -> Dict[int, Tensor]:
    """Squared per-sample norms ``(N,)`` of each parameter's gradient, UNSCALED (gradients of the
    reduced loss restricted to sample ``n``), running the sum checks when due
    (``GradHooks._sum_check_key``). ``caps``: the records ``plans`` was made from (default: all
    of the batch)."""
    sq: Dict[int, Tensor] = {}
    probes, projections = [], []
    key = gh._sum_check_key()
    check = key is not None
    partial: Dict[int, Tensor] = {}  # materialised params with several calls, summed so far
    left = {pid: len(p.entries) for pid, p in plans.items()
            if p.kind not in (_GRAM, _FORMS, _ROWS)}

    def reduce(pid: int, t: Tensor, low: Optional[torch.dtype]) -> None:
        if pid in partial:
            t = partial.pop(pid) + t
        left[pid] -= 1
        if left[pid]:
            partial[pid] = t
            return
        sq[pid] = _sq(t.reshape(t.shape[0], -1), 1)
        if check:
            probes.append(_probed(plans[pid].name, t, gh._param_grads.get(pid), low or t.dtype))

    def project(pid: int, a: Tensor, g: Tensor, caps) -> None:
        low = next((cap.low for cap in caps if cap.low is not None), a.dtype)
        name = plans[pid].name
        projections.append((name, _projection_terms(name, a, g, gh._param_grads.get(pid)), low))

    done = set()
    for cap in gh._reached if caps is None else caps:
        layer = cap.layer
        if type(layer.rule) is LinearRule and cap.a.dim() == 2 and all(
                len(plans[id(layer.params[n])].entries) == 1 for n in cap.names):
            # Linear on (B, in) used once: ||dW_n||^2 = ||a_n||^2 ||g_n||^2, ||db_n||^2 = ||g_n||^2
            a, g = cap.a, _summed_grad(cap)
            dt = a.dtype
            if g.dtype != dt or dt in (torch.bfloat16, torch.float16):
                dt = compute_dtype(a, g)
                a, g = a.to(dt), g.to(dt)
            g_sq = torch.linalg.vecdot(g, g)
            for local in cap.names:
                pid = id(layer.params[local])
                done.add(pid)
                if local == "bias":
                    sq[pid] = g_sq
                    if check:
                        probes.append(_probed(plans[pid].name, g, gh._param_grads.get(pid),
                                              cap.low or dt))
                else:
                    sq[pid] = torch.linalg.vecdot(a, a).mul_(g_sq)
                    if check:
                        project(pid, a[:, None, None], g[:, None, None], [cap])  # (N, 1, 1, .)
            continue
        rest = []
        for local in cap.names:
            pid = id(layer.params[local])
            kind = plans[pid].kind
            if kind == _CLOSED and local == "bias":
                reduce(pid, _bias_grads(cap, gh.batch_first), cap.low)
            elif kind not in (_GRAM, _FORMS, _ROWS):
                rest.append(local)
        if rest:
            out = call_grads(layer.rule, layer.module, cap.a, _grads_arg(cap), gh.batch_first,
                             rest, None)
            for local, t in out.items():
                reduce(id(layer.params[local]), t, cap.low)
    for pid, p in plans.items():
        if p.kind == _FORMS:
            _forms_sq_norm(gh, p, forms, sq, probes, projections, check)
        elif p.kind == _ROWS:
            r = forms.rows(p)
            sq[pid] = _rows_sq_norms(r, gh._batch_size, gh._params[pid].shape[0])
            if check:
                probes.append(_rows_probed(gh, p, r))
        if p.kind != _GRAM or pid in done:
            continue
        calls = [_canonical(cap, gh.batch_first) for cap, _ in p.entries]
        if len(calls) == 1:
            a, g = calls[0]
        else:
            dt = compute_dtype(*(t for call in calls for t in call))
            a = torch.cat([c[0].to(dt) for c in calls], 2)
            g = torch.cat([c[1].to(dt) for c in calls], 2)
        sq[pid] = gram_sq_norms(a, g)
        if check:
            project(pid, a, g, [cap for cap, _ in p.entries])
    if probes:
        check_sums(probes, None)
    if projections:
        _check_projections(projections)
    if check:
        gh._sum_check_passed(key)
    return sq


def _forms_sq_norm(gh, p: _Param, forms: _Forms, sq, probes, projections, check: bool) -> None:
    """Squared per-sample norm of a parameter given in factored form: per row block the Gram
    form where :func:`use_gram` says it is cheaper, else the block materialised; sum checks:
    weight-like blocks on the random projection (their terms add up to the whole parameter's),
    bias-like blocks on the probes within their rows."""
    pid, name = p.pid, p.name
    low = next((cap.low for cap, _ in p.entries if cap.low is not None), None)
    total = gh._param_grads.get(pid) if check else None
    blocks = forms.blocks(p)
    if blocks is None:  # the calls' row blocks differ: materialise, as any other rule
        t = forms.materialised(p, gh._params[pid].shape)
        sq[pid] = _sq(t.reshape(t.shape[0], -1), 1)
        if check:
            probes.append(_probed(name, t, total, low or t.dtype))
        return
    acc = None
    for b in blocks:
        if b.a is not None:  # weight-like: checked on the projection (blocks add up)
            a4, g4 = b.a.unsqueeze(1), b.g.unsqueeze(1)
            shared = forms.sharing(b.g)
            if use_gram(b.a.shape[1], b.a.shape[2], b.g.shape[2], shared):
                if shared > 1:  # the grad_output's Gram matrix is formed once for its blocks
                    aa = b.a @ b.a.transpose(-1, -2)
                    part = aa.mul_(forms.gram(b.g)).view(aa.shape[0], -1).sum(1)
                else:
                    part = gram_sq_norms(a4, g4)
            else:
                part = _sq(weight_grad(a4, g4).view(b.g.shape[0], -1), 1)
            if check:
                projections.append((name, _projection_terms(name, a4, g4, total, b.rows),
                                    low or a4.dtype))
        else:  # bias-like: on the probes within its rows
            t = b.g.sum(1)
            part = _sq(t, 1)
            if check:
                item = _probed(name, t, total, low or t.dtype, b.rows)
                if item is not None:
                    probes.append(item)
        acc = part if acc is None else acc + part
    if acc is None:  # no block: a path of the layer no backward reached (norm 0)
        param = gh._params[pid]
        acc = torch.zeros(gh._batch_size, dtype=compute_dtype(param), device=param.device)
    sq[pid] = acc


def _rows(gh, p: _Param) -> Rows:
    """The parameter's :class:`~gradhooks.registry.Rows` over all its calls (entries
    concatenated: calls of one table add up)."""
    parts = []
    for cap, local in p.entries:
        layer = cap.layer
        parts.append(layer.rule.rows(layer.module, cap.a, _grads_arg(cap), gh.batch_first,
                                     [local])[local])
    if len(parts) == 1:
        return parts[0]
    dt = compute_dtype(*(r.values for r in parts))
    return Rows(torch.cat([r.sample for r in parts]), torch.cat([r.row for r in parts]),
                torch.cat([r.values.to(dt) for r in parts]))


def _rows_sq_norms(r: Rows, batch: int, num_rows: int) -> Tensor:
    """``(N,)`` squared per-sample norms of a row-scatter gradient (:class:`Rows`): the entries
    summed per ``(sample, row)`` pair (one sort of the ``E`` pair keys and an ``index_add``),
    then their squared norms summed per sample; ``O(E (D + log E))``, no ``(N, V, D)`` tensor."""
    key = r.sample * num_rows + r.row
    pairs, which = torch.unique(key, return_inverse=True)
    sums = r.values.new_zeros(pairs.shape[0], r.values.shape[1]).index_add_(0, which, r.values)
    return r.values.new_zeros(batch).index_add_(0, pairs // num_rows, _sq(sums, 1))


def _rows_probed(gh, p: _Param, r: Rows) -> tuple:
    """The sum-check item (:func:`~gradhooks.per_sample.check_sums`) of a row-scatter parameter:
    its per-sample gradients at the probe coordinates ``(N, K)``, formed for the probed rows only
    (at most one per probe) instead of all ``V``."""
    total = gh._param_grads.get(p.pid)
    if total is None:
        raise _no_total(p.name)
    shape = gh._params[p.pid].shape
    idx = total.probe_index()
    width = shape.numel() // shape[0]
    prow, pcol = idx // width, idx % width
    rows, slot = torch.unique(prow, return_inverse=True)  # the R probed rows
    pos = torch.full((shape[0],), -1, dtype=torch.long, device=idx.device)
    pos[rows] = torch.arange(rows.shape[0], device=idx.device)
    at = pos[r.row]
    keep = at >= 0
    n_rows = rows.shape[0]
    acc = r.values.new_zeros(gh._batch_size * n_rows, r.values.shape[1])
    acc.index_add_(0, r.sample[keep] * n_rows + at[keep], r.values[keep])
    low = next((cap.low for cap, _ in p.entries if cap.low is not None), r.values.dtype)
    return p.name, acc.view(gh._batch_size, n_rows, -1)[:, slot, pcol], total.probe_values(), low


def _forms_weighted(gh, p: _Param, forms: _Forms, c: Tensor, dest=_no_dest) -> Tensor:
    """``sum_n c_n d(param)_n`` of a parameter in factored form: per block one matmul
    ``sum_{n,s} (c_n g[n,s]) a[n,s]^T`` (or ``sum_{n,s} c_n g[n,s]``), rows concatenated;
    written into ``dest(id(param), dtype)`` when that gives a tensor (one block only)."""
    shape = gh._params[p.pid].shape
    blocks = forms.blocks(p)
    if blocks is None:
        t = forms.materialised(p, shape)
        return torch.tensordot(c.to(t.dtype), t, 1)
    if not blocks:  # no backward reached this path of the layer
        return torch.zeros(shape, dtype=c.dtype, device=c.device)
    parts = []
    for b in blocks:
        cw = c.to(b.g.dtype)
        if b.a is None:
            parts.append((b.g.sum(1).t(), cw))  # (O, N) @ (N,)
            continue
        a, g = _weigh(b.a, b.g, cw, 0)
        if a.stride(0) < a.stride(1) and g.stride(0) < g.stride(1):
            # stored position-major (a recurrent replay's (T, B, .)): the sum over (n, s) does
            # not care for the order, and flattening that way needs no copy
            a, g = a.transpose(0, 1), g.transpose(0, 1)
        parts.append((g.reshape(-1, g.shape[-1]).t(), a.reshape(-1, a.shape[-1])))
    if len(parts) == 1:
        m, v = parts[0]
        into = dest(p.pid, m.dtype)
        if into is not None:
            into = into.view(m.shape[0], *v.shape[1:])
        return torch.matmul(m, v, out=into).view(shape)
    return torch.cat([(m @ v).reshape(m.shape[0], -1) for m, v in parts], 0).reshape(shape)


def _ghost_sums(gh, plans: Dict[int, _Param], c: Tensor, assign, forms: _Forms) -> None:
    """``sum_n c_n d(param)_n`` (unscaled per-sample gradients) for each parameter, from the
    records: closed forms for Linear/Conv, one materialised layer at a time otherwise. Calls
    ``assign(pid, sum)`` as soon as a parameter's sum is complete (so that its old ``.grad`` can
    be freed before the next layer is processed). Linear weights and biases and single-block
    factored forms are written straight into the parameter's ``.grad`` when it has the
    parameter's shape, the computation's dtype and a contiguous layout (no second tensor of the
    parameter's size: ghost clipping's peak stays at plain training's)."""
    left = {pid: len(p.entries) for pid, p in plans.items()}
    partial: Dict[int, Tensor] = {}
    offered: set = set()

    def dest(pid: int, dtype: torch.dtype) -> Optional[Tensor]:
        # The parameter's current .grad, for its first contribution only (later ones add to it).
        if pid in offered:
            return None
        offered.add(pid)
        grad = gh._params[pid].grad
        if (grad is None or grad.dtype != dtype or grad.layout != torch.strided
                or grad.shape != gh._params[pid].shape or not grad.is_contiguous()):
            return None
        return grad

    def add(pid: int, t: Tensor) -> None:  # ``t`` is a new tensor
        if pid in partial:
            t = partial.pop(pid).add_(t)
        left[pid] -= 1
        if left[pid]:
            partial[pid] = t
        else:
            assign(pid, t)

    for pid, p in plans.items():
        if p.kind == _FORMS:
            assign(pid, _forms_weighted(gh, p, forms, c, dest))
        elif p.kind == _ROWS:  # sum_n c_n d(param)_n: one index_add of the weighted entries
            r = forms.rows(p)
            out = r.values.new_zeros(gh._params[pid].shape)
            assign(pid, out.index_add_(0, r.row, r.values * c.to(r.values.dtype)[r.sample, None]))
    forms.calls.clear()
    forms.joined.clear()
    forms.scatters.clear()
    for cap in gh._reached:
        layer = cap.layer
        kinds = [plans[id(layer.params[n])].kind for n in cap.names]
        closed = [n for n, k in zip(cap.names, kinds) if k in (_GRAM, _CLOSED)]
        generic = [n for n, k in zip(cap.names, kinds) if k == _GENERIC]
        if closed:
            for local, t in _weighted_closed(cap, closed, c, gh.batch_first, dest).items():
                add(id(layer.params[local]), t)
        if generic:
            out = call_grads(layer.rule, layer.module, cap.a, _grads_arg(cap), gh.batch_first,
                             generic, None)
            for local, t in out.items():
                pid = id(layer.params[local])
                offered.add(pid)
                add(pid, torch.tensordot(c.to(t.dtype), t, 1))


# ------------------------------------------------------------------------------------- public API
def per_sample_grad_norms(gh, *, per_param: bool = False) -> Union[Tensor, Dict[str, Tensor]]:
    """L2 norms of the per-sample gradients over all trainable parameters the backward reached,
    without materialising them where a cheaper closed form exists.

    Args:
        gh: the :class:`~gradhooks.GradHooks` (called as ``gh.per_sample_grad_norms()``).
        per_param: if ``True`` return the norm of each parameter's per-sample gradient instead.

    Returns:
        ``(B,)``: ``||dtheta_n||_2`` over the concatenation of all trainable parameters the
        backward passes of this batch reached (frozen and unreached parameters contribute 0);
        ``dtheta_n`` is what :meth:`~gradhooks.GradHooks.per_sample_grads` returns for sample
        ``n`` (for ``loss_reduction="mean"`` the gradient of the sample's own loss, i.e. ``B``
        times the recorded one). With ``per_param=True``: ``{name: (B,)}`` in the order of
        ``model.named_parameters()`` (a tied parameter once). Dtype: the promoted dtype of the
        records, at least float32. Linear/Conv weights use the Gram form when cheaper (Li et al.
        2022, arXiv:2110.05679, sec. 4), other parameters are materialised one layer at a time;
        see the module docstring. Not cached: each call recomputes. After
        :meth:`~gradhooks.GradHooks.per_sample_grads` released the records (its default), the
        norms of its result.

    Raises:
        NoBackwardError: if no backward pass reached a hooked layer since the batch started.
        HigherOrderGradError: if a backward pass ran with ``create_graph=True`` through a hooked
            layer.
        GradientMismatchError: if a recorded input was modified in place, or (``check=True``)
            the per-sample gradients do not sum to autograd's gradient.
    """
    from .hooks import _no_autocast

    if gh._released:  # per_sample_grads() formed the result and released the records
        sq_of = _result_sq_norms(gh.per_sample_grads())
        if per_param:
            return {name: t.sqrt_() for name, t in sq_of.items()}
        return _total(sq_of.values()).sqrt_()
    plans, scale = _plan(gh, "per_sample_grad_norms()")
    with _no_autocast():
        sq = _sq_norms(gh, plans, _Forms(gh, plans))
    factor = 1.0 if scale is None else scale
    if per_param:
        return {p.name: sq[pid].sqrt().mul_(factor) for pid, p in plans.items()}
    return _total(sq.values()).sqrt_().mul_(factor)


def clip_and_accumulate(gh, max_norm: float, *, method: str = "ghost",
                        noise_multiplier: float = 0.0,
                        generator: Optional[torch.Generator] = None) -> Tensor:
    """DP-SGD step gradient: per-sample clipping to ``max_norm``, summed, plus Gaussian noise,
    written to ``param.grad``.

    Sets, for every trainable parameter ``theta`` of the model (Abadi et al. 2016,
    arXiv:1607.00133, algorithm 1)::

        theta.grad = (sum_n min(1, C / ||dtheta_n||) dtheta_n + sigma C z) / D

    with ``C = max_norm``, ``sigma = noise_multiplier``, ``z ~ N(0, I)`` drawn from
    ``generator``, ``||dtheta_n||`` the norm over all parameters (:func:`per_sample_grad_norms`;
    ``dtheta_n`` is the gradient of sample ``n``'s own loss), and ``D = B`` for
    ``loss_reduction="mean"``, ``D = 1`` for ``"sum"``. For Poisson sampling (where DP-SGD
    divides by the *expected* batch size) use ``loss_reduction="sum"`` and divide
    ``param.grad`` (or the learning rate) by it yourself.

    **param.grad is overwritten**, whatever autograd accumulated into it (the unclipped batch
    gradient, and anything earlier): for gradient accumulation over several batches, sum the
    results yourself. With ``method="ghost"`` Linear parameters and those of recurrent and
    attention layers are written into the existing ``.grad`` tensor where it has the
    parameter's shape, dtype and a contiguous layout (like ``torch.nn.utils.clip_grad_norm_``,
    in place: a reference to the old ``.grad`` sees the new values), so that no second
    gradient-sized tensor is allocated; the others get a new tensor. Trainable parameters the
    backward did not reach get the clipped sum 0 plus the noise (DP requires noise on every
    released coordinate); frozen parameters (``requires_grad=False``) are left alone.

    Args:
        gh: the :class:`~gradhooks.GradHooks` (called as ``gh.clip_and_accumulate(...)``).
        max_norm: ``C > 0``.
        method: ``"ghost"`` (default): norms by the Gram form where cheaper, clipped sums from
            the records with one weighted contraction per Linear/Conv call and per block of
            recurrent and attention layers, one ``index_add`` per Embedding (Li et al. 2022,
            sec. 4; Bu et al. 2023,
            arXiv:2210.00038, book-keeping), other layers materialised one at a time (twice:
            once for the norms, once for the sum); peak memory close to plain training. ``"materialize"``:
            :meth:`~gradhooks.GradHooks.per_sample_grads` (kept, and set as
            ``param.grad_sample``; runs its sum check), then the weighted sum. Both give the
            same result up to rounding. After ``per_sample_grads()`` released the records (its
            default), ``"ghost"`` clips its result as ``"materialize"`` does.
        noise_multiplier: ``sigma >= 0``; ``0`` adds no noise.
        generator: a ``torch.Generator`` on the parameters' device, for reproducible noise
            (default: torch's global generator). The noise is drawn parameter by parameter in the
            order of ``model.named_parameters()``.

    Returns:
        ``(B,)``: the per-sample gradient norms before clipping (the clip factors are
        ``(max_norm / norms).clamp(max=1)``).

    Raises:
        ValueError: if ``max_norm`` is not a positive finite number, ``noise_multiplier`` is
            negative, or ``method`` is unknown.
        GradHooksError: if a trainable parameter of the model is not covered by the hooks (it
            was frozen when :func:`gradhooks.attach` ran and its module has no rule): it could
            not be clipped.
        NoBackwardError, HigherOrderGradError, GradientMismatchError: as
            :func:`per_sample_grad_norms`.
    """
    from .hooks import _no_autocast

    if method not in CLIP_METHODS:
        raise ValueError(f"method must be one of {CLIP_METHODS}, got {method!r}")
    trainable = _clip_setup(gh, max_norm, noise_multiplier)
    if gh._released:  # per_sample_grads() formed the result and released the records
        method = "materialize"
    else:
        plans, scale = _plan(gh, "clip_and_accumulate()")
    divisor = reduction_scale(gh.loss_reduction, gh._batch_size) or 1.0  # "mean": B
    assigned = set()

    def assign(pid: int, t: Tensor) -> None:
        p = gh._params[pid]
        if p.grad is None or t.data_ptr() != p.grad.data_ptr():  # else written into it already
            p.grad = t.to(p.dtype)  # replaces (frees) autograd's gradient right away
        assigned.add(pid)

    with _no_autocast():
        if method == "ghost":
            forms = _Forms(gh, plans)
            norms = _total(_sq_norms(gh, plans, forms).values()).sqrt_().mul_(divisor)
            factors = (max_norm / norms).clamp_(max=1.0)
            # The records are the per-sample gradients divided by D: weighting them gives sum / D.
            _ghost_sums(gh, plans, factors, assign, forms)
        else:
            grads = gh.per_sample_grads()
            pids = {name: pid for pid, name in gh._names.items()}
            norms = _total(_result_sq_norms(grads).values()).sqrt_()
            factors = (max_norm / norms).clamp_(max=1.0)
            for name, t in grads.items():
                assign(pids[name], torch.tensordot(factors.to(t.dtype), t, 1).div_(divisor))
    _add_noise(trainable, assigned, noise_multiplier * max_norm / divisor, generator)
    return norms


def _result_sq_norms(grads: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """``{name: (B,)}`` squared L2 norms of materialised per-sample gradients ``(B, ...)``, in
    at least float32."""
    return {name: _sq(t.reshape(t.shape[0], -1).to(compute_dtype(t)), 1)
            for name, t in grads.items()}


def _clip_setup(gh, max_norm, noise_multiplier) -> List[Tuple[str, nn.Parameter]]:
    """Check the clipping arguments; return the model's trainable ``(name, param)``.

    Raises:
        ValueError: ``max_norm`` not a positive finite number, ``noise_multiplier`` negative.
        GradHooksError: a trainable parameter the hooks do not cover."""
    if not (isinstance(max_norm, (int, float)) and math.isfinite(max_norm) and max_norm > 0):
        raise ValueError(f"max_norm must be a positive finite number (the clipping bound C), "
                         f"got {max_norm!r}")
    if not (isinstance(noise_multiplier, (int, float)) and noise_multiplier >= 0):
        raise ValueError(f"noise_multiplier must be >= 0 (noise std / max_norm), got "
                         f"{noise_multiplier!r}")
    trainable = [(n, p) for n, p in gh.model.named_parameters() if p.requires_grad]
    missing = [n for n, p in trainable if id(p) not in gh._params]
    if missing:
        raise GradHooksError(
            f"trainable parameters {', '.join(map(repr, missing))} are not covered by the hooks "
            f"(they were frozen when attach() ran and their module has no rule), so they cannot "
            f"be clipped: detach and attach again after unfreezing them"
        )
    return trainable


def _add_noise(trainable, assigned, std: float, generator) -> None:
    """``param.grad += std * N(0, I)`` in the order of ``trainable``; parameters whose id is not
    in ``assigned`` first get ``.grad = 0`` (DP noises every released coordinate)."""
    for _, p in trainable:
        if id(p) not in assigned:
            p.grad = torch.zeros_like(p)
        if std > 0:
            p.grad.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype, device=p.device),
                        alpha=std)


class _NormStream:
    """Per-sample squared norms formed while :func:`clipped_backward`'s first pass runs.

    The records are split into groups linked by shared parameters (a layer called twice, tied
    weights). As soon as every record of a group has had all its hook calls (``events``), the
    group's norms are formed (:func:`_sq_norms`) and its activations and grad_outputs dropped,
    so grad_outputs do not pile up over the backward as in book-keeping.
    """

    def __init__(self, gh, caps: list, events: Dict[int, int]):
        self.gh, self.events, self.hits = gh, events, {}
        parent = {id(c): id(c) for c in caps}

        def root(x: int) -> int:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        owner: Dict[int, int] = {}  # id(param) -> a record that uses it
        for cap in caps:
            for local in cap.names:
                pid = id(cap.layer.params[local])
                if pid in owner:
                    parent[root(id(cap))] = root(owner[pid])
                else:
                    owner[pid] = id(cap)
        groups: Dict[int, list] = {}
        for cap in caps:
            groups.setdefault(root(id(cap)), []).append(cap)
        self.group_of = {id(c): g for g in groups.values() for c in g}
        self.waiting = {id(g): len(g) for g in groups.values()}
        self.groups = list(groups.values())
        self.sq: Optional[Tensor] = None

    def hit(self, cap) -> None:
        k = self.hits.get(id(cap), 0) + 1
        self.hits[id(cap)] = k
        if k == self.events.get(id(cap)):
            group = self.group_of[id(cap)]
            self.waiting[id(group)] -= 1
            if not self.waiting[id(group)]:
                self._reduce(group)

    def _reduce(self, group: list) -> None:
        del self.waiting[id(group)]
        gh = self.gh
        reached = [cap for cap in group if cap.hits]
        if reached:
            plans = _plan_caps(gh, reached)
            self.sq = _total([self.sq, *_sq_norms(gh, plans, _Forms(gh, plans), reached).values()])
        for cap in group:
            cap.release()

    def finish(self) -> Optional[Tensor]:
        """Reduce the groups some of whose hooks did not run (an output no gradient reached);
        ``(N,)`` squared norms summed over all parameters, or ``None`` if nothing was reached."""
        for group in self.groups:
            if id(group) in self.waiting:
                self._reduce(group)
        return self.sq


def clipped_backward(gh, losses: Tensor, max_norm: float, *, noise_multiplier: float = 0.0,
                     generator: Optional[torch.Generator] = None) -> Tensor:
    """DP-SGD step gradient by two-pass ghost clipping (Li et al. 2022, arXiv:2110.05679,
    sec. 4): ``param.grad`` as :func:`clip_and_accumulate` sets it, from the per-sample losses,
    with peak memory close to plain training.

    Replaces ``loss.backward()`` (call it after the forward, instead of any backward). First pass:
    a backward of ``losses.sum()`` (as :meth:`~gradhooks.GradHooks.backward`: no weight
    gradients, graph retained) during which each layer's per-sample squared norms are formed as
    soon as its grad_outputs are in (Gram form where cheaper, as
    :func:`per_sample_grad_norms`) and its records dropped. Then ``c_n = min(1, C / ||g_n||)``,
    and a second, ordinary backward of ``sum_n c_n losses[n] / D`` writes the clipped sum into
    ``param.grad`` (autograd's weight-gradient kernels, no per-sample tensor, no records kept).
    Book-keeping (:func:`clip_and_accumulate` after a backward) instead keeps every layer's
    activations and grad_outputs until the norms are known and needs no per-sample losses;
    this costs one more backward pass but keeps only what plain training keeps (measured in
    ``benchmarks/``).

    **param.grad is overwritten** (set to ``None`` before the second pass), parameters the
    passes do not reach get ``0``, plus the noise, frozen ones are left alone -- as
    :func:`clip_and_accumulate`. The records of the batch are consumed: reading per-sample
    results afterwards raises :class:`~gradhooks.NoBackwardError`. The sum check runs on the
    steps :meth:`~gradhooks.GradHooks.backward` computes parameter gradients for it (first
    steps, new structures, every 100th); on those the first pass keeps the records until the
    end, as book-keeping does.

    Args:
        gh: the :class:`~gradhooks.GradHooks` (called as ``gh.clipped_backward(...)``).
        losses: ``(B,)`` per-sample losses of the current batch (``reduction="none"``), sample
            ``n``'s own loss, whose gradient is the per-sample gradient ``g_n``.
        max_norm: ``C > 0``.
        noise_multiplier: ``sigma >= 0``; the noise ``sigma C z / D`` is added as in
            :func:`clip_and_accumulate` (``D = B`` for ``loss_reduction="mean"``, else 1).
        generator: a ``torch.Generator`` for the noise.

    Returns:
        ``(B,)``: the per-sample gradient norms ``||g_n||`` before clipping.

    Raises:
        ValueError: bad ``max_norm`` or ``noise_multiplier``, or ``losses`` not a ``(B,)`` tensor
            that requires grad, ``B`` the batch size the hooks recorded.
        GradHooksError: a trainable parameter the hooks do not cover.
        NoBackwardError, GradientMismatchError: as :func:`per_sample_grad_norms`.
    """
    from .hooks import _no_autocast

    trainable = _clip_setup(gh, max_norm, noise_multiplier)
    batch = gh._batch_size
    if not (isinstance(losses, Tensor) and losses.dim() == 1 and losses.requires_grad
            and losses.shape[0] == batch):
        shape = tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__
        raise ValueError(
            f"clipped_backward needs the (B,) per-sample losses of the current batch (B = "
            f"{batch}, e.g. F.cross_entropy(out, y, reduction='none')) that require grad; got "
            f"{shape}" + ("" if not isinstance(losses, Tensor) or losses.requires_grad
                          else " not requiring grad"))
    streams: list = []

    def stream(caps, events):
        streams.append(_NormStream(gh, caps, events))
        return streams[0]

    with _no_autocast():
        if gh._drive(losses.sum(), None, True, stream):
            sq = streams[0].finish()
            if sq is None:
                _plan(gh, "clipped_backward()")  # raises NoBackwardError
        else:  # the sum check is due: records kept, checked, then reduced
            plans, _ = _plan(gh, "clipped_backward()")
            sq = _total(_sq_norms(gh, plans, _Forms(gh, plans)).values())
    norms = sq.sqrt_()
    factors = (max_norm / norms).clamp_(max=1.0)
    divisor = reduction_scale(gh.loss_reduction, batch) or 1.0
    gh._reset_batch()  # records consumed; the second pass records nothing
    for _, p in trainable:
        p.grad = None
    gh._muted = True
    try:
        (losses * (factors / divisor).to(losses.dtype)).sum().backward()
    finally:
        gh._muted = False
    _add_noise(trainable, {id(p) for _, p in trainable if p.grad is not None},
               noise_multiplier * max_norm / divisor, generator)
    return norms
