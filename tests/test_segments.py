"""Factored per-sample gradients of grouped products (gradhooks.base.segments): every read of a
:class:`Segments` (formed, scaled, norms, weighted sum, probe values, sums of several) against
the definition ``out[n, e] = sum_{r: key[r] = n E + e} u[r] v[r]^T`` formed row by row in
float64, over batch sizes 0, 1 and several, segments empty and skewed, rows in runs or shuffled,
and the loop and grouped-kernel contractions."""
import pytest
import torch

from gradhooks.base import segments
from gradhooks.base._pool import BufferPool, using_pool
from gradhooks.base.segments import Segments, segment_outer

E, U, V = 4, 6, 5


def reference(u, v, key, size, groups):
    """``(size, groups, U, V)`` (``(size, groups, U)`` for ``v=None``), row by row in float64."""
    shape = (size, groups, u.shape[1]) + (() if v is None else (v.shape[1],))
    out = torch.zeros(shape, dtype=torch.float64)
    for r in range(u.shape[0]):
        n, e = divmod(int(key[r]), groups)
        term = u[r].double() if v is None else torch.outer(u[r].double(), v[r].double())
        out[n, e] += term
    return out


def rows(size, dtype, layout, seed=0, count=None):
    g = torch.Generator().manual_seed(seed)
    count = 7 * size if count is None else count
    # skewed: most rows in a few segments, some segments empty
    weights = torch.rand(size * E, generator=g) ** 4 + 1e-3
    key = (torch.multinomial(weights, count, replacement=True, generator=g)
           if size and count else torch.zeros(0, dtype=torch.int64))
    if layout == "runs":  # each segment's rows together, segments in no particular order
        rank = torch.randperm(size * E, generator=g)
        key = key[torch.argsort(rank[key], stable=True)]
    u = torch.randn(count, U, generator=g, dtype=dtype)
    v = torch.randn(count, V, generator=g, dtype=dtype)
    return u, v, key


def tol(dtype):
    return dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("size", [0, 1, 3])
@pytest.mark.parametrize("layout", ["runs", "shuffled"])
@pytest.mark.parametrize("loop", [True, False])
def test_reads_match_definition(dtype, size, layout, loop, monkeypatch, device):
    """On each device of ``conftest.DEVICES`` (off the CPU the reads take their padded,
    one-kernel forms)."""
    if not loop:  # (the grouped kernel, or the padded product, instead of one mm per segment)
        monkeypatch.setattr(segments, "LOOP_KEYS", 0)
    u, v, key = rows(size, dtype, layout)
    ref = reference(u, v, key, size, E).to(device)
    u, v, key = u.to(device), v.to(device), key.to(device)
    seg = Segments(u, v, key, size, (E, U, V))
    assert seg.shape == ref.shape and seg.dtype == dtype and not seg.requires_grad
    torch.testing.assert_close(seg.dense().double(), ref, **tol(dtype))
    torch.testing.assert_close(seg.dense(2.5).double(), 2.5 * ref, **tol(dtype))
    flat = ref.flatten(1)
    torch.testing.assert_close(seg.sq_norms().double(), flat.square().sum(1), **tol(dtype))
    torch.testing.assert_close(seg.sq_norms(padded=True).double(), flat.square().sum(1),
                               **tol(dtype))  # (the form used off the CPU)
    c = torch.linspace(0.5, 2.0, size, dtype=dtype, device=device)
    torch.testing.assert_close(seg.weighted(c).double(),
                               torch.einsum("n,n...->...", c.double(), ref), **tol(dtype))
    torch.testing.assert_close(seg.weighted().double(), ref.sum(0), **tol(dtype))
    idx = torch.tensor([0, 7, E * U * V - 1, U * V + 3, 2 * U * V], device=device)
    torch.testing.assert_close(seg.at(idx).double(), flat[:, idx], **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("size", [0, 1, 3])
def test_bias_segments(dtype, size):
    u, _, key = rows(size, dtype, "shuffled", seed=1)
    seg = Segments(u, None, key, size, (E, U))
    ref = reference(u, None, key, size, E)
    torch.testing.assert_close(seg.dense().double(), ref, **tol(dtype))
    torch.testing.assert_close(seg.sq_norms().double(), ref.flatten(1).square().sum(1),
                               **tol(dtype))
    c = torch.arange(size, dtype=dtype) + 1
    torch.testing.assert_close(seg.weighted(c).double(),
                               torch.einsum("n,n...->...", c.double(), ref), **tol(dtype))
    idx = torch.tensor([0, U + 1, E * U - 1])
    torch.testing.assert_close(seg.at(idx).double(), ref.flatten(1)[:, idx], **tol(dtype))


def test_sums_concatenate_rows_and_add_to_tensors():
    u1, v1, k1 = rows(3, torch.float64, "shuffled", seed=2)
    u2, v2, k2 = rows(3, torch.float64, "runs", seed=3, count=5)
    a, b = Segments(u1, v1, k1, 3, (E, U, V)), Segments(u2, v2, k2, 3, (E, U, V))
    both = a + b
    assert isinstance(both, Segments) and both.u.shape[0] == u1.shape[0] + 5
    ref = reference(u1, v1, k1, 3, E) + reference(u2, v2, k2, 3, E)
    torch.testing.assert_close(both.dense(), ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(both.sq_norms(), ref.reshape(3, -1).square().sum(1))
    t = torch.randn(3, E, U, V, dtype=torch.float64)
    torch.testing.assert_close(a + t, reference(u1, v1, k1, 3, E) + t)
    torch.testing.assert_close(t + a, reference(u1, v1, k1, 3, E) + t)


def test_dense_reuses_a_free_pooled_buffer():
    u, v, key = rows(64, torch.float32, "shuffled", seed=4, count=4096)
    u = torch.randn(4096, 256)
    seg = Segments(u, torch.randn(4096, 128), key, 64, (E, 256, 128))
    assert seg.shape.numel() * 4 >= BufferPool.MIN_BYTES
    pool = BufferPool()
    first = seg.dense()
    ptr = first.data_ptr()
    pool.give([first])
    del first
    with using_pool(pool):
        again = seg.dense()
    assert again.data_ptr() == ptr  # (formed into the free buffer: no fresh pages)
    torch.testing.assert_close(again, seg.dense(), rtol=0, atol=0)


def test_segment_outer_keys_beyond_rows():
    # keys past the last row's get zeros, on every contraction path
    u, v = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    key = torch.tensor([4, 0, 4, 2, 0])
    ref = torch.zeros(7, 3, 2, dtype=torch.float64)
    for r in range(5):
        ref[key[r]] += torch.outer(u[r], v[r])
    torch.testing.assert_close(segment_outer(u, v, key, 7), ref)
    out = torch.full((7, 3, 2), float("nan"), dtype=torch.float64)
    torch.testing.assert_close(segment_outer(u, v, key, 7, out=out), ref)
