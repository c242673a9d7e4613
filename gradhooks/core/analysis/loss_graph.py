"""A loss computed after the model, proven from its autograd graph to split into per-sample terms.

Per-sample gradients exist only where the batch loss is ``L = sum_n l_n(z_n) + c``, each
sample's term a function of that sample's model output ``z_n`` alone (``c``: terms without the
model's outputs). The forward's ops are judged while the forward runs
(:mod:`gradhooks.core.analysis.separation`), and ``gh.backward(loss)`` checks a loss's samples
through its batched graph (:mod:`gradhooks.readers.sample_check`). A plain
``loss.backward()`` on a loss computed after the model shows gradhooks neither: an InfoNCE
``F.cross_entropy(z @ z.T / t, arange(B))``, a softmax or sort over the batch, ``z - z.mean(0)``
or ``z[:B // 2] - z[B // 2:]`` would give each sample's *contribution* to the batch gradient,
silently. So the first hooked grad_output of such a pass walks the loss's graph from the pass's
root (:func:`~gradhooks.core.analysis.backward_losses.backward_roots`) down to the tensors the
model made, and proves the split there, or says which node it could not prove (:func:`judge`).

The nodes walked are those made after the model's forwards (each forward's span of autograd
sequence numbers is noted: :class:`ForwardSpans`). A node made inside a forward is a boundary:
its output carries the batch on the dim provenance followed to the model's output (its
signature's analysed forward). Where provenance did not follow it, no dim is guessed from
the sizes (a dim of size ``B`` may not be the batch's, and the batch may be merged, packed or
on another dim of that size): the output is taken as a sum over the samples, as a 0-dim one is
(a loss computed in the forward, judged there), which only linear ops may follow; a
non-linear op on it is not proven (``UnprovenOpError``: per-sample losses handed to
``gh.backward`` are judged by the sample check instead), not proven to mix. A node
made before the first forward, and a leaf (a parameter, an input), does not depend on the
model's outputs, nor does a node whose inputs all do not, whatever it is. Every other node
is judged by the table of :mod:`gradhooks.core.analysis.loss_rules`, from the model's outputs
up to the loss: a node that pairs or mixes the samples, or that no rule proves keeps them
apart, is the verdict.

A node made inside a forward that is not one of its outputs (a side computation kept on a
module or by a hook, added to the loss) is also collected (``judge``'s ``sides``): its ops,
counted and hashed (:func:`~gradhooks.base.torch_internals.graph_ops`), must be ones an
analysed forward of the same input signature showed (:meth:`ForwardSpans.unshown`), since a
planned forward's fingerprint covers its outputs' graph only.

A hooked layer called outside the model's forward (``model.head(g)`` in the loss) records
rows that provenance never followed: its input's rows are proven the samples' own by the same
table, from its graph down to the model's outputs and the outputs of earlier such calls
(:func:`rows_of`), and its outputs are then boundaries as the model's are
(:meth:`ForwardSpans.note_call`).

Cost: one visit per node made after the forward (a loss has some tens), per backward pass;
where the loss reads side computations, a walk of their graphs in the forward.
"""
from __future__ import annotations

import collections
from typing import Deque, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ...base.torch_internals import autograd_nodes_made, graph_ops, is_functorch_wrapped, reached
from ...base.utils import tensors as tensors_in
from ...base.utils import tree_flatten
from .batch_dims import Routed
from .loss_rules import LINEAR, Info, One, Rows, Unproven, apply, averaged, rows

__all__ = ["ForwardSpans", "judge", "rows_of"]


#: Autograd's sequence number of a leaf's ``AccumulateGrad`` (made outside any forward).
_LEAF = 2 ** 64 - 1
#: The forwards whose spans are kept (a backward pass reaches its own batch's).
_SPANS = 256
#: At most this many nodes made after the forward are walked; more: not proven.
_CAP = 20000


class _Lost(str):
    """A tensor of the forward whose batch dim provenance did not follow: taken as
    :data:`LINEAR` (only linear ops may follow it), but a non-linear op on it is not proven to
    mix the samples (it may be per-sample elements), only not proven to keep them apart."""


_UNKNOWN = _Lost(LINEAR)
_LOST = ("it reads a tensor the model's forward made whose batch dim gradhooks did not follow "
         "there (so it is taken as a sum over the samples)")


class ForwardSpans:
    """The autograd sequence numbers each of the model's forwards took (this thread's counter,
    :func:`~gradhooks.base.torch_internals.autograd_nodes_made`): a node numbered inside a span
    was made by the model, one numbered after the last span by the loss; and the batch dim of
    each of a forward's output tensors, as provenance followed it in its signature's analysed
    forward (:meth:`end`)."""

    def __init__(self):
        self.spans: Deque[Tuple[int, int]] = collections.deque(maxlen=_SPANS)
        self._open: Optional[int] = None
        self._depth = 0  # (a model whose forward calls itself: one span)
        #: ``{(sequence number, output_nr): batch dim}`` of recent forwards' output tensors
        #: (``int``, ``(dim, rows per sample)``, ``None``: unknown)
        self.outputs: Dict[Tuple[int, int], object] = {}
        self._dims: Dict[tuple, list] = {}  # input signature -> its outputs' batch dims
        #: span -> (input signature, analysed) of the forwards the placement followed
        self.kinds: Dict[Tuple[int, int], Tuple[tuple, bool]] = {}
        self.tops: set = set()  #: the sequence numbers of the forwards' output nodes
        #: the sequence numbers of the output nodes of hooked calls outside the model's
        #: forwards (:meth:`note_call`), boundaries as the model's outputs are
        self.called: set = set()
        #: input signature -> graph_ops of the tensors its analysed forwards made off their
        #: outputs (side computations: :meth:`unshown`)
        self.sides: Dict[tuple, set] = {}
        #: span -> {node: what} of an analysed forward's unproven ops off its outputs, which
        #: the check of the forward alone cannot see (:meth:`off_outputs`)
        self._off: Dict[Tuple[int, int], dict] = {}
        self._attrs: Dict[Tuple[int, int], list] = {}  # span -> [(node, ops)] kept on modules

    def start(self) -> None:
        """The model's forward starts."""
        self._depth += 1
        if self._depth == 1 and torch.is_grad_enabled():
            try:
                self._open = autograd_nodes_made()
            except AttributeError:  # (inside a torch.func transform: no node is made)
                self._open = None

    def end(self, output=None, placement=None) -> None:
        """The model's forward returned (with ``output``; ``placement``: the recorder's
        :class:`~gradhooks.core.recorder.placement.Placement`, duck-typed: its ``provenance``
        while an analysed forward ends, its ``signature``) or raised."""
        self._depth = max(0, self._depth - 1)
        if self._depth or self._open is None:
            return
        span = (self._open, autograd_nodes_made())
        self.spans.append(span)
        self._open = None
        if output is not None and placement is not None:
            self._note_outputs(output, placement)
            if len(self.kinds) > _SPANS * 2:
                self.kinds.clear()
            if placement.signature is not None:
                analysed = placement.provenance is not None
                self.kinds[span] = (placement.signature, analysed)
                if analysed:
                    self._side_attributes(placement.recorder.model, span, placement.signature)

    def stop(self) -> None:
        """A forward was interrupted (detach, suspended): it ends here."""
        self._depth = 1
        self.end()

    def _note_outputs(self, output, placement) -> None:
        tensors = [t for t in tree_flatten(output)[0]
                   if isinstance(t, torch.Tensor) and not is_functorch_wrapped(t)]
        if len(self.tops) > _SPANS * 64:
            self.tops.clear()
        self.tops.update(t.grad_fn._sequence_nr() for t in tensors if t.grad_fn is not None)
        prov, key = placement.provenance, placement.signature
        if prov is not None:
            dims = []
            for t in tensors:  # (only a batch dim provenance followed counts: never "none")
                batched, _, dim = prov.look(t)
                dims.append(dim if batched else None)
            self._dims[key] = dims
        dims = self._dims.get(key)
        if len(self.outputs) > _SPANS * 8:
            self.outputs.clear()
        if dims is None or len(dims) != len(tensors):
            return
        for t, dim in zip(tensors, dims):
            node = t.grad_fn
            if node is not None:
                self.outputs[(node._sequence_nr(), t.output_nr)] = dim

    def _side_attributes(self, model, span: Tuple[int, int], signature: tuple) -> None:
        # An analysed forward's tensors kept on its modules (``self.aux_loss = ...``), off its
        # outputs: the analysis proved their ops (unless off_outputs finds an unproven one
        # there), which a planned forward's loss may read.
        kept = self._attrs.setdefault(span, [])
        for module in model.modules():
            for value in vars(module).values():
                if isinstance(value, (torch.Tensor, list, tuple, dict)):
                    for t in tensors_in(value):
                        node = t.grad_fn
                        if node is not None and span[0] <= node._sequence_nr() < span[1]:
                            kept.append((node, graph_ops((), span, (node,))))
                            self.sides.setdefault(signature, set()).add(kept[-1][1])

    def reset_batch(self) -> None:
        """A new batch: its forwards' side computations are the ones its loss reads (the
        autograd nodes of the last batch's are let go)."""
        self._off.clear()
        self._attrs.clear()

    def off_outputs(self, unproven: dict) -> None:
        """The last forward, analysed, ran ops no rule proves keep the samples apart whose
        results its outputs do not depend on (``{node: what}``): the check of the forward
        alone cannot see them. A side computation that holds one is not proven (its tensors
        kept on modules are not the signature's), and a loss that reads it is refused
        (:meth:`unshown`)."""
        span = self.spans[-1]
        self._off[span] = unproven
        signature = self.kinds.get(span, (None,))[0]
        for node, ops in self._attrs.get(span, ()):
            if reached((), (node,), set(unproven)):
                self.sides.get(signature, set()).discard(ops)

    def unshown(self, found: Dict[Tuple[int, int], list]
                ) -> Tuple[List[Tuple[tuple, List[str]]], set, List[str]]:
        """``found``: ``{span: nodes}``, the nodes of the model's forwards that a loss read off
        their outputs (:func:`judge`'s ``sides``): side computations. Those of an analysed
        forward join its signature's (the analysis proved their ops) unless they hold an op
        no rule proves keeps the samples apart (:meth:`off_outputs`). Returns, for each
        planned forward, its signature and the nodes whose ops (count and fingerprint,
        :func:`~gradhooks.base.torch_internals.graph_ops`) no analysed forward of it showed
        (nothing proves they keep the samples apart); the signatures of the analysed forwards
        that showed some; and what names each unproven op such a side computation holds."""
        unproven, shown_by, ops_off = [], set(), []
        for span, nodes in found.items():
            kind = self.kinds.get(span)
            if kind is None:  # (a forward the placement did not follow)
                continue
            signature, analysed = kind
            shown = self.sides.setdefault(signature, set())
            if analysed:
                off = self._off.get(span, {})
                hit = reached((), tuple(nodes), set(off))
                if hit:
                    ops_off.extend(sorted(off[n] for n in hit))
                    continue
                shown.update(graph_ops((), span, (node,)) for node in nodes)
                shown_by.add(signature)
                continue
            new = [node.name() for node in nodes if graph_ops((), span, (node,)) not in shown]
            if new:
                unproven.append((signature, new))
        return unproven, shown_by, ops_off

    def span_of(self, seq: int) -> Optional[Tuple[int, int]]:
        """The span of the forward that made node ``seq``, if one kept did."""
        return next(((a, b) for a, b in self.spans if a <= seq <= b), None)

    def outside(self) -> bool:
        """Whether no model forward runs now (a hooked layer called now is called outside)."""
        return self._depth == 0

    def note_call(self, outputs: list) -> None:
        """A hooked layer's call outside the model's forwards returned ``outputs`` (``[(tensor,
        batch dim)]`` in its rule's layout), its input's rows proven the samples' own
        (:func:`rows_of`): the loss's walk takes them as it takes the model's outputs."""
        if len(self.called) > _SPANS * 64:
            self.called.clear()
        for t, dim in outputs:
            node = t.grad_fn if isinstance(t, torch.Tensor) else None
            if node is not None and isinstance(dim, int):
                seq = node._sequence_nr()
                self.called.add(seq)
                self.tops.add(seq)
                self.outputs[(seq, t.output_nr)] = dim

    def made_by_model(self, seq: int) -> Optional[bool]:
        """``True``: node ``seq`` was made inside a forward (or is a hooked call's output
        outside one: :meth:`note_call`); ``False``: after the first forward and outside every
        one (by the loss); ``None``: before the first one kept, or a leaf."""
        if seq in self.called:
            return True
        if not self.spans or seq == _LEAF or seq < self.spans[0][0]:
            return None
        return any(a <= seq <= b for a, b in self.spans)


def judge(root, spans: ForwardSpans, samples: Tensor,
          sides: Optional[dict] = None) -> Optional[Unproven]:
    """Whether the loss whose autograd node is ``root`` splits into per-sample terms of the
    model's outputs (module docstring).

    Args:
        root: the ``grad_fn`` of a root of the backward pass (its nodes have run: only their
            types, saved sizes and shapes are read).
        spans: the model's forwards (:class:`ForwardSpans`).
        samples: ``(B,)`` int64, the sample of each row of the hooked layers' batch
            (``arange(B)``, or the declared ``sample_ids``' groups), ``B`` > 1.
        sides: if given, filled with ``{span: nodes}``: the nodes of a forward the loss reads
            that are not the forward's outputs (:meth:`ForwardSpans.unshown`).

    Returns:
        ``None`` where proven (or the root does not depend on the outputs), else the
        :class:`Unproven` naming the first node (walked from the model's outputs up) that is not.
    """
    try:
        _walk(root, spans, samples, sides)
    except Unproven as found:
        return found
    return None


def rows_of(t: Tensor, dim: int, spans: ForwardSpans, samples: Tensor) -> Optional[Unproven]:
    """Whether the rows of ``t`` on ``dim`` are the samples' own (``samples``: ``(B,)``,
    ``arange(B)``), proven by :func:`judge`'s table from ``t``'s graph down to the model's
    outputs and the outputs of hooked calls made outside the model's forward
    (:meth:`ForwardSpans.note_call`): the input of such a call, whose records split its rows
    by sample. ``None`` where proven, or where ``t`` depends on none of those (the batch
    itself, as the model's top-level inputs are taken); else the :class:`Unproven`, whose
    ``mixes`` says its rows are proven paired, mixed or other samples'."""
    node = t.grad_fn
    if node is None:
        return None
    try:
        memo = _walk(node, spans, samples, None)
    except Unproven as found:
        return found
    info = memo[node][t.output_nr] if t.output_nr < len(memo[node]) else None
    if info is None or isinstance(info, One) or (
            isinstance(info, Rows) and info.dim == dim and info.ids is not None
            and torch.equal(info.ids.cpu(), samples)):
        return None
    other = (isinstance(info, Rows) and info.dim == dim and info.ids is not None
             and info.ids.numel() == samples.numel())  # (rows of other samples: a permutation)
    return Unproven(_name(node), f"the input of a hooked layer called outside the model's "
                                 f"forward does not have the samples' own rows on dim {dim} "
                                 f"({info})", other)


def _walk(root, spans: ForwardSpans, samples: Tensor, sides: Optional[dict]) -> dict:
    # judge's walk: {node: [Info of each output]} from the model's outputs up to ``root``.
    # Raises Unproven (judge's).
    memo: Dict[object, List[Info]] = {}
    todo = [root]
    while todo:
        node = todo[-1]
        if node in memo:
            todo.pop()
            continue
        if len(memo) > _CAP:
            raise Unproven(node.name(), f"the loss's graph has more than {_CAP} nodes "
                                        f"after the model's forward", False)
        where = spans.made_by_model(node._sequence_nr())
        if where is None:
            memo[node] = [None] * max(1, len(node._input_metadata))
            todo.pop()
            continue
        if where:
            seq = node._sequence_nr()
            if sides is not None and seq not in spans.tops:
                sides.setdefault(spans.span_of(seq), []).append(node)
            memo[node] = [_boundary(m.shape, samples, spans.outputs.get((seq, nr)))
                          for nr, m in enumerate(node._input_metadata)]
            todo.pop()
            continue
        waiting = [n for n, _ in node.next_functions if n is not None and n not in memo]
        if waiting:
            todo.extend(waiting)
            continue
        todo.pop()
        ins = [(None, None) if n is None else (memo[n][nr], _shape(n, nr))
               for n, nr in node.next_functions]
        if all(i is None for i, _ in ins):
            memo[node] = [None] * max(1, len(node._input_metadata))
        else:
            outs = [list(m.shape) for m in node._input_metadata]
            try:
                memo[node] = apply(_name(node), node, ins, outs)
                _even(_name(node), averaged(_name(node), node, ins), samples)
            except Unproven as e:  # (on a tensor whose batch dim was not followed: unproven)
                raise Unproven(e.node, f"{e.why}; but {_LOST}", False) if e.mixes and any(
                    isinstance(i, _Lost) for i, _ in ins) else e
            except (AttributeError, TypeError, ValueError, IndexError, RuntimeError) as e:
                raise Unproven(_name(node), f"what autograd kept of it could not be read "
                                            f"({type(e).__name__}: {e})", False) from e
    return memo


def _even(name: str, ids: Optional[Tensor], samples: Tensor) -> None:
    # A mean over rows whose samples ``ids`` are known (loss_rules.averaged) must count every
    # sample's rows equally often: else it is not the mean of the samples' own terms, and its
    # 1/R is not each sample's share. Raises Unproven (not proven to mix).
    if ids is None:
        return
    counts = torch.bincount(ids.cpu(), minlength=int(samples.max()) + 1)
    if int(counts.min()) == int(counts.max()):
        return
    some, none = int(counts.argmax()), int(counts.argmin())
    raise Unproven(name, f"a mean over {ids.numel()} rows that counts the samples unequally "
                         f"(sample {some}: {int(counts[some])} rows, sample {none}: "
                         f"{int(counts[none])}; a slice or subset of the batch): it is not the "
                         f"mean of each sample's own loss, whose share is 1/B", False)


def _shape(node, nr: int) -> Optional[list]:
    meta = node._input_metadata
    return list(meta[nr].shape) if nr < len(meta) else None


def _boundary(shape, samples: Tensor, known) -> Info:
    # A tensor the model's forward made: where provenance followed its batch dim (an output
    # of the model); else, 0-dim, a sum over the samples (a loss computed in the forward,
    # judged there); else a tensor whose batch dim is not known: only linear ops may follow it.
    shape, batch = list(shape), len(samples)
    if isinstance(known, tuple) and len(shape) > known[0] and shape[known[0]] == batch * known[1]:
        return rows(known[0], samples.repeat_interleave(known[1]))
    if isinstance(known, int) and len(shape) > known and shape[known] == batch:
        return rows(known, samples)
    if isinstance(known, Routed) and shape and shape[0] == len(known.samples) and (
            known.size == batch):  # (rows gathered from the batch: row r of sample samples[r])
        return rows(0, samples[known.samples.cpu()])
    return _UNKNOWN if shape else LINEAR


def _name(node) -> str:
    return node.name().rsplit("::", 1)[-1]
