"""Rules for ``nn.Embedding`` and ``nn.EmbeddingBag``: per-sample gradients as scatters.

Index conventions: ``n`` sample (for ``EmbeddingBag``: bag), ``s`` position of an index within a
sample, ``j`` entry of the flat index list of an ``EmbeddingBag``, ``v`` row of the table
(``V = num_embeddings``), ``d`` embedding dim (``D = embedding_dim``).

Forward and per-sample gradients, with ``g = dL/dy`` (grad_output) and ``[.]`` the indicator
(torch docs of ``nn.Embedding`` / ``nn.EmbeddingBag``; the same sums as aten's
``embedding_dense_backward`` and ``_embedding_bag_dense_backward``)::

    Embedding       y[n, s] = W[x[n, s]]
                    dL_n/dW[v] = sum_s [x[n, s] = v] g[n, s]
    EmbeddingBag    sum:   y[n] = sum_{j in bag n} w_j W[x_j]      (w_j: per_sample_weights or 1)
                    mean:  the same with w_j = 1 / (number of entries of bag n)
                    dL_n/dW[v] = sum_{j in bag n} [x_j = v] w_j g[n]
                    max:   y[n, d] = W[m[n, d], d], m[n, d] the row of bag n holding the max of dim d
                    dL_n/dW[v, d] = [m[n, d] = v] g[n, d]

Entries equal to ``padding_idx`` are left out of a bag (and of the ``mean`` count); the
``padding_idx`` row gets zero gradient. An empty bag (repeated offsets, or only padding) has
output zero and contributes nothing. ``max_norm`` renormalises rows of ``W`` in place in the
forward (under no_grad); the gradient is still the scatter above.

No one-hot is formed: the ``(B, V, D)`` result is a zero buffer into which the rows of ``g`` are
added (``index_add_``) at flat row ``n * V + v``, one kernel whose memory is that of the result.
For ``max`` the rows ``m[n, d]`` are recomputed with torch's own ``embedding_bag`` kernel (same
tie-breaking as the forward) from the module's current weight; they are right as long as the
weight is not changed between the forward and the read of the results (e.g. by an optimizer
step).

Not per-sample: ``scale_grad_by_freq=True`` divides each row's batch gradient by the row's
frequency in the whole batch, which is not the sum of the samples' own gradients (each would
divide by its own frequency); such calls raise :class:`~gradhooks.base.errors.UnsupportedCallError`.
``sparse=True`` is supported: the per-sample results are dense ``(B, V, D)`` either way.

Both rules are ``multi_io`` (they receive the recorded call itself): the integer indices are used
as they are, and an ``EmbeddingBag`` needs its ``offsets`` and ``per_sample_weights``. Grad_outputs
of lower precision (a bfloat16 model) are accumulated in float32.
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..base.errors import BatchSizeError, UnsupportedCallError
from ..base.forms import OneHot
from ..base.registry import Call, LayerRule, Rows, register_rule
from ..base.utils import compute_dtype

__all__ = ["EmbeddingRule", "EmbeddingBagRule", "scatter_rows"]


def scatter_rows(batch: int, num_rows: int, sample: Tensor, row: Tensor, values: Tensor) -> Tensor:
    """Per-sample row gradients: ``out[n, v] = sum_j [sample_j = n][row_j = v] values_j``.

    Args:
        batch: ``B``.
        num_rows: ``V``.
        sample: ``(E,)`` sample (bag) of each entry, in ``[0, B)``.
        row: ``(E,)`` table row of each entry, in ``[0, V)``.
        values: ``(E, D)`` what each entry adds to its row.

    Returns:
        ``(B, V, D)``, a new tensor (not a view): ``index_add_`` of ``values`` into it, seen as
        ``(B * V, D)``, at flat rows ``sample * V + row``.
    """
    out = values.new_zeros(batch, num_rows, values.shape[-1])
    out.view(batch * num_rows, -1).index_add_(0, sample * num_rows + row, values)
    return out


def _refuse_scale_grad_by_freq(module: nn.Module) -> None:
    if module.scale_grad_by_freq:
        raise UnsupportedCallError(
            f"{type(module).__name__} has scale_grad_by_freq=True: torch divides each row's "
            f"gradient by how often the row occurs in the whole batch, so the batch gradient is "
            f"not the sum of the samples' own gradients (each sample would divide by its own "
            f"count) and per-sample gradients that add up to it do not exist. Set "
            f"scale_grad_by_freq=False (scale the learning rate per row in the optimizer instead)"
        )


def _first_input(call: Call, name: str = "input") -> Tensor:
    return call.args[0] if call.args else call.kwargs[name]


@register_rule(nn.Embedding)
class EmbeddingRule(LayerRule):
    """``nn.Embedding``: indices ``x`` ``(B, *)`` (or ``(T, B, *)`` with ``batch_first=False``),
    output ``(B, *, D)``.

    Returns ``weight``: ``(B, V, D)``, ``dL_n/dW[v] = sum_s [x[n, s] = v] g[n, s]``, the
    ``padding_idx`` row zero (torch docs of ``nn.Embedding``; Goodfellow 2015 for the per-sample
    scatter of grad_outputs).

    Raises:
        UnsupportedCallError: at the forward, if ``scale_grad_by_freq=True``.
        BatchSizeError: for a 0-dim index.
    """

    position_wise = True  # (each index looked up alike: records relaid out, core/recorder/layouts.py)
    feature_dims = 0

    differentiable = True

    param_names = ("weight",)
    multi_io = True

    def check_call(self, module: nn.Module, args: tuple, kwargs: dict, options: Dict[str, object]) -> None:
        _refuse_scale_grad_by_freq(module)

    @staticmethod
    def _batch_dim(x: Tensor, batch_first: bool) -> int:
        # Indices carry no feature dim: torch's sequence layout (T, B, ...) has 2 dims or more.
        return 0 if batch_first or x.dim() < 2 else 1

    def batch_size(self, module: nn.Module, x, batch_first: bool) -> int:
        if not isinstance(x, Tensor) or x.dim() == 0:
            raise BatchSizeError(
                f"got a single index{'' if not isinstance(x, Tensor) else ' of shape ()'}; "
                f"per-sample gradients need a batch dimension: pass indices (B, *) "
                f"(e.g. x.unsqueeze(0))"
            )
        return x.shape[self._batch_dim(x, batch_first)]

    has_rows = True

    def rows(self, module: nn.Module, a: Call, g: Tensor, batch_first: bool,
             names: Iterable[str]) -> Dict[str, Rows]:
        """The per-sample gradient as row scatters (:class:`~gradhooks.base.forms.Rows`): one
        entry per index ``x[n, s]`` except those equal to ``padding_idx`` (whose row gets no
        gradient), ``values`` the matching rows of ``g`` (at least float32)."""
        idx = _first_input(a)
        if self._batch_dim(idx, batch_first) == 1:
            idx, g = idx.transpose(0, 1), g.transpose(0, 1)
        b = idx.shape[0]
        sample = torch.arange(b, device=idx.device).view(b, *(1,) * (idx.dim() - 1)).expand_as(idx)
        sample, row = sample.reshape(-1), idx.reshape(-1)
        values = g.reshape(-1, module.embedding_dim).to(compute_dtype(g))
        if module.padding_idx is not None:
            keep = row != module.padding_idx
            sample, row, values = sample[keep], row[keep], values[keep]
        return {"weight": Rows(sample, row, values)}

    kfac_transposed = True  # y = weight^T onehot(x): W = weight.T, (D, V)

    def kfac_form(self, module: nn.Module, a: Optional[Call], g: Tensor, batch_first: bool
                  ) -> Tuple[Optional[OneHot], Tensor]:
        """Kronecker-factored form: the lookup is a Linear layer without bias on one-hot inputs,
        ``y[n, s] = weight^T onehot(x[n, s])``, with the positions ``s`` as shared positions:
        ``a`` a :class:`~gradhooks.base.forms.OneHot` ``(N, 1, S)`` of ``V`` (``-1`` at
        ``padding_idx``: that row gets no gradient, as if its input were zero), ``g``
        ``(N, 1, S, D)`` (at least float32)."""
        if self._batch_dim(g, batch_first) == 1:
            g = g.transpose(0, 1)
        n, s = g.shape[0], math.prod(g.shape[1:-1])  # (explicit S: -1 is ambiguous for B = 0)
        g = g.reshape(n, 1, s, module.embedding_dim).to(compute_dtype(g))
        if a is None:
            return None, g
        idx = _first_input(a)
        if self._batch_dim(idx, batch_first) == 1:
            idx = idx.transpose(0, 1)
        idx = idx.reshape(n, 1, s).long()
        if module.padding_idx is not None:
            idx = idx.masked_fill(idx == module.padding_idx, -1)
        return OneHot(idx, module.num_embeddings), g

    def per_sample_grads(self, module: nn.Module, a: Call, g: Tensor, batch_first: bool,
                         names: Iterable[str]) -> Dict[str, Tensor]:
        """``a``: the call (indices ``(B, *)``); ``g``: ``(B, *, D)``. Returns ``{"weight": (B, V, D)}``."""
        idx = _first_input(a)
        r = self.rows(module, a, g, batch_first, names)["weight"]
        return {"weight": scatter_rows(idx.shape[self._batch_dim(idx, batch_first)],
                                       module.num_embeddings, r.sample, r.row, r.values)}


class ScaledEmbeddingRule(EmbeddingRule):
    """An ``nn.Embedding`` subclass whose forward multiplies the lookup by a constant:
    ``y = embedding(x) * embed_scale`` (transformers' ``BartScaledWordEmbedding``,
    ``M2M100ScaledWordEmbedding`` ... the ``sqrt(d_model)`` scaling of Vaswani et al. 2017;
    Gemma's ``GemmaTextScaledWordEmbedding`` keeps it as a 0-dim buffer, multiplied in the
    table's dtype: ``embed_scale.to(weight.dtype)``).

    Not registered by type: :mod:`gradhooks.rules.known` recognises the class by name and checks
    :meth:`formula` against the module on a probe input. Per-sample gradients as
    :class:`EmbeddingRule`'s with the grad_output rows times ``embed_scale`` (the chain rule
    through the constant): ``weight``: ``(B, V, D)``, or the row scatters for norms and clipping.
    """

    def rows(self, module: nn.Module, a: Call, g: Tensor, batch_first: bool,
             names: Iterable[str]) -> Dict[str, Rows]:
        r = super().rows(module, a, g, batch_first, names)["weight"]
        return {"weight": Rows(r.sample, r.row, r.values * _embed_scale(module))}

    def formula(self, module: nn.Module, x: Tensor) -> Tensor:
        """What the rule assumes the module computes: ``F.embedding(x, weight) * embed_scale``."""
        return F.embedding(x, module.weight, module.padding_idx) * _embed_scale(module)

    def probe_input(self, module: nn.Module) -> Optional[Tensor]:
        """``(2, 3)`` indices into the table, or ``None`` without a numeric or 0-dim tensor
        ``embed_scale``."""
        scale = getattr(module, "embed_scale", None)
        if not (isinstance(scale, (int, float)) or (isinstance(scale, Tensor) and scale.dim() == 0
                                                    and scale.is_floating_point())) \
                or not isinstance(module, nn.Embedding):
            return None
        return torch.randint(0, module.num_embeddings, (2, 3), device=module.weight.device)


def _embed_scale(module: nn.Module):
    """``embed_scale`` as a number, or a 0-dim tensor buffer in the table's dtype."""
    scale = module.embed_scale
    return scale.to(module.weight.dtype) if isinstance(scale, Tensor) else float(scale)


_BAG_ARGS = ("input", "offsets", "per_sample_weights")
_BAG_MODES = {"sum": 0, "mean": 1, "max": 2}

def _bag_call(args: tuple, kwargs: dict) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """``(input, offsets, per_sample_weights)`` of an ``EmbeddingBag.forward`` call."""
    given = dict(zip(_BAG_ARGS, args))
    given.update(kwargs)
    return given.get("input"), given.get("offsets"), given.get("per_sample_weights")


@register_rule(nn.EmbeddingBag)
class EmbeddingBagRule(LayerRule):
    """``nn.EmbeddingBag`` (modes ``sum``, ``mean``, ``max``): per-bag gradients.

    Input ``(B, L)`` (``B`` bags of ``L`` indices), or 1-D ``(E,)`` with ``offsets`` ``(B,)``
    (``(B + 1,)`` with ``include_last_offset=True``): bag ``n`` is
    ``input[offsets[n]:offsets[n + 1]]``. ``per_sample_weights`` (``sum`` mode) has the shape of
    ``input``. Output ``(B, D)``; the batch is always the bags, whatever ``batch_first``.

    Returns ``weight``: ``(B, V, D)`` (formulas in the module docstring; torch docs of
    ``nn.EmbeddingBag``).

    Raises:
        UnsupportedCallError: at the forward, if ``scale_grad_by_freq=True``, or if
            ``include_last_offset=True`` and the last offset is not the length of the input
            (torch's documented CSR form; torch's own gradient of the entries after it is wrong).
        BatchSizeError: for an input that is neither ``(B, L)`` nor 1-D with offsets.
    """

    param_names = ("weight",)
    multi_io = True

    def check_call(self, module: nn.Module, args: tuple, kwargs: dict, options: Dict[str, object]) -> None:
        _refuse_scale_grad_by_freq(module)
        x, offsets, _ = _bag_call(args, kwargs)
        if isinstance(x, Tensor) and x.dim() == 1 and isinstance(offsets, Tensor):
            if module.include_last_offset and offsets.numel() and int(offsets[-1]) != x.numel():
                raise UnsupportedCallError(
                    f"EmbeddingBag has include_last_offset=True, but the last offset "
                    f"({int(offsets[-1])}) is not the length of the input ({x.numel()}); torch "
                    f"documents the last offset as the input size (CSR form) and computes wrong "
                    f"gradients for the entries after it. Pass offsets ending with len(input)"
                )

    def call_batch_size(self, module: nn.Module, args: tuple, kwargs: dict, batch_first: bool) -> int:
        x, offsets, _ = _bag_call(args, kwargs)
        if isinstance(x, Tensor) and x.dim() == 1 and isinstance(offsets, Tensor):
            return offsets.numel() - int(module.include_last_offset)
        return self.batch_size(module, x, batch_first)

    def batch_size(self, module: nn.Module, x, batch_first: bool) -> int:
        if isinstance(x, Tensor) and x.dim() == 2:
            return x.shape[0]
        raise BatchSizeError(
            f"got an input of shape {tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}"
            f" as the first argument; per-sample (per-bag) gradients need either a (B, L) input "
            f"or a 1-D input with offsets, passed as EmbeddingBag(input, offsets, ...)"
        )

    def per_sample_grads(self, module: nn.Module, a: Call, g: Tensor, batch_first: bool,
                         names: Iterable[str]) -> Dict[str, Tensor]:
        """``a``: the call; ``g``: ``(B, D)``. Returns ``{"weight": (B, V, D)}``."""
        x, offsets, psw = _bag_call(a.args, a.kwargs)
        dt = compute_dtype(g) if psw is None else compute_dtype(g, psw)
        g = g.to(dt)
        if x.dim() == 2:  # B bags of L entries each, as F.embedding_bag flattens it
            offsets = torch.arange(x.shape[0], device=x.device, dtype=x.dtype) * x.shape[1]
            x = x.reshape(-1)
            psw = psw.reshape(-1) if psw is not None else None
            last = False
        else:
            last = module.include_last_offset
        b, v = offsets.numel() - int(last), module.num_embeddings
        pad = module.padding_idx
        if module.mode == "max":
            out = self._max_grads(module, x, offsets.to(x.dtype), last, g, b)
        else:
            # bag of entry j: the number of offsets <= j, minus one (an empty bag repeats an offset)
            bag = torch.bucketize(torch.arange(x.numel(), device=x.device), offsets, right=True) - 1
            keep = (x != pad).to(dt) if pad is not None else torch.ones(x.shape, dtype=dt, device=x.device)
            w = keep if psw is None else keep * psw.to(dt)
            if module.mode == "mean":
                count = torch.zeros(b, dtype=dt, device=x.device).index_add_(0, bag, keep)
                w = w / count.clamp_(min=1).index_select(0, bag)
            out = scatter_rows(b, v, bag, x, g.index_select(0, bag) * w.unsqueeze(1))
        return {"weight": out}  # padding entries: weight 0 above, left out of the max by torch

    @staticmethod
    def _max_grads(module: nn.Module, x: Tensor, offsets: Tensor, last: bool, g: Tensor, b: int) -> Tensor:
        """``max`` mode: ``g[n, d]`` added at ``(n, m[n, d], d)``; ``(B, V, D)``."""
        # torch.embedding_bag returns (output, offset2bag, bag_size, max_indices); bag_size counts
        # the non-padding entries, and max_indices is meaningless for bags where it is 0
        _, _, bag_size, rows = torch.embedding_bag(
            module.weight.detach(), x, offsets, False, _BAG_MODES["max"], False, None, last,
            module.padding_idx)
        v, d = module.num_embeddings, module.embedding_dim
        rows = rows.clamp(min=0)  # an empty bag may report -1; its value is masked below
        values = g * (bag_size > 0).to(g.dtype).unsqueeze(1)
        sample = torch.arange(b, device=x.device).unsqueeze(1)
        flat = (sample * v + rows) * d + torch.arange(d, device=x.device)  # (B, D) into (B, V, D)
        out = g.new_zeros(b, v, d)
        out.view(-1).index_add_(0, flat.reshape(-1), values.reshape(-1))
        return out
