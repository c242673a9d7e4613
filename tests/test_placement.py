"""Batch placement on its own: no model, no hooks, a stub recorder. What each call is (batched,
shared, planned), the relayouts of the hard cases (``T == B`` after a transpose, ``(B * T, D)``
rows), the plans a tracked forward leaves, the refusals, and the per-sample cotangents taken
where a shared tensor meets the batch."""
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from gradhooks.base.errors import BatchSizeError
from gradhooks.base.registry import find_rule
from gradhooks.core.recorder.check_policy import SumCheck
from gradhooks.core.recorder.placement import (
    BATCHED,
    PLANNED,
    SHARED,
    Placed,
    Placement,
    layout_swap,
    meeting_cotangent,
    partial_batch_hint,
    reads_batch_at,
    recomputed_error,
    relayout,
    shared_call_layout,
)
from gradhooks.core.recorder.records import Layer

B = T = 4  # T == B: sizes never tell where the batch is
D = 3


def _layer(module: nn.Module, path: str = "lin") -> Layer:
    return Layer(path, module, find_rule(module, path), dict(module.named_parameters()))


def _recorder(batch_first: bool = True, layers=()):
    received = []
    return SimpleNamespace(
        batch_first=batch_first, layers=list(layers), attachment=SimpleNamespace(raw_params={}),
        batch_id=1, forward_id=1, batch_size=4, calls=0, driven=False, edges_complete=False,
        hooks_muted=False, attached=True, sum_check=SumCheck(True), model=nn.Identity(),
        backward_pass=SimpleNamespace(receive=lambda rec, leaf, g: received.append((rec, leaf, g))),
        received=received)


def _placement(**kw):
    recorder = _recorder(**kw)
    return Placement(recorder, demote=lambda layer: None), recorder


def test_relayout_swaps_dims_and_splits_rows():
    x = torch.randn(T, B, D)
    assert torch.equal(relayout(x, ("swap", 1, 0)), x.transpose(0, 1))
    rows = torch.randn(B * T, D)
    assert relayout(rows, ("split", 0, B, T)).shape == (B, T, D)
    assert torch.equal(relayout(rows, ("split", 0, B, T)).reshape(B * T, D), rows)


def test_reads_batch_at_asks_the_rule_never_a_size():
    layer = _layer(nn.Linear(D, 2))
    # (B, T, D) with B == T: only the rule's own convention decides
    assert reads_batch_at(layer, (B, T, D), torch.float32, 0, batch_first=True)
    assert not reads_batch_at(layer, (B, T, D), torch.float32, 1, batch_first=True)
    assert reads_batch_at(layer, (T, B, D), torch.float32, 1, batch_first=False)


def test_untracked_unplanned_call_is_ordinary():
    placement, _ = _placement()
    lin = nn.Linear(D, 2)
    x = torch.randn(B, T, D)
    assert placement.place(_layer(lin), x, lin(x), None, (x,)) is None
    assert placement.ordinals == {}


def test_tracked_calls_are_batched_or_shared_by_data_flow():
    placement, _ = _placement()
    lin, table = nn.Linear(D, D), nn.Linear(D, D)
    layer, shared_layer = _layer(lin), _layer(table, "table")
    x = torch.randn(B, T, D)
    placement.start([x], training=True)
    try:
        assert placement.provenance is not None
        out = lin(x)
        assert placement.place(layer, x, out, None, (x,)) == Placed(BATCHED, None, None, 1, None)
        # a (T, D) input that does not come from the batch, with T == B: shared all the same
        ids = torch.randn(T, D)
        placed = placement.place(shared_layer, ids, table(ids), None, (ids,))
        assert placed.kind == SHARED and placed.ordinal == 1
        assert placement.place(layer, x, lin(x), None, (x,)).ordinal == 2
    finally:
        placement.end_forward(True, 1)
    assert placement.provenance is None


def test_transposed_batch_is_swapped_back_with_t_equal_b():
    # FSMT: a batch-first model that runs its layers on (T, B, D); with T == B the declared
    # layout would read the positions as samples
    placement, _ = _placement()
    lin = nn.Linear(D, 2)
    layer = _layer(lin)
    x = torch.randn(B, T, D)
    placement.start([x], training=True)
    try:
        h = x.transpose(0, 1)
        placed = placement.place(layer, h, lin(h), None, (h,))
        assert placed.kind == BATCHED and placed.swap == ("swap", 1, 0)
        assert torch.equal(relayout(h, placed.swap), x)
    finally:
        placement.end_forward(True, 1)
    assert list(placement.signatures.values()) == ["mode"]  # (relayouts: tracked every time)


def test_flattened_rows_are_split_into_samples():
    # OPT: (B * T, D) rows before the feed-forward
    placement, _ = _placement()
    lin = nn.Linear(D, 2)
    x = torch.randn(B, T, D)
    placement.start([x], training=True)
    try:
        rows = x.reshape(B * T, D)
        swap = layout_swap(placement.provenance, _layer(lin), rows, batch_first=True)
        assert swap == ("split", 0, B, T)
    finally:
        placement.stop()


def test_signature_without_shared_calls_is_tracked_once():
    placement, _ = _placement()
    x = torch.randn(B, T, D)
    placement.start([x], training=True)
    placement.end_forward(True, 1)
    assert list(placement.signatures.values()) == [{}]
    placement.start([torch.randn(B, T, D)], training=True)
    assert placement.provenance is None and placement.plan is None
    placement.start([torch.randn(B, T, D)], training=False)  # (another signature)
    assert placement.provenance is not None
    placement.stop()


def test_shared_call_met_by_a_broadcast_is_planned_and_pulled_back_per_sample():
    placement, recorder = _placement()
    table = nn.Linear(D, D)
    layer = _layer(table, "table")
    x = torch.randn(B, T, D, requires_grad=True)
    placement.start([x], training=True)
    try:
        ids = torch.randn(T, D)
        pos = table(ids)
        placed = placement.place(layer, ids, pos, None, (ids,))
        record = placement.record_shared(layer, (ids,), {}, pos, layer.trainable(), ids,
                                         placed.ordinal)
        h = x + pos  # (B, T, D) + (T, D): a broadcast that adds the batch dim
    finally:
        placement.end_forward(True, 1)
    assert record.shared == "prepend" and record.a.shape == (B, T, D)
    assert recorder.calls == 1 and id(layer) in placement.shared_layers and placement.met
    assert list(placement.signatures.values()) == [{(id(layer), 1): "prepend"}]
    h.square().sum().backward()
    ((got, leaf, cotangent),) = recorder.received
    assert got is record and leaf is None
    torch.testing.assert_close(cotangent, 2 * h.detach())  # each sample's own cotangent


def test_planned_forward_follows_the_plan_without_tracking():
    placement, _ = _placement()
    lin = nn.Linear(D, D)
    layer = _layer(lin)
    x = torch.randn(B, T, D)
    key = (((tuple(x.shape), x.dtype),), True)
    placement.signatures[key] = {(id(layer), 1): "expand", (id(layer), 2): "rows"}
    placement.start([x], training=True)
    assert placement.provenance is None and placement.plan_size == B
    ids = torch.randn(1, T, D)
    assert placement.place(layer, ids, lin(ids), None, (ids,)) == Placed(PLANNED, B, None, 1,
                                                                        "expand")
    assert placement.place(layer, x, lin(x), None, (x,)) is None  # "rows": ordinary
    assert placement.place(layer, x, lin(x), None, (x,)) is None  # not in the plan
    placement.end_forward(True, 1)
    assert placement.plan is None


def test_refused_meeting_raises_at_the_read_and_goes_with_the_batch():
    placement, _ = _placement()
    table = nn.Linear(D, D)
    layer = _layer(table, "table")
    x = torch.randn(B, T, D)
    placement.start([x], training=True)
    try:
        ids = torch.randn(T, D)
        pos = table(ids)
        placement.record_shared(layer, (ids,), {}, pos, layer.trainable(), ids, 1)
        torch.einsum("btd,td->td", x, pos)  # (the samples summed: not split per sample)
    finally:
        placement.end_forward(True, 1)
    error = placement.refusal("per_sample_grads()")
    assert isinstance(error, BatchSizeError)
    assert "table" in str(error) and "einsum" in str(error) and "per_sample_grads()" in str(error)
    assert list(placement.signatures.values()) == ["mode"]
    placement.reset_batch()
    assert placement.refusal("per_sample_grads()") is None


def test_refusals_of_a_forward_that_raised_are_dropped():
    placement, _ = _placement()
    table = nn.Linear(D, D)
    layer = _layer(table, "table")
    x = torch.randn(B, T, D)
    placement.start([x], training=True)
    ids = torch.randn(T, D)
    pos = table(ids)
    placement.record_shared(layer, (ids,), {}, pos, layer.trainable(), ids, 1)
    torch.einsum("btd,td->td", x, pos)
    placement.end_forward(False, 1)
    assert placement.refusal("per_sample_grads()") is None
    assert placement.signatures == {}  # (nothing learnt from a forward that raised)


def test_nested_model_forward_ends_with_the_outer_call():
    placement, _ = _placement()
    assert not placement.nest()
    placement.start([torch.randn(B, D)], training=True)
    assert placement.nest()
    placement.end_forward(True, 1)
    assert placement.provenance is not None
    placement.end_forward(True, 1)
    assert placement.provenance is None


def test_shared_call_with_two_outputs_is_refused():
    placement, _ = _placement()
    layer = _layer(nn.Linear(D, D), "table")
    placement.start([torch.randn(B, D)], training=True)
    try:
        with pytest.raises(BatchSizeError, match="one tensor input and one tensor output"):
            placement.record_shared(layer, (), {}, (torch.ones(1), torch.ones(1)),
                                    layer.trainable(), None, 1)
    finally:
        placement.stop()


@pytest.mark.parametrize("batch_first,expected", [(True, "prepend"), (False, "prepend1")],
                         ids=["batch_first", "seq_first"])
def test_shared_call_layout_follows_the_rule(batch_first, expected):
    lin = nn.Linear(D, D)
    ids = torch.randn(T, D)
    assert shared_call_layout(_layer(lin), ids, lin(ids), (ids,), {}, batch_first) == expected


def test_meeting_cotangent_broadcast_and_rows():
    grad = torch.randn(T, B, D)  # u: (T, 1, D) broadcast over dim 1 of (T, B, D)
    cot = meeting_cotangent(grad, "broadcast", (T, 1, D), 1)
    assert cot.shape == (B, T, 1, D)
    torch.testing.assert_close(cot[2, :, 0], grad[:, 2])
    grad = torch.randn(B, D)  # u: (B, D) lined up row by row with the batch on dim 0
    cot = meeting_cotangent(grad, "rows", (B, D), 0)
    assert cot.shape == (B, B, D)
    for n in range(B):
        torch.testing.assert_close(cot[n, n], grad[n])
        assert cot[n].abs().sum() == grad[n].abs().sum()


def test_hints_and_errors_name_the_fix():
    opacus_cell = type("RNNLinear", (nn.Linear,), {"__module__": "opacus.layers.dp_rnn"})(D, D)
    assert "nn.LSTM" in partial_batch_hint(opacus_cell, "default")
    assert partial_batch_hint(nn.Linear(D, D), "default") == "default"
    error = recomputed_error(_layer(nn.Linear(D, D), "pos"))
    assert isinstance(error, BatchSizeError) and "checkpoint" in str(error)
