"""KFAC's accumulator: the unnormalised factor sums of every covered layer, fed one backward
pass at a time, and their normalisation into :class:`~gradhooks.readers.curvature.kfac_results.KFACFactors` /
:class:`~gradhooks.readers.curvature.kfac_results.DiagonalFactors` (:class:`KFACSums`).

Formulas, index names and the placement of the scales: the module docstring of
:mod:`gradhooks.kfac`. Read by :func:`gradhooks.readers.curvature.kfac.kfac_factors` (from the records) and
:func:`gradhooks.kfac` (pass by pass); the sums of several processes are combined by
:meth:`gradhooks.readers.distributed.Ranks.all_reduce_kfac`.
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, List, Mapping, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from ...base.errors import GradHooksError
from ...base.forms import Block, Call, OneHot
from ...base.utils import own_loss_scale
from ...core.recorder.capture import Layer
from ..canonical import call_grads, canonical
from ..distributed import ranks_of_group
from .kfac_results import DiagonalFactors, KFACFactors

__all__ = ["KFACSums"]


def _ones_border(xx: Tensor, s: Tensor, m) -> Tensor:
    # [[xx, s], [s^T, m]] for x~ = [x, 1]: (G, I+1, I+1) from xx (G, I, I), s (G, I).
    groups, i = s.shape
    out = xx.new_empty(groups, i + 1, i + 1)
    out[:, :i, :i] = xx
    out[:, :i, i] = s
    out[:, i, :i] = s
    out[:, i, i] = m
    return out


def _moment(x, ones: bool, diagonal: bool, dtype: torch.dtype) -> Tensor:
    # x: (G, M, I) rows (or a OneHot (G, M) of indices) -> sum over the M rows of x~ x~^T,
    # x~ = [x, 1] if ones: (G, I', I'), or its diagonal (G, I'). The ones row/column are filled
    # from sums instead of concatenating.
    if isinstance(x, OneHot):  # x^T x of one-hot rows is diagonal: the counts of each index
        groups, m = x.index.shape
        counts = OneHot(x.index[None], x.size).counts(dtype)[0]  # (G, I)
        if diagonal:
            return torch.cat([counts, counts.new_full((groups, 1), m)], 1) if ones else counts
        return _ones_border(torch.diag_embed(counts), counts, m) if ones else torch.diag_embed(counts)
    groups, m, _ = x.shape
    if diagonal:
        d = (x * x).sum(1)
        return torch.cat([d, d.new_full((groups, 1), m)], 1) if ones else d
    xx = x.transpose(1, 2) @ x
    return _ones_border(xx, x.sum(1), m) if ones else xx


class _Part(NamedTuple):
    # One Kronecker block of one call in one backward pass: the parameters [W b] it covers
    # (local names; None if not covered), its number of groups and its pieces
    # (first group, a (N, G_j, S_j, I) / OneHot (N, G_j, S_j) / None, g (N, G_j, S_j, O)).
    name: str
    weight: Optional[str]
    bias: Optional[str]
    groups: int
    pieces: List[Tuple[int, object, Tensor]]
    transposed: bool


def _chunked(name: str, weight: Optional[str], bias: Optional[str], blocks: List[Block]) -> _Part:
    # Row blocks of a forms rule as groups of equal height (the gcd of the blocks' heights): a
    # packed in_proj_weight of a cross-attention (q from the query, k and v from the key) gives
    # three groups of E rows; a self-attention's one block of 3E rows stays one group.
    height = 0
    for b in blocks:
        height = math.gcd(height, b.g.shape[-1])
    pieces, lo = [], 0
    for b in blocks:
        k = b.g.shape[-1] // height
        n, s = b.g.shape[:2]
        g = b.g.reshape(n, s, k, height).transpose(1, 2)  # (N, k, S, height)
        a = None if weight is None else b.a.unsqueeze(1).expand(n, k, *b.a.shape[1:])
        pieces.append((lo, a, g))
        lo += k
    return _Part(name, weight, bias, lo, pieces, False)


def _block_parts(forms: Dict[str, List[Block]]) -> List[_Part]:
    # A forms rule's blocks as Kronecker parts: each weight-like parameter with the bias-like one
    # named like it (``weight`` -> ``bias``, the LayerRule.forms contract), the other bias-like
    # parameters alone (MultiheadAttention's in_proj_bias beside separate q/k/v weights, bias_k).
    biases = {n: b for n, b in forms.items() if b[0].a is None}
    parts = []
    for name, blocks in forms.items():
        if blocks[0].a is None:
            continue
        bias = name.replace("weight", "bias")
        if bias in biases and [b.rows for b in biases[bias]] == [b.rows for b in blocks]:
            del biases[bias]
        else:
            bias = None
        parts.append(_chunked(name, name, bias, blocks))
    parts.extend(_chunked(name, None, name, blocks) for name, blocks in biases.items())
    return parts


#: How :func:`~gradhooks.readers.curvature.kfac.kfac_factors` covers a hooked layer: Kronecker factors from the rule's
#: :meth:`~gradhooks.base.registry.LayerRule.kfac_form`, Kronecker factors per row block of its
#: :meth:`~gradhooks.base.registry.LayerRule.forms`, or a diagonal block.
_KRON, _BLOCKS, _DIAG = "kron", "blocks", "diag"


def _kind(layer: Layer) -> str:
    rule = layer.rule
    if rule.has_kfac_form and set(layer.params) <= {"weight", "bias"}:
        return _KRON
    if rule.has_forms:
        return _BLOCKS
    return _DIAG


def _parts(layer: Layer, a, grads, names: Tuple[str, ...], batch_first: bool,
           with_a: bool) -> List[_Part]:
    # The Kronecker parts of one call in one backward pass (grads: [g] for single-output rules,
    # the output's structure for multi_io ones).
    rule, module = layer.rule, layer.module
    if _kind(layer) == _BLOCKS:
        return _block_parts(rule.forms(module, a, grads, batch_first, names))
    g = grads if rule.multi_io else grads[0]
    if not isinstance(g, Tensor):
        return []
    a_c, g_c = canonical(layer, a, g, batch_first, form_a=with_a and "weight" in names, kfac=True)
    weight = "weight" if "weight" in names else None
    bias = "bias" if "bias" in names else None
    return [_Part("", weight, bias, g_c.shape[1], [(0, a_c, g_c)], rule.kfac_transposed)]


class _Sums:
    """Unnormalised factor sums of one Kronecker block over its calls and backward passes:
    ``A[g] = a_sum[g] / count[g]``, ``G = g_sum`` times the loss scales (:meth:`KFACSums.result`),
    ``g_sum`` built from the recorded gradients."""

    def __init__(self, key: str, layer: Layer, part: _Part, approx: str, max_dense: Optional[int]):
        self.key, self.layer, self.approx, self.max_dense = key, layer, approx, max_dense
        self.part, self.weight, self.bias = part.name, part.weight, part.bias
        self.groups, self.transposed = part.groups, part.transposed
        self.a_sum: Optional[Tensor] = None
        self.g_sum: Optional[Tensor] = None
        self.counts = [0] * part.groups
        self.diag_a = self.diag_g = False
        # reduce: per-sample sums over positions of every call, positions per group, and per
        # backward pass the per-sample sums of g over the positions of every call
        self.a_pos: Optional[Tensor] = None
        self.g_pos: Dict[int, Tensor] = {}
        self.seen: set = set()

    def _check(self, part: _Part) -> None:
        if part.groups != self.groups:
            raise GradHooksError(
                f"module {self.layer.describe()}: its calls give the parameters of "
                f"{self.key!r} in {self.groups} and in {part.groups} row blocks (e.g. a "
                f"MultiheadAttention called as self- and as cross-attention); KFAC needs one "
                f"layout per parameter")

    def add_a(self, part: _Part) -> None:
        self._check(part)
        for lo, a, g in part.pieces:
            n, gj, s = g.shape[:3]
            hi = lo + gj
            if a is None:  # bias only: the moment of the ones
                a = g.new_zeros(n, gj, s, 0)
            dim = a.size if isinstance(a, OneHot) else a.shape[-1]
            if self.a_sum is None and self.a_pos is None:
                d_in = dim + (self.bias is not None)
                # one-hot rows: A is diagonal for expand, kept as its diagonal (exact)
                self.diag_a = ((isinstance(a, OneHot) and self.approx == "expand")
                               or _too_big(d_in, self.max_dense))
                self.diag_g = _too_big(g.shape[-1], self.max_dense)
            if self.approx == "expand":
                rows = (OneHot(a.index.transpose(0, 1).reshape(gj, n * s), a.size)
                        if isinstance(a, OneHot) else a.transpose(0, 1).reshape(gj, n * s, dim))
                m = _moment(rows, self.bias is not None, self.diag_a, g.dtype)
                if self.a_sum is None:
                    self.a_sum = m.new_zeros(self.groups, *m.shape[1:])
                self.a_sum[lo:hi] += m
                for j in range(lo, hi):
                    self.counts[j] += n * s
            else:
                sums = a.counts(g.dtype) if isinstance(a, OneHot) else a.sum(2)  # (N, G_j, I)
                if self.a_pos is None:
                    self.a_pos = sums.new_zeros(n, self.groups, dim)
                    self.positions = [0] * self.groups
                self.a_pos[:, lo:hi] += sums
                for j in range(lo, hi):
                    self.positions[j] += s

    def add_g(self, p: int, part: _Part) -> None:
        self._check(part)
        for lo, _, g in part.pieces:
            n, gj, s, o = g.shape
            if self.approx == "expand":
                m = _moment(g.transpose(0, 1).reshape(gj, n * s, o), False, self.diag_g, g.dtype)
                if self.g_sum is None:
                    self.g_sum = m.new_zeros(self.groups, *m.shape[1:])
                self.g_sum[lo:lo + gj] += m
            else:
                if p not in self.g_pos:
                    self.g_pos[p] = g.new_zeros(n, self.groups, o)
                self.g_pos[p][:, lo:lo + gj] += g.sum(2)

    def finish(self) -> None:
        if self.approx == "reduce":
            n = self.a_pos.shape[0]
            positions = self.a_pos.new_tensor(self.positions).clamp(min=1)
            mean = (self.a_pos / positions[:, None]).transpose(0, 1)  # (G, N, I)
            self.a_sum = _moment(mean, self.bias is not None, self.diag_a, mean.dtype)
            self.counts = [n] * self.groups
            for g in self.g_pos.values():
                m = _moment(g.transpose(0, 1), False, self.diag_g, g.dtype)
                self.g_sum = m if self.g_sum is None else self.g_sum.add_(m)
            self.a_pos, self.g_pos = None, {}

    def tensors(self) -> List[Tensor]:
        return [self.a_sum, self.g_sum]

    def layout(self) -> tuple:
        return (self.key, tuple(self.a_sum.shape), tuple(self.g_sum.shape))

    def result(self, counts: List[int], g_scale: float, kfac_approx: str, names,
               per_position: Optional[int] = None) -> "KFACFactors":
        # per_position: N, for g_positions="mean" (G times N / counts[g] = 1 / R, the positions
        # per sample; expand's counts are N R)
        count = self.a_sum.new_tensor(counts).clamp(min=1)  # no samples: A = 0, not 0/0
        a_fac = self.a_sum / count.view(-1, *[1] * (self.a_sum.dim() - 1))
        g_fac = self.g_sum * g_scale
        if per_position is not None:
            g_fac = g_fac * (max(per_position, 1) / count).view(-1, *[1] * (g_fac.dim() - 1))
        if self.groups == 1:
            a_fac, g_fac = a_fac[0], g_fac[0]
        params = self.layer.params
        weight = params[self.weight] if self.weight is not None else None
        bias = params[self.bias] if self.bias is not None else None
        return KFACFactors(
            A=a_fac, G=g_fac, module=self.layer.path,
            weight=names[id(weight)] if weight is not None else None,
            bias=names[id(bias)] if bias is not None else None,
            weight_shape=tuple(weight.shape) if weight is not None else None,
            groups=self.groups, kfac_approx=kfac_approx, diagonal_A=self.diag_a,
            diagonal_G=self.diag_g, weight_transposed=self.transposed, part=self.part,
            bias_shape=tuple(bias.shape) if bias is not None else None)


class _DiagSums:
    """``sum_p sum_n (d l_n / d theta)^2`` of one layer's parameters, from the per-sample
    gradients of each backward pass (own-loss gradients: the records' scale applied)."""

    def __init__(self, key: str, layer: Layer):
        self.key, self.layer = key, layer
        self.sq: Dict[str, Tensor] = {}

    def add_pass(self, grads: Dict[str, Tensor]) -> None:
        for name, t in grads.items():
            sq = t.square().sum(0)
            self.sq[name] = sq if name not in self.sq else self.sq[name].add_(sq)

    def finish(self) -> None:
        pass

    def tensors(self) -> List[Tensor]:
        return [self.sq[n] for n in sorted(self.sq)]

    def layout(self) -> tuple:
        return (self.key, tuple((n, tuple(self.sq[n].shape)) for n in sorted(self.sq)))

    def result(self, counts, g_scale: float, kfac_approx: str, names,
               per_position: Optional[int] = None) -> "DiagonalFactors":
        params = self.layer.params
        order = [n for n in params if n in self.sq]  # the layer's (named_parameters) order
        return DiagonalFactors(
            diagonal={names[id(params[n])]: self.sq[n] * g_scale for n in order},
            module=self.layer.path, kfac_approx=kfac_approx)


def _too_big(dim: int, max_dense: Optional[int]) -> bool:
    return max_dense is not None and dim > max_dense


def _call_key(a) -> int:
    # The same call in every backward pass: its recorded input (a multi_io call's Call is
    # rebuilt per pass with that pass's internal gradients; its args tuple is not).
    return id(a.args) if isinstance(a, Call) else id(a)


class KFACSums:
    """The KFAC reader's accumulator: factor sums of every covered layer, fed one backward pass
    at a time (:func:`~gradhooks.readers.curvature.kfac.kfac_factors` from the records; :func:`gradhooks.kfac` from
    :func:`gradhooks.readers.passes.run_passes`, so that ``multi_io`` layers, whose records sum the
    passes, get each pass's gradients on their own).

    Args:
        size: ``B``.
        loss_reduction, batch_first: as given to :func:`gradhooks.attach`.
        scale: the records' scale to own-loss gradients (:attr:`~gradhooks.core.recorder.records.Batch.scale`).
        names: ``{id(param): name}``.
        kfac_approx, max_dense: as for :func:`~gradhooks.readers.curvature.kfac.kfac_factors`.
    """

    def __init__(self, size: int, loss_reduction: str, batch_first: bool, scale: Optional[float],
                 names: Mapping[int, str], kfac_approx: str, max_dense: Optional[int]):
        self.size, self.loss_reduction, self.batch_first = size, loss_reduction, batch_first
        self.scale, self.names = scale, names
        self.factor = 1.0 if scale is None else float(scale)
        self.approx, self.max_dense = kfac_approx, max_dense
        self.entries: Dict[Tuple[int, str], object] = {}

    def _entry(self, layer: Layer, part: Optional[_Part]):
        name = "" if part is None else part.name
        key = (id(layer), name)
        entry = self.entries.get(key)
        if entry is None:
            path = layer.path if not name else (f"{layer.path}.{name}" if layer.path else name)
            entry = self.entries[key] = (_DiagSums(path, layer) if part is None
                                         else _Sums(path, layer, part, self.approx, self.max_dense))
        return entry

    def add_pass(self, p: int, calls: Iterable) -> None:
        """Add backward pass ``p``: ``calls`` are ``(layer, a, grads, names)`` (e.g.
        :class:`~gradhooks.readers.passes.PassCall`) with this pass's grad_output (``[g]`` for
        single-output rules, the output's structure for ``multi_io`` rules)."""
        diag: Dict[int, Tuple[Layer, Dict[str, Tensor]]] = {}
        for layer, a, grads, names in calls:
            try:
                if _kind(layer) == _DIAG:
                    got = call_grads(layer.rule, layer.module, a, grads, self.batch_first, names,
                                     self.scale)
                    total = diag.setdefault(id(layer), (layer, {}))[1]
                    for name, t in got.items():  # a module called twice: sum, then square
                        total[name] = t if name not in total else total[name].add_(t)
                    continue
                key = _call_key(a)
                parts = _parts(layer, a, grads, tuple(names), self.batch_first, with_a=True)
                for part in parts:
                    entry = self._entry(layer, part)
                    if key not in entry.seen:
                        entry.seen.add(key)
                        entry.add_a(part)
                    entry.add_g(p, part)
            except GradHooksError as e:
                if layer.describe() in str(e):
                    raise
                raise type(e)(f"module {layer.describe()}: {e}") from None
        for layer, grads in diag.values():
            self._entry(layer, None).add_pass(grads)

    def result(self, order: Mapping[int, int], passes: int, backward_passes: str,
               all_reduce: bool = False, group=None, g_positions: str = "sum"
               ) -> Dict[str, "KFACFactors | DiagonalFactors"]:
        """The factors, keyed and ordered as :func:`~gradhooks.readers.curvature.kfac.kfac_factors` documents
        (``order``: ``{id(param): position}`` in ``named_parameters()`` order; ``passes``: the
        number of backward passes, for ``backward_passes="mean"``; ``all_reduce``, ``group``:
        the sums and counts summed over the ranks of ``group`` first; ``g_positions``: ``G``
        summed or averaged over the positions, as :func:`~gradhooks.readers.curvature.kfac.kfac_factors`
        documents).

        Raises:
            GradHooksError: with ``all_reduce``, if no process group is initialised or the ranks
                hold different layers.
        """
        def first(item):
            (_, name), entry = item
            params = entry.layer.params
            covered = [params[n] for n in ((entry.weight, entry.bias) if isinstance(entry, _Sums)
                                           else entry.sq) if n is not None]
            return min(order.get(id(p), 0) for p in covered), name

        entries = [e for _, e in sorted(self.entries.items(), key=first)]
        for e in entries:
            e.finish()
        # own-loss gradients: the records times N (mean); MC passes averaged
        per_pass = 1.0 / (passes if backward_passes == "mean" else 1)
        for e in entries:
            if isinstance(e, _Sums):
                e.g_sum.mul_(self.factor * self.factor * per_pass)
            else:
                for t in e.sq.values():
                    t.mul_(per_pass)
        n_total = self.size
        counts = [e.counts if isinstance(e, _Sums) else [] for e in entries]
        if all_reduce:
            n_total, counts = _all_reduce(entries, n_total, counts, group)
        w = 1.0 / (own_loss_scale(self.loss_reduction, n_total) or 1.0)
        per_position = n_total if g_positions == "mean" else None
        return {e.key: e.result(c, w, self.approx, self.names, per_position)
                for e, c in zip(entries, counts)}


def _all_reduce(entries: list, n_local: int, counts: List[List[int]], group
                ) -> Tuple[int, List[List[int]]]:
    # The entries' sums, the sample count and the entries' counts summed over the ranks of
    # ``group`` (gradhooks.readers.distributed); returns the total count and the summed counts.
    ranks = ranks_of_group(group)
    ints = ranks.all_reduce_kfac([t for e in entries for t in e.tensors()],
                                 [n_local, *[c for cs in counts for c in cs]],
                                 [e.layout() for e in entries])
    out, start = [], 1
    for cs in counts:
        out.append(ints[start:start + len(cs)])
        start += len(cs)
    return ints[0], out
