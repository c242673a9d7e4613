"""Rule for ``nn.ConvTranspose1d``, ``nn.ConvTranspose2d`` and ``nn.ConvTranspose3d``.

Index conventions: ``n`` sample, ``g`` group, ``i`` input channel within a group (``C_in/G``),
``o`` output channel within a group (``C_out/G``), ``k`` kernel offset, ``t`` input position,
``p`` output position (spatial dims flattened; ``s`` stride, ``d`` dilation, ``q`` padding).

Forward (torch docs of ``nn.ConvTranspose2d``; Dumoulin & Visin 2016, arXiv:1603.07285,
sec. 4), weight ``W`` of shape ``(C_in, C_out/G, *kernel)``::

    y[n, g, o, p] = sum_{i, k, t : p = s t - q + d k} x[n, g, i, t] W[g, i, o, k] + b[g, o]

i.e. the adjoint (input gradient) of the convolution ``conv(., W)`` with the same stride, padding
and dilation, which maps ``C_out`` channels to ``C_in``: ``<g, conv_transpose(x, W)> =
<conv(g, W), x>`` for every ``g`` of the output's shape. Differentiating w.r.t. ``W`` swaps the
roles of input and grad_output: the weight gradient of a transposed convolution is the weight
gradient of that convolution with input ``g`` (the grad_output) and grad_output ``x`` (the input).
With ``U`` the unfolded patches of ``g`` (stride ``s``, padding ``q``, dilation ``d``; one patch per
*input* position ``t``), per sample (Goodfellow 2015, arXiv:1510.01799; Rochette et al. 2019,
arXiv:1912.06015, sec. 3)::

    dL_n/dW[g, i, o, k] = sum_t x[n, g, i, t] U[n, g, o, k, t]        dL_n/db[g, o] = sum_p g[n, g, o, p]

-- the canonical form of :mod:`gradhooks.readers.per_sample` with ``a = U`` ``(N, G, T, C_out/G * K)`` and
``g = x`` ``(N, G, T, C_in/G)``. ``output_padding`` (and ``output_size`` given to the forward)
only adds output rows; it is read back from the output's shape, so both work.

Two exact evaluations, as for :mod:`gradhooks.rules.conv`, chosen per call by
:func:`~gradhooks.rules.conv.choose_method` given the *output* positions (see the measurements above
:class:`ConvTransposeRule`):

* ``"conv"``: torch's own transposed-convolution weight backward
  (``aten.convolution_backward`` with ``transposed=True``) on one "sample" whose groups are the
  ``(sample, group)`` pairs: input ``(1, N*C_in, ...)``, grad_output ``(1, N*C_out, ...)``,
  ``groups = N*G``; it returns the ``(N*C_in, C_out/G, *kernel)`` per-sample weights;
* ``"unfold"``: the patches ``U`` above, then a batched matmul over ``(n, g)``.
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..base.forms import weight_grad
from ..base.registry import LayerRule, register_rule
from .conv import ConvRule, choose_method, unfold, weight_backward

__all__ = ["ConvTransposeRule", "output_padding", "transposed_patches"]


def output_padding(module: nn.Module, x: Tensor, y_shape) -> List[int]:
    """The output padding a call of a ``nn.ConvTransposeNd`` used, read from the shapes.

    ``Y = (X - 1) s - 2 q + d (k - 1) + 1 + output_padding`` per spatial dim (torch docs of
    ``nn.ConvTranspose2d``), so this is ``module.output_padding`` or what ``output_size`` asked for.

    Args:
        module: the layer.
        x: its input ``(N, C_in, *X)``.
        y_shape: its output's shape ``(N, C_out, *Y)``.
    """
    return [y - ((xs - 1) * s - 2 * q + d * (k - 1) + 1)
            for y, xs, s, q, d, k in zip(y_shape[2:], x.shape[2:], module.stride, module.padding,
                                         module.dilation, module.kernel_size)]


def conv_transpose_weight_grad(module: nn.Module, x: Tensor, g: Tensor) -> Tensor:
    """Per-sample weight gradient through torch's transposed-convolution weight backward.

    Args:
        module: a ``nn.ConvTransposeNd``.
        x: its input ``(N, C_in, *X)``.
        g: grad_output ``(N, C_out, *Y)``.

    Returns:
        ``(N, C_in, C_out/G, *kernel_size)``.
    """
    return weight_backward(module, x, g, list(module.padding), per_sample=True, transposed=True,
                           output_padding=output_padding(module, x, g.shape))


def unfold_weight_grad(module: nn.Module, x: Tensor, g: Tensor) -> Tensor:
    """Per-sample weight gradient from the unfolded grad_output (canonical form).

    Args, Returns: as :func:`conv_transpose_weight_grad`.
    """
    n, groups = x.shape[0], module.groups
    patches = unfold(module, g)  # (N, G, T', C_out/G * K), T' >= T
    # an output_padding >= stride leaves whole patch rows past the input's end: pad x with zeros
    extra = [op // s for op, s in zip(output_padding(module, x, g.shape), module.stride)]
    if any(extra):
        x = F.pad(x, [p for e in reversed(extra) for p in (0, e)])
    x = x.reshape(n, groups, module.in_channels // groups, math.prod(x.shape[2:])
                  ).transpose(-1, -2)
    return weight_grad(patches, x).reshape(n, *module.weight.shape)


_CONV_TRANSPOSE = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def transposed_patches(module: nn.Module, x: Tensor, y_shape) -> Tensor:
    """The inputs each *output* position of a transposed convolution sees, in canonical form.

    ``a[n, g, p, (i, k)] = x[n, g, i, t]`` where ``p = s t - q + d k`` (zero where no input
    position ``t`` maps there), so that ``y[n, g, :, p] = W[g] a[n, g, p] + b[g]`` with ``W[g]``
    the ``(C_out/G, C_in/G * K)`` matrix ``weight.view(G, C_in/G, C_out/G, K)`` transposed in
    its two middle dims (:attr:`~gradhooks.base.registry.LayerRule.kfac_transposed`). Computed as one
    depthwise transposed convolution of ``x`` whose weight is the identity over the ``K`` kernel
    offsets (groups ``C_in``, ``K`` output channels per input channel): ``O(N C_in K P)``.

    Args:
        module: a ``nn.ConvTransposeNd``.
        x: its input ``(N, C_in, *X)``.
        y_shape: its output's shape ``(N, C_out, *Y)`` (for ``output_padding``).

    Returns:
        ``(N, G, P, C_in/G * K)``, ``P = prod(Y)``, the last dim ordered ``(i, k)`` like
        ``weight[i, o].flatten()``.
    """
    c_in, groups, kernel = module.in_channels, module.groups, tuple(module.kernel_size)
    k = 1
    for ki in kernel:
        k *= ki
    eye = torch.eye(k, dtype=x.dtype, device=x.device).reshape(1, k, *kernel).repeat(c_in, *[1] * (len(kernel) + 1))
    out = _CONV_TRANSPOSE[len(kernel)](
        x, eye, None, module.stride, module.padding, output_padding(module, x, y_shape), c_in,
        module.dilation)  # (N, C_in * K, *Y), channel i * K + k
    n = x.shape[0]
    return out.reshape(n, groups, c_in // groups * k, math.prod(out.shape[2:])).transpose(-1, -2)


# Why choose_method is given the output positions. Measured (CPU time, 1 thread, 2-core AMD EPYC,
# torch 2.13, B=64, ConvTranspose2d(C, C, k, stride 2, padding 1), medians of 9; ms as unfold/conv
# per input H x W, k3 then k4): dense C=16: conv 1.1-8x faster at every size; C=64: 4x4 2.8/5.3,
# 4.3/22.7; 8x8 9.7/3.8, 15.0/25.0; 14x14 29/7.8, 64/19; C=128: 4x4 23/60, 41/107; 8x8 42/65,
# 85/113; 14x14 118/77, 194/140; depthwise (groups=C): conv 1.7-17x faster everywhere. Judged on
# the output positions Y (4x the input positions here) the conv-rule thresholds pick the faster
# method in 35 of these 36 shapes (on the input positions: 33); the miss (C=64, k4, 8x8) costs 1.7x.


@register_rule(nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
class ConvTransposeRule(LayerRule):
    """``nn.ConvTranspose1d/2d/3d``: ``a`` is ``(B, C_in, *X)``, ``g`` is ``(B, C_out, *Y)``.

    Returns ``weight``: ``(B, C_in, C_out/groups, *kernel_size)``, ``bias``: ``(B, C_out)``. The
    batch dim is always dim 0 (torch's convolution layout), whatever ``batch_first``.

    Raises (at the forward):
        BatchSizeError: an unbatched input ``(C_in, *X)``.
    """

    weight_linear_in_input = True

    #: ``"auto"`` (per call, :func:`~gradhooks.rules.conv.choose_method` on the output positions),
    #: ``"conv"`` or ``"unfold"``.
    method = "auto"

    batch_size = ConvRule.batch_size  # the same layout: (B, C_in, *spatial)

    kfac_transposed = True

    def kfac_form(self, module: nn.Module, a: Optional[Tensor], g: Tensor, batch_first: bool
                  ) -> Tuple[Optional[Tensor], Tensor]:
        """Kronecker-factored form (Grosse & Martens 2016, sec. 3, with the roles of the
        convolution's positions taken by the *output* positions ``P``): ``a``
        :func:`transposed_patches` ``(N, G, P, C_in/G * K)``, ``g`` ``(N, G, P, C_out/G)``, so
        that the bias sees an input of ones at every output position. (The per-sample rule's
        canonical form, with ``x`` and the unfolded ``g`` swapped, is not used: its "output"
        side would be ``C_in`` and the bias would not fit it.)"""
        n, groups = g.shape[0], module.groups
        g_c = g.reshape(n, groups, module.out_channels // groups, math.prod(g.shape[2:])
                        ).transpose(-1, -2)
        return (None if a is None else transposed_patches(module, a, g.shape)), g_c

    def per_sample_grads(
        self, module: nn.Module, a: Tensor, g: Tensor, batch_first: bool, names: Iterable[str]
    ) -> Dict[str, Tensor]:
        out = {}
        if "weight" in names:
            method = self.method
            if method == "auto":
                method = choose_method(module, math.prod(g.shape[2:]))
            fn = conv_transpose_weight_grad if method == "conv" else unfold_weight_grad
            out["weight"] = fn(module, a, g)
        if "bias" in names:
            out["bias"] = g.flatten(2).sum(-1)
        return out
