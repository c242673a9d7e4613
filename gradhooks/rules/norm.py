"""Rules for the normalisation layers with an elementwise affine map.

Covered: ``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.GroupNorm``, ``nn.InstanceNorm1d/2d/3d``
(``affine=True``) and ``nn.BatchNorm1d/2d/3d`` (``affine=True``; per-sample only with running
statistics, see below).

Index conventions: ``n`` sample, ``s`` shared position (every element of sample ``n`` that is
scaled by the same parameter entry: tokens and pixels, and for LayerNorm/RMSNorm every leading
position), ``p`` parameter entry (an element of ``normalized_shape``, or a channel ``c``).

Forward: a normalisation ``x̂`` of the input followed by an elementwise affine map::

    y[n, s, p] = x̂[n, s, p] * weight[p] + bias[p]

``x̂`` does not depend on ``weight`` or ``bias``, so with ``g = dL/dy`` (grad_output)::

    dL_n/dweight[p] = sum_s g[n, s, p] x̂[n, s, p]          dL_n/dbias[p] = sum_s g[n, s, p]

``x̂`` is recomputed from the recorded input exactly as torch normalises (torch docs of each
layer; the variance is the biased one, ``correction=0``, everywhere)::

    LayerNorm     x̂ = (x - mean) / sqrt(var + eps), over the trailing ``normalized_shape`` dims
                  of each position (Ba et al. 2016, arXiv:1607.06450, sec. 3)
    RMSNorm       x̂ = x / sqrt(mean(x^2) + eps), over the trailing dims; ``eps=None`` is
                  ``torch.finfo(x.dtype).eps`` (Zhang & Sennrich 2019, arXiv:1910.07467, eq. 4)
    GroupNorm     mean, var over the ``C/G`` channels of a group and all spatial positions of one
                  sample (Wu & He 2018, arXiv:1803.08494, sec. 3.1, eq. 1-3)
    InstanceNorm  mean, var over the spatial positions of one sample and channel (Ulyanov et al.
                  2016, arXiv:1607.08022, eq. 4); with ``track_running_stats=True`` in eval mode
                  the running statistics instead
    BatchNorm     eval mode with running statistics:
                  x̂ = (x - running_mean) / sqrt(running_var + eps) (Ioffe & Szegedy 2015,
                  arXiv:1502.03167, alg. 2); training mode (or ``track_running_stats=False``) uses
                  the statistics of the whole batch (alg. 1), so sample ``n``'s output depends on
                  every other sample and per-sample gradients are not defined: refused at the
                  forward with :class:`~gradhooks.base.errors.UnsupportedCallError` unless
                  ``attach(model, allow_batchnorm_train=True)``, which returns each sample's
                  *contribution* ``sum_s g[n, s, c] x̂_batch[n, s, c]`` with the batch statistics
                  held fixed. The contributions sum to ``param.grad`` (the formula above is exact
                  for the batch gradient, since ``x̂`` does not depend on ``weight``/``bias``), but
                  they are not the gradients of each sample's own loss.

Running statistics are read from the module when the results are computed: a layer whose running
statistics change between the forward and :meth:`~gradhooks.GradHooks.per_sample_grads` (a
no-grad forward in training mode in between) gets a different ``x̂``, which the sum check reports
as :class:`~gradhooks.base.errors.GradientMismatchError`.

Batch dim: LayerNorm and RMSNorm follow ``batch_first`` like ``nn.Linear`` (``(T, B, ...,
*normalized_shape)`` with ``batch_first=False``; an input with only one dim before
``normalized_shape`` is read as batch-first); the other layers always take the batch on dim 0 and
the channels on dim 1 (torch's layout). Under autocast the inputs reach the rules promoted to
float32 (:func:`gradhooks.readers.per_sample.call_grads`), so ``x̂`` is computed in float32.
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..base.errors import BatchSizeError, UnsupportedCallError
from ..base.registry import LayerRule, register_rule

__all__ = ["LayerNormRule", "RMSNormRule", "GroupNormRule", "InstanceNormRule", "BatchNormRule"]


def _standardise(x: Tensor, dims, eps: float) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` with the mean and biased variance over ``dims`` (new tensor).

    Over trailing dims this is ``F.layer_norm`` without affine parameters: one fused kernel,
    8x faster on CPU than ``var_mean`` + subtract + scale (0.06 against 0.47 ms for
    ``(16, 64, 128)``, 2 threads), equal to 7e-7 in float32 and 2e-15 in float64.
    """
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    k = len(dims)
    if sorted(d % x.dim() for d in dims) == list(range(x.dim() - k, x.dim())):
        return F.layer_norm(x, x.shape[x.dim() - k:], None, None, eps)
    var, mean = torch.var_mean(x, dim=dims, correction=0, keepdim=True)
    return (x - mean).mul_(torch.rsqrt(var.add_(eps)))


def _running_standardise(module: nn.Module, x: Tensor) -> Tensor:
    """``(x - running_mean[c]) / sqrt(running_var[c] + eps)`` for ``x`` ``(B, C, *spatial)``."""
    shape = (1, -1) + (1,) * (x.dim() - 2)
    mean = module.running_mean.to(x.dtype).view(shape)
    var = module.running_var.to(x.dtype).view(shape)
    return (x - mean).mul_(torch.rsqrt(var + module.eps))


def _running_stats_grads(module: nn.Module, a: Tensor, g: Tensor, names: Iterable[str]
                         ) -> Dict[str, Tensor]:
    """``weight``, ``bias`` ``(B, C)``: ``sum_s g x̂`` and ``sum_s g`` of a channel norm that
    standardises with its running statistics, by torch's own fused eval-mode batch-norm backward
    with the ``(sample, channel)`` pairs as its channels (input ``(1, B*C, *spatial)``, the
    statistics repeated per sample): one pass over ``a`` and ``g``, 3-6x faster on the CPU than
    forming ``x̂`` (``(x - mean) * rsqrt(var + eps)``, then ``* g``, then the sum: ResNet-50's
    BatchNorms at 224 x 224, B = 16, 2 threads, e.g. 23.4 against 4.8 ms at (64, 112, 112)),
    and as exact (it subtracts the mean before the product: no cancellation).

    Args:
        module: a channel norm with ``running_mean`` / ``running_var`` ``(C,)``.
        a: its input ``(B, C, *spatial)``, ``B > 0``; g: grad_output, ``a``'s shape and dtype.
    """
    n, c = a.shape[0], a.shape[1]
    shape = (1, n * c, *a.shape[2:])
    mean = module.running_mean.to(a.dtype).repeat(n)
    var = module.running_var.to(a.dtype).repeat(n)
    names = tuple(names)
    _, weight, bias = torch.ops.aten.native_batch_norm_backward(
        g.reshape(shape), a.reshape(shape), None, mean, var, None, None, False, module.eps,
        [False, "weight" in names, "bias" in names])
    out = {}
    if "weight" in names:
        out["weight"] = weight.view(n, c)
    if "bias" in names:
        out["bias"] = bias.view(n, c)
    return out


class _AffineNormRule(LayerRule):
    """Shared part: ``weight`` = sum over shared positions of ``g * x̂``, ``bias`` = sum of ``g``.

    Subclasses implement :meth:`normalised` (``x̂``, same shape as the input) and
    :meth:`per_entry` (sum a tensor shaped like the input over the shared positions of each
    sample, giving ``(B, *param.shape)``).
    """

    differentiable = True

    def normalised(self, module: nn.Module, a: Tensor) -> Tensor:
        raise NotImplementedError

    def per_entry(self, module: nn.Module, t: Tensor, batch_first: bool) -> Tensor:
        raise NotImplementedError

    def per_sample_grads(
        self, module: nn.Module, a: Tensor, g: Tensor, batch_first: bool, names: Iterable[str]
    ) -> Dict[str, Tensor]:
        """``weight``: ``(B, *weight.shape)`` = ``sum_s g x̂``; ``bias``: ``(B, *bias.shape)`` =
        ``sum_s g``."""
        out = {}
        if "weight" in names:
            out["weight"] = self.per_entry(module, self.normalised(module, a).mul_(g), batch_first)
        if "bias" in names:
            out["bias"] = self.per_entry(module, g, batch_first)
        return out


# --------------------------------------------------------------------------- LayerNorm, RMSNorm
class _TrailingNormRule(_AffineNormRule):
    """Normalisation over the trailing ``normalized_shape`` dims; parameters of that shape.

    Input ``(B, *, *normalized_shape)`` (or ``(T, B, *, *normalized_shape)`` with
    ``batch_first=False``); every position of ``*`` (and ``T``) is a shared position.
    """

    position_wise = True

    @staticmethod
    def normalized_shape(module: nn.Module) -> Tuple[int, ...]:
        """The trailing dims normalised over (``module.normalized_shape``; the weight's shape
        for layers that do not store it)."""
        return tuple(module.normalized_shape)

    def _batch_dim(self, module: nn.Module, x: Tensor, batch_first: bool) -> int:
        # As nn.Linear: batch_first=False means torch's sequence layout, but an input with a
        # single dim before normalized_shape has only one candidate batch dim.
        return 0 if batch_first or x.dim() < len(self.normalized_shape(module)) + 2 else 1

    def batch_size(self, module: nn.Module, x: Tensor, batch_first: bool) -> int:
        """``B``. Raises :class:`BatchSizeError` for an input without a dim before ``normalized_shape``."""
        shape = self.normalized_shape(module)
        if x.dim() <= len(shape):
            raise BatchSizeError(
                f"got an unbatched input of shape {tuple(x.shape)} (only the normalized_shape "
                f"{shape}); per-sample gradients need a batch dimension: "
                f"pass (B, *normalized_shape) (e.g. x.unsqueeze(0))"
            )
        return x.shape[self._batch_dim(module, x, batch_first)]

    def per_entry(self, module: nn.Module, t: Tensor, batch_first: bool) -> Tensor:
        """``t`` shaped like the input -> ``(B, *normalized_shape)``, summed over positions."""
        bd = self._batch_dim(module, t, batch_first)
        # (B, S, *normalized_shape), or (T, B, S, *normalized_shape): no transposed copy
        shape = self.normalized_shape(module)
        s = math.prod(t.shape[bd + 1:len(t.shape) - len(shape)])  # (explicit: B = 0)
        lead = t.reshape(*t.shape[:bd + 1], s, *shape)
        return lead.sum((0, 2)) if bd == 1 else lead.sum(1)

    def _norm_dims(self, module: nn.Module) -> Tuple[int, ...]:
        return tuple(range(-len(self.normalized_shape(module)), 0))


@register_rule(nn.LayerNorm)
class LayerNormRule(_TrailingNormRule):
    """``nn.LayerNorm`` (``elementwise_affine=True``, with or without bias).

    ``x̂ = (x - mean) / sqrt(var + eps)`` over ``normalized_shape`` (Ba et al. 2016, sec. 3;
    torch docs of ``nn.LayerNorm``). Returns ``weight`` and ``bias``: ``(B, *normalized_shape)``.
    """

    def normalised(self, module: nn.Module, a: Tensor) -> Tensor:
        return _standardise(a, self._norm_dims(module), module.eps)

    def formula(self, module: nn.Module, x: Tensor) -> Tensor:
        """What the rule assumes the module computes (for :mod:`gradhooks.rules.known`'s check of
        subclasses such as timm's ``LayerNorm``): ``F.layer_norm`` with the module's options."""
        return F.layer_norm(x, module.normalized_shape, module.weight, module.bias, module.eps)

    def probe_input(self, module: nn.Module) -> Optional[Tensor]:
        """``(2, 3, *normalized_shape)`` in the weight's dtype, or ``None`` without a weight."""
        w = module.weight
        if not isinstance(w, nn.Parameter):
            return None
        return torch.randn(2, 3, *module.normalized_shape, dtype=w.dtype, device=w.device)


@register_rule(nn.RMSNorm)
class RMSNormRule(_TrailingNormRule):
    """``nn.RMSNorm`` with ``elementwise_affine=True`` (without it the layer has no parameters).

    ``x̂ = x / sqrt(mean(x^2) + eps)`` over ``normalized_shape``, ``eps=None`` meaning
    ``torch.finfo(x.dtype).eps`` of the computation dtype (Zhang & Sennrich 2019, eq. 4; torch
    docs of ``nn.RMSNorm``). Returns ``weight``: ``(B, *normalized_shape)``.
    """

    param_names = ("weight",)

    def normalised(self, module: nn.Module, a: Tensor) -> Tensor:
        eps = module.eps if module.eps is not None else torch.finfo(a.dtype).eps
        ms = a.square().mean(self._norm_dims(module), keepdim=True)
        return a * torch.rsqrt(ms.add_(eps))


# --------------------------------------------------------------------------- channel norms
class _ChannelNormRule(_AffineNormRule):
    """Input ``(B, C, *spatial)``, parameters ``(C,)``; spatial positions are shared positions.

    The batch is always dim 0 (torch's layout for these layers), whatever ``batch_first``.
    """

    def batch_size(self, module: nn.Module, x: Tensor, batch_first: bool) -> int:
        """``B = x.shape[0]``. Raises :class:`BatchSizeError` for an input without batch dim."""
        ndim = self._batched_ndim(module)
        if x.dim() < 2 or (ndim is not None and x.dim() != ndim):
            raise BatchSizeError(
                f"got an input of shape {tuple(x.shape)}; per-sample gradients need a batched "
                f"input (B, C, *spatial) with {ndim if ndim is not None else 'at least 2'} dims "
                f"(e.g. x.unsqueeze(0))"
            )
        return x.shape[0]

    def _batched_ndim(self, module: nn.Module) -> Optional[int]:
        """The number of dims of a batched input, or ``None`` if any number from 2 up is."""
        return None

    def per_entry(self, module: nn.Module, t: Tensor, batch_first: bool) -> Tensor:
        """``t`` ``(B, C, *spatial)`` -> ``(B, C)``, summed over the spatial positions."""
        return t.reshape(t.shape[0], t.shape[1], -1).sum(-1)

    def uses_running_stats(self, module: nn.Module) -> bool:
        """Whether ``x̂`` is standardised with ``running_mean`` / ``running_var``."""
        return False

    def per_sample_grads(
        self, module: nn.Module, a: Tensor, g: Tensor, batch_first: bool, names: Iterable[str]
    ) -> Dict[str, Tensor]:
        """As :meth:`_AffineNormRule.per_sample_grads`; with running statistics (eval mode) by
        :func:`_running_stats_grads`."""
        if a.shape[0] and self.uses_running_stats(module):
            return _running_stats_grads(module, a, g, names)
        return super().per_sample_grads(module, a, g, batch_first, names)


@register_rule(nn.GroupNorm)
class GroupNormRule(_ChannelNormRule):
    """``nn.GroupNorm`` (``affine=True``): input ``(B, C, *spatial)``.

    ``x̂`` standardises each group of ``C / num_groups`` channels of one sample over those channels
    and all spatial positions (Wu & He 2018, sec. 3.1; torch docs of ``nn.GroupNorm``). Returns
    ``weight`` and ``bias``: ``(B, C)``.
    """

    def normalised(self, module: nn.Module, a: Tensor) -> Tensor:
        grouped = a.reshape(a.shape[0], module.num_groups, -1)
        return _standardise(grouped, -1, module.eps).view(a.shape)


_INSTANCE_DIMS = ((nn.InstanceNorm1d, 3), (nn.InstanceNorm2d, 4), (nn.InstanceNorm3d, 5))


@register_rule(nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
class InstanceNormRule(_ChannelNormRule):
    """``nn.InstanceNorm1d/2d/3d`` (``affine=True``): input ``(B, C, *spatial)`` (batched only).

    ``x̂`` standardises each channel of each sample over its spatial positions (Ulyanov et al.
    2016, eq. 4), or uses ``running_mean``/``running_var`` when ``track_running_stats=True`` and
    the module is in eval mode (torch docs of ``nn.InstanceNorm1d``). Either way a sample's
    output depends on that sample only. Returns ``weight`` and ``bias``: ``(B, C)``.
    """

    def _batched_ndim(self, module: nn.Module) -> Optional[int]:
        # (C, *spatial) is torch's unbatched form, which has no per-sample gradients
        for cls, ndim in _INSTANCE_DIMS:
            if isinstance(module, cls):
                return ndim
        return None

    def uses_running_stats(self, module: nn.Module) -> bool:
        return not (module.training or not module.track_running_stats)

    def normalised(self, module: nn.Module, a: Tensor) -> Tensor:
        if not self.uses_running_stats(module):
            return _standardise(a, tuple(range(2, a.dim())), module.eps)
        return _running_standardise(module, a)


def _uses_batch_stats(module: nn.Module) -> bool:
    # torch's _BatchNorm.forward: bn_training = training or (no running statistics)
    return module.training or (module.running_mean is None and module.running_var is None)


@register_rule(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
class BatchNormRule(_ChannelNormRule):
    """``nn.BatchNorm1d/2d/3d`` (``affine=True``): input ``(B, C)`` or ``(B, C, *spatial)``.

    Eval mode with running statistics: ``x̂ = (x - running_mean) / sqrt(running_var + eps)``
    (Ioffe & Szegedy 2015, alg. 2; torch docs of ``nn.BatchNorm1d``): exact per-sample
    gradients. With batch statistics (training mode, or ``track_running_stats=False``) only with
    ``allow_batchnorm_train=True``: ``x̂`` standardised over the batch and spatial dims (alg. 1),
    and the result is each sample's contribution to the batch gradient (see the module
    docstring). Returns ``weight`` and ``bias``: ``(B, C)``.

    Raises:
        UnsupportedCallError: at the forward, for a call that uses batch statistics without
            ``allow_batchnorm_train=True``.
    """

    #: The check must also run when nothing is recorded (``affine=False``, frozen parameters):
    #: batch statistics make the results of every layer before this one contributions too.
    #: Read by the hook manager once it supports it (see the issue 3 report).
    check_always = True

    def check_call(self, module: nn.Module, args: tuple, kwargs: dict, options: Dict[str, object]) -> None:
        if not _uses_batch_stats(module) or options.get("allow_batchnorm_train", False):
            return
        name = type(module).__name__
        if module.training and module.running_mean is not None:
            why = "is in training mode, so it normalises with the mean and variance of the whole batch"
            evals = "; put it in eval mode (model.eval()) to normalise with its running statistics"
        else:
            why = ("has no running statistics (track_running_stats=False), so it normalises with "
                   "the mean and variance of the whole batch even in eval mode")
            evals = ""
        raise UnsupportedCallError(
            f"{name} {why}: each sample's output depends on every other sample of the batch, and "
            f"per-sample gradients are not defined. Replace it by nn.GroupNorm (the usual "
            f"replacement, which normalises each sample alone; nn.LayerNorm or "
            f"nn.InstanceNorm{name[-2:]}(affine=True) also work){evals}; or attach(model, "
            f"allow_batchnorm_train=True) to get each sample's contribution to the batch gradient "
            f"with the batch statistics held fixed (they sum to param.grad, but are not the "
            f"gradients of each sample's own loss)"
        )

    def uses_running_stats(self, module: nn.Module) -> bool:
        return not _uses_batch_stats(module)

    def normalised(self, module: nn.Module, a: Tensor) -> Tensor:
        if _uses_batch_stats(module):
            return _standardise(a, (0,) + tuple(range(2, a.dim())), module.eps)
        return _running_standardise(module, a)


# --------------------------------------------------------------------------- other libraries' norms
# Not registered by type (gradhooks imports neither transformers nor timm nor torchvision):
# gradhooks.rules.known recognises these classes by name and checks ``formula`` against the
# module's own forward on ``probe_input`` before it uses the rule.

def _eps_of(module: nn.Module) -> float:
    eps = getattr(module, "variance_epsilon", None)
    return getattr(module, "eps", 1e-6) if eps is None else eps


class RMSNormLikeRule(_TrailingNormRule):
    """An RMSNorm written in the model's own code: transformers' ``LlamaRMSNorm``,
    ``Qwen2RMSNorm``, ``MistralRMSNorm`` ..., ``T5LayerNorm``, ``GemmaRMSNorm`` (``1 + weight``),
    ``Olmo2RMSNorm``; timm's ``RmsNorm``.

    ``y = weight * x̂``, ``x̂ = x / sqrt(mean(x^2) + eps)`` over the last ``weight.dim()`` dims
    (Zhang & Sennrich 2019, eq. 4), with ``eps`` the module's ``variance_epsilon`` or ``eps``.
    These layers differ in where they round, which matters at float64's precision, so the rule
    comes in three ``precision`` variants and :mod:`gradhooks.rules.known` picks the one whose
    :meth:`formula` equals the module's output on a float64 probe:

    * ``"input"``: everything in the input's dtype (timm ``RmsNorm``, ``nn.RMSNorm``);
    * ``"float32"``: ``x̂`` computed in float32 and cast back to the input's dtype
      (``LlamaRMSNorm`` and its copies: ``hidden_states.to(torch.float32)``);
    * ``"float32-variance"``: only ``mean(x^2)`` in float32, the product in the input's dtype
      (``T5LayerNorm``).

    and, with ``precision="float32"``, three ``scale`` variants, which say how the weight scales
    ``x̂``:

    * ``"weight"``: ``y = weight * x̂.to(input dtype)`` (``LlamaRMSNorm``, ``MambaRMSNorm``,
      ``Mamba2RMSNorm``, ``OlmoeRMSNorm``; every ``precision``);
    * ``"weight-float32"``: ``y = (weight * x̂).to(input dtype)``, the product taken before the
      cast back (``Olmo2RMSNorm``);
    * ``"one-plus-weight-float32"``: ``y = (x̂ * (1 + weight.float())).to(input dtype)``
      (``GemmaRMSNorm``, ``Gemma2RMSNorm``, ``Gemma3RMSNorm``: a zero weight is the identity
      scale, transformers PR 29402).

    In every variant ``y`` is ``x̂`` times an affine function of ``weight`` with slope 1, so the
    per-sample gradient is ``dL_n/dweight = sum_s g[n, s] x̂[n, s]`` (the variants differ only in
    rounding, float32's where they compute in float32, which the float64 probe tells apart;
    with a float64 weight OLMo-2's product is Llama's, and the probe picks ``"weight"``).

    Input ``(B, *, D)`` (``batch_first`` as ``nn.Linear``); returns ``weight``: ``(B, D)``.

    Raises:
        BatchSizeError: for an input without a batch dim.
    """

    param_names = ("weight",)

    #: The ``scale`` variants (see the class docstring).
    SCALES = ("weight", "weight-float32", "one-plus-weight-float32")

    def __init__(self, precision: str = "input", scale: str = "weight"):
        if precision not in ("input", "float32", "float32-variance"):
            raise ValueError(f"unknown precision {precision!r}")
        if scale not in self.SCALES or (scale != "weight" and precision != "float32"):
            raise ValueError(f"unknown scale {scale!r} (with precision {precision!r}); one of "
                             f"{self.SCALES}, the last two with precision 'float32'")
        self.precision, self.scale = precision, scale

    @staticmethod
    def normalized_shape(module: nn.Module) -> Tuple[int, ...]:
        return tuple(module.weight.shape)

    def normalised(self, module: nn.Module, a: Tensor) -> Tensor:
        dims, eps = self._norm_dims(module), _eps_of(module)
        if self.precision == "input":
            return a * torch.rsqrt(a.square().mean(dims, keepdim=True).add_(eps))
        a32 = a.to(torch.float32)
        inv = torch.rsqrt(a32.pow(2).mean(dims, keepdim=True) + eps)
        if self.precision == "float32":
            return (a32 * inv).to(a.dtype)
        return a * inv  # (float64 * float32 -> float64, as T5LayerNorm)

    def formula(self, module: nn.Module, x: Tensor) -> Tensor:
        """``y`` as the module is assumed to compute it (``precision`` and ``scale``)."""
        if self.scale == "weight":
            return module.weight * self.normalised(module, x)
        x32 = x.to(torch.float32)
        xhat = x32 * torch.rsqrt(x32.pow(2).mean(self._norm_dims(module), keepdim=True) + _eps_of(module))
        if self.scale == "weight-float32":
            return (module.weight * xhat).to(x.dtype)
        return (xhat * (1.0 + module.weight.float())).to(x.dtype)

    def probe_input(self, module: nn.Module) -> Optional[Tensor]:
        """``(2, 3, *weight.shape)`` in float64 (where the variants differ), or ``None`` if the
        module's only parameter is not a ``weight``."""
        w = getattr(module, "weight", None)
        if not isinstance(w, nn.Parameter) or [n for n, _ in module.named_parameters(recurse=False)] != ["weight"]:
            return None
        return torch.randn(2, 3, *w.shape, dtype=torch.float64, device=w.device)


class LayerNorm2dRule(_ChannelNormRule):
    """LayerNorm over the channels of an NCHW tensor: timm's and torchvision's ``LayerNorm2d``
    (ConvNeXt), an ``nn.LayerNorm`` subclass that permutes to NHWC, normalises the last dim and
    permutes back.

    ``x̂[n, :, h, w] = (x[n, :, h, w] - mean) / sqrt(var + eps)`` over the ``C`` channels of
    each pixel (Ba et al. 2016, sec. 3; Liu et al. 2022, arXiv:2201.03545, sec. 2.6), then the
    channel-wise affine map of this module's docstring. Input ``(B, C, *spatial)`` (batch on
    dim 0); returns ``weight`` and ``bias``: ``(B, C)``.

    Raises:
        BatchSizeError: for an input without a batch dim.
    """

    def normalised(self, module: nn.Module, a: Tensor) -> Tensor:
        x = a.movedim(1, -1)  # (B, *spatial, C), a view
        return F.layer_norm(x, x.shape[-1:], None, None, module.eps).movedim(-1, 1)

    def formula(self, module: nn.Module, x: Tensor) -> Tensor:
        """``F.layer_norm`` over dim 1 with the module's weight, bias and eps."""
        return F.layer_norm(x.movedim(1, -1), (x.shape[1],), module.weight, module.bias,
                            module.eps).movedim(-1, 1)

    def probe_input(self, module: nn.Module) -> Optional[Tensor]:
        """``(2, C, 3, 2)``, or ``None`` without a ``(C,)`` weight."""
        w = getattr(module, "weight", None)
        if not isinstance(w, nn.Parameter) or w.dim() != 1:
            return None
        return torch.randn(2, w.shape[0], 3, 2, dtype=w.dtype, device=w.device)


class BatchNormActRule(BatchNormRule):
    """timm's ``BatchNormAct2d``: an ``nn.BatchNorm2d`` subclass whose forward applies its
    ``drop`` and ``act`` submodules to the normalised output, ``y = act(drop(bn(x)))``.

    The hooks see ``g = dL/dy`` after the activation; the rule recomputes ``z = bn(x)`` (the
    :class:`BatchNormRule` formula, running statistics in eval mode) and pulls ``g`` back through
    ``act(drop(.))`` with one elementwise autograd call, ``g_z = dL/dz``, then forms
    ``dL_n/dweight = sum_s g_z x̂``, ``dL_n/dbias = sum_s g_z``. Training mode is refused as for
    ``BatchNorm2d`` (``allow_batchnorm_train``). Returns ``weight``, ``bias``: ``(B, C)``.

    Raises:
        UnsupportedCallError: at the forward, for batch statistics (see :class:`BatchNormRule`).
    """

    differentiable = False  # (its activation's vjp is taken on a detached copy)

    def per_sample_grads(
        self, module: nn.Module, a: Tensor, g: Tensor, batch_first: bool, names: Iterable[str]
    ) -> Dict[str, Tensor]:
        xhat = self.normalised(module, a)
        shape = (1, -1) + (1,) * (a.dim() - 2)
        z = xhat if module.weight is None else xhat * module.weight.detach().to(xhat.dtype).view(shape)
        if module.bias is not None:
            z = z + module.bias.detach().to(xhat.dtype).view(shape)
        with torch.enable_grad():
            z = z.detach().requires_grad_()
            # (a clone: an inplace activation must not write into the leaf)
            (g_lin,) = torch.autograd.grad(module.act(module.drop(z.clone())), z, g)
        out = {}
        if "weight" in names:
            out["weight"] = self.per_entry(module, xhat.mul_(g_lin), batch_first)
        if "bias" in names:
            out["bias"] = self.per_entry(module, g_lin, batch_first)
        return out

    def formula(self, module: nn.Module, x: Tensor) -> Tensor:
        """``act(drop(batch_norm(x)))`` with the running statistics (eval mode)."""
        z = F.batch_norm(x, module.running_mean, module.running_var, module.weight, module.bias,
                         False, 0.0, module.eps)
        return module.act(module.drop(z))

    def probe_input(self, module: nn.Module) -> Optional[Tensor]:
        """``(2, C, 3, 2)``, or ``None`` without running statistics, ``act`` and ``drop``."""
        w = getattr(module, "weight", None)
        if (module.running_mean is None or not isinstance(getattr(module, "act", None), nn.Module)
                or not isinstance(getattr(module, "drop", None), nn.Module)):
            return None
        dtype = w.dtype if w is not None else module.running_mean.dtype
        return torch.randn(2, module.num_features, 3, 2, dtype=dtype, device=module.running_mean.device)
