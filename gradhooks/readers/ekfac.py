"""The EKFAC reader: eigenvalue-corrected KFAC (George et al. 2018, "Fast Approximate Natural
Gradient Descent in a Kronecker-factored Eigenbasis", NeurIPS, arXiv:1806.03884, sec. 3).

Index conventions as in :mod:`gradhooks.kfac`: ``n`` sample, ``g`` group, ``s`` weight-sharing
position, ``i`` input feature (with the bias's ``1`` appended when the bias is covered: ``I'``),
``o`` output feature, ``p`` backward pass. With the KFAC factors ``A = Q_A diag(.) Q_A^T`` and
``G = Q_G diag(.) Q_G^T`` (``kfac_approx="expand"``, :func:`gradhooks.readers.kfac.kfac_factors`), EKFAC
keeps the Kronecker eigenbasis and replaces the Kronecker product of the eigenvalues by the
second moment of the per-sample gradients in that basis::

    M[p, n, g] = sum_s (Q_G[g]^T e[p, n, g, s]) (Q_A[g]^T ã[n, g, s])^T        (O, I')
    S[g] = w sum_p sum_n M[p, n, g] ** 2                                       (O, I')

with ``e`` the gradient of sample ``n``'s own loss w.r.t. the layer output in pass ``p`` and
``w`` the loss reduction's scale (``1/N`` for ``"mean"``, ``1`` for ``"sum"``), as KFAC's ``G``
carries it. The block of the Fisher / GGN for ``[W[g] b[g]]`` flattened row-major is then
``K diag(S[g].flatten()) K^T`` with ``K = torch.kron(Q_G[g], Q_A[g])``. The per-sample
gradients are formed only in the eigenbasis (the records projected before the product), never in
the parameters' own basis. With one sample and no weight sharing it is the exact Fisher block.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, Optional

import torch
from torch import Tensor

from ..base.forms import weight_grad
from ..base.utils import compute_dtype, no_autocast, own_loss_scale
from ..core.records import Batch
from .canonical import augmented, canonical
from .kfac import KFACFactors, kfac_factors

__all__ = ["EKFACFactors", "ekfac_factors"]


@dataclasses.dataclass(repr=False)
class EKFACFactors:
    """The eigenvalue-corrected Kronecker factors of one layer (module docstring).

    Attributes:
        kfac: the layer's :class:`~gradhooks.readers.kfac.KFACFactors` (``A``, ``G``, names, groups).
        Q_A: ``(I', I')`` eigenvectors of ``A`` as columns (``(groups, I', I')`` for grouped
            convolutions), ``I' = d_in[+1]``.
        Q_G: ``(O, O)`` eigenvectors of ``G`` (``(groups, O, O)``).
        scaling: ``(O, I')`` corrected eigenvalues ``S`` (``(groups, O, I')``), in the dtype
            of the records (at least float32).
    """

    kfac: KFACFactors
    Q_A: Tensor
    Q_G: Tensor
    scaling: Tensor

    def __repr__(self) -> str:
        return (f"EKFACFactors(module={self.kfac.module!r}, Q_A={tuple(self.Q_A.shape)}, "
                f"Q_G={tuple(self.Q_G.shape)}, scaling={tuple(self.scaling.shape)})")

    def block(self, group: int = 0) -> Tensor:
        """The ``(O I', O I')`` approximation of the Fisher / GGN block of ``[W[g] b[g]]``
        flattened row-major: ``K diag(S.flatten()) K^T``, ``K = kron(Q_G, Q_A)``."""
        qa, qg, s = (t if t.dim() == 2 else t[group] for t in (self.Q_A, self.Q_G, self.scaling))
        k = torch.kron(qg, qa)
        return (k * s.reshape(-1)) @ k.t()


def ekfac_factors(batch: Batch, *, modules: Optional[Iterable[str]] = None
                  ) -> Dict[str, EKFACFactors]:
    """EKFAC factors of every layer with a linear form the backward reached (Linear, Conv,
    transformers' Conv1D), after one or more backward passes of the current batch.

    Args:
        batch: ``recorder.snapshot("ekfac_factors()", sum_check=False)`` (called as
            ``gh.ekfac_factors()``).
        modules: names of the modules wanted (default: all), as for
            :func:`gradhooks.readers.kfac.kfac_factors`.

    Returns:
        ``{module name: EKFACFactors}`` in ``model.named_modules()`` order. Each backward pass
        adds its per-sample second moments (one pass with the loss: the empirical Fisher; one per
        column of the loss Hessian's square root: the GGN, as :func:`gradhooks.readers.kfac.kfac_factors`
        with ``backward_passes="sum"``).

    Raises:
        The errors of :func:`gradhooks.readers.kfac.kfac_factors` (``NoBackwardError`` ...), which
        this calls first (``kfac_approx="expand"``, dense factors).
    """
    factors = kfac_factors(batch, "expand", modules=modules, coverage="linear")
    wanted = set(factors)
    records = [cap for cap in batch.records if cap.layer.path in wanted and cap.spec is None]
    w = 1.0 / (own_loss_scale(batch.loss_reduction, batch.size) or 1.0)
    out: Dict[str, EKFACFactors] = {}
    with no_autocast():
        for path, kf in factors.items():
            eig_a, q_a = torch.linalg.eigh(kf.A if kf.groups > 1 else kf.A[None])
            eig_g, q_g = torch.linalg.eigh(kf.G if kf.groups > 1 else kf.G[None])
            passes: Dict[int, Tensor] = {}  # pass -> (N, groups, O, I') summed over calls
            for cap in records:
                if cap.layer.path != path:
                    continue
                layer = cap.layer
                dt = compute_dtype(cap.a, *cap.grads)  # (one dtype for all passes)
                a, g = canonical(layer, cap.a, cap.grads[0], batch.batch_first,
                                 form_a=kf.weight is not None, dtype=dt)
                a = augmented(a, g, kf.bias is not None)  # (N, groups, S, I')
                a_e = a @ q_a.to(dt)  # in the eigenbasis
                for k, g in enumerate(cap.grads):
                    _, g = canonical(layer, None, g, batch.batch_first, dtype=dt)
                    m = weight_grad(a_e, (g @ q_g.to(dt)) * batch.factor)  # (N, groups, O, I')
                    passes[k] = m if k not in passes else passes[k].add_(m)
            scaling = sum(m.square().sum(0) for m in passes.values()) * w
            if kf.groups == 1:
                q_a, q_g, scaling = q_a[0], q_g[0], scaling[0]
            out[path] = EKFACFactors(kf, q_a, q_g, scaling)
    return out
