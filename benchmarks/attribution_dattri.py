"""gradhooks.attribution against dattri 0.3.0 on the same MLP on scikit-learn's digits, side by
side in one run: influence scores of 1200 training samples on 300 validation samples, their
agreement and their time (CPU, float32, median of repeats).

    python benchmarks/attribution_dattri.py [--repeats 3] [--threads 1]
        [--out benchmarks/results/attribution_dattri.md]

Needs ``pip install -c constraints.txt dattri==0.3.0`` (pure Python; it keeps torch 2.13.0).
Model: MLP 64-128-10 (tanh), trained 30 epochs (Adam) on the digits' true labels; train and
query loaders in batches of 200 and 300. Rows:

* gradient dot product ``<q_m, g_n>`` (``H = I``; TracIn at one checkpoint, Grad-Dot):
  gradhooks' ``pairwise_scores`` / ``self_scores`` with no preconditioner against dattri's
  ``TracInAttributor`` (``weight_list=[1]``, ``normalized_grad=False``) with its random
  projection switched off (``projector_kwargs = None`` after construction: its constructor
  always projects to 512 dimensions). Exact on both sides: equal up to float32.
* EK-FAC influence ``q_m^T H^-1 g_n``, the same damping ``λ`` on both sides (added to the
  corrected eigenvalues): gradhooks' ``FactorFit`` (two passes) + ``pairwise_scores`` against
  dattri's ``IFAttributorEKFAC`` (``cache`` + ``attribute``), both against a float64 reference
  of the definition from dense per-sample gradients of a float64 copy (``torch.func``).
* LoGra (projected gradients, ``H = I``): gradhooks' ``gh.projected_grads(16, 16)`` against
  dattri's ``LoGraAttributor(hessian="Identity", proj_dim=256)`` (16 x 16 per layer on both
  sides); different random projections, so each is compared with the exact scores by rank
  correlation (Spearman over the training samples, mean over the queries).
"""
import argparse
import copy
import importlib.metadata
import logging
import pathlib
import statistics
import tempfile
import time
import warnings

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradhooks
from gradhooks import attribution

try:
    import dattri
    from dattri.algorithm import IFAttributorEKFAC, LoGraAttributor, TracInAttributor
    from dattri.task import AttributionTask
except ImportError:  # pragma: no cover
    dattri = None

DAMPING = 1e-3
LAYERS = ("1", "3")  # the two Linear layers of mlp()


def mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 10))


def setup(epochs: int = 30):
    """(trained model, train loader, query loader)."""
    torch.manual_seed(0)
    digits = load_digits()
    x = torch.as_tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.as_tensor(digits.target)
    perm = torch.randperm(len(y))
    train, val = perm[:1200], perm[1200:1500]
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(epochs):
        for i in range(0, len(train), 100):
            b = train[i:i + 100]
            opt.zero_grad()
            F.cross_entropy(model(x[b]), y[b]).backward()
            opt.step()
    return (model, DataLoader(TensorDataset(x[train], y[train]), batch_size=200),
            DataLoader(TensorDataset(x[val], y[val]), batch_size=300))


# ---------------------------------------------------------------- gradhooks

def gh_fit(model, train) -> attribution.Preconditioner:
    with gradhooks.attach(model) as gh:
        fit = attribution.fit_factors(gh, train, lambda b: F.cross_entropy(model(b[0]), b[1]),
                                      all_layers=False, progress=False)
    return fit.preconditioner("ekfac", damping=DAMPING)


def gh_scores(model, train, queries, pre=None):
    """((N, M) pairwise scores, (N,) self-influence)."""
    with gradhooks.attach(model) as gh:
        (x, y), = queries
        F.cross_entropy(model(x), y).backward()
        q = attribution.query_gradients(gh.gradient_features(), pre)
        gh.clear()
        model.zero_grad(set_to_none=True)
        cols, selfs = [], []
        for x, y in train:
            F.cross_entropy(model(x), y).backward()
            features = gh.gradient_features()
            cols.append(attribution.pairwise_scores(q, features))
            selfs.append(attribution.self_scores(features, pre))
            gh.clear()
            model.zero_grad(set_to_none=True)
    return torch.cat(cols, 1).T, torch.cat(selfs)


def gh_projected(model, train, queries, k: int = 16):
    with gradhooks.attach(model) as gh:
        out = []
        for loader in (train, queries):
            rows = []
            for x, y in loader:
                F.cross_entropy(model(x), y).backward()
                rows.append(gh.projected_grads(k, k, seed=0))
                gh.clear()
                model.zero_grad(set_to_none=True)
            out.append(torch.cat(rows))
    return out[0] @ out[1].T


# ---------------------------------------------------------------- dattri

def dattri_task(model):
    def loss_func(params, data):  # torch.func style; per sample (vmap) or per batch
        x, y = data
        out = torch.func.functional_call(model, params, x.reshape(-1, 1, 8, 8))
        return F.cross_entropy(out, y.reshape(-1))
    return AttributionTask(loss_func=loss_func, model=model, checkpoints=model.state_dict())


def dattri_logra_task(model):
    def loss_func(module, batch, device):  # BlockProjectedIF's convention; own-loss gradients
        x, y = batch
        return F.cross_entropy(module(x.to(device)), y.to(device), reduction="sum")
    return AttributionTask(loss_func=loss_func, model=model, checkpoints=model.state_dict())


def dattri_tracin(model, train, queries):
    tracin = TracInAttributor(dattri_task(model), weight_list=torch.ones(1), normalized_grad=False)
    tracin.projector_kwargs = None  # exact gradients (the constructor always sets a projector)
    return tracin.attribute(train, queries), tracin.self_attribute(train)


# ---------------------------------------------------------------- float64 reference

def dense_grads(model, loader):
    """{layer: (N, O, I + 1)} per-sample gradients [W b] of a float64 copy (torch.func
    ``vmap(grad)``: neither tool's code), and {layer: (N, I)} the layers' inputs."""
    model = copy.deepcopy(model).double()
    params = {k: p.detach() for k, p in model.named_parameters()}

    def loss(p, x, y):
        return F.cross_entropy(torch.func.functional_call(model, p, x[None]), y[None])

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))
    grads, inputs = {k: [] for k in LAYERS}, {k: [] for k in LAYERS}
    for x, y in loader:
        per = per_sample(params, x.double(), y)
        for k in LAYERS:
            grads[k].append(torch.cat([per[f"{k}.weight"], per[f"{k}.bias"][..., None]], -1))
    hooks = [model.get_submodule(k).register_forward_hook(
        lambda m, i, o, k=k: inputs[k].append(i[0].detach())) for k in LAYERS]
    with torch.no_grad():
        for x, _ in loader:
            model(x.double())
    for h in hooks:
        h.remove()
    return {k: torch.cat(v) for k, v in grads.items()}, {k: torch.cat(v) for k, v in inputs.items()}


def ekfac_reference(train, queries, inputs, bases=None, dattri_form=False):
    """(N, M) EK-FAC scores in float64 from dense gradients. ``bases``: {layer: (Q_A, Q_G)}
    (default: eigenvectors of the float64 A and G). ``dattri_form``: dattri 0.3.0's formula,
    rotation ``Q_G M Q_A^T`` (eigenvectors as rows) and the query's [W b] matrix reshaped from
    ``cat(W.flatten(), b)``."""
    total = 0
    for k in LAYERS:
        m, v = train[k], queries[k]
        if bases is None:
            a = torch.cat([inputs[k], torch.ones(len(inputs[k]), 1, dtype=m.dtype)], 1)
            g = m[..., -1]  # the bias's gradient is the output gradient (no weight sharing)
            q_a = torch.linalg.eigh(a.T @ a / len(a))[1]
            q_g = torch.linalg.eigh(g.T @ g / len(g))[1]
        else:
            q_a, q_g = (t.double() for t in bases[k])
        if dattri_form:
            rot, back = (lambda t: q_g @ t @ q_a.T), (lambda t: q_g.T @ t @ q_a)
            w, b = v[..., :-1], v[..., -1]
            v = torch.cat([w.flatten(1), b], 1).reshape(v.shape)
            rows = torch.cat([m[..., :-1].flatten(1), m[..., -1]], 1)
        else:
            rot, back = (lambda t: q_g.T @ t @ q_a), (lambda t: q_g @ t @ q_a.T)
            rows = m.flatten(1)
        scaling = rot(m).square().mean(0)
        total = total + rows @ back(rot(v) / (scaling + DAMPING)).flatten(1).T
    return total


# ---------------------------------------------------------------- comparisons

def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref|."""
    return ((a.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman rank correlation over the training samples (dim 0), mean over the queries."""
    ra, rb = (t.double().argsort(0).argsort(0).double() for t in (a, b))
    ra, rb = ra - ra.mean(0), rb - rb.mean(0)
    return ((ra * rb).sum(0) / (ra.norm(dim=0) * rb.norm(dim=0))).mean().item()


def timed(fn, repeats: int, first=None, name=None):
    """(median seconds, last result); the first call's time into ``first[name]``."""
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    if first is not None:
        first[name] = times[0]
    return statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: tiny matmuls, and steady on a busy machine)")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"
                                             / "attribution_dattri.md"))
    args = parser.parse_args()
    if dattri is None:
        raise SystemExit("dattri is not installed: pip install -c constraints.txt dattri==0.3.0")
    torch.set_num_threads(args.threads)
    logging.disable(logging.INFO)      # dattri's per-stage log lines
    warnings.filterwarnings("ignore")  # (and its "full training data loader was NOT cached")
    model, train, queries = setup()
    r = args.repeats
    lines = ["# gradhooks.attribution against dattri", "",
             "`python benchmarks/attribution_dattri.py` (not part of the test suite). dattri "
             "installed with `pip install -c constraints.txt dattri==0.3.0`: a pure-Python wheel "
             "that leaves torch at 2.13.0+cpu and adds pretty_midi, mido, six and "
             "importlib_resources.", "",
             f"torch {torch.__version__}, dattri {importlib.metadata.version('dattri')}, "
             f"threads {torch.get_num_threads()}, CPU; MLP 64-128-10 (tanh) on scikit-learn's "
             f"digits, N = 1200 train, M = 300 queries; median of {r} (s); EK-FAC damping "
             f"{DAMPING} on both sides", ""]

    # gradient dot product, exact
    t_first = {}
    t_gh, (dot, dot_self) = timed(lambda: gh_scores(model, train, queries), r, t_first, "gh")
    t_da, (dot_da, dot_self_da) = timed(lambda: dattri_tracin(model, train, queries), r, t_first,
                                        "tracin")
    ref_train, inputs = dense_grads(model, train)
    ref_query, _ = dense_grads(model, queries)
    dot_ref = sum(ref_train[k].flatten(1) @ ref_query[k].flatten(1).T for k in LAYERS)
    self_ref = sum(ref_train[k].flatten(1).square().sum(1) for k in LAYERS)

    # EK-FAC
    t_fit, pre = timed(lambda: gh_fit(model, train), r)
    t_ek, (ek, _) = timed(lambda: gh_scores(model, train, queries, pre), r)
    fits, atts = [], []
    for _ in range(r):
        ekfac = IFAttributorEKFAC(dattri_task(model), damping=DAMPING)
        t0 = time.perf_counter()
        ekfac.cache(train)
        t1 = time.perf_counter()
        ek_da = ekfac.attribute(train, queries)
        fits.append(t1 - t0)
        atts.append(time.perf_counter() - t1)
    ek_ref = ekfac_reference(ref_train, ref_query, inputs)
    ek_ref_da = ekfac_reference(ref_train, ref_query, inputs, bases=ekfac.cached_q,
                                dattri_form=True)
    ek_ref_da_basis = ekfac_reference(ref_train, ref_query, inputs, bases=ekfac.cached_q)

    # LoGra, H = I
    t_lg, lg = timed(lambda: gh_projected(model, train, queries), r)
    logra_times, lg_da = [], None
    for _ in range(r):
        with tempfile.TemporaryDirectory() as tmp:  # (its batch_metadata.json; default ".")
            logra = LoGraAttributor(dattri_logra_task(model), hessian="Identity", proj_dim=256,
                                    offload="none", cache_dir=tmp)
            t0 = time.perf_counter()
            logra.cache(train)
            lg_da = logra.attribute(train, queries)
            logra_times.append(time.perf_counter() - t0)
    t_lg_da = statistics.median(logra_times)

    lines += [
        "| scores | gradhooks (s) | dattri (s) | gradhooks vs dattri | gradhooks vs float64 | "
        "dattri vs float64 |",
        "|---|--:|--:|--:|--:|--:|",
        f"| gradient dot product (N, M) and self (N,), H = I | {t_gh:.3f} | {t_da:.3f} "
        f"(TracInAttributor, unprojected) "
        f"| {rel(dot, dot_da):.1e} / {rel(dot_self, dot_self_da):.1e} "
        f"| {rel(dot, dot_ref):.1e} / {rel(dot_self, self_ref):.1e} "
        f"| {rel(dot_da, dot_ref):.1e} / {rel(dot_self_da, self_ref):.1e} |",
        f"| EK-FAC influence (N, M): fit + scores | {t_fit:.3f} + {t_ek:.3f} | "
        f"{statistics.median(fits):.3f} + {statistics.median(atts):.3f} (IFAttributorEKFAC) "
        f"| {rel(ek, ek_da):.1e}, Spearman {spearman(ek, ek_da):.3f} "
        f"| {rel(ek, ek_ref):.1e} "
        f"| {rel(ek_da, ek_ref):.1e}, Spearman {spearman(ek_da, ek_ref):.3f} |",
        f"| LoGra 16 x 16 per layer, H = I (N, M) | {t_lg:.3f} | {t_lg_da:.3f} (LoGraAttributor) "
        f"| Spearman {spearman(lg, lg_da):.3f} | Spearman {spearman(lg, dot_ref):.3f} "
        f"| Spearman {spearman(lg_da, dot_ref):.3f} |",
        "",
        "Max |difference| / max |reference| unless marked Spearman (rank correlation over the "
        "training samples, mean over the queries). float64: dense per-sample gradients of a "
        "float64 copy by torch.func (gradient dot product; EK-FAC by its definition, "
        "eigenvectors of the float64 A and G; LoGra: against the exact dot product).",
        "",
        f"dattri's EK-FAC scores against its own formula in float64 (its eigenvectors Q_A, Q_G, "
        f"rotation Q_G M Q_A^T, query [W b] reshaped from cat(W.flatten(), b)): "
        f"{rel(ek_da, ek_ref_da):.1e}; gradhooks' against the definition with dattri's float32 "
        f"eigenvectors (Q_G^T M Q_A, [W b] by columns): {rel(ek, ek_ref_da_basis):.1e}.",
        "",
        f"First calls in the process (in the medians' repeats): gradhooks dot product "
        f"{t_first['gh']:.2f} s, TracInAttributor {t_first['tracin']:.2f} s, LoGraAttributor "
        f"{logra_times[0]:.2f} s.",
        "",
        "## Notes",
        "",
        "- Gradient dot product (TracIn at one checkpoint, Grad-Dot): the two are equal within "
        "float32. dattri's `TracInAttributor` always projects (to 512 dimensions: "
        "`projector_kwargs=None` falls back to its module-level `DEFAULT_PROJECTOR_KWARGS`, which "
        "a caller's `projector_kwargs` also update in place); here its projector is switched off "
        "after construction to compare exact scores.",
        "- EK-FAC: not equal, and dattri's scores are far from the definition (rank correlation "
        "above). dattri 0.3.0's `IFAttributorEKFAC` rotates by `q_s @ M @ q_a.T` "
        "(`dattri/func/fisher.py` `_update_lambda`, `algorithm/influence_function.py` "
        "`transform_test_rep`) where `torch.linalg.eigh` returns the eigenvectors as columns (the "
        "eigenbasis is `Q_G^T M Q_A`), and forms the query's `(O, I + 1)` matrix by reshaping "
        "`cat(W.flatten(), b)`, so the bias is not its last column as in the corrected "
        "eigenvalues from its hooks. Its scores equal that formula in float64 (line above); "
        "gradhooks' equal the definition, with the float64 eigenvectors or with dattri's. For "
        "a layer without bias only the rotation differs.",
        "- LoGra: the random projections differ between the tools (not comparable seed for "
        "seed); at 16 x 16 per layer both rank the training samples alike against the exact "
        "scores. dattri's first `LoGraAttributor` call in a process carries a one-time set-up "
        "(line above); its default `cache_dir` is the working directory (it writes "
        "`batch_metadata.json` there), here a temporary one.",
        "- Not compared: dattri's `IFAttributorDataInf`, `TRAKAttributor`, `FactGraSSAttributor` "
        "and `BlockProjectedIFAttributor` with `hessian=\"eFIM\"` (a Fisher in the projected "
        "space, with no gradhooks counterpart in this comparison).",
        "- Times: one torch thread on a shared 2-core machine with other jobs running; the "
        "spread between runs is up to 2.5x; gradhooks was the faster in every run.",
    ]
    text = "\n".join(lines)
    print(text)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    print(f"written: {out}")


if __name__ == "__main__":
    main()
