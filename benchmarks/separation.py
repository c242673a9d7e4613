"""Cost of "exact or refused" (issue 38, points 1-2) at real size: the first step of a structure
against the steady state, beside plain training, in one process.

    PYTHONPATH=CHECKOUT python benchmarks/separation.py [--models gpt2,vit-b16] [--batch 16]
        [--seq 128] [--repeats 3] [--threads 2] [--smoke] [--out benchmarks/results/separation.md]

Per model (``benchmarks/scale.py``'s builders: GPT-2 small, ViT-B/16 at 224x224), round robin,
medians of ``--repeats``:

* ``plain``: forward, ``loss.backward()`` (no hooks);
* ``steady``: forward, ``gh.backward(losses.mean())`` of the ``(B,)`` per-sample losses and
  ``gh.per_sample_grad_norms()`` on a known structure (after three steps: the signature's first,
  analysed, and two planned forwards of the same structure): the signature's plan followed (no
  provenance, each forward's ops fingerprinted), the sample check passed -- what training
  pays on every step;
* ``steady, checks skipped``: the same with ``attach(..., unsafe_skip_sample_check=True)``: the
  steady state without point 2's bookkeeping, to show it costs nothing;
* ``first step``: the same step on a structure seen for the first time (signatures and the
  sample check's record forgotten before each repeat): the forward tracked by provenance (the
  whitelist's verdicts, point 1), the forward-alone check where an op needs it, and the sample
  check through the batched graph (point 2: two masked backward passes, one weighted one, one norm
  read and one weighted-sum read).

The machine is noisy: the ratios to ``plain`` in one process are what to compare.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import scale  # noqa: E402  (benchmarks/scale.py: the real-size builders, batches and losses)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def measure(name: str, batch: int, seq: int, repeats: int, smoke: bool) -> dict:
    import gradhooks

    spec = scale.MODELS[name]
    model, info = spec.build(smoke)
    model = scale.prepare(model)
    x, y = scale.make_batch(spec, info, batch, min(seq, 32) if smoke else seq, seed=0)

    def plain():
        model.zero_grad(set_to_none=True)
        scale.loss_fn(model(x), y).backward()

    def hooked(gh, first):
        def step():
            if first:
                gh.recorder.placement.forget_signatures()
                gh.recorder.sample_checked.clear()
            gh.backward(scale.per_sample_loss(model(x), y).mean())
            gh.per_sample_grad_norms()
        return step

    variants = {
        "plain": (None, plain),
        "steady": (dict(), False),
        "steady, checks skipped": (dict(unsafe_skip_sample_check=True), False),
        "first step": (dict(), True),
    }
    times = {k: [] for k in variants}
    for r in range(repeats + 1):  # (the first round warms up, not counted)
        for key, (options, first) in variants.items():
            if options is None:
                t = _timed(plain)
            else:
                with gradhooks.attach(model, **options) as gh:  # (attached per round)
                    hooked(gh, True)()  # (its first step: tracked, checked)
                    for _ in range(2):  # (the first planned forward, whose count of autograd
                        hooked(gh, False)()  # nodes is new: checked; the next one, analysed)
                    t = _timed(hooked(gh, first))
            if r:
                times[key].append(t)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt2,vit-b16")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="tiny configs (a minute)")
    p.add_argument("--out", default=None, help="also write the table here (markdown)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    lines = ["| model | B x T | plain (ms) | steady | steady, checks skipped | first step "
             "| first step - steady (ms) |", "|---|---|--:|--:|--:|--:|--:|"]
    for name in a.models.split(","):
        m = measure(name, a.batch, a.seq, a.repeats, a.smoke)
        base = m["plain"]
        shape = f"{a.batch}" + (f" x {a.seq}" if scale.MODELS[name].kind != "image" else "")
        lines.append(f"| {scale.MODELS[name].title} | {shape} | {base:.0f} | "
                     f"{m['steady'] / base:.2f}x | {m['steady, checks skipped'] / base:.2f}x | "
                     f"{m['first step'] / base:.2f}x | {m['first step'] - m['steady']:.0f} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(f"# Cost of exact-or-refused (issue 38, points 1-2)\n\n`python benchmarks/"
                    f"separation.py {' '.join(argv if argv is not None else sys.argv[1:])}`, "
                    f"torch {torch.__version__}, {a.threads} threads, medians of {a.repeats}, "
                    f"ratios to plain forward + loss.backward() in one process.\n\n{text}\n")


if __name__ == "__main__":
    main()
