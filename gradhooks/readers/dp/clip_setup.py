"""The checks and small shared steps of the clipping readers: book-keeping clipping
(:func:`gradhooks.readers.dp.clipping.clip_and_accumulate`, :func:`gradhooks.readers.dp.clipping.finish_step`) and
the two-pass driver (:func:`gradhooks.readers.dp.clipped_backward.clipped_backward`).

Checks of the arguments, of the ranks (:func:`clip_ranks`) and of the accumulator
(:func:`check_accumulation`) before anything is read; the empty batch's norms; the
``GradScaler`` overflow; the noise of one process (:func:`add_noise`). How several processes
combine is :mod:`gradhooks.readers.distributed`'s.

Index conventions: ``N`` samples of the batch, a parameter of shape ``P``.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ...base.errors import GradHooksError
from ..distributed import Ranks, is_sharded, ranks_of
from .accumulation import Accumulation

__all__ = ["check_clip", "clip_ranks", "check_accumulation", "empty_norms", "overflowed",
           "skip_if_not_finite", "add_noise"]


def check_clip(source, max_norm, noise_multiplier) -> List[Tuple[str, nn.Parameter]]:
    """Check the clipping arguments; return the model's trainable ``(name, param)``, in
    ``named_parameters()`` order (the order the noise is drawn in). ``source``: the
    :class:`~gradhooks.core.recorder.records.Batch` of a reader, or the recorder of a driver (its
    ``model``, ``params`` and ``names``). Under FSDP2 a parameter unsharded at the time (between
    its module's forward and backward) stands for the hooked, sharded one of its name.

    Raises:
        ValueError: ``max_norm`` not a positive finite number, ``noise_multiplier`` negative.
        GradHooksError: a trainable parameter the hooks do not cover."""
    if not (isinstance(max_norm, (int, float)) and math.isfinite(max_norm) and max_norm > 0):
        raise ValueError(f"max_norm must be a positive finite number (the clipping bound C), "
                         f"got {max_norm!r}")
    if not (isinstance(noise_multiplier, (int, float)) and noise_multiplier >= 0):
        raise ValueError(f"noise_multiplier must be >= 0 (noise std / max_norm), got "
                         f"{noise_multiplier!r}")
    trainable = [(n, p) for n, p in source.model.named_parameters() if p.requires_grad]
    if any(id(p) not in source.params for _, p in trainable) and any(
            is_sharded(p) for p in source.params.values()):
        # FSDP2 holds a module's unsharded parameters from its forward to its backward (the
        # root module's always): the hooked (sharded) parameters of those names are meant
        hooked = {source.names[pid]: p for pid, p in source.params.items() if pid in source.names}
        trainable = [(n, hooked.get(n, p)) for n, p in trainable]
    missing = [n for n, p in trainable if id(p) not in source.params]
    if missing:
        raise GradHooksError(
            f"trainable parameters {', '.join(map(repr, missing))} are not covered by the hooks "
            f"(they were frozen when attach() ran and their module has no rule), so they cannot "
            f"be clipped: detach and attach again after unfreezing them"
        )
    return trainable


def clip_ranks(source) -> Optional[Ranks]:
    """The ranks a clip combines over (:func:`gradhooks.readers.distributed.ranks_of` of the model and
    its hooked parameters), or ``None`` for one process. ``source``: the
    :class:`~gradhooks.core.recorder.records.Batch` of a reader, or the recorder of a driver (its ``model``,
    ``params`` and ``check``).

    Under FSDP2 each rank still records whole layers for its own samples (FSDP gathers a
    layer's parameters for its forward and backward), so per-sample norms need no
    communication, flat or group-wise; only the clipped sums are reduce-scattered into the
    shards.

    Raises:
        GradHooksError: an FSDP2 model with the sum check on (``attach(..., check=True)``, the
            default): it watches the sharded parameters, while autograd's gradients go to the
            unsharded ones FSDP swaps in for the forward and backward, so it would report every
            parameter as missing its gradient. Attach with ``check=False``."""
    ranks = ranks_of(source.model, source.params.values())
    if ranks is not None and ranks.sharded and source.check:
        raise GradHooksError(
            "clipping a model sharded by FSDP2 (fully_shard) needs attach(..., check=False): "
            "the sum check watches the sharded parameters, but autograd's gradients go to the "
            "unsharded ones FSDP swaps in for the forward and backward")
    return ranks


def check_accumulation(accumulation: Optional[Accumulation],
                       accumulate: bool, read: str, trainable, noise_multiplier,
                       ranks: Optional[Ranks], key: tuple, batch: Optional[int]) -> None:
    """The checks of a clip before it reads anything (:mod:`gradhooks.readers.dp.accumulation`): with
    ``accumulate=True`` no noise, no FSDP2, the same clipping (``key``) as the lot's earlier
    micro-batches and (book-keeping, ``batch`` its id) not read twice; without it no pending
    accumulation; either way no ``.grad`` holding an unread gradient of an earlier batch.

    Raises:
        ValueError: ``accumulate=True`` with noise, without an accumulator, or with other
            ``max_norm`` / ``groups`` than the earlier micro-batches.
        AccumulationError: as :class:`~gradhooks.readers.dp.accumulation.Accumulation` says.
        GradHooksError: ``accumulate=True`` on an FSDP2-sharded model."""
    if accumulate:
        if accumulation is None:
            raise ValueError(f"{read} with accumulate=True needs the GradHooks' accumulator: "
                             f"call it as gh.{read[:-2]}(..., accumulate=True)")
        if noise_multiplier:
            raise ValueError(
                f"{read} with accumulate=True adds no noise (DP-SGD adds it once per logical "
                f"batch): pass noise_multiplier to gh.finish_step() instead, got "
                f"noise_multiplier={noise_multiplier!r}")
        if ranks is not None and ranks.sharded:
            raise GradHooksError(
                f"{read} with accumulate=True is not supported on a model sharded by FSDP2 "
                f"(fully_shard): the accumulated sums would be full-size on every rank. Use a "
                f"logical batch that fits in one step there, or DistributedDataParallel")
    if accumulation is None:
        return
    accumulation.watch()
    if accumulate:
        accumulation.begin(read, key, batch)
    else:
        accumulation.refuse_pending(read)
    accumulation.check_grads(trainable, read)


def empty_norms(trainable: Sequence[Tuple[str, nn.Parameter]]) -> Tensor:
    """``(0,)`` norms of an empty batch, in the parameters' dtype (at least float32)."""
    p = trainable[0][1] if trainable else torch.empty(0)
    return torch.zeros(0, dtype=torch.promote_types(p.dtype, torch.float32), device=p.device)


def overflowed(grad_scale: float, norms: Tensor) -> bool:
    """Whether a ``GradScaler``'s step (``grad_scale``: its scale, 1.0 without one) overflowed:
    a non-finite per-sample norm (``norms``: ``(N,)`` or ``(N, K)``)."""
    return grad_scale != 1.0 and not bool(torch.isfinite(norms).all())


def skip_if_not_finite(grad_scale: float, trainable, norms: Tensor) -> None:
    """With a ``GradScaler``: a step whose per-sample gradients overflowed (a non-finite norm)
    sets every ``.grad`` to ``inf``, so that ``scaler.step()`` skips it and ``scaler.update()``
    lowers the scale, as for plain training (a clipping factor of 0 would hide the overflow)."""
    if overflowed(grad_scale, norms):
        for _, p in trainable:
            p.grad.fill_(float("inf"))


def add_noise(trainable, assigned, std: float, generator: Optional[torch.Generator]) -> None:
    """One process: ``param.grad += std * N(0, I)`` in the order of ``trainable``; parameters
    whose id is not in ``assigned`` first get ``.grad = 0`` (DP noises every released
    coordinate)."""
    for _, p in trainable:
        if id(p) not in assigned:
            p.grad = torch.zeros_like(p)
        if std > 0:
            p.grad.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype, device=p.device),
                        alpha=std)
