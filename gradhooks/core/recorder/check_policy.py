"""When the sum check (:mod:`gradhooks.readers.verify`) runs, and when a forward is analysed
again: :class:`SumCheck`, the policy of ``attach(..., check=mode)``, kept by the recorder."""
from __future__ import annotations

from typing import Optional

import torch

from ...base.torch_internals import autograd_nodes_made, graph_nodes
from ...base.utils import tensors

__all__ = ["SumCheck"]


class SumCheck:
    """When the sum check runs, given ``attach(..., check=mode)``.

    ``mode=True``: on every read whose *structure* has not passed before -- which modules were
    called how often, by how many backward passes, and which parameters autograd reached -- and
    on every 100th read (the failures the check catches are properties of that structure);
    ``"always"``: every read; ``False``: never. :meth:`~gradhooks.GradHooks.backward` asks
    :meth:`edges_allowed` whether it may skip the parameter gradients (then the batch's reads
    skip the check), with its own structure key (the forward's recorded calls).

    Between the analysed forwards of an input signature, each forward that follows its plan is
    counted (:meth:`untracked_start` / :meth:`untracked_end`): the autograd nodes it made, i.e.
    its differentiable ops. A count its signature has not shown before is a forward of another
    structure (a branch on a flag, on a tensor's value, a parameter used outside its module
    from this step): the batch's reads then run the sum check, ``backward()`` computes the
    parameter gradients for it and the sample check through the batched graph runs
    (:attr:`changed`), the signature's next forward is analysed (:meth:`forward_due`), and where
    the count differs from earlier planned forwards' the placement checks the forward alone
    (:func:`~gradhooks.core.recorder.placement.verify_changed`).
    A branch that keeps the count (another op for one) is left to the schedule. A signature
    that has shown more than :attr:`COUNTS` counts (its structure follows the data) is analysed
    on every forward instead.
    """

    #: one read (and one ``backward()``) in this many runs the check whatever the structure;
    #: one forward in this many of an input signature is analysed again (:meth:`forward_due`).
    EVERY = 100
    #: more node counts than this for one signature: every forward of it is analysed.
    COUNTS = 8

    def __init__(self, mode) -> None:
        if mode not in (True, False, "always"):
            raise ValueError(f"check must be True, False or 'always', got {mode!r}")
        self.mode = mode
        self._passed: set = set()  # read structures whose check passed
        self._reads = 0
        self._drive_passed: set = set()  # backward() structures whose check passed
        self._drives = 0
        self._forwards: dict = {}  # input signature -> its forwards that followed its plan
        self._nodes: dict = {}  # input signature -> autograd node counts of its planned forwards
        self._recount: set = set()  # signatures whose next forward is analysed (a new count)
        self._ops: dict = {}  # input signature -> the model's ops in its last analysed forward
        self._running: Optional[tuple] = None  # (signature, nodes made, analysed) of the one running
        #: This batch has a forward whose count its signature had not shown: its reads check
        #: (reset with the batch).
        self.changed = False

    def read_due(self, structure: tuple) -> bool:
        """Count a read of ``structure``; whether it runs the check."""
        self._reads += 1
        return (self.mode == "always" or structure not in self._passed or self.changed
                or self._reads % self.EVERY == 0)

    def forward_due(self, signature: tuple) -> bool:
        """Count a forward of an input signature whose first forward was analysed (provenance,
        the op whitelist: :class:`~gradhooks.core.recorder.placement.Placement`); whether this
        one is analysed again: every one under ``"always"``, otherwise every :attr:`EVERY`-th
        whatever ``mode`` (the analysis proves the forward keeps samples apart, it is not the
        sum check). A forward whose structure changes with the same input shapes (a branch on
        a flag or on a tensor's value) is judged on that forward as on its signature's first."""
        if self.mode == "always":
            return True
        if signature in self._recount:
            if len(self._nodes[signature]) <= self.COUNTS:
                self._recount.discard(signature)
            return True
        count = self._forwards.get(signature, 0) + 1
        self._forwards[signature] = count
        return count % self.EVERY == 0

    def edges_allowed(self, drive_key: tuple) -> bool:
        """Count a ``backward()``; whether it may skip the parameter gradients."""
        self._drives += 1
        return not (self.mode == "always" or (self.mode and (
            drive_key not in self._drive_passed or self.changed
            or self._drives % self.EVERY == 0)))

    def forward_start(self, signature: tuple, analysed: bool) -> None:
        """A forward of ``signature`` starts: ``analysed`` (provenance runs: its count of the
        model's ops is the baseline of the planned forward after it) or following its plan."""
        self._running = ((signature, autograd_nodes_made(), analysed) if torch.is_grad_enabled()
                         else None)

    def forward_end(self, completed: bool, output=None) -> bool:
        """That forward returned (``completed``, with ``output``) or raised. An analysed forward
        leaves the count of the model's ops its outputs depend on
        (:func:`~gradhooks.base.torch_internals.graph_nodes`: gradhooks' own nodes left out).
        A planned forward is counted by all the nodes it made (one reading); a count its
        signature has not shown sets :attr:`changed` and has the signature's next forward
        analysed, except on the signature's first planned forward when it ran the analysed
        forward's ops (its outputs' graph counted: the structure the analysis proved). Returns
        whether the structure changed: a count that differs from those of the signature's
        earlier planned forwards, or a first planned forward whose ops are not the analysed
        forward's."""
        running, self._running = self._running, None
        if not completed or running is None or not torch.is_grad_enabled():
            return False
        signature, start, analysed = running
        span = (start, autograd_nodes_made())
        if analysed:
            self._ops[signature] = graph_nodes(tensors(output), span)
            return False
        nodes = span[1] - span[0]
        seen = self._nodes.setdefault(signature, set())
        if nodes in seen:
            return False
        ops = None if seen else self._ops.get(signature)
        seen.add(nodes)
        if ops is not None and graph_nodes(tensors(output), span) == ops:
            return False
        self._recount.add(signature)
        self.changed = True
        return len(seen) > 1 or ops is not None

    def passed(self, structure: tuple, drive_key: Optional[tuple]) -> None:
        """Remember that the check of ``structure`` (reached by ``drive_key``'s backward, if
        any) passed."""
        self._passed.add(structure)
        self.changed = False  # (the batch's records passed: its other reads need not)
        if drive_key is not None:
            self._drive_passed.add(drive_key)
