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
  gradient; the replay's verification (:mod:`gradhooks.rules.fallback_replay`, whatever
  ``check`` says) detects this and raises :class:`~gradhooks.base.errors.ReplayMismatchError`.
* Every input and output tensor that carries the batch has it on the batch dim (dim 0, or dim 1
  for inputs of 3 or more dims with ``batch_first=False``) with size ``B``; other tensor inputs
  are broadcast to every sample. An output reached by the backward without such a batch dim
  raises :class:`~gradhooks.base.errors.BatchSizeError`.
* The forward is deterministic (no dropout in training mode): ``torch.func.vmap`` refuses random
  operations, which is reported as :class:`~gradhooks.base.errors.UnsupportedCallError`.
* Only the module's own (direct) parameters are differentiated; its submodules are replayed with
  their parameters held fixed and get their per-sample gradients from their own rules.

Where ``vmap`` cannot replay the module (any exception from inside the transform), it is
replayed sample by sample with plain autograd, or refused with
:class:`~gradhooks.base.errors.ReplayError` (:mod:`gradhooks.rules.fallback_replay`).

Cost: one vmapped forward and vjp of the module per read (about what ``torch.func`` costs), plus
one batched forward and backward of the module (the verification, on every read:
``benchmarks/results/replay_verify.md``, +11-15% of the step on torchvision's Swin-T, whose
windowed attention is replayed, -2% to +7% on BART's replayed positional embeddings).
"""
from __future__ import annotations

import warnings
import weakref
from typing import Dict, Iterable, List, Optional

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..base.errors import (
    BatchSizeError,
    FallbackWarning,
    GradHooksError,
    ReplayError,
    UnsupportedCallError,
)
from ..base.registry import Call, LayerRule
from ..base.utils import paused, state_kept
from .fallback_replay import (
    Replay,
    cause_of,
    looped,
    structure,
    verify,
    way_out,
)

__all__ = ["FallbackRule", "FALLBACK", "UNVERIFIED_FALLBACK", "note_path"]


def _batch_dim(t: Tensor, batch_first: bool) -> int:
    return 0 if batch_first or t.dim() < 3 else 1


class FallbackRule(LayerRule):
    """Any module: per-sample vjp of the module's own parameters with ``torch.func.vmap``.

    ``a`` is the recorded :class:`~gradhooks.base.forms.Call`; ``g`` the output structure with the
    grad_output of each output tensor (``(B, ...)`` on the batch dim). Returns
    ``{name: (B, *param.shape)}`` for each of the module's own trainable parameters.
    """

    multi_io = True
    positional_grads = True  # (g's leaves paired with the replay's output leaves by position)

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

    def __init__(self, verify_replay: bool = True):
        #: Whether every replay is verified (:func:`~gradhooks.rules.fallback_replay.verify`);
        #: ``False`` only for ``attach(..., unsafe_skip_replay_check=True)``
        #: (:data:`UNVERIFIED_FALLBACK`).
        self.verify_replay = verify_replay
        # per module: the call structures vmap cannot replay (-> the cause),
        # and whether its looped replay was warned of (weak: the rule outlives models)
        self._memo: "weakref.WeakKeyDictionary[nn.Module, _Memo]" = weakref.WeakKeyDictionary()

    def _memo_of(self, module: nn.Module) -> "_Memo":
        memo = self._memo.get(module)
        if memo is None:
            memo = self._memo[module] = _Memo()
        return memo

    def internal(self, module: nn.Module, args: tuple, kwargs: dict, output) -> Optional[tuple]:
        """At the forward of every call (its replay is verified): a copy of its output leaves,
        ``a.internal["replay_output"]``, for :func:`~gradhooks.rules.fallback_replay.verify` (a
        call run again must give it). ``None`` under ``unsafe_skip_replay_check`` (nothing
        kept)."""
        if not self.verify_replay:
            return None
        out_leaves, _ = tree_flatten(output)
        return None, {"replay_output": [t.detach().clone() if isinstance(t, Tensor) else None
                                        for t in out_leaves]}

    def per_sample_grads(self, module: nn.Module, a: Call, g, batch_first: bool,
                         names: Iterable[str]) -> Dict[str, Tensor]:
        """Raises:
            ReplayError: neither vmap nor the loop over samples can replay the module.
            ReplayMismatchError: a replay computes something else than the module's batched
                call (:func:`~gradhooks.rules.fallback_replay.verify`).
            UnsupportedCallError: a random forward (dropout in training mode).
            BatchSizeError: an output the backward reached has no batch dim of size ``B``.
        """
        names = tuple(names)
        if a.shared == "param":  # a raw parameter's own cotangents (gradhooks.core.analysis.provenance)
            return {names[0]: g}
        _warn_container(module, names)
        r = self._replay(module, a, g, batch_first)
        own = {n: module.get_parameter(n).detach() for n in names}
        memo = self._memo_of(module)
        key = structure(tree_flatten((a.args, a.kwargs))[0])  # (as internal() saw the call)
        cause = memo.looped.get(key)
        how = "torch.func replay (vmap)"
        if cause is None:
            try:
                with state_kept(module):
                    out = self._vmapped(module, own, r)
            except GradHooksError:  # (a random forward: no replay can draw its masks)
                raise
            except Exception as e:  # (any exception from inside the transform: loop instead)
                cause = memo.looped[key] = cause_of(e)
        seconds = None
        if cause is not None:
            how = "sample-by-sample replay"
            try:
                out, seconds = looped(module, own, r)
            except Exception as e:
                raise ReplayError(
                    f"module {describe(module)}: gradhooks cannot replay it per sample for its "
                    f"parameters {', '.join(names)}: torch.func.vmap fails ({cause}), and so does "
                    f"one call per sample ({cause_of(e)}). A module that cannot run on one sample "
                    f"of its batch (B rows it builds itself; state kept between calls, such "
                    f"as a cache or a recurrent state, other than tensors of B rows kept as "
                    f"attributes, whose rows each sample's call is given) cannot be replayed "
                    f"per sample. {way_out(module)}") from None
        if self.verify_replay:
            # (every replay: one that becomes wrong on a later batch of the same structure, a
            # branch on the batch size or state that changes what the forward computes, is
            # refused on that batch; for a looped one the batched call costs about 1/B of it)
            batched = verify(module, own, r, out, (a.internal or {}).get("replay_output"),
                             describe(module), _path_prefix(module), how)
        else:
            batched = None
        if seconds is not None and not memo.warned:
            memo.warned = True
            cost = f"{seconds * 1e3:.3g} ms for {r.b} samples ({seconds * 1e3 / max(r.b, 1):.3g} ms each"
            if batched:
                cost += f", {seconds / batched:.3g}x the module's batched forward and backward"
            verdict = ("are checked against its batched gradient on every read"
                       if batched is not None else
                       "are NOT verified (unsafe_skip_replay_check=True)")
            warnings.warn(
                f"gradhooks replays the module {describe(module)} sample by sample: "
                f"torch.func.vmap cannot replay it ({cause}). Its per-sample gradients "
                f"{verdict} and cost one call of the module per sample: {cost}). A dedicated rule "
                f"(gradhooks.register_rule) makes it fast.", FallbackWarning, stacklevel=4)
        return {n: out[n].detach().contiguous() for n in names}

    def _replay(self, module: nn.Module, a: Call, g, batch_first: bool) -> Replay:
        """How the call ``a`` is sliced per sample (:class:`~gradhooks.rules.fallback_replay.Replay`)."""
        in_leaves, in_spec = tree_flatten((a.args, a.kwargs))
        g_leaves, _ = tree_flatten(g)
        reached = [i for i, t in enumerate(g_leaves) if isinstance(t, Tensor)]
        if a.shared is not None:
            # A call on inputs that are the same for every sample (Call.shared): the one call's
            # vjp, over the samples' grad_outputs only; the first input as it was.
            first = next(i for i, t in enumerate(in_leaves) if isinstance(t, Tensor))
            x = in_leaves[first]
            in_leaves[first] = x[0] if a.shared == "prepend" else x[:1]
            b = next(g_leaves[i].shape[0] for i in reached)
            return Replay(in_leaves, in_spec, [], [], g_leaves, reached, [0] * len(reached), b,
                          a.shared)
        if a.dims is not None:  # (the batch dims provenance followed: Call.dims)
            in_dim, out_dim = list(a.dims[0]), list(a.dims[1])
            # A tensor the batch did not reach but sized B on the batched inputs' dim (made
            # from sizes and expanded, as XLNet's positions are): sample n's call reads its
            # index n, as in the batched forward.
            found = [(d, t.shape[d]) for t, d in zip(in_leaves, in_dim) if d is not None]
            if found:
                d0, b0 = found[0]
                in_dim = [d0 if d is None and isinstance(t, Tensor) and t.dim() > d0
                          and t.shape[d0] == b0 else d for t, d in zip(in_leaves, in_dim)]
        else:
            in_dim = [_batch_dim(t, batch_first) if isinstance(t, Tensor) else None
                      for t in in_leaves]
            out_dim = [_batch_dim(t, batch_first) if isinstance(t, Tensor) else None
                       for t in g_leaves]
        first = next((i for i, t in enumerate(in_leaves) if isinstance(t, Tensor)
                      and in_dim[i] is not None), None)
        if first is None:
            raise BatchSizeError(
                "the torch.func fallback replays a module per sample by slicing its inputs on "
                "the batch dim, and none of this call's inputs carries the batch")
        if a.dims is None:
            b = self.batch_size(module, in_leaves[first], batch_first)
        else:
            b = in_leaves[first].shape[in_dim[first]]
        batched = [i for i, t in enumerate(in_leaves) if isinstance(t, Tensor) and t.dim() > 0
                   and in_dim[i] is not None and t.shape[in_dim[i]] == b]
        for i in reached:
            t = g_leaves[i]
            if t.dim() == 0 or out_dim[i] is None or t.shape[out_dim[i]] != b:
                raise BatchSizeError(
                    f"output {i} of the module has shape {tuple(t.shape)} without a batch dim "
                    f"of size {b}; the torch.func fallback needs every output the loss uses to "
                    f"be batched like the input"
                )
        return Replay(in_leaves, in_spec, batched, [in_dim[i] for i in batched], g_leaves,
                      reached, [out_dim[i] for i in reached], b, None)

    @staticmethod
    def _vmapped(module: nn.Module, own: Dict[str, Tensor], r: Replay) -> Dict[str, Tensor]:
        """``{name: (B, *param.shape)}`` by ``torch.func.vmap`` of the module's vjp per sample.

        Raises:
            UnsupportedCallError: a random forward (vmap refuses its randomness).
            Exception: whatever the transform raises (the caller replays sample by sample).
        """
        keep_dims = r.shared == "prepend"

        def one(params, xs: List[Tensor], gs: List[Tensor]):
            leaves = list(r.in_leaves)
            for i, d, x in zip(r.batched, r.in_dims, xs):
                leaves[i] = x.unsqueeze(d)
            args, kwargs = tree_unflatten(leaves, r.in_spec)

            differentiable = []  # (the reached outputs that can have a gradient: not the
            # indices a router's top-k returns, whose grad_output is zeros at most)

            def f(p):
                out_leaves, _ = tree_flatten(functional_call(module, p, tuple(args), kwargs))
                differentiable[:] = [k for k, i in enumerate(r.reached)
                                     if out_leaves[i].is_floating_point() or out_leaves[i].is_complex()]
                return [out_leaves[r.reached[k]] for k in differentiable]

            _, pull = vjp(f, params)
            return pull([gs[k] if keep_dims else gs[k].unsqueeze(r.out_dims[k])
                         for k in differentiable])[0]

        xs = [r.in_leaves[i] for i in r.batched]
        gs = [r.g_leaves[i] for i in r.reached]
        try:
            with paused(), torch.enable_grad():
                return vmap(one, in_dims=(None, list(r.in_dims), list(r.out_dims)))(own, xs, gs)
        except RuntimeError as e:
            if "randomness" in str(e):
                raise UnsupportedCallError(
                    f"the torch.func fallback cannot replay a random forward ({e}); put the module "
                    f"in eval mode or move its dropout out of it"
                ) from None
            raise


class _Memo:
    """What :class:`FallbackRule` keeps per module across reads."""

    __slots__ = ("looped", "warned")

    def __init__(self):
        self.looped: Dict[tuple, str] = {}  # call structure -> why vmap cannot replay it
        self.warned = False  # the looped replay's FallbackWarning was issued


_WARNED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
_PATHS: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()


def note_path(module: nn.Module, path: str) -> None:
    """Remember the path in its model of a module the fallback covers, for the messages of its
    replays (:func:`gradhooks.core.recorder.records.find_layers` calls it at attach)."""
    _PATHS[module] = path


def describe(module: nn.Module) -> str:
    """``'path' (Class)`` of a module the fallback covers, as
    :meth:`~gradhooks.core.recorder.records.Layer.describe` writes it."""
    return f"{_PATHS.get(module, '?') or '<root>'!r} ({type(module).__name__})"


def _path_prefix(module: nn.Module) -> str:
    path = _PATHS.get(module, "")
    return f"{path}." if path else ""


def _warn_container(module: nn.Module, names: tuple) -> None:
    """A :class:`~gradhooks.base.errors.FallbackWarning` the first time a module with children is
    replayed for its own (raw) parameters: :func:`~gradhooks.core.recorder.records.find_layers` names leaf
    modules at ``attach``, but a container's raw parameters are usually taken at their own ops
    (:mod:`gradhooks.core.analysis.provenance`), so only a replay that really runs is reported."""
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


#: The instance the hook manager uses for modules without a rule.
FALLBACK = FallbackRule()
#: The one ``attach(..., unsafe_skip_replay_check=True)`` uses: replays are not verified.
UNVERIFIED_FALLBACK = FallbackRule(verify_replay=False)
