"""Cost of forward separation (issue 38, points 1-2) on a GPT-2 of reduced size.

    PYTHONPATH=CHECKOUT python benchmarks/separation.py [--layers 4] [--width 256] [--batch 8]
        [--tokens 64] [--repeats 5] [--threads 2]

Run it once per checkout (the base and the change) on the same machine and compare:

* ``tracked step``: forward (tracked by provenance: the signatures are forgotten before each
  step, so every forward is a signature's first), backward and per-sample norms; the whitelist's
  verdicts run here;
* ``steady step``: the same step on a known signature (no tracking), what training pays;
* ``forward check``: :func:`gradhooks.core.alone.forward_alone` on the batch (what a signature
  with an op no rule proves pays once: one batched forward without gradient in training mode and
  three forwards of one sample), where the checkout has it.

Prints the median of ``--repeats`` timings of each, in milliseconds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _median(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    a = parser.parse_args()
    torch.set_num_threads(a.threads)
    import transformers
    import gradhooks
    from zoo_imports import TokensToLogits

    cfg = transformers.GPT2Config(vocab_size=1000, n_embd=a.width, n_layer=a.layers,
                                  n_head=a.width // 64, n_positions=a.tokens)
    torch.manual_seed(0)
    model = TokensToLogits(transformers.GPT2LMHeadModel(cfg)).train()
    ids = torch.randint(0, 1000, (a.batch, a.tokens))

    def step(gh, forget):
        if forget:
            gh.recorder.placement.forget_signatures()
        model.zero_grad()
        out = model(ids)
        F.cross_entropy(out.reshape(-1, out.shape[-1]), ids.reshape(-1)).backward()
        gh.per_sample_grad_norms()

    with gradhooks.attach(model) as gh:
        for _ in range(2):
            step(gh, True)
        tracked = _median(lambda: step(gh, True), a.repeats)
        steady = _median(lambda: step(gh, False), a.repeats)
    print(f"gradhooks {gradhooks.__file__}")
    print(f"GPT-2 layers={a.layers} width={a.width} B={a.batch} T={a.tokens} "
          f"threads={a.threads}")
    print(f"tracked step  {tracked:8.1f} ms")
    print(f"steady step   {steady:8.1f} ms")
    try:
        from gradhooks.core.alone import forward_alone
    except ImportError:
        return
    with torch.no_grad():
        out = model(ids)
    check = _median(lambda: forward_alone(model, (ids,), {}, out, a.batch, 0,
                                          lambda t: 0), a.repeats)
    passed, why = forward_alone(model, (ids,), {}, out, a.batch, 0, lambda t: 0)
    print(f"forward check {check:8.1f} ms (passed: {passed} {why})")


if __name__ == "__main__":
    main()
