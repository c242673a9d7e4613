"""Which exact per-sample conv weight-gradient method is faster, per shape (backs the thresholds
CONV_METHOD_MAX_GROUP_WEIGHT / CONV_METHOD_MIN_POSITIONS in gradhooks/rules/conv.py).

    python benchmarks/conv_methods.py [--batch 64] [--repeats 10] [--threads 2]

Prints, for Conv2d(C, C, 3) on H x W inputs, the median time of the "unfold" and "conv" methods,
which one `choose_method` picks, and whether that is the faster one.
"""
import argparse
import statistics
import time

import torch
from torch import nn

from gradhooks.rules.conv import ConvRule, choose_method


def median_ms(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rule = ConvRule()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, B={args.batch}, medians of {args.repeats}")
    print("| C | groups | out HxW | unfold ms | conv ms | auto picks | right? |")
    print("|---|---|---|---|---|---|---|")
    for groups in (1, "C"):
        for hw in (6, 10, 14, 20, 28):
            for c in (16, 64, 128):
                g_ = c if groups == "C" else 1
                m = nn.Conv2d(c, c, 3, groups=g_)
                x = torch.randn(args.batch, c, hw, hw)
                g = torch.randn_like(m(x))
                times = {}
                for method in ("unfold", "conv"):
                    type(rule).method = method
                    times[method] = median_ms(lambda: rule.per_sample_grads(m, x, g, True, ("weight",)), args.repeats)
                type(rule).method = "auto"
                pick = choose_method(m, g[0, 0].numel())
                best = min(times, key=times.get)
                print(f"| {c} | {g_} | {hw - 2}x{hw - 2} | {times['unfold']:.2f} | {times['conv']:.2f} | {pick} | "
                      f"{'yes' if pick == best else 'no'} |")


if __name__ == "__main__":
    main()
