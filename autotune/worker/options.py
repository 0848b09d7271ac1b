"""What `autotune worker` is told (`WorkerOptions`), and the environment its probe children get.

Every child of the worker (fork server, cold probes, distributed launchers, hardware detection)
runs without the worker's token: a probe runs workload code (`child_environment`)."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from autotune.contract.registry import builtin_workload_names, workload_paths
from autotune.engine.distributed import launch_argv
from autotune.engine.fork_server import without_secrets
from autotune.worker.client import DEFAULT_API

CHILD_MODULE = "autotune.engine.probe_child"
RETRY_ENV = "AUTOTUNE_WORKER_RETRY_S"


def service_retry_s(default: float) -> float:
    """How long one lease call or complete retries a service that does not answer before the
    worker moves on (a lease call: the worker says the service does not answer and asks again;
    a complete: its result waits in the spool, delivered when the service answers):
    $AUTOTUNE_WORKER_RETRY_S seconds when set, else `default` (10 s for both). Shorter: a
    restarted service is seen sooner; longer: fewer lines on a network that drops out for a
    while. A signal's last complete keeps its own budget. ValueError unless a positive number."""
    value = os.environ.get(RETRY_ENV, "").strip()
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"${RETRY_ENV} must be a positive number of seconds, not {value!r}: set it to e.g. "
                         f"{default:g}, or unset it for the default")
    return seconds


def hard_timeout_grace_s(timeout_s: float) -> float:
    """Slack on top of probe.timeout_s before the child is killed: the probe's own (soft)
    deadline starts after the interpreter and torch are up, so give process start room."""
    return min(30.0, max(5.0, 0.05 * timeout_s))


def inductor_cache_dir() -> Path:
    """Per-host TorchInductor cache shared by a host's trials: $AUTOTUNE_INDUCTOR_CACHE_DIR,
    else ~/.cache/autotune/inductor (a warm cache makes a probe's compile warm-up much shorter)."""
    env = os.environ.get("AUTOTUNE_INDUCTOR_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "autotune" / "inductor"


def child_environment(threads: int | None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The probe child's environment: the worker's without its secrets (the token: a probe runs
    workload code), plus the compile cache and thread limits."""
    env = without_secrets(os.environ if base is None else base)
    if "TORCHINDUCTOR_CACHE_DIR" not in env:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache_dir())
    if threads:
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[name] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    env["AUTOTUNE_PARENT_PID"] = str(os.getpid())  # the child dies with this worker (autotune/engine/probe_child.py)
    return env


def default_worker_id(device: str) -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{device}"


@dataclass
class WorkerOptions:
    """What `autotune worker` is told on its command line."""

    api: str = DEFAULT_API
    token: str | None = None
    study: str | None = None  # serve only this study (default: any study of this hardware class)
    device: str = "cpu"
    max_trials: int | None = None  # exit after this many trials (default: never)
    idle_exit_s: float | None = None  # exit after this long without work (default: never)
    worker_id: str | None = None  # default: hostname-pid-device
    heartbeat_s: float = 5.0
    threads: int | None = None  # torch threads in the child (default: torch's)
    allow_workloads: tuple[str, ...] | None = None  # workloads it runs (default: the built-in ones)
    gpus_per_trial: int = 1  # GPUs (cpu: gloo processes) per trial; the device is split into groups of this many
    spool_dir: Path | None = None  # undelivered results (default: autotune.worker.spool.default_spool_dir())
    child_argv: list[str] = field(default_factory=lambda: [sys.executable, "-m", CHILD_MODULE])
    # fork the probe children from a server that has imported torch (autotune.engine.fork_server)
    warm_start: bool = True
    launch_argv: list[str] = field(default_factory=launch_argv)  # the distributed launcher (gpus_per_trial > 1)

    def allowed_workloads(self) -> tuple[str, ...]:
        """The allowed workload names (an ``NAME=module:attr`` entry allows NAME)."""
        if self.allow_workloads is None:
            return tuple(builtin_workload_names())
        return tuple(dict.fromkeys(entry.partition("=")[0].strip() for entry in self.allow_workloads))

    def workload_paths(self) -> dict[str, str]:
        """NAME → module:attr of the ``--allow-workload NAME=module:attr`` entries (the operator's
        import paths, exported to the probe children by `export_workload_paths`); ValueError
        with the fix for a malformed entry."""
        return workload_paths(self.allow_workloads or ())
