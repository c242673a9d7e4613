"""DP fine-tuning with TRL: :class:`DPSFTTrainer` (``trl.SFTTrainer``) and :class:`DPDPOTrainer`
(``trl.DPOTrainer``), each the TRL trainer with the DP-SGD step of
:class:`gradhooks.integrations.transformers.DPTrainerMixin` (Poisson lots, per-sample clipping
into gradhooks' accumulator by book-keeping or two-pass ghost clipping, the noise once per lot,
epsilon from Opacus' accountant)::

    from gradhooks.integrations.transformers import DPConfig
    from gradhooks.integrations.trl import DPDPOTrainer, DPSFTTrainer
    trainer = DPSFTTrainer(model=model, args=SFTConfig(..., packing=False),
                           train_dataset=prompt_completion, processing_class=tokenizer,
                           dp=DPConfig(target_epsilon=8.0, delta=1e-5, max_grad_norm=1.0))
    trainer.train()            # logs "epsilon" beside TRL's metrics

Importing this module imports ``trl`` (``pip install trl``); ``import gradhooks`` does not.

**SFT.** The sample is one row of TRL's padded batch (``input_ids``, ``attention_mask``,
``labels`` with ``-100`` on the prompt under ``completion_only_loss`` and past the end): its
loss is the mean (``DPConfig.token_reduction="sum"``: the sum) of its own completion tokens'
negative log-likelihoods (:func:`gradhooks.integrations.transformers.causal_lm_losses`). TRL's
own loss, a mean over all the batch's tokens, weighs samples by their token counts and is not
used. Refused (``SampleMixingError``): ``packing=True`` and ``padding_free=True`` (a row holds
several samples, each row's gradient is then a sum over samples). Refused
(``UnsupportedLossError``): ``loss_type="dft"`` (weights from the model's own probabilities),
label smoothing, a model's auxiliary (router) loss.

**DPO.** TRL's concatenated forward ``[chosen; rejected]`` (``2P`` rows for ``P`` pairs): the
pair is the sample, declared with ``gh.set_sample_ids(cat([arange(P), arange(P)]))`` after the
forward (:mod:`gradhooks.base.sample_groups`), so that each pair's gradient, norm and clipping
is that of its two rows together. Each pair's loss (:func:`dpo_pair_losses`, TRL's formulas)
from the policy's completion log-probabilities (summed over the completion tokens, as TRL)
and the reference's: taken from the batch (``precompute_ref_log_probs=True``) or from TRL's
``compute_ref_log_probs`` (the reference model, or the peft model with its adapter disabled)
under ``torch.no_grad()`` with gradhooks' hooks paused, so the reference forward records
nothing. Loss types: ``"sigmoid"``, ``"hinge"``, ``"ipo"``, ``"robust"`` and their weighted
sums (``loss_weights``), ``f_divergence_type="reverse_kl"``; refused (``UnsupportedLossError``):
the types that couple pairs (``"aot"``, ``"aot_unpaired"`` sort over the batch; ``"sft"`` is a
mean over the batch's tokens), the others not written here, ``ld_alpha``, ``use_weighting``,
an auxiliary loss.
"""
from __future__ import annotations

from typing import Any, Dict

import torch
import torch.nn.functional as F
import trl
from torch import Tensor, nn

from ..base.errors import SampleMixingError, UnsupportedLossError
from ..base.utils import paused
from ..tools.token_losses import per_sample_token_loss
from .transformers import DPTrainerMixin, causal_lm_losses

__all__ = ["DPSFTTrainer", "DPDPOTrainer", "dpo_pair_losses"]

DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust")


class DPSFTTrainer(DPTrainerMixin, trl.SFTTrainer):
    """``trl.SFTTrainer`` with DP-SGD (module docstring): ``trl.SFTTrainer``'s arguments plus
    ``dp`` (:class:`~gradhooks.integrations.transformers.DPConfig`).

    Raises:
        SampleMixingError: ``args.packing`` or ``args.padding_free``.
        UnsupportedLossError: ``args.loss_type != "nll"``, ``args.label_smoothing_factor > 0``,
            or a model with an auxiliary router loss.
        ValueError: as :class:`~gradhooks.integrations.transformers.DPTrainerMixin`.
    """

    def __init__(self, *args, dp, **kwargs):
        super().__init__(*args, dp=dp, **kwargs)
        a = self.args
        if a.packing or getattr(self, "padding_free", False) or a.padding_free:
            raise SampleMixingError(
                "DPSFTTrainer: packing=True / padding_free=True put several samples in one row "
                "of the batch, so a row's gradient is a sum over samples and per-sample clipping "
                "would clip the row, not each sample; set packing=False and padding_free=False "
                "in SFTConfig (each sample its own padded row)")
        if a.loss_type != "nll" or a.label_smoothing_factor > 0 or self.aux_loss_enabled:
            raise UnsupportedLossError(
                f"DPSFTTrainer: the per-sample loss is each sample's negative log-likelihood of "
                f"its own completion tokens; loss_type={a.loss_type!r} (use 'nll'), "
                f"label_smoothing_factor={a.label_smoothing_factor} (use 0) and a router "
                f"auxiliary loss (aux_loss_enabled={self.aux_loss_enabled}) are not written as "
                f"per-sample losses")

    def per_sample_losses(self, model: nn.Module, inputs: Dict[str, Any]) -> Tensor:
        """``(B,)``: each row's mean (or sum, ``dp.token_reduction``) of its valid tokens'
        negative log-likelihoods (labels ``-100`` ignored, causal shift)."""
        inputs = {**inputs, "use_cache": False}
        return causal_lm_losses(model, inputs, self.dp.token_reduction)


def dpo_pair_losses(chosen_logps: Tensor, rejected_logps: Tensor, ref_chosen_logps: Tensor,
                    ref_rejected_logps: Tensor, *, beta: float, loss_types=("sigmoid",),
                    loss_weights=None, label_smoothing: float = 0.0,
                    chosen_lengths=None, rejected_lengths=None) -> Tensor:
    """``(P,)`` DPO losses, one per pair, as ``trl.DPOTrainer`` (1.16) computes them before its
    mean over the batch (Rafailov et al. 2023, arXiv:2305.18290, eq. 7;
    ``f_divergence_type="reverse_kl"``). With ``d = (lc - rc) - (lr - rr)``:
    ``"sigmoid"``: ``-logsigmoid(beta d)``; ``"hinge"``: ``relu(1 - beta d)``; ``"robust"``
    (Chowdhury et al. 2024): ``(-(1-e) logsigmoid(beta d) + e logsigmoid(-beta d)) / (1-2e)``,
    ``e = label_smoothing``; ``"ipo"`` (Azar et al. 2023, with TRL's length normalisation):
    ``((lc - rc) / |c| - (lr - rr) / |r| - 1 / (2 beta))^2``. Several types: the
    ``loss_weights``-weighted sum.

    Args:
        chosen_logps, rejected_logps: ``(P,)`` the policy's completion log-probabilities
            (summed over each completion's tokens).
        ref_chosen_logps, ref_rejected_logps: ``(P,)`` the reference's, constants.
        chosen_lengths, rejected_lengths: ``(P,)`` completion token counts (``"ipo"`` only).

    Raises:
        UnsupportedLossError: a loss type not listed above.
    """
    chosen, rejected = chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps
    weights = loss_weights or [1.0] * len(loss_types)
    total = 0.0
    for kind, weight in zip(loss_types, weights):
        d = beta * (chosen - rejected)
        if kind == "sigmoid":
            part = -F.logsigmoid(d)
        elif kind == "hinge":
            part = torch.relu(1 - d)
        elif kind == "robust":
            e = label_smoothing
            part = (-(1 - e) * F.logsigmoid(d) + e * F.logsigmoid(-d)) / (1 - 2 * e)
        elif kind == "ipo":
            gap = (chosen / chosen_lengths.clamp(min=1.0)
                   - rejected / rejected_lengths.clamp(min=1.0))
            part = (gap - 1 / (2 * beta)) ** 2
        else:
            raise UnsupportedLossError(_dpo_refusal(kind))
        total = total + weight * part
    return total


def _dpo_refusal(kind) -> str:
    why = {"aot": "sorts the log-ratios over the batch's pairs (each pair's loss depends on the "
                  "others)",
           "aot_unpaired": "sorts the log-ratios over the batch's pairs (each pair's loss "
                           "depends on the others)",
           "sft": "is a mean over the batch's chosen tokens, not a loss per pair"}
    return (f"DPDPOTrainer: loss_type {kind!r} " + why.get(kind, "is not written as a per-pair "
            "loss here") + f"; use one or a weighted sum of {list(DPO_LOSS_TYPES)}")


class DPDPOTrainer(DPTrainerMixin, trl.DPOTrainer):
    """``trl.DPOTrainer`` with DP-SGD, the pair the sample (module docstring):
    ``trl.DPOTrainer``'s arguments plus ``dp``
    (:class:`~gradhooks.integrations.transformers.DPConfig`). The lot is Poisson-sampled over
    pairs (``q = L / P_total``); ``lot_sizes`` counts pairs.

    Raises:
        UnsupportedLossError: a loss type outside ``"sigmoid"``, ``"hinge"``, ``"ipo"``,
            ``"robust"``; ``f_divergence_type != "reverse_kl"``; ``ld_alpha``;
            ``use_weighting``; an auxiliary router loss.
        ValueError: as :class:`~gradhooks.integrations.transformers.DPTrainerMixin`.
    """

    def __init__(self, *args, dp, **kwargs):
        super().__init__(*args, dp=dp, **kwargs)
        for kind in self.loss_types:
            if kind not in DPO_LOSS_TYPES:
                raise UnsupportedLossError(_dpo_refusal(kind))
        other = {"f_divergence_type": (self.f_divergence_type, "reverse_kl"),
                 "ld_alpha": (self.ld_alpha, None), "use_weighting": (self.use_weighting, False),
                 "aux_loss_enabled": (self.aux_loss_enabled, False)}
        for name, (value, supported) in other.items():
            if value != supported and str(value) != supported:
                raise UnsupportedLossError(
                    f"DPDPOTrainer: {name}={value!r} is not written as a per-pair loss here; "
                    f"use {name}={supported!r}")

    def per_sample_losses(self, model: nn.Module, inputs: Dict[str, Any]) -> Tensor:
        """``(P,)`` per-pair losses (:func:`dpo_pair_losses`) of a ``[chosen; rejected]``
        batch of ``2P`` rows; declares the pairs as the samples (``gh.set_sample_ids``)."""
        ids, mask = inputs["input_ids"], inputs["completion_mask"]
        pairs = ids.shape[0] // 2
        if "ref_chosen_logps" in inputs:
            ref_c, ref_r = inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
        else:
            with torch.no_grad(), paused():  # the reference forward records nothing
                ref_c, ref_r = self.compute_ref_log_probs(model, inputs)
        kwargs = {k: v for k, v in inputs.items()
                  if k not in ("completion_mask", "ref_chosen_logps", "ref_rejected_logps")}
        logits = model(**kwargs, use_cache=False).logits
        self.gh.set_sample_ids(torch.arange(pairs, device=ids.device).repeat(2))
        labels = ids.masked_fill(mask == 0, -100)
        logps = -per_sample_token_loss(logits, labels, reduction="sum")  # TRL: summed log-probs
        lengths = mask.sum(1).to(logps.dtype)
        return dpo_pair_losses(logps[:pairs], logps[pairs:], ref_c.to(logps.dtype),
                               ref_r.to(logps.dtype), beta=self.beta,
                               loss_types=self.loss_types, loss_weights=self.loss_weights,
                               label_smoothing=self.label_smoothing,
                               chosen_lengths=lengths[:pairs], rejected_lengths=lengths[pairs:])
