"""What the recorder records and what readers see: hooked layers, per-call records, and the
read-only :class:`Batch` snapshot of one batch.

:class:`Layer`: a hooked module with its rule and parameters (:func:`find_layers` chooses them).
:class:`Record`: one call of a hooked module: its input activations ``a`` and the grad_outputs
it received. :class:`Batch`: what a reader gets from
:meth:`gradhooks.core.recorder.capture.Recorder.snapshot`.
"""
from __future__ import annotations

import warnings
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_unflatten

from ... import rules as _rules  # noqa: F401  (registers the built-in rules)
from ...base.errors import (
    FallbackWarning,
    GradHooksError,
    GradientMismatchError,
    UnsupportedModuleError,
)
from ...base.forms import NO_GRAD
from ...base.registry import LayerRule, find_rule, supported_types
from ...base.sample_groups import SampleGroups
from ...base.torch_internals import own_parameters, version
from ...base.utils import own_loss_scale, tensors
from ...rules.fallback import FALLBACK, note_path
from ..analysis import as_batch

__all__ = ["Layer", "Record", "Batch", "find_layers", "plain_state", "shared_lookup", "expand_call",
           "FORWARDS"]

#: Values of ``forwards``: how the top-level forwards before one backward map to rows.
FORWARDS = ("one", "same_samples")


def shared_lookup(x, output, batch_first: bool) -> bool:
    """Whether a call on one row, in a forward whose batch has more (the caller checks that), is
    a lookup of indices shared by the batch (position ids ``(1, T)`` broadcast over it, as
    transformers' models make them): an integer tensor input with the row on the batch dim, and
    one output tensor. Such a call's output is handed downstream expanded to the batch
    (:func:`expand_call`), so that the gradient each sample sends back is recorded before the
    broadcast sums it. A float input of one row is not: it may be part of the batch (a step of
    a shrinking ``PackedSequence``), and stays refused."""
    return (isinstance(output, Tensor) and isinstance(x, Tensor) and x.dim() >= 1
            and output.dim() >= 1 and not x.is_floating_point() and (batch_first or x.dim() < 3))


def expand_call(b: int, x: Tensor, output: Tensor, args: tuple, kwargs: dict, how: str = "expand"):
    """``(x, output, args, kwargs)`` of a shared call (a :func:`shared_lookup` one, or one that
    provenance found handed straight to a broadcast with the batch) with its input ``x`` (the
    first argument) and its output made ``b`` identical samples in the layout ``how``
    (:func:`gradhooks.core.analysis.provenance.as_batch`; views)."""
    x_b = as_batch(x, b, how)
    if args:
        args = (x_b, *args[1:])
    else:
        kwargs = {k: (x_b if i == 0 else v) for i, (k, v) in enumerate(kwargs.items())}
    return x_b, as_batch(output, b, how), args, kwargs


def plain_state(p: nn.Parameter) -> dict:
    """A hooked parameter's pickled state (``Parameter.__reduce_ex__`` reads ``__getstate__``,
    found on the instance first): its ``__dict__`` without gradhooks' attributes, so that
    ``pickle`` / ``torch.save`` of an attached model write a plain model."""
    return {k: v for k, v in p.__dict__.items() if k not in ("grad_sample", "__getstate__")}


class Layer:
    """A hooked module: its path in the model, its rule and the parameters the rule handles."""

    __slots__ = ("path", "module", "rule", "params", "items", "all_names", "validates", "watched",
                 "demoted")

    def __init__(self, path: str, module: nn.Module, rule: LayerRule, params: Dict[str, nn.Parameter]):
        self.path, self.module, self.rule, self.params = path, module, rule, params
        # Precomputed for the forward hook, which runs on every call of every hooked layer.
        self.items = tuple(params.items())
        self.all_names = tuple(params)
        self.validates = type(rule).check_call is not LayerRule.check_call
        self.watched = False  # every parameter has its sum-check gradient hook
        self.demoted = None  # the forward whose parent's replay covers its calls (Attachment.demote)

    def trainable(self) -> Tuple[str, ...]:
        """Names of the parameters that currently require grad."""
        for _, p in self.items:
            if not p.requires_grad:
                return tuple(n for n, p in self.items if p.requires_grad)
        return self.all_names

    def describe(self) -> str:
        """``'path' (Type)`` for messages."""
        return f"{self.path or '<root>'!r} ({type(self.module).__name__})"


class Record:
    """One call of one hooked module: input activations and the grad_outputs it received.

    Single-output rules: ``a`` is the first input, ``grads`` one grad_output per backward pass.
    ``multi_io`` rules: ``a`` is a :class:`Call`, ``grads`` holds per output tensor (leaf of
    the output's pytree ``spec``) the grad_output summed over backward passes, or ``None``.
    """

    __slots__ = ("layer", "a", "versions", "names", "grads", "step", "spec", "low", "hits", "forward",
                 "shared", "task", "met", "rows", "swap", "__weakref__")

    def __init__(self, layer: "Layer", a, names: Tuple[str, ...], step: int, spec=None,
                 leaves: Optional[list] = None):
        self.layer, self.a, self.names, self.step, self.spec = layer, a, names, step, spec
        self.versions = [(a, version(a))] if isinstance(a, Tensor) else [(t, version(t)) for t in tensors(a)]
        self.grads: list = leaves if spec is not None else []
        self.low: Optional[torch.dtype] = None  # grad_output dtype when below float32 (autocast)
        self.hits = 0  # grad_output hook calls (backward passes x output tensors reached)
        self.forward = 0  # the model's top-level forward (a count) this call belongs to
        # A shared call (gradhooks.core.analysis.provenance): how its input was made a batch ("expand" /
        # "prepend"; "rows": its own B rows, met by the batch row by row), else None; and the
        # backward pass its last grad_output came from.
        self.shared: Optional[str] = None
        self.task: Optional[int] = None
        self.met = False  # whether its output met the batch yet (in the forward)
        self.rows = None  # a "rows" call's layout before it became one (to go back to)
        # how the input and grad_output were laid out so that the rule reads the batch where
        # the model carries it (capture.relayout), or None
        self.swap: Optional[tuple] = None

    def check_unmodified(self, result: str) -> None:
        """Raise :class:`GradientMismatchError` if a recorded input was modified in place since
        the forward: what the read ``result`` (e.g. ``"per_sample_grads()"``) computes from it
        would be wrong."""
        for t, v in self.versions:
            if version(t) != v:
                raise GradientMismatchError(
                    f"the input of module {self.layer.describe()} was modified in place after its "
                    f"forward; what {result} computes from it would be wrong. Avoid in-place ops on the layer's input "
                    f"(e.g. use ReLU(inplace=False) after the layer that feeds it)"
                )

    def grad_struct(self):
        """``multi_io`` rules: the output's structure with each tensor's grad_output (or
        ``None``), as :meth:`~gradhooks.base.registry.LayerRule.per_sample_grads` takes it."""
        return self.grad_tree(self.grads)

    def grad_tree(self, leaves: list):
        """``leaves`` (one per output leaf) in the output's structure, ``None`` as
        :data:`~gradhooks.base.forms.NO_GRAD` for a rule with ``positional_grads``."""
        if self.layer.rule.positional_grads:
            leaves = [NO_GRAD if t is None else t for t in leaves]
        return tree_unflatten(leaves, self.spec)

    def grads_arg(self):
        """The grad_outputs as the rule takes them: :meth:`grad_struct` for ``multi_io`` rules,
        else the list of one grad_output per backward pass."""
        return self.grad_tree(self.grads) if self.spec is not None else self.grads

    def summed_grad(self) -> Tensor:
        """Single-output rules: the grad_output summed over the backward passes."""
        return self.grads[0] if len(self.grads) == 1 else torch.stack(self.grads).sum(0)

    def release(self) -> None:
        """Drop the activations and grad_outputs (the read that released them is done), and
        the input gradients of a graph node a rule's
        :meth:`~gradhooks.base.registry.LayerRule.internal` asked for (an attention core's
        q, k, v gradients): the hook on that node holds their dict for as long as the graph
        lives (two-pass clipping's first pass retains it). The rule's other entries stay."""
        internal = getattr(self.a, "internal", None)
        if isinstance(internal, dict):
            internal.pop("grad_inputs", None)
        self.a = None
        self.versions = []
        self.grads = []



def find_layers(model: nn.Module, strict: bool, hooked: Callable[[nn.Module], bool],
                demoted: Iterable[str] = (), fallback: LayerRule = FALLBACK) -> List[Layer]:
    """The modules of ``model`` to hook, in ``named_modules()`` order, with their rules.

    A module with trainable parameters gets its rule (exact type, then parents:
    :func:`~gradhooks.base.registry.find_rule`), or the ``torch.func`` fallback for parameters no rule
    handles (one :class:`FallbackWarning` lists them); a rule may claim a submodule's parameters
    (``MultiheadAttention``'s ``out_proj``), which is then not hooked itself. The warning names
    leaf modules only: a container's own (raw) parameters (ViT's class token, a layer scale) are
    taken at their own ops where they meet the batch, and the container is replayed, with a
    :class:`FallbackWarning` then, only where that fails (:class:`~gradhooks.rules.fallback.FallbackRule`). A parameter that a
    module and one of its descendants both register (Opacus' ``DPLSTM`` / ``DPGRU`` / ``DPRNN``
    register their cells' weights again under the ``nn.LSTM`` names) is handled by the
    descendant, which computes with it; results keep the model's names
    (``named_parameters()``). Parameter-free modules whose rule must validate every call
    (``BatchNorm(affine=False)``) are included.

    Args:
        model: the model.
        strict: refuse modules without a dedicated rule instead of the fallback.
        hooked: whether a module is already hooked by another recorder.
        demoted: paths of modules whose parameters their parent reads functionally
            (``F.linear(x, self.qkv.weight)``, torchvision's Swin; found by provenance): not
            hooked themselves; the parent's ``torch.func`` replay covers their parameters.
        fallback: the fallback rule (:data:`~gradhooks.rules.fallback.UNVERIFIED_FALLBACK` for
            ``attach(..., unsafe_skip_replay_check=True)``).

    Raises:
        UnsupportedModuleError: with ``strict``, naming every module without a rule; or for a
            subclass of a supported type that overrides ``forward``.
        GradHooksError: if a module to hook is already hooked.
    """
    layers: List[Layer] = []
    unsupported, listed = [], []
    claimed: set = set()  # ids of submodules an ancestor's rule claims (MHA's out_proj)
    registered: Dict[int, List[str]] = {}  # id(param) -> paths of the modules that register it
    for path, module in model.named_modules():
        for p in own_parameters(module).values():
            if p is not None:
                registered.setdefault(id(p), []).append(path)

    def alias(path: str, p: nn.Parameter) -> bool:
        # ``p`` is registered again by a descendant of ``path`` (Opacus' DPLSTM registers its
        # cells' weights under its own names): the descendant computes with it and handles it.
        prefix = path + "." if path else ""
        return any(q != path and q.startswith(prefix) for q in registered[id(p)])

    demoted = set(demoted)
    for path, module in model.named_modules():
        own = {n: p for n, p in module.named_parameters(recurse=False) if not alias(path, p)}
        if path in demoted:
            continue
        children = [d for d in demoted if d.rpartition(".")[0] == path]
        if children:  # the parent that reads them: the replay covers its and their parameters
            handled = dict(own)
            for d in children:
                rel = d[len(path) + 1:] if path else d
                handled.update((f"{rel}.{n}", p) for n, p in
                               module.get_submodule(rel).named_parameters())
            claimed.update(id(module.get_submodule(n.rsplit(".", 1)[0]))
                           for n in handled if "." in n)
            note_path(module, path)
            layers.append(Layer(path, module, fallback, handled))
            continue
        if not own:
            rule = find_rule(module, path)
            if rule is not None and rule.check_always:  # BatchNorm(affine=False)
                layers.append(Layer(path, module, rule, {}))
            continue
        if id(module) in claimed:
            continue
        try:
            rule = find_rule(module, path)
        except UnsupportedModuleError:  # a subclass overriding forward
            if strict:
                raise
            rule = None
        handled = rule.params_of(module) if rule is not None else {}
        handled = {n: p for n, p in handled.items() if "." in n or n in own}
        extra = [n for n, p in own.items() if n not in handled and p.requires_grad]
        if extra:
            if strict:
                unsupported.append((path, module, extra))
                continue
            rule, handled = fallback, fallback.params_of(module)
            note_path(module, path)  # (for the messages of its replays)
            if next(module.children(), None) is None:
                listed.append(f"{path or '<root>'!r} ({type(module).__qualname__})")
            # (else its raw parameters are usually taken at their own ops, provenance: its
            # replay warns when it runs, FallbackRule)
        if handled:
            if hooked(module):
                raise GradHooksError(
                    f"module {path or '<root>'!r} ({type(module).__name__}) is already hooked "
                    f"by another GradHooks; call detach() on that one first"
                )
            claimed.update(id(module.get_submodule(n.rsplit(".", 1)[0]))
                           for n in handled if "." in n)
            layers.append(Layer(path, module, rule, handled))
    if unsupported:
        lines = "\n".join(
            f"  {p or '<root>'!r} ({type(m).__qualname__}): parameters {', '.join(e)}"
            for p, m, e in unsupported
        )
        raise UnsupportedModuleError(
            "gradhooks has no per-sample gradient rule for these modules, which own trainable "
            f"parameters:\n{lines}\nSupported types: {', '.join(supported_types())}. "
            "attach(model, strict=False) covers them with the torch.func fallback (exact if "
            "the module treats samples independently); or freeze those parameters "
            "(requires_grad_(False)), or register a rule with @gradhooks.register_rule."
        )
    if listed:
        warnings.warn(
            "gradhooks has no dedicated rule for these modules and uses its torch.func "
            f"fallback (vmap of the module's vjp per sample) for them: {', '.join(listed)}. "
            "It is exact only if each module treats the samples of a batch independently "
            "(see gradhooks.rules.fallback); attach(model, strict=True) refuses such modules.",
            FallbackWarning, stacklevel=6,
        )
    return layers


class Memo:
    """Decisions a recorder keeps between batches of one call structure, so that a batch of a
    known structure is not looked at again (the norm plan's templates,
    :func:`gradhooks.readers.plan.plan`). A reader asks :meth:`get`; it never writes into the memo
    otherwise. At most :attr:`LIMIT` keys are kept (structures may vary without bound: the memo
    then starts over); the recorder clears it when the model changes."""

    #: Keys kept before the memo starts over.
    LIMIT = 64

    def __init__(self):
        self._values: Dict[object, object] = {}

    def get(self, key, make: Callable[[], object]):
        """The value made for ``key`` (hashable), made by ``make()`` on a miss."""
        value = self._values.get(key)
        if value is None:
            if len(self._values) >= self.LIMIT:
                self._values.clear()
            value = self._values[key] = make()
        return value

    def clear(self) -> None:
        """Forget every key (the model changed)."""
        self._values.clear()

    def __len__(self) -> int:
        return len(self._values)


class Batch(NamedTuple):
    """A read-only snapshot of one batch, as :meth:`~gradhooks.core.recorder.capture.Recorder.snapshot` hands it
    to a reader: the reader's only view of the recorder. It is a named tuple (its fields cannot
    be set, and it is made in one step: a snapshot is taken per read, several per two-pass
    clip); what a reader asks of the recorder (release a record, keep a result, note a passed
    sum check) goes through :meth:`release`, :meth:`keep` and :meth:`check_passed`.

    Attributes:
        records: the :class:`Record` of every call a backward pass reached (or the subset asked
            for), in the order reached; ``()`` for a batch whose records an earlier read
            released (:attr:`released`: :attr:`result` answers the read). Each holds ``a`` (the
            input activations; a :class:`~gradhooks.base.forms.Call` for ``multi_io`` rules),
            ``grads`` (the grad_outputs: one per backward pass, or per output leaf for
            ``multi_io`` rules), ``names`` (the trainable parameters of the call), ``layer``
            (:class:`Layer`) and ``low`` (the grad_output dtype when below float32).
        size: ``B``.
        scale: what turns the records into the gradients of each sample's own loss, computed
            here, once: the own-loss scale (:func:`gradhooks.base.utils.own_loss_scale`: ``B`` for
            ``loss_reduction="mean"``, ``None`` for ``"sum"``) divided by :attr:`grad_scale`;
            ``None`` when that is 1 (no scaling).
        factor: :attr:`scale` as a number (``1.0`` for ``None``).
        divisor: ``D`` (``B`` or ``1.0``): the batch loss is ``(1/D) sum_n l_n``.
        grad_scale: ``S``, the ``GradScaler``'s scale the backward used (``1.0`` without one):
            the records are ``S`` times the gradients of the loss.
        loss_reduction, batch_first, differentiable: as given to :func:`gradhooks.attach`.
        check: the ``check`` given to :func:`gradhooks.attach`.
        model: the attached model (read only: readers that write ``param.grad`` find the
            process group or mesh of its parameters, :mod:`gradhooks.readers.distributed`).
        names: ``{id(param): name}`` of the model's parameters, in ``named_parameters()`` order.
        order: ``{id(param): position}`` in that order.
        params: ``{id(param): param}`` of the hooked parameters.
        layers: the hooked :class:`Layer` objects, in ``named_modules()`` order.
        totals: ``{id(param): GradTotal}``: autograd's gradients of this batch (sum check).
        checking: whether this read checks for parameters it has no records of
            (:func:`~gradhooks.readers.verify.check_unrecorded`): ``check`` is on and the backward
            computed parameter gradients.
        check_key: the structure whose sum check this read runs, or ``None`` (not due).
        batch_id: the recorder's number of this batch (:attr:`Recorder.batch_id`).
        result: the per-sample gradients ``{name: (B, *param.shape)}`` an earlier read kept
            (:meth:`keep`) for this batch, or ``None``.
        released: whether an earlier read released the records (:attr:`records` is then
            ``()`` and :attr:`result` holds what they gave).
        releasing: whether this reader releases each record once used (:meth:`release`).
        memo: the recorder's :class:`Memo` of per-structure decisions (read with ``get``).
        pool: the recorder's :class:`~gradhooks.base._pool.BufferPool` (buffers a read may reuse).
        asks: the recorder, for the three requests of :meth:`release`, :meth:`keep` and
            :meth:`check_passed` (readers call those, not it).
        groups: the batch's :class:`~gradhooks.base.sample_groups.SampleGroups` when
            ``sample_ids`` were declared (rows sharing an id are one sample: :attr:`scale` and
            :attr:`divisor` then count the ``G`` samples), else ``None``.
    """

    records: Tuple[Record, ...]
    size: int
    scale: Optional[float]
    factor: float
    divisor: float
    grad_scale: float
    loss_reduction: str
    batch_first: bool
    differentiable: bool
    check: object
    model: nn.Module
    names: Dict[int, str]
    order: Dict[int, int]
    params: Dict[int, nn.Parameter]
    layers: List[Layer]
    totals: Dict[int, object]
    checking: bool
    check_key: Optional[tuple]
    batch_id: int
    result: Optional[Dict[str, Tensor]]
    released: bool
    releasing: bool
    memo: Memo
    pool: object
    asks: object  # the recorder's release_record / keep_result / sum_check_passed
    groups: Optional[SampleGroups] = None

    @property
    def samples(self) -> int:
        """The number of samples: ``G`` with :attr:`groups`, else ``B`` (:attr:`size`)."""
        return self.size if self.groups is None else self.groups.count

    @classmethod
    def of(cls, recorder, records: Tuple[Record, ...], check_key: Optional[tuple],
           checking: bool, grad_scale: float = 1.0, releasing: bool = False,
           groups: Optional[SampleGroups] = None) -> "Batch":
        """The snapshot of ``recorder`` (the :class:`~gradhooks.core.recorder.capture.Recorder`: its
        public attributes) with ``records``; the scales are computed here, once (over the
        ``G`` samples of ``groups`` when given)."""
        size = recorder.batch_size
        own = own_loss_scale(recorder.loss_reduction, size if groups is None else groups.count)
        divisor = 1.0 if own is None else own
        scale = own if grad_scale == 1.0 else divisor / grad_scale
        return cls(records, size, scale, 1.0 if scale is None else scale, divisor, grad_scale,
                   recorder.loss_reduction, recorder.batch_first, recorder.differentiable,
                   recorder.check, recorder.model, recorder.names, recorder.order,
                   recorder.params, recorder.layers, recorder.totals, checking, check_key,
                   recorder.batch_id, recorder.result, recorder.released, releasing,
                   recorder.memo, recorder.pool, recorder, groups)

    @property
    def low(self) -> Optional[torch.dtype]:
        """bfloat16 / float16 where a record's grad_outputs are of that dtype (an autocast
        forward), else ``None``: reads compute under
        :func:`~gradhooks.base.utils.tf32_products` of it."""
        return next((r.low for r in self.records if r.low is not None), None)

    def release(self, record: Record) -> None:
        """Ask the recorder to release ``record``'s tensors (a reader that :attr:`releasing`
        does so once it has used them: the read's peak memory stays one layer's records)."""
        self.asks.release_record(record)

    def keep(self, result: Dict[str, Tensor]) -> Dict[str, Tensor]:
        """Ask the recorder to keep ``result`` (the per-sample reader's) for this batch's later
        reads (:attr:`result`); returns it."""
        return self.asks.keep_result(result)

    def check_passed(self) -> None:
        """Tell the recorder that this read's sum check (:attr:`check_key`) passed."""
        self.asks.sum_check_passed(self.check_key)
