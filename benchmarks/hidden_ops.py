"""Cost of hashing the ops a forward runs without gradient (issue 38:
``gradhooks.core.analysis.hidden.HiddenOps``), on the models that pay it, in one process.

    PYTHONPATH=CHECKOUT python benchmarks/hidden_ops.py [--batch 8] [--seq 128] [--repeats 5]
        [--threads 2] [--smoke] [--out benchmarks/results/hidden_ops.md]

A custom ``autograd.Function``'s forward and a reentrant checkpoint run their ops without
gradient: the autograd graph holds them as one node, so the
fingerprint of a planned forward cannot see them change. gradhooks hashes them (a
``TorchFunctionMode`` around the forward) on every forward of an input signature whose analysed
forward ran any; models that run none (GPT-2, BERT, ViT, Llama as configured) never enter it.
The workload here is the worst case: GPT-2 small with transformers' gradient checkpointing,
reentrant (``use_reentrant=True``), where every op of every block runs without gradient in the
forward (and is recomputed with gradient in the backward). Round robin, medians of
``--repeats``:

* ``plain``: forward, ``loss.backward()`` (no hooks);
* ``plain + hashing``: the same, the mode active around the forward: what the hashing adds;
* ``gradhooks steady``: attached, forward, ``loss.backward()``, ``per_sample_grad_norms()`` on a
  known structure (its planned forwards hashed).

The machine is noisy: the ratios to ``plain`` in one process are what to compare.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from separation import _timed  # noqa: E402  (one call's wall time, ms)

import scale  # noqa: E402  (benchmarks/scale.py: the real-size builders, batches and losses)


def measure(batch: int, seq: int, repeats: int, smoke: bool) -> dict:
    import gradhooks
    from gradhooks.core.analysis.hidden import HiddenOps

    spec = scale.MODELS["gpt2"]
    model, info = spec.build(smoke)
    model = scale.prepare(model)
    inner = getattr(model, "model", model)  # (scale wraps the transformers model: ids -> logits)
    inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    x, y = scale.make_batch(spec, info, batch, min(seq, 32) if smoke else seq, seed=0)
    counted = {}

    def plain():
        model.zero_grad(set_to_none=True)
        scale.loss_fn(model(x), y).backward()

    def hashed():
        model.zero_grad(set_to_none=True)
        with HiddenOps() as mode:
            out = model(x)
        counted["ops"] = mode.count
        scale.loss_fn(out, y).backward()

    gh = gradhooks.attach(model)

    def steady():
        model.zero_grad(set_to_none=True)
        scale.loss_fn(model(x), y).backward()
        gh.per_sample_grad_norms()

    variants = {"plain": plain, "plain + hashing": hashed, "gradhooks steady": steady}
    times = {k: [] for k in variants}
    try:
        with gh.recorder.suspended():
            plain()
        for _ in range(3):  # (the signature's first forward, analysed; then planned ones)
            steady()
        signature = gh.recorder.placement.signature
        hashing = signature in gh.recorder.sum_check._hidden
        for r in range(repeats + 1):  # (the first round warms up, not counted)
            for key, fn in variants.items():
                if key == "gradhooks steady":
                    t = _timed(fn)
                else:
                    with gh.recorder.suspended():
                        t = _timed(fn)
                if r:
                    times[key].append(t)
    finally:
        gh.detach()
    out = {k: statistics.median(v) for k, v in times.items()}
    out["ops"], out["hashing"] = counted["ops"], hashing
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="tiny config (seconds)")
    p.add_argument("--out", default=None, help="also write the table here (markdown)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    r = measure(a.batch, a.seq, a.repeats, a.smoke)
    base = r["plain"]
    lines = [f"GPT-2 small{' (smoke)' if a.smoke else ''}, reentrant gradient checkpointing, "
             f"B x T = {a.batch} x {a.seq}; torch {torch.__version__}, {a.threads} threads, "
             f"medians of {a.repeats}; ops hashed per forward: {r['ops']}; the attachment's "
             f"planned forwards hashed: {r['hashing']}", "",
             "| variant | ms | x plain |", "|---|--:|--:|"]
    for key in ("plain", "plain + hashing", "gradhooks steady"):
        lines.append(f"| {key} | {r[key]:.0f} | {r[key] / base:.3f} |")
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write("# Hashing the ops a forward runs without gradient\n\n"
                    "`python benchmarks/hidden_ops.py`\n\n" + text + "\n")


if __name__ == "__main__":
    main()
