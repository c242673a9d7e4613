"""Two references for per-sample gradients, and a comparison of gradhooks against both.

* :func:`batched_forward_per_sample_grads` differentiates the *same* batched forward once per
  sample: ``grad_n = d loss_fn(out[n:n+1], y[n:n+1]) / d theta`` with ``out = model(x)``. This is
  what gradhooks computes (its hooks read that forward), so it must equal it to rounding: the
  pass/fail check of :func:`compare` and of the main job.
* :func:`looped_per_sample_grads` runs one forward and one backward per sample,
  ``grad_n = d loss_fn(model(x[n:n+1]), y[n:n+1]) / d theta``, the textbook definition. Away from
  kinks it equals the first to rounding. At a kink (ReLU at 0, a tie in a max-pool window) the
  forward of one sample can round differently from the batched one and take the other side
  (another subgradient, just as valid): the difference is then reported, with the op where the
  forwards first decide differently (:mod:`gradhooks.tools.kinks`), not counted as an error.
"""
from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from ..base.errors import GradHooksError
from ..base.utils import check_loss_reduction, paused
from ..core.recorder.capture import is_hooked
from ..hooks import attach
from .kinks import KinkDifference, first_kink_difference

__all__ = ["looped_per_sample_grads", "batched_forward_per_sample_grads", "compare", "Comparison",
           "ParamError", "max_rel_error"]

Batch = Union[Tensor, Sequence[Tensor]]
#: A model's output: a tensor or a (nested) tuple / list of them.
Outputs = Union[Tensor, Sequence[Any]]


def _as_tuple(x: Batch) -> Tuple[Tensor, ...]:
    return (x,) if isinstance(x, Tensor) else tuple(x)


def _unwrap(xs: Tuple[Tensor, ...], original: Batch) -> Batch:
    return xs[0] if isinstance(original, Tensor) else xs


def _batch_size(inputs: Tuple[Tensor, ...]) -> int:
    if not inputs or any(t.dim() == 0 for t in inputs):
        raise ValueError("inputs must be a tensor or a tuple of tensors batched on dim 0")
    b = inputs[0].shape[0]
    if any(t.shape[0] != b for t in inputs):
        raise ValueError(f"inputs disagree on the batch size (dim 0): {[t.shape[0] for t in inputs]}")
    return b


def _check_loss_module(loss_fn: Callable[..., Tensor], loss_reduction: str) -> None:
    """Refuse an ``nn.Module`` loss whose ``reduction`` attribute contradicts ``loss_reduction``
    (``nn.CrossEntropyLoss(reduction="sum")`` with ``"mean"``, and the reverse) or does not
    reduce (``"none"``): the batch loss would not be the declared reduction of the per-sample
    losses. Other reductions (``"batchmean"``) and plain functions are judged by value
    (:func:`_check_reduction`).

    Raises:
        ValueError: as above, naming both and what to pass.
    """
    reduction = getattr(loss_fn, "reduction", None) if isinstance(loss_fn, nn.Module) else None
    name = type(loss_fn).__name__
    if reduction == "none":
        raise ValueError(
            f"loss_fn is {name}(reduction='none'): it returns per-sample losses, which must be "
            f"reduced over the samples (one batch loss). Pass {name}(reduction="
            f"{loss_reduction!r}) (loss_reduction={loss_reduction!r}), or reduce it yourself: "
            f"lambda out, y: loss_fn(out, y).{loss_reduction}()")
    if reduction in ("mean", "sum") and reduction != loss_reduction:
        raise ValueError(
            f"loss_fn is {name}(reduction={reduction!r}), which matches "
            f"loss_reduction={reduction!r}, but loss_reduction={loss_reduction!r} was given: "
            f"pass loss_reduction={reduction!r} (or {name}(reduction={loss_reduction!r}))")


def _prepare(model: nn.Module, loss_fn: Callable[..., Tensor], inputs: Batch, targets: Batch,
             loss_reduction: str
             ) -> Tuple[Tuple[Tensor, ...], Tuple[Tensor, ...], int, List[Tuple[str, nn.Parameter]],
                        List[nn.Parameter]]:
    # The checks both references start with: (inputs, targets as tuples, B, trainable
    # (name, param) pairs, their params).
    check_loss_reduction(loss_reduction)
    _check_loss_module(loss_fn, loss_reduction)
    xs, ys = _as_tuple(inputs), _as_tuple(targets)
    b = _batch_size(xs)
    if _batch_size(ys) != b:
        raise ValueError(f"inputs have batch size {b} but targets {ys[0].shape[0]}")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return xs, ys, b, named, [p for _, p in named]


def looped_per_sample_grads(
    model: nn.Module,
    loss_fn: Callable[..., Tensor],
    inputs: Batch,
    targets: Batch,
    *,
    loss_reduction: str = "mean",
) -> Dict[str, Tensor]:
    """Per-sample gradients by looped autograd: one forward/backward per sample (the reference).

    Args:
        model: the model, called as ``model(*inputs_n)`` on each sample ``n`` with a batch of one.
        loss_fn: ``loss_fn(outputs, targets) -> scalar``: the batch loss, reduced over samples
            by ``loss_reduction`` (e.g. ``nn.CrossEntropyLoss()`` for ``"mean"``).
        inputs: a tensor or tuple of tensors, batched on dim 0, size ``B``.
        targets: a tensor or tuple of tensors, batched on dim 0, size ``B``.
        loss_reduction: ``"mean"`` or ``"sum"``. A batch of one reduces the same either way, so
            the per-sample gradients do not depend on it; it is used to check that ``loss_fn``
            really reduces that way: the batch loss must equal the mean (or sum) of the ``B``
            per-sample losses (one extra forward of the whole batch, without backward).

    Returns:
        ``{name: (B, *param.shape)}`` for every trainable parameter that any sample's backward
        reached, keyed and ordered as in ``model.named_parameters()`` (same keys and shapes as
        :meth:`GradHooks.per_sample_grads`). Entry ``n`` is the gradient of sample ``n``'s own
        loss; a parameter reached for some samples only is zero for the others. ``param.grad``
        is not touched (``torch.autograd.grad`` is used) and hooks of gradhooks record nothing.

    Raises:
        ValueError: if ``loss_reduction`` is not ``"mean"``/``"sum"``, the batch sizes of
            ``inputs`` and ``targets`` differ, or ``loss_fn`` does not reduce as declared (an
            ``nn.Module`` loss whose ``reduction`` is another one, or ``"none"``, is refused
            before any forward).
    """
    xs, ys, b, named, params = _prepare(model, loss_fn, inputs, targets, loss_reduction)
    per: List[List[Optional[Tensor]]] = [[None] * b for _ in named]
    losses = []
    with paused():
        for i in range(b):
            x = _unwrap(tuple(t[i:i + 1] for t in xs), inputs)
            y = _unwrap(tuple(t[i:i + 1] for t in ys), targets)
            loss = loss_fn(model(*_as_tuple(x)), y)
            losses.append(loss.detach())
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            for k, gr in enumerate(grads):
                per[k][i] = gr
        with torch.no_grad():
            batch_loss = loss_fn(model(*xs), _unwrap(ys, targets)).detach()
    per_sample_losses = torch.stack(losses)
    _check_reduction(batch_loss, per_sample_losses, loss_reduction)
    out = {}
    for (name, p), column in zip(named, per):
        if all(gr is None for gr in column):
            continue
        out[name] = torch.stack([torch.zeros_like(p) if gr is None else gr for gr in column])
    return out


def _slice_output(out: Outputs, i: int, b: int) -> Outputs:
    """``out[i:i+1]`` for a tensor, or for every tensor of a (nested) tuple/list of outputs."""
    if isinstance(out, Tensor):
        if out.dim() == 0 or out.shape[0] != b:
            raise ValueError(
                f"model outputs must be batched on dim 0 (size {b}) to take one sample's loss "
                f"from the batched forward; got an output of shape {tuple(out.shape)} (wrap the "
                f"model so that it returns batch-first outputs)")
        return out[i:i + 1]
    if isinstance(out, (tuple, list)):
        return type(out)(_slice_output(o, i, b) for o in out)
    raise ValueError(f"model outputs must be tensors or tuples/lists of tensors batched on dim 0, "
                     f"got {type(out).__name__}")


def batched_forward_per_sample_grads(
    model: nn.Module,
    loss_fn: Callable[..., Tensor],
    inputs: Batch,
    targets: Batch,
    *,
    loss_reduction: str = "mean",
) -> Dict[str, Tensor]:
    """Per-sample gradients of one batched forward: one backward per sample through it.

    Runs ``out = model(*inputs)`` once on the whole batch, then for each sample ``n`` takes its
    own loss from that forward, ``l_n = loss_fn(out[n:n+1], y[n:n+1])`` (every output tensor and
    target sliced on dim 0), and ``torch.autograd.grad(l_n, params, retain_graph=True)``. The
    forward's decisions at kinks (which side of 0 a ReLU input is on, which element of a max-pool
    window is largest) are those of the batch, exactly as gradhooks sees them, so this is the
    reference gradhooks must equal to rounding on every CPU; :func:`looped_per_sample_grads`
    runs a forward per sample and may take the other side of a kink (see :mod:`gradhooks.tools.kinks`).
    This is the "naive" per-sample gradient of Goodfellow (2015), "Efficient per-example gradient
    computations", Section 2, taken through the batched graph; it costs ``B`` backward passes of
    the whole batch.

    Args:
        model: the model, called once as ``model(*inputs)``; its outputs (a tensor or a tuple/list
            of tensors) must be batched on dim 0.
        loss_fn, inputs, targets, loss_reduction: as for :func:`looped_per_sample_grads`
            (``inputs`` and ``targets`` batched on dim 0, size ``B``).

    Returns:
        ``{name: (B, *param.shape)}``, the same convention as :func:`looped_per_sample_grads`:
        every trainable parameter some sample's loss reaches, in ``named_parameters()`` order,
        zeros for samples that do not reach it; ``param.grad`` untouched, gradhooks' hooks paused.

    Raises:
        ValueError: if ``loss_reduction`` is not ``"mean"``/``"sum"``, the batch sizes disagree,
            an output is not batched on dim 0, or ``loss_fn`` does not reduce as declared (the
            batch loss must be the mean, or sum, of the ``B`` per-sample losses).
    """
    xs, ys, b, named, params = _prepare(model, loss_fn, inputs, targets, loss_reduction)
    per: List[List[Optional[Tensor]]] = [[None] * b for _ in named]
    losses = []
    with paused():
        out = model(*xs)
        parts = [_slice_output(out, i, b) for i in range(b)]  # checks the outputs first
        batch_loss = loss_fn(out, _unwrap(ys, targets)).detach()
        for i in range(b):
            loss = loss_fn(parts[i], _unwrap(tuple(t[i:i + 1] for t in ys), targets))
            losses.append(loss.detach())
            grads = torch.autograd.grad(loss, params, retain_graph=i < b - 1, allow_unused=True)
            for k, gr in enumerate(grads):
                per[k][i] = gr
    _check_reduction(batch_loss, torch.stack(losses), loss_reduction)
    return {name: torch.stack([torch.zeros_like(p) if gr is None else gr for gr in grads])
            for (name, p), grads in zip(named, per) if any(gr is not None for gr in grads)}


def _check_reduction(batch_loss: Tensor, losses: Tensor, loss_reduction: str) -> None:
    if batch_loss.numel() != 1:
        raise ValueError(f"loss_fn must return a scalar, got shape {tuple(batch_loss.shape)}")
    total = losses.sum()
    expected = total / len(losses) if loss_reduction == "mean" else total
    tol = (1e-9 if batch_loss.dtype == torch.float64 else 1e-3) * (losses.abs().sum() + 1e-30)
    if (batch_loss - expected).abs() > tol:
        other = "sum" if loss_reduction == "mean" else "mean"
        hint = ""
        alt = total if other == "sum" else total / len(losses)
        if (batch_loss - alt).abs() <= tol:
            hint = f" It matches loss_reduction={other!r}: pass that instead."
        raise ValueError(
            f"loss_fn does not reduce over samples as loss_reduction={loss_reduction!r} says: the "
            f"batch loss is {batch_loss.item():.6g}, the {loss_reduction} of the per-sample losses "
            f"is {expected.item():.6g}.{hint} (A model whose output for one sample depends on the "
            f"others, e.g. BatchNorm in training mode, has no per-sample gradients either.)"
        )


def max_rel_error(actual: Tensor, expected: Tensor) -> float:
    """``max |actual - expected| / max |expected|``: error relative to the largest entry.

    Both tensors are compared in float64. Returns ``0.0`` when both are all zeros and ``inf``
    when only ``expected`` is.
    """
    diff = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    scale = expected.double().abs().max().item() if expected.numel() else 0.0
    if scale == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / scale


@dataclass
class ParamError:
    """Error of one parameter's per-sample gradients against a reference (see :func:`compare`)."""

    name: str
    shape: Tuple[int, ...]
    max_abs_error: float
    max_rel_error: float


#: A parameter's error is relative to its largest entry, floored at this fraction of the
#: largest entry of all parameters: a gradient that is exactly zero in exact arithmetic (an
#: attention key bias, softmax being shift invariant) is rounding noise in autograd's result,
#: and relative to itself every answer would be a mismatch (``benchmarks/scale.py`` floors
#: alike).
ERROR_FLOOR = 1e-3


def _errors(ours: Dict[str, Tensor], ref: Dict[str, Tensor]) -> List[ParamError]:
    """One :class:`ParamError` per name in both, as :func:`max_rel_error` but sample by sample
    (no whole float64 copies of large results), in the wider of the two dtypes, and relative
    to at least :data:`ERROR_FLOOR` of the largest entry of all parameters."""
    rows = []
    top = max((max(b.abs().max().item() for b in r) for r in ref.values() if r.numel()),
              default=0.0)
    for name, r in ref.items():
        if name not in ours or not r.numel():
            continue
        wide = torch.promote_types(ours[name].dtype, r.dtype)
        diff = max((a.to(wide) - b.to(wide)).abs().max().item() for a, b in zip(ours[name], r))
        scale = max(max(b.abs().max().item() for b in r), ERROR_FLOOR * top)  # (per sample)
        rel = diff / scale if scale else (0.0 if diff == 0.0 else float("inf"))
        rows.append(ParamError(name, tuple(r.shape[1:]), diff, rel))
    return rows


@dataclass
class Comparison:
    """Result of :func:`compare`: gradhooks against two references, and timings.

    Attributes:
        params: one :class:`ParamError` per parameter against
            :func:`batched_forward_per_sample_grads` (autograd through the same batched forward),
            in ``named_parameters()`` order. :attr:`ok` and :attr:`max_rel_error` read these.
        hooks_seconds: median time of forward + backward + ``per_sample_grads()`` (seconds).
        loop_seconds: median time of :func:`looped_per_sample_grads` in the model's own dtype.
        missing: parameters only one of gradhooks and the reference returned (should be empty).
        rtol: the tolerance :attr:`ok` uses.
        loop_params: one :class:`ParamError` per parameter against
            :func:`looped_per_sample_grads` (independent per-sample forwards) run in
            :attr:`loop_dtype`. Reported, not judged: at a kink the loop can take another
            subgradient (see :attr:`kink`).
        loop_dtype: the dtype of the loop behind :attr:`loop_params` (``None``: not run).
        kink: when the loop differs by more than ``rtol``, the first kink op where its forwards
            decide differently from the batched one (:class:`gradhooks.tools.kinks.KinkDifference`),
            or ``None`` (no kink decision differs: the difference is rounding, or a bug).
        reference_seconds: time of one :func:`batched_forward_per_sample_grads` (seconds).
    """

    params: List[ParamError]
    hooks_seconds: float
    loop_seconds: float
    missing: List[str] = field(default_factory=list)
    rtol: float = 1e-5
    loop_params: List[ParamError] = field(default_factory=list)
    loop_dtype: Optional[torch.dtype] = None
    kink: Optional[KinkDifference] = None
    reference_seconds: float = 0.0

    @property
    def max_rel_error(self) -> float:
        """Largest relative error against the same batched forward over all parameters
        (``max|diff| / max|reference|`` each)."""
        return max((p.max_rel_error for p in self.params), default=0.0)

    @property
    def loop_max_rel_error(self) -> float:
        """Largest relative difference from the loop over all parameters (0.0 if not run)."""
        return max((p.max_rel_error for p in self.loop_params), default=0.0)

    @property
    def ok(self) -> bool:
        """True if every parameter is within ``rtol`` of autograd through the same batched
        forward and both returned the same keys (the loop's difference does not count)."""
        return not self.missing and self.max_rel_error <= self.rtol

    def __str__(self) -> str:
        loop = {p.name: p.max_rel_error for p in self.loop_params}
        loop_head = f"vs loop {str(self.loop_dtype).replace('torch.', '')}" if self.loop_params else ""
        w = max([len("parameter")] + [len(p.name) for p in self.params])
        lines = [f"{'parameter':<{w}}  {'shape':<18} {'max abs err':>12} {'max rel err':>12}"
                 f"  {loop_head:>18}".rstrip()]
        for p in self.params:
            tail = f"  {loop[p.name]:>18.3e}" if p.name in loop else ""
            lines.append(f"{p.name:<{w}}  {str(p.shape):<18} {p.max_abs_error:>12.3e} "
                         f"{p.max_rel_error:>12.3e}{tail}")
        for name in self.missing:
            lines.append(f"{name:<{w}}  returned by only one of gradhooks and the reference")
        lines.append(f"gradhooks {self.hooks_seconds * 1e3:.2f} ms, looped autograd "
                     f"{self.loop_seconds * 1e3:.2f} ms ({self.loop_seconds / self.hooks_seconds:.1f}x)"
                     f"; {'OK' if self.ok else 'MISMATCH'} at rtol={self.rtol:g} against autograd "
                     f"through the same batched forward")
        if self.kink is not None:
            lines.append(f"the loop's forwards take another side of a kink than the batched one "
                         f"(another valid subgradient), first at {self.kink}")
        elif self.loop_params and self.loop_max_rel_error > self.rtol:
            lines.append(f"the loop differs by {self.loop_max_rel_error:.3e} > rtol and no kink "
                         f"decision differs: rounding of the model's dtype, or a model whose "
                         f"samples interact")
        return "\n".join(lines)


def _to_dtype(x: Outputs, dtype: torch.dtype) -> Outputs:
    if isinstance(x, Tensor):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, (tuple, list)):
        return type(x)(_to_dtype(t, dtype) for t in x)
    return [_to_dtype(t, dtype) for t in x]


def compare(
    model: nn.Module,
    loss_fn: Callable[..., Tensor],
    inputs: Batch,
    targets: Batch,
    *,
    loss_reduction: str = "mean",
    batch_first: bool = True,
    repeats: int = 3,
    rtol: Optional[float] = None,
    reference_dtype: Optional[torch.dtype] = torch.float64,
) -> Comparison:
    """Check gradhooks on your own model and batch against autograd, and time it against the loop.

    Two questions, two numbers per parameter:

    1. Is gradhooks' math right? It is compared with
       :func:`batched_forward_per_sample_grads`: autograd through the *same* batched forward,
       one backward per sample. :attr:`Comparison.ok` and ``.max_rel_error`` judge this
       (each parameter's error relative to its largest entry, floored at
       :data:`ERROR_FLOOR` of the largest of all).
    2. How far is it from independent per-sample forwards? :func:`looped_per_sample_grads` is
       run on a copy of the model in ``reference_dtype`` (float64 by default: the loop's own
       rounding then does not blur the figure) and reported in ``.loop_params``. Away from
       kinks both agree to the model's rounding; at a kink the loop's forward can decide
       differently (ReLU input on the other side of 0, another element of a max-pool window
       tied or nearly tied), which changes the gradient by up to 100% for the units concerned
       while both are valid subgradients. When the loop differs by more than ``rtol``,
       ``.kink`` names the first op where the forwards decide differently
       (:func:`gradhooks.tools.kinks.first_kink_difference`).

    gradhooks is attached, ``loss_fn(model(*inputs), targets).backward()`` and
    :meth:`GradHooks.per_sample_grads` run ``repeats`` times, then it is detached;
    :func:`looped_per_sample_grads` runs ``repeats`` times in the model's dtype for the timing.
    ``param.grad`` is restored to what it was before the call; the user's model is never
    converted (the ``reference_dtype`` loop runs on a deep copy, and on a deep copy of
    ``loss_fn`` if it is a module).

    Args:
        model, loss_fn, inputs, targets, loss_reduction: as for :func:`looped_per_sample_grads`.
        batch_first: as for :func:`gradhooks.attach`.
        repeats: timed repetitions of each method, after one untimed warm-up run (medians
            are reported).
        rtol: tolerance of :attr:`Comparison.ok`; default ``1e-10`` for float64 parameters and
            ``1e-5`` otherwise.
        reference_dtype: dtype of the loop behind ``.loop_params`` (floating parameters,
            buffers, inputs and targets are converted on copies); ``None``: the model's own
            dtype, on the model itself.

    Returns:
        A :class:`Comparison` (``print`` it for a table; ``.ok``, ``.max_rel_error``,
        ``.loop_max_rel_error``, ``.kink``).

    Raises:
        GradHooksError: if ``model`` is already attached (detach it first), and the errors of
            :func:`gradhooks.attach`, :func:`batched_forward_per_sample_grads` and
            :func:`looped_per_sample_grads` (``copy.deepcopy`` errors for a model that cannot
            be copied: pass ``reference_dtype=None``).
    """
    if is_hooked(model):
        raise GradHooksError("compare() attaches its own hooks: detach the model's GradHooks first")
    check_loss_reduction(loss_reduction)
    _check_loss_module(loss_fn, loss_reduction)
    xs = _as_tuple(inputs)
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.grad for p in params]
    try:
        hook_times, ours = [], {}
        with attach(model, loss_reduction=loss_reduction, batch_first=batch_first) as gh:
            for _ in range(1 + max(1, repeats)):  # the first run warms up (kernel set-up)
                for p in params:
                    p.grad = None
                t0 = time.perf_counter()
                loss_fn(model(*xs), targets).backward()
                ours = {k: v.detach().clone() for k, v in gh.per_sample_grads().items()}
                hook_times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ref = batched_forward_per_sample_grads(model, loss_fn, inputs, targets,
                                               loss_reduction=loss_reduction)
        reference_seconds = time.perf_counter() - t0
        loop_times, loop = [], {}
        for _ in range(1 + max(1, repeats)):
            t0 = time.perf_counter()
            loop = looped_per_sample_grads(model, loss_fn, inputs, targets, loss_reduction=loss_reduction)
            loop_times.append(time.perf_counter() - t0)
    finally:
        for p, g in zip(params, saved):
            p.grad = g
    if rtol is None:
        rtol = 1e-10 if all(p.dtype == torch.float64 for p in params) else 1e-5
    state = [t for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()]
    loop_model, loop_loss, loop_x, loop_y = model, loss_fn, inputs, targets
    if reference_dtype is not None and any(t.dtype != reference_dtype for t in state):
        loop_model = copy.deepcopy(model).to(reference_dtype)
        if isinstance(loss_fn, nn.Module):
            loop_loss = copy.deepcopy(loss_fn).to(reference_dtype)
        loop_x, loop_y = _to_dtype(inputs, reference_dtype), _to_dtype(targets, reference_dtype)
        loop = looped_per_sample_grads(loop_model, loop_loss, loop_x, loop_y,
                                       loss_reduction=loss_reduction)
    loop_dtype = next((t.dtype for t in loop.values()), None)
    report = Comparison(_errors(ours, ref), statistics.median(hook_times[1:]),
                        statistics.median(loop_times[1:]), sorted(set(ref) ^ set(ours)), rtol,
                        _errors(ours, loop), loop_dtype, None, reference_seconds)
    if report.loop_max_rel_error > rtol:
        with paused():
            report.kink = first_kink_difference(model, xs, loop_model, _as_tuple(loop_x))
    return report
