"""Pointwise (1x1, unpadded) convolutions: the per-sample gradient by the "unfold" method (the
input itself as patches) whatever the cost thresholds say, and the weighted sum of book-keeping
clipping by per-sample matmuls (gradhooks.rules.conv._pointwise_weighted), against looped autograd."""
import pytest
import torch
from torch import nn

from gradhooks.rules import conv
from gradhooks.rules.conv import ConvRule, pointwise

from conftest import check_against_loop_or_empty, check_weighted_sum

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}

# (dims, conv kwargs, input spatial size)
POINTWISE = {
    "2d": (2, dict(in_channels=3, out_channels=4, kernel_size=1), (5, 6)),
    "2d-stride2-nobias": (2, dict(in_channels=3, out_channels=5, kernel_size=1, stride=2, bias=False), (7, 6)),
    "2d-groups2": (2, dict(in_channels=4, out_channels=6, kernel_size=1, groups=2), (4, 4)),
    "2d-depthwise-stride": (2, dict(in_channels=3, out_channels=3, kernel_size=1, groups=3, stride=(1, 2)), (5, 5)),
    "2d-dilation-same": (2, dict(in_channels=2, out_channels=3, kernel_size=1, dilation=2, padding="same"), (4, 5)),
    "1d-stride3": (1, dict(in_channels=2, out_channels=3, kernel_size=1, stride=3), (10,)),
    "3d-stride": (3, dict(in_channels=2, out_channels=3, kernel_size=1, stride=(1, 2, 1)), (3, 4, 3)),
}


def _model(dims, kwargs):
    return nn.Sequential(CONV[dims](**kwargs), nn.Tanh())


def test_pointwise_is_kernel_one_without_padding():
    assert pointwise(nn.Conv2d(3, 4, 1, stride=2))
    assert pointwise(nn.Conv2d(3, 4, 1, padding="same"))
    assert pointwise(nn.Conv3d(3, 4, (1, 1, 1), padding="valid"))
    assert not pointwise(nn.Conv2d(3, 4, 1, padding=1))  # (its borders see the padding)
    assert not pointwise(nn.Conv2d(3, 4, (1, 3), padding=(0, 1)))


@pytest.mark.parametrize("batch", [0, 1, 3], ids=["B0", "B1", "B3"])
@pytest.mark.parametrize("config", list(POINTWISE.values()), ids=list(POINTWISE))
def test_pointwise_auto_takes_unfold(config, batch, loss_reduction, dtype, monkeypatch):
    """The default ("auto") method never takes the grouped convolution for a pointwise conv."""
    def refused(*args, **kwargs):
        raise AssertionError("the grouped-convolution method ran for a pointwise convolution")

    monkeypatch.setattr(conv, "conv_weight_grad", refused)
    monkeypatch.setattr(ConvRule, "method", "auto")
    dims, kwargs, size = config
    x = torch.randn(batch, kwargs["in_channels"], *size)
    check_against_loop_or_empty(_model(dims, kwargs), x, torch.rand(batch) + 0.5,
                                loss_reduction=loss_reduction, dtype=dtype)


@pytest.mark.parametrize("chunk", [16 * 2**20, 1], ids=["one-chunk", "per-sample-chunks"])
@pytest.mark.parametrize("batch", [0, 1, 4], ids=["B0", "B1", "B4"])
@pytest.mark.parametrize("config", list(POINTWISE.values()), ids=list(POINTWISE))
def test_pointwise_weighted_sum_matches_loop(config, batch, chunk, dtype, monkeypatch):
    """``sum_n c_n dW_n`` by per-sample matmuls equals the weighted sum of the looped per-sample
    gradients (float64 and float32), in one chunk and in chunks of one sample."""
    monkeypatch.setattr(conv, "POINTWISE_MATMUL_POSITIONS", 1)
    monkeypatch.setattr(conv, "POINTWISE_CHUNK_BYTES", chunk)
    dims, kwargs, size = config
    check_weighted_sum(ConvRule(), lambda: CONV[dims](**kwargs), (kwargs["in_channels"], *size),
                       batch, dtype)


def test_pointwise_weighted_sum_below_threshold_uses_the_kernel(monkeypatch):
    """Below POINTWISE_MATMUL_POSITIONS output positions the weight-backward kernel runs."""
    def refused(*args, **kwargs):
        raise AssertionError("per-sample matmuls ran below the threshold")

    monkeypatch.setattr(conv, "_pointwise_weighted", refused)
    m = nn.Conv2d(3, 4, 1).double()
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)  # 16 positions < 128
    g = torch.randn_like(m(x))
    c = torch.rand(2, dtype=torch.float64)
    got = ConvRule().weighted_sum(m, x, g, c, True, ["weight"])["weight"]
    expected = torch.einsum("n,nos,nis->oi", c, g.flatten(2), x.flatten(2))
    assert torch.allclose(got.view(4, 3), expected, rtol=1e-12, atol=0)
