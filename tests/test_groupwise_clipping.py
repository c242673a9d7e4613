"""Group-wise (per-layer) clipping against a loop written here: each sample's gradient clipped
per parameter group to that group's bound, summed, divided by D; noise with the total bound."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks

from conftest import loop_grads

F64 = torch.float64


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv1d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(12, 5), nn.Tanh(),
                         nn.Linear(5, 3)).double()


def _expected(ref, groups, bounds, divisor):
    out = {}
    norms = []
    for names, c in zip(groups, bounds):
        norm = torch.sqrt(sum(ref[n].flatten(1).square().sum(1) for n in names))
        norms.append(norm)
        factor = (c / norm).clamp(max=1.0)
        for n in names:
            out[n] = (ref[n] * factor.view(-1, *[1] * (ref[n].dim() - 1))).sum(0) / divisor
    return out, torch.stack(norms, 1)


@pytest.mark.parametrize("method", ["ghost", "materialize"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_groupwise_clipping_matches_loop(method, reduction):
    model = _model()
    x, y = torch.randn(6, 2, 6, dtype=F64), torch.randint(0, 3, (6,))
    loss = lambda o, t: F.cross_entropy(o, t, reduction=reduction)  # noqa: E731
    ref = loop_grads(model, loss, x, y)
    groups = [["0.weight", "0.bias"], ["3.weight", "3.bias"], ["5.weight", "5.bias"]]
    per_layer = torch.sqrt(torch.stack([sum(ref[n].flatten(1).square().sum(1) for n in g)
                                        for g in groups], 1))
    bounds = [float(per_layer[:, k].median()) for k in range(3)]
    expected, norms = _expected(ref, groups, bounds, 6 if reduction == "mean" else 1)
    with gradhooks.attach(model, loss_reduction=reduction) as gh:
        loss(model(x), y).backward()
        got = gh.clip_and_accumulate(bounds, method=method, groups=groups)
    torch.testing.assert_close(got, norms, rtol=1e-10, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=1e-10, atol=1e-14)


def test_groupwise_noise_uses_the_total_bound():
    model = _model()
    x, y = torch.randn(4, 2, 6, dtype=F64), torch.randint(0, 3, (4,))
    groups = [[n for n, _ in model.named_parameters() if n.startswith("0.")],
              [n for n, _ in model.named_parameters() if not n.startswith("0.")]]
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        F.cross_entropy(model(x), y, reduction="sum").backward()
        gh.clip_and_accumulate([3.0, 4.0], groups=groups, noise_multiplier=0.5,
                               generator=torch.Generator().manual_seed(1))
        noisy = {n: p.grad.clone() for n, p in model.named_parameters()}
        F.cross_entropy(model(x), y, reduction="sum").backward()
        gh.clip_and_accumulate([3.0, 4.0], groups=groups)
    gen = torch.Generator().manual_seed(1)
    for n, p in model.named_parameters():
        z = torch.randn(p.shape, generator=gen, dtype=F64)
        torch.testing.assert_close(noisy[n] - p.grad, 0.5 * 5.0 * z, rtol=1e-10, atol=1e-12)


def test_groups_must_partition_the_trainable_parameters():
    model = _model()
    x, y = torch.randn(4, 2, 6, dtype=F64), torch.randint(0, 3, (4,))
    with gradhooks.attach(model) as gh:
        F.cross_entropy(model(x), y).backward()
        with pytest.raises(ValueError, match="not in a group: 5.weight"):
            gh.clip_and_accumulate(1.0, groups=[["0.weight", "0.bias", "3.weight", "3.bias"]])
        with pytest.raises(ValueError, match="in two groups"):
            gh.clip_and_accumulate(1.0, groups=[["0.weight"], ["0.weight"]])
        with pytest.raises(ValueError, match="2 bounds for 1 groups"):
            gh.clip_and_accumulate([1.0, 2.0], groups=[[n for n, _ in model.named_parameters()]])
