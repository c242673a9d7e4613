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
branch), or names a changed forward that no check could verify, or a side computation whose
ops no analysed forward showed, or (a side computation kept in a list) one whose list the
check of the forward alone's runs of the model added to. The drawn ops run in the forward's
output path, or in a side computation off it (kept on the module or in a list as a forward
hook would) that the loss adds. A schedule of ops that keep the samples apart is exact on every step. Derandomized: CI
runs the same draws every time."""
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


STASH: list = []  # (where a forward hook would keep a side computation)


class Switched(nn.Module):
    """``b(op_k(tanh(a(x))))`` with ``k = which``: two structures of one input signature. With
    ``side`` set, ``b(tanh(a(x)))`` and, off the output, ``aux = op_k(tanh(a(x))).pow(2)
    .mean()`` kept on the module (``"module"``) or in a list as a forward hook would
    (``"hook"``): the loss adds ``0.1 * aux``."""

    def __init__(self, ops, side=None):
        super().__init__()
        self.a, self.b = nn.Linear(4, D), nn.Linear(D, 3)
        self.ops, self.which, self.side = ops, 0, side

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.side is None:
            return self.b(self.ops[self.which](h))
        aux = self.ops[self.which](h).pow(2).mean()
        if self.side == "module":
            self.aux = aux
        else:
            STASH.append(aux)
        return self.b(h)

    def loss(self, out, y):
        """Cross-entropy, plus ``0.1 * aux`` of the last forward with ``side`` set."""
        if self.side is None:
            return F.cross_entropy(out, y)
        return F.cross_entropy(out, y) + 0.1 * (self.aux if self.side == "module" else STASH[-1])


@settings(max_examples=DRAWS, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(first=st.lists(st.integers(0, len(TABLE) - 1), min_size=1, max_size=2),
       second=st.lists(st.integers(0, len(TABLE) - 1), min_size=1, max_size=2),
       schedule=st.lists(st.integers(0, 1), min_size=2, max_size=5),
       batch=st.sampled_from([2, 4]), seed=st.integers(0, 2 ** 16),
       loss=st.sampled_from(["plain", "per_sample", "clipped"]),
       side=st.sampled_from([None, None, "module", "hook"]))
def test_structure_changes_are_exact_or_refused(first, second, schedule, batch, seed, loss,
                                                side):
    forwards = [[TABLE[i] for i in first], [TABLE[i] for i in second]]
    model = Switched([_compose([op for _, op, _ in ops]) for ops in forwards], side).double()
    loss = "plain" if side else loss  # (a side computation's loss is the batch's, plain)
    torch.manual_seed(seed)
    ran: set = set()
    with gradhooks.attach(model) as gh:
        for step, which in enumerate([0] + schedule):
            g = torch.Generator().manual_seed(seed + step)
            x = torch.randn(batch, 4, generator=g, dtype=F64)
            y = torch.randint(0, 3, (batch,), generator=g)
            model.which = which
            ran.add(which)
            model.__dict__.pop("aux", None)  # (a non-leaf tensor cannot be deep-copied)
            twin = copy.deepcopy(model)  # (its forwards are no calls of the hooked model)
            try:
                ref = loop_grads(twin, twin.loss, x, y)
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
                    model.loss(out, y).backward()
                    ours = gh.per_sample_grads()
            except gradhooks.SampleMixingError as error:
                mixed = any(mixes for k in ran for _, _, mixes in forwards[k])
                assert mixed or "could not verify" in str(error) or (
                    side is not None and "off its outputs" in str(error)) or (
                    side == "hook" and "gradhooks.is_paused()" in str(error)), (
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
