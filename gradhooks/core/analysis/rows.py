"""Per-sample gradients of a weight read functionally by a linear map of batched rows:
``y = F.linear(x, W, b)`` inside a module without a rule (a mixture of experts' router on its
``(B * T, D)`` token rows, an expert's ``(E, O, I)`` weight slice on the rows routed to it).

Index conventions: ``n`` the sample, ``r`` a row, ``s`` the positions a row holds, ``i`` in,
``o`` out. With sample ``n``'s rows ``R_n`` (their batch dim from
:mod:`gradhooks.core.analysis.provenance`: an int, a merged ``(dim, inner)``, or
:class:`~gradhooks.core.analysis.batch_dims.Routed` rows)::

    dL_n/dW = sum_{r in R_n} g[r] x[r]^T        dL_n/db = sum_{r in R_n} g[r]

(Goodfellow 2015, arXiv:1510.01799, sec. 3), at the cost of the op's own rows. A grouped
product's weight and an expert's slice ``weight[e]`` hand their parameter the rows themselves,
keyed by (sample, expert) (:class:`~gradhooks.base.segments.Segments`): formed, normed or
summed only when read.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor
from torch.autograd.graph import get_gradient_edge

from ...base.segments import Segments, per_key_rows, routed_layout, segment_outer
from ...base.torch_internals import saved
from ...base.utils import OWNED
from ...rules.fallback import FallbackRule
from .batch_dims import Routed

__all__ = ["meeting_cotangent", "by_sample", "linear_cotangents", "own_weights", "linear_meeting",
           "grouped_cotangents", "grouped_meeting", "gathered_meeting", "segment_outer", "ADDS"]


def by_sample(t: Tensor, bd, size: int) -> Optional[Tensor]:
    """``t``'s rows grouped by sample, ``(size, S, F)`` (``F`` its last dim), for a batch dim
    ``bd`` that is an int or a merged ``(dim, inner)`` before the last dim; ``None`` otherwise
    (:class:`Routed` rows: :func:`linear_cotangents` scatters them)."""
    d, inner = bd if isinstance(bd, tuple) else (bd, 1)
    if not isinstance(d, int) or d >= t.dim() - 1:
        return None
    t = t.movedim(d, 0)  # (each sample's rows counted, not -1: an empty batch has none)
    return t.reshape(size, inner * math.prod(t.shape[1:-1]), t.shape[-1])


def _padded(t: Tensor, samples: Tensor, size: int) -> Tensor:
    # Routed rows (R, ..., F) laid out per sample, (size, R_max * S, F), zeros after each
    # sample's own rows: the contraction then costs what the rows' own weight gradient does
    # (a one-hot over the samples would cost size times that).
    rows = t.reshape(t.shape[0], -1, t.shape[-1])
    return per_key_rows(rows, routed_layout(samples, size)).flatten(1, 2)


def linear_cotangents(x: Tensor, g: Tensor, bd, size: int, weight: bool, bias: bool):
    """Each sample's gradient of ``F.linear``'s weight ``(size, O, I)`` and bias ``(size, O)``
    (``None`` for those not asked for) from its input ``x (..., I)`` and the gradient ``g
    (..., O)`` of its output, the samples' rows as ``bd`` says."""
    xs, gs = by_sample(x, bd, size), by_sample(g, bd, size)
    if xs is None:  # (Routed: rows on dim 0, row r of sample bd.samples[r], in any order)
        x, g = x.reshape(x.shape[0], -1, x.shape[-1]), g.reshape(g.shape[0], -1, g.shape[-1])
        if weight and x.shape[1] == 1:
            gw = segment_outer(g[:, 0], x[:, 0], bd.samples, size)
            gb = segment_outer(g[:, 0], None, bd.samples, size) if bias else None
            return gw, gb
        xs, gs = _padded(x, bd.samples, size), _padded(g, bd.samples, size)
    gw = torch.einsum("nso,nsi->noi", gs, xs) if weight else None
    return gw, gs.sum(1) if bias else None


def own_weights(prov, args, kwargs):
    """``(operands, sources)``: ``F.linear``'s weight / bias on a batch merged with other dims
    or routed (a mixture of experts' router and experts), where it is a parameter of a module
    without a rule, or made from one by ops of one input (an expert's ``weight[e]``): the
    parameter is made a source of its own (``prov``: the
    :class:`~gradhooks.core.analysis.provenance.Provenance`, its ``param_sources_of``) and the operand
    tagged with it, its per-sample gradient taken at this op (:func:`linear_meeting`)."""
    found, sources = [], None
    for u in (args[1:3] if len(args) > 1 else ()) + tuple(
            kwargs[k] for k in ("weight", "bias") if k in kwargs):
        if not isinstance(u, Tensor) or not u.requires_grad:
            continue
        node, param = u.grad_fn, u
        for _ in range(4):
            if node is None:
                break
            if hasattr(node, "variable"):  # (AccumulateGrad)
                param, node = node.variable, None
                break
            nxt = [f for f, _ in node.next_functions if f is not None]
            node = nxt[0] if len(nxt) == 1 else None
            param = None if node is None else param
        info = prov.params.get(id(param)) if node is None and param is not None else None
        if info is None or info[1] is not None or len(info[0]) != 1 or not isinstance(
                info[0][0].rule, FallbackRule):
            continue
        layer = info[0][0]
        name = next((n for n, q in layer.params.items() if q is param), None)
        if name is None:
            continue
        src = prov.param_sources_of([((layer, name), param)])
        prov.add_sources([u], src)
        found.append(u)
        sources = src if sources is None else sources + tuple(
            x for x in src if all(x[0] is not y[0] for y in sources))
    return found, sources



def linear_meeting(prov, args, kwargs, ref, bd, tainted):
    """``F.linear(x, W, b)`` with ``x`` batched (``ref``, its rows grouped by sample as ``bd``
    says: merged, :class:`Routed`, or an int, the batch dim, where ``W`` carries sources: a
    weight computed from raw parameters, peft's LoKr ``kron(w1, w2)``) and ``W`` / ``b``
    carrying sources (``tainted``): returns ``hook(out)``, to call on the op's output, which
    registers the backward hook that forms each sample's gradient of ``W`` / ``b`` from its own
    rows (:func:`linear_cotangents`) and hands it to provenance's ``meet`` as ``"given"``; or
    ``None`` for any other layout (the op is then left to provenance's split, which refuses it
    or, for a bias alone, broadcasts it)."""
    x = args[0] if args else kwargs.get("input")
    w = args[1] if len(args) > 1 else kwargs.get("weight")
    b = args[2] if len(args) > 2 else kwargs.get("bias")
    if isinstance(bd, int):
        if not any(u is w for u in tainted):
            return None
        bd = (bd, 1)
    if x is not ref or x.dim() < 2 or any(u is not w and u is not b for u in tainted):
        return None
    size = prov.batch_size
    if isinstance(bd, tuple) and (bd[0] >= x.dim() - 1 or x.shape[bd[0]] != size * bd[1]):
        return None
    if isinstance(bd, Routed) and (bd.samples.numel() and int(bd.samples.max()) >= size):
        return None
    xd = x.detach()
    return _meeting(prov, w, b, tainted, lambda g, gw, gb: linear_cotangents(
        xd, g, bd, size, gw, gb), rows=lambda g: _sample_rows(xd, g, bd, size))


def _sample_rows(x: Tensor, g: Tensor, bd, size: int):
    # (x rows (R, I), g rows (R, O), their samples (R,)) of F.linear's input and output
    # gradient, the samples' rows as bd says (merged (dim, inner) or Routed)
    if isinstance(bd, Routed):
        samples = bd.samples.to(torch.int64)
    else:
        d, inner = bd
        x, g = x.movedim(d, 0), g.movedim(d, 0)
        samples = torch.arange(x.shape[0], device=x.device) // inner
    positions = x[0].numel() // x.shape[-1] if x.shape[0] else 1
    if positions > 1:
        samples = samples.repeat_interleave(positions)
    return x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1]), samples


def grouped_cotangents(x: Tensor, g: Tensor, samples: Tensor, offs: Tensor, size: int,
                       groups: int, weight: bool, bias: bool, transposed: bool = False):
    """Each sample's gradient of a grouped product's ``(E, I, O)`` weight, ``(size, E, I, O)``
    (``(size, E, O, I)`` with ``transposed``: the layout of the parameter it is a transpose
    of), and of its ``(E, O)`` bias, ``(size, E, O)`` (``None`` for those not asked for), as
    :class:`~gradhooks.base.segments.Segments` (factored: formed only by a reader that needs
    them), from its rows ``x (S, I)``, their output's gradient ``g (S, O)``, the rows' samples
    ``samples (S,)`` and the groups' end offsets ``offs (E,)`` (row ``r`` in group ``e`` for
    ``offs[e-1] <= r < offs[e]``; rows after ``offs[-1]`` are in none)::

        dL_n/dW_e = sum_{r of sample n in group e} x[r] g[r]^T

    one segment per ``(sample, group)`` pair."""
    rows = x.shape[0]
    group = torch.searchsorted(offs.to(torch.int64), torch.arange(rows, device=x.device),
                               right=True)
    key = samples.to(torch.int64) * groups + group
    inside = group < groups
    if not bool(inside.all()):
        x, g, key = x[inside], g[inside], key[inside]
    gw = gb = None
    if weight:
        u, v = (g, x) if transposed else (x, g)
        gw = Segments(u, v, key, size, (groups, u.shape[-1], v.shape[-1]))
    if bias:
        gb = Segments(g, None, key, size, (groups, g.shape[-1]))
    return gw, gb


def grouped_meeting(prov, args, kwargs, ref, bd, tainted):
    """A grouped product ``grouped_mm(x, W, offs=offs)`` (:func:`~gradhooks.core.analysis.batch_dims.is_grouped_mm`:
    transformers' grouped experts, ``x`` the ``(S, I)`` token rows sorted by expert, ``W`` an
    ``(E, I, O)`` parameter or its transpose) with ``x`` batched as merged or :class:`Routed`
    rows and ``W`` (and a ``bias``) carrying sources: ``hook(out)`` as :func:`linear_meeting`,
    each sample's gradient from its own rows in each group (:func:`grouped_cotangents`); a
    weight that is the transpose of its parameter gets it in the parameter's layout, handed at
    the parameter (no pull-back through the transpose); ``None`` for any other form."""
    x = args[0] if args else kwargs.get("input", kwargs.get("mat_a"))
    w = args[1] if len(args) > 1 else kwargs.get("weight", kwargs.get("mat_b"))
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    b = kwargs.get("bias")
    if (x is not ref or x.dim() != 2 or not isinstance(w, Tensor) or w.dim() != 3
            or not isinstance(offs, Tensor) or offs.dim() != 1 or offs.shape[0] != w.shape[0]
            or any(u is not w and u is not b for u in tainted)):
        return None
    size = prov.batch_size
    if isinstance(bd, tuple):
        if bd[0] != 0 or x.shape[0] != size * bd[1]:
            return None
        samples = torch.arange(x.shape[0], device=x.device) // bd[1]
    else:
        samples = bd.samples
        if samples.numel() and int(samples.max()) >= size:
            return None
    xd, offs, groups = x.detach(), offs.detach(), w.shape[0]
    param = _transpose_of(prov, w)
    return _meeting(prov, w, b, tainted, lambda g, gw, gb: grouped_cotangents(
        xd, g, samples, offs, size, groups, gw, gb, transposed=param is not None),
        whole={id(w): param} if param is not None else None)


#: In-place and out-of-place adds: where a per-row bias gathered from a parameter meets rows.
ADDS = frozenset(getattr(torch.Tensor, n) for n in ("add", "add_", "__add__", "__iadd__",
                                                    "__radd__")) | {torch.add}


def gathered_meeting(prov, func, args, kwargs, ref, bd):
    """``rows + P[idx]`` (an add, :data:`ADDS`) with ``rows`` :class:`Routed` and ``P[idx]``
    a row per routed row gathered from a 2-D parameter ``P (E, O)`` of a module without a rule
    by an index of the rows (GPT-OSS' grouped experts add ``gate_up_proj_bias[expert_ids]``):
    ``hook(out)`` as :func:`linear_meeting`, sample ``n``'s gradient of ``P[e]`` the sum of the
    add's output gradient over its rows ``r`` with ``idx[r] = e`` (:func:`segment_outer`); or
    ``None`` for any other form."""
    if not isinstance(bd, Routed) or len(args) < 2 or kwargs.get("alpha", 1) != 1:
        return None
    u = args[1] if args[0] is ref else args[0] if args[1] is ref else None
    node = getattr(u, "grad_fn", None)
    if (node is None or type(node).__name__ != "IndexBackward0" or u.dim() != 2
            or ref.dim() != 2 or u.shape != ref.shape):
        return None
    index = saved(node, "indices")
    param = getattr(node.next_functions[0][0], "variable", None)
    if (param is None or param.dim() != 2 or len(index) != 1 or index[0] is None
            or index[0].dim() != 1):
        return None
    info = prov.params.get(id(param))
    if info is None or len(info[0]) != 1 or not isinstance(info[0][0].rule, FallbackRule):
        return None
    layer = info[0][0]
    name = next((n for n, q in layer.params.items() if q is param), None)
    if name is None:
        return None
    sources = prov.param_sources_of([((layer, name), param)])
    size, groups, idx = prov.batch_size, param.shape[0], index[0].detach().to(torch.int64)
    key = bd.samples.to(torch.int64) * groups + idx
    prov.met_by_rows.add(id(param))
    edge, shape = sources[0][1], tuple(param.shape)

    def hook(out):
        if not isinstance(out, Tensor) or not out.requires_grad:
            return
        prov.noted(sources[:1], "linear", out, None, None)

        def on_grad(g):
            cot = Segments(g, None, key, size, shape)
            prov.meet(edge, sources[:1], "given", shape,
                      cot.dense() if g.requires_grad else cot, None)  # (create_graph: formed)
        out.register_hook(on_grad)
    return hook


def _meeting(prov, w, b, tainted, cotangents, whole=None, rows=None):
    # The hook of a linear-form meeting (linear_meeting, grouped_meeting): on the op's output,
    # a backward hook that forms each sample's cotangents of w / b (``cotangents(g, want_w,
    # want_b)``) and meets them. ``whole``: {id(operand): (param, its sources)} for an operand
    # that is a view of a parameter whose cotangent is formed in the parameter's layout.
    # ``rows(g)``: (x rows, g rows, samples) of the op: an operand that is a slice param[e] of a
    # parameter that is a source of its own (an expert's weight in a per-expert loop) hands the
    # parameter Segments of its rows at key (sample, e) (the experts' parts add up as rows, no
    # (B, E, O, I) tensor per expert).
    us = [(u, u is w) for u in (w, b) if u is not None and u.requires_grad
          and any(u is t for t in tainted)]
    for u, _ in us:  # (the parameters taken here: a module whose every one is, is placed merged)
        for record, _, _ in prov.look(u)[1] or ():
            prov.met_by_rows.update(id(record.layer.params[n]) for n in record.names
                                    if n in record.layer.params)

    def hook(out):
        if not isinstance(out, Tensor) or not out.requires_grad:
            return
        met = []
        for u, is_w in us:
            own = (whole or {}).get(id(u))
            if own is not None:
                met.append((own[1][0][1], own[1][:1], tuple(own[0].shape), is_w, None))
            else:
                met.append((get_gradient_edge(u), prov.look(u)[1], tuple(u.shape), is_w,
                            _slice_of(prov, u, is_w) if rows is not None else None))
        for _, src, _, _, _ in met:
            prov.noted(src, "linear", out, None, None)

        def on_grad(g):
            whole_ = [m for m in met if m[4] is None or g.requires_grad]
            if whole_:
                gw, gb = cotangents(g, any(m[3] for m in whole_), not all(m[3] for m in whole_))
                if g.requires_grad:  # (create_graph: a differentiable read needs the tensors)
                    gw, gb = (t.dense() if isinstance(t, Segments) else t for t in (gw, gb))
                for t in (gw, gb):
                    if isinstance(t, Tensor) and not t.requires_grad:
                        setattr(t, OWNED, True)  # (formed here, for one record: scaled in place)
                for edge, src, shape, is_w, _ in whole_:
                    prov.meet(edge, src, "given", shape, gw if is_w else gb, None)
            if len(whole_) < len(met):
                x_rows, g_rows, samples = rows(g)
                for _, src, _, is_w, (param, index) in (m for m in met if m not in whole_):
                    seg = Segments(g_rows, x_rows if is_w else None,
                                   samples * param.shape[0] + index, prov.batch_size, param.shape)
                    prov.meet(src[0][1], src[:1], "given", tuple(param.shape), seg, None)
        out.register_hook(on_grad)
    return hook


def _transpose_of(prov, u: Tensor):
    # (param, its sources) when u is param.transpose(-2, -1) of a 3-D parameter that is a source
    # of its own (transformers' experts pass gate_up_proj.transpose(-2, -1)), else None.
    node = u.grad_fn
    if type(node).__name__ != "TransposeBackward0" or u.dim() != 3:
        return None
    # (the saved dims are int64 read back unsigned: -2 is 2**64 - 2)
    dims = {(d - (1 << 64) if d >= 1 << 63 else d) % 3
            for d in (saved(node, "dim0"), saved(node, "dim1"))}
    if dims != {1, 2}:
        return None
    param, own = _own_param_of(prov, u, node)
    return None if param is None else (param, own)


def _own_param_of(prov, u: Tensor, node):
    # (param, its sources) when node (u's grad_fn) reads a parameter that is a source of its
    # own and u carries that source alone; else (None, None).
    param = getattr(node.next_functions[0][0], "variable", None)
    src = prov.look(u)[1]
    own = prov.param_sources.get(id(param)) if param is not None else None
    if own is None or src is None or len(src) != 1 or src[0][0] is not own[0][0]:
        return None, None
    return param, own


def _slice_of(prov, u: Tensor, is_w: bool):
    # (param, e) when u is param[e] (an expert's weight (E, O, I) or bias (E, O): SelectBackward0
    # on dim 0 of a parameter that is a source of its own), else None.
    node = u.grad_fn
    if (type(node).__name__ != "SelectBackward0" or saved(node, "dim") != 0
            or u.dim() != (2 if is_w else 1)):
        return None
    param, _ = _own_param_of(prov, u, node)
    if param is None:
        return None
    index = saved(node, "index")  # (int64 read back unsigned: -1 is 2**64 - 1)
    return param, (index - (1 << 64) if index >= 1 << 63 else index) % param.shape[0]


def meeting_cotangent(grad: Tensor, how: str, shape: tuple, dim: int) -> Tensor:
    """Each sample's cotangent of a source-carrying tensor ``u`` of ``shape`` that met the batch
    on dim ``dim``, from the gradient ``grad`` where it met: ``(B, *shape)``.

    ``"broadcast"``: ``grad`` is ``u_b``'s, ``(..., B, ...)`` with ``B`` on ``dim``, and each
    sample's slice is its own cotangent. ``"rows"`` (and ``"direct"``): ``u``'s ``B`` rows on dim
    ``dim`` lined up with the batch's, so sample ``n``'s cotangent is row ``n`` of ``grad``,
    zero elsewhere; with ``dim == (d, inner)``, ``u``'s ``B * inner`` rows on dim ``d`` lined up
    with a batch merged with the dims after it (``(B * nW, N, C)`` windows), sample ``n``'s
    its ``inner`` rows ``n * inner ...``."""
    if how == "given":  # (F.linear's weight: computed per sample where it met, rows.py)
        return grad
    if how == "broadcast":
        grad = grad.movedim(dim, 0)
        return grad.reshape(grad.shape[0], *shape)
    dim, inner = dim if isinstance(dim, tuple) else (dim, 1)
    size = shape[dim] // inner
    cotangent = grad.new_zeros((size, *shape))
    idx = torch.arange(size, device=grad.device)
    if size:  # (sample, its rows, ...): a view
        rows = cotangent.unflatten(dim + 1, (size, inner)).movedim(dim + 1, 1)
        rows[idx, idx] = grad.reshape(shape).unflatten(dim, (size, inner)).movedim(dim, 0)
    return cotangent
