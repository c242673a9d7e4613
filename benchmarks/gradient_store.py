"""The projected gradient store (gradhooks.readers.attribution.gradient_store): its cost per batch against a
plain training step on GPT-2 small, and its features against traker's (TRAK 0.3.2) on the same
model (CPU, float32, one process, alternating variants, medians).

    python benchmarks/gradient_store.py --part gpt2 [--repeats 3] [--batch 8] [--seq 128]
    python benchmarks/gradient_store.py --part traker [--train 1500] [--queries 100]
    python benchmarks/gradient_store.py                      # both, writes benchmarks/results/gradient_store.md

Part ``gpt2`` (``transformers.GPT2Config()`` defaults: 12 layers, n_embd 768, random weights,
eval mode, random token ids, B x T tokens, per-sample loss = mean token cross-entropy):

* ``plain``: a training step of the whole model: forward, ``loss.backward()``, ``AdamW.step()``;
* ``plain_frozen_emb``: the same with the token and position embeddings frozen (the parameters
  the store covers);
* ``store``: one batch into a float16 :class:`GradientStore` (``k_in = k_out = 16``: LoGra's
  default, ``K = 256`` per layer): hooked forward, ``gh.backward``, the factored projection of the
  48 ``Conv1D`` layers and 25 LayerNorms' per-sample gradients, the write to the memory map;
* ``store_less``: the same with LESS's Adam transform (per-sample matrices formed and projected).

The embeddings are frozen for the store: a dense projection of the tied 50257 x 768 token
embedding (``R`` of 256 x 38.6M entries) does not fit in memory; LoGra, LESS and TRAK's LM runs
likewise leave it out. Peak memory: one subprocess per variant (``ru_maxrss``).

Part ``traker`` (scikit-learn's digits, an MLP 64-128-10 trained briefly, TRAK's margin output,
``N`` train / ``M`` query samples): the exact per-sample margin gradients ``J`` ``(N, P)`` in
float64 (``torch.func``, neither tool's code), then each tool's projected features ``Φ``
``(N, K)`` at the same ``K`` (gradhooks ``k_in = k_out = 32``, 2 layers: ``K = 2048``; traker
``proj_dim = 2048``, float32) and projected queries ``q``; and gradhooks at ``k_in = k_out = 64``
(``K = 8192``), to show its LoGra (Kronecker) projection converging. Projection-independent statistics:

* the Gram matrix: relative Frobenius error of ``s Φ Φ^T`` against ``J J^T``, ``s`` the best
  scalar (traker's Gaussian projection is not scaled by ``1/sqrt(K)``: ``s`` about ``1/K``);
* Spearman rank correlation (mean over queries) of the inner products ``q Φ^T`` against the
  exact ``q_J J^T``;
* TRAK's scores with a ridge, ``q (Φ^T Φ + λ I)^{-1} Φ^T diag(Q)``, against the exact ones,
  ``q_J J^T (J J^T + λ I)^{-1} diag(Q)`` (the same by the push-through identity), and between
  the tools; ``λ = 0.01 tr(Φ Φ^T) / N`` per tool (``K > N`` here, so traker's default
  ``λ = 0`` would invert a singular ``Φ^T Φ``), both from each tool's own stored features and
  out-to-loss weights;
* featurizing time per batch of 100 and peak memory (one subprocess per tool).
"""
import argparse
import contextlib
import copy
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.readers.attribution.gradient_store import GradientStore
from gradhooks.readers.attribution.output_functions import (
    AdamDirection,
    margin_output,
    trak_margins,
)

HERE = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------------------------- GPT-2 part
def gpt2(frozen_emb: bool):
    import zoo_imports  # torchvision beside the CPU torch (tests/zoo_imports.py)
    zoo_imports.import_torchvision()
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).eval()
    if frozen_emb:
        model.transformer.wte.weight.requires_grad_(False)
        model.transformer.wpe.weight.requires_grad_(False)
    return model


def token_losses(model, batch):
    """(B,) per-sample loss: mean next-token cross-entropy of each sequence."""
    ids = batch[0]
    logits = model(input_ids=ids).logits[:, :-1]
    tok = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                          reduction="none")
    return tok.view(ids.shape[0], -1).mean(1)


def _optimizer(model):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    return opt


def _plain_step(model, opt, batch):
    opt.zero_grad(set_to_none=True)
    token_losses(model, batch).mean().backward()
    opt.step()


class StoreRun:
    """One GPT-2 store: ``step(batch)`` writes one batch (forward, gh.backward, projection,
    write)."""

    def __init__(self, model, rows, less, path):
        self.model, self.less = model, less
        self.gh = gradhooks.attach(model, loss_reduction="sum")
        self.store = GradientStore(path, rows, k_in=16, k_out=16, seed=0, dtype=torch.float16,
                                   transform="adam" if less else None, overwrite=True)
        self.transform = None
        if less:  # a real AdamW state: two steps on the batch (suspended hooks)
            opt = _optimizer(model)
            with self.gh.recorder.suspended():
                for _ in range(2):
                    _plain_step(model, opt, self.batch0)
            opt.zero_grad(set_to_none=True)
            self.transform = AdamDirection(opt)

    def step(self, batch):
        self.store.add_batch(self.gh, batch, token_losses, transform=self.transform)


def part_gpt2(args):
    torch.manual_seed(1)
    batch = (torch.randint(0, 50257, (args.batch, args.seq)),)
    plain = gpt2(False)
    plain_opt = _optimizer(plain)
    frozen = gpt2(True)
    frozen_opt = _optimizer(frozen)
    tmp = tempfile.mkdtemp()
    store_model = gpt2(True)
    StoreRun.batch0 = batch
    rows = args.batch * (args.warmup + args.repeats)  # warm-ups and repeats, one batch each
    runs = {"store": StoreRun(store_model, rows, False, os.path.join(tmp, "a"))}
    if not args.no_less:
        runs["store_less"] = StoreRun(gpt2(True), rows, True, os.path.join(tmp, "b"))

    def suspended_all():
        stack = contextlib.ExitStack()
        for r in runs.values():
            stack.enter_context(r.gh.recorder.suspended())
        return stack

    def timed(name):
        def other(r):  # the other attachments' global hooks off while one variant runs
            stack = contextlib.ExitStack()
            for key, run in runs.items():
                if key != r:
                    stack.enter_context(run.gh.recorder.suspended())
            return stack
        if name == "plain":
            with suspended_all():
                t = time.perf_counter()
                _plain_step(plain, plain_opt, batch)
                return time.perf_counter() - t
        if name == "plain_frozen_emb":
            with suspended_all():
                t = time.perf_counter()
                _plain_step(frozen, frozen_opt, batch)
                return time.perf_counter() - t
        with other(name):
            t = time.perf_counter()
            runs[name].step(batch)
            return time.perf_counter() - t

    names = ["plain", "plain_frozen_emb", "store"] + ([] if args.no_less else ["store_less"])
    for name in names:  # warm-up: one-time work (sum check of a new structure, oneDNN kernels)
        for _ in range(args.warmup):
            timed(name)
    times = {n: [] for n in names}
    for r in range(args.repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            times[name].append(timed(name))
            print(f"  {name}: {times[name][-1]:.2f} s", flush=True)
    med = {n: statistics.median(t) for n, t in times.items()}
    mem = {} if args.no_memory else {n: _memory("gpt2", n, args) for n in names}
    for r in runs.values():
        r.gh.detach()
    return {"times": times, "median": med, "memory": mem, "K": runs["store"].store.dim,
            "threads": torch.get_num_threads(), "batch": args.batch, "seq": args.seq}


def _memory(part, name, args):
    """Peak RSS (MiB) of a fresh process running one variant twice."""
    cmd = [sys.executable, __file__, "--memory-of", f"{part}:{name}", "--batch", str(args.batch),
           "--seq", str(args.seq), "--threads", str(args.threads), "--train", str(args.train),
           "--queries", str(args.queries)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=os.path.dirname(HERE)))
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except Exception:  # pragma: no cover
        return {"error": (out.stderr or out.stdout)[-500:]}


def _rss() -> float:
    """Peak resident memory of this process so far, MiB: ``VmHWM`` (``ru_maxrss`` is kept
    across ``exec`` and would report the parent's peak in the subprocess)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_of(spec, args):
    part, name = spec.split(":")
    if part == "gpt2":
        batch = (torch.randint(0, 50257, (args.batch, args.seq)),)
        tmp = tempfile.mkdtemp()
        if name.startswith("plain"):
            model = gpt2(name != "plain")
            opt = _optimizer(model)
            base = _rss()
            for _ in range(2):
                _plain_step(model, opt, batch)
        else:
            StoreRun.batch0 = batch
            run = StoreRun(gpt2(True), args.batch * 4, name == "store_less", os.path.join(tmp, "s"))
            base = _rss()
            for _ in range(2):
                run.step(batch)
        print(json.dumps({"peak_mib": round(_rss()), "after_setup_mib": round(base)}))
        return
    data = digits(args)
    base = _rss()
    if name == "gradhooks":
        gradhooks_features(data, tempfile.mkdtemp())
    else:
        traker_features(data, tempfile.mkdtemp())
    print(json.dumps({"peak_mib": round(_rss()), "after_setup_mib": round(base)}))


# --------------------------------------------------------------------------------- traker part
def digits(args):
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    n, m = args.train, args.queries
    for _ in range(30):  # a briefly trained classifier: margins of both signs
        opt.zero_grad()
        F.cross_entropy(model(x[:n]), y[:n]).backward()
        opt.step()
    model.eval()
    return {"model": model, "train": (x[:n], y[:n]), "query": (x[n:n + m], y[n:n + m]),
            "batch": 100}


def _batches(data, size):
    x, y = data
    return [(x[i:i + size], y[i:i + size]) for i in range(0, x.shape[0], size)]


def gradhooks_features(data, tmp, k=32):
    model = data["model"]
    store = GradientStore(os.path.join(tmp, "gh"), data["train"][0].shape[0], k_in=k, k_out=k,
                          seed=0, dtype=torch.float32, output="margin")
    t = time.perf_counter()
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        store.fill(gh, _batches(data["train"], data["batch"]), margin_output, progress=False)
        elapsed = time.perf_counter() - t
        gh.backward(trak_margins(model(data["query"][0]), data["query"][1]).sum())
        query = store.project(gh.gradient_features())
    return store, query, elapsed


def traker_features(data, tmp):
    from trak import TRAKer
    model = data["model"]
    n = data["train"][0].shape[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = TRAKer(model=model, task="image_classification", train_set_size=n,
                    save_dir=os.path.join(tmp, "trak"), device="cpu", proj_dim=2048,
                    use_half_precision=False, logging_level=40)
        tr.load_checkpoint(model.state_dict(), model_id=0)
        t = time.perf_counter()
        for batch in _batches(data["train"], data["batch"]):
            tr.featurize(batch=batch, num_samples=batch[0].shape[0])
        elapsed = time.perf_counter() - t
        tr.finalize_features()
        m = data["query"][0].shape[0]
        tr.start_scoring_checkpoint(exp_name="q", checkpoint=model.state_dict(), model_id=0,
                                    num_targets=m)
        tr.score(batch=data["query"], num_samples=m)
        scores = tr.finalize_scores(exp_name="q")  # (N, M)
    return tr, torch.tensor(np.array(scores)).T, elapsed


def exact_margin_grads(model, x, y):
    """(N, P) float64 per-sample margin gradients by torch.func (independent of both tools)."""
    m64 = copy.deepcopy(model).double()
    params = {k: v.detach() for k, v in m64.named_parameters()}

    def f(p, xi, yi):
        out = torch.func.functional_call(m64, p, (xi[None],))
        return trak_margins(out, yi[None]).sum()

    g = torch.func.vmap(torch.func.grad(f), in_dims=(None, 0, 0))(params, x.double(), y)
    return torch.cat([g[k].flatten(1) for k in params], 1)


def _spearman(a, b):
    from scipy.stats import spearmanr
    return float(np.mean([spearmanr(a[i].numpy(), b[i].numpy()).statistic for i in range(a.shape[0])]))


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _ridge(phi, q, qweights, c=0.01):
    """TRAK's scores with the ridge lam = c tr(Φ Φ^T) / N: q (Φ^T Φ + lam I)^{-1} Φ^T diag(Q), in
    the N x N form (equal by the push-through identity)."""
    lam = c * float(phi.square().sum()) / phi.shape[0]
    kern = phi @ phi.T + lam * torch.eye(phi.shape[0], dtype=phi.dtype)
    return torch.linalg.solve(kern, (q @ phi.T).T).T * qweights


def _scaled_rel(a, b):
    s = float((a * b).sum() / (a * a).sum())
    return float((s * a - b).norm() / b.norm()), s


def part_traker(args):
    data = digits(args)
    j = exact_margin_grads(data["model"], *data["train"])
    jq = exact_margin_grads(data["model"], *data["query"])
    with torch.no_grad():
        logits = data["model"](data["train"][0]).double()
    qw = torch.sigmoid(-trak_margins(logits, data["train"][1]))
    gram, inner, exact = j @ j.T, jq @ j.T, _ridge(j, jq, qw)
    out = {"N": data["train"][0].shape[0], "M": data["query"][0].shape[0], "P": j.shape[1]}
    tools = ["gradhooks", "traker", "gradhooks_k64"]
    times = {t: [] for t in tools}
    res = {}
    for r in range(args.repeats):
        for tool in (tools if r % 2 == 0 else tools[::-1]):
            if tool not in times:
                continue
            tmp = tempfile.mkdtemp()
            if tool.startswith("gradhooks"):
                store, query, el = gradhooks_features(data, tmp, 64 if tool.endswith("k64") else 32)
                phi = store.features(dtype=torch.float64)
                lam = 0.01 * float(phi.square().sum()) / phi.shape[0]
                trak = store.scores(query.double(), damping=lam, out_to_loss=True)
                res[tool] = (phi, query.double(), trak, store.out_to_loss.double())
            else:
                try:
                    tr, _, el = traker_features(data, tmp)
                except Exception as e:  # record why, precisely
                    out["traker_error"] = f"{type(e).__name__}: {e}"
                    times.pop("traker")
                    continue
                cur = tr.saver.current_store
                phi = torch.tensor(np.array(cur["grads"]), dtype=torch.float64)
                q = torch.tensor(np.array(cur["q_grads"]), dtype=torch.float64)
                w = torch.tensor(np.array(cur["out_to_loss"]), dtype=torch.float64).reshape(-1)
                res[tool] = (phi, q, _ridge(phi, q, w), w)
            times[tool].append(el / len(_batches(data["train"], data["batch"])))
    for tool, (phi, q, trak, w) in res.items():
        err, scale = _scaled_rel(phi @ phi.T, gram)
        out[tool] = {"K": phi.shape[1], "gram_rel_err": err, "gram_scale": scale,
                     "spearman_inner_vs_exact": _spearman(q @ phi.T, inner),
                     "spearman_trak_vs_exact": _spearman(trak, exact),
                     "out_to_loss_max_diff": float((w - qw).abs().max()),
                     "time_per_batch_s": statistics.median(times[tool])}
    if "traker" in res:
        out["spearman_trak_scores_gh_vs_traker"] = _spearman(res["gradhooks"][2], res["traker"][2])
    if not args.no_memory:
        out["memory"] = {t: _memory("traker", t, args) for t in ("gradhooks", "traker") if t in res}
    return out


# ------------------------------------------------------------------------------------ report
def report(g2, tk, args):
    lines = ["# Projected gradient store: GPT-2 small step ratio and traker comparison", "",
             f"`python benchmarks/gradient_store.py` (CPU, {torch.get_num_threads()} threads, float32 "
             f"compute; torch {torch.__version__}). Generated by the script; numbers from one run.", ""]
    if g2:
        med = g2["median"]
        lines += ["## Store cost per batch vs a plain training step (GPT-2 small)", "",
                  f"B = {g2['batch']} x T = {g2['seq']} tokens, `GPT2Config()` defaults (random weights, "
                  f"eval mode), k_in = k_out = 16 (K = {g2['K']}), float16 store; median of "
                  f"{len(next(iter(g2['times'].values())))} alternating repeats after {args.warmup} warm-up(s).", "",
                  "| variant | median s / batch | ratio to `plain` | ratio to `plain_frozen_emb` | peak RSS MiB (after setup) |",
                  "|---|---|---|---|---|"]
        for n, t in med.items():
            mem = g2["memory"].get(n, {})
            m = f"{mem.get('peak_mib', '-')} ({mem.get('after_setup_mib', '-')})" if mem else "-"
            lines.append(f"| `{n}` | {t:.2f} | {t / med['plain']:.2f}x | {t / med['plain_frozen_emb']:.2f}x | {m} |")
        lines += ["", "All samples: " + "; ".join(f"{n}: " + ", ".join(f"{x:.2f}" for x in v)
                                               for n, v in g2["times"].items()), ""]
    if tk:
        lines += ["## Against traker 0.3.2 (TRAK) on the same model", "",
                  f"Digits MLP 64-128-10, N = {tk['N']} train, M = {tk['M']} queries, P = {tk['P']} "
                  f"parameters, TRAK margin output; exact features J (N, P) in float64 by torch.func.", ""]
        if "traker_error" in tk:
            lines += [f"traker failed: `{tk['traker_error']}`", ""]
        lines += ["| tool | K | Gram: rel. error of s Φ Φ^T vs J J^T (s) | Spearman q Φ^T vs exact | Spearman TRAK scores vs exact | s / batch of 100 | peak RSS MiB (after setup) |",
                  "|---|---|---|---|---|---|---|"]
        for tool in ("gradhooks", "traker", "gradhooks_k64"):
            if tool in tk:
                r = tk[tool]
                mem = tk.get("memory", {}).get(tool, {})
                m = f"{mem.get('peak_mib', '-')} ({mem.get('after_setup_mib', '-')})" if mem else "-"
                lines.append(f"| {tool} | {r['K']} | {r['gram_rel_err']:.4f} ({r['gram_scale']:.3g}) | "
                             f"{r['spearman_inner_vs_exact']:.4f} | {r['spearman_trak_vs_exact']:.4f} | "
                             f"{r['time_per_batch_s']:.4f} | {m} |")
        if "spearman_trak_scores_gh_vs_traker" in tk:
            lines += ["", f"Spearman rank correlation of the two tools' TRAK scores (mean over queries): "
                          f"{tk['spearman_trak_scores_gh_vs_traker']:.4f}. Largest difference of the "
                          f"out-to-loss weights Q from the exact 1 - p: gradhooks "
                          f"{tk['gradhooks']['out_to_loss_max_diff']:.1e}, traker "
                          f"{tk['traker']['out_to_loss_max_diff']:.1e}."]
        lines.append("")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", default="all", choices=["all", "gpt2", "traker"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--train", type=int, default=1500)
    ap.add_argument("--queries", type=int, default=100)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--no-less", action="store_true")
    ap.add_argument("--memory-of", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "gradient_store.md"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_of:
        memory_of(args.memory_of, args)
        return
    g2 = part_gpt2(args) if args.part in ("all", "gpt2") else None
    if g2:
        print(json.dumps(g2, indent=1, default=str))
    tk = part_traker(args) if args.part in ("all", "traker") else None
    if tk:
        print(json.dumps(tk, indent=1, default=str))
    text = report(g2, tk, args)
    print(text)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
