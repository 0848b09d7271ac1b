"""Selective activation checkpointing's policy, shared by the built-in blocks and Hugging Face models.

``checkpoint: selective`` keeps the outputs of the matmuls and of attention (the expensive ops
to recompute) and recomputes the cheap ops between them (norms, activations, adds), through
``torch.utils.checkpoint.create_selective_checkpoint_contexts``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

SAVED_BY_SELECTIVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.linear.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def save_matmuls_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep matmul and attention outputs, recompute the cheap ops."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE
