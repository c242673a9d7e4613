"""DP-SGD clipping side by side: plain training, gradhooks' book-keeping and two-pass ghost
clipping, Opacus' ghost clipping and Opacus' hooks-mode clipping, on the workloads of
``gradhooks.tools.workloads.DP_WORKLOADS`` (see benchmarks/README.md, "DP clipping").

    python benchmarks/dp.py [--workloads mlp,cnn,lstm,transformer,wide_mlp,resnet_gn,encoder]
        [--methods ...] [--repeats 10] [--warmup 3] [--threads T] [--no-memory]
        [--check-batch 6] [--seed 0] [--out benchmarks/results/dp.md]

One timed step is everything a DP-SGD step needs before ``optimizer.step()``: forward, backward
and ``param.grad`` holding the clipped mean ``(1/B) sum_n min(1, C / ||g_n||) g_n`` (the sum for
the seed MLP's summed loss), noise multiplier 0, ``C`` the median per-sample gradient norm of
the batch (about half the samples clipped):

* ``plain``: forward + ``loss.backward()`` (no clipping: the denominator of every ratio);
* ``gh_ghost``: forward + ``gh.backward(loss)`` + ``gh.clip_and_accumulate(C)`` (book-keeping);
* ``gh_two_pass``: forward + ``gh.clipped_backward(per_sample_losses, C)``;
* ``opacus_ghost``: ``GradSampleModuleFastGradientClipping`` with ``DPLossFastGradientClipping``
  (``loss.backward()`` runs its two passes), then ``DPOptimizerFastGradientClipping.pre_step()``
  (noise 0, division by B);
* ``opacus_hooks``: ``GradSampleModule`` forward + ``loss.backward()``, then
  ``DPOptimizer.pre_step()`` (per-sample clipping from ``grad_sample``, noise 0, division by B).

Timing, interleaving and peak memory are those of ``peers.py`` (its ``time_case``: methods in a
round robin whose start rotates, medians; its ``memory_child``: each method in a fresh process,
peak RSS of a step above a pre-warmed baseline). Correctness, separately and before timing: each
method once on a float64 copy of the model and a batch of ``--check-batch`` samples, its
``param.grad`` against the clipped mean formed from looped autograd's per-sample gradients with
``C`` their median norm (``max |diff| / max |ref|`` over parameters). Opacus clips by
``C / (||g_n|| + 1e-6)``, so its error is about ``1e-6 / ||g_n||``, not rounding. A method
that fails on a workload is reported with its error class and message.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from typing import Dict, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the gradhooks of this checkout
sys.path.insert(0, HERE)

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

import gradhooks  # noqa: E402
from gradhooks.tools.workloads import DP_WORKLOADS  # noqa: E402

import peers  # noqa: E402

TOL = 1e-9          # float64 relative error allowed to gradhooks (rounding)
OPACUS_TOL = 1e-4   # Opacus: its 1e-6 stabiliser in C / (||g|| + 1e-6), relative to ||g||


def clip_norm(case: peers.Case) -> float:
    """``C`` of ``case``: the median per-sample gradient norm of its model and batch (looped
    autograd, computed once per case)."""
    if not hasattr(case, "clip_norm"):
        wl = case.workload
        ref = gradhooks.looped_per_sample_grads(case.copy(), wl.loss_fn, case.x, case.y,
                                                loss_reduction=wl.loss_reduction)
        case.clip_norm = float(peers._ref_norms(ref).median())
    return case.clip_norm


class _Clipped:
    """A DP method: ``result()`` is ``{name: param.grad}``, the clipped mean (or sum)."""

    def result(self) -> Dict[str, Tensor]:
        return {n: p.grad for n, p in self.named_parameters() if p.grad is not None}

    def named_parameters(self):
        return self.model.named_parameters()


class GhGhost(_Clipped, peers._GradHooks):
    key, label = "gh_ghost", "gradhooks book-keeping (gh.backward + clip_and_accumulate)"

    def run(self) -> None:
        case = self.case
        self.gh.backward(case.loss(self.model(case.x)))
        self.gh.clip_and_accumulate(clip_norm(case))


class GhTwoPass(_Clipped, peers._GradHooks):
    key, label = "gh_two_pass", "gradhooks two-pass (clipped_backward)"

    def run(self) -> None:
        case = self.case
        losses = case.workload.per_sample_loss(self.model(case.x), case.y)
        self.gh.clipped_backward(losses, clip_norm(case))


class _PerSampleCriterion(nn.Module):
    """The workload's loss as Opacus' ghost clipping wants a criterion: ``reduction="none"``
    gives the ``(B,)`` per-sample losses (``DPLossFastGradientClipping`` sets it so)."""

    def __init__(self, case: peers.Case):
        super().__init__()
        self.case, self.reduction = case, case.workload.loss_reduction

    def forward(self, out: Tensor, y: Tensor) -> Tensor:
        wl = self.case.workload
        return wl.per_sample_loss(out, y) if self.reduction == "none" else wl.loss_fn(out, y)


class _OpacusDP(_Clipped, peers.Method):
    """Opacus with ``ModuleValidator.fix`` (DPLSTM, DPMultiheadAttention, as peers.py) and a DP
    optimizer of noise 0 around SGD; ``run`` stops after ``pre_step()`` (clip, noise, scale),
    before the parameter update."""

    peer = True
    ghost = False

    def __init__(self, case: peers.Case):
        super().__init__(case)
        from opacus.validators import ModuleValidator
        wl = case.workload
        dtype = next(case.model.parameters()).dtype
        batch_first = wl.make_seq_first_model is None
        if not batch_first:  # (peers.py: DPMultiheadAttention(batch_first=True) is wrong)
            self.model = wl.make_seq_first_model().to(case.device, dtype)
            self.model.load_state_dict(case.model.state_dict())
        # (fix builds its DPLSTM / DPMultiheadAttention in the default dtype)
        self.model = ModuleValidator.fix(self.model).to(dtype)
        errors = ModuleValidator.validate(self.model, strict=False)
        if errors:
            raise peers.Unsupported("; ".join(str(e) for e in errors))
        self.base = self.model
        self._build(batch_first, wl.loss_reduction, clip_norm(case))

    def result(self) -> Dict[str, Tensor]:
        from opacus.layers import DPMultiheadAttention
        mha = [n for n, m in self.base.named_modules() if isinstance(m, DPMultiheadAttention)]
        return peers.merge_qkv(super().result(), mha, dim=0)

    def named_parameters(self):
        return self.base.named_parameters()

    def release(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def close(self) -> None:
        self.gsm._close()


class OpacusHooks(_OpacusDP):
    key, label = "opacus_hooks", "Opacus hooks (GradSampleModule + DPOptimizer)"

    def _build(self, batch_first: bool, reduction: str, c: float) -> None:
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer
        self.gsm = GradSampleModule(self.base, batch_first=batch_first, loss_reduction=reduction)
        self.opt = DPOptimizer(torch.optim.SGD(self.base.parameters(), lr=0.0),
                               noise_multiplier=0.0, max_grad_norm=c,
                               expected_batch_size=self.case.batch, loss_reduction=reduction)

    def run(self) -> None:
        self.case.loss(self.gsm(self.case.x)).backward()
        self.opt.pre_step()


class OpacusGhost(_OpacusDP):
    key, label = "opacus_ghost", "Opacus ghost (GradSampleModuleFastGradientClipping)"

    def _build(self, batch_first: bool, reduction: str, c: float) -> None:
        from opacus.grad_sample import GradSampleModuleFastGradientClipping
        from opacus.optimizers import DPOptimizerFastGradientClipping
        from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
        self.gsm = GradSampleModuleFastGradientClipping(
            self.base, batch_first=batch_first, loss_reduction=reduction, max_grad_norm=c,
            use_ghost_clipping=True)
        self.opt = DPOptimizerFastGradientClipping(
            torch.optim.SGD(self.base.parameters(), lr=0.0), noise_multiplier=0.0,
            max_grad_norm=c, expected_batch_size=self.case.batch, loss_reduction=reduction)
        self.criterion = DPLossFastGradientClipping(self.gsm, self.opt,
                                                    _PerSampleCriterion(self.case), reduction)

    def run(self) -> None:
        self.criterion(self.gsm(self.case.x), self.case.y).backward()
        self.opt.pre_step()


METHODS = {m.key: m for m in (peers.Plain, GhGhost, GhTwoPass, OpacusGhost, OpacusHooks)}
DP_KEYS = tuple(k for k in METHODS if k != "plain")
peers.METHODS.update(METHODS)  # peers.time_case / memory_child look methods up there
peers.WORKLOADS = {**peers.WORKLOADS, **DP_WORKLOADS}


# ------------------------------------------------------------------------------------ checking
def check_case(name: str, batch: int, seed: int) -> peers.Case:
    """A float64 copy of workload ``name`` at ``batch`` samples, ``clip_norm`` set."""
    case = peers.Case(DP_WORKLOADS[name], batch, torch.device("cpu"), seed)
    case.model.double()
    if case.x.is_floating_point():
        case.x = case.x.double()
    clip_norm(case)
    return case


def expected_clipped(case: peers.Case) -> Dict[str, Tensor]:
    """``sum_n min(1, C / ||g_n||) g_n`` (divided by B for a mean loss) from looped autograd."""
    wl = case.workload
    ref = gradhooks.looped_per_sample_grads(case.copy(), wl.loss_fn, case.x, case.y,
                                            loss_reduction=wl.loss_reduction)
    factor = (case.clip_norm / peers._ref_norms(ref)).clamp(max=1.0)
    if wl.loss_reduction == "mean":
        factor = factor / case.batch
    return {n: torch.einsum("n,n...->...", factor, g.double()) for n, g in ref.items()}


def check_methods(name: str, keys: Sequence[str], batch: int, seed: int) -> Dict[str, dict]:
    """Each method once on a float64 batch: ``{key: {"max_rel_err", "status", "detail"}}``."""
    case = check_case(name, batch, seed)
    expected = expected_clipped(case)
    out: Dict[str, dict] = {}
    for key in keys:
        m = None
        try:
            m = METHODS[key](case)
            m.release()
            m.run()
            got = m.result()
            missing = [n for n in expected if n not in got]
            err = max((peers.rel_err(got[n], expected[n]) for n in expected if n in got),
                      default=float("inf"))
            tol = OPACUS_TOL if key.startswith("opacus") else TOL
            out[key] = {"status": "ok" if err <= tol and not missing else "MISMATCH",
                        "max_rel_err": float("inf") if missing else err, "missing": missing}
        except Exception as e:  # noqa: BLE001  (every failure is reported)
            out[key] = peers.classify(key, e)
        finally:
            if m is not None:
                m.close()
    return out


# ------------------------------------------------------------------------------------ reporting
def _short(detail: str, n: int = 90) -> str:
    detail = detail.replace("|", "/")
    return detail if len(detail) <= n else detail[:n - 3] + "..."


def markdown(report: dict) -> str:
    keys = report["methods"]
    lines = [f"# DP clipping: gradhooks against Opacus ({report['title']})", "",
             f"{report['when']}, gradhooks {report['rev']}, torch {torch.__version__}, "
             f"opacus {report['opacus']}, {report['machine']}, {report['threads']} threads, "
             f"medians of {report['repeats']} interleaved repeats after {report['warmup']} "
             f"warm-up calls. Ratio = median time / plain training's (forward + "
             f"loss.backward()) in the same run; memory = peak RSS of one step above a "
             f"pre-warmed baseline, each method in a fresh process, and its ratio to plain's. "
             f"Error: max relative error of param.grad against the looped clipped mean "
             f"(float64, B={report['check_batch']}, C = median per-sample norm).", ""]
    if report.get("note"):
        lines += [f"**{report['note']}**", ""]
    head = ["workload", "B", "plain ms"] + [f"{k} time" for k in keys if k != "plain"]
    head += ["plain MB"] + [f"{k} MB" for k in keys if k != "plain"]
    rows = []
    for wl, rec in report["workloads"].items():
        t, mem = rec["time"], rec.get("memory", {})
        row = [wl, str(rec["batch"]), f"{t['plain']['median_ms']:.3g}"
               if t.get("plain", {}).get("status") == "ok" else "error"]
        for k in keys:
            if k == "plain":
                continue
            r = t.get(k, {})
            row.append(f"{r['ratio']:.2f}x" if r.get("status") == "ok" and "ratio" in r
                       else r.get("status", "-"))
        pm = mem.get("plain", {})
        row.append(f"{pm['step_mb']:.1f}" if pm.get("status") == "ok" else "-")
        for k in keys:
            if k == "plain":
                continue
            r = mem.get(k, {})
            row.append(f"{r['step_mb'] / pm['step_mb']:.2f}x" if r.get("status") == "ok"
                       and pm.get("status") == "ok" and pm["step_mb"] > 0 else
                       r.get("status", "-"))
        rows.append(row)
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", "## Correctness (float64, against the looped clipped mean)", "",
              "| workload | " + " | ".join(k for k in keys if k != "plain") + " |",
              "|---|" + "---|" * (len(keys) - 1)]
    for wl, rec in report["workloads"].items():
        cells = []
        for k in keys:
            if k == "plain":
                continue
            r = rec["check"].get(k, {})
            if "max_rel_err" in r:
                cells.append(f"{r['max_rel_err']:.1e}" + ("" if r["status"] == "ok"
                                                           else f" {r['status']}"))
            else:
                cells.append(f"{r.get('status', '-')}: {_short(r.get('detail', ''))}")
        lines.append(f"| {wl} | " + " | ".join(cells) + " |")
    failures = [(wl, k, r.get("detail", "")) for wl, rec in report["workloads"].items()
                for part in ("time", "memory") for k, r in rec.get(part, {}).items()
                if r.get("status") not in ("ok", None)]
    if failures:
        lines += ["", "## Failures while timing / measuring memory", ""]
        lines += [f"- {wl}, {k}: {_short(d, 200)}" for wl, k, d in failures]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", type=peers._names(list(DP_WORKLOADS)),
                   default=list(DP_WORKLOADS))
    p.add_argument("--methods", type=peers._names(list(METHODS)), default=list(METHODS))
    p.add_argument("--repeats", type=peers._positive, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--check-batch", type=peers._positive, default=6)
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--title", default="full run")
    p.add_argument("--note", default="", help="a line printed in bold under the header")
    p.add_argument("--out", default=os.path.join(HERE, "results", "dp.md"))
    p.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.memory_child is not None:
        print(json.dumps(peers.memory_child(json.loads(args.memory_child))))
        return 0
    peers._quiet()
    if args.threads:
        torch.set_num_threads(args.threads)
    keys = ["plain"] + [k for k in args.methods if k != "plain"]
    import opacus
    report = {"title": args.title, "note": args.note, "methods": keys,
              "when": datetime.date.today().isoformat(), "rev": peers._git_rev(),
              "opacus": opacus.__version__, "machine": f"{platform.machine()} "
              f"{os.cpu_count()} cores", "threads": torch.get_num_threads(),
              "repeats": args.repeats, "warmup": args.warmup, "check_batch": args.check_batch,
              "workloads": {}}
    bad = False
    for name in args.workloads:
        wl = DP_WORKLOADS[name]
        print(f"[{name}] checking", file=sys.stderr, flush=True)
        rec = {"batch": wl.batch_size,
               "check": check_methods(name, [k for k in keys if k != "plain"],
                                      args.check_batch, args.seed)}
        bad |= any(r.get("status") != "ok" for k, r in rec["check"].items()
                   if k.startswith("gh_"))
        case = peers.Case(wl, wl.batch_size, torch.device("cpu"), args.seed)
        clip_norm(case)
        rec["time"] = peers.time_case(case, keys, args.repeats, args.repeats, args.warmup,
                                      lambda msg: print(f"  {msg}", file=sys.stderr, flush=True))
        for r in rec["time"].values():
            r.pop("traceback", None)
        if not args.no_memory:
            rec["memory"] = {k: peers.measure_memory(name, k, wl.batch_size,
                                                     report["threads"], "cpu", args.seed,
                                                     script=__file__) for k in keys}
        report["workloads"][name] = rec
        print(markdown({**report, "workloads": {name: rec}}).split("\n## ")[0].splitlines()[-1],
              file=sys.stderr, flush=True)
    text = markdown(report)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(text)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
