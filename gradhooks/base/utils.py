"""Small utilities shared by the recorder, the rules and the readers: the pause switch, the
autocast guard, pytree walkers for call arguments and outputs, the computation dtype, and the
one definition of ``loss_reduction`` and its own-loss scale.
"""
from __future__ import annotations

import collections
import contextlib
import copy
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

from . import torch_internals

__all__ = ["paused", "is_paused", "no_autocast", "tf32_allowed", "tf32_products", "is_functorch_wrapped", "tensors", "detached",
           "flatten", "compute_dtype", "LOW_PRECISION", "LOSS_REDUCTIONS", "check_loss_reduction",
           "own_loss_scale", "OWNED", "rng_states", "set_rng_states", "state_kept", "same_tensor"]

#: The values ``loss_reduction`` may take.
LOSS_REDUCTIONS = ("mean", "sum")

#: Dtypes below float32 (autocast records them); rules and readers compute in float32 then.
LOW_PRECISION = (torch.bfloat16, torch.float16)

# > 0 while hooks must record nothing (the looped reference and the fallback's replay run the
# model or a module again).
PAUSED = 0


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Context in which no :class:`~gradhooks.GradHooks` records anything (used by the looped
    reference and by the fallback rule's replay of a module)."""
    global PAUSED
    PAUSED += 1
    try:
        yield
    finally:
        PAUSED -= 1


@contextlib.contextmanager
def state_kept(module: torch.nn.Module) -> Iterator[None]:
    """Run ``module`` (the model, or one module) without side effects: when it ends, the
    attributes of it and its submodules are as before (``self.last = x``, an auxiliary loss
    kept for the loss; a vmapped tensor must not outlive the transform), and so are the lists
    and dicts among them, by their contents (a cache; the registered parameters, buffers,
    submodules), and the buffers' values (a running statistic updated in place, also inside a
    kernel that does not bump its version): a changed buffer is set back through ``.data``,
    so that the version an autograd graph saved of it stays valid.

    Cost: a shallow copy of each submodule's ``__dict__`` and of its lists and dicts, a copy
    of each buffer and a comparison with it."""
    saved = []
    for m in module.modules():
        attrs = dict(vars(m))
        saved.append((m, attrs, {k: copy.copy(v) for k, v in attrs.items() if type(v) in _HELD},
                      [(b, b.detach().clone()) for b in torch_internals.own_buffers(m).values()
                       if b is not None]))
    try:
        yield
    finally:
        for m, attrs, contents, values in saved:
            now = vars(m)
            for k in [k for k in now if k not in attrs]:
                del now[k]
            for k, v in attrs.items():
                if now.get(k, attrs) is not v:
                    now[k] = v
            for k, old in contents.items():
                if _changed(attrs[k], old):
                    attrs[k].clear()
                    attrs[k].extend(old) if type(old) is list else attrs[k].update(old)
            with torch.no_grad():
                for b, value in values:
                    if not same_tensor(b, value):
                        b.data.copy_(value)


#: The containers state_kept restores by their contents (OrderedDict: a module's hooks).
_HELD = (list, dict, collections.OrderedDict)


def _changed(now, old) -> bool:
    # Whether a list or dict holds other objects than its copy ``old`` (by identity: tensors).
    if len(now) != len(old):
        return True
    if isinstance(old, dict):
        return any(old.get(k, old) is not v for k, v in now.items())
    return any(a is not b for a, b in zip(now, old))


def same_tensor(x: Tensor, y: Tensor) -> bool:
    """Whether ``x`` and ``y`` have the same shape, dtype and values (NaN equal to NaN)."""
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if x.is_floating_point() or x.is_complex():
        return bool(torch.allclose(x, y, rtol=0, atol=0, equal_nan=True))
    return bool(torch.equal(x, y))


def rng_states(inputs: List[Tensor]) -> tuple:
    """The states of torch's random number generators a forward on ``inputs`` draws from: the
    CPU's default generator and the default generator of each CUDA device an input is on
    (about 1 µs), for :func:`set_rng_states` (a forward rerun as it ran draws the same numbers)."""
    cuda = {t.device.index for t in inputs if t.is_cuda}
    return (torch.default_generator.get_state(),
            {i: torch.cuda.get_rng_state(i) for i in cuda} if cuda else {})


def set_rng_states(states: tuple) -> None:
    """Put torch's random number generators back to ``states`` (:func:`rng_states`)."""
    cpu, cuda = states
    torch.default_generator.set_state(cpu)
    for i, state in cuda.items():
        torch.cuda.set_rng_state(state, i)


def is_paused() -> bool:
    """Whether gradhooks is running the model itself now (the check of the forward alone, the
    looped reference, a replay: a :func:`paused` context): a forward hook of the user's that
    keeps tensors outside the model's modules (a list of features) can skip those runs,
    ``if gradhooks.is_paused(): return``, or the check refuses the batch
    (:data:`~gradhooks.core.analysis.alone.KEPT`). Public as ``gradhooks.is_paused``."""
    return PAUSED > 0


#: Inputs wrapped by torch.func transforms (vmap, grad) are not recorded.
is_functorch_wrapped = torch_internals.is_functorch_wrapped

_AUTOCAST_DEVICES = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


@contextlib.contextmanager
def no_autocast() -> Iterator[None]:
    """Context with autocast off on every device where it is on: rules and readers compute in the
    recorded dtypes (promoted to float32), whatever autocast the caller runs under. Entering
    ``torch.autocast`` costs about 10 µs, so only where autocast is on."""
    on = [d for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d)]
    if not on:
        yield
        return
    with contextlib.ExitStack() as stack:
        for d in on:
            stack.enter_context(torch.autocast(d, enabled=False))
        yield


def tf32_allowed() -> bool:
    """Whether float32 work on CUDA may run in TF32: cuDNN's convolutions and RNNs
    (``torch.backends.cudnn.allow_tf32``, on by default) or cuBLAS' matrix products
    (``torch.backends.cuda.matmul.allow_tf32``, ``torch.set_float32_matmul_precision``)."""
    b = torch.backends
    return bool(b.cudnn.allow_tf32 or b.cuda.matmul.allow_tf32
                or torch.get_float32_matmul_precision() != "highest")


@contextlib.contextmanager
def tf32_products(low: Optional[torch.dtype]) -> Iterator[None]:
    """Context in which float32 matrix products and convolutions on CUDA may use TF32, for a
    read of records formed in ``low`` = bfloat16 / float16 (an autocast forward's
    grad_outputs, promoted to float32 by the rules); a no-op for ``None`` and without CUDA.

    Why it loses nothing the records have: TF32 keeps 11 significant bits, as many as float16
    and more than bfloat16 (8), so the records' own values enter the tensor cores exactly, and
    TF32 products accumulate in float32; products of float32 intermediates are rounded at
    ``2**-11``, below the records' own rounding (bfloat16: ``2**-8``). On an H200 such a read's
    float32 products run at the tensor cores' TF32 rate instead of float32's (about 7x). The
    caller's flags (``torch.backends.cuda.matmul.allow_tf32``, ``torch.backends.cudnn.allow_tf32``)
    are restored on exit."""
    if low not in (torch.bfloat16, torch.float16) or not torch.cuda.is_available():
        yield
        return
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """The dtype per-sample quantities are accumulated in: the promoted dtype of ``tensors``, at
    least ``float32`` (an autocast forward records bfloat16/float16 grad_outputs)."""
    dt = tensors[0].dtype
    for t in tensors[1:]:
        dt = torch.promote_types(dt, t.dtype)
    return torch.promote_types(dt, torch.float32)


def check_loss_reduction(loss_reduction: str) -> None:
    """Raise ``ValueError`` unless ``loss_reduction`` is ``"mean"`` or ``"sum"``."""
    if loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(
            f"loss_reduction must be 'mean' or 'sum' (how the batch loss was reduced over "
            f"samples), got {loss_reduction!r}"
        )


def own_loss_scale(loss_reduction: str, batch_size: int) -> Optional[float]:
    """Factor that turns gradients of the reduced batch loss into per-sample-loss gradients.

    The one place this is computed (the recorder puts it in every batch snapshot). With
    ``loss_reduction="mean"`` the batch loss is ``(1/B) sum_n l_n``, so what the hooks see for
    sample ``n`` is ``(1/B) dl_n``; multiplying by ``B`` gives ``dl_n``, the gradient of the
    sample's own loss, independent of the batch size (Opacus' convention). With ``"sum"`` no
    scaling is needed and ``None`` is returned.

    Raises:
        ValueError: if ``loss_reduction`` is not ``"mean"`` or ``"sum"``.
    """
    check_loss_reduction(loss_reduction)
    return float(batch_size) if loss_reduction == "mean" else None


# ---------------------------------------------------------------------------- pytree walkers
# The forward hook walks call arguments and outputs on every call. torch's Python pytree costs
# about 15 µs per walk of an LSTM's (out, (h, c)); plain tuples, lists and dicts (exact types)
# with tensors and scalars in them are walked here instead, anything else by the pytree.
_PLAIN_LEAVES = (type(None), int, float, bool, str, torch.dtype, torch.device)


def tensors(obj) -> List[Tensor]:
    """The tensors in ``obj`` (pytree order)."""
    found: List[Tensor] = []
    _collect(obj, found)
    return found


def _collect(obj, found: List[Tensor]) -> None:
    # Named tuples (Call, PackedSequence) and dict subclasses flatten like their bases.
    if isinstance(obj, Tensor):
        found.append(obj)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            _collect(o, found)
    elif isinstance(obj, dict):
        for o in obj.values():
            _collect(o, found)
    elif type(obj) not in _PLAIN_LEAVES:
        found.extend(x for x in tree_flatten(obj)[0] if isinstance(x, Tensor))


def detached(obj):
    """``obj`` with every tensor detached (same structure)."""
    t = type(obj)
    if t is tuple:
        return tuple([detached(o) for o in obj])
    if t is list:
        return [detached(o) for o in obj]
    if t is dict:
        return {k: detached(v) for k, v in obj.items()}
    if isinstance(obj, Tensor):
        return obj.detach()
    if t in _PLAIN_LEAVES:
        return obj
    return tree_map(lambda x: x.detach() if isinstance(x, Tensor) else x, obj)


class _Opaque(Exception):
    pass


_SPECS: Dict[tuple, object] = {}  # structure key (_key) -> its pytree TreeSpec


def _key(obj, leaves: list):
    # Appends the leaves of plain tuples / lists / dicts to ``leaves`` (pytree order) and
    # returns a hashable key of the structure; raises _Opaque for any other container.
    t = type(obj)
    if t is tuple or t is list:
        return (t, *[_key(o, leaves) for o in obj])
    if t is dict:
        return (dict, tuple(obj), *[_key(o, leaves) for o in obj.values()])
    if not isinstance(obj, Tensor) and t not in _PLAIN_LEAVES:
        raise _Opaque
    leaves.append(obj)
    return None


def flatten(obj) -> Tuple[list, object]:
    """``tree_flatten(obj)``, with the spec of a structure of plain containers built once."""
    leaves: list = []
    try:
        key = _key(obj, leaves)
    except _Opaque:
        return tree_flatten(obj)
    spec = _SPECS.get(key)
    if spec is None:
        if len(_SPECS) > 1024:  # structures vary without bound (e.g. dict keys): stop caching
            _SPECS.clear()
        spec = _SPECS[key] = tree_flatten(obj)[1]
    return leaves, spec



#: Attribute set (``True``) on a per-sample cotangent gradhooks formed itself and handed to one
#: record only (a linear or grouped meeting's ``(B, *param.shape)``: gradhooks.core.analysis.rows): a read
#: that releases the record may scale it in place instead of copying it.
OWNED = "_gradhooks_owned"
