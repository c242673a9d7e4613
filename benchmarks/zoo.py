"""Speed on the model zoo: plain training against per-sample gradients and DP clipping.

Per model (tiny-width configs of the zoo test at realistic batch and sequence sizes: B = 16,
T = 64 tokens or 32x32 images, float32, eval mode, random weights, offline), the median time of
one step of:

* ``train``: ``loss.backward()`` (the baseline);
* ``grads``: ``gh.backward(loss)`` + ``gh.per_sample_grads()``;
* ``clip``: ``loss.backward()`` + ``gh.clip_and_accumulate(1.0)`` (ghost clipping after an
  ordinary backward, which also computes the unclipped batch gradient);
* ``book-keeping clip``: ``gh.backward(loss)`` + ``gh.clip_and_accumulate(1.0)`` (Bu et al.
  2023's book-keeping: one backward to the layers' outputs, no batch weight gradient);
* ``vmap``: ``torch.func.vmap(grad(functional_call))`` per-sample gradients, where it runs;
* ``opacus``: Opacus' ``GradSampleModule`` (hooks mode) ``loss.backward()``, where it runs.

Each step includes its forward. Ratios are to ``train``. Run from the repository root::

    python benchmarks/zoo.py [--repeats 15] [--threads 1] [--models llama,gpt2] [--out results/zoo.md]

Every model runs with its library's default call (position ids, T5's relative-position buckets
and BART's positions are shared calls: gradhooks/core/analysis/provenance.py; Swin's attention, whose parent reads
its child Linears' weights, is replayed by the fallback).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import gradhooks  # noqa: E402

import zoo_imports  # noqa: E402  (torchvision in the CPU venv, see tests/zoo_imports.py)

B, T, V, H = 16, 64, 1000, 64


TokensToLogits = zoo_imports.TokensToLogits  # (shared with the tests)


def build(name):
    import timm
    import transformers as tr
    tv = zoo_imports.import_torchvision()
    common = dict(vocab_size=V, hidden_size=H, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=4 * H, max_position_embeddings=T)
    if name == "bert":
        return TokensToLogits(tr.BertForSequenceClassification(tr.BertConfig(num_labels=3, **common))), "label"
    if name == "gpt2":
        cfg = tr.GPT2Config(vocab_size=V, n_embd=H, n_layer=2, n_head=4, n_positions=T)
        return TokensToLogits(tr.GPT2LMHeadModel(cfg)), "tokens"
    if name == "t5":
        cfg = tr.T5Config(vocab_size=V, d_model=H, d_kv=16, d_ff=4 * H, num_layers=2, num_heads=4,
                          decoder_start_token_id=0)
        return TokensToLogits(tr.T5ForConditionalGeneration(cfg), decoder=True), "tokens"
    if name == "bart":
        cfg = tr.BartConfig(vocab_size=V, d_model=H, encoder_layers=2, decoder_layers=2,
                            encoder_attention_heads=4, decoder_attention_heads=4,
                            encoder_ffn_dim=4 * H, decoder_ffn_dim=4 * H, max_position_embeddings=T)
        return TokensToLogits(tr.BartForConditionalGeneration(cfg), decoder=True), "tokens"
    if name == "llama":
        return TokensToLogits(tr.LlamaForCausalLM(tr.LlamaConfig(num_key_value_heads=2, **common))), "tokens"
    if name == "llama-lora":
        import peft
        m = tr.LlamaForCausalLM(tr.LlamaConfig(num_key_value_heads=2, **common))
        return TokensToLogits(peft.get_peft_model(m, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))), "tokens"
    if name == "timm-vit":
        return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=4, depth=4, num_classes=10), "image"
    if name == "timm-convnext-atto":
        return timm.create_model("convnext_atto", num_classes=10), "image"
    if name == "timm-efficientnet-b0":
        return timm.create_model("efficientnet_b0", num_classes=10), "image"
    if name == "timm-resnet18":
        return timm.create_model("resnet18", num_classes=10), "image"
    if name == "tv-resnet18-gn":
        return tv.models.resnet18(num_classes=10, norm_layer=lambda c: nn.GroupNorm(8, c)), "image"
    if name == "tv-swin":
        return tv.models.SwinTransformer(patch_size=[4, 4], embed_dim=32, depths=[2, 2],
                                         num_heads=[2, 4], window_size=[4, 4], num_classes=10), "image"
    if name == "tv-mobilenet-v3-small":
        return tv.models.mobilenet_v3_small(num_classes=10), "image"
    if name == "xlnet":
        cfg = tr.XLNetConfig(vocab_size=V, d_model=H, n_layer=2, n_head=4, d_inner=4 * H,
                             num_labels=3, dropout=0.0)
        return TokensToLogits(tr.XLNetForSequenceClassification(cfg)), "label"
    if name == "gemma":
        return TokensToLogits(tr.GemmaForCausalLM(tr.GemmaConfig(
            num_key_value_heads=2, head_dim=16, **common))), "tokens"
    if name == "mamba":
        cfg = tr.MambaConfig(vocab_size=V, hidden_size=H, state_size=8, num_hidden_layers=2,
                             use_cache=False)
        return TokensToLogits(tr.MambaForCausalLM(cfg)), "tokens"
    if name == "mixtral":
        return TokensToLogits(tr.MixtralForCausalLM(tr.MixtralConfig(
            num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
            **common))), "tokens"  # (transformers' default experts: grouped_mm)
    if name in ("beit", "hf-swin"):
        cfg = (tr.BeitConfig(image_size=32, patch_size=4, hidden_size=H, num_hidden_layers=2,
                             num_attention_heads=4, intermediate_size=4 * H, num_labels=10,
                             use_relative_position_bias=True) if name == "beit" else
               tr.SwinConfig(image_size=32, patch_size=2, embed_dim=32, depths=[2, 2],
                             num_heads=[2, 4], window_size=4, num_labels=10))
        model = (tr.BeitForImageClassification if name == "beit"
                 else tr.SwinForImageClassification)(cfg)
        return ImageLogits(model), "image"
    if name == "timm-swin":
        from timm.models.swin_transformer import SwinTransformer
        return SwinTransformer(img_size=32, patch_size=2, embed_dim=32, depths=(2, 2),
                               num_heads=(2, 4), window_size=4, num_classes=10), "image"
    raise KeyError(name)


class ImageLogits(nn.Module):
    """transformers' image classifiers return an output object: its logits."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(pixel_values=x).logits


MODELS = ["bert", "gpt2", "t5", "bart", "llama", "llama-lora", "timm-vit", "timm-convnext-atto",
          "timm-efficientnet-b0", "timm-resnet18", "tv-resnet18-gn", "tv-mobilenet-v3-small",
          "tv-swin", "xlnet", "gemma", "mamba", "mixtral", "beit", "hf-swin", "timm-swin"]


def data(kind):
    g = torch.Generator().manual_seed(0)
    if kind == "image":
        return torch.randn(B, 3, 32, 32, generator=g), torch.randint(0, 10, (B,), generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    return ids, torch.randint(0, 3, (B,), generator=g) if kind == "label" else ids


def loss_fn(out, y):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="sum") / out.shape[0]


def median_time(step, repeats):
    for _ in range(2):
        step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(name, repeats, peers=True):
    model, kind = build(name)
    model = model.eval()
    x, y = data(kind)
    params = [p for p in model.parameters() if p.requires_grad]
    res = {}

    def train():
        for p in params:
            p.grad = None
        loss_fn(model(x), y).backward()
    res["train"] = median_time(train, repeats)

    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        gh = gradhooks.attach(model)
    # the modules whose parameters the torch.func fallback replays (raw parameters of
    # containers that provenance splits per sample are not replayed)
    gh.backward(loss_fn(model(x), y))
    res["fallback"] = sorted({type(c.layer.module).__name__ for c in gh.recorder.records
                              if type(c.layer.rule).__name__ == "FallbackRule" and c.names
                              and getattr(c.a, "shared", None) != "param"})
    gh.per_sample_grads()

    def grads():
        gh.backward(loss_fn(model(x), y))
        gh.per_sample_grads()
    res["grads"] = median_time(grads, repeats)

    def clip():
        for p in params:
            p.grad = None
        loss_fn(model(x), y).backward()
        gh.clip_and_accumulate(1.0)
    res["clip"] = median_time(clip, repeats)

    def bookkeeping():  # (Bu et al. 2023: one backward to the layers' outputs, then the clip)
        for p in params:
            p.grad = None
        gh.backward(loss_fn(model(x), y))
        gh.clip_and_accumulate(1.0)
    res["bookkeeping"] = median_time(bookkeeping, repeats)
    gh.detach()
    res["train"] = (res["train"] + median_time(train, repeats)) / 2  # (before and after: drift)

    if not peers:
        res["vmap"] = res["opacus"] = "not run"
        return res
    try:
        from torch.func import functional_call, grad, vmap
        named = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
        frozen = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
        buffers = dict(model.named_buffers())

        def one(p, xi, yi):
            return loss_fn(functional_call(model, (p, frozen, buffers), (xi[None],)), yi[None])
        per = vmap(grad(one), in_dims=(None, 0, 0))
        res["vmap"] = median_time(lambda: per(named, x, y), repeats)
    except Exception as e:  # noqa: BLE001 (reported)
        res["vmap"] = f"fails: {type(e).__name__}"
    try:
        from opacus import GradSampleModule
        gsm = GradSampleModule(model, loss_reduction="mean")

        def opacus_step():
            for p in params:
                p.grad = None
                p.grad_sample = None
            loss_fn(gsm(x), y).backward()
        res["opacus"] = median_time(opacus_step, repeats)
        gsm._close()
    except Exception as e:  # noqa: BLE001
        res["opacus"] = f"fails: {type(e).__name__}"
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-peers", action="store_true", help="skip torch.func and Opacus")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    lines = [f"B={B}, T={T} / 32x32, float32, {args.threads} thread(s), medians of {args.repeats}; "
             f"ratios to plain training (train)", "",
             "| model | train ms | grads | clip | book-keeping clip | vmap | opacus | replayed by the fallback |",
             "|---|--:|--:|--:|--:|--:|--:|---|"]
    for name in args.models.split(","):
        r = run(name, args.repeats, peers=not args.no_peers)
        cell = lambda k: (f"{r[k] / r['train']:.2f}x" if isinstance(r[k], float) else r[k])
        line = (f"| {name} | {r['train'] * 1e3:.1f} | {cell('grads')} | {cell('clip')} | "
                f"{cell('bookkeeping')} | {cell('vmap')} | {cell('opacus')} | "
                f"{', '.join(r['fallback']) or '-'} |")
        print(line, flush=True)
        lines.append(line)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
