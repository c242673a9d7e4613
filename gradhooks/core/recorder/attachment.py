"""The model's side of a recorder: which modules and parameters are hooked, kept in step with
the model, and undone on detach.

A :class:`~gradhooks.core.recorder.capture.Recorder` hooks no module itself (its global module hooks filter by
module, :mod:`gradhooks.core.recorder.graph`); what it hooks is the map its :class:`Attachment` builds from
the model as it is now: the hooked :class:`~gradhooks.core.recorder.records.Layer` objects, their parameters,
each trainable parameter's gradient hook (the sum check's), and the process-wide registry of
hooked modules that refuses a second recorder on the same layer. The map is rebuilt at the
first forward after the model changed (a submodule or parameter replaced, a frozen parameter no
layer covers unfrozen, a layer demoted to its parent's replay).
"""
from __future__ import annotations

import functools
import warnings
import weakref
from typing import Dict, List, Optional

import torch
from torch import Tensor, nn

from ...base import utils
from ...base.errors import (
    FallbackWarning,
    FrozenModelWarning,
    GradHooksError,
    UnsupportedModuleError,
)
from ...base.torch_internals import (
    OptimizedModule,
    compiled_module,
    drop_empty_grad_hooks,
    grad_hooks,
    own_parameters,
)
from ...rules.fallback import FallbackRule, note_path
from ..analysis import user_line
from .records import Layer, find_layers, plain_state

__all__ = ["Attachment", "is_hooked", "hooker", "unwrap_compiled"]

# Modules currently hooked by a live recorder (to refuse a second attach to the same layer),
# each to a weak reference to it: a strong one would keep the recorder, its model and so the key
# alive for the rest of the process.
_HOOKED: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()

_MISSING = object()


def hooker(module: nn.Module):
    """The live recorder that hooks ``module``, or ``None``."""
    ref = _HOOKED.get(module)
    return None if ref is None else ref()


def is_hooked(model: nn.Module) -> bool:
    """Whether any module of ``model`` is hooked by a live recorder."""
    return any(hooker(m) is not None for m in model.modules())


def unwrap_compiled(model):
    """The module ``torch.compile(model)`` wraps (``OptimizedModule._orig_mod``), else ``model``.

    Compiled code calls the global module hooks of the module it wraps (as long as it is
    compiled after they exist: before its first call, or after ``torch._dynamo.reset()``), so
    hooking the original module and calling the compiled one is exact; hooking the wrapper
    itself makes dynamo trace the hooks and fail."""
    while isinstance(model, OptimizedModule):
        model = compiled_module(model)
    return model


def _script_modules(model: nn.Module) -> List[str]:
    # TorchScript modules with trainable parameters: their compiled forward runs no hooks.
    if isinstance(model, torch.jit.ScriptModule):
        found = [("", model)]
    else:
        found = []
        for path, m in model.named_modules():
            if isinstance(m, torch.jit.ScriptModule):
                found.append((path, m))
    return [f"{path or '<root>'!r} ({getattr(m, 'original_name', type(m).__name__)})"
            for path, m in found if any(p.requires_grad for p in m.parameters())]


def _hook_names(p: nn.Parameter) -> str:
    # The gradient hooks a user registered on ``p`` (``p.register_hook(fn)``), for messages.
    hooks = grad_hooks(p) or {}
    return ", ".join(getattr(fn, "__qualname__", type(fn).__name__) for fn in hooks.values())


def _param_grad(recorder: "weakref.ref", pid: int, grad: Tensor) -> None:
    # A parameter's gradient hook (Attachment.watch): holds its recorder weakly, as the global
    # hooks do, so that the model does not keep a dropped recorder alive.
    live = recorder()
    return None if live is None else live.backward_pass.on_param_grad(pid, grad)


#: Modules that only hold parameters, for their parent's forward to read (peft's IA3, VeRA and
#: LoKr adapters keep theirs in an ``nn.ParameterDict``): never called, so their parameters are
#: raw parameters of the forward, as a container's own are.
_HOLDERS = (nn.ParameterDict, nn.ParameterList)
#: Modules whose forward never runs (containers): a layer whose parameters another module
#: reads cannot be handed to such a parent's replay (:meth:`Attachment.demote`).
_CONTAINERS = (nn.ModuleDict, nn.ModuleList) + _HOLDERS


class Attachment:
    """The hooked modules and parameters of one recorder, built from its model.

    It keeps the recorder's layer maps (``recorder.layers``, ``names``, ``order``, ``params``
    and the hooks' ``_layer_of``) up to date; ``recorder`` is the
    :class:`~gradhooks.core.recorder.capture.Recorder` (duck-typed: this module sits below it).

    Attributes:
        params: ``{id(param): param}`` of the hooked parameters (the recorder's ``params``: the
            same dict, kept in place).
        param_handles: the parameters' gradient-hook handles (the recorder's global hooks remove
            them too if the recorder is collected while attached).
        raw_params: ``{id(param): (layer, name)}``: the raw parameters of containers (and of
            parameter holders, :data:`_HOLDERS`) on the
            fallback (ViT's class token, a block's layer scale), whose replay would run the
            children again; under provenance each is a source of its own, priced at its own
            ops (:meth:`gradhooks.core.recorder.placement.Placement.param_source`). A leaf module keeps its
            replay, which costs one call and checks per sample what the module computes.
        changed: what changed in the model since the last :meth:`sync` (a message), or
            ``None``.
    """

    def __init__(self, recorder):
        self._recorder = recorder
        self.params: Dict[int, nn.Parameter] = {}
        self.param_handles: list = []
        self.raw_params: Dict[int, tuple] = {}
        self.changed: Optional[str] = None
        self._hooks_were_none: List[nn.Parameter] = []  # params whose _backward_hooks we created
        self._saved_grad_sample: Dict[int, object] = {}  # a user's own grad_sample, restored
        self._watched: set = set()  # ids of params with a gradient hook (sum check)
        self._module_ids: set = set()  # ids of the model's modules (registration hooks)
        self._unhooked: List[nn.Parameter] = []  # frozen parameters no layer covers
        self._demoted: set = set()  # paths of layers their parent reads functionally
        self._resync = False  # a demotion: rebuild the maps at the next forward
        self._synced = False  # whether sync() ran once (the checks of attach)
        # {id(param): names} of user gradient hooks registered before ours: they run first, so
        # autograd's gradient the sum check sees is the one they changed (messages name them).
        self.hooks_ahead: Dict[int, str] = {}
        # A hooked parameter as its module holds it (module, name, param): a forward in which the
        # module holds another tensor ran under torch.func.functional_call (note_forward).
        self._witness: Optional[tuple] = None
        #: the module whose parameters the model's last forward replaced, or None.
        self.swapped: Optional[str] = None

    def needs_sync(self) -> bool:
        """Whether the model changed since :meth:`sync` (a submodule or parameter set, a layer
        demoted, a frozen parameter no layer covers made trainable): asked at each forward."""
        return (self.changed is not None or self._resync
                or any(p.requires_grad for p in self._unhooked))

    def sync(self) -> None:
        """(Re)build what is hooked from the model as it is now: at attach, and at the first
        forward after the model changed.

        Raises:
            UnsupportedModuleError: (from :func:`~gradhooks.core.recorder.records.find_layers`) for a module
                no rule handles under ``strict``, or one another live recorder hooks.
        """
        self.unsync()
        recorder = self._recorder
        model = recorder.model
        scripted = _script_modules(model)
        if scripted:
            raise UnsupportedModuleError(
                f"module {', '.join(scripted)} is a TorchScript module (torch.jit.script / "
                f"torch.jit.trace) with trainable parameters: its compiled forward runs no Python "
                f"hooks, so gradhooks would record none of its calls. Attach to the eager module "
                f"(script the model after gradhooks is done with it), or script only submodules "
                f"without trainable parameters")
        if not self._synced:
            self._synced = True
            self._check_trainable(model)
        recorder.names = {id(p): name for name, p in model.named_parameters()}
        recorder.order = {pid: i for i, pid in enumerate(recorder.names)}  # results in this order
        layers = recorder.layers = find_layers(
            model, recorder.strict, lambda m: hooker(m) not in (None, recorder), self._demoted,
            recorder.fallback)
        recorder.layer_of = {id(layer.module): layer for layer in layers}
        self.raw_params = {id(p): (layer, name) for layer in layers
                           if isinstance(layer.rule, FallbackRule)
                           and (next(layer.module.children(), None) is not None
                                or isinstance(layer.module, _HOLDERS))
                           for name, p in layer.params.items()}
        self._module_ids = {id(m) for m in model.modules()}
        for layer in layers:
            _HOOKED[layer.module] = weakref.ref(recorder)
            for p in layer.params.values():
                if id(p) in self.params:
                    continue  # tied: one hook per parameter
                self.params[id(p)] = p
                if recorder.check and p.requires_grad:
                    self.watch(p)  # also catches a module whose forward never runs
                value = p.__dict__.get("grad_sample", _MISSING)
                if value is not _MISSING:
                    self._saved_grad_sample[id(p)] = value
                p.__getstate__ = functools.partial(plain_state, p)  # (see plain_state)
        self._unhooked = [p for p in model.parameters() if id(p) not in self.params]
        self._witness = next(((layer.module, name, p) for layer in layers
                              for name, p in layer.params.items()
                              if own_parameters(layer.module).get(name) is p), None)
        self.changed = None
        self._resync = False

    def unsync(self) -> None:
        """Undo what :meth:`sync` did to the parameters (gradient hooks, ``grad_sample``,
        ``__getstate__``) and the hooked-module registry."""
        for h in self.param_handles:
            h.remove()
        self.param_handles.clear()
        for p in self._hooks_were_none:
            drop_empty_grad_hooks(p)
        self._hooks_were_none.clear()
        self._watched.clear()
        self.hooks_ahead.clear()
        for pid, p in self.params.items():
            if pid in self._saved_grad_sample:
                p.grad_sample = self._saved_grad_sample[pid]
            else:
                p.__dict__.pop("grad_sample", None)
            p.__dict__.pop("__getstate__", None)
        self._saved_grad_sample.clear()
        self.params.clear()
        for layer in self._recorder.layers:
            if hooker(layer.module) is self._recorder:
                del _HOOKED[layer.module]

    def _check_trainable(self, model: nn.Module) -> None:
        # At attach: a model without parameters has nothing to hook (refused); a frozen one
        # records nothing until a parameter is made trainable (warned).
        params = list(model.parameters())
        if not params:
            raise GradHooksError(
                f"attach: the model ({type(model).__name__}) has no parameters, so there is "
                f"nothing to hook and no per-sample gradient to compute. Attach the model whose "
                f"parameters are trained (for gradients w.r.t. inputs use torch.autograd.grad or "
                f"torch.func.vmap(torch.func.grad(...)))")
        if not any(p.requires_grad for p in params):
            warnings.warn(
                f"attach: no parameter of the model ({type(model).__name__}) requires grad "
                f"(requires_grad_(False) on all of them), so nothing is recorded and reads will "
                f"find no backward pass; make the parameters to train trainable "
                f"(requires_grad_(True)), before or after attach", FrozenModelWarning,
                stacklevel=5)

    def note_forward(self) -> None:
        """At each top-level forward of the model: note in :attr:`swapped` whether a hooked
        module holds other tensors than its parameters (``torch.func.functional_call(model,
        params, x)`` swaps them in for the call); autograd then computes the gradients of those
        tensors, not of the parameters the sum check watches. One lookup per forward."""
        witness = self._witness
        if witness is None or utils.PAUSED:
            return
        module, name, p = witness
        held = own_parameters(module).get(name)
        self.swapped = None if held is p else (
            f"{next(layer.describe() for layer in self._recorder.layers if layer.module is module)}"
            f" held {'a tensor' if held is not None else 'nothing'} other than its parameter "
            f"{name!r}")

    def on_registration(self, module: nn.Module, name: str, value) -> None:
        """A parameter or submodule ``value`` is set on some ``module`` (a global hook): if it
        is one of the model's, the maps are stale (:attr:`changed`)."""
        if id(module) in self._module_ids and self.changed is None:
            self.changed = f"{type(value).__name__} {name!r} set on {type(module).__name__}"

    def watch(self, p: nn.Parameter) -> None:
        """Register the sum check's gradient hook on ``p`` (once), at the first forward in
        which it is trainable (torch refuses hooks on tensors that do not require grad)."""
        if id(p) in self._watched:
            return
        self._watched.add(id(p))
        if grad_hooks(p):
            self.hooks_ahead[id(p)] = _hook_names(p)
        if grad_hooks(p) is None:
            self._hooks_were_none.append(p)
        self.param_handles.append(p.register_hook(functools.partial(
            _param_grad, weakref.ref(self._recorder), id(p))))

    def demote(self, layer: Layer) -> Optional[str]:
        """A hooked layer's parameter is read outside its forward (torchvision's Swin:
        ``F.linear(x, self.qkv.weight)`` in the parent): from this forward on, its parent's
        ``torch.func`` replay covers it (:func:`~gradhooks.core.recorder.records.find_layers`' ``demoted``);
        the parent's forward hook, still to come in this forward, records it. Warns with a
        :class:`FallbackWarning`. Returns why it cannot be (a layer on the fallback itself:
        timm's ``self.rel_pos.get_bias()`` in MaxViT), or ``None``."""
        recorder = self._recorder
        layer_of = recorder.layer_of
        if layer_of.get(id(layer.module)) is not layer or not layer.path:
            return None
        parent_path = layer.path.rpartition(".")[0]
        parent = recorder.model.get_submodule(parent_path)
        if isinstance(layer.rule, FallbackRule) or isinstance(parent, _CONTAINERS):
            # (a container's forward never runs: nothing would replay it, peft's DoRA reading
            # lora_A.default.weight, held in a ModuleDict, inside its magnitude module's forward)
            return (f"module {layer.describe()} has its parameters read outside its forward"
                    f"{user_line()} (by another module: a method of it other than forward, or "
                    f"its parameters used "
                    f"functionally), where gradhooks cannot split them per sample. Give the "
                    f"module that reads them a rule that claims them (gradhooks.register_rule), "
                    f"or call the module itself")
        self._demoted.add(layer.path)
        layer.demoted = recorder.forward_id  # (its calls of this forward: the parent's replay's)
        self._resync = True  # (the next forward rebuilds every layer map with the demotion)
        old = layer_of.get(id(parent))
        params = dict(old.params) if old is not None else {}
        rel = layer.path[len(parent_path) + 1:] if parent_path else layer.path
        params.update((f"{rel}.{n}", p) for n, p in layer.params.items())
        new = Layer(parent_path, parent, recorder.fallback, params)
        note_path(parent, parent_path)
        recorder.layers = [new if x is old else x for x in recorder.layers if x is not layer]
        if old is None:
            recorder.layers.append(new)
        del layer_of[id(layer.module)]
        layer_of[id(parent)] = new
        _HOOKED.pop(layer.module, None)
        _HOOKED[parent] = weakref.ref(recorder)
        warnings.warn(
            f"module {layer.describe()} has its parameters read outside its forward"
            f"{user_line()} (by its parent {new.describe()}, e.g. F.linear(x, self.{rel}.weight)); gradhooks covers "
            f"them with the torch.func fallback's replay of the parent", FallbackWarning,
            stacklevel=2)
        return None
