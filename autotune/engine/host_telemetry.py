"""What the host did for the training loop during a probe's timed windows.

A host-bound config (short steps: CUDA graphs at a small batch) runs at the speed of the loop's
thread, which varies from host to host and process to process. So per timed window the probe
records the loop thread's ``busy_fraction`` (CPU seconds over the window's seconds),
``minor_faults``, ``involuntary_switches`` (preemptions) and ``voluntary_switches``
(``getrusage(RUSAGE_THREAD)``), and the whole host's ``host_busy_fraction`` and
``host_steal_fraction`` (/proc/stat); the host's CPU model (`cpu_model`) goes with the result,
since host-bound throughputs compare only between like CPUs. Best effort: without RUSAGE_THREAD
(macOS, Windows) nothing is recorded, and without /proc/stat the host's fractions are None.
"""

from __future__ import annotations

import functools
import platform
import resource
import time
from dataclasses import dataclass
from pathlib import Path

_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", None)  # Linux only
# /proc/stat and /proc/cpuinfo are read by hand: a line of each, where psutil would read the same files and is
# not a dependency (nor worth one); the thread's own counters come from the standard library (getrusage).
_PROC_STAT = Path("/proc/stat")


def parse_proc_stat(text: str) -> tuple[int, int, int] | None:
    """The host's CPU time so far, from /proc/stat's aggregate line: (busy, steal, total) in
    clock ticks. Busy is everything but idle, iowait and steal; guest time is already inside
    user and nice, so it is not counted twice. None when the line is not there."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            ticks = [int(x) for x in fields[1:9]] + [0] * (8 - len(fields[1:9]))
            user, nice, system, idle, iowait, irq, softirq, steal = ticks
            busy = user + nice + system + irq + softirq
            return busy, steal, busy + idle + iowait + steal
    return None


def host_cpu_ticks() -> tuple[int, int, int] | None:
    """`parse_proc_stat` of this host now; None where there is no /proc/stat."""
    try:
        return parse_proc_stat(_PROC_STAT.read_text())
    except OSError:
        return None


@dataclass(frozen=True)
class ThreadUsage:
    """The calling thread's counters at one moment."""

    at: float  # time.perf_counter() seconds
    cpu_s: float  # user + system
    minor_faults: int
    involuntary_switches: int
    voluntary_switches: int
    host_ticks: tuple[int, int, int] | None = None  # the whole host's (busy, steal, total) CPU ticks

    @classmethod
    def read(cls) -> ThreadUsage | None:
        """The calling thread's counters now; None where the platform has no per-thread usage."""
        if _RUSAGE_THREAD is None:
            return None
        usage = resource.getrusage(_RUSAGE_THREAD)
        return cls(at=time.perf_counter(), cpu_s=usage.ru_utime + usage.ru_stime, minor_faults=usage.ru_minflt,
                   involuntary_switches=usage.ru_nivcsw, voluntary_switches=usage.ru_nvcsw,
                   host_ticks=host_cpu_ticks())


def window_stats(start: ThreadUsage, end: ThreadUsage) -> dict[str, float | int | None]:
    """One window's readings (the module docstring says what each means)."""
    seconds = end.at - start.at
    busy = (end.cpu_s - start.cpu_s) / seconds if seconds > 0 else None
    host_busy = host_steal = None
    if start.host_ticks and end.host_ticks and end.host_ticks[2] > start.host_ticks[2]:
        total = end.host_ticks[2] - start.host_ticks[2]
        host_busy = round((end.host_ticks[0] - start.host_ticks[0]) / total, 4)
        host_steal = round((end.host_ticks[1] - start.host_ticks[1]) / total, 4)
    return {"busy_fraction": None if busy is None else round(min(busy, 1.0), 4),
            "minor_faults": end.minor_faults - start.minor_faults,
            "involuntary_switches": end.involuntary_switches - start.involuntary_switches,
            "voluntary_switches": end.voluntary_switches - start.voluntary_switches,
            "host_busy_fraction": host_busy, "host_steal_fraction": host_steal}


@functools.cache  # fixed for the process: read once, however many probes and workers ask
def cpu_model() -> str:
    """The host CPU's model name (Linux: /proc/cpuinfo), else what the platform module knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"
