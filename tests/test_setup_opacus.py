"""Opacus' own layers and pipeline with gradhooks: its DP RNN layers (each weight registered twice)
are exact, and Opacus' DPOptimizer consuming gradhooks' grad_sample takes the same steps as
Opacus' own GradSampleModule."""
import opacus  # noqa: E402
import opacus.layers  # noqa: E402
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks

from conftest import assert_close_to_loop, loop_grads


@pytest.mark.parametrize("cls", ["DPLSTM", "DPGRU", "DPRNN"])
@pytest.mark.parametrize("layers", [1, 2])
def test_opacus_dp_rnn_layers_match_loop(cls, layers, dtype):
    torch.manual_seed(0)
    rnn = getattr(opacus.layers, cls)(3, 4, num_layers=layers, batch_first=True).to(dtype)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.head = rnn, nn.Linear(4, 2).to(dtype)

        def forward(self, x):
            return self.head(self.rnn(x)[0][:, -1])

    model = Model()
    x, y = torch.randn(3, 5, 3, dtype=dtype), torch.randint(0, 2, (3,))
    ref = loop_grads(model, F.cross_entropy, x, y)
    with gradhooks.attach(model) as gh:
        F.cross_entropy(model(x), y).backward()
        ours = gh.per_sample_grads()
    assert "rnn.weight_ih_l0" in ours and "rnn.bias_hh_l0" in ours  # nn.LSTM's names
    assert_close_to_loop(ours, ref, dtype)


def test_dp_optimizer_steps_equal_opacus_grad_sample_module():
    from opacus.grad_sample import GradSampleModule
    from opacus.optimizers import DPOptimizer

    torch.manual_seed(0)
    make = lambda: nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))  # noqa: E731
    ours_model, theirs_model = make(), make()
    theirs_model.load_state_dict(ours_model.state_dict())
    theirs = GradSampleModule(theirs_model)
    opts = []
    for params in (ours_model.parameters(), theirs.parameters()):
        opts.append(DPOptimizer(torch.optim.SGD(params, lr=0.1), noise_multiplier=1.0,
                                max_grad_norm=0.5, expected_batch_size=8))
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    with gradhooks.attach(ours_model) as gh:
        for _ in range(3):
            for model, opt, seed in ((ours_model, opts[0], 1), (theirs, opts[1], 1)):
                torch.manual_seed(seed)
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                if model is ours_model:
                    gh.per_sample_grads()
                opt.step()
    for (n, p), q in zip(ours_model.named_parameters(), theirs_model.parameters()):
        assert torch.equal(p, q), n
