"""The KFAC reader: Kronecker factors of every layer with a linear form (Linear, Conv).

Index conventions: ``n`` sample (``N`` of them, ``B`` for one process's batch), ``g`` group
(``G = 1`` except for grouped convolutions), ``r`` weight-sharing position (the positions ``s``
of every recorded call of the module: tokens of a Linear on ``(B, T, in)``, output pixels of a
convolution), ``i`` input feature (for a convolution: ``(c, k)``, an input channel of the group
and a kernel offset, ordered like ``weight[o].flatten()``), ``o`` output feature, ``p`` backward
pass.

Forward (the canonical form of :mod:`gradhooks.forms`)::

    y[n, g, r] = W[g] a[n, g, r] + b[g]          ã = [a; 1] when the bias is covered

Loss: ``L = w sum_n l_n`` with ``w = 1/N`` for ``loss_reduction="mean"`` and ``w = 1`` for
``"sum"``; ``e[p, n, g, r] = d l_n / d y[n, g, r]`` is the gradient of sample ``n``'s *own* loss
that backward pass ``p`` sent into the layer output (the hooks record ``w e``).

KFAC (Martens & Grosse 2015, arXiv:1503.05671, sec. 3; convolutions: Grosse & Martens 2016,
arXiv:1602.01407, sec. 3 "KFC"; weight sharing: Eschenhagen et al. 2023, arXiv:2311.00636,
sec. 3) approximates the layer's block of the Fisher / GGN of ``L`` by ``A ⊗ G``.

KFAC-expand (the positions are treated like extra samples)::

    A[g] = 1/(N R) sum_{n,r} ã[n,g,r] ã[n,g,r]^T
    G[g] = w sum_p sum_{n,r} e[p,n,g,r] e[p,n,g,r]^T

KFAC-reduce (positions are aggregated first)::

    ā[n,g] = 1/R sum_r ã[n,g,r]         A[g] = 1/N sum_n ā[n,g] ā[n,g]^T
    G[g] = w sum_p sum_n (sum_r e[p,n,g,r]) (sum_r e[p,n,g,r])^T

So ``A`` is a mean over samples (and positions for expand), ``G`` is summed over positions and
carries the reduction's scale ``w``: this is ``curvlinops.KFACLinearOperator``'s placement
(its ``_hook_accumulate_input_covariance`` / ``_accumulate_gradient_covariance``), so results
can be compared with it. With ``backward_passes="mean"`` (Monte-Carlo Fisher) ``G`` is divided
by the number of backward passes. With ``N = 1`` and ``R = 1`` (no weight sharing) ``A ⊗ G`` is
exactly the outer product of the sample's gradient (its empirical Fisher).

A module called several times in one forward: the positions of all its calls form one set of
weight-sharing positions (``R = sum over calls of S``), i.e. the factors are those of one call on
the concatenation of the calls' inputs (curvlinops instead adds per-call factors, which makes its
``A`` larger by the number of calls).

Grouped convolutions: one factor pair per group, stacked on a leading dim of size ``groups``
(exact block-diagonal structure of the weight; curvlinops instead averages the patches over
groups and keeps one pair).

Vectorisation: ``[W[g] b[g]]`` as a ``(d_out, d_in + 1)`` matrix, flattened row-major (torch's
``.flatten()``), has the block ``torch.kron(G[g], A[g])``; with column stacking (the papers'
``vec``) it is ``A[g] ⊗ G[g]``.
"""
from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .capture import Layer, Recorder
from .errors import GradHooksError
from .utils import compute_dtype, no_autocast, own_loss_scale

__all__ = ["KFACFactors", "kfac_factors", "KFAC_APPROX", "check_choice"]

#: Values of ``kfac_approx``.
KFAC_APPROX = ("expand", "reduce")
_PASSES = ("sum", "mean")


@dataclasses.dataclass(repr=False)
class KFACFactors:
    """The Kronecker factors of one ``nn.Linear`` / ``nn.ConvNd`` (conventions: module docstring).

    Attributes:
        A: input-side factor, ``(d_in[+1], d_in[+1])``; ``d_in = in_features`` for a Linear and
            ``C_in/groups * prod(kernel_size)`` for a convolution (ordered like
            ``weight[o].flatten()``); the trailing row/column (``+1``) belongs to the bias (an
            input of ones) when :attr:`bias` is set. ``(groups, ., .)`` when ``groups > 1``.
            When :attr:`diagonal_A` is set, only the diagonal: ``(d_in[+1],)`` or
            ``(groups, d_in[+1])``.
        G: output-side factor, ``(d_out, d_out)`` with ``d_out = out_features`` or
            ``C_out/groups``; ``(groups, ., .)`` when ``groups > 1``; the diagonal only
            (``(d_out,)`` / ``(groups, d_out)``) when :attr:`diagonal_G` is set.
        module: the module's name in ``model.named_modules()`` (``""`` for the model itself).
        weight: the weight's name in ``model.named_parameters()``, or ``None`` if it is not
            covered (frozen).
        bias: the bias's name, or ``None`` (no bias, or frozen): then ``A`` has no ones row.
        weight_shape: ``weight.shape`` (``None`` when :attr:`weight` is ``None``).
        groups: number of convolution groups (1 for a Linear).
        kfac_approx: ``"expand"`` or ``"reduce"``.
        diagonal_A / diagonal_G: the factor is stored as its diagonal (``max_dense``).
        weight_transposed: the weight is stored as ``W^T``, ``(d_in, d_out)`` (transformers'
            ``Conv1D``, :attr:`~gradhooks.registry.LayerRule.weight_transposed`):
            :meth:`grad_matrix` transposes it into the ``(d_out, d_in)`` block of ``[W b]`` and
            :meth:`split` back, so the factors act on ``[W b]`` as for an ``nn.Linear``.

    The block of the Fisher / GGN for ``[W[g] b[g]]`` flattened row-major is
    ``torch.kron(G[g], A[g])`` (:meth:`dense` gives it in the parameters' own order);
    :meth:`grad_matrix` / :meth:`split` convert gradients to / from that matrix form, e.g. for
    the KFAC step ``G^-1 [dW db] A^-1`` (Martens & Grosse 2015, sec. 4).
    """

    A: Tensor
    G: Tensor
    module: str
    weight: Optional[str]
    bias: Optional[str]
    weight_shape: Optional[Tuple[int, ...]]
    groups: int = 1
    kfac_approx: str = "expand"
    diagonal_A: bool = False
    diagonal_G: bool = False
    weight_transposed: bool = False

    @property
    def params(self) -> Tuple[str, ...]:
        """Names of the parameters covered, weight first."""
        return tuple(n for n in (self.weight, self.bias) if n is not None)

    def __repr__(self) -> str:
        diag_a, diag_g = (" diag" if d else "" for d in (self.diagonal_A, self.diagonal_G))
        return (f"KFACFactors(module={self.module!r}, params={self.params}, "
                f"A={tuple(self.A.shape)}{diag_a}, G={tuple(self.G.shape)}{diag_g}, "
                f"groups={self.groups}, kfac_approx={self.kfac_approx!r}, dtype={self.A.dtype})")

    def grad_matrix(self, grads: Mapping[str, Tensor]) -> Tensor:
        """Gradients of the covered parameters as the matrix ``[W b]`` the factors act on.

        Args:
            grads: ``{name: tensor of the parameter's shape}`` holding at least :attr:`params`
                (e.g. ``{n: p.grad for n, p in model.named_parameters()}``).

        Returns:
            ``(d_out, d_in[+1])``, or ``(groups, d_out, d_in[+1])`` when ``groups > 1``; the
            bias is the last column.

        Raises:
            KeyError: if a covered parameter is missing from ``grads``.
        """
        parts = []
        if self.weight is not None:
            w = grads[self.weight]
            if self.weight_transposed:  # (d_in, d_out) -> (d_out, d_in); groups is 1
                w = w.t()
            parts.append(w.reshape(self.groups, w.shape[0] // self.groups, -1))
        if self.bias is not None:
            parts.append(grads[self.bias].reshape(self.groups, -1, 1))
        mat = torch.cat(parts, -1) if len(parts) > 1 else parts[0]
        return mat if self.groups > 1 else mat[0]

    def split(self, mat: Tensor) -> Dict[str, Tensor]:
        """Inverse of :meth:`grad_matrix`: ``{name: tensor of the parameter's shape}``."""
        mat = mat.reshape(self.groups, -1, mat.shape[-1])
        out = {}
        if self.weight is not None:
            cols = mat.shape[-1] - (self.bias is not None)
            w = mat[..., :cols]
            out[self.weight] = (w[0].t().contiguous() if self.weight_transposed
                                else w.reshape(self.weight_shape))
        if self.bias is not None:
            out[self.bias] = mat[..., -1].reshape(-1)
        return out

    def dense(self) -> Tensor:
        """The KFAC block as a dense ``(P, P)`` matrix, ``P`` the number of covered entries,
        in the order of ``torch.cat([weight.flatten(), bias])`` (block-diagonal over groups)."""
        a = torch.diag_embed(self.A) if self.diagonal_A else self.A
        g = torch.diag_embed(self.G) if self.diagonal_G else self.G
        if self.groups == 1:
            a, g = a[None], g[None]
        blocks = torch.block_diag(*[torch.kron(gg, aa) for gg, aa in zip(g, a)])
        sizes = {}
        if self.weight is not None:
            sizes[self.weight] = self.weight_shape
        if self.bias is not None:
            sizes[self.bias] = (g.shape[0] * g.shape[-1],)
        index, start = {}, 0
        for name, shape in sizes.items():
            count = math.prod(shape)
            index[name] = torch.arange(start, start + count, device=a.device).reshape(shape)
            start += count
        perm = self.grad_matrix(index).reshape(-1)  # position in the matrix form -> param order
        out = blocks.new_zeros(start, start)
        out[perm[:, None], perm[None, :]] = blocks
        return out


def check_choice(name: str, value, choices: Sequence[str]) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def _moment(x: Tensor, ones: bool, diagonal: bool) -> Tensor:
    # x: (G, M, I) -> sum over the M rows of x~ x~^T, x~ = [x, 1] if ones: (G, I', I'), or its
    # diagonal (G, I'). The ones row/column are filled from sums instead of concatenating.
    groups, m, i = x.shape
    if diagonal:
        d = (x * x).sum(1)
        return torch.cat([d, d.new_full((groups, 1), m)], 1) if ones else d
    xx = x.transpose(1, 2) @ x
    if not ones:
        return xx
    s = x.sum(1)
    out = x.new_empty(groups, i + 1, i + 1)
    out[:, :i, :i] = xx
    out[:, :i, i] = s
    out[:, i, :i] = s
    out[:, i, i] = m
    return out


def _canonical(layer: Layer, a: Tensor, grads: List[Tensor], batch_first: bool):
    # a (N, G, S, I) once, and one g (N, G, S, O) per backward pass (the rule's linear form).
    module, rule = layer.module, layer.rule
    dt = compute_dtype(a, *grads)
    a, g0 = rule.linear_form(module, a.to(dt), grads[0].to(dt), batch_first)
    return a, [g0] + [rule.linear_form(module, None, g.to(dt), batch_first)[1] for g in grads[1:]]


class _Sums:
    """Unnormalised factor sums of one module over its calls: ``A = a_sum / a_count``,
    ``G = g_sum / N`` (mean) or ``g_sum`` (sum), with ``g_sum`` built from own-loss gradients."""

    def __init__(self, layer, weight: bool, bias: bool, approx: str, diag_a: bool, diag_g: bool):
        self.layer, self.weight, self.bias, self.approx = layer, weight, bias, approx
        self.diag_a, self.diag_g = diag_a, diag_g
        self.a_sum = self.g_sum = None
        self.a_count = 0
        # reduce: per-sample sums over positions of every call, and the number of positions
        self.a_pos: Optional[Tensor] = None
        self.g_pos: Optional[List[Tensor]] = None
        self.positions = 0

    @staticmethod
    def _add(total: Optional[Tensor], t: Tensor) -> Tensor:
        return t if total is None else total.add_(t)

    def add_call(self, a: Tensor, gs: List[Tensor]) -> None:
        n, groups, s, _ = a.shape
        if not self.weight:
            a = a[..., :0]  # bias only: A is the 1x1 moment of the ones
        if self.approx == "expand":
            rows = a.transpose(0, 1).reshape(groups, n * s, a.shape[-1])
            self.a_sum = self._add(self.a_sum, _moment(rows, self.bias, self.diag_a))
            self.a_count += n * s
            for g in gs:
                rows = g.transpose(0, 1).reshape(groups, n * s, g.shape[-1])
                self.g_sum = self._add(self.g_sum, _moment(rows, False, self.diag_g))
            return
        if self.g_pos is not None and len(self.g_pos) != len(gs):
            raise GradHooksError(
                f"module {self.layer.describe()} is called several times in the forward and the "
                f"backward passes reached its calls unequally ({len(self.g_pos)} vs {len(gs)}); "
                f"KFAC-reduce sums each pass's gradients over all calls, so every pass must reach "
                f"every call (or use kfac_approx='expand')"
            )
        self.a_pos = self._add(self.a_pos, a.sum(2))
        self.positions += s
        sums = [g.sum(2) for g in gs]
        self.g_pos = sums if self.g_pos is None else [t.add_(u) for t, u in zip(self.g_pos, sums)]

    def finish(self) -> None:
        if self.approx == "reduce":
            n = self.a_pos.shape[0]
            mean = (self.a_pos / self.positions).transpose(0, 1)  # (G, N, I)
            self.a_sum = _moment(mean, self.bias, self.diag_a)
            self.a_count = n
            for g in self.g_pos:
                self.g_sum = self._add(self.g_sum, _moment(g.transpose(0, 1), False, self.diag_g))
            self.a_pos = self.g_pos = None


def _too_big(dim: int, max_dense: Optional[int]) -> bool:
    return max_dense is not None and dim > max_dense


def _kfac_layer(layer: Layer) -> bool:
    return layer.rule.has_linear_form and not layer.rule.multi_io and "weight" in layer.params


def kfac_factors(
    recorder: Recorder,
    kfac_approx: str = "expand",
    *,
    backward_passes: str = "sum",
    modules: Optional[Iterable[str]] = None,
    max_dense: Optional[int] = None,
    all_reduce: bool = False,
    group=None,
) -> Dict[str, KFACFactors]:
    """KFAC factors of every hooked ``nn.Linear`` / ``nn.Conv1d/2d/3d`` the backward reached.

    Formulas and conventions are in the module docstring: ``A`` is a mean over the samples (and
    the weight-sharing positions for expand), ``G`` is summed over positions and carries the
    loss reduction's scale (``1/N`` for ``loss_reduction="mean"``), as in
    ``curvlinops.KFACLinearOperator`` (Martens & Grosse 2015, sec. 3; Grosse & Martens 2016,
    sec. 3; Eschenhagen et al. 2023, sec. 3). Computed in the recorded dtype, at least
    float32 (autocast captures are promoted).

    Args:
        recorder: the :class:`~gradhooks.capture.Recorder` of a :class:`~gradhooks.GradHooks`,
            after one or more backward passes of the current batch.
        kfac_approx: ``"expand"`` or ``"reduce"`` (Eschenhagen et al. 2023); identical for
            layers without weight sharing.
        backward_passes: ``"sum"``: ``G`` sums ``e e^T`` over the backward passes (one pass
            with the loss: empirical Fisher; one pass per column of a square root of the loss
            Hessian: type-2 / GGN); ``"mean"``: divided by the number of backward passes
            (Monte-Carlo Fisher, one pass per sampled target).
        modules: names of the modules wanted (default: all); e.g. to skip a huge layer.
        max_dense: factors of a larger dimension are computed and returned as their diagonal
            only (:attr:`KFACFactors.diagonal_A` / ``diagonal_G``), e.g. the
            ``(9217, 9217)`` input factor of a ``Linear(9216, 128)``. Default: all dense.
        all_reduce: sum the factors' numerators and counts over the processes of ``group``
            (``torch.distributed``), so that every rank holds the factors of the union of the
            ranks' batches: ``N`` is the total number of samples, and for ``"mean"`` the loss
            of the union is the mean over all of them. Every rank must call this.
        group: the ``torch.distributed`` process group (default: the world).

    Returns:
        ``{module name: KFACFactors}`` in ``model.named_modules()`` order. Modules of other
        types (embeddings, norms, the torch.func fallback ...) have no KFAC factors here and are
        left out; a parameter tied between two modules appears in both entries.

    Raises:
        NoBackwardError: before any backward pass of the current batch.
        HigherOrderGradError: after a ``create_graph=True`` backward through a hooked layer.
        GradientMismatchError: if a recorded input was modified in place after its forward.
        GradHooksError: with ``all_reduce``, if no process group is initialised or the ranks
            hold different layers; with ``"reduce"``, if the calls of one module were reached
            by different numbers of backward passes.
        ValueError: for an unknown ``kfac_approx`` / ``backward_passes`` value or module name.
    """
    check_choice("kfac_approx", kfac_approx, KFAC_APPROX)
    check_choice("backward_passes", backward_passes, _PASSES)
    if max_dense is not None and max_dense < 1:
        raise ValueError(f"max_dense must be a positive int or None, got {max_dense!r}")
    layers = recorder.layers
    order = {id(layer): i for i, layer in enumerate(layers)}
    wanted = None
    if modules is not None:
        wanted = set(modules)
        known = {layer.path for layer in layers if _kfac_layer(layer)}
        unknown = sorted(wanted - known)
        if unknown:
            raise ValueError(f"modules {unknown} are not hooked Linear/Conv layers of the model; "
                             f"these are: {sorted(known)}")
    batch = recorder.snapshot("kfac_factors()", sum_check=False, records=[
        cap for cap in recorder.records if _kfac_layer(cap.layer)
        and (wanted is None or cap.layer.path in wanted)])
    by_layer: Dict[int, list] = {}
    for cap in batch.records:
        by_layer.setdefault(id(cap.layer), []).append(cap)
    # backward passes: one grad_output per pass in single-output captures (multi_io captures
    # hold one summed grad_output per output tensor instead)
    passes = max((len(cap.grads) for cap in recorder.records if cap.spec is None), default=1)
    scale = batch.factor  # own-loss gradients: the records times B (mean) / S (GradScaler)
    sums: List[_Sums] = []
    with no_autocast():
        for key in sorted(by_layer, key=order.__getitem__):
            caps = by_layer[key]
            layer = caps[0].layer
            names = {n for cap in caps for n in cap.names}
            weight, bias = "weight" in names, "bias" in names
            entry = None
            for cap in caps:
                a, gs = _canonical(layer, cap.a, cap.grads, batch.batch_first)
                if entry is None:
                    d_in, d_out = a.shape[-1] * weight + bias, gs[0].shape[-1]
                    entry = _Sums(layer, weight, bias, kfac_approx, _too_big(d_in, max_dense),
                                  _too_big(d_out, max_dense))
                entry.add_call(a, gs)
            entry.finish()
            # own-loss gradients: the recorded ones times N (mean); MC passes averaged
            entry.g_sum.mul_(scale * scale / (passes if backward_passes == "mean" else 1))
            sums.append(entry)
    n_total = batch.size
    counts = [e.a_count for e in sums]
    if all_reduce:
        n_total, counts = _all_reduce(sums, n_total, counts, group)
    out = {}
    for e, count in zip(sums, counts):
        layer = e.layer
        a_fac, g_fac = e.a_sum / count, e.g_sum / (own_loss_scale(batch.loss_reduction, n_total) or 1.0)
        groups = a_fac.shape[0]
        if groups == 1:
            a_fac, g_fac = a_fac[0], g_fac[0]
        weight = layer.params.get("weight") if e.weight else None
        out[layer.path] = KFACFactors(
            A=a_fac, G=g_fac, module=layer.path,
            weight=batch.names[id(weight)] if weight is not None else None,
            bias=batch.names[id(layer.params["bias"])] if e.bias else None,
            weight_shape=tuple(weight.shape) if weight is not None else None,
            groups=groups, kfac_approx=kfac_approx, diagonal_A=e.diag_a, diagonal_G=e.diag_g,
            weight_transposed=layer.rule.weight_transposed,
        )
    return out


def _all_reduce(sums: List[_Sums], n_local: int, counts: List[int], group) -> Tuple[int, List[int]]:
    # One collective for the float sums, one for the integer counts, one (MAX) for the layout.
    if not (dist.is_available() and dist.is_initialized()):
        raise GradHooksError(
            "all_reduce=True needs an initialised torch.distributed process group "
            "(torch.distributed.init_process_group) on every rank"
        )
    tensors = [t for e in sums for t in (e.a_sum, e.g_sum)]
    device = tensors[0].device if tensors else torch.device("cpu")
    layout = repr([(e.layer.path, tuple(e.a_sum.shape), tuple(e.g_sum.shape)) for e in sums])
    sig = zlib.crc32(layout.encode())
    check = torch.tensor([len(sums), -len(sums), sig, -sig], dtype=torch.int64, device=device)
    dist.all_reduce(check, op=dist.ReduceOp.MAX, group=group)
    if check[0] != -check[1] or check[2] != -check[3]:
        raise GradHooksError(
            "kfac_factors(all_reduce=True): the ranks hold factors of different layers or shapes "
            f"(this rank: {layout}); every rank must run the same model and backward passes"
        )
    if tensors:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat, group=group)
        start = 0
        for t in tensors:
            t.copy_(flat[start:start + t.numel()].view_as(t))
            start += t.numel()
    ints = torch.tensor([n_local, *counts], dtype=torch.int64, device=device)
    dist.all_reduce(ints, group=group)
    ints = ints.tolist()
    return ints[0], ints[1:]


