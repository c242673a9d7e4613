"""The gradient-feature reads of :class:`~gradhooks.GradHooks`: the batch's per-sample
gradients in factored form, their Gram matrix and their random projections, the inputs of data
attribution (:mod:`gradhooks.readers.gram`, :mod:`gradhooks.readers.attribution`, whose
functions take these results). A mixin: its methods use the facade's ``recorder``.
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from ..core.recorder.capture import Recorder
from ..readers.attribution.projections import projected_grads
from ..readers.gram import GradientFeatures, gradient_features, gram

__all__ = ["FeatureReads"]


class FeatureReads:
    """Per-sample gradients as features (Gram matrices, LoGra projections) for data
    attribution. Mixed into :class:`~gradhooks.GradHooks`."""

    recorder: Recorder  # (the facade's)

    def gradient_features(self) -> GradientFeatures:
        """This batch's per-sample loss gradients in factored form (the layers' ``a`` and ``g``,
        per-sample tensors only for layers without a linear form), after its backward pass:
        keep them to form :meth:`gram` against a later batch. See
        :func:`gradhooks.readers.gram.gradient_features`."""
        return gradient_features(self.recorder.snapshot("gradient_features()", sum_check=False))

    def gram(self, other: Optional[GradientFeatures] = None) -> Tensor:
        """The Gram matrix ``<grad l_n, grad l_m>`` of this batch's per-sample loss gradients,
        ``(B, B)``, or ``(B, B2)`` against ``other`` (:meth:`gradient_features` of another
        batch), without forming them (Gram form per layer). Conventions:
        :func:`gradhooks.readers.gram.gram`."""
        return gram(gradient_features(self.recorder.snapshot("gradient_features()",
                                                          sum_check=False)), other)

    def projected_grads(self, k_in: int = 16, k_out: int = 16, seed: int = 0) -> Tensor:
        """``(B, K)`` per-sample loss gradients under fixed random projections of each layer's
        ``a`` and ``g`` applied before the outer product (LoGra, arXiv:2405.13954), never
        forming ``(B, P)``; reproducible from ``seed``. See
        :func:`gradhooks.readers.attribution.projections.projected_grads`."""
        return projected_grads(self.recorder.snapshot("gradient_features()", sum_check=False),
                               k_in, k_out, seed)
