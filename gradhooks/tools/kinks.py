"""Where two forwards of the same model take different sides of a kink (a non-differentiable point).

A per-sample gradient is defined by the forward it differentiates. At a kink (ReLU at 0, ties in a
max-pool window, ``max`` with indices, comparisons) the gradient is one subgradient chosen by the
forward's *decision*: which side of 0, which element of the window. A batched forward and a
forward of one sample compute the same numbers in a different order (another kernel, another
blocking, another SIMD width), so their roundings differ; when a value sits on or next to a kink,
the two forwards can decide differently, and their gradients are then different subgradients,
both correct. This module finds the first such decision.

Index conventions: ``B`` the batch size, ``n`` a sample; a decision tensor holds the decision
per element of the op's output (``(B, ...)`` for the batched forward, ``(1, ...)`` for sample
``n``'s own forward), its batch dimension found by shape (the one that is ``B`` in the batched
record and ``1`` in the looped one, all other dimensions equal).

How: a :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every aten op below
autograd, functional ones included (``F.relu``, ``F.max_pool2d`` are not modules), and records
the decision of each kink op in execution order, with the module it ran in and the module that
finished last before it (from forward pre-/post-hooks). The idea of recording a forward's
decisions to explain subgradient differences follows the "tie-breaking" discussions of
non-smooth autodiff (Kakade & Lee 2018, "Provably correct automatic subdifferentiation"; Bolte &
Pauwels 2020, "A mathematical model for automatic differentiation in machine learning").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..base.torch_internals import EMBEDDING_BAG_OPS

__all__ = ["KinkRecord", "KinkDifference", "KinkRecorder", "first_kink_difference"]

aten = torch.ops.aten


def _region(x: Tensor, lo: Any, hi: Any) -> Tensor:
    """0 below ``lo``, 1 strictly inside, 2 at or above ``hi`` (``None`` bounds are open);
    ``x <= lo`` counts as below (the gradient of a clamp is 0 there)."""
    region = torch.ones_like(x, dtype=torch.int8)
    if lo is not None:
        region = region - (x <= lo).to(torch.int8)
    if hi is not None:
        region = region + (x >= hi).to(torch.int8)
    return region


# op -> (what differs, decision from (args, kwargs) before the op runs / from its output after).
# ``before`` decisions read the input (in-place ops overwrite it); ``after`` ones the indices.
_Before = Callable[[tuple, dict], Tensor]
_After = Callable[[tuple, dict, Any], Optional[Tensor]]
_UNITS = ("unit takes the other side of the kink", "units take the other side of the kink")
_BEFORE: Dict[Any, Tuple[Tuple[str, str], _Before]] = {}
_AFTER: Dict[Any, Tuple[Tuple[str, str], _After]] = {}
for _op in (aten.relu, aten.relu_):
    _BEFORE[_op] = (_UNITS, lambda a, k: a[0] > 0)
for _op in (aten.leaky_relu, aten.leaky_relu_):
    _BEFORE[_op] = (_UNITS, lambda a, k: a[0] > 0)
for _op in (aten.threshold, aten.threshold_):
    _BEFORE[_op] = (_UNITS, lambda a, k: a[0] > a[1])
for _op in (aten.hardtanh, aten.hardtanh_):
    _BEFORE[_op] = (_UNITS, lambda a, k: _region(a[0], a[1] if len(a) > 1 else -1.0,
                                                a[2] if len(a) > 2 else 1.0))
for _op in (aten.clamp, aten.clamp_):
    _BEFORE[_op] = (_UNITS, lambda a, k: _region(a[0], a[1] if len(a) > 1 else k.get("min"),
                                                a[2] if len(a) > 2 else k.get("max")))
for _op in (aten.clamp_min, aten.clamp_min_):
    _BEFORE[_op] = (_UNITS, lambda a, k: _region(a[0], a[1], None))
for _op in (aten.clamp_max, aten.clamp_max_):
    _BEFORE[_op] = (_UNITS, lambda a, k: _region(a[0], None, a[1]))
_BEFORE[aten.abs] = (("sign flips", "signs flip"), lambda a, k: torch.sign(a[0]))
for _op in (aten.maximum, aten.minimum):
    _BEFORE[_op] = (("element picks the other operand", "elements pick the other operand"), lambda a, k: torch.sign(a[0] - a[1]))
for _op in (aten.gt, aten.lt, aten.ge, aten.le, aten.eq, aten.ne):
    _AFTER[_op] = (("comparison flips", "comparisons flip"), lambda a, k, out: out)
for _op in (aten.max_pool1d_with_indices, aten.max_pool2d_with_indices,
            aten.max_pool3d_with_indices, aten.adaptive_max_pool1d, aten.adaptive_max_pool2d,
            aten.adaptive_max_pool3d):
    _AFTER[_op] = (("window picks another maximum", "windows pick another maximum"), lambda a, k, out: out[1])
for _op in (aten.max, aten.min):  # only the .dim overloads return indices
    _AFTER[_op] = (("reduction picks another index", "reductions pick another index"),
                   lambda a, k, out: out[1] if isinstance(out, (tuple, list)) else None)
_AFTER[aten.topk] = (("top-k selection differs", "top-k selections differ"), lambda a, k, out: out[1])
for _op in EMBEDDING_BAG_OPS:  # mode 2 is "max"
    _AFTER[_op] = (("bag entry picks another maximum", "bag entries pick another maximum"),
                   lambda a, k, out: out[3] if (a[4] if len(a) > 4 else k.get("mode", 0)) == 2
                   else None)


@dataclass
class KinkRecord:
    """One kink op of a recorded forward.

    Attributes:
        op: the aten op's name, e.g. ``"max_pool2d_with_indices"``.
        module: qualified name of the innermost module running (``""``: the root).
        module_type: that module's class name.
        after: qualified name of the module whose forward finished last before the op (``None``
            if none did).
        what: what a difference of the decision means, singular and plural, e.g.
            ``("window picks another maximum", "windows pick another maximum")``.
        decision: the decision per output element (a bool mask, a region code or indices),
            shape ``(B, ...)`` for the batched forward and ``(1, ...)`` for one sample's.
    """

    op: str
    module: str
    module_type: str
    after: Optional[str]
    what: Tuple[str, str]
    decision: Tensor

    @property
    def key(self) -> Tuple[str, str, Optional[str]]:
        """Where the op ran: records of two forwards are matched by this key and occurrence."""
        return self.op, self.module, self.after

    def where(self) -> str:
        """``"max_pool2d_with_indices after 'conv2' in <root> (DigitsCNN)"``."""
        after = f" after {self.after!r}" if self.after is not None else ""
        inside = repr(self.module) if self.module else "<root>"
        return f"{self.op}{after} in {inside} ({self.module_type})"


class KinkRecorder(TorchDispatchMode):
    """Records the decision of every kink op run while it is active, in execution order.

    Use as ``with KinkRecorder(model) as rec: model(x)``, then read ``rec.records``
    (a list of :class:`KinkRecord`). Recording does not change any result; it costs one small
    tensor (bool/int8/int64, one entry per output element) per kink op. Module names come from
    forward pre-/post-hooks on ``model``'s submodules, removed on exit.

    Args:
        model: the module whose submodules name where each op ran.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.records: List[KinkRecord] = []
        self._stack: List[Tuple[str, str]] = []
        self._last: Optional[str] = None
        self._handles: List[Any] = []

    def __enter__(self) -> "KinkRecorder":
        def pre(name: str) -> Callable[..., None]:
            def hook(module: nn.Module, args: Any) -> None:
                self._stack.append((name, type(module).__name__))
            return hook

        def post(name: str) -> Callable[..., None]:
            def hook(module: nn.Module, args: Any, out: Any) -> None:
                if self._stack and self._stack[-1][0] == name:
                    self._stack.pop()
                self._last = name
            return hook

        for name, m in self.model.named_modules():
            self._handles.append(m.register_forward_pre_hook(pre(name)))
            self._handles.append(m.register_forward_hook(post(name), always_call=True))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105 (torch API)
        kwargs = kwargs or {}
        packet = func.overloadpacket
        entry, decision = _BEFORE.get(packet), None
        if entry is not None:
            decision = entry[1](args, kwargs)
        out = func(*args, **kwargs)
        if entry is None and packet in _AFTER:
            entry = _AFTER[packet]
            decision = entry[1](args, kwargs, out)
        if decision is not None:
            module, module_type = self._stack[-1] if self._stack else ("", type(self.model).__name__)
            self.records.append(KinkRecord(packet.__name__, module, module_type, self._last,
                                           entry[0], decision.detach().clone()))
        return out


@dataclass
class KinkDifference:
    """The first kink op at which the batched forward and the per-sample forwards decide
    differently (see :func:`first_kink_difference`).

    Attributes:
        record: the batched forward's record of that op (its ``where()`` names it).
        samples: how many samples decide differently there.
        elements: how many decisions (units, windows, ...) differ, over all samples.
    """

    record: KinkRecord
    samples: int
    elements: int

    def __str__(self) -> str:
        s = "s" if self.samples != 1 else ""
        what = self.record.what[self.elements != 1]
        return f"{self.record.where()}: {self.samples} sample{s}, {self.elements} {what}"


def _batch_dim(batched: Tensor, single: Tensor, b: int) -> Optional[int]:
    """The dim that is ``b`` in ``batched`` and 1 in ``single``, all others equal; else None."""
    if batched.dim() != single.dim():
        return None
    for d in range(batched.dim()):
        if (batched.shape[d] == b and single.shape[d] == 1
                and batched.shape[:d] == single.shape[:d]
                and batched.shape[d + 1:] == single.shape[d + 1:]):
            return d
    return None


def _by_key(records: Sequence[KinkRecord]) -> Dict[Tuple[Any, int], KinkRecord]:
    seen: Dict[Any, int] = {}
    out = {}
    for r in records:
        i = seen.get(r.key, 0)
        seen[r.key] = i + 1
        out[(r.key, i)] = r
    return out


def first_kink_difference(
    model: nn.Module,
    inputs: Sequence[Tensor],
    reference_model: Optional[nn.Module] = None,
    reference_inputs: Optional[Sequence[Tensor]] = None,
) -> Optional[KinkDifference]:
    """Run ``model(*inputs)`` once on the batch and ``reference_model`` once per sample, and
    return the first kink op (in the batched forward's order) whose decisions differ.

    Both forwards run with autograd as in training (no backward), so they take the same code
    paths as a gradient computation. Row ``n`` of each batched decision is compared with sample
    ``n``'s; ops that are not batched (no dimension is ``B`` in the batched record and 1 in the
    sample's) and ops that only one of the forwards ran are not compared.

    Args:
        model: the model of the batched forward.
        inputs: tensors batched on dim 0, size ``B``.
        reference_model: the model of the per-sample forwards (e.g. a float64 copy of
            ``model``); default ``model``.
        reference_inputs: ``inputs`` as ``reference_model`` takes them (e.g. in float64);
            default ``inputs``.

    Returns:
        A :class:`KinkDifference`, or ``None`` if every compared decision agrees.

    Raises:
        ValueError: if ``inputs`` disagree on the batch size.
    """
    reference_model = model if reference_model is None else reference_model
    reference_inputs = inputs if reference_inputs is None else reference_inputs
    b = inputs[0].shape[0]
    if any(t.shape[0] != b for t in [*inputs, *reference_inputs]):
        raise ValueError("inputs disagree on the batch size (dim 0)")
    with KinkRecorder(model) as rec:
        model(*inputs)
    batched = rec.records
    singles = []
    for n in range(b):
        with KinkRecorder(reference_model) as rec:
            reference_model(*(t[n:n + 1] for t in reference_inputs))
        singles.append(_by_key(rec.records))
    for key, record in _by_key(batched).items():
        samples = elements = 0
        for n, single in enumerate(singles):
            other = single.get(key)
            d = None if other is None else _batch_dim(record.decision, other.decision, b)
            if d is None:
                continue
            differ = int((record.decision.narrow(d, n, 1) != other.decision).sum())
            samples += differ > 0
            elements += differ
        if samples:
            return KinkDifference(record, samples, elements)
    return None
