"""Per-sample gradients side by side: gradhooks against looped autograd, torch.func, Opacus,
BackPACK and ExpandedWeights on the five workloads of issue 5 (see benchmarks/README.md).

    python benchmarks/peers.py [--workloads mlp,cnn,lstm,transformer,wide_mlp] [--methods ...]
        [--repeats 10] [--loop-repeats N] [--warmup 3] [--threads T]
        [--batch-sizes 16,32,64,128,256 | --batch-sizes default] [--no-memory]
        [--device cpu|cuda] [--seed 0] [--out benchmarks/results]

For every workload and batch size, each method gets its own copy of one seeded model (Opacus and
BackPACK modify theirs) and the same batch; the methods are timed interleaved (round robin per
repetition, start rotated), after ``--warmup`` untimed calls each; the median is reported. A timed
call is everything a training step needs to have the method's result: forward, backward and the
per-sample quantity (gradients, norms, or the clipped gradient sum). Before each call, untimed,
the user's side of a training loop is done: ``param.grad = None`` and the reference to the last
result dropped (``optimizer.zero_grad(set_to_none=True)``); for the peers also their per-sample
attribute (Opacus' ``zero_grad``, ``grad_sample`` of ExpandedWeights, which would otherwise
accumulate, ``grad_batch`` of BackPACK). gradhooks drops its records of the previous step (and
recycles its result buffers) itself at the next forward, so that is inside its timing.

Each method's result of its last timed call is checked against looped autograd (float32,
``max |diff| / max |loop|`` per parameter, maximum over parameters). Peak memory: each method in a
fresh subprocess at the workload's own batch size (see :func:`memory_child`).

Writes ``peers.md`` (tables), ``peers.json`` (every time, error and memory figure) and
``peers_time_vs_batch.png`` to ``--out``. Exit code 1 if a gradhooks result differs from the loop
by more than the tolerance (1e-4), else 0.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import datetime
import gc
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import Tensor, nn

import gradhooks  # noqa: E402
from gradhooks.tools.workloads import BENCH_WORKLOADS as WORKLOADS  # noqa: E402
from gradhooks.tools.workloads import Workload  # noqa: E402

TOL = 1e-4          # float32 max relative error against the loop (as `gradhooks bench`)
CLIP_NORM = 1.0     # C of the clipping methods
SWEEP = (16, 32, 64, 128, 256)
Grads = Dict[str, Tensor]


class Unsupported(Exception):
    """The method cannot compute this workload's per-sample gradients (reported "unsupported")."""


# ----------------------------------------------------------------------------------------- case
class Case:
    """A workload at one batch size: the seeded float32 model (never run itself: every method
    works on its own ``copy()``), inputs ``x`` and targets ``y`` batched on dim 0."""

    def __init__(self, workload: Workload, batch: int, device: torch.device, seed: int):
        self.workload, self.batch, self.device = workload, batch, device
        torch.manual_seed(seed)
        self.model = workload.make_model().to(device)
        x, y = workload.load(torch.float32, batch)
        if x.shape[0] != batch:
            raise ValueError(f"workload {workload.name}: its data has only {x.shape[0]} samples, "
                             f"batch size {batch} asked for")
        self.x, self.y = x.to(device), y.to(device)

    def loss(self, out: Tensor) -> Tensor:
        return self.workload.loss_fn(out, self.y)

    def copy(self) -> nn.Module:
        return copy.deepcopy(self.model)


# -------------------------------------------------------------------------------------- methods
class Method:
    """One way of computing per-sample quantities. ``run()`` is what is timed; ``result()``
    (untimed) returns what is checked against the loop: ``{name: (B, *shape)}`` for
    ``kind="grads"``, ``(B,)`` norms for ``"norms"``, ``{name: clipped sum}`` for ``"clipped"``;
    ``release()`` (untimed) drops what the last call kept, like ``zero_grad(set_to_none=True)``."""

    key = ""
    label = ""
    kind: Optional[str] = None
    peer = False  # a peer library: an exception while setting up or warming up means "unsupported"

    def __init__(self, case: Case):
        self.case = case
        self.model = case.copy()
        self.out = None
        self.notes: List[str] = []

    def forward_backward(self) -> None:
        self.case.loss(self.model(self.case.x)).backward()

    def run(self) -> None:
        raise NotImplementedError

    def result(self):
        return self.out

    def release(self) -> None:
        self.out = None
        for p in self.model.parameters():
            p.grad = None

    def forget(self) -> None:
        """Drop everything the method keeps between steps (used once, before the memory
        baseline, after the pre-warm step); default: :meth:`release`."""
        self.release()

    def close(self) -> None:
        pass


class Plain(Method):
    key, label = "plain", "plain batch gradient"

    def run(self) -> None:
        self.forward_backward()


class _GradHooks(Method):
    def __init__(self, case: Case):
        super().__init__(case)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", gradhooks.FallbackWarning)
            self.gh = gradhooks.attach(self.model, loss_reduction=case.workload.loss_reduction)
        self.notes += [f"gradhooks: {w.message}" for w in caught
                       if issubclass(w.category, gradhooks.FallbackWarning)]

    # release(): only the user's side (param.grad, the reference to the result); gradhooks drops
    # its records and recycles the result's buffers itself at the next forward, inside the timing.

    def forget(self) -> None:
        self.release()
        self.gh.clear()
        self.gh.recorder.pool.clear()

    def close(self) -> None:
        self.gh.detach()


class GhAttached(_GradHooks):
    key, label = "gh_attached", "gradhooks: hooks attached, nothing read"

    def run(self) -> None:
        self.forward_backward()


class GhGrads(_GradHooks):
    key, label, kind = "gh_grads", "gradhooks: per-sample grads (gh.backward)", "grads"

    def gh_backward(self) -> None:
        # GradHooks.backward: grad_outputs without autograd's batch gradient (param.grad stays
        # None, as with vmap and ExpandedWeights).
        self.gh.backward(self.case.loss(self.model(self.case.x)))

    def run(self) -> None:
        self.gh_backward()
        self.out = self.gh.per_sample_grads()


class GhGradsBatch(_GradHooks):
    key, label, kind = "gh_grads_batch", "gradhooks: per-sample grads + batch grad (loss.backward)", "grads"

    def run(self) -> None:
        self.forward_backward()
        self.out = self.gh.per_sample_grads()


class GhNorms(GhGrads):
    key, label, kind = "gh_norms", "gradhooks: per-sample norms (gh.backward)", "norms"

    def run(self) -> None:
        self.gh_backward()
        self.out = self.gh.per_sample_grad_norms()


class GhGhost(GhGrads):
    key, label, kind = "gh_ghost", "gradhooks: ghost clipping (gh.backward)", "clipped"
    clip_method = "ghost"

    def run(self) -> None:
        self.gh_backward()
        self.gh.clip_and_accumulate(CLIP_NORM, method=self.clip_method)

    def result(self) -> Grads:
        return {n: p.grad for n, p in self.model.named_parameters() if p.grad is not None}


class GhTwoPass(GhGhost):
    key, label = "gh_two_pass", "gradhooks: two-pass ghost clipping (gh.clipped_backward)"

    def run(self) -> None:
        wl, case = self.case.workload, self.case
        self.gh.clipped_backward(wl.per_sample_loss(self.model(case.x), case.y), CLIP_NORM)


class GhClip(GhGhost):
    key, label = "gh_clip", "gradhooks: materialised clipping (gh.backward)"
    clip_method = "materialize"


class NoopHooks(Method):
    """What any hook-based method pays before it does any work: on every module with parameters
    of its own (the modules gradhooks hooks), a forward hook that puts a tensor hook on the
    output, both doing nothing. Not a peer: the floor of a "hooks attached" time on this
    machine (torch's hook dispatch on the forward and in autograd)."""

    key, label = "noop_hooks", "reference: no-op torch hooks (floor of hooks only)"

    def __init__(self, case: Case):
        super().__init__(case)

        def on_grad(grad: Tensor) -> None:
            return None

        def on_forward(module: nn.Module, args: tuple, out) -> None:
            t = out[0] if isinstance(out, tuple) else out
            if isinstance(t, Tensor) and t.requires_grad:
                t.register_hook(on_grad)

        self.handles = [m.register_forward_hook(on_forward) for m in self.model.modules()
                        if next(m.parameters(recurse=False), None) is not None]

    def run(self) -> None:
        self.forward_backward()

    def close(self) -> None:
        for h in self.handles:
            h.remove()


class Loop(Method):
    key, label, kind = "loop", "looped autograd", "grads"

    def run(self) -> None:
        wl = self.case.workload
        self.out = gradhooks.looped_per_sample_grads(self.model, wl.loss_fn, self.case.x,
                                                     self.case.y, loss_reduction=wl.loss_reduction)


class Vmap(Method):
    key, label, kind = "vmap", "torch.func vmap(grad)", "grads"

    def __init__(self, case: Case):
        super().__init__(case)
        from torch.func import functional_call, grad, vmap

        params = {k: v.detach() for k, v in self.model.named_parameters() if v.requires_grad}
        loss_fn, model = case.workload.loss_fn, self.model

        def sample_loss(p: Grads, xn: Tensor, yn: Tensor) -> Tensor:
            return loss_fn(functional_call(model, p, (xn.unsqueeze(0),)), yn.unsqueeze(0))

        per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0))
        self._call = lambda: per_sample(params, case.x, case.y)

    def run(self) -> None:
        self.out = self._call()


class Opacus(Method):
    key, label, kind, peer = "opacus", "Opacus GradSampleModule (hooks)", "grads", True

    def __init__(self, case: Case):
        super().__init__(case)
        from opacus import GradSampleModule
        from opacus.layers import DPGRU, DPLSTM, DPRNN, DPMultiheadAttention
        from opacus.validators import ModuleValidator

        wl = case.workload
        batch_first = wl.make_seq_first_model is None
        if not batch_first:
            self.model = wl.make_seq_first_model().to(case.device)
            self.model.load_state_dict(case.model.state_dict())
            self.notes.append("Opacus: runs the model in (T, B, d) layout (batch_first=False): "
                              "DPMultiheadAttention(batch_first=True) computes a different "
                              "function in opacus 1.6")
        fixed = ModuleValidator.fix(self.model)  # nn.LSTM -> DPLSTM, MHA -> DPMultiheadAttention
        before = dict(self.model.named_modules())
        swapped = sorted({f"{type(before[n]).__name__} -> {type(m).__name__}"
                          for n, m in fixed.named_modules()
                          if n in before and type(before[n]) is not type(m)})
        if swapped:
            self.notes.append(f"Opacus: ModuleValidator.fix swapped {', '.join(swapped)}")
        errors = ModuleValidator.validate(fixed, strict=False)
        if errors:
            raise Unsupported("; ".join(str(e) for e in errors))
        self.gsm = GradSampleModule(fixed, batch_first=batch_first,
                                    loss_reduction=wl.loss_reduction)
        functorch = sorted({type(m).__name__ for m in self.gsm.iterate_submodules(fixed)
                            if type(m) not in self.gsm.GRAD_SAMPLERS
                            and type(m) not in (DPRNN, DPLSTM, DPGRU)})
        if functorch:
            self.notes.append(f"Opacus: functorch (vmap) fallback for {', '.join(functorch)}")
        self.model = fixed
        self._mha = [n for n, m in fixed.named_modules() if isinstance(m, DPMultiheadAttention)]

    def run(self) -> None:
        self.case.loss(self.gsm(self.case.x)).backward()

    def release(self) -> None:
        self.gsm.zero_grad(set_to_none=True)

    def result(self) -> Grads:
        gs = {n: p.grad_sample for n, p in self.model.named_parameters()
              if p.requires_grad and getattr(p, "grad_sample", None) is not None}
        return merge_qkv(gs, self._mha, dim=1)

    def close(self) -> None:
        self.gsm._close()


def merge_qkv(tensors: Grads, prefixes: Sequence[str], dim: int) -> Grads:
    """Opacus' ``DPMultiheadAttention`` (under the module names ``prefixes``) has q/k/v
    Linears where ``nn.MultiheadAttention`` has ``in_proj_weight`` / ``in_proj_bias``: their
    tensors (``{name: tensor}``, changed in place and returned) are concatenated on ``dim``
    (0 for gradients, 1 for per-sample gradients) under torch's names."""
    for prefix in prefixes:
        pre = f"{prefix}." if prefix else ""
        for what in ("weight", "bias"):
            parts = [tensors.pop(f"{pre}{q}linear.{what}", None) for q in "qkv"]
            if all(t is not None for t in parts):
                tensors[f"{pre}in_proj_{what}"] = torch.cat(parts, dim=dim)
    return tensors


class BackPACK(Method):
    key, label, kind, peer = "backpack", "BackPACK BatchGrad", "grads", True

    def __init__(self, case: Case):
        super().__init__(case)
        from backpack import extend

        self.model = extend(self.model)

    def run(self) -> None:
        from backpack import backpack
        from backpack.extensions import BatchGrad

        with backpack(BatchGrad()):
            self.forward_backward()

    def release(self) -> None:
        super().release()
        for p in self.model.parameters():
            if hasattr(p, "grad_batch"):
                del p.grad_batch

    def result(self) -> Grads:
        # BackPACK returns each sample's share of a mean-reduced loss (1/B of its gradient).
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        missing = [n for n, p in named if getattr(p, "grad_batch", None) is None]
        if missing:
            types = sorted({type(self.model.get_submodule(n.rpartition(".")[0])).__name__
                            for n in missing})
            raise Unsupported(f"no BatchGrad extension for {', '.join(types)} "
                              f"(parameters {', '.join(missing)})")
        scale = self.case.batch if self.case.workload.loss_reduction == "mean" else 1
        return {n: p.grad_batch * scale for n, p in named}


class ExpandedWeights(Method):
    key, label, kind, peer = "ew", "ExpandedWeights", "grads", True

    def run(self) -> None:
        from torch.nn.utils._per_sample_grad import call_for_per_sample_grads

        wl = self.case.workload
        out = call_for_per_sample_grads(self.model, batch_size=self.case.batch,
                                        loss_reduction=wl.loss_reduction)(self.case.x)
        self.case.loss(out).backward()

    def release(self) -> None:
        super().release()
        for p in self.model.parameters():
            p.grad_sample = None

    def result(self) -> Grads:
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        missing = [n for n, p in named if getattr(p, "grad_sample", None) is None]
        if missing:
            raise Unsupported(f"no grad_sample for {', '.join(missing)}")
        return {n: p.grad_sample for n, p in named}


METHODS: Dict[str, type] = {m.key: m for m in (
    Plain, GhAttached, GhGrads, GhGradsBatch, GhNorms, GhGhost, GhTwoPass, GhClip, NoopHooks,
    Loop, Vmap, Opacus, BackPACK, ExpandedWeights)}
GRADHOOKS_KEYS = ("gh_attached", "gh_grads", "gh_grads_batch", "gh_norms", "gh_ghost",
                  "gh_two_pass", "gh_clip")
# gradhooks' DP API: AttributeError / NotImplementedError from these means "n/a" (not there yet)
DP_API_KEYS = ("gh_norms", "gh_ghost", "gh_two_pass", "gh_clip")
SHORT = {"loop": "loop", "vmap": "vmap", "opacus": "Opacus hooks", "backpack": "BackPACK",
         "ew": "ExpandedWeights"}
PEER_KEYS = tuple(SHORT)
SUMMARY_KEYS = ("gh_grads", "gh_attached", "noop_hooks", "gh_norms", "gh_ghost", "gh_two_pass")
SUMMARY_LABELS = {"gh_grads": "gradhooks grads", "gh_attached": "gradhooks hooks only",
                  "noop_hooks": "no-op hooks (floor of hooks only)",
                  "gh_norms": "gradhooks norms", "gh_ghost": "gradhooks ghost clip (book-keeping)",
                  "gh_two_pass": "gradhooks ghost clip (two-pass)"}


def classify(key: str, exc: BaseException) -> Dict[str, str]:
    """Status of a method that raised ``exc``: ``n/a`` (gradhooks' norms/clipping API not there
    yet), ``unsupported`` (a peer refusing the model) or ``error``; with a one-line detail."""
    if key in DP_API_KEYS and isinstance(exc, (AttributeError, NotImplementedError)):
        status = "n/a"
    elif isinstance(exc, Unsupported) or METHODS[key].peer:
        status = "unsupported"
    else:
        status = "error"
    detail = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return {"status": status, "detail": detail[:300],
            "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))}


# ------------------------------------------------------------------------------------- checking
def rel_err(actual: Tensor, expected: Tensor) -> float:
    """``max |actual - expected| / max |expected|`` in float64, chunked over dim 0 (per-sample
    gradients of the CNN at B=256 are 1.2 GB in float32)."""
    if actual.shape != expected.shape:
        return math.inf
    diff = scale = 0.0
    for a, e in zip(actual.split(16), expected.split(16)):
        e64 = e.detach().double()
        diff = max(diff, (a.detach().double() - e64).abs().max().item())
        scale = max(scale, e64.abs().max().item())
    if scale == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / scale


def _ref_norms(ref: Grads) -> Tensor:
    sq = [g.detach().double().flatten(1).pow(2).sum(1) for g in ref.values()]
    return torch.stack(sq).sum(0).sqrt()


def check(kind: str, out, ref: Grads, case: Case) -> Dict[str, object]:
    """Max relative error of a method's result against the loop's per-sample gradients ``ref``;
    ``missing``: parameters of the loop the method did not return."""
    if kind == "grads":
        missing = [n for n in ref if n not in out]
        err = max([rel_err(out[n], ref[n]) for n in ref if n in out], default=math.inf)
        return {"max_rel_err": math.inf if missing else err, "missing": missing}
    if kind == "norms":
        return {"max_rel_err": rel_err(out.detach().reshape(-1).cpu(), _ref_norms(ref).cpu()),
                "missing": []}
    # clipped: sum_n min(1, C / ||g_n||) g_n, divided by B for a mean-reduced loss
    factor = (CLIP_NORM / _ref_norms(ref)).clamp(max=1.0)
    if case.workload.loss_reduction == "mean":
        factor = factor / case.batch
    missing = [n for n in ref if n not in out]
    errs = [rel_err(out[n], torch.einsum("n,n...->...", factor, ref[n].double())) for n in ref
            if n in out]
    return {"max_rel_err": math.inf if missing else max(errs, default=math.inf), "missing": missing}


# -------------------------------------------------------------------------------------- timing
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_case(case: Case, keys: Sequence[str], repeats: int, loop_repeats: int, warmup: int,
              tick: Callable[[str], None]) -> Dict[str, dict]:
    """Time the methods ``keys`` on ``case`` interleaved; returns ``{key: record}`` with
    ``status``, ``median_ms``, ``times_ms``, ``max_rel_err``, ``missing``, ``notes``."""
    wl = case.workload
    ref = gradhooks.looped_per_sample_grads(case.copy(), wl.loss_fn, case.x, case.y,
                                            loss_reduction=wl.loss_reduction)
    records: Dict[str, dict] = {}
    methods: Dict[str, Method] = {}
    for key in keys:
        tick(f"{wl.name} B={case.batch}: set up {key}")
        m = None
        try:
            m = METHODS[key](case)
            for _ in range(warmup):
                m.release()
                m.run()
            if m.kind is not None:
                m.result()  # peers raise Unsupported here when they skipped parameters
            m.release()
            methods[key] = m
            records[key] = {"status": "ok", "notes": m.notes, "times_ms": []}
        except Exception as e:  # noqa: BLE001  (every failure is reported, none stops the suite)
            records[key] = {**classify(key, e), "notes": m.notes if m is not None else []}
            if m is not None:
                m.close()
    active = list(methods)
    for rep in range(repeats):
        for i in range(len(active)):
            key = active[(rep + i) % len(active)]
            if key not in methods:
                continue
            n_reps = loop_repeats if key == "loop" else repeats
            if rep >= n_reps:
                continue
            m, rec = methods[key], records[key]
            tick(f"{wl.name} B={case.batch}: {key}")
            others = contextlib.ExitStack()  # other gradhooks methods' global module hooks
            try:                                 # removed: they would slow this method's model
                m.release()
                gc.disable()
                _sync(case.device)
                for other in methods.values():
                    if other is not m and isinstance(other, _GradHooks):
                        others.enter_context(other.gh.recorder.suspended())
                t0 = time.perf_counter()
                m.run()
                _sync(case.device)
                rec["times_ms"].append((time.perf_counter() - t0) * 1e3)
                others.close()
                gc.enable()
                if rep == n_reps - 1 and m.kind is not None:
                    rec.update(check(m.kind, m.result(), ref, case))
                m.release()
            except Exception as e:  # noqa: BLE001
                gc.enable()
                others.close()
                rec.update(classify(key, e))
                m.close()
                del methods[key]
    for key, m in methods.items():
        m.close()
        rec = records[key]
        rec["median_ms"] = statistics.median(rec["times_ms"])
    plain = records.get("plain", {}).get("median_ms")
    for rec in records.values():
        if "median_ms" in rec and plain:
            rec["ratio"] = rec["median_ms"] / plain
    return records


# -------------------------------------------------------------------------------------- memory
def _proc_status_kb(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            return next((int(l.split()[1]) for l in f if l.startswith(field + ":")), None)
    except OSError:
        return None


def _rss_bytes() -> int:
    return (_proc_status_kb("VmRSS") or 0) * 1024


def _peak_bytes() -> int:
    # VmHWM: the peak RSS of this process image. ru_maxrss is not used where VmHWM exists: it
    # also keeps the peak of the image before exec(), i.e. the RSS of the parent that spawned us.
    hwm = _proc_status_kb("VmHWM")
    if hwm is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return hwm * 1024


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: reset the peak RSS (VmHWM) to the current RSS
        return True
    except OSError:
        return False


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap pages back to the OS
    except (OSError, AttributeError):
        pass


def memory_child(spec: dict) -> dict:
    """In a fresh process: build the case and the method, take the RSS (``baseline``), run one
    warm-up step and release its result, reset the peak RSS, run the measured step. Returns
    ``step_mb`` = peak RSS of the measured step - baseline: what one training step needs on top
    of model and data, including what the method keeps between steps (``retained_mb``: e.g.
    a buffer pool). On CUDA also ``gpu_step_mb``, the same for GPU memory allocated."""
    torch.set_num_threads(spec["threads"])
    _quiet()
    device = torch.device(spec["device"])
    case = Case(WORKLOADS[spec["workload"]], spec["batch"], device, spec["seed"])
    m = METHODS[spec["method"]](case)
    # Pre-warm: one step whose state is then dropped, so that one-time costs (lazy imports,
    # code pages of kernels used for the first time, thread pools) stay out of the baseline's
    # difference: they are RSS but not memory a step needs.
    m.run()
    m.forget()
    _trim()
    _sync(device)
    baseline = _rss_bytes()
    gpu_baseline = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    resettable = _reset_peak()
    if resettable:  # without a peak reset the warm-up's peak would hide the measured step's
        m.release()
        m.run()
    m.release()
    _trim()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _reset_peak()
    before = _rss_bytes()
    m.run()
    _sync(device)
    peak = _peak_bytes()
    out = {"baseline_mb": baseline / 2**20, "retained_mb": (before - baseline) / 2**20,
           "peak_mb": peak / 2**20, "step_mb": (peak - baseline) / 2**20,
           "warm_step": resettable}
    if device.type == "cuda":
        out["gpu_step_mb"] = (torch.cuda.max_memory_allocated(device) - gpu_baseline) / 2**20
    return out


#: bytes; allocations from this size up are mmapped by glibc and returned to the OS when freed.
MMAP_THRESHOLD = 128 * 1024


def measure_memory(workload: str, key: str, batch: int, threads: int, device: str,
                   seed: int, script: str = __file__) -> dict:
    """:func:`memory_child` of method ``key`` in a fresh process: ``script --memory-child
    SPEC`` (this file, or ``benchmarks/dp.py`` for its own methods and workloads)."""
    spec = {"workload": workload, "method": key, "batch": batch, "threads": threads,
            "device": device, "seed": seed}
    try:
        # A fixed mmap threshold: glibc's default raises it after each large free, so that
        # later tensors of that size come from the heap and stay resident after they are freed
        # (RSS then counts dead tensors; the same setting for every method).
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
        proc = subprocess.run([sys.executable, os.path.abspath(script), "--memory-child",
                               json.dumps(spec)], capture_output=True, text=True, timeout=1800,
                              env=env)
    except subprocess.TimeoutExpired:
        return {"status": "error", "detail": "memory subprocess timed out"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"status": "error", "detail": f"memory subprocess failed: {tail[:300]}"}
    return {"status": "ok", **json.loads(lines[-1])}


# ------------------------------------------------------------------------------------- reporting
def _fmt_ratio(rec: Optional[dict], key: str = "ratio") -> str:
    if rec is None:
        return "-"
    if rec.get("status") != "ok":
        return rec.get("status", "-")
    value = rec.get(key)
    return "-" if value is None else f"{value:.3g}x" if value < 10 else f"{value:.0f}x"


def _fmt_err(rec: dict) -> str:
    if rec.get("status") != "ok" or "max_rel_err" not in rec:
        return "-"
    err = rec["max_rel_err"]
    text = "missing " + ", ".join(rec["missing"]) if rec.get("missing") else f"{err:.1e}"
    return text if err <= TOL else f"{text} MISMATCH"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool]) -> str:
    widths = [max(map(len, col)) for col in zip(header, *rows)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if r else c.ljust(w)
                                 for c, w, r in zip(cells, widths, right)) + " |"

    rule = "|" + "|".join("-" * (w + 1) + (":" if r else "-") for w, r in zip(widths, right)) + "|"
    return "\n".join([line(header), rule, *map(line, rows)])


def summary_table(report: dict) -> str:
    """The issue's table with gradhooks columns: one row per workload at its own batch size."""
    rows = []
    for wl_name, cases in report["cases"].items():
        wl = WORKLOADS[wl_name]
        recs = cases.get(str(wl.batch_size))
        if recs is None:
            continue
        plain = recs.get("plain", {})
        peers = sorted(((recs[k]["ratio"], SHORT[k]) for k in PEER_KEYS
                        if recs.get(k, {}).get("status") == "ok" and "ratio" in recs[k]
                        and recs[k].get("max_rel_err", math.inf) <= TOL and k != "loop"))
        best = f"{peers[0][1]} {peers[0][0]:.3g}x" if peers else "-"
        others = []
        for k in PEER_KEYS:
            rec = recs.get(k)
            if rec is None or (peers and SHORT[k] == peers[0][1]):
                continue
            others.append(f"{SHORT[k]} {_fmt_ratio(rec)}" +
                          (" (wrong)" if rec.get("max_rel_err", 0) > TOL else ""))
        plain_ms = f"{plain['median_ms']:.3g} ms" if "median_ms" in plain else "-"
        mb = {k: _step_mb(report, wl_name, k) for k in recs}
        peer_mb = sorted((mb[k], SHORT[k]) for k in PEER_KEYS if k != "loop" and mb.get(k)
                         and recs[k].get("max_rel_err", math.inf) <= TOL)
        grads_mb = "-" if mb.get("gh_grads") is None else f"{mb['gh_grads']:.3g}" + (
            f" ({peer_mb[0][1]} {peer_mb[0][0]:.3g})" if peer_mb else "")
        ghost_mb = ["-" if not mb.get(k) or not mb.get("plain") else f"{mb[k] / mb['plain']:.2f}x"
                    for k in ("gh_ghost", "gh_two_pass")]
        rows.append([f"{wl_name}, B={wl.batch_size}", plain_ms,
                     *(_fmt_ratio(recs.get(k)) for k in SUMMARY_KEYS), best, ", ".join(others),
                     grads_mb, *ghost_mb])
    header = ["workload", "plain batch", *(SUMMARY_LABELS[k] for k in SUMMARY_KEYS),
              "best peer (ratio)", "others", "grads peak MB (lowest peer)",
              "book-keeping MB x plain", "two-pass MB x plain"]
    return _table(header, rows, [False, True, *[True] * len(SUMMARY_KEYS), False, False, True,
                                 True, True])


def _step_mb(report: dict, workload: str, key: str) -> Optional[float]:
    m = report["memory"].get(workload, {}).get(key, {})
    return m.get("gpu_step_mb", m.get("step_mb"))


def detail_table(report: dict) -> str:
    """Every method at each workload's own batch size: time, ratio, error, peak memory."""
    rows = []
    for wl_name, cases in report["cases"].items():
        wl = WORKLOADS[wl_name]
        recs = cases.get(str(wl.batch_size), {})
        base = _step_mb(report, wl_name, "plain")
        for key, rec in recs.items():
            mb = _step_mb(report, wl_name, key)
            ok = rec["status"] == "ok"
            rows.append([wl_name, METHODS[key].label,
                         f"{rec['median_ms']:.3f}" if ok else rec["status"],
                         _fmt_ratio(rec) if ok else "-", _fmt_err(rec),
                         "-" if mb is None else f"{mb:.1f}",
                         "-" if mb is None or not base else f"{mb / base:.2f}x"])
    header = ["workload", "method", "median ms", "x plain", "max rel err vs loop", "peak MB",
              "MB x plain"]
    return _table(header, rows, [False, False, True, True, True, True, True])


def sweep_table(report: dict) -> str:
    """Median ms per method (rows) and batch size (columns), per workload."""
    parts = []
    for wl_name, cases in report["cases"].items():
        sizes = sorted(cases, key=int)
        keys = list(dict.fromkeys(k for s in sizes for k in cases[s]))
        rows = [[METHODS[k].label] + [f"{cases[s][k]['median_ms']:.3g}"
                                      if cases[s].get(k, {}).get("status") == "ok"
                                      else cases[s].get(k, {}).get("status", "-") for s in sizes]
                for k in keys]
        parts.append(f"**{wl_name}** (median ms)\n\n" +
                     _table(["method"] + [f"B={s}" for s in sizes], rows,
                            [False] + [True] * len(sizes)))
    return "\n\n".join(parts)


def notes_text(report: dict) -> str:
    lines = []
    for wl_name, cases in report["cases"].items():
        seen = set()
        for recs in cases.values():
            for key, rec in recs.items():
                items = list(rec.get("notes", []))
                if rec["status"] != "ok":
                    items.append(f"{METHODS[key].label}: {rec['status']} ({rec['detail']})")
                for note in items:
                    if note not in seen:
                        seen.add(note)
                        lines.append(f"- {wl_name}: {note}")
        for key, m in report["memory"].get(wl_name, {}).items():
            if m.get("status") != "ok":
                lines.append(f"- {wl_name}: memory of {METHODS[key].label}: {m.get('detail')}")
    return "\n".join(lines) or "- none"


def markdown(report: dict) -> str:
    meta = report["meta"]
    return "\n".join([
        "# gradhooks against its peers",
        "",
        f"{meta['date']} | gradhooks {meta['gradhooks']} ({meta['git']}) | torch {meta['torch']} | "
        f"{meta['device_name']} | torch.set_num_threads({meta['threads']}) | float32 | medians of "
        f"{meta['repeats']} interleaved repetitions (loop: {meta['loop_repeats']}) after "
        f"{meta['warmup']} warm-up | seed {meta['seed']}",
        "",
        f"Command: `{meta['command']}`",
        "",
        "Ratio = median time of forward + backward + the method's per-sample result / median time "
        "of the plain batch gradient (forward + backward), same run. Peers whose result differs "
        f"from the loop by more than {TOL:g} are not counted as best peer or lowest memory. "
        "Peak MB: see below.",
        "",
        summary_table(report),
        "",
        "## Every method at the workload's batch size",
        "",
        "Peak MB: each method in a fresh process at the workload's batch size: peak RSS of a "
        "step (after one warm-up step) above the RSS once model, data and method are set up, so "
        "it includes what the method keeps between steps" +
        ("; on CUDA: peak GPU memory allocated, measured the same way" if meta["device"] != "cpu"
         else "") + ". MB x plain: ratio to the plain batch gradient's.",
        "",
        detail_table(report),
        "",
        "## Time against batch size",
        "",
        sweep_table(report),
        "",
        "## Notes",
        "",
        notes_text(report),
        "",
    ])


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["cases"])
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.2 * rows), squeeze=False)
    for ax, wl_name in zip(axes.flat, names):
        cases = report["cases"][wl_name]
        sizes = sorted(cases, key=int)
        for key, cls in METHODS.items():
            pts = [(int(s), cases[s][key]["median_ms"]) for s in sizes
                   if cases[s].get(key, {}).get("status") == "ok"]
            if pts:
                style = "-" if key in GRADHOOKS_KEYS else "--" if key != "plain" else "-"
                ax.plot(*zip(*pts), style, marker="o", markersize=3, label=cls.label,
                        linewidth=2.2 if key in ("plain", "gh_grads") else 1.2,
                        color="black" if key == "plain" else None)
        ax.set_xscale("log", base=2)
        ax.set_xticks([int(s) for s in sizes], [s for s in sizes])
        ax.minorticks_off()
        ax.set_yscale("log")
        ax.set_title(WORKLOADS[wl_name].title, fontsize=10)
        ax.set_xlabel("batch size")
        ax.set_ylabel("median ms per step")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    handles: dict = {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=4, fontsize=8)
    meta = report["meta"]
    fig.suptitle(f"per-sample gradients: time per step vs batch size (torch {meta['torch']}, "
                 f"{meta['device_name']}, {meta['threads']} threads)", fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ CLI
def _names(choices: Sequence[str]) -> Callable[[str], List[str]]:
    def parse(text: str) -> List[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(choices)}")
        return names
    return parse


def _sizes(text: str) -> Optional[List[int]]:
    if text == "default":
        return None
    try:
        sizes = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers or 'default', got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError("batch sizes must be >= 1")
    return sizes


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Per-sample gradients side by side: gradhooks against looped autograd, "
                    "torch.func, Opacus, BackPACK and ExpandedWeights (see benchmarks/README.md).")
    p.add_argument("--workloads", type=_names(list(WORKLOADS)), default=list(WORKLOADS),
                   help=f"comma-separated, from {','.join(WORKLOADS)} (default: all)")
    p.add_argument("--methods", type=_names(list(METHODS)), default=list(METHODS),
                   help=f"comma-separated, from {','.join(METHODS)} (default: all; plain is "
                        "always added)")
    p.add_argument("--repeats", type=_positive, default=10, help="timed repetitions per method (default 10)")
    p.add_argument("--loop-repeats", type=_positive, default=None,
                   help="timed repetitions of the looped autograd (default: --repeats)")
    p.add_argument("--warmup", type=_positive, default=3,
                   help="untimed calls per method first (default 3: one-time work such as "
                        "gradhooks' structure checks in its first two backward passes)")
    p.add_argument("--threads", type=_positive, default=None,
                   help="torch.set_num_threads (default: torch's choice, reported)")
    p.add_argument("--batch-sizes", type=_sizes, default=list(SWEEP),
                   help="the sweep for the plot, comma-separated (default 16,32,64,128,256), or "
                        "'default' for each workload's own batch size only (always included)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed of the models (default 0)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results"),
                   help="folder for peers.md, peers.json and peers_time_vs_batch.png (default "
                        "benchmarks/results)")
    p.add_argument("--render", metavar="JSON", default=None,
                   help="only rewrite peers.md and the plot in --out from an earlier peers.json")
    p.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    return p


def _git_rev() -> str:
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        rev = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", "gradhooks"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (rev or "unknown") + ("+local changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), model)
    except OSError:
        pass
    return f"CPU {model} ({os.cpu_count()} cores)"


def _quiet() -> None:
    # Known, expected warnings (gradhooks' FallbackWarning is recorded in the notes instead).
    warnings.filterwarnings("ignore", category=gradhooks.FallbackWarning)
    for pattern in ("Extension saving to grad_batch does not have an extension",  # BackPACK
                    "There is a performance drop because we have not yet implemented",  # vmap
                    "Using a non-full backward hook", "Secure RNG turned off",
                    "Full backward hook is firing"):
        warnings.filterwarnings("ignore", message=pattern)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.memory_child is not None:
        print(json.dumps(memory_child(json.loads(args.memory_child))))
        return 0
    if args.render is not None:
        with open(args.render) as f:
            return write_outputs(json.load(f), args.out)
    from tqdm import tqdm

    _quiet()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    device = torch.device(args.device)
    keys = ["plain"] + [k for k in args.methods if k != "plain"]
    loop_repeats = args.loop_repeats or args.repeats
    plan = [(WORKLOADS[n], sorted(set(args.batch_sizes or []) | {WORKLOADS[n].batch_size}))
            for n in args.workloads]
    for wl, sizes in plan:
        try:
            n = wl.load(torch.float32, max(sizes))[0].shape[0]
        except ValueError as e:
            build_parser().error(str(e))
        if n < max(sizes):
            build_parser().error(f"workload {wl.name} has {n} samples; --batch-sizes asks for "
                                 f"{max(sizes)}")
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "gradhooks": gradhooks.__version__, "git": _git_rev(), "torch": torch.__version__,
            "python": platform.python_version(), "device": str(device),
            "device_name": _device_name(device), "threads": threads, "repeats": args.repeats,
            "loop_repeats": loop_repeats, "warmup": args.warmup, "seed": args.seed,
            "tolerance": TOL, "clip_norm": CLIP_NORM,
            "command": "python benchmarks/peers.py " + " ".join(sys.argv[1:] if argv is None
                                                                else argv)}
    print(f"gradhooks {meta['gradhooks']} ({meta['git']}) | torch {meta['torch']} | "
          f"{meta['device_name']} | {threads} threads | medians of {args.repeats} "
          f"(loop {loop_repeats}), warm-up {args.warmup}", flush=True)
    report = {"meta": meta, "cases": {}, "memory": {}}
    per_rep = len(keys) - 1 + (loop_repeats / args.repeats)
    total = sum(len(sizes) for _, sizes in plan) * round(args.repeats * per_rep + len(keys))
    with tqdm(total=total, unit="call", file=sys.stderr, dynamic_ncols=True) as bar:
        def tick(label: str) -> None:
            bar.set_description(label, refresh=False)
            bar.update(1)

        for wl, sizes in plan:
            report["cases"][wl.name] = {}
            for b in sizes:
                case = Case(wl, b, device, args.seed)
                report["cases"][wl.name][str(b)] = time_case(
                    case, keys, args.repeats, loop_repeats, args.warmup, tick)
                del case
                gc.collect()
    if not args.no_memory:
        jobs = [(wl, k) for wl, _ in plan for k in keys
                if report["cases"][wl.name][str(wl.batch_size)][k]["status"] == "ok"]
        for wl, key in tqdm(jobs, desc="peak memory (one process per method)", unit="process",
                            file=sys.stderr, dynamic_ncols=True):
            report["memory"].setdefault(wl.name, {})[key] = measure_memory(
                wl.name, key, wl.batch_size, threads, args.device, args.seed)
    return write_outputs(report, args.out)


def write_outputs(report: dict, out: str) -> int:
    """Write peers.md, peers.json and the plot to ``out``, print the tables; returns the exit
    code (1 if a gradhooks result differs from the loop by more than the tolerance)."""
    os.makedirs(out, exist_ok=True)
    text = markdown(report)
    with open(os.path.join(out, "peers.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "peers.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    plot(report, os.path.join(out, "peers_time_vs_batch.png"))
    print(text)
    names = ("peers.md", "peers.json", "peers_time_vs_batch.png")
    print(f"wrote {', '.join(os.path.join(out, n) for n in names)}")
    bad = [(wl, b, k) for wl, cases in report["cases"].items() for b, recs in cases.items()
           for k, rec in recs.items() if k in GRADHOOKS_KEYS and rec["status"] == "ok"
           and rec.get("max_rel_err", 0.0) > TOL]
    for wl, b, k in bad:
        print(f"MISMATCH: {METHODS[k].label} on {wl} B={b} differs from the loop by more than "
              f"{TOL:g}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
