"""Samples recomputed alone: the check of a forward alone, and the pieces the sample spot check
(:mod:`gradhooks.readers.spotcheck`) shares with it.

A forward keeps the samples of a batch apart exactly when each sample's rows of the batched
output are what the model computes on that sample alone: any op that lets a sample's output
depend on another sample (a pairing ``einsum``, a scatter into shared rows, a statistic of the
batch) makes them differ, whatever the op. So where provenance found an op that no rule proves
keeps the samples apart (:mod:`gradhooks.core.analysis.separation`), the placement runs
:func:`forward_alone` once on the first forward of that input signature: the model on samples
:func:`checked_rows` alone (``0``, ``B // 2`` and ``B - 1``: their inputs sliced from what the
model's forward received; the middle one since an op on rows ``1`` to ``B - 2`` alone, found by
a probe, spared the ends), whose
outputs must reproduce those rows of the batched output to rounding, and then the batch with
its rows reordered so that each sample moves (:func:`reordered`), whose output must be the
batched output reordered alike: a mixing of rows none of the three is (``h[2]`` and ``h[5]``
of eight paired inside a custom ``autograd.Function``, found by a probe) changes it, since a
sample's result then depends on the row it sits in (both to
:data:`FORWARD_RTOL` of the output's dtype, or of the least precise floating dtype an op of
the check's runs returned where that is coarser: a float32 router inside a float64 model rounds
as float32; relative to the largest entry of each output). The check runs under
``torch.no_grad()`` with the hooks paused. A model in training mode is checked in training mode,
against the batched output as it ran, where that forward is deterministic (sample 0 run twice
with two seeds agrees) and no module keeps running statistics (a batch norm, which a forward in
training mode would update). A forward in training mode that draws random numbers (dropout)
or keeps running statistics, and one random in eval mode, is checked as it ran too, by copies
(:func:`_copies_as_ran`): torch's random generators put back to their states at the forward's
start (:func:`~gradhooks.base.utils.rng_states`, saved by the placement), the batch rerun must
reproduce its output (the same dropout masks), and the batch with every row sample ``n``'s
inputs must reproduce sample ``n``'s rows (its masks are the batch's, row for row, while a
statistic of the batch or a pairing of rows changes them); buffers the reruns update (running
statistics) are put back. So a branch taken only in training mode is judged. Without those
states (a caller of :func:`forward_alone` that has none) every module is put in ``eval()``
(restored after) and the batch rerun in eval mode, the samples alone against it. A forward
whose rerun does not reproduce it (random numbers from Python's or NumPy's generators) cannot
be checked, nor can one whose inputs or outputs carry no batch dim gradhooks can find: then the
check says why, and the op stays refused. The check runs the model: each module's attributes
(and the lists and dicts among them) are put back after it, so that what the forward keeps for
the loss there (an auxiliary loss, features) is the batch's; a run whose tensors stay alive
elsewhere (a forward hook's list, a global cache) is refused (:data:`KEPT`), since the loss may
read them without their gradient. Cost, once per input signature with such an op, or a
forward of a new structure: three or four forwards of one sample and one batched forward
without gradient where the forward is deterministic; where it is checked as it ran, a batched
forward without gradient for the batch and one per checked sample, one more from other random
states, and the reordered batch only where that one reproduces it (dropout masks are drawn per
row, so a random forward's reordered batch is not run).
"""
from __future__ import annotations

import weakref
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ...base.utils import paused, same_tensor, set_rng_states, state_kept

__all__ = ["forward_alone", "reordered", "sample_rows", "largest_difference", "FORWARD_RTOL", "NO_CHECK", "KEPT"]

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


def _slice(x, n, size: int, layout: int, hit: list, fill: bool = False):
    # x with every tensor's batch dim (dim 0, or dim 1 of one of 2 dims or more with
    # layout 1) of size ``size`` narrowed to sample n (``fill``: sample n copied to all ``size``
    # rows; n a (size,) index tensor: the rows reordered, row j the old row n[j]); others
    # unchanged.
    if isinstance(x, Tensor):
        d = 0 if layout == 0 or x.dim() < 2 else 1
        if x.dim() > d and x.shape[d] == size:
            hit.append(True)
            if isinstance(n, Tensor):
                return x.index_select(d, n.to(x.device))
            row = x.narrow(d, n, 1)
            return row.expand(x.shape).contiguous() if fill else row
        return x
    if isinstance(x, dict):
        return type(x)({k: _slice(v, n, size, layout, hit, fill) for k, v in x.items()})
    if type(x) in (list, tuple):
        return type(x)(_slice(v, n, size, layout, hit, fill) for v in x)
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
    return len(again) == len(first) and all(map(same_tensor, again, first))


def forward_alone(model: nn.Module, args: tuple, kwargs: dict, output, size: int, layout: int,
                  dim_of: Callable[[Tensor], object],
                  rng: Optional[tuple] = None) -> Tuple[bool, str]:
    """Whether samples ``0`` and ``size - 1`` run alone reproduce their rows of ``output``
    (module docstring).

    Args:
        model: the model; ``args`` / ``kwargs`` what its forward received, ``output`` what it
            returned (tensors with the batch on a dim: ``(B, ...)`` or ``(..., B, ...)``).
        size: ``B``.
        layout: ``0`` (``batch_first``) or ``1`` (``batch_first=False``: dim 1 of inputs of 2
            dims or more); where ``dim_of`` finds no batch dim of an output, the same.
        dim_of: an output tensor's batch dim as provenance followed it (an int, else unknown).
        rng: the states of torch's random generators at the start of the forward that returned
            ``output`` (:func:`~gradhooks.base.utils.rng_states`), if known: a forward that
            draws random numbers or keeps running statistics is then checked as it ran, by
            batches of one sample's copies (:func:`_copies_as_ran`).

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
    made = _Made({id(t) for t in (*_tensors(args), *_tensors(kwargs), *_tensors(output),
                                  *model.parameters(), *model.buffers(),
                                  *(t for m, _ in modes for t in _tensors(list(vars(m).values()))))})
    with state_kept(model):  # (modes, tensors kept for the loss: aux losses, caches; buffers)
        with made:
            passed, why = _checked(model, args, kwargs, output, outs, size, layout, rng, modes,
                                   made.dtypes)
    if any(r() is not None for r in made.refs):
        return False, KEPT
    return passed, why


class _Made(TorchFunctionMode):
    """Weak references to the tensors torch's ops return while it is active, less those in
    ``known`` (ids of tensors that existed before: an in-place op returns its input); and the
    floating dtypes of those results (:attr:`dtypes`)."""

    def __init__(self, known: set):
        super().__init__()
        self.known, self.refs, self.dtypes = known, [], set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        given = {id(t) for t in _tensors(list(args)) + _tensors(kwargs)}  # (x.to(), in place)
        for t in _tensors(out):
            if t.is_floating_point():
                self.dtypes.add(t.dtype)
            if id(t) not in self.known and id(t) not in given:
                self.refs.append(weakref.ref(t))
        return out


#: Why :func:`forward_alone` refuses a forward that kept its runs' tensors outside its modules.
KEPT = ("the model's forward kept tensors of gradhooks' own runs of it (the check of the "
        "forward alone) outside its modules, in a forward hook's list or a cache, where the "
        "loss may read them instead of the batch's, without their gradient (tensors kept on a "
        "module are put back after the check). A hook can skip gradhooks' runs: "
        "`if gradhooks.is_paused(): return`")


def _checked(model: nn.Module, args: tuple, kwargs: dict, output, outs: list, size: int,
             layout: int, rng: Optional[tuple], modes: list, seen: set) -> Tuple[bool, str]:
    # forward_alone's checks, without gradient and with gradhooks' hooks paused, the caller's
    # random streams left as they were (its next dropout masks too).
    training = model.training
    cuda = sorted({t.device.index or 0 for t in _tensors(output) if t.is_cuda})
    batch = (model, args, kwargs, _tensors(output), outs, size, layout, seen)
    try:
        with torch.no_grad(), paused(), torch.random.fork_rng(devices=cuda):
            as_ran = training and _deterministic(model, args, kwargs, size, layout)
            if training and not as_ran and rng is not None:
                return _copies_as_ran(*batch, rng)
            if not as_ran:
                model.eval()
            why = _alone(*batch, training, as_ran)
            if why == _RANDOM and rng is not None:  # (in eval mode: as it ran, then)
                for m, mode in modes:
                    m.training = mode
                return _copies_as_ran(*batch, rng)
            return not why, why
    except Exception as error:  # (a forward that cannot run on one sample)
        return False, (f"{NO_CHECK}: the model's forward on one sample raised "
                       f"{type(error).__name__}: {error}")


_RANDOM = f"{NO_CHECK}: the forward draws random numbers even in eval mode"


def _differs(batched: List[Tensor], again: List[Tensor], outs: list, n: Optional[int],
             whole: bool, seen: set) -> str:
    # The first output whose rows of sample n (all rows: n None) differ between the batch's
    # run and another (of the whole batch: ``whole``, else of sample n alone) beyond
    # FORWARD_RTOL of its dtype or of the coarsest floating dtype ``seen`` in the runs' ops,
    # as "output i (max difference, largest entry)"; "" if none.
    for i, d in outs:
        ours, one = batched[i], again[i]
        if n is not None:
            ours = ours.narrow(d, n, 1)
            if whole and one.dim() > d and one.shape[d] == batched[i].shape[d]:
                one = one.narrow(d, n, 1)
        if ours.shape != one.shape:
            return f"output {i} of shape {tuple(one.shape)}, not {tuple(ours.shape)}"
        diff, scale = largest_difference(ours, one)
        rtol = max(FORWARD_RTOL.get(dt, 1e-3) for dt in {ours.dtype, *seen})
        if not diff <= rtol * scale + 1e-30:
            return f"output {i} (max difference {diff:.3g}, largest entry {scale:.3g})"
    return ""


def checked_rows(size: int) -> List[int]:
    """The samples the check of the forward alone runs alone: ``0``, ``size // 2`` and
    ``size - 1``, each once (then the batch reordered: :func:`reordered`)."""
    return sorted({0, size // 2, size - 1})


def _alone(model: nn.Module, args: tuple, kwargs: dict, output: List[Tensor], outs: list,
           size: int, layout: int, seen: set, training: bool, as_ran: bool) -> str:
    # The checked samples run alone against their rows of the batch (output as it ran, or
    # the batch rerun in eval mode); "" where they agree, else why not.
    batched = _tensors(model(*args, **kwargs)) if training and not as_ran else output
    for n in checked_rows(size):
        hit: list = []
        a, k = _slice(args, n, size, layout, hit), _slice(kwargs, n, size, layout, hit)
        if not hit:
            return f"{NO_CHECK}: no input of the model's forward has the batch size on its batch dim"
        torch.default_generator.manual_seed(n)
        alone = _tensors(model(*a, **k))
        if n == 0 and not as_ran and not _same_again(model, a, k, alone, size):
            return _RANDOM
        if len(alone) != len(batched):
            return f"{NO_CHECK}: the model returns another structure for one sample"
        found = _differs(batched, alone, outs, n, False, seen)
        if found:
            return (f"sample {n} run alone does not reproduce its rows of the batched {found}: "
                    "the forward mixes the samples")
    return _moved(model, args, kwargs, batched, outs, size, layout, seen)


def _moved(model: nn.Module, args: tuple, kwargs: dict, batched: List[Tensor], outs: list,
           size: int, layout: int, seen: set) -> str:
    # Every row at once: the batch reordered so that each sample moves (reordered) must give
    # ``batched`` (its output) reordered alike; "" where it does (or B <= 3: every row was run
    # alone), else why not. For a forward that draws no random numbers.
    if size <= 3:
        return ""
    order = reordered(size)
    a, k = _slice(args, order, size, layout, []), _slice(kwargs, order, size, layout, [])
    moved = _tensors(model(*a, **k))
    if len(moved) != len(batched):
        return f"{NO_CHECK}: the model returns another structure for the batch reordered"
    want = list(batched)
    for i, d in outs:
        want[i] = batched[i].index_select(d, order.to(batched[i].device))
    found = _differs(want, moved, outs, None, True, seen)
    if found:
        return (f"the batch with its rows reordered (each sample moved to another row) does "
                f"not give the batched {found} reordered alike: a sample's result depends on "
                f"the row it sits in or on other rows, so the forward mixes the samples")
    return ""


def reordered(size: int) -> Tensor:
    """``(size,)`` int64: a fixed reordering of ``size`` rows that moves every row (one cycle
    through all of them, in a random order drawn from a generator seeded by ``size``), for
    the check of the forward alone: the batch reordered so must give its output reordered
    alike, which a forward that mixes any rows, including ones no sample run alone covers,
    does not."""
    cycle = torch.randperm(size, generator=torch.Generator().manual_seed(size))
    order = torch.empty(size, dtype=torch.int64)
    order[cycle] = cycle.roll(-1)
    return order


def _copies_as_ran(model: nn.Module, args: tuple, kwargs: dict, output: List[Tensor],
                   outs: list, size: int, layout: int, seen: set, rng: tuple
                   ) -> Tuple[bool, str]:
    # The forward as it ran (its modes, torch's random generators put back to their states at
    # its start): rerun on the batch it must reproduce ``output`` (else its random numbers come
    # from elsewhere: no check), and on sample n's inputs copied to every row (checked_rows)
    # it must reproduce sample n's rows: its dropout masks are the batch's, row for row, and a
    # statistic of the batch (a batch norm in training mode) or a pairing of rows changes them.
    # (The buffers a rerun updates, running statistics, are put back after: state_kept.)
    for n in (None, *checked_rows(size)):
        hit: list = [True]
        a, k = ((args, kwargs) if n is None else
                (_slice(args, n, size, layout, hit, True), _slice(kwargs, n, size, layout, hit, True)))
        if len(hit) == 1 and n is not None:
            return False, (f"{NO_CHECK}: no input of the model's forward has the batch size "
                           "on its batch dim")
        set_rng_states(rng)
        again = _tensors(model(*a, **k))
        found = ("another structure" if len(again) != len(output) else
                 _differs(output, again, outs, n, True, seen))
        if found and n is None:
            return False, (f"{NO_CHECK}: the forward rerun with torch's random generators "
                           f"put back as they were at its start does not reproduce its "
                           f"{found} (random numbers from another source?)")
        if found:
            return False, (f"sample {n}'s inputs copied to every row of the batch, the "
                           f"forward rerun as it ran, do not reproduce its rows of the "
                           f"{found}: the forward mixes the samples")
    # (where the batch rerun from other random states reproduces it too, the forward draws no
    # random numbers after all -- it was checked as it ran because it cannot run on one
    # sample -- and the batch reordered is checked; with dropout each row's mask stays with
    # its row, so it is not)
    torch.default_generator.manual_seed(size + 1)
    again = _tensors(model(*args, **kwargs))
    if len(again) == len(output) and not _differs(output, again, outs, None, True, seen):
        why = _moved(model, args, kwargs, output, outs, size, layout, seen)
        if why:
            return False, why
    return True, ""
