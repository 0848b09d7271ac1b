"""The workload interface: what the probe needs from a training job.

A workload supplies a model whose ``forward(batch, with_aux)`` returns a dict of scalar
losses with the key ``"total"`` (``with_aux`` turns the workload's expensive auxiliary
losses on, which the ``inverse_loss_frequency`` knob thins out), training and validation
datasets of dict items, and a quality metric computed in fp32 on the validation set
(lower is better). Presets give the default batch size, accumulation, learning rate and
sample budget.

This module does not import torch at run time (only for type checking): the registry in
`autotune.workloads` imports it, and the service and the worker read the registry without
torch. A workload's own module imports torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the registry (autotune.workloads) is read by the service and the worker: no torch there
    import torch
    from torch import nn
    from torch.utils.data import Dataset


@dataclass(frozen=True)
class TrainingDefaults:
    batch_size: int
    accum_steps: int
    lr: float
    samples: int  # training samples per probe (every probe of a study trains the same number)
    weight_decay: float = 0.0
    warmup_fraction: float = 0.05  # LR warm-up, as a fraction of the probe's samples
    final_lr_fraction: float = 0.1  # cosine decay ends at this fraction of lr


class Workload(ABC):
    """One training job at one preset. Instances are cheap; data loads lazily."""

    name: str
    preset: str
    quality_metric: str = "val_nrmse"

    @property
    @abstractmethod
    def defaults(self) -> TrainingDefaults: ...

    @abstractmethod
    def build_model(self) -> nn.Module:
        """A freshly initialised model (uses the global torch RNG: seed before calling)."""

    @abstractmethod
    def datasets(self, seed: int) -> tuple[Dataset, Dataset]:
        """(train, validation) datasets; validation is fixed and independent of `seed`'s training order."""

    @abstractmethod
    def evaluate(self, model: nn.Module, val: Dataset, device: torch.device) -> float:
        """The quality metric on the validation set, in fp32 (lower is better)."""
