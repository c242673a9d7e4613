"""Property test of forwards whose structure changes from step to step with the same input
shapes (issue 38: "exact or refused" between analysed forwards). Hypothesis draws two forwards
from the op table of tests/test_separation.py -- ops that keep the samples apart and ops that
mix them, between two hooked Linear layers -- and a schedule of steps that takes one or the
other (the first step takes the first), with a batch of the same shape on every step, a seed
per step and a loss (a plain ``loss.backward()`` of the mean, per-sample losses through
``gh.backward``, or two-pass clipping's norms, ``gh.clipped_backward``). On every step the
per-sample gradients (the norms) are exact against a float64 loop of that step's forward, or
the read is refused (``SampleMixingError``, of which
``UnprovenOpError`` is one); a refusal needs a mixing op in a forward the schedule ran so far
(a signature keeps the verdicts of its analysed forwards: its planned forwards may take either
branch), or names a changed forward that no check could verify. A schedule of ops that keep
the samples apart is exact on every step. Derandomized: CI runs the same draws every time."""
import copy

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import gradhooks

from conftest import loop_grads
from test_separation import D
from test_separation_property import TABLE, _compose

F64 = torch.float64
DRAWS = 300


class Switched(nn.Module):
    """``b(op_k(tanh(a(x))))`` with ``k = which``: two structures of one input signature."""

    def __init__(self, ops):
        super().__init__()
        self.a, self.b = nn.Linear(4, D), nn.Linear(D, 3)
        self.ops, self.which = ops, 0

    def forward(self, x):
        return self.b(self.ops[self.which](torch.tanh(self.a(x))))


@settings(max_examples=DRAWS, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(first=st.lists(st.integers(0, len(TABLE) - 1), min_size=1, max_size=2),
       second=st.lists(st.integers(0, len(TABLE) - 1), min_size=1, max_size=2),
       schedule=st.lists(st.integers(0, 1), min_size=2, max_size=5),
       batch=st.sampled_from([2, 4]), seed=st.integers(0, 2 ** 16),
       loss=st.sampled_from(["plain", "per_sample", "clipped"]))
def test_structure_changes_are_exact_or_refused(first, second, schedule, batch, seed, loss):
    forwards = [[TABLE[i] for i in first], [TABLE[i] for i in second]]
    model = Switched([_compose([op for _, op, _ in ops]) for ops in forwards]).double()
    torch.manual_seed(seed)
    ran: set = set()
    with gradhooks.attach(model) as gh:
        for step, which in enumerate([0] + schedule):
            g = torch.Generator().manual_seed(seed + step)
            x = torch.randn(batch, 4, generator=g, dtype=F64)
            y = torch.randint(0, 3, (batch,), generator=g)
            model.which = which
            ran.add(which)
            twin = copy.deepcopy(model)  # (its forwards are no calls of the hooked model)
            try:
                ref = loop_grads(twin, F.cross_entropy, x, y)
            except (RuntimeError, ValueError):  # (torch refuses the form on one sample)
                return
            if not all(bool(torch.isfinite(r).all()) for r in ref.values()):
                return  # (std / cov of one sample: NaN, nothing to compare)
            model.zero_grad()
            out = model(x)
            try:
                if loss == "clipped":  # (a bound no norm reaches: the norms are the result)
                    norms = gh.clipped_backward(F.cross_entropy(out, y, reduction="none"), 1e30)
                    ours = {"norm": norms}
                    ref = {"norm": torch.stack([torch.cat([r[n].reshape(-1) for r in ref.values()])
                                                .norm() for n in range(batch)])}
                elif loss == "per_sample":
                    gh.backward(F.cross_entropy(out, y, reduction="none").mean())
                    ours = gh.per_sample_grads()
                else:
                    F.cross_entropy(out, y).backward()
                    ours = gh.per_sample_grads()
            except gradhooks.SampleMixingError as error:
                mixed = any(mixes for k in ran for _, _, mixes in forwards[k])
                assert mixed or "could not verify" in str(error), (
                    f"step {step}: a schedule of ops that keep the samples apart was refused: "
                    f"{[[n for n, _, _ in ops] for ops in forwards]} {schedule}: {error}")
                continue
            floor = max(1e-12, max(float(r.abs().max()) for r in ref.values()))
            for name, r in ref.items():
                scale = max(float(r.abs().max()), floor)
                diff = float((ours[name] - r).abs().max())
                assert diff <= 1e-9 * scale, (step, name, diff, scale,
                                              [[n for n, _, _ in ops] for ops in forwards],
                                              schedule)
