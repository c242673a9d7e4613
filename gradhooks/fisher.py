"""The one-call KFAC driver: :func:`kfac` attaches, runs the backward passes a Fisher type
needs (empirical, Monte-Carlo or type-2 / GGN) and reads :func:`gradhooks.readers.curvature.kfac.kfac_factors`.

Conventions of the factors: :mod:`gradhooks.kfac`. Fisher types: Martens & Grosse 2015,
arXiv:1503.05671, sec. 5; Botev et al. 2017, arXiv:1706.03662 (type-2).
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from .base.errors import NoBackwardError, UnsupportedLossError
from .base.utils import no_autocast, own_loss_scale
from .hooks import attach
from .readers.curvature.kfac import (
    KFAC_APPROX,
    DiagonalFactors,
    KFACFactors,
    KFACSums,
    check_choice,
    check_g_positions,
    check_options,
)
from .readers.losses import LossModel
from .readers.passes import run_passes

__all__ = ["kfac", "FISHER_TYPES"]

#: Values of ``fisher`` in :func:`kfac`.
FISHER_TYPES = ("empirical", "mc", "type-2")


def kfac(
    model: nn.Module,
    inputs: Union[Tensor, Sequence[Tensor]],
    targets: Union[Tensor, Sequence[Tensor]],
    loss_fn: Union[nn.CrossEntropyLoss, nn.MSELoss, nn.BCEWithLogitsLoss],
    fisher: str = "empirical",
    mc_samples: int = 1,
    kfac_approx: str = "expand",
    generator: Optional[torch.Generator] = None,
    *,
    batch_first: bool = True,
    allow_batchnorm_train: bool = False,
    modules: Optional[Iterable[str]] = None,
    max_dense: Optional[int] = None,
    all_reduce: bool = False,
    group: Optional[torch.distributed.ProcessGroup] = None,
    g_positions: str = "sum",
) -> Dict[str, Union[KFACFactors, DiagonalFactors]]:
    """KFAC factors of a model on one batch, for the empirical, Monte-Carlo or type-2 Fisher.

    Attaches gradhooks (with ``loss_reduction = loss_fn.reduction``), runs one forward
    ``model(*inputs)`` and the backward passes the Fisher type needs, with
    ``torch.autograd.grad`` (``param.grad`` is not touched), and returns
    :func:`kfac_factors`. Conventions: see the module docstring (``A ⊗ G`` approximates the
    Fisher / GGN of ``loss_fn(model(inputs), targets)`` as reduced: mean or sum over samples).

    * ``"empirical"``: one backward pass of ``loss_fn(out, targets)``: the same factors as
      :func:`kfac_factors` after the training ``loss.backward()``. (curvlinops also multiplies
      this pass by ``sqrt(D)`` for MSE / BCE with ``reduction="mean"``, so its empirical ``G``
      is ``D`` times the empirical Fisher of the loss as written; ours is not.)
    * ``"mc"``: ``mc_samples`` backward passes of ``loss_fn(out, y~) / sqrt(k)``, ``y~`` drawn
      from the predictive distribution (categorical ``softmax(out)`` for cross-entropy,
      ``N(out, I/2)`` for MSE, ``Bernoulli(sigmoid(out))`` for BCE) with ``generator``;
      ``G`` is their average (Martens & Grosse 2015, sec. 5). ``k = 1/D`` undoes the extra
      mean over the ``D`` outputs per sample that ``reduction="mean"`` of MSE / BCE applies
      (curvlinops' ``_maybe_adjust_loss_scale``), so that MC converges to type-2.
    * ``"type-2"``: one backward pass per column ``c`` of ``S`` with ``S S^T`` the Hessian of
      the loss w.r.t. the outputs (CE: ``S = diag(sqrt p) - p sqrt(p)^T``; MSE: ``sqrt(2k) I``;
      BCE: ``diag(sqrt(k s(1-s)))``), giving the GGN's exact ``G`` (Martens & Grosse 2015,
      sec. 5; Botev et al. 2017, arXiv:1706.03662). ``D`` (or ``C``) backward passes.

    Memory: the hooks keep every pass's grad_outputs of the hooked layers until the factors are
    formed, i.e. ``mc_samples`` (or ``D``) times the size of those layers' outputs.

    Under ``DistributedDataParallel`` pass ``ddp.module`` (DDP's reducer expects one backward per
    forward), or attach to the DDP model and call :func:`kfac_factors` with ``all_reduce=True``
    after the training backward.

    Args:
        model: the model; it must not be attached to another GradHooks.
        inputs: a tensor or a sequence of tensors (``model(*inputs)``), batched.
        targets: what ``loss_fn`` takes with the output (only its shape matters for
            ``"mc"`` / ``"type-2"``).
        loss_fn: an ``nn.CrossEntropyLoss`` (output ``(B, C)``), ``nn.MSELoss`` or
            ``nn.BCEWithLogitsLoss`` (output ``(B, ...)``) with ``reduction`` ``"mean"`` or
            ``"sum"``.
        fisher: ``"empirical"``, ``"mc"`` or ``"type-2"``.
        mc_samples: number of sampled targets for ``"mc"`` (must be 1 otherwise).
        kfac_approx: ``"expand"`` or ``"reduce"``.
        generator: ``torch.Generator`` (on the output's device) for ``"mc"``; ``None`` uses
            torch's global RNG.
        batch_first, allow_batchnorm_train: as for :func:`gradhooks.attach` (BatchNorm in
            training mode mixes the samples; the factors of the Linear / Conv layers are then
            those of the batch as the model computes it).
        modules, max_dense, all_reduce, group, g_positions: as for :func:`kfac_factors`
            (``g_positions="mean"``: ``G`` averaged over the weight-sharing positions,
            kronfluence's convention).

    Returns:
        ``{module name: KFACFactors}`` (see :func:`kfac_factors`).

    Raises:
        UnsupportedLossError: for another loss, ``reduction="none"``, class / positive weights,
            label smoothing, targets equal to ``ignore_index``, or a cross-entropy output that
            is not ``(B, C)``.
        BatchSizeError: if the output is not batched like the hooked layers' inputs.
        ValueError: for an unknown ``fisher`` / ``kfac_approx`` / ``g_positions`` (or ``"mean"``
            with ``"reduce"``), ``mc_samples < 1``, or
            ``mc_samples != 1`` with a Fisher type other than ``"mc"``.
        GradHooksError: if the model is already hooked by a live GradHooks; the errors of
            :func:`kfac_factors`.
    """
    check_choice("fisher", fisher, FISHER_TYPES)
    check_choice("kfac_approx", kfac_approx, KFAC_APPROX)
    check_g_positions(kfac_approx, g_positions)
    if not isinstance(mc_samples, int) or mc_samples < 1:
        raise ValueError(f"mc_samples must be a positive int, got {mc_samples!r}")
    if fisher != "mc" and mc_samples != 1:
        raise ValueError(f"mc_samples={mc_samples} is only meaningful for fisher='mc' "
                         f"(got fisher={fisher!r})")
    LossModel.check(loss_fn)
    xs = (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)
    with attach(model, loss_reduction=loss_fn.reduction, batch_first=batch_first, check=False,
                allow_batchnorm_train=allow_batchnorm_train) as gh:
        out = model(*xs)
        if not isinstance(out, Tensor):
            raise UnsupportedLossError(
                f"kfac() needs a model returning one tensor, got {type(out).__name__}")
        batch_size = gh.batch_size
        if batch_size is None:
            raise NoBackwardError(
                "the forward reached no hooked layer that requires grad; the model has no "
                "trainable parameter to compute KFAC for")
        loss = LossModel(loss_fn, out, batch_size)
        if fisher == "empirical":
            loss.check_targets(targets)
            params = [p for p in model.parameters() if p.requires_grad]
            with gh.recorder.backward_pass.judged():  # (the loss of the Fisher's definition)
                torch.autograd.grad(loss_fn(out, targets), params, allow_unused=True)
            return gh.kfac_factors(kfac_approx, modules=modules, max_dense=max_dense,
                                   all_reduce=all_reduce, group=group, g_positions=g_positions)
        # Several passes: each read on its own (run_passes), so that the layers whose records
        # sum the passes (embedding, attention, recurrent) get each pass's gradients.
        recorder = gh.recorder
        wanted = check_options(recorder, kfac_approx, "mean" if fisher == "mc" else "sum",
                               modules, max_dense)
        if fisher == "mc":
            scale = 1.0 / math.sqrt(loss.k)
            cotangents: Iterable = (_loss_gradient(loss_fn, out, loss.sample(out, generator),
                                                   scale) for _ in range(mc_samples))
        else:
            cotangents = loss.hessian_sqrt_columns(out)
        total = {"mc": mc_samples, "type-2": loss.dim}[fisher]
        sums = KFACSums(batch_size, recorder.loss_reduction, recorder.batch_first,
                        own_loss_scale(recorder.loss_reduction, batch_size),
                        recorder.names, kfac_approx, max_dense)
        with no_autocast():
            for p, calls in enumerate(run_passes(recorder, out, cotangents, total,
                                                 f"gradhooks.kfac(fisher={fisher!r})")):
                sums.add_pass(p, [tuple(c) for c in calls if wanted(c.layer)])
            return sums.result(recorder.order, total, "mean" if fisher == "mc" else "sum",
                               all_reduce, group, g_positions)


def _loss_gradient(loss_fn: nn.Module, out: Tensor, targets: Tensor, scale: float) -> Tensor:
    # d (scale * loss_fn(out, targets)) / d out, the cotangent of one Monte-Carlo pass.
    leaf = out.detach().requires_grad_(True)
    with torch.enable_grad():
        (grad,) = torch.autograd.grad(loss_fn(leaf, targets) * scale, leaf)
    return grad
