"""Ops that mix the samples of a batch: what :mod:`gradhooks.core.analysis.provenance` refuses.

Per-sample gradients are the gradients of each sample's own loss. A forward in which sample
``n``'s output depends, through the parameters, on the other samples (``h - h.mean(0)`` between
two layers, a softmax over the batch, batch statistics) has none: what the hooks then record is
each sample's contribution to the batch gradient, and the sum check cannot tell (the rows still
add up to ``param.grad``). The forward shows such ops, and they are the same for every forward of
an input signature, so the tracked forward finds them and the reads of its batches (and of later
batches of the signature) raise :class:`~gradhooks.base.errors.SampleMixingError`.

The rule, for an op whose operand carries the batch on a dim provenance knows (``d``; for
``(B * T, D)`` rows, the merged dim):

* *mixes* (refused): an op whose output still carries the batch and computes each sample's
  values from the others' along ``d``: ``softmax`` / ``log_softmax`` / ``softmin`` /
  ``normalize`` over ``d``, ``sort`` / ``msort`` / ``cumsum`` / ``cumprod`` / ``cummax`` /
  ``cummin`` / ``logcumsumexp`` along ``d``, ``layer_norm`` over a shape that covers ``d``;
  ``batch_norm`` in training mode (the batch statistics; accepted by ``allow_batchnorm_train``
  as well);
* *a statistic of the batch*: a reduction over ``d`` (``sum``, ``mean``, ``var``, ``std``,
  ``max``, ``logsumexp``, ``norm``, ``median``, ``topk``, ``quantile`` ..., or over every dim).
  Alone it is not refused: a loss computed inside the forward (``model(ids, labels=labels)``)
  reduces over the batch. Ops on statistics give statistics; a statistic that then meets a tensor
  that carries the batch (``h - h.mean(0)``, ``h / h.std(0)``: broadcast back to the samples) is
  refused, naming the reduction and the op where it met the batch;
* *a product that pairs or contracts the samples* (refused): ``matmul`` / ``mm`` / ``bmm`` /
  ``@`` whose two operands both carry the batch in their matrix dims (``z @ z.T``: a ``(B, B)``
  similarity of a contrastive model; ``a.T @ b``: a sum over the samples).

Only outputs that require grad and whose autograd graph reaches a parameter gradhooks records
count: a statistic of the raw inputs (``x - x.mean(0)`` before the first layer) makes sample
``n``'s output depend on the other samples' *inputs*, not on the parameters through them, so
each sample's gradient is still that of its own loss (exact); a ``.detach()``-ed statistic
(``h - h.mean(0).detach()``) is a constant to autograd, so it is too. Ops that only move samples
(indexing, ``gather``, ``cat`` / ``stack`` of batches, permutations) and reductions over other
dims (attention's softmax over keys, ``LayerNorm`` over features, pooling) are not mixing; nor
is a batched product (``q @ k.transpose(-2, -1)`` with the batch in the broadcast dims). Every
op not recognised here is judged by the whitelist of :mod:`gradhooks.core.analysis.separation` (an
``einsum`` over the batch, a scatter along it, an op where the batch dim was lost, an op no rule
knows: unproven, refused as :class:`~gradhooks.base.errors.UnprovenOpError` unless the
forward-alone check of :mod:`gradhooks.core.analysis.alone` passed); a loss that mixes after the
forward is judged from its autograd graph (:mod:`gradhooks.core.analysis.loss_graph`), and its
verdict joins the batch's here (:meth:`Mixing.loss_graph`).
"""
from __future__ import annotations

import collections
import os
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ...base.errors import GradHooksError, SampleMixingError, UnprovenOpError
from ...base.torch_internals import getframe
from .batch_dims import Routed
from .hidden import HIDDEN_FILE
from .indexing import IN_ORDER
from .loss_graph import judge
from .separation import UNPROVEN
from .token_means import ForwardLosses, TokenMeans

__all__ = ["MIXING_OPS", "mixing_op", "rows_of_others", "upstream_of", "user_line",
           "called_by_gradhooks", "Mixing", "MIXES", "STAT",
           "BATCH_NORM", "UNCHECKED", "IN_ORDER"]

#: :func:`mixing_op`'s kinds: an op whose batched output mixes the samples, a reduction over the
#: batch (a statistic), batch normalisation with batch statistics.
MIXES, STAT, BATCH_NORM = "mixes", "statistic", "batch_norm"
#: The verdicts on a loss after the model (:meth:`Mixing.loss_graph`): pairs the samples, or not
#: proven to keep them apart.
LOSS_MIXES, LOSS_UNPROVEN = "loss_mixes", "loss_unproven"
#: The verdict kind of a planned forward whose structure changed and that no check of the
#: forward alone could verify: refused as an unproven op unless the batch's sample check passes
#: (:meth:`Mixing.checked`).
UNCHECKED = "unchecked"



def _owners(names, owners=(torch, torch.Tensor)):
    return {getattr(o, n): n for o in owners for n in names if getattr(o, n, None) is not None}


_ALL = object()  # (a reduction over every dim)
# name -> (position of the dim argument, its default): reductions, and ops along a dim
_REDUCTIONS = {
    **{n: (1, _ALL) for n in ("sum", "mean", "nansum", "nanmean", "std", "var", "prod", "amax",
                              "amin", "max", "min", "median", "nanmedian", "var_mean",
                              "std_mean", "logsumexp", "aminmax")},
    "norm": (2, _ALL), "vector_norm": (2, _ALL), "quantile": (2, _ALL), "nanquantile": (2, _ALL),
    "topk": (2, -1), "kthvalue": (2, -1), "mode": (1, -1)}
_ALONG = {**{n: (1, None) for n in ("softmax", "log_softmax", "softmin", "cumsum", "cumprod",
                                    "cummax", "cummin", "logcumsumexp")},
          "sort": (1, -1), "msort": (None, 0), "normalize": (2, 1)}

_REDUCE_OPS = {**_owners(_REDUCTIONS), torch.linalg.vector_norm: "vector_norm"}
_ALONG_OPS = {**_owners(_ALONG), **{getattr(F, n): n for n in ("softmax", "log_softmax",
                                                                "softmin", "normalize")}}
_BATCH_NORMS = {F.batch_norm, torch.batch_norm}
#: Every op :func:`mixing_op` looks at (provenance asks only for these).
MIXING_OPS = frozenset(_REDUCE_OPS) | frozenset(_ALONG_OPS) | _BATCH_NORMS | {F.layer_norm}


def _dims(args, kwargs, pos, default, nd: int):
    # The dims an op reduces or runs along, mod nd; _ALL for every dim; None if not readable.
    dim = kwargs.get("dim", args[pos] if pos is not None and len(args) > pos else default)
    if dim is None:
        return None
    if dim is _ALL or isinstance(dim, bool):  # (std(x, True): unbiased, every dim)
        return _ALL
    if isinstance(dim, int):
        return {dim % nd} if nd else _ALL
    if isinstance(dim, (tuple, list)) and all(isinstance(d, int) for d in dim):
        return {d % nd for d in dim} if dim and nd else _ALL
    return None


#: Products of two operands: mixing where both carry the batch in their matrix dims.
CONTRACTIONS = frozenset({torch.matmul, Tensor.matmul, torch.mm, Tensor.mm, torch.bmm, Tensor.bmm,
                          Tensor.__matmul__, Tensor.__rmatmul__})


def contraction_mixes(batched: list) -> Optional[Tuple[str, str]]:
    """``(MIXES, what)`` if a product's two operands (``batched``: ``[(tensor, batch dim)]`` of
    its operands that carry the batch) both carry it in their matrix dims (module docstring),
    else ``None``."""
    if len(batched) != 2:
        return None
    dims = []
    for t, bd in batched:
        d = bd[0] if isinstance(bd, tuple) else bd
        if not isinstance(d, int) or t.dim() < 1:
            return None
        dims.append(d % t.dim())
    (a, da), (b, db) = (batched[0][0], dims[0]), (batched[1][0], dims[1])
    if da < a.dim() - 2 or db < b.dim() - 2:
        return None  # (a batched product: the batch in the broadcast dims)
    return MIXES, (f"a product of two tensors that both carry the batch in their matrix dims "
                   f"({tuple(a.shape)} on dim {da}, {tuple(b.shape)} on dim {db}): it pairs or "
                   f"contracts the samples (z @ z.T of a contrastive model)")


def rows_of_others(batched) -> Optional[Tuple[str, str]]:
    """``(MIXES, what)`` where an op lines up rows gathered from the batch by an index, or
    sorted along it (:class:`~gradhooks.core.analysis.batch_dims.Routed`), with the batch's own
    rows (``h + h[perm]``, ``h * s.sort().values[:, None]``: each row meets another sample's),
    ``batched`` the op's ``[(tensor, batch dim)]``; else ``None``. Rows whose samples are the
    batch's in order again (a routing undone, or a sort that found the batch sorted) are not:
    a fact of these values, noted by :meth:`~gradhooks.core.analysis.indexing.Routed.merged_inner`."""
    routed = [bd for _, bd in batched if isinstance(bd, Routed)]
    if not routed or len(routed) == len(batched):
        return None
    own = [(t, bd) for t, bd in batched if isinstance(bd, (int, tuple))]
    for bd in routed:
        inner = bd.merged_inner()
        for t, d in own:
            if t.dim() == 0 or t.shape[0] != bd.samples.shape[0] or (d if isinstance(d, int)
                                                                     else d[0]) != 0:
                continue  # (broadcast, or the batch elsewhere: not row by row)
            if inner is None or inner != (1 if isinstance(d, int) else d[1]):
                return (MIXES, "rows gathered or sorted from the batch in a data-dependent "
                               "order met other samples' rows (x[index] or x.sort(0) combined "
                               "with x)")
    return None


def mixing_op(func, args, kwargs, ref: Tensor, bd) -> Optional[Tuple[str, str]]:
    """``(kind, what)`` if ``func(*args, **kwargs)`` on ``ref`` (its batch dim ``bd``: an int, a
    merged ``(dim, inner)``, or ``None``: unknown) mixes the samples (module docstring): kind
    :data:`MIXES`, :data:`STAT` or :data:`BATCH_NORM`, ``what`` the op and dim for messages;
    else ``None``."""
    if bd is None or not args or args[0] is not ref:
        return None
    d = bd[0] if isinstance(bd, tuple) else bd if isinstance(bd, int) else 0  # (Routed: 0)
    nd = ref.dim()
    if func in _BATCH_NORMS:
        training = kwargs.get("training", args[5] if len(args) > 5 else False)
        return (BATCH_NORM, "batch_norm in training mode (statistics over the batch)") \
            if training and d != 1 else None
    if func is F.layer_norm:
        shape = kwargs.get("normalized_shape", args[1] if len(args) > 1 else ())
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        return (MIXES, f"layer_norm over a shape {shape} that covers the batch dim (dim {d})") \
            if d >= nd - len(shape) else None
    name = _REDUCE_OPS.get(func)
    if name is not None:
        if len(args) > 1 and isinstance(args[1], Tensor) and name in ("max", "min"):
            return None  # (elementwise)
        dims = _dims(args, kwargs, *_REDUCTIONS[name], nd)
        if dims is _ALL:
            return STAT, f"{name} over every dim (the batch dim {d} too)"
        return (STAT, f"{name} over the batch dim (dim {d})") if dims and d in dims else None
    name = _ALONG_OPS[func]
    pos, default = _ALONG[name]
    if default is None and name in ("softmax", "log_softmax", "softmin") and pos is not None:
        if "dim" not in kwargs and len(args) <= 1:  # (torch's implicit dim)
            default = 0 if nd in (0, 1, 3) else 1
    dims = _dims(args, kwargs, pos, default, nd)
    if dims is _ALL or dims and d in dims:
        return MIXES, f"{name} along the batch dim (dim {d})"
    return None


def upstream_of(t: Tensor, params: dict, limit: int = 100000) -> Optional[str]:
    """The nearest recorded parameter's module upstream of ``t`` in its autograd graph (breadth
    first), as ``"module 'path' (Type)"`` (``"parameter 'name' of module 'path' (Type)"`` for a
    raw parameter provenance records at its own ops); ``None`` if the graph reaches none (``t`` is computed
    from the inputs alone). ``params``: provenance's ``{id(param): (layers, None) | (layer,
    name)}``."""
    node = t.grad_fn
    if node is None:
        return None
    seen, queue = {node}, collections.deque([node])
    while queue and len(seen) < limit:
        for nxt, _ in queue.popleft().next_functions:
            if nxt is None or nxt in seen:
                continue
            var = getattr(nxt, "variable", None)
            if var is not None:
                info = params.get(id(var))
                if info is not None:
                    if info[1] is None:
                        return f"module {info[0][0].describe()}"
                    return f"parameter {info[1]!r} of module {info[0].describe()}"  # (raw)
                continue
            seen.add(nxt)
            queue.append(nxt)
    return None


_SKIP = (os.path.dirname(torch.__file__) + os.sep,
         os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep)


def called_by_gradhooks(mode_file: str) -> bool:
    """Whether the innermost frame outside torch, ``mode_file`` (the provenance mode's own
    module) and the :class:`~gradhooks.core.analysis.hidden.HiddenOps` mode inside it is
    gradhooks' (its hooks' ops on a batch, run under provenance: not the user's forward)."""
    frame = getframe(1)
    while frame is not None and (frame.f_code.co_filename.startswith(_SKIP[0])
                                 or frame.f_code.co_filename in (mode_file, HIDDEN_FILE)):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(_SKIP[1])


def user_line() -> str:
    """``" (file.py:line in function)"``: the innermost frame of the caller outside torch and
    gradhooks (the user's forward), or ``""``."""
    frame = getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_SKIP) and not name.startswith("<"):
            return f" ({os.path.basename(name)}:{frame.f_lineno} in {frame.f_code.co_name})"
        frame = frame.f_back
    return ""


class Mixing:
    """The verdicts of one recorder's placement: which input signatures' forwards mix the
    samples, and the mixing ops of the batch, which its reads refuse (:meth:`refusal`).

    A mixing op is structural: the tracked forward of a signature finds it
    (:attr:`gradhooks.core.analysis.provenance.Provenance.mixing`, told by :meth:`learned`), and the
    untracked forwards of that signature carry the verdict into their batches
    (:meth:`untracked_end`).

    Args:
        recorder: the recorder (duck-typed), whose ``allow_sample_mixing`` and
            ``allow_batchnorm_train`` option the refusal reads.

    Attributes:
        signatures: ``{signature: ((kind, what), ...)}`` found by each signature's tracked
            forward.
        batch: ``[(kind, what)]`` of this batch's forwards.
        key: the signature of the untracked forward running now, or ``None``.
        tokens: the :class:`~gradhooks.core.analysis.token_means.TokenMeans` verdicts: token-level mean
            losses over the batch computed in the forward (refused first, :meth:`refusal`).
    """

    def __init__(self, recorder):
        self._recorder = recorder
        self.tokens = TokenMeans(recorder)
        self.signatures: Dict[tuple, tuple] = {}
        self.key: Optional[tuple] = None
        self.reset_batch()

    def reset_batch(self) -> None:
        """A new batch: none of its forwards has mixed the samples yet."""
        self.batch: List[Tuple[str, str]] = []
        self.tokens.batch = []
        #: The batch's sample check is under way (its reads judge :data:`UNCHECKED` structures).
        self.judging = False
        self.again: list = []  # (loss verdict, what judges it again): Mixing.loss_graph

    def learned(self, signature: tuple, found, losses: Optional[ForwardLosses] = None) -> None:
        """A tracked forward of ``signature`` returned having found the mixing ops ``found``
        (and the token-level ``losses``). A signature tracked again keeps the ops an earlier
        forward of it found: its later untracked forwards may take either branch."""
        found = [f for f in found if f[0] != IN_ORDER]  # (not a verdict: Placement._learn)
        before = self.signatures.get(signature, ())
        self.signatures[signature] = tuple(before) + tuple(f for f in found if f not in before)
        self._note(found)
        if losses is not None:
            self.tokens.learned(signature, losses)

    def untracked_start(self, signature: tuple, size: int) -> None:
        """An untracked forward of ``signature`` (batch size ``size``) starts."""
        self.key = signature
        self.tokens.untracked_start(signature, size)

    def untracked_end(self, completed: bool) -> None:
        """An untracked forward ended (``completed``: it returned): its signature's verdict
        joins the batch."""
        if completed and self.key is not None:
            self._note(self.signatures.get(self.key, ()))
        self.key = None
        self.tokens.untracked_end(completed)

    def stop(self) -> None:
        """A forward was interrupted (detach, suspended): end its watch."""
        self.tokens.stop()

    def forget(self) -> None:
        """Drop every signature's verdicts (the model changed)."""
        self.signatures.clear()
        self.tokens.signatures.clear()

    def loss_graph(self, found, again: Optional[tuple] = None) -> None:
        """A backward pass's loss, computed after the model, whose split into per-sample terms
        its graph does not prove (``found``:
        :class:`~gradhooks.core.analysis.loss_rules.Unproven`) joins the batch's verdicts.
        ``again``: ``(root node, spans)`` of a loss judged row by row before
        ``sample_ids`` were declared: judged again over the samples when they are (at the
        read)."""
        item = (LOSS_MIXES if found.mixes else LOSS_UNPROVEN, str(found))
        self._note([item])
        if again is not None:
            self.again.append((item, again))

    def checked(self, passed: bool) -> None:
        """The batch's sample check through the batched graph (:mod:`gradhooks.readers.sample_check`),
        whose reads of the records :attr:`judging` let through, ended: where it ``passed``, a
        changed structure that no check of the forward alone could verify (:data:`UNCHECKED`)
        is verified."""
        self.judging = False
        if passed:
            self.batch = [item for item in self.batch if item[0] != UNCHECKED]

    def _judge_again(self) -> None:
        # sample_ids declared after the backward: a loss that combines rows of one sample
        # (a DPO pair) is proven over the samples (its graph's nodes outlive the pass).
        ids = self._recorder.reads.declared_ids() if self.again else None
        if ids is None:
            return
        for item, (node, spans) in self.again:
            if item in self.batch:
                self.batch.remove(item)
            found = judge(node, spans, ids.cpu())
            if found is not None:
                self._note([(LOSS_MIXES if found.mixes else LOSS_UNPROVEN, str(found))])
        self.again = []

    def _note(self, found) -> None:
        for item in found:
            if item not in self.batch:
                self.batch.append(item)

    def refusal(self, read: str) -> Optional[GradHooksError]:
        """The error a read (``read``, e.g. ``"per_sample_grads()"``) of this batch raises when
        a forward computed a token-level mean loss that weighs the samples unequally
        (:class:`~gradhooks.base.errors.UnsupportedLossError`) or mixed the samples
        (:class:`SampleMixingError`), or ``None``: none did, or the attachment accepts the
        mixing (``allow_sample_mixing=True``; batch statistics also
        ``allow_batchnorm_train=True``)."""
        error = self.tokens.refusal(read)
        if error is not None:
            return error
        recorder = self._recorder
        self._judge_again()
        if not self.batch or getattr(recorder, "allow_sample_mixing", False):
            return None
        loss = [(kind, what) for kind, what in self.batch if kind in (LOSS_MIXES, LOSS_UNPROVEN)]
        forward = [(kind, what) for kind, what in self.batch if (kind, what) not in loss]
        if loss and not forward:  # (the forward's own verdicts first: they name its ops)
            return _loss_refusal(read, *loss[0])
        bn = getattr(recorder, "options", {}).get("allow_batchnorm_train", False)
        found = [what for kind, what in forward
                 if not (kind == BATCH_NORM and bn) and kind not in (UNPROVEN, UNCHECKED)]
        unproven = [what for kind, what in forward
                    if kind == UNPROVEN or kind == UNCHECKED and not self.judging]
        if not found and unproven:
            return _unproven(read, unproven)
        if not found:
            return _loss_refusal(read, *loss[0]) if loss else None
        more = f" (and {len(found) - 1} more such op(s))" if len(found) > 1 else ""
        return SampleMixingError(
            f"the forward mixes the samples of the batch: {found[0]}{more}. Each sample's "
            f"output then depends on the other samples through the parameters, so {read} would "
            f"not be the gradients of each sample's own loss (the sum check cannot see this: "
            f"the rows still add up to the batch gradient). Compute the statistic outside the "
            f"per-sample forward (running statistics, another batch), .detach() it if it is "
            f"meant as a constant, or pass attach(..., allow_sample_mixing=True) to accept "
            f"results that are then each sample's contribution to the batch gradient, not the "
            f"gradient of its own loss")


def _loss_refusal(read: str, kind: str, what: str) -> GradHooksError:
    # The refusal of a loss computed after the model whose graph does not prove its split into
    # per-sample terms (gradhooks.core.analysis.loss_graph).
    error = SampleMixingError if kind == LOSS_MIXES else UnprovenOpError
    said = ("pairs or mixes the samples" if kind == LOSS_MIXES
            else "runs an op that gradhooks cannot prove keeps the samples apart")
    return error(
        f"the loss computed after the model {said}: autograd node {what}. Unless the loss is "
        f"a sum of terms each of one sample's outputs, {read} would not be the gradients of "
        f"each sample's own loss, and the sum check cannot see it. Ways out: compute the "
        f"per-sample losses, shape (B,) (reduction='none'; (G,) with sample_ids), and hand "
        f"them to gh.backward(losses.sum()) (or .mean()) or gh.clipped_backward(losses, "
        f"max_norm), whose sample check judges each sample through the batched graph "
        f"whatever the loss's ops; pass attach(..., allow_sample_mixing=True) to accept "
        f"results that are each sample's contribution to the batch gradient; or report the op "
        f"to gradhooks if it keeps the samples apart")


def _unproven(read: str, unproven: list) -> UnprovenOpError:
    # The refusal of ops no rule proves keep the samples apart whose forward-alone check failed
    # or was not possible (gradhooks.core.analysis.separation, gradhooks.core.analysis.alone).
    more = f" (and {len(unproven) - 1} more such op(s))" if len(unproven) > 1 else ""
    first = unproven[0]
    scatter = "moves rows between samples" in first
    way = ("declare which rows make one sample (a sample index, sample_ids: one id per row "
           "of the batch, e.g. the graph of each node) so that they are one sample; "
           if scatter else "")
    return UnprovenOpError(
        f"the forward runs an op that gradhooks cannot prove keeps the samples of the batch "
        f"apart: {first}{more}. If it lets a sample's output depend on the other samples "
        f"through the parameters, {read} would not be the gradients of each sample's own loss, "
        f"and the sum check cannot see it. Ways out: {way}rewrite the op with ops that keep "
        f"the batch dim (a per-sample einsum letter, a reduction over other dims); pass "
        f"attach(..., allow_sample_mixing=True) to accept results that are each sample's "
        f"contribution to the batch gradient; verify a batch with gh.check_samples(loss_fn, "
        f"inputs, targets); or report the op to gradhooks if it keeps the samples apart")
