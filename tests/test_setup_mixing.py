"""A loss or a model that mixes the samples of a batch has no per-sample gradients, and the sum
check cannot see it (the rows still add up to the batch gradient). A mixing op the forward shows
is refused at the read (tests/test_mixing.py); for what it cannot show (a loss that mixes, an
accepted mixing op) gh.check_samples() recomputes a few samples alone and refuses."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks


class Centered(nn.Module):
    """h - h.mean(0) inside the model: each output depends on every sample."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h - h.mean(0, keepdim=True))


def _info_nce(z, _):
    """InfoNCE over the batch: sample n's loss depends on every other sample."""
    z = F.normalize(z, dim=1)
    logits = z @ z.t() / 0.5
    return F.cross_entropy(logits, torch.arange(z.shape[0]))


def test_model_that_mixes_samples_is_refused_at_the_read():
    # the forward shows the mixing op (h.mean(0) met the batch again): refused, by name
    torch.manual_seed(0)
    model = Centered().double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    with gradhooks.attach(model) as gh:
        F.cross_entropy(model(x), y).backward()
        with pytest.raises(gradhooks.SampleMixingError, match=r"mean over the batch dim.*'a'"):
            gh.per_sample_grads()
        with pytest.raises(gradhooks.SampleMixingError):
            gh.check_samples(F.cross_entropy, x, y, samples=2)


def test_accepted_mixing_is_still_caught_by_the_spot_check():
    torch.manual_seed(0)
    model = Centered().double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    with gradhooks.attach(model, allow_sample_mixing=True) as gh:
        F.cross_entropy(model(x), y).backward()
        gh.per_sample_grads()  # the sum check passes: the rows add up
        with pytest.raises(gradhooks.GradientMismatchError, match="mixes the samples"):
            gh.check_samples(F.cross_entropy, x, y, samples=2)


def test_loss_that_mixes_samples_is_caught_by_the_spot_check():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 5)).double()
    x = torch.randn(6, 4, dtype=torch.float64)
    with gradhooks.attach(model) as gh:  # (the loss's graph refuses it first: test_loss_graph)
        _info_nce(model(x), None).backward()
        with pytest.raises(gradhooks.SampleMixingError, match="MmBackward"):
            gh.check_samples(lambda out, y: F.cross_entropy(out, y), x,
                             torch.zeros(6, dtype=torch.long), samples=6)
    with gradhooks.attach(model, allow_sample_mixing=True) as gh:  # (accepted: the spot check)
        _info_nce(model(x), None).backward()
        with pytest.raises(gradhooks.GradientMismatchError, match="mixes the samples"):
            gh.check_samples(lambda out, y: F.cross_entropy(out, y), x,
                             torch.zeros(6, dtype=torch.long), samples=6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_spot_check_passes_on_a_per_sample_loss(dtype):
    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv1d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(12, 3)).to(dtype)
    x, y = torch.randn(7, 2, 6, dtype=dtype), torch.randint(0, 3, (7,))
    with gradhooks.attach(model) as gh:
        F.cross_entropy(model(x), y).backward()
        gh.check_samples(F.cross_entropy, x, y, samples=7,
                         generator=torch.Generator().manual_seed(0))
