"""Property test over training set-ups: Hypothesis draws a stock-layer model, whether it is
checkpointed (and how), compiled or not, the batch size (0, 1, several), the loss reduction and
the backward; every per-sample gradient and norm must equal a loop written here (float64)."""
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradhooks

from conftest import assert_close_to_loop

F64 = torch.float64
LAYERS = {
    "linear": lambda: nn.Sequential(nn.Linear(4, 6), nn.Tanh()),
    "conv": lambda: nn.Sequential(nn.Unflatten(1, (1, 4)), nn.Conv1d(1, 2, 3), nn.Tanh(),
                                  nn.Flatten(), nn.Linear(4, 6)),
    "layernorm": lambda: nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6)),
    "groupnorm": lambda: nn.Sequential(nn.Linear(4, 6), nn.Unflatten(1, (6, 1)),
                                       nn.GroupNorm(2, 6), nn.Flatten()),
}


class Net(nn.Module):
    def __init__(self, layer, ckpt):
        super().__init__()
        self.body, self.head, self.ckpt = LAYERS[layer](), nn.Linear(6, 3), ckpt

    def forward(self, x):
        if self.ckpt == "none":
            h = self.body(x)
        else:
            h = checkpoint(self.body, x, use_reentrant=self.ckpt == "reentrant")
        return self.head(h)


def _loop(model, x, y, reduction):
    names = [n for n, _ in model.named_parameters()]
    rows = {n: [] for n in names}
    for i in range(x.shape[0]):
        model.zero_grad()
        F.cross_entropy(model(x[i:i + 1]), y[i:i + 1], reduction=reduction).backward()
        for n, p in model.named_parameters():
            rows[n].append(p.grad.clone())
    return {n: torch.stack(rows[n]) if rows[n] else
            torch.zeros(0, *p.shape, dtype=F64) for n, p in model.named_parameters()}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layer=st.sampled_from(sorted(LAYERS)), ckpt=st.sampled_from(["none", "non_reentrant",
                                                                     "reentrant"]),
       compiled=st.booleans(), batch=st.sampled_from([0, 1, 3]),
       reduction=st.sampled_from(["mean", "sum"]), gh_backward=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_setups_match_loop(layer, ckpt, compiled, batch, reduction, gh_backward, seed):
    torch.manual_seed(seed)
    model = Net(layer, ckpt).double()
    if batch == 0:
        reduction = "sum"  # (a mean over no samples is NaN)
    if ckpt == "reentrant":
        gh_backward = False  # refused with a clear error (test_setup_checkpoint.py)
    x = torch.randn(batch, 4, dtype=F64, requires_grad=ckpt == "reentrant")
    y = torch.randint(0, 3, (batch,))
    ref = _loop(model, x, y, reduction)
    torch._dynamo.reset()
    run = torch.compile(model, backend="aot_eager") if compiled and ckpt == "none" else model
    with gradhooks.attach(model, loss_reduction=reduction) as gh:
        for _ in range(2):
            loss = F.cross_entropy(run(x), y, reduction=reduction)
            gh.backward(loss) if gh_backward else loss.backward()
            if batch:
                norms = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in ref.values()))
                torch.testing.assert_close(gh.per_sample_grad_norms(), norms, rtol=1e-9, atol=0)
            ours = gh.per_sample_grads()
            if batch:
                assert_close_to_loop(ours, ref, F64)
            else:
                assert {n: g.shape for n, g in ours.items()} == {n: g.shape for n, g in ref.items()}
            model.zero_grad()
    torch._dynamo.reset()
