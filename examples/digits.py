"""Real data that ships offline and a small CNN, shared by the demo, the tests and benchmarks.

scikit-learn carries the UCI handwritten digits (1,797 images of 8×8 pixels, 10 classes), so
nothing is downloaded at run time.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn


def load_digits_split(test_fraction: float = 0.2, seed: int = 0):
    """Standardised digits as float32 tensors ``(x_train, y_train, x_test, y_test)``, N×1×8×8."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = (data.images.astype(np.float32) / 16.0 - 0.5) / 0.5
    x_tr, x_te, y_tr, y_te = train_test_split(x, data.target, test_size=test_fraction,
                                              random_state=seed, stratify=data.target)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))
    return t(x_tr).unsqueeze(1), t(y_tr).long(), t(x_te).unsqueeze(1), t(y_te).long()


class DigitsCNN(nn.Module):
    """Three conv blocks with batch norm and a two-layer head: 14 parameter tensors, ~60k weights."""

    def __init__(self, width: int = 32, classes: int = 10) -> None:
        super().__init__()
        w = width
        self.features = nn.Sequential(
            nn.Conv2d(1, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU(),
            nn.Conv2d(w, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(w, 2 * w, 3, padding=1), nn.BatchNorm2d(2 * w), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(2 * w * 2 * 2, 64), nn.ReLU(),
                                  nn.Linear(64, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).float().mean().item()
    model.train()
    return acc
