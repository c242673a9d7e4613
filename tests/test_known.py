"""Other libraries' layers that gradhooks recognises by class name and checks on a probe input
(gradhooks/rules/known.py): transformers' Conv1D and RMSNorms, timm's / torchvision's
LayerNorm2d, timm's LayerNorm, RmsNorm, BatchNormAct2d and LayerScale. Each against looped
autograd (float64 and float32, B = 1 and 3), without the fallback; a class that only shares
the name goes to the fallback with a warning. Copies of the library classes (same code) keep
these tests independent of the zoo extra; the real classes are tested too where installed."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.base.errors import FallbackWarning
from gradhooks.rules.fallback import FallbackRule
from gradhooks.rules.linear import TransposedLinearRule
from gradhooks.rules.norm import BatchNormActRule, LayerNorm2dRule, LayerNormRule, RMSNormLikeRule
from gradhooks.rules.scale import ScaleRule

import zoo_imports  # noqa: F401  (torchvision in this venv: see the module)
from conftest import assert_close_to_loop, check_against_loop, loop_grads


# ---------------------------------------------------------------- copies of the library classes
class Conv1D(nn.Module):
    """transformers.pytorch_utils.Conv1D (GPT-2), verbatim forward."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.randn(nf))

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class LlamaRMSNorm(nn.Module):
    """transformers' LlamaRMSNorm: x̂ in float32, cast back, times weight."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class T5LayerNorm(nn.Module):
    """transformers' T5LayerNorm: only the variance in float32."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight.dtype in [torch.float16, torch.bfloat16]:
            hidden_states = hidden_states.to(self.weight.dtype)
        return self.weight * hidden_states


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm scales by (1 + weight): named like an RMSNorm, computes something else
    (here in the input's dtype, so that the float64 fallback is compared at float64's precision)."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d))
        self.eps = eps

    def forward(self, x):
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return out * (1.0 + self.weight)


class LayerNorm2d(nn.LayerNorm):
    """torchvision.models.convnext.LayerNorm2d."""

    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class LayerScale(nn.Module):
    """timm.layers.LayerScale."""

    def __init__(self, dim, inplace=False):
        super().__init__()
        self.inplace = inplace
        self.gamma = nn.Parameter(torch.rand(dim) + 0.5)

    def forward(self, x):
        return x.mul_(self.gamma) if self.inplace else x * self.gamma


class LayerScale2d(LayerScale):
    """timm.layers.LayerScale2d."""

    def forward(self, x):
        gamma = self.gamma.view(1, -1, 1, 1)
        return x.mul_(gamma) if self.inplace else x * gamma


def randomised(module):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.rand_like(p) + 0.5)
    return module


def rule_of(gh, path):
    return next(layer.rule for layer in gh.recorder.layers if layer.path == path)


def timm_layers():
    import timm.layers
    return timm.layers


# id: (factory, input shape with 0 at the batch dim, batch_first, expected rule class)
CASES = {
    "conv1d-Bd": (lambda: Conv1D(5, 4), (0, 4), True, TransposedLinearRule),
    "conv1d-BTd": (lambda: Conv1D(5, 4), (0, 3, 4), True, TransposedLinearRule),
    "conv1d-TBd-seqfirst": (lambda: Conv1D(5, 4), (3, 0, 4), False, TransposedLinearRule),
    "llama-rmsnorm-BTd": (lambda: LlamaRMSNorm(6), (0, 3, 6), True, RMSNormLikeRule),
    "llama-rmsnorm-TBd-seqfirst": (lambda: LlamaRMSNorm(6, eps=1e-3), (3, 0, 6), False, RMSNormLikeRule),
    "t5-layernorm-BTd": (lambda: T5LayerNorm(6), (0, 3, 6), True, RMSNormLikeRule),
    "layernorm2d-BCHW": (lambda: randomised(LayerNorm2d(4)), (0, 4, 3, 2), True, LayerNorm2dRule),
    "layerscale-BTd": (lambda: LayerScale(6), (0, 3, 6), True, ScaleRule),
    "layerscale-TBd-seqfirst": (lambda: LayerScale(6), (3, 0, 6), False, ScaleRule),
    "layerscale2d-BCHW": (lambda: LayerScale2d(4), (0, 4, 3, 2), True, ScaleRule),
}


def run_case(make, shape, batch_first, expected, batch, loss_reduction, dtype):
    module = make()
    bdim = 0 if batch_first or len(shape) < 3 else 1
    shape = list(shape)
    shape[bdim] = batch
    model = nn.Sequential(module, nn.Tanh())
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)  # no fallback for any of these
        check_against_loop(model, torch.randn(*shape), torch.rand(batch) + 0.5,
                           loss_reduction=loss_reduction, dtype=dtype, batch_first=batch_first)
        with gradhooks.attach(model, batch_first=batch_first) as gh:
            assert type(rule_of(gh, "0")) is expected


@pytest.mark.parametrize("batch", [1, 3], ids=["B1", "B3"])
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_known_layer_matches_loop(case, batch, loss_reduction, dtype):
    run_case(*case, batch, loss_reduction, dtype)


def test_rmsnorm_variant_follows_where_the_module_rounds():
    """In float64 the three RMSNorms differ by float32 rounding (1e-8): each gets the variant
    that matches it to the last bits, else the float64 loop would differ at 1e-8."""
    model = nn.ModuleList([LlamaRMSNorm(6), T5LayerNorm(6), nn.Module()]).double()
    with gradhooks.attach(model) as gh:
        assert rule_of(gh, "0").precision == "float32"
        assert rule_of(gh, "1").precision == "float32-variance"


def test_name_alike_that_computes_otherwise_gets_the_fallback():
    """GemmaRMSNorm's (1 + weight) fails the probe: a warning names it, the fallback is exact."""
    model = nn.Sequential(nn.Linear(4, 6), GemmaRMSNorm(6), nn.Tanh()).double()
    x, y = torch.randn(3, 4, dtype=torch.float64), torch.rand(3, dtype=torch.float64)
    with pytest.warns(FallbackWarning, match="'1'.*GemmaRMSNorm.*RMSNormLikeRule.*differs"):
        check_against_loop(model, x, y, loss_reduction="mean", dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        with gradhooks.attach(model) as gh:
            assert isinstance(rule_of(gh, "1"), FallbackRule)


def test_inplace_layer_scale_is_not_recognised():
    """An inplace layer scale overwrites the input the rule needs: the probe refuses it."""
    model = nn.Sequential(nn.Linear(4, 6), LayerScale(6, inplace=True))
    with pytest.warns(FallbackWarning, match="inplace"):
        gh = gradhooks.attach(model)
    assert isinstance(rule_of(gh, "1"), FallbackRule)
    gh.detach()


def test_probe_leaves_random_state_and_modes_alone():
    model = nn.Sequential(Conv1D(5, 4), LlamaRMSNorm(5))
    model[1].train()
    state = torch.get_rng_state()
    gradhooks.attach(model).detach()
    assert torch.equal(state, torch.get_rng_state())
    assert model[1].training


# ---------------------------------------------------------------- Conv1D: the readers
def conv1d_and_linear(dtype):
    """A Conv1D MLP and the nn.Linear MLP with the same function (weights transposed)."""
    c = nn.Sequential(Conv1D(5, 4), nn.Tanh(), Conv1D(3, 5)).to(dtype)
    lin = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(dtype)
    with torch.no_grad():
        for i in (0, 2):
            lin[i].weight.copy_(c[i].weight.t())
            lin[i].bias.copy_(c[i].bias)
    return c, lin


@pytest.mark.parametrize("shape", [(3, 4), (3, 6, 4)], ids=["Bd", "BTd"])
def test_conv1d_norms_clipping_kfac(shape, dtype):
    """Norms (Gram form), ghost clipping (its own weighted sum, (I, O)) and KFAC factors of a
    Conv1D equal those of the nn.Linear with the transposed weight."""
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    x = torch.randn(*shape, dtype=dtype)
    c, lin = conv1d_and_linear(dtype)
    got = {}
    for name, model in (("c", c), ("lin", lin)):
        with gradhooks.attach(model) as gh:
            (model(x) ** 2).mean().backward()
            kf = gh.kfac_factors()
            norms = gh.per_sample_grad_norms(per_param=True)
            gh.clip_and_accumulate(0.1)
            clipped = {n: p.grad.clone() for n, p in model.named_parameters()}
            ps = gh.per_sample_grads()
        got[name] = (kf, norms, clipped, ps)
    (kc, nc, cc, pc), (kl, nl, cl, pl) = got["c"], got["lin"]
    for i in ("0", "2"):
        for attr in ("A", "G"):
            torch.testing.assert_close(getattr(kc[i], attr), getattr(kl[i], attr), rtol=tol, atol=tol)
        torch.testing.assert_close(nc[f"{i}.weight"], nl[f"{i}.weight"], rtol=tol, atol=tol)
        torch.testing.assert_close(cc[f"{i}.weight"], cl[f"{i}.weight"].t(), rtol=tol, atol=tol)
        torch.testing.assert_close(cc[f"{i}.bias"], cl[f"{i}.bias"], rtol=tol, atol=tol)
        torch.testing.assert_close(pc[f"{i}.weight"], pl[f"{i}.weight"].transpose(1, 2), rtol=tol, atol=tol)
        # grad_matrix / split / dense: the same [W b] matrix, each in its parameters' order
        grads = {n: p.grad for n, p in c.named_parameters()}
        lgrads = {n: g.t() if g.dim() == 2 else g for n, g in grads.items()}
        assert kc[i].weight_transposed and not kl[i].weight_transposed
        torch.testing.assert_close(kc[i].grad_matrix(grads), kl[i].grad_matrix(lgrads), rtol=0, atol=0)
        back = kc[i].split(kc[i].grad_matrix(grads))
        assert torch.equal(back[f"{i}.weight"], grads[f"{i}.weight"])
        w = c[int(i)].weight
        perm = torch.arange(w.numel()).view(w.t().shape).t().reshape(-1)  # Conv1D order -> Linear's
        perm = torch.cat([perm, torch.arange(w.numel(), w.numel() + w.shape[1])])
        torch.testing.assert_close(kc[i].dense(), kl[i].dense()[perm][:, perm], rtol=tol, atol=tol)


def test_conv1d_clipping_methods_agree():
    c, _ = conv1d_and_linear(torch.float64)
    x = torch.randn(4, 3, 4, dtype=torch.float64)
    out = {}
    for method in ("ghost", "materialize"):
        with gradhooks.attach(c) as gh:
            (c(x) ** 2).mean().backward()
            gh.clip_and_accumulate(0.05, method=method)
        out[method] = [p.grad.clone() for p in c.parameters()]
    for a, b in zip(out["ghost"], out["materialize"]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------- the real classes
def real_cases():
    cases = {}
    try:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm as HFLlama
        from transformers.models.t5.modeling_t5 import T5LayerNorm as HFT5
        from transformers.pytorch_utils import Conv1D as HFConv1D
        cases["transformers-Conv1D"] = (lambda: randomised(HFConv1D(5, 4)), (0, 3, 4), TransposedLinearRule)
        cases["transformers-LlamaRMSNorm"] = (lambda: randomised(HFLlama(6)), (0, 3, 6), RMSNormLikeRule)
        cases["transformers-T5LayerNorm"] = (lambda: randomised(HFT5(6)), (0, 3, 6), RMSNormLikeRule)
    except ImportError:
        pass
    try:
        from timm import layers as tl
        cases["timm-LayerNorm2d"] = (lambda: randomised(tl.LayerNorm2d(4)), (0, 4, 3, 2), LayerNorm2dRule)
        cases["timm-LayerNorm"] = (lambda: randomised(tl.LayerNorm(6)), (0, 3, 6), LayerNormRule)
        cases["timm-RmsNorm"] = (lambda: randomised(tl.RmsNorm(6)), (0, 3, 6), RMSNormLikeRule)
        cases["timm-LayerScale"] = (lambda: randomised(tl.LayerScale(6)), (0, 3, 6), ScaleRule)
        cases["timm-LayerScale2d"] = (lambda: randomised(tl.LayerScale2d(4)), (0, 4, 3, 2), ScaleRule)
        cases["timm-BatchNormAct2d-relu"] = (
            lambda: primed(tl.BatchNormAct2d(4)), (0, 4, 3, 2), BatchNormActRule)
        cases["timm-BatchNormAct2d-silu"] = (
            lambda: primed(tl.BatchNormAct2d(4, act_layer=nn.SiLU)), (0, 4, 3, 2), BatchNormActRule)
    except ImportError:
        pass
    return cases


def primed(bn):
    """Random affine parameters and non-trivial running statistics, then eval mode."""
    randomised(bn)
    with torch.no_grad():
        for _ in range(3):
            bn(torch.randn(4, bn.num_features, 3, 2) * 2 + 1)
    return bn.eval()


REAL = real_cases()


@pytest.mark.parametrize("batch", [1, 3], ids=["B1", "B3"])
@pytest.mark.parametrize("case", list(REAL.values()), ids=list(REAL))
def test_library_class_matches_loop(case, batch, loss_reduction, dtype):
    make, shape, expected = case
    run_case(make, shape, True, expected, batch, loss_reduction, dtype)


def test_batchnormact_in_training_mode_is_refused():
    tl = timm_layers()
    bn = tl.BatchNormAct2d(4).train()
    with gradhooks.attach(bn):
        with pytest.raises(gradhooks.UnsupportedCallError, match="BatchNormAct2d"):
            bn(torch.randn(2, 4, 3, 3))


class PegasusScaledWordEmbedding(nn.Embedding):
    """transformers' ``*ScaledWordEmbedding`` (BART, M2M100, Pegasus ...): a lookup times a
    constant."""

    def __init__(self, num, dim, padding_idx=None, embed_scale=1.0, plus=0.0, buffer=False):
        super().__init__(num, dim, padding_idx=padding_idx)
        self.plus, self.buffer = plus, buffer
        if buffer:  # Gemma's GemmaTextScaledWordEmbedding: a float32 0-dim buffer
            self.register_buffer("embed_scale", torch.tensor(embed_scale), persistent=False)
        else:
            self.embed_scale = embed_scale

    def forward(self, ids):
        scale = self.embed_scale.to(self.weight.dtype) if self.buffer else self.embed_scale
        return super().forward(ids) * scale + self.plus


@pytest.mark.parametrize("buffer", [False, True], ids=["number", "0-dim-buffer"])
@pytest.mark.parametrize("batch", [0, 1, 3], ids=["B0", "B1", "B3"])
@pytest.mark.parametrize("padding", [None, 2], ids=["no-pad", "pad"])
def test_scaled_word_embedding_matches_loop(batch, padding, buffer, dtype):
    """Recognised by the probe (no fallback): per-sample gradients, norms and clipping from the
    scaled row scatters, against the loop; the scale a number (BART) or a 0-dim float32 buffer
    cast to the table's dtype (Gemma; sqrt(32) is not exact in float32)."""
    torch.manual_seed(0)
    emb = PegasusScaledWordEmbedding(7, 4, padding_idx=padding, embed_scale=32 ** 0.5,
                                     buffer=buffer).to(dtype)
    model = nn.Sequential(emb, nn.Tanh(), nn.Flatten(), nn.Linear(12, 2)).to(dtype)
    x, y = torch.randint(0, 7, (batch, 3)), torch.randint(0, 2, (batch,))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        gh = gradhooks.attach(model, loss_reduction="sum")
    try:
        assert type(rule_of(gh, "0")).__name__ == "ScaledEmbeddingRule"
        F.cross_entropy(model(x), y, reduction="sum").backward()
        norms = gh.per_sample_grad_norms()
        ours = gh.per_sample_grads()
    finally:
        gh.detach()
    if batch == 0:
        assert ours["0.weight"].shape == (0, 7, 4) and norms.shape == (0,)
        return
    ref = loop_grads(model, F.cross_entropy, x, y)
    assert_close_to_loop(ours, ref, dtype)
    want = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    torch.testing.assert_close(norms, want, rtol=1e-9 if dtype == torch.float64 else 1e-4, atol=0)


def test_scaled_word_embedding_that_computes_otherwise_gets_the_fallback():
    """A ``*ScaledWordEmbedding`` that adds a constant after the scaling fails the probe."""
    model = nn.Sequential(PegasusScaledWordEmbedding(7, 4, embed_scale=2.0, plus=1.0), nn.Tanh())
    with pytest.warns(FallbackWarning, match="ScaledEmbeddingRule.*differs"):
        gh = gradhooks.attach(model)
    assert isinstance(rule_of(gh, "0"), FallbackRule)
    gh.detach()
