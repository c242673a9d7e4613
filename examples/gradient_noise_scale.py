"""Gradient noise scale while training an MLP on real digits, from per-sample gradients.

    python examples/gradient_noise_scale.py [--steps 60]

The "simple" noise scale B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018, arXiv:1812.06162,
sec. 2.2), with G the true gradient and Sigma the per-sample gradient covariance, says roughly
which batch size still speeds training up. Both are estimated without bias from each batch
(|G|^2 ~ |mean|^2 - tr(Sigma)/B) and smoothed by exponential moving averages (their appendix A). It needs per-sample gradients; here they come
from the same backward pass that trains the model. Needs scikit-learn and tqdm (`.[job]`).
"""
import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from tqdm import tqdm

import gradhooks

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--batch", type=int, default=64)
args = parser.parse_args()

torch.manual_seed(0)
digits = load_digits()
x_all = torch.tensor(digits.data, dtype=torch.float32) / 16.0   # (1797, 64)
y_all = torch.tensor(digits.target)
model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ema_trace = ema_g2 = 0.0

with gradhooks.attach(model, loss_reduction="mean") as gh:
    for step in (bar := tqdm(range(args.steps))):
        idx = torch.randint(0, len(x_all), (args.batch,))
        loss = F.cross_entropy(model(x_all[idx]), y_all[idx])
        opt.zero_grad()
        loss.backward()
        per = torch.cat([g.flatten(1) for g in gh.per_sample_grads().values()], 1)  # (B, P)
        trace_sigma = per.var(0, unbiased=True).sum().item()
        g2 = per.mean(0).pow(2).sum().item() - trace_sigma / args.batch
        ema_trace = trace_sigma if step == 0 else 0.9 * ema_trace + 0.1 * trace_sigma
        ema_g2 = g2 if step == 0 else 0.9 * ema_g2 + 0.1 * g2
        noise_scale = ema_trace / ema_g2
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", B_simple=f"{noise_scale:.0f}")
print(f"final loss {loss.item():.3f}, gradient noise scale B_simple ~ {noise_scale:.0f}")
