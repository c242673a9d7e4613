"""float16 autocast with torch.amp.GradScaler: per-sample results, norms and clipping of the
*unscaled* loss; .grad written at the scaler's scale for scaler.step(); overflowed steps
skipped as GradScaler skips them. Against a float32 loop, within float16's rounding."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from conftest import loop_grads

RTOL16 = 5e-3  # float16 forward and grad_outputs, against the float32 loop


def _setup(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    return model, x, y


def _scaled_step(model, gh, scaler, x, y):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    return loss


def _close(ours, ref):
    for n, g in ref.items():
        scale = float(g.abs().max())
        assert float((ours[n].float() - g).abs().max()) <= RTOL16 * scale, n


def test_per_sample_grads_and_norms_are_of_the_unscaled_loss():
    model, x, y = _setup()
    ref = loop_grads(model, F.cross_entropy, x, y)
    norms = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in ref.values()))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    with gradhooks.attach(model, grad_scaler=scaler) as gh:
        _scaled_step(model, gh, scaler, x, y)
        assert float(scaler.get_scale()) == 2.0 ** 16  # the records are 65536x the gradients
        torch.testing.assert_close(gh.per_sample_grad_norms(), norms, rtol=RTOL16, atol=0)
        _close(gh.per_sample_grads(retain_records=True), ref)
    with gradhooks.attach(model) as gh:  # without the scaler: S times the gradients
        _scaled_step(model, gh, scaler, x, y)
        with pytest.warns(gradhooks.LossScaleWarning):  # (the next test)
            scaled = gh.per_sample_grad_norms()
        assert float(scaled[0] / norms[0]) == pytest.approx(2.0 ** 16, rel=1e-2)


@pytest.mark.parametrize("method", ["ghost", "materialize", "two_pass"])
def test_clipping_then_scaler_step_equals_clipped_sgd(method):
    model, x, y = _setup(1)
    ref = loop_grads(model, F.cross_entropy, x, y)
    norms = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in ref.values()))
    c = float(norms.median())
    factors = (c / norms).clamp(max=1)
    expected = {n: p.detach() - 0.1 * (g * factors.view(-1, *[1] * (g.dim() - 1))).mean(0)
                for (n, p), g in zip(model.named_parameters(), ref.values())}
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.attach(model, grad_scaler=scaler) as gh:
        if method == "two_pass":
            with torch.autocast("cpu", dtype=torch.float16):
                losses = F.cross_entropy(model(x), y, reduction="none")
            got = gh.clipped_backward(losses.float(), c)
        else:
            _scaled_step(model, gh, scaler, x, y)
            got = gh.clip_and_accumulate(c, method=method)
        torch.testing.assert_close(got, norms, rtol=RTOL16, atol=0)
        assert float(model[0].weight.grad.abs().max()) > 100  # written at the scale
        scaler.step(opt)
        scaler.update()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[n], rtol=RTOL16, atol=RTOL16 * 0.1)


def test_overflow_step_is_skipped_and_the_scale_lowered():
    model, x, y = _setup(2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)  # float16 grad_outputs overflow
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.attach(model, grad_scaler=scaler) as gh:
        _scaled_step(model, gh, scaler, x, y)
        norms = gh.clip_and_accumulate(1.0)
        assert not bool(torch.isfinite(norms).all())
        scaler.step(opt)
        scaler.update()
    assert float(scaler.get_scale()) < 2.0 ** 40
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n


def _autocast_read(dtype, grad_scaler=None, reads=2):
    model, x, y = _setup(3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    with gradhooks.attach(model, grad_scaler=grad_scaler) as gh:
        for _ in range(reads):
            with torch.autocast("cpu", dtype=dtype):
                loss = F.cross_entropy(model(x), y)
            (scaler.scale(loss) if dtype == torch.float16 else loss).backward()
            gh.per_sample_grad_norms()


def test_undeclared_scaler_under_float16_autocast_is_warned_once():
    """Without attach(grad_scaler=...) the results of scaler.scale(loss).backward() are S times
    too large; gradhooks cannot tell a scaled loss from a plain one, so a float16 forward with
    no scaler declared is warned once per attachment."""
    with pytest.warns(gradhooks.LossScaleWarning,
                      match=r"float16 \(module '\d' \(Linear\).*grad_scaler=scaler") as caught:
        _autocast_read(torch.float16)
    assert sum(issubclass(w.category, gradhooks.LossScaleWarning) for w in caught) == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32],
                         ids=["float16-declared", "bfloat16", "float32"])
def test_no_loss_scale_warning_when_declared_or_not_float16(dtype):
    scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
    with warnings.catch_warnings():
        warnings.simplefilter("error", gradhooks.LossScaleWarning)
        if dtype == torch.float32:
            model, x, y = _setup(3)
            with gradhooks.attach(model) as gh:
                F.cross_entropy(model(x), y).backward()
                gh.per_sample_grads()
        else:
            _autocast_read(dtype, grad_scaler=scaler)
