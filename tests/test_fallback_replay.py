"""The torch.func fallback's replay never crashes and never lies (gradhooks.rules.fallback_replay).

Where vmap cannot replay a module, the module is replayed sample by sample (exact against the
loop, warned once naming its path, cause and cost) or refused with a ReplayError naming the module
and cause; never a raw torch error. A replay that computes something else than the module's
batched forward is refused by the verification of every read,
whatever ``check`` says; only ``unsafe_skip_replay_check=True`` skips it.
"""
import copy
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
import gradhooks.rules.fallback as fallback_module

from conftest import RTOL, assert_close_to_loop, loop_grads, looped_by, weighted_square_loss


class OldSqrtTanh(torch.autograd.Function):
    """An old-style autograd.Function (forward(ctx, ...), no setup_context): vmap refuses it.
    ``tanh(x * w)`` with its hand-written backward."""

    @staticmethod
    def forward(ctx, x, w):
        y = torch.tanh(x * w)
        ctx.save_for_backward(x, w, y)
        return y

    @staticmethod
    def backward(ctx, g):
        x, w, y = ctx.saved_tensors
        d = g * (1 - y * y)
        return d * w, (d * x).sum_to_size(w.shape)


class OldStyle(nn.Module):
    """(a) A custom layer whose op is an old-style autograd.Function."""

    def __init__(self, d=4):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return OldSqrtTanh.apply(x, self.w)


class Guarded(nn.Module):
    """(b) Python control flow on tensor values (input guards, as real code has them): the same
    branch for the batch and for each sample alone."""

    def __init__(self, d=4):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d))

    def forward(self, x):
        if not torch.isfinite(x).all():
            raise ValueError("non-finite input")
        if (x.abs() > 1e6).any():
            x = x.clamp(-1e6, 1e6)
        return torch.tanh(x * self.w)


class BatchBranch(nn.Module):
    """(b, mixing) A branch on a statistic of the whole batch: sample 2 alone takes the other
    branch than the batch, so no per-sample replay is its share of the batch."""

    def __init__(self, d=4):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d))

    def forward(self, x):
        if x.abs().max() > 2:
            return torch.tanh(x * self.w)
        return x * self.w


class KeepsLast(nn.Module):
    """(c) Caches its whole batch input (``self.last = x``) and computes from the cache."""

    def __init__(self, d=4):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d))
        self.last = None

    def forward(self, x):
        self.last = x
        return torch.tanh(self.last * self.w)


class Running(nn.Module):
    """(c) A running buffer updated in place by the forward (vmap refuses the in-place update of
    a captured tensor); the output does not read it."""

    def __init__(self, d=4):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d))
        self.register_buffer("running", torch.zeros(d))

    def forward(self, x):
        self.running.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return torch.tanh(x * self.w)


class RunningUsed(Running):
    """(c) As :class:`Running`, but the output reads the buffer the forward just updated: run
    again it is not the forward's function."""

    def forward(self, x):
        self.running.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return torch.tanh((x - self.running) * self.w)


class Memory(nn.Module):
    """(c) Holds the first batch it saw (B rows) and adds it to every later input: one sample
    cannot run against it whole; the looped replay gives it sample n's row."""

    def __init__(self, d=4):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d))
        self.memory = None

    def forward(self, x):
        if self.memory is None:
            self.memory = x.detach().clone()
        return torch.tanh((x + self.memory) * self.w)


class Masked(nn.Module):
    def __init__(self, d=4):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d))

    def forward(self, x, mask):
        if (mask < 0).any():  # (a guard: vmap refuses it, the loop replays)
            raise ValueError("negative mask")
        return torch.tanh(x * self.w) * mask


class ExpandedMask(nn.Module):
    """(d) A parameter-owning module called with a mask already expanded to B rows."""

    def __init__(self):
        super().__init__()
        self.lin, self.m = nn.Linear(4, 4), Masked()

    def forward(self, x):
        mask = torch.linspace(0.5, 1.5, 4, dtype=x.dtype)[None].expand(x.shape[0], 4)
        return self.m(self.lin(x), mask)


class ExpandedQuery(nn.Module):
    """(d) A learned query expanded to B rows and handed to a module vmap cannot replay."""

    def __init__(self):
        super().__init__()
        self.q = nn.Parameter(torch.randn(1, 4))
        self.lin, self.m = nn.Linear(4, 4), OldStyle()

    def forward(self, x):
        return self.lin(x) * self.m(self.q.expand(x.shape[0], -1))


class BuildsRows(nn.Module):
    """(d) Builds B rows itself from a size it is given: one sample's call cannot."""

    def __init__(self, d=4):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(1, d))

    def forward(self, x, rows):
        return torch.tanh(x + self.pos.expand(rows, -1))


class BuildsRowsModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.m = nn.Linear(4, 4), BuildsRows()

    def forward(self, x):
        return self.m(self.lin(x), x.shape[0])


class ByBatchSize(nn.Module):
    """(e) Normalises by ``x.shape[0]``: replayed as a batch of one, each sample is B times its
    share of the batch."""

    def __init__(self, d=4):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return torch.tanh(x * self.w) / x.shape[0]


class Centred(nn.Module):
    """(e) Mixes samples: subtracts the batch mean."""

    def __init__(self, d=4):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return torch.tanh((x - x.mean(0, keepdim=True)) * self.w)


def seq(m):
    return nn.Sequential(nn.Linear(4, 4), m, nn.Linear(4, 2))


def _read(model, x, y, loss_reduction="mean", **attach):
    """Per-sample gradients read through ``attach(model, **attach)`` and the fallback warnings."""
    loss_fn = weighted_square_loss(loss_reduction)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        with gradhooks.attach(model, loss_reduction=loss_reduction, **attach) as gh:
            loss_fn(model(x), y).backward()
            got = gh.per_sample_grads()
    return got, [str(w.message) for w in rec if issubclass(w.category, gradhooks.FallbackWarning)
                 and "sample by sample" in str(w.message)]


def _exact(model, batch, loss_reduction, dtype, **attach):
    """The read equals the loop (B = 0: every result is (0, *shape)); returns the warnings."""
    model = model.to(dtype)
    x = torch.randn(batch, 4, dtype=dtype)
    y = torch.rand(batch, dtype=dtype)
    if batch == 0:
        got, warned = _read(model, x, y, loss_reduction, **attach)
        trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
        assert set(got) == set(trainable)
        for n, t in got.items():
            assert t.shape == (0, *trainable[n].shape), n
        return warned
    ref = loop_grads(model, weighted_square_loss(loss_reduction), x, y)
    got, warned = _read(model, x, y, loss_reduction, **attach)
    assert_close_to_loop(got, ref, dtype)
    return warned


EXACT = {
    "old-style-function": (lambda: seq(OldStyle()), "1", "setup_context"),
    "control-flow-on-values": (lambda: seq(Guarded()), "1", "data-dependent control flow"),
    "caches-its-batch": (lambda: seq(KeepsLast()), "1", None),
    "running-buffer-in-place": (lambda: seq(Running()), "1", "in-place operation"),
    "expanded-mask": (ExpandedMask, "m", "data-dependent control flow"),
    "expanded-query": (ExpandedQuery, "m", "setup_context"),
}


@pytest.mark.parametrize("batch", [0, 1, 3], ids=["B0", "B1", "B3"])
@pytest.mark.parametrize("case", list(EXACT))
def test_replays_vmap_cannot_do_are_looped_and_exact(case, batch, loss_reduction, dtype):
    """(a)-(d): exact against the loop in float64 and float32; where vmap fails, one warning
    naming the module's path, the cause and the measured cost."""
    make, path, cause = EXACT[case]
    warned = _exact(make(), batch, loss_reduction, dtype)
    if cause is None or batch == 0:  # (vmap replays it; B = 0 replays nothing)
        assert warned == []
        return
    assert len(warned) == 1, warned
    assert f"module {path!r} ({type(make().get_submodule(path)).__name__})" in warned[0]
    assert cause in warned[0] and " ms for " in warned[0]


def test_looped_replay_warns_once_per_module_and_leaves_the_module_as_it_was(dtype):
    """Two reads, two modules vmap cannot replay: one warning each; the buffer the replays run
    through in place and the attribute they set are as the forward left them."""
    model = nn.Sequential(nn.Linear(4, 4), Running(), KeepsLast(), OldStyle()).to(dtype)
    x = torch.randn(3, 4, dtype=dtype)
    loss_fn = weighted_square_loss("sum")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        with gradhooks.attach(model, loss_reduction="sum") as gh:
            for _ in range(2):
                loss_fn(model(x), torch.ones(3, dtype=dtype)).backward()
                running, last = model[1].running.clone(), model[2].last
                gh.per_sample_grads()
                assert torch.equal(model[1].running, running) and model[2].last is last
    looped = [str(w.message) for w in rec if "sample by sample" in str(w.message)]
    assert len(looped) == 2
    assert sum("'1' (Running)" in w for w in looped) == 1
    assert sum("'3' (OldStyle)" in w for w in looped) == 1


class Affine(nn.Module):
    """``tanh(x * w)``, flattened: vmap replays it."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return torch.tanh(x * self.w).flatten(1)


@pytest.mark.parametrize("module", [Affine, OldStyle], ids=["vmapped", "looped"])
def test_every_read_is_verified_vmapped_or_looped(module, monkeypatch):
    """Every read's replay is verified, vmapped or looped, B = 1 included, whatever the call
    structure (feature shapes, dtypes, batch size) and with check=False."""
    calls = []
    original = fallback_module.verify
    monkeypatch.setattr(fallback_module, "verify",
                        lambda *a, **k: calls.append(a[2].b) or original(*a, **k))
    model = nn.Sequential(module()).double()
    shapes = [(1, 4), (1, 4), (3, 4), (5, 4), (2, 4), (3, 2, 4), (4, 2, 4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gradhooks.FallbackWarning)
        with gradhooks.attach(model, check=False) as gh:
            for shape in shapes:
                (model(torch.randn(*shape, dtype=torch.float64)) ** 2).sum().backward()
                gh.per_sample_grads()
    assert calls == [s[0] for s in shapes]


REFUSED_LOOP = {
    "builds-B-rows": (BuildsRowsModel, "'m' (BuildsRows)", "BuildsRows"),
}


@pytest.mark.parametrize("check", [True, False], ids=["check", "no-check"])
@pytest.mark.parametrize("case", list(REFUSED_LOOP))
def test_module_neither_vmap_nor_the_loop_can_replay_is_refused_naming_it(case, check, dtype):
    """(c), (d): a module that cannot run on one sample (a whole-batch cache; B rows it builds
    itself): a ReplayError naming the module, both causes and the ways out, never the raw torch
    error."""
    make, who, cls = REFUSED_LOOP[case]
    model = make().to(dtype)
    x = torch.randn(3, 4, dtype=dtype)
    model(x)  # (Memory keeps this batch)
    with pytest.raises(gradhooks.ReplayError) as e:
        _read(model, x, torch.rand(3, dtype=dtype), check=check)
    msg = str(e.value)
    assert msg.count(who) == 1 and "torch.func.vmap fails (RuntimeError: " in msg
    assert "one call per sample (RuntimeError: " in msg
    assert f"register_rule({cls})" in msg and "strict=True" in msg and "requires_grad_(False)" in msg
    assert isinstance(e.value, gradhooks.UnsupportedCallError)


def test_state_of_b_rows_kept_on_a_module_is_replayed_row_by_row(dtype):
    """(c) A module that keeps B rows of state as a plain attribute (a cache of the whole
    batch; RecurrentGemma's recurrence states) cannot run on one sample against all of them:
    the looped replay gives each sample its own row (set back after), verified against the
    batched call; exact against a loop where each sample meets its row."""
    model = seq(Memory()).to(dtype)
    x = torch.randn(3, 4, dtype=dtype)
    model(x)  # (Memory keeps this batch)
    y = torch.rand(3, dtype=dtype)
    memory = model[1].memory
    got, warned = _read(model, x, y)
    assert model[1].memory is memory and warned
    def alone(n):  # (sample n meets its row of the memory)
        model[1].memory = memory[n:n + 1]
        return weighted_square_loss("mean")(model(x[n:n + 1]), y[n:n + 1])
    ref = looped_by(model, 3, alone)
    model[1].memory = memory
    assert_close_to_loop(got, ref, dtype)


WRONG = {
    "normalises-by-batch-size": (lambda: seq(ByBatchSize()), "'1' (ByBatchSize)", "vmap"),
    "branch-on-the-batch": (lambda: nn.Sequential(BatchBranch(), nn.Linear(4, 2)),
                            "'0' (BatchBranch)", "sample-by-sample"),
}


@pytest.mark.parametrize("check", [True, False], ids=["check", "no-check"])
@pytest.mark.parametrize("case", list(WRONG))
def test_replay_that_computes_something_else_is_refused_whatever_check_says(case, check,
                                                                           loss_reduction, dtype):
    """(e): a replay that runs but is not the batched forward's share of each sample: refused by
    the verification with check=False too (ReplayMismatchError, a GradientMismatchError),
    naming the module, the parameter and how it was replayed."""
    make, who, how = WRONG[case]
    model = make().to(dtype)
    x = torch.rand(3, 4, dtype=dtype)
    x[2] += 5  # (BatchBranch: the batch takes the tanh branch, samples 0 and 1 alone do not)
    with pytest.raises(gradhooks.ReplayMismatchError, match="does not add up to its batch gradient") as e:
        _read(model, x, torch.rand(3, dtype=dtype), loss_reduction, check=check)
    msg = str(e.value)
    assert msg.startswith(f"module {who}:") and how in msg and "check=False does not skip" in msg
    assert isinstance(e.value, gradhooks.GradientMismatchError)


@pytest.mark.parametrize("check", [True, False], ids=["check", "no-check"])
def test_module_whose_state_changed_since_its_forward_is_refused(check, dtype):
    """(c): a buffer the forward updated in place and then read: run again, the module is not
    the forward's function, which the verification sees in its output (whatever check says)."""
    model = seq(RunningUsed()).to(dtype)
    x = torch.randn(3, 4, dtype=dtype)
    with pytest.raises(gradhooks.ReplayMismatchError, match="'1' .RunningUsed.: run again on its "
                       "recorded inputs, its forward does not give the output"):
        _read(model, x, torch.rand(3, dtype=dtype), check=check)


@pytest.mark.filterwarnings("ignore::gradhooks.FallbackWarning")
def test_mixing_module_accepted_by_allow_sample_mixing_is_still_refused_with_check_false():
    """x - x.mean(0) in a fallback module: provenance's refusal waived (allow_sample_mixing) and
    the sum check off, the replay's verification still refuses it."""
    model = seq(Centred()).double()
    with pytest.raises(gradhooks.ReplayMismatchError, match="'1' .Centred.*'1.w'"):
        _read(model, torch.randn(4, 4, dtype=torch.float64), torch.rand(4, dtype=torch.float64),
              check=False, allow_sample_mixing=True)


def test_unsafe_skip_replay_check_really_skips_the_verification():
    """The loudly named switch returns the wrong replay, as it says: the per-sample gradients of
    ByBatchSize's weight then sum to B times autograd's batch gradient (what the verification
    refuses); a right replay is unchanged by it."""
    model = seq(ByBatchSize()).double()
    x, y = torch.randn(3, 4, dtype=torch.float64), torch.rand(3, dtype=torch.float64)
    weighted_square_loss("sum")(model(x), y).backward()
    batch_grad = model[1].w.grad.clone()
    model.zero_grad()
    got, _ = _read(model, x, y, "sum", check=False, unsafe_skip_replay_check=True)
    torch.testing.assert_close(got["1.w"].sum(0), 3 * batch_grad, rtol=1e-10, atol=0)
    model = seq(OldStyle()).double()
    ref = loop_grads(model, weighted_square_loss("mean"), x, y)
    got, _ = _read(model, x, y, unsafe_skip_replay_check=True)
    assert_close_to_loop(got, ref, torch.float64)


def test_random_forward_that_vmap_cannot_replay_is_refused():
    """A random forward (dropout in training mode) whose vmap fails first (on its old-style
    Function): the loop replays other dropout masks, and the verification refuses it (run again,
    the module does not give its recorded output), naming randomness."""

    class NoisyOld(OldStyle):
        def forward(self, x):
            return nn.functional.dropout(super().forward(x), 0.5, self.training)

    model = seq(NoisyOld()).double()
    with pytest.raises(gradhooks.GradHooksError, match="'1' .NoisyOld.") as e:
        _read(model, torch.randn(3, 4, dtype=torch.float64), torch.rand(3, dtype=torch.float64),
              check=False)
    assert "random" in str(e.value)


def _recurrent_gemma():
    """transformers' RecurrentGemma (tiny, random weights): its RG-LRU layer
    (RecurrentGemmaRglru, raw parameters, no gradhooks rule) applies an old-style
    autograd.Function (SqrtBoundDerivative) and keeps the recurrence's last state of all B rows
    in ``self.recurrent_states`` after the forward."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import zoo_imports  # noqa: F401  (torchvision in this venv: see the module)
    # isort: split
    import transformers  # (the test extra installs it: a missing one fails, never skips)
    cfg = transformers.RecurrentGemmaConfig(
        num_hidden_layers=2, vocab_size=32, hidden_size=16, intermediate_size=32,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, lru_width=16,
        attention_window_size=8, conv1d_width=3, block_types=["recurrent", "attention"])
    return transformers.RecurrentGemmaForCausalLM(cfg)


@pytest.mark.parametrize("use_cache", [False, True], ids=["no-cache", "cache"])
def test_recurrent_gemma_rg_lru_exact_not_a_raw_torch_error(use_cache):
    """A real module with two of the causes (vmap refuses its old-style Function; its forward
    leaves the recurrence's state of all B rows in ``self.recurrent_states``): on the default
    path it gave a raw torch error, refused with a ReplayError by the looped replay; since the
    forward's provenance follows the batch through its ops (issue 38's whitelist), its raw
    parameters' per-sample gradients are split where they meet the batch and come out exact
    against the loop (to float32's precision: its norms compute in float32 inside the float64
    model), no replay needed."""
    model = _recurrent_gemma().double()
    ids = torch.randint(0, 32, (3, 5))
    params = dict(model.named_parameters())
    ref = {n: torch.zeros(3, *p.shape, dtype=p.dtype) for n, p in params.items()}
    for i in range(3):
        model.zero_grad(set_to_none=True)
        model(input_ids=ids[i:i + 1], use_cache=use_cache).logits.square().sum().backward()
        for n, p in params.items():
            if p.grad is not None:
                ref[n][i] = p.grad
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gradhooks.FallbackWarning)
        with gradhooks.attach(model, loss_reduction="sum") as gh:
            model(input_ids=ids, use_cache=use_cache).logits.square().sum().backward()
            ours = gh.per_sample_grads()
    top = max(float(r.abs().max()) for r in ref.values())
    for n, r in ref.items():
        got = ours.get(n, torch.zeros_like(r))
        assert float((got - r).abs().max()) <= 1e-6 * max(float(r.abs().max()), 1e-3 * top), n


def test_tolerance_table_covers_the_float_dtypes():
    """The verification's tolerance is the sum check's (relative to sum_n |value_n|), far
    below what a wrong replay is off by (a factor B, or 4.5e4 in the issue's case)."""
    from gradhooks.readers.verify import SUM_CHECK_RTOL
    from gradhooks.rules.fallback_replay import REPLAY_RTOL
    assert REPLAY_RTOL == SUM_CHECK_RTOL
    assert RTOL[torch.float64] < REPLAY_RTOL[torch.float64] < 1e-6


class Float32Inside(nn.Module):
    """A float64 module that computes in float32 inside (as Gemma's RMSNorm casts), through an
    old-style Function (looped, so verified on every read)."""

    def __init__(self, d=4):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return OldSqrtTanh.apply(x.float(), self.w.float()).to(x.dtype)


@pytest.mark.parametrize("batch", [1, 3, 16], ids=["B1", "B3", "B16"])
def test_module_computing_in_float32_inside_is_verified_at_float32(batch):
    """Its gradient, formed in float32, is judged at float32's tolerance (as the sum check
    judges it): no false refusal; the result equals the loop to float32's precision."""
    model = seq(Float32Inside()).double()
    x, y = torch.randn(batch, 4, dtype=torch.float64), torch.rand(batch, dtype=torch.float64)
    ref = loop_grads(model, weighted_square_loss("mean"), x, y)
    for _ in range(2):
        got, _ = _read(model, x, y, check=False)
        for name in ref:
            scale = ref[name].abs().max()
            assert (got[name] - ref[name]).abs().max() <= RTOL[torch.float32] * scale, name


@pytest.mark.filterwarnings("ignore::gradhooks.FallbackWarning")
@pytest.mark.parametrize("method", ["ghost", "materialize"])
def test_norms_and_clipping_read_the_looped_replay_and_its_refusals(method, dtype):
    """Readers other than per_sample_grads (norms and clipping form the fallback's part through
    the same rule): exact against the loop for a module vmap cannot replay, and a wrong replay
    refused there too, with check=False."""
    model = seq(OldStyle()).to(dtype)
    x, y = torch.randn(3, 4, dtype=dtype), torch.rand(3, dtype=dtype)
    loss_fn = weighted_square_loss("sum")
    ref = loop_grads(model, loss_fn, x, y)
    norms = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in ref.values()))
    clipped = {n: (g * (0.5 / norms).clamp(max=1).view(-1, *[1] * (g.dim() - 1))).sum(0)
               for n, g in ref.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gradhooks.FallbackWarning)
        with gradhooks.attach(model, loss_reduction="sum", check=False) as gh:
            loss_fn(model(x), y).backward()
            torch.testing.assert_close(gh.per_sample_grad_norms(), norms,
                                       rtol=RTOL[dtype] * 10, atol=0)
            gh.clip_and_accumulate(0.5, method=method)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, clipped[n], rtol=RTOL[dtype] * 10,
                                   atol=RTOL[dtype] * float(clipped[n].abs().max()))
    model = seq(ByBatchSize()).to(dtype)
    with gradhooks.attach(model, loss_reduction="sum", check=False) as gh:
        loss_fn(model(x), y).backward()
        with pytest.raises(gradhooks.ReplayMismatchError, match="'1' .ByBatchSize.: its torch"):
            gh.per_sample_grad_norms()


def test_parameters_changed_between_the_forward_and_the_first_read_are_refused():
    """The replay recomputes the module with its parameters as they are at the read: an
    optimizer step taken before the first read of a structure makes it another function, which
    the verification sees in the output (check=False); read before the step, it is exact."""
    model = seq(Affine()).double()
    x, y = torch.randn(3, 4, dtype=torch.float64), torch.rand(3, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gradhooks.FallbackWarning)
        with gradhooks.attach(model, check=False) as gh:
            weighted_square_loss("mean")(model(x), y).backward()
            with torch.no_grad():
                model[1].w.add_(0.1)
            with pytest.raises(gradhooks.ReplayMismatchError,
                               match="'1' .Affine.*parameters changed since the forward"):
                gh.per_sample_grads()


class LaterByBatchSize(nn.Module):
    """``tanh(x * w)``, divided by ``x.shape[0]`` once ``by_size`` is set (state that changes
    what the forward computes on a later batch of the same call structure): its vmapped replay,
    which sees one sample, is then B times each sample's share."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 4))
        self.by_size = False

    def forward(self, x):
        y = torch.tanh(x * self.w)  # (a division either way: the forward's count of autograd
        return y / (x.shape[0] if self.by_size else 1)  # nodes stays, the replay must see it)


@pytest.mark.parametrize("check", [False, True, "always"], ids=["no-check", "default", "always"])
@pytest.mark.parametrize("b", [2, 3])
def test_every_replay_is_verified(b, check, dtype, monkeypatch):
    """Every call's replay is verified, whatever ``check`` says: a replay that becomes wrong on a
    later batch of the same call structure (state that changes what the forward computes) is
    refused on that batch, naming the module; until it changes, every read is exact against a
    loop."""
    calls = []
    original = fallback_module.verify
    monkeypatch.setattr(fallback_module, "verify",
                        lambda *a, **k: calls.append(1) or original(*a, **k))
    torch.manual_seed(0)
    model = nn.Sequential(LaterByBatchSize(), nn.Linear(4, 2)).to(dtype)
    twin = copy.deepcopy(model)  # (the loop's forwards are no calls of the hooked module)
    loss = weighted_square_loss("mean")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gradhooks.FallbackWarning)
        with gradhooks.attach(model, check=check) as gh:
            for step in range(1, 12):
                x, y = torch.randn(b, 4, dtype=dtype), torch.rand(b, dtype=dtype)
                model.zero_grad()
                loss(model(x), y).backward()
                assert_close_to_loop(gh.per_sample_grads(), loop_grads(twin, loss, x, y), dtype)
            assert len(calls) == 11
            model[0].by_size = True  # (same structure: the next call's replay is wrong)
            x, y = torch.randn(b, 4, dtype=dtype), torch.rand(b, dtype=dtype)
            model.zero_grad()
            loss(model(x), y).backward()
            with pytest.raises(gradhooks.ReplayMismatchError,
                               match=r"module '0' \(LaterByBatchSize\)"):
                gh.per_sample_grads()


class PlainLinear(nn.Module):
    """IBert's ``QuantLinear`` with quantisation off: F.linear of its own weight and bias,
    no rule (on the fallback)."""

    def __init__(self, d=4):
        super().__init__()
        self.weight, self.bias = nn.Parameter(0.5 * torch.randn(d, d)), nn.Parameter(torch.randn(d))

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class KeyBiasAttention(nn.Module):
    """The key projection's bias shifts every score of a query alike, which softmax over the
    keys ignores: its gradient is zero, in each sample, up to rounding."""

    def __init__(self, d=4):
        super().__init__()
        self.q, self.k, self.head = nn.Linear(d, d), PlainLinear(d), nn.Linear(d, 2)

    def forward(self, x):
        scores = self.q(x) @ self.k(x).transpose(1, 2)
        return self.head(torch.tanh(scores.softmax(-1) @ x).mean(1))


@pytest.mark.parametrize("batch", [1, 3, 8], ids=["B1", "B3", "B8"])
def test_a_replayed_gradient_zero_by_invariance_is_not_refused(batch, dtype):
    """The replay's verification judges the key bias's rounding relative to its module's
    largest gradient (1% of it, as the sum check floors): rounding of a sum that cancels is
    not a wrong replay (IBert's QuantLinear key was refused at a relative 0.09 of 2e-22)."""
    torch.manual_seed(0)
    model = KeyBiasAttention().to(dtype)
    x, y = torch.randn(batch, 5, 4, dtype=dtype), torch.rand(batch, dtype=dtype)
    ref = loop_grads(model, weighted_square_loss("mean"), x, y)
    got, _ = _read(model, x, y)
    scale = max(float(r.abs().max()) for r in ref.values())
    zero = got.pop("k.bias"), ref.pop("k.bias")  # (rounding: judged against the model's scale)
    assert all(float(t.abs().max()) <= RTOL[dtype] * scale for t in zero)
    assert_close_to_loop(got, ref, dtype)
