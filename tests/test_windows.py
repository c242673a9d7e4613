"""Windowed attention that merges the batch with its windows (issue 30): timm's Swin Transformer
partitions ``(B, H, W, C)`` into windows ``(B * nW, N, C)`` whose count is not a size of the
input. Provenance follows the batch through the merge as the merged dim's outer factor (as
OPT's ``(B * T, D)`` rows): the Linear layers on windows get their records unflattened to
``(B, nW * N, C)``, a shared tensor (a relative position bias, a shift mask added to it)
meeting the windows is split per sample with each sample's windows summed (broadcast) or its
own rows kept (row-aligned), and the attention module that owns the bias table (no rule) is not
replayed: its table is priced at its own ops. Per-sample gradients and norms against a loop of
batches of one, float64, B = 3, B = 1 and B equal to a stage's window count."""
import pytest
import torch
from torch import nn

import gradhooks

import zoo_imports  # noqa: F401  (torchvision importable before timm)
from conftest import check_model


def timm_swin(fused: bool):
    """timm's SwinTransformer (swin_tiny_patch4_window7_224's architecture) at 32x32: patches
    of 2, windows of 4: 16 windows in the first stage, 4 in the second; two blocks per stage,
    the second with shifted windows (the shift mask added to the bias)."""
    from timm.models.swin_transformer import SwinTransformer
    model = SwinTransformer(img_size=32, patch_size=2, embed_dim=16, depths=(2, 2),
                            num_heads=(2, 2), window_size=4, num_classes=5)
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = fused  # (scaled_dot_product_attention with the bias as its mask)
    return model


def images(b, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, 3, 32, 32, dtype=torch.float64, generator=g),
            torch.randint(0, 5, (b,), generator=g))


@pytest.mark.parametrize("b", [3, 1, 4], ids=["B3", "B1", "B_eq_windows"])
@pytest.mark.parametrize("fused", [True, False], ids=["sdpa", "explicit"])
def test_timm_swin(b, fused):
    torch.manual_seed(0)
    model = timm_swin(fused).double().eval()
    check_model(model, *images(b))


def test_timm_swin_two_batches_of_one_signature():
    """Merged windows make the signature tracked on every forward: the second batch's
    gradients are its own."""
    torch.manual_seed(0)
    model = timm_swin(True).double().eval()
    for seed in (1, 2):
        check_model(model, *images(3, seed))


def partition(x, w):
    """``(B, H, W, C) -> (B * nW, w * w, C)`` windows, as Swin makes them."""
    b, h, wd, c = x.shape
    x = x.view(b, h // w, w, wd // w, w, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, w * w, c)


def reverse(x, w, b, h, wd):
    c = x.shape[-1]
    x = x.view(b, h // w, wd // w, w, w, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(b, h, wd, c)


class WindowBias(nn.Module):
    """No input: a learned ``(N, C)`` bias, expanded to ``rows`` windows when given (a
    row-aligned meeting with the windows), else ``(1, N, C)`` (a broadcast over them)."""

    def __init__(self, n, c):
        super().__init__()
        self.table = nn.Parameter(torch.randn(n, c) * 0.1)

    def forward(self, rows=None):
        t = self.table.unsqueeze(0)
        return t if rows is None else t.expand(rows, -1, -1)


class WindowBlock(nn.Module):
    """Linear layers on windows, a raw parameter of the block (a container) broadcast over them,
    and two no-input biases: one broadcast, one expanded to the windows' rows."""

    def __init__(self, c=4, w=2):
        super().__init__()
        self.w = w
        self.lin = nn.Linear(c, c)
        self.gain = nn.Parameter(torch.ones(1, 1, c) + 0.1 * torch.randn(1, 1, c))
        self.bias, self.rows_bias = WindowBias(w * w, c), WindowBias(w * w, c)

    def forward(self, x):  # (B, H, W, C)
        b, h, wd, _ = x.shape
        win = partition(x, self.w)
        win = torch.tanh(self.lin(win) * self.gain + self.bias()) + self.rows_bias(win.shape[0])
        return reverse(win, self.w, b, h, wd)


class WindowNet(nn.Module):
    def __init__(self, c=4):
        super().__init__()
        self.embed, self.block, self.head = nn.Linear(3, c), WindowBlock(c), nn.Linear(c, 3)

    def forward(self, x):  # (B, H, W, 3)
        return self.head(self.block(self.embed(x)).mean((1, 2)))


@pytest.mark.parametrize("b", [3, 1, 4], ids=["B3", "B1", "B_eq_windows"])
def test_windows_with_raw_and_shared_parameters(b, dtype):
    """4x4 images in 2x2 windows: 4 windows per sample (B = 4 equals it)."""
    torch.manual_seed(0)
    model = WindowNet().to(dtype)
    x, y = torch.randn(b, 4, 4, 3, dtype=dtype), torch.randint(0, 3, (b,))
    check_model(model, x, y, dtype=dtype)


class Scale(nn.Module):
    """A leaf module without a rule: its parameter is replayed by the torch.func fallback."""

    def __init__(self, c):
        super().__init__()
        self.s = nn.Parameter(torch.ones(c))

    def forward(self, x):
        return x * self.s


def test_leaf_module_without_a_rule_on_windows_is_refused():
    """The fallback replays a module per sample as a batch of one; on windows of a merged batch
    it cannot take one sample's rows: the read raises, naming the module, instead of a wrong
    or missing gradient."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.scale, self.head = nn.Linear(3, 4), Scale(4), nn.Linear(4, 3)

        def forward(self, x):
            b, h, wd, _ = x.shape
            win = self.scale(partition(self.embed(x), 2))
            return self.head(reverse(win, 2, b, h, wd).mean((1, 2)))

    model = Net().double()
    with pytest.warns(gradhooks.FallbackWarning), gradhooks.attach(model) as gh:
        model(torch.randn(3, 4, 4, 3, dtype=torch.float64)).sum().backward()
        with pytest.raises(gradhooks.BatchSizeError, match=r"'scale' \(Scale\).*merged"):
            gh.per_sample_grads()
