"""A small decoder-only transformer (GPT-style) over byte tokens.

Token + learned position embeddings, pre-norm blocks (RMSNorm, causal multi-head attention
through F.scaled_dot_product_attention, GELU MLP), a final RMSNorm and a linear head. The
blocks are the `ups` workload's `Block` with causal attention, so the activation-
checkpoint modes (none | block | attn | mlp | selective) are the same.

The optional expensive loss term is **mtp** (multi-token prediction): a second head, an MLP
and a vocabulary projection, predicts the token two positions ahead; ``forward(batch,
with_aux=True)`` adds ``mtp_weight × its cross-entropy`` to the total. The
``inverse_loss_frequency`` knob runs it on one step in k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autotune.workloads.ups.model import Block


@dataclass(frozen=True)
class GPTSpec:
    vocab: int
    context: int
    dim: int
    depth: int
    heads: int
    mlp_ratio: int = 4
    mtp_weight: float = 0.3


class CausalAttention(nn.Module):
    """Multi-head causal self-attention (SDPA with is_causal: flash/efficient kernels on a GPU)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by heads {heads}")
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, n, d))


class GPTBlock(Block):
    """The ups pre-norm block with causal self-attention."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int) -> None:
        super().__init__(dim, heads, mlp_ratio)
        self.attn = CausalAttention(dim, heads)  # type: ignore[assignment]


class GPTModel(nn.Module):
    def __init__(self, spec: GPTSpec) -> None:
        super().__init__()
        self.spec = spec
        self.tok = nn.Embedding(spec.vocab, spec.dim)
        self.pos = nn.Parameter(torch.zeros(spec.context, spec.dim))
        nn.init.normal_(self.pos, std=0.02)
        self.blocks = nn.ModuleList(GPTBlock(spec.dim, spec.heads, spec.mlp_ratio) for _ in range(spec.depth))
        self.norm = nn.RMSNorm(spec.dim)
        self.head = nn.Linear(spec.dim, spec.vocab, bias=False)
        self.mtp = nn.Sequential(nn.Linear(spec.dim, spec.dim), nn.GELU(), nn.RMSNorm(spec.dim),
                                 nn.Linear(spec.dim, spec.vocab, bias=False))

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.norm(h)

    def next_token_loss(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.head(h)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))

    def forward(self, batch: dict[str, torch.Tensor], with_aux: bool = True) -> dict[str, torch.Tensor]:
        """Losses: ``lm`` (next-token cross-entropy), ``mtp`` when `with_aux`, and ``total``."""
        h = self.hidden(batch["x"])
        lm = self.next_token_loss(h, batch["y"])
        losses = {"lm": lm}
        total = lm
        if with_aux:
            # token t+2 predicted at position t: the target of position t+1
            logits = self.mtp(h[:, :-1])
            mtp = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch["y"][:, 1:].reshape(-1))
            losses["mtp"] = mtp
            total = total + self.spec.mtp_weight * mtp
        losses["total"] = total
        return losses
