"""The multiply-add floors of norms, book-keeping and two-pass clipping on ResNet-50, ConvNeXt-T,
EfficientNet-B0 and ViT-B/16 (224 x 224), per sample, as ratios to plain training's multiply-adds: what no
implementation of each form can go below at plain training's multiply-add rate.

    python benchmarks/mac_floors.py

Per layer with a weight (convolutions, depthwise ones as ``G`` groups of ``I = k^2``, ``O = 1``;
Linear, over every position of a channels-last input; ViT's attention projections, which run inside
``F.multi_head_attention_forward``, added by their shapes), with ``S`` positions, ``G`` groups,
``I`` / ``O`` in / out features per group: forward ``F = S G I O`` (= the weight gradient
``Bw``; the input gradient ``Bi`` the same, except for the first layer, whose input needs
none), the Gram norm ``S^2 G (I + O)`` (a convolution's ``a a^T`` from its input's pixels
where cheaper: ``G (A + S^2 O)``, ``A`` from :func:`gradhooks.rules.conv.patch_gram_cost`), the
materialised per-sample gradient ``S G I O``.
ViT's attention products ``2 S^2 d`` per block count once in the forward and twice in the
input gradient.

- plain = F + Bi + Bw;
- norms = F + Bi + sum_layers min(S I O, S^2 (I + O)) (the cheaper form per layer);
- two-pass = plain + Bi + norms' part (a second backward without weight gradients: the first
  pass, which forms the norms);
- book-keeping = F + Bi + sum_layers S I O where every per-sample gradient is materialised
  and kept for the clipped sum (memory B x P), or + S^2 (I + O) on each layer whose Gram
  form is the cheaper norm (its clipped sum is then a weight-gradient pass).
"""
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gradhooks.rules.conv import patch_gram_cost  # noqa: E402

import zoo  # noqa: E402  (torchvision beside the CPU torch: tests/zoo_imports.py)


def _layers(model, x):
    """``[(S, G, I, O, A)]`` of the layers with a weight, in forward order (per sample); ``A``
    the multiply-adds of ``a a^T`` per group: a convolution's from its input's pixels where
    cheaper (:func:`gradhooks.rules.conv.patch_gram_cost`), else ``S^2 I``."""
    out = []

    def hook(mod, inp, o):
        if isinstance(mod, torch.nn.Conv2d):
            g, s = mod.groups, o.shape[2] * o.shape[3]
            i = mod.in_channels // g * math.prod(mod.kernel_size)
            out.append((s, g, i, mod.out_channels // g,
                        patch_gram_cost(mod, inp[0].shape) or s * s * i))
        elif isinstance(mod, torch.nn.Linear):
            s = inp[0].numel() // inp[0].shape[-1] // x.shape[0]
            out.append((s, 1, mod.in_features, mod.out_features, s * s * mod.in_features))

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    return out


def floors(name: str):
    tv = zoo.zoo_imports.import_torchvision()
    model = {"resnet50": tv.models.resnet50, "vit-b16": tv.models.vit_b_16,
             "convnext-t": tv.models.convnext_tiny,
             "efficientnet-b0": tv.models.efficientnet_b0}[name]().eval()
    layers = _layers(model, torch.randn(1, 3, 224, 224))
    att = 0
    if name == "vit-b16":  # in_proj (d -> 3d) and out_proj per block; QK^T and AV products
        s, d = 197, 768
        layers += [(s, 1, d, 3 * d, s * s * d), (s, 1, d, d, s * s * d)] * 12
        att = 12 * 2 * s * s * d
    sio = [s * g * i * o for s, g, i, o, _ in layers]
    gram = [g * (aa + s * s * o) for s, g, i, o, aa in layers]
    f = sum(sio) + att
    bi = sum(sio) - sio[0] + 2 * att  # (the attention products' backward: both operands)
    plain = f + bi + sum(sio)
    norm = sum(min(a, b) for a, b in zip(sio, gram))
    return {
        "plain G MACs / sample": plain / 1e9,
        "norms": (f + bi + norm) / plain,
        "two-pass": (plain + bi + norm) / plain,
        "book-keeping, all kept": (f + bi + sum(sio)) / plain,
        "book-keeping, Gram where cheaper": (f + bi + sum(sio) + sum(
            b for a, b in zip(sio, gram) if b < a)) / plain,
        "Gram layers": f"{sum(b < a for a, b in zip(sio, gram))} of {len(sio)}",
    }


def main():
    rows = {m: floors(m) for m in ("resnet50", "convnext-t", "efficientnet-b0", "vit-b16")}
    keys = list(next(iter(rows.values())))
    print("| model | " + " | ".join(keys) + " |")
    print("|---|" + "--:|" * len(keys))
    for m, r in rows.items():
        cells = [f"{v:.2f}" if k.startswith("plain") else v if isinstance(v, str) else f"{v:.3f}x"
                 for k, v in r.items()]
        print(f"| {m} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
