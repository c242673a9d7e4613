"""What per-sample gradients cost on a mixture-of-experts model against the dense model of the
same width (issue 30's target: the MoE's ratio within 1.3x of the dense one's).

    python benchmarks/moe.py [--repeats 11] [--threads 1] [--width 128] [--batch 8] [--tokens 64]
                             [--ffn 2] [--experts grouped_mm|eager]

Mixtral (sparse MoE: ``E = 8`` experts, top-2 routing over the ``(B*T, d)`` token rows) and
Mistral (the same decoder with one dense MLP of the expert's width), both from configs (random
weights, float32, eval, 2 layers, vocab 1000), the same batch, the experts as transformers
runs them by default (``"grouped_mm"``: one grouped product over the rows sorted by expert;
``--experts eager`` for its per-expert loop). Per model, timed round robin in one process after
2 warm-up steps each, medians:

* ``train``: ``loss.backward()`` (the baseline);
* ``grads``: ``gh.backward(loss)`` + ``gh.per_sample_grads()``;
* ``norms``: ``loss.backward()`` + ``gh.per_sample_grad_norms()``.

The loss is the mean over samples of each sample's token-mean cross-entropy. Printed: each
step's ms, its ratio to the model's own ``train``, and MoE ratio / dense ratio.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import gradhooks  # noqa: E402

import zoo_imports  # noqa: E402  (torchvision in the CPU venv, see tests/zoo_imports.py)

V = 1000


def build(kind: str, width: int, tokens: int, experts=None, ffn: int = 2):
    import transformers as tr
    common = dict(vocab_size=V, hidden_size=width, intermediate_size=ffn * width,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=tokens, use_cache=False)
    torch.manual_seed(0)
    if kind == "moe":
        return tr.MixtralForCausalLM(tr.MixtralConfig(
            num_local_experts=8, num_experts_per_tok=2, experts_implementation=experts,
            **common)).eval()
    return tr.MistralForCausalLM(tr.MistralConfig(**common)).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--ffn", type=int, default=2,
                        help="each expert's (and the dense MLP's) intermediate size / width")
    parser.add_argument("--experts", default=None, choices=[None, "grouped_mm", "eager"],
                        help="transformers' experts implementation (default: its default, "
                             "grouped_mm)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    zoo_imports.import_torchvision()
    ids = torch.randint(0, V, (args.batch, args.tokens), generator=torch.Generator().manual_seed(1))

    def loss_of(m):
        return gradhooks.per_sample_token_loss(m(ids).logits, ids).mean()

    variants = {}
    for kind in ("dense", "moe"):
        plain = build(kind, args.width, args.tokens, args.experts, args.ffn)
        hooked = copy.deepcopy(plain)
        gh = gradhooks.attach(hooked)

        def train(m=plain):
            loss_of(m).backward()

        def grads(m=hooked, gh=gh):
            gh.backward(loss_of(m))
            gh.per_sample_grads()

        def norms(m=hooked, gh=gh):
            loss_of(m).backward()
            gh.per_sample_grad_norms()

        for name, run in (("train", train), ("grads", grads), ("norms", norms)):
            variants[(kind, name)] = (run, plain, hooked)
    times = {k: [] for k in variants}
    for k, (run, plain, hooked) in variants.items():
        for _ in range(2):
            plain.zero_grad(set_to_none=True)
            hooked.zero_grad(set_to_none=True)
            run()
    for i in range(args.repeats):
        order = list(variants) if i % 2 == 0 else list(reversed(variants))
        for k in order:
            run, plain, hooked = variants[k]
            plain.zero_grad(set_to_none=True)
            hooked.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            run()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"Mixtral (8 experts, top-2, experts {args.experts or 'grouped_mm (default)'}) vs "
          f"Mistral, width {args.width}, intermediate {args.ffn} x width, 2 layers, B = {args.batch}, "
          f"T = {args.tokens}, float32, {args.threads} thread(s), medians of {args.repeats}")
    print("| model | train ms | grads | norms |")
    print("|---|--:|--:|--:|")
    ratio = {}
    for kind in ("dense", "moe"):
        t = med[(kind, "train")]
        ratio[kind] = {m: med[(kind, m)] / t for m in ("grads", "norms")}
        print(f"| {kind} | {t:.1f} | {ratio[kind]['grads']:.2f}x | {ratio[kind]['norms']:.2f}x |")
    for m in ("grads", "norms"):
        print(f"MoE ratio / dense ratio ({m}): {ratio['moe'][m] / ratio['dense'][m]:.2f}")


if __name__ == "__main__":
    main()
