"""The curvature reads of :class:`~gradhooks.GradHooks`: KFAC / EKFAC factors, the GGN, the
empirical Fisher, per-sample Jacobians and the NTK (:mod:`gradhooks.readers.curvature`,
:mod:`gradhooks.readers.jacobians`, :mod:`gradhooks.readers.gram`). A mixin: its methods use the
facade's ``recorder``.
"""
from __future__ import annotations

from typing import Dict, Iterable, Mapping, Optional, Union

import torch
from torch import Tensor, nn

from ..core.recorder.capture import Recorder
from ..readers.curvature.ekfac import EKFACFactors, ekfac_factors
from ..readers.curvature.ggn import empirical_fisher_diag, ggn_diag, ggn_sqrt, ggn_vector_product
from ..readers.curvature.kfac import DiagonalFactors, KFACFactors, kfac_factors
from ..readers.gram import GradientFeatures, gram, jacobian_features
from ..readers.jacobians import per_sample_jacobians

__all__ = ["CurvatureReads"]


class CurvatureReads:
    """Curvature from the records: KFAC (Martens & Grosse 2015), EKFAC (George et al. 2018),
    GGN and Fisher, Jacobians and the NTK. Mixed into :class:`~gradhooks.GradHooks`."""

    recorder: Recorder  # (the facade's)

    def kfac_factors(self, kfac_approx: str = "expand", *, backward_passes: str = "sum",
                     modules: Optional[Iterable[str]] = None, max_dense: Optional[int] = None,
                     all_reduce: bool = False,
                     group: Optional[torch.distributed.ProcessGroup] = None, coverage: str = "all",
                     g_positions: str = "sum") -> Dict[str, Union[KFACFactors, DiagonalFactors]]:
        """KFAC factors of every hooked layer the backward reached: ``{key: KFACFactors}``
        (``A`` ``(d_in[+1], d_in[+1])``, ``G`` ``(d_out, d_out)``, stacked per group) for
        Linear, Conv, ConvTranspose, Embedding, attention projections and recurrent weights,
        and ``{module: DiagonalFactors}`` (the exact diagonal of the block) for every other
        layer. Arguments, keys, conventions (Martens & Grosse 2015; Grosse & Martens 2016;
        Eschenhagen et al. 2023; Martens, Ba & Johnson 2018) and errors:
        :func:`gradhooks.readers.curvature.kfac.kfac_factors` (``g_positions="mean"``: kronfluence's)."""
        return kfac_factors(self.recorder.snapshot("kfac_factors()", sum_check=False),
                            kfac_approx, backward_passes=backward_passes,
                            modules=modules, max_dense=max_dense, all_reduce=all_reduce,
                            group=group, coverage=coverage, g_positions=g_positions)

    def ekfac_factors(self, *, modules: Optional[Iterable[str]] = None, coverage: str = "all"
                      ) -> Dict[str, Union[EKFACFactors, DiagonalFactors]]:
        """Eigenvalue-corrected KFAC (George et al. 2018): ``EKFACFactors`` (eigenvectors
        ``Q_A`` ``(I', I')``, ``Q_G`` ``(O, O)`` of the KFAC factors, corrected eigenvalues
        ``(O, I')``) for each Kronecker entry of :meth:`kfac_factors`, ``DiagonalFactors`` for
        norms and the others; ``coverage="linear"``: Linear / Conv / ``Conv1D`` only. Conventions
        and errors: :func:`gradhooks.readers.curvature.ekfac.ekfac_factors`."""
        return ekfac_factors(self.recorder.snapshot("ekfac_factors()", sum_check=False),
                             modules=modules, coverage=coverage)

    def per_sample_jacobians(self, output: Tensor, *, flat: bool = False,
                             create_graph: bool = False) -> Union[Dict[str, Tensor], Tensor]:
        """Per-sample Jacobians of ``output`` ``(B, *S)`` w.r.t. the hooked trainable parameters:
        ``{name: (B, *S, *param.shape)}`` (or one ``(B, *S, P)`` tensor with ``flat=True``), from
        the forward that made ``output`` and one backward pass per coordinate of ``S``, which
        this call runs (call it before any backward pass of that forward); differentiable with
        ``create_graph=True`` (attach with ``differentiable=True``). Conventions and errors:
        :func:`gradhooks.readers.jacobians.per_sample_jacobians`."""
        return per_sample_jacobians(self.recorder, output, flat=flat, create_graph=create_graph)

    def ggn_sqrt(self, output: Tensor, loss_fn: nn.Module, *, mc_samples: int = 0,
                 generator: Optional[torch.Generator] = None) -> Dict[str, Tensor]:
        """The GGN's symmetric square root ``{name: (C, B, *param.shape)}`` (BackPACK's
        ``SqrtGGNExact``; ``SqrtGGNMC`` with ``mc_samples`` sampled labels) of
        ``loss_fn(output, y)``, from the forward that made ``output`` (call before any backward
        pass of it; it runs ``C`` or ``M``). Conventions and errors:
        :func:`gradhooks.readers.curvature.ggn.ggn_sqrt`."""
        return ggn_sqrt(self.recorder, output, loss_fn, mc_samples=mc_samples,
                        generator=generator)

    def ggn_diag(self, output: Tensor, loss_fn: nn.Module, *, per_sample: bool = False,
                 mc_samples: int = 0, generator: Optional[torch.Generator] = None
                 ) -> Dict[str, Tensor]:
        """The GGN's diagonal ``{name: (*param.shape)}`` (per sample: ``(B, *param.shape)``,
        the samples' shares) without the ``(C, B, *shape)`` square root; calling rules and
        conventions: :func:`gradhooks.readers.curvature.ggn.ggn_diag`."""
        return ggn_diag(self.recorder, output, loss_fn, per_sample=per_sample,
                        mc_samples=mc_samples, generator=generator)

    def ggn_vector_product(self, output: Tensor, loss_fn: nn.Module,
                           vector: Mapping[str, Tensor], *, mc_samples: int = 0,
                           generator: Optional[torch.Generator] = None) -> Dict[str, Tensor]:
        """``GGN v`` for ``vector`` ``{name: param-shaped tensor}``; calling rules and
        conventions: :func:`gradhooks.readers.curvature.ggn.ggn_vector_product`."""
        return ggn_vector_product(self.recorder, output, loss_fn, vector, mc_samples=mc_samples,
                                  generator=generator)

    def empirical_fisher_diag(self) -> Dict[str, Tensor]:
        """Diagonal of the empirical Fisher of the loss as reduced, ``w sum_n (grad l_n)^2``
        ``{name: (*param.shape)}``, after the loss's backward pass, with no per-sample tensor
        for Linear-like layers without weight sharing: :func:`gradhooks.readers.curvature.ggn.empirical_fisher_diag`."""
        return empirical_fisher_diag(self.recorder.snapshot("empirical_fisher_diag()",
                                                            sum_check=False))

    def jacobian_features(self, output: Tensor) -> GradientFeatures:
        """The per-sample Jacobians of ``output`` ``(B, C)`` in factored form (``C`` backward
        passes, run by this call before any other backward of the forward): keep them for
        :meth:`ntk` against a later batch. See :func:`gradhooks.readers.gram.jacobian_features`."""
        return jacobian_features(self.recorder, output)

    def ntk(self, output: Tensor, other: Optional[GradientFeatures] = None) -> Tensor:
        """The empirical NTK ``K[n, m, c, d] = <d f_c(x_n), d f_d(x_m)>`` ``(B, B, C, C)`` of
        ``output`` ``(B, C)`` (or ``(B, B2, C, C)`` against ``other``,
        :meth:`jacobian_features` of another batch), without the ``(B, C, P)`` Jacobian; runs
        ``C`` backward passes. Conventions: :func:`gradhooks.readers.gram.gram`."""
        return gram(jacobian_features(self.recorder, output), other)
