"""Per-sample gradients of a stock CNN on real handwritten digits (scikit-learn's bundled set).

    python examples/quickstart.py

Attaches gradhooks, runs one batch, and prints each parameter's per-sample gradient shape and the
per-sample gradient norms (the quantity DP-SGD clips). Needs scikit-learn (`pip install -e .[job]`).
"""
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import gradhooks

torch.manual_seed(0)
digits = load_digits()
x = torch.tensor(digits.images[:32], dtype=torch.float32).unsqueeze(1) / 16.0  # (32, 1, 8, 8)
y = torch.tensor(digits.target[:32])

model = nn.Sequential(
    nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),   # (B, 16, 4, 4)
    nn.Conv2d(16, 16, 3, padding=1, groups=4), nn.ReLU(), nn.Flatten(),       # (B, 256)
    nn.Linear(256, 10),
)

with gradhooks.attach(model, loss_reduction="mean") as gh:
    loss = F.cross_entropy(model(x), y)          # reduction="mean", as declared
    loss.backward()
    grads = gh.per_sample_grads()                 # {name: (B, *param.shape)}

for name, g in grads.items():
    print(f"{name:10s} per-sample gradient {tuple(g.shape)}")
norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in grads.values()))  # (B,)
print("per-sample gradient norms:", [round(v, 3) for v in norms.tolist()[:8]], "...")
# With loss_reduction="mean" the batch gradient is the mean of the per-sample gradients:
print("mean of per-sample == param.grad:",
      all(torch.allclose(grads[n].mean(0), p.grad, atol=1e-6) for n, p in model.named_parameters()))
