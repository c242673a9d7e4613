"""Property test of forward separation (issue 38, points 1 and 2): Hypothesis composes random
forwards from the op table of tests/test_separation.py -- ops that keep the samples apart and
ops that mix them, in any order, between two hooked Linear layers or after a GRU or a
self-attention block (applied at each position) -- with random batch sizes,
seeds and losses (mean, sum, a scaled mean, per-sample losses summed through ``gh.backward``,
per-sample losses that themselves pair samples after the model -- the sample check's ground,
tests/test_sample_check.py; under a plain ``loss.backward()``, the loss graph's,
tests/test_loss_graph.py -- and two-pass clipping's norms), and on every draw the per-sample
gradients are exact against a float64 loop, or the read is refused (``SampleMixingError``). A
draw made only of ops that keep the samples apart is never refused. Derandomized: CI runs the
same draws every time."""
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gradhooks

from conftest import loop_grads
from test_sample_check import MIXED as MIXED_LOSSES
from test_separation import KEEPS, MIXES, AfterRecurrent, Between, _seq_op

F64 = torch.float64
TABLE = [(name, op, False) for name, op in KEEPS.items()] + [
    (name, op, True) for name, (op, _) in MIXES.items()]
DRAWS = 2000


def _loss(kind, mixed=None):
    if kind in ("mixed_loss", "plain_mixed"):  # (B,) losses whose terms pair samples, summed
        return lambda out, y: MIXED_LOSSES[mixed](out, y).sum()
    if kind == "sum":
        return lambda out, y: F.cross_entropy(out, y, reduction="sum")
    if kind == "scaled":
        return lambda out, y: 0.5 * F.cross_entropy(out, y)
    return F.cross_entropy


def _compose(ops):
    def op(h):
        for f in ops:
            h = f(h)
        return h
    return op


@settings(max_examples=DRAWS, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(picks=st.lists(st.integers(0, len(TABLE) - 1), min_size=1, max_size=3),
       batch=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2 ** 16),
       loss=st.sampled_from(["mean", "sum", "scaled", "per_sample", "mixed_loss", "plain_mixed",
                             "clipped"]),
       mixed=st.sampled_from(sorted(MIXED_LOSSES)),
       front=st.sampled_from(["linear", "linear", "gru", "attention"]))
def test_random_forwards_are_exact_or_refused(picks, batch, seed, loss, mixed, front):
    ops = [TABLE[i] for i in picks]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, *(() if front == "linear" else (3,)), 4, generator=g, dtype=F64)
    y = torch.randint(0, 3, (batch,), generator=g)
    torch.manual_seed(seed)
    op = _compose([op for _, op, _ in ops])
    model = (Between(op) if front == "linear" else AfterRecurrent(front, _seq_op(op))).double()
    reduction = ("sum" if loss in ("sum", "per_sample", "mixed_loss", "plain_mixed", "clipped")
                 else "mean")
    loss_fn = _loss(loss, mixed)
    try:
        ref = loop_grads(model, loss_fn, x, y)
    except (RuntimeError, ValueError):  # (torch's batch_norm / instance_norm refuse one value)
        return  # (a form that torch cannot run on one sample alone: no reference to compare)
    if not all(bool(torch.isfinite(r).all()) for r in ref.values()):
        return  # (std / cov of one sample: NaN, nothing to compare)
    with gradhooks.attach(model, loss_reduction=reduction) as gh:
        model.zero_grad()
        out = model(x)
        try:
            if loss == "per_sample":
                gh.backward(F.cross_entropy(out, y, reduction="none").sum())
            elif loss == "mixed_loss":
                gh.backward(MIXED_LOSSES[mixed](out, y).sum())
            elif loss == "clipped":  # (a bound no norm reaches: the norms are the result)
                norms = gh.clipped_backward(F.cross_entropy(out, y, reduction="none"), 1e30)
            else:
                loss_fn(out, y).backward()
            if loss != "clipped":
                ours = gh.per_sample_grads()
        except (gradhooks.SampleMixingError, gradhooks.UnsupportedLossError) as error:
            # (a mixing op that zeroes rows of the output's gradient: the loss split's counts
            # then differ, and the read refuses the loss; never a draw without a mixing op)
            assert loss in ("mixed_loss", "plain_mixed") or any(mixes for _, _, mixes in ops), (
                f"a forward of ops that keep the samples apart was refused: "
                f"{[name for name, _, _ in ops]}: {error}")
            return
    if loss == "clipped":
        want = torch.stack([torch.cat([r[n].reshape(-1) for r in ref.values()]).norm()
                            for n in range(batch)])
        assert float((norms - want).abs().max()) <= 1e-9 * max(float(want.max()), 1e-12), (
            norms, want, [n for n, _, _ in ops])
        return
    assert list(ours) == list(ref)
    # float64, 1e-10 of the model's largest gradient entry: the forward-alone check accepts an
    # op when one sample alone reproduces its rows to 1e-10 of the output's scale, so a mixing
    # term below that (a cube of a cube of small activations) may pass, and a parameter whose
    # own-loss gradient vanishes then holds rounding-sized values
    floor = max(1e-12, max(float(r.abs().max()) for r in ref.values()))
    for name, r in ref.items():
        scale = max(float(r.abs().max()), floor)
        diff = float((ours[name] - r).abs().max())
        assert diff <= 1e-9 * scale, (name, diff, scale, [n for n, _, _ in ops])


def test_the_table_has_both_kinds():
    assert sum(m for *_, m in TABLE) >= 40 and sum(not m for *_, m in TABLE) >= 40
