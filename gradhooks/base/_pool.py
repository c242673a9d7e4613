"""The buffer pool: reuse of per-sample gradient tensors that nothing references any more.

Private to gradhooks, and the only home of the reference-count trick: the per-sample reader
offers a superseded result to the pool, and a rule asking :func:`new_empty` for a tensor of the
same shape gets one back only if neither the tensor object nor its storage is referenced
anywhere else.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from .torch_internals import storage_handle, storage_use_count

__all__ = ["BufferPool", "new_empty", "using_pool"]


class BufferPool:
    """Reuses the per-sample gradient tensors of an earlier read that nothing else references.

    Writing ``B x P`` fresh floats is dominated by page faults on newly mapped memory on CPU
    (the seed CNN's fc1: 302 MB, measured 57 ms fresh against 10 ms into a reused tensor, 2
    cores). When a result is superseded (next batch, or another backward pass) its tensors are
    offered to the pool; a rule that asks :func:`new_empty` for an output of the same shape,
    dtype and device gets one back only if neither the tensor object nor its storage is
    referenced anywhere else (no user variable, no view, no ``grad_sample``), so a result the
    user kept is never overwritten.

    Only CPU tensors of at least :attr:`MIN_BYTES` are kept. Smaller ones cost few page faults,
    and keeping them would add their size to the peak memory of the next forward and backward
    (the pool holds them until the next result is formed): on the LSTM LM benchmark (tensors of
    at most 2 MB) the pool saved no time and cost 3 MB of its 10 MB peak. On CUDA the caching
    allocator already reuses freed blocks without page faults, so a pool there would only hold
    memory.
    """

    #: bytes: smaller tensors are left to the allocator. The Transformer block's 4.2 MB
    #: feed-forward weights still gain from reuse (12.4 against 14.0 ms a step, benchmarks/).
    MIN_BYTES = 4 * 2**20

    #: Results kept for reuse: the last two. In a loop ``grads = gh.per_sample_grads()`` the
    #: variable still holds the previous result while the next one is computed, so only the one
    #: before it is free; keeping two generations lets such loops reuse memory too.
    GENERATIONS = 2

    def __init__(self) -> None:
        # Per generation, the offered tensors by (shape, dtype, device): a lookup, not a scan.
        self._gens: List[Dict[tuple, List[Tensor]]] = []

    def give(self, tensors: Iterable[Tensor]) -> None:
        """Offer ``tensors`` (a result no longer handed out) for reuse; the oldest generation
        beyond :attr:`GENERATIONS` is forgotten."""
        gen: Dict[tuple, List[Tensor]] = {}
        for t in tensors:
            if (t.device.type != "cpu" or t.numel() * t.element_size() < self.MIN_BYTES
                    or t.requires_grad):  # (a differentiable read's: no out= into it)
                continue
            gen.setdefault((t.shape, t.dtype, t.device), []).append(t)
        self._gens = [gen] + self._gens[: self.GENERATIONS - 1]

    def take(self, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Optional[Tensor]:
        """A free tensor of exactly this ``shape``/``dtype``/``device``, or ``None``."""
        key = (torch.Size(shape), dtype, device)
        for gen in reversed(self._gens):  # oldest first: the least likely to be held
            free = gen.get(key)
            if free:
                for i in range(len(free)):  # no loop variable bound to a tensor: it would count as a holder
                    if _unshared(free, i):
                        return free.pop(i)
        return None

    def clear(self) -> None:
        """Forget every tensor offered (frees their memory if nothing else holds them)."""
        self._gens = []


def _use_count(t: Tensor) -> int:
    return storage_use_count(storage_handle(t))


def _counts(pool: List[Tensor], i: int) -> Tuple[int, int]:
    t = pool[i]
    return sys.getrefcount(t), _use_count(t)


def _calibrate() -> Optional[Tuple[int, int]]:
    # Reference counts of a tensor held by the pool list only, measured through the same code
    # path (they differ between Python and torch versions); None disables reuse.
    try:
        return _counts([torch.empty(2)], 0)
    except Exception:  # a torch without the private storage use count
        return None


_UNSHARED = _calibrate()


def _unshared(pool: List[Tensor], i: int) -> bool:
    return _UNSHARED is not None and _counts(pool, i) == _UNSHARED


_POOL: Optional[BufferPool] = None  # set by the hook manager while it computes a result


@contextlib.contextmanager
def using_pool(pool: Optional[BufferPool]) -> Iterator[None]:
    """Within this context :func:`new_empty` draws from ``pool``."""
    global _POOL
    prev, _POOL = _POOL, pool
    try:
        yield
    finally:
        _POOL = prev


def new_empty(shape: Tuple[int, ...], like: Tensor) -> Optional[Tensor]:
    """An uninitialised ``like.dtype``/``like.device`` tensor of ``shape`` for a rule's result:
    a reused one from the active :class:`BufferPool` when available, else a new one; ``None``
    for a differentiable read (``like`` carries an autograd graph under grad mode), where the
    rule must make its result by the op itself (``out=None``: ops with ``out=`` have no
    derivative)."""
    if like.requires_grad and torch.is_grad_enabled():
        return None
    shape = tuple(shape)
    if _POOL is not None:
        t = _POOL.take(shape, like.dtype, like.device)
        if t is not None:
            return t
    return like.new_empty(shape)

