"""Opacus users keep their pipeline: gradhooks supplies the per-sample gradients (or the clipped
sum) and Opacus' ``DPDataLoader`` (Poisson sampling, empty batches included), ``DPOptimizer``
(clipping, noise, scaling) and its privacy accountant do the rest. Checked against Opacus' own
engine (``PrivacyEngine.make_private``, ``GradSampleModule`` in hooks mode) run from the same
seeds: the parameters after every epoch, float64, and epsilon from the accountant.

The set-up mirrors what ``make_private`` does inside (README, "Opacus' pipeline with
gradhooks"): the data loader through ``DPDataLoader.from_data_loader``, ``sample_rate = 1 /
len(loader)``, ``expected_batch_size = len(dataset) * sample_rate``, and the accountant's step
hook on the optimizer.
"""
import pytest
import torch
import torch.nn.functional as F
from opacus import PrivacyEngine
from opacus.accountants import RDPAccountant
from opacus.data_loader import DPDataLoader
from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradhooks

N, BATCH, EPOCHS, LR = 24, 2, 2, 0.5  # sample rate 1/12: Poisson batches of 0 to ~6 samples
SIGMA, C, DELTA = 0.8, 0.3, 1e-5


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv1d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(12, 3)).double()


def dataset():
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(N, 2, 6, generator=g, dtype=torch.float64),
                         torch.randint(0, 3, (N,), generator=g))


def opacus_engine():
    """Opacus' own pipeline: ``PrivacyEngine.make_private`` with ``GradSampleModule``."""
    model = make_model()
    engine = PrivacyEngine(accountant="rdp")
    module, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        data_loader=DataLoader(dataset(), batch_size=BATCH), noise_multiplier=SIGMA,
        max_grad_norm=C, poisson_sampling=True,
        noise_generator=torch.Generator().manual_seed(2))

    def step(x, y):
        F.cross_entropy(module(x), y).backward()
        opt.step()

    return model, opt, loader, step, engine.accountant, None


def gradhooks_pipeline(mode):
    """The same pipeline with gradhooks: ``"grad_sample"`` sets ``p.grad_sample`` for Opacus'
    ``DPOptimizer`` (which clips); ``"ghost"`` writes the clipped sum into ``p.grad`` (book-keeping
    ghost clipping, no per-sample tensor) for Opacus' ``DPOptimizerFastGradientClipping``, which
    adds the noise and scales."""
    model = make_model()
    loader = DPDataLoader.from_data_loader(DataLoader(dataset(), batch_size=BATCH))
    sample_rate = 1 / len(loader)
    expected = int(len(loader.dataset) * sample_rate)
    cls = DPOptimizer if mode == "grad_sample" else DPOptimizerFastGradientClipping
    opt = cls(torch.optim.SGD(model.parameters(), lr=LR), noise_multiplier=SIGMA,
              max_grad_norm=C, expected_batch_size=expected,
              generator=torch.Generator().manual_seed(2))
    accountant = RDPAccountant()
    opt.attach_step_hook(accountant.get_optimizer_hook_fn(sample_rate=sample_rate))
    gh = gradhooks.attach(model, loss_reduction="mean" if mode == "grad_sample" else "sum")

    def step(x, y):
        if mode == "grad_sample":
            F.cross_entropy(model(x), y).backward()
            gh.per_sample_grads()  # p.grad_sample: (B, *p.shape), also (0, *p.shape)
        else:
            gh.backward(F.cross_entropy(model(x), y, reduction="sum"))
            gh.clip_and_accumulate(C)  # p.grad = sum_n min(1, C / ||g_n||) g_n
        opt.step()

    return model, opt, loader, step, accountant, gh


def train(pipeline, seed=3):
    """Runs ``EPOCHS`` epochs; returns the model's parameters after each epoch, the batch
    sizes Poisson sampling drew, and epsilon."""
    model, opt, loader, step, accountant, _ = pipeline
    torch.manual_seed(seed)  # the Poisson sampler draws from torch's global generator
    params, sizes = [], []
    for _ in range(EPOCHS):
        for x, y in loader:
            sizes.append(len(x))
            opt.zero_grad()
            step(x, y)
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return params, sizes, accountant.get_epsilon(DELTA)


@pytest.fixture(scope="module")
def reference():
    return train(opacus_engine())


def test_grad_sample_path_takes_opacus_engine_steps(reference):
    ref_params, ref_sizes, ref_eps = reference
    pipeline = gradhooks_pipeline("grad_sample")
    try:
        params, sizes, eps = train(pipeline)
    finally:
        pipeline[-1].detach()
    assert sizes == ref_sizes and 0 in sizes and max(sizes) > 2  # empty and clipped batches ran
    assert eps == ref_eps
    for ours, theirs in zip(params, ref_params):
        for name in theirs:
            torch.testing.assert_close(ours[name], theirs[name], rtol=1e-13, atol=1e-15,
                                       msg=lambda m: f"{name}: {m}")
    assert any(not torch.equal(ref_params[0][n], make_model().state_dict()[n])
               for n in ref_params[0])  # training moved the parameters


def test_clipped_sum_path_takes_opacus_engine_steps(reference):
    """Only the clipping factor differs: Opacus clips by ``C / (||g_n|| + 1e-6)``, gradhooks by
    ``C / ||g_n||``, so a clipped sample's weight differs by a relative ``~1e-6 / ||g_n||``."""
    ref_params, ref_sizes, ref_eps = reference
    pipeline = gradhooks_pipeline("ghost")
    try:
        params, sizes, eps = train(pipeline)
    finally:
        pipeline[-1].detach()
    assert sizes == ref_sizes and eps == ref_eps
    for ours, theirs in zip(params, ref_params):
        for name in theirs:
            torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=1e-6,
                                       msg=lambda m: f"{name}: {m}")


def test_empty_poisson_batch_gives_empty_grad_sample():
    """An empty batch gives ``(0, *shape)`` per-sample gradients (what DPOptimizer expects: it
    then clips nothing and adds only the noise), with a mean loss that is NaN."""
    model = make_model()
    with gradhooks.attach(model) as gh:
        loss = F.cross_entropy(model(torch.zeros(0, 2, 6, dtype=torch.float64)),
                               torch.zeros(0, dtype=torch.long))
        loss.backward()
        grads = gh.per_sample_grads()
        assert torch.isnan(loss)
        for name, p in model.named_parameters():
            assert grads[name].shape == (0, *p.shape) and p.grad_sample.shape == (0, *p.shape)
