"""Depthwise convolutions (one input channel per group, any channel multiplier): on the CPU,
with a kernel wider than 3, the default ("auto") method forms the per-sample weight gradient as a forward convolution of
the input by grad_output (gradhooks.rules.conv.correlation_weight_grad), and book-keeping's
weighted sum as those contracted with the weights, against looped autograd."""
import pytest
import torch
from torch import nn

from gradhooks.rules import conv
from gradhooks.rules.conv import ConvRule, auto_method, depthwise

from conftest import check_against_loop_or_empty, check_weighted_sum

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}

# (dims, conv kwargs, input spatial size)
DEPTHWISE = {
    "2d-7x7-same": (2, dict(in_channels=3, out_channels=3, kernel_size=7, padding=3, groups=3), (8, 9)),
    "2d-stride2-nobias": (2, dict(in_channels=4, out_channels=4, kernel_size=5, stride=2, padding=2,
                                  groups=4, bias=False), (7, 6)),
    "2d-multiplier-dilation": (2, dict(in_channels=2, out_channels=6, kernel_size=(4, 2), dilation=(2, 1),
                                       groups=2), (10, 5)),
    "2d-reflect-asym-same": (2, dict(in_channels=3, out_channels=3, kernel_size=(2, 4), padding="same",
                                     padding_mode="reflect", groups=3), (6, 6)),
    "2d-stride-dilation": (2, dict(in_channels=2, out_channels=2, kernel_size=(3, 5), stride=(2, 3),
                                   dilation=(1, 2), padding=(1, 2), groups=2), (9, 12)),
    "1d-circular": (1, dict(in_channels=3, out_channels=3, kernel_size=5, padding=2, dilation=2,
                            padding_mode="circular", groups=3), (11,)),
    "3d-stride": (3, dict(in_channels=2, out_channels=4, kernel_size=(1, 2, 4), stride=(1, 2, 1),
                          padding=(0, 1, 1), groups=2), (3, 5, 5)),
}


def _model(dims, kwargs):
    return nn.Sequential(CONV[dims](**kwargs), nn.Tanh())


def _refused(what):
    def refused(*args, **kwargs):
        raise AssertionError(f"{what} ran for a depthwise convolution on the CPU")
    return refused


def test_depthwise_is_one_input_channel_per_group():
    assert depthwise(nn.Conv2d(4, 4, 3, groups=4))
    assert depthwise(nn.Conv2d(4, 8, 3, groups=4))   # a channel multiplier
    assert not depthwise(nn.Conv1d(1, 5, 3))          # one input channel, dense: not measured
    assert not depthwise(nn.Conv2d(4, 4, 3, groups=2))
    assert not depthwise(nn.Conv2d(4, 4, 3))


def test_auto_method_keeps_the_measured_choices():
    """Pointwise convolutions take "unfold"; depthwise ones with a kernel wider than 3
    "correlation" on the CPU only (not measured elsewhere: another device keeps choose_method's
    pick); 3x3 depthwise ones (oneDNN's own kernel) and dense ones choose_method's."""
    dw = nn.Conv2d(4, 4, (1, 5), groups=4)
    x = torch.empty(2, 4, 5, 5)
    assert auto_method(nn.Conv2d(4, 4, 1, groups=4), x, 25) == "unfold"
    assert auto_method(dw, x, 5) == "correlation"
    assert auto_method(dw, x.to("meta"), 5) == conv.choose_method(dw, 5) == "conv"
    for other in (nn.Conv2d(4, 4, 3, groups=4), nn.Conv2d(4, 4, 5)):
        assert auto_method(other, x, 9) == conv.choose_method(other, 9)


@pytest.mark.parametrize("batch", [0, 1, 3], ids=["B0", "B1", "B3"])
@pytest.mark.parametrize("config", list(DEPTHWISE.values()), ids=list(DEPTHWISE))
def test_depthwise_auto_takes_the_correlation(config, batch, loss_reduction, dtype, monkeypatch):
    """The default method of a depthwise convolution on the CPU runs neither the grouped
    weight-backward kernel nor the unfolded patches, and matches the loop."""
    monkeypatch.setattr(conv, "conv_weight_grad", _refused("the grouped weight-backward kernel"))
    monkeypatch.setattr(conv, "unfold", _refused("the unfolded patches"))
    monkeypatch.setattr(ConvRule, "method", "auto")
    dims, kwargs, size = config
    x = torch.randn(batch, kwargs["in_channels"], *size)
    check_against_loop_or_empty(_model(dims, kwargs), x, torch.rand(batch) + 0.5,
                                loss_reduction=loss_reduction, dtype=dtype)


@pytest.mark.parametrize("batch", [0, 1, 4], ids=["B0", "B1", "B4"])
@pytest.mark.parametrize("config", list(DEPTHWISE.values()), ids=list(DEPTHWISE))
def test_depthwise_weighted_sum_matches_loop(config, batch, dtype, monkeypatch):
    """``sum_n c_n dW_n`` by the correlation contracted with ``c`` (the weight-backward kernel
    refused) equals the weighted sum of the looped per-sample gradients."""
    monkeypatch.setattr(conv, "weight_backward", _refused("the weight-backward kernel"))
    dims, kwargs, size = config
    check_weighted_sum(ConvRule(), lambda: CONV[dims](**kwargs), (kwargs["in_channels"], *size),
                       batch, dtype)
