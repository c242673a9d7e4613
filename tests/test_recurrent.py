"""nn.LSTM / nn.GRU / nn.RNN and their cells: per-sample gradients against looped autograd.

The reference runs one forward and one backward per sample (the sample's own slice of the input,
of ``h0`` / ``(h0, c0)`` and of the loss weights; a PackedSequence sample is packed alone with
its own length), so it shares nothing with the rule's batched replay.
"""
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import gradhooks
from gradhooks import BatchSizeError, UnsupportedCallError

from conftest import assert_close_to_loop

I, H, P, T = 3, 4, 2, 5  # input, hidden, proj_size, time steps

TYPES = {
    "LSTM": lambda **kw: nn.LSTM(I, H, **kw),
    "GRU": lambda **kw: nn.GRU(I, H, **kw),
    "RNNtanh": lambda **kw: nn.RNN(I, H, **kw),
    "RNNrelu": lambda **kw: nn.RNN(I, H, nonlinearity="relu", **kw),
}

# (num_layers, bidirectional, batch_first, bias, h0 given, B): a covering subset of the product
CONFIGS = [
    (1, False, True, True, True, 3),
    (1, True, False, False, False, 1),
    (2, False, False, True, False, 3),
    (2, True, True, False, True, 3),
    (2, True, False, True, True, 1),
]


def _cid(layers, bidir, batch_first, bias, h0, b, proj=0):
    return "-".join([f"L{layers}", "bi" if bidir else "uni", "bf" if batch_first else "tf",
                     "bias" if bias else "nobias", "h0" if h0 else "noh0", f"B{b}"]
                    + ([f"proj{proj}"] if proj else []))


CASES = [(t, c, 0) for t in TYPES for c in CONFIGS] + [
    ("LSTM", (2, True, False, True, True, 3), P),
    ("LSTM", (1, False, True, False, False, 1), P),
]
CASE_IDS = [f"{t}-{_cid(*c, proj=p)}" for t, c, p in CASES]


@pytest.fixture(autouse=True)
def native_kernels(monkeypatch):
    """Run on torch's native RNN kernels: the oneDNN kernels float32 uses by default on CPU
    JIT-compile per shape (10-200 ms each), which would dominate the run time. Tests that take
    the ``onednn`` fixture run on them."""
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)


@pytest.fixture
def onednn(native_kernels, monkeypatch):
    """torch's default CPU kernels (oneDNN for float32), as a user's model runs."""
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", True)


def compare(model, run, batch, dtype, loss_reduction, batch_first=True, plain=True):
    """Attach, backprop ``run(slice(None))`` (the loss summed over the batch, divided by B for
    "mean"), and compare with one ``run(slice(n, n + 1)).backward()`` per sample. ``plain``:
    by ``loss.backward()``; else by ``gh.backward(loss)`` (a loss that unpacks a
    ``PackedSequence`` output or writes into an output in place: in-place ops on views, which
    the loss graph does not prove and a plain backward refuses, tests/test_loss_graph.py; its
    per-sample losses are checked through the batched graph instead)."""
    model.to(dtype)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    ref = {name: [] for name in params}
    for n in range(batch):
        model.zero_grad()
        run(slice(n, n + 1)).backward()
        for name, p in params.items():
            ref[name].append(torch.zeros_like(p) if p.grad is None else p.grad.clone())
    model.zero_grad()
    ref = {name: torch.stack(g) for name, g in ref.items()}
    with gradhooks.attach(model, loss_reduction=loss_reduction, batch_first=batch_first) as gh:
        loss = run(slice(None))
        loss = loss / batch if loss_reduction == "mean" else loss
        loss.backward() if plain else gh.backward(loss)
        ours = gh.per_sample_grads()
    assert_close_to_loop(ours, ref, dtype)
    return ours, ref


def state_loss(out, state, w, use=("out", "h", "c")):
    """sum_n w_n (|out_n|^2 + sum h_n^3 + sum c_n^3); ``out`` ``(T, B, F)``, states ``(L*D, B, .)``."""
    h, c = state if isinstance(state, tuple) else (state, None)
    losses = 0  # (B,) per-sample losses, summed: a split gradhooks proves (a sum over every
    # element is refused where a ReLU RNN's output row gets an exactly zero gradient)
    if "out" in use:
        losses = losses + (w[:, None] * out.pow(2)).sum((0, 2))
    if "h" in use:
        losses = losses + (w[:, None] * h.pow(3)).sum((0, 2))
    if "c" in use and c is not None:
        losses = losses + (w[:, None] * c.pow(3)).sum((0, 2))
    return losses.sum()


def make_inputs(model, batch, h0, dtype):
    D = 1 + model.bidirectional
    x = torch.randn(T, batch, I, dtype=dtype)
    hx = None
    if h0:
        hx = torch.randn(model.num_layers * D, batch, model.proj_size or H, dtype=dtype)
        if isinstance(model, nn.LSTM):
            hx = (hx, torch.randn(model.num_layers * D, batch, H, dtype=dtype))
    return x, hx, torch.rand(batch, dtype=dtype) + 0.5


def slice_state(hx, sl):
    if hx is None:
        return None
    return tuple(h[:, sl] for h in hx) if isinstance(hx, tuple) else hx[:, sl]


@pytest.mark.parametrize("kind,config,proj", CASES, ids=CASE_IDS)
def test_recurrent_matches_loop(kind, config, proj, loss_reduction, dtype):
    layers, bidir, batch_first, bias, h0, batch = config
    kw = dict(proj_size=proj) if proj else {}
    model = TYPES[kind](num_layers=layers, bidirectional=bidir, batch_first=batch_first, bias=bias, **kw)
    x, hx, w = make_inputs(model, batch, h0, dtype)

    def run(sl):
        xs = x[:, sl].transpose(0, 1) if batch_first else x[:, sl]
        h = slice_state(hx, sl)
        if h is None:
            out, state = model(xs)
        elif batch_first:
            out, state = model(xs, h)
        else:
            out, state = model(xs, hx=h)  # as a keyword
        return state_loss(out.transpose(0, 1) if batch_first else out, state, w[sl])

    ours, _ = compare(model, run, batch, dtype, loss_reduction)
    assert set(ours) == {n for n, _ in model.named_parameters()}


@pytest.mark.parametrize("use", [("out",), ("h",), ("h", "c")],
                         ids=["output_only", "h_n_only", "states_only"])
@pytest.mark.parametrize("kind", list(TYPES))
def test_recurrent_partial_outputs(kind, use, loss_reduction, dtype):
    """A loss that uses only the output (h_n, c_n unreached), only h_n (output and c_n
    unreached), or only the final states."""
    model = TYPES[kind](num_layers=2, bidirectional=True)
    x, hx, w = make_inputs(model, 3, True, dtype)

    def run(sl):
        out, state = model(x[:, sl], slice_state(hx, sl))
        return state_loss(out, state, w[sl], use)

    compare(model, run, 3, dtype, loss_reduction)


@pytest.mark.parametrize("kind", list(TYPES))
def test_onednn_kernels(kind, loss_reduction, onednn):
    """float32 on torch's default CPU kernels (oneDNN), as a user's model runs."""
    model = TYPES[kind](num_layers=2, bidirectional=True, batch_first=True)
    x, hx, w = make_inputs(model, 3, True, torch.float32)

    def run(sl):
        out, state = model(x[:, sl].transpose(0, 1), slice_state(hx, sl))
        return state_loss(out.transpose(0, 1), state, w[sl])

    compare(model, run, 3, torch.float32, loss_reduction)


@pytest.mark.parametrize("sort", [True, False], ids=["sorted", "unsorted"])
@pytest.mark.parametrize("kind", list(TYPES) + ["LSTMproj"])
def test_recurrent_packed(kind, sort, loss_reduction, dtype):
    """PackedSequence of unequal lengths: results in the user's sample order, h0 in that order."""
    kw = dict(num_layers=2, bidirectional=True, batch_first=not sort)
    model = nn.LSTM(I, H, proj_size=P, **kw) if kind == "LSTMproj" else TYPES[kind](**kw)
    lengths = torch.tensor([5, 4, 2, 2] if sort else [2, 5, 1, 4])  # (layout varies with it)
    x, hx, w = make_inputs(model, 4, True, dtype)

    def run(sl):
        xs = x[:, sl].transpose(0, 1) if model.batch_first else x[:, sl]
        packed = pack_padded_sequence(xs, lengths[sl], batch_first=model.batch_first, enforce_sorted=sort)
        out, state = model(packed, slice_state(hx, sl))
        assert (out.sorted_indices is None) == sort
        return state_loss(pad_packed_sequence(out)[0], state, w[sl])

    compare(model, run, 4, dtype, loss_reduction, plain=False)


CELLS = {
    "LSTMCell": lambda **kw: nn.LSTMCell(I, H, **kw),
    "GRUCell": lambda **kw: nn.GRUCell(I, H, **kw),
    "RNNCelltanh": lambda **kw: nn.RNNCell(I, H, **kw),
    "RNNCellrelu": lambda **kw: nn.RNNCell(I, H, nonlinearity="relu", **kw),
}


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("steps", [1, T], ids=["one_call", "python_loop"])
@pytest.mark.parametrize("given", [True, False], ids=["hx", "nohx"])
@pytest.mark.parametrize("kind", list(CELLS))
def test_cell_matches_loop(kind, given, steps, bias, loss_reduction, dtype):
    """A cell called once, or once per time step in a Python loop (calls summed per sample)."""
    batch = 3
    model = CELLS[kind](bias=bias)
    lstm = isinstance(model, nn.LSTMCell)
    x = torch.randn(steps, batch, I, dtype=dtype)
    h0 = torch.randn(batch, H, dtype=dtype), torch.randn(batch, H, dtype=dtype)
    w = torch.rand(batch, dtype=dtype) + 0.5

    def run(sl):
        state = (h0[0][sl], h0[1][sl]) if lstm else h0[0][sl]
        total = 0
        for t in range(steps):
            if t == 0 and not given:
                state = model(x[t, sl])
            else:
                state = model(x[t, sl], state)
            h, c = state if lstm else (state, None)
            total = total + (w[sl, None] * h.pow(2)).sum()
            if c is not None:
                total = total + (w[sl, None] * c.pow(3)).sum()
        return total

    compare(model, run, batch, dtype, loss_reduction)


@pytest.mark.parametrize("kind", list(TYPES))
def test_dropout_in_training_is_refused(kind):
    model = TYPES[kind](num_layers=2, dropout=0.3)
    with gradhooks.attach(model):
        with pytest.raises(UnsupportedCallError, match=r"dropout.*eval\(\)"):
            model(torch.randn(T, 2, I))


@pytest.mark.parametrize("setting", ["eval", "dropout0", "one_layer"])
def test_dropout_eval_or_zero_works(setting, loss_reduction):
    """Dropout off (eval mode, p = 0) or without effect (one layer: torch applies it between
    layers only) is accepted."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that one layer has no dropout
        model = nn.LSTM(I, H, num_layers=1 if setting == "one_layer" else 2,
                        dropout=0.0 if setting == "dropout0" else 0.3)
    if setting == "eval":
        model.eval()
    x, hx, w = make_inputs(model, 3, False, torch.float64)
    compare(model, lambda sl: state_loss(*model(x[:, sl]), w[sl]), 3, torch.float64, loss_reduction)


@pytest.mark.parametrize("module,shape", [
    (nn.LSTM(I, H), (T, I)), (nn.GRU(I, H, batch_first=True), (T, I)), (nn.RNNCell(I, H), (I,)),
    (nn.LSTMCell(I, H), (I,)),
], ids=["LSTM", "GRU-bf", "RNNCell", "LSTMCell"])
def test_unbatched_input_is_refused(module, shape):
    with gradhooks.attach(module):
        with pytest.raises(BatchSizeError, match="unbatched"):
            module(torch.randn(*shape))


def _bf16_lstm_unsupported():
    """Why torch cannot run a bfloat16 LSTM under CPU autocast here, or ``None`` if it can.

    oneDNN's bfloat16 LSTM primitive needs CPU support (AVX-512 BF16 / AMX on x86); without it
    torch raises "could not create a primitive descriptor for the LSTM forward propagation
    primitive" (issue 14, an AMD EPYC Zen 3 with AVX2 only). Tried on a tiny input."""
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            nn.LSTM(2, 2, batch_first=True)(torch.randn(1, 2, 2))
    except RuntimeError as e:
        return f"torch cannot run a bfloat16 LSTM under CPU autocast on this CPU: {e}".split("\n")[0]
    return None


def test_autocast_bf16_computes_in_float32(onednn):
    """Under CPU autocast the rule replays in float32; results are float32 and close to the
    float32 results without autocast (the forward itself ran in bfloat16)."""
    reason = _bf16_lstm_unsupported()
    if reason:
        pytest.skip(reason)
    lstm = nn.LSTM(I, H, num_layers=2, batch_first=True)
    x = torch.randn(4, T, I)
    with gradhooks.attach(lstm, loss_reduction="sum") as gh:
        lstm(x)[0].pow(2).sum().backward()
        plain = {k: v.clone() for k, v in gh.per_sample_grads().items()}
    lstm.zero_grad()
    with gradhooks.attach(lstm, loss_reduction="sum") as gh:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = lstm(x)[0]
        out.float().pow(2).sum().backward()
        auto = gh.per_sample_grads()
    for name, t in auto.items():
        assert t.dtype == torch.float32
        assert (t - plain[name]).abs().max() <= 5e-2 * plain[name].abs().max(), name


@pytest.mark.parametrize("frozen", ["l0", "l1"])
def test_frozen_layer(frozen, loss_reduction, dtype):
    """Only some layers trainable: the others get no entry, the trainable ones stay exact."""
    model = nn.GRU(I, H, num_layers=2, bidirectional=True)
    for name, p in model.named_parameters():
        p.requires_grad_(f"_{frozen}" not in name)
    x, hx, w = make_inputs(model, 3, True, dtype)
    ours, _ = compare(model, lambda sl: state_loss(*model(x[:, sl], hx[:, sl]), w[sl]), 3, dtype,
                      loss_reduction)
    assert all(f"_{frozen}" not in name for name in ours)


def test_module_layout_not_global_flag(loss_reduction, dtype):
    """attach(batch_first=False) with a batch_first=True LSTM: the module's own layout counts."""
    model = nn.LSTM(I, H, batch_first=True)
    x, _, w = make_inputs(model, 3, False, dtype)

    def run(sl):
        out, state = model(x[:, sl].transpose(0, 1))
        return state_loss(out.transpose(0, 1), state, w[sl])

    compare(model, run, 3, dtype, loss_reduction, batch_first=False)


@pytest.mark.parametrize("packed", [False, True], ids=["tensor", "packed"])
@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("kind", list(TYPES))
def test_last_layer_output_is_recorded_not_replayed(kind, layers, packed, monkeypatch,
                                                     loss_reduction, dtype):
    """The last layer's states come from the recorded output: torch's kernel replays only the
    layers below it; the results stay exact."""
    from gradhooks.rules import recurrent_replay as recurrent

    replays = []
    replay = recurrent._layer_output
    monkeypatch.setattr(recurrent, "_layer_output", lambda *a: replays.append(1) or replay(*a))
    model = TYPES[kind](num_layers=layers, bidirectional=True, batch_first=True)
    x, hx, w = make_inputs(model, 3, True, dtype)
    lengths = torch.tensor([5, 2, 4])

    def run(sl):
        xs = x[:, sl].transpose(0, 1)
        if packed:
            xs = pack_padded_sequence(xs, lengths[sl], batch_first=True, enforce_sorted=False)
        out, state = model(xs, slice_state(hx, sl))
        out = pad_packed_sequence(out)[0] if packed else out.transpose(0, 1)
        return state_loss(out, state, w[sl])

    compare(model, run, 3, dtype, loss_reduction, plain=not packed)
    # (through gh.backward the sample check reads the norms too: one more read)
    assert len(replays) == (layers - 1) * (1 if not packed else 2)


@pytest.mark.parametrize("kind", list(TYPES))
def test_output_modified_in_place_is_replayed(kind, monkeypatch, loss_reduction, dtype):
    """An output modified in place after the forward is not used (its version changed): the
    rule replays the last layer too, and the results stay exact."""
    from gradhooks.rules import recurrent_replay as recurrent

    replays = []
    replay = recurrent._layer_output
    monkeypatch.setattr(recurrent, "_layer_output", lambda *a: replays.append(1) or replay(*a))
    model = TYPES[kind](num_layers=1)
    x, hx, w = make_inputs(model, 3, True, dtype)

    def run(sl):
        out, state = model(x[:, sl], slice_state(hx, sl))
        out = out.view_as(out)  # a view, so that the in-place op below is allowed by autograd
        out.mul_(2)
        return state_loss(out, state, w[sl])

    compare(model, run, 3, dtype, loss_reduction, plain=False)
    assert len(replays) == 2  # (two reads: gh.backward's sample check, then the test's)
