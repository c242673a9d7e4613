"""torch.compile: attaching before or after compiling stays exact; a model compiled and run
before attach gets an error that names torch.compile."""
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


def test_model_compiled_and_run_before_attach_names_compile():
    model = _mlp(torch.float32)
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    compiled = torch.compile(model, backend="aot_eager")
    compiled(x).sum().backward()  # compiled without hooks
    with gradhooks.attach(model) as gh:
        F.cross_entropy(compiled(x), y).backward()
        with pytest.raises(gradhooks.NoBackwardError, match=r"torch\.compile.*_dynamo\.reset"):
            gh.per_sample_grads()
        torch._dynamo.reset()  # what the message says: recompiled, the hooks run
        F.cross_entropy(compiled(x), y).backward()
        assert_close_to_loop(gh.per_sample_grads(), loop_grads(model, F.cross_entropy, x, y),
                             torch.float32)
