"""Which exact per-sample conv weight-gradient method is faster, per shape (backs the thresholds
CONV_METHOD_SMALL_WEIGHT / CONV_METHOD_WEIGHT_PER_POSITION and the pointwise rule in
gradhooks/rules/conv.py).

    python benchmarks/conv_methods.py [--batch 64] [--repeats 10] [--threads 2]
    python benchmarks/conv_methods.py --pointwise [--batch 16] [--repeats 5]
    python benchmarks/conv_methods.py --depthwise [--batch 16] [--repeats 5]

Prints, for Conv2d(C, C, 3) on H x W inputs, the median time of the "unfold" and "conv" methods,
which one `choose_method` picks, and whether that is the faster one. ``--pointwise``: the 1x1
convolutions of ResNet-50 at 224 x 224 instead (the two methods alternated in each repeat, so a
loaded machine slows both alike), with the batch's plain weight gradient (torch's kernel, what
plain training computes) as the yardstick. ``--depthwise``: the depthwise convolutions of
ConvNeXt-T and EfficientNet-B0 and the dense convolutions of ResNet-50, ConvNeXt-T and the stems
at 224 x 224, per-sample by the three methods ("conv", "unfold", "correlation"; alternated in
each repeat), with what ``"auto"`` picks (backs ``depthwise`` in gradhooks/rules/conv.py).
"""
import argparse
import statistics
import time

import torch
from torch import nn

from gradhooks.rules.conv import (
    ConvRule,
    _pointwise_weighted,
    auto_method,
    choose_method,
    pad_as_torch,
    weight_backward,
)

# ResNet-50's 1x1 convolutions at 224 x 224: (C_in, C_out, stride, input H = W)
POINTWISE = [(64, 64, 1, 56), (64, 256, 1, 56), (256, 64, 1, 56), (256, 128, 1, 56),
             (256, 512, 2, 56), (128, 512, 1, 28), (512, 128, 1, 28), (512, 256, 1, 28),
             (512, 1024, 2, 28), (256, 1024, 1, 14), (1024, 256, 1, 14), (1024, 512, 1, 14),
             (1024, 2048, 2, 14), (512, 2048, 1, 7), (2048, 512, 1, 7)]

# (model, C_in, C_out, kernel, stride, padding, groups, input H = W): depthwise convolutions of
# ConvNeXt-T (7x7) and EfficientNet-B0 (3x3 / 5x5), then dense ones (stems, ConvNeXt's 2x2
# downsampling, ResNet-50's 3x3)
SHAPES = ([("ConvNeXt-T", c, c, 7, 1, 3, c, h) for c, h in ((96, 56), (192, 28), (384, 14), (768, 7))]
          + [("EfficientNet-B0", c, c, k, s, k // 2, c, h) for c, h, k, s in (
              (32, 112, 3, 1), (96, 112, 3, 2), (144, 56, 3, 1), (144, 56, 5, 2), (240, 28, 5, 1),
              (240, 28, 3, 2), (480, 14, 3, 1), (480, 14, 5, 1), (672, 14, 5, 1), (672, 14, 5, 2),
              (1152, 7, 5, 1), (1152, 7, 3, 1))]
          + [("ConvNeXt-T", 3, 96, 4, 4, 0, 1, 224), ("ConvNeXt-T", 96, 192, 2, 2, 0, 1, 56),
             ("ConvNeXt-T", 192, 384, 2, 2, 0, 1, 28), ("ConvNeXt-T", 384, 768, 2, 2, 0, 1, 14),
             ("EfficientNet-B0", 3, 32, 3, 2, 1, 1, 224), ("ResNet-50", 3, 64, 7, 2, 3, 1, 224)]
          + [("ResNet-50", c, c, 3, s, 1, 1, h) for c, h, s in (
              (64, 56, 1), (128, 56, 2), (128, 28, 1), (256, 28, 2), (256, 14, 1), (512, 14, 2),
              (512, 7, 1))])


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


def depthwise(args):
    rule = ConvRule()
    methods = ("conv", "unfold", "correlation")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, B={args.batch}, medians "
          f"of {args.repeats}, methods alternated per repeat")
    print("| model | C_in | C_out | kernel | stride | groups | in HxW | conv ms | unfold ms | "
          "correlation ms | auto picks | auto / best |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model, cin, cout, k, stride, pad, groups, hw in SHAPES:
        m = nn.Conv2d(cin, cout, k, stride=stride, padding=pad, groups=groups, bias=False)
        x = torch.randn(args.batch, cin, hw, hw)
        with torch.no_grad():
            g = torch.randn_like(m(x))
        times = {k_: [] for k_ in methods}
        for _ in range(args.repeats + 1):  # (the first round warms up)
            for method in methods:
                type(rule).method = method
                t0 = time.perf_counter()
                rule.per_sample_grads(m, x, g, True, ("weight",))
                times[method].append(time.perf_counter() - t0)
        type(rule).method = "auto"
        med = {k_: statistics.median(v[1:]) * 1e3 for k_, v in times.items()}
        pick = auto_method(m, x, g[0, 0].numel())
        print(f"| {model} | {cin} | {cout} | {k} | {stride} | {groups} | {hw}x{hw} | {med['conv']:.1f} | "
              f"{med['unfold']:.1f} | {med['correlation']:.1f} | {pick} | "
              f"{med[pick] / min(med.values()):.2f} |", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pointwise", action="store_true",
                    help="ResNet-50's 1x1 convolutions (use --batch 16)")
    ap.add_argument("--depthwise", action="store_true",
                    help="depthwise and dense convolutions of ConvNeXt-T, EfficientNet-B0 and "
                         "ResNet-50, three methods (use --batch 16)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.pointwise:
        return pointwise(args)
    if args.depthwise:
        return depthwise(args)
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
