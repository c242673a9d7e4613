"""Loss split, proven (issue 38, point 3): a scalar loss is split into per-sample terms only where
its graph proves the split; a loss normalised over the batch's tokens is refused wherever the
samples' valid-token counts differ, whatever the loss function, with ``loss.backward()`` and
with ``gh.backward(loss)``; per_sample_token_loss and ``token_normalisation="batch"`` are the two
ways out, both exact against a loop; a constant factor on the loss (gradient accumulation) is
read by ``gh.backward`` and divided out by the DP reads, which refuse where it cannot be read.

The model is per-token (Embedding, Linear, tanh, Linear head: no op across tokens or samples),
so every loop below is each sample alone, in float64 (1e-10) and float32 (1e-5).
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.base.errors import UnsupportedLossError

from conftest import RTOL, assert_close_to_loop, loop_grads

V, D, T = 7, 6, 5
DTYPES = {"f64": torch.float64, "f32": torch.float32}
VALID = [5, 3, 2]  # valid labels per sample (the rest -100): unequal counts
WEIGHT = torch.tensor([0.5, 1.0, 2.0, 0.3, 1.5, 0.8, 1.2])


class TokenModel(nn.Module):
    """(B, T) ids -> (B, T, V) logits, each token on its own."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.hidden = nn.Linear(D, D)
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        return self.head(torch.tanh(self.hidden(self.emb(ids))))


def model_of(dtype):
    torch.manual_seed(0)
    return TokenModel().to(dtype)


def batch(valid, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (len(valid), T), generator=g)
    labels = torch.randint(0, V, (len(valid), T), generator=g)
    for n, k in enumerate(valid):
        labels[n, k:] = -100
    return ids, labels


def _rows(logits, labels):
    return logits.reshape(-1, V), labels.reshape(-1)


def _mask(labels):
    return (labels != -100).to(torch.get_default_dtype())


# The five batch losses normalised over the batch's tokens (none is plain cross-entropy), each
# with its per-sample form through per_sample_token_loss: the loss of each sample alone.
def weighted_ce(logits, labels):
    return F.cross_entropy(*_rows(logits, labels), weight=WEIGHT.to(logits.dtype))


def smoothed_ce(logits, labels):
    return F.cross_entropy(*_rows(logits, labels), label_smoothing=0.1)


def ce_with_z_loss(logits, labels):
    valid = labels != -100
    z = torch.logsumexp(logits, -1).pow(2)
    return F.cross_entropy(*_rows(logits, labels)) + 1e-2 * z[valid].sum() / valid.sum()


def sum_over_num_items(logits, labels):
    num_items_in_batch = (labels != -100).sum()  # (transformers' Trainer passes it)
    return F.cross_entropy(*_rows(logits, labels), reduction="sum") / num_items_in_batch


def focal(logits, labels):
    ce = F.cross_entropy(*_rows(logits, labels), reduction="none").view(labels.shape)
    valid = (labels != -100).to(logits.dtype)
    return ((1 - torch.exp(-ce)) ** 2 * ce * valid).sum() / valid.sum()


def focal_tokens(logits, labels):
    ce = F.cross_entropy(*_rows(logits, labels), reduction="none").view(labels.shape)
    return (1 - torch.exp(-ce)) ** 2 * ce


FORMS = {
    "class-weighted": (weighted_ce, lambda lg, lb: gradhooks.per_sample_token_loss(
        lg, lb, shift=False, weight=WEIGHT.to(lg.dtype))),
    "label-smoothing": (smoothed_ce, lambda lg, lb: gradhooks.per_sample_token_loss(
        lg, lb, shift=False, label_smoothing=0.1)),
    "z-loss": (ce_with_z_loss, lambda lg, lb: gradhooks.per_sample_token_loss(
        lg, lb, shift=False, z_loss=1e-2)),
    "sum-over-num-items": (sum_over_num_items, lambda lg, lb: gradhooks.per_sample_token_loss(
        lg, lb, shift=False)),
    "focal": (focal, lambda lg, lb: gradhooks.per_sample_token_loss(
        token_losses=focal_tokens(lg, lb), mask=lb != -100)),
}


def backward(gh, loss, how):
    if how == "gh.backward":
        gh.backward(loss)
    else:
        loss.backward()


HOW = ["loss.backward", "gh.backward"]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("form", list(FORMS))
def test_padded_token_losses_refused(form, how, dtype):
    batch_loss = FORMS[form][0]
    model = model_of(DTYPES[dtype])
    ids, labels = batch(VALID)
    with gradhooks.attach(model) as gh:
        backward(gh, batch_loss(model(ids), labels), how)
        for read in (gh.per_sample_grads, gh.per_sample_grad_norms,
                     lambda: gh.clip_and_accumulate(1.0)):
            with pytest.raises(UnsupportedLossError) as info:
                read()
            message = str(info.value)
            assert "per_sample_token_loss" in message, message
            assert "token_normalisation='batch'" in message, message
            assert "depends on the batch's token count" in message, message
            if form == "class-weighted":
                assert "class-weighted" in message, message
            else:
                assert "N_n = [5, 3, 2]" in message, message


@pytest.mark.parametrize("how", HOW)
def test_plain_cross_entropy_refused_on_the_same_batch(how):
    model = model_of(torch.float64)
    ids, labels = batch(VALID)
    with gradhooks.attach(model) as gh:
        loss = F.cross_entropy(*_rows(model(ids), labels))
        if how == "gh.backward":
            with pytest.raises(UnsupportedLossError, match=r"N_n = \[5, 3, 2\]"):
                gh.backward(loss)
        else:
            loss.backward()
            with pytest.raises(UnsupportedLossError, match=r"N_n = \[5, 3, 2\]"):
                gh.per_sample_grads()


@pytest.mark.parametrize("form", list(FORMS))
def test_per_sample_token_loss_matches_each_sample_alone(form):
    # The helper's (B,) losses are, entry by entry, the batch loss computed on the sample alone.
    batch_loss, own = FORMS[form]
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, T, V, dtype=torch.float64, generator=g)
    _, labels = batch(VALID)
    ours = own(logits, labels)
    ref = torch.stack([batch_loss(logits[n:n + 1], labels[n:n + 1]) for n in range(3)])
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("valid", [VALID, [4]], ids=["B3", "B1"])
def test_per_sample_losses_exact(form, how, dtype, valid):
    # Way out (a): (B,) per-sample losses, reduced over samples: the split is proven.
    batch_loss, own = FORMS[form]
    dtype = DTYPES[dtype]
    model = model_of(dtype)
    ids, labels = batch(valid)
    ref = loop_grads(model, batch_loss, ids, labels)  # each sample alone, the batch loss's code
    with gradhooks.attach(model) as gh:
        backward(gh, own(model(ids), labels).mean(), how)
        assert_close_to_loop(gh.per_sample_grads(), ref, dtype)


@pytest.mark.parametrize("form", [f for f in FORMS if f != "class-weighted"])
def test_equal_counts_accepted_and_exact(form):
    # Equal valid counts: a token mean over the batch is the mean of the samples' token means.
    batch_loss = FORMS[form][0]
    model = model_of(torch.float64)
    ids, labels = batch([3, 3, 3])
    ref = loop_grads(model, batch_loss, ids, labels)
    for how in HOW:
        with gradhooks.attach(model) as gh:
            backward(gh, batch_loss(model(ids), labels), how)
            assert_close_to_loop(gh.per_sample_grads(), ref, torch.float64)
        model.zero_grad()


def test_class_weights_refused_with_equal_counts_unless_weight_sums_equal():
    # A weighted mean divides by the batch's weight total: equal counts are not enough.
    model = model_of(torch.float64)
    ids, labels = batch([3, 3, 3])
    with gradhooks.attach(model) as gh:
        weighted_ce(model(ids), labels).backward()
        with pytest.raises(UnsupportedLossError, match="class-weighted"):
            gh.per_sample_grads()
        gh.backward(weighted_ce(model(ids), labels))
        with pytest.raises(UnsupportedLossError, match=r"class-weight sums = \["):
            gh.per_sample_grads()
        same = labels.clone()
        same[:, :3] = 2  # one class everywhere: equal weight sums, an exact split
        gh.backward(weighted_ce(model(ids), same))
        assert_close_to_loop(gh.per_sample_grads(), loop_grads(model, weighted_ce, ids, same),
                             torch.float64)


def contributions(model, loss_fn, ids, labels):
    """{name: (B, *shape)}: B times sample n's contribution to the gradient of the batch loss
    (the gradient through sample n's logits only; the normaliser counts the whole batch)."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    rows = []
    for n in range(ids.shape[0]):
        logits = model(ids)
        keep = (torch.arange(ids.shape[0]) == n).view(-1, 1, 1)
        loss = loss_fn(torch.where(keep, logits, logits.detach()), labels)
        rows.append(torch.autograd.grad(loss, [p for _, p in params], materialize_grads=True))
    b = ids.shape[0]
    return {name: b * torch.stack([r[k] for r in rows]) for k, (name, _) in enumerate(params)}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("form", list(FORMS) + ["plain"])
def test_batch_token_normalisation_gives_contributions(form, how, dtype):
    # Way out (b): token_normalisation="batch": each sample's contribution, summing to .grad.
    batch_loss = FORMS[form][0] if form != "plain" else (
        lambda lg, lb: F.cross_entropy(*_rows(lg, lb)))
    dtype = DTYPES[dtype]
    model = model_of(dtype)
    ids, labels = batch(VALID)
    ref = contributions(model, batch_loss, ids, labels)
    with gradhooks.attach(model, token_normalisation="batch") as gh:
        model.zero_grad()
        loss = batch_loss(model(ids), labels)
        loss.backward()
        ours = gh.per_sample_grads()
        assert_close_to_loop(ours, ref, dtype)
        for name, p in model.named_parameters():
            torch.testing.assert_close(ours[name].sum(0) / len(VALID), p.grad,
                                       rtol=RTOL[dtype] * 10, atol=RTOL[dtype] * 10)
        if how == "gh.backward":
            gh.backward(batch_loss(model(ids), labels))
            assert_close_to_loop(gh.per_sample_grads(), ref, dtype)


def test_token_normalisation_checked():
    with pytest.raises(ValueError, match="token_normalisation"):
        gradhooks.attach(model_of(torch.float64), token_normalisation="tokens")


def test_masked_mse_over_tokens_refused_and_exact_per_sample():
    # Not a cross-entropy at all: an MSE over the valid tokens of the batch.
    model = model_of(torch.float64)
    ids, labels = batch(VALID)
    target = torch.randn(len(VALID), T, V, dtype=torch.float64)

    def mse(logits, mask):
        return (((logits - target[:logits.shape[0]]) ** 2).sum(-1) * mask).sum() / mask.sum()

    mask = (labels != -100).double()
    with gradhooks.attach(model) as gh:
        mse(model(ids), mask).backward()
        with pytest.raises(UnsupportedLossError, match=r"N_n = \[5, 3, 2\]"):
            gh.per_sample_grads()
        logits = model(ids)
        losses = gradhooks.per_sample_token_loss(
            token_losses=((logits - target) ** 2).sum(-1), mask=mask)
        gh.backward(losses.mean())
        ours = gh.per_sample_grads()
    ref = {}
    rows = []
    params = [(n, p) for n, p in model.named_parameters()]
    for n in range(len(VALID)):
        tg = target[n:n + 1]
        loss = (((model(ids[n:n + 1]) - tg) ** 2).sum(-1) * mask[n:n + 1]).sum() / mask[n].sum()
        rows.append(torch.autograd.grad(loss, [p for _, p in params]))
    ref = {name: torch.stack([r[k] for r in rows]) for k, (name, _) in enumerate(params)}
    assert_close_to_loop(ours, ref, torch.float64)


def test_empty_batch_per_sample_token_loss():
    model = model_of(torch.float64)
    ids, labels = torch.zeros(0, T, dtype=torch.long), torch.zeros(0, T, dtype=torch.long)
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        losses = gradhooks.per_sample_token_loss(model(ids), labels, shift=False,
                                                 weight=WEIGHT.double(), z_loss=1e-2)
        assert losses.shape == (0,)
        gh.backward(losses.sum())
        assert all(g.shape[0] == 0 for g in gh.per_sample_grads().values())


def test_helper_errors():
    logits, labels = torch.randn(2, T, V), torch.randint(0, V, (2, T))
    with pytest.raises(ValueError, match=r"weight must be a \(V,\)"):
        gradhooks.per_sample_token_loss(logits, labels, weight=torch.ones(V + 1))
    with pytest.raises(ValueError, match="not both"):
        gradhooks.per_sample_token_loss(logits, labels, token_losses=torch.ones(2, T),
                                        mask=torch.ones(2, T))
    with pytest.raises(ValueError, match="of one shape"):
        gradhooks.per_sample_token_loss(token_losses=torch.ones(2, T), mask=torch.ones(2, 3))
    out = gradhooks.per_sample_token_loss(token_losses=torch.ones(2, T),
                                          mask=torch.zeros(2, T, dtype=torch.bool))
    assert out.tolist() == [0.0, 0.0]  # (no valid token: 0, as for the logits path)


# ------------------------------------------------------------------ a constant factor on the loss
def mlp(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def lot(dtype, b=6):
    g = torch.Generator().manual_seed(2)
    return torch.randn(b, 5, generator=g).to(dtype), torch.randint(0, 3, (b,), generator=g)


def clipped_mean(model, x, y, max_norm):
    """(norms, {name: sum_n min(1, C / |g_n|) g_n / B}) of each sample's own cross-entropy."""
    ref = loop_grads(model, F.cross_entropy, x, y)
    norms = sum(g.flatten(1).pow(2).sum(1) for g in ref.values()).sqrt()
    factors = (max_norm / norms).clamp(max=1.0)
    return norms, {n: torch.einsum("n,n...->...", factors, g) / x.shape[0]
                   for n, g in ref.items()}


def between(norms):
    s = norms.sort().values
    return float(s[len(s) // 2 - 1] + s[len(s) // 2]) / 2  # (a bound between two norms)


SCALED = {"loss / steps": lambda loss, k: loss / k,
          "loss * (1 / steps)": lambda loss, k: loss * (1.0 / k),
          "loss / tensor(steps)": lambda loss, k: loss / torch.tensor(float(k))}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("scaled", list(SCALED))
def test_accumulation_factor_read_and_divided_out(scaled, dtype):
    # The Trainer's loss / gradient_accumulation_steps over DP micro-batches: clipping acts on
    # each sample's own (unscaled) loss gradient, whatever the micro-batch.
    dtype = DTYPES[dtype]
    model = mlp(dtype)
    x, y = lot(dtype)
    norms_ref, ref = clipped_mean(model, x, y, 1.0)
    max_norm = between(norms_ref)
    norms_ref, ref = clipped_mean(model, x, y, max_norm)
    steps = 3
    with gradhooks.attach(model) as gh:
        norms = []
        for xb, yb in gradhooks.micro_batches((x, y), 2):
            gh.backward(SCALED[scaled](F.cross_entropy(model(xb), yb), steps))
            norms.append(gh.clip_and_accumulate(max_norm, accumulate=True))
        gh.finish_step()
    tol = dict(rtol=RTOL[dtype] * 10, atol=0)
    torch.testing.assert_close(torch.cat(norms), norms_ref, **tol)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[name], rtol=RTOL[dtype] * 10,
                                   atol=RTOL[dtype] * ref[name].abs().max())


@pytest.mark.parametrize("b", [1, 4])
def test_constant_factor_in_one_batch(b):
    # A plain clip of c times the mean: the gradient of each sample's own loss is clipped, and
    # .grad is written at the loss's scale (c times the clipped mean), as for a GradScaler.
    model = mlp(torch.float64)
    x, y = lot(torch.float64, b)
    norms_ref, ref = clipped_mean(model, x, y, 0.3)
    own = loop_grads(model, F.cross_entropy, x, y)
    with gradhooks.attach(model) as gh:
        gh.backward(F.cross_entropy(model(x), y) * 0.5)
        per_sample = gh.per_sample_grads(retain_records=True)  # (of the loss as given)
        norms = gh.clip_and_accumulate(0.3)
        assert_close_to_loop({n: g * 2 for n, g in per_sample.items()}, own, torch.float64)
    torch.testing.assert_close(norms, norms_ref, rtol=1e-10, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 0.5 * ref[name], rtol=1e-10, atol=1e-14)


def test_sum_over_b_is_the_mean_not_a_factor():
    model = mlp(torch.float64)
    x, y = lot(torch.float64, 4)
    norms_ref, ref = clipped_mean(model, x, y, 0.3)
    with gradhooks.attach(model) as gh:
        gh.backward(F.cross_entropy(model(x), y, reduction="none").sum() / 4)
        torch.testing.assert_close(gh.clip_and_accumulate(0.3), norms_ref, rtol=1e-10, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[name], rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("scaled", list(SCALED))
def test_unreadable_factor_refused_by_dp_reads(scaled):
    # loss.backward() frees the factor before any hook runs: the DP reads refuse, the others
    # read the gradients of the loss as given.
    model = mlp(torch.float64)
    x, y = lot(torch.float64, 4)
    with gradhooks.attach(model) as gh:
        SCALED[scaled](F.cross_entropy(model(x), y), 3).backward()
        with pytest.raises(UnsupportedLossError, match="cannot read.*gh.backward"):
            gh.clip_and_accumulate(1.0, accumulate=True)
        ours = gh.per_sample_grads()
    own = loop_grads(model, F.cross_entropy, x, y)
    assert_close_to_loop({n: g * 3 for n, g in ours.items()}, own, torch.float64)


def test_factor_with_materialize_refused():
    model = mlp(torch.float64)
    x, y = lot(torch.float64, 4)
    with gradhooks.attach(model) as gh:
        gh.backward(F.cross_entropy(model(x), y) / 3)
        with pytest.raises(UnsupportedLossError, match="method='ghost'"):
            gh.clip_and_accumulate(1.0, method="materialize")


class Head(nn.Module):
    """One hooked layer on one-hot tokens: its grad_output is captured by gh.backward's
    output-edges pass (no pre-hook of a later layer runs)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(V, V)

    def forward(self, ids):
        return self.head(F.one_hot(ids, V).to(self.head.weight.dtype))


@pytest.mark.parametrize("model_fn", [lambda: model_of(torch.float64), lambda: Head().double()],
                         ids=["three-layers", "one-layer"])
def test_masked_mean_without_cross_entropy_refused_by_gh_backward(model_fn):
    # No nll_loss whose targets give the counts: the first grad_output's zero rows do, also when
    # it is one the output-edges pass captures.
    model = model_fn()
    ids, labels = batch(VALID)
    mask = (labels != -100).double()
    with gradhooks.attach(model, check=False) as gh:
        for _ in range(3):  # (the first pass computes parameter gradients; then edges)
            gh.backward(((model(ids) ** 2).sum(-1) * mask).sum() / mask.sum())
            with pytest.raises(UnsupportedLossError, match=r"N_n = \[5, 3, 2\]"):
                gh.per_sample_grads()


class WithLoss(TokenModel):
    """A model that computes its (class-weighted) loss in its forward, as a custom
    ``*ForCausalLM`` does."""

    def forward(self, ids, labels):
        return weighted_ce(super().forward(ids), labels)


def test_loss_computed_in_the_forward_refused():
    torch.manual_seed(0)
    model = WithLoss().double()
    ids, labels = batch(VALID)
    with gradhooks.attach(model) as gh:
        for _ in range(2):  # the tracked first forward, then an untracked one
            model(ids, labels).backward()
            with pytest.raises(UnsupportedLossError, match="class-weighted"):
                gh.per_sample_grads()
            model.zero_grad()
