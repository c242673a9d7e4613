"""Where a DP workload's book-keeping step goes: the hooked forward + backward
(``gh.backward(loss)``: grad_outputs recorded, no weight gradients), the per-sample norms and the
clipped sum (``gh.clip_and_accumulate(C)``: both from the same records), and the Python of the
hooks alone (``attach`` with nothing read: plain forward + ``loss.backward()`` with the hooks on),
each as a ratio to a plain step (hooks suspended), medians of the steps after a warm-up, the
variants alternated in one process. Run from the repository root::

    python benchmarks/dp_breakdown.py [--workloads mlp,cnn] [--steps 15] [--threads 1]

Workloads: ``gradhooks.tools.workloads.DP_WORKLOADS`` (those of ``benchmarks/dp.py``).
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gradhooks  # noqa: E402
from gradhooks.tools.workloads import DP_WORKLOADS  # noqa: E402


def breakdown(name: str, steps: int, warmup: int = 5) -> str:
    wl = DP_WORKLOADS[name]
    torch.manual_seed(0)
    model = wl.make_model()
    x, y = wl.load(torch.float32, wl.batch_size)
    gh = gradhooks.attach(model, loss_reduction=wl.loss_reduction)
    times = {k: [] for k in ("plain", "hooks", "backward", "clip")}

    def step(key, fn):
        t = time.perf_counter()
        fn()
        times[key].append(time.perf_counter() - t)

    def plain():
        with gh.recorder.suspended():
            model.zero_grad(set_to_none=True)
            wl.loss_fn(model(x), y).backward()

    def hooks():
        model.zero_grad(set_to_none=True)
        wl.loss_fn(model(x), y).backward()

    try:
        for i in range(steps + warmup):
            step("plain", plain)
            step("hooks", hooks)
            gh.recorder.reset_batch()
            model.zero_grad(set_to_none=True)
            step("backward", lambda: gh.backward(wl.loss_fn(model(x), y)))
            step("clip", lambda: gh.clip_and_accumulate(1.0))
            if i < warmup:
                for v in times.values():
                    v.clear()
    finally:
        gh.detach()
    m = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    p = m["plain"]
    return (f"| {name} | {p:.2f} ms | {m['hooks'] / p:.2f}x | {m['backward'] / p:.2f}x | "
            f"{m['clip'] / p:.2f}x | {(m['backward'] + m['clip']) / p:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default=",".join(DP_WORKLOADS))
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("| workload | plain step | hooks on, nothing read | gh.backward | clip_and_accumulate | "
          "book-keeping step |\n|---|--:|--:|--:|--:|--:|")
    for name in args.workloads.split(","):
        print(breakdown(name, args.steps), flush=True)


if __name__ == "__main__":
    main()
