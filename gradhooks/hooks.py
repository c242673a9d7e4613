"""The hook manager: attach to a model, record activations and grad_outputs per call, detach.

How it works (Goodfellow 2015, arXiv:1510.01799): for every module that has a rule, a forward
hook records the call's input activations ``a`` and registers a pre-hook on the autograd node that
produced the call's output (like curvlinops' ``output.register_hook``, but cheaper to register;
unlike ``register_full_backward_hook`` it works when an in-place op such as
``ReLU(inplace=True)`` follows the layer). In the backward the pre-hook receives the gradient
w.r.t. that output, ``g``. Each call gets its own record, so a layer
called several times in one forward pairs every input with its own grad_output. Per-sample
gradients are formed from the records only when asked for (:meth:`GradHooks.per_sample_grads`).

All state lives in the :class:`GradHooks` object; the only attribute put on user objects is
``param.grad_sample``, removed by :meth:`GradHooks.detach`.
"""
from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from . import rules as _rules  # noqa: F401  (registers the built-in rules)
from .per_sample import (BufferPool, GradTotal, call_grads, check_loss_reduction, check_sums,
                         reduction_scale, using_pool)
from .registry import (
    BatchSizeError,
    Call,
    FallbackWarning,
    GradHooksError,
    GradientMismatchError,
    HigherOrderGradError,
    LayerRule,
    NoBackwardError,
    RecordsReleasedError,
    UnsupportedModuleError,
    find_rule,
    supported_types,
)
from .rules.fallback import FALLBACK

__all__ = ["attach", "GradHooks"]

# Modules currently hooked by a live GradHooks (to refuse a second attach to the same layer).
_HOOKED: "weakref.WeakKeyDictionary[nn.Module, GradHooks]" = weakref.WeakKeyDictionary()
# > 0 while hooks must record nothing (the looped reference runs the model sample by sample).
_PAUSED = 0

_MISSING = object()


def _accumulate_grad_type() -> type:
    x = torch.zeros(1, requires_grad=True)
    return type((x * 1).grad_fn.next_functions[0][0])


_ACCUMULATE_GRAD = _accumulate_grad_type()  # autograd's node of a leaf: nothing below it
_TAG = "gradhooks"  # key of the entries GradHooks.backward finds in autograd nodes' metadata


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Context in which no GradHooks records anything (used by the looped reference)."""
    global _PAUSED
    _PAUSED += 1
    try:
        yield
    finally:
        _PAUSED -= 1


# Inputs wrapped by torch.func transforms (vmap, grad) are not recorded.
_is_functorch_wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", lambda x: False)


_AUTOCAST_DEVICES = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


@contextlib.contextmanager
def _no_autocast() -> Iterator[None]:
    # Rules compute in the recorded dtypes (promoted to float32), whatever autocast is active.
    # Entering torch.autocast costs about 10 µs: only where autocast is on.
    on = [d for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d)]
    if not on:
        yield
        return
    with contextlib.ExitStack() as stack:
        for d in on:
            stack.enter_context(torch.autocast(d, enabled=False))
        yield


class _Layer:
    """A hooked module: its path in the model, its rule and the parameters the rule handles."""

    __slots__ = ("path", "module", "rule", "params", "items", "all_names", "validates", "watched")

    def __init__(self, path: str, module: nn.Module, rule: LayerRule, params: Dict[str, nn.Parameter]):
        self.path, self.module, self.rule, self.params = path, module, rule, params
        # Precomputed for the forward hook, which runs on every call of every hooked layer.
        self.items = tuple(params.items())
        self.all_names = tuple(params)
        self.validates = type(rule).check_call is not LayerRule.check_call
        self.watched = False  # every parameter has its sum-check gradient hook

    def trainable(self) -> Tuple[str, ...]:
        """Names of the parameters that currently require grad."""
        for _, p in self.items:
            if not p.requires_grad:
                return tuple(n for n, p in self.items if p.requires_grad)
        return self.all_names

    def describe(self) -> str:
        return f"{self.path or '<root>'!r} ({type(self.module).__name__})"


class _Capture:
    """One call of one hooked module: input activations and the grad_outputs it received.

    Single-output rules: ``a`` is the first input, ``grads`` one grad_output per backward pass.
    ``multi_io`` rules: ``a`` is a :class:`Call`, ``grads`` holds per output tensor (leaf of
    the output's pytree ``spec``) the grad_output summed over backward passes, or ``None``.
    """

    __slots__ = ("layer", "a", "versions", "names", "grads", "step", "spec", "low", "hits", "__weakref__")

    def __init__(self, layer: _Layer, a, names: Tuple[str, ...], step: int, spec=None,
                 leaves: Optional[list] = None):
        self.layer, self.a, self.names, self.step, self.spec = layer, a, names, step, spec
        self.versions = [(a, a._version)] if isinstance(a, Tensor) else [(t, t._version) for t in _tensors(a)]
        self.grads: list = leaves if spec is not None else []
        self.low: Optional[torch.dtype] = None  # grad_output dtype when below float32 (autocast)
        self.hits = 0  # grad_output hook calls (backward passes x output tensors reached)

    def check_unmodified(self, result: str) -> None:
        """Raise :class:`GradientMismatchError` if a recorded input was modified in place since
        the forward: ``result`` (e.g. ``"per-sample gradients"``) computed from it would be wrong."""
        for t, v in self.versions:
            if t._version != v:
                raise GradientMismatchError(
                    f"the input of module {self.layer.describe()} was modified in place after its "
                    f"forward; {result} would be wrong. Avoid in-place ops on the layer's input "
                    f"(e.g. use ReLU(inplace=False) after the layer that feeds it)"
                )

    def grad_struct(self):
        return tree_unflatten(self.grads, self.spec)

    def release(self) -> None:
        self.a = None
        self.versions = []
        self.grads = []


def _on_grad(t: Tensor, fn) -> None:
    """Call ``fn(grad_outputs, nr)`` whenever a backward pass reaches the tensor ``t``:
    ``grad_outputs[nr]`` is the gradient w.r.t. ``t`` (``None`` when the node that produced
    ``t`` runs for another of its outputs only).

    A pre-hook on ``t``'s autograd node: cheaper to register than ``Tensor.register_hook``, and
    like it unaffected by in-place ops that later rebase ``t`` onto another node (the node that
    produced ``t`` still receives the gradient w.r.t. the value the layer returned).
    """
    node = t.grad_fn
    if node is None:  # a leaf returned as the output
        t.register_hook(lambda g: fn((g,), 0))
    else:
        node.register_prehook(functools.partial(fn, nr=t.output_nr))


# The forward hook walks call arguments and outputs on every call. torch's Python pytree costs
# about 15 µs per walk of an LSTM's (out, (h, c)); plain tuples, lists and dicts (exact types)
# with tensors and scalars in them are walked here instead, anything else by the pytree.
_PLAIN_LEAVES = (type(None), int, float, bool, str, torch.dtype, torch.device)


def _tensors(obj) -> List[Tensor]:
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


def _detached(obj):
    """``obj`` with every tensor detached (same structure)."""
    t = type(obj)
    if t is tuple:
        return tuple([_detached(o) for o in obj])
    if t is list:
        return [_detached(o) for o in obj]
    if t is dict:
        return {k: _detached(v) for k, v in obj.items()}
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


def _flatten(obj) -> Tuple[list, object]:
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


class GradHooks:
    """Per-sample gradients of an existing model, through hooks on its layers.

    Create it with :func:`attach`. Typical use::

        with gradhooks.attach(model, loss_reduction="mean") as gh:
            loss = F.cross_entropy(model(x), y)          # reduction="mean"
            loss.backward()
            grads = gh.per_sample_grads()                 # {name: (B, *param.shape)}

    **Batches and backward passes.** A *batch* starts with the first forward (with autograd
    enabled) after a backward pass, or after :meth:`clear`. All calls of hooked layers until the
    next backward belong to that batch; within one forward of the model they must agree on the
    batch size ``B`` (a forward that no backward reached may be followed by one of another size,
    which starts a new batch). Several backward
    passes through the same forward (``retain_graph=True``) *accumulate*: the per-sample
    gradients are summed over them, like ``param.grad``. The next forward after a backward starts
    a new batch and *replaces* the previous results (per-sample gradients of different batches
    cannot be added sample by sample). :meth:`clear` drops everything recorded at once.

    **Backward without the batch gradient.** ``gh.backward(loss)`` (:meth:`backward`) replaces
    ``loss.backward()`` when only per-sample results are wanted: autograd then computes the
    gradients w.r.t. the layers' outputs only, not the batch weight gradients (which per-sample
    rules recompute sample by sample anyway), and ``param.grad`` is left alone.

    **Memory.** Inputs of calls whose output never reaches a backward are freed with the autograd
    graph. Inputs and grad_outputs of calls the backward reached are kept until the next
    recording forward of the model starts, :meth:`clear` or :meth:`detach`, so that norms,
    clipping and KFAC factors can be read in any order, or until :meth:`per_sample_grads`
    releases them layer by layer as it forms its result (its default, ``retain_records=False``;
    later norms and clipping then read the result).

    **Sum check.** :meth:`per_sample_grads` verifies, on up to 256 coordinates of each
    parameter, that the per-sample gradients sum to the gradient autograd computed for the
    parameter in the same backward passes. It catches a parameter that also receives gradient
    outside its module (used functionally, ``x @ layer.weight.T``), a module that mixes samples
    under the fallback, or a backward that computed no parameter gradient
    (``torch.autograd.grad`` w.r.t. the input only). Its cost is a few torch calls and a read
    of ``B x 256`` values per parameter (0.5 ms per read on a 3-layer MLP, noise on real
    models); autograd's gradients are taken in the backward as
    :class:`~gradhooks.per_sample.GradTotal` (large ones reduced at once, so that autograd
    still moves them into ``.grad``). With ``check=True`` (default) it runs on every read whose *structure* has not
    been checked before -- which modules were called how often, by how many backward passes,
    and which parameters autograd reached -- and on every 100th read: the failures above are
    properties of that structure, so a training loop pays for the check once, and any new
    structure is checked when it appears. ``check="always"`` checks every read; ``check=False``
    never. Calls whose input was modified in place after the forward, and ``create_graph``
    backward passes, are refused on every read whatever ``check`` is.
    """

    def __init__(self, model: nn.Module, *, loss_reduction: str = "mean", batch_first: bool = True,
                 check=True, strict: bool = False, allow_batchnorm_train: bool = False):
        check_loss_reduction(loss_reduction)
        if not isinstance(model, nn.Module):
            raise TypeError(f"attach expects an nn.Module, got {type(model).__name__}")
        self.model = model
        self.loss_reduction = loss_reduction
        self.batch_first = bool(batch_first)
        if check not in (True, False, "always"):
            raise ValueError(f"check must be True, False or 'always', got {check!r}")
        self.check = check
        self._checked: set = set()  # structures whose sum check passed
        self._reads = 0
        self.strict = bool(strict)
        self._options = {"allow_batchnorm_train": bool(allow_batchnorm_train)}
        self._layers: List[_Layer] = []
        self._handles: list = []
        self._names: Dict[int, str] = {}  # id(param) -> name in model.named_parameters()
        self._params: Dict[int, nn.Parameter] = {}
        self._hooks_were_none: List[nn.Parameter] = []  # params whose _backward_hooks we created
        self._saved_grad_sample: Dict[int, object] = {}
        self._watched: set = set()  # ids of params with a gradient hook (sum check)
        self._attached = False
        self._pool = BufferPool()
        self._plans: Dict[tuple, list] = {}  # gradhooks.dp's per-parameter decisions per structure
        # GradHooks.backward: once called, forwards record their outputs' autograd edges.
        self._driven = False
        self._drives = 0
        self._drive_checked: set = set()  # forward structures whose sum check passed (backward())
        # Inside backward(): (id(capture), leaf) whose grad_outputs arrive as its return values.
        self._captured: frozenset = frozenset()
        self._muted = False  # hooks record nothing (second pass of clipped_backward)
        self._stream = None  # gradhooks.dp._NormStream while clipped_backward's first pass runs
        self._step = 0
        self._forward_id = 0
        self._reset_batch()
        self._attach()

    # ------------------------------------------------------------------ attach / detach
    def _attach(self) -> None:
        for name, p in self.model.named_parameters():
            self._names[id(p)] = name
        self._order = {pid: i for i, pid in enumerate(self._names)}  # results in this order
        unsupported, fallback = [], []
        claimed: set = set()  # ids of submodules an ancestor's rule claims (MHA's out_proj)
        for path, module in self.model.named_modules():
            own = dict(module.named_parameters(recurse=False))
            if not own:
                rule = find_rule(module, path)
                if rule is not None and rule.check_always:  # BatchNorm(affine=False)
                    self._layers.append(_Layer(path, module, rule, {}))
                continue
            if id(module) in claimed:
                continue
            try:
                rule = find_rule(module, path)
            except UnsupportedModuleError:  # a subclass overriding forward
                if self.strict:
                    raise
                rule = None
            handled = rule.params_of(module) if rule is not None else {}
            extra = [n for n, p in own.items() if n not in handled and p.requires_grad]
            if extra:
                if self.strict:
                    unsupported.append((path, module, extra))
                    continue
                rule, handled = FALLBACK, FALLBACK.params_of(module)
                fallback.append(f"{path or '<root>'!r} ({type(module).__qualname__})")
            if handled:
                if module in _HOOKED:
                    raise GradHooksError(
                        f"module {path or '<root>'!r} ({type(module).__name__}) is already hooked "
                        f"by another GradHooks; call detach() on that one first"
                    )
                claimed.update(id(module.get_submodule(n.rsplit(".", 1)[0]))
                               for n in handled if "." in n)
                self._layers.append(_Layer(path, module, rule, handled))
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
        if fallback:
            warnings.warn(
                "gradhooks has no dedicated rule for these modules and uses its torch.func "
                f"fallback (vmap of the module's vjp per sample) for them: {', '.join(fallback)}. "
                "It is exact only if each module treats the samples of a batch independently "
                "(see gradhooks.rules.fallback); attach(model, strict=True) refuses such modules.",
                FallbackWarning, stacklevel=4,
            )
        # A top-level forward starts here: layers of one forward must agree on the batch size,
        # while a forward that never reached a backward may be followed by another batch size.
        self._handles.append(self.model.register_forward_pre_hook(self._on_model_forward))
        for layer in self._layers:
            _HOOKED[layer.module] = self
            self._handles.append(layer.module.register_forward_hook(
                functools.partial(self._on_forward, layer), with_kwargs=True))
            for p in layer.params.values():
                if id(p) in self._params:
                    continue  # tied: one hook per parameter
                self._params[id(p)] = p
                if self.check and p.requires_grad:
                    self._watch_param(p)  # also catches a module whose forward never runs
                value = p.__dict__.get("grad_sample", _MISSING)
                if value is not _MISSING:
                    self._saved_grad_sample[id(p)] = value
        self._attached = True

    def detach(self) -> None:
        """Remove every hook, record and ``grad_sample`` attribute; the model is as before attach.

        Afterwards the model's hook dictionaries, ``state_dict()``, ``copy.deepcopy`` and
        ``pickle`` behave exactly as before :func:`attach`. Calling it twice is harmless.
        """
        if not self._attached:
            return
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for p in self._hooks_were_none:
            if not p._backward_hooks:
                p._backward_hooks = None
        self._hooks_were_none.clear()
        self._watched.clear()
        for pid, p in self._params.items():
            if pid in self._saved_grad_sample:
                p.grad_sample = self._saved_grad_sample[pid]
            else:
                p.__dict__.pop("grad_sample", None)
        for layer in self._layers:
            if _HOOKED.get(layer.module) is self:
                del _HOOKED[layer.module]
        self._reset_batch()
        self._pool.clear()
        self._attached = False

    def __enter__(self) -> "GradHooks":
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    # ------------------------------------------------------------------ batch state
    def _reset_batch(self) -> None:
        for cap in getattr(self, "_reached", ()):
            cap.release()
        self._step += 1
        self._reached: List[_Capture] = []
        # Whether every forward of this batch marked its output nodes for GradHooks.backward.
        self._edges_complete = self._driven
        # How reads run the sum check: None (decided at the read), "due" (backward() computed
        # autograd's parameter gradients for it), "skip" (backward() computed none).
        self._sum_check: Optional[str] = None
        self._drive_key: Optional[tuple] = None
        self._higher_order: Optional[str] = None  # a layer a create_graph=True backward reached
        self._batch_size: Optional[int] = None
        self._batch_source: Optional[str] = None
        self._batch_forward = -1  # the top-level forward in which the batch size was set
        self._backward_seen = False
        # per_sample_grads() released the records; _stale: a module a backward then reached.
        self._released = False
        self._stale: Optional[str] = None
        self._param_grads: Dict[int, GradTotal] = {}  # autograd's, for the sum check
        self._param_passes: Dict[int, int] = {}
        self._drop_result()

    def _drop_result(self) -> None:
        # A superseded result's tensors may be reused for the next one (BufferPool), unless the
        # user still holds them.
        result = getattr(self, "_result", None)
        if result:
            self._pool.give(result.values())
        self._result: Optional[Dict[str, Tensor]] = None

    def clear(self) -> None:
        """Drop everything recorded (activations, grad_outputs, results) and set every
        ``param.grad_sample`` to ``None``. The next forward starts a new batch."""
        self._reset_batch()
        for p in self._params.values():
            if "grad_sample" in p.__dict__:
                p.grad_sample = None

    @property
    def batch_size(self) -> Optional[int]:
        """Batch size ``B`` of the current batch, or ``None`` before its first forward."""
        return self._batch_size

    # ------------------------------------------------------------------ hooks
    def _on_forward(self, layer: _Layer, module: nn.Module, args, kwargs, output) -> None:
        # Hot path: runs for every call of every hooked layer, so attribute lookups and Python
        # calls are kept to what the bookkeeping needs (hooks attached but nothing read cost
        # little more than the plain forward + backward; benchmarks/peers.py "hooks only").
        if _PAUSED or not torch.is_grad_enabled():
            return
        rule = layer.rule
        if rule.multi_io:
            leaves, spec = _flatten(output)
            reached = [i for i, t in enumerate(leaves) if isinstance(t, Tensor) and t.requires_grad]
            if not reached:
                return
            x = args[0] if args else next(iter(kwargs.values()), None)
            if any(_is_functorch_wrapped(t) for t in _tensors((args, kwargs))):
                return
        else:
            if not isinstance(output, Tensor) or not output.requires_grad:
                return
            x = args[0] if args else next(iter(kwargs.values()), None)
            if not isinstance(x, Tensor) or _is_functorch_wrapped(x):
                return
        names = layer.trainable()
        if not names and not rule.check_always:
            return
        try:
            if layer.validates:
                rule.check_call(module, args, kwargs, self._options)
            if not names:
                return
            b = rule.call_batch_size(module, args, kwargs, self.batch_first)
        except GradHooksError as e:
            raise type(e)(f"module {layer.describe()}: {e}") from None
        if self.check and not layer.watched:
            for n in names:
                self._watch_param(layer.params[n])
            layer.watched = len(names) == len(layer.items)
        if self._backward_seen:
            self.clear()
        if b != self._batch_size:
            if self._batch_size is not None and self._forward_id != self._batch_forward:
                self._reset_batch()  # an earlier forward that no backward reached: drop it
            if self._batch_size is None:
                self._batch_size, self._batch_source, self._batch_forward = b, layer.describe(), self._forward_id
            else:
                raise BatchSizeError(
                    f"module {layer.describe()} sees batch size {b}, but {self._batch_source} saw "
                    f"{self._batch_size} in the same forward. Per-sample gradients need every hooked "
                    f"layer to see the whole batch on the batch dim (batch_first={self.batch_first}); "
                    f"check the input layout, or pass batch_first=False for (T, B, ...) inputs."
                )
        if rule.multi_io:
            # Output leaves that carry no gradient but structure (a PackedSequence's batch_sizes
            # and indices) are kept so that the grad structure rebuilds; the others start as None.
            fill = [t if isinstance(t, Tensor) and not t.is_floating_point() and not t.is_complex()
                    else None for t in leaves]
            found = rule.internal(module, args, kwargs, output)
            node = None if found is None else found[0]
            cap = _Capture(layer, Call(_detached(tuple(args)), _detached(dict(kwargs)),
                                       None if found is None else found[1]),
                           names, self._step, spec, fill)
            if node is not None:
                node.register_hook(functools.partial(self._on_internal, cap, found[1]))
            for i in reached:
                _on_grad(leaves[i], functools.partial(self._on_grad_output, cap, i))
            if self._driven:
                self._mark(cap, [(leaves[i], i) for i in reached], node)
        else:
            cap = _Capture(layer, x.detach(), names, self._step)
            _on_grad(output, functools.partial(self._on_grad_output, cap, None))
            if self._driven:
                self._mark(cap, [(output, None)], None)

    def _mark(self, cap: _Capture, outputs: list, internal) -> None:
        # For GradHooks.backward, which finds them by walking the graph: tag the autograd nodes
        # of the outputs ``(tensor, leaf)`` and the rule's ``internal`` node (whose inputs it
        # asks gradients for, so that autograd runs that node and its post-hook). The tag lives
        # in the node's metadata dict and goes with the graph.
        for t, leaf in outputs:
            if t.grad_fn is None:  # an output that is a leaf tensor: backward() falls back
                self._edges_complete = False
                return
        for t, leaf in outputs:
            t.grad_fn.metadata.setdefault(_TAG, []).append((self, cap, leaf, t.output_nr))
        if internal is not None:
            internal.metadata.setdefault(_TAG, []).append((self, cap, -1, None))

    def _on_model_forward(self, module: nn.Module, args) -> None:
        self._forward_id += 1
        # A forward that will record starts a new batch: drop the last one's records here, not
        # at the first hooked layer's forward hook (after that layer's forward), so that they
        # are not held beside the new batch's first activations (about 3 MB more peak memory
        # on the Transformer block, whose first hooked layer is the attention).
        if (self._backward_seen and not _PAUSED and torch.is_grad_enabled() and args
                and not any(_is_functorch_wrapped(t) for t in _tensors(args))):
            self.clear()

    def _on_grad_output(self, cap: _Capture, leaf: Optional[int], grads: tuple, nr: int) -> None:
        # grads[nr]: the gradient w.r.t. the recorded output tensor (see _on_grad).
        grad = grads[nr]
        if _PAUSED or grad is None or self._muted or (id(cap), leaf) in self._captured:
            return None
        self._receive(cap, leaf, grad)
        return None

    def _receive(self, cap: _Capture, leaf: Optional[int], grad: Tensor) -> None:
        # Record a grad_output of ``cap`` (of output leaf ``leaf`` for multi_io rules).
        if cap.step != self._step:
            raise GradHooksError(
                f"a backward pass reached module {cap.layer.describe()} through a graph built "
                f"before the current batch started (an earlier forward, or one with another batch "
                f"size); per-sample results are per batch: run the backward passes of a forward "
                f"before the next forward, and give one loss only outputs of one batch"
            )
        if self._released:  # nothing to add the grad_output to: reads now raise
            self._stale = self._stale or cap.layer.describe()
            self._backward_seen = True
            self._drop_result()
            return
        if grad.requires_grad and self._higher_order is None:
            self._higher_order = cap.layer.describe()
        if not cap.hits:  # the first grad_output this call receives
            self._reached.append(cap)
        cap.hits += 1
        if grad.dtype in (torch.bfloat16, torch.float16):
            cap.low = grad.dtype
        grad = grad.detach()
        if leaf is None:
            cap.grads.append(grad)
        else:
            prev = cap.grads[leaf]
            cap.grads[leaf] = grad if prev is None else prev + grad
        self._backward_seen = True
        if self._result is not None:
            self._drop_result()
        if self._stream is not None:
            self._stream.hit(cap)

    def _on_internal(self, cap: _Capture, saved: dict, grad_inputs: tuple,
                     grad_outputs: tuple) -> None:
        # Post-hook on a node a rule asked for (LayerRule.internal): sum its input gradients.
        if _PAUSED or self._muted or self._released:
            return None
        prev = saved.get("grad_inputs")
        new = tuple(None if t is None else t.detach() for t in grad_inputs)
        if prev is not None:
            new = tuple(b if a is None else a if b is None else a + b for a, b in zip(prev, new))
        saved["grad_inputs"] = new
        if self._stream is not None:
            self._stream.hit(cap)
        return None

    def _watch_param(self, p: nn.Parameter) -> None:
        # Gradient hook for the sum check, registered at the first forward in which ``p`` is
        # trainable (torch refuses hooks on tensors that do not require grad).
        if id(p) in self._watched:
            return
        self._watched.add(id(p))
        if p._backward_hooks is None:
            self._hooks_were_none.append(p)
        self._handles.append(p.register_hook(functools.partial(self._on_param_grad, id(p))))

    def _on_param_grad(self, pid: int, grad: Tensor) -> None:
        if _PAUSED or self._muted:
            return None
        total = self._param_grads.get(pid)
        if total is None:
            self._param_grads[pid] = GradTotal(grad)
        else:
            total.add(grad)
        self._param_passes[pid] = self._param_passes.get(pid, 0) + 1
        return None

    def _check_records(self, read: Optional[str]) -> None:
        """Raise :class:`RecordsReleasedError` if the records ``read`` (a method call, ``None``
        for :meth:`per_sample_grads` itself) needs are gone."""
        if self._stale is not None:
            raise RecordsReleasedError(
                f"a backward pass reached module {self._stale} after per_sample_grads() released "
                f"this batch's records (activations and grad_outputs), so its grad_outputs were "
                f"not recorded: to read per-sample results over several backward passes of one "
                f"forward, call per_sample_grads(retain_records=True) before the later passes, "
                f"or run a new forward"
            )
        if not self._released:
            return
        if read is None:
            raise RecordsReleasedError(
                "per_sample_grads() released this batch's records as it read them and did not "
                "finish (it raised an error): run the forward and backward again, with "
                "per_sample_grads(retain_records=True) to keep the records through a failed read"
            )
        raise RecordsReleasedError(
            f"per_sample_grads() released this batch's records (activations and grad_outputs) as "
            f"it read them, and {read} needs them: call {read} before per_sample_grads(), or "
            f"per_sample_grads(retain_records=True) to keep them"
        )

    def _check_unrecorded(self, recorded) -> None:
        # Parameters autograd reached whose module the hooks never saw called (a parent reading
        # child.weight functionally): their per-sample results are unknown.
        missing = [name for pid, name in self._names.items()
                   if pid in self._param_grads and pid in self._params and pid not in recorded]
        if missing:
            raise GradientMismatchError(
                f"autograd computed gradients for {', '.join(map(repr, missing))}, but the "
                f"hooks saw no call of the module that owns them: the parameters are used "
                f"outside their module's forward (functionally, e.g. by a parent module that "
                f"reads child.weight directly). Their per-sample gradients are unknown; give "
                f"the parent a rule (gradhooks.register_rule) that claims them"
            )

    def _structure(self) -> tuple:
        # What the sum check's verdict depends on: the calls and backward passes each module
        # received, and the passes in which autograd reached each parameter.
        calls = tuple((id(cap.layer), cap.names, cap.hits) for cap in self._reached)
        return calls, tuple(sorted(self._param_passes.items()))

    def _sum_check_key(self) -> Optional[tuple]:
        """Whether this read runs the sum check (class docstring; :meth:`backward` decides it
        for its batch): the structure key to pass to :meth:`_sum_check_passed`, or ``None``."""
        if not self.check or self._sum_check == "skip":
            return None
        self._reads += 1
        key = self._structure()
        if (self._sum_check == "due" or self.check == "always" or key not in self._checked
                or self._reads % 100 == 0):
            return key
        return None

    def _sum_check_passed(self, key: tuple) -> None:
        self._checked.add(key)
        if self._drive_key is not None:
            self._drive_checked.add(self._drive_key)
        self._sum_check = None

    # ------------------------------------------------------------------ backward
    def backward(self, loss: Tensor, gradient: Optional[Tensor] = None, *,
                 retain_graph: bool = False) -> None:
        """A backward pass that records the grad_outputs without forming the batch gradient.

        Use it instead of ``loss.backward()`` when only per-sample quantities are wanted
        (:meth:`per_sample_grads`, :meth:`per_sample_grad_norms`, :meth:`clip_and_accumulate`,
        :meth:`kfac_factors`, ...): it asks autograd for the gradients w.r.t. the hooked layers'
        outputs (``torch.autograd.grad`` with :class:`torch.autograd.graph.GradientEdge` inputs)
        instead of the parameters, so autograd skips every weight-gradient product (``g^T a``
        of a Linear, the weight-backward convolution of a Conv, the gate products of an LSTM):
        the part of the backward that per-sample rules compute sample by sample anyway (about
        a third of a Linear network's backward; measured in ``benchmarks/``). Everything
        gradhooks reads is recorded exactly as by ``loss.backward()``.

        ``param.grad`` is neither allocated nor changed; parameters the hooks do not cover get
        no gradient either (use ``loss.backward()`` for those). Several calls through one
        forward (``retain_graph=True``) accumulate, like backward passes do.

        **Sum check.** Without the parameters' gradients the sum check of the class docstring
        has nothing to compare with. So on the steps where it is due -- the first call (whose
        forward ran before the hooks knew of this mode and recorded no edges), each new forward
        structure (which modules were called, in which order), every 100th call, and every call
        with ``check="always"`` -- this computes the parameters' gradients instead
        (``torch.autograd.grad(loss, params)``, handed to the check and dropped, ``.grad``
        untouched), and the next read runs the check. On the other steps reads skip it.

        Args:
            loss: the tensor to differentiate, usually the scalar batch loss reduced as the
                ``loss_reduction`` given to :func:`attach` says.
            gradient: the gradient w.r.t. ``loss`` (its shape) for a non-scalar ``loss``, as in
                ``Tensor.backward``.
            retain_graph: keep the graph for another backward pass through it.

        Raises:
            GradHooksError: if ``loss`` does not require grad, or nothing trainable is hooked.
            RuntimeError: from autograd, e.g. a non-scalar ``loss`` without ``gradient``, or a
                graph already freed by an earlier backward.
        """
        if not isinstance(loss, Tensor) or not loss.requires_grad:
            raise GradHooksError(
                "GradHooks.backward(loss): loss must be a tensor that requires grad (the output of "
                "a forward of the hooked model, not under torch.no_grad())")
        self._drive(loss, gradient, retain_graph)

    def _drive(self, loss: Tensor, gradient: Optional[Tensor], retain_graph: bool,
               stream=None) -> bool:
        # GradHooks.backward's pass. ``stream(caps, events)``: called before an output-edges
        # pass with the records below ``loss`` and the hook calls each will get (their tags);
        # returns the stream that hears of each (gradhooks.dp). Returns whether the pass asked
        # for the output edges (else: for the parameters, for the sum check).
        caps, captures, events = self._walk(loss.grad_fn)
        key = tuple((id(c.layer), c.names) for c in caps)
        self._drives += 1
        edges_mode = self._edges_complete and bool(caps) and not (
            self.check == "always"
            or (self.check and (key not in self._drive_checked or self._drives % 100 == 0)))
        self._driven = True
        if edges_mode:
            self._sum_check = "skip"  # this batch's parameter gradients are incomplete
            self._captured = {(id(cap), leaf) for _, cap, leaf in captures}
            self._stream = None if stream is None else stream(caps, events)
            try:
                grads = torch.autograd.grad(loss, [e for e, _, _ in captures], gradient,
                                            retain_graph=retain_graph, allow_unused=True)
                for (_, cap, leaf), grad in zip(captures, grads):
                    if grad is not None and leaf != -1:
                        self._receive(cap, leaf, grad)
            finally:
                self._captured = frozenset()
                self._stream = None
        else:
            params = [p for p in self._params.values() if p.requires_grad]
            if not params:
                raise GradHooksError(
                    "GradHooks.backward: no hooked parameter requires grad; nothing to record")
            torch.autograd.grad(loss, params, gradient, retain_graph=retain_graph,
                                allow_unused=True)  # gradient hooks hand them to the sum check
            if self.check and self._sum_check != "skip":
                self._sum_check = "due"
                self._drive_key = key if self._edges_complete else None
        return edges_mode

    def _walk(self, root) -> Tuple[List[_Capture], List[tuple], Dict[int, int]]:
        """The graph below ``root`` as :meth:`backward` needs it: the captures whose nodes this
        GradHooks tagged (:meth:`_mark`), in the order of a depth-first walk from the loss, the
        edges to ask autograd for, ``[(GradientEdge, capture, leaf)]``, and ``{id(capture):
        number of its tags}`` (the hook calls a pass gives it).

        Autograd runs a node iff a requested edge lies below it. So only the tagged nodes with
        no tagged node below them (the first layers) are requested -- their output edge, or for
        a rule's internal node its input edges (``leaf == -1``) --, and every other tagged node
        runs and gets its gradient through its pre-hook as in ``loss.backward()``: autograd then
        holds the requested gradients until it returns, the others are the hooks' to keep or
        drop.
        """
        if root is None:
            return [], [], {}
        below: Dict[object, bool] = {}  # node -> a tagged node lies (strictly) below it
        kids: Dict[object, list] = {}  # visited node -> its next nodes (leaves' AccumulateGrad left out)
        tags: Dict[object, list] = {}
        leaf_node = _ACCUMULATE_GRAD
        stack = [root]
        while stack:  # depth-first, post-order
            node = stack[-1]
            nexts = kids.get(node)
            if nexts is None:  # first visit
                nexts = kids[node] = [n for n, _ in node.next_functions
                                      if n is not None and type(n) is not leaf_node]
                entries = node.metadata.get(_TAG)
                if entries:
                    mine = [e for e in entries if e[0] is self]
                    if mine:
                        tags[node] = mine
                todo = [n for n in nexts if n not in kids]
                if todo:
                    stack.extend(todo)
                    continue
            stack.pop()
            if node not in below:  # (a node reached twice is finished once)
                below[node] = any(n in tags or below[n] for n in nexts)
        caps: Dict[int, _Capture] = {}
        captures: List[tuple] = []
        events: Dict[int, int] = {}
        for node, entries in tags.items():
            for _, cap, leaf, nr in entries:
                caps.setdefault(id(cap), cap)
                events[id(cap)] = events.get(id(cap), 0) + 1
                if below[node]:
                    continue
                if leaf == -1:
                    captures.extend((GradientEdge(n, i), cap, -1)
                                    for n, i in node.next_functions if n is not None)
                else:
                    captures.append((GradientEdge(node, nr), cap, leaf))
        return list(caps.values()), captures, events

    # ------------------------------------------------------------------ results
    def per_sample_grads(self, *, retain_records: bool = False) -> Dict[str, Tensor]:
        """Per-sample gradients of every trainable parameter the backward reached.

        Args:
            retain_records: keep the batch's records (input activations, grad_outputs) after
                the read. By default they are released layer by layer as the result is formed,
                like ``loss.backward()`` frees the graph (``retain_graph=False``): the peak
                memory of the read is then about the result plus one layer's records, not all
                records plus the result. Later reads of this batch still work where the result
                suffices (this call again, :meth:`per_sample_grad_norms`,
                :meth:`clip_and_accumulate`); :meth:`kfac_factors`, and reads after another
                backward pass through the hooked layers, need the records: call them first or
                pass ``retain_records=True``.

        Returns:
            ``{name: tensor}`` keyed by the parameter's name in ``model.named_parameters()``
            (a parameter tied between modules appears once, summed over them), in that order.
            Each tensor has shape ``(B, *param.shape)`` and the parameter's dtype; entry ``n`` is
            the gradient of sample ``n``'s own loss: with ``loss_reduction="mean"`` the recorded
            gradients are multiplied by ``B``, so the result does not depend on the batch size.
            The same tensor is set as ``param.grad_sample``; ``param.grad`` is left as autograd
            computed it. The result is computed on first call and cached until the next
            backward pass or batch.

        Raises:
            NoBackwardError: if no backward pass reached a hooked layer since the batch started.
            RecordsReleasedError: if a backward pass reached the hooked layers after a read
                released the records, or a read that released them failed.
            HigherOrderGradError: if a backward pass ran with ``create_graph=True`` through a
                hooked layer (a loss containing input derivatives).
            GradientMismatchError: if the sum check fails (see the class docstring), or an input
                recorded in the forward was modified in place afterwards.
        """
        if self._result is not None:
            return self._result
        self._check_records(None)
        if not self._reached:
            raise NoBackwardError(
                "no backward pass has reached a hooked layer since the last forward: call "
                "loss.backward() before per_sample_grads() (forwards under torch.no_grad() or "
                "inference_mode() record nothing)"
            )
        if self._higher_order is not None:
            raise HigherOrderGradError(
                f"a backward pass with create_graph=True reached module {self._higher_order}: the "
                f"loss contains derivatives (a gradient penalty or a Laplacian built with "
                f"torch.autograd.grad(..., create_graph=True)), so each parameter's gradient has "
                f"terms through the derivative graph that grad_output-based per-sample rules do "
                f"not see; the result would be wrong. Compute such per-sample gradients with "
                f"torch.func (vmap over grad of the per-sample loss), or detach the derivative term"
            )
        scale = reduction_scale(self.loss_reduction, self._batch_size)
        for cap in self._reached:
            cap.check_unmodified("per-sample gradients")
        raw: Dict[int, Tensor] = {}
        low: Dict[int, torch.dtype] = {}
        self._released = not retain_records
        with _no_autocast(), using_pool(self._pool):
            for cap in self._reached:
                layer = cap.layer
                try:  # (no local holds the records: a released cap frees them during the call)
                    out = call_grads(layer.rule, layer.module, cap.a,
                                     cap.grad_struct() if cap.spec is not None else cap.grads,
                                     self.batch_first, cap.names, scale,
                                     cap.release if self._released else None)
                except GradHooksError as e:
                    raise type(e)(f"module {layer.describe()}: {e}") from None
                for local, t in out.items():
                    pid = id(layer.params[local])
                    if cap.low is not None:
                        low[pid] = cap.low
                    if pid in raw:
                        raw[pid].add_(t)  # another call, or a tied module (rules return owned tensors)
                    else:
                        raw[pid] = t
        if self.check and self._sum_check != "skip":
            self._check_unrecorded(raw)
        key = self._sum_check_key()
        if key is not None:
            check_sums([(self._names[pid], t, self._param_grads.get(pid), low.get(pid, t.dtype))
                        for pid, t in raw.items()], scale)
            self._sum_check_passed(key)
        result = {}
        order = self._order
        for pid in sorted(raw, key=order.__getitem__):
            p = self._params[pid]
            t = raw[pid]
            if t.dtype != p.dtype:
                t = t.to(p.dtype)
            result[self._names[pid]] = t
            p.grad_sample = t
        self._result = result
        return result

    # ------------------------------------------------------------------ curvature, norms, clipping
    # Computed from the same records by gradhooks.kfac (issue 4) and gradhooks.dp (issue 5).
    def kfac_factors(self, *args, **kwargs):
        """KFAC factors ``{module name: KFACFactors}`` of every Linear / Conv layer the backward
        reached: ``A`` ``(d_in[+1], d_in[+1])``, ``G`` ``(d_out, d_out)`` (stacked per group for
        grouped convolutions). Arguments, conventions (Martens & Grosse 2015; Grosse & Martens
        2016; Eschenhagen et al. 2023) and errors: :func:`gradhooks.kfac.kfac_factors`."""
        from .kfac import kfac_factors  # the module, not gradhooks.kfac (the one-call function)
        return kfac_factors(self, *args, **kwargs)

    def sum_grad_squared(self, *args, **kwargs):
        """Diagonal of the empirical Fisher ``{name: (*param.shape)}``, ``sum_n g_n**2`` of the
        per-sample gradients (BackPACK's SumGradSquared); see
        :func:`gradhooks.kfac.sum_grad_squared` for the scaling convention and errors."""
        from .kfac import sum_grad_squared  # the module, not gradhooks.kfac (the one-call function)
        return sum_grad_squared(self, *args, **kwargs)

    def variance(self, *args, **kwargs):
        """Per-parameter gradient variance over the batch ``{name: (*param.shape)}`` (``1/B``
        normalisation, BackPACK's Variance); see :func:`gradhooks.kfac.variance`."""
        from .kfac import variance  # the module, not gradhooks.kfac (the one-call function)
        return variance(self, *args, **kwargs)

    def per_sample_grad_norms(self, *args, **kwargs):
        """``(B,)`` L2 norms of the per-sample gradients over all trainable parameters, by the
        Gram form where cheaper (Li et al. 2022, sec. 4); arguments and errors:
        :func:`gradhooks.dp.per_sample_grad_norms`."""
        from .dp import per_sample_grad_norms
        return per_sample_grad_norms(self, *args, **kwargs)

    def clip_and_accumulate(self, *args, **kwargs):
        """DP-SGD (Abadi et al. 2016): overwrite ``param.grad`` with the sum of per-sample
        gradients clipped to ``max_norm`` plus Gaussian noise (ghost clipping by default; Li et
        al. 2022, Bu et al. 2023) and return the ``(B,)`` norms; arguments and errors:
        :func:`gradhooks.dp.clip_and_accumulate`."""
        from .dp import clip_and_accumulate
        return clip_and_accumulate(self, *args, **kwargs)

    def clipped_backward(self, *args, **kwargs):
        """DP-SGD by two-pass ghost clipping (Li et al. 2022): instead of ``loss.backward()``,
        from the ``(B,)`` per-sample losses, overwrite ``param.grad`` with the clipped sum plus
        noise, keeping memory close to plain training; returns the ``(B,)`` norms. Arguments
        and errors: :func:`gradhooks.dp.clipped_backward`."""
        from .dp import clipped_backward
        return clipped_backward(self, *args, **kwargs)


def attach(model: nn.Module, *, loss_reduction: str = "mean", batch_first: bool = True,
           check=True, strict: bool = False, allow_batchnorm_train: bool = False) -> GradHooks:
    """Attach per-sample-gradient hooks to every supported layer of an existing model.

    Registers a forward hook on each module that has a rule (``nn.Linear``, ``nn.Conv1d/2d/3d``;
    see :func:`gradhooks.supported_types`) and a gradient hook on each of their parameters, and
    changes nothing else: nested containers, residual connections and functional ops between the
    layers work as they are.

    Args:
        model: the ``nn.Module``.
        loss_reduction: ``"mean"`` or ``"sum"``: how the batch loss was reduced over samples.
            With ``"mean"`` per-sample gradients are multiplied by ``B`` (gradient of each
            sample's own loss).
        batch_first: ``True`` if the batch is dim 0 of every layer input; ``False`` for torch's
            sequence layout ``(T, B, ..., features)`` (a 2-D ``(B, features)`` input is then still
            read as batch-first). Convolutions always take the batch on dim 0.
        check: the sum check of :class:`GradHooks`: ``True`` (each new call structure, and
            every 100th read), ``"always"`` (every read) or ``False``.
        strict: refuse modules that own trainable parameters but have no dedicated rule
            (raise :class:`UnsupportedModuleError`) instead of covering them with the
            ``torch.func`` fallback (:mod:`gradhooks.rules.fallback`, with one
            :class:`FallbackWarning` listing them).
        allow_batchnorm_train: accept ``BatchNorm`` in training mode; its per-sample results are
            then each sample's *contribution* to the batch gradient with the batch statistics
            held fixed (they sum to ``param.grad``), not gradients of each sample's own loss;
            the layers before the BatchNorm then also get such contributions.

    Returns:
        A :class:`GradHooks`, also a context manager that detaches on exit.

    Raises:
        ValueError: if ``loss_reduction`` is not ``"mean"`` or ``"sum"``.
        UnsupportedModuleError: with ``strict=True``, if a module owns trainable parameters and
            has no rule; the message names each such module's path and type.
        GradHooksError: if a layer is already hooked by another live :class:`GradHooks`.
    """
    return GradHooks(model, loss_reduction=loss_reduction, batch_first=batch_first, check=check,
                     strict=strict, allow_batchnorm_train=allow_batchnorm_train)
