"""The recorder: hooks on the model, one record per call, and the snapshot a reader gets.

Lives here: ``capture`` (the ``Recorder``: attach / detach, batch lifecycle, ``snapshot()``) and
its parts: ``attachment`` (which modules are hooked, parametrizations), ``forward_pass`` and
``backward_pass`` (the hooks: input activations ``a``, grad_outputs; the graph walk of
``gh.backward()``), ``graph`` (grad_output pre-hooks, tags), ``placement`` (where the batch sits
in each call: batched, shared or planned, as the analysis found it; ``layouts``: relayouts and
shared calls' layouts; ``meetings``: where shared tensors meet the batch), ``records``
(``Layer``, ``Record``, the read-only ``Batch``), ``batch_reads`` (what a read asks of a batch)
and ``checks`` / ``check_policy`` (autograd's totals of each batch, ``GradTotal``, and when the
sum check is due: the verification's evidence, judged by :mod:`gradhooks.readers.verify`).

May import: ``gradhooks.base``, ``gradhooks.rules``, this folder and the batch analysis through
its interface (``gradhooks.core.analysis``, the package, never a module inside it).
"""
