"""The workload interface: what the probe needs from a training job.

A workload supplies a model whose ``forward(batch, with_aux)`` returns a dict of scalar losses
with the key ``"total"`` (``with_aux`` adds the expensive auxiliary loss, ``aux_loss_name``, which
the ``inverse_loss_frequency`` knob thins out), training and validation datasets of dict items,
and a quality metric (``quality_metric``, ``quality_direction``) computed in fp32 on the
validation set; presets give the default batch size, accumulation, learning rate and sample
budget. The optional hooks (`build_optimizers`, `grad_clip_norm`, `lr_multiplier`,
`sample_batch`) default to what a probe trained with before a workload could say otherwise.
`PresetWorkload` is the shortcut for a table of presets. Writing one: docs/workloads.md and examples/my_workload.

No torch at run time (only for type checking): the registry imports this module, and the
service and the worker read the registry without torch. A workload's own module imports torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:  # the registry (autotune.workloads) is read by the service and the worker: no torch there
    import torch
    from torch import nn
    from torch.utils.data import Dataset

    from autotune.contract.config import TrainConfig
    from autotune.engine.optimizers import OptimizerLike


QUALITY_DIRECTIONS = ("minimize", "maximize")


@dataclass(frozen=True)
class TrainingDefaults:
    batch_size: int
    accum_steps: int
    lr: float
    samples: int  # training samples per probe (every probe of a study trains the same number)
    weight_decay: float = 0.0
    warmup_fraction: float = 0.05  # LR warm-up, as a fraction of the probe's samples
    final_lr_fraction: float = 0.1  # cosine decay ends at this fraction of lr
    grad_clip_norm: float | None = None  # clip the gradients' global L2 norm to this (None: no clipping)


class Workload(ABC):
    """One training job at one preset. Instances are cheap; data loads lazily."""

    name: str
    preset: str
    quality_metric: str = "val_nrmse"
    quality_direction: str = "minimize"  # "minimize" | "maximize"
    aux_loss_name: str | None = None  # the optional expensive loss term thinned by inverse_loss_frequency

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
        """The quality metric (`quality_metric`) on the validation set, in fp32; better is lower
        or higher as `quality_direction` says."""

    def build_optimizers(self, model: nn.Module, config: TrainConfig) -> OptimizerLike:
        """The optimizer(s) of this job's step over `model` (already on its device, wrapped for
        several ranks where there are several). Default: AdamW, the preset's lr and weight decay."""
        from autotune.engine.optimizers import adamw

        assert config.lr is not None, "resolve() the config first"
        return adamw(model, config.lr, self.defaults.weight_decay)

    @property
    def grad_clip_norm(self) -> float | None:
        """Clip the gradients' global L2 norm to this before each optimizer step (None: no clipping)."""
        return self.defaults.grad_clip_norm

    def lr_multiplier(self, progress: float) -> float:
        """The factor of each parameter group's base lr at `progress` (samples trained / the
        probe's budget). Default: warm-up, then cosine (`autotune.engine.knobs.lr_factor`)."""
        from autotune.engine.knobs import lr_factor

        d = self.defaults
        return lr_factor(progress, d.warmup_fraction, d.final_lr_fraction)

    def sample_batch(self, batch_size: int, generator: torch.Generator, device: torch.device) -> dict[str, Any]:
        """Optional: the job's own data path. Override it when the job makes its training
        batches itself (nanoGPT's ``get_batch``: random windows of a token tensor, copied to
        the GPU): return one micro-batch of `batch_size` samples as a dict of tensors on
        `device`, drawing its randomness from `generator` (a CPU generator seeded by the
        probe's seed). The probe then trains on these batches, calling this in its loop as the
        job does, and records the DataLoader knobs as inactive; the training dataset of
        `datasets` is not read (its validation set still is). Not overridden: the probe feeds
        the training dataset through a DataLoader built from the DataLoader knobs."""
        raise NotImplementedError(f"{type(self).__name__} has no sample_batch: the probe uses a DataLoader")


class PresetWorkload(Workload):
    """A workload whose presets are a table: name → a spec with a ``training`` field
    (TrainingDefaults). Subclasses set `presets` and annotate `spec` with their spec type."""

    presets: ClassVar[Mapping[str, Any]]
    spec: Any

    def __init__(self, preset: str) -> None:
        if preset not in self.presets:
            raise ValueError(f"unknown preset {preset!r} for workload {self.name!r}; "
                             f"known: {', '.join(self.presets)}")
        self.preset = preset
        self.spec = self.presets[preset]

    @property
    def defaults(self) -> TrainingDefaults:
        training: TrainingDefaults = self.spec.training
        return training
