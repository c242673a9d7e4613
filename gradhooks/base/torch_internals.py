"""Every torch internal gradhooks reads, named once, with the torch versions it was checked on.

gradhooks hooks autograd and ``nn.Module`` from the outside; a few of the things it reads are not
torch's public API. They are read from here (the attributes of autograd nodes listed in
:data:`SAVED` are read where the node is, by these names), so that a torch release that moves
one fails :func:`check` -- at ``import gradhooks`` with a :class:`~gradhooks.base.errors.GradHooksError`
naming it, and in ``tests/test_torch_internals.py`` -- instead of a user's run.

Versions: :data:`RUN_ON` are the releases the suite (or its CI slice) ran on; :data:`SEEN_SINCE`
the first of the releases whose source was read (2.1.0, 2.4.1, 2.10.0, 2.13.0, 2.14.1, 2.15.0:
their wheels' ``torch/*.py`` and ``torch/_C/*.pyi``) that has the internal. The tested floor,
:data:`FLOOR`, is ``install_requires``' lower bound (setup.cfg). Older releases miss what
:func:`check` names: 2.4.1 has no ``with_kwargs`` global forward hooks (nor a public
``DTensor``), 2.1.0 neither those nor the engine frame.
"""
from __future__ import annotations

import inspect
import sys
import types
from typing import Any, Dict, Optional, Tuple

import torch
import torch.autograd.graph as _autograd_graph
from torch.nn.modules import module as torch_module

from .errors import GradHooksError

__all__ = ["FLOOR", "RUN_ON", "SEEN_SINCE", "ENGINE_FRAME", "GLOBAL_HOOK_FLAGS", "SAVED",
           "PRIVATE_ATTRIBUTES", "PRIVATE_MODULES", "torch_module", "current_autograd_node", "current_graph_task_id",
           "storage_use_count", "is_functorch_wrapped", "grouped_mm", "OptimizedModule",
           "DTensor", "Partial", "distribute_tensor", "missing", "check",
           "VF", "OpOverload", "aten", "EMBEDDING_BAG_OPS", "getframe", "current_frames", "saved", "version",
           "is_view", "storage_handle", "own_parameters", "own_buffers", "compiled_module",
           "grad_hooks", "drop_empty_grad_hooks", "NUMPY_KEYWORDS", "canonical_kwargs", "post_accumulate_grad_hooks",
           "drop_empty_post_accumulate_grad_hooks", "autograd_nodes_made", "own", "graph_ops",
           "reached"]

#: The lowest torch the suite ran on (``install_requires`` in setup.cfg says the same).
FLOOR = "2.13.0"
#: Releases the tests ran on: the suite (2.13.0, ``make test``) and the CI slice
#: (``make test-newest``, 2.14.1). 2.15.0 was not run: docs/development.md says why.
RUN_ON = ("2.13.0", "2.14.1")

#: The frame of ``torch.autograd.graph._engine_run_backward``, the function
#: ``Tensor.backward`` and ``torch.autograd.grad`` call the C++ engine from: the frame walk of
#: :mod:`gradhooks.core.analysis.backward_losses` finds the loss of a backward pass above it.
ENGINE_FRAME = "_engine_run_backward"

#: The flags torch keeps beside a global forward hook under its handle's id
#: (``torch.nn.modules.module``), removed with the hook (:func:`gradhooks.core.recorder.graph.remove_handles`).
GLOBAL_HOOK_FLAGS = ("_global_forward_hooks_with_kwargs", "_global_forward_hooks_always_called")

#: ``torch._C._current_autograd_node()``: the node the engine is running (the output-edges
#: pass checks it is the one it tagged; :mod:`gradhooks.core.recorder.backward_pass`).
current_autograd_node = getattr(torch._C, "_current_autograd_node", None)
#: ``torch._C._current_graph_task_id()``: ``-1`` outside a backward pass (a forward inside one
#: is a checkpoint's recomputation; one id per backward call).
current_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
#: ``torch._C._storage_Use_Count``: the references to a storage (the buffer pool reuses a
#: result nothing references; :mod:`gradhooks.base._pool`).
storage_use_count = getattr(torch._C, "_storage_Use_Count", None)
#: ``torch._C._functorch.is_functorch_wrapped_tensor`` (a ``torch.func`` transform's tensor:
#: the hooks stand aside); a release without it has no such tensors to meet.
is_functorch_wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor",
                               lambda x: False)
#: ``torch._grouped_mm`` (MoE experts' grouped products; ``None`` where torch has none).
grouped_mm = getattr(torch, "_grouped_mm", None)

#: ``torch.compile``'s wrapper (its ``_orig_mod`` is the model; :mod:`gradhooks.core.recorder.attachment`).
from torch._dynamo.eval_frame import OptimizedModule  # noqa: E402

#: FSDP2's sharded tensors (:mod:`gradhooks.readers.distributed`); ``None`` where
#: ``torch.distributed.tensor`` does not export them (2.4.1) or torch has no distributed build.
try:
    from torch.distributed.tensor import DTensor, Partial, distribute_tensor
except ImportError:  # (refused where used: no DTensor parameter can exist then)
    DTensor = Partial = distribute_tensor = None

#: ``torch._VF`` (the recurrent kernels: :mod:`gradhooks.core.analysis.batch_dims` marks their
#: calls), ``torch._ops.OpOverload`` (an aten op's type) and ``torch.ops.aten`` (whose private
#: ``_embedding_bag`` ops the kinks tool watches): :data:`PRIVATE_MODULES`.
VF = torch._VF
OpOverload = torch._ops.OpOverload
aten = torch.ops.aten
#: embedding_bag's private aten ops (mode 2 is "max": the kinks tool watches its picks).
EMBEDDING_BAG_OPS = (aten._embedding_bag, aten._embedding_bag_forward_only)

#: CPython's frame access (``sys._getframe``, ``sys._current_frames``; the builtins themselves,
#: so a depth counts from the caller as with ``sys``): the engine-frame walk of
#: :mod:`gradhooks.core.analysis.backward_losses`, the user line of messages and the call's
#: keyword arguments (:func:`gradhooks.core.recorder.graph.call_kwargs`).
getframe = sys._getframe
current_frames = sys._current_frames


def saved(node: Any, name: str, *default: Any) -> Any:
    """``node._saved_<name>``: a saved attribute of an autograd node (:data:`SAVED` lists the
    node types and names read; ``default``, as for ``getattr``, where it may be absent)."""
    return getattr(node, "_saved_" + name, *default)


_PROBE = torch.zeros((), requires_grad=True)


def autograd_nodes_made() -> int:
    """How many autograd nodes this thread has made (``Node._sequence_nr()``, torch's per-thread
    counter, of a node made for the purpose): the difference of two readings around a forward
    is how many differentiable ops it ran, plus one. Only with grad mode on (there is no node
    otherwise)."""
    return _PROBE.view(()).grad_fn._sequence_nr()


#: The key gradhooks sets in the ``metadata`` dict (public: ``torch.autograd.graph.Node``) of an
#: autograd node it made itself in a forward (:func:`own`), which :func:`graph_ops` skips.
OWN = "gradhooks_own"
_OWN_TYPES: set = set()  # the node types own() marked (graph_ops reads the metadata of those)


def own(result: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """``result``, a view or expand gradhooks made of ``source`` in a forward (a shared call's
    output handed to the batch, an output aliased), with the autograd nodes between them marked
    as gradhooks' own: not the model's ops (:func:`graph_ops`)."""
    node, stop = result.grad_fn, source.grad_fn
    while node is not None and node is not stop and node.next_functions:
        node.metadata[OWN] = True
        _OWN_TYPES.add(type(node))
        node = node.next_functions[0][0]
    return result


def graph_ops(tensors, span: Tuple[int, int], nodes: tuple = ()) -> Tuple[int, int]:
    """``(count, fingerprint)`` of the autograd nodes numbered in ``span`` (``[start, end)`` of
    :func:`autograd_nodes_made` readings around a forward) that the graphs of ``tensors`` hold,
    less those gradhooks made (:func:`own`): the model's differentiable ops its outputs depend
    on, whichever of gradhooks' forwards ran it (analysed or planned). The fingerprint hashes
    the node types in the order of a depth-first walk from ``tensors``, which follows the
    graph's edges, with the dims each node's op ran along (its saved ``dim`` / ``dims`` /
    ``dim0`` / ``dim1`` / ``keepdim`` arguments: ``h.mean(0)`` is not ``h.mean(1)``,
    ``h.flip(0)`` not ``h.flip(1)``): another op in place of one (same count), or the same op
    along another dim, changes it. Nodes made before the span are not walked past. Cost: a
    Python step per node (about 1 µs; GPT-2 small's 707 nodes take 0.7 ms)."""
    start, end = span
    stack = [t.grad_fn for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    stack.extend(nodes)  # (autograd nodes to walk from, as the tensors' grad_fn)
    seen: set = set()
    count = fingerprint = 0
    own_types, dims_of = _OWN_TYPES, _DIMS
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        number = node._sequence_nr()
        if number < start:
            continue
        kind = type(node)
        if number < end and not (kind in own_types and OWN in node.metadata):
            count += 1
            dims = dims_of.get(kind)
            if dims is None:
                dims = dims_of[kind] = tuple(a for a in dir(kind)
                                             if a.startswith("_saved_") and "dim" in a)
            fingerprint = hash((fingerprint, kind, _dims(node, dims) if dims else None))
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return count, fingerprint


def reached(tensors, nodes: tuple, targets: set) -> set:
    """Which of the autograd nodes ``targets`` the graphs of ``tensors`` (and of the nodes
    ``nodes``) hold: a walk that does not go below the lowest sequence number of the targets
    (a node's inputs were made before it)."""
    if not targets:
        return set()
    low = min(t._sequence_nr() for t in targets)
    stack = [t.grad_fn for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    stack.extend(nodes)
    seen: set = set()
    while stack:
        node = stack.pop()
        if node in seen or node._sequence_nr() < low:
            continue
        seen.add(node)
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return seen & targets


#: node type -> the names of its saved dim arguments (graph_ops; autograd's ``_saved_<name>``)
_DIMS: Dict[type, tuple] = {}


def _dims(node, names: tuple) -> tuple:
    # The saved dim arguments of ``node`` as graph_ops hashes them (a list as a tuple; a tensor,
    # or one autograd cannot give, as None: not a dim; anything else unhashable by its repr).
    values = []
    for name in names:
        try:
            value = getattr(node, name)
        except Exception:  # (freed, or a type autograd's binding cannot convert)
            value = None
        value = (tuple(value) if isinstance(value, list) else
                 None if isinstance(value, torch.Tensor) else value)
        try:
            hash(value)
        except TypeError:
            value = repr(value)
        values.append(value)
    return tuple(values)


def version(t: torch.Tensor) -> int:
    """``t._version``: the counter torch bumps at each in-place change of ``t``'s data."""
    return t._version


def is_view(t: torch.Tensor) -> bool:
    """``t._is_view()``: whether ``t`` is a view of another tensor's storage."""
    return t._is_view()


def storage_handle(t: torch.Tensor) -> int:
    """``t.untyped_storage()._cdata``: the handle :data:`storage_use_count` takes."""
    return t.untyped_storage()._cdata


def own_parameters(module: torch.nn.Module) -> Dict[str, Optional[torch.Tensor]]:
    """``module._parameters``: the parameters ``module`` registers itself (not its
    submodules'), the dictionary itself (faster than ``nn.Module.__getattr__``)."""
    return module._parameters


def own_buffers(module: torch.nn.Module) -> Dict[str, Optional[torch.Tensor]]:
    """``module._buffers``: the buffers ``module`` registers itself, the dictionary itself
    (the fallback's replay restores it)."""
    return module._buffers


def compiled_module(model: torch.nn.Module) -> torch.nn.Module:
    """``model._orig_mod``: the module an :data:`OptimizedModule` (``torch.compile``) wraps."""
    return model._orig_mod


def grad_hooks(t: torch.Tensor) -> Optional[dict]:
    """``t._backward_hooks``: the hooks of ``t.register_hook`` (``None`` before the first)."""
    return t._backward_hooks


def drop_empty_grad_hooks(t: torch.Tensor) -> None:
    """Set ``t._backward_hooks`` back to ``None`` where it is empty (as before a first hook:
    a tensor that never had one pickles and deep-copies as before)."""
    if not t._backward_hooks:
        t._backward_hooks = None


def post_accumulate_grad_hooks(t: torch.Tensor) -> Optional[dict]:
    """``t._post_accumulate_grad_hooks``: the hooks of ``t.register_post_accumulate_grad_hook``
    (``None`` before the first)."""
    return t._post_accumulate_grad_hooks


def drop_empty_post_accumulate_grad_hooks(t: torch.Tensor) -> None:
    """Set ``t._post_accumulate_grad_hooks`` back to ``None`` where it is empty."""
    if not t._post_accumulate_grad_hooks:
        t._post_accumulate_grad_hooks = None


#: numpy's keyword names that torch's argument parser takes for its own in every C-bound
#: function and ``Tensor`` method (``numpy_compatibility_arg_names`` in
#: ``torch/csrc/utils/python_arg_parser.cpp``): ``x.mean(axis=2, keepdims=True)``. Its input
#: names (``x``, ``a``, ``x1``, ``x2``) are left: a few functions have a parameter named ``x``.
NUMPY_KEYWORDS = {"axis": "dim", "keepdims": "keepdim"}
_C_BOUND = (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType)


def canonical_kwargs(func: Any, kwargs: Optional[dict]) -> dict:
    """``kwargs`` of a call of ``func`` seen by a ``TorchFunctionMode``, with the numpy names
    torch's parser binds (:data:`NUMPY_KEYWORDS`) under torch's own, so that the analyses read
    ``dim`` where the user wrote ``axis``. A new dict where one is renamed; the call is the same."""
    if not kwargs:
        return {}
    if not isinstance(func, _C_BOUND) or not any(k in NUMPY_KEYWORDS for k in kwargs):
        return kwargs
    return {NUMPY_KEYWORDS[k] if k in NUMPY_KEYWORDS and NUMPY_KEYWORDS[k] not in kwargs else k: v
            for k, v in kwargs.items()}


#: Saved attributes of autograd nodes read by name (``node._saved_<name>``, :func:`saved`), per node type:
#: the loss nodes whose reduction, target and weight say how the loss of a backward pass is
#: reduced (:mod:`gradhooks.core.analysis.backward_losses`, :mod:`gradhooks.readers.loss_reduction`) and
#: the indexing / transpose / select nodes of routed rows and experts' weights
#: (:mod:`gradhooks.core.analysis.rows`). (Attention's ``ScaledDotProduct*Backward0._saved_output`` is
#: read too, optionally: without it the attention rule replays the call; the mean / division
#: nodes' ``self`` / ``other`` of a loss's scale likewise, by :func:`saved` with a default.)
SAVED: Dict[str, Tuple[str, ...]] = {
    "NllLossBackward0": ("reduction", "target", "weight", "ignore_index", "self"),
    "MseLossBackward0": ("reduction", "self", "target"),
    "MeanBackward0": ("self_sym_sizes",),
    "DivBackward0": ("other",),
    "IndexBackward0": ("indices",),
    "TransposeBackward0": ("dim0", "dim1"),
    "SelectBackward0": ("dim", "index"),
    # the loss graph's table (core.analysis.loss_graph; a node whose value is gone is refused)
    "SumBackward1": ("dim", "keepdim"),
    "LogsumexpBackward0": ("dim", "keepdim"),
    "SoftmaxBackward0": ("dim",),
    "FlipBackward0": ("dims",),
    "PermuteBackward0": ("dims",),
    "SliceBackward0": ("dim", "start", "end", "step"),
    "GatherBackward0": ("dim",),
    "SplitBackward0": ("dim",),
    "CatBackward0": ("dim",),
    "StackBackward0": ("dim",),
    "BinaryCrossEntropyWithLogitsBackward0": ("reduction",),
    "NativeLayerNormBackward0": ("normalized_shape",),
    "NativeBatchNormBackward0": ("training",),
}

#: Private attributes of torch objects read or written by name (object: attributes; the
#: modules reading them): ``nn.Module._parameters`` / ``_buffers`` (the records, the fallback's
#: replay), ``Tensor._version`` (in-place changes after a forward), ``Tensor._backward_hooks`` /
#: ``_post_accumulate_grad_hooks`` (attachment, accumulation), ``UntypedStorage._cdata`` (the
#: pool), ``OptimizedModule._orig_mod`` (a compiled model's module).
PRIVATE_ATTRIBUTES: Dict[str, Tuple[str, ...]] = {
    "nn.Module": ("_parameters", "_buffers"),
    "Tensor": ("_version", "_is_view", "_backward_hooks", "_post_accumulate_grad_hooks"),
    "Node": ("_sequence_nr", "_input_metadata"),
    "UntypedStorage": ("_cdata",),
    "OptimizedModule": ("_orig_mod",),
}

#: torch's private modules imported by name elsewhere (module: the names taken from it):
#: pytree walks of args and outputs (base.utils, core, readers, rules), the functions that mark a
#: recurrent call (``torch._VF``) or an aten op (``torch._ops.OpOverload``; core.analysis.batch_dims),
#: and the dispatch mode of the kinks tool (tools.kinks).
PRIVATE_MODULES: Dict[str, Tuple[str, ...]] = {
    "torch.utils._pytree": ("tree_flatten", "tree_map", "tree_unflatten"),
    "torch._VF": ("lstm", "gru", "rnn_tanh", "rnn_relu", "lstm_cell", "gru_cell",
                  "rnn_tanh_cell", "rnn_relu_cell"),
    "torch._ops": ("OpOverload",),
    "torch.ops.aten": ("_embedding_bag", "_embedding_bag_forward_only"),
    "sys": ("_getframe", "_current_frames"),
    "torch.utils._python_dispatch": ("TorchDispatchMode",),
}

#: First release (of those read: module docstring) with each internal.
SEEN_SINCE = {
    "torch.autograd.graph._engine_run_backward": "2.4.1",
    "torch.nn.modules.module._global_forward_hooks_with_kwargs": "2.10.0",
    "register_module_forward_hook(with_kwargs=, always_call=)": "2.10.0",
    "torch.nn.modules.module._global_forward_hooks_always_called": "2.1.0",
    "torch._C._current_autograd_node": "2.4.1",
    "torch._C._current_graph_task_id": "2.1.0",
    "torch._C._storage_Use_Count": "2.1.0",
    "torch._C._functorch.is_functorch_wrapped_tensor": "2.1.0",
    "torch._grouped_mm (optional)": "2.10.0",
    "torch._dynamo.eval_frame.OptimizedModule": "2.1.0",
    "torch.distributed.tensor.DTensor (optional)": "2.10.0",
}


def missing() -> Dict[str, str]:
    """``{internal: what breaks without it}`` for each required internal this torch lacks
    (empty on every release in :data:`RUN_ON`)."""
    out = {}
    if not hasattr(_autograd_graph, ENGINE_FRAME):
        out[f"torch.autograd.graph.{ENGINE_FRAME}"] = (
            "the frame the loss of a backward pass is found above (loss_reduction checks)")
    for name in GLOBAL_HOOK_FLAGS:
        if not isinstance(getattr(torch_module, name, None), dict):
            out[f"torch.nn.modules.module.{name}"] = "the flags removed with the global hooks"
    params = inspect.signature(torch.nn.modules.module.register_module_forward_hook).parameters
    if not {"with_kwargs", "always_call"} <= set(params):
        out["register_module_forward_hook(with_kwargs=, always_call=)"] = (
            "the global forward hook every layer is recorded by")
    for name in ("_current_autograd_node", "_current_graph_task_id", "_storage_Use_Count"):
        if not hasattr(torch._C, name):
            out[f"torch._C.{name}"] = "the backward pass's bookkeeping"
    return out


def check() -> None:
    """Raise :class:`~gradhooks.base.errors.GradHooksError` naming each internal this torch
    lacks (:func:`missing`), the torch version, the tested range and the way out.

    Raises:
        GradHooksError: on a torch without one of them (e.g. 2.4.1: the ``with_kwargs``
            global forward hooks).
    """
    gone = missing()
    if gone:
        listed = "; ".join(f"{k} ({v})" for k, v in gone.items())
        raise GradHooksError(
            f"gradhooks needs torch internals that torch {torch.__version__} lacks: {listed}. "
            f"gradhooks is tested on torch {FLOOR} to {RUN_ON[-1]}: "
            f"pip install 'torch>={FLOOR}'")


check()  # (at import: a torch without one of them fails here, by name, not in a user's run)
