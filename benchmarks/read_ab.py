"""A change of a rule's math toggled per call against its earlier form, alternated in one
process on ResNet-50 (issue 39): the norms read alone (``per_sample_grad_norms()`` after
``gh.backward``) and the whole book-keeping step, each timed step right after an untimed one of
the same variant (a step that follows a lighter one pays for the pages that one returned to the
system). The changes (``--change``):

* ``batchnorm``: BatchNorm's per-sample gradients (eval mode) by torch's fused batch-norm
  backward over ``(sample, channel)`` pairs, against the earlier form (``x_hat`` formed,
  multiplied by ``g``, summed);
* ``pixel-gram``: the Gram form's patch Gram matrix of a convolution from its input's pixels
  (:func:`gradhooks.rules.conv.patch_gram`, where its cost model finds it cheaper), against
  the unfolded patches' product.

    python benchmarks/read_ab.py --change pixel-gram [--batch 16] [--repeats 5] [--smoke]

Prints medians (ms) per variant and the plain step's.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from gradhooks.rules import conv  # noqa: E402
from gradhooks.rules.norm import BatchNormRule  # noqa: E402

import scale  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--change", choices=("batchnorm", "pixel-gram"), default="pixel-gram")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    case = scale.ScaleCase(scale.MODELS["resnet50"], args.batch, None, args.smoke, 0)
    scale.set_clip_norm(case)
    gh, model = case.attach(), case.model
    fused, pixels = BatchNormRule.uses_running_stats, conv.patch_gram_cost

    def use(variant: str) -> None:
        new = variant == "new"
        if args.change == "batchnorm":
            BatchNormRule.uses_running_stats = fused if new else lambda self, module: False
        else:
            conv.patch_gram_cost = pixels if new else lambda module, shape: None
            gh.recorder.memo.clear()  # (the norm plan, made per structure, follows the cost)

    def plain():
        with gh.recorder.suspended():
            case.loss(model(case.x)).backward()

    def norms_read():
        gh.backward(case.loss(model(case.x)))
        t0 = time.perf_counter()
        gh.per_sample_grad_norms()
        gh.clear()
        return time.perf_counter() - t0

    def bookkeeping():
        gh.backward(case.loss(model(case.x)))
        gh.clip_and_accumulate(case.clip_norm)

    def timed(fn):
        for q in model.parameters():
            q.grad = None
        fn()  # (settles: the timed call follows one of its own)
        for q in model.parameters():
            q.grad = None
        t0 = time.perf_counter()
        inner = fn()
        return inner if inner is not None else time.perf_counter() - t0

    times = {k: [] for k in ("plain", "norms read, new", "norms read, before",
                             "book-keeping, new", "book-keeping, before")}
    for rep in range(args.repeats + 1):
        runs = [("plain", None, plain)]
        for variant in (("new", "before") if rep % 2 == 0 else ("before", "new")):
            runs += [(f"norms read, {variant}", variant, norms_read),
                     (f"book-keeping, {variant}", variant, bookkeeping)]
        for key, variant, fn in runs:
            if variant is not None:
                use(variant)
            ms = timed(fn) * 1e3
            if rep:  # (the first round warms up)
                times[key].append(ms)
    use("new")
    base = statistics.median(times["plain"])
    print(f"{args.change}: {case.spec.title}, B = {args.batch}{' (smoke)' if args.smoke else ''}, "
          f"{torch.get_num_threads()} threads, medians of {args.repeats}")
    for key, ts in times.items():
        m = statistics.median(ts)
        print(f"  {key:24s} {m:9.1f} ms  {m / base:5.2f}x of plain's step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
