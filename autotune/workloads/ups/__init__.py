"""The reference workload `ups`: a PDE-transformer (Universal-Physics-Stack shape) on
Burgers and advection trajectories from the project's own solver.

Presets:
  tiny       a probe in seconds on a CPU (tests, demos)
  full       latent 128 tokens × 128 dims, hidden 384, depth 12, batch 12 × accum 4
             (the starting point of the source research); ≈ 23.3 M parameters
  tiny-muon  tiny, trained as the research's job is: a Muon + AdamW hybrid
  full-muon  full, likewise

The ``-muon`` presets use ``torch.optim.Muon`` (torch >= 2.9; on an older torch their probes
fail as ``unsupported``) for the nn.Linear weight matrices and AdamW for the rest, with one
learning rate and the gradients' global norm clipped at 1.0; ``tiny`` and ``full`` use AdamW alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from autotune.contract.config import TrainConfig
from autotune.contract.workload import PresetWorkload, TrainingDefaults
from autotune.engine.metrics import nrmse_per_sample
from autotune.engine.optimizers import OptimizerLike, muon_adamw
from autotune.workloads.ups.data import DataSpec, PairDataset, load_or_generate, split_indices
from autotune.workloads.ups.model import ModelSpec, UPSModel


@dataclass(frozen=True)
class Preset:
    data: DataSpec
    model: ModelSpec
    n_queries: int
    training: TrainingDefaults
    optimizer: str = "adamw"  # "adamw" | "muon" (Muon + AdamW, autotune.engine.optimizers.muon_adamw)


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        data=DataSpec(n_points=32, traj_per_physics=16, n_snapshots=9),
        model=ModelSpec(n_fields=2, n_points=32, latent_tokens=8, latent_dim=16, hidden=32, depth=2, heads=2,
                        fourier_modes=8),
        n_queries=16,
        training=TrainingDefaults(batch_size=4, accum_steps=2, lr=3e-3, samples=3072, weight_decay=0.03),
    ),
    "full": Preset(
        data=DataSpec(n_points=256, traj_per_physics=160, n_snapshots=41),
        model=ModelSpec(n_fields=2, n_points=256, latent_tokens=128, latent_dim=128, hidden=384, depth=12, heads=6,
                        fourier_modes=16),
        n_queries=128,
        training=TrainingDefaults(batch_size=12, accum_steps=4, lr=5e-4, samples=19200, weight_decay=0.03),
    ),
}
MUON_CLIP_NORM = 1.0
for _name in ("tiny", "full"):
    _base = PRESETS[_name]
    PRESETS[f"{_name}-muon"] = replace(_base, optimizer="muon",
                                        training=replace(_base.training, grad_clip_norm=MUON_CLIP_NORM))


class UPSWorkload(PresetWorkload):
    name = "ups"
    quality_metric = "val_nrmse"
    quality_direction = "minimize"
    aux_loss_name = "inverse"  # decode(encode(u)) ≈ u and encode(decode(z)) ≈ z

    presets = PRESETS
    spec: Preset

    def build_model(self) -> nn.Module:
        return UPSModel(self.spec.model)

    def build_optimizers(self, model: nn.Module, config: TrainConfig) -> OptimizerLike:
        """AdamW (``tiny``, ``full``) or the research's Muon + AdamW hybrid (``-muon`` presets)."""
        if self.spec.optimizer == "muon":
            assert config.lr is not None
            return muon_adamw(model, config.lr, self.defaults.weight_decay)
        return super().build_optimizers(model, config)

    def datasets(self, seed: int) -> tuple[Dataset, Dataset]:
        fields, physics = load_or_generate(self.spec.data)
        train_idx, val_idx = split_indices(physics, self.spec.data.val_fraction)
        train = PairDataset(fields, train_idx, n_queries=self.spec.n_queries, seed=seed)
        val = PairDataset(fields, val_idx, n_queries=None, seed=0)
        return train, val

    @torch.no_grad()
    def evaluate(self, model: nn.Module, val: Dataset, device: torch.device) -> float:
        """Mean NRMSE of the one-step prediction on every grid point of the held-out set."""
        model.eval()
        total, count = 0.0, 0
        for batch in DataLoader(val, batch_size=64, shuffle=False):
            pred = model.predict(batch["u"].to(device), batch["q"].to(device))  # type: ignore[operator]
            per = nrmse_per_sample(pred.cpu(), batch["y"])
            total += float(per.sum())
            count += per.numel()
        return total / count
