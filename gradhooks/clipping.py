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

**Two-pass clipping** (:func:`clipped_backward`; Li et al. 2022, sec. 4): book-keeping keeps
every layer's activations and grad_outputs until all norms are known. From per-sample losses,
a first backward (no weight gradients, graph retained) forms each group of records' norms as soon
as its grad_outputs are in and drops them (:class:`_NormStream`); a second, ordinary backward of
``sum_n c_n loss_n / D`` then gives the clipped sum through autograd's own weight-gradient
kernels. One more backward pass, but no grad_output outlives its layer.

**Logical batches larger than memory** (``accumulate=True``, :func:`finish_step`; Abadi et al.
2016's lots, Opacus' virtual steps): each micro-batch's clipped sum goes to an
:class:`~gradhooks.accumulation.Accumulation`, the noise and the division come once per logical
batch (:mod:`gradhooks.accumulation`).

Norms are formed by :mod:`gradhooks.norms`, with its sum checks.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, distribute_tensor

from .accumulation import Accumulation
from .capture import Batch, Recorder
from .errors import AccumulationError, GradHooksError
from .norms import (CLOSED, FORMS, GENERIC, GRAM, ROWS, TIED, Forms, PlannedParam, add_up, plan,
                    result_sq_norms, squared_norms, summed)
from .per_sample import call_grads, per_sample_grads
from .utils import no_autocast, own_loss_scale

__all__ = ["clip_and_accumulate", "clipped_backward", "finish_step", "CLIP_METHODS"]

#: The values ``method`` of :func:`clip_and_accumulate` may take.
CLIP_METHODS = ("ghost", "materialize")


def _no_dest(pid: int, dtype: torch.dtype) -> Optional[Tensor]:
    return None


def _forms_weighted(batch: Batch, p: PlannedParam, forms: Forms, c: Tensor, dest=_no_dest) -> Tensor:
    """``sum_n c_n d(param)_n`` of a parameter in factored form: per block one matmul
    ``sum_{n,s} (c_n g[n,s]) a[n,s]^T`` (or ``sum_{n,s} c_n g[n,s]``), rows concatenated;
    written into ``dest(id(param), dtype)`` when that gives a tensor (one block only)."""
    shape = batch.params[p.pid].shape
    blocks = forms.blocks(p)
    if blocks is None:
        t = forms.materialised(p, shape)
        return torch.tensordot(c.to(t.dtype), t, 1)
    if not blocks:  # no backward reached this path of the layer
        return torch.zeros(shape, dtype=c.dtype, device=c.device)
    parts = []
    for b in blocks:
        cw = c.to(b.g.dtype)
        if b.a is None:
            parts.append((b.g.sum(1).t(), cw))  # (O, N) @ (N,)
            continue
        if b.a.numel() < b.g.numel():  # weigh the smaller (the sum is linear in both)
            a, g = b.a * cw.view(-1, 1, 1), b.g
        else:
            a, g = b.a, b.g * cw.view(-1, 1, 1)
        if a.stride(0) < a.stride(1) and g.stride(0) < g.stride(1):
            # stored position-major (a recurrent replay's (T, B, .)): the sum over (n, s) does
            # not care for the order, and flattening that way needs no copy
            a, g = a.transpose(0, 1), g.transpose(0, 1)
        parts.append((g.reshape(-1, g.shape[-1]).t(), a.reshape(-1, a.shape[-1])))
    if len(parts) == 1:
        m, v = parts[0]
        into = dest(p.pid, m.dtype)
        if into is not None:
            into = into.view(m.shape[0], *v.shape[1:])
        return torch.matmul(m, v, out=into).view(shape)
    return torch.cat([(m @ v).reshape(m.shape[0], -1) for m, v in parts], 0).reshape(shape)


def _ghost_sums(batch: Batch, plans: Dict[int, PlannedParam], c: Union[Tensor, Dict[int, Tensor]],
                assign, forms: Forms) -> None:
    """``sum_n c_n d(param)_n`` (unscaled per-sample gradients) for each parameter, ``c`` one
    ``(N,)`` weight vector or one per parameter id (group-wise clipping), from the
    records: :meth:`~gradhooks.registry.LayerRule.weighted_sum` for rules with a linear form
    (Linear, Conv), one matmul per block for factored forms, one ``index_add`` for row
    scatters, one materialised layer at a time otherwise. Calls
    ``assign(pid, sum)`` as soon as a parameter's sum is complete (so that its old ``.grad`` can
    be freed before the next layer is processed). Linear weights and biases and single-block
    factored forms are written straight into the parameter's ``.grad`` when it has the
    parameter's shape, the computation's dtype and a contiguous layout (no second tensor of the
    parameter's size: ghost clipping's peak stays at plain training's)."""
    # a TIED weight's row scatters count as one contribution, added last (in place)
    left = {pid: len(p.entries) if p.kind != TIED
            else 1 + sum(not cap.layer.rule.has_rows for cap, _ in p.entries)
            for pid, p in plans.items()}
    partial: Dict[int, Tensor] = {}
    offered: set = set()
    weights = (lambda pid: c) if isinstance(c, Tensor) else c.__getitem__

    def dest(pid: int, dtype: torch.dtype) -> Optional[Tensor]:
        # The parameter's current .grad, for its first contribution only (later ones add to it).
        if pid in offered:
            return None
        offered.add(pid)
        grad = batch.params[pid].grad
        if (grad is None or isinstance(grad, DTensor) or grad.dtype != dtype
                or grad.layout != torch.strided or grad.shape != batch.params[pid].shape
                or not grad.is_contiguous()):
            return None
        return grad

    def add(pid: int, t: Tensor) -> None:  # ``t`` is a new tensor
        if pid in partial:
            t = partial.pop(pid).add_(t)
        left[pid] -= 1
        if left[pid]:
            partial[pid] = t
        else:
            assign(pid, t)

    for pid, p in plans.items():
        if p.kind == FORMS:
            assign(pid, _forms_weighted(batch, p, forms, weights(pid), dest))
        elif p.kind == ROWS:  # sum_n c_n d(param)_n: one index_add of the weighted entries
            r = forms.rows(p)
            out = r.values.new_zeros(batch.params[pid].shape)
            cw = weights(pid).to(r.values.dtype)
            assign(pid, out.index_add_(0, r.row, r.values * cw[r.sample, None]))
    tied = {pid: forms.rows(p) for pid, p in plans.items() if p.kind == TIED}  # (the norms')
    forms.calls.clear()
    forms.joined.clear()
    forms.scatters.clear()
    for cap in batch.records:
        layer = cap.layer
        kinds = [plans[id(layer.params[n])].kind for n in cap.names]
        closed = [n for n, k in zip(cap.names, kinds)
                  if k in (GRAM, CLOSED) or (k == TIED and not layer.rule.has_rows)]
        generic = [n for n, k in zip(cap.names, kinds) if k == GENERIC]
        if closed:
            a, g = summed(cap)
            dt = a.dtype
            by_weights: Dict[int, list] = {}  # the call's parameters by their weight vector
            for n in closed:
                by_weights.setdefault(id(weights(id(layer.params[n]))), []).append(n)
            for names in by_weights.values():
                into = {n: dest(id(layer.params[n]), dt) for n in names}
                sums = layer.rule.weighted_sum(
                    layer.module, a, g, weights(id(layer.params[names[0]])).to(dt),
                    batch.batch_first, names, {n: t for n, t in into.items() if t is not None})
                for local, t in sums.items():
                    add(id(layer.params[local]), t)
            del a, g
        if generic:
            out = call_grads(layer.rule, layer.module, cap.a, cap.grads_arg(), batch.batch_first,
                             generic, None)
            for local, t in out.items():
                pid = id(layer.params[local])
                offered.add(pid)
                add(pid, torch.tensordot(weights(pid).to(t.dtype), t, 1))
    for pid, r in tied.items():  # the output projections' sum so far, plus the rows' index_add
        out = partial.pop(pid)
        cw = weights(pid).to(r.values.dtype)
        out.index_add_(0, r.row, (r.values * cw[r.sample, None]).to(out.dtype))
        assign(pid, out)


def clip_and_accumulate(recorder: Recorder, max_norm: Union[float, Sequence[float]], *,
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
    (:func:`gradhooks.norms.per_sample_grad_norms`;
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
    :mod:`gradhooks.accumulation`). For a logical batch larger than memory clip each micro-batch
    with ``accumulate=True`` and call :func:`finish_step` after the last. With
    ``method="ghost"`` Linear parameters and those of recurrent and attention layers are written
    into the existing ``.grad`` tensor where it has the parameter's shape, dtype and a
    contiguous layout (like ``torch.nn.utils.clip_grad_norm_``, in place: a reference to the old
    ``.grad`` sees the new values), so that no second gradient-sized tensor is allocated; the
    others get a new tensor. Trainable parameters the backward did not reach get the clipped sum
    0 plus the noise (DP requires noise on every released coordinate); frozen parameters
    (``requires_grad=False``) are left alone.

    Args:
        recorder: the :class:`~gradhooks.capture.Recorder` of a :class:`~gradhooks.GradHooks`
            (called as ``gh.clip_and_accumulate(...)``).
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
        accumulation: the :class:`~gradhooks.accumulation.Accumulation` of the
            :class:`~gradhooks.GradHooks` (passed by ``gh.clip_and_accumulate``): needed for
            ``accumulate=True``; also watches for a ``.grad`` this call would drop.

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
            :func:`gradhooks.norms.per_sample_grad_norms`.
    """
    if method not in CLIP_METHODS:
        raise ValueError(f"method must be one of {CLIP_METHODS}, got {method!r}")
    bounds, group_of = _groups(recorder, max_norm, groups)
    if group_of is not None:
        max_norm = math.sqrt(sum(b * b for b in bounds))  # the bound of the whole gradient
    trainable = _clip_setup(recorder, max_norm, noise_multiplier)
    mesh = _fsdp_mesh(recorder)
    key = (tuple(bounds), None if groups is None else tuple(tuple(g) for g in groups))
    _accumulation_setup(recorder, accumulation, accumulate, "clip_and_accumulate()", trainable,
                        noise_multiplier, mesh, key, recorder.batch_id)
    if recorder.released:  # per_sample_grads() formed the result and released the records
        method = "materialize"
    batch = recorder.snapshot("clip_and_accumulate()") if method == "ghost" else None
    assigned = set()
    local_sums: Dict[int, Tensor] = {}  # FSDP2: the full-shape local sums, reduce-scattered below

    def assign(pid: int, t: Tensor) -> None:
        p = recorder.params[pid]
        if mesh is not None:
            local_sums[pid] = t
        elif p.grad is None or t.data_ptr() != p.grad.data_ptr():  # else written into it already
            p.grad = t.to(p.dtype)  # replaces (frees) autograd's gradient right away
        assigned.add(pid)

    with no_autocast():
        if recorder.batch_size == 0:  # an empty (Poisson) batch: the sum is 0
            # (D = 1 for an empty batch with loss_reduction="mean", as clipped_backward takes it)
            scale, norms = recorder.grad_scale(), _empty_norms(trainable)
        elif batch is not None:
            scale = batch.grad_scale / batch.divisor
            plans, units = plan(batch)
            forms = Forms(batch, plans)
            sq = squared_norms(batch, plans, units, forms)
            norms, factors = _factors(sq, group_of, bounds, batch.factor)
            # The records are S / D times the per-sample gradients: weighting them gives the
            # clipped sum times S / D.
            _ghost_sums(batch, plans, factors, assign, forms)
        else:
            grads = per_sample_grads(recorder)
            scale = recorder.grad_scale() / (
                own_loss_scale(recorder.loss_reduction, recorder.batch_size) or 1.0)
            pids = {name: pid for pid, name in recorder.names.items()}
            sq = {pids[name]: t for name, t in result_sq_norms(grads).items()}
            if sq:
                norms, factors = _factors(sq, group_of, bounds, 1.0)
            else:
                norms, factors = _empty_norms(trainable), {}
            for name, t in grads.items():
                c = factors if isinstance(factors, Tensor) else factors[pids[name]]
                assign(pids[name], torch.tensordot(c.to(t.dtype), t, 1).mul_(scale))
    if accumulate:  # .grad is S / D times the clipped sum: into the accumulator, unscaled
        for _, p in trainable:
            if id(p) not in assigned:
                p.grad = None  # (a parameter the backward did not reach: 0)
        accumulation.add(trainable, 1.0 / scale, recorder.batch_size or 0, bound=max_norm,
                         key=key, batch=recorder.batch_id, overflow=_overflowed(recorder, norms))
        return norms
    group = _ddp_group(recorder)
    if mesh is not None:  # each rank's share of the sum over the ranks' samples / global D
        local = own_loss_scale(recorder.loss_reduction, recorder.batch_size or 0) or 1.0
        total = _global_divisor(recorder, mesh.get_group(), recorder.batch_size or 0)
        std = noise_multiplier * max_norm * scale * local / total
        for _, p in trainable:
            t = local_sums.pop(id(p), None)
            t = torch.zeros(p.shape, dtype=p.dtype, device=p.device) if t is None else t.to(p.dtype)
            if std > 0 and dist.get_rank(mesh.get_group()) == 0:  # the noise once, in the sum
                t.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype, device=p.device),
                       alpha=std / (local / total))
            # one reduce-scatter per parameter, as FSDP's own: Partial -> the parameter's shards
            p.grad = DTensor.from_local(t.mul_(local / total), p.device_mesh,
                                        [Partial()] * p.device_mesh.ndim).redistribute(
                p.device_mesh, p.placements)
    elif group is None:
        _add_noise(trainable, assigned, noise_multiplier * max_norm * scale, generator)
    else:  # the sum over the ranks' samples, divided by the global D, noise added once
        local = own_loss_scale(recorder.loss_reduction, recorder.batch_size or 0) or 1.0
        total = _global_divisor(recorder, group, recorder.batch_size or 0)
        _add_noise(trainable, assigned, 0.0, None)  # zeros where nothing was assigned
        std = noise_multiplier * max_norm * scale * local / total
        for _, p in trainable:
            p.grad.mul_(local / total)
            if std > 0 and dist.get_rank(group) == 0:
                p.grad.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype,
                                        device=p.device), alpha=std)
            dist.all_reduce(p.grad, group=group)
    _skip_if_not_finite(recorder, trainable, norms)
    if accumulation is not None:
        accumulation.consumed(trainable)
    return norms


def _ddp_group(recorder: Recorder):
    """The process group of a ``DistributedDataParallel`` model run by several processes, or
    ``None``. Its clipped sums are summed over the ranks here: DDP's own all-reduce averaged
    the batch gradients that clipping overwrites."""
    model = recorder.model
    if (isinstance(model, nn.parallel.DistributedDataParallel) and dist.is_initialized()
            and dist.get_world_size(model.process_group) > 1):
        return model.process_group
    return None


def _fsdp_mesh(recorder: Recorder):
    """The device mesh of a model sharded by FSDP2 (``torch.distributed.fsdp.fully_shard``:
    its parameters are ``DTensor`` shards) over several processes, or ``None``.

    Each rank still records whole layers for its own samples (FSDP gathers a layer's
    parameters for its forward and backward), so per-sample norms need no communication, flat
    or group-wise; only the clipped sums are reduce-scattered into the shards.

    Raises:
        GradHooksError: with the sum check on (``attach(..., check=True)``, the default): it
            watches the sharded parameters, while autograd's gradients go to the unsharded ones
            FSDP swaps in for the forward and backward, so it would report every parameter as
            missing its gradient. Attach with ``check=False``."""
    p = next(iter(recorder.params.values()), None)
    if not isinstance(p, DTensor) or p.device_mesh.size() < 2:
        return None
    if recorder.check:
        raise GradHooksError(
            "clipping a model sharded by FSDP2 (fully_shard) needs attach(..., check=False): "
            "the sum check watches the sharded parameters, but autograd's gradients go to the "
            "unsharded ones FSDP swaps in for the forward and backward")
    return p.device_mesh


def _graph_leaves(root) -> List[Tensor]:
    """The leaf tensors that require grad in the autograd graph below ``root`` (the variables
    of its ``AccumulateGrad`` nodes): under FSDP2 the unsharded parameters of this forward."""
    seen, stack, leaves = set(), [root], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)
        if isinstance(var, Tensor) and var.requires_grad:
            leaves.append(var)
        stack.extend(n for n, _ in node.next_functions)
    return leaves


def _global_divisor(recorder: Recorder, group, local_size: int) -> float:
    """``D`` of the ranks' concatenated batch: its size for ``loss_reduction="mean"``, else 1
    (one all-reduce of the local batch sizes ``local_size``)."""
    if recorder.loss_reduction != "mean":
        return 1.0
    device = next(iter(recorder.params.values())).device
    size = torch.tensor([float(local_size)], dtype=torch.float64, device=device)
    dist.all_reduce(size, group=group)
    return float(size)


def _groups(recorder: Recorder, max_norm, groups):
    """``(bounds, group_of)``: the clipping bound of each group and ``{id(param): group}``
    (``None`` for flat clipping: one group, every parameter).

    Raises:
        ValueError: for a malformed ``max_norm`` / ``groups`` pair, or groups that do not
            partition the trainable parameters the hooks cover."""
    if groups is None:
        return [max_norm], None  # (checked by _clip_setup)
    bounds = [max_norm] * len(groups) if isinstance(max_norm, (int, float)) else list(max_norm)
    if len(bounds) != len(groups) or not groups:
        raise ValueError(f"max_norm gives {len(bounds)} bounds for {len(groups)} groups")
    for b in bounds:
        _clip_setup(recorder, b, 0.0)  # each a positive finite number
    pid_of = {name: pid for pid, name in recorder.names.items()}
    group_of: Dict[int, int] = {}
    for k, names in enumerate(groups):
        for name in names:
            if name not in pid_of or id(recorder.model.get_parameter(name)) != pid_of[name]:
                raise ValueError(f"groups: {name!r} is not a parameter of the model")
            if pid_of[name] in group_of:
                raise ValueError(f"groups: {name!r} is in two groups")
            group_of[pid_of[name]] = k
    missing = [n for n, p in recorder.model.named_parameters()
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


def _empty_norms(trainable) -> Tensor:
    """``(0,)`` norms of an empty batch, in the parameters' dtype (at least float32)."""
    p = trainable[0][1] if trainable else torch.empty(0)
    return torch.zeros(0, dtype=torch.promote_types(p.dtype, torch.float32), device=p.device)


def _skip_if_not_finite(recorder: Recorder, trainable, norms: Tensor) -> None:
    """With a ``GradScaler``: a step whose per-sample gradients overflowed (a non-finite norm)
    sets every ``.grad`` to ``inf``, so that ``scaler.step()`` skips it and ``scaler.update()``
    lowers the scale, as for plain training (a clipping factor of 0 would hide the overflow)."""
    if _overflowed(recorder, norms):
        for _, p in trainable:
            p.grad.fill_(float("inf"))


def _overflowed(recorder: Recorder, norms: Tensor) -> bool:
    """Whether a ``GradScaler``'s step overflowed: a non-finite per-sample norm."""
    return recorder.grad_scale() != 1.0 and not bool(torch.isfinite(norms).all())


def _accumulation_setup(recorder: Recorder, accumulation: Optional[Accumulation],
                        accumulate: bool, read: str, trainable, noise_multiplier, mesh, key,
                        batch: Optional[int]) -> None:
    """The checks of a clip before it reads anything (:mod:`gradhooks.accumulation`): with
    ``accumulate=True`` no noise, no FSDP2, the same clipping as the lot's earlier
    micro-batches and (book-keeping, ``batch`` its id) not read twice; without it no pending
    accumulation; either way no ``.grad`` holding an unread gradient of an earlier batch.

    Raises:
        ValueError: ``accumulate=True`` with noise, without an accumulator, or with other
            ``max_norm`` / ``groups`` than the earlier micro-batches.
        AccumulationError: as :class:`~gradhooks.accumulation.Accumulation` says.
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
        if mesh is not None:
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


def _clip_setup(recorder: Recorder, max_norm, noise_multiplier) -> List[Tuple[str, nn.Parameter]]:
    """Check the clipping arguments; return the model's trainable ``(name, param)``.

    Raises:
        ValueError: ``max_norm`` not a positive finite number, ``noise_multiplier`` negative.
        GradHooksError: a trainable parameter the hooks do not cover."""
    if not (isinstance(max_norm, (int, float)) and math.isfinite(max_norm) and max_norm > 0):
        raise ValueError(f"max_norm must be a positive finite number (the clipping bound C), "
                         f"got {max_norm!r}")
    if not (isinstance(noise_multiplier, (int, float)) and noise_multiplier >= 0):
        raise ValueError(f"noise_multiplier must be >= 0 (noise std / max_norm), got "
                         f"{noise_multiplier!r}")
    trainable = [(n, p) for n, p in recorder.model.named_parameters() if p.requires_grad]
    missing = [n for n, p in trainable if id(p) not in recorder.params]
    if missing:
        raise GradHooksError(
            f"trainable parameters {', '.join(map(repr, missing))} are not covered by the hooks "
            f"(they were frozen when attach() ran and their module has no rule), so they cannot "
            f"be clipped: detach and attach again after unfreezing them"
        )
    return trainable


def _add_noise(trainable, assigned, std: float, generator) -> None:
    """``param.grad += std * N(0, I)`` in the order of ``trainable``; parameters whose id is not
    in ``assigned`` first get ``.grad = 0`` (DP noises every released coordinate)."""
    for _, p in trainable:
        if id(p) not in assigned:
            p.grad = torch.zeros_like(p)
        if std > 0:
            p.grad.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype, device=p.device),
                        alpha=std)


class _NormStream:
    """Per-sample squared norms formed while :func:`clipped_backward`'s first pass runs.

    The records are split into groups linked by shared parameters (a layer called twice, tied
    weights). As soon as every record of a group has had all its hook calls (``events``), the
    group's norms are formed (:func:`gradhooks.norms.squared_norms`) and its activations and
    grad_outputs dropped, so grad_outputs do not pile up over the backward as in book-keeping.
    """

    def __init__(self, recorder: Recorder, caps: list, events: Dict[int, int]):
        self.recorder, self.events, self.hits = recorder, events, {}
        parent = {id(c): id(c) for c in caps}

        def root(x: int) -> int:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        owner: Dict[int, int] = {}  # id(param) -> a record that uses it
        for cap in caps:
            for local in cap.names:
                pid = id(cap.layer.params[local])
                if pid in owner:
                    parent[root(id(cap))] = root(owner[pid])
                else:
                    owner[pid] = id(cap)
        groups: Dict[int, list] = {}
        for cap in caps:
            groups.setdefault(root(id(cap)), []).append(cap)
        self.group_of = {id(c): g for g in groups.values() for c in g}
        self.waiting = {id(g): len(g) for g in groups.values()}
        self.groups = list(groups.values())
        self.sq: Optional[Tensor] = None

    def hit(self, cap) -> None:
        """A hook call of the record ``cap`` (:meth:`~gradhooks.capture.Recorder.drive`)."""
        k = self.hits.get(id(cap), 0) + 1
        self.hits[id(cap)] = k
        if k == self.events.get(id(cap)):
            group = self.group_of[id(cap)]
            self.waiting[id(group)] -= 1
            if not self.waiting[id(group)]:
                self._reduce(group)

    def _reduce(self, group: list) -> None:
        del self.waiting[id(group)]
        reached = [cap for cap in group if cap.hits]
        if reached:
            batch = self.recorder.snapshot("clipped_backward()", records=reached)
            plans, units = plan(batch)
            sq = squared_norms(batch, plans, units, Forms(batch, plans))
            self.sq = add_up([self.sq, *sq.values()])
        for cap in group:
            cap.release()

    def finish(self) -> Optional[Tensor]:
        """Reduce the groups some of whose hooks did not run (an output no gradient reached);
        ``(N,)`` squared norms summed over all parameters, or ``None`` if nothing was reached."""
        for group in self.groups:
            if id(group) in self.waiting:
                self._reduce(group)
        return self.sq


def clipped_backward(recorder: Recorder, losses: Tensor, max_norm: float, *, noise_multiplier: float = 0.0,
                     generator: Optional[torch.Generator] = None, accumulate: bool = False,
                     accumulation: Optional[Accumulation] = None) -> Tensor:
    """DP-SGD step gradient by two-pass ghost clipping (Li et al. 2022, arXiv:2110.05679,
    sec. 4): ``param.grad`` as :func:`clip_and_accumulate` sets it, from the per-sample losses,
    with peak memory close to plain training.

    Replaces ``loss.backward()`` (call it after the forward, instead of any backward). First pass:
    a backward of ``losses.sum()`` (as :meth:`~gradhooks.GradHooks.backward`: no weight
    gradients, graph retained) during which each layer's per-sample squared norms are formed as
    soon as its grad_outputs are in (Gram form where cheaper, as
    :func:`gradhooks.norms.per_sample_grad_norms`) and its records dropped. Then ``c_n = min(1, C / ||g_n||)``,
    and a second, ordinary backward of ``sum_n c_n losses[n] / D`` writes the clipped sum into
    ``param.grad`` (autograd's weight-gradient kernels, no per-sample tensor, no records kept).
    Book-keeping (:func:`clip_and_accumulate` after a backward) instead keeps every layer's
    activations and grad_outputs until the norms are known and needs no per-sample losses;
    this costs one more backward pass but keeps only what plain training keeps (measured in
    ``benchmarks/``).

    **param.grad is overwritten** (set to ``None`` before the second pass), parameters the
    passes do not reach get ``0``, plus the noise, frozen ones are left alone -- as
    :func:`clip_and_accumulate`. The records of the batch are consumed: reading per-sample
    results afterwards raises :class:`~gradhooks.NoBackwardError`. The sum check runs on the
    steps :meth:`~gradhooks.GradHooks.backward` computes parameter gradients for it (first
    steps, new structures, every 100th); on those the first pass keeps the records until the
    end, as book-keeping does.

    Args:
        recorder: the :class:`~gradhooks.capture.Recorder` of a :class:`~gradhooks.GradHooks`
            (called as ``gh.clipped_backward(...)``).
        losses: ``(B,)`` per-sample losses of the current batch (``reduction="none"``), sample
            ``n``'s own loss, whose gradient is the per-sample gradient ``g_n``.
        max_norm: ``C > 0``.
        noise_multiplier: ``sigma >= 0``; the noise ``sigma C z / D`` is added as in
            :func:`clip_and_accumulate` (``D = B`` for ``loss_reduction="mean"``, else 1).
        generator: a ``torch.Generator`` for the noise.
        accumulate, accumulation: as :func:`clip_and_accumulate`: the second pass backpropagates
            ``sum_n c_n losses[n]`` (no ``1 / D``), whose gradient is moved from ``.grad``
            into ``accumulation``; :func:`finish_step` adds the noise and divides. Under DDP
            the second pass's all-reduce gives every rank the ranks' mean, which
            :func:`finish_step`'s sum over the ranks turns into their total.

    **Several processes.** As :func:`clip_and_accumulate`: the result is that of the ranks'
    concatenated batch. The second pass is an ordinary backward, so DDP's all-reduce or FSDP2's
    reduce-scatter sums the clipped gradients; the only addition is one all-reduce of the batch
    sizes (``loss_reduction="mean"``). Under FSDP2 (attach with ``check=False``) the first pass
    asks autograd for the parameter gradients (the unsharded parameters FSDP swaps in are not
    the ones the hooks know) and keeps the records until the norms are formed, and FSDP
    all-gathers each layer for both passes. A rank with an empty local batch takes both passes
    under FSDP2, and the second (with the all-reduces) under DDP.

    With ``attach(..., grad_scaler=scaler)`` both passes backpropagate ``S`` times the losses
    (``S = scaler.get_scale()``): pass the unscaled losses; ``param.grad`` is then ``S`` times
    the clipped, noised sum, for ``scaler.step(optimizer)``, as in :func:`clip_and_accumulate`.

    Returns:
        ``(B,)``: the per-sample gradient norms ``||g_n||`` before clipping.

    Raises:
        ValueError: bad ``max_norm`` or ``noise_multiplier``, or ``losses`` not a ``(B,)`` tensor
            that requires grad, ``B`` the batch size the hooks recorded; with ``accumulate=True``
            as :func:`clip_and_accumulate`.
        AccumulationError: as :func:`clip_and_accumulate` (``.grad`` holding an unread
            gradient of an earlier batch, which this call sets to ``None``).
        GradHooksError: a trainable parameter the hooks do not cover; an FSDP2 model attached
            with the sum check on.
        NoBackwardError, GradientMismatchError: as :func:`gradhooks.norms.per_sample_grad_norms`.
    """
    trainable = _clip_setup(recorder, max_norm, noise_multiplier)
    batch = recorder.batch_size
    mesh = _fsdp_mesh(recorder)
    key = ((max_norm,), None)
    _accumulation_setup(recorder, accumulation, accumulate, "clipped_backward()", trainable,
                        noise_multiplier, mesh, key, None)
    if not (isinstance(losses, Tensor) and losses.dim() == 1 and losses.requires_grad
            and losses.shape[0] == batch):
        shape = tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__
        raise ValueError(
            f"clipped_backward needs the (B,) per-sample losses of the current batch (B = "
            f"{batch}, e.g. F.cross_entropy(out, y, reduction='none')) that require grad; got "
            f"{shape}" + ("" if not isinstance(losses, Tensor) or losses.requires_grad
                          else " not requiring grad"))
    # (accumulating: the second pass gives the clipped sum itself, D comes at finish_step)
    divisor = 1.0 if accumulate else own_loss_scale(recorder.loss_reduction, batch) or 1.0
    scaler = recorder.grad_scaler if recorder.grad_scale() != 1.0 else None
    total = losses.sum() if scaler is None else scaler.scale(losses.sum())
    scale = recorder.grad_scale()  # S: both passes backpropagate S times the losses
    group = _ddp_group(recorder) if mesh is None else mesh.get_group()
    if batch == 0 and group is None:  # an empty (Poisson) batch: the clipped sum is 0, the noise is not
        recorder.reset_batch()
        for _, p in trainable:
            p.grad = None
        if accumulate:
            accumulation.add(trainable, 1.0, 0, bound=max_norm, key=key, batch=None,
                             overflow=False)
            return _empty_norms(trainable)
        _add_noise(trainable, set(), noise_multiplier * max_norm * scale / divisor, generator)
        if accumulation is not None:
            accumulation.consumed(trainable)
        return _empty_norms(trainable)
    streams: list = []

    def stream(caps, events):
        streams.append(_NormStream(recorder, caps, events))
        return streams[0]

    with no_autocast():
        if mesh is not None:
            # FSDP2: the unsharded parameters autograd sees are not the (sharded) ones the hooks
            # know, so the first pass asks for the graph's leaves; its grad_outputs reach the
            # records as in loss.backward(), which are reduced at the end. FSDP all-gathers each
            # layer for this pass too, but reduce-scatters nothing (autograd.grad fills no
            # .grad). A rank with an empty local batch takes both passes all the same: the other
            # ranks' all-gathers and reduce-scatters wait for its own.
            torch.autograd.grad(total, _graph_leaves(total.grad_fn), retain_graph=True,
                                allow_unused=True)
            if batch:
                snap = recorder.snapshot("clipped_backward()")
                plans, units = plan(snap)
                sq = add_up(squared_norms(snap, plans, units, Forms(snap, plans)).values())
                del snap
            else:
                sq = _empty_norms(trainable)
        elif batch == 0:  # DDP: an empty local batch joins the ranks' collectives below
            sq = _empty_norms(trainable)
        elif recorder.drive(total, None, True, stream) and streams:
            sq = streams[0].finish()
            if sq is None:
                recorder.snapshot("clipped_backward()")  # raises NoBackwardError
        else:  # the sum check is due, or shared calls / raw parameters met the batch (their
            # hook calls are not counted: no stream): records kept, then reduced
            snap = recorder.snapshot("clipped_backward()")
            plans, units = plan(snap)
            sq = add_up(squared_norms(snap, plans, units, Forms(snap, plans)).values())
            del snap
    norms = sq.sqrt_().div_(scale)
    factors = (max_norm / norms).clamp_(max=1.0)
    recorder.reset_batch()  # records consumed; the second pass records nothing
    for _, p in trainable:
        p.grad = None
    if group is not None and not accumulate:
        # DDP and FSDP average the ranks' gradients: weigh by world / global D
        divisor = _global_divisor(recorder, group, batch) / dist.get_world_size(group)
    second = (losses * (factors / divisor).to(losses.dtype)).sum()
    with recorder.muted():
        (second if scaler is None else scaler.scale(second)).backward()
    if accumulate:
        # .grad: S times the clipped sum (under DDP the ranks' mean: finish_step's all-reduce
        # sums the ranks' accumulators)
        accumulation.add(trainable, 1.0 / scale, batch, bound=max_norm, key=key, batch=None,
                         overflow=_overflowed(recorder, norms))
        return norms
    if mesh is not None:  # FSDP reduce-scattered the clipped sums; the noise drawn on rank 0
        std = noise_multiplier * max_norm * scale / (divisor * dist.get_world_size(group))
        for _, p in trainable:
            if p.grad is None:
                p.grad = distribute_tensor(torch.zeros(p.shape, dtype=p.dtype, device=p.device),
                                           p.device_mesh, p.placements)
            if std > 0:
                z = torch.randn(p.shape, generator=generator, dtype=p.dtype, device=p.device)
                p.grad.add_(distribute_tensor(z, p.device_mesh, p.placements, src_data_rank=0),
                            alpha=std)
    elif group is None:
        _add_noise(trainable, {id(p) for _, p in trainable if p.grad is not None},
                   noise_multiplier * max_norm * scale / divisor, generator)
    else:  # the same noise on every rank, drawn once (rank 0) and broadcast
        std = noise_multiplier * max_norm * scale / (divisor * dist.get_world_size(group))
        _add_noise(trainable, {id(p) for _, p in trainable if p.grad is not None}, 0.0, None)
        if std > 0:
            for _, p in trainable:
                z = (torch.randn(p.shape, generator=generator, dtype=p.dtype, device=p.device)
                     if dist.get_rank(group) == 0 else torch.empty_like(p))
                dist.broadcast(z, src=dist.get_global_rank(group, 0), group=group)
                p.grad.add_(z, alpha=std)
    _skip_if_not_finite(recorder, trainable, norms)
    if accumulation is not None:
        accumulation.consumed(trainable)
    return norms


def finish_step(recorder: Recorder, accumulation: Accumulation, *, noise_multiplier: float = 0.0,
                expected_batch_size: Optional[float] = None,
                generator: Optional[torch.Generator] = None) -> int:
    """The DP-SGD step gradient of a logical batch clipped in micro-batches (Abadi et al. 2016,
    arXiv:1607.00133, algorithm 1, one lot; Opacus' virtual steps / ``BatchMemoryManager``).

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
        recorder: the :class:`~gradhooks.capture.Recorder` of a :class:`~gradhooks.GradHooks`.
        accumulation: its :class:`~gradhooks.accumulation.Accumulation` (called as
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
    trainable = _clip_setup(recorder, accumulation.bound, noise_multiplier)
    accumulation.watch()
    if recorder.records and recorder.batch_id != accumulation.batch:
        raise AccumulationError(
            f"{read}: the current batch had a backward pass (its records are there) that was "
            f"not clipped into the accumulation; its samples would be left out. Call "
            f"gh.clip_and_accumulate(C, accumulate=True) after each micro-batch's backward, "
            f"then finish_step()")
    accumulation.check_grads(trainable, read, current=True)
    group = _ddp_group(recorder)
    samples = accumulation.samples
    if expected_batch_size is not None:
        divisor = float(expected_batch_size)
    elif recorder.loss_reduction == "mean":
        total = samples if group is None else _global_divisor(recorder, group, samples)
        divisor = float(total) or 1.0
    else:
        divisor = 1.0
    std = noise_multiplier * accumulation.bound
    scale = recorder.grad_scale() / divisor
    draws = group is None or dist.get_rank(group) == 0  # the noise once, on rank 0
    with no_autocast():
        for _, p in trainable:
            t = accumulation.sums.pop(id(p), None)
            if t is None:
                t = torch.zeros_like(p)
            if std > 0 and draws:
                t.add_(torch.randn(p.shape, generator=generator, dtype=t.dtype, device=t.device),
                       alpha=std)
            if group is not None:
                dist.all_reduce(t, group=group)
            p.grad = t.mul_(scale).to(p.dtype)
            if accumulation.overflow:
                p.grad.fill_(float("inf"))
    accumulation.consumed(trainable)
    accumulation.reset()
    return samples
