"""Adaptive clipping (gradhooks.AdaptiveClipping; Andrew et al. 2021, arXiv:1905.03871) with
book-keeping and two-pass clipping: the bound's trajectory and every step's clipped gradient
against a float64 loop of per-sample gradients (float32 too), and against Opacus 1.6's
``AdaClipDPOptimizer`` on the same lots with the same noise draws."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks

from conftest import loop_grads

B, STEPS = 6, 4


def make_model(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv1d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(12, 3)).to(dtype)


def lots(dtype, steps=STEPS, b=B):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(b, 2, 6, generator=g, dtype=dtype), torch.randint(0, 3, (b,), generator=g))
            for _ in range(steps)]


def ce(out, y):
    return F.cross_entropy(out, y)


@pytest.mark.parametrize("b", [1, B], ids=["B1", f"B{B}"])
@pytest.mark.parametrize("method", ["bookkeeping", "two_pass"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_bound_and_clipped_sums_follow_the_loop(method, dtype, b):
    """sigma = 0 (no gradient noise, the count still noised): each step's clipped mean equals
    the loop's at that step's bound, and the bounds follow C <- C exp(-eta (b~ - gamma)) with
    the loop's unclipped count and the same count-noise draws."""
    model = make_model(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    ada = gradhooks.AdaptiveClipping(0.5, noise_multiplier=0.0, count_noise_std=1.5,
                                     target_quantile=0.4, learning_rate=0.7,
                                     generator=torch.Generator().manual_seed(3))
    replay = torch.Generator().manual_seed(3)  # the count noise, drawn again for the reference
    bound = 0.5
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    with gradhooks.attach(model) as gh:
        for x, y in lots(dtype, b=b):
            ref = loop_grads(model, ce, x, y)  # (own losses: the mean's per-sample gradients)
            norms_ref = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
            want = {n: torch.einsum("n,n...->...", (bound / norms_ref).clamp(max=1.0), g) / b
                    for n, g in ref.items()}
            opt.zero_grad()
            if method == "bookkeeping":
                gh.backward(ce(model(x), y))
                norms = gh.clip_and_accumulate(ada.max_norm,
                                               noise_multiplier=ada.gradient_noise_multiplier)
            else:
                norms = gh.clipped_backward(F.cross_entropy(model(x), y, reduction="none"),
                                            ada.max_norm)
            torch.testing.assert_close(norms.double(), norms_ref.double(), rtol=tol, atol=0)
            for n, p in model.named_parameters():
                torch.testing.assert_close(p.grad, want[n], rtol=tol,
                                           atol=tol * float(want[n].abs().max()))
            new = ada.update(norms)
            noise = float(torch.normal(0.0, 1.5, (), generator=replay, dtype=torch.float32))
            # (the count from the norms update() saw: a norm within float32 rounding of the
            # bound must not decide the test)
            frac = (float((norms.double() <= bound).sum()) + noise) / b
            bound = bound * math.exp(-0.7 * (frac - 0.4))
            assert new == pytest.approx(bound, rel=1e-12)
            assert ada.unclipped_fraction == pytest.approx(frac, rel=1e-12)
            opt.step()


def test_bounds_are_clamped_and_empty_lots_keep_the_target():
    ada = gradhooks.AdaptiveClipping(1.0, noise_multiplier=0.0, count_noise_std=0.0,
                                     learning_rate=5.0, min_norm=0.5, max_norm_bound=2.0)
    assert ada.update(torch.zeros(4)) == 0.5  # all unclipped: exp(-2.5), held at the floor
    assert ada.update(torch.full((4,), 10.0)) == 2.0  # all clipped: exp(2.5), at the ceiling
    assert ada.update(torch.zeros(0)) == 2.0  # an empty lot: b~ = gamma, no change
    free = gradhooks.AdaptiveClipping(1.0, noise_multiplier=0.0, count_noise_std=0.0,
                                      learning_rate=0.3)
    assert free.update(torch.tensor([0.5, 2.0, 3.0, 4.0])) == pytest.approx(math.exp(0.3 * 0.25))


def test_gradient_noise_multiplier_is_theorem_1():
    ada = gradhooks.AdaptiveClipping(1.0, noise_multiplier=1.0, count_noise_std=5.0)
    assert ada.gradient_noise_multiplier == pytest.approx((1.0 - 0.01) ** -0.5)
    assert ada.noise_multiplier == 1.0


@pytest.mark.parametrize("kwargs, match", [
    (dict(noise_multiplier=2.0, count_noise_std=1.0), "2 \\* count_noise_std"),
    (dict(noise_multiplier=1.0, count_noise_std=1.0, target_quantile=1.5), "target_quantile"),
    (dict(noise_multiplier=1.0, count_noise_std=1.0, learning_rate=0.0), "learning_rate"),
    (dict(noise_multiplier=1.0, count_noise_std=1.0, min_norm=3.0, max_norm_bound=2.0),
     "min_norm"),
])
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gradhooks.AdaptiveClipping(1.0, **kwargs)


def test_groupwise_norms_are_refused():
    ada = gradhooks.AdaptiveClipping(1.0, noise_multiplier=0.0, count_noise_std=1.0)
    with pytest.raises(ValueError, match="one bound"):
        ada.update(torch.ones(3, 2))


def test_same_trajectory_as_opacus_adaclip():
    """Opacus 1.6's AdaClipDPOptimizer (GradSampleModule in hooks mode) and gradhooks'
    book-keeping with AdaptiveClipping, float64, sigma = 0.8, the same lots and one noise
    generator each seeded alike: the bound after every step and the parameters agree (Opacus
    clips by C / (||g|| + 1e-6): 1e-6-relative differences)."""
    from opacus import GradSampleModule
    from opacus.optimizers import AdaClipDPOptimizer
    sigma, sigma_b, c0, gamma, eta = 0.8, 2.0, 0.4, 0.5, 0.5
    ours_model, theirs_model = make_model(torch.float64), make_model(torch.float64)
    gsm = GradSampleModule(theirs_model, loss_reduction="mean")
    theirs = AdaClipDPOptimizer(
        torch.optim.SGD(theirs_model.parameters(), lr=0.5), noise_multiplier=sigma,
        target_unclipped_quantile=gamma, clipbound_learning_rate=eta, max_clipbound=10.0,
        min_clipbound=0.01, unclipped_num_std=sigma_b, max_grad_norm=c0, expected_batch_size=B,
        generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(7)
    ada = gradhooks.AdaptiveClipping(c0, noise_multiplier=sigma, count_noise_std=sigma_b,
                                     target_quantile=gamma, learning_rate=eta, min_norm=0.01,
                                     max_norm_bound=10.0, generator=g)
    ours = torch.optim.SGD(ours_model.parameters(), lr=0.5)
    with gradhooks.attach(ours_model) as gh:
        for x, y in lots(torch.float64, steps=6):
            theirs.zero_grad(set_to_none=True)
            ce(gsm(x), y).backward()
            theirs.step()
            ours.zero_grad(set_to_none=True)
            gh.backward(ce(ours_model(x), y))
            norms = gh.clip_and_accumulate(ada.max_norm,
                                           noise_multiplier=ada.gradient_noise_multiplier,
                                           generator=g)
            ada.update(norms)
            ours.step()
            assert ada.max_norm == pytest.approx(float(theirs.max_grad_norm), rel=1e-5)
    for (n, p), q in zip(ours_model.named_parameters(), theirs_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=n)
