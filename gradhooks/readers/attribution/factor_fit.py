"""KFAC / EKFAC factors fitted over many batches (:class:`FactorFit`), for the influence scores
of :mod:`gradhooks.readers.attribution.influence_scores`: kronfluence's ``fit_covariance_matrices``,
``perform_eigendecomposition`` and ``fit_lambda_matrices``, from the batches'
:class:`~gradhooks.readers.gram.GradientFeatures` (and, for the layers without records in
canonical form, their ``gh.kfac_factors()``).

Index conventions as :mod:`gradhooks.readers.attribution.influence_scores`. Convention: the mean over samples
(kronfluence's; ``gh.kfac_factors()`` / ``gh.ekfac_factors()`` with ``loss_reduction="mean"`` on
one batch)::

    A = sum_{n,s} ã ã^T / (N S)     G = sum_n sum_s e e^T / N     S = sum_n (Q_G^T g_n Q_A)^2 / N

(``FactorFit(g_positions="mean")``: ``G = sum_n sum_s e e^T / (N S)``, kronfluence's exactly:
its gradient covariance is divided by the number of tokens, not of samples.)

``e`` the gradient of sample ``n``'s own loss w.r.t. the layer output (kfac-expand), ``g_n`` the
``[W b]`` gradient of its own loss.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ...base.errors import GradHooksError
from ...base.utils import no_autocast
from ..curvature.ekfac import EIGH_DTYPE, EKFACFactors, eigenbasis
from ..curvature.kfac import G_POSITIONS, check_choice
from ..curvature.kfac_results import DiagonalFactors, KFACFactors
from ..gram import GradientFeatures
from .influence_blocks import (
    CHUNK_NUMEL,
    STRATEGIES,
    BlockInverse,
    Damping,
    Preconditioner,
    Term,
    block_rows,
    check_features,
    damped,
)

__all__ = ["FactorFit"]

_FORMAT = 1  # (of FactorFit.save's files)


class FactorFit:
    """KFAC / EKFAC factors accumulated over many batches, in two passes over the data::

        fit = FactorFit()
        for x, y in loader:                       # pass 1: A and G
            ...; loss.backward(); fit.add_covariances(gh.gradient_features()); gh.clear()
        for x, y in loader:                       # pass 2 (EKFAC only): S in the eigenbasis
            ...; loss.backward(); fit.add_eigenvalues(gh.gradient_features()); gh.clear()
        pre = fit.preconditioner("ekfac")

    Which layers: those whose records the features hold in canonical form (Linear, Conv,
    ``Conv1D``: ``A`` and ``G`` from the records, the module docstring's sums). With
    ``add_covariances(features, factors=gh.kfac_factors())`` also the other parameters (the
    features' dense per-sample gradients): a Kronecker entry (Embedding, attention projections,
    recurrent weights) adds its ``A`` and ``G`` weighted by the batch's ``N`` (exact when every
    sample has the same number of positions, e.g. sequences of one length), and EKFAC's ``S``
    from the per-sample gradients rotated into the eigenbasis; a diagonal entry (norm layers) its
    exact diagonal ``sum_n dθ_n^2 / N``, used under both strategies (:attr:`Preconditioner.kinds`
    says ``"diagonal"``). The eigenbasis is fixed by the first :meth:`add_eigenvalues` (or
    :meth:`preconditioner`) call, eigendecomposed in ``eigh_dtype`` (float64: kronfluence's); the
    sums are kept in float64, the eigenvectors and ``1 / (S + λ)`` in the features' dtype (as
    kronfluence casts them back to its factors' dtype).

    Args:
        chunk_numel: how many entries of per-sample matrices are formed at a time.
        eigh_dtype: dtype of the eigendecomposition.
        g_positions: ``"sum"`` (default; ``gh.kfac_factors()``'s ``G``) or ``"mean"``: the
            records' ``G`` averaged over the positions per sample ``S`` (kronfluence's KFAC; the
            module docstring). For the dense Kronecker entries the ``factors`` given to
            :meth:`add_covariances` decide (:func:`~gradhooks.readers.attribution.loaders.fit_factors`
            reads them with the same ``g_positions``). EKFAC's scores do not depend on it.

    Raises:
        ValueError: for an unknown ``g_positions``.
    """

    def __init__(self, chunk_numel: int = CHUNK_NUMEL, eigh_dtype: torch.dtype = EIGH_DTYPE,
                 g_positions: str = "sum"):
        check_choice("g_positions", g_positions, G_POSITIONS)
        self.chunk_numel, self.eigh_dtype, self.g_positions = chunk_numel, eigh_dtype, g_positions
        self._a: Dict[str, Tensor] = {}
        self._g: Dict[str, Tensor] = {}
        self._count: Dict[str, Tuple[int, int]] = {}  # samples, positions
        self._layout: Dict[str, KFACFactors] = {}  # dense Kronecker entries (A, G as N-weighted sums)
        self._diag: Dict[str, List] = {}  # dense diagonal entries: [{name: sum}, samples]
        self._eigen: Optional[Dict[str, Tuple[Tensor, Optional[Tensor], Tensor,
                                              Optional[Tensor]]]] = None
        self._s: Dict[str, Tensor] = {}
        self._s_count: Dict[str, int] = {}
        self._dtype: Optional[torch.dtype] = None  # the features': Q and 1 / (S + λ) kept in it

    def save(self, path) -> None:
        """Write the fitted factors (sums, counts, eigenbasis, corrected eigenvalues) to
        ``path`` (``torch.save``), to score later or in another process (kronfluence saves its
        factors likewise); :meth:`load` reads them back."""
        torch.save({"format": _FORMAT, "state": dict(vars(self))}, path)

    @classmethod
    def load(cls, path, map_location=None) -> "FactorFit":
        """The :class:`FactorFit` :meth:`save` wrote to ``path`` (``torch.load`` with
        ``weights_only=True``: tensors, numbers and the factor classes only).

        Raises:
            GradHooksError: for a file of another format."""
        with torch.serialization.safe_globals([KFACFactors, DiagonalFactors]):
            blob = torch.load(path, map_location=map_location, weights_only=True)
        if not isinstance(blob, dict) or blob.get("format") != _FORMAT:
            raise GradHooksError(f"FactorFit.load({path!r}): not a file FactorFit.save wrote")
        fit = cls.__new__(cls)
        fit.g_positions = "sum"  # (files saved before g_positions existed)
        fit.__dict__.update(blob["state"])
        return fit

    def __repr__(self) -> str:
        return (f"FactorFit(layers={list(self._count)}, diagonal={list(self._diag)}, "
                f"samples={dict(self._count)}, eigenvalue samples={self._s_count})")

    def add_covariances(self, features: GradientFeatures, factors: Optional[dict] = None) -> None:
        """Pass 1: add a batch's ``ã ã^T`` and ``e e^T`` sums (its linear layers' records).

        Args:
            features: ``gh.gradient_features()`` of the batch.
            factors: ``gh.kfac_factors()`` of the same batch (``loss_reduction="mean"``), for the
                entries whose parameters the features hold as dense per-sample gradients (class
                docstring); ``None``: the linear layers only.

        Raises:
            GradHooksError: after the eigenbasis was fixed; for Jacobian features.
            TypeError: for a factor entry of another type.
        """
        check_features(features, "FactorFit.add_covariances()")
        if self._eigen is not None:
            raise GradHooksError("FactorFit.add_covariances() after the eigenbasis was fixed "
                                 "(add_eigenvalues / preconditioner): start a new FactorFit")
        n = features.size
        if self._dtype is None:
            held = [e.a for e in features.linear.values()] + list(features.dense.values())
            self._dtype = held[0].dtype if held else None
        with no_autocast(), torch.no_grad():
            for path, e in features.linear.items():
                a, g = e.a, e.g[0]
                sa = torch.einsum("ngsi,ngsj->gij", a, a).double()  # (sums in float64)
                sg = torch.einsum("ngso,ngsp->gop", g, g).double()
                if path in self._a:
                    self._a[path] += sa
                    self._g[path] += sg
                    c, r = self._count[path]
                    self._count[path] = (c + n, r + n * a.shape[2])
                else:
                    self._a[path], self._g[path] = sa, sg
                    self._count[path] = (n, n * a.shape[2])
            for key, f in (factors or {}).items():
                self._add_factor(key, f.kfac if isinstance(f, EKFACFactors) else f, features)

    def _add_factor(self, key: str, f, features: GradientFeatures) -> None:
        # a dense entry's N-weighted factors (A, G or the diagonal), in float64
        if not isinstance(f, (KFACFactors, DiagonalFactors)):
            raise TypeError(f"factor {key!r}: expected KFACFactors or DiagonalFactors, got "
                            f"{type(f).__name__}")
        n = features.size
        if key in features.linear or not all(p in features.dense for p in f.params):
            return  # (records of a linear layer, or parameters this batch does not hold)
        if isinstance(f, DiagonalFactors):
            sums = {p: d.double() * n for p, d in f.diagonal.items()}
            if key in self._diag:
                for p, t in sums.items():
                    self._diag[key][0][p] += t
                self._diag[key][1] += n
            else:
                self._diag[key] = [sums, n]
            return
        prev = self._layout.get(key)
        a, g = f.A.double() * n, f.G.double() * n
        if prev is not None:
            a, g = a + prev.A, g + prev.G
        count = n + (self._count[key][0] if prev is not None else 0)
        self._layout[key] = KFACFactors(a, g, f.module, f.weight, f.bias, f.weight_shape, f.groups,
                                        f.kfac_approx, f.diagonal_A, f.diagonal_G,
                                        f.weight_transposed, f.part, f.bias_shape)
        self._count[key] = (count, count)

    def _basis(self):
        # {key: (eigenvalues of A, Q_A, eigenvalues of G, Q_G)}, (G, .) leading dims, fixed on
        # first use
        if self._eigen is None:
            samples = [n for n, _ in self._count.values()] + [n for _, n in self._diag.values()]
            if not samples or min(samples) == 0:
                raise GradHooksError("FactorFit: no sample was added by add_covariances()")
            self._eigen = {}
            for path, sa in self._a.items():
                n, r = self._count[path]
                # (sa: (G, I', I') with its group dim: eigenbasis keeps it for groups > 1)
                e_a, q_a = eigenbasis(sa / r, False, sa.shape[0] + 1, self.eigh_dtype)
                per = r if self.g_positions == "mean" else n
                e_g, q_g = eigenbasis(self._g[path] / per, False, sa.shape[0] + 1, self.eigh_dtype)
                self._eigen[path] = (e_a, self._cast(q_a), e_g, self._cast(q_g))
            self._a, self._g = {}, {}  # (the sums are not needed any more: free them)
            for key, kf in self._layout.items():
                n = self._count[key][0]
                e_a, q_a = eigenbasis(kf.A / n, kf.diagonal_A, kf.groups, self.eigh_dtype)
                e_g, q_g = eigenbasis(kf.G / n, kf.diagonal_G, kf.groups, self.eigh_dtype)
                self._eigen[key] = (e_a, self._cast(q_a), e_g, self._cast(q_g))
        return self._eigen

    def _cast(self, t: Optional[Tensor]) -> Optional[Tensor]:
        # eigenvectors / inverses in the features' dtype (kronfluence keeps its factors' dtype)
        return t if t is None or self._dtype is None else t.to(self._dtype)

    def add_eigenvalues(self, features: GradientFeatures) -> None:
        """Pass 2 (EKFAC): add a batch's squared per-sample gradients in the eigenbasis.

        Raises:
            GradHooksError: for a linear layer without covariances from pass 1, or before any.
        """
        check_features(features, "FactorFit.add_eigenvalues()")
        basis = self._basis()
        with no_autocast(), torch.no_grad():
            for path in features.linear:
                if path not in basis:
                    raise GradHooksError(f"FactorFit.add_eigenvalues(): layer {path!r} had no "
                                         f"covariances added in the first pass")
            for key, (_, q_a, _, q_g) in basis.items():
                layout = self._layout.get(key)
                if layout is not None:
                    if not all(p in features.dense for p in layout.params):
                        continue
                    term = Term(BlockInverse("ekfac", Q_A=q_a, Q_G=q_g, layout=layout), None,
                                layout.params)
                elif key in features.linear:
                    term = Term(BlockInverse("ekfac", Q_A=q_a, Q_G=q_g), key, ())
                else:
                    continue
                e = features.linear.get(key)
                if e is not None and e.a.shape[2] == 1:  # sum_n (g'_n)^2 (a'_n)^2T: no matrices
                    a2 = (e.a[:, :, 0] @ q_a.to(e.a.dtype)).square()
                    g2 = (e.g[0, :, :, 0] @ q_g.to(e.a.dtype)).square()
                    sums = [torch.einsum("ngo,ngi->goi", g2, a2)]
                else:
                    sums = [m.square().sum(0) for _, m in
                            block_rows(term, features, self.chunk_numel, in_eigenbasis=True)]
                for t in sums:
                    t = t.double()
                    self._s[key] = t if key not in self._s else self._s[key] + t
                self._s_count[key] = self._s_count.get(key, 0) + features.size

    def preconditioner(self, strategy: str = "ekfac", *, damping: Damping = None,
                       missing: str = "skip") -> Preconditioner:
        """``H^-1`` of the fitted factors (:mod:`gradhooks.readers.attribution.influence_blocks`).

        Args:
            strategy: ``"ekfac"`` (needs :meth:`add_eigenvalues`) or ``"kfac"``.
            damping, missing: as :func:`~gradhooks.readers.attribution.influence_blocks.preconditioner`.

        Raises:
            ValueError: for an unknown strategy / missing, or a tuple damping with EKFAC or
                diagonal blocks.
            GradHooksError: before any :meth:`add_covariances`; for EKFAC, a layer without
                :meth:`add_eigenvalues`.
        """
        check_choice("strategy", strategy, STRATEGIES)
        blocks = {}
        with no_autocast(), torch.no_grad():
            for key, (e_a, q_a, e_g, q_g) in self._basis().items():
                if strategy == "ekfac":
                    if not self._s_count.get(key):
                        raise GradHooksError(f"FactorFit.preconditioner('ekfac'): layer {key!r} "
                                             f"has no eigenvalues: call add_eigenvalues() first")
                    inverse, lam = damped(self._s[key] / self._s_count[key], damping, key)
                elif isinstance(damping, tuple):
                    lam = (float(damping[0]), float(damping[1]))
                    inverse = 1.0 / ((e_g + lam[1])[..., :, None] * (e_a + lam[0])[..., None, :])
                else:
                    inverse, lam = damped(e_g[..., :, None] * e_a[..., None, :], damping, key)
                layout = self._layout.get(key)
                blocks[key] = BlockInverse(strategy, () if layout is None else layout.params,
                                           q_a, q_g, self._cast(inverse), lam, layout)
            for key, (sums, n) in self._diag.items():
                inverse, lam = damped(torch.cat([t.flatten() for t in sums.values()]) / n,
                                      damping, key)
                blocks[key] = BlockInverse("diagonal", tuple(sums), inverse=self._cast(inverse),
                                           damping=lam)
        return Preconditioner(blocks, missing)
