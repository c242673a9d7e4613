"""A forward that mixes the samples through the parameters (``h - h.mean(0)``, ``h / h.std(0)``,
a softmax or sort over the batch, batch statistics between two layers) has no per-sample
gradients, and the sum check cannot see it: the reads refuse it (SampleMixingError, naming the op
and the module), on the tracked forward and on the untracked forwards of its signature, unless
``attach(..., allow_sample_mixing=True)``. Ops that only move samples, reductions over other
dims, statistics of the raw inputs or detached ones, and a loss computed inside the forward are
not mixing: their per-sample gradients are exact against a loop (float64)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks

from conftest import assert_close_to_loop, loop_grads

F64 = torch.float64


def _centre(h):
    return h - h.mean(0, keepdim=True)


def _scale(h):
    return h / (h.std(0, unbiased=False) + 1.0)


def _softmax(h):
    return h.softmax(0)


def _sort(h):
    return torch.sort(h, 0).values


def _manual_batch_norm(h):
    mean = h.mean(0)
    var = ((h - mean) ** 2).mean(0)
    return (h - mean) / torch.sqrt(var + 1e-5)


def _functional_batch_norm(h):  # (two values per channel and sample: B = 1 runs too)
    return F.batch_norm(torch.stack([h, h * h], -1), None, None, training=True).sum(-1)


def _similarity(h):  # (a contrastive model's (B, B) similarities, mixed back into the rows)
    return h + torch.softmax(h @ h.T, 1) @ h


def _contraction(h):  # (a sum over the samples by a product: h^T h, then back to the rows)
    return h @ torch.tanh(torch.mm(h.T, h))


MIXING = [(_centre, "mean"), (_scale, "std"), (_softmax, "softmax"), (_sort, "sort"),
          (_similarity, "product of two tensors"), (_contraction, "product of two tensors"),
          (_manual_batch_norm, "mean"), (_functional_batch_norm, "batch_norm")]
MIXING_IDS = ["centre", "std", "softmax0", "sort0", "z@z.T", "h.T@h", "manual_bn",
              "F.batch_norm"]


class Between(nn.Module):
    """``b(op(tanh(a(x))))``: ``op`` between two hooked Linear layers."""

    def __init__(self, op):
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)
        self.op = op

    def forward(self, x):
        return self.b(self.op(torch.tanh(self.a(x))))


def _batch(b, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 4, generator=g, dtype=F64), torch.randint(0, 3, (b,), generator=g)


def _read(gh, read):
    if read == "per_sample_grads":
        return gh.per_sample_grads()
    if read == "norms":
        return gh.per_sample_grad_norms()
    return gh.clip_and_accumulate(1.0)


# ---------------------------------------------------------------- refused
@pytest.mark.parametrize("b", [1, 3], ids=["B1", "B3"])
@pytest.mark.parametrize("read", ["per_sample_grads", "norms", "clip_and_accumulate"])
@pytest.mark.parametrize("op,name", MIXING, ids=MIXING_IDS)
def test_mixing_op_between_layers_is_refused_at_the_read(op, name, read, b):
    model = Between(op).double()
    with gradhooks.attach(model) as gh:
        for step in range(2):  # the tracked forward, then an untracked one of its signature
            x, y = _batch(b, step)
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            with pytest.raises(gradhooks.SampleMixingError) as info:
                _read(gh, read)
            message = str(info.value)
            assert name in message and "'a' (Linear)" in message, message
            assert "allow_sample_mixing=True" in message and "detach" in message
            assert "test_mixing.py" in message  # the line of the forward
            if step == 0:  # (the signature is known: the next forward is not tracked)
                assert all(isinstance(v, dict) for v in gh.recorder.placement.signatures.values())


@pytest.mark.parametrize("b", [1, 3], ids=["B1", "B3"])
@pytest.mark.parametrize("op,name", MIXING, ids=MIXING_IDS)
def test_allow_sample_mixing_gives_contributions_to_the_batch_gradient(op, name, b):
    model = Between(op).double()
    with gradhooks.attach(model, allow_sample_mixing=True) as gh:
        for step in range(2):
            x, y = _batch(b, step)
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            grads = gh.per_sample_grads()
            for pname, p in model.named_parameters():  # (mean reduction: they average to .grad)
                torch.testing.assert_close(grads[pname].mean(0), p.grad, rtol=1e-10, atol=1e-12)
            assert gh.per_sample_grad_norms().shape == (b,)


def test_allow_sample_mixing_is_documented():
    doc = gradhooks.attach.__doc__
    assert "allow_sample_mixing" in doc and "contribution to the batch gradient" in doc


def test_batch_statistics_accepted_by_allow_batchnorm_train():
    x, y = _batch(3)
    model = Between(_functional_batch_norm).double()
    with gradhooks.attach(model, allow_batchnorm_train=True) as gh:
        F.cross_entropy(model(x), y).backward()
        gh.per_sample_grads()
    # a hooked BatchNorm in training mode, as before
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)).double().train()
    with gradhooks.attach(model, allow_batchnorm_train=True) as gh:
        F.cross_entropy(model(x), y).backward()
        gh.per_sample_grads()


def test_a_statistic_met_twice_is_named_once_and_others_counted():
    def two(h):
        return (h - h.mean(0)).softmax(0)
    x, y = _batch(3)
    model = Between(two).double()
    with gradhooks.attach(model) as gh:
        F.cross_entropy(model(x), y).backward()
        with pytest.raises(gradhooks.SampleMixingError, match=r"mean .* 1 more"):
            gh.per_sample_grads()


# ---------------------------------------------------------------- not mixing: exact
def _moves(h):  # index the batch with a permutation and its inverse
    perm = torch.arange(h.shape[0]).flip(0)
    return h[perm][perm]


def _features(h):  # reductions and normalisations over the features
    h = h - h.mean(1, keepdim=True)
    h = h / (h.std(-1, keepdim=True) + 1.0)
    return F.layer_norm(torch.sort(h, -1).values, (6,)) + h.softmax(-1) + h.sum(1, keepdim=True)


def _batched_product(h):  # (per-sample products: the batch in the broadcast dim, as attention)
    q = h.view(h.shape[0], 2, 3)
    return (torch.softmax(q @ q.transpose(-2, -1), -1) @ q).reshape(h.shape)


@pytest.mark.parametrize("b", [1, 3], ids=["B1", "B3"])
@pytest.mark.parametrize("op", [_moves, _features, _batched_product],
                         ids=["moves_samples", "over_features", "batched_product"])
def test_ops_that_do_not_mix_are_exact(op, b):
    x, y = _batch(b)
    model = Between(op).double()
    ref = loop_grads(model, F.cross_entropy, x, y)
    with gradhooks.attach(model) as gh:
        F.cross_entropy(model(x), y).backward()
        ours = gh.per_sample_grads()
    assert_close_to_loop(ours, ref, F64)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("op", [lambda h: torch.stack(list(h.unbind(0)), 0),
                                lambda h: torch.cat([h[:1], h[1:]], 0)], ids=["unbind", "split"])
def test_rows_taken_apart_and_joined_again_are_unproven_not_guessed(op, dtype):
    """``stack(h.unbind(0))``, ``cat([h[:1], h[1:]])``: the batch dim is not followed through
    the pieces, so the model's output has none gradhooks knows; a non-linear loss on it after a
    plain backward is refused as unproven (not guessed from the sizes), per-sample losses
    through ``gh.backward`` are checked through the batched graph and exact."""
    x, y = _batch(3)
    model = Between(op).to(dtype)
    x = x.to(dtype)
    with gradhooks.attach(model) as gh:
        F.cross_entropy(model(x), y).backward()
        with pytest.raises(gradhooks.UnprovenOpError, match="batch dim gradhooks did not follow"):
            gh.per_sample_grads()
    ref = loop_grads(model, F.cross_entropy, x, y)
    with gradhooks.attach(model) as gh:
        gh.backward(F.cross_entropy(model(x), y, reduction="none").mean())
        ours = gh.per_sample_grads()
    assert_close_to_loop(ours, ref, dtype)


class Statistic(nn.Module):
    """A statistic of the batch that is not a function of the parameters: of the raw inputs
    (``x - x.mean(0)`` before the first layer), or detached (``h - h.mean(0).detach()``).
    ``fixed``: the statistics as constants, for the looped reference."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)
        self.fixed = None

    def forward(self, x):
        mx = x.mean(0, keepdim=True) if self.fixed is None else self.fixed[0]
        h = torch.tanh(self.a(x - mx))
        mh = h.mean(0, keepdim=True).detach() if self.fixed is None else self.fixed[1]
        self.seen = (mx, mh)
        return self.b(h - mh)


@pytest.mark.parametrize("b", [1, 3], ids=["B1", "B3"])
def test_statistics_of_inputs_and_detached_ones_are_not_mixing(b):
    x, y = _batch(b)
    model = Statistic().double()
    with gradhooks.attach(model) as gh:
        for _ in range(2):
            F.cross_entropy(model(x), y).backward()
            ours = gh.per_sample_grads()
    model.fixed = model.seen  # each sample's own loss, the batch's statistics held as data
    assert_close_to_loop(ours, loop_grads(model, F.cross_entropy, x, y), F64)


class WithLoss(nn.Module):
    """A model that computes its scalar loss inside the forward (``model(ids, labels=labels)``):
    the loss's reduction over the batch is not mixing."""

    def __init__(self, per_sample_then_mean: bool):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
        self.per_sample_then_mean = per_sample_then_mean

    def forward(self, x, labels):
        out = self.net(x)
        if self.per_sample_then_mean:
            losses = F.cross_entropy(out, labels, reduction="none")
            return losses.sum() / losses.shape[0] + 0.0 * out.mean()
        return F.cross_entropy(out, labels)


@pytest.mark.parametrize("b", [1, 3], ids=["B1", "B3"])
@pytest.mark.parametrize("split", [False, True], ids=["cross_entropy", "reduction_none_mean"])
def test_loss_computed_inside_the_forward_is_not_mixing(split, b):
    x, y = _batch(b)
    model = WithLoss(split).double()
    params = dict(model.named_parameters())
    ref = {n: [] for n in params}
    for i in range(b):
        model.zero_grad()
        model(x[i:i + 1], y[i:i + 1]).backward()
        for n, p in params.items():
            ref[n].append(p.grad.clone())
    ref = {n: torch.stack(g) for n, g in ref.items()}
    model.zero_grad()
    with gradhooks.attach(model) as gh:
        model(x, y).backward()
        ours = gh.per_sample_grads()
    assert_close_to_loop(ours, ref, F64)


@pytest.mark.parametrize("over", [0, 1], ids=["positions", "samples"])
def test_batch_dim_is_followed_not_read_off_a_size(over):
    # T == B: a mean over the positions of a transposed (T, B, D) activation is per sample; one
    # over its dim 1 (the samples) mixes them
    class Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x):  # (B, T, 4)
            h = self.a(x).transpose(0, 1)  # (T, B, D)
            return self.b(h * h.mean(over, keepdim=True)).sum(0)

    b = 3
    x, y = torch.randn(b, b, 4, dtype=F64), torch.randint(0, 2, (b,))
    model = Seq().double()
    with gradhooks.attach(model) as gh:
        F.cross_entropy(model(x), y).backward()
        if over == 1:
            with pytest.raises(gradhooks.SampleMixingError, match="mean over the batch dim"):
                gh.per_sample_grads()
            return
        ours = gh.per_sample_grads()
    assert_close_to_loop(ours, loop_grads(model, F.cross_entropy, x, y), F64)


def _shuffled(h):  # (each sample's row meets another sample's: h + h[perm])
    b = h.shape[0]
    return h + h[(torch.arange(b) + 1) % b]


@pytest.mark.parametrize("read", ["per_sample_grads", "norms", "clip_and_accumulate"])
def test_rows_of_other_samples_gathered_by_an_index_are_refused(read):
    """``h + h[perm]`` (a sample indexed and combined with another's row): the rows gathered
    by the index carry their samples (batch_dims.Routed), and meeting the batch's own rows of
    other samples is mixing, refused at every read; with B = 1 the index is the identity and
    the result exact."""
    model = Between(_shuffled).double()
    x, y = _batch(3)
    with gradhooks.attach(model) as gh:
        F.cross_entropy(model(x), y).backward()
        with pytest.raises(gradhooks.SampleMixingError, match="gathered or sorted from the batch"):
            _read(gh, read)
    x, y = _batch(1)
    ref = loop_grads(model, F.cross_entropy, x, y)
    with gradhooks.attach(model) as gh:
        F.cross_entropy(model(x), y).backward()
        assert_close_to_loop(gh.per_sample_grads(), ref, F64)


class RawAfterMixing(nn.Module):
    """A container whose raw parameter ``scale`` meets the batch after a mean over the batch
    (limitations: "a raw parameter under provenance after a container that mixes samples"): the
    statistic is of a hooked layer's output (``"layer"``), of the raw parameter's own product
    (``"raw"``), or of the raw inputs (``"inputs"``: no parameter behind it, not mixing)."""

    def __init__(self, source):
        super().__init__()
        self.source = source
        self.a = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4))
        self.b = nn.Linear(4, 3)
        self.fixed = None  # the batch's input statistic held as data (the loop's reference)

    def forward(self, x):
        if self.source == "inputs":
            m = x.mean(0, keepdim=True) if self.fixed is None else self.fixed
            self.seen = m
            h = torch.tanh(self.a(x - m))
        else:
            h = torch.tanh(self.a(x)) if self.source == "layer" else torch.tanh(x * self.scale)
            h = h - h.mean(0, keepdim=True)
        return self.b(h * self.scale)


@pytest.mark.parametrize("b", [1, 3], ids=["B1", "B3"])
@pytest.mark.parametrize("source", ["layer", "raw"])
def test_raw_parameter_after_a_mixing_container_is_refused(source, b):
    model = RawAfterMixing(source).double()
    with gradhooks.attach(model) as gh:
        for step in range(2):  # the tracked forward, then an untracked one of its signature
            x, y = _batch(b, step)
            F.cross_entropy(model(x), y).backward()
            for read in ("per_sample_grads", "norms", "clip_and_accumulate"):
                with pytest.raises(gradhooks.SampleMixingError) as info:
                    _read(gh, read)
                message = str(info.value)
                assert "mean over the batch dim" in message, message
                named = ("module 'a' (Linear)" if source == "layer"
                         else "parameter 'scale' of module '<root>'")
                assert named in message and "allow_sample_mixing=True" in message, message
            model.zero_grad()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("b", [0, 1, 3], ids=["B0", "B1", "B3"])
def test_raw_parameter_after_a_statistic_of_the_inputs_is_exact(b, dtype):
    # The statistic depends on no parameter: each sample's gradient is its own loss's, the
    # batch's input statistic held as data (as for hooked layers above).
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(b, 4, generator=g, dtype=dtype), torch.randint(0, 3, (b,), generator=g)
    model = RawAfterMixing("inputs").to(dtype)
    with gradhooks.attach(model) as gh:
        F.cross_entropy(model(x), y).backward() if b else model(x).sum().backward()
        ours = gh.per_sample_grads()
    if b == 0:
        assert all(v.shape[0] == 0 for v in ours.values()) and "scale" in ours
        return
    model.fixed = model.seen
    assert_close_to_loop(ours, loop_grads(model, F.cross_entropy, x, y), dtype)
