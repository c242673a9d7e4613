"""The DP-SGD reads of :class:`~gradhooks.GradHooks`: clipping, the two-pass driver and the
lot's end (:mod:`gradhooks.readers.dp`). A mixin: its methods use the facade's ``recorder`` and
``accumulation``.
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence, Union

import torch
from torch import Tensor

from ..core.recorder.capture import Recorder
from ..readers.dp.accumulation import Accumulation
from ..readers.dp.clipped_backward import clipped_backward
from ..readers.dp.clipping import clip_and_accumulate, finish_step
from ..readers.loss_reduction import unscaled

__all__ = ["DPReads"]


class DPReads:
    """DP-SGD from the records (Abadi et al. 2016): book-keeping, two-pass and materialised
    clipping, accumulation over micro-batches. Mixed into :class:`~gradhooks.GradHooks`."""

    recorder: Recorder  # (the facade's)
    accumulation: Accumulation  # (the facade's)

    def clip_and_accumulate(self, max_norm: Union[float, Sequence[float]], *, method: str = "ghost",
                            noise_multiplier: float = 0.0,
                            generator: Optional[torch.Generator] = None,
                            groups: Optional[Iterable[Iterable[str]]] = None,
                            accumulate: bool = False) -> Tensor:
        """DP-SGD (Abadi et al. 2016, arXiv:1607.00133): overwrite ``param.grad`` with the sum
        of per-sample gradients clipped to ``max_norm`` plus Gaussian noise (ghost clipping by
        default; Li et al. 2022, Bu et al. 2023) and return the ``(B,)`` norms before clipping
        (``groups``: group-wise clipping, ``(B, K)`` norms). ``accumulate=True``: a micro-batch
        of a larger logical batch; its clipped sum is added to :attr:`accumulation` (no noise,
        no division, ``param.grad`` set to ``None``) for :meth:`finish_step`. Arguments and
        errors: :func:`gradhooks.readers.dp.clipping.clip_and_accumulate`, :mod:`gradhooks.readers.dp.accumulation`."""
        materialize = method == "materialize"  # (it reads the per-sample gradients)
        batch = self.recorder.snapshot(
            "per_sample_grads()" if materialize else "clip_and_accumulate()", result=True,
            release=materialize)
        batch = unscaled(batch, self.recorder, materialize)  # (a constant factor on the loss)
        return clip_and_accumulate(batch, max_norm, method=method,
                                   noise_multiplier=noise_multiplier, generator=generator,
                                   groups=None if groups is None else [list(g) for g in groups],
                                   accumulate=accumulate, accumulation=self.accumulation)

    def clipped_backward(self, losses: Tensor, max_norm: float, *, noise_multiplier: float = 0.0,
                         generator: Optional[torch.Generator] = None, accumulate: bool = False) -> Tensor:
        """DP-SGD by two-pass ghost clipping (Li et al. 2022, sec. 4): instead of
        ``loss.backward()``, from the ``(B,)`` per-sample losses, overwrite ``param.grad`` with
        the clipped sum plus noise, keeping memory close to plain training; returns the ``(B,)``
        norms (``(G,)`` losses and norms with :meth:`set_sample_ids`). ``accumulate=True``: add
        the clipped sum to :attr:`accumulation` instead, as :meth:`clip_and_accumulate`.
        Arguments and errors: :func:`gradhooks.readers.dp.clipped_backward.clipped_backward`."""
        return clipped_backward(self.recorder, losses, max_norm,
                                noise_multiplier=noise_multiplier, generator=generator,
                                accumulate=accumulate, accumulation=self.accumulation)

    def finish_step(self, *, noise_multiplier: float = 0.0,
                    expected_batch_size: Optional[float] = None,
                    generator: Optional[torch.Generator] = None) -> int:
        """End a DP-SGD step whose logical batch was clipped in micro-batches
        (``accumulate=True``): write ``param.grad = (sum of the clipped per-sample gradients +
        sigma C z) / D``, the noise drawn once, ``D`` the logical batch size (``"mean"``), 1
        (``"sum"``) or ``expected_batch_size`` (Poisson sampling, as Opacus); returns the
        number of samples. Arguments and errors: :func:`gradhooks.readers.dp.clipping.finish_step`."""
        return finish_step(self.recorder, self.accumulation, noise_multiplier=noise_multiplier,
                           expected_batch_size=expected_batch_size, generator=generator)
