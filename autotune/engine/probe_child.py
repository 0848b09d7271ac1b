"""The probe child process: ``python -m autotune.engine.probe_child`` runs one probe for a worker.

One child per trial (its own process group and CUDA context), so a crash, an OOM kill or a hang
ends only the child; forked from the worker's fork server (`autotune.engine.fork_server`), else
started cold. Protocol:

stdin   one JSON object (`ChildJob.to_json`): workload, preset, config, device, probe settings.
stdout  JSON lines, nothing else: {"type": "report", "step": S, "metrics": {...}} after every
        timed window; {"type": "progress", "phase": P, ...} at every phase and window
        (autotune.engine.probe.ProgressCallback); {"type": "result", "result":
        ProbeResult.to_dict()} exactly once, last. Fd 1 points at stderr before torch is
        imported, so stray prints cannot corrupt the protocol.
stderr  everything else.

Exit status 0 whenever the result line was written. SIGTERM stops the probe at the next window
boundary (``stopped_early``). The child never outlives its worker (`watch_parent`:
PR_SET_PDEATHSIG, and a watchdog on the parent pid, $AUTOTUNE_PARENT_PID, that kills the child's
process group). A probe over several GPUs runs under `autotune.engine.distributed` instead, with
the same job and stdout protocol.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from types import FrameType
from typing import IO, Any

from autotune.contract.protocol import ProbeSpec
from autotune.engine.stdout_guard import divert_stdout

log = logging.getLogger("autotune.engine.probe_child")

PARENT_PID_ENV = "AUTOTUNE_PARENT_PID"
PARENT_POLL_S = 0.5
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PR_SET_NAME = 15


@dataclass
class ChildJob:
    """What one probe child runs."""

    workload: str
    preset: str
    config: dict[str, Any]
    device: str = "cpu"
    probe: ProbeSpec = field(default_factory=ProbeSpec)  # how to measure: the study's, its defaults written there
    threads: int | None = None  # torch intra-op threads (None: torch's default)
    world_size: int = 1  # processes of the probe: > 1 runs as N ranks (autotune.engine.distributed)

    def __post_init__(self) -> None:
        if not isinstance(self.probe, ProbeSpec):  # its fields as a mapping (the JSON on stdin, a script)
            self.probe = ProbeSpec.model_validate(self.probe)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "probe": self.probe.model_dump(mode="json")})

    @classmethod
    def from_json(cls, text: str) -> ChildJob:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("the job must be a JSON object")
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


class ProtocolWriter:
    """Writes the JSON lines of the protocol to the real stdout (thread-safe, flushed per line)."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    def write(self, message: dict[str, Any]) -> None:
        line = json.dumps(message, allow_nan=True)
        with self._lock:
            self._stream.write(line + "\n")
            self._stream.flush()


def claim_stdout() -> ProtocolWriter:
    """Keep a private handle on stdout for the protocol; point fd 1 (and sys.stdout) at stderr
    for the rest of the process (`autotune.engine.stdout_guard.divert_stdout`)."""
    protocol_fd = divert_stdout()
    if protocol_fd is None:
        raise SystemExit("autotune.engine.probe_child: stdout must be open (the protocol goes there)")
    return ProtocolWriter(os.fdopen(protocol_fd, "w", buffering=1, encoding="utf-8"))


def _die_with_group() -> None:
    """End this process and, when it leads its process group (the worker starts it so), the whole group."""
    try:
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
    finally:
        os._exit(137)


def _prctl(option: int, value: int | bytes) -> bool:
    """libc's prctl(option, value); False where that is not available (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return int(libc.prctl(option, value, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def set_parent_death_signal(signum: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `signum` to this process when its parent dies (Linux
    PR_SET_PDEATHSIG, through libc's prctl). False where that is not available. The signal
    fires when the parent *thread* that started this process exits; the worker starts
    probes from its main thread."""
    return _prctl(PR_SET_PDEATHSIG, int(signum))


def set_process_name(name: str) -> bool:
    """Name this process `name` (its first 15 bytes) where ps -o comm, top and /proc/PID/comm
    show it (Linux PR_SET_NAME); a child forked by the worker's fork server shows the
    server's command line otherwise. False where that is not available."""
    return _prctl(PR_SET_NAME, name.encode()[:15])


def watch_parent(parent_pid: int | None = None, poll_s: float = PARENT_POLL_S) -> int:
    """Make this process die with its parent (see the module docstring): PR_SET_PDEATHSIG where
    available, plus a daemon thread that kills the process group once the parent pid changes.
    `parent_pid`: the parent to watch (default: $AUTOTUNE_PARENT_PID, else the current
    parent). Exits at once when that parent is already gone. Returns the watched pid."""
    if parent_pid is None:
        env = os.environ.get(PARENT_PID_ENV, "")
        parent_pid = int(env) if env.isdigit() else os.getppid()
    set_parent_death_signal()
    if os.getppid() != parent_pid:  # it died before (or while) the signal was armed
        _die_with_group()

    def poll() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent_pid:
                log.error("the worker (pid %d) is gone: stopping this probe", parent_pid)
                _die_with_group()

    threading.Thread(target=poll, name="parent-watchdog", daemon=True).start()
    return parent_pid


def run_job(job: ChildJob, out: ProtocolWriter, stop: threading.Event) -> dict[str, Any]:
    """Run the probe of `job`, writing reports to `out`; returns the ProbeResult dict (never raises)."""
    if job.threads:
        os.environ.setdefault("OMP_NUM_THREADS", str(job.threads))
    import torch

    if job.threads:
        torch.set_num_threads(job.threads)
    from autotune.contract.config import ConfigError
    from autotune.engine.probe import ProbeSettings, classify_exception, device_name, run_probe
    from autotune.engine.result import ProbeResult

    def on_report(step: int, metrics: dict[str, float]) -> bool:
        out.write({"type": "report", "step": step, "metrics": metrics})
        return stop.is_set()

    def on_progress(phase: str, info: dict[str, Any]) -> None:
        out.write({"type": "progress", "phase": phase, **info})

    try:
        settings = ProbeSettings.from_spec(job.probe)
        result = run_probe(job.workload, job.config, preset=job.preset, device=job.device, settings=settings,
                           on_report=on_report, on_progress=on_progress)
        return result.to_dict()
    except Exception as exc:  # a config the probe refuses, an unknown workload, ...: a recorded failure
        if isinstance(exc, ConfigError):
            kind, message = "error", f"invalid probe configuration: {exc}"
        else:
            kind, message = classify_exception(exc)
        log.error("probe did not start: %s", message)
        try:
            device = device_name(torch.device(job.device))
        except Exception:
            device = job.device
        return ProbeResult(workload=job.workload, preset=job.preset, config=job.config, device=device,
                           torch_version=torch.__version__, failure={"kind": kind, "message": message}).to_dict()


def main() -> int:
    watch_parent()
    out = claim_stdout()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()

    def on_sigterm(signum: int, _frame: FrameType | None) -> None:
        # Stop at the next window boundary (run_probe's on_report returns True); the worker
        # sends SIGKILL if that takes longer than its grace period.
        stop.set()

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        job = ChildJob.from_json(sys.stdin.read())
    except (ValueError, TypeError) as e:
        print(f"autotune.engine.probe_child: bad job on stdin: {e}", file=sys.stderr)
        return 2
    result = run_job(job, out, stop)
    if stop.is_set() and not result.get("failure"):
        result["stopped_early"] = True
    out.write({"type": "result", "result": result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
