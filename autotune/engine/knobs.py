"""Each knob family applied for real, one small function each.

The probe applies them in this order (each function checks its own preconditions):

1. ``apply_backend_flags``   precision's TF32 switches, cudnn.benchmark (process-global)
2. ``apply_checkpointing``   activation-checkpoint granularity on the model's blocks
3. model moved to the device (before it 2b; and 6 with inductor_tuning, 7b, 9b: the LM knobs, lm_knobs.py)
4. ``apply_fp8``             torchao float8 training (precision=fp8 only; before compile)
5. ``apply_ddp``             DDP (bucket_cap_mb, gradient_as_bucket_view, static_graph) or
                             FSDP2 fully_shard over the ranks (inactive in a single-process probe)
6. ``apply_compile``         torch.compile with the chosen mode (wraps the whole loss, and the
                             DDP module: dynamo's DDPOptimizer splits graphs at bucket boundaries)
7. ``build_optimizers``      the workload's optimizer(s) (default AdamW; a Muon + AdamW hybrid ...),
                             ``fused_optimizer`` set on them in place (autotune/engine/optimizers.py)
8. ``build_loader``          DataLoader workers / prefetch / pin_memory / persistent workers
9. ``Trainer``               autocast + GradScaler, accumulation (no_sync on all but the last
                             micro-batch with several ranks), inverse-loss frequency, gradient
                             clipping, the optimizer step compiled (``compile_optimizer``) and the
                             whole step as one CUDA graph (``step_graph``, autotune/engine/step_graph.py)

The NCCL knobs are environment variables, set on the launch (`autotune.engine.distributed`) before
any rank starts; `apply_ddp` records them.

Every function returns what it built and records in ``notes`` what it did, or why it was
inactive, so a ProbeResult says which knobs actually changed the run.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

from autotune.contract.config import TrainConfig
from autotune.contract.errors import ProbeError
from autotune.engine import step_graph
from autotune.engine.epoch_cost import Boundary
from autotune.engine.hf_checkpointing import checkpoint_hf_models, hf_models
from autotune.engine.optimizers import (
    OptimizerLike,
    adamw,
    all_params,
    apply_fused_optimizer,
    as_optimizers,
    clip_gradients,
    compile_optimizer_step,
    lr_to_tensor,
    set_lr,
)

log = logging.getLogger(__name__)

Notes = dict[str, str]


# -- 1. backend flags -----------------------------------------------------------------------

def apply_backend_flags(config: TrainConfig, device: torch.device, notes: Notes) -> None:
    """Set the process-global matmul/cudnn switches. fp32 means TF32 *off*; tf32 turns it on.

    Set explicitly both ways so a previous probe in the same process cannot leak in.
    """
    tf32 = config.precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    if config.precision in ("fp32", "tf32"):
        notes["precision"] = f"{config.precision}: TF32 {'on' if tf32 else 'off'}" + (
            "" if device.type == "cuda" else " (no effect on cpu)")
    torch.backends.cudnn.benchmark = config.cudnn_benchmark
    notes["cudnn_benchmark"] = str(config.cudnn_benchmark).lower() + (
        "" if device.type == "cuda" else " (no effect on cpu)")


# -- 2. activation checkpointing ------------------------------------------------------------

def apply_checkpointing(model: nn.Module, mode: str, notes: Notes) -> int:
    """Set the checkpoint granularity on every module that has a `checkpoint` attribute
    (the workload's transformer blocks), and on every Hugging Face model inside `model`
    through its own switch: ``gradient_checkpointing_enable`` (non-reentrant; ``selective``
    with the matmul-saving policy; ``attn`` / ``mlp`` refused: HF checkpoints whole layers) or
    ``gradient_checkpointing_disable`` (``none``). Returns how many blocks (and HF decoder
    layers) were set."""
    blocks = [m for m in model.modules() if hasattr(m, "checkpoint") and not isinstance(m, nn.ModuleList)]
    hf = hf_models(model)
    if mode != "none" and not blocks and not hf:
        raise ProbeError("unsupported", "checkpoint: this workload's model has no checkpointable blocks (no module "
                                        "with a `checkpoint` attribute, no Hugging Face model with "
                                        "gradient_checkpointing_enable); use none")
    if mode == "selective" and not hasattr(torch.utils.checkpoint, "create_selective_checkpoint_contexts"):
        raise ProbeError("unsupported", f"checkpoint=selective needs torch >= 2.4 (installed {torch.__version__})")
    done = checkpoint_hf_models(hf, mode) if hf else []
    for block in blocks:
        setattr(block, "checkpoint", mode)  # noqa: B010 (a plain attribute read in Block.forward)
    if not hf:
        notes["checkpoint"] = f"{mode} on {len(blocks)} blocks"
        return len(blocks)
    parts = [f"{mode} on {f'{n} decoder layers' if n is not None else 'the decoder layers'} of {name}"
             for name, n in done]
    if mode == "none":
        parts = [f"none: gradient checkpointing off on {name}" for name, _ in done]
    elif mode == "block":
        parts = [p + " (gradient_checkpointing_enable, use_reentrant=False)" for p in parts]
    else:
        parts = [p + " (gradient_checkpointing_enable, use_reentrant=False; matmul and attention outputs kept)"
                 for p in parts]
    if blocks:
        parts.append(f"{mode} on {len(blocks)} blocks")
    notes["checkpoint"] = "; ".join(parts)
    return sum(n or 0 for _, n in done) + len(blocks)


# -- 4. fp8 -------------------------------------------------------------------------------

def fp8_supported(device: torch.device) -> str | None:
    """None when fp8 training can run here; otherwise the reason it cannot."""
    if device.type != "cuda":
        return f"fp8 training needs a CUDA GPU with compute capability >= 8.9; device is {device.type}"
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        return f"fp8 training needs compute capability >= 8.9 (Ada/Hopper); this GPU is {cap[0]}.{cap[1]}"
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return "fp8 training needs torchao: pip install 'autotune[gpu]' (or pip install torchao)"
    return None


def apply_fp8(model: nn.Module, config: TrainConfig, device: torch.device, notes: Notes) -> nn.Module:
    """Swap eligible nn.Linear layers for torchao Float8Linear (dims divisible by 16)."""
    if config.precision != "fp8":
        return model
    reason = fp8_supported(device)
    if reason:
        raise ProbeError("unsupported", reason)
    from torchao.float8 import convert_to_float8_training

    def eligible(module: nn.Module, fqn: str) -> bool:
        return isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0

    convert_to_float8_training(model, module_filter_fn=eligible)
    n = sum(1 for m in model.modules() if type(m).__name__ == "Float8Linear")
    notes["precision"] = f"fp8: {n} Linear layers in float8 (torchao), the rest bf16 autocast"
    return model


# -- 5. DDP / FSDP2 -----------------------------------------------------------------------

def world_size() -> int:
    """Processes in this probe: the default process group's size, 1 when there is none."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def record_inactive_distributed(config: TrainConfig, notes: Notes, why: str) -> None:
    """Note every distributed knob as inactive (`why`: e.g. 'world size 1')."""
    from autotune.contract.config import DISTRIBUTED_KNOBS

    for name in DISTRIBUTED_KNOBS:
        notes[name] = f"{shown_value(getattr(config, name))} (inactive: {why})"


def shown_value(value: Any) -> str:
    """A knob's value as the notes show it (true/false, 25, unset)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    return "unset" if value is None else str(value)


def _record_nccl(config: TrainConfig, device: torch.device, notes: Notes) -> None:
    """The NCCL knobs are environment variables set on the launch (autotune.engine.distributed);
    here they are only recorded, with whether NCCL is the backend at all."""
    from autotune.contract.config import NCCL_ENV_KNOBS

    for name, variable in NCCL_ENV_KNOBS.items():
        value = getattr(config, name)
        if device.type != "cuda":
            notes[name] = f"{shown_value(value)} (inactive: gloo on cpu)"
        else:
            notes[name] = f"{variable}={value}" if value is not None else f"{variable} unset (NCCL's default)"


def apply_ddp(model: nn.Module, config: TrainConfig, notes: Notes, device: torch.device | None = None) -> nn.Module:
    """Wrap the model for data parallelism over the default process group.

    World size 1 (no process group): the model is returned as it is and every distributed
    knob is recorded as inactive. Otherwise, by ``parallel``:

    * ``ddp``: `DistributedDataParallel` with ``bucket_cap_mb``, ``gradient_as_bucket_view``
      and ``static_graph`` (one replica per process; ``device_ids`` = the process's GPU).
      ``static_graph`` with no_sync accumulation (accum_steps > 1) is "unsupported": DDP's
      static graph breaks under ``no_sync()`` (pytorch/pytorch#143580).
    * ``fsdp2``: `fully_shard` on every transformer block (modules with a ``checkpoint``
      attribute), then on the root; the DDP-only knobs are recorded inactive.

    Applied before `apply_compile`: compiling the wrapped module lets dynamo's DDPOptimizer
    split the graph at bucket boundaries, so all-reduces overlap the backward. The caller
    passes the returned module to `Trainer(parallel=...)` (for no_sync).
    """
    world = world_size()
    if world == 1:
        record_inactive_distributed(config, notes, "world size 1")
        return model
    device = device or next(model.parameters()).device
    backend = torch.distributed.get_backend()
    _record_nccl(config, device, notes)
    accum = config.accum_steps or 1
    notes["no_sync_accumulation"] = (
        "true: all-reduce on the last micro-batch of each step only" if config.no_sync_accumulation
        else "false: all-reduce after every micro-batch") + ("" if accum > 1 else " (accum_steps 1: no effect)")
    if config.parallel == "fsdp2":
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError as e:
            raise ProbeError("unsupported", f"parallel=fsdp2 needs torch.distributed.fsdp.fully_shard (torch >= 2.6; "
                                            f"installed {torch.__version__}); use parallel=ddp") from e
        from torch.distributed.device_mesh import init_device_mesh

        # the probe's device type, not the host's accelerator (fully_shard's default mesh): gloo
        # ranks of a CPU probe on a GPU host shard on the CPU
        mesh = init_device_mesh(device.type, (world,))
        blocks = [m for m in model.modules() if hasattr(m, "checkpoint") and not isinstance(m, nn.ModuleList)]
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for name in ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph"):
            notes[name] = f"{shown_value(getattr(config, name))} (inactive: parallel=fsdp2)"
        notes["parallel"] = f"fsdp2: fully_shard on {len(blocks)} blocks + root, {world} ranks ({backend})"
        return model
    if config.static_graph and config.no_sync_accumulation and accum > 1:
        # DDP's static graph breaks under no_sync() (pytorch/pytorch#143580; torch 2.13 still): the
        # first backward hits an internal assert, and past it gradients stop being all-reduced.
        raise ProbeError("unsupported", "static_graph=true cannot be combined with no_sync_accumulation=true when "
                                        "accum_steps > 1 (DDP's static graph breaks under no_sync(), pytorch/pytorch"
                                        "#143580): set no_sync_accumulation=false or static_graph=false")
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=config.bucket_cap_mb,
        gradient_as_bucket_view=config.gradient_as_bucket_view, static_graph=config.static_graph)
    notes["parallel"] = f"ddp: {world} ranks ({backend})"
    notes["bucket_cap_mb"] = f"{config.bucket_cap_mb:g}"
    notes["gradient_as_bucket_view"] = shown_value(config.gradient_as_bucket_view)
    notes["static_graph"] = shown_value(config.static_graph)
    return ddp


def gradient_sync(parallel: nn.Module | None, sync: bool) -> contextlib.AbstractContextManager[Any]:
    """Context for one micro-batch's forward+backward: with ``sync=False`` its gradients are
    only accumulated locally (DDP ``no_sync()``; FSDP2 ``set_requires_gradient_sync(False)``,
    which reduce-scatters nothing until a synchronising backward). A no-op without a
    parallel wrapper."""
    if parallel is None:
        return contextlib.nullcontext()
    if hasattr(parallel, "no_sync"):
        return contextlib.nullcontext() if sync else parallel.no_sync()  # type: ignore[operator]
    parallel.set_requires_gradient_sync(sync)  # type: ignore[operator]
    return contextlib.nullcontext()


# -- 6. compile ---------------------------------------------------------------------------

def apply_compile(model: nn.Module, mode: str, notes: Notes, backend: str = "inductor") -> nn.Module:
    """torch.compile the model (its forward computes the losses, so the loss is compiled too).

    ``default`` is torch.compile's own default mode. `backend` exists for tests that only
    need to see the model go through dynamo; probes always use inductor.
    """
    if mode == "none":
        notes["compile"] = "none (eager)"
        return model
    compiled = torch.compile(model, mode=None if mode == "default" else mode, backend=backend)
    notes["compile"] = f"{mode} ({backend})"
    return compiled  # type: ignore[return-value]


# -- 7. optimizer -------------------------------------------------------------------------

def build_optimizer(model: nn.Module, config: TrainConfig, weight_decay: float, notes: Notes) -> torch.optim.AdamW:
    """AdamW over every trainable parameter (what a workload trains with by default), with one
    fused kernel (``fused_optimizer=true``) or multi-tensor foreach."""
    assert config.lr is not None, "resolve() the config first"
    opt = adamw(model, config.lr, weight_decay)
    apply_fused_optimizer(as_optimizers(opt), config, next(model.parameters()).device, notes)
    return opt


def build_optimizers(workload: Any, model: nn.Module, config: TrainConfig, notes: Notes) -> OptimizerLike:
    """The workload's own optimizer(s) over `model` (`Workload.build_optimizers`), checked (every
    trainable parameter in exactly one optimizer) and with ``fused_optimizer`` applied to them
    in place. Returns what the workload built (one optimizer, or its container)."""
    built = workload.build_optimizers(model, config)
    try:
        opts = as_optimizers(built, model, where=f"{type(workload).__name__}.build_optimizers")
    except (TypeError, ValueError) as e:
        raise ProbeError("error", str(e)) from e
    apply_fused_optimizer(opts, config, next(model.parameters()).device, notes)
    notes["optimizer"] = ", ".join(
        f"{type(o).__name__} ({sum(len(g['params']) for g in o.param_groups)} tensors in "
        f"{len(o.param_groups)} groups)" for o in opts)
    return built


# -- 8. data ------------------------------------------------------------------------------

class StreamSampler(Sampler[int]):
    """An endless stream of seeded permutations, cut into DataLoader epochs.

    The order of samples depends only on `seed`, never on the batch size or worker count,
    so every probe of a study trains on the same samples. Each ``iter()`` (one DataLoader
    epoch) continues the stream where the previous one stopped and yields a whole number of
    batches, so no sample is dropped or repeated at an epoch boundary.

    With several ranks (`world` > 1), the stream is cut into global micro-batches of
    ``batch_size × world`` samples and rank `rank` takes its slice of each: the ranks of one
    micro-batch together train exactly the samples a single process with micro-batch
    ``batch_size × world`` trains, in the same order.
    """

    def __init__(self, n: int, batch_size: int, seed: int, rank: int = 0, world: int = 1) -> None:
        self.n = n
        self.batch_size = batch_size
        self.rank = rank
        self.world = world
        self.epoch_len = -(-n // (batch_size * world)) * batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self._buffer: list[int] = []

    def _next(self) -> int:
        if not self._buffer:
            self._buffer = torch.randperm(self.n, generator=self.generator).tolist()[::-1]
        return self._buffer.pop()

    def __iter__(self) -> Iterator[int]:
        if self.world == 1:
            for _ in range(self.epoch_len):
                yield self._next()
            return
        lo, hi = self.rank * self.batch_size, (self.rank + 1) * self.batch_size
        for _ in range(self.epoch_len // self.batch_size):
            global_batch = [self._next() for _ in range(self.batch_size * self.world)]
            yield from global_batch[lo:hi]

    def __len__(self) -> int:
        return self.epoch_len


def build_loader(dataset: Dataset, config: TrainConfig, device: torch.device, seed: int, notes: Notes,
                 rank: int = 0, world: int = 1) -> DataLoader:
    """The training DataLoader for the data-pipeline knobs (rank `rank` of `world`: its slice
    of every global micro-batch, see `StreamSampler`)."""
    assert config.batch_size is not None
    return DataLoader(
        dataset,
        batch_size=config.batch_size,
        sampler=StreamSampler(len(dataset), config.batch_size, seed, rank, world),  # type: ignore[arg-type]
        **loader_options(config, device, notes),
    )


def loader_options(config: TrainConfig, device: torch.device, notes: Notes) -> dict[str, Any]:
    """The DataLoader keyword arguments of the data-pipeline knobs: num_workers, pin_memory
    (CUDA only), and with workers prefetch_factor and persistent_workers."""
    kwargs: dict[str, Any] = {"num_workers": config.num_workers}
    if config.num_workers > 0:
        kwargs["prefetch_factor"] = config.prefetch_factor  # None → torch's default (2)
        kwargs["persistent_workers"] = config.persistent_workers
    kwargs["pin_memory"] = pin = config.pin_memory and device.type == "cuda"
    notes["num_workers"] = str(config.num_workers)
    notes["pin_memory"] = str(pin).lower() + ("" if device.type == "cuda" or not config.pin_memory
                                              else " (inactive on cpu)")
    return kwargs


def batch_length(batch: Any) -> int:
    """Samples in a micro-batch: the first dimension of its first tensor (a dict, a tuple or
    list, or a tensor)."""
    if isinstance(batch, dict):
        return batch_length(next(iter(batch.values())))
    if isinstance(batch, (tuple, list)):
        return batch_length(batch[0])
    return len(batch)


class EpochIterator:
    """Pull micro-batches across DataLoader epochs, moving them to the device.

    Re-creating the iterator at each epoch boundary is what makes `persistent_workers`
    matter: without it the worker processes are started again every epoch. Each epoch start
    after the first is recorded in `boundaries` with the host seconds its fetch took
    (autotune/engine/epoch_cost.py amortizes them).

    The fetch that will begin an epoch is foreseen from the loader's length in micro-batches
    (`predicted` lists them), and on a CUDA device it is bracketed with CUDA events on the
    current stream: one before the fetch, one as the batch arrives, before its copies are
    issued. Nothing is enqueued between them, so their distance is how long the GPU idled for
    the stall: none of it while the work queued ahead still ran (the host runs ahead of a busy
    GPU). `resolved_boundaries` reads them once they have completed. A start not foreseen (a
    loader without a length, e.g. of an IterableDataset) has no events: its GPU gap is unknown.
    Ordinary fetches record nothing.
    """

    def __init__(self, loader: DataLoader, device: torch.device) -> None:
        self.loader = loader
        self.device = device
        self.non_blocking = bool(loader.pin_memory)  # only pinned memory copies asynchronously
        self._it: Iterator[Any] | None = None
        self.epochs = 0
        self.pulled = 0  # micro-batches handed out
        self.boundaries: list[Boundary] = []
        self.predicted: list[int] = []  # the micro-batches whose fetch was foreseen to begin an epoch
        try:
            self._epoch_length: int | None = len(loader)
        except TypeError:  # no length: the epoch starts come unforeseen
            self._epoch_length = None
        self._in_epoch = 0  # micro-batches pulled in the current epoch
        self._gpu_marks: list[tuple[torch.cuda.Event, torch.cuda.Event] | None] = []  # per boundary

    def next(self) -> dict[str, torch.Tensor]:
        t0 = time.perf_counter()
        foreseen = self._it is not None and self._in_epoch == self._epoch_length
        if foreseen:
            self.predicted.append(self.pulled)
        before = self._mark() if foreseen and self.device.type == "cuda" else None
        began = False
        while True:
            if self._it is None:
                self._it = iter(self.loader)
                self.epochs += 1
                self._in_epoch = 0
                began = self.epochs > 1  # the first start is setup, not a boundary a long run repeats
            try:
                batch = next(self._it)
                break
            except StopIteration:
                self._it = None  # shuts non-persistent workers down: part of the boundary's stall
        marks = None if before is None else (before, self._mark())  # before the copies: the GPU's idle ends here
        moved = {k: v.to(self.device, non_blocking=self.non_blocking) for k, v in batch.items()}
        if began:  # a foreseen fetch that began no epoch (a wrong length) drops its marks
            self.boundaries.append(Boundary(self.pulled, time.perf_counter() - t0))
            self._gpu_marks.append(marks)
        self._in_epoch += 1
        self.pulled += 1
        return moved

    def _mark(self) -> torch.cuda.Event:
        """A timing event recorded now on the device's current stream (no sync)."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def resolved_boundaries(self) -> list[Boundary]:
        """`boundaries` with `gpu_gap_s`, the seconds the GPU idled across each start it has
        events for. Read here rather than at the fetch, when the GPU may not have reached them
        yet; this waits until it has, so call it after the training's last sync."""
        resolved = []
        for boundary, marks in zip(self.boundaries, self._gpu_marks, strict=True):
            if marks is None:
                resolved.append(boundary)
                continue
            before, after = marks
            after.synchronize()  # sync: `before` precedes it on the stream, so both are done
            resolved.append(Boundary(boundary.micro_batch, boundary.stall_s, before.elapsed_time(after) / 1e3))
        return resolved

    def close(self) -> None:
        self._it = None  # shuts non-persistent workers down


# -- 9. the training step ----------------------------------------------------------------

def lr_factor(progress: float, warmup_fraction: float, final_fraction: float) -> float:
    """Learning-rate multiplier at `progress` (samples seen / samples budgeted, in [0, 1]):
    linear warm-up, then cosine decay to `final_fraction`. Defined over samples, not steps,
    so every effective batch size follows the same schedule."""
    progress = min(max(progress, 0.0), 1.0)
    if progress < warmup_fraction:
        return (progress + 1e-9) / warmup_fraction
    t = (progress - warmup_fraction) / max(1.0 - warmup_fraction, 1e-9)
    return final_fraction + (1.0 - final_fraction) * 0.5 * (1.0 + math.cos(math.pi * t))


@dataclass(frozen=True)
class Schedule:
    """The LR schedule of a probe: `total_samples` is the budget the progress is measured on.
    The factor of each group's base lr is `multiplier(progress)` where given (a workload's
    ``lr_multiplier``), else `lr_factor` with the warm-up and final fractions."""

    total_samples: int
    warmup_fraction: float = 0.05
    final_fraction: float = 0.1
    multiplier: Callable[[float], float] | None = None

    def factor(self, samples_seen: int) -> float:
        progress = min(max(samples_seen / self.total_samples, 0.0), 1.0)
        if self.multiplier is not None:
            return float(self.multiplier(progress))
        return lr_factor(progress, self.warmup_fraction, self.final_fraction)


class Trainer:
    """Forward/backward with autocast and GradScaler, gradient accumulation and
    inverse-loss frequency, gradient clipping, and the user's optimizer(s). ``step`` is one
    optimizer step over ``accum_steps`` micro-batches. With a `schedule`, the learning rate
    follows it over the samples seen so far by all ranks (without one it stays as the caller
    sets it: a loop that writes ``group["lr"]`` itself keeps doing so, also where the knobs
    turned the lr into a device tensor, see `_adopt_written_lrs`).

    `optimizer` is one optimizer or several (autotune.engine.optimizers.Optimizers, or a list): a
    hybrid such as Muon + AdamW steps as one. `clip_norm`: clip the gradients' global L2 norm
    to it before the update (after fp16's GradScaler has unscaled them), on the device.

    Several ranks: `parallel` is the DDP/FSDP2 module `apply_ddp` returned (the one whose
    ``no_sync`` matters, even when `model` is its compiled wrapper) and `world` the ranks;
    with ``no_sync_accumulation`` only the last micro-batch of a step synchronises gradients.
    """

    def __init__(self, model: nn.Module, optimizer: OptimizerLike, config: TrainConfig,
                 device: torch.device, notes: Notes, schedule: Schedule | None = None,
                 parallel: nn.Module | None = None, world: int = 1, clip_norm: float | None = None,
                 compile_backend: str = "inductor") -> None:
        self.model = model
        self.parallel = parallel
        self.world = world
        self.schedule = schedule
        self.optimizer = optimizer  # as given: one optimizer or the caller's container
        self.optimizers = as_optimizers(optimizer)
        self.base_lrs = [float(group["lr"]) for group in self.optimizers.param_groups]
        self.samples_seen = 0
        self.config = config
        self.device = device
        self.clip_norm = clip_norm
        self.params = all_params(self.optimizers)
        self.last_grad_norm: torch.Tensor | None = None  # the norm before clipping, of the last step (device)
        notes["grad_clip"] = (f"max norm {clip_norm:g} (global L2, on the device)" if clip_norm is not None
                              else "off")
        self.cudagraphs = config.compile == "reduce-overhead"
        # compile_optimizer: one compiled function steps every optimizer (autotune/engine/optimizers.py)
        self.compiled_step = compile_optimizer_step(self.optimizers, config, device, notes, compile_backend)
        # step_graph: the whole step replayed as one CUDA graph (autotune/engine/step_graph.py)
        self.graph: step_graph.StepGraph | None = None
        if config.step_graph:
            why = step_graph.blocker(config, device, world, self.optimizers, self.compiled_step is not None)
            if why is None:
                lr_to_tensor(self.optimizers, device, capturable=True)
                self.graph = step_graph.StepGraph(self._step_device, device)
                notes["step_graph"] = (f"on: each step variant runs {step_graph.EAGER_RUNS} times eagerly, then is "
                                       f"replayed as one CUDA graph (forward, backward, {self.optimizers.name})")
            else:
                notes["step_graph"] = why
        else:
            notes["step_graph"] = "off"
        # the groups' lr tensors (compile_optimizer, step_graph): written in place, never replaced
        self.lr_tensors: list[torch.Tensor | None] = [
            g["lr"] if isinstance(g["lr"], torch.Tensor) else None for g in self.optimizers.param_groups]
        # With CUDA graphs and accumulation, the first micro-batch's backward would hand its
        # graph-owned gradient buffers to .grad, and the next replay overwrites them. Keeping
        # .grad allocated (zeroed, never set to None) makes backward accumulate into our own
        # tensors instead. The step graph replays its backward into the same tensors too.
        self.keep_grads = (self.cudagraphs and (config.accum_steps or 1) > 1) or self.graph is not None
        if self.keep_grads:
            for p in self.params:
                p.grad = torch.zeros_like(p)
            if self.cudagraphs:
                notes["compile"] = (notes.get("compile", "reduce-overhead")
                                    + "; .grad kept allocated across micro-batches")
        self.step_index = 0
        self.inverse_steps = 0
        dtype = {"bf16": torch.bfloat16, "fp8": torch.bfloat16, "fp16": torch.float16}.get(config.precision)
        self.autocast_dtype = dtype
        self.scaler = torch.amp.GradScaler(device.type) if config.precision == "fp16" else None
        if dtype is not None and config.precision != "fp8":
            notes["precision"] = f"{config.precision}: autocast {dtype}" + (" + GradScaler" if self.scaler else "")
        notes["accum_steps"] = f"{config.accum_steps} (loss scaled by 1/{config.accum_steps})"
        notes["inverse_loss_frequency"] = f"inverse losses on 1 step in {config.inverse_loss_frequency}"

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def with_inverse(self) -> bool:
        return self.step_index % self.config.inverse_loss_frequency == 0

    # The loss of one micro-batch: ``loss_fn(model, batch, with_aux)`` when set (autotune.apply
    # sets the user's), else a workload model's ``model(batch, with_aux)["total"]``.
    loss_fn: Callable[[nn.Module, Any, bool], torch.Tensor] | None = None

    def loss(self, batch: Any, with_aux: bool) -> torch.Tensor:
        if self.loss_fn is not None:
            return self.loss_fn(self.model, batch, with_aux)
        return self.model(batch, with_aux)["total"]  # type: ignore[no-any-return]

    def accumulate(self, micro_batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """Forward + backward over the micro-batches; returns the step's mean loss (on device, detached)."""
        return self._forward_backward(micro_batches, self._count(micro_batches))

    def _count(self, micro_batches: list[Any]) -> bool:
        """The host's bookkeeping of a step's micro-batches: samples seen, inverse steps.
        Returns whether this step runs the inverse losses."""
        # every rank trains micro-batches of the same size: the global count is the local one × world
        self.samples_seen += sum(batch_length(b) for b in micro_batches) * self.world
        with_inverse = self.with_inverse()
        if with_inverse:
            self.inverse_steps += 1
        return with_inverse

    def _forward_backward(self, micro_batches: list[Any], with_inverse: bool) -> torch.Tensor:
        """The device work of `accumulate` (no host bookkeeping: a CUDA graph captures it)."""
        accum = len(micro_batches)
        total = torch.zeros((), device=self.device)
        skip_sync = self.parallel is not None and self.config.no_sync_accumulation
        for index, batch in enumerate(micro_batches):
            if self.cudagraphs:
                # CUDA graphs reuse their output buffers: mark each new iteration so the previous
                # replay's outputs are not overwritten while autograd still needs them.
                torch.compiler.cudagraph_mark_step_begin()
            with gradient_sync(self.parallel, sync=not skip_sync or index == accum - 1):
                with self.autocast():
                    loss = self.loss(batch, with_inverse)
                scaled = loss / accum  # equal weight per sample, whatever the split into micro-batches
                if self.scaler is not None:
                    self.scaler.scale(scaled).backward()
                else:
                    scaled.backward()
            total += scaled.detach().float()
        return total

    def _set_lr(self) -> None:
        self._adopt_written_lrs()
        if self.schedule is not None:
            factor = self.schedule.factor(self.samples_seen)
            for group, base in zip(self.optimizers.param_groups, self.base_lrs, strict=True):
                # a plain float: fused/foreach AdamW read it on the host each step (no recompile);
                # a device tensor (compile_optimizer, step_graph) is filled in place
                set_lr(group, base * factor)

    def _adopt_written_lrs(self) -> None:
        """A loop (or a torch LR scheduler of old) that writes a float into ``group["lr"]``
        where the knobs keep a device tensor: copy the float into the tensor the compiled or
        captured step reads, and put the tensor back, so the user's schedule keeps acting."""
        for group, tensor in zip(self.optimizers.param_groups, self.lr_tensors, strict=True):
            if tensor is not None and group["lr"] is not tensor:
                tensor.fill_(float(group["lr"]))
                group["lr"] = tensor

    def _update(self) -> None:
        """Gradient clipping, the optimizers' update and the zeroing of the gradients (device work)."""
        opts = self.optimizers
        if self.scaler is not None:
            if self.clip_norm is not None:
                for opt in opts:  # clip what the optimizer will see: the unscaled gradients
                    self.scaler.unscale_(opt)
                self.last_grad_norm = clip_gradients(self.params, self.clip_norm)
            for opt in opts:
                self.scaler.step(opt)
            self.scaler.update()
        else:
            if self.clip_norm is not None:
                self.last_grad_norm = clip_gradients(self.params, self.clip_norm)
            if self.compiled_step is not None:
                self.compiled_step()
            else:
                opts.step()
        opts.zero_grad(set_to_none=not self.keep_grads)

    def _step_device(self, micro_batches: list[Any], with_inverse: bool) -> torch.Tensor:
        """Everything one optimizer step does on the device: what `StepGraph` captures."""
        total = self._forward_backward(micro_batches, with_inverse)
        self._update()
        return total

    def optimizer_step(self) -> None:
        self._set_lr()
        self._update()
        self.step_index += 1

    def step(self, micro_batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        if self.graph is None:
            loss = self.accumulate(micro_batches)
            self.optimizer_step()
            return loss
        # step_graph: the host's bookkeeping here, the device's work eager or replayed
        with_inverse = self._count(micro_batches)
        self._set_lr()
        loss = self.graph.run(micro_batches, with_inverse)
        self.step_index += 1
        return loss
