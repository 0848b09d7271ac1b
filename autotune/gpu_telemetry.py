"""What the GPU itself did during a probe's timed windows, read from NVML (nvidia-ml-py).

A throughput is only as good as the clocks it was measured at. A GPU that the driver holds
down for power or heat (or that is still boosting up) runs the same kernels slower, and a
short probe and a long run can meet it in different states. So the probe reads, at the
start and end of every timed window: the SM clock, temperature and power draw, and the time
the driver spent holding the clocks down for power or thermal reasons (NVML's violation
counters, cumulative nanoseconds). Per window it records the clock, temperature, power and
utilization (the share of the driver's last sample period, up to a second, in which a kernel
ran: well below 100 % means the GPU waited on the host) at the window's end, and the
fraction of the window that was throttled; the probe notes windows that were throttled for
a noticeable part of their time.

Telemetry is best effort: without a CUDA device, without nvidia-ml-py, or where the driver
does not answer a query, the fields are None and nothing else changes.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

# what autotune asks NVML (nvidia-ml-py's names; tests/test_gpu_telemetry.py checks they exist)
NVML_CALLS = ("nvmlInit", "nvmlDeviceGetHandleByPciBusId", "nvmlDeviceGetClockInfo", "nvmlDeviceGetTemperature",
              "nvmlDeviceGetPowerUsage", "nvmlDeviceGetViolationStatus", "nvmlDeviceGetUtilizationRates")
# perf-policy types whose violation counters mean "clocks held down"
THROTTLE_POLICIES = ("NVML_PERF_POLICY_POWER", "NVML_PERF_POLICY_THERMAL")
THROTTLE_NOTE_FRACTION = 0.05  # a window throttled this long is worth a note
HOST_BOUND_UTILIZATION = 80  # median utilization (%) over the windows below which the GPU mostly waited on the host


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
    behind this (bench/README.md): a batch-24 CUDA-graphs config ran 31-56 % slower on later
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
