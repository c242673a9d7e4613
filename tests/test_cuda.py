"""The CUDA path against looped autograd; skipped (honestly) on machines without a GPU."""
import pytest
import torch
from torch import nn

from conftest import check_against_loop

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_cnn_on_cuda_matches_loop(dtype):
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1, padding_mode="reflect"), nn.ReLU(inplace=True),
        nn.Conv2d(4, 4, 3, groups=2, stride=2), nn.Flatten(), nn.Linear(4 * 3 * 3, 3),
    ).cuda()
    x = torch.randn(6, 2, 8, 8, device="cuda")
    w = torch.rand(6, device="cuda") + 0.5
    ours = check_against_loop(model, x, w, loss_reduction="mean", dtype=dtype)
    assert all(t.is_cuda for t in ours.values())
