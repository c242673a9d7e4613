"""nn.Conv1d/2d/3d per-sample gradients against looped autograd, every option torch has."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from gradhooks.rules.conv import ConvRule

from conftest import check_against_loop


@pytest.fixture(params=["conv", "unfold", "correlation"], autouse=True)
def method(request, monkeypatch):
    """The three exact weight-gradient methods run every case (auto picks one of them per
    shape)."""
    monkeypatch.setattr(ConvRule, "method", request.param)
    return request.param

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}

# (dims, conv kwargs, input spatial size)
CONFIGS = {
    "1d-basic": (1, dict(in_channels=3, out_channels=4, kernel_size=3), (9,)),
    "1d-stride2-pad1": (1, dict(in_channels=2, out_channels=3, kernel_size=3, stride=2, padding=1), (10,)),
    "1d-dil2-same": (1, dict(in_channels=2, out_channels=3, kernel_size=3, dilation=2, padding="same"), (9,)),
    "1d-even-same": (1, dict(in_channels=2, out_channels=2, kernel_size=4, padding="same"), (8,)),
    "1d-groups2": (1, dict(in_channels=4, out_channels=6, kernel_size=2, groups=2), (7,)),
    "1d-depthwise": (1, dict(in_channels=3, out_channels=6, kernel_size=3, groups=3, padding=1), (8,)),
    "1d-reflect": (1, dict(in_channels=2, out_channels=3, kernel_size=3, padding=2, padding_mode="reflect"), (8,)),
    "1d-replicate-nobias": (1, dict(in_channels=2, out_channels=3, kernel_size=3, padding=1, padding_mode="replicate", bias=False), (6,)),
    "1d-circular-stride": (1, dict(in_channels=2, out_channels=3, kernel_size=3, stride=2, padding=2, padding_mode="circular"), (9,)),
    "1d-valid": (1, dict(in_channels=2, out_channels=3, kernel_size=5, padding="valid"), (9,)),
    "2d-basic": (2, dict(in_channels=2, out_channels=3, kernel_size=3), (6, 7)),
    "2d-asym-kernel-stride": (2, dict(in_channels=2, out_channels=3, kernel_size=(2, 3), stride=(2, 1), padding=(1, 0)), (7, 6)),
    "2d-dilation-tuple": (2, dict(in_channels=2, out_channels=4, kernel_size=3, dilation=(1, 2), padding=(2, 1)), (7, 8)),
    "2d-same-even-reflect": (2, dict(in_channels=2, out_channels=3, kernel_size=(2, 4), padding="same", padding_mode="reflect"), (6, 6)),
    "2d-same-dil-circular": (2, dict(in_channels=2, out_channels=2, kernel_size=3, dilation=2, padding="same", padding_mode="circular"), (6, 7)),
    "2d-replicate-stride": (2, dict(in_channels=3, out_channels=2, kernel_size=3, stride=2, padding=1, padding_mode="replicate"), (7, 7)),
    "2d-groups3-nobias": (2, dict(in_channels=6, out_channels=3, kernel_size=2, groups=3, bias=False), (5, 5)),
    "2d-depthwise": (2, dict(in_channels=4, out_channels=4, kernel_size=3, groups=4, padding=1), (6, 5)),
    "2d-1x1": (2, dict(in_channels=4, out_channels=5, kernel_size=1), (4, 4)),
    "3d-basic": (3, dict(in_channels=2, out_channels=3, kernel_size=2), (4, 5, 4)),
    "3d-stride-pad-dil": (3, dict(in_channels=2, out_channels=2, kernel_size=(1, 2, 3), stride=(1, 2, 1), padding=(0, 1, 2), dilation=(2, 1, 2)), (5, 5, 6)),
    "3d-groups-reflect": (3, dict(in_channels=4, out_channels=4, kernel_size=3, groups=2, padding=1, padding_mode="reflect"), (4, 4, 5)),
    "3d-same-circular": (3, dict(in_channels=2, out_channels=2, kernel_size=(2, 3, 2), padding="same", padding_mode="circular"), (4, 4, 4)),
    "3d-replicate-nobias": (3, dict(in_channels=1, out_channels=2, kernel_size=2, padding=1, padding_mode="replicate", bias=False), (3, 4, 3)),
}


@pytest.mark.parametrize("batch", [1, 3], ids=["B1", "B3"])
@pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))
def test_conv_matches_loop(config, batch, loss_reduction, dtype):
    dims, kwargs, size = config
    model = nn.Sequential(CONV[dims](**kwargs), nn.Tanh())
    x = torch.randn(batch, kwargs["in_channels"], *size)
    w = torch.rand(batch) + 0.5
    check_against_loop(model, x, w, loss_reduction=loss_reduction, dtype=dtype)


def test_conv_then_linear_network(loss_reduction, dtype):
    """A small CNN: conv -> in-place ReLU -> conv -> pool -> flatten -> linear."""
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.ReLU(inplace=True), nn.Conv2d(4, 4, 3, stride=2, padding=1),
        nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4 * 2 * 2, 3),
    )
    x = torch.randn(5, 1, 9, 9)
    check_against_loop(model, x, torch.randint(0, 3, (5,)), loss_reduction=loss_reduction,
                       dtype=dtype, loss_fn=nn.CrossEntropyLoss(reduction=loss_reduction))


@st.composite
def conv_configs(draw):
    dims = draw(st.integers(1, 3))
    groups = draw(st.integers(1, 3))
    cin = groups * draw(st.integers(1, 2))
    cout = groups * draw(st.integers(1, 2))
    kernel = tuple(draw(st.integers(1, 3)) for _ in range(dims))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(dims))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(dims))
    mode = draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"]))
    kind = draw(st.sampled_from(["int", "tuple", "same", "valid"]))
    if kind == "same" and any(s != 1 for s in stride):
        kind = "tuple"  # torch refuses padding='same' with stride > 1
    if kind == "int":
        padding = draw(st.integers(0, 2))
        pads = (padding,) * dims
    elif kind == "tuple":
        padding = tuple(draw(st.integers(0, 2)) for _ in range(dims))
        pads = padding
    else:
        padding = kind
        pads = tuple(d * (k - 1) for d, k in zip(dilation, kernel)) if kind == "same" else (0,) * dims
    extent = [d * (k - 1) + 1 for d, k in zip(dilation, kernel)]
    # input large enough for one output position and for reflect padding (< input size)
    size = tuple(max(e, p + 1) + draw(st.integers(0, 3)) for e, p in zip(extent, pads))
    bias = draw(st.booleans())
    batch = draw(st.sampled_from([1, 2, 4]))
    kwargs = dict(in_channels=cin, out_channels=cout, kernel_size=kernel, stride=stride,
                  padding=padding, dilation=dilation, groups=groups, bias=bias, padding_mode=mode)
    return dims, kwargs, size, batch


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conv_configs(), st.sampled_from(["mean", "sum"]))
def test_conv_random_configs_match_loop(cfg, loss_reduction):
    dims, kwargs, size, batch = cfg
    torch.manual_seed(0)
    model = nn.Sequential(CONV[dims](**kwargs), nn.Tanh())
    x = torch.randn(batch, kwargs["in_channels"], *size)
    w = torch.rand(batch) + 0.5
    check_against_loop(model, x, w, loss_reduction=loss_reduction, dtype=torch.float64)
