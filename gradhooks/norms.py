"""The norms reader: per-sample gradient norms without materialising the per-sample gradients.

Index conventions: ``n`` sample, ``g`` group (``G = 1`` except for grouped convolutions), ``s``,
``t`` weight-sharing positions (tokens, pixels; ``S = 1`` for a Linear on ``(B, in)``), ``i``
input feature, ``o`` output feature. A Linear or Conv call in the canonical form of
:mod:`gradhooks.forms` computes ``y[n,g,s] = W[g] a[n,g,s] + b[g]``, so sample ``n``'s
gradient is ``dW_n[g] = sum_s g[n,g,s] a[n,g,s]^T`` and ``db_n[g] = sum_s g[n,g,s]``, with
``g`` the recorded grad_output (for ``loss_reduction="mean"`` multiplied by ``B``, the gradient of
the sample's own loss, as in :meth:`~gradhooks.GradHooks.per_sample_grads`).

**Norms** (:func:`per_sample_grad_norms`). ``||dW_n||^2`` without forming ``dW_n`` (the Gram or
"ghost norm" trick; Goodfellow 2015, arXiv:1510.01799, for ``S = 1``; Li et al. 2022, "Large
language models can be strong differentially private learners", ICLR, arXiv:2110.05679, sec. 4,
for ``S > 1``)::

    ||dW_n||^2 = sum_g sum_{s,t} (a[n,g,s] . a[n,g,t]) (g[n,g,s] . g[n,g,t])

costs ``N G S^2 (I + O)`` multiply-adds and ``N G S^2`` memory; materialising ``dW_n`` costs
``N G S I O`` and ``N G I O``. Per parameter the cheaper is used, by this count plus, for
tensors too large for the cache, the cost of writing and reading them back (:func:`use_gram`:
the Gram form iff ``S (I + O) < I O`` on small layers; the Gram form then needs less memory as
well; ``benchmarks/norm_cost.py`` measures both forms on a grid of 42 Linear shapes and the
two rules' picks: FLOPs alone 3-4 picks slower than the best, up to 2.3x; with the bytes term
2, up to 1.1x, both near ties). Measured (2 CPU cores,
torch 2.13, ``N = 32``, medians, ms Gram / materialised, ratio ``S (I + O) / (I O)``): Linear
128x128 S=32 (0.5) 0.13 / 0.24, S=64 (1.0) 0.43 / 0.43, S=128 (2.0) 1.6 / 0.82; 512x512 S=128
(0.5) 6.6 / 23.6; 64->512 S=64 (1.1) 0.90 / 0.91, S=128 (2.3) 3.7 / 2.0; Conv2d 3x3 128->128 on
8x8 (0.56) 21 / 33, on 12x12 (1.25) 44 / 41; 256->256 on 4x4 (0.07) 1.9 / 74; 32->64 on 12x12
(2.75) 62 / 0.8 (a materialised conv uses torch's grouped-convolution weight-backward kernel, a
Gram conv needs the unfolded patches). Bias: ``||db_n||^2 = ||sum_s g[n,s]||^2`` from an
``(N, O)`` tensor. A parameter used by several calls (a layer called twice, weights tied between
layers) has gradient ``sum_calls dW_n``; its Gram form concatenates the calls' positions, which
includes the cross terms between calls. Rules that give their gradients in factored form
(:class:`~gradhooks.forms.Block`: recurrent layers and cells, with the time steps as
positions; MultiheadAttention, with the tokens) are treated the same way, block by block: Gram
form or materialised block per the same count, their replay run once per call for norms and
clipped sum together; blocks that share their grad_output (an LSTM's ``weight_ih`` and
``weight_hh``: the gate gradients) form its Gram matrix once, which counts as ``O / shared``
in the comparison. Rules that give their gradients as row scatters
(:class:`~gradhooks.forms.Rows`: ``nn.Embedding``, ``dW_n[v] = sum_s [x[n,s] = v] g[n,s]``)
need no ``(N, V, D)`` tensor: ``||dW_n||^2`` is the sum of the squared norms of the
grad_output rows summed per ``(sample, row)`` pair (``O(N S D)``: one sort of the pair keys and
an ``index_add``), and the clipped sum is one ``index_add`` of ``c_n g[n,s]`` at row ``x[n,s]``.
A weight tied between an input embedding (row scatters ``R_n``) and an output projection with
a linear form (``L_n = sum_s g[n,s] a[n,s]^T``; GPT-2, Llama-3.2, Gemma, T5) is :data:`TIED`:
``||R_n + L_n||^2 = ||R_n||^2 + ||L_n||^2 + 2 <R_n, L_n>``, the projection's part in the Gram
form or materialised per :func:`use_gram`, the cross term ``sum_{j,s} g[n,s,row_j] (a[n,s] .
values_j)`` from both records (:func:`tied_cross`, ``N S E D``), never a ``(N, V, D)`` tensor in
the Gram case; the clipped sum is the projection's weighted contraction plus one ``index_add``.
Layers with none of these (norm layers, whose per-sample gradients are ``(N, C)`` anyway;
EmbeddingBag, transposed convs, the torch.func fallback, and other parameters tied across layer
types) are materialised with their rule, one layer at a time, and reduced to norms at once.

**Checks.** As :meth:`~gradhooks.GradHooks.per_sample_grads` does (``check=True``: on each new
call structure and every 100th read; ``check="always"``: every read; ``check=False``: never),
the per-sample gradients must sum to the gradient autograd computed (a parameter also used
outside its module would otherwise get a silently wrong norm and an unclipped share): materialised
parameters on 256 probe coordinates (:func:`gradhooks.checks.check_sums`), Gram-form
parameters on one fixed random rank-one projection ``sum_g v_g^T (sum_n dW_n[g]) u_g``, computed
from the records as ``sum_{n,g,s} (a[n,g,s] . u_g)(g[n,g,s] . v_g)`` (cost ``N G S (I + O)``).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

import torch
from torch import Tensor

from .capture import Batch, Record, Recorder
from .checks import check_projections, check_sums, no_total, probed, projection_terms
from .forms import Block, Rows, from_blocks, gram_sq_norms, sq_norms, weight_grad
from .per_sample import call_grads, per_sample_grads
from .utils import compute_dtype, no_autocast

__all__ = ["per_sample_grad_norms", "use_gram", "squared_norms", "plan", "Forms", "PlannedParam",
           "result_sq_norms", "add_up", "summed", "tied_linear", "GRAM", "CLOSED", "FORMS", "ROWS",
           "TIED", "GENERIC"]

# How each parameter's per-sample norm and clipped sum are formed.
GRAM = "gram"          # weight of a rule with a linear form: Gram-form norm, closed-form clipped sum
CLOSED = "closed"      # weight or bias with a linear form: materialised norm, closed-form clipped sum
FORMS = "forms"        # rule with factored forms (recurrent, attention): per block as Linear
ROWS = "rows"          # rule with row scatters (Embedding): per (sample, row) sums, index_add
TIED = "tied"          # weight tied between row scatters and linear forms (input / output
                       # embeddings): rows + linear form + their cross term, no (N, V, D) tensor
GENERIC = "generic"    # any other rule: materialised norm and clipped sum


#: Bytes of per-sample tensors above which writing them is bound by memory traffic on this
#: machine (``benchmarks/norm_cost.py``: below it the two forms' times follow their multiply-add
#: counts; above it a materialised ``(N, O, I)`` costs about :data:`BYTE_COST` multiply-adds per
#: value, written to fresh pages and read back).
MEMORY_BOUND = 4 * 2**20

#: Multiply-adds one value of a memory-bound per-sample tensor costs (write and read back):
#: fitted on this machine (2 cores, about 120 G multiply-adds/s in ``bmm``, 3.6 GB/s for fresh
#: pages), ``benchmarks/norm_cost.py``.
BYTE_COST = 250


def use_gram(positions: int, fan_in: int, fan_out: int, shared: int = 1,
             batch: int = 0) -> bool:
    """Whether the Gram form of a weight's per-sample squared norms is the cheaper one.

    Args:
        positions: ``S``, weight-sharing positions per sample and group (summed over the calls
            of a parameter used several times).
        fan_in: ``I``, input features per group (``C_in/G * prod(kernel_size)`` for a conv).
        fan_out: ``O``, output features per group.
        shared: how many weights have this same grad_output (an LSTM's ``weight_ih`` and
            ``weight_hh``: the gate gradients), whose Gram matrix is then formed once for all.
        batch: ``N G``, the number of per-sample (per-group) matrices (``0``: unknown, the
            multiply-add counts alone).

    Returns:
        Whether ``S^2 (I + O / shared) + bytes(S^2 (1 + 1 / shared))`` (Gram: the ``a a^T``
        and ``g g^T`` matrices) is below ``S I O + bytes(I O)`` (materialised), where
        ``bytes(k)`` is :data:`BYTE_COST` ``k`` when the ``batch`` such tensors exceed
        :data:`MEMORY_BOUND` bytes (float32) and 0 below (they stay in cache). The FLOP count
        alone is the textbook rule (Li et al. 2022, sec. 4: ``S (I + O) < I O``); the bytes term
        turns it on memory-bound layers (``benchmarks/norm_cost.py``, N = 32: 128 tokens of
        128 -> 512, Gram 3.1 ms against 6.9 ms materialised, where FLOPs alone pick the
        materialised form; 256 tokens of 512 -> 512, 20 against 37 ms). Measurements in the
        module docstring.
    """
    s, i, o = positions, fan_in, fan_out
    gram = s * s * (i + o / shared)
    mat = s * i * o
    if batch * s * s * 4 > MEMORY_BOUND:
        gram += BYTE_COST * s * s * (1 + 1 / shared)
    if batch * i * o * 4 > MEMORY_BOUND:
        mat += BYTE_COST * i * o
    return gram < mat


def add_up(parts) -> Optional[Tensor]:
    """Sum of the ``(N,)`` tensors ``parts`` (per-parameter squared norms), ``None`` if empty."""
    total = None
    for t in parts:
        if t is not None:
            total = t if total is None else total + t
    return total


def summed(cap: Record) -> Tuple[Tensor, Tensor]:
    """A linear-form call's input and grad_output (summed over backward passes), both in the
    computation dtype (:func:`~gradhooks.utils.compute_dtype`)."""
    a, g = cap.a, cap.summed_grad()
    dt = a.dtype
    if g.dtype != dt or dt in (torch.bfloat16, torch.float16):
        dt = compute_dtype(a, g)
        a, g = a.to(dt), g.to(dt)
    return a, g


def _canonical(cap: Record, batch_first: bool) -> Tuple[Tensor, Tensor]:
    """Canonical ``a (N, G, S, I)``, ``g (N, G, S, O)`` of a linear-form call, grads summed."""
    layer = cap.layer
    return layer.rule.linear_form(layer.module, *summed(cap), batch_first)


def _sizes(cap: Record, batch_first: bool) -> Tuple[int, int, int, int]:
    """``(G, S, I, O)`` of a linear-form call's canonical form, without forming ``a``."""
    layer = cap.layer
    _, g = layer.rule.linear_form(layer.module, None, cap.grads[0], batch_first)
    _, groups, positions, o = g.shape
    weight = layer.params.get("weight")
    return groups, positions, (0 if weight is None else weight.numel() // (groups * o)), o


def _identity_form(cap: Record, batch_first: bool) -> bool:
    """Whether a call's linear form (with ``G = S = 1``) is its recorded 2-D input and
    grad_output themselves, ``(N, I)`` and ``(N, O)`` viewed as ``(N, 1, 1, .)`` (a Linear on
    ``(B, in)``): then the readers use the records as they are, without the views (a few
    microseconds a layer, which the seed MLP's 0.1 ms step notices). Checked on the tensors, once
    per structure (:func:`plan` keeps it)."""
    a, g = cap.a, cap.grads[0]
    if a.dim() != 2 or g.dim() != 2:
        return False
    a4, g4 = cap.layer.rule.linear_form(cap.layer.module, a, g, batch_first)
    return all(t4.shape == (t.shape[0], 1, 1, t.shape[1]) and t4.data_ptr() == t.data_ptr()
               and (t4.stride(0), t4.stride(3)) == t.stride() for t, t4 in ((a, a4), (g, g4)))


def _bias_grads(cap: Record, batch_first: bool) -> Tensor:
    """Per-sample bias gradient ``(N, G O)`` of a linear-form call: ``sum_s g[n, g, s]``."""
    layer = cap.layer
    g = cap.summed_grad()
    g = g.to(compute_dtype(g))
    _, g = layer.rule.linear_form(layer.module, None, g, batch_first)
    n = g.shape[0]
    return g.reshape(n, -1) if g.shape[2] == 1 else g.sum(2).reshape(n, -1)


class Forms:
    """The factored forms (:meth:`~gradhooks.registry.LayerRule.forms`) of the calls of rules
    that have them, computed once per call (the rule's replay runs once for norms and clipped
    sum together) and dropped with this object."""

    def __init__(self, batch: Batch, plans: Dict[int, "PlannedParam"]):
        self.batch, self.plans, self.calls, self.joined = batch, plans, {}, {}
        self.uses: Optional[Dict[tuple, int]] = None  # grad_output key -> weight-like blocks
        self.grams: Dict[tuple, Tuple[Tensor, Tensor]] = {}  # key -> (g, g g^T)
        self.scatters: Dict[int, Rows] = {}  # id(param) -> its row scatters (_rows)

    def rows(self, p: "PlannedParam") -> Rows:
        """The parameter's :class:`~gradhooks.forms.Rows` (:func:`_rows`), formed once for
        norms and clipped sum."""
        if p.pid not in self.scatters:
            self.scatters[p.pid] = _rows(self.batch, p)
        return self.scatters[p.pid]

    @staticmethod
    def _key(t: Tensor) -> tuple:
        return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype

    def sharing(self, g: Tensor) -> int:
        """How many weight-like blocks of the factored parameters have the grad_output ``g``
        (the same tensor: an LSTM's ``weight_ih`` and ``weight_hh`` blocks)."""
        if self.uses is None:
            self.uses = {}
            for p in self.plans.values():
                if p.kind == FORMS:
                    for b in self.blocks(p) or ():
                        if b.a is not None:
                            key = self._key(b.g)
                            self.uses[key] = self.uses.get(key, 0) + 1
        return self.uses.get(self._key(g), 1)

    def gram(self, g: Tensor) -> Tensor:
        """``g g^T`` ``(N, S, S)`` of a shared grad_output ``g`` ``(N, S, O)``, formed once."""
        key = self._key(g)
        if key not in self.grams:
            self.grams[key] = (g, g @ g.transpose(-1, -2))  # g kept: its address stays its own
        return self.grams[key][1]

    def of(self, cap: Record) -> Dict[str, list]:
        """The factored forms of the record ``cap``'s parameters planned as :data:`FORMS`."""
        forms = self.calls.get(id(cap))
        if forms is None:
            layer = cap.layer
            names = [n for n in cap.names if self.plans[id(layer.params[n])].kind == FORMS]
            forms = layer.rule.forms(layer.module, cap.a, cap.grads_arg(), self.batch.batch_first, names)
            self.calls[id(cap)] = forms
        return forms

    def blocks(self, p: "PlannedParam") -> Optional[list]:
        """The parameter's blocks with the calls' positions concatenated (``a`` ``(N, S, I)``,
        ``g`` ``(N, S, O)`` summed over calls: their cross terms are part of the norm), or
        ``None`` if the calls' row blocks differ. Computed once per parameter."""
        if p.pid not in self.joined:
            self.joined[p.pid] = self._join(p)
        return self.joined[p.pid]

    def _join(self, p: "PlannedParam") -> Optional[list]:
        per_call = [self.of(cap).get(local) for cap, local in p.entries]
        per_call = [b for b in per_call if b is not None]
        if not per_call:
            return []
        if len(per_call) == 1:
            return per_call[0]
        layout = [[(b.rows, b.a is None) for b in blocks] for blocks in per_call]
        if any(x != layout[0] for x in layout[1:]):
            return None
        out = []
        for parts in zip(*per_call):
            dt = compute_dtype(*(t for b in parts for t in (b.a, b.g) if t is not None))
            a = None if parts[0].a is None else torch.cat([b.a.to(dt) for b in parts], 1)
            out.append(Block(parts[0].rows, a, torch.cat([b.g.to(dt) for b in parts], 1)))
        return out

    def materialised(self, p: "PlannedParam", shape) -> Tensor:
        """``(N, *param.shape)``, the sum over the parameter's calls (when their blocks differ)."""
        total = None
        for cap, local in p.entries:
            blocks = self.of(cap).get(local)
            if blocks:
                t = from_blocks(blocks, (blocks[0].g.shape[0], *shape))
                total = t if total is None else total.add_(t)
        return total


# ------------------------------------------------------------------------------------- the plan
class PlannedParam:
    """One trainable parameter the backward reached: its calls and how it is handled."""

    __slots__ = ("pid", "name", "entries", "kind")

    def __init__(self, pid: int, name: str):
        self.pid, self.name, self.entries, self.kind = pid, name, [], GENERIC


def plan(batch: Batch) -> Tuple[Dict[int, PlannedParam], Tuple[int, ...]]:
    """Decide per parameter how its norm and clipped sum are formed: ``{id(param):
    PlannedParam}`` in the order of ``model.named_parameters()``, for the records of ``batch``
    (which must hold every call of their parameters); and per record ``0``, or ``1`` if its rule
    has a linear form with ``G = S = 1`` (outer-product norms), ``2`` if that form is the records
    themselves (:func:`_identity_form`: a Linear on ``(B, in)``).

    The decisions depend only on which layers were called with which parameters and on the
    grad_output shapes, so they are kept per such structure (in ``batch.cache``) and reused for
    the next batch of the same structure.

    Raises:
        GradientMismatchError: (``check`` on) a parameter autograd reached has no record.
    """
    caps = batch.records
    key = ("norms", batch.size, tuple((id(cap.layer), cap.names, None if cap.spec is not None
                                       else tuple(cap.grads[0].shape)) for cap in caps))
    cache = batch.cache
    template = cache.get(key)
    if template is None:
        if len(cache) >= 64:  # structures vary without bound: start over
            cache.clear()
        template = cache[key] = _plan_template(batch)
    plans: Dict[int, PlannedParam] = {}
    for pid, kind, entries in template[0]:
        p = plans[pid] = PlannedParam(pid, batch.names[pid])
        p.kind, p.entries = kind, [(caps[i], local) for i, local in entries]
    batch.check_unrecorded(plans)
    return plans, template[1]


def _plan_template(batch: Batch):
    """Per parameter reached by the records, in the order of ``model.named_parameters()``:
    ``(id, kind, [(index in records, local name)])``; and per record whether it is a unit
    linear form."""
    caps = batch.records
    found: Dict[int, PlannedParam] = {}
    for i, cap in enumerate(caps):
        for local in cap.names:
            pid = id(cap.layer.params[local])
            if pid not in found:
                found[pid] = PlannedParam(pid, batch.names[pid])
            found[pid].entries.append((cap, local, i))
    sizes = {i: _sizes(cap, batch.batch_first) for i, cap in enumerate(caps)
             if cap.spec is None and cap.layer.rule.has_linear_form}
    for p in found.values():
        locals_ = {local for _, local, _ in p.entries}
        rules = [cap.layer.rule for cap, _, _ in p.entries]
        if all(rule.has_forms for rule in rules):
            p.kind = FORMS
        elif all(rule.has_rows for rule in rules):
            p.kind = ROWS
        elif _tieable(p, sizes):
            p.kind = TIED
        elif len(locals_) == 1 and all(i in sizes for _, _, i in p.entries):
            p.kind = CLOSED
            if locals_ == {"weight"}:
                calls = [sizes[i] for _, _, i in p.entries]
                shapes = {(grp, i, o) for grp, _, i, o in calls}
                if len(shapes) == 1:
                    grp, i, o = shapes.pop()
                    if use_gram(sum(s for _, s, _, _ in calls), i, o, batch=batch.size * grp):
                        p.kind = GRAM
    units = tuple(0 if not (i in sizes and sizes[i][0] == 1 and sizes[i][1] == 1)
                  else 2 if _identity_form(caps[i], batch.batch_first) else 1
                  for i in range(len(caps)))
    return ([(pid, found[pid].kind, [(i, local) for _, local, i in found[pid].entries])
             for pid in batch.names if pid in found], units)


def _tieable(p: PlannedParam, sizes: Dict[int, Tuple[int, int, int, int]]) -> bool:
    """Whether a parameter's calls are row scatters (an input embedding) and ungrouped linear
    forms of one shape (an output projection tied to it), all of its ``weight``: then
    :data:`TIED` forms its norm from both factored records and their cross term."""
    rows = [i for cap, local, i in p.entries if cap.layer.rule.has_rows and local == "weight"]
    linear = [i for cap, local, i in p.entries if i in sizes and local == "weight"]
    return (bool(rows) and bool(linear) and len(rows) + len(linear) == len(p.entries)
            and len({sizes[i][::2] for i in linear}) == 1 and sizes[linear[0]][0] == 1)


def tied_linear(batch: Batch, p: PlannedParam) -> Optional[Tuple[Tensor, Tensor, Tensor, Tensor]]:
    """The linear-form calls of a :data:`TIED` parameter, positions concatenated: canonical
    ``a`` ``(N, 1, S, I)``, ``g`` ``(N, 1, S, O)``, and the same as ``p`` ``(N, S, R)``,
    ``q`` ``(N, S, C)`` with the parameter's rows ``R`` first, so that sample ``n``'s gradient
    of these calls is ``sum_s p[n, s] q[n, s]^T`` ``(R, C)`` (``p = g``, ``q = a``; swapped for
    a weight stored transposed, ``(I, O)``: transformers' ``Conv1D``). ``None`` without calls."""
    calls = [(cap, _canonical(cap, batch.batch_first)) for cap, _ in p.entries
             if not cap.layer.rule.has_rows]
    if not calls:
        return None
    dt = compute_dtype(*(t for _, call in calls for t in call))
    if len(calls) == 1:  # (no copy: an LM head's g is (N, 1, S, V), 411 MB for GPT-2 at 16 x 128)
        a, g = (t.to(dt) for t in calls[0][1])
    else:
        a = torch.cat([c[0].to(dt) for _, c in calls], 2)
        g = torch.cat([c[1].to(dt) for _, c in calls], 2)
    pp, qq = a[:, 0], g[:, 0]
    if not calls[0][0].layer.rule.weight_transposed:
        pp, qq = qq, pp
    return a, g, pp, qq


def _by_sample(r: Rows, batch: int) -> Tuple[Tensor, Tensor]:
    """A row scatter's entries laid out per sample, zero-padded to the largest count ``E``:
    rows ``(N, E)`` int64 (0 where padded) and values ``(N, E, D)`` (0 where padded)."""
    counts = torch.bincount(r.sample, minlength=batch)
    width = int(counts.max()) if r.sample.numel() else 0
    order = torch.argsort(r.sample, stable=True)
    sample = r.sample[order]
    starts = torch.cumsum(counts, 0) - counts  # int64 throughout: counts never pass a float
    slot = torch.arange(sample.shape[0], device=sample.device) - starts[sample]
    rows = r.row.new_zeros(batch, width)
    rows[sample, slot] = r.row[order]
    values = r.values.new_zeros(batch, width, r.values.shape[1])
    values[sample, slot] = r.values[order]
    return rows, values


def tied_cross(r: Rows, p: Tensor, q: Tensor) -> Tensor:
    """``(N,)`` inner products ``<R_n, L_n>`` of a tied weight's two per-sample parts: the row
    scatter ``R_n`` (:class:`~gradhooks.forms.Rows`, the input embedding) and the linear-form
    gradient ``L_n = sum_s p[n, s] q[n, s]^T`` (``p`` ``(N, S, V)``, ``q`` ``(N, S, D)``: the
    output projection, :func:`tied_linear`), without forming either ``(N, V, D)`` tensor::

        <R_n, L_n> = sum_{j: sample_j = n} values_j . L_n[row_j]
                   = sum_{j, s} p[n, s, row_j] (q[n, s] . values_j)

    (the Gram form of Li et al. 2022, arXiv:2110.05679, sec. 4, between the one-hot inputs of
    the embedding and the output projection's grad_outputs). Cost ``N S E D`` multiply-adds for
    ``E`` entries per sample (GPT-2 small, T = 128: 1.6 G for B = 16, against 79 G for one
    materialised ``(B, V, D)`` gradient)."""
    n = p.shape[0]
    rows, values = _by_sample(r, n)
    picked = p.gather(2, rows.unsqueeze(1).expand(n, p.shape[1], rows.shape[1]))  # (N, S, E)
    return (q @ values.to(q.dtype).transpose(1, 2)).mul_(picked).view(n, -1).sum(1)


def squared_norms(batch: Batch, plans: Dict[int, PlannedParam], units: Tuple[int, ...],
                  forms: Forms) -> Dict[int, Tensor]:
    """Squared per-sample norms ``(N,)`` of each parameter's gradient, UNSCALED (gradients of the
    reduced loss restricted to sample ``n``), running the sum checks when due
    (``batch.check_key``). ``plans``, ``units``: :func:`plan` of ``batch``; ``forms``: a
    :class:`Forms` of them (kept for the clipped sum)."""
    sq: Dict[int, Tensor] = {}
    probes, projections = [], []
    check = batch.check_key is not None
    partial: Dict[int, Tensor] = {}  # materialised params with several calls, summed so far
    left = {pid: len(p.entries) for pid, p in plans.items()
            if p.kind not in (GRAM, FORMS, ROWS, TIED)}

    def reduce(pid: int, t: Tensor, low: Optional[torch.dtype]) -> None:
        if pid in partial:
            t = partial.pop(pid) + t
        left[pid] -= 1
        if left[pid]:
            partial[pid] = t
            return
        sq[pid] = sq_norms(t.reshape(t.shape[0], -1), 1)
        if check:
            probes.append(probed(plans[pid].name, t, batch.totals.get(pid), low or t.dtype))

    def project(pid: int, a: Tensor, g: Tensor, caps) -> None:
        low = next((cap.low for cap in caps if cap.low is not None), a.dtype)
        name = plans[pid].name
        transposed = caps[0].layer.rule.weight_transposed
        projections.append((name, projection_terms(name, a, g, batch.totals.get(pid),
                                                   transposed=transposed), low))

    done = set()
    for cap, unit in zip(batch.records, units):
        layer = cap.layer
        if unit and all(len(plans[id(layer.params[n])].entries) == 1 for n in cap.names):
            # G = S = 1 (Linear on (B, in)), used once: ||dW_n||^2 = ||a_n||^2 ||g_n||^2,
            # ||db_n||^2 = ||g_n||^2
            if unit == 2:  # the records are the canonical form already
                a, g = summed(cap)
            else:
                a, g = _canonical(cap, batch.batch_first)
                a, g = a.reshape(g.shape[0], -1), g.reshape(g.shape[0], -1)
            dt = a.dtype
            g_sq = torch.linalg.vecdot(g, g)
            for local in cap.names:
                pid = id(layer.params[local])
                done.add(pid)
                if local == "bias":
                    sq[pid] = g_sq
                    if check:
                        probes.append(probed(plans[pid].name, g, batch.totals.get(pid),
                                              cap.low or dt))
                else:
                    sq[pid] = torch.linalg.vecdot(a, a).mul_(g_sq)
                    if check:
                        project(pid, a[:, None, None], g[:, None, None], [cap])  # (N, 1, 1, .)
            continue
        rest = []
        for local in cap.names:
            pid = id(layer.params[local])
            kind = plans[pid].kind
            if kind == CLOSED and local == "bias":
                reduce(pid, _bias_grads(cap, batch.batch_first), cap.low)
            elif kind not in (GRAM, FORMS, ROWS, TIED):
                rest.append(local)
        if rest:
            out = call_grads(layer.rule, layer.module, cap.a, cap.grads_arg(), batch.batch_first,
                             rest, None)
            for local, t in out.items():
                reduce(id(layer.params[local]), t, cap.low)
    for pid, p in plans.items():
        if p.kind == FORMS:
            _forms_sq_norm(batch, p, forms, sq, probes, projections, check)
        elif p.kind == ROWS:
            r = forms.rows(p)
            sq[pid] = _rows_sq_norms(r, batch.size, batch.params[pid].shape[0])
            if check:
                probes.append(_rows_probed(batch, p, r))
        elif p.kind == TIED:
            sq[pid] = _tied_sq_norms(batch, p, forms, probes if check else None)
        if p.kind != GRAM or pid in done:
            continue
        calls = [_canonical(cap, batch.batch_first) for cap, _ in p.entries]
        if len(calls) == 1:
            a, g = calls[0]
        else:
            dt = compute_dtype(*(t for call in calls for t in call))
            a = torch.cat([c[0].to(dt) for c in calls], 2)
            g = torch.cat([c[1].to(dt) for c in calls], 2)
        sq[pid] = gram_sq_norms(a, g)
        if check:
            project(pid, a, g, [cap for cap, _ in p.entries])
    if probes:
        check_sums(probes, None)
    if projections:
        check_projections(projections)
    if check:
        batch.check_passed()
    return sq


def _forms_sq_norm(batch: Batch, p: PlannedParam, forms: Forms, sq, probes, projections, check: bool) -> None:
    """Squared per-sample norm of a parameter given in factored form: per row block the Gram
    form where :func:`use_gram` says it is cheaper, else the block materialised; sum checks:
    weight-like blocks on the random projection (their terms add up to the whole parameter's),
    bias-like blocks on the probes within their rows."""
    pid, name = p.pid, p.name
    low = next((cap.low for cap, _ in p.entries if cap.low is not None), None)
    total = batch.totals.get(pid) if check else None
    blocks = forms.blocks(p)
    if blocks is None:  # the calls' row blocks differ: materialise, as any other rule
        t = forms.materialised(p, batch.params[pid].shape)
        sq[pid] = sq_norms(t.reshape(t.shape[0], -1), 1)
        if check:
            probes.append(probed(name, t, total, low or t.dtype))
        return
    acc = None
    for b in blocks:
        if b.a is not None:  # weight-like: checked on the projection (blocks add up)
            a4, g4 = b.a.unsqueeze(1), b.g.unsqueeze(1)
            shared = forms.sharing(b.g)
            if use_gram(b.a.shape[1], b.a.shape[2], b.g.shape[2], shared, batch=b.a.shape[0]):
                if shared > 1:  # the grad_output's Gram matrix is formed once for its blocks
                    aa = b.a @ b.a.transpose(-1, -2)
                    part = aa.mul_(forms.gram(b.g)).view(aa.shape[0], -1).sum(1)
                else:
                    part = gram_sq_norms(a4, g4)
            else:
                part = sq_norms(weight_grad(a4, g4).view(b.g.shape[0], -1), 1)
            if check:
                projections.append((name, projection_terms(name, a4, g4, total, b.rows),
                                    low or a4.dtype))
        else:  # bias-like: on the probes within its rows
            t = b.g.sum(1)
            part = sq_norms(t, 1)
            if check:
                item = probed(name, t, total, low or t.dtype, b.rows)
                if item is not None:
                    probes.append(item)
        acc = part if acc is None else acc + part
    if acc is None:  # no block: a path of the layer no backward reached (norm 0)
        param = batch.params[pid]
        acc = torch.zeros(batch.size, dtype=compute_dtype(param), device=param.device)
    sq[pid] = acc


def _tied_sq_norms(batch: Batch, p: PlannedParam, forms: Forms, probes: Optional[list]) -> Tensor:
    """Squared per-sample norms of a :data:`TIED` weight, ``||R_n + L_n||^2 = ||R_n||^2 +
    ||L_n||^2 + 2 <R_n, L_n>``: the row scatter's norm (:func:`_rows_sq_norms`), the linear
    form's in the Gram form or materialised, whichever :func:`use_gram` finds cheaper, and the
    cross term :func:`tied_cross`; no ``(N, V, D)`` tensor in the Gram case. With ``probes`` a
    list, appends the sum-check item of both parts on the probe coordinates."""
    r = forms.rows(p)
    shape = batch.params[p.pid].shape
    a, g, pp, qq = tied_linear(batch, p)
    rows_sq = _rows_sq_norms(r, batch.size, shape[0])
    dt = compute_dtype(a, r.values)
    if use_gram(a.shape[2], a.shape[3], g.shape[3], batch=batch.size):
        lin_sq = gram_sq_norms(a, g)
    else:
        lin_sq = sq_norms(torch.bmm(pp.transpose(1, 2), qq).view(batch.size, -1), 1)
    sq = rows_sq.to(dt) + lin_sq.to(dt) + 2 * tied_cross(r, pp.to(dt), qq.to(dt))
    if probes is not None:
        name, rows_part, ref, low = _rows_probed(batch, p, r)
        idx = batch.totals[p.pid].probe_index()
        prow, pcol = idx // shape[1], idx % shape[1]
        lin_part = (pp.index_select(2, prow) * qq.index_select(2, pcol)).sum(1)  # (N, K)
        probes.append((name, rows_part.to(dt) + lin_part.to(dt), ref, low))
    return sq


def _rows(batch: Batch, p: PlannedParam) -> Rows:
    """The parameter's :class:`~gradhooks.forms.Rows` over all its calls (entries
    concatenated: calls of one table add up)."""
    parts = []
    for cap, local in p.entries:
        layer = cap.layer
        if not layer.rule.has_rows:  # the linear-form calls of a TIED weight
            continue
        parts.append(layer.rule.rows(layer.module, cap.a, cap.grads_arg(), batch.batch_first,
                                     [local])[local])
    if len(parts) == 1:
        return parts[0]
    dt = compute_dtype(*(r.values for r in parts))
    return Rows(torch.cat([r.sample for r in parts]), torch.cat([r.row for r in parts]),
                torch.cat([r.values.to(dt) for r in parts]))


def _rows_sq_norms(r: Rows, batch: int, num_rows: int) -> Tensor:
    """``(N,)`` squared per-sample norms of a row-scatter gradient (:class:`Rows`): the entries
    summed per ``(sample, row)`` pair (one sort of the ``E`` pair keys and an ``index_add``),
    then their squared norms summed per sample; ``O(E (D + log E))``, no ``(N, V, D)`` tensor."""
    key = r.sample * num_rows + r.row
    pairs, which = torch.unique(key, return_inverse=True)
    sums = r.values.new_zeros(pairs.shape[0], r.values.shape[1]).index_add_(0, which, r.values)
    return r.values.new_zeros(batch).index_add_(0, pairs // num_rows, sq_norms(sums, 1))


def _rows_probed(batch: Batch, p: PlannedParam, r: Rows) -> tuple:
    """The sum-check item (:func:`~gradhooks.checks.check_sums`) of a row-scatter parameter:
    its per-sample gradients at the probe coordinates ``(N, K)``, formed for the probed rows only
    (at most one per probe) instead of all ``V``."""
    total = batch.totals.get(p.pid)
    if total is None:
        raise no_total(p.name)
    shape = batch.params[p.pid].shape
    idx = total.probe_index()
    width = shape.numel() // shape[0]
    prow, pcol = idx // width, idx % width
    rows, slot = torch.unique(prow, return_inverse=True)  # the R probed rows
    pos = torch.full((shape[0],), -1, dtype=torch.long, device=idx.device)
    pos[rows] = torch.arange(rows.shape[0], device=idx.device)
    at = pos[r.row]
    keep = at >= 0
    n_rows = rows.shape[0]
    acc = r.values.new_zeros(batch.size * n_rows, r.values.shape[1])
    acc.index_add_(0, r.sample[keep] * n_rows + at[keep], r.values[keep])
    low = next((cap.low for cap, _ in p.entries if cap.low is not None), r.values.dtype)
    return p.name, acc.view(batch.size, n_rows, -1)[:, slot, pcol], total.probe_values(), low


def per_sample_grad_norms(recorder: Recorder, *, per_param: bool = False) -> Union[Tensor, Dict[str, Tensor]]:
    """L2 norms of the per-sample gradients over all trainable parameters the backward reached,
    without materialising them where a cheaper closed form exists.

    Args:
        recorder: the :class:`~gradhooks.capture.Recorder` of a
            :class:`~gradhooks.GradHooks` (called as ``gh.per_sample_grad_norms()``).
        per_param: if ``True`` return the norm of each parameter's per-sample gradient instead.

    Returns:
        ``(B,)``: ``||dtheta_n||_2`` over the concatenation of all trainable parameters the
        backward passes of this batch reached (frozen and unreached parameters contribute 0);
        ``dtheta_n`` is what :meth:`~gradhooks.GradHooks.per_sample_grads` returns for sample
        ``n`` (for ``loss_reduction="mean"`` the gradient of the sample's own loss, i.e. ``B``
        times the recorded one). With ``per_param=True``: ``{name: (B,)}`` in the order of
        ``model.named_parameters()`` (a tied parameter once). Dtype: the promoted dtype of the
        records, at least float32. Linear/Conv weights use the Gram form when cheaper (Li et al.
        2022, arXiv:2110.05679, sec. 4), other parameters are materialised one layer at a time;
        see the module docstring. Not cached: each call recomputes. After
        :meth:`~gradhooks.GradHooks.per_sample_grads` released the records (its default), the
        norms of its result.

    Raises:
        NoBackwardError: if no backward pass reached a hooked layer since the batch started.
        HigherOrderGradError: if a backward pass ran with ``create_graph=True`` through a hooked
            layer.
        GradientMismatchError: if a recorded input was modified in place, or (``check=True``)
            the per-sample gradients do not sum to autograd's gradient.
    """
    if recorder.released:  # per_sample_grads() formed the result and released the records
        sq_of = result_sq_norms(per_sample_grads(recorder))
        if per_param:
            return {name: t.sqrt_() for name, t in sq_of.items()}
        return add_up(sq_of.values()).sqrt_()
    batch = recorder.snapshot("per_sample_grad_norms()")
    if batch.size == 0:  # an empty (Poisson) batch
        empty = {batch.names[pid]: p.new_zeros(0, dtype=compute_dtype(p))
                 for pid, p in batch.params.items() if p.requires_grad}
        return empty if per_param else next(iter(empty.values()))
    plans, units = plan(batch)
    with no_autocast():
        sq = squared_norms(batch, plans, units, Forms(batch, plans))
    if per_param:
        return {p.name: sq[pid].sqrt().mul_(batch.factor) for pid, p in plans.items()}
    return add_up(sq.values()).sqrt_().mul_(batch.factor)


def result_sq_norms(grads: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """``{name: (B,)}`` squared L2 norms of materialised per-sample gradients ``(B, ...)``, in
    at least float32."""
    return {name: sq_norms(t.flatten(1).to(compute_dtype(t)), 1)
            for name, t in grads.items()}
