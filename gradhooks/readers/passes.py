"""Several backward passes through one forward, read pass by pass: the driver behind the
per-sample Jacobians (:mod:`gradhooks.readers.jacobians`), the GGN square root (:mod:`gradhooks.readers.curvature.ggn`)
and the NTK (:mod:`gradhooks.readers.gram`).

The recorder accumulates the backward passes through one forward: a single-output record keeps
one grad_output per pass in ``Record.grads``, a ``multi_io`` record sums them per output leaf.
A reader that needs each pass on its own (pass ``c`` sends the cotangent ``e_c`` into the model
output, and its per-sample gradients are the ``c``-th output's per-sample Jacobian rows) runs
the passes here and, after each, *takes* the pass's grad_outputs out of the records
(:func:`run_passes`): the single-output records' new entry is popped, the ``multi_io`` records'
leaves (and a rule's internal ``grad_inputs``) are reset to ``None``. So each pass is read
exactly (no difference of running sums) and the records hold one pass at a time. At the end the
batch is released like ``per_sample_grads()`` releases it: later reads of this batch raise
:class:`~gradhooks.base.errors.RecordsReleasedError` (their grad_outputs were consumed).

Why one pass per cotangent is exact: with samples treated independently (every hooked rule's
assumption), ``sum_n <e_c, f(x_n)>`` has the gradient ``sum_n J_n^T e_c`` and the rules split
it per sample, so pass ``c`` gives ``J_n^T e_c`` for every ``n`` at once (Goodfellow 2015,
arXiv:1510.01799; the same loop over output dimensions as BackPACK's ``SqrtGGNExact`` and
ASDL's ``batch_jacobian``).
"""
from __future__ import annotations

from typing import Iterable, Iterator, List, NamedTuple, Optional

from torch import Tensor

from ..base.errors import BatchSizeError, GradHooksError, NoBackwardError
from ..base.segments import Segments
from ..core.recorder.capture import Layer, Recorder

__all__ = ["PassCall", "run_passes", "check_output"]


class PassCall(NamedTuple):
    """One call of a hooked module in one backward pass.

    Attributes:
        layer: the hooked :class:`~gradhooks.core.recorder.records.Layer`.
        a: the call's input activations (a :class:`~gradhooks.base.forms.Call` for ``multi_io``
            rules, with this pass's internal ``grad_inputs``).
        grads: this pass's grad_output as the rule takes it: a one-element list for
            single-output rules, the output's structure for ``multi_io`` rules.
        names: the call's trainable parameter names (local to the module).
    """

    layer: Layer
    a: object
    grads: object
    names: tuple


def check_output(recorder: Recorder, output: Tensor, read: str) -> None:
    """Refuse an ``output`` the per-pass readers cannot differentiate: not a tensor of the
    current batch's forward that requires grad, not batched on dim 0, or a forward that a
    backward pass already reached (its records hold that pass's grad_outputs); a batch with
    ``sample_ids`` (:class:`~gradhooks.base.errors.SampleIdsError`: these reads are per row)."""
    recorder.reads.groups(read)  # (refuses sample_ids: not one of the reads that group rows)
    if not isinstance(output, Tensor) or not output.requires_grad:
        raise GradHooksError(f"{read}: output must be a tensor that requires grad, the output of "
                             f"a forward of the hooked model (not under torch.no_grad())")
    if recorder.batch_size is None:
        raise NoBackwardError(f"{read}: no forward of the hooked model has recorded a batch")
    if output.dim() == 0 or output.shape[0] != recorder.batch_size:
        raise BatchSizeError(
            f"{read}: the output has shape {tuple(output.shape)} but the hooked layers saw batch "
            f"size {recorder.batch_size}; the output must be batched on dim 0 (movedim it)")
    if recorder.records:
        raise GradHooksError(
            f"{read} runs its own backward passes through the forward, but a backward pass "
            f"already reached the hooked layers after it: run the forward again and call {read} "
            f"before any backward pass")


def _take(cap) -> Optional[PassCall]:
    # This pass's grad_outputs of ``cap``, removed from it; None if the pass did not reach it.
    layer = cap.layer
    if cap.spec is None:
        if not cap.grads:
            return None
        g = cap.grads.pop()
        return PassCall(layer, cap.a, [g], cap.names)
    internal = cap.a.internal
    inner = internal.pop("grad_inputs", None) if internal else None
    leaves = list(cap.grads)
    reached = False
    for i, t in enumerate(leaves):
        if isinstance(t, Segments) or (isinstance(t, Tensor)
                                       and (t.is_floating_point() or t.is_complex())):
            cap.grads[i] = None
            reached = True
    if not reached and inner is None:
        return None
    a = cap.a if inner is None else cap.a._replace(internal={**internal, "grad_inputs": inner})
    return PassCall(layer, a, cap.grad_tree(leaves), cap.names)


def run_passes(recorder: Recorder, output: Tensor, cotangents: Iterable[Tensor], count: int,
               read: str, create_graph: bool = False) -> Iterator[List[PassCall]]:
    """Run one backward pass of ``output`` per cotangent and yield each pass's calls.

    Args:
        recorder: the :class:`~gradhooks.core.recorder.capture.Recorder`, after the forward that made
            ``output`` and before any backward pass through it (:func:`check_output`).
        output: the tensor to differentiate, ``(B, ...)``.
        cotangents: ``count`` tensors shaped like ``output`` (the gradient w.r.t. ``output`` of
            each pass), made lazily.
        count: how many there are (the graph is kept until the last).
        read: the reading call, for messages.
        create_graph: run the passes with ``create_graph=True`` (the graph is then kept after
            the last pass too): with ``attach(..., differentiable=True)`` the calls' ``a`` and
            grad_outputs carry the autograd graph, for a differentiable read.

    Yields:
        Per pass, the :class:`PassCall` of every call the pass reached, in the order reached;
        consume them before the next pass is run (the generator then drops them).

    Raises:
        HigherOrderGradError, GradientMismatchError: as :meth:`Recorder.snapshot`.
        GradHooksError: with ``create_graph`` on a recorder not attached with
            ``differentiable=True`` (its records are detached).
    """
    check_output(recorder, output, read)
    if create_graph and not recorder.differentiable:
        raise GradHooksError(
            f"{read} with create_graph=True needs records that keep their autograd graphs: "
            f"attach the model with gradhooks.attach(model, differentiable=True)")
    for c, cot in enumerate(cotangents):
        last = c == count - 1
        recorder.drive(output, cot.to(output.dtype), retain_graph=create_graph or not last,
                       create_graph=create_graph)
        batch = recorder.snapshot(read, sum_check=False, release=last)
        calls = [t for t in map(_take, batch.records) if t is not None]
        yield calls
        del calls
    for cap in recorder.records:
        cap.release()
