"""What the backward pass delivers to a recorder: grad_outputs, a rule's internal gradients and
autograd's parameter gradients; and :meth:`BackwardPass.drive`, the backward pass of
:meth:`gradhooks.GradHooks.backward`, which asks autograd for the hooked layers' output gradients
instead of the parameters'.

Every hook here runs once per recorded call per backward pass, and writes into the recorder's
batch state (its records, the released / stale flags, the sum check's totals).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, Optional

import torch
from torch import Tensor, nn

from ...base import torch_internals, utils
from ...base.errors import GradHooksError
from ..analysis import (
    UNCHECKED,
    UNPROVEN,
    ForwardSpans,
    backward_roots,
    fixed_normaliser,
    judge,
    loss_of,
    position_rows,
    row_counts,
    rows_of,
    split_of,
    valid_rows,
)
from .graph import walk
from .placement import relayout
from .records import Record
from .totals import GradTotal

__all__ = ["BackwardPass"]


#: Why the reads refuse a hooked layer called outside the model's forward on rows the loss walk
#: cannot follow (:meth:`BackwardPass.outside_call`).
_UNFOLLOWED = ("{layer} was called outside the model's forward on rows gradhooks cannot follow "
               "({found}): nothing proves they are the samples' own. A sample check verifies it: "
               "per-sample losses, shape (B,), through gh.backward(losses.mean()) or "
               "gh.clipped_backward(losses, max_norm); or call the layer inside the model's forward")


class BackwardPass:
    """The backward side of one recorder (``recorder``: the
    :class:`~gradhooks.core.recorder.capture.Recorder`, whose batch state it fills).

    Attributes:
        captured: inside :meth:`drive`'s output-edges pass, the ``(id(record), leaf)`` whose
            grad_outputs arrive as the pass's return values (their hooks skip them).
        listener: told of every hook call while :meth:`drive`'s pass runs (two-pass
            clipping), or ``None``.
    """

    def __init__(self, recorder):
        self._recorder = recorder
        self.captured: frozenset = frozenset()
        self.listener = None
        self._task = None  # the backward pass (graph task id) whose roots were looked at
        self._loss = None  # what its root is (backward_losses.Finding), until judged
        self._judged = 0  # > 0: inside passes on a loss gradhooks judged itself (judged())
        self._split = None  # the pass's loss split (backward_losses.Split) awaiting its counts
        self.expected = None  # the Split gh.backward read from its loss (expecting())
        self.spans = ForwardSpans()  # the model's forwards: where a loss's graph is judged

    def on_grad_output(self, record: Record, leaf: Optional[int], grads: tuple,
                       nr: int) -> None:
        """Pre-hook on the autograd node of a recorded output: ``grads[nr]`` is the gradient
        w.r.t. the output tensor (leaf ``leaf`` for ``multi_io`` rules)
        (:func:`gradhooks.core.recorder.graph.on_grad`). Returns ``None`` (the gradient flows on unchanged)."""
        grad = grads[nr]
        recorder = self._recorder
        if (utils.PAUSED or grad is None or recorder.hooks_muted or not recorder.attached
                or (id(record), leaf) in self.captured):
            return None
        self._see_loss(grad, record)
        self.receive(record, leaf, grad)
        return None

    @contextlib.contextmanager
    def judged(self):
        """The backward passes inside run on a loss gradhooks checked or built itself
        (``gh.backward``, ``clipped_backward``, the Fisher and multi-pass drivers): their roots
        are not looked at (:meth:`_see_loss`)."""
        self._judged += 1
        try:
            yield
        finally:
            self._judged -= 1

    @contextlib.contextmanager
    def expecting(self, split):
        """The judged pass inside (``gh.backward``) runs on a loss whose split ``split``
        (:class:`~gradhooks.core.analysis.backward_losses.Split`, or ``None``: nothing to count) was
        read from its graph before the pass: its first token-shaped grad_output gives the
        counts (:meth:`_see_loss`)."""
        self.expected = split
        try:
            yield
        finally:
            self.expected = None

    def _see_loss(self, grad: Tensor, record: Record) -> None:
        """The first hooked grad_output of a backward pass looks at its roots for a loss that is
        not the declared mean (or sum) over samples (:mod:`gradhooks.core.analysis.backward_losses`): a
        token-level mean, whose valid-token counts the logits' grad_output gives, a loss whose
        split into per-sample terms is not proven (counted from the first hooked grad_output,
        in its call's layout: :func:`~gradhooks.core.analysis.backward_losses.row_counts`), a constant factor, or
        a reduction over the batch that contradicts ``loss_reduction``; refused at the read."""
        if self._judged and self.expected is None:
            return
        task = torch_internals.current_graph_task_id()
        recorder = self._recorder
        tokens = recorder.placement.mixing.tokens
        if task != self._task:
            self._task, self._loss, self._split = task, None, None
            size = recorder.batch_size
            if self._judged:
                self._split = self.expected
            else:
                roots = backward_roots() if size else None
                self.judge_graph(roots)
                self._loss = found = None if roots is None else loss_of(roots, size)
                if found is not None and found.kind == "mean" and found.node is not None:
                    tokens.rows_mean(found.what, None)  # (its rows, if counted below, replace it)
                if roots is not None and len(roots) == 1 and roots[0].dim() == 0:
                    samples = recorder.reads.declared_samples() or size  # (G with sample_ids)
                    self._split = self._judge_split(
                        split_of(roots[0].grad_fn, samples, _scaling(recorder)), tokens)
        self._count(grad, record)
        found = self._loss
        if found is None:
            return
        size, tokens = recorder.batch_size, recorder.placement.mixing.tokens
        if found.kind == "tokens":
            rows = (position_rows(grad, record, size, recorder.batch_first, found.classes)
                    if found.classes in grad.shape else None)  # (cheap: not the logits)
            counts = (None if rows is None or rows[1]
                      else valid_rows(rows[0], found.tokens, found.classes))
            if counts is not None:
                self._loss = None
                tokens.seen_after_forward(found.what, counts)
            return
        if found.node is not None and (torch_internals.current_autograd_node() is not found.node
                                       or grad.dim() == 0 or grad.shape[0] != size):
            return  # (the loss's rows are not yet known to be the batch's)
        self._loss = None
        tokens.contradicts(found.what, found.kind, size)
        if found.kind == "mean":  # (a loss function's own mean over the B rows)
            tokens.rows_mean(found.what, size)

    def judge_graph(self, roots: Optional[tuple], mixing_only: bool = False) -> None:
        """The loss (the tensors ``roots`` of a backward pass) computed after the model: its
        split into per-sample terms proven from its graph, or the batch's per-sample reads
        refused (:func:`gradhooks.core.analysis.loss_graph.judge`); nothing to prove with one
        row, or where the attachment accepts mixing. ``mixing_only``: only a node shown to
        mix the samples is refused (per-sample losses the sample check judges)."""
        recorder = self._recorder
        size = recorder.batch_size
        if (roots is None or not size or size < 2
                or getattr(recorder, "allow_sample_mixing", False)):
            return
        declared = recorder.reads.declared_ids()
        samples = torch.arange(size) if declared is None else declared.cpu()
        for root in roots:
            if root.grad_fn is None:
                continue
            sides: dict = {}
            found = judge(root.grad_fn, self.spans, samples, sides)
            self._sides(sides)
            if found is not None and (found.mixes or not mixing_only):  # (sample_ids declared later judge it again: Mixing)
                recorder.placement.mixing.loss_graph(found, None if declared is not None else (
                    root.grad_fn, self.spans))
                return

    def outside_call(self, layer, module: nn.Module, args: tuple, output, x: Tensor) -> None:
        """A hooked ``layer`` called outside the model's forward (``model.head(h)`` in the loss):
        provenance does not follow it, so its input ``x``'s rows must be proven the samples'
        own from its graph down to the model's outputs and the outputs of earlier such calls
        (:func:`~gradhooks.core.analysis.loss_graph.rows_of`): where it shows them paired,
        mixed or another sample's (``h.flip(0)``, a mixup of rows) the batch's reads are
        refused (``SampleMixingError``); rows it cannot follow (an op the loss rules do not
        prove) are refused too (``UNCHECKED``) unless the batch's sample check passes (made due
        here). Its outputs then count as boundaries for the loss's walk
        (:meth:`~gradhooks.core.analysis.loss_graph.ForwardSpans.note_call`). Nothing to prove
        with one row, where the attachment accepts mixing, or for a forward recomputed in a
        backward pass (gradient checkpointing)."""
        recorder = self._recorder
        if torch_internals.current_graph_task_id() != -1:
            return  # (a forward recomputed inside a backward pass: gradient checkpointing)
        dim = 0 if recorder.batch_first or x.dim() < 2 else 1
        size = x.shape[dim] if x.dim() > dim else 0
        if size > 1 and not getattr(recorder, "allow_sample_mixing", False):
            found = rows_of(x, dim, self.spans, torch.arange(size))
            if found is not None and found.mixes:
                recorder.placement.mixing.loss_graph(found)
            elif found is not None:  # (rows not followed: a sample check verifies them)
                recorder.sum_check.changed = True
                recorder.placement.mixing.batch.append(
                    (UNCHECKED, _UNFOLLOWED.format(layer=layer.describe(), found=found)))
        self.spans.note_call(layer.rule.output_dims(module, args, output,
                                                    lambda t: dim if t is x else None))

    def _sides(self, sides: dict) -> None:
        # Tensors a planned forward made off its outputs that the loss reads (a side
        # computation kept on a module or by a hook) whose ops no analysed forward of its
        # signature showed: the batch's reads are refused unless its sample check passes, and
        # the signature's forwards are analysed until one's loss reads it (ForwardSpans.unshown).
        recorder = self._recorder
        unproven, shown_by, ops_off = self.spans.unshown(sides)
        for signature in shown_by:
            recorder.sum_check.side_shown(signature)
        recorder.placement.mixing.batch.extend((UNPROVEN, (
            f"{what}. Its result is off the model's outputs (a side computation the loss "
            f"reads), where the check of the forward alone cannot see it: return it as an "
            f"output of the model (per sample, shape (B, ...)) to have it checked")) for what in ops_off)
        for signature, names in unproven:
            recorder.sum_check.side_unshown(signature)
            recorder.placement.mixing.batch.append((UNCHECKED, (
                f"the loss reads tensors a forward of {type(recorder.model).__name__} made off "
                f"its outputs (a side computation kept on a module or by a hook: autograd's "
                f"{', '.join(sorted(set(names)))}) whose ops no analysed forward of its input "
                f"signature showed: nothing proves they keep the samples apart. A sample check "
                f"verifies it: per-sample losses, shape (B,), through gh.backward(losses.mean()) "
                f"or gh.clipped_backward(losses, max_norm); attach(..., check='always') "
                f"analyses every forward instead")))

    def _count(self, grad: Tensor, record: Record) -> None:
        # The pass's first hooked grad_output (the output layer's: closest to the loss) gives
        # the valid-token counts of a loss whose split is not proven, in the layout gradhooks
        # knows for its call (row_counts); the later ones (inner layers, whose zero rows a ReLU
        # may make) never do.
        split, self._split = self._split, None
        recorder = self._recorder
        if split is None or grad is None or fixed_normaliser(
                split, torch_internals.current_autograd_node()):
            return
        rows = position_rows(grad, record, recorder.batch_size, recorder.batch_first)
        if rows is not None:
            counts = row_counts(*rows)
            source = (f"the zero rows of the {tuple(grad.shape)} grad_output of module "
                      f"{record.layer.describe()}")
            if rows[1]:  # (unknown layout)
                source += (", along the dim whose zeros are whole rows (a layout of positions "
                           "and features gradhooks does not know)")
            recorder.placement.mixing.tokens.unsplit(split.what, counts, split.weighted, source,
                                                     split.length)

    def _judge_split(self, split, tokens):
        """What a plain ``loss.backward()``'s loss split (``split``) leaves to count: ``None``
        where it is proven or left to the token-level mean of :func:`loss_of`; a class-weighted
        mean (whose weight sums the freed target no longer gives) is refused at once; a
        constant factor on it is noted (not readable there: the DP reads refuse)."""
        if split is None:
            return None
        if split.scaled:
            declared, size = self._recorder.loss_reduction, self._recorder.batch_size
            if split.factor is not None and split.top is not None:  # (a Python-number scale)
                tokens.scaled(split.factor * {("sum", "mean"): size, ("mean", "sum"): 1 / size}
                              .get((split.top, declared), 1.0), split.what)
            elif not (split.top == "sum" and declared == "mean"):
                tokens.scaled(None, split.what)  # (a sum scaled under "mean": taken as sum / B)
        samples, size = self._recorder.reads.declared_samples(), self._recorder.batch_size
        if split.proven:
            if samples is None and split.reduction == "mean" and not split.scaled:
                tokens.rows_mean(split.what, size)  # (judged at the read: ids declared later)
            return None
        if (samples is not None and samples != size and split.top == "mean"
                and split.length == size and not split.scaled):
            tokens.rows_mean(split.what, size)  # (sample_ids: a mean over the rows)
            return None
        if split.weighted:  # (refused even where no (B, T, D) grad_output gives the counts)
            tokens.unsplit(split.what, None, True, "")
        if self._loss is not None and self._loss.kind == "tokens":
            return None  # (the token-level mean's own message names its counts)
        return split

    def receive(self, record: Record, leaf: Optional[int], grad: Tensor) -> None:
        """Add a grad_output ``grad`` of ``record`` (of output leaf ``leaf`` for ``multi_io``
        rules) to the batch: relaid out where the placement moved the record's batch dim, summed
        over the meetings of a shared call within one pass.

        Raises:
            GradHooksError: if the record belongs to an earlier batch (a graph built before it).
        """
        if not record.names or record.layer.demoted == record.forward:
            return  # (a replay whose raw parameters came from provenance; a call its parent's
            # replay covers: a parameter read outside the call after it, in the same forward)
        recorder = self._recorder
        if record.step != recorder.batch_id:
            raise GradHooksError(
                f"a backward pass reached module {record.layer.describe()} through a graph built "
                f"before the current batch started (an earlier forward, or one with another batch "
                f"size); per-sample results are per batch: run the backward passes of a forward "
                f"before the next forward, and give one loss only outputs of one batch"
            )
        if recorder.released:  # nothing to add the grad_output to: reads now raise
            recorder.stale = recorder.stale or record.layer.describe()
            recorder.backward_seen = True
            recorder.drop_result()
            return
        if record.swap is not None:  # (T == B, (B * T, D) rows, (T, B) ids: placement)
            grad = relayout(grad, record.swap)
        differentiable = recorder.differentiable
        if grad.requires_grad and recorder.higher_order is None and not differentiable:
            recorder.higher_order = record.layer.describe()
        if not record.hits:  # the first grad_output this call receives
            recorder.reached_records.append(record)
        if grad.dtype in (torch.bfloat16, torch.float16):
            record.low = grad.dtype
        if not differentiable and grad.requires_grad:  # (else a create_graph pass's graph
            grad = grad.detach()  # stays: differentiable reads; a tensor that needs no
            # detaching keeps its attributes: gradhooks' own cotangents, base.utils.OWNED)
        if record.shared is not None and leaf is None:
            # A shared call's parts arrive once per place it meets the batch: one grad_output
            # per backward pass is their sum.
            task = torch_internals.current_graph_task_id()
            if record.grads and record.task == task:
                record.grads[-1] = record.grads[-1] + grad
                return
            record.task = task
        record.hits += 1
        if leaf is None:
            record.grads.append(grad)
        else:
            prev = record.grads[leaf]
            record.grads[leaf] = grad if prev is None else prev + grad
        recorder.backward_seen = True
        if recorder.result is not None:
            recorder.drop_result()
        if self.listener is not None:
            self.listener.hit(record)

    def on_internal(self, record: Record, saved: dict, grad_inputs: tuple,
                    grad_outputs: tuple) -> None:
        """Post-hook on a node a rule asked for (:meth:`LayerRule.internal`): sums its input
        gradients into ``saved["grad_inputs"]`` over the backward passes."""
        recorder = self._recorder
        if utils.PAUSED or recorder.hooks_muted or recorder.released or not recorder.attached:
            return None
        prev = saved.get("grad_inputs")
        new = tuple(None if t is None else t.detach() for t in grad_inputs)
        if prev is not None:
            new = tuple(b if a is None else a if b is None else a + b for a, b in zip(prev, new))
        saved["grad_inputs"] = new
        if self.listener is not None:
            self.listener.hit(record)
        return None

    def on_param_grad(self, pid: int, grad: Tensor) -> None:
        """A watched parameter's gradient (:meth:`gradhooks.core.recorder.attachment.Attachment.watch`):
        added to the batch's totals for the sum check, except in a placement's pull-back."""
        recorder = self._recorder
        if (utils.PAUSED or recorder.hooks_muted or not recorder.attached
                or recorder.placement.pulling):
            return None
        total = recorder.totals.get(pid)
        if total is None:
            total = recorder.totals[pid] = GradTotal(grad)
            ahead = recorder.attachment.hooks_ahead
            if ahead:  # (user hooks that changed this gradient first: named by the sum check)
                total.hooks = ahead.get(pid)
        else:
            total.add(grad)
        recorder.param_passes[pid] = recorder.param_passes.get(pid, 0) + 1
        recorder.backward_seen = True  # (also when no hook ran: the next forward starts anew)
        return None

    def drive(self, loss: Tensor, gradient: Optional[Tensor], retain_graph: bool,
              listen: Optional[Callable[[list, Dict[int, int]], object]] = None,
              create_graph: bool = False) -> bool:
        """The backward pass of :meth:`gradhooks.GradHooks.backward` (see its docstring): asks
        autograd for the hooked layers' output gradients (``GradientEdge`` inputs) instead of the
        parameters', except where the sum check is due (:meth:`SumCheck.edges_allowed`).

        Args:
            loss, gradient, retain_graph, create_graph: as for ``torch.autograd.grad``.
            listen: ``listen(records, events)``, called before an output-edges pass with the
                records below ``loss`` and the hook calls each will get; returns an object whose
                ``hit(record)`` is called on each of those calls during the pass (two-pass
                clipping forms norms as a layer's gradients come in). The calls of records of
                shared calls and raw parameters (``record.shared`` set) are not counted by the
                events where their output met the batch in the forward (their parts come from
                hooks on the meeting operands): the listener must not rely on theirs.

        Returns:
            Whether the pass asked for the output edges (else for the parameters, whose
            gradients go to the sum check of the next read).

        Raises:
            GradHooksError: if the pass must compute parameter gradients and none is trainable.
        """
        with self.judged():
            return self._drive(loss, gradient, retain_graph, listen, create_graph)

    def _drive(self, loss, gradient, retain_graph, listen, create_graph) -> bool:
        recorder = self._recorder
        walked = walk(loss.grad_fn, recorder)
        if walked is None:
            raise GradHooksError(
                "GradHooks.backward(loss) cannot reach the layers inside a reentrant "
                "torch.utils.checkpoint (use_reentrant=True): their backward runs only within "
                "loss.backward(), which torch.autograd.grad does not call into. Use "
                "loss.backward() (exact, per-sample results as usual), or "
                "checkpoint(..., use_reentrant=False)")
        records, captures, events = walked
        key = tuple((id(c.layer), c.names) for c in records)
        # (two-pass clipping counts each record's hook calls from the tags: not those of the
        # meetings of shared calls, whose parts come from hooks on the meeting operands)
        edges_mode = (recorder.sum_check.edges_allowed(key) and recorder.edges_complete
                      and bool(records) and walked is not None)
        recorder.driven = True
        if edges_mode:
            recorder.sum_check_state = "skip"  # this batch's parameter gradients are incomplete
            self.captured = {(id(record), leaf) for _, record, leaf in captures}
            self.listener = None if listen is None else listen(records, events)
            try:
                self._task = None
                grads = torch.autograd.grad(loss, [e for e, _, _ in captures], gradient,
                                            retain_graph=retain_graph, allow_unused=True,
                                            create_graph=create_graph)
                if self._task is None and self.expected is not None:  # (no pre-hook ran:
                    self._split = self.expected  # the first captured grad_output counts)
                    self._count(*next(((g, r) for (_, r, leaf), g in zip(captures, grads)
                                       if g is not None and leaf is None), (None, None)))
                for (_, record, leaf), grad in zip(captures, grads):
                    if grad is not None and leaf != -1:
                        self.receive(record, leaf, grad)
            finally:
                self.captured = frozenset()
                self.listener = None
        else:
            params = [p for p in recorder.params.values() if p.requires_grad]
            if not params:
                raise GradHooksError(
                    "GradHooks.backward: no hooked parameter requires grad; nothing to record")
            torch.autograd.grad(loss, params, gradient, retain_graph=retain_graph,
                                allow_unused=True, create_graph=create_graph)  # (gradient hooks
            # hand them to the sum check)
            if recorder.check and recorder.sum_check_state != "skip":
                recorder.sum_check_state = "due"
                recorder.drive_key = key if recorder.edges_complete else None
        return edges_mode


def _scaling(recorder) -> bool:
    # Whether a declared GradScaler scales the loss of a plain backward (its top Mul).
    scaler = recorder.grad_scaler
    return scaler is not None and scaler.is_enabled()
