"""The glue: train.py's job as an autotune workload, built from the script's own functions.

Registered as ``gpt-script`` by the package's entry point (pyproject.toml). Each hook is one
of the script's parts: build_model, get_batch (the script's own data path: random windows
copied to the device, no DataLoader), estimate_loss (quality), configure_optimizers (the two
AdamW groups), grad_clip (clipping) and get_lr (the schedule, over the probe's samples).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

from autotune.contract.config import TrainConfig
from autotune.workloads import TrainingDefaults, Workload
from gpt_script import train as script


class Windows(Dataset):
    """The script's token stream as dict items: every window of block_size and its targets."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data) - script.block_size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.data[i : i + script.block_size], "y": self.data[i + 1 : i + 1 + script.block_size]}


class Probed(nn.Module):
    """The script's GPT with the probe's forward: (batch, with_aux) -> {"total": loss}."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = script.build_model()

    def forward(self, batch: dict[str, torch.Tensor], with_aux: bool = True) -> dict[str, torch.Tensor]:
        return {"total": self.gpt(batch["x"], batch["y"])[1]}


class ScriptWorkload(Workload):
    name = "gpt-script"
    quality_metric = "val_loss"
    grad_clip_norm = script.grad_clip  # the script's clip_grad_norm_(..., 1.0)

    def __init__(self, preset: str) -> None:
        script.use_size(preset)  # the script's --size: tiny, or char (a ValueError names them)
        self.preset = preset

    @property
    def defaults(self) -> TrainingDefaults:
        return TrainingDefaults(batch_size=script.batch_size, accum_steps=script.gradient_accumulation_steps,
                                lr=script.learning_rate, samples=2048)

    def build_model(self) -> nn.Module:
        return Probed()

    def datasets(self, seed: int) -> tuple[Dataset, Dataset]:
        return Windows(script.train_data), Windows(script.val_data)  # training batches: sample_batch

    def sample_batch(self, batch_size: int, generator: torch.Generator,
                     device: torch.device) -> dict[str, torch.Tensor]:  # the script's own data path
        x, y = script.get_batch("train", batch_size, device=str(device), generator=generator)
        return {"x": x, "y": y}

    def evaluate(self, model: nn.Module, val: Dataset, device: torch.device) -> float:
        return script.estimate_loss(model.gpt, "val", device=str(device))  # type: ignore[arg-type]

    def build_optimizers(self, model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
        assert config.lr is not None  # the preset's, or the trial's
        return script.configure_optimizers(model, script.weight_decay, config.lr, (script.beta1, script.beta2))

    def lr_multiplier(self, progress: float) -> float:  # get_lr over max_iters, stretched over the probe
        return script.get_lr(progress * script.max_iters) / script.learning_rate
