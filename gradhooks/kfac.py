"""The KFAC reader: Kronecker factors of every layer linear in its weight (Linear, Conv,
ConvTranspose, Embedding, the projections of MultiheadAttention, the weights of LSTM / GRU / RNN
and their cells), and the exact diagonal block of every other layer (norms, the fallback).

Index conventions: ``n`` sample (``N`` of them, ``B`` for one process's batch), ``g`` group
(``G = 1`` except for grouped convolutions), ``r`` weight-sharing position (the positions ``s``
of every recorded call of the module: tokens of a Linear on ``(B, T, in)``, output pixels of a
convolution), ``i`` input feature (for a convolution: ``(c, k)``, an input channel of the group
and a kernel offset, ordered like ``weight[o].flatten()``), ``o`` output feature, ``p`` backward
pass.

Forward (the canonical form of :mod:`gradhooks.forms`)::

    y[n, g, r] = W[g] a[n, g, r] + b[g]          ã = [a; 1] when the bias is covered

Loss: ``L = w sum_n l_n`` with ``w = 1/N`` for ``loss_reduction="mean"`` and ``w = 1`` for
``"sum"``; ``e[p, n, g, r] = d l_n / d y[n, g, r]`` is the gradient of sample ``n``'s *own* loss
that backward pass ``p`` sent into the layer output (the hooks record ``w e``).

KFAC (Martens & Grosse 2015, arXiv:1503.05671, sec. 3; convolutions: Grosse & Martens 2016,
arXiv:1602.01407, sec. 3 "KFC"; weight sharing: Eschenhagen et al. 2023, arXiv:2311.00636,
sec. 3) approximates the layer's block of the Fisher / GGN of ``L`` by ``A ⊗ G``.

KFAC-expand (the positions are treated like extra samples)::

    A[g] = 1/(N R) sum_{n,r} ã[n,g,r] ã[n,g,r]^T
    G[g] = w sum_p sum_{n,r} e[p,n,g,r] e[p,n,g,r]^T

KFAC-reduce (positions are aggregated first)::

    ā[n,g] = 1/R sum_r ã[n,g,r]         A[g] = 1/N sum_n ā[n,g] ā[n,g]^T
    G[g] = w sum_p sum_n (sum_r e[p,n,g,r]) (sum_r e[p,n,g,r])^T

So ``A`` is a mean over samples (and positions for expand), ``G`` is summed over positions and
carries the reduction's scale ``w``: this is ``curvlinops.KFACLinearOperator``'s placement
(its ``_hook_accumulate_input_covariance`` / ``_accumulate_gradient_covariance``), so results
can be compared with it. With ``backward_passes="mean"`` (Monte-Carlo Fisher) ``G`` is divided
by the number of backward passes. With ``N = 1`` and ``R = 1`` (no weight sharing) ``A ⊗ G`` is
exactly the outer product of the sample's gradient (its empirical Fisher).

Where ``a`` and ``g`` come from: the rule's :meth:`~gradhooks.registry.LayerRule.kfac_form`
(Linear, Conv: their linear form; ``nn.ConvTranspose``: the inputs each *output* position sees,
so the output positions are the shared positions; ``nn.Embedding``: one-hot rows of the
indices, zero at ``padding_idx``, so ``A`` is diagonal for expand, ``A[v, v]`` the share of
index ``v`` among all positions, and stored as that diagonal), or the row blocks of its
:meth:`~gradhooks.registry.LayerRule.forms` (recurrent layers: the layer input, previous state
or cell output at every time step as ``a``, the replayed gate gradients as ``g``, i.e. the time
steps are weight-sharing positions, Martens, Ba & Johnson 2018, ICLR, "Kronecker-factored
curvature approximations for recurrent neural networks", sec. 3, with temporal independence;
attention: the tokens of the query / key / value and the gradients of their projections). A
forms rule's weight is paired with the bias named like it (``weight_ih_l0`` / ``bias_ih_l0``);
each pair is one entry keyed ``"<module>.<weight>"``.

Diagonal blocks (:class:`DiagonalFactors`), for layers with neither: ``w sum_p sum_n
(d l_n / d theta)^2`` from the per-sample gradients of each backward pass (the calls of a
module summed per sample first): the exact diagonal of the same Fisher / GGN block, with the
scale ``w`` placed as in ``G`` (divided by the passes for ``backward_passes="mean"``).

A module called several times in one forward: the positions of all its calls form one set of
weight-sharing positions (``R = sum over calls of S``), i.e. the factors are those of one call on
the concatenation of the calls' inputs (curvlinops instead adds per-call factors, which makes its
``A`` larger by the number of calls).

Grouped convolutions: one factor pair per group, stacked on a leading dim of size ``groups``
(exact block-diagonal structure of the weight; curvlinops instead averages the patches over
groups and keeps one pair).

Vectorisation: ``[W[g] b[g]]`` as a ``(d_out, d_in + 1)`` matrix, flattened row-major (torch's
``.flatten()``), has the block ``torch.kron(G[g], A[g])``; with column stacking (the papers'
``vec``) it is ``A[g] ⊗ G[g]``.
"""
from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .capture import Layer, Recorder
from .errors import GradHooksError
from .forms import Block, Call, OneHot
from .per_sample import call_grads
from .utils import compute_dtype, no_autocast, own_loss_scale

__all__ = ["KFACFactors", "DiagonalFactors", "KFACSums", "kfac_factors", "check_options",
           "KFAC_APPROX", "COVERAGE", "check_choice"]

#: Values of ``kfac_approx``.
KFAC_APPROX = ("expand", "reduce")
_PASSES = ("sum", "mean")


@dataclasses.dataclass(repr=False)
class KFACFactors:
    """The Kronecker factors of one block of parameters ``[W b]`` (conventions: module docstring).

    Attributes:
        A: input-side factor, ``(d_in[+1], d_in[+1])``; ``d_in = in_features`` for a Linear,
            ``C_in/groups * prod(kernel_size)`` for a convolution (ordered like
            ``weight[o].flatten()``) or a transposed convolution (ordered like
            ``weight[i, o].flatten()`` over ``(i, k)``), ``num_embeddings`` for an Embedding,
            the input size / hidden size / projection size for the weights of a recurrent layer;
            the trailing row/column (``+1``) belongs to the bias (an input of ones) when
            :attr:`bias` is set. ``(groups, ., .)`` when ``groups > 1``. When
            :attr:`diagonal_A` is set, only the diagonal: ``(d_in[+1],)`` or
            ``(groups, d_in[+1])`` (an Embedding's ``A`` with ``kfac_approx="expand"`` is
            diagonal, and always stored so: the share of each index among the positions).
        G: output-side factor, ``(d_out, d_out)`` with ``d_out = out_features``,
            ``C_out/groups``, ``embedding_dim``, or the rows of the block (``4 * hidden_size``
            for an LSTM's ``weight_ih_l0``, ``3 * embed_dim`` for a self-attention's packed
            ``in_proj_weight``); ``(groups, ., .)`` when ``groups > 1``; the diagonal only
            (``(d_out,)`` / ``(groups, d_out)``) when :attr:`diagonal_G` is set.
        module: the module's name in ``model.named_modules()`` (``""`` for the model itself).
        weight: the weight's name in ``model.named_parameters()``, or ``None`` if it is not
            covered (frozen, or a bias-like parameter alone).
        bias: the bias's name, or ``None`` (no bias, or frozen): then ``A`` has no ones row.
        weight_shape: ``weight.shape`` (``None`` when :attr:`weight` is ``None``).
        groups: number of groups: convolution groups, or equal row blocks of a parameter whose
            rows see different inputs (a cross-attention's packed ``in_proj_weight``: 3, the
            query's and the key's and value's rows); 1 otherwise.
        kfac_approx: ``"expand"`` or ``"reduce"``.
        diagonal_A / diagonal_G: the factor is stored as its diagonal (``max_dense``).
        weight_transposed: the weight stores its input dim first, ``(groups * d_in', d_out,
            *kernel)`` (transformers' ``Conv1D`` ``(d_in, d_out)``, ``nn.Embedding``
            ``(V, D)``, ``nn.ConvTranspose`` ``(C_in, C_out/groups, *kernel)``):
            :meth:`grad_matrix` swaps the two leading dims of each group into the
            ``(d_out, d_in)`` block of ``[W b]`` and :meth:`split` back, so the factors act on
            ``[W b]`` as for an ``nn.Linear``.
        part: ``""`` for a module's only entry; else the local name of the block's first
            parameter (``"weight_ih_l0"``, ``"in_proj_weight"``, ``"out_proj.weight"``); the
            entry's key in :func:`kfac_factors` is ``module + "." + part``.
        bias_shape: ``bias.shape`` (``None`` when :attr:`bias` is ``None``).

    The block of the Fisher / GGN for ``[W[g] b[g]]`` flattened row-major is
    ``torch.kron(G[g], A[g])`` (:meth:`dense` gives it in the parameters' own order);
    :meth:`grad_matrix` / :meth:`split` convert gradients to / from that matrix form, e.g. for
    the KFAC step ``G^-1 [dW db] A^-1`` (Martens & Grosse 2015, sec. 4).
    """

    A: Tensor
    G: Tensor
    module: str
    weight: Optional[str]
    bias: Optional[str]
    weight_shape: Optional[Tuple[int, ...]]
    groups: int = 1
    kfac_approx: str = "expand"
    diagonal_A: bool = False
    diagonal_G: bool = False
    weight_transposed: bool = False
    part: str = ""
    bias_shape: Optional[Tuple[int, ...]] = None

    @property
    def params(self) -> Tuple[str, ...]:
        """Names of the parameters covered, weight first."""
        return tuple(n for n in (self.weight, self.bias) if n is not None)

    def __repr__(self) -> str:
        diag_a, diag_g = (" diag" if d else "" for d in (self.diagonal_A, self.diagonal_G))
        part = f", part={self.part!r}" if self.part else ""
        return (f"KFACFactors(module={self.module!r}{part}, params={self.params}, "
                f"A={tuple(self.A.shape)}{diag_a}, G={tuple(self.G.shape)}{diag_g}, "
                f"groups={self.groups}, kfac_approx={self.kfac_approx!r}, dtype={self.A.dtype})")

    def grad_matrix(self, grads: Mapping[str, Tensor]) -> Tensor:
        """Gradients of the covered parameters as the matrix ``[W b]`` the factors act on.

        Args:
            grads: ``{name: tensor of the parameter's shape}`` holding at least :attr:`params`
                (e.g. ``{n: p.grad for n, p in model.named_parameters()}``).

        Returns:
            ``(d_out, d_in[+1])``, or ``(groups, d_out, d_in[+1])`` when ``groups > 1``; the
            bias is the last column.

        Raises:
            KeyError: if a covered parameter is missing from ``grads``.
        """
        parts = []
        d_out = self.G.shape[-1]
        if self.weight is not None:
            w = grads[self.weight]
            if self.weight_transposed:  # (G * I', O, *K) -> (G, O, I' * K)
                w = w.reshape(self.groups, w.shape[0] // self.groups, d_out, -1).transpose(1, 2)
            parts.append(w.reshape(self.groups, d_out, -1))
        if self.bias is not None:
            parts.append(grads[self.bias].reshape(self.groups, -1, 1))
        mat = torch.cat(parts, -1) if len(parts) > 1 else parts[0]
        return mat if self.groups > 1 else mat[0]

    def split(self, mat: Tensor) -> Dict[str, Tensor]:
        """Inverse of :meth:`grad_matrix`: ``{name: tensor of the parameter's shape}``."""
        mat = mat.reshape(self.groups, -1, mat.shape[-1])
        out = {}
        if self.weight is not None:
            cols = mat.shape[-1] - (self.bias is not None)
            w = mat[..., :cols]
            if self.weight_transposed:
                per = self.weight_shape[0] // self.groups
                w = w.reshape(self.groups, w.shape[1], per, -1).transpose(1, 2)
            out[self.weight] = w.reshape(self.weight_shape)
        if self.bias is not None:
            out[self.bias] = mat[..., -1].reshape(self.bias_shape or (-1,))
        return out

    def dense(self) -> Tensor:
        """The KFAC block as a dense ``(P, P)`` matrix, ``P`` the number of covered entries,
        in the order of ``torch.cat([weight.flatten(), bias.flatten()])`` (block-diagonal over
        groups)."""
        a = torch.diag_embed(self.A) if self.diagonal_A else self.A
        g = torch.diag_embed(self.G) if self.diagonal_G else self.G
        if self.groups == 1:
            a, g = a[None], g[None]
        blocks = torch.block_diag(*[torch.kron(gg, aa) for gg, aa in zip(g, a)])
        sizes = {}
        if self.weight is not None:
            sizes[self.weight] = self.weight_shape
        if self.bias is not None:
            sizes[self.bias] = self.bias_shape or (g.shape[0] * g.shape[-1],)
        index, start = {}, 0
        for name, shape in sizes.items():
            count = math.prod(shape)
            index[name] = torch.arange(start, start + count, device=a.device).reshape(shape)
            start += count
        perm = self.grad_matrix(index).reshape(-1)  # position in the matrix form -> param order
        out = blocks.new_zeros(start, start)
        out[perm[:, None], perm[None, :]] = blocks
        return out


@dataclasses.dataclass(repr=False)
class DiagonalFactors:
    """The diagonal block of a layer whose curvature has no Kronecker factorisation here (norm
    layers, ``nn.EmbeddingBag``, parametrized layers, the ``torch.func`` fallback).

    ``diagonal[name] = w sum_p sum_n (d l_n / d param)^2`` (per-sample gradients of each
    sample's own loss in backward pass ``p``; ``w`` the loss reduction's scale, ``1/N`` for
    ``"mean"``; divided by the number of passes for ``backward_passes="mean"``): the exact
    diagonal of the empirical Fisher / GGN block whose Kronecker approximation
    :class:`KFACFactors` gives for linear layers, with the same placement of the scales as
    ``G`` (one sample and ``"sum"``: the squared gradient). BackPACK's ``DiagGGNExact`` /
    ``SumGradSquared`` up to that scale.

    Attributes:
        diagonal: ``{name in model.named_parameters(): tensor of the parameter's shape}``.
        module: the module's name.
        kfac_approx: as asked (the diagonal does not depend on it).
    """

    diagonal: Dict[str, Tensor]
    module: str
    kfac_approx: str = "expand"

    @property
    def params(self) -> Tuple[str, ...]:
        """Names of the parameters covered, in ``named_parameters()`` order."""
        return tuple(self.diagonal)

    def __repr__(self) -> str:
        shapes = {n: tuple(t.shape) for n, t in self.diagonal.items()}
        return f"DiagonalFactors(module={self.module!r}, diagonal={shapes})"

    def dense(self) -> Tensor:
        """The block as a dense ``(P, P)`` diagonal matrix, in the order of
        ``torch.cat([p.flatten() for p in params])``."""
        return torch.diag_embed(torch.cat([t.reshape(-1) for t in self.diagonal.values()]))

    def precondition(self, grads: Mapping[str, Tensor], damping: float) -> Dict[str, Tensor]:
        """``grads / (diagonal + damping)`` for the covered parameters (the diagonal's
        analogue of the KFAC step ``(G + λ)^-1 [dW db] (A + λ)^-1``).

        Raises:
            KeyError: if a covered parameter is missing from ``grads``.
        """
        return {n: grads[n] / (d + damping) for n, d in self.diagonal.items()}


def check_choice(name: str, value, choices: Sequence[str]) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def _ones_border(xx: Tensor, s: Tensor, m) -> Tensor:
    # [[xx, s], [s^T, m]] for x~ = [x, 1]: (G, I+1, I+1) from xx (G, I, I), s (G, I).
    groups, i = s.shape
    out = xx.new_empty(groups, i + 1, i + 1)
    out[:, :i, :i] = xx
    out[:, :i, i] = s
    out[:, i, :i] = s
    out[:, i, i] = m
    return out


def _moment(x, ones: bool, diagonal: bool, dtype: torch.dtype) -> Tensor:
    # x: (G, M, I) rows (or a OneHot (G, M) of indices) -> sum over the M rows of x~ x~^T,
    # x~ = [x, 1] if ones: (G, I', I'), or its diagonal (G, I'). The ones row/column are filled
    # from sums instead of concatenating.
    if isinstance(x, OneHot):  # x^T x of one-hot rows is diagonal: the counts of each index
        groups, m = x.index.shape
        counts = OneHot(x.index[None], x.size).counts(dtype)[0]  # (G, I)
        if diagonal:
            return torch.cat([counts, counts.new_full((groups, 1), m)], 1) if ones else counts
        return _ones_border(torch.diag_embed(counts), counts, m) if ones else torch.diag_embed(counts)
    groups, m, _ = x.shape
    if diagonal:
        d = (x * x).sum(1)
        return torch.cat([d, d.new_full((groups, 1), m)], 1) if ones else d
    xx = x.transpose(1, 2) @ x
    return _ones_border(xx, x.sum(1), m) if ones else xx


class _Part(NamedTuple):
    # One Kronecker block of one call in one backward pass: the parameters [W b] it covers
    # (local names; None if not covered), its number of groups and its pieces
    # (first group, a (N, G_j, S_j, I) / OneHot (N, G_j, S_j) / None, g (N, G_j, S_j, O)).
    name: str
    weight: Optional[str]
    bias: Optional[str]
    groups: int
    pieces: List[Tuple[int, object, Tensor]]
    transposed: bool


def _chunked(name: str, weight: Optional[str], bias: Optional[str], blocks: List[Block]) -> _Part:
    # Row blocks of a forms rule as groups of equal height (the gcd of the blocks' heights): a
    # packed in_proj_weight of a cross-attention (q from the query, k and v from the key) gives
    # three groups of E rows; a self-attention's one block of 3E rows stays one group.
    height = 0
    for b in blocks:
        height = math.gcd(height, b.g.shape[-1])
    pieces, lo = [], 0
    for b in blocks:
        k = b.g.shape[-1] // height
        n, s = b.g.shape[:2]
        g = b.g.reshape(n, s, k, height).transpose(1, 2)  # (N, k, S, height)
        a = None if weight is None else b.a.unsqueeze(1).expand(n, k, *b.a.shape[1:])
        pieces.append((lo, a, g))
        lo += k
    return _Part(name, weight, bias, lo, pieces, False)


def _block_parts(forms: Dict[str, List[Block]]) -> List[_Part]:
    # A forms rule's blocks as Kronecker parts: each weight-like parameter with the bias-like one
    # named like it (``weight`` -> ``bias``, the LayerRule.forms contract), the other bias-like
    # parameters alone (MultiheadAttention's in_proj_bias beside separate q/k/v weights, bias_k).
    biases = {n: b for n, b in forms.items() if b[0].a is None}
    parts = []
    for name, blocks in forms.items():
        if blocks[0].a is None:
            continue
        bias = name.replace("weight", "bias")
        if bias in biases and [b.rows for b in biases[bias]] == [b.rows for b in blocks]:
            del biases[bias]
        else:
            bias = None
        parts.append(_chunked(name, name, bias, blocks))
    parts.extend(_chunked(name, None, name, blocks) for name, blocks in biases.items())
    return parts


#: How :func:`kfac_factors` covers a hooked layer: Kronecker factors from the rule's
#: :meth:`~gradhooks.registry.LayerRule.kfac_form`, Kronecker factors per row block of its
#: :meth:`~gradhooks.registry.LayerRule.forms`, or a diagonal block.
_KRON, _BLOCKS, _DIAG = "kron", "blocks", "diag"


def _kind(layer: Layer) -> str:
    rule = layer.rule
    if rule.has_kfac_form and set(layer.params) <= {"weight", "bias"}:
        return _KRON
    if rule.has_forms:
        return _BLOCKS
    return _DIAG


def _linear_layer(layer: Layer) -> bool:
    return layer.rule.has_linear_form and not layer.rule.multi_io and "weight" in layer.params


#: Values of ``coverage``.
COVERAGE = ("all", "linear")


def _parts(layer: Layer, a, grads, names: Tuple[str, ...], batch_first: bool,
           with_a: bool) -> List[_Part]:
    # The Kronecker parts of one call in one backward pass (grads: [g] for single-output rules,
    # the output's structure for multi_io ones).
    rule, module = layer.rule, layer.module
    if _kind(layer) == _BLOCKS:
        return _block_parts(rule.forms(module, a, grads, batch_first, names))
    if rule.multi_io:
        g = grads
        if not isinstance(g, Tensor):
            return []
    else:
        g = grads[0]
        dt = compute_dtype(g) if a is None else compute_dtype(a, g)
        g = g.to(dt)
        a = None if a is None else a.to(dt)
    a_c, g_c = rule.kfac_form(module, a if with_a and "weight" in names else None, g, batch_first)
    weight = "weight" if "weight" in names else None
    bias = "bias" if "bias" in names else None
    return [_Part("", weight, bias, g_c.shape[1], [(0, a_c, g_c)], rule.kfac_transposed)]


class _Sums:
    """Unnormalised factor sums of one Kronecker block over its calls and backward passes:
    ``A[g] = a_sum[g] / count[g]``, ``G = g_sum`` times the loss scales (:meth:`KFACSums.result`),
    ``g_sum`` built from the recorded gradients."""

    def __init__(self, key: str, layer: Layer, part: _Part, approx: str, max_dense: Optional[int]):
        self.key, self.layer, self.approx, self.max_dense = key, layer, approx, max_dense
        self.part, self.weight, self.bias = part.name, part.weight, part.bias
        self.groups, self.transposed = part.groups, part.transposed
        self.a_sum: Optional[Tensor] = None
        self.g_sum: Optional[Tensor] = None
        self.counts = [0] * part.groups
        self.diag_a = self.diag_g = False
        # reduce: per-sample sums over positions of every call, positions per group, and per
        # backward pass the per-sample sums of g over the positions of every call
        self.a_pos: Optional[Tensor] = None
        self.g_pos: Dict[int, Tensor] = {}
        self.seen: set = set()

    def _check(self, part: _Part) -> None:
        if part.groups != self.groups:
            raise GradHooksError(
                f"module {self.layer.describe()}: its calls give the parameters of "
                f"{self.key!r} in {self.groups} and in {part.groups} row blocks (e.g. a "
                f"MultiheadAttention called as self- and as cross-attention); KFAC needs one "
                f"layout per parameter")

    def add_a(self, part: _Part) -> None:
        self._check(part)
        for lo, a, g in part.pieces:
            n, gj, s = g.shape[:3]
            hi = lo + gj
            if a is None:  # bias only: the moment of the ones
                a = g.new_zeros(n, gj, s, 0)
            dim = a.size if isinstance(a, OneHot) else a.shape[-1]
            if self.a_sum is None and self.a_pos is None:
                d_in = dim + (self.bias is not None)
                # one-hot rows: A is diagonal for expand, kept as its diagonal (exact)
                self.diag_a = ((isinstance(a, OneHot) and self.approx == "expand")
                               or _too_big(d_in, self.max_dense))
                self.diag_g = _too_big(g.shape[-1], self.max_dense)
            if self.approx == "expand":
                rows = (OneHot(a.index.transpose(0, 1).reshape(gj, n * s), a.size)
                        if isinstance(a, OneHot) else a.transpose(0, 1).reshape(gj, n * s, dim))
                m = _moment(rows, self.bias is not None, self.diag_a, g.dtype)
                if self.a_sum is None:
                    self.a_sum = m.new_zeros(self.groups, *m.shape[1:])
                self.a_sum[lo:hi] += m
                for j in range(lo, hi):
                    self.counts[j] += n * s
            else:
                sums = a.counts(g.dtype) if isinstance(a, OneHot) else a.sum(2)  # (N, G_j, I)
                if self.a_pos is None:
                    self.a_pos = sums.new_zeros(n, self.groups, dim)
                    self.positions = [0] * self.groups
                self.a_pos[:, lo:hi] += sums
                for j in range(lo, hi):
                    self.positions[j] += s

    def add_g(self, p: int, part: _Part) -> None:
        self._check(part)
        for lo, _, g in part.pieces:
            n, gj, s, o = g.shape
            if self.approx == "expand":
                m = _moment(g.transpose(0, 1).reshape(gj, n * s, o), False, self.diag_g, g.dtype)
                if self.g_sum is None:
                    self.g_sum = m.new_zeros(self.groups, *m.shape[1:])
                self.g_sum[lo:lo + gj] += m
            else:
                if p not in self.g_pos:
                    self.g_pos[p] = g.new_zeros(n, self.groups, o)
                self.g_pos[p][:, lo:lo + gj] += g.sum(2)

    def finish(self) -> None:
        if self.approx == "reduce":
            n = self.a_pos.shape[0]
            positions = self.a_pos.new_tensor(self.positions).clamp(min=1)
            mean = (self.a_pos / positions[:, None]).transpose(0, 1)  # (G, N, I)
            self.a_sum = _moment(mean, self.bias is not None, self.diag_a, mean.dtype)
            self.counts = [n] * self.groups
            for g in self.g_pos.values():
                m = _moment(g.transpose(0, 1), False, self.diag_g, g.dtype)
                self.g_sum = m if self.g_sum is None else self.g_sum.add_(m)
            self.a_pos, self.g_pos = None, {}

    def tensors(self) -> List[Tensor]:
        return [self.a_sum, self.g_sum]

    def layout(self) -> tuple:
        return (self.key, tuple(self.a_sum.shape), tuple(self.g_sum.shape))

    def result(self, counts: List[int], g_scale: float, kfac_approx: str, names) -> "KFACFactors":
        count = self.a_sum.new_tensor(counts).clamp(min=1)  # no samples: A = 0, not 0/0
        a_fac = self.a_sum / count.view(-1, *[1] * (self.a_sum.dim() - 1))
        g_fac = self.g_sum * g_scale
        if self.groups == 1:
            a_fac, g_fac = a_fac[0], g_fac[0]
        params = self.layer.params
        weight = params[self.weight] if self.weight is not None else None
        bias = params[self.bias] if self.bias is not None else None
        return KFACFactors(
            A=a_fac, G=g_fac, module=self.layer.path,
            weight=names[id(weight)] if weight is not None else None,
            bias=names[id(bias)] if bias is not None else None,
            weight_shape=tuple(weight.shape) if weight is not None else None,
            groups=self.groups, kfac_approx=kfac_approx, diagonal_A=self.diag_a,
            diagonal_G=self.diag_g, weight_transposed=self.transposed, part=self.part,
            bias_shape=tuple(bias.shape) if bias is not None else None)


class _DiagSums:
    """``sum_p sum_n (d l_n / d theta)^2`` of one layer's parameters, from the per-sample
    gradients of each backward pass (own-loss gradients: the records' scale applied)."""

    def __init__(self, key: str, layer: Layer):
        self.key, self.layer = key, layer
        self.sq: Dict[str, Tensor] = {}

    def add_pass(self, grads: Dict[str, Tensor]) -> None:
        for name, t in grads.items():
            sq = t.square().sum(0)
            self.sq[name] = sq if name not in self.sq else self.sq[name].add_(sq)

    def finish(self) -> None:
        pass

    def tensors(self) -> List[Tensor]:
        return [self.sq[n] for n in sorted(self.sq)]

    def layout(self) -> tuple:
        return (self.key, tuple((n, tuple(self.sq[n].shape)) for n in sorted(self.sq)))

    def result(self, counts, g_scale: float, kfac_approx: str, names) -> "DiagonalFactors":
        params = self.layer.params
        order = [n for n in params if n in self.sq]  # the layer's (named_parameters) order
        return DiagonalFactors(
            diagonal={names[id(params[n])]: self.sq[n] * g_scale for n in order},
            module=self.layer.path, kfac_approx=kfac_approx)


def _too_big(dim: int, max_dense: Optional[int]) -> bool:
    return max_dense is not None and dim > max_dense


def _call_key(a) -> int:
    # The same call in every backward pass: its recorded input (a multi_io call's Call is
    # rebuilt per pass with that pass's internal gradients; its args tuple is not).
    return id(a.args) if isinstance(a, Call) else id(a)


class KFACSums:
    """The KFAC reader's accumulator: factor sums of every covered layer, fed one backward pass
    at a time (:func:`kfac_factors` from the records; :func:`gradhooks.kfac` from
    :func:`gradhooks.passes.run_passes`, so that ``multi_io`` layers, whose records sum the
    passes, get each pass's gradients on their own).

    Args:
        size: ``B``.
        loss_reduction, batch_first: as given to :func:`gradhooks.attach`.
        scale: the records' scale to own-loss gradients (:attr:`~gradhooks.records.Batch.scale`).
        names: ``{id(param): name}``.
        kfac_approx, max_dense: as for :func:`kfac_factors`.
    """

    def __init__(self, size: int, loss_reduction: str, batch_first: bool, scale: Optional[float],
                 names: Mapping[int, str], kfac_approx: str, max_dense: Optional[int]):
        self.size, self.loss_reduction, self.batch_first = size, loss_reduction, batch_first
        self.scale, self.names = scale, names
        self.factor = 1.0 if scale is None else float(scale)
        self.approx, self.max_dense = kfac_approx, max_dense
        self.entries: Dict[Tuple[int, str], object] = {}

    def _entry(self, layer: Layer, part: Optional[_Part]):
        name = "" if part is None else part.name
        key = (id(layer), name)
        entry = self.entries.get(key)
        if entry is None:
            path = layer.path if not name else (f"{layer.path}.{name}" if layer.path else name)
            entry = self.entries[key] = (_DiagSums(path, layer) if part is None
                                         else _Sums(path, layer, part, self.approx, self.max_dense))
        return entry

    def add_pass(self, p: int, calls: Iterable) -> None:
        """Add backward pass ``p``: ``calls`` are ``(layer, a, grads, names)`` (e.g.
        :class:`~gradhooks.passes.PassCall`) with this pass's grad_output (``[g]`` for
        single-output rules, the output's structure for ``multi_io`` rules)."""
        diag: Dict[int, Tuple[Layer, Dict[str, Tensor]]] = {}
        for layer, a, grads, names in calls:
            try:
                if _kind(layer) == _DIAG:
                    got = call_grads(layer.rule, layer.module, a, grads, self.batch_first, names,
                                     self.scale)
                    total = diag.setdefault(id(layer), (layer, {}))[1]
                    for name, t in got.items():  # a module called twice: sum, then square
                        total[name] = t if name not in total else total[name].add_(t)
                    continue
                key = _call_key(a)
                parts = _parts(layer, a, grads, tuple(names), self.batch_first, with_a=True)
                for part in parts:
                    entry = self._entry(layer, part)
                    if key not in entry.seen:
                        entry.seen.add(key)
                        entry.add_a(part)
                    entry.add_g(p, part)
            except GradHooksError as e:
                if layer.describe() in str(e):
                    raise
                raise type(e)(f"module {layer.describe()}: {e}") from None
        for layer, grads in diag.values():
            self._entry(layer, None).add_pass(grads)

    def result(self, order: Mapping[int, int], passes: int, backward_passes: str,
               all_reduce: bool = False, group=None) -> Dict[str, "KFACFactors | DiagonalFactors"]:
        """The factors, keyed and ordered as :func:`kfac_factors` documents (``order``:
        ``{id(param): position}`` in ``named_parameters()`` order; ``passes``: the number of
        backward passes, for ``backward_passes="mean"``)."""
        def first(item):
            (_, name), entry = item
            params = entry.layer.params
            covered = [params[n] for n in ((entry.weight, entry.bias) if isinstance(entry, _Sums)
                                           else entry.sq) if n is not None]
            return min(order.get(id(p), 0) for p in covered), name

        entries = [e for _, e in sorted(self.entries.items(), key=first)]
        for e in entries:
            e.finish()
        # own-loss gradients: the records times N (mean); MC passes averaged
        per_pass = 1.0 / (passes if backward_passes == "mean" else 1)
        for e in entries:
            if isinstance(e, _Sums):
                e.g_sum.mul_(self.factor * self.factor * per_pass)
            else:
                for t in e.sq.values():
                    t.mul_(per_pass)
        n_total = self.size
        counts = [e.counts if isinstance(e, _Sums) else [] for e in entries]
        if all_reduce:
            n_total, counts = _all_reduce(entries, n_total, counts, group)
        w = 1.0 / (own_loss_scale(self.loss_reduction, n_total) or 1.0)
        return {e.key: e.result(c, w, self.approx, self.names) for e, c in zip(entries, counts)}


def kfac_factors(
    recorder: Recorder,
    kfac_approx: str = "expand",
    *,
    backward_passes: str = "sum",
    modules: Optional[Iterable[str]] = None,
    max_dense: Optional[int] = None,
    all_reduce: bool = False,
    group=None,
    coverage: str = "all",
) -> Dict[str, "KFACFactors | DiagonalFactors"]:
    """KFAC factors of every hooked layer the backward reached, and a diagonal block for the
    parameters no Kronecker factorisation fits.

    Which layers get what (formulas and conventions: the module docstring):

    * Kronecker factors ``A ⊗ G`` (:class:`KFACFactors`) for the layers linear in their
      weight: ``nn.Linear`` (and transformers' ``Conv1D``), ``nn.Conv1d/2d/3d`` (Martens &
      Grosse 2015, sec. 3; Grosse & Martens 2016, sec. 3), ``nn.ConvTranspose1d/2d/3d`` (the
      output positions as shared positions), ``nn.Embedding`` (one-hot inputs: ``A`` diagonal,
      the counts of each index), the projections of ``nn.MultiheadAttention`` (tokens as shared
      positions) and the input, hidden and projection weights of ``nn.LSTM`` / ``nn.GRU`` /
      ``nn.RNN`` and their cells (time steps as shared positions, the gate gradients the
      recurrent rule replays as ``g``: Martens, Ba & Johnson 2018, "Kronecker-factored
      curvature approximations for recurrent neural networks", ICLR, sec. 3, with the
      independence-across-time approximation of their option "V1"; Eschenhagen et al. 2023,
      sec. 3, for expand / reduce);
    * a diagonal block (:class:`DiagonalFactors`) ``w sum_p sum_n (d l_n / d theta)^2`` (the
      exact diagonal of the block, with ``G``'s scale ``w``) for every other layer: norms,
      ``nn.EmbeddingBag``, parametrized layers, the ``torch.func`` fallback.

    Computed in the recorded dtype, at least float32 (autocast captures are promoted).

    Args:
        recorder: the :class:`~gradhooks.capture.Recorder` of a :class:`~gradhooks.GradHooks`,
            after one or more backward passes of the current batch.
        kfac_approx: ``"expand"`` or ``"reduce"`` (Eschenhagen et al. 2023); identical for
            layers without weight sharing. (Diagonal blocks do not depend on it.)
        backward_passes: ``"sum"``: ``G`` sums ``e e^T`` over the backward passes (one pass
            with the loss: empirical Fisher; one pass per column of a square root of the loss
            Hessian: type-2 / GGN); ``"mean"``: divided by the number of backward passes
            (Monte-Carlo Fisher, one pass per sampled target). The same for diagonal blocks.
        modules: names of the modules wanted (default: all); e.g. to skip a huge layer.
        max_dense: factors of a larger dimension are computed and returned as their diagonal
            only (:attr:`KFACFactors.diagonal_A` / ``diagonal_G``), e.g. the
            ``(9217, 9217)`` input factor of a ``Linear(9216, 128)``. Default: all dense.
        all_reduce: sum the factors' numerators and counts over the processes of ``group``
            (``torch.distributed``), so that every rank holds the factors of the union of the
            ranks' batches: ``N`` is the total number of samples, and for ``"mean"`` the loss
            of the union is the mean over all of them. Every rank must call this.
        group: the ``torch.distributed`` process group (default: the world).
        coverage: ``"all"`` (default) or ``"linear"``: only the layers with a linear form
            (Linear, Conv, ``Conv1D``; the coverage before Embedding, ConvTranspose, attention,
            recurrent layers and diagonal blocks were added; EKFAC's).

    Returns:
        ``{key: KFACFactors or DiagonalFactors}``, ordered by the first covered parameter in
        ``model.named_parameters()``. The key is the module's name when the module has one
        entry (Linear, Conv, ConvTranspose, Embedding, diagonal blocks); a module with several
        Kronecker blocks (attention, recurrent layers) has one entry per block, keyed
        ``"<module>.<first parameter>"``: ``"lstm.weight_ih_l0"`` (with ``bias_ih_l0``),
        ``"attn.in_proj_weight"`` (with ``in_proj_bias``), ``"attn.out_proj.weight"``,
        ``"attn.bias_k"``. A parameter tied between two modules appears in both entries.

    Raises:
        NoBackwardError: before any backward pass of the current batch.
        HigherOrderGradError: after a ``create_graph=True`` backward through a hooked layer.
        GradientMismatchError: if a recorded input was modified in place after its forward.
        GradHooksError: with ``all_reduce``, if no process group is initialised or the ranks
            hold different layers; if several backward passes reached a ``multi_io`` layer
            (embedding, attention, recurrent, fallback) whose records sum the passes (use
            :func:`gradhooks.kfac`, which reads each pass on its own); if calls of one
            attention module split its projections into different row blocks.
        ValueError: for an unknown ``kfac_approx`` / ``backward_passes`` / ``coverage`` value or
            module name.
    """
    check_choice("coverage", coverage, COVERAGE)
    wanted = check_options(recorder, kfac_approx, backward_passes, modules, max_dense,
                           coverage)
    batch = recorder.snapshot("kfac_factors()", sum_check=False, records=[
        cap for cap in recorder.records if wanted(cap.layer)])
    # backward passes: one grad_output per pass in single-output captures (multi_io captures
    # hold one summed grad_output per output tensor instead)
    passes = max((len(cap.grads) for cap in recorder.records if cap.spec is None), default=1)
    summed = [cap for cap in batch.records if cap.spec is not None]
    if passes > 1 and summed:
        raise GradHooksError(
            f"kfac_factors(): {passes} backward passes reached the model, but module "
            f"{summed[0].layer.describe()} records their grad_outputs summed, and G needs each "
            f"pass's on its own. Use gradhooks.kfac(model, inputs, targets, loss_fn, fisher=...) "
            f"(it reads pass by pass), or read after each backward pass")
    sums = KFACSums(batch.size, batch.loss_reduction, batch.batch_first, batch.scale,
                    batch.names, kfac_approx, max_dense)
    with no_autocast():
        for p in range(passes):
            sums.add_pass(p, [
                (cap.layer, cap.a, cap.grad_struct() if cap.spec is not None else [cap.grads[p]],
                 cap.names)
                for cap in batch.records if cap.spec is not None or p < len(cap.grads)])
        return sums.result(batch.order, passes, backward_passes, all_reduce, group)


def check_options(recorder: Recorder, kfac_approx: str, backward_passes: str,
                  modules: Optional[Iterable[str]], max_dense: Optional[int],
                  coverage: str = "all"):
    """Validate :func:`kfac_factors`' options; returns ``wanted(layer) -> bool``.

    Raises:
        ValueError: for an unknown value or module name (the message lists the known ones).
    """
    check_choice("kfac_approx", kfac_approx, KFAC_APPROX)
    check_choice("backward_passes", backward_passes, _PASSES)
    if max_dense is not None and max_dense < 1:
        raise ValueError(f"max_dense must be a positive int or None, got {max_dense!r}")
    covered = (lambda layer: True) if coverage == "all" else _linear_layer
    if modules is None:
        return covered
    wanted = set(modules)
    known = {layer.path for layer in recorder.layers if covered(layer)}
    unknown = sorted(wanted - known)
    if unknown:
        raise ValueError(f"modules {unknown} are not hooked layers of the model"
                         f"{'' if coverage == 'all' else ' with a linear form'}; these are: "
                         f"{sorted(known)}")
    return lambda layer: layer.path in wanted and covered(layer)


def _all_reduce(entries: list, n_local: int, counts: List[List[int]], group
                ) -> Tuple[int, List[List[int]]]:
    # One collective for the float sums, one for the integer counts, one (MAX) for the layout.
    if not (dist.is_available() and dist.is_initialized()):
        raise GradHooksError(
            "all_reduce=True needs an initialised torch.distributed process group "
            "(torch.distributed.init_process_group) on every rank"
        )
    tensors = [t for e in entries for t in e.tensors()]
    device = tensors[0].device if tensors else torch.device("cpu")
    layout = repr([e.layout() for e in entries])
    sig = zlib.crc32(layout.encode())
    check = torch.tensor([len(entries), -len(entries), sig, -sig], dtype=torch.int64, device=device)
    dist.all_reduce(check, op=dist.ReduceOp.MAX, group=group)
    if check[0] != -check[1] or check[2] != -check[3]:
        raise GradHooksError(
            "kfac_factors(all_reduce=True): the ranks hold factors of different layers or shapes "
            f"(this rank: {layout}); every rank must run the same model and backward passes"
        )
    if tensors:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat, group=group)
        start = 0
        for t in tensors:
            t.copy_(flat[start:start + t.numel()].view_as(t))
            start += t.numel()
    ints = torch.tensor([n_local, *[c for cs in counts for c in cs]], dtype=torch.int64,
                        device=device)
    dist.all_reduce(ints, group=group)
    ints = ints.tolist()
    out, start = [], 1
    for cs in counts:
        out.append(ints[start:start + len(cs)])
        start += len(cs)
    return ints[0], out
