"""TorchInductor's compile workers, sent away before a probe's timed windows.

When a process's compiled code loads its first Triton kernel (on a GPU), TorchInductor starts
a pool of compile workers: a sidecar process (``torch/_inductor/compile_worker/__main__.py``)
that forks one worker per CPU (up to 32). It does so even when every kernel comes from the
compile cache and the pool never compiles anything (``AsyncCompile.triton`` asks whether the
pool is ready, which starts it; the ``inductor`` backend of ``torch._dynamo`` warms it up
too). A long training run does not see the pool: TorchInductor quiesces it (the workers exit)
once it has been idle for a minute. A probe's timed windows, though, fall in that first
minute, beside the pool's start-up and its idle processes, on a host whose single
training-loop thread may be what bounds a config (autotune.host_telemetry).

So after the warm-up (the last compile a probe expects), the probe asks each pool to quiesce
now, as TorchInductor would a minute later, and waits until the workers have exited before
it times anything. Nothing is lost: a later compile (a recompile in a timed window) starts
the workers again. What was done is recorded with the result (``ProbeResult.compile_workers``,
a row of ``autotune probe``'s table); workers left running add a measurement note.

Linux only (the workers are found through /proc); elsewhere, and where no pool was started
(no Triton, CPU probes, ``TORCHINDUCTOR_COMPILE_THREADS=1``), nothing is done.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_PROC = Path("/proc")
_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/`pid`/stat after the command name, from the state on (``[0]`` the
    state, ``[1]`` the parent pid, ``[11:13]`` user and system ticks, ``[19]`` the start time);
    None when the process is gone or there is no /proc. The name may hold spaces and
    parentheses, so the fields are split after its last ")"."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2:].split()


def children(pid: int) -> list[int]:
    """The live child processes of `pid` (Linux /proc; [] elsewhere or once `pid` is gone)."""
    try:
        entries = [e.name for e in _PROC.iterdir() if e.name.isdigit()]
    except OSError:
        return []
    found = []
    for name in entries:
        fields = process_stat(name)
        if fields and int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(name))
    return found


def cpu_seconds(pid: int) -> float:
    """The user + system CPU seconds `pid` has used so far (0 once it is gone)."""
    fields = process_stat(pid)
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S if fields else 0.0


def _pools() -> list[Any]:
    """TorchInductor's live subprocess pools in this process (none when TorchInductor never made one)."""
    module = sys.modules.get("torch._inductor.async_compile")
    pools = getattr(module, "_pool_set", None) if module is not None else None
    return [p for p in (pools or ()) if hasattr(p, "quiesce") and getattr(p, "running", False)
            and getattr(p, "process", None) is not None]


def quiesce_compile_workers(timeout_s: float = 30.0, poll_s: float = 0.05) -> dict[str, Any] | None:
    """Ask every TorchInductor compile pool of this process to quiesce and wait, at most
    `timeout_s`, until its workers have exited. Returns what was done, or None when there was
    no pool: ``workers`` (processes found), ``worker_cpu_s`` (the CPU seconds they had used),
    ``wait_s``, ``left`` (workers still alive at the timeout)."""
    pools = _pools()
    if not pools or not _PROC.is_dir():
        return None
    sidecars = [p.process.pid for p in pools]
    workers = [w for s in sidecars for w in children(s)]
    used = sum(cpu_seconds(w) for w in workers)
    t0 = time.perf_counter()
    for pool in pools:
        try:
            pool.quiesce()
        except Exception as exc:  # a private API of torch's: never let it fail a probe
            log.warning("could not quiesce TorchInductor's compile workers: %s", exc)
            return {"workers": len(workers), "worker_cpu_s": round(used, 3), "wait_s": 0.0,
                    "left": len(workers), "error": str(exc)}
    left = workers
    while left and time.perf_counter() - t0 < timeout_s:
        time.sleep(poll_s)
        left = [w for s in sidecars for w in children(s)]
    return {"workers": len(workers), "worker_cpu_s": round(used, 3),
            "wait_s": round(time.perf_counter() - t0, 3), "left": len(left)}


def summary(done: dict[str, Any] | None) -> str:
    """One line for a probe's table: what `quiesce_compile_workers` did ("-": no pool)."""
    if not done or not done["workers"]:
        return "-"
    text = f"{done['workers']} stopped after the warm-up in {done['wait_s']:g} s ({done['worker_cpu_s']:g} CPU-s used)"
    return text + (f"; {done['left']} still running" if done["left"] else "")


def note(done: dict[str, Any] | None) -> str | None:
    """A measurement note, only when compile workers were left beside the timed windows (the
    wait ran out, or torch refused the quiesce); None otherwise."""
    if not done or not done["left"]:
        return None
    why = f"torch refused to quiesce them ({done['error']})" if done.get("error") else (
        f"still running {done['wait_s']:g} s after they were asked to stop")
    return (f"{done['left']} of TorchInductor's {done['workers']} compile workers ran beside the timed windows: "
            f"{why}; on a host-bound config they may slow it")
