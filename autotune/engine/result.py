"""What one probe measured: `ProbeResult` (its `to_dict` is what a worker hands in, validated by
`autotune.contract.results.TrialResult`), and the epoch-start amortization of its windows
(`amortize_epoch_starts`): the DataLoader's epoch starts counted at the rate a long run pays
them (autotune/engine/epoch_cost.py), the windows as timed kept in ``raw_window_throughputs``.
No torch at import: the worker builds results for trials whose probe gave none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autotune.contract.gate import window_rate
from autotune.engine.epoch_cost import Boundary, amortized_seconds, epoch_costs, gpu_idle_summary

if TYPE_CHECKING:
    from autotune.contract.config import TrainConfig
    from autotune.engine.timing import RankSync

AMORTIZED_NOTE = 0.01  # a measurement note says so when amortizing epoch starts moves the throughput this much


@dataclass
class ProbeResult:
    """Everything one probe measured. JSON-serialisable through `to_dict`."""

    workload: str
    preset: str
    config: dict[str, Any]
    device: str
    torch_version: str
    cuda_version: str | None = None  # torch.version.cuda (None: a CPU build)
    driver_version: str | None = None  # the NVIDIA driver's, from NVML (None: no GPU or no NVML)
    gpu_count: int = 0  # GPUs the probe ran on (world_size on CUDA; 0 on a CPU)
    model_fingerprint: str | None = None  # autotune.contract.provenance.model_fingerprint, taken at setup
    throughput_samples_per_s: float | None = None
    throughput_spread: float | None = None
    window_throughputs: list[float] = field(default_factory=list)  # with epoch starts amortized (epoch_cost.py)
    raw_window_throughputs: list[float] = field(default_factory=list)  # as timed, epoch starts where they fell
    val_nrmse: float | None = None  # set only for a workload whose quality metric is val_nrmse
    quality_metric: str = "val_nrmse"
    quality: float | None = None  # the workload's quality metric (whatever its name) on the validation set
    quality_direction: str = "minimize"  # "minimize" | "maximize"
    warmup_s: float | None = None
    setup_s: float | None = None
    setup_phases: dict[str, float] = field(default_factory=dict)  # host seconds per setup phase
    process_start_s: float | None = None
    train_s: float | None = None
    peak_mem_reserved_bytes: int | None = None
    peak_mem_allocated_bytes: int | None = None
    data_wait_fraction: float | None = None
    window_data_wait_s: list[float] = field(default_factory=list)  # rank 0's host seconds blocked on data, per window
    # rank 0's GPU per window (autotune.engine.gpu_telemetry): SM clock, temperature, power, throttled fraction
    window_gpu: list[dict[str, float | None]] = field(default_factory=list)
    # energy of every GPU of the trial over the timed windows (autotune.engine.gpu_telemetry): joules over the windows'
    # samples; per window; per GPU (rank order, they sum up); "nvml_total_energy" | "power_integral". None on a CPU
    energy_j_per_sample: float | None = None
    window_energy_j_per_sample: list[float] = field(default_factory=list)
    gpu_energy_j_per_sample: list[float] = field(default_factory=list)
    energy_method: str | None = None
    # rank 0's training-loop thread per window (autotune.engine.host_telemetry): busy fraction, page faults, preemptions
    window_host: list[dict[str, float | int | None]] = field(default_factory=list)
    epoch_micro_batches: int | None = None  # one DataLoader epoch (a rank's micro-batches)
    # every epoch start after the first: micro_batch (index), stall_s (host seconds of its fetch),
    # gpu_gap_s (seconds the GPU idled across it; None on a CPU), excess_s (its cost, the gap
    # where known else the stall, over a typical fetch), window (the timed window it fell in, or None)
    epoch_boundaries: list[dict[str, Any]] = field(default_factory=list)
    epoch_cost_s: float | None = None  # the mean excess: what one epoch start costs
    traced_steps: int = 0  # warm-up steps in the trace (ProbeSettings.trace_path)
    # TorchInductor's compile workers stopped before the timed windows: workers, worker_cpu_s,
    # wait_s, left (autotune.engine.compile_workers); None when there were none or they were kept
    compile_workers: dict[str, Any] | None = None
    host_cpu: str | None = None  # the host's CPU model: host-bound throughputs compare only between like CPUs
    measurement_notes: list[str] = field(default_factory=list)  # what qualifies the throughput (e.g. throttling)
    loss_curve: list[tuple[int, float]] = field(default_factory=list)
    samples_trained: int = 0
    steps: int = 0
    warmup_steps: int = 0
    window_steps: int = 0
    inverse_steps: int = 0
    world_size: int = 1  # processes (GPUs) the probe ran on; throughput counts the samples of all
    knobs: dict[str, str] = field(default_factory=dict)
    stopped_early: bool = False
    failure: dict[str, str] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["loss_curve"] = [list(p) for p in self.loss_curve]
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ProbeResult:
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["loss_curve"] = [tuple(p) for p in values.get("loss_curve", [])]
        return cls(**values)

    @property
    def ok(self) -> bool:
        return self.failure is None and not self.stopped_early


def amortize_epoch_starts(result: ProbeResult, boundaries: list[Boundary], spans: list[tuple[int, int]],
                           seconds: list[float], window_samples: int, sync: RankSync, cfg: TrainConfig,
                           planned_micro_batches: int) -> None:
    """Count the DataLoader's epoch starts in the windows at the rate a long run pays them
    (autotune/engine/epoch_cost.py): record each start's stall and GPU gap (`boundaries` resolved:
    `EpochIterator.resolved_boundaries`), and replace the window throughputs with amortized
    ones (the raw ones are kept). Several ranks: a window's excess and the mean cost are the
    largest over the ranks (the slowest rank sets the window's time)."""
    result.raw_window_throughputs = list(result.window_throughputs)
    epoch = result.epoch_micro_batches
    assert epoch is not None
    restarts = cfg.num_workers > 0 and not cfg.persistent_workers  # an epoch start restarts the workers
    costs = epoch_costs(spans, result.window_data_wait_s, boundaries)
    if costs is None:  # every rank alike: the boundaries fall at the same micro-batches
        if restarts and planned_micro_batches <= epoch:
            result.measurement_notes.append(
                f"the probe ran inside one DataLoader epoch ({planned_micro_batches} of {epoch} micro-batches): the "
                "cost of an epoch start (restarting the non-persistent workers) is not in this throughput")
        return
    window_excess = [sync.max(e) for e in costs.window_excess_s]
    cost = sync.max(costs.cost_s)
    result.epoch_cost_s = cost
    result.epoch_boundaries = [{"micro_batch": b.micro_batch, "stall_s": b.stall_s, "gpu_gap_s": b.gpu_gap_s,
                                "excess_s": e, "window": w}
                               for b, e, w in zip(boundaries, costs.excess_s, costs.window_of, strict=True)]
    adjusted = amortized_seconds(seconds, spans, window_excess, cost, epoch)
    if adjusted is None:
        return
    result.window_throughputs = [window_samples / s for s in adjusted]
    raw, amortized = window_rate(result.raw_window_throughputs)[0], window_rate(result.window_throughputs)[0]
    if abs(amortized / raw - 1) >= AMORTIZED_NOTE:
        timed = sum(w is not None for w in costs.window_of)
        long_run = sum(hi - lo for lo, hi in spans) / epoch
        start = "; ".join(filter(None, ("restarting the workers" if restarts else "refilling the queue",
                                        gpu_idle_summary(boundaries))))
        result.measurement_notes.append(
            f"an epoch start costs {cost * 1e3:.0f} ms ({start}); the windows timed {timed} where a long run pays "
            f"{long_run:.2f} (one per {epoch} micro-batches): counted at that rate, {raw:,.0f} → {amortized:,.0f} "
            "samples/s")
