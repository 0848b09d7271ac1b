"""The probe: train one configuration for a fixed sample budget and measure it honestly.

Phases of `run_probe`:

setup     build the workload, data and model; apply the knobs (autotune/engine/knobs.py)
warm-up   the first optimizer steps (compilation, CUDA-graph capture, autotuning, allocator
          growth, DataLoader start): timed apart as ``warmup_s``, never part of the throughput
timed     the remaining steps in equal windows (>= 5; autotune/engine/timing.py): throughput is
          the timed samples over the timed seconds, epoch starts counted at a long run's rate
          (autotune/engine/result.py); each window also records what the host's loop thread and
          the GPU did, and the GPUs' energy (host_telemetry.py, gpu_telemetry.py)
validate  quality on the fixed held-out set, in fp32, on a fresh eager copy of the trained model

Every probe of a study trains the same samples in the same order (seeded), so quality compares
at equal cost. With several ranks (autotune/engine/distributed.py) the windows are aligned and a
window's time is the slowest rank's. Any failure ends as a ProbeResult with ``failure = {kind,
message}``: never an unrecorded crash.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import platform
import re
import resource
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from autotune.contract.config import ConfigError, TrainConfig, parse_config
from autotune.contract.gate import window_rate
from autotune.contract.protocol import ProbeSpec
from autotune.contract.registry import Workload, get_workload
from autotune.contract.steps import plan_steps
from autotune.engine import step_graph
from autotune.engine.compile_workers import note as compile_workers_note
from autotune.engine.compile_workers import process_stat, quiesce_compile_workers, start_compile_pool
from autotune.engine.gpu_telemetry import (
    ENERGY_METHODS,
    EnergyMeter,
    GpuTelemetry,
    host_bound_note,
    summarize_energy,
    throttle_note,
    window_stats,
)
from autotune.engine.host_telemetry import ThreadUsage, cpu_model
from autotune.engine.host_telemetry import window_stats as host_window_stats
from autotune.engine.knobs import (
    EpochIterator,
    Notes,
    ProbeError,
    Schedule,
    Trainer,
    apply_backend_flags,
    apply_checkpointing,
    apply_ddp,
    apply_fp8,
    build_loader,
    build_optimizers,
    world_size,
)
from autotune.engine.lm_knobs import apply_lr_scaling, apply_model_kernels, compile_model, use_attention_backend
from autotune.engine.optimizers import as_optimizers
from autotune.engine.provenance import cuda_version, driver_version, model_fingerprint
from autotune.engine.result import ProbeResult, amortize_epoch_starts
from autotune.engine.sampled_data import (
    SampledBatches,
    describe,
    has_own_data_path,
    note_inactive_loader_knobs,
    sampling_generator,
)
from autotune.engine.timing import TRACE_DATA, TRACE_STEP, Clock, RankSync, start_trace, stop_trace

log = logging.getLogger(__name__)


# on_report(step, metrics) -> True to stop the probe now (the caller decided to prune it)
ReportCallback = Callable[[int, dict[str, float]], bool]
# on_progress(phase, info): where the probe is, for a person watching: phase "setup", "warm-up",
# "timed windows", "window" (after each), "untimed tail", "validation"; info: samples done and in
# all ("samples", "total_samples"), and where known "window"/"windows", "eta_s" (the training
# left at the timed windows' rate; validation not counted). Rank 0 only; never raises into the probe.
ProgressCallback = Callable[[str, dict[str, Any]], None]


_SPEC = ProbeSpec()  # a study's probe defaults: ProbeSettings takes them, written once (contract.protocol)


@dataclass
class ProbeSettings:
    """How to measure (the same for every trial of a study): a study's ProbeSpec (its defaults
    are these), plus what only a local probe sets (trace, compile backend, ...)."""

    samples: int | None = None  # training samples; None → the preset's default
    seed: int = _SPEC.seed
    warmup_steps: int = _SPEC.warmup_steps  # at least; also >= 2 × inverse_loss_frequency (step_graph: 4 ×)
    windows: int = _SPEC.windows  # timed windows (>= 5)
    timeout_s: float | None = None  # soft limit checked between steps (a study's: its ProbeSpec.timeout_s)
    compile_backend: str = "inductor"
    trace_path: str | None = None  # a Chrome trace (torch.profiler) of the warm-up's last steps
    trace_steps: int = 5  # at most; never more than half the warm-up (its first steps compile)
    # start TorchInductor's compile pool early and stop its idle workers before timing
    # (autotune.engine.compile_workers); False leaves the pool to TorchInductor: started at the first
    # compile, beside the timed windows as a process's first minute has it
    quiesce_compile_workers: bool = True

    @classmethod
    def from_spec(cls, spec: ProbeSpec) -> ProbeSettings:
        """A study's probe: its ProbeSpec as the child receives it."""
        return cls(samples=spec.samples, seed=spec.seed, warmup_steps=spec.warmup_steps, windows=spec.windows,
                   timeout_s=spec.timeout_s)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def seconds_since_process_start() -> float | None:
    """Wall seconds since this process started (Linux /proc), for the fixed-overhead figure."""
    # /proc by hand, as in autotune.engine.compile_workers: no psutil (not a dependency) for two fields
    try:
        fields = process_stat("self")
        with open("/proc/uptime") as up:
            uptime = float(up.read().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK") if fields else None
    except (OSError, ValueError, IndexError):
        return None


def classify_exception(exc: BaseException) -> tuple[str, str]:
    """Map an exception to (failure kind, message)."""
    if isinstance(exc, ProbeError):
        return exc.kind, exc.message
    text = f"{type(exc).__name__}: {exc}".strip()
    short = text.splitlines()[0][:2000] if text else type(exc).__name__
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return "oom", short
    lowered = text.lower()
    if "out of memory" in lowered or "can't allocate memory" in lowered or "cannot allocate memory" in lowered:
        return "oom", short
    return "error", short


ENERGY_NOTE_S = 1.0  # timed windows shorter than this in all: the energy figure is a few counter steps


def full_state_dict(model: torch.nn.Module, config: TrainConfig) -> dict[str, Any]:
    """The model's full (unsharded) state dict on every rank: a collective under FSDP2 (every
    rank must call it); DDP replicas hold the full weights already."""
    if config.parallel != "fsdp2":
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def _peak_memory(device: torch.device) -> tuple[int | None, int | None]:
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device), torch.cuda.max_memory_allocated(device)
    # CPU: the process's peak resident set (Linux reports KiB); there is no allocator split
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, None


def run_probe(
    workload: str | Workload,
    config: TrainConfig | Mapping[str, Any] | None = None,
    *,
    preset: str = "tiny",
    device: str | torch.device = "cpu",
    settings: ProbeSettings | None = None,
    on_report: ReportCallback | None = None,
    on_progress: ProgressCallback | None = None,
) -> ProbeResult:
    """Train `config` on `workload` for the sample budget and measure it.

    Bad knob values raise ConfigError before anything runs (a caller error); everything
    that goes wrong while running becomes ``result.failure``.
    """
    settings = settings or ProbeSettings()
    t_begin = time.perf_counter()
    process_start_s = seconds_since_process_start()
    wl = get_workload(workload, preset) if isinstance(workload, str) else workload
    cfg = config if isinstance(config, TrainConfig) else parse_config(config)
    d = wl.defaults
    cfg = cfg.resolve(d.batch_size, d.accum_steps, d.lr)
    try:
        dev = torch.device(device)
    except RuntimeError:  # torch's message lists every backend it was built with
        raise ConfigError("device", f"{device!r} is not a device; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device", f"{device} requested but CUDA is not available; use --device cpu")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    samples = settings.samples or d.samples
    world = world_size()
    global_batch = cfg.effective_batch * world  # every rank trains batch_size × accum_steps per step
    # step_graph: each step kind runs eagerly, then is captured and replayed, all in the warm-up
    periods = step_graph.EAGER_RUNS + 2 if cfg.step_graph and step_graph.setting_blocker(cfg, dev, world) is None else 2
    total, warm, n_windows, per = plan_steps(samples, global_batch, settings.warmup_steps, settings.windows,
                                             cfg.inverse_loss_frequency, periods)
    result = ProbeResult(
        workload=wl.name, preset=wl.preset, config={**cfg.to_dict(), "effective_batch": global_batch},
        device=device_name(dev), torch_version=torch.__version__, cuda_version=cuda_version(),
        driver_version=driver_version(dev), gpu_count=world if dev.type == "cuda" else 0,
        quality_metric=wl.quality_metric,
        quality_direction=getattr(wl, "quality_direction", "minimize"),
        process_start_s=process_start_s, warmup_steps=warm, window_steps=per, world_size=world,
        host_cpu=cpu_model(),
    )
    notes: Notes = {}
    try:
        _run(wl, cfg, dev, settings, result, notes, on_report, t_begin, total, warm, n_windows, per, on_progress)
    except Exception as exc:  # every failure becomes a record
        kind, message = classify_exception(exc)
        log.debug("probe failed: %s", traceback.format_exc())
        result.failure = {"kind": kind, "message": message}
    finally:
        result.knobs = notes
        result.samples_trained = result.steps * global_batch
        if result.peak_mem_reserved_bytes is None:  # else reduced over the ranks already (end of _run)
            result.peak_mem_reserved_bytes, result.peak_mem_allocated_bytes = _peak_memory(dev)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return result


@dataclass
class Training:
    """What a probe trains, built by `build_training`."""

    plain_model: torch.nn.Module  # the unwrapped module: its state_dict has clean keys
    loader: Any  # the DataLoader (None: the workload samples its own batches)
    data: EpochIterator | SampledBatches
    trainer: Trainer
    sync: RankSync
    val_set: Any
    eff: int  # global samples per optimizer step
    rank: int
    world: int


def build_training(wl: Workload, cfg: TrainConfig, dev: torch.device, settings: ProbeSettings, notes: Notes,
                   total: int, phase: Callable[[str], None] = lambda name: None) -> Training:
    """Apply the knobs in the documented order (autotune/engine/knobs.py) and build the model, data and
    trainer of `total` optimizer steps (the LR schedule's length); `phase(name)` is called as
    each part is built (the probe's setup breakdown)."""
    apply_backend_flags(cfg, dev, notes)
    train_set, val_set = wl.datasets(settings.seed)
    phase("data")
    torch.manual_seed(settings.seed)  # same initial weights for every probe of a study (per device type)
    with dev:  # initialise directly on the device: faster than building on the host and copying
        model = wl.build_model()
    apply_checkpointing(model, cfg.checkpoint, notes) if cfg.checkpoint != "none" else notes.setdefault(
        "checkpoint", "none")
    apply_model_kernels(model, cfg, dev, notes)  # 2b: hf_attn_implementation, liger_kernels (lm_knobs.py)
    model.to(dev)
    model.train()
    model = apply_fp8(model, cfg, dev, notes)
    phase("model")
    plain_model = model  # the unwrapped module: its state_dict has clean keys
    world = world_size()
    rank = torch.distributed.get_rank() if world > 1 else 0
    parallel = apply_ddp(model, cfg, notes, dev)  # before compile: dynamo then sees DDP's buckets
    phase("parallel")  # DDP/FSDP2 wrapping: the initial broadcast of the weights, the reducer
    model = compile_model(parallel, cfg, dev, notes, backend=settings.compile_backend)  # with inductor_tuning
    phase("compile_wrap")  # torch.compile is lazy: this is import and wrapper cost, not compilation
    optimizer = build_optimizers(wl, plain_model, cfg, notes)  # the workload's own step: its optimizer(s)
    d = wl.defaults
    # lr_scaling: the preset's lr goes with the preset's batch per rank (the world size is the same for both)
    lr_factor = apply_lr_scaling(as_optimizers(optimizer), cfg, d.batch_size * d.accum_steps, notes, world=world)
    loader: Any = None
    data: EpochIterator | SampledBatches
    if has_own_data_path(wl):  # the job's own data path (Workload.sample_batch), not a DataLoader
        assert cfg.batch_size is not None
        data = SampledBatches(wl, cfg.batch_size, sampling_generator(settings.seed, rank), dev)
        note_inactive_loader_knobs(cfg, notes, wl)
        notes["data"] = describe(wl)
    else:
        loader = build_loader(train_set, cfg, dev, settings.seed, notes, rank, world)
        data = EpochIterator(loader, dev)
    eff = cfg.effective_batch * world  # global samples per optimizer step
    own_schedule = type(wl).lr_multiplier is not Workload.lr_multiplier
    schedule = Schedule(total * eff, d.warmup_fraction, d.final_lr_fraction,
                        multiplier=wl.lr_multiplier if own_schedule else None)
    trainer = Trainer(model, optimizer, cfg, dev, notes, schedule=schedule,
                      parallel=parallel if world > 1 else None, world=world, clip_norm=wl.grad_clip_norm,
                      compile_backend=settings.compile_backend)
    use_attention_backend(trainer, plain_model, cfg, dev, notes, lambda message: ProbeError("unsupported", message))
    assert cfg.lr is not None
    ran = f"{cfg.lr * lr_factor:g} ({cfg.lr:g} × {lr_factor:.4g}, lr_scaling {cfg.lr_scaling})" if lr_factor != 1 \
        else f"{cfg.lr:g}"
    notes["lr"] = f"{ran}, " + (f"the workload's schedule ({type(wl).__name__}.lr_multiplier) over the probe's "
                                "samples" if own_schedule else
                                f"warm-up {d.warmup_fraction:.0%} of samples, cosine to {d.final_lr_fraction:g}×")
    phase("optimizer_data_loader")
    return Training(plain_model, loader, data, trainer, RankSync(dev, world), val_set, eff, rank, world)


def _run(wl: Workload, cfg: TrainConfig, dev: torch.device, settings: ProbeSettings, result: ProbeResult,
         notes: Notes, on_report: ReportCallback | None, t_begin: float, total: int, warm: int, n_windows: int,
         per: int, on_progress: ProgressCallback | None = None) -> None:
    deadline = None if settings.timeout_s is None else t_begin + settings.timeout_s

    def progress(name: str, **info: Any) -> None:
        if on_progress is not None and (world_size() == 1 or torch.distributed.get_rank() == 0):
            try:
                on_progress(name, info)
            except Exception:  # a display must never fail a measurement
                log.debug("progress callback failed", exc_info=True)

    progress("setup")

    def check_deadline(phase: str) -> None:
        if deadline is not None and time.perf_counter() > deadline:
            raise ProbeError("timeout", f"probe exceeded its {settings.timeout_s:g} s budget during {phase}")

    phases = result.setup_phases
    mark = time.perf_counter()

    def phase(name: str) -> None:
        """Record the host seconds since the previous mark under `name` (setup breakdown)."""
        nonlocal mark
        now = time.perf_counter()
        phases[name] = round(now - mark, 4)
        mark = now

    phases["before_probe"] = round(mark - t_begin, 4)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        torch.empty(1, device=dev)  # create the CUDA context here, so its cost has a name
    phase("device_init")
    # TorchInductor's compile pool: started now rather than at the first compile, so that its
    # sidecar's start-up (importing torch) overlaps the setup and warm-up, not the timed windows
    early_pool = None
    if settings.quiesce_compile_workers and cfg.compile != "none" and dev.type == "cuda":
        early_pool = start_compile_pool()
        phase("compile_pool")
    if cfg.precision == "fp8":  # fail fast, before data and model are built
        from autotune.engine.knobs import fp8_supported

        reason = fp8_supported(dev)
        if reason:
            raise ProbeError("unsupported", reason)

    # --- setup: the knobs, in the documented order (autotune/engine/knobs.py) ---
    t = build_training(wl, cfg, dev, settings, notes, total, phase)
    plain_model, loader, data, trainer, sync, val_set = t.plain_model, t.loader, t.data, t.trainer, t.sync, t.val_set
    eff, rank, world = t.eff, t.rank, t.world
    result.model_fingerprint = model_fingerprint(plain_model)  # names and shapes: setup, not timed
    result.setup_s = time.perf_counter() - t_begin
    check_deadline("setup")

    accum = cfg.accum_steps
    assert accum is not None
    clock = Clock(dev)
    data_wait = 0.0

    def next_micro_batches() -> list[dict[str, torch.Tensor]]:
        nonlocal data_wait
        t0 = time.perf_counter()  # host time blocked on the DataLoader (+ H2D copy issue)
        batches = [data.next() for _ in range(accum)]
        data_wait += time.perf_counter() - t0
        return batches

    # the lr that ran (lr_scaling: "0.002 (0.001 × 2, lr_scaling linear)"), as the notes say it
    lr_ran = re.match(r"[^,(]+(\([^)]*\))?", str(notes.get("lr", cfg.lr))).group(0).strip()  # type: ignore[union-attr]

    def check_finite(losses: torch.Tensor, step: int) -> None:
        if not bool(torch.isfinite(losses).all()):
            raise ProbeError("nan", f"non-finite loss at step {step} (samples {step * eff}); "
                                    f"precision={cfg.precision}, lr={lr_ran}")

    meter: EnergyMeter | None = None
    try:
        # --- warm-up: compile, CUDA-graph capture, autotuning; timed apart ---
        progress("warm-up", steps=warm, samples=0, total_samples=total * eff)
        t0 = time.perf_counter()
        warm_losses = []
        traced = min(settings.trace_steps, warm // 2) if settings.trace_path and rank == 0 else 0
        profiler = None
        for i in range(warm):
            if traced and i == warm - traced:
                profiler = start_trace(dev)
            if profiler is None:
                warm_losses.append(trainer.step(next_micro_batches()))
            else:  # named ranges, so a reader of the trace finds each step and its data wait
                with torch.profiler.record_function(TRACE_DATA):
                    batches = next_micro_batches()
                with torch.profiler.record_function(TRACE_STEP):
                    warm_losses.append(trainer.step(batches))
            result.steps = trainer.step_index
            check_deadline("warm-up")
        if profiler is not None and settings.trace_path:
            stop_trace(profiler, dev, settings.trace_path)
            result.traced_steps = traced
        stacked = torch.stack(warm_losses)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)  # sync: warm-up ends when its kernels have finished
        result.warmup_s = time.perf_counter() - t0
        check_finite(stacked, warm)
        result.loss_curve.append((warm * eff, sync.mean(float(stacked[-1]))))
        if settings.quiesce_compile_workers:
            result.compile_workers = quiesce_compile_workers(wait_ready=early_pool is not None)
            left = compile_workers_note(result.compile_workers)
            if left:
                result.measurement_notes.append(left)
            check_deadline("stopping the compile workers")

        # --- timed windows ---
        # Move every object alive now (torch's modules, the dataset, the model) out of the
        # collector's reach: a full collection over them takes long enough to distort a window.
        gc.collect()
        gc.freeze()
        data_wait = 0.0
        host_window_time = 0.0
        spans: list[tuple[int, int]] = []  # each window's micro-batches, [first, end)
        seconds: list[float] = []
        step = warm
        telemetry = GpuTelemetry.open(dev)
        meter = EnergyMeter.open(telemetry)
        window_joules: list[list[float | None]] = []  # per window: each rank's GPU
        progress("timed windows", windows=n_windows, samples=warm * eff, total_samples=total * eff,
                 warmup_s=round(result.warmup_s, 3))
        for w in range(n_windows):
            sync.barrier()  # several ranks: a window starts when every rank is ready
            h0 = time.perf_counter()
            wait0 = data_wait
            gpu0 = telemetry.read() if telemetry else None  # host-side NVML queries: outside the timed events
            host0 = ThreadUsage.read()
            if meter:
                meter.start()  # host-side, just before the window's first launch (the GPU is idle)
            started = clock.start()
            first = data.pulled
            losses = []
            for _ in range(per):
                losses.append(trainer.step(next_micro_batches()))
                result.steps = trainer.step_index
                check_deadline(f"window {w + 1}/{n_windows}")  # host clock only: no sync
            mine = clock.stop(started)  # waits for the window's kernels
            joules = meter.stop() if meter else None  # right after them, before the ranks meet
            elapsed = sync.max(mine)  # several ranks: the slowest rank's window time
            window_joules.append(sync.gather(joules))
            spans.append((first, data.pulled))
            seconds.append(elapsed)
            host1 = ThreadUsage.read()
            if host0 and host1:
                result.window_host.append(host_window_stats(host0, host1))
            if telemetry and gpu0:
                result.window_gpu.append(window_stats(gpu0, telemetry.read()))
            host_window_time += time.perf_counter() - h0
            result.window_data_wait_s.append(data_wait - wait0)
            step += per
            result.steps = step
            window_losses = torch.stack(losses).cpu()  # already synchronized by clock.stop on GPU
            check_finite(window_losses, step)
            throughput = per * eff / elapsed
            result.window_throughputs.append(throughput)
            mean_loss = sync.mean(float(window_losses.mean()))  # over the ranks
            result.loss_curve.append((step * eff, mean_loss))
            check_deadline(f"window {w + 1}/{n_windows}")
            metrics = {"samples": step * eff, "loss": mean_loss, "throughput": throughput, "window": w}
            if all(j is not None for joules in window_joules for j in joules):  # the windows' so far: a window's
                # own is coarse (the counter's step, 0.1 s on the H100, against windows of a few tenths)
                metrics["energy_j_per_sample"] = (sum(j or 0.0 for joules in window_joules for j in joules)
                                                  / (len(window_joules) * per * eff))
            progress("window", window=w + 1, windows=n_windows, samples=step * eff, total_samples=total * eff,
                     eta_s=round((total - step) * sum(seconds) / max(1, step - warm), 1))
            stop = on_report is not None and on_report(step, metrics)
            if sync.from_rank0(stop):  # rank 0 alone reports: its decision stops every rank at once
                result.stopped_early = True
                break

        result.data_wait_fraction = data_wait / host_window_time if host_window_time > 0 else None
        methods = sync.gather(float(ENERGY_METHODS.index(meter.method)) if meter else None)
        energy = summarize_energy(window_joules, [per * eff] * len(window_joules),
                                  [ENERGY_METHODS[int(m)] if m is not None else None for m in methods])
        if energy is not None:
            result.energy_j_per_sample, result.energy_method = energy.j_per_sample, energy.method
            result.window_energy_j_per_sample = energy.window_j_per_sample
            result.gpu_energy_j_per_sample = energy.gpu_j_per_sample
            if sum(seconds) < ENERGY_NOTE_S:
                result.measurement_notes.append(
                    f"energy per sample: the timed windows lasted {sum(seconds):.2f} s in all, a few steps of NVML's "
                    "energy reading (0.1 s on the H100), so the figure is coarse; more samples per probe make it "
                    "finer")
        if not result.stopped_early:
            # --- leftover steps: trained (equal sample budget) but not timed ---
            if total > step:
                progress("untimed tail", samples=step * eff, total_samples=total * eff,
                         eta_s=round((total - step) * sum(seconds) / max(1, step - warm), 1))
            tail = []
            for _ in range(total - step):
                tail.append(trainer.step(next_micro_batches()))
                result.steps = trainer.step_index
                check_deadline("the untimed tail")
            if tail:
                check_finite(torch.stack(tail), total)
            step = total
        if loader is not None:  # a DataLoader's epoch starts, counted at a long run's rate
            result.epoch_micro_batches = len(loader)  # the untimed tail's epoch starts count in the cost too
            amortize_epoch_starts(result, data.resolved_boundaries(), spans, seconds, per * eff, sync, cfg,
                                   total * accum)
        else:  # no epochs: the windows as timed
            result.raw_window_throughputs = list(result.window_throughputs)
        for note in (throttle_note(result.window_gpu), host_bound_note(result.window_gpu)):
            if note:
                result.measurement_notes.append(note)
        windows = result.window_throughputs
        result.throughput_samples_per_s, result.throughput_spread = window_rate(windows)
    finally:
        gc.unfreeze()
        data.close()
        if meter is not None:
            meter.close()  # a window that raised left its power sampler running
    result.steps = step
    result.inverse_steps = trainer.inverse_steps
    if trainer.graph is not None:
        notes["step_graph"] += (f"; {trainer.graph.replays} of {trainer.step_index} steps replayed from "
                                f"{len(trainer.graph.graphs)} graphs")
    result.train_s = time.perf_counter() - t_begin - (result.setup_s or 0.0)
    if result.stopped_early:
        return

    # --- validation in fp32 on a fresh eager model holding the trained weights ---
    check_deadline("validation")
    progress("validation", samples=total * eff, total_samples=total * eff)
    trained = full_state_dict(plain_model, cfg) if world > 1 else plain_model.state_dict()
    if rank == 0:  # once: every rank holds the same weights
        with dev:
            reference = wl.build_model()
        state = {k: v.float() if v.is_floating_point() else v for k, v in trained.items()}
        reference.load_state_dict(state)
        with torch.autocast(dev.type, enabled=False):
            value = wl.evaluate(reference, val_set, dev)
        if not math.isfinite(value):
            raise ProbeError("nan", f"validation {wl.quality_metric} is not finite")
        result.quality = value
        if wl.quality_metric == "val_nrmse":
            result.val_nrmse = value
    if world > 1:  # peak memory: the maximum over the ranks (every rank gets here; rank 0 last)
        reserved, allocated = _peak_memory(dev)
        result.peak_mem_reserved_bytes = int(sync.max(float(reserved or 0)))
        result.peak_mem_allocated_bytes = None if allocated is None else int(sync.max(float(allocated)))
