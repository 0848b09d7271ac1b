"""autotune.engine.gpu_telemetry: per-window GPU state from NVML readings, and the throttling note.

The readings themselves need a GPU (tests/engine/test_probe.py, marked gpu); here the arithmetic that
turns two readings into a window's figures, and what the probe and the worker make of them.
"""

from __future__ import annotations

import pytest
import torch

from autotune.engine.gpu_telemetry import (
    NVML_CALLS,
    THROTTLE_POLICIES,
    GpuTelemetry,
    Reading,
    host_bound_note,
    throttle_note,
    window_stats,
)


def reading(at: float, throttled_ns: int | None, clock: int = 1980, utilization: int | None = None) -> Reading:
    return Reading(at=at, sm_clock_mhz=clock, temperature_c=61, power_w=512.5, throttled_ns=throttled_ns,
                   utilization_percent=utilization)


def test_a_window_reports_the_fraction_of_its_time_the_clocks_were_held_down() -> None:
    stats = window_stats(reading(10.0, 5_000_000_000, utilization=99), reading(12.0, 5_500_000_000, clock=1755,
                                                                                utilization=57))
    assert stats == {"sm_clock_mhz": 1755, "temperature_c": 61, "power_w": 512.5,  # the window's end
                     "throttled_fraction": pytest.approx(0.25), "utilization_percent": 57}  # 0.5 s of 2 s


@pytest.mark.parametrize(("start_ns", "end_ns"), [(None, 10), (10, None), (5_000_000_000, 0), (0, 10**12)])
def test_an_unsupported_or_nonsensical_counter_is_no_measurement(start_ns: int | None, end_ns: int | None) -> None:
    """Unsupported (None), gone backwards (a reset), or more throttled time than time: None, never a guess."""
    assert window_stats(reading(0.0, start_ns), reading(1.0, end_ns))["throttled_fraction"] is None


def test_the_note_names_the_throttled_windows_and_the_clock_range() -> None:
    windows = [window_stats(reading(0.0, 0), reading(1.0, ns, clock=c))
               for ns, c in ((0, 1980), (10_000_000, 1980), (300_000_000, 1410))]
    note = throttle_note(windows)
    assert note is not None
    assert "window 3 30%" in note and "window 2" not in note  # 1 % is below the 5 % threshold
    assert "1410–1980 MHz" in note


def test_no_throttling_or_no_counters_means_no_note() -> None:
    assert throttle_note([window_stats(reading(0.0, 0), reading(1.0, 1_000_000))]) is None
    assert throttle_note([window_stats(reading(0.0, None), reading(1.0, None))]) is None
    assert throttle_note([]) is None


def windows_at(*utilizations: int | None) -> list[dict[str, float | None]]:
    return [window_stats(reading(0.0, 0), reading(1.0, 0, utilization=u)) for u in utilizations]


def test_a_gpu_that_mostly_waited_on_the_host_gets_a_note() -> None:
    """The readings of a batch-24 CUDA-graphs probe on the H100 host (bench/results/host_bound_h100.jsonl)."""
    note = host_bound_note(windows_at(69, 69, 68, 67, 46, 62, 66, 60))
    assert note is not None and "66 %" in note and "46–69 %" in note and "bound by the host" in note


def test_a_busy_gpu_or_missing_readings_mean_no_host_bound_note() -> None:
    assert host_bound_note(windows_at(94, 82, 89, 93, 0, 97, 93, 89)) is None  # one slow window: median 91
    assert host_bound_note(windows_at(50, None, 50)) is None  # a window without a reading: no claim
    assert host_bound_note([]) is None


def test_there_is_no_telemetry_off_a_gpu() -> None:
    assert GpuTelemetry.open(torch.device("cpu")) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU host has a driver to read")
def test_a_cuda_device_without_a_driver_means_no_telemetry_not_an_error() -> None:
    """nvidia-ml-py is installed (a dependency) but finds no driver library here: telemetry is off."""
    import pynvml  # noqa: F401 - installed with autotune

    assert GpuTelemetry.open(torch.device("cuda", 0)) is None


def test_the_nvml_calls_and_fields_autotune_reads_exist_in_the_installed_nvidia_ml_py() -> None:
    """A rename in the dependency would turn telemetry off silently on every GPU: caught here."""
    import pynvml

    for name in (*NVML_CALLS, *THROTTLE_POLICIES, "NVML_CLOCK_SM", "NVML_TEMPERATURE_GPU"):
        assert hasattr(pynvml, name), name
    assert "violationTime" in [name for name, _ in pynvml.c_nvmlViolationTime_t._fields_]
    assert "gpu" in [name for name, _ in pynvml.c_nvmlUtilization_t._fields_]
