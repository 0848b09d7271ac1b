"""The example job as an autotune workload: what a probe needs, in one small class.

Registered by the package's entry point (pyproject.toml):
``[project.entry-points."autotune.workloads"] my-wl = "my_workload.workload:MyWorkload"``.
A worker runs it only when its operator allows it: ``autotune worker --allow-workload my-wl``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

from autotune.workloads import TrainingDefaults, Workload
from my_workload.data import Signal, make_datasets
from my_workload.model import Regressor

PRESETS = {
    "tiny": TrainingDefaults(batch_size=8, accum_steps=1, lr=3e-3, samples=1024),
    "full": TrainingDefaults(batch_size=64, accum_steps=1, lr=1e-3, samples=65536),
}


class MyWorkload(Workload):
    name = "my-wl"
    quality_metric = "val_loss"  # validation MSE; a study names its quality after it
    quality_direction = "minimize"
    aux_loss_name = "smoothness"  # the term inverse_loss_frequency thins out

    def __init__(self, preset: str) -> None:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r} for workload 'my-wl'; known: {', '.join(PRESETS)}")
        self.preset = preset

    @property
    def defaults(self) -> TrainingDefaults:
        return PRESETS[self.preset]

    def build_model(self) -> nn.Module:
        return Regressor()

    def datasets(self, seed: int) -> tuple[Dataset, Dataset]:
        return make_datasets()  # the probe orders the training samples by its own seed

    @torch.no_grad()
    def evaluate(self, model: nn.Module, val: Dataset, device: torch.device) -> float:
        assert isinstance(val, Signal)
        pred = model.predict(val.x.to(device))  # type: ignore[operator]
        return float(nn.functional.mse_loss(pred.float(), val.y.to(device)))
