"""The forward side of a recorder: what runs when the model's forward starts, and the recording
of each hooked layer's call (the hot path: it runs on every call, so its Python calls are kept to
what the bookkeeping needs: one to the placement, none per call beyond it).

Per call: the :class:`~gradhooks.core.recorder.placement.Placement` says where the batch sits (an ordinary
call, batched under tracking with a relayout, shared, or planned); this module keeps the
batch size ``B`` (the first call of a batch sets it, the others must see it), builds the
:class:`~gradhooks.core.recorder.records.Record` and registers the hooks through which the backward pass
delivers its grad_outputs (:class:`~gradhooks.core.recorder.backward_pass.BackwardPass`).
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ...base import utils
from ...base.errors import BatchSizeError, GradHooksError
from ...base.forms import Call
from ...base.torch_internals import own
from ...base.utils import detached, flatten, is_functorch_wrapped, tensors
from ...rules.fallback import FallbackRule
from .graph import in_backward, mark, on_grad
from .placement import BATCHED, MERGED, SHARED, partial_batch_hint, recomputed_error, relayout
from .records import Layer, Record, expand_call, shared_lookup

__all__ = ["ForwardPass"]


class ForwardPass:
    """The forward side of one recorder (``recorder``: the
    :class:`~gradhooks.core.recorder.capture.Recorder`, whose batch state it fills; duck-typed: this module
    sits below it). The recorder wraps :meth:`record_call` and :meth:`model_forward` in
    ``torch.compiler.disable`` and calls them from its global module hooks."""

    def __init__(self, recorder):
        self._recorder = recorder

    def record_call(self, layer: Layer, module: nn.Module, args, kwargs, output) -> None:
        """Record one call of the hooked ``layer`` (``module``, with ``args``, ``kwargs`` and
        ``output``): ask the placement where the batch sits, check the batch size, build the
        :class:`~gradhooks.core.recorder.records.Record` and hook its output's autograd node. Returns the
        output to hand downstream instead of ``output`` (a shared call expanded to ``B``
        identical samples), or ``None``.

        Raises:
            BatchSizeError: if the call sees another batch size than the batch's, or is a shared
                call gradhooks cannot split (:meth:`~gradhooks.core.recorder.placement.Placement.record_shared`)
                or one recomputed in the backward.
            GradHooksError: if the layer's rule refuses the call (prefixed with the module).
        """
        # Hot path: runs for every call of every hooked layer, so attribute lookups and Python
        # calls are kept to what the bookkeeping needs (hooks attached but nothing read cost
        # little more than the plain forward + backward; benchmarks/peers.py "hooks only").
        # The placement says where the batch sits (None: an ordinary call); this builds the
        # record and keeps the batch size.
        if utils.PAUSED or not torch.is_grad_enabled():
            return
        recorder = self._recorder
        rule = layer.rule
        leaves = None
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
        alias = None if rule.multi_io or not names else _unviewed(output)
        if alias is not None:  # (handed on instead of the output: kept under in-place ops)
            output = alias
        if names and recorder.backward_pass.spans.outside():  # (provenance does not follow it)
            recorder.backward_pass.outside_call(layer, module, args, output, x)
        placement = recorder.placement
        try:
            if layer.validates:
                rule.check_call(module, args, kwargs, recorder.options)
            if not names:
                return
            placed = placement.place(layer, x, output, leaves, args, kwargs)
            prov = placement.provenance
            if placed is not None and prov is not None:  # (tracked)
                prov.retag(rule.output_dims(module, args, output, lambda t: prov.look(t)[2]))
            swap = dims = None
            if placed is None:
                b = rule.call_batch_size(module, args, kwargs, recorder.batch_first)
            elif placed.kind is BATCHED and placed.swap is not None and placed.swap[0] == "dims":
                dims = placed.swap[1:]  # (a fallback call: its replay takes the batch there)
                b = next(t.shape[d] for t, d in zip(tree_flatten((args, kwargs))[0], dims[0])
                         if d is not None)
            elif placed.kind is BATCHED:
                swap = placed.swap
                if swap is not None:  # (recorded with the batch where the rule reads it)
                    x = relayout(x, swap)
                    args = (x, *args[1:])
                b = rule.call_batch_size(module, args, kwargs, recorder.batch_first)
            else:
                b = None
        except GradHooksError as e:
            raise type(e)(f"module {layer.describe()}: {e}") from None
        if recorder.check and not layer.watched:
            for n in names:
                recorder.attachment.watch(layer.params[n])
            layer.watched = len(names) == len(layer.items)
        if recorder.backward_seen and not in_backward():  # (a recomputation: this batch's)
            recorder.clear()
        if placed is None:
            if id(layer) in placement.shared_layers and in_backward():
                raise recomputed_error(layer)
            # a lookup of one row in a forward whose batch has more (records.shared_lookup):
            # handed downstream expanded to the batch
            shared = (b == 1 and recorder.batch_size is not None and recorder.batch_size > 1
                      and recorder.forward_id == recorder.batch_forward
                      and shared_lookup(x, output, recorder.batch_first))
            if shared:
                b = recorder.batch_size
                x, output, args, kwargs = expand_call(b, x, output, args, kwargs)
                if rule.multi_io:
                    leaves, spec = flatten(output)
                    reached = [0]
        elif placed.kind is SHARED:
            placement.record_shared(layer, args, kwargs, output, names, x, placed.ordinal)
            return alias
        elif placed.kind is MERGED:  # (a fallback on (B * n, ...) rows: its parameters' ops)
            placement.merged_call(layer, names)
            return alias
        elif placed.kind is BATCHED:
            shared = False
        else:  # planned: a shared call its signature's tracked forward planned
            shared = True
            b = (recorder.batch_size if recorder.batch_size is not None
                 and recorder.batch_forward == recorder.forward_id else placed.size)
            x, output, args, kwargs = expand_call(b, x, output, args, kwargs, placed.layout)
            placement.shared_layers.add(id(layer))
            if rule.multi_io:
                leaves, spec = flatten(output)
                reached = [0]
        if b != recorder.batch_size:
            self._set_batch_size(b, layer, module, args, kwargs)
        tracked = placed is not None and placed.kind is BATCHED
        if tracked:
            placement.batched_call(b)
        recorder.calls += 1
        aliased = False
        if (rule.multi_io and isinstance(rule, FallbackRule) and len(reached) > 1
                and not isinstance(output, Tensor)):
            # Outputs of a replayed module handed on as aliases, so that each one's grad_output is
            # what the code after the module sends it: an output the module also used itself (a
            # router's logits, from which it took its top-k weights; a layer's output that an
            # encoder feeds to its next layer and also returns in hidden_states, in a
            # ModelOutput) would otherwise bring that use's gradient too, and the replay's vjp,
            # which recomputes the use, would count it twice.
            leaves = [own(leaves[i].view_as(leaves[i]), leaves[i]) if i in reached else t
                      for i, t in enumerate(leaves)]
            output, aliased = tree_unflatten(leaves, spec), True
        elif rule.multi_io and len(reached) > 1:
            # One tensor at several places of the output (transformers' DebertaV2Encoder: the
            # last hidden state and hidden_states[-1]): its node's gradient is that of all its
            # uses, taken once, at its first place (hooked at each, the replay counted it twice)
            first: dict = {}
            for i in reached:
                first.setdefault(id(leaves[i]), i)
            reached = sorted(first.values())
        if rule.multi_io:
            # Output leaves that carry no gradient but structure (a PackedSequence's batch_sizes
            # and indices) are kept so that the grad structure rebuilds; the others start as None.
            fill = [t if isinstance(t, Tensor) and not t.is_floating_point() and not t.is_complex()
                    else None for t in leaves]
            found = rule.internal(module, args, kwargs, output)
            node = None if found is None else found[0]
            record = Record(layer, Call(detached(tuple(args)), detached(dict(kwargs)),
                                        None if found is None else found[1], dims=dims),
                            names, recorder.batch_id, spec, fill)
            record.forward, record.swap = recorder.forward_id, swap  # (an Embedding's ids)
            if tracked:
                placement.batched_record(record)
            if node is not None:
                node.register_hook(functools.partial(recorder.on_internal, record, found[1]))
            for i in reached:
                on_grad(leaves[i], functools.partial(recorder.on_grad_output, record, i))
            if recorder.driven:
                recorder.edges_complete &= mark(recorder, record,
                                                 [(leaves[i], i) for i in reached], node)
        else:
            record = Record(layer, x if recorder.differentiable else x.detach(), names,
                            recorder.batch_id)
            record.forward, record.swap = recorder.forward_id, swap
            on_grad(output, functools.partial(recorder.on_grad_output, record, None))
            if recorder.driven:
                recorder.edges_complete &= mark(recorder, record, [(output, None)], None)
        return output if shared or aliased else alias

    def _set_batch_size(self, size: int, layer: Layer, module: nn.Module, args, kwargs) -> None:
        # A call whose batch size is not the batch's: the first of a batch sets it (after
        # dropping an earlier forward that no backward reached); any other in the same forward
        # is refused (BatchSizeError), with the fix for calls that see part of the batch.
        recorder = self._recorder
        if (recorder.batch_size is not None and recorder.forward_id != recorder.batch_forward
                and not in_backward()):
            recorder.reset_batch()  # an earlier forward that no backward reached: drop it
        if recorder.batch_size is None:
            recorder.batch_size, recorder.batch_source = size, layer.describe()
            recorder.batch_forward = recorder.forward_id
            return
        prov = recorder.placement.provenance
        lost = next(iter(prov.unproven.values()), None) if prov is not None else None
        x = args[0] if args and isinstance(args[0], Tensor) else None
        merged = prov is not None and x is not None and isinstance(prov.look(x)[2], tuple)
        hint = partial_batch_hint(module, (
            f"its input holds the batch merged with the dim after it ((B * n, ...) rows, as "
            f"PatchTST's channels), which its rule ({type(layer.rule).__name__}) does not read "
            f"(position-wise layers do: Linear, LayerNorm, Embedding); keep the batch on a dim "
            f"of its own there, or give the module a rule (gradhooks.register_rule)." if merged
            else f"the forward ran ops before this call whose batch dim gradhooks could not "
            f"follow, the first: {lost[1]}; a rule (gradhooks.register_rule) for the module "
            f"that runs them is the way out." if lost is not None else
            "check the input layout, or pass batch_first=False for (T, B, ...) inputs."))
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors((args, kwargs)))
        raise BatchSizeError(
            f"module {layer.describe()} sees batch size {size} (inputs {shapes}), but "
            f"{recorder.batch_source} saw "
            f"{recorder.batch_size} in the same forward. Per-sample gradients need every hooked "
            f"layer to see the whole batch on the batch dim (batch_first={recorder.batch_first}); "
            + hint
        )

    def model_forward(self, module: nn.Module, args, kwargs) -> None:
        """The model's own forward starts (the recorder's pre-hook): follow the model if it
        changed (:meth:`~gradhooks.core.recorder.attachment.Attachment.needs_sync`), start a batch if the last
        one was read, and let the placement track or plan this forward."""
        recorder = self._recorder
        if recorder.placement.nest():  # the model's forward calls the model again
            return
        if utils.PAUSED or not torch.is_grad_enabled() or in_backward():
            return  # records nothing; or a recomputation (checkpoint) of the current batch
        if recorder.attachment.needs_sync():
            recorder.sync()  # the model changed since attach: follow it
        recorder.forward_id += 1
        # A forward that will record starts a new batch: drop the last one's records here, not
        # at the first hooked layer's forward hook (after that layer's forward), so that they
        # are not held beside the new batch's first activations (about 3 MB more peak memory
        # on the Transformer block, whose first hooked layer is the attention).
        if (recorder.backward_seen and args
                and not any(is_functorch_wrapped(t) for t in tensors(args))):
            recorder.clear()
        recorder.placement.start(tensors((args, kwargs)), module.training)


def _unviewed(output: Tensor):
    """``output`` as a tensor autograd does not track as a view, where it is a view of a whole
    ``addmm`` result (ATen's ``linear`` on ``(B, T, d)`` returns ``addmm(...).view(B, T, O)``,
    as transformers' ``Conv1D`` does); else ``None``.

    An in-place op on the output (``nn.ReLU(inplace=True)`` after the layer) rebases a view
    onto its base, and the view's own autograd node, whose pre-hook records the grad_output
    (:func:`~gradhooks.core.recorder.graph.on_grad`), leaves the graph: the layer's grad_output
    never arrived. ``aten._unsafe_view`` of it is the same memory (no copy) under a node of its
    own that stays in the graph, as a non-view's does. No saved tensor sees the in-place write
    unversioned: ``AddmmBackward0`` saves the product's operands, not its result. The alias
    carries the output's Python attributes (provenance's tag), and its node is gradhooks' own
    (:func:`~gradhooks.base.torch_internals.own`)."""
    base = output._base
    if (base is None or base.numel() != output.numel() or base.grad_fn is None
            or type(base.grad_fn).__name__ != "AddmmBackward0"):
        return None
    with torch._C.DisableTorchFunction():
        alias = torch.ops.aten._unsafe_view(output, output.shape)
    alias.__dict__.update(output.__dict__)
    return own(alias, output)
