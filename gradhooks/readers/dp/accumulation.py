"""Logical batches larger than memory in DP-SGD: clipped sums accumulated over micro-batches.

DP-SGD (Abadi et al. 2016, arXiv:1607.00133, algorithm 1) clips each sample of a *lot* ``L``
(the logical batch) and adds the Gaussian noise once per lot::

    theta.grad = (sum_{n in L} min(1, C / ||g_n||) g_n + sigma C z) / D

``D = |L|`` (or the *expected* lot size ``q N`` under Poisson sampling, as Opacus divides).
At real size a lot has hundreds to thousands of samples and is processed in micro-batches that
fit in memory: Opacus' ``BatchMemoryManager`` and its "virtual steps" (``DPOptimizer`` keeps
``p.summed_grad`` and skips the step until the lot is complete), fastDP's gradient
accumulation. In gradhooks each micro-batch is clipped with
``gh.clip_and_accumulate(C, accumulate=True)`` (book-keeping) or
``gh.clipped_backward(losses, C, accumulate=True)`` (two-pass), which add the micro-batch's
clipped sum to an :class:`Accumulation` (no noise, no division, ``param.grad`` set to ``None``);
``gh.finish_step(noise_multiplier=sigma)`` (:func:`gradhooks.readers.dp.clipping.finish_step`) then writes
the formula above into ``param.grad`` and starts the next lot. The result is that of one clip of
the whole lot: each sample is clipped on its own, whatever micro-batch it is in.

The accumulator lives here, not on the parameters (Opacus' ``p.summed_grad``): detaching leaves
the model as it was.

**Silent drops.** ``param.grad`` accumulates over ``loss.backward()`` calls, while a clip
*overwrites* it with the clipped sum of the current batch only (its records: the next forward
replaced the earlier batch's). ``loss.backward()`` on micro-batch 1, then a forward/backward on
micro-batch 2, then a clip, would drop micro-batch 1 without a word. :class:`Accumulation` sees
it at no cost per step: a hook after autograd's accumulation into each trainable parameter's
``.grad`` (``register_post_accumulate_grad_hook``) notes the tensor (a weak reference), its
``_version`` and the batch (:attr:`gradhooks.core.recorder.capture.Recorder.batch_id`). A backward of a later
batch that adds into that very tensor, untouched since (its ``_version`` one more: neither
zeroed in place, as ``optimizer.zero_grad(set_to_none=False)`` does, nor replaced, as
``set_to_none=True`` does), had an unread gradient in it; a clip of such a ``.grad``, or of one
still holding an earlier batch's unread gradient, raises :class:`~gradhooks.AccumulationError`.
Backward passes through one forward (``retain_graph=True``) are one batch and accumulate by
design; a ``.grad`` gradhooks wrote (a clip, :func:`~gradhooks.readers.dp.clipping.finish_step`) counts as
read. No gradient value is read: one weak reference and two integers per parameter.

**Micro-batches and Poisson sampling.** :func:`micro_batches` splits a logical batch into
micro-batches of at most ``k`` samples. For Poisson sampling (each sample in the lot with
probability ``q``, independently: the sampling the privacy accounting assumes) use Opacus'
``DPDataLoader.from_data_loader(loader)`` (its ``UniformWithReplacementSampler``), whose lots
vary in size and may be empty, and divide by the expected lot size
``finish_step(..., expected_batch_size=int(q * len(dataset)))``.
"""
from __future__ import annotations

import functools
import weakref
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

from torch import Tensor, nn

from ...base.errors import AccumulationError
from ...base.torch_internals import (
    drop_empty_post_accumulate_grad_hooks,
    is_view,
    post_accumulate_grad_hooks,
    version,
)
from ...base.utils import is_paused
from ..distributed import is_sharded

__all__ = ["Accumulation", "micro_batches"]


class _Seen:
    """What the last accumulation into a parameter's ``.grad`` left: the tensor (weakly), its
    ``_version``, the batch, whether gradhooks has read (or written) it since, and whether it
    already held an earlier batch's unread gradient (``stale``: that batch's id)."""

    __slots__ = ("ref", "version", "batch", "consumed", "stale")

    def __init__(self, grad: Tensor, batch: int, consumed: bool, stale: Optional[int]):
        self.ref = weakref.ref(grad)
        self.version = version(grad)
        self.batch, self.consumed, self.stale = batch, consumed, stale

    def holds(self, grad: Optional[Tensor]) -> bool:
        """Whether ``grad`` is the tensor seen, not modified since."""
        return grad is not None and self.ref() is grad and version(grad) == self.version


class Accumulation:
    """The DP-SGD accumulator of a :class:`~gradhooks.GradHooks` and its ``.grad`` watch.

    Index conventions: ``b`` the samples of one micro-batch, ``B = sum b`` those of the lot
    (the logical batch). Holds, per trainable parameter, the sum over the micro-batches read so
    far of their clipped per-sample gradients ``sum_n c_n g_n`` (parameter-shaped, unscaled:
    gradients of each sample's own loss, at scale 1 under a ``GradScaler``), the number of
    samples ``B`` and micro-batches, the clipping bound, and whether a micro-batch overflowed.
    Written by :func:`gradhooks.readers.dp.clipping.clip_and_accumulate` and
    :func:`gradhooks.readers.dp.clipping.clipped_backward` with ``accumulate=True``, emptied by
    :func:`gradhooks.readers.dp.clipping.finish_step`.
    """

    def __init__(self, recorder):
        self.recorder = recorder
        self.sums: Dict[int, Tensor] = {}   # id(param) -> sum over micro-batches of sum_n c_n g_n
        self.samples = 0                    # B so far (this rank's, under DDP)
        self.micro = 0                      # micro-batches read so far
        self.bound: Optional[float] = None  # C of the noise (flat C, or sqrt(sum_k C_k^2))
        self.key: Optional[tuple] = None    # (bounds, groups) of the first micro-batch
        self.batch: Optional[int] = None    # batch_id of the last book-keeping micro-batch read
        self.overflow = False               # a micro-batch had a non-finite norm (GradScaler)
        self._seen: Dict[int, _Seen] = {}
        self._handles: list = []
        self._were_none: List[nn.Parameter] = []
        self._watched: Dict[int, weakref.ref] = {}  # id(param) -> the parameter hooked
        # (a GradHooks dropped while attached: its hooks go with it)
        weakref.finalize(self, _unhook, self._handles, self._were_none).atexit = False
        self.watch()

    # ------------------------------------------------------------------ the .grad watch
    def watch(self) -> None:
        """Hook every trainable parameter the recorder covers that has no hook yet (called at
        attach and by every clip, so that parameters unfrozen later are followed). Sharded
        ``DTensor`` parameters (FSDP2, whose ``.grad`` FSDP writes itself) are not watched."""
        for p in self.recorder.params.values():
            w = self._watched.get(id(p))
            if (w is not None and w() is p) or not p.requires_grad or is_sharded(p):
                continue
            self._watched[id(p)] = weakref.ref(p)
            if post_accumulate_grad_hooks(p) is None:
                self._were_none.append(p)
            # (a weak reference: the parameters' hooks do not keep the GradHooks alive)
            self._handles.append(p.register_post_accumulate_grad_hook(
                functools.partial(_after_accumulate, weakref.ref(self), id(p))))

    def accumulated(self, pid: int, p: Tensor) -> None:
        # After autograd added a backward's gradient into p.grad.
        if is_paused() or not self.recorder.attached:
            return
        grad, batch = p.grad, self.recorder.batch_id
        prev = self._seen.get(pid)
        stale = None
        if (prev is not None and not prev.consumed and grad is not None
                and prev.ref() is grad and version(grad) == prev.version + 1):
            # added into the tensor the last backward left, untouched since
            stale = prev.stale if prev.stale is not None else (
                prev.batch if prev.batch != batch else None)
        if grad is not None:
            self._seen[pid] = _Seen(grad, batch, False, stale)

    def check_grads(self, trainable: Sequence[Tuple[str, nn.Parameter]], read: str, *,
                    current: bool = False) -> None:
        """Raise if a ``.grad`` that ``read`` overwrites holds a gradient of an earlier batch
        (with ``current=True``: of any batch, the current one included) that gradhooks never
        read.

        Raises:
            AccumulationError: naming the parameters, the reason and what to do."""
        batch = self.recorder.batch_id
        dropped = []
        for name, p in trainable:
            seen = self._seen.get(id(p))
            if seen is None or seen.consumed or not seen.holds(p.grad):
                continue
            if current or seen.stale is not None or seen.batch != batch:
                dropped.append(name)
        if dropped:
            names = ", ".join(map(repr, dropped[:3])) + (" ..." if len(dropped) > 3 else "")
            raise AccumulationError(
                f"{read} would overwrite param.grad of {names}, which still holds the gradient "
                "of a loss.backward() that no clip read"
                + ("" if current else " (of an earlier batch: another forward, not zeroed since)")
                + ": that gradient would be dropped. Clip every micro-batch after its own "
                "backward with accumulate=True (gh.clip_and_accumulate(C, accumulate=True) or "
                "gh.clipped_backward(losses, C, accumulate=True)) and call "
                "gh.finish_step(noise_multiplier=...) once per logical batch; or call "
                "optimizer.zero_grad() before the backward if the old gradient is not wanted")

    def consumed(self, trainable: Sequence[Tuple[str, nn.Parameter]]) -> None:
        """Mark each ``.grad`` as read: gradhooks wrote it (a clip, ``finish_step``) or dropped
        it (``None``)."""
        batch = self.recorder.batch_id
        for _, p in trainable:
            if p.grad is None:
                self._seen.pop(id(p), None)
            else:
                self._seen[id(p)] = _Seen(p.grad, batch, True, None)

    # ------------------------------------------------------------------ the accumulator
    @property
    def pending(self) -> bool:
        """Whether micro-batches were accumulated since the last ``finish_step``."""
        return self.micro > 0

    def refuse_pending(self, read: str) -> None:
        """Raise if an accumulation is pending (a call that overwrites ``.grad`` would drop it).

        Raises:
            AccumulationError"""
        if self.pending:
            raise AccumulationError(
                f"{read} without accumulate=True while {self.micro} micro-batch(es) "
                f"({self.samples} samples) are accumulated for a DP step: it would overwrite "
                f"param.grad and leave them behind. Clip this micro-batch with accumulate=True "
                f"too, then call gh.finish_step(noise_multiplier=...)")

    def begin(self, read: str, key: tuple, batch: Optional[int]) -> None:
        """Check that a micro-batch may be added (nothing is changed until :meth:`add`): the
        same clipping as the earlier ones, and (book-keeping, ``batch`` its id) not read before.

        Raises:
            AccumulationError: the micro-batch was already accumulated.
            ValueError: another ``max_norm`` / ``groups`` than the earlier micro-batches."""
        if batch is not None and batch == self.batch and self.pending:
            raise AccumulationError(
                f"{read} with accumulate=True: this micro-batch was already clipped into the "
                f"accumulation (its samples would count twice); run the next micro-batch's "
                f"forward and backward first")
        if self.pending and key != self.key:
            raise ValueError(
                f"{read}: every micro-batch of a logical batch must be clipped alike (max_norm, "
                f"groups); the first had {self.key}, this one {key}")

    def add(self, trainable: Sequence[Tuple[str, nn.Parameter]], factor: float, samples: int, *,
            bound: float, key: tuple, batch: Optional[int], overflow: bool) -> None:
        """Move each trainable parameter's ``.grad`` (``1 / factor`` times the micro-batch's
        clipped sum ``sum_n c_n g_n``, or ``None`` for 0) into the accumulator, times ``factor``,
        and set ``.grad`` to ``None``; count the micro-batch's ``samples``. ``bound``: ``C`` of
        the noise; ``key``: the clipping (:meth:`begin`); ``batch``: the book-keeping batch's
        id; ``overflow``: a non-finite norm under a ``GradScaler``."""
        for _, p in trainable:
            g = p.grad
            if g is None:
                continue
            acc = self.sums.get(id(p))
            if acc is None:
                # the first micro-batch's tensor becomes the accumulator, unless it is a view
                # (DDP's gradient_as_bucket_view: its bucket is written again by the next backward)
                acc = self.sums[id(p)] = g.clone() if is_view(g) else g
                if factor != 1.0:
                    acc.mul_(factor)
            elif factor != 1.0:
                acc.add_(g, alpha=factor)
            else:
                acc.add_(g)
            p.grad = None
        self.consumed(trainable)
        self.samples += samples
        self.micro += 1
        self.overflow = self.overflow or overflow
        self.bound, self.key = bound, key
        if batch is not None:
            self.batch = batch

    def reset(self) -> None:
        """Drop what was accumulated; the next micro-batch starts a new logical batch."""
        self.sums.clear()
        self.samples = self.micro = 0
        self.bound = self.key = self.batch = None
        self.overflow = False

    def close(self) -> None:
        """Remove the hooks and drop everything (:meth:`~gradhooks.GradHooks.detach`); the
        parameters' hook dictionaries are as before."""
        _unhook(self._handles, self._were_none)
        self._watched.clear()
        self._seen.clear()
        self.reset()


def _unhook(handles: list, were_none: List[nn.Parameter]) -> None:
    # Remove the watch's hooks; the dictionaries torch created for them go back to None.
    for h in handles:
        h.remove()
    handles.clear()
    for p in were_none:
        drop_empty_post_accumulate_grad_hooks(p)
    were_none.clear()


def _after_accumulate(ref, pid: int, p: Tensor) -> None:
    # The post-accumulate-grad hook of a watched parameter.
    acc = ref()
    if acc is not None:
        acc.accumulated(pid, p)


BatchLike = Union[Tensor, Sequence[Tensor]]


def micro_batches(batch: BatchLike, max_size: int) -> Iterator[BatchLike]:
    """Split a logical batch into consecutive micro-batches of at most ``max_size`` samples.

    Opacus' ``BatchMemoryManager`` idea (``opacus/utils/batch_memory_manager.py``: a Poisson
    lot split into physical batches that fit in memory) without its coupling to the optimizer:
    clip each micro-batch with ``accumulate=True`` and call ``gh.finish_step`` after the last.

    Args:
        batch: a tensor ``(B, ...)`` or a tuple / list of tensors batched on dim 0 (what a
            ``DataLoader`` yields, ``(x, y)``).
        max_size: ``k >= 1``.

    Yields:
        ``ceil(B / k)`` micro-batches of the same structure, views ``(b, ...)`` with ``b <= k``
        (all ``k`` but the last), in order; for an empty lot (``B = 0``, which Poisson sampling
        draws) one empty micro-batch ``(0, ...)``, so that the step still runs (its noise).

    Raises:
        ValueError: ``max_size`` not a positive integer, or tensors of different batch sizes.
    """
    if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1:
        raise ValueError(f"max_size must be a positive integer, got {max_size!r}")
    single = isinstance(batch, Tensor)
    parts = [batch] if single else list(batch)
    sizes = {t.shape[0] for t in parts}
    if len(sizes) != 1:
        raise ValueError(f"micro_batches: the tensors of a batch must share dim 0, got sizes "
                         f"{sorted(sizes)}")
    size = sizes.pop()
    for start in range(0, max(size, 1), max_size):
        pieces = [t[start:start + max_size] for t in parts]
        yield pieces[0] if single else tuple(pieces) if isinstance(batch, tuple) else pieces
