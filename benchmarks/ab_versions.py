"""Two versions of gradhooks side by side in one process: the A/B check of a refactor.

    python benchmarks/ab_versions.py BASE_CHECKOUT NEW_CHECKOUT [--repeats 30] [--threads 2]
        [--workloads mlp,cnn,lstm,transformer,wide_mlp,gpt2] [--methods hooks,grads,norms,ghost,two_pass]

Each checkout's ``gradhooks/`` package is loaded under its own module name (``gh_a``, ``gh_b``;
gradhooks imports itself only relatively), so both run in the same process on the same machine
state. For every workload of :data:`gradhooks.tools.workloads.BENCH_WORKLOADS` and every method, the two versions are
timed round robin -- A, B, B, A, A, B, ... so that neither always runs first -- after 3 warm-up
steps each, on their own copy of one seeded float32 model and the same batch. A step is what a
training loop pays for the method: forward, backward and the read, as in ``peers.py``.

Prints per workload and method the median of each version, the ratio B / A of the medians and,
as a noise estimate, the ratio of the medians of the two halves of A's own samples. A change is
within noise when its ratio is inside that spread.
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch

from gradhooks.tools.workloads import BENCH_WORKLOADS, Workload

METHODS = ("hooks", "grads", "norms", "ghost", "two_pass")


def _gpt2_model():
    # (imported here: transformers is only needed for this workload; tests/zoo_imports.py
    # stubs the CUDA torchvision it would pull in)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "tests"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers as tr

    import zoo_imports
    cfg = tr.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    return zoo_imports.TokensToLogits(tr.GPT2LMHeadModel(cfg))


def _gpt2_batch(dtype, batch: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50257, (batch, 129), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _token_mean(out, y):  # (B,): each sequence's mean next-token cross-entropy
    return torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten(),
                                             reduction="none").view(y.shape).mean(1)


WORKLOADS = {**BENCH_WORKLOADS, "gpt2": Workload(
    "gpt2", "GPT-2 small", "GPT-2 small (124 M, tied), B = 4, T = 128, token-mean CE", 4,
    _gpt2_model, _gpt2_batch, lambda out, y: _token_mean(out, y).mean(), "mean", _token_mean)}


def load_version(checkout: str, name: str):
    """Import ``checkout/gradhooks`` as the package ``name``."""
    root = os.path.join(os.path.abspath(checkout), "gradhooks")
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(root, "__init__.py"), submodule_search_locations=[root])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def make_step(gh_pkg, method: str, wl, model, x, y) -> Callable[[], None]:
    """One training step of ``method`` with the package ``gh_pkg`` attached to ``model``."""
    gh = gh_pkg.attach(model, loss_reduction=wl.loss_reduction)

    def step() -> None:
        for p in model.parameters():
            p.grad = None
        out = model(x)
        if method == "two_pass":
            gh.clipped_backward(wl.per_sample_loss(out, y), 1.0)
            return
        loss = wl.loss_fn(out, y)
        if method == "hooks":
            loss.backward()
            return
        gh.backward(loss) if method in ("grads", "norms") else loss.backward()
        if method == "grads":
            gh.per_sample_grads()
        elif method == "norms":
            gh.per_sample_grad_norms()
        else:
            gh.clip_and_accumulate(1.0)

    return step


def main(argv: List[str] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base")
    p.add_argument("new")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--methods", default=",".join(METHODS))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    versions = {"A": load_version(args.base, "gh_a"), "B": load_version(args.new, "gh_b")}
    print(f"A = {args.base}, B = {args.new}; torch {torch.__version__}, {args.threads} threads, "
          f"medians of {args.repeats}")
    print("| workload | method | A ms | B ms | B / A | A's own half-to-half |")
    print("|---|---|--:|--:|--:|--:|")
    for wname in args.workloads.split(","):
        wl = WORKLOADS[wname]
        torch.manual_seed(0)
        seed_model = wl.make_model()
        x, y = wl.load(torch.float32, wl.batch_size)
        for method in args.methods.split(","):
            steps: Dict[str, Callable[[], None]] = {
                k: make_step(v, method, wl, copy.deepcopy(seed_model), x, y)
                for k, v in versions.items()}
            times: Dict[str, List[float]] = {k: [] for k in steps}
            for k in steps:
                for _ in range(3):
                    steps[k]()
            for i in range(args.repeats):
                order = ("A", "B") if i % 2 == 0 else ("B", "A")
                for k in order:
                    t0 = time.perf_counter()
                    steps[k]()
                    times[k].append(time.perf_counter() - t0)
            a, b = (statistics.median(times[k]) * 1e3 for k in ("A", "B"))
            half = len(times["A"]) // 2
            noise = statistics.median(times["A"][half:]) / statistics.median(times["A"][:half])
            print(f"| {wname} | {method} | {a:.3f} | {b:.3f} | {b / a:.3f} | {noise:.3f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
