"""A Laplace approximation of a digits CNN with gradhooks' laplace-torch backend: calibration
(ECE, NLL) of the Laplace predictive against the MAP model, and a reliability plot.

    python examples/laplace_digits.py [--structure kron] [--out examples/results/laplace_digits.png]

The CNN has the tutorial CNN's layout (two convolutions, max-pool, linear head) at the 8x8 size
of scikit-learn's bundled digits (no download). It is trained to a MAP estimate, then
``Laplace(model, "classification", hessian_structure=..., backend=GradHooksGGN)`` is fitted on
the training set, its prior precision chosen by the marginal likelihood, and the GLM predictive
(probit) is compared with the MAP softmax on the test set, for all weights and for the last
layer.

On this easy problem the MAP model is already calibrated (ECE 0.009) and the Laplace predictive,
which widens every prediction, is underconfident: ECE 0.43 for all weights, 0.23 for the last
layer, with the marginal-likelihood prior. That is the method and the prior, not the backend:
gradhooks' factors equal laplace-torch's curvlinops backend's here to the last bit (prior
precision 3.65, log marginal likelihood -676.4 after the same training), and its BackPack
backend, whose convolution factors differ, gives 4.71 / -972.6 and ECE 0.36.
"""
import argparse
import pathlib
import sys
import types

import torch
from torch import nn

# laplace-torch imports torchmetrics, which imports torchvision; a torchvision wheel built for
# another torch (a CUDA build beside a CPU torch) fails at import in this one submodule. Neither
# uses torchvision here: an empty stand-in (only if nothing imported it yet).
sys.modules.setdefault("torchvision._meta_registrations",
                       types.ModuleType("torchvision._meta_registrations"))
from laplace import Laplace  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

from gradhooks.integrations.laplace_backend import GradHooksGGN  # noqa: E402


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 16, 3), nn.ReLU(), nn.Conv2d(16, 32, 3), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(128, 10))


def calibration(probs: torch.Tensor, y: torch.Tensor, bins: int = 10):
    """(ECE, NLL, accuracy, per-bin confidence, per-bin accuracy, per-bin count)."""
    conf, pred = probs.max(1)
    correct = (pred == y).double()
    edges = torch.linspace(0, 1, bins + 1, dtype=probs.dtype)
    ece, bin_conf, bin_acc, counts = 0.0, [], [], []
    for lo, hi in zip(edges[:-1], edges[1:]):
        inside = (conf > lo) & (conf <= hi)
        n = int(inside.sum())
        counts.append(n)
        bin_conf.append(float(conf[inside].mean()) if n else float("nan"))
        bin_acc.append(float(correct[inside].mean()) if n else float("nan"))
        if n:
            ece += n / len(y) * abs(bin_acc[-1] - bin_conf[-1])
    nll = float(-probs[torch.arange(len(y)), y].clamp_min(1e-12).log().mean())
    return ece, nll, float(correct.mean()), bin_conf, bin_acc, counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--structure", default="kron", choices=["diag", "kron", "full"])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "laplace_digits.png"))
    args = parser.parse_args()
    torch.manual_seed(0)
    digits = load_digits()
    x = torch.as_tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.as_tensor(digits.target)
    perm = torch.randperm(len(y))
    train, test = perm[:1200], perm[1200:]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[train], y[train]),
                                         batch_size=100, shuffle=True)
    model = cnn()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3, weight_decay=1e-4)
    for _ in range(args.epochs):
        for xb, yb in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
    model.eval()
    fit_loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[train], y[train]),
                                             batch_size=100)
    with torch.no_grad():
        p_map = model(x[test]).softmax(1)
    rows = {"MAP": calibration(p_map.double(), y[test])}
    for weights in ("all", "last_layer"):
        la = Laplace(model, "classification", subset_of_weights=weights,
                     hessian_structure=args.structure, backend=GradHooksGGN)
        la.fit(fit_loader)
        la.optimize_prior_precision(method="marglik")
        p_la = la(x[test], pred_type="glm", link_approx="probit")
        name = f"Laplace ({args.structure}{', last layer' if weights == 'last_layer' else ''}, gradhooks)"
        rows[name] = calibration(p_la.double().detach(), y[test])
        print(f"{name}: prior precision {float(la.prior_precision):.3g}, "
              f"log marginal likelihood {float(la.log_marginal_likelihood()):.1f}")
    print(f"{'model':28s} {'acc':>6s} {'ECE':>7s} {'NLL':>7s}")
    for name, (ece, nll, acc, *_) in rows.items():
        print(f"{name:28s} {acc:6.3f} {ece:7.4f} {nll:7.4f}")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.plot([0, 1], [0, 1], "k:", lw=1)
    for name, (ece, _, _, conf, acc, _) in rows.items():
        ax.plot(conf, acc, "o-", label=f"{name}: ECE {ece:.3f}")
    ax.set_xlabel("confidence")
    ax.set_ylabel("accuracy")
    ax.set_title("Digits CNN: reliability")
    ax.legend(fontsize=8)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100, bbox_inches="tight")
    print(f"reliability plot: {out}")


if __name__ == "__main__":
    main()
