"""The checkpoint knob on Hugging Face models: through the model's own switch.

A transformers ``PreTrainedModel`` checkpoints whole decoder layers with
``gradient_checkpointing_enable`` (``activation_checkpointing_enable`` from transformers 5),
so the knob drives that switch rather than a ``checkpoint`` attribute on blocks
(`autotune.engine.knobs.apply_checkpointing` calls here). Models are found by their
attributes: transformers itself is never imported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from autotune.contract.errors import ProbeError
from autotune.engine.checkpoint_policy import save_matmuls_policy


def hf_models(model: nn.Module) -> list[nn.Module]:
    """The outermost Hugging Face models in `model` (itself included): modules that say whether
    they support gradient checkpointing and can turn it on (a transformers ``PreTrainedModel``,
    found by those attributes: transformers is not imported). A model nested in another (the
    ``LlamaModel`` inside ``LlamaForCausalLM``) is its outer model's business."""
    found: list[str] = []
    models: list[nn.Module] = []
    for name, module in model.named_modules():
        if not hasattr(module, "supports_gradient_checkpointing") or not _hf_switch(module, "enable"):
            continue
        if any(outer == "" or name.startswith(outer + ".") for outer in found):
            continue
        found.append(name)
        models.append(module)
    return models


def _hf_switch(module: nn.Module, which: str) -> Callable[..., Any] | None:
    """The model's checkpointing switch: ``activation_checkpointing_<which>`` where transformers
    has it (its name from transformers 5.x, where ``gradient_checkpointing_<which>`` is a deprecated
    alias of it), else ``gradient_checkpointing_<which>``; None when the model has neither."""
    for prefix in ("activation", "gradient"):
        switch = getattr(module, f"{prefix}_checkpointing_{which}", None)
        if callable(switch):
            return switch  # type: ignore[no-any-return]
    return None


def hf_checkpoint_kwargs(mode: str) -> dict[str, Any]:
    """The keyword arguments a Hugging Face model's ``gradient_checkpointing_enable`` hands to
    ``torch.utils.checkpoint.checkpoint`` for `mode`: non-reentrant always; ``selective`` adds
    the policy that keeps the matmul and attention outputs (`save_matmuls_policy`)."""
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if mode == "selective":
        from functools import partial

        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, save_matmuls_policy)
    return kwargs


def checkpoint_hf_models(models: list[nn.Module], mode: str) -> list[tuple[str, int | None]]:
    """Apply `mode` to each Hugging Face model through its own switch: ``block`` and
    ``selective`` checkpoint every decoder layer (HF checkpoints whole layers), ``none`` turns
    checkpointing off. Returns (model class, layers now checkpointed) per model: the layers
    flagged, or where older transformers flag the model alone, its config's num_hidden_layers
    (None when it has none)."""
    names = ", ".join(sorted({type(m).__name__ for m in models}))
    if mode in ("attn", "mlp"):
        raise ProbeError("unsupported", f"checkpoint: {names} (Hugging Face) checkpoints whole decoder layers "
                                        f"(gradient_checkpointing_enable), not the {mode} sub-layer alone; use "
                                        "block (every layer recomputed) or selective (every layer, its matmul and "
                                        "attention outputs kept)")
    done: list[tuple[str, int | None]] = []
    for model in models:
        supported = getattr(model, "supports_gradient_checkpointing", False)
        if mode == "none":
            switch = _hf_switch(model, "disable") if supported else None
            if switch is not None:
                switch()
            done.append((type(model).__name__, 0))
            continue
        if not supported:
            raise ProbeError("unsupported", f"checkpoint: {type(model).__name__} (Hugging Face) does not support "
                                            "gradient checkpointing (supports_gradient_checkpointing is False); "
                                            "use none")
        switch = _hf_switch(model, "enable")
        assert switch is not None
        kwargs = hf_checkpoint_kwargs(mode)
        if getattr(switch, "__name__", "").startswith("activation"):
            switch(activation_checkpointing_kwargs=kwargs)
        else:
            switch(gradient_checkpointing_kwargs=kwargs)
        layers = sum(1 for m in model.modules()
                     if getattr(m, "gradient_checkpointing", False) is True
                     and not hasattr(m, "supports_gradient_checkpointing"))
        if not layers:  # older transformers flag the model alone: its config says how many layers it has
            layers = getattr(getattr(model, "config", None), "num_hidden_layers", 0)
        done.append((type(model).__name__, layers if isinstance(layers, int) and layers > 0 else None))
    return done
