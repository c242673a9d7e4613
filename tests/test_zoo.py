"""The model zoo: models people train, built offline from tiny configs with random weights
(transformers, peft LoRA, timm, torchvision), per-sample gradients, per-sample norms and DP
clipping in float64 against looped autograd (1e-10 relative to the largest entry).

Default position ids, T5's relative-position buckets and BART's positions are shared calls,
decided by provenance (gradhooks/core/analysis/provenance.py); ViT's and ConvNeXt's raw parameters are priced at
their own ops; Swin's parent reads its child Linears' weights with F.linear, and the parent's
torch.func replay covers them.
Needs the ``zoo`` extra (also in ``test``): a missing library fails the test.
"""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.rules.fallback import FallbackRule

import zoo_imports
from conftest import RTOL, loop_grads

torchvision = zoo_imports.import_torchvision()
TokensToLogits = zoo_imports.TokensToLogits
V, H, T, B = 64, 32, 8, 2  # vocab, hidden size, tokens, batch


def token_loss(out, y):
    """Cross entropy summed over each sample's tokens (or its one label), mean over samples."""
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="sum") / out.shape[0]


def transformers_lib():
    import transformers
    return transformers


def bert(batched_positions=False):
    tr = transformers_lib()
    cfg = tr.BertConfig(vocab_size=V, hidden_size=H, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=2 * H, max_position_embeddings=T, num_labels=3)
    return TokensToLogits(tr.BertForSequenceClassification(cfg), batched_positions), "label"


def gpt2(batched_positions=False):
    tr = transformers_lib()
    cfg = tr.GPT2Config(vocab_size=V, n_embd=H, n_layer=2, n_head=4, n_positions=T,
                        bos_token_id=0, eos_token_id=0)
    return TokensToLogits(tr.GPT2LMHeadModel(cfg), batched_positions), "tokens"


def t5():
    tr = transformers_lib()
    cfg = tr.T5Config(vocab_size=V, d_model=H, d_kv=8, d_ff=2 * H, num_layers=2, num_heads=4,
                      decoder_start_token_id=0)
    return TokensToLogits(tr.T5ForConditionalGeneration(cfg), decoder=True), "tokens"


def opt():
    """OPT flattens its hidden states to (B * T, D) rows before each block's LayerNorm and
    feed-forward: provenance keeps the samples as the rows' outer factor, and the records of
    those layers are laid out (B, T, D)."""
    tr = transformers_lib()
    cfg = tr.OPTConfig(vocab_size=V, hidden_size=H, num_hidden_layers=2, ffn_dim=2 * H,
                       num_attention_heads=4, max_position_embeddings=T + 2, word_embed_proj_dim=H,
                       dropout=0.0)
    return TokensToLogits(tr.OPTForCausalLM(cfg)), "tokens"


def fsmt():
    """FSMT (fairseq's translation Transformer) computes in (T, B, D) inside a batch-first
    model and runs its attention over (B * heads, T, d): its Linear and LayerNorm calls see the
    batch on dim 1, which provenance follows (with T == B the declared layout would read the
    positions as samples)."""
    tr = transformers_lib()
    cfg = tr.FSMTConfig(langs=["en", "de"], src_vocab_size=V, tgt_vocab_size=V, d_model=H,
                        encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=2 * H, decoder_ffn_dim=2 * H,
                        max_position_embeddings=T + 4, dropout=0.0, attention_dropout=0.0,
                        activation_dropout=0.0)
    model = TokensToLogits(tr.FSMTForConditionalGeneration(cfg), decoder=True)
    positions = model.eval()(torch.ones(1, T, dtype=torch.long)).shape[1]
    if positions != T:  # (use_cache=False instead breaks later versions' FSMT in float64)
        pytest.skip(f"transformers {tr.__version__}'s FSMT in eval mode, its cache on, returns "
                    f"{positions} of {T} positions' logits (5.17 does, on the GPU image)")
    return model, "tokens"


def bart():
    """BART's learned positions: an Embedding subclass whose forward makes the position ids from
    the input's shape, (B, T) after an expand, the same for every sample."""
    tr = transformers_lib()
    cfg = tr.BartConfig(vocab_size=V, d_model=H, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=2 * H,
                        decoder_ffn_dim=2 * H, max_position_embeddings=T, pad_token_id=0,
                        bos_token_id=0, eos_token_id=0, decoder_start_token_id=0)
    return TokensToLogits(tr.BartForConditionalGeneration(cfg), decoder=True), "tokens"


def distilbert():
    tr = transformers_lib()
    cfg = tr.DistilBertConfig(vocab_size=V, dim=H, n_layers=2, n_heads=4, hidden_dim=2 * H,
                              max_position_embeddings=T, num_labels=3)
    return TokensToLogits(tr.DistilBertForSequenceClassification(cfg)), "label"


def roberta():
    """RoBERTa makes its position ids from the input ids (a cumulative sum of the non-pad mask):
    the position lookup computes from the batch."""
    tr = transformers_lib()
    cfg = tr.RobertaConfig(vocab_size=V, hidden_size=H, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=2 * H, max_position_embeddings=T + 2, num_labels=3,
                           pad_token_id=0)
    return TokensToLogits(tr.RobertaForSequenceClassification(cfg)), "label"


def deberta_v2():
    """DeBERTa-v2's disentangled attention over 2 layers: its encoder reads
    ``rel_embeddings.weight`` outside the embedding's forward (replayed by the fallback) and
    returns a ``ModelOutput`` whose ``hidden_states`` hold layer 0's output, which layer 1 uses
    too; log-bucketed relative positions, c2p and p2c."""
    tr = transformers_lib()
    cfg = tr.DebertaV2Config(vocab_size=V, hidden_size=H, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=2 * H, num_labels=3, relative_attention=True,
                             pos_att_type=["c2p", "p2c"], max_relative_positions=8,
                             position_buckets=4, hidden_dropout_prob=0.0,
                             attention_probs_dropout_prob=0.0)
    return TokensToLogits(tr.DebertaV2ForSequenceClassification(cfg)), "label"


def qwen2():
    tr = transformers_lib()
    cfg = tr.Qwen2Config(vocab_size=V, hidden_size=H, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=2 * H, max_position_embeddings=T)
    return TokensToLogits(tr.Qwen2ForCausalLM(cfg)), "tokens"


def whisper():
    """Whisper: log-mel features (B, 8, 16) into the encoder (its sinusoidal positions are a
    frozen Embedding), decoder tokens made from sizes (the same for every sample: a shared
    call of the token embedding), a 3-class head on the last position's logits."""
    tr = transformers_lib()
    cfg = tr.WhisperConfig(vocab_size=V, d_model=H, encoder_layers=1, decoder_layers=1,
                           encoder_attention_heads=4, decoder_attention_heads=4,
                           encoder_ffn_dim=2 * H, decoder_ffn_dim=2 * H, num_mel_bins=8,
                           max_source_positions=8, max_target_positions=T, pad_token_id=0,
                           bos_token_id=0, eos_token_id=0, decoder_start_token_id=0)

    class Speech(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = tr.WhisperForConditionalGeneration(cfg)

        def forward(self, mel):
            ids = torch.arange(4, device=mel.device).expand(mel.shape[0], 4)
            return self.model(input_features=mel, decoder_input_ids=ids).logits[:, -1, :3]
    return Speech(), "mel"


def hf_vit():
    tr = transformers_lib()
    cfg = tr.ViTConfig(image_size=32, patch_size=8, hidden_size=H, num_hidden_layers=2,
                       num_attention_heads=4, intermediate_size=2 * H, num_labels=5)

    class Images(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = tr.ViTForImageClassification(cfg)

        def forward(self, x):
            return self.model(pixel_values=x).logits
    return Images(), "image"


def llama():
    tr = transformers_lib()
    cfg = tr.LlamaConfig(vocab_size=V, hidden_size=H, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=2 * H, max_position_embeddings=T,
                         bos_token_id=0, eos_token_id=0)
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # grouped-query attention
    return TokensToLogits(tr.LlamaForCausalLM(cfg)), "tokens"


def xlnet():
    """XLNet: transposes its ids to (T, B) before the embedding and computes in (T, B, D); its
    relative attention (raw q/k/v/o/r weights in einsums) is replayed per sample by the
    fallback on the batch dim provenance followed (dim 1)."""
    tr = transformers_lib()
    cfg = tr.XLNetConfig(vocab_size=V, d_model=H, n_layer=2, n_head=4, d_inner=2 * H,
                         dropout=0.0, num_labels=3)
    return TokensToLogits(tr.XLNetForSequenceClassification(cfg)), "label"


def beit():
    """BEiT: a relative-position-bias module called with no tensor input, whose output meets
    the batch in the attention scores (a shared call at its own ops)."""
    tr = transformers_lib()
    cfg = tr.BeitConfig(image_size=32, patch_size=8, hidden_size=H, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=2 * H, num_labels=5,
                        use_relative_position_bias=True)
    return ImageLogits(tr.BeitForImageClassification(cfg)), "image"


def hf_swin():
    """transformers' Swin: windows (B * nW, N, C) and a relative-position-bias table."""
    tr = transformers_lib()
    cfg = tr.SwinConfig(image_size=32, patch_size=2, embed_dim=16, depths=[2, 2],
                        num_heads=[2, 2], window_size=4, num_labels=5)
    return ImageLogits(tr.SwinForImageClassification(cfg)), "image"


def timm_swin():
    """timm's Swin (swin_tiny_patch4_window7_224's architecture at 32x32, shifted windows)."""
    from timm.models.swin_transformer import SwinTransformer
    return SwinTransformer(img_size=32, patch_size=2, embed_dim=16, depths=(2, 2),
                           num_heads=(2, 2), window_size=4, num_classes=5), "image"


ImageLogits = zoo_imports.ImageLogits


def longformer():
    """Longformer's sliding-window attention (as_strided chunks of (B * H, T, d) rows, laid
    out (T, B * H, d)) and its global attention on the first token (elements picked by
    (sample, position) pairs, put back by index; a narrow to the batch's largest count of
    global tokens, checked by running samples alone); its softmax is float32 inside."""
    tr = transformers_lib()
    cfg = tr.LongformerConfig(vocab_size=V, hidden_size=H, num_hidden_layers=2,
                              num_attention_heads=4, intermediate_size=2 * H, attention_window=4,
                              max_position_embeddings=T + 8, num_labels=3, pad_token_id=0)
    return TokensToLogits(tr.LongformerForSequenceClassification(cfg)), "label"


def moe(kind):
    """Sparse mixture of experts (4 experts, top-2) over the (B*T, d) token rows; the experts'
    eager loop (the grouped matmul refuses doubles). The routers' softmax and the RMSNorms run
    in float32 inside the float64 model."""
    def build():
        tr = transformers_lib()
        common = dict(vocab_size=V, hidden_size=H, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2,
                      max_position_embeddings=T, experts_implementation="eager")
        if kind == "mixtral":
            return TokensToLogits(tr.MixtralForCausalLM(tr.MixtralConfig(num_local_experts=4,
                                                                          **common))), "tokens"
        cfg = tr.Qwen2MoeConfig(moe_intermediate_size=24, shared_expert_intermediate_size=32,
                                num_experts=4, **common)
        return TokensToLogits(tr.Qwen2MoeForCausalLM(cfg)), "tokens"
    return build


def gemma():
    """Gemma: ``(1 + weight)`` RMSNorms and a scaled embedding, computed in float32 inside."""
    tr = transformers_lib()
    cfg = tr.GemmaConfig(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         max_position_embeddings=T)
    return TokensToLogits(tr.GemmaForCausalLM(cfg)), "tokens"


def mamba():
    """Mamba: the selective scan and its norms in float32 inside (use_cache=False: a call with
    a cache is generation, refused)."""
    tr = transformers_lib()
    cfg = tr.MambaConfig(vocab_size=V, hidden_size=H, state_size=8, num_hidden_layers=2,
                         expand=2, conv_kernel=4, use_cache=False)
    return TokensToLogits(tr.MambaForCausalLM(cfg)), "tokens"


def lora(make, targets):
    def build():
        import peft
        model, kind = make()
        cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0,
                              fan_in_fan_out=targets == ["c_attn"])
        model.model = peft.get_peft_model(model.model, cfg)
        with torch.no_grad():  # lora_B starts at 0: make the LoRA path (and its gradients) non-trivial
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1)
        return model, kind
    return build


def wav2vec2():
    """Wav2Vec2's positional conv embedding is a weight_norm-parametrized grouped Conv1d."""
    tr = transformers_lib()
    cfg = tr.Wav2Vec2Config(hidden_size=H, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=2 * H, conv_dim=(8, 8), conv_stride=(4, 4),
                            conv_kernel=(8, 4), num_conv_pos_embeddings=4,
                            num_conv_pos_embedding_groups=2, mask_time_prob=0.0,
                            feat_extract_norm="layer", do_stable_layer_norm=True)

    class Audio(nn.Module):
        def __init__(self):
            super().__init__()
            self.model, self.head = tr.Wav2Vec2Model(cfg), nn.Linear(H, 3)

        def forward(self, x):
            return self.head(self.model(x).last_hidden_state.mean(1))
    return Audio(), "audio"


def timm_model(name, **kwargs):
    def build():
        import timm
        return timm.create_model(name, num_classes=5, **kwargs), "image"
    return build


def timm_mixer():
    from timm.models.mlp_mixer import MlpMixer
    return MlpMixer(num_classes=5, img_size=32, patch_size=8, num_blocks=2, embed_dim=H), "image"


def vision(build):
    def make():
        return build(torchvision.models), "image"
    return make


def tv_convnext(m):
    from torchvision.models.convnext import CNBlockConfig
    return m.ConvNeXt([CNBlockConfig(16, 32, 1), CNBlockConfig(32, None, 1)], num_classes=5)


def tv_swin(m):
    return m.SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                             window_size=[4, 4], num_classes=5)


# Modules with parameters but no rule (their class names), per model; every other module with
# parameters must have a rule. The raw parameters of containers are priced at their own ops
# (gradhooks.core.analysis.provenance), the others replayed by the torch.func fallback.
FALLBACK = {
    "timm-vit-tiny-layerscale": {"VisionTransformer"},  # cls_token, pos_embed
    "timm-convnext-atto": {"ConvNeXtBlock"},  # gamma, applied by the block itself
    "tv-convnext": {"CNBlock"},  # layer_scale
    "tv-swin": {"ShiftedWindowAttention"},  # relative_position_bias_table
    "hf-vit": {"ViTEmbeddings"},  # cls_token, position_embeddings
    "tv-vit": {"VisionTransformer", "Encoder"},  # class_token; pos_embedding
    # An Embedding subclass with its own forward (positions made from the input's shape, a
    # shared call): the fallback replays it, a single lookup. (BART's scaled token embedding
    # is recognised: ScaledEmbeddingRule.)
    "bart": {"BartLearnedPositionalEmbedding"},
    "opt": {"OPTLearnedPositionalEmbedding"},  # (an Embedding subclass with its own forward)
    "fsmt": {"SinusoidalPositionalEmbedding"},  # (the same)
    "whisper": {"WhisperPositionalEmbedding"},  # (its decoder's: an Embedding subclass)
    # The relative attention's raw weights meet the batch in einsums; the model's mask_emb is
    # never read without a permutation mask (no gradient, as in autograd).
    "xlnet": {"XLNetRelativeAttention", "XLNetModel"},
    # Containers without a rule whose raw parameters are taken at their own ops (provenance):
    # BEiT's layer scales (BeitLayer), class token (BeitEmbeddings) and the bias table of a
    # module called with no input; Swin's bias tables (on the windows, (B * nW, N, C)).
    "beit": {"BeitLayer", "BeitEmbeddings", "BeitRelativePositionBias"},
    "hf-swin": {"SwinRelativePositionBias"},
    "timm-swin": {"WindowAttention"},
    # The routers' raw (E, D) weights and the experts' raw 3-D weights, read with F.linear on
    # the routed token rows: taken at those ops, each row's sample followed (core/analysis/rows.py).
    "mixtral": {"MixtralTopKRouter", "MixtralExperts"},
    "qwen2-moe": {"Qwen2MoeTopKRouter", "Qwen2MoeExperts"},
}

# id: (builder, marks)
ZOO = {
    "bert": (bert, None),
    "bert-batched-positions": (lambda: bert(True), None),
    "gpt2": (gpt2, None),
    "gpt2-batched-positions": (lambda: gpt2(True), None),
    "t5": (t5, None),
    "bart": (bart, None),
    "llama-gqa": (llama, None),
    "llama-gqa-lora": (lora(llama, ["q_proj", "v_proj"]), None),
    "gpt2-lora-conv1d-batched-positions": (lora(lambda: gpt2(True), ["c_attn"]), None),
    "wav2vec2-weight-norm-conv": (wav2vec2, None),
    "timm-vit-tiny-layerscale": (timm_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2,
                                            init_values=0.1), None),
    "timm-convnext-atto": (timm_model("convnext_atto"), None),
    "timm-efficientnet-b0-eval": (timm_model("efficientnet_b0"), None),
    "timm-resnet18-eval": (timm_model("resnet18"), None),
    "timm-mixer": (timm_mixer, None),
    "tv-resnet18-groupnorm": (vision(lambda m: m.resnet18(num_classes=5, norm_layer=lambda c: nn.GroupNorm(2, c))), None),
    "tv-convnext": (vision(tv_convnext), None),
    "tv-mobilenet-v3-small-eval": (vision(lambda m: m.mobilenet_v3_small(num_classes=5)), None),
    "tv-swin": (vision(tv_swin), None),
    "distilbert": (distilbert, None),
    "opt": (opt, None),
    "fsmt": (fsmt, None),
    "roberta": (roberta, None),
    "deberta-v2": (deberta_v2, None),
    "qwen2": (qwen2, None),
    "bert-lora": (lora(bert, ["query", "value"]), None),
    "whisper": (whisper, None),
    "xlnet": (xlnet, None),
    "beit": (beit, None),
    "hf-swin": (hf_swin, None),
    "timm-swin": (timm_swin, None),
    "hf-vit": (hf_vit, None),
    "tv-vit": (vision(lambda m: m.VisionTransformer(image_size=32, patch_size=8, num_layers=2,
                                                    num_heads=2, hidden_dim=H, mlp_dim=2 * H,
                                                    num_classes=5)), None),
    "tv-efficientnet-b0-eval": (vision(lambda m: m.efficientnet_b0(num_classes=5)), None),
}


def assert_close(ours, ref):
    """As conftest.assert_close_to_loop in float64 (max |diff| <= 1e-10 max |ref| per parameter),
    with a floor for gradients that vanish in exact arithmetic (a key bias before a softmax:
    the loop's own rounding, 1e-22, is all there is): the scale is at least 1e-4 of the model's
    largest entry."""
    assert list(ours) == list(ref), (list(ours), list(ref))
    floor = 1e-4 * max(r.abs().max() for r in ref.values())
    for name in ref:
        assert ours[name].shape == ref[name].shape, name
        scale = max(ref[name].abs().max(), floor)
        diff = (ours[name] - ref[name]).abs().max()
        assert diff <= RTOL[torch.float64] * scale, f"{name}: max diff {diff:.3e} vs scale {scale:.3e}"


def inputs(kind, generator, b=B, t=T):
    if kind == "image":
        return torch.randn(b, 3, 32, 32, dtype=torch.float64, generator=generator), torch.randint(0, 5, (b,), generator=generator)
    if kind == "mel":
        return torch.randn(b, 8, 16, dtype=torch.float64, generator=generator), torch.randint(0, 3, (b,), generator=generator)
    if kind == "audio":
        return torch.randn(b, 400, dtype=torch.float64, generator=generator), torch.randint(0, 3, (b,), generator=generator)
    ids = torch.randint(1, V, (b, t), generator=generator)
    return ids, (torch.randint(0, 3, (b,), generator=generator) if kind == "label" else ids.roll(-1, 1))


@pytest.mark.parametrize("name, build", [pytest.param(name, b, marks=m or (), id=name)
                                         for name, (b, m) in ZOO.items()])
def test_zoo_model_matches_loop(name, build, device):
    """Per-sample gradients, per-sample norms and ghost clipping (after loss.backward()) equal
    the loop's in float64, on each device of ``conftest.DEVICES``. Eval mode: no dropout,
    BatchNorm on running statistics."""
    model, kind = build()
    model = model.double().eval().to(device)
    x, y = (t.to(device) for t in inputs(kind, torch.Generator().manual_seed(1)))
    ref = loop_grads(model, token_loss, x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gradhooks.FallbackWarning)  # (the README lists who gets it)
        gh = gradhooks.attach(model)
    try:
        fallback = {type(layer.module).__name__ for layer in gh.recorder.layers
                    if isinstance(layer.rule, FallbackRule)}
        assert fallback == FALLBACK.get(name, set())
        token_loss(model(x), y).backward()
        norms = gh.per_sample_grad_norms()
        ref_norms = torch.cat([g.reshape(B, -1) for g in ref.values()], 1).norm(dim=1)
        torch.testing.assert_close(norms, ref_norms, rtol=1e-10, atol=0)
        max_norm = ref_norms.min().item() * 1.5  # one sample clipped, one not (B = 2)
        gh.clip_and_accumulate(max_norm)
        factors = (max_norm / ref_norms).clamp(max=1.0)
        want = {n: torch.tensordot(factors, g, 1) / B for n, g in ref.items()}
        got = {n: p.grad for n, p in model.named_parameters() if n in ref}
        got = {n: got[n] for n in want}
        assert_close(got, want)
        assert_close(gh.per_sample_grads(), ref)
    finally:
        gh.detach()


# Models that compute parts in float32 inside a float64 model (norms, Mamba's scan, MoE routers'
# softmax; tests/test_moe.py swaps those for float64 and checks 1e-10): exact to
# float32's precision, with the default attach (its sum check judges those parameters at the
# precision autograd formed their gradients in: gradhooks/core/recorder/totals.py).
FLOAT32_INSIDE = {"gemma": gemma, "mamba": mamba, "mixtral": moe("mixtral"),
                  "qwen2-moe": moe("qwen2-moe"), "longformer": longformer}


@pytest.mark.parametrize("t", [T, B], ids=["T8", "T=B"])
@pytest.mark.parametrize("name", list(FLOAT32_INSIDE))
def test_zoo_float32_inside_matches_loop(name, t):
    """Per-sample gradients and norms against the loop, each gradient within 1e-5 of its largest
    entry (the float32 floor the models compute at); Gemma and Mamba every module by a rule, the
    MoE models' routers and experts at their own ops (FALLBACK)."""
    model, kind = FLOAT32_INSIDE[name]()
    model = model.double().eval()
    x, y = inputs(kind, torch.Generator().manual_seed(1), t=t)
    ref = loop_grads(model, token_loss, x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gradhooks.FallbackWarning)  # (the README lists who gets it)
        gh = gradhooks.attach(model)
    try:
        fallback = {type(layer.module).__name__ for layer in gh.recorder.layers
                    if isinstance(layer.rule, FallbackRule)}
        assert fallback == FALLBACK.get(name, set())
        token_loss(model(x), y).backward()
        ref_norms = torch.cat([g.reshape(B, -1) for g in ref.values()], 1).norm(dim=1)
        torch.testing.assert_close(gh.per_sample_grad_norms(), ref_norms, rtol=1e-5, atol=0)
        ours = gh.per_sample_grads()
    finally:
        gh.detach()
    assert list(ours) == list(ref)
    floor = 1e-4 * max(r.abs().max() for r in ref.values())  # (as assert_close: a key's bias)
    for n in ref:
        diff, scale = (ours[n] - ref[n]).abs().max(), max(ref[n].abs().max(), floor)
        assert diff <= 1e-5 * scale, f"{n}: max diff {diff:.3e} vs scale {scale:.3e}"


@pytest.mark.parametrize("name", ["bert", "gpt2", "t5", "bart", "llama-gqa", "opt", "fsmt",
                                  "xlnet"])
def test_zoo_length_equal_to_batch(name):
    """T == B: position ids (1, T) or (B, T) made from sizes, and T5's (T, T) relative-position
    buckets, have the batch size on their first dim by coincidence; gradhooks follows where
    they came from (gradhooks.core.analysis.provenance), so they stay shared calls and the per-sample
    gradients and norms equal the loop's (a size read as the batch dim would give the
    per-query-position split instead, with the same sum). Two batches of one signature: the
    first is tracked, the second follows its plan (BERT, GPT-2: positions handed to the
    broadcast as B samples, token types an ordinary call on their B rows) or is tracked again
    (T5: the buckets meet the batch after a permute; BART: its decoder's positions (1, T, d) come
    from a call on the (B, T) ids; OPT's (B * T, D) rows and FSMT's (T, B, D) layers: records
    laid out per call)."""
    model, kind = ZOO[name][0]()
    model = model.double().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gradhooks.FallbackWarning)
        gh = gradhooks.attach(model)
    try:
        for seed in (2, 3):
            x, y = inputs(kind, torch.Generator().manual_seed(seed), b=4, t=4)
            ref = loop_grads(model, token_loss, x, y)
            model.zero_grad()
            token_loss(model(x), y).backward()
            ref_norms = torch.cat([g.reshape(4, -1) for g in ref.values()], 1).norm(dim=1)
            torch.testing.assert_close(gh.per_sample_grad_norms(), ref_norms, rtol=1e-10, atol=0)
            assert_close(gh.per_sample_grads(), ref)
        # (the loop's batches of one are a signature of their own)
        plan = gh.recorder.placement.signatures[((((4, 4), torch.int64),), False)]
        # (OPT, FSMT: records laid out per call, relayout: tracked every forward)
        assert plan == {"t5": "mode", "bart": "mode", "llama-gqa": {}, "opt": "mode",
                        "fsmt": "mode", "xlnet": "mode"}.get(name) or (
            name in ("bert", "gpt2") and isinstance(plan, dict) and plan), plan
    finally:
        gh.detach()
