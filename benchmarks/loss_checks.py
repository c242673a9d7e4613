"""What the loss checks of issue 29 cost: one GPT-2 step with the loss computed in the forward
(watched by ``gradhooks.core.analysis.token_means.Watch`` on untracked forwards) and outside it (looked
at by ``gradhooks.core.analysis.backward_losses`` from inside the backward), against plain training.

    python benchmarks/loss_checks.py [--repeats 15] [--threads 1] [--width 256] [--batch 8]

A GPT-2 language model from a config (random weights, float32, no dropout; ``--width`` hidden,
4 layers, vocab 8000, T = 64), an unpadded batch (equal counts: no refusal, so the read runs).
Variants, timed round robin after 2 warm-up steps each, one process, medians:

* ``plain in-forward``: ``model(ids, labels=ids).loss.backward()``, not attached;
* ``attached in-forward``: the same attached, then ``per_sample_grad_norms()``: the forward's
  loss ops watched (a ``TorchFunctionMode``, one Python call per torch op);
* ``plain outside``: ``F.cross_entropy(model(ids).logits ...).backward()``, not attached;
* ``attached outside``: the same attached, then ``per_sample_grad_norms()``: the backward's
  roots looked at (a frame walk and a graph walk per pass, a count over the logits' gradient),
  and the loss's graph after the model proven per sample (issue 38:
  ``gradhooks.core.analysis.loss_graph``);
* ``attached outside, graph not judged``: the same with that proof switched off (only here),
  so that its cost is the difference of the two; the proof alone (``judge`` on the loss's
  graph, before its backward) is also timed directly, in microseconds.

The ratio of interest is attached in-forward / attached outside (the watch's cost, the rest of
the step being the same) next to each one's ratio to its plain step.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import gradhooks  # noqa: E402

import zoo_imports  # noqa: E402  (torchvision in the CPU venv, see tests/zoo_imports.py)

V, T = 8000, 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    zoo_imports.import_torchvision()
    import transformers as tr
    torch.manual_seed(0)
    cfg = tr.GPT2Config(vocab_size=V, n_embd=args.width, n_layer=4, n_head=4, n_positions=T,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    model = tr.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, V, (args.batch, T), generator=torch.Generator().manual_seed(1))

    hooked = copy.deepcopy(model)  # (its own copy: the plain steps run on an unhooked model)
    gh = gradhooks.attach(hooked)

    def inside(m):
        m(ids, labels=ids).loss.backward()

    def outside(m):
        logits = m(ids).logits
        F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1)).backward()

    def plain(step):
        return lambda: step(model)

    def attached(step):
        def run():
            step(hooked)
            gh.per_sample_grad_norms()
        return run

    from gradhooks.core.analysis import judge
    from gradhooks.core.recorder.backward_pass import BackwardPass
    judged = BackwardPass.judge_graph

    def unjudged(step):
        def run():
            BackwardPass.judge_graph = lambda self, roots: None
            try:
                attached(step)()
            finally:
                BackwardPass.judge_graph = judged
        return run

    variants = {"plain in-forward": plain(inside), "attached in-forward": attached(inside),
                "plain outside": plain(outside), "attached outside": attached(outside),
                "attached outside, graph not judged": unjudged(outside)}
    times = {k: [] for k in variants}
    for k, run in variants.items():
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            hooked.zero_grad(set_to_none=True)
            run()
    for i in range(args.repeats):
        order = list(variants) if i % 2 == 0 else list(reversed(variants))
        for k in order:
            model.zero_grad(set_to_none=True)
            hooked.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            variants[k]()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"GPT-2 width {args.width}, 4 layers, vocab {V}, B = {args.batch}, T = {T}, float32, "
          f"{args.threads} thread(s), medians of {args.repeats}")
    print("| variant | ms | / its plain step |")
    print("|---|--:|--:|")
    for k in variants:
        plain = (med["plain " + k.split(" ", 1)[1].split(",")[0]] if k.startswith("attached")
                 else med[k])
        print(f"| {k} | {med[k]:.1f} | {med[k] / plain:.2f}x |")
    logits = hooked(ids).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
    spans, rows = gh.recorder.backward_pass.spans, torch.arange(args.batch)
    took = []
    for _ in range(101):
        t0 = time.perf_counter()
        found = judge(loss.grad_fn, spans, rows, 0)
        took.append(time.perf_counter() - t0)
    assert found is None, found
    loss.backward()
    print(f"the loss graph's proof alone: {statistics.median(took) * 1e6:.0f} us (median of 101)")
    print(f"watch cost: attached in-forward / attached outside = "
          f"{med['attached in-forward'] / med['attached outside']:.3f} "
          f"(plain in-forward / plain outside = {med['plain in-forward'] / med['plain outside']:.3f})")


if __name__ == "__main__":
    main()
