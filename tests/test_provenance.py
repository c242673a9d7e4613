"""Shared calls decided by where tensors came from (gradhooks.core.analysis.provenance), never by their sizes:
layers called on inputs that are the same for every sample (a learned query, a (T, T) bias made
from sizes, an initial state made from the batch size), whose outputs meet the batch by
broadcasting or row by row, against a loop in float64 and float32, at batch sizes 0, 1, several
and equal to the sequence length."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks

from conftest import assert_close_to_loop, loop_grads

D = 5


class SharedBias(nn.Module):
    """A (T, T) relative-position bias from an Embedding of bucket indices made from T, and a
    learned query through a Linear: both shared calls; they meet the batch by broadcasting."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, D)
        self.rel = nn.Embedding(7, 2)  # 2 heads
        self.query = nn.Parameter(torch.randn(D))
        self.q_proj = nn.Linear(D, D)
        self.head = nn.Linear(2 * D, 3)

    def forward(self, x):  # x (B, T, 3)
        t = x.shape[1]
        pos = torch.arange(t)
        buckets = (pos[None, :] - pos[:, None]).clamp(-3, 3) + 3  # (T, T), no batch dim
        bias = self.rel(buckets).permute(2, 0, 1)  # (2, T, T)
        h = torch.tanh(self.inp(x))  # (B, T, D)
        scores = h @ h.transpose(1, 2) / D ** 0.5  # (B, T, T)
        attn = torch.softmax(scores[:, None] + bias, -1)  # (B, 2, T, T): broadcast over B
        mixed = (attn @ h[:, None]).mean(1)  # (B, T, D)
        q = self.q_proj(self.query)  # (D,): shared
        pooled = torch.softmax((mixed @ q[:, None])[..., 0], -1)  # (B, T)
        out = torch.cat([(pooled[..., None] * mixed).sum(1), mixed.mean(1) * q], -1)
        return self.head(out)


class InitialState(nn.Module):
    """A Linear on a zero state of the batch's size, made from sizes: a shared call with B rows
    that meets the batch row by row. ``seq_first``: inputs ``(T, B, 3)`` (torch's sequence
    layout) instead of ``(B, T, 3)``."""

    def __init__(self, seq_first=False):
        super().__init__()
        self.seq_first = seq_first
        self.init = nn.Linear(D, D)
        self.step = nn.Linear(3, D)
        self.head = nn.Linear(D, 3)

    def forward(self, x):  # x (B, T, 3), or (T, B, 3) when seq_first
        steps = x.unbind(0) if self.seq_first else x.unbind(1)
        h = self.init(torch.ones(steps[0].shape[0], D, dtype=x.dtype))  # (B, D), the same for all
        for x_t in steps:
            h = torch.tanh(self.step(x_t) + h)
        return self.head(h)


@pytest.mark.parametrize("batch,length", [(0, 4), (1, 4), (3, 4), (4, 4)],
                         ids=["B0", "B1", "B3", "T_eq_B"])
@pytest.mark.parametrize("make", [SharedBias, InitialState], ids=["broadcast", "rows"])
def test_shared_calls_match_loop(make, batch, length, dtype):
    torch.manual_seed(0)
    model = make().to(dtype)
    x = torch.randn(batch, length, 3, dtype=dtype)
    y = torch.randint(0, 3, (batch,))
    ref = loop_grads(model, F.cross_entropy, x, y) if batch else {
        n: torch.zeros(0, *p.shape, dtype=dtype) for n, p in model.named_parameters()}
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        F.cross_entropy(model(x), y, reduction="sum").backward()
        ours = gh.per_sample_grads()
    if batch:  # (the loop used the mean over one sample, the same as the sum)
        assert_close_to_loop(ours, ref, dtype)
    else:
        assert {n: g.shape for n, g in ours.items()} == {n: g.shape for n, g in ref.items()}


def test_shared_norms_and_clipping_match_loop():
    """Norms and clipping read the same per-sample grad_outputs of the shared calls."""
    torch.manual_seed(0)
    model = SharedBias().double()
    x, y = torch.randn(4, 4, 3, dtype=torch.float64), torch.randint(0, 3, (4,))
    ref = loop_grads(model, F.cross_entropy, x, y)
    norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    with gradhooks.attach(model) as gh:
        F.cross_entropy(model(x), y).backward()
        torch.testing.assert_close(gh.per_sample_grad_norms(), norms, rtol=1e-10, atol=0)
        c = norms.median().item()
        gh.clip_and_accumulate(c)
        factors = (c / norms).clamp(max=1)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, torch.tensordot(factors, ref[n], 1) / 4,
                                       rtol=1e-10, atol=1e-14)


@pytest.mark.filterwarnings("ignore::gradhooks.FallbackWarning")
@pytest.mark.parametrize("make", ["SharedBias", "TinyViT"])
def test_gh_backward_with_shared_calls_matches_loop(make):
    """GradHooks.backward with shared calls and raw parameters: the parameter pass while the
    sum check is due, then the output-edges pass, which asks for the gradients below the
    meeting operands so that their hooks run; exact in both."""
    torch.manual_seed(0)
    model = globals()[make]().double()
    x, y = torch.randn(3, 4, 3, dtype=torch.float64), torch.randint(0, 3, (3,))
    ref = loop_grads(model, F.cross_entropy, x, y)
    states = []
    with gradhooks.attach(model) as gh:
        for _ in range(3):  # (later batches: the signature is known, the sum check passed)
            gh.backward(F.cross_entropy(model(x), y))
            states.append(gh.recorder.sum_check_state)
            assert_close_to_loop(gh.per_sample_grads(), ref, torch.float64)
    assert states[0] == "due" and states[-1] == "skip"  # both passes ran


class Einsum(nn.Module):
    def __init__(self, op="einsum"):
        super().__init__()
        self.op, self.inp, self.q = op, nn.Linear(3, D), nn.Linear(D, D)
        self.query = nn.Parameter(torch.randn(4, D))

    def forward(self, x):  # x (B, T, 3)
        q = self.q(self.query)  # (4, D), shared
        if self.op == "einsum":
            return torch.einsum("qd,btd->bqt", q, self.inp(x)).tanh().sum(2)  # (B, 4)
        return torch.tensordot(self.inp(x), q, dims=([2], [1])).sum(1)  # (B, 4)


def test_shared_call_meeting_in_an_einsum_is_split_by_its_letters(dtype):
    """The batch letter is the batched operand's at its batch dim: the shared operand's ``q``
    (here as many queries as samples) is not taken for it. Exact against the loop."""
    torch.manual_seed(0)
    model = Einsum().to(dtype)
    x, y = torch.randn(4, 4, 3, dtype=dtype), torch.randint(0, 4, (4,))
    with gradhooks.attach(model) as gh:
        F.cross_entropy(model(x), y).backward()
        ours = gh.per_sample_grads()
    assert_close_to_loop(ours, loop_grads(model, F.cross_entropy, x, y), dtype)


def test_shared_call_meeting_in_an_unsplit_op_is_refused():
    """An op the split does not know (tensordot) can line a shared operand's dims up with the
    batch in any way: the read raises, naming the module and the op, instead of guessing."""
    torch.manual_seed(0)
    model = Einsum("tensordot").double()
    x, y = torch.randn(4, 4, 3, dtype=torch.float64), torch.randint(0, 4, (4,))
    with gradhooks.attach(model) as gh:
        F.cross_entropy(model(x), y).backward()
        with pytest.raises(gradhooks.BatchSizeError, match=r"'q' \(Linear\).*tensordot"):
            gh.per_sample_grads()


def test_tracking_stops_with_the_forward_and_runs_once_per_signature():
    """The provenance mode (with the hashing of ops run without gradient inside it: two modes)
    is active only inside the model's forward (also when it raises), and after the first
    forward of a signature without shared calls neither is entered again (the model runs no
    op without gradient)."""
    seen = []

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x, fail=False):
            seen.append(torch._C._len_torch_function_stack())
            if fail:
                raise RuntimeError("boom")
            return self.lin(x)

    model = Probe()
    x = torch.randn(4, 3)
    with gradhooks.attach(model) as gh:
        with pytest.raises(RuntimeError, match="boom"):
            model(x, fail=True)
        assert torch._C._len_torch_function_stack() == 0
        for _ in range(2):
            model(x).sum().backward()
            gh.per_sample_grads()
        model(torch.randn(5, 3)).sum().backward()  # a new signature: tracked again
    assert seen == [2, 2, 0, 2]
    assert torch._C._len_torch_function_stack() == 0


def test_shared_call_in_a_recomputed_region_is_refused():
    """A checkpointed region that makes a shared call is recomputed in the backward, where the
    meeting with the batch is not replayed: refused with the module's name."""
    from torch.utils.checkpoint import checkpoint

    class Ckpt(SharedBias):
        def forward(self, x):
            return checkpoint(super().forward, x, use_reentrant=False)

    torch.manual_seed(0)
    model = Ckpt().double()
    x, y = torch.randn(3, 4, 3, dtype=torch.float64), torch.randint(0, 3, (3,))
    with gradhooks.attach(model):
        with pytest.raises(gradhooks.BatchSizeError, match="recomputed"):
            F.cross_entropy(model(x), y).backward()


class TinyViT(nn.Module):
    """A container with raw parameters, as timm's VisionTransformer and ConvNeXt blocks have: a
    class token expanded and concatenated (meets the batch row by row), a position embedding
    added and a layer scale multiplied (broadcast), and hooked children."""

    def __init__(self, einsum=False):
        super().__init__()
        self.embed, self.mix, self.head = nn.Linear(3, D), nn.Linear(D, D), nn.Linear(D, 3)
        self.cls_token = nn.Parameter(torch.randn(1, 1, D))
        self.pos_embed = nn.Parameter(torch.randn(1, 5, D))
        self.gamma = nn.Parameter(torch.rand(D) + 0.5)
        self.einsum = einsum

    def forward(self, x):  # x (B, 4, 3)
        h = self.embed(x)
        h = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), h], 1) + self.pos_embed
        if self.einsum:  # (tensordot: not split per sample, so the replay covers gamma)
            h = h + torch.tensordot(torch.tanh(self.mix(h)), torch.diag(self.gamma), 1)
        else:
            h = h + torch.tanh(self.mix(h)) * self.gamma
        return self.head(h[:, 0])


@pytest.mark.filterwarnings("ignore::gradhooks.FallbackWarning")
@pytest.mark.parametrize("einsum", [False, True], ids=["split", "einsum-replay"])
@pytest.mark.parametrize("batch", [0, 1, 3, 5], ids=["B0", "B1", "B3", "B_eq_T"])
def test_raw_parameters_of_a_container_match_loop(batch, einsum, dtype):
    """Raw parameters of a container take their per-sample gradients where they meet the batch
    (records with Call.shared == "param"), and the container's torch.func replay drops them; a
    parameter that meets the batch in an op that is not split (tensordot) stays with the
    replay."""
    torch.manual_seed(0)
    model = TinyViT(einsum).to(dtype)
    x, y = torch.randn(batch, 4, 3, dtype=dtype), torch.randint(0, 3, (batch,))
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        F.cross_entropy(model(x), y, reduction="sum").backward()
        params = {c.names[0] for c in gh.recorder.records
                  if getattr(c.a, "shared", None) == "param"}
        replayed = {n for c in gh.recorder.records
                    if c.layer.module is model and getattr(c.a, "shared", None) is None
                    for n in c.names}
        ours = gh.per_sample_grads()
    if batch:
        assert params == ({"cls_token", "pos_embed"} if einsum else
                          {"cls_token", "pos_embed", "gamma"})
        assert replayed == ({"gamma"} if einsum else set())
        assert_close_to_loop(ours, loop_grads(model, F.cross_entropy, x, y), dtype)
    else:
        assert all(g.shape[0] == 0 for g in ours.values())


class Functional(nn.Module):
    """A parent that reads its child Linear's weights with F.linear (torchvision's Swin does):
    the child's forward never runs."""

    def __init__(self):
        super().__init__()
        self.qkv, self.head = nn.Linear(3, D), nn.Linear(D, 3)

    def forward(self, x):  # x (B, T, 3)
        return self.head(torch.tanh(F.linear(x, self.qkv.weight, self.qkv.bias)).mean(1))


@pytest.mark.parametrize("batch", [0, 1, 4], ids=["B0", "B1", "B4"])
def test_weights_read_functionally_by_a_parent_match_loop(batch, dtype):
    """The child's parameters go to the parent's torch.func replay (with a FallbackWarning at
    the forward that finds it), exact from that first batch on."""
    torch.manual_seed(0)
    outer = nn.Sequential(Functional()).to(dtype)
    x, y = torch.randn(batch, 4, 3, dtype=dtype), torch.randint(0, 3, (batch,))
    ref = loop_grads(outer, F.cross_entropy, x, y) if batch else None
    with gradhooks.attach(outer, loss_reduction="sum") as gh:
        for step in range(2):
            with pytest.warns(gradhooks.FallbackWarning, match=r"'0.qkv'.*'0' \(Functional\)") \
                    if step == 0 else warnings.catch_warnings():
                F.cross_entropy(outer(x), y, reduction="sum").backward()
            ours = gh.per_sample_grads()
            if batch:
                assert_close_to_loop(ours, ref, dtype)
            else:
                assert {n: g.shape[0] for n, g in ours.items()} == {n: 0 for n in ours}
            outer.zero_grad()


class SeqFirst(nn.Module):
    """A sequence-first model (inputs ``(T, B, 3)``, ``batch_first=False``) with every kind of
    shared call: position ids ``(T,)`` through an Embedding (``(T, D)`` unsqueezed to
    ``(T, 1, D)`` and broadcast), a ``(T, T)`` relative-position bias, a class token (a raw
    parameter expanded to ``(1, B, D)`` and concatenated on the time dim), a raw position
    parameter ``(T + 1, 1, D)`` and a zero initial state of the batch's size through a Linear
    (``(B, D)``, met row by row)."""

    def __init__(self, length, batch_first_input=False):
        super().__init__()
        self.batch_first_input = batch_first_input  # (B, T, 3) inputs, transposed here
        self.inp = nn.Linear(3, D)
        self.pos = nn.Embedding(length, D)
        self.rel = nn.Embedding(2 * length - 1, 1)
        self.cls = nn.Parameter(torch.randn(1, 1, D))
        self.pos_raw = nn.Parameter(torch.randn(length + 1, 1, D))
        self.init = nn.Linear(D, D)
        self.head = nn.Linear(D, 3)
        self.length = length

    def forward(self, x):  # x (T, B, 3)
        h = self.inp(x)
        if self.batch_first_input:  # (B, T, D) -> (T, B, D)
            h = h.transpose(0, 1)
        t, b = h.shape[0], h.shape[1]
        ids = torch.arange(t)
        h = h + self.pos(ids).unsqueeze(1)  # (T, B, D)
        h = torch.cat([self.cls.expand(1, b, D), h], 0) + self.pos_raw  # (T + 1, B, D)
        buckets = ids[None, :] - ids[:, None] + t - 1  # (T, T)
        bias = self.rel(buckets)[..., 0]  # (T, T): shared
        hb = h[1:].transpose(0, 1)  # (B, T, D)
        attn = torch.softmax(hb @ hb.transpose(1, 2) / D ** 0.5 + bias, -1)  # (B, T, T)
        mixed = (attn @ hb).transpose(0, 1)  # (T, B, D)
        state = self.init(torch.zeros(b, D, dtype=x.dtype))  # (B, D): shared, B rows
        return self.head(torch.tanh(mixed.mean(0) + h[0] + state))


@pytest.mark.filterwarnings("ignore::gradhooks.FallbackWarning")
@pytest.mark.parametrize("batch,length", [(0, 4), (1, 4), (3, 4), (4, 4)],
                         ids=["B0", "B1", "B3", "T_eq_B"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["seq_first", "transposed_inside"])
def test_sequence_first_shared_calls_match_loop(batch, length, batch_first, dtype):
    """Shared calls meeting (T, B, ...) tensors: with batch_first=False, and in a batch_first
    model that transposes its input to (T, B, ...) itself. Provenance follows the batch dim
    through the ops (the transpose moves it to dim 1), so with T == B a (T, 1, D) operand is
    a broadcast over dim 1, never rows of dim 0 of equal size. Norms too; two batches, so
    that the second forward is checked as well."""
    torch.manual_seed(0)
    model = SeqFirst(length, batch_first).to(dtype)
    with gradhooks.attach(model, batch_first=batch_first, loss_reduction="sum") as gh:
        for seed in (1, 2):
            torch.manual_seed(seed)
            x = torch.randn(length, batch, 3, dtype=dtype)
            if batch_first:
                x = x.transpose(0, 1).contiguous()
            y = torch.randint(0, 3, (batch,))
            F.cross_entropy(model(x), y, reduction="sum").backward()
            ours = gh.per_sample_grads()
            if not batch:
                assert {n: g.shape for n, g in ours.items()} == {
                    n: (0, *p.shape) for n, p in model.named_parameters()}
                continue
            with gradhooks.base.utils.paused():
                ref = loop_grads(model, F.cross_entropy, x, y, batch_dim=0 if batch_first else 1)
            assert_close_to_loop(ours, ref, dtype)
            norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
            tol = 1e-10 if dtype == torch.float64 else 1e-4
            torch.testing.assert_close(gh.per_sample_grad_norms(), norms, rtol=tol, atol=tol)
            for p in model.parameters():
                p.grad = None


def _ops(x, w):
    # (func, args, kwargs) on a batched x (B=2 on its dim 1 of (T=2, B=2, D=4)): sizes equal on
    # purpose, so only the data flow can tell the batch dim
    e = torch.nn.Embedding(5, 4).weight
    return [
        (torch.Tensor.transpose, (x, 0, 1), {}), (torch.Tensor.permute, (x, 2, 0, 1), {}),
        (torch.permute, (x, (1, 2, 0)), {}), (torch.Tensor.unsqueeze, (x, 1), {}),
        (torch.matmul, (x, w), {}),
        (torch.Tensor.__matmul__, (x, x.transpose(1, 2)), {}), (F.linear, (x, w), {}),
        (torch.Tensor.mean, (x, 0), {}), (torch.Tensor.sum, (x, (0, 2), True), {}),
        (torch.Tensor.amax, (x, -1), {}), (torch.Tensor.__getitem__, (x, 0), {}),
        (torch.Tensor.__getitem__, (x, (slice(None), 0)), {}),
        (torch.Tensor.__getitem__, (x, (Ellipsis, None, 1)), {}),
        (torch.Tensor.__getitem__, (x, (slice(None), slice(1, None))), {}),
        (F.pad, (x, (1, 1)), {}), (F.pad, (x, (0, 0, 1, 0)), {}),
        (torch.Tensor.unbind, (x, 0), {}), (torch.Tensor.chunk, (x, 2, -1), {}),
        (torch.cat, ([x, x], 2), {}), (torch.stack, ([x, x], 1), {}),
        (torch.add, (x, torch.ones(3, 1, 1, 4)), {}), (torch.softmax, (x, -1), {}),
        (F.scaled_dot_product_attention, (x.unsqueeze(0), x.unsqueeze(0), x.unsqueeze(0)), {}),
        (F.embedding, (torch.zeros(2, 2, dtype=torch.long), e), {}),
    ]


@pytest.mark.parametrize("i", range(24))
def test_batch_dim_followed_through_ops_as_the_meta_replay_finds_it(i):
    """The batch dim's fast rules (transpose, matmul, reductions, indexing ...) agree with the
    replay on meta tensors whose batch dim has a size no other dim has, with every dim of the
    real tensors of equal size (T == B == heads)."""
    from gradhooks.core.analysis.batch_dims import _on_meta, batch_dim_after
    x, w = torch.randn(2, 2, 4), torch.randn(4, 4)
    func, args, kwargs = _ops(x, w)[i]
    ref = next(a for a in args if isinstance(a, torch.Tensor)) if func not in (torch.cat, torch.stack) else x
    bd = 1 if ref.dim() == 3 else (2 if ref.dim() == 4 else 1)
    out = func(*args, **kwargs)
    batched = [(ref, bd)]
    assert batch_dim_after(func, args, kwargs, ref, bd, batched, out) == _on_meta(func, args, kwargs, batched, out)


@pytest.mark.parametrize("shape,bd,out_shape,expected", [
    ((2, 2, 4), 1, (2, 2, 2, 2), 1), ((2, 2, 4), 1, (2, 8), (1, 4)), ((2, 2, 4), 0, (2, 8), 0),
    ((3, 4, 5), 0, (12, 5), (0, 4)), ((3, 4, 5), 1, (12, 5), None),
    ((2, 2, 4), 1, (4, 4), None), ((2, 2, 4), 0, (1, 2, 2, 4), 1), ((2, 2, 4), 2, (2, 2, 2, 2), None),
    ((0, 2, 4), 1, (0, 8), None)])
def test_batch_dim_kept_by_views_that_keep_the_dims_before_it(shape, bd, out_shape, expected):
    """A view / reshape keeps the batch dim where the product of the dims before it is kept and
    the next dim has its size; merged with the dims after it, it is kept as (dim, inner) (the
    samples the outer factor); merged with a dim before it, it is lost."""
    from gradhooks.core.analysis.provenance import batch_dim_after
    x = torch.zeros(shape)
    out = x.reshape(out_shape)
    assert batch_dim_after(torch.Tensor.reshape, (x, *out_shape), {}, x, bd, [(x, bd)], out) == expected


@pytest.mark.parametrize("batch", [0, 1, 3, 4], ids=["B0", "B1", "B3", "T_eq_B"])
def test_sequence_first_state_from_sizes_is_planned_and_exact(batch, dtype):
    """batch_first=False: the state's Linear is found row by row at the first forward; later
    forwards follow the plan (an ordinary call on its B rows, no tracking) and stay exact."""
    torch.manual_seed(0)
    model = InitialState(seq_first=True).to(dtype)
    with gradhooks.attach(model, batch_first=False, loss_reduction="sum") as gh:
        for seed in (1, 2, 3):
            torch.manual_seed(seed)
            x, y = torch.randn(4, batch, 3, dtype=dtype), torch.randint(0, 3, (batch,))
            F.cross_entropy(model(x), y, reduction="sum").backward()
            ours = gh.per_sample_grads()
            if batch:
                with gradhooks.base.utils.paused():
                    ref = loop_grads(model, F.cross_entropy, x, y, batch_dim=1)
                assert_close_to_loop(ours, ref, dtype)
            else:
                assert {n: g.shape for n, g in ours.items()} == {
                    n: (0, *p.shape) for n, p in model.named_parameters()}
            for p in model.parameters():
                p.grad = None
        if batch > 1:  # (with B = 1 a (1, D) state is also a broadcast: tracked each time)
            assert list(gh.recorder.placement.signatures.values()) == [
                {(id(gh.recorder.layers[0]), 1): "rows"}]


class LearnedState(nn.Module):
    """A recurrent layer whose initial state is a raw parameter of the container, expanded to
    the batch (``(layers, 1, H) -> (layers, B, H)``, or ``(1, H) -> (B, H)`` for a cell)."""

    def __init__(self, kind, batch_first):
        super().__init__()
        self.kind, self.batch_first = kind, batch_first
        cls = {"gru": nn.GRU, "lstm": nn.LSTM, "rnn": nn.RNN}.get(kind)
        if cls is not None:
            self.rnn = cls(3, 5, num_layers=2, batch_first=batch_first)
            self.h0 = nn.Parameter(torch.randn(2, 1, 5))
            self.c0 = nn.Parameter(torch.randn(2, 1, 5)) if kind == "lstm" else None
        else:
            self.rnn = nn.LSTMCell(3, 5)
            self.h0, self.c0 = nn.Parameter(torch.randn(1, 5)), nn.Parameter(torch.randn(1, 5))
        self.head = nn.Linear(5, 3)

    def forward(self, x):  # x (B, T, 3) or (T, B, 3)
        b = x.shape[0] if self.batch_first else x.shape[1]
        if self.kind == "cell":
            h, c = self.h0.expand(b, 5), self.c0.expand(b, 5)
            for t in range(x.shape[1 if self.batch_first else 0]):
                h, c = self.rnn(x[:, t] if self.batch_first else x[t], (h, c))
            return self.head(h)
        h0 = self.h0.expand(2, b, 5).contiguous()
        state = h0 if self.c0 is None else (h0, self.c0.expand(2, b, 5).contiguous())
        out, _ = self.rnn(x, state)
        return self.head(out[:, -1] if self.batch_first else out[-1])


@pytest.mark.parametrize("batch", [0, 1, 3, 4], ids=["B0", "B1", "B3", "T_eq_B"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["bf", "seq"])
@pytest.mark.parametrize("kind", ["gru", "lstm", "rnn", "cell"])
def test_learned_initial_states_match_loop(kind, batch_first, batch, dtype):
    """A learned initial state meets the batch inside the recurrent op (its states' batch dim
    is 1, whatever the input's layout; a cell's is 0): split there, row by row, so the
    container needs no replay (a vmapped replay of nn.GRU fails in torch.func)."""
    torch.manual_seed(0)
    model = LearnedState(kind, batch_first).to(dtype)
    x = torch.randn(batch, 4, 3, dtype=dtype)
    if not batch_first:
        x = x.transpose(0, 1).contiguous()
    y = torch.randint(0, 3, (batch,))
    with gradhooks.attach(model, batch_first=batch_first, loss_reduction="sum") as gh:
        F.cross_entropy(model(x), y, reduction="sum").backward()
        ours = gh.per_sample_grads()
    if not batch:
        assert {n: g.shape for n, g in ours.items()} == {
            n: (0, *p.shape) for n, p in model.named_parameters()}
        return
    ref = loop_grads(model, F.cross_entropy, x, y, batch_dim=0 if batch_first else 1)
    assert_close_to_loop(ours, ref, dtype)


def test_batch_merged_with_heads_is_followed_back_to_its_own_dim():
    """Attention code that runs bmm over samples x heads: (B, H, T, d) -> (B*H, T, d) ->
    transpose -> (T, B*H, d) -> view (T, B, H*d); with B == T == H the sizes cannot tell, the
    flat layout can."""
    from gradhooks.core.analysis.provenance import batch_dim_after
    x = torch.zeros(3, 3, 3, 5)
    steps = [(torch.Tensor.reshape, lambda t: (t, 9, 3, 5)), (torch.Tensor.transpose, lambda t: (t, 0, 1)),
             (torch.Tensor.contiguous, lambda t: (t,)), (torch.Tensor.view, lambda t: (t, 3, 3, 15))]
    bd, t = 0, x
    found = []
    for func, make in steps:
        args = make(t)
        out = func(*args)
        bd = batch_dim_after(func, args, {}, t, bd, [(t, bd)], out)
        found.append(bd)
        t = out
    assert found == [(0, 3), (1, 3), (1, 3), 1]


def _index(x, *index):
    return torch.Tensor.__getitem__, (x, index)


def _cases():
    # (func, args, batch dim of args' first tensor, expected batch dim of the output): B = 3,
    # every other dim of size 3 too where it can be, so that no size tells
    m, w = torch.ones(3, 3, dtype=torch.bool), torch.randn(3, 3, 3)
    rows, cols = torch.arange(3), torch.arange(3)
    return [
        # x[arange(B) in place on the batch dim, others]: row p of the output is sample p's
        (*_index(m, rows[:, None, None, None], cols[None, None, None, :]), 0, 0),
        (*_index(m, rows, cols), 0, 0),  # (x[arange(B), labels]: one entry of each row)
        (*_index(m.t(), cols[:, None], rows[None, :]), 1, 1),
        (*_index(w, slice(None), rows[:, None], cols[None, :]), 1, 1),
        (*_index(w, rows[:, None], slice(None), cols[None, :]), 0, 0),  # (not adjacent: front)
        # not the batch's own rows in order: lost (left to the replay)
        (*_index(m, rows.flip(0), cols), 0, None), (*_index(m, rows[:2], cols[:2]), 0, None),
        (*_index(m, m[:, 0]), 0, None), (*_index(m, rows.double().long() * 0, cols), 0, None),
        # ref on the right of a matmul: its batch dims and columns stay, its rows are contracted
        (torch.matmul, (torch.randn(2, 3), w), 2, 2), (torch.matmul, (torch.randn(2, 3), w), 0, 0),
        (torch.matmul, (torch.randn(3), w), 0, 0), (torch.matmul, (torch.randn(3, 3), w), 1, None),
        (torch.matmul, (torch.randn(5, 1, 2, 3), w), 0, 1),
        # a new tensor of the batched operand's shape: laid out as it is
        (torch.Tensor.new_zeros, (m, m.shape), 1, 1), (torch.zeros_like, (w,), 2, 2),
        (torch.Tensor.new_zeros, (m, (3,)), 0, None),
    ]


@pytest.mark.parametrize("i", range(len(_cases())))
def test_batch_dim_through_own_row_indices_right_matmuls_and_new_tensors(i):
    """Advanced indexing of the batch dim by ``arange(B)`` (transformers' padding masks:
    ``padding_mask[batch_arange[:, None, None, None], kv_arange[None, None, None, :]]``),
    a batched right operand of ``matmul`` (learned queries ``q @ h.transpose(1, 2)``) and
    ``new_zeros(x.shape)`` (T5's shifted labels) keep the batch dim where it is proven; any
    other index (a permutation, fewer rows, a mask) does not."""
    from gradhooks.core.analysis.batch_dims import batch_dim_after
    func, args, bd, expected = _cases()[i]
    ref = args[1] if func is torch.matmul else args[0]
    out = func(*args)
    assert batch_dim_after(func, args, {}, ref, bd, [(ref, bd)], out) == expected


def test_provenance_follows_the_batch_dim_not_the_sizes():
    """Directly on a Provenance (no model, no hooks): with T == B the batch dim after a transpose
    is the one the data flow moved it to, a (B * T, D) view merges it with the positions, and a
    tensor not computed from the batch is not batched whatever its sizes."""
    from gradhooks.core.analysis.provenance import Provenance

    b = t = 4
    x = torch.randn(b, t, 3)
    noop = lambda *args: None
    prov = Provenance(b, 0, [x], noop, noop, noop)
    with prov:
        swapped = x.transpose(0, 1)
        rows = x.reshape(b * t, 3)
        buckets = torch.zeros(t, t)  # (T, T) with T == B
    assert prov.look(swapped)[0] and prov.look(swapped)[2] == 1
    assert prov.look(rows)[2] == (0, t)
    assert not prov.batched(buckets)
    assert prov.batch_size == b and prov.batch_dim == 0
    assert prov.shared_calls == [] and prov.plain == set() and not prov.swapped


@pytest.mark.parametrize("b", [2, 4])  # (one row: its stride is any, nothing to keep apart)
def test_an_as_strided_view_keeps_the_batch_only_within_its_tensor(b):
    """as_strided keeps the batch dim where its rows stay the samples' (Longformer's chunks:
    windows within each row, or rows interleaved in memory); a view of part of a wider tensor
    that reads past that part (memory its rows do not hold) loses it."""
    from gradhooks.core.analysis.provenance import Provenance

    x = torch.randn(b, 12)
    noop = lambda *args: None
    prov = Provenance(b, 0, [x], noop, noop, noop)
    with prov:
        h = x * 2
        windows = h.as_strided((b, 5, 4), (12, 2, 1))
        interleaved = h.t().contiguous().t().as_strided((b, 11, 2), (1, b, b))
        left = h[:, :6]  # (its rows' strides reach the right half's memory)
        past = left.as_strided((b, 12), (12, 1))
    assert prov.look(windows)[2] == 0 and prov.look(interleaved)[2] == 0
    assert prov.look(left)[2] == 0 and prov.look(past)[2] is None


def test_transposed_layers_are_relayouted_and_their_signature_tracked_every_time():
    """A batch-first model that runs a Linear on (T, B, D) with T == B: the placement swaps its
    records back (so the rule reads the samples, not the positions), and the signature stays
    tracked ("mode")."""
    class Transposing(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x):
            return self.lin(x.transpose(0, 1)).transpose(0, 1)

    torch.manual_seed(0)
    model = Transposing().double()
    x = torch.randn(4, 4, 3, dtype=torch.float64)
    ref = loop_grads(model, lambda out, y: out.sum(), x, torch.zeros(4))
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        model(x).sum().backward()
        (record,) = gh.recorder.records
        assert record.swap == ("swap", 1, 0)
        assert list(gh.recorder.placement.signatures.values()) == ["mode"]
        assert_close_to_loop(gh.per_sample_grads(), ref, torch.float64)
