"""Quality metrics, computed in float64 on the host side of the comparison."""

from __future__ import annotations

import torch


def nrmse_per_sample(pred: torch.Tensor, true: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """‖pred − true‖₂ / ‖true‖₂ for every (sample, field); inputs (B, C, N) → (B, C).

    The norm runs over the last axis (the points). Computed in float64 so that low-precision
    training cannot leak into the quality number.
    """
    if pred.shape != true.shape:
        raise ValueError(f"pred {tuple(pred.shape)} and true {tuple(true.shape)} differ in shape")
    p, t = pred.double(), true.double()
    return torch.linalg.vector_norm(p - t, dim=-1) / torch.linalg.vector_norm(t, dim=-1).clamp_min(eps)


def nrmse(pred: torch.Tensor, true: torch.Tensor) -> float:
    """Mean NRMSE over samples and fields."""
    return float(nrmse_per_sample(pred, true).mean())
