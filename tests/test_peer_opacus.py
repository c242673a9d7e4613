"""Opacus' own per-layer test suite (``opacus/tests/grad_samples``, shipped in the opacus wheel)
run with gradhooks as the grad sampler: a peer suite, with Opacus' hypothesis-drawn layer
configurations, its micro-batch reference and its tolerances, unchanged.

The adapter replaces Opacus' ``compute_opacus_grad_sample`` (the function its tests call to get
the per-sample gradients under test) by one that attaches gradhooks to the same clone of the
module, runs the same ``ModelWithLoss`` (L1 loss against zeros, ``loss_reduction`` "sum" or
"mean") and returns ``per_sample_grads()`` under Opacus' parameter names. Every grad-sample mode
Opacus would loop over runs gradhooks once (``run_test`` asks for "hooks" only here).
"""
import numpy as np
import opacus  # noqa: E402,F401
import pytest
import torch
from opacus.layers.dp_rnn import DPRNNBase  # noqa: E402
from opacus.tests.grad_samples import common  # noqa: E402
from opacus.utils import per_sample_gradients_utils as psu  # noqa: E402
from opacus.utils.module_utils import trainable_parameters  # noqa: E402
from torch.nn.utils.rnn import PackedSequence  # noqa: E402

import gradhooks  # noqa: E402

OPACUS_GRAD_SAMPLE = psu.compute_opacus_grad_sample


def gradhooks_grad_sample(x, module, batch_first=True, loss_reduction="mean",
                          grad_sample_mode="hooks"):
    """Opacus' ``compute_opacus_grad_sample`` with gradhooks in place of its GradSampleModule:
    ``{name: (B, *param.shape)}`` of the module's trainable parameters.

    One drawn configuration is refused by gradhooks, on purpose: Opacus' own DP RNN layers
    (``DPLSTM`` ...) on a ``PackedSequence`` run their cells on a shrinking part of the batch.
    There the refusal and its message are asserted, and Opacus' own result stands in so that
    Hypothesis goes on checking the other configurations of the test."""
    if isinstance(x, PackedSequence) and any(isinstance(m, DPRNNBase) for m in module.modules()):
        try:  # (sequences of equal lengths, or one sample: every call sees the whole batch)
            return _gradhooks(x, module, batch_first, loss_reduction)
        except gradhooks.BatchSizeError as e:
            assert "DPLSTM / DPGRU / DPRNN" in str(e) and "PackedSequence" in str(e), str(e)
        return OPACUS_GRAD_SAMPLE(x, module, batch_first=batch_first,
                                  loss_reduction=loss_reduction, grad_sample_mode="hooks")
    return _gradhooks(x, module, batch_first, loss_reduction)


def _packed(model, x, gh, loss_reduction):
    # ModelWithLoss's loss of a PackedSequence output: the L1 loss of the packed rows (tokens of
    # samples interleaved time-major) for "sum", the mean over the sequences of their own L1
    # means after pad_packed_sequence's in-place copies (CopySlices) for "mean": a loss graph
    # gradhooks does not prove, which a plain backward() refuses (tests/test_loss_graph.py).
    # The same loss as per-sample losses through gh.backward, whose sample check judges them
    # through the batched graph.
    out = model.wrapped_module(x)
    losses = torch.stack([model.criterion(x_i, torch.zeros_like(x_i))
                          for x_i in psu.unpack_packedsequences(out)])
    gh.backward(losses.mean() if loss_reduction == "mean" else losses.sum())


def _gradhooks(x, module, batch_first, loss_reduction):
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        torch.manual_seed(0)
        np.random.seed(0)
        model = psu.ModelWithLoss(psu.clone_module(module), loss_reduction)
        with gradhooks.attach(model.wrapped_module, loss_reduction=loss_reduction,
                              batch_first=batch_first) as gh:
            model.zero_grad()
            if isinstance(x, PackedSequence):
                _packed(model, x, gh, loss_reduction)
            else:
                model(x).backward()
            grads = gh.per_sample_grads()
        return {name: grads[name] for name, _ in trainable_parameters(model.wrapped_module)}
    finally:
        torch.use_deterministic_algorithms(deterministic)


@pytest.fixture(autouse=True)
def _gradhooks_as_grad_sampler(monkeypatch):
    monkeypatch.setattr(psu, "compute_opacus_grad_sample", gradhooks_grad_sample)
    monkeypatch.setattr(common, "compute_opacus_grad_sample", gradhooks_grad_sample)
    real = common.GradSampleHooks_test.run_test_with_reduction

    def one_mode(self, *args, grad_sample_mode="hooks", **kwargs):
        if grad_sample_mode != "hooks":  # the modes are Opacus' samplers: gradhooks is one
            return None
        return real(self, *args, grad_sample_mode=grad_sample_mode, **kwargs)

    monkeypatch.setattr(common.GradSampleHooks_test, "run_test_with_reduction", one_mode)


from opacus.tests.grad_samples.conv1d_test import *  # noqa: E402,F401,F403
from opacus.tests.grad_samples.conv2d_test import *  # noqa: E402,F401,F403
from opacus.tests.grad_samples.conv3d_test import *  # noqa: E402,F401,F403
from opacus.tests.grad_samples.dp_multihead_attention_test import *  # noqa: E402,F401,F403
from opacus.tests.grad_samples.dp_rnn_test import *  # noqa: E402,F401,F403
from opacus.tests.grad_samples.embedding_bag_test import *  # noqa: E402,F401,F403
from opacus.tests.grad_samples.embedding_test import *  # noqa: E402,F401,F403
from opacus.tests.grad_samples.group_norm_test import *  # noqa: E402,F401,F403
from opacus.tests.grad_samples.instance_norm1d_test import *  # noqa: E402,F401,F403
from opacus.tests.grad_samples.instance_norm2d_test import *  # noqa: E402,F401,F403
from opacus.tests.grad_samples.instance_norm3d_test import *  # noqa: E402,F401,F403
from opacus.tests.grad_samples.layer_norm_test import *  # noqa: E402,F401,F403
from opacus.tests.grad_samples.linear_test import *  # noqa: E402,F401,F403
from opacus.tests.grad_samples.rms_norm_test import *  # noqa: E402,F401,F403
from opacus.tests.grad_samples.sequence_bias_test import *  # noqa: E402,F401,F403
