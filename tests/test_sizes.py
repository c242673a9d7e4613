"""Indices, counts and sums at the sizes of pretrained models: nothing passes through float32.

The sum check's probe coordinates were a float32 ``linspace``: above ``2**24`` elements (every
word embedding of a pretrained-size language model) the last index rounded to ``numel`` and the
first backward raised ``IndexError``. A float32 ``vector_norm`` over 10^8 values was percents low.
"""
import pytest
import torch

from gradhooks.base.forms import SQ_NORM_CHUNK, sq_norms
from gradhooks.core.recorder.totals import SUM_CHECK_PROBES, GradTotal, _probe_index


@pytest.mark.parametrize("numel", [257, 2**24 - 1, 2**24 + 1, 2**24 + 3, 50257 * 768,
                                   128256 * 2048, 2**40 + 7])
def test_probe_indices_are_exact_integers(numel):
    idx = _probe_index(numel, SUM_CHECK_PROBES, torch.device("cpu"))
    assert idx.dtype == torch.int64 and idx.shape == (SUM_CHECK_PROBES,)
    assert int(idx[0]) == 0 and int(idx[-1]) == numel - 1
    assert bool((idx[1:] > idx[:-1]).all())
    want = [k * (numel - 1) // (SUM_CHECK_PROBES - 1) for k in range(SUM_CHECK_PROBES)]
    assert idx.tolist() == want


def test_grad_total_of_a_parameter_above_2_24_elements():
    """The summary of a gradient past float32's integer range reads its last element."""
    n = 2**24 + 3
    grad = torch.arange(n, dtype=torch.float64).view(-1, 1)  # 2-D: projection and norm too
    total = GradTotal(grad)
    idx = total.probe_index()
    assert int(idx[-1]) == n - 1
    assert torch.equal(total.probe_values(), idx.to(torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sq_norms_accumulate_long_rows_beyond_their_dtype(dtype):
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(2, 16 * SQ_NORM_CHUNK + 5, generator=gen).to(dtype)
    want = t.double().square().sum(1)
    got = sq_norms(t, 1)
    assert got.dtype == dtype
    rtol = 1e-6 if dtype == torch.float32 else 1e-2  # bfloat16: the result's own rounding
    assert ((got.double() - want).abs() / want).max() <= rtol
    assert torch.equal(sq_norms(t[:, :100], 1), torch.linalg.vector_norm(t[:, :100], dim=1).square())
