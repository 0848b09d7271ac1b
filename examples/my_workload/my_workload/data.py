"""The data of the example job: y = sin(3x) + 0.5·cos(7x) + noise, fixed seeds."""

from __future__ import annotations

import math

import torch
from torch.utils.data import Dataset


class Signal(Dataset):
    """n points x ∈ [-π, π] with targets; items are dicts {"x": (1,), "y": (1,)}."""

    def __init__(self, n: int, seed: int, noise: float = 0.05) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = (torch.rand(n, 1, generator=g) * 2 - 1) * math.pi
        self.y = torch.sin(3 * self.x) + 0.5 * torch.cos(7 * self.x) + noise * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


def make_datasets() -> tuple[Signal, Signal]:
    """(train, validation): different seeds, the validation set fixed."""
    return Signal(2048, seed=1), Signal(512, seed=2)
