"""In-place ops on a hooked layer's output (``nn.ReLU(inplace=True)``, ``h.mul_(2)``): torch's
``linear`` on ``(B, T, d)`` returns its ``addmm`` result *viewed*, and an in-place op on a view
rebases it, taking the view's autograd node (where the grad_output was recorded) out of the
graph. Per-sample gradients, norms and clipping stay exact against the loop, with
``loss.backward()`` and ``gh.backward``, with ``check`` on and off; and for a shared call
(Swin-v2's continuous position bias: an MLP on a constant table with an in-place ReLU)."""
import pytest
import torch
from torch import nn

import gradhooks

from conftest import RTOL, check_against_loop_or_empty, loop_grads, weighted_square_loss

OPS = {
    "ReLU(inplace=True)": lambda h: nn.functional.relu(h, inplace=True),
    "relu_": lambda h: h.relu_(),
    "mul_": lambda h: h.mul_(2.0),
    "out of place": lambda h: h.relu(),
}


class PerToken(nn.Module):
    def __init__(self, op, bias=True):
        super().__init__()
        self.l1, self.l2, self.op = nn.Linear(6, 8, bias=bias), nn.Linear(8, 3), OPS[op]

    def forward(self, x):
        return self.l2(self.op(self.l1(x)))


@pytest.mark.parametrize("shape", [(5, 6), (6,), (2, 3, 6)], ids=["BTd", "Bd", "B23d"])
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("batch", [0, 1, 3])
def test_inplace_op_after_a_linear(op, shape, batch, loss_reduction, dtype):
    model = PerToken(op)
    x, w = torch.randn(batch, *shape), torch.rand(batch) + 0.5
    check_against_loop_or_empty(model, x, w, loss_reduction=loss_reduction, dtype=dtype)


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("how", ["loss.backward", "gh.backward"])
def test_norms_and_clipping_after_an_inplace_relu(how, check):
    model = PerToken("ReLU(inplace=True)", bias=False).double()
    x, w = torch.randn(4, 5, 6, dtype=torch.float64), torch.rand(4, dtype=torch.float64) + 0.5
    loss_fn = weighted_square_loss("sum")
    ref = loop_grads(model, loss_fn, x, w)
    norms = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in ref.values()))
    c = (norms.median() / norms).clamp(max=1)
    with gradhooks.attach(model, loss_reduction="sum", check=check) as gh:
        loss = loss_fn(model(x), w)
        gh.backward(loss) if how == "gh.backward" else loss.backward()
        assert sorted(gh.per_sample_grads()) == sorted(ref)
        torch.testing.assert_close(gh.per_sample_grad_norms(), norms, rtol=1e-10, atol=0)
        gh.clip_and_accumulate(float(norms.median()))
    for name, p in model.named_parameters():
        expected = torch.tensordot(c, ref[name], 1)
        assert (p.grad - expected).abs().max() <= RTOL[torch.float64] * expected.abs().max()


class PositionBias(nn.Module):
    """Swin-v2's continuous position bias: an MLP with an in-place ReLU on a constant
    ``(1, T, T, 2)`` table (a shared call), added to per-sample attention scores."""

    def __init__(self, t=4, d=4):
        super().__init__()
        self.t = t
        self.qkv = nn.Linear(d, 3 * d)
        self.cpb = nn.Sequential(nn.Linear(2, 8), nn.ReLU(inplace=True), nn.Linear(8, 1, bias=False))
        self.register_buffer("table", torch.randn(1, t, t, 2))
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        bias = self.cpb(self.table).view(self.t, self.t)
        a = torch.softmax(q @ k.transpose(-1, -2) + bias, -1)
        return self.head(a @ v)


@pytest.mark.parametrize("batch", [1, 3])
def test_inplace_relu_in_a_shared_call(batch, dtype):
    model = PositionBias()
    x, w = torch.randn(batch, 4, 4), torch.rand(batch) + 0.5
    check_against_loop_or_empty(model, x, w, loss_reduction="mean", dtype=dtype)


class Assigns(nn.Module):
    """``x[index] = value`` in the forward (``Tensor.__setitem__``, in place): a raw
    parameter written into a batched tensor, into a fresh one that then meets the batch, the
    batch's rows written into a fresh tensor, a constant at positions the batch picks."""

    def __init__(self, form):
        super().__init__()
        self.l1, self.l2, self.form = nn.Linear(5, 6), nn.Linear(6, 3), form
        self.p = nn.Parameter(0.5 * torch.randn(6))

    def forward(self, x):
        h = torch.tanh(self.l1(x))
        if self.form == "param_into_batch":
            h = h.clone()
            h[:, :2] = self.p[:2]
        elif self.form == "param_into_fresh":
            buf = h.new_zeros(h.shape)
            buf[:] = self.p
            h = h * buf
        elif self.form == "rows_into_fresh":
            buf = torch.zeros(h.shape[0], 6, dtype=h.dtype)
            buf[:, 1:] = self.p[1:] * h[:, 1:]
            h = buf + h
        elif self.form == "constant_at_picked":
            h = h.clone()
            h[h > 0.5] = -1.0
            h = h + self.p
        return self.l2(torch.tanh(h))


@pytest.mark.parametrize("batch", [0, 1, 4], ids=["B0", "B1", "B4"])
@pytest.mark.parametrize("form", ["param_into_batch", "param_into_fresh", "rows_into_fresh",
                                  "constant_at_picked"])
def test_assignments_that_keep_samples_apart_are_exact(form, batch, dtype):
    """Each is judged as the op that returns the target (provenance.writes_batch): the target
    carries what was written; before, a batch's rows written into a fresh tensor left it
    looking constant, so a permutation written there was silently wrong
    (tests/test_separation.py's setitem forms)."""
    torch.manual_seed(0)
    check_against_loop_or_empty(Assigns(form), torch.randn(batch, 5), torch.rand(batch) + 0.5,
                                loss_reduction="mean", dtype=dtype)
