"""autotune.engine.lm_knobs: the language-model knobs (attention kernel, a Hugging Face model's
attention implementation, Liger's kernels, TorchInductor's tuning flags, the lr's batch rule),
each shown to change what ran, or to say why it could not, in the probe and in autotune.apply."""

from __future__ import annotations

import math
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._dynamo
from helpers import CPU, resolved
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

from autotune.contract.config import INDUCTOR_TUNINGS, TrainConfig
from autotune.contract.errors import ProbeError
from autotune.contract.registry import Workload
from autotune.engine import lm_knobs
from autotune.engine.apply import ApplyError, apply
from autotune.engine.knobs import Trainer
from autotune.engine.lm_knobs import (
    INDUCTOR_FLAGS,
    apply_attn_implementation,
    apply_liger_kernels,
    apply_lr_scaling,
    compile_model,
    sdpa_blocker,
    use_attention_backend,
)
from autotune.engine.optimizers import as_optimizers
from autotune.engine.probe import ProbeSettings, build_training, run_probe
from autotune.workloads.gpt.model import GPTModel, GPTSpec

FLASH_CPU = "aten._scaled_dot_product_flash_attention_for_cpu"


class _Ops(TorchDispatchMode):
    """The aten ops that ran (forward and backward) while it was on."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))

    def ran(self, prefix: str) -> bool:
        return any(op.startswith(prefix) for op in self.ops)


def _gpt() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = GPTModel(GPTSpec(vocab=32, context=8, dim=16, depth=1, heads=2))
    batch = {"x": torch.randint(0, 32, (4, 8)), "y": torch.randint(0, 32, (4, 8))}
    return model, batch


def _ops_of_one_step(knobs: dict[str, Any]) -> tuple[_Ops, dict[str, str]]:
    model, batch = _gpt()
    prepared = apply({"batch_size": 4, "accum_steps": 1, **knobs}, model, lr=1e-2, quiet=True)
    with _Ops() as seen:
        loss = prepared.step(batch)
    assert loss is not None and torch.isfinite(loss)
    return seen, prepared.notes


def _tiny_llama(attn: str = "sdpa") -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
                                        attn_implementation=attn))


def _llama_loss(model: nn.Module, batch: Any, with_aux: bool) -> torch.Tensor:
    return model(input_ids=batch, labels=batch, use_cache=False).loss  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------------------------
# attention_backend


def test_attention_backend_math_replaces_torchs_cpu_flash_kernel_in_the_step() -> None:
    """On the CPU torch picks its flash kernel; attention_backend=math makes the same step run
    the math path (matmuls, no flash kernel), forward and backward."""
    auto, notes = _ops_of_one_step({})
    assert auto.ran(FLASH_CPU) and auto.ran(FLASH_CPU + "_backward")
    assert notes["attention_backend"] == "auto (torch's choice per call)"
    math_ops, notes = _ops_of_one_step({"attention_backend": "math"})
    assert not math_ops.ran(FLASH_CPU) and math_ops.ran("aten.bmm")
    assert notes["attention_backend"] == ("math: scaled_dot_product_attention limited to MATH in every forward "
                                          "(float32 on cpu)")
    flash, notes = _ops_of_one_step({"attention_backend": "flash"})
    assert flash.ran(FLASH_CPU) and notes["attention_backend"].startswith("flash: ")


@pytest.mark.parametrize("backend", ["auto", "math"])
def test_a_compiled_forward_is_traced_under_the_attention_backend(backend: str) -> None:
    """aot_eager runs the aten graph it traced: the math kernel is what the compiled step runs."""
    torch._dynamo.reset()
    model, batch = _gpt()
    cfg = TrainConfig(compile="default", attention_backend=backend, batch_size=4, accum_steps=1, lr=1e-2)
    notes: dict[str, str] = {}
    compiled = compile_model(model, cfg, CPU, notes, backend="aot_eager")
    trainer = Trainer(compiled, torch.optim.AdamW(model.parameters(), lr=1e-2), cfg, CPU, notes)
    use_attention_backend(trainer, model, cfg, CPU, notes, lambda message: ProbeError("unsupported", message))
    trainer.step([batch])  # compiles
    with _Ops() as seen:
        trainer.step([batch])
    assert seen.ran(FLASH_CPU) is (backend == "auto") and seen.ran("aten.bmm") is (backend == "math")
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["efficient", "cudnn"])
def test_a_kernel_the_cpu_lacks_is_recorded_inactive_and_torchs_choice_runs(backend: str) -> None:
    assert sdpa_blocker(backend, CPU, torch.float32) is not None
    assert sdpa_blocker("math", CPU, torch.float32) is None and sdpa_blocker("flash", CPU, torch.bfloat16) is None
    seen, notes = _ops_of_one_step({"attention_backend": backend})
    assert seen.ran(FLASH_CPU)  # torch's own choice, as without the knob
    note = notes["attention_backend"]
    assert note.startswith(f"{backend} (inactive: torch has no {backend} attention kernel for float32 on cpu")
    assert note.endswith("torch's choice runs)")


class _WideValues(nn.Module):
    """Attention whose values are wider than its queries: the math path runs it, flash cannot."""

    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(8, 16)
        self.v = nn.Linear(8, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.qk(x).view(x.shape[0], 1, -1, 16)
        v = self.v(x).view(x.shape[0], 1, -1, 32)
        return nn.functional.scaled_dot_product_attention(q, q, v).mean(dim=(1, 3))


def test_a_call_the_chosen_kernel_refuses_names_the_knob() -> None:
    def loss(model: nn.Module, batch: Any, with_aux: bool) -> torch.Tensor:
        return nn.functional.mse_loss(model(batch[0]), batch[1])

    batch = (torch.randn(4, 6, 8), torch.randn(4, 6))
    model = _WideValues()
    prepared = apply({"attention_backend": "flash", "batch_size": 4}, model, lr=1e-3, loss_fn=loss, quiet=True)
    with pytest.raises(ApplyError, match=r"attention_backend: flash: this model's attention call has no flash "
                                         r"kernel .*use auto, or math") as info:
        prepared.step(batch)
    assert info.value.knob == "attention_backend"
    fine = apply({"attention_backend": "math", "batch_size": 4}, _WideValues(), lr=1e-3, loss_fn=loss, quiet=True)
    assert fine.step(batch) is not None
    # the probe's Trainer: an "unsupported" failure, the kind a study learns from
    cfg = TrainConfig(attention_backend="flash", batch_size=4, accum_steps=1, lr=1e-3)
    notes: dict[str, str] = {}
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cfg, CPU, notes)
    trainer.loss_fn = loss
    use_attention_backend(trainer, model, cfg, CPU, notes, lambda message: ProbeError("unsupported", message))
    with pytest.raises(ProbeError, match="attention_backend=flash: this model's attention call") as failure:
        trainer.step([batch])
    assert failure.value.kind == "unsupported"


def test_the_probe_runs_its_step_under_the_attention_backend(tiny: Workload) -> None:
    settings = ProbeSettings(samples=100)
    notes: dict[str, str] = {}
    training = build_training(tiny, resolved(tiny, attention_backend="math"), CPU, settings, notes, total=10)
    batches = [training.data.next() for _ in range(training.trainer.config.accum_steps or 1)]
    with _Ops() as seen:
        training.trainer.step(batches)
    assert not seen.ran(FLASH_CPU) and notes["attention_backend"].startswith("math: ")
    training.data.close()
    notes = {}
    training = build_training(tiny, resolved(tiny), CPU, settings, notes, total=10)
    with _Ops() as seen:
        training.trainer.step([training.data.next() for _ in range(training.trainer.config.accum_steps or 1)])
    assert seen.ran(FLASH_CPU)  # the ups model's attention: torch's CPU flash kernel by default
    training.data.close()
    failed = run_probe(tiny, {"attention_backend": "math"}, settings=ProbeSettings(samples=100))
    assert failed.failure is None and failed.knobs["attention_backend"].startswith("math: ")


def test_the_attention_backend_is_inactive_on_an_eager_hugging_face_model() -> None:
    model = _tiny_llama("eager")
    batch = torch.randint(0, 32, (2, 8))
    prepared = apply({"attention_backend": "math", "batch_size": 2}, model, lr=1e-3, loss_fn=_llama_loss, quiet=True)
    assert prepared.notes["attention_backend"] == ("math (inactive: the Hugging Face model's attention is not sdpa "
                                                   "(LlamaForCausalLM: eager): set hf_attn_implementation sdpa)")
    assert prepared.notes["hf_attn_implementation"] == "auto (the model's own: LlamaForCausalLM: eager)"
    switched = apply({"attention_backend": "math", "hf_attn_implementation": "sdpa", "batch_size": 2},
                     _tiny_llama("eager"), lr=1e-3, loss_fn=_llama_loss, quiet=True)
    assert switched.notes["hf_attn_implementation"] == "sdpa on LlamaForCausalLM (was eager)"
    assert switched.notes["attention_backend"].startswith("math: ")
    with _Ops() as seen:
        switched.step(batch)
    assert not seen.ran(FLASH_CPU) and not seen.ran("aten._scaled_dot_product")


# ---------------------------------------------------------------------------------------------
# hf_attn_implementation


@pytest.mark.parametrize(("start", "want", "sdpa_ops"), [("sdpa", "eager", False), ("eager", "sdpa", True)])
def test_hf_attn_implementation_switches_what_the_model_runs(start: str, want: str, sdpa_ops: bool) -> None:
    model = _tiny_llama(start)
    batch = torch.randint(0, 32, (2, 8))
    prepared = apply({"hf_attn_implementation": want, "batch_size": 2}, model, lr=1e-3, loss_fn=_llama_loss,
                     quiet=True)
    assert model.config._attn_implementation == want  # type: ignore[union-attr]
    assert prepared.notes["hf_attn_implementation"] == f"{want} on LlamaForCausalLM (was {start})"
    with _Ops() as seen:
        prepared.step(batch)
    assert seen.ran(FLASH_CPU) is sdpa_ops  # eager attention: softmax over matmuls, no SDPA kernel


def test_hf_attn_implementation_is_inactive_without_a_hugging_face_model_or_a_way_to_switch() -> None:
    notes: dict[str, str] = {}
    apply_attn_implementation(_gpt()[0], TrainConfig(hf_attn_implementation="eager"), notes)
    assert notes["hf_attn_implementation"] == ("eager (inactive: no Hugging Face model in this model; its attention "
                                               "is its own code)")
    model = _tiny_llama("sdpa")
    model.set_attn_implementation = None  # type: ignore[assignment]  # a transformers without the switch
    apply_attn_implementation(model, TrainConfig(hf_attn_implementation="eager"), notes)
    assert notes["hf_attn_implementation"].startswith("eager inactive on LlamaForCausalLM: this transformers has no "
                                                      "set_attn_implementation")
    assert "build it with attn_implementation='eager'" in notes["hf_attn_implementation"]
    assert model.config._attn_implementation == "sdpa"  # type: ignore[union-attr]


def test_flex_attention_is_inactive_off_cuda_and_the_model_trains_with_its_own() -> None:
    """FlexAttention has no backward on a CPU: the knob says so, the step runs the model's sdpa."""
    model = _tiny_llama("sdpa")
    prepared = apply({"hf_attn_implementation": "flex_attention", "batch_size": 2}, model, lr=1e-3,
                     loss_fn=_llama_loss, quiet=True)
    assert prepared.notes["hf_attn_implementation"] == ("flex_attention (inactive: FlexAttention trains on CUDA "
                                                        "only, not on cpu; the model keeps sdpa)")
    assert model.config._attn_implementation == "sdpa"  # type: ignore[union-attr]
    with _Ops() as seen:
        prepared.step(torch.randint(0, 32, (2, 8)))
    assert seen.ran(FLASH_CPU)


# ---------------------------------------------------------------------------------------------
# liger_kernels

CUDA = torch.device("cuda")  # only its type is read: Liger's gate, before any kernel would run


def _fake_liger(monkeypatch: pytest.MonkeyPatch, table: dict[str, Callable[..., None]]) -> None:
    """liger_kernel.transformers.monkey_patch as Liger ships it: a model type → apply function table."""
    modules = {name: types.ModuleType(name) for name in
               ("liger_kernel", "liger_kernel.transformers", "liger_kernel.transformers.monkey_patch")}
    modules["liger_kernel.transformers.monkey_patch"].MODEL_TYPE_TO_APPLY_LIGER_FN = table  # type: ignore[attr-defined]
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)


def test_liger_kernels_are_inactive_on_a_cpu_in_the_probe_and_in_apply(tiny: Workload) -> None:
    result = run_probe(tiny, {"liger_kernels": True}, settings=ProbeSettings(samples=100))
    assert result.failure is None
    assert result.knobs["liger_kernels"] == "true (inactive on cpu: Liger's kernels are Triton kernels for CUDA GPUs)"
    prepared = apply({"liger_kernels": True, "batch_size": 2}, _tiny_llama(), lr=1e-3, loss_fn=_llama_loss,
                     quiet=True)
    assert prepared.notes["liger_kernels"].startswith("true (inactive on cpu")
    assert run_probe(tiny, {}, settings=ProbeSettings(samples=100)).knobs["liger_kernels"] == "false"


def test_liger_kernels_say_why_not_without_a_hugging_face_model_or_without_liger(
        monkeypatch: pytest.MonkeyPatch) -> None:
    notes: dict[str, str] = {}
    on = TrainConfig(liger_kernels=True)
    assert apply_liger_kernels(_gpt()[0], on, CUDA, notes) == 0
    assert notes["liger_kernels"].startswith("true (inactive: no Hugging Face model in this model")
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # not installed: its import raises ImportError
    assert apply_liger_kernels(_tiny_llama(), on, CUDA, notes) == 0
    assert notes["liger_kernels"].startswith("true (inactive: liger-kernel cannot be imported (ModuleNotFoundError")
    assert notes["liger_kernels"].endswith("pip install 'autotune[liger]' on a CUDA host)")


def test_liger_kernels_swap_the_modules_of_a_supported_model_and_refuse_another_type(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Liger's per-type function gets the user's model instance and the kernels we want; the modules
    it patches (renamed Liger..., as Liger's _patch_rms_norm_module / _patch_swiglu_module do)
    are counted in the notes. Liger itself needs CUDA and Triton: a stand-in for its table."""
    calls: list[tuple[nn.Module, dict[str, Any]]] = []

    def apply_liger_kernel_to_llama(rope: bool = True, cross_entropy: bool = False,
                                    fused_linear_cross_entropy: bool = True, rms_norm: bool = True,
                                    swiglu: bool = True, model: Any = None) -> None:
        calls.append((model, {"rope": rope, "cross_entropy": cross_entropy, "rms_norm": rms_norm, "swiglu": swiglu,
                              "fused_linear_cross_entropy": fused_linear_cross_entropy}))
        base = model.model
        patched = [base.norm, *(m for layer in base.layers for m in (layer.input_layernorm,
                                                                      layer.post_attention_layernorm))]
        for module in patched:
            module.__dict__["_get_name"] = lambda: "LigerRMSNorm"
        for layer in base.layers:
            layer.mlp.__dict__["_get_name"] = lambda: "LigerSwiGLUMLP"

    _fake_liger(monkeypatch, {"llama": apply_liger_kernel_to_llama})
    model = _tiny_llama()
    notes: dict[str, str] = {}
    assert apply_liger_kernels(model, TrainConfig(liger_kernels=True), CUDA, notes) == 7  # 5 norms + 2 MLPs
    assert calls == [(model, {"rope": True, "cross_entropy": False, "rms_norm": True, "swiglu": True,
                              "fused_linear_cross_entropy": True})]
    assert notes["liger_kernels"] == ("LlamaForCausalLM (llama): rope, rms_norm, swiglu, fused_linear_cross_entropy; "
                                      "7 modules run Liger's forward")
    _fake_liger(monkeypatch, {"qwen2": apply_liger_kernel_to_llama})
    assert apply_liger_kernels(_tiny_llama(), TrainConfig(liger_kernels=True), CUDA, notes) == 0
    assert notes["liger_kernels"] == ("inactive on LlamaForCausalLM: Liger has no kernels for model type 'llama' "
                                      "(it has qwen2)")
    assert len(calls) == 1


def test_under_compile_liger_takes_its_cross_entropy_kernel_where_this_torch_cannot_trace_the_fused_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Liger's fused linear cross-entropy calls addmm(out_dtype=float32) in its forward; where the
    compile's fake-tensor pass cannot trace that (torch 2.11 on an H100: a TypeError), the knob asks
    Liger for its cross-entropy kernel instead and says why; eager, or where it traces, the fused one."""
    calls: list[dict[str, Any]] = []

    def apply_liger_kernel_to_llama(rope: bool = True, cross_entropy: bool = False,
                                    fused_linear_cross_entropy: bool = True, rms_norm: bool = True,
                                    swiglu: bool = True, model: Any = None) -> None:
        calls.append({"cross_entropy": cross_entropy, "fused_linear_cross_entropy": fused_linear_cross_entropy})

    _fake_liger(monkeypatch, {"llama": apply_liger_kernel_to_llama})
    failing = "TypeError: unsupported operand type(s) for *: 'torch.dtype' and 'FakeTensor'"
    traces: dict[str, str | None] = {"why": failing}
    monkeypatch.setattr(lm_knobs, "addmm_out_dtype_traces", lambda device: traces["why"])
    notes: dict[str, str] = {}
    apply_liger_kernels(_tiny_llama(), TrainConfig(liger_kernels=True, compile="default"), CUDA, notes)
    assert calls[-1] == {"cross_entropy": True, "fused_linear_cross_entropy": False}
    assert notes["liger_kernels"].endswith(f"(fused_linear_cross_entropy left out under compile=default: torch "
                                           f"{torch.__version__} cannot trace its addmm(out_dtype=float32) on fake "
                                           f"tensors ({failing}))")
    apply_liger_kernels(_tiny_llama(), TrainConfig(liger_kernels=True, compile="none"), CUDA, notes)
    assert calls[-1] == {"cross_entropy": False, "fused_linear_cross_entropy": True}  # eager: no trace to fail
    traces["why"] = None
    apply_liger_kernels(_tiny_llama(), TrainConfig(liger_kernels=True, compile="default"), CUDA, notes)
    assert calls[-1] == {"cross_entropy": False, "fused_linear_cross_entropy": True}  # it traces: the fused one
    assert "left out" not in notes["liger_kernels"]


def test_the_addmm_check_runs_the_call_on_fake_tensors_and_reports_a_failure() -> None:
    assert lm_knobs.addmm_out_dtype_traces(torch.device("cpu")) is None  # this torch traces it (2.13 does)
    if not torch.cuda.is_available():  # a CPU build has no CUDA tensors, not even fake ones: the check says so
        why = lm_knobs.addmm_out_dtype_traces(torch.device("cuda"))
        assert why is not None and why.startswith("RuntimeError: ")


# ---------------------------------------------------------------------------------------------
# inductor_tuning


def _spy_compile(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    real = torch.compile

    def spy(model: Any, **kwargs: Any) -> Any:
        seen.append(kwargs)
        return real(model, **kwargs)

    monkeypatch.setattr(torch, "compile", spy)
    return seen


@pytest.mark.parametrize(("mode", "tuning", "options"), [
    ("default", "coordinate_descent", {"coordinate_descent_tuning": True}),
    ("reduce-overhead", "max_autotune_gemm", {"triton.cudagraphs": True, "max_autotune_gemm": True}),
    ("reduce-overhead", "max_autotune_gemm+coordinate_descent",
     {"triton.cudagraphs": True, "max_autotune_gemm": True, "coordinate_descent_tuning": True}),
])
def test_inductor_tuning_goes_into_the_compiles_options(monkeypatch: pytest.MonkeyPatch, mode: str, tuning: str,
                                                        options: dict[str, Any]) -> None:
    """The mode's own options and the flags, as one options= dict of this model's compile: the
    process-wide inductor config is left as it is."""
    seen = _spy_compile(monkeypatch)
    notes: dict[str, str] = {}
    compiled = compile_model(nn.Linear(2, 2), TrainConfig(compile=mode, inductor_tuning=tuning), CPU, notes)
    assert isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule)
    assert seen == [{"backend": "inductor", "options": options}]
    assert notes["compile"] == f"{mode} (inductor)" and notes["inductor_tuning"].startswith(f"{tuning}: ")
    assert not torch._inductor.config.coordinate_descent_tuning and not torch._inductor.config.max_autotune_gemm


@pytest.mark.parametrize(("knobs", "backend", "why"), [
    ({"compile": "none"}, "inductor", "compile none"),
    ({"compile": "default"}, "eager", "the compile backend is eager, not inductor"),
    ({"compile": "max-autotune-no-cudagraphs"}, "inductor",
     "compile max-autotune-no-cudagraphs sets coordinate_descent_tuning already"),
])
def test_inductor_tuning_is_inactive_where_it_adds_nothing(monkeypatch: pytest.MonkeyPatch, knobs: dict[str, Any],
                                                           backend: str, why: str) -> None:
    seen = _spy_compile(monkeypatch)
    notes: dict[str, str] = {}
    compile_model(nn.Linear(2, 2), TrainConfig(**knobs, inductor_tuning="coordinate_descent"), CPU, notes, backend)
    assert notes["inductor_tuning"] == f"coordinate_descent (inactive: {why})"
    assert all("options" not in kwargs for kwargs in seen)  # apply_compile's plain mode, as without the knob
    compile_model(nn.Linear(2, 2), TrainConfig(**knobs), CPU, notes, backend)
    assert notes["inductor_tuning"] == "none"


def test_every_inductor_tuning_choice_has_its_flags() -> None:
    assert tuple(INDUCTOR_FLAGS) == INDUCTOR_TUNINGS and INDUCTOR_FLAGS["none"] == {}
    known = torch._inductor.config.get_config_copy()
    assert all(flag in known for flags in INDUCTOR_FLAGS.values() for flag in flags)  # this torch has them


@pytest.mark.slow
def test_inductor_tuning_holds_while_the_model_compiles_and_is_gone_after() -> None:
    """A real TorchInductor compile (CPU): a post-grad pass reads the inductor config while the
    model compiles. The flag is on then, off before and after, and off for another model
    compiled without the knob in the same process."""
    from torch._inductor import config as inductor_config

    seen: list[bool] = []

    def record(graph: torch.fx.Graph) -> None:
        seen.append(bool(inductor_config.coordinate_descent_tuning))

    torch._dynamo.reset()
    with inductor_config.patch(post_grad_custom_pre_pass=record, fx_graph_cache=False):
        torch.manual_seed(0)
        model, x = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), torch.randn(3, 4)
        notes: dict[str, str] = {}
        tuned = compile_model(model, TrainConfig(compile="default", inductor_tuning="coordinate_descent"), CPU, notes)
        assert not inductor_config.coordinate_descent_tuning  # lazy: nothing compiled yet
        torch.testing.assert_close(tuned(x), model(x))
        assert seen == [True] and not inductor_config.coordinate_descent_tuning
        plain = compile_model(nn.Linear(4, 2), TrainConfig(compile="default"), CPU, notes)
        plain(x)
        assert seen == [True, False]
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------
# lr_scaling


@pytest.mark.parametrize(("rule", "factor"), [("linear", 4.0), ("sqrt", 2.0), ("none", 1.0)])
def test_the_probes_optimizer_runs_the_scaled_lr(tiny: Workload, rule: str, factor: float) -> None:
    """The tiny preset's lr goes with its 4 × 2 samples per step; 8 × 4 is 4 times that."""
    d = tiny.defaults
    cfg = resolved(tiny, batch_size=d.batch_size * 2, accum_steps=d.accum_steps * 2, lr_scaling=rule)
    notes: dict[str, str] = {}
    training = build_training(tiny, cfg, CPU, ProbeSettings(samples=320), notes, total=10)
    groups = training.trainer.optimizers.param_groups
    assert [g["lr"] for g in groups] == pytest.approx([d.lr * factor] * len(groups))
    assert training.trainer.base_lrs == pytest.approx([d.lr * factor] * len(groups))  # the schedule's base
    if rule == "none":
        assert notes["lr_scaling"] == "none" and notes["lr"].startswith(f"{d.lr:g}, ")
    else:
        assert notes["lr_scaling"].startswith(f"{rule}: effective batch 32 against the lr's 8 (× 4): every "
                                              f"parameter group's lr × {factor:.4g}")
        assert notes["lr"].startswith(f"{d.lr * factor:g} ({d.lr:g} × {factor:.4g}, lr_scaling {rule}), ")
    training.data.close()
    same = resolved(tiny, lr_scaling=rule)  # the preset's own batch: the lr it was set for
    notes = {}
    training = build_training(tiny, same, CPU, ProbeSettings(samples=320), notes, total=10)
    assert training.trainer.optimizers.param_groups[0]["lr"] == pytest.approx(d.lr)
    training.data.close()


def test_the_probe_reports_the_leased_config_and_the_lr_that_ran(tiny: Workload) -> None:
    d = tiny.defaults
    result = run_probe(tiny, {"batch_size": d.batch_size * 2, "lr_scaling": "sqrt"},
                       settings=ProbeSettings(samples=160))
    assert result.failure is None
    assert result.config["lr"] == d.lr and result.config["lr_scaling"] == "sqrt"  # the lease's config, unchanged
    assert result.knobs["lr"].startswith(f"{d.lr * math.sqrt(2):g} ")


def _user() -> tuple[nn.Module, torch.optim.Optimizer, DataLoader]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    loader = DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 1)), batch_size=4)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01), loader


def _mse(model: nn.Module, batch: Any, with_aux: bool) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch[0]), batch[1])


def test_apply_scales_the_users_lr_and_their_schedulers_base_lrs() -> None:
    """Your lr goes with your loader's batch of 4; the config's 8 × 2 is 4 times that. A LambdaLR
    made before apply goes on acting on the scaled lr."""
    model, opt, loader = _user()
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    prepared = apply({"batch_size": 8, "accum_steps": 2, "lr_scaling": "linear"}, model, optimizer=opt,
                     train_loader=loader, loss_fn=_mse, scheduler=scheduler, quiet=True)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.04) and scheduler.base_lrs == pytest.approx([0.04])
    assert prepared.notes["lr"] == "0.01 (yours); × 4 by lr_scaling: 0.04 runs"
    assert prepared.notes["lr_scaling"] == ("linear: effective batch 16 against the lr's 4 (× 4): every parameter "
                                            "group's lr × 4, and 1 LR scheduler's base lrs")
    seen: list[float] = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(float(o.param_groups[0]["lr"])))
    for batch in list(prepared.train_loader or [])[:4]:
        if prepared.step(batch) is not None:
            scheduler.step()
    assert seen == pytest.approx([0.04, 0.02])


def test_apply_refuses_to_scale_under_a_scheduler_it_was_not_given() -> None:
    model, opt, loader = _user()
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    with pytest.raises(ApplyError, match="pass scheduler=your_scheduler") as info:
        apply({"batch_size": 8, "lr_scaling": "sqrt"}, model, optimizer=opt, train_loader=loader, loss_fn=_mse)
    assert info.value.knob == "lr_scaling"


def test_apply_takes_the_reference_batch_and_says_when_it_has_none(capsys: pytest.CaptureFixture[str]) -> None:
    model, opt, _ = _user()
    prepared = apply({"batch_size": 8, "lr_scaling": "sqrt"}, model, optimizer=opt, loss_fn=_mse, reference_batch=32)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01 * math.sqrt(0.25))  # a smaller batch: a smaller lr
    model, opt, _ = _user()
    prepared = apply({"batch_size": 8, "lr_scaling": "sqrt"}, model, optimizer=opt, loss_fn=_mse)
    assert opt.param_groups[0]["lr"] == 0.01
    assert prepared.notes["lr_scaling"].startswith("sqrt not applied: the effective batch your lr was set for is "
                                                   "unknown (pass reference_batch=")
    assert "lr_scaling: sqrt not applied" in capsys.readouterr().err  # printed once, as every knob that cannot act


def test_lr_scaling_scales_what_a_scheduler_keeps_in_the_groups() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    one_cycle = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=10)
    notes: dict[str, str] = {}
    cfg = TrainConfig(batch_size=8, accum_steps=1, lr_scaling="linear")
    before = dict(opt.param_groups[0])
    assert apply_lr_scaling(as_optimizers(opt), cfg, 4, notes, [one_cycle]) == 2.0
    group = opt.param_groups[0]
    for key in ("lr", "initial_lr", "max_lr", "min_lr"):
        assert group[key] == pytest.approx(before[key] * 2), key
    opt.step()
    one_cycle.step()
    assert group["lr"] > before["lr"] * 2  # the cycle climbs from the scaled start towards the scaled max

