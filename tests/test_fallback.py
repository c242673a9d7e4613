"""The torch.func fallback: modules without a dedicated rule, against looped autograd."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks

import zoo_imports
from conftest import assert_close_to_loop, check_against_loop, loop_grads


class Affine(nn.Module):
    """A custom layer with raw parameters and a nonlinearity inside: y = tanh(x * scale) + shift."""

    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(d))
        self.shift = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return torch.tanh(x * self.scale) + self.shift


class GatedWithChild(nn.Module):
    """Own parameter plus a hooked child (its own rule): y = lin(x) * sigmoid(gate) * x.sum(-1, keepdim)."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.gate = nn.Parameter(torch.randn(d))

    def forward(self, x, *, temperature=1.0):
        return self.lin(x) * torch.sigmoid(self.gate / temperature) * x.sum(-1, keepdim=True)


class Standardized(nn.Conv2d):
    """Weight-standardised convolution: overrides forward, so the Conv rule does not apply."""

    def forward(self, x):
        w = (self.weight - self.weight.mean()) / (self.weight.std() + 1e-5)
        return F.conv2d(x, w, self.bias, padding=1)


class Kw(nn.Module):
    def __init__(self):
        super().__init__()
        self.g = GatedWithChild(4)

    def forward(self, x):
        return self.g(x, temperature=2.0)


class ScoresAndUse(nn.Module):
    """Returns an intermediate it also used itself, as a router does with its logits:
    ``(s, softmax(s) * x)``, ``s = x @ w``."""

    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d))

    def forward(self, x):
        s = x @ self.w
        return s, torch.softmax(s, -1) * x


class UsesOutputs(nn.Module):
    """``ScoresAndUse``'s second output, and its first too (``both``) or not."""

    def __init__(self, both):
        super().__init__()
        self.r, self.out, self.both = ScoresAndUse(4), nn.Linear(4, 2), both

    def forward(self, x):
        s, y = self.r(x)
        return self.out(y + 0.5 * s if self.both else y)


CASES = {
    "prelu": (lambda: nn.Sequential(nn.Linear(4, 5), nn.PReLU(5), nn.Linear(5, 2)), (4,)),
    "prelu-shared": (lambda: nn.Sequential(nn.Linear(4, 5), nn.PReLU(), nn.Linear(5, 2)), (4,)),
    "custom-affine-seq": (lambda: nn.Sequential(nn.Linear(4, 3), Affine(3)), (6, 4)),
    "own-param-and-child": (lambda: nn.Sequential(GatedWithChild(4), nn.Linear(4, 2)), (4,)),
    "kwargs": (Kw, (4,)),
    "standardized-conv": (lambda: nn.Sequential(Standardized(2, 3, 3), nn.Flatten(), nn.Linear(48, 2)), (2, 4, 4)),
    "returns-an-intermediate-used": (lambda: UsesOutputs(both=False), (4,)),
    "returns-an-intermediate-used-twice": (lambda: UsesOutputs(both=True), (3, 4)),
}


@pytest.mark.filterwarnings("ignore::gradhooks.FallbackWarning")
@pytest.mark.parametrize("batch", [1, 3], ids=["B1", "B3"])
@pytest.mark.parametrize("case", list(CASES))
def test_fallback_matches_loop(case, batch, loss_reduction, dtype):
    make, shape = CASES[case]
    check_against_loop(make(), torch.randn(batch, *shape), torch.rand(batch),
                       loss_reduction=loss_reduction, dtype=dtype)


def test_fallback_warns_once_listing_the_modules():
    model = nn.Sequential(nn.Linear(4, 3), Affine(3), nn.PReLU())
    with pytest.warns(gradhooks.FallbackWarning) as rec:
        gh = gradhooks.attach(model)
    gh.detach()
    assert len(rec) == 1
    msg = str(rec[0].message)
    assert "'1' (Affine)" in msg and "'2' (PReLU)" in msg and "'0'" not in msg and "strict=True" in msg


class RawParamContainer(nn.Module):
    """A container with a raw parameter of its own (ViT's class token, a layer scale) used
    after its child: by a broadcast (taken at its own op, no replay) or as a matmul operand
    (met in an op gradhooks does not split per sample: the container is replayed)."""

    def __init__(self, use):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.randn(4, 4))
        self.use = use

    def forward(self, x):
        h = self.lin(x)
        return h + self.w[0] if self.use == "broadcast" else h @ self.w


@pytest.mark.parametrize("use", ["broadcast", "matmul"])
def test_fallback_warning_names_only_modules_that_are_replayed(use, dtype):
    """A container's raw parameter taken at its own op is no fallback: no warning (torchvision's
    ViT warned "'<root>' (VisionTransformer)" although nothing was replayed); one whose
    container is replayed warns when the replay runs, naming it. Exact in both cases."""
    model = nn.Sequential(RawParamContainer(use)).to(dtype)
    x = torch.randn(3, 4, dtype=dtype)
    loss_fn = lambda out, t: (out ** 2).sum()
    ref = gradhooks.looped_per_sample_grads(model, loss_fn, x, torch.zeros(3), loss_reduction="sum")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        with gradhooks.attach(model, loss_reduction="sum") as gh:
            loss_fn(model(x), None).backward()
            got = gh.per_sample_grads()
    fallback = [str(w.message) for w in rec if issubclass(w.category, gradhooks.FallbackWarning)]
    if use == "broadcast":
        assert fallback == []
    else:
        assert len(fallback) == 1 and "'0' (RawParamContainer)" in fallback[0] and "w" in fallback[0]
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    for name in ref:
        assert (got[name] - ref[name]).abs().max() <= tol * ref[name].abs().max(), name


def test_no_warning_when_every_module_has_a_rule():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gradhooks.attach(nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Conv1d(1, 1, 1))).detach()


def test_strict_refuses_the_fallback_modules():
    with pytest.raises(gradhooks.UnsupportedModuleError) as e:
        gradhooks.attach(nn.Sequential(nn.Linear(4, 3), Affine(3)), strict=True)
    assert "'1' (Affine): parameters scale, shift" in str(e.value)


class MixesSamples(nn.Module):
    """Violates the fallback's assumption: subtracts the batch mean before scaling."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return (x - x.mean(0, keepdim=True)) * self.w


@pytest.mark.filterwarnings("ignore::gradhooks.FallbackWarning")
def test_module_mixing_samples_is_refused_and_else_caught_by_the_replay_check():
    """A fallback module that mixes samples (x - x.mean(0) after a Linear): provenance sees the
    mixing op and the read refuses it; accepted with allow_sample_mixing=True, the replay's
    verification (tests/test_fallback_replay.py) still sees that the fallback's own weight has no
    per-sample split: ReplayMismatchError, a GradientMismatchError."""
    model = nn.Sequential(nn.Linear(3, 3), MixesSamples()).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    with gradhooks.attach(model) as gh:
        (model(x) ** 2).sum().backward()
        with pytest.raises(gradhooks.SampleMixingError, match="mean"):
            gh.per_sample_grads()
    with gradhooks.attach(model, allow_sample_mixing=True) as gh:
        (model(x) ** 2).sum().backward()
        with pytest.raises(gradhooks.ReplayMismatchError, match="'1.w'"):
            gh.per_sample_grads()


class Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return F.dropout(x, 0.5, self.training) * self.w


@pytest.mark.filterwarnings("ignore::gradhooks.FallbackWarning")
def test_random_forward_is_refused_with_advice():
    model = Noisy()
    with gradhooks.attach(model) as gh:
        (model(torch.randn(4, 3)) ** 2).sum().backward()
        with pytest.raises(gradhooks.UnsupportedCallError, match="module .<root>. .Noisy.*eval mode"):
            gh.per_sample_grads()
    model.eval()
    check_against_loop(model, torch.randn(4, 3), torch.rand(4), loss_reduction="sum",
                       dtype=torch.float64)


class SequenceFirstInside(nn.Module):
    """A module without a rule that works on ``(T, B, D)`` inside a batch-first model (as
    XLNet's relative attention does), with a positions tensor made from sizes and expanded to
    the batch (not from the batch: sample n's call reads its own copy)."""

    def __init__(self, d=4):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / 2)
        self.pos = nn.Parameter(torch.randn(d) / 2)

    def forward(self, h, r):
        return torch.einsum("tbi,ij->tbj", torch.tanh(h), self.w) + r * self.pos


class SeqFirstModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.out = SequenceFirstInside(), nn.Linear(4, 2)

    def forward(self, x):  # x: (B, T, 4)
        h = x.transpose(0, 1)
        r = torch.arange(h.shape[0], dtype=x.dtype)[:, None, None].expand(-1, h.shape[1], 4)
        return self.out(self.inner(h, r).transpose(0, 1))


@pytest.mark.parametrize("tokens", [5, 3], ids=["T5", "T=B"])
@pytest.mark.parametrize("batch", [1, 3], ids=["B1", "B3"])
def test_fallback_replays_on_the_batch_dim_provenance_followed(tokens, batch, loss_reduction,
                                                               dtype):
    """The replay slices every input and grad_output on the dim provenance followed the batch
    to (dim 1 here), not the declared layout's (Call.dims): exact with T == B too."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gradhooks.FallbackWarning)
        check_against_loop(SeqFirstModel(), torch.randn(batch, tokens, 4), torch.rand(batch),
                           loss_reduction=loss_reduction, dtype=dtype)


class UnusedRaw(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.scale = nn.Parameter(torch.rand(2) + 0.5)
        self.unused = nn.Parameter(torch.randn(4))  # (XLNet's mask_emb without a perm mask)

    def forward(self, x):
        return self.fc(x) * self.scale


@pytest.mark.parametrize("batch", [1, 3], ids=["B1", "B3"])
def test_raw_parameter_never_read_gets_no_gradient(batch, loss_reduction, dtype):
    """A container's raw parameter the forward never read gets no gradient, as in autograd (no
    entry, no sum check on it), instead of a GradientMismatchError about a pass it was not in."""
    torch.manual_seed(0)
    ours = check_against_loop(UnusedRaw(), torch.randn(batch, 3), torch.rand(batch),
                              loss_reduction=loss_reduction, dtype=dtype)
    assert "unused" not in ours and set(ours) == {"fc.weight", "fc.bias", "scale"}


class _Twice(nn.Module):
    # the replayed module itself returns the structure; TwiceOut's selection runs in the parent
    def __init__(self, form):
        super().__init__()
        self.form = form
        self.scale = nn.Parameter(torch.randn(4))

    def forward(self, x):
        h = torch.tanh(x * self.scale)
        return {"dict": lambda: {"last": h, "all": (x, h)}, "tuple": lambda: (h, (x, h)),
                "list": lambda: [x, h, h]}[self.form]()


class _Pick(nn.Module):
    def __init__(self, form):
        super().__init__()
        self.form = form
        self.inp, self.block, self.head = nn.Linear(4, 4), _Twice(form), nn.Linear(4, 3)

    def forward(self, x):
        out = self.block(self.inp(x))
        h = out["last"] if self.form == "dict" else out[0] if self.form == "tuple" else out[1]
        return self.head(h)


@pytest.mark.filterwarnings("ignore::gradhooks.FallbackWarning")
@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("form", ["dict", "tuple", "list"])
@pytest.mark.parametrize("batch", [1, 3])
def test_one_tensor_at_two_places_of_a_replayed_output(form, batch, check, dtype):
    """Its gradient is taken once (it was twice the truth with ``check=False``, and refused as
    a mismatch with the check on)."""
    model = _Pick(form).to(dtype)
    x, w = torch.randn(batch, 4, dtype=dtype), torch.rand(batch, dtype=dtype) + 0.5
    if check:
        check_against_loop(model, x, w, loss_reduction="mean", dtype=dtype)
        return
    ref = {n: torch.stack([torch.autograd.grad((w[i] * model(x[i:i + 1]).pow(2).sum()), p)[0]
                           for i in range(batch)]) for n, p in model.named_parameters()}
    with gradhooks.attach(model, loss_reduction="sum", check=False) as gh:
        (w[:, None] * model(x).pow(2)).sum().backward()
        got = gh.per_sample_grads()
    for n, r in ref.items():
        assert (got[n] - r).abs().max() <= (1e-10 if dtype == torch.float64 else 1e-5) * r.abs().max(), n


class _Encoder(nn.Module):
    """transformers' encoder pattern (DeBERTa-v2's): no rule, so the fallback replays it for an
    embedding table every layer reads outside the embedding's forward (``rel_embeddings.weight``,
    handed to this parent's replay); it returns a ``ModelOutput`` whose ``hidden_states`` hold
    its input, each layer's output (fed to the next layer too) and the last one, which is also
    ``last_hidden_state``. The parent reads ``hidden_states[-1]`` only (``at``) or also an inner
    layer's output (``inner``), or ``last_hidden_state`` (``last``)."""

    def __init__(self, layers=2, d=4):
        super().__init__()
        self.rel = nn.Embedding(2, d)
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))

    def forward(self, x, output_cls):
        rel = self.rel.weight  # (read outside the Embedding's forward)
        states = [x]
        for layer in self.layers:
            states.append(torch.tanh(layer(states[-1]) * rel[0] + rel[1]))
        return output_cls(last_hidden_state=states[-1], hidden_states=tuple(states))


class _ReadsStates(nn.Module):
    def __init__(self, read, output_cls):
        super().__init__()
        self.read, self.output_cls = read, output_cls
        self.inp, self.encoder, self.head = nn.Linear(3, 4), _Encoder(), nn.Linear(4, 3)

    def forward(self, x):
        out = self.encoder(self.inp(x), self.output_cls)
        h = {"at": lambda: out[1][-1], "inner": lambda: out[1][-1] + out[1][1] ** 2,
             "last": lambda: out.last_hidden_state}[self.read]()
        return self.head(h)


@pytest.mark.filterwarnings("ignore::gradhooks.FallbackWarning")
@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("read", ["at", "inner", "last"])
@pytest.mark.parametrize("batch", [0, 1, 3])
def test_a_replayed_model_output_with_unreached_fields_and_inner_states(read, batch, check,
                                                                        dtype):
    """A ``ModelOutput`` drops fields that are ``None``: the grad_outputs of an output whose
    ``last_hidden_state`` no backward reached moved up one place and were paired with the wrong
    output leaves; and an inner layer's output, used by the next layer inside the module and
    returned, brought that use's gradient twice (DeBERTa-v2 with 2 layers: its
    ``rel_embeddings`` 50-120% off with ``check=False``, refused by the sum check with it on)."""
    zoo_imports.import_torchvision()
    from transformers.modeling_outputs import BaseModelOutput

    torch.manual_seed(0)
    model = _ReadsStates(read, BaseModelOutput).to(dtype)
    x, y = torch.randn(batch, 3, dtype=dtype), torch.randint(0, 3, (batch,))
    loss = lambda out, t: F.cross_entropy(out, t, reduction="sum")
    with gradhooks.attach(model, loss_reduction="sum", check=check) as gh:
        loss(model(x), y).backward()
        ours = gh.per_sample_grads()
    if not batch:
        assert all(t.shape[0] == 0 for t in ours.values())
        return
    assert_close_to_loop(ours, loop_grads(model, loss, x, y), dtype)


class _TwoOut(nn.Module):  # (no rule: the fallback; only its second output is used)
    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return torch.tanh(x @ self.w1), torch.tanh(x @ self.w2)


class _UsesSecond(nn.Module):
    def __init__(self):
        super().__init__()
        self.two, self.head = _TwoOut(), nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.two(x)[1])


@pytest.mark.filterwarnings("ignore::gradhooks.FallbackWarning")
@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_replayed_parameter_no_backward_reached_is_zero_not_refused(batch, check, dtype):
    """``w1`` feeds only an output nothing uses: autograd computes no gradient for it, and its
    per-sample gradients are zeros (the sum check refused them as 'recorded but no autograd
    gradient' before 2026-12-08); nonzero values there are still refused."""
    torch.manual_seed(0)
    model = _UsesSecond().to(dtype)
    x, y = torch.randn(batch, 4, dtype=dtype), torch.randint(0, 3, (batch,))
    loss = lambda out, t: F.cross_entropy(out, t, reduction="sum")
    with gradhooks.attach(model, loss_reduction="sum", check=check) as gh:
        loss(model(x), y).backward()
        ours = gh.per_sample_grads()
    assert not ours.pop("two.w1").count_nonzero()
    assert_close_to_loop(ours, loop_grads(model, loss, x, y), dtype)
