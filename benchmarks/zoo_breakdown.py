"""Where a zoo model's per-sample step goes: ``gh.backward(loss)`` (the hooked forward and
backward, no weight gradients) and ``gh.per_sample_grads()`` (the per-layer rules), each as a
ratio to a plain step (``loss.backward()`` with gradhooks' hooks suspended), medians over the
steps after a warm-up, in one process with the three alternated. Run from the repository root::

    python benchmarks/zoo_breakdown.py --models timm-resnet18,bert [--steps 14] [--threads 1]

Models and data as in ``benchmarks/zoo.py``.
"""
import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gradhooks  # noqa: E402

import zoo  # noqa: E402  (the models, data and loss of the zoo benchmark)


def breakdown(name: str, steps: int, warmup: int = 4) -> str:
    model, kind = zoo.build(name)
    model.eval()
    x, y = zoo.data(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gradhooks.FallbackWarning)
        gh = gradhooks.attach(model)
    plain, backward, read = [], [], []
    try:
        for i in range(steps + warmup):
            with gh.recorder.suspended():
                t0 = time.perf_counter()
                model.zero_grad(set_to_none=True)
                zoo.loss_fn(model(x), y).backward()
                t1 = time.perf_counter()
            model.zero_grad(set_to_none=True)
            t2 = time.perf_counter()
            gh.backward(zoo.loss_fn(model(x), y))
            t3 = time.perf_counter()
            gh.per_sample_grads()
            t4 = time.perf_counter()
            if i >= warmup:
                plain.append(t1 - t0)
                backward.append(t3 - t2)
                read.append(t4 - t3)
    finally:
        gh.detach()
    p, b, r = (statistics.median(v) * 1e3 for v in (plain, backward, read))
    return f"| {name} | {p:.1f} ms | {b / p:.2f}x | {r / p:.2f}x |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="timm-resnet18,tv-resnet18-gn,timm-convnext-atto,bert,tv-swin")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("| model | plain step | gh.backward | per_sample_grads() |\n|---|--:|--:|--:|")
    for name in args.models.split(","):
        print(breakdown(name, args.steps), flush=True)


if __name__ == "__main__":
    main()
