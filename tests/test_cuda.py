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
    from test_every_rule_every_reader import SliceExperts

    import gradhooks
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


@pytest.mark.parametrize("kind", ["conv3d", "gru"])
def test_torch_tf32_defaults_attach_and_read_within_tf32(kind):
    """torch's defaults on CUDA round float32 convolutions and RNNs to TF32 in cuDNN
    (``torch.backends.cudnn.allow_tf32``): autograd's own batch gradient is then formed at about
    TF32's precision. The default attach must not raise a false sum-check alarm there
    (``gradhooks.readers.verify.TF32_RTOL``), and its per-sample gradients stay within TF32's
    rounding of a float32 loop run with TF32 off. (Measured on an H200 before the TF32
    tolerance: GradientMismatchError on Conv3d and RNN layers, 2.8e-3 and 4.5e-4 of the
    summed magnitude, in 123 of 2258 cuda test variants.)"""
    import gradhooks

    from conftest import loop_grads, weighted_square_loss
    torch.manual_seed(0)
    if kind == "conv3d":
        model = nn.Sequential(nn.Conv3d(2, 6, 3, padding=1), nn.Tanh(), nn.Flatten(),
                              nn.Linear(6 * 5 * 5 * 5, 3)).cuda()
        x = torch.randn(4, 2, 5, 5, 5, device="cuda")
    else:
        from test_every_rule_every_reader import Pick
        model = nn.Sequential(Pick(nn.GRU(5, 7, batch_first=True), "first"), nn.Flatten(),
                              nn.Linear(7 * 6, 3)).cuda()
        x = torch.randn(4, 6, 5, device="cuda")
    w = torch.rand(4, device="cuda") + 0.5
    loss_fn = weighted_square_loss("mean")
    flags = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = False, False
        ref = loop_grads(model, loss_fn, x, w)
        torch.backends.cudnn.allow_tf32 = True  # torch's default
        with gradhooks.attach(model) as gh:  # (the sum check on: it must not raise)
            loss_fn(model(x), w).backward()
            ours = gh.per_sample_grads()
            gh.per_sample_grad_norms()
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = flags
    for name, r in ref.items():
        err = float((ours[name] - r).abs().max() / r.abs().max())
        assert err <= 1e-2, (name, err)


def test_bf16_autocast_reads_use_tf32_and_restore_the_flags():
    """Reads of records formed under CUDA bf16 autocast run their float32 products in TF32
    (gradhooks.base.utils.tf32_products: the records' values are exact in TF32): norms and
    book-keeping clipping from the records agree with the same computed in float64 from the
    materialised per-sample gradients (well inside bfloat16's rounding of the records), the
    per-sample gradients with a float32 loop of the autocast forward within bfloat16's
    tolerance, and the caller's TF32 flags are as they were after each read."""
    import gradhooks

    from conftest import loop_grads
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(),
                          nn.Linear(32, 4)).cuda()
    x = torch.randn(5, 7, 16, device="cuda")  # (B, T, D): the Gram forms of the norms

    def forward(inp):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return model(inp).float()

    def loss_fn(out, _):
        return out.square().sum((1, 2)).mean()

    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, inp):
            return forward(inp)

    wrapped = Wrapped()
    ref = loop_grads(wrapped, loss_fn, x, torch.zeros(5, device="cuda"))
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    with gradhooks.attach(wrapped) as gh:
        loss_fn(wrapped(x), None).backward()
        assert gh.recorder.snapshot("test", sum_check=False).low == torch.bfloat16
        norms = gh.per_sample_grad_norms()
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == flags
        bound = float(norms.median())
        gh.clip_and_accumulate(bound)
        clipped = {n: p.grad.double() for n, p in wrapped.named_parameters()}
        loss_fn(wrapped(x), None).backward()
        grads = gh.per_sample_grads()
    flat = torch.cat([g.double().flatten(1) for g in grads.values()], 1)
    want = flat.norm(dim=1)
    assert float((norms.double() - want).abs().max() / want.max()) <= 1e-3
    factors = (bound / want).clamp(max=1.0)
    for name, g in grads.items():
        expect = torch.tensordot(factors, g.double(), 1) / 5
        assert float((clipped[name] - expect).abs().max() / expect.abs().max()) <= 1e-3, name
        r = ref[name]
        assert float((g - r).abs().max() / r.abs().max()) <= 5e-2, name
