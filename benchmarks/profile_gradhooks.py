"""Where gradhooks' time goes beyond the plain forward + backward, per workload.

    python benchmarks/profile_gradhooks.py [--workloads ...] [--methods gh_grads,gh_norms,...]
        [--repeats 5] [--threads T] [--top 12] [--out FILE.md]

For each workload (at its own batch size) and gradhooks method of benchmarks/peers.py:

* the median time of plain and of the method (steps as in peers.py);
* among the torch ops the method calls more often than plain, those whose self CPU time grows
  most (torch.profiler; ``extra ms per step`` = (method - plain) self time / repeats); the ops
  both call equally often are summed into one net figure (noise, or slower because of the hooks);
* the gradhooks Python functions with the most time under cProfile (``cum ms`` including callees,
  ``own ms`` without, per step).

Both profilers add overhead; read the shares, not the absolute numbers. The machine's load moves
them too: profile on a quiet machine.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gradhooks.tools.workloads import BENCH_WORKLOADS as WORKLOADS  # noqa: E402

from peers import GRADHOOKS_KEYS, METHODS, Case, Method, _names, _positive, _quiet  # noqa: E402


def _step(m: Method) -> None:
    m.release()
    m.run()


def median_ms(m: Method, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        m.release()
        t0 = time.perf_counter()
        m.run()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def op_times(m: Method, repeats: int) -> Dict[str, Tuple[float, int]]:
    """``{op: (self CPU ms summed over the repeats, calls)}`` under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            _step(m)
    return {e.key: (e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()}


def python_times(m: Method, repeats: int, top: int) -> List[Tuple[str, float, float, int]]:
    """gradhooks functions by cumulative time: ``(function, cum ms, own ms, calls)`` per step."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(repeats):
        _step(m)
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (file, line, func), (cc, nc, tt, ct, _) in stats.stats.items():
        if f"{os.sep}gradhooks{os.sep}" in file:
            where = file.split(f"{os.sep}gradhooks{os.sep}")[-1]
            rows.append((f"{where}:{line} {func}", ct * 1e3 / repeats, tt * 1e3 / repeats,
                         nc // repeats))
    rows.sort(key=lambda r: -r[1])
    return rows[:top]


def profile_workload(name: str, keys: Sequence[str], repeats: int, top: int) -> str:
    wl = WORKLOADS[name]
    case = Case(wl, wl.batch_size, torch.device("cpu"), 0)
    plain = METHODS["plain"](case)
    _step(plain)
    plain_ms = median_ms(plain, repeats)
    plain_ops = op_times(plain, repeats)
    lines = [f"## {name} (B={wl.batch_size}): plain {plain_ms:.2f} ms", ""]
    for key in keys:
        try:
            m = METHODS[key](case)
            _step(m)
        except Exception as e:  # noqa: BLE001
            lines += [f"### {METHODS[key].label}: not available ({type(e).__name__}: {e})", ""]
            continue
        ms = median_ms(m, repeats)
        ops = op_times(m, repeats)
        extra, same = [], 0.0
        for k, (t, n) in ops.items():
            t0, n0 = plain_ops.get(k, (0.0, 0))
            if n > n0:
                extra.append(((t - t0) / repeats, k, (n - n0) / repeats))
            else:
                same += (t - t0) / repeats
        extra.sort(reverse=True)
        lines += [f"### {METHODS[key].label}: {ms:.2f} ms ({ms / plain_ms:.2f}x plain, "
                  f"+{ms - plain_ms:.2f} ms)", "",
                  f"torch ops called more often than in plain, by extra self CPU time per step "
                  f"(all of them: {sum(e for e, _, _ in extra):.2f} ms; ops with plain's call "
                  f"count: net {same:+.2f} ms):", "",
                  "| op | extra ms per step | extra calls per step |", "|---|---:|---:|"]
        lines += [f"| `{k}` | {e:.3f} | {c:g} |" for e, k, c in extra[:top]]
        lines += ["", "gradhooks Python functions (cProfile, per step):", "",
                  "| function | cum ms | own ms | calls |", "|---|---:|---:|---:|"]
        lines += [f"| `{f}` | {ct:.3f} | {tt:.3f} | {n} |"
                  for f, ct, tt, n in python_times(m, repeats, top)]
        lines.append("")
        m.release()
        m.close()
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", type=_names(list(WORKLOADS)), default=list(WORKLOADS))
    p.add_argument("--methods", type=_names(list(GRADHOOKS_KEYS)), default=list(GRADHOOKS_KEYS))
    p.add_argument("--repeats", type=_positive, default=5)
    p.add_argument("--threads", type=_positive, default=None)
    p.add_argument("--top", type=_positive, default=12)
    p.add_argument("--out", default=None, help="also write the report to this markdown file")
    args = p.parse_args(argv)
    _quiet()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    parts = [f"# Profile of gradhooks against the plain batch gradient (torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads, {args.repeats} steps profiled)", ""]
    for name in args.workloads:
        parts.append(profile_workload(name, args.methods, args.repeats, args.top))
        print(parts[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
