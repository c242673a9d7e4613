"""The base: what every layer of gradhooks stands on, and nothing of hooks or records.

Lives here: ``errors`` (every error and warning class), ``utils`` (pause switch, autocast
guard, pytree walkers, ``loss_reduction`` and its own-loss scale), ``_pool`` (the buffer pool),
``forms`` (``Call`` / ``Block`` / ``Rows`` and the canonical-form math, tensors in, tensors
out), ``segments`` (``Segments``: per-sample gradients as rows per (sample, group) segment,
kept factored; the per-key row layout), ``registry`` (``LayerRule``, ``register_rule``, the lookup),
``torch_internals`` (every torch internal gradhooks reads, with the versions checked).

May import: torch, opt_einsum and the modules of this folder only.
"""
