"""The worker: lease a trial, run its probe in a child process, report, complete; repeat.

One worker serves one device, or several *GPU groups* (`plan_groups`): with
``--gpus-per-trial N`` every trial runs on N GPUs at once (`autotune.engine.distributed`),
and ``--device cuda:0,1,2,3 --gpus-per-trial 2`` makes two groups (GPUs 0,1 and 2,3), each
with its own lease loop (a thread; worker id suffixed with the group) and its own trials.
``--device cpu --gpus-per-trial 2`` runs 2 gloo processes per trial (tests, smoke runs). The
worker leases only studies whose ``gpus_per_trial`` equals its own (the lease request says
it; pinned with --study to another world size, the service answers 422 naming the fix).
The loop of one group (`Worker.run`):

spool     first, results not yet delivered (`autotune.worker.spool`: a folder per service id, one JSON
          file per result) are handed in, at the worker's start and around every lease; only the
          folder of the service answering (and the top, for an unknown service's) is read.
lease     POST /v1/trials/lease with the worker's hardware class, its allow-list (the service
          offers it only studies of those workloads; a --study of another workload is a 422
          naming the fix) and the study, if given.
          204: nothing to do: wait with backoff (capped at 5 s); exit after `idle_exit_s`.
          Unreachable (connection refused, timeouts, 5xx): retried in slices of LEASE_RETRY_S;
          the time counts toward `idle_exit_s` too, and a worker that gives up so exits with
          status 3, naming the URL it could not reach and for how long.
          A lease of a trial whose result lies in the spool is not run again: the spooled
          result is delivered. Nor is a lease of a trial whose spooled result was just
          delivered (the lease came back before the delivery, e.g. right after a service
          restart; `Spool.settled`): the delivery ended it. "Its result" means the result of
          that very lease: the lease's token (`TrialLease.lease_token`) must be the spooled
          one's (a backup of the database has the same service id, study and trial ids, but
          its leases have other tokens). Each lease is tagged with the service's id (the lease
          names it; from an older service, GET /v1/health asked after the lease) and its
          token, which its spooled result keeps; heartbeats, reports and the complete carry
          the token.
          While idle it reads GET /v1/studies (at once, then every minute) and names, once per
          distinct set, the running studies it cannot take and why: another hardware class,
          a workload off its allow-list, another gpus_per_trial (`skipped_studies`).
refuse    the allow-list is the worker's own boundary, whatever the service sends: a lease
          naming a workload that is not on the worker's allow-list (`--allow-workload`,
          default: the built-in workloads) or not installed here is completed at once as failed,
          kind "refused", with a message naming the workload and how to allow it. Nothing the
          lease names is imported: the check reads the registry's names (autotune.workloads),
          and only a probe child of an allowed, installed workload imports its module. An
          ``--allow-workload NAME=module:attr`` entry allows NAME and defines it for this
          worker's children (exported in AUTOTUNE_WORKLOADS, see autotune.workloads): the
          operator's import path, never the service's.
probe     `python -m autotune.engine.probe_child` in its own process group (see probe_child.py for
          the stdin/stdout protocol), with a hard limit of the study's probe.timeout_s plus a
          small grace, torch threads and a per-host TorchInductor cache set in its environment,
          and the worker's token (AUTOTUNE_TOKEN) taken out of it: every child of the worker
          (fork server, cold probes, distributed launchers, hardware detection) runs without it.
          Warm start (the default; `--cold-start` turns it off): the child is forked from the
          worker's fork server (`autotune.engine.fork_server`), which imported torch, torch._dynamo
          and the probe once, in that same environment; a GPU's hardware detection at start
          is forked from it too (a CPU is detected without torch). A server that cannot
          serve leaves the children starting cold.
          CPU share: a ``--device cpu`` worker without --threads registers among its host's CPU
          workers (`CpuShare`: flock'ed slot files, released by the kernel when a worker dies)
          and, before each probe, waits for its share of the cores (m live workers: 1/m each),
          pins the child to them and runs it with one torch thread per core (at most
          OMP_NUM_THREADS, if set); the banner says "cpu: N threads, core share k of m".
          ``--threads N`` keeps N threads and no share.
          A group of N > 1 GPUs runs `python -m autotune.engine.distributed` instead (a launcher
          that imports torch once and forks N ranks, CUDA_VISIBLE_DEVICES = the group's
          GPUs), the job in a job directory: prune = its stop file; a kill ends the
          launcher's group and every rank's group; a rank's failure record (kind, message
          naming the rank) becomes the trial's result.
monitor   drains the child's stdout (its report lines and its result) and acts on decisions;
          it never waits on the network. A `Courier` thread, started before the child (whose
          fork may wait for the fork server's preload), carries the reports to POST /report
          and a heartbeat every `heartbeat_s` to the service (reply prune → SIGTERM the child:
          it stops at the next window and its result says stopped_early, or SIGKILL after a
          grace and a partial result is built from the reports; heartbeat reply stop → kill the
          child, complete the trial as failed). While the service is away the courier keeps at
          most MAX_PENDING_REPORTS reports, dropping the oldest: a prune decision comes late,
          the probe's timed windows (measured in the child) are never touched.
complete  the result is written to the spool, then POST /complete (retried COMPLETE_RETRY_S)
          if the service still shows the lease's service id (else it waits in the spool for
          that service: `autotune.worker.spool.misplaced`); the file is removed once the service has it.
          Not delivered, it stays in the spool and the lease loop delivers it when the service
          answers. A child that dies without a result (crash, OOM kill, signal), hangs past the
          hard limit, or is interrupted becomes a failure record; the worker itself goes on.

Resilience: every call retries connection errors and 5xx (backoff capped at 10 s), so a
worker outlives a service restart, and no result is lost meanwhile: it waits in the spool,
also across a kill of the worker (the next worker on that spool delivers it). A 409 means the
trial is no longer this worker's: the child is stopped, and a result it gave anyway is kept
in the spool's rejected/ folder (in the spool itself, for the service that leased it, when
the service does not know the trial or holds another lease of it: another database). How
this meets the service's lease grace: `autotune.worker.spool`.
SIGINT/SIGTERM: the running child is killed, its trial completed as failed, kind
"interrupted" ("worker interrupted by SIGTERM"; the service re-runs it on another worker: a
preemption says nothing about the config), and the worker exits 128 + signal.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import json
import logging
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any, TypeVar

from rich.console import Console
from rich.markup import escape

from autotune.contract.gate import window_rate
from autotune.contract.protocol import ANOTHER_LEASE, LeaseRequest, TrialLease
from autotune.contract.registry import (
    ENTRY_POINT_GROUP,
    builtin_workload_names,
    export_workload_paths,
    registered_workloads,
    workload_paths,
)
from autotune.engine.distributed import (
    JOB_DIR_ENV,
    collect_failure,
    kill_ranks,
    launch_argv,
    prepare_job_dir,
    request_stop,
)
from autotune.engine.fork_server import ForkedChild, ForkServer, ForkServerError, without_secrets
from autotune.engine.probe_child import ChildJob
from autotune.worker.client import (
    DEFAULT_API,
    ApiError,
    Client,
    Conflict,
    Invalid,
    NotFound,
    ServiceUnavailable,
    Unauthorized,
)
from autotune.worker.hardware import Hardware, detect_cpu, installed_torch_version
from autotune.worker.spool import (
    Delivery,
    Services,
    Spool,
    SpoolEntry,
    default_spool_dir,
    deliver,
    deliver_entries,
    misplaced,
    service_identity,
    services_named,
    spool_command,
    unauthorized_hint,
)

log = logging.getLogger(__name__)

CHILD_MODULE = "autotune.engine.probe_child"
IDLE_BACKOFF_START_S = 0.5
IDLE_BACKOFF_CAP_S = 5.0
PRUNE_GRACE_S = 5.0  # a pruned child gets this long to stop at a window boundary and print its result
KILL_GRACE_S = 2.0  # SIGTERM → SIGKILL when the child's result is not wanted
STDERR_TAIL_CHARS = 1500
# A last complete after SIGINT/SIGTERM retries this long, then the worker exits anyway (the
# result stays in the spool; the service's reaper fails the trial as "lost" later).
FINAL_COMPLETE_RETRY_S = 20.0
# A complete retries this long; then its result waits in the spool and the lease loop (which
# needs the service anyway) delivers it when the service answers.
COMPLETE_RETRY_S = 10.0
# One lease call retries this long; the loop calls again (counting --idle-exit meanwhile).
LEASE_RETRY_S = 10.0
SPOOL_RETRY_S = 2.0  # one spooled result's delivery from the lease loop: short, the loop comes back
# A spooled result the service would not take yet (a 401, a trial it does not know) is offered again after this
SPOOL_RECHECK_S = 60.0
UNREACHABLE_EXIT = 3  # --idle-exit ran out while the service could not be reached
# Reports the courier keeps while the service is away (the oldest are dropped beyond this).
MAX_PENDING_REPORTS = 8
COURIER_CLOSE_S = 2.0  # after the probe, the courier gets this long to hand in what it holds
AWAY_PAUSE_S = 1.0  # the courier's pause between two tries while the service is away (each try has its budget)
# An idle worker rereads the studies this often to name the running ones it cannot take.
SKIPPED_RECHECK_S = 60.0
SKIPPED_LIST_RETRY_S = 2.0  # the listing is a hint: a service that does not answer soon is not waited for


def hard_timeout_grace_s(timeout_s: float) -> float:
    """Slack on top of probe.timeout_s before the child is killed: the probe's own (soft)
    deadline starts after the interpreter and torch are up, so give process start room."""
    return min(30.0, max(5.0, 0.05 * timeout_s))


def inductor_cache_dir() -> Path:
    """Per-host TorchInductor cache shared by a host's trials: $AUTOTUNE_INDUCTOR_CACHE_DIR,
    else ~/.cache/autotune/inductor. Warm caches cut compile warm-up from ~30 s to ~3 s."""
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


@dataclass(frozen=True)
class DeviceGroup:
    """The devices one lease loop runs its trials on.

    `devices` are torch device strings as the worker sees them (``cuda:2``, ``cpu``); a
    CPU group of N processes repeats ``cpu`` N times. `name` goes into the worker id."""

    devices: tuple[str, ...]

    @property
    def world_size(self) -> int:
        return len(self.devices)

    @property
    def is_cuda(self) -> bool:
        return self.devices[0].startswith("cuda")

    @property
    def name(self) -> str:
        if not self.is_cuda:
            return "cpu" if self.world_size == 1 else f"cpu-x{self.world_size}"
        if self.world_size == 1:
            return self.devices[0]
        return "cuda:" + ",".join(d.partition(":")[2] for d in self.devices)

    def visible_devices(self, environ: Mapping[str, str] | None = None) -> str:
        """CUDA_VISIBLE_DEVICES for this group's ranks: its GPUs in the numbering of the
        worker's own CUDA_VISIBLE_DEVICES, when the worker has one."""
        env = os.environ if environ is None else environ
        outer = [v.strip() for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        indices = [int(d.partition(":")[2]) for d in self.devices]
        return ",".join(outer[i] if i < len(outer) else str(i) for i in indices) if outer else \
            ",".join(map(str, indices))


def plan_groups(device: str, gpus_per_trial: int, cuda_count: Callable[[], int] | None = None) -> list[DeviceGroup]:
    """Split `device` (``cpu``, ``cuda``, ``cuda:N`` or ``cuda:0,1,...``) into groups of
    `gpus_per_trial` devices. ``cpu`` is one group of `gpus_per_trial` gloo processes;
    ``cuda`` means the current GPU for one GPU per trial, every visible GPU otherwise
    (`cuda_count` counts them). Raises ValueError naming the fix."""
    if gpus_per_trial < 1:
        raise ValueError(f"--gpus-per-trial {gpus_per_trial}: must be >= 1")
    if device == "cpu":
        return [DeviceGroup(("cpu",) * gpus_per_trial)]
    if device == "cuda" and gpus_per_trial == 1:
        return [DeviceGroup(("cuda",))]
    if device == "cuda":
        count = cuda_count() if cuda_count is not None else visible_cuda_count()
        if count == 0:
            raise ValueError("--device cuda: CUDA is not available on this host (no GPU visible); use --device cpu")
        indices = list(range(count))
    elif device.startswith("cuda:"):
        try:
            indices = [int(part) for part in device[5:].split(",")]
        except ValueError:
            raise ValueError(f"--device {device}: expected cuda:N or cuda:N,M,... (GPU indices)") from None
        if len(set(indices)) != len(indices) or min(indices) < 0:
            raise ValueError(f"--device {device}: each GPU index once, none negative")
    else:
        raise ValueError(f"unknown device {device!r}; use cpu, cuda, cuda:N or cuda:N,M,...")
    if not indices or len(indices) % gpus_per_trial:
        raise ValueError(f"--device {device} holds {len(indices)} GPU(s), not a multiple of --gpus-per-trial "
                         f"{gpus_per_trial}: list a multiple of {gpus_per_trial} GPUs (e.g. cuda:0,1 for 2)")
    return [DeviceGroup(tuple(f"cuda:{i}" for i in indices[k:k + gpus_per_trial]))
            for k in range(0, len(indices), gpus_per_trial)]


def describe_exit(returncode: int) -> str:
    """Why a child ended without a result, in words."""
    if returncode < 0:
        number = -returncode
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        hint = ": possibly the OOM killer" if number == signal.SIGKILL else ""
        return f"probe process killed by signal {number} ({name}{hint})"
    if returncode == 0:
        return "probe process exited (code 0) without printing a result"
    return f"probe process exited with code {returncode} without a result"


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


def refusal(workload: str, allowed: tuple[str, ...]) -> str | None:
    """Why this worker will not run a trial of `workload`, or None when it will: the workload
    must be on the allow-list and installed here. Reads registry names only (imports nothing
    the lease names): a study must not make a worker run code its operator did not allow."""
    if workload not in allowed:
        return (f"workload {workload!r} is not allowed on this worker (allowed: {', '.join(allowed) or 'none'}); "
                f"start the worker with --allow-workload {workload} to run it")
    installed = registered_workloads()
    if workload not in installed:
        return (f"workload {workload!r} is allowed but not installed on this worker (installed: "
                f"{', '.join(sorted(installed))}); install the package that registers it under the entry-point "
                f"group {ENTRY_POINT_GROUP!r} on this host, or name its code: --allow-workload "
                f"{workload}=module.path:attr")
    return None


# --- running studies this worker cannot take ------------------------------------------------------


@dataclass(frozen=True)
class SkippedStudy:
    """A running study whose trials the service does not offer this worker, and why (with the fix)."""

    name: str
    hardware: str
    reason: str


def _hardware_reason(study_hardware: str, hardware_class: str) -> str:
    if study_hardware == "cpu":
        return (f"a CPU study, and this worker's hardware class is {hardware_class!r}: CPU studies go to workers "
                f"started with --device cpu (a spec without `hardware` is a CPU study; submit it with "
                f"hardware: {hardware_class} to run it on this GPU)")
    if hardware_class == "cpu":
        return ("a GPU study, and this worker runs on the cpu: start a worker with --device cuda on a host with "
                "that GPU (its hardware class must be the study's `hardware` exactly)")
    return (f"this worker's GPU is {hardware_class!r}: a worker takes only the studies whose `hardware` is its "
            "GPU's name exactly; start one on that GPU, or submit a study with this GPU's name")


def skipped_studies(studies: Any, hardware_class: str, allowed: tuple[str, ...], gpus_per_trial: int,
                    study: str | None = None) -> list[SkippedStudy]:
    """The running studies of a GET /v1/studies reply (`studies`: its ``data``, read as plain
    JSON, so a spec naming a space or workload unknown here is still read) that the service
    will not offer a worker of `hardware_class`, allow-list `allowed` and `gpus_per_trial`
    (only `study` when the worker is pinned to one), each with why and the fix."""
    skipped: list[SkippedStudy] = []
    for info in studies if isinstance(studies, list) else ():
        if not isinstance(info, dict) or info.get("state") != "running" or not isinstance(info.get("spec"), dict):
            continue
        name, spec = str(info.get("name")), info["spec"]
        if study is not None and name != study:
            continue
        hardware = str(spec.get("hardware", "cpu"))
        workload = str(spec.get("workload", "ups"))
        world = spec.get("gpus_per_trial", 1)
        if hardware != hardware_class:
            reason = _hardware_reason(hardware, hardware_class)
        elif workload not in allowed:
            reason = (f"workload {workload!r} is not on this worker's allow-list ({', '.join(allowed) or 'none'}): "
                      f"start the worker with --allow-workload {workload}")
        elif world != gpus_per_trial:
            reason = (f"each trial runs on {world} GPU(s) (gpus_per_trial) and this worker's on {gpus_per_trial}: "
                      f"start a worker with --gpus-per-trial {world}")
        else:
            continue
        skipped.append(SkippedStudy(name, hardware, reason))
    return skipped


class SkipNotice:
    """What a worker process last said about the running studies it cannot take: each distinct
    set is said once, however often the idle loops poll (shared by the lease loops of one
    worker, which see the same studies)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._shown: frozenset[str] | None = None

    def fresh(self, skipped: list[SkippedStudy]) -> bool:
        """True when `skipped` is non-empty and not the set last said (which it now becomes)."""
        key = frozenset(s.name for s in skipped)
        with self._lock:
            if not key or key == self._shown:
                return False
            self._shown = key
            return True


# --- the CPU share: the CPU workers of one host split its cores -----------------------------------

CPU_SHARE_ENV = "AUTOTUNE_CPU_SHARE_DIR"
CPU_SHARE_POLL_S = 0.1  # a probe waiting for its cores looks again this often


def cpu_share_dir() -> Path:
    """Where the CPU workers of this host register (`CpuShare`): $AUTOTUNE_CPU_SHARE_DIR, else
    $XDG_RUNTIME_DIR/autotune/cpu-share, else ~/.cache/autotune/cpu-share/HOSTNAME (the host's
    name keeps apart the registries of hosts that share a home directory)."""
    env = os.environ.get(CPU_SHARE_ENV)
    if env:
        return Path(env).expanduser()
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "autotune" / "cpu-share"
    return Path.home() / ".cache" / "autotune" / "cpu-share" / socket.gethostname()


def format_cores(cpus: Collection[int]) -> str:
    """CPU numbers as ranges: ``0-3,6`` for (0, 1, 2, 3, 6)."""
    ranges: list[list[int]] = []
    for core in sorted(set(cpus)):
        if ranges and ranges[-1][1] == core - 1:
            ranges[-1][1] = core
        else:
            ranges.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def cpu_siblings(cpu: int) -> tuple[int, ...]:
    """The logical CPUs of `cpu`'s physical core (its hyperthreads; sysfs), or just `cpu`."""
    try:
        text = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
        siblings: set[int] = set()
        for part in text.split(","):
            low, _, high = part.partition("-")
            siblings.update(range(int(low), int(high or low) + 1))
    except (OSError, ValueError):
        return (cpu,)
    return tuple(sorted(siblings | {cpu}))


@dataclass(frozen=True)
class PhysicalCore:
    """A core: `id` (its lowest logical CPU, whoever may run there: the name of its lock) and the
    logical CPUs of it that this process may run on."""

    id: int
    cpus: tuple[int, ...]


def physical_cores(cpus: Collection[int]) -> tuple[PhysicalCore, ...]:
    """`cpus` (logical CPUs) grouped by physical core, in core order: hyperthreads of one core
    are never split between two workers, and a share's threads are its cores."""
    groups: dict[int, list[int]] = {}
    for cpu in sorted(set(cpus)):
        groups.setdefault(min(cpu_siblings(cpu)), []).append(cpu)
    return tuple(PhysicalCore(core, tuple(members)) for core, members in sorted(groups.items()))


T = TypeVar("T")


def split_cores(cores: Sequence[T], rank: int, workers: int) -> tuple[T, ...]:
    """Share `rank` (0-based) of `workers` equal shares of `cores`: len(cores) // workers cores
    each, the remainder left idle (every worker's probes run on as many threads, so their
    throughputs compare); with more workers than cores, core rank mod len(cores), which the
    probes of the workers that share it take in turns (`CpuShare.acquire`)."""
    if workers > len(cores):
        return (cores[rank % len(cores)],)
    size = len(cores) // workers
    return tuple(cores[rank * size:(rank + 1) * size])


@dataclass(frozen=True)
class CoreShare:
    """One CPU worker's share of the host's cores: the `index`-th (from 1) of the `of` live CPU
    workers, its probes pinned to the logical CPUs of `cores` with one torch thread per core."""

    index: int
    of: int
    cores: tuple[PhysicalCore, ...]
    host_cores: tuple[PhysicalCore, ...]

    @property
    def threads(self) -> int:
        return len(self.cores)

    @property
    def cpus(self) -> tuple[int, ...]:
        return tuple(sorted(cpu for core in self.cores for cpu in core.cpus))

    def probe_threads(self, world_size: int = 1, cap: int | None = None) -> int:
        """Torch threads of each of a probe's `world_size` processes: one per core, at most `cap`
        (`omp_threads_cap`)."""
        return max(1, min(self.threads // world_size, cap or self.threads))

    def describe(self, cap: int | None = None) -> str:
        n, cpus = self.probe_threads(cap=cap), self.cpus
        host = [cpu for core in self.host_cores for cpu in core.cpus]
        capped = f" (OMP_NUM_THREADS={cap})" if n < self.threads else ""
        text = (f"{n} thread{'s' if n != 1 else ''}{capped}, core share {self.index} of {self.of} "
                f"(CPU{'s' if len(cpus) != 1 else ''} {format_cores(cpus)} of {format_cores(host)})")
        if self.of > len(self.host_cores):
            return text + ", taken in turns: more CPU workers than cores"
        idle = len(self.host_cores) - self.threads * self.of
        return text + (f", {idle} core{'s' if idle != 1 else ''} left idle" if idle else "")


def omp_threads_cap(environ: Mapping[str, str] | None = None) -> int | None:
    """OMP_NUM_THREADS of the worker's environment when it holds a positive number: the
    operator's (or a test suite's) ceiling on a probe's threads, which a core share keeps."""
    value = (os.environ if environ is None else environ).get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


class CpuShare:
    """This worker's place among the CPU workers of its host, and the cores its probes run on.

    The registry is a directory of lock files (`cpu_share_dir`), every lock an flock(2): the
    kernel drops it when its holder exits, kill -9 included, so a dead worker holds nothing and
    nothing needs cleaning up (a stale file is only an unlocked file).

    registry.lock  held for the instant of a claim, a count or a core acquisition, which so never interleave;
    slot-N.lock    held by a live CPU worker for its whole life (`claim`: the lowest free N);
                   the live workers are the slots whose lock is taken; the text says whether
                   the worker waits for cores, since when and which;
    core-N.lock    held by a worker while one of its probes runs on physical core N.

    Before each probe (`acquire`) the worker counts the live slots (m), takes its rank k among
    them (slot order) and so its share (`split_cores`): m equal shares of the host's physical
    cores (those this process may run on; hyperthreads stay with their core). It then takes
    the locks of its share's cores, waiting while another worker's probe holds one of them: a
    worker that started alone has all the cores until its running probe ends; its next probe
    takes only its new share. Waiters go first come, first served: no worker takes a core an
    earlier waiter wants. Two probes therefore never run on one core at once, whatever the
    workers' start and exit order. An idle worker keeps its share: every probe of a study
    runs on as many cores."""

    def __init__(self, root: Path | None = None, cores: Sequence[PhysicalCore] | None = None) -> None:
        self.root = root or cpu_share_dir()
        if cores is None:  # the CPUs this process may run on (a cpuset, taskset), by physical core
            cores = physical_cores(os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity")
                                   else range(os.cpu_count() or 1))
        self.host_cores = tuple(sorted(cores, key=lambda core: core.id))
        if not self.host_cores:
            raise ValueError("no cores to share")
        self.slot: int | None = None
        self._slot_fd: int | None = None
        self._core_fds: list[int] = []
        self.held: CoreShare | None = None  # the share whose core locks this worker holds (a probe runs)

    def __enter__(self) -> CpuShare:
        return self.claim()

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _open(self, name: str) -> int:
        return os.open(self.root / name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    @contextlib.contextmanager
    def _registry(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        fd = self._open("registry.lock")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # the lock goes with the descriptor

    def claim(self) -> CpuShare:
        """Register this worker: take the lowest free slot, held until `close` (or exit)."""
        if self.slot is not None:
            return self
        with self._registry():
            index = 0
            while True:
                fd = self._open(f"slot-{index}.lock")
                if _try_lock(fd):
                    break
                os.close(fd)
                index += 1
            self.slot, self._slot_fd = index, fd
            self._write_state({})
        return self

    def _write_state(self, state: dict[str, Any]) -> None:
        assert self._slot_fd is not None
        os.ftruncate(self._slot_fd, 0)
        os.pwrite(self._slot_fd, json.dumps({"pid": os.getpid(), **state}).encode(), 0)

    def _live(self) -> dict[int, dict[str, Any]]:
        """Slot → its state, for every live worker's slot (this one's included); under the registry lock."""
        live: dict[int, dict[str, Any]] = {}
        for path in self.root.glob("slot-*.lock"):
            number = path.stem.partition("-")[2]
            if not number.isdigit():
                continue
            index = int(number)
            if index == self.slot:
                live[index] = {}
                continue
            fd = self._open(path.name)
            try:
                if _try_lock(fd):
                    continue  # nobody holds it: a worker that is gone (the lock goes with the close below)
                try:
                    state = json.loads(os.pread(fd, 4096, 0) or b"{}")
                except ValueError:
                    state = {}
                live[index] = state if isinstance(state, dict) else {}
            finally:
                os.close(fd)
        return live

    def _share(self, live: Collection[int]) -> CoreShare:
        assert self.slot is not None
        slots = sorted(live)
        rank = slots.index(self.slot)
        return CoreShare(rank + 1, len(slots), split_cores(self.host_cores, rank, len(slots)), self.host_cores)

    def current(self) -> CoreShare:
        """This worker's share as the live workers stand now (`claim` first)."""
        if self.slot is None:
            raise RuntimeError("CpuShare.current() before claim()")
        with self._registry():
            return self._share(self._live())

    def acquire(self, stop: Callable[[], bool] | None = None,
                on_wait: Callable[[CoreShare], None] | None = None) -> CoreShare | None:
        """Take the locks of this worker's current share's cores, waiting (polls of
        CPU_SHARE_POLL_S) while another worker holds one of them or an earlier waiter wants one;
        `on_wait` is called once, at the first wait. The share, held until `release`; None when
        `stop()` said so while it waited."""
        if self.slot is None:
            raise RuntimeError("CpuShare.acquire() before claim()")
        self.release()
        since: float | None = None
        try:
            while True:
                with self._registry():
                    live = self._live()
                    share = self._share(live)
                    mine = {core.id for core in share.cores}
                    ahead = [i for i, s in live.items()
                             if i != self.slot and isinstance(s.get("waiting_since"), (int, float))
                             and (since is None or (s["waiting_since"], i) < (since, self.slot))
                             and mine & set(s.get("wants") or ())]
                    if not ahead and self._lock_cores(share.cores):
                        if since is not None:
                            self._write_state({})
                        self.held = share
                        return share
                    first = since is None
                    if since is None:
                        since = time.time()  # wall-clock: compared across processes
                    self._write_state({"waiting_since": since, "wants": sorted(mine)})
                if first and on_wait is not None:
                    on_wait(share)
                if stop is not None and stop():
                    return None
                time.sleep(CPU_SHARE_POLL_S)
        finally:
            if self.held is None and since is not None and self._slot_fd is not None:
                with self._registry():
                    self._write_state({})

    def _lock_cores(self, cores: Sequence[PhysicalCore]) -> bool:
        fds: list[int] = []
        for core in cores:
            fd = self._open(f"core-{core.id}.lock")
            fds.append(fd)
            if not _try_lock(fd):
                for taken in fds:
                    os.close(taken)
                return False
        self._core_fds = fds
        return True

    def release(self) -> None:
        """Let go of the cores (the probe ended)."""
        fds, self._core_fds, self.held = self._core_fds, [], None
        for fd in fds:
            os.close(fd)

    def close(self) -> None:
        """Release the cores and the slot: this worker no longer counts."""
        self.release()
        if self._slot_fd is not None:
            os.close(self._slot_fd)
        self._slot_fd = self.slot = None


def claim_cpu_share(options: WorkerOptions) -> CpuShare | None:
    """A CPU worker's share of the host's cores (`CpuShare`, claimed), or None: not --device cpu, or
    --threads given (the operator's number, as before), or the registry cannot be written (said)."""
    if options.device != "cpu" or options.threads is not None:
        return None
    share = CpuShare()
    try:
        return share.claim()
    except OSError as e:
        log.warning("could not register in the CPU workers' registry %s (%s): probes run at torch's default "
                    "threads; pass --threads to choose", share.root, e)
        return None


def pin_process(pid: int, cpus: Collection[int]) -> bool:
    """Pin every thread of process `pid` to `cpus`; the threads and processes it starts later
    inherit that. False (logged) when the kernel refused it, or the platform cannot."""
    if not hasattr(os, "sched_setaffinity"):
        return False
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    pinned = True
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            continue  # the thread (or the child) is gone already
        except OSError as e:
            log.warning("could not pin probe %d to CPUs %s: %s", pid, format_cores(sorted(cpus)), e)
            pinned = False
    return pinned


# --- the probe child -----------------------------------------------------------------------------


class ProbeProcess:
    """One running probe child: its stdout protocol lines arrive on `events`, its stderr
    is kept as a tail. The child leads its own process group; `kill` ends the whole group
    (DataLoader workers, compile workers), so no orphans remain.

    With a `job_dir` the child is a distributed launcher (`autotune.engine.distributed`): the job
    is in the directory (not on stdin), a stop request is its stop file, and a kill also ends
    the process group of every rank (each rank leads its own session)."""

    def __init__(self, argv: list[str], job: ChildJob, env: Mapping[str, str], job_dir: Path | None = None,
                 server: ForkServer | None = None, events: queue.Queue[tuple[str, Any]] | None = None,
                 cpus: Collection[int] | None = None) -> None:
        self.events: queue.Queue[tuple[str, Any]] = events if events is not None else queue.Queue()
        self._stderr: collections.deque[str] = collections.deque(maxlen=200)
        self.job_dir = job_dir
        self.proc = self._start(argv, env, server)
        if cpus:  # before the job is written: the child waits for it, and its torch threads come later
            pin_process(self.proc.pid, cpus)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        if job_dir is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write(job.to_json().encode())  # small: fits the pipe buffer, never blocks
                self.proc.stdin.close()
            except BrokenPipeError:
                pass  # the child died at once; its exit status tells why
        self._out = threading.Thread(target=self._read_stdout, args=(self.proc.stdout,), daemon=True,
                                     name=f"probe-{self.proc.pid}-stdout")
        self._err = threading.Thread(target=self._read_stderr, args=(self.proc.stderr,), daemon=True,
                                     name=f"probe-{self.proc.pid}-stderr")
        self._out.start()
        self._err.start()

    def _start(self, argv: list[str], env: Mapping[str, str], server: ForkServer | None
               ) -> subprocess.Popen[bytes] | ForkedChild:
        """Fork the child from `server` when it runs exactly what the server serves (the probe
        child, in the server's environment); else, or when the server cannot, start it cold."""
        if (server is not None and self.job_dir is None and argv[:1] == [server.python]
                and without_secrets(env) == server.env):
            first = server.down is None
            try:
                return server.popen(argv[1:])
            except ForkServerError as exc:
                if first:  # said once: later trials start cold without a word
                    log.warning("the fork server cannot start probes (%s): they start cold from now on", exc)
        return subprocess.Popen(argv, stdin=subprocess.PIPE if self.job_dir is None else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=without_secrets(env),
                                start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read_stdout(self, stream: IO[bytes]) -> None:
        for raw in stream:
            line = raw.decode("utf-8", "replace").strip()
            if not line:
                continue
            try:
                message = json.loads(line)
            except ValueError:
                self._stderr.append(f"[stdout] {line}")
                continue
            kind = message.get("type") if isinstance(message, dict) else None
            if kind == "report" and isinstance(message.get("metrics"), dict):
                self.events.put(("report", message))
            elif kind == "progress" and isinstance(message.get("phase"), str):
                self.events.put(("progress", message))
            elif kind == "result" and isinstance(message.get("result"), dict):
                self.events.put(("result", message["result"]))
            else:
                self._stderr.append(f"[stdout] {line}")
        self.events.put(("eof", None))

    def _read_stderr(self, stream: IO[bytes]) -> None:
        for raw in stream:
            line = raw.decode("utf-8", "replace").rstrip()
            self._stderr.append(line)
            log.debug("probe %d: %s", self.proc.pid, line)

    def stderr_tail(self, chars: int = STDERR_TAIL_CHARS) -> str:
        if self.proc.poll() is not None:
            self._err.join(timeout=1.0)  # let the reader take the last lines
        text = "\n".join(self._stderr).strip()
        return text[-chars:]

    def poll(self) -> int | None:
        return self.proc.poll()

    def signal_child(self, signum: int) -> None:
        """Send `signum` to the child only (not its DataLoader workers)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signum)

    def request_stop(self) -> None:
        """Ask the probe to stop at its next window boundary (prune): SIGTERM to a single
        child; the stop file of a distributed one (its launcher takes SIGTERM as "kill")."""
        if self.job_dir is not None:
            request_stop(self.job_dir)
        else:
            self.signal_child(signal.SIGTERM)

    def kill_group(self) -> None:
        """SIGKILL the child's whole process group, and every rank's of a distributed probe
        (harmless when they are already gone)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.job_dir is not None:
            kill_ranks(self.job_dir)

    def stop(self, grace_s: float) -> None:
        """SIGTERM the child, give it `grace_s` to exit, then SIGKILL its group; reap it."""
        self.signal_child(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace_s)
        self.finish()

    def finish(self) -> int:
        """Kill what is left of the group, reap the child, let the readers drain; its exit status."""
        self.kill_group()
        returncode = self.proc.wait()
        if self.job_dir is not None:
            kill_ranks(self.job_dir)  # a rank whose pid file appeared while the launcher died
        self._out.join(timeout=5.0)
        self._err.join(timeout=5.0)
        return returncode


# --- the courier: reports and heartbeats off the monitor's path -----------------------------------


class Courier:
    """Carries one trial's reports and heartbeats to the service, on a thread of its own.

    Why a thread: the monitor must keep draining the child's stdout whatever the service does.
    Forwarded inline, each report waited out its retries while the service was down (up to
    5 s each), so the monitor fell behind the probe: the trial took seconds longer per report,
    the hard deadline could fire on a probe that had long finished, and the worker could act
    on a prune or stop only after the backlog. `post` never blocks: it queues the report,
    keeping at most `max_pending` (the oldest are dropped and counted: a late prune is fine,
    a stalled monitor is not). Decisions (`decisions`: prune, stop, conflict) are set here and
    acted on by the monitor, which `wake` nudges; the child is only ever handled there.

    While the service is away a report is retried (kept at the head of the queue) after each
    failed try's budget plus AWAY_PAUSE_S; heartbeats go on at their interval. `close` gives
    the queue COURIER_CLOSE_S to reach a service that answers, then abandons the thread
    (whatever it would still send is not wanted)."""

    def __init__(self, client: Client, trial_id: int, worker_id: str, heartbeat_s: float,
                 wake: Callable[[], None] = lambda: None, max_pending: int = MAX_PENDING_REPORTS,
                 lease_token: str | None = None) -> None:
        self.client = client
        self.trial_id = trial_id
        self.worker_id = worker_id
        # the lease's token goes with every call (the service takes them only for that lease); none: not sent
        self._token_kw: dict[str, Any] = {"lease_token": lease_token} if lease_token is not None else {}
        self.heartbeat_s = heartbeat_s
        self.budget_s = min(heartbeat_s, 5.0)  # one call's retries
        self.wake = wake
        self.max_pending = max_pending
        self._cond = threading.Condition()
        self._pending: collections.deque[dict[str, Any]] = collections.deque()
        self._closing = False
        self._done = False
        self._away = False  # the last call did not reach the service
        self._retry_at = 0.0
        self._abort = threading.Event()  # ends the call in flight (close, while the service is away)
        self.sent = 0  # reports the service took
        self.dropped = 0  # reports dropped: the queue was full, or the service refused them
        self.peak_pending = 0
        self.heartbeats = 0
        self.prune: tuple[int, str] | None = None  # (step, reason): the service said prune
        self.stop: str | None = None  # the heartbeat said stop (why)
        self.conflict: str | None = None  # 409: the trial is no longer ours (the service's words)
        self._thread = threading.Thread(target=self._run, name=f"courier-{trial_id}", daemon=True)

    def start(self) -> Courier:
        self._thread.start()
        return self

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._pending)

    def decisions(self) -> tuple[tuple[int, str] | None, str | None, str | None]:
        """(prune, stop, conflict) as decided so far."""
        with self._cond:
            return self.prune, self.stop, self.conflict

    def post(self, report: dict[str, Any]) -> None:
        """Queue `report` for the service; never blocks."""
        with self._cond:
            if self._done or self.prune is not None:
                return  # pruned or no longer ours: reports are not wanted any more
            self._pending.append(report)
            while len(self._pending) > self.max_pending:
                self._pending.popleft()
                self.dropped += 1
            self.peak_pending = max(self.peak_pending, len(self._pending))
            self._cond.notify()

    def close(self, wait_s: float | None = None) -> None:
        """Stop: hand in the queued reports while the service answers, for up to `wait_s`
        (default COURIER_CLOSE_S); a call still retrying for a service that is away is
        abandoned at once."""
        wait_s = COURIER_CLOSE_S if wait_s is None else wait_s
        with self._cond:
            self._closing = True
            if self._away:
                self._abort.set()
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(wait_s)
        self._abort.set()
        with self._cond:
            self._done = True
            self.dropped += len(self._pending)
            self._pending.clear()

    def _next(self, next_heartbeat: float) -> tuple[str, dict[str, Any] | None]:
        """Wait for the next thing to send: ("heartbeat", None), ("report", r) or ("end", None)."""
        with self._cond:
            while True:
                if self._done:
                    return "end", None
                now = time.monotonic()
                if self._closing:
                    if self._pending and not self._away and self.prune is None:
                        return "report", self._pending.popleft()
                    return "end", None
                if now >= next_heartbeat:
                    return "heartbeat", None
                if self._pending and now >= self._retry_at:
                    return "report", self._pending.popleft()
                until = next_heartbeat if not self._pending else min(next_heartbeat, self._retry_at)
                self._cond.wait(max(0.0, until - now))

    def _run(self) -> None:
        next_heartbeat = time.monotonic() + self.heartbeat_s
        while True:
            what, report = self._next(next_heartbeat)
            if what == "end":
                return
            if what == "heartbeat":
                next_heartbeat = time.monotonic() + self.heartbeat_s
                self._heartbeat()
            else:
                assert report is not None
                self._report(report)

    def _decide(self, **decision: Any) -> None:
        with self._cond:
            for name, value in decision.items():
                if getattr(self, name) is None:
                    setattr(self, name, value)
            if self.stop is not None or self.conflict is not None:
                self._done = True
            self.dropped += len(self._pending)
            self._pending.clear()
        self.wake()

    def _unreachable(self, what: str, error: ServiceUnavailable) -> None:
        with self._cond:
            if not self._away:
                log.warning("%s for trial %d waits: %s (the probe goes on; reports are kept, at most %d)",
                            what, self.trial_id, error, self.max_pending)
            self._away = True
            self._retry_at = time.monotonic() + AWAY_PAUSE_S

    def _reached(self) -> None:
        with self._cond:
            if self._away:
                log.warning("the service takes trial %d's reports and heartbeats again", self.trial_id)
            self._away = False

    def _heartbeat(self) -> None:
        try:
            reply = self.client.heartbeat(self.trial_id, self.worker_id, retry_for_s=self.budget_s,
                                          interruptible=True, cancel=self._abort, **self._token_kw)
        except ServiceUnavailable as e:
            self._unreachable("the heartbeat", e)
            return
        except Conflict as e:
            self._decide(conflict=e.message)
            return
        except ApiError as e:
            log.warning("heartbeat for trial %d refused: %s", self.trial_id, e)
            return
        self._reached()
        self.heartbeats += 1
        if reply.action == "stop":
            self._decide(stop=reply.reason or "the service said stop")

    def _report(self, report: dict[str, Any]) -> None:
        metrics = {k: float(v) for k, v in report["metrics"].items() if isinstance(v, (int, float))}
        step = int(report["step"])
        try:
            reply = self.client.report(self.trial_id, self.worker_id, step, metrics, retry_for_s=self.budget_s,
                                       interruptible=True, cancel=self._abort, **self._token_kw)
        except ServiceUnavailable as e:
            with self._cond:  # back at the head of the queue, if the queue has room
                if not self._done and self.prune is None and len(self._pending) < self.max_pending:
                    self._pending.appendleft(report)
                else:
                    self.dropped += 1
            self._unreachable("a report", e)
            return
        except Conflict as e:
            self._decide(conflict=e.message)
            return
        except ApiError as e:
            log.warning("report for trial %d refused: %s", self.trial_id, e)
            with self._cond:
                self.dropped += 1
            return
        self._reached()
        with self._cond:
            self.sent += 1
        if reply.prune:
            self._decide(prune=(step, reply.reason or "pruned"))


# --- outcomes ------------------------------------------------------------------------------------


@dataclass
class TrialRun:
    """What happened to one leased trial while its child ran."""

    lease: TrialLease
    service_id: str | None = None  # the id of the service that leased it (None: unknown)
    started: float = field(default_factory=time.monotonic)
    reports: list[dict[str, Any]] = field(default_factory=list)
    result: dict[str, Any] | None = None
    returncode: int | None = None
    prune_reason: str | None = None
    stop_reason: str | None = None  # the service said stop (heartbeat)
    interrupted_by: str | None = None  # SIGINT / SIGTERM name
    timed_out: bool = False
    dropped: str | None = None  # why the trial is no longer ours (no complete)
    rank_failure: dict[str, Any] | None = None  # a distributed probe's earliest rank failure record
    courier: Courier | None = None  # carried its reports and heartbeats
    child_ended: float | None = None  # monotonic time the monitor saw the child's stdout end
    progress: dict[str, Any] | None = None  # the probe's last progress message (phase, samples, ETA)

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started


def progress_text(lease: TrialLease, elapsed_s: float, progress: dict[str, Any] | None) -> str:
    """Where a trial's probe is, in one line (`describe_progress`), with the seconds so far."""
    return f"trial {lease.number} of {lease.study}: {describe_progress(progress)} ({elapsed_s:.0f} s)"


def describe_progress(progress: Mapping[str, Any] | None) -> str:
    """A probe's progress message (autotune.engine.probe.ProgressCallback) in words: its phase, samples
    done of all, the timed window, the ETA of its training (validation not counted)."""
    if not progress:
        return "starting"
    phase = str(progress.get("phase"))
    parts = [phase if phase != "window" else f"timed window {progress.get('window')} of {progress.get('windows')}"]
    if phase == "warm-up" and progress.get("steps"):
        parts[0] += f" ({progress['steps']} steps: compile, autotuning)"
    if phase == "timed windows" and progress.get("windows"):
        parts[0] += f" ({progress['windows']}; warm-up took {float(progress.get('warmup_s') or 0):.1f} s)"
    done, total = progress.get("samples"), progress.get("total_samples")
    if isinstance(done, int) and isinstance(total, int) and total > 0:
        parts.append(f"{done:,} of {total:,} samples")
    eta = progress.get("eta_s")
    if isinstance(eta, (int, float)):
        parts.append(f"training ETA {eta:.0f} s")
    return " · ".join(parts)


def minimal_result(lease: TrialLease, hardware: Hardware, failure: dict[str, str] | None,
                   **fields: Any) -> dict[str, Any]:
    """A ProbeResult dict for a trial whose child gave none: workload, preset, config, device,
    torch_version and the failure always present."""
    from autotune.engine.probe import ProbeResult  # imports torch (CPU side only: no CUDA context)

    result = ProbeResult(workload=lease.workload, preset=lease.preset, config=dict(lease.config),
                         device=hardware.device_name, torch_version=hardware.torch_version, failure=failure)
    for name, value in fields.items():
        setattr(result, name, value)
    return result.to_dict()


def partial_result(run: TrialRun, hardware: Hardware) -> dict[str, Any]:
    """A stopped_early result from the reports a pruned child sent before it was killed."""
    throughputs = [float(r["metrics"]["throughput"]) for r in run.reports if "throughput" in r["metrics"]]
    curve = [(int(r["metrics"].get("samples", 0)), float(r["metrics"]["loss"])) for r in run.reports
             if "loss" in r["metrics"]]
    fields: dict[str, Any] = {"stopped_early": True, "window_throughputs": throughputs, "loss_curve": curve}
    if throughputs:
        rate, spread = window_rate(throughputs)  # as the probe's own (autotune.engine.probe)
        fields.update(throughput_samples_per_s=rate, throughput_spread=spread)
    if run.reports:
        last = run.reports[-1]
        fields.update(steps=int(last["step"]), samples_trained=int(last["metrics"].get("samples", 0)))
    return minimal_result(run.lease, hardware, None, **fields)


def final_result(run: TrialRun, hardware: Hardware, stderr_tail: str) -> dict[str, Any]:
    """The result to complete `run`'s trial with. The child's own result wins when it gave
    one (marked stopped_early if the trial was pruned); otherwise, by precedence: the worker
    was interrupted, the service said stop, the hard timeout, pruned (a partial result from
    the reports), a rank of a distributed probe failed (its record), the child died."""

    def failed(kind: str, message: str) -> dict[str, Any]:
        return minimal_result(run.lease, hardware, {"kind": kind, "message": message})

    if run.result is not None:
        if run.prune_reason is not None and not run.result.get("failure"):
            return {**run.result, "stopped_early": True}
        return run.result
    if run.interrupted_by:
        return failed("interrupted", f"worker interrupted by {run.interrupted_by}")
    if run.stop_reason:
        return failed("error", f"stopped by the service: {run.stop_reason}")
    if run.timed_out:
        timeout = run.lease.probe.timeout_s
        return failed("timeout", f"probe exceeded its hard limit of {timeout:g} s "
                                 f"(+{hard_timeout_grace_s(timeout):g} s grace) and was killed")
    if run.prune_reason is not None:
        return partial_result(run, hardware)
    if run.rank_failure is not None:  # a rank failed: the launcher ended the others; its record says why
        return run.rank_failure
    why = describe_exit(run.returncode if run.returncode is not None else -1)
    return failed("error", f"{why}; stderr tail:\n{stderr_tail}" if stderr_tail else why)


# --- display -------------------------------------------------------------------------------------


def format_params(params: Mapping[str, Any], limit: int = 8) -> str:
    items = [f"{k}={v}" for k, v in list(params.items())[:limit]]
    if len(params) > limit:
        items.append("…")
    return " ".join(items) or "(defaults)"


def summarize_result(result: Mapping[str, Any]) -> str:
    """One line: throughput · NRMSE, or the failure, or pruned."""
    failure = result.get("failure")
    if failure:
        message = str(failure.get("message", "")).splitlines()[0][:300] if failure.get("message") else ""
        return f"[red]FAIL {escape(str(failure.get('kind')))}[/]: {escape(message)}"
    thr = result.get("throughput_samples_per_s")
    thr_text = f"{thr:,.1f} samples/s" if isinstance(thr, (int, float)) else "- samples/s"
    if result.get("stopped_early"):
        return f"[yellow]PRUNED[/] ({thr_text} before it stopped)"
    nrmse = result.get("quality", result.get("val_nrmse"))
    label = "NRMSE" if result.get("quality_metric", "val_nrmse") == "val_nrmse" else str(result["quality_metric"])
    nrmse_text = f"{escape(label)} {nrmse:.4f}" if isinstance(nrmse, (int, float)) else f"{escape(label)} -"
    warm = result.get("warmup_s")
    warm_text = f" · warm-up {warm:.2f} s" if isinstance(warm, (int, float)) else ""
    return f"[green]{thr_text}[/] · {nrmse_text}{warm_text}"


# --- the worker ----------------------------------------------------------------------------------


class Worker:
    """The lease → probe → complete loop of one device (see the module docstring)."""

    def __init__(self, options: WorkerOptions, hardware: Hardware, client: Client | None = None,
                 console: Console | None = None, group: DeviceGroup | None = None,
                 worker_id_suffix: str | None = None, fork_server: ForkServer | None = None,
                 cpu_share: CpuShare | None = None) -> None:
        self.options = options
        self.cpu_share = cpu_share  # this worker's share of the host's cores (`claim_cpu_share`; None: --threads)
        self._shown_share: CoreShare | None = None
        self.fork_server = fork_server  # where its probe children are forked from (None: started cold)
        self.hardware = hardware
        self.group = group or DeviceGroup((hardware.device,) * options.gpus_per_trial)
        base = options.worker_id or default_worker_id(hardware.device if self.group.world_size == 1
                                                      else self.group.name)
        self.worker_id = f"{base}-{worker_id_suffix}" if worker_id_suffix else base
        self.show_status = True  # a live status line (off when several groups share the console)
        self.stop_event = threading.Event()
        self.client = client or Client(options.api, options.token, retry_for_s=None, cancel=self.stop_event)
        self.console = console or Console(soft_wrap=True, highlight=False)
        self.spool = Spool(options.spool_dir or default_spool_dir())
        self._spool_later: dict[Path, float] = {}  # spooled results the service would not take yet → when to retry
        self._spool_said: set[tuple[Path, str]] = set()  # (file, why) kept-notices said once
        self._later_for: str | None = None  # the service id that `_spool_later` was decided by
        self._elsewhere_for: str | None = None  # the service id other services' results were last counted for
        self.service_id: str | None = None  # the service's id as of the last lease (GET /v1/health; None: unknown)
        self.signal_name: str | None = None
        self.signal_number: int | None = None
        self.allowed = options.allowed_workloads()
        export_workload_paths(options.workload_paths())  # the children resolve NAME=module:attr entries
        self.trials_done = 0
        self.current: ProbeProcess | None = None
        self.skip_notice = SkipNotice()  # shared by the loops of one process (run_worker)

    # --- signals --------------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self.signal_name is not None:  # a second signal: stop waiting for anything
            raise KeyboardInterrupt
        self.signal_number = signum
        self.signal_name = signal.Signals(signum).name
        self.stop_event.set()

    # --- the loop -------------------------------------------------------------------------------

    def announce(self) -> None:
        hw = self.hardware
        if hw.device.startswith("cuda"):
            mem = f", {hw.memory_bytes / 2**30:.1f} GiB" if hw.memory_bytes else ""
            device = f"GPU {hw.device_name}{mem} ({hw.device})"
        else:
            device = hw.device_name
        if self.group.world_size > 1:
            kind = "GPUs" if self.group.is_cuda else "gloo processes on the cpu"
            device = f"{device} · {self.group.world_size} {kind} per trial ({self.group.name})"
        self.console.print(f"[bold]autotune worker[/] {self.worker_id}")
        self.console.print(f"  device   {device}")
        cpu = f" · {escape(hw.cpu_model)}, {hw.cpu_count} cores" if hw.cpu_model else ""  # host-bound configs follow it
        self.console.print(f"  hardware class [bold]{hw.hardware_class}[/] · torch {hw.torch_version} · "
                           f"host {hw.hostname}{cpu}")
        threads = self.options.threads or ("core share" if self.cpu_share is not None else "torch default")
        self.console.print(f"  service  {self.client.base_url} · study {self.options.study or 'any'} · "
                           f"threads {threads} · heartbeat {self.options.heartbeat_s:g} s")
        if self.cpu_share is not None:
            try:
                self._shown_share = share = self.cpu_share.current()
            except OSError as e:  # said; each probe tries the registry again
                self.console.print(f"  [yellow]cpu: the CPU workers' registry {escape(str(self.cpu_share.root))} "
                                   f"failed ({escape(str(e))})[/]")
            else:
                self.console.print(f"  cpu: {share.describe(omp_threads_cap())} · the CPU workers of this host "
                                   f"split its cores, again before each probe (registry "
                                   f"{escape(str(self.cpu_share.root))}; --threads N: no share)")
        missing = [name for name in self.allowed if name not in registered_workloads()]
        note = f" [yellow](not installed here: {escape(', '.join(missing))}; their trials are refused)[/]" \
            if missing else ""
        self.console.print(f"  workloads {escape(', '.join(self.allowed) or 'none')} (--allow-workload){note}")
        self.console.print(f"  spool    {escape(str(self.spool.root))} (results not yet delivered; --spool-dir)")
        pending = self.spool.pending()
        mine = [e for e in pending if e.api == self.client.base_url]
        if mine:
            self.console.print(f"  [yellow]{len(mine)} undelivered result(s) for this service in the spool[/] "
                               f"({escape(', '.join(e.label for e in mine[:5]))}{', …' if len(mine) > 5 else ''}): "
                               "delivering them before any new trial")
        others = [e for e in pending if e.api != self.client.base_url]
        if others:  # one line: which services, and the command that shows them
            names = escape(services_named(others))
            self.console.print(f"  {len(others)} spooled result(s) for other services ({names}) are left for workers "
                               f"with that --api: {escape(spool_command(self.spool.root))}")

    def run(self) -> int:
        """Serve trials until told to stop; the exit status (128 + signal when interrupted,
        UNREACHABLE_EXIT when --idle-exit ran out without a reachable service)."""
        self.announce()
        idle_since: float | None = None
        unreachable_since: float | None = None  # when the lease calls started failing
        delay = IDLE_BACKOFF_START_S
        waiting_shown = False
        skips_checked: float | None = None  # when the running studies were last read (None: this idle spell: not yet)
        request = LeaseRequest(worker_id=self.worker_id, hardware=self.hardware.hardware_class,
                               study=self.options.study, workloads=list(self.allowed),
                               gpus_per_trial=self.group.world_size)
        try:
            while not self.stop_event.is_set():
                if self.options.max_trials is not None and self.trials_done >= self.options.max_trials:
                    # the last results first: wait for the service as long as --idle-exit allows (default: until
                    # it answers or a signal comes), as a worker's complete always did
                    self.deliver_spool(retry_for_s=self.options.idle_exit_s)
                    self.console.print(f"done: {self.trials_done} trial(s) (--max-trials)")
                    self.say_spool_left()
                    return 0
                if unreachable_since is None:  # a service that does not answer is not asked twice per round
                    self.deliver_spool()
                budget = LEASE_RETRY_S
                if self.options.idle_exit_s is not None:
                    idle = 0.0 if idle_since is None else time.monotonic() - idle_since
                    budget = min(budget, max(0.5, self.options.idle_exit_s - idle))
                asked = time.monotonic()
                try:
                    lease = self.client.lease(request, retry_for_s=budget, interruptible=True)
                except ServiceUnavailable as e:
                    if self.stop_event.is_set():
                        break  # interrupted while the service was away
                    now = time.monotonic()
                    unreachable_since = unreachable_since or asked
                    idle_since = idle_since or asked
                    if self.options.idle_exit_s is not None and now - idle_since >= self.options.idle_exit_s:
                        self.console.print(
                            f"[bold red]error:[/] could not reach the autotune service at "
                            f"{escape(self.client.base_url)} for {now - unreachable_since:.0f} s "
                            f"({escape(e.cause)}); --idle-exit {self.options.idle_exit_s:g} s ran out: exiting "
                            f"after {self.trials_done} trial(s). Check that the service runs (autotune serve) "
                            "and that --api names its address")
                        self.say_spool_left()
                        return UNREACHABLE_EXIT
                    continue  # the lease call waited (its backoff) already
                except Conflict as e:  # the service refused a second lease for this worker: ask again
                    log.warning("lease refused: %s", e.message)
                    self.stop_event.wait(1.0)
                    continue
                except (NotFound, Unauthorized, Invalid) as e:
                    message = unauthorized_hint(self.client.base_url, f"HTTP {e.status_code}: {e.message}") \
                        if isinstance(e, Unauthorized) else e.message
                    self.console.print(f"[bold red]error:[/] the service refused the lease: {escape(message)}")
                    self.say_spool_left()
                    return 2 if isinstance(e, Invalid) else 1
                if lease is not None:
                    self.learn_service_id(lease)
                if unreachable_since is not None:
                    self.console.print(f"the service at {escape(self.client.base_url)} answers again (away "
                                       f"{time.monotonic() - unreachable_since:.0f} s)")
                    unreachable_since = None
                    self._spool_later.clear()  # maybe another service (database) now: offer everything again
                    self.deliver_spool()
                if lease is not None and self._deliver_instead(lease):
                    continue  # measured already: its spooled result went in (or waits for the service)
                if lease is None:
                    now = time.monotonic()
                    if idle_since is None:
                        idle_since = now
                    if not waiting_shown:
                        self.console.print("waiting for trials…")
                        waiting_shown = True
                    if skips_checked is None or now - skips_checked >= SKIPPED_RECHECK_S:
                        skips_checked = now
                        self.show_skipped_studies()
                    idle = now - idle_since
                    if self.options.idle_exit_s is not None and idle >= self.options.idle_exit_s:
                        self.console.print(f"idle for {idle:.0f} s: exiting after {self.trials_done} trial(s)")
                        self.say_spool_left()
                        return 0
                    wait = delay
                    if self.options.idle_exit_s is not None:
                        wait = min(wait, max(0.05, self.options.idle_exit_s - idle))
                    self.stop_event.wait(wait)
                    delay = min(delay * 2, IDLE_BACKOFF_CAP_S)
                    continue
                idle_since, delay, waiting_shown, skips_checked = None, IDLE_BACKOFF_START_S, False, None
                self.run_trial(lease)
                self.trials_done += 1
        except KeyboardInterrupt:
            if self.current is not None:
                self.current.finish()
        if self.signal_number is not None:
            self.console.print(f"stopped by {self.signal_name} after {self.trials_done} trial(s)")
            self.say_spool_left()
            return 128 + self.signal_number
        return 0

    def show_skipped_studies(self) -> None:
        """Say which running studies the service will not offer this worker, and why; each
        distinct set once (`SkipNotice`). A hint only: when the studies cannot be read (the
        service is away, an older service, a test's fake client), it says nothing."""
        try:
            path = "/v1/studies" if self.options.study is None else f"/v1/studies/{self.options.study}"
            reply = self.client.request("GET", path, retry_for_s=SKIPPED_LIST_RETRY_S).json()
            studies = reply.get("data") if self.options.study is None else [reply]
        except Exception as e:  # a hint must never stop the worker
            log.debug("could not read the studies for the idle hint: %s", e)
            return
        skipped = skipped_studies(studies, self.hardware.hardware_class, self.allowed, self.group.world_size,
                                  self.options.study)
        if not self.skip_notice.fresh(skipped):
            return
        count = f"{len(skipped)} running stud{'y' if len(skipped) == 1 else 'ies'}"
        self.console.print(f"[yellow]{count} this worker cannot take[/] (its hardware class "
                           f"{escape(repr(self.hardware.hardware_class))}, gpus_per_trial {self.group.world_size}):")
        for s in skipped:
            self.console.print(f"  {escape(s.name)} (hardware {escape(repr(s.hardware))}): {escape(s.reason)}")

    # --- the spool ------------------------------------------------------------------------------

    def learn_service_id(self, lease: TrialLease | None = None) -> str | None:
        """Keep the id of the service that made `lease` (the lease names it: `TrialLease.service_id`),
        else ask the service for its id (GET /v1/health: an older service's lease names none);
        None (unknown: its results are matched by URL, study and lease token) when the service
        shows none or does not answer now. Never the id of before: a restart may have changed it."""
        if lease is not None and lease.service_id:
            self.service_id = lease.service_id
            return self.service_id
        try:
            self.service_id = service_identity(self.client, SPOOL_RETRY_S)
        except ServiceUnavailable as e:
            log.warning("could not ask the service for its id (%s): this trial's result is matched by URL", e)
            self.service_id = None
        return self.service_id

    def _services(self, service_id: str | None) -> Services:
        """The spool folders this worker reads for a service that shows `service_id`: that
        service's and the top (an unknown service's, and an older worker's); all where the id is
        unknown (matched by URL)."""
        return None if service_id is None else (service_id, None)

    def deliver_spool(self, retry_for_s: float | None = SPOOL_RETRY_S) -> bool:
        """Hand in the spooled results of this service, oldest first (`autotune.worker.spool.deliver_entries`),
        each only if it belongs here: the service shows the entry's service id, and its study
        holds the trial (`autotune.worker.spool.misplaced`). Only this service's folder of the spool
        (and its top) is read; the results of other services leased at this URL (the service
        restarted on another database) are counted in one line, once per service answering.
        False when the service could not be reached (the rest wait for the next round). A
        result the service would not take yet (401, a trial it does not know, another
        service's) is offered again after SPOOL_RECHECK_S; a 401 ends the round (no other
        delivery would fare better)."""
        pending = self.spool.pending(self.client.base_url, self._services(self.service_id))
        if not pending and self.service_id == self._elsewhere_for:
            return True
        try:
            current = service_identity(self.client, retry_for_s)
        except ServiceUnavailable:
            return False
        if current != self._later_for:  # another service answers now: what the last one would not take may go in
            self._spool_later.clear()
            self._later_for = current
        if current != self._elsewhere_for:
            self._elsewhere_for = current
            self._say_elsewhere(current)
        if current != self.service_id:
            pending = self.spool.pending(self.client.base_url, self._services(current))
        now = time.monotonic()
        entries = [e for e in pending if e.path is None or self._spool_later.get(e.path, 0.0) <= now]
        for entry, outcome in deliver_entries(self.spool, self.client, entries, current, retry_for_s):
            self._say_delivery(entry, outcome, spooled=True)
            if outcome.status == "unreachable":
                return False
            if outcome.status == "kept" and entry.path is not None:
                self._spool_later[entry.path] = now + SPOOL_RECHECK_S
                if outcome.unauthorized:
                    break
        return True

    def _say_elsewhere(self, current: str | None) -> None:
        """One line on the results in the spool that were leased at this URL from another service
        than `current` (its folder is not read by the delivery rounds): they wait for it."""
        if current is None:
            return
        elsewhere = [e for e in self.spool.pending(self.client.base_url) if e.service_id not in (None, current)
                     and e.path is not None and e.path.parent != self.spool.root]  # the top's are said one by one
        if elsewhere:
            self.console.print(f"  [yellow]{len(elsewhere)} spooled result(s) of {escape(services_named(elsewhere))} "
                               f"wait for that service[/]: the service at {escape(self.client.base_url)} is service "
                               f"{escape(current)} now (another database); they are delivered when theirs answers "
                               f"there again: {escape(spool_command(self.spool.root))}")

    def _deliver_instead(self, lease: TrialLease) -> bool:
        """True when `lease` is a trial this worker must not run: its result is in the spool (the
        service handed back the lease it still holds; the result is delivered instead), or was
        just delivered from the spool (the lease came back before the delivery ended it). A
        spooled result of the same trial id in another study or service is another trial's, and
        so is one of another lease (its lease token is not this lease's: a backup of the database
        holds the same service id, study and trial number): this lease is run, and the kept
        result waits for the service it was leased from."""
        label = f"trial {lease.number} of {lease.study} (id {lease.trial_id})"
        if self.spool.settled(self.client.base_url, self.worker_id, lease.trial_id, lease.study, lease.number,
                              self.service_id, lease_token=lease.lease_token):
            self.console.print(f"  {escape(label)}: its result was delivered from the spool just now: "
                               "not run again (a lease of it handed out before the delivery)")
            self.stop_event.wait(1.0)  # the service ends the lease with the delivery; should it not, ask later
            return True
        entry = next((e for e in self.spool.pending(self.client.base_url, self._services(self.service_id))
                      if e.worker_id == self.worker_id and
                      e.is_lease(lease.trial_id, lease.study, lease.number, self.service_id, lease.lease_token)),
                     None)
        if entry is None:
            return False
        self.console.print(f"  {escape(entry.label)}: measured already, its result is in the spool: delivering it "
                           "instead of running the trial again")
        with self.spool.claim(entry) as mine:
            if mine:
                self._say_delivery(entry, deliver(self.spool, self.client, entry, COMPLETE_RETRY_S,
                                                  interruptible=True), spooled=True)
        if entry.path is not None and entry.path.exists():
            self.stop_event.wait(1.0)  # still not taken: the loop tries again, without running it
        return True

    def _say_delivery(self, entry: SpoolEntry, outcome: Delivery, spooled: bool) -> None:
        """One line on what became of a result (`spooled`: an earlier result from the spool)."""
        what = f"spooled result of {entry.label}" if spooled else f"trial {entry.number}"
        where = escape(str(outcome.path)) if outcome.path is not None else "memory only: the spool could not be written"
        if outcome.status == "delivered":
            assert outcome.info is not None
            info = outcome.info
            feasible = {True: " · feasible", False: " · infeasible", None: ""}[info.feasible] \
                if info.state == "COMPLETE" else ""
            prefix = f"  {what} delivered" if spooled else f"  trial {entry.number}"
            self.console.print(f"{prefix} → {info.state}{feasible}")
        elif outcome.status == "already":
            self.console.print(f"  {what}: {escape(outcome.message)}; nothing more to deliver")
        elif outcome.status == "rejected" and outcome.path is None and not entry.measured:
            self.console.print(f"  {what}: not ours any more, dropped ({escape(outcome.message)})")
        elif outcome.status == "rejected":
            self.console.print(f"  [red]{what} not taken by the service[/]: {escape(outcome.message)}. The "
                               f"measurement is kept in {where}")
        elif outcome.status == "unreachable":
            if not spooled:
                self.console.print(f"  [yellow]{what}: the service did not answer[/] ({escape(outcome.message)}); "
                                   f"the result is kept in {where} and delivered when the service at "
                                   f"{escape(self.client.base_url)} answers again")
        else:  # kept
            key = (outcome.path or Path(), outcome.message)
            if key not in self._spool_said:
                self._spool_said.add(key)
                self.console.print(f"  [red]{what}: not delivered[/]: {escape(outcome.message)}. The result is kept "
                                   f"in {where}; it is offered again every {SPOOL_RECHECK_S:.0f} s")

    def say_spool_left(self) -> None:
        """Before exiting: what the spool still holds, and where."""
        pending = self.spool.pending(self.client.base_url)
        if pending:
            self.console.print(f"[yellow]{len(pending)} result(s) not delivered[/], kept in "
                               f"{escape(str(self.spool.root))} ({escape(', '.join(e.label for e in pending[:5]))}"
                               f"{', …' if len(pending) > 5 else ''}): a worker started with --spool-dir "
                               f"{escape(str(self.spool.root))} delivers them when the service at "
                               f"{escape(self.client.base_url)} answers ({escape(spool_command(self.spool.root))})")

    # --- one trial ------------------------------------------------------------------------------

    def run_trial(self, lease: TrialLease) -> TrialRun:
        """Run `lease`'s probe in a child, forward reports and heartbeats, then complete it."""
        run = TrialRun(lease, service_id=self.service_id)
        baseline = " [cyan](baseline)[/]" if lease.is_baseline else \
            " [cyan](re-measure)[/]" if lease.role == "remeasure" else ""
        self.console.print(f"▶ trial {lease.number} of {lease.study} (id {lease.trial_id}){baseline}: "
                           f"{format_params(lease.params)}")
        refused = refusal(lease.workload, self.allowed)
        if refused is not None:  # _complete prints the refusal
            self._complete(run, minimal_result(lease, self.hardware, {"kind": "refused", "message": refused}))
            return run
        world = self.group.world_size
        share = self._take_cores(run) if self.cpu_share is not None and self.signal_name is None else None
        threads = share.probe_threads(world, omp_threads_cap()) if share is not None else self.options.threads
        job = ChildJob(workload=lease.workload, preset=lease.preset, config=dict(lease.config),
                       device=self.hardware.device if world == 1 else ("cuda" if self.group.is_cuda else "cpu"),
                       probe=lease.probe.model_dump(mode="json"), threads=threads, world_size=world)
        job_dir: Path | None = None
        if self.signal_name is None and run.dropped is None and run.stop_reason is None:
            # one probe: the threads go in its job (its environment stays the fork server's)
            env = child_environment(threads if world > 1 else self.options.threads)
            argv = self.options.child_argv
            if world > 1:
                job_dir = prepare_job_dir(job.to_json())
                env[JOB_DIR_ENV] = str(job_dir)
                if self.group.is_cuda:
                    env["CUDA_VISIBLE_DEVICES"] = self.group.visible_devices()
                argv = self.options.launch_argv
            # the heartbeats start first: a worker's first probe waits for its fork server's preload
            # (seconds; minutes on a loaded host or a slow disk), and the lease must hold meanwhile
            events: queue.Queue[tuple[str, Any]] = queue.Queue()
            courier = Courier(self.client, lease.trial_id, self.worker_id, self.options.heartbeat_s,
                              wake=lambda: events.put(("wake", None)), lease_token=lease.lease_token)
            run.courier = courier.start()
            try:
                child = ProbeProcess(argv, job, env, job_dir=job_dir, server=self.fork_server, events=events,
                                     cpus=share.cpus if share is not None else None)
            except BaseException:
                courier.close()
                self._release_cores()
                raise
            self.current = child
            try:
                if self.console.is_terminal and self.show_status:
                    with self.console.status("") as status:
                        self._monitor(run, child, courier, lambda text: status.update(text))
                else:
                    self._monitor(run, child, courier, None)
            finally:
                run.returncode = child.finish()
                self._release_cores()
                self.current = None
                courier.close()
                if job_dir is not None:
                    run.rank_failure = collect_failure(job_dir)
                    shutil.rmtree(job_dir, ignore_errors=True)
            tail = child.stderr_tail()
            if courier.dropped:
                self.console.print(f"  trial {lease.number}: {courier.dropped} report(s) not delivered while the "
                                   "service was away (the result holds every timed window)")
        else:  # interrupted between lease and start (or while it waited for its cores), or stopped by the service then
            run.interrupted_by = self.signal_name
            tail = ""
        if run.dropped:
            self.console.print(f"  trial {lease.number}: dropped: {escape(run.dropped)}")
            entry = self._entry(run, final_result(run, self.hardware, tail))
            if run.result is not None and entry.measured:  # the child finished anyway: never throw a measurement away
                # a service that does not know the trial (or holds another lease of it) runs on another
                # database: the measurement waits in the spool for the leasing one
                # (`autotune.worker.spool.misplaced`), else rejected/
                foreign = "not leased by this service" in run.dropped or ANOTHER_LEASE in run.dropped
                try:
                    where = str(self.spool.put(entry) if foreign else self.spool.reject(entry, run.dropped))
                except OSError as e:
                    where = f"nowhere (the spool could not be written: {e})"
                self.console.print(f"  trial {lease.number}: its result is kept in {escape(where)}"
                                   + (f", for {escape(entry.home)}" if foreign else ""))
            else:
                self.spool.remove(entry)  # a failure record written ahead: it measured nothing
            return run
        result = final_result(run, self.hardware, tail)
        self._complete(run, result)
        return run

    def _take_cores(self, run: TrialRun) -> CoreShare | None:
        """Wait until this worker's share of the host's cores is free (`CpuShare.acquire`) and hold
        it for the probe; while it waits, heartbeats keep the lease. None when a signal came, or the
        service said stop or not ours (noted on `run`) meanwhile. The probe's time limit starts
        once it has its cores."""
        assert self.cpu_share is not None
        lease = run.lease
        courier: Courier | None = None

        def waiting(share: CoreShare) -> None:
            nonlocal courier
            self.console.print(f"  trial {lease.number}: waiting for CPU{'s' if len(share.cpus) != 1 else ''} "
                               f"{format_cores(share.cpus)} (another CPU worker's probe on this host runs there)")
            courier = Courier(self.client, lease.trial_id, self.worker_id, self.options.heartbeat_s,
                              lease_token=lease.lease_token).start()

        def cut_short() -> bool:
            if self.signal_name is not None:
                return True
            if courier is None:
                return False
            _, stop, conflict = courier.decisions()
            return stop is not None or conflict is not None

        try:
            share = self.cpu_share.acquire(stop=cut_short, on_wait=waiting)
        except OSError as e:  # the registry cannot be read or written: run this probe unpinned
            share = None
            self.console.print(f"  [yellow]trial {lease.number}: the CPU workers' registry "
                               f"{escape(str(self.cpu_share.root))} failed ({escape(str(e))}): this probe runs "
                               "on every core, at torch's default threads[/]")
        finally:
            if courier is not None:
                courier.close()
        if courier is not None:
            _, stop, conflict = courier.decisions()
            if conflict is not None:
                run.dropped = f"the service says the trial is no longer ours ({conflict})"
            elif stop is not None:
                run.stop_reason = stop
                self.console.print(f"  trial {lease.number}: the service said stop ({escape(stop)})")
        if share is not None and (run.dropped is not None or run.stop_reason is not None):
            self._release_cores()
            return None
        if share is not None:
            if share != self._shown_share:
                self._shown_share = share
                self.console.print(f"  cpu: now {share.describe(omp_threads_cap())} (CPU workers on this host "
                                   "started or stopped)")
            run.started = time.monotonic()
        return share

    def _release_cores(self) -> None:
        if self.cpu_share is not None:
            self.cpu_share.release()

    def _monitor(self, run: TrialRun, child: ProbeProcess, courier: Courier,
                 show: Callable[[str], None] | None) -> None:
        """Follow the child until it exits or must be stopped. Nothing here waits on the service
        (the courier does): the child's stdout is drained as fast as it comes."""
        lease = run.lease
        timeout = lease.probe.timeout_s
        hard_deadline = run.started + timeout + hard_timeout_grace_s(timeout)
        eof = False
        while True:
            if self.signal_name is not None:
                run.interrupted_by = self.signal_name
                child.stop(KILL_GRACE_S)
                return
            now = time.monotonic()
            if now >= hard_deadline:
                run.timed_out = True
                child.stop(KILL_GRACE_S)
                return
            if not self._act(run, child, courier):
                return
            if show is not None:  # a terminal: one live line
                last = run.reports[-1]["metrics"].get("throughput") if run.reports else None
                speed = f" · last window {last:,.1f} samples/s" if isinstance(last, (int, float)) else ""
                show(progress_text(lease, run.elapsed_s, run.progress) + speed)
            try:
                kind, payload = child.events.get(timeout=0.2)
            except queue.Empty:
                if child.poll() is not None and not eof:
                    # exited, but a grandchild may hold the pipe open: end the group so EOF comes
                    child.kill_group()
                continue
            if kind == "progress":
                phase = payload.get("phase")
                if show is None and phase != "window" and (run.progress or {}).get("phase") != phase:
                    # a log: one line per phase (a terminal's live line shows every window)
                    self.console.print(f"  {escape(progress_text(lease, run.elapsed_s, payload))}", highlight=False)
                run.progress = payload
            elif kind == "report":
                run.reports.append(payload)
                if run.prune_reason is None:
                    courier.post(payload)
            elif kind == "result":
                run.result = payload
                self._write_ahead(run)
            elif kind == "eof":
                eof = True
                run.child_ended = time.monotonic()
                run.returncode = child.finish()
                return

    def _act(self, run: TrialRun, child: ProbeProcess, courier: Courier) -> bool:
        """Carry out what the service decided (the courier's `decisions`); False when the child
        has been stopped for good (409: no longer ours; heartbeat: stop)."""
        prune, stop, conflict = courier.decisions()
        if conflict is not None:
            run.dropped = f"the service says the trial is no longer ours ({conflict})"
            child.stop(KILL_GRACE_S)
            return False
        if stop is not None:
            run.stop_reason = stop
            self.console.print(f"  trial {run.lease.number}: the service said stop ({escape(stop)})")
            child.stop(KILL_GRACE_S)
            return False
        if prune is not None and run.prune_reason is None:
            step, reason = prune
            run.prune_reason = reason
            self.console.print(f"  trial {run.lease.number}: pruned at step {step} ({escape(reason)})")
            # The child stops at its next window boundary and prints a stopped_early result;
            # a separate thread escalates to SIGKILL after the grace period.
            child.request_stop()
            threading.Thread(target=_kill_after, args=(child, PRUNE_GRACE_S), daemon=True).start()
        return True

    def _entry(self, run: TrialRun, result: dict[str, Any]) -> SpoolEntry:
        lease = run.lease
        entry = SpoolEntry(api=self.client.base_url, trial_id=lease.trial_id, worker_id=self.worker_id,
                           study=lease.study, number=lease.number, result=result, service_id=run.service_id,
                           lease_token=lease.lease_token)
        if self.spool.path_of(entry).exists():
            entry.path = self.spool.path_of(entry)  # written ahead (`_write_ahead`)
        return entry

    def _write_ahead(self, run: TrialRun) -> None:
        """Spool the child's result the moment it arrives: the worker may die (SIGKILL, OOM)
        before it completes the trial; the next worker on this spool then delivers it. The
        complete that follows rewrites the same file with the final result."""
        try:
            self.spool.put(self._entry(run, final_result(run, self.hardware, "")))
        except OSError as e:
            log.warning("could not write trial %d's result to the spool %s: %s", run.lease.trial_id,
                        self.spool.root, e)

    def _complete(self, run: TrialRun, result: dict[str, Any]) -> None:
        """Spool the result (write-ahead), then hand it in if the service is still the one that
        leased the trial (its id: a restart on another database during the probe goes unseen
        while the calls' retries last); the spool file goes once the service has it."""
        lease = run.lease
        retry = FINAL_COMPLETE_RETRY_S if self.signal_name is not None else COMPLETE_RETRY_S
        self.console.print(f"  trial {lease.number} ({run.elapsed_s:.1f} s): {summarize_result(result)}")
        for note in result.get("measurement_notes") or ():
            self.console.print(f"  [yellow]trial {lease.number}: {escape(str(note))}[/]")
        entry = self._entry(run, result)
        try:
            self.spool.put(entry)
        except OSError as e:
            self.console.print(f"  [yellow]trial {lease.number}: could not write the spool "
                               f"{escape(str(self.spool.root))} ({escape(str(e))})[/]: the result is only in "
                               "memory until the service takes it; point --spool-dir at a writable directory")
        interruptible = self.signal_name is None
        outcome: Delivery | None = None
        if entry.service_id is not None:
            try:
                outcome = misplaced(self.client, entry, service_identity(self.client, retry, interruptible), retry)
            except ServiceUnavailable as e:
                outcome = Delivery("unreachable", str(e), path=entry.path)
        outcome = outcome or deliver(self.spool, self.client, entry, retry, interruptible=interruptible)
        self._say_delivery(entry, outcome, spooled=False)


def _kill_after(child: ProbeProcess, grace_s: float) -> None:
    try:
        child.proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        log.warning("probe %d did not stop within %.0f s of SIGTERM: killing it", child.pid, grace_s)
        child.kill_group()


DETECT_SCRIPT = ("import json, sys\n"
                 "from autotune.worker.hardware import detect\n"
                 "try:\n"
                 "    print(json.dumps(detect(sys.argv[1]).to_dict()))\n"
                 "except ValueError as e:\n"
                 "    print(e, file=sys.stderr)\n"
                 "    sys.exit(2)\n")


def run_python(args: list[str], server: ForkServer | None = None, timeout_s: float | None = 300.0,
               env: Mapping[str, str] | None = None) -> tuple[int, str, str]:
    """``python ARGS`` in a short-lived child (forked from `server` when it can and `env`, if
    given, is the server's; else started cold in `env`, default this process's, without the
    worker's secrets): its (exit status, stdout, stderr). Raises subprocess.TimeoutExpired past
    `timeout_s` (None: no limit). A forked one does not wait for the server's whole preload:
    torch is there."""
    if server is not None and server.down is None and (env is None or without_secrets(env) == server.env):
        try:
            child = server.popen(args, preloaded=False)
        except ForkServerError as exc:
            log.warning("the fork server cannot start children (%s): they start cold from now on", exc)
        else:
            assert child.stdin is not None and child.stdout is not None and child.stderr is not None
            child.stdin.close()
            streams = (child.stdout, child.stderr)
            texts = ["", ""]

            def read(index: int) -> None:
                texts[index] = streams[index].read().decode("utf-8", "replace")

            readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(2)]
            for reader in readers:
                reader.start()
            try:
                code = child.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                raise
            finally:
                for reader in readers:
                    reader.join(timeout=5.0)
                for stream in streams:
                    stream.close()
            return code, texts[0], texts[1]
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout_s, check=False,
                          env=without_secrets(os.environ if env is None else env))
    return proc.returncode, proc.stdout, proc.stderr


def detect_hardware(device: str, server: ForkServer | None = None) -> Hardware:
    """`autotune.worker.hardware.detect(device)` run in a short-lived child process (forked from the
    worker's `server` when there is one: it has imported torch already).

    Asking torch about a GPU creates a CUDA context (~400 MiB of GPU memory on an H100)
    that would stay with the worker for its whole life, next to each probe's own; the
    worker itself therefore never initialises CUDA (nor imports torch). The CPU needs no
    question for torch but its version, which the installed distribution records: it is
    detected here, and a CPU worker leases at once, while its fork server is still importing
    torch (one that exits at once, e.g. refused a pinned study, stops that import midway).
    Raises ValueError when the device cannot be used."""
    version = installed_torch_version() if device == "cpu" else None
    if version is not None:
        return detect_cpu(version)
    code, out, err = run_python(["-c", DETECT_SCRIPT, device], server)
    if code != 0:
        lines = err.strip().splitlines()
        raise ValueError(lines[-1] if lines else f"hardware detection for {device!r} failed (exit code {code})")
    return Hardware(**json.loads(out.strip().splitlines()[-1]))


def start_fork_server(options: WorkerOptions) -> ForkServer | None:
    """The worker's fork server (`autotune.engine.fork_server`), started in the environment its probe
    children get, or None: warm starts off (--cold-start), not Linux, several GPUs per trial
    (the distributed launcher starts cold, with its group's GPUs, and forks its ranks itself), or the
    server could not be started (said; the children start cold)."""
    if not options.warm_start or options.gpus_per_trial != 1 or not sys.platform.startswith("linux"):
        return None
    export_workload_paths(options.workload_paths())  # in the environment the server (and each child) reads
    try:
        return ForkServer(child_environment(options.threads)).start()
    except OSError as exc:
        log.warning("the fork server did not start (%s): probes start cold", exc)
        return None


COUNT_SCRIPT = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"


def visible_cuda_count() -> int:
    """How many GPUs this host shows (in a short-lived child: the worker never touches CUDA)."""
    proc = subprocess.run([sys.executable, "-c", COUNT_SCRIPT], capture_output=True, text=True, timeout=300,
                          check=False, env=without_secrets(os.environ))
    try:
        return int(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return 0


def run_worker(options: WorkerOptions, console: Console | None = None) -> int:
    """Detect the hardware, install the signal handlers and serve trials (the `autotune worker` verb).

    One lease loop per device group (`plan_groups`): with one group it runs on the main thread;
    with several, each runs on its own thread (worker id suffixed with its group), the main
    thread forwarding SIGINT/SIGTERM to all of them. Each loop counts its own --max-trials and
    --idle-exit. Exit status: the first non-zero loop status, else 0. Raises ValueError when a
    device cannot be used or the devices do not split into groups."""
    groups = plan_groups(options.device, options.gpus_per_trial)
    cpu_share = claim_cpu_share(options)  # --device cpu without --threads: this worker's share of the host's cores
    server = start_fork_server(options)  # from the main thread, which lives as long as the worker
    try:
        if len(groups) == 1:
            group = groups[0]
            hardware = detect_hardware(group.devices[0], server)
            worker = Worker(options, hardware, console=console, group=group, fork_server=server, cpu_share=cpu_share)
            worker.install_signal_handlers()
            try:
                return worker.run()
            finally:
                worker.client.close()
        console = console or Console(soft_wrap=True, highlight=False)
        workers = []
        notice = SkipNotice()  # the loops see the same studies: say which they cannot take once, not once per loop
        for group in groups:
            worker = Worker(options, detect_hardware(group.devices[0], server), console=console, group=group,
                            worker_id_suffix=group.name if options.worker_id else None, fork_server=server)
            worker.show_status = False
            worker.skip_notice = notice
            workers.append(worker)
        return _run_loops(workers)
    finally:
        if server is not None:
            server.close()
        if cpu_share is not None:
            cpu_share.close()


def _run_loops(workers: list[Worker]) -> int:
    """Run several lease loops on threads until they all return; signals reach every loop.
    The probe children are started from the loops' threads, which live until their loop
    ends (a child's PR_SET_PDEATHSIG fires when the thread that started it exits)."""
    codes: dict[int, int] = {}

    def on_signal(signum: int, frame: FrameType | None) -> None:
        second = any(w.signal_name is not None for w in workers)
        for w in workers:
            with contextlib.suppress(KeyboardInterrupt):  # Worker's own "second signal" reaction
                w._on_signal(signum, frame)
        if second:
            raise KeyboardInterrupt  # the main thread kills every running probe (below)

    def serve(index: int, worker: Worker) -> None:
        try:
            codes[index] = worker.run()
        finally:
            worker.client.close()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)
    threads = [threading.Thread(target=serve, args=(i, w), name=f"worker-{w.group.name}", daemon=True)
               for i, w in enumerate(workers)]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(timeout=0.5)  # short joins: the main thread keeps handling signals
    except KeyboardInterrupt:  # a second signal: stop waiting, kill every running probe
        for w in workers:
            if w.current is not None:
                w.current.finish()
        return 128 + (workers[0].signal_number or signal.SIGINT)
    nonzero = [codes.get(i, 1) for i in range(len(workers)) if codes.get(i, 1) != 0]
    return nonzero[0] if nonzero else 0
