"""Training-data attribution from the hook records: influence scores of train samples on query
samples, ``q_m^T H^-1 g_n``, without the ``(B, P)`` per-sample gradients of the train batch.

Index conventions as :mod:`gradhooks.readers.gram`: ``m`` query sample (``M`` of them), ``n``
train sample (``N``), ``g`` group, ``s`` weight-sharing position, ``i`` input feature with the
bias's ``1`` appended when the bias is covered (``I'``), ``o`` output feature. ``q_m`` and
``g_n`` are the gradients of each sample's *own* loss (:func:`~gradhooks.readers.gram.gradient_features`),
per layer the ``(O, I')`` matrix of ``[W b]``: ``g_n = sum_s g[n,s] ã[n,s]^T``.

Influence functions (Koh & Liang 2017, arXiv:1703.04730, sec. 2; Grosse et al. 2023,
arXiv:2308.03296, sec. 2-3, EK-FAC influence; kronfluence's ``compute_pairwise_scores`` /
``compute_self_scores``), with ``H`` block-diagonal over layers::

    S[m, n] = sum_layers <H^-1 q_m, g_n>          self-influence: sum_layers <H^-1 g_n, g_n>

``H`` per block (identity, KFAC, EKFAC, diagonal), its damping and which parameters each block
covers: :mod:`gradhooks.readers.attribution.influence_blocks` (:func:`preconditioner`); factors fitted over
many batches: :mod:`gradhooks.readers.attribution.factor_fit` (:class:`FactorFit`). This module re-exports
their public names (``gradhooks.attribution.X``).

How it is formed. The query side is small: its gradients are formed per block, ``(M, G, O,
I')``, and preconditioned in the eigenbasis, ``Q_G ((Q_G^T q_m Q_A) / (S + λ)) Q_A^T``
(:func:`query_gradients`; ``Q_G^T q_m Q_A`` formed from the records rotated first where that
costs fewer multiply-adds, ``S (O^2 + I'^2) <= O I' (O + I')``: tokens fewer than the width). The train side is contracted from its records, by whichever costs
fewer multiply-adds (:func:`records_form_cheaper`): directly, ``sum_s g[n,s]^T Q'_m ã[n,s]``
(no weight sharing, or one query), or through at most ``CHUNK_NUMEL`` entries of train
matrices ``(G, O, I')`` at a time and one matmul. Self-influence of a layer without weight
sharing forms no ``(O, I')`` matrix: ``sum_{o,i} (Q_G^T g_n)_o^2 (Q_A^T ã_n)_i^2 / (S + λ)_{oi}``.

Per-token scores (``pairwise_scores(per_token=True)``, kronfluence's
``compute_per_token_scores``: its ``"qio,bti,bto->qbt"``): the train gradient's decomposition
over its weight-sharing positions, ``S[m, n, s] = sum_layers sum_g g[n,g,s]^T Q'_m[g] ã[n,g,s]``
(``(M, N, S)``, summing to the pairwise scores over ``s``), for the layers whose records hold
the positions (Linear / ``Conv1D`` on ``(B, T, in)``: ``S = T`` tokens; the positions of a
module's several calls are concatenated). A parameter held only as a dense per-sample gradient
(embedding, norm, attention, recurrent, tied weights) has no per-position decomposition here:
its block is refused with an error naming it (kronfluence tracks no such layer; leave it out of
the preconditioner, ``missing="skip"``).

Several batches: :class:`FactorFit` fits the factors over many batches in two passes, as
kronfluence's ``fit_all_factors``, with its convention (the mean over samples): that of
``gh.kfac_factors()`` / ``gh.ekfac_factors()`` with ``loss_reduction="mean"`` (with ``"sum"``
their ``G`` and ``S`` are ``N`` times larger, the scores under the default damping ``N`` times
smaller). kronfluence's KFAC also averages ``G`` over the ``S`` positions of a layer with weight
sharing, so its KFAC scores of such a layer are ``S`` times ours (EKFAC's are the same).
"""
from __future__ import annotations

from typing import Dict, Optional, Union

import torch
from torch import Tensor

from ...base.errors import GradHooksError
from ...base.utils import no_autocast
from ..gram import GradientFeatures
from .factor_fit import FactorFit
from .influence_blocks import (
    CHUNK_NUMEL,
    HEURISTIC_DAMPING,
    MISSING,
    BlockInverse,
    Preconditioner,
    block_rows,
    check_features,
    preconditioner,
    terms,
)

__all__ = ["BlockInverse", "Preconditioner", "QueryGradients", "FactorFit", "preconditioner",
           "query_gradients", "pairwise_scores", "self_scores", "records_form_cheaper",
           "HEURISTIC_DAMPING", "MISSING", "CHUNK_NUMEL"]


class QueryGradients:
    """The query batch's preconditioned gradients ``H^-1 q_m`` (:func:`query_gradients`).

    Attributes:
        size: ``M``.
        preconditioner: the :class:`Preconditioner` applied.
        grads: ``{key: (M, D)}``, each block's preconditioned gradients flattened (``[W b]``
            row-major per group for Kronecker and identity blocks of linear layers).
        kinds: ``{key: kind}`` of the blocks taking part.
    """

    def __init__(self, size: int, pre: Preconditioner, grads: Dict[str, Tensor],
                 kinds: Dict[str, str]):
        self.size, self.preconditioner, self.grads, self.kinds = size, pre, grads, kinds

    def __repr__(self) -> str:
        return f"QueryGradients(M={self.size}, kinds={self.kinds})"


def query_gradients(features: GradientFeatures, pre: Optional[Preconditioner] = None
                    ) -> QueryGradients:
    """``H^-1 q_m`` of every query sample per block, materialised (``M P`` entries).

    Args:
        features: ``gh.gradient_features()`` of the query batch (after its loss's backward).
        pre: from :func:`preconditioner` / :meth:`FactorFit.preconditioner`; ``None``: ``H = I``.

    Raises:
        GradHooksError: for Jacobian features (several passes), or factors whose shapes do not
            match the records.
    """
    check_features(features, "query_gradients()")
    pre = preconditioner(None) if pre is None else pre
    grads, kinds = {}, {}
    with no_autocast(), torch.no_grad():
        for key, term in terms(pre, features).items():
            # rotate the records before their product where that is cheaper: S (O^2 + I'^2)
            # multiply-adds a query instead of the matrices' O I' (O + I') (GPT-2's layers)
            e = features.linear.get(term.path) if term.path is not None else None
            first = e is None or _rotate_records_first(e)
            m = torch.cat([t for _, t in block_rows(term, features, 1 << 62, first)])
            grads[key] = term.block.apply(m, in_eigenbasis=first).flatten(1)
            kinds[key] = term.block.kind
    return QueryGradients(features.size, pre, grads, kinds)


def _rotate_records_first(e) -> bool:
    # S (O^2 + I'^2) <= O I' (O + I'): rotating a (N, G, S, I') and g (N, G, S, O) into the
    # eigenbasis costs no more than rotating their (O, I') product
    s, i, o = e.a.shape[2], e.a.shape[-1], e.g.shape[-1]
    return s * (o * o + i * i) <= o * i * (o + i)


def _total(parts: Dict[str, Tensor], per_layer: bool, what: str):
    if per_layer:
        return parts
    if not parts:
        raise GradHooksError(f"{what}: no parameter took part (the batches share none, or no "
                             f"factor entry covers them with missing='skip')")
    return sum(parts.values())


def pairwise_scores(query: Union[QueryGradients, GradientFeatures], train: GradientFeatures,
                    pre: Optional[Preconditioner] = None, *, per_layer: bool = False,
                    per_token: bool = False, chunk_numel: int = CHUNK_NUMEL
                    ) -> Union[Tensor, Dict[str, Tensor]]:
    """Influence scores ``S[m, n] = <H^-1 q_m, g_n>`` ``(M, N)`` (kronfluence's
    ``compute_pairwise_scores``), the train batch's per-sample gradients never formed beyond
    ``chunk_numel`` entries at a time (module docstring).

    Args:
        query: :func:`query_gradients` (preconditioned once, reused for many train batches) or
            the query batch's ``gh.gradient_features()`` (then preconditioned with ``pre``).
        train: ``gh.gradient_features()`` of a train batch.
        pre: with features as ``query``: the :class:`Preconditioner` (``None``: ``H = I``,
            which gives ``gram(query, train)``); with :class:`QueryGradients`: must be
            ``None`` or the one they were made with.
        per_layer: return ``{key: (M, N)}`` per block (they add up to the total; which
            approximation each used: :attr:`QueryGradients.kinds`).
        per_token: return ``(M, N, T)`` per-token scores (module docstring; kronfluence's
            ``compute_per_token_scores``), ``T`` the train records' weight-sharing positions
            (tokens), the same for every block taking part (with ``per_layer``, ``{key: (M, N,
            S_key)}``, each block its own ``S``). Their sum over ``T`` is the pairwise score.
        chunk_numel: how many entries of train matrices (per-token: of the ``(M, c, G, S, O)``
            intermediate) one block forms at a time.

    Returns:
        ``(M, N)`` in the dtype of the features (``(M, N, T)`` with ``per_token``), or a dict
        of them per block with ``per_layer``.

    Raises:
        GradHooksError: for Jacobian features, mismatched factors, or no shared parameter;
            with ``per_token``, for a block of parameters held as dense per-sample gradients
            (the message names them), or blocks with different numbers of positions.
        ValueError: for query gradients made with another preconditioner than ``pre``.
    """
    if isinstance(query, GradientFeatures):
        query = query_gradients(query, pre)
    elif pre is not None and pre is not query.preconditioner:
        raise ValueError("pairwise_scores(): query gradients made with another preconditioner")
    check_features(train, "pairwise_scores()")
    held = terms(query.preconditioner, train)
    parts = {}
    with no_autocast(), torch.no_grad():
        for key, q in query.grads.items():
            term = held.get(key)
            if term is None:
                continue  # (a parameter only one batch reached adds nothing)
            e = train.linear.get(term.path) if term.path is not None else None
            if per_token:
                if e is None:
                    raise GradHooksError(
                        f"pairwise_scores(per_token=True): block {key!r} ({term.block.kind}) covers "
                        f"{list(term.names)}, held as per-sample gradients without positions (an "
                        f"embedding, norm, attention, recurrent or tied parameter); leave its "
                        f"entry out of the factors (with missing='skip') for per-token scores")
                parts[key] = _records_scores(q, e, chunk_numel, per_token=True)
                continue
            if e is not None and records_form_cheaper(query.size, e.a.shape[2]):
                parts[key] = _records_scores(q, e, chunk_numel)
                continue
            s = q.new_zeros(query.size, train.size)
            for start, rows in block_rows(term, train, chunk_numel):
                s[:, start:start + rows.shape[0]] = q @ rows.flatten(1).to(q.dtype).T
            parts[key] = s
    if per_token and not per_layer:
        positions = {key: t.shape[-1] for key, t in parts.items()}
        if len(set(positions.values())) > 1:
            raise GradHooksError(f"pairwise_scores(per_token=True): the blocks hold different "
                                 f"numbers of positions {positions}; use per_layer=True")
    return _total(parts, per_layer, "pairwise_scores()")


def records_form_cheaper(m: int, s: int) -> bool:
    """Whether contracting a linear layer's train records with the ``M`` preconditioned
    queries, ``sum_s g[n,s]^T Q'_m ã[n,s]`` (``M N G S O I'`` multiply-adds), costs no more than
    forming the train ``(O, I')`` matrices and one matmul (``N G O I' (S + M)``): ``M S <= M +
    S``, i.e. ``S = 1`` or ``M = 1`` (for ``S = 1`` the matrices are slow ``k = 1`` batched
    matmuls too: benchmarks/attribution.py's MLP at M = 32, 2.0 s by matrices, 0.7 s here)."""
    return m * s <= m + s


def _records_scores(q: Tensor, e, chunk_numel: int, per_token: bool = False) -> Tensor:
    # (M, N) = sum_{g,s} g[n,g,s]^T Q'[m,g] ã[n,g,s], chunked over train samples; per_token:
    # (M, N, S), not summed over s
    a, g = e.a, e.g[0]
    n, grp, pos, i = a.shape
    o, m = g.shape[-1], q.shape[0]
    q = q.reshape(m, grp, o, i)
    a, g = a.to(q.dtype), g.to(q.dtype)
    step = max(1, chunk_numel // max(1, m * grp * pos * o))
    out = "mns" if per_token else "mn"
    return torch.cat([torch.einsum(f"nmgso,ngso->{out}",
                                   torch.einsum("ngsi,mgoi->nmgso", a[k:k + step], q),
                                   g[k:k + step]) for k in range(0, max(n, 1), step)], 1)


def self_scores(train: GradientFeatures, pre: Optional[Preconditioner] = None, *,
                per_layer: bool = False, chunk_numel: int = CHUNK_NUMEL
                ) -> Union[Tensor, Dict[str, Tensor]]:
    """Self-influence ``<H^-1 g_n, g_n>`` ``(N,)`` (kronfluence's ``compute_self_scores``); for
    ``H = I`` the squared per-sample gradient norms. Layers without weight sharing need no
    per-sample matrix (module docstring); the others form them ``chunk_numel`` entries at a time.

    Args:
        train: ``gh.gradient_features()`` of the batch.
        pre, per_layer, chunk_numel: as :func:`pairwise_scores` (``pre=None``: ``H = I``).
    """
    check_features(train, "self_scores()")
    pre = preconditioner(None) if pre is None else pre
    parts = {}
    with no_autocast(), torch.no_grad():
        for key, term in terms(pre, train).items():
            e = train.linear.get(term.path) if term.path is not None else None
            if e is not None and e.a.shape[2] == 1:
                parts[key] = _self_unshared(term.block, e.a[:, :, 0], e.g[0, :, :, 0])
                continue
            parts[key] = torch.cat([term.block.quadratic(m, in_eigenbasis=True)
                                    for _, m in block_rows(term, train, chunk_numel, True)])
    return _total(parts, per_layer, "self_scores()")


def _self_unshared(block: BlockInverse, a: Tensor, g: Tensor) -> Tensor:
    # a (N, G, I'), g (N, G, O): sum_{g,o,i} (Q_G^T g)_o^2 (Q_A^T a)_i^2 inverse[g, o, i]
    if block.Q_A is not None:
        a = torch.einsum("ngi,gij->ngj", a, block.Q_A.to(a.dtype))
    if block.Q_G is not None:
        g = torch.einsum("ngo,gop->ngp", g, block.Q_G.to(g.dtype))
    a2, g2 = a.square(), g.square()
    if block.inverse is None:
        return (a2.sum(-1) * g2.sum(-1)).sum(1)
    return torch.einsum("ngo,ngi,goi->n", g2, a2, block.inverse.to(a.dtype))
