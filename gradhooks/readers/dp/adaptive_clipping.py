"""Adaptive clipping for DP-SGD: the clipping norm follows a quantile of the per-sample gradient
norms, estimated privately (Andrew, Thakkar, McMahan, Ramaswamy 2021, "Differentially Private
Learning with Adaptive Clipping", NeurIPS, arXiv:1905.03871, Algorithm 1 with the geometric
update; Opacus' ``AdaClipDPOptimizer``).

After each step's clipping with bound ``C_t``, with ``b_n = 1[||g_n|| <= C_t]`` (sample ``n``
not clipped) over the ``B`` samples of the lot::

    b~   = (sum_n b_n + N(0, sigma_b^2)) / B            the noised unclipped fraction
    C_t+1 = clamp(C_t exp(-eta (b~ - gamma)), C_min, C_max)

``gamma`` the target quantile, ``eta`` the learning rate, ``sigma_b`` the count's noise. The
count's release costs privacy: Theorem 1 of the paper makes the pair (noised clipped sum with
multiplier ``sigma_Delta``, noised count with ``sigma_b``) as private as one Gaussian mechanism of
multiplier ``sigma`` when ``sigma_Delta = (sigma^-2 - (2 sigma_b)^-2)^(-1/2)``
(:attr:`AdaptiveClipping.gradient_noise_multiplier`): the gradient noise is drawn with that
larger multiplier, and the accountant is given ``sigma`` (:attr:`AdaptiveClipping.noise_multiplier`).
This is Opacus 1.6's convention, and its noise draws come in its order (the gradient's
parameter by parameter, then the count's), so the same generator gives the same trajectory.

Works with every clipping read that returns the ``(B,)`` norms: book-keeping
(``gh.clip_and_accumulate``) and two-pass (``gh.clipped_backward``); under DDP / FSDP2 the
count and the lot size are summed over the ranks and the count's noise is drawn once (rank 0)
and broadcast, so every rank gets the same bound.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["AdaptiveClipping"]


class AdaptiveClipping:
    """The clipping bound of DP-SGD with adaptive clipping, updated after each step from the
    step's per-sample norms (module docstring; Andrew et al. 2021, arXiv:1905.03871).

    Use::

        ada = gradhooks.AdaptiveClipping(1.0, noise_multiplier=1.0, count_noise_std=8.0)
        gh.backward(loss)
        norms = gh.clip_and_accumulate(ada.max_norm,
                                       noise_multiplier=ada.gradient_noise_multiplier)
        ada.update(norms)            # C for the next step
        optimizer.step()
        # accountant.step(noise_multiplier=ada.noise_multiplier, sample_rate=q)

    Args:
        max_norm: ``C_0 > 0``, the first step's bound.
        noise_multiplier: ``sigma >= 0``, the multiplier the privacy accountant sees.
        count_noise_std: ``sigma_b``, the standard deviation of the noise on the unclipped count
            (the paper suggests about ``B / 20``); ``2 sigma_b > sigma`` is required where
            ``sigma > 0`` (else no gradient noise multiplier gives the privacy of ``sigma``).
        target_quantile: ``gamma`` in ``[0, 1]``, the fraction of samples that should end up
            unclipped (default 0.5: the median norm).
        learning_rate: ``eta > 0`` of the geometric update (default 0.2, the paper's).
        min_norm, max_norm_bound: the bound is kept in ``[min_norm, max_norm_bound]``
            (defaults ``0`` and ``inf``; Opacus' ``min_clipbound`` / ``max_clipbound``).
        generator: a ``torch.Generator`` for the count's noise (pass the one the clipping read
            uses for its noise to reproduce Opacus' draws); default torch's global one.

    Raises:
        ValueError: a bound not positive, ``min_norm >= max_norm_bound``, ``target_quantile``
            outside ``[0, 1]``, ``learning_rate <= 0``, ``noise_multiplier < 0``,
            ``count_noise_std < 0``, or ``noise_multiplier >= 2 count_noise_std`` with
            ``noise_multiplier > 0``.
    """

    def __init__(self, max_norm: float, *, noise_multiplier: float, count_noise_std: float,
                 target_quantile: float = 0.5, learning_rate: float = 0.2,
                 min_norm: float = 0.0, max_norm_bound: float = math.inf,
                 generator: Optional[torch.Generator] = None):
        if not max_norm > 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm}")
        if not 0 <= min_norm < max_norm_bound:
            raise ValueError(f"need 0 <= min_norm < max_norm_bound, got {min_norm}, "
                             f"{max_norm_bound}")
        if not 0.0 <= target_quantile <= 1.0:
            raise ValueError(f"target_quantile must be in [0, 1], got {target_quantile}")
        if not learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {learning_rate}")
        if noise_multiplier < 0 or count_noise_std < 0:
            raise ValueError(f"noise_multiplier and count_noise_std must be >= 0, got "
                             f"{noise_multiplier}, {count_noise_std}")
        if noise_multiplier > 0 and noise_multiplier >= 2 * count_noise_std:
            raise ValueError(
                f"noise_multiplier ({noise_multiplier}) must be below 2 * count_noise_std "
                f"({2 * count_noise_std}): the count's release uses part of the privacy of "
                f"sigma, and sigma_Delta = (sigma^-2 - (2 sigma_b)^-2)^(-1/2) needs "
                f"2 sigma_b > sigma (Andrew et al. 2021, Theorem 1)")
        self.max_norm = float(min(max(max_norm, min_norm), max_norm_bound))
        self.noise_multiplier = float(noise_multiplier)
        self.count_noise_std = float(count_noise_std)
        self.target_quantile, self.learning_rate = float(target_quantile), float(learning_rate)
        self.min_norm, self.max_norm_bound = float(min_norm), float(max_norm_bound)
        self.generator = generator
        #: the noised unclipped fraction of the last update (``b~``), ``None`` before the first
        self.unclipped_fraction: Optional[float] = None

    @property
    def gradient_noise_multiplier(self) -> float:
        """``sigma_Delta = (sigma^-2 - (2 sigma_b)^-2)^(-1/2)`` (``0`` for ``sigma = 0``): the
        multiplier to draw the gradient's noise with, so that gradient and count together are as
        private as ``sigma`` (Andrew et al. 2021, Theorem 1)."""
        if self.noise_multiplier == 0:
            return 0.0
        return (self.noise_multiplier ** -2 - (2 * self.count_noise_std) ** -2) ** -0.5

    def update(self, norms: Tensor, *, batch_size: Optional[int] = None) -> float:
        """Update the bound from one step's per-sample norms and return the next bound.

        Args:
            norms: ``(B,)`` per-sample gradient norms before clipping, as the clipping read
                returned them (``(B, K)`` group-wise norms are refused: one bound is adapted).
                Under DDP / FSDP2 each rank's own samples; the count and ``B`` are summed over
                the ranks of the default process group.
            batch_size: the lot size ``B`` to divide the count by (default: the number of norms,
                over the ranks), e.g. the expected lot size ``q N`` of Poisson sampling.

        Returns:
            ``C_t+1`` (also :attr:`max_norm`), a Python float.

        Raises:
            ValueError: ``norms`` not one-dimensional.
        """
        if not isinstance(norms, Tensor) or norms.dim() != 1:
            raise ValueError("update() needs the (B,) per-sample norms the clipping read returned"
                             f" (one bound is adapted), got {getattr(norms, 'shape', norms)}")
        counts = torch.tensor([float((norms <= self.max_norm).sum()), float(norms.numel())],
                              dtype=torch.float64, device=norms.device)
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if distributed:
            dist.all_reduce(counts)
        noise = torch.zeros((), dtype=torch.float64, device=norms.device)
        if self.count_noise_std > 0 and (not distributed or dist.get_rank() == 0):
            # (in float32, of shape (), as Opacus draws it: the same generator, the same draw)
            noise = torch.normal(0.0, self.count_noise_std, (), device=norms.device,
                                 generator=self.generator, dtype=torch.float32).double()
        if distributed:
            dist.broadcast(noise, src=0)
        size = float(counts[1]) if batch_size is None else float(batch_size)
        unclipped = float(counts[0] + noise) / size if size else self.target_quantile
        self.unclipped_fraction = unclipped
        bound = self.max_norm * math.exp(-self.learning_rate * (unclipped - self.target_quantile))
        self.max_norm = float(min(max(bound, self.min_norm), self.max_norm_bound))
        return self.max_norm
