"""Per-sample gradient norms and the gradient noise scale during ordinary Trainer training.

    python examples/trainer_grad_stats.py [--steps 80] [--batch 32] [--seed 0] [--threads 1]

A character-level GPT-2 (transformers' ``GPT2LMHeadModel`` from a small config: 2 layers, width
64, random weights: nothing is downloaded) is trained, without privacy, on the paragraphs of
Python's ``argparse.py`` by a plain ``transformers.Trainer``, with gradhooks'
``GradientStatsCallback`` added. After each step's backward the callback reads the Gram matrix
``<g_n, g_m>`` of the batch's per-sample gradients (Gram form per layer, no per-sample gradient
tensor) and logs the per-sample gradient norms and the "simple" gradient noise scale
``B_simple = tr(Sigma) / |G|^2`` (McCandlish et al. 2018, arXiv:1812.06162, sec. 2.2, with the
unbiased estimates and moving averages of their appendix A): roughly the batch size beyond which
larger batches stop speeding training up.

The padded batches have uneven lengths, so the Trainer gets ``compute_loss_func=token_mean_loss``
(each paragraph's mean loss over its own characters, then the mean over paragraphs): per-sample
gradients are then each paragraph's own; the model's own loss (a mean over the batch's
characters) weighs paragraphs by their lengths, and gradhooks refuses it.
Needs transformers and opacus: ``pip install -e .[transformers]``.
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

from gradhooks.integrations.transformers import (  # noqa: E402
    GradientStatsCallback,
    causal_lm_collate,
    token_mean_loss,
)

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=80)
parser.add_argument("--batch", type=int, default=32)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: at this model size more threads cost more than they "
                         "give, on a busy machine much more)")
args = parser.parse_args()
torch.set_num_threads(args.threads)
transformers.logging.set_verbosity_error()


collate = causal_lm_collate  # (right padding, labels -100 past each paragraph's end)


torch.manual_seed(args.seed)
model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
    n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=0,
    eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
stats = GradientStatsCallback(decay=0.9)
trainer = transformers.Trainer(
    model=model,
    args=transformers.TrainingArguments(
        tempfile.mkdtemp(), max_steps=args.steps, per_device_train_batch_size=args.batch,
        learning_rate=3e-3, logging_steps=max(1, args.steps // 8), save_strategy="no",
        report_to=[], use_cpu=True, seed=args.seed, disable_tqdm=True),
    train_dataset=paragraphs(argparse.__file__), data_collator=collate,
    compute_loss_func=token_mean_loss, callbacks=[stats])
result = trainer.train()

print(f"{'step':>5} {'loss':>6} {'mean |g_n|':>10} {'max |g_n|':>9} {'tr Sigma':>9} "
      f"{'|G|^2':>8} {'B_simple':>8}")
logged = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
for row in stats.history:
    if row["step"] in logged:
        print(f"{row['step']:5d} {logged[row['step']]['loss']:6.3f} {row['grad_norm_mean']:10.3f} "
              f"{row['grad_norm_max']:9.3f} {row['trace_sigma']:9.2f} {row['g2']:8.3f} "
              f"{row['noise_scale']:8.1f}")
print(f"gradient noise scale B_simple ~ {stats.history[-1]['noise_scale']:.0f} (batch "
      f"{args.batch}); {result.metrics['train_runtime']:.1f} s for {args.steps} steps")
