"""The recorder: attach to a model, record activations and grad_outputs per call, detach.

How it works (Goodfellow 2015, arXiv:1510.01799): for every module that has a rule, a forward
hook records the call's input activations ``a`` and registers a pre-hook on the autograd node that
produced the call's output (like curvlinops' ``output.register_hook``, but cheaper to register;
unlike ``register_full_backward_hook`` it works when an in-place op such as
``ReLU(inplace=True)`` follows the layer). In the backward the pre-hook receives the gradient
w.r.t. that output, ``g``. Each call gets its own :class:`~gradhooks.records.Record`, so a layer called several times
in one forward pairs every input with its own grad_output.

The recorder computes nothing from its records. Readers (:mod:`gradhooks.per_sample`,
:mod:`gradhooks.norms`, :mod:`gradhooks.clipping`, :mod:`gradhooks.kfac`, ...) ask it for a
:class:`~gradhooks.records.Batch`: a read-only snapshot of the batch's records, its size ``B``, the own-loss scale
(computed once, :func:`gradhooks.utils.own_loss_scale`) and autograd's parameter gradients for
the sum check, validated once (records released, stale, modified in place, ``create_graph``).

All state lives in the :class:`Recorder`; the only attribute put on user objects is
``param.grad_sample`` (set by the per-sample reader), removed by :meth:`Recorder.detach`.
"""
from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor, nn

from . import utils
from ._pool import BufferPool
from .checks import GradTotal, SumCheck, refusal
from .errors import BatchSizeError, GradHooksError
from .forms import Call
from .graph import GlobalHooks, call_kwargs, in_backward, mark, module_hooks, on_grad, walk
from .provenance import Provenance, as_batch, input_batch_dim, shared_layout, source_cotangent
from .errors import FallbackWarning
from .rules.fallback import FALLBACK, FallbackRule
from .records import (FORWARDS, Batch, Layer, Record, expand_call, find_layers, plain_state,
                      shared_lookup)
from .utils import check_loss_reduction, detached, flatten, is_functorch_wrapped, tensors


__all__ = ["Recorder", "Batch", "Layer", "Record", "is_hooked"]

# Modules currently hooked by a live Recorder (to refuse a second attach to the same layer),
# each to a weak reference to it: a strong one would keep the recorder, its model and so the key
# alive for the rest of the process.
_HOOKED: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()

_MISSING = object()


def relayout(t: Tensor, how: tuple) -> Tensor:
    """A position-wise layer's input or grad_output in the layout its rule reads the batch
    from (:meth:`Recorder._layout_swap`): ``("swap", d0, d1)`` transposes two dims,
    ``("split", d, B, inner)`` unflattens a dim of ``B * inner`` rows into ``(B, inner)``."""
    if how[0] == "swap":
        return t.transpose(how[1], how[2])
    return t.unflatten(how[1], how[2:])


def _reads_batch_at(layer: Layer, shape, dtype, dim: int, batch_first: bool = False) -> bool:
    # Whether the layer's rule reads the batch of an input of ``shape`` from dim ``dim``: asked
    # on a meta tensor whose dim ``dim`` has a size no other dim has (a size never decides).
    shape = list(shape)
    shape[dim] = max(shape) + 1
    try:
        return layer.rule.batch_size(layer.module, torch.empty(shape, dtype=dtype, device="meta"),
                                     batch_first) == shape[dim]
    except GradHooksError:
        return False


def _hint(module: nn.Module, default: str) -> str:
    # What to do about a call that does not see the whole batch.
    if type(module).__module__.startswith("opacus."):  # RNNLinear in a DP RNN
        return ("Opacus' DPLSTM / DPGRU / DPRNN run their cells on fewer samples at later time "
                "steps of a PackedSequence, and on an initial state made from sizes, so these "
                "calls cover only part of the batch: use torch's nn.LSTM / nn.GRU / nn.RNN "
                "(gradhooks' recurrent rule takes PackedSequence), or padded inputs.")
    return default


def _hooker(module: nn.Module) -> Optional["Recorder"]:
    # The live Recorder that hooks ``module``, or None.
    ref = _HOOKED.get(module)
    return None if ref is None else ref()


def is_hooked(model: nn.Module) -> bool:
    """Whether any module of ``model`` is hooked by a live :class:`Recorder`."""
    return any(_hooker(m) is not None for m in model.modules())


def _param_grad(recorder: "weakref.ref[Recorder]", pid: int, grad: Tensor) -> None:
    # A parameter's gradient hook (Recorder._watch_param): holds its recorder weakly, as the
    # global hooks do, so that the model does not keep a dropped recorder alive.
    live = recorder()
    return None if live is None else live._on_param_grad(pid, grad)


class Recorder:
    """The hook manager behind :class:`~gradhooks.GradHooks`: hooks, records, batch lifecycle.

    Batches and memory are as the :class:`~gradhooks.GradHooks` docstring says. Readers use the
    public attributes below (read only) and :meth:`snapshot`; the facade adds the user API.

    Attributes:
        model: the attached model.
        loss_reduction: ``"mean"`` or ``"sum"``, as given to :func:`gradhooks.attach`.
        batch_first: the layout flag given to :func:`gradhooks.attach`.
        differentiable: records keep their inputs' and grad_outputs' autograd graphs
            (:func:`gradhooks.attach`).
        strict: refuse modules without a dedicated rule instead of the fallback.
        sum_check: the :class:`~gradhooks.checks.SumCheck` policy (``check=``).
        names: ``{id(param): name}`` of every parameter of the model, in
            ``model.named_parameters()`` order.
        params: ``{id(param): param}`` of the hooked parameters.
        layers: the hooked :class:`Layer` objects, in ``model.named_modules()`` order.
        cache: per-structure decisions readers keep between batches (cleared on detach).
    """

    def __init__(self, model: nn.Module, *, loss_reduction: str = "mean", batch_first: bool = True,
                 check=True, strict: bool = False, allow_batchnorm_train: bool = False,
                 forwards: str = "one", grad_scaler=None, differentiable: bool = False):
        check_loss_reduction(loss_reduction)
        if forwards not in FORWARDS:
            raise ValueError(f"forwards must be one of {FORWARDS}, got {forwards!r}")
        if grad_scaler is not None and not callable(getattr(grad_scaler, "get_scale", None)):
            raise TypeError(f"grad_scaler must be a torch.amp.GradScaler, got "
                            f"{type(grad_scaler).__name__}")
        self.forwards = forwards
        self.grad_scaler = grad_scaler
        self.differentiable = bool(differentiable)
        if not isinstance(model, nn.Module):
            raise TypeError(f"attach expects an nn.Module, got {type(model).__name__}")
        self.model = model
        self.loss_reduction = loss_reduction
        self.batch_first = bool(batch_first)
        self.sum_check = SumCheck(check)
        self.check = check  # (read on every forward: a plain attribute)
        self.strict = bool(strict)
        self._options = {"allow_batchnorm_train": bool(allow_batchnorm_train)}
        self.layers: List[Layer] = []
        self._hooks: Optional[GlobalHooks] = None  # the global module hooks (graph.module_hooks)
        self.names: Dict[int, str] = {}  # id(param) -> name in model.named_parameters()
        self.params: Dict[int, nn.Parameter] = {}
        self._hooks_were_none: List[nn.Parameter] = []  # params whose _backward_hooks we created
        self._saved_grad_sample: Dict[int, object] = {}
        self._watched: set = set()  # ids of params with a gradient hook (sum check)
        self._attached = False
        self.pool = BufferPool()
        self.cache: Dict[object, object] = {}
        # backward(): once called, forwards record their outputs' autograd edges.
        self._driven = False
        # Inside drive(): (id(record), leaf) whose grad_outputs arrive as its return values.
        self._captured: frozenset = frozenset()
        self._muted = False  # hooks record nothing (muted(): clipped_backward's second pass)
        self._pulling = False  # a per-sample pull-back to shared sources is running
        self._listener = None  # told of every hook call while drive()'s pass runs (two-pass clipping)
        self._step = 0
        self._forward_id = 0
        self._param_handles: list = []
        self._layer_of: Dict[int, Layer] = {}  # id(module) -> its Layer, for the global hooks
        self._module_ids: set = set()  # ids of the model's modules (registration hooks)
        self._unhooked: List[nn.Parameter] = []  # frozen parameters no layer covers
        self._changed: Optional[str] = None  # what changed in the model since the last sync
        self._demoted: set = set()  # paths of layers their parent reads functionally
        self._resync = False        # Provenance (gradhooks.provenance) of the forward running now, or None; per input
        # signature, whether its forwards need it (None: not tracked yet).
        self._prov: Optional[Provenance] = None
        # Per input signature, what its tracked forward found: "mode" (track every forward:
        # sources that meet the batch after other ops, raw parameters), or the plan
        # {(id(layer), k): layout} of its shared calls whose outputs themselves meet the batch
        # only by broadcasts ("expand" / "prepend": later forwards hand them downstream as B
        # identical samples, records.expand_call) or only row by row ("rows": their B rows are
        # the samples', an ordinary call); {} without shared calls. Planned forwards run
        # without tracking.
        self._signatures: Dict[tuple, object] = {}
        self._plan: Optional[dict] = None  # the plan of the forward running now
        self._plan_b = 0
        self._ordinals: Dict[int, int] = {}  # calls of each hooked layer in this forward
        # Under torch.compile the recording runs eagerly (a graph break), instead of dynamo
        # tracing it and recompiling for every record; the filters above stay traceable.
        self._record = torch.compiler.disable(self._on_forward)
        self._model_forward = torch.compiler.disable(self._on_model_forward)
        self.reset_batch()
        self._attach()

    # ------------------------------------------------------------------ attach / detach
    def _attach(self) -> None:
        # Global module hooks, filtered by module: the model itself carries no hook of ours, so
        # copy.deepcopy / pickle / torch.save of an attached model give a plain model.
        self._hook_modules()
        self._attached = True
        try:
            self._sync()
        except BaseException:  # (a refused model: nothing of the attempt stays installed)
            self.detach()
            raise

    def _hook_modules(self) -> None:
        # Removed by detach(), or with the parameters' hooks when the recorder is collected
        # while attached (a GradHooks that drops its recorder detaches it first).
        self._hooks = module_hooks(self, pre=Recorder._on_pre_forward,
                                   post=Recorder._on_any_forward, done=Recorder._on_done,
                                   registration=Recorder._on_registration,
                                   what=f"a gradhooks recorder of a {type(self.model).__name__}",
                                   also=self._param_handles)

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Within this context the global module hooks are removed, the recorder's state kept:
        every module of the process, this model's included, runs torch's hook-free fast path and
        nothing is recorded. For benchmarks that time other methods in the same process
        (``benchmarks/peers.py``), whose models would otherwise pay the hooks' dispatch."""
        if not self._attached:
            yield
            return
        self._stop_tracking()
        self._hooks.remove()
        try:
            yield
        finally:
            if self._attached:
                self._hook_modules()

    def _sync(self) -> None:
        # (Re)build what is hooked from the model as it is now: at attach, and at the first
        # forward after the model changed (a submodule or parameter replaced, a frozen
        # parameter no layer covers unfrozen).
        self._unsync()
        self.names = {id(p): name for name, p in self.model.named_parameters()}
        self.order = {pid: i for i, pid in enumerate(self.names)}  # results in this order
        self.layers = find_layers(self.model, self.strict,
                                  lambda m: _hooker(m) not in (None, self), self._demoted)
        self._layer_of = {id(layer.module): layer for layer in self.layers}
        # Raw parameters: those of containers on the fallback (ViT's class token, a block's
        # layer scale), whose replay would run the children again; under provenance each is a
        # source of its own, priced at its own ops. (A leaf module keeps its replay, which costs
        # one call and checks per sample what the module computes.)
        self._raw = {id(p): (layer, name) for layer in self.layers
                     if isinstance(layer.rule, FallbackRule)
                     and next(layer.module.children(), None) is not None
                     for name, p in layer.params.items()}
        self._module_ids = {id(m) for m in self.model.modules()}
        for layer in self.layers:
            _HOOKED[layer.module] = weakref.ref(self)
            for p in layer.params.values():
                if id(p) in self.params:
                    continue  # tied: one hook per parameter
                self.params[id(p)] = p
                if self.check and p.requires_grad:
                    self._watch_param(p)  # also catches a module whose forward never runs
                value = p.__dict__.get("grad_sample", _MISSING)
                if value is not _MISSING:
                    self._saved_grad_sample[id(p)] = value
                p.__getstate__ = functools.partial(plain_state, p)  # (see plain_state)
        self._unhooked = [p for p in self.model.parameters() if id(p) not in self.params]
        self._changed = None
        self._resync = False
        self.cache.clear()
        self._signatures.clear()
        self.reset_batch()

    def _unsync(self) -> None:
        # Undo what _sync did to the parameters and the hooked-module registry.
        for h in self._param_handles:
            h.remove()
        self._param_handles.clear()
        for p in self._hooks_were_none:
            if not p._backward_hooks:
                p._backward_hooks = None
        self._hooks_were_none.clear()
        self._watched.clear()
        for pid, p in self.params.items():
            if pid in self._saved_grad_sample:
                p.grad_sample = self._saved_grad_sample[pid]
            else:
                p.__dict__.pop("grad_sample", None)
            p.__dict__.pop("__getstate__", None)
        self._saved_grad_sample.clear()
        self.params.clear()
        for layer in self.layers:
            if _hooker(layer.module) is self:
                del _HOOKED[layer.module]

    def _on_registration(self, module: nn.Module, name: str, value) -> None:
        # Global registration hook: a parameter or submodule is set on some module.
        if id(module) in self._module_ids and self._changed is None:
            self._changed = f"{type(value).__name__} {name!r} set on {type(module).__name__}"
        return None

    @property
    def attached(self) -> bool:
        """Whether the hooks are attached (``False`` after :meth:`detach`)."""
        return self._attached

    def detach(self) -> None:
        """Remove every hook, record and ``grad_sample`` attribute; the model is as before attach.

        Afterwards the model's hook dictionaries, ``state_dict()``, ``copy.deepcopy`` and
        ``pickle`` behave exactly as before :func:`attach`. Calling it twice is harmless.
        """
        if not self._attached:
            return
        self._stop_tracking()
        self._hooks.remove()
        self._hooks = None
        self._unsync()
        self._attached = False  # graphs built before: their hooks now do nothing
        self.reset_batch()
        self.pool.clear()

    # ------------------------------------------------------------------ batch state
    def reset_batch(self) -> None:
        """Drop the current batch's records and result; the next forward starts a new batch."""
        for cap in getattr(self, "_records", ()):
            cap.release()
        self._step += 1
        self._records: List[Record] = []
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
        self.totals: Dict[int, GradTotal] = {}  # autograd's, for the sum check
        self._param_passes: Dict[int, int] = {}
        self._calls = 0  # hooked-layer calls recorded in this batch
        self._shared_layers: set = set()  # ids of layers with a shared call in this batch
        self._meetings = False  # a shared call's output or a raw parameter met the batch
        # shared calls whose outputs met the batch where they cannot be split: id -> (call, why)
        self._refused: Dict[int, Tuple[Record, str]] = {}
        self._drop_result()

    def _drop_result(self) -> None:
        # A superseded result's tensors may be reused for the next one (BufferPool), unless the
        # user still holds them.
        result = getattr(self, "_result", None)
        if result:
            self.pool.give(result.values())
        self._result: Optional[Dict[str, Tensor]] = None

    def clear(self) -> None:
        """Drop everything recorded (activations, grad_outputs, results) and set every
        ``param.grad_sample`` to ``None``. The next forward starts a new batch."""
        self.reset_batch()
        for p in self.params.values():
            if "grad_sample" in p.__dict__:
                p.grad_sample = None

    @property
    def batch_size(self) -> Optional[int]:
        """Batch size ``B`` of the current batch, or ``None`` before its first forward."""
        return self._batch_size

    # ------------------------------------------------------------------ hooks
    def _on_pre_forward(self, module: nn.Module, args) -> None:
        # Global forward pre-hook: only the model's own forward starts anything; under
        # provenance the hooked layers whose forward runs are noted.
        if module is self.model:
            self._model_forward(module, args, call_kwargs())
        elif self._prov is not None:
            layer = self._layer_of.get(id(module))
            if layer is not None:
                self._prov.entered.add(id(layer))

    def _learn(self, prov: Provenance) -> None:
        # What a tracked forward that returned tells about its signature (see _signatures).
        plan = {key: "rows" if prov.kinds.get(id(cap)) == "direct" else how
                for cap, key, how in prov.shared_calls}
        if (prov.param_sources or prov.plain or prov.swapped
                or len(plan) < len(prov.shared_calls)):
            plan = "mode"
        before = self._signatures.get(prov.signature)
        self._signatures[prov.signature] = (plan if before is None or before == plan
                                            else "mode")

    def _stop_tracking(self) -> None:
        # End the provenance of a forward that detach() / suspended() interrupted.
        prov, self._prov = self._prov, None
        if prov is not None:
            prov.__exit__(None, None, None)

    def _on_done(self, module: nn.Module, completed: bool = False) -> None:
        # The model's forward returned (completed) or raised: its provenance stops; a tracked
        # forward that returned tells whether its signature needs tracking every time.
        prov = self._prov
        if module is self.model and prov is None:
            self._plan = None  # (calls outside the model's forward follow no plan)
        if module is self.model and prov is not None:
            prov.depth -= 1
            if prov.depth == 0:
                self._prov = None
                prov.__exit__(None, None, None)
                if not completed:  # (its records are never read: no refusal of theirs either)
                    self._refused = {k: v for k, v in self._refused.items()
                                     if v[0].forward != self._forward_id}
                else:
                    self._settle_params(prov)
                    self._learn(prov)

    def _on_any_forward(self, module: nn.Module, args, kwargs, output) -> None:
        # Global forward hook: the hooked layers' calls.
        layer = self._layer_of.get(id(module))
        if module is not self.model:
            return None if layer is None else self._record(layer, module, args, kwargs, output)
        completed = False
        try:
            result = None if layer is None else self._record(layer, module, args, kwargs, output)
            completed = True
        finally:
            self._on_done(module, completed)
        return result

    def _on_forward(self, layer: Layer, module: nn.Module, args, kwargs, output) -> None:
        # Hot path: runs for every call of every hooked layer, so attribute lookups and Python
        # calls are kept to what the bookkeeping needs (hooks attached but nothing read cost
        # little more than the plain forward + backward; benchmarks/peers.py "hooks only").
        if utils.PAUSED or not torch.is_grad_enabled():
            return
        rule = layer.rule
        if rule.multi_io:
            leaves, spec = flatten(output)
            reached = [i for i, t in enumerate(leaves) if isinstance(t, Tensor) and t.requires_grad]
            if not reached:
                return
            x = args[0] if args else next(iter(kwargs.values()), None)
            if any(is_functorch_wrapped(t) for t in tensors((args, kwargs))):
                return
        else:
            if not isinstance(output, Tensor) or not output.requires_grad:
                return
            x = args[0] if args else next(iter(kwargs.values()), None)
            if not isinstance(x, Tensor) or is_functorch_wrapped(x):
                return
        names = layer.trainable()
        if not names and not rule.check_always:
            return
        try:
            if layer.validates:
                rule.check_call(module, args, kwargs, self._options)
            if not names:
                return
            prov, plan, ordinal = self._prov, self._plan, 0
            if prov is not None or plan:
                ordinal = self._ordinals[id(layer)] = self._ordinals.get(id(layer), 0) + 1
            planned = plan.get((id(layer), ordinal)) if plan else None
            if planned == "rows":  # (its B rows are the samples': an ordinary call)
                planned = None
            # Provenance decides whether this call sees the batch: a call whose output the
            # batch did not reach is a shared call, whatever its sizes.
            shared_call = prov is not None and not any(
                prov.batched(t) for t in (leaves if rule.multi_io else (output,)))
            swap = None
            if (prov is not None and not shared_call and rule.position_wise and x.dim() >= 2
                    and args and args[0] is x):
                swap = self._layout_swap(prov, layer, x)
                if swap is not None:  # (recorded with the batch where the rule reads it)
                    x = relayout(x, swap)
                    args = (x, *args[1:])
            b = (None if shared_call or planned else
                 rule.call_batch_size(module, args, kwargs, self.batch_first))
        except GradHooksError as e:
            raise type(e)(f"module {layer.describe()}: {e}") from None
        if self.check and not layer.watched:
            for n in names:
                self._watch_param(layer.params[n])
            layer.watched = len(names) == len(layer.items)
        if self._backward_seen and not in_backward():  # (a recomputation belongs to this batch)
            self.clear()
        if shared_call:
            return self._record_shared(prov, layer, args, kwargs, output, names, x, ordinal)
        if planned is not None:  # a shared call its signature's tracked forward planned
            b = (self._batch_size if self._batch_size is not None
                 and self._batch_forward == self._forward_id else self._plan_b)
            x, output, args, kwargs = expand_call(b, x, output, args, kwargs, planned)
            self._shared_layers.add(id(layer))
            if rule.multi_io:
                leaves, spec = flatten(output)
                reached = [0]
        elif prov is None and id(layer) in self._shared_layers and in_backward():
            raise BatchSizeError(
                f"module {layer.describe()} is recomputed in the backward pass (a checkpointed "
                f"region) after a call on shared inputs in its forward; gradhooks takes a shared "
                f"call's per-sample part where it meets the batch in the forward, which a "
                f"recomputation does not replay. Leave the layers that make position biases / "
                f"learned queries outside torch.utils.checkpoint")
        shared = planned is not None or (
            prov is None and b == 1 and self._batch_size is not None and self._batch_size > 1
            and self._forward_id == self._batch_forward and shared_lookup(x, output, self.batch_first))
        if shared and planned is None:  # handed downstream expanded to the batch (records.shared_lookup)
            b = self._batch_size
            x, output, args, kwargs = expand_call(b, x, output, args, kwargs)
            if rule.multi_io:
                leaves, spec = flatten(output)
                reached = [0]
        if b != self._batch_size:
            if (self._batch_size is not None and self._forward_id != self._batch_forward
                    and not in_backward()):
                self.reset_batch()  # an earlier forward that no backward reached: drop it
            if self._batch_size is None:
                self._batch_size, self._batch_source, self._batch_forward = b, layer.describe(), self._forward_id
            else:
                hint = _hint(module, "check the input layout, or pass batch_first=False for "
                                     "(T, B, ...) inputs.")
                shapes = ", ".join(str(tuple(t.shape)) for t in tensors((args, kwargs)))
                raise BatchSizeError(
                    f"module {layer.describe()} sees batch size {b} (inputs {shapes}), but "
                    f"{self._batch_source} saw "
                    f"{self._batch_size} in the same forward. Per-sample gradients need every hooked "
                    f"layer to see the whole batch on the batch dim (batch_first={self.batch_first}); "
                    + hint
                )
        if prov is not None:
            prov.b = b  # (the batch size shared calls are expanded to)
        self._calls += 1
        if rule.multi_io:
            # Output leaves that carry no gradient but structure (a PackedSequence's batch_sizes
            # and indices) are kept so that the grad structure rebuilds; the others start as None.
            fill = [t if isinstance(t, Tensor) and not t.is_floating_point() and not t.is_complex()
                    else None for t in leaves]
            found = rule.internal(module, args, kwargs, output)
            node = None if found is None else found[0]
            cap = Record(layer, Call(detached(tuple(args)), detached(dict(kwargs)),
                                     None if found is None else found[1]),
                         names, self._step, spec, fill)
            cap.forward = self._forward_id
            if prov is not None and isinstance(rule, FallbackRule):
                prov.fallback_calls.append(cap)
            if node is not None:
                node.register_hook(functools.partial(self._on_internal, cap, found[1]))
            for i in reached:
                on_grad(leaves[i], functools.partial(self._on_grad_output, cap, i))
            if self._driven:
                self._edges_complete &= mark(self, cap, [(leaves[i], i) for i in reached], node)
            if shared:
                return output
        else:
            cap = Record(layer, x if self.differentiable else x.detach(), names, self._step)
            cap.forward, cap.swap = self._forward_id, swap
            on_grad(output, functools.partial(self._on_grad_output, cap, None))
            if self._driven:
                self._edges_complete &= mark(self, cap, [(output, None)], None)
            if shared:
                return output
        return None

    def _record_shared(self, prov: Provenance, layer: Layer, args, kwargs, output, names,
                       x, ordinal: int) -> None:
        # A call whose output the batch did not reach (gradhooks.provenance): its input is
        # recorded as a batch of B identical samples (provenance.as_batch) and its output
        # tagged as a source; its per-sample grad_outputs come from where it meets the batch.
        if not isinstance(output, Tensor) or not isinstance(x, Tensor):
            raise BatchSizeError(
                f"module {layer.describe()} is called on inputs that do not come from the batch "
                f"(shapes {[tuple(t.shape) for t in tensors((args, kwargs))]}), and gradhooks "
                f"splits such shared calls per sample only for one tensor input and one tensor "
                "output. " + _hint(layer.module, "Pass the inputs batched (e.g. position ids "
                                              "expanded to (B, T)), or keep the module frozen."))
        rule = layer.rule
        b = prov.b
        how = self._shared_layout(layer, x, output, b, args, kwargs)
        x_b = as_batch(x, b, how)
        if rule.multi_io:
            leaves, spec = flatten(as_batch(output, b, how))
            call_args = (x_b.detach(), *detached(tuple(args[1:]))) if args else ()
            call_kwargs = detached(dict(kwargs))
            if not args:
                first = next(iter(call_kwargs))
                call_kwargs[first] = x_b.detach()
            cap = Record(layer, Call(call_args, call_kwargs, None, how), names, self._step, spec,
                         [None])
        else:
            cap = Record(layer, x_b.detach(), names, self._step)
        cap.forward = self._forward_id
        cap.shared = how
        prov.shared_calls.append((cap, (id(layer), ordinal), how))
        if isinstance(rule, FallbackRule):
            prov.fallback_calls.append(cap)
        self._calls += 1
        self._shared_layers.add(id(layer))
        prov.add_source(output, cap)
        return None

    def _layout_swap(self, prov: Provenance, layer: Layer, x: Tensor) -> Optional[tuple]:
        # A position-wise layer (Linear, LayerNorm ...) whose input carries the batch on
        # another dim than the one its rule reads under the declared layout (a batch-first
        # model that transposes to (T, B, D) inside, as FSMT does), or merged into rows
        # (OPT's (B * T, D) before its feed-forward): how to lay out its records so that the
        # rule reads the batch (relayout; None: as they are). Decided by the batch dim
        # provenance followed from the inputs; with T == B the declared layout would silently
        # read the positions as samples.
        _, _, bd = prov._look(x)
        if isinstance(bd, tuple):  # samples merged with the dims after them: (B * T, D) rows
            d, inner = bd
            if d != 0 or not self.batch_first or x.shape[0] % inner:
                return None
            swap = ("split", 0, x.shape[0] // inner, inner)
            if not _reads_batch_at(layer, relayout(x, swap).shape, x.dtype, 0, self.batch_first):
                return None
            prov.swapped = True
            return swap
        want = 0 if self.batch_first or x.dim() < 3 else 1  # (the Linear rule's convention)
        if bd is None or bd == want or x.dim() < 3:  # (the common case: no probe)
            return None
        if (_reads_batch_at(layer, x.shape, x.dtype, bd, self.batch_first)
                or not _reads_batch_at(layer, x.shape, x.dtype, want, self.batch_first)):
            return None
        prov.swapped = True  # (its signature is tracked on every forward: no plan)
        return ("swap", bd, want)

    def _shared_layout(self, layer: Layer, x: Tensor, output: Tensor, b: int, args,
                       kwargs) -> str:
        # Where a shared call's samples go (provenance.shared_layout): dim 0; with
        # batch_first=False the dim the layer's rule reads the batch from, found by asking the
        # rule on a shape whose candidate dim has a size no other dim has (never by a size
        # that happens to equal B). The fallback's replay takes the samples on dim 0 always.
        rule = layer.rule
        if self.batch_first or isinstance(rule, FallbackRule):
            return shared_layout(x, output)
        for dim in (1, 0):
            how = shared_layout(x, output, dim)
            shape = as_batch(torch.empty(x.shape, dtype=x.dtype, device="meta"), 1, how).shape
            if _reads_batch_at(layer, shape, x.dtype, dim):
                return how
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors((args, kwargs)))
        raise BatchSizeError(
            f"module {layer.describe()} is called on inputs that do not come from the batch "
            f"(shapes {shapes}), and its rule reads no batch dim gradhooks can add to them "
            f"(batch_first=False). " + _hint(layer.module, "Pass the inputs batched (e.g. "
                                                           "position ids expanded to (T, B)), "
                                                           "or keep the module frozen."))

    def _on_noted(self, sources: tuple, how: str, u_b: Optional[Tensor],
                  direct: Optional[int], dim: Optional[int]) -> None:
        # In the forward, where a shared call's output meets the batch (as u_b): the output-
        # edges pass of gh.backward asks for the gradient below u_b, so that autograd runs its
        # hook. A call on B rows whose output meets the batch only row by row, itself (an
        # initial state made from the batch size), is recorded as an ordinary call on its B
        # rows (no B x B expansion); any other meeting makes it B identical samples again.
        # (only a call whose output itself meets the batch, always by broadcasts that add the
        # batch dim as its record's layout does, or always row by row, can be planned)
        kinds = self._prov.kinds
        for s in sources:
            cap = s[0]
            fits = (how == "direct" or how == "broadcast" and self.batch_first
                    and direct == {"expand": 0, "prepend": 1}.get(cap.shared))
            if direct is None or not fits or kinds.setdefault(id(cap), how) != how:
                self._prov.plain.add(id(cap))
        if u_b is None:
            return
        self._meetings = True
        if self._driven:
            self._edges_complete &= mark(self, sources[0][0], [], u_b.grad_fn)
        for cap, _, _ in sources:
            if cap.spec is not None:
                continue
            layout = cap.shared
            if how == "direct" and layout.startswith("prepend") and not cap.met:
                # (its input has B rows, lined up with the batch where its output meets it)
                d = 1 if layout == "prepend1" else 0
                one = cap.a.select(d, 0) if cap.a.shape[d] else None
                if (one is not None and one.dim() > dim and one.shape[dim] == cap.a.shape[d]
                        and _reads_batch_at(cap.layer, one.shape, one.dtype, dim, self.batch_first)):
                    cap.a, cap.shared, cap.rows = one, "rows", layout
            elif how != "direct" and cap.shared == "rows":
                cap.a, cap.shared = as_batch(cap.a, cap.a.shape[0], cap.rows), cap.rows
            cap.met = True

    def _param_source(self, p: Tensor, info: tuple) -> Optional[Record]:
        # The record of a raw parameter at its first use in a tracked forward (provenance); or
        # a hooked layer's parameter read functionally by another module.
        layer, name = info
        if name is None:
            return self._demote(layer[0]) if len(layer) == 1 else None
        cap = Record(layer, Call((), {}, None, "param"), (name,), self._step,
                     flatten(p)[1], [None])
        cap.forward, cap.shared = self._forward_id, "param"
        self._calls += 1
        return cap

    def _demote(self, layer: Layer) -> None:
        # A hooked layer's parameter is read outside its forward (torchvision's Swin:
        # F.linear(x, self.qkv.weight) in the parent): from this forward on, its parent's
        # torch.func replay covers it (find_layers' ``demoted``); the parent's forward hook,
        # still to come in this forward, records it.
        if (self._layer_of.get(id(layer.module)) is not layer or not layer.path
                or isinstance(layer.rule, FallbackRule)):
            return None
        self._demoted.add(layer.path)
        self._resync = True  # (the next forward rebuilds every layer map with the demotion)
        parent_path = layer.path.rpartition(".")[0]
        parent = self.model.get_submodule(parent_path)
        old = self._layer_of.get(id(parent))
        params = dict(old.params) if old is not None else {}
        rel = layer.path[len(parent_path) + 1:] if parent_path else layer.path
        params.update((f"{rel}.{n}", p) for n, p in layer.params.items())
        new = Layer(parent_path, parent, FALLBACK, params)
        self.layers = [new if x is old else x for x in self.layers if x is not layer]
        if old is None:
            self.layers.append(new)
        del self._layer_of[id(layer.module)]
        self._layer_of[id(parent)] = new
        _HOOKED.pop(layer.module, None)
        _HOOKED[parent] = weakref.ref(self)
        warnings.warn(
            f"module {layer.describe()} has its parameters read outside its forward (by its "
            f"parent {new.describe()}, e.g. F.linear(x, self.{rel}.weight)); gradhooks covers "
            f"them with the torch.func fallback's replay of the parent", FallbackWarning,
            stacklevel=2)
        return None

    def _settle_params(self, prov: Provenance) -> None:
        # At the end of a tracked forward: a raw parameter whose uses all met the batch in ops
        # that split per sample takes its per-sample gradients from there, and its module's
        # torch.func replay drops it (a module left with no parameter to replay records
        # nothing); one that met the batch otherwise stays with the replay.
        for sources in prov.param_sources.values():
            cap = sources[0][0]
            name = cap.names[0]
            if self._refused.pop(id(cap), None) is not None:
                cap.names = ()
                continue
            for call in prov.fallback_calls:
                if call.layer.module is cap.layer.module:  # (the Layer may be a demotion's)
                    call.names = tuple(n for n in call.names if n != name)

    def _on_meeting(self, edge, sources: tuple, how: str, shape: tuple, grad: Tensor,
                    dim: int) -> None:
        # Tensor hook (gradhooks.provenance): the gradient of a source-carrying tensor where it
        # met the batch (on dim ``dim``); its per-sample part, pulled back to each source's
        # output.
        if utils.PAUSED or self._muted or not self._attached:
            return None
        if how == "direct" and sources[0][0].shared == "rows":
            if sources[0][0].step == self._step:
                self._receive(sources[0][0], None, grad)
            return None
        if how == "broadcast":
            grad = grad.movedim(dim, 0)
            b = grad.shape[0]
            cot = grad.reshape(b, *shape)
        else:  # rows: sample n's cotangent is row n (on dim ``dim`` of u) of the gradient
            b = shape[dim]
            cot = grad.new_zeros((b, *shape))
            idx = torch.arange(b, device=grad.device)
            if b:
                rows = cot.movedim(dim + 1, 1)  # (sample, row, ...): a view
                rows[idx, idx] = grad.reshape(shape).movedim(dim, 0)
        live = [s for s in sources if s[0].step == self._step]
        if not live:
            return None
        # (u itself is a source: its cotangent as it is; autograd would hand back the batched
        # grad_output unwrapped from its vmap)
        same = [e.node is edge.node and e.output_nr == edge.output_nr for _, e, _ in live]
        pulled = [cot if s else None for s in same]
        rest = [i for i, s in enumerate(same) if not s]
        if rest and b == 0:  # (autograd's batched grad needs a sample)
            for i in rest:
                pulled[i] = cot.new_zeros((0, *live[i][2]))
        elif rest:
            self._pulling = True  # (a raw parameter's gradient hooks see this pass: not theirs)
            try:
                got = torch.autograd.grad([edge], [live[i][1] for i in rest], [cot],
                                          retain_graph=True, allow_unused=True,
                                          is_grads_batched=True)
            finally:
                self._pulling = False
            for i, g in zip(rest, got):
                pulled[i] = g
        for (cap, _, _), g in zip(live, pulled):
            if g is not None:
                self._receive(cap, 0 if cap.spec is not None else None,
                              source_cotangent(g, cap.shared))
        return None

    def _refuse_shared(self, sources: tuple, message: str) -> None:
        # Sources met the batch in an op that is not split per sample: their reads raise.
        for cap, *_ in sources:
            self._refused.setdefault(id(cap), (cap, message))
            self._prov.plain.add(id(cap))

    def _on_model_forward(self, module: nn.Module, args, kwargs) -> None:
        if self._prov is not None:  # the model's forward calls the model again
            self._prov.depth += 1
            return
        if utils.PAUSED or not torch.is_grad_enabled() or in_backward():
            return  # records nothing; or a recomputation (checkpoint) of the current batch
        if (self._changed is not None or self._resync
                or any(p.requires_grad for p in self._unhooked)):
            self._sync()  # the model changed since attach: follow it
        self._forward_id += 1
        # A forward that will record starts a new batch: drop the last one's records here, not
        # at the first hooked layer's forward hook (after that layer's forward), so that they
        # are not held beside the new batch's first activations (about 3 MB more peak memory
        # on the Transformer block, whose first hooked layer is the attention).
        if self._backward_seen and args and not any(is_functorch_wrapped(t) for t in tensors(args)):
            self.clear()
        self._track(tensors((args, kwargs)), module.training)

    def _track(self, top: List[Tensor], training: bool) -> None:
        # Start the provenance of this forward (gradhooks.provenance) when its input signature
        # is new or had shared calls: the batch is what the top-level inputs carry on the batch
        # dim (batch_first=False: dim 1 of an input of 2 dims or more, torch's (T, B, ...)).
        self._plan, self._ordinals = None, {}
        first = next((t for t in top if t.dim() > 0), None)
        if first is None or any(is_functorch_wrapped(t) for t in top):
            return
        layout = 0 if self.batch_first else 1
        bdim = input_batch_dim(first, layout)
        key = (tuple((tuple(t.shape), t.dtype) for t in top), training)
        known = self._signatures.get(key)
        if isinstance(known, dict):  # (empty: no shared calls)
            self._plan, self._plan_b = known or None, first.shape[bdim]
            return
        # The top-level inputs are the batch (all of them: EmbeddingBag's offsets too); its size
        # is the first hooked call's on them (the first input's batch dim until then).
        owners: Dict[int, tuple] = {}  # (tied parameters have several)
        for layer in self.layers:
            for p in layer.params.values():
                owners[id(p)] = owners.get(id(p), ()) + (layer,)
        raw = {pid: (layers, None) for pid, layers in owners.items()}
        raw.update((pid, info) for pid, info in self._raw.items()
                   if info[0].params[info[1]].requires_grad)
        prov = Provenance(first.shape[bdim], layout, top, self._on_meeting, self._refuse_shared,
                          self._on_noted, raw, self._param_source)
        prov.fallback_calls = []  # this forward's records of modules that own raw parameters
        prov.shared_calls = []  # (record, (id(layer), k), layout) of this forward's shared calls
        prov.plain = set()  # ids of shared calls whose outputs are used otherwise (see _on_noted)
        prov.swapped = False  # a position-wise layer's records had their batch dim swapped
        prov.kinds = {}  # id(record) -> how its output meets the batch ("broadcast" / "direct")
        prov.signature, prov.depth = key, 1
        self._prov = prov
        prov.__enter__()

    def _on_grad_output(self, cap: Record, leaf: Optional[int], grads: tuple, nr: int) -> None:
        # grads[nr]: the gradient w.r.t. the recorded output tensor (see _on_grad).
        grad = grads[nr]
        if (utils.PAUSED or grad is None or self._muted or not self._attached
                or (id(cap), leaf) in self._captured):
            return None
        self._receive(cap, leaf, grad)
        return None

    def _receive(self, cap: Record, leaf: Optional[int], grad: Tensor) -> None:
        # Record a grad_output of ``cap`` (of output leaf ``leaf`` for multi_io rules).
        if not cap.names:  # (a replay whose raw parameters came from provenance)
            return
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
        if cap.swap is not None and leaf is None:  # (see _layout_swap)
            grad = relayout(grad, cap.swap)
        if grad.requires_grad and self._higher_order is None and not self.differentiable:
            self._higher_order = cap.layer.describe()
        if not cap.hits:  # the first grad_output this call receives
            self._records.append(cap)
        if grad.dtype in (torch.bfloat16, torch.float16):
            cap.low = grad.dtype
        if not self.differentiable:  # (else a create_graph pass's graph stays: differentiable reads)
            grad = grad.detach()
        if cap.shared is not None and leaf is None:
            # A shared call's parts arrive once per place it meets the batch: one grad_output
            # per backward pass is their sum.
            task = torch._C._current_graph_task_id()
            if cap.grads and cap.task == task:
                cap.grads[-1] = cap.grads[-1] + grad
                return
            cap.task = task
        cap.hits += 1
        if leaf is None:
            cap.grads.append(grad)
        else:
            prev = cap.grads[leaf]
            cap.grads[leaf] = grad if prev is None else prev + grad
        self._backward_seen = True
        if self._result is not None:
            self._drop_result()
        if self._listener is not None:
            self._listener.hit(cap)

    def _on_internal(self, cap: Record, saved: dict, grad_inputs: tuple,
                     grad_outputs: tuple) -> None:
        # Post-hook on a node a rule asked for (LayerRule.internal): sum its input gradients.
        if utils.PAUSED or self._muted or self._released or not self._attached:
            return None
        prev = saved.get("grad_inputs")
        new = tuple(None if t is None else t.detach() for t in grad_inputs)
        if prev is not None:
            new = tuple(b if a is None else a if b is None else a + b for a, b in zip(prev, new))
        saved["grad_inputs"] = new
        if self._listener is not None:
            self._listener.hit(cap)
        return None

    def _watch_param(self, p: nn.Parameter) -> None:
        # Gradient hook for the sum check, registered at the first forward in which ``p`` is
        # trainable (torch refuses hooks on tensors that do not require grad).
        if id(p) in self._watched:
            return
        self._watched.add(id(p))
        if p._backward_hooks is None:
            self._hooks_were_none.append(p)
        self._param_handles.append(p.register_hook(functools.partial(_param_grad,
                                                                     weakref.ref(self), id(p))))

    def _on_param_grad(self, pid: int, grad: Tensor) -> None:
        if utils.PAUSED or self._muted or not self._attached or self._pulling:
            return None
        total = self.totals.get(pid)
        if total is None:
            self.totals[pid] = GradTotal(grad)
        else:
            total.add(grad)
        self._param_passes[pid] = self._param_passes.get(pid, 0) + 1
        self._backward_seen = True  # (also when no hook ran: the next forward starts anew)
        return None

    # ------------------------------------------------------------------ what readers see
    @property
    def batch_id(self) -> int:
        """A number that changes whenever a batch starts (:meth:`reset_batch`: the first
        recording forward after a backward pass, :meth:`clear`, a consumed batch); equal for
        every backward pass through one forward (:mod:`gradhooks.accumulation` tells batches
        apart by it)."""
        return self._step

    @property
    def records(self) -> Tuple["Record", ...]:
        """The current batch's records that a backward pass reached, in the order reached."""
        return tuple(self._records)

    @property
    def released(self) -> bool:
        """Whether a read released this batch's records (``per_sample_grads()``'s default)."""
        return self._released

    @property
    def sum_check_state(self) -> Optional[str]:
        """How this batch's reads run the sum check: ``None`` (decided at the read by
        :attr:`sum_check`), ``"due"`` (:meth:`drive` computed autograd's parameter gradients for
        it) or ``"skip"`` (:meth:`drive` computed none)."""
        return self._sum_check

    @property
    def result(self) -> Optional[Dict[str, Tensor]]:
        """The per-sample gradients kept by :meth:`keep_result` for this batch, or ``None``."""
        return self._result

    def keep_result(self, result: Dict[str, Tensor]) -> Dict[str, Tensor]:
        """Keep ``result`` (the per-sample reader's) until the next backward pass or batch, when
        its tensors are offered to :attr:`pool`; returns it."""
        self._result = result
        return result

    def snapshot(self, read: str, *, records: Optional[List["Record"]] = None,
                 release: bool = False, sum_check: bool = True) -> "Batch":
        """The batch as a reader sees it, validated once.

        Args:
            read: the reading call, e.g. ``"per_sample_grad_norms()"``, for the messages.
            records: a subset of the records (a group two-pass clipping reduces during its
                backward); default: every record of the batch.
            release: the reader releases each record as it uses it (the records are gone for
                later reads, which then raise :class:`RecordsReleasedError`).
            sum_check: whether the read runs the sum check when it is due (counts as a read for
                :attr:`sum_check`); ``False`` for reads that check nothing (KFAC factors).

        Raises:
            RecordsReleasedError: if an earlier read released the records (or one that did
                failed), or a backward pass reached the hooked layers after that.
            NoBackwardError: if no backward pass reached a hooked layer in this batch.
            HigherOrderGradError: if a backward pass with ``create_graph=True`` did.
            GradientMismatchError: if a recorded input was modified in place since its forward.
        """
        # (A model that is itself a hooked layer, a cell called per time step, is a layer
        # called several times: its calls see the same samples.)
        forwards = len({cap.forward for cap in self._records})
        error = refusal(
            read, attached=self._attached, changed=self._changed, stale=self._stale,
            released=self._released, reached=len(self._records), calls=self._calls,
            backward_reached_params=bool(self.totals),
            forwards=forwards if self.forwards == "one" and id(self.model) not in self._layer_of
            else 1, higher_order=self._higher_order)
        if error is not None:
            raise error
        for cap, where in self._refused.values():
            raise BatchSizeError(
                f"module {cap.layer.describe()} is called on inputs that do not come from the "
                f"batch (a shared call: the same for every sample), and its output meets the "
                f"batch in {where}, which gradhooks cannot split per sample; {read} would be "
                f"wrong. Make the shared tensor meet the batch by broadcasting (+, *, where, "
                f"matmul, cat off the batch dim), or pass the module's inputs batched (B, ...)")
        records = tuple(self._records if records is None else records)
        for cap in records:
            cap.check_unmodified(read)
        checking = sum_check and bool(self.check) and self._sum_check != "skip"
        key = None
        if checking:
            structure = self._structure()
            if self._sum_check == "due" or self.sum_check.read_due(structure):
                key = structure
        if release:
            self._released = True
        return Batch(self, records, key, checking, self._check_passed, self.grad_scale())

    def grad_scale(self) -> float:
        """The loss scale ``S`` of the ``grad_scaler`` given to :func:`gradhooks.attach` (its
        current ``get_scale()``, the one the last ``scaler.scale(loss).backward()`` used), or
        ``1.0``: the recorded grad_outputs are ``S`` times those of the loss."""
        scaler = self.grad_scaler
        if scaler is None or not scaler.is_enabled():
            return 1.0
        return float(scaler.get_scale())

    def _check_passed(self, key: tuple) -> None:
        self.sum_check.passed(key, self._drive_key)
        self._sum_check = None

    def _structure(self) -> tuple:
        # What the sum check's verdict depends on: the calls and backward passes each module
        # received, and the passes in which autograd reached each parameter.
        calls = tuple((id(cap.layer), cap.names, cap.hits) for cap in self._records)
        return calls, tuple(sorted(self._param_passes.items()))

    @contextlib.contextmanager
    def muted(self) -> Iterator[None]:
        """Within this context the hooks record nothing (an ordinary backward pass through a
        batch whose records were consumed: two-pass clipping's second pass)."""
        self._muted = True
        try:
            yield
        finally:
            self._muted = False

    # ------------------------------------------------------------------ backward
    def drive(self, loss: Tensor, gradient: Optional[Tensor], retain_graph: bool,
              listen: Optional[Callable[[list, Dict[int, int]], object]] = None,
              create_graph: bool = False) -> bool:
        """The backward pass of :meth:`gradhooks.GradHooks.backward` (see its docstring): asks
        autograd for the hooked layers' output gradients (``GradientEdge`` inputs) instead of the
        parameters', except where the sum check is due (:meth:`SumCheck.edges_allowed`).

        Args:
            loss, gradient, retain_graph, create_graph: as for ``torch.autograd.grad``.
            listen: ``listen(records, events)``, called before an output-edges pass with the
                records below ``loss`` and the hook calls each will get; returns an object whose
                ``hit(record)`` is called on each of those calls during the pass (two-pass
                clipping forms norms as a layer's gradients come in). Not called where a shared
                call's output or a raw parameter met the batch in the forward (their parts come
                from hooks on the meeting operands, which the events do not count): the pass
                still asks for the output edges, and the reader takes the records at its end.

        Returns:
            Whether the pass asked for the output edges (else for the parameters, whose
            gradients go to the sum check of the next read).

        Raises:
            GradHooksError: if the pass must compute parameter gradients and none is trainable.
        """
        walked = walk(loss.grad_fn, self)
        if walked is None:
            raise GradHooksError(
                "GradHooks.backward(loss) cannot reach the layers inside a reentrant "
                "torch.utils.checkpoint (use_reentrant=True): their backward runs only within "
                "loss.backward(), which torch.autograd.grad does not call into. Use "
                "loss.backward() (exact, per-sample results as usual), or "
                "checkpoint(..., use_reentrant=False)")
        caps, captures, events = walked
        key = tuple((id(c.layer), c.names) for c in caps)
        # (two-pass clipping counts each record's hook calls from the tags: not those of the
        # meetings of shared calls, whose parts come from hooks on the meeting operands)
        edges_mode = (self.sum_check.edges_allowed(key) and self._edges_complete and bool(caps)
                      and walked is not None)
        if self._meetings:
            listen = None
        self._driven = True
        if edges_mode:
            self._sum_check = "skip"  # this batch's parameter gradients are incomplete
            self._captured = {(id(cap), leaf) for _, cap, leaf in captures}
            self._listener = None if listen is None else listen(caps, events)
            try:
                grads = torch.autograd.grad(loss, [e for e, _, _ in captures], gradient,
                                            retain_graph=retain_graph, allow_unused=True,
                                            create_graph=create_graph)
                for (_, cap, leaf), grad in zip(captures, grads):
                    if grad is not None and leaf != -1:
                        self._receive(cap, leaf, grad)
            finally:
                self._captured = frozenset()
                self._listener = None
        else:
            params = [p for p in self.params.values() if p.requires_grad]
            if not params:
                raise GradHooksError(
                    "GradHooks.backward: no hooked parameter requires grad; nothing to record")
            torch.autograd.grad(loss, params, gradient, retain_graph=retain_graph,
                                allow_unused=True, create_graph=create_graph)  # (gradient hooks
            # hand them to the sum check)
            if self.check and self._sum_check != "skip":
                self._sum_check = "due"
                self._drive_key = key if self._edges_complete else None
        return edges_mode
