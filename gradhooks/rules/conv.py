"""Rule for ``nn.Conv1d``, ``nn.Conv2d`` and ``nn.Conv3d`` with every option torch has.

Index conventions: ``n`` sample, ``g`` group, ``c`` input channel within a group, ``k`` kernel
offset (all spatial dims flattened), ``s`` output position (all spatial dims flattened), ``o``
output channel within a group.

Forward, with ``P`` the padded input (zeros / reflect / replicate / circular, asymmetric for
``padding='same'`` exactly as torch pads) and ``U`` its unfolded patches (im2col, with stride and
dilation)::

    y[n, g, o, s] = sum_{c,k} W[g, o, c, k] U[n, g, c, k, s] + b[g, o]

so the per-sample gradient is the canonical-form product (Goodfellow 2015, arXiv:1510.01799;
Rochette et al. 2019, arXiv:1912.06015, sec. 3; Grosse & Martens 2016, arXiv:1602.01407, sec. 3
for the unfolded form)::

    dL_n/dW[g, o, c, k] = sum_s g[n, g, o, s] U[n, g, c, k, s]      dL_n/db[g, o] = sum_s g[n, g, o, s]

The patches are reshaped by group *before* the contraction, so a grouped or depthwise convolution
costs ``1/groups`` of a dense one (no cross-group product that is thrown away).

Two exact ways to evaluate the weight gradient, chosen per call by :func:`choose_method`:

* ``"unfold"``: im2col patches in canonical form, then a batched matmul over ``(n, g)``;
* ``"conv"``: the same sum written as the weight gradient of one convolution whose groups are
  ``(sample, group)`` pairs: input ``(1, N*C_in, *spatial)``, grad_output ``(1, N*C_out, ...)``,
  ``groups = N*G``; torch's own convolution backward kernel (oneDNN on CPU, cuDNN on GPU) then
  returns the ``(N*C_out, C_in/G, *kernel)`` per-sample weights without any patch matrix;
* ``"correlation"``: the same sum as a *forward* convolution (a cross-correlation) of the padded
  input by grad_output as its kernel: ``dW[n, g, o, c, k] = sum_s g[n, g, o, s] P[n, g, c,
  stride * s + dilation * k]`` is the forward convolution of ``P`` (batch ``C_in/G``, channels
  ``N*G``) with the kernels ``g`` (``(N*G*C_out/G, 1, *spatial_out)``, ``groups = N*G``) at
  dilation = the layer's stride and stride = its dilation, cropped to ``kernel_size``
  (:func:`correlation_weight_grad`). For a depthwise convolution with a kernel wider than 3
  the input is a view and the forward kernel is 4-14x faster than either form above on the CPU.
"""
from __future__ import annotations

import itertools
import math
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..base.errors import BatchSizeError
from ..base.forms import weight_grad
from ..base.registry import LayerRule, register_rule


def padding_pairs(module: nn.Module) -> List[Tuple[int, int]]:
    """``(before, after)`` padding for each spatial dim of a ``nn.ConvNd``, as torch applies it.

    ``'valid'`` is no padding; ``'same'`` pads ``dilation * (kernel - 1)`` in total, the smaller
    half before (torch's ``_ConvNd.__init__``); an int or tuple pads both sides equally.
    """
    k, d = module.kernel_size, module.dilation
    if module.padding == "valid":
        return [(0, 0)] * len(k)
    if module.padding == "same":
        pairs = []
        for ki, di in zip(k, d):
            total = di * (ki - 1)
            pairs.append((total // 2, total - total // 2))
        return pairs
    return [(p, p) for p in module.padding]


def padded(module: nn.Module, x: Tensor) -> Tensor:
    """``x`` ``(N, C_in, *spatial)`` padded exactly as ``module`` pads it (:func:`padding_pairs`,
    its ``padding_mode``); ``x`` itself without padding."""
    pairs = padding_pairs(module)
    if not any(p for pair in pairs for p in pair):
        return x
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    return F.pad(x, [p for pair in reversed(pairs) for p in pair], mode=mode)  # (last dim first)


def unfold(module: nn.Module, x: Tensor) -> Tensor:
    """Unfolded input patches of a ``nn.ConvNd`` in canonical form.

    Args:
        module: a ``nn.Conv1d/2d/3d``.
        x: its input, ``(N, C_in, *spatial)``.

    Returns:
        ``(N, G, S, C_in/G * prod(kernel_size))`` with ``S`` the number of output positions; the
        last dim is ordered like ``weight[o].flatten()``, i.e. ``(c, k1, k2, ...)``.
    """
    dims = len(module.kernel_size)
    x = padded(module, x)
    for i, (k, d, s) in enumerate(zip(module.kernel_size, module.dilation, module.stride)):
        x = x.unfold(2 + i, d * (k - 1) + 1, s)  # appends the window dim at the end
    if any(d > 1 for d in module.dilation):
        x = x[(Ellipsis,) + tuple(slice(None, None, d) for d in module.dilation)]
    # x: (N, C, O_1..O_d, K_1..K_d)
    n, c = x.shape[:2]
    groups = module.groups
    out_sizes = x.shape[2 : 2 + dims]
    x = x.reshape(n, groups, c // groups, *x.shape[2:])
    perm = (0, 1, *range(3, 3 + dims), 2, *range(3 + dims, 3 + 2 * dims))
    s = 1
    for o in out_sizes:
        s *= o
    # (sizes spelled out, not -1: N = 0 is an empty batch, and -1 is then ambiguous)
    return x.permute(perm).reshape(n, groups, s, c // groups * math.prod(x.shape[3 + dims:]))


# Measured by benchmarks/conv_methods.py (2 CPU cores, torch 2.13, B=64, Conv2d(C, C, 3), medians):
# the grouped convolution ("conv") wins whenever the per-group weight W = C_in/G * C_out/G * K is
# small (C=16 dense, every depthwise conv: 2-40x faster), and otherwise once the output has enough
# positions S: C=64 (W=36864): unfold 1.4 vs conv 8.0 ms at S=16, 10.1 vs 10.7 at S=64, 10.8 vs 3.3
# at S=144, 75.6 vs 10.7 at S=576; C=128 (W=147456): 13.8 vs 37.1 at S=16, 50.6 vs 47.5 at S=144,
# 102 vs 54 at S=324. "conv" iff W <= 4096 or S >= W / 512 picks the faster one (or a tie within
# 10%) at every measured point. Pointwise convolutions (:func:`pointwise`; ResNet-50's 1x1
# bottleneck convolutions, B=16) take "unfold", a batched matmul of the input itself: 1.7-3.9x
# faster than "conv" at every measured shape (``benchmarks/results/conv_methods.md``), whose grouped
# kernel is slow with ``N`` groups of a 1x1 kernel.
CONV_METHOD_SMALL_WEIGHT = 4096
CONV_METHOD_WEIGHT_PER_POSITION = 512


def pointwise(module: nn.Module) -> bool:
    """Whether ``module`` is a pointwise (``1 x ... x 1`` kernel, unpadded) convolution: its
    patches are its input itself (:func:`unfold` returns a view for stride 1, a strided copy of
    the input's size otherwise), so the ``"unfold"`` method is one batched matmul."""
    return (all(k == 1 for k in module.kernel_size)
            and all(p == 0 for pair in padding_pairs(module) for p in pair))


def choose_method(module: nn.Module, positions: int) -> str:
    """``"conv"`` or ``"unfold"`` for a convolution whose output has ``positions`` positions
    per sample and channel (see the measurements above this function; a pointwise convolution,
    :func:`pointwise`, is decided by the caller)."""
    k = 1
    for ki in module.kernel_size:
        k *= ki
    per_group = module.in_channels * module.out_channels * k // module.groups ** 2
    if per_group <= CONV_METHOD_SMALL_WEIGHT or positions * CONV_METHOD_WEIGHT_PER_POSITION >= per_group:
        return "conv"
    return "unfold"


def depthwise(module: nn.Module) -> bool:
    """Whether ``module`` is a depthwise convolution: several groups of one input channel each
    (any channel multiplier); its :func:`correlation_weight_grad` reads the input as a view. A
    dense convolution of one input channel (an audio model's first layer) is not: not measured.

    Measured (``benchmarks/conv_methods.py --depthwise``, ``benchmarks/results/conv_methods.md``:
    ConvNeXt-T's 7x7 and EfficientNet-B0's 3x3 / 5x5 depthwise convolutions at 224 x 224, B = 16,
    2 CPU cores): with a kernel wider than 3 (:data:`CORRELATION_MIN_KERNEL`) ``"correlation"``
    is 4-14x faster than ``"conv"``; at 3x3, where oneDNN has its own depthwise weight-backward
    kernel, ``"conv"`` is 1.05-1.75x faster; ``"unfold"`` is the slowest everywhere. Dense
    convolutions (ResNet-50's 3x3, the stems, ConvNeXt's 2x2 downsampling) are 1.1-3.3x slower by
    the correlation than by the faster of the other two. Not measured on a GPU, where ``"auto"`` keeps :func:`choose_method`.
    """
    return module.groups > 1 and module.in_channels == module.groups


#: A :func:`depthwise` convolution on the CPU takes the ``"correlation"`` method when a kernel
#: dim exceeds this (measurements in :func:`depthwise`).
CORRELATION_MIN_KERNEL = 3


def pad_as_torch(module: nn.Module, x: Tensor) -> Tuple[Tensor, List[int]]:
    """``(x', padding)`` such that a convolution of ``x'`` with symmetric zero ``padding``
    equals ``module``'s convolution of ``x``: torch's own padding when it is symmetric zeros,
    else ``x`` padded as torch pads it (asymmetric ``'same'``, reflect/replicate/circular) and
    no padding."""
    pairs = padding_pairs(module)
    if module.padding_mode == "zeros" and all(a == b for a, b in pairs):
        return x, [a for a, _ in pairs]
    return padded(module, x), [0] * len(pairs)


def weight_backward(module: nn.Module, x: Tensor, g: Tensor, padding: List[int], *,
                    per_sample: bool, transposed: bool = False,
                    output_padding: Optional[List[int]] = None) -> Tensor:
    """The weight gradient of ``module``'s (transposed) convolution through torch's own kernel
    (``aten.convolution_backward``; oneDNN on CPU, cuDNN on GPU).

    Args:
        module: a ``nn.ConvNd`` or ``nn.ConvTransposeNd``.
        x: its input ``(N, C_in, *spatial)`` (already padded if ``padding`` says so).
        g: grad_output ``(N, C_out, *spatial_out)``.
        padding: the symmetric zero padding to apply.
        per_sample: ``True``: one convolution whose groups are the ``(sample, group)`` pairs
            (input ``(1, N*C_in, ...)``, ``groups = N*G``), giving ``(N, *weight.shape)``;
            ``False``: the batch gradient ``weight.shape`` (summed over samples).
        transposed, output_padding: for ``nn.ConvTransposeNd``.
    """
    n = x.shape[0]
    dims = len(padding)
    if per_sample:
        x, g = x.reshape(1, -1, *x.shape[2:]), g.reshape(1, -1, *g.shape[2:])
        shape, groups = (n * module.weight.shape[0], *module.weight.shape[1:]), n * module.groups
    else:
        shape, groups = module.weight.shape, module.groups
    _, gw, _ = torch.ops.aten.convolution_backward(
        g, x, g.new_zeros(()).expand(shape),  # only its shape is read
        None, list(module.stride), padding, list(module.dilation), transposed,
        output_padding or [0] * dims, groups, [False, True, False],
    )
    return gw.view(n, *module.weight.shape) if per_sample else gw


def conv_weight_grad(module: nn.Module, x: Tensor, g: Tensor) -> Tensor:
    """Per-sample weight gradient as the weight gradient of a ``(sample, group)``-grouped conv.

    Args:
        module: a ``nn.ConvNd``.
        x: its input ``(N, C_in, *spatial)``.
        g: grad_output ``(N, C_out, *spatial_out)``.

    Returns:
        ``(N, C_out, C_in/G, *kernel_size)``.
    """
    x, padding = pad_as_torch(module, x)
    return weight_backward(module, x, g, padding, per_sample=True)


def correlation_weight_grad(module: nn.Module, x: Tensor, g: Tensor) -> Tensor:
    """Per-sample weight gradient as one forward convolution of the input by grad_output (the
    ``"correlation"`` method of the module docstring; the kernel gradient of a strided
    convolution as a correlation of the input with grad_output: Goodfellow, Bengio & Courville,
    *Deep Learning*, 2016, sec. 9.5, eq. 9.11).

    Args:
        module: a ``nn.ConvNd``.
        x: its input ``(N, C_in, *spatial)``.
        g: grad_output ``(N, C_out, *spatial_out)``, ``x``'s dtype.

    Returns:
        ``(N, C_out, C_in/G, *kernel_size)``.
    """
    x, padding = pad_as_torch(module, x)
    n, groups, kernel = x.shape[0], module.groups, tuple(module.kernel_size)
    c_in, c_out = module.in_channels // groups, module.out_channels // groups
    if n == 0:
        return g.new_zeros(0, *module.weight.shape)
    spatial = x.shape[2:]
    # input: batch C_in/G, channels (sample, group); a view when C_in/G is 1
    inp = x.reshape(n, groups, c_in, *spatial).movedim(2, 0).reshape(c_in, n * groups, *spatial)
    kernels = g.reshape(n * groups * c_out, 1, *g.shape[2:])
    conv = (F.conv1d, F.conv2d, F.conv3d)[len(kernel) - 1]
    out = conv(inp, kernels, None, module.dilation, padding, module.stride, n * groups)
    out = out[(slice(None), slice(None)) + tuple(slice(0, k) for k in kernel)]
    # (C_in/G, N*G*C_out/G, *kernel) -> (N, G, C_out/G, C_in/G, *kernel)
    out = out.reshape(c_in, n, groups, c_out, *kernel).movedim(0, 3)
    return out.reshape(n, module.out_channels, c_in, *kernel)


def auto_method(module: nn.Module, x: Tensor, positions: int) -> str:
    """The method ``"auto"`` runs for ``module`` on input ``x``: ``"unfold"`` for a
    :func:`pointwise` convolution, ``"correlation"`` for a :func:`depthwise` one on the CPU
    with a kernel dim above :data:`CORRELATION_MIN_KERNEL`, else :func:`choose_method` of the
    ``positions`` output positions per sample and channel."""
    if pointwise(module):
        return "unfold"
    if (depthwise(module) and x.device.type == "cpu"
            and max(module.kernel_size) > CORRELATION_MIN_KERNEL):
        return "correlation"
    return choose_method(module, positions)


def _taps(module: nn.Module, spatial: Tuple[int, ...]) -> List[Tuple[int, Dict[int, List[int]]]]:
    """Per spatial dim of the padded input of sizes ``spatial``: the output size ``P`` and, per
    stride phase ``r``, the shifts ``q`` of the kernel taps in it (tap ``t`` reads the padded
    input at ``stride * p + dilation * t = stride * (p + q) + r``)."""
    out = []
    for length, k, d, s in zip(spatial, module.kernel_size, module.dilation, module.stride):
        phases: Dict[int, List[int]] = {}
        for t in range(k):
            phases.setdefault(d * t % s, []).append(d * t // s)
        out.append(((length - d * (k - 1) - 1) // s + 1, phases))
    return out


def _padded_sizes(module: nn.Module, spatial) -> Tuple[int, ...]:
    return tuple(n + a + b for n, (a, b) in zip(spatial, padding_pairs(module)))


def patch_gram_cost(module: nn.Module, shape) -> Optional[int]:
    """Multiply-adds per ``(sample, group)`` of :func:`patch_gram` for an input of ``shape``
    ``(N, C_in, *spatial)`` (the phases' Gram matrices, plus one add per tap and pair of
    positions), or ``None`` where that is not below the ``S^2 C_in/G prod(kernel_size)`` of the
    unfolded patches' Gram matrix (a pointwise convolution: the two are one product)."""
    taps = _taps(module, _padded_sizes(module, shape[2:]))
    c = module.in_channels // module.groups
    s = math.prod(p for p, _ in taps)
    k = math.prod(module.kernel_size)
    cost = s * s * k  # (the shifted adds)
    for combo in itertools.product(*(phases.items() for _, phases in taps)):
        m = math.prod(p + max(shifts) for (p, _), (_, shifts) in zip(taps, combo))
        cost += m * m * c
    return cost if cost < s * s * c * k else None


def patch_gram(module: nn.Module, x: Tensor) -> Tensor:
    """Gram matrix of each sample's unfolded patches, ``U U^T`` with ``U = unfold(module, x)``,
    from Gram matrices of the padded input's pixels, never forming ``U``.

    Patch ``p`` holds the padded input ``P`` at ``stride * p + dilation * t`` for the kernel taps
    ``t`` (per spatial dim), so ``<U[p], U[p']> = sum_t <P[stride p + d t], P[stride p' + d t]>``.
    Writing ``d t = stride * q + r``, tap ``t`` reads the stride phase ``r`` of ``P``
    (``P_r[m] = P[stride * m + r]``) at ``p + q``: the sum is over taps of the phase's pixel Gram
    matrix ``P_r^T P_r`` shifted by ``q`` on both axes. Cost per sample and group: the phases'
    ``M^2 C_in/G`` (``M`` their pixels, about ``S`` each) and ``S^2 prod(kernel_size)`` adds,
    against ``S^2 C_in/G prod(kernel_size)`` for the patches' product (a 3 x 3 convolution at 14 x
    14: 5x fewer; :func:`patch_gram_cost`). It serves the Gram form of the per-sample norm (Li et
    al. 2022, arXiv:2110.05679, sec. 4), whose ``a a^T`` it is; the expansion over taps and
    stride phases is derived here, for any stride, dilation, padding mode and groups.

    Args:
        module: a ``nn.Conv1d/2d/3d``.
        x: its input ``(N, C_in, *spatial)``, float32 or float64.

    Returns:
        ``(N, G, S, S)``, ``S`` the output positions in :func:`unfold`'s order, ``x``'s dtype.
    """
    x = padded(module, x)
    n, groups = x.shape[0], module.groups
    c = x.shape[1] // groups
    taps = _taps(module, tuple(x.shape[2:]))
    out_sizes = [p for p, _ in taps]
    x = x.reshape(n, groups, c, *x.shape[2:])
    total: Optional[Tensor] = None
    for combo in itertools.product(*(phases.items() for _, phases in taps)):
        sizes = [p + max(shifts) for p, (_, shifts) in zip(out_sizes, combo)]
        pixels = x[(Ellipsis,) + tuple(slice(r, r + s * (m - 1) + 1, s) for (r, _), s, m
                                       in zip(combo, module.stride, sizes))]
        pixels = pixels.reshape(n, groups, c, math.prod(sizes))
        gram = (pixels.transpose(-1, -2) @ pixels).view(n, groups, *sizes, *sizes)
        for shift in itertools.product(*(shifts for _, shifts in combo)):
            part = gram[(slice(None), slice(None))
                        + tuple(slice(q, q + p) for q, p in zip(shift, out_sizes)) * 2]
            if total is None:
                total = part.contiguous()
            else:
                total += part
    s = math.prod(out_sizes)
    assert total is not None  # (every kernel has a tap)
    return total.view(n, groups, s, s)


#: Output positions from which a :func:`pointwise` convolution's weighted sum (book-keeping's
#: clipped sum) is formed by per-sample matmuls of the input itself, summed with the weights,
#: rather than by torch's weight-backward kernel. ``benchmarks/conv_methods.py --pointwise``
#: (ResNet-50's 1x1 convolutions, B = 16, 2 CPU cores): 1.8-4x faster at 196 to 3136 positions,
#: 1.8x slower at 49 (a per-sample ``(O, I)`` result costs as much to write as its ``S`` = 49
#: multiply-adds per value).
POINTWISE_MATMUL_POSITIONS = 128

#: Bytes of per-sample ``(n, O, I)`` gradients :func:`_pointwise_weighted` forms at once.
POINTWISE_CHUNK_BYTES = 16 * 2**20


def _pointwise_weighted(module: nn.Module, x: Tensor, g: Tensor, c: Tensor) -> Tensor:
    """``sum_n c_n dW_n`` of a :func:`pointwise` convolution, ``weight.shape``: per chunk of
    samples the per-sample gradients ``g_n x_n^T`` (one batched matmul of the records' own
    layout, :func:`unfold` a view for stride 1) contracted with ``c``; chunks of at most
    :data:`POINTWISE_CHUNK_BYTES` bytes.

    Args:
        module: a pointwise ``nn.ConvNd``.
        x: its input ``(N, C_in, *spatial)``; g: grad_output ``(N, C_out, *spatial_out)``;
            c: ``(N,)`` weights; all in one dtype.
    """
    n, groups = g.shape[0], module.groups
    a_c = unfold(module, x)  # (N, G, S, I)
    g_c = g.reshape(n, groups, module.out_channels // groups, a_c.shape[2])  # (N, G, O, S)
    per = a_c.shape[1] * a_c.shape[3] * g_c.shape[2] * x.element_size()
    step = max(1, POINTWISE_CHUNK_BYTES // max(per, 1))
    total = None
    for i in range(0, n, step):
        part = torch.tensordot(c[i:i + step], torch.matmul(g_c[i:i + step], a_c[i:i + step]), 1)
        total = part if total is None else total.add_(part)
    if total is None:  # (an empty batch)
        return g.new_zeros(module.weight.shape)
    return total.view(module.weight.shape)


@register_rule(nn.Conv1d, nn.Conv2d, nn.Conv3d)
class ConvRule(LayerRule):
    """``nn.Conv1d/2d/3d``: ``a`` is ``(B, C_in, *spatial)``, ``g`` is ``(B, C_out, *spatial_out)``.

    Returns ``weight``: ``(B, C_out, C_in/groups, *kernel_size)``, ``bias``: ``(B, C_out)``.
    The batch dim is always dim 0 (torch's convolution layout), whatever ``batch_first``.
    """

    differentiable = True

    weight_linear_in_input = True
    has_linear_form = True

    #: ``"auto"`` (per call, :func:`auto_method`), ``"conv"``, ``"unfold"`` or
    #: ``"correlation"``.
    method = "auto"

    def batch_size(self, module: nn.Module, x: Tensor, batch_first: bool) -> int:
        dims = len(module.kernel_size)
        if x.dim() != dims + 2:
            raise BatchSizeError(
                f"got an input of shape {tuple(x.shape)}; per-sample gradients need a batched "
                f"input (B, C_in, *spatial) with {dims + 2} dims (e.g. x.unsqueeze(0))"
            )
        return x.shape[0]

    def linear_form(self, module: nn.Module, a: Optional[Tensor], g: Tensor, batch_first: bool
                    ) -> Tuple[Optional[Tensor], Tensor]:
        """Canonical form: ``a`` ``(N, G, S, C_in/G * K)`` unfolded patches (:func:`unfold`),
        ``g`` ``(N, G, S, C_out/G)`` (a view), ``S`` the output positions."""
        n, groups = g.shape[0], module.groups
        g = g.reshape(n, groups, module.out_channels // groups, math.prod(g.shape[2:])
                      ).transpose(-1, -2)
        return (None if a is None else unfold(module, a)), g

    def input_gram_cost(self, module: nn.Module, a: Tensor) -> Optional[int]:
        """:func:`patch_gram_cost` of the input ``a``."""
        return patch_gram_cost(module, a.shape)

    def input_gram(self, module: nn.Module, a: Tensor, batch_first: bool) -> Optional[Tensor]:
        """:func:`patch_gram` where :func:`patch_gram_cost` finds it cheaper than the
        patches' product, else ``None``."""
        return None if patch_gram_cost(module, a.shape) is None else patch_gram(module, a)

    def weighted_sum(self, module: nn.Module, a: Tensor, g: Tensor, c: Tensor, batch_first: bool,
                     names: Iterable[str], out: Optional[Dict[str, Tensor]] = None
                     ) -> Dict[str, Tensor]:
        """As :meth:`LayerRule.weighted_sum`; the weight by torch's convolution weight-backward
        kernel on the weighted input or grad_output (no unfolded patches), or for a
        :func:`pointwise` convolution of at least :data:`POINTWISE_MATMUL_POSITIONS` output
        positions by per-sample matmuls summed with the weights (:func:`_pointwise_weighted`),
        or for one whose ``"auto"`` method is ``"correlation"`` (a :func:`depthwise` one, whose
        per-sample weights are small) by :func:`correlation_weight_grad` contracted with the
        weights."""
        names = tuple(names)
        result = {}
        positions = math.prod(g.shape[2:])
        if "weight" in names and pointwise(module) and positions >= POINTWISE_MATMUL_POSITIONS:
            result["weight"] = _pointwise_weighted(module, a, g, c)
        elif "weight" in names and auto_method(module, a, positions) == "correlation":
            result["weight"] = torch.tensordot(c, correlation_weight_grad(module, a, g), 1)
        elif "weight" in names:
            shape = [-1] + [1] * (g.dim() - 1)
            if a.numel() < g.numel():
                x, gw = a * c.view(shape), g
            else:
                x, gw = a, g * c.view(shape)
            x, padding = pad_as_torch(module, x)
            result["weight"] = weight_backward(module, x, gw, padding, per_sample=False)
        if "bias" in names:
            per = g.flatten(2).sum(-1)  # (N, C_out)
            result["bias"] = torch.mv(per.t(), c, out=(out or {}).get("bias"))
        return result

    def per_sample_grads(
        self, module: nn.Module, a: Tensor, g: Tensor, batch_first: bool, names: Iterable[str]
    ) -> Dict[str, Tensor]:
        n = g.shape[0]
        out = {}
        if "weight" in names:
            method = self.method
            if method == "auto":
                method = auto_method(module, a, math.prod(g.shape[2:]))
            if method == "conv":
                out["weight"] = conv_weight_grad(module, a, g)
            elif method == "correlation":
                out["weight"] = correlation_weight_grad(module, a, g)
            else:
                a_c, g_c = self.linear_form(module, a, g, batch_first)
                out["weight"] = weight_grad(a_c, g_c, (n, *module.weight.shape))
        if "bias" in names:
            out["bias"] = g.flatten(2).sum(-1)
        return out
