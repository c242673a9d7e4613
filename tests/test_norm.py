"""Normalisation layers (LayerNorm, RMSNorm, GroupNorm, InstanceNorm, BatchNorm) against looped
autograd, BatchNorm's refusal of batch statistics and its opt-in contributions."""
import pytest
import torch
from torch import nn

import gradhooks
from gradhooks.rules.norm import BatchNormRule, GroupNormRule

from conftest import (
    RTOL,
    assert_close_to_loop,
    check_against_loop,
    loop_grads,
    weighted_square_loss,
)


def randomised(module):
    """Random affine parameters, so the layers after the norm see a non-trivial output."""
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    return module


def primed(module, shape):
    """Non-trivial running statistics: a few no-grad forwards in training mode, then eval."""
    with torch.no_grad():
        for _ in range(3):
            module(torch.randn(4, *shape[1:]) * 2 + 1)
    return module.eval()


def run_case(module, shape, batch, loss_reduction, dtype, batch_first=True):
    model = nn.Sequential(module, nn.Tanh())
    bdim = 0 if batch_first or len(shape) < 3 else 1
    shape = list(shape)
    shape[bdim] = batch
    check_against_loop(model, torch.randn(*shape), torch.rand(batch) + 0.5,
                       loss_reduction=loss_reduction, dtype=dtype, batch_first=batch_first)


BATCHES = pytest.mark.parametrize("batch", [1, 3], ids=["B1", "B3"])

# id: (module factory, input shape with 0 on the batch dim, batch_first)
TRAILING = {
    "layernorm-Bd": (lambda: nn.LayerNorm(6), (0, 6), True),
    "layernorm-BTd": (lambda: nn.LayerNorm(6), (0, 5, 6), True),
    "layernorm-TBd-seqfirst": (lambda: nn.LayerNorm(6), (5, 0, 6), False),
    "layernorm-Bd-seqfirst": (lambda: nn.LayerNorm(6), (0, 6), False),
    "layernorm-nobias-BTd": (lambda: nn.LayerNorm(6, bias=False), (0, 4, 6), True),
    "layernorm-shape2-Bhw": (lambda: nn.LayerNorm((3, 4)), (0, 3, 4), True),
    "layernorm-shape2-BThw": (lambda: nn.LayerNorm((3, 4), eps=1e-3), (0, 2, 3, 4), True),
    "layernorm-shape2-TBhw-seqfirst": (lambda: nn.LayerNorm((3, 4), bias=False), (2, 0, 3, 4), False),
    "rmsnorm-Bd": (lambda: nn.RMSNorm(6), (0, 6), True),
    "rmsnorm-BTd-eps": (lambda: nn.RMSNorm(6, eps=1e-3), (0, 5, 6), True),
    "rmsnorm-TBd-seqfirst": (lambda: nn.RMSNorm(6), (5, 0, 6), False),
    "rmsnorm-shape2-BThw": (lambda: nn.RMSNorm((3, 4), eps=0.1), (0, 2, 3, 4), True),
}


@BATCHES
@pytest.mark.parametrize("case", list(TRAILING.values()), ids=list(TRAILING))
def test_layernorm_rmsnorm_match_loop(case, batch, loss_reduction, dtype):
    make, shape, batch_first = case
    run_case(randomised(make()), shape, batch, loss_reduction, dtype, batch_first)


def test_rmsnorm_default_eps_is_the_dtypes_eps():
    """eps=None: torch uses finfo(dtype).eps; tiny inputs make the difference visible."""
    norm = randomised(nn.RMSNorm(5)).double()
    x = torch.randn(3, 5, dtype=torch.float64) * 1e-8
    with gradhooks.attach(norm, loss_reduction="sum") as gh:
        (norm(x) ** 2).sum().backward()
        ours = gh.per_sample_grads()  # the sum check against autograd passes as well
    ref = loop_grads(norm, lambda out, _: (out ** 2).sum(), x, torch.zeros(3))
    assert_close_to_loop(ours, ref, torch.float64)


@pytest.mark.parametrize("norm", [nn.LayerNorm(5, elementwise_affine=False),
                                  nn.RMSNorm(5, elementwise_affine=False),
                                  nn.GroupNorm(1, 5, affine=False)],
                         ids=["layernorm", "rmsnorm", "groupnorm"])
def test_norms_without_parameters_are_transparent(norm, loss_reduction, dtype):
    model = nn.Sequential(nn.Linear(4, 5), norm, nn.Tanh(), nn.Linear(5, 2))
    ours = check_against_loop(model, torch.randn(3, 4), torch.rand(3) + 0.5,
                              loss_reduction=loss_reduction, dtype=dtype)
    assert set(ours) == {"0.weight", "0.bias", "3.weight", "3.bias"}


CHANNEL = {
    "groupnorm-BC": (lambda: nn.GroupNorm(2, 4), (0, 4)),
    "groupnorm-BCL": (lambda: nn.GroupNorm(2, 4), (0, 4, 5)),
    "groupnorm-BCHW-one-group": (lambda: nn.GroupNorm(1, 4), (0, 4, 3, 3)),
    "groupnorm-BCHW-per-channel": (lambda: nn.GroupNorm(4, 4, eps=1e-3), (0, 4, 3, 2)),
    "groupnorm-BCDHW": (lambda: nn.GroupNorm(3, 6), (0, 6, 2, 3, 2)),
}
for _d, _shape in ((1, (0, 3, 5)), (2, (0, 3, 3, 4)), (3, (0, 3, 2, 3, 2))):
    _cls = getattr(nn, f"InstanceNorm{_d}d")
    CHANNEL[f"instancenorm{_d}d"] = (lambda c=_cls: c(3, affine=True), _shape)
    CHANNEL[f"instancenorm{_d}d-stats-train"] = (
        lambda c=_cls: c(3, affine=True, track_running_stats=True), _shape)
    CHANNEL[f"instancenorm{_d}d-stats-eval"] = (
        lambda c=_cls, s=_shape: primed(c(3, affine=True, track_running_stats=True), s), _shape)
    CHANNEL[f"instancenorm{_d}d-nostats-eval"] = (lambda c=_cls: c(3, affine=True).eval(), _shape)
CHANNEL.update({
    "batchnorm1d-BC-eval": (lambda: primed(nn.BatchNorm1d(4), (0, 4)), (0, 4)),
    "batchnorm1d-BCL-eval": (lambda: primed(nn.BatchNorm1d(4, eps=1e-3), (0, 4, 5)), (0, 4, 5)),
    "batchnorm2d-eval": (lambda: primed(nn.BatchNorm2d(3), (0, 3, 3, 4)), (0, 3, 3, 4)),
    "batchnorm3d-eval": (lambda: primed(nn.BatchNorm3d(3), (0, 3, 2, 3, 2)), (0, 3, 2, 3, 2)),
})


@BATCHES
@pytest.mark.parametrize("case", list(CHANNEL.values()), ids=list(CHANNEL))
def test_channel_norms_match_loop(case, batch, loss_reduction, dtype):
    make, shape = case
    run_case(randomised(make()), shape, batch, loss_reduction, dtype)


def test_frozen_weight_trainable_bias():
    norm = randomised(nn.GroupNorm(2, 4)).double()
    norm.weight.requires_grad_(False)
    ours = check_against_loop(norm, torch.randn(3, 4, 5), torch.rand(3) + 0.5,
                              loss_reduction="sum", dtype=torch.float64)
    assert list(ours) == ["bias"]


AUTOCAST = {
    "groupnorm": (lambda: nn.Sequential(nn.Conv1d(4, 4, 1), randomised(nn.GroupNorm(2, 4)), nn.Tanh()),
                  (5, 4, 6)),
    "layernorm": (lambda: nn.Sequential(nn.Linear(6, 6), randomised(nn.LayerNorm(6)), nn.Tanh()), (5, 7, 6)),
    "rmsnorm": (lambda: nn.Sequential(nn.Linear(6, 6), randomised(nn.RMSNorm(6)), nn.Tanh()), (5, 7, 6)),
}


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # torch's rms_norm
@pytest.mark.parametrize("case", list(AUTOCAST.values()), ids=list(AUTOCAST))
def test_autocast_bfloat16_computes_in_float32(case, device):
    """Under autocast (the device's) the layer before the norm runs in bfloat16; the norm's
    per-sample gradients come out in float32 and agree with a looped autocast run within bfloat16
    rounding."""
    make, shape = case
    model = InAutocast(make()).to(device)
    x, w = torch.randn(*shape).to(device), (torch.rand(shape[0]) + 0.5).to(device)
    loss_fn = weighted_square_loss("mean")
    ref = loop_grads(model, loss_fn, x, w)
    with gradhooks.attach(model) as gh:
        loss_fn(model(x), w).backward()
        ours = gh.per_sample_grads()
    names = [n for n in ref if n.startswith("inner.1.")]
    assert names
    for name in names:
        assert ours[name].dtype == torch.float32
        assert (ours[name] - ref[name]).abs().max() <= 2e-2 * ref[name].abs().max(), name


class InAutocast(nn.Module):
    """Runs ``inner`` under bfloat16 autocast (of ``x``'s device) and returns float32."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            return self.inner(x).float()


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("norm,x", [
    (nn.LayerNorm(4), torch.randn(4)),
    (nn.LayerNorm((3, 4)), torch.randn(3, 4)),
    (nn.RMSNorm(4), torch.randn(4)),
    (nn.InstanceNorm1d(3, affine=True), torch.randn(3, 5)),
    (nn.InstanceNorm2d(3, affine=True), torch.randn(3, 4, 4)),
], ids=["layernorm", "layernorm-shape2", "rmsnorm", "instancenorm1d", "instancenorm2d"])
def test_unbatched_input_is_refused(norm, x):
    with gradhooks.attach(nn.Sequential(norm)) as gh:
        with pytest.raises(gradhooks.BatchSizeError, match=r"'0' \(.*Norm.*\).*batch"):
            gh.model(x)


@pytest.mark.parametrize("rule,norm", [(GroupNormRule(), nn.GroupNorm(1, 4)),
                                       (BatchNormRule(), nn.BatchNorm1d(4))], ids=["groupnorm", "batchnorm"])
def test_channel_norm_batch_size_needs_batch_and_channel_dims(rule, norm):
    """A 1-D input, which torch itself refuses before the hook runs; called directly the rule says why."""
    with pytest.raises(gradhooks.BatchSizeError, match=r"\(B, C, \*spatial\) with at least 2 dims"):
        rule.batch_size(norm, torch.randn(4), True)


BATCHNORMS = {
    "batchnorm1d-BC": (lambda **kw: nn.BatchNorm1d(4, **kw), (3, 4)),
    "batchnorm1d-BCL": (lambda **kw: nn.BatchNorm1d(4, **kw), (3, 4, 5)),
    "batchnorm2d": (lambda **kw: nn.BatchNorm2d(3, **kw), (3, 3, 4, 4)),
    "batchnorm3d": (lambda **kw: nn.BatchNorm3d(3, **kw), (3, 3, 2, 3, 2)),
}


@pytest.mark.parametrize("case", list(BATCHNORMS.values()), ids=list(BATCHNORMS))
def test_batchnorm_training_mode_is_refused_at_the_forward(case):
    make, shape = case
    model = nn.Sequential(nn.Identity(), make())
    with gradhooks.attach(model) as gh:
        with pytest.raises(gradhooks.UnsupportedCallError) as e:
            gh.model(torch.randn(*shape))
    msg = str(e.value)
    assert "'1' (BatchNorm" in msg and "training mode" in msg and "whole batch" in msg
    assert "nn.GroupNorm" in msg and "model.eval()" in msg
    assert "attach(model, allow_batchnorm_train=True)" in msg


@pytest.mark.parametrize("case", list(BATCHNORMS.values()), ids=list(BATCHNORMS))
def test_batchnorm_without_running_stats_is_refused_in_eval_mode(case):
    make, shape = case
    model = make(track_running_stats=False).eval()
    with gradhooks.attach(model) as gh:
        with pytest.raises(gradhooks.UnsupportedCallError) as e:
            gh.model(torch.randn(*shape))
    msg = str(e.value)
    assert "track_running_stats=False" in msg and "nn.GroupNorm" in msg
    assert "allow_batchnorm_train=True" in msg and "model.eval()" not in msg


def batch_standardised(x, eps):
    dims = [0] + list(range(2, x.dim()))
    return (x - x.mean(dims, keepdim=True)) / torch.sqrt(x.var(dims, unbiased=False, keepdim=True) + eps)


# (case, batch): torch refuses BatchNorm1d training on a (1, C) batch, so that one runs with B=4 only
OPT_IN = [(k, b) for k in BATCHNORMS for b in (1, 4) if not (b == 1 and k == "batchnorm1d-BC")]


@pytest.mark.parametrize("stats", ["train", "nostats-eval"])
@pytest.mark.parametrize("key,batch", OPT_IN, ids=[f"{k}-B{b}" for k, b in OPT_IN])
def test_batchnorm_opt_in_gives_contributions_that_sum_to_the_batch_gradient(
        key, batch, stats, loss_reduction, dtype):
    """allow_batchnorm_train=True: sum_s g x̂_batch per sample (batch statistics held fixed);
    they sum to param.grad. They are not per-sample gradients (see the next test)."""
    make, shape = BATCHNORMS[key]
    bn = randomised(make() if stats == "train" else make(track_running_stats=False).eval()).to(dtype)
    x = torch.randn(batch, *shape[1:], dtype=dtype)
    w = torch.rand(batch, dtype=dtype) + 0.5
    with gradhooks.attach(bn, loss_reduction=loss_reduction, allow_batchnorm_train=True) as gh:
        h = bn(x)
        h.retain_grad()
        weighted_square_loss(loss_reduction)(torch.tanh(h), w).backward()
        ours = gh.per_sample_grads()
    scale = batch if loss_reduction == "mean" else 1
    g = h.grad * scale
    expected = {"weight": g * batch_standardised(x, bn.eps), "bias": g}
    for name, p in bn.named_parameters():
        e = expected[name].reshape(batch, shape[1], -1).sum(-1)
        assert ours[name].dtype == dtype
        assert (ours[name] - e).abs().max() <= RTOL[dtype] * e.abs().max(), name
        bound = RTOL[dtype] * e.abs().sum(0).max()
        assert (ours[name].sum(0) - scale * p.grad).abs().max() <= bound, name


def test_batchnorm_opt_in_contributions_are_not_per_sample_gradients():
    """With batch statistics a sample's loss depends on the other samples: the looped gradient
    (each sample normalised alone) differs from the contribution, which is what attach documents."""
    bn = randomised(nn.BatchNorm1d(3)).double()
    x, w = torch.randn(4, 3, 5, dtype=torch.float64), torch.rand(4, dtype=torch.float64) + 0.5
    loss_fn = weighted_square_loss("sum")
    with gradhooks.attach(bn, loss_reduction="sum", allow_batchnorm_train=True) as gh:
        loss_fn(torch.tanh(bn(x)), w).backward()
        ours = gh.per_sample_grads()
    looped = loop_grads(nn.Sequential(bn, nn.Tanh()), loss_fn, x, w)
    assert (ours["weight"] - looped["0.weight"]).abs().max() > 1e-3 * looped["0.weight"].abs().max()


@pytest.mark.parametrize("bn", ["affine-false", "frozen"])
def test_batchnorm_in_training_without_trainable_parameters_is_still_refused(bn):
    norm = nn.BatchNorm1d(3, affine=(bn != "affine-false"))
    if bn == "frozen":
        norm.requires_grad_(False)
    model = nn.Sequential(nn.Conv1d(2, 3, 3), norm, nn.Conv1d(3, 2, 3)).train()
    with gradhooks.attach(model) as gh:
        with pytest.raises(gradhooks.UnsupportedCallError, match=r"'1' \(BatchNorm1d\)"):
            model(torch.randn(4, 2, 8))
        model.eval()  # running statistics: fine
        (model(torch.randn(4, 2, 8)) ** 2).sum().backward()
        assert set(gh.per_sample_grads()) == {"0.weight", "0.bias", "2.weight", "2.bias"}
