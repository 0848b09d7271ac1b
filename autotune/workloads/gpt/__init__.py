"""The built-in workload `gpt`: a small GPT-style causal language model on text the project
generates (autotune/workloads/gpt/data.py; nothing is downloaded). Quality: validation
loss (mean next-token cross-entropy in nats per byte, fp32, lower is better). The optional
expensive loss term is ``mtp`` (multi-token prediction), thinned by inverse_loss_frequency.

Presets:
  tiny    context 64, dim 64, depth 2: a probe in seconds on a CPU (tests, the tutorial)
  full    context 512, dim 512, depth 8, heads 8, batch 16 × accum 2: ≈ 26.1 M parameters
  medium  context 1024, dim 768, depth 12, heads 12 (GPT-2 small's shape, byte tokens), batch 8 × accum 4:
          ≈ 87.0 M parameters: 1.5× full's width, for GPU studies where full's 512-wide matmuls bound the MFU
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from autotune.contract.workload import PresetWorkload, TrainingDefaults
from autotune.workloads.gpt.data import VOCAB, TextSpec, TokenWindows, load_or_generate
from autotune.workloads.gpt.model import GPTModel, GPTSpec


@dataclass(frozen=True)
class Preset:
    text: TextSpec
    model: GPTSpec
    training: TrainingDefaults


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        text=TextSpec(train_bytes=400_000, val_bytes=16_384),
        model=GPTSpec(vocab=VOCAB, context=64, dim=64, depth=2, heads=2),
        training=TrainingDefaults(batch_size=8, accum_steps=2, lr=3e-3, samples=2048, weight_decay=0.01),
    ),
    "full": Preset(
        text=TextSpec(train_bytes=24_000_000, val_bytes=262_144),
        model=GPTSpec(vocab=VOCAB, context=512, dim=512, depth=8, heads=8),
        training=TrainingDefaults(batch_size=16, accum_steps=2, lr=6e-4, samples=19200, weight_decay=0.1),
    ),
    "medium": Preset(
        text=TextSpec(train_bytes=24_000_000, val_bytes=262_144),  # full's text (one cache)
        model=GPTSpec(vocab=VOCAB, context=1024, dim=768, depth=12, heads=12),
        training=TrainingDefaults(batch_size=8, accum_steps=4, lr=6e-4, samples=9600, weight_decay=0.1),
    ),
}


class GPTWorkload(PresetWorkload):
    name = "gpt"
    quality_metric = "val_loss"
    quality_direction = "minimize"
    aux_loss_name = "mtp"

    presets = PRESETS
    spec: Preset

    def build_model(self) -> nn.Module:
        return GPTModel(self.spec.model)

    def datasets(self, seed: int) -> tuple[Dataset, Dataset]:
        """The training windows (their order is the probe's, from `seed`) and the fixed validation windows."""
        train, val = load_or_generate(self.spec.text)
        context = self.spec.model.context
        return TokenWindows(train, context), TokenWindows(val, context)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, val: Dataset, device: torch.device) -> float:
        """Mean next-token cross-entropy over every validation token (nats per byte)."""
        model.eval()
        total, count = 0.0, 0
        for batch in DataLoader(val, batch_size=32, shuffle=False):
            x, y = batch["x"].to(device), batch["y"].to(device)
            h = model.hidden(x)  # type: ignore[operator]
            logits = model.head(h).float()  # type: ignore[operator]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                                     reduction="sum")
            total += float(loss)
            count += y.numel()
        return total / count
