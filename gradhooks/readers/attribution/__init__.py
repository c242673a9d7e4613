"""Training-data attribution from the records (``gradhooks.attribution``, its public name).

Lives here: influence scores ``q_m^T H^-1 g_n`` and self-influence with identity, KFAC or EKFAC
blocks (``influence_scores``: ``query_gradients``, ``pairwise_scores`` (per token too),
``self_scores``), the blocks ``H^-1`` (``influence_blocks``: ``preconditioner``,
``Preconditioner``, ``BlockInverse``) and their fit over many batches (``factor_fit``:
``FactorFit``, with ``save`` / ``load``); the same over data loaders, with progress bars
(``loaders``: ``fit_factors``, ``query_gradients_over``, ``pairwise_scores_over``,
``self_scores_over``); projected per-sample gradients (``projections``, LoGra) and the projected
gradient store of a data set (LoGra / TRAK / LESS: ``gradient_store``: ``GradientStore``) with its
output functions and transforms (``output_functions``: ``trak_margins``, ``trak_out_to_loss``,
``margin_output``, ``AdamDirection``, ``GradientTransform``, ``project_batch``). This
``__init__`` gathers them in one namespace (imports only).

May import: ``gradhooks.base``, ``gradhooks.rules``, ``gradhooks.core``, the per-sample basics
at the top of ``gradhooks.readers`` (gradient features, Gram matrices) and
``gradhooks.readers.curvature`` (the KFAC / EKFAC factors an influence block inverts: influence
functions are inverse-curvature products). Never ``dp``.
"""
from __future__ import annotations

from .factor_fit import FactorFit
from .gradient_store import GradientStore, StoreSpecError
from .influence_blocks import (
                                  CHUNK_NUMEL,
                                  HEURISTIC_DAMPING,
                                  MISSING,
                                  BlockInverse,
                                  Preconditioner,
                                  preconditioner,
)
from .influence_scores import (
                                  QueryGradients,
                                  pairwise_scores,
                                  query_gradients,
                                  records_form_cheaper,
                                  self_scores,
)
from .loaders import (
                                  fit_factors,
                                  pairwise_scores_over,
                                  query_gradients_over,
                                  self_scores_over,
)
from .output_functions import (
                                  AdamDirection,
                                  GradientTransform,
                                  margin_output,
                                  project_batch,
                                  trak_margins,
                                  trak_out_to_loss,
)

__all__ = ["BlockInverse", "Preconditioner", "QueryGradients", "FactorFit", "preconditioner",
           "query_gradients", "pairwise_scores", "self_scores", "records_form_cheaper",
           "HEURISTIC_DAMPING", "MISSING", "CHUNK_NUMEL",
           "fit_factors", "query_gradients_over", "pairwise_scores_over", "self_scores_over",
           "GradientStore", "StoreSpecError", "AdamDirection", "GradientTransform",
           "margin_output", "project_batch", "trak_margins", "trak_out_to_loss"]
