"""What gradhooks' global module hooks cost the other models of the process: the plain forward of
an unrelated 8-layer MLP and the plain training step of the seed MLP, before any attach, with one
live attachment on another model, and after 1,000 attach cycles (issue 31).

    python benchmarks/attach_cycles.py [--rounds 15] [--calls 200] [--threads 1]

An attachment hooks through torch's process-wide module hooks (the model itself carries none),
so while one is live every module call of the process leaves torch's hook-free fast path. The
1,000 cycles are 500 ``attach(nn.Linear(3, 2))`` + ``detach()`` and 500 attachments dropped
without ``detach()`` (garbage-collected, a ``NotDetachedWarning`` each, silenced here); after
them nothing of gradhooks should be left in torch's hook dictionaries, and the unrelated models
should run as fast as before any attach.

The unrelated models: ``Linear(128, 128)`` x 8 with ReLU between, ``(64, 128)`` input, forward
under ``no_grad``; the seed MLP 10-32-32-10 (``gradhooks.tools.workloads.make_mlp``) at B = 256,
zero_grad + forward + sum + ``backward()``. The live attachment is on a third model
(``Linear(3, 2)``). Each figure is the median over ``--rounds`` rounds of the mean time of
``--calls`` calls; "nothing attached" and "one live attachment" are alternated round by round
in one process (before and after the cycles), "before any attach" runs first.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time
import warnings

import torch
import torch.nn.modules.module as torch_module
from torch import nn

import gradhooks
from gradhooks.tools.workloads import make_mlp


def global_entries() -> int:
    """Entries in all of torch's global module hook dictionaries."""
    return sum(len(d) for name, d in vars(torch_module).items()
               if name.startswith("_global_") and isinstance(d, dict))


def per_call_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def workloads():
    """name -> the call timed."""
    torch.manual_seed(0)
    deep = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(128, 128), nn.ReLU())])
    x = torch.randn(64, 128)
    seed = make_mlp()
    xs = torch.randn(256, 10)

    def forward():
        with torch.no_grad():
            deep(x)

    def step():
        seed.zero_grad(set_to_none=True)
        seed(xs).sum().backward()

    return {"8-layer MLP forward": forward, "seed MLP plain step": step}


def sample(fns: dict, calls: int, into: dict, variant: str) -> None:
    for name, fn in fns.items():
        into.setdefault((name, variant), []).append(per_call_us(fn, calls))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore", ResourceWarning)  # (the dropped attachments' warnings)
    fns = workloads()
    other = nn.Linear(3, 2)
    times: dict = {}
    for fn in fns.values():  # warm-up
        per_call_us(fn, args.calls)
    entries = {"before any attach": global_entries()}
    for _ in range(args.rounds):
        sample(fns, args.calls, times, "before any attach")

    def alternate(suffix: str) -> None:
        for r in range(args.rounds):
            order = ["nothing attached", "one live attachment"]
            for variant in order if r % 2 == 0 else order[::-1]:
                if variant == "one live attachment":
                    with gradhooks.attach(other):
                        sample(fns, args.calls, times, variant + suffix)
                else:
                    sample(fns, args.calls, times, variant + suffix)

    alternate(" (before the cycles)")
    for i in range(args.cycles):
        gh = gradhooks.attach(nn.Linear(3, 2))
        if i % 2 == 0:
            gh.detach()
        del gh
    gc.collect()
    entries[f"after {args.cycles} cycles"] = global_entries()
    alternate(f" (after {args.cycles} cycles)")

    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"{args.rounds} rounds x {args.calls} calls, medians")
    print("global hook entries: " + ", ".join(f"{k}: {v}" for k, v in entries.items()))
    names = list(fns)
    print("| variant | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    base = {name: statistics.median(times[(name, "before any attach")]) for name in names}
    variants = list(dict.fromkeys(v for _, v in times))
    for variant in variants:
        cells = []
        for name in names:
            t = statistics.median(times[(name, variant)])
            cells.append(f"{t:.1f} us ({t / base[name] - 1:+.0%})")
        print(f"| {variant} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
