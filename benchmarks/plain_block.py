"""Per-sample gradients of a pre-LN Transformer block written with plain tensor ops: gradhooks
against ExpandedWeights (torch's ``call_for_per_sample_grads`` and Opacus' ``grad_sample_mode
="ew"``), Opacus' hooks and torch.func, side by side in one process.

    python benchmarks/plain_block.py [--repeats 30] [--threads 2]

The block (issue "DP-SGD at the cost of plain training", its per-sample target): LayerNorm,
``Linear(d, 3d)`` for q/k/v, softmax attention with ``@`` over 4 heads, ``Linear(d, d)``,
LayerNorm, a GELU MLP 128-512-128, mean pooling over the tokens, ``Linear(d, 10)``; B = 16,
T = 64, d = 128, Gaussian inputs, cross-entropy (mean). Every method's per-sample gradients are
checked against gradhooks' (float32, 1e-4 of the largest entry) before timing. Methods run round
robin (the start rotates), after 3 warm-up steps each; the table gives medians and the ratio to
plain ``loss.backward()`` of the same run. A step is what a training loop pays: forward,
backward and the per-sample read.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

import gradhooks

B, T, D, HEADS = 16, 64, 128, 4


class PlainBlock(nn.Module):
    """Pre-LN block with plain tensor ops (no ``nn.MultiheadAttention``), mean-pooled, with a
    10-class head: ``(B, T, D) -> (B, 10)``."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.head = nn.Linear(D, 10)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-1, -2) / (D // HEADS) ** 0.5, -1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, D))
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return self.head(x.mean(1))


def methods(model, x, y):
    """name -> (step, read): ``step()`` runs one training step's per-sample work, ``read()``
    returns its per-sample gradients ``{name: (B, *shape)}``."""
    out = {}
    params = [p for p in model.parameters()]

    def zero():
        for p in params:
            p.grad = None

    def plain():
        zero()
        F.cross_entropy(model(x), y).backward()
    out["plain"] = (plain, None)

    m_gh = copy.deepcopy(model)
    gh = gradhooks.attach(m_gh)
    state = {}

    def gh_step():
        gh.backward(F.cross_entropy(m_gh(x), y))
        state["gh"] = gh.per_sample_grads()
    out["gradhooks"] = (gh_step, lambda: state["gh"])

    from torch.nn.utils._per_sample_grad import call_for_per_sample_grads
    m_ew = copy.deepcopy(model)

    def ew_step():
        for p in m_ew.parameters():
            p.grad, p.grad_sample = None, None
        F.cross_entropy(call_for_per_sample_grads(m_ew, batch_size=B, loss_reduction="mean")(x),
                        y).backward()
    out["ExpandedWeights (torch)"] = (ew_step, lambda: {
        n: p.grad_sample for n, p in m_ew.named_parameters()})

    try:
        from opacus.grad_sample.utils import wrap_model
        for mode in ("ew", "hooks"):
            gsm = wrap_model(copy.deepcopy(model), grad_sample_mode=mode, batch_first=True,
                             loss_reduction="mean")

            def op_step(gsm=gsm):
                gsm.zero_grad(set_to_none=True)
                F.cross_entropy(gsm(x), y).backward()
            out[f"Opacus {mode}"] = (op_step, lambda gsm=gsm: {
                n.removeprefix("_module."): p.grad_sample for n, p in gsm.named_parameters()})
    except Exception as e:  # noqa: BLE001 (reported, not timed)
        out["Opacus"] = (None, repr(e))

    fparams = {k: v.detach() for k, v in model.named_parameters()}

    def one(p, xi, yi):
        return F.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    def vmap_step():
        state["vmap"] = vmap(grad(one), in_dims=(None, 0, 0))(fparams, x, y)
    out["torch.func vmap"] = (vmap_step, lambda: state["vmap"])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = PlainBlock()
    x, y = torch.randn(B, T, D), torch.randint(0, 10, (B,))
    ms = methods(model, x, y)
    runnable = {}
    ref = None
    for name, (step, read) in ms.items():
        if step is None:
            print(f"{name}: fails ({read})")
            continue
        try:
            step()
            got = read() if read is not None else None
        except Exception as e:  # noqa: BLE001
            print(f"{name}: fails ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
            continue
        if got is not None:
            ref = ref or got
            worst = max(((got[n] - ref[n]).abs().max() / ref[n].abs().max()).item() for n in ref)
            if worst > 1e-4:
                print(f"{name}: differs from gradhooks by {worst:.1e} (relative); not timed")
                continue
        runnable[name] = step
    times = {n: [] for n in runnable}
    names = list(runnable)
    for n in names:
        for _ in range(3):
            runnable[n]()
    for r in range(args.repeats):
        for n in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            runnable[n]()
            times[n].append(time.perf_counter() - t0)
    plain = statistics.median(times["plain"])
    print(f"| method | ms (median of {args.repeats}) | x plain |")
    print("|---|--:|--:|")
    for n in names:
        med = statistics.median(times[n])
        print(f"| {n} | {med * 1e3:.2f} | {med / plain:.2f}x |")


if __name__ == "__main__":
    main()
