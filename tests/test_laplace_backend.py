"""The laplace-torch backend against laplace-torch's own curvlinops backend: marginal likelihood,
posterior precision and predictive probabilities for diag, kron and full Hessian structures
(all weights and last layer), on an MLP and a small CNN on scikit-learn's digits, in float64.

The reference for ``"full"`` is laplace's ASDL backend (exact in float64, like its BackPACK
backend and its torch.func GGNInterface.full): its curvlinops backend forms the dense matrix as
``linop @ torch.eye(P)`` with a float32 identity, so it carries float32 rounding (1e-8 relative).

laplace-torch imports torchmetrics, which imports torchvision; the torchvision wheel in some
environments (a CUDA build beside a CPU torch) fails at import on its C++ operators
("operator torchvision::nms does not exist") from ``torchvision._meta_registrations``. Neither
laplace nor these tests use torchvision, so an empty stand-in for that one submodule is put in
``sys.modules`` first; where torchvision imports cleanly the stand-in is unused (setdefault).
"""
import sys
import types

import pytest
import torch
from torch import nn

sys.modules.setdefault("torchvision._meta_registrations",
                       types.ModuleType("torchvision._meta_registrations"))
import curvlinops  # noqa: E402,F401  (laplace-torch's backend compared against)
import sklearn.datasets as sklearn  # noqa: E402
from laplace import Laplace  # noqa: E402
from laplace.curvature import AsdlEF, AsdlGGN, CurvlinopsEF, CurvlinopsGGN  # noqa: E402

from gradhooks.integrations.laplace_backend import GradHooksEF, GradHooksGGN  # noqa: E402


def _digits(n_train=48, n_test=16):
    d = sklearn.load_digits()
    x = torch.as_tensor(d.images, dtype=torch.float64)[:n_train + n_test] / 16.0
    y = torch.as_tensor(d.target, dtype=torch.long)[:n_train + n_test]
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def _mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.Tanh(), nn.Linear(8, 10))


def _cnn():
    # the tutorial CNN's layout (conv, conv, pool, linear) at the 8x8 size of the digits
    return nn.Sequential(nn.Unflatten(1, (1, 8)), nn.Conv2d(1, 4, 3), nn.ReLU(),
                         nn.Conv2d(4, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(16, 10))


def _fit(make, backend, structure, subset, x, y):
    torch.manual_seed(0)
    model = make().double()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    la = Laplace(model, "classification", subset_of_weights=subset, hessian_structure=structure,
                 backend=backend)
    la.fit(loader)
    return la


def _precision(la):
    prec = la.posterior_precision
    return prec.to_matrix() if hasattr(prec, "to_matrix") else prec


def _close(a, b, what):
    scale = b.abs().max().clamp_min(1e-30)
    assert (a - b).abs().max() <= 1e-9 * scale, f"{what}: {(a - b).abs().max():.3e} vs {scale:.3e}"


@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
@pytest.mark.parametrize("make", [_mlp, _cnn], ids=["mlp", "cnn"])
def test_matches_curvlinops(make, structure, subset):
    x, y, x_test, _ = _digits()
    x_test = x_test.reshape(len(x_test), 8, 8)
    ours = _fit(make, GradHooksGGN, structure, subset, x, y)
    ref = _fit(make, AsdlGGN if structure == "full" else CurvlinopsGGN, structure, subset, x, y)
    _close(ours.log_marginal_likelihood(), ref.log_marginal_likelihood(), "marglik")
    _close(_precision(ours), _precision(ref), "posterior precision")
    for link in ("probit",) if structure == "kron" else ("probit", "mc"):
        if link == "mc":
            torch.manual_seed(3)
            p_ours = ours(x_test, pred_type="glm", link_approx="mc", n_samples=20)
            torch.manual_seed(3)
            p_ref = ref(x_test, pred_type="glm", link_approx="mc", n_samples=20)
        else:
            p_ours = ours(x_test, pred_type="glm", link_approx=link)
            p_ref = ref(x_test, pred_type="glm", link_approx=link)
        _close(p_ours, p_ref, f"predictive ({link})")


@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
def test_empirical_fisher_matches_curvlinops(structure):
    x, y, _, _ = _digits()
    ours = _fit(_mlp, GradHooksEF, structure, "all", x, y)
    ref = _fit(_mlp, AsdlEF if structure == "full" else CurvlinopsEF, structure, "all", x, y)
    _close(ours.log_marginal_likelihood(), ref.log_marginal_likelihood(), "marglik")
    _close(_precision(ours), _precision(ref), "posterior precision")


def _mlp_norm():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.LayerNorm(8), nn.Tanh(),
                         nn.Linear(8, 10))


def test_kron_with_layer_norm_uses_its_diagonal_block():
    """kron on a model with a LayerNorm: the Linear layers get Kronecker blocks as before (the
    same as on the model without it: checked against curvlinops above), the LayerNorm's
    parameters a diagonal block equal to the GGN diagonal of the diag structure."""
    x, y, _, _ = _digits()
    kron = _fit(_mlp_norm, GradHooksGGN, "kron", "all", x, y)
    diag = _fit(_mlp_norm, GradHooksGGN, "diag", "all", x, y)
    full, d = _precision(kron), _precision(diag)  # H + prior precision (1)
    lo, hi = 64 * 8 + 8, 64 * 8 + 8 + 16  # norm.weight, norm.bias
    block = full[lo:hi, lo:hi]
    _close(block.diagonal(), d[lo:hi], "LayerNorm diagonal")
    assert torch.count_nonzero(block - torch.diag_embed(block.diagonal())) == 0
    assert torch.count_nonzero(full[lo:hi, :lo]) == 0


def _smooth_cnn():
    # the CNN's layout with tanh and average pooling: no ReLU / max-pool kink (digits have
    # constant regions, where a max pool's windows tie) for a second derivative to straddle
    return nn.Sequential(nn.Unflatten(1, (1, 8)), nn.Conv2d(1, 4, 3), nn.Tanh(),
                         nn.Conv2d(4, 4, 3), nn.Tanh(), nn.AvgPool2d(2), nn.Flatten(),
                         nn.Linear(16, 10))


@pytest.mark.parametrize("make", [_mlp, _smooth_cnn], ids=["mlp", "cnn"])
def test_jacobians_with_enable_backprop_are_differentiable(make):
    """laplace's ``jacobians(x, enable_backprop=True)`` (its differentiable predictive): our
    Jacobians keep their graphs (``create_graph``); the gradient of a function of ``Js`` and
    ``f`` w.r.t. the inputs and the weights equals that through laplace's curvlinops backend
    (torch.func ``vmap(jacrev)``, correct on these layers)."""
    torch.manual_seed(0)
    model = make().double()
    x = _digits()[0][:5].clone().requires_grad_()
    params = list(model.parameters())
    got = []
    for backend in (GradHooksGGN, CurvlinopsGGN):
        js, f = backend(model, "classification").jacobians(x, enable_backprop=True)
        assert js.requires_grad and f.requires_grad
        value = (js ** 2).sum() + (js.sum(-1) * f).sum()
        got.append((js.detach(), torch.autograd.grad(value, [x] + params)))
    torch.testing.assert_close(got[0][0], got[1][0], rtol=1e-10, atol=1e-12)
    for ours, theirs in zip(got[0][1], got[1][1]):
        torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-11)
