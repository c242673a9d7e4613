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

``H`` per block (:class:`BlockInverse`):

* ``"identity"``: ``H = I``; ``S`` is the Gram matrix of the gradients (TracIn at one
  checkpoint, Pruthi et al. 2020, arXiv:2002.08484; gradient similarity);
* ``"kfac"``: ``A ⊗ G`` (:func:`~gradhooks.readers.kfac.kfac_factors`, Martens & Grosse 2015)
  damped in its eigenbasis, ``H = K (diag(lam_G) ⊗ diag(lam_A) + λ) K^T`` with
  ``K = Q_G ⊗ Q_A`` (kronfluence's ``Kfac``), or factor by factor,
  ``(G + λ_G I) ⊗ (A + λ_A I)``, for ``damping=(λ_A, λ_G)``;
* ``"ekfac"``: ``K (diag(S) + λ) K^T`` with the corrected eigenvalues ``S``
  (:func:`~gradhooks.readers.ekfac.ekfac_factors`; George et al. 2018; kronfluence's ``Ekfac``);
* ``"diagonal"``: ``diag(d) + λ`` for a :class:`~gradhooks.readers.kfac_results.DiagonalFactors`
  entry (norm layers and the other layers KFAC has no Kronecker pair for).

Damping: ``λ`` given, or by default ``0.1`` times the mean of the block's eigenvalues
(``S``, ``lam_G ⊗ lam_A`` or ``d``): kronfluence's heuristic (``damping_factor=None``,
``HEURISTIC_DAMPING_SCALE``), per block.

How it is formed. The query side is small: its gradients are formed per block, ``(M, G, O,
I')``, and preconditioned in the eigenbasis, ``Q_G ((Q_G^T q_m Q_A) / (S + λ)) Q_A^T``
(:func:`query_gradients`). The train side is contracted from its records, by whichever costs
fewer multiply-adds (:func:`records_form_cheaper`): directly, ``sum_s g[n,s]^T Q'_m ã[n,s]``
(no weight sharing, or one query), or through at most ``CHUNK_NUMEL`` entries of train
matrices ``(G, O, I')`` at a time and one matmul. Self-influence of a layer without weight
sharing forms no ``(O, I')`` matrix: ``sum_{o,i} (Q_G^T g_n)_o^2 (Q_A^T ã_n)_i^2 / (S + λ)_{oi}``.

Which layers take part. The records' layers linear in their weight (Linear, Conv, ``Conv1D``:
:attr:`GradientFeatures.linear`) use the factor entry keyed by their module; the other
parameters (per-sample gradients in :attr:`GradientFeatures.dense`: embeddings, attention,
recurrent layers, norms, tied weights) use the entry whose parameters they are (a Kronecker
entry of :func:`~gradhooks.readers.kfac.kfac_factors` with ``coverage="all"``, or a diagonal
one). A parameter no entry covers is left out (``missing="skip"``, the default: kronfluence
likewise scores only the modules it tracks) or taken with ``H = I`` (``missing="identity"``);
:attr:`Preconditioner.kinds` / :attr:`QueryGradients.kinds` say what each block used.

Several batches: :class:`FactorFit` fits the factors over many batches in two passes, as
kronfluence's ``fit_all_factors``, with its convention (the mean over samples): that of
``gh.kfac_factors()`` / ``gh.ekfac_factors()`` with ``loss_reduction="mean"`` (with ``"sum"``
their ``G`` and ``S`` are ``N`` times larger, the scores under the default damping ``N`` times
smaller). kronfluence's KFAC also averages ``G`` over the ``S`` positions of a layer with weight
sharing, so its KFAC scores of such a layer are ``S`` times ours (EKFAC's are the same).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Iterator, NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

from ..base.errors import GradHooksError
from ..base.utils import no_autocast
from .ekfac import EKFACFactors
from .gram import GradientFeatures
from .kfac import check_choice
from .kfac_results import DiagonalFactors, KFACFactors

__all__ = ["BlockInverse", "Preconditioner", "QueryGradients", "FactorFit", "preconditioner",
           "query_gradients", "pairwise_scores", "self_scores", "records_form_cheaper",
           "HEURISTIC_DAMPING", "MISSING", "CHUNK_NUMEL"]

#: Default damping: this times the mean eigenvalue of the block (kronfluence's heuristic).
HEURISTIC_DAMPING = 0.1
#: Values of ``missing``.
MISSING = ("skip", "identity")
#: Train samples' ``(G, O, I')`` matrices are formed this many entries at a time (per block).
CHUNK_NUMEL = 1 << 22
_STRATEGIES = ("ekfac", "kfac")

Damping = Union[None, float, Tuple[float, float]]


@dataclasses.dataclass(repr=False)
class BlockInverse:
    """The damped inverse of one block of ``H`` (module docstring).

    Attributes:
        kind: ``"ekfac"``, ``"kfac"``, ``"diagonal"`` or ``"identity"``.
        params: names of the parameters covered (``()`` for blocks made from features alone).
        Q_A: ``(G, I', I')`` eigenvectors of ``A`` as columns, or ``None`` (the identity: no
            rotation, e.g. a factor kept diagonal).
        Q_G: ``(G, O, O)``, or ``None``.
        inverse: ``(G, O, I')`` ``1 / (S + λ)`` in the eigenbasis (``"diagonal"``: ``(P,)``
            over the parameters flattened and concatenated in :attr:`params` order);
            ``None`` for ``"identity"``.
        damping: the ``λ`` used (``(λ_A, λ_G)`` for factor damping).
        layout: the :class:`~gradhooks.readers.kfac_results.KFACFactors` whose
            :meth:`~gradhooks.readers.kfac_results.KFACFactors.grad_matrix` layout turns per-sample
            gradients into ``[W b]`` (Kronecker blocks of the dense parameters), else ``None``.
    """

    kind: str
    params: Tuple[str, ...] = ()
    Q_A: Optional[Tensor] = None
    Q_G: Optional[Tensor] = None
    inverse: Optional[Tensor] = None
    damping: Union[float, Tuple[float, float]] = 0.0
    layout: Optional[KFACFactors] = None

    def __repr__(self) -> str:
        shape = None if self.inverse is None else tuple(self.inverse.shape)
        return f"BlockInverse(kind={self.kind!r}, inverse={shape}, damping={self.damping!r})"

    def _rotate(self, m: Tensor, back: bool = False) -> Tensor:
        # (N, G, O, I') into the eigenbasis (Q_G^T m Q_A), or back (Q_G m Q_A^T)
        q_g, q_a = self.Q_G, self.Q_A
        if q_g is not None:
            q_g = q_g.to(m.dtype)
            m = (q_g if back else q_g.transpose(-1, -2)) @ m
        if q_a is not None:
            q_a = q_a.to(m.dtype)
            m = m @ (q_a.transpose(-1, -2) if back else q_a)
        return m

    def apply(self, m: Tensor) -> Tensor:
        """``H^-1 m`` for per-sample ``m`` ``(N, G, O, I')`` (``(N, P)`` for ``"diagonal"``)."""
        if self.inverse is None:
            return m
        if self.kind == "diagonal":
            return m * self.inverse.to(m.dtype)
        return self._rotate(self._rotate(m) * self.inverse.to(m.dtype), back=True)

    def quadratic(self, m: Tensor, in_eigenbasis: bool = False) -> Tensor:
        """``(N,)`` ``m_n^T H^-1 m_n`` for per-sample ``m`` (as :meth:`apply`; already rotated
        into the eigenbasis with ``in_eigenbasis``)."""
        if self.inverse is None:
            return m.flatten(1).square().sum(1)
        if self.kind == "diagonal":
            return (m.square() * self.inverse.to(m.dtype)).sum(1)
        m = m if in_eigenbasis else self._rotate(m)
        return (m.square() * self.inverse.to(m.dtype)).flatten(1).sum(1)


_IDENTITY = BlockInverse("identity")


def _damped(values: Tensor, damping: Damping, key: str) -> Tuple[Tensor, float]:
    # 1 / (values + λ), λ given or HEURISTIC_DAMPING * mean(values)
    if isinstance(damping, tuple):
        raise ValueError(f"block {key!r}: damping=(λ_A, λ_G) damps the two Kronecker factors "
                         f"of a KFAC entry; this block has none, give one float")
    lam = HEURISTIC_DAMPING * values.mean().item() if damping is None else float(damping)
    return 1.0 / (values + lam), lam


def _eigen(factor: Tensor, diagonal: bool, groups: int) -> Tuple[Tensor, Optional[Tensor]]:
    # eigenvalues (G, d) and eigenvectors (G, d, d) (None: a diagonal factor, its own basis)
    factor = (factor if groups > 1 else factor[None]).double()  # (kronfluence's precision)
    if diagonal:
        return factor, None
    return torch.linalg.eigh(factor)


def _block(key: str, factor, damping: Damping) -> BlockInverse:
    if isinstance(factor, EKFACFactors):
        kf = factor.kfac
        one = (lambda t: t) if kf.groups > 1 else (lambda t: t[None])
        inverse, lam = _damped(one(factor.scaling), damping, key)
        return BlockInverse("ekfac", kf.params, one(factor.Q_A), one(factor.Q_G), inverse, lam, kf)
    if isinstance(factor, KFACFactors):
        e_a, q_a = _eigen(factor.A, factor.diagonal_A, factor.groups)
        e_g, q_g = _eigen(factor.G, factor.diagonal_G, factor.groups)
        if isinstance(damping, tuple):
            lam_a, lam_g = (float(d) for d in damping)
            inverse = 1.0 / ((e_g + lam_g)[..., :, None] * (e_a + lam_a)[..., None, :])
            lam: Union[float, Tuple[float, float]] = (lam_a, lam_g)
        else:
            inverse, lam = _damped(e_g[..., :, None] * e_a[..., None, :], damping, key)
        return BlockInverse("kfac", factor.params, q_a, q_g, inverse, lam, factor)
    if isinstance(factor, DiagonalFactors):
        inverse, lam = _damped(torch.cat([t.flatten() for t in factor.diagonal.values()]),
                               damping, key)
        return BlockInverse("diagonal", factor.params, inverse=inverse, damping=lam)
    raise TypeError(f"factor {key!r}: expected KFACFactors, EKFACFactors or DiagonalFactors, "
                    f"got {type(factor).__name__}")


class Preconditioner:
    """``H^-1`` block by block (module docstring): :func:`preconditioner` or
    :meth:`FactorFit.preconditioner` make it.

    Attributes:
        blocks: ``{key: BlockInverse}``, keyed like the factors (module path; ``"<module>.<param>"``
            for the several blocks of one module).
        missing: ``"skip"`` or ``"identity"``: what a parameter no block covers gets.
    """

    def __init__(self, blocks: Dict[str, BlockInverse], missing: str = "skip"):
        check_choice("missing", missing, MISSING)
        self.blocks, self.missing = blocks, missing

    @property
    def kinds(self) -> Dict[str, str]:
        """``{key: kind}`` of the blocks."""
        return {key: b.kind for key, b in self.blocks.items()}

    def __repr__(self) -> str:
        return f"Preconditioner(kinds={self.kinds}, missing={self.missing!r})"


def preconditioner(factors: Optional[dict] = None, *, damping: Damping = None,
                   missing: str = "skip") -> Preconditioner:
    """``H^-1`` from factors (module docstring).

    Args:
        factors: ``gh.ekfac_factors()`` (EKFAC), ``gh.kfac_factors()`` (KFAC; its diagonal
            entries give ``"diagonal"`` blocks), ``gradhooks.kfac(...)``, or ``None``: ``H = I``
            for every parameter (gradient similarity / TracIn). For factors fitted on several
            batches: :class:`FactorFit`.
        damping: ``λ`` added to the eigenvalues of every block; ``None`` (default):
            ``HEURISTIC_DAMPING`` times the block's mean eigenvalue; ``(λ_A, λ_G)``: KFAC
            blocks damped factor by factor, ``(G + λ_G I) ⊗ (A + λ_A I)`` (other blocks refuse
            it).
        missing: ``"skip"`` (default) or ``"identity"`` for the parameters no entry covers.

    Raises:
        ValueError: for an unknown ``missing``, a negative damping, or a tuple damping with a
            block that is not KFAC.
        TypeError: for an entry of another type.
    """
    if damping is not None and min(damping if isinstance(damping, tuple) else (damping,)) < 0:
        raise ValueError(f"damping must be >= 0, got {damping!r}")
    if factors is None:
        return Preconditioner({}, "identity")
    with no_autocast(), torch.no_grad():
        return Preconditioner({key: _block(key, f, damping) for key, f in factors.items()},
                              missing)


class _Term(NamedTuple):
    # one block of H as a batch's features hold it: a linear entry (path) or dense params
    block: BlockInverse
    path: Optional[str]
    names: Tuple[str, ...]


def _check_features(features: GradientFeatures, what: str) -> None:
    if not isinstance(features, GradientFeatures):
        raise TypeError(f"{what}: expected GradientFeatures (gh.gradient_features()), got "
                        f"{type(features).__name__}")
    if features.passes != 1:
        raise GradHooksError(f"{what}: the features hold {features.passes} backward passes "
                             f"(Jacobian rows); influence scores take loss gradients "
                             f"(gh.gradient_features() after the loss's backward)")


def _terms(pre: Preconditioner, features: GradientFeatures) -> Dict[str, _Term]:
    terms: Dict[str, _Term] = {}
    for path, e in features.linear.items():
        b = pre.blocks.get(path)
        if b is not None and b.kind in _STRATEGIES:
            want = tuple(b.inverse.shape)
            have = (e.a.shape[1], e.g.shape[-1], e.a.shape[-1])
            if want != have:
                raise GradHooksError(
                    f"block {path!r}: factors of shape (groups, O, I') = {want}, the records "
                    f"{have} (factors of another model, or of other parameters: a frozen bias?)")
            terms[path] = _Term(b, path, ())
        elif pre.missing == "identity":
            terms[path] = _Term(_IDENTITY, path, ())
    covered: set = set()
    for key, b in pre.blocks.items():
        if key in features.linear or not b.params or covered.intersection(b.params):
            continue  # (a parameter tied between two entries: the first one's)
        if all(n in features.dense for n in b.params):
            terms[key] = _Term(b, None, b.params)
            covered.update(b.params)
    if pre.missing == "identity":
        for name in features.dense:
            if name not in covered:
                terms[name] = _Term(_IDENTITY, None, (name,))
    return terms


def _grad_matrices(kf: KFACFactors, grads: Dict[str, Tensor]) -> Tensor:
    # KFACFactors.grad_matrix with a leading sample dim: (N, G, O, I')
    groups, d_out = kf.groups, kf.G.shape[-1]
    parts = []
    if kf.weight is not None:
        w = grads[kf.weight]
        n, cols = w.shape[0], w.shape[1:].numel() // (groups * d_out)  # (N may be 0)
        if kf.weight_transposed:  # (N, G * I', O, *K) -> (N, G, O, I' * K)
            per = w.shape[1] // groups
            w = w.reshape(n, groups, per, d_out, cols // per).transpose(2, 3)
        parts.append(w.reshape(n, groups, d_out, cols))
    if kf.bias is not None:
        b = grads[kf.bias]
        parts.append(b.reshape(b.shape[0], groups, d_out, 1))
    return torch.cat(parts, -1) if len(parts) > 1 else parts[0]


def _rows(term: _Term, features: GradientFeatures, chunk_numel: int, eigenbasis: bool = False
          ) -> Iterator[Tuple[int, Tensor]]:
    """``(start, per-sample matrices)`` of the batch, ``(c, G, O, I')`` (``(c, P)`` for
    diagonal and identity blocks of dense parameters), ``c`` samples at a time; with
    ``eigenbasis``, ``Q_G^T m Q_A`` (for a linear layer from the records rotated first:
    ``S (O^2 + I'^2)`` multiply-adds a sample instead of the matrices' ``O I' (O + I')``)."""
    block = term.block
    if term.path is not None:
        e = features.linear[term.path]
        a, g = e.a, e.g[0]
        _, grp, _, i = a.shape
        step = max(1, chunk_numel // max(1, grp * g.shape[-1] * i))
        q_a, q_g = (block.Q_A, block.Q_G) if eigenbasis else (None, None)
        for start in range(0, max(features.size, 1), step):  # (one empty chunk for B = 0)
            a_c, g_c = a[start:start + step], g[start:start + step]
            if q_a is not None:
                a_c = a_c @ q_a.to(a_c.dtype)
            if q_g is not None:
                g_c = g_c @ q_g.to(g_c.dtype)
            yield start, torch.einsum("ngso,ngsi->ngoi", g_c, a_c)
        return
    grads = {n: features.dense[n][0] for n in term.names}
    if block.layout is not None:
        m = _grad_matrices(block.layout, grads)
        yield 0, block._rotate(m) if eigenbasis else m
    else:
        yield 0, torch.cat([t.flatten(1) for t in grads.values()], 1)


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
    _check_features(features, "query_gradients()")
    pre = preconditioner(None) if pre is None else pre
    grads, kinds = {}, {}
    with no_autocast(), torch.no_grad():
        for key, term in _terms(pre, features).items():
            m = torch.cat([t for _, t in _rows(term, features, 1 << 62)])
            grads[key] = term.block.apply(m).flatten(1)
            kinds[key] = term.block.kind
    return QueryGradients(features.size, pre, grads, kinds)


def _total(parts: Dict[str, Tensor], per_layer: bool, what: str):
    if per_layer:
        return parts
    if not parts:
        raise GradHooksError(f"{what}: no parameter took part (the batches share none, or no "
                             f"factor entry covers them with missing='skip')")
    return sum(parts.values())


def pairwise_scores(query: Union[QueryGradients, GradientFeatures], train: GradientFeatures,
                    pre: Optional[Preconditioner] = None, *, per_layer: bool = False,
                    chunk_numel: int = CHUNK_NUMEL) -> Union[Tensor, Dict[str, Tensor]]:
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
        chunk_numel: how many entries of train matrices one block forms at a time.

    Raises:
        GradHooksError: for Jacobian features, mismatched factors, or no shared parameter.
        ValueError: for query gradients made with another preconditioner than ``pre``.
    """
    if isinstance(query, GradientFeatures):
        query = query_gradients(query, pre)
    elif pre is not None and pre is not query.preconditioner:
        raise ValueError("pairwise_scores(): query gradients made with another preconditioner")
    _check_features(train, "pairwise_scores()")
    terms = _terms(query.preconditioner, train)
    parts = {}
    with no_autocast(), torch.no_grad():
        for key, q in query.grads.items():
            term = terms.get(key)
            if term is None:
                continue  # (a parameter only one batch reached adds nothing)
            e = train.linear.get(term.path) if term.path is not None else None
            if e is not None and records_form_cheaper(query.size, e.a.shape[2]):
                parts[key] = _records_scores(q, e, chunk_numel)
                continue
            s = q.new_zeros(query.size, train.size)
            for start, rows in _rows(term, train, chunk_numel):
                s[:, start:start + rows.shape[0]] = q @ rows.flatten(1).to(q.dtype).T
            parts[key] = s
    return _total(parts, per_layer, "pairwise_scores()")


def records_form_cheaper(m: int, s: int) -> bool:
    """Whether contracting a linear layer's train records with the ``M`` preconditioned
    queries, ``sum_s g[n,s]^T Q'_m ã[n,s]`` (``M N G S O I'`` multiply-adds), costs no more than
    forming the train ``(O, I')`` matrices and one matmul (``N G O I' (S + M)``): ``M S <= M +
    S``, i.e. ``S = 1`` or ``M = 1`` (for ``S = 1`` the matrices are slow ``k = 1`` batched
    matmuls too: benchmarks/attribution.py's MLP at M = 32, 2.0 s by matrices, 0.7 s here)."""
    return m * s <= m + s


def _records_scores(q: Tensor, e, chunk_numel: int) -> Tensor:
    # (M, N) = sum_{g,s} g[n,g,s]^T Q'[m,g] ã[n,g,s], chunked over train samples
    a, g = e.a, e.g[0]
    n, grp, pos, i = a.shape
    o, m = g.shape[-1], q.shape[0]
    q = q.reshape(m, grp, o, i)
    a, g = a.to(q.dtype), g.to(q.dtype)
    step = max(1, chunk_numel // max(1, m * grp * pos * o))
    return torch.cat([torch.einsum("nmgso,ngso->mn",
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
    _check_features(train, "self_scores()")
    pre = preconditioner(None) if pre is None else pre
    parts = {}
    with no_autocast(), torch.no_grad():
        for key, term in _terms(pre, train).items():
            e = train.linear.get(term.path) if term.path is not None else None
            if e is not None and e.a.shape[2] == 1:
                parts[key] = _self_unshared(term.block, e.a[:, :, 0], e.g[0, :, :, 0])
                continue
            parts[key] = torch.cat([term.block.quadratic(m, in_eigenbasis=True)
                                    for _, m in _rows(term, train, chunk_numel, True)])
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


class FactorFit:
    """KFAC / EKFAC factors of the linear layers accumulated over many batches, from their
    ``gh.gradient_features()`` (kronfluence's ``fit_covariance_matrices``,
    ``perform_eigendecomposition``, ``fit_lambda_matrices``): two passes over the data::

        fit = FactorFit()
        for x, y in loader:                       # pass 1: A and G
            ...; loss.backward(); fit.add_covariances(gh.gradient_features()); gh.clear()
        for x, y in loader:                       # pass 2 (EKFAC only): S in the eigenbasis
            ...; loss.backward(); fit.add_eigenvalues(gh.gradient_features()); gh.clear()
        pre = fit.preconditioner("ekfac")

    Convention (mean over samples, kronfluence's; ``gh.kfac_factors()`` /
    ``gh.ekfac_factors()`` with ``loss_reduction="mean"`` on one batch)::

        A = sum_{n,s} ã ã^T / (N S)     G = sum_n sum_s e e^T / N     S = sum_n (Q_G^T g_n Q_A)^2 / N

    ``e`` the gradient of sample ``n``'s own loss w.r.t. the layer output (kfac-expand). The
    eigenbasis is fixed by the first :meth:`add_eigenvalues` (or :meth:`preconditioner`) call.
    """

    def __init__(self, chunk_numel: int = CHUNK_NUMEL):
        self.chunk_numel = chunk_numel
        self._a: Dict[str, Tensor] = {}
        self._g: Dict[str, Tensor] = {}
        self._count: Dict[str, Tuple[int, int]] = {}  # samples, positions
        self._eigen: Optional[Dict[str, Tuple[Tensor, Tensor, Tensor, Tensor]]] = None
        self._s: Dict[str, Tensor] = {}
        self._s_count: Dict[str, int] = {}

    def __repr__(self) -> str:
        return (f"FactorFit(layers={list(self._a)}, samples={dict(self._count)}, "
                f"eigenvalue samples={self._s_count})")

    def add_covariances(self, features: GradientFeatures) -> None:
        """Pass 1: add a batch's ``ã ã^T`` and ``e e^T`` sums (its linear layers)."""
        _check_features(features, "FactorFit.add_covariances()")
        if self._eigen is not None:
            raise GradHooksError("FactorFit.add_covariances() after the eigenbasis was fixed "
                                 "(add_eigenvalues / preconditioner): start a new FactorFit")
        with no_autocast(), torch.no_grad():
            for path, e in features.linear.items():
                a, g = e.a, e.g[0]
                sa = torch.einsum("ngsi,ngsj->gij", a, a).double()  # (sums in float64)
                sg = torch.einsum("ngso,ngsp->gop", g, g).double()
                if path in self._a:
                    self._a[path] += sa
                    self._g[path] += sg
                    n, r = self._count[path]
                    self._count[path] = (n + a.shape[0], r + a.shape[0] * a.shape[2])
                else:
                    self._a[path], self._g[path] = sa, sg
                    self._count[path] = (a.shape[0], a.shape[0] * a.shape[2])

    def _basis(self) -> Dict[str, Tuple[Tensor, Tensor, Tensor, Tensor]]:
        # {path: (eigenvalues of A, Q_A, eigenvalues of G, Q_G)}, fixed on first use
        if self._eigen is None:
            if not self._a or min(n for n, _ in self._count.values()) == 0:
                raise GradHooksError("FactorFit: no sample was added by add_covariances()")
            self._eigen = {}
            for path, sa in self._a.items():
                n, r = self._count[path]
                e_a, q_a = torch.linalg.eigh(sa / r)
                e_g, q_g = torch.linalg.eigh(self._g[path] / n)
                self._eigen[path] = (e_a, q_a, e_g, q_g)
        return self._eigen

    def add_eigenvalues(self, features: GradientFeatures) -> None:
        """Pass 2 (EKFAC): add a batch's squared per-sample gradients in the eigenbasis."""
        _check_features(features, "FactorFit.add_eigenvalues()")
        basis = self._basis()
        with no_autocast(), torch.no_grad():
            for path in features.linear:
                if path not in basis:
                    raise GradHooksError(f"FactorFit.add_eigenvalues(): layer {path!r} had no "
                                         f"covariances added in the first pass")
                _, q_a, _, q_g = basis[path]
                e = features.linear[path]
                if e.a.shape[2] == 1:  # sum_n (g'_n)^2 (a'_n)^2T: one matmul, no matrices
                    a2 = (e.a[:, :, 0] @ q_a.to(e.a.dtype)).square()
                    g2 = (e.g[0, :, :, 0] @ q_g.to(e.a.dtype)).square()
                    sums = [torch.einsum("ngo,ngi->goi", g2, a2)]
                else:
                    term = _Term(BlockInverse("ekfac", Q_A=q_a, Q_G=q_g), path, ())
                    sums = [m.square().sum(0) for _, m in
                            _rows(term, features, self.chunk_numel, eigenbasis=True)]
                for t in sums:
                    t = t.double()
                    self._s[path] = t if path not in self._s else self._s[path] + t
                self._s_count[path] = self._s_count.get(path, 0) + features.size

    def preconditioner(self, strategy: str = "ekfac", *, damping: Damping = None,
                       missing: str = "skip") -> Preconditioner:
        """``H^-1`` of the fitted factors: ``strategy`` ``"ekfac"`` (needs :meth:`add_eigenvalues`)
        or ``"kfac"``; ``damping`` and ``missing`` as :func:`preconditioner`."""
        check_choice("strategy", strategy, _STRATEGIES)
        blocks = {}
        with no_autocast(), torch.no_grad():
            for path, (e_a, q_a, e_g, q_g) in self._basis().items():
                if strategy == "ekfac":
                    if not self._s_count.get(path):
                        raise GradHooksError(f"FactorFit.preconditioner('ekfac'): layer {path!r} "
                                             f"has no eigenvalues: call add_eigenvalues() first")
                    inverse, lam = _damped(self._s[path] / self._s_count[path], damping, path)
                elif isinstance(damping, tuple):
                    lam = (float(damping[0]), float(damping[1]))
                    inverse = 1.0 / ((e_g + lam[1])[..., :, None] * (e_a + lam[0])[..., None, :])
                else:
                    inverse, lam = _damped(e_g[..., :, None] * e_a[..., None, :], damping, path)
                blocks[path] = BlockInverse(strategy, (), q_a, q_g, inverse, lam)
        return Preconditioner(blocks, missing)
