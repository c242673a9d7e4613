"""Behaviour of the hook manager: reuse, tying, freezing, several backward passes, detach, memory."""
import copy
import gc
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.base._pool import BufferPool

from conftest import assert_close_to_loop, check_against_loop, loop_grads, weighted_square_loss

F64 = torch.float64


class Reuse(nn.Module):
    """The same Linear called twice in one forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.lin(torch.tanh(self.lin(x)))))


class PythonRNN(nn.Module):
    """A recurrence written in Python: h_t = tanh(W_x x_t + W_h h_{t-1})."""

    def __init__(self, d=3, h=5):
        super().__init__()
        self.inp, self.rec, self.out = nn.Linear(d, h), nn.Linear(h, h, bias=False), nn.Linear(h, 2)

    def forward(self, x):  # (B, T, d)
        h = torch.zeros(x.shape[0], self.rec.in_features, dtype=x.dtype)
        for t in range(x.shape[1]):
            h = torch.tanh(self.inp(x[:, t]) + self.rec(h))
        return self.out(h)


class Residual(nn.Module):
    """Residual block with functional ops and an in-place activation between layers."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 3, 3, padding=1)
        self.conv2 = nn.Conv2d(3, 3, 3, padding=1, bias=False)
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        h = F.relu(self.conv1(x), inplace=True)
        h = x + self.conv2(h) * 0.5
        return self.fc(h.mean(dim=(2, 3)))


@pytest.mark.parametrize("batch", [1, 4], ids=["B1", "B4"])
@pytest.mark.parametrize("make,shape", [
    (Reuse, (4,)), (PythonRNN, (6, 3)), (Residual, (3, 5, 5)),
], ids=["reuse", "python-rnn", "residual-inplace"])
def test_multi_call_models_match_loop(make, shape, batch, loss_reduction, dtype):
    model = make()
    x = torch.randn(batch, *shape)
    check_against_loop(model, x, torch.rand(batch) + 0.5, loss_reduction=loss_reduction, dtype=dtype)


def test_tied_weights_one_entry_summed(loss_reduction, dtype):
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    model[2].weight = model[0].weight
    ours = check_against_loop(model, torch.randn(3, 4), torch.rand(3) + 0.5,
                              loss_reduction=loss_reduction, dtype=dtype)
    assert "2.weight" not in ours and "0.weight" in ours and "2.bias" in ours


def test_frozen_and_unreached_get_no_entry():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.unused = nn.Linear(3, 3), nn.Linear(3, 2), nn.Linear(3, 2)

        def forward(self, x):
            h = self.a(x)
            self.unused(h)  # computed but never part of the loss
            return self.b(h)

    model = Branchy().double()
    model.a.weight.requires_grad_(False)
    ours = check_against_loop(model, torch.randn(4, 3), torch.rand(4) + 0.5,
                              loss_reduction="mean", dtype=F64)
    assert list(ours) == ["a.bias", "b.weight", "b.bias"]
    assert not hasattr(model.a.weight, "grad_sample")


def test_param_grad_is_untouched():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x, w = torch.randn(5, 3, dtype=F64), torch.rand(5, dtype=F64)
    loss_fn = weighted_square_loss("mean")
    loss_fn(model(x), w).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with gradhooks.attach(model) as gh:
        loss_fn(model(x), w).backward()
        per = gh.per_sample_grads()
    for (name, p), e in zip(model.named_parameters(), expected):
        torch.testing.assert_close(p.grad, e, rtol=0, atol=0)
        torch.testing.assert_close(per[name].mean(0), e, rtol=1e-12, atol=1e-14)


def test_several_backward_passes_accumulate_then_next_forward_replaces(grad_totals):
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x, w = torch.randn(4, 3, dtype=F64), torch.rand(4, dtype=F64) + 0.5
    f1 = weighted_square_loss("sum")
    f2 = lambda out, w: (w[:, None] * out).sum()  # noqa: E731
    both = lambda out, w: f1(out, w) + f2(out, w)  # noqa: E731
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        out = model(x)
        f1(out, w).backward(retain_graph=True)
        first = {k: v.clone() for k, v in gh.per_sample_grads(retain_records=True).items()}
        f2(out, w).backward()
        assert_close_to_loop(gh.per_sample_grads(), loop_grads(model, both, x, w), F64)
        assert_close_to_loop(first, loop_grads(model, f1, x, w), F64)
        # a new forward starts a new batch: results are replaced, not added
        x2 = torch.randn(4, 3, dtype=F64)
        f1(model(x2), w).backward()
        assert_close_to_loop(gh.per_sample_grads(), loop_grads(model, f1, x2, w), F64)
        gh.clear()
        assert all(p.grad_sample is None for p in model.parameters())
        with pytest.raises(gradhooks.NoBackwardError):
            gh.per_sample_grads()


def test_a_backward_after_a_releasing_read_makes_reads_raise():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x, w = torch.randn(4, 3, dtype=F64), torch.rand(4, dtype=F64)
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        out = model(x)
        weighted_square_loss("sum")(out, w).backward(retain_graph=True)
        gh.per_sample_grads()  # releases the records
        out.sum().backward()  # autograd's part still works
        for read in (gh.per_sample_grads, gh.per_sample_grad_norms, gh.kfac_factors,
                     lambda: gh.clip_and_accumulate(1.0)):
            with pytest.raises(gradhooks.RecordsReleasedError,
                               match=r"reached module '2' \(Linear\).*retain_records=True"):
                read()
        weighted_square_loss("sum")(model(x), w).backward()  # a new batch reads again
        assert_close_to_loop(gh.per_sample_grads(), loop_grads(model, weighted_square_loss("sum"), x, w), F64)


class _LSTMHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.head = nn.LSTM(3, 5, batch_first=True), nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0])


def _holders(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


@pytest.mark.parametrize("retain", [False, True])
def test_per_sample_grads_releases_the_records_unless_asked_to_retain(retain):
    torch.manual_seed(0)
    model = _LSTMHead().double()
    lstm, head = model.lstm, model.head
    x, w = torch.randn(4, 6, 3, dtype=F64), torch.rand(4, dtype=F64)
    loss_fn = lambda out, w: (w[:, None, None] * out ** 2).sum()  # noqa: E731
    h = lstm(x)[0]
    loss_fn(head(h), w).backward(retain_graph=True)  # the graph (and the hooks on it) stay alive
    plain = (_holders(x), _holders(h))  # what autograd and the variables hold without hooks
    model.zero_grad()
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        h = lstm(x)[0]
        loss_fn(head(h), w).backward(retain_graph=True)
        held = (_holders(x), _holders(h))
        assert held[0] > plain[0] and held[1] > plain[1]  # records: lstm's input; its output
        grads = gh.per_sample_grads(retain_records=retain)
        assert (_holders(x), _holders(h)) == (held if retain else plain)
        norms = gh.per_sample_grad_norms(per_param=True)  # from the records, or the result
        if retain:
            assert set(gh.kfac_factors()) == {"head", "lstm.weight_ih_l0", "lstm.weight_hh_l0"}
        else:
            with pytest.raises(gradhooks.RecordsReleasedError,
                               match=r"kfac_factors\(\) before per_sample_grads\(\)"):
                gh.kfac_factors()
    ref = loop_grads(model, loss_fn, x, w)
    assert_close_to_loop(grads, ref, F64)
    for name, n in norms.items():
        torch.testing.assert_close(n, ref[name].flatten(1).norm(dim=1), rtol=1e-10, atol=1e-12)


def test_the_next_forward_drops_the_records_before_its_first_layer_runs():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x1, x2, w = torch.randn(5, 3, dtype=F64), torch.randn(5, 3, dtype=F64), torch.rand(5, dtype=F64)
    before = _holders(x1)
    seen = []
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        weighted_square_loss("sum")(model(x1), w).backward()
        assert _holders(x1) > before  # recorded
        with torch.no_grad():
            model(x1)  # records nothing, drops nothing
        assert _holders(x1) > before
        handle = model[0].register_forward_pre_hook(lambda m, args: seen.append(_holders(x1)))
        weighted_square_loss("sum")(model(x2), w).backward()
        handle.remove()
        assert seen == [before]  # not held beside the first layer's new activations
        assert_close_to_loop(gh.per_sample_grads(), loop_grads(model, weighted_square_loss("sum"), x2, w), F64)


def test_reads_after_a_releasing_read_match_those_from_the_records():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x, w = torch.randn(5, 3, dtype=F64), torch.rand(5, dtype=F64)
    got = {}
    for retain in (True, False):
        with gradhooks.attach(model, loss_reduction="mean") as gh:
            weighted_square_loss("mean")(model(x), w).backward()
            gh.per_sample_grads(retain_records=retain)
            assert gh.recorder.released is not retain
            norms = gh.per_sample_grad_norms()
            clip_norms = gh.clip_and_accumulate(0.5)  # ghost from the records, else the result
            got[retain] = (norms, clip_norms, [p.grad.clone() for p in model.parameters()])
    for a, b in zip(got[True][:2], got[False][:2]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    for a, b in zip(got[True][2], got[False][2]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_new_batch_may_have_another_batch_size():
    model = nn.Linear(3, 2).double()
    with gradhooks.attach(model) as gh:
        for b in (4, 3):
            weighted_square_loss()(model(torch.randn(b, 3, dtype=F64)), torch.ones(b, dtype=F64)).backward()
            assert gh.per_sample_grads()["weight"].shape == (b, 2, 3)
            assert gh.batch_size == b


def test_no_grad_forward_records_nothing():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).double()
    x, w = torch.randn(4, 3, dtype=F64), torch.ones(4, dtype=F64)
    with gradhooks.attach(model) as gh:
        with torch.no_grad():
            model(x)
        with torch.inference_mode():
            model(x)
        with pytest.raises(gradhooks.NoBackwardError):
            gh.per_sample_grads()
        weighted_square_loss()(model(x), w).backward()
        before = gh.per_sample_grads()
        with torch.no_grad():
            model(torch.randn(7, 3, dtype=F64))  # another batch size, but records nothing
        assert gh.per_sample_grads() is before
        assert gh.batch_size == 4


def _hook_state(model):
    state = []
    for m in model.modules():
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                     "_backward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
            state.append(dict(getattr(m, attr)))
    for p in model.parameters():
        state.append((p._backward_hooks, sorted(p.__dict__)))
    return state


def test_detach_restores_model_exactly():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(2 * 3 * 3, 2))
    before_hooks = _hook_state(model)
    before_pickle = pickle.dumps(model)
    before_state = {k: v.clone() for k, v in model.state_dict().items()}
    gh = gradhooks.attach(model)
    x = torch.randn(3, 1, 5, 5)
    weighted_square_loss()(model(x), torch.ones(3)).backward()
    gh.per_sample_grads()
    assert _hook_state(model) != before_hooks
    model.zero_grad(set_to_none=True)
    gh.detach()
    gh.detach()  # harmless
    assert _hook_state(model) == before_hooks
    assert pickle.dumps(model) == before_pickle
    assert list(model.state_dict()) == list(before_state)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before_state[k])
    clone = copy.deepcopy(model)
    assert _hook_state(clone) == before_hooks
    buf = io.BytesIO()
    torch.save(model, buf)
    # after detach, a forward/backward records nothing and sets no attribute
    weighted_square_loss()(model(x), torch.ones(3)).backward()
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())


def test_context_manager_detaches_and_keeps_a_users_grad_sample():
    model = nn.Linear(2, 2)
    model.weight.grad_sample = "mine"
    with gradhooks.attach(model) as gh:
        weighted_square_loss()(model(torch.randn(3, 2)), torch.ones(3)).backward()
        gh.per_sample_grads()
        assert isinstance(model.weight.grad_sample, torch.Tensor)
    assert model.weight.grad_sample == "mine"
    assert not hasattr(model.bias, "grad_sample")
    assert not model._forward_hooks and not model._forward_hooks_with_kwargs
    gradhooks.attach(model).detach()  # can attach again after detach


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_memory_does_not_grow_over_200_steps():
    """Each step records ~3 MB of activations and makes ~8 MB of per-sample gradients; a leak
    of either would add over 2 GB in 200 steps."""
    model = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 32 * 32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(gh):
        loss = weighted_square_loss()(model(torch.randn(64, 4, 32, 32)), torch.ones(64))
        opt.zero_grad()
        loss.backward()
        gh.per_sample_grads()
        opt.step()

    with gradhooks.attach(model) as gh:
        for _ in range(10):
            step(gh)
        gc.collect()
        start = _rss_bytes()
        for _ in range(200):
            step(gh)
        gc.collect()
        grown = _rss_bytes() - start
        assert len(gh.recorder.records) == 2  # only the last batch's two calls are held
    assert grown < 60e6, f"RSS grew by {grown / 1e6:.1f} MB over 200 steps"


def test_forward_without_backward_frees_its_activations():
    """50 forwards of 4 MB inputs whose outputs are dropped: nothing may be kept."""
    model = nn.Linear(4096, 8)
    with gradhooks.attach(model):
        model(torch.randn(256, 4096))
        gc.collect()
        start = _rss_bytes()
        for _ in range(50):
            model(torch.randn(256, 4096))  # output discarded: graph and recorded input go with it
        gc.collect()
        grown = _rss_bytes() - start
    assert grown < 40e6, f"RSS grew by {grown / 1e6:.1f} MB"


class SeqHead(nn.Module):
    """(T, B, d) -> per-step Linear -> last step (B, h) -> Linear head, torch's sequence layout."""

    def __init__(self):
        super().__init__()
        self.step, self.head = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.step(x))[-1])


@pytest.mark.parametrize("batch", [1, 3], ids=["B1", "B3"])
def test_batch_second_sequence_with_2d_head(batch, loss_reduction, dtype):
    x = torch.randn(5, batch, 3)
    check_against_loop(SeqHead(), x, torch.rand(batch) + 0.5, loss_reduction=loss_reduction,
                       dtype=dtype, batch_first=False, loss_fn=weighted_square_loss(loss_reduction))


@pytest.mark.parametrize("layout", ["channels_last", "transposed", "sliced"])
def test_non_contiguous_inputs(layout, dtype):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1, padding_mode="replicate")
            self.conv_b = nn.Conv2d(4, 2, 2, stride=2)
            self.fc = nn.Linear(2, 2)

        def forward(self, x):
            h = self.conv_b(torch.relu(self.conv(x)))  # (B, 2, 3, 3)
            return self.fc(h.transpose(1, 3))  # non-contiguous Linear input (B, 3, 3, 2)

    x = torch.randn(4, 3, 6, 6)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "transposed":
        x = x.transpose(2, 3).contiguous().transpose(2, 3)
    else:
        x = torch.randn(4, 3, 6, 12)[..., ::2]
    assert not x.is_contiguous()
    check_against_loop(Net(), x, torch.rand(4) + 0.5, loss_reduction="mean", dtype=dtype)


def test_layer_called_with_keyword_input():
    class KW(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x):
            return self.lin(input=x)

    check_against_loop(KW(), torch.randn(4, 3), torch.rand(4) + 0.5, loss_reduction="sum", dtype=F64)


def test_module_registered_twice_in_the_tree():
    shared = nn.Linear(3, 3)
    model = nn.Sequential(shared, nn.Tanh(), shared)  # one module under two names
    ours = check_against_loop(model, torch.randn(4, 3), torch.rand(4) + 0.5,
                              loss_reduction="mean", dtype=F64)
    assert list(ours) == ["0.weight", "0.bias"]


def test_frozen_weight_trainable_bias_input_without_grad():
    model = nn.Sequential(nn.Conv1d(2, 3, 3), nn.Tanh(), nn.Conv1d(3, 2, 2))
    model[0].weight.requires_grad_(False)
    model[2].weight.requires_grad_(False)
    ours = check_against_loop(model, torch.randn(3, 2, 7), torch.rand(3) + 0.5,
                              loss_reduction="mean", dtype=F64)
    assert list(ours) == ["0.bias", "2.bias"]


def test_torch_func_transforms_on_an_attached_model_record_nothing():
    from torch.func import functional_call, grad, vmap
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x = torch.randn(5, 3, dtype=F64)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xn):
        return functional_call(model, p, (xn.unsqueeze(0),)).pow(2).sum()

    with gradhooks.attach(model, loss_reduction="sum") as gh:
        per = vmap(grad(loss), in_dims=(None, 0))(params, x)
        with pytest.raises(gradhooks.NoBackwardError):
            gh.per_sample_grads()
        model(x).pow(2).sum().backward()
        ours = gh.per_sample_grads()
    for k in per:
        torch.testing.assert_close(ours[k], per[k], rtol=1e-10, atol=1e-12)


def test_result_buffers_are_reused_only_when_nothing_holds_them(monkeypatch):
    monkeypatch.setattr(BufferPool, "MIN_BYTES", 0)  # the test's tensors are small
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 2)).double()

    def step(x):
        (model(x) ** 2).sum().backward()
        return gh.per_sample_grads()

    x1, x2, x3 = (torch.randn(4, 6, dtype=torch.float64) for _ in range(3))
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        kept = step(x1)["0.weight"]
        snapshot = kept.clone()
        view = step(x2)["1.weight"][0]  # a view keeps its storage alive
        view_snapshot = view.clone()
        ptr2 = gh.per_sample_grads()["0.weight"].data_ptr()
        res3 = step(x3)
        assert torch.equal(kept, snapshot) and torch.equal(view, view_snapshot)
        assert res3["1.weight"].data_ptr() != view.data_ptr()
        assert res3["0.weight"].data_ptr() == ptr2  # nobody held batch 2's tensor: reused
        ref = loop_grads(model, lambda out, _: (out ** 2).sum(), x3, torch.zeros(4))
        assert_close_to_loop(res3, ref, torch.float64)


def test_result_buffers_are_reused_in_a_loop_that_rebinds_its_variable(monkeypatch):
    monkeypatch.setattr(BufferPool, "MIN_BYTES", 0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 2)).double()
    ptrs = []
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        grads = None
        for _ in range(4):
            x = torch.randn(3, 6, dtype=torch.float64)
            (model(x) ** 2).sum().backward()
            grads = gh.per_sample_grads()  # the previous result is still bound while this runs
            ptrs.append(grads["0.weight"].data_ptr())
        ref = loop_grads(model, lambda out, _: (out ** 2).sum(), x, torch.zeros(3))
        assert_close_to_loop(grads, ref, torch.float64)
    assert ptrs[2] == ptrs[0] and ptrs[3] == ptrs[1] and ptrs[0] != ptrs[1]


def test_buffer_pool_keeps_only_large_cpu_tensors():
    pool = BufferPool()
    big = torch.empty(BufferPool.MIN_BYTES // 4, dtype=torch.float32)
    small = torch.empty(BufferPool.MIN_BYTES // 4 - 1, dtype=torch.float32)
    meta = torch.empty(BufferPool.MIN_BYTES, device="meta")  # not CPU: left to its allocator
    shapes = [(t.shape, t.dtype, t.device) for t in (big, small, meta)]
    pool.give([big, small, meta])
    del big, small, meta
    assert pool.take(*shapes[0]) is not None
    assert pool.take(*shapes[1]) is None and pool.take(*shapes[2]) is None


def test_weight_tied_between_two_bias_free_layers(loss_reduction, dtype):
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Tanh(), nn.Linear(4, 4, bias=False))
    model[2].weight = model[0].weight
    ours = check_against_loop(model, torch.randn(3, 4), torch.rand(3), loss_reduction=loss_reduction,
                              dtype=dtype)
    assert list(ours) == ["0.weight"]


# --------------------------------------------------------------- the forward hook's structure walk
_Pair = __import__("collections").namedtuple("_Pair", "first second")
_TENSORS = [torch.randn(2, requires_grad=True), torch.randn(3), torch.randn(1, 2)]


def _structures():
    from hypothesis import strategies as st

    leaves = st.one_of(st.sampled_from(_TENSORS), st.none(), st.integers(-3, 3), st.booleans(),
                       st.sampled_from(["a", torch.float32, torch.device("cpu")]))
    return st.recursive(leaves, lambda inner: st.one_of(
        st.tuples(inner, inner), st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(["x", "y", "z"]), inner, max_size=3),
        st.builds(_Pair, inner, inner)), max_leaves=12)


def test_structure_walk_matches_torch_pytree():
    """The forward hook's own walk of call arguments and outputs (plain containers, pytree for
    the rest) gives what torch's pytree gives: leaves, spec, tensors, detached copies."""
    from hypothesis import given, settings
    from torch.utils._pytree import tree_flatten

    from gradhooks.base import utils

    @settings(max_examples=300, deadline=None)
    @given(_structures())
    def check(obj):
        leaves, spec = tree_flatten(obj)
        fast_leaves, fast_spec = utils.flatten(obj)
        assert fast_spec == spec
        assert len(fast_leaves) == len(leaves) and all(a is b for a, b in zip(fast_leaves, leaves))
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        assert [id(t) for t in utils.tensors(obj)] == [id(t) for t in tensors]
        det_leaves, det_spec = tree_flatten(utils.detached(obj))
        assert det_spec == spec
        for a, b in zip(det_leaves, leaves):
            if isinstance(b, torch.Tensor):
                assert not a.requires_grad and a.data_ptr() == b.data_ptr() and a is not b
            else:
                assert a is b or a == b

    check()
