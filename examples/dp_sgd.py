"""DP-SGD training of the tutorial CNN on real digits: per-sample clipping, Gaussian noise, epsilon.

    python examples/dp_sgd.py [--epochs 5] [--steps N] [--batch 128] [--sigma 1.0]
                              [--max-norm 1.0] [--lr 0.1] [--delta 1e-5] [--seed 0] [--threads N]

DP-SGD (Abadi et al. 2016, arXiv:1607.00133, algorithm 1): each step draws a batch by **Poisson
sampling** (every training example joins independently with probability q = batch / N, so the
batch size varies), clips each example's gradient to norm C, sums, adds N(0, sigma^2 C^2) noise
to every coordinate, divides by the *expected* batch size q N, and takes an SGD step. The
privacy budget epsilon at the stated delta comes from Opacus' RDP accountant
(``opacus.accountants.RDPAccountant``; Mironov et al. 2019, "Renyi differential privacy of the
sampled Gaussian mechanism"), which assumes exactly this Poisson-subsampled Gaussian mechanism.

The model is ``gradhooks.tools.workloads.DigitsCNN`` (PyTorch's per-sample-gradients tutorial CNN) on
scikit-learn's 1797 8x8 digits upsampled to 28x28 (``gradhooks.tools.workloads.load_digits_batch``), split
80/20 into train and test with the seed. Training runs three times from the same seed: with
ghost clipping by book-keeping (``gh.backward(loss)`` then ``gh.clip_and_accumulate``: norms and
clipped sum from the recorded activations and grad_outputs, no per-sample gradient tensors; Bu
et al. 2023), with two-pass ghost clipping (``gh.clipped_backward(per-sample losses)``: norms in
a first backward, clipped sum by a second; Li et al. 2022; peak memory close to plain training)
and with materialised per-sample gradients. One step of the three agrees to float32 rounding; over many steps training amplifies those rounding differences (as it would any
perturbation of the weights), so the script prints the largest parameter difference after the
first step and at the end. The sampling and noise use seeded
``torch.Generator``s so that the two runs match; a real deployment draws both from a secure
source. Needs scikit-learn, tqdm and opacus (``pip install -e .[examples]``).
"""
import argparse
import time

import torch
import torch.nn.functional as F
from opacus.accountants import RDPAccountant
from tqdm import tqdm

import gradhooks
from gradhooks.tools.workloads import DigitsCNN, load_digits_batch

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=float, default=5.0,
                    help="passes over the training set (steps = epochs / q)")
parser.add_argument("--steps", type=int, default=None, help="number of steps (overrides --epochs)")
parser.add_argument("--batch", type=int, default=128, help="expected batch size q N")
parser.add_argument("--sigma", type=float, default=1.0, help="noise multiplier")
parser.add_argument("--max-norm", type=float, default=1.0, help="clipping bound C")
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--delta", type=float, default=1e-5)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
parser.add_argument("--no-progress", action="store_true", help="no progress bar")
args = parser.parse_args()
if args.threads:
    torch.set_num_threads(args.threads)

x_all, y_all = load_digits_batch(torch.float32, batch=1797)  # (1797, 1, 28, 28), (1797,)
perm = torch.randperm(len(x_all), generator=torch.Generator().manual_seed(args.seed))
n_train = int(0.8 * len(x_all))
x_train, y_train = x_all[perm[:n_train]], y_all[perm[:n_train]]
x_test, y_test = x_all[perm[n_train:]], y_all[perm[n_train:]]
q = args.batch / n_train
steps = args.steps if args.steps is not None else max(1, round(args.epochs / q))


def train(method: str):
    """DP-SGD with gradhooks' clipping ``method``, the same seeds whatever the method. Returns
    the model and a copy of its parameters after the first step."""
    torch.manual_seed(args.seed)
    model = DigitsCNN()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sampler = torch.Generator().manual_seed(args.seed + 1)
    noise = torch.Generator().manual_seed(args.seed + 2)
    with gradhooks.attach(model, loss_reduction="sum") as gh:
        bar = tqdm(range(steps), desc=f"{method:>11}", disable=args.no_progress)
        for step in bar:
            idx = (torch.rand(n_train, generator=sampler) < q).nonzero().squeeze(1)  # Poisson
            opt.zero_grad()
            if len(idx) > 0:
                losses = F.cross_entropy(model(x_train[idx]), y_train[idx], reduction="none")
                if method == "two-pass":
                    gh.clipped_backward(losses, args.max_norm, noise_multiplier=args.sigma,
                                        generator=noise)
                else:
                    gh.backward(losses.sum())  # grad_outputs only: no batch gradient needed
                    gh.clip_and_accumulate(args.max_norm, method=method,
                                           noise_multiplier=args.sigma, generator=noise)
                bar.set_postfix(batch=len(idx), loss=f"{losses.mean().item():.3f}")
            else:  # an empty batch still releases noise
                for p in model.parameters():
                    p.grad = args.sigma * args.max_norm * torch.randn(p.shape, generator=noise)
            for p in model.parameters():
                p.grad /= q * n_train  # DP-SGD divides by the expected batch size
            opt.step()
            if step == 0:
                first = [p.detach().clone() for p in model.parameters()]
    return model, first


@torch.no_grad()
def accuracy(model: DigitsCNN) -> float:
    return (model(x_test).argmax(1) == y_test).float().mean().item()


models, firsts = {}, {}
METHODS = ("ghost", "two-pass", "materialize")
for method in METHODS:
    start = time.perf_counter()
    models[method], firsts[method] = train(method)
    print(f"{method:<11}: test accuracy {100 * accuracy(models[method]):.1f}% "
          f"({time.perf_counter() - start:.1f} s)")

accountant = RDPAccountant()
for _ in range(steps):
    accountant.step(noise_multiplier=args.sigma, sample_rate=q)
eps = accountant.get_epsilon(delta=args.delta)


def max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


largest = max(p.abs().max().item() for p in models["ghost"].parameters())
print(f"epsilon = {eps:.2f} at delta = {args.delta:g} (RDP accountant, Poisson sampling q = "
      f"{q:.4f}, sigma = {args.sigma}, C = {args.max_norm}, {steps} steps, {n_train} train / "
      f"{len(x_test)} test digits)")
for other in METHODS[1:]:
    first_diff = max_diff(firsts["ghost"], firsts[other])
    diff = max_diff(models["ghost"].parameters(), models[other].parameters())
    print(f"max |parameter difference| ghost vs {other}: {first_diff:.2e} after step 1, "
          f"{diff:.2e} after {steps} steps (largest |parameter| {largest:.2f})")
