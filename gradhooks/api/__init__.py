"""The facade's reads, by use: mixins of :class:`gradhooks.GradHooks` (``hooks.py``), one module
per use of the readers (``dp``, ``curvature``, ``features``), so that the facade's class stays one
idea (attach, batches, the per-sample basics). Every read of the records is a method of
``GradHooks``; what is computed from a read's result (influence scores of gradient features,
a preconditioner of KFAC factors) is a function of that result (``gradhooks.attribution``).

Layer ``api`` (with the package's top modules). May import: every layer below (``base``,
``rules``, ``core``, ``readers``) and this folder. Never ``tools`` or ``integrations``.
"""
