"""KFAC's result types: :class:`KFACFactors` (the Kronecker factors of one block of
parameters) and :class:`DiagonalFactors` (the exact diagonal block of a layer without a
Kronecker factorisation), as :func:`gradhooks.readers.curvature.kfac.kfac_factors` returns them.

Conventions (index names, ``A``, ``G``, the scale ``w``, the vectorisation): the module
docstring of :mod:`gradhooks.kfac`. These classes hold and convert the factors; they are
formed by :class:`gradhooks.readers.curvature.kfac_sums.KFACSums`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, Mapping, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["KFACFactors", "DiagonalFactors"]


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
            entry's key in :func:`~gradhooks.readers.curvature.kfac.kfac_factors` is ``module + "." + part``.
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
