"""The forms a rule gives its per-sample gradients in, and the math shared by every reader.

Records: :class:`Call` (the inputs of one call of a ``multi_io`` rule). Factored forms:
:class:`Block` (Linear-like row blocks: recurrent layers, attention) and :class:`Rows` (row
scatters: embeddings).

Canonical form (curvlinops' convention, extended by a group axis): every linear-like layer
reshapes what the hooks recorded into

* ``a``: ``(N, G, S, I)`` -- input activations (for a convolution: unfolded patches),
* ``g``: ``(N, G, S, O)`` -- gradient of the loss w.r.t. the layer output (grad_output),

with ``n`` the sample, ``g`` the group (``G = 1`` except for grouped convolutions), ``s`` the
weight-sharing position (``S = 1`` for a Linear on ``(B, in)``), ``i``/``o`` in/out features.
The layer computes ``y[n, g, s] = W[g] a[n, g, s] (+ b[g])``, hence (Goodfellow 2015,
arXiv:1510.01799, sec. 3; Rochette et al. 2019, arXiv:1912.06015, sec. 3 for convolutions)::

    dL_n/dW[g] = sum_s g[n, g, s] a[n, g, s]^T      (einsum 'ngsi,ngso->ngoi')
    dL_n/db[g] = sum_s g[n, g, s]

where ``L_n`` is sample ``n``'s share of the loss as the user reduced it.

The functions here form per-sample gradients and Gram-form norms from the canonical form; the
rules call them, and so do the readers (norms, clipping, KFAC) through
:meth:`~gradhooks.base.registry.LayerRule.linear_form`.
"""
from __future__ import annotations

from typing import Any, Dict, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ._pool import new_empty

__all__ = ["Call", "Block", "Rows", "OneHot", "weight_grad", "bias_grad", "from_blocks", "gram_sq_norms",
           "sq_norms", "NO_GRAD"]


class _NoGrad:
    """The type of :data:`NO_GRAD`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "NO_GRAD"


#: An output leaf no backward pass reached, in the grad_output structure handed to a rule that
#: reads the leaves by their position in the output (:attr:`LayerRule.positional_grads
#: <gradhooks.base.registry.LayerRule.positional_grads>`: the torch.func fallback). A pytree leaf,
#: unlike ``None``, which torch's pytree flattens to nothing and a transformers ``ModelOutput``
#: drops as a field, so that the leaves after it would move up one place (a module returning
#: ``(h1, h2)`` of which only ``h2`` is used had ``h2``'s grad_output paired with ``h1``).
NO_GRAD = _NoGrad()


class Call(NamedTuple):
    """The inputs of one recorded call of a ``multi_io`` rule's module: ``module(*args, **kwargs)``.

    Tensors are detached copies (sharing storage) of what the module received; other values
    (ints, ``None``, ``PackedSequence`` fields ...) are kept as they were. ``internal``: what
    the rule's :meth:`LayerRule.internal` asked to record for this call (``None`` otherwise).
    ``shared``: for a call on inputs that are the same for every sample (a shared call,
    :mod:`gradhooks.core.analysis.provenance`), how its first input was made a batch of ``B`` identical samples:
    ``"expand"`` (its leading dim of size 1 expanded) or ``"prepend"`` (a new leading dim);
    ``"param"``: no call, a raw parameter whose per-sample gradients are its cotangents where it
    meets the batch; ``None`` for an ordinary call. ``dims``: for a call whose tensors carry the
    batch elsewhere than the declared layout says (XLNet's ``(T, B, D)`` inside a batch-first
    model), the batch dim of each tensor leaf of ``(args, kwargs)`` and of the output, as
    provenance followed it (``None``: not batched); ``None``: the declared layout.
    """

    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]
    internal: Optional[Dict[str, Any]] = None
    shared: Optional[str] = None
    dims: Optional[Tuple[Tuple[Optional[int], ...], Tuple[Optional[int], ...]]] = None


class Block(NamedTuple):
    """Part of a parameter's per-sample gradient in factored form (the rows ``rows`` of dim 0,
    or the whole parameter for ``rows=None``)::

        weight-like (a given):  d(param)_n[rows] = sum_s g[n, s] a[n, s]^T   (O, I), reshaped
        bias-like  (a = None):  d(param)_n[rows] = sum_s g[n, s]             (O,), reshaped

    The Linear form of Goodfellow 2015 (arXiv:1510.01799, sec. 3) with ``S`` shared positions
    (time steps, tokens). Rules that can give their gradients this way (recurrent layers,
    attention: :meth:`LayerRule.forms`) let per-sample norms use the Gram form and DP clipping
    form the clipped sum with one matmul, without a per-sample tensor (Li et al. 2022,
    arXiv:2110.05679, sec. 4).

    Attributes:
        rows: a ``slice`` of the parameter's dim 0, or ``None`` for all of it.
        a: ``(N, S, I)`` activations, or ``None`` for a bias-like block.
        g: ``(N, S, O)`` the gradients the block's rows multiply (``O * I`` = number of elements
            of ``param[rows]``, or ``O`` of them for a bias-like block).
    """

    rows: Optional[slice]
    a: Optional[Tensor]
    g: Tensor


class Rows(NamedTuple):
    """A parameter's per-sample gradient as a scatter of row contributions (a lookup table:
    ``nn.Embedding``)::

        d(param)_n[v] = sum_j [sample_j = n] [row_j = v] values_j          (D,)

    for a parameter of shape ``(V, D)``. Per-sample norms then need no ``(B, V, D)`` tensor:
    ``||d(param)_n||^2 = sum_v ||sum_{j: sample_j = n, row_j = v} values_j||^2``, the squared
    norms of the entries summed per ``(sample, row)`` pair (``O(E D)``); and the clipped sum
    ``sum_n c_n d(param)_n`` is one ``index_add`` of ``c[sample_j] values_j`` at ``row_j``.
    (An embedding is a Linear layer on one-hot inputs, whose Gram form ``sum_{s,t} [x_s = x_t]
    (g_s . g_t)`` Li et al. 2022, arXiv:2110.05679, sec. 4, use for ghost clipping; summing
    per row first gives the same value in ``O(E D)`` instead of ``O(S^2 D)`` per sample.)

    Attributes:
        sample: ``(E,)`` int64, the sample of each entry, in ``[0, B)``.
        row: ``(E,)`` int64, the row of the table it adds to, in ``[0, V)``.
        values: ``(E, D)`` what it adds (grad_output rows, at least float32).
    """

    sample: Tensor
    row: Tensor
    values: Tensor


class OneHot(NamedTuple):
    """Canonical activations ``a`` ``(N, G, S, I)`` that are one-hot rows, given by their indices
    (an ``nn.Embedding`` is a Linear layer on one-hot inputs: ``y = weight^T onehot(x)``), so
    that no ``(N, G, S, I)`` tensor of zeros is formed.

    Attributes:
        index: ``(N, G, S)`` int64, the ``1`` of each row, or ``-1`` for a row of zeros (an
            index equal to ``padding_idx``, whose row gets no gradient).
        size: ``I``, the length of the rows (``num_embeddings``).
    """

    index: Tensor
    size: int

    def dense(self, dtype: torch.dtype) -> Tensor:
        """The rows ``(N, G, S, I)`` themselves (for tests and small ``I``)."""
        out = torch.zeros(*self.index.shape, self.size + 1, dtype=dtype, device=self.index.device)
        out.scatter_(-1, self.index.clamp(min=-1).remainder(self.size + 1).unsqueeze(-1), 1)
        return out[..., :self.size]

    def counts(self, dtype: torch.dtype) -> Tensor:
        """``sum_s a[n, g, s]``: ``(N, G, I)`` how often each index occurs per sample."""
        n, groups, _ = self.index.shape
        keep = self.index >= 0
        out = torch.zeros(n, groups, self.size, dtype=dtype, device=self.index.device)
        return out.scatter_add_(2, self.index.clamp(min=0), keep.to(dtype))


def weight_grad(a: Tensor, g: Tensor, out_shape: Optional[Tuple[int, ...]] = None) -> Tensor:
    """Per-sample weight gradient from the canonical form.

    Args:
        a: ``(N, G, S, I)`` input activations.
        g: ``(N, G, S, O)`` grad_output.
        out_shape: the shape to return, e.g. ``(N, *weight.shape)`` (same number of elements,
            contiguous layout of ``(N, G, O, I)``); default ``(N, G, O, I)``.

    Returns:
        ``sum_s g[n,g,s,o] a[n,g,s,i]`` (Goodfellow 2015, arXiv:1510.01799, sec. 3; over shared
        positions: Rochette et al. 2019, sec. 3), in a tensor from :func:`new_empty` (not a
        view, so that the :class:`BufferPool` can reuse it). With ``S = 1`` this is an outer
        product (one broadcast multiply); otherwise a batched matmul over ``(N, G)``
        contracting ``S``.
    """
    n, grp, _, i = a.shape
    shape = (n, grp, g.shape[-1], i)
    out = new_empty(out_shape or shape, a if a.requires_grad else g)
    target = None if out is None else out.view(shape)
    if a.shape[2] == 1:
        got = torch.mul(g[:, :, 0, :, None], a[:, :, 0, None, :], out=target)
    else:
        got = torch.matmul(g.transpose(-1, -2), a, out=target)
    return got.view(out_shape or shape) if out is None else out


def bias_grad(g: Tensor, out_shape: Optional[Tuple[int, ...]] = None) -> Tensor:
    """Per-sample bias gradient from the canonical form.

    Args:
        g: ``(N, G, S, O)`` grad_output.
        out_shape: the shape to return (default ``(N, G, O)``), as for :func:`weight_grad`.

    Returns:
        ``sum_s g[n, g, s, o]`` (the bias sees an input of ones).
    """
    shape = g.shape[:2] + g.shape[3:]
    out = new_empty(out_shape or shape, g)
    if out is None:  # (a differentiable read)
        return g.sum(2).view(out_shape or shape)
    torch.sum(g, dim=2, out=out.view(shape))
    return out


def from_blocks(blocks: Sequence[Block], shape: Tuple[int, ...]) -> Tensor:
    """Materialise a per-sample gradient given in factored form (:class:`Block`).

    Args:
        blocks: disjoint row blocks covering the parameter, in increasing row order.
        shape: ``(N, *param.shape)``.

    Returns:
        ``(N, *param.shape)``: per block :func:`weight_grad` (``a`` given) or :func:`bias_grad`
        (``a = None``) with the block's ``S`` positions as shared positions.
    """
    n = shape[0]
    parts = []
    for b in blocks:
        g = b.g.unsqueeze(1)
        if len(blocks) == 1:
            return bias_grad(g, shape) if b.a is None else weight_grad(b.a.unsqueeze(1), g, shape)
        t = bias_grad(g) if b.a is None else weight_grad(b.a.unsqueeze(1), g)
        parts.append(t.reshape(n, b.g.shape[-1], -1))
    return torch.cat(parts, 1).view(shape)


def gram_sq_norms(a: Optional[Tensor], g: Tensor, aa: Optional[Tensor] = None) -> Tensor:
    """Squared per-sample weight-gradient norms in the Gram form, without forming the gradients.

    Args:
        a: ``(N, G, S, I)`` activations (the canonical form above); ``None`` with ``aa``.
        g: ``(N, G, S, O)`` grad_outputs.
        aa: optional ``(N, G, S, S)``, ``a a^T`` formed by the caller (a convolution's from its
            input's pixels, :meth:`~gradhooks.base.registry.LayerRule.input_gram`); written to.

    Returns:
        ``(N,)``: ``sum_g sum_{s,t} (a[n,g,s] . a[n,g,t]) (g[n,g,s] . g[n,g,t])``, which equals
        ``sum_g ||sum_s g[n,g,s] a[n,g,s]^T||_F^2`` (Li et al. 2022, arXiv:2110.05679, sec. 4;
        for ``S = 1`` the product ``||a_n||^2 ||g_n||^2``, Goodfellow 2015).
    """
    n = g.shape[0]
    if aa is None:
        assert a is not None
        if a.shape[2] == 1:
            return (sq_norms(a, -1) * sq_norms(g, -1)).view(n, -1).sum(1)
        aa = a @ a.transpose(-1, -2)
    return aa.mul_(g @ g.transpose(-1, -2)).view(n, -1).sum(1)



#: Values per chunk of a low-precision sum of squares (:func:`sq_norms`): torch's ``vector_norm``
#: accumulates float32 in float32, 2.7% low over a 124 M-value (GPT-2 embedding) per-sample
#: gradient here; over chunks of ``2**16`` it is within 3e-7, and the chunks add in float64.
SQ_NORM_CHUNK = 1 << 16


def sq_norms(t: Tensor, dim: int) -> Tensor:
    """Sum of squares of ``t`` over ``dim`` (an int), in ``t``'s dtype, without a temporary of
    ``t``'s size. Below float64 and over more than :data:`SQ_NORM_CHUNK` values, summed in
    chunks whose sums add in float64 (float32 accumulation over 10^8 values is off by percents).
    """
    if t.shape[dim] <= SQ_NORM_CHUNK or t.dtype == torch.float64:
        return torch.linalg.vector_norm(t, dim=dim).square_()
    total = None
    for part in t.split(SQ_NORM_CHUNK, dim):
        sq = torch.linalg.vector_norm(part, dim=dim, dtype=torch.float32).double().square_()
        total = sq if total is None else total.add_(sq)
    return total.to(t.dtype)
