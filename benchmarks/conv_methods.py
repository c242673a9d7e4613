"""Which exact per-sample conv weight-gradient method is faster, per shape (backs the thresholds
CONV_METHOD_SMALL_WEIGHT / CONV_METHOD_WEIGHT_PER_POSITION and the pointwise rule in
gradhooks/rules/conv.py).

    python benchmarks/conv_methods.py [--batch 64] [--repeats 10] [--threads 2]
    python benchmarks/conv_methods.py --pointwise [--batch 16] [--repeats 5]

Prints, for Conv2d(C, C, 3) on H x W inputs, the median time of the "unfold" and "conv" methods,
which one `choose_method` picks, and whether that is the faster one. ``--pointwise``: the 1x1
convolutions of ResNet-50 at 224 x 224 instead (the two methods alternated in each repeat, so a
loaded machine slows both alike), with the batch's plain weight gradient (torch's kernel, what
plain training computes) as the yardstick.
"""
import argparse
import statistics
import time

import torch
from torch import nn

from gradhooks.rules.conv import (
    ConvRule,
    _pointwise_weighted,
    choose_method,
    pad_as_torch,
    weight_backward,
)

# ResNet-50's 1x1 convolutions at 224 x 224: (C_in, C_out, stride, input H = W)
POINTWISE = [(64, 64, 1, 56), (64, 256, 1, 56), (256, 64, 1, 56), (256, 128, 1, 56),
             (256, 512, 2, 56), (128, 512, 1, 28), (512, 128, 1, 28), (512, 256, 1, 28),
             (512, 1024, 2, 28), (256, 1024, 1, 14), (1024, 256, 1, 14), (1024, 512, 1, 14),
             (1024, 2048, 2, 14), (512, 2048, 1, 7), (2048, 512, 1, 7)]


def median_ms(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def pointwise(args):
    rule = ConvRule()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, B={args.batch}, medians "
          f"of {args.repeats}, methods alternated per repeat")
    print("| C_in | C_out | stride | out HxW | weighted sum: conv kernel ms | per-sample matmuls ms | "
          "per-sample unfold ms | per-sample conv ms | conv / unfold |")
    print("|---|---|---|---|---|---|---|---|---|")
    for cin, cout, stride, hw in POINTWISE:
        m = nn.Conv2d(cin, cout, 1, stride=stride, bias=False)
        x = torch.randn(args.batch, cin, hw, hw)
        g = torch.randn_like(m(x))
        xp, pad = pad_as_torch(m, x)

        def per_sample(method):
            type(rule).method = method
            return lambda: rule.per_sample_grads(m, x, g, True, ("weight",))

        c = torch.rand(args.batch)
        fns = {"plain": lambda: weight_backward(m, xp, g * c.view(-1, 1, 1, 1), pad,
                                                per_sample=False),
               "matmul": lambda: _pointwise_weighted(m, x, g, c),
               "unfold": per_sample("unfold"), "conv": per_sample("conv")}
        times = {k: [] for k in fns}
        for k, fn in fns.items():
            per_sample(k)() if k in ("unfold", "conv") else fn()  # warm-up
        for _ in range(args.repeats):
            for k, fn in fns.items():
                if k in ("unfold", "conv"):
                    type(rule).method = k
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
        type(rule).method = "auto"
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"| {cin} | {cout} | {stride} | {hw // stride}x{hw // stride} | {med['plain']:.1f} | "
              f"{med['matmul']:.1f} | {med['unfold']:.1f} | {med['conv']:.1f} | {med['conv'] / med['unfold']:.2f} |",
              flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pointwise", action="store_true",
                    help="ResNet-50's 1x1 convolutions (use --batch 16)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.pointwise:
        return pointwise(args)
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
