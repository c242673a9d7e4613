"""Nothing outlives its GradHooks: torch's process-wide hook dictionaries after attach cycles,
dropped attachments, and one of two live attachments detached (issue 31).

An attachment puts entries in torch's global module hook dictionaries
(``torch.nn.modules.module._global_*``); these tests compare every one of them, keys and values,
before and after. (The time an unrelated model's forward takes is benchmarked, not tested:
``benchmarks/attach_cycles.py``.)
"""
import gc
import warnings

import pytest
import torch
import torch.nn.modules.module as torch_module
from torch import nn

import gradhooks
from gradhooks.core.recorder.capture import Recorder, is_hooked

from conftest import RTOL, loop_grads, weighted_square_loss

CYCLES = 1000

# Every global hook dictionary torch keeps (torch 2.13: forward, forward-pre, with-kwargs and
# always-called flags, backward, backward-pre, full-backward flag, module / parameter / buffer
# registration).
GLOBAL_DICTS = sorted(name for name in vars(torch_module)
                      if name.startswith("_global_") and isinstance(vars(torch_module)[name], dict))


def global_hooks() -> dict:
    """``{name: {id: entry}}`` of every global hook dictionary of torch, copied."""
    return {name: dict(getattr(torch_module, name)) for name in GLOBAL_DICTS}


def assert_same(before: dict, after: dict) -> None:
    for name in GLOBAL_DICTS:
        b, a = before[name], after[name]
        assert a.keys() == b.keys(), (f"{name}: {len(b)} entries before, {len(a)} after; "
                                      f"added {sorted(a.keys() - b.keys())}, "
                                      f"removed {sorted(b.keys() - a.keys())}")
        assert all(a[k] is b[k] for k in b), f"{name}: an entry replaced"


def added(before: dict, after: dict) -> dict:
    """``{name: ids}`` of the entries ``after`` has and ``before`` has not."""
    return {name: after[name].keys() - before[name].keys() for name in GLOBAL_DICTS
            if after[name].keys() - before[name].keys()}


@pytest.fixture(autouse=True)
def _collected():
    gc.collect()  # (attachments other tests dropped in reference cycles go first)
    yield


def test_the_dictionaries_are_found():
    assert {"_global_forward_hooks", "_global_forward_hooks_with_kwargs",
            "_global_forward_hooks_always_called", "_global_forward_pre_hooks",
            "_global_backward_hooks", "_global_backward_pre_hooks",
            "_global_module_registration_hooks",
            "_global_parameter_registration_hooks"} <= set(GLOBAL_DICTS)


def test_an_attachment_installs_its_entries_and_detach_removes_exactly_them():
    before = global_hooks()
    gh = gradhooks.attach(nn.Linear(3, 2))
    mine = added(before, global_hooks())
    assert mine.keys() == {"_global_forward_pre_hooks", "_global_forward_hooks",
                           "_global_forward_hooks_with_kwargs",
                           "_global_forward_hooks_always_called",
                           "_global_parameter_registration_hooks",
                           "_global_module_registration_hooks"}
    gh.detach()
    assert_same(before, global_hooks())


def test_torchs_with_kwargs_flag_is_removed_with_its_hook():
    # torch's RemovableHandle of a with_kwargs=True global forward hook leaves its flag in
    # _global_forward_hooks_with_kwargs (torch 2.13); detach removes it.
    before = dict(torch_module._global_forward_hooks_with_kwargs)
    for _ in range(50):
        gradhooks.attach(nn.Linear(3, 2)).detach()
    assert torch_module._global_forward_hooks_with_kwargs == before


def test_attach_detach_cycles_leave_torchs_global_hooks_as_they_were():
    before = global_hooks()
    x = torch.randn(4, 3)
    for i in range(CYCLES):
        model = nn.Linear(3, 2)
        with gradhooks.attach(model) as gh:
            if i % 100 == 0:  # (some cycles also record and read)
                model(x).pow(2).sum().backward()
                gh.per_sample_grads()
    assert_same(before, global_hooks())


def test_dropped_attachments_go_with_their_hooks_and_warn():
    before = global_hooks()
    models = [nn.Linear(3, 2) for _ in range(CYCLES)]
    with pytest.warns(gradhooks.NotDetachedWarning, match="without detach") as record:
        for model in models:
            gradhooks.attach(model)  # never detached, dropped at once
        gc.collect()
    assert sum(issubclass(w.category, gradhooks.NotDetachedWarning) for w in record) == CYCLES
    assert issubclass(gradhooks.NotDetachedWarning, ResourceWarning)
    assert_same(before, global_hooks())
    model = models[0]  # as after detach(): no hook, re-attachable
    assert not is_hooked(model)
    assert all(not p._backward_hooks for p in model.parameters())
    gradhooks.attach(model).detach()


def test_an_attachment_dropped_in_a_reference_cycle_goes_at_collection():
    before = global_hooks()
    model = nn.Linear(3, 2)
    holder = {"gh": gradhooks.attach(model)}
    holder["self"] = holder  # only the cycle collector frees it
    model(torch.randn(4, 3)).sum().backward()
    del holder
    with pytest.warns(gradhooks.NotDetachedWarning):
        gc.collect()
    assert_same(before, global_hooks())
    assert not is_hooked(model)


def test_a_recorder_collected_without_detach_removes_its_hooks():
    # A Recorder without its GradHooks facade: the hooks hold it weakly, its finalizer removes
    # the global entries and the parameters' gradient hooks.
    before = global_hooks()
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    recorder = Recorder(model)
    model(torch.randn(5, 3)).sum().backward()
    assert is_hooked(model)
    del recorder
    with pytest.warns(gradhooks.NotDetachedWarning, match="recorder"):
        gc.collect()
    assert_same(before, global_hooks())
    assert not is_hooked(model)
    assert all(not p._backward_hooks for p in model.parameters())


def test_detach_after_a_detached_attachment_was_dropped():
    # (a detached GradHooks dropped later warns nothing and removes nothing)
    before = global_hooks()
    gh = gradhooks.attach(nn.Linear(3, 2))
    gh.detach()
    with warnings.catch_warnings():
        warnings.simplefilter("error", gradhooks.NotDetachedWarning)
        del gh
        gc.collect()
    assert_same(before, global_hooks())


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_two_live_attachments_one_detached_the_other_still_exact(reduction):
    torch.manual_seed(0)
    dtype = torch.float64
    first, second = (nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(dtype)
                     for _ in range(2))
    loss_fn = weighted_square_loss(reduction)
    x, y = torch.randn(6, 5, dtype=dtype), torch.rand(6, dtype=dtype)

    before = global_hooks()
    gh_first = gradhooks.attach(first, loss_reduction=reduction)
    with_first = global_hooks()
    gh_second = gradhooks.attach(second, loss_reduction=reduction)
    gh_second.detach()
    assert_same(with_first, global_hooks())  # exactly the second's entries went

    loss_fn(first(x), y).backward()
    second(x).sum().backward()  # (a model whose attachment was detached records nothing)
    grads = gh_first.per_sample_grads()
    ref = loop_grads(first, loss_fn, x, y)
    assert grads.keys() == ref.keys()
    for name, r in ref.items():
        err = (grads[name] - r).abs().max() / r.abs().max()
        assert err <= RTOL[dtype], name
    assert not any(hasattr(p, "grad_sample") for p in second.parameters())
    gh_first.detach()
    assert_same(before, global_hooks())


def test_a_dropped_attachment_leaves_a_live_one_exact():
    torch.manual_seed(1)
    dtype = torch.float64
    live_model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).to(dtype)
    loss_fn = weighted_square_loss("mean")
    x, y = torch.randn(5, 4, dtype=dtype), torch.rand(5, dtype=dtype)
    with gradhooks.attach(live_model) as gh:
        with_live = global_hooks()
        with pytest.warns(gradhooks.NotDetachedWarning):
            gradhooks.attach(nn.Linear(4, 2).to(dtype))
            gc.collect()
        assert_same(with_live, global_hooks())
        loss_fn(live_model(x), y).backward()
        grads = gh.per_sample_grads()
    ref = loop_grads(live_model, loss_fn, x, y)
    for name, r in ref.items():
        assert (grads[name] - r).abs().max() / r.abs().max() <= RTOL[dtype], name


def test_a_refused_attach_leaves_nothing_installed():
    class Scale(nn.Module):  # trainable, no rule: refused with strict=True
        def __init__(self):
            super().__init__()
            self.s = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x * self.s

    before = global_hooks()
    model = nn.Sequential(nn.Linear(3, 3), Scale())
    with warnings.catch_warnings():
        warnings.simplefilter("error", gradhooks.NotDetachedWarning)
        with pytest.raises(gradhooks.UnsupportedModuleError):
            gradhooks.attach(model, strict=True)
        assert_same(before, global_hooks())
        gc.collect()
    assert not is_hooked(model)
    with gradhooks.attach(model[0]):  # (and the first layer is free)
        pass
    assert_same(before, global_hooks())


def test_suspended_then_detached_leaves_the_dictionaries_as_they_were():
    before = global_hooks()
    gh = gradhooks.attach(nn.Linear(3, 2))
    with gh.recorder.suspended():
        assert_same(before, global_hooks())  # nothing of it while suspended
    gh.detach()
    assert_same(before, global_hooks())
