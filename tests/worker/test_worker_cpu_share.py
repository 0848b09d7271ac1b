"""CPU workers on one host split its cores (autotune.worker.cpu_share.CpuShare): real registries in a
temporary directory, real processes holding them (killed with SIGKILL too), a real Worker
pinning its probe child, and real `autotune worker` processes printing their banners."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import IO, Any

import pytest
from rich.console import Console
from worker_fakes import HARDWARE, FakeClient, fake_child, make_lease

from autotune.worker.cpu_share import (
    CPU_SHARE_ENV,
    CoreShare,
    CpuShare,
    PhysicalCore,
    claim_cpu_share,
    cpu_siblings,
    format_cores,
    omp_threads_cap,
    physical_cores,
    split_cores,
)
from autotune.worker.loop import Worker
from autotune.worker.options import WorkerOptions


def cores(n: int) -> tuple[PhysicalCore, ...]:
    """A host of `n` cores of one CPU each, as the registries below see it (nothing is pinned with these)."""
    return tuple(PhysicalCore(i, (i,)) for i in range(n))


CORES = cores(4)

HOLDER = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from autotune.worker.cpu_share import CpuShare, PhysicalCore
    host = [PhysicalCore(i, (i,)) for i in range(int(sys.argv[2]))]
    share = CpuShare(Path(sys.argv[1]), cores=host).claim()
    print(json.dumps({"slot": share.slot}), flush=True)
    for line in sys.stdin:  # "share": this worker's share as the live workers stand now
        s = share.current()
        print(json.dumps({"index": s.index, "of": s.of, "cpus": list(s.cpus)}), flush=True)
""")


def start_holder(root: Path, cores: int = len(CORES)) -> tuple[subprocess.Popen[str], int]:
    """A process that claims a slot in `root` and answers "share" on stdin; (process, its slot)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(root), str(cores)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())["slot"]


def ask(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("share\n")
    proc.stdin.flush()
    answer: dict[str, Any] = json.loads(proc.stdout.readline())
    return answer


def test_split_and_describe() -> None:
    assert [split_cores((0, 1, 2, 3), r, 2) for r in range(2)] == [(0, 1), (2, 3)]
    assert [split_cores((0, 1, 2, 3), r, 3) for r in range(3)] == [(0,), (1,), (2,)]  # 3 idle: equal shares
    assert [split_cores((0, 1), r, 3) for r in range(3)] == [(0,), (1,), (0,)]  # more workers than cores
    assert format_cores((0, 1, 2, 3, 6, 8, 9)) == "0-3,6,8-9"
    assert CoreShare(2, 2, CORES[2:], CORES).describe() == "2 threads, core share 2 of 2 (CPUs 2-3 of 0-3)"
    assert CoreShare(3, 3, CORES[2:3], CORES).describe() == \
        "1 thread, core share 3 of 3 (CPU 2 of 0-3), 1 core left idle"
    smt = (PhysicalCore(0, (0, 2)), PhysicalCore(1, (1, 3)))  # two cores, two hyperthreads each: one thread a core
    assert CoreShare(1, 1, smt, smt).describe() == "2 threads, core share 1 of 1 (CPUs 0-3 of 0-3)"
    # an OMP_NUM_THREADS in the worker's environment caps the threads (the cores stay the share's)
    assert omp_threads_cap({"OMP_NUM_THREADS": "1"}) == 1 and omp_threads_cap({"OMP_NUM_THREADS": "x"}) is None
    assert CoreShare(1, 1, CORES, CORES).describe(cap=1) == \
        "1 thread (OMP_NUM_THREADS=1), core share 1 of 1 (CPUs 0-3 of 0-3)"
    assert CoreShare(1, 2, CORES[:2], CORES).probe_threads(world_size=2) == 1


def test_hyperthreads_stay_with_their_core() -> None:
    host = sorted(os.sched_getaffinity(0))
    grouped = physical_cores(host)
    assert sorted(cpu for core in grouped for cpu in core.cpus) == host
    for core in grouped:
        assert all(core.id == min(cpu_siblings(cpu)) for cpu in core.cpus)


def test_two_worker_processes_get_disjoint_shares_and_a_killed_one_frees_its_share(tmp_path: Path) -> None:
    first, slot1 = start_holder(tmp_path)
    second, slot2 = start_holder(tmp_path)
    try:
        assert (slot1, slot2) == (0, 1)
        a, b = ask(first), ask(second)
        assert (a["index"], a["of"], b["index"], b["of"]) == (1, 2, 2, 2)
        assert len(a["cpus"]) == len(b["cpus"]) == 2 and not set(a["cpus"]) & set(b["cpus"])
        os.kill(first.pid, signal.SIGKILL)  # no cleanup runs: the kernel drops its locks
        first.wait(timeout=10)
        assert ask(second) == {"index": 1, "of": 1, "cpus": [0, 1, 2, 3]}
        third, slot3 = start_holder(tmp_path)  # the dead worker's slot is free again
        try:
            assert slot3 == 0
            assert ask(third)["cpus"] == [0, 1] and ask(second)["cpus"] == [2, 3]
        finally:
            third.kill()
            third.wait(timeout=10)
    finally:
        for proc in (first, second):
            proc.kill()
            proc.wait(timeout=10)


def test_a_probe_waits_while_another_workers_probe_holds_its_cores(tmp_path: Path) -> None:
    alone = CpuShare(tmp_path, cores=CORES).claim()
    first = alone.acquire()
    assert first is not None and first.cpus == (0, 1, 2, 3)  # alone on the host: every core
    late = CpuShare(tmp_path, cores=CORES).claim()
    waited = threading.Event()
    got: list[CoreShare | None] = []
    thread = threading.Thread(target=lambda: got.append(late.acquire(on_wait=lambda s: waited.set())))
    thread.start()
    try:
        assert waited.wait(5)  # its cores 2-3 are still the first worker's, whose probe runs
        time.sleep(0.3)
        assert not got
        alone.release()  # that probe ended
        thread.join(5)
        assert got and got[0] is not None and got[0].cpus == (2, 3) and (got[0].index, got[0].of) == (2, 2)
        again = alone.acquire()  # its next probe: its new share, beside the other's
        assert again is not None and again.cpus == (0, 1)
    finally:
        late.close()
        thread.join(5)
        alone.close()
    assert CpuShare(tmp_path, cores=CORES).claim().current().cores == CORES  # both gone: every core again


def test_waiters_go_first_come_first_served_when_workers_outnumber_cores(tmp_path: Path) -> None:
    shares = [CpuShare(tmp_path, cores=cores(2)).claim() for _ in range(3)]  # ranks 0 and 2 share core 0
    try:
        held = shares[0].acquire()
        assert held is not None and held.cpus == (0,) and held.describe().endswith("more CPU workers than cores")
        waited = threading.Event()
        got: list[CoreShare | None] = []
        thread = threading.Thread(target=lambda: got.append(shares[2].acquire(on_wait=lambda s: waited.set())))
        thread.start()
        assert waited.wait(5)
        shares[0].release()
        # the releaser comes back at once, but the earlier waiter gets the core
        stop_at = time.monotonic() + 3
        mine = shares[0].acquire(stop=lambda: time.monotonic() > stop_at or bool(got))
        thread.join(5)
        assert got and got[0] is not None and got[0].cpus == (0,)
        if mine is not None:  # it may get the core only once the waiter let it go: it did not
            pytest.fail("the returning worker took the core an earlier waiter wanted")
        assert shares[1].acquire() is not None  # core 1 was never in question
    finally:
        for share in shares:
            share.close()


CHILD = """
import json, os, sys
job = json.loads(sys.stdin.read())
print(json.dumps({"type": "result", "result": {"workload": "ups", "preset": "tiny", "config": {}, "device": "cpu",
      "torch_version": "x", "failure": None, "threads": job["threads"],
      "affinity": sorted(os.sched_getaffinity(0))}}), flush=True)
"""


def test_a_worker_pins_its_probe_to_its_share_and_says_so_in_its_banner(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # one thread per core of the share (the suite sets 1)
    host = physical_cores(os.sched_getaffinity(0))
    other = CpuShare(tmp_path / "share").claim()  # another CPU worker on this host, there first
    share = CpuShare(tmp_path / "share").claim()
    try:
        expected = share.current()
        assert (expected.index, expected.of) == (2, 2)
        client = FakeClient()
        out = io.StringIO()
        options = WorkerOptions(worker_id="w1", child_argv=fake_child(tmp_path, CHILD), spool_dir=tmp_path / "spool")
        worker = Worker(options, HARDWARE, client=client, console=Console(file=out, width=300),  # type: ignore[arg-type]
                        cpu_share=share)
        worker.announce()
        assert f"cpu: {expected.describe()}" in out.getvalue() and "threads core share" in out.getvalue()
        worker.run_trial(make_lease())
        result = client.completed[0]
        assert result["affinity"] == list(expected.cpus) and result["threads"] == expected.threads
        if len(host) >= 2:
            assert expected.cores == host[len(host) // 2:2 * (len(host) // 2)]
        assert share.held is None  # the probe ended: its cores are free again
        held = other.acquire()
        assert held is not None and not set(held.cpus) & set(expected.cpus)
    finally:
        other.close()
        share.close()


def test_only_a_cpu_worker_without_threads_claims_a_share(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CPU_SHARE_ENV, str(tmp_path))
    assert claim_cpu_share(WorkerOptions(device="cpu", threads=2)) is None
    assert claim_cpu_share(WorkerOptions(device="cuda:0")) is None
    share = claim_cpu_share(WorkerOptions(device="cpu"))
    assert share is not None and share.root == tmp_path and share.slot == 0
    share.close()


def read_banner(proc: subprocess.Popen[str], lines: list[str], until: str, timeout_s: float = 60.0) -> str:
    """Read the worker's stdout into `lines` until a line containing `until`; that line."""
    assert proc.stdout is not None
    stream: IO[str] = proc.stdout
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        lines.append(line)
        if until in line:
            return line
    raise AssertionError(f"no {until!r} in the worker's output:\n{''.join(lines)}")


def test_two_worker_processes_announce_disjoint_shares_and_threads_opt_out(tmp_path: Path) -> None:
    env = {**os.environ, CPU_SHARE_ENV: str(tmp_path / "share"), "PYTHONUNBUFFERED": "1", "COLUMNS": "400"}
    env.pop("AUTOTUNE_TOKEN", None)
    nowhere = "http://127.0.0.1:9"  # nothing answers: each worker prints its banner, then waits for the service

    def start(*extra: str) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-m", "autotune.cli", "worker", "--api", nowhere, "--device", "cpu",
                                 "--cold-start", "--idle-exit", "60", "--spool-dir", str(tmp_path / "spool"), *extra],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                env=env)

    procs: list[subprocess.Popen[str]] = []
    try:
        procs.append(start())
        procs.append(start("--threads", "1"))  # --threads: today's behaviour, no share (started alongside)
        first = read_banner(procs[0], [], "cpu:")
        assert "core share 1 of 1" in first
        explicit: list[str] = []
        read_banner(procs[1], explicit, "spool ")
        assert not any("core share" in line for line in explicit) and any("threads 1" in line for line in explicit)
        procs.append(start())
        second = read_banner(procs[2], [], "cpu:")
        assert "core share 2 of 2" in second  # the --threads worker does not count
        threads = min(max(1, len(physical_cores(os.sched_getaffinity(0))) // 2), omp_threads_cap() or 1024)
        assert f"cpu: {threads} thread" in second
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)
