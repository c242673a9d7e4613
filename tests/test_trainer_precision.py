"""Mixed precision in the Trainer's DP step (issue 40, point 4): ``bf16=True`` and ``fp16=True``
with its ``GradScaler``, each within the precision's tolerance of a float32 loop (the looped
clipped sum of tests/test_trainer.py), and an overflowing fp16 lot skipped as the Trainer skips
it.

**What runs where.** ``bf16=True`` runs here as a user's CPU run does: accelerate's bfloat16
autocast around the forward. ``fp16=True`` on a CPU is ignored by accelerate (no autocast, no
scaler: a float32 run, checked below); on a GPU accelerate sets ``native_amp`` and a
``torch.amp.GradScaler``. CPU autocast does run float16 in torch 2.13, and
``torch.amp.GradScaler("cpu")`` is the same class, so the fp16 tests give the Trainer's
accelerator, before ``train()``, exactly what accelerate gives it on a GPU (``native_amp = True``,
``scaler = GradScaler(...)``): the forward then runs under float16 autocast, the backward at the
scale, the optimizer step through ``scaler.step`` / ``scaler.update``. That is the GPU code path
with CPU kernels; the ``cuda`` tests below run accelerate's own GPU set-up where a GPU is there.
"""
import copy

import pytest
import torch
import transformers  # noqa: E402
from test_trainer import (  # noqa: E402
    C,
    GradsBeforeStep,
    arguments,
    clipped_reference,
    collate,
    dataset,
    first_lot,
    model_of,
)

from gradhooks.integrations.transformers import DPConfig, DPTrainer  # noqa: E402

import zoo_imports  # noqa: F401  (the torchvision import fix, before transformers)


class ScaleBeforeStep(transformers.TrainerCallback):
    """The loss scale ``S`` at each optimizer step (the one the lot was clipped at)."""

    def __init__(self, trainer):
        self.trainer, self.scales, self.skipped = trainer, [], []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        scaler = self.trainer.accelerator.scaler
        self.scales.append(1.0 if scaler is None else float(scaler.get_scale()))

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.skipped.append(self.trainer.accelerator.optimizer_step_was_skipped)


def as_on_gpu(trainer, init_scale):
    """What accelerate gives a Trainer with ``fp16=True`` on a GPU: native autocast (float16)
    and a ``torch.amp.GradScaler`` (here on the CPU)."""
    trainer.accelerator.native_amp = True
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)


def relative_error(got, want):
    scale = max(float(v.abs().max()) for v in want.values())
    return max(float((got[n].double() - want[n].double()).abs().max()) for n in want) / scale


def run(tmp_path, precision, clipping="book-keeping", init_scale=2.0 ** 10, cuda=False, **kw):
    """One DP step of the tiny GPT-2 in ``precision``; with ``cuda`` on the GPU, where
    accelerate itself sets up the autocast and (fp16) its ``GradScaler`` (whose initial scale
    is then set to ``init_scale``), else on the CPU with the GPU's state given
    (:func:`as_on_gpu`)."""
    data = dataset()
    model = model_of(torch.float32)
    start = copy.deepcopy(model)
    grads = GradsBeforeStep()
    args = arguments(tmp_path, **{precision: True}, **({"use_cpu": False} if cuda else {}), **kw)
    trainer = DPTrainer(model=model, args=args, train_dataset=data, data_collator=collate,
                        callbacks=[grads], dp=DPConfig(max_grad_norm=C, noise_multiplier=0.0,
                                                       clipping=clipping))
    scales = ScaleBeforeStep(trainer)
    trainer.add_callback(scales)
    if precision == "fp16" and cuda:  # (accelerate's own scaler, on the GPU)
        assert trainer.accelerator.native_amp
        assert isinstance(trainer.accelerator.scaler, torch.amp.GradScaler)
        trainer.accelerator.scaler = torch.amp.GradScaler("cuda", init_scale=init_scale)
    elif precision == "fp16":
        as_on_gpu(trainer, init_scale)
    trainer.train()
    want = clipped_reference(copy.deepcopy(start).double(),
                             [data[i] for i in first_lot(data, args)], 6)
    return trainer, grads.grads, scales, want, start


# bfloat16 keeps 8 significant bits (relative rounding 2^-9 = 2e-3 per op); float16 11 bits
# (2^-12 = 2.4e-4): the bounds allow the error of a 2-layer network's forward and backward.
TOLERANCE = {"bf16": 3e-2, "fp16": 5e-3}


@pytest.mark.parametrize("clipping", ["book-keeping", "two-pass"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("micro", [(6, 1), (1, 6)], ids=["G1", "G6"])
def test_mixed_precision_step_near_float32_loop(tmp_path, precision, clipping, micro):
    """The step's gradient is within the precision's tolerance of the float64 loop's clipped
    sum. With fp16, gradhooks writes ``S`` times it (``S = 1024``) and the Trainer unscales it
    (``scaler.unscale_`` in its gradient-norm read, before ``on_pre_optimizer_step``): a
    gradient not written at the scale, or clipped at the scale, would be far off."""
    trainer, grads, steps, want, _ = run(tmp_path, precision, clipping,
                                          per_device_train_batch_size=micro[0],
                                          gradient_accumulation_steps=micro[1])
    assert trainer.lot_sizes[0] > 0
    if precision == "fp16":
        assert steps.scales == [2.0 ** 10] and steps.skipped == [False]
    got = {n: g.double() for n, g in grads[0].items()}  # (unscaled by the Trainer already)
    assert relative_error(got, want) <= TOLERANCE[precision]


ON_CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device: accelerate runs fp16=True (its GradScaler) and bf16=True on a GPU "
           "only; the tests above give the CPU the GPU's state instead")


@ON_CUDA
@pytest.mark.parametrize("clipping", ["book-keeping", "two-pass"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_step_on_cuda_near_float32_loop(tmp_path, precision, clipping):
    """On a GPU, where accelerate sets up the autocast and the ``GradScaler`` itself (the CPU
    tests above give it that state by hand): the step's gradient is within the precision's
    tolerance of the float64 loop's clipped sum, unscaled by the Trainer."""
    trainer, grads, steps, want, _ = run(tmp_path, precision, clipping, cuda=True)
    assert next(trainer.model.parameters()).is_cuda and trainer.lot_sizes[0] > 0
    if precision == "fp16":
        assert steps.scales == [2.0 ** 10] and steps.skipped == [False]
    got = {n: g.double().cpu() for n, g in grads[0].items()}
    assert relative_error(got, want) <= TOLERANCE[precision]


@ON_CUDA
def test_fp16_overflow_on_cuda_keeps_the_weights(tmp_path):
    """An overflowing float16 lot on a GPU with the Trainer's default fused AdamW (the CUDA
    kernel that reads the scaler's ``found_inf``): the weights stay, the scale is halved, the
    accountant counts the lot."""
    trainer, _, steps, _, start = run(tmp_path, "fp16", init_scale=2.0 ** 40, cuda=True)
    assert steps.scales == [2.0 ** 40]
    assert float(trainer.accelerator.scaler.get_scale()) == 2.0 ** 39
    for (n, p), q in zip(trainer.model.named_parameters(), start.parameters()):
        assert torch.equal(p.detach().cpu(), q.detach()), n
    assert len(trainer.accountant.history) == 1 and trainer.lot_sizes[0] > 0


def test_bf16_autocast_ran(tmp_path):
    """``bf16=True`` is not a float32 run in disguise: the step differs from float32's by
    more than float32 rounding."""
    _, bf16, _, want, _ = run(tmp_path, "bf16")
    err = relative_error({n: g.double() for n, g in bf16[0].items()}, want)
    assert 1e-5 < err <= TOLERANCE["bf16"]


def test_fp16_overflow_skips_the_step(tmp_path):
    """A loss scale so large that the float16 backward overflows: ``finish_step`` writes
    ``inf`` (NaN after the Trainer's ``unscale_``), ``scaler.step`` skips the update (the
    weights stay), ``scaler.update`` halves the scale, and the Trainer does not step the
    learning-rate scheduler; the accountant counts the lot. (``optim="adamw_torch"``: with the
    Trainer's default fused AdamW the scaler hands the overflow to the fused kernel, which
    leaves the weights, and accelerate reports the step as taken, so the Trainer steps the
    scheduler: the same for a plain Trainer, below.)"""
    trainer, grads, steps, _, start = run(tmp_path, "fp16", init_scale=2.0 ** 40,
                                          optim="adamw_torch")
    assert steps.scales == [2.0 ** 40] and steps.skipped == [True]
    assert not any(torch.isfinite(g).any() for g in grads[0].values())
    assert float(trainer.accelerator.scaler.get_scale()) == 2.0 ** 39
    for (n, p), q in zip(trainer.model.named_parameters(), start.parameters()):
        assert torch.equal(p.detach(), q.detach()), n
    assert trainer.lr_scheduler.last_epoch == 0  # not stepped
    assert len(trainer.accountant.history) == 1 and trainer.lot_sizes[0] > 0


def test_fp16_on_cpu_is_a_float32_run(tmp_path):
    """Without the GPU's state, accelerate ignores ``fp16=True`` on a CPU (no scaler, no
    autocast): the DP step is then the float32 one, 1e-5 of the loop."""
    data = dataset()
    model = model_of(torch.float32)
    start = copy.deepcopy(model)
    grads = GradsBeforeStep()
    args = arguments(tmp_path, fp16=True)
    trainer = DPTrainer(model=model, args=args, train_dataset=data, data_collator=collate,
                        callbacks=[grads], dp=DPConfig(max_grad_norm=C, noise_multiplier=0.0))
    trainer.train()
    assert trainer.accelerator.scaler is None
    want = clipped_reference(start.double(), [data[i] for i in first_lot(data, args)], 6)
    assert relative_error({n: g.double() for n, g in grads.grads[0].items()}, want) <= 1e-5


def test_tied_weights_under_bf16_judged_by_their_parts():
    """GPT-2's tied ``wte`` under bfloat16 autocast: its per-sample gradient is the embedding's
    row scatter (float32) plus the output layer's product (bfloat16), which can cancel; the sum
    check judges it relative to the parts (it failed 2 of these 24 one-sample batches when
    judged relative to their sum), and still refuses a gradient the hooks do not see (the
    weight used functionally beside its modules)."""
    from test_trainer import causal_lm_losses

    import gradhooks
    from gradhooks.base.errors import GradientMismatchError

    data = dataset()
    model = model_of(torch.float32)
    for sample in data:
        with gradhooks.attach(model, loss_reduction="sum", check="always") as gh:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                losses = causal_lm_losses(model, collate([sample]))
            gh.backward(losses.sum())
            gh.clip_and_accumulate(C)
    with gradhooks.attach(model, loss_reduction="sum", check="always") as gh:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses = causal_lm_losses(model, collate(data[:1]))
        extra = 1e-2 * model.transformer.wte.weight.pow(2).sum()  # (outside its modules)
        gh.backward(losses.sum() + extra)
        with pytest.raises(GradientMismatchError, match="transformer.wte.weight"):
            gh.clip_and_accumulate(C)


def test_fp16_overflow_with_fused_adamw_keeps_the_weights(tmp_path):
    """The Trainer's default optimizer (fused AdamW) on an overflowing lot: the weights stay
    (the fused kernel skips on the scaler's ``found_inf``) and the scale is halved."""
    trainer, _, steps, _, start = run(tmp_path, "fp16", init_scale=2.0 ** 40)
    assert steps.scales == [2.0 ** 40]
    assert float(trainer.accelerator.scaler.get_scale()) == 2.0 ** 39
    for (n, p), q in zip(trainer.model.named_parameters(), start.parameters()):
        assert torch.equal(p.detach(), q.detach()), n
