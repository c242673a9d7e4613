"""Mamba's selective state-space mixer (issue 30; gradhooks/rules/mamba.py): the parameters the
mixer reads itself (``A_log``, ``D``, ``conv1d.*``, ``dt_proj.*``) get their per-sample gradients
from :class:`MambaMixerRule` instead of the ``torch.func`` fallback, ``in_proj`` / ``x_proj`` /
``out_proj`` from the Linear rule. Against a loop of batch-of-one passes, float64 and float32, on a
copy of transformers' ``MambaMixer`` (no transformers needed) and on tiny ``MambaForCausalLM``
and ``Mamba2ForCausalLM`` (hidden 32, 2 layers, vocab 64, T = 5; Mamba-2's mixer on
:class:`Mamba2MixerRule`, gradhooks/rules/mamba2.py), with and without padding, without any
FallbackWarning.

The mixer computes ``A``, ``D`` and the scan's ``Δ B u`` in float32 whatever the model's dtype,
so at float64 the loop agrees to float32's precision only: each parameter's per-sample gradients
are compared at ``1e-5`` of their norm (``test_norm_variants.against_loop``)."""
import math

import pytest
import torch
import torch.nn.functional as F
from test_norm_variants import (
    against_loop,
    call,
    rule_of,
    run_lm,
    square,
    tiny,
    token_loss,
    transformers_lib,
)
from torch import nn

import gradhooks
from gradhooks.base.errors import FallbackWarning, UnsupportedCallError
from gradhooks.rules.linear import LinearRule
from gradhooks.rules.mamba import MambaMixerRule
from gradhooks.rules.mamba2 import Mamba2MixerRule
from gradhooks.rules.norm_variants import GatedRMSNormRule


class MambaMixer(nn.Module):
    """transformers' MambaMixer (5.x), the slow path verbatim (causal_conv1d_fn and the
    sequential mamba_selective_scan inlined), without the cache."""

    def __init__(self, hidden=6, inner=8, state=3, rank=2, kernel=4, conv_bias=True):
        super().__init__()
        self.intermediate_size, self.ssm_state_size, self.time_step_rank = inner, state, rank
        self.conv1d = nn.Conv1d(inner, inner, kernel, groups=inner, padding=kernel - 1, bias=conv_bias)
        self.activation = "silu"
        self.act = nn.SiLU()
        self.in_proj = nn.Linear(hidden, 2 * inner, bias=False)
        self.x_proj = nn.Linear(inner, rank + 2 * state, bias=False)
        self.dt_proj = nn.Linear(rank, inner, bias=True)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, state + 1.0)).expand(inner, -1).contiguous()
                                  + 0.1 * torch.randn(inner, state))
        self.D = nn.Parameter(torch.rand(inner) + 0.5)
        self.out_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, hidden_states, cache=None, attention_mask=None):
        def masked(h):
            return h if attention_mask is None else (h * attention_mask[:, :, None]).to(h.dtype)

        dtype = hidden_states.dtype
        projected_states = self.in_proj(masked(hidden_states)).transpose(1, 2)
        A = -torch.exp(self.A_log.float())
        hidden_states_B_C, gate = projected_states.chunk(2, dim=1)
        weight, seq_len = self.conv1d.weight.squeeze(1), hidden_states_B_C.shape[-1]
        out = F.conv1d(hidden_states_B_C.to(weight.dtype), weight=weight.unsqueeze(1),
                       bias=self.conv1d.bias, padding=weight.shape[-1] - 1,
                       groups=hidden_states_B_C.shape[1])[:, :, :seq_len]
        hidden_states_B_C = self.act(out).to(hidden_states_B_C.dtype)
        hidden_states_B_C = masked(hidden_states_B_C.transpose(1, 2))
        time_step, B, C = torch.split(self.x_proj(hidden_states_B_C),
                                      [self.time_step_rank, self.ssm_state_size, self.ssm_state_size], dim=-1)
        time_step = self.dt_proj.weight @ time_step.transpose(1, 2)
        # mamba_selective_scan(u, dt, A, B^T, C^T, D, z=gate, delta_bias, delta_softplus=True)
        u, dt = hidden_states_B_C.transpose(1, 2), time_step
        dt = F.softplus(dt + self.dt_proj.bias.float().to(dt.dtype)[..., None])
        discrete_A = torch.exp(A[None, :, None, :] * dt[:, :, :, None])
        discrete_B = dt[:, :, :, None] * B[:, None, :, :].float()
        deltaB_u = discrete_B * u[:, :, :, None].float()
        ssm_state = torch.zeros(u.shape[0], u.shape[1], A.shape[-1], dtype=u.dtype)
        scan_outputs = []
        for index in range(seq_len):
            ssm_state = discrete_A[:, :, index] * ssm_state + deltaB_u[:, :, index]
            scan_output = torch.matmul(ssm_state.to(u.dtype), C[:, index, :].unsqueeze(-1))
            scan_outputs.append(scan_output[:, :, 0])
        scan_output = torch.stack(scan_outputs, dim=-1)
        scan_output = (scan_output + u * self.D.float()[None, :, None]) * F.silu(gate)
        return self.out_proj(scan_output.transpose(1, 2).to(dtype))


class Block(nn.Module):
    """``tanh(mixer(x, attention_mask=mask))``; with ``masked`` the mask zeroes the tokens whose
    first feature is below -0.3 (padding, as the model marks it)."""

    def __init__(self, masked=False, **kwargs):
        super().__init__()
        self.mixer, self.masked = MambaMixer(**kwargs), masked

    def forward(self, x):
        mask = None
        if self.masked:  # (each sample's own: the loop's batch of one sees the same mask)
            mask = (x[..., 0] > -0.3).to(x.dtype)
        return torch.tanh(self.mixer(x, attention_mask=mask))


MIXER_PARAMS = ["A_log", "D", "conv1d.weight", "conv1d.bias", "dt_proj.weight", "dt_proj.bias"]


def assert_mixer_layers(gh, prefix):
    """The mixer on its rule with its six parameters (five without a conv bias); its Linears on
    theirs; conv1d and dt_proj not hooked themselves."""
    layers = {layer.path: layer for layer in gh.recorder.layers if layer.path.startswith(prefix)}
    assert isinstance(layers[prefix].rule, MambaMixerRule)
    own = dict(layers[prefix].module.named_parameters())
    assert sorted(layers[prefix].params) == sorted(n for n in MIXER_PARAMS if n in own)
    for name in ("in_proj", "x_proj", "out_proj"):
        assert isinstance(layers[f"{prefix}.{name}"].rule, LinearRule)
    assert f"{prefix}.conv1d" not in layers and f"{prefix}.dt_proj" not in layers


CASES = {
    "plain": dict(),
    "masked": dict(masked=True),
    "no-conv-bias-k2": dict(kernel=2, conv_bias=False),
}


@pytest.mark.parametrize("b", [0, 1, 3], ids=["B0", "B1", "B3"])
@pytest.mark.parametrize("kwargs", list(CASES.values()), ids=list(CASES))
def test_mixer_copy_matches_loop(kwargs, b, dtype):
    torch.manual_seed(0)
    model = Block(**kwargs).to(dtype)
    gh = against_loop(model, call, torch.randn(b, 5, 6, dtype=dtype), square)
    assert_mixer_layers(gh, "mixer")
    gh.detach()


def test_frozen_mixer_parameters_are_left_out(dtype):
    torch.manual_seed(0)
    model = Block().to(dtype)
    model.mixer.A_log.requires_grad_(False)
    model.mixer.conv1d.bias.requires_grad_(False)
    x = torch.randn(3, 5, 6, dtype=dtype)
    gh = against_loop(model, call, x, square)
    ours = gh.per_sample_grads()
    assert "mixer.A_log" not in ours and "mixer.conv1d.bias" not in ours
    assert "mixer.D" in ours and "mixer.conv1d.weight" in ours
    gh.detach()


def test_mixer_that_computes_otherwise_gets_the_fallback():
    """A class named MambaMixer that skips the D term fails the probe: a warning, the fallback."""
    class Other(MambaMixer):
        def forward(self, hidden_states, cache=None, attention_mask=None):
            return super().forward(hidden_states) - 0.5 * self.out_proj(hidden_states[..., :1].expand(
                -1, -1, self.intermediate_size))

    Other.__name__ = Other.__qualname__ = "MambaMixer"
    model = nn.Sequential(Other())
    with pytest.warns(FallbackWarning, match="MambaMixerRule.*differs"):
        gh = gradhooks.attach(model)
    assert not isinstance(rule_of(gh, "0"), MambaMixerRule)
    gh.detach()


def test_mixer_called_with_a_cache_is_refused():
    model = Block()
    mixer = model.mixer
    with gradhooks.attach(model):
        with pytest.raises(UnsupportedCallError, match="use_cache=False"):
            mixer(torch.randn(2, 5, 6), cache=object())


# ---------------------------------------------------------------- transformers' MambaForCausalLM
def tiny_mamba():
    t = transformers_lib()
    torch.manual_seed(0)
    model = t.MambaForCausalLM(t.MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                             state_size=4, expand=2))
    with torch.no_grad():  # D, A_log, norms off their initial values
        for n, p in model.named_parameters():
            if n.endswith(("D", "A_log", "norm.weight", "norm_f.weight")):
                p.add_(0.3 * torch.randn_like(p))
    return model.train()


def run_lm_padded(model, ids):
    """The ids with token 0 as padding (``attention_mask = ids != 0``, each sample's own)."""
    return model(input_ids=ids, attention_mask=(ids != 0).long(), use_cache=False).logits


@pytest.mark.parametrize("run", [run_lm, run_lm_padded], ids=["plain", "padded"])
@pytest.mark.parametrize("b", [1, 3], ids=["B1", "B3"])
def test_tiny_mamba_matches_loop(b, run, dtype):
    model = tiny_mamba().to(dtype)
    ids = torch.randint(0, 64, (b, 5))
    ids[:, -1] = 0  # (padding where padded)
    gh = against_loop(model, run, ids, token_loss)  # (no FallbackWarning at all)
    for i in range(2):
        assert_mixer_layers(gh, f"backbone.layers.{i}.mixer")
    gh.detach()


@pytest.mark.parametrize("run", [run_lm, run_lm_padded], ids=["plain", "padded"])
@pytest.mark.parametrize("b", [1, 3], ids=["B1", "B3"])
def test_tiny_mamba2_matches_loop(b, run, dtype):
    """Mamba-2 (2 groups, chunk 4 for T = 5: a padded chunk): the mixer's dt_bias, A_log, D and
    conv1d on Mamba2MixerRule, its gated norm on GatedRMSNormRule, no FallbackWarning."""
    model = tiny("mamba2").to(dtype)
    ids = torch.randint(0, 64, (b, 5))
    ids[:, -1] = 0
    gh = against_loop(model, run, ids, token_loss)
    for i in range(2):
        layers = {x.path: x for x in gh.recorder.layers}
        mixer = layers[f"backbone.layers.{i}.mixer"]
        assert isinstance(mixer.rule, Mamba2MixerRule)
        assert sorted(mixer.params) == sorted(["dt_bias", "A_log", "D", "conv1d.weight", "conv1d.bias"])
        assert isinstance(layers[f"backbone.layers.{i}.mixer.norm"].rule, GatedRMSNormRule)
        assert isinstance(layers[f"backbone.layers.{i}.mixer.in_proj"].rule, LinearRule)
    gh.detach()


def test_tiny_mamba_eval_with_cache_is_refused():
    """Eval mode defaults to use_cache=True: refused with the hint; use_cache=False works."""
    model = tiny_mamba().eval()
    ids = torch.randint(0, 64, (2, 5))
    with gradhooks.attach(model, check=False) as gh:
        with pytest.raises(UnsupportedCallError, match="use_cache=False"):
            model(input_ids=ids)
        token_loss(model(input_ids=ids, use_cache=False).logits, ids).backward()
        assert math.isfinite(float(gh.per_sample_grads()["backbone.layers.0.mixer.A_log"].sum()))


# ---------------------------------------------------------------- readers on the new rules
READER_MODELS = {"mixer": lambda: Block(masked=True),
                 "gated-norm": lambda: __import__("test_norm_variants").Gated()}


@pytest.mark.parametrize("method", ["ghost", "two_pass"])
@pytest.mark.parametrize("kind", list(READER_MODELS))
def test_norms_and_clipping_match_loop(kind, method, dtype):
    """Per-sample norms and the clipped sum (``sum_n min(1, C / ||g_n||) g_n / B``) from the
    looped gradients, at float32's precision (the layers compute in float32 inside)."""
    from test_norm_variants import loop_grads
    torch.manual_seed(0)
    model = READER_MODELS[kind]().to(dtype)
    x = torch.randn(4, 5, 6 if kind == "mixer" else 5, dtype=dtype)
    ref = loop_grads(model, call, x, square)
    flat = torch.cat([g.flatten(1) for g in ref.values()], 1)
    norms = flat.norm(dim=1)
    bound = float(norms.median())
    c = (bound / norms).clamp(max=1.0)
    # (check=False: the sum check's false float64 mismatch of float32-inside layers, see
    # test_norm_variants.against_loop)
    with gradhooks.attach(model, check=False) as gh:
        out = model(x)
        if method == "two_pass":
            gh.clipped_backward(out.pow(2).flatten(1).sum(1), bound)
        else:
            square(out, x).backward()
            got = gh.per_sample_grad_norms()
            assert (got - norms).norm() <= 1e-5 * norms.norm()
            gh.clip_and_accumulate(bound, method=method)
    for name, p in model.named_parameters():
        want = torch.einsum("n,n...->...", c, ref[name]) / x.shape[0]
        assert (p.grad - want).norm() <= 1e-5 * want.norm() + 1e-30, name

