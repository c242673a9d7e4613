"""Finding mislabelled training digits with influence scores: self-influence and harm to the
validation loss, read by ``gradhooks.attribution`` with an EK-FAC preconditioner, rank the
training samples whose labels were flipped first; a plot of the top-ranked images.

    python examples/influence_digits.py [--strategy ekfac|kfac|identity] [--epochs 200]
        [--flip-fraction 0.03] [--seed 0] [--out examples/results/influence_digits.png]

scikit-learn's bundled digits (8x8, no download) are split into 1200 training, 300 validation
and 297 test images; a seeded 3% of the training labels (36) are changed to another digit. An
MLP 64-128-10 (tanh) is trained on the given labels until it fits nearly all of them, the
wrong ones included. Then, with gradhooks attached:

* ``attribution.fit_factors`` fits the EK-FAC factors over the training loader (covariances,
  eigendecomposition, eigenvalue corrections) and gives the preconditioner ``H^-1``;
* self-influence ``g_n^T H^-1 g_n`` of every training sample (``attribution.self_scores``);
* influence on the validation loss, ``sum_m q_m^T H^-1 g_n`` over the 300 validation samples
  (``attribution.query_gradients`` once, then ``attribution.pairwise_scores`` per train batch):
  a negative total means upweighting sample ``n`` raises the validation loss, so the most
  negative are ranked first.

It prints the fraction of the mislabelled samples found in the top k and top 2k of each
ranking (k = the number flipped), against a random ranking's expected fraction (k / N) and
the training loss as a baseline. Once the model has fitted the wrong labels their loss is no
longer large and the loss ranking falls behind self-influence. Seeds 0-9 (EK-FAC, 200 epochs):
self-influence found 0.72-0.86 of them in the top k and 0.92-0.97 in the top 2k; the training
loss 0.58-0.81 and 0.83-0.97; harm to the validation loss 0.53-0.78 and 0.67-0.86; random 0.03
and 0.06. With ``--strategy identity`` (``H = I``: squared gradient norms, TracIn at one
checkpoint) self-influence is no better than the loss (seed 0: 0.64 / 0.86). About 7 s on 2
CPU cores, most of it importing torch and training.
"""
import argparse
import pathlib
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradhooks
from gradhooks import attribution

N_TRAIN, N_VAL = 1200, 300


def mlp(hidden: int = 128) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.Tanh(), nn.Linear(hidden, 10))


def data(seed: int, flip_fraction: float):
    """(x, true labels, given labels, train / validation / test indices, flipped train indices)."""
    gen = torch.Generator().manual_seed(seed)
    digits = load_digits()
    x = torch.as_tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (1797, 1, 8, 8)
    y = torch.as_tensor(digits.target)
    perm = torch.randperm(len(y), generator=gen)
    train, val, test = perm[:N_TRAIN], perm[N_TRAIN:N_TRAIN + N_VAL], perm[N_TRAIN + N_VAL:]
    n_flip = max(1, round(flip_fraction * N_TRAIN))
    flipped = torch.randperm(N_TRAIN, generator=gen)[:n_flip]  # positions in the train set
    given = y.clone()
    shift = torch.randint(1, 10, (n_flip,), generator=gen)     # another digit, uniformly
    given[train[flipped]] = (y[train[flipped]] + shift) % 10
    return x, y, given, train, val, test, flipped


def train_model(model, loader, epochs: int) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(epochs):
        for xb, yb in loader:
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()


def influence(model, loader, x_val, y_val, strategy: str):
    """(self-influence (N,), total influence on the validation loss (N,), preconditioner)."""
    with gradhooks.attach(model) as gh:
        if strategy == "identity":
            pre = attribution.preconditioner(None)   # H = I: TracIn / gradient similarity
        else:
            # pass 1: A, G; pass 2 (EK-FAC): the eigenvalues in their eigenbasis
            fit = attribution.fit_factors(gh, loader, lambda b: F.cross_entropy(model(b[0]), b[1]),
                                          strategy=strategy, all_layers=False, progress=False)
            pre = fit.preconditioner(strategy)
        F.cross_entropy(model(x_val), y_val).backward()
        query = attribution.query_gradients(gh.gradient_features(), pre)   # H^-1 q_m, (M, P)
        gh.clear()
        model.zero_grad(set_to_none=True)
        self_inf, total = [], []
        for xb, yb in loader:
            F.cross_entropy(model(xb), yb).backward()
            train = gh.gradient_features()
            self_inf.append(attribution.self_scores(train, pre))           # (B,)
            total.append(attribution.pairwise_scores(query, train).sum(0))  # (M, B) -> (B,)
            gh.clear()
            model.zero_grad(set_to_none=True)
    return torch.cat(self_inf), torch.cat(total), pre


def found(order: torch.Tensor, is_flipped: torch.Tensor, k: int) -> float:
    """Fraction of the flipped samples among the first ``k`` of ``order``."""
    return is_flipped[order[:k]].sum().item() / is_flipped.sum().item()


def plot(path: pathlib.Path, images, given, true, rankings, per_row: int = 12, rows: int = 2):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(rows * len(rankings), per_row,
                             figsize=(per_row * 0.95, rows * len(rankings) * 1.2 + 0.4))
    for r, (name, order) in enumerate(rankings.items()):
        for j in range(rows * per_row):
            ax = axes[r * rows + j // per_row, j % per_row]
            n = order[j].item()
            wrong = given[n] != true[n]
            ax.imshow(images[n, 0], cmap="gray_r")
            ax.set_title(f"{given[n]} (true {true[n]})" if wrong else f"{given[n]}",
                         fontsize=8, color="red" if wrong else "black")
            ax.set_xticks([])
            ax.set_yticks([])
        axes[r * rows, 0].set_ylabel(name, fontsize=8, rotation=0, ha="right", va="center")
    fig.suptitle("Top-ranked training digits: given label (red: flipped, with the true label)",
                 fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="ekfac", choices=["ekfac", "kfac", "identity"])
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--flip-fraction", type=float, default=0.03)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"
                                             / "influence_digits.png"))
    args = parser.parse_args()
    torch.set_num_threads(1)  # the matmuls are tiny: more threads only wait for each other
    torch.manual_seed(args.seed)
    x, y, given, train, val, test, flipped = data(args.seed, args.flip_fraction)
    n_flip = len(flipped)
    is_flipped = torch.zeros(N_TRAIN, dtype=torch.bool)
    is_flipped[flipped] = True
    gen = torch.Generator().manual_seed(args.seed)
    train_set = TensorDataset(x[train], given[train])
    model = mlp()
    t0 = time.perf_counter()
    train_model(model, DataLoader(train_set, batch_size=100, shuffle=True, generator=gen),
                args.epochs)
    with torch.no_grad():
        fits = model(x[train]).argmax(1) == given[train]
        test_acc = (model(x[test]).argmax(1) == y[test]).float().mean().item()
    print(f"digits: {N_TRAIN} train ({n_flip} labels flipped, seed {args.seed}), {N_VAL} "
          f"validation, {len(test)} test; MLP 64-128-10 trained {args.epochs} epochs "
          f"({time.perf_counter() - t0:.1f} s)")
    print(f"accuracy on the given train labels {fits.float().mean().item():.3f} (fits "
          f"{int(fits[flipped].sum())} of the {n_flip} flipped ones), test accuracy {test_acc:.3f}")

    t0 = time.perf_counter()
    loader = DataLoader(train_set, batch_size=200)   # in order: scores line up with train
    self_inf, total, pre = influence(model, loader, x[val], y[val], args.strategy)
    kinds = ", ".join(f"{k}: {v}" for k, v in pre.kinds.items()) or "every parameter: identity"
    print(f"{args.strategy} preconditioner ({kinds}); self-influence ({N_TRAIN},) and influence "
          f"of each train sample on the {N_VAL} validation losses ({N_VAL}, {N_TRAIN}) in "
          f"{time.perf_counter() - t0:.2f} s")
    with torch.no_grad():
        loss = F.cross_entropy(model(x[train]), given[train], reduction="none")
    label = {"ekfac": "EK-FAC", "kfac": "KFAC", "identity": "H = I"}[args.strategy]
    rankings = {f"self-influence ({label})": self_inf.argsort(descending=True),
                f"harm to validation loss ({label})": total.argsort(),
                "training loss": loss.argsort(descending=True)}
    print(f"fraction of the {n_flip} mislabelled training samples found in the top k of each "
          f"ranking (k = {n_flip}, 2k = {2 * n_flip}):")
    print(f"  {'ranking':38s} {'top k':>6s} {'top 2k':>7s}")
    for name, order in rankings.items():
        print(f"  {name:38s} {found(order, is_flipped, n_flip):6.2f} "
              f"{found(order, is_flipped, 2 * n_flip):7.2f}")
    print(f"  {'random (expected: k / N)':38s} {n_flip / N_TRAIN:6.2f} "
          f"{2 * n_flip / N_TRAIN:7.2f}")
    out = pathlib.Path(args.out)
    plot(out, x[train], given[train], y[train],
         {name: order for name, order in list(rankings.items())[:2]})
    print(f"top-ranked training images: {out}")


if __name__ == "__main__":
    main()
