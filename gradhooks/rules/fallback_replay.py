"""The ``torch.func`` fallback's replay that never crashes and never lies.

:class:`~gradhooks.rules.fallback.FallbackRule` replays a module without a rule per sample with
``torch.func.vmap``. This module gives that replay two guards (issue 38, point 5).

**Sample by sample where vmap cannot.** ``vmap`` cannot replay every module: an old-style
``torch.autograd.Function`` (``forward(ctx, ...)`` without ``setup_context``), Python control flow
on tensor values (``if x.abs().max() > 1:``), a buffer updated in place, and anything else that
raises inside the transform. Any exception from inside the vmapped replay sends the module (for
that call structure) to :func:`looped`: for each sample ``n``, one call of the module on ``x_n``
(its slice of every batched input, a batch of one) and plain ``torch.autograd.grad`` of the
outputs against ``g_n``::

    dL_n/dθ = torch.autograd.grad(module(x_n; θ), θ, g_n)         for n = 0 .. B-1

the same vector-Jacobian product as the vmapped one, without a ``torch.func`` transform (which
is what old-style Functions and data-dependent control flow refuse), at ``B`` calls of the module
per read. A :class:`~gradhooks.base.errors.FallbackWarning` says so once per module, naming its
path, the cause and the measured cost. If the loop fails too (a module that cannot run on one
sample), the read raises :class:`~gradhooks.base.errors.ReplayError` naming the module, both
causes and the ways out; never the raw torch error.

**Verified, whatever ``check`` says.** A replay can run and still compute another function than
the module's batched forward: a module that reads the batch size (``x / x.shape[0]``) or
statistics over the batch (``x - x.mean(0)``), keeps state between calls, or branches on batch
values. Every read of each replayed module is therefore compared, by :func:`verify`, with autograd's gradient of the module's own parameters
through its batched call on the recorded inputs::

    sum_n dL_n/dθ  ==  torch.autograd.grad(module(x; θ), θ, g)          (all B samples at once)

(both sides with the ``loss_reduction`` scale already on ``g``, as
:func:`~gradhooks.readers.canonical.call_grads` hands it), within :data:`REPLAY_RTOL` of the
scale ``max(sum_n |dL_n/dθ|, |ref|)`` (rounding of the sum over samples, never its order),
floored at 1% of the largest such scale among the module's parameters, as the sum check is (a
gradient that is zero by invariance, a key's bias under softmax, is rounding of the module's
terms: IBert's ``QuantLinear`` key). The
batched call run again must also give the output the forward gave (saved by
:meth:`~gradhooks.rules.fallback.FallbackRule.internal`):
otherwise the module keeps state that the forward changed (a cache, a buffer updated in place)
or is random, and both sides would agree on another function. A mismatch raises
:class:`~gradhooks.base.errors.ReplayMismatchError`. ``check=False`` does not skip this (it skips
the sum check over all parameters); ``attach(..., unsafe_skip_replay_check=True)`` does. Every
call is verified, not the first of each call structure only: a replay that becomes wrong on a
later batch of the same structure (a branch on the batch size, state that changes what the
forward computes, Python control flow on tensor values that a looped replay follows) is refused
on that batch. Cost: one batched call and backward of the module and a copy of its output per
call (``benchmarks/results/replay_verify.md``: +11% of the per-sample-gradient step and +15%
of the clipping step on torchvision's Swin-T, whose windowed attention is replayed, -2% and +7%
on BART, whose positional embeddings are; for a looped replay about ``1/B`` of the loop).

Every replay (vmapped, looped, the batched reference) leaves the module as it found it: plain
attributes it sets (``self.last = x``) and buffers it changes in place are restored
(:func:`~gradhooks.base.utils.state_kept`), so that a replay does not feed a cache or a running
statistic.
"""
from __future__ import annotations

import contextlib
import time
from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..base.errors import ReplayError, ReplayMismatchError
from ..base.utils import paused, state_kept

__all__ = ["Replay", "REPLAY_RTOL", "structure", "looped", "verify", "cause_of",
           "way_out"]

#: Relative tolerance of :func:`verify` by dtype: the per-sample gradients' sum may differ from
#: the batched call's gradient by rounding, relative to ``sum_n |value_n|`` (``B * eps`` in the
#: worst case; the values of the sum check, :data:`gradhooks.readers.verify.SUM_CHECK_RTOL`). A wrong
#: replay is off by far more (a module that normalises by ``x.shape[0]``: a factor ``B``).
REPLAY_RTOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}

_PLAIN = (int, float, bool, str, type(None))


class Replay(NamedTuple):
    """How :class:`~gradhooks.rules.fallback.FallbackRule` slices one recorded call per sample.

    ``in_leaves`` / ``in_spec``: the call's ``(args, kwargs)`` flattened (for a shared call,
    ``shared``, its first input as the module received it); ``batched``: the indices of the
    input leaves sliced per sample, on ``in_dims`` (one per ``batched``); ``g_leaves``: the
    output's grad_outputs flattened (``loss_reduction`` scale applied), of which ``reached``
    are tensors, batched on ``out_dims`` (one per ``reached``); ``b``: the batch size;
    ``shared``: :attr:`~gradhooks.base.forms.Call.shared` (``"prepend"``: sample ``n``'s
    grad_output is ``g[n]``; ``"expand"``: ``g[n:n+1]``; ``None``: an ordinary call).
    """

    in_leaves: list
    in_spec: object
    batched: List[int]
    in_dims: List[int]
    g_leaves: list
    reached: List[int]
    out_dims: List[int]
    b: int
    shared: Optional[str]


def structure(leaves: Sequence) -> tuple:
    """The call structure a verification holds for: each input leaf's dtype and shape without
    its leading dim (so that a new batch size, Poisson sampling's, is not a new structure), and
    the plain values (ints, flags) passed beside the tensors; other objects by type."""
    return tuple((t.dtype, tuple(t.shape[1:])) if isinstance(t, Tensor)
                 else (t if isinstance(t, _PLAIN) else type(t).__qualname__) for t in leaves)


@contextlib.contextmanager
def _state_rows(module: nn.Module, n: int, b: int) -> Iterator[None]:
    """Sample ``n``'s row of each tensor of ``b`` rows the module and its submodules keep as
    plain attributes (state its forward left for the batch: a recurrence's last states), for a
    replay of that sample alone; set back after. (Rows that are no sample's make the replay
    another function: :func:`verify` refuses it.)"""
    saved = [(m, k, v) for m in module.modules() for k, v in list(vars(m).items())
             if isinstance(v, Tensor) and v.dim() > 0 and v.shape[0] == b and b > 1]
    try:
        for m, k, v in saved:
            m.__dict__[k] = v[n:n + 1]
        yield
    finally:
        for m, k, v in saved:
            m.__dict__[k] = v


def _pull(module: nn.Module, own: Dict[str, Tensor], leaves: list, spec, reached: List[int],
          gs: List[Tensor]) -> Tuple[Dict[str, Tensor], list]:
    """``(grads, outputs)``: ``torch.autograd.grad`` of ``module(*args, **kwargs)`` (``leaves``
    unflattened by ``spec``) w.r.t. its own parameters ``own`` against the cotangents ``gs`` of
    its output leaves ``reached``; ``{name: param.shape}`` (zeros where unused) and the output
    leaves (detached)."""
    params = {n: p.detach().requires_grad_() for n, p in own.items()}
    args, kwargs = tree_unflatten(leaves, spec)
    with paused(), state_kept(module), torch.enable_grad():
        out_leaves, _ = tree_flatten(functional_call(module, params, tuple(args), kwargs))
        outs, cots = [], []
        for k, i in enumerate(reached):
            t = out_leaves[i]
            if isinstance(t, Tensor) and t.requires_grad and (t.is_floating_point()
                                                              or t.is_complex()):
                outs.append(t)
                cots.append(gs[k].to(t.dtype))
        got = (torch.autograd.grad(outs, list(params.values()), cots, allow_unused=True)
               if outs else [None] * len(params))
    grads = {n: torch.zeros_like(p) if d is None else d for (n, p), d in zip(params.items(), got)}
    return grads, [t.detach() if isinstance(t, Tensor) else t for t in out_leaves]


def _sample_cotangents(r: Replay, n: int) -> List[Tensor]:
    out = []
    for k, i in enumerate(r.reached):
        g = r.g_leaves[i]
        out.append(g[n] if r.shared == "prepend" else g.narrow(r.out_dims[k], n, 1))
    return out


def looped(module: nn.Module, own: Dict[str, Tensor], r: Replay) -> Tuple[Dict[str, Tensor], float]:
    """Per-sample gradients by a loop over the samples (each a batch of one) with plain
    autograd: ``({name: (B, *param.shape)}, seconds the loop took)``.

    Raises whatever the module raises on one sample (the caller turns it into a
    :class:`~gradhooks.base.errors.ReplayError`)."""
    start = time.perf_counter()
    rows: Dict[str, List[Tensor]] = {n: [] for n in own}
    for n in range(r.b):
        leaves = list(r.in_leaves)
        for i, d in zip(r.batched, r.in_dims):
            leaves[i] = leaves[i].narrow(d, n, 1)
        with _state_rows(module, n, r.b):
            grads, _ = _pull(module, own, leaves, r.in_spec, r.reached, _sample_cotangents(r, n))
        for name, t in grads.items():
            rows[name].append(t)
    out = {n: torch.stack(ts) for n, ts in rows.items()}
    if any(t.is_cuda for t in out.values()):
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def _rtol(*dtypes: torch.dtype) -> float:
    return max(REPLAY_RTOL.get(d, 1e-4) for d in dtypes)


def _precision(values: Tensor) -> torch.dtype:
    """The dtype whose tolerance judges ``values``: float32 for float64 values that are all
    float32 values and not all of float16's 11 significant bits (a float64 module computing in
    float32 inside, as Gemma's RMSNorm does; the sum check's rule,
    :func:`gradhooks.core.recorder.totals.formed_in`), else their own dtype."""
    if values.dtype != torch.float64 or not values.numel():
        return values.dtype
    exact = values.to(torch.float32).to(torch.float64) == values
    wide = (torch.frexp(values).mantissa * 2048).frac().ne(0)
    return torch.float32 if bool(exact.all() & (exact & wide).any()) else values.dtype


def verify(module: nn.Module, own: Dict[str, Tensor], r: Replay, got: Dict[str, Tensor],
           recorded: Optional[list], who: str, param_path: str, how: str) -> float:
    """Check a replay's per-sample gradients ``got`` (``{name: (B, *param.shape)}``) against
    autograd's gradient of the module's own parameters through its batched call; returns the
    seconds that batched call and its backward took (the looped replay's cost is stated
    against it).

    Args:
        recorded: the output leaves the forward gave (saved at the forward), or ``None``.
        who: the module, ``'path' (Class)``, for messages; ``param_path``: its path prefix for
            parameter names; ``how``: how it was replayed, for messages.

    Raises:
        ReplayMismatchError: the batched call run again does not give the recorded output, or
            the per-sample gradients do not sum to its gradient.
        ReplayError: the batched call itself fails when run again.
    """
    leaves = list(r.in_leaves)
    if r.shared is None:
        gs = [r.g_leaves[i] for i in r.reached]
    else:  # one call on the inputs it received: its grad_output, summed over the samples
        gs = [r.g_leaves[i].sum(0, keepdim=r.shared != "prepend") for i in r.reached]
    start = time.perf_counter()
    try:
        ref, outs = _pull(module, own, leaves, r.in_spec, r.reached, gs)
    except Exception as e:  # (a cache sized for another call, state the forward changed ...)
        raise ReplayError(
            f"module {who}: run again on its recorded inputs, its batched forward fails "
            f"({cause_of(e)}), so its {how} cannot be verified; it keeps state between calls "
            f"(a cache) or was given inputs that no longer fit it. {way_out(module)}") from None
    seconds = time.perf_counter() - start
    if recorded is not None:
        for i in r.reached:
            was, now = recorded[i] if i < len(recorded) else None, outs[i]
            if was is None or not isinstance(now, Tensor):
                continue
            if r.shared is not None:
                was = was[0] if r.shared == "prepend" else was[:1]
            if was.shape != now.shape:
                diff = "of another shape"
            elif was.numel():
                off = float((now - was.to(now.dtype)).abs().max())
                tol = _rtol(_precision(was), now.dtype) * float(was.abs().max())
                diff = None if off <= tol else f"{off:.3g} off (tolerance {tol:.3g})"
            else:
                diff = None
            if diff is not None:
                raise ReplayMismatchError(
                    f"module {who}: run again on its recorded inputs, its forward does not give "
                    f"the output {i} it gave in the batch's forward ({diff}): it keeps state "
                    f"between calls (a cache, a buffer updated in place), is random (dropout in "
                    f"training mode), or its parameters changed since the forward (read before "
                    f"optimizer.step()), so no replay computes what the forward did. Its per-sample "
                    f"gradients are refused (check=False does not skip this check). Make the "
                    f"forward a function of its inputs and parameters (eval mode, no cache), or "
                    f"{way_out(module, lower=True)}")
    scales = {name: max(float(t.detach().abs().sum(0).max()) if t.numel() else 0.0,
                        float(ref[name].abs().max()) if ref[name].numel() else 0.0)
              for name, t in got.items()}
    floor = 0.01 * max(scales.values(), default=0.0)  # (as the sum check's: a gradient that is
    # zero by invariance, a key's bias under softmax, is rounding of terms of the module's size)
    for name, t in got.items():
        t = t.detach()
        want = ref[name].to(t.dtype)
        total = t.sum(0)
        scale = max(scales[name], floor)
        tol = _rtol(t.dtype, _precision(want)) * scale + torch.finfo(t.dtype).tiny
        diff = float((total - want).abs().max()) if want.numel() else 0.0
        if diff > tol:
            raise ReplayMismatchError(
                f"module {who}: its {how} does not add up to its batch gradient: the per-sample "
                f"gradients of {param_path + name!r}, summed over the {r.b} samples, differ from "
                f"autograd's gradient of the module's own parameters through its batched call by "
                f"{diff:.3g} (tolerance {tol:.3g}, {t.dtype}; relative {diff / max(scale, 1e-300):.3g}). "
                f"Each sample replayed alone is not its share of the batch: the module reads the "
                f"batch size (x.shape[0]) or statistics over the batch (x.mean(0)), or branches on "
                f"the batch's values. The result would be wrong, so it is refused (check=False "
                f"does not skip this check). Make the module treat the samples of a batch "
                f"independently, or {way_out(module, lower=True)}")
    return seconds


def cause_of(e: BaseException) -> str:
    """``Type: first line of the message`` (at most 200 characters), for messages."""
    lines = str(e).strip().splitlines()
    first = lines[0] if lines else ""
    return f"{type(e).__name__}: {first[:200]}{'...' if len(first) > 200 else ''}"


def way_out(module: nn.Module, lower: bool = False) -> str:
    """The ways out of a module the fallback cannot replay exactly."""
    name = type(module).__qualname__
    text = (f"Give {name} a dedicated rule (@gradhooks.register_rule({name}) on a LayerRule), "
            f"refuse it at attach with attach(model, strict=True), or freeze its parameters "
            f"(requires_grad_(False)).")
    return text[0].lower() + text[1:] if lower else text
