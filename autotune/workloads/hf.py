"""Hugging Face causal language models as autotune workloads, and a tuned config on the HF Trainer.

A workload from an HF causal LM and a token stream, in a few lines (registered under the
entry-point group ``autotune.workloads`` as ``my-lm = "my_pkg.workload:workload"``)::

    from transformers import LlamaConfig, LlamaForCausalLM
    from autotune.workloads import TrainingDefaults
    from autotune.workloads.hf import causal_lm_workload

    workload = causal_lm_workload(
        "my-lm",
        model=lambda: LlamaForCausalLM(LlamaConfig(vocab_size=32000, hidden_size=512, num_hidden_layers=8)),
        tokens=lambda: torch.load("tokens.pt"),      # 1-D token ids; the last 10 % validate
        block_size=512,
        defaults=TrainingDefaults(batch_size=8, accum_steps=4, lr=3e-4, samples=8192, weight_decay=0.1),
    )

The probe trains the model on blocks of `block_size` tokens with ``labels = input_ids`` (the HF
model shifts them and returns the loss), with AdamW over two parameter groups as HF users build
them (`decay_param_groups`: no weight decay on biases and LayerNorm/RMSNorm weights); its quality
is ``val_loss``, the mean next-token cross-entropy over every validation token, in fp32. The
``checkpoint`` knob drives the model's own ``gradient_checkpointing_enable`` (whole decoder layers:
``block``, or ``selective`` keeping the matmul outputs; ``attn`` / ``mlp`` are refused), through
`autotune.engine.knobs.apply_checkpointing`. A job that samples its own batches (nanoGPT-style
``get_batch``: random windows copied to the device) says so with ``sample_batch=``: the probe then
trains on that data path instead of a DataLoader over the blocks. Several presets, or a model per
preset: subclass `HFCausalLM`.

Your own loop takes a recommended config with `autotune.apply` and `causal_lm_loss`; the HF
Trainer takes it as its `training_arguments` (docs/huggingface.md).

transformers is imported only inside functions: importing this module needs torch alone.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from autotune.contract.config import KNOBS, TrainConfig
from autotune.contract.workload import TrainingDefaults, Workload

if TYPE_CHECKING:
    from transformers import TrainingArguments

# What a workload's tokens may be: a 1-D tensor of token ids (cut into blocks), or a dataset of
# tokenized rows of one length (dict items with input_ids, and optionally attention_mask and
# labels: a ``datasets.Dataset`` after tokenizing and grouping, for instance).
TokenSource = torch.Tensor | Dataset | Sequence[Mapping[str, Any]]
Tokens = TokenSource | tuple[TokenSource, TokenSource]

IGNORE_INDEX = -100  # the label HF's loss skips
MODEL_KEYS = ("input_ids", "attention_mask", "labels")  # what a batch hands the model


# -- data ------------------------------------------------------------------------------------

class TokenBlocks(Dataset):
    """Blocks of `block_size` tokens of a 1-D token stream, as the model's keyword arguments:
    ``{"input_ids": block, "labels": block}`` (the HF model shifts the labels itself). Blocks
    start every `stride` tokens (default `block_size`: disjoint blocks, as HF's ``group_texts``)."""

    def __init__(self, tokens: torch.Tensor, block_size: int, stride: int | None = None) -> None:
        tokens = torch.as_tensor(tokens)
        if tokens.ndim != 1:
            raise ValueError(f"tokens: expected a 1-D tensor of token ids, got shape {tuple(tokens.shape)}")
        if block_size < 2:
            raise ValueError(f"block_size {block_size}: a block needs at least 2 tokens (an input and its next)")
        self.tokens = tokens
        self.block_size = block_size
        self.stride = stride or block_size
        self.length = max(0, (len(tokens) - block_size) // self.stride + 1)
        if self.length == 0:
            raise ValueError(f"tokens: {len(tokens)} tokens hold no block of {block_size}")

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.length:
            raise IndexError(index)
        start = index * self.stride
        block = self.tokens[start:start + self.block_size].long()
        return {"input_ids": block, "labels": block}


class TokenRows(Dataset):
    """A dataset of tokenized rows (dict items: ``input_ids``, optionally ``attention_mask`` and
    ``labels``; lists or tensors) as tensors the probe moves to the device. Without labels they
    are the input ids, with the padding (attention_mask 0) set to -100, which the loss skips.
    Other columns (the text, ...) are left out. Rows must be of one length (batched as they are)."""

    def __init__(self, rows: Dataset | Sequence[Mapping[str, Any]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.rows[index]
        if not isinstance(row, Mapping) or "input_ids" not in row:
            raise TypeError(f"tokens: row {index} is {type(row).__name__}, not a mapping with input_ids")
        item = {k: torch.as_tensor(row[k]) for k in MODEL_KEYS if k in row}
        item["input_ids"] = item["input_ids"].long()
        if "labels" not in item:
            labels = item["input_ids"].clone()
            if "attention_mask" in item:
                labels[item["attention_mask"] == 0] = IGNORE_INDEX
            item["labels"] = labels
        return item


def token_datasets(tokens: Tokens, block_size: int, val_fraction: float = 0.1,
                   train_stride: int | None = None) -> tuple[Dataset, Dataset]:
    """(train, validation) of `tokens`: a (train, val) pair, or one 1-D stream whose last
    `val_fraction` validates. Streams become `TokenBlocks` (validation blocks always disjoint,
    so each token is scored once), datasets of rows `TokenRows`."""
    if isinstance(tokens, tuple):
        train, val = tokens
    elif isinstance(tokens, torch.Tensor) or hasattr(tokens, "__array__"):
        stream = torch.as_tensor(tokens)
        n_val = max(block_size, int(len(stream) * val_fraction))
        if len(stream) < n_val + block_size:
            raise ValueError(f"tokens: {len(stream)} tokens are too few for a training and a validation block "
                             f"of {block_size}")
        train, val = stream[:len(stream) - n_val], stream[len(stream) - n_val:]
    else:
        raise TypeError(f"tokens: a dataset of rows needs its validation set too: pass (train, val), "
                        f"got {type(tokens).__name__}")

    def as_dataset(source: TokenSource, stride: int | None) -> Dataset:
        if isinstance(source, torch.Tensor) or hasattr(source, "__array__"):
            return TokenBlocks(torch.as_tensor(source), block_size, stride)
        return TokenRows(source)

    return as_dataset(train, train_stride), as_dataset(val, None)


# -- the model -------------------------------------------------------------------------------

class CausalLMModule(nn.Module):
    """An HF causal LM with the probe's forward: ``(batch, with_aux) -> {"total": loss}``, the
    loss the model computes from ``labels``. The HF model is ``.hf`` (its state_dict keys are
    the HF model's with ``hf.`` before them; ``module.hf.save_pretrained(...)`` saves it)."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model

    def forward(self, batch: Mapping[str, torch.Tensor], with_aux: bool = True) -> dict[str, torch.Tensor]:
        return {"total": causal_lm_loss(self.hf, batch, with_aux)}


def causal_lm_loss(model: nn.Module, batch: Mapping[str, torch.Tensor], with_aux: bool = True) -> torch.Tensor:
    """The HF model's own loss of `batch` (its keyword arguments, with ``labels``), without a KV
    cache: ``loss_fn=causal_lm_loss`` for `autotune.apply` on an HF model."""
    out = model(**{k: v for k, v in batch.items() if k in MODEL_KEYS}, use_cache=False)
    loss = out.loss if hasattr(out, "loss") else out[0]
    if loss is None:
        raise ValueError("the model returned no loss: its batch needs labels (labels = input_ids for a causal LM)")
    return loss  # type: ignore[no-any-return]


def hf_model_of(model: nn.Module) -> nn.Module:
    """The HF model inside `model` (a `CausalLMModule`), or `model` itself."""
    inner = model.hf if isinstance(model, CausalLMModule) else model
    assert isinstance(inner, nn.Module)
    return inner


def _checkpointing_off(model: nn.Module) -> None:
    """Turn the model's gradient checkpointing off where its factory turned it on: the
    ``checkpoint`` knob alone decides what a probe recomputes."""
    from autotune.engine.knobs import apply_checkpointing

    apply_checkpointing(model, "none", {})


@torch.no_grad()
def validation_loss(model: nn.Module, val: Dataset, device: torch.device, batch_size: int = 16) -> float:
    """Mean next-token cross-entropy over every scored validation token (labels shifted by one,
    -100 skipped), computed in fp32 from the model's logits."""
    hf = hf_model_of(model)
    was_training = hf.training
    hf.eval()
    total, count = 0.0, 0
    try:
        for batch in DataLoader(val, batch_size=batch_size, shuffle=False):  # type: ignore[arg-type]
            inputs = {k: v.to(device) for k, v in batch.items() if k in MODEL_KEYS and k != "labels"}
            logits = hf(**inputs, use_cache=False).logits.float()
            labels = batch["labels"].to(device)[:, 1:]
            total += float(torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX,
                reduction="sum"))
            count += int((labels != IGNORE_INDEX).sum())
    finally:
        hf.train(was_training)
    if count == 0:
        raise ValueError("the validation set has no scored token")
    return total / count


# -- the optimizer ---------------------------------------------------------------------------

def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)) or "norm" in type(module).__name__.lower()


def decay_param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two parameter groups as HF users make them: weight decay on the weight matrices and
    embeddings, none on biases and on the weights of LayerNorm / RMSNorm layers (every 1-D
    parameter, and any parameter of a module whose class name says Norm). A tied weight counts
    once. Empty groups are left out."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    seen: set[int] = set()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            (no_decay if p.ndim < 2 or _is_norm(module) else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def hf_adamw(model: nn.Module, lr: float, weight_decay: float, **kwargs: Any) -> torch.optim.AdamW:
    """AdamW over `decay_param_groups` (torch's defaults: betas (0.9, 0.999), eps 1e-8, as the
    HF Trainer's)."""
    return torch.optim.AdamW(decay_param_groups(model, weight_decay), lr=lr, **kwargs)


# -- the workload ----------------------------------------------------------------------------

class HFCausalLM(Workload):
    """An HF causal LM trained on token blocks. Subclass it, or build one with
    `causal_lm_workload`: set `name`, `block_size` and `presets` (preset name → TrainingDefaults)
    and implement `hf_model` (a fresh model; `self.preset` says which) and `tokens`. A job that
    makes its training batches itself overrides `sample_batch` (`Workload.sample_batch`: a dict
    with ``input_ids`` and ``labels`` on the device); the probe then trains on it, not on the
    blocks of `tokens` (which still give the validation set)."""

    quality_metric = "val_loss"
    quality_direction = "minimize"
    block_size: int  # a class attribute, or set per preset in __init__
    presets: ClassVar[Mapping[str, TrainingDefaults]]
    val_fraction: ClassVar[float] = 0.1  # of a single token stream: the last tokens validate
    train_stride: ClassVar[int | None] = None  # None: disjoint training blocks; 1: every window
    eval_batch_size: ClassVar[int] = 16

    def __init__(self, preset: str) -> None:
        if preset not in self.presets:
            raise ValueError(f"unknown preset {preset!r} for workload {self.name!r}; known: {', '.join(self.presets)}")
        self.preset = preset

    @property
    def defaults(self) -> TrainingDefaults:
        return self.presets[self.preset]

    def hf_model(self) -> nn.Module:
        """A freshly initialised HF causal LM (e.g. ``LlamaForCausalLM(config)``; uses the global
        torch RNG, seeded by the probe)."""
        raise NotImplementedError(f"{type(self).__name__}.hf_model: return a fresh HF causal LM")

    def tokens(self) -> Tokens:
        """The token ids: one 1-D tensor (its last `val_fraction` validates), or (train, val),
        each a 1-D tensor or a dataset of tokenized rows of one length."""
        raise NotImplementedError(f"{type(self).__name__}.tokens: return the token ids")

    def build_model(self) -> nn.Module:
        hf = self.hf_model()
        _checkpointing_off(hf)
        return CausalLMModule(hf)

    def datasets(self, seed: int) -> tuple[Dataset, Dataset]:
        return token_datasets(self.tokens(), self.block_size, self.val_fraction, self.train_stride)

    def evaluate(self, model: nn.Module, val: Dataset, device: torch.device) -> float:
        return validation_loss(model, val, device, self.eval_batch_size)

    def build_optimizers(self, model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
        assert config.lr is not None, "resolve() the config first"
        return hf_adamw(model, config.lr, self.defaults.weight_decay)


def causal_lm_workload(name: str, model: Callable[[], nn.Module], tokens: Tokens | Callable[[], Tokens], *,
                       block_size: int, defaults: TrainingDefaults | Mapping[str, TrainingDefaults],
                       val_fraction: float = 0.1, train_stride: int | None = None,
                       lr_multiplier: Callable[[float], float] | None = None,
                       sample_batch: Callable[[int, torch.Generator, torch.device], Mapping[str, torch.Tensor]]
                       | None = None,
                       eval_batch_size: int = 16) -> type[HFCausalLM]:
    """A workload class (the factory an entry point names) for the HF causal LM `model()` builds,
    trained on `tokens` (or what `tokens()` returns, read when a probe starts: see `HFCausalLM.tokens`)
    in blocks of `block_size`. `defaults`: the preset ``default``, or a table preset → defaults.
    `lr_multiplier(progress)`: the schedule over the probe's samples (default: warm-up, cosine).
    `sample_batch(batch_size, generator, device)`: the job's own data path (its ``get_batch``: a
    dict with ``input_ids`` and ``labels`` on `device`, its randomness from `generator`); the
    probe then trains on these batches, not on a DataLoader over the blocks (the DataLoader
    knobs are noted inactive), and `tokens` gives the validation set."""
    presets = {"default": defaults} if isinstance(defaults, TrainingDefaults) else dict(defaults)
    memo: list[Tokens] = []

    def read_tokens(self: HFCausalLM) -> Tokens:
        if not callable(tokens) or isinstance(tokens, (torch.Tensor, Dataset)):
            return tokens  # type: ignore[return-value]
        if not memo:
            memo.append(tokens())
        return memo[0]

    namespace: dict[str, Any] = {
        "name": name, "presets": presets, "block_size": block_size, "val_fraction": val_fraction,
        "train_stride": train_stride, "eval_batch_size": eval_batch_size,
        "hf_model": lambda self: model(), "tokens": read_tokens, "__module__": _caller_module(),
    }
    if lr_multiplier is not None:
        namespace["lr_multiplier"] = lambda self, progress: lr_multiplier(progress)
    if sample_batch is not None:  # only then: the probe asks whether the class overrides it
        namespace["sample_batch"] = lambda self, batch_size, generator, device: dict(
            sample_batch(batch_size, generator, device))
    title = "".join(part.capitalize() for part in name.replace(".", "-").replace("_", "-").split("-"))
    return type(f"{title}Workload", (HFCausalLM,), namespace)


def _caller_module() -> str:
    frame = sys._getframe(2)
    return str(frame.f_globals.get("__name__", __name__))


# -- the HF Trainer ----------------------------------------------------------------------------

def training_arguments(config: str | Path | Mapping[str, Any] | TrainConfig, args: TrainingArguments,
                       model: nn.Module | None = None, *, use_config_lr: bool = False,
                       notes: dict[str, str] | None = None, quiet: bool = False) -> TrainingArguments:
    """A copy of the HF Trainer's `args` with a recommended `config` applied: build the Trainer
    with it (``Trainer(model, args=training_arguments("best.yaml", args), ...)``). The Trainer
    reads precision, compile and the DataLoader when it is built, so the config goes into its
    arguments, not into a Trainer already made.

    Mapped: batch_size → per_device_train_batch_size, accum_steps → gradient_accumulation_steps,
    precision → bf16 / fp16 / tf32, compile → torch_compile / torch_compile_mode, checkpoint
    block → (activation|gradient)_checkpointing with use_reentrant=False, fused_optimizer → optim
    adamw_torch_fused / adamw_torch (when the Trainer's optimizer is torch's AdamW), the
    DataLoader knobs → dataloader_*, bucket_cap_mb → ddp_bucket_cap_mb, static_graph →
    ddp_static_graph, cudnn_benchmark → torch.backends.cudnn.benchmark (process-wide, as the
    probe), the config's lr → learning_rate only with `use_config_lr`. ``checkpoint=selective``
    is applied to `model` itself (its checkpoint kwargs hold a function, which the arguments
    should not: they are saved as JSON), so it needs `model`; attn / mlp and precision fp8 are
    refused (ApplyError naming the knob). The LM knobs: liger_kernels → use_liger_kernel,
    hf_attn_implementation on `model`, lr_scaling → learning_rate (your arguments' effective batch
    the reference). What the Trainer cannot take (step_graph, compile_optimizer: it runs its own
    step; attention_backend, inductor_tuning: its own step and compile call, the notes give the
    line that sets them) is noted inactive in `notes` and printed once unless `quiet`."""
    from autotune.contract.errors import ProbeError
    from autotune.engine.apply import ApplyError, load_config
    from autotune.engine.knobs import apply_checkpointing

    cfg = load_config(config)
    notes = {} if notes is None else notes
    changes: dict[str, Any] = {}
    fields = {f.name for f in dataclasses.fields(args) if f.init}

    def put(name: str, value: Any) -> None:
        if name in fields:
            changes[name] = value

    # micro-batch and accumulation
    old_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps
    batch = cfg.batch_size or args.per_device_train_batch_size
    accum = cfg.accum_steps or args.gradient_accumulation_steps
    put("per_device_train_batch_size", batch)
    put("gradient_accumulation_steps", accum)
    notes["batch_size"] = f"{batch} per device × {accum} accumulated"
    if batch * accum != old_batch and args.max_steps > 0:
        notes["batch_size"] += (f"; the effective batch changed from {old_batch} to {batch * accum} sequences: "
                                f"max_steps ({args.max_steps}) counts optimizer steps, so scale it by "
                                f"{old_batch}/{batch * accum} to train the same samples")
    # precision (the probe: TF32 on for tf32 alone)
    if cfg.precision == "fp8":
        raise ApplyError("precision", "fp8 is torchao's Float8Linear in the probe, which the HF Trainer does not "
                                      "run: apply it with autotune.apply, or use a config with precision bf16")
    put("bf16", cfg.precision == "bf16")
    put("fp16", cfg.precision == "fp16")
    put("tf32", cfg.precision == "tf32")
    notes["precision"] = {"fp32": "fp32 (tf32=False)", "tf32": "tf32=True", "bf16": "bf16=True (autocast)",
                          "fp16": "fp16=True (autocast + GradScaler)"}[cfg.precision]
    torch.backends.cudnn.benchmark = cfg.cudnn_benchmark
    notes["cudnn_benchmark"] = f"{str(cfg.cudnn_benchmark).lower()} (torch.backends.cudnn.benchmark, process-wide)"
    # activation checkpointing
    flag = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    kwargs_field = f"{flag}_kwargs"
    if cfg.checkpoint in ("attn", "mlp"):
        raise ApplyError("checkpoint", f"HF models checkpoint whole decoder layers, not the {cfg.checkpoint} "
                                       "sub-layer alone: use a config with checkpoint block or selective")
    if cfg.checkpoint == "block":
        put(flag, True)
        put(kwargs_field, {**dict(getattr(args, kwargs_field, None) or {}), "use_reentrant": False})
        notes["checkpoint"] = f"block: {flag}=True, use_reentrant=False (every decoder layer)"
    else:
        put(flag, False)
        if cfg.checkpoint == "selective" and model is None:
            raise ApplyError("checkpoint", "checkpoint=selective is applied to the model itself: pass model=... "
                                           "(the model you give the Trainer)")
        if model is not None:
            try:
                apply_checkpointing(model, cfg.checkpoint, notes)
            except ProbeError as e:
                raise ApplyError("checkpoint", e.message.removeprefix("checkpoint: ")) from None
        else:
            notes["checkpoint"] = f"none: {flag}=False"
    # compile
    put("torch_compile", cfg.compile != "none")
    put("torch_compile_mode", None if cfg.compile in ("none", "default") else cfg.compile)
    if cfg.compile == "none":
        put("torch_compile_backend", None)  # a backend alone turns torch_compile on
    notes["compile"] = "none (eager)" if cfg.compile == "none" else f"torch_compile=True, mode {cfg.compile}"
    # the optimizer
    optim = str(getattr(args.optim, "value", args.optim))
    if optim in ("adamw_torch", "adamw_torch_fused"):
        put("optim", "adamw_torch_fused" if cfg.fused_optimizer else "adamw_torch")
        notes["fused_optimizer"] = f"optim={'adamw_torch_fused' if cfg.fused_optimizer else 'adamw_torch'}"
    else:
        notes["fused_optimizer"] = (f"{str(cfg.fused_optimizer).lower()} not applied: the Trainer's optim is {optim} "
                                    "(fused_optimizer maps adamw_torch ↔ adamw_torch_fused)")
    for knob in ("compile_optimizer", "step_graph"):
        if getattr(cfg, knob):
            notes[knob] = "true not applied (inactive: the HF Trainer runs its own optimizer step; autotune.apply does)"
    if cfg.inverse_loss_frequency != 1:
        notes["inverse_loss_frequency"] = f"{cfg.inverse_loss_frequency} not applied (inactive: no auxiliary loss)"
    # data
    workers = cfg.num_workers
    put("dataloader_num_workers", workers)
    put("dataloader_prefetch_factor", cfg.prefetch_factor if workers > 0 else None)
    put("dataloader_persistent_workers", cfg.persistent_workers and workers > 0)
    put("dataloader_pin_memory", cfg.pin_memory)
    notes["num_workers"] = f"dataloader_num_workers={workers}"
    # several processes (torchrun): DDP's bucket size and static graph
    cap = max(1, round(cfg.bucket_cap_mb))
    put("ddp_bucket_cap_mb", cap)
    notes["bucket_cap_mb"] = f"ddp_bucket_cap_mb={cap}" + (f" (rounded from {cfg.bucket_cap_mb:g}: the Trainer takes "
                                                            "whole MiB)" if cap != cfg.bucket_cap_mb else "")
    if cfg.static_graph and "ddp_static_graph" not in fields:
        notes["static_graph"] = "true not applied (inactive: this transformers has no ddp_static_graph)"
    put("ddp_static_graph", cfg.static_graph)
    for knob in ("parallel", "gradient_as_bucket_view", "no_sync_accumulation", "nccl_nsocks_perthread",
                 "nccl_socket_nthreads", "nccl_min_nchannels"):
        if getattr(cfg, knob) != KNOBS[knob].default:
            notes[knob] = (f"{getattr(cfg, knob)} not applied (inactive: no TrainingArguments field; "
                           "see docs/huggingface.md)")
    # the learning rate: yours unless asked
    if use_config_lr:
        if cfg.lr is None:
            raise ApplyError("lr", "use_config_lr=True but the config has no lr; drop use_config_lr or add lr")
        put("learning_rate", cfg.lr)
        notes["lr"] = f"{cfg.lr:g} from the config (use_config_lr=True)"
    elif cfg.lr is not None and cfg.lr != args.learning_rate:
        notes["lr"] = (f"{cfg.lr:g} in the config not applied: your learning_rate ({args.learning_rate:g}) kept "
                       "(use_config_lr=True applies the config's)")
    # the language-model knobs (autotune/engine/lm_knobs.py), lr_scaling on the lr chosen above
    _lm_knobs_on_trainer(cfg, args, model, fields, put, notes, old_batch, batch * accum, use_config_lr)
    updated = dataclasses.replace(args, **changes)
    if not quiet:
        lines = [f"  {knob}: {text}" for knob, text in notes.items() if "not applied" in text or "inactive" in text]
        if lines:
            print("autotune training_arguments: knobs that could not act on the HF Trainer:", *lines, sep="\n",
                  file=sys.stderr)
    return updated


def _lm_knobs_on_trainer(cfg: TrainConfig, args: TrainingArguments, model: nn.Module | None, fields: set[str],
                         put: Callable[[str, Any], None], notes: dict[str, str], old_batch: int, new_batch: int,
                         use_config_lr: bool) -> None:
    """liger_kernels → use_liger_kernel; hf_attn_implementation on `model`; lr_scaling → learning_rate
    (the lr in use × the rule's factor, your args' own effective batch the reference);
    attention_backend and inductor_tuning noted with the line that applies them (the Trainer runs
    its own step and its own torch.compile call)."""
    from autotune.engine.lm_knobs import INDUCTOR_FLAGS, apply_attn_implementation, lr_factor_of, sdpa_backend

    if "use_liger_kernel" in fields:
        put("use_liger_kernel", cfg.liger_kernels)
        if cfg.liger_kernels:
            notes["liger_kernels"] = "use_liger_kernel=True (the Trainer applies Liger's kernels; needs liger-kernel)"
    elif cfg.liger_kernels:
        notes["liger_kernels"] = "true not applied (inactive: this transformers has no use_liger_kernel)"
    if cfg.hf_attn_implementation != "auto":
        if model is None:
            notes["hf_attn_implementation"] = (f"{cfg.hf_attn_implementation} not applied: pass model=... (the "
                                               "model you give the Trainer), or build it with "
                                               f"attn_implementation={cfg.hf_attn_implementation!r}")
        else:
            on_cpu = args.use_cpu or not torch.cuda.is_available()
            apply_attn_implementation(model, cfg, notes, torch.device("cpu" if on_cpu else "cuda"))
    if cfg.attention_backend != "auto":
        notes["attention_backend"] = (f"{cfg.attention_backend} not applied (inactive: the Trainer runs its own step): "
                                      "train under `with torch.nn.attention.sdpa_kernel(torch.nn.attention."
                                      f"SDPBackend.{sdpa_backend(cfg.attention_backend).name}): trainer.train()`")
    if cfg.inductor_tuning != "none":
        flags = " and ".join(f"torch._inductor.config.{flag} = True" for flag in INDUCTOR_FLAGS[cfg.inductor_tuning])
        notes["inductor_tuning"] = (f"{cfg.inductor_tuning} not applied (inactive: the Trainer makes its own "
                                    f"torch.compile call): set {flags} before trainer.train()")
    if cfg.lr_scaling != "none":
        lr = cfg.lr if use_config_lr and cfg.lr is not None else args.learning_rate
        factor = lr_factor_of(cfg.lr_scaling, new_batch, old_batch)
        put("learning_rate", lr * factor)
        notes["lr"] = (f"{lr * factor:g} ({lr:g} × {factor:.4g}: lr_scaling {cfg.lr_scaling}, your arguments' "
                       f"effective batch {old_batch} → {new_batch})")


__all__ = ["CausalLMModule", "HFCausalLM", "TokenBlocks", "TokenRows", "causal_lm_loss", "causal_lm_workload",
           "decay_param_groups", "hf_adamw", "hf_model_of", "token_datasets", "training_arguments",
           "validation_loss"]
