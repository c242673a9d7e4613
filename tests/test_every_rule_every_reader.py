"""Every rule through every reader, against one looped reference.

The model is Opacus' shared test mixin (``opacus/tests/grad_samples/common.py``, which runs
every grad-sample mode of one module against micro-batches): here one table has a small module
per registered layer type (:func:`gradhooks.supported_types`, checked complete below) plus a
module only the fallback covers and a mixture of experts of raw-parameter slices, and every reader of the per-sample gradients is compared with
what it must equal when computed from the looped ones (``tests/conftest.py``'s ``loop_grads``,
one forward and backward per sample):

- ``per_sample_grads``: the loop itself;
- ``per_sample_grad_norms`` (total and ``per_param``): their L2 norms;
- ``clip_and_accumulate`` (``ghost`` and ``materialize``) and ``clipped_backward`` (two-pass):
  ``sum_n min(1, C / ||g_n||) g_n / D`` in ``param.grad``;
- ``gram``: ``<g_n, g_m>``; ``projected_grads``: a linear map of ``g_n`` (checked on the
  difference of two samples' projections, see the test);
- ``sum_grad_squared``, ``variance``, ``empirical_fisher_diag``: their documented moments.

A new rule is covered by adding one line to :data:`MODULES`; a new reader by one test here.
Float64 with tight bounds, float32 with ``1e-5``-relative ones; batch sizes 0, 1 and 3; both
loss reductions.
"""
import warnings

import pytest
import torch
from torch import nn

import gradhooks

from conftest import RTOL, loop_grads, weighted_square_loss


class Pick(nn.Module):
    """Wraps a layer whose output is a tuple or which takes several inputs, so that the model
    maps one tensor to one tensor (the wrapper has no parameters of its own)."""

    def __init__(self, layer: nn.Module, how: str):
        super().__init__()
        self.layer, self.how = layer, how

    def forward(self, x):
        if self.how == "first":  # RNN / GRU / LSTM: (output, state); LSTMCell: (h, c)
            return self.layer(x)[0]
        if self.how == "self_attention":
            return self.layer(x, x, x, need_weights=False)[0]
        raise AssertionError(self.how)


class Gate(nn.Module):
    """A layer no rule knows: covered by the torch.func fallback."""

    def __init__(self, n: int = 5):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n))

    def forward(self, x):
        return torch.tanh(x * self.w) * x


class SliceExperts(nn.Module):
    """A mixture of experts no rule knows (custom MoE code): each row of ``(B, T, D)`` goes to
    2 of 3 experts, chosen by the row's own largest entries among its first 3 (from the input
    itself: no rounding can change the choice), weighted by a softmax of a Linear router; the
    experts are slices ``weight[e]``, ``bias[e]`` of raw parameters, applied in a loop to the
    rows routed to them (their per-sample gradients: gradhooks.base.segments.Segments)."""

    def __init__(self, d: int = 5, experts: int = 3):
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.weight = nn.Parameter(torch.randn(experts, d, d) / d ** 0.5)
        self.bias = nn.Parameter(torch.randn(experts, d))

    def forward(self, x):
        rows = x.reshape(-1, x.shape[-1])
        experts = self.weight.shape[0]
        chosen = rows.detach()[:, :experts].topk(2, -1).indices
        probs = torch.softmax(self.router(rows), -1)
        out = torch.zeros_like(rows)
        for e in range(experts):
            token = torch.where((chosen == e).any(-1))[0]
            y = torch.nn.functional.linear(rows[token], self.weight[e], self.bias[e])
            out.index_add_(0, token, y * probs[token][:, e, None])
        return out.reshape(x.shape)


def _bn(cls, c):
    m = cls(c)
    m.running_mean.normal_()
    m.running_var.uniform_(0.5, 2.0)
    nn.init.normal_(m.weight)
    nn.init.normal_(m.bias)
    return m.eval()  # (train mode mixes the samples through the batch statistics)


def _affine(m):
    nn.init.normal_(m.weight)
    nn.init.normal_(m.bias)
    return m


# type name -> (model factory, input shape without B, integer inputs' vocabulary or None)
MODULES = {
    "Linear": (lambda: nn.Linear(5, 4), (3, 5), None),
    "Conv1d": (lambda: nn.Conv1d(3, 4, 3, padding=1), (3, 7), None),
    "Conv2d": (lambda: nn.Conv2d(4, 6, 3, stride=2, groups=2), (4, 7, 6), None),
    "Conv3d": (lambda: nn.Conv3d(2, 3, 2), (2, 4, 3, 4), None),
    "ConvTranspose1d": (lambda: nn.ConvTranspose1d(3, 4, 3, stride=2), (3, 5), None),
    "ConvTranspose2d": (lambda: nn.ConvTranspose2d(2, 3, 3), (2, 4, 5), None),
    "ConvTranspose3d": (lambda: nn.ConvTranspose3d(2, 2, 2), (2, 3, 3, 2), None),
    "BatchNorm1d": (lambda: _bn(nn.BatchNorm1d, 4), (4, 5), None),
    "BatchNorm2d": (lambda: _bn(nn.BatchNorm2d, 3), (3, 4, 4), None),
    "BatchNorm3d": (lambda: _bn(nn.BatchNorm3d, 2), (2, 3, 3, 2), None),
    "GroupNorm": (lambda: _affine(nn.GroupNorm(2, 4)), (4, 6), None),
    "InstanceNorm1d": (lambda: _affine(nn.InstanceNorm1d(3, affine=True)), (3, 6), None),
    "InstanceNorm2d": (lambda: _affine(nn.InstanceNorm2d(2, affine=True)), (2, 4, 3), None),
    "InstanceNorm3d": (lambda: _affine(nn.InstanceNorm3d(2, affine=True)), (2, 3, 3, 2), None),
    "LayerNorm": (lambda: _affine(nn.LayerNorm(6)), (3, 6), None),
    "RMSNorm": (lambda: nn.RMSNorm(6, elementwise_affine=True), (3, 6), None),
    "Embedding": (lambda: nn.Embedding(11, 4, padding_idx=0), (5,), 11),
    "EmbeddingBag": (lambda: nn.EmbeddingBag(11, 4, mode="mean"), (5,), 11),
    "RNN": (lambda: Pick(nn.RNN(4, 5, batch_first=True), "first"), (3, 4), None),
    "GRU": (lambda: Pick(nn.GRU(4, 5, batch_first=True), "first"), (3, 4), None),
    "LSTM": (lambda: Pick(nn.LSTM(4, 5, batch_first=True), "first"), (3, 4), None),
    "RNNCell": (lambda: nn.RNNCell(4, 5), (4,), None),
    "GRUCell": (lambda: nn.GRUCell(4, 5), (4,), None),
    "LSTMCell": (lambda: Pick(nn.LSTMCell(4, 5), "first"), (4,), None),
    "MultiheadAttention": (lambda: Pick(nn.MultiheadAttention(8, 2, batch_first=True),
                                        "self_attention"), (3, 8), None),
    "fallback": (lambda: Gate(5), (2, 5), None),
    "moe-slices": (lambda: SliceExperts(), (3, 5), None),
}

SIZES = [0, 1, 3]


def test_the_table_covers_every_registered_rule():
    """A rule registered without a line in :data:`MODULES` fails here, not silently."""
    assert set(gradhooks.supported_types()) <= set(MODULES), \
        set(gradhooks.supported_types()) - set(MODULES)


def _setup(kind, b, dtype, device="cpu"):
    """A seeded model, its batch ``x`` ``(b, ...)`` and per-sample weights ``w`` ``(b,)``, on
    ``device`` (drawn on the CPU, so every device sees the same numbers)."""
    torch.manual_seed(0)
    make, shape, vocab = MODULES[kind]
    model = make().to(dtype)
    if vocab is None:
        x = torch.randn(b, *shape, dtype=dtype)
    else:
        x = torch.randint(0, vocab, (b, *shape))
    w = torch.rand(b, dtype=dtype) + 0.5
    model, x, w = model.to(device), x.to(device), w.to(device)
    if b == 0:
        try:
            model(x)
        except (IndexError, RuntimeError, ValueError) as e:
            pytest.skip(f"torch's own {kind} refuses an empty batch ({type(e).__name__}: {e})")
    return model, x, w


def _reference(model, x, w):
    """The looped per-sample gradients of each sample's own loss, ``{name: (B, *shape)}`` for
    every trainable parameter (zeros where a sample does not reach one)."""
    if x.shape[0] == 0:
        return {n: p.new_zeros((0, *p.shape)) for n, p in model.named_parameters()}
    ref = loop_grads(model, weighted_square_loss("sum"), x, w)
    return {n: ref.get(n, p.new_zeros((x.shape[0], *p.shape)))
            for n, p in model.named_parameters()}


def _attached(model, x, w, loss_reduction):
    """Attach, forward and backward the batch loss; returns the GradHooks."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gradhooks.FallbackWarning)
        gh = gradhooks.attach(model, loss_reduction=loss_reduction)
        weighted_square_loss(loss_reduction)(model(x), w).backward()
    return gh


#: float32 on CUDA: cuDNN's RNN kernels (TF32 off) accumulate the time steps in another order
#: than gradhooks' replay of the gates; measured on an H200, up to 1.8e-5 of the largest entry
#: (RNN / GRU, B = 3), against 1e-5 on the CPU
CUDA_RTOL_FLOAT32 = 5e-5


def _close(ours, ref, dtype, what):
    assert ours.shape == ref.shape, (what, ours.shape, ref.shape)
    scale = ref.abs().max() if ref.numel() else 0.0
    diff = (ours.to(ref.dtype) - ref).abs().max() if ref.numel() else 0.0
    rtol = (CUDA_RTOL_FLOAT32 if dtype == torch.float32 and ref.device.type == "cuda"
            else RTOL[dtype])
    assert diff <= rtol * max(float(scale), 1e-30) + (1e-12 if dtype == torch.float64
                                                       else 1e-7), \
        f"{what}: max diff {float(diff):.3e} vs max |ref| {float(scale):.3e}"


def _flat(grads):
    return torch.cat([g.flatten(1) for g in grads.values()], 1)


cases = pytest.mark.parametrize("kind", list(MODULES))
sizes = pytest.mark.parametrize("b", SIZES, ids=[f"B{b}" for b in SIZES])


@cases
@sizes
def test_per_sample_grads(kind, b, dtype, loss_reduction, device):
    model, x, w = _setup(kind, b, dtype, device)
    ref = _reference(model, x, w)
    gh = _attached(model, x, w, loss_reduction)
    with gh:
        ours = gh.per_sample_grads()
    assert list(ours) == list(ref)
    for name in ref:
        _close(ours[name], ref[name], dtype, name)


@cases
@sizes
def test_norms(kind, b, dtype, loss_reduction, device):
    model, x, w = _setup(kind, b, dtype, device)
    ref = _reference(model, x, w)
    gh = _attached(model, x, w, loss_reduction)
    with gh:
        total = gh.per_sample_grad_norms()
        per_param = gh.per_sample_grad_norms(per_param=True)
    _close(total, _flat(ref).norm(dim=1) if b else total.new_zeros(0), dtype, "norms")
    for name, g in ref.items():
        _close(per_param[name], g.flatten(1).norm(dim=1), dtype, name)


def _bound(ref):
    """A clipping bound strictly between two samples' norms (at least one sample clipped, no
    sample at the kink ``||g_n|| = C``); any positive bound for fewer than two samples."""
    norms = _flat(ref).norm(dim=1).sort().values if ref and next(iter(ref.values())).shape[0] \
        else torch.ones(1)
    if norms.numel() < 2:
        return 0.5 * float(norms[0]) + 1e-3
    return float((norms[-2] * norms[-1]).sqrt()) if norms[-1] > norms[-2] else 0.5 * float(norms[0])


def _clipped_sum(ref, bound, b, loss_reduction):
    if not b:
        return {n: g.new_zeros(g.shape[1:]) for n, g in ref.items()}
    norms = _flat(ref).norm(dim=1)
    c = (bound / norms).clamp(max=1.0)
    d = b if loss_reduction == "mean" else 1
    return {n: torch.einsum("n,n...->...", c, g) / d for n, g in ref.items()}


@cases
@sizes
@pytest.mark.parametrize("method", ["ghost", "materialize", "two_pass"])
def test_clipping(kind, b, dtype, loss_reduction, method, device):
    _check_clipping(kind, b, dtype, loss_reduction, method, device)


@cases
@sizes
def test_clipping_from_kept_per_sample_grads(kind, b, dtype, loss_reduction, monkeypatch):
    """Book-keeping clipping with every per-sample gradient it materialises for the norms kept
    for the clipped sum (``readers.plan.KEEP_OF_RECORDS`` raised: one ``tensordot`` each instead
    of the closed form or a second replay) equals the loop's clipped sum too."""
    from gradhooks.readers import plan as plan_module
    monkeypatch.setattr(plan_module, "KEEP_OF_RECORDS", 1e12)
    _check_clipping(kind, b, dtype, loss_reduction, "ghost", "cpu")


def _check_clipping(kind, b, dtype, loss_reduction, method, device):
    model, x, w = _setup(kind, b, dtype, device)
    ref = _reference(model, x, w)
    bound = _bound(ref)
    expected = _clipped_sum(ref, bound, b, loss_reduction)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gradhooks.FallbackWarning)
        with gradhooks.attach(model, loss_reduction=loss_reduction) as gh:
            out = model(x)
            if method == "two_pass":
                shape = (-1,) + (1,) * (out.dim() - 1)
                losses = (w.view(shape) * out ** 2).flatten(1).sum(1)
                gh.clipped_backward(losses, bound)
            else:
                weighted_square_loss(loss_reduction)(out, w).backward()
                gh.clip_and_accumulate(bound, method=method)
    for name, p in model.named_parameters():
        _close(p.grad, expected[name], dtype, name)


@cases
@sizes
def test_gram_and_projections(kind, b, dtype, loss_reduction, device):
    model, x, w = _setup(kind, b, dtype, device)
    ref = _reference(model, x, w)
    flat = _flat(ref)
    gh = _attached(model, x, w, loss_reduction)
    with gh:
        _close(gh.gram(), flat @ flat.T, dtype, "gram")
        projected = gh.projected_grads(k_in=3, k_out=2, seed=1)
    assert projected.shape[0] == b
    if b == 0:  # an empty batch's rows are as wide as any other's (batches are concatenated)
        model1, x1, w1 = _setup(kind, 1, dtype, device)
        gh1 = _attached(model1, x1, w1, loss_reduction)
        with gh1:
            assert projected.shape[1:] == gh1.projected_grads(k_in=3, k_out=2, seed=1).shape[1:]
    if b == 3:  # linear in g_n: the projections of x[0], x[1] and of a batch of (x[0], x[0],
        # x[1]) agree sample by sample (so each row is a function of its own sample only)
        model2, _, _ = _setup(kind, b, dtype, device)
        x2, w2 = x[[0, 0, 1]], w[[0, 0, 1]]
        gh2 = _attached(model2, x2, w2, loss_reduction)
        with gh2:
            again = gh2.projected_grads(k_in=3, k_out=2, seed=1)
        _close(again, projected[[0, 0, 1]], dtype, "projected_grads")


@cases
@sizes
def test_moments(kind, b, dtype, loss_reduction, device):
    model, x, w = _setup(kind, b, dtype, device)
    ref = _reference(model, x, w)
    gh = _attached(model, x, w, loss_reduction)
    with gh:
        fisher = gh.empirical_fisher_diag()
        sgs = gh.sum_grad_squared()
        var = gh.variance() if b else None
    weight = 1.0 / b if (loss_reduction == "mean" and b) else 1.0
    for name, g in ref.items():
        _close(sgs[name], (g * g).sum(0), dtype, name)
        _close(fisher[name], (g * g).sum(0) * weight, dtype, name)
        if b:
            _close(var[name], g.var(0, correction=0), dtype, name)
