"""What the host did for the training loop during a probe's timed windows.

A config whose steps are short (CUDA graphs at a small batch) is bound by the host thread
that runs the training loop, not by the GPU: its throughput follows that thread's CPU speed
and whatever takes the thread's core from it, and it varies from host to host and from
process to process more than a GPU-bound config does (bench/README.md, probe fidelity). So
the probe reads the loop thread's own counters (``getrusage(RUSAGE_THREAD)``, Linux) at the
start and end of every timed window and records, per window:

``busy_fraction``         the thread's CPU seconds (user + system) over the window's seconds.
                          Near 1: the thread never waited (host-bound, or spinning in a CUDA
                          sync); well below 1: it slept (on data, on a blocking sync, or off
                          its core).
``minor_faults``          page faults served without I/O. After DataLoader workers are forked
                          (non-persistent workers: at every epoch), the loop's writes to memory
                          it shares with them copy pages; a burst of these slows a window.
``involuntary_switches``  times the kernel took the core from the thread (another process or
                          thread wanted it): preemption, e.g. by busy DataLoader workers.
``voluntary_switches``    times the thread went to sleep: waiting on a lock (the GIL, when
                          another thread of the process holds it), a queue or a blocking sync.
``host_busy_fraction``    the whole host's CPUs (/proc/stat, Linux): the fraction of their time
                          spent busy (not idle, waiting on I/O or stolen), whoever ran. A
                          host-bound loop runs at one thread's speed, which the rest of the
                          host's load can slow (shared caches, memory bandwidth, clocks): a
                          single-thread speedometer ran 3–10 % slower around short probes of
                          such a config (docs/measurement.md).
``host_steal_fraction``   the fraction of the host's CPU time a hypervisor gave to others.

Best effort, like the GPU's telemetry: where RUSAGE_THREAD does not exist (macOS, Windows)
nothing is recorded, and without /proc/stat the host's two fractions are None. The host's
CPU model (`cpu_model`) goes with the result, since host-bound throughputs compare only
between like CPUs.
"""

from __future__ import annotations

import functools
import platform
import resource
import time
from dataclasses import dataclass
from pathlib import Path

_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", None)  # Linux only
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
