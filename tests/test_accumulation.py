"""DP-SGD over logical batches larger than memory (gradhooks.readers.dp.accumulation): micro-batches
clipped with accumulate=True, the noise added once and the division by the logical batch size
done once by finish_step, against the looped clipped mean of the whole logical batch; the
errors where a gradient would be dropped silently, and the legitimate cases that must not
raise (zero_grad, retain_graph)."""
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks

import two_process
from conftest import RTOL, loop_grads

C = 0.4  # below most per-sample norms of the models here: most samples are clipped
PATHS = ["ghost", "gh_backward", "materialize", "two_pass"]
SPLITS = {"whole": [8], "uneven": [3, 1, 4], "empty_and_one": [1, 0, 5, 2], "leading_empty": [0, 8]}


def mlp():
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def cnn():
    return nn.Sequential(nn.Conv1d(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(),
                         nn.Linear(3 * 5, 3))


SHAPES = {mlp: (4,), cnn: (2, 5)}


def _data(make, dtype, b=8, seed=0):
    torch.manual_seed(seed)
    model = make().to(dtype)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(b, *SHAPES[make], generator=g, dtype=dtype)
    y = torch.randint(0, 3, (b,), generator=g)
    return model, x, y


def _clipped_sum(model, x, y, bounds=(C,), groups=None):
    """The looped reference: one forward/backward per sample, each clipped (flat, or per
    group), summed over the whole logical batch: {name: param.shape}."""
    ref = loop_grads(model, F.cross_entropy, x, y)
    names = list(ref)
    groups = groups or [names]
    out = {n: torch.zeros_like(t[0]) for n, t in ref.items()}
    for k, group in enumerate(groups):
        norms = torch.sqrt(sum(ref[n].flatten(1).square().sum(1) for n in group))
        c = (bounds[k] / norms).clamp(max=1)
        for n in group:
            out[n] = (ref[n] * c.view(-1, *[1] * (ref[n].dim() - 1))).sum(0)
    return out


def _micro_step(gh, model, xb, yb, path, reduction, **clip):
    """Forward, backward and clip of one micro-batch, accumulated."""
    out = model(xb)
    if path == "two_pass":
        return gh.clipped_backward(F.cross_entropy(out, yb, reduction="none"), clip.pop("c", C),
                                   accumulate=True)
    loss = F.cross_entropy(out, yb, reduction=reduction)
    if path == "gh_backward":
        gh.backward(loss)
    else:
        loss.backward()
    return gh.clip_and_accumulate(clip.pop("c", C), accumulate=True,
                                  method="materialize" if path == "materialize" else "ghost",
                                  **clip)


def _accumulated(model, x, y, splits, path, reduction, finish=None, **clip):
    """param.grad after the micro-batches ``splits`` of (x, y) and finish_step(**finish)."""
    with gradhooks.attach(model, loss_reduction=reduction) as gh:
        for xb, yb in _split(x, y, splits):
            _micro_step(gh, model, xb, yb, path, reduction, **clip)
        assert gh.finish_step(**(finish or {})) == len(x)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return grads


def _split(x, y, splits):
    start = 0
    for b in splits:
        yield x[start:start + b], y[start:start + b]
        start += b
    assert start == len(x)


def _close(ours, ref, dtype):
    for n, t in ref.items():
        scale = float(t.abs().max())
        assert float((ours[n] - t).abs().max()) <= RTOL[dtype] * scale, n


# ------------------------------------------------------------------------- against the loop
@pytest.mark.parametrize("splits", list(SPLITS.values()), ids=list(SPLITS))
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_accumulation_equals_the_looped_clipped_mean(dtype, path, reduction, splits):
    model, x, y = _data(mlp, dtype)
    ref = _clipped_sum(model, x, y)
    ours = _accumulated(model, x, y, splits, path, reduction)
    d = len(x) if reduction == "mean" else 1  # as clip_and_accumulate on the whole batch
    _close(ours, {n: t / d for n, t in ref.items()}, dtype)


@pytest.mark.parametrize("path", PATHS)
def test_accumulation_conv(path):
    model, x, y = _data(cnn, torch.float64)
    ref = _clipped_sum(model, x, y)
    ours = _accumulated(model, x, y, [2, 0, 3, 3], path, "mean")
    _close(ours, {n: t / len(x) for n, t in ref.items()}, torch.float64)


def test_micro_batches_of_a_lot_mixing_the_paths():
    """Book-keeping and two-pass micro-batches add up alike."""
    model, x, y = _data(mlp, torch.float64)
    ref = _clipped_sum(model, x, y)
    with gradhooks.attach(model) as gh:
        for (xb, yb), path in zip(_split(x, y, [2, 3, 3]), ["two_pass", "ghost", "gh_backward"]):
            _micro_step(gh, model, xb, yb, path, "mean")
        gh.finish_step()
        _close({n: p.grad for n, p in model.named_parameters()},
               {n: t / len(x) for n, t in ref.items()}, torch.float64)


@pytest.mark.parametrize("path", ["ghost", "materialize"])
def test_groupwise_accumulation(path):
    model, x, y = _data(mlp, torch.float64)
    groups, bounds = [["0.weight", "0.bias"], ["2.weight", "2.bias"]], (0.3, 0.2)
    ref = _clipped_sum(model, x, y, bounds, groups)
    gen = torch.Generator().manual_seed(3)
    z = {n: torch.randn(p.shape, generator=gen, dtype=p.dtype) for n, p in model.named_parameters()}
    total = (bounds[0] ** 2 + bounds[1] ** 2) ** 0.5  # the noise's bound: the whole gradient's
    finish = dict(noise_multiplier=0.5, generator=torch.Generator().manual_seed(3))
    ours = _accumulated(model, x, y, [5, 0, 3], path, "sum", c=list(bounds), groups=groups,
                        finish=finish)
    _close(ours, {n: t + 0.5 * total * z[n] for n, t in ref.items()}, torch.float64)


# ------------------------------------------------------------------------- noise and division
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_noise_is_added_once(path, reduction):
    """grad = (clipped sum + sigma C z) / D with z drawn once from the generator, in the order
    of named_parameters; D the expected batch size when given (Poisson sampling)."""
    model, x, y = _data(mlp, torch.float64)
    ref = _clipped_sum(model, x, y)
    sigma, gen = 1.3, torch.Generator().manual_seed(11)
    z = {n: torch.randn(p.shape, generator=gen, dtype=p.dtype) for n, p in model.named_parameters()}
    for expected_size in (None, 10):
        d = expected_size or (len(x) if reduction == "mean" else 1)
        ours = _accumulated(model, x, y, [3, 0, 5], path, reduction,
                            finish=dict(noise_multiplier=sigma, expected_batch_size=expected_size,
                                        generator=torch.Generator().manual_seed(11)))
        _close(ours, {n: (t + sigma * C * z[n]) / d for n, t in ref.items()}, torch.float64)


def test_empty_logical_batch_gets_the_noise_alone():
    model, x, y = _data(mlp, torch.float64, b=0)
    gen = torch.Generator().manual_seed(2)
    z = {n: torch.randn(p.shape, generator=gen, dtype=p.dtype) for n, p in model.named_parameters()}
    for path in PATHS:
        ours = _accumulated(model, x, y, [0, 0], path, "mean",
                            finish=dict(noise_multiplier=0.5,
                                        generator=torch.Generator().manual_seed(2)))
        for n, t in z.items():
            torch.testing.assert_close(ours[n], 0.5 * C * t, rtol=1e-15, atol=0)  # D = 1


def test_grad_is_none_between_micro_batches_and_results_are_per_micro_batch():
    """An accumulate=True clip returns the micro-batch's norms and leaves .grad None (the
    micro-batch's unclipped gradient must not reach an optimizer)."""
    model, x, y = _data(mlp, torch.float64)
    ref = loop_grads(model, F.cross_entropy, x, y)
    norms = torch.sqrt(sum(t.flatten(1).square().sum(1) for t in ref.values()))
    with gradhooks.attach(model) as gh:
        for path, (lo, hi) in zip(["ghost", "two_pass"], [(0, 3), (3, 8)]):
            got = _micro_step(gh, model, x[lo:hi], y[lo:hi], path, "mean")
            torch.testing.assert_close(got, norms[lo:hi], rtol=1e-12, atol=0)
            assert all(p.grad is None for p in model.parameters())
        assert gh.accumulation.samples == 8 and gh.accumulation.micro == 2
        gh.finish_step()
        assert not gh.accumulation.pending


def test_grad_scaler_scale_is_applied_once():
    """With a GradScaler .grad is S times the result (unscaled accumulation), as a clip writes
    it for scaler.step()."""
    model, x, y = _data(mlp, torch.float64)
    ref = _clipped_sum(model, x, y)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    with gradhooks.attach(model, grad_scaler=scaler) as gh:
        for (xb, yb), path in zip(_split(x, y, [3, 0, 5]), ["ghost", "two_pass", "two_pass"]):
            out = model(xb)
            if path == "two_pass":
                gh.clipped_backward(F.cross_entropy(out, yb, reduction="none"), C, accumulate=True)
            else:
                scaler.scale(F.cross_entropy(out, yb)).backward()
                gh.clip_and_accumulate(C, accumulate=True)
        gh.finish_step()
        _close({n: p.grad / 2.0 ** 10 for n, p in model.named_parameters()},
               {n: t / len(x) for n, t in ref.items()}, torch.float64)


def test_grad_scaler_overflow_in_a_micro_batch_skips_the_step():
    torch.manual_seed(2)
    model = mlp()
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)  # float16 grad_outputs overflow
    with gradhooks.attach(model, grad_scaler=scaler) as gh:
        for xb, yb in _split(x, y, [3, 3]):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(xb), yb)
            scaler.scale(loss).backward()
            gh.clip_and_accumulate(1.0, accumulate=True)
        gh.finish_step(noise_multiplier=1.0)
        assert all(bool(torch.isinf(p.grad).all()) for p in model.parameters())


# ------------------------------------------------------------------------- micro_batches
def test_micro_batches_split():
    x, y = torch.arange(10.).view(5, 2), torch.arange(5)
    parts = list(gradhooks.micro_batches((x, y), 2))
    assert [tuple(p[0].shape) for p in parts] == [(2, 2), (2, 2), (1, 2)]
    assert torch.equal(torch.cat([p[1] for p in parts]), y)
    assert [t.shape[0] for t in gradhooks.micro_batches(x, 5)] == [5]
    empty = list(gradhooks.micro_batches([x[:0], y[:0]], 3))  # an empty lot: one empty step
    assert len(empty) == 1 and isinstance(empty[0], list) and empty[0][0].shape == (0, 2)
    with pytest.raises(ValueError, match="max_size"):
        list(gradhooks.micro_batches(x, 0))
    with pytest.raises(ValueError, match="dim 0"):
        list(gradhooks.micro_batches((x, y[:3]), 2))


def test_poisson_lots_from_opacus_split_into_micro_batches():
    """Opacus' DPDataLoader draws the Poisson lots (sizes vary, some empty); micro_batches splits
    them; finish_step divides by the expected lot size: each step equals the loop's."""
    from opacus import data_loader  # (the test extra's: a missing opacus fails, never skips)
    torch.manual_seed(0)
    model = mlp().double()
    x, y = torch.randn(20, 4, dtype=torch.float64), torch.randint(0, 3, (20,))
    loader = data_loader.DPDataLoader.from_data_loader(
        torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=5),
        generator=torch.Generator().manual_seed(4))
    expected_size = loader.sample_rate * len(x)
    lots, grads = [], []
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        for xl, yl in loader:  # (the parameters do not change: no optimizer step)
            lots.append((xl, yl))
            for xb, yb in gradhooks.micro_batches((xl, yl), 2):
                F.cross_entropy(model(xb), yb, reduction="sum").backward()
                gh.clip_and_accumulate(C, accumulate=True)
            gh.finish_step(expected_batch_size=expected_size)
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert len({len(xl) for xl, _ in lots}) > 1  # lots of several sizes
    for (xl, yl), ours in zip(lots, grads):
        ref = (_clipped_sum(model, xl, yl) if len(xl) else
               {n: torch.zeros_like(p) for n, p in model.named_parameters()})
        _close(ours, {n: t / expected_size for n, t in ref.items()}, torch.float64)


# ------------------------------------------------------------------------- errors
def _two_micro_backward_passes(gh, model, x, y, second="loss"):
    F.cross_entropy(model(x[:3]), y[:3]).backward()
    loss = F.cross_entropy(model(x[3:]), y[3:])
    gh.backward(loss) if second == "gh" else loss.backward()


@pytest.mark.parametrize("second", ["loss", "gh"])
@pytest.mark.parametrize("read", ["clip", "clip_accumulate", "two_pass"])
def test_an_earlier_batch_left_in_grad_is_not_dropped_silently(read, second):
    """loss.backward() on micro-batch 1, forward/backward on micro-batch 2, then a clip: .grad
    holds micro-batch 1's gradient, which the clip would overwrite."""
    model, x, y = _data(mlp, torch.float64)
    with gradhooks.attach(model) as gh:
        if read == "two_pass":
            F.cross_entropy(model(x[:3]), y[:3]).backward()
            losses = F.cross_entropy(model(x[3:]), y[3:], reduction="none")
            with pytest.raises(gradhooks.AccumulationError, match="earlier batch.*zero_grad"):
                gh.clipped_backward(losses, C)
            return
        _two_micro_backward_passes(gh, model, x, y, second)
        with pytest.raises(gradhooks.AccumulationError, match="still holds the gradient"):
            gh.clip_and_accumulate(C, accumulate=read == "clip_accumulate")


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_between_batches_is_fine(set_to_none):
    model, x, y = _data(mlp, torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.attach(model) as gh:
        F.cross_entropy(model(x[:3]), y[:3]).backward()  # not clipped: dropped by zero_grad
        opt.zero_grad(set_to_none=set_to_none)
        for step in range(3):
            F.cross_entropy(model(x[3:]), y[3:]).backward()
            gh.clip_and_accumulate(C)
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        # a zero_grad after the forward, before the backward, also counts
        F.cross_entropy(model(x[:3]), y[:3]).backward()
        loss = F.cross_entropy(model(x[3:]), y[3:])
        opt.zero_grad(set_to_none=set_to_none)
        loss.backward()
        gh.clip_and_accumulate(C, accumulate=True)
        gh.finish_step()


def test_backward_passes_through_one_forward_accumulate_by_design():
    """retain_graph=True: two backward passes of one forward are one batch (README, "Batches
    and backward passes"): clipping their sum raises nothing."""
    model, x, y = _data(mlp, torch.float64)
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        out = model(x)
        F.cross_entropy(out[:, :2], y.clamp(max=1), reduction="sum").backward(retain_graph=True)
        F.cross_entropy(out, y, reduction="sum").backward()
        gh.clip_and_accumulate(C)
        out = model(x)  # no zero_grad after the clip: its own write is overwritten, as documented
        F.cross_entropy(out, y, reduction="sum").backward()
        gh.clip_and_accumulate(C)


def test_plain_clip_while_an_accumulation_is_pending():
    model, x, y = _data(mlp, torch.float64)
    with gradhooks.attach(model) as gh:
        _micro_step(gh, model, x[:3], y[:3], "ghost", "mean")
        F.cross_entropy(model(x[3:]), y[3:]).backward()
        with pytest.raises(gradhooks.AccumulationError, match="accumulate=True.*finish_step"):
            gh.clip_and_accumulate(C)
        with pytest.raises(gradhooks.AccumulationError, match="1 micro-batch"):
            gh.clipped_backward(F.cross_entropy(model(x[3:]), y[3:], reduction="none"), C)


def test_finish_step_errors():
    model, x, y = _data(mlp, torch.float64)
    with gradhooks.attach(model) as gh:
        with pytest.raises(gradhooks.AccumulationError, match="nothing accumulated"):
            gh.finish_step()
        F.cross_entropy(model(x), y).backward()
        gh.clip_and_accumulate(C, noise_multiplier=1.0)  # a plain step: finished already
        with pytest.raises(gradhooks.AccumulationError, match="nothing accumulated"):
            gh.finish_step()
        _micro_step(gh, model, x[:3], y[:3], "ghost", "mean")
        gh.backward(F.cross_entropy(model(x[3:]), y[3:]))  # forgot its clip
        with pytest.raises(gradhooks.AccumulationError, match="not clipped into"):
            gh.finish_step()
        gh.clip_and_accumulate(C, accumulate=True)
        with pytest.raises(gradhooks.AccumulationError, match="already clipped"):
            gh.clip_and_accumulate(C, accumulate=True)  # its samples would count twice
        with pytest.raises(ValueError, match="expected_batch_size"):
            gh.finish_step(expected_batch_size=0)
        assert gh.finish_step() == 8


def test_accumulate_argument_errors():
    model, x, y = _data(mlp, torch.float64)
    with gradhooks.attach(model) as gh:
        F.cross_entropy(model(x[:3]), y[:3]).backward()
        with pytest.raises(ValueError, match="finish_step"):
            gh.clip_and_accumulate(C, accumulate=True, noise_multiplier=1.0)
        gh.clip_and_accumulate(C, accumulate=True)
        F.cross_entropy(model(x[3:]), y[3:]).backward()
        with pytest.raises(ValueError, match="clipped alike"):
            gh.clip_and_accumulate(2 * C, accumulate=True)


def test_detach_leaves_the_parameters_as_they_were():
    model, x, y = _data(mlp, torch.float64)
    before = [p._post_accumulate_grad_hooks for p in model.parameters()]
    gh = gradhooks.attach(model)
    _micro_step(gh, model, x, y, "ghost", "mean")
    gh.detach()
    assert [p._post_accumulate_grad_hooks for p in model.parameters()] == before == [None] * 4
    assert not gh.accumulation.pending
    F.cross_entropy(model(x), y).backward()  # plain autograd again
    assert all(p.grad is not None for p in model.parameters())


# ------------------------------------------------------------------------- DDP
def _check_ddp_accumulation(sizes, bucket_view, rank, world):
    """Each rank clips its micro-batches (book-keeping and two-pass, one of them empty on one
    rank); finish_step sums the ranks' accumulators once: every rank holds the clipped, noised
    mean of the ranks' concatenated logical batch."""
    torch.manual_seed(0)
    base = mlp().double()
    ref_model = mlp().double()
    ref_model.load_state_dict(base.state_dict())
    ddp = nn.parallel.DistributedDataParallel(base, gradient_as_bucket_view=bucket_view)
    batches = []
    for r in range(world):
        g = torch.Generator().manual_seed(300 + r)
        batches.append((torch.randn(sum(sizes[r]), 4, generator=g, dtype=torch.float64),
                        torch.randint(0, 3, (sum(sizes[r]),), generator=g)))
    x_all, y_all = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    ref = _clipped_sum(ref_model, x_all, y_all)
    gen = torch.Generator().manual_seed(5)
    expected = {n: (t + 0.7 * C * torch.randn(t.shape, generator=gen, dtype=t.dtype)) / len(x_all)
                for n, t in ref.items()}
    x, y = batches[rank]
    with gradhooks.attach(ddp) as gh:
        for (xb, yb), path in zip(_split(x, y, sizes[rank]), ["ghost", "two_pass", "ghost"]):
            _micro_step(gh, ddp, xb, yb, path, "mean")
        gh.finish_step(noise_multiplier=0.7, generator=torch.Generator().manual_seed(5))
    for n, p in base.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("bucket_view", [False, True], ids=["grads", "bucket_views"])
def test_ddp_accumulation_two_processes_gloo(bucket_view):
    two_process.run(functools.partial(_check_ddp_accumulation, ([2, 0, 3], [1, 3, 2]),
                                      bucket_view))


def _check_fsdp_refuses_accumulation(rank, world):
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = mlp().double()
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    x, y = torch.randn(3, 4, dtype=torch.float64), torch.randint(0, 3, (3,))
    with gradhooks.attach(model, check=False) as gh:
        F.cross_entropy(model(x), y).backward()
        with pytest.raises(gradhooks.GradHooksError, match="FSDP2"):
            gh.clip_and_accumulate(C, accumulate=True)
        with pytest.raises(gradhooks.GradHooksError, match="FSDP2"):
            gh.clipped_backward(F.cross_entropy(model(x), y, reduction="none"), C,
                                accumulate=True)


def test_fsdp2_refuses_accumulation_two_processes_gloo():
    two_process.run(_check_fsdp_refuses_accumulation)
