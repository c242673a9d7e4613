"""The damped inverse curvature of the influence scores, block by block, and how a batch's
:class:`~gradhooks.readers.gram.GradientFeatures` meet the blocks (:mod:`gradhooks.readers.attribution.influence_scores`).

Index conventions as :mod:`gradhooks.readers.attribution.influence_scores`: ``n`` sample, ``g`` group, ``s``
weight-sharing position, ``i`` input feature with the bias's ``1`` (``I'``), ``o`` output feature.

``H`` per block (:class:`BlockInverse`):

* ``"identity"``: ``H = I``; the scores are the Gram matrix of the gradients (TracIn at one
  checkpoint, Pruthi et al. 2020, arXiv:2002.08484; gradient similarity);
* ``"kfac"``: ``A ⊗ G`` (:func:`~gradhooks.readers.curvature.kfac.kfac_factors`, Martens & Grosse 2015)
  damped in its eigenbasis, ``H = K (diag(lam_G) ⊗ diag(lam_A) + λ) K^T`` with
  ``K = Q_G ⊗ Q_A`` (kronfluence's ``Kfac``), or factor by factor,
  ``(G + λ_G I) ⊗ (A + λ_A I)``, for ``damping=(λ_A, λ_G)``;
* ``"ekfac"``: ``K (diag(S) + λ) K^T`` with the corrected eigenvalues ``S``
  (:func:`~gradhooks.readers.curvature.ekfac.ekfac_factors`; George et al. 2018; kronfluence's ``Ekfac``);
* ``"diagonal"``: ``diag(d) + λ`` for a :class:`~gradhooks.readers.curvature.kfac_results.DiagonalFactors`
  entry (norm layers and the other layers KFAC has no Kronecker pair for).

Damping: ``λ`` given, or by default ``0.1`` times the mean of the block's eigenvalues
(``S``, ``lam_G ⊗ lam_A`` or ``d``): kronfluence's heuristic (``damping_factor=None``,
``HEURISTIC_DAMPING_SCALE``), per block. The factors are eigendecomposed in float64
(:func:`~gradhooks.readers.curvature.ekfac.eigenbasis`, kronfluence's ``eigendecomposition_dtype``).

Which layers take part (:func:`terms`). The records' layers linear in their weight (Linear, Conv,
``Conv1D``: :attr:`GradientFeatures.linear`) use the block keyed by their module; the other
parameters (per-sample gradients in :attr:`GradientFeatures.dense`: embeddings, attention,
recurrent layers, norms, tied weights) use the block whose parameters they are (a Kronecker or
EKFAC entry, laid out by :func:`~gradhooks.readers.curvature.ekfac.per_sample_matrices`, or a diagonal
one). A parameter no block covers is left out (``missing="skip"``, the default: kronfluence
likewise scores only the modules it tracks) or taken with ``H = I`` (``missing="identity"``).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Iterator, NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

from ...base.errors import GradHooksError
from ...base.utils import no_autocast
from ..curvature.ekfac import EKFACFactors, eigenbasis, per_sample_matrices
from ..curvature.kfac import check_choice
from ..curvature.kfac_results import DiagonalFactors, KFACFactors
from ..gram import GradientFeatures

__all__ = ["BlockInverse", "Preconditioner", "preconditioner", "Term", "terms", "check_features",
           "block_rows", "HEURISTIC_DAMPING", "MISSING", "CHUNK_NUMEL", "STRATEGIES", "Damping",
           "damped"]

#: Default damping: this times the mean eigenvalue of the block (kronfluence's heuristic).
HEURISTIC_DAMPING = 0.1
#: Values of ``missing``.
MISSING = ("skip", "identity")
#: Train samples' ``(G, O, I')`` matrices are formed this many entries at a time (per block).
CHUNK_NUMEL = 1 << 22
#: The Kronecker strategies.
STRATEGIES = ("ekfac", "kfac")

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
        layout: the :class:`~gradhooks.readers.curvature.kfac_results.KFACFactors` whose
            :meth:`~gradhooks.readers.curvature.kfac_results.KFACFactors.grad_matrix` layout turns per-sample
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

    def rotate(self, m: Tensor, back: bool = False) -> Tensor:
        # (N, G, O, I') into the eigenbasis (Q_G^T m Q_A), or back (Q_G m Q_A^T)
        q_g, q_a = self.Q_G, self.Q_A
        if q_g is not None:
            q_g = q_g.to(m.dtype)
            m = (q_g if back else q_g.transpose(-1, -2)) @ m
        if q_a is not None:
            q_a = q_a.to(m.dtype)
            m = m @ (q_a.transpose(-1, -2) if back else q_a)
        return m

    def apply(self, m: Tensor, in_eigenbasis: bool = False) -> Tensor:
        """``H^-1 m`` for per-sample ``m`` ``(N, G, O, I')`` (``(N, P)`` for ``"diagonal"``;
        already rotated into the eigenbasis, ``Q_G^T m Q_A``, with ``in_eigenbasis``)."""
        if self.inverse is None:
            return m
        if self.kind == "diagonal":
            return m * self.inverse.to(m.dtype)
        m = m if in_eigenbasis else self.rotate(m)
        return self.rotate(m * self.inverse.to(m.dtype), back=True)

    def quadratic(self, m: Tensor, in_eigenbasis: bool = False) -> Tensor:
        """``(N,)`` ``m_n^T H^-1 m_n`` for per-sample ``m`` (as :meth:`apply`; already rotated
        into the eigenbasis with ``in_eigenbasis``)."""
        if self.inverse is None:
            return m.flatten(1).square().sum(1)
        if self.kind == "diagonal":
            return (m.square() * self.inverse.to(m.dtype)).sum(1)
        m = m if in_eigenbasis else self.rotate(m)
        return (m.square() * self.inverse.to(m.dtype)).flatten(1).sum(1)


_IDENTITY = BlockInverse("identity")


def damped(values: Tensor, damping: Damping, key: str) -> Tuple[Tensor, float]:
    """``(1 / (values + λ), λ)``, ``λ`` given or ``HEURISTIC_DAMPING * values.mean()``.

    Raises:
        ValueError: for a tuple ``damping`` (only KFAC blocks have two factors to damp).
    """
    if isinstance(damping, tuple):
        raise ValueError(f"block {key!r}: damping=(λ_A, λ_G) damps the two Kronecker factors "
                         f"of a KFAC entry; this block has none, give one float")
    lam = HEURISTIC_DAMPING * values.mean().item() if damping is None else float(damping)
    return 1.0 / (values + lam), lam


def _block(key: str, factor, damping: Damping) -> BlockInverse:
    if isinstance(factor, EKFACFactors):
        kf = factor.kfac
        one = (lambda t: t) if kf.groups > 1 else (lambda t: None if t is None else t[None])
        inverse, lam = damped(one(factor.scaling), damping, key)
        return BlockInverse("ekfac", kf.params, one(factor.Q_A), one(factor.Q_G), inverse, lam, kf)
    if isinstance(factor, KFACFactors):
        e_a, q_a = eigenbasis(factor.A, factor.diagonal_A, factor.groups)
        e_g, q_g = eigenbasis(factor.G, factor.diagonal_G, factor.groups)
        if isinstance(damping, tuple):
            lam_a, lam_g = (float(d) for d in damping)
            inverse = 1.0 / ((e_g + lam_g)[..., :, None] * (e_a + lam_a)[..., None, :])
            lam: Union[float, Tuple[float, float]] = (lam_a, lam_g)
        else:
            inverse, lam = damped(e_g[..., :, None] * e_a[..., None, :], damping, key)
        return BlockInverse("kfac", factor.params, q_a, q_g, inverse, lam, factor)
    if isinstance(factor, DiagonalFactors):
        inverse, lam = damped(torch.cat([t.flatten() for t in factor.diagonal.values()]),
                               damping, key)
        return BlockInverse("diagonal", factor.params, inverse=inverse, damping=lam)
    raise TypeError(f"factor {key!r}: expected KFACFactors, EKFACFactors or DiagonalFactors, "
                    f"got {type(factor).__name__}")


class Preconditioner:
    """``H^-1`` block by block (module docstring): :func:`preconditioner` or
    :meth:`~gradhooks.readers.attribution.factor_fit.FactorFit.preconditioner` make it.

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
            batches: :class:`~gradhooks.readers.attribution.factor_fit.FactorFit`.
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


class Term(NamedTuple):
    """One block of ``H`` as a batch's features hold it: ``block``, and the linear entry's
    ``path`` (records in :attr:`GradientFeatures.linear`) or ``None`` with the ``names`` of its
    dense parameters (:attr:`GradientFeatures.dense`)."""

    block: BlockInverse
    path: Optional[str]
    names: Tuple[str, ...]


def check_features(features: GradientFeatures, what: str) -> None:
    """Raise unless ``features`` are loss-gradient features (one backward pass).

    Raises:
        TypeError: for another type. GradHooksError: for Jacobian features (several passes).
    """
    if not isinstance(features, GradientFeatures):
        raise TypeError(f"{what}: expected GradientFeatures (gh.gradient_features()), got "
                        f"{type(features).__name__}")
    if features.passes != 1:
        raise GradHooksError(f"{what}: the features hold {features.passes} backward passes "
                             f"(Jacobian rows); influence scores take loss gradients "
                             f"(gh.gradient_features() after the loss's backward)")


def terms(pre: Preconditioner, features: GradientFeatures) -> Dict[str, Term]:
    """``{key: Term}``: the blocks of ``pre`` the batch's parameters take part in (module
    docstring), with ``missing="identity"`` an identity term per uncovered layer / parameter.

    Raises:
        GradHooksError: for a Kronecker block whose shape does not match the records.
    """
    out: Dict[str, Term] = {}
    for path, e in features.linear.items():
        b = pre.blocks.get(path)
        if b is not None and b.kind in STRATEGIES:
            want = tuple(b.inverse.shape)
            have = (e.a.shape[1], e.g.shape[-1], e.a.shape[-1])
            if want != have:
                raise GradHooksError(
                    f"block {path!r}: factors of shape (groups, O, I') = {want}, the records "
                    f"{have} (factors of another model, or of other parameters: a frozen bias?)")
            out[path] = Term(b, path, ())
        elif pre.missing == "identity":
            out[path] = Term(_IDENTITY, path, ())
    covered: set = set()
    for key, b in pre.blocks.items():
        if key in features.linear or not b.params or covered.intersection(b.params):
            continue  # (a parameter tied between two entries: the first one's)
        if all(n in features.dense for n in b.params):
            out[key] = Term(b, None, b.params)
            covered.update(b.params)
    if pre.missing == "identity":
        for name in features.dense:
            if name not in covered:
                out[name] = Term(_IDENTITY, None, (name,))
    return out


def block_rows(term: Term, features: GradientFeatures, chunk_numel: int,
               in_eigenbasis: bool = False) -> Iterator[Tuple[int, Tensor]]:
    """``(start, per-sample matrices)`` of the batch, ``(c, G, O, I')`` (``(c, P)`` for
    diagonal and identity blocks of dense parameters), ``c`` samples at a time (at most
    ``chunk_numel`` entries; dense parameters: all at once, they are held already); with
    ``in_eigenbasis``, ``Q_G^T m Q_A`` (for a linear layer from the records rotated first:
    ``S (O^2 + I'^2)`` multiply-adds a sample instead of the matrices' ``O I' (O + I')``)."""
    block = term.block
    if term.path is not None:
        e = features.linear[term.path]
        a, g = e.a, e.g[0]
        _, grp, _, i = a.shape
        step = max(1, chunk_numel // max(1, grp * g.shape[-1] * i))
        q_a, q_g = (block.Q_A, block.Q_G) if in_eigenbasis else (None, None)
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
        m = per_sample_matrices(block.layout, grads)
        yield 0, block.rotate(m) if in_eigenbasis else m
    else:
        yield 0, torch.cat([t.flatten(1) for t in grads.values()], 1)


