"""Shared test helpers: an independent looped-autograd reference and the tolerance check.

The loop here deliberately does not use gradhooks.looped_per_sample_grads, so the library's own
reference is tested against it as well.
"""
import os
import warnings

import pytest
import torch

import gradhooks


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``make test``: one worker per core, ``--dist loadgroup``) the
    real-size tier (``scale`` marker) runs in one worker, one model at a time (two real-size
    models side by side would double its peak memory), and is collected first."""
    scale = [item for item in items if item.get_closest_marker("scale") is not None]
    for item in scale:
        item.add_marker(pytest.mark.xdist_group("scale"))
    # the group first: its one worker works through it while the others take the rest, instead
    # of one worker running it alone at the end
    items[:] = scale + [item for item in items if item.get_closest_marker("scale") is None]


@pytest.hookimpl(tryfirst=True)  # before any fixture is set up (a real-size model)
def pytest_runtest_setup(item):
    """Fail a grouped test that pytest-xdist ran outside its group: under ``--dist loadgroup`` it
    marks a grouped test by a ``@group`` suffix of its node id, which pytest 9.2 no longer lets
    it write (pytest-dev/pytest-xdist#1386). Without the group the real-size tier spreads over
    every worker, two real-size models share the memory and the tier fails for want of it."""
    if (getattr(item.config.option, "loadgroup", False)  # (set on xdist's workers)
            and item.get_closest_marker("xdist_group") is not None and "@" not in item.nodeid):
        pytest.fail(f"pytest-xdist ignored this test's xdist_group: this pytest ({pytest.__version__}) "
                    "does not let pytest-xdist mark groups in node ids (pytest-dev/pytest-xdist#1386). "
                    "Install the test extra's pytest (setup.cfg: pytest<9.2), or run without -n.")


# Relative error bounds, relative to the largest entry of the reference (the criterion).
RTOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def weighted_square_loss(reduction="mean", batch_dim=0):
    """loss = reduce_n( w_n * sum(out_n ** 2) ): nonlinear, and every sample weighs differently.

    ``targets`` is the per-sample weight ``w``, shape ``(B,)``; ``out`` is batched on
    ``batch_dim``. Returns the loss reduced over samples by ``reduction``.
    """
    def loss_fn(out, w):
        shape = [1] * out.dim()
        shape[batch_dim] = -1
        total = (w.view(shape) * out ** 2).sum()
        return total / out.shape[batch_dim] if reduction == "mean" else total
    return loss_fn


def looped_by(model, b, sample_loss):
    """Reference per-sample gradients of a forward and loss the test writes out per sample:
    ``sample_loss(i)`` (sample ``i``'s loss, computed alone) backward, one per sample.

    Returns {name: (b, *shape)} for every parameter (each needs a gradient)."""
    grads = {n: [] for n, _ in model.named_parameters()}
    for i in range(b):
        model.zero_grad()
        sample_loss(i).backward()
        for n, p in model.named_parameters():
            grads[n].append(p.grad.clone())
    return {n: torch.stack(g) for n, g in grads.items()}


def loop_grads(model, loss_fn, x, y, batch_dim=0):
    """Reference per-sample gradients: one forward + loss.backward() per sample.

    Returns {name: (B, *shape)} for trainable parameters the backward reached.
    """
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    b = x.shape[batch_dim]
    out = {n: [None] * b for n in params}
    for i in range(b):
        for p in params.values():
            p.grad = None
        xi = x.narrow(batch_dim, i, 1)
        yi = y.narrow(0, i, 1)
        loss_fn(model(xi), yi).backward()
        for n, p in params.items():
            out[n][i] = p.grad
    for p in params.values():
        p.grad = None
    res = {}
    for n, gs in out.items():
        if all(g is None for g in gs):
            continue
        res[n] = torch.stack([torch.zeros_like(params[n]) if g is None else g for g in gs])
    return res


def _log_error(name, dtype, diff, scale):
    # GRADHOOKS_ERRLOG=path: append "test<TAB>param<TAB>dtype<TAB>relative error" per comparison
    # (how the README's largest-error column is measured).
    path = os.environ.get("GRADHOOKS_ERRLOG")
    if path:
        with open(path, "a") as f:
            rel = float(diff / scale) if scale > 0 else float(diff)
            f.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?')}\t{name}\t{dtype}\t{rel:.3e}\n")


def assert_close_to_loop(ours, ref, dtype):
    """Same keys, same shapes, max|diff| <= RTOL[dtype] * max|ref| for every parameter."""
    assert list(ours) == list(ref), (list(ours), list(ref))
    for name in ref:
        assert ours[name].shape == ref[name].shape, name
        assert ours[name].dtype == ref[name].dtype, name
        scale = ref[name].abs().max()
        diff = (ours[name] - ref[name]).abs().max()
        _log_error(name, dtype, diff, scale)
        assert diff <= RTOL[dtype] * scale, f"{name}: max diff {diff:.3e} vs max |ref| {scale:.3e}"


def check_against_loop(model, x, y, *, loss_reduction, dtype, batch_first=True, loss_fn=None):
    """Attach, run one batch, and compare per_sample_grads() with the loop."""
    batch_dim = 0 if batch_first or x.dim() < 3 else 1
    loss_fn = loss_fn or weighted_square_loss(loss_reduction, batch_dim)
    model = model.to(dtype)
    x = x.to(dtype)
    y = y.to(dtype) if y.is_floating_point() else y
    ref = loop_grads(model, loss_fn, x, y, batch_dim)
    with gradhooks.attach(model, loss_reduction=loss_reduction, batch_first=batch_first) as gh:
        loss_fn(model(x), y).backward()
        ours = gh.per_sample_grads()
        for name, p in model.named_parameters():
            if name in ours:
                assert p.grad_sample is ours[name]
    assert_close_to_loop(ours, ref, dtype)
    return ours


def check_against_loop_or_empty(model, x, w, *, loss_reduction, dtype):
    """:func:`check_against_loop` with :func:`weighted_square_loss`; for an empty batch (no
    loop to compare with) the per-sample gradients must be empty, of the right shapes."""
    if x.shape[0]:
        check_against_loop(model, x, w, loss_reduction=loss_reduction, dtype=dtype)
        return
    model = model.to(dtype)
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        weighted_square_loss("sum")(model(x.to(dtype)), w.to(dtype)).backward()
        out = gh.per_sample_grads()
    assert {n: t.shape for n, t in out.items()} == {
        n: (0, *p.shape) for n, p in model.named_parameters()}


def check_weighted_sum(rule, make, x_shape, batch, dtype):
    """``rule.weighted_sum`` (``sum_n c_n dW_n``) of the module ``make()`` on a random input
    ``(batch, *x_shape)`` and grad_output against the weighted sum of the looped per-sample
    gradients in float64, to ``RTOL[dtype]`` of its largest entry; an empty batch gives zeros."""
    model = make().to(dtype)
    x = torch.randn(batch, *x_shape, dtype=dtype)
    g = torch.randn_like(model(x))
    c = torch.rand(batch, dtype=dtype) + 0.1
    names = [n for n, _ in model.named_parameters()]
    got = rule.weighted_sum(model, x, g, c, True, names)
    assert got["weight"].shape == model.weight.shape and got["weight"].dtype == dtype
    if batch == 0:
        assert all(t.abs().max() == 0 for t in got.values() if t.numel())
        return
    # looped reference: the gradient of sum(y_n * g_n) for sample n alone, in float64
    ref_model = make().double()
    ref_model.load_state_dict(model.state_dict())
    ref = loop_grads(ref_model, lambda out, gg: (out * gg).sum(), x.double(), g.double())
    for n in names:
        expected = torch.tensordot(c.double(), ref[n], 1)
        diff = (got[n].double() - expected).abs().max()
        assert diff <= RTOL[dtype] * expected.abs().max(), f"{n}: {diff:.3e}"


@pytest.fixture(params=[torch.float64, torch.float32], ids=["f64", "f32"])
def dtype(request):
    return request.param


#: The devices of the device-parametrized tests (the ``device`` fixture): the CPU, and CUDA where
#: a GPU is there. Without one the ``cuda`` variants are not generated, and
#: ``tests/test_cuda.py::test_cuda_variants_are_generated`` skips saying so (one skip, not one per
#: variant).
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    """``torch.device`` of each of :data:`DEVICES`. On CUDA, TF32 is off for the test (cuDNN's
    convolutions and RNNs round float32 operands to 10 bits by default, and so would the loop's
    reference): float32 verdicts there are float32's. ``tests/test_cuda.py`` checks torch's
    TF32 defaults separately."""
    if request.param != "cuda":
        yield torch.device(request.param)
        return
    flags = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield torch.device("cuda")
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = flags


@pytest.fixture(params=["mean", "sum"])
def loss_reduction(request):
    return request.param


@pytest.fixture(params=["kept", "summarised"])
def grad_totals(request, monkeypatch):
    """How the sum check holds autograd's parameter gradients: whole (parameters below
    GradTotal.SUMMARISE elements), or reduced to probes and a projection at once (larger ones;
    forced here for every parameter)."""
    if request.param == "summarised":
        from gradhooks.core.recorder.totals import GradTotal
        monkeypatch.setattr(GradTotal, "SUMMARISE", 1)
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    # The suite's tensors are tiny: intra-op threads only spin against each other (and against
    # other processes on a shared 2-core machine), several-fold slower than one thread.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _no_leaked_provenance():
    """Every test leaves torch's function-mode stack as it found it: gradhooks' provenance mode
    (gradhooks.core.analysis.provenance) lives only inside an attached model's forward."""
    yield
    leaked = torch._C._len_torch_function_stack()
    while torch._C._len_torch_function_stack():
        torch._C._pop_torch_function_stack()
    assert leaked == 0, f"{leaked} torch function mode(s) left active"


def check_model(model, x, y, loss=None, dtype=torch.float64):
    """Per-sample gradients and norms of ``model`` (default attach, default call) equal the
    loop's (1e-10 of the largest entry in float64, 1e-5 in float32; a floor of 1e-4 of the
    model's largest entry for gradients that vanish in exact arithmetic: key biases)."""
    loss = loss or torch.nn.functional.cross_entropy
    ref = loop_grads(model, loss, x, y)
    norms = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in ref.values()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gradhooks.FallbackWarning)
        gh = gradhooks.attach(model)
    try:
        loss(model(x), y).backward()
        torch.testing.assert_close(gh.per_sample_grad_norms(), norms,
                                   rtol=1e-9 if dtype == torch.float64 else 1e-4, atol=0)
        got = gh.per_sample_grads()
        floor = 1e-4 * max(r.abs().max() for r in ref.values())
        assert list(got) == list(ref)
        tol = 1e-10 if dtype == torch.float64 else 1e-5
        for name, r in ref.items():
            scale = max(r.abs().max(), floor)
            diff = (got[name] - r).abs().max()
            assert diff <= tol * scale, f"{name}: max diff {diff:.3e} vs scale {scale:.3e}"
    finally:
        gh.detach()
