"""Mixture of experts (issue 30, part 3): transformers' Mixtral and Qwen2-MoE from tiny configs,
with their default call.

Their router (``MixtralTopKRouter``: a raw ``(E, D)`` weight read with ``F.linear`` on the
``(B * T, D)`` token rows) and experts (``MixtralExperts``: raw ``(E, 2I, D)`` / ``(E, D, I)``
tensors, read per expert as ``F.linear(hidden[token_idx], gate_up_proj[e])`` and summed back
with ``index_add_``) are modules without a rule. Provenance follows each token row's sample
through the routing (``hidden[token_idx]``: rows of the samples ``token_idx // T``,
:class:`gradhooks.core.batch_dims.Routed`), and each ``F.linear`` whose weight is such a
module's parameter (or an expert's slice of one) forms every sample's gradient from its own
rows there (gradhooks/core/rows.py), written into the 3-D parameter's slice. The
load-balancing loss (``output_router_logits=True``) mixes the samples and is refused.

Exactness: both models compute in float32 inside a float64 model (the router's softmax,
RMSNorm), so even the batch gradient differs from the loop's mean by about 1e-7 of its size;
the float64 checks swap those two forwards for the same math in the model's dtype
(``float64_internals``), and the models as shipped are checked to 1e-6. The default experts
implementation (``torch._grouped_mm``, no float64) is refused at the read, naming the experts.
"""
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
import zoo_imports  # noqa: F401  (torchvision importable before transformers)
from conftest import loop_grads

V = 64


class TokensToLogits(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).logits


def mixtral(experts="eager"):
    import transformers
    cfg = transformers.MixtralConfig(vocab_size=V, hidden_size=32, intermediate_size=48,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=32,
                                     experts_implementation=experts)
    return TokensToLogits(transformers.MixtralForCausalLM(cfg))


def qwen2_moe():
    import transformers
    cfg = transformers.Qwen2MoeConfig(vocab_size=V, hidden_size=32, intermediate_size=48,
                                      moe_intermediate_size=24,
                                      shared_expert_intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      num_experts=4, num_experts_per_tok=2,
                                      max_position_embeddings=32, experts_implementation="eager")
    return TokensToLogits(transformers.Qwen2MoeForCausalLM(cfg))


def _router_forward(self, hidden_states):
    # (MixtralTopKRouter / Qwen2MoeTopKRouter.forward without the cast to float32)
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(hidden_states, self.weight)
    top, chosen = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top, chosen


def _rms_norm_forward(self, h):
    # (MixtralRMSNorm / Qwen2MoeRMSNorm.forward without the cast to float32)
    return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def float64_internals(model):
    """The routers' and RMSNorms' forwards in the model's dtype (they cast to float32)."""
    for m in model.modules():
        name = type(m).__name__
        if name.endswith("TopKRouter"):
            m.forward = types.MethodType(_router_forward, m)
        elif name.endswith("RMSNorm"):
            m.forward = types.MethodType(_rms_norm_forward, m)
    return model


def token_loss(out, y):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="sum") / out.shape[0]


def tokens(b, t, seed=0):
    ids = torch.randint(1, V, (b, t), generator=torch.Generator().manual_seed(seed))
    return ids, ids.roll(-1, 1)


def attach(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gradhooks.FallbackWarning)
        return gradhooks.attach(model)


def check(model, b, t, rtol, seed=0):
    """Per-sample gradients and norms against the loop, each parameter to ``rtol`` of its
    largest entry (with a floor of 1e-4 of the model's largest: gradients that vanish in
    exact arithmetic, key biases)."""
    ids, y = tokens(b, t, seed)
    ref = loop_grads(model, token_loss, ids, y)
    norms = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in ref.values()))
    gh = attach(model)
    try:
        token_loss(model(ids), y).backward()
        torch.testing.assert_close(gh.per_sample_grad_norms(), norms, rtol=max(rtol, 1e-9),
                                   atol=0)
        got = gh.per_sample_grads()
        assert list(got) == list(ref)
        floor = 1e-4 * max(r.abs().max() for r in ref.values())
        for name, r in ref.items():
            scale = max(r.abs().max(), floor)
            diff = (got[name] - r).abs().max()
            assert diff <= rtol * scale, f"{name}: max diff {diff:.3e} vs scale {scale:.3e}"
    finally:
        gh.detach()


MODELS = {"mixtral": mixtral, "qwen2-moe": qwen2_moe}


@pytest.mark.parametrize("b, t", [(3, 6), (3, 3), (1, 5)], ids=["B3", "T_eq_B", "B1"])
@pytest.mark.parametrize("name", MODELS)
def test_moe_matches_loop_float64(name, b, t):
    """Every parameter: the routers' weights, the experts' 3-D tensors (experts no token chose
    get zeros), the shared expert and its gate (Qwen2-MoE), attention, norms, embeddings."""
    torch.manual_seed(0)
    check(float64_internals(MODELS[name]()).double().eval(), b, t, rtol=1e-10)


@pytest.mark.parametrize("name", MODELS)
def test_moe_as_shipped(name):
    """The models as transformers ships them (float32 routing and norms inside a float64 model):
    to 1e-6, the float32 rounding the batch gradient itself differs from the loop's by."""
    torch.manual_seed(0)
    check(MODELS[name]().double().eval(), 3, 6, rtol=1e-6)


def test_two_batches_of_one_signature():
    """The routing changes with the data: every forward of a signature with routed rows is
    tracked, and the second batch's gradients are its own."""
    torch.manual_seed(0)
    model = float64_internals(mixtral()).double().eval()
    for seed in (1, 2):
        check(model, 3, 4, rtol=1e-10, seed=seed)


def test_grouped_mm_experts_are_refused_naming_them():
    """The default experts implementation (torch._grouped_mm, float32 only) reads the 3-D
    parameters in an op gradhooks does not split per sample: the reads raise."""
    torch.manual_seed(0)
    model = mixtral(experts=None).eval()
    gh = attach(model)
    try:
        ids, y = tokens(3, 6)
        token_loss(model(ids), y).backward()
        with pytest.raises(gradhooks.BatchSizeError,
                           match=r"mlp\.experts' \(MixtralExperts\).*merged"):
            gh.per_sample_grads()
    finally:
        gh.detach()


class LinearExperts(nn.Module):
    """Experts as nn.Linear modules (the older Mixtral layout): tokens routed by a Linear
    router's top-k, gathered per expert, summed back with index_add_."""

    def __init__(self, d=8, experts=3, k=2):
        super().__init__()
        self.router, self.k = nn.Linear(d, experts, bias=False), k
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(experts))

    def forward(self, h):  # (B, T, D)
        rows = h.reshape(-1, h.shape[-1])
        weights, chosen = torch.softmax(self.router(rows), -1).topk(self.k, -1)
        out = torch.zeros_like(rows)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            out.index_add_(0, token, expert(rows[token]) * weights[token, slot, None])
        return out.reshape(h.shape)


def test_linear_experts_on_routed_rows_are_refused_in_the_forward():
    """An expert nn.Linear called on the rows routed to it (R of them) has a rule that reads the
    batch from dim 0: it sees another batch size than the batch's and is refused in the
    forward (its rule would need the rows' samples: not done)."""
    model = nn.Sequential(nn.Linear(4, 8), LinearExperts(), nn.Linear(8, 3)).double()
    with gradhooks.attach(model):
        with pytest.raises(gradhooks.BatchSizeError, match="experts"):
            model(torch.randn(3, 6, 4, dtype=torch.float64))


def test_load_balancing_loss_is_refused_unless_allowed():
    """output_router_logits=True adds a load-balancing loss made of two statistics of the whole
    batch (the fraction of tokens per expert, a constant of the batch, times the mean router
    probability over every layer's tokens, joined along the batch dim): per-sample gradients of
    that loss are not each sample's own. Refused at the read (SampleMixingError, naming the
    router); allow_sample_mixing=True accepts each sample's contribution to the batch gradient,
    averaged over the samples, is the batch gradient (a mean-reduced loss)."""
    torch.manual_seed(0)
    model = float64_internals(mixtral()).double().eval()
    inner = model.model
    ids, y = tokens(3, 6)
    for allow in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", gradhooks.FallbackWarning)
            gh = gradhooks.attach(inner, allow_sample_mixing=allow)
        try:
            inner.zero_grad()
            inner(input_ids=ids, labels=y, output_router_logits=True).loss.backward()
            if not allow:
                with pytest.raises(gradhooks.SampleMixingError, match="MixtralTopKRouter"):
                    gh.per_sample_grads()
                continue
            got = gh.per_sample_grads()
            for name, p in inner.named_parameters():
                if name in got:
                    torch.testing.assert_close(got[name].mean(0), p.grad, rtol=1e-9, atol=1e-12)
        finally:
            gh.detach()
