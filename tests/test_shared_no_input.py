"""Shared calls with no input (issue 30): a module without a rule whose output comes only from
its own parameters (called with no tensor, or with a window size), which then meets the batch.
BEiT's and HF Swin's relative position bias tables, a learned query, prompt tokens. The
module's own parameters become sources of their own (as raw parameters are,
gradhooks.core.analysis.provenance): each one's per-sample gradient is pulled back from where the
module's output meets the batch, through the module's own ops. Per-sample gradients and norms
against a loop of batches of one, float64 (and float32 for the toys), B = 3, B = 1 and the
tokens' count equal to B."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks

import zoo_imports  # noqa: F401  (torchvision importable before transformers)
from conftest import check_model


def image_loss(out, y):
    return F.cross_entropy(out, y)


ImageLogits = zoo_imports.ImageLogits


def beit(shared_bias=False, image_size=32):
    import transformers
    cfg = transformers.BeitConfig(image_size=image_size, patch_size=8, hidden_size=32,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, num_labels=5,
                                  use_relative_position_bias=not shared_bias,
                                  use_shared_relative_position_bias=shared_bias)
    return ImageLogits(transformers.BeitForImageClassification(cfg))


def hf_swin():
    import transformers
    cfg = transformers.SwinConfig(image_size=32, patch_size=2, embed_dim=16, depths=[2, 2],
                                  num_heads=[2, 2], window_size=4, num_labels=5)
    return ImageLogits(transformers.SwinForImageClassification(cfg))


def images(b, size=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, 3, size, size, dtype=torch.float64, generator=g),
            torch.randint(0, 5, (b,), generator=g))


@pytest.mark.parametrize("b", [3, 1], ids=["B3", "B1"])
@pytest.mark.parametrize("shared_bias", [False, True], ids=["per-layer-bias", "shared-bias"])
def test_beit_relative_position_bias(b, shared_bias):
    """BeitRelativePositionBias is called on a window size (no tensor) and its (heads, N, N)
    output is added to the attention scores: exact, at the cost of its own ops (index,
    interpolate, permute); one module called by every layer (shared bias) sums its parts."""
    torch.manual_seed(0)
    model = beit(shared_bias).double().eval()
    check_model(model, *images(b))


def test_beit_tokens_equal_to_batch():
    """16x16 images in 8x8 patches: 4 patches and the class token, N = 5 tokens, B = 5."""
    torch.manual_seed(1)
    model = beit(image_size=16).double().eval()
    check_model(model, *images(5, size=16))


@pytest.mark.parametrize("b", [3, 4], ids=["B3", "B4"])
def test_hf_swin_relative_position_bias(b):
    """SwinRelativePositionBias (no input) meets the windows (B * nW, heads, N, N) of a batch
    merged with its windows (tests/test_windows.py); shifted windows in the second block of
    each stage; B = 4 is the second stage's window count."""
    torch.manual_seed(0)
    model = hf_swin().double().eval()
    check_model(model, *images(b))


class Queries(nn.Module):
    """A learned query as a module: ``forward()`` returns its parameter (Q, D) scaled."""

    def __init__(self, q, d):
        super().__init__()
        self.q = nn.Parameter(torch.randn(q, d))

    def forward(self):
        return self.q * 0.5


class Prompt(nn.Module):
    """Prompt tokens made from the batch size: ``forward(b) -> (b, P, D)``."""

    def __init__(self, p, d):
        super().__init__()
        self.p = nn.Parameter(torch.randn(p, d))

    def forward(self, b):
        return self.p.unsqueeze(0).expand(b, -1, -1)


class Pooler(nn.Module):
    """Tokens ``(B, T, D)``, prompt tokens concatenated before them, then attention pooling by
    learned queries (a matmul that broadcasts the queries over the batch)."""

    def __init__(self, d=6, q=2, p=3, classes=3):
        super().__init__()
        self.embed = nn.Linear(4, d)
        self.prompt, self.queries = Prompt(p, d), Queries(q, d)
        self.head = nn.Linear(q * d, classes)

    def forward(self, x):
        h = torch.cat([self.prompt(x.shape[0]), self.embed(x)], dim=1)  # (B, P + T, D)
        att = torch.softmax(self.queries() @ h.transpose(1, 2), -1)  # (B, Q, P + T)
        return self.head((att @ h).flatten(1))


@pytest.mark.parametrize("b, t", [(3, 5), (1, 4), (2, 2)], ids=["B3", "B1", "T_eq_B"])
def test_learned_queries_and_prompt_tokens(b, t, dtype):
    """A module returning its (scaled) parameter, called with no input, meets the batch in a
    broadcasting matmul; prompt tokens expanded to the batch size meet it row by row in a
    cat. Q == B too (T_eq_B: 2 queries, 2 samples, 2 tokens)."""
    torch.manual_seed(0)
    model = Pooler().to(dtype)
    x, y = torch.randn(b, t, 4, dtype=dtype), torch.randint(0, 3, (b,))
    check_model(model, x, y, loss=F.cross_entropy, dtype=dtype)


class ParamOut(nn.Module):
    """A module whose forward returns its parameter itself."""

    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d))

    def forward(self):
        return self.w


def test_module_returning_its_parameter_over_two_forwards(dtype):
    """The output is the parameter: its own source; the second forward of the signature is
    tracked again (parameters of shared calls: no plan) and gives its own batch's gradients."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.scale = nn.Linear(3, 3), ParamOut(3)

        def forward(self, x):
            return self.lin(x) * self.scale()

    torch.manual_seed(0)
    model = Model().to(dtype)
    loss = lambda out, y: ((out - y) ** 2).sum() / out.shape[0]
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(4, 3, dtype=dtype, generator=g), torch.randn(4, 3, dtype=dtype,
                                                                         generator=g)
        check_model(model, x, y, loss=loss, dtype=dtype)


def test_refused_where_the_output_meets_the_batch_in_an_op_that_is_not_split():
    """A no-input module's output that meets the batch in an op gradhooks does not split per
    sample (tensordot) is refused at the read, naming the module and the op."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.queries = nn.Linear(3, 3), Queries(2, 3)

        def forward(self, x):
            return torch.tensordot(self.lin(x), self.queries(), dims=([1], [1]))

    model = Model().double()
    x = torch.randn(4, 3, dtype=torch.float64)
    with pytest.warns(gradhooks.FallbackWarning, match="queries"), gradhooks.attach(model) as gh:
        model(x).sum().backward()
        with pytest.raises(gradhooks.BatchSizeError, match="queries.*tensordot"):
            gh.per_sample_grads()
