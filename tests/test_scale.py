"""The real-size tier: models at the sizes people train, with the default ``gradhooks.attach(model)``
(sum check on), against looped autograd (one forward and backward per sample).

GPT-2 small (124 M, ``wte`` tied to ``lm_head``), BERT-base, T5-small (shared embedding called by
encoder and decoder, tied to ``lm_head``), a Llama-3.2-1B-width decoder (d = 2048, grouped-query
attention, a tied 128256 x 2048 embedding, 2 blocks), torchvision's ViT-B/16 at 224 x 224 and
ResNet-50 at 224 x 224 in eval mode (BatchNorm on running statistics). Random weights from configs,
nothing downloaded. The token embeddings of GPT-2, BERT and the Llama-width model have more than
2^24 elements (float32 cannot count their entries exactly: what the tiny configs of
tests/test_zoo.py never see).

Per model (one test class, one build, one reference per class: only one model is in memory at a
time): per-sample gradients, per-sample norms, book-keeping clipping (``gh.backward`` then
``clip_and_accumulate``) and two-pass clipping (``clipped_backward``) against the loop, with the
clipping bound ``C`` between the smallest and largest reference norm (some samples clipped, some
not). Also KFAC factors of BERT-base against factors formed here from the layers' inputs and
grad_outputs, bf16 autocast (GPT-2; the Llama width where the CPU multiplies bf16 natively) and
float16 with ``torch.amp.GradScaler`` (GPT-2) against the float32 weights' loop, and that ViT-B/16
runs without a FallbackWarning.

Precision: float64 except the Llama-width model, float32 there: its 384 M parameters are 3.1 GB
in float64, a batch-of-one backward alone peaks at 12.7 GB resident and gradhooks' per-sample
gradients (B = 2) add 6.1 GB, too much for a shared 24 GB machine. In float32 its class peaks at
10 GB resident (the whole tier at 12.5 GB: the allocator keeps some memory of earlier classes).
A class whose measured peak exceeds the memory available is skipped, saying so: the OOM killer
would end the whole session.

Eval mode everywhere: no dropout, BatchNorm on its running statistics. Marked ``scale``
(``pytest -m "not scale"`` leaves it out); runs by default.
"""
import contextlib
import math
import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # random weights from configs: never download

import pytest
import torch
import torch.nn.functional as F

import gradhooks

import zoo_imports
from conftest import DEVICES

torchvision = zoo_imports.import_torchvision()  # (before transformers: see zoo_imports)
TokensToLogits = zoo_imports.TokensToLogits
import transformers  # noqa: E402

pytestmark = pytest.mark.scale

# Bounds on max |ours - ref| relative to max |ref| of each parameter (with the floor of
# _Errors.check), and on the norms' relative error. float64: measured 2.7e-14 at most (BERT;
# T5: see T5 below); bound 1e-9, the reductions here being 768..8192 long. float32 (the Llama-width
# model): the loop's single-sample matmuls and gradhooks' batched ones round differently;
# measured 3.4e-6 at most (per-sample gradients, both clippings), bound 5e-5. A norm, a sum of
# squares of millions of positive terms, carries its terms' relative rounding: same bounds.
RTOL = {torch.float64: 1e-9, torch.float32: 5e-5}


def token_losses(out, y):
    """``(B,)``: each sample's cross entropy summed over its tokens (or its one label)."""
    b = out.shape[0]
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="none").view(b, -1).sum(1)


def token_loss(out, y):
    """The batch loss: the mean over samples of :func:`token_losses` (``loss_reduction="mean"``)."""
    return token_losses(out, y).sum() / out.shape[0]


class Spec:
    """How to build one model and its batch: ``build()`` gives the module (ids or images ->
    logits), ``dtype`` its parameters' dtype, ``rtol`` the bound of the comparisons with the
    loop (default ``RTOL[dtype]``), ``peak_gib`` the test process's peak resident memory over
    the model's tests (measured), ``kind`` its inputs (``"tokens"``: ``(B, T)`` ids
    and next-token targets, ``"label"``: ids and a class per sample, ``"image"``: ``(B, 3, 224,
    224)`` and a class of ``classes``)."""

    def __init__(self, build, kind, *, peak_gib, dtype=torch.float64, b=2, t=16, vocab=None,
                 classes=None, rtol=None):
        self.build, self.kind, self.dtype, self.b, self.t = build, kind, dtype, b, t
        self.peak_gib = peak_gib
        self.rtol = RTOL[dtype] if rtol is None else rtol
        self.vocab, self.classes = vocab, classes

    def inputs(self, generator):
        if self.kind == "image":
            x = torch.randn(self.b, 3, 224, 224, dtype=self.dtype, generator=generator)
            return x, torch.randint(0, self.classes, (self.b,), generator=generator)
        ids = torch.randint(1, self.vocab, (self.b, self.t), generator=generator)  # (0: BERT's pad)
        if self.kind == "label":
            return ids, torch.randint(0, self.classes, (self.b,), generator=generator)
        return ids, ids.roll(-1, 1)


def _gpt2():
    return TokensToLogits(transformers.GPT2LMHeadModel(transformers.GPT2Config()))


def _bert():
    return TokensToLogits(transformers.BertForSequenceClassification(transformers.BertConfig()))


def _t5():
    return TokensToLogits(transformers.T5ForConditionalGeneration(transformers.T5Config()), decoder=True)


LLAMA_CONFIG = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256, num_hidden_layers=2,
                    tie_word_embeddings=True)


def _llama():
    return TokensToLogits(transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_CONFIG)))


GPT2 = Spec(_gpt2, "tokens", peak_gib=6, vocab=50257)
BERT = Spec(_bert, "label", peak_gib=6, b=3, vocab=30522, classes=2)
# T5LayerNorm computes its variance in float32, also in a float64 model, so every gradient
# below a T5 norm carries float32 rounding of the part that flows through the variance, and
# that part is rounded as it is scaled: gradhooks' rows are B times the mean loss's batched
# grad_outputs (``e_n / B`` rounded), its ghost clipping weighs those by ``c_n``, the loop
# backpropagates ``e_n`` (or ``c_n e_n / B``) itself. Measured, B = 3: 1.1e-8 relative on every
# parameter below the decoder's final norm, 0 above it; gradhooks against the batched-forward
# reference 1.1e-8 too, and 0 with ``loss_reduction="sum"`` or B = 2 (exact scaling). A float32
# bound, not a gradhooks error.
T5 = Spec(_t5, "tokens", peak_gib=4, b=3, vocab=32128, rtol=1e-7)
LLAMA = Spec(_llama, "tokens", peak_gib=11, dtype=torch.float32, t=8, vocab=128256)
# A sparse mixture of experts at a real width: Mixtral's layout (8 experts, top-2, grouped-query
# attention) at d = 2048 with OLMoE-1B-7B's expert width (1024), one block, 192 M parameters,
# transformers' default experts implementation (torch's grouped kernel, which takes no doubles:
# float32, at the Llama-width model's bound). Routing is a top-k, a kink: the batch's routing
# margin is checked first (zoo_imports.routing_margin), so that float32 rounding
# cannot send a token to other experts in the loop than in the batch.
MIXTRAL_CONFIG = dict(hidden_size=2048, intermediate_size=1024, num_attention_heads=16,
                      num_key_value_heads=4, vocab_size=32000, num_hidden_layers=1,
                      num_local_experts=8, num_experts_per_tok=2)


def _mixtral():
    return TokensToLogits(transformers.MixtralForCausalLM(
        transformers.MixtralConfig(**MIXTRAL_CONFIG)))


MIXTRAL = Spec(_mixtral, "tokens", peak_gib=8, dtype=torch.float32, t=16, vocab=32000)
VIT = Spec(lambda: torchvision.models.vit_b_16(), "image", peak_gib=4, classes=1000)
RESNET = Spec(lambda: torchvision.models.resnet50(), "image", peak_gib=2, classes=1000)


class Case:
    """One built model in eval mode, its batch ``(x, y)``, the loop's per-sample gradient norms
    ``ref_norms`` (float64) and a clipping bound ``max_norm`` between the smallest and the
    largest of them.

    The loop's per-sample gradients are never held all at once (for the Llama-width model they
    are 3.1 GB, as much again as gradhooks' result): :meth:`loop` hands them out one sample at a
    time, and :meth:`clipped_mean` is formed by the loop of its own, sample by sample."""

    def __init__(self, spec, device="cpu"):
        torch.manual_seed(0)
        self.spec, self.dtype, self.b = spec, spec.dtype, spec.b
        self.model = spec.build().to(spec.dtype).eval().to(device)
        self.x, self.y = (t.to(device) for t in spec.inputs(torch.Generator().manual_seed(1)))
        self.names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        self.ref_norms = torch.stack([_norm(grads) for grads in self.loop()])
        lo, hi = float(self.ref_norms.min()), float(self.ref_norms.max())
        assert lo < hi, self.ref_norms
        self.max_norm = math.sqrt(lo * hi)  # some samples clipped, some not
        self._clipped = None

    def loop(self, weights=None):
        """Sample by sample (``n = 0 .. B-1``): one forward of sample ``n`` alone and a backward
        of its own loss (times ``weights[n]``); yields ``{name: gradient}`` of the parameters it
        reached, in ``model.named_parameters()`` order (the ``.grad`` tensors, dropped at the
        next sample unless ``weights`` is given, then accumulated as autograd accumulates)."""
        params = dict(self.model.named_parameters())
        self.model.zero_grad(set_to_none=True)
        try:
            for n in range(self.b):
                if weights is None:
                    self.model.zero_grad(set_to_none=True)
                loss = token_loss(self.model(self.x[n:n + 1]), self.y[n:n + 1])
                (loss if weights is None else loss * weights[n]).backward()
                yield {k: params[k].grad for k in self.names if params[k].grad is not None}
        finally:
            self.model.zero_grad(set_to_none=True)

    def clipped_mean(self):
        """The loop's clipped mean ``{name: sum_n min(1, C / ||g_n||) g_n / B}``: sample ``n``'s
        own loss backpropagated with weight ``min(1, C / ||g_n||) / B``, accumulated. Formed
        on first use and kept for the class."""
        if self._clipped is None:
            factors = (self.max_norm / self.ref_norms).clamp(max=1.0) / self.b
            for grads in self.loop(weights=factors.tolist()):
                pass
            self._clipped = grads
        return self._clipped

    def params(self):
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}


def _available_gib():
    """The kernel's estimate of the memory available without swapping (``MemAvailable`` of
    /proc/meminfo), in GiB; ``None`` where there is no /proc/meminfo."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2 ** 20
    except OSError:
        pass
    return None


def _norm(grads):
    """float64 L2 norm over a sample's gradients ``{name: tensor}``."""
    return sum(g.double().square().sum() for g in grads.values()).sqrt()


def _max_abs(t, other=None, chunk=1 << 24):
    """max |t - other| (or max |t|) without a temporary of t's size (embeddings of 1 GB); in
    float64 where the dtypes differ."""
    t = t.reshape(-1)
    other = None if other is None else other.reshape(-1)
    out = 0.0
    for i in range(0, t.numel(), chunk):
        if other is None:
            d = t[i:i + chunk]
        elif t.dtype == other.dtype:
            d = t[i:i + chunk] - other[i:i + chunk]
        else:
            d = t[i:i + chunk].double() - other[i:i + chunk].double()
        out = max(out, float(d.abs().max()))
    return out


class _Errors:
    """Per parameter, max |ours - ref| and max |ref| over the pieces compared (the samples of a
    per-sample result, one by one)."""

    def __init__(self):
        self.diff, self.scale = {}, {}

    def add(self, ours, ref):
        """``ours``, ``ref``: ``{name: tensor}`` of the same keys, shapes and dtypes."""
        assert list(ours) == list(ref), (list(ours), list(ref))
        for name, r in ref.items():
            assert ours[name].shape == r.shape, (name, ours[name].shape, r.shape)
            assert ours[name].dtype == r.dtype, (name, ours[name].dtype, r.dtype)
            self.diff[name] = max(self.diff.get(name, 0.0), _max_abs(ours[name], r))
            self.scale[name] = max(self.scale.get(name, 0.0), _max_abs(r))
        return self

    def check(self, rtol):
        """max |ours - ref| <= rtol * max(max |ref|, floor) per parameter. The floor, 1e-4 of the
        largest entry of any parameter, is for gradients that vanish in exact arithmetic (a key
        projection's bias before a softmax: the loop's own rounding is all there is)."""
        floor = 1e-4 * max(self.scale.values())
        off = [f"{n}: max diff {d:.3e} vs scale {max(self.scale[n], floor):.3e}"
               for n, d in self.diff.items() if d > rtol * max(self.scale[n], floor)]
        assert not off, f"{len(off)} of {len(self.diff)} parameters off:\n" + "\n".join(off[:20])


def _check_clipped(case, want, rtol):
    """``param.grad`` is ``want``, the loop's clipped mean (parameters no sample reached: 0)."""
    got = {n: p.grad for n, p in case.params().items()}
    for n in set(got) - set(want):
        assert not bool(got[n].any()), n
    _Errors().add({n: got[n] for n in want}, want).check(rtol)


@contextlib.contextmanager
def _attached(case, **kwargs):
    """``gradhooks.attach(case.model, **kwargs)`` (the defaults: sum check on); on exit the
    hooks are detached and every ``.grad`` dropped (the next test starts clean, memory freed)."""
    gh = gradhooks.attach(case.model, **kwargs)
    try:
        yield gh
    finally:
        gh.detach()
        case.model.zero_grad(set_to_none=True)


@contextlib.contextmanager
def _float32(model):
    """The model in float32 for the block, then back in its dtype. The configs initialise in
    float32, so float64 -> float32 -> float64 is exact: the tests after it see the same
    weights."""
    dtype = next(model.parameters()).dtype
    model.float()
    try:
        yield
    finally:
        model.to(dtype)


class _Tier:
    """The tests every model gets; a subclass per model sets ``spec``."""

    spec = None

    @pytest.fixture(scope="class", params=DEVICES)
    @classmethod
    def case(cls, request):
        """The model on each device of ``conftest.DEVICES`` (on CUDA with TF32 off: float32
        verdicts at float32's precision), built once per class and device."""
        available = _available_gib()
        if available is not None and available < cls.spec.peak_gib:
            if os.environ.get("GRADHOOKS_REQUIRE_SCALE"):  # .ci/run: the tier must run there
                pytest.fail(f"the real-size tier needs about {cls.spec.peak_gib} GiB of memory, "
                            f"{available:.1f} GiB available (GRADHOOKS_REQUIRE_SCALE is set)")
            pytest.skip(f"needs about {cls.spec.peak_gib} GiB of memory, {available:.1f} GiB "
                        f"available: the kernel's OOM killer would end the whole test session")
        if request.param != "cuda":
            yield Case(cls.spec)
            return
        flags = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
        try:
            yield Case(cls.spec, "cuda")
        finally:
            torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = flags

    def test_per_sample_grads(self, case):
        """``gh.backward(loss)``, then ``per_sample_grads()`` equal the loop's."""
        with _attached(case) as gh:
            gh.backward(token_loss(case.model(case.x), case.y))
            ours = gh.per_sample_grads()
            assert all(p.grad_sample is ours[n] for n, p in case.params().items() if n in ours)
        errors = _Errors()
        for n, ref in enumerate(case.loop()):
            errors.add({k: ours[k][n] for k in ours}, ref)
        errors.check(case.spec.rtol)

    def test_per_sample_grad_norms(self, case):
        """``loss.backward()``, then the norms (Gram forms, no per-sample tensor where
        cheaper) equal the loop's (float64 norms)."""
        with _attached(case) as gh:
            token_loss(case.model(case.x), case.y).backward()
            norms = gh.per_sample_grad_norms()
        assert norms.shape == (case.b,)
        torch.testing.assert_close(norms.double(), case.ref_norms, rtol=case.spec.rtol, atol=0)

    def test_bookkeeping_clipping(self, case):
        """``gh.backward(loss)`` then ``clip_and_accumulate(C)``: ``param.grad`` is the loop's
        ``sum_n min(1, C / ||g_n||) g_n / B`` and the returned norms are the loop's."""
        want = case.clipped_mean()
        with _attached(case) as gh:
            gh.backward(token_loss(case.model(case.x), case.y))
            norms = gh.clip_and_accumulate(case.max_norm)
            _check_clipped(case, want, case.spec.rtol)
        torch.testing.assert_close(norms.double(), case.ref_norms, rtol=case.spec.rtol, atol=0)

    def test_two_pass_clipping(self, case):
        """``clipped_backward(per-sample losses, C)``: the same ``param.grad`` and norms."""
        want = case.clipped_mean()
        with _attached(case) as gh:
            norms = gh.clipped_backward(token_losses(case.model(case.x), case.y), case.max_norm)
            _check_clipped(case, want, case.spec.rtol)
        torch.testing.assert_close(norms.double(), case.ref_norms, rtol=case.spec.rtol, atol=0)


# Mixed precision, against the loop of the float32 weights (for GPT-2: the float64 loop of the
# same weights, which are float32 values; the two loops differ by float32 rounding, 1e-6,
# nothing next to these bounds).
#
# bf16 keeps 8 significant bits (unit roundoff 2^-9 = 2e-3): autocast rounds each matmul's
# inputs and output to bf16, the records (activations, grad_outputs) are those bf16 tensors,
# and every gradient, autograd's own batch gradient as much as gradhooks' per-sample ones,
# carries the bf16 forward's and backward's error. Measured (largest error of the clipped
# mean relative to its largest entry): autograd's bf16 backward of ``sum_n c_n l_n / B``
# against the float32 loop 8.0e-3 (GPT-2) and 1.1e-2 (Llama-width, the tied embedding);
# gradhooks' book-keeping clipping 9.0e-3 and 1.2e-2, its norms 7e-4 and 3e-4 relative. Bound:
# 5e-2, 4x autograd's own bf16 error and far below what a wrong scale (B, S), a dropped sample
# or a dropped use of a tied weight gives (order 1).
RTOL_BF16 = 5e-2
# float16 keeps 11 bits (unit roundoff 2^-12 = 2.4e-4), 8x finer. Measured on GPT-2: norms
# 1e-4 relative, clipped mean 1.0e-3 of its largest entry. Bound 1e-2.
RTOL_F16 = 1e-2


def _assert_mixed_close(got, case, rtol):
    """Clipped gradients within ``rtol`` of the largest entry of the loop's (one scale for
    the model: mixed precision's error is relative to the activations, not to each
    parameter's own gradient)."""
    want = case.clipped_mean()
    scale = max(_max_abs(w) for w in want.values())
    off = {n: _max_abs(got[n], w) / scale for n, w in want.items()}
    worst = max(off, key=off.get)
    assert off[worst] <= rtol, f"{worst}: {off[worst]:.3e} of the largest entry"


def _bf16_autocast_norms_and_clipping(case):
    case.clipped_mean()  # (the loop's, of the model as built: before the conversion)
    with _float32(case.model), _attached(case) as gh:
        with torch.autocast(case.x.device.type, dtype=torch.bfloat16):
            out = case.model(case.x)
        assert out.dtype == torch.bfloat16
        gh.backward(token_loss(out.float(), case.y))
        norms = gh.per_sample_grad_norms()
        torch.testing.assert_close(norms.double(), case.ref_norms, rtol=RTOL_BF16, atol=0)
        clip_norms = gh.clip_and_accumulate(case.max_norm)
        torch.testing.assert_close(clip_norms, norms, rtol=1e-6, atol=0)
        _assert_mixed_close({n: p.grad for n, p in case.params().items()}, case, RTOL_BF16)


def _cpu_autocast_supports(dtype):
    """Whether CPU autocast runs a Linear in ``dtype`` here (an unsupported dtype only warns
    and disables autocast)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autocast("cpu", dtype=dtype):
            return F.linear(torch.ones(2, 2), torch.ones(2, 2)).dtype == dtype


class TestGPT2Small(_Tier):
    spec = GPT2

    def test_per_sample_grad_norms_batch_of_one(self, case):
        """B = 1: the norm of the one sample (its loss is the batch loss)."""
        with _attached(case) as gh:
            gh.backward(token_loss(case.model(case.x[:1]), case.y[:1]))
            norms = gh.per_sample_grad_norms()
        torch.testing.assert_close(norms.double(), case.ref_norms[:1], rtol=case.spec.rtol, atol=0)

    def test_bf16_autocast_norms_and_clipping(self, case):
        _bf16_autocast_norms_and_clipping(case)

    def test_float16_grad_scaler_norms_and_clipping(self, case):
        """float16 autocast, ``scaler.scale(loss).backward()``: norms of the unscaled loss;
        ``clip_and_accumulate`` writes ``S`` times the clipped mean into ``.grad`` (for
        ``scaler.step``)."""
        device = case.x.device.type
        if device == "cpu" and not _cpu_autocast_supports(torch.float16):
            pytest.skip("CPU autocast does not run float16 matmuls with this torch / CPU")
        scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 12)
        scale = float(scaler.get_scale())
        case.clipped_mean()  # (the loop's, of the model as built: before the conversion)
        with _float32(case.model), _attached(case, grad_scaler=scaler) as gh:
            with torch.autocast(device, dtype=torch.float16):
                out = case.model(case.x)
            assert out.dtype == torch.float16
            scaler.scale(token_loss(out.float(), case.y)).backward()
            norms = gh.per_sample_grad_norms()
            torch.testing.assert_close(norms.double(), case.ref_norms, rtol=RTOL_F16, atol=0)
            gh.clip_and_accumulate(case.max_norm)
            got = {n: p.grad / scale for n, p in case.params().items()}
            assert all(bool(torch.isfinite(g).all()) for g in got.values())
            _assert_mixed_close(got, case, RTOL_F16)


class TestBertBase(_Tier):
    spec = BERT

    def test_kfac_factors(self, case):
        """KFAC-expand factors (conventions: gradhooks/readers/curvature/kfac.py) of a query projection, the last
        feed-forward input layer, the classifier and the word embedding, against factors formed
        here from each layer's input ``a`` and grad_output (``w e``, ``w = 1/B``):
        ``A = ã^T ã / (B R)`` (``ã = [a, 1]``, ``R`` tokens per sample; for the embedding the
        diagonal: the share of each index), ``G = w sum e e^T = B sum go go^T``."""
        names = ["model.bert.embeddings.word_embeddings",
                 "model.bert.encoder.layer.0.attention.self.query",
                 "model.bert.encoder.layer.11.intermediate.dense", "model.classifier"]
        modules = dict(case.model.named_modules())
        seen = {}

        def record(name):
            def forward_hook(module, inputs, output):
                seen[name] = {"a": inputs[0].detach()}
                output.register_hook(lambda g: seen[name].__setitem__("go", g.detach()))
            return forward_hook

        with _attached(case) as gh:
            handles = [modules[n].register_forward_hook(record(n)) for n in names]
            try:
                gh.backward(token_loss(case.model(case.x), case.y))
            finally:
                for h in handles:
                    h.remove()
            factors = gh.kfac_factors(modules=names)
        assert set(factors) == set(names), list(factors)
        b = case.b
        for name in names:
            a, go = seen[name]["a"], seen[name]["go"]
            f = factors[name]
            go = go.reshape(-1, go.shape[-1])
            want_g = b * go.T @ go
            if name.endswith("word_embeddings"):
                assert f.diagonal_A and f.bias is None
                want_a = torch.bincount(a.reshape(-1), minlength=modules[name].num_embeddings)
                want_a = want_a.to(go.dtype) / a.numel()
            else:
                a = a.reshape(-1, a.shape[-1])
                a = torch.cat([a, torch.ones_like(a[:, :1])], 1)  # (B R, d_in + 1)
                want_a = a.T @ a / a.shape[0]
            for got, want, what in ((f.A, want_a, "A"), (f.G, want_g, "G")):
                assert got.shape == want.shape, (name, what, got.shape, want.shape)
                scale = float(want.abs().max())
                diff = float((got - want).abs().max())
                assert diff <= case.spec.rtol * scale, f"{name}.{what}: {diff:.3e} vs {scale:.3e}"


class TestT5Small(_Tier):
    spec = T5


def _cpu_has_bf16_matmul():
    """Whether the CPU multiplies bfloat16 natively (``avx512_bf16`` or ``amx_bf16`` in
    /proc/cpuinfo's flags). Without them torch's CPU bf16 ``mm`` takes a slow path: measured on
    an AVX2-only AMD EPYC, one plain bf16-autocast step of the Llama-width model takes 129 s
    against 5.5 s in float32 (every one of its 45 matmuls about 3 s)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(f.read().split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})


class TestLlamaWidth(_Tier):
    spec = LLAMA

    def test_bf16_autocast_norms_and_clipping(self, case):
        """bf16 autocast at the Llama width, where the CPU multiplies bf16 natively (or on
        CUDA). GPT-2 small's test of the same name runs bf16 at real size everywhere (its tied
        50257 x 768 embedding, also more than 2^24 entries)."""
        if case.x.device.type == "cpu" and not _cpu_has_bf16_matmul():
            pytest.skip("this CPU has no native bf16 matmul (avx512_bf16 / amx_bf16): torch's "
                        "bf16 matmuls take about 3 s each at this width, the test 7 minutes "
                        "(GPT-2 small's bf16 test runs here)")
        _bf16_autocast_norms_and_clipping(case)


class TestMixtralWidth(_Tier):
    spec = MIXTRAL

    def test_routing_is_far_from_a_tie(self, case):
        """The premise of the float32 comparisons: no token of the batch has its k-th and
        (k+1)-th router probabilities within 1e-5 (float32 rounds them at about 1e-7)."""
        assert zoo_imports.routing_margin(case.model, case.x) > 1e-5


class TestViTB16(_Tier):
    spec = VIT

    def test_vit_runs_without_fallback_warning(self, case):
        """Attaching and running vit_b_16 (one sample; its norm the loop's) warns no
        FallbackWarning: its raw parameters (``class_token``, ``encoder.pos_embedding``) are
        priced at their own ops, nothing is replayed."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gh = gradhooks.attach(case.model)
            try:
                gh.backward(token_loss(case.model(case.x[:1]), case.y[:1]))
                norms = gh.per_sample_grad_norms()
            finally:
                gh.detach()
        fallback = [str(w.message) for w in caught if issubclass(w.category, gradhooks.FallbackWarning)]
        assert not fallback, fallback
        torch.testing.assert_close(norms.double(), case.ref_norms[:1], rtol=case.spec.rtol, atol=0)


class TestResNet50Eval(_Tier):
    spec = RESNET
