"""The sum check, in one place: per-sample results must add up to autograd's batch gradient.

``sum_n grad_n == scale * batch_grad`` holds for every parameter by linearity of the gradient in
the loss. It fails when a parameter also receives gradient outside the module whose hooks
produced ``grad_n`` (a functional use, ``x @ layer.weight.T``), when a module mixes samples under
the fallback, or when a backward computed no parameter gradient. This module holds

* :class:`GradTotal`: autograd's gradient of a parameter as the recorder keeps it for the check;
* :func:`check_sums`: materialised per-sample gradients on probe coordinates;
* :func:`projection_terms` / :func:`check_projections`: Gram-form (never materialised) weights on
  a fixed random rank-one projection ``sum_g v_g^T (sum_n dW_n[g]) u_g``, computed from the
  records as ``sum_{n,g,s} (a[n,g,s] . u_g)(g[n,g,s] . v_g)`` (cost ``N G S (I + O)``);
* :func:`check_unrecorded`: parameters autograd reached whose module the hooks never saw;
* :func:`formed_in` / :meth:`GradTotal.formed` / :func:`module_precision`: the precision autograd
  formed a gradient in, as its values (or those of another parameter of its module) establish
  it, which selects the tolerance (:data:`SUM_CHECK_RTOL`);
*when* the check runs (each new call structure, every 100th read, or always) is
:class:`gradhooks.core.check_policy.SumCheck`.

The other validity checks of a read are :func:`gradhooks.core.batch_reads.refusal`.
"""
from __future__ import annotations

import functools
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..base.errors import GradientMismatchError
from ..base.segments import Segments
from ..base.utils import tf32_allowed

__all__ = ["GradTotal", "bilinear_directions", "check_sums", "projection_terms",
           "check_projections", "probed", "no_total", "check_unrecorded",
           "SUM_CHECK_RTOL", "SUM_CHECK_PROBES", "user_hooks", "formed_in", "module_precision"]

# Relative tolerance of check_sums per dtype: the sum of B per-sample values may differ from
# autograd's batch value by rounding, relative to sum_n |value_n| (B * eps in the worst case).
# Each parameter is judged at the precision its gradient was formed in (check_sums).
SUM_CHECK_RTOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}
#: float32 on CUDA where TF32 is allowed (:func:`~gradhooks.base.utils.tf32_allowed`): autograd
#: forms a convolution's or an RNN's batch gradient at about TF32's precision (H200, torch's
#: defaults: Conv3d 2.8e-3, RNN 4.5e-4 of the summed magnitude); judged at this tolerance.
TF32_RTOL = 1e-2
SUM_CHECK_PROBES = 256

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


def _float32_columns(values: Tensor) -> Tuple[Tensor, Tensor]:
    # Per float64 value: whether it is exactly a float32 value, and whether it needs more
    # significant bits than float16 / bfloat16 hold (11): a value of float32's precision, not a
    # small integer or a power of two, which every float is.
    exact = values.to(torch.float32).to(torch.float64) == values
    wide = exact & (torch.frexp(values).mantissa * 2048).frac().ne(0)
    return exact, wide


def formed_in(values: Tensor) -> Tensor:
    """Whether autograd's gradient ``values`` (float64, e.g. a parameter's at the probe
    coordinates) were formed in float32: a 0-dim bool tensor, true when every value is exactly a
    float32 value and some value needs more than the 11 significant bits of float16 / bfloat16.

    A float64 value computed in float64 is a float32 value with probability ``2**-29``; autograd
    casts a gradient it formed in float32 up to the parameter's dtype (the backward of
    ``self.weight.float()``): every value is then a float32 value. So a parameter a float64
    model uses in float32 (Gemma's RMSNorm ``1 + self.weight.float()``, Mamba's
    ``self.D.float()``) is judged at float32's tolerance, established from what autograd
    computed, and only such a parameter."""
    if values.dtype != torch.float64 or not values.numel():
        return torch.zeros((), dtype=torch.bool, device=values.device)
    exact, wide = _float32_columns(values)
    return exact.all() & wide.any()


@functools.lru_cache(maxsize=256)
def _probe_index(numel: int, probes: int, device: torch.device) -> Tensor:
    """``probes`` evenly spaced flat coordinates of ``[0, numel)``, first and last included, in
    int64 arithmetic (``k (numel - 1) // (probes - 1)``): a float32 ``linspace`` rounds
    ``numel - 1`` to ``numel`` above ``2**24`` elements (every word embedding of a
    pretrained-size language model) and indexes out of range."""
    k = torch.arange(probes, dtype=torch.int64, device=device)
    return k.mul_(numel - 1).div_(max(probes - 1, 1), rounding_mode="floor")


@functools.lru_cache(maxsize=64)
def bilinear_directions(rows: int, cols: int, dtype: torch.dtype,
                        device: torch.device) -> Tuple[Tensor, Tensor, float]:
    """Fixed random directions for the sum check's projection of a weight viewed as a
    ``(rows, cols)`` matrix (dim 0 by the rest): ``u`` ``(cols,)``, ``v`` ``(rows,)`` and
    ``||u|| ||v||``; the same values for every dtype and device (drawn in float64)."""
    gen = torch.Generator().manual_seed(20240501)
    u = torch.randn(cols, generator=gen, dtype=torch.float64)
    v = torch.randn(rows, generator=gen, dtype=torch.float64)
    return u.to(device, dtype), v.to(device, dtype), float(u.norm() * v.norm())


class GradTotal:
    """Autograd's gradient of one parameter summed over the backward passes of a batch, kept in
    the form the sum check reads it.

    A parameter with fewer than :attr:`SUMMARISE` elements (or a sparse gradient) is kept whole.
    A larger one is reduced at once to its values at the probe coordinates
    (:func:`check_sums`) and, with 2 or more dims, to ``v^T W u`` and ``||W||`` for the
    directions of :func:`bilinear_directions` (``W`` = the gradient viewed as ``(dim 0, rest)``):
    holding the gradient itself would make autograd copy it into ``param.grad`` instead of
    moving it there, one parameter-sized allocation per step (CNN: 4.8 MB, wide MLP: 2.5 MB).

    It also keeps what the gradient's values show of the precision autograd formed it in
    (:meth:`formed`), per backward pass: a sum over passes is no float32 value any more.
    """

    #: elements from which the gradient is summarised instead of kept.
    SUMMARISE = 1 << 16

    __slots__ = ("full", "shape", "device", "dtype", "probes", "proj", "norm", "hooks", "lower",
                 "module")

    def __init__(self, grad: Tensor):
        self.shape, self.device, self.dtype = grad.shape, grad.device, grad.dtype
        self.full: Optional[Tensor] = None
        #: the user's gradient hooks that ran on the parameter before ours (names), or None
        self.hooks: Optional[str] = None
        #: a float64 gradient: whether a backward pass's gradient was formed in float32
        #: (:func:`formed_in`, a 0-dim bool tensor); None until read (:meth:`read_lower`)
        self.lower: Optional[Tensor] = None
        #: whether the parameter's module computes in float32 (:func:`module_precision`)
        self.module = False
        if grad.numel() < self.SUMMARISE or grad.layout != torch.strided:
            self.full = grad
            return
        self.probes, self.proj, self.norm = self._summary(grad)

    def add(self, grad: Tensor) -> None:
        """Add the gradient of another backward pass."""
        if self.dtype == torch.float64:  # (each pass's precision: their sum no longer shows it)
            dense = grad.layout == torch.strided
            self.lower = self.read_lower() | (dense and formed_in(
                grad.reshape(-1).index_select(0, self.probe_index())))
        if self.full is not None:
            self.full = self.full + grad
            return
        probes, proj, norm = self._summary(grad)
        self.probes = self.probes + probes
        self.proj = None if proj is None else self.proj + proj
        self.norm = None if norm is None else self.norm + norm  # an upper bound of ||sum||

    def formed(self) -> torch.dtype:
        """The precision autograd formed this gradient in, as far as the values establish it:
        float32 for a float64 gradient of which some backward pass's values are all float32
        values (:func:`formed_in`), or whose module computes in float32 (:attr:`module`); else
        the gradient's dtype."""
        if self.dtype != torch.float64:
            return self.dtype
        return torch.float32 if self.module or bool(self.read_lower()) else self.dtype

    def formed_rtol(self) -> Tensor:
        """:data:`SUM_CHECK_RTOL` of :meth:`formed`, a 0-dim tensor (read without a sync)."""
        if self.dtype != torch.float64 or self.module:
            return torch.tensor(_rtol(self.formed()))
        return torch.where(self.read_lower(), _rtol(torch.float32), _rtol(self.dtype))

    def read_lower(self) -> Tensor:
        """:attr:`lower` of a float64 gradient, read from its values if not yet."""
        if self.lower is None:
            self.lower = formed_in(self.probe_values())
        return self.lower

    def _summary(self, grad: Tensor):
        flat = grad.reshape(-1)
        probes = flat.index_select(0, self.probe_index())
        if grad.dim() < 2:
            return probes, None, None
        w = grad.reshape(grad.shape[0], -1)
        w = w.to(torch.promote_types(w.dtype, torch.float32))
        u, v, _ = bilinear_directions(w.shape[0], w.shape[1], w.dtype, w.device)
        return probes, torch.dot(v, w @ u), torch.linalg.vector_norm(w)

    def probe_index(self) -> Tensor:
        """The flat coordinates of the probes: :data:`SUM_CHECK_PROBES` evenly spaced ones, or
        all of them for a smaller parameter."""
        numel = self.shape.numel()
        if numel <= SUM_CHECK_PROBES:
            return torch.arange(numel, device=self.device)
        return _probe_index(numel, SUM_CHECK_PROBES, self.device)

    def probe_values(self) -> Tensor:
        """The gradient at :meth:`probe_index`, ``(K,)``."""
        if self.full is None:
            return self.probes
        full = self.full.to_dense() if self.full.layout != torch.strided else self.full
        return full.reshape(-1).index_select(0, self.probe_index())

    def projection(self, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
        """``(v^T W u, ||W||)`` in ``dtype`` (:func:`bilinear_directions`; 2+ dims only)."""
        if self.full is None:
            return self.proj.to(dtype), self.norm.to(dtype)
        w = self.full.reshape(self.shape[0], -1).to(dtype)
        u, v, _ = bilinear_directions(w.shape[0], w.shape[1], dtype, w.device)
        return torch.dot(v, w @ u), torch.linalg.vector_norm(w)


def module_precision(modules: Iterable[Sequence[Optional["GradTotal"]]]) -> None:
    """The precision a module computes in, from its parameters' gradients: where autograd
    formed the float64 gradient of one parameter of a module in float32 (:func:`formed_in`: the
    module casts it down, ``self.D.float()``), the module computes in float32, and its other
    float64 parameters are judged at float32 too (:attr:`GradTotal.module`): their gradients are
    float64 sums of values formed in float32, which a rule that recomputes the module per sample
    (the ``torch.func`` fallback) rounds otherwise than the batched forward (the Mamba mixer's
    ``conv1d.bias``, next to ``A_log.float()`` and ``D.float()``).

    Args:
        modules: per module, the :class:`GradTotal` of each of its parameters (``None``: no
            gradient). One sync per device.
    """
    groups = [[t for t in totals if t is not None and t.dtype == torch.float64]
              for totals in modules]
    groups = [g for g in groups if len(g) > 1]
    by_device: Dict[torch.device, list] = {}
    for g in groups:
        for t in g:
            by_device.setdefault(t.device, []).append(t)
    lowered = set()
    for totals in by_device.values():
        flags = torch.stack([t.read_lower() for t in totals]).tolist()
        lowered.update(id(t) for t, flag in zip(totals, flags) if flag)
    for g in groups:
        if any(id(t) in lowered for t in g):
            for t in g:
                t.module = True


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
    whose hooks produced ``grad_n``. Checked on :data:`SUM_CHECK_PROBES` evenly spaced
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
        exact, wide = _float32_columns(vals)
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
    """Sum check of a Gram-form weight on a random rank-one projection (module docstring):
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
    formed = total.formed_rtol().to(ref)
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
    lower (:meth:`GradTotal.formed`)."""
    if total is None:
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


def check_unrecorded(names: Mapping[int, str], params: Mapping[int, object],
                     totals: Mapping[int, object], recorded: Iterable[int]) -> None:
    """Refuse parameters autograd reached whose module the hooks never saw called (a parent
    reading ``child.weight`` functionally): their per-sample results are unknown.

    Args:
        names: ``{id(param): name}`` of the model's parameters.
        params: ``{id(param): param}`` of the hooked parameters.
        totals: ``{id(param): GradTotal}``: the parameters autograd computed a gradient for.
        recorded: ids of the parameters the read has per-sample results for.

    Raises:
        GradientMismatchError: naming those parameters.
    """
    recorded = set(recorded)
    missing = [name for pid, name in names.items()
               if pid in totals and pid in params and pid not in recorded]
    if missing:
        raise GradientMismatchError(
            f"autograd computed gradients for {', '.join(map(repr, missing))}, but the "
            f"hooks saw no call of the module that owns them: the parameters are used "
            f"outside their module's forward (functionally, e.g. by a parent module that "
            f"reads child.weight directly). Their per-sample gradients are unknown; give "
            f"the parent a rule (gradhooks.register_rule) that claims them"
        )

