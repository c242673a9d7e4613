"""Every error and warning class gradhooks raises on purpose.

All errors derive from :class:`GradHooksError` (a ``RuntimeError``); several also derive from the
built-in class a caller would catch for that kind of mistake (``TypeError``, ``ValueError``).
Messages name the module (its path in the model and its type) and say what to do.
"""
from __future__ import annotations

__all__ = [
    "GradHooksError",
    "UnsupportedModuleError",
    "BatchSizeError",
    "UnsupportedCallError",
    "ReplayError",
    "HigherOrderGradError",
    "NoBackwardError",
    "RecordsReleasedError",
    "GradientMismatchError",
    "ReplayMismatchError",
    "UnsupportedLossError",
    "FallbackWarning",
    "NotDetachedWarning",
    "SampleMixingError",
    "SampleIdsError",
    "UnprovenOpError",
    "LossScaleWarning",
    "FrozenModelWarning",
]


class GradHooksError(RuntimeError):
    """Base class of every error gradhooks raises on purpose."""


class UnsupportedModuleError(GradHooksError, TypeError):
    """A module owns trainable parameters that no rule can give per-sample gradients for.

    Raised by :func:`gradhooks.attach`; the message names the module's path in the model, its
    type, and the supported types.
    """


class UnsupportedCallError(GradHooksError, ValueError):
    """A supported module was called in a way whose per-sample gradients are not defined.

    Raised at the forward, naming the module: ``BatchNorm`` in training mode (batch statistics
    mix the samples), a recurrent layer with inter-layer dropout in training mode (the dropout
    masks cannot be replayed). The message says what to do instead.
    """


class ReplayError(UnsupportedCallError):
    """The ``torch.func`` fallback cannot replay a module per sample: neither vectorised
    (``torch.func.vmap``) nor sample by sample (plain autograd on each sample's slice,
    :mod:`gradhooks.rules.fallback_replay`).

    Raised at the read, never as the raw torch error from inside the replay. The message names
    the module (path and class), both causes (exception type and first line) and the ways out:
    a dedicated rule (:func:`gradhooks.register_rule`), ``attach(..., strict=True)`` to refuse
    the module at attach, or freezing its parameters.
    """


class HigherOrderGradError(GradHooksError):
    """A backward pass ran with ``create_graph=True`` through a hooked layer.

    The loss then contains derivatives (a gradient penalty, a Laplacian built with
    ``torch.autograd.grad(..., create_graph=True)``), and the parameter gradient has terms that
    grad_output-based rules do not see; per-sample results are refused rather than wrong.
    """


class BatchSizeError(GradHooksError, ValueError):
    """A layer's input has no batch dimension, or layers of one forward disagree on its size."""


class NoBackwardError(GradHooksError):
    """Per-sample results were asked for before any backward pass reached a hooked layer."""


class RecordsReleasedError(NoBackwardError):
    """A read needs the activations and grad_outputs of the batch, but
    :meth:`~gradhooks.GradHooks.per_sample_grads` released them (its default, as
    ``loss.backward()`` frees the graph), or a backward pass reached the hooked layers after it
    did. The message says what to do: read what needs them first, or pass
    ``retain_records=True``."""


class GradientMismatchError(GradHooksError):
    """The per-sample gradients do not sum to the gradient autograd computed for a parameter.

    The message gives the difference, the tolerance and the dtype it was judged at (the
    precision autograd formed the gradient in: :func:`gradhooks.core.recorder.totals.formed_in`), and a
    cause only where one is established (gradient hooks registered before attach); a
    difference far above rounding is what a parameter that also receives gradient outside the
    module that owns it (``x @ layer.weight.T``), a module that mixes the samples, or a captured
    input modified in place after the forward give. The result would be wrong, so it is refused.
    """


class ReplayMismatchError(GradientMismatchError):
    """A ``torch.func`` fallback replay computed something else than the module's batched
    forward: its per-sample gradients do not sum to the gradient of the module's own parameters
    through its batched call on the recorded inputs, or that call run again does not give the
    output the forward gave (:mod:`gradhooks.rules.fallback_replay`).

    Checked on every read of each replayed module, whatever ``check`` says (``check=False``
    skips only the sum check); skipped only with ``attach(..., unsafe_skip_replay_check=True)``. The message names the module, the
    parameter, the difference and its tolerance, the likely causes (the module reads the batch
    size or statistics over the batch, keeps state between calls, or is random) and what to do.
    """


class AccumulationError(GradHooksError):
    """A DP-SGD gradient accumulated over several backward passes would be dropped, counted
    twice or released without its noise.

    Raised by :meth:`~gradhooks.GradHooks.clip_and_accumulate`,
    :meth:`~gradhooks.GradHooks.clipped_backward` and :meth:`~gradhooks.GradHooks.finish_step`
    (:mod:`gradhooks.readers.dp.accumulation`): ``param.grad`` still holds the gradient of an earlier
    batch's ``loss.backward()`` that no clip read (clipping would overwrite it); a plain clip
    while micro-batches are accumulated (call it with ``accumulate=True``, then
    ``finish_step()``); a micro-batch clipped into the accumulation twice; ``finish_step()``
    with nothing accumulated, or after a backward pass that was not clipped into it. The message
    says which and what to do.
    """


class SampleMixingError(GradHooksError):
    """The model's forward mixes the samples of the batch through the parameters: an op that
    reduces or normalises over the batch dim (``h - h.mean(0)``, ``h / h.std(0)``, a softmax or
    sort over the batch, batch statistics) between a hooked layer and the loss.

    Each sample's output then depends on the other samples, and what the hooks record is each
    sample's contribution to the batch gradient, not the gradient of its own loss; the sum check
    cannot see it. Raised at the read (:mod:`gradhooks.core.analysis.mixing`); the message names the op,
    the module upstream of it and the line of the forward, and says what to do (compute the
    statistic outside the forward, ``.detach()`` it, or ``attach(..., allow_sample_mixing=True)``
    to accept the contributions).
    """


class SampleIdsError(GradHooksError, ValueError):
    """``sample_ids`` (:meth:`gradhooks.GradHooks.set_sample_ids`: rows sharing an id are one
    sample) are malformed (not a ``(B,)`` integer tensor on the batch's device), were set for a
    batch no read used, or were set for a read that cannot group rows (KFAC, Jacobians, GGN,
    Gram / NTK, projections)."""


class UnprovenOpError(SampleMixingError):
    """The model's forward runs an op on tensors that carry the batch (and a parameter's
    gradient) that no rule of gradhooks' table proves keeps the samples apart
    (:mod:`gradhooks.core.analysis.separation`: an ``einsum`` that pairs or contracts the batch letter, a
    ``scatter`` / ``index_add`` along the batch dim, indexing that drops the batch dim and is
    broadcast back, a custom ``autograd.Function``, an op the table does not know), and the
    check of the forward alone (:mod:`gradhooks.core.analysis.alone`: one sample run alone reproduces its
    row of the batched output) failed or was not possible.

    Raised at the read; the message names the op, the module upstream of it, the line of the
    forward, the check's finding, and the ways out: ``attach(..., allow_sample_mixing=True)`` to
    accept each sample's contribution to the batch gradient,
    :meth:`~gradhooks.GradHooks.check_samples` to verify, a declared sample index
    (``sample_ids``) where rows of several samples are meant to be pooled, or reporting the op.
    """


class FallbackWarning(UserWarning):
    """Issued once per :func:`gradhooks.attach`, listing the modules the torch.func fallback covers."""


class LossScaleWarning(UserWarning):
    """Issued once per :func:`gradhooks.attach` at the first read of a batch whose forward ran
    in float16 (autocast) when no ``grad_scaler`` was declared: if the loss was scaled
    (``scaler.scale(loss).backward()``), every result is that many times too large. Pass
    ``attach(..., grad_scaler=scaler)``."""


class FrozenModelWarning(UserWarning):
    """Issued by :func:`gradhooks.attach` for a model none of whose parameters requires grad:
    nothing is recorded until some are made trainable (``requires_grad_(True)``), which the
    hooks then follow."""


class NotDetachedWarning(ResourceWarning):
    """A :class:`~gradhooks.GradHooks` was garbage-collected while still attached (never
    :meth:`~gradhooks.GradHooks.detach`-ed, nor used as a context manager): its hooks are
    removed then, as :meth:`~gradhooks.GradHooks.detach` would, and this warning says so, as an
    unclosed file's does. A ``ResourceWarning``: hidden by Python's default filters, shown under
    ``python -X dev``, ``-W default`` and pytest."""


class UnsupportedLossError(GradHooksError, TypeError):
    """A loss gradhooks cannot use as given: :func:`gradhooks.kfac` was given a loss it cannot
    form the Fisher of (not ``nn.CrossEntropyLoss``, ``nn.MSELoss`` or ``nn.BCEWithLogitsLoss``;
    an option that changes the loss's curvature or reduction; or a model output of the wrong
    shape for the loss); or the loss handed to :meth:`~gradhooks.GradHooks.backward` /
    :meth:`~gradhooks.GradHooks.clipped_backward` is not a mean (or sum) over samples as
    ``loss_reduction`` declares: a token mean over a padded batch, a contradicting reduction,
    one batch loss broadcast to ``B`` "per-sample" losses
    (:mod:`gradhooks.readers.loss_reduction`); or, at a read, a loss whose split into
    per-sample terms its graph does not prove while the samples' valid-token counts differ (a
    class-weighted mean whatever the counts; :mod:`gradhooks.core.analysis.backward_losses`), or a
    constant factor on the loss that a DP read cannot read (the message names the counts or the
    loss's ops and the ways out)."""
