"""The GGN reader: its symmetric square root in BackPACK's layout, its diagonal (per sample and
for the batch), GGN-vector products, and the empirical Fisher's diagonal.

Index conventions: ``n`` sample (``B``), ``c`` column of the loss Hessian's square root (``C``
output coordinates; or ``m`` of ``M`` sampled labels for the Monte-Carlo version), ``o`` / ``i``
out / in features of a layer with a linear form.

Loss (:class:`~gradhooks.readers.losses.LossModel`): ``L = w sum_n l_n(f_n)``, ``w = 1/B`` for
``reduction="mean"`` and ``1`` for ``"sum"``; ``H_n`` the Hessian of ``l_n`` w.r.t. the output
``f_n``, ``H_n = S_n S_n^T`` (CE: ``S = diag(sqrt p) - p sqrt(p)^T``; MSE: ``sqrt(2k) I``; BCE:
``diag(sqrt(k s (1 - s)))``). The GGN of ``L`` (Schraudolph 2002; Martens 2020,
arXiv:1412.1193, sec. 8) and its square root (Dangel et al. 2020, BackPACK, arXiv:1912.10985,
sec. 2.2)::

    GGN = w sum_n J_n^T H_n J_n = sum_{c,n} V[c,n] V[c,n]^T,   V[c,n] = sqrt(w) J_n^T S_n[:, c]

``V[c, n]`` is the per-sample gradient of the backward pass with cotangent ``sqrt(w) S[:, c]``
(:mod:`gradhooks.readers.passes`): ``C`` passes. Monte-Carlo (BackPACK's ``SqrtGGNMC``): ``V[m, n] =
sqrt(w k / M) J_n^T grad_f nll(f_n, y~_m)`` with ``y~_m`` drawn from the model's predictive
distribution, so that ``E[sum_m V V^T] = GGN``: ``M`` passes.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Dict, Iterable, List, Mapping, Optional

import torch
from torch import Tensor

from ...base._pool import using_pool
from ...base.utils import compute_dtype, no_autocast
from ...core.recorder.capture import Recorder
from ...core.recorder.records import Batch
from ..canonical import canonical_call, scaled
from ..jacobians import pass_grads, trainable_params
from ..losses import LossModel
from ..passes import PassCall, check_output, run_passes

__all__ = ["ggn_sqrt", "ggn_diag", "ggn_vector_product", "empirical_fisher_diag",
           "sqrt_cotangents"]


def sqrt_cotangents(loss: LossModel, output: Tensor, mc_samples: int = 0,
                    generator: Optional[torch.Generator] = None) -> Iterable[Tensor]:
    """The cotangents of the square-root passes (module docstring): ``sqrt(w) S[:, c]`` for
    ``c < C`` (``mc_samples=0``), or ``sqrt(w k / M) grad_f nll(f, y~_m)`` for ``m < M``."""
    if mc_samples == 0:
        root_w = 1.0 / math.sqrt(loss.w)
        for col in loss.hessian_sqrt_columns(output):  # (these are w S[:, c])
            yield col * root_w
        return
    f = output.detach().to(compute_dtype(output)).requires_grad_(True)
    factor = 1.0 / math.sqrt(loss.w * loss.k * mc_samples)
    for _ in range(mc_samples):
        with torch.enable_grad():  # the gradient of loss_fn is w k grad nll per sample
            (grad,) = torch.autograd.grad(loss.fn(f, loss.sample(f, generator)), f)
        yield grad * factor


def _passes(recorder: Recorder, output: Tensor, loss_fn, mc_samples: int, generator, read: str):
    if not isinstance(mc_samples, int) or mc_samples < 0:
        raise ValueError(f"mc_samples must be an int >= 0 (0: exact), got {mc_samples!r}")
    LossModel.check(loss_fn)
    check_output(recorder, output, read)
    loss = LossModel(loss_fn, output, recorder.batch_size)
    count = mc_samples or loss.dim
    return count, run_passes(recorder, output, sqrt_cotangents(loss, output, mc_samples, generator),
                             count, read)


def ggn_sqrt(recorder: Recorder, output: Tensor, loss_fn, *, mc_samples: int = 0,
             generator: Optional[torch.Generator] = None) -> Dict[str, Tensor]:
    """The GGN's symmetric square root ``V`` in BackPACK's layout (``SqrtGGNExact`` /
    ``SqrtGGNMC``): ``{name: (C, B, *param.shape)}`` with ``sum_{c,n} V[c,n] V[c,n]^T`` the GGN
    of ``loss_fn(output, y)`` as reduced (module docstring).

    Call it after the forward that made ``output`` and before any backward pass through it
    (it runs ``C`` or ``M`` backward passes; the batch's records are released afterwards, as by
    :func:`gradhooks.readers.jacobians.per_sample_jacobians`).

    Args:
        recorder: the :class:`~gradhooks.core.recorder.capture.Recorder` of an attached GradHooks.
        output: the model output ``(B, C)`` (cross-entropy) or ``(B, ...)`` (MSE, BCE).
        loss_fn: ``nn.CrossEntropyLoss``, ``nn.MSELoss`` or ``nn.BCEWithLogitsLoss``, reduction
            ``"mean"`` or ``"sum"`` (as :func:`gradhooks.kfac`); targets are not needed.
        mc_samples: ``0`` for the exact square root (``C`` columns, ``C`` = outputs per
            sample), ``M > 0`` for ``M`` sampled labels.
        generator: for the sampled labels.

    Returns:
        ``{name: (C or M, B, *param.shape)}`` in ``model.named_parameters()`` order.

    Raises:
        UnsupportedLossError: for another loss (:func:`gradhooks.kfac`'s rules).
        GradHooksError, BatchSizeError: as :func:`~gradhooks.readers.jacobians.per_sample_jacobians`.
    """
    params = trainable_params(recorder)
    count, passes = _passes(recorder, output, loss_fn, mc_samples, generator, "ggn_sqrt()")
    b = output.shape[0]
    out = {pid: p.new_zeros((count, b, *p.shape)) for pid, _, p in params}
    with no_autocast(), using_pool(recorder.pool):
        for c, calls in enumerate(passes):
            for pid, t in pass_grads(calls, recorder.batch_first).items():
                out[pid][c] = t
    return {name: out[pid] for pid, name, _ in params}


def _squares(calls: List[PassCall], batch_first: bool, scale: Optional[float], per_sample: bool,
             out: Dict[int, Tensor]) -> None:
    # Add the squared per-sample gradients of one pass's calls into ``out`` {pid: (B, *shape) or
    # (*shape)}. Closed form for a call of a layer with a linear form and one position (S = 1)
    # whose parameters no other call of the pass shares: (g^2)^T (a^2) for the weight (one
    # matmul, no (B, O, I) tensor when summed over samples); a square of the summed per-sample
    # gradient otherwise (several positions or calls: squares of sums are not sums of squares).
    uses = Counter(id(p) for call in calls for n, p in call.layer.params.items() if n in call.names)
    dense = []
    for call in calls:
        layer, rule = call.layer, call.layer.rule
        names = call.names
        if not (rule.has_linear_form and not rule.multi_io
                and all(uses[id(layer.params[n])] == 1 for n in names)):
            dense.append(call)
            continue
        a_c, g_c = canonical_call(call, batch_first, form_a="weight" in names)
        if g_c.shape[2] != 1:
            dense.append(call)
            continue
        g_c = scaled(g_c, scale)  # (after the test: a dense call is scaled by pass_grads)
        g2 = g_c[:, :, 0].square()  # (N, G, O)
        for name in names:
            p = layer.params[name]
            if name == "weight":
                a2 = a_c[:, :, 0].square()  # (N, G, I)
                t = (g2[..., :, None] * a2[..., None, :] if per_sample
                     else torch.einsum("ngo,ngi->goi", g2, a2))
            else:
                t = g2 if per_sample else g2.sum(0)
            t = t.reshape(((g2.shape[0],) if per_sample else ()) + tuple(p.shape)).to(p.dtype)
            _add(out, id(p), t)
    for pid, t in pass_grads(dense, batch_first, scale).items():
        t = t.square_()
        _add(out, pid, t if per_sample else t.sum(0))


def _add(out: Dict[int, Tensor], pid: int, t: Tensor) -> None:
    if pid in out:
        out[pid].add_(t)
    else:
        out[pid] = t


def ggn_diag(recorder: Recorder, output: Tensor, loss_fn, *, per_sample: bool = False,
             mc_samples: int = 0, generator: Optional[torch.Generator] = None
             ) -> Dict[str, Tensor]:
    """The GGN's diagonal ``sum_{c,n} V[c,n]^2`` (BackPACK's ``DiagGGNExact`` / ``DiagGGNMC``),
    or with ``per_sample`` each sample's share ``sum_c V[c,n]^2`` (``BatchDiagGGNExact``: the
    shares sum to the batch diagonal, so they carry ``w``).

    Same calling rules and arguments as :func:`ggn_sqrt`; no ``(C, B, *shape)`` tensor is
    formed: each pass's squares are added at once, for Linear-like layers without weight
    sharing from ``(g^2)^T (a^2)`` (no per-sample tensor at all for the batch diagonal).

    Returns:
        ``{name: (*param.shape)}``, or ``{name: (B, *param.shape)}`` with ``per_sample``;
        zeros for parameters the output does not depend on.
    """
    params = trainable_params(recorder)
    _, passes = _passes(recorder, output, loss_fn, mc_samples, generator, "ggn_diag()")
    out: Dict[int, Tensor] = {}
    with no_autocast(), using_pool(recorder.pool):
        for calls in passes:
            _squares(calls, recorder.batch_first, None, per_sample, out)
    b = output.shape[0]
    return {name: out[pid].to(p.dtype) if pid in out
            else p.new_zeros(((b,) if per_sample else ()) + tuple(p.shape))
            for pid, name, p in params}


def ggn_vector_product(recorder: Recorder, output: Tensor, loss_fn, vector: Mapping[str, Tensor],
                       *, mc_samples: int = 0, generator: Optional[torch.Generator] = None
                       ) -> Dict[str, Tensor]:
    """The GGN times a vector, ``GGN v = sum_{c,n} V[c,n] (V[c,n] . v)``.

    Same calling rules and arguments as :func:`ggn_sqrt`, plus ``vector``: ``{name: tensor of
    the parameter's shape}`` for every hooked trainable parameter. Each pass's per-sample
    gradients ``(B, P)`` are formed and dropped in turn (``C`` passes); for many vectors, one
    :func:`ggn_sqrt` and two contractions are cheaper.

    Returns:
        ``{name: (*param.shape)}``.

    Raises:
        KeyError: if ``vector`` lacks a parameter.
    """
    params = trainable_params(recorder)
    vec = {pid: vector[name] for pid, name, _ in params}
    _, passes = _passes(recorder, output, loss_fn, mc_samples, generator,
                        "ggn_vector_product()")
    out = {pid: torch.zeros_like(p) for pid, _, p in params}
    with no_autocast(), using_pool(recorder.pool):
        for calls in passes:
            grads = pass_grads(calls, recorder.batch_first)
            coef = sum((t.flatten(1) @ vec[pid].reshape(-1).to(t.dtype)) for pid, t in grads.items())
            for pid, t in grads.items():
                out[pid] += torch.tensordot(coef, t, 1).to(out[pid].dtype)
    return {name: out[pid] for pid, name, _ in params}


def empirical_fisher_diag(batch: Batch) -> Dict[str, Tensor]:
    """The diagonal of the empirical Fisher of the loss as reduced, after its backward pass::

        F = w sum_n grad l_n grad l_n^T,      diag F = w sum_n (grad l_n)^2

    (``grad l_n`` the gradient of sample ``n``'s own loss, as
    :meth:`~gradhooks.GradHooks.per_sample_grads`; ``w = 1/B`` for ``loss_reduction="mean"``,
    ``1`` for ``"sum"``: the convention of :func:`gradhooks.readers.curvature.kfac.kfac_factors`' empirical
    factors, ``sum_grad_squared() * w``). For layers with a linear form and no weight sharing
    it is ``w (g^2)^T (a^2)`` from the records, with no per-sample tensor (BackPACK's
    ``SumGradSquared`` trick; Dangel et al. 2020, sec. 2.1); other layers square their
    per-sample gradients. The records are kept (other reads may follow).

    Args:
        batch: ``recorder.snapshot("empirical_fisher_diag()", sum_check=False)``.

    Returns:
        ``{name: (*param.shape)}`` for the hooked trainable parameters (zeros where the
        backward did not reach, and for an empty batch).

    Raises:
        NoBackwardError, RecordsReleasedError, HigherOrderGradError: as
            :meth:`~gradhooks.GradHooks.per_sample_grads`.
    """
    params = trainable_params(batch)
    if batch.size == 0:  # an empty (Poisson) batch: no sample, nothing summed
        return {name: torch.zeros_like(p) for _, name, p in params}
    calls = [PassCall(cap.layer, cap.a, cap.grads_arg(), cap.names) for cap in batch.records]
    out: Dict[int, Tensor] = {}
    with no_autocast(), using_pool(batch.pool):
        _squares(calls, batch.batch_first, batch.scale, False, out)
    w = 1.0 / batch.divisor
    return {name: out[pid].mul_(w).to(p.dtype) if pid in out else torch.zeros_like(p)
            for pid, name, p in params}
