"""Where the batch sits in one hooked call's tensors: the layout helpers of
:mod:`gradhooks.core.recorder.placement`.

A position-wise layer's records moved so that its rule reads the batch (:func:`layout_swap`,
:func:`relayout`: ``T == B`` layouts after a transpose, ``(B * T, D)`` rows, ``(B * nW, N, C)``
windows), the layout a shared call's samples take (:func:`shared_call_layout`), the rule probed on
``meta`` shapes whose candidate dim has a size no other dim has (:func:`reads_batch_at`), and the
errors and hints of calls that see only part of the batch.

Index conventions: ``B`` the batch size, ``T`` positions, ``D`` features.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from ...base.errors import BatchSizeError, GradHooksError
from ...base.segments import routed_layout
from ...base.utils import tensors
from ...rules.fallback import FallbackRule
from ..analysis import Provenance, Routed, as_batch, relayout, shared_layout
from .records import Layer

__all__ = ["relayout", "reads_batch_at", "partial_batch_hint", "layout_swap",
           "shared_call_layout", "recomputed_error"]

def reads_batch_at(layer: Layer, shape, dtype, dim: int, batch_first: bool = False) -> bool:
    """Whether ``layer``'s rule reads the batch of an input of ``shape`` from dim ``dim``.

    Asked on a ``meta`` tensor whose dim ``dim`` has a size no other dim has, so that a size
    that happens to equal ``B`` never decides (``T == B``). A rule that refuses the shape
    (:class:`GradHooksError`) reads it from nowhere: ``False``."""
    shape = list(shape)
    shape[dim] = max(shape) + 1
    try:
        return layer.rule.batch_size(layer.module, torch.empty(shape, dtype=dtype, device="meta"),
                                     batch_first) == shape[dim]
    except GradHooksError:
        return False


def partial_batch_hint(module: nn.Module, default: str) -> str:
    """What to do about a call that does not see the whole batch: for Opacus' DP RNN cells
    (``RNNLinear``: a DP LSTM's zero initial state made from sizes, and fewer samples at later
    steps of a ``PackedSequence``), use torch's recurrent layers; for any other module,
    ``default``."""
    if type(module).__module__.startswith("opacus."):
        return ("Opacus' DPLSTM / DPGRU / DPRNN run their cells on fewer samples at later time "
                "steps of a PackedSequence, and on an initial state made from sizes, so these "
                "calls cover only part of the batch: use torch's nn.LSTM / nn.GRU / nn.RNN "
                "(gradhooks' recurrent rule takes PackedSequence), or padded inputs.")
    return default


def layout_swap(prov: Provenance, layer: Layer, x: Tensor, batch_first: bool) -> Optional[tuple]:
    """How to lay out the records of a position-wise layer's call on ``x`` so that its rule
    reads the batch (:func:`relayout`'s ``how``), or ``None`` (as they are).

    For a layer (Linear, LayerNorm, Embedding ...) whose input carries the batch on another dim
    than the one its rule reads under the declared layout (a batch-first model that transposes
    to ``(T, B, D)`` inside, as FSMT does, or its ids to ``(T, B)``, as XLNet does), or merged
    into rows (OPT's ``(B * T, D)`` before its
    feed-forward), or rows gathered from the batch by an index (a mixture of experts' expert
    ``nn.Linear`` on the rows routed to it: :func:`~gradhooks.base.segments.routed_layout`). Decided by the batch dim
    ``prov`` followed from the inputs; with ``T == B``
    the declared layout would silently read the positions as samples. Marks ``prov.swapped``
    (such a signature is tracked on every forward: no plan)."""
    _, _, batch_dim = prov.look(x)
    if isinstance(batch_dim, tuple):  # samples merged with the dims after them: rows
        dim, inner = batch_dim
        if dim != 0 or not batch_first or x.shape[0] % inner:
            return None
        swap = ("split", 0, x.shape[0] // inner, inner)
        if not reads_batch_at(layer, relayout(x, swap).shape, x.dtype, 0, batch_first):
            return None
        prov.swapped = True
        return swap
    if isinstance(batch_dim, Routed):  # rows gathered by an index: laid out per sample
        if not batch_first or batch_dim.size != prov.batch_size or x.dim() < 2:
            return None
        swap = routed_layout(batch_dim.samples, batch_dim.size)
        if not reads_batch_at(layer, (batch_dim.size, swap[-1], *x.shape[1:]), x.dtype, 0,
                              batch_first):
            return None
        prov.swapped = True
        return swap
    positions = x.dim() - layer.rule.feature_dims  # (batch and positions: 2 for (T, B, D))
    want = 0 if batch_first or positions < 2 else 1  # (the Linear rule's convention)
    if not isinstance(batch_dim, int) or batch_dim == want or positions < 2:  # (no probe;
        # None: lost)
        return None
    if (reads_batch_at(layer, x.shape, x.dtype, batch_dim, batch_first)
            or not reads_batch_at(layer, x.shape, x.dtype, want, batch_first)):
        return None
    prov.swapped = True  # (its signature is tracked on every forward: no plan)
    return ("swap", batch_dim, want)


def fallback_dims(prov: Provenance, args: tuple, kwargs: dict, leaves: list,
                  batch_first: bool) -> Optional[tuple]:
    """``("dims", inputs, outputs)`` for a torch.func fallback call whose batched tensors carry
    the batch elsewhere than the declared layout says (the batch dim of each tensor leaf of
    ``(args, kwargs)`` and of the output ``leaves``, ``None`` for those the batch did not
    reach: :attr:`gradhooks.base.forms.Call.dims`), or ``None`` (the declared layout holds, or
    a batch dim is merged or lost). Marks ``prov.swapped`` (tracked on every forward)."""
    def dims_of(ts) -> Optional[list]:
        out = []
        for t in ts:
            d = prov.look(t)[2] if isinstance(t, Tensor) and prov.batched(t) else None
            if d is not None and not isinstance(d, int):
                return None
            out.append(d)
        return out

    inputs = tree_flatten((args, kwargs))[0]
    ins, outs = dims_of(inputs), dims_of(leaves)
    if ins is None or outs is None or not any(d is not None for d in ins):
        return None
    flat = inputs + list(leaves)
    if all(d is None or d == (0 if batch_first or t.dim() < 3 else 1)
           for t, d in zip(flat, ins + outs)):
        return None
    prov.swapped = True  # (its signature is tracked on every forward: no plan)
    return ("dims", tuple(ins), tuple(outs))


def shared_call_layout(layer: Layer, x: Tensor, output: Tensor, args, kwargs,
                       batch_first: bool) -> str:
    """Where a shared call's samples go (:func:`~gradhooks.core.analysis.provenance.shared_layout`):
    dim 0; with ``batch_first=False`` the dim the layer's rule reads the batch from, found by
    asking the rule on a shape whose candidate dim has a size no other dim has (never by a
    size that happens to equal ``B``: ``T == B``). The fallback's replay takes the samples
    on dim 0.

    Raises:
        BatchSizeError: if the rule reads the batch from neither dim 0 nor dim 1.
    """
    if batch_first or isinstance(layer.rule, FallbackRule):
        return shared_layout(x, output)
    for dim in (1, 0):
        how = shared_layout(x, output, dim)
        shape = as_batch(torch.empty(x.shape, dtype=x.dtype, device="meta"), 1, how).shape
        if reads_batch_at(layer, shape, x.dtype, dim):
            return how
    shapes = ", ".join(str(tuple(t.shape)) for t in tensors((args, kwargs)))
    raise BatchSizeError(
        f"module {layer.describe()} is called on inputs that do not come from the batch "
        f"(shapes {shapes}), and its rule reads no batch dim gradhooks can add to them "
        f"(batch_first=False). " + partial_batch_hint(
            layer.module, "Pass the inputs batched (e.g. position ids expanded to (T, B)), "
                          "or keep the module frozen."))


def recomputed_error(layer: Layer) -> BatchSizeError:
    """The error for a layer recomputed in the backward (a checkpointed region) after a
    shared call in its forward: a recomputation does not replay the meetings the shared
    call's per-sample part is taken from."""
    return BatchSizeError(
        f"module {layer.describe()} is recomputed in the backward pass (a checkpointed "
        f"region) after a call on shared inputs in its forward; gradhooks takes a shared "
        f"call's per-sample part where it meets the batch in the forward, which a "
        f"recomputation does not replay. Leave the layers that make position biases / "
        f"learned queries outside torch.utils.checkpoint")
