"""The clipping readers: DP-SGD per-sample clipping, by book-keeping ghost clipping or two passes.

**Clipping** (:func:`clip_and_accumulate`). DP-SGD (Abadi et al. 2016, arXiv:1607.00133,
algorithm 1) needs ``sum_n c_n dtheta_n`` with ``c_n = min(1, C / ||dtheta_n||)``. Ghost
clipping with book-keeping (Bu et al. 2023, "Differentially private optimization on large model
at small cost", ICML, arXiv:2210.00038, sec. 3; Li et al. 2022, sec. 4) takes the norms as above
and forms the clipped sum directly from the recorded activations and grad_outputs -- no second
backward pass and, for Linear and Conv, no per-sample tensor::

    sum_n c_n dW_n = sum_{n,s} (c_n g[n,s]) a[n,s]^T     (one matmul / one conv weight-backward)
    sum_n c_n db_n = sum_{n,s} c_n g[n,s]

and per block for factored forms. Layers without either are materialised a second time, one
layer at a time, and reduced with the weights ``c_n`` at once.

**Two-pass clipping** (:func:`gradhooks.readers.dp.clipped_backward.clipped_backward`, its own module: a
driver that runs the backward passes; Li et al. 2022, sec. 4): from per-sample losses, a first
backward forms the norms layer by layer and drops the records, a second backward of
``sum_n c_n loss_n / D`` gives the clipped sum.

**Logical batches larger than memory** (``accumulate=True``, :func:`finish_step`; Abadi et al.
2016's lots, Opacus' virtual steps): each micro-batch's clipped sum goes to an
:class:`~gradhooks.readers.dp.accumulation.Accumulation`, the noise and the division come once per logical
batch (:mod:`gradhooks.readers.dp.accumulation`).

:func:`clip_and_accumulate` runs in four steps: the set-up (checks, before anything is read:
:mod:`gradhooks.readers.dp.clip_setup`), the norms (:mod:`gradhooks.readers.norms`, with its sum checks), the
weighted sums, and the noise with the ranks' sum (:mod:`gradhooks.readers.distributed` combines the
ranks of DDP and FSDP2).
"""
from __future__ import annotations

import math
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from ...base.errors import AccumulationError
from ...base.utils import no_autocast, own_loss_scale, tf32_products
from ...core.recorder.capture import Recorder
from ...core.recorder.records import Batch
from ..distributed import Ranks, is_sharded, ranks_of
from ..ghost_sums import ghost_sums
from ..per_sample import per_sample_grads
from ..plan import Forms, add_up, keep_budget, plan, result_sq_norms, squared_norms
from ..verify import Evidence
from .accumulation import Accumulation
from .clip_setup import (
    add_noise,
    check_accumulation,
    check_clip,
    clip_ranks,
    empty_norms,
    overflowed,
    skip_if_not_finite,
)

__all__ = ["clip_and_accumulate", "finish_step", "CLIP_METHODS"]

#: The values ``method`` of :func:`clip_and_accumulate` may take.
CLIP_METHODS = ("ghost", "materialize")


def clip_and_accumulate(batch: Batch, max_norm: Union[float, Sequence[float]], *,
                        method: str = "ghost", noise_multiplier: float = 0.0,
                        generator: Optional[torch.Generator] = None,
                        groups: Optional[Sequence[Sequence[str]]] = None,
                        accumulate: bool = False,
                        accumulation: Optional[Accumulation] = None) -> Tensor:
    """DP-SGD step gradient: per-sample clipping to ``max_norm``, summed, plus Gaussian noise,
    written to ``param.grad``.

    Sets, for every trainable parameter ``theta`` of the model (Abadi et al. 2016,
    arXiv:1607.00133, algorithm 1)::

        theta.grad = (sum_n min(1, C / ||dtheta_n||) dtheta_n + sigma C z) / D

    with ``C = max_norm``, ``sigma = noise_multiplier``, ``z ~ N(0, I)`` drawn from
    ``generator``, ``||dtheta_n||`` the norm over all parameters
    (:func:`gradhooks.readers.norms.per_sample_grad_norms`;
    ``dtheta_n`` is the gradient of sample ``n``'s own loss), and ``D = B`` for
    ``loss_reduction="mean"``, ``D = 1`` for ``"sum"``. For Poisson sampling (where DP-SGD
    divides by the *expected* batch size) use ``loss_reduction="sum"`` and divide
    ``param.grad`` (or the learning rate) by it yourself. An empty batch (``B = 0``) gets the
    noise alone, with ``D = 1`` also for ``"mean"`` (as :func:`clipped_backward`).

    **GradScaler.** With ``attach(..., grad_scaler=scaler)`` after
    ``scaler.scale(loss).backward()``, norms and clipping are those of the unscaled loss, and
    ``param.grad`` is written ``S`` times the clipped, noised sum (``S = scaler.get_scale()``),
    as autograd would have: call ``scaler.step(optimizer)`` and ``scaler.update()`` as usual. A
    step with a non-finite per-sample norm (an overflow) sets every ``.grad`` to ``inf``, so
    that the scaler skips it and lowers the scale.

    **Several processes.** On a ``DistributedDataParallel`` model every rank gets the clipped,
    noised sum over the ranks' concatenated batch divided by its global ``D`` (one all-reduce of
    the clipped sums, one of the batch sizes; the noise drawn on rank 0). On a model sharded by
    FSDP2 (``fully_shard``; attach with ``check=False``) each rank's ``.grad`` shards are those
    of the same result (one reduce-scatter per parameter, as FSDP's own). Norms need no
    communication in either: each rank records whole layers for its own samples.

    **param.grad is overwritten**, whatever autograd accumulated into it (the unclipped batch
    gradient of this batch; a gradient of an earlier batch that no clip read raises
    :class:`~gradhooks.AccumulationError` instead of being dropped, see
    :mod:`gradhooks.readers.dp.accumulation`). For a logical batch larger than memory clip each micro-batch
    with ``accumulate=True`` and call :func:`finish_step` after the last. With
    ``method="ghost"`` Linear parameters and those of recurrent and attention layers are written
    into the existing ``.grad`` tensor where it has the parameter's shape, dtype and a
    contiguous layout (like ``torch.nn.utils.clip_grad_norm_``, in place: a reference to the old
    ``.grad`` sees the new values), so that no second gradient-sized tensor is allocated; the
    others get a new tensor. Trainable parameters the backward did not reach get the clipped sum
    0 plus the noise (DP requires noise on every released coordinate); frozen parameters
    (``requires_grad=False``) are left alone.

    Args:
        batch: ``recorder.snapshot("clip_and_accumulate()", release=method == "materialize",
            result=True)`` (called as ``gh.clip_and_accumulate(...)``).
        max_norm: ``C > 0``.
        method: ``"ghost"`` (default): norms by the Gram form where cheaper, clipped sums from
            the records with one weighted contraction per Linear/Conv call and per block of
            recurrent and attention layers, one ``index_add`` per Embedding (Li et al. 2022,
            sec. 4; Bu et al. 2023,
            arXiv:2210.00038, book-keeping), other layers materialised one at a time (twice:
            once for the norms, once for the sum); peak memory close to plain training. ``"materialize"``:
            :meth:`~gradhooks.GradHooks.per_sample_grads` (kept, and set as
            ``param.grad_sample``; runs its sum check), then the weighted sum. Both give the
            same result up to rounding. After ``per_sample_grads()`` released the records (its
            default), ``"ghost"`` clips its result as ``"materialize"`` does.
        noise_multiplier: ``sigma >= 0``; ``0`` adds no noise.
        groups: group-wise clipping (Opacus' per-layer clipping, fastDP's group-wise):
            parameter-name groups that partition the trainable parameters; each sample's
            gradient is clipped per group, ``min(1, C_k / ||g_n,k||)`` with ``C_k`` the group's
            bound (``max_norm`` a number for all groups, or one per group). The noise is
            ``sigma C z / D`` with ``C = sqrt(sum_k C_k^2)``, the bound of the whole clipped
            gradient, so the privacy accounting is that of flat clipping with the same
            ``sigma`` (Opacus' convention). Returns ``(B, K)`` norms then.
        generator: a ``torch.Generator`` on the parameters' device, for reproducible noise
            (default: torch's global generator). The noise is drawn parameter by parameter in the
            order of ``model.named_parameters()``.
        accumulate: this batch is a micro-batch of a larger logical batch (DP-SGD's lot; Opacus'
            virtual steps): its clipped sum ``sum_n c_n dtheta_n`` (no noise, no division, of
            the unscaled loss under a ``GradScaler``) is added to ``accumulation``, ``.grad`` is
            set to ``None`` (the micro-batch's unclipped gradient must not reach an optimizer),
            and :func:`finish_step` later adds the noise and divides, once. Every micro-batch of
            a lot must use the same ``max_norm`` and ``groups``. Under DDP the ranks'
            accumulators are summed by :func:`finish_step`; not on FSDP2 models.
        accumulation: the :class:`~gradhooks.readers.dp.accumulation.Accumulation` of the
            :class:`~gradhooks.GradHooks` (passed by ``gh.clip_and_accumulate``): needed for
            ``accumulate=True``; also watches for a ``.grad`` this call would drop.

    **Samples of several rows** (``gh.set_sample_ids(ids)``): the samples are the ``G``
    groups of rows sharing an id, in the order of the sorted unique ids; ``dtheta_k`` is the
    sum of its rows' gradients (the gradient of the group's loss), clipped as one, ``D = G``
    for ``"mean"``; the norms are ``(G,)`` (or ``(G, K)``). Book-keeping weighs each row by its
    group's factor (the clipped sum is linear in the rows).

    Returns:
        ``(B,)``: the per-sample gradient norms before clipping (the clip factors are
        ``(max_norm / norms).clamp(max=1)``).

    Raises:
        ValueError: if ``max_norm`` is not a positive finite number, ``noise_multiplier`` is
            negative (or not 0 with ``accumulate=True``), ``method`` is unknown, or
            ``max_norm`` / ``groups`` differ from the lot's earlier micro-batches.
        AccumulationError: ``.grad`` holds a gradient of an earlier batch that no clip read
            (``loss.backward()`` of another forward, not zeroed since: it would be dropped);
            without ``accumulate=True`` while micro-batches are accumulated; with it, this
            batch was accumulated already.
        GradHooksError: if a trainable parameter of the model is not covered by the hooks (it
            was frozen when :func:`gradhooks.attach` ran and its module has no rule): it could
            not be clipped; an FSDP2 model attached with the sum check on.
        NoBackwardError, HigherOrderGradError, GradientMismatchError: as
            :func:`gradhooks.readers.norms.per_sample_grad_norms`.
    """
    clip = _set_up(batch, max_norm, method, noise_multiplier, groups, accumulate, accumulation)
    sums = _Target(batch, clip.ranks)
    with no_autocast(), tf32_products(batch.low):
        found = _norms(batch, clip)
        _weighted_sums(batch, clip, found, sums.assign)
    if accumulate:  # .grad is S / D times the clipped sum: into the accumulator, unscaled
        for _, p in clip.trainable:
            if id(p) not in sums.assigned:
                p.grad = None  # (a parameter the backward did not reach: 0)
        accumulation.add(clip.trainable, 1.0 / found.scale, batch.samples or 0,
                         bound=clip.max_norm, key=clip.key, batch=batch.batch_id,
                         overflow=overflowed(batch.grad_scale, found.norms))
        return found.norms
    _noise(batch, clip, sums, found.scale, noise_multiplier, generator)
    skip_if_not_finite(batch.grad_scale, clip.trainable, found.norms)
    if accumulation is not None:
        accumulation.consumed(clip.trainable)
    return found.norms


class _Clip(NamedTuple):
    # What clip_and_accumulate's set-up found: the method to run, the bounds C_k and
    # {id(param): group} (None: flat), C of the whole gradient, the trainable (name, param),
    # the ranks (None: one process), the accumulation key.
    method: str
    bounds: List[float]
    group_of: Optional[Dict[int, int]]
    max_norm: float
    trainable: List[Tuple[str, nn.Parameter]]
    ranks: Optional[Ranks]
    key: tuple


def _set_up(batch: Batch, max_norm, method: str, noise_multiplier, groups, accumulate: bool,
            accumulation: Optional[Accumulation]) -> _Clip:
    """:func:`clip_and_accumulate`'s set-up: every check of the arguments, the ranks and the
    accumulator, before anything is read.

    Raises:
        ValueError, AccumulationError, GradHooksError: as :func:`clip_and_accumulate` (all but
            the readers' ``NoBackwardError`` and the like)."""
    if method not in CLIP_METHODS:
        raise ValueError(f"method must be one of {CLIP_METHODS}, got {method!r}")
    bounds, group_of = _groups(batch, max_norm, groups)
    if group_of is not None:
        max_norm = math.sqrt(sum(b * b for b in bounds))  # the bound of the whole gradient
    trainable = check_clip(batch, max_norm, noise_multiplier)
    ranks = clip_ranks(batch)
    key = (tuple(bounds), None if groups is None else tuple(tuple(g) for g in groups))
    check_accumulation(accumulation, accumulate, "clip_and_accumulate()", trainable,
                       noise_multiplier, ranks, key, batch.batch_id)
    if batch.released:  # per_sample_grads() formed the result and released the records
        method = "materialize"
    return _Clip(method, bounds, group_of, max_norm, trainable, ranks, key)


class _Norms(NamedTuple):
    # The norms step's result: (N,) or (N, K) norms, the clipping factors (an (N,) vector, or
    # one per parameter id), the scale of what is weighted to S / D times own-loss gradients,
    # and what the weighted sums read: (plans, forms) of the records, or the materialised
    # per-sample gradients {name: (N, *shape)}.
    norms: Tensor
    factors: Union[Tensor, Dict[int, Tensor], None]
    scale: float
    read: object


def _norms(batch: Batch, clip: _Clip) -> _Norms:
    """The per-sample norms and clipping factors: from the records (``batch``, book-keeping:
    Gram form where cheaper), from the materialised per-sample gradients, or none (an empty
    batch).

    Raises:
        NoBackwardError, HigherOrderGradError, GradientMismatchError: as
            :func:`gradhooks.readers.norms.per_sample_grad_norms`."""
    if batch.size == 0:  # an empty (Poisson) batch: the sum is 0
        # (D = 1 for an empty batch with loss_reduction="mean", as clipped_backward takes it)
        return _Norms(empty_norms(clip.trainable), None, batch.grad_scale, None)
    if clip.method == "ghost":
        plans, units = plan(batch)
        forms = Forms(batch, plans, keep=keep_budget(batch))
        evidence = Evidence(batch)
        sq = squared_norms(batch, plans, units, forms, evidence)
        evidence.judge()
        norms, factors = _factors(sq, clip.group_of, clip.bounds, batch.factor)
        if batch.groups is not None:  # sample_ids: each row weighs as its sample (linear)
            to_rows = batch.groups.to_rows
            factors = (to_rows(factors) if isinstance(factors, Tensor)
                       else {pid: to_rows(c) for pid, c in factors.items()})
        # The records are S / D times the per-sample gradients: weighting them gives the
        # clipped sum times S / D.
        return _Norms(norms, factors, batch.grad_scale / batch.divisor, (plans, forms))
    grads = per_sample_grads(batch)
    scale = batch.grad_scale / batch.divisor
    pids = {name: pid for pid, name in batch.names.items()}
    sq = {pids[name]: t for name, t in result_sq_norms(grads).items()}
    if sq:
        norms, factors = _factors(sq, clip.group_of, clip.bounds, 1.0)
    else:
        norms, factors = empty_norms(clip.trainable), {}
    return _Norms(norms, factors, scale, grads)


def _weighted_sums(batch: Batch, clip: _Clip, found: _Norms, assign) -> None:
    """``sum_n c_n d(param)_n`` times ``found.scale`` for each parameter, handed to
    ``assign(id(param), sum)``: from the records (:func:`gradhooks.readers.ghost_sums.ghost_sums`) or
    from the materialised per-sample gradients (one ``tensordot`` each); nothing for an empty
    batch."""
    if found.read is None:
        return
    if clip.method == "ghost":
        plans, forms = found.read
        ghost_sums(batch, plans, found.factors, assign, forms)
        return
    pids = {name: pid for pid, name in batch.names.items()}
    for name, t in found.read.items():
        c = found.factors if isinstance(found.factors, Tensor) else found.factors[pids[name]]
        assign(pids[name], torch.tensordot(c.to(t.dtype), t, 1).mul_(found.scale))


class _Target:
    """Where the weighted sums go: straight into ``param.grad`` (replacing, and so freeing,
    autograd's gradient at once; or already written into it), or, for a sharded parameter of
    several ranks, aside until the ranks' sums are combined (:meth:`summand`)."""

    def __init__(self, batch: Batch, ranks: Optional[Ranks]):
        self.params, self.ranks = batch.params, ranks
        self.assigned: set = set()
        self.aside: Dict[int, Tensor] = {}  # the full-shape local sums of sharded parameters

    def assign(self, pid: int, t: Tensor) -> None:
        """Take the weighted sum ``t`` (the parameter's shape) of parameter ``pid``."""
        p = self.params[pid]
        if self.ranks is not None and is_sharded(p):
            self.aside[pid] = t
        elif p.grad is None or t.data_ptr() != p.grad.data_ptr():  # else written into it already
            p.grad = t.to(p.dtype)  # replaces (frees) autograd's gradient right away
        self.assigned.add(pid)

    def summand(self, p: nn.Parameter) -> Tensor:
        """This rank's full-size sum of ``p``, in its dtype (zeros if no backward reached it)."""
        t = self.aside.pop(id(p), None)
        if t is not None:
            return t.to(p.dtype)
        return p.grad if id(p) in self.assigned else Ranks.zero_summand(p)


def _noise(batch: Batch, clip: _Clip, sums: _Target, scale: float, noise_multiplier,
           generator: Optional[torch.Generator]) -> None:
    """The noise, and the ranks' sum: one process adds ``sigma C S / D z`` to each ``.grad``
    (zeros where nothing was assigned); several processes divide each rank's sum by the global
    ``D`` (for ``"mean"``; ``scale`` holds the local one), rank 0 adds the noise once, and the
    ranks' sums are summed into each parameter's ``.grad``
    (:meth:`gradhooks.readers.distributed.Ranks.sum_`: DDP all-reduce, FSDP2 reduce-scatter), in the
    order of ``named_parameters()``."""
    ranks = clip.ranks
    if ranks is None:
        add_noise(clip.trainable, sums.assigned, noise_multiplier * clip.max_norm * scale,
                  generator)
        return
    local = own_loss_scale(batch.loss_reduction, batch.samples or 0) or 1.0
    total = ranks.global_divisor(batch.loss_reduction, batch.samples or 0)
    std = noise_multiplier * clip.max_norm * scale * local / total
    for _, p in clip.trainable:
        t = sums.summand(p).mul_(local / total)
        if std > 0 and ranks.rank == 0:  # the noise once, in the sum
            t.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype, device=p.device),
                   alpha=std)
        p.grad = ranks.sum_(p, t)


def _groups(batch: Batch, max_norm, groups):
    """``(bounds, group_of)``: the clipping bound of each group and ``{id(param): group}``
    (``None`` for flat clipping: one group, every parameter).

    Raises:
        ValueError: for a malformed ``max_norm`` / ``groups`` pair, or groups that do not
            partition the trainable parameters the hooks cover."""
    if groups is None:
        return [max_norm], None  # (checked by check_clip)
    bounds = [max_norm] * len(groups) if isinstance(max_norm, (int, float)) else list(max_norm)
    if len(bounds) != len(groups) or not groups:
        raise ValueError(f"max_norm gives {len(bounds)} bounds for {len(groups)} groups")
    for b in bounds:
        check_clip(batch, b, 0.0)  # each a positive finite number
    pid_of = {name: pid for pid, name in batch.names.items()}
    group_of: Dict[int, int] = {}
    for k, names in enumerate(groups):
        for name in names:
            if name not in pid_of or id(batch.model.get_parameter(name)) != pid_of[name]:
                raise ValueError(f"groups: {name!r} is not a parameter of the model")
            if pid_of[name] in group_of:
                raise ValueError(f"groups: {name!r} is in two groups")
            group_of[pid_of[name]] = k
    missing = [n for n, p in batch.model.named_parameters()
               if p.requires_grad and id(p) not in group_of]
    if missing:
        raise ValueError(f"groups must cover every trainable parameter; not in a group: "
                         f"{', '.join(missing)}")
    return bounds, group_of


def _factors(sq: Dict[int, Tensor], group_of, bounds, factor: float):
    """Per-sample norms and clipping factors from the squared norms ``{id(param): (N,)}`` of
    the records (times ``factor``: the own-loss scale). Flat: ``(N,)`` norms and one ``(N,)``
    factor vector. Group-wise (Opacus' per-layer / fastDP's group-wise clipping): ``(N, K)``
    norms, one per group, and ``{id(param): (N,)}`` factors ``min(1, C_k / ||g_n,k||)``."""
    if group_of is None:
        norms = add_up(sq.values()).sqrt_().mul_(factor)
        return norms, (bounds[0] / norms).clamp_(max=1.0)
    any_sq = next(iter(sq.values()))
    per_group = [any_sq.new_zeros(any_sq.shape) for _ in bounds]
    for pid, t in sq.items():
        per_group[group_of[pid]] = per_group[group_of[pid]] + t
    norms = torch.stack(per_group, 1).sqrt_().mul_(factor)  # (N, K)
    factors = (norms.new_tensor(bounds) / norms).clamp_(max=1.0)
    return norms, {pid: factors[:, group_of[pid]].contiguous() for pid in sq}


def finish_step(recorder: Recorder, accumulation: Accumulation, *, noise_multiplier: float = 0.0,
                expected_batch_size: Optional[float] = None,
                generator: Optional[torch.Generator] = None) -> int:
    """The DP-SGD step gradient of a logical batch clipped in micro-batches (Abadi et al. 2016,
    arXiv:1607.00133, algorithm 1, one lot; Opacus' virtual steps / ``BatchMemoryManager``).
    It reads no records (the micro-batches' clipped sums are in ``accumulation``), so it takes
    the recorder, for the model, its parameters and the batch the last micro-batch was.

    After ``clip_and_accumulate(C, accumulate=True)`` or ``clipped_backward(losses, C,
    accumulate=True)`` on each micro-batch, sets for every trainable parameter ``theta``::

        theta.grad = (sum_{n in lot} min(1, C / ||dtheta_n||) dtheta_n + sigma C z) / D

    the sum over every sample of every micro-batch (each clipped on its own, as one clip of the
    whole lot would), ``z ~ N(0, I)`` drawn once, from ``generator``, parameter by parameter in
    the order of ``model.named_parameters()`` (as :func:`clip_and_accumulate` draws it), ``C``
    the micro-batches' ``max_norm`` (group-wise: ``sqrt(sum_k C_k^2)``), and ``D``:
    ``expected_batch_size`` when given (Poisson sampling: Opacus divides by the expected lot
    size ``q N``, so that the sum's sensitivity does not depend on the drawn size), else the
    number of samples ``B`` of the lot for ``loss_reduction="mean"`` (1 if ``B = 0``) and 1 for
    ``"sum"`` -- as :func:`clip_and_accumulate` on the whole lot. Then the accumulation is
    emptied: the next ``accumulate=True`` clip starts the next lot. Call
    ``optimizer.step()`` next, as after a clip.

    With a ``GradScaler`` (``attach(..., grad_scaler=scaler)``) ``.grad`` is written ``S``
    times this (``S = scaler.get_scale()`` now; the micro-batches were accumulated unscaled),
    and set to ``inf`` if a micro-batch's norms overflowed, for ``scaler.step(optimizer)`` to
    skip, as :func:`clip_and_accumulate`. On a ``DistributedDataParallel`` model the ranks'
    accumulators are summed (one all-reduce per parameter, the noise drawn on rank 0), ``B``
    is the ranks' total (one all-reduce), and ``expected_batch_size`` is that of the lot of all
    ranks together; every rank must call it. Not on FSDP2 models (``accumulate=True`` refuses
    them).

    Args:
        recorder: the :class:`~gradhooks.core.recorder.capture.Recorder` of a :class:`~gradhooks.GradHooks`.
        accumulation: its :class:`~gradhooks.readers.dp.accumulation.Accumulation` (called as
            ``gh.finish_step(...)``).
        noise_multiplier: ``sigma >= 0``; ``0`` adds no noise.
        expected_batch_size: ``D > 0`` for Poisson-sampled lots, e.g.
            ``int(sample_rate * len(dataset))``; ``None``: as above.
        generator: a ``torch.Generator`` on the parameters' device, for reproducible noise.

    Returns:
        ``B``: the number of samples accumulated in this process.

    Raises:
        AccumulationError: nothing was accumulated since the last ``finish_step`` (no
            ``accumulate=True`` clip); the current batch had a backward pass that was not
            clipped into the accumulation; or a ``.grad`` holds a gradient no clip read (both
            would be dropped).
        ValueError: ``noise_multiplier`` negative, ``expected_batch_size`` not positive.
        GradHooksError: a trainable parameter the hooks do not cover.
    """
    read = "finish_step()"
    if not accumulation.pending:
        raise AccumulationError(
            f"{read} with nothing accumulated: clip each micro-batch of the logical batch with "
            f"gh.clip_and_accumulate(C, accumulate=True) (after its backward) or "
            f"gh.clipped_backward(losses, C, accumulate=True) first; for a batch clipped "
            f"without accumulate=True the noise was added by that call already")
    e = expected_batch_size
    if e is not None and not (isinstance(e, (int, float)) and not isinstance(e, bool)
                              and math.isfinite(e) and e > 0):
        raise ValueError(f"expected_batch_size must be a positive number (the expected size of "
                         f"the Poisson-sampled logical batch), got {expected_batch_size!r}")
    trainable = check_clip(recorder, accumulation.bound, noise_multiplier)
    accumulation.watch()
    if recorder.records and recorder.batch_id != accumulation.batch:
        raise AccumulationError(
            f"{read}: the current batch had a backward pass (its records are there) that was "
            f"not clipped into the accumulation; its samples would be left out. Call "
            f"gh.clip_and_accumulate(C, accumulate=True) after each micro-batch's backward, "
            f"then finish_step()")
    accumulation.check_grads(trainable, read, current=True)
    ranks = ranks_of(recorder.model, recorder.params.values())  # (DDP: accumulate refuses FSDP2)
    samples = accumulation.samples
    if expected_batch_size is not None:
        divisor = float(expected_batch_size)
    elif recorder.loss_reduction == "mean":
        total = samples if ranks is None else ranks.global_divisor("mean", samples)
        divisor = float(total) or 1.0
    else:
        divisor = 1.0
    std = noise_multiplier * accumulation.bound
    scale = recorder.grad_scale() / divisor
    draws = ranks is None or ranks.rank == 0  # the noise once, on rank 0
    with no_autocast():
        for _, p in trainable:
            t = accumulation.sums.pop(id(p), None)
            if t is None:
                t = torch.zeros_like(p)
            if std > 0 and draws:
                t.add_(torch.randn(p.shape, generator=generator, dtype=t.dtype, device=t.device),
                       alpha=std)
            if ranks is not None:
                t = ranks.sum_(p, t)
            p.grad = t.mul_(scale).to(p.dtype)
            if accumulation.overflow:
                p.grad.fill_(float("inf"))
    accumulation.consumed(trainable)
    accumulation.reset()
    return samples
