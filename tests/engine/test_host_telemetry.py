"""autotune.engine.host_telemetry: the training loop thread's own counters per window, read for real
from this thread (Linux's getrusage(RUSAGE_THREAD)), the whole host's CPU time (/proc/stat),
and the host's CPU model."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
import time

import pytest

from autotune.engine.host_telemetry import ThreadUsage, cpu_model, parse_proc_stat, window_stats

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
    # the share of a CPU the spinning thread gets depends on the host's load: check the reading
    # against the thread's own CPU clock over the same window
    t0, c0 = time.perf_counter(), time.thread_time()
    busy = measure(spin)
    share = (time.thread_time() - c0) / (time.perf_counter() - t0)
    idle = measure(lambda: time.sleep(0.3))
    assert busy["busy_fraction"] is not None and idle["busy_fraction"] is not None
    assert busy["busy_fraction"] == pytest.approx(share, abs=0.05)
    assert busy["busy_fraction"] > 0.1 > idle["busy_fraction"]


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


def test_proc_stat_splits_the_hosts_cpu_time_into_busy_steal_and_total() -> None:
    text = "cpu  100 5 20 800 30 2 3 40 7 0\ncpu0 50 2 10 400 15 1 1 20 3 0\nintr 12345\n"
    # busy: user + nice + system + irq + softirq (guest time is inside user already)
    assert parse_proc_stat(text) == (130, 40, 1000)
    assert parse_proc_stat("cpu  1 2 3 4\n") == (6, 0, 10)  # an old kernel's four columns
    assert parse_proc_stat("intr 1\n") is None


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="/proc/stat is Linux-only")
def test_the_hosts_busy_fraction_sees_other_processes_load() -> None:
    """Processes that spin on every CPU make the host busy in a window where this thread sleeps."""
    cpus = os.cpu_count() or 1
    # Each spinner says so once it is spinning, and spins until it is stopped: a slow interpreter
    # start (a loaded CI host) cannot leave the measured window short of load.
    code = (
        "import sys, time\nend = time.perf_counter() + 60\nsys.stdout.write('spinning\\n'); sys.stdout.flush()\n"
        "while time.perf_counter() < end: pass"
    )
    spinners = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(cpus)]
    try:
        for proc in spinners:
            assert proc.stdout is not None and proc.stdout.readline() == "spinning\n"
        loaded = measure(lambda: time.sleep(0.4))
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()
    quiet = measure(lambda: time.sleep(0.4))
    assert loaded["busy_fraction"] is not None and loaded["busy_fraction"] < 0.1  # this thread slept
    assert loaded["host_busy_fraction"] is not None and quiet["host_busy_fraction"] is not None
    assert loaded["host_busy_fraction"] > 0.85  # every CPU spun, while this thread slept
    if quiet["host_busy_fraction"] < 0.5:  # a host the rest of the world leaves quiet: the load is what moved it
        assert loaded["host_busy_fraction"] > quiet["host_busy_fraction"] + 0.3
    assert 0.0 <= loaded["host_steal_fraction"] <= 1.0  # type: ignore[operator]
