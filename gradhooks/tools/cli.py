"""Command line: ``python -m gradhooks bench`` (or ``gradhooks bench``), the main job.

Computes per-sample gradients of four models on real data that ships with the installed packages
(scikit-learn's digits and diabetes data, the text of Python's own ``argparse.py``), by four
methods, times them, and checks gradhooks and ``torch.func`` against autograd through the same
batched forward (:func:`gradhooks.batched_forward_per_sample_grads`), reporting their distance
from looped autograd (one forward per sample, in float64 for a float32 run) as well::

    gradhooks bench [--workloads cnn,mlp,lstm,transformer] [--repeats 10] [--loop-repeats 3]
                    [--dtype float32|float64] [--threads N] [--tol T] [--json PATH] [--seed S]

Why two references: at a kink (a ReLU input at 0, a tie in a max-pool window; the upsampled 8x8
digits give thousands of exact ties in the CNN's max-pool) the loop's batch-of-one forward can
round differently from the batched one on some CPUs (AVX2 vs AVX-512 kernels, oneDNN or not),
break a tie the other way and so differentiate another subgradient: the loop's difference then
says nothing about gradhooks' math. The first kink op where the forwards decide differently is
printed under the table (:mod:`gradhooks.tools.kinks`).

Exit code 0 if every error is within the tolerance, 1 if one is not, 2 if the optional
dependencies (``pip install gradhooks[job]``: scikit-learn, tqdm) are missing. This module is
not imported by ``import gradhooks``; scikit-learn and tqdm are imported only when it runs.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import statistics
import sys
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .._version import __version__
from ..hooks import attach
from .kinks import first_kink_difference
from .reference import batched_forward_per_sample_grads, looped_per_sample_grads, max_rel_error
from .workloads import JOB_WORKLOADS as WORKLOADS
from .workloads import Workload

__all__ = ["main", "WORKLOADS", "Result", "median_ms", "format_table", "run_workload"]

Grads = Dict[str, Tensor]
DEFAULT_TOL = {"float32": 1e-4, "float64": 1e-10}


# ---------------------------------------------------------------------------------- methods
# Each method is a context manager: set up (untimed), yield ``run() -> per-sample grads or None``.
@contextlib.contextmanager
def _plain(wl: Workload, model: nn.Module, x: Tensor, y: Tensor) -> Iterator[Callable[[], None]]:
    yield lambda: wl.loss_fn(model(x), y).backward()


@contextlib.contextmanager
def _hooks(wl: Workload, model: nn.Module, x: Tensor, y: Tensor) -> Iterator[Callable[[], Grads]]:
    with attach(model, loss_reduction=wl.loss_reduction) as gh:
        def run() -> Grads:
            gh.backward(wl.loss_fn(model(x), y))  # per-sample grads only, as vmap gives
            return gh.per_sample_grads()
        yield run


@contextlib.contextmanager
def _vmap(wl: Workload, model: nn.Module, x: Tensor, y: Tensor) -> Iterator[Callable[[], Grads]]:
    from torch.func import functional_call, grad, vmap

    params = {k: v.detach() for k, v in model.named_parameters()}

    def sample_loss(p: Grads, xn: Tensor, yn: Tensor) -> Tensor:
        return wl.loss_fn(functional_call(model, p, (xn.unsqueeze(0),)), yn.unsqueeze(0))

    per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0))
    yield lambda: per_sample(params, x, y)


@contextlib.contextmanager
def _loop(wl: Workload, model: nn.Module, x: Tensor, y: Tensor) -> Iterator[Callable[[], Grads]]:
    yield lambda: looped_per_sample_grads(model, wl.loss_fn, x, y,
                                                    loss_reduction=wl.loss_reduction)


PLAIN, LOOP = "plain batch gradient", "looped autograd"
METHODS = {PLAIN: _plain, "gradhooks": _hooks, "torch.func vmap(grad)": _vmap, LOOP: _loop}


# ---------------------------------------------------------------------------------- running
@dataclasses.dataclass
class Result:
    """One row of the report: a method on a workload.

    Attributes:
        workload, method: the row.
        median_ms: median time of one call; ``ratio`` is it over the plain batch gradient's.
        max_rel_error: the largest :func:`gradhooks.max_rel_error` over the parameters against
            :func:`gradhooks.batched_forward_per_sample_grads` (autograd through the same batched
            forward; ``inf`` if the parameter sets differ); ``None`` for the plain gradient and
            the loop itself.
        loop_rel_error: the same against :func:`gradhooks.looped_per_sample_grads` run in
            ``loop_dtype`` (float64 for a float32 run): reported, not judged.
        loop_dtype: ``"float64"`` or ``"float32"``; ``None`` where no error is computed.
        kink: where the loop's per-sample forwards first decide a kink differently from the
            batched forward (:class:`gradhooks.tools.kinks.KinkDifference` as text), computed when the
            loop differs by more than the tolerance; ``None`` otherwise.
        ok: whether the row passes. gradhooks: ``max_rel_error <= tol``. ``torch.func
            vmap(grad)``, a peer: within ``tol`` of either reference (its batching rules may run
            the batched forward or one per sample, and both are valid per-sample gradients; a
            tie broken the other way in the loop must not fail the job). The exit code is 1 if
            any row is not ok.
    """

    workload: str
    method: str
    median_ms: float
    ratio: float = 1.0
    max_rel_error: Optional[float] = None
    ok: bool = True
    loop_rel_error: Optional[float] = None
    loop_dtype: Optional[str] = None
    kink: Optional[str] = None


def median_ms(fn: Callable[[], object], repeats: int, *, reset: Callable[[], None] = lambda: None,
              tick: Callable[[], None] = lambda: None) -> Tuple[float, object]:
    """Call ``fn`` once to warm up, then ``repeats`` times under ``time.perf_counter``.

    ``reset`` runs (untimed) before every call and ``tick`` after it. Returns the median time of
    the timed calls in milliseconds and the last call's result.
    """
    times, out = [], None
    for i in range(repeats + 1):
        reset()
        t0 = time.perf_counter()
        out = fn()
        if i:
            times.append(time.perf_counter() - t0)
        tick()
    return statistics.median(times) * 1e3, out


def _max_error(ours: Grads, ref: Grads) -> float:
    if list(ours) != list(ref) or any(ours[k].shape != ref[k].shape for k in ref):
        return math.inf
    return max(max_rel_error(ours[k], ref[k]) for k in ref)


def _to_float64(t: Tensor) -> Tensor:
    return t.double() if t.is_floating_point() else t


def run_workload(wl: Workload, dtype: torch.dtype, repeats: int, loop_repeats: int, tol: float,
                 seed: int, progress: Callable[[str, int], None]) -> List[Result]:
    """Time every method of :data:`METHODS` on ``wl``, check the per-sample ones against autograd
    through the same batched forward and report their distance from the loop (float64 for a
    float32 run, on a float64 copy of the model; the kink explanation when it exceeds ``tol``).
    ``progress(label, calls_done)`` is called with 0 when a method starts and with 1 after each
    of its calls. Returns one :class:`Result` per method, in :data:`METHODS` order."""
    torch.manual_seed(seed)
    model = wl.make_model().to(dtype)
    x, y = wl.load(dtype, wl.batch_size)

    def reset() -> None:
        for p in model.parameters():
            p.grad = None

    times, grads = {}, {}
    for name, method in METHODS.items():
        label = f"{wl.name}: {name}"
        progress(label, 0)
        with method(wl, model, x, y) as fn:
            times[name], grads[name] = median_ms(
                fn, loop_repeats if name == LOOP else repeats, reset=reset,
                tick=lambda: progress(label, 1))
    reset()
    progress(f"{wl.name}: references", 0)
    ref = batched_forward_per_sample_grads(model, wl.loss_fn, x, y,
                                                     loss_reduction=wl.loss_reduction)
    loop_model, lx, loop = model, x, grads[LOOP]
    if dtype != torch.float64:
        loop_model, lx = copy.deepcopy(model).double(), _to_float64(x)
        loop = looped_per_sample_grads(loop_model, wl.loss_fn, lx, _to_float64(y),
                                                 loss_reduction=wl.loss_reduction)
    loop_dtype = str(next(iter(loop.values())).dtype).replace("torch.", "")
    errors = {name: (_max_error(grads[name], ref), _max_error(grads[name], loop))
              for name in METHODS if name not in (PLAIN, LOOP)}
    kink = None
    if any(e[1] > tol for e in errors.values()):
        diff = first_kink_difference(model, (x,), loop_model, (lx,))
        kink = None if diff is None else str(diff)
    results = []
    for name in METHODS:
        row = Result(wl.name, name, times[name], times[name] / times[PLAIN])
        if name in errors:
            row.max_rel_error, row.loop_rel_error = errors[name]
            row.loop_dtype, row.kink = loop_dtype, kink
            row.ok = row.max_rel_error <= tol or (name != "gradhooks" and row.loop_rel_error <= tol)
        results.append(row)
    return results


def format_table(results: Sequence[Result]) -> str:
    """The results as a markdown table: workload, method, median ms, ratio to the plain batch
    gradient, max relative error against autograd through the same batched forward (the
    checked one) and against the loop ("-" where not applicable)."""
    loop_dtypes = sorted({r.loop_dtype for r in results if r.loop_dtype})
    header = ("workload", "method", "median ms", "x plain", "max rel err (same fwd)",
              f"vs {'/'.join(loop_dtypes) or 'float64'} loop")
    rows = [(r.workload, r.method, f"{r.median_ms:.2f}", f"{r.ratio:.1f}x",
             "-" if r.max_rel_error is None else f"{r.max_rel_error:.2e}",
             "-" if r.loop_rel_error is None else f"{r.loop_rel_error:.2e}") for r in results]
    widths = [max(map(len, col)) for col in zip(header, *rows)]
    right = (False, False, True, True, True, True)

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if r else c.ljust(w)
                                 for c, w, r in zip(cells, widths, right)) + " |"

    rule = "|" + "|".join("-" * (w + 1) + (":" if r else "-") for w, r in zip(widths, right)) + "|"
    return "\n".join([line(header), rule, *map(line, rows)])


# ---------------------------------------------------------------------------------- CLI
def _workload_list(text: str) -> List[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown workload(s) {', '.join(unknown) or '(none given)'}; choose from "
            f"{', '.join(WORKLOADS)}")
    return names


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``gradhooks`` command (subcommand ``bench``)."""
    parser = argparse.ArgumentParser(
        prog="gradhooks", description="gradhooks: exact per-sample gradients through layer hooks.")
    sub = parser.add_subparsers(dest="command")
    bench = sub.add_parser(
        "bench", help="time and check per-sample gradients on real data (the default)",
        description="Per-sample gradients of a CNN on sklearn digits, an MLP on sklearn "
                    "diabetes data, a char LSTM language model and a causal Transformer on the "
                    "text of Python's argparse.py: plain batch gradient, gradhooks, torch.func "
                    "vmap(grad) and looped autograd; errors are checked against autograd through "
                    "the same batched forward, the distance from the loop (float64 for a float32 "
                    "run) is reported.")
    bench.add_argument("--workloads", type=_workload_list, default=list(WORKLOADS),
                       help=f"comma-separated, from {','.join(WORKLOADS)} (default: all)")
    bench.add_argument("--repeats", type=_positive_int, default=10,
                       help="timed repetitions per method (median reported; default 10)")
    bench.add_argument("--loop-repeats", type=_positive_int, default=3,
                       help="timed repetitions of the looped reference (default 3)")
    bench.add_argument("--dtype", choices=sorted(DEFAULT_TOL), default="float32")
    bench.add_argument("--threads", type=_positive_int, default=None,
                       help="torch.set_num_threads (default: torch's choice)")
    bench.add_argument("--tol", type=float, default=None,
                       help="max relative error allowed (default 1e-4 float32, 1e-10 float64)")
    bench.add_argument("--json", metavar="PATH", default=None, help="also write results as JSON")
    bench.add_argument("--seed", type=int, default=0, help="torch.manual_seed of the models")
    return parser


def _bench(args: argparse.Namespace) -> int:
    try:
        import sklearn.datasets  # noqa: F401
        from tqdm import tqdm
    except ImportError as e:
        print(f"gradhooks bench needs scikit-learn and tqdm ({e}); install them with: "
              f"pip install 'gradhooks[job]'", file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    tol = DEFAULT_TOL[args.dtype] if args.tol is None else args.tol
    workloads = [WORKLOADS[n] for n in args.workloads]

    print(f"gradhooks {__version__} bench | torch {torch.__version__} | "
          f"{torch.get_num_threads()} threads | {args.dtype} | medians of {args.repeats} "
          f"(loop: {args.loop_repeats}) | tol {tol:g} | seed {args.seed}")
    for wl in workloads:
        print(f"- {wl.name}: {wl.description}")
    total = len(workloads) * ((len(METHODS) - 1) * (args.repeats + 1) + args.loop_repeats + 1)
    results: List[Result] = []
    with tqdm(total=total, file=sys.stderr, unit="run", dynamic_ncols=True) as bar:
        def progress(label: str, done: int) -> None:
            bar.set_description(label, refresh=not done)
            bar.update(done)

        for wl in workloads:
            results += run_workload(wl, dtype, args.repeats, args.loop_repeats, tol, args.seed,
                                    progress)
    print()
    print(format_table(results))
    print()
    kinks = {r.workload: r.kink for r in results if r.kink}
    for name, kink in kinks.items():
        print(f"{name}: the loop's per-sample forwards take another side of a kink than the "
              f"batched forward (another valid subgradient, not an error), first at {kink}")
    failed = [r for r in results if not r.ok]
    for r in failed:
        loop = "" if r.method == "gradhooks" else f" (and {r.loop_rel_error:.3e} from the loop)"
        print(f"FAILED: {r.method} on {r.workload}: max rel error {r.max_rel_error:.3e} "
              f"> tol {tol:g} against autograd through the same batched forward{loop}")
    if not failed:
        print(f"OK: every per-sample gradient is within {tol:g} of autograd through the same "
              f"batched forward")
    if args.json:
        report = {"torch": torch.__version__, "gradhooks": __version__,
                  "threads": torch.get_num_threads(), "dtype": args.dtype, "tol": tol,
                  "repeats": args.repeats, "loop_repeats": args.loop_repeats, "seed": args.seed,
                  "ok": not failed, "results": [dataclasses.asdict(r) for r in results]}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 1 if failed else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``gradhooks`` / ``python -m gradhooks``; returns the exit code.

    ``argv`` defaults to ``sys.argv[1:]``; without a subcommand, ``bench`` is assumed.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("bench", "-h", "--help"):
        argv.insert(0, "bench")
    args = build_parser().parse_args(argv)
    return _bench(args)
