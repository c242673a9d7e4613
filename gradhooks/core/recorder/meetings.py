"""Where a shared call's output (or a raw parameter) meets the batch: the placement's two
provenance callbacks, in the forward (:func:`note_meeting`: mark the meeting, lay out a call
recorded on its rows) and in the backward (:func:`pull_back`: each sample's cotangent where they
met, pulled back to the sources by one batched vector-Jacobian product and handed to the
recorder). :mod:`gradhooks.core.analysis.provenance` explains the meetings; ``placement`` is the
:class:`~gradhooks.core.recorder.placement.Placement` (duck-typed: this module sits below it).

Index conventions: ``B`` the batch size.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ...base import utils
from ...base.segments import Segments
from ..analysis import as_batch, meeting_cotangent, source_cotangent
from .graph import mark
from .layouts import reads_batch_at

__all__ = ["note_meeting", "pull_back"]


def note_meeting(placement, sources: tuple, how: str, u_b: Optional[Tensor],
                 direct: Optional[int], dim: Optional[int]) -> None:
    """Provenance's ``noted`` (:meth:`~gradhooks.core.recorder.placement.Placement.on_noted`): in the
    forward, where a shared call's output meets the batch (as ``u_b``).

    The output-edges pass of ``gh.backward`` asks for the gradient below ``u_b``, so that
    autograd runs its hook. A call on ``B`` rows whose output meets the batch only row by
    row, itself (a learned initial state, or one made from the batch size), is recorded as
    an ordinary call on its ``B`` rows (``"rows"``: no ``B x B`` expansion); any other
    meeting makes it ``B`` identical samples again. Only a call whose output itself meets
    the batch, always by broadcasts that add the batch dim as its record's layout does, or
    always row by row, can be planned (else it is added to ``plain``)."""
    prov, recorder = placement.provenance, placement.recorder
    kinds = prov.kinds
    for source in sources:
        record = source[0]
        fits = (how == "direct" or how == "broadcast" and recorder.batch_first
                and direct == {"expand": 0, "prepend": 1}.get(record.shared))
        if direct is None or not fits or kinds.setdefault(id(record), how) != how:
            prov.plain.add(id(record))
    if u_b is None:
        return
    placement.met = True
    if recorder.driven:
        recorder.edges_complete &= mark(recorder, sources[0][0], [], u_b.grad_fn)
    for record, _, _ in sources:
        if record.spec is not None:
            continue
        layout = record.shared
        if how == "direct" and layout.startswith("prepend") and not record.met:
            # (its input has B rows, lined up with the batch where its output meets it)
            rows_dim = 1 if layout == "prepend1" else 0
            one = record.a.select(rows_dim, 0) if record.a.shape[rows_dim] else None
            if (one is not None and one.dim() > dim
                    and one.shape[dim] == record.a.shape[rows_dim]
                    and reads_batch_at(record.layer, one.shape, one.dtype, dim,
                                       recorder.batch_first)):
                record.a, record.shared, record.rows = one, "rows", layout
        elif how != "direct" and record.shared == "rows":
            record.a = as_batch(record.a, record.a.shape[0], record.rows)
            record.shared = record.rows
        record.met = True


def pull_back(placement, edge, sources: tuple, how: str, shape: tuple, grad: Tensor,
              dim) -> None:
    """Provenance's ``meet`` (:meth:`~gradhooks.core.recorder.placement.Placement.on_meeting`, a tensor
    hook in the backward): the gradient ``grad`` of a source-carrying tensor of ``shape`` where
    it met the batch (on dim ``dim``, or ``(dim, inner)`` for ``B * inner`` merged rows); its
    per-sample part, pulled back to each source (a shared call's output, a parameter) and
    handed to the recorder.

    The per-sample cotangents are :func:`meeting_cotangent`'s; ``"direct"`` for a call
    recorded on its rows (learned initial states): ``grad`` is its ordinary grad_output."""
    recorder = placement.recorder
    if utils.PAUSED or recorder.hooks_muted or not recorder.attached:
        return None
    first = sources[0][0]
    if how == "direct" and first.shared == "rows":
        if first.step == recorder.batch_id:
            recorder.backward_pass.receive(first, None, grad)
        return None
    cotangent = meeting_cotangent(grad, how, shape, dim)
    size = cotangent.shape[0]
    live = [s for s in sources if s[0].step == recorder.batch_id]
    if not live:
        return None
    # (u itself is a source: its cotangent as it is; autograd would hand back the batched
    # grad_output unwrapped from its vmap)
    same = [e.node is edge.node and e.output_nr == edge.output_nr for _, e, _ in live]
    pulled = [cotangent if s else None for s in same]
    rest = [i for i, s in enumerate(same) if not s]
    if rest and size == 0:  # (autograd's batched grad needs a sample)
        for i in rest:
            pulled[i] = cotangent.new_zeros((0, *live[i][2]))
    elif rest:
        if isinstance(cotangent, Segments):  # (pulled back through ops: autograd needs it formed)
            cotangent = cotangent.dense()
        placement.pulling = True  # (a raw parameter's gradient hooks see this pass: not theirs)
        try:
            got = torch.autograd.grad([edge], [live[i][1] for i in rest], [cotangent],
                                      retain_graph=True, allow_unused=True,
                                      is_grads_batched=True)
        finally:
            placement.pulling = False
        for i, g in zip(rest, got):
            pulled[i] = g
    receive = recorder.backward_pass.receive
    for (record, _, _), g in zip(live, pulled):
        if g is not None:
            receive(record, 0 if record.spec is not None else None,
                    source_cotangent(g, record.shared))
    return None
