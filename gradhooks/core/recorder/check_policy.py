"""When the sum check (:mod:`gradhooks.readers.verify`) runs, and when a forward is analysed
again: :class:`SumCheck`, the policy of ``attach(..., check=mode)``, kept by the recorder."""
from __future__ import annotations

from typing import Optional

import torch

from ...base.torch_internals import autograd_nodes_made, graph_ops
from ...base.utils import rng_states, tensors
from ..analysis import HiddenOps, under_compile

__all__ = ["SumCheck"]


class SumCheck:
    """When the sum check runs, given ``attach(..., check=mode)``.

    ``mode=True``: on every read whose *structure* has not passed before -- which modules were
    called how often, by how many backward passes, and which parameters autograd reached -- and
    on every 100th read (the failures the check catches are properties of that structure);
    ``"always"``: every read; ``False``: never. :meth:`~gradhooks.GradHooks.backward` asks
    :meth:`edges_allowed` whether it may skip the parameter gradients (then the batch's reads
    skip the check), with its own structure key (the forward's recorded calls).

    Each forward of an input signature whose first forward was analysed is fingerprinted
    (:meth:`forward_start` / :meth:`forward_end`): the model's differentiable ops its outputs
    depend on, counted and hashed in graph order with the dims each ran along
    (:func:`~gradhooks.base.torch_internals.graph_ops`, gradhooks' own nodes left out, so that
    an analysed forward and a planned one of the same structure agree), and, for the forwards
    that follow the plan, all the autograd nodes it made (side computations the outputs do not
    depend on). A planned forward whose ops no forward of its signature has shown, or whose
    count of nodes the earlier planned forwards of those ops have not, is a forward of another
    structure (a branch on a flag, on a tensor's value, one op swapped for another or run
    along another dim, a parameter used outside its module from this step): the batch's reads
    then run the sum check, ``backward()``
    computes the parameter gradients for it and the sample check through the batched graph
    runs (:attr:`changed`), the placement checks the forward alone
    (:func:`~gradhooks.core.recorder.alone_checks.verify_changed`), and the signature's next
    forward is analysed (:meth:`forward_due`); the structure joins the signature's once an
    analysed forward shows it, and is checked on each of its forwards until then (the check of
    the forward alone holds for its batch only: :meth:`accept`). A signature that has shown
    more than :attr:`COUNTS` structures (its structure follows the data) is analysed on every
    forward instead. Cost: about 1 µs per autograd node of the forward, a Python step of a graph walk.

    Ops a forward runs without gradient inside a custom ``autograd.Function``'s ``forward`` or
    a reentrant checkpoint are one node of the graph: the forwards of a signature whose
    analysed forward ran any are hashed too (their op and plain arguments:
    :class:`~gradhooks.core.analysis.hidden.HiddenOps`), and that hash joins the fingerprint,
    so a Function whose forward computes something else on a later step (a flag read inside
    it) is another structure. Other signatures' planned forwards run without it, and so does a
    forward under ``torch.compile`` (:func:`~gradhooks.core.analysis.hidden.under_compile`).
    """

    #: one read (and one ``backward()``) in this many runs the check whatever the structure;
    #: one forward in this many of an input signature is analysed again (:meth:`forward_due`).
    EVERY = 100
    #: more structures than this for one signature: every forward of it is analysed.
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
        self._nodes: dict = {}  # input signature -> {ops: node counts of its planned forwards}
        self._recount: set = set()  # signatures whose next forward is analysed (a new structure)
        self._ops: dict = {}  # input signature -> graph_ops of its forwards (analysed, planned)
        self._wanted: dict = {}  # signature -> forwards left to analyse for a side computation
        self._running: Optional[tuple] = None  # (signature, nodes made, analysed) of the one running
        self._pending: Optional[tuple] = None  # (signature, ops, nodes) of a new structure: accept()
        #: The random generators' states at the start of the last forward (:func:`rng_states`):
        #: the check of the forward alone reruns it as it ran.
        self.rng: Optional[tuple] = None
        self._hidden: set = set()  # signatures whose forwards run ops without gradient
        self._mode: Optional[HiddenOps] = None  # (hashing the forward running now)
        #: The last forward's structure: its ops' count and fingerprint (:func:`graph_ops`,
        #: with the ``(count, fingerprint)`` of the ops it ran without gradient where its
        #: signature's are hashed: :class:`~gradhooks.core.analysis.hidden.HiddenOps`), ``None``
        #: where not taken. The check of the forward alone is kept per signature and structure:
        #: a Function that computes something else (its hashed ops; under ``torch.compile`` a
        #: graph compiled again, whose autograd node is of a new type) is checked again.
        self.structure: Optional[tuple] = None
        #: This batch has a forward of a structure its signature had not shown: its reads check
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
        if signature in self._wanted:
            self._wanted[signature] -= 1
            if not self._wanted[signature]:
                del self._wanted[signature]
            return True
        if signature in self._recount:
            if len(self._ops[signature]) <= self.COUNTS:
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

    def forward_start(self, signature: tuple, analysed: bool, inputs: list) -> None:
        """A forward of ``signature`` on ``inputs`` starts: ``analysed`` (provenance runs: its
        ops are a structure the analysis proved) or following its plan."""
        grad = torch.is_grad_enabled()
        self._running = (signature, autograd_nodes_made(), analysed) if grad else None
        self.rng = rng_states(inputs) if grad else None
        if (grad and self._mode is None and (analysed or signature in self._hidden)
                and not under_compile()):
            self._mode = HiddenOps()  # (an analysed forward's inside its provenance mode)
            self._mode.__enter__()

    def forward_end(self, completed: bool, output=None) -> bool:
        """That forward returned (``completed``, with ``output``) or raised; returns whether it
        was a planned forward of a structure its signature had not shown (the class docstring):
        then :attr:`changed` is set, the signature's next forward is analysed, and the structure
        is the signature's once the caller verified it (:meth:`accept`)."""
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(None, None, None)
        running, self._running, self.structure = self._running, None, None
        if not completed or running is None or not torch.is_grad_enabled():
            return False
        signature, start, analysed = running
        end = autograd_nodes_made()
        ops = graph_ops(tensors(output), (start, end))
        if analysed and mode is not None and mode.count:
            self._hidden.add(signature)
        if signature in self._hidden:
            ops = (ops, None if mode is None else (mode.count, mode.fingerprint))
        self.structure = ops
        shown = self._ops.setdefault(signature, set())
        if analysed:
            shown.add(ops)
            return False
        nodes = self._nodes.setdefault(signature, {}).setdefault(ops, set())
        if ops in shown and (not nodes or end - start in nodes):
            nodes.add(end - start)  # (a structure's first planned forward: its baseline)
            return False
        self._pending = (signature, ops, end - start)
        self._recount.add(signature)
        self.changed = True
        return True

    def side_unshown(self, signature: tuple) -> None:
        """A planned forward of ``signature`` ran ops no analysed forward showed, found after
        it: a side computation its loss read
        (:meth:`~gradhooks.core.analysis.loss_graph.ForwardSpans.unshown`). The batch's reads
        check (:attr:`changed`), and the signature's forwards are analysed until one's loss
        reads a side computation (:meth:`side_shown`; at most :attr:`EVERY` of them): a loss
        that reads it every few steps has it proven at its next read."""
        self._wanted[signature] = self.EVERY
        self.changed = True

    def side_shown(self, signature: tuple) -> None:
        """An analysed forward of ``signature`` whose loss read a side computation (its ops
        proven): its forwards follow the plan again."""
        self._wanted.pop(signature, None)

    def accept(self) -> None:
        """The planned forward of a new structure that :meth:`forward_end` reported needs no
        check (a batch of one sample, mixing accepted): its structure joins its signature's.
        Any other joins when an analysed forward shows it; until then each of its forwards is
        checked again (the check of the forward alone holds for the batch it ran on: a sort
        of the batch's values that found them sorted passes it on that batch only)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            signature, ops, nodes = pending
            self._ops[signature].add(ops)
            self._nodes[signature][ops].add(nodes)

    def passed(self, structure: tuple, drive_key: Optional[tuple]) -> None:
        """Remember that the check of ``structure`` (reached by ``drive_key``'s backward, if
        any) passed."""
        self._passed.add(structure)
        self.changed = False  # (the batch's records passed: its other reads need not)
        if drive_key is not None:
            self._drive_passed.add(drive_key)
