"""The model of the example job: an MLP of residual blocks, with an optional smoothness loss."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    """Residual MLP block. `checkpoint` ("none" | "block") is the attribute autotune's
    checkpoint knob sets: "block" recomputes the block's activations in backward."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.checkpoint = "none"

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.checkpoint != "none" and torch.is_grad_enabled():
            return h + checkpoint(self.net, h, use_reentrant=False)
        return h + self.net(h)


class Regressor(nn.Module):
    def __init__(self, dim: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(1, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, 1)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def forward(self, batch: dict[str, torch.Tensor], with_aux: bool = True) -> dict[str, torch.Tensor]:
        """Losses: "mse", and "smoothness" (an extra forward pass at shifted inputs: the
        expensive optional term) when `with_aux`; "total" is what is trained."""
        pred = self.predict(batch["x"]).float()
        mse = nn.functional.mse_loss(pred, batch["y"])
        losses = {"mse": mse, "total": mse}
        if with_aux:
            shifted = self.predict(batch["x"] + 1e-2).float()
            losses["smoothness"] = (shifted - pred).pow(2).mean()
            losses["total"] = mse + 0.1 * losses["smoothness"]
        return losses
