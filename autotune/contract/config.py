"""Training configuration: the knobs a trial sets, declared once.

Every knob has a name, a type, a default and either a set of allowed values or a range.
`parse_config` turns a user mapping (JSON, YAML, a search-space sample) into a frozen
`TrainConfig`, rejecting unknown knobs, bad values and impossible combinations with a
`ConfigError` that names the knob and says what is allowed. The search space, the REST
API and the CLI all validate through this module, so the rules live in one place.

This module imports nothing heavy (no torch): the service validates with it too.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COMPILE_MODES = ("none", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CHECKPOINT_MODES = ("none", "block", "attn", "mlp", "selective")
PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8")
PARALLEL_MODES = ("ddp", "fsdp2")
# The language-model knobs (autotune/engine/lm_knobs.py applies them; docs/workloads.md explains them)
ATTENTION_BACKENDS = ("auto", "flash", "efficient", "cudnn", "math")
HF_ATTN_IMPLEMENTATIONS = ("auto", "sdpa", "eager", "flex_attention")
INDUCTOR_TUNINGS = ("none", "coordinate_descent", "max_autotune_gemm", "max_autotune_gemm+coordinate_descent")
LR_SCALINGS = ("none", "linear", "sqrt")


class ConfigError(ValueError):
    """A knob has a bad name, type or value. `knob` names it; the message says the fix."""

    def __init__(self, knob: str, message: str) -> None:
        super().__init__(f"{knob}: {message}")
        self.knob = knob
        self.message = message


@dataclass(frozen=True)
class Knob:
    """One tunable setting: its type, default and what values are allowed."""

    name: str
    type: type
    default: Any
    doc: str
    choices: tuple[Any, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    nullable: bool = False

    def allowed(self) -> str:
        """Human-readable description of the allowed values."""
        if self.choices is not None:
            text = " | ".join(str(c).lower() if isinstance(c, bool) else str(c) for c in self.choices)
        elif self.minimum is not None and self.maximum is not None:
            text = f"{self.type.__name__} in [{self.minimum}, {self.maximum}]"
        elif self.minimum is not None:
            text = f"{self.type.__name__} >= {self.minimum}"
        else:
            text = self.type.__name__
        return text + (" or null" if self.nullable else "")

    def check(self, value: Any) -> Any:
        """Return `value` coerced to this knob's type, or raise ConfigError."""
        if value is None:
            if self.nullable:
                return None
            raise ConfigError(self.name, f"must not be null; allowed: {self.allowed()}")
        if self.type is bool:
            if not isinstance(value, bool):
                raise ConfigError(self.name, f"expected true or false, got {value!r}")
        elif self.type is int:
            if isinstance(value, bool) or not isinstance(value, int):
                if isinstance(value, float) and value.is_integer():
                    value = int(value)
                else:
                    raise ConfigError(self.name, f"expected an integer, got {value!r}; allowed: {self.allowed()}")
        elif self.type is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(self.name, f"expected a number, got {value!r}; allowed: {self.allowed()}")
            value = float(value)
            if not math.isfinite(value):
                raise ConfigError(self.name, f"expected a finite number, got {value!r}; allowed: {self.allowed()}")
        elif self.type is str and not isinstance(value, str):
            raise ConfigError(self.name, f"expected a string, got {value!r}; allowed: {self.allowed()}")
        if self.choices is not None and value not in self.choices:
            raise ConfigError(self.name, f"{value!r} is not allowed; allowed: {self.allowed()}")
        if self.minimum is not None and value < self.minimum:
            raise ConfigError(self.name, f"{value!r} is too small; allowed: {self.allowed()}")
        if self.maximum is not None and value > self.maximum:
            raise ConfigError(self.name, f"{value!r} is too large; allowed: {self.allowed()}")
        return value


# The knob families, in the order they are applied by the probe (see autotune/engine/knobs.py).
KNOBS: dict[str, Knob] = {
    k.name: k
    for k in (
        Knob("precision", str, "fp32",
             "fp32 (TF32 off) | tf32 | bf16 autocast | fp16 autocast+GradScaler | fp8 (torchao)", choices=PRECISIONS),
        Knob("cudnn_benchmark", bool, False, "torch.backends.cudnn.benchmark", choices=(False, True)),
        Knob("checkpoint", str, "none", "activation-checkpoint granularity inside each transformer block",
             choices=CHECKPOINT_MODES),
        Knob("hf_attn_implementation", str, "auto", "a Hugging Face model's attn_implementation, set on the model "
             "(auto: the model's own; inactive on other models)", choices=HF_ATTN_IMPLEMENTATIONS),
        Knob("liger_kernels", bool, False, "Liger's fused kernels (RMSNorm, SwiGLU, RoPE, fused linear "
             "cross-entropy) on a Hugging Face model of a class Liger supports (CUDA; pip install "
             "'autotune[liger]')", choices=(False, True)),
        Knob("compile", str, "none", "torch.compile mode (none = eager)", choices=COMPILE_MODES),
        Knob("inductor_tuning", str, "none", "TorchInductor tuning flags for the model's compile only "
             "(coordinate-descent tuning, Triton GEMM autotuning); inactive with compile none",
             choices=INDUCTOR_TUNINGS),
        Knob("attention_backend", str, "auto", "the kernels scaled_dot_product_attention may use in the forward "
             "(auto: torch's choice); one that cannot run on this device and dtype is recorded inactive",
             choices=ATTENTION_BACKENDS),
        Knob("bucket_cap_mb", float, 25.0, "DDP gradient bucket size in MiB (live only with world size > 1)",
             minimum=0.001, maximum=4096.0),
        Knob("parallel", str, "ddp", "data parallelism over the trial's GPUs: ddp (DistributedDataParallel) | "
             "fsdp2 (fully_shard); live only with world size > 1", choices=PARALLEL_MODES),
        Knob("gradient_as_bucket_view", bool, False, "DDP: gradients are views into the all-reduce buckets "
             "(saves a copy and memory; world size > 1, parallel=ddp)", choices=(False, True)),
        Knob("static_graph", bool, False, "DDP static_graph=True: the used parameters never change between "
             "iterations (world size > 1, parallel=ddp)", choices=(False, True)),
        Knob("no_sync_accumulation", bool, True, "skip the gradient all-reduce on all but the last micro-batch "
             "of an optimizer step (DDP no_sync / FSDP2 set_requires_gradient_sync; world size > 1)",
             choices=(False, True)),
        Knob("nccl_nsocks_perthread", int, None, "NCCL_NSOCKS_PERTHREAD for the launch (null: unset; NCCL's "
             "socket transport, world size > 1)", minimum=1, maximum=64, nullable=True),
        Knob("nccl_socket_nthreads", int, None, "NCCL_SOCKET_NTHREADS for the launch (null: unset; NCCL's "
             "socket transport, world size > 1)", minimum=1, maximum=16, nullable=True),
        Knob("nccl_min_nchannels", int, None, "NCCL_MIN_NCHANNELS for the launch (null: unset; world size > 1)",
             minimum=1, maximum=32, nullable=True),
        Knob("fused_optimizer", bool, False, "optimizer implementation of every optimizer that has one (AdamW, "
             "Adam, SGD): true = fused kernel, false = foreach; inactive for an optimizer without (Muon)",
             choices=(False, True)),
        Knob("compile_optimizer", bool, False, "torch.compile the optimizer step (every optimizer; learning rates "
             "become device tensors): the per-parameter loops of a host-bound step (Muon's Newton-Schulz, "
             "AdamW) become generated kernels; inactive with fp16", choices=(False, True)),
        Knob("step_graph", bool, False, "capture the whole optimizer step (forward, backward, clipping, the "
             "optimizers) in one CUDA graph after the warm-up: one launch per step instead of per-parameter host "
             "work (CUDA, one process; inactive with CUDA-graph compile modes and fp16; an optimizer without a "
             "capturable mode, e.g. Muon, needs compile_optimizer)", choices=(False, True)),
        Knob("batch_size", int, None, "micro-batch size (default: the workload preset's)", minimum=1, maximum=65536,
             nullable=True),
        Knob("accum_steps", int, None, "micro-batches per optimizer step (default: the preset's)", minimum=1,
             maximum=1024, nullable=True),
        Knob("num_workers", int, 0, "DataLoader worker processes", minimum=0, maximum=256),
        Knob("prefetch_factor", int, None, "batches prefetched per worker (only with num_workers > 0)", minimum=1,
             maximum=64, nullable=True),
        Knob("pin_memory", bool, False, "page-locked host batches for async host-to-device copies",
             choices=(False, True)),
        Knob("persistent_workers", bool, False, "keep DataLoader workers alive across epochs (only with workers > 0)",
             choices=(False, True)),
        Knob("inverse_loss_frequency", int, 1, "compute the workload's expensive auxiliary losses every N steps",
             minimum=1, maximum=1000),
        Knob("lr", float, None, "learning rate (default: the preset's; not searched by default)", minimum=0.0,
             nullable=True),
        Knob("lr_scaling", str, "none", "the lr's rule when batch_size × accum_steps differs from the preset's: "
             "none (kept) | linear (× the ratio) | sqrt (× its square root)", choices=LR_SCALINGS),
    )
}


@dataclass(frozen=True)
class TrainConfig:
    """One point of the search space: the knob values a probe runs with.

    `batch_size`, `accum_steps` and `lr` may be None, meaning "the workload preset's
    default"; `resolve` fills them in.
    """

    precision: str = "fp32"
    cudnn_benchmark: bool = False
    checkpoint: str = "none"
    hf_attn_implementation: str = "auto"
    liger_kernels: bool = False
    compile: str = "none"
    inductor_tuning: str = "none"
    attention_backend: str = "auto"
    bucket_cap_mb: float = 25.0
    parallel: str = "ddp"
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    no_sync_accumulation: bool = True
    nccl_nsocks_perthread: int | None = None
    nccl_socket_nthreads: int | None = None
    nccl_min_nchannels: int | None = None
    fused_optimizer: bool = False
    compile_optimizer: bool = False
    step_graph: bool = False
    batch_size: int | None = None
    accum_steps: int | None = None
    num_workers: int = 0
    prefetch_factor: int | None = None
    pin_memory: bool = False
    persistent_workers: bool = False
    inverse_loss_frequency: int = 1
    lr: float | None = None
    lr_scaling: str = "none"

    @property
    def effective_batch(self) -> int:
        if self.batch_size is None or self.accum_steps is None:
            raise ValueError("effective_batch needs batch_size and accum_steps; call resolve() first")
        return self.batch_size * self.accum_steps

    def resolve(self, batch_size: int, accum_steps: int, lr: float) -> TrainConfig:
        """Fill the preset-dependent defaults that are still None."""
        return dataclasses.replace(
            self,
            batch_size=self.batch_size if self.batch_size is not None else batch_size,
            accum_steps=self.accum_steps if self.accum_steps is not None else accum_steps,
            lr=self.lr if self.lr is not None else lr,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


assert set(KNOBS) == {f.name for f in dataclasses.fields(TrainConfig)}, "KNOBS and TrainConfig disagree"


# The knobs that act only when a trial spans several processes (world size > 1: DDP or FSDP2
# over the trial's GPUs). A single-process probe records them as inactive, and a search space
# may declare them only for a study of gpus_per_trial > 1 (autotune.contract.space.validate_for).
DISTRIBUTED_KNOBS = ("bucket_cap_mb", "parallel", "gradient_as_bucket_view", "static_graph", "no_sync_accumulation",
                     "nccl_nsocks_perthread", "nccl_socket_nthreads", "nccl_min_nchannels")

# NCCL environment knobs → the variable set on the launch (unset when the knob is null).
NCCL_ENV_KNOBS = {"nccl_nsocks_perthread": "NCCL_NSOCKS_PERTHREAD", "nccl_socket_nthreads": "NCCL_SOCKET_NTHREADS",
                  "nccl_min_nchannels": "NCCL_MIN_NCHANNELS"}


# The knobs `check_rules` reads: a search space is checked over every combination of these
# it can draw (autotune.contract.space), so a rule reading another knob must be listed here.
RULE_KNOBS = ("num_workers", "prefetch_factor", "persistent_workers")
# The knobs `check_hardware` reads: a search space's choices of each are checked against the study's hardware.
HARDWARE_KNOBS = ("precision", "attention_backend", "liger_kernels")


def knobs_of(config: Mapping[str, Any] | Any) -> dict[str, Any]:
    """The knob settings in `config` (derived and unknown keys dropped; {} for a non-mapping):
    what a stored config holds beside its knobs (effective_batch, ...) never becomes one."""
    if not isinstance(config, Mapping):
        return {}
    return {k: v for k, v in config.items() if k in KNOBS}


def check_rules(values: Mapping[str, Any]) -> None:
    """Cross-knob rules that hold for every device. Raises ConfigError naming a knob.
    `values` holds every knob (defaults filled in); only RULE_KNOBS are read."""
    workers = values.get("num_workers", 0)
    if workers == 0:
        if values.get("prefetch_factor") is not None:
            raise ConfigError("prefetch_factor", "only applies with num_workers > 0; set num_workers >= 1 or drop it")
        if values.get("persistent_workers"):
            raise ConfigError("persistent_workers", "only applies with num_workers > 0; set num_workers >= 1 or false")


def check_hardware(values: Mapping[str, Any], hardware: str) -> None:
    """Rules of the hardware class a study runs on ('cpu', or the GPU name a worker reports).
    Raises ConfigError naming the knob. fp8 needs a CUDA GPU (compute capability >= 8.9, which
    only the probe can check on the GPU itself); so do the efficient and cuDNN attention kernels
    and Liger's kernels. Only HARDWARE_KNOBS are read."""
    if values.get("precision") == "fp8" and hardware == "cpu":
        raise ConfigError("precision", "fp8 needs a CUDA GPU with compute capability >= 8.9 and this study's "
                                       "hardware is cpu: use bf16 or fp32, or run the study on such a GPU")
    if values.get("attention_backend") in ("efficient", "cudnn") and hardware == "cpu":
        raise ConfigError("attention_backend", f"{values['attention_backend']} attention is a CUDA kernel and this "
                                               "study's hardware is cpu: use auto, flash (torch's CPU flash kernel) "
                                               "or math, or run the study on a GPU")
    if values.get("liger_kernels") is True and hardware == "cpu":
        raise ConfigError("liger_kernels", "Liger's kernels are Triton kernels for CUDA GPUs and this study's "
                                           "hardware is cpu: set liger_kernels false, or run the study on a GPU")


def parse_config(raw: Mapping[str, Any] | None) -> TrainConfig:
    """Validate a mapping of knob values into a TrainConfig (unset knobs take defaults)."""
    raw = dict(raw or {})
    values: dict[str, Any] = {}
    for name, value in raw.items():
        knob = KNOBS.get(name) if isinstance(name, str) else None
        if knob is None:
            close = difflib.get_close_matches(str(name), KNOBS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(str(name), f"unknown knob{hint}; known knobs: {', '.join(KNOBS)}")
        values[name] = knob.check(value)
    check_rules({**{k: v.default for k, v in KNOBS.items()}, **values})
    return TrainConfig(**values)


def load_config_arg(text: str) -> dict[str, Any]:
    """Read a `--config` argument: inline JSON, or a path to a YAML/JSON file."""
    text = text.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError("config", f"not valid JSON ({e}); pass a JSON object or a path to a YAML file") from e
    else:
        path = Path(text)
        if not path.is_file():
            raise ConfigError("config", f"{text!r} is neither a JSON object nor an existing file")
        import yaml

        try:
            data = yaml.safe_load(path.read_text())
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise ConfigError("config", f"{text}: not valid YAML ({' '.join(str(e).split())})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("config", f"expected a mapping of knob -> value, got {type(data).__name__}")
    return data


def normalised(config: Mapping[str, Any]) -> dict[str, Any]:
    """Every knob's value in `config`, a knob left out at its default, coerced to the knob's
    type (25 and 25.0 are one bucket size); a value the knob refuses is kept as given. Two
    configs that normalise alike run the same training."""
    out: dict[str, Any] = {}
    for name, knob in KNOBS.items():
        value = config.get(name, knob.default)
        try:
            out[name] = knob.check(value)
        except ConfigError:
            out[name] = value
    return out
