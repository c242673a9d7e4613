"""Activation checkpointing (torch.utils.checkpoint, both modes; checkpoint_sequential;
transformers' gradient_checkpointing_enable): the forwards recomputed during the backward belong
to the batch being differentiated. Float64 against a loop written here."""
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import gradhooks

from conftest import RTOL, assert_close_to_loop, loop_grads


class Checkpointed(nn.Module):
    """Linear-Tanh-Linear-Tanh in a checkpointed block, then a Linear head."""

    def __init__(self, reentrant):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 3)
        self.reentrant = reentrant

    def forward(self, x):
        return self.head(checkpoint(self.block, x, use_reentrant=self.reentrant))


def _loss(reduction):
    return lambda out, y: F.cross_entropy(out, y, reduction=reduction)


@pytest.mark.parametrize("reentrant,backward", [(False, "loss.backward"), (False, "gh.backward"),
                                                (True, "loss.backward")],
                         ids=["non_reentrant", "non_reentrant-gh.backward", "reentrant"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("batch", [1, 5])
def test_checkpoint_matches_loop(reentrant, backward, reduction, batch, dtype):
    torch.manual_seed(0)
    model = Checkpointed(reentrant).to(dtype)
    x, y = torch.randn(batch, 4, dtype=dtype, requires_grad=reentrant), torch.randint(0, 3, (batch,))
    ref = loop_grads(model, _loss(reduction), x, y)
    with gradhooks.attach(model, loss_reduction=reduction) as gh:
        for _ in range(3):  # later steps: gh.backward's output-edges pass, structure checked
            loss = _loss(reduction)(model(x), y)
            loss.backward() if backward == "loss.backward" else gh.backward(loss)
            assert_close_to_loop(gh.per_sample_grads(), ref, dtype)
            if backward == "loss.backward":
                model.zero_grad()


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpoint_norms_and_clipping(reentrant):
    """Book-keeping after loss.backward(); two-pass clipping (its first pass is gh.backward's,
    so only without reentrant checkpoints, which it refuses: next test)."""
    torch.manual_seed(1)
    f64 = torch.float64
    model = Checkpointed(reentrant).to(f64)
    x, y = torch.randn(6, 4, dtype=f64, requires_grad=reentrant), torch.randint(0, 3, (6,))
    ref = loop_grads(model, _loss("mean"), x, y)
    norms = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in ref.values()))
    c = float(norms.median())
    clipped = {n: (g * (c / norms).clamp(max=1).view(-1, *[1] * (g.dim() - 1))).mean(0)
               for n, g in ref.items()}
    with gradhooks.attach(model) as gh:
        _loss("mean")(model(x), y).backward()
        torch.testing.assert_close(gh.per_sample_grad_norms(), norms, rtol=1e-10, atol=0)
        gh.clip_and_accumulate(c)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, clipped[n], rtol=1e-10, atol=1e-15)
        if reentrant:
            return
        out = model(x)
        gh.clipped_backward(F.cross_entropy(out, y, reduction="none"), c)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, clipped[n], rtol=1e-10, atol=1e-15)


def test_gh_backward_refuses_a_reentrant_checkpoint():
    """torch.autograd.grad does not run the layers inside a reentrant checkpoint: refused with
    what to do, not a result without them."""
    model = Checkpointed(True).double()
    x, y = torch.randn(4, 4, dtype=torch.float64, requires_grad=True), torch.randint(0, 3, (4,))
    with gradhooks.attach(model) as gh:
        with pytest.raises(gradhooks.GradHooksError, match="use_reentrant=False"):
            gh.backward(F.cross_entropy(model(x), y))


def test_checkpoint_sequential(dtype):
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                          nn.Linear(8, 3)).to(dtype)
    x, y = torch.randn(5, 4, dtype=dtype), torch.randint(0, 3, (5,))

    class Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model

        def forward(self, x):
            return checkpoint_sequential(self.net, 2, x, use_reentrant=False)

    wrapped = Seq()
    ref = loop_grads(wrapped, _loss("mean"), x, y)
    with gradhooks.attach(wrapped) as gh:
        for _ in range(2):
            _loss("mean")(wrapped(x), y).backward()
            assert_close_to_loop(gh.per_sample_grads(), ref, dtype)


def test_transformers_gradient_checkpointing():
    """A small BERT with transformers' own gradient_checkpointing_enable(). (The stub: the
    registry's torchvision 0.28 is a CUDA build whose import fails with our CPU torch in
    torchvision/_meta_registrations.py; transformers imports torchvision when it is installed
    and uses none of its ops here.)"""
    sys.modules.setdefault("torchvision._meta_registrations",
                           types.ModuleType("torchvision._meta_registrations"))
    import transformers
    torch.manual_seed(3)
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=32,
                                  max_position_embeddings=16, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    bert = transformers.BertForSequenceClassification(cfg).double().train()
    bert.gradient_checkpointing_enable()
    assert bert.is_gradient_checkpointing

    class Classifier(nn.Module):  # position and token-type ids passed batched (issue 16)
        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, ids):
            return self.bert(input_ids=ids, position_ids=torch.arange(ids.shape[1]).expand_as(ids),
                             token_type_ids=torch.zeros_like(ids)).logits

    model = Classifier()
    ids, labels = torch.randint(0, 50, (3, 7)), torch.randint(0, 2, (3,))
    ref = loop_grads(model, F.cross_entropy, ids, labels)
    with gradhooks.attach(model) as gh:
        F.cross_entropy(model(ids), labels).backward()
        ours = gh.per_sample_grads()
    assert list(ours) == list(ref)
    # relative to the largest entry over all parameters: the key biases' gradients are 0 up to
    # rounding (softmax is invariant to them)
    scale = max(float(g.abs().max()) for g in ref.values())
    for n, g in ref.items():
        assert float((ours[n] - g).abs().max()) <= RTOL[torch.float64] * scale, n
