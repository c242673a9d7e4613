"""The readers: everything computed from a batch's records, one module per reader.

Lives here: the shared math below the readers (``plan``: how each parameter's norm and clipped
sum are formed; ``canonical``: a record in the canonical ``(a, g)`` form; ``distributed``: how
ranks combine; ``losses``: the loss model; ``ghost_sums``: weighted sums of the per-sample
gradients from the records), the readers, which take a ``Batch``
(``per_sample``, ``norms``, ``clipping``, ``kfac``, ``ekfac``, ``gram``, ``projections``,
``statistics``, ``ggn.empirical_fisher_diag``), and the drivers that run backward passes
themselves and so hold the recorder (``clipped_backward``'s two-pass driver, ``passes``: the
multi-pass driver behind ``jacobians`` and ``ggn``), the DP accumulator (``accumulation``) and
the spot check (``spotcheck``).

May import: ``gradhooks.base``, ``gradhooks.rules``, ``gradhooks.core`` and this folder.
Never the facade (``gradhooks.hooks``) or anything above it.
"""
