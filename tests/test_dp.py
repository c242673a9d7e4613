"""Per-sample gradient norms and DP-SGD clipping (gradhooks.readers.norms, gradhooks.readers.dp.clipping) against looped autograd."""
import pathlib
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

import gradhooks
from gradhooks.readers import ghost_sums, plan, verify
from gradhooks.readers.dp import clipping
from gradhooks.rules import conv

from conftest import RTOL, loop_grads, weighted_square_loss

FALLBACK_OK = pytest.mark.filterwarnings("ignore::gradhooks.FallbackWarning")


# ------------------------------------------------------------------------------------ models
class CNN(nn.Module):
    """Convs with stride, padding, dilation, groups, asymmetric 'same' + reflect padding."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3, stride=2, padding=1)
        self.conv2 = nn.Conv2d(4, 6, 3, padding=2, dilation=2, groups=2)
        self.conv3 = nn.Conv2d(6, 4, 2, padding="same", padding_mode="reflect", bias=False)
        self.conv4 = nn.Conv1d(4, 3, 3, stride=2)
        self.head = nn.Linear(3 * 12, 3)

    def forward(self, x):                               # (B, 2, 9, 9)
        x = torch.tanh(self.conv2(torch.tanh(self.conv1(x))))   # (B, 6, 5, 5)
        x = torch.tanh(self.conv3(x)).flatten(2)                 # (B, 4, 25)
        return self.head(torch.tanh(self.conv4(x)).flatten(1))   # conv4: (B, 3, 12)


class Bottleneck(nn.Module):
    """Pointwise (1x1) convolutions as in a ResNet bottleneck (stride 1 and 2, grouped, 1-D and
    3-D), whose per-sample gradients and weighted sums are batched matmuls of the input itself,
    around a 3x3 convolution and a padded 1x1 (not pointwise: its borders see the padding)."""

    def __init__(self):
        super().__init__()
        self.reduce = nn.Conv2d(4, 2, 1, bias=False)
        self.mid = nn.Conv2d(2, 2, 3, padding=1)
        self.expand = nn.Conv2d(2, 6, 1, stride=2)
        self.grouped = nn.Conv2d(6, 4, 1, groups=2)
        self.padded = nn.Conv2d(4, 4, 1, padding=1, padding_mode="reflect", bias=False)
        self.deep = nn.Conv3d(4, 3, 1, stride=(1, 2, 1))
        self.line = nn.Conv1d(3, 2, 1)
        self.head = nn.Linear(2 * 12, 3)

    def forward(self, x):                                        # (B, 4, 7, 7)
        x = torch.tanh(self.mid(torch.tanh(self.reduce(x))))    # (B, 2, 7, 7)
        x = torch.tanh(self.grouped(torch.tanh(self.expand(x))))  # (B, 4, 4, 4)
        x = torch.tanh(self.padded(x)).unsqueeze(2)             # (B, 4, 1, 6, 6)
        x = torch.tanh(self.deep(x)).flatten(2)                 # (B, 3, 18)
        return self.head(torch.tanh(self.line(x[..., :12])).flatten(1))


class Depthwise(nn.Module):
    """Depthwise convolutions as in ConvNeXt / EfficientNet (7x7 'same', a channel multiplier
    with stride 2, 1-D with dilation), whose per-sample gradients on the CPU are forward
    convolutions of the input by grad_output (the "correlation" method), and their weighted
    sums those contracted with the clipping factors; a 3x3 one by the weight-backward kernel."""

    def __init__(self):
        super().__init__()
        self.dw7 = nn.Conv2d(3, 3, 7, padding=3)
        self.mult = nn.Conv2d(3, 6, 5, stride=2, padding=2, groups=3, bias=False)
        self.line = nn.Conv1d(6, 6, 5, dilation=2, groups=6, padding_mode="reflect", padding=4)
        self.small = nn.Conv1d(6, 6, 3, groups=6, padding=1)
        self.head = nn.Linear(6 * 16, 3)

    def forward(self, x):                                        # (B, 3, 8, 8)
        x = torch.tanh(self.mult(torch.tanh(self.dw7(x))))      # (B, 6, 4, 4)
        return self.head(torch.tanh(self.small(self.line(x.flatten(2)))).flatten(1))


class ClassToken(nn.Module):
    """A ViT's stem in small: a learned class token (raw parameter, expanded to the batch) and a
    position embedding (raw parameter, broadcast) meet the batch; an MLP block; the head reads
    the class token."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 6)
        self.cls = nn.Parameter(torch.randn(1, 1, 6))
        self.pos = nn.Parameter(0.1 * torch.randn(1, 5, 6))
        self.fc1, self.fc2, self.head = nn.Linear(6, 8), nn.Linear(8, 6), nn.Linear(6, 2)

    def forward(self, x):                                        # (B, 4, 3)
        h = torch.cat([self.cls.expand(x.shape[0], -1, -1), self.proj(x)], 1) + self.pos
        h = h + self.fc2(torch.tanh(self.fc1(torch.tanh(h))))   # (B, 5, 6)
        return self.head(torch.tanh(h[:, 0]))


class Twice(nn.Module):
    """One Linear called twice in a forward."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.inner(torch.tanh(self.inner(x)))))


class Affine(nn.Module):
    """A layer without rule (the torch.func fallback covers it)."""

    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(d) + 0.5)
        self.shift = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return x * self.scale + self.shift


class Tied(nn.Module):
    """Weights tied between two Linear layers, and a Linear bias tied to the shift of a layer
    without rule (a parameter shared between a closed form and the torch.func fallback)."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(5, 5)
        self.l2 = nn.Linear(5, 5)
        self.l2.weight = self.l1.weight
        self.act = Affine(5)
        self.act.shift = self.l2.bias
        self.head = nn.Linear(5, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.act(self.l2(torch.tanh(self.l1(x))))))


class TiedLM(nn.Module):
    """Embedding -> LSTM -> Linear head tied to the embedding (closed form + rule, one param)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.rnn = nn.LSTM(6, 6, batch_first=True)
        self.head = nn.Linear(6, 11)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(self.rnn(self.emb(tokens))[0])


class TwoTables(nn.Module):
    """Embeddings without tying (row scatters): one table looked up twice (its calls' entries
    add up), one with padding_idx (that row gets no gradient), tokens repeated within samples."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 5)
        self.pos = nn.Embedding(7, 5, padding_idx=2)
        self.head = nn.Linear(5, 3)

    def forward(self, tokens):
        x = self.emb(tokens) * self.emb(tokens.flip(1)) + self.pos(tokens)
        return self.head(torch.tanh(x))


class GramThenLSTM(nn.Module):
    """A Gram-form Linear (on (B, T, 16)) before a layer with factored forms."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.lstm = nn.LSTM(16, 3, batch_first=True)

    def forward(self, x):
        return self.lstm(torch.tanh(self.lin(x)))[0]


def _tokens(batch):
    return torch.randint(0, 7, (batch, 6))  # 6 positions over 7 rows: repeats and padding


def _frozen():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    model[2].requires_grad_(False)
    return model


def _tied_nobias():
    # the second layer owns only the tied weight (it must still be hooked)
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Tanh(), nn.Linear(4, 4, bias=False))
    model[2].weight = model[0].weight
    return model


class DeepRNN(nn.Module):
    """2-layer bidirectional LSTM with projections: one row block per weight, T positions."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(4, 5, num_layers=2, bidirectional=True, proj_size=3, batch_first=True)
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


class CellLoop(nn.Module):
    """An LSTMCell called once per step: one parameter, T calls (positions concatenated)."""

    def __init__(self):
        super().__init__()
        self.cell = nn.LSTMCell(4, 5)
        self.head = nn.Linear(5, 2)

    def forward(self, x):
        state = None
        for t in range(x.shape[1]):
            state = self.cell(x[:, t], state)
        return self.head(state[0])


class CrossAttention(nn.Module):
    """Packed in_proj with key is value (two row blocks), and separate q/k/v weights with
    bias_k/bias_v (bias-like blocks of one position)."""

    def __init__(self):
        super().__init__()
        self.packed = nn.MultiheadAttention(6, 2, batch_first=True)
        self.split = nn.MultiheadAttention(6, 3, kdim=4, vdim=4, add_bias_kv=True, batch_first=True)

    def forward(self, x):
        q, mem = x[:, :2], x[:, 2:]
        y = self.packed(q, mem, mem, need_weights=False)[0]
        return self.split(y, mem[..., :4], mem[..., 2:], need_weights=False)[0]


# name: (model factory, input shape after the batch dim (or an input maker), batch_first)
MODELS = {
    "mlp": (lambda: nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)), (5,), True),
    "cnn": (CNN, (2, 9, 9), True),
    "bottleneck": (Bottleneck, (4, 7, 7), True),
    "depthwise": (Depthwise, (3, 8, 8), True),
    "class_token": (ClassToken, (4, 3), True),
    "seq": (lambda: nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                                  nn.Linear(16, 2)), (4, 6), True),
    "seq_tb": (lambda: nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)), (3, 6), False),
    "twice": (Twice, (4,), True),
    "tied": (Tied, (5,), True),
    "prelu": (lambda: nn.Sequential(nn.Linear(4, 3), nn.PReLU(3), nn.Linear(3, 2)), (4,), True),
    "frozen": (_frozen, (4,), True),
    "tied_nobias": (_tied_nobias, (4,), True),
    "lm": (TiedLM, lambda b: torch.randint(0, 11, (b, 5)), True),
    "tables": (TwoTables, _tokens, True),
    "gram_then_lstm": (GramThenLSTM, (3, 16), True),
    # pre-LN: after a final LayerNorm the square loss is nearly constant and the gradients of
    # the layers before it are float32 rounding noise
    "transformer": (lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True,
                                                                norm_first=True),
                    (4, 8), True),
    "deep_rnn": (DeepRNN, (5, 4), True),
    "cell_loop": (CellLoop, (3, 4), True),
    "cross_attention": (CrossAttention, (5, 6), True),
}


def _setup(name, batch, dtype):
    make, shape, batch_first = MODELS[name]
    model = make().to(dtype)
    x = shape(batch) if callable(shape) else torch.randn(batch, *shape, dtype=dtype)
    if not batch_first:
        x = x.transpose(0, 1).contiguous()  # (T, B, d)
    w = torch.rand(batch, dtype=dtype) + 0.5
    return model, x, w, batch_first, (0 if batch_first else 1)


@pytest.fixture(params=["auto", "gram", "pixels", "materialize"])
def form(request, monkeypatch):
    """Which norm form Linear/Conv weights use: the cost model's choice, or forced; ``pixels``:
    the Gram form, with every convolution's patch Gram matrix from its input's pixels
    (:func:`gradhooks.rules.conv.patch_gram`, which the cost model picks only where cheaper)."""
    if request.param != "auto":
        monkeypatch.setattr(plan, "use_gram", lambda *a, **k: request.param != "materialize")
    if request.param == "pixels":
        monkeypatch.setattr(conv, "patch_gram_cost", lambda *a: 1)
    return request.param


def _ref_norms(ref):
    return torch.sqrt(sum(g.flatten(1).square().sum(1) for g in ref.values()))


def _assert_close(ours, ref, dtype, what, scale=None):
    """max|ours - ref| <= RTOL * scale (default: the largest |ref|)."""
    scale = ref.abs().max() if scale is None else scale
    diff = (ours - ref).abs().max()
    assert diff <= RTOL[dtype] * scale, f"{what}: max diff {diff:.3e} vs max |ref| {scale:.3e}"


# ------------------------------------------------------------------------------------ norms
@FALLBACK_OK
@pytest.mark.parametrize("batch", [1, 4], ids=["B1", "B4"])
@pytest.mark.parametrize("name", list(MODELS))
def test_norms_match_loop(name, batch, form, loss_reduction, dtype, grad_totals):
    model, x, w, batch_first, bd = _setup(name, batch, dtype)
    loss_fn = weighted_square_loss(loss_reduction, bd)
    ref = loop_grads(model, loss_fn, x, w, bd)
    with gradhooks.attach(model, loss_reduction=loss_reduction, batch_first=batch_first) as gh:
        loss_fn(model(x), w).backward()
        norms = gh.per_sample_grad_norms()
        per_param = gh.per_sample_grad_norms(per_param=True)
    assert norms.shape == (batch,) and norms.dtype == dtype
    _assert_close(norms, _ref_norms(ref), dtype, "norms")
    assert list(per_param) == list(ref)
    for n, g in ref.items():
        _assert_close(per_param[n], g.flatten(1).norm(dim=1), dtype, n)


class Repeats(nn.Module):
    """A Linear called ``repeats`` times (set per batch), on (B, 4) or on (B, 3, 4)."""

    def __init__(self):
        super().__init__()
        self.inner, self.head, self.repeats = nn.Linear(4, 4), nn.Linear(4, 2), 1

    def forward(self, x):
        for _ in range(self.repeats):
            x = torch.tanh(self.inner(x))
        return self.head(x)


def test_norms_and_clipping_follow_the_structure_of_each_batch(dtype, grad_totals):
    """The per-parameter decisions kept per call structure: batches alternating between
    structures (calls per layer, input rank, batch size) each get their own, exact results."""
    model = Repeats().to(dtype)
    loss_fn = weighted_square_loss("sum", 0)
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        for repeats, shape in [(1, (4,)), (2, (4,)), (1, (3, 4)), (1, (4,)), (2, (4,)), (1, (3, 4))]:
            for batch in (3, 5):
                model.repeats = repeats
                x = torch.randn(batch, *shape, dtype=dtype)
                w = torch.rand(batch, dtype=dtype) + 0.5
                with gradhooks.base.utils.paused():
                    ref = loop_grads(model, loss_fn, x, w)
                loss_fn(model(x), w).backward()
                _assert_close(gh.per_sample_grad_norms(), _ref_norms(ref), dtype,
                              f"norms, {repeats} calls, input {shape}, B={batch}")
                sums, scales, _ = _ref_clipped(ref, 1.0, "sum", batch)
                gh.clip_and_accumulate(1.0)
                for n, p in model.named_parameters():
                    _assert_close(p.grad, sums[n], dtype, n, scales[n])
                model.zero_grad()


def second_loss(out, w):
    """A second loss on the same outputs, for backward passes through one forward."""
    return (out.sin() * w[:, None]).sum()


def two_passes_setup(dtype):
    """The "twice" model, its batch, and the loop's gradients of both losses (sum reduction)."""
    model, x, w, _, _ = _setup("twice", 3, dtype)
    loss_fn = weighted_square_loss("sum")
    ref = loop_grads(model, lambda out, w: loss_fn(out, w) + second_loss(out, w), x, w)
    return model, x, w, loss_fn, ref


def test_norms_of_several_backward_passes(dtype, grad_totals):
    """retain_graph: the norm of the gradient summed over the passes (like param.grad)."""
    model, x, w, loss_fn, ref = two_passes_setup(dtype)
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        out = model(x)
        loss_fn(out, w).backward(retain_graph=True)
        second_loss(out, w).backward()
        _assert_close(gh.per_sample_grad_norms(), _ref_norms(ref), dtype, "norms")


def test_use_gram_is_the_flop_count_plus_memory_bound_bytes():
    assert plan.use_gram(1, 10, 10)            # S = 1: always the product of norms
    assert plan.use_gram(63, 128, 128)         # 63 * 256 < 128 * 128
    assert not plan.use_gram(64, 128, 128)
    assert not plan.use_gram(576, 288, 64)     # the seed CNN's conv2: materialised
    # the LSTM LM's weight_ih (32 steps, 32 -> 256 gates): its gate-gradient Gram is shared
    assert not plan.use_gram(32, 32, 256) and plan.use_gram(32, 32, 256, shared=2)
    # in cache (32 x 128 x 128 floats: 2 MB) the FLOP count decides, as above
    assert not plan.use_gram(64, 128, 128, batch=32)
    # beyond the cache writing (N, O, I) costs BYTE_COST per value: 128 tokens of 128 -> 512
    # (FLOPs: 128 * 640 > 65536, materialised; measured 3.0 ms Gram, 6.8 ms materialised)
    assert not plan.use_gram(128, 128, 512) and plan.use_gram(128, 128, 512, batch=32)
    assert plan.use_gram(256, 512, 512, batch=32) and not plan.use_gram(256, 512, 512)
    # and the Gram matrices' own bytes count too: 256 tokens of 512 -> 128 stays materialised
    assert not plan.use_gram(256, 512, 128, batch=32)


class _LSTMHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        return self.head(self.lstm(x)[0])


def test_lstm_gate_gradient_gram_is_formed_once(monkeypatch, dtype):
    """weight_ih and weight_hh of an LSTM have the same grad_output (the gate gradients): its
    Gram matrix is formed once for both, and the norms stay exact."""
    formed = []
    gram = plan.Forms.gram
    monkeypatch.setattr(plan.Forms, "gram",
                        lambda self, g: formed.append((g.shape, self._key(g) in self.grams))
                        or gram(self, g))
    model, x, w = _LSTMHead().to(dtype), torch.randn(3, 12, 8, dtype=dtype), torch.rand(3, dtype=dtype)
    loss_fn = weighted_square_loss("sum")
    ref = loop_grads(model, loss_fn, x, w)
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        loss_fn(model(x), w).backward()
        per_param = gh.per_sample_grad_norms(per_param=True)
        _assert_close(gh.per_sample_grad_norms(), _ref_norms(ref), dtype, "norms")
    for n, g in ref.items():
        _assert_close(per_param[n], g.flatten(1).norm(dim=1), dtype, n)
    # weight_ih forms it, weight_hh reuses it; in each of the two reads
    assert formed == [((3, 12, 64), False), ((3, 12, 64), True)] * 2


def test_gram_form_forms_no_per_sample_tensor(monkeypatch):
    """Linear without bias on (B, in): norms and ghost clipping never call a rule."""
    model = nn.Sequential(nn.Linear(30, 20, bias=False), nn.Tanh(), nn.Linear(20, 10, bias=False))
    for module in (plan, ghost_sums):  # (clipping's weighted sums: gradhooks.readers.ghost_sums)
        monkeypatch.setattr(module, "call_grads", lambda *a, **k: pytest.fail("materialised"))
    with gradhooks.attach(model) as gh:
        weighted_square_loss()(model(torch.randn(8, 30)), torch.ones(8)).backward()
        gh.per_sample_grad_norms()
        gh.clip_and_accumulate(0.1)


# ------------------------------------------------------------------------------------ clipping
def assert_clipped_grads(model, expected, scales, dtype):
    """Every trainable parameter's .grad is its clipped sum (dtype, shape, value within the
    rounding scale); frozen parameters got no .grad."""
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, n
            continue
        assert p.grad.dtype == dtype and p.grad.shape == p.shape, n
        _assert_close(p.grad, expected[n], dtype, n, scales[n])


def _ref_clipped(ref, max_norm, loss_reduction, batch):
    """Clipped sums from the looped per-sample gradients, and the scale of their rounding: the
    largest sum_n |c_n g_n| / D (a sum that cancels is compared relative to its terms)."""
    norms = _ref_norms(ref)
    c = (max_norm / norms).clamp(max=1)
    div = batch if loss_reduction == "mean" else 1
    sums = {n: torch.tensordot(c, g, 1) / div for n, g in ref.items()}
    scales = {n: (torch.tensordot(c, g.abs(), 1) / div).max() for n, g in ref.items()}
    return sums, scales, norms


@FALLBACK_OK
@pytest.mark.parametrize("method", clipping.CLIP_METHODS)
@pytest.mark.parametrize("name", list(MODELS))
def test_clipping_matches_loop(name, method, loss_reduction, dtype, grad_totals):
    batch = 5
    model, x, w, batch_first, bd = _setup(name, batch, dtype)
    loss_fn = weighted_square_loss(loss_reduction, bd)
    ref = loop_grads(model, loss_fn, x, w, bd)
    max_norm = float(_ref_norms(ref).median())  # some samples clipped, some not
    expected, scales, ref_norms = _ref_clipped(ref, max_norm, loss_reduction, batch)
    with gradhooks.attach(model, loss_reduction=loss_reduction, batch_first=batch_first) as gh:
        loss_fn(model(x), w).backward()
        norms = gh.clip_and_accumulate(max_norm, method=method)
    _assert_close(norms, ref_norms, dtype, "norms")
    assert_clipped_grads(model, expected, scales, dtype)


@pytest.mark.parametrize("name", ["cnn", "seq", "tied"])
@FALLBACK_OK
def test_ghost_equals_materialize(name):
    model, x, w, batch_first, bd = _setup(name, 6, torch.float64)
    with gradhooks.attach(model, batch_first=batch_first) as gh:
        weighted_square_loss("mean", bd)(model(x), w).backward()
        results = []
        for method in clipping.CLIP_METHODS:
            norms = gh.clip_and_accumulate(0.05, method=method, noise_multiplier=0.5,
                                           generator=torch.Generator().manual_seed(3))
            results.append((norms, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (n1, g1), (n2, g2) = results
    torch.testing.assert_close(n1, n2, rtol=1e-12, atol=0.0)
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], rtol=0.0, atol=1e-14)


def test_clipping_overwrites_grad_and_handles_unreached_params():
    """param.grad is overwritten; an unused layer gets 0 (+ noise), a frozen one is untouched."""
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(3, 2)
            self.unused = nn.Linear(3, 2)
            self.frozen = nn.Linear(2, 2).requires_grad_(False)

        def forward(self, x):
            return self.frozen(self.used(x))

    model = Branchy().double()
    x, w = torch.randn(4, 3, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    ref = loop_grads(model, weighted_square_loss("sum"), x, w)
    expected, _, _ = _ref_clipped(ref, 1e9, "sum", 4)  # nothing clipped: the batch gradient
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        model.used.weight.grad = torch.full_like(model.used.weight, 7.0)  # stale: overwritten
        weighted_square_loss("sum")(model(x), w).backward()
        gh.clip_and_accumulate(1e9)
        torch.testing.assert_close(model.used.weight.grad, expected["used.weight"])
        assert torch.equal(model.unused.weight.grad, torch.zeros(2, 3, dtype=torch.float64))
        assert model.frozen.weight.grad is None
        gh.clip_and_accumulate(1e9, noise_multiplier=1.0)
        assert model.unused.bias.grad.abs().min() > 0  # noise on every trainable parameter
        assert model.frozen.weight.grad is None


@pytest.mark.parametrize("method", clipping.CLIP_METHODS)
@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_noise_is_exact_and_reproducible(method, loss_reduction):
    """grad = clipped sum + sigma * C * z / D, z drawn param by param from the generator."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x, w = torch.randn(4, 3, dtype=torch.float64), torch.rand(4, dtype=torch.float64)
    sigma, c = 0.7, 0.3
    with gradhooks.attach(model, loss_reduction=loss_reduction) as gh:
        weighted_square_loss(loss_reduction)(model(x), w).backward()
        gh.clip_and_accumulate(c, method=method)
        clean = [p.grad.clone() for p in model.parameters()]
        runs = []
        for seed in (1, 1, 2):
            gh.clip_and_accumulate(c, method=method, noise_multiplier=sigma,
                                   generator=torch.Generator().manual_seed(seed))
            runs.append([p.grad.clone() for p in model.parameters()])
    div = 4 if loss_reduction == "mean" else 1
    gen = torch.Generator().manual_seed(1)
    for p, g0, g1 in zip(model.parameters(), clean, runs[0]):
        z = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        torch.testing.assert_close(g1, g0 + sigma * c * z / div, rtol=1e-12, atol=1e-14)
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
    assert not any(torch.equal(a, b) for a, b in zip(runs[0], runs[2]))


# ------------------------------------------------------------------------------------ errors
def _attached_mlp(**kw):
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))
    return model, gradhooks.attach(model, **kw)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan"), "1"])
def test_bad_max_norm(bad):
    model, gh = _attached_mlp()
    weighted_square_loss()(model(torch.randn(2, 3)), torch.ones(2)).backward()
    with pytest.raises(ValueError, match="max_norm must be a positive finite number"):
        gh.clip_and_accumulate(bad)


def test_bad_noise_and_method():
    model, gh = _attached_mlp()
    weighted_square_loss()(model(torch.randn(2, 3)), torch.ones(2)).backward()
    with pytest.raises(ValueError, match="noise_multiplier must be >= 0"):
        gh.clip_and_accumulate(1.0, noise_multiplier=-0.1)
    with pytest.raises(ValueError, match="method must be one of"):
        gh.clip_and_accumulate(1.0, method="opacus")


def test_before_backward():
    model, gh = _attached_mlp()
    with pytest.raises(gradhooks.NoBackwardError, match="loss.backward"):
        gh.per_sample_grad_norms()
    model(torch.randn(2, 3))
    with pytest.raises(gradhooks.NoBackwardError):
        gh.clip_and_accumulate(1.0)


@pytest.mark.filterwarnings(r"ignore:Using backward\(\) with create_graph")
def test_create_graph_is_refused():
    model, gh = _attached_mlp()
    weighted_square_loss()(model(torch.randn(2, 3)), torch.ones(2)).backward(create_graph=True)
    with pytest.raises(gradhooks.HigherOrderGradError, match="create_graph"):
        gh.per_sample_grad_norms()
    with pytest.raises(gradhooks.HigherOrderGradError):
        gh.clip_and_accumulate(1.0)


def test_input_modified_in_place():
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))
    x = torch.randn(2, 3)
    with gradhooks.attach(model) as gh:
        weighted_square_loss()(model(x), torch.ones(2)).backward()
        x.mul_(2.0)  # e.g. a reused input buffer
        with pytest.raises(gradhooks.GradientMismatchError, match="modified in place"):
            gh.per_sample_grad_norms()
        with pytest.raises(gradhooks.GradientMismatchError, match="modified in place"):
            gh.clip_and_accumulate(1.0)


@pytest.mark.parametrize("form", ["gram", "materialize"])
@pytest.mark.parametrize("layer", ["linear", "conv", "lstm", "attention", "embedding"])
def test_functional_use_of_a_weight_is_caught(layer, form, monkeypatch, grad_totals):
    """A weight also used outside its module: the sum check refuses the norms and the clipping."""
    monkeypatch.setattr(plan, "use_gram", lambda *a, **k: form == "gram")
    if layer == "linear":
        mod, x = nn.Linear(4, 4), torch.randn(3, 4)
        extra = lambda: (x @ mod.weight.T).square().sum()  # noqa: E731
    elif layer == "conv":
        mod, x = nn.Conv2d(2, 2, 3), torch.randn(3, 2, 5, 5)
        extra = lambda: mod.weight.square().sum()  # noqa: E731
    elif layer == "lstm":  # factored forms (Block): a weight of a recurrent layer
        mod, x = nn.LSTM(4, 4, batch_first=True, bias=False), torch.randn(3, 5, 4)
        extra = lambda: mod.weight_hh_l0.square().sum()  # noqa: E731
    elif layer == "embedding":  # row scatters (Rows): a lookup table
        mod, x = nn.Embedding(6, 4), torch.randint(0, 6, (3, 5))
        extra = lambda: mod.weight[1:3].square().sum()  # noqa: E731
    else:
        mod, x = nn.MultiheadAttention(4, 2, batch_first=True, bias=False), torch.randn(3, 5, 4)
        extra = lambda: mod.in_proj_weight.square().sum()  # noqa: E731
    call = {"lstm": lambda: mod(x)[0], "attention": lambda: mod(x, x, x)[0]}.get(layer, lambda: mod(x))
    pname = {"lstm": "weight_hh_l0", "attention": "in_proj_weight"}.get(layer, "weight")
    with gradhooks.attach(mod) as gh:
        (call().square().sum() + extra()).backward()
        with pytest.raises(gradhooks.GradientMismatchError, match=f"'{pname}' do not sum"):
            gh.per_sample_grad_norms()
        with pytest.raises(gradhooks.GradientMismatchError):
            gh.clip_and_accumulate(1.0)
    with gradhooks.attach(mod, check=False) as gh:  # the check is what catches it
        (call().square().sum() + extra()).backward()
        gh.per_sample_grad_norms()


def test_parameter_used_only_outside_its_module(grad_totals):
    class Parent(nn.Module):  # reads its child's weight functionally; the child never runs
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(3, 3)
            self.child = nn.Linear(3, 3)

        def forward(self, x):
            return torch.nn.functional.linear(self.inner(x), self.child.weight, self.child.bias)

    # (issue 16: no longer refused) provenance sees the weight read outside its module's
    # forward, and the parent's torch.func replay covers it from that forward on
    model = Parent().double()
    x = torch.randn(4, 3, dtype=torch.float64)
    ref = loop_grads(model, lambda out, _: (out ** 2).sum(), x, torch.zeros(4))
    norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    with pytest.warns(gradhooks.FallbackWarning, match="'child' .*read outside its forward"):
        with gradhooks.attach(model, loss_reduction="sum") as gh:
            (model(x) ** 2).sum().backward()
            torch.testing.assert_close(gh.per_sample_grad_norms(), norms, rtol=1e-10, atol=0)
            gh.clip_and_accumulate(norms.median().item())
            factors = (norms.median() / norms).clamp(max=1)
            for n, p in model.named_parameters():
                torch.testing.assert_close(p.grad, torch.tensordot(factors, ref[n], 1),
                                           rtol=1e-10, atol=1e-14)


def test_sum_check_schedule_follows_per_sample_grads(monkeypatch):
    """check=True: once per call structure (a structure checked by either path counts; the
    signature's first planned forward runs the analysed forward's ops: not checked again,
    ``SumCheck.forward_end``); check="always": every read."""
    calls = []
    for fn in ("check_sums", "check_projections"):
        real = getattr(verify, fn)
        monkeypatch.setattr(verify, fn,
                            lambda *a, _real=real, **k: (calls.append(1), _real(*a, **k))[1])
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    for check, expected in ((True, 2 * 1), ("always", 2 * 4)):  # 2 calls per checked read
        calls.clear()
        with gradhooks.attach(model, loss_reduction="sum", check=check) as gh:
            for _ in range(2):
                (model(torch.randn(5, 3)) ** 2).sum().backward()
                gh.per_sample_grad_norms()
                gh.clip_and_accumulate(1.0)
        assert len(calls) == expected, check
    with gradhooks.attach(model, check=False) as gh:
        calls.clear()
        (model(torch.randn(5, 3)) ** 2).sum().backward()
        gh.per_sample_grad_norms()
        assert not calls


def test_parameter_unfrozen_after_attach_is_followed():
    """The PReLU, frozen at attach, is not hooked; unfrozen, the next forward hooks it (issue
    17: followed, not silently left out of the clipped sum)."""
    model = nn.Sequential(nn.Linear(3, 3), nn.PReLU()).double()
    model[1].weight.requires_grad_(False)
    x = torch.randn(4, 3, dtype=torch.float64)
    with pytest.warns(gradhooks.FallbackWarning), gradhooks.attach(model, loss_reduction="sum") as gh:
        model[1].weight.requires_grad_(True)
        model(x).sum().backward()
        ours = gh.per_sample_grads()
    ref = gradhooks.looped_per_sample_grads(model, lambda out, y: out.sum(), x, x,
                                            loss_reduction="sum")
    assert list(ours) == ["0.weight", "0.bias", "1.weight"]
    for name, g in ref.items():
        _assert_close(ours[name], g, torch.float64, name)


# ------------------------------------------------------------------------------------ example
def test_dp_sgd_example_runs():
    script = pathlib.Path(__file__).resolve().parent.parent / "examples" / "dp_sgd.py"
    done = subprocess.run([sys.executable, str(script), "--steps", "3", "--batch", "16",
                           "--no-progress"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for method in ("ghost", "two-pass", "materialize"):
        assert re.search(method + r"\s*: test accuracy \d+\.\d%", out), out
    assert re.search(r"epsilon = \d+\.\d+ at delta = 1e-05", out), out
    for other in ("two-pass", "materialize"):
        found = re.search(f"ghost vs {other}: (\\S+) after step 1, (\\S+) after 3 steps", out)
        assert found, out
        assert float(found[1]) < 1e-6 and float(found[2]) < 1e-5, out


def test_ghost_clipping_writes_into_the_existing_grad():
    """Ghost clipping writes Linear and LSTM sums into the .grad autograd made (no second
    gradient-sized tensor), with the same values as the materialised method."""
    torch.manual_seed(0)
    model = TiedLM().double()
    x = torch.randint(0, 11, (4, 5))
    results = {}
    for method in clipping.CLIP_METHODS:
        with gradhooks.attach(model) as gh:
            model.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            before = {n: p.grad.data_ptr() for n, p in model.named_parameters()}
            gh.clip_and_accumulate(0.1, method=method)
            results[method] = {n: p.grad.clone() for n, p in model.named_parameters()}
            if method == "ghost":
                same = {n for n, p in model.named_parameters() if p.grad.data_ptr() == before[n]}
                assert {"rnn.weight_ih_l0", "rnn.weight_hh_l0", "rnn.bias_ih_l0", "head.bias"} <= same
    for n, t in results["ghost"].items():
        torch.testing.assert_close(t, results["materialize"][n], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("keep", [0.0, 1e12], ids=["recomputed", "kept"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_bookkeeping_keeps_materialised_conv_grads_within_budget(keep, dtype, monkeypatch):
    """A conv net whose first convolution's norm is materialised (large S, small weight:
    CLOSED in the norm plan): book-keeping keeps that per-sample gradient for the clipped sum
    when the budget allows (readers.plan.Forms.offer) and forms the sum from the records
    otherwise; both equal the float64 loop's clipped mean."""
    from gradhooks.readers import plan as plan_module
    monkeypatch.setattr(plan_module, "KEEP_OF_RECORDS", keep)
    kept = []
    offer = plan_module.Forms.offer

    def spy(self, pid, t):
        offer(self, pid, t)
        kept.extend(p for p in self.kept if p not in kept)
    monkeypatch.setattr(plan_module.Forms, "offer", spy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Tanh(), nn.Conv2d(4, 8, 3, stride=2),
                          nn.Tanh(), nn.Flatten(), nn.Linear(8 * 7 * 7, 5)).to(dtype)
    x = torch.randn(6, 3, 16, 16, dtype=dtype)
    y = torch.randint(0, 5, (6,))
    ref = gradhooks.looped_per_sample_grads(model, nn.CrossEntropyLoss(), x, y)
    norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    bound = float(norms.median())
    want = {n: torch.einsum("n,n...->...", (bound / norms).clamp(max=1.0), g) / 6
            for n, g in ref.items()}
    with gradhooks.attach(model) as gh:
        nn.functional.cross_entropy(model(x), y).backward()
        gh.clip_and_accumulate(bound)
    assert (len(kept) > 0) == (keep > 0)  # (the first conv's weight is materialised: S = 256)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=tol, atol=tol * float(want[n].abs().max()))
