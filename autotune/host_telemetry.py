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

Best effort, like the GPU's telemetry: where RUSAGE_THREAD does not exist (macOS, Windows)
nothing is recorded. The host's CPU model (`cpu_model`) goes with the result, since
host-bound throughputs compare only between like CPUs.
"""

from __future__ import annotations

import functools
import platform
import resource
import time
from dataclasses import dataclass
from pathlib import Path

_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", None)  # Linux only


@dataclass(frozen=True)
class ThreadUsage:
    """The calling thread's counters at one moment."""

    at: float  # time.perf_counter() seconds
    cpu_s: float  # user + system
    minor_faults: int
    involuntary_switches: int
    voluntary_switches: int

    @classmethod
    def read(cls) -> ThreadUsage | None:
        """The calling thread's counters now; None where the platform has no per-thread usage."""
        if _RUSAGE_THREAD is None:
            return None
        usage = resource.getrusage(_RUSAGE_THREAD)
        return cls(at=time.perf_counter(), cpu_s=usage.ru_utime + usage.ru_stime, minor_faults=usage.ru_minflt,
                   involuntary_switches=usage.ru_nivcsw, voluntary_switches=usage.ru_nvcsw)


def window_stats(start: ThreadUsage, end: ThreadUsage) -> dict[str, float | int | None]:
    """One window's readings (the module docstring says what each means)."""
    seconds = end.at - start.at
    busy = (end.cpu_s - start.cpu_s) / seconds if seconds > 0 else None
    return {"busy_fraction": None if busy is None else round(min(busy, 1.0), 4),
            "minor_faults": end.minor_faults - start.minor_faults,
            "involuntary_switches": end.involuntary_switches - start.involuntary_switches,
            "voluntary_switches": end.voluntary_switches - start.voluntary_switches}


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
