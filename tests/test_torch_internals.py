"""Every torch internal gradhooks reads (gradhooks/base/torch_internals.py) still exists, with
the behaviour gradhooks relies on, on the torch this runs on: a torch release that moves one
fails here with the internal's name, not in a user's run (issue 40, point 7)."""
import configparser
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.base import torch_internals as ti
from gradhooks.base.errors import GradHooksError


def _version(v):
    return tuple(int(p) for p in v.split("+")[0].split(".")[:3])


def test_nothing_missing():
    assert ti.missing() == {}, f"torch {torch.__version__} lacks: {ti.missing()}"


def test_floor_is_install_requires():
    """The tested floor, setup.cfg's install_requires and this torch agree."""
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "setup.cfg"))
    requires = cfg["options"]["install_requires"].split()
    assert [r for r in requires if r.startswith("torch")] == [f"torch>={ti.FLOOR}"], requires
    assert _version(torch.__version__) >= _version(ti.FLOOR)


def test_engine_frame():
    """ENGINE_FRAME is a frame on the stack while a backward pass runs the hooks."""
    seen = []

    def hook(g):
        names, f = [], sys._getframe()
        while f is not None:
            names.append(f.f_code.co_name)
            f = f.f_back
        seen.append(ti.ENGINE_FRAME in names)

    x = torch.randn(3, requires_grad=True)
    y = x * 2
    y.register_hook(hook)
    y.sum().backward()
    torch.autograd.grad((x * 3).sum(), x)  # (no hook: only checks grad() goes through it)
    assert seen == [True], f"torch.autograd.graph.{ti.ENGINE_FRAME} is no longer on the stack"


def test_global_hook_flags():
    """A global forward hook with with_kwargs / always_call leaves its flags in the named
    dictionaries, under its handle's id."""
    h = torch.nn.modules.module.register_module_forward_hook(lambda *a: None, with_kwargs=True,
                                                              always_call=True)
    try:
        for name in ti.GLOBAL_HOOK_FLAGS:
            assert h.id in getattr(ti.torch_module, name), f"{name} does not hold the hook's id"
    finally:
        h.remove()
        for name in ti.GLOBAL_HOOK_FLAGS:
            getattr(ti.torch_module, name).pop(h.id, None)


def test_autograd_node_and_task_id():
    assert ti.current_graph_task_id() == -1, "_current_graph_task_id outside backward"
    seen = []
    x = torch.randn(3, requires_grad=True)
    y = x * 2
    y.grad_fn.register_prehook(lambda g: seen.append((ti.current_autograd_node(),
                                                      ti.current_graph_task_id())))
    y.sum().backward()
    (node, task), = seen
    assert node is y.grad_fn, "_current_autograd_node is not the node running its pre-hook"
    assert task != -1, "_current_graph_task_id inside backward"


def test_storage_use_count_and_functorch():
    t = torch.zeros(4)
    before = ti.storage_use_count(ti.storage_handle(t))
    view = t[:2]  # noqa: F841 (a second reference to the storage)
    assert ti.storage_use_count(ti.storage_handle(t)) == before + 1
    assert not ti.is_functorch_wrapped(t)
    seen = []
    torch.func.vmap(lambda r: seen.append(ti.is_functorch_wrapped(r)) or r)(torch.zeros(2, 3))
    assert seen == [True], "is_functorch_wrapped_tensor does not see a vmap's tensor"


def test_optimized_module_and_dtensor():
    model = nn.Linear(2, 2)
    compiled = torch.compile(model)
    assert isinstance(compiled, ti.OptimizedModule) and ti.compiled_module(compiled) is model
    assert ti.DTensor is not None, "torch.distributed.tensor no longer exports DTensor"
    assert ti.Partial is not None and ti.distribute_tensor is not None


def _nodes():
    # one graph per node type of ti.SAVED, made by the ops that give it
    x = torch.randn(4, 3, requires_grad=True)
    y = torch.randint(0, 3, (4,))
    w = torch.randn(2, 4, 5, requires_grad=True)
    yield F.nll_loss(F.log_softmax(x, 1), y).grad_fn
    yield F.mse_loss(x, torch.zeros(4, 3)).grad_fn
    yield x.sum(1).mean().grad_fn
    yield (x / 2).grad_fn
    yield x[torch.tensor([0, 2])].grad_fn
    yield w.transpose(-2, -1).grad_fn
    yield w[1].grad_fn
    yield x.sum(1, keepdim=True).grad_fn
    yield x.logsumexp(1).grad_fn
    yield x.softmax(1).grad_fn
    yield x.flip(0).grad_fn
    yield w.permute(2, 0, 1).grad_fn
    yield x[:, 1:].grad_fn
    yield x.gather(1, y[:, None]).grad_fn
    yield x.split(2)[0].grad_fn
    yield torch.cat([x, x]).grad_fn
    yield torch.stack([x, x]).grad_fn
    yield F.binary_cross_entropy_with_logits(x, torch.zeros(4, 3)).grad_fn
    yield F.layer_norm(x, (3,)).grad_fn
    yield F.batch_norm(x, None, None, training=True).grad_fn


def test_saved_attributes():
    """Each node attribute of ti.SAVED exists on a node of that type, named as listed."""
    found = {type(n).__name__: n for n in _nodes()}
    for name, attrs in ti.SAVED.items():
        assert name in found, f"no {name} node from its op on torch {torch.__version__}"
        for a in attrs:
            assert hasattr(found[name], f"_saved_{a}"), f"{name}._saved_{a} is gone"


def test_private_attributes():
    model = nn.Linear(2, 2)
    t = torch.zeros(2, requires_grad=True)
    objects = {"nn.Module": model, "Tensor": t, "UntypedStorage": t.untyped_storage(),
               "OptimizedModule": torch.compile(model), "Node": (t.requires_grad_() * 1).grad_fn}
    assert set(objects) == set(ti.PRIVATE_ATTRIBUTES)
    for kind, attrs in ti.PRIVATE_ATTRIBUTES.items():
        for a in attrs:
            assert hasattr(objects[kind], a), f"{kind}.{a} is gone"


def test_check_names_what_is_missing(monkeypatch):
    monkeypatch.delattr(torch.autograd.graph, ti.ENGINE_FRAME)
    monkeypatch.delattr(ti.torch_module, ti.GLOBAL_HOOK_FLAGS[0])
    with pytest.raises(GradHooksError, match=r"torch .* lacks: torch\.autograd\.graph\._engine_run_backward"
                                             r".*_global_forward_hooks_with_kwargs.*pip install 'torch>="):
        ti.check()


def test_main_job_runs():
    """The main job's core (per-sample gradients against the loop) on this torch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    with gradhooks.attach(model) as gh:
        F.mse_loss(model(x), y).backward()
        got = gh.per_sample_grads()
    for n in range(5):
        model.zero_grad()
        F.mse_loss(model(x[n:n + 1]), y[n:n + 1]).backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(got[name][n], p.grad, rtol=1e-12, atol=1e-14)


def test_older_hook_signature_is_named(monkeypatch):
    """torch 2.4.1's register_module_forward_hook(hook, *, always_call) has no with_kwargs."""
    def old(hook, *, always_call=False):
        raise AssertionError("not called")
    monkeypatch.setattr(ti.torch_module, "register_module_forward_hook", old)
    with pytest.raises(GradHooksError, match=r"register_module_forward_hook\(with_kwargs=, always_call=\)"):
        ti.check()


def test_without_dtensor(monkeypatch):
    """A torch whose torch.distributed.tensor exports no DTensor (2.4.1): no parameter is one."""
    from gradhooks.readers import distributed
    monkeypatch.setattr(distributed, "DTensor", None)
    assert not distributed.is_sharded(torch.zeros(2))


def test_private_modules():
    import functools
    import importlib
    for name, attrs in ti.PRIVATE_MODULES.items():
        head, *rest = name.split(".ops.") if ".ops." in name else (name,)
        mod = importlib.import_module(head)  # (torch.ops.aten: an attribute path, not a module)
        mod = functools.reduce(getattr, ["ops"] + rest[0].split(".") if rest else [], mod)
        for a in attrs:
            assert hasattr(mod, a), f"{name}.{a} is gone"


def test_saved_reads_the_node():
    """saved(node, name) is the node's ``_saved_<name>``; a default where it is absent."""
    x = torch.randn(4, 3, requires_grad=True)
    node = F.nll_loss(F.log_softmax(x, 1), torch.tensor([0, 1, 2, 0]), reduction="sum").grad_fn
    assert ti.saved(node, "reduction") == 2 and ti.saved(node, "weight") is None
    assert ti.saved(node, "no_such", "absent") == "absent"
    with pytest.raises(AttributeError):
        ti.saved(node, "no_such")


def test_version_and_view():
    t = torch.zeros(3)
    v = ti.version(t)
    t.add_(1)
    assert ti.version(t) == v + 1, "Tensor._version does not count an in-place change"
    assert ti.is_view(t[:2]) and not ti.is_view(t)


def test_own_parameters_and_buffers_are_the_dictionaries():
    bn = nn.BatchNorm1d(2)
    assert ti.own_parameters(bn)["weight"] is bn.weight
    assert ti.own_buffers(bn)["running_mean"] is bn.running_mean
    ti.own_buffers(bn)["extra"] = torch.ones(1)  # (the fallback's replay restores the dict itself)
    assert "extra" in dict(bn.named_buffers())


@pytest.mark.parametrize("kind", ["grad", "post_accumulate_grad"])
def test_hook_dictionaries(kind):
    """The hook dictionary is None before a first hook, holds it after, and is set back to None
    once empty (a parameter that never had a hook pickles as before)."""
    read = getattr(ti, f"{kind}_hooks")
    drop = getattr(ti, f"drop_empty_{kind}_hooks")
    p = nn.Parameter(torch.zeros(2))
    assert read(p) is None
    register = p.register_hook if kind == "grad" else p.register_post_accumulate_grad_hook
    h = register(lambda *a: None)
    assert len(read(p)) == 1
    drop(p)
    assert len(read(p)) == 1, "a dictionary holding a hook was dropped"
    h.remove()
    assert read(p) is not None and not read(p)
    drop(p)
    assert read(p) is None


def test_frames():
    """getframe(0) is the caller's frame (the builtin: depths count as with sys); current_frames
    holds this thread's."""
    import threading
    assert ti.getframe(0).f_code.co_name == "test_frames"
    assert threading.get_ident() in ti.current_frames()


def test_private_ops():
    """torch._VF's recurrent kernels, an aten op's type and embedding_bag's private ops."""
    assert callable(ti.VF.lstm) and callable(ti.VF.gru_cell)
    assert isinstance(torch.ops.aten.add.Tensor, ti.OpOverload)
    out = torch.nn.functional.embedding_bag(torch.tensor([0, 1]), torch.randn(3, 2),
                                            torch.tensor([0]), mode="max")
    assert out.shape == (1, 2) and len(ti.EMBEDDING_BAG_OPS) == 2


def test_graph_ops_fingerprints_the_model_ops_less_gradhooks_own():
    """graph_ops: the ops in the span that the outputs depend on; the same structure gives the
    same (count, fingerprint), one op swapped for another the same count and another
    fingerprint, gradhooks' own views (own) and nodes outside the span or off the outputs'
    graph are not counted."""
    w = torch.randn(3, 3, requires_grad=True)
    before = torch.randn(4, 3, requires_grad=True) * 2  # (a node made before the span)

    def run(swap, shared=False):
        start = ti.autograd_nodes_made()
        h = before @ w
        h = torch.tanh(h) * 1.0 if not swap else h - h.mean(0, keepdim=True)
        if shared:
            h = ti.own(h.expand(2, 4, 3), h)[0]
        (h * 3).sum()  # (off the outputs' graph)
        return ti.graph_ops([h], (start, ti.autograd_nodes_made()))

    plain = run(False)
    assert plain[0] == 3 and run(False) == plain
    assert run(False, shared=True)[0] == plain[0] + 1  # (the select is the model's; expand own)
    swapped = run(True)
    assert swapped[0] == plain[0] and swapped[1] != plain[1]
    assert ti.graph_ops([torch.zeros(2)], (0, 10)) == (0, 0)


@pytest.mark.parametrize("op", ["mean", "sum", "softmax", "flip", "cumsum", "transpose",
                                "cat", "narrow", "select"])
def test_graph_ops_fingerprints_the_dims_an_op_ran_along(op):
    """The same op along another dim (a square batch: the same shapes) changes the fingerprint,
    the same op along the same dim does not: autograd's saved dim arguments are hashed."""
    forms = {
        "mean": lambda h, d: h - h.mean(d, keepdim=True),
        "sum": lambda h, d: h * h.sum(d, keepdim=True),
        "softmax": lambda h, d: h.softmax(d),
        "flip": lambda h, d: h * h.flip(d),
        "cumsum": lambda h, d: h.cumsum(d),
        "transpose": lambda h, d: h.transpose(d, 1 - d) if d else h.transpose(0, 1),
        "cat": lambda h, d: torch.cat([h, h], d).narrow(d, 0, 4),
        "narrow": lambda h, d: h.narrow(d, 1, 3) * 2,
        "select": lambda h, d: h * h.select(d, 0).unsqueeze(d),
    }
    w = torch.randn(4, 4, requires_grad=True)

    def run(d):
        start = ti.autograd_nodes_made()
        h = forms[op](torch.randn(4, 4) @ w, d)
        return ti.graph_ops([h], (start, ti.autograd_nodes_made()))

    assert run(0) == run(0) and run(1) == run(1)
    if op != "transpose":  # (transpose(1, 0) and transpose(0, 1) are one op)
        assert run(0)[0] == run(1)[0] and run(0)[1] != run(1)[1]


def test_graph_ops_dims_never_break_the_walk():
    """A saved dim argument autograd's binding cannot give (any exception) counts as ``None``,
    and an unhashable one (a list of lists) by its repr: the fingerprint of a forward is taken
    whatever an op saved, equal for equal values and different for different ones."""
    class Node:
        def __init__(self, nested):
            self._saved_dims, self.nested = [[0, 1], [2]], nested

        @property
        def _saved_dim(self):
            raise ValueError("not convertible")

        @property
        def _saved_keepdim(self):
            return [self.nested]

    names = ("_saved_dims", "_saved_dim", "_saved_keepdim")
    got = ti._dims(Node([1]), names)
    assert got[1] is None and hash(got) == hash(ti._dims(Node([1]), names))
    assert ti._dims(Node([1]), names) != ti._dims(Node([2]), names)
