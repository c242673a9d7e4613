"""EK-FAC / KFAC influence scores from the hook records (gradhooks.readers.attribution) against the
same scores from materialised per-sample gradients and against kronfluence (CPU, float32, one
process, median of repeats).

    python benchmarks/attribution.py --only gradhooks [--repeats 3] [--train 2048] [--queries 32]
    python benchmarks/attribution.py --only kronfluence [--repeats 3] ...

Workloads (random data, random weights): an MLP 784-512-256-10 (tanh) and a CNN on 1x28x28
(Conv2d(1, 16, 5), ReLU, MaxPool 2, Conv2d(16, 32, 5), ReLU, MaxPool 2, Linear(512, 10)).

* fit: EK-FAC factors over the train set in batches: gradhooks' :class:`FactorFit` (two passes:
  covariances, then eigenvalue corrections), kronfluence's ``fit_all_factors``
  (``use_empirical_fisher=True``: the same Fisher).
* scores ``(M, N)``: gradhooks (preconditioned queries, the train records contracted a chunk at
  a time); "materialised": ``gh.per_sample_grads()`` per train batch, ``(B, P)``, then a matmul
  with the same preconditioned queries; kronfluence's ``compute_pairwise_scores`` (default
  heuristic damping, which gradhooks' default equals). The largest difference to kronfluence is
  printed relative to its largest score.
"""
import argparse
import copy
import statistics
import tempfile
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import gradhooks
from gradhooks.readers import attribution as attr

try:
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.task import Task
except ImportError:  # pragma: no cover
    Analyzer = None
    Task = object


class Classification(Task):
    def compute_train_loss(self, batch, model, sample=False):
        return F.cross_entropy(model(batch[0]), batch[1], reduction="sum")

    def compute_measurement(self, batch, model):
        return F.cross_entropy(model(batch[0]), batch[1], reduction="sum")


def mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.Tanh(), nn.Linear(512, 256),
                         nn.Tanh(), nn.Linear(256, 10))


def cnn():
    return nn.Sequential(nn.Conv2d(1, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 5),
                         nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(512, 10))


def batches(x, y, size):
    return [(x[i:i + size], y[i:i + size]) for i in range(0, x.shape[0], size)]


def gradhooks_fit(model, train):
    fit = attr.FactorFit()
    with gradhooks.attach(model) as gh:
        for add in (fit.add_covariances, fit.add_eigenvalues):
            for x, y in train:
                F.cross_entropy(model(x), y).backward()
                add(gh.gradient_features())
                gh.clear()
                model.zero_grad(set_to_none=True)
    return fit.preconditioner("ekfac")


def gradhooks_scores(model, pre, query, train, materialise=False):
    with gradhooks.attach(model) as gh:
        F.cross_entropy(model(query[0]), query[1]).backward()
        q = attr.query_gradients(gh.gradient_features(), pre)
        gh.clear()
        cols = []
        for x, y in train:
            F.cross_entropy(model(x), y).backward()
            if materialise:
                cols.append(_materialised(model, q, gh.per_sample_grads()))
            else:
                cols.append(attr.pairwise_scores(q, gh.gradient_features()))
            gh.clear()
            model.zero_grad(set_to_none=True)
    return torch.cat(cols, 1)


def _materialised(model, q, grads):
    # (B, P) per layer in the [W b] layout of the preconditioned queries, then one matmul
    out = 0
    for path, pq in q.grads.items():
        w, b = grads[f"{path}.weight"], grads.get(f"{path}.bias")
        mat = w.flatten(2)
        if b is not None:
            mat = torch.cat([mat, b[..., None]], -1)
        out = out + pq @ mat.flatten(1).T
    return out


def kronfluence_scores(model, query, train_set, batch):
    task = Classification()
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        analyzer = Analyzer(analysis_name="bench", model=prepare_model(copy.deepcopy(model), task),
                            task=task, output_dir=out, disable_model_save=True, cpu=True,
                            disable_tqdm=True)
        t0 = time.perf_counter()
        analyzer.fit_all_factors(factors_name="f", dataset=train_set, per_device_batch_size=batch,
                                 factor_args=FactorArguments(strategy="ekfac",
                                                             use_empirical_fisher=True))
        t1 = time.perf_counter()
        analyzer.compute_pairwise_scores(
            scores_name="s", factors_name="f", query_dataset=TensorDataset(*query),
            train_dataset=train_set, per_device_query_batch_size=query[0].shape[0],
            per_device_train_batch_size=batch, score_args=ScoreArguments(damping_factor=None))
        t2 = time.perf_counter()
        return analyzer.load_pairwise_scores("s")["all_modules"], t1 - t0, t2 - t1


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--train", type=int, default=2048)
    parser.add_argument("--queries", type=int, default=32)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--only", choices=("gradhooks", "kronfluence"), required=True,
                        help="one library per process (run both)")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, N = {args.train}, "
          f"M = {args.queries}, batch {args.batch}; median of {args.repeats} (s)")
    print("| model | gradhooks fit | gradhooks scores | materialised scores | kronfluence fit | "
          "kronfluence scores | max diff / max score |")
    print("|---|--:|--:|--:|--:|--:|--:|")
    for name, make in (("mlp", mlp), ("cnn", cnn)):
        torch.manual_seed(0)
        model = make()
        x, y = torch.randn(args.train, 1, 28, 28), torch.randint(0, 10, (args.train,))
        query = (torch.randn(args.queries, 1, 28, 28), torch.randint(0, 10, (args.queries,)))
        train = batches(x, y, args.batch)
        times = {k: [] for k in ("fit", "scores", "materialised", "kf_fit", "kf_scores")}
        for _ in range(args.repeats if args.only != "kronfluence" else 0):
            t0 = time.perf_counter()
            pre = gradhooks_fit(model, train)
            t1 = time.perf_counter()
            ours = gradhooks_scores(model, pre, query, train)
            t2 = time.perf_counter()
            dense = gradhooks_scores(model, pre, query, train, materialise=True)
            t3 = time.perf_counter()
            times["fit"].append(t1 - t0)
            times["scores"].append(t2 - t1)
            times["materialised"].append(t3 - t2)
            assert torch.allclose(ours, dense, rtol=1e-3, atol=1e-3 * dense.abs().max().item())
        diff = float("nan")
        for _ in range(args.repeats if args.only != "gradhooks" else 0):
            theirs, kf_fit, kf_scores = kronfluence_scores(model, query, TensorDataset(x, y),
                                                           args.batch)
            times["kf_fit"].append(kf_fit)
            times["kf_scores"].append(kf_scores)
        if args.only == "kronfluence":  # (untimed: for the difference)
            ours = gradhooks_scores(model, gradhooks_fit(model, train), query, train)
            diff = ((ours - theirs).abs().max() / theirs.abs().max()).item()
        med = {k: (f"{statistics.median(v):.3f}" if v else "-") for k, v in times.items()}
        print(f"| {name} | {med['fit']} | {med['scores']} | {med['materialised']} | "
              f"{med['kf_fit']} | {med['kf_scores']} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
