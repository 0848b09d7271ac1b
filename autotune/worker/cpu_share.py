"""The CPU share: the CPU workers of one host split its cores between their probes.

A ``--device cpu`` worker without ``--threads`` registers among its host's CPU workers
(`CpuShare`: flock'ed slot files, released by the kernel when a worker dies) and, before each
probe, waits for its share of the cores (m live workers: 1/m each), pins the child to them and
runs it with one torch thread per core (at most OMP_NUM_THREADS, if set): probes of one study
then run on as many cores, so their throughputs compare. ``--threads N`` keeps N threads and no
share."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from autotune.worker.options import WorkerOptions

log = logging.getLogger(__name__)

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
    # read by hand: one small sysfs file, and no installed library (psutil is no dependency) gives
    # the sibling map; a missing or odd file means "no hyperthreads"
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
    try:  # every thread: sched_setaffinity(pid) pins only the thread whose id is `pid`
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

