"""Several top-level forwards before one backward: refused at the read (row n would be sample n
of every forward added up), unless attach(forwards="same_samples") declares that every forward
saw the same samples (two augmentations of one batch)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks

from conftest import assert_close_to_loop


def _model(dtype=torch.float64):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def test_two_forwards_of_different_samples_are_refused():
    model = _model()
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 3, (8,))
    with gradhooks.attach(model) as gh:
        (F.cross_entropy(model(x[:4]), y[:4]) + F.cross_entropy(model(x[4:]), y[4:])).backward()
        for read in (gh.per_sample_grads, gh.per_sample_grad_norms,
                     lambda: gh.clip_and_accumulate(1.0)):
            with pytest.raises(gradhooks.GradHooksError, match="2 forwards.*same_samples"):
                read()
        F.cross_entropy(model(x), y).backward()  # one forward: fine again
        assert gh.per_sample_grads()["0.weight"].shape == (8, 8, 4)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_two_views_of_the_same_samples(reduction, dtype):
    """Per-sample loss l_n = f(m(x1_n)) + f(m(x2_n)); its gradient by a loop written here."""
    model = _model(dtype)
    x1, y = torch.randn(5, 4, dtype=dtype), torch.randint(0, 3, (5,))
    x2 = x1 + 0.1 * torch.randn(5, 4, dtype=dtype)
    ref = {n: [] for n, _ in model.named_parameters()}
    for i in range(5):
        model.zero_grad()
        (F.cross_entropy(model(x1[i:i + 1]), y[i:i + 1])
         + F.cross_entropy(model(x2[i:i + 1]), y[i:i + 1])).backward()
        for n, p in model.named_parameters():
            ref[n].append(p.grad.clone())
    ref = {n: torch.stack(g) for n, g in ref.items()}
    with gradhooks.attach(model, loss_reduction=reduction, forwards="same_samples") as gh:
        (F.cross_entropy(model(x1), y, reduction=reduction)
         + F.cross_entropy(model(x2), y, reduction=reduction)).backward()
        assert_close_to_loop(gh.per_sample_grads(), ref, dtype)


def test_forwards_option_is_checked():
    with pytest.raises(ValueError, match="forwards must be one of"):
        gradhooks.attach(_model(), forwards="concat")
