"""DP fine-tuning with the Hugging Face Trainer: gradhooks' DPTrainer on a small GPT-2.

    python examples/trainer_dp.py [--steps 60] [--epsilon 8] [--batch 32] [--micro 2]
        [--clipping book-keeping|two-pass] [--lora] [--seed 0] [--threads 1]

A character-level GPT-2 (transformers' ``GPT2LMHeadModel`` from a small config: 2 layers, width
64, random weights: nothing is downloaded) is trained on the paragraphs of Python's
``argparse.py`` (at most 64 characters each, so the padded batches have uneven lengths;
labels -100 past each end) with the script one writes for a ``Trainer``, ``DPTrainer`` and a
``DPConfig`` in its place:

* Poisson sampling of lots of expected size ``--batch``, each run as ``--micro`` micro-batches
  through the Trainer's gradient accumulation;
* each paragraph's gradient (of its mean loss over its own characters) clipped to ``C = 1``,
  book-keeping ghost clipping by default (``--clipping two-pass`` for the two-pass variant);
* Gaussian noise once per lot, its multiplier from the target epsilon (``--epsilon`` at delta
  1e-5, Opacus' RDP accountant, for the run's ``--steps`` lots), epsilon logged by the Trainer;
* ``--lora``: peft LoRA (rank 8) on the attention projections instead of every weight.

Prints the noise multiplier, the held-out loss before and after, and epsilon. Needs
transformers, opacus (and peft for ``--lora``): ``pip install -e .[transformers]``.
"""
import argparse
import os
import sys
import tempfile
import types

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The registry's torchvision 0.28 is a CUDA build whose import fails beside the CPU torch (in
# torchvision/_meta_registrations.py); transformers imports torchvision when it is installed and
# needs none of its ops here.
sys.modules.setdefault("torchvision._meta_registrations",
                       types.ModuleType("torchvision._meta_registrations"))

import torch  # noqa: E402
import transformers  # noqa: E402
from char_text import VOCAB, paragraphs  # noqa: E402  (examples/char_text.py)

from gradhooks.integrations.transformers import DPConfig, DPTrainer, causal_lm_collate  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=60, help="lots (optimizer steps)")
parser.add_argument("--epsilon", type=float, default=8.0, help="target epsilon at delta 1e-5")
parser.add_argument("--batch", type=int, default=32, help="expected lot size")
parser.add_argument("--micro", type=int, default=2, help="micro-batches per lot")
parser.add_argument("--clipping", default="book-keeping", choices=["book-keeping", "two-pass"])
parser.add_argument("--lora", action="store_true", help="train peft LoRA adapters only")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: at this model size more threads cost more than they "
                         "give, on a busy machine much more)")
args = parser.parse_args()
torch.set_num_threads(args.threads)
transformers.logging.set_verbosity_error()


collate = causal_lm_collate  # (right padding, labels -100 past each paragraph's end)


data = paragraphs(argparse.__file__)
split = torch.randperm(len(data), generator=torch.Generator().manual_seed(args.seed)).tolist()
train = [data[i] for i in split[: int(0.9 * len(data))]]
test = [data[i] for i in split[int(0.9 * len(data)):]]

torch.manual_seed(args.seed)
model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
    n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=0,
    eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
if args.lora:
    from peft import LoraConfig, get_peft_model  # (optional dependency of this flag only)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"],
                                             lora_dropout=0.0, fan_in_fan_out=True))

training_args = transformers.TrainingArguments(
    tempfile.mkdtemp(), max_steps=args.steps, per_device_train_batch_size=args.batch // args.micro,
    gradient_accumulation_steps=args.micro, per_device_eval_batch_size=64,
    learning_rate=3e-3 if not args.lora else 1e-2, lr_scheduler_type="constant",
    logging_steps=max(1, args.steps // 4), save_strategy="no", report_to=[], use_cpu=True,
    seed=args.seed, disable_tqdm=True)
trainer = DPTrainer(model=model, args=training_args, train_dataset=train, eval_dataset=test,
                    data_collator=collate,
                    dp=DPConfig(target_epsilon=args.epsilon, delta=1e-5, max_grad_norm=1.0,
                                clipping=args.clipping, noise_seed=args.seed))
before = trainer.evaluate()["eval_loss"]
result = trainer.train()
after = trainer.evaluate()["eval_loss"]
logged = [h for h in trainer.state.log_history if "loss" in h]
print(f"{len(train)} training paragraphs, lots of {args.batch} expected (q = "
      f"{trainer.sample_rate:.4f}) in {args.micro} micro-batches, {args.clipping} clipping"
      f"{', LoRA' if args.lora else ''}")
print(f"noise multiplier {trainer.noise_multiplier:.3f} for epsilon {args.epsilon} over "
      f"{args.steps} lots; lot sizes drawn: min {min(trainer.lot_sizes)}, max "
      f"{max(trainer.lot_sizes)}")
for h in logged:
    print(f"  step {h['step']:4d}  loss {h['loss']:.3f}  epsilon {h['epsilon']:.2f}")
print(f"held-out loss (nats per character) {before:.3f} -> {after:.3f}")
print(f"epsilon = {trainer.epsilon():.2f} at delta = 1e-05; "
      f"{result.metrics['train_runtime']:.1f} s")
