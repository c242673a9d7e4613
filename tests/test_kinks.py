"""Kink decisions (gradhooks.tools.kinks) and the two references of compare(), on forwards built to
decide differently for a batch and for one sample on every CPU (no reliance on rounding)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.tools.kinks import KinkRecorder, first_kink_difference

F64 = torch.float64


class TieBreaker(nn.Module):
    """``(B, 4)`` -> ``(B, 2)``: Linear(4, 4), max over pairs ``(0, 1)`` and ``(2, 3)``,
    Linear(2, 2). With ``lift`` it adds ``lift`` to the second element of each pair only for a
    batch of one: exact ties then break the other way in a per-sample forward, as a batch-of-1
    kernel that rounds differently does on some CPUs."""

    def __init__(self, lift=0.0):
        super().__init__()
        self.inp, self.out, self.lift = nn.Linear(4, 4), nn.Linear(2, 2), lift

    def forward(self, x):
        h = self.inp(x)
        if x.shape[0] == 1 and self.lift:
            h = h + torch.tensor([0.0, self.lift, 0.0, self.lift], dtype=h.dtype)
        return self.out(F.max_pool1d(h.unsqueeze(1), 2).squeeze(1))


def _tied_batch(model, b):
    """Inputs whose first pair is tied for every sample (rows 0 and 1 of inp equal), the
    second pair only for even samples."""
    with torch.no_grad():
        model.inp.weight[1] = model.inp.weight[0]
        model.inp.bias[1] = model.inp.bias[0]
        model.inp.weight[3] = model.inp.weight[2]
        model.inp.bias[3] = model.inp.bias[2]
    x = torch.randn(b, 4, dtype=F64)
    return x


def test_first_difference_names_the_pool_and_counts_windows():
    model = TieBreaker(lift=1e-6).double()
    x = _tied_batch(model, 6)
    diff = first_kink_difference(model, (x,))
    assert diff is not None
    assert diff.record.op == "max_pool2d_with_indices"
    assert diff.record.module == "" and diff.record.module_type == "TieBreaker"
    assert diff.record.after == "inp"
    # every sample has both pairs tied: the batch picks the first element, a sample the second
    assert (diff.samples, diff.elements) == (6, 12)
    assert str(diff) == ("max_pool2d_with_indices after 'inp' in <root> (TieBreaker): 6 samples, "
                         "12 windows pick another maximum")
    assert first_kink_difference(TieBreaker().double(), (x,)) is None  # same forward: no flip


def test_recorder_sees_functional_and_module_kinks_with_their_module():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(5, 3)
    with KinkRecorder(model) as rec:
        out = model(x)
        torch.clamp(out, -0.1, 0.1).abs().max(dim=1)
        (out > 0).sum()
    ops = [(r.op, r.module, r.after) for r in rec.records]
    # ops after the model's forward ran "in" the root, after the root ("")
    assert ops == [("relu", "1", "0"), ("clamp", "", ""), ("abs", "", ""), ("max", "", ""),
                   ("gt", "", "")]
    pre = model[0](x)
    assert torch.equal(rec.records[0].decision, pre > 0)
    c = out.detach()
    assert torch.equal(rec.records[1].decision,
                       (c > -0.1).to(torch.int8) + (c >= 0.1).to(torch.int8))
    assert rec.records[3].decision.shape == (5,)
    assert not model[0]._forward_hooks and not model[0]._forward_pre_hooks  # hooks removed


def test_relu_flip_inside_a_submodule():
    """A sample's pre-activation exactly 0 in the batch, lifted above 0 alone: a ReLU flip in
    the named submodule, found before the later (unflipped) ops."""
    class Lift(nn.Module):
        def forward(self, h):
            return h + 1e-3 if h.shape[0] == 1 else h

    model = nn.Sequential(nn.Linear(2, 3), nn.Sequential(Lift(), nn.ReLU()), nn.Linear(3, 1))
    x = torch.zeros(4, 2)
    with torch.no_grad():
        model[0].bias.copy_(torch.tensor([0.0, 1.0, -1.0]))
    diff = first_kink_difference(model, (x,))
    assert (diff.record.op, diff.record.module, diff.record.after) == ("relu", "1.1", "1.0")
    assert (diff.samples, diff.elements) == (4, 4)


def test_compare_passes_a_tie_flip_and_names_it():
    """The loop takes other subgradients (its ties break the other way): compare() is OK
    against the same batched forward, reports the loop's difference and names the kink."""
    model = TieBreaker(lift=1e-9).double()
    x, y = _tied_batch(model, 6), torch.randn(6, 2, dtype=F64)
    report = gradhooks.compare(model, nn.MSELoss(), x, y, repeats=1)
    assert report.ok and report.max_rel_error < 1e-12 and report.rtol == 1e-10
    assert report.loop_dtype == F64 and report.loop_max_rel_error > 1e-2
    assert report.kink is not None and report.kink.record.op == "max_pool2d_with_indices"
    assert "max_pool2d_with_indices after 'inp'" in str(report)
    assert "vs loop float64" in str(report)


def test_batched_forward_reference_closed_form_and_errors():
    """MSE on Linear: dl_n/dW = 2 (W x_n + b - y_n) x_n^T / out_features, from one forward."""
    lin = nn.Linear(3, 2).double()
    x, y = torch.randn(5, 3, dtype=F64), torch.randn(5, 2, dtype=F64)
    ref = gradhooks.batched_forward_per_sample_grads(lin, nn.MSELoss(), x, y)
    r = (lin(x) - y).detach()
    torch.testing.assert_close(ref["weight"], r[:, :, None] * x[:, None, :], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(ref["bias"], r, rtol=1e-12, atol=1e-14)
    assert lin.weight.grad is None
    with pytest.raises(ValueError, match="matches loss_reduction='sum'"):
        gradhooks.batched_forward_per_sample_grads(lin, nn.MSELoss(reduction="sum"), x, y)

    class Transposed(nn.Module):  # outputs (2, B): not batched on dim 0
        def forward(self, x):
            return lin(x).t()

    with pytest.raises(ValueError, match=r"batched on dim 0 \(size 5\).*\(2, 5\)"):
        gradhooks.batched_forward_per_sample_grads(Transposed(), nn.MSELoss(), x, y)


def test_compare_leaves_the_users_model_in_its_dtype():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    x, y = torch.randn(6, 3), torch.randint(0, 2, (6,))
    report = gradhooks.compare(model, nn.CrossEntropyLoss(), x, y, repeats=1)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert report.ok and report.rtol == 1e-5 and report.loop_dtype == F64
    assert report.loop_max_rel_error < 1e-5 and report.kink is None
    same = gradhooks.compare(model, nn.CrossEntropyLoss(), x, y, repeats=1, reference_dtype=None)
    assert same.loop_dtype == torch.float32
