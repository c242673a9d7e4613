"""Parameters a parent reads outside their module's forward: held in an ``nn.ParameterDict`` /
``nn.ParameterList`` (peft's IA3, VeRA, LoKr and LoRA-on-Embedding adapters; LoKr's weight
computed from them, ``kron(w1, w2)``, meets the batch as F.linear's weight), returned by a
child's method other than ``forward`` (timm's MaxViT / CoAtNet ``self.rel_pos.get_bias()``), or
the weights of layers in a ``ModuleDict`` read by another module (peft's DoRA on a Conv).
Exact against the loop where the parameter meets the batch in an op gradhooks splits per
sample; refused, with ``check`` on and off, where it does not (they were silently missing from
the results with ``check=False``)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks

from conftest import (
    assert_close_to_loop,
    check_against_loop,
    check_against_loop_or_empty,
    loop_grads,
)


class IA3(nn.Module):
    """A frozen Linear whose output a trainable vector scales, held in a ParameterDict (or a
    ParameterList)."""

    def __init__(self, d_in, d_out, holder):
        super().__init__()
        self.base = nn.Linear(d_in, d_out).requires_grad_(False)
        v = nn.Parameter(1 + 0.3 * torch.randn(d_out))
        self.holder = holder
        self.scale = nn.ParameterDict({"default": v}) if holder == "dict" else nn.ParameterList([v])

    def forward(self, x):
        return self.base(x) * self.scale["default" if self.holder == "dict" else 0]


@pytest.mark.parametrize("holder", ["dict", "list"])
@pytest.mark.parametrize("batch", [0, 1, 3])
def test_parameters_in_a_holder_meeting_the_batch_are_exact(holder, batch, dtype):
    model = nn.Sequential(IA3(4, 6, holder), nn.Tanh(), IA3(6, 3, holder))
    x, w = torch.randn(batch, 5, 4), torch.rand(batch) + 0.5
    if batch:
        check_against_loop(model, x, w, loss_reduction="mean", dtype=dtype)
        return
    model = model.to(dtype)
    with gradhooks.attach(model) as gh:
        model(x.to(dtype)).square().sum().backward()
        got = gh.per_sample_grads()
    assert {n: t.shape for n, t in got.items()} == {
        n: (0, *p.shape) for n, p in model.named_parameters() if p.requires_grad}


class KronAdapter(nn.Module):
    """peft's LoKr pattern: a frozen Linear plus ``F.linear(x, kron(w1, w2))``, the factors
    held in ParameterDicts (``w1`` itself a low-rank product with ``factored``), and a bias
    computed from a raw parameter too (``bias``): a weight computed from raw parameters alone
    meets the batch as F.linear's weight."""

    def __init__(self, d_in, d_out, factored=False, bias=False):
        super().__init__()
        self.base = nn.Linear(d_in, d_out).requires_grad_(False)
        self.factored, self.bias = factored, bias
        if factored:
            self.w1_a = nn.ParameterDict({"default": nn.Parameter(torch.randn(2, 3))})
            self.w1_b = nn.ParameterDict({"default": nn.Parameter(torch.randn(3, 2))})
        else:
            self.w1 = nn.ParameterDict({"default": nn.Parameter(torch.randn(2, 2))})
        self.w2 = nn.ParameterDict({"default": nn.Parameter(torch.randn(d_out // 2, d_in // 2))})
        if bias:
            self.b = nn.ParameterList([nn.Parameter(torch.randn(d_out // 2))])

    def forward(self, x):
        w1 = (self.w1_a["default"] @ self.w1_b["default"] if self.factored
              else self.w1["default"])
        delta = torch.kron(w1, self.w2["default"]).reshape(self.base.weight.shape) * 0.5
        bias = self.b[0].repeat(2) if self.bias else None
        return self.base(x) + F.linear(x, delta, bias)


@pytest.mark.parametrize("form", ["kron", "factored", "with_bias"])
@pytest.mark.parametrize("shape, batch_first", [((4,), True), ((5, 4), True), ((5, 4), False)],
                         ids=["2d", "3d", "3d_seq_first"])
@pytest.mark.parametrize("batch", [0, 1, 3])
def test_a_weight_computed_from_raw_parameters_is_exact(form, shape, batch_first, batch, dtype):
    torch.manual_seed(0)
    model = nn.Sequential(KronAdapter(4, 6, form == "factored", form == "with_bias"), nn.Tanh(),
                          KronAdapter(6, 2, form == "factored", form == "with_bias"))
    size = (batch, *shape) if batch_first else (shape[0], batch, shape[1])
    x, w = torch.randn(size), torch.rand(batch) + 0.5
    if batch:
        ours = check_against_loop(model, x, w, loss_reduction="sum", dtype=dtype,
                                  batch_first=batch_first)
        assert set(ours) == {n for n, p in model.named_parameters() if p.requires_grad}
        return
    model = model.to(dtype)
    with gradhooks.attach(model, loss_reduction="sum", batch_first=batch_first) as gh:
        model(x.to(dtype)).sum().backward()
        got = gh.per_sample_grads()
    assert {n: t.shape for n, t in got.items()} == {
        n: (0, *p.shape) for n, p in model.named_parameters() if p.requires_grad}


class EmbeddingAdapter(nn.Module):
    """LoRA on an Embedding as peft writes it: the adapter's A read by F.embedding from a
    ParameterDict (an op gradhooks does not split per sample for a raw weight)."""

    def __init__(self):
        super().__init__()
        self.base = nn.Embedding(11, 4).requires_grad_(False)
        self.a = nn.ParameterDict({"default": nn.Parameter(torch.randn(11, 2))})
        self.b = nn.Linear(2, 4, bias=False)
        self.head = nn.Linear(4, 3)

    def forward(self, ids):
        return self.head((self.base(ids) + self.b(F.embedding(ids, self.a["default"]))).mean(1))


class RelPosBias(nn.Module):
    def __init__(self, t):
        super().__init__()
        self.table = nn.Parameter(0.1 * torch.randn(t, t))

    def get_bias(self):
        return self.table.unsqueeze(0)

    def forward(self, scores):
        return scores + self.get_bias()


class Attention(nn.Module):
    """timm's MaxViT pattern: the parent calls ``self.rel_pos.get_bias()``, never its forward."""

    def __init__(self, t=5, d=4):
        super().__init__()
        self.qkv, self.rel_pos, self.head = nn.Linear(d, 3 * d), RelPosBias(t), nn.Linear(d, 3)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.rel_pos.get_bias())
        return self.head(o.mean(1))


class Magnitude(nn.Module):
    """peft's DoRA pattern: a module on the fallback whose forward reads the weights of two
    layers held in ModuleDicts (containers, never called) and uses them functionally."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(d))

    def forward(self, x, lora_a, lora_b):
        return F.linear(x, lora_b.weight @ lora_a.weight) * self.weight


class DoraLike(nn.Module):
    def __init__(self, d=4):
        super().__init__()
        self.base = nn.Linear(d, d).requires_grad_(False)
        self.lora_a = nn.ModuleDict({"default": nn.Linear(d, 2, bias=False)})
        self.lora_b = nn.ModuleDict({"default": nn.Linear(2, d, bias=False)})
        self.magnitude, self.head = Magnitude(d), nn.Linear(d, 3)

    def forward(self, x):
        h = self.base(x) + self.magnitude(x, self.lora_a["default"], self.lora_b["default"])
        return self.head(torch.tanh(h))


def _only_the_adapter():  # (all else frozen: the refused meeting is the only trainable use)
    model = EmbeddingAdapter()
    for m in (model.b, model.head):
        m.requires_grad_(False)
    return model


CASES = {
    "embedding_adapter": (EmbeddingAdapter, lambda: torch.randint(0, 11, (3, 5)), "'a'"),
    # (nothing recorded: the refusal names the op, not "no backward pass")
    "only_the_adapter": (_only_the_adapter, lambda: torch.randint(0, 11, (3, 5)),
                         "'a' (ParameterDict) has raw parameters"),
    "child_method": (Attention, lambda: torch.randn(3, 5, 4), "'rel_pos'"),
    "container_child": (DoraLike, lambda: torch.randn(3, 4), "lora_"),
}


@pytest.mark.filterwarnings("ignore::gradhooks.FallbackWarning")
@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_a_parameter_read_where_it_cannot_be_split_is_refused(case, check):
    make, data, named = CASES[case]
    model, x = make(), data()
    with gradhooks.attach(model, check=check) as gh:
        model(x).square().sum().backward()
        for read in (gh.per_sample_grads, gh.per_sample_grad_norms):
            with pytest.raises(gradhooks.GradHooksError) as info:
                read()
            assert named in str(info.value), str(info.value)
            assert not isinstance(info.value, gradhooks.NoBackwardError)


class PositionTable(nn.Embedding):
    """ProphetNet's positional embedding: called on the batch's shape (a shared call, no
    batch input), its weight read again after the call by another method."""

    def forward(self, shape, device):
        ids = torch.cumsum(torch.ones(shape, dtype=torch.long, device=device), 1)
        return super().forward(ids), ids

    def shifted(self, ids):
        return super().forward(ids + 1)


class TwoStreams(nn.Module):
    def __init__(self, d=4):
        super().__init__()
        self.emb, self.pos, self.head = nn.Embedding(11, d), PositionTable(9, d), nn.Linear(d, 3)

    def forward(self, ids):
        h = self.emb(ids)
        p, pos_ids = self.pos(h.shape[:2], h.device)
        return self.head(torch.tanh((h + p) * self.pos.shifted(pos_ids))).mean(1)


@pytest.mark.filterwarnings("ignore::gradhooks.FallbackWarning")
@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("b", [1, 4], ids=["B1", "B4"])
def test_a_shared_call_s_parameters_read_again_after_it_are_exact(b, check, dtype):
    """Its parameters are sources already (the shared call's own): the read after the call
    carries them to where they meet the batch, and each sample's part is pulled back there,
    with or without the sum check (check=False returned 0.8 relative error before)."""
    torch.manual_seed(0)
    model = TwoStreams().to(dtype)
    ids, y = torch.randint(0, 11, (b, 5)), torch.randint(0, 3, (b,))
    ref = loop_grads(model, lambda out, t: F.cross_entropy(out, t, reduction="sum"), ids, y)
    with gradhooks.attach(model, loss_reduction="sum", check=check) as gh:
        for _ in range(2):  # (the tracked first forward, and the planned second)
            model.zero_grad()
            F.cross_entropy(model(ids), y, reduction="sum").backward()
            assert_close_to_loop(gh.per_sample_grads(), ref, dtype)


class Scale(nn.Module):  # (no rule: on the fallback)
    def __init__(self, d=4):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(d))

    def forward(self, x):
        return x * self.weight


class ReadAfter(nn.Module):
    def __init__(self, d=4):
        super().__init__()
        self.scale, self.head = Scale(d), nn.Linear(d, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.scale(x)) * self.scale.weight)


@pytest.mark.parametrize("check", [True, False])
def test_a_fallback_layer_s_parameters_read_after_its_call_are_refused_naming_the_line(check):
    """A batched call's parameters read after it returned, by its parent: the replay of the
    call does not see that use, so every read is refused with the module and the line (with
    check=False the result was silently wrong before)."""
    model, x = ReadAfter(), torch.randn(3, 4)
    with gradhooks.attach(model, check=check) as gh:
        model(x).square().sum().backward()
        for read in (gh.per_sample_grads, gh.per_sample_grad_norms):
            with pytest.raises(gradhooks.BatchSizeError,
                               match=r"'scale' \(Scale\).*read outside its forward "
                                     r"\(test_setup_holders.py:\d+ in forward\)"):
                read()


class TiedAfter(nn.Module):
    """A layer's weight read again after its call, in the same forward (a tied projection)."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.enc(x)) @ self.enc.weight.T


@pytest.mark.parametrize("b", [0, 1, 4], ids=["B0", "B1", "B4"])
def test_a_layer_s_weight_read_after_its_call_is_covered_by_the_parent_s_replay(b, dtype):
    """Provenance sees the read outside the call (after it) and hands the layer to its
    parent's replay from this forward on, this forward's own record of the layer dropped (it
    would count the call twice); before, only the sum check refused it."""
    torch.manual_seed(0)
    with pytest.warns(gradhooks.FallbackWarning, match=r"'enc' \(Linear\).*read outside"):
        check_against_loop_or_empty(TiedAfter(), torch.randn(b, 4), torch.rand(b) + 0.5,
                                    loss_reduction="mean", dtype=dtype)
