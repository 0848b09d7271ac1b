"""The language-model knobs (issue 40), each a small function at its place in the probe's order.

autotune/engine/knobs.py lists the steps; the probe (`build_training`) and `autotune.apply` call
these at the same points:

2b. ``apply_model_kernels``  after activation checkpointing, on the plain model:
                             ``hf_attn_implementation`` (a Hugging Face model's own
                             ``set_attn_implementation``), then ``liger_kernels`` (Liger's fused
                             RMSNorm / SwiGLU / RoPE / linear cross-entropy on the model's modules)
6.  ``compile_model``        torch.compile with the mode and ``inductor_tuning``'s TorchInductor
                             flags, passed as the compile's options: they hold while this model
                             compiles (the warm-up, where compile time is counted) and never
                             touch the process-wide ``torch._inductor.config``
7b. ``apply_lr_scaling``     after the optimizer(s) are built, before the Trainer reads their lrs:
                             every group's lr (and a torch scheduler's base lrs) × the rule's factor
9b. ``use_attention_backend`` the Trainer's loss runs under ``sdpa_kernel([backend])``, so every
                             ``scaled_dot_product_attention`` of the forward may use that kernel only

Each records in ``notes`` what it did, or why it could not act ("inactive: ..."), as every knob does.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from autotune.contract.config import TrainConfig
from autotune.engine.hf_checkpointing import hf_models
from autotune.engine.knobs import Notes, Trainer, apply_compile
from autotune.engine.optimizers import Optimizers, set_lr

# -- 2b. a Hugging Face model's attention implementation ------------------------------------------


def attn_implementation(module: nn.Module) -> str | None:
    """The attention implementation a Hugging Face model runs (its ``config._attn_implementation``)."""
    return getattr(getattr(module, "config", None), "_attn_implementation", None)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:300]


def apply_attn_implementation(model: nn.Module, config: TrainConfig, notes: Notes,
                              device: torch.device | None = None) -> None:
    """Set ``hf_attn_implementation`` on every Hugging Face model inside `model` through its own
    ``set_attn_implementation`` (transformers >= 4.5x picks the attention function from the config at
    each forward), read back from the model's config: a model that keeps its own is said so."""
    knob, want = "hf_attn_implementation", config.hf_attn_implementation
    found = hf_models(model)
    if want == "auto":
        own = ", ".join(f"{type(m).__name__}: {attn_implementation(m)}" for m in found)
        notes[knob] = "auto" + (f" (the model's own: {own})" if own else "")
        return
    if not found:
        notes[knob] = f"{want} (inactive: no Hugging Face model in this model; its attention is its own code)"
        return
    if want == "flex_attention" and device is not None and device.type != "cuda":
        # torch's FlexAttention has a forward on the CPU but no backward (NotImplementedError in training)
        notes[knob] = f"{want} (inactive: FlexAttention trains on CUDA only, not on {device.type}; the model keeps " \
                      f"{', '.join(str(attn_implementation(m)) for m in found)})"
        return
    parts = []
    for hf in found:
        name, before = type(hf).__name__, attn_implementation(hf)
        setter = getattr(hf, "set_attn_implementation", None)
        if before == want:
            parts.append(f"{want} on {name} (its own already)")
            continue
        if not callable(setter):
            parts.append(f"{want} inactive on {name}: this transformers has no set_attn_implementation (it picks the "
                         f"attention classes when the model is built): build it with attn_implementation={want!r}")
            continue
        try:
            setter(want)
        except (ValueError, ImportError, RuntimeError, NotImplementedError) as e:
            parts.append(f"{want} inactive on {name}: {_first_line(e)}")
            continue
        after = attn_implementation(hf)
        parts.append(f"{want} on {name} (was {before})" if after == want else
                     f"{want} inactive on {name}: it kept {after} (the model cannot switch its attention once built)")
    notes[knob] = "; ".join(parts)


# -- 2b. Liger's fused kernels ---------------------------------------------------------------------

# what liger_kernels turns on, passed to Liger's apply_liger_kernel_to_<model type>(model=..., **these)
# where the function takes the argument (the fused linear cross-entropy never materialises the logits)
LIGER_KERNELS = {"rope": True, "rms_norm": True, "swiglu": True, "fused_linear_cross_entropy": True,
                 "cross_entropy": False}


def addmm_out_dtype_traces(device: torch.device) -> str | None:
    """None when torch.compile's fake-tensor pass can trace ``torch.addmm(..., out_dtype=float32,
    out=...)`` with bf16 operands on `device`, else why not. Liger's fused linear cross-entropy
    makes that call inside its forward under autocast with fp32 weights (liger-kernel 0.8.5); torch
    2.11's fake-tensor pass sends it to the plain addmm decomposition, which takes the dtype for
    ``beta`` (a TypeError: the compiled probe fails). Tried on fake tensors: nothing runs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        with FakeTensorMode():
            acc = torch.empty(4, 8, device=device)
            a, b = (torch.empty(shape, dtype=torch.bfloat16, device=device) for shape in ((4, 16), (16, 8)))
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    except Exception as e:  # the failure is the answer; it never leaves this check
        return f"{type(e).__name__}: {_first_line(e)}"
    return None


def liger_kernels_for(config: TrainConfig, device: torch.device, accepted: Iterable[str]
                      ) -> tuple[dict[str, bool], str]:
    """The kernels to ask Liger's apply function for (those of LIGER_KERNELS it takes), and a note:
    under torch.compile, where this torch cannot trace the fused linear cross-entropy's addmm
    (`addmm_out_dtype_traces`), Liger's cross-entropy kernel instead of the fused one."""
    kwargs = {k: v for k, v in LIGER_KERNELS.items() if k in accepted}
    if config.compile == "none" or not kwargs.get("fused_linear_cross_entropy"):
        return kwargs, ""
    why = addmm_out_dtype_traces(device)
    if why is None:
        return kwargs, ""
    kwargs["fused_linear_cross_entropy"] = False
    if "cross_entropy" in kwargs:
        kwargs["cross_entropy"] = True
    return kwargs, (f" (fused_linear_cross_entropy left out under compile={config.compile}: torch "
                    f"{torch.__version__} cannot trace its addmm(out_dtype=float32) on fake tensors ({why}))")


def liger_table() -> tuple[dict[str, Callable[..., Any]] | None, str]:
    """Liger's model type → apply function, or None and why it cannot be had (not installed, or
    its import fails: Triton missing, ...)."""
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except Exception as e:  # ImportError, or Triton's own failure at import: never a crash of the probe
        return None, f"liger-kernel cannot be imported ({type(e).__name__}: {_first_line(e)}): pip install " \
                     "'autotune[liger]' on a CUDA host"
    return dict(MODEL_TYPE_TO_APPLY_LIGER_FN), ""


def liger_modules(model: nn.Module) -> int:
    """Modules of `model` that run Liger's forward (Liger renames each module it patches)."""
    return sum(1 for m in model.modules() if m._get_name().startswith("Liger"))


def apply_liger_kernels(model: nn.Module, config: TrainConfig, device: torch.device, notes: Notes) -> int:
    """``liger_kernels``: Liger's kernels on every Hugging Face model inside `model` whose model type
    Liger supports, through its ``apply_liger_kernel_to_<type>(model=...)`` (which also patches
    the type's modeling module process-wide: the probe is a process of its own). Returns how many
    modules now run Liger's forward; inactive, with the reason, off CUDA, without an HF model,
    without liger-kernel, or for a model type Liger has no kernels for."""
    knob = "liger_kernels"
    if not config.liger_kernels:
        notes[knob] = "false"
        return 0
    if device.type != "cuda":
        notes[knob] = f"true (inactive on {device.type}: Liger's kernels are Triton kernels for CUDA GPUs)"
        return 0
    found = hf_models(model)
    if not found:
        notes[knob] = ("true (inactive: no Hugging Face model in this model; Liger patches transformers' model "
                       "classes: Llama, Mistral, Qwen2, Gemma, ...)")
        return 0
    table, why = liger_table()
    if table is None:
        notes[knob] = f"true (inactive: {why})"
        return 0
    parts, swapped = [], 0
    for hf in found:
        model_type = getattr(getattr(hf, "config", None), "model_type", None)
        apply_fn = table.get(str(model_type))
        if apply_fn is None:
            known = sorted(table)
            listed = ", ".join(known[:12]) + (f", ... ({len(known)} in all)" if len(known) > 12 else "")
            parts.append(f"inactive on {type(hf).__name__}: Liger has no kernels for model type {model_type!r} "
                         f"(it has {listed})")
            continue
        kwargs, left_out = liger_kernels_for(config, device, inspect.signature(apply_fn).parameters)
        apply_fn(model=hf, **kwargs)
        n = liger_modules(hf)
        swapped += n
        parts.append(f"{type(hf).__name__} ({model_type}): {', '.join(k for k, v in kwargs.items() if v)}; "
                     f"{n} modules run Liger's forward{left_out}")
    notes[knob] = "; ".join(parts)
    return swapped


def apply_model_kernels(model: nn.Module, config: TrainConfig, device: torch.device, notes: Notes) -> None:
    """Knob step 2b: the attention implementation, then Liger's kernels, on the plain model."""
    apply_attn_implementation(model, config, notes, device)
    apply_liger_kernels(model, config, device, notes)


# -- 6. the compile's TorchInductor flags ------------------------------------------------------------

INDUCTOR_FLAGS: dict[str, dict[str, Any]] = {
    "none": {},
    "coordinate_descent": {"coordinate_descent_tuning": True},
    "max_autotune_gemm": {"max_autotune_gemm": True},
    "max_autotune_gemm+coordinate_descent": {"max_autotune_gemm": True, "coordinate_descent_tuning": True},
}


def mode_options(mode: str) -> dict[str, Any]:
    """The TorchInductor options torch.compile's `mode` stands for ({} for none and default)."""
    if mode in ("none", "default"):
        return {}
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode))


def compile_model(model: nn.Module, config: TrainConfig, device: torch.device, notes: Notes,
                  backend: str = "inductor") -> nn.Module:
    """Knob step 6: `apply_compile`, with ``inductor_tuning``'s flags added to the compile's
    options (the mode's own options and the flags, as one ``options=`` dict: torch.compile takes a
    mode or options, and a mode is a name for options). TorchInductor patches its config with them
    while it compiles this model, so nothing leaks into another model or trial of the process.
    Inactive with compile none, another backend, or a mode that sets the flags already."""
    knob, tuning = "inductor_tuning", config.inductor_tuning
    flags = INDUCTOR_FLAGS[tuning]
    if tuning == "none" or config.compile == "none" or backend != "inductor":
        why = "compile none" if config.compile == "none" else f"the compile backend is {backend}, not inductor"
        notes[knob] = "none" if tuning == "none" else f"{tuning} (inactive: {why})"
        return apply_compile(model, config.compile, notes, backend=backend)
    options = mode_options(config.compile)
    implied = {k for k, v in options.items() if v is True}
    if options.get("max_autotune"):
        implied |= {"max_autotune_gemm", "max_autotune_pointwise"}
    if set(flags) <= implied:
        notes[knob] = f"{tuning} (inactive: compile {config.compile} sets {', '.join(flags)} already)"
        return apply_compile(model, config.compile, notes, backend=backend)
    compiled = torch.compile(model, backend="inductor", options={**options, **flags})
    notes["compile"] = f"{config.compile} (inductor)"
    notes[knob] = (f"{tuning}: {', '.join(f'{k}=True' for k in flags)} in TorchInductor's config while this model "
                   "compiles (torch.compile options; the process-wide config untouched)")
    if device.type != "cuda":
        notes[knob] += f" (on {device.type}: coordinate descent tunes Triton kernels only)"
    return compiled  # type: ignore[return-value]


# -- 7b. the learning rate's batch rule -------------------------------------------------------------

SCHEDULER_LISTS = ("base_lrs", "max_lrs", "_last_lr")  # a torch scheduler's per-group lrs
GROUP_LRS = ("initial_lr", "max_lr", "min_lr")  # what torch's schedulers keep in a group beside its lr


def lr_factor_of(rule: str, batch: int, reference: int) -> float:
    """The lr's multiplier when the effective batch is `batch` and the lr was set for `reference`."""
    ratio = batch / reference
    return {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[rule]


def _schedulers(schedulers: Iterable[Any]) -> Iterator[Any]:
    """Every scheduler, those inside a SequentialLR / ChainedScheduler included."""
    for s in schedulers:
        yield s
        yield from _schedulers(getattr(s, "_schedulers", ()) or ())


def apply_lr_scaling(optimizers: Optimizers, config: TrainConfig, reference_batch: int | None, notes: Notes,
                     schedulers: Iterable[Any] = (), world: int = 1) -> float:
    """Knob step 7b, ``lr_scaling``: when the effective batch per rank (batch_size × accum_steps)
    differs from `reference_batch` (the one the lr was set for: the preset's in a probe), multiply
    every parameter group's lr by the ratio (linear) or its square root (sqrt), together with
    what torch's LR schedulers keep of it (each group's ``initial_lr`` / ``max_lr`` / ``min_lr``,
    each scheduler's ``base_lrs``), so a schedule goes on acting on the scaled lr. The world size
    is the same for the batch and its reference. Returns the factor (1.0 when nothing changed)."""
    knob, rule = "lr_scaling", config.lr_scaling
    if rule == "none":
        notes[knob] = "none"
        return 1.0
    assert config.batch_size is not None and config.accum_steps is not None, "resolve() the config first"
    batch = config.batch_size * config.accum_steps
    if reference_batch is None:
        notes[knob] = (f"{rule} not applied: the effective batch your lr was set for is unknown (pass "
                       "reference_batch=, or train_loader=)")
        return 1.0
    factor = lr_factor_of(rule, batch, reference_batch)
    if factor == 1.0:
        notes[knob] = f"{rule}: the effective batch {batch * world} is the lr's own: lr kept"
        return 1.0
    for group in optimizers.param_groups:
        set_lr(group, float(group["lr"]) * factor)
        for key in GROUP_LRS:
            if isinstance(group.get(key), (int, float)):
                group[key] = group[key] * factor
    scaled = 0
    for scheduler in _schedulers(schedulers):
        scaled += 1
        for name in SCHEDULER_LISTS:
            values = getattr(scheduler, name, None)
            if isinstance(values, list):
                setattr(scheduler, name, [v * factor if isinstance(v, (int, float)) else v for v in values])
        if isinstance(getattr(scheduler, "eta_min", None), (int, float)):  # cosine annealing's floor
            scheduler.eta_min *= factor
    schedules = {0: "", 1: ", and 1 LR scheduler's base lrs"}.get(scaled,
                                                                   f", and the base lrs of {scaled} LR schedulers")
    notes[knob] = (f"{rule}: effective batch {batch * world} against the lr's {reference_batch * world} "
                   f"(× {batch / reference_batch:g}): every parameter group's lr × {factor:.4g}{schedules}")
    return factor


# -- 9b. the attention kernel ------------------------------------------------------------------------

SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                 "math": "MATH"}
NO_KERNEL = ("No available kernel", "No viable backend")  # torch's errors on CUDA and on the CPU


def sdpa_backend(name: str) -> Any:
    from torch.nn.attention import SDPBackend

    return getattr(SDPBackend, SDPA_BACKENDS[name])


def sdpa_blocker(name: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """None when scaled_dot_product_attention runs with only the `name` kernel on `device` for
    `dtype` (a small causal call, head dim 64); otherwise why not, with torch's reasons."""
    from torch.nn.attention import sdpa_kernel

    q = torch.randn(1, 2, 16, 64, device=device, dtype=dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel([sdpa_backend(name)]):
                torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        except RuntimeError as e:
            reasons = [str(w.message).splitlines()[0] for w in caught if "because" in str(w.message)][:2]
            return (f"torch has no {name} attention kernel for {str(dtype).removeprefix('torch.')} on "
                    f"{device.type}: {_first_line(e)}" + (f" ({'; '.join(reasons)})" if reasons else ""))
    return None


def sdpa_callers(model: nn.Module) -> list[str]:
    """The classes of `model`'s modules whose forward names scaled_dot_product_attention."""
    names = set()
    for cls in {type(m) for m in model.modules()}:
        try:
            source = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            continue
        if "scaled_dot_product_attention" in source:
            names.add(cls.__name__)
    return sorted(names)


def _workload_loss(model: nn.Module, batch: Any, with_aux: bool) -> torch.Tensor:
    return model(batch, with_aux)["total"]  # type: ignore[no-any-return]


def use_attention_backend(trainer: Trainer, model: nn.Module, config: TrainConfig, device: torch.device,
                          notes: Notes, error: Callable[[str], Exception]) -> None:
    """Knob step 9b, ``attention_backend``: the Trainer's loss (the model's forward) runs under
    ``torch.nn.attention.sdpa_kernel([backend])``, so scaled_dot_product_attention may use that
    kernel only (a compiled forward traces under it too, and the backward runs the kernel's own
    backward). Inactive where the kernel cannot run on this device for the forward's dtype (the
    autocast dtype, else the model's), or where the HF model's attention is not sdpa. A call the
    kernel refuses later (its shape, a mask) raises `error(message)` naming the knob."""
    knob, name = "attention_backend", config.attention_backend
    if name == "auto":
        notes[knob] = "auto (torch's choice per call)"
        return
    hf = hf_models(model)
    other = [f"{type(m).__name__}: {attn_implementation(m)}" for m in hf if attn_implementation(m) != "sdpa"]
    if hf and len(other) == len(hf):
        notes[knob] = (f"{name} (inactive: the Hugging Face model's attention is not sdpa ({', '.join(other)}): "
                       "set hf_attn_implementation sdpa)")
        return
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    dtype = trainer.autocast_dtype or (param.dtype if param is not None else torch.float32)
    why = sdpa_blocker(name, device, dtype)
    if why is not None:
        notes[knob] = f"{name} (inactive: {why}; torch's choice runs)"
        return
    from torch.nn.attention import sdpa_kernel

    backend = sdpa_backend(name)
    inner = trainer.loss_fn or _workload_loss

    def loss(m: nn.Module, batch: Any, with_aux: bool) -> torch.Tensor:
        with sdpa_kernel([backend]):
            try:
                return inner(m, batch, with_aux)
            except RuntimeError as e:
                if any(text in str(e) for text in NO_KERNEL):
                    raise error(f"attention_backend={name}: this model's attention call has no {name} kernel "
                                f"({_first_line(e)}): use auto, or math") from e
                raise

    trainer.loss_fn = loss
    notes[knob] = (f"{name}: scaled_dot_product_attention limited to {backend.name} in every forward "
                   f"({str(dtype).removeprefix('torch.')} on {device.type})")
    if not hf and not sdpa_callers(model):
        notes[knob] += ("; no module's forward names scaled_dot_product_attention, so it is inactive unless a "
                        "function the forward calls uses it")


__all__ = ["apply_attn_implementation", "apply_liger_kernels", "apply_lr_scaling", "apply_model_kernels",
           "compile_model", "sdpa_blocker", "use_attention_backend"]
