"""The tools around the library: references, comparisons, the main job.

Lives here: ``reference`` (the batched-forward and looped references, ``compare()``),
``kinks`` (where two forwards decide a kink differently), ``workloads`` (models, data and
losses of the main job and the benchmarks), ``cli`` (``python -m gradhooks bench``).

May import: every layer below (``base``, ``rules``, ``core``, ``readers``), the facade
(``gradhooks.hooks``, ``gradhooks.fisher``) and this folder. The library never imports a tool
except the package's ``__init__``, which re-exports the references.
"""
