"""Mixture of experts (issue 30, part 3): transformers' Mixtral and Qwen2-MoE from tiny configs,
with their default call.

Their router (``MixtralTopKRouter``: a raw ``(E, D)`` weight read with ``F.linear`` on the
``(B * T, D)`` token rows) and experts (``MixtralExperts``: raw ``(E, 2I, D)`` / ``(E, D, I)``
tensors, read per expert as ``F.linear(hidden[token_idx], gate_up_proj[e])`` and summed back
with ``index_add_``) are modules without a rule. Provenance follows each token row's sample
through the routing (``hidden[token_idx]``: rows of the samples ``token_idx // T``,
:class:`gradhooks.core.analysis.batch_dims.Routed`), and each ``F.linear`` whose weight is such a
module's parameter (or an expert's slice of one) forms every sample's gradient from its own
rows there (gradhooks/core/analysis/rows.py), written into the 3-D parameter's slice. The
load-balancing loss (``output_router_logits=True``) mixes the samples and is refused.

Exactness: both models compute in float32 inside a float64 model (the router's softmax,
RMSNorm), so even the batch gradient differs from the loop's mean by about 1e-7 of its size;
the float64 checks swap those two forwards for the same math in the model's dtype
(``float64_internals``), and the models as shipped are checked to 1e-6.

transformers' default experts implementation (``"grouped_mm"``: the ``(B * T * top_k, D)``
token rows sorted by expert, ``hidden[perm // top_k]``, one ``torch._grouped_mm`` over the raw
``(E, I, O)`` weights with the experts' offsets, the rows put back by ``[inv_perm]`` and summed
over the top-k slots) is followed the same way: each sample's gradient of each expert from its
own rows of the grouped product (gradhooks/core/analysis/rows.py, ``grouped_meeting``). torch's grouped
product takes no doubles, so the float64 checks run transformers' own fallback of it (its
``grouped_mm_fallback`` custom op, which it uses where the kernel cannot run), and the kernel
itself is checked in float32.
"""
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks

import zoo_imports  # (also: torchvision importable before transformers)
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


def qwen2_moe(experts="eager"):
    import transformers
    cfg = transformers.Qwen2MoeConfig(vocab_size=V, hidden_size=32, intermediate_size=48,
                                      moe_intermediate_size=24,
                                      shared_expert_intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      num_experts=4, num_experts_per_tok=2,
                                      max_position_embeddings=32, experts_implementation=experts)
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


def check(model, b, t, rtol, seed=0, device="cpu"):
    """Per-sample gradients, norms and book-keeping clipping (``clip_and_accumulate`` after
    ``loss.backward()``, one sample clipped and one not where B > 1) against the loop, each
    parameter to ``rtol`` of its largest entry (with a floor of 1e-4 of the model's largest:
    gradients that vanish in exact arithmetic, key biases)."""
    ids, y = (v.to(device) for v in tokens(b, t, seed))
    model = model.to(device)
    ref = loop_grads(model, token_loss, ids, y)
    norms = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in ref.values()))
    floor = 1e-4 * max(r.abs().max() for r in ref.values())

    def close(got, want):
        assert list(got) == list(want)
        for name, r in want.items():
            scale = max(r.abs().max(), floor)
            diff = (got[name] - r).abs().max()
            assert diff <= rtol * scale, f"{name}: max diff {diff:.3e} vs scale {scale:.3e}"

    gh = attach(model)
    try:
        model.zero_grad(set_to_none=True)
        token_loss(model(ids), y).backward()
        torch.testing.assert_close(gh.per_sample_grad_norms(), norms, rtol=max(rtol, 1e-9),
                                   atol=0)
        per_param = gh.per_sample_grad_norms(per_param=True)
        for name, r in ref.items():  # (each expert's weight: from its factored segments)
            want = r.flatten(1).norm(dim=1)
            torch.testing.assert_close(per_param[name], want, rtol=max(rtol, 1e-9),
                                       atol=rtol * float(norms.max()), msg=name)
        max_norm = float(norms.sort().values[b // 2]) * 1.01
        factors = (max_norm / norms).clamp(max=1.0)
        grads = dict(model.named_parameters())
        clipped = {n: torch.tensordot(factors, g, 1) / b for n, g in ref.items()}
        gh.clip_and_accumulate(max_norm)  # (from the records: the ghost method)
        close({n: grads[n].grad for n in ref}, clipped)
        close(gh.sum_grad_squared(), {n: g.square().sum(0) for n, g in ref.items()})
        model.zero_grad(set_to_none=True)
        token_loss(model(ids), y).backward()
        close(gh.per_sample_grads(), ref)
        gh.clip_and_accumulate(max_norm)  # (from per_sample_grads' result)
        close({n: grads[n].grad for n in ref}, clipped)
    finally:
        gh.detach()


MODELS = {"mixtral": mixtral, "qwen2-moe": qwen2_moe}


@pytest.mark.parametrize("b, t", [(3, 6), (3, 3), (1, 5)], ids=["B3", "T_eq_B", "B1"])
@pytest.mark.parametrize("name", MODELS)
def test_moe_matches_loop_float64(name, b, t, device):
    """Every parameter: the routers' weights, the experts' 3-D tensors (experts no token chose
    get zeros), the shared expert and its gate (Qwen2-MoE), attention, norms, embeddings; on
    each device of ``conftest.DEVICES``."""
    torch.manual_seed(0)
    check(float64_internals(MODELS[name]()).double().eval(), b, t, rtol=1e-10, device=device)


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


@pytest.fixture
def grouped_mm_in_float64(monkeypatch):
    """transformers' grouped experts through its ``grouped_mm_fallback`` custom op (the one it
    runs where torch's kernel cannot: under torch.compile, old torch, unaligned memory), which
    takes doubles as torch's kernel does not."""
    import transformers.integrations.moe as moe
    monkeypatch.setattr(moe, "_can_use_grouped_mm", lambda *args: False)


@pytest.mark.parametrize("b, t", [(3, 6), (3, 3), (1, 5), (3, 1)], ids=["B3", "T_eq_B", "B1", "T1"])
@pytest.mark.parametrize("name", MODELS)
def test_default_grouped_experts_match_loop_float64(name, b, t, grouped_mm_in_float64):
    """The default experts implementation (experts_implementation left unset: "grouped_mm").
    T = 1: the token rows are the (B, D) samples themselves; the routers are replayed per
    sample (their outputs handed on as aliases, so the logits' grad_output is the code after
    the router's alone), the experts' rows still routed."""
    torch.manual_seed(0)
    model = MODELS[name](experts=None)
    assert model.model.config._experts_implementation == "grouped_mm"
    check(float64_internals(model).double().eval(), b, t, rtol=1e-10)


@pytest.mark.parametrize("name", MODELS)
def test_default_grouped_experts_float32_kernel(name, device):
    """torch's grouped kernel as shipped, in float32, at float32's tolerance, on each device of
    ``conftest.DEVICES``; the routing of the batch used is checked to be far from a tie first
    (so rounding cannot change it)."""
    torch.manual_seed(0)
    model = MODELS[name](experts=None).eval().to(device)
    ids, _ = tokens(3, 6)
    assert zoo_imports.routing_margin(model, ids.to(device)) > 1e-5  # (float32 rounds at 1e-7)
    check(model, 3, 6, rtol=2e-4, device=device)


def sentinel_masks(model):
    """Turn on transformers' sentinel-row masks in every experts module (``_is_expert_parallel``:
    the expert-ids compared with the number of experts, clamped in place, the sorted token rows
    ``masked_fill_``-ed before the grouped product and its outputs after it), the path
    transformers 5.17 takes on CUDA for every model: the rows must stay each sample's through
    the masks of sorted ids."""
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    if not experts or not all(hasattr(m, "_is_expert_parallel") for m in experts):
        pytest.skip("this transformers' grouped experts have no switch for the sentinel-row "
                    "masks (5.17 applies them always: the default experts' tests run them)")
    for m in experts:
        m._is_expert_parallel = True
    return model


@pytest.mark.parametrize("b, t", [(3, 6), (1, 5), (3, 1)], ids=["B3", "B1", "T1"])
@pytest.mark.parametrize("name", MODELS)
def test_grouped_experts_sentinel_masks_float64(name, b, t, grouped_mm_in_float64):
    """The default experts with the sentinel-row masks on (the GPU image's path), in float64."""
    torch.manual_seed(0)
    model = sentinel_masks(float64_internals(MODELS[name](experts=None)))
    check(model.double().eval(), b, t, rtol=1e-10)


@pytest.mark.parametrize("name", MODELS)
def test_grouped_experts_sentinel_masks_float32_kernel(name, device):
    """The same through torch's grouped kernel in float32, on each device."""
    torch.manual_seed(0)
    model = sentinel_masks(MODELS[name](experts=None)).eval().to(device)
    ids, _ = tokens(3, 6)
    assert zoo_imports.routing_margin(model, ids.to(device)) > 1e-5
    check(model, 3, 6, rtol=2e-4, device=device)


class MoEBlockModel(nn.Module):
    """Embedding -> transformers' Mixtral sparse MoE block (router + grouped experts) -> Linear:
    the block on its own, so that batch sizes the full decoder does not take (B = 0) run."""

    def __init__(self, experts=None):
        super().__init__()
        import transformers
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
        cfg = transformers.MixtralConfig(hidden_size=8, intermediate_size=12,
                                         num_local_experts=4, num_experts_per_tok=2,
                                         experts_implementation=experts)
        cfg._experts_implementation = experts or "grouped_mm"
        self.embed, self.moe = nn.Embedding(V, 8), MixtralSparseMoeBlock(cfg)
        self.head = nn.Linear(8, V)
        for p in self.moe.parameters():  # (torch.empty outside a PreTrainedModel's init)
            nn.init.normal_(p, std=0.3)

    def forward(self, ids):
        return self.head(self.moe(self.embed(ids)))


@pytest.mark.parametrize("b", [0, 1, 4], ids=["B0", "B1", "B4"])
@pytest.mark.parametrize("masks", [False, True], ids=["no_masks", "sentinel_masks"])
def test_grouped_experts_block_float64(b, masks, grouped_mm_in_float64):
    """The block alone, B = 0 included (every per-sample gradient ``(0, *shape)``); with the
    sentinel-row masks on too."""
    torch.manual_seed(0)
    model = float64_internals(MoEBlockModel()).double()
    if masks:
        sentinel_masks(model)
    if b:
        check(model, b, 5, rtol=1e-10)
        return
    gh = attach(model)
    try:
        ids, y = tokens(0, 5)
        token_loss(model(ids), y).backward()
        got = gh.per_sample_grads()
        assert list(got) == [n for n, _ in model.named_parameters()]
        for name, p in model.named_parameters():
            assert got[name].shape == (0, *p.shape), name
        assert gh.per_sample_grad_norms().shape == (0,)
    finally:
        gh.detach()


def _decoder(name):
    import transformers as tr
    common = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=32)
    if name == "olmoe":
        cfg = tr.OlmoeConfig(intermediate_size=24, num_experts=4, num_experts_per_tok=2, **common)
        return TokensToLogits(tr.OlmoeForCausalLM(cfg))
    if name == "qwen3-moe":
        cfg = tr.Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                                num_experts_per_tok=2, head_dim=8, **common)
        return TokensToLogits(tr.Qwen3MoeForCausalLM(cfg))
    if name == "gpt-oss":
        cfg = tr.GptOssConfig(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                              head_dim=8, **common)
        return TokensToLogits(tr.GptOssForCausalLM(cfg))
    cfg = tr.DeepseekV3Config(intermediate_size=48, moe_intermediate_size=24, n_routed_experts=4,
                              num_experts_per_tok=2, n_group=1, topk_group=1,
                              first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16,
                              qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, **common)
    return TokensToLogits(tr.DeepseekV3ForCausalLM(cfg))


@pytest.mark.parametrize("t", [6, 3, 1], ids=["T6", "T_eq_B", "T1"])
@pytest.mark.parametrize("name", ["olmoe", "qwen3-moe", "deepseek-v3", "gpt-oss"])
def test_other_moe_decoders_as_shipped(name, t, grouped_mm_in_float64):
    """OLMoE, Qwen3-MoE, DeepSeek-V3 (its router flattens the (B, T, D) input to token rows
    itself, a group-limited top-k with a correction bias; a dense first block and a shared
    expert) and GPT-OSS (biased router; experts with (E, I, O) weights and per-expert biases
    added to the routed rows, ``bias[expert_ids]``: gradhooks.core.analysis.rows.gathered_meeting; a
    clamped gate) with their default experts, as shipped (float32 routers inside a float64 model: to
    1e-6, as test_moe_as_shipped)."""
    torch.manual_seed(0)
    check(_decoder(name).double().eval(), 3, t, rtol=1e-6)


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


class ExpertsModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.moe, self.head = nn.Embedding(V, 8), LinearExperts(), nn.Linear(8, V)

    def forward(self, ids):
        return self.head(self.moe(self.embed(ids)))


@pytest.mark.parametrize("b, t", [(3, 6), (3, 3), (1, 5)], ids=["B3", "T_eq_B", "B1"])
def test_linear_experts_on_routed_rows_match_loop(b, t):
    """Experts that are nn.Linear modules called on the rows routed to them (R rows of
    varying samples): their records are laid out per sample (``(B, R_max, D)``, zeros after
    each sample's rows: gradhooks.base.segments.routed_layout), so the Linear rule and every
    reader take them as they take any (B, T, D) call; the router is a Linear on the (B * T, D)
    rows."""
    torch.manual_seed(0)
    check(ExpertsModel().double(), b, t, rtol=1e-10)


@pytest.mark.parametrize("experts", ["grouped", "slices"])
def test_two_backward_passes_add_up(experts, grouped_mm_in_float64):
    """Two backward passes of one forward (``retain_graph``): each expert weight's rows of the
    two passes add up (concatenated segments), per-sample gradients and norms those of the
    summed loss."""
    torch.manual_seed(0)
    model = (float64_internals(MoEBlockModel()) if experts == "grouped"
             else SliceExpertsModel()).double()
    ids, y = tokens(3, 5)

    def loss_fn(out, y):  # (the two passes' losses, summed)
        return token_loss(out, y) + 0.5 * out.square().sum() / out.shape[0]
    ref = loop_grads(model, loss_fn, ids, y)
    gh = attach(model)
    try:
        out = model(ids)
        token_loss(out, y).backward(retain_graph=True)
        (0.5 * out.square().sum() / out.shape[0]).backward()
        norms = gh.per_sample_grad_norms()
        got = gh.per_sample_grads()
    finally:
        gh.detach()
    for name, r in ref.items():
        torch.testing.assert_close(got[name], r, rtol=1e-10, atol=1e-12, msg=name)
    torch.testing.assert_close(norms, torch.cat([r.flatten(1) for r in ref.values()], 1)
                               .norm(dim=1), rtol=1e-10, atol=0)


class SliceExperts(nn.Module):
    """Experts as slices of raw parameters in a loop (custom MoE code, transformers' "eager"
    experts): ``F.linear(rows, self.weight[e], self.bias[e])`` on the rows routed to expert
    ``e``, indexed from the end (``e - E``: negative indices), each row at two positions
    (``(R, 2, D)``) when ``pairs``."""

    def __init__(self, d=8, experts=3, k=2, pairs=False):
        super().__init__()
        self.router, self.k, self.pairs = nn.Linear(d, experts, bias=False), k, pairs
        self.weight = nn.Parameter(torch.randn(experts, d, d) / d ** 0.5)
        self.bias = nn.Parameter(torch.randn(experts, d))

    def forward(self, h):  # (B, T, D)
        rows = h.reshape(-1, h.shape[-1])
        weights, chosen = torch.softmax(self.router(rows), -1).topk(self.k, -1)
        out = torch.zeros_like(rows)
        experts = self.weight.shape[0]
        for e in range(experts):
            token, slot = torch.where(chosen == e)
            x = rows[token]
            if self.pairs:  # (each routed row at two positions: itself and scaled)
                x = x[:, None] * torch.tensor([[1.0], [-0.5]], dtype=x.dtype)
            y = F.linear(x, self.weight[e - experts], self.bias[e])
            y = y.sum(1) if self.pairs else y
            out.index_add_(0, token, y * weights[token, slot, None])
        return out.reshape(h.shape)


class SliceExpertsModel(ExpertsModel):
    def __init__(self, pairs=False):
        super().__init__()
        self.moe = SliceExperts(pairs=pairs)


@pytest.mark.parametrize("pairs", [False, True], ids=["rows", "pairs"])
@pytest.mark.parametrize("b, t", [(3, 6), (3, 3), (1, 5)], ids=["B3", "T_eq_B", "B1"])
def test_slice_experts_in_a_loop_match_loop(b, t, pairs):
    """Each expert's ``weight[e]`` / ``bias[e]`` slice hands the parameter its rows at the key
    (sample, e); the experts' parts add up as rows (gradhooks.base.segments.Segments)."""
    torch.manual_seed(0)
    check(SliceExpertsModel(pairs).double(), b, t, rtol=1e-10)


def test_linear_experts_kfac_is_refused_naming_the_expert():
    """KFAC's A / G average over positions: rows routed to an expert have none per sample."""
    torch.manual_seed(0)
    model = ExpertsModel().double()
    with gradhooks.attach(model) as gh:
        ids, y = tokens(3, 5)
        token_loss(model(ids), y).backward()
        with pytest.raises(gradhooks.GradHooksError, match=r"moe\.experts\.\d.*routed"):
            gh.kfac_factors()
        assert set(gh.kfac_factors(modules=["embed", "head"])) == {"embed", "head"}


def test_linear_experts_empty_batch():
    torch.manual_seed(0)
    model = ExpertsModel().double()
    with gradhooks.attach(model) as gh:
        ids, y = tokens(0, 5)
        token_loss(model(ids), y).backward()
        got = gh.per_sample_grads()
        for name, p in model.named_parameters():
            assert got[name].shape == (0, *p.shape), name


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


def test_batched_mm_experts_are_refused_naming_them():
    """transformers' "batched_mm" experts gather a weight per row from the 3-D parameters and
    bmm them: not split per sample, refused at the read naming the experts."""
    torch.manual_seed(0)
    model = float64_internals(mixtral(experts="batched_mm")).double().eval()
    gh = attach(model)
    try:
        ids, y = tokens(3, 6)
        token_loss(model(ids), y).backward()
        with pytest.raises(gradhooks.BatchSizeError, match=r"mlp\.experts' \(MixtralExperts\)"):
            gh.per_sample_grads()
    finally:
        gh.detach()
