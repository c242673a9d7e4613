"""The two-pass clipping driver: :func:`clipped_backward` runs the backward passes of a DP-SGD
step itself (Li et al. 2022, arXiv:2110.05679, sec. 4).

Book-keeping clipping (:func:`gradhooks.readers.dp.clipping.clip_and_accumulate`) keeps every layer's
activations and grad_outputs until all norms are known. From per-sample losses, a first backward
(no weight gradients, graph retained) forms each group of records' norms as soon as its
grad_outputs are in and drops them (:class:`_NormStream`); a second, ordinary backward of
``sum_n c_n loss_n / D`` then gives the clipped sum through autograd's own weight-gradient
kernels (less the parameters whose small per-sample gradients the first pass kept:
:attr:`_NormStream.kept`). One more backward pass, but no grad_output outlives its layer.

Index conventions: ``n`` sample (``B`` of this process's batch), ``c_n`` the clipping factor.
How the ranks of a multi-process run combine (the divisor, the noise): :mod:`gradhooks.readers.distributed`.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ...base.errors import GradHooksError
from ...base.utils import no_autocast, own_loss_scale
from ...core.recorder.capture import Recorder
from ..distributed import Ranks
from ..loss_reduction import check_per_sample_losses, loss_scale_of
from ..plan import Forms, add_up, keep_budget, plan, squared_norms
from ..sample_check import SampleCheck
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

__all__ = ["clipped_backward"]


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


class _NormStream:
    """Per-sample squared norms formed while :func:`clipped_backward`'s first pass runs.

    The records are split into groups linked by shared parameters (a layer called twice, tied
    weights). As soon as every record of a group has had all its hook calls (``events``), the
    group's norms are formed (:func:`gradhooks.readers.plan.squared_norms`) and its activations and
    grad_outputs dropped, so grad_outputs do not pile up over the backward as in book-keeping.
    A group holding a record of a shared call or of a raw parameter (``record.shared`` set: a
    ViT's class token and position embedding), whose parts come from the hooks where it met the
    batch and whose calls the events do not count, is reduced at the end (:meth:`finish`); the
    other groups stream as before.

    With ``keep``, each group keeps the per-sample gradients it materialised for its norms
    (:class:`~gradhooks.readers.plan.Forms`' ``keep``) up to
    :func:`~gradhooks.readers.plan.keep_budget` of its own records, in :attr:`kept`
    (``{id(param): (N, *param.shape)}``, ``S`` times the gradients): the large-``S`` layers
    with small weights (a depthwise convolution, a stem), whose weight-backward the second pass
    then skips.
    """

    def __init__(self, recorder: Recorder, caps: list, events: Dict[int, int], keep: bool,
                 check: Optional[SampleCheck] = None):
        self.recorder, self.events, self.hits = recorder, events, {}
        self.keep, self.kept, self.check = keep, {}, check
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
        self.deferred = {id(g) for g in groups.values() if any(c.shared is not None for c in g)}
        self.groups = list(groups.values())
        self.sq: Optional[Tensor] = None

    def hit(self, cap) -> None:
        """A hook call of the record ``cap`` (:meth:`~gradhooks.core.recorder.capture.Recorder.drive`)."""
        k = self.hits.get(id(cap), 0) + 1
        self.hits[id(cap)] = k
        if k == self.events.get(id(cap)):
            group = self.group_of.get(id(cap))
            if group is None or id(group) in self.deferred:  # (reduced by finish())
                return
            self.waiting[id(group)] -= 1
            if not self.waiting[id(group)]:
                self._reduce(group)

    def _reduce(self, group: list) -> None:
        del self.waiting[id(group)]
        reached = [cap for cap in group if cap.hits]
        if reached:
            batch = self.recorder.snapshot("clipped_backward()", records=reached)
            plans, units = plan(batch)
            evidence = Evidence(batch)
            forms = Forms(batch, plans, keep=keep_budget(batch) if self.keep else 0)
            sq = squared_norms(batch, plans, units, forms, evidence)
            evidence.judge()
            self.sq = add_up([self.sq, *sq.values()])
            self.kept.update(forms.kept)
            if self.check is not None:  # (the sample check's weighted sums: consumes forms)
                self.check.weigh(batch, plans, forms, sq)
        for cap in group:
            cap.release()

    def finish(self) -> Optional[Tensor]:
        """Reduce the groups some of whose hooks did not run (an output no gradient reached);
        ``(N,)`` squared norms summed over all parameters, or ``None`` if nothing was reached.

        Raises:
            GradHooksError: a record the pass reached that was not below the loss when the
                pass began shares a parameter with a group already reduced (its norm would miss
                that part); not met by any known setup, refused rather than guessed.
        """
        for group in self.groups:
            if id(group) in self.waiting:
                self._reduce(group)
        extra = [cap for cap in self.recorder.records if cap.hits and id(cap) not in self.group_of]
        if extra:  # (reached, unknown to the walk of the graph: reduced together, at the end)
            done = {id(cap.layer.params[n]) for g in self.groups for cap in g for n in cap.names}
            shared = [cap for cap in extra if any(id(cap.layer.params[n]) in done
                                                  for n in cap.names)]
            if shared:
                raise GradHooksError(
                    f"clipped_backward(): the first pass reached {shared[0].layer.describe()}, "
                    f"which the graph below the losses did not show when it began, and whose "
                    f"parameters other layers use too, whose norms were already formed; use "
                    f"loss.backward() and clip_and_accumulate() (book-keeping) for this model")
            self.waiting[id(extra)] = len(extra)
            self._reduce(extra)
        return self.sq


def clipped_backward(recorder: Recorder, losses: Tensor, max_norm: float, *,
                     noise_multiplier: float = 0.0, generator: Optional[torch.Generator] = None,
                     accumulate: bool = False, accumulation: Optional[Accumulation] = None
                     ) -> Tensor:
    """DP-SGD step gradient by two-pass ghost clipping (Li et al. 2022, arXiv:2110.05679,
    sec. 4): ``param.grad`` as :func:`~gradhooks.readers.dp.clipping.clip_and_accumulate` sets it, from the
    per-sample losses, with peak memory close to plain training. A driver: it runs the backward
    passes itself.

    Replaces ``loss.backward()`` (call it after the forward, instead of any backward). First pass:
    a backward of ``losses.sum()`` (as :meth:`~gradhooks.GradHooks.backward`: no weight
    gradients, graph retained) during which each layer's per-sample squared norms are formed as
    soon as its grad_outputs are in (Gram form where cheaper, as
    :func:`gradhooks.readers.norms.per_sample_grad_norms`) and its records dropped. Then
    ``c_n = min(1, C / ||g_n||)``, and a second, ordinary backward of
    ``sum_n c_n losses[n] / D`` writes the clipped sum into ``param.grad`` (autograd's
    weight-gradient kernels, no records kept). In one process without ``sample_ids``, the
    per-sample gradients the first pass materialised for its norms are kept where they are
    small next to their layer's records (at most
    :data:`~gradhooks.readers.plan.KEEP_OF_RECORDS` of their inputs' bytes: a depthwise
    convolution, a stem, biases and norms), their clipped sum is ``sum_n c_n g_n / D`` from
    them, and the second pass asks autograd for the other parameters only (``inputs=``), so
    their weight-backward, torch's slowest kernels on the CPU for depthwise convolutions
    (ConvNeXt-T, EfficientNet), runs once less. Book-keeping
    (:func:`~gradhooks.readers.dp.clipping.clip_and_accumulate` after a backward) instead keeps every
    layer's activations and grad_outputs until the norms are known and needs no per-sample
    losses; this costs one more backward pass but keeps only what plain training keeps
    (measured in ``benchmarks/``).

    **param.grad is overwritten** (set to ``None`` before the second pass), parameters the
    passes do not reach get ``0``, plus the noise, frozen ones are left alone -- as
    :func:`~gradhooks.readers.dp.clipping.clip_and_accumulate`. The records of the batch are consumed:
    reading per-sample results afterwards raises :class:`~gradhooks.NoBackwardError`. The sum
    check runs on the steps :meth:`~gradhooks.GradHooks.backward` computes parameter gradients
    for it (first steps, new structures, every 100th); on those the first pass keeps the records
    until the end, as book-keeping does.

    Args:
        recorder: the :class:`~gradhooks.core.recorder.capture.Recorder` of a :class:`~gradhooks.GradHooks`
            (called as ``gh.clipped_backward(...)``).
        losses: ``(B,)`` per-sample losses of the current batch (``reduction="none"``), sample
            ``n``'s own loss, whose gradient is the per-sample gradient ``g_n``. With
            ``sample_ids`` (``gh.set_sample_ids``): ``(G,)``, the loss of each sample (group of
            rows), in the order of the sorted unique ids (a DPO loss per pair); the norms are
            then ``(G,)``, ``D = G`` for ``"mean"``. Row losses ``r`` ``(B,)`` become these by
            ``r.new_zeros(G).index_add(0, inverse, r)``, ``inverse`` from
            ``torch.unique(ids, return_inverse=True)``.
        max_norm: ``C > 0``.
        noise_multiplier: ``sigma >= 0``; the noise ``sigma C z / D`` is added as in
            :func:`~gradhooks.readers.dp.clipping.clip_and_accumulate` (``D = B`` for
            ``loss_reduction="mean"``, else 1).
        generator: a ``torch.Generator`` for the noise.
        accumulate, accumulation: as :func:`~gradhooks.readers.dp.clipping.clip_and_accumulate`: the
            second pass backpropagates ``sum_n c_n losses[n]`` (no ``1 / D``), whose gradient
            is moved from ``.grad`` into ``accumulation``;
            :func:`~gradhooks.readers.dp.clipping.finish_step` adds the noise and divides. Under DDP the
            second pass's all-reduce gives every rank the ranks' mean, which
            :func:`~gradhooks.readers.dp.clipping.finish_step`'s sum over the ranks turns into their total.

    **Several processes.** As :func:`~gradhooks.readers.dp.clipping.clip_and_accumulate`: the result is
    that of the ranks' concatenated batch. The second pass is an ordinary backward, so DDP's
    all-reduce or FSDP2's reduce-scatter sums the clipped gradients; the only addition is one
    all-reduce of the batch sizes (``loss_reduction="mean"``). Under FSDP2 (attach with
    ``check=False``) the first pass asks autograd for the parameter gradients (the unsharded
    parameters FSDP swaps in are not the ones the hooks know) and keeps the records until the
    norms are formed, and FSDP all-gathers each layer for both passes. A rank with an empty
    local batch takes both passes under FSDP2, and the second (with the all-reduces) under DDP.

    With ``attach(..., grad_scaler=scaler)`` both passes backpropagate ``S`` times the losses
    (``S = scaler.get_scale()``): pass the unscaled losses; ``param.grad`` is then ``S`` times
    the clipped, noised sum, for ``scaler.step(optimizer)``, as in
    :func:`~gradhooks.readers.dp.clipping.clip_and_accumulate`. Without a ``grad_scaler``, losses
    that are ``scaler.scale(losses)`` are read at the scale seen on them
    (:func:`gradhooks.readers.loss_reduction.loss_scale_of`): the norms are of the unscaled
    losses, ``param.grad`` is ``S`` times the clipped sum likewise.

    Returns:
        ``(B,)``: the per-sample gradient norms ``||g_n||`` before clipping.

    Raises:
        UnsupportedLossError: ``losses`` are one batch loss broadcast to ``B`` entries
            (:func:`gradhooks.readers.loss_reduction.check_per_sample_losses`).
        SampleIdsError: ids set for an earlier batch no read used (:meth:`~gradhooks.core.recorder.batch_reads.BatchReads.groups`).
        ValueError: bad ``max_norm`` or ``noise_multiplier``, or ``losses`` not a ``(B,)`` tensor
            that requires grad, ``B`` the batch size the hooks recorded; with ``accumulate=True``
            as :func:`~gradhooks.readers.dp.clipping.clip_and_accumulate`.
        AccumulationError: as :func:`~gradhooks.readers.dp.clipping.clip_and_accumulate` (``.grad``
            holding an unread gradient of an earlier batch, which this call sets to ``None``).
        GradHooksError: a trainable parameter the hooks do not cover; an FSDP2 model attached
            with the sum check on.
        NoBackwardError, GradientMismatchError: as :func:`gradhooks.readers.norms.per_sample_grad_norms`.
        SampleMixingError: the sample check through the batched graph
            (:mod:`gradhooks.readers.sample_check`, on the first step of each structure): the
            forward or the losses pair samples.
    """
    rows = recorder.batch_size
    batch = recorder.reads.samples("clipped_backward()")  # G with sample_ids, else B
    check_per_sample_losses(losses, batch)
    recorder.reads.see_scale(loss_scale_of(losses))
    trainable = check_clip(recorder, max_norm, noise_multiplier)
    ranks = clip_ranks(recorder)
    key = ((max_norm,), None)
    check_accumulation(accumulation, accumulate, "clipped_backward()", trainable,
                       noise_multiplier, ranks, key, None)
    if not (isinstance(losses, Tensor) and losses.dim() == 1 and losses.requires_grad
            and losses.shape[0] == batch):
        shape = tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__
        what = "B" if recorder.reads.groups("clipped_backward()") is None else "G"
        raise ValueError(
            f"clipped_backward needs the ({what},) per-sample losses of the current batch ({what} = "
            f"{batch}{'' if what == 'B' else ' samples: rows sharing a sample_id'}, e.g. "
            f"F.cross_entropy(out, y, reduction='none')) that require grad; got "
            f"{shape}" + ("" if not isinstance(losses, Tensor) or losses.requires_grad
                          else " not requiring grad"))
    # (accumulating: the second pass gives the clipped sum itself, D comes at finish_step)
    divisor = 1.0 if accumulate else own_loss_scale(recorder.loss_reduction, batch) or 1.0
    scaler = recorder.grad_scaler if recorder.grad_scale() != 1.0 else None
    total = losses.sum() if scaler is None else scaler.scale(losses.sum())
    scale = recorder.grad_scale()  # S: both passes backpropagate S times the losses
    seen = recorder.reads.seen  # (scaler.scale(losses) given: kept past the records, finish_step)
    if rows == 0 and ranks is None:  # an empty (Poisson) batch: the sum is 0, the noise is not
        recorder.reset_batch()
        for _, p in trainable:
            p.grad = None
        if accumulate:
            accumulation.add(trainable, 1.0, 0, bound=max_norm, key=key, batch=None,
                             overflow=False)
            return empty_norms(trainable)
        add_noise(trainable, set(), noise_multiplier * max_norm * scale / divisor, generator)
        if accumulation is not None:
            accumulation.consumed(trainable)
        return empty_norms(trainable)
    # (the first pass's root is total: the losses times S where the scaler is declared)
    check = SampleCheck.before(recorder, losses, None if scaler is None else
                               torch.full_like(losses, scale), batch)
    # (one process, no sample_ids: the second pass may leave kept parameters out; DDP's and
    # FSDP's reductions expect every parameter's gradient from it)
    keep = ranks is None and recorder.reads.groups("clipped_backward()") is None
    with no_autocast():
        sq, kept = _first_pass(recorder, ranks, total, trainable, keep, check)
    if check is not None:
        check.judge_norms(sq)
    norms = sq.sqrt_().div_(scale)
    factors = (max_norm / norms).clamp_(max=1.0)
    recorder.reset_batch()  # records consumed; the second pass records nothing
    recorder.reads.seen = seen
    for _, p in trainable:
        p.grad = None
    if ranks is not None and not accumulate:
        # DDP and FSDP average the ranks' gradients: weigh by world / global D
        divisor = ranks.global_divisor(recorder.loss_reduction, batch) / ranks.size
    second = (losses * (factors / divisor).to(losses.dtype)).sum()
    # (every other leaf of the graph, not the trainable parameters only: an input that
    # requires grad gets its gradient from the second pass as without kept parameters)
    rest = [t for t in _graph_leaves(second.grad_fn) if id(t) not in kept] if kept else []
    if scaler is not None:
        second = scaler.scale(second)
    with recorder.muted():
        if not kept:
            second.backward()
        elif rest:  # (autograd skips the kept parameters' weight-backward)
            second.backward(inputs=rest)
    for _, p in trainable:  # S sum_n c_n g_n / D from the kept S g_n
        t = kept.get(id(p))
        if t is not None:
            p.grad = torch.tensordot((factors / divisor).to(t.dtype), t, 1).to(p.dtype)
    if accumulate:
        # .grad: S times the clipped sum (under DDP the ranks' mean: finish_step's all-reduce
        # sums the ranks' accumulators)
        accumulation.add(trainable, 1.0 / scale, batch, bound=max_norm, key=key, batch=None,
                         overflow=overflowed(scale, norms))
        return norms
    if ranks is None:
        add_noise(trainable, {id(p) for _, p in trainable if p.grad is not None},
                  noise_multiplier * max_norm * scale / divisor, generator)
    else:  # DDP / FSDP summed the clipped sums; the same noise on every rank, drawn once
        _same_noise(trainable, ranks, noise_multiplier * max_norm * scale / (divisor * ranks.size),
                    generator)
    skip_if_not_finite(scale, trainable, norms)
    if accumulation is not None:
        accumulation.consumed(trainable)
    return norms


def _first_pass(recorder: Recorder, ranks: Optional[Ranks], total: Tensor, trainable,
                keep: bool, check: Optional[SampleCheck] = None
                ) -> Tuple[Tensor, Dict[int, Tensor]]:
    """The first pass of :func:`clipped_backward`: a backward of ``total`` (``S sum_n l_n``,
    graph retained, no weight gradients) and the ``(B,)`` per-sample squared norms of ``S``
    times the gradients, each record's formed as soon as it can be and dropped; and (``keep``:
    :attr:`_NormStream.kept`) the per-sample gradients kept for the clipped sum, ``S`` times
    the gradients (``{}`` where the pass did not stream).

    Raises:
        NoBackwardError, GradientMismatchError: as :func:`gradhooks.readers.norms.per_sample_grad_norms`.
    """
    batch = recorder.batch_size
    streams: list = []

    def stream(caps, events):
        streams.append(_NormStream(recorder, caps, events, keep, check))
        return streams[0]

    if ranks is not None and ranks.sharded:
        # FSDP2: the unsharded parameters autograd sees are not the (sharded) ones the hooks
        # know, so the first pass asks for the graph's leaves; its grad_outputs reach the
        # records as in loss.backward(), which are reduced at the end. FSDP all-gathers each
        # layer for this pass too, but reduce-scatters nothing (autograd.grad fills no
        # .grad). A rank with an empty local batch takes both passes all the same: the other
        # ranks' all-gathers and reduce-scatters wait for its own.
        with recorder.backward_pass.judged():
            torch.autograd.grad(total, _graph_leaves(total.grad_fn), retain_graph=True,
                                allow_unused=True)
        if batch:
            return _kept_records_norms(recorder), {}
        return empty_norms(trainable), {}
    if batch == 0:  # DDP: an empty local batch joins the ranks' collectives of the second pass
        return empty_norms(trainable), {}
    if recorder.drive(total, None, True, stream) and streams:
        sq = streams[0].finish()
        if sq is None:
            recorder.snapshot("clipped_backward()")  # raises NoBackwardError
        return sq, streams[0].kept
    # the sum check is due (the pass computed the parameter gradients: no stream): records
    # kept, then reduced
    return _kept_records_norms(recorder, check), {}


def _kept_records_norms(recorder: Recorder, check: Optional[SampleCheck] = None) -> Tensor:
    """``(B,)`` per-sample squared norms from all the batch's records, kept until now (and the
    sample check's weighted sums of them, :meth:`SampleCheck.weigh`)."""
    snap = recorder.snapshot("clipped_backward()")
    plans, units = plan(snap)
    evidence = Evidence(snap)
    forms = Forms(snap, plans)
    sq = squared_norms(snap, plans, units, forms, evidence)
    evidence.judge()
    if check is not None:
        check.weigh(snap, plans, forms, sq)
    return add_up(sq.values())


def _same_noise(trainable, ranks: Ranks, std: float, generator: Optional[torch.Generator]
                ) -> None:
    """Several processes, after the second pass summed the clipped gradients: every trainable
    parameter's ``.grad`` (zeros, placed like it, where the passes did not reach it) plus
    ``std z``, ``z ~ N(0, I)`` the same on every rank (drawn on rank 0), parameter by parameter
    in the order of ``trainable``."""
    for _, p in trainable:
        if p.grad is None:
            p.grad = ranks.zeros(p)
        if std > 0:
            p.grad.add_(ranks.same_noise(p, generator), alpha=std)
