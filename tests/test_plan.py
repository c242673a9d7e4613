"""The norm plan (:mod:`gradhooks.readers.plan`): the kind chosen per parameter, the templates kept per
call structure (the recorder's :class:`~gradhooks.core.recorder.records.Memo`), and :func:`~gradhooks.readers.plan.squared_norms`
against a loop of autograd, in float64."""
import pytest
import torch
from torch import nn

import gradhooks
from gradhooks.core.recorder.records import Memo
from gradhooks.readers import plan as plan_mod
from gradhooks.readers.plan import (
    CLOSED,
    FORMS,
    GENERIC,
    GRAM,
    ROWS,
    Forms,
    plan,
    squared_norms,
    use_gram,
)
from gradhooks.readers.verify import Evidence

from conftest import loop_grads, weighted_square_loss


class _Mixed(nn.Module):
    """One layer of each kind: Embedding (rows), LSTM (forms), Linear on tokens (linear form),
    LayerNorm (generic), Linear on (B, in) (unit form)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.lstm = nn.LSTM(6, 5, batch_first=True)
        self.proj = nn.Linear(5, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = self.norm(self.proj(self.lstm(self.emb(x))[0]))
        return self.head(h.mean(1))


def _batch(gh, model, x, w):
    weighted_square_loss("sum")(model(x), w).backward()
    return gh.recorder.snapshot("test_plan")


def test_kinds_per_parameter():
    torch.manual_seed(0)
    model = _Mixed().double()
    x, w = torch.randint(0, 11, (3, 7)), torch.rand(3, dtype=torch.float64)
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        batch = _batch(gh, model, x, w)
        plans, units = plan(batch)
    kinds = {p.name: p.kind for p in plans.values()}
    # proj: S = 7 tokens, 5 -> 4: 7 * 9 > 20, materialised; head: S = 1, the product of norms
    assert not use_gram(7, 5, 4) and use_gram(1, 4, 2)
    assert kinds == {"emb.weight": ROWS, "lstm.weight_ih_l0": FORMS, "lstm.weight_hh_l0": FORMS,
                     "lstm.bias_ih_l0": FORMS, "lstm.bias_hh_l0": FORMS,
                     "proj.weight": CLOSED, "proj.bias": CLOSED, "norm.weight": GENERIC,
                     "norm.bias": GENERIC, "head.weight": GRAM, "head.bias": CLOSED}
    assert list(kinds) == [n for n, _ in model.named_parameters()]  # the model's order
    by_layer = dict(zip((cap.layer.path for cap in batch.records), units))
    assert by_layer["head"] == 2 and by_layer["proj"] == 0  # head: its records are the form


def test_gram_kind_when_cheaper(monkeypatch):
    model = nn.Sequential(nn.Linear(64, 64)).double()
    x = torch.randn(2, 3, 64, dtype=torch.float64)  # S = 3: 3 * 128 < 64 * 64
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        batch = _batch(gh, model, x, torch.rand(2, dtype=torch.float64))
        plans, _ = plan(batch)
        assert {p.name: p.kind for p in plans.values()} == {"0.weight": GRAM, "0.bias": CLOSED}
        monkeypatch.setattr(plan_mod, "use_gram", lambda *a, **k: False)
        gh.recorder.memo.clear()  # (the structure's template was kept: decide again)
        plans, _ = plan(batch)
        assert plans[id(model[0].weight)].kind == CLOSED


def test_plan_cache_keeps_one_template_per_structure(monkeypatch):
    made = []
    real = plan_mod._plan_template
    monkeypatch.setattr(plan_mod, "_plan_template", lambda batch: made.append(1) or real(batch))
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        for b in (5, 5, 6):
            x = torch.randn(b, 3, dtype=torch.float64)
            batch = _batch(gh, model, x, torch.rand(b, dtype=torch.float64))
            plan(batch)
            assert batch.memo is gh.recorder.memo  # the recorder's, one per attachment
    assert len(made) == 2  # B = 5 twice (one template), B = 6 (another)
    monkeypatch.setattr(Memo, "LIMIT", 1)
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        for b in (2, 3, 2):
            batch = _batch(gh, model, torch.randn(b, 3, dtype=torch.float64),
                           torch.rand(b, dtype=torch.float64))
            plan(batch)
    assert len(made) == 5  # LIMIT 1: every new structure starts over


@pytest.mark.parametrize("form", ["auto", "gram", "materialised"])
def test_squared_norms_match_loop(form, monkeypatch):
    if form != "auto":
        monkeypatch.setattr(plan_mod, "use_gram", lambda *a, **k: form == "gram")
    torch.manual_seed(1)
    model = _Mixed().double()
    x, w = torch.randint(0, 11, (4, 7)), torch.rand(4, dtype=torch.float64)
    ref = loop_grads(model, weighted_square_loss("sum"), x, w)
    with gradhooks.attach(model, loss_reduction="sum", check="always") as gh:
        batch = _batch(gh, model, x, w)
        plans, units = plan(batch)
        evidence = Evidence(batch)
        sq = squared_norms(batch, plans, units, Forms(batch, plans), evidence)
        assert evidence.due and (evidence.probes or evidence.projections)
        evidence.judge()
    for pid, p in plans.items():
        torch.testing.assert_close(sq[pid], ref[p.name].flatten(1).square().sum(1),
                                   rtol=1e-10, atol=1e-12, msg=p.name)
