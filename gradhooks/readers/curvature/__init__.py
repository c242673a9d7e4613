"""Curvature: KFAC, EKFAC and GGN / Fisher from the records.

Lives here: ``kfac`` (``kfac_factors``: the KFAC factors ``A`` / ``G`` per layer, Martens &
Grosse 2015; Eschenhagen et al. 2023 for weight sharing), ``kfac_sums`` (the factors' sums over
the records, ranks and passes), ``kfac_results`` (the result types ``KFACFactors``,
``DiagonalFactors``), ``ekfac`` (eigenvalue-corrected KFAC, George et al. 2018) and ``ggn`` (the
GGN's square root, diagonal and products; the empirical Fisher's diagonal).

May import: ``gradhooks.base``, ``gradhooks.rules``, ``gradhooks.core`` and the per-sample
basics at the top of ``gradhooks.readers`` (canonical forms, Jacobians, passes). Never another
use (``dp``, ``attribution``).
"""
