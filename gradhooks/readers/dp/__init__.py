"""DP-SGD: per-sample clipping, noise and the lot's accumulation, from the records.

Lives here: ``clipping`` (``clip_and_accumulate``, ``finish_step``: the clipped, noised sum into
``param.grad``, book-keeping or materialised; its weighted sums: ``readers.ghost_sums``, Bu et
al. 2023), ``clipped_backward`` (``gh.clipped_backward``: book-keeping and two-pass clipping
of per-sample losses), ``clip_setup`` (what a clip is asked: max norm, per layer, groups),
``accumulation`` (the lot over micro-batches, ``micro_batches``), ``adaptive_clipping`` (the clip
norm following a quantile, Andrew et al. 2021).

May import: ``gradhooks.base``, ``gradhooks.rules``, ``gradhooks.core`` and the per-sample
basics at the top of ``gradhooks.readers`` (norm plan, canonical forms, ranks). Never another
use (``curvature``, ``attribution``): DP needs no curvature.
"""
