"""The verification, in one place: the verdicts on what the readers computed.

A read computes; where the sum check is due (``batch.check_key``, :mod:`gradhooks.core.recorder.check_policy`),
its computation declares its evidence in an :class:`Evidence` (its per-sample results at the
probe coordinates, its Gram-form weights' random projections: taken where the tensors are, so
that nothing is kept), and the read's driver calls :meth:`Evidence.judge` once, before anything
is written (``param.grad``, ``grad_sample``). This module judges:

* the sum check: per-sample results must add up to autograd's batch gradient
  (``sum_n grad_n == scale * batch_grad``, linearity of the gradient in the loss); it fails when
  a parameter also receives gradient outside the module whose hooks produced ``grad_n`` (a
  functional use, ``x @ layer.weight.T``), when a module mixes the samples under the fallback, or
  when a backward computed no parameter gradient. Materialised parameters on probe coordinates
  (:func:`check_sums`), Gram-form weights on a fixed random rank-one projection
  ``sum_g v_g^T (sum_n dW_n[g]) u_g``, computed from the records as
  ``sum_{n,g,s} (a[n,g,s] . u_g)(g[n,g,s] . v_g)`` (:func:`projection_terms`,
  :func:`check_projections`; cost ``N G S (I + O)``);
* parameters autograd reached whose module the hooks never saw (:func:`check_unrecorded`);
* each at the tolerance of the precision its gradient was formed in (:data:`SUM_CHECK_RTOL`;
  the evidence of that precision: :mod:`gradhooks.core.recorder.totals`).

* the sample check through the batched graph (:func:`judge_sample_rows`,
  :func:`judge_weighted_sums`): the rows of two samples against autograd's gradient of their own
  loss terms, and the records' sum of every row times a random weight against autograd's gradient
  of the same weighted sum of the loss terms, which :mod:`gradhooks.readers.sample_check`
  computes (masked and weighted backward passes through the batched forward).

The check of a forward run one sample alone (:mod:`gradhooks.readers.spotcheck`, an explicit
``gh.check_samples``) judges at its own tolerance there; the replay checks of the
``torch.func`` fallback run inside the rule (:mod:`gradhooks.rules.fallback_replay`), below the
readers.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..base.errors import GradientMismatchError, SampleMixingError
from ..base.segments import Segments
from ..base.utils import tf32_allowed
from ..core.recorder.records import Batch
from ..core.recorder.totals import GradTotal, bilinear_directions, float32_columns

__all__ = ["Evidence", "check_sums", "projection_terms", "check_projections", "probed",
           "no_total", "check_unrecorded", "SUM_CHECK_RTOL", "TF32_RTOL", "user_hooks",
           "formed_rtol", "SAMPLE_CHECK_RTOL", "judge_sample_rows"]

# Relative tolerance of check_sums per dtype: the sum of B per-sample values may differ from
# autograd's batch value by rounding, relative to sum_n |value_n| (B * eps in the worst case).
# Each parameter is judged at the precision its gradient was formed in (check_sums).
SUM_CHECK_RTOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}
#: float32 on CUDA where TF32 is allowed (:func:`~gradhooks.base.utils.tf32_allowed`): autograd
#: forms a convolution's or an RNN's batch gradient at about TF32's precision (H200, torch's
#: defaults: Conv3d 2.8e-3, RNN 4.5e-4 of the summed magnitude); judged at this tolerance.
TF32_RTOL = 1e-2

# Why a parameter is judged at its dtype, for the messages (keys of the check items).
_WHY = {
    "results": "the dtype of its per-sample gradients and of autograd's gradient",
    "grad_outputs": "the dtype of its module's recorded grad_outputs (autocast)",
    "param": "the dtype of the parameter and of autograd's gradient of it",
    "formed": ("the precision autograd formed its gradient in: its values, or those of another "
               "parameter of its module, are all float32 values, as when the module computes "
               "with its parameters cast down (self.weight.float())"),
}


def _rtol(dtype: torch.dtype, device: Optional[torch.device] = None) -> float:
    # ``device``: where the compared values live (float32 on CUDA with TF32 allowed: TF32_RTOL)
    cuda = device is not None and torch.device(device).type == "cuda"
    return TF32_RTOL if dtype == torch.float32 and cuda and tf32_allowed() else \
        SUM_CHECK_RTOL.get(dtype, 1e-4)


def _looser(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    # The dtype of the two with the larger tolerance (``a`` on a tie).
    return b if _rtol(b) > _rtol(a) else a


def formed_rtol(total: GradTotal) -> Tensor:
    """:data:`SUM_CHECK_RTOL` of :meth:`GradTotal.formed`, a 0-dim tensor (read without a
    sync)."""
    if total.dtype != torch.float64 or total.module:
        return torch.tensor(_rtol(total.formed()))
    return torch.where(total.read_lower(), _rtol(torch.float32), _rtol(total.dtype))


def user_hooks(names: Mapping[int, str], totals: Mapping[int, "GradTotal"]) -> Dict[str, str]:
    """``{name: hooks}`` of the parameters whose gradient the user's hooks registered before
    attach changed (:attr:`GradTotal.hooks`), for the messages of :func:`check_sums` and
    :func:`check_projections` on items that carry no :class:`GradTotal`."""
    return {names[pid]: total.hooks for pid, total in totals.items()
            if total.hooks and pid in names}


def _mismatch(name: str, difference: str, tol: float, of: str, dtype: torch.dtype, why: str,
              relative: float, hooks: Mapping[str, str], results: str,
              rtol: Optional[float] = None) -> GradientMismatchError:
    # The sum check's failure for parameter ``name``: what differs (``difference``), the
    # tolerance ``tol`` (rtol of ``dtype`` times ``of``) and why that dtype, then a cause only
    # where one is established: the user's gradient hooks registered before attach (seen), else
    # what the size of the difference (``relative`` to the magnitude) shows.
    tolerance = "" if tol != tol else f", {tol:.3g}"
    head = (f"the per-sample gradients of {name!r} do not sum to the gradient autograd "
            f"computed for it: {difference}, above the tolerance for {_name(dtype)}{tolerance} "
            f"(rtol {_rtol(dtype) if rtol is None else rtol:g} of {of}; {_name(dtype)} is {why}"
            f"{'; TF32 allowed on CUDA' if rtol == TF32_RTOL else ''})")
    if name in hooks:
        return GradientMismatchError(
            f"{head}. {name!r} has gradient hooks registered before attach ({hooks[name]}, from "
            f"{name}.register_hook(...)) that changed the gradient autograd accumulates, which "
            f"per-sample gradients of the loss do not see. Register such hooks after "
            f"gradhooks.attach (they then change .grad only, after the check), or apply the "
            f"change to the per-sample results")
    size = f"The difference is {relative:.2g} relative to the per-sample gradients' magnitude"
    rounding = next((d for d in (torch.float32, torch.bfloat16)
                     if _rtol(dtype) < _rtol(d) and relative <= _rtol(d)), None)
    if rounding is not None:
        return GradientMismatchError(
            f"{head}. {size}, within {_name(rounding)}'s tolerance: the size of rounding, not of "
            f"a missing gradient term. The module may compute in a lower precision than "
            f"{_name(dtype)} in a way autograd's gradient does not show (gradhooks reads the "
            f"precision off its values); if so, attach(..., check=False) skips the check, and "
            f"the per-sample {results} carry that rounding")
    return GradientMismatchError(
        f"{head}. {size}, far above rounding: autograd's gradient holds a part that the "
        f"recorded calls of the module owning {name!r} do not account for: gradient the "
        f"parameter receives outside the module that owns it (a functional use such as "
        f"x @ layer.weight.T, or a module gradhooks does not hook), or a module that mixes the "
        f"samples. Per-sample {results} would be wrong; use the parameter only through its "
        f"module.")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_sums(items: Sequence[Tuple], scale: Optional[float],
               hooks: Optional[Mapping[str, str]] = None) -> None:
    """Check that per-sample gradients sum to the batch gradient autograd computed.

    ``sum_n grad_n == scale * batch_grad`` must hold for every parameter (linearity of the
    gradient in the loss); it fails when a parameter also receives gradient outside the module
    whose hooks produced ``grad_n``. Checked on :data:`~gradhooks.core.recorder.totals.SUM_CHECK_PROBES` evenly spaced
    coordinates per parameter (:meth:`GradTotal.probe_index`), all parameters of a device in one
    vectorised comparison, each within the :data:`SUM_CHECK_RTOL` of the precision its gradient
    was formed in, relative to ``sum_n |grad_n|`` per coordinate (floored at 1% of the largest
    such sum of the device's parameters, so that rounding in coordinates that cancel within a
    sample passes). The precision is the loosest of the per-sample gradients' dtype,
    ``tol_dtype``, autograd's gradient's dtype (the parameter's) and the precision autograd's
    values show (:meth:`GradTotal.formed`, :func:`formed_in`: float32 inside a float64 model);
    one parameter's precision never loosens another's.

    A parameter whose per-sample gradient is a sum of parts formed apart (a tied weight: the
    embedding's row scatter plus the output layer's product, the latter under autocast in
    bfloat16) is judged relative to ``sum_n sum_parts |part_n|`` instead (``magnitude``): the
    rounding of a sum scales with its terms, not with the sum where they cancel.

    Args:
        items: ``(name, per_sample (B, *shape), batch_grad[, tol_dtype[, why[, magnitude]]])``
            per parameter (``magnitude``: ``(B, K)`` the summed absolute values of the parts at
            the probe coordinates, as ``per_sample`` there; ``None``: ``|per_sample|``); ``batch_grad`` is what autograd computed in the same backward passes: a
            :class:`GradTotal`, a tensor already reduced to the probe coordinates of
            ``per_sample`` (``(K,)`` with ``per_sample`` ``(B, K)``), or ``None``;
            ``tol_dtype`` (default: ``per_sample.dtype``) selects the tolerance, e.g. bfloat16
            when the grad_outputs were bfloat16 (autocast); ``why`` (from :func:`probed`): the
            reason ``tol_dtype`` was chosen, for the message.
        scale: the own-loss scale (:func:`gradhooks.base.utils.own_loss_scale`) already applied to ``per_sample``.
        hooks: the user's gradient hooks of items whose ``batch_grad`` is no :class:`GradTotal`
            (:func:`user_hooks`), named as the cause where their check fails.

    Raises:
        GradientMismatchError: naming the first parameter that fails, the difference, the
            tolerance and the dtype it was judged at; or one that has per-sample gradients but
            no autograd gradient (e.g. ``torch.autograd.grad`` w.r.t. the input).
    """
    groups: Dict[torch.device, list] = {}
    hooks = dict(hooks or {})
    for name, t, total, *rest in items:
        if total is None:
            raise no_total(name)
        dtype = rest[0] if rest and rest[0] is not None else t.dtype
        why = rest[1] if len(rest) > 1 and rest[1] else (
            "results" if dtype == t.dtype else "grad_outputs")
        flat = t.reshape(t.shape[0], -1)
        magnitude = rest[2] if len(rest) > 2 else None
        known = False  # whether the precision autograd's values show is read already
        if isinstance(total, GradTotal):
            if total.hooks:
                hooks[name] = total.hooks
            idx, ref = total.probe_index(), total.probe_values()
            if idx.numel() < flat.shape[1]:
                flat = flat.index_select(1, idx)
                if magnitude is not None:
                    magnitude = magnitude.reshape(flat.shape[0], -1).index_select(1, idx)
            formed, known = total.formed(), True
            if formed != total.dtype and _looser(dtype, formed) != dtype:
                dtype, why = formed, "formed"
        else:
            ref = total.reshape(-1)
        if _looser(dtype, ref.dtype) != dtype:
            dtype, why = ref.dtype, "param"
        groups.setdefault(t.device, []).append([name, flat, ref, dtype, why, known, magnitude])
    for device, entries in groups.items():
        _judge(entries, scale, hooks)


def _judge(entries: list, scale: Optional[float], hooks: Mapping[str, str]) -> None:
    # check_sums on one device: ``entries`` [name, (B, K) per-sample, (K,) autograd's, dtype,
    # why, known], the precision autograd's float64 values show read here for those not known.
    acc = torch.float64 if any(e[1].dtype == torch.float64 for e in entries) else torch.float32
    sizes = [e[1].shape[1] for e in entries]
    device = entries[0][1].device

    def segments(ks):  # the entry (0..len(ks)-1) of each column, formed on the CPU
        return torch.repeat_interleave(torch.arange(len(ks)), torch.tensor([sizes[k] for k in ks]))

    unread = [k for k, e in enumerate(entries)
              if not e[5] and e[3] == torch.float64 and e[2].dtype == torch.float64 and sizes[k]]
    if unread:  # (one vectorised reading, one sync)
        vals = torch.cat([entries[k][2] for k in unread])
        exact, wide = float32_columns(vals)
        at = segments(unread).to(device, non_blocking=True)
        ones = vals.new_ones(len(unread))
        all_exact = ones.scatter_reduce(0, at, exact.to(vals.dtype), "amin")
        any_wide = torch.zeros_like(ones).scatter_reduce(0, at, wide.to(vals.dtype), "amax")
        for k, lower in zip(unread, ((all_exact > 0) & (any_wide > 0)).tolist()):
            if lower:
                entries[k][3], entries[k][4] = torch.float32, "formed"
    per = torch.cat([e[1].to(acc) for e in entries], 1)  # (B, K)
    if not per.shape[1]:
        return
    ref = torch.cat([e[2].to(acc) for e in entries])
    seg = segments(range(len(entries)))
    rtol = torch.tensor([_rtol(e[3], device) for e in entries], dtype=acc)[seg].to(device)  # (K,)
    err = per.sum(0).sub_(ref, alpha=1.0 if scale is None else scale).abs_()
    # per coordinate: its parameter's rtol times sum_n |grad_n| (of its parts where given:
    # ``magnitude``), floored at the same rtol times
    # 1% of the largest such sum (rounding of a coordinate whose per-sample values cancel within
    # each sample); NaN-safe: a NaN per-sample value where autograd's gradient is finite is a
    # mismatch
    mag = torch.cat([(e[1] if e[6] is None else e[6]).to(acc).abs().sum(0) for e in entries])
    top = torch.nan_to_num(mag, nan=0.0, posinf=0.0).max() * 1e-2
    tol = torch.maximum(mag * rtol, rtol * top + torch.finfo(acc).tiny)
    bad = ~(err <= tol) & ref.isfinite()
    if not bool(bad.any()):
        return
    k = int(seg[int(bad.nonzero()[0, 0])])
    name, _, _, dtype, why, _, _ = entries[k]
    mine = (seg == k).to(device) & bad
    ratio = torch.where(mine, torch.nan_to_num(err / tol, nan=float("inf")), -1.0)
    j = int(ratio.argmax())
    e, t = float(err[j]), float(tol[j])
    if e != e:
        difference = "a per-sample value is not a number where autograd's gradient is finite"
        relative = float("inf")
    else:
        difference = f"they differ by {e:.3g}"
        relative = e * float(rtol[j]) / t
    raise _mismatch(name, difference, t, "the per-sample gradients' summed magnitude",
                    dtype, _WHY[why], relative, hooks, "gradients", float(rtol[j]))


def no_total(name: str) -> GradientMismatchError:
    """The error for a parameter with per-sample results but no autograd gradient."""
    return GradientMismatchError(
        f"grad_outputs were recorded for the module owning {name!r}, but autograd computed no "
        f"gradient for {name!r} in those backward passes (e.g. torch.autograd.grad with respect "
        f"to the input only, or torch.func.functional_call(model, params, x), whose forward "
        f"uses the tensors passed in instead of the parameters); per-sample gradients of the "
        f"parameters are not defined for such a pass"
    )


def projection_terms(name: str, a: Tensor, g: Tensor, total: Optional[GradTotal],
                      rows: Optional[slice] = None, transposed: bool = False) -> Tensor:
    """Sum check of a Gram-form weight on a random rank-one projection (this module's docstring):
    ``(got, ref, bound, rtol)``, with ``got = sum_{n,g,s} (a . u)(g . v_g)`` from the records,
    ``ref = v^T W u`` from autograd's gradient ``W`` (viewed as ``(dim 0, rest)``,
    :meth:`GradTotal.projection`) and ``bound`` the scale of the rounding
    errors of both (``sum |a . u||g . v| + ||W|| ||u|| ||v||``), and ``rtol``, the tolerance of
    the precision autograd formed ``W`` in (:meth:`GradTotal.formed`), which
    :func:`check_projections` takes where it is looser than the item's. ``a`` ``(N, G, S, I)``,
    ``g`` ``(N, G, S, O)``: the canonical form, or one row block ``rows`` of ``W`` (``G = 1``); then
    ``ref`` and the bound's second term count only for the first block (``rows.start == 0``):
    the blocks' ``got`` add up to the whole projection. ``transposed``: the weight is stored as
    ``W^T`` ``(I, O)`` (:attr:`~gradhooks.base.registry.LayerRule.weight_transposed`), so ``u`` runs
    over ``O`` and ``v`` over ``I``: ``got = sum (a . v)(g . u)`` (``G = 1``, no ``rows``).

    Raises:
        GradientMismatchError: if autograd computed no gradient for the parameter.
    """
    if total is None:
        raise no_total(name)
    shape = total.shape
    u, v, uv = bilinear_directions(shape[0], shape.numel() // shape[0], a.dtype, a.device)
    if transposed:
        u, v = v, u
    if rows is not None:
        v = v[rows]
    grp, o = a.shape[1], g.shape[-1]
    if grp == 1:  # plain matrix products
        prod = (a.reshape(-1, a.shape[-1]) @ u).mul_(g.reshape(-1, o) @ v)
    else:
        prod = (a @ u).mul_((g * v.view(grp, 1, o)).sum(-1))  # (N, G, S)
    ref, norm = total.projection(a.dtype)
    formed = formed_rtol(total).to(ref)
    if rows is not None and rows.start != 0:  # (the blocks' terms add up: counted once)
        ref, norm, formed = torch.zeros_like(ref), torch.zeros_like(norm), torch.zeros_like(formed)
    return torch.stack([prod.sum(), ref, prod.abs().sum() + norm * uv, formed])


def check_projections(items: List[Tuple[str, Tensor, torch.dtype]],
                      hooks: Optional[Mapping[str, str]] = None) -> None:
    """Compare the :func:`projection_terms` of every Gram-form weight at once (``hooks``: the
    user's gradient hooks, :func:`user_hooks`, named as the cause where they ran).

    Each weight is judged at its own precision: the loosest of ``dtype`` (the item's) and the
    one autograd formed its gradient in (:meth:`GradTotal.formed`, the terms' last entry).

    Raises:
        GradientMismatchError: naming the first parameter whose projection differs by more than
            ``SUM_CHECK_RTOL[dtype] * bound``, the difference, the tolerance and the dtype.
    """
    summed: Dict[str, list] = {}  # a parameter's row blocks add up
    for name, terms, dt in items:
        if name in summed:
            summed[name][1] = summed[name][1] + terms
        else:
            summed[name] = [name, terms, dt]
    by_device: Dict[torch.device, list] = {}
    for item in summed.values():
        by_device.setdefault(item[1].device, []).append(item)
    for group in by_device.values():
        dt = torch.float64 if any(t.dtype == torch.float64 for _, t, _ in group) else torch.float32
        terms = torch.stack([t.to(dt) for _, t, _ in group])  # (P, 4)
        given = terms.new_tensor([_rtol(d, terms.device) for _, _, d in group])
        rtol = torch.maximum(given, terms[:, 3])
        diff = (terms[:, 0] - terms[:, 1]).abs()
        bad = diff > rtol * terms[:, 2] + torch.finfo(terms.dtype).tiny
        if bool(bad.any()):
            k = int(bad.nonzero()[0, 0])
            name, _, dtype = group[k]
            got, ref, bound, formed = terms[k].tolist()
            why = "grad_outputs" if dtype in (torch.bfloat16, torch.float16) else "results"
            if formed > _rtol(dtype):
                dtype = next(d for d in (torch.float32, torch.bfloat16, torch.float16)
                             if _rtol(d) == formed)
                why = "formed"
            d = abs(got - ref)
            raise _mismatch(name, f"on a random projection, {got:.6g} vs autograd's {ref:.6g}, "
                            f"they differ by {d:.3g}", _rtol(dtype, terms.device) * bound,
                            "the projection's rounding bound", dtype, _WHY[why],
                            d / bound if bound > 0 else float("inf"), hooks or {}, "norms")


def probed(name: str, t: Tensor, total: Optional[GradTotal], tol_dtype: torch.dtype,
            rows: Optional[slice] = None) -> Optional[tuple]:
    """A :func:`check_sums` item reduced to the probe coordinates, so that
    ``t`` need not be kept: ``t`` ``(N, *shape)`` is the per-sample gradient of the parameter
    (or its :class:`~gradhooks.base.segments.Segments`), or of its rows ``rows`` (dim 0); ``None`` if no probe falls in those rows. Its tolerance
    dtype is ``tol_dtype``, or the precision autograd formed the gradient in where that is
    lower (:meth:`GradTotal.formed`); ``None`` too where autograd computed no gradient and
    ``t`` is all zeros, which says the same (a replayed module's output nothing used).

    Raises:
        GradientMismatchError: nonzero per-sample values where autograd computed no gradient
            (:func:`no_total`)."""
    if total is None:
        if isinstance(t, Tensor) and not bool(t.count_nonzero()):
            return None
        raise no_total(name)
    idx, ref = total.probe_index(), total.probe_values()
    factored = isinstance(t, Segments)  # (each sample's values at the probes, from its rows)
    flat = t.at(idx) if factored else t.reshape(t.shape[0], -1)
    if rows is not None and not factored:
        cols = total.shape.numel() // total.shape[0]
        inside = (idx >= rows.start * cols) & (idx < rows.stop * cols)
        idx, ref = idx[inside] - rows.start * cols, ref[inside]
        if not idx.numel():
            return None
    if idx.numel() < flat.shape[1]:
        flat = flat.index_select(1, idx)
    formed = total.formed()  # (the passes' precision: the probes' sum no longer shows it)
    if formed != total.dtype and _looser(tol_dtype, formed) != tol_dtype:
        return name, flat, ref, formed, "formed"
    return name, flat, ref, tol_dtype


class Evidence:
    """What one read's computation hands the verification: its per-sample results reduced to
    the sum check's probe coordinates (:func:`probed`, items of :func:`check_sums`) and its
    Gram-form weights' projection terms (:func:`projection_terms`), declared where those tensors
    are computed and judged together by :meth:`judge`.

    Attributes:
        batch: the snapshot read.
        due: whether this read's sum check is due (``batch.check_key`` set): only then is
            anything declared.
        probes: :func:`check_sums` items, per parameter (or row block of one).
        projections: ``(name, terms (4,), dtype)`` per Gram-form weight (or row block).
    """

    __slots__ = ("batch", "due", "probes", "projections")

    def __init__(self, batch: Batch):
        self.batch = batch
        self.due = batch.check_key is not None
        self.probes: List[tuple] = []
        self.projections: List[Tuple[str, Tensor, torch.dtype]] = []

    def probe(self, pid: int, t, tol_dtype: torch.dtype, rows: Optional[slice] = None) -> None:
        """Declare parameter ``pid``'s per-sample gradient ``t`` ``(N, *shape)`` (or its
        :class:`~gradhooks.base.segments.Segments`, or its rows ``rows``) at the probe
        coordinates, judged at ``tol_dtype`` or looser (:func:`probed`)."""
        item = probed(self.batch.names[pid], t, self.batch.totals.get(pid), tol_dtype, rows)
        if item is not None:
            self.probes.append(item)

    def project(self, pid: int, a: Tensor, g: Tensor, tol_dtype: torch.dtype,
                rows: Optional[slice] = None, transposed: bool = False) -> None:
        """Declare the projection terms of Gram-form weight ``pid`` from its canonical form
        ``a`` ``(N, G, S, I)``, ``g`` ``(N, G, S, O)`` (:func:`projection_terms`)."""
        name = self.batch.names[pid]
        self.projections.append((name, projection_terms(name, a, g, self.batch.totals.get(pid),
                                                        rows, transposed), tol_dtype))

    def judge(self, scale: Optional[float] = None) -> None:
        """The verdict on everything declared, once per read, before the read writes anything:
        :func:`check_sums` of the probes (``scale``: the own-loss scale already applied to
        them), :func:`check_projections` of the projections; then the read's sum check is
        noted as passed (:meth:`~gradhooks.core.recorder.records.Batch.check_passed`).

        Raises:
            GradientMismatchError: as :func:`check_sums` and :func:`check_projections`.
        """
        if not self.due:
            return
        hooks = user_hooks(self.batch.names, self.batch.totals)  # (named in the messages)
        if self.probes:
            check_sums(self.probes, scale, hooks)
        if self.projections:
            check_projections(self.projections, hooks)
        self.batch.check_passed()


def check_unrecorded(batch: Batch, recorded) -> None:
    """Refuse parameters autograd reached whose module the hooks never saw called (a parent
    reading ``child.weight`` functionally): their per-sample results are unknown. Checked
    where the read checks for them (``batch.checking``: ``check`` is on and the backward
    computed parameter gradients).

    Args:
        batch: the snapshot (its names, hooked parameters and :class:`GradTotal` per parameter
            autograd computed a gradient for).
        recorded: ids of the parameters the read has per-sample results for.

    Raises:
        GradientMismatchError: naming those parameters.
    """
    if not batch.checking:
        return
    recorded = set(recorded)
    missing = [name for pid, name in batch.names.items()
               if pid in batch.totals and pid in batch.params and pid not in recorded]
    if missing:
        raise GradientMismatchError(
            f"autograd computed gradients for {', '.join(map(repr, missing))}, but the "
            f"hooks saw no call of the module that owns them: the parameters are used "
            f"outside their module's forward (functionally, e.g. by a parent module that "
            f"reads child.weight directly). Their per-sample gradients are unknown; give "
            f"the parent a rule (gradhooks.register_rule) that claims them"
        )


#: Relative tolerance of the sample check (:mod:`gradhooks.readers.sample_check`) per dtype of
#: the compared values, against the row's norm over all parameters: the records' rows and
#: autograd's masked pass round differently (float32: about 1e-6 of the norm through a
#: 12-layer Transformer); a pairing op changes a row by order 1.
SAMPLE_CHECK_RTOL = {torch.float64: 1e-7, torch.float32: 2e-3, torch.bfloat16: 1e-1,
                     torch.float16: 1e-1}


def judge_sample_rows(ours: Mapping[int, Tensor], ref: Mapping[int, Tensor], rows: Sequence[int],
                      dtype: torch.dtype, names: Mapping[int, str], what: str,
                      summed: bool = False) -> bool:
    """The sample check's verdict: the per-sample results' squared norms of the checked rows
    against autograd's gradient of those samples' own loss terms through the batched forward
    (:mod:`gradhooks.readers.sample_check` computes both).

    Args:
        ours, ref: ``{key: (R,)}`` squared norms of the rows ``rows`` (``R`` of them): ``key``
            is ``id(param)``, or 0 for the sum over all parameters (``summed``); the keys of
            both are compared.
        dtype: the precision of the compared values (:data:`SAMPLE_CHECK_RTOL`).
        names: ``{id(param): name}``; ``what``: the loss (both for the message).

    Returns:
        Whether every compared value was finite (a non-finite row, a float16 step that
        overflowed, which the GradScaler skips, is not judged: a later step of the structure
        is).

    Raises:
        SampleMixingError: a row differs by more than ``SAMPLE_CHECK_RTOL[dtype]`` of its
            norm: something between the samples' inputs and their loss terms pairs samples.
    """
    keys = [k for k in ours if k in ref]
    if not keys:
        return False
    dev = ours[keys[0]].device
    mine = torch.stack([ours[k].to(dev).clamp(min=0).sqrt() for k in keys])  # (P, R)
    theirs = torch.stack([ref[k].to(dev).clamp(min=0).sqrt() for k in keys])
    total = torch.maximum(mine.square().sum(0), theirs.square().sum(0)).sqrt()  # (R,)
    rtol = SAMPLE_CHECK_RTOL.get(dtype, 2e-3)
    diff = (mine - theirs).abs()
    finite = torch.isfinite(mine) & torch.isfinite(theirs)
    bad = ~(diff <= rtol * total + 1e-30) & finite.all(0, keepdim=True)
    if not bool(bad.any()):
        return bool(finite.all())
    k, r = (int(i) for i in bad.nonzero()[0])
    name = "all parameters together" if summed else repr(names.get(keys[k], "?"))
    n = rows[r]
    raise SampleMixingError(
        f"the sample check: sample {n}'s gradient of its own term of {what}, taken by "
        f"autograd through the batched forward, has norm {float(theirs[k, r]):.6g} for "
        f"{name}, but row {n} of the per-sample results has {float(mine[k, r]):.6g} (a "
        f"difference of {float(diff[k, r]):.3g}, tolerance {rtol:g} of the row's norm "
        f"{float(total[r]):.6g}): " + _PAIRS)


_PAIRS = ("something between the samples' inputs and their loss terms pairs samples -- an op in "
          "the model or in the loss after it (z @ z.T, a sort, a softmax or a statistic over the "
          "batch, an index that moves rows between samples), so the per-sample gradients are not "
          "defined for it. Compute each sample's loss from its own rows only (gh.set_sample_ids "
          "groups rows that form one sample), or, to read the batch's contributions on purpose, "
          "attach(..., allow_sample_mixing=True)")


def judge_weighted_sums(ours: Mapping[int, Tensor], ref: Mapping[int, Tensor], spread: float,
                        dtype: torch.dtype, names: Mapping[int, str], what: str) -> bool:
    """The sample check's verdict on every row at once: the records' ``sum_n w_n g_n`` against
    autograd's gradient of ``sum_n w_n l_n`` through the batched forward (``w_n`` distinct
    random weights), both sketched per parameter (:mod:`gradhooks.readers.sample_check`
    computes them).

    Args:
        ours, ref: ``{id(param): (K,)}`` float64 sketches ``u_k^T W z_k`` of the two sums; a
            parameter of ``ref`` missing from ``ours`` (no record formed its sum) counts as
            zero.
        spread: ``sum_n w_n^2 ||g_n||^2`` over the records' rows and parameters: the expected
            squared norm of a weighted sum, the scale of the tolerance.
        dtype: the precision of the compared values (:data:`SAMPLE_CHECK_RTOL`).
        names: ``{id(param): name}``; ``what``: the loss (both for the message).

    Returns:
        Whether every compared value was finite (a non-finite one is not judged).

    Raises:
        SampleMixingError: the sums differ by more than ``SAMPLE_CHECK_RTOL[dtype]`` of the
            larger of ``sqrt(spread)`` and the sums' size: some row is not its sample's
            gradient.
    """
    keys = list(ref)
    if not keys:
        return False
    theirs = torch.stack([ref[k] for k in keys])  # (P, K)
    mine = torch.stack([ours.get(k, torch.zeros_like(ref[k])) for k in keys])
    if not (bool(torch.isfinite(mine).all()) and bool(torch.isfinite(theirs).all())
            and spread == spread and spread != float("inf")):
        return False
    probes = theirs.shape[1]
    size = max(spread, float(theirs.square().sum()) / probes, float(mine.square().sum()) / probes)
    diff = (mine - theirs).square().sum(1).div(probes).sqrt()  # (P,): rms over the sketches
    rtol = SAMPLE_CHECK_RTOL.get(dtype, 2e-3)
    total = float(diff.square().sum().sqrt())
    if total <= rtol * size ** 0.5 + 1e-30:
        return True
    k = int(diff.argmax())
    raise SampleMixingError(
        f"the sample check: the sum of every sample's per-sample result times a random weight "
        f"differs from autograd's gradient of the same weighted sum of {what}, taken through the "
        f"batched forward, by {total:.3g} (tolerance {rtol:g} of {size ** 0.5:.6g}, the size "
        f"of such a sum), most in {names.get(keys[k], '?')!r} ({float(diff[k]):.3g}): some "
        f"row, not necessarily a checked one, is not its sample's gradient: " + _PAIRS)
