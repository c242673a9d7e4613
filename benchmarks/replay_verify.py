"""Cost of verifying every ``torch.func`` fallback replay (issue 38, point 5), beside plain
training, in one process.

    python benchmarks/replay_verify.py [--models tv-swin,bart] [--repeats 15] [--threads 1]
        [--out benchmarks/results/replay_verify.md]

Per model (``benchmarks/zoo.py``'s builders and batches: B = 16, T = 64 tokens or 32x32 images,
float32, eval mode; BART's positional embeddings and torchvision Swin-T's windowed attention are
replayed by the fallback), the median time of one step of, round robin:

* ``train``: ``loss.backward()``;
* ``grads``: ``gh.backward(loss)`` + ``gh.per_sample_grads()``, every replay verified (the
  default: one batched call and backward of each replayed module per read);
* ``grads, unverified``: the same under ``attach(..., unsafe_skip_replay_check=True)``;
* ``clip`` / ``clip, unverified``: ``loss.backward()`` + ``gh.clip_and_accumulate(1.0)``.

Ratios are to ``train``; the last columns are verified over unverified.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gradhooks  # noqa: E402

import zoo  # noqa: E402  (benchmarks/zoo.py: the model builders, batches and loss)


def measure(name: str, repeats: int) -> dict:
    model, kind = zoo.build(name)
    model = model.eval()
    x, y = zoo.data(kind)
    params = [p for p in model.parameters() if p.requires_grad]

    def train():
        for p in params:
            p.grad = None
        zoo.loss_fn(model(x), y).backward()

    def steps(gh):
        def grads():
            gh.backward(zoo.loss_fn(model(x), y))
            gh.per_sample_grads()

        def clip():
            for p in params:
                p.grad = None
            zoo.loss_fn(model(x), y).backward()
            gh.clip_and_accumulate(1.0)
        return grads, clip

    variants = {"train": None, "grads": ({}, 0), "clip": ({}, 1),
                "grads, unverified": ({"unsafe_skip_replay_check": True}, 0),
                "clip, unverified": ({"unsafe_skip_replay_check": True}, 1)}
    times = {k: [] for k in variants}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gradhooks.FallbackWarning)
        for r in range(repeats + 1):  # (round robin; the first round warms up)
            for key, how in variants.items():
                if how is None:
                    step = train
                    train()
                else:  # (attached per round: its first step analyses the forward, untimed)
                    gh = gradhooks.attach(model, **how[0])
                    step = steps(gh)[how[1]]
                    step()
                t0 = time.perf_counter()
                step()
                t = time.perf_counter() - t0
                if how is not None:
                    gh.detach()
                if r:
                    times[key].append(t * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tv-swin,bart")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="also write the table here (markdown)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    lines = ["| model | train (ms) | grads | grads, unverified | clip | clip, unverified "
             "| grads: verified / unverified | clip: verified / unverified |",
             "|---|--:|--:|--:|--:|--:|--:|--:|"]
    for name in a.models.split(","):
        m = measure(name, a.repeats)
        base = m["train"]
        lines.append(f"| {name} | {base:.1f} | {m['grads'] / base:.2f}x | "
                     f"{m['grads, unverified'] / base:.2f}x | {m['clip'] / base:.2f}x | "
                     f"{m['clip, unverified'] / base:.2f}x | "
                     f"{m['grads'] / m['grads, unverified']:.3f} | "
                     f"{m['clip'] / m['clip, unverified']:.3f} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines)
    if a.out:
        with open(a.out, "w") as f:
            f.write(f"# Cost of verifying every fallback replay (issue 38, point 5)\n\n"
                    f"`python benchmarks/replay_verify.py "
                    f"{' '.join(argv if argv is not None else sys.argv[1:])}`, torch "
                    f"{torch.__version__}, {a.threads} thread(s), medians of {a.repeats}, "
                    f"round robin in one process; ratios to plain training (`train`).\n\n"
                    f"{text}\n")


if __name__ == "__main__":
    main()
