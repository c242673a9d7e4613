"""nn.MultiheadAttention and the nn.Transformer* layers against looped autograd.

Every option of the module (masks of each kind and dtype, need_weights / average_attn_weights
with the weights entering the loss, bias_k/bias_v, zero attention, kdim/vdim, both layouts,
cross-attention) is compared with one forward/backward per sample. Inputs that carry the batch
(query, key, value, key_padding_mask, a 3-D attn_mask with its N*heads rows) are sliced per sample
in the loop; the local loop below does that, since conftest's loop slices one input only.
"""
import pytest
import torch
from torch import nn

import gradhooks

from conftest import assert_close_to_loop, check_against_loop

E, H = 8, 2




class Attn(nn.Module):
    """Calls the MultiheadAttention with the recorded inputs; returns (y, attention weights)."""

    def __init__(self, mha, **call):
        super().__init__()
        self.mha, self.call = mha, call

    def forward(self, query, key, value, key_padding_mask=None, attn_mask=None):
        return self.mha(query, key, value, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                        **self.call)


def attn_loss(outputs, w, reduction, batch_dim, use_y=True):
    """reduce_n w_n * (sum y_n^2 [+ sum 3 * P_n^2]): y and the returned weights both enter."""
    y, p = outputs
    losses = 0.0  # (B,) per-sample losses, then reduced: a split gradhooks can prove (a sum
    # over every element is refused where a fully padded sample's rows get no gradient)
    if use_y:
        shape = [1] * y.dim()
        shape[batch_dim] = -1
        losses = (w.view(shape) * y ** 2).movedim(batch_dim, 0).flatten(1).sum(1)
    if p is not None:
        losses = losses + (w.view(-1, *[1] * (p.dim() - 1)) * 3 * p ** 2).flatten(1).sum(1)
    total = losses.sum()
    return total / w.shape[0] if reduction == "mean" else total


def per_sample_inputs(inputs, n, batch_dims, size=1):
    """Samples n .. n+size-1 of every input (a 3-D attn_mask: its rows n*H .. (n+size)*H - 1)."""
    out = {}
    for name, t in inputs.items():
        if t is None or (name == "attn_mask" and t.dim() == 2):
            out[name] = t
        elif name == "attn_mask":
            out[name] = t[n * H:(n + size) * H]
        else:
            out[name] = t.narrow(batch_dims.get(name, 0), n, size)
    return out


def compare(model, inputs, batch_dims, dtype, use_y=True, batch_first=True):
    """Hooked batch vs one forward/backward per sample, for both loss reductions, on the whole
    batch and on its first sample alone (B = 1); returns the whole batch's per-sample gradients.

    The loop runs once: the gradient of w_n * l_n is what both reductions must give for sample n.
    """
    model = model.to(dtype)
    inputs = {k: (t.to(dtype) if t is not None and t.is_floating_point() else t) for k, t in inputs.items()}
    bd = batch_dims["query"]
    b = inputs["query"].shape[bd]
    w = (torch.rand(b) + 0.5).to(dtype)
    params = dict(model.named_parameters())
    ref = {n: [] for n in params}
    for i in range(b):
        model.zero_grad(set_to_none=True)
        attn_loss(model(**per_sample_inputs(inputs, i, batch_dims)), w[i:i + 1], "sum", bd, use_y).backward()
        for n, p in params.items():
            ref[n].append(p.grad)
    ref = {n: torch.stack(gs) for n, gs in ref.items() if gs[0] is not None}
    model.zero_grad(set_to_none=True)
    for size in sorted({b, 1}, reverse=True):
        for reduction in ("mean", "sum"):
            with gradhooks.attach(model, loss_reduction=reduction, batch_first=batch_first) as gh:
                batch = per_sample_inputs(inputs, 0, batch_dims, size)
                attn_loss(model(**batch), w[:size], reduction, bd, use_y).backward()
                ours = gh.per_sample_grads()
            try:
                assert_close_to_loop(ours, {n: t[:size] for n, t in ref.items()}, dtype)
            except AssertionError as e:
                raise AssertionError(f"B={size}, loss_reduction={reduction!r}: {e}") from None
            if size == b and reduction == "sum":
                result = ours
    return result


def causal(l, s):
    return torch.ones(l, s, dtype=torch.bool).triu(1)


def padding_mask(b, s, kind):
    """(B, S): the last keys padded for every other sample; kind "all-of-one": every key of
    sample 1 (scaled_dot_product_attention then outputs zeros for it, and so must the replay)."""
    m = torch.zeros(b, s, dtype=torch.bool)
    m[::2, s - 2:] = True
    if kind == "all-of-one":
        m[1:2] = True
        return m
    if kind == "float":
        return torch.zeros(b, s).masked_fill(m, float("-inf")) + 0.3 * torch.randn(b, s)
    return m


def mask3d(b, l, s, kind):
    """(B*H, L, S): a different mask per sample and head, key 0 always visible."""
    m = torch.rand(b * H, l, s) < 0.4
    m[..., 0] = False
    return torch.randn(b * H, l, s).masked_fill(m, float("-inf")) if kind == "float" else m


# id: (module kwargs, call kwargs, L, S, cross, masks) -- masks: which to pass and their kind;
# cross: "self" (x, x, x), "kv" (x, m, m), "qkv" (x, m, m2), "qv" (x, m, x)
CASES = {
    "self-noweights": ({}, dict(need_weights=False), 5, 5, "self", {}),
    "self-weights-avg": ({}, dict(need_weights=True), 5, 5, "self", {}),
    "self-weights-per-head": ({}, dict(need_weights=True, average_attn_weights=False), 4, 4, "self", {}),
    "nobias": (dict(bias=False), dict(need_weights=False), 4, 4, "self", {}),
    "bias-kv": (dict(add_bias_kv=True), dict(need_weights=False), 4, 4, "self", {}),
    "bias-kv-weights": (dict(add_bias_kv=True), dict(need_weights=True), 4, 4, "self", {}),
    "zero-attn": (dict(add_zero_attn=True), dict(need_weights=True), 4, 4, "self", {}),
    "bias-kv-zero-attn-kpm": (dict(add_bias_kv=True, add_zero_attn=True), dict(need_weights=False), 4, 6, "kv", {"kpm": "bool"}),
    "kpm-bool": ({}, dict(need_weights=False), 4, 5, "kv", {"kpm": "bool"}),
    "kpm-one-sample-fully-padded": ({}, dict(need_weights=False), 4, 5, "kv", {"kpm": "all-of-one"}),
    "kpm-float-weights": ({}, dict(need_weights=True), 4, 5, "kv", {"kpm": "float"}),
    "mask2d-bool": ({}, dict(need_weights=False), 4, 4, "self", {"mask": "causal"}),
    "mask2d-float-weights": ({}, dict(need_weights=True), 3, 5, "kv", {"mask": "float2d"}),
    "mask3d-bool": ({}, dict(need_weights=False), 4, 5, "kv", {"mask": "bool3d"}),
    "mask3d-float-weights": ({}, dict(need_weights=True, average_attn_weights=False), 4, 5, "kv", {"mask": "float3d"}),
    "mask3d-kpm": (dict(add_zero_attn=True), dict(need_weights=False), 4, 5, "kv", {"mask": "float3d", "kpm": "float"}),
    "causal-sdpa": ({}, dict(need_weights=False, is_causal=True), 5, 5, "self", {"mask": "causal"}),
    "causal-weights": ({}, dict(need_weights=True, is_causal=True), 5, 5, "self", {"mask": "causal"}),
    "causal-kpm": ({}, dict(need_weights=False, is_causal=True), 5, 5, "self", {"mask": "causal", "kpm": "bool"}),
    "causal-hint-overrides-mask": ({}, dict(need_weights=False, is_causal=True), 4, 4, "self", {"mask": "float2d"}),
    "causal-bias-kv": (dict(add_bias_kv=True), dict(need_weights=False, is_causal=True), 4, 4, "self", {"mask": "causal"}),
    "cross-k-ne-v": ({}, dict(need_weights=True), 3, 6, "qkv", {}),
    "query-is-value": ({}, dict(need_weights=False), 4, 4, "qv", {}),
    "kdim-vdim": (dict(kdim=5, vdim=3), dict(need_weights=True), 4, 6, "qkv", {"kpm": "bool"}),
    "kdim-vdim-nobias-bias-kv": (dict(kdim=5, vdim=3, bias=False, add_bias_kv=True), dict(need_weights=False), 3, 4, "qkv", {}),
}


def build(case, batch, batch_first):
    kw, call, l, s, cross, masks = case
    mha = nn.MultiheadAttention(E, H, batch_first=batch_first, **kw)
    kdim, vdim = mha.kdim, mha.vdim

    def seq(length, dim):
        return torch.randn(batch, length, dim) if batch_first else torch.randn(length, batch, dim)

    x = seq(l, E)
    if cross == "self":
        k = v = x
    elif cross == "kv":
        k = v = seq(s, E)
    elif cross == "qv":
        k, v = seq(s, E), x
    else:
        k, v = seq(s, kdim), seq(s, vdim)
    inputs = dict(query=x, key=k, value=v, key_padding_mask=None, attn_mask=None)
    if "kpm" in masks:
        inputs["key_padding_mask"] = padding_mask(batch, s, masks["kpm"])
    mask = masks.get("mask")
    if mask == "causal":
        inputs["attn_mask"] = causal(l, s)
    elif mask == "float2d":
        inputs["attn_mask"] = torch.randn(l, s)
    elif mask is not None:
        inputs["attn_mask"] = mask3d(batch, l, s, "float" if mask.startswith("float") else "bool")
    bd = 0 if batch_first else 1
    return Attn(mha, **call), inputs, {"query": bd, "key": bd, "value": bd, "key_padding_mask": 0}


@pytest.mark.parametrize("batch_first", [True, False], ids=["bfirst", "seqfirst"])
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_mha_matches_loop(case, batch_first, dtype):
    model, inputs, bds = build(case, 3, batch_first)
    compare(model, inputs, bds, dtype, batch_first=batch_first)


@pytest.mark.parametrize("average", [True, False], ids=["avg", "per-head"])
@pytest.mark.parametrize("bias_kv", [False, True], ids=["plain", "bias-kv"])
def test_loss_on_attention_weights_only(bias_kv, average, dtype):
    """Only the returned weights enter the loss: out_proj and the value path get no gradient,
    so they are left out (as in the loop, where their .grad stays None)."""
    mha = nn.MultiheadAttention(E, H, batch_first=True, add_bias_kv=bias_kv)
    x = torch.randn(3, 4, E)
    inputs = dict(query=x, key=x, value=x)
    model = Attn(mha, need_weights=True, average_attn_weights=average)
    ours = compare(model, inputs, {"query": 0, "key": 0, "value": 0}, dtype, use_y=False)
    assert "mha.out_proj.weight" not in ours and "mha.bias_v" not in ours
    assert ("mha.bias_k" in ours) == bias_kv
    assert ours["mha.in_proj_weight"][:, 2 * E:].abs().max() == 0  # value rows


def test_kdim_vdim_weights_only_leaves_out_value_projection():
    mha = nn.MultiheadAttention(E, H, batch_first=True, kdim=5, vdim=3)
    inputs = dict(query=torch.randn(2, 3, E), key=torch.randn(2, 4, 5), value=torch.randn(2, 4, 3))
    ours = compare(Attn(mha, need_weights=True), inputs, {"query": 0, "key": 0, "value": 0},
                   torch.float64, use_y=False)
    assert set(ours) == {"mha.q_proj_weight", "mha.k_proj_weight", "mha.in_proj_bias"}


def test_frozen_projections_out_proj_only(dtype):
    """Only out_proj trainable: no replay through autograd is needed, results still exact."""
    model, inputs, bds = build(CASES["bias-kv-weights"], 3, True)
    for name, p in model.mha.named_parameters():
        p.requires_grad_(name.startswith("out_proj"))
    ours = compare(model, inputs, bds, dtype)
    assert list(ours) == ["mha.out_proj.weight", "mha.out_proj.bias"]


def test_module_batch_first_decides_layout_not_attach_flag(loss_reduction, dtype):
    """A seq-first MHA inside a batch-first model (transposes around it): the module's own
    batch_first is what the rule reads."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(3, E)
            self.mha = nn.MultiheadAttention(E, H, batch_first=False)
            self.out = nn.Linear(E, 2)

        def forward(self, x):
            h = self.inp(x).transpose(0, 1)
            return self.out(self.mha(h, h, h, need_weights=False)[0].transpose(0, 1))

    check_against_loop(Model(), torch.randn(3, 4, 3), torch.rand(3) + 0.5,
                       loss_reduction=loss_reduction, dtype=dtype)


def test_dropout_in_eval_mode_matches_loop(dtype):
    mha = nn.MultiheadAttention(E, H, dropout=0.5, batch_first=True).eval()
    model, inputs, bds = build(CASES["kpm-bool"], 3, True)
    model.mha = mha
    compare(model, inputs, bds, dtype)


def test_repeated_calls_are_summed(dtype):
    """One MHA called twice (self- then cross-attention) in one forward."""

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(E, H, batch_first=True, add_bias_kv=True)

        def forward(self, x):
            h = self.mha(x, x, x, need_weights=False)[0]
            return self.mha(h, x, x)[0]

    check_against_loop(Twice(), torch.randn(3, 4, E), torch.rand(3) + 0.5, loss_reduction="mean",
                       dtype=dtype)


# ----------------------------------------------------------------------------- Transformer layers
# LayerNorm: covered by the torch.func fallback (with a FallbackWarning) until rules/norm.py has its rule
TRANSFORMER = pytest.mark.filterwarnings("ignore::gradhooks.FallbackWarning")


class EncoderLayer(nn.Module):
    """nn.TransformerEncoderLayer and a head (sum(LN(h)^2) alone hardly depends on h)."""

    def __init__(self, batch_first, norm_first):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=12, dropout=0.0,
                                                batch_first=batch_first, norm_first=norm_first)
        self.head = nn.Linear(E, 3)

    def forward(self, query):
        return self.head(self.layer(query)), None


@TRANSFORMER
@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["bfirst", "seqfirst"])
def test_encoder_layer_matches_loop(batch_first, norm_first, dtype):
    x = torch.randn(3, 5, E) if batch_first else torch.randn(5, 3, E)
    compare(EncoderLayer(batch_first, norm_first), dict(query=x), {"query": 0 if batch_first else 1},
            dtype, batch_first=batch_first)


class Encoder(nn.Module):
    """A 2-layer nn.TransformerEncoder called with a causal mask and a key padding mask."""

    def __init__(self, batch_first):
        super().__init__()
        layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=12, dropout=0.1,
                                           batch_first=batch_first, activation="gelu")
        self.enc = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()
        self.head = nn.Linear(E, 3)

    def forward(self, query, key=None, value=None, key_padding_mask=None, attn_mask=None):
        return self.head(self.enc(query, mask=attn_mask, src_key_padding_mask=key_padding_mask,
                                  is_causal=True)), None


@TRANSFORMER
@pytest.mark.parametrize("batch_first", [True, False], ids=["bfirst", "seqfirst"])
def test_encoder_stack_with_masks_matches_loop(batch_first, dtype):
    b, t = 3, 5
    x = torch.randn(b, t, E) if batch_first else torch.randn(t, b, E)
    inputs = dict(query=x, key_padding_mask=padding_mask(b, t, "float"),
                  attn_mask=nn.Transformer.generate_square_subsequent_mask(t))
    bd = 0 if batch_first else 1
    compare(Encoder(batch_first), inputs, {"query": bd, "key_padding_mask": 0}, dtype,
            batch_first=batch_first)


class Decoder(nn.Module):
    def __init__(self, batch_first, norm_first):
        super().__init__()
        self.dec = nn.TransformerDecoderLayer(E, H, dim_feedforward=12, dropout=0.0,
                                              batch_first=batch_first, norm_first=norm_first)
        self.head = nn.Linear(E, 3)

    def forward(self, query, key=None, value=None, key_padding_mask=None, attn_mask=None):
        return self.head(self.dec(query, key, tgt_mask=attn_mask, tgt_is_causal=True,
                                  memory_key_padding_mask=key_padding_mask)), None


@TRANSFORMER
@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["bfirst", "seqfirst"])
def test_decoder_layer_matches_loop(batch_first, norm_first, dtype):
    t, s, batch = 4, 6, 3
    shape = (lambda length: (batch, length, E)) if batch_first else (lambda length: (length, batch, E))
    inputs = dict(query=torch.randn(shape(t)), key=torch.randn(shape(s)),
                  key_padding_mask=padding_mask(batch, s, "bool"),
                  attn_mask=nn.Transformer.generate_square_subsequent_mask(t))
    bd = 0 if batch_first else 1
    compare(Decoder(batch_first, norm_first), inputs, {"query": bd, "key": bd, "key_padding_mask": 0},
            dtype, batch_first=batch_first)


# ----------------------------------------------------------------------------- autocast
@TRANSFORMER
def test_autocast_bf16_computes_in_float32():
    """Under CPU bf16 autocast the rule computes in float32 and returns float32 results, close to
    the float32 loop within bfloat16 rounding of the forward."""
    model, inputs, bds = build(CASES["bias-kv-weights"], 3, True)
    w = torch.rand(3) + 0.5
    params = dict(model.named_parameters())
    ref = {n: [] for n in params}
    for i in range(3):
        model.zero_grad(set_to_none=True)
        attn_loss(model(**per_sample_inputs(inputs, i, bds)), w[i:i + 1], "sum", 0).backward()
        for n, p in params.items():
            ref[n].append(p.grad)
    model.zero_grad(set_to_none=True)
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, p = model(**inputs)
        assert y.dtype == torch.bfloat16
        attn_loss((y.float(), p.float()), w, "sum", 0).backward()
        ours = gh.per_sample_grads()
    for n, gs in ref.items():
        r = torch.stack(gs)
        assert ours[n].dtype == torch.float32
        assert (ours[n] - r).abs().max() <= 5e-2 * r.abs().max(), n


# ----------------------------------------------------------------------------- errors
def test_dropout_in_training_mode_is_refused():
    mha = nn.MultiheadAttention(E, H, dropout=0.1, batch_first=True)
    x = torch.randn(2, 3, E)
    with gradhooks.attach(mha):
        with pytest.raises(gradhooks.UnsupportedCallError, match=r"'<root>'.*dropout=0.1.*eval\(\)"):
            mha(x, x, x)


@TRANSFORMER
def test_transformer_dropout_in_training_mode_is_refused():
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=12, dropout=0.1, batch_first=True)
    with gradhooks.attach(layer):
        with pytest.raises(gradhooks.UnsupportedCallError, match=r"'self_attn'.*dropout"):
            layer(torch.randn(2, 3, E))


@pytest.mark.parametrize("batch_first", [True, False], ids=["bfirst", "seqfirst"])
def test_unbatched_query_is_refused(batch_first):
    mha = nn.MultiheadAttention(E, H, batch_first=batch_first)
    x = torch.randn(3, E)
    with gradhooks.attach(mha):
        with pytest.raises(gradhooks.BatchSizeError, match=r"unbatched query \(3, 8\).*unsqueeze"):
            mha(x, x, x)


def test_out_proj_used_outside_the_module_fails_the_sum_check():
    """out_proj is claimed by the MHA rule (not hooked itself): calling it directly as well,
    in the loss after the forward (where provenance does not look), gives its parameters
    gradient the rule does not see, which the sum check refuses."""
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    x = torch.randn(2, 3, E)
    with gradhooks.attach(mha) as gh:
        (mha(x, x, x)[0] + mha.out_proj(x)).pow(2).sum().backward()
        with pytest.raises(gradhooks.GradientMismatchError, match="out_proj"):
            gh.per_sample_grads()


@pytest.mark.parametrize("batch", [1, 4])
def test_out_proj_called_in_the_forward_after_the_attention_is_exact(batch, dtype):
    """The same call inside the model's forward, after the attention's: provenance sees
    out_proj's parameters read outside the MHA call that owns them and hands the MHA to its
    parent's replay, this forward's MHA record included (no double count)."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(E, H, batch_first=True)

        def forward(self, x):
            return self.mha(x, x, x)[0] + self.mha.out_proj(x)

    torch.manual_seed(0)
    with pytest.warns(gradhooks.FallbackWarning, match=r"'mha'.*read outside its forward"):
        check_against_loop(Model(), torch.randn(batch, 3, E), torch.rand(batch) + 0.5,
                           loss_reduction="sum", dtype=dtype)


@pytest.mark.parametrize("batch", [1, 3], ids=["B1", "B3"])
def test_attention_core_gradients_taken_from_the_graph(batch, dtype):
    """need_weights=False: the rule takes the gradients w.r.t. q, k, v from the
    scaled_dot_product_attention node instead of replaying the call; two backward passes
    through one forward (retain_graph) sum, as in the loop."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, batch_first=True).to(dtype)
    x = torch.randn(batch, 5, E, dtype=dtype)

    def losses(xb):
        y = mha(xb, xb, xb, need_weights=False)[0]
        return y.square().sum(), y.sin().sum()

    ref = {n: torch.zeros(batch, *p.shape, dtype=dtype) for n, p in mha.named_parameters()}
    for i in range(batch):
        l1, l2 = losses(x[i:i + 1])
        for (n, _), g in zip(mha.named_parameters(), torch.autograd.grad(l1 + l2, list(mha.parameters()))):
            ref[n][i] = g
    with gradhooks.attach(mha, loss_reduction="sum") as gh:
        l1, l2 = losses(x)
        l1.backward(retain_graph=True)
        l2.backward()
        cap = gh.recorder.records[0]
        assert cap.a.internal is not None and cap.a.internal.get("grad_inputs") is not None
        ours = gh.per_sample_grads()
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    for n, r in ref.items():
        assert (ours[n] - r).abs().max() <= tol * r.abs().max(), n
