"""Apply a tuned config to your own training loop: ``autotune.apply``.

`apply` puts a recommended config (``autotune best STUDY --format yaml > best.yaml``) on *your*
model, optimizer(s) and DataLoader through the knob functions the probe uses, in the same order
(autotune/engine/knobs.py), so your loop runs the step that was measured::

    import autotune

    prepared = autotune.apply("best.yaml", model, optimizer=optimizer, train_loader=loader,
                              device="cuda", grad_clip_norm=1.0,
                              loss_fn=lambda model, batch, with_aux: ...)
    for batch in prepared.train_loader:
        loss = prepared.step(batch)          # None until accum_steps micro-batches are in

Your objects are changed in place, never replaced (keep your references: your LR schedule keeps
acting on them), and the learning rate stays yours unless ``use_config_lr=True``.
`prepared.notes` says what every knob did; `apply` prints, once, each knob that could not act on
your objects (``quiet=True`` to skip). What each knob does to your objects: docs/workloads.md.
``print(prepared.loop_rate())`` at the end says how fast your own loop ran under the config, by
the wall clock, beside what the study's probe measured for it (from a best.yaml's header).

On a job of several ranks (torchrun, ``torch.distributed.init_process_group`` before `apply`)
the distributed knobs act too (`distribute`): a plain model is wrapped in DistributedDataParallel
with the config's ``bucket_cap_mb``, ``gradient_as_bucket_view`` and ``static_graph`` (sharded
with FSDP2 for ``parallel: fsdp2`` where `apply` builds the optimizer), a DDP of yours is kept and
adjusted where DDP allows, and `prepared.step` accumulates under ``no_sync()`` on all but the last
micro-batch (``no_sync_accumulation``). `prepared.model` is then the DDP over your module and
`prepared.parallel` the wrapper; the NCCL knobs are environment variables of your launch. One
process: every distributed knob is inactive. docs/apply-ddp.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import re
import sys
import time
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler

from autotune.contract.config import (
    DISTRIBUTED_KNOBS,
    KNOBS,
    NCCL_ENV_KNOBS,
    ConfigError,
    TrainConfig,
    load_config_arg,
    parse_config,
)
from autotune.contract.errors import ProbeError
from autotune.engine.hf_checkpointing import hf_models
from autotune.engine.knobs import (
    Notes,
    Schedule,
    Trainer,
    apply_backend_flags,
    apply_checkpointing,
    apply_ddp,
    apply_fp8,
    batch_length,
    build_optimizer,
    loader_options,
    record_inactive_distributed,
    shown_value,
    world_size,
)
from autotune.engine.lm_knobs import apply_lr_scaling, apply_model_kernels, compile_model, use_attention_backend
from autotune.engine.optimizers import OptimizerLike, Optimizers, apply_fused_optimizer, as_optimizers, set_lr

LossFn = Callable[[nn.Module, Any, bool], torch.Tensor]


class ApplyError(ConfigError):
    """A config that cannot be applied to these objects: `knob` names the knob, the message the fix."""


def load_config(source: str | Path | Mapping[str, Any] | TrainConfig) -> TrainConfig:
    """A validated TrainConfig from a YAML/JSON file (``autotune best --format yaml`` writes
    one; its comment header is ignored), inline JSON, a mapping, or a TrainConfig."""
    if isinstance(source, TrainConfig):
        return source
    if isinstance(source, Mapping):
        return parse_config(source)
    text = str(source)
    if not text.strip().startswith("{") and not Path(text).is_file():
        raise ConfigError("config", f"{text!r} is not a file: write one with "
                                    "`autotune best STUDY --format yaml > best.yaml`")
    return parse_config(load_config_arg(text))


_PROBE_THROUGHPUT = re.compile(r"^# throughput: ([0-9][0-9.]*) samples/s", re.MULTILINE)


def probe_throughput_of(source: str | Path | Mapping[str, Any] | TrainConfig) -> float | None:
    """The throughput the study measured for this config (samples/s, the geometric mean over its
    runs), from the ``# throughput:`` line of a best.yaml that ``autotune best --format yaml``
    wrote; None for a config given any other way."""
    if isinstance(source, (Mapping, TrainConfig)) or str(source).strip().startswith("{"):
        return None
    try:
        found = _PROBE_THROUGHPUT.search(Path(source).read_text())
    except (OSError, UnicodeDecodeError):
        return None
    return float(found.group(1)) if found else None


LOOP_RATE_WARMUP_STEPS = 10  # optimizer steps left out of `Prepared.loop_rate`: compile, graph capture


@dataclass(frozen=True)
class LoopRate:
    """Your loop's own speed under the config (`Prepared.loop_rate`), by the wall clock from the
    end of optimizer step `first_step` - 1 to the end of step `last_step`: everything your loop
    did between them (data, logging, evaluation) counts, as it does for your job."""

    first_step: int
    last_step: int
    samples: int  # of every rank
    seconds: float
    probe_samples_per_s: float | None  # what the study measured for this config (a best.yaml's)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else float("inf")

    @property
    def over_probe(self) -> float | None:
        """Your loop's rate over the probe's (1.0: the loop ran as fast as measured)."""
        return self.samples_per_s / self.probe_samples_per_s if self.probe_samples_per_s else None

    def __str__(self) -> str:
        text = (f"your loop: {self.samples_per_s:,.1f} samples/s over optimizer steps {self.first_step}-"
                f"{self.last_step} ({self.samples:,} samples in {self.seconds:.2f} s, wall clock)")
        if self.over_probe is not None:
            text += (f"; the study's probe measured {self.probe_samples_per_s:,.1f} for this config "
                     f"({self.over_probe:.2f}x)")
        return text


@contextlib.contextmanager
def _as_apply_error(knob: str) -> Iterator[None]:
    """The knob functions raise the probe's ProbeError (a failure kind); here it is the user's
    config that does not fit their objects: ApplyError naming `knob`."""
    try:
        yield
    except ProbeError as e:
        raise ApplyError(knob, e.message) from None


def _default_loss(model: nn.Module, batch: Any, with_aux: bool) -> torch.Tensor:
    """The workload protocol: ``model(batch, with_aux)["total"]``."""
    return model(batch, with_aux)["total"]  # type: ignore[no-any-return]


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """`batch` (tensors in dicts, tuples and lists) on `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device, non_blocking) for v in batch)
    return batch


def rebuild_loader(loader: DataLoader, config: TrainConfig, device: torch.device, notes: Notes) -> DataLoader:
    """`loader` again with the config's batch size and data-pipeline knobs (`loader_options`),
    keeping its dataset, sampler, collate_fn, drop_last, worker_init_fn and generator."""
    if loader.batch_size is None:
        raise ApplyError("batch_size", "the DataLoader has a custom batch_sampler; pass one built with "
                         "batch_size=... (and sampler=... for custom ordering) so autotune can rebuild it")
    assert config.batch_size is not None
    return DataLoader(loader.dataset, batch_size=config.batch_size, sampler=loader.sampler,
                      collate_fn=loader.collate_fn, drop_last=loader.drop_last,
                      worker_init_fn=loader.worker_init_fn, generator=loader.generator,
                      **loader_options(config, device, notes))


@dataclass
class Prepared:
    """Your objects with the config applied (see the module docstring)."""

    config: TrainConfig
    device: torch.device
    model: nn.Module  # what to call in the loop (compiled when asked)
    module: nn.Module  # the plain module (checkpointing/fp8 applied, not compiled): save its state_dict
    optimizer: OptimizerLike  # yours (or the AdamW built for you), changed in place
    trainer: Trainer
    train_loader: DataLoader | None = None
    parallel: nn.Module | None = None  # the DDP (or FSDP) module over the ranks; None in one process
    notes: Notes = field(default_factory=dict)
    check_batch_size: bool = False  # no loader was rebuilt: the first step checks the caller's micro-batches
    probe_samples_per_s: float | None = None  # the study's measurement of this config (a best.yaml's)
    _pending: list[Any] = field(default_factory=list)
    # the wall clock and sample count at the end of the warm-up's last step and of the latest step
    _rate_start: tuple[float, int] | None = None
    _rate_last: tuple[float, int, int] | None = None

    @property
    def optimizers(self) -> Optimizers:
        """Every optimizer `step` steps (one, or your hybrid's), as one."""
        return self.trainer.optimizers

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        return self.trainer.scaler

    @property
    def accum_steps(self) -> int:
        assert self.config.accum_steps is not None
        return self.config.accum_steps

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The config's autocast context (a no-op for fp32/tf32)."""
        return self.trainer.autocast()

    @property
    def with_aux(self) -> bool:
        """Whether the current optimizer step runs the expensive optional loss term."""
        return self.trainer.with_inverse()

    @property
    def optimizer_steps(self) -> int:
        return self.trainer.step_index

    def step(self, batch: Any) -> torch.Tensor | None:
        """Add one micro-batch (moved to the device); once accum_steps are in, run forward and
        backward on each (under autocast, GradScaler for fp16, loss / accum_steps) and one
        optimizer step. Returns that step's mean loss (detached), else None."""
        if self.check_batch_size:
            got = batch_length(batch)
            if got != self.config.batch_size:
                raise ApplyError("batch_size", f"the config's micro-batch is {self.config.batch_size} samples and "
                                               f"step got {got}: build micro-batches of prepared.config.batch_size "
                                               "samples, or pass train_loader=... for autotune to rebuild")
            self.check_batch_size = False
        self._pending.append(to_device(batch, self.device, non_blocking=self.device.type == "cuda"))
        if len(self._pending) < self.accum_steps:
            return None
        batches, self._pending = self._pending, []
        loss = self.trainer.step(batches)
        self._clock_step()
        return loss

    def _clock_step(self) -> None:
        """The host clock at the end of an optimizer step (no device sync: in a steady loop the
        host runs the same distance ahead of the device at both ends of the span)."""
        now, steps, samples = time.perf_counter(), self.trainer.step_index, self.trainer.samples_seen
        if steps == LOOP_RATE_WARMUP_STEPS:
            self._rate_start = (now, samples)
        elif steps > LOOP_RATE_WARMUP_STEPS and self._rate_start is not None:
            self._rate_last = (now, steps, samples)

    def loop_rate(self) -> LoopRate | None:
        """Your loop's samples per second under the config, by the wall clock over the optimizer
        steps `step` ran after the first LOOP_RATE_WARMUP_STEPS (10: compile and CUDA-graph
        capture happen there), with the study's own measurement of the config where the config
        came from a best.yaml: ``print(prepared.loop_rate())`` at the end of training. None until
        a step past the warm-up has run. Every rank's samples count (the probe's throughput is
        global too); time your loop spends outside `step` counts as well, as it does for your job."""
        if self._rate_start is None or self._rate_last is None:
            return None
        (t0, s0), (t1, steps, s1) = self._rate_start, self._rate_last
        return LoopRate(first_step=LOOP_RATE_WARMUP_STEPS + 1, last_step=steps, samples=s1 - s0, seconds=t1 - t0,
                        probe_samples_per_s=self.probe_samples_per_s)


def _check_loss_fn(model: nn.Module, loss_fn: LossFn | None) -> LossFn:
    """The loss function `step` calls; without one the model must follow the workload protocol
    (``forward(batch, with_aux)`` returning a dict with ``"total"``)."""
    if loss_fn is not None:
        return loss_fn
    try:
        params = [p for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    except (TypeError, ValueError):
        params = []
    if len(params) < 2 and not any(p.kind is p.VAR_POSITIONAL for p in params):
        raise ApplyError("loss_fn", f"{type(model).__name__}.forward does not take (batch, with_aux): pass "
                                    "loss_fn=lambda model, batch, with_aux: <your scalar loss>, e.g. "
                                    "loss_fn=lambda m, b, aux: torch.nn.functional.mse_loss(m(b[0]), b[1])")

    def protocol_loss(model: nn.Module, batch: Any, with_aux: bool) -> torch.Tensor:
        out = model(batch, with_aux)
        if not isinstance(out, Mapping) or "total" not in out:
            raise ApplyError("loss_fn", f"the model returned {type(out).__name__}, not a dict with 'total': pass "
                                        "loss_fn=lambda model, batch, with_aux: <your scalar loss>")
        return out["total"]  # type: ignore[no-any-return]

    return protocol_loss


def _print_inactive(notes: Notes, config: TrainConfig) -> None:
    """Each knob that could not act on the caller's objects, once, on stderr (the multi-process
    knobs only where the config sets them off their defaults: in one process they are all
    inactive, and a DDP job that keeps DDP's defaults loses nothing)."""
    lines = [f"  {knob}: {text}" for knob, text in notes.items()
             if ("inactive" in text or "not applied" in text)
             and (knob not in DISTRIBUTED_KNOBS or getattr(config, knob) != KNOBS[knob].default)]
    if lines:
        print("autotune.apply: knobs that could not act here (prepared.notes has every knob):", *lines,
              sep="\n", file=sys.stderr)


# -- data parallelism over the caller's process group (knob step 5) ----------------------------

MIB = 1024 * 1024


@dataclass
class Parallel:
    """The model as `apply` distributed it over the caller's process group."""

    model: nn.Module  # what to compile and call: the DDP or sharded module (the model as given in one process)
    module: nn.Module  # the plain module, inside any DDP wrapper: save its state_dict
    wrapper: nn.Module | None  # the DDP / FSDP module whose no_sync the Trainer uses; None: one process
    world: int


def _sharded_by_caller(model: nn.Module) -> str | None:
    """'FSDP2' / 'FSDP' where the caller sharded the model already, else None."""
    from torch.distributed import fsdp

    fsdp2_module = getattr(fsdp, "FSDPModule", None)  # torch >= 2.6 exports it here
    if fsdp2_module is not None and isinstance(model, fsdp2_module):
        return "FSDP2"
    return "FSDP" if isinstance(model, fsdp.FullyShardedDataParallel) else None


def _record_nccl_environment(config: TrainConfig, backend: str, notes: Notes) -> None:
    """The NCCL knobs are environment variables that NCCL reads when it makes the process
    group's communicators, which the caller's init_process_group (or its first collective)
    did before apply: apply can only say whether the launch set them."""
    for name, variable in NCCL_ENV_KNOBS.items():
        value = getattr(config, name)
        present = os.environ.get(variable)
        if "nccl" not in backend:
            notes[name] = f"{shown_value(value)} (inactive: the process group's backend is {backend}, not NCCL)"
        elif value is None:
            notes[name] = (f"{variable} unset in the config" + (f"; {present} from your environment" if present
                                                                else " (NCCL's default)"))
        elif present == str(value):
            notes[name] = f"{variable}={value} (set by your launch)"
        else:
            notes[name] = (f"{variable}={value} not applied: NCCL reads it when the process group is made, before "
                           f"apply; launch with it in the environment (`{variable}={value} torchrun ...`)"
                           + (f"; your environment has {present}" if present is not None else ""))


def _record_no_sync(config: TrainConfig, notes: Notes) -> None:
    accum = config.accum_steps or 1
    notes["no_sync_accumulation"] = (
        "true: all-reduce on the last micro-batch of each step only (no_sync() on the others)"
        if config.no_sync_accumulation else "false: all-reduce after every micro-batch"
    ) + ("" if accum > 1 else " (accum_steps 1: no effect)")


def _check_static_graph_with_no_sync(static_graph: bool, config: TrainConfig) -> None:
    """DDP's static graph breaks under no_sync() (pytorch/pytorch#143580): refused, as the probe's
    `apply_ddp` refuses it."""
    if static_graph and config.no_sync_accumulation and (config.accum_steps or 1) > 1:
        raise ApplyError("static_graph", "a static_graph DDP breaks under no_sync(), which no_sync_accumulation uses "
                                         "when accum_steps > 1 (pytorch/pytorch#143580): set no_sync_accumulation: "
                                         "false, or static_graph: false (on a DDP of yours: build it without "
                                         "static_graph, or pass ddp.module for apply to wrap)")


def _adjust_callers_ddp(ddp: DistributedDataParallel, config: TrainConfig, notes: Notes) -> None:
    """The config's DDP knobs on the caller's own DDP, kept (never re-wrapped: DDP exposes no way
    to copy what it was built with, comm hooks, mixed precision and delayed all-reduces
    included, and the replaced wrapper would keep its gradient buckets alive).
    ``bucket_cap_mb`` and ``gradient_as_bucket_view`` are constructor arguments: recorded as
    kept, or not applied with the fix. ``static_graph`` is set in place before the first
    forward (DDP's ``_set_static_graph``); after it, or to turn it off, it is not applied."""
    fix = "pass the plain module (your_ddp.module) for apply to wrap it with the config's DDP knobs"
    wanted_cap = int(config.bucket_cap_mb * MIB)
    if ddp.bucket_bytes_cap == wanted_cap:
        notes["bucket_cap_mb"] = f"{config.bucket_cap_mb:g} (your DDP's buckets already)"
    else:
        notes["bucket_cap_mb"] = (f"{config.bucket_cap_mb:g} not applied: your DDP was built with "
                                  f"{ddp.bucket_bytes_cap / MIB:g} MiB buckets, a constructor argument; {fix}")
    if ddp.gradient_as_bucket_view == config.gradient_as_bucket_view:
        notes["gradient_as_bucket_view"] = f"{shown_value(config.gradient_as_bucket_view)} (your DDP's already)"
    else:
        notes["gradient_as_bucket_view"] = (f"{shown_value(config.gradient_as_bucket_view)} not applied: your DDP was "
                                            f"built with {shown_value(ddp.gradient_as_bucket_view)}, a constructor "
                                            f"argument; {fix}")
    if ddp.static_graph == config.static_graph:
        notes["static_graph"] = f"{shown_value(config.static_graph)} (your DDP's already)"
    elif config.static_graph and not getattr(ddp, "_lazy_init_ran", True):
        _check_static_graph_with_no_sync(True, config)
        ddp._set_static_graph()
        notes["static_graph"] = "true: set on your DDP before its first forward"
    elif config.static_graph:
        notes["static_graph"] = f"true not applied: your DDP has run a forward already (set it before); {fix}"
    else:
        notes["static_graph"] = f"false not applied: DDP cannot turn a static graph off; {fix}"
    _check_static_graph_with_no_sync(ddp.static_graph, config)


def _record_ddp_built(ddp: DistributedDataParallel, config: TrainConfig, notes: Notes) -> None:
    """What each DDP knob did on the DDP apply built (read back from it)."""
    notes["bucket_cap_mb"] = f"{config.bucket_cap_mb:g}: DDP's gradient buckets of {ddp.bucket_bytes_cap / MIB:g} MiB"
    notes["gradient_as_bucket_view"] = (
        "true: each parameter's .grad is a view into DDP's bucket (no copy)" if ddp.gradient_as_bucket_view
        else "false: gradients are copied into DDP's buckets")
    notes["static_graph"] = ("true: DDP static_graph (the used parameters never change)" if ddp.static_graph
                             else "false")


def _note_unsharded_sampler(loader: DataLoader, notes: Notes) -> None:
    """With several ranks, a map-style dataset read through torch's default samplers is read
    whole by every rank: noted (apply keeps your sampler)."""
    sampler = loader.sampler
    if isinstance(sampler, (SequentialSampler, RandomSampler)) and not isinstance(loader.dataset, IterableDataset):
        notes["sampler"] = (f"{type(sampler).__name__} kept, so every rank reads every sample (rank sharding not "
                            "applied: give your DataLoader sampler=DistributedSampler(dataset) and call its "
                            "set_epoch each epoch)")


def distribute(model: nn.Module, config: TrainConfig, device: torch.device, notes: Notes,
               builds_optimizer: bool) -> Parallel:
    """Knob step 5: the config's data parallelism on the caller's model, over the default
    process group the caller made (torchrun + ``init_process_group``). One process (no
    group, or a group of one): the model as it is, every distributed knob inactive.
    Several ranks, by what the caller passed:

    * a plain model: the probe's `apply_ddp` wraps it: DDP with ``bucket_cap_mb``,
      ``gradient_as_bucket_view`` and ``static_graph``; ``parallel: fsdp2`` shards it with
      ``fully_shard`` where apply builds the optimizer (`builds_optimizer`), else DDP instead
      (your optimizer holds the unsharded parameters that fully_shard replaces: not applied);
    * a DistributedDataParallel: kept, the knobs adjusted in place where DDP allows
      (`_adjust_callers_ddp`);
    * a model the caller sharded (FSDP2 ``fully_shard``, FSDP): kept, the DDP knobs inactive.

    ``no_sync_accumulation`` acts in the Trainer (the wrapper's ``no_sync()`` on all but the
    last micro-batch); the NCCL knobs are only recorded (`_record_nccl_environment`)."""
    world = world_size()
    if world == 1:
        record_inactive_distributed(config, notes, "one process: no torch.distributed process group of several ranks")
        return Parallel(model, model, None, 1)
    backend = str(torch.distributed.get_backend())
    ranks = f"{world} ranks ({backend})"
    if isinstance(model, DistributedDataParallel):
        _adjust_callers_ddp(model, config, notes)
        notes["parallel"] = f"ddp: your DistributedDataParallel, {ranks}" + (
            "" if config.parallel == "ddp" else f" ({config.parallel} not applied: your model is a DDP already)")
        parallel = Parallel(model, model.module, model, world)
    elif (sharding := _sharded_by_caller(model)) is not None:
        why = f"inactive: your model is sharded with {sharding}, not DDP"
        for name in ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph"):
            notes[name] = f"{shown_value(getattr(config, name))} ({why})"
        notes["parallel"] = f"{sharding}: yours, kept, {ranks}" + (
            "" if config.parallel == "fsdp2" else f" ({config.parallel} not applied: your model is sharded already)")
        parallel = Parallel(model, model, model, world)
    else:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())  # DDP's device_ids: this rank's GPU
        fsdp2 = config.parallel == "fsdp2" and builds_optimizer
        chosen = config if fsdp2 or config.parallel != "fsdp2" else dataclasses.replace(config, parallel="ddp")
        with _as_apply_error("parallel" if fsdp2 else "static_graph"):
            wrapped = apply_ddp(model, chosen, notes, device)
        if chosen is not config:
            notes["parallel"] = ("fsdp2 not applied: fully_shard replaces the parameters your optimizer holds (pass "
                                 "optimizer=None for apply to build AdamW after sharding); " + notes["parallel"])
        parallel = Parallel(wrapped, model, wrapped, world)
        if isinstance(wrapped, DistributedDataParallel):
            _record_ddp_built(wrapped, config, notes)
    _record_no_sync(config, notes)
    _record_nccl_environment(config, backend, notes)
    return parallel


def apply(config: str | Path | Mapping[str, Any] | TrainConfig, model: nn.Module, *,
          optimizer: OptimizerLike | None = None, train_loader: DataLoader | None = None,
          loss_fn: LossFn | None = None, device: str | torch.device = "cpu", lr: float | None = None,
          use_config_lr: bool = False, weight_decay: float = 0.0, grad_clip_norm: float | None = None,
          total_samples: int | None = None, warmup_fraction: float = 0.05, final_lr_fraction: float = 0.1,
          lr_multiplier: Callable[[float], float] | None = None, scheduler: Any = None,
          reference_batch: int | None = None, quiet: bool = False) -> Prepared:
    """Apply `config` to your model, optimizer(s) and DataLoader, in the probe's knob order.

    `loss_fn(model, batch, with_aux) -> scalar loss`; default: ``model(batch, with_aux)["total"]``
    (the workload protocol; another model without `loss_fn` is refused). `optimizer`: yours, or
    a list of yours (a hybrid), kept and changed in place; None builds AdamW (lr `lr`,
    `weight_decay`). The learning rate stays your optimizer's unless `use_config_lr` (then the
    config's lr replaces every group's). batch_size / accum_steps that the config leaves
    unset keep your loader's batch size and 1. `grad_clip_norm`: clip the gradients' global L2
    norm before each optimizer step. `total_samples`: follow a schedule over that many samples
    (`lr_multiplier(progress)`, default warm-up then cosine to `final_lr_fraction`), as the
    probe did; None leaves the lr to you. Raises ConfigError / ApplyError naming the knob and
    the fix; prints once each knob that could not act (unless `quiet`).

    ``lr_scaling`` (linear / sqrt) multiplies your lr by the config's effective batch over
    `reference_batch`, the micro-batch × accumulation your lr was set for (default: your
    train_loader's batch size); pass your torch LR `scheduler` (one, or a list) made before apply,
    so its base lrs scale too (an optimizer whose groups hold a scheduler's ``initial_lr`` without
    it is refused: the scheduler's next step would undo the scaling).

    Several ranks (a default process group of world size > 1, made by you before `apply`):
    `model` plain is wrapped in DistributedDataParallel with the config's ``bucket_cap_mb``,
    ``gradient_as_bucket_view`` and ``static_graph`` (``parallel: fsdp2``: sharded with
    fully_shard where `optimizer` is None, else DDP instead, noted); `model` a DDP of yours is
    kept, ``static_graph`` set on it before its first forward, its constructor-only knobs noted
    as not applied with the fix (pass ``your_ddp.module``); `model` sharded by you (FSDP2 / FSDP)
    is kept. `step` then skips the gradient all-reduce on all but the last micro-batch with
    ``no_sync_accumulation``; the config's batch_size is each rank's micro-batch and
    `total_samples` counts the samples of all ranks. ``prepared.model`` is the DDP (compiled
    where asked), ``prepared.module`` your plain module (save its state_dict),
    ``prepared.parallel`` the wrapper. The NCCL knobs are environment variables NCCL reads
    before `apply` runs: only noted (set by your launch, or not applied). docs/apply-ddp.md.
    """
    cfg = load_config(config)
    config_lr = cfg.lr  # the probe preset's, in a best.yaml
    dev = torch.device(device)
    try:
        opts = as_optimizers(optimizer, model) if optimizer is not None else None
    except (TypeError, ValueError) as e:
        raise ApplyError("optimizer", str(e)) from None
    own_lr = float(opts.param_groups[0]["lr"]) if opts is not None else lr
    if use_config_lr and cfg.lr is None:
        raise ApplyError("lr", "use_config_lr=True but the config has no lr; drop use_config_lr or add lr")
    chosen_lr = cfg.lr if use_config_lr else own_lr
    if chosen_lr is None:
        raise ApplyError("lr", "there is no optimizer to take the learning rate from: pass optimizer=... or lr=...")
    batch = train_loader.batch_size if train_loader is not None and train_loader.batch_size else None
    cfg = dataclasses.replace(cfg, lr=None).resolve(batch or cfg.batch_size or 1, 1, float(chosen_lr))
    step_loss = _check_loss_fn(model, loss_fn)
    notes: Notes = {}
    apply_backend_flags(cfg, dev, notes)  # 1
    # 2: a Hugging Face model's own switch is set both ways (none turns off what the model had on)
    if cfg.checkpoint != "none" or hf_models(model):
        try:
            apply_checkpointing(model, cfg.checkpoint, notes)
        except ProbeError as e:
            message = e.message.removeprefix("checkpoint: ")
            if "no checkpointable blocks" in message:
                message += (". A block obeys the knob when it has a `checkpoint` attribute that its forward reads "
                            "(autotune/workloads/ups/model.py Block, docs/tutorial.md); a Hugging Face model "
                            "through its gradient_checkpointing_enable (docs/huggingface.md)")
            raise ApplyError("checkpoint", message) from None
    else:
        notes["checkpoint"] = "none"
    apply_model_kernels(model, cfg, dev, notes)  # 2b: hf_attn_implementation, liger_kernels
    model.to(dev)  # 3
    with _as_apply_error("precision"):  # 4
        if isinstance(model, DistributedDataParallel):
            apply_fp8(model.module, cfg, dev, notes)  # the Linear layers inside your DDP, swapped in place
        else:
            model = apply_fp8(model, cfg, dev, notes)
    parallel = distribute(model, cfg, dev, notes, builds_optimizer=opts is None)  # 5
    plain = parallel.module
    compiled = compile_model(parallel.model, cfg, dev, notes)  # 6, with inductor_tuning
    with _as_apply_error("fused_optimizer"):  # 7
        held: OptimizerLike
        if opts is None:
            held = build_optimizer(plain, cfg, weight_decay, notes)
            opts = as_optimizers(held)
        else:
            assert optimizer is not None
            held = optimizer
            apply_fused_optimizer(opts, cfg, dev, notes)
    if use_config_lr:
        for group in opts.param_groups:
            set_lr(group, float(chosen_lr))
        notes["lr"] = f"{chosen_lr:g} from the config (use_config_lr=True), in every parameter group"
    elif config_lr is not None and config_lr != chosen_lr:
        notes["lr"] = (f"{config_lr:g} in the config not applied: your optimizer's lr ({chosen_lr:g}) kept "
                       "(use_config_lr=True applies the config's)")
    else:
        notes["lr"] = f"{chosen_lr:g} (yours)"
    schedulers = [] if scheduler is None else list(scheduler) if isinstance(scheduler, (list, tuple)) else [scheduler]
    reference = reference_batch or batch  # the effective batch your lr was set for
    if (cfg.lr_scaling != "none" and reference is not None and not schedulers
            and any("initial_lr" in g for g in opts.param_groups)):
        raise ApplyError("lr_scaling", "your optimizer has a torch LR scheduler (its parameter groups hold "
                                       "initial_lr), whose base lrs would undo the scaled lr at its next step: pass "
                                       "scheduler=your_scheduler (or a list of them) to apply")
    factor = apply_lr_scaling(opts, cfg, reference, notes, schedulers, world=parallel.world)  # 7b
    if factor != 1.0:
        notes["lr"] += f"; × {factor:.4g} by lr_scaling: {float(opts.param_groups[0]['lr']):g} runs"
    loader = None
    if train_loader is not None:  # 8
        loader = rebuild_loader(train_loader, cfg, dev, notes)
        if parallel.world > 1:
            _note_unsharded_sampler(loader, notes)
    else:
        for knob in ("num_workers", "prefetch_factor", "pin_memory", "persistent_workers"):
            if getattr(cfg, knob) != KNOBS[knob].default:
                notes[knob] = f"{getattr(cfg, knob)} not applied: no train_loader to rebuild"
        notes["batch_size"] = (f"{cfg.batch_size}: no train_loader, so build micro-batches of {cfg.batch_size} "
                               "yourself (the first step checks)")
    schedule = (Schedule(total_samples, warmup_fraction, final_lr_fraction, multiplier=lr_multiplier)
                if total_samples else None)
    with _as_apply_error("optimizer"):  # 9
        trainer = Trainer(compiled, opts, cfg, dev, notes, schedule=schedule, parallel=parallel.wrapper,
                          world=parallel.world, clip_norm=grad_clip_norm)
    trainer.loss_fn = step_loss
    use_attention_backend(trainer, plain, cfg, dev, notes,  # 9b
                          lambda message: ApplyError("attention_backend", message.removeprefix("attention_backend=")))
    prepared = Prepared(config=cfg, device=dev, model=compiled, module=plain, optimizer=held, trainer=trainer,
                        train_loader=loader, parallel=parallel.wrapper, notes=notes,
                        check_batch_size=train_loader is None, probe_samples_per_s=probe_throughput_of(config))
    if not quiet:
        _print_inactive(notes, cfg)
    return prepared


class _CallableModule(types.ModuleType):
    """`autotune.apply(...)` calls `apply` (this module is also importable as autotune.apply)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Prepared:
        return apply(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["ApplyError", "LoopRate", "LossFn", "Prepared", "apply", "load_config", "probe_throughput_of",
           "rebuild_loader", "to_device"]
