"""The per-layer choice between the Gram ("ghost") norm and the materialised per-sample
gradient, measured on this machine against the cost models that could make it.

    python benchmarks/norm_cost.py [--repeats 15] [--threads 2]

For a Linear layer's records ``a`` ``(N, S, I)`` and ``g`` ``(N, S, O)`` (N = 32) over a grid of
positions ``S`` and fan-in / fan-out ``I``, ``O``, times the two ways gradhooks forms the
per-sample squared norms ``||dW_n||^2`` (``gradhooks.readers.norms``):

* Gram: ``(a a^T) * (g g^T)`` summed, ``N S^2 (I + O)`` multiply-adds, ``2 N S^2`` values
  written;
* materialised: ``dW_n = g_n^T a_n`` then its squared sum, ``N S I O`` multiply-adds and
  ``N I O`` values written (and read back).

It fits ``t = flops / F + bytes / W + c`` to each form (least squares on the grid: the rates
behind ``gradhooks.readers.norms.BYTE_COST``), then reports how often each rule picks the faster form
and what the wrong picks cost: the FLOP count alone (Li et al. 2022's ``S (I + O) < I O``) and
gradhooks' ``use_gram`` (FLOPs plus the bytes of tensors beyond ``MEMORY_BOUND``). Medians of
``--repeats``.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch

from gradhooks.readers.plan import use_gram


def gram(a, g):
    return (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(g, g.transpose(1, 2))).sum((1, 2))


def materialised(a, g):
    return torch.bmm(g.transpose(1, 2), a).pow(2).sum((1, 2))


def timed(fn, repeats):
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n = 32
    rows = []
    for s, (i, o) in itertools.product((8, 16, 32, 64, 128, 256),
                                       ((64, 64), (128, 128), (128, 512), (512, 128), (512, 512),
                                        (768, 768), (32, 256))):
        a, g = torch.randn(n, s, i), torch.randn(n, s, o)
        tg = timed(lambda: gram(a, g), args.repeats)
        tm = timed(lambda: materialised(a, g), args.repeats)
        rows.append(dict(S=s, I=i, O=o, gram=tg, mat=tm,
                         gram_flops=n * s * s * (i + o), gram_bytes=4 * 2 * n * s * s,
                         mat_flops=n * s * i * o, mat_bytes=4 * 2 * n * i * o))
    # fit t = flops / F + bytes / W + c per form (least squares)
    fits = {}
    for form in ("gram", "mat"):
        x = torch.tensor([[r[f"{form}_flops"], r[f"{form}_bytes"], 1.0] for r in rows],
                         dtype=torch.float64)
        y = torch.tensor([r[form] for r in rows], dtype=torch.float64)
        fits[form] = torch.linalg.lstsq(x, y[:, None]).solution[:, 0]

    def predict(form, r):
        k = fits[form]
        return float(k[0] * r[f"{form}_flops"] + k[1] * r[f"{form}_bytes"] + k[2])

    print(f"fitted: Gram {1 / fits['gram'][0] / 1e9:.0f} G multiply-adds/s, "
          f"{1 / fits['gram'][1] / 1e9 if fits['gram'][1] > 0 else float('inf'):.1f} GB/s; "
          f"materialised {1 / fits['mat'][0] / 1e9:.0f} G multiply-adds/s, "
          f"{1 / fits['mat'][1] / 1e9 if fits['mat'][1] > 0 else float('inf'):.1f} GB/s")
    print()
    print("| S | I | O | Gram ms | materialised ms | faster | FLOPs picks | use_gram picks |")
    print("|--:|--:|--:|--:|--:|---|---|---|")
    lost = {"flops": [], "bytes": []}
    for r in rows:
        best = "gram" if r["gram"] <= r["mat"] else "mat"
        by_flops = "gram" if r["S"] * (r["I"] + r["O"]) < r["I"] * r["O"] else "mat"
        by_bytes = "gram" if use_gram(r["S"], r["I"], r["O"], batch=n) else "mat"
        for key, pick in (("flops", by_flops), ("bytes", by_bytes)):
            lost[key].append(r[pick] / r[best])
        print(f"| {r['S']} | {r['I']} | {r['O']} | {r['gram'] * 1e3:.2f} | {r['mat'] * 1e3:.2f} "
              f"| {best} | {by_flops}{'' if by_flops == best else ' (wrong)'} "
              f"| {by_bytes}{'' if by_bytes == best else ' (wrong)'} |")
    print()
    for key, label in (("flops", "FLOPs only"), ("bytes", "use_gram (FLOPs + bytes)")):
        wrong = [x for x in lost[key] if x > 1.0]
        print(f"{label}: {len(wrong)} of {len(rows)} picks slower than the best, "
              f"worst {max(lost[key]):.2f}x, total time {sum(lost[key]) / len(rows):.3f}x the best")


if __name__ == "__main__":
    main()
