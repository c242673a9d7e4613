"""What a projected gradient store holds for each sample: the output function differentiated
(TRAK's margin), an elementwise transform of each per-sample gradient (LESS: Adam's update
direction) and the LoGra projection of the result, with the projection matrices drawn once.

Index conventions as :mod:`gradhooks.readers.gram`: ``n`` sample (``N``), ``c`` backward pass
(``C = 1`` here: loss / output gradients), ``g`` group, ``s`` weight-sharing position, ``i`` input
feature with the bias's ``1`` appended when the bias is covered (``I'``), ``o`` output feature.

* **TRAK's output function** (Park et al. 2023, arXiv:2303.14186, sec. 3 and App. E.1; traker's
  ``ImageClassificationModelOutput``): for classification the per-sample output is the margin
  ``f_n = log(p_n / (1 - p_n)) = z[n, y_n] - logsumexp_{c != y_n} z[n, c]`` of the correct class
  (:func:`trak_margins`), and the out-to-loss weight is ``Q_n = 1 - p_n``
  (:func:`trak_out_to_loss`). Differentiate ``trak_margins(...).sum()`` with
  ``attach(..., loss_reduction="sum")``: sample ``n``'s gradient is then ``grad f_n``.
* **LESS's optimizer transform** (Xia et al. 2024, arXiv:2402.04333, sec. 3.2 and App. A;
  ``less/data_selection/collect_grad_reps.py``, ``obtain_gradients_with_adam``): sample ``n``'s
  gradient ``g_n`` is replaced, entry by entry, by Adam's direction from the optimizer's
  moments ``m``, ``v`` (:class:`AdamDirection`)::

      m_n = b1 m + (1 - b1) g_n,   v_n = b2 v + (1 - b2) g_n**2,   d_n = m_n / sqrt(v_n + eps)

  (LESS's formula: ``eps`` inside the root, no bias correction; ``convention="adam"`` gives
  torch's next Adam step instead, ``m̂_n / (sqrt(v̂_n) + eps)`` with ``m̂ = m_n / (1 - b1^t)``,
  ``v̂ = v_n / (1 - b2^t)``, ``t`` the optimizer's step plus one). Nonlinear in ``g_n``: each
  layer's per-sample gradient is formed, a chunk of samples at a time
  (:data:`CHUNK_NUMEL`), transformed and projected by the *same* matrices as
  :func:`~gradhooks.readers.attribution.projections.project_features`::

      linear layers:  P_g d_n[g] P_a^T  (k_out, k_in) per group, d_n[g] in the (O, I') layout of [W b]
      other params:   R vec(d_n)        (k_in k_out,)

  so that the identity transform gives ``project_features``' output (:func:`project_batch`).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ...base.errors import GradHooksError
from ...base.registry import find_rule
from ...base.utils import no_autocast
from ..gram import GradientFeatures
from .projections import projection

__all__ = ["trak_margins", "trak_out_to_loss", "margin_output", "ProjectionCache",
           "GradientTransform", "Identity", "AdamDirection", "matrix_layout", "project_batch",
           "CHUNK_NUMEL", "CONVENTIONS"]

#: Per-sample gradients of one layer are formed at most this many entries at a time (the LESS
#: transform): 2**24 float32 entries, 64 MiB.
CHUNK_NUMEL = 1 << 24
#: Values of :class:`AdamDirection`'s ``convention``.
CONVENTIONS = ("less", "adam")


# ----------------------------------------------------------------------- TRAK's output function
def _check_logits(logits: Tensor, labels: Tensor, who: str) -> None:
    if logits.dim() != 2 or labels.dim() != 1 or labels.shape[0] != logits.shape[0]:
        raise GradHooksError(
            f"{who}: expected logits (B, C) and labels (B,), got {tuple(logits.shape)} and "
            f"{tuple(labels.shape)}; flatten a sequence's positions into the batch first")
    if logits.shape[1] < 2:
        raise GradHooksError(f"{who}: the margin needs at least 2 classes, got C = {logits.shape[1]}")
    if labels.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise GradHooksError(f"{who}: labels must be integer class indices, got {labels.dtype}")


def trak_margins(logits: Tensor, labels: Tensor) -> Tensor:
    """TRAK's classification output function: ``f_n = z[n, y_n] - logsumexp_{c != y_n} z[n, c]``
    ``= log(p_n / (1 - p_n))`` with ``p_n`` the softmax probability of the correct class (Park
    et al. 2023, arXiv:2303.14186, sec. 3, App. E.1; traker's ``ImageClassificationModelOutput.
    get_output``). Differentiable; ``trak_margins(...).sum()`` backpropagated with
    ``loss_reduction="sum"`` gives each sample's ``grad f_n``.

    Args:
        logits: ``(B, C)`` floating point, ``C >= 2``.
        labels: ``(B,)`` integer class indices.

    Returns:
        ``(B,)`` margins, dtype of ``logits``.

    Raises:
        GradHooksError: on shapes other than ``(B, C)`` / ``(B,)``, ``C < 2`` or float labels.
    """
    _check_logits(logits, labels, "trak_margins()")
    correct = logits.gather(1, labels[:, None])[:, 0]
    mask = torch.arange(logits.shape[1], device=logits.device) == labels[:, None]
    others = logits.masked_fill(mask, float("-inf"))
    return correct - others.logsumexp(1)


def trak_out_to_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """TRAK's out-to-loss weight ``Q_n = 1 - p_n = sigmoid(-f_n)`` (the derivative of the
    cross-entropy ``-log p_n`` with respect to the margin ``f_n``, up to sign; Park et al. 2023,
    sec. 3; traker's ``get_out_to_loss_grad``), detached.

    Args, Raises: as :func:`trak_margins`.

    Returns:
        ``(B,)`` in ``[0, 1]``, dtype of ``logits``.
    """
    _check_logits(logits, labels, "trak_out_to_loss()")
    return torch.sigmoid(-trak_margins(logits.detach(), labels))


def margin_output(model: nn.Module, batch: Sequence[Tensor]) -> Tuple[Tensor, Tensor]:
    """An ``output_fn`` for :meth:`~gradhooks.readers.attribution.gradient_store.GradientStore.fill` on
    ``(inputs, labels)`` batches of a classifier: ``(trak_margins(model(inputs), labels),
    trak_out_to_loss(...))``, ``(B,)`` each."""
    inputs, labels = batch[0], batch[1]
    logits = model(inputs)
    return trak_margins(logits, labels), trak_out_to_loss(logits, labels)


# ------------------------------------------------------------------------------ projections
class ProjectionCache:
    """The matrices of :func:`~gradhooks.readers.attribution.projections.projection`, drawn once per
    ``(key, side, k, dim, dtype, device)`` and kept (a store projects every batch with them;
    drawing GPT-2's costs more than projecting). Same values as ``projection(...)``."""

    def __init__(self, seed: int):
        self.seed = seed
        self._mats: Dict[tuple, Tensor] = {}

    def get(self, key: str, side: str, k: int, dim: int, dtype: torch.dtype, device) -> Tensor:
        """``projection(key, side, k, dim, self.seed, dtype, device)``, ``(k, dim)``."""
        tag = (key, side, k, dim, dtype, str(device))
        mat = self._mats.get(tag)
        if mat is None:
            mat = self._mats[tag] = projection(key, side, k, dim, self.seed, dtype, device)
        return mat


# ------------------------------------------------------------------- LESS's optimizer transform
class GradientTransform:
    """An elementwise transform of each sample's gradient, applied before the projection.

    Subclasses implement :meth:`__call__`. ``params`` are the parameters a block covers (the
    weight and / or bias of a linear layer, one parameter otherwise) and ``layout`` maps a list
    of tensors shaped as those parameters (optimizer state) to the block's layout, without the
    sample dim: ``(G, O, I')`` for a linear layer (:func:`matrix_layout`), the parameter's own
    shape otherwise.
    """

    def __call__(self, key: str, grads: Tensor, params: List[nn.Parameter],
                 layout: Callable[[List[Tensor]], Tensor]) -> Tensor:  # pragma: no cover
        raise NotImplementedError


class Identity(GradientTransform):
    """No transform: ``d_n = g_n`` (for checking the materialised path against the factored one)."""

    def __call__(self, key, grads, params, layout):
        return grads


class AdamDirection(GradientTransform):
    """LESS's per-sample Adam direction from an ``torch.optim.Adam`` / ``AdamW`` state (module
    docstring; Xia et al. 2024, arXiv:2402.04333, App. A; LESS's ``obtain_gradients_with_adam``
    with its ``prepare_optimizer_state``).

    Args:
        optimizer: the optimizer after at least one step, holding ``exp_avg``, ``exp_avg_sq``
            and ``step`` for every parameter the store covers; ``betas`` and ``eps`` are read
            from each parameter's group (LESS hard-codes ``(0.9, 0.999)`` and ``1e-8``, torch's
            defaults). ``amsgrad`` is not supported.
        convention: ``"less"`` (default): ``m_n / sqrt(v_n + eps)``, no bias correction, as
            LESS; ``"adam"``: ``m̂_n / (sqrt(v̂_n) + eps)`` with torch's bias correction at
            step ``t + 1``. Weight decay (AdamW's decoupled term, Adam's L2 term) is not part
            of the direction, as in LESS.

    Raises:
        GradHooksError: on an unknown ``convention``, an optimizer with ``amsgrad=True``, or
            (when called) a parameter without ``exp_avg`` / ``exp_avg_sq`` state (the optimizer
            has not stepped it: run the optimizer first, or freeze the parameter).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, convention: str = "less"):
        if convention not in CONVENTIONS:
            raise GradHooksError(f"AdamDirection: convention must be one of {CONVENTIONS}, got "
                                 f"{convention!r}")
        self.optimizer, self.convention = optimizer, convention
        self._group = {}
        for group in optimizer.param_groups:
            if group.get("amsgrad", False):
                raise GradHooksError("AdamDirection: amsgrad=True is not supported (LESS uses "
                                     "plain Adam / AdamW moments)")
            if "betas" not in group or "eps" not in group:
                raise GradHooksError(f"AdamDirection: {type(optimizer).__name__} has no betas / eps: "
                                     f"pass a torch.optim.Adam or AdamW")
            for p in group["params"]:
                self._group[id(p)] = group
        self._cache: Dict[str, tuple] = {}

    def state(self, key: str, params: List[nn.Parameter], layout, dtype, device):
        """``(m, v, b1, b2, eps, t)`` of a block in its layout (cached per key and dtype):
        the moments before this sample, the group's betas and eps, and the step ``t`` the
        bias correction of ``convention="adam"`` uses (the optimizer's step plus one)."""
        hit = self._cache.get(key)
        if hit is not None and hit[0].dtype == dtype:
            return hit
        ms, vs, steps = [], [], set()
        for p in params:
            st = self.optimizer.state.get(p, {})
            if "exp_avg" not in st or "exp_avg_sq" not in st or id(p) not in self._group:
                raise GradHooksError(
                    f"AdamDirection: the optimizer holds no exp_avg / exp_avg_sq for {key!r} "
                    f"(shape {tuple(p.shape)}): step the optimizer on it first, or set "
                    f"requires_grad=False on it so the store leaves it out")
            ms.append(st["exp_avg"])
            vs.append(st["exp_avg_sq"])
            steps.add(int(st.get("step", 0)) + 1)
        groups = [self._group[id(p)] for p in params]
        if any((grp["betas"], grp["eps"]) != (groups[0]["betas"], groups[0]["eps"]) for grp in groups):
            raise GradHooksError(f"AdamDirection: the parameters of {key!r} sit in optimizer "
                                 f"groups with different betas / eps")
        b1, b2 = (float(b) for b in groups[0]["betas"])
        out = (layout(ms).to(dtype=dtype, device=device), layout(vs).to(dtype=dtype, device=device),
               b1, b2, float(groups[0]["eps"]), max(steps))
        self._cache[key] = out
        return out

    def __call__(self, key, grads, params, layout):
        m, v, b1, b2, eps, t = self.state(key, params, layout, grads.dtype, grads.device)
        m_n = b1 * m + (1 - b1) * grads
        v_n = b2 * v + (1 - b2) * grads.square()
        if self.convention == "adam":  # torch's Adam direction at step t (bias-corrected)
            return (m_n / (1 - b1 ** t)) / ((v_n / (1 - b2 ** t)).sqrt() + eps)
        return m_n / (v_n + eps).sqrt()  # LESS: eps inside the root, no bias correction


def matrix_layout(module: nn.Module, path: str, names: List[str], groups: int, d_out: int,
                  d_in: int) -> Callable[[List[Tensor]], Tensor]:
    """The map from tensors shaped as the layer's covered parameters (``names``: ``"weight"``
    and / or ``"bias"``, in that order) to the ``(G, O, I')`` layout of ``[W b]`` the canonical
    form uses (:mod:`gradhooks.readers.canonical`: ``W[g] = weight.view(G, O, I)[g]``, or
    ``weight.T``-like for a rule with ``weight_transposed``: ``Conv1D``, transposed convs).

    Raises:
        GradHooksError: if the sizes do not add up to ``I'`` (a layer this store cannot lay out).
    """
    rule = find_rule(module, path)
    transposed = bool(getattr(rule, "weight_transposed", False))
    sizes = {n: getattr(module, n).numel() for n in names}
    expect = (sizes.get("weight", 0) // (groups * d_out)) + ("bias" in names)
    if expect != d_in or ("weight" in names and sizes["weight"] % (groups * d_out)):
        raise GradHooksError(
            f"GradientStore: cannot lay out the optimizer state of {path!r} "
            f"({type(module).__name__}, parameters {names}) as its (G={groups}, O={d_out}, "
            f"I'={d_in}) gradient matrix: freeze it or use transform=None")

    def layout(tensors: List[Tensor]) -> Tensor:
        parts = []
        for name, t in zip(names, tensors):
            if name == "weight":
                if transposed:  # (G * I, O, *K) -> (G, O, I * K)
                    t = t.reshape(groups, t.shape[0] // groups, d_out, -1).transpose(1, 2)
                parts.append(t.reshape(groups, d_out, -1))
            else:
                parts.append(t.reshape(groups, d_out, 1))
        return torch.cat(parts, -1) if len(parts) > 1 else parts[0]

    return layout


def _covered(module: nn.Module) -> List[str]:
    # The parameters a linear entry covers: its trainable weight and / or bias (the features'
    # ones column stands for the bias; with a frozen weight the entry is the bias alone).
    return [n for n in ("weight", "bias")
            if isinstance(getattr(module, n, None), nn.Parameter) and getattr(module, n).requires_grad]


# ------------------------------------------------------------------------------- projection
def project_batch(features: GradientFeatures, k_in: int, k_out: int, seed: int = 0, *,
                  transform: Optional[GradientTransform] = None, model: Optional[nn.Module] = None,
                  cache: Optional[ProjectionCache] = None, chunk_numel: int = CHUNK_NUMEL) -> Tensor:
    """``(B, K)`` projected per-sample gradients of one batch, optionally transformed
    elementwise before the projection (module docstring).

    ``transform=None``: the factored LoGra form, equal to
    :func:`~gradhooks.readers.attribution.projections.project_features` (the matrices cached in ``cache``).
    With a transform: each linear layer's per-sample ``(G, O, I')`` matrices are formed
    ``max(1, chunk_numel // (G O I'))`` samples at a time, transformed, and projected as
    ``P_g d_n P_a^T``; the other parameters' per-sample gradients are transformed and
    projected by ``R``. Columns in ``project_features``' order.

    Args:
        features: :func:`~gradhooks.readers.gram.gradient_features` of the batch (one backward
            pass: loss or output gradients).
        k_in, k_out, seed: as :func:`~gradhooks.readers.attribution.projections.project_features`.
        transform: a :class:`GradientTransform` (:class:`AdamDirection`), or ``None``.
        model: the model the features come from (needed with a transform: its modules and
            parameters give the optimizer state's layout).
        cache: a :class:`ProjectionCache` of ``seed`` to reuse across batches.
        chunk_numel: bound on the per-sample entries formed at once.

    Returns:
        ``(B, K)`` in the features' dtype.

    Raises:
        ValueError: if ``k_in`` or ``k_out`` is below 1.
        GradHooksError: with a transform, for features of several backward passes (Jacobians),
            without ``model``, or a layer whose state cannot be laid out (:func:`matrix_layout`).
    """
    if k_in < 1 or k_out < 1:
        raise ValueError(f"k_in and k_out must be positive, got {k_in}, {k_out}")
    cache = cache or ProjectionCache(seed)
    if cache.seed != seed:
        raise GradHooksError(f"project_batch(): the cache holds seed {cache.seed}, not {seed}")
    if transform is not None:
        if features.passes != 1:
            raise GradHooksError("project_batch(): a transform needs loss / output gradients "
                                 f"(one backward pass), got {features.passes} passes")
        if model is None:
            raise GradHooksError("project_batch(): pass model= with a transform (the optimizer "
                                 "state is looked up by its parameters)")
    parts = []
    with no_autocast():
        for path, e in features.linear.items():
            a, g = e.a, e.g  # (N, G, S, I'), (C, N, G, S, O)
            pa = cache.get(path, "a", k_in, a.shape[-1], a.dtype, a.device)
            pg = cache.get(path, "g", k_out, g.shape[-1], g.dtype, g.device)
            if transform is None:
                ap, gp = a @ pa.t(), g @ pg.t()
                t = (gp[..., 0, :, None] * ap[:, :, 0, None, :] if a.shape[2] == 1
                     else gp.transpose(-1, -2) @ ap)  # (C, N, G, ko, ki)
            else:
                t = _transformed_linear(path, a, g[0], pa, pg, transform, model, chunk_numel)[None]
            parts.append(t.flatten(2))
        params = dict(model.named_parameters()) if model is not None else {}
        for name, t in features.dense.items():
            flat = t.flatten(2)  # (C, N, numel)
            if transform is not None:
                p = params[name]
                flat = transform(name, t[0], [p], lambda ts: ts[0]).flatten(1)[None]
            r = cache.get(name, "dense", k_in * k_out, flat.shape[-1], flat.dtype, flat.device)
            parts.append(flat @ r.t())
    if not parts:
        raise GradHooksError("project_batch(): the features hold no parameter")
    out = torch.cat(parts, -1).transpose(0, 1)  # (N, C, K)
    return out[:, 0] if features.passes == 1 else out


def _transformed_linear(path, a, g, pa, pg, transform, model, chunk_numel) -> Tensor:
    # a (N, G, S, I'), g (N, G, S, O) -> (N, G, ko, ki): per chunk of samples the (G, O, I')
    # matrices sum_s g a^T, transformed, then P_g d P_a^T.
    n, groups, _, d_in = a.shape
    d_out = g.shape[-1]
    module = model.get_submodule(path)
    names = _covered(module)
    layout = matrix_layout(module, path, names, groups, d_out, d_in)
    params = [getattr(module, name) for name in names]
    step = max(1, chunk_numel // max(1, groups * d_out * d_in))
    out = a.new_empty(n, groups, pg.shape[0], pa.shape[0])
    for lo in range(0, n, step):
        mats = torch.einsum("ngso,ngsi->ngoi", g[lo:lo + step], a[lo:lo + step])
        d = transform(path, mats, params, layout)
        out[lo:lo + step] = pg @ d @ pa.t()
    return out
