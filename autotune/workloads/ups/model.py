"""The `ups` model: grid encoder → latent transformer operator → any-point decoder.

Shaped like the Universal Physics Stack of the source research: a field sampled on a grid
is encoded into a fixed set of latent tokens (supernode pooling of grid patches refined by
cross-attention to every point), a stack of pre-norm transformer blocks (RMSNorm, SDPA attention, MLP) advances
the latent state by one time step, and a decoder answers queries at arbitrary coordinates
by cross-attending to the latent tokens. Two inverse losses keep the latent space
consistent and are the expensive auxiliary terms that `inverse_loss_frequency` thins out:
decode(encode(u)) ≈ u and encode(decode(z)) ≈ z.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from autotune.engine.checkpoint_policy import save_matmuls_policy


@dataclass(frozen=True)
class ModelSpec:
    n_fields: int
    n_points: int
    latent_tokens: int
    latent_dim: int
    hidden: int
    depth: int
    heads: int
    mlp_ratio: int = 4
    fourier_modes: int = 16
    inverse_weight: float = 0.5


class FourierFeatures(nn.Module):
    """Periodic coordinate embedding x ↦ [sin(kx), cos(kx)], k = 1..m."""

    k: torch.Tensor

    def __init__(self, modes: int) -> None:
        super().__init__()
        self.register_buffer("k", torch.arange(1, modes + 1, dtype=torch.float32), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        angles = x.unsqueeze(-1) * self.k
        return torch.cat([angles.sin(), angles.cos()], dim=-1)


class Attention(nn.Module):
    """Multi-head attention through F.scaled_dot_product_attention (flash/efficient kernels)."""

    def __init__(self, dim: int, heads: int, kv_dim: int | None = None) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(kv_dim or dim, 2 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        b, n, d = x.shape
        context = x if context is None else context
        q = self.q(x).reshape(b, n, self.heads, d // self.heads).transpose(1, 2)
        k, v = self.kv(context).reshape(b, context.shape[1], 2, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, n, d))


class MLP(nn.Module):
    def __init__(self, dim: int, ratio: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, ratio * dim)
        self.fc2 = nn.Linear(ratio * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block. `checkpoint` selects what is recomputed in backward:
    none | block (the whole block) | attn (attention sub-layer) | mlp (MLP sub-layer) |
    selective (whole block, but matmul outputs are saved; see `save_matmuls_policy`)."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.RMSNorm(dim)
        self.mlp = MLP(dim, mlp_ratio)
        self.checkpoint = "none"

    def _attn(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(self.norm1(x))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.norm2(x))

    def _block(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._attn(x)
        return x + self._mlp(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mode = self.checkpoint
        if mode == "none" or not torch.is_grad_enabled():
            return self._block(x)
        if mode == "block":
            return checkpoint(self._block, x, use_reentrant=False)
        if mode == "attn":
            x = x + checkpoint(self._attn, x, use_reentrant=False)
            return x + self._mlp(x)
        if mode == "mlp":
            x = x + self._attn(x)
            return x + checkpoint(self._mlp, x, use_reentrant=False)
        if mode == "selective":
            context = partial(create_selective_checkpoint_contexts, save_matmuls_policy)
            return checkpoint(self._block, x, use_reentrant=False, context_fn=context)
        raise ValueError(f"unknown checkpoint mode {mode!r}")


class UPSModel(nn.Module):
    """forward(batch, with_inverse) returns the training losses as a dict of scalars."""

    grid_x: torch.Tensor
    latent_x: torch.Tensor

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        h, c = spec.hidden, spec.n_fields
        self.coords = FourierFeatures(spec.fourier_modes)
        # encoder: grid stem (conv over neighbours) + coordinate embedding → cross-attention
        self.stem = nn.Conv1d(c, h, kernel_size=3, padding=1, padding_mode="circular")
        self.enc_pos = nn.Linear(2 * spec.fourier_modes, h)
        self.latent_queries = nn.Parameter(torch.randn(spec.latent_tokens, h) / math.sqrt(h))
        self.enc_norm = nn.RMSNorm(h)
        self.enc_attn = Attention(h, spec.heads)
        self.enc_out = nn.Linear(h, spec.latent_dim)
        # latent operator
        self.op_in = nn.Linear(spec.latent_dim, h)
        self.blocks = nn.ModuleList(Block(h, spec.heads, spec.mlp_ratio) for _ in range(spec.depth))
        self.op_norm = nn.RMSNorm(h)
        self.op_out = nn.Linear(h, spec.latent_dim)
        # any-point decoder
        self.dec_pos = nn.Linear(2 * spec.fourier_modes, h)
        self.dec_latent = nn.Linear(spec.latent_dim, h)
        self.dec_attn = Attention(h, spec.heads)
        self.dec_mlp = MLP(h, 2)
        self.dec_out = nn.Linear(h, c)
        if spec.n_points % spec.latent_tokens:
            raise ValueError(f"n_points ({spec.n_points}) must be a multiple of latent_tokens ({spec.latent_tokens})")
        self.register_buffer(
            "grid_x", 2 * math.pi * torch.arange(spec.n_points, dtype=torch.float32) / spec.n_points,
            persistent=False,
        )
        patch = spec.n_points // spec.latent_tokens  # latent token i sits at the centre of its patch
        self.register_buffer("latent_x", self.grid_x.reshape(spec.latent_tokens, patch).mean(dim=1),
                             persistent=False)

    def encode(self, u: torch.Tensor) -> torch.Tensor:
        """(B, C, N) on the grid → (B, T, latent_dim).

        Supernode pooling: each latent token starts as the mean of a contiguous patch of
        N/T grid points (so the latent carries spatial structure from initialisation), then
        a cross-attention over all points refines it.
        """
        b = u.shape[0]
        t = self.spec.latent_tokens
        points = self.stem(u).transpose(1, 2) + self.enc_pos(self.coords(self.grid_x))  # (B, N, h)
        pooled = points.reshape(b, t, -1, points.shape[-1]).mean(dim=2)  # (B, T, h)
        z = pooled + self.latent_queries
        z = z + self.enc_attn(self.enc_norm(z), self.enc_norm(points))
        return self.enc_out(z)

    def advance(self, z: torch.Tensor) -> torch.Tensor:
        """One time step in latent space (residual)."""
        x = self.op_in(z)
        for block in self.blocks:
            x = block(x)
        return z + self.op_out(self.op_norm(x))

    def decode(self, z: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Latent (B, T, D) queried at coordinates q (B, Q) → fields (B, C, Q)."""
        pos = self.dec_pos(self.coords(q))
        latent = self.dec_latent(z) + self.dec_pos(self.coords(self.latent_x))  # tokens know their place
        x = pos + self.dec_attn(pos, latent)
        x = x + self.dec_mlp(x)
        return self.dec_out(x).transpose(1, 2)

    def predict(self, u: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return self.decode(self.advance(self.encode(u)), q)

    def forward(self, batch: dict[str, torch.Tensor], with_inverse: bool = True) -> dict[str, torch.Tensor]:
        u, q, y = batch["u"], batch["q"], batch["y"]
        z = self.encode(u)
        losses = {"forward": F.mse_loss(self.decode(self.advance(z), q).float(), y)}
        total = losses["forward"]
        if with_inverse:
            # inverse encoding: the latent must reconstruct its own input at the queries
            idx = (q * (self.spec.n_points / (2 * math.pi))).round().long().clamp_(0, self.spec.n_points - 1)
            u_at_q = torch.gather(u, 2, idx.unsqueeze(1).expand(-1, u.shape[1], -1))
            losses["inv_encode"] = F.mse_loss(self.decode(z, q).float(), u_at_q)
            # inverse decoding: decoding on the full grid and re-encoding returns the latent
            grid_q = self.grid_x.expand(u.shape[0], -1)
            # (relative to the latent's own scale, so shrinking the latent cannot game it)
            z_ref = z.detach().float()
            z_again = self.encode(self.decode(z, grid_q)).float()
            scale = z_ref.pow(2).mean((1, 2), keepdim=True).clamp_min(1e-6)  # per sample: accumulation-invariant
            losses["inv_decode"] = ((z_again - z_ref).pow(2) / scale).mean()
            total = total + self.spec.inverse_weight * (losses["inv_encode"] + losses["inv_decode"])
        losses["total"] = total
        return losses
