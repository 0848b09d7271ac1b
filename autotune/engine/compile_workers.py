"""TorchInductor's compile workers, started early and sent away before a probe's timed windows.

At a process's first compile TorchInductor starts a pool of compile workers (a sidecar that
imports torch, then forks a worker per CPU), even when every kernel comes from the cache, and
quiesces it once it has been idle for a minute: a long run hardly sees the pool, but a short
probe's timed windows fall in that first minute. So a compiling GPU probe starts the pool at the
start of its setup (`start_compile_pool`), where its start-up overlaps setup and warm-up, and
after the warm-up waits for it and quiesces it (`quiesce_compile_workers`); a later compile
starts it again. What was done goes with the result (``ProbeResult.compile_workers``); workers
left running add a measurement note. Linux only (the workers are found through /proc).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# /proc read by hand (a few fields of stat, cmdline and children, Linux only like the quiesce itself): psutil
# would read the same files and is not a dependency, nor worth one for this.
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


def cmdline(pid: int) -> str:
    """The command line of `pid`, its arguments joined by spaces ("" once it is gone or without /proc)."""
    try:
        return (_PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def process_name(pid: int) -> str:
    """The name of `pid` (/proc/PID/comm: what ps -o comm shows; "" once it is gone)."""
    try:
        return (_PROC / str(pid) / "comm").read_text().strip()
    except OSError:
        return ""


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


def start_compile_pool() -> int | None:
    """Start TorchInductor's compile pool now, as its ``inductor`` backend does at the first
    compile: the sidecar process, and a request that it fork its workers. Returns the
    sidecar's pid, or None where TorchInductor would start no pool (one compile thread,
    ``TORCH_WARM_POOL=0``, no process pools allowed here) or could not."""
    if os.environ.get("TORCH_WARM_POOL", "1") != "1":
        return None
    try:
        from torch._inductor.async_compile import AsyncCompile, get_compile_threads

        if get_compile_threads() <= 1:
            return None
        AsyncCompile.warm_pool()  # the sidecar process starts (it imports torch)
        AsyncCompile.wakeup()  # ... and forks its workers once it is up
    except Exception as exc:  # a private API of torch's: never let it fail a probe
        log.warning("could not start TorchInductor's compile workers early: %s", exc)
        return None
    pools = _pools()
    return pools[-1].process.pid if pools else None


def _expected_workers(sidecar: int) -> int:
    """How many workers the sidecar forks (its ``--workers=N`` argument; 0 if unknown)."""
    try:
        args = (_PROC / str(sidecar) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return 0
    for arg in args:
        if arg.startswith(b"--workers="):
            return int(arg.split(b"=", 1)[1] or 0)
    return 0


def _wait_until_up(sidecars: list[int], timeout_s: float, poll_s: float, idle_s: float = 0.5) -> None:
    """Wait, at most `timeout_s`, while a sidecar is still starting: it has forked fewer
    workers than it will and it used CPU in the last `idle_s` (importing torch). An idle
    sidecar short of workers is up but was never asked for them, or has quiesced them
    already: nothing to wait for."""
    t0 = time.perf_counter()
    busy_at = {s: (cpu_seconds(s), t0) for s in sidecars}
    expected = {s: _expected_workers(s) for s in sidecars}
    while time.perf_counter() - t0 < timeout_s:
        now = time.perf_counter()
        starting = False
        for s in sidecars:
            used = cpu_seconds(s)
            if used != busy_at[s][0]:
                busy_at[s] = (used, now)
            if len(children(s)) < expected[s] and now - busy_at[s][1] < idle_s:
                starting = True
        if not starting:
            return
        time.sleep(poll_s)


def quiesce_compile_workers(timeout_s: float = 30.0, poll_s: float = 0.05,
                            wait_ready: bool = False) -> dict[str, Any] | None:
    """Ask every TorchInductor compile pool of this process to quiesce and wait, at most
    `timeout_s` in all, until its workers have exited. With `wait_ready` (a pool this process
    asked to start, `start_compile_pool`), first wait until each sidecar has forked all its
    workers: a sidecar still starting up would go on, beside what follows, importing torch and
    forking workers. Returns what was done, or None when there was no pool: ``workers``
    (processes found), ``worker_cpu_s`` (the CPU seconds they had used), ``sidecar_cpu_s``
    (the sidecars' own, their start-up mostly), ``ready_wait_s``, ``wait_s``, ``left``
    (workers still alive at the timeout)."""
    pools = _pools()
    if not pools or not _PROC.is_dir():
        return None
    sidecars = [p.process.pid for p in pools]
    t_ready = time.perf_counter()
    if wait_ready:
        _wait_until_up(sidecars, timeout_s, poll_s)
    ready_wait = time.perf_counter() - t_ready
    workers = [w for s in sidecars for w in children(s)]
    used = sum(cpu_seconds(w) for w in workers)
    found = {"workers": len(workers), "worker_cpu_s": round(used, 3),
             "sidecar_cpu_s": round(sum(cpu_seconds(s) for s in sidecars), 3), "ready_wait_s": round(ready_wait, 3)}
    t0 = time.perf_counter()
    timeout_s = max(timeout_s - ready_wait, 1.0)
    for pool in pools:
        try:
            pool.quiesce()
        except Exception as exc:  # a private API of torch's: never let it fail a probe
            log.warning("could not quiesce TorchInductor's compile workers: %s", exc)
            return {**found, "wait_s": 0.0, "left": len(workers), "error": str(exc)}
    left = workers
    while left and time.perf_counter() - t0 < timeout_s:
        time.sleep(poll_s)
        left = [w for s in sidecars for w in children(s)]
    return {**found, "wait_s": round(time.perf_counter() - t0, 3), "left": len(left)}


def summary(done: dict[str, Any] | None) -> str:
    """One line for a probe's table: what `quiesce_compile_workers` did ("-": no pool)."""
    if not done or not done["workers"]:
        return "-"
    text = f"{done['workers']} stopped after the warm-up in {done['wait_s']:g} s ({done['worker_cpu_s']:g} CPU-s used)"
    if done.get("ready_wait_s", 0) >= 0.05:
        text += f", {done['ready_wait_s']:g} s waited for them to start"
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
