"""autotune.host_telemetry: the training loop thread's own counters per window, read for real
from this thread (Linux's getrusage(RUSAGE_THREAD)), and the host's CPU model."""

from __future__ import annotations

import resource
import threading
import time

import pytest

from autotune.host_telemetry import ThreadUsage, cpu_model, window_stats

pytestmark = pytest.mark.skipif(not hasattr(resource, "RUSAGE_THREAD"), reason="per-thread usage is Linux-only")


def measure(work: object) -> dict[str, float | int | None]:
    start = ThreadUsage.read()
    assert start is not None
    work()  # type: ignore[operator]
    end = ThreadUsage.read()
    assert end is not None
    return window_stats(start, end)


def spin() -> None:
    deadline = time.perf_counter() + 0.3
    while time.perf_counter() < deadline:
        pass


def test_a_thread_that_computes_reads_busy_and_one_that_sleeps_does_not() -> None:
    busy, idle = measure(spin), measure(lambda: time.sleep(0.3))
    assert busy["busy_fraction"] is not None and idle["busy_fraction"] is not None
    assert busy["busy_fraction"] > 0.3 > 0.1 > idle["busy_fraction"]


def test_touching_new_memory_counts_page_faults() -> None:
    def touch() -> None:
        block = bytearray(32 << 20)  # fresh pages from the kernel: each first write faults
        for i in range(0, len(block), 4096):
            block[i] = 1

    quiet = measure(lambda: None)
    assert measure(touch)["minor_faults"] > max(16, 4 * quiet["minor_faults"])  # type: ignore[operator]


def test_sleeping_counts_voluntary_switches() -> None:
    def naps() -> None:
        for _ in range(20):
            time.sleep(0.001)

    assert measure(naps)["voluntary_switches"] >= 20  # type: ignore[operator]


def test_the_counters_are_the_calling_threads_own() -> None:
    """Another thread's work does not show in this thread's window: the readings are per thread."""
    other = threading.Thread(target=spin)
    here = measure(lambda: (other.start(), other.join()))
    assert here["busy_fraction"] is not None and here["busy_fraction"] < 0.2


def test_the_cpu_model_is_named() -> None:
    model = cpu_model()
    assert model and model != "unknown"
