"""The hook plumbing of the recorder: global module hooks, grad_output pre-hooks, and the tags
and graph walk that :meth:`gradhooks.GradHooks.backward` uses to ask autograd for the hooked layers' output
gradients instead of the parameters' (``torch.autograd.grad`` with
:class:`torch.autograd.graph.GradientEdge` inputs).
"""
from __future__ import annotations

import functools
import warnings
import weakref
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from ...base.errors import NotDetachedWarning
from ...base.torch_internals import GLOBAL_HOOK_FLAGS, current_graph_task_id, getframe, torch_module

__all__ = ["GlobalHooks", "module_hooks", "remove_handles", "warn_not_detached", "call_kwargs",
           "on_grad", "tag", "mark", "walk", "in_backward", "TAG", "RECOMPUTING"]

#: Autograd nodes whose backward runs a forward again and differentiates it on its own
#: (``torch.utils.checkpoint`` with ``use_reentrant=True``): the hooked layers inside are not
#: in the graph :func:`walk` sees, so the output-edges pass cannot reach them.
RECOMPUTING = frozenset({"CheckpointFunctionBackward"})


def _accumulate_grad_type() -> type:
    x = torch.zeros(1, requires_grad=True)
    return type((x * 1).grad_fn.next_functions[0][0])


_ACCUMULATE_GRAD = _accumulate_grad_type()  # autograd's node of a leaf: nothing below it
TAG = "gradhooks"
_RAISED = object()  # key of the entries drive() finds in autograd nodes' metadata



def on_grad(t: Tensor, fn) -> None:
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


class GlobalHooks:
    """The entries one owner put in torch's process-wide module hook dictionaries
    (``torch.nn.modules.module._global_*``), and their removal.

    :meth:`remove` deletes exactly these entries -- the hooks and the flags torch keeps beside
    them (``_global_forward_hooks_with_kwargs``, ``_global_forward_hooks_always_called``) --, and
    never another owner's: torch's handle ids are unique in the process. (torch 2.13's
    ``RemovableHandle`` of a ``with_kwargs=True`` global forward hook leaves its
    ``_global_forward_hooks_with_kwargs`` flag behind: one entry per attachment, for the rest of
    the process.) When nothing holds hooks, the dictionaries are empty again and every module
    call of the process takes torch's hook-free fast path.

    If the owner is garbage-collected before :meth:`remove`, the entries are removed then, with
    the handles in ``also`` (a list the owner keeps filling: its tensor hooks), and a
    :class:`~gradhooks.base.errors.NotDetachedWarning` naming ``what``.
    """

    def __init__(self, owner, handles: list, what: str, also: list):
        self.handles = handles
        self._finalizer = weakref.finalize(owner, _collected, handles, also, what)
        self._finalizer.atexit = False  # (live at exit: the process's end removes everything)

    def remove(self) -> None:
        """Remove the entries (a second call does nothing)."""
        self._finalizer.detach()
        remove_handles(self.handles)


def module_hooks(owner, *, pre: Callable, post: Callable, done: Callable,
                 registration: Callable, what: str, also: list) -> GlobalHooks:
    """Register torch's global module hooks for ``owner`` and return them as a
    :class:`GlobalHooks`: ``pre(owner, module, args)`` before every module's forward (torch's
    global pre-hooks get no keyword arguments: :func:`call_kwargs` reads them),
    ``post(owner, module, args, kwargs, output)`` after it (what it returns, if not ``None``,
    replaces the output), ``done(owner, module)`` instead when the forward raised (``post`` sees
    the ends of forwards that returned), ``registration(owner, module, name, value)`` when a
    parameter or submodule is set on any module. Global hooks filtered by module, instead of
    hooks on the model's modules, leave the model itself without hooks (``deepcopy`` / ``pickle``
    of it are plain). They hold ``owner`` weakly and are removed when it is collected, with the
    handles in ``also`` (:class:`GlobalHooks`; ``what`` names the owner in the warning)."""
    me = weakref.ref(owner)

    def on_pre(module, args):
        live = me()
        if live is not None:
            pre(live, module, args)

    def on_post(module, args, kwargs, output=_RAISED):
        # (torch calls an always-called hook with (module, args, result) when forward raised)
        live = me()
        if live is None:
            return None
        if output is _RAISED:
            done(live, module)
            return None
        return post(live, module, args, kwargs, output)

    def on_registration(module, name, value):
        live = me()
        if live is not None:
            registration(live, module, name, value)

    handles = [register_module_forward_pre_hook(on_pre),
               register_module_forward_hook(on_post, with_kwargs=True, always_call=True),
               register_module_parameter_registration_hook(on_registration),
               register_module_module_registration_hook(on_registration)]
    return GlobalHooks(owner, handles, what, also)


def call_kwargs() -> dict:
    """The keyword arguments of the module call whose ``pre`` hook (:func:`module_hooks`) is
    running: the local ``kwargs`` of torch's ``Module._call_impl`` frame that called the hook
    (two frames above ``pre``); ``{}`` where torch calls hooks otherwise. Call it from ``pre``
    itself, and only for the modules that need it (it reads a frame)."""
    kwargs = getframe(3).f_locals.get("kwargs")
    return kwargs if isinstance(kwargs, dict) else {}


def remove_handles(handles: list) -> None:
    """Remove torch hook handles, global or not, with the flags torch keeps beside global
    forward hooks under the same id (which its ``RemovableHandle`` may leave behind)."""
    for h in handles:
        h.remove()
        for name in GLOBAL_HOOK_FLAGS:
            getattr(torch_module, name).pop(h.id, None)


def warn_not_detached(what: str) -> None:
    """Issue the :class:`~gradhooks.base.errors.NotDetachedWarning` of an attachment that was
    garbage-collected while attached (``what`` names it)."""
    warnings.warn(f"{what} was garbage-collected without detach(); its hooks are removed now. "
                  f"Call detach(), or attach in a `with` statement.", NotDetachedWarning)


def _collected(handles: list, also: list, what: str) -> None:
    # The owner of global hooks was garbage-collected without removing them.
    warn_not_detached(what)
    remove_handles(handles + also)


def mark(owner, record, outputs: list, internal) -> bool:
    """Tag, for :func:`walk`, the autograd nodes of a record's ``outputs`` (``[(tensor, leaf)]``)
    and the rule's ``internal`` node (whose inputs the output-edges pass asks gradients for, so
    that autograd runs that node and its post-hook). Returns ``False`` (nothing tagged) if an
    output is a leaf tensor, which the walk cannot find: the batch then takes the parameter
    pass."""
    for t, _ in outputs:
        if t.grad_fn is None:
            return False
    for t, leaf in outputs:
        tag(t.grad_fn, (owner, record, leaf, t.output_nr))
    if internal is not None:
        tag(internal, (owner, record, -1, None))
    return True


def in_backward() -> bool:
    """True inside an autograd backward pass: a forward running now is a recomputation
    (``torch.utils.checkpoint``) of the batch being differentiated."""
    return current_graph_task_id() != -1


def tag(node, entry: tuple) -> None:
    """Tag the autograd ``node`` with ``entry = (owner, record, leaf, output_nr)`` for
    :func:`walk`; the tag lives in the node's metadata dict and goes with the graph."""
    node.metadata.setdefault(TAG, []).append(entry)


def walk(root, owner) -> Optional[Tuple[list, List[tuple], Dict[int, int]]]:
    """The graph below ``root`` as :meth:`gradhooks.core.recorder.capture.Recorder.drive` needs it: the records
    whose nodes ``owner`` tagged (:func:`tag`), in the order of a depth-first walk from the loss, the
    edges to ask autograd for, ``[(GradientEdge, capture, leaf)]``, and ``{id(capture):
    number of its tags}`` (the hook calls a pass gives it); ``None`` if the graph holds a
    :data:`RECOMPUTING` node (then only ``loss.backward()`` reaches every hooked layer).

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
            if type(node).__name__ in RECOMPUTING:
                return None  # layers inside run their forward again in the backward
            nexts = kids[node] = [n for n, _ in node.next_functions
                                  if n is not None and type(n) is not leaf_node]
            entries = node.metadata.get(TAG)
            if entries:
                mine = [e for e in entries if e[0] is owner]
                if mine:
                    tags[node] = mine
            todo = [n for n in nexts if n not in kids]
            if todo:
                stack.extend(todo)
                continue
        stack.pop()
        if node not in below:  # (a node reached twice is finished once)
            below[node] = any(n in tags or below[n] for n in nexts)
    caps: Dict[int, object] = {}
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
