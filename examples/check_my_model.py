"""Check gradhooks against looped autograd on your own model, and time both.

    python examples/check_my_model.py

`gradhooks.compare` runs the hooks and the one-sample-at-a-time loop on the same batch and
prints, per parameter, the largest absolute and relative error and the time of each method.
Replace the model and batch below with yours.
"""
import torch
from torch import nn

import gradhooks


class Block(nn.Module):
    """A residual block with functional ops between the layers."""

    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, padding_mode="reflect")
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, groups=c)  # depthwise

    def forward(self, x):
        return x + self.conv2(torch.relu(self.conv1(x)))


torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), Block(8), Block(8), nn.AdaptiveAvgPool2d(1),
                      nn.Flatten(), nn.Linear(8, 5)).double()
x, y = torch.randn(16, 3, 17, 17, dtype=torch.float64), torch.randint(0, 5, (16,))

report = gradhooks.compare(model, nn.CrossEntropyLoss(), x, y, loss_reduction="mean")
print(report)
assert report.ok, "gradhooks disagrees with looped autograd"
