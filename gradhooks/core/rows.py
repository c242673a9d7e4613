"""Per-sample gradients of a weight read functionally by a linear map of batched rows:
``y = F.linear(x, W, b)`` inside a module without a rule (a mixture of experts' router on its
``(B * T, D)`` token rows, an expert's ``(E, O, I)`` weight slice on the rows routed to it).

Index conventions: ``n`` the sample, ``r`` a row, ``s`` the positions a row holds, ``i`` in,
``o`` out. With sample ``n``'s rows ``R_n`` (their batch dim from
:mod:`gradhooks.core.provenance`: an int, a merged ``(dim, inner)``, or
:class:`~gradhooks.core.batch_dims.Routed` rows)::

    dL_n/dW = sum_{r in R_n} g[r] x[r]^T        dL_n/db = sum_{r in R_n} g[r]

(Goodfellow 2015, arXiv:1510.01799, sec. 3), at the cost of the op's own rows.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.autograd.graph import get_gradient_edge

from ..rules.fallback import FallbackRule
from .batch_dims import Routed

__all__ = ["by_sample", "linear_cotangents", "own_weights", "linear_meeting"]


def by_sample(t: Tensor, bd, size: int) -> Optional[Tensor]:
    """``t``'s rows grouped by sample, ``(size, S, F)`` (``F`` its last dim), for a batch dim
    ``bd`` that is an int or a merged ``(dim, inner)`` before the last dim; ``None`` otherwise
    (:class:`Routed` rows: :func:`linear_cotangents` scatters them)."""
    d = bd[0] if isinstance(bd, tuple) else bd
    if not isinstance(d, int) or d >= t.dim() - 1:
        return None
    return t.movedim(d, 0).reshape(size, -1, t.shape[-1])


def _padded(t: Tensor, samples: Tensor, size: int) -> Tensor:
    # Routed rows (R, ..., F) laid out per sample, (size, R_max * S, F), zeros after each
    # sample's own rows: the contraction then costs what the rows' own weight gradient does
    # (a one-hot over the samples would cost size times that).
    rows = t.reshape(t.shape[0], -1, t.shape[-1])
    counts = torch.bincount(samples, minlength=size)
    order = torch.argsort(samples, stable=True)
    first = torch.cumsum(counts, 0) - counts
    sorted_samples = samples[order]
    at = torch.arange(len(order), device=t.device) - first[sorted_samples]
    out = rows.new_zeros((size, int(counts.max()) if len(order) else 0, *rows.shape[1:]))
    out[sorted_samples, at] = rows[order]
    return out.flatten(1, 2)


def linear_cotangents(x: Tensor, g: Tensor, bd, size: int, weight: bool, bias: bool):
    """Each sample's gradient of ``F.linear``'s weight ``(size, O, I)`` and bias ``(size, O)``
    (``None`` for those not asked for) from its input ``x (..., I)`` and the gradient ``g
    (..., O)`` of its output, the samples' rows as ``bd`` says."""
    xs, gs = by_sample(x, bd, size), by_sample(g, bd, size)
    if xs is None:  # (Routed: rows on dim 0, row r of sample bd.samples[r], in any order)
        xs, gs = _padded(x, bd.samples, size), _padded(g, bd.samples, size)
    gw = torch.einsum("nso,nsi->noi", gs, xs) if weight else None
    return gw, gs.sum(1) if bias else None


def own_weights(prov, args, kwargs):
    """``(operands, sources)``: ``F.linear``'s weight / bias on a batch merged with other dims
    or routed (a mixture of experts' router and experts), where it is a parameter of a module
    without a rule, or made from one by ops of one input (an expert's ``weight[e]``): the
    parameter is made a source of its own (``prov``: the
    :class:`~gradhooks.core.provenance.Provenance`, its ``param_sources_of``) and the operand
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
    says: merged or :class:`Routed`) and ``W`` / ``b`` carrying sources (``tainted``): returns
    ``hook(out)``, to call on the op's output, which registers the backward hook that forms
    each sample's gradient of ``W`` / ``b`` from its own rows (:func:`linear_cotangents`) and
    hands it to provenance's ``meet`` as ``"given"``; or ``None`` for any other layout (the op
    is then left to provenance's split, which refuses it)."""
    x = args[0] if args else kwargs.get("input")
    w = args[1] if len(args) > 1 else kwargs.get("weight")
    b = args[2] if len(args) > 2 else kwargs.get("bias")
    if x is not ref or x.dim() < 2 or any(u is not w and u is not b for u in tainted):
        return None
    size = prov.batch_size
    if isinstance(bd, tuple) and (bd[0] >= x.dim() - 1 or x.shape[bd[0]] != size * bd[1]):
        return None
    if isinstance(bd, Routed) and (bd.samples.numel() and int(bd.samples.max()) >= size):
        return None
    us = [(u, u is w) for u in (w, b) if u is not None and u.requires_grad
          and any(u is t for t in tainted)]
    xd = x.detach()

    def hook(out):
        if not isinstance(out, Tensor) or not out.requires_grad:
            return
        met = [(get_gradient_edge(u), prov.look(u)[1], tuple(u.shape), is_w, _slice_of(prov, u))
               for u, is_w in us]
        for _, src, _, _, _ in met:
            prov.noted(src, "linear", out, None, None)

        def on_grad(g):
            gw, gb = linear_cotangents(xd, g, bd, size, any(m[3] for m in met),
                                       not all(m[3] for m in met))
            for edge, src, shape, is_w, part in met:
                if part is None or g.requires_grad:
                    prov.meet(edge, src, "given", shape, gw if is_w else gb, None)
                else:
                    _into_slice(prov, src, part, gw if is_w else gb)
        out.register_hook(on_grad)
    return hook


def _slice_of(prov, u: Tensor):
    # (param, e) when u is param[e] (an expert's weight, SelectBackward0 on dim 0 of a parameter
    # that is a source of its own), else None.
    node = u.grad_fn
    if type(node).__name__ != "SelectBackward0" or node._saved_dim != 0:
        return None
    param = getattr(node.next_functions[0][0], "variable", None)
    src = prov.look(u)[1]
    own = prov.param_sources.get(id(param)) if param is not None else None
    if own is None or src is None or len(src) != 1 or src[0][0] is not own[0][0]:
        return None
    return param, node._saved_index


def _into_slice(prov, sources: tuple, part: tuple, cotangent: Tensor) -> None:
    # An expert's slice weight[e] of a 3-D parameter: its per-sample part (B, O, I) is written
    # into one (B, E, O, I) tensor per backward pass, handed to the parameter's record at the
    # first expert (its own edge: no pull-back through the slice, which would build a zero
    # (B, E, O, I) tensor per expert) and filled in place by the others while the record still
    # holds that tensor; any other contribution between them makes each expert hand its own.
    param, index = part
    record = sources[0][0]
    key = (id(param), torch._C._current_graph_task_id())
    held = prov.slice_buffers.get(key)
    grads = getattr(record, "grads", None)
    if (held is not None and grads and isinstance(grads[0], Tensor)
            and grads[0].data_ptr() == held.data_ptr() and grads[0].shape == held.shape):
        held[:, index] += cotangent
        return
    whole = cotangent.new_zeros((cotangent.shape[0], *param.shape))
    whole[:, index] = cotangent
    prov.slice_buffers[key] = whole
    prov.meet(sources[0][1], sources[:1], "given", tuple(param.shape), whole, None)
