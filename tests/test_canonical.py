"""The records -> canonical ``(a, g)`` adapter (:mod:`gradhooks.readers.canonical`), tested directly on
tensors (no hooks, no model): the per-sample gradients contracted from its output,
``einsum('ngsi,ngso->ngoi')`` and ``g.sum(2)``, must equal a loop of autograd over the samples,
for Linear (2-D, 3-D with the batch first or second) and Conv (unfolded patches, groups), in
float64 and float32, for batches of 0, 1 and 4."""
import pytest
import torch
from torch import nn

from gradhooks.base.registry import find_rule
from gradhooks.core.recorder.records import Layer
from gradhooks.readers.canonical import (
    augmented,
    canonical,
    canonical_call,
    canonical_sizes,
    grad_sum,
    identity_form,
    scaled,
    summed,
)
from gradhooks.readers.passes import PassCall

TOL = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-5)}


def _layer(module: nn.Module) -> Layer:
    return Layer("m", module, find_rule(module), dict(module.named_parameters()))


# (id, module maker, input shape given N, batch_first)
CASES = [
    ("linear-2d", lambda: nn.Linear(5, 3), lambda n: (n, 5), True),
    ("linear-3d-batch-first", lambda: nn.Linear(5, 3), lambda n: (n, 7, 5), True),
    ("linear-3d-batch-second", lambda: nn.Linear(5, 3), lambda n: (7, n, 5), False),
    ("linear-4d", lambda: nn.Linear(4, 2, bias=False), lambda n: (n, 2, 3, 4), True),
    ("conv1d", lambda: nn.Conv1d(3, 4, 3, padding=1), lambda n: (n, 3, 9), True),
    ("conv2d", lambda: nn.Conv2d(2, 4, 3, stride=2), lambda n: (n, 2, 7, 6), True),
    ("conv2d-groups-2", lambda: nn.Conv2d(4, 6, 3, groups=2, padding=1), lambda n: (n, 4, 5, 5),
     True),
    ("conv2d-depthwise", lambda: nn.Conv2d(3, 6, 2, groups=3, dilation=2),
     lambda n: (n, 3, 6, 6), True),
]


def _batch_dim(batch_first: bool, x: torch.Tensor) -> int:
    return 0 if batch_first or x.dim() < 3 else 1


def _looped(module: nn.Module, x: torch.Tensor, g: torch.Tensor, batch_first: bool):
    """Per-sample gradients by autograd, one sample at a time: ``{name: (N, *param.shape)}``."""
    d = _batch_dim(batch_first, x)
    out = {n: [] for n, _ in module.named_parameters()}
    for i in range(x.shape[d]):
        xi, gi = x.narrow(d, i, 1), g.narrow(d, i, 1)
        grads = torch.autograd.grad(module(xi), list(module.parameters()), gi)
        for (n, _), t in zip(module.named_parameters(), grads):
            out[n].append(t)
    return {n: (torch.stack(ts) if ts else p.new_zeros((0, *p.shape)))
            for (n, p), ts in zip(module.named_parameters(), out.values())}


def _record(make, shape, n: int, dtype: torch.dtype, batch_first: bool):
    torch.manual_seed(0)
    module = make().to(dtype)
    x = torch.randn(*shape(n), dtype=dtype)
    with torch.no_grad():
        g = torch.randn_like(module(x))
    return module, x, g


@pytest.mark.parametrize("n", [0, 1, 4], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("name,make,shape,batch_first", CASES, ids=[c[0] for c in CASES])
def test_canonical_contracts_to_looped_per_sample_grads(name, make, shape, batch_first, dtype, n):
    module, x, g = _record(make, shape, n, dtype, batch_first)
    layer = _layer(module)
    a_c, g_c = canonical(layer, x, g, batch_first)
    assert a_c.dim() == 4 and g_c.dim() == 4 and a_c.shape[:3] == g_c.shape[:3]
    assert a_c.dtype == g_c.dtype == dtype
    groups, positions, fan_in, fan_out = canonical_sizes(layer, g, batch_first)
    assert a_c.shape == (n, groups, positions, fan_in) and g_c.shape == (n, groups, positions, fan_out)
    assert groups == getattr(module, "groups", 1)
    ref = _looped(module, x, g, batch_first)
    got_w = torch.einsum("ngsi,ngso->ngoi", a_c, g_c).reshape(n, *module.weight.shape)
    torch.testing.assert_close(got_w, ref["weight"], **TOL[dtype])
    if module.bias is not None:
        got_b = g_c.sum(2).reshape(n, *module.bias.shape)
        torch.testing.assert_close(got_b, ref["bias"], **TOL[dtype])


@pytest.mark.parametrize("name,make,shape,batch_first", CASES, ids=[c[0] for c in CASES])
def test_scale_form_a_and_summed_passes(name, make, shape, batch_first):
    """``scale`` multiplies g (a new tensor, the record untouched); ``form_a=False`` skips a;
    two backward passes are summed as one grad_output; the result is :func:`canonical` of it."""
    module, x, g = _record(make, shape, 4, torch.float64, batch_first)
    layer = _layer(module)
    before = g.clone()
    a_c, g_c = canonical(layer, x, g, batch_first)
    a_s, g_s = canonical(layer, x, g, batch_first, scale=4.0)
    torch.testing.assert_close(g_s, 4.0 * g_c, rtol=0, atol=0)
    torch.testing.assert_close(a_s, a_c, rtol=0, atol=0)
    assert torch.equal(g, before)
    none, g_only = canonical(layer, x, g, batch_first, form_a=False)
    assert none is None and torch.equal(g_only, g_c)
    g2 = torch.randn_like(g)
    call = PassCall(layer, x, [g, g2], ("weight",))
    a_p, g_p = canonical_call(call, batch_first, scale=2.0)
    _, g_ref = canonical(layer, x, g + g2, batch_first)
    torch.testing.assert_close(g_p, 2.0 * g_ref, rtol=1e-15, atol=0)
    torch.testing.assert_close(a_p, a_c, rtol=0, atol=0)
    assert torch.equal(grad_sum([g, g2]), g + g2) and grad_sum([g]) is g


def test_dtypes_promoted_once_and_no_copy_in_full_precision():
    """float32 records are used as they are (views, no copy); bfloat16 ones are promoted to
    float32; a float64 input with float32 grad_output gives float64; without ``a`` the dtype
    is ``g``'s (at least float32); ``dtype`` overrides."""
    module = nn.Linear(5, 3)
    layer = _layer(module)
    x, g = torch.randn(4, 5), torch.randn(4, 3)
    a_c, g_c = canonical(layer, x, g, True)
    assert a_c.data_ptr() == x.data_ptr() and g_c.data_ptr() == g.data_ptr()
    a_b, g_b = canonical(layer, x.bfloat16(), g.bfloat16(), True)
    assert a_b.dtype == g_b.dtype == torch.float32
    a_m, g_m = canonical(layer, x.double(), g, True)
    assert a_m.dtype == g_m.dtype == torch.float64
    assert canonical(layer, None, g.bfloat16(), True)[1].dtype == torch.float32
    assert canonical(layer, x.double(), g, True, form_a=False)[1].dtype == torch.float64
    assert canonical(layer, None, g, True, dtype=torch.float64)[1].dtype == torch.float64
    a_s, g_s = summed(PassCall(layer, x.double(), [g, g], ("weight",)))
    assert a_s.dtype == g_s.dtype == torch.float64 and torch.equal(g_s, (2 * g).double())


def test_identity_form_and_kfac_form():
    """A Linear on ``(N, in)``: its canonical form is its records viewed as ``(N, 1, 1, .)``;
    not on ``(N, T, in)``. ``kfac=True`` gives the KFAC form (the same for a Linear)."""
    module = nn.Linear(5, 3)
    layer = _layer(module)
    x, g = torch.randn(4, 5), torch.randn(4, 3)
    assert identity_form(layer, x, g, True)
    assert not identity_form(layer, torch.randn(4, 2, 5), torch.randn(4, 2, 3), True)
    a_k, g_k = canonical(layer, x, g, True, kfac=True)
    a_c, g_c = canonical(layer, x, g, True)
    assert torch.equal(a_k, a_c) and torch.equal(g_k, g_c)


def test_augmented_bias_column_and_scaled():
    """``ã = [a; 1]`` gives ``[dW db]`` in one contraction; a weight-less call gives the ones."""
    module = nn.Conv2d(4, 6, 3, groups=2).double()
    layer = _layer(module)
    x = torch.randn(3, 4, 5, 5, dtype=torch.float64)
    g = torch.randn_like(module(x).detach())
    a_c, g_c = canonical(layer, x, g, True)
    both = torch.einsum("ngsi,ngso->ngoi", augmented(a_c, g_c, True), g_c)
    ref = _looped(module, x, g, True)
    torch.testing.assert_close(both[..., :-1].reshape(3, *module.weight.shape), ref["weight"])
    torch.testing.assert_close(both[..., -1].reshape(3, 6), ref["bias"])
    assert augmented(a_c, g_c, False) is a_c
    ones = augmented(None, g_c, True)
    assert ones.shape == (*g_c.shape[:3], 1) and bool((ones == 1).all())
    assert scaled(g_c, None) is g_c and torch.equal(scaled(g_c, 3.0), 3.0 * g_c)
