"""The KFAC reader: Kronecker factors of every layer linear in its weight (Linear, Conv,
ConvTranspose, Embedding, the projections of MultiheadAttention, the weights of LSTM / GRU / RNN
and their cells), and the exact diagonal block of every other layer (norms, the fallback).

Index conventions: ``n`` sample (``N`` of them, ``B`` for one process's batch), ``g`` group
(``G = 1`` except for grouped convolutions), ``r`` weight-sharing position (the positions ``s``
of every recorded call of the module: tokens of a Linear on ``(B, T, in)``, output pixels of a
convolution), ``i`` input feature (for a convolution: ``(c, k)``, an input channel of the group
and a kernel offset, ordered like ``weight[o].flatten()``), ``o`` output feature, ``p`` backward
pass.

Forward (the canonical form of :mod:`gradhooks.base.forms`)::

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
can be compared with it. ``g_positions="mean"`` (expand only) divides ``G[g]`` by the positions
per sample ``R`` (``G[g] = w/R sum_p sum_{n,r} e e^T``): kronfluence's convention (its
``TrackedLinear.get_flattened_gradient`` counts every token, and its gradient covariance is
divided by that count), so that with ``loss_reduction="mean"`` its ``gradient_covariance`` is
this ``G`` and its KFAC influence scores (``use_empirical_fisher=True``) are this ``A ⊗ G``'s;
under the default ``"sum"`` those scores are ``1/R`` of kronfluence's (``A ⊗ G`` is ``R``
times larger). ``R = 1`` without weight sharing: both conventions agree. With ``backward_passes="mean"`` (Monte-Carlo Fisher) ``G`` is divided
by the number of backward passes. With ``N = 1`` and ``R = 1`` (no weight sharing) ``A ⊗ G`` is
exactly the outer product of the sample's gradient (its empirical Fisher).

Where ``a`` and ``g`` come from: the rule's :meth:`~gradhooks.base.registry.LayerRule.kfac_form`
(Linear, Conv: their linear form; ``nn.ConvTranspose``: the inputs each *output* position sees,
so the output positions are the shared positions; ``nn.Embedding``: one-hot rows of the
indices, zero at ``padding_idx``, so ``A`` is diagonal for expand, ``A[v, v]`` the share of
index ``v`` among all positions, and stored as that diagonal), or the row blocks of its
:meth:`~gradhooks.base.registry.LayerRule.forms` (recurrent layers: the layer input, previous state
or cell output at every time step as ``a``, the replayed gate gradients as ``g``, i.e. the time
steps are weight-sharing positions, Martens, Ba & Johnson 2018, ICLR, "Kronecker-factored
curvature approximations for recurrent neural networks", sec. 3, with temporal independence;
attention: the tokens of the query / key / value and the gradients of their projections). A
forms rule's weight is paired with the bias named like it (``weight_ih_l0`` / ``bias_ih_l0``);
each pair is one entry keyed ``"<module>.<weight>"``.

Diagonal blocks (:class:`DiagonalFactors`), for layers with neither: ``w sum_p sum_n
(d l_n / d theta)^2`` from the per-sample gradients of each backward pass (the calls of a
module summed per sample first): the exact diagonal of the same Fisher / GGN block, with the
scale ``w`` placed as in ``G`` (divided by the passes for ``backward_passes="mean"``).

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

Where it lives: this module checks the options and reads the records (:func:`kfac_factors`);
the factor sums and their normalisation are :class:`gradhooks.readers.curvature.kfac_sums.KFACSums`'s, the result
types :mod:`gradhooks.readers.curvature.kfac_results`'s, and the ranks' all-reduce (``all_reduce=True``)
:meth:`gradhooks.readers.distributed.Ranks.all_reduce_kfac`'s.
"""
from __future__ import annotations

from typing import Dict, Iterable, Optional, Sequence

from ...base.errors import GradHooksError
from ...base.utils import no_autocast
from ...core.recorder.records import Batch, Layer
from .kfac_results import DiagonalFactors, KFACFactors
from .kfac_sums import KFACSums

__all__ = ["KFACFactors", "DiagonalFactors", "KFACSums", "kfac_factors", "check_options",
           "KFAC_APPROX", "COVERAGE", "G_POSITIONS", "check_choice", "check_g_positions"]

#: Values of ``kfac_approx``.
KFAC_APPROX = ("expand", "reduce")
_PASSES = ("sum", "mean")
#: Values of ``coverage``.
COVERAGE = ("all", "linear")
#: Values of ``g_positions``: ``G`` summed over the weight-sharing positions (curvlinops',
#: Eschenhagen et al. 2023's) or averaged over them (kronfluence's).
G_POSITIONS = ("sum", "mean")


def check_choice(name: str, value, choices: Sequence[str]) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def check_g_positions(kfac_approx: str, g_positions: str) -> None:
    """Raise ``ValueError`` for an unknown ``g_positions``, or ``"mean"`` with
    ``kfac_approx="reduce"`` (kronfluence's convention is defined for expand: it has no reduce)."""
    check_choice("g_positions", g_positions, G_POSITIONS)
    if g_positions == "mean" and kfac_approx != "expand":
        raise ValueError("g_positions='mean' (kronfluence's G, averaged over the tokens) is "
                         "defined for kfac_approx='expand' only; use g_positions='sum' with "
                         "'reduce'")


def _linear_layer(layer: Layer) -> bool:
    # coverage="linear": the layers with a linear form (Linear, Conv, Conv1D)
    return layer.rule.has_linear_form and not layer.rule.multi_io and "weight" in layer.params


def kfac_factors(
    batch: Batch,
    kfac_approx: str = "expand",
    *,
    backward_passes: str = "sum",
    modules: Optional[Iterable[str]] = None,
    max_dense: Optional[int] = None,
    all_reduce: bool = False,
    group=None,
    coverage: str = "all",
    g_positions: str = "sum",
) -> Dict[str, KFACFactors | DiagonalFactors]:
    """KFAC factors of every hooked layer the backward reached, and a diagonal block for the
    parameters no Kronecker factorisation fits.

    Which layers get what (formulas and conventions: the module docstring):

    * Kronecker factors ``A ⊗ G`` (:class:`KFACFactors`) for the layers linear in their
      weight: ``nn.Linear`` (and transformers' ``Conv1D``), ``nn.Conv1d/2d/3d`` (Martens &
      Grosse 2015, sec. 3; Grosse & Martens 2016, sec. 3), ``nn.ConvTranspose1d/2d/3d`` (the
      output positions as shared positions), ``nn.Embedding`` (one-hot inputs: ``A`` diagonal,
      the counts of each index), the projections of ``nn.MultiheadAttention`` (tokens as shared
      positions) and the input, hidden and projection weights of ``nn.LSTM`` / ``nn.GRU`` /
      ``nn.RNN`` and their cells (time steps as shared positions, the gate gradients the
      recurrent rule replays as ``g``: Martens, Ba & Johnson 2018, "Kronecker-factored
      curvature approximations for recurrent neural networks", ICLR, sec. 3, with the
      independence-across-time approximation of their option "V1"; Eschenhagen et al. 2023,
      sec. 3, for expand / reduce);
    * a diagonal block (:class:`DiagonalFactors`) ``w sum_p sum_n (d l_n / d theta)^2`` (the
      exact diagonal of the block, with ``G``'s scale ``w``) for every other layer: norms,
      ``nn.EmbeddingBag``, parametrized layers, the ``torch.func`` fallback.

    Computed in the recorded dtype, at least float32 (autocast captures are promoted).

    Args:
        batch: ``recorder.snapshot("kfac_factors()", sum_check=False)``, after one or more
            backward passes of the current batch (the records of the layers not wanted are
            left out here).
        kfac_approx: ``"expand"`` or ``"reduce"`` (Eschenhagen et al. 2023); identical for
            layers without weight sharing. (Diagonal blocks do not depend on it.)
        backward_passes: ``"sum"``: ``G`` sums ``e e^T`` over the backward passes (one pass
            with the loss: empirical Fisher; one pass per column of a square root of the loss
            Hessian: type-2 / GGN); ``"mean"``: divided by the number of backward passes
            (Monte-Carlo Fisher, one pass per sampled target). The same for diagonal blocks.
        modules: names of the modules wanted (default: all); e.g. to skip a huge layer.
        max_dense: factors of a larger dimension are computed and returned as their diagonal
            only (:attr:`KFACFactors.diagonal_A` / ``diagonal_G``), e.g. the
            ``(9217, 9217)`` input factor of a ``Linear(9216, 128)``. Default: all dense.
        all_reduce: sum the factors' numerators and counts over the processes of ``group``
            (``torch.distributed``), so that every rank holds the factors of the union of the
            ranks' batches: ``N`` is the total number of samples, and for ``"mean"`` the loss
            of the union is the mean over all of them. Every rank must call this.
        group: the ``torch.distributed`` process group (default: the world).
        coverage: ``"all"`` (default) or ``"linear"``: only the layers with a linear form
            (Linear, Conv, ``Conv1D``; the coverage before Embedding, ConvTranspose, attention,
            recurrent layers and diagonal blocks were added; EKFAC's).
        g_positions: ``"sum"`` (default: ``G`` sums ``e e^T`` over the weight-sharing
            positions, the papers' and curvlinops' KFAC-expand) or ``"mean"``: each
            Kronecker entry's ``G`` divided by its positions per sample ``R`` (tokens of a
            Linear on ``(B, T, in)``, output pixels of a convolution), kronfluence's
            convention: with ``loss_reduction="mean"`` its ``gradient_covariance`` and KFAC
            scores exactly (module docstring; docs/data-attribution.md). Expand only;
            diagonal blocks are not affected.

    Returns:
        ``{key: KFACFactors or DiagonalFactors}``, ordered by the first covered parameter in
        ``model.named_parameters()``. The key is the module's name when the module has one
        entry (Linear, Conv, ConvTranspose, Embedding, diagonal blocks); a module with several
        Kronecker blocks (attention, recurrent layers) has one entry per block, keyed
        ``"<module>.<first parameter>"``: ``"lstm.weight_ih_l0"`` (with ``bias_ih_l0``),
        ``"attn.in_proj_weight"`` (with ``in_proj_bias``), ``"attn.out_proj.weight"``,
        ``"attn.bias_k"``. A parameter tied between two modules appears in both entries.

    Raises:
        NoBackwardError: before any backward pass of the current batch.
        HigherOrderGradError: after a ``create_graph=True`` backward through a hooked layer.
        GradientMismatchError: if a recorded input was modified in place after its forward.
        GradHooksError: for a layer called on rows routed to it (a mixture of experts'
            ``nn.Linear`` expert: no positions per sample to average over); with
            ``all_reduce``, if no process group is initialised or the ranks
            hold different layers; if several backward passes reached a ``multi_io`` layer
            (embedding, attention, recurrent, fallback) whose records sum the passes (use
            :func:`gradhooks.kfac`, which reads each pass on its own); if calls of one
            attention module split its projections into different row blocks.
        ValueError: for an unknown ``kfac_approx`` / ``backward_passes`` / ``coverage`` /
            ``g_positions`` value or module name; for ``g_positions="mean"`` with
            ``kfac_approx="reduce"``.
    """
    check_choice("coverage", coverage, COVERAGE)
    check_g_positions(kfac_approx, g_positions)
    wanted = check_options(batch, kfac_approx, backward_passes, modules, max_dense, coverage)
    records = [cap for cap in batch.records if wanted(cap.layer)]
    routed = next((cap for cap in records if cap.swap is not None and cap.swap[0] == "routed"),
                  None)
    if routed is not None:  # (gradhooks.base.segments.routed_layout: rows padded per sample)
        raise GradHooksError(
            f"kfac_factors(): module {routed.layer.describe()} is called on rows routed to it "
            f"(a mixture of experts' expert: a different number of rows per sample), and KFAC's "
            f"A and G average over each sample's positions, which such rows do not have; leave "
            f"it out (modules=[...] without it), or use its per-sample gradients")
    # backward passes: one grad_output per pass in single-output captures (multi_io captures
    # hold one summed grad_output per output tensor instead)
    passes = max((len(cap.grads) for cap in batch.records if cap.spec is None), default=1)
    summed = [cap for cap in records if cap.spec is not None]
    if passes > 1 and summed:
        raise GradHooksError(
            f"kfac_factors(): {passes} backward passes reached the model, but module "
            f"{summed[0].layer.describe()} records their grad_outputs summed, and G needs each "
            f"pass's on its own. Use gradhooks.kfac(model, inputs, targets, loss_fn, fisher=...) "
            f"(it reads pass by pass), or read after each backward pass")
    sums = KFACSums(batch.size, batch.loss_reduction, batch.batch_first, batch.scale,
                    batch.names, kfac_approx, max_dense)
    with no_autocast():
        for p in range(passes):
            sums.add_pass(p, [
                (cap.layer, cap.a, cap.grad_struct() if cap.spec is not None else [cap.grads[p]],
                 cap.names)
                for cap in records if cap.spec is not None or p < len(cap.grads)])
        return sums.result(batch.order, passes, backward_passes, all_reduce, group, g_positions)


def check_options(source, kfac_approx: str, backward_passes: str,
                  modules: Optional[Iterable[str]], max_dense: Optional[int],
                  coverage: str = "all"):
    """Validate :func:`kfac_factors`' options; returns ``wanted(layer) -> bool``. ``source``:
    the :class:`~gradhooks.core.recorder.records.Batch` of the reader, or the recorder of the Fisher driver
    (:func:`gradhooks.fisher.kfac`): its hooked ``layers``.

    Raises:
        ValueError: for an unknown value or module name (the message lists the known ones).
    """
    check_choice("kfac_approx", kfac_approx, KFAC_APPROX)
    check_choice("backward_passes", backward_passes, _PASSES)
    if max_dense is not None and max_dense < 1:
        raise ValueError(f"max_dense must be a positive int or None, got {max_dense!r}")
    covered = (lambda layer: True) if coverage == "all" else _linear_layer
    if modules is None:
        return covered
    wanted = set(modules)
    known = {layer.path for layer in source.layers if covered(layer)}
    unknown = sorted(wanted - known)
    if unknown:
        raise ValueError(f"modules {unknown} are not hooked layers of the model"
                         f"{'' if coverage == 'all' else ' with a linear form'}; these are: "
                         f"{sorted(known)}")
    return lambda layer: layer.path in wanted and covered(layer)
