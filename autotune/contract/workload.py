"""The workload interface: what the probe needs from a training job.

A workload supplies a model whose ``forward(batch, with_aux)`` returns a dict of scalar
losses with the key ``"total"`` (``with_aux`` turns the workload's expensive auxiliary
losses on, which the ``inverse_loss_frequency`` knob thins out), training and validation
datasets of dict items, and a quality metric computed in fp32 on the validation set.
Presets give the default batch size, accumulation, learning rate and sample budget.

The quality metric is named by ``quality_metric`` (``"val_nrmse"`` for field regression,
``"val_loss"`` for a language model, ...) and has a ``quality_direction``: ``"minimize"``
(the default: lower is better) or ``"maximize"`` (an accuracy). The study's quality gate
compares every trial's metric with the baseline's in that direction (autotune/contract/gate.py).
``aux_loss_name`` names the expensive optional loss term that ``forward(batch,
with_aux=True)`` adds and the ``inverse_loss_frequency`` knob thins out (None: the model has
none, and the knob changes nothing).

Minimal example (see examples/my_workload for an installable one)::

    class MyWorkload(Workload):
        name = "my-wl"                      # the name studies use
        quality_metric = "val_loss"
        presets = ("tiny",)

        def __init__(self, preset: str) -> None:
            self.preset = preset

        @property
        def defaults(self) -> TrainingDefaults:
            return TrainingDefaults(batch_size=16, accum_steps=1, lr=1e-3, samples=2048)

        def build_model(self) -> nn.Module: ...          # forward(batch, with_aux) -> {"total": ...}
        def datasets(self, seed): ...                     # (train, val) of dict items
        def evaluate(self, model, val, device) -> float:  # the quality metric, fp32

Optional hooks (defaults: what a probe trained with before a workload could say otherwise):

* ``build_optimizers(model, config)``: the optimizer(s) of the user's step, from the model
  and the trial's config (``config.lr`` is the resolved learning rate): any
  ``torch.optim.Optimizer`` with any parameter groups, or a list of them (a Muon + AdamW
  hybrid: `autotune.engine.optimizers.muon_adamw`). Default: AdamW over every trainable parameter
  with the preset's lr and weight decay. The knobs act on what it returns, in place
  (``fused_optimizer`` sets the groups' fused/foreach flags where the optimizer has them);
  a knob that cannot act on it is recorded as inactive with the reason.
* ``grad_clip_norm``: clip the gradients' global L2 norm to this before each optimizer step
  (None: no clipping). Default: the preset's ``TrainingDefaults.grad_clip_norm``.
* ``lr_multiplier(progress)``: the LR schedule, as the factor each parameter group's base lr
  is multiplied by at `progress` (samples trained / the probe's sample budget, in [0, 1]).
  Default: linear warm-up over ``warmup_fraction``, then cosine to ``final_lr_fraction``.
  Over samples, not steps: every batch size follows the same schedule.

`PresetWorkload` is the shortcut for a workload whose presets are a table of specs (the
built-in ones use it); a workload may subclass `Workload` directly.

This module does not import torch at run time (only for type checking): the registry in
`autotune.workloads` imports it, and the service and the worker read the registry without
torch. A workload's own module imports torch.
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
