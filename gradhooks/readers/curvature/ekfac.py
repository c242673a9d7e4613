"""The EKFAC reader: eigenvalue-corrected KFAC (George et al. 2018, "Fast Approximate Natural
Gradient Descent in a Kronecker-factored Eigenbasis", NeurIPS, arXiv:1806.03884, sec. 3).

Index conventions as in :mod:`gradhooks.kfac`: ``n`` sample, ``g`` group, ``s`` weight-sharing
position, ``i`` input feature (with the bias's ``1`` appended when the bias is covered: ``I'``),
``o`` output feature, ``p`` backward pass. With the KFAC factors ``A = Q_A diag(.) Q_A^T`` and
``G = Q_G diag(.) Q_G^T`` (``kfac_approx="expand"``, :func:`gradhooks.readers.curvature.kfac.kfac_factors`), EKFAC
keeps the Kronecker eigenbasis and replaces the Kronecker product of the eigenvalues by the
second moment of the per-sample gradients in that basis::

    M[p, n, g] = Q_G[g]^T dW[p, n, g] Q_A[g]                                   (O, I')
    S[g] = w sum_p sum_n M[p, n, g] ** 2                                       (O, I')

with ``dW[p, n, g]`` the ``[W[g] b[g]]`` gradient of sample ``n``'s *own* loss in pass ``p`` and
``w`` the loss reduction's scale (``1/N`` for ``"mean"``, ``1`` for ``"sum"``), as KFAC's ``G``
carries it. The block of the Fisher / GGN for ``[W[g] b[g]]`` flattened row-major is then
``K diag(S[g].flatten()) K^T`` with ``K = torch.kron(Q_G[g], Q_A[g])``. With one sample and no
weight sharing it is the exact Fisher block.

Which layers, and how ``M`` is formed (:attr:`EKFACFactors.source`):

* layers linear in their weight (Linear, Conv, transformers' ``Conv1D``): from the records,
  ``M = sum_s (Q_G^T e[p,n,g,s]) (Q_A^T ã[n,g,s])^T``, the records projected before the product,
  never formed in the parameters' own basis (``"records"``);
* the other layers with a Kronecker entry in ``kfac_factors(coverage="all")`` (``nn.Embedding``,
  the projections of ``nn.MultiheadAttention``, the weights of LSTM / GRU / RNN,
  ``nn.ConvTranspose``): from the per-sample gradients of the entry's parameters (their module's
  rule, :func:`~gradhooks.readers.jacobians.pass_grads`), rotated (``"per-sample"``; ``B P``
  entries for the module: an embedding's ``(B, V, D)``). A factor KFAC stores as its diagonal
  (an Embedding's ``A``) is its own eigenbasis: ``Q_A`` is ``None``, the identity;
* every other layer (norms, ``nn.EmbeddingBag``, the fallback): the exact diagonal block of the
  empirical Fisher / GGN, ``w sum_p sum_n dθ_n^2``, as :class:`~gradhooks.readers.curvature.kfac_results.DiagonalFactors`
  (the diagonal approximation is exact on its own terms, so no correction applies).

Eigendecomposition: as kronfluence's ``perform_eigendecomposition``, of the symmetrised factor
``(F + F^T) / 2`` in ``eigh_dtype`` (default float64: in float32 the eigenvectors of an
ill-conditioned ``A`` and so the scores differ from kronfluence's by about 300 times more), the
eigenvectors then cast back to the factor's dtype.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, Mapping, Optional, Tuple, Union

import torch
from torch import Tensor

from ...base._pool import using_pool
from ...base.forms import weight_grad
from ...base.utils import compute_dtype, no_autocast, own_loss_scale
from ...core.recorder.records import Batch, Layer
from ..canonical import augmented, canonical
from ..jacobians import pass_grads
from ..passes import PassCall
from .kfac import COVERAGE, check_choice, kfac_factors
from .kfac_results import DiagonalFactors, KFACFactors

__all__ = ["EKFACFactors", "ekfac_factors", "per_sample_matrices", "eigenbasis",
           "EIGH_DTYPE"]

#: Default dtype of the factors' eigendecomposition (kronfluence's ``eigendecomposition_dtype``).
EIGH_DTYPE = torch.float64


@dataclasses.dataclass(repr=False)
class EKFACFactors:
    """The eigenvalue-corrected Kronecker factors of one block of parameters (module docstring).

    Attributes:
        kfac: the block's :class:`~gradhooks.readers.curvature.kfac.KFACFactors` (``A``, ``G``, names,
            groups, the layout of :meth:`~gradhooks.readers.curvature.kfac_results.KFACFactors.grad_matrix`).
        Q_A: ``(I', I')`` eigenvectors of ``A`` as columns (``(groups, I', I')`` for grouped
            convolutions), ``I' = d_in[+1]``; ``None`` when ``A`` is kept diagonal (an
            Embedding's): the identity.
        Q_G: ``(O, O)`` eigenvectors of ``G`` (``(groups, O, O)``); ``None`` for a diagonal ``G``.
        scaling: ``(O, I')`` corrected eigenvalues ``S`` (``(groups, O, I')``), in the dtype
            of the records (at least float32).
        source: ``"records"`` (linear layers) or ``"per-sample"`` (the others): how ``S`` was
            formed (module docstring).
    """

    kfac: KFACFactors
    Q_A: Optional[Tensor]
    Q_G: Optional[Tensor]
    scaling: Tensor
    source: str = "records"

    def __repr__(self) -> str:
        shape = lambda t: None if t is None else tuple(t.shape)  # noqa: E731
        return (f"EKFACFactors(key={self.kfac.module + ('.' + self.kfac.part if self.kfac.part else '')!r}, "
                f"Q_A={shape(self.Q_A)}, Q_G={shape(self.Q_G)}, scaling={shape(self.scaling)}, "
                f"source={self.source!r})")

    def block(self, group: int = 0) -> Tensor:
        """The ``(O I', O I')`` approximation of the Fisher / GGN block of ``[W[g] b[g]]``
        flattened row-major: ``K diag(S.flatten()) K^T``, ``K = kron(Q_G, Q_A)`` (a ``None``
        eigenbasis: the identity)."""
        s = self.scaling if self.scaling.dim() == 2 else self.scaling[group]
        qa, qg = ((torch.eye(n, dtype=s.dtype, device=s.device) if t is None else
                   t if t.dim() == 2 else t[group])
                  for t, n in ((self.Q_A, s.shape[1]), (self.Q_G, s.shape[0])))
        k = torch.kron(qg, qa)
        return (k * s.reshape(-1)) @ k.t()


def eigenbasis(factor: Tensor, diagonal: bool, groups: int, eigh_dtype: torch.dtype = EIGH_DTYPE
               ) -> Tuple[Tensor, Optional[Tensor]]:
    """Eigenvalues ``(G, d)`` and eigenvectors ``(G, d, d)`` (columns) of a KFAC factor, with a
    leading group dim even for ``groups == 1``; for a factor stored as its diagonal (``diagonal``)
    the diagonal itself and ``None`` (the identity). Of ``(F + F^T) / 2`` in ``eigh_dtype``, cast
    back to ``factor.dtype`` (kronfluence's ``perform_eigendecomposition``)."""
    factor = factor if groups > 1 else factor[None]
    if diagonal:
        return factor, None
    f = factor.to(eigh_dtype)
    values, vectors = torch.linalg.eigh((f + f.transpose(-1, -2)) / 2)
    return values.to(factor.dtype), vectors.to(factor.dtype).contiguous()


def per_sample_matrices(kf: KFACFactors, grads: Mapping[str, Tensor]) -> Tensor:
    """Per-sample gradients as the matrices ``[W b]`` the factors act on: the batched
    :meth:`~gradhooks.readers.curvature.kfac_results.KFACFactors.grad_matrix`.

    Args:
        kf: the block's factors (its layout: groups, a weight stored transposed, the bias).
        grads: ``{name: (N, *param.shape)}`` holding at least ``kf.params``.

    Returns:
        ``(N, groups, O, I')`` (``groups`` dim kept for ``groups == 1``), the bias last column.

    Raises:
        KeyError: if a covered parameter is missing from ``grads``.
    """
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


def _rotated(m: Tensor, q_a: Optional[Tensor], q_g: Optional[Tensor]) -> Tensor:
    # (N, G, O, I') -> Q_G^T m Q_A (a None basis: the identity)
    if q_g is not None:
        m = q_g.transpose(-1, -2).to(m.dtype) @ m
    return m if q_a is None else m @ q_a.to(m.dtype)


def _linear_records(layer: Layer) -> bool:
    # the layers whose records are in canonical (a, g) form (kfac's coverage="linear")
    return layer.rule.has_linear_form and not layer.rule.multi_io and "weight" in layer.params


def _module_grads(batch: Batch, module: str) -> Dict[int, Dict[str, Tensor]]:
    # {pass: {param name: (N, *shape)}} own-loss per-sample gradients of one module's params
    caps = [cap for cap in batch.records if cap.layer.path == module]
    passes = max((len(cap.grads) for cap in caps if cap.spec is None), default=1)
    out = {}
    for p in range(passes):
        calls = [PassCall(cap.layer, cap.a, cap.grad_struct() if cap.spec is not None
                          else [cap.grads[p]], cap.names)
                 for cap in caps if cap.spec is not None or p < len(cap.grads)]
        with using_pool(batch.pool):
            got = pass_grads(calls, batch.batch_first, batch.scale)
        out[p] = {batch.names[pid]: t for pid, t in got.items()}
    return out


def ekfac_factors(batch: Batch, *, modules: Optional[Iterable[str]] = None,
                  coverage: str = "all", eigh_dtype: torch.dtype = EIGH_DTYPE
                  ) -> Dict[str, Union[EKFACFactors, DiagonalFactors]]:
    """EKFAC factors of every layer the backward reached, after one or more backward passes of
    the current batch: Kronecker eigenbasis and corrected eigenvalues for every Kronecker entry of
    :func:`~gradhooks.readers.curvature.kfac.kfac_factors`, the exact diagonal block for the others
    (module docstring).

    Args:
        batch: ``recorder.snapshot("ekfac_factors()", sum_check=False)`` (called as
            ``gh.ekfac_factors()``).
        modules: names of the modules wanted (default: all), as for
            :func:`gradhooks.readers.curvature.kfac.kfac_factors`.
        coverage: ``"all"`` (default) or ``"linear"``: only the layers linear in their weight
            (Linear, Conv, ``Conv1D``; kronfluence's coverage, and this reader's before
            embeddings, attention, recurrent and norm layers were added).
        eigh_dtype: dtype of the eigendecomposition (default float64, as kronfluence).

    Returns:
        ``{key: EKFACFactors or DiagonalFactors}``, keyed and ordered as ``kfac_factors``
        (``"<module>.<first parameter>"`` for the several blocks of an attention or recurrent
        module). Each backward pass adds its per-sample second moments (one pass with the loss:
        the empirical Fisher; one per column of the loss Hessian's square root: the GGN, as
        :func:`gradhooks.readers.curvature.kfac.kfac_factors` with ``backward_passes="sum"``).

    Raises:
        ValueError: for an unknown ``coverage``.
        The errors of :func:`gradhooks.readers.curvature.kfac.kfac_factors` (``NoBackwardError`` ...), which
        this calls first (``kfac_approx="expand"``, dense factors).
    """
    check_choice("coverage", coverage, COVERAGE)
    factors = kfac_factors(batch, "expand", modules=modules, coverage=coverage)
    linear = {cap.layer.path for cap in batch.records
              if cap.spec is None and _linear_records(cap.layer)}
    w = 1.0 / (own_loss_scale(batch.loss_reduction, batch.size) or 1.0)
    out: Dict[str, Union[EKFACFactors, DiagonalFactors]] = {}
    grads: Dict[str, Dict[int, Dict[str, Tensor]]] = {}  # module -> per-sample grads per pass
    with no_autocast(), torch.no_grad():
        for key, kf in factors.items():
            if isinstance(kf, DiagonalFactors):
                out[key] = kf
                continue
            _, q_a = eigenbasis(kf.A, kf.diagonal_A, kf.groups, eigh_dtype)
            _, q_g = eigenbasis(kf.G, kf.diagonal_G, kf.groups, eigh_dtype)
            if key in linear and not kf.part:
                scaling, source = _from_records(batch, key, kf, q_a, q_g), "records"
            else:
                if kf.module not in grads:
                    grads[kf.module] = _module_grads(batch, kf.module)
                scaling = sum(_rotated(per_sample_matrices(kf, g), q_a, q_g).square().sum(0)
                              for g in grads[kf.module].values())
                source = "per-sample"
            scaling = scaling * w
            if kf.groups == 1:
                q_a, q_g, scaling = (None if q_a is None else q_a[0],
                                     None if q_g is None else q_g[0], scaling[0])
            out[key] = EKFACFactors(kf, q_a, q_g, scaling, source)
    return out


def _from_records(batch: Batch, path: str, kf: KFACFactors, q_a: Optional[Tensor],
                  q_g: Optional[Tensor]) -> Tensor:
    # sum_p sum_n M[p, n]^2 (groups, O, I') of a linear layer, from its canonical records
    passes: Dict[int, Tensor] = {}  # pass -> (N, groups, O, I') summed over calls
    for cap in batch.records:
        if cap.layer.path != path or cap.spec is not None:
            continue
        layer = cap.layer
        dt = compute_dtype(cap.a, *cap.grads)  # (one dtype for all passes)
        a, g = canonical(layer, cap.a, cap.grads[0], batch.batch_first,
                         form_a=kf.weight is not None, dtype=dt)
        a = augmented(a, g, kf.bias is not None)  # (N, groups, S, I')
        a_e = a if q_a is None else a @ q_a.to(dt)  # in the eigenbasis
        for k, g in enumerate(cap.grads):
            _, g = canonical(layer, None, g, batch.batch_first, dtype=dt)
            g = g if q_g is None else g @ q_g.to(dt)
            m = weight_grad(a_e, g * batch.factor)  # (N, groups, O, I')
            passes[k] = m if k not in passes else passes[k].add_(m)
    return sum(m.square().sum(0) for m in passes.values())
