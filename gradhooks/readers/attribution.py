"""``gradhooks.attribution``: training-data attribution from the hooks' records, in one
namespace (imports only; the math is in the modules named).

* Influence scores ``q_m^T H^-1 g_n`` and self-influence with identity, KFAC or EKFAC blocks
  (:mod:`gradhooks.readers.influence_scores`: ``query_gradients``, ``pairwise_scores`` (per
  token too), ``self_scores``), the blocks ``H^-1`` (:mod:`gradhooks.readers.influence_blocks`:
  ``preconditioner``, ``Preconditioner``, ``BlockInverse``) and their fit over many batches
  (:mod:`gradhooks.readers.factor_fit`: ``FactorFit``, with ``save`` / ``load``);
* the same over data loaders, with progress bars (:mod:`gradhooks.readers.attribution_loaders`:
  ``fit_factors``, ``query_gradients_over``, ``pairwise_scores_over``, ``self_scores_over``);
* the projected gradient store of a data set (LoGra / TRAK / LESS:
  :mod:`gradhooks.readers.gradient_store`: ``GradientStore``) and its output functions and
  transforms (:mod:`gradhooks.readers.output_functions`: ``trak_margins``,
  ``trak_out_to_loss``, ``margin_output``, ``AdamDirection``, ``GradientTransform``,
  ``project_batch``).
"""
from __future__ import annotations

from .attribution_loaders import (
                                  fit_factors,
                                  pairwise_scores_over,
                                  query_gradients_over,
                                  self_scores_over,
)
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
