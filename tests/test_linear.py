"""nn.Linear per-sample gradients against looped autograd."""
import pytest
import torch
from torch import nn

from conftest import check_against_loop

SHAPES = {
    "2d": (),          # (B, in)
    "3d": (5,),        # (B, T, in): positions summed per sample
    "4d": (3, 2),      # (B, T1, T2, in)
}


@pytest.mark.parametrize("batch", [1, 4], ids=["B1", "B4"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("extra", list(SHAPES.values()), ids=list(SHAPES))
def test_linear_matches_loop(batch, bias, extra, loss_reduction, dtype):
    model = nn.Sequential(nn.Linear(6, 5, bias=bias), nn.Tanh(), nn.Linear(5, 3, bias=bias))
    x = torch.randn(batch, *extra, 6)
    w = torch.rand(batch) + 0.5
    check_against_loop(model, x, w, loss_reduction=loss_reduction, dtype=dtype)


@pytest.mark.parametrize("batch", [1, 3], ids=["B1", "B3"])
def test_linear_batch_second(batch, loss_reduction, dtype):
    """batch_first=False: (T, B, in) inputs, batch on dim 1."""
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    x = torch.randn(7, batch, 4)
    w = torch.rand(batch) + 0.5
    check_against_loop(model, x, w, loss_reduction=loss_reduction, dtype=dtype, batch_first=False)


def test_linear_mean_reduction_does_not_depend_on_batch_size():
    """With loss_reduction='mean' entry n is the gradient of sample n's own loss."""
    import gradhooks

    from conftest import weighted_square_loss
    model = nn.Linear(3, 2).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    w = torch.ones(5, dtype=torch.float64)
    results = []
    for b in (1, 2, 5):
        with gradhooks.attach(model) as gh:
            weighted_square_loss("mean")(model(x[:b]), w[:b]).backward()
            results.append(gh.per_sample_grads()["weight"][0].clone())
    torch.testing.assert_close(results[0], results[1], rtol=1e-12, atol=0.0)
    torch.testing.assert_close(results[0], results[2], rtol=1e-12, atol=0.0)
