"""A laplace-torch backend (laplace-torch 0.3, Daxberger et al. 2021, arXiv:2106.14806):
:class:`GradHooksGGN` (``GGNInterface``) and :class:`GradHooksEF` (``EFInterface``)::

    from laplace import Laplace
    from gradhooks.integrations.laplace_backend import GradHooksGGN
    la = Laplace(model, "classification", subset_of_weights="all",
                 hessian_structure="kron", backend=GradHooksGGN)
    la.fit(train_loader)

Importing this module imports laplace-torch (an optional dependency: ``pip install
gradhooks[laplace]``); ``import gradhooks`` does not.

Conventions are laplace-torch's (``laplace/curvature/curvature.py``): the loss is
``lossfunc(f, y)`` with ``reduction="sum"`` (``CrossEntropyLoss`` for classification,
``MSELoss`` for regression) and every curvature and loss is multiplied by ``factor`` (1 for
classification, 1/2 for regression: ``N(f, 1)`` from ``MSELoss``). So the GGN is
``sum_n J_n^T H_n J_n`` with ``H_n`` the Hessian of the negative log-likelihood.
The Jacobians are ``(B, C, P)`` over the trainable parameters of the model (of
``model.last_layer`` for last-layer Laplace) in ``parameters()`` order. Kronecker factors
(:class:`laplace.utils.Kron`, one block per parameter in ``parameters()`` order) follow
laplace's curvlinops backend: per module with a bias ``[G, A]`` for the weight (``[A, G]`` for a
weight stored ``(in, out)``: embeddings, ``Conv1D``) and ``[G]`` for the bias; a single dense
block for diagonal blocks (norm layers, the fallback: ``diag_embed``) and for layouts two
factors cannot hold (transposed convolutions, grouped factors) (``A`` the input covariance without the
bias's ones, mean over the batch, rescaled by ``M / N`` for a batch of ``M`` of ``N`` data
points; ``G`` the gradient covariance of the summed loss), from
:func:`gradhooks.kfac` (``fisher="type-2"``, or ``"mc"`` with ``stochastic=True``,
``"empirical"`` for :class:`GradHooksEF`).

Where gradhooks computes it: ``jacobians`` (:func:`~gradhooks.readers.jacobians.per_sample_jacobians`,
``C`` backward passes), ``gradients`` (per-sample gradients), ``diag`` (the GGN diagonal from
``C`` backward passes, :func:`~gradhooks.readers.curvature.ggn.ggn_diag`; the EF diagonal in closed form),
``full`` (``V^T V`` from the GGN's square root, :func:`~gradhooks.readers.curvature.ggn.ggn_sqrt`; ``G^T G`` for
the EF), ``kron``. ``jacobians(enable_backprop=True)`` (differentiable Jacobians, used by
laplace's ``enable_backprop`` option) attaches with ``differentiable=True`` and reads with
``create_graph=True`` (:func:`~gradhooks.readers.jacobians.per_sample_jacobians`); a model with a layer
whose rule has no differentiable path (recurrent, attention, the fallback) goes to laplace's
torch.func implementation instead.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Tuple

import torch
from laplace.curvature import EFInterface, GGNInterface
from laplace.utils import Kron
from torch import Tensor, nn

from ..base.errors import GradHooksError
from ..fisher import kfac as _kfac_driver
from ..hooks import attach
from ..readers.curvature.kfac import DiagonalFactors

__all__ = ["GradHooksGGN", "GradHooksEF"]


class _GradHooksInterface:
    """What both backends share: attaching to the (last-layer) model for one call."""

    def _attach(self, reduction: str = "sum", differentiable: bool = False):
        # A fresh attach per call: laplace calls the backend from fit() and from predictive
        # code, and hooks left on the model would record every later forward.
        return attach(self._model, loss_reduction=reduction, check=False,
                      differentiable=differentiable)

    def _flat(self, grads) -> Tensor:
        # dict {name: (..., *shape)} over self.params_dict's names -> (..., P), subnetwork applied
        lead = next(iter(grads.values())).dim() - next(iter(self.params_dict.values())).dim()
        flat = torch.cat([grads[n].flatten(lead) for n in self.params_dict], lead)
        if self.subnetwork_indices is not None:
            flat = flat[..., self.subnetwork_indices]
        return flat

    def _check_covered(self, gh) -> None:
        covered = set(gh.recorder.names[pid] for pid in gh.recorder.params)
        missing = [n for n in self.params_dict if n not in covered]
        if missing:
            raise GradHooksError(f"gradhooks hooks no rule for parameters {missing}")

    def jacobians(self, x, enable_backprop: bool = False) -> Tuple[Tensor, Tensor]:
        """``(Js (B, C, P), f (B, C))``: per-sample Jacobians of the model output
        (:func:`gradhooks.readers.jacobians.per_sample_jacobians`); with ``enable_backprop`` both keep
        their autograd graphs (``create_graph=True``), or come from laplace's torch.func version
        for a model with a layer whose rule has no differentiable path."""
        with torch.enable_grad(), self._attach(differentiable=enable_backprop) as gh:
            if enable_backprop and not all(layer.rule.differentiable
                                           for layer in gh.recorder.layers):
                js = None
            else:
                f = self.model(x)
                self._check_covered(gh)
                js = gh.per_sample_jacobians(f, create_graph=enable_backprop)
        if js is None:
            return GGNInterface.jacobians(self, x, enable_backprop=True)
        if enable_backprop:
            return self._flat(js), f
        return self._flat(js).detach(), f.detach()

    def gradients(self, x, y) -> Tuple[Tensor, Tensor]:
        """``(Gs (B, P), loss)``: per-sample gradients of ``lossfunc`` (summed), and the loss."""
        with torch.enable_grad(), self._attach() as gh:
            f = self.model(x)
            loss = self.lossfunc(f, y)
            gh.backward(loss)
            gs = gh.per_sample_grads()
        return self._flat(gs).detach(), loss.detach()

    def _kron(self, x, y, n_data: int, fisher: str, mc_samples: int = 1,
              kfac_approx: str = "expand") -> Tuple[Tensor, Kron]:
        wanted = [p for p in self._model.parameters() if p.requires_grad]
        if self.subnetwork_indices is not None:
            raise GradHooksError("kron: subnetwork Laplace has no Kronecker structure")
        model, inputs = self.model, x
        if self.last_layer and hasattr(self.model, "forward_with_features"):
            # (the last layer on the features: the passes need not run through the rest)
            with torch.no_grad():
                inputs = self.model.forward_with_features(x)[1]
            model = self._model
        prefix = _module_paths(model, self._model)
        factors = _kfac_driver(model, inputs, y, self.lossfunc, fisher=fisher,
                               mc_samples=mc_samples, kfac_approx=kfac_approx,
                               modules=None if prefix is None else [prefix])
        found = {}  # id(param) -> laplace block: [G, A] / [A, G] (transposed) / [dense]
        params = dict(model.named_parameters())
        rescale = len(y) / n_data
        for path, fac in factors.items():
            if prefix is not None and not (path == prefix or path.startswith(prefix + ".")):
                continue
            for name, block in _blocks(fac, rescale).items():
                found[id(params[name])] = block
        if set(found) != {id(p) for p in wanted}:
            raise GradHooksError(
                "kron: gradhooks has no factors for some trainable parameters of the model "
                "(frozen in part, or not reached by the forward); use hessian_structure='diag' "
                "or 'full'")
        blocks = [found[id(p)] for p in wanted]  # laplace's order: parameters()
        with torch.no_grad():
            loss = self.lossfunc(model(inputs), y)
        return self.factor * loss.detach(), Kron(blocks) * self.factor


def _blocks(fac, rescale: float) -> dict:
    # One KFAC entry as laplace's Kron blocks {param name: [factors]}, following laplace's
    # curvlinops backend: a weight ``[G, A * M/N]`` (the mean input covariance, rescaled so that
    # the sum over the batches of an epoch is the data set's mean), ``[A * M/N, G]`` for weights
    # stored transposed ((V, D) embeddings, Conv1D); a bias ``[G * A[-1, -1]]``. Blocks Kron
    # cannot hold as two factors in the parameter's own layout (grouped factors, a transposed
    # convolution's (C_in, C_out, *k), factors kept diagonal by max_dense) and diagonal blocks
    # (norm layers, the fallback) become one dense (P, P) matrix: ``dense()`` of the entry
    # restricted to the parameter (A rescaled as above), ``diag_embed`` of a diagonal block.
    if isinstance(fac, DiagonalFactors):
        return {n: [torch.diag_embed(d.reshape(-1))] for n, d in fac.diagonal.items()}
    out = {}
    plain = fac.groups == 1 and not fac.diagonal_G
    a, g = fac.A, fac.G
    if plain and fac.diagonal_A:  # an embedding's diagonal A: laplace's factors are dense
        a = torch.diag_embed(a)
    if fac.weight is not None:
        if plain and (not fac.weight_transposed or len(fac.weight_shape) == 2):
            a_w = a[:-1, :-1] if fac.bias is not None else a
            if a_w.numel() == g.numel() == 1:
                out[fac.weight] = [g * a_w]
            elif fac.weight_transposed:
                out[fac.weight] = [a_w * rescale, g]
            else:
                out[fac.weight] = [g, a_w * rescale]
        else:
            scaled = dataclasses.replace(fac, A=a * rescale, bias=None, bias_shape=None)
            if fac.bias is not None:  # drop the ones row / column of the bias
                scaled.A = (scaled.A[..., :-1] if fac.diagonal_A else scaled.A[..., :-1, :-1])
            out[fac.weight] = [scaled.dense()]
    if fac.bias is not None:
        if plain:
            out[fac.bias] = [g * a[-1, -1]]
        else:
            only = dataclasses.replace(fac, weight=None, weight_shape=None,
                                       A=a[..., -1:] if fac.diagonal_A else a[..., -1:, -1:])
            out[fac.bias] = [only.dense()]
    return out


def _module_paths(model: nn.Module, sub: nn.Module):
    # The path of ``sub`` inside ``model`` (None when it is the model itself).
    if sub is model:
        return None
    for path, m in model.named_modules():
        if m is sub:
            return path
    raise GradHooksError("the last layer is not a submodule of the model")


class GradHooksGGN(_GradHooksInterface, GGNInterface):
    """laplace-torch's ``GGNInterface`` through gradhooks (module docstring). ``stochastic``:
    the Monte-Carlo Fisher with ``num_samples`` sampled labels instead of the exact GGN."""

    def __init__(self, model: nn.Module, likelihood, last_layer: bool = False,
                 subnetwork_indices=None, dict_key_x: str = "input_ids",
                 dict_key_y: str = "labels", stochastic: bool = False, num_samples: int = 1):
        super().__init__(model, likelihood, last_layer, subnetwork_indices, dict_key_x,
                         dict_key_y, stochastic=stochastic, num_samples=num_samples)

    def _mc(self) -> int:
        return self.num_samples if self.stochastic else 0

    def full(self, x, y, **kwargs: Any) -> Tuple[Tensor, Tensor]:
        """``(factor * loss, factor * GGN (P, P))`` with ``GGN = V^T V`` (the square root of
        :func:`gradhooks.readers.curvature.ggn.ggn_sqrt`, ``C`` or ``num_samples`` backward passes)."""
        with torch.enable_grad(), self._attach() as gh:
            f = self.model(x)
            self._check_covered(gh)
            loss = self.lossfunc(f, y).detach()
            v = self._flat(gh.ggn_sqrt(f, self.lossfunc, mc_samples=self._mc()))
        v = v.reshape(-1, v.shape[-1])
        return self.factor * loss, self.factor * (v.t() @ v)

    def diag(self, x, y, **kwargs: Any) -> Tuple[Tensor, Tensor]:
        """``(factor * loss, factor * diag(GGN) (P,))`` (:func:`gradhooks.readers.curvature.ggn.ggn_diag`)."""
        with torch.enable_grad(), self._attach() as gh:
            f = self.model(x)
            self._check_covered(gh)
            loss = self.lossfunc(f, y).detach()
            d = self._flat(gh.ggn_diag(f, self.lossfunc, mc_samples=self._mc()))
        return self.factor * loss, self.factor * d

    def kron(self, x, y, N: int, **kwargs: Any) -> Tuple[Tensor, Kron]:
        """``(factor * loss, factor * Kron)``: KFAC of the exact GGN (type-2), or the MC Fisher
        with ``stochastic``; ``kfac_approx`` (``"expand"`` / ``"reduce"``) may be passed."""
        fisher = "mc" if self.stochastic else "type-2"
        return self._kron(x, y, N, fisher, self.num_samples if self.stochastic else 1,
                          kwargs.get("kfac_approx", "expand"))


class GradHooksEF(_GradHooksInterface, EFInterface):
    """laplace-torch's ``EFInterface`` through gradhooks: the empirical Fisher
    ``sum_n g_n g_n^T`` of the summed loss (module docstring)."""

    def full(self, x, y, **kwargs: Any) -> Tuple[Tensor, Tensor]:
        """``(factor * loss, factor * G^T G)`` from the ``(B, P)`` per-sample gradients."""
        gs, loss = self.gradients(x, y)
        return self.factor * loss, self.factor * (gs.t() @ gs)

    def diag(self, x, y, **kwargs: Any) -> Tuple[Tensor, Tensor]:
        """``(factor * loss, factor * sum_n g_n^2)`` without per-sample gradients for Linear
        layers (:func:`gradhooks.readers.curvature.ggn.empirical_fisher_diag`)."""
        with torch.enable_grad(), self._attach() as gh:
            f = self.model(x)
            self._check_covered(gh)
            loss = self.lossfunc(f, y)
            gh.backward(loss)
            d = self._flat(gh.empirical_fisher_diag())
        return self.factor * loss.detach(), self.factor * d

    def kron(self, x, y, N: int, **kwargs: Any) -> Tuple[Tensor, Kron]:
        """``(factor * loss, factor * Kron)`` of the empirical Fisher."""
        return self._kron(x, y, N, "empirical", 1, kwargs.get("kfac_approx", "expand"))
