"""Set-ups that give wrong numbers or misleading errors unless recognised (issue 29): each is
refused or warned with a message that names the user's cause and the module, and says what to
do. functional_call on an attached model, a gradient hook that changes a parameter's gradient,
a TorchScript submodule, a model with no parameters or none trainable, and two forwards (a
contrastive / two-view loss) reached by one backward."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
import gradhooks.core.recorder.attachment

from conftest import assert_close_to_loop, loop_grads

F64 = torch.float64


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(5, 4, generator=g, dtype=F64), torch.randint(0, 3, (5,), generator=g)


def test_functional_call_with_other_parameters_names_it():
    model = _mlp()
    x, y = _data()
    other = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    with gradhooks.attach(model) as gh:
        F.cross_entropy(torch.func.functional_call(model, other, (x,)), y).backward()
        with pytest.raises(gradhooks.GradientMismatchError,
                           match=r"'0' \(Linear\).*functional_call.*load_state_dict"):
            gh.per_sample_grads()
        # the model's own parameters, through functional_call or not: exact
        F.cross_entropy(torch.func.functional_call(model, dict(model.named_parameters()), (x,)),
                        y).backward()
        assert_close_to_loop(gh.per_sample_grads(), loop_grads(model, F.cross_entropy, x, y), F64)


def test_gradient_hook_that_changes_the_gradient_is_named():
    model = _mlp()
    x, y = _data()

    def double_it(g):
        return 2 * g

    model[0].weight.register_hook(double_it)
    with gradhooks.attach(model) as gh:
        F.cross_entropy(model(x), y).backward()
        with pytest.raises(gradhooks.GradientMismatchError,
                           match=r"'0.weight' has gradient hooks.*double_it.*register_hook"):
            gh.per_sample_grads()


@pytest.mark.parametrize("read", ["per_sample_grad_norms", "clip_and_accumulate"])
@pytest.mark.parametrize("param", ["0.weight", "0.bias"], ids=["weight-projection", "bias-probes"])
def test_gradient_hook_is_named_by_the_norms_and_clipping_checks(read, param):
    """The norms' and ghost clipping's sum check (the random projection of a Gram-form or
    rank-one weight, the probes of a bias) names the user's hook as per_sample_grads' does."""
    model = _mlp()
    x, y = _data()

    def double_it(g):
        return 2 * g

    model.get_parameter(param).register_hook(double_it)
    with gradhooks.attach(model) as gh:
        F.cross_entropy(model(x), y).backward()
        with pytest.raises(gradhooks.GradientMismatchError,
                           match=rf"{param!r} has gradient hooks.*double_it.*register_hook"):
            if read == "per_sample_grad_norms":
                gh.per_sample_grad_norms()
            else:
                gh.clip_and_accumulate(1.0)


def test_gradient_hook_registered_after_attach_changes_grad_only():
    model = _mlp()
    x, y = _data()
    ref = loop_grads(model, F.cross_entropy, x, y)
    with gradhooks.attach(model) as gh:
        model[0].weight.register_hook(lambda g: 2 * g)
        F.cross_entropy(model(x), y).backward()
        assert_close_to_loop(gh.per_sample_grads(), ref, F64)
        torch.testing.assert_close(model[0].weight.grad, 2 * ref["0.weight"].mean(0))


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_scripted_submodule_is_refused_at_attach():
    model = _mlp()
    model[2] = torch.jit.script(model[2])
    with pytest.raises(gradhooks.UnsupportedModuleError,
                       match=r"'2' \(Linear\) is a TorchScript module.*no Python hooks"):
        gradhooks.attach(model)
    assert not gradhooks.core.recorder.attachment.is_hooked(model)
    for p in model[2].parameters():  # a frozen scripted module: nothing to record there
        p.requires_grad_(False)
    with gradhooks.attach(model) as gh:
        x, y = _data()
        F.cross_entropy(model(x), y).backward()  # (provenance does not see into the scripted
        with pytest.raises(gradhooks.UnprovenOpError, match="did not follow"):  # module's ops)
            gh.per_sample_grads()
    with gradhooks.attach(model) as gh:  # (per-sample losses: checked through the batched graph)
        gh.backward(F.cross_entropy(model(x), y, reduction="none").mean())
        assert set(gh.per_sample_grads()) == {"0.weight", "0.bias"}


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_scripted_model_is_refused_at_attach():
    with pytest.raises(gradhooks.UnsupportedModuleError, match=r"'<root>'.*TorchScript"):
        gradhooks.attach(torch.jit.script(_mlp()))


def test_model_without_parameters_is_refused():
    with pytest.raises(gradhooks.GradHooksError, match=r"\(Sequential\) has no parameters"):
        gradhooks.attach(nn.Sequential(nn.Tanh(), nn.ReLU()))


def test_frozen_model_is_warned_and_followed_when_unfrozen():
    model = _mlp().requires_grad_(False)
    x, y = _data()
    with pytest.warns(gradhooks.FrozenModelWarning, match=r"\(Sequential\).*requires_grad_"):
        gh = gradhooks.attach(model)
    with gh:
        model.requires_grad_(True)
        F.cross_entropy(model(x), y).backward()
        assert_close_to_loop(gh.per_sample_grads(), loop_grads(model, F.cross_entropy, x, y), F64)


def test_partly_frozen_model_is_not_warned():
    model = _mlp()
    model[0].requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gradhooks.FrozenModelWarning)
        gradhooks.attach(model).detach()


def test_two_view_contrastive_loss_names_it():
    model = _mlp()
    x, _ = _data()
    x2 = x + 0.1 * torch.randn_like(x)
    with gradhooks.attach(model) as gh:
        z1, z2 = F.normalize(model(x), dim=1), F.normalize(model(x2), dim=1)
        logits = z1 @ z2.T / 0.5  # InfoNCE over the two views
        F.cross_entropy(logits, torch.arange(len(x))).backward()
        with pytest.raises(gradhooks.GradHooksError,
                           match=r"2 forwards.*contrastive.*InfoNCE.*forwards='same_samples'"):
            gh.per_sample_grads()


class StridedRows(nn.Module):
    """A view gradhooks cannot follow (``as_strided``) hands the next layer rows that are not
    the batch's."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h.as_strided((h.shape[0] // 2, 6), (6, 1)))


class MergedChannels(nn.Module):
    """PatchTST's layout: each sample's channels folded into the batch, ``(B * C, D, L)``,
    before a BatchNorm1d (eval), whose rule reads dim 0 as the samples."""

    def __init__(self):
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(4, 6), nn.BatchNorm1d(6).eval(), nn.Linear(6, 3)

    def forward(self, x):  # x: (B, C, L, 4)
        h = self.a(x).flatten(0, 1).transpose(1, 2)  # (B * C, 6, L)
        return self.b(self.norm(h).mean(-1)).view(x.shape[0], -1, 3).mean(1)


@pytest.mark.parametrize("case", ["strided", "merged"])
def test_a_layer_that_sees_another_batch_size_names_the_cause(case):
    """The BatchSizeError names what provenance knows: the first op whose batch dim it could
    not follow (op, reason, line), or the batch merged into the rows of a layer whose rule
    does not read merged rows; not 'check the input layout'."""
    if case == "strided":
        model, x, want = StridedRows(), torch.randn(4, 4), r"the first: op as_strided.*" \
            r"test_setup_messages.py:\d+ in forward"
    else:
        model, x, want = MergedChannels(), torch.randn(3, 2, 5, 4), r"merged.*BatchNormRule"
    with gradhooks.attach(model) as gh:
        with pytest.raises(gradhooks.BatchSizeError, match=want) as info:
            model(x).sum().backward()
            gh.per_sample_grads()
        assert "check the input layout" not in str(info.value)
