"""The Hugging Face ``Trainer`` integration (issue 28, gradhooks/integrations/transformers.py):
:class:`DPTrainer` and :class:`GradientStatsCallback` on a tiny GPT-2 (2 layers, width 32, no
dropout) from a config, padded causal-LM batches with uneven valid-token counts, float64 (and
float32 with tolerances).

Each DP step is checked against a hand-computed reference: the lot the Poisson sampler drew
(re-drawn from the same seed), each sample's gradient of its own token-mean loss by a loop of
one-sample forwards (no padding), clipped to ``C`` and summed, over the expected lot size
(noise 0). Epsilon against Opacus' accountants stepped by hand.
"""
import copy
import math
import pathlib
import subprocess
import sys

import pytest
import torch

import zoo_imports

zoo_imports.import_torchvision()
import transformers  # noqa: E402  (the test extra, with opacus; after the torchvision stub)
from opacus import PrivacyEngine  # noqa: E402
from opacus.accountants import PRVAccountant, RDPAccountant  # noqa: E402
from opacus.utils.uniform_sampler import UniformWithReplacementSampler  # noqa: E402

from gradhooks.integrations.transformers import (  # noqa: E402
    DPConfig,
    DPTrainer,
    GradientStatsCallback,
    PoissonMicroBatchSampler,
    causal_lm_collate,
    causal_lm_losses,
    token_mean_loss,
)

V, N, C = 50, 24, 0.5


def model_of(dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return zoo_imports.tiny_gpt2(V).to(dtype)


def dataset(n=N, seed=1):
    """``n`` samples of 2 to 11 tokens (uneven valid-token counts after padding)."""
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, V, (int(torch.randint(2, 12, (), generator=g)),),
                                        generator=g).tolist()} for _ in range(n)]


collate = causal_lm_collate  # (right padding with 0, labels -100 past each sample's end)


def arguments(tmp_path, **kw):
    kw = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 3, "max_steps": 1,
          "learning_rate": 1e-2, "report_to": [], "save_strategy": "no", "use_cpu": True,
          "logging_steps": 1, "seed": 0, "disable_tqdm": True, **kw}
    return transformers.TrainingArguments(str(tmp_path), **kw)


class GradsBeforeStep(transformers.TrainerCallback):
    """Copies ``param.grad`` of the trainable parameters before each optimizer step."""

    def __init__(self):
        self.grads = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()
                           if p.requires_grad})


def own_grads(model, sample, reduction="mean"):
    """The gradient of one sample's own token loss, alone (no padding)."""
    batch = collate([sample])
    model.zero_grad()
    causal_lm_losses(model, batch, reduction).sum().backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def clipped_reference(model, samples, expected, reduction="mean", bound=C):
    """``sum_n min(1, C / ||g_n||) g_n / expected`` by a loop (``C``: ``bound``)."""
    total = None
    for s in samples:
        g = own_grads(model, s, reduction)
        norm = torch.sqrt(sum((v.double() ** 2).sum() for v in g.values()))
        factor = min(1.0, bound / float(norm))
        total = ({n: factor * v for n, v in g.items()} if total is None
                 else {n: total[n] + factor * v for n, v in g.items()})
    if total is None:
        return {n: torch.zeros_like(p) for n, p in model.named_parameters() if p.requires_grad}
    return {n: v / expected for n, v in total.items()}


def first_lot(data, args):
    """The first lot the trainer's sampler draws (same seed, same rate)."""
    lot = args.per_device_train_batch_size * args.gradient_accumulation_steps
    sampler = PoissonMicroBatchSampler(len(data), lot / len(data), 1,
                                       args.gradient_accumulation_steps,
                                       torch.Generator().manual_seed(args.seed))
    return [i for part in sampler for i in part]


def assert_grads_close(got, want, rtol):
    assert got.keys() == want.keys()
    scale = max(float(v.abs().max()) for v in want.values())
    for n in want:
        err = float((got[n].double() - want[n].double()).abs().max())
        assert err <= rtol * scale, f"{n}: {err:.3g} > {rtol:g} * {scale:.3g}"


def run_dp(tmp_path, model, data, dp, **kw):
    grads = GradsBeforeStep()
    args = arguments(tmp_path, **kw)
    trainer = DPTrainer(model=model, args=args, train_dataset=data, data_collator=collate,
                        dp=dp, callbacks=[grads])
    trainer.train()
    return trainer, grads.grads, args


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-10), (torch.float32, 1e-5)],
                         ids=["float64", "float32"])
@pytest.mark.parametrize("clipping", ["book-keeping", "two-pass"])
@pytest.mark.parametrize("micro", [(6, 1), (2, 3), (1, 6)], ids=["G1", "G3", "G6"])
def test_dp_step_equals_looped_clipped_sum(tmp_path, dtype, rtol, clipping, micro):
    """One DP step (noise 0): the Trainer's gradient before the optimizer step equals the
    looped clipped sum of the Poisson lot over its expected size, however the lot is split
    into micro-batches (1, 3 or 6 of them: some have 0 or 1 sample)."""
    data = dataset()
    model = model_of(dtype)
    start = copy.deepcopy(model)
    trainer, grads, args = run_dp(
        tmp_path, model, data, DPConfig(max_grad_norm=C, noise_multiplier=0.0,
                                        clipping=clipping),
        per_device_train_batch_size=micro[0], gradient_accumulation_steps=micro[1])
    lot = first_lot(data, args)
    assert trainer.lot_sizes == [len(lot)] and len(lot) > 0
    want = clipped_reference(start, [data[i] for i in lot], expected=6)
    assert_grads_close(grads[0], want, rtol)


def _lots(data, args, count):
    """The first ``count`` lots the trainer's sampler draws (same seed, same rate)."""
    micro = args.gradient_accumulation_steps
    lot = args.per_device_train_batch_size * micro
    parts = list(PoissonMicroBatchSampler(len(data), lot / len(data), count, micro,
                                          torch.Generator().manual_seed(args.seed)))
    return [[i for part in parts[k * micro:(k + 1) * micro] for i in part]
            for k in range(count)]


@pytest.mark.parametrize("clipping", ["book-keeping", "two-pass"])
def test_adaptive_clipping_follows_the_loop(tmp_path, clipping):
    """Adaptive clipping in the Trainer path (Andrew et al. 2021; noise off on both the gradient
    and the count): lot k is clipped at C_k, and C_k+1 = C_k exp(-eta (b_k - gamma)) with b_k
    the fraction of lot k's samples whose own-loss gradient norm (a float64 loop) is <= C_k;
    each lot's gradient equals the looped clipped sum at that lot's bound (float64, 1e-10). The
    weights move between lots (learning rate 0: the loop sees the same weights)."""
    data = dataset()
    model = model_of(torch.float64)
    start = copy.deepcopy(model)
    gamma, eta, c0 = 0.5, 0.7, 0.3
    trainer, grads, args = run_dp(
        tmp_path, model, data,
        DPConfig(max_grad_norm=c0, noise_multiplier=0.0, clipping=clipping,
                 target_unclipped_quantile=gamma, clipbound_learning_rate=eta,
                 count_noise_std=0.0), max_steps=3, learning_rate=0.0)
    bound = c0
    for k, lot in enumerate(_lots(data, args, 3)):
        samples = [data[i] for i in lot]
        norms = [float(torch.sqrt(sum((v ** 2).sum() for v in own_grads(start, x).values())))
                 for x in samples]
        want = clipped_reference(start, samples, expected=6, bound=bound)
        assert_grads_close(grads[k], want, 1e-10)
        frac = sum(n <= bound for n in norms) / len(norms) if norms else gamma
        bound = bound * math.exp(-eta * (frac - gamma))
    assert trainer.clip_bound == pytest.approx(bound, rel=1e-12)


def test_adaptive_clipping_config_errors():
    with pytest.raises(ValueError, match="count_noise_std"):
        DPConfig(noise_multiplier=1.0, target_unclipped_quantile=0.5)
    with pytest.raises(ValueError, match="count_noise_std"):
        DPConfig(noise_multiplier=1.0, count_noise_std=3.0)


def test_token_sum_reduction(tmp_path):
    """``token_reduction="sum"``: each sample's loss is its token sum."""
    data = dataset()
    model = model_of()
    start = copy.deepcopy(model)
    _, grads, args = run_dp(tmp_path, model, data,
                            DPConfig(max_grad_norm=C, noise_multiplier=0.0,
                                     token_reduction="sum"))
    want = clipped_reference(start, [data[i] for i in first_lot(data, args)], 6, "sum")
    assert_grads_close(grads[0], want, 1e-10)


def test_uneven_token_counts_per_sample_losses():
    """:func:`causal_lm_losses` on a padded batch (valid counts 1 to 11, one all-padding
    label row) equals each sample alone: mean over its own valid tokens, or the sum."""
    model = model_of()
    data = dataset(6, seed=3) + [{"input_ids": [7]}]
    batch = collate(data)
    assert len(set((batch["labels"] != -100).sum(1).tolist())) > 3
    for reduction in ("mean", "sum"):
        got = causal_lm_losses(model, batch, reduction)
        want = torch.stack([causal_lm_losses(model, collate([s]), reduction)[0] for s in data])
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert float(got[-1].detach()) == 0.0  # one token: no target after the shift


def test_poisson_sampler_draws_as_opacus():
    """The lots are Opacus' Poisson sampler's (``UniformWithReplacementSampler``, inside its
    ``DPDataLoader``) from the same generator, split into
    micro-batches that cover each lot once, empty ones included."""
    gen_a, gen_b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    ours = PoissonMicroBatchSampler(40, 0.1, 10, 4, gen_a)
    parts = list(ours)
    assert len(parts) == len(ours) == 40
    theirs = list(UniformWithReplacementSampler(num_samples=40, sample_rate=0.1, generator=gen_b))
    lots = [sum(parts[4 * i: 4 * i + 4], []) for i in range(10)]
    assert lots == theirs
    assert any(len(p) == 0 for p in parts)
    assert all(max(map(len, parts[4 * i: 4 * i + 4])) - min(map(len, parts[4 * i: 4 * i + 4])) <= 1
               for i in range(10))


def test_empty_lots_give_zero_gradient_and_count(tmp_path):
    """A lot with no sample: micro-batches of 0 samples, the gradient is the noise only (0
    here), and the accountant still counts the step."""
    data = dataset(200)
    trainer, grads, _ = run_dp(tmp_path, model_of(), data,
                               DPConfig(max_grad_norm=C, noise_multiplier=0.0),
                               per_device_train_batch_size=1, gradient_accumulation_steps=1,
                               max_steps=6)
    assert 0 in trainer.lot_sizes and len(trainer.lot_sizes) == 6
    for g, size in zip(grads, trainer.lot_sizes):
        if size == 0:
            assert all(float(v.abs().max()) == 0.0 for v in g.values())


@pytest.mark.parametrize("accountant,cls", [("rdp", RDPAccountant), ("prv", PRVAccountant)])
def test_epsilon_logged_equals_opacus_accountant(tmp_path, accountant, cls):
    """The logged epsilon is Opacus' accountant's for the same steps, rate and sigma; with a
    target epsilon, sigma is ``get_noise_multiplier``'s and the final epsilon meets it."""
    data = dataset()
    trainer, _, _ = run_dp(tmp_path, model_of(), data,
                           DPConfig(max_grad_norm=C, noise_multiplier=1.1,
                                    accountant=accountant, noise_seed=0), max_steps=3)
    logged = [h["epsilon"] for h in trainer.state.log_history if "loss" in h]
    acc = cls()
    for step in range(3):
        acc.step(noise_multiplier=1.1, sample_rate=6 / N)
        assert logged[step] == pytest.approx(acc.get_epsilon(delta=1e-5), rel=1e-9)
    trainer, _, _ = run_dp(tmp_path, model_of(), data,
                           DPConfig(max_grad_norm=C, target_epsilon=4.0, accountant=accountant,
                                    noise_seed=0), max_steps=4)
    final = trainer.state.log_history[-1]["epsilon"]
    assert final <= 4.0 and final == pytest.approx(4.0, abs=0.05)
    assert trainer.state.log_history[-1]["noise_multiplier"] == trainer.noise_multiplier


def test_noise_is_added_once_per_lot(tmp_path):
    """With noise, the step's gradient minus the noiseless one has the std ``sigma C / L``."""
    data = dataset()
    noisy = run_dp(tmp_path, model_of(), data,
                   DPConfig(max_grad_norm=C, noise_multiplier=2.0, noise_seed=3))[1][0]
    clean = run_dp(tmp_path, model_of(), data,
                   DPConfig(max_grad_norm=C, noise_multiplier=0.0))[1][0]
    z = torch.cat([(noisy[n] - clean[n]).flatten() for n in clean])
    assert float(z.std()) == pytest.approx(2.0 * C / 6, rel=0.02)


def test_lora_through_peft(tmp_path):
    """peft LoRA on GPT-2's attention: only the adapters train, and their DP step equals the
    looped clipped sum."""
    import peft
    torch.manual_seed(0)
    model = peft.get_peft_model(model_of(), peft.LoraConfig(r=4, target_modules=["c_attn"],
                                                             lora_dropout=0.0))
    for n, p in model.named_parameters():  # non-zero B so that every adapter has a gradient
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    data = dataset()
    start = copy.deepcopy(model)
    trainer, grads, args = run_dp(tmp_path, model, data,
                                  DPConfig(max_grad_norm=C, noise_multiplier=0.0),
                                  max_steps=2)
    assert set(grads[0]) == {n for n, p in start.named_parameters() if p.requires_grad}
    assert all("lora_" in n for n in grads[0])
    want = clipped_reference(start, [data[i] for i in first_lot(data, args)], 6)
    assert_grads_close(grads[0], want, 1e-10)
    assert len(trainer.lot_sizes) == 2


def test_same_update_as_opacus_make_private(tmp_path):
    """Opacus 1.6's ``make_private(..., wrap_model=False)`` (its hooks on the unchanged model,
    ``DPOptimizer``) on the same lot, noise 0: the same update as DPTrainer's up to Opacus'
    ``C / (||g_n|| + 1e-6)``; with that factor in the loop, equal to rounding."""
    data = dataset()
    model = model_of()
    start = copy.deepcopy(model)
    _, grads, args = run_dp(tmp_path, model, data, DPConfig(max_grad_norm=C,
                                                            noise_multiplier=0.0))
    lot = [data[i] for i in first_lot(data, args)]
    theirs = copy.deepcopy(start)
    engine = PrivacyEngine()
    hooks, optimizer, _ = engine.make_private(
        module=theirs, optimizer=torch.optim.SGD(theirs.parameters(), lr=1.0),
        data_loader=torch.utils.data.DataLoader(data, batch_size=6, collate_fn=collate),
        noise_multiplier=0.0, max_grad_norm=C, wrap_model=False, loss_reduction="mean")
    batch = collate(lot)  # Opacus' Embedding rule needs position ids batched
    batch["position_ids"] = torch.arange(batch["input_ids"].shape[1]).expand(len(lot), -1)
    causal_lm_losses(theirs, batch).mean().backward()
    optimizer.pre_step()
    opacus = {n: p.grad for n, p in theirs.named_parameters()}
    hooks.cleanup()
    assert_grads_close(grads[0], opacus, 1e-5)
    # the loop with Opacus' factor: C / (||g|| + 1e-6)
    total = None
    for s in lot:
        g = own_grads(start, s)
        norm = float(torch.sqrt(sum((v ** 2).sum() for v in g.values())))
        f = min(1.0, C / (norm + 1e-6))
        total = ({n: f * v for n, v in g.items()} if total is None
                 else {n: total[n] + f * v for n, v in g.items()})
    assert_grads_close(opacus, {n: v / 6 for n, v in total.items()}, 1e-10)


def test_config_errors():
    with pytest.raises(ValueError, match="exactly one"):
        DPConfig()
    with pytest.raises(ValueError, match="clipping"):
        DPConfig(noise_multiplier=1.0, clipping="ghost")
    with pytest.raises(ValueError, match="token_reduction"):
        DPConfig(noise_multiplier=1.0, token_reduction="none")


def test_stats_callback_against_loop(tmp_path):
    """:class:`GradientStatsCallback` during plain training (``token_mean_loss`` on padded
    batches): norms, ``tr(Sigma)``, ``|G|^2`` and B_simple from the per-sample gradients of a
    loop over the batch (one batch holds the whole data set, so it is known)."""
    data = dataset(8)
    model = model_of()
    start = copy.deepcopy(model)
    cb = GradientStatsCallback()
    args = arguments(tmp_path, per_device_train_batch_size=8, gradient_accumulation_steps=1,
                     max_steps=1)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   data_collator=collate, compute_loss_func=token_mean_loss,
                                   callbacks=[cb])
    trainer.train()
    g = torch.stack([torch.cat([v.flatten() for v in own_grads(start, s).values()])
                     for s in data])
    b = len(data)
    norms = g.norm(dim=1)
    mean = g.mean(0)
    trace_sigma = float(((g - mean) ** 2).sum() / (b - 1))
    g2 = float(mean.pow(2).sum()) - trace_sigma / b
    row = cb.history[0]
    assert row["step"] == 1 and row["batch_size"] == b
    assert row["grad_norm_mean"] == pytest.approx(float(norms.mean()), rel=1e-10)
    assert row["grad_norm_max"] == pytest.approx(float(norms.max()), rel=1e-10)
    assert row["trace_sigma"] == pytest.approx(trace_sigma, rel=1e-9)
    assert row["g2"] == pytest.approx(g2, rel=1e-9, abs=1e-9 * trace_sigma)
    assert row["noise_scale"] == pytest.approx(trace_sigma / g2, rel=1e-6)
    assert trainer.state.log_history[0]["grad_norm_mean"] == row["grad_norm_mean"]


def test_stats_callback_refuses_accumulation(tmp_path):
    args = arguments(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    trainer = transformers.Trainer(model=model_of(), args=args, train_dataset=dataset(8),
                                   data_collator=collate, compute_loss_func=token_mean_loss,
                                   callbacks=[GradientStatsCallback()])
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        trainer.train()


def _run_example(name, *args):
    """Runs an example as a user would (as tests/test_examples.py does)."""
    script = pathlib.Path(__file__).resolve().parent.parent / "examples" / name
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_example_trainer_dp():
    out = _run_example("trainer_dp.py", "--steps", "3", "--lora")
    assert "LoRA" in out and "epsilon = " in out and "held-out loss" in out


def test_example_trainer_grad_stats():
    out = _run_example("trainer_grad_stats.py", "--steps", "4")
    assert "gradient noise scale B_simple" in out
