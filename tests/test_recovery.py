"""Crash recovery with real processes: the real service (`autotune serve` on SQLite) and real
workers, killed with SIGKILL, frozen with SIGSTOP, or left without their service.

What must hold: a trial whose worker dies is failed as "lost" once the grace period passes
and re-run (same config, role and probe) by another worker; the dead worker's probe child
does not outlive it; a worker that comes back after its lease was reaped is refused (409)
and changes nothing; a service restart loses and duplicates nothing; a repeated
complete is harmless; after max_retries retries a lost trial stays failed, saying why.

The service runs with a short lease grace and reaper interval (environment variables
AUTOTUNE_LEASE_GRACE_S / AUTOTUNE_REAPER_INTERVAL_S), so each test takes seconds: 5 s where
real workers heartbeat, 1 s where a client plays the workers and no lease is meant to live.
Probes are the small spec's (64 samples): the tests act on a probe child once it runs (it
has imported torch), long before it could finish.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from live_service import (
    LiveService,
    Processes,
    is_alive,
    lease_ended,
    leased_trial_ids,
    log_text,
    probe_children,
    small_spec,
    start_worker,
    wait_until,
)

from autotune.contract.results import LeaseRequest
from autotune.worker.client import Client, Conflict

pytestmark = pytest.mark.slow
# long enough that a live worker's heartbeats (every 0.5 s) never miss it on a loaded 2-core host
GRACE_S = 5.0
FAST_REAPER = {"AUTOTUNE_LEASE_GRACE_S": str(GRACE_S), "AUTOTUNE_REAPER_INTERVAL_S": "0.25"}
# a client plays the workers and sends no heartbeat: its leases are meant to go silent, so a short grace
SILENT_GRACE_S = 1.0
SILENT_REAPER = {"AUTOTUNE_LEASE_GRACE_S": str(SILENT_GRACE_S), "AUTOTUNE_REAPER_INTERVAL_S": "0.1"}
NO_PRUNING = {"enabled": False}  # every trial runs to the end: the outcomes are known in advance


@pytest.fixture(scope="module")
def service(module_processes: Processes, tiny_datasets: Any) -> LiveService:
    """One service for the module's tests that use it: each submits a study of its own name and
    starts its workers (or plays them) with that study (a test's workers never see another's
    trials)."""
    return LiveService(module_processes, module_processes.log_dir / "autotune.db", env=FAST_REAPER).start()


@pytest.fixture
def silent_service(processes: Processes, tmp_path: Path) -> LiveService:
    """The service for a client that plays silent workers (no probe runs: no data needed)."""
    return LiveService(processes, tmp_path / "autotune.db", env=SILENT_REAPER).start()


def has_imported_torch(pid: int) -> bool:
    """Whether process `pid` has torch's libraries mapped (a probe child past its start); False once gone."""
    try:
        return "torch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def worker_client(service: LiveService) -> Client:
    """A client that plays a worker (with the service's worker token once it has one)."""
    return Client(service.url, getattr(service, "worker_token", None), retry_for_s=10.0)


def by_number(service: LiveService, study: str) -> dict[int, dict[str, Any]]:
    return {t["number"]: t for t in service.trials(study)}


def study_finished(service: LiveService, study: str) -> dict[str, Any] | None:
    info: dict[str, Any] = service.get(f"/v1/studies/{study}")
    return info if info["state"] == "finished" else None


def test_a_killed_workers_trial_is_retried_by_another_worker(service: LiveService, processes: Processes) -> None:
    # one trial (the baseline); two workers, either may lease it
    service.submit(small_spec("kill", n_trials=1))
    workers = {wid: start_worker(processes, service.url, "--study", "kill", "--worker-id", wid, "--max-trials", "1",
                                 log_name=f"{wid}.log") for wid in ("rec-a", "rec-b")}

    def running() -> tuple[str, int] | None:
        for wid, proc in workers.items():
            if kids := probe_children(proc.pid):
                return wid, kids[0]
        return None

    victim, child = wait_until(running, 60, "a probe child")
    wait_until(lambda: has_imported_torch(child), 60, "the probe child to import torch")  # mid-probe
    os.kill(workers[victim].pid, signal.SIGKILL)  # the worker only: its child runs in its own session
    killed_at = time.monotonic()
    # the orphaned probe dies with its worker (PR_SET_PDEATHSIG, or the parent-pid watchdog)
    wait_until(lambda: not is_alive(child), 3, "the killed worker's probe child to exit")

    survivor = "rec-b" if victim == "rec-a" else "rec-a"
    retry = wait_until(lambda: by_number(service, "kill").get(1), GRACE_S + 20, "the retry of trial 0")
    # reaped after the grace period, leased at the survivor's next poll (idle backoff: at most 5 s),
    # with some seconds to spare for a loaded host
    assert time.monotonic() - killed_at < GRACE_S + 5 + 7
    assert workers[survivor].wait(timeout=60) == 0, log_text(workers[survivor])[-3000:]

    trials = by_number(service, "kill")
    lost, retry = trials[0], trials[1]
    assert lost["state"] == "FAIL" and lost["failure"]["kind"] == "lost", lost
    assert f"worker {victim} stopped heartbeating" in lost["failure"]["message"]
    assert lost["retried_as"] == 1 and lost["worker_id"] == victim
    assert retry["state"] == "COMPLETE" and retry["worker_id"] == survivor, retry
    assert (retry["retry_of"], retry["attempt"], retry["role"]) == (0, 2, "baseline")
    assert {k: v for k, v in retry["config"].items() if k in lost["config"]} == lost["config"]
    study = study_finished(service, "kill")
    assert study is not None and study["counts"] == {"COMPLETE": 1} and study["retried"] == 1
    # the retried baseline set the gate (the baseline itself is never a recommendation)
    assert [t["feasible"] for t in trials.values()] == [False, True]


# Imported by every process started with it on PYTHONPATH: the fork server alone (its command
# line names it) sleeps before its preload, as on a loaded host or a slow disk
SLOW_FORK_SERVER = """
import time
with open("/proc/self/cmdline", "rb") as f:
    if b"autotune.engine.fork_server" in f.read():
        time.sleep({seconds})
"""


def test_a_lease_holds_while_the_first_probe_waits_for_the_fork_servers_preload(
        service: LiveService, processes: Processes, tmp_path: Path) -> None:
    """A worker leases at once, while its fork server still imports torch; its first probe waits
    for that preload. The heartbeats start with the lease, so a preload longer than the grace
    period costs the trial nothing."""
    site = tmp_path / "slow-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_FORK_SERVER.format(seconds=GRACE_S + 3))
    path = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    service.submit(small_spec("slow-start", n_trials=1, pruning=NO_PRUNING))
    worker = start_worker(processes, service.url, "--study", "slow-start", "--max-trials", "1",
                          env={"PYTHONPATH": path})
    assert worker.wait(timeout=120) == 0, log_text(worker)[-3000:]
    trials = by_number(service, "slow-start")
    assert list(trials) == [0], trials  # no retry: the lease was never reaped
    assert trials[0]["state"] == "COMPLETE", trials[0]
    assert trials[0]["duration_s"] > GRACE_S, trials[0]  # the wait was longer than the grace period


def test_a_zombie_worker_is_refused_and_changes_nothing(service: LiveService, processes: Processes) -> None:
    """A worker frozen past the grace period (SIGSTOP: a hung host, a network partition) finds
    its trial re-run by another worker when it wakes up: its calls get 409."""
    service.submit(small_spec("zombie", n_trials=1, pruning=NO_PRUNING))
    frozen = start_worker(processes, service.url, "--study", "zombie", "--worker-id", "zz-a", "--max-trials", "1",
                          log_name="zz-a.log")
    wait_until(lambda: probe_children(frozen.pid), 60, "a probe child")
    os.kill(frozen.pid, signal.SIGSTOP)
    try:
        # the other worker starts while zz-a is frozen (its start overlaps the grace period): the
        # trial is not offered to it while zz-a's lease holds, its retry is once the lease is reaped
        other = start_worker(processes, service.url, "--study", "zombie", "--worker-id", "zz-b", "--max-trials", "1",
                             log_name="zz-b.log")
        wait_until(lambda: by_number(service, "zombie")[0]["state"] == "FAIL", GRACE_S + 10, "trial 0 to be reaped")
        assert other.wait(timeout=60) == 0, log_text(other)[-3000:]
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
    assert frozen.wait(timeout=30) == 0, log_text(frozen)[-3000:]
    log = log_text(frozen)
    assert "no longer ours" in log or "not ours any more" in log or "reaped" in log, log[-3000:]

    trials = by_number(service, "zombie")
    assert trials[0]["state"] == "FAIL" and trials[0]["failure"]["kind"] == "lost"  # the zombie's result was refused
    assert trials[0]["retried_as"] == 1
    assert trials[1]["state"] == "COMPLETE" and trials[1]["worker_id"] == "zz-b", trials[1]


def test_a_fake_zombies_late_calls_get_409_and_retries_run_out(silent_service: LiveService) -> None:
    """A client plays the workers: two leases that go silent (max_retries 1), then the first
    worker's late report, heartbeat and complete."""
    service = silent_service
    service.submit(small_spec("silent", n_trials=1, max_retries=1))
    with worker_client(service) as client:
        first = client.lease(LeaseRequest(worker_id="w1", hardware="cpu", study="silent"))
        assert first is not None
        wait_until(lambda: by_number(service, "silent")[0]["state"] == "FAIL"
                   and lease_ended(service.db_path, first.trial_id), SILENT_GRACE_S + 10, "trial 0 to be reaped")
        with pytest.raises(Conflict, match="reaped"):
            client.report(first.trial_id, "w1", 1, {"loss": 0.5})
        with pytest.raises(Conflict, match="reaped"):  # heartbeat, report and complete answer alike
            client.heartbeat(first.trial_id, "w1")
        with pytest.raises(Conflict, match="reaped"):
            client.complete(first.trial_id, "w1", {"failure": None, "throughput_samples_per_s": 1.0,
                                                   "val_nrmse": 0.1})
        second = client.lease(LeaseRequest(worker_id="w2", hardware="cpu", study="silent"))
        assert second is not None and second.number == 1 and second.config == first.config
        wait_until(lambda: by_number(service, "silent")[1]["state"] == "FAIL", SILENT_GRACE_S + 10,
                   "trial 1 to be reaped")
        assert client.lease(LeaseRequest(worker_id="w3", hardware="cpu", study="silent")) is None
    trials = by_number(service, "silent")
    assert trials[0]["failure"]["kind"] == "lost" and trials[0]["retried_as"] == 1
    message = trials[1]["failure"]["message"]
    assert message.startswith("lost 2 times (trials #0, #1; max_retries 1)") and "worker w2" in message
    study = study_finished(service, "silent")
    assert study is not None and study["failures"] == {"lost": 1}


def test_a_repeated_complete_returns_the_same_result(service: LiveService) -> None:
    service.submit(small_spec("again", n_trials=1))
    result = {"workload": "ups", "preset": "tiny", "config": {}, "device": "cpu", "torch_version": "test",
              "throughput_samples_per_s": 123.0, "val_nrmse": 0.1, "failure": None, "stopped_early": False}
    with worker_client(service) as client:
        got = client.lease(LeaseRequest(worker_id="w1", hardware="cpu", study="again"))
        assert got is not None
        first = client.complete(got.trial_id, "w1", result)
        time.sleep(0.05)
        again = client.complete(got.trial_id, "w1", result)  # a network retry of the same call
    assert again == first  # duration_s included: Optuna's completion time did not move
    assert first.state == "COMPLETE" and first.throughput_samples_per_s == 123.0
    assert service.get("/v1/studies/again")["counts"] == {"COMPLETE": 1}


def test_a_service_restart_mid_study_loses_and_duplicates_nothing(processes: Processes, tmp_path: Path,
                                                                  tiny_datasets: Any) -> None:
    """A crash of the service mid-study: the workers retry their calls until it is back. The
    grace period is longer than a worker's longest retry backoff (10 s), so a worker alive all
    along is never reaped: its next heartbeat or complete gets through in time. (After a
    restart every lease gets one full grace period: tests/api/test_api_retries.py.)

    The crash comes in the search phase, once the baseline has finished: a search trial runs
    (the listing shows it RUNNING, whether its lease is recorded yet or not). It may land
    between creating a trial and recording its lease: that trial is failed as "never leased"
    one grace period after the restart and re-run. So the workers stay up (a long --idle-exit)
    until the study is finished, and are stopped then. (A crash while the baseline's trial is
    created: tests/api/test_api_retries.py.)"""
    service = LiveService(processes, tmp_path / "autotune.db",
                          env={"AUTOTUNE_LEASE_GRACE_S": "15", "AUTOTUNE_REAPER_INTERVAL_S": "0.25"}).start()
    n = 3
    service.submit(small_spec("restart", n_trials=n, samples=64, pruning=NO_PRUNING))
    workers = {wid: start_worker(processes, service.url, "--study", "restart", "--worker-id", wid, "--idle-exit", "120",
                                 log_name=f"{wid}.log") for wid in ("rs-a", "rs-b")}

    def search_running() -> bool:
        trials = service.trials("restart")
        return (any(t["role"] == "baseline" and t["state"] == "COMPLETE" for t in trials)
                and any(t["role"] == "search" and t["state"] == "RUNNING" for t in trials))

    wait_until(search_running, 90, "a search trial to run after the baseline")
    outage = f"autotune service at {service.url}: "  # a worker's (or its client's) line for a call that failed
    said = {wid: log_text(proc).count(outage) for wid, proc in workers.items()}
    assert service.proc is not None
    os.killpg(service.proc.pid, signal.SIGKILL)  # a crash, mid-study
    service.proc.wait()
    # reports, heartbeats, completes or leases find no service meanwhile (a worker says so)
    wait_until(lambda: any(log_text(proc).count(outage) > said[wid] for wid, proc in workers.items()), 30,
               "a worker to find the service gone")
    service.start()  # same database file, same port
    study = wait_until(lambda: study_finished(service, "restart"), 90, "the study to finish")
    for wid, proc in workers.items():
        assert proc.poll() is None, f"{wid} died:\n{log_text(proc)[-3000:]}"  # it rode out the outage
        processes.stop(proc)
        assert "Traceback" not in log_text(proc), log_text(proc)[-3000:]
    # a never-leased trial's retry stands for it; a draw of a config measured already is REPEAT
    assert study["counts"].get("COMPLETE", 0) + study["counts"].get("REPEAT", 0) == n, study
    assert set(study["counts"]) <= {"COMPLETE", "REPEAT"}, study
    trials = service.trials("restart")
    numbers = sorted(t["number"] for t in trials)
    assert numbers == list(range(len(trials)))  # every trial accounted for
    for t in trials:  # the workers lived on: nothing was reaped for silence
        assert t["state"] in ("COMPLETE", "REPEAT") or ("never leased" in t["failure"]["message"]
                                                         and t["retried_as"]), t
    leased = {wid: leased_trial_ids(p) for wid, p in workers.items()}
    every = leased["rs-a"] + leased["rs-b"]
    # a drawn config already measured is REPEAT, never leased (tests/api/test_api_repeats.py): it has no
    # worker; every completed trial was run by one
    complete = {t["trial_id"]: t["worker_id"] for t in trials if t["state"] == "COMPLETE"}
    assert all(complete.values())
    assert all(t["repeat_of"] is not None and not t["worker_id"] for t in trials if t["state"] == "REPEAT")
    assert sorted(every) == sorted(complete)  # each completed trial leased once, by one worker
    for wid, ids in leased.items():
        assert all(complete[i] == wid for i in ids)  # ... and completed by the worker that leased it


PARENT = """
import subprocess, sys, time
from autotune.engine.probe_child import ChildJob
job = ChildJob(workload="ups", preset="tiny", config={"batch_size": 2, "accum_steps": 1},
               probe={"samples": 1_000_000, "windows": 5, "warmup_steps": 5}, threads=1)
child = subprocess.Popen([sys.executable, "-m", "autotune.engine.probe_child"], stdin=subprocess.PIPE,
                         stdout=subprocess.DEVNULL, start_new_session=True)
child.stdin.write(job.to_json().encode())
child.stdin.close()
print(child.pid, flush=True)
time.sleep(600)
"""


def test_a_probe_child_exits_when_its_parent_is_killed(processes: Processes, tiny_datasets: Any) -> None:
    """The child runs in its own session (a SIGKILL of the worker's group does not reach it),
    with a probe far too long to end by itself: only the parent-death watch can stop it."""
    parent = processes.start([sys.executable, "-c", PARENT], "parent.log")
    child = int(wait_until(lambda: log_text(parent).strip().splitlines()[:1], 30, "the child's pid")[0])
    wait_until(lambda: "torch" in Path(f"/proc/{child}/maps").read_text(), 60, "the child to import torch")
    assert is_alive(child)
    os.kill(parent.pid, signal.SIGKILL)
    wait_until(lambda: not is_alive(child), 3, "the orphaned probe child to exit")


def test_a_probe_child_whose_parent_is_already_gone_exits_at_once() -> None:
    """The parent died before the child could arm the death signal: $AUTOTUNE_PARENT_PID
    names a parent that is not the child's parent any more."""
    env = {**os.environ, "AUTOTUNE_PARENT_PID": "1" if os.getpid() != 1 else "2"}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "autotune.engine.probe_child"], input="{}", capture_output=True,
                          text=True, env=env, timeout=60)
    assert done.returncode == 137 and done.stdout == ""  # killed itself before reading the job
    assert time.monotonic() - started < 30
