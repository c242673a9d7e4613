"""The core: the recorder and what it hands to readers.

Lives here: ``checks`` (the sum check: ``GradTotal``, probes, when it runs), ``records``
(``Layer``, ``Record``: one call's ``a`` and grad_outputs; ``Batch``: the read-only snapshot a
reader gets), ``graph`` (grad_output pre-hooks, tags, the graph walk of ``gh.backward()``),
``provenance`` (which tensors carry the batch; ``batch_dims``: where the batch dim goes
through each op; ``rows``: per-sample weights of ``F.linear`` on merged or routed rows),
``placement`` (where the batch sits in each call: batched, shared or planned; ``layouts``: its
relayouts and the layout of shared calls; ``meetings``: where shared tensors meet the batch, in
the forward and the backward), ``capture`` (the ``Recorder``: attach / detach, hooks,
batch lifecycle, ``snapshot()``) and the recorder's parts split out of it.

May import: ``gradhooks.base``, ``gradhooks.rules`` and this folder. Never a reader: the core
records and computes nothing from its records.
"""
