"""The sample check through the batched graph (issue 38, point 2;
gradhooks/readers/sample_check.py): where per-sample losses exist, rows 0 and B - 1 of the
records are compared with autograd's gradient of those samples' own loss terms through the same
batched forward. A loss or forward that pairs samples -- whatever the op, here after the model
where the forward's whitelist does not look -- is refused; separable ones are exact against the
loop, in float64 and float32, for B = 0, 1 and several."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.readers import sample_check

from conftest import RTOL, assert_close_to_loop, loop_grads

F64 = torch.float64


def _model(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).to(dtype)


def _batch(b, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 5, generator=g, dtype=dtype), torch.randint(0, 3, (b,), generator=g)


def _own(z, y):  # separable: sample n's term depends on its own row only
    return F.cross_entropy(z, y, reduction="none") + 0.1 * (z ** 2).sum(1)


# Per-sample losses whose terms pair samples, computed after the model (the forward's whitelist
# sees nothing of them): each is a (B,) tensor whose entry n depends on other rows.
MIXED = {
    "infonce_z_zT": lambda z, y: F.cross_entropy(z @ z.T, torch.arange(len(z)), reduction="none"),
    "centred": lambda z, y: F.cross_entropy(z - z.mean(0), y, reduction="none"),
    "rolled_terms": lambda z, y: _own(z, y) * (1 + _own(z, y).roll(1, 0)),
    "softmax_over_batch": lambda z, y: (z.softmax(0) * z).sum(1),
    "sorted_over_batch": lambda z, y: (z.sort(0).values * z).sum(1),
    "batch_std": lambda z, y: ((z / z.std(0)) ** 2).sum(1),
    "cumsum_over_batch": lambda z, y: (z.cumsum(0) ** 2).sum(1),
    "einsum_pairs": lambda z, y: torch.einsum("nc,mc->n", z, z.tanh()),
    # (rows 0 and B - 1 left alone: the middle row is checked too)
    "middle_rows_centred": lambda z, y: _own(torch.cat([z[:1], z[1:-1] - z[1:-1].mean(0),
                                                        z[-1:]]), y),
}

# How a DP or per-sample user hands the losses over.
USES = {
    "clipped_backward": lambda gh, l: gh.clipped_backward(l, 1.0),
    "backward_mean": lambda gh, l: (gh.backward(l.mean()), gh.per_sample_grad_norms()),
    "backward_sum_scaled": lambda gh, l: (gh.backward(l.sum() / 4), gh.per_sample_grads()),
    "backward_vector": lambda gh, l: (gh.backward(l, torch.ones_like(l)),
                                      gh.clip_and_accumulate(1.0)),
}


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("use", list(USES), ids=list(USES))
@pytest.mark.parametrize("mix", list(MIXED), ids=list(MIXED))
def test_a_loss_that_pairs_samples_is_refused(mix, use, dtype):
    model = _model(dtype)
    x, y = _batch(6, dtype)
    with gradhooks.attach(model, check=False) as gh:  # (check=False does not skip it)
        losses = MIXED[mix](model(x), y)
        # (the sample check, or first the loss's graph where it shows the pairing op:
        # tests/test_loss_graph.py)
        with pytest.raises(gradhooks.SampleMixingError,
                           match="sample check.*pairs samples|loss computed after the model pairs"):
            USES[use](gh, losses)


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("b", [0, 1, 2, 7], ids=["B0", "B1", "B2", "B7"])
@pytest.mark.parametrize("use", ["backward_mean", "backward_sum", "backward_vector"])
def test_separable_losses_pass_and_are_exact(use, b, dtype):
    model = _model(dtype)
    x, y = _batch(b, dtype)
    reduction = "sum" if use != "backward_mean" else "mean"
    ref = loop_grads(model, lambda z, t: getattr(_own(z, t), reduction)(), x, y)
    with gradhooks.attach(model, loss_reduction=reduction) as gh:
        for _ in range(2):  # (the second step: the structure passed, not checked again)
            losses = _own(model(x), y)
            if use == "backward_vector":
                gh.backward(losses, torch.ones_like(losses))
            else:
                gh.backward(getattr(losses, reduction)())
            ours = gh.per_sample_grads()
        if b:
            assert_close_to_loop(ours, ref, dtype)
        else:
            assert all(t.shape[0] == 0 for t in ours.values())
        assert len(gh.recorder.sample_checked) == (1 if b > 1 else 0)


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("b", [0, 1, 5], ids=["B0", "B1", "B5"])
def test_two_pass_clipping_of_separable_losses_is_exact(b, dtype):
    model = _model(dtype)
    x, y = _batch(b, dtype)
    ref = loop_grads(model, lambda z, t: _own(z, t).sum(), x, y)
    want = torch.zeros(b, dtype=dtype) if not b else torch.stack(
        [torch.cat([g[n].reshape(-1) for g in ref.values()]).norm() for n in range(b)])
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        norms = gh.clipped_backward(_own(model(x), y), 1.0)
    tol = RTOL[dtype] * max(float(want.abs().max()) if b else 1.0, 1.0)
    assert norms.shape == (b,)
    torch.testing.assert_close(norms, want, rtol=0, atol=tol)


def test_grouped_samples_are_checked_per_group():
    """sample_ids: rows 2k, 2k + 1 are one sample (a DPO pair); (G,) losses separable over
    groups pass, and a loss pairing groups is refused."""
    model = _model(F64)
    x, y = _batch(8, F64)
    ids = torch.arange(8) // 2

    def pair_losses(z, t):  # (G,) from the rows of each group
        rows = _own(z, t)
        return rows.new_zeros(4).index_add(0, ids, rows)

    with gradhooks.attach(model, loss_reduction="sum") as gh:
        out = model(x)
        gh.set_sample_ids(ids)
        gh.clipped_backward(pair_losses(out, y), 1.0)
        assert len(gh.recorder.sample_checked) == 1
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        out = model(x)
        gh.set_sample_ids(ids)
        mixed = pair_losses(out, y)
        with pytest.raises(gradhooks.SampleMixingError, match="sample check"):
            gh.clipped_backward(mixed * (1 + mixed.roll(1, 0)), 1.0)


def test_the_switches_that_skip_it():
    """allow_sample_mixing (contributions declared) and the loudly named
    unsafe_skip_sample_check skip it; check=False does not (above)."""
    model = _model(F64)
    x, y = _batch(6, F64)
    for options in ({"allow_sample_mixing": True}, {"unsafe_skip_sample_check": True}):
        with gradhooks.attach(model, **options) as gh:
            gh.backward(MIXED["infonce_z_zT"](model(x), y).mean())
            assert not gh.recorder.sample_checked
            if "unsafe_skip_sample_check" in options:  # (the loss's graph still shows z @ z.T)
                with pytest.raises(gradhooks.SampleMixingError, match="MmBackward"):
                    gh.per_sample_grad_norms()
                continue
            assert gh.per_sample_grad_norms().shape == (6,)


def test_checked_once_per_structure_and_again_for_a_new_one(monkeypatch):
    calls = []
    judge = sample_check.SampleCheck.judge_records
    monkeypatch.setattr(sample_check.SampleCheck, "judge_records",
                        lambda self: (calls.append(self.key), judge(self))[1])
    model = _model(F64)
    with gradhooks.attach(model) as gh:
        for b in (4, 4, 4, 5, 5):
            x, y = _batch(b, F64)
            gh.backward(_own(model(x), y).mean())
            gh.per_sample_grads()
    # one per input signature: its first forward (its first planned one runs the same ops:
    # SumCheck.forward_end)
    assert len(calls) == 2


class MiddleMix(nn.Module):
    """A forward that mixes only rows 1 to B - 2 (centred over them, or reversed), which the
    checks of rows 0 and B - 1 alone did not see (a new-user probe, 2026-12-07)."""

    def __init__(self, how):
        super().__init__()
        self.how, self.a, self.b = how, nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        mid = h[1:-1]
        mid = mid - mid.mean(0) if self.how == "centred" else mid.flip(0)
        return self.b(torch.cat([h[:1], mid, h[-1:]]))


@pytest.mark.parametrize("how", ["centred", "reversed"])
@pytest.mark.parametrize("use", ["loss.backward"] + list(USES))
def test_a_forward_that_mixes_only_middle_rows_is_refused(how, use):
    model = MiddleMix(how).double()
    x, y = _batch(6, F64)
    with gradhooks.attach(model) as gh:
        losses = _own(model(x), y)
        with pytest.raises(gradhooks.GradHooksError):
            if use == "loss.backward":
                losses.mean().backward()
                gh.per_sample_grads()
            else:
                USES[use](gh, losses)


def _pair_rows(terms, i, j):
    # (B,) terms with rows i and j each also depending on the other's term (every other row,
    # the checked 0 and B - 1 among them, left alone)
    other = terms.clone()
    other[i], other[j] = terms[j], terms[i]
    picked = torch.zeros_like(terms)
    picked[[i, j]] = 1
    return terms + 0.5 * picked * other


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("b, pair", [(5, (1, 3)), (8, (2, 5)), (16, (6, 9))],
                         ids=["B5", "B8", "B16"])
@pytest.mark.parametrize("use", list(USES), ids=list(USES))
def test_a_pairing_of_unchecked_rows_is_refused_by_the_weighted_sum(use, b, pair, dtype):
    """Only rows the row check does not compare are paired (after the model, where no
    analysis of the forward sees it): the weighted sum over every row finds it."""
    model = _model(dtype)
    x, y = _batch(b, dtype)
    with gradhooks.attach(model, check=False) as gh:
        losses = _pair_rows(_own(model(x), y), *pair)
        with pytest.raises(gradhooks.SampleMixingError, match="random weight"):
            USES[use](gh, losses)


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["f64", "f32"])
def test_the_weighted_sum_sees_a_pairing_of_unchecked_groups(dtype):
    """sample_ids: 6 groups of two rows; groups 2 and 3 are paired, groups 0 and 5 not."""
    model = _model(dtype)
    x, y = _batch(12, dtype)
    ids = torch.arange(12) // 2
    for clipped in (True, False):
        with gradhooks.attach(model, loss_reduction="sum") as gh:
            out = model(x)
            gh.set_sample_ids(ids)
            per_group = _own(out, y).new_zeros(6).index_add(0, ids, _own(out, y))
            losses = _pair_rows(per_group, 2, 3)
            with pytest.raises(gradhooks.SampleMixingError, match="random weight"):
                if clipped:
                    gh.clipped_backward(losses, 1.0)
                else:
                    gh.backward(losses.sum())
                    gh.per_sample_grad_norms()


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("b", [3, 16], ids=["B3", "B16"])
def test_the_weighted_sum_passes_separable_losses_grouped_and_tied(b, dtype):
    """Separable losses pass the weighted sum where its records take every form: a tied
    embedding (row scatters plus a projection), grouped rows, two-pass and book-keeping."""
    torch.manual_seed(0)
    emb = nn.Embedding(11, 6)
    head = nn.Linear(6, 11, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, nn.LayerNorm(6), nn.Linear(6, 6), nn.Tanh(), head).to(dtype)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 11, (b, 4), generator=g)

    def losses_of(out, t):
        return F.cross_entropy(out.transpose(1, 2), t, reduction="none").sum(1)

    ref = loop_grads(model, lambda z, t: losses_of(z, t).sum(), tokens, tokens)
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        gh.backward(losses_of(model(tokens), tokens).sum())
        assert_close_to_loop(gh.per_sample_grads(), ref, dtype)
        assert len(gh.recorder.sample_checked) == 1
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        gh.clipped_backward(losses_of(model(tokens), tokens), 1e9)  # (no clipping: the plain sum)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref[name].sum(0), rtol=RTOL[dtype],
                                       atol=RTOL[dtype])
        assert len(gh.recorder.sample_checked) == 1
