"""DP fine-tuning of a GPT-2-style model with the Hugging Face Trainer: gradhooks' ``DPTrainer``
against Opacus 1.6 (``PrivacyEngine.make_private(..., wrap_model=False)``: its hooks on the
unchanged model, ``DPOptimizer``, RDP accountant), same model, data, seeds, noise multiplier
and accountant.

    python benchmarks/trainer_opacus.py [--repeats 15] [--batch 16] [--steps 20] [--threads 1]
        [--out benchmarks/results/trainer_opacus.md]

The example: a character-level GPT-2 (transformers' ``GPT2LMHeadModel`` from a config: 2 layers,
width 64, 4 heads, 128 characters, no dropout, random weights, float32) on the paragraphs of
Python's ``textwrap.py`` (8 to 64 characters each: padded batches with uneven valid-token
counts, labels -100 past each end); each sample's loss is its mean over its own tokens.

1. **Clipped update** (noise 0, ``C = 1``; model in float32, then float64): the gradient the
   optimizer receives on the first Poisson lot, from ``DPTrainer`` (book-keeping and two-pass
   clipping, the lot in 2 micro-batches) and from Opacus (the same lot in one batch: Opacus'
   Poisson mode forbids accumulation; ``losses.mean().backward()`` then
   ``DPOptimizer.pre_step()``), each against the clipped sum over the expected lot size formed
   in float64 from a loop of one-sample gradients. Opacus clips by ``C / (||g_n|| + 1e-6)``.
2. **Epsilon**: ``DPTrainer.train()`` and :class:`OpacusTrainer` (Opacus in a ``Trainer``)
   ``.train()`` for ``--steps`` lots of one batch, with the noise multiplier that
   ``get_noise_multiplier`` gives for epsilon 8 (RDP) at the same rate: the epsilon each logs,
   and each run's wall time per lot.
3. **Time and memory per step** on one fixed full lot (``--batch`` samples): forward, backward,
   clip, noise, division, ``SGD.step()``: ``plain`` (no DP), ``gradhooks book-keeping`` and
   ``two-pass`` (what ``DPTrainer.training_step`` runs), ``opacus hooks``; each method on its own
   copy of the model, all in one process, in rounds whose order rotates; medians of
   ``--repeats`` rounds after 3 warm-up rounds. Peak memory: the process' peak RSS during one
   step above its RSS at the step's start (``/proc/self/clear_refs`` resets the peak; the
   script re-runs itself with ``MALLOC_MMAP_THRESHOLD_=65536`` so that freed tensors leave
   the RSS; what a method keeps between steps is dropped, untimed, before each), median over
   the rounds. Linux only (``/proc``).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import textwrap
import time
import types

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# torchvision 0.28 (a CUDA build beside the CPU torch) fails to import; transformers imports it
# when installed and needs none of its ops here (as examples/dp_lora_finetune.py).
sys.modules.setdefault("torchvision._meta_registrations",
                       types.ModuleType("torchvision._meta_registrations"))

import torch  # noqa: E402
import transformers  # noqa: E402
from opacus import PrivacyEngine  # noqa: E402
from opacus.accountants.utils import get_noise_multiplier  # noqa: E402

import gradhooks  # noqa: E402
from gradhooks.integrations.transformers import (  # noqa: E402
    DPConfig,
    DPTrainer,
    PoissonMicroBatchSampler,
    causal_lm_collate,
    causal_lm_losses,
)

VOCAB, C, DELTA = 128, 1.0, 1e-5


def paragraphs(module, length: int):
    """The module source's paragraphs (blank-line separated), at most ``length`` characters,
    at least 8, as character ids."""
    text = open(module.__file__, encoding="utf-8").read()
    out = []
    for par in re.split(r"\n\s*\n", text):
        par = par.strip()[:length]
        if len(par) >= 8:
            out.append({"input_ids": [min(ord(c), VOCAB - 1) for c in par]})
    return out


def collate(features):
    """causal_lm_collate's padding, labels and mask, and position ids batched: Opacus' Embedding
    rule reads the batch from its input, and GPT-2's own position_ids are (1, T)."""
    batch = causal_lm_collate(features)
    b, t = batch["input_ids"].shape
    return {**batch, "position_ids": torch.arange(t).expand(b, -1)}


def gpt2(length: int):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB,
                                  n_positions=length, bos_token_id=0, eos_token_id=0,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def training_args(out, batch, steps, **kw):
    kw = {"logging_steps": 1, "per_device_train_batch_size": batch // 2,
          "gradient_accumulation_steps": 2, **kw}
    return transformers.TrainingArguments(
        out, max_steps=steps, learning_rate=1e-3, lr_scheduler_type="constant", report_to=[],
        save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, **kw)


class GradsBeforeStep(transformers.TrainerCallback):
    def __init__(self):
        self.grads = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})


def looped_clipped(model, samples, expected):
    """float64: ``sum_n min(1, C / ||g_n||) g_n / expected`` by one-sample gradients."""
    model = copy.deepcopy(model).double()
    total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for s in samples:
        model.zero_grad()
        causal_lm_losses(model, collate([s])).sum().backward()
        norm = math.sqrt(sum(float((p.grad ** 2).sum()) for p in model.parameters()))
        for n, p in model.named_parameters():
            total[n] += min(1.0, C / norm) * p.grad
    return {n: v / expected for n, v in total.items()}


def max_diff(got, want):
    err = max(float((got[n].double() - want[n].double()).abs().max()) for n in want)
    return err, err / max(float(v.abs().max()) for v in want.values())


def opacus_setup(model, data, batch, sigma, noise_seed=0):
    """Opacus 1.6 as its README sets it up, with the model left unwrapped (hooks only)."""
    loader = torch.utils.data.DataLoader(data, batch_size=batch, collate_fn=collate)
    engine = PrivacyEngine(accountant="rdp")
    hooks, optimizer, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
        data_loader=loader, noise_multiplier=sigma, max_grad_norm=C, loss_reduction="mean",
        poisson_sampling=True, wrap_model=False, grad_sample_mode="hooks",
        noise_generator=torch.Generator().manual_seed(noise_seed))
    return engine, hooks, optimizer


def compare_updates(data, length, batch, out, dtype):
    """Part 1: the first lot's clipped update of each (model in ``dtype``), against the
    float64 loop."""
    model = gpt2(length).to(dtype)
    args = training_args(out, batch, 1)
    lot_sampler = PoissonMicroBatchSampler(len(data), batch / len(data), 1, 1,
                                           torch.Generator().manual_seed(args.seed))
    lot = next(iter(lot_sampler))
    want = looped_clipped(model, [data[i] for i in lot], batch)
    rows = {}
    for clipping in ("book-keeping", "two-pass"):
        grads = GradsBeforeStep()
        trainer = DPTrainer(model=copy.deepcopy(model), args=args, train_dataset=data,
                            data_collator=collate, callbacks=[grads],
                            dp=DPConfig(max_grad_norm=C, noise_multiplier=0.0,
                                        clipping=clipping))
        trainer.train()
        assert trainer.lot_sizes == [len(lot)]
        rows[f"gradhooks {clipping}"] = (grads.grads[0], want)
    theirs = copy.deepcopy(model)
    _, hooks, optimizer = opacus_setup(theirs, data, batch, 0.0)
    optimizer.zero_grad()
    causal_lm_losses(theirs, collate([data[i] for i in lot])).mean().backward()
    optimizer.pre_step()
    opacus_grads = {n: p.grad.detach().clone() for n, p in theirs.named_parameters()}
    hooks.cleanup()
    rows["opacus hooks"] = (opacus_grads, want)
    table = {k: max_diff(g, w) for k, (g, w) in rows.items()}
    table["gradhooks book-keeping vs opacus"] = max_diff(rows["gradhooks book-keeping"][0],
                                                         opacus_grads)
    return len(lot), table


class OpacusTrainer(transformers.Trainer):
    """Opacus 1.6 in a Trainer, as one would write it: ``make_private(..., wrap_model=False)`` on
    the Trainer's model, its ``DPDataLoader`` (Poisson lots) and ``DPOptimizer`` (around AdamW,
    the Trainer's default) in place of the Trainer's; one batch per lot (Opacus' Poisson mode
    forbids gradient accumulation); epsilon of its accountant logged."""

    def __init__(self, *args, sigma: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.args.max_grad_norm = 0.0
        self.sigma, self.engine = sigma, PrivacyEngine(accountant="rdp")

    def get_train_dataloader(self):
        loader = torch.utils.data.DataLoader(self.train_dataset, collate_fn=self.data_collator,
                                             batch_size=self.args.per_device_train_batch_size)
        self.hooks, self.dp_optimizer, dp_loader = self.engine.make_private(
            module=self.model, data_loader=loader, noise_multiplier=self.sigma,
            optimizer=torch.optim.AdamW(self.model.parameters(), lr=self.args.learning_rate),
            max_grad_norm=C, loss_reduction="mean", wrap_model=False,
            noise_generator=torch.Generator().manual_seed(0))
        return dp_loader

    def create_optimizer(self, model=None):
        self.optimizer = self.dp_optimizer
        return self.optimizer

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        self.dp_optimizer.zero_grad()  # (the Trainer's model.zero_grad() leaves grad_sample)
        loss = causal_lm_losses(model, self._prepare_inputs(inputs)).mean()
        loss.backward()
        return loss.detach()

    def log(self, logs, start_time=None):
        logs["epsilon"] = self.engine.get_epsilon(DELTA) if self.engine.accountant.history else 0.0
        super().log(logs, start_time)


def compare_epsilon(data, length, batch, steps, out):
    """Part 2: same sigma, rate and steps, one batch per lot: DPTrainer's logged epsilon and
    :class:`OpacusTrainer`'s, and the wall time per lot of each ``train()``."""
    q = batch / len(data)
    sigma = get_noise_multiplier(target_epsilon=8.0, target_delta=DELTA, sample_rate=q,
                                 steps=steps, accountant="rdp")
    args = training_args(out, batch, steps, logging_steps=steps, per_device_train_batch_size=batch,
                         gradient_accumulation_steps=1)
    t0 = time.perf_counter()
    ours = DPTrainer(model=gpt2(length), args=args, train_dataset=data, data_collator=collate,
                     dp=DPConfig(max_grad_norm=C, noise_multiplier=sigma, noise_seed=0))
    ours.train()
    wall_ours = (time.perf_counter() - t0) / steps
    t0 = time.perf_counter()
    theirs = OpacusTrainer(model=gpt2(length), args=args, train_dataset=data,
                           data_collator=collate, sigma=sigma)
    theirs.train()
    wall_theirs = (time.perf_counter() - t0) / steps
    theirs.hooks.cleanup()
    eps = [[h["epsilon"] for h in t.state.log_history if "loss" in h][-1] for t in (ours, theirs)]
    return sigma, eps[0], eps[1], wall_ours, wall_theirs


def rss(key: str) -> int:
    return int(re.search(key + r":\s+(\d+)", open("/proc/self/status").read()).group(1))


def gradhooks_methods(model0, fixed, batch, sigma):
    """Plain training and gradhooks' book-keeping and two-pass DP steps on copies of
    ``model0``, on the batch ``fixed``: ``{name: (step(), release())}`` (:func:`step_methods`;
    benchmarks/trl_sft_opacus.py uses them too)."""
    methods = {}
    plain = copy.deepcopy(model0)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=1e-3)

    def plain_step():
        plain_opt.zero_grad()
        causal_lm_losses(plain, fixed).mean().backward()
        plain_opt.step()
    methods["plain (no DP)"] = (plain_step, plain_opt.zero_grad)

    for clipping in ("book-keeping", "two-pass"):
        model = copy.deepcopy(model0)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        gh = gradhooks.attach(model, loss_reduction="sum")
        gen = torch.Generator().manual_seed(0)

        def gh_step(model=model, opt=opt, gh=gh, gen=gen, clipping=clipping):
            opt.zero_grad()
            losses = causal_lm_losses(model, fixed)
            if clipping == "two-pass":
                gh.clipped_backward(losses, C, accumulate=True)
            else:
                gh.backward(losses.sum())
                gh.clip_and_accumulate(C, accumulate=True)
            gh.finish_step(noise_multiplier=sigma, expected_batch_size=batch, generator=gen)
            opt.step()
        methods[f"gradhooks {clipping}"] = (gh_step, lambda opt=opt, gh=gh: (opt.zero_grad(),
                                                                             gh.clear()))
    return methods


def step_methods(data, length, batch, sigma):
    """Part 3: ``{name: (step(), release())}``, each on its own model copy and the same full
    lot; ``release`` (untimed) drops what a method keeps between steps (the gradients:
    ``zero_grad``, which also drops Opacus' ``grad_sample``; gradhooks: the last batch's
    records, which its next forward would drop), so that each step's peak is measured
    from a start that holds none of it."""
    fixed = collate(data[:batch])
    base = gpt2(length)
    methods = gradhooks_methods(base, fixed, batch, sigma)

    theirs = copy.deepcopy(base)
    _, hooks, optimizer = opacus_setup(theirs, data, batch, sigma)

    def opacus_step():
        optimizer.zero_grad()
        causal_lm_losses(theirs, fixed).mean().backward()
        optimizer.step()
    methods["opacus hooks"] = (opacus_step, optimizer.zero_grad)
    return methods


def time_and_memory(methods, repeats: int):
    names = list(methods)
    times = {k: [] for k in names}
    peaks = {k: [] for k in names}
    for r in range(repeats + 3):
        order = names[r % len(names):] + names[:r % len(names)]
        for k in order:
            step, release = methods[k]
            release()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            start = rss("VmRSS")
            t0 = time.perf_counter()
            step()
            dt = time.perf_counter() - t0
            if r >= 3:
                times[k].append(dt)
                peaks[k].append(rss("VmHWM") - start)
    return ({k: statistics.median(v) * 1e3 for k, v in times.items()},
            {k: statistics.median(v) / 1024 for k, v in peaks.items()})


def main():
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        # glibc keeps freed heap blocks, so RSS would not fall after a step's frees; with
        # every block of 64 KiB or more mmapped (returned to the system on free) the peak RSS
        # of a step follows its live tensors. glibc reads this at start: run again with it.
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
        os.execv(sys.executable, [sys.executable] + sys.argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--batch", type=int, default=16, help="expected lot size L")
    p.add_argument("--length", type=int, default=64, help="at most this many characters")
    p.add_argument("--steps", type=int, default=20, help="lots of the epsilon comparison")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="write the results as markdown here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    data = paragraphs(textwrap, args.length)
    data = data[: len(data) // args.batch * args.batch]  # Opacus' rate 1 / len(loader) = L / N
    out = tempfile.mkdtemp()
    transformers.logging.set_verbosity_error()

    tables = {dtype: compare_updates(data, args.length, args.batch, out, dtype)
              for dtype in (torch.float32, torch.float64)}
    sigma, eps_ours, eps_opacus, trainer_ours, trainer_opacus = compare_epsilon(
        data, args.length, args.batch, args.steps, out)
    times, peaks = time_and_memory(step_methods(data, args.length, args.batch, sigma),
                                   args.repeats)

    lines = [
        "# DP Trainer: gradhooks' DPTrainer against Opacus 1.6 (benchmarks/trainer_opacus.py)",
        "",
        f"{datetime.date.today()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, opacus 1.6, {platform.machine()} {os.cpu_count()} cores, "
        f"{args.threads} thread(s). Character GPT-2 (2 layers, width 64) on {len(data)} "
        f"paragraphs of textwrap.py ({args.length} characters at most), expected lot "
        f"L = {args.batch}, q = {args.batch / len(data):.4f}, C = {C}.",
        "",
    ]
    for dtype, (lot, table) in tables.items():
        lines += [f"## Clipped update of the first Poisson lot ({lot} samples; noise 0, "
                  f"{str(dtype)[6:]})", "",
                  "| update | max abs diff | relative to max entry |", "|---|--:|--:|"]
        for k, (err, rel) in table.items():
            ref = "" if "vs" in k else " vs float64 loop"
            lines.append(f"| {k}{ref} | {err:.2e} | {rel:.2e} |")
        lines.append("")
    lines += [
        "",
        f"## Epsilon ({args.steps} lots, sigma = {sigma:.4f} from get_noise_multiplier(eps 8, "
        f"RDP), delta = {DELTA:g})",
        "",
        "| | epsilon |",
        "|---|--:|",
        f"| DPTrainer (book-keeping), logged | {eps_ours:.6f} |",
        f"| OpacusTrainer (make_private, wrap_model=False), logged | {eps_opacus:.6f} |",
        "",
        f"train() wall time per lot (one batch per lot, AdamW, epsilon logged at the end only: "
        f"each RDP get_epsilon costs about 0.1 s): DPTrainer {trainer_ours * 1e3:.1f} ms, "
        f"OpacusTrainer {trainer_opacus * 1e3:.1f} ms (one run each, not alternated).",
        "",
        f"## Time and peak memory per step (fixed lot of {args.batch}, medians of "
        f"{args.repeats} rotated rounds)",
        "",
        "| method | ms per step | x plain | peak RSS above start, MB |",
        "|---|--:|--:|--:|",
    ]
    base = times["plain (no DP)"]
    for k in times:
        lines.append(f"| {k} | {times[k]:.2f} | {times[k] / base:.2f}x | {peaks[k]:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
