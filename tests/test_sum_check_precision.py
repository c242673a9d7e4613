"""The sum check judges each parameter at the precision autograd formed its gradient in
(issue 30), and its message states the difference, the tolerance and the dtype, naming a cause
only where one is established.

transformers' Gemma and Mamba compute their norms (and Mamba its scan's ``A_log``, ``D``) in
float32 inside a float64 model (``self.weight.float()``, ``hidden_states.to(torch.float32)``):
their parameters' gradients are float32 values cast up, and the sum over the samples differs
from autograd's by float32 rounding. Those are judged at float32's tolerance, read off the values
autograd computed (``formed_in``) and the module they share (``module_precision``); every other
parameter stays at float64's, and a genuine mismatch is still refused."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.core.recorder.totals import GradTotal, formed_in
from gradhooks.readers.verify import check_sums

import zoo_imports

zoo_imports.import_torchvision()  # (transformers, for Gemma and Mamba)

F64 = torch.float64
V, T = 64, 5

pytestmark = pytest.mark.filterwarnings("ignore::gradhooks.FallbackWarning")


# ----------------------------------------------------------------------------- the zoo models
def _gemma():
    import transformers
    cfg = transformers.GemmaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                   vocab_size=V, max_position_embeddings=16, use_cache=False)
    return transformers.GemmaForCausalLM(cfg)


def _mamba():
    import transformers
    cfg = transformers.MambaConfig(hidden_size=32, state_size=4, num_hidden_layers=2,
                                   vocab_size=V, expand=2, conv_kernel=3, use_cache=False)
    return transformers.MambaForCausalLM(cfg)


class _Logits(nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids):
        return self.lm(input_ids=ids).logits


def _lm_loss(logits, ids):
    """Per token cross-entropy, its mean per sample, the mean over the samples."""
    per_token = F.cross_entropy(logits.reshape(-1, V), ids.reshape(-1), reduction="none")
    return per_token.view(ids.shape[0], -1).mean(1).mean()


def _loop(model, ids):
    """Per-sample gradients from B batch-of-one float64 passes."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    rows = []
    for i in range(ids.shape[0]):
        model.zero_grad(set_to_none=True)
        _lm_loss(model(ids[i:i + 1]), ids[i:i + 1]).backward()
        rows.append({n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                     for n, p in params.items()})
    model.zero_grad(set_to_none=True)
    return {n: torch.stack([r[n] for r in rows]) for n in params}


@pytest.mark.parametrize("batch", [1, 3], ids=["B1", "B3"])
@pytest.mark.parametrize("build", [_gemma, _mamba], ids=["gemma", "mamba"])
def test_float32_norms_of_a_float64_model_pass_the_check_and_match_the_loop(build, batch):
    torch.manual_seed(0)
    model = _Logits(build().double()).eval()
    ids = torch.randint(0, V, (batch, T), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (transformers' slow-path notices)
        ref = _loop(model, ids)
        with gradhooks.attach(model) as gh:
            _lm_loss(model(ids), ids).backward()
            got = gh.per_sample_grads()  # no GradientMismatchError
        with gradhooks.attach(model, check="always") as gh:  # the norms' own check
            _lm_loss(model(ids), ids).backward()
            norms = gh.per_sample_grad_norms()
    assert set(got) == set(ref)
    for name, want in ref.items():
        for n in range(batch):  # float32's floor of the model: relative to each gradient's norm
            err = float((got[name][n] - want[n]).norm())
            assert err <= 1e-5 * float(want[n].norm()) + 1e-12, (name, n, err)
    want_norms = torch.stack([torch.cat([ref[k][n].reshape(-1) for k in ref]).norm()
                              for n in range(batch)])
    torch.testing.assert_close(norms, want_norms, rtol=1e-5, atol=0)


# ------------------------------------------------------------- modules that compute in float32
class CastScale(nn.Module):
    """``x * (1 + w)`` computed in float32 (Gemma's RMSNorm's cast), plus a float64 bias."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d) * 0.1)
        self.bias = nn.Parameter(torch.randn(d) * 0.1)

    def forward(self, x):
        y = (x.float() * (1.0 + self.weight.float())).to(x.dtype)
        return y + self.bias


class CastLinear(nn.Linear):
    """A Linear whose product runs in float32: its weight's gradient is formed in float32."""

    def forward(self, x):
        return F.linear(x.float(), self.weight.float(), self.bias.float()).to(x.dtype)


def _data(b=6, d=8):
    g = torch.Generator().manual_seed(2)
    return torch.randn(b, d, generator=g, dtype=F64), torch.randn(b, 3, generator=g, dtype=F64)


@pytest.mark.parametrize("read", ["per_sample_grads", "per_sample_grad_norms"])
def test_a_module_computing_in_float32_is_judged_at_float32(read, grad_totals):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), CastScale(16), nn.Tanh(), CastLinear(16, 3)).double()
    x, y = _data()
    with gradhooks.attach(model, check="always") as gh:
        F.mse_loss(model(x), y).backward()
        getattr(gh, read)()
        # two backward passes of one forward: each pass's gradient is read for its precision
        out = model(x)
        F.mse_loss(out, y).backward(retain_graph=True)
        (0.5 * F.mse_loss(out, -y)).backward()
        getattr(gh, read)()


@pytest.mark.parametrize("batch", [1, 4], ids=["B1", "B4"])
def test_a_genuine_float64_mismatch_is_refused_at_float64(batch, grad_totals):
    """A parameter also used outside its module: the difference is named with float64's
    tolerance, and the float32 module beside it loosens nothing."""

    class Leaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.Linear(8, 8)
            self.norm = CastScale(8)
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            h = self.norm(torch.tanh(self.enc(x)))
            return self.head(h), h

    torch.manual_seed(0)
    model = Leaky().double()
    x, y = _data(batch)
    with gradhooks.attach(model) as gh:
        out, h = model(x)  # (a tiny use outside the module, in the loss)
        F.mse_loss(out + 1e-7 * (h @ model.enc.weight.T)[:, :3], y).backward()
        with pytest.raises(gradhooks.GradientMismatchError,
                           match=r"'enc.weight' do not sum .*: they differ by \S+, above the "
                                 r"tolerance for float64, \S+ \(rtol 1e-09 of"):
            gh.per_sample_grads()


def test_a_large_mismatch_names_the_use_outside_the_module():
    class TiedHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.Linear(4, 4)

        def forward(self, x):
            return torch.tanh(self.enc(x))

    model = TiedHead().double()
    with gradhooks.attach(model) as gh:  # (the weight used again in the loss)
        (model(torch.randn(3, 4, dtype=F64)) @ model.enc.weight.T).square().sum().backward()
        with pytest.raises(gradhooks.GradientMismatchError,
                           match=r"'enc.weight'.*above the tolerance for float64.*far above "
                                 r"rounding.*outside the module"):
            gh.per_sample_grads()


def test_a_float32_parameter_used_outside_its_module_is_still_refused():
    """Judged at float32 (its module computes in float32: the shift's values show it), a use
    outside the module is far above float32's tolerance."""

    class CastAffine(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(d) * 0.1)
            self.shift = nn.Parameter(torch.randn(d) * 0.1)

        def forward(self, x):
            return (x.float() * (1.0 + self.weight.float()) + self.shift.float()).to(x.dtype)

    class LeakyCast(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = CastAffine(4)

        def forward(self, x):
            return self.norm(x)

    model = LeakyCast().double()
    with gradhooks.attach(model) as gh:  # (used in the loss, after the forward)
        (model(torch.randn(5, 4, dtype=F64)) * model.norm.weight).square().sum().backward()
        with pytest.raises(gradhooks.GradientMismatchError,
                           match=r"'norm.weight'.*above the tolerance for float32.*the precision "
                                 r"autograd formed its gradient in.*outside the module"):
            gh.per_sample_grads()


def test_a_hook_that_changes_a_float64_gradient_is_named_with_the_tolerance():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    model[0].bias.register_hook(lambda g: g * (1 + 1e-6))  # small, yet far above float64's
    x, y = _data()
    with gradhooks.attach(model) as gh:
        F.mse_loss(model(x), y).backward()
        with pytest.raises(gradhooks.GradientMismatchError,
                           match=r"'0.bias'.*above the tolerance for float64.*'0.bias' has "
                                 r"gradient hooks registered before attach"):
            gh.per_sample_grads()


def test_a_rounding_sized_difference_is_not_blamed_on_a_use_outside():
    """A float64 difference of float32 rounding's size is said to be that, no use outside the
    module is named (none was seen)."""
    g = torch.Generator().manual_seed(3)
    per = torch.randn(4, 10, generator=g, dtype=F64)
    ref = per.sum(0) * (1 + 1e-7)
    with pytest.raises(gradhooks.GradientMismatchError, match="float32's tolerance") as info:
        check_sums([("w", per, ref)], None)
    assert "outside" not in str(info.value)
    assert "above the tolerance for float64" in str(info.value)


# ------------------------------------------------------------------------- reading the values
def test_formed_in_reads_float32_values_and_nothing_else():
    g = torch.Generator().manual_seed(4)
    x32 = torch.randn(300, generator=g).double()
    assert bool(formed_in(x32))
    assert not bool(formed_in(torch.randn(300, generator=g, dtype=F64)))
    x32[7] += 1e-12  # one value of float64's precision: not formed in float32
    assert not bool(formed_in(x32))
    assert not bool(formed_in(torch.zeros(5, dtype=F64)))  # exact in every dtype: no evidence
    assert not bool(formed_in(torch.tensor([1.0, -2.0, 3.0, 0.5], dtype=F64)))
    assert not bool(formed_in(torch.randn(5, generator=g)))  # float32 itself: nothing to read


def test_grad_total_reads_each_pass(grad_totals):
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(70000, generator=g).double(), torch.randn(70000, generator=g).double()
    total = GradTotal(a)
    total.add(b)  # the sum is no float32 value, each pass was
    assert not bool(formed_in(total.probe_values()))
    assert total.formed() == torch.float32
    other = GradTotal(torch.randn(70, generator=g, dtype=F64))
    other.add(torch.randn(70, generator=g, dtype=F64))
    assert other.formed() == F64
