"""Empty batches (Poisson-sampled DP-SGD draws B = 0 sometimes): (0, *shape) per-sample
gradients, (0,) norms, clipping that leaves only the noise."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks

MODELS = {
    "mlp": (lambda: nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)), (4,)),
    "conv": (lambda: nn.Sequential(nn.Conv2d(2, 3, 3), nn.GroupNorm(1, 3), nn.Flatten(),
                                   nn.Linear(12, 3)), (2, 4, 4)),
    "norms": (lambda: nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 3)), (4,)),
}


def _model(name):
    torch.manual_seed(0)
    make, shape = MODELS[name]
    return make().double(), shape


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_empty_batch_reads(name, reduction):
    model, shape = _model(name)
    x, y = torch.randn(0, *shape, dtype=torch.float64), torch.zeros(0, dtype=torch.long)
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        F.cross_entropy(model(x), y, reduction="sum").backward()
        grads = gh.per_sample_grads(retain_records=True)
        assert {n: tuple(g.shape) for n, g in grads.items()} == {
            n: (0, *p.shape) for n, p in model.named_parameters()}
        assert gh.per_sample_grad_norms().shape == (0,)
        assert all(t.shape == (0,) for t in gh.per_sample_grad_norms(per_param=True).values())


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("method", ["ghost", "materialize", "two_pass"])
def test_empty_batch_clipping_adds_only_the_noise(method, reduction):
    """Noise sigma C z alone; D = 1 also for a mean loss (an empty batch has no size to divide
    by; its mean loss is NaN)."""
    model, shape = _model("conv")
    x, y = torch.randn(0, *shape, dtype=torch.float64), torch.zeros(0, dtype=torch.long)
    expected = {}
    gen = torch.Generator().manual_seed(7)
    for n, p in model.named_parameters():
        expected[n] = 0.5 * 2.0 * torch.randn(p.shape, generator=gen, dtype=p.dtype)
    with gradhooks.attach(model, loss_reduction=reduction) as gh:
        out = model(x)
        if method == "two_pass":
            norms = gh.clipped_backward(F.cross_entropy(out, y, reduction="none"), 2.0,
                                        noise_multiplier=0.5,
                                        generator=torch.Generator().manual_seed(7))
        else:
            F.cross_entropy(out, y, reduction=reduction).backward()
            norms = gh.clip_and_accumulate(2.0, method=method, noise_multiplier=0.5,
                                           generator=torch.Generator().manual_seed(7))
    assert norms.shape == (0,)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=0, atol=0)


def test_empty_then_full_batch():
    model, shape = _model("mlp")
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        F.cross_entropy(model(torch.randn(0, *shape, dtype=torch.float64)),
                        torch.zeros(0, dtype=torch.long), reduction="sum").backward()
        assert gh.per_sample_grads()["0.weight"].shape == (0, 6, 4)
        x, y = torch.randn(3, *shape, dtype=torch.float64), torch.randint(0, 3, (3,))
        F.cross_entropy(model(x), y, reduction="sum").backward()
        ref = gradhooks.looped_per_sample_grads(model, lambda o, t: F.cross_entropy(
            o, t, reduction="sum"), x, y, loss_reduction="sum")
        ours = gh.per_sample_grads()
        for n in ref:
            torch.testing.assert_close(ours[n], ref[n], rtol=1e-10, atol=1e-14)
