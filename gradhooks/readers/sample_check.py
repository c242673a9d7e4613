"""The sample check through the batched graph: a few samples' rows against autograd's gradient of
their own loss term, through the same batched forward (issue 38, point 2).

Where per-sample losses exist -- ``gh.clipped_backward(losses)`` with ``(B,)`` losses,
``gh.backward(losses, gradient)`` on a ``(B,)`` tensor, ``gh.backward(loss)`` on a loss whose graph
proves it ``.mean()`` / ``.sum()`` of a ``(B,)`` tensor (:func:`~gradhooks.core.analysis.backward_losses.split_of`,
the DP Trainer's book-keeping step) -- the contribution of sample ``n`` to the batch gradient is
``torch.autograd.grad`` of the root with its gradient masked to entry ``n`` (for a proven split:
the reduction node's input gradient masked, so the reduction's own ``1/B`` and the constant
factors above it stay). For a forward and a loss that keep samples apart that is row ``n`` of the
records (Goodfellow's ``g_n a_n^T``) to rounding; any op that pairs samples -- in the model, or in
the loss after it (an InfoNCE ``z @ z.T``, a sort over the batch, a batch statistic), known to
gradhooks' rules or not -- makes them differ. So the check is general where the separation
whitelist (:mod:`gradhooks.core.analysis.separation`) and the forward-alone check
(:mod:`gradhooks.core.analysis.alone`) see only the forward.

**What is compared.** Two things. (1) Per parameter, the norm of row ``n`` of the recorded
contributions (:func:`gradhooks.readers.plan.squared_norms`: the Gram form where cheaper, nothing
materialised) against the norm of autograd's gradient for that row, for rows ``0`` and ``N - 1``
(a named sample in the message); within :data:`~gradhooks.readers.verify.SAMPLE_CHECK_RTOL` of
the row's norm over all parameters. (2) Every row at once, where ``N > 2``: autograd's gradient
of ``sum_n w_n l_n`` through the batched forward against the records' sum ``sum_n w_n g_n``
(:func:`~gradhooks.readers.ghost_sums.ghost_sums`, one weight-gradient product per layer,
nothing materialised), the weights ``w`` a random permutation of ``N`` evenly spaced values in
``[-1, 1]``. For a separable forward the two are equal to rounding; rows that differ by ``d_n``
change it by ``sum_n w_n d_n``. The differences sum to zero over the rows (both sides add up to
the batch gradient), so equal weights would cancel them; distinct ones do not: two rows paired
symmetrically (``d_j = -d_i``) show ``(w_i - w_j) d_i``, at least ``2 / (N - 1)`` of ``d_i``. It
is compared within ``SAMPLE_CHECK_RTOL`` of ``sqrt(sum_n w_n^2 ||g_n||^2)``, the expected norm
of such a sum. Neither
sum is stored whole: each parameter's is sketched by :data:`PROBES` products ``u^T W z`` with
random Gaussian ``u``, ``z`` (``W`` the parameter's sum as ``(shape[0], -1)``;
``E (u^T W z)^2 = ||W||_F^2``, so a difference is seen at its own size, not diluted by the
parameter's dimension). Two-pass clipping's first pass forms the norms summed over the
parameters as it goes: there the totals are compared for (1), and each group of records adds
its sketches to (2) before it is dropped.

**When.** On the first backward of each structure (the forward's input signature, the form of
the loss, and whether ``sample_ids`` group rows) and on every :data:`EVERY`-th, whatever ``attach(..., check=...)`` says: ``check=False`` skips the sum check
only. ``attach(..., allow_sample_mixing=True)`` and ``allow_batchnorm_train=True`` (results
are declared contributions, not per-sample) and the loudly named ``attach(..., unsafe_skip_sample_check=True)`` skip it; so does a
multi-process run (``torch.distributed`` initialised with more than one rank: the extra
``autograd.grad`` passes would run DDP's / FSDP's collectives out of step).

**Cost**, once per structure: three backward passes through the batched graph without parameter
gradients kept (``autograd.grad`` w.r.t. the hooked parameters: rows ``0`` and ``N - 1`` and the
weighted sum), the weighted sums from the records (about one weight-gradient product per layer)
and, for ``gh.backward``, one norm read of the records (``benchmarks/separation.py`` measures it on GPT-2 small and ViT-B/16).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..base.utils import no_autocast, tf32_products
from ..core.analysis import split_of
from .ghost_sums import ghost_sums
from .plan import Forms, add_up, plan, squared_norms
from .verify import SAMPLE_CHECK_RTOL, Evidence, judge_sample_rows, judge_weighted_sums

__all__ = ["SampleCheck", "SAMPLE_CHECK_RTOL", "EVERY", "PROBES"]

_READ = "per_sample_grad_norms()"  # (the read the check is, for the batch's validation)

#: one backward in this many is checked whatever its structure (as the sum check's policy).
EVERY = 100


def _distributed() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


#: sketches ``u^T W z`` per parameter in the check of the weighted sum.
PROBES = 2

_SEED = 0x5A3C  # (the weights' and probes' generator: the same draws on every run)


def _mask(grad: Tensor, n: int) -> Tensor:
    # ``grad`` with every entry of dim 0 but ``n`` zeroed
    out = torch.zeros_like(grad)
    out[n] = grad[n]
    return out


def _weigh(grad: Tensor, weights: Tensor) -> Tensor:
    # ``grad`` with its entry n of dim 0 times weights[n]
    return grad * weights.to(grad.dtype).view(-1, *[1] * (grad.dim() - 1))


def _probes(shape: torch.Size, generator: torch.Generator) -> Tuple[Tensor, Tensor]:
    """``u: (PROBES, shape[0])`` and ``z: (PROBES, numel / shape[0])`` float64 Gaussians, on
    the CPU (a 0-dim parameter: one entry each)."""
    rows = shape[0] if len(shape) else 1
    cols = max(1, shape.numel() // max(rows, 1))
    return (torch.randn(PROBES, rows, dtype=torch.float64, generator=generator),
            torch.randn(PROBES, cols, dtype=torch.float64, generator=generator))


def _sketch(t: Tensor, probes: Tuple[Tensor, Tensor]) -> Tensor:
    """``(PROBES,)`` float64: ``u_k^T W z_k`` of ``t`` as ``W = (shape[0], -1)``, computed in
    float64 for float64 ``t`` and in float32 otherwise (its rounding, about ``1e-7`` of
    ``||W||_F``, is far inside ``SAMPLE_CHECK_RTOL``)."""
    u, z = probes
    dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
    w = t.detach().reshape(u.shape[1], z.shape[1]).to(dtype)
    u, z = u.to(device=t.device, dtype=dtype), z.to(device=t.device, dtype=dtype)
    return ((u @ w) * z).sum(1).double().cpu()


class SampleCheck:
    """The references of one backward's sample check, taken before the pass (the graph is
    alive), judged once the records' norms are formed.

    Build with :meth:`before`; then :meth:`judge_records` (after ``gh.backward``'s pass) or
    :meth:`judge_norms` (two-pass clipping's first-pass norms).

    Attributes:
        rows: the checked samples ``n``: ``0`` and ``N - 1``.
        ref: ``{id(param): (len(rows),)}`` squared norms of autograd's gradient of each row's
            contribution, float64.
        what: the loss in words, for the message.
        weights: ``(N,)`` the weights ``w_n`` of the weighted sum (float64, CPU), ``None``
            where ``N <= 2`` (the rows are all the samples).
        probes: ``{id(param): (u, z)}`` (:func:`_probes`); ``weighted``: ``{id(param):
            (PROBES,)}`` sketches of autograd's ``d(sum_n w_n l_n)/d(param)``; ``ours``: the
            same of the records' ``sum_n w_n g_n``, and ``spread``: their
            ``sum_n w_n^2 ||g_n||^2``, as :meth:`weigh` adds them.
    """

    def __init__(self, recorder, key: tuple, rows: List[int], ref: Dict[int, Tensor], what: str,
                 weights: Optional[Tensor] = None, probes: Optional[dict] = None,
                 weighted: Optional[Dict[int, Tensor]] = None):
        self.recorder, self.key, self.rows, self.ref, self.what = recorder, key, rows, ref, what
        self.weights, self.probes, self.weighted = weights, probes or {}, weighted or {}
        self.ours: Dict[int, Tensor] = {}
        self.spread = 0.0

    @staticmethod
    def form(recorder, root, gradient: Optional[Tensor], samples: int) -> Optional[tuple]:
        """``(node, what)`` where ``root`` holds per-sample losses the check can mask: ``(N,)``
        losses (``node`` ``None``), or a 0-dim mean / sum of them (its reduction's node, from
        :func:`~gradhooks.core.analysis.split_of`); ``None`` where it holds none."""
        if not isinstance(root, Tensor) or root.grad_fn is None or not samples:
            return None
        if root.dim() == 1 and root.shape[0] == samples:
            return None, "losses"
        if root.dim() == 0 and gradient is None:
            split = split_of(root.grad_fn, samples, recorder.grad_scaler is not None)
            if split is not None and split.proven and split.node is not None:
                return split.node, split.what
        return None

    @classmethod
    def before(cls, recorder, root: Tensor, gradient: Optional[Tensor], samples: int,
               found: object = "read") -> Optional["SampleCheck"]:
        """The references for the backward of ``root`` about to run, or ``None`` where the check
        is not due or not possible (no ``(N,)`` per-sample losses to mask, ``N`` = ``samples``).

        Args:
            recorder: the :class:`~gradhooks.core.recorder.capture.Recorder`.
            root: the tensor the pass starts from: ``(N,)`` per-sample losses, or a 0-dim loss.
            gradient: the pass's gradient for ``root`` (``None``: ones / 1).
            samples: ``N``: ``B``, or ``G`` with ``sample_ids``.
            found: :meth:`form` of ``root`` where the caller read it already (else read here).
        """
        if (not samples or samples < 2 or recorder.allow_sample_mixing or recorder.unsafe_skip_sample_check
                or recorder.options.get("allow_batchnorm_train")
                or _distributed() or not isinstance(root, Tensor) or root.grad_fn is None):
            return None
        if found == "read":
            found = cls.form(recorder, root, gradient, samples)
        if found is None:
            return None
        node, form = found
        key = (recorder.placement.signature, form, type(root.grad_fn).__name__,
               recorder.reads.groups(_READ) is not None)
        recorder.sample_checks += 1
        if (key in recorder.sample_checked and recorder.sample_checks % EVERY
                and not recorder.sum_check.changed):
            return None
        if recorder.records:
            return None  # (an earlier pass through this forward: its rows are in the records)
        params = [p for p in recorder.params.values() if p.requires_grad]
        if not params:
            return None
        rows = sorted({0, samples - 1})
        generator = torch.Generator().manual_seed(_SEED)
        weights = (None if samples <= len(rows) else torch.linspace(
            -1, 1, samples, dtype=torch.float64)[torch.randperm(samples, generator=generator)])

        def grads_of(change):
            # autograd's gradient of the root with its (or its reduction's) gradient changed
            if node is None:
                g = torch.ones_like(root) if gradient is None else gradient
                return torch.autograd.grad(root, params, change(g), retain_graph=True,
                                           allow_unused=True)
            handle = node.register_hook(lambda gi, go: (change(gi[0]),) + tuple(gi[1:]))
            try:
                return torch.autograd.grad(root, params, retain_graph=True, allow_unused=True)
            finally:
                handle.remove()

        sq: List[List[Tensor]] = []
        probes, weighted = {}, {}
        with recorder.muted():
            for n in rows:
                grads = grads_of(lambda g, n=n: _mask(g, n))
                # (the norm in the gradient's dtype, squared in float64: no float64 copy of a
                # large gradient; its rounding is far inside SAMPLE_CHECK_RTOL)
                sq.append([torch.zeros((), dtype=torch.float64, device=p.device) if g is None
                           else torch.linalg.vector_norm(g).double().square()
                           for p, g in zip(params, grads)])
            if weights is not None:
                grads = grads_of(lambda g: _weigh(g, weights.to(g.device)))
                for p, g in zip(params, grads):
                    probes[id(p)] = _probes(p.shape, generator)
                    weighted[id(p)] = (torch.zeros(PROBES, dtype=torch.float64) if g is None
                                       else _sketch(g, probes[id(p)]))
                del grads
        ref = {id(p): torch.stack([row[k] for row in sq]) for k, p in enumerate(params)}
        recorder.placement.mixing.judging = True  # (until the verdict: Mixing.checked)
        what = ("the per-sample losses" if node is None else f"the loss ({form})")
        return cls(recorder, key, rows, ref, what, weights, probes, weighted)

    def weigh(self, batch, plans: dict, forms: Forms, sq: Dict[int, Tensor]) -> None:
        """Add the sketches of the records' weighted sums ``sum_n w_n g_n`` of ``batch``'s
        parameters (:func:`~gradhooks.readers.ghost_sums.ghost_sums`, after the norms ``sq``
        ``{id(param): (N,)}`` were formed with ``plans`` and ``forms``, which it consumes) to
        :attr:`ours`, and their ``sum_n w_n^2 ||g_n||^2`` to :attr:`spread`; nothing where the
        check has no weighted sum."""
        if self.weights is None or not sq:
            return
        some = next(iter(sq.values()))
        weights = self.weights.to(some.device)
        self.spread += float(sum((t.double() * weights.square()).sum() for t in sq.values()))
        if batch.groups is not None:  # (sample_ids: each row weighs as its sample)
            weights = batch.groups.to_rows(weights)

        def assign(pid: int, t: Tensor) -> None:
            if pid in self.probes:
                self.ours[pid] = _sketch(t, self.probes[pid])

        ghost_sums(batch, plans, weights, assign, forms, into_grad=False)

    def judge_records(self) -> None:
        """Compare the records of the pass that just ran (their rows' norms per parameter,
        :func:`~gradhooks.readers.plan.squared_norms`, not scaled to the sample's own loss).

        Raises:
            SampleMixingError: as :meth:`_judge`.
        """
        batch = self.recorder.snapshot(_READ, sum_check=False)
        plans, units = plan(batch)
        with no_autocast(), tf32_products(batch.low):
            forms = Forms(batch, plans)
            sq = squared_norms(batch, plans, units, forms, Evidence(batch))
            self.weigh(batch, plans, forms, sq)
        ours = {pid: t.index_select(0, torch.tensor(self.rows, device=t.device)).double()
                for pid, t in sq.items()}
        self._judge(ours, batch.low)

    def judge_norms(self, sq: Tensor) -> None:
        """Compare ``(N,)`` squared norms summed over the parameters (two-pass clipping's first
        pass, of the same root and gradient as the references), and the weighted sums its
        groups of records added (:meth:`weigh`).

        Raises:
            SampleMixingError: as :meth:`_judge`.
        """
        rows = torch.tensor(self.rows, device=sq.device)
        ours = {0: sq.index_select(0, rows).double()}
        ref = add_up([t.to(sq.device) for t in self.ref.values()])
        self._judge(ours, None, {0: ref})

    def _judge(self, ours: Dict[int, Tensor], low, ref: Optional[Dict[int, Tensor]] = None
               ) -> None:
        # ours / ref: {key: (len(rows),) squared norms}, keyed by id(param), or 0 for the sum
        # over all parameters (``ref`` given); the verdict: verify.judge_sample_rows.
        dtype = low or next(iter(self.recorder.params.values())).dtype
        passed = False
        try:
            passed = judge_sample_rows(ours, self.ref if ref is None else ref, self.rows, dtype,
                                       self.recorder.names, self.what, summed=ref is not None)
            if self.weights is not None:
                passed = judge_weighted_sums(self.ours, self.weighted, self.spread, dtype,
                                             self.recorder.names, self.what) and passed
        finally:
            self.recorder.placement.mixing.checked(passed)  # (a changed structure verified)
        if passed:
            self.recorder.sample_checked.add(self.key)
