"""torch.compile: attaching before or after compiling stays exact; a model compiled and run
before attach gets an error that names torch.compile."""
import functools
import gc
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks

from conftest import assert_close_to_loop, loop_grads


def _mlp(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    gc.collect()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("order", ["attach_then_compile", "compile_then_attach"])
def test_compile_aot_eager(order):
    f64 = torch.float64
    model = _mlp(f64)
    x, y = torch.randn(5, 4, dtype=f64), torch.randint(0, 3, (5,))
    ref = loop_grads(model, F.cross_entropy, x, y)
    if order == "attach_then_compile":
        gh = gradhooks.attach(model)
        compiled = torch.compile(model, backend="aot_eager")
    else:
        compiled = torch.compile(model, backend="aot_eager")
        gh = gradhooks.attach(model)
    try:
        for _ in range(2):
            F.cross_entropy(compiled(x), y).backward()
            assert_close_to_loop(gh.per_sample_grads(), ref, f64)
    finally:
        gh.detach()


def test_compile_inductor_float32():
    model = _mlp(torch.float32)
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    ref = loop_grads(model, F.cross_entropy, x, y)
    with gradhooks.attach(model) as gh:
        compiled = torch.compile(model)
        F.cross_entropy(compiled(x), y).backward()
        assert_close_to_loop(gh.per_sample_grads(), ref, torch.float32)


COMPILED_BEFORE_ATTACH = """
import torch, torch.nn.functional as F
from torch import nn
import gradhooks
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
compiled = torch.compile(model, backend="aot_eager")
compiled(x).sum().backward()  # compiled while no module hook exists: the code has none
with gradhooks.attach(model) as gh:
    F.cross_entropy(compiled(x), y).backward()
    try:
        gh.per_sample_grads()
    except gradhooks.NoBackwardError as e:
        print("REFUSED:", e)
    torch._dynamo.reset()  # what the message says: recompiled, the hooks run
    F.cross_entropy(compiled(x), y).backward()
    ours = gh.per_sample_grads()
ref = gradhooks.looped_per_sample_grads(model, F.cross_entropy, x, y)
print("ERROR:", max(gradhooks.max_rel_error(ours[k], ref[k]) for k in ref))
"""


def test_model_compiled_and_run_before_attach_names_compile():
    """In a fresh process (compiled code calls global module hooks that exist when it is
    compiled, e.g. those of another attached model, and is then exact)."""
    run = subprocess.run([sys.executable, "-c", COMPILED_BEFORE_ATTACH], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "REFUSED:" in run.stdout and "torch.compile" in run.stdout
    assert "_dynamo.reset" in run.stdout
    assert float(run.stdout.split("ERROR:")[1]) < 1e-5


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_attach_to_the_compiled_module_hooks_the_module_it_wraps(loss_reduction):
    """gradhooks.attach(torch.compile(model)) (an OptimizedModule, which dynamo failed to trace
    the hooks of: "already tracked for mutation") hooks ``_orig_mod``; the compiled module's
    calls are recorded, exact against the loop."""
    f64 = torch.float64
    model = _mlp(f64)
    x, y = torch.randn(5, 4, dtype=f64), torch.randint(0, 3, (5,))
    loss_fn = functools.partial(F.cross_entropy, reduction=loss_reduction)
    ref = loop_grads(model, loss_fn, x, y)
    compiled = torch.compile(model, backend="aot_eager")
    with gradhooks.attach(compiled, loss_reduction=loss_reduction) as gh:
        assert gh.model is model
        for _ in range(2):
            loss_fn(compiled(x), y).backward()
            assert_close_to_loop(gh.per_sample_grads(), ref, f64)
