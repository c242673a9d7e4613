"""DP supervised fine-tuning with TRL: gradhooks' ``DPSFTTrainer`` against Opacus 1.6
(``make_private(..., wrap_model=False)``, its hooks on the unchanged model), on the same
completion-only SFT batches, same model, seeds, noise multiplier and accountant.

    python benchmarks/trl_sft_opacus.py [--repeats 15] [--batch 16] [--steps 20] [--threads 1]
        [--out benchmarks/results/trl_sft_opacus.md]

The example: the character GPT-2 of ``benchmarks/trainer_opacus.py`` (2 layers, width 64,
random weights, float32) on prompt-completion pairs cut from the paragraphs of ``textwrap.py``
(the first 16 characters the prompt, the rest, up to 64 in all, the completion), given to TRL
pre-tokenized with ``completion_only_loss=True``: TRL's collator pads them and masks the prompt
(labels -100). Each sample's loss is its mean over its own completion tokens.

1. **Clipped update** of the first Poisson lot (noise 0, ``C = 1``; float32, float64):
   ``DPSFTTrainer`` (book-keeping and two-pass, the lot in 2 micro-batches) and Opacus (the
   same lot as one batch of TRL's collator), each against a float64 loop of one-sample
   gradients, clipped and summed, over the expected lot size.
2. **Epsilon**: ``DPSFTTrainer.train()`` for ``--steps`` lots with the noise multiplier
   ``get_noise_multiplier`` gives for epsilon 8 (RDP), against Opacus' ``PrivacyEngine`` after
   as many optimizer steps at the same rate and noise multiplier.
3. **Time and peak memory per step** on one fixed full lot (``--batch`` samples, TRL's
   collated batch): ``plain`` (no DP), ``gradhooks book-keeping`` / ``two-pass`` (what
   ``DPSFTTrainer.training_step`` runs), ``opacus hooks``; the measurement of
   ``benchmarks/trainer_opacus.py`` (rotated rounds, medians, peak RSS; Linux only).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import pathlib
import platform
import sys
import tempfile
import textwrap

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import datasets  # noqa: E402
import tokenizers  # noqa: E402
import torch  # noqa: E402
import trainer_opacus as base  # noqa: E402  (the torchvision import fix, model, measurement)
import transformers  # noqa: E402
import trl  # noqa: E402
from opacus import PrivacyEngine  # noqa: E402
from opacus.accountants.utils import get_noise_multiplier  # noqa: E402

from gradhooks.integrations.transformers import DPConfig, PoissonMicroBatchSampler, causal_lm_losses  # noqa: E402
from gradhooks.integrations.trl import DPSFTTrainer  # noqa: E402

C, DELTA, PROMPT = base.C, base.DELTA, 16


def sft_rows(length):
    """Pre-tokenized prompt-completion rows: ``input_ids`` (characters) and
    ``completion_mask`` (0 on the prompt's 16 characters)."""
    rows = []
    for r in base.paragraphs(textwrap, length):
        ids = r["input_ids"]
        if len(ids) > PROMPT + 2:
            rows.append({"input_ids": ids, "completion_mask": [0] * PROMPT
                         + [1] * (len(ids) - PROMPT)})
    return rows


def tokenizer():
    """A stand-in tokenizer (the rows are tokenized already): TRL reads its pad token, id 0."""
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<pad>": 0, "<eos>": 1},
                                                           unk_token="<pad>"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                                eos_token="<eos>")


def sft_args(out, batch, steps):
    return trl.SFTConfig(out, max_steps=steps, learning_rate=1e-3, lr_scheduler_type="constant",
                         report_to=[], save_strategy="no", use_cpu=True, seed=0,
                         disable_tqdm=True, logging_steps=steps, bf16=False, packing=False,
                         completion_only_loss=True, max_length=None,
                         per_device_train_batch_size=batch // 2, gradient_accumulation_steps=2)


def with_positions(batch):
    """Opacus' Embedding rule needs the position ids batched (GPT-2's own are ``(1, T)``)."""
    b, t = batch["input_ids"].shape
    return {**batch, "position_ids": torch.arange(t).expand(b, -1)}


def trainer_of(rows, length, batch, steps, out, dtype=torch.float32, sigma=0.0,
               clipping="book-keeping"):
    model = base.gpt2(length).to(dtype)
    grads = base.GradsBeforeStep()
    trainer = DPSFTTrainer(model=model, args=sft_args(out, batch, steps),
                           train_dataset=datasets.Dataset.from_list(rows),
                           processing_class=tokenizer(), callbacks=[grads],
                           dp=DPConfig(max_grad_norm=C, noise_multiplier=sigma, noise_seed=0,
                                       clipping=clipping))
    return trainer, grads


def compare_updates(rows, length, batch, out, dtype):
    table = {}
    # (copies of the model before a trainer patches its forward: TRL's fused-head forward calls
    # the original model's bound forward, which a deepcopy would keep)
    start = base.gpt2(length).to(dtype)
    for clipping in ("book-keeping", "two-pass"):
        trainer, grads = trainer_of(rows, length, batch, 1, out, dtype, clipping=clipping)
        trainer.train()
        table[f"gradhooks {clipping}"] = grads.grads[0]
    data = trainer.train_dataset
    lot = [i for part in PoissonMicroBatchSampler(len(data), trainer.sample_rate, 1, 2,
                                                  torch.Generator().manual_seed(0)) for i in part]
    assert trainer.lot_sizes == [len(lot)]
    collate = trainer.data_collator
    ref = copy.deepcopy(start).double()
    total = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
    for i in lot:
        ref.zero_grad()
        causal_lm_losses(ref, collate([data[i]])).sum().backward()
        norm = sum(float((p.grad ** 2).sum()) for p in ref.parameters()) ** 0.5
        for n, p in ref.named_parameters():
            total[n] += min(1.0, C / norm) * p.grad
    want = {n: v / batch for n, v in total.items()}
    theirs = copy.deepcopy(start)
    _, hooks, optimizer = base.opacus_setup(theirs, list(data), batch, 0.0)
    causal_lm_losses(theirs, with_positions(collate([data[i] for i in lot]))).mean().backward()
    optimizer.pre_step()
    opacus = {n: p.grad.detach().clone() for n, p in theirs.named_parameters()}
    hooks.cleanup()
    out_table = {k: base.max_diff(v, want) for k, v in table.items()}
    out_table["opacus hooks"] = base.max_diff(opacus, want)
    out_table["gradhooks book-keeping vs opacus"] = base.max_diff(table["gradhooks book-keeping"],
                                                                  opacus)
    return len(lot), out_table


def compare_epsilon(rows, length, batch, steps, out):
    q = batch / len(rows)
    sigma = get_noise_multiplier(target_epsilon=8.0, target_delta=DELTA, sample_rate=q,
                                 steps=steps, accountant="rdp", epsilon_tolerance=0.01)
    trainer, _ = trainer_of(rows, length, batch, steps, out, sigma=sigma)
    trainer.train()
    ours = trainer.state.log_history[-1]["epsilon"]
    model = base.gpt2(length)
    engine = PrivacyEngine(accountant="rdp")
    loader = torch.utils.data.DataLoader(rows, batch_size=batch, collate_fn=base.collate)
    _, optimizer, _ = engine.make_private(module=model,
                                          optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                                          data_loader=loader, noise_multiplier=sigma,
                                          max_grad_norm=C, poisson_sampling=True,
                                          wrap_model=False)
    for _ in range(steps):  # the accountant's step of each lot (its hook on optimizer.step)
        engine.accountant.step(noise_multiplier=optimizer.noise_multiplier,
                               sample_rate=optimizer.expected_batch_size / len(rows))
    return sigma, ours, engine.get_epsilon(DELTA), q


def step_methods(trainer, batch, sigma):
    fixed = trainer.data_collator([trainer.train_dataset[i] for i in range(batch)])
    model0 = base.gpt2(trainer.model.config.n_positions)  # (unpatched: see compare_updates)
    methods = base.gradhooks_methods(model0, fixed, batch, sigma)
    theirs = copy.deepcopy(model0)
    _, _, optimizer = base.opacus_setup(theirs, list(trainer.train_dataset)[:batch], batch,
                                        sigma)
    positioned = with_positions(fixed)

    def opacus_step():
        optimizer.zero_grad()
        causal_lm_losses(theirs, positioned).mean().backward()
        optimizer.step()
    methods["opacus hooks"] = (opacus_step, optimizer.zero_grad)
    return methods


def main():
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:  # (as benchmarks/trainer_opacus.py)
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
        os.execv(sys.executable, [sys.executable] + sys.argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--batch", type=int, default=16, help="expected lot size L")
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    rows = sft_rows(args.length)
    rows = rows[: len(rows) // args.batch * args.batch]
    out = tempfile.mkdtemp()
    tables = {dt: compare_updates(rows, args.length, args.batch, out, dt)
              for dt in (torch.float32, torch.float64)}
    sigma, eps_ours, eps_opacus, q = compare_epsilon(rows, args.length, args.batch, args.steps,
                                                     out)
    trainer, _ = trainer_of(rows, args.length, args.batch, 1, out, sigma=sigma)
    times, peaks = base.time_and_memory(step_methods(trainer, args.batch, sigma), args.repeats)
    lines = [
        "# DP SFT with TRL: gradhooks' DPSFTTrainer against Opacus 1.6 "
        "(benchmarks/trl_sft_opacus.py)", "",
        f"{datetime.date.today()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, trl {trl.__version__}, opacus 1.6, {platform.machine()} "
        f"{os.cpu_count()} cores, {args.threads} thread(s). **Not a quiet machine**: the cores "
        f"were shared with other jobs while this ran, so the times are indicative (their ratios "
        f"within one rotated round are the sturdier figure). Character GPT-2 (2 layers, width "
        f"64) on {len(rows)} prompt-completion pairs cut from textwrap.py (prompt 16 "
        f"characters, masked), expected lot L = {args.batch}, q = {q:.4f}, C = {C}.", ""]
    for dt, (lot, table) in tables.items():
        lines += [f"## Clipped update of the first Poisson lot ({lot} samples; noise 0, "
                  f"{str(dt)[6:]})", "", "| update | max abs diff | relative to max entry |",
                  "|---|--:|--:|"]
        for k, (err, rel) in table.items():
            lines.append(f"| {k}{'' if 'vs' in k else ' vs float64 loop'} | {err:.2e} | "
                         f"{rel:.2e} |")
        lines.append("")
    lines += [f"## Epsilon ({args.steps} lots, sigma = {sigma:.4f} from "
              f"get_noise_multiplier(eps 8, RDP), delta = {DELTA:g})", "",
              "| | epsilon |", "|---|--:|",
              f"| DPSFTTrainer, logged | {eps_ours:.6f} |",
              f"| Opacus PrivacyEngine's RDP accountant, stepped once per lot at its "
              f"optimizer's sigma and rate | {eps_opacus:.6f} |", "",
              f"## Time and peak memory per step (fixed lot of {args.batch}, medians of "
              f"{args.repeats} rotated rounds)", "",
              "| method | ms per step | x plain | peak RSS above start, MB |",
              "|---|--:|--:|--:|"]
    ref = times["plain (no DP)"]
    for k in times:
        lines.append(f"| {k} | {times[k]:.2f} | {times[k] / ref:.2f}x | {peaks[k]:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
