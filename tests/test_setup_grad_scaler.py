"""float16 autocast with torch.amp.GradScaler: per-sample results, norms and clipping of the
*unscaled* loss; .grad written at the scaler's scale for scaler.step(); overflowed steps
skipped as GradScaler skips them. Against a float32 loop, within float16's rounding. The first
three tests run on each of conftest's devices (CUDA's float16 autocast and ``GradScaler("cuda")``
where a GPU is there)."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks

from conftest import loop_grads

RTOL16 = 5e-3  # float16 forward and grad_outputs, against the float32 loop


def _setup(seed=0, device="cpu"):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    return model.to(device), x.to(device), y.to(device)


def _scaled_step(model, gh, scaler, x, y):
    with torch.autocast(x.device.type, dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    return loss


def _close(ours, ref):
    for n, g in ref.items():
        scale = float(g.abs().max())
        assert float((ours[n].float() - g).abs().max()) <= RTOL16 * scale, n


def test_per_sample_grads_and_norms_are_of_the_unscaled_loss(device):
    model, x, y = _setup(0, device)
    ref = loop_grads(model, F.cross_entropy, x, y)
    norms = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in ref.values()))
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 16)
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
def test_clipping_then_scaler_step_equals_clipped_sgd(method, device):
    model, x, y = _setup(1, device)
    ref = loop_grads(model, F.cross_entropy, x, y)
    norms = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in ref.values()))
    c = float(norms.median())
    factors = (c / norms).clamp(max=1)
    expected = {n: p.detach() - 0.1 * (g * factors.view(-1, *[1] * (g.dim() - 1))).mean(0)
                for (n, p), g in zip(model.named_parameters(), ref.values())}
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 12)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.attach(model, grad_scaler=scaler) as gh:
        if method == "two_pass":
            with torch.autocast(device.type, dtype=torch.float16):
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


def test_overflow_step_is_skipped_and_the_scale_lowered(device):
    model, x, y = _setup(2, device)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 40)  # float16 grad_outputs overflow
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


# ---------------------------------------------------------------- a scale seen on the loss
def _seen_run(grad_scaler, method, scaler):
    """One float16 step handing the scaled loss to gh.backward / gh.clipped_backward."""
    model, x, y = _setup(4)
    with gradhooks.attach(model, grad_scaler=grad_scaler) as gh:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        if method == "two_pass":
            losses = F.cross_entropy(out.float(), y, reduction="none")
            norms = gh.clipped_backward(scaler.scale(losses) if grad_scaler is None else losses,
                                        0.5)
            return norms, None, {n: p.grad.clone() for n, p in model.named_parameters()}
        gh.backward(scaler.scale(F.cross_entropy(out.float(), y)))
        grads = gh.per_sample_grads(retain_records=True)
        norms = gh.clip_and_accumulate(0.5, method=method)
        return norms, grads, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("method", ["ghost", "materialize", "two_pass"])
def test_scale_seen_on_the_loss_reads_as_a_declared_grad_scaler(method):
    """gh.backward(scaler.scale(loss)) / gh.clipped_backward(scaler.scale(losses), C) with no
    grad_scaler declared: the results are those of attach(grad_scaler=scaler) (of the unscaled
    loss, against the float32 loop), .grad written at the scale; the scale is recognised by its
    form, so a LossScaleWarning says so once (none with the scaler declared)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    model, x, y = _setup(4)
    ref = loop_grads(model, F.cross_entropy, x, y)
    with pytest.warns(gradhooks.LossScaleWarning, match="read a loss scale of 4096"):
        norms, grads, written = _seen_run(None, method, scaler)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gradhooks.LossScaleWarning)
        declared_norms, declared_grads, declared_written = _seen_run(scaler, method, scaler)
    torch.testing.assert_close(norms, declared_norms)
    for n, g in declared_written.items():
        torch.testing.assert_close(written[n], g)
    assert float(written["0.weight"].abs().max()) > 100  # written at the scale
    if grads is not None:
        _close(grads, ref)
        for n, g in declared_grads.items():
            torch.testing.assert_close(grads[n], g)


@pytest.mark.filterwarnings("ignore::gradhooks.LossScaleWarning")
def test_scale_seen_lasts_one_batch_and_a_plain_scaling_is_no_loss_scale():
    model, x, y = _setup(5)
    ref = loop_grads(model, F.cross_entropy, x, y)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    with gradhooks.attach(model) as gh:
        gh.backward(scaler.scale(F.cross_entropy(model(x), y)))
        _close(gh.per_sample_grads(), ref)
        gh.backward(F.cross_entropy(model(x), y))  # the next batch: unscaled, read unscaled
        _close(gh.per_sample_grads(), ref)
        gh.backward(F.cross_entropy(model(x), y) * torch.tensor(3.0))  # not a power of two
        _close(gh.per_sample_grads(), {n: 3 * g for n, g in ref.items()})


@pytest.mark.filterwarnings("ignore::gradhooks.LossScaleWarning")
@pytest.mark.parametrize("two_pass", [False, True], ids=["ghost", "two_pass"])
def test_scale_seen_on_micro_batches_reaches_finish_step(two_pass):
    """Micro-batches handed scaled (accumulate=True): finish_step writes .grad at the scale, as
    with attach(grad_scaler=scaler)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    written = []
    for declared in (None, scaler):
        model, x, y = _setup(6)
        with gradhooks.attach(model, grad_scaler=declared) as gh:
            for part in (slice(0, 4), slice(4, 8)):
                if two_pass:
                    losses = F.cross_entropy(model(x[part]), y[part], reduction="none")
                    gh.clipped_backward(losses if declared else scaler.scale(losses), 0.5,
                                        accumulate=True)
                else:
                    gh.backward(scaler.scale(F.cross_entropy(model(x[part]), y[part])))
                    gh.clip_and_accumulate(0.5, accumulate=True)
            gh.finish_step()
            written.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for n, g in written[1].items():
        torch.testing.assert_close(written[0][n], g)
    assert float(written[0]["0.weight"].abs().max()) > 1  # at the scale


@pytest.mark.parametrize("declared", [True, False], ids=["declared", "undeclared"])
def test_a_scale_whose_value_is_not_read_at_the_backward(monkeypatch, declared):
    """On an accelerator the loss walk reads no tensor's value at the backward (no device
    sync), so ``scaler.scale(losses.sum())``'s factor is unknown there: as on a GPU, the walk
    reads none here (``constant_of`` of a tensor scaling returns ``None``). The declared
    scaler's own scale tensor at the loss's top is its ``scaler.scale(loss)`` (the reads divide
    by ``get_scale()``): the norms are the unscaled loss's, against the loop. An undeclared one
    is refused, naming the way out. (The Trainer's fp16 book-keeping step on a GPU was refused
    so until this: tests/test_trainer_precision.py's cuda tests.)"""
    import gradhooks.core.analysis.backward_losses as walk
    import gradhooks.readers.loss_reduction as reduction
    real = walk.constant_of
    unread = lambda node, name: None if name == "MulBackward0" else real(node, name)  # noqa: E731
    monkeypatch.setattr(walk, "constant_of", unread)
    monkeypatch.setattr(reduction, "constant_of", unread)
    model, x, y = _setup(4)
    ref = loop_grads(model, lambda out, t: F.cross_entropy(out, t, reduction="sum"), x, y)
    norms = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in ref.values()))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    with gradhooks.attach(model, loss_reduction="sum",
                          grad_scaler=scaler if declared else None) as gh:
        with torch.autocast("cpu", dtype=torch.float16):
            losses = F.cross_entropy(model(x), y, reduction="none")
        gh.backward(scaler.scale(losses.float().sum()))
        if not declared:
            with pytest.raises(gradhooks.UnsupportedLossError, match="grad_scaler=scaler"):
                gh.clip_and_accumulate(float(norms.median()))
            return
        got = gh.clip_and_accumulate(float(norms.median()))
    torch.testing.assert_close(got, norms, rtol=RTOL16, atol=0)
