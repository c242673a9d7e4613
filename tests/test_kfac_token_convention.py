"""KFAC's ``G`` of a token model under the two conventions (issue 40, point 6): ``"sum"`` (the
default: summed over the tokens of a sequence, Eschenhagen et al. 2023 / curvlinops) and
``"mean"`` (averaged over them, kronfluence's). Checked against each other exactly, and against
kronfluence 1.0 on a token model with T = 32 in float64 (its factors and its KFAC pairwise and
self scores, ``use_empirical_fisher=True``, its heuristic damping and a fixed one)."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradhooks
from gradhooks import attribution as attr

F64 = torch.float64
T = 32  # tokens per sequence (the token model)


def token_model(dtype=F64):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(dtype)


def token_loss(out, y):
    """Sum over a sequence's tokens (each sample's own loss), mean over the sequences."""
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum") / max(len(y), 1)


def token_data(n, t=T, dtype=F64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, t, 4, generator=g, dtype=F64).to(dtype), torch.randint(0, 3, (n, t), generator=g)


def _factors(model, x, y, **kw):
    with gradhooks.attach(model) as gh:
        token_loss(model(x), y).backward()
        return gh.kfac_factors(**kw)


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("n", [0, 1, 5], ids=["B0", "B1", "B5"])
@pytest.mark.parametrize("t", [1, 7], ids=["T1", "T7"])
def test_mean_is_sum_over_tokens(t, n, dtype):
    """g_positions="mean": the same A, and G divided by the tokens per sequence (T = 1: equal)."""
    model = token_model(dtype)
    x, y = token_data(n, t, dtype)
    total = _factors(model, x, y)
    mean = _factors(model, x, y, g_positions="mean")
    assert list(total) == list(mean) == ["0", "2"]
    tol = dict(rtol=1e-12, atol=0) if dtype == F64 else dict(rtol=1e-6, atol=0)
    for key in total:
        torch.testing.assert_close(mean[key].A, total[key].A, **tol)
        torch.testing.assert_close(mean[key].G * t, total[key].G, **tol)


def test_g_positions_errors():
    model = token_model()
    x, y = token_data(2, 3)
    with pytest.raises(ValueError, match="g_positions must be one of 'sum', 'mean'"):
        _factors(model, x, y, g_positions="tokens")
    with pytest.raises(ValueError, match="defined for kfac_approx='expand' only"):
        _factors(model, x, y, kfac_approx="reduce", g_positions="mean")
    with pytest.raises(ValueError, match="g_positions must be one of"):
        attr.FactorFit(g_positions="token")


def _kronfluence(model, train, query, strategy, damping, tmp_path):
    # kronfluence 1.0 in float64: its factors, pairwise scores (M, N) and self scores (N,)
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.task import Task

    class Tokens(Task):
        def compute_train_loss(self, batch, model, sample=False):
            return F.cross_entropy(model(batch[0]).flatten(0, 1), batch[1].flatten(), reduction="sum")

        def compute_measurement(self, batch, model):
            return self.compute_train_loss(batch, model)

    factor_args = FactorArguments(strategy=strategy, use_empirical_fisher=True,
                                  activation_covariance_dtype=F64, gradient_covariance_dtype=F64,
                                  eigendecomposition_dtype=F64, per_sample_gradient_dtype=F64,
                                  lambda_dtype=F64)
    score_args = ScoreArguments(damping_factor=damping, per_sample_gradient_dtype=F64,
                                precondition_dtype=F64, score_dtype=F64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        analyzer = Analyzer(analysis_name="t", model=prepare_model(copy.deepcopy(model), Tokens()),
                            task=Tokens(), output_dir=str(tmp_path), disable_model_save=True,
                            cpu=True, disable_tqdm=True)
        analyzer.fit_all_factors(factors_name="f", dataset=train, per_device_batch_size=len(train),
                                 factor_args=factor_args)
        analyzer.compute_pairwise_scores(scores_name="p", factors_name="f", query_dataset=query,
                                         train_dataset=train, per_device_query_batch_size=len(query),
                                         per_device_train_batch_size=len(train),
                                         score_args=score_args)
        analyzer.compute_self_scores(scores_name="s", factors_name="f", train_dataset=train,
                                     per_device_train_batch_size=len(train), score_args=score_args)
    cov = analyzer.load_covariance_matrices("f")  # (sums and their counts, as kronfluence keeps them)
    factors = {name: {k: v / cov[f"num_{name}_processed"][k] for k, v in cov[name].items()}
               for name in ("activation_covariance", "gradient_covariance")}
    return (factors, analyzer.load_pairwise_scores("p")["all_modules"],
            analyzer.load_self_scores("s")["all_modules"])


@pytest.mark.parametrize("damping", [None, 1e-3], ids=["heuristic", "fixed"])
def test_against_kronfluence(damping, tmp_path):
    """T = 32 tokens, float64: with g_positions="mean" (and loss_reduction="mean") A and G are
    kronfluence's activation / gradient covariances, and the KFAC scores are its scores, with its
    heuristic damping (0.1 x the mean eigenvalue: gradhooks' default, damping=None) and with a
    fixed damping; with the default "sum" and the heuristic damping every score is 1/T of
    kronfluence's (H and its damping both T times larger)."""
    model = token_model()
    xt, yt = token_data(8, seed=1)
    xq, yq = token_data(3, seed=2)
    train, query = TensorDataset(xt, yt), TensorDataset(xq, yq)
    theirs, their_pair, their_self = _kronfluence(model, train, query, "kfac", damping, tmp_path)
    tight = dict(rtol=1e-10, atol=0)
    with gradhooks.attach(model) as gh:
        token_loss(model(xt), yt).backward()
        factors = {c: gh.kfac_factors(g_positions=c) for c in ("sum", "mean")}
        tf = gh.gradient_features()
        gh.clear()
        token_loss(model(xq), yq).backward()
        qf = gh.gradient_features()
    for key, f in factors["mean"].items():
        torch.testing.assert_close(f.A, theirs["activation_covariance"][key], **tight)
        torch.testing.assert_close(f.G, theirs["gradient_covariance"][key], **tight)
    fixed = {} if damping is None else {"damping": damping}
    scores = {}
    for c, fac in factors.items():
        pre = attr.preconditioner(fac, **fixed)
        scores[c] = attr.pairwise_scores(qf, tf, pre), attr.self_scores(tf, pre)
    for ours, theirs_ in zip(scores["mean"], (their_pair, their_self)):
        torch.testing.assert_close(ours, theirs_, rtol=1e-9, atol=1e-12 * theirs_.abs().max().item())
    if damping is None:
        for ours, theirs_ in zip(scores["sum"], (their_pair, their_self)):
            torch.testing.assert_close(ours * T, theirs_, rtol=1e-9, atol=1e-12 * theirs_.abs().max().item())
    # the same through the loaders' fit (FactorFit(g_positions="mean"), two batches of 4)
    loader = DataLoader(train, batch_size=4)
    with gradhooks.attach(model) as gh:
        fit = attr.fit_factors(gh, loader, lambda b: token_loss(model(b[0]), b[1]), strategy="kfac",
                               fit=attr.FactorFit(g_positions="mean"), progress=False)
        pre = fit.preconditioner("kfac", **fixed)
        pair = attr.pairwise_scores_over(gh, DataLoader(query, batch_size=3), loader,
                                         lambda b: token_loss(model(b[0]), b[1]), pre, progress=False)
    torch.testing.assert_close(pair, their_pair, rtol=1e-9, atol=1e-12 * their_pair.abs().max().item())


@pytest.mark.parametrize("fisher", ["empirical", "type-2"])
def test_fisher_driver(fisher):
    """gradhooks.kfac(..., g_positions="mean") on a token model with MSE: G / T, A the same."""
    model = token_model()
    x = token_data(3, 5)[0]
    y = torch.randn(3, 5, 3, dtype=F64)
    total = gradhooks.kfac(model, x, y, nn.MSELoss(), fisher=fisher)
    mean = gradhooks.kfac(model, x, y, nn.MSELoss(), fisher=fisher, g_positions="mean")
    for key in total:
        torch.testing.assert_close(mean[key].A, total[key].A, rtol=1e-12, atol=0)
        torch.testing.assert_close(mean[key].G * 5, total[key].G, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="defined for kfac_approx='expand' only"):
        gradhooks.kfac(model, x, y, nn.MSELoss(), kfac_approx="reduce", g_positions="mean")
