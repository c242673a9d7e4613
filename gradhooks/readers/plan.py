"""The norm plan: per parameter, how its per-sample squared norm (and DP clipping's clipped sum)
is formed from the records, and :func:`squared_norms`, which forms the norms by that plan. Read
by :mod:`gradhooks.readers.norms` and :mod:`gradhooks.readers.dp.clipping`; tensors in, tensors out (the records'
canonical forms come from :mod:`gradhooks.readers.canonical`).

Index conventions as :mod:`gradhooks.readers.canonical`: ``n`` sample, ``g`` group, ``s``, ``t``
positions, ``i`` / ``o`` in / out features; ``g`` the recorded grad_output, UNSCALED here (the
readers multiply the norms by the own-loss scale, :attr:`~gradhooks.core.recorder.records.Batch.factor`).

**Kinds** (:func:`plan`): :data:`GRAM` and :data:`CLOSED` (a rule with a linear form: Gram-form
or materialised norm, closed-form clipped sum), :data:`FORMS` (factored forms, block by block),
:data:`ROWS` (row scatters), :data:`TIED` (a weight tied between row scatters and linear forms),
:data:`GENERIC` (materialised with the rule; a raw parameter whose per-sample gradient a record
holds as :class:`~gradhooks.base.segments.Segments`, a mixture of experts' weight, per
``(sample, expert)`` segment instead: :func:`factored`). The decisions depend only on the call
structure and are kept per structure (the recorder's :class:`~gradhooks.core.recorder.records.Memo`).

**Gram form** (Goodfellow 2015, arXiv:1510.01799, for ``S = 1``; Li et al. 2022, "Large language
models can be strong differentially private learners", ICLR, arXiv:2110.05679, sec. 4, the
"ghost norm", for ``S > 1``)::

    ||dW_n||^2 = sum_g sum_{s,t} (a[n,g,s] . a[n,g,t]) (g[n,g,s] . g[n,g,t])

costs ``N G S^2 (I + O)`` multiply-adds against ``N G S I O`` for materialising ``dW_n``; per
parameter the cheaper is used (:func:`use_gram`: that count plus a memory-traffic term, measured
in ``benchmarks/norm_cost.py`` on 42 Linear shapes: FLOPs alone 3-4 picks slower than the best,
up to 2.3x; with the bytes term 2, up to 1.1x, near ties). Measured (2 CPU cores, torch 2.13,
``N = 32``, medians, ms Gram / materialised, ratio ``S (I + O) / (I O)``): Linear 128x128 S=32
(0.5) 0.13 / 0.24, S=128 (2.0) 1.6 / 0.82; 512x512 S=128 (0.5) 6.6 / 23.6; Conv2d 3x3 128->128
on 8x8 (0.56) 21 / 33, on 12x12 (1.25) 44 / 41; 32->64 on 12x12 (2.75) 62 / 0.8 (a materialised
conv uses torch's weight-backward kernel, a Gram conv the unfolded patches, now where cheaper their
Gram matrix from the pixels, ``rules.conv.patch_gram``). Bias: ``||db_n||^2 = ||sum_s g[n,s]||^2``. A parameter of several calls concatenates the calls' positions (their cross
terms included). Factored forms (:class:`~gradhooks.base.forms.Block`) go block by block, each replay
run once for norms and clipped sum (:class:`Forms`); row scatters (:class:`~gradhooks.base.forms.Rows`)
per ``(sample, row)`` pair, no ``(N, V, D)`` tensor; a :data:`TIED` weight (GPT-2's embedding and
LM head) as ``||R_n + L_n||^2 = ||R_n||^2 + ||L_n||^2 + 2 <R_n, L_n>`` (:mod:`gradhooks.readers.scatters`).

**Samples of several rows** (``batch.groups``, :mod:`gradhooks.base.sample_groups`): the norm
is that of each sample's rows' summed gradient. Gram form: the rows of a sample joined as one
sample whose positions are all its rows' (:meth:`~gradhooks.base.sample_groups.SampleGroups.join_positions`,
zero rows padding the smaller samples; ``S`` then counts ``m S`` in :func:`use_gram`); row
scatters: the entries keyed by ``(sample, row)``; tied weights: both, and their cross term of
the joined forms; materialised parameters (factored forms too): the per-row tensors summed per
sample first (one ``index_add``). The clipped sums need nothing of this: the readers weigh each
row by its sample's factor.

**Checks** (``batch.check_key`` set: due): the per-sample gradients must sum to autograd's;
the norms declare the evidence (:class:`~gradhooks.readers.verify.Evidence`), judged by the caller:
materialised parameters on 256 probe coordinates (:func:`gradhooks.readers.verify.check_sums`),
Gram-form parameters on a fixed random rank-one projection computed from the records
(:func:`gradhooks.readers.verify.check_projections`, cost ``N G S (I + O)``).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from ..base.forms import Block, Rows, from_blocks, gram_sq_norms, sq_norms, weight_grad
from ..base.segments import Segments
from ..base.utils import compute_dtype, tensors
from ..core.recorder.records import Batch, Record
from .canonical import (
    call_grads,
    canonical,
    canonical_call,
    canonical_sizes,
    gram_form,
    gram_in_cost,
    identity_form,
    summed,
)
from .scatters import rows_of, rows_probed, rows_sq_norms, tied_cross, tied_linear
from .verify import Evidence, check_unrecorded, probed, projection_terms

__all__ = ["GRAM", "CLOSED", "FORMS", "ROWS", "TIED", "GENERIC", "MEMORY_BOUND", "BYTE_COST",
           "use_gram", "KEEP_OF_RECORDS", "keep_budget", "add_up", "PlannedParam", "plan",
           "Forms", "squared_norms", "result_sq_norms", "factored"]

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
             batch: int = 0, gram_in: Optional[int] = None) -> bool:
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
        gram_in: multiply-adds of ``a a^T`` per matrix where the rule forms it otherwise
            (:meth:`~gradhooks.base.registry.LayerRule.input_gram_cost`; ``None``: ``S^2 I``).

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
    gram = (s * s * i if gram_in is None else gram_in) + s * s * o / shared
    mat = s * i * o
    if batch * s * s * 4 > MEMORY_BOUND:
        gram += BYTE_COST * s * s * (1 + 1 / shared)
    if batch * i * o * 4 > MEMORY_BOUND:
        mat += BYTE_COST * i * o
    return gram < mat


#: Book-keeping clipping keeps materialised per-sample gradients for its clipped sum up to this
#: fraction of the bytes of the batch's recorded layer inputs (:func:`keep_budget`): plain
#: training holds at least those inputs at its peak (they are what its backward needs), so the
#: kept tensors add at most this fraction of that. In a convolutional network the materialised
#: (:data:`CLOSED`) weights are the early, large-``S`` convolutions with small weights, whose
#: weight-backward is the costliest to repeat per byte kept (``S`` multiply-adds per value):
#: ResNet-50 at 224 x 224 keeps all of them at about 17% of its records.
KEEP_OF_RECORDS = 0.25


def keep_budget(batch: Batch) -> int:
    """Bytes of per-sample gradients :class:`Forms` may keep for a clipped sum:
    :data:`KEEP_OF_RECORDS` of the bytes of the records' layer inputs."""
    total = sum(t.numel() * t.element_size() for cap in batch.records for t in tensors(cap.a))
    return int(KEEP_OF_RECORDS * total)


def add_up(parts) -> Optional[Tensor]:
    """Sum of the ``(N,)`` tensors ``parts`` (per-parameter squared norms), ``None`` if empty."""
    total = None
    for t in parts:
        if t is not None:
            total = t if total is None else total + t
    return total


class PlannedParam:
    """One trainable parameter the backward reached: its calls and how it is handled.

    Attributes:
        pid: ``id(param)``.
        name: its name in ``model.named_parameters()``.
        entries: ``[(record, local name)]``, every call of the batch that uses it, in the order
            reached (a layer called twice, a weight tied between layers: several).
        kind: :data:`GRAM`, :data:`CLOSED`, :data:`FORMS`, :data:`ROWS`, :data:`TIED` or
            :data:`GENERIC` (module docstring).
    """

    __slots__ = ("pid", "name", "entries", "kind")

    def __init__(self, pid: int, name: str):
        self.pid, self.name, self.entries, self.kind = pid, name, [], GENERIC


def plan(batch: Batch) -> Tuple[Dict[int, PlannedParam], Tuple[int, ...]]:
    """Decide per parameter how its norm and clipped sum are formed: ``{id(param):
    PlannedParam}`` in the order of ``model.named_parameters()``, for the records of ``batch``
    (which must hold every call of their parameters); and per record ``0``, or ``1`` if its rule
    has a linear form with ``G = S = 1`` (outer-product norms), ``2`` if that form is the records
    themselves (:func:`~gradhooks.readers.canonical.identity_form`: a Linear on ``(B, in)``).

    The decisions depend only on the batch size, on which layers were called with which
    parameters and on the grad_output shapes, so they are kept per such structure (in the
    recorder's :attr:`~gradhooks.core.recorder.records.Batch.memo`) and reused for the next batch of the same
    structure.

    Raises:
        GradientMismatchError: (``check`` on) a parameter autograd reached has no record.
    """
    caps = batch.records
    key = ("norm plan", batch.size, None if batch.groups is None else batch.groups.key,
           tuple((id(cap.layer), cap.names, (
        isinstance(cap.grads[0], Segments)) if cap.spec is not None
        else tuple(cap.grads[0].shape)) for cap in caps))
    template = batch.memo.get(key, lambda: _plan_template(batch))
    plans: Dict[int, PlannedParam] = {}
    for pid, kind, entries in template[0]:
        p = plans[pid] = PlannedParam(pid, batch.names[pid])
        p.kind, p.entries = kind, [(caps[i], local) for i, local in entries]
    check_unrecorded(batch, plans)
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
    sizes = {i: canonical_sizes(cap.layer, cap.grads[0], batch.batch_first) for i, cap in enumerate(caps)
             if cap.spec is None and cap.layer.rule.has_linear_form}
    groups = batch.groups  # (sample_ids: a sample's positions are all its rows' positions)
    most, samples = (1, batch.size) if groups is None else (groups.most, groups.count)
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
                    one = len(calls) == 1 and groups is None  # (its rule may form a a^T)
                    own = gram_in_cost(p.entries[0][0]) if one else None
                    if use_gram(most * sum(s for _, s, _, _ in calls), i, o,
                                batch=samples * grp, gram_in=own):
                        p.kind = GRAM
    units = tuple(0 if groups is not None or not (i in sizes and sizes[i][0] == 1 and sizes[i][1] == 1)
                  else 2 if identity_form(caps[i].layer, caps[i].a, caps[i].grads[0], batch.batch_first)
                  else 1
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


class Forms:
    """The factored forms (:meth:`~gradhooks.base.registry.LayerRule.forms`) of the calls of rules
    that have them, computed once per call (the rule's replay runs once for norms and clipped
    sum together) and dropped with this object.

    ``keep``: bytes of materialised per-sample gradients (:data:`CLOSED` and :data:`GENERIC`
    parameters, formed for their norms) that may be kept for the clipped sum that follows
    (:attr:`kept`, filled by :func:`squared_norms` in the order the parameters complete), so that
    it is one ``tensordot`` with the clipping factors instead of a second weight-gradient
    computation from the records (a convolution's weight-backward, a rule's replay); ``0`` for
    reads that clip nothing."""

    def __init__(self, batch: Batch, plans: Dict[int, "PlannedParam"], keep: int = 0):
        self.batch, self.plans, self.calls, self.joined = batch, plans, {}, {}
        self.keep = keep  # bytes left for kept per-sample gradients
        self.kept: Dict[int, Tensor] = {}  # id(param) -> its (N, *shape) per-sample gradient
        self.uses: Optional[Dict[tuple, int]] = None  # grad_output key -> weight-like blocks
        self.grams: Dict[tuple, Tuple[Tensor, Tensor]] = {}  # key -> (g, g g^T)
        self.scatters: Dict[int, Rows] = {}  # id(param) -> its row scatters (rows_of)

    def offer(self, pid: int, t: Tensor) -> None:
        """Keep ``t``, the ``(N, *shape)`` per-sample gradient of parameter ``pid`` (unscaled),
        for the clipped sum if it fits in the bytes left (:attr:`keep`)."""
        size = t.numel() * t.element_size()
        if size <= self.keep:
            self.kept[pid] = t
            self.keep -= size

    def rows(self, p: "PlannedParam") -> Rows:
        """The parameter's :class:`~gradhooks.base.forms.Rows` (:func:`~gradhooks.readers.scatters.rows_of`), formed once for
        norms and clipped sum."""
        if p.pid not in self.scatters:
            self.scatters[p.pid] = rows_of(self.batch, p)
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


def result_sq_norms(grads: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """``{name: (B,)}`` squared L2 norms of materialised per-sample gradients ``{name: (B,
    ...)}`` (:func:`gradhooks.readers.per_sample.per_sample_grads`' result), in at least float32 (the
    norms of a read whose records were released, and of clipping's ``"materialize"`` method)."""
    return {name: sq_norms(t.flatten(1).to(compute_dtype(t)), 1)
            for name, t in grads.items()}


def _bias_grads(cap: Record, batch_first: bool) -> Tensor:
    """Per-sample bias gradient ``(N, G O)`` of a linear-form call: ``sum_s g[n, g, s]``."""
    _, g = canonical(cap.layer, None, cap.summed_grad(), batch_first)
    n = g.shape[0]
    return g.reshape(n, -1) if g.shape[2] == 1 else g.sum(2).reshape(n, -1)


def squared_norms(batch: Batch, plans: Dict[int, PlannedParam], units: Tuple[int, ...],
                  forms: Forms, evidence: Evidence) -> Dict[int, Tensor]:
    """Squared per-sample norms of each parameter's gradient by its plan, declaring the sum
    check's evidence in ``evidence`` where it is due (module docstring); the caller judges it
    (:meth:`~gradhooks.readers.verify.Evidence.judge`) before it uses the norms.

    Args:
        batch: the snapshot (``N = batch.size`` samples, at least one).
        plans, units: :func:`plan` of ``batch``.
        forms: a :class:`Forms` of them (its factored forms and row scatters are kept for the
            clipped sum that may follow).
        evidence: the read's :class:`~gradhooks.readers.verify.Evidence`.

    Returns:
        ``{id(param): (N,)}`` UNSCALED (the gradients of the reduced loss restricted to sample
        ``n``: multiply the norms by :attr:`~gradhooks.core.recorder.records.Batch.factor` for the own-loss
        ones), in the promoted dtype of the records, at least float32.

    Raises:
        GradientMismatchError: (check due) a parameter has no autograd gradient to compare with.
    """
    sq: Dict[int, Tensor] = {}
    probes, projections, check = evidence.probes, evidence.projections, evidence.due
    groups = batch.groups  # sample_ids: norms per sample, of its rows' summed gradient
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
        forms.offer(pid, t)  # (per row: the clipped sum weighs rows by their sample's factor)
        if groups is not None:
            t = groups.sum_rows(t)
        sq[pid] = sq_norms(t.reshape(t.shape[0], -1), 1)
        if check:
            evidence.probe(pid, t, low or t.dtype)

    def project(pid: int, a: Tensor, g: Tensor, caps) -> None:
        low = next((cap.low for cap in caps if cap.low is not None), a.dtype)
        evidence.project(pid, a, g, low, transposed=caps[0].layer.rule.weight_transposed)

    done = set()
    for cap, unit in zip(batch.records, units):
        layer = cap.layer
        if unit and all(len(plans[id(layer.params[n])].entries) == 1 for n in cap.names):
            # G = S = 1 (Linear on (B, in)), used once: ||dW_n||^2 = ||a_n||^2 ||g_n||^2,
            # ||db_n||^2 = ||g_n||^2
            if unit == 2:  # the records are the canonical form already
                a, g = summed(cap)
            else:
                a, g = canonical_call(cap, batch.batch_first)
                a, g = a.reshape(g.shape[0], -1), g.reshape(g.shape[0], -1)
            dt = a.dtype
            g_sq = torch.linalg.vecdot(g, g)
            for local in cap.names:
                pid = id(layer.params[local])
                done.add(pid)
                if local == "bias":
                    sq[pid] = g_sq
                    if check:
                        evidence.probe(pid, g, cap.low or dt)
                else:
                    sq[pid] = torch.linalg.vecdot(a, a).mul_(g_sq)
                    if check:
                        project(pid, a[:, None, None], g[:, None, None], [cap])  # (N, 1, 1, .)
            continue
        rest = []
        for local in cap.names:
            pid = id(layer.params[local])
            kind = plans[pid].kind
            if groups is None and factored(cap, plans[pid]):  # (a grouped product's weight)
                seg = cap.grads[0]
                sq[pid] = seg.sq_norms()
                if check:
                    evidence.probe(pid, seg, cap.low or seg.dtype)
            elif kind == CLOSED and local == "bias":
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
            if groups is None:
                sq[pid] = rows_sq_norms(r, batch.size, batch.params[pid].shape[0])
            else:  # entries of a sample's rows: pairs (sample, row of the table)
                sq[pid] = rows_sq_norms(groups.regroup(r), groups.count,
                                        batch.params[pid].shape[0])
            if check:  # (the probes' rows as the other parameters': per sample)
                name, t, *rest = rows_probed(batch, p, r)
                probes.append((name, t if groups is None else groups.sum_rows(t), *rest))
        elif p.kind == TIED:
            sq[pid] = _tied_sq_norms(batch, p, forms, probes if check else None)
        if p.kind != GRAM or pid in done:
            continue
        aa = None  # (a a^T from the rule where it has one)
        if len(p.entries) == 1:
            a, aa, g = gram_form(p.entries[0][0], batch.batch_first, form_a=check,
                                 rule_gram=groups is None)
        else:
            calls = [canonical_call(cap, batch.batch_first) for cap, _ in p.entries]
            dt = compute_dtype(*(t for call in calls for t in call))
            a = torch.cat([c[0].to(dt) for c in calls], 2)
            g = torch.cat([c[1].to(dt) for c in calls], 2)
        if groups is not None:  # a sample's positions: all its rows' (zero rows padding)
            a, g = groups.join_positions(a, 2), groups.join_positions(g, 2)
        sq[pid] = gram_sq_norms(a, g, aa)
        if check:
            project(pid, a, g, [cap for cap, _ in p.entries])
    return sq


def factored(cap: Record, p: PlannedParam) -> bool:
    """Whether ``p`` (:data:`GENERIC`) is a raw parameter of this one record whose per-sample
    gradients are held as :class:`~gradhooks.base.segments.Segments` (a grouped product's
    weight): its norm and clipped sum are then formed from the rows, never the tensor."""
    return (p.kind == GENERIC and len(p.entries) == 1 and cap.spec is not None
            and len(cap.grads) == 1 and isinstance(cap.grads[0], Segments))


def _forms_sq_norm(batch: Batch, p: PlannedParam, forms: Forms, sq, probes, projections, check: bool) -> None:
    """Squared per-sample norm of a parameter given in factored form: per row block the Gram
    form where :func:`use_gram` says it is cheaper, else the block materialised; sum checks:
    weight-like blocks on the random projection (their terms add up to the whole parameter's),
    bias-like blocks on the probes within their rows."""
    pid, name = p.pid, p.name
    low = next((cap.low for cap, _ in p.entries if cap.low is not None), None)
    total = batch.totals.get(pid) if check else None
    blocks = forms.blocks(p)
    if blocks is None or (batch.groups is not None and blocks):
        # the calls' row blocks differ, or rows are summed per sample: materialise
        t = forms.materialised(p, batch.params[pid].shape)
        if batch.groups is not None:
            t = batch.groups.sum_rows(t)
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
        acc = torch.zeros(batch.samples, dtype=compute_dtype(param), device=param.device)
    sq[pid] = acc


def _tied_sq_norms(batch: Batch, p: PlannedParam, forms: Forms, probes: Optional[list]) -> Tensor:
    """Squared per-sample norms of a :data:`TIED` weight, ``||R_n + L_n||^2 = ||R_n||^2 +
    ||L_n||^2 + 2 <R_n, L_n>``: the row scatter's norm (:func:`~gradhooks.readers.scatters.rows_sq_norms`), the linear
    form's in the Gram form or materialised, whichever :func:`use_gram` finds cheaper, and the
    cross term :func:`~gradhooks.readers.scatters.tied_cross`; no ``(N, V, D)`` tensor in the Gram case. With ``probes`` a
    list, appends the sum-check item of both parts on the probe coordinates."""
    r = forms.rows(p)
    shape = batch.params[p.pid].shape
    a, g, pp, qq = tied_linear(batch, p)
    groups, n = batch.groups, batch.samples
    if groups is None:
        rn, an, gn, pn, qn = r, a, g, pp, qq
    else:  # a sample's rows as one sample: entries re-keyed, positions joined
        rn = groups.regroup(r)
        an, gn = groups.join_positions(a, 2), groups.join_positions(g, 2)
        pn, qn = groups.join_positions(pp, 1), groups.join_positions(qq, 1)
    rows_sq = rows_sq_norms(rn, n, shape[0])
    dt = compute_dtype(a, r.values)
    if use_gram(an.shape[2], an.shape[3], gn.shape[3], batch=n):
        lin_sq = gram_sq_norms(an, gn)
    else:
        lin_sq = sq_norms(torch.bmm(pn.transpose(1, 2), qn).view(n, -1), 1)
    sq = rows_sq.to(dt) + lin_sq.to(dt) + 2 * tied_cross(rn, pn.to(dt), qn.to(dt))
    if probes is not None:
        name, rows_part, ref, low = rows_probed(batch, p, r)
        idx = batch.totals[p.pid].probe_index()
        prow, pcol = idx // shape[1], idx % shape[1]
        lin_part = (pp.index_select(2, prow) * qq.index_select(2, pcol)).sum(1)  # (N, K)
        part = rows_part.to(dt) + lin_part.to(dt)
        terms = rows_part.to(dt).abs() + lin_part.to(dt).abs()  # (the tolerance's magnitude)
        if groups is not None:
            part, terms = groups.sum_rows(part), groups.sum_rows(terms)
        probes.append((name, part, ref, low, None, terms))
    return sq
