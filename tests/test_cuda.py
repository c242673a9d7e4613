"""The CUDA path against looped autograd; skipped (honestly) on machines without a GPU.

Beside the tests here, the device-parametrized tests (those taking ``conftest``'s ``device``
fixture: every rule x every reader, the zoo's models, the Segments kernels, bf16 autocast of
norms and KFAC) get a ``cuda`` variant where a GPU is there; without one those variants are not
generated and :func:`test_cuda_variants_are_generated` skips, saying so.
"""
import pytest
import torch
from torch import nn

from conftest import DEVICES, check_against_loop

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (without one the cuda variants of the device-parametrized tests are "
           "not generated either: conftest.DEVICES)")


def test_cuda_variants_are_generated():
    """Where a GPU is there, the device-parametrized tests run on it too (``conftest.DEVICES``);
    on a machine without one this test is skipped, and with it those tests' cuda variants."""
    assert DEVICES == ["cpu", "cuda"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_cnn_on_cuda_matches_loop(dtype):
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1, padding_mode="reflect"), nn.ReLU(inplace=True),
        nn.Conv2d(4, 4, 3, groups=2, stride=2), nn.Flatten(), nn.Linear(4 * 3 * 3, 3),
    ).cuda()
    x = torch.randn(6, 2, 8, 8, device="cuda")
    w = torch.rand(6, device="cuda") + 0.5
    ours = check_against_loop(model, x, w, loss_reduction="mean", dtype=dtype)
    assert all(t.is_cuda for t in ours.values())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_slice_experts_on_cuda_match_loop(dtype):
    """A mixture of experts of raw-parameter slices on CUDA: the factored per-sample gradients
    (gradhooks.base.segments) take their off-CPU forms (one padded kernel, no launch per
    segment); per-sample gradients against the loop, norms against their norms."""
    import gradhooks
    from test_every_rule_every_reader import SliceExperts
    torch.manual_seed(0)
    model = SliceExperts().cuda()
    x = torch.randn(4, 3, 5, device="cuda")
    w = torch.rand(4, device="cuda") + 0.5
    ours = check_against_loop(model, x, w, loss_reduction="mean", dtype=dtype)
    assert all(t.is_cuda for t in ours.values())
    with gradhooks.attach(model) as gh:
        (model(x.to(dtype)).square().sum((1, 2)) * w.to(dtype)).mean().backward()
        norms = gh.per_sample_grad_norms()
        grads = gh.per_sample_grads()
    want = torch.cat([g.flatten(1) for g in grads.values()], 1).norm(dim=1)
    torch.testing.assert_close(norms, want, rtol=1e-10 if dtype == torch.float64 else 1e-5,
                               atol=0)
