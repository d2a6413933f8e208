"""A user's own model and dataset, as `--model user_code:SkipsOnOdd --dataset user_code:vectors`.

Flat vectors, not images, and a model whose forward skips a layer on odd training steps: the kind of
model DDP's static_graph would train wrongly. Tests copy this file into a temp directory, where
nothing installed can see it.
"""
import torch
from torch import nn
from torch.utils.data import TensorDataset


def vectors(split, data_dir, image_size):
    """20 features; the class is the argmax of a fixed linear map of them, so it can be learned."""
    g = torch.Generator().manual_seed(0 if split == "train" else 1)
    x = torch.randn(1024 if split == "train" else 256, 20, generator=g)
    w = torch.randn(20, 4, generator=torch.Generator().manual_seed(42))
    return TensorDataset(x, (x @ w).argmax(1))


class SkipsOnOdd(nn.Module):
    def __init__(self, num_classes, in_channels):
        super().__init__()
        self.inp, self.extra, self.out = nn.Linear(in_channels, 64), nn.Linear(64, 64), nn.Linear(64, num_classes)
        self.steps = 0

    def forward(self, x):
        h = torch.relu(self.inp(x))
        if self.training:
            self.steps += 1
        if not (self.training and self.steps % 2 == 1):
            h = h + torch.relu(self.extra(h))  # a residual branch, skipped on odd steps
        return self.out(h)
