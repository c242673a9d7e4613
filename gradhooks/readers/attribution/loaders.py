"""Influence scores over data loaders: the passes of :mod:`gradhooks.readers.attribution.influence_scores` and
:class:`~gradhooks.readers.attribution.factor_fit.FactorFit` run batch by batch over a loader, with a
progress bar (kronfluence's ``fit_all_factors``, ``compute_pairwise_scores`` and
``compute_self_scores`` over its data sets; Grosse et al. 2023, arXiv:2308.03296, sec. 3).

Each batch is one forward and one backward of ``loss_fn(batch)``, the batch's loss reduced as
the hooks were attached (``loss_reduction="mean"``: a mean over the batch's samples, the
convention of :class:`~gradhooks.readers.attribution.factor_fit.FactorFit`); the hooks' records are read
and cleared after each batch, and ``param.grad`` is set to ``None`` (these passes are not
training). ``gh``: the :class:`~gradhooks.GradHooks` attached to the model ``loss_fn`` runs.
"""
from __future__ import annotations

import importlib
from typing import Callable, Iterable, Optional

import torch
from torch import Tensor

from ...base.errors import GradHooksError
from .factor_fit import FactorFit
from .influence_blocks import Preconditioner
from .influence_scores import QueryGradients, pairwise_scores, query_gradients, self_scores

__all__ = ["fit_factors", "query_gradients_over", "pairwise_scores_over", "self_scores_over"]


def _batches(loader: Iterable, progress: bool, what: str):
    if not progress:
        return loader
    try:
        tqdm = importlib.import_module("tqdm").tqdm
    except ImportError:  # (tqdm is optional: no bar without it)
        return loader
    return tqdm(loader, desc=what, leave=False)


def _backward(gh, loss_fn: Callable, batch) -> None:
    gh.clear()
    loss = loss_fn(batch)
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        raise GradHooksError(f"loss_fn(batch) must return the batch's scalar loss (reduced as "
                             f"loss_reduction says), got "
                             f"{tuple(loss.shape) if isinstance(loss, Tensor) else type(loss)}")
    loss.backward()


def _done(gh) -> None:
    gh.clear()
    gh.model.zero_grad(set_to_none=True)


def fit_factors(gh, loader: Iterable, loss_fn: Callable, *, strategy: str = "ekfac",
                all_layers: bool = True, fit: Optional[FactorFit] = None,
                progress: bool = True) -> FactorFit:
    """Fit KFAC / EKFAC factors over ``loader``: the covariance pass, the eigendecomposition
    and (``strategy="ekfac"``) the eigenvalue-correction pass, as kronfluence's
    ``fit_all_factors``.

    Args:
        gh: the attached hooks; loader: batches; loss_fn: ``loss_fn(batch) -> scalar loss``.
        strategy: ``"ekfac"`` (two passes) or ``"kfac"`` (one).
        all_layers: add ``gh.kfac_factors()`` for the layers without canonical records
            (embeddings, attention, recurrent, norms); ``False``: Linear / Conv / ``Conv1D``
            only (kronfluence's coverage).
        fit: a :class:`FactorFit` to add to (default: a new one).
        progress: a tqdm bar per pass (if tqdm is installed).

    Returns:
        The :class:`FactorFit` (``.preconditioner(strategy)`` gives ``H^-1``; ``.save(path)``).

    Raises:
        ValueError: for an unknown strategy. GradHooksError: for a ``loss_fn`` that does not
        return a scalar, and the errors of :class:`FactorFit`.
    """
    if strategy not in ("ekfac", "kfac"):
        raise ValueError(f"strategy must be 'ekfac' or 'kfac', got {strategy!r}")
    fit = FactorFit() if fit is None else fit
    for batch in _batches(loader, progress, "covariances"):
        _backward(gh, loss_fn, batch)
        fit.add_covariances(gh.gradient_features(),
                            gh.kfac_factors(g_positions=fit.g_positions) if all_layers else None)
        _done(gh)
    if strategy == "ekfac":
        for batch in _batches(loader, progress, "eigenvalues"):
            _backward(gh, loss_fn, batch)
            fit.add_eigenvalues(gh.gradient_features())
            _done(gh)
    return fit


def query_gradients_over(gh, loader: Iterable, loss_fn: Callable, pre: Preconditioner, *,
                         progress: bool = True) -> QueryGradients:
    """``H^-1 q_m`` of every query sample of ``loader`` (:func:`query_gradients` per batch,
    joined along the samples): ``M`` the loader's samples, each block ``(M, D)``.

    Raises:
        GradHooksError: for an empty loader, or batches whose blocks differ.
    """
    parts = []
    for batch in _batches(loader, progress, "queries"):
        _backward(gh, loss_fn, batch)
        parts.append(query_gradients(gh.gradient_features(), pre))
        _done(gh)
    if not parts:
        raise GradHooksError("query_gradients_over(): the query loader gave no batch")
    keys = list(parts[0].grads)
    if any(list(p.grads) != keys for p in parts):
        raise GradHooksError("query_gradients_over(): the query batches reached different "
                             "blocks (layers); use batches that run the same layers")
    return QueryGradients(sum(p.size for p in parts), pre,
                          {k: torch.cat([p.grads[k] for p in parts]) for k in keys},
                          parts[0].kinds)


def pairwise_scores_over(gh, query_loader: Iterable, train_loader: Iterable, loss_fn: Callable,
                         pre: Preconditioner, *, per_token: bool = False,
                         progress: bool = True) -> Tensor:
    """Influence scores ``S[m, n] = q_m^T H^-1 g_n`` of every train sample of
    ``train_loader`` on every query sample of ``query_loader``: ``(M, N)`` (``(M, N, T)`` with
    ``per_token``), the train side from each batch's records (:func:`pairwise_scores`), never
    its ``(B, P)`` gradients; kronfluence's ``compute_pairwise_scores``.

    Raises:
        The errors of :func:`query_gradients_over` and :func:`pairwise_scores`.
    """
    query = query_gradients_over(gh, query_loader, loss_fn, pre, progress=progress)
    scores = []
    for batch in _batches(train_loader, progress, "train scores"):
        _backward(gh, loss_fn, batch)
        scores.append(pairwise_scores(query, gh.gradient_features(), pre, per_token=per_token))
        _done(gh)
    if not scores:
        return torch.zeros(query.size, 0)
    return torch.cat(scores, dim=1)


def self_scores_over(gh, loader: Iterable, loss_fn: Callable,
                     pre: Optional[Preconditioner] = None, *, progress: bool = True) -> Tensor:
    """Self-influence ``g_n^T H^-1 g_n`` of every sample of ``loader``: ``(N,)``
    (:func:`self_scores` per batch; kronfluence's ``compute_self_scores``)."""
    out = []
    for batch in _batches(loader, progress, "self scores"):
        _backward(gh, loss_fn, batch)
        out.append(self_scores(gh.gradient_features(), pre))
        _done(gh)
    return torch.cat(out) if out else torch.zeros(0)
