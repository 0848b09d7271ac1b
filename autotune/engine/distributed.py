"""Multi-GPU probes: one trial over N local processes, forked by one launcher.

A study with ``gpus_per_trial`` N > 1 runs every probe on N processes of one host (one per GPU
with NCCL, or CPU processes with gloo). The worker starts ``python -m autotune.engine.distributed``
(the *launcher*), which imports torch and the probe once and forks the N ranks from its only
thread, before any CUDA context exists: a rank starts in hundredths of a second instead of
importing torch itself. The ranks meet at a TCP store on a socket the launcher opened before the
forks (no port is raced for).

The job directory (``$AUTOTUNE_JOB_DIR``, `prepare_job_dir`) holds ``job.json`` (the `ChildJob`),
``stop`` (the worker's prune: every rank stops at the next window end), ``rank-R.pid`` and
``rank-R.json`` (a rank's failure record). Rank 0 alone writes the protocol of
`autotune.engine.probe_child` on stdout. A failing rank makes the launcher kill the others, and
the worker reports the earliest failure (`collect_failure`). No orphans: the launcher and the
ranks die with their parent (`watch_parent`) and the worker kills every rank's process group
(`kill_ranks`). This module imports torch only inside the launcher and the ranks.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

from autotune.contract.config import NCCL_ENV_KNOBS

JOB_DIR_ENV = "AUTOTUNE_JOB_DIR"
JOB_FILE = "job.json"
STOP_FILE = "stop"
STOP_POLL_S = 0.1
MAX_WORLD_SIZE = 64
STORE_HOST = "127.0.0.1"  # the ranks' rendezvous store (one host: NCCL finds its own interfaces)
STORE_TIMEOUT_S = 300.0  # joining the process group: every rank connects within this


def prepare_job_dir(job_json: str, parent: str | None = None) -> Path:
    """A fresh job directory holding ``job.json`` (the caller removes it when the trial ends)."""
    path = Path(tempfile.mkdtemp(prefix="autotune-job-", dir=parent))
    (path / JOB_FILE).write_text(job_json)
    return path


def launch_argv(python: str = sys.executable) -> list[str]:
    """The command that runs one distributed probe (its job directory comes by environment)."""
    return [python, "-m", "autotune.engine.distributed"]


def request_stop(job_dir: Path) -> None:
    """Ask the ranks to stop at the next window boundary (the worker's prune)."""
    with contextlib.suppress(OSError):
        (job_dir / STOP_FILE).touch()


def nccl_environment(config: Mapping[str, Any]) -> dict[str, str]:
    """The NCCL variables the config's knobs set (null knobs set nothing)."""
    return {variable: str(config[name]) for name, variable in NCCL_ENV_KNOBS.items()
            if config.get(name) is not None}


def collect_failure(job_dir: Path) -> dict[str, Any] | None:
    """The ProbeResult dict of the earliest rank failure record in `job_dir`, or None."""
    records = []
    for path in job_dir.glob("rank-*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # written while the rank was killed: ignore a torn record
        if isinstance(record, dict) and isinstance(record.get("result"), dict):
            records.append((float(record.get("time", 0.0)), int(record.get("rank", 0)), record["result"]))
    if not records:
        return None
    return min(records, key=lambda r: (r[0], r[1]))[2]


def rank_pids(job_dir: Path) -> list[int]:
    pids = []
    for path in job_dir.glob("rank-*.pid"):
        with contextlib.suppress(OSError, ValueError):
            pids.append(int(path.read_text().strip()))
    return sorted(pids)


def _runs_job(pid: int, job_dir: Path) -> bool:
    """Whether process `pid` still belongs to this job (its environment names the job
    directory), so a recycled pid is never killed."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"{JOB_DIR_ENV}={job_dir}".encode() in environ.split(b"\0")


def kill_ranks(job_dir: Path) -> None:
    """SIGKILL the process group of every rank of this job that is still alive (each rank
    leads its own session)."""
    for pid in rank_pids(job_dir):
        if _runs_job(pid, job_dir):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


# --- the launcher ---------------------------------------------------------------------------


def _job_dir() -> Path:
    value = os.environ.get(JOB_DIR_ENV)
    if not value or not (Path(value) / JOB_FILE).is_file():
        raise SystemExit(f"autotune.engine.distributed: ${JOB_DIR_ENV} must name a directory holding {JOB_FILE}")
    return Path(value)


def _describe(status: int) -> str:
    """A wait status in words: "exited with 1", "was killed by SIGKILL"."""
    if os.WIFSIGNALED(status):
        return f"was killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exited with {os.waitstatus_to_exitcode(status)}"


def launch_main() -> int:
    """The launcher (see the module docstring): import once, fork the N ranks, wait for them;
    the first rank to fail ends the others. 0 when every rank ended well, else 1."""
    from autotune.engine.probe_child import PARENT_PID_ENV, ChildJob, set_parent_death_signal, watch_parent

    set_parent_death_signal()  # the watchdog thread comes after the forks (fork from one thread only)
    job_dir = _job_dir()
    job = ChildJob.from_json((job_dir / JOB_FILE).read_text())
    if not 2 <= job.world_size <= MAX_WORLD_SIZE:
        print(f"autotune.engine.distributed: world_size {job.world_size} is not in [2, {MAX_WORLD_SIZE}]",
              file=sys.stderr)
        return 2
    worker = os.environ.get(PARENT_PID_ENV, "")
    worker_pid = int(worker) if worker.isdigit() else os.getppid()
    os.environ.update(nccl_environment(job.config))
    os.environ[PARENT_PID_ENV] = str(os.getpid())  # the ranks die with this launcher
    # one process per GPU would get all the host's cores each: share them (the worker's --threads wins)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // job.world_size)))
    _preload()
    # the store's listening socket, made before the forks: rank 0 serves the store on it, the
    # others connect to its port (no port is chosen and then raced for)
    listener = socket.create_server((STORE_HOST, 0), backlog=MAX_WORLD_SIZE)
    ranks: dict[int, int] = {}  # pid -> rank
    gc.freeze()  # the preloaded objects: the ranks' collections never traverse (or copy) them
    try:
        for rank in range(job.world_size):
            pid = os.fork()
            if pid == 0:
                _rank_process(rank, job.world_size, listener)  # never returns
            ranks[pid] = rank
            (job_dir / f"rank-{rank}.pid").write_text(str(pid))  # before the rank runs: kill_ranks finds it
    finally:
        listener.close()
    watch_parent(worker_pid)
    return _wait_for_ranks(ranks)


def _preload() -> None:
    """What every rank imports, imported once here so the forked ranks start with it (torch._dynamo
    too: torch.optim imports it on an optimizer's first step, 1.5-2 CPU-s in each rank otherwise);
    checks that forking stays safe (one thread, no CUDA context)."""
    import torch
    import torch._dynamo
    import torch.distributed

    import autotune.engine.probe  # noqa: F401

    if threading.active_count() != 1 or torch.cuda.is_initialized():
        raise SystemExit("autotune.engine.distributed: the launcher started a thread or CUDA before forking its ranks")


def _rank_process(rank: int, world: int, listener: socket.socket) -> NoReturn:
    """In a forked rank: lead a new session, run `rank_main`, exit with its status. Never returns."""
    from autotune.engine.fork_server import exit_forked
    from autotune.engine.probe_child import set_process_name

    def rank_process() -> int:
        os.setsid()
        set_process_name(f"rank{rank}")  # ps: each rank shows the launcher's command line
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                          MASTER_ADDR=STORE_HOST, MASTER_PORT=str(listener.getsockname()[1]))
        if rank != 0:
            listener.close()
        return rank_main(listener if rank == 0 else None)

    exit_forked(rank_process)


def _wait_for_ranks(ranks: dict[int, int]) -> int:
    """Reap the ranks; at the first that fails, SIGKILL the others' process groups (they may be
    blocked in a collective, waiting for the one that failed). 0 when all exited 0, else 1."""
    failed: str | None = None
    while ranks:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        rank = ranks.pop(pid, None)
        if rank is None or status == 0 or failed is not None:
            continue
        failed = f"rank {rank} {_describe(status)}"
        print(f"autotune.engine.distributed: {failed}: ending the other {len(ranks)} rank(s)", file=sys.stderr)
        for other in ranks:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(other, signal.SIGKILL)
    return 0 if failed is None else 1


# --- one rank -------------------------------------------------------------------------------


def _write_record(job_dir: Path, rank: int, world: int, result: dict[str, Any]) -> None:
    """This rank's failure record (written to a temporary name, then renamed: never torn)."""
    failure = dict(result.get("failure") or {})
    failure["message"] = f"rank {rank} of {world}: {failure.get('message', '')}"
    failure["rank"] = str(rank)
    result = {**result, "failure": failure}
    tmp = job_dir / f".rank-{rank}.json.tmp"
    tmp.write_text(json.dumps({"rank": rank, "time": time.time(), "result": result}, allow_nan=True))
    tmp.replace(job_dir / f"rank-{rank}.json")


def _watch_stop_file(job_dir: Path, stop: threading.Event) -> None:
    def poll() -> None:
        while not stop.is_set():
            if (job_dir / STOP_FILE).exists():
                stop.set()
            time.sleep(STOP_POLL_S)

    threading.Thread(target=poll, name="stop-file", daemon=True).start()


def rank_main(listener: socket.socket | None = None) -> int:
    """One rank (forked by the launcher: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT set; rank 0 gets the store's listening socket): join the process group, run
    the probe on this rank's device, then either write the result (rank 0) or, on failure,
    the rank's record (and exit 1 at once)."""
    from autotune.engine.probe_child import ChildJob, ProtocolWriter, claim_stdout, run_job, watch_parent

    watch_parent()
    out = claim_stdout()
    job_dir = _job_dir()
    rank, local_rank, world = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    job = ChildJob.from_json((job_dir / JOB_FILE).read_text())
    import torch

    cuda = job.device.startswith("cuda")
    device = f"cuda:{local_rank}" if cuda else "cpu"  # CUDA_VISIBLE_DEVICES holds this trial's GPUs
    stop = threading.Event()
    if rank == 0:
        _watch_stop_file(job_dir, stop)
    try:
        if cuda:
            torch.cuda.set_device(local_rank)
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        store = torch.distributed.TCPStore(host, port, world, is_master=rank == 0, wait_for_workers=False,
                                           timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S),
                                           master_listen_fd=listener.fileno() if listener is not None else None)
        torch.distributed.init_process_group(backend="nccl" if cuda else "gloo", store=store, rank=rank,
                                             world_size=world)
    except Exception as e:
        from autotune.engine.result import ProbeResult

        failed = ProbeResult(workload=job.workload, preset=job.preset, config=job.config, device=device,
                             torch_version=torch.__version__, world_size=world,
                             failure={"kind": "error", "message": f"joining the process group failed: {e}"})
        _write_record(job_dir, rank, world, failed.to_dict())
        os._exit(1)
    job.device = device
    silent = ProtocolWriter(open(os.devnull, "w"))  # noqa: SIM115 (ranks other than 0 report nothing)
    result = run_job(job, out if rank == 0 else silent, stop)
    if result.get("failure"):
        _write_record(job_dir, rank, world, result)
        sys.stderr.flush()
        os._exit(1)  # now: the peers may be blocked in a collective; the launcher ends them
    if rank == 0:  # stopped_early is the probe's own: set when every rank stopped at rank 0's word
        out.write({"type": "result", "result": result})
    torch.distributed.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv:
        print("usage: python -m autotune.engine.distributed  (the job directory comes in $AUTOTUNE_JOB_DIR)",
              file=sys.stderr)
        return 2
    return launch_main()


if __name__ == "__main__":
    sys.exit(main())
