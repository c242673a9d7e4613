"""The looped-autograd reference, and a comparison of gradhooks against it on a user's model.

The reference is the definition of a per-sample gradient: one forward and one backward per
sample, ``grad_n = d loss_fn(model(x[n:n+1]), y[n:n+1]) / d theta``. It is ``B`` times slower
than a batch gradient, and it is what gradhooks must equal.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from .capture import is_hooked
from .errors import GradHooksError
from .hooks import attach
from .utils import check_loss_reduction, paused

__all__ = ["looped_per_sample_grads", "compare", "Comparison", "ParamError", "max_rel_error"]

Batch = Union[Tensor, Sequence[Tensor]]


def _as_tuple(x: Batch) -> Tuple[Tensor, ...]:
    return (x,) if isinstance(x, Tensor) else tuple(x)


def _unwrap(xs: Tuple[Tensor, ...], original: Batch):
    return xs[0] if isinstance(original, Tensor) else xs


def _batch_size(inputs: Tuple[Tensor, ...]) -> int:
    if not inputs or any(t.dim() == 0 for t in inputs):
        raise ValueError("inputs must be a tensor or a tuple of tensors batched on dim 0")
    b = inputs[0].shape[0]
    if any(t.shape[0] != b for t in inputs):
        raise ValueError(f"inputs disagree on the batch size (dim 0): {[t.shape[0] for t in inputs]}")
    return b


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
            ``inputs`` and ``targets`` differ, or ``loss_fn`` does not reduce as declared.
    """
    check_loss_reduction(loss_reduction)
    xs, ys = _as_tuple(inputs), _as_tuple(targets)
    b = _batch_size(xs)
    if _batch_size(ys) != b:
        raise ValueError(f"inputs have batch size {b} but targets {ys[0].shape[0]}")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
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
    for (name, p), grads in zip(named, per):
        if all(gr is None for gr in grads):
            continue
        out[name] = torch.stack([torch.zeros_like(p) if gr is None else gr for gr in grads])
    return out


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
    """Error of one parameter's per-sample gradients against the loop (see :func:`compare`)."""

    name: str
    shape: Tuple[int, ...]
    max_abs_error: float
    max_rel_error: float


@dataclass
class Comparison:
    """Result of :func:`compare`.

    Attributes:
        params: one :class:`ParamError` per parameter, in ``named_parameters()`` order.
        hooks_seconds: median time of forward + backward + ``per_sample_grads()`` (seconds).
        loop_seconds: median time of :func:`looped_per_sample_grads` (seconds).
        missing: parameters only one of the two methods returned (should be empty).
        rtol: the tolerance :attr:`ok` uses.
    """

    params: List[ParamError]
    hooks_seconds: float
    loop_seconds: float
    missing: List[str] = field(default_factory=list)
    rtol: float = 1e-5

    @property
    def max_rel_error(self) -> float:
        """Largest relative error over all parameters (``max|diff| / max|loop|`` each)."""
        return max((p.max_rel_error for p in self.params), default=0.0)

    @property
    def ok(self) -> bool:
        """True if every parameter is within ``rtol`` and both methods returned the same keys."""
        return not self.missing and self.max_rel_error <= self.rtol

    def __str__(self) -> str:
        w = max([len("parameter")] + [len(p.name) for p in self.params])
        lines = [f"{'parameter':<{w}}  {'shape':<18} {'max abs err':>12} {'max rel err':>12}"]
        for p in self.params:
            lines.append(f"{p.name:<{w}}  {str(p.shape):<18} {p.max_abs_error:>12.3e} "
                         f"{p.max_rel_error:>12.3e}")
        for name in self.missing:
            lines.append(f"{name:<{w}}  returned by only one of the two methods")
        lines.append(f"gradhooks {self.hooks_seconds * 1e3:.2f} ms, looped autograd "
                     f"{self.loop_seconds * 1e3:.2f} ms ({self.loop_seconds / self.hooks_seconds:.1f}x)"
                     f"; {'OK' if self.ok else 'MISMATCH'} at rtol={self.rtol:g}")
        return "\n".join(lines)


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
) -> Comparison:
    """Check gradhooks against looped autograd on your own model and batch, and time both.

    Attaches gradhooks, runs ``loss_fn(model(*inputs), targets).backward()`` and
    :meth:`GradHooks.per_sample_grads` ``repeats`` times, detaches, runs
    :func:`looped_per_sample_grads` ``repeats`` times, and compares per parameter. ``param.grad``
    is restored to what it was before the call.

    Args:
        model, loss_fn, inputs, targets, loss_reduction: as for :func:`looped_per_sample_grads`.
        batch_first: as for :func:`gradhooks.attach`.
        repeats: timed repetitions of each method, after one untimed warm-up run (medians
            are reported).
        rtol: tolerance of :attr:`Comparison.ok`; default ``1e-10`` for float64 parameters and
            ``1e-5`` otherwise.

    Returns:
        A :class:`Comparison` (``print`` it for a table; ``.ok``, ``.max_rel_error``).

    Raises:
        GradHooksError: if ``model`` is already attached (detach it first), and the errors of
            :func:`gradhooks.attach` and :func:`looped_per_sample_grads`.
    """
    if is_hooked(model):
        raise GradHooksError("compare() attaches its own hooks: detach the model's GradHooks first")
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
        loop_times, ref = [], {}
        for _ in range(1 + max(1, repeats)):
            t0 = time.perf_counter()
            ref = looped_per_sample_grads(model, loss_fn, inputs, targets, loss_reduction=loss_reduction)
            loop_times.append(time.perf_counter() - t0)
    finally:
        for p, g in zip(params, saved):
            p.grad = g
    if rtol is None:
        rtol = 1e-10 if all(p.dtype == torch.float64 for p in params) else 1e-5
    rows = []
    for name, r in ref.items():
        if name in ours:
            diff = (ours[name].double() - r.double()).abs().max().item()
            rows.append(ParamError(name, tuple(r.shape[1:]), diff, max_rel_error(ours[name], r)))
    missing = sorted(set(ref) ^ set(ours))
    return Comparison(rows, statistics.median(hook_times[1:]), statistics.median(loop_times[1:]), missing, rtol)
