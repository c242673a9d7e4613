"""The general fallback: exact per-sample gradients of any module through ``torch.func``.

A module that owns trainable parameters but has no dedicated rule (a custom layer with a raw
``nn.Parameter``, ``nn.PReLU``, a learned scale ...) is covered by replaying it per sample: with
``x_n`` sample ``n``'s slice of every batched input and ``g_n`` its slice of every grad_output,
the per-sample gradient of the module's own parameters ``θ`` is the vector-Jacobian product
(the functorch recipe of ``torch.func``'s per-sample-gradient tutorial; Opacus' functorch mode)::

    dL_n/dθ = vjp(θ ↦ module(x_n; θ), g_n)        for every n, vectorised with torch.func.vmap

Each sample is replayed as a batch of one (``x_n`` keeps a batch dim of size 1), so modules that
read ``x.shape[0]`` or expect a batch dim work unchanged.

Assumptions (documented in the README):

* The module treats the samples of a batch independently: output sample ``n`` depends only on
  input sample ``n``. A module that mixes samples (batch statistics, attention across the batch)
  gets each sample's replayed gradient, which then differs from its share of the batch
  gradient; the sum check (``check=True``) detects this and raises ``GradientMismatchError``.
* Every input and output tensor that carries the batch has it on the batch dim (dim 0, or dim 1
  for inputs of 3 or more dims with ``batch_first=False``) with size ``B``; other tensor inputs
  are broadcast to every sample. An output reached by the backward without such a batch dim
  raises :class:`~gradhooks.base.errors.BatchSizeError`.
* The forward is deterministic (no dropout in training mode): ``torch.func.vmap`` refuses random
  operations, which is reported as :class:`~gradhooks.base.errors.UnsupportedCallError`.
* Only the module's own (direct) parameters are differentiated; its submodules are replayed with
  their parameters held fixed and get their per-sample gradients from their own rules.

Cost: one vmapped forward and vjp of the module per read (about what ``torch.func`` costs).
"""
from __future__ import annotations

import warnings
import weakref
from typing import Dict, Iterable, List

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..base.errors import BatchSizeError, FallbackWarning, UnsupportedCallError
from ..base.registry import Call, LayerRule
from ..base.utils import paused

__all__ = ["FallbackRule", "FALLBACK", "note_container"]


def _batch_dim(t: Tensor, batch_first: bool) -> int:
    return 0 if batch_first or t.dim() < 3 else 1


class FallbackRule(LayerRule):
    """Any module: per-sample vjp of the module's own parameters with ``torch.func.vmap``.

    ``a`` is the recorded :class:`~gradhooks.base.forms.Call`; ``g`` the output structure with the
    grad_output of each output tensor (``(B, ...)`` on the batch dim). Returns
    ``{name: (B, *param.shape)}`` for each of the module's own trainable parameters.
    """

    multi_io = True

    def params_of(self, module: nn.Module) -> Dict[str, nn.Parameter]:
        return dict(module.named_parameters(recurse=False))

    def batch_size(self, module: nn.Module, x, batch_first: bool) -> int:
        if not isinstance(x, Tensor) or x.dim() == 0:
            raise BatchSizeError(
                f"the torch.func fallback reads the batch size from the first input, a tensor "
                f"with a batch dim; got {type(x).__name__}"
                f"{tuple(x.shape) if isinstance(x, Tensor) else ''}"
            )
        return x.shape[_batch_dim(x, batch_first)]

    def per_sample_grads(self, module: nn.Module, a: Call, g, batch_first: bool,
                         names: Iterable[str]) -> Dict[str, Tensor]:
        names = tuple(names)
        if a.shared == "param":  # a raw parameter's own cotangents (gradhooks.core.provenance)
            return {names[0]: g}
        _warn_container(module, names)
        in_leaves, in_spec = tree_flatten((a.args, a.kwargs))
        g_leaves, _ = tree_flatten(g)
        reached = [i for i, t in enumerate(g_leaves) if isinstance(t, Tensor)]
        if a.shared is not None:
            # A call on inputs that are the same for every sample (Call.shared): the one call's
            # vjp, vmapped over the samples' grad_outputs only; the first input as it was.
            first = next(i for i, t in enumerate(in_leaves) if isinstance(t, Tensor))
            x = in_leaves[first]
            in_leaves[first] = x[0] if a.shared == "prepend" else x[:1]
            batched, keep_dims = [], a.shared == "prepend"
        else:
            if a.dims is not None:  # (the batch dims provenance followed: Call.dims)
                in_dim, out_dim = list(a.dims[0]), list(a.dims[1])
                # A tensor the batch did not reach but sized B on the batched inputs' dim (made
                # from sizes and expanded, as XLNet's positions are): sample n's call reads its
                # index n, as in the batched forward.
                d0 = next(d for d in in_dim if d is not None)
                b0 = next(t.shape[d] for t, d in zip(in_leaves, in_dim) if d is not None)
                in_dim = [d0 if d is None and isinstance(t, Tensor) and t.dim() > d0
                          and t.shape[d0] == b0 else d for t, d in zip(in_leaves, in_dim)]
            else:
                in_dim = [_batch_dim(t, batch_first) if isinstance(t, Tensor) else None
                          for t in in_leaves]
                out_dim = [_batch_dim(t, batch_first) if isinstance(t, Tensor) else None
                           for t in g_leaves]
            first = next(i for i, t in enumerate(in_leaves) if isinstance(t, Tensor)
                         and in_dim[i] is not None)
            if a.dims is None:
                b = self.batch_size(module, in_leaves[first], batch_first)
            else:
                b = in_leaves[first].shape[in_dim[first]]
            batched = [i for i, t in enumerate(in_leaves) if isinstance(t, Tensor) and t.dim() > 0
                       and in_dim[i] is not None and t.shape[in_dim[i]] == b]
            keep_dims = False
            for i in reached:
                t = g_leaves[i]
                if t.dim() == 0 or out_dim[i] is None or t.shape[out_dim[i]] != b:
                    raise BatchSizeError(
                        f"output {i} of the module has shape {tuple(t.shape)} without a batch dim "
                        f"of size {b}; the torch.func fallback needs every output the loss uses to "
                        f"be batched like the input"
                    )
        own = {n: module.get_parameter(n).detach() for n in names}

        def in_dim_of(i: int) -> int:  # (a shared call's samples are on dim 0)
            return 0 if a.shared is not None else in_dim[i]

        def out_dim_of(i: int) -> int:
            return 0 if a.shared is not None else out_dim[i]

        def one(params, xs: List[Tensor], gs: List[Tensor]):
            leaves = list(in_leaves)
            for i, x in zip(batched, xs):
                leaves[i] = x.unsqueeze(in_dim_of(i))
            args, kwargs = tree_unflatten(leaves, in_spec)

            differentiable = []  # (the reached outputs that can have a gradient: not the
            # indices a router's top-k returns, whose grad_output is zeros at most)

            def f(p):
                out_leaves, _ = tree_flatten(functional_call(module, p, tuple(args), kwargs))
                differentiable[:] = [k for k, i in enumerate(reached)
                                     if out_leaves[i].is_floating_point() or out_leaves[i].is_complex()]
                return [out_leaves[reached[k]] for k in differentiable]

            _, pull = vjp(f, params)
            return pull([gs[k] if keep_dims else gs[k].unsqueeze(out_dim_of(reached[k]))
                         for k in differentiable])[0]

        xs = [in_leaves[i] for i in batched]
        gs = [g_leaves[i] for i in reached]
        in_dims = (None, [in_dim_of(i) for i in batched], [out_dim_of(i) for i in reached])
        try:
            with paused(), torch.enable_grad():
                out = vmap(one, in_dims=in_dims)(own, xs, gs)
        except RuntimeError as e:
            if "randomness" in str(e):
                raise UnsupportedCallError(
                    f"the torch.func fallback cannot replay a random forward ({e}); put the module "
                    f"in eval mode or move its dropout out of it"
                ) from None
            raise
        return {n: out[n].detach().contiguous() for n in names}


_WARNED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
_PATHS: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()


def note_container(module: nn.Module, path: str) -> None:
    """Remember a container's path in its model, for the warning of its first replay."""
    _PATHS[module] = path


def _warn_container(module: nn.Module, names: tuple) -> None:
    """A :class:`~gradhooks.base.errors.FallbackWarning` the first time a module with children is
    replayed for its own (raw) parameters: :func:`~gradhooks.core.records.find_layers` names leaf
    modules at ``attach``, but a container's raw parameters are usually taken at their own ops
    (:mod:`gradhooks.core.provenance`), so only a replay that really runs is reported."""
    names = [n for n in names if "." not in n]  # (children's weights read by the parent
    if not names or next(module.children(), None) is None or module in _WARNED:  # warned of)
        return
    _WARNED.add(module)
    warnings.warn(
        f"gradhooks replays the module {_PATHS.get(module, '?') or '<root>'!r} "
        f"({type(module).__qualname__}) with its torch.func fallback "
        f"(vmap of the module's vjp per sample, children included) for its own parameters "
        f"{', '.join(names)}: they meet the batch in an op gradhooks does not split per sample. "
        f"Exact only if the module treats the samples of a batch independently (see "
        f"gradhooks.rules.fallback).", FallbackWarning, stacklevel=4)


#: The one instance the hook manager uses for modules without a rule.
FALLBACK = FallbackRule()
