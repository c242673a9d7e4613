"""Samples recomputed alone: the check of a forward alone, and the pieces the sample spot check
(:mod:`gradhooks.readers.spotcheck`) shares with it.

A forward keeps the samples of a batch apart exactly when each sample's rows of the batched
output are what the model computes on that sample alone: any op that lets a sample's output
depend on another sample (a pairing ``einsum``, a scatter into shared rows, a statistic of the
batch) makes them differ, whatever the op. So where provenance found an op that no rule proves
keeps the samples apart (:mod:`gradhooks.core.analysis.separation`), the placement runs
:func:`forward_alone` once on the first forward of that input signature: the model on samples
``0`` and ``B - 1`` alone (their inputs sliced from what the model's forward received), whose
outputs must reproduce those rows of the batched output to rounding
(:data:`FORWARD_RTOL`, relative to the largest entry of each output). The check runs under
``torch.no_grad()`` with the hooks paused. A model in training mode is checked in training mode,
against the batched output as it ran, where that forward is deterministic (sample 0 run twice
with two seeds agrees) and no module keeps running statistics (a batch norm, which a forward in
training mode would update): so a branch taken only in training mode is judged. Otherwise every
module is put in ``eval()`` (restored after): dropout draws other masks for a batch of one than
for the batch, so the batch is rerun in eval mode too. A forward that still draws random numbers
in eval mode (run twice on one sample with two seeds, it differs) cannot be checked, nor can one
whose inputs or outputs carry no batch dim gradhooks can find: then the check says why, and the
op stays refused. Cost, once per input signature with such an op: in training mode two forwards
of one sample more, and one batched forward without gradient where the forward is random; three
forwards of one sample.
"""
from __future__ import annotations

from typing import Callable, List, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from ...base.utils import paused

__all__ = ["forward_alone", "sample_rows", "largest_difference", "FORWARD_RTOL", "NO_CHECK"]

#: Relative tolerance of :func:`forward_alone` per dtype, against the largest entry of an output:
#: a batch of one rounds differently from the batch (float32 outputs of a 12-layer Transformer
#: differ by about 1e-6 of their scale); an op that mixes samples changes them by far more.
FORWARD_RTOL = {torch.float64: 1e-10, torch.float32: 1e-3, torch.bfloat16: 5e-2,
                torch.float16: 5e-2}

#: How :func:`forward_alone`'s reason starts where no check was possible (not a difference found).
NO_CHECK = "no check was possible"

Batch = Union[Tensor, Sequence[Tensor]]


def sample_rows(x: Batch, n: int) -> Batch:
    """Sample ``n`` of a batch on dim 0 (a tensor, or a tuple / list of tensors), as a batch
    of one."""
    if isinstance(x, Tensor):
        return x[n:n + 1]
    return type(x)(t[n:n + 1] for t in x)


def largest_difference(ours: Tensor, alone: Tensor) -> Tuple[float, float]:
    """``(max |ours - alone|, max(max |ours|, max |alone|))``, in float64."""
    scale = max(float(ours.abs().max()), float(alone.abs().max())) if ours.numel() else 0.0
    diff = float((ours.double() - alone.double()).abs().max()) if ours.numel() else 0.0
    return diff, scale


def _same(x: Tensor, y: Tensor) -> bool:
    # Equal shapes and values (NaN equal to NaN).
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if x.is_floating_point() or x.is_complex():
        return bool(torch.allclose(x, y, rtol=0, atol=0, equal_nan=True))
    return bool(torch.equal(x, y))


def _tensors(x) -> List[Tensor]:
    # The tensors of a model's output, in order: a tensor, tuples / lists / dicts of them
    # (transformers' ModelOutput is a dict), nested.
    if isinstance(x, Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


def _slice(x, n: int, size: int, layout: int, hit: list):
    # x with every tensor's batch dim (dim 0, or dim 1 of one of 2 dims or more with
    # layout 1) of size ``size`` narrowed to sample n; others unchanged.
    if isinstance(x, Tensor):
        d = 0 if layout == 0 or x.dim() < 2 else 1
        if x.dim() > d and x.shape[d] == size:
            hit.append(True)
            return x.narrow(d, n, 1)
        return x
    if isinstance(x, dict):
        return type(x)({k: _slice(v, n, size, layout, hit) for k, v in x.items()})
    if type(x) in (list, tuple):
        return type(x)(_slice(v, n, size, layout, hit) for v in x)
    return x


def _deterministic(model: nn.Module, args: tuple, kwargs: dict, size: int, layout: int) -> bool:
    # Whether a model in training mode can be checked as it ran: no module keeps running
    # statistics (a forward would update them), and sample 0 run twice with two seeds agrees.
    if any(isinstance(m, nn.modules.batchnorm._NormBase)
           and (m.track_running_stats or isinstance(m, nn.modules.batchnorm._BatchNorm))
           for m in model.modules()):
        return False
    hit: list = []
    a, k = _slice(args, 0, size, layout, hit), _slice(kwargs, 0, size, layout, hit)
    if not hit:
        return False
    try:
        torch.default_generator.manual_seed(0)
        return _same_again(model, a, k, _tensors(model(*a, **k)), size)
    except Exception:  # (the check proper says why)
        return False


def _same_again(model: nn.Module, a: tuple, k: dict, first: List[Tensor], size: int) -> bool:
    # Whether the model run again on one sample's inputs, with another seed than the run that
    # gave ``first``, returns the same outputs: it draws no random numbers.
    torch.default_generator.manual_seed(1 + size)
    again = _tensors(model(*a, **k))
    return len(again) == len(first) and all(map(_same, again, first))


def forward_alone(model: nn.Module, args: tuple, kwargs: dict, output, size: int, layout: int,
                  dim_of: Callable[[Tensor], object]) -> Tuple[bool, str]:
    """Whether samples ``0`` and ``size - 1`` run alone reproduce their rows of ``output``
    (module docstring).

    Args:
        model: the model; ``args`` / ``kwargs`` what its forward received, ``output`` what it
            returned (tensors with the batch on a dim: ``(B, ...)`` or ``(..., B, ...)``).
        size: ``B``.
        layout: ``0`` (``batch_first``) or ``1`` (``batch_first=False``: dim 1 of inputs of 2
            dims or more); where ``dim_of`` finds no batch dim of an output, the same.
        dim_of: an output tensor's batch dim as provenance followed it (an int, else unknown).

    Returns:
        ``(True, "")`` if every floating output with the batch on a known dim agrees to
        :data:`FORWARD_RTOL`; else ``(False, why)``: the first difference (output, sample,
        size of it), or why no check was possible.
    """
    if size <= 1:
        return True, ""  # (one sample: nothing to mix)
    outs = []
    for i, t in enumerate(_tensors(output)):
        if not t.is_floating_point():
            continue
        d = dim_of(t)
        if not isinstance(d, int):
            d = 0 if layout == 0 or t.dim() < 2 else 1
        if t.dim() > d and t.shape[d] == size:
            outs.append((i, d))
    if not outs:
        return False, (f"{NO_CHECK}: the model's output has no tensor with the batch "
                       "on a dim gradhooks could follow")
    modes = [(m, m.training) for m in model.modules()]
    training = model.training
    cuda = sorted({t.device.index or 0 for t in _tensors(output) if t.is_cuda})
    try:
        # (the caller's random streams are left as they were: its next dropout masks too)
        with torch.no_grad(), paused(), torch.random.fork_rng(devices=cuda):
            as_ran = training and _deterministic(model, args, kwargs, size, layout)
            if not as_ran:
                model.eval()
            batched = (_tensors(model(*args, **kwargs)) if training and not as_ran
                       else _tensors(output))
            for n in sorted({0, size - 1}):
                hit: list = []
                a, k = _slice(args, n, size, layout, hit), _slice(kwargs, n, size, layout, hit)
                if not hit:
                    return False, (f"{NO_CHECK}: no input of the model's forward has "
                                   "the batch size on its batch dim")
                torch.default_generator.manual_seed(n)
                alone = _tensors(model(*a, **k))
                if n == 0 and not as_ran and not _same_again(model, a, k, alone, size):
                    return False, (f"{NO_CHECK}: the forward draws random "
                                   "numbers even in eval mode")
                if len(alone) != len(batched):
                    return False, (f"{NO_CHECK}: the model returns another structure "
                                   "for one sample")
                for i, d in outs:
                    ours, one = batched[i].narrow(d, n, 1), alone[i]
                    if ours.shape != one.shape:
                        return False, (f"sample {n} run alone returns output {i} of shape "
                                       f"{tuple(one.shape)}, not {tuple(ours.shape)}")
                    diff, scale = largest_difference(ours, one)
                    if not diff <= FORWARD_RTOL.get(ours.dtype, 1e-3) * scale + 1e-30:
                        return False, (f"sample {n} run alone does not reproduce its row of the "
                                       f"batched output {i} (max difference {diff:.3g}, largest "
                                       f"entry {scale:.3g}): the forward mixes the samples")
    except Exception as error:  # (a forward that cannot run on one sample)
        return False, (f"{NO_CHECK}: the model's forward on one sample raised "
                       f"{type(error).__name__}: {error}")
    finally:
        for m, mode in modes:
            m.training = mode
    return True, ""
