"""A token-level mean loss over the batch, computed inside the forward: what the reads refuse.

transformers' causal-LM loss (``model(ids, labels=labels).loss``: ``ForCausalLMLoss``) is one
``cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100)`` over the ``B * T``
token rows of the batch: a mean over all ``N = sum_n N_n`` valid tokens (``N_n``: sample ``n``'s
targets that are not ``ignore_index``), or, given ``num_items_in_batch``, a sum divided by that
count. Sample ``n``'s part of it is ``N_n / N`` times its own token-mean loss, so with
``loss_reduction="mean"`` (results multiplied by ``B``) its per-sample gradient is ``B N_n / N``
times that of its own token-mean loss (``N_n / N`` with ``"sum"``): silently rescaled whenever
the counts differ (padding). With equal counts the batch loss is the mean of the samples' token
means: exact, allowed. ``gh.backward(loss)`` sees such a loss in its graph
(:mod:`gradhooks.readers.loss_reduction`); a plain ``loss.backward()`` does not, so the forward
is watched instead.

What counts as such a loss: ``cross_entropy`` / ``nll_loss`` without ``weight=`` (a weighted
mean is refused by its backward pass whatever the counts) whose input requires grad and
whose target carries the batch (provenance follows it through the label shift: ``F.pad``,
slicing, ``view``; rows ``(B * T,)`` or ``(B, T)``) with ``reduction="mean"``, or
``reduction="sum"`` then divided by something other than ``B`` (``num_items_in_batch``). Each
sample's valid-token count is the target reshaped to ``(B, -1)`` compared with
``ignore_index``; the counts stay on the device (no sync in the forward) and are compared at the
read (:meth:`TokenMeans.refusal`).

Cost: the first (tracked) forward of an input signature finds the loss by provenance at no
extra cost beyond one count per loss call. A signature whose tracked forward had such a loss is
watched on its untracked forwards (the padding changes from batch to batch while the shapes do
not) by a light ``TorchFunctionMode`` (:class:`Watch`): one Python call and a set lookup per
torch function of the forward (about 1 us each; a few hundred per GPT-2 forward), plus the
count (one compare and one sum over the ``B * T`` targets) per loss call. Signatures without
such a loss pay nothing.

Not seen here: a loss computed outside the forward (``gh.backward`` refuses one from its
graph; :mod:`gradhooks.core.analysis.backward_losses` finds one that ``loss.backward()`` differentiates,
refused at the read through :meth:`TokenMeans.seen_after_forward`), losses other than these two
(``weight=``, label smoothing, auxiliary terms: their backward pass finds them whether they were
computed inside the forward or not, :meth:`TokenMeans.unsplit`).

Also kept here, per batch: the losses whose split into per-sample terms is not proven
(:meth:`TokenMeans.unsplit`) and the constant factors on the losses (:meth:`TokenMeans.scaled`,
divided out by the DP reads: :meth:`TokenMeans.dp_factor`). With
``attach(..., token_normalisation="batch")`` none of the token-count refusals is made: the
results are each sample's contribution to the batch gradient.
"""
from __future__ import annotations

from typing import Callable, Dict, List, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ...base.errors import UnsupportedLossError

__all__ = ["TOKEN_OPS", "TOKEN_NORMALISATIONS", "ForwardLosses", "Watch", "TokenMeans",
           "check_token_normalisation"]

#: The values of ``attach(..., token_normalisation=)``: ``"sample"`` (default: a loss whose
#: split into per-sample terms is not proven is refused where the samples' token counts differ)
#: or ``"batch"`` (the batch's token normalisation is wanted: results are contributions).
TOKEN_NORMALISATIONS = ("sample", "batch")


def check_token_normalisation(value: str) -> str:
    """``value`` if it is one of :data:`TOKEN_NORMALISATIONS`.

    Raises:
        ValueError: another value."""
    if value not in TOKEN_NORMALISATIONS:
        raise ValueError(f"token_normalisation must be one of {TOKEN_NORMALISATIONS}, got "
                         f"{value!r}")
    return value

_LOSSES = {F.cross_entropy: "cross_entropy", F.nll_loss: "nll_loss"}
_DIVS = {torch.div, torch.true_divide, Tensor.div, Tensor.true_divide, Tensor.__truediv__}
#: The ops :class:`ForwardLosses` looks at (provenance and :class:`Watch` ask only for these).
TOKEN_OPS = frozenset(_LOSSES) | frozenset(_DIVS)


def _option(args, kwargs, name: str, pos: int, default):
    return kwargs.get(name, args[pos] if len(args) > pos else default)


class ForwardLosses:
    """The token-level losses of one forward.

    Args:
        dims: the target batch dims the signature's tracked forward found, one per loss call
            (``None``: not a token loss); ``None`` for a tracked forward (provenance tells).

    Attributes:
        found: ``[[what, counts (B,) tensor, reduction, divisor or None, used]]``, ``used``
            set by a hook on the loss when a backward reaches it (a loss the user computes but
            does not differentiate, beside per-sample losses of the logits, is not refused).
        dims: the target batch dim of each loss call of this forward (``None``: not one).
    """

    def __init__(self, dims: Optional[tuple] = None):
        self._known = dims
        self.dims: list = []
        self.found: list = []
        self._sums: list = []  # [(output, index in found)] of reduction="sum" losses

    def observe(self, func, args, kwargs, out, size: int, dim_of: Optional[Callable]) -> None:
        """``out = func(*args, **kwargs)`` ran in the forward; ``size``: ``B``; ``dim_of``: the
        batch dim of a tensor (an int, a merged ``(dim, inner)``, ``None``), or ``None`` to take
        the signature's (:attr:`dims`)."""
        if func in _DIVS:
            for o, i in self._sums:
                if len(args) > 1 and args[0] is o and self.found[i][3] is None:
                    self.found[i][3] = args[1]
            return
        name = _LOSSES[func]
        target = _option(args, kwargs, "target", 1, None)
        x = args[0] if args else kwargs.get("input")
        if dim_of is not None:
            d = dim_of(target) if isinstance(target, Tensor) else None
            d = d if isinstance(d, int) else (d[0] if d is not None and d[0] == 0 else None)
        else:
            k = len(self.dims)
            d = self._known[k] if k < len(self._known) else None
        self.dims.append(d)
        reduction = _option(args, kwargs, "reduction", 6, "mean")
        if (d is None or not isinstance(x, Tensor) or not x.requires_grad or size <= 0
                or _option(args, kwargs, "weight", 2, None) is not None  # (its backward pass
                # refuses a weighted mean: gradhooks.core.analysis.backward_losses.split_of)
                or reduction not in ("mean", "sum") or target.dim() <= d
                or target.numel() % size or target.is_floating_point()):
            return
        ignore = _option(args, kwargs, "ignore_index", 4, -100)
        with torch.no_grad():
            counts = (target.movedim(d, 0).reshape(size, -1) != ignore).sum(1)
        finding = [f"computed in the model's forward, {name}(reduction={reduction!r}, "
                   f"ignore_index={ignore}) over the {tuple(target.shape)} targets of the batch,",
                   counts, reduction, None, False]
        self.found.append(finding)
        if isinstance(out, Tensor) and out.requires_grad:  # (used: a backward reaches it)
            out.register_hook(lambda g, f=finding: f.__setitem__(4, True))
        if reduction == "sum" and isinstance(out, Tensor):
            self._sums.append((out, len(self.found) - 1))


class _Contradiction(NamedTuple):
    """A batch loss whose reduction over the batch is not the declared one (its message,
    ``{read}`` to fill in)."""
    message: str


class _RowsMean(NamedTuple):
    """A backward pass's loss that is an unscaled mean over the batch's ``rows`` rows
    (``what``): refused at the read where ``sample_ids``, declared before or after that
    backward, group the rows into another number of samples (:func:`rows_mean_message`)."""
    what: str
    rows: int


class _Unsplit(NamedTuple):
    """A backward pass's loss whose split into per-sample terms its graph does not prove
    (:func:`gradhooks.core.analysis.backward_losses.split_of`): ``counts`` ``(B,)`` the valid-token rows
    per sample (or the class-weight sums of a weighted mean; ``None``: not known), ``source``
    where they come from."""
    what: str
    counts: Optional[Tensor]
    weighted: bool
    source: str
    length: Optional[int] = None  # (Split.length: (L,) losses reduced, L != B)

    @property
    def decisive(self) -> bool:
        """Whether :attr:`counts` are the normaliser's per-sample parts (read from the loss's
        saved targets: a weighted mean's weight sums), not only its valid rows."""
        return self.source == TARGETS


#: The source of counts read from a loss's saved targets (:attr:`_Unsplit.decisive`).
TARGETS = "the loss's saved targets"


class _Factor(NamedTuple):
    """A constant factor on a backward pass's loss relative to the declared reduction
    (``None``: not readable), and the loss in words."""
    factor: Optional[float]
    what: str


class Watch(TorchFunctionMode):
    """The light mode over an untracked forward of a signature with a token loss: only the
    loss calls and divisions are looked at (:class:`ForwardLosses` with the signature's dims)."""

    def __init__(self, losses: ForwardLosses, size: int):
        super().__init__()
        self.losses, self.size = losses, size

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in TOKEN_OPS:
            self.losses.observe(func, args, kwargs, out, self.size, None)
        return out


class TokenMeans:
    """Which input signatures compute a token-level loss in their forward, and this batch's
    losses, which the reads refuse when the samples' valid-token counts differ.

    Args:
        recorder: the recorder (duck-typed): its ``loss_reduction`` words the message.

    Attributes:
        signatures: ``{signature: dims}``: the target batch dim of each loss call of a
            signature whose tracked forward had a token loss.
        batch: ``[[what, counts, reduction, divisor, used]]`` of this batch's forwards, and
            the contradictions of its backward passes (:meth:`contradicts`).
    """

    def __init__(self, recorder):
        self._recorder = recorder
        self.signatures: Dict[tuple, tuple] = {}
        self._watch: Optional[Watch] = None
        self._depth = 0
        self.batch: List[list] = []

    def learned(self, signature: tuple, losses: ForwardLosses) -> None:
        """A tracked forward of ``signature`` returned with ``losses``."""
        if losses.found:
            self.signatures[signature] = tuple(losses.dims)
        else:
            self.signatures.pop(signature, None)
        self.batch.extend(losses.found)

    def untracked_start(self, signature: tuple, size: int) -> None:
        """An untracked forward of ``signature`` (batch size ``size``) starts: watched if the
        signature's tracked forward had a token loss."""
        if self._watch is not None:
            self._depth += 1
            return
        dims = self.signatures.get(signature)
        if dims is not None:
            self._watch, self._depth = Watch(ForwardLosses(dims), size), 1
            self._watch.__enter__()

    def untracked_end(self, completed: bool) -> None:
        """An untracked forward ended (``completed``: it returned): its losses join the batch."""
        watch = self._watch
        if watch is None:
            return
        self._depth -= 1
        if self._depth > 0:
            return
        self.stop()
        if completed:
            self.batch.extend(watch.losses.found)

    def stop(self) -> None:
        """End a watch (its forward ended, or was interrupted by a detach)."""
        watch, self._watch, self._depth = self._watch, None, 0
        if watch is not None:
            watch.__exit__(None, None, None)

    def seen_after_forward(self, what: str, counts: Tensor) -> None:
        """A token-level mean loss computed after the forward, found by its backward pass
        (:mod:`gradhooks.core.analysis.backward_losses`): ``counts`` ``(B,)`` its valid tokens per
        sample; refused at the read like one of the forward's."""
        self.batch.append([what, counts, "mean", None, True])

    def unsplit(self, what: str, counts: Optional[Tensor], weighted: bool, source: str,
                length: Optional[int] = None) -> None:
        """A backward pass's loss is not proven to split into per-sample terms
        (:class:`_Unsplit`): refused at the read where ``counts`` differ, or it is a class-
        weighted mean whose per-sample weight sums are not known to be equal. Counts for a
        weighted mean noted earlier without them take its place."""
        entry = _Unsplit(what, counts, weighted, source, length)
        for i, old in enumerate(self.batch):
            if isinstance(old, _Unsplit) and old.counts is None and old.what == what:
                self.batch[i] = entry
                return
        self.batch.append(entry)

    def scaled(self, factor: Optional[float], what: str) -> None:
        """A backward pass's loss is ``factor`` times the declared reduction of per-sample
        losses (``None``: a constant factor was seen that could not be read): the DP reads
        divide it out (:meth:`dp_factor`)."""
        self.batch.append(_Factor(factor, what))

    def dp_factor(self, read: str, materialize: bool = False) -> float:
        """The constant factor ``c`` on this batch's loss (``1.0`` where none was seen), which
        a DP read divides out so that clipping acts on the gradient of each sample's own
        unscaled loss.

        Raises:
            UnsupportedLossError: a factor was seen that could not be read, backward passes
                of the batch had different factors, or ``materialize`` (clipping the per-sample
                gradients ``per_sample_grads()`` returns, which are of the loss as given)."""
        found = {entry.factor: entry.what for entry in self.batch if isinstance(entry, _Factor)}
        if not found:
            return 1.0
        if None in found:
            raise UnsupportedLossError(
                f"{read}: the loss of this batch's backward ({found[None]}) is multiplied by a "
                f"constant (loss / gradient_accumulation_steps, loss * c) that gradhooks cannot "
                f"read: loss.backward() frees it before any hook runs. Clipping would act on c "
                f"times each sample's gradient, at the wrong scale. Call gh.backward(loss) "
                f"instead of loss.backward() (gradhooks then reads the factor and clips the "
                f"gradient of each sample's own unscaled loss), or backward the unscaled loss "
                f"and let gh.clip_and_accumulate(C, accumulate=True) with gh.finish_step() do "
                f"the accumulation")
        if len(found) > 1:
            raise UnsupportedLossError(
                f"{read}: the backward passes of this batch scaled their losses by different "
                f"constants ({', '.join(f'{c:g}' for c in found)}): no one scale to clip at. "
                f"Clip after each backward, or use one factor")
        factor = next(iter(found))
        if materialize:
            raise UnsupportedLossError(
                f"{read} with method='materialize': the loss ({found[factor]}) is {factor:g} "
                f"times the declared reduction of per-sample losses, and the per-sample "
                f"gradients it would clip are those of the loss as given. Use method='ghost' "
                f"(it clips the gradient of each sample's own unscaled loss) or backward the "
                f"unscaled loss")
        return factor

    def contradicts(self, what: str, reduction: str, size: int) -> None:
        """A backward pass's loss is ``what``, a ``reduction`` (``"sum"`` / ``"mean"``) over the
        batch's ``size`` rows (:mod:`gradhooks.core.analysis.backward_losses`): refused at the read when
        it is not the recorder's ``loss_reduction``."""
        declared = getattr(self._recorder, "loss_reduction", "mean")
        if reduction == declared:
            return
        factor, fix = ((f"{size} (B) times", "divide it by B (reduction='mean', or losses.mean())")
                       if declared == "mean" else
                       (f"1/{size} (1/B) times", "sum it (reduction='sum', or losses.sum())"))
        self.batch.append(_Contradiction(
            f"loss_reduction={declared!r} was declared, but the loss differentiated by this "
            f"batch's backward is {what}, a {reduction} over the batch (B = {size}): {{read}} "
            f"would be {factor} the gradient of each sample's own loss. Make the loss the "
            f"declared reduction ({fix}) or attach with loss_reduction={reduction!r}"))

    def rows_mean(self, what: str, rows: Optional[int]) -> None:
        """A backward pass's loss is ``what``, an unscaled mean over the batch's ``rows`` rows
        (``.mean()`` of ``(B,)`` row losses, a loss function's ``reduction="mean"``; ``None``: a
        loss function's rows not counted yet, which a later call with the count replaces):
        refused at the read under ``loss_reduction="mean"`` where the ``sample_ids`` declared
        by then group the batch's rows into another number of samples
        (:func:`rows_mean_message`); the row count is read while the pass runs, so ids declared
        after it are judged too. A mean over rows never counted is refused too: it may be one
        over the ``B`` rows (fail closed)."""
        entry = _RowsMean(what, rows)
        for i in range(len(self.batch) - 1, -1, -1):
            old = self.batch[i]
            if isinstance(old, _RowsMean) and old.rows is None and old.what == what:
                self.batch[i] = entry
                return
        self.batch.append(entry)

    def refusal(self, read: str) -> Optional[UnsupportedLossError]:
        """The error a read (``read``) of this batch raises when a token-level loss of its
        forward weighs the samples unequally (module docstring), or ``None``."""
        batch_wide = getattr(self._recorder, "token_normalisation", "sample") == "batch"
        for entry in self.batch:
            if isinstance(entry, _Contradiction):
                return UnsupportedLossError(entry.message.replace("{read}", read))
            if isinstance(entry, _RowsMean):
                samples, size = self._recorder.reads.declared_samples(), self._recorder.batch_size
                if (samples is None or samples == (entry.rows or size)
                        or getattr(self._recorder, "loss_reduction", "mean") != "mean"):
                    continue
                if entry.rows is not None:
                    return UnsupportedLossError(rows_mean_message(entry.what, entry.rows,
                                                                  samples, read))
                return UnsupportedLossError(
                    f"{read}: sample_ids group the B = {size} rows into G = {samples} samples, "
                    f"and the loss is {entry.what} whose rows gradhooks could not count after "
                    f"loss.backward() (an op lies between the model's output and the loss "
                    f"function, and autograd frees the count before any hook runs): a mean over "
                    f"the B rows would make every result G/B = {samples}/{size} times the "
                    f"gradient of the sample's own loss. Hand the loss to gh.backward(loss), "
                    f"which counts its rows before the pass, or use reduction='none' and sum "
                    f"the rows' losses / G")
            if isinstance(entry, _Factor) or batch_wide:
                continue  # (token_normalisation="batch": contributions are wanted)
            if isinstance(entry, _Unsplit):
                if (not entry.weighted and entry.length is not None
                        and entry.length == self._recorder.reads.declared_samples()):
                    continue  # (.mean() / .sum() of (G,) losses of the declared samples)
                error = _unsplit_error(entry, read)
                if error is not None:
                    return error
                continue
            what, counts, reduction, divisor, used = entry
            if not used:
                continue  # (no backward reached this loss: it is not what the results are of)
            b = counts.numel()
            n = counts.tolist()
            if len(set(n)) <= 1:
                continue  # (equal counts: the mean of the samples' token means, exact)
            d = float(sum(n))
            if reduction == "sum":
                if divisor is None:
                    continue  # (each sample's own loss is its token sum)
                d = float(divisor.item() if isinstance(divisor, Tensor) else divisor)
                if d == b:
                    continue  # (the mean of the samples' token sums)
            scale = b if getattr(self._recorder, "loss_reduction", "mean") == "mean" else 1
            factors = ", ".join(f"{scale * k / d:.4g}" for k in n)
            how = ("the mean over all N" if reduction == "mean"
                   else f"a sum divided by {d:g}, not by B = {b}, over the")
            return UnsupportedLossError(
                f"the loss {what} is {how} valid tokens of "
                f"the batch, and the samples have different numbers of valid tokens "
                f"(N_n = {n}, N = {sum(n)}): {read} would be each sample's own token-mean "
                f"gradient times {'B ' if scale > 1 else ''}N_n / "
                f"{'N' if reduction == 'mean' else f'{d:g}'} = ({factors}), not the gradient "
                f"of its own loss. Compute one loss per sample and hand it to gradhooks: "
                f"losses = gradhooks.per_sample_token_loss(out.logits, labels); then "
                f"gh.backward(losses.mean()) or gh.clipped_backward(losses, C); or attach with "
                f"token_normalisation='batch' if each sample's contribution to the batch "
                f"gradient is wanted")
        return None


def _unsplit_error(entry: _Unsplit, read: str) -> Optional[UnsupportedLossError]:
    # The refusal of a loss whose split is not proven (TokenMeans.unsplit), or None.
    n = None if entry.counts is None else entry.counts.tolist()
    weights = entry.weighted and not entry.decisive  # (weight sums not known: always refused)
    if n is not None and len(n) < 2:
        return None
    if not weights and (n is None or len(set(n)) <= 1):
        return None
    if n is None:
        shown = "the per-sample sums of the targets' class weights are not known"
    else:
        shown = ", ".join(f"{k:g}" for k in n[:8]) + (", ..." if len(n) > 8 else "")
        shown = (f"{'class-weight sums' if entry.decisive and entry.weighted else 'N_n'} = "
                 f"[{shown}] (B = {len(n)}, from {entry.source})")
    if entry.weighted:
        how = ("is a class-weighted mean: it divides by the total class weight of the batch's "
               "targets, so each sample's term depends on the other samples' targets")
    else:
        how = ("is not proven to split into per-sample terms (only .mean() / .sum() of (B,) "
               "per-sample losses is), and the samples' valid tokens differ")
    return UnsupportedLossError(
        f"{read}: the loss ({entry.what}) {how}: {shown}. A loss normalised over the batch's "
        f"tokens (a token mean, class weights, label smoothing, a z-loss or other auxiliary "
        f"term, a sum divided by num_items_in_batch, a masked mean) weighs each sample by the "
        f"batch's counts, so {read} would not be the gradient of each sample's own loss. Ways "
        f"out: (a) compute one loss per sample, losses = gradhooks.per_sample_token_loss("
        f"logits, labels, weight=..., label_smoothing=..., z_loss=...) (or "
        f"per_sample_token_loss(token_losses=l, mask=m) for any (B, T) token-loss tensor), then "
        f"gh.backward(losses.mean()) or gh.clipped_backward(losses, C); or (b) declare that the "
        f"batch's token normalisation is wanted, gradhooks.attach(..., "
        f"token_normalisation='batch'): results are then each sample's contribution to the "
        f"batch gradient (under DP-SGD each sample's clipped term then depends on the batch's "
        f"token count)")


def rows_mean_message(what: str, rows: int, samples: int, read: str) -> str:
    """Why a mean over the ``B = rows`` rows is no batch loss when ``sample_ids`` group them
    into ``G = samples`` samples (``loss_reduction="mean"``): each result would be ``G / B``
    times the gradient of the sample's own loss."""
    return (f"{read}: sample_ids group the B = {rows} rows into G = {samples} samples, but "
            f"the loss is a mean over the rows ({what}): a sample's loss is the sum of its "
            f"rows' terms, and the batch loss must be their mean over the samples "
            f"(loss_reduction='mean': row_losses.sum() / {samples}) or their sum ('sum'); as it "
            f"is, every result would be G/B = {samples}/{rows} times the gradient of the "
            f"sample's own loss. Use reduction='none' and sum / G")
