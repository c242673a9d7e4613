"""nn.ConvTranspose1d/2d/3d per-sample gradients against looped autograd, every option torch has
(stride, padding, output_padding -- also >= stride, allowed when smaller than the dilation --,
dilation, groups, bias, and output_size given to the forward), with both exact methods."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import gradhooks
from gradhooks.rules.conv import choose_method
from gradhooks.rules.conv_transpose import ConvTransposeRule, output_padding

from conftest import check_against_loop

CONV_T = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}




@pytest.fixture(params=["conv", "unfold"], autouse=True)
def method(request, monkeypatch):
    """Both exact weight-gradient methods run every case (auto picks one of them per shape)."""
    monkeypatch.setattr(ConvTransposeRule, "method", request.param)
    return request.param


class WithOutputSize(nn.Module):
    """Calls the transposed convolution with ``output_size`` (picks the output padding)."""

    def __init__(self, conv, output_size):
        super().__init__()
        self.conv, self.output_size = conv, output_size

    def forward(self, x):
        return torch.tanh(self.conv(x, output_size=self.output_size))


# (dims, module kwargs, input spatial size, output_size for the forward or None)
CONFIGS = {
    "1d-basic": (1, dict(in_channels=3, out_channels=4, kernel_size=3), (6,), None),
    "1d-stride2-pad1-outpad1": (1, dict(in_channels=2, out_channels=3, kernel_size=3, stride=2, padding=1, output_padding=1), (5,), None),
    "1d-dil3-outpad2-ge-stride": (1, dict(in_channels=2, out_channels=3, kernel_size=3, stride=2, dilation=3, output_padding=2), (5,), None),
    "1d-groups2-nobias": (1, dict(in_channels=4, out_channels=6, kernel_size=2, stride=3, groups=2, bias=False), (4,), None),
    "1d-depthwise": (1, dict(in_channels=3, out_channels=3, kernel_size=4, stride=2, padding=1, groups=3), (5,), None),
    "1d-output-size": (1, dict(in_channels=2, out_channels=2, kernel_size=3, stride=3, padding=1), (4,), [11]),
    "2d-basic": (2, dict(in_channels=2, out_channels=3, kernel_size=3), (4, 5), None),
    "2d-k4-s2-p1": (2, dict(in_channels=3, out_channels=2, kernel_size=4, stride=2, padding=1), (4, 3), None),
    "2d-asym": (2, dict(in_channels=2, out_channels=3, kernel_size=(2, 3), stride=(2, 1), padding=(1, 0), output_padding=(1, 0)), (4, 4), None),
    "2d-dilation-groups3": (2, dict(in_channels=3, out_channels=6, kernel_size=3, dilation=(2, 1), padding=1, groups=3), (4, 4), None),
    "2d-outpad-dilation": (2, dict(in_channels=2, out_channels=2, kernel_size=2, stride=(1, 2), dilation=(3, 2), output_padding=(2, 1), bias=False), (3, 4), None),
    "2d-output-size-full": (2, dict(in_channels=2, out_channels=3, kernel_size=3, stride=2, padding=1), (3, 4), [2, 3, 6, 8]),
    "2d-1x1": (2, dict(in_channels=4, out_channels=3, kernel_size=1), (3, 3), None),
    "3d-basic": (3, dict(in_channels=2, out_channels=2, kernel_size=2), (3, 3, 2), None),
    "3d-stride-pad-dil-groups": (3, dict(in_channels=4, out_channels=2, kernel_size=(1, 2, 3), stride=(2, 1, 2), padding=(0, 1, 1), dilation=(1, 2, 1), output_padding=(1, 0, 1), groups=2), (3, 3, 3), None),
    "3d-output-size-nobias": (3, dict(in_channels=1, out_channels=2, kernel_size=2, stride=2, bias=False), (2, 3, 2), [5, 6, 4]),
}


def build(dims, kwargs, output_size):
    conv = CONV_T[dims](**kwargs)
    return nn.Sequential(conv, nn.Tanh()) if output_size is None else WithOutputSize(conv, output_size)


@pytest.mark.parametrize("batch", [1, 3], ids=["B1", "B3"])
@pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))
def test_conv_transpose_matches_loop(config, batch, loss_reduction, dtype):
    dims, kwargs, size, output_size = config
    x = torch.randn(batch, kwargs["in_channels"], *size)
    check_against_loop(build(dims, kwargs, output_size), x, torch.rand(batch) + 0.5,
                       loss_reduction=loss_reduction, dtype=dtype)


def test_output_padding_read_from_shapes():
    """output_size changes the output padding the call used; the rule reads it from the output."""
    conv = nn.ConvTranspose2d(2, 2, 3, stride=3, padding=1, output_padding=(0, 1))
    x = torch.randn(1, 2, 4, 4)
    assert output_padding(conv, x, conv(x).shape) == [0, 1]
    assert output_padding(conv, x, conv(x, output_size=[11, 10]).shape) == [1, 0]


def test_upsampling_decoder(loss_reduction, dtype):
    """A small decoder: linear -> reshape -> transposed convs with in-place ReLU between."""
    model = nn.Sequential(
        nn.Linear(3, 4 * 3 * 3), nn.Unflatten(1, (4, 3, 3)),
        nn.ConvTranspose2d(4, 4, 4, stride=2, padding=1), nn.ReLU(inplace=True),
        nn.ConvTranspose2d(4, 2, 3, stride=2, padding=1, output_padding=1, groups=2), nn.Sigmoid(),
    )
    check_against_loop(model, torch.randn(4, 3), torch.rand(4) + 0.5, loss_reduction=loss_reduction,
                       dtype=dtype)


@st.composite
def conv_transpose_configs(draw):
    dims = draw(st.integers(1, 3))
    groups = draw(st.integers(1, 3))
    cin = groups * draw(st.integers(1, 2))
    cout = groups * draw(st.integers(1, 2))
    kernel = tuple(draw(st.integers(1, 3)) for _ in range(dims))
    dilation = tuple(draw(st.integers(1, 3)) for _ in range(dims))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(dims))
    # torch: output_padding < max(stride, dilation); padding must leave an output position
    out_pad = tuple(draw(st.integers(0, max(s, d) - 1)) for s, d in zip(stride, dilation))
    size = tuple(draw(st.integers(1, 4)) for _ in range(dims))
    padding = []
    for k, d, s, x in zip(kernel, dilation, stride, size):
        full = (x - 1) * s + d * (k - 1) + 1  # output size without padding
        padding.append(draw(st.integers(0, min(2, (full - 1) // 2))))
    kwargs = dict(in_channels=cin, out_channels=cout, kernel_size=kernel, stride=stride,
                  padding=tuple(padding), output_padding=out_pad, dilation=dilation, groups=groups,
                  bias=draw(st.booleans()))
    return dims, kwargs, size, draw(st.sampled_from([1, 2, 4]))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(conv_transpose_configs(), st.sampled_from(["mean", "sum"]))
def test_conv_transpose_random_configs_match_loop(cfg, loss_reduction):
    dims, kwargs, size, batch = cfg
    torch.manual_seed(0)
    x = torch.randn(batch, kwargs["in_channels"], *size)
    check_against_loop(nn.Sequential(CONV_T[dims](**kwargs), nn.Tanh()), x, torch.rand(batch) + 0.5,
                       loss_reduction=loss_reduction, dtype=torch.float64)


@pytest.mark.parametrize("method", ["auto"])
def test_auto_method_matches_loop(method, monkeypatch):
    """The default ("auto") path: a shape for which choose_method picks each method."""
    monkeypatch.setattr(ConvTransposeRule, "method", "auto")
    small = nn.ConvTranspose2d(2, 3, 3, stride=2)
    big = nn.ConvTranspose2d(64, 64, 3, stride=2)  # output 7x7
    assert choose_method(small, 49) == "conv" and choose_method(big, 49) == "unfold"
    for conv in (small, big):
        x = torch.randn(2, conv.in_channels, 3, 3)
        check_against_loop(nn.Sequential(conv, nn.Tanh()), x, torch.rand(2) + 0.5,
                           loss_reduction="mean", dtype=torch.float64)


@pytest.mark.parametrize("dims", [1, 2, 3], ids=["1d", "2d", "3d"])
def test_unbatched_input_is_refused(dims):
    conv = CONV_T[dims](2, 3, 2)
    with gradhooks.attach(conv):
        with pytest.raises(gradhooks.BatchSizeError, match=rf"shape \(2,( 4,?)+\).*{dims + 2} dims"):
            conv(torch.randn(2, *[4] * dims))
