"""Book-keeping clipping with and without keeping the materialised per-sample gradients for the
clipped sum (``gradhooks.readers.plan.KEEP_OF_RECORDS``; issue 39, convolutions), alternated in
one process on one model: plain training, book-keeping with the default budget, and with none
(every clipped sum of a materialised weight formed again from the records). ``--two-pass``:
two-pass clipping (``gh.clipped_backward``) instead, whose first pass keeps them and whose
second pass then leaves those parameters out, against keeping none (the whole second backward).

    python benchmarks/keep_budget.py [--model resnet50] [--batch 16] [--repeats 5] [--smoke]
    python benchmarks/keep_budget.py --two-pass --model convnext-t

Prints medians (ms), the ratio of each to plain training and what each keeps (MB). Time only;
peak memory: ``benchmarks/scale.py --models resnet50 --methods bookkeeping``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from gradhooks.readers import plan as plan_module  # noqa: E402

import scale  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet50", choices=list(scale.MODELS))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--two-pass", action="store_true",
                   help="two-pass clipping (clipped_backward) instead of book-keeping")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = scale.MODELS[args.model]
    case = scale.ScaleCase(spec, args.batch, None if spec.kind == "image" else args.seq,
                           args.smoke, 0)
    scale.set_clip_norm(case)
    gh, model = case.attach(), case.model
    default = plan_module.KEEP_OF_RECORDS
    kept_mb = {}
    offer = plan_module.Forms.offer

    def spy(self, pid, t):  # (two-pass: one Forms per group of records)
        offer(self, pid, t)
        if self.kept.get(pid) is t:
            spy.bytes += t.numel() * t.element_size()
    plan_module.Forms.offer = spy

    def plain():
        with gh.recorder.suspended():
            case.loss(model(case.x)).backward()

    def clipping(keep):
        def run():
            plan_module.KEEP_OF_RECORDS = keep
            spy.bytes = 0
            if args.two_pass:
                gh.clipped_backward(scale.per_sample_loss(model(case.x), case.y), case.clip_norm)
            else:
                gh.backward(case.loss(model(case.x)))
                gh.clip_and_accumulate(case.clip_norm)
            kept_mb[keep] = spy.bytes / 2**20
        return run

    name = "two-pass" if args.two_pass else "book-keeping"
    budgets = {f"{name}, keep {default:g}": default, f"{name}, keep 0": 0.0}
    variants = {"plain": plain, **{k: clipping(v) for k, v in budgets.items()}}
    times = {k: [] for k in variants}
    for rep in range(args.repeats + 1):
        keys = list(variants)
        for key in keys[rep % len(keys):] + keys[:rep % len(keys)]:
            for q in model.parameters():
                q.grad = None
            ms = scale.timed_ms(case.device, variants[key])
            if rep:  # (the first round warms up)
                times[key].append(ms)
    plan_module.KEEP_OF_RECORDS = default
    base = statistics.median(times["plain"])
    print(f"{spec.title}, B = {args.batch}{' (smoke)' if args.smoke else ''}, "
          f"{torch.get_num_threads()} threads, medians of {args.repeats}")
    for key, ts in times.items():
        m = statistics.median(ts)
        extra = f", kept {kept_mb.get(budgets[key], 0):.0f} MB" if key in budgets else ""
        print(f"  {key:32s} {m:9.1f} ms  {m / base:5.2f}x{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
