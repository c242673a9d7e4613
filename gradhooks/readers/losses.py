"""What the Fisher / GGN readers need of a supported loss (cross-entropy, MSE, BCE with
logits): its reduction, per-sample scale, sampled targets and a symmetric factorisation of its
Hessian w.r.t. the model output.

Shared by the one-call KFAC driver (:mod:`gradhooks.fisher`) and the GGN reader
(:mod:`gradhooks.readers.curvature.ggn`); below both in the import order, so that a reader need not import the
facade.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
from torch import Tensor, nn

from ..base.errors import BatchSizeError, UnsupportedLossError
from ..base.utils import compute_dtype

__all__ = ["LossModel"]


class LossModel:
    """What :func:`kfac` needs of a supported loss: its kind, reduction and per-sample scale.

    The per-sample loss of sample ``n`` is ``l_n = k * nll(f_n, y_n)`` with ``nll`` the negative
    log-likelihood of a categorical (CE), Gaussian with variance 1/2 (MSE) or Bernoulli (BCE)
    distribution, and ``k = 1/D`` for MSE / BCE with ``reduction="mean"`` over ``D`` outputs
    per sample (torch averages over all elements), ``k = 1`` otherwise.
    """

    @staticmethod
    def check(loss_fn) -> None:
        """Refuse (before any forward) a loss whose Fisher :func:`kfac` cannot form."""
        supported = (nn.CrossEntropyLoss, nn.MSELoss, nn.BCEWithLogitsLoss)
        if not isinstance(loss_fn, supported):
            raise UnsupportedLossError(
                f"kfac() supports nn.CrossEntropyLoss, nn.MSELoss and nn.BCEWithLogitsLoss "
                f"instances (their Fisher is known), got {type(loss_fn).__name__}; for a "
                f"functional loss pass e.g. nn.CrossEntropyLoss(reduction='mean'), for another "
                f"loss attach gradhooks and call kfac_factors() after your own backward passes"
            )
        name = type(loss_fn).__name__
        if loss_fn.reduction not in ("mean", "sum"):
            raise UnsupportedLossError(
                f"{name}(reduction={loss_fn.reduction!r}): KFAC needs the batch loss reduced "
                f"over samples, use reduction='mean' or 'sum'")
        if any(getattr(loss_fn, w, None) is not None for w in ("weight", "pos_weight")):
            raise UnsupportedLossError(
                f"{name} with weight/pos_weight: the weighted loss is not the likelihood the "
                f"Fisher types assume (and CE's 'mean' divides by the sum of weights); drop them")
        if getattr(loss_fn, "label_smoothing", 0.0):
            raise UnsupportedLossError(
                f"{name}(label_smoothing={loss_fn.label_smoothing}): its gradient with sampled "
                f"targets does not estimate the Fisher; use label_smoothing=0")

    def __init__(self, loss_fn, out: Tensor, batch: int):
        if out.dim() == 0 or out.shape[0] != batch:
            raise BatchSizeError(
                f"the model output has shape {tuple(out.shape)} but the hooked layers saw batch "
                f"size {batch}; kfac() needs the output batched on dim 0")
        self.ce = isinstance(loss_fn, nn.CrossEntropyLoss)
        if self.ce and out.dim() != 2:
            raise UnsupportedLossError(
                f"CrossEntropyLoss needs a model output of shape (B, C) for kfac(), got "
                f"{tuple(out.shape)}; for (B, C, d1, ...) outputs the loss averages over positions "
                f"as well: move them into the batch (out.movedim(1, -1).flatten(0, -2))")
        self.fn, self.reduction = loss_fn, loss_fn.reduction
        self.dim = out[0].numel()
        self.k = 1.0 if self.ce or self.reduction == "sum" else 1.0 / self.dim
        # the batch loss is w * sum_n l_n
        self.w = 1.0 / batch if self.reduction == "mean" else 1.0

    def check_targets(self, targets) -> None:
        if self.ce and isinstance(targets, Tensor) and not targets.is_floating_point():
            if bool((targets == self.fn.ignore_index).any()):
                raise UnsupportedLossError(
                    f"targets contain CrossEntropyLoss's ignore_index ({self.fn.ignore_index}); "
                    f"the mean would run over fewer samples than the batch: drop those samples")

    def sample(self, out: Tensor, generator: Optional[torch.Generator]) -> Tensor:
        """Targets drawn from the predictive distribution the loss is the NLL of."""
        f = out.detach()
        if self.ce:
            return torch.multinomial(f.softmax(1), 1, generator=generator).squeeze(1)
        if isinstance(self.fn, nn.MSELoss):
            return f + math.sqrt(0.5) * torch.randn(f.shape, generator=generator, dtype=f.dtype,
                                                    device=f.device)
        return torch.bernoulli(torch.sigmoid(f), generator=generator)

    def hessian_sqrt_columns(self, out: Tensor) -> Iterable[Tensor]:
        """Columns ``S[:, :, c]`` (each shaped like ``out``) with ``sum_c S S^T`` the Hessian of
        ``l_n`` w.r.t. ``f_n``, times ``w`` (so that they scale like the batch loss's grads)."""
        f = out.detach().reshape(out.shape[0], -1).to(compute_dtype(out))
        if self.ce:  # H = diag(p) - p p^T = S S^T, S[:, c] = sqrt(p_c) (e_c - p)
            p = f.softmax(1)
            root = p.sqrt()
            for c in range(f.shape[1]):
                col = p * (-root[:, c:c + 1])
                col[:, c] += root[:, c]
                yield (col * self.w).to(out.dtype).reshape(out.shape)
            return
        if isinstance(self.fn, nn.MSELoss):  # H = 2k I
            diag = torch.full_like(f, math.sqrt(2 * self.k))
        else:  # H = k diag(s (1 - s)), s = sigmoid(f)
            s = torch.sigmoid(f)
            diag = (self.k * s * (1 - s)).sqrt()
        for c in range(f.shape[1]):
            col = torch.zeros_like(f)
            col[:, c] = diag[:, c] * self.w
            yield col.to(out.dtype).reshape(out.shape)
