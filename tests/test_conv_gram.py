"""A convolution's patch Gram matrix from its input's pixels (gradhooks.rules.conv.patch_gram):
equal to the unfolded patches' own product for every option torch has, chosen by the norm plan
where it is cheaper, and the norms and clipped sums formed with it equal the loop's."""
import pytest
import torch
from torch import nn

import gradhooks
from gradhooks.readers import plan
from gradhooks.rules import conv
from gradhooks.rules.conv import ConvRule, patch_gram, patch_gram_cost, unfold

from conftest import RTOL, loop_grads, weighted_square_loss

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}

# (dims, conv kwargs, input spatial size): strides that leave phases unused or read, dilations
# whose taps share a phase, every padding mode, 'same' (asymmetric), groups, depthwise, 1x1
CONFIGS = {
    "1d-stride2-dil2": (1, dict(in_channels=2, out_channels=3, kernel_size=4, stride=2, padding=3, dilation=2), (17,)),
    "1d-stride3-k2": (1, dict(in_channels=2, out_channels=2, kernel_size=2, stride=3), (11,)),
    "1d-same-even-circular": (1, dict(in_channels=3, out_channels=2, kernel_size=4, padding="same", padding_mode="circular"), (9,)),
    "2d-3x3": (2, dict(in_channels=4, out_channels=5, kernel_size=3, padding=1), (7, 6)),
    "2d-stride2-groups2": (2, dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=1, groups=2), (9, 8)),
    "2d-mixed": (2, dict(in_channels=3, out_channels=3, kernel_size=(2, 3), stride=(2, 3), padding=(0, 2), dilation=(2, 1)), (11, 10)),
    "2d-1x1-stride2": (2, dict(in_channels=4, out_channels=4, kernel_size=1, stride=2), (8, 8)),
    "2d-reflect": (2, dict(in_channels=4, out_channels=4, kernel_size=3, padding=1, padding_mode="reflect"), (8, 8)),
    "2d-replicate-same": (2, dict(in_channels=2, out_channels=3, kernel_size=(2, 4), padding="same", padding_mode="replicate"), (6, 7)),
    "2d-depthwise-5x5-s3": (2, dict(in_channels=4, out_channels=4, kernel_size=5, stride=3, groups=4), (13, 11)),
    "3d-stride-hw": (3, dict(in_channels=2, out_channels=3, kernel_size=3, stride=(1, 2, 2), padding=1), (5, 6, 7)),
}


@pytest.mark.parametrize("batch", [0, 1, 3], ids=["B0", "B1", "B3"])
@pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))
def test_patch_gram_is_the_unfolded_patches_gram(config, batch, dtype):
    dims, kwargs, size = config
    module = CONV[dims](**kwargs).to(dtype)
    x = torch.randn(batch, kwargs["in_channels"], *size, dtype=dtype)
    got = patch_gram(module, x)
    a = unfold(module, x.double())
    ref = a @ a.transpose(-1, -2)
    assert got.shape == ref.shape and got.dtype == dtype
    if batch:
        assert (got.double() - ref).abs().max() <= RTOL[dtype] * ref.abs().max()


def test_the_cost_model_takes_the_pixels_where_they_are_cheaper():
    """ResNet-50's 3 x 3 convolutions at 14 x 14 and 7 x 7 (where the norm plan takes the Gram
    form): the phases' products cost a fifth and a third of the patches'; a strided one (four
    phases) two thirds; a 1 x 1 or a single output position: no cheaper form (``None``)."""
    def ratio(module, shape):
        cost = patch_gram_cost(module, shape)
        out = module(torch.zeros(1, *shape[1:])).shape[2:]
        s = out.numel()
        return None if cost is None else cost / (s * s * module.weight[0].numel())

    assert ratio(nn.Conv2d(256, 256, 3, padding=1), (16, 256, 14, 14)) < 0.2
    assert ratio(nn.Conv2d(512, 512, 3, padding=1), (16, 512, 7, 7)) < 0.35
    assert ratio(nn.Conv2d(256, 256, 3, stride=2, padding=1), (16, 256, 28, 28)) < 0.7
    assert ratio(nn.Conv2d(256, 1024, 1), (16, 256, 14, 14)) is None
    assert ratio(nn.Conv2d(64, 64, 3), (16, 64, 3, 3)) is None
    # and the plan's choice follows: 14 x 14 Gram (with the pixels), 56 x 56 materialised
    layer = nn.Conv2d(256, 256, 3, padding=1)
    cost = patch_gram_cost(layer, (16, 256, 14, 14))
    assert plan.use_gram(196, 2304, 256, batch=16, gram_in=cost)
    assert not plan.use_gram(3136, 576, 64, batch=16,
                             gram_in=patch_gram_cost(nn.Conv2d(64, 64, 3, padding=1), (16, 64, 56, 56)))


class Deep(nn.Module):
    """3 x 3 convolutions of many channels at few positions (the norm plan's Gram form with the
    pixels), a strided one, and a 1 x 1 (the patches' product)."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 48, 3, padding=1)
        self.c2 = nn.Conv2d(48, 48, 3, stride=2, padding=1, padding_mode="reflect")
        self.c3 = nn.Conv2d(48, 64, 3, padding=1, bias=False)
        self.c4 = nn.Conv2d(64, 32, 1)
        self.head = nn.Linear(32, 3)

    def forward(self, x):  # (B, 3, 6, 6)
        x = torch.tanh(self.c2(torch.tanh(self.c1(x))))  # (B, 48, 3, 3)
        x = self.c4(torch.tanh(self.c3(x)))
        return self.head(x.mean((2, 3)))


@pytest.mark.parametrize("batch", [1, 5])
def test_norms_and_clipping_with_the_pixels_match_the_loop(batch, loss_reduction, dtype, monkeypatch):
    formed = []
    own = ConvRule.input_gram
    monkeypatch.setattr(ConvRule, "input_gram",
                        lambda self, m, a, bf: formed.append(own(self, m, a, bf) is not None)
                        or own(self, m, a, bf))
    model = Deep().to(dtype)
    x, w = torch.randn(batch, 3, 6, 6, dtype=dtype), torch.rand(batch, dtype=dtype) + 0.5
    loss_fn = weighted_square_loss(loss_reduction)
    ref = loop_grads(model, loss_fn, x, w)
    norms = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in ref.values()))
    c = (norms.median() / norms).clamp(max=1)
    div = batch if loss_reduction == "mean" else 1
    with gradhooks.attach(model, loss_reduction=loss_reduction) as gh:
        loss_fn(model(x), w).backward()
        got = gh.per_sample_grad_norms()
        assert (got - norms).abs().max() <= RTOL[dtype] * norms.max()
        gh.clip_and_accumulate(float(norms.median()))
    for name, p in model.named_parameters():
        expected = torch.tensordot(c, ref[name], 1) / div
        scale = (torch.tensordot(c, ref[name].abs(), 1) / div).max()
        assert (p.grad - expected).abs().max() <= RTOL[dtype] * scale, name
    assert any(formed), "no convolution took the pixels' Gram form"


def test_a_forced_pixel_gram_is_exact_on_every_layer(monkeypatch):
    """The cost model aside (forced on, as ``tests/test_dp.py``'s ``pixels`` form does for its
    models): two passes of clipping read the same norms."""
    monkeypatch.setattr(conv, "patch_gram_cost", lambda *a: 1)
    model = Deep().double()
    x, w = torch.randn(4, 3, 6, 6, dtype=torch.float64), torch.rand(4, dtype=torch.float64)
    ref = loop_grads(model, weighted_square_loss("sum"), x, w)
    norms = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in ref.values()))
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        losses = (model(x).square().sum(1) * w)
        got = gh.clipped_backward(losses, float(norms.median()))
    torch.testing.assert_close(got, norms, rtol=1e-10, atol=0)
