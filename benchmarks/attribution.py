"""EK-FAC / KFAC influence scores from the hook records (gradhooks.readers.attribution) against the
same scores from materialised per-sample gradients and against kronfluence (CPU, float32, one
process, median of repeats).

    python benchmarks/attribution.py --only gradhooks [--repeats 3] [--train 2048] [--queries 32]
    python benchmarks/attribution.py --only kronfluence [--repeats 3] ...
    python benchmarks/attribution.py --only gradhooks --models gpt2 [--gpt2-layers 12] ...
    python benchmarks/attribution.py --only kronfluence --models gpt2 ...
    python benchmarks/attribution.py --only gradhooks --models gpt2-full ...

GPT-2 small (``--models gpt2``): transformers' ``GPT2LMHeadModel(GPT2Config(n_layer=L))``, the
default sizes (n_embd 768, 12 heads, vocabulary 50257) with ``L = --gpt2-layers`` blocks (default
12), random weights, eval mode, next-token loss summed over the tokens of a sequence. kronfluence
1.0.1 tracks ``nn.Linear`` and ``nn.Conv2d`` only, not transformers' ``Conv1D``: every
``Conv1D`` is converted to the equal ``nn.Linear`` (weight transposed) for both tools, and both
score the 4 L linear layers of the blocks (``c_attn``, ``attn.c_proj``, ``c_fc``, ``mlp.c_proj``;
kronfluence's ``get_influence_tracked_modules``, as its own GPT-2 example); the other parameters
(embeddings, LayerNorms, the tied ``lm_head``) are frozen for both, so both backward passes do
the same work. ``gpt2-full``: gradhooks alone, every parameter trainable and scored: EK-FAC for
the block linears and the embeddings (``FactorFit`` with ``gh.kfac_factors()``, the tied
``lm_head`` gradient taken with ``wte``'s block), the LayerNorms' exact diagonal. Reported: fit
time, scoring time and throughput (train sequences / s), peak RSS of the process (one library per
process), and "fwd+bwd": the same batches' plain forward + backward without any tool, the
floor both scoring passes pay.

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
import resource
import statistics
import sys
import tempfile
import time
import types
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


class LMTask(Task):
    """Next-token loss summed over the tokens (and sequences) of a batch; ``modules``: the
    tracked layers (kronfluence's ``get_influence_tracked_modules``)."""

    def __init__(self, modules=None):
        super().__init__()
        self.modules = modules

    def compute_train_loss(self, batch, model, sample=False):
        return lm_loss(model, batch[0]) * batch[0].shape[0]

    def compute_measurement(self, batch, model):
        return lm_loss(model, batch[0]) * batch[0].shape[0]

    def get_influence_tracked_modules(self):
        return self.modules


def lm_loss(model, x):
    """Next-token cross-entropy, summed over the tokens of a sequence, mean over sequences
    (gradhooks' ``loss_reduction="mean"``: each sample's own loss is its tokens' sum)."""
    logits = model(x).logits[:, :-1]
    return F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum") / x.shape[0]


def gpt2(layers, full):
    """GPT-2 small sizes with ``layers`` blocks, random weights, ``Conv1D`` -> ``nn.Linear``;
    unless ``full``, only the blocks' linear layers trainable. Returns (model, their names)."""
    # (torchvision 0.28 in this venv does not match torch 2.13: transformers' import of it
    # fails on its meta registrations, which GPT-2 does not need)
    sys.modules.setdefault("torchvision._meta_registrations",
                           types.ModuleType("torchvision._meta_registrations"))
    from transformers.models.gpt2.modeling_gpt2 import GPT2Config, GPT2LMHeadModel
    from transformers.pytorch_utils import Conv1D
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=layers)).eval()
    names = []
    for name, mod in list(model.named_modules()):
        if isinstance(mod, Conv1D):
            lin = nn.Linear(*mod.weight.shape)
            with torch.no_grad():
                lin.weight.copy_(mod.weight.T)
                lin.bias.copy_(mod.bias)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, lin)
            names.append(name)
    if not full:
        for p in model.parameters():
            p.requires_grad_(False)
        for name in names:
            for p in model.get_submodule(name).parameters():
                p.requires_grad_(True)
    return model, names


def peak_rss_gb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def gpt2_gradhooks(model, train, query, full):
    """(fit s, scores s, scores, kinds, query s): FactorFit (EK-FAC) over ``train``, then the
    pairwise scores of ``query`` against every train batch (of which the query batch's backward
    and preconditioning take query s)."""
    t0 = time.perf_counter()
    fit = attr.FactorFit()
    with gradhooks.attach(model) as gh:
        no_head = [layer.path for layer in gh.recorder.layers if layer.path != "lm_head"]
        for x in train:
            lm_loss(model, x).backward()
            factors = None
            if full:  # (the tied lm_head's G would be 50257 x 50257: its gradient goes to wte's block)
                factors = gh.kfac_factors(modules=no_head)
            fit.add_covariances(gh.gradient_features(), factors)
            gh.clear()
            model.zero_grad(set_to_none=True)
        for x in train:
            lm_loss(model, x).backward()
            fit.add_eigenvalues(gh.gradient_features())
            gh.clear()
            model.zero_grad(set_to_none=True)
        pre = fit.preconditioner("ekfac")
        t1 = time.perf_counter()
        lm_loss(model, query).backward()
        q = attr.query_gradients(gh.gradient_features(), pre)
        gh.clear()
        model.zero_grad(set_to_none=True)
        tq = time.perf_counter()
        cols = []
        for x in train:
            lm_loss(model, x).backward()
            cols.append(attr.pairwise_scores(q, gh.gradient_features()))
            gh.clear()
            model.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1, torch.cat(cols, 1), q.kinds, tq - t1


def fwd_bwd(model, train):
    t0 = time.perf_counter()
    for x in train:
        lm_loss(model, x).backward()
        model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def run_gpt2(args, full):
    torch.manual_seed(1)
    model, names = gpt2(args.gpt2_layers, full)
    n, t, m, b = args.gpt2_train, args.gpt2_seq, args.gpt2_queries, args.gpt2_batch
    x = torch.randint(0, model.config.vocab_size, (n, t))
    query = torch.randint(0, model.config.vocab_size, (m, t))
    train = [x[i:i + b] for i in range(0, n, b)]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"GPT-2: {args.gpt2_layers} layers, N = {n} x {t} tokens, M = {m}, batch {b}, "
          f"{trainable / 1e6:.1f} M trainable parameters, {'all' if full else 'block linears'}")
    label = "gpt2-full" if full else "gpt2"
    base = fwd_bwd(model, train)
    if args.only == "kronfluence":
        theirs, kf_fit, kf_scores = kronfluence_scores(
            model, LMTask(names), TensorDataset(query), TensorDataset(x), b)
        rss = peak_rss_gb()
        ours = gpt2_gradhooks(model, train, query, full)[2]  # (untimed: the difference)
        diff = ((ours - theirs).abs().max() / theirs.abs().max()).item()
        print(f"| {label} kronfluence | {kf_fit:.1f} | {kf_scores:.1f} | {n / kf_scores:.2f} | "
              f"{rss:.1f} | fwd+bwd {base:.1f} s; max diff / max score {diff:.1e} |", flush=True)
        return
    fit_s, score_s, ours, kinds, query_s = gpt2_gradhooks(model, train, query, full)
    counts = {k: list(kinds.values()).count(k) for k in sorted(set(kinds.values()))}
    print(f"| {label} gradhooks | {fit_s:.1f} | {score_s:.1f} | {n / score_s:.2f} | "
          f"{peak_rss_gb():.1f} | fwd+bwd {base:.1f} s; of the scores, the query batch "
          f"{query_s:.1f} s, the train batches {score_s - query_s:.1f} s; blocks {counts} |",
          flush=True)


def mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.Tanh(), nn.Linear(512, 256),
                         nn.Tanh(), nn.Linear(256, 10))


def cnn():
    return nn.Sequential(nn.Conv2d(1, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 5),
                         nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(512, 10))


def batches(x, y, size):
    return [(x[i:i + size], y[i:i + size]) for i in range(0, x.shape[0], size)]


def gradhooks_fit(model, train):
    with gradhooks.attach(model) as gh:
        fit = attr.fit_factors(gh, train, lambda b: F.cross_entropy(model(b[0]), b[1]),
                               all_layers=False, progress=False)
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


def kronfluence_scores(model, task, query_set, train_set, batch):
    """kronfluence's EK-FAC fit and pairwise scores of ``query_set`` (one batch) against
    ``train_set``: ``(scores, fit seconds, score seconds)``."""
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
            scores_name="s", factors_name="f", query_dataset=query_set,
            train_dataset=train_set, per_device_query_batch_size=len(query_set),
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
    parser.add_argument("--models", default="mlp,cnn", help="of mlp, cnn, gpt2, gpt2-full")
    parser.add_argument("--gpt2-layers", type=int, default=12)
    parser.add_argument("--gpt2-train", type=int, default=32)
    parser.add_argument("--gpt2-seq", type=int, default=64)
    parser.add_argument("--gpt2-queries", type=int, default=8)
    parser.add_argument("--gpt2-batch", type=int, default=8)
    args = parser.parse_args()
    models = args.models.split(",")
    if "gpt2" in models or "gpt2-full" in models:
        print(f"torch {torch.__version__}, threads {torch.get_num_threads()} (s; GB)")
        print("| run | fit | scores | train seq / s | peak RSS | notes / max diff / max score |")
        print("|---|--:|--:|--:|--:|---|")
        for name in ("gpt2", "gpt2-full"):
            if name in models:
                run_gpt2(args, name == "gpt2-full")
        return
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
            theirs, kf_fit, kf_scores = kronfluence_scores(
                model, Classification(), TensorDataset(*query), TensorDataset(x, y), args.batch)
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
