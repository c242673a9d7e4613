"""Samples made of several rows (``gh.set_sample_ids``): rows sharing an id are one sample.

Every per-sample read that takes ids -- per-sample gradients ``(G, *shape)``, norms ``(G,)``,
book-keeping clipping (ghost and materialised) and two-pass clipping with ``(G,)`` losses -- is
compared with a float64 (and float32) loop over the samples: each sample's loss computed from
its rows alone (one forward of just those rows), its gradient by autograd. Models: an MLP, a
small conv net on augmented views of images (unequal numbers of views, a view alone), a token
model (embedding, LSTM, self-attention: row scatters and factored forms) on multiple-choice
options, a message-passing network on a batch of graphs (nodes the rows, messages between
nodes of one graph), and a tiny GPT-2 in TRL's DPO forward: one forward of ``[chosen; rejected]``, a pair the sample, the DPO
loss per pair. Ids are never sorted; batch sizes 0, 1 and several. Then the errors.
"""
import os
import warnings

import pytest
import test_every_rule_every_reader as every_rule
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks import SampleIdsError
from gradhooks.readers import plan as plan_module

import zoo_imports
from conftest import loop_grads

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # random weights from configs: never download

RTOL = {torch.float64: 1e-9, torch.float32: 2e-5}
BETA = 0.5


# ---------------------------------------------------------------------------------- the cases
class Case:
    """A model, a batch of rows with their ids, and ``losses(model, rows) -> (G_rows,)``: the
    loss of each sample the rows ``rows`` (an index tensor) hold, in sorted-id order, from one
    forward of those rows alone; ``batch_loss`` is the loss the user backpropagates."""

    def __init__(self, model, ids, losses):
        self.model, self.ids, self.losses = model, ids, losses

    def batch_losses(self):
        return self.losses(self.model, torch.arange(self.ids.shape[0]))


def _row_loss_case(model, x, w, ids, within):
    """Row losses ``w_n * sum(tanh-net(x_n)^2)``; a sample's loss their sum (``within="sum"``)
    or mean (``"mean"``) over its rows, formed by constant per-row weights (no op over the
    batch in the forward)."""
    _, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
    share = torch.ones_like(w) if within == "sum" else 1.0 / counts[inverse].to(w.dtype)

    def losses(model, rows):
        p = next(model.parameters())  # (the data stays on the CPU in float64: test_on_cuda)
        dev = p.device
        xs = x[rows].to(dev)
        out = model(xs.to(p.dtype) if xs.is_floating_point() else xs)
        row = (w[rows] * share[rows]).to(dev, p.dtype) * out.pow(2).flatten(1).sum(1)
        _, inv = torch.unique(ids[rows], return_inverse=True)
        return row.new_zeros(int(inv.max()) + 1 if rows.numel() else 0).index_add(
            0, inv.to(dev), row)
    return losses


def mlp_case(ids, dtype, within="sum"):
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(dtype)
    b = ids.shape[0]
    x, w = torch.randn(b, 5, dtype=dtype), torch.rand(b, dtype=dtype) + 0.5
    return Case(model, ids, _row_loss_case(model, x, w, ids, within))


def conv_case(ids, dtype, within="sum"):
    """Augmented views: each id an image, each row one view of it (flipped, noised)."""
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.Tanh(),
                          nn.Conv2d(4, 4, 3, groups=2), nn.GroupNorm(2, 4), nn.Tanh(),
                          nn.Flatten(), nn.Linear(4 * 4 * 4, 3)).to(dtype)
    images = torch.randn(int(ids.max()) + 1 if ids.numel() else 0, 2, 6, 6, dtype=dtype)
    views = images[ids]
    views = torch.where(torch.rand(ids.shape[0], 1, 1, 1) < 0.5, views.flip(-1), views)
    views = views + 0.1 * torch.randn_like(views)
    w = torch.rand(ids.shape[0], dtype=dtype) + 0.5
    return Case(model, ids, _row_loss_case(model, views, w, ids, within))


class Sequence(nn.Module):
    """Tokens -> Embedding (row scatters) -> LSTM and self-attention (factored forms) -> Linear."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.lstm = nn.LSTM(6, 6, batch_first=True)
        self.attn = nn.MultiheadAttention(6, 2, batch_first=True)
        self.head = nn.Linear(6, 3)

    def forward(self, tokens):
        h, _ = self.lstm(self.embed(tokens))
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.head(torch.tanh(h).mean(1))


def seq_case(ids, dtype, within="sum"):
    """Multiple-choice style: each id a question, each row one option's tokens."""
    model = Sequence().to(dtype)
    tokens = torch.randint(0, 11, (ids.shape[0], 5))
    w = torch.rand(ids.shape[0], dtype=dtype) + 0.5
    return Case(model, ids, _row_loss_case(model, tokens, w, ids, within))


class MessagePassing(nn.Module):
    """Node rows, messages along edges within each graph (``index_add`` over the node dim),
    node-level layers only; the graph's loss reads its nodes' outputs."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.out = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 2)

    def forward(self, x, src, dst):
        h = torch.tanh(self.l1(x))
        h = h + h.new_zeros(h.shape).index_add(0, dst, h[src])
        h = torch.tanh(self.l2(h))
        h = h + h.new_zeros(h.shape).index_add(0, dst, h[src])
        return self.out(h)


def graph_case(ids, dtype, within="sum"):
    """A batch of graphs: each id a graph, each row a node (the ``batch`` vector of a graph
    library); edges drawn between nodes of one graph."""
    model = MessagePassing().to(dtype)
    x = torch.randn(ids.shape[0], 4, dtype=dtype)
    same = (ids[:, None] == ids[None, :]) & (torch.rand(ids.shape[0], ids.shape[0]) < 0.6)
    src, dst = torch.nonzero(same, as_tuple=True)

    def losses(model, rows):
        dev = next(model.parameters()).device
        pos = torch.full((ids.shape[0],), -1)
        pos[rows] = torch.arange(rows.numel())
        keep = (pos[src] >= 0) & (pos[dst] >= 0)
        node = model(x[rows].to(dev), pos[src[keep]].to(dev), pos[dst[keep]].to(dev))
        _, inv = torch.unique(ids[rows], return_inverse=True)
        pooled = node.new_zeros(int(inv.max()) + 1 if rows.numel() else 0, 2).index_add(
            0, inv.to(dev), node)  # sum readout per graph
        return pooled.tanh().pow(2).sum(1)
    return Case(model, ids, losses)


V, T = 23, 6


def dpo_case(pairs, dtype, perm=None):
    """TRL's DPO forward: chosen and rejected completions of ``P`` prompts in one forward
    ``[chosen; rejected]``, the pair ``i`` (id ``perm[i]``) the sample; the loss per pair
    ``-logsigmoid(beta ((lc - lr) - (ref_c - ref_r)))``, log-probs summed over the completion's
    tokens (a mask per row), the reference log-probs constants."""
    model = zoo_imports.tiny_gpt2(V, positions=T).to(dtype)
    chosen = torch.randint(0, V, (pairs, T))
    rejected = torch.randint(0, V, (pairs, T))
    start = torch.randint(1, T - 1, (2 * pairs,))  # the completion starts there (per row)
    mask = (torch.arange(T - 1)[None] >= start[:, None] - 1).to(dtype)  # over label positions
    ref = torch.randn(2 * pairs, dtype=dtype)
    perm = torch.randperm(pairs) if perm is None else perm
    ids = perm.repeat(2)

    def losses(model, rows):
        p = rows.numel() // 2
        pair = rows[:p] % pairs if p else rows[:0]  # rows = [chosen rows; their rejected rows]
        tokens = torch.cat([chosen[pair], rejected[pair]])
        logits = model(tokens).logits[:, :-1]
        logp = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
        logp = (logp * mask[rows]).sum(1)
        lc, lr = logp[:p], logp[p:]  # as TRL's concatenated_forward splits them
        rc, rr = ref[rows[:p]], ref[rows[p:]]
        per_pair = -F.logsigmoid(BETA * ((lc - lr) - (rc - rr)))
        return per_pair[torch.argsort(ids[rows[:p]])]  # sorted-id order
    return Case(model, ids, losses)


def _groups_of(ids):
    """The rows of each sample, in sorted-id order; for a DPO pair [chosen; rejected]."""
    return [torch.nonzero(ids == k).squeeze(1) for k in torch.unique(ids)]


def loop_reference(case):
    """``{name: (G, *shape)}``: each sample's loss from its rows alone, its gradient."""
    params = {n: p for n, p in case.model.named_parameters() if p.requires_grad}
    out = {n: [] for n in params}
    for rows in _groups_of(case.ids):
        (loss,) = case.losses(case.model, rows)
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        for (n, p), g in zip(params.items(), grads):
            out[n].append(torch.zeros_like(p) if g is None else g)
    return {n: (torch.stack(gs) if gs else params[n].new_zeros(0, *params[n].shape))
            for n, gs in out.items()}


def flat_norms(grads, g):
    if not grads:
        return torch.zeros(g)
    return torch.cat([t.flatten(1) for t in grads.values()], 1).norm(dim=1)


def assert_close(ours, ref, dtype, what):
    scale = ref.abs().max() if ref.numel() else torch.tensor(0.0)
    diff = (ours - ref).abs().max() if ref.numel() else torch.tensor(0.0)
    assert ours.shape == ref.shape, (what, ours.shape, ref.shape)
    assert diff <= RTOL[dtype] * max(float(scale), 1e-30), f"{what}: {diff:.3e} vs {scale:.3e}"


def batch_loss(case, reduction):
    losses = case.batch_losses()
    return losses.mean() if reduction == "mean" else losses.sum()


IDS = {
    "unequal": torch.tensor([3, 0, 3, 7, 0, 3, 5, 7]),  # sizes 2, 3, 1, 2; unsorted; one alone
    "one_row": torch.tensor([4]),
    "all_one": torch.tensor([2, 0, 1]),  # every sample one row, ids a permutation
    "empty": torch.zeros(0, dtype=torch.long),
}
MAKERS = {"mlp": mlp_case, "conv": conv_case, "seq": seq_case, "graph": graph_case}


def make(name, ids, dtype, within="sum"):
    torch.manual_seed(0)
    if name == "dpo":
        pairs = {"unequal": 3, "one_row": 1, "all_one": 2, "empty": 0}[ids]
        return dpo_case(pairs, dtype)
    return MAKERS[name](IDS[ids], dtype, within)


# (transformers' GPT-2 cannot run a batch of 0 rows itself: its attention reshapes with -1)
# (a batch of graphs with message passing is refused: test_batch_of_graphs_is_refused)
CASES = [(m, i) for m in ("mlp", "conv", "seq", "dpo") for i in IDS
         if (m, i) != ("dpo", "empty")]


def test_batch_of_graphs_is_refused(dtype):
    """Message passing between a graph's nodes (``index_add`` along the node rows), the graphs
    declared as samples: the op table cannot prove that the scatter stays inside one declared
    sample (gradhooks.core.analysis.separation; proving it from the ids is not built), and the model's
    inputs (node rows and an edge list) cannot be sliced for the forward-alone check, so every
    read is refused naming ``index_add``: never a silently wrong number."""
    case = make("graph", "unequal", dtype)
    with gradhooks.attach(case.model) as gh:
        loss = batch_loss(case, "mean")
        gh.set_sample_ids(case.ids)
        loss.backward()
        with pytest.raises(gradhooks.UnprovenOpError, match="index_add"):
            gh.per_sample_grads()


# ----------------------------------------------------------------------- per-sample gradients
@pytest.mark.parametrize("name,ids", CASES, ids=[f"{m}-{i}" for m, i in CASES])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_per_sample_grads_and_norms(name, ids, reduction, dtype):
    case = make(name, ids, dtype)
    ref = loop_reference(case)
    g = torch.unique(case.ids).numel()
    with gradhooks.attach(case.model, loss_reduction=reduction) as gh:
        loss = batch_loss(case, reduction)
        gh.set_sample_ids(case.ids)
        if g:
            loss.backward()
        else:  # an empty batch: a mean over no sample is NaN; its sum is 0
            case.batch_losses().sum().backward()
        norms = gh.per_sample_grad_norms()
        per_param = gh.per_sample_grad_norms(per_param=True)
        ours = gh.per_sample_grads()
        assert gh.per_sample_grad_norms().shape == (g,)  # from the kept result
    assert list(ours) == list(ref)
    for n in ref:
        assert ours[n].dtype == dtype
        assert_close(ours[n], ref[n], dtype, n)
        assert_close(per_param[n], ref[n].flatten(1).norm(dim=1), dtype, n + " norm")
    assert_close(norms, flat_norms(ref, g).to(norms.dtype), dtype, "norms")


@pytest.mark.parametrize("name", ["mlp", "conv", "dpo"])
@pytest.mark.parametrize("gram", [True, False], ids=["gram", "materialised"])
def test_norms_both_forms_and_mean_within_sample(name, gram, monkeypatch):
    """Both forms of a linear layer's norm (the Gram form over the sample's rows' positions,
    and the materialised one; for GPT-2's tied embedding and LM head, with the cross term of
    the joined forms), and a sample's loss the mean over its rows."""
    monkeypatch.setattr(plan_module, "use_gram", lambda *a, **k: gram)
    case = make(name, "unequal", torch.float64, within="mean")
    ref = loop_reference(case)
    with gradhooks.attach(case.model, loss_reduction="mean", check="always") as gh:
        loss = batch_loss(case, "mean")
        loss.backward()
        gh.set_sample_ids(case.ids)  # (after the backward: any time before the first read)
        norms = gh.per_sample_grad_norms()
        plans, _ = plan_module.plan(gh.recorder.snapshot("per_sample_grad_norms()"))
    assert_close(norms, flat_norms(ref, norms.shape[0]), torch.float64, "norms")
    if name == "dpo":  # (the tied weight keeps its factored form)
        assert {p.name: p.kind for p in plans.values()}["transformer.wte.weight"] == plan_module.TIED


def test_norm_of_a_sample_is_not_the_sum_of_its_rows_norms():
    case = make("mlp", "unequal", torch.float64)
    with gradhooks.attach(case.model, loss_reduction="sum") as gh:
        case.batch_losses().sum().backward()
        rows = gh.per_sample_grad_norms()
    with gradhooks.attach(case.model, loss_reduction="sum") as gh:
        case.batch_losses().sum().backward()
        gh.set_sample_ids(case.ids)
        grouped = gh.per_sample_grad_norms()
    per_row_sum = torch.zeros(4, dtype=rows.dtype).index_add(
        0, torch.unique(case.ids, return_inverse=True)[1], rows)
    assert rows.shape == (8,) and grouped.shape == (4,)
    assert not torch.allclose(grouped, per_row_sum)
    assert_close(grouped, flat_norms(loop_reference(case), 4), torch.float64, "norms")


def test_statistics_over_samples():
    case = make("conv", "unequal", torch.float64)
    ref = loop_reference(case)
    with gradhooks.attach(case.model, loss_reduction="mean") as gh:
        batch_loss(case, "mean").backward()
        gh.set_sample_ids(case.ids)
        var = gh.variance()
    for n in ref:
        assert_close(var[n], ref[n].var(0, correction=0), torch.float64, n)


# ---------------------------------------------------------------------------------- clipping
def clipped_reference(ref, max_norm, divisor):
    norms = flat_norms(ref, next(iter(ref.values())).shape[0])
    c = (max_norm / norms).clamp(max=1.0)
    return {n: torch.tensordot(c.to(t.dtype), t, 1) / divisor for n, t in ref.items()}, norms


@pytest.mark.parametrize("name,ids", [c for c in CASES if c[1] != "empty"],
                         ids=[f"{m}-{i}" for m, i in CASES if i != "empty"])
@pytest.mark.parametrize("method", ["ghost", "materialize", "two_pass"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_clipping_per_sample(name, ids, method, reduction, dtype):
    case = make(name, ids, dtype)
    ref = loop_reference(case)
    g = torch.unique(case.ids).numel()
    full = flat_norms(ref, g)
    max_norm = float(full.median()) if g > 1 else float(full[0]) / 2  # some clipped, some not
    expected, ref_norms = clipped_reference(ref, max_norm, g if reduction == "mean" else 1)
    with gradhooks.attach(case.model, loss_reduction=reduction) as gh:
        if method == "two_pass":
            losses = case.batch_losses()
            gh.set_sample_ids(case.ids)
            norms = gh.clipped_backward(losses, max_norm)
        else:
            loss = batch_loss(case, reduction)
            gh.set_sample_ids(case.ids)
            gh.backward(loss) if name == "mlp" else loss.backward()
            norms = gh.clip_and_accumulate(max_norm, method=method)
    assert_close(norms, ref_norms.to(norms.dtype), dtype, "norms")
    for n, p in case.model.named_parameters():
        assert_close(p.grad, expected[n], dtype, n)


def test_multiple_choice_softmax_over_a_samples_rows(dtype):
    """A multiple-choice head: one score per option (row), a softmax over each question's
    options inside the forward (``view(-1, c)`` merges the options' rows); the question (its
    options' rows) is the sample. The op table cannot prove that the merge stays inside one
    declared sample, and the output has no row per option for the forward-alone check: every
    read is refused (``UnprovenOpError`` naming the ``view``). Accepted unproven with
    ``allow_sample_mixing=True``, the grouped results equal the loop's (the merge pairs rows of
    one sample only): per-sample gradients, norms and ghost clipping."""
    q, c = 4, 3

    class MultipleChoice(nn.Module):
        def __init__(self):
            super().__init__()
            # (no bias on the score: a softmax over options cancels it, its gradient is 0)
            self.score = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1, bias=False))

        def forward(self, x):
            return self.score(x).view(-1, c).log_softmax(-1)

    model = MultipleChoice().to(dtype)
    x, label = torch.randn(q * c, 5, dtype=dtype), torch.randint(0, c, (q,))
    perm = torch.randperm(q)
    ids = perm.repeat_interleave(c)  # question i's options are rows i c .. i c + c - 1
    ref = {n: torch.zeros(q, *p.shape, dtype=dtype) for n, p in model.named_parameters()}
    for i in range(q):
        loss = -model(x[i * c:(i + 1) * c])[0, label[i]]
        for (n, p), g in zip(model.named_parameters(), torch.autograd.grad(loss, list(model.parameters()))):
            ref[n][perm[i]] = g  # sample perm[i]: the ids in increasing order
    expected, ref_norms = clipped_reference(ref, 0.7, q)
    with gradhooks.attach(model, loss_reduction="mean") as gh:
        out = model(x)
        gh.set_sample_ids(ids)
        (-out[torch.arange(q), label]).mean().backward()
        with pytest.raises(gradhooks.UnprovenOpError, match="view"):
            gh.per_sample_grads()
    with gradhooks.attach(model, loss_reduction="mean", allow_sample_mixing=True) as gh:
        out = model(x)
        gh.set_sample_ids(ids)
        (-out[torch.arange(q), label]).mean().backward()
        ours = gh.per_sample_grads(retain_records=True)
        norms = gh.clip_and_accumulate(0.7)
    assert_close(norms, ref_norms, dtype, "norms")
    for n, p in model.named_parameters():
        assert_close(ours[n], ref[n], dtype, n)
        assert_close(p.grad, expected[n], dtype, n + " clipped")


def test_empty_batch_clipping_with_ids():
    case = make("mlp", "empty", torch.float64)
    with gradhooks.attach(case.model, loss_reduction="mean") as gh:
        losses = case.batch_losses()
        gh.set_sample_ids(case.ids)
        norms = gh.clipped_backward(losses, 1.0)
    assert norms.shape == (0,)
    assert all(float(p.grad.abs().max()) == 0.0 for p in case.model.parameters())


def test_accumulation_counts_samples():
    """Micro-batches with ids: finish_step divides by the number of samples, not rows."""
    case = make("mlp", "unequal", torch.float64)
    ref = loop_reference(case)
    expected, _ = clipped_reference(ref, 0.3, 2 * 4)
    with gradhooks.attach(case.model, loss_reduction="mean") as gh:
        for _ in range(2):  # the same micro-batch twice: 8 samples of 16 rows
            loss = batch_loss(case, "mean")
            gh.set_sample_ids(case.ids)
            loss.backward()
            gh.clip_and_accumulate(0.3, accumulate=True)
        assert gh.finish_step() == 8
    for n, p in case.model.named_parameters():
        assert_close(p.grad, 2 * expected[n], torch.float64, n)


def test_ids_hold_for_one_batch_only():
    case = make("mlp", "unequal", torch.float64)
    with gradhooks.attach(case.model, loss_reduction="sum") as gh:
        case.batch_losses().sum().backward()
        gh.set_sample_ids(case.ids)
        assert gh.per_sample_grads()["0.weight"].shape[0] == 4
        case.batch_losses().sum().backward()  # the next batch: rows are samples again
        assert gh.per_sample_grads()["0.weight"].shape[0] == 8
        case.batch_losses().sum().backward()
        gh.set_sample_ids(case.ids)
        gh.set_sample_ids(None)
        assert gh.per_sample_grads()["0.weight"].shape[0] == 8
        case.batch_losses().sum().backward()
        gh.set_sample_ids(case.ids)
        gh.clear()  # drops the batch and its ids
        case.batch_losses().sum().backward()
        assert gh.per_sample_grads()["0.weight"].shape[0] == 8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["mlp", "conv", "seq"])
def test_on_cuda(name, dtype, monkeypatch):
    """On a GPU: ids on the CPU refused, on the GPU grouped as on the CPU (against the CPU
    float64 loop), per-sample gradients, norms and book-keeping clipping."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # (float32 tolerances)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    case = make(name, "unequal", torch.float64)
    ref = loop_reference(case)
    expected, ref_norms = clipped_reference(ref, 0.5, 4)
    case.model.to("cuda", dtype)
    with gradhooks.attach(case.model, loss_reduction="mean") as gh:
        loss = batch_loss(case, "mean")
        with pytest.raises(SampleIdsError, match="ids are on cpu"):
            gh.set_sample_ids(case.ids)
        gh.set_sample_ids(case.ids.cuda())
        loss.backward()
        norms = gh.clip_and_accumulate(0.5)
        ours = gh.per_sample_grads()
    assert_close(norms.cpu().double(), ref_norms, dtype, "norms")
    for n, p in case.model.named_parameters():
        assert ours[n].is_cuda and ours[n].shape[0] == 4
        assert_close(ours[n].cpu().double(), ref[n], dtype, n)
        assert_close(p.grad.cpu().double(), expected[n], dtype, n + " clipped")


# ------------------------------------------------------------------ every rule, rows grouped
ROW_IDS = torch.tensor([2, 0, 2, 1, 0])  # samples of 2, 2 and 1 rows, unsorted


def _every_rule(kind, dtype):
    """A model of :mod:`test_every_rule_every_reader`'s table on 5 rows, and what the grouped
    reads must equal: the looped rows' gradients (each row alone) summed per sample."""
    model, x, w = every_rule._setup(kind, ROW_IDS.shape[0], dtype)
    rows = every_rule._reference(model, x, w)
    _, inverse = torch.unique(ROW_IDS, return_inverse=True)
    ref = {n: g.new_zeros(3, *g.shape[1:]).index_add(0, inverse, g) for n, g in rows.items()}
    return model, x, w, ref


def _row_losses(model, x, w):
    out = model(x)
    return (w.view((-1,) + (1,) * (out.dim() - 1)) * out ** 2).flatten(1).sum(1)


@pytest.mark.parametrize("kind", list(every_rule.MODULES))
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_every_rule_grouped(kind, reduction, dtype):
    """Per-sample gradients and norms of every rule (the table of
    tests/test_every_rule_every_reader.py) with rows grouped: each sample's rows' looped
    gradients summed, their norms."""
    model, x, w, ref = _every_rule(kind, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gradhooks.FallbackWarning)
        with gradhooks.attach(model, loss_reduction=reduction) as gh:
            loss = _row_losses(model, x, w).sum() / (3 if reduction == "mean" else 1)
            gh.set_sample_ids(ROW_IDS)
            loss.backward()
            norms = gh.per_sample_grad_norms()
            per_param = gh.per_sample_grad_norms(per_param=True)
            ours = gh.per_sample_grads()
    assert list(ours) == list(ref)
    for n in ref:
        assert_close(ours[n], ref[n], dtype, n)
        assert_close(per_param[n], ref[n].flatten(1).norm(dim=1), dtype, n + " norm")
    assert_close(norms, flat_norms(ref, 3).to(norms.dtype), dtype, "norms")


@pytest.mark.parametrize("kind", list(every_rule.MODULES))
@pytest.mark.parametrize("method", ["ghost", "materialize", "two_pass"])
def test_every_rule_grouped_clipping(kind, method, dtype):
    model, x, w, ref = _every_rule(kind, dtype)
    norms = flat_norms(ref, 3)
    bound = float(norms.median())
    expected, ref_norms = clipped_reference(ref, bound, 3)
    _, inverse = torch.unique(ROW_IDS, return_inverse=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gradhooks.FallbackWarning)
        with gradhooks.attach(model, loss_reduction="mean") as gh:
            rows = _row_losses(model, x, w)
            gh.set_sample_ids(ROW_IDS)
            if method == "two_pass":
                got = gh.clipped_backward(rows.new_zeros(3).index_add(0, inverse, rows), bound)
            else:
                (rows.sum() / 3).backward()
                got = gh.clip_and_accumulate(bound, method=method)
    assert_close(got, ref_norms.to(got.dtype), dtype, "norms")
    for n, p in model.named_parameters():
        assert_close(p.grad, expected[n], dtype, n)


# ------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("bad,match", [
    (torch.tensor([0.0, 1.0, 1.0, 2.0, 0.0, 1.0, 2.0, 2.0]), "integer dtype"),
    (torch.tensor([True, False] * 4), "integer dtype"),
    (torch.tensor([0, 1, 2]), r"shape \(B,\) = \(8,\)"),
    (torch.zeros(8, 1, dtype=torch.long), r"shape \(B,\)"),
    ([0, 1, 2, 3, 0, 1, 2, 3], "must be a \\(B,\\) integer tensor"),
    (torch.zeros(8, dtype=torch.long, device="meta"), "ids are on meta"),
], ids=["float", "bool", "length", "2d", "list", "device"])
def test_malformed_ids_are_refused(bad, match):
    case = make("mlp", "unequal", torch.float64)
    with gradhooks.attach(case.model, loss_reduction="sum") as gh:
        case.batch_losses().sum()
        with pytest.raises(SampleIdsError, match=match):
            gh.set_sample_ids(bad)


def test_ids_before_any_forward_are_refused():
    case = make("mlp", "unequal", torch.float64)
    with gradhooks.attach(case.model) as gh:
        with pytest.raises(SampleIdsError, match="no forward has run yet"):
            gh.set_sample_ids(case.ids)


def test_ids_after_a_row_read_are_refused():
    case = make("mlp", "unequal", torch.float64)
    with gradhooks.attach(case.model, loss_reduction="sum") as gh:
        case.batch_losses().sum().backward()
        gh.per_sample_grads()
        with pytest.raises(SampleIdsError, match="already formed .* row by row"):
            gh.set_sample_ids(case.ids)
        case.batch_losses().sum().backward()
        gh.set_sample_ids(case.ids)
        gh.per_sample_grads()
        with pytest.raises(SampleIdsError, match=r"set_sample_ids\(None\): .* per sample"):
            gh.set_sample_ids(None)  # (the kept result is per sample: later reads read it)
        assert gh.per_sample_grad_norms().shape == (4,)


def test_ids_set_before_their_forward_are_refused_at_the_read():
    case = make("mlp", "unequal", torch.float64)
    with gradhooks.attach(case.model, loss_reduction="sum") as gh:
        case.batch_losses().sum().backward()
        gh.per_sample_grads()
        gh.set_sample_ids(None)
        case.batch_losses().sum().backward()
        gh.per_sample_grad_norms()  # (this batch read without ids)
        gh.set_sample_ids(case.ids)  # meant for the next forward: it describes this batch
        gh.set_sample_ids(case.ids)
        case.batch_losses().sum().backward()
        with pytest.raises(SampleIdsError, match="declared for an earlier batch"):
            gh.per_sample_grads()


@pytest.mark.parametrize("read", ["kfac_factors", "ekfac_factors", "gram", "projected_grads",
                                  "empirical_fisher_diag", "per_sample_jacobians"])
def test_reads_that_cannot_group_refuse(read):
    case = make("mlp", "unequal", torch.float64)
    with gradhooks.attach(case.model, loss_reduction="sum") as gh:
        x = torch.randn(8, 5, dtype=torch.float64)
        out = case.model(x)
        gh.set_sample_ids(case.ids)
        name = "gradient_features" if read in ("gram", "projected_grads") else read
        with pytest.raises(SampleIdsError, match=rf"{name}\(\): sample_ids are set"):
            if read == "per_sample_jacobians":
                gh.per_sample_jacobians(out)
            else:
                out.pow(2).sum().backward()
                getattr(gh, read)()


def test_clipped_backward_wants_one_loss_per_sample():
    case = make("dpo", "unequal", torch.float64)
    with gradhooks.attach(case.model, loss_reduction="mean") as gh:
        tokens = torch.randint(0, V, (6, T))
        logits = case.model(tokens).logits
        gh.set_sample_ids(case.ids)
        with pytest.raises(ValueError, match=r"needs the \(G,\) per-sample losses .*G = 3 samples"):
            gh.clipped_backward(logits.sum((1, 2)), 1.0)


@pytest.mark.parametrize("form", ["cross_entropy_mean", "losses_mean"])
def test_a_mean_over_rows_is_refused(form):
    """With ids, a mean over the B rows is not the mean over the G samples: gh.backward refuses
    it (every result would be G/B times the truth); the sum over rows divided by G passes."""
    model = nn.Sequential(nn.Linear(5, 3)).double()
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
    with gradhooks.attach(model, loss_reduction="mean") as gh:
        out = model(x)
        gh.set_sample_ids(IDS["unequal"])
        loss = (F.cross_entropy(out, y) if form == "cross_entropy_mean"
                else F.cross_entropy(out, y, reduction="none").mean())
        with pytest.raises(gradhooks.UnsupportedLossError, match=r"mean over the rows .*G/B = 4/8"):
            gh.backward(loss, retain_graph=True)
        gh.backward(F.cross_entropy(out, y, reduction="sum") / 4)
        assert gh.per_sample_grads()["0.weight"].shape == (4, 3, 5)


@pytest.mark.parametrize("when", ["ids-before", "ids-after"])
@pytest.mark.parametrize("form", ["cross_entropy_mean", "losses_mean"])
@pytest.mark.parametrize("read", ["per_sample_grads", "per_sample_grad_norms"])
def test_a_mean_over_rows_is_refused_after_a_plain_backward(read, form, when):
    """The same means handed to a plain loss.backward(), the ids declared before or after it:
    the graph shows the (B,) tensor a .mean() reduces, and a loss function's own mean over the
    B rows shows them at the output's grad_output, so the read refuses it; the sum over rows
    / G is exact."""
    model = nn.Sequential(nn.Linear(5, 3)).double()
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
    ref = {"0.weight": [], "0.bias": []}
    groups = torch.unique(IDS["unequal"], return_inverse=True)[1]
    for g in range(4):  # each sample's own loss: the sum of its rows' losses
        model.zero_grad()
        F.cross_entropy(model(x[groups == g]), y[groups == g], reduction="sum").backward()
        for n, p in model.named_parameters():
            ref[n].append(p.grad.clone())
    ref = {n: torch.stack(v) for n, v in ref.items()}
    with gradhooks.attach(model, loss_reduction="mean") as gh:
        out = model(x)
        if when == "ids-before":
            gh.set_sample_ids(IDS["unequal"])
        loss = (F.cross_entropy(out, y) if form == "cross_entropy_mean"
                else F.cross_entropy(out, y, reduction="none").mean())
        loss.backward()
        if when == "ids-after":
            gh.set_sample_ids(IDS["unequal"])
        with pytest.raises(gradhooks.UnsupportedLossError,
                           match=rf"{read}\(\): sample_ids group the B = 8 rows .*G/B = 4/8"):
            getattr(gh, read)()
        model.zero_grad()
        out = model(x)
        if when == "ids-before":
            gh.set_sample_ids(IDS["unequal"])
        (F.cross_entropy(out, y, reduction="sum") / 4).backward()
        if when == "ids-after":
            gh.set_sample_ids(IDS["unequal"])
        ours = gh.per_sample_grads()
    for n in ref:
        assert_close(ours[n], ref[n], torch.float64, n)


@pytest.mark.parametrize("rows", ["B", "G"])
def test_a_mean_over_rows_it_cannot_count_is_refused_after_a_plain_backward(rows):
    """A loss function's mean over rows with an op between it and the model's output: after a
    plain loss.backward() its row count is freed before any hook runs, so with ids it is
    refused whatever the rows are (fail closed), naming gh.backward; gh.backward counts them
    before the pass, refuses the mean over the B rows and gives a mean over the G samples'
    rows exactly (against each sample's rows alone, float64)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3)).double()
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
    ids = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])

    def loss_of(out):
        if rows == "B":
            return F.cross_entropy(out * 2.0, y)
        return F.cross_entropy(out.view(-1, 2, 3).sum(1), y[::2])  # (one row per sample)

    with gradhooks.attach(model, loss_reduction="mean") as gh:
        out = model(x)
        gh.set_sample_ids(ids)
        loss_of(out).backward()
        with pytest.raises(gradhooks.UnsupportedLossError,
                           match=r"could not count .*G/B = 4/8 .*gh\.backward\(loss\)"):
            gh.per_sample_grads()
        out = model(x)
        gh.set_sample_ids(ids)
        if rows == "B":
            with pytest.raises(gradhooks.UnsupportedLossError, match=r"G/B = 4/8"):
                gh.backward(loss_of(out))
            return
        gh.backward(loss_of(out))
        ours = gh.per_sample_grads()
    for n, p in model.named_parameters():
        ref = torch.stack([torch.autograd.grad(F.cross_entropy(
            model(x[2 * g:2 * g + 2]).sum(0, keepdim=True), y[2 * g:2 * g + 1]), p)[0]
            for g in range(4)])
        assert_close(ours[n], ref, torch.float64, n)


def test_a_mean_over_rows_without_ids_stays_exact():
    """Without ids each row is a sample: the same means are the declared mean, exact."""
    model = nn.Sequential(nn.Linear(5, 3)).double()
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
    ref = loop_grads(model, F.cross_entropy, x, y)
    with gradhooks.attach(model, loss_reduction="mean") as gh:
        for loss in (lambda o: F.cross_entropy(o, y),
                     lambda o: F.cross_entropy(o, y, reduction="none").mean()):
            loss(model(x)).backward()
            ours = gh.per_sample_grads()
            for n in ref:
                assert_close(ours[n], ref[n], torch.float64, n)


def test_two_forward_refusal_names_sample_ids():
    """The refusal of two forwards before one backward leads to one concatenated forward with
    sample_ids, not to a concatenation whose rows would each be a sample."""
    model = nn.Sequential(nn.Linear(4, 3)).double()
    a, b = torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64)
    with gradhooks.attach(model) as gh:
        (model(a) - model(b)).pow(2).sum().backward()
        with pytest.raises(gradhooks.GradHooksError, match="set_sample_ids") as e:
            gh.per_sample_grads()
    assert "without sample_ids would make each row a sample" in str(e.value)
