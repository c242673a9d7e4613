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
* :class:`SumCheck`: *when* the check runs (each new call structure, every 100th read, or
  always), so that a training loop pays for it once per structure;
* :func:`refusal`: the other validity checks of a read, in one place (records released or stale,
  the model changed, several forwards, ``create_graph``, no backward, hooks that never ran).
"""
from __future__ import annotations

import functools
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..base.errors import (GradHooksError, GradientMismatchError, HigherOrderGradError, NoBackwardError,
                     RecordsReleasedError)

__all__ = ["GradTotal", "bilinear_directions", "check_sums", "projection_terms",
           "check_projections", "probed", "no_total", "check_unrecorded", "SumCheck",
           "SUM_CHECK_RTOL", "SUM_CHECK_PROBES", "refusal", "user_hooks"]

# Relative tolerance of check_sums per dtype: the sum of B per-sample values may differ from
# autograd's batch value by rounding, relative to sum_n |value_n| (B * eps in the worst case).
SUM_CHECK_RTOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}
SUM_CHECK_PROBES = 256


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
    """

    #: elements from which the gradient is summarised instead of kept.
    SUMMARISE = 1 << 16

    __slots__ = ("full", "shape", "device", "probes", "proj", "norm", "hooks")

    def __init__(self, grad: Tensor):
        self.shape, self.device = grad.shape, grad.device
        self.full: Optional[Tensor] = None
        #: the user's gradient hooks that ran on the parameter before ours (names), or None
        self.hooks: Optional[str] = None
        if grad.numel() < self.SUMMARISE or grad.layout != torch.strided:
            self.full = grad
            return
        self.probes, self.proj, self.norm = self._summary(grad)

    def add(self, grad: Tensor) -> None:
        """Add the gradient of another backward pass."""
        if self.full is not None:
            self.full = self.full + grad
            return
        probes, proj, norm = self._summary(grad)
        self.probes = self.probes + probes
        self.proj = None if proj is None else self.proj + proj
        self.norm = None if norm is None else self.norm + norm  # an upper bound of ||sum||

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


def user_hooks(names: Mapping[int, str], totals: Mapping[int, "GradTotal"]) -> Dict[str, str]:
    """``{name: hooks}`` of the parameters whose gradient the user's hooks registered before
    attach changed (:attr:`GradTotal.hooks`), for the messages of :func:`check_sums` and
    :func:`check_projections` on items that carry no :class:`GradTotal`."""
    return {names[pid]: total.hooks for pid, total in totals.items()
            if total.hooks and pid in names}


def _mismatch(name: str, difference: str, hooks: Mapping[str, str], results: str
              ) -> GradientMismatchError:
    # The sum check's failure for parameter ``name``: the user's gradient hooks registered
    # before attach where there are some (the likelier cause), else a use outside its module.
    head = (f"the per-sample gradients of {name!r} do not sum to the gradient autograd "
            f"computed for it ({difference})")
    if name in hooks:
        return GradientMismatchError(
            f"{head}: {name!r} has gradient hooks registered before attach ({hooks[name]}, from "
            f"{name}.register_hook(...)) that changed the gradient autograd accumulates, which "
            f"per-sample gradients of the loss do not see. Register such hooks after "
            f"gradhooks.attach (they then change .grad only, after the check), or apply the "
            f"change to the per-sample results")
    return GradientMismatchError(
        f"{head}. The parameter receives gradient outside the module that owns it (a functional "
        f"use such as x @ layer.weight.T, or a module gradhooks does not hook); per-sample "
        f"{results} would be wrong. Use the parameter only through its module.")


def check_sums(items: Sequence[Tuple], scale: Optional[float],
               hooks: Optional[Mapping[str, str]] = None) -> None:
    """Check that per-sample gradients sum to the batch gradient autograd computed.

    ``sum_n grad_n == scale * batch_grad`` must hold for every parameter (linearity of the
    gradient in the loss); it fails when a parameter also receives gradient outside the module
    whose hooks produced ``grad_n``. Checked on :data:`SUM_CHECK_PROBES` evenly spaced
    coordinates per parameter (:meth:`GradTotal.probe_index`), all parameters of a device in one vectorised comparison, within
    :data:`SUM_CHECK_RTOL` relative to ``sum_n |grad_n|`` per coordinate (floored at 1% of the
    largest such bound, so that rounding in coordinates that cancel within a sample passes).

    Args:
        items: ``(name, per_sample (B, *shape), batch_grad[, tol_dtype])`` per parameter;
            ``batch_grad`` is what autograd computed in the same backward passes: a
            :class:`GradTotal`, a tensor already reduced to the probe coordinates of
            ``per_sample`` (``(K,)`` with ``per_sample`` ``(B, K)``), or ``None``;
            ``tol_dtype`` (default: ``per_sample.dtype``) selects the tolerance, e.g. bfloat16
            when the grad_outputs were bfloat16 (autocast).
        scale: the own-loss scale (:func:`gradhooks.base.utils.own_loss_scale`) already applied to ``per_sample``.
        hooks: the user's gradient hooks of items whose ``batch_grad`` is no :class:`GradTotal`
            (:func:`user_hooks`), named as the cause where their check fails.

    Raises:
        GradientMismatchError: naming the first parameter that fails, or that has per-sample
            gradients but no autograd gradient (e.g. ``torch.autograd.grad`` w.r.t. the input).
    """
    groups: Dict[torch.device, list] = {}
    hooks = dict(hooks or {})
    for name, t, total, *tol_dtype in items:
        if total is None:
            raise no_total(name)
        if isinstance(total, GradTotal) and total.hooks:
            hooks[name] = total.hooks
        flat = t.reshape(t.shape[0], -1)
        if isinstance(total, GradTotal):
            idx, ref = total.probe_index(), total.probe_values()
            if idx.numel() < flat.shape[1]:
                flat = flat.index_select(1, idx)
        else:
            ref = total.reshape(-1)
        groups.setdefault(t.device, []).append((name, flat, ref, SUM_CHECK_RTOL.get(tol_dtype[0] if tol_dtype else t.dtype, 1e-4)))
    for device, entries in groups.items():
        acc = torch.float64 if any(e[1].dtype == torch.float64 for e in entries) else torch.float32
        per = torch.cat([e[1].to(acc) for e in entries], 1)  # (B, K)
        ref = torch.cat([e[2].to(acc) for e in entries])
        rtol = max(e[3] for e in entries)  # the loosest dtype of the group
        err = per.sum(0).sub_(ref, alpha=1.0 if scale is None else scale).abs_()
        # per coordinate: rtol * sum_n |grad_n|, floored at 1% of that for the largest coordinate
        # (rounding of a coordinate whose per-sample values cancel within each sample)
        tol = per.abs().sum(0).mul_(rtol)
        # NaN-safe: a NaN per-sample value where autograd's gradient is finite is a mismatch
        floor = float(torch.nan_to_num(tol, nan=0.0, posinf=0.0).max()) * 1e-2 + torch.finfo(acc).tiny
        bad = ~(err <= tol.clamp_(min=floor)) & ref.isfinite()
        if bool(bad.any()):
            sizes = [e[1].shape[1] for e in entries]
            first = int(bad.nonzero()[0, 0])
            k = 0
            for (name, *_), size in zip(entries, sizes):
                k += size
                if first < k:
                    break
            raise _mismatch(name, f"largest difference {err.max().item():.3g}", hooks,
                            "gradients")


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
    ``(got, ref, bound)``, with ``got = sum_{n,g,s} (a . u)(g . v_g)`` from the records,
    ``ref = v^T W u`` from autograd's gradient ``W`` (viewed as ``(dim 0, rest)``,
    :meth:`GradTotal.projection`) and ``bound`` the scale of the rounding
    errors of both (``sum |a . u||g . v| + ||W|| ||u|| ||v||``). ``a`` ``(N, G, S, I)``, ``g``
    ``(N, G, S, O)``: the canonical form, or one row block ``rows`` of ``W`` (``G = 1``); then
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
    if rows is not None and rows.start != 0:
        ref, norm = torch.zeros_like(ref), torch.zeros_like(norm)
    return torch.stack([prod.sum(), ref, prod.abs().sum() + norm * uv])


def check_projections(items: List[Tuple[str, Tensor, torch.dtype]],
                      hooks: Optional[Mapping[str, str]] = None) -> None:
    """Compare the :func:`projection_terms` of every Gram-form weight at once (``hooks``: the
    user's gradient hooks, :func:`user_hooks`, named as the cause where they ran).

    Raises:
        GradientMismatchError: naming the first parameter whose projection differs by more than
            ``SUM_CHECK_RTOL[dtype] * bound``.
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
        terms = torch.stack([t.to(dt) for _, t, _ in group])  # (P, 3)
        rtol = terms.new_tensor([SUM_CHECK_RTOL.get(dt, 1e-4) for _, _, dt in group])
        bad = (terms[:, 0] - terms[:, 1]).abs() > rtol * terms[:, 2] + torch.finfo(terms.dtype).tiny
        if bool(bad.any()):
            k = int(bad.nonzero()[0, 0])
            got, ref = terms[k, 0].item(), terms[k, 1].item()
            raise _mismatch(group[k][0], f"on a random projection: {got:.6g} vs {ref:.6g}",
                            hooks or {}, "norms")


def probed(name: str, t: Tensor, total: Optional[GradTotal], tol_dtype: torch.dtype,
            rows: Optional[slice] = None) -> Optional[tuple]:
    """A :func:`check_sums` item reduced to the probe coordinates, so that
    ``t`` need not be kept: ``t`` ``(N, *shape)`` is the per-sample gradient of the parameter,
    or of its rows ``rows`` (dim 0); ``None`` if no probe falls in those rows."""
    if total is None:
        raise no_total(name)
    idx, ref = total.probe_index(), total.probe_values()
    flat = t.reshape(t.shape[0], -1)
    if rows is not None:
        cols = total.shape.numel() // total.shape[0]
        inside = (idx >= rows.start * cols) & (idx < rows.stop * cols)
        idx, ref = idx[inside] - rows.start * cols, ref[inside]
        if not idx.numel():
            return None
    if idx.numel() < flat.shape[1]:
        flat = flat.index_select(1, idx)
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


class SumCheck:
    """When the sum check runs, given ``attach(..., check=mode)``.

    ``mode=True``: on every read whose *structure* has not passed before -- which modules were
    called how often, by how many backward passes, and which parameters autograd reached -- and
    on every 100th read (the failures the check catches are properties of that structure);
    ``"always"``: every read; ``False``: never. :meth:`~gradhooks.GradHooks.backward` asks
    :meth:`edges_allowed` whether it may skip the parameter gradients (then the batch's reads
    skip the check), with its own structure key (the forward's recorded calls).
    """

    #: one read (and one ``backward()``) in this many runs the check whatever the structure.
    EVERY = 100

    def __init__(self, mode) -> None:
        if mode not in (True, False, "always"):
            raise ValueError(f"check must be True, False or 'always', got {mode!r}")
        self.mode = mode
        self._passed: set = set()  # read structures whose check passed
        self._reads = 0
        self._drive_passed: set = set()  # backward() structures whose check passed
        self._drives = 0

    def read_due(self, structure: tuple) -> bool:
        """Count a read of ``structure``; whether it runs the check."""
        self._reads += 1
        return (self.mode == "always" or structure not in self._passed
                or self._reads % self.EVERY == 0)

    def edges_allowed(self, drive_key: tuple) -> bool:
        """Count a ``backward()``; whether it may skip the parameter gradients."""
        self._drives += 1
        return not (self.mode == "always" or (self.mode and (
            drive_key not in self._drive_passed or self._drives % self.EVERY == 0)))

    def passed(self, structure: tuple, drive_key: Optional[tuple]) -> None:
        """Remember that the check of ``structure`` (reached by ``drive_key``'s backward, if
        any) passed."""
        self._passed.add(structure)
        if drive_key is not None:
            self._drive_passed.add(drive_key)


def refusal(read: str, *, attached: bool, changed: Optional[str], stale: Optional[str],
            released: bool, reached: int, calls: int, backward_reached_params: bool,
            forwards: int, higher_order: Optional[str]) -> Optional[GradHooksError]:
    """The error a read of the current batch must raise, or ``None`` if it may go on.

    Args:
        read: the reading call, e.g. ``"per_sample_grad_norms()"``, named in the messages.
        attached: whether the hooks are attached.
        changed: what changed in the model since its forward (a parameter or submodule set on
            it), or ``None``.
        stale: the module a backward pass reached after a read released the records, or
            ``None``.
        released: whether a read released the records.
        reached: how many calls a backward pass reached.
        calls: how many hooked-layer calls the forwards of this batch recorded.
        backward_reached_params: whether autograd computed parameter gradients in this batch.
        forwards: how many top-level forwards the reached calls came from (counted as 1 when
            ``attach(forwards="same_samples")`` or when the model is itself a hooked layer).
        higher_order: the module a ``create_graph=True`` backward reached, or ``None``.
    """
    if not attached:
        return GradHooksError(
            f"{read}: this GradHooks was detached from the model, which dropped its records "
            f"(also at the end of a `with gradhooks.attach(model) as gh:` block): read inside "
            f"the block / before detach(), or attach again and rerun the forward and backward")
    if changed is not None:
        return GradHooksError(
            f"{read}: the model changed after its forward ({changed}), so the records do not "
            f"describe its parameters any more: run the forward and backward again (gradhooks "
            f"follows the change at the next forward)")
    if stale is not None:
        return RecordsReleasedError(
            f"a backward pass reached module {stale} after per_sample_grads() released this "
            f"batch's records (activations and grad_outputs), so its grad_outputs were not "
            f"recorded: to read per-sample results over several backward passes of one forward, "
            f"call per_sample_grads(retain_records=True) before the later passes, or run a new "
            f"forward")
    if released:
        if read == "per_sample_grads()":
            return RecordsReleasedError(
                "per_sample_grads() released this batch's records as it read them and did not "
                "finish (it raised an error): run the forward and backward again, with "
                "per_sample_grads(retain_records=True) to keep the records through a failed read")
        return RecordsReleasedError(
            f"per_sample_grads() released this batch's records (activations and grad_outputs) "
            f"as it read them, and {read} needs them: call {read} before per_sample_grads(), or "
            f"per_sample_grads(retain_records=True) to keep them")
    if not reached:
        if calls == 0 and backward_reached_params:
            return NoBackwardError(
                f"{read}: autograd computed parameter gradients, but no hooked layer's forward "
                f"hook ran: the forward went through code compiled by torch.compile before "
                f"attach (compiled code does not see hooks added later). Attach before "
                f"compiling, or call torch._dynamo.reset() after attach so that it recompiles")
        return NoBackwardError(
            f"no backward pass has reached a hooked layer since the last forward: call "
            f"loss.backward() (or gh.backward(loss)) before {read} (forwards under "
            f"torch.no_grad() or inference_mode() record nothing; a model compiled with "
            f"torch.compile before attach runs without the hooks: attach first)")
    if forwards > 1:
        return GradHooksError(
            f"{read}: the backward reached the records of {forwards} forwards of the model, "
            f"whose rows would be added sample by sample (row n = sample n of every forward). "
            f"This is what a contrastive or two-view loss does (SimCLR / InfoNCE over "
            f"model(view1) and model(view2), a siamese or triplet loss). If every forward saw "
            f"the same samples in the same order (two views or augmentations of one batch, sample "
            f"n's own loss depending on both), declare it: attach(model, forwards='same_samples'), "
            f"and the per-sample results sum over the forwards. Otherwise (different samples in "
            f"each forward, or negatives drawn from other samples) run one forward per backward: "
            f"concatenate the inputs, model(torch.cat([x1, x2])), and split the output")
    if higher_order is not None:
        return HigherOrderGradError(
            f"a backward pass with create_graph=True reached module {higher_order}: the loss "
            f"contains derivatives (a gradient penalty or a Laplacian built with "
            f"torch.autograd.grad(..., create_graph=True)), so each parameter's gradient has "
            f"terms through the derivative graph that grad_output-based rules do not see; "
            f"{read} would be wrong. Compute such per-sample quantities with torch.func (vmap "
            f"over grad of the per-sample loss), or detach the derivative term")
    return None
