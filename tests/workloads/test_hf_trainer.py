"""A recommended config on the Hugging Face Trainer: `autotune.workloads.hf.training_arguments`
maps it onto TrainingArguments, and the Trainer built from them runs what the config says (on a
CPU, a tiny config-built model, a few steps)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # what the Trainer runs on

from autotune.engine.apply import ApplyError  # noqa: E402
from autotune.workloads.hf import TokenBlocks, training_arguments  # noqa: E402

_n = torch.arange(1024)
DATA = TokenBlocks((_n * 7 + _n // 64) % 64, 16)


def llama() -> nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))


def user_args(tmp_path: Path, **overrides: Any) -> Any:
    """The user's TrainingArguments: micro-batch 4, no accumulation, eager, fp32."""
    values = {"output_dir": str(tmp_path), "use_cpu": True, "max_steps": 3, "per_device_train_batch_size": 4,
              "learning_rate": 1e-3, "report_to": [], "save_strategy": "no", "logging_strategy": "no",
              "disable_tqdm": True, **overrides}
    return transformers.TrainingArguments(**values)


def checkpointing(args: Any) -> tuple[bool, dict[str, Any] | None]:
    flag = "activation_checkpointing" if hasattr(args, "activation_checkpointing") else "gradient_checkpointing"
    return getattr(args, flag), getattr(args, f"{flag}_kwargs")


def counting(model: nn.Module) -> list[bool]:
    """Each MLP forward with grad on (training, or its recomputation in backward)."""
    calls: list[bool] = []
    for layer in model.model.layers:  # type: ignore[union-attr]
        forward = layer.mlp.forward

        def counted(*args: Any, _forward: Any = forward, **kwargs: Any) -> Any:
            calls.append(torch.is_grad_enabled())
            return _forward(*args, **kwargs)

        layer.mlp.forward = counted
    return calls


BEST = {"batch_size": 2, "accum_steps": 2, "checkpoint": "block", "fused_optimizer": True, "compile": "none",
        "num_workers": 0, "pin_memory": False, "bucket_cap_mb": 50.0, "lr": 0.5}


def test_the_config_becomes_the_trainers_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = user_args(tmp_path)
    notes: dict[str, str] = {}
    new = training_arguments({**BEST, "step_graph": True}, args, notes=notes)
    assert new is not args and args.per_device_train_batch_size == 4 and checkpointing(args)[0] is False  # a copy
    assert (new.per_device_train_batch_size, new.gradient_accumulation_steps) == (2, 2)
    assert checkpointing(new) == (True, {"use_reentrant": False})
    assert str(getattr(new.optim, "value", new.optim)) == "adamw_torch_fused"
    assert (new.bf16, new.fp16, new.torch_compile, new.dataloader_num_workers, new.dataloader_pin_memory,
            new.ddp_bucket_cap_mb) == (False, False, False, 0, False, 50)
    assert new.learning_rate == 1e-3 and "0.5 in the config not applied" in notes["lr"]  # the user's lr kept
    assert "HF Trainer runs its own optimizer step" in notes["step_graph"]
    assert "step_graph" in capsys.readouterr().err  # said once
    assert training_arguments(BEST, args, use_config_lr=True, quiet=True).learning_rate == 0.5


def test_compile_and_precision_map_to_their_fields(tmp_path: Path) -> None:
    args = user_args(tmp_path, torch_compile_backend="inductor")
    compiled = training_arguments({"compile": "max-autotune-no-cudagraphs", "precision": "bf16"}, args, quiet=True)
    assert compiled.torch_compile is True and compiled.torch_compile_mode == "max-autotune-no-cudagraphs"
    assert compiled.bf16 is True and compiled.fp16 is False
    eager = training_arguments({"compile": "none"}, compiled, quiet=True)
    assert eager.torch_compile is False and eager.bf16 is False  # a backend alone would turn compile back on


def test_the_lm_knobs_reach_the_trainer_or_say_the_line_that_applies_them(tmp_path: Path) -> None:
    args = user_args(tmp_path, gradient_accumulation_steps=2)  # the user's effective batch: 4 x 2
    model = llama()
    notes: dict[str, str] = {}
    new = training_arguments({"batch_size": 8, "accum_steps": 4, "lr_scaling": "sqrt", "liger_kernels": True,
                              "hf_attn_implementation": "eager", "attention_backend": "math",
                              "inductor_tuning": "coordinate_descent"}, args, model, notes=notes, quiet=True)
    assert new.learning_rate == pytest.approx(1e-3 * 2.0) and args.learning_rate == 1e-3  # sqrt(32 / 8)
    assert "lr_scaling sqrt" in notes["lr"] and "8 → 32" in notes["lr"]
    assert new.use_liger_kernel is True and args.use_liger_kernel is False
    assert model.config._attn_implementation == "eager"  # type: ignore[union-attr]
    assert "SDPBackend.MATH" in notes["attention_backend"] and "not applied" in notes["attention_backend"]
    assert "torch._inductor.config.coordinate_descent_tuning = True" in notes["inductor_tuning"]
    linear = training_arguments({"batch_size": 2, "accum_steps": 2, "lr_scaling": "linear", "lr": 0.4}, args,
                                use_config_lr=True, quiet=True)
    assert linear.learning_rate == pytest.approx(0.4 * 4 / 8)  # the config's lr, scaled to half the batch
    plain = training_arguments({"batch_size": 8, "accum_steps": 4}, args, quiet=True)
    assert plain.learning_rate == 1e-3  # lr_scaling none: the batch changes, the lr does not


def test_what_the_trainer_cannot_run_is_refused_naming_the_knob(tmp_path: Path) -> None:
    args = user_args(tmp_path)
    for config, knob in (({"checkpoint": "attn"}, "checkpoint"), ({"precision": "fp8"}, "precision"),
                         ({"checkpoint": "selective"}, "checkpoint")):
        with pytest.raises(ApplyError) as info:
            training_arguments(config, args, quiet=True)
        assert info.value.knob == knob
    assert "pass model=" in str(info.value)  # selective goes on the model itself


def test_the_trainer_runs_the_config(tmp_path: Path) -> None:
    """Micro-batches of 2, accumulated over 2, every decoder layer recomputed, fused AdamW."""
    model = llama()
    calls = counting(model)
    trainer = transformers.Trainer(model=model, args=training_arguments(BEST, user_args(tmp_path), quiet=True),
                                   train_dataset=DATA)
    seen: list[int] = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(len(kw["input_ids"])), with_kwargs=True)
    trainer.train()
    assert seen == [2] * 6  # 3 optimizer steps of 2 micro-batches of 2 sequences
    assert sum(calls) == 6 * 2 * 2  # each layer's MLP ran again in backward: checkpointed
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.param_groups[0]["fused"] is True


def test_selective_checkpointing_goes_on_the_model_the_trainer_trains(tmp_path: Path) -> None:
    model = llama()
    calls = counting(model)
    notes: dict[str, str] = {}
    args = training_arguments({**BEST, "checkpoint": "selective"}, user_args(tmp_path, max_steps=1), model,
                              notes=notes, quiet=True)
    assert checkpointing(args)[0] is False and notes["checkpoint"].startswith("selective on 2 decoder layers")
    transformers.Trainer(model=model, args=args, train_dataset=DATA).train()
    assert sum(calls) == 2 * 2 * 2  # 2 micro-batches, 2 layers, recomputed
