"""Attaching to real training set-ups: DDP, input-derivative losses, autocast, containers,
no_grad / inference_mode forwards."""
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks

import two_process
from conftest import assert_close_to_loop, check_against_loop, loop_grads, weighted_square_loss


def mlp():
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


# --------------------------------------------------------------------------- DDP
def _with_ddp(check, rank, world):
    """A seeded DDP-wrapped MLP (float64) and a copy of it for the reference, handed to the
    module-level ``check(rank, world, base, ref_model, ddp)``."""
    torch.manual_seed(0)
    base = mlp().double()
    ref_model = mlp().double()
    ref_model.load_state_dict(base.state_dict())
    check(rank, world, base, ref_model, nn.parallel.DistributedDataParallel(base))


def _spawn(check):
    two_process.run(functools.partial(_with_ddp, check))


def _check_per_sample(rank, world, base, ref_model, ddp):
    """Per-sample gradients of each rank's local batch; DDP's all-reduce of .grad untouched."""
    loss_fn = weighted_square_loss("mean")
    batches = []
    for r in range(world):
        g = torch.Generator().manual_seed(100 + r)
        batches.append((torch.randn(3 + r, 5, generator=g, dtype=torch.float64),
                        torch.rand(3 + r, generator=g, dtype=torch.float64)))
    x, y = batches[rank]
    with gradhooks.attach(ddp, loss_reduction="mean") as gh:
        loss_fn(ddp(x), y).backward()
        ours = {k.removeprefix("module."): v for k, v in gh.per_sample_grads().items()}
    ref = loop_grads(ref_model, loss_fn, x, y)
    assert_close_to_loop(ours, ref, torch.float64)
    # DDP's all-reduce is undisturbed: .grad is the average over ranks of each rank's
    # mean-loss gradient, i.e. of the mean of that rank's per-sample gradients.
    for name, p in base.named_parameters():
        expected = torch.stack([loop_grads(ref_model, loss_fn, xb, yb)[name].mean(0)
                                for xb, yb in batches]).mean(0)
        torch.testing.assert_close(p.grad, expected, rtol=1e-12, atol=1e-12)


def _check_clipping(sizes, rank, world, base, ref_model, ddp):
    """Book-keeping (ghost, materialised) and two-pass clipping of a DDP model: every rank ends
    with the clipped, noised mean of the ranks' concatenated batch, the noise added once; also
    when one rank's (Poisson) batch is empty: it joins every collective."""
    batches = []
    for r in range(world):
        g = torch.Generator().manual_seed(200 + r)
        batches.append((torch.randn(sizes[r], 5, generator=g, dtype=torch.float64),
                        torch.randint(0, 3, (sizes[r],), generator=g)))
    x_all = torch.cat([b[0] for b in batches])
    y_all = torch.cat([b[1] for b in batches])
    ref = loop_grads(ref_model, F.cross_entropy, x_all, y_all)
    norms = torch.sqrt(sum(t.flatten(1).square().sum(1) for t in ref.values()))
    c, sigma = float(norms.median()), 0.7
    gen = torch.Generator().manual_seed(5)
    expected = {}
    for name, t in ref.items():
        clipped = (t * (c / norms).clamp(max=1).view(-1, *[1] * (t.dim() - 1))).sum(0)
        z = torch.randn(t.shape[1:], generator=gen, dtype=torch.float64)
        expected[name] = (clipped + sigma * c * z) / len(x_all)
    x, y = batches[rank]
    with gradhooks.attach(ddp) as gh:
        for method in ("ghost", "materialize", "two_pass"):
            ddp.zero_grad()
            out = ddp(x)
            noise = torch.Generator().manual_seed(5)
            if method == "two_pass":
                gh.clipped_backward(F.cross_entropy(out, y, reduction="none"), c,
                                    noise_multiplier=sigma, generator=noise)
            else:
                F.cross_entropy(out, y).backward()
                gh.clip_and_accumulate(c, method=method, noise_multiplier=sigma,
                                       generator=noise)
            for name, p in base.named_parameters():
                torch.testing.assert_close(p.grad, expected[name], rtol=1e-10, atol=1e-12,
                                           msg=lambda m: f"{method} {name}: {m}")


@pytest.mark.parametrize("sizes", [(3, 4), (4, 0)], ids=["unequal", "one-rank-empty"])
def test_ddp_clipping_two_processes_gloo(sizes):
    _spawn(functools.partial(_check_clipping, sizes))


def test_ddp_two_processes_gloo():
    _spawn(_check_per_sample)


# --------------------------------------------------------------------------- input derivatives
def test_gradient_penalty_is_refused_not_wrong():
    model = mlp().double()
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    with gradhooks.attach(model) as gh:
        out = model(x)
        gx, = torch.autograd.grad(out.sum(), x, create_graph=True)
        loss = (out ** 2).mean() + (gx.norm(dim=1) - 1).pow(2).mean()
        loss.backward()
        with pytest.raises(gradhooks.HigherOrderGradError, match="create_graph=True.*torch.func"):
            gh.per_sample_grads()


def test_laplacian_loss_is_refused():
    model = nn.Sequential(nn.Linear(2, 6), nn.Tanh(), nn.Linear(6, 1)).double()
    x = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    with gradhooks.attach(model) as gh:
        u = model(x)
        du, = torch.autograd.grad(u.sum(), x, create_graph=True)
        lap = sum(torch.autograd.grad(du[:, i].sum(), x, create_graph=True)[0][:, i] for i in range(2))
        (lap ** 2).mean().backward()
        with pytest.raises(gradhooks.HigherOrderGradError):
            gh.per_sample_grads()


def test_next_batch_after_a_refused_one_works():
    model = mlp().double()
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        out = model(x)
        gx, = torch.autograd.grad(out.sum(), x, create_graph=True)
        gx.pow(2).sum().backward()
        with pytest.raises(gradhooks.HigherOrderGradError):
            gh.per_sample_grads()
        xb = torch.randn(4, 5, dtype=torch.float64)
        (model(xb) ** 2).sum().backward()
        assert gh.per_sample_grads()["0.weight"].shape == (4, 8, 5)


def test_input_gradient_without_create_graph_is_caught_by_the_sum_check():
    model = mlp().double()
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    with gradhooks.attach(model) as gh:
        out = model(x)
        torch.autograd.grad(out.sum(), x, retain_graph=True)  # a saliency map
        (out ** 2).mean().backward()
        with pytest.raises(gradhooks.GradientMismatchError):
            gh.per_sample_grads()


# --------------------------------------------------------------------------- autocast
class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 5 * 5, 3)

    def forward(self, x):
        return self.fc(F.relu(self.conv(x)).flatten(1))


@pytest.mark.parametrize("make,shape", [(mlp, (5,)), (ConvNet, (2, 5, 5))], ids=["mlp", "cnn"])
def test_autocast_bfloat16_gives_float32_per_sample_grads(make, shape):
    model = make()
    x, y = torch.randn(6, *shape), torch.rand(6)
    loss_fn = weighted_square_loss("mean")

    def fwd_loss(xb, yb):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(xb)
        return loss_fn(out.float(), yb)

    ref = {n: [] for n, _ in model.named_parameters()}
    for i in range(6):
        model.zero_grad()
        fwd_loss(x[i:i + 1], y[i:i + 1]).backward()
        for n, p in model.named_parameters():
            ref[n].append(p.grad.clone())
    model.zero_grad()
    with gradhooks.attach(model) as gh:
        fwd_loss(x, y).backward()
        ours = gh.per_sample_grads()  # the sum check passes at bfloat16 tolerance
    for n, p in model.named_parameters():
        r = torch.stack(ref[n])
        assert ours[n].dtype == torch.float32 == p.dtype
        # the loop's weight gradients are bfloat16 matmuls; ours accumulate in float32
        assert (ours[n] - r).abs().max() <= 2e-2 * r.abs().max(), n


def test_per_sample_grads_read_inside_autocast_still_float32():
    model = mlp()
    x = torch.randn(4, 5)
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        (model(x) ** 2).sum().backward()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ours = gh.per_sample_grads()
    ref = loop_grads(model, lambda out, _: (out ** 2).sum(), x, torch.zeros(4))
    assert_close_to_loop(ours, ref, torch.float32)


# --------------------------------------------------------------------------- containers
class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d, d), nn.Linear(d, d)])
        self.heads = nn.ModuleDict({"a": nn.Linear(d, 2), "b": nn.Linear(d, 2)})
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        h = x
        for layer in self.layers:
            h = h + self.act(layer(h))  # residual, in-place activation after the layer
        return self.heads["a"](h) * self.heads["b"](h)


@pytest.mark.parametrize("batch", [1, 4], ids=["B1", "B4"])
def test_modulelist_moduledict_residual_inplace(batch, loss_reduction, dtype):
    check_against_loop(nn.Sequential(nn.Linear(3, 6), Block(6)), torch.randn(batch, 3),
                       torch.rand(batch), loss_reduction=loss_reduction, dtype=dtype)


@pytest.mark.parametrize("ctx", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_no_grad_and_inference_mode_forwards_capture_nothing(ctx):
    model = mlp()
    with gradhooks.attach(model) as gh:
        with ctx():
            model(torch.randn(7, 5))
        assert gh.batch_size is None and not gh.recorder.records
        with pytest.raises(gradhooks.NoBackwardError):
            gh.per_sample_grads()
        (model(torch.randn(2, 5)) ** 2).sum().backward()
        assert gh.per_sample_grads()["0.weight"].shape[0] == 2
        with ctx():  # an evaluation pass between steps keeps the results
            model(torch.randn(9, 5))
        assert gh.per_sample_grads()["0.weight"].shape[0] == 2
