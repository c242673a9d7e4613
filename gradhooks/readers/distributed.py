"""How the ranks of a multi-process run combine: the one module that talks to
``torch.distributed``.

What it owns:

* **Which processes.** :func:`ranks_of` finds the processes a model's gradients are combined
  over: the process group of a ``DistributedDataParallel`` model, or the device mesh of a model
  sharded by FSDP2 (``fully_shard``: its parameters are ``DTensor`` shards). :func:`ranks_of_group`
  wraps a group the caller names (``kfac_factors(all_reduce=True, group=...)``).
* **The global divisor** ``D`` of the ranks' concatenated batch (:meth:`Ranks.global_divisor`:
  one all-reduce of the local batch sizes).
* **The sum of per-rank tensors**, one parameter at a time, into that parameter's placement
  (:meth:`Ranks.sum_`): an all-reduce for a replicated parameter (DDP), a reduce-scatter into
  the shards for a ``DTensor`` parameter (FSDP2), as those wrappers reduce their own gradients.
* **Noise the same on every rank** (:meth:`Ranks.same_noise`), drawn once, on rank 0.
* **KFAC's all-reduce** of factor sums and counts (:meth:`Ranks.all_reduce_kfac`).

The readers (:mod:`gradhooks.readers.dp.clipping`, :mod:`gradhooks.readers.dp.clipped_backward`,
:mod:`gradhooks.kfac`) hold a :class:`Ranks` (``None`` for one process) and call these methods;
none of them imports ``torch.distributed``. Per-sample norms need no communication in any mode
here: every rank records whole layers for its own samples (FSDP gathers a layer's parameters for
its forward and backward).

**Adding a mode** (tensor parallel, ZeRO-3, ...): teach :func:`ranks_of` to recognise the
model (or its parameters' placement) and give :meth:`Ranks.sum_`, :meth:`Ranks.same_noise`,
:meth:`Ranks.zeros` and :meth:`Ranks.zero_summand` a branch for the new placement (or a
:class:`Ranks` subclass overriding them), with its test in ``tests/test_distributed.py``. A
mode whose ranks each hold only part of a layer's weight (tensor parallel) would also need the
per-sample norms summed over the ranks, which is not done here yet.

Index conventions: ``R`` ranks in the group; a parameter of shape ``P`` (any shape).
"""
from __future__ import annotations

import zlib
from typing import Iterable, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..base.errors import GradHooksError
from ..base.torch_internals import DTensor, Partial, distribute_tensor

__all__ = ["Ranks", "ranks_of", "ranks_of_group", "is_sharded"]


def is_sharded(t: Tensor) -> bool:
    """Whether ``t`` is a ``DTensor`` (an FSDP2 parameter or gradient): each rank holds a shard
    of it, so its local storage cannot receive a full-size tensor."""
    return DTensor is not None and isinstance(t, DTensor)


class Ranks:
    """The processes whose gradients are combined into one result, and how.

    Args:
        group: the ``torch.distributed`` process group (``None``: the world).
        mesh: the FSDP2 device mesh the group belongs to, or ``None`` (DDP, or a named group).
        device: where the small tensors of the collectives live (batch sizes, counts): the
            parameters' device (a CUDA device for NCCL).
    """

    def __init__(self, group=None, mesh=None, device: Optional[torch.device] = None):
        self.group, self.mesh = group, mesh
        self.device = torch.device("cpu") if device is None else device

    @property
    def sharded(self) -> bool:
        """Whether the parameters are FSDP2 shards (``DTensor``): the unsharded parameters that
        autograd sees during a forward and backward are not the ones the hooks know, and
        ``.grad`` holds this rank's shard only."""
        return self.mesh is not None

    @property
    def size(self) -> int:
        """``R``: the number of ranks in the group."""
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        """This process's rank in the group (``0`` draws the noise)."""
        return dist.get_rank(self.group)

    def global_divisor(self, loss_reduction: str, local_size: int) -> float:
        """``D`` of the ranks' concatenated batch: the total number of samples for
        ``loss_reduction="mean"`` (``0.0`` if every rank's batch is empty), else ``1.0``
        without communication. One all-reduce of ``local_size``; every rank must call it."""
        if loss_reduction != "mean":
            return 1.0
        size = torch.tensor([float(local_size)], dtype=torch.float64, device=self.device)
        dist.all_reduce(size, group=self.group)
        return float(size)

    def sum_(self, param: Tensor, t: Tensor) -> Tensor:
        """``sum_r t_r`` over the ranks, placed like ``param`` (to be its ``.grad``).

        A replicated parameter (DDP): ``t`` is all-reduced in place and returned. A ``DTensor``
        parameter (FSDP2): ``t``, this rank's full-size summand, is reduce-scattered into the
        parameter's placements (``Partial`` -> ``Shard``, one collective, as FSDP's own); the
        result is a ``DTensor``. Every rank must call it, for the same parameters in the same
        order.

        Args:
            param: the parameter, shape ``P``.
            t: ``P``: this rank's summand, a plain tensor (in ``param``'s dtype for a
                ``DTensor`` parameter).

        Returns:
            ``P``: the sum (``t`` itself for a replicated parameter).
        """
        if is_sharded(param):
            mesh = param.device_mesh
            return DTensor.from_local(t, mesh, [Partial()] * mesh.ndim).redistribute(
                mesh, param.placements)
        dist.all_reduce(t, group=self.group)
        return t

    def same_noise(self, param: Tensor, generator: Optional[torch.Generator]) -> Tensor:
        """``z ~ N(0, I)`` of ``param``'s shape, dtype and placement, the same on every rank:
        drawn on rank 0 from ``generator`` and broadcast (replicated) or scattered into the
        shards (``DTensor``; every rank draws, rank 0's draw is used). Every rank must call it.

        Returns:
            ``P``: a plain tensor, or a ``DTensor`` placed like ``param``.
        """
        if is_sharded(param):
            z = torch.randn(param.shape, generator=generator, dtype=param.dtype,
                            device=param.device)
            return distribute_tensor(z, param.device_mesh, param.placements, src_data_rank=0)
        z = (torch.randn(param.shape, generator=generator, dtype=param.dtype, device=param.device)
             if self.rank == 0 else torch.empty_like(param))
        src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast(z, src=src, group=self.group)
        return z

    @staticmethod
    def zero_summand(param: Tensor) -> Tensor:
        """This rank's summand for a parameter it has nothing for: full-size zeros of
        ``param``'s shape and dtype as a plain tensor (a ``DTensor`` parameter's global shape),
        for :meth:`sum_`; no communication."""
        if is_sharded(param):
            return torch.zeros(param.shape, dtype=param.dtype, device=param.device)
        return torch.zeros_like(param)

    @staticmethod
    def zeros(param: Tensor) -> Tensor:
        """Zeros of ``param``'s shape and dtype, placed like it (a ``.grad`` for a parameter no
        backward reached); no communication."""
        if is_sharded(param):
            return distribute_tensor(torch.zeros(param.shape, dtype=param.dtype,
                                                 device=param.device),
                                     param.device_mesh, param.placements)
        return torch.zeros_like(param)

    def all_reduce_kfac(self, tensors: Sequence[Tensor], counts: Sequence[int],
                        layout: Sequence[tuple]) -> List[int]:
        """Sum KFAC's factor numerators and counts over the ranks (:mod:`gradhooks.kfac`), so
        that every rank holds the factors of the union of the ranks' batches.

        Three collectives: a ``MAX`` of the number of entries and a checksum of ``layout``
        (each also negated, to see any rank differing), one ``SUM`` of all ``tensors``
        flattened into one buffer (copied back in place), one ``SUM`` of the integers. Every
        rank must call it.

        Args:
            tensors: the factor sums, any shapes, one dtype; summed in place.
            counts: integers (the sample count, position counts), summed.
            layout: one item per factor entry (its key and shapes), the same on every rank.

        Returns:
            ``counts`` summed over the ranks, as a list.

        Raises:
            GradHooksError: if the ranks' ``layout`` differ (different layers or shapes).
        """
        device = tensors[0].device if tensors else torch.device("cpu")
        described = repr(list(layout))
        sig = zlib.crc32(described.encode())
        check = torch.tensor([len(layout), -len(layout), sig, -sig], dtype=torch.int64,
                             device=device)
        dist.all_reduce(check, op=dist.ReduceOp.MAX, group=self.group)
        if check[0] != -check[1] or check[2] != -check[3]:
            raise GradHooksError(
                "kfac_factors(all_reduce=True): the ranks hold factors of different layers or "
                f"shapes (this rank: {described}); every rank must run the same model and "
                f"backward passes")
        if tensors:
            flat = torch.cat([t.reshape(-1) for t in tensors])
            dist.all_reduce(flat, group=self.group)
            start = 0
            for t in tensors:
                t.copy_(flat[start:start + t.numel()].view_as(t))
                start += t.numel()
        ints = torch.tensor(list(counts), dtype=torch.int64, device=device)
        dist.all_reduce(ints, group=self.group)
        return ints.tolist()


def ranks_of(model: nn.Module, params: Optional[Iterable[Tensor]] = None) -> Optional[Ranks]:
    """The ranks ``model``'s gradients are combined over, or ``None`` for one process.

    FSDP2 (``fully_shard``): the first of ``params`` is a ``DTensor`` on a mesh of at least two
    devices; the ranks are the mesh's (1-D) group. DDP: ``model`` is a
    ``DistributedDataParallel`` over an initialised group of at least two processes. Otherwise
    (one process, a world of one, no group initialised): ``None``.

    Args:
        model: the model as attached (the DDP wrapper, or the sharded module).
        params: the parameters to be combined, in order (the hooked ones); default
            ``model.parameters()``.
    """
    first = next(iter(model.parameters() if params is None else params), None)
    if is_sharded(first) and first.device_mesh.size() >= 2:
        return Ranks(first.device_mesh.get_group(), first.device_mesh, first.device)
    if (isinstance(model, nn.parallel.DistributedDataParallel) and dist.is_initialized()
            and dist.get_world_size(model.process_group) > 1):
        device = first.device if first is not None else None
        return Ranks(model.process_group, None, device)
    return None


def ranks_of_group(group=None) -> Ranks:
    """The ranks of a process group the caller names (``None``: the world), e.g.
    ``kfac_factors(all_reduce=True, group=...)``.

    Raises:
        GradHooksError: if no ``torch.distributed`` process group is initialised.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise GradHooksError(
            "all_reduce=True needs an initialised torch.distributed process group "
            "(torch.distributed.init_process_group) on every rank"
        )
    return Ranks(group)
