"""What the GPU itself did during a probe's timed windows, read from NVML (nvidia-ml-py).

A throughput is only as good as the clocks it was measured at, and a short probe and a long run
can meet a GPU in different power or thermal states. So at the start and end of every timed
window the probe reads the SM clock, temperature, power, utilization and the driver's throttle
counters, records them per window, and notes windows throttled for a noticeable part of their
time. Energy (`EnergyMeter`, `summarize_energy`): each GPU's joules over each window, from NVML's
total-energy counter (``nvml_total_energy``) or, without one, integrated power readings
(``power_integral``), read outside the CUDA events like the other NVML reads. Best effort:
without a CUDA device, nvidia-ml-py or an answer from the driver, the fields are None.
"""

from __future__ import annotations

import itertools
import logging
import math
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

# what autotune asks NVML (nvidia-ml-py's names; tests/engine/test_gpu_telemetry.py checks they exist)
NVML_CALLS = ("nvmlInit", "nvmlDeviceGetHandleByPciBusId", "nvmlDeviceGetClockInfo", "nvmlDeviceGetTemperature",
              "nvmlDeviceGetPowerUsage", "nvmlDeviceGetViolationStatus", "nvmlDeviceGetUtilizationRates",
              "nvmlDeviceGetTotalEnergyConsumption")
# perf-policy types whose violation counters mean "clocks held down"
THROTTLE_POLICIES = ("NVML_PERF_POLICY_POWER", "NVML_PERF_POLICY_THERMAL")
THROTTLE_NOTE_FRACTION = 0.05  # a window throttled this long is worth a note
HOST_BOUND_UTILIZATION = 80  # median utilization (%) over the windows below which the GPU mostly waited on the host
# how a probe's energy was measured (ProbeResult.energy_method), the better first
ENERGY_METHODS = ("nvml_total_energy", "power_integral")
POWER_SAMPLE_INTERVAL_S = 0.02  # power readings while a window runs, where there is no energy counter


@dataclass(frozen=True)
class Reading:
    """One NVML reading of a device."""

    at: float  # time.monotonic() seconds
    sm_clock_mhz: int | None
    temperature_c: int | None
    power_w: float | None
    throttled_ns: int | None  # power + thermal violation time so far (cumulative)
    utilization_percent: int | None = None  # time a kernel ran, over the driver's last sample period (≤ 1 s)


def window_stats(start: Reading, end: Reading) -> dict[str, float | None]:
    """One window's telemetry: clock, temperature and power at its end; the fraction of it the
    clocks were held down (None where the counters are unsupported or went backwards)."""
    fraction = None
    seconds = end.at - start.at
    if start.throttled_ns is not None and end.throttled_ns is not None and seconds > 0:
        fraction = (end.throttled_ns - start.throttled_ns) / 1e9 / seconds
        if not 0.0 <= fraction <= 1.5:  # a counter reset or a driver's odd units: not a measurement
            fraction = None
        else:
            fraction = min(fraction, 1.0)
    return {"sm_clock_mhz": end.sm_clock_mhz, "temperature_c": end.temperature_c, "power_w": end.power_w,
            "throttled_fraction": fraction, "utilization_percent": end.utilization_percent}


def window_range(windows: Sequence[dict[str, float | None]], key: str) -> tuple[float, float] | None:
    """(lowest, highest) of one reading over the windows; None when no window has it."""
    values = [v for v in (w.get(key) for w in windows) if v is not None]
    return (min(values), max(values)) if values else None


def throttle_note(windows: Sequence[dict[str, float | None]]) -> str | None:
    """A note naming the windows the GPU was throttled in for ≥ 5 % of their time, with the SM
    clock range over the windows; None when no window was."""
    fractions = [w.get("throttled_fraction") for w in windows]
    hot = [(i, f) for i, f in enumerate(fractions) if f is not None and f >= THROTTLE_NOTE_FRACTION]
    if not hot:
        return None
    clocks = window_range(windows, "sm_clock_mhz")
    where = ", ".join(f"window {i + 1} {f:.0%}" for i, f in hot)
    clock_range = f"; SM clock {clocks[0]:.0f}–{clocks[1]:.0f} MHz" if clocks else ""
    return (f"the driver held the GPU's clocks down (power or heat) during the timed windows: {where}{clock_range}. "
            "This throughput holds for a GPU in the same state; check cooling and power limits (nvidia-smi -q -d "
            "PERFORMANCE) before comparing it with other hosts")


def host_bound_note(windows: Sequence[dict[str, float | None]]) -> str | None:
    """A note when the GPU ran kernels for less than HOST_BOUND_UTILIZATION % of the time in the
    median window: the GPU waited on the host (None: no readings, or a busy GPU). The H100 runs
    behind this (docs/measurement.md): a batch-24 CUDA-graphs config ran 31-56 % slower on later
    lent hosts than on the first, with the same GPU model, at the maximum SM clock."""
    values = sorted(v for v in (w.get("utilization_percent") for w in windows) if v is not None)
    if not values or len(values) < len(windows):  # a window without a reading: no claim
        return None
    median = statistics.median(values)
    if median >= HOST_BOUND_UTILIZATION:
        return None
    return (f"the GPU ran kernels only {median:.0f} % of the time (median over the timed windows; "
            f"{values[0]:.0f}–{values[-1]:.0f} %): this throughput is bound by the host (launches, the training "
            "loop, data) rather than by the GPU's compute. Such throughputs follow the host's CPU and load: compare "
            "them only between like hosts (host_cpu), and expect repeated runs of one config to differ more than a "
            "GPU-bound config's (bench/README.md, probe fidelity)")


class GpuTelemetry:
    """NVML readings of one CUDA device. `open` returns None where there is nothing to read."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self._nvml = nvml
        self._handle = handle

    @classmethod
    def open(cls, device: torch.device) -> GpuTelemetry | None:
        if device.type != "cuda":
            return None
        try:
            import pynvml  # nvidia-ml-py
        except ImportError:
            log.info("GPU telemetry off: nvidia-ml-py is not installed")
            return None
        try:
            pynvml.nvmlInit()
            props = torch.cuda.get_device_properties(device)
            # NVML numbers devices its own way (CUDA_VISIBLE_DEVICES does not apply): find this
            # one by its PCI address
            domain, bus, dev = (getattr(props, f"pci_{part}_id") for part in ("domain", "bus", "device"))
            bus_id = f"{domain:08x}:{bus:02x}:{dev:02x}.0"
            handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id.encode())
        except Exception as e:  # no driver library, an old torch without PCI ids, an unknown device
            log.info("GPU telemetry off: %s", e)
            return None
        return cls(pynvml, handle)

    def _query(self, name: str, *args: Any) -> Any:
        try:
            return getattr(self._nvml, name)(self._handle, *args)
        except Exception:  # NVML_ERROR_NOT_SUPPORTED and friends: that reading is unknown
            return None

    def read(self) -> Reading:
        """Now's reading; a query the driver does not answer reads None (never raises)."""
        clock = self._query("nvmlDeviceGetClockInfo", getattr(self._nvml, "NVML_CLOCK_SM", 1))
        temperature = self._query("nvmlDeviceGetTemperature", getattr(self._nvml, "NVML_TEMPERATURE_GPU", 0))
        milliwatts = self._query("nvmlDeviceGetPowerUsage")
        violations = [self._query("nvmlDeviceGetViolationStatus", getattr(self._nvml, policy, None))
                      for policy in THROTTLE_POLICIES]
        try:
            throttled: int | None = sum(int(v.violationTime) for v in violations)
        except (AttributeError, TypeError, ValueError):  # unsupported (None) or a struct of another shape
            throttled = None
        rates = self._query("nvmlDeviceGetUtilizationRates")
        return Reading(at=time.monotonic(), sm_clock_mhz=clock, temperature_c=temperature,
                       power_w=None if milliwatts is None else milliwatts / 1000, throttled_ns=throttled,
                       utilization_percent=getattr(rates, "gpu", None))

    def energy_mj(self) -> int | None:
        """NVML's total-energy counter (millijoules since the driver loaded); None where unsupported."""
        value = self._query("nvmlDeviceGetTotalEnergyConsumption")
        return int(value) if isinstance(value, int) and not isinstance(value, bool) else None

    def power_w(self) -> float | None:
        """The power draw now (watts; Ampere and newer: averaged over the last second); None where unsupported."""
        milliwatts = self._query("nvmlDeviceGetPowerUsage")
        return milliwatts / 1000 if isinstance(milliwatts, (int, float)) and not isinstance(milliwatts, bool) else None


# --- energy ----------------------------------------------------------------------------------


def counter_joules(start_mj: int | None, end_mj: int | None) -> float | None:
    """The energy between two readings of the total-energy counter (millijoules), in joules;
    None when a reading is missing or the counter went backwards (the driver reloaded)."""
    if start_mj is None or end_mj is None or end_mj < start_mj:
        return None
    return (end_mj - start_mj) / 1000.0


def power_integral_joules(samples: Sequence[tuple[float, float]], start: float, end: float) -> float | None:
    """The energy over [start, end] (seconds) from power samples (time, watts), in joules: the
    trapezoid rule over the samples, the power before the first sample and after the last held
    at theirs. None without a usable sample or an empty interval."""
    points = sorted((t, w) for t, w in samples if math.isfinite(t) and math.isfinite(w) and w >= 0)
    if not points or not end > start:
        return None

    def power(t: float) -> float:
        if t <= points[0][0]:
            return points[0][1]
        for (t0, w0), (t1, w1) in itertools.pairwise(points):
            if t0 <= t <= t1:
                return w0 if t1 == t0 else w0 + (w1 - w0) * (t - t0) / (t1 - t0)
        return points[-1][1]

    knots = [start, *(t for t, _ in points if start < t < end), end]
    return sum((b - a) * (power(a) + power(b)) / 2 for a, b in itertools.pairwise(knots))


@dataclass(frozen=True)
class Energy:
    """A probe's energy over its timed windows (`summarize_energy`)."""

    j_per_sample: float  # every GPU's energy in the windows over the windows' samples
    window_j_per_sample: list[float]  # each window's
    gpu_j_per_sample: list[float]  # each GPU's (rank order) energy in the windows over their samples: they sum up
    method: str  # ENERGY_METHODS: the weakest any GPU used


def summarize_energy(window_gpu_joules: Sequence[Sequence[float | None]], window_samples: Sequence[float],
                     methods: Sequence[str | None]) -> Energy | None:
    """The energy per sample of a probe from each window's joules per GPU
    (`window_gpu_joules[w][g]`), each window's samples (all ranks'), and each GPU's method. None
    unless every GPU has a method and every window a reading of every GPU: a figure that left
    out a GPU or a window would be too low."""
    if (not window_gpu_joules or len(window_gpu_joules) != len(window_samples) or not methods
            or any(m not in ENERGY_METHODS for m in methods)):
        return None
    rows: list[list[float]] = []
    for joules in window_gpu_joules:
        if len(joules) != len(methods) or any(j is None or not math.isfinite(j) or j < 0 for j in joules):
            return None
        rows.append([float(j) for j in joules if j is not None])
    total_samples = float(sum(window_samples))
    if total_samples <= 0 or any(s <= 0 for s in window_samples):
        return None
    per_gpu = [sum(row[g] for row in rows) / total_samples for g in range(len(methods))]
    method = max(methods, key=lambda m: ENERGY_METHODS.index(m or ""))
    return Energy(j_per_sample=sum(sum(row) for row in rows) / total_samples,
                  window_j_per_sample=[sum(row) / s for row, s in zip(rows, window_samples, strict=True)],
                  gpu_j_per_sample=per_gpu, method=str(method))


class EnergyMeter:
    """One GPU's energy over a window: `start()` just before it, `stop()` (joules, or None)
    just after it. The counter where the GPU has one (`method` "nvml_total_energy"), else
    power samples integrated ("power_integral": a thread samples while the window runs;
    `threaded` False leaves the sampling to the caller's `sample()`). `open` returns None
    where neither reading answers."""

    def __init__(self, telemetry: GpuTelemetry, method: str, interval_s: float = POWER_SAMPLE_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic, threaded: bool = True) -> None:
        if method not in ENERGY_METHODS:
            raise ValueError(f"energy method {method!r} is not one of {', '.join(ENERGY_METHODS)}")
        self.method = method
        self._telemetry = telemetry
        self._interval = interval_s
        self._clock = clock
        self._threaded = threaded
        self._start_mj: int | None = None
        self._began = 0.0
        self._samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def open(cls, telemetry: GpuTelemetry | None, **kwargs: Any) -> EnergyMeter | None:
        if telemetry is None:
            return None
        if telemetry.energy_mj() is not None:
            return cls(telemetry, "nvml_total_energy", **kwargs)
        if telemetry.power_w() is not None:
            return cls(telemetry, "power_integral", **kwargs)
        log.info("GPU energy off: the driver answers neither the energy counter nor the power reading")
        return None

    def sample(self) -> None:
        """One power reading, kept with its time (the sampling thread's step)."""
        watts = self._telemetry.power_w()
        if watts is not None:
            self._samples.append((self._clock(), watts))

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.sample()

    def start(self) -> None:
        if self.method == "nvml_total_energy":
            self._start_mj = self._telemetry.energy_mj()
            return
        self._samples = []
        self._began = self._clock()
        self.sample()
        if self._threaded:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="gpu-power", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop the sampling thread, if one runs (a window that never reached `stop`)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def stop(self) -> float | None:
        if self.method == "nvml_total_energy":
            return counter_joules(self._start_mj, self._telemetry.energy_mj())
        self.close()
        self.sample()
        return power_integral_joules(self._samples, self._began, self._clock())
