"""Projected per-sample gradients (LoGra) against the looped per-sample gradients projected by
the same matrices (P_g dW_n P_a^T for linear layers, R vec(d theta_n) for the others)."""
import pytest
import torch
from test_ggn import MODELS, close
from test_gram import CASES, _loss

import gradhooks
from gradhooks.readers.attribution.projections import projection

from conftest import loop_grads


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_projected_loop(case, dtype):
    torch.manual_seed(0)
    make, data = CASES[case]
    model = make().to(dtype)
    x = data(4)
    x = x.to(dtype) if x.is_floating_point() else x
    y = torch.randint(0, {"tied": 3, "lm": 7}.get(case, 4), (4,))
    loss_fn = _loss(case)
    ref = loop_grads(model, lambda o, t: loss_fn(o, t), x, y)
    modules = dict(model.named_modules())
    with gradhooks.attach(model) as gh:
        loss_fn(model(x), y).backward()
        feats = gh.gradient_features()
        ours = gh.projected_grads(k_in=3, k_out=2, seed=7)
        assert torch.equal(ours, gh.projected_grads(k_in=3, k_out=2, seed=7))
        assert not torch.allclose(ours, gh.projected_grads(k_in=3, k_out=2, seed=8))
    parts = []
    for path in feats.linear:
        m = modules[path]
        w = ref[f"{path}.weight" if path else "weight"].flatten(2)
        mat = torch.cat([w, ref[f"{path}.bias"][..., None]], -1) if m.bias is not None else w
        pa = projection(path, "a", 3, mat.shape[-1], 7, dtype)
        pg = projection(path, "g", 2, mat.shape[-2], 7, dtype)
        parts.append((pg @ mat @ pa.t()).flatten(1))
    for name in feats.dense:
        flat = ref[name].flatten(1)
        parts.append(flat @ projection(name, "dense", 6, flat.shape[1], 7, dtype).t())
    expected = torch.cat(parts, 1)
    assert ours.shape == expected.shape == (4, 6 * (len(feats.linear) + len(feats.dense)))
    close(ours, expected, dtype)


def test_bad_sizes():
    model, x = MODELS["mlp"][0](), torch.randn(2, 5)
    with gradhooks.attach(model) as gh:
        model(x).sum().backward()
        with pytest.raises(ValueError):
            gh.projected_grads(k_in=0)
