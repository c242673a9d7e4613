"""Where the placement runs the check of a forward alone
(:func:`~gradhooks.core.analysis.alone.forward_alone`): on the ops of an analysed forward that no
rule proves keep the samples apart (:func:`verify_unproven`), and on a planned forward whose
structure is not its input signature's earlier ones (:func:`verify_changed`). Both add their
verdicts to the batch's (:class:`~gradhooks.core.analysis.mixing.Mixing`), refused at its reads.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...base.torch_internals import reached
from ...base.utils import tensors
from ..analysis import BY_VALUES, NO_CHECK, UNCHECKED, UNPROVEN, forward_alone

__all__ = ["verify_unproven", "verify_changed"]


@torch.compiler.disable
def verify_unproven(placement, prov, call: Optional[tuple]) -> None:
    """At the end of a tracked forward that noted ops no rule proves keep the samples apart
    (:attr:`~gradhooks.core.analysis.provenance.Provenance.unproven`): accept them when the forward
    alone reproduces the batch's rows (:func:`~gradhooks.core.analysis.alone.forward_alone`, once per
    signature, structure (:attr:`~gradhooks.core.recorder.check_policy.SumCheck.structure`) and
    set of such ops: the placement's ``verified``), else add them to the forward's
    verdicts, refused at the reads. ``placement``: the
    :class:`~gradhooks.core.recorder.placement.Placement` (duck-typed); ``prov``: the forward's
    :class:`~gradhooks.core.analysis.provenance.Provenance`; ``call``: ``(args, kwargs, output)``
    of the model's forward. Not traced by ``torch.compile`` (it runs the model)."""
    recorder = placement.recorder
    ops = prov.unproven
    if call is not None:  # (those whose results the outputs do not depend on: a side computation)
        on = reached(tensors(call[2]), (), {n for _, _, n in ops.values() if n is not None})
        off = {n: what for _, what, n in ops.values() if n is not None and n not in on}
        if off:
            recorder.backward_pass.spans.off_outputs(off)
            ops = {k: v for k, v in ops.items() if v[2] not in off}
    verified = placement.verified.setdefault((prov.signature, recorder.sum_check.structure),
                                             set())
    if set(ops) <= verified:
        return  # (signatures tracked on every forward, a mixture of experts' routing: once)
    passed, why = False, f"{NO_CHECK}: the model's forward was not seen whole"
    if call is not None and not getattr(recorder, "allow_sample_mixing", False):
        args, kwargs, output = call
        passed, why = forward_alone(recorder.model, args, kwargs, output, prov.batch_size,
                                    prov.batch_dim, lambda t: prov.look(t)[2],
                                    recorder.sum_check.rng)
    if passed:  # (but a verdict of this batch's sizes holds for it alone: checked again)
        verified.update(k for k, (_, what, _) in ops.items() if BY_VALUES not in what)
    else:
        prov.mixing.extend((UNPROVEN, f"{what}. The check of the forward alone: {why}")
                           for _, what, _ in ops.values())


@torch.compiler.disable
def verify_changed(placement, call: Optional[tuple]) -> None:
    """At the end of a planned forward whose structure is not its input signature's earlier
    ones (a branch taken: :meth:`~gradhooks.core.recorder.check_policy.SumCheck.forward_end`):
    the check of the forward alone (:func:`~gradhooks.core.analysis.alone.forward_alone`) on it,
    so that a branch that mixes the samples is refused at this batch's reads
    (``UnprovenOpError``), also after a plain ``loss.backward()``; the next forward is analysed.

    Where no check is possible (inputs without the batch size on their batch dim, an output
    without it, a forward whose rerun with the random generators put back does not reproduce it) nothing proves the new structure keeps the
    samples apart: the batch's reads are refused (``UnprovenOpError``, naming why) unless its
    sample check through the batched graph passes (per-sample losses through ``gh.backward``
    or ``gh.clipped_backward``: :meth:`~gradhooks.core.analysis.mixing.Mixing.checked`). A
    batch of one sample, which nothing can mix, is not checked. ``placement``: the
    :class:`~gradhooks.core.recorder.placement.Placement` (duck-typed); ``call``: ``(args,
    kwargs, output)`` of the model's forward. Not traced by ``torch.compile``."""
    recorder = placement.recorder
    if getattr(recorder, "allow_sample_mixing", False) or placement.plan_size < 2:
        recorder.sum_check.accept()
        return
    passed, why = False, f"{NO_CHECK}: the model's forward was not seen whole"
    if call is not None:
        args, kwargs, output = call
        passed, why = forward_alone(recorder.model, args, kwargs, output, placement.plan_size,
                                    0 if recorder.batch_first else 1, lambda t: None,
                                    recorder.sum_check.rng)
    if passed:  # (this batch's: a structure joins its signature's once an analysis proves it)
        return
    what = (f"a forward of {type(recorder.model).__name__} whose structure is not its input "
            f"signature's earlier ones (a branch taken: it ran other differentiable ops)")
    if why.startswith(NO_CHECK):
        placement.mixing.batch.append((UNCHECKED, (
            f"{what}, and the check of the forward alone could not verify it ({why}). A "
            f"sample check verifies it: per-sample losses, shape (B,), through "
            f"gh.backward(losses.mean()) or gh.clipped_backward(losses, max_norm); "
            f"attach(..., check='always') analyses every forward instead")))
    else:
        placement.mixing.batch.append((UNPROVEN, (
            f"{what}. The check of the forward alone: {why}. (A forward that also reads "
            f"statistics of its raw inputs or detached ones, which are exact, fails this "
            f"check too: attach(..., allow_sample_mixing=True) accepts it)")))
