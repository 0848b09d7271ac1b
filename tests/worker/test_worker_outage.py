"""The worker without its service: timing never waits on the network, no measurement is
discarded, and --idle-exit counts time without a reachable service.

Most tests run `Worker` in-process against scripted clients and fake child programs; the last
ones run the real service and a real worker in subprocesses and kill the service (SIGKILL)
mid-probe.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_service import (
    CLI,
    LiveService,
    Processes,
    free_port,
    log_text,
    probe_children,
    reports_stored,
    small_spec,
    start_worker,
    wait_until,
)
from rich.console import Console
from worker_fakes import HARDWARE, fake_child, make_lease

from autotune.contract.results import HeartbeatReply, ReportReply, TrialLease
from autotune.contract.views import TrialInfo, TrialList
from autotune.worker import courier as courier_module
from autotune.worker.client import Client, Conflict, ServiceUnavailable
from autotune.worker.courier import MAX_PENDING_REPORTS
from autotune.worker.delivery import COMPLETE_RETRY_S
from autotune.worker.loop import LEASE_RETRY_S, UNREACHABLE_EXIT, Worker
from autotune.worker.options import RETRY_ENV, WorkerOptions, service_retry_s
from autotune.worker.spool import Spool, SpoolEntry

RESULT = {"workload": "ups", "preset": "tiny", "config": {"batch_size": 4}, "device": "cpu", "torch_version": "x",
          "throughput_samples_per_s": 5.0, "window_throughputs": [5.0, 5.0, 5.0], "val_nrmse": 0.5, "failure": None}


def child_printing(tmp_path: Path, reports: int, before_result: str = "") -> list[str]:
    """A fake probe: `reports` report lines at once, then `before_result` (code), then its result."""
    return fake_child(tmp_path, f"""
import json, os, sys, time
for step in range({reports}):
    print(json.dumps({{"type": "report", "step": step, "metrics": {{"samples": step * 4, "loss": 0.5,
                                                                    "throughput": 100.0, "window": step}}}}),
          flush=True)
{before_result}
print({json.dumps({"type": "result", "result": RESULT})!r}, flush=True)
""")


class ScriptedClient:
    """A worker's client: every call recorded; reports and heartbeats as `on_call` decides."""

    base_url = "http://fake"
    service_id = "fake-service"

    def __init__(self, leases: list[TrialLease | None] | None = None,
                 known: list[tuple[str, int, int]] | None = None) -> None:
        self.leases = list(leases or [])
        # (study, trial id, number): the trials the service holds besides those it leases here
        self.known = list(known or []) + [(t.study, t.trial_id, t.number) for t in self.leases if t is not None]
        self.calls: list[tuple[str, Any]] = []
        self.completed: list[tuple[int, str, dict[str, Any]]] = []
        self.complete_errors: list[Exception] = []  # raised by the next completes, in turn
        self.lock = threading.Lock()

    def on_call(self, what: str) -> None:
        """Called at the start of every report and heartbeat; may block or raise."""

    def lease(self, request: Any, **kw: Any) -> TrialLease | None:
        self.calls.append(("lease", None))
        return self.leases.pop(0) if self.leases else None

    def health(self, **kw: Any) -> dict[str, Any]:
        return {"status": "ok", "db": "sqlite", "version": "test", "service_id": self.service_id}

    def trials(self, name: str, **kw: Any) -> TrialList:
        data = [TrialInfo(trial_id=i, number=n, state="RUNNING", params={}) for study, i, n in self.known
                if study == name]
        return TrialList(data=data, count=len(data))

    def heartbeat(self, trial_id: int, worker_id: str, **kw: Any) -> HeartbeatReply:
        self.on_call("heartbeat")
        with self.lock:
            self.calls.append(("heartbeat", trial_id))
        return HeartbeatReply(action="continue")

    def report(self, trial_id: int, worker_id: str, step: int, metrics: dict[str, float], **kw: Any) -> ReportReply:
        self.on_call("report")
        with self.lock:
            self.calls.append(("report", step))
        return ReportReply(prune=False)

    def complete(self, trial_id: int, worker_id: str, result: dict[str, Any], **kw: Any) -> TrialInfo:
        with self.lock:
            self.calls.append(("complete", trial_id))
        if self.complete_errors:
            raise self.complete_errors.pop(0)
        self.completed.append((trial_id, worker_id, result))
        return TrialInfo(trial_id=trial_id, number=0, state="COMPLETE", params={})

    def request(self, method: str, path: str, **kw: Any) -> Any:
        raise ServiceUnavailable(self.base_url, "no listing here")

    def close(self) -> None:
        pass


def make_worker(client: Any, argv: list[str], spool: Path, out: io.StringIO | None = None, **options: Any) -> Worker:
    opts = WorkerOptions(worker_id="w1", child_argv=argv, spool_dir=spool, **options)
    console = Console(file=out if out is not None else io.StringIO(), soft_wrap=True)
    return Worker(opts, HARDWARE, client=client, console=console)


# --- timing never waits on the service ---------------------------------------------------------------


class HangingClient(ScriptedClient):
    """A service that takes the connection and never answers (until released): every report
    and heartbeat blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.in_flight = 0
        self.in_flight_at_complete: int | None = None

    def on_call(self, what: str) -> None:
        with self.lock:
            self.in_flight += 1
        self.release.wait(60)
        with self.lock:
            self.in_flight -= 1

    def complete(self, trial_id: int, worker_id: str, result: dict[str, Any], **kw: Any) -> TrialInfo:
        with self.lock:
            self.in_flight_at_complete = self.in_flight
        return super().complete(trial_id, worker_id, result, **kw)


def test_the_monitor_drains_the_probe_while_reports_and_heartbeats_hang(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The child's 20 reports and its result are all taken while the courier's first call
    hangs: the monitor never waits on the service, the queue of reports stays bounded, and the
    trial completes with the child's own result while that call is still hanging."""
    monkeypatch.setattr(courier_module, "COURIER_CLOSE_S", 0.2)
    client = HangingClient()
    worker = make_worker(client, child_printing(tmp_path, 20), tmp_path / "spool", heartbeat_s=0.05)
    try:
        run = worker.run_trial(make_lease())
    finally:
        client.release.set()
    assert client.in_flight_at_complete == 1  # completed while the first report/heartbeat still hung
    assert [(trial, wid) for trial, wid, _ in client.completed] == [(7, "w1")]
    assert client.completed[0][2] == RESULT  # the child's result, its timed windows as measured
    assert len(run.reports) == 20 and run.result == RESULT and run.child_ended is not None
    courier = run.courier
    assert courier is not None and courier.sent == 0
    assert courier.peak_pending <= MAX_PENDING_REPORTS  # bounded, however long the service hangs
    assert courier.dropped >= 20 - 1 - MAX_PENDING_REPORTS and courier.pending == 0
    assert Spool(tmp_path / "spool").pending() == []  # delivered: nothing left behind


class AwayThenBackClient(ScriptedClient):
    """Refuses the first `away` reports and heartbeats (connection refused), answers after;
    creates `back_file` at its first answer after the outage (the fake child waits for it)."""

    def __init__(self, away: int, back_file: Path) -> None:
        super().__init__()
        self.away = away
        self.back_file = back_file
        self.refused = 0

    def on_call(self, what: str) -> None:
        with self.lock:
            if self.refused < self.away:
                self.refused += 1
                raise ServiceUnavailable(self.base_url, "ConnectError: connection refused")
        self.back_file.touch()


def test_reports_wait_bounded_while_the_service_is_away_and_the_newest_go_in_when_it_is_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(courier_module, "AWAY_PAUSE_S", 0.01)
    back = tmp_path / "back"
    argv = child_printing(tmp_path, 12, f"""
while not os.path.exists({str(back)!r}):  # the probe goes on until the service is back
    time.sleep(0.01)
""")
    client = AwayThenBackClient(away=3, back_file=back)
    run = make_worker(client, argv, tmp_path / "spool", heartbeat_s=30.0).run_trial(make_lease())
    courier = run.courier
    assert courier is not None
    steps = [step for what, step in client.calls if what == "report"]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)  # in order, none twice
    assert courier.sent == len(steps) >= 1 and courier.sent + courier.dropped == 12
    assert steps[-1] == 11  # the newest made it; the oldest were the ones dropped
    assert courier.peak_pending <= MAX_PENDING_REPORTS
    assert client.calls[-1] == ("complete", 7) and client.completed[0][2] == RESULT


# --- no measurement is discarded ---------------------------------------------------------------------


def test_an_undelivered_result_stays_in_the_spool_and_the_next_round_delivers_it(tmp_path: Path) -> None:
    client = ScriptedClient(leases=[make_lease()])
    client.complete_errors = [ServiceUnavailable("http://fake", "ConnectError: connection refused")]
    out = io.StringIO()
    spool = tmp_path / "spool"
    worker = make_worker(client, child_printing(tmp_path, 3), spool, out, idle_exit_s=0.3)
    assert worker.run() == 0
    text = out.getvalue()
    assert "the service did not answer" in text and f"kept in {spool}" in text
    assert "spooled result of trial 0 of s (id 7) delivered → COMPLETE" in text
    assert [(trial, wid, result) for trial, wid, result in client.completed] == [(7, "w1", RESULT)]
    assert Spool(spool).pending() == [] and Spool(spool).rejected() == []


def test_at_start_a_worker_delivers_the_spool_as_the_worker_that_measured_it(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool")
    spool.put(SpoolEntry(api="http://fake", trial_id=5, worker_id="host-999-cpu", study="s", number=2,
                         result=RESULT))
    spool.put(SpoolEntry(api="http://elsewhere:8000", trial_id=6, worker_id="host-999-cpu", study="t", number=0,
                         result=RESULT))
    client = ScriptedClient(known=[("s", 5, 2)])
    out = io.StringIO()
    assert make_worker(client, ["unused"], spool.root, out, idle_exit_s=0.2).run() == 0
    # completed as the worker that held the lease (a restarted worker has a new default id)
    assert client.completed == [(5, "host-999-cpu", RESULT)]
    assert client.calls.index(("complete", 5)) < client.calls.index(("lease", None))  # before any new trial
    text = out.getvalue()
    assert "1 undelivered result(s) for this service" in text
    assert "1 spooled result(s) for other services (http://elsewhere:8000)" in text
    assert [e.api for e in spool.pending()] == ["http://elsewhere:8000"]  # left for a worker of that service


def test_a_result_the_service_will_not_take_is_kept_in_rejected_and_said(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool")
    spool.put(SpoolEntry(api="http://fake", trial_id=5, worker_id="w1", study="s", number=2, result=RESULT))
    client = ScriptedClient(known=[("s", 5, 2)])
    reaped = ("cannot complete trial 5: its lease was reaped: no heartbeat within the grace period, the trial is "
              "marked FAIL (lost); stop running it and lease a new trial")
    client.complete_errors = [Conflict(409, reaped, "POST", "/v1/trials/5/complete")]
    out = io.StringIO()
    assert make_worker(client, ["unused"], spool.root, out, idle_exit_s=0.2).run() == 0
    (rejected,) = spool.rejected()
    assert rejected.result == RESULT and rejected.reason == f"HTTP 409: {reaped}"
    text = out.getvalue()
    assert "spooled result of trial 2 of s (id 5) not taken by the service" in text
    assert f"kept in {rejected.path}" in text and spool.pending() == []


def test_a_leased_trial_whose_result_is_in_the_spool_is_delivered_not_run_again(tmp_path: Path) -> None:
    """The worker measured trial 7, could not deliver it, and its lease is still active: the
    service hands the same trial back at the next lease. It must not be measured twice."""
    ran = tmp_path / "ran"
    argv = fake_child(tmp_path, f"open({str(ran)!r}, 'w').close()\n")
    spool = Spool(tmp_path / "spool")
    spool.put(SpoolEntry(api="http://fake", trial_id=7, worker_id="w1", study="s", number=0, result=RESULT))
    client = ScriptedClient(leases=[make_lease(trial_id=7)])
    client.complete_errors = [ServiceUnavailable("http://fake", "ConnectError")]  # the round before the lease
    out = io.StringIO()
    assert make_worker(client, argv, spool.root, out, idle_exit_s=0.2).run() == 0
    assert not ran.exists()
    assert client.completed == [(7, "w1", RESULT)] and spool.pending() == []
    assert "measured already, its result is in the spool" in out.getvalue()


def test_a_trial_dropped_after_its_probe_finished_keeps_the_measurement(tmp_path: Path) -> None:
    class ConflictOnReport(ScriptedClient):
        def on_call(self, what: str) -> None:
            if what == "report":
                raise Conflict(409, "cannot report on trial 7: its lease was reaped", "POST", "/v1/trials/7/report")

    # the result is printed before the courier's 409 can reach the monitor: the child is done by then
    result_line = json.dumps({"type": "result", "result": RESULT})
    argv = child_printing(tmp_path, 0, f"""
print({result_line!r}, flush=True)
print(json.dumps({{"type": "report", "step": 99, "metrics": {{"throughput": 1.0}}}}), flush=True)
time.sleep(60)
""")
    client = ConflictOnReport()
    out = io.StringIO()
    run = make_worker(client, argv, tmp_path / "spool", out).run_trial(make_lease())
    assert run.dropped and "its lease was reaped" in run.dropped
    (kept,) = Spool(tmp_path / "spool").rejected()
    assert kept.result == RESULT and "no longer ours" in (kept.reason or "")
    assert client.completed == [] and f"its result is kept in {kept.path}" in out.getvalue()


def unauthorized_service(request: httpx.Request) -> httpx.Response:
    """A service restarted on another database: it knows none of the worker's tokens."""
    return httpx.Response(401, json={"detail": "invalid or revoked token"})


def test_a_401_keeps_the_result_and_names_the_likely_cause(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool")
    spool.put(SpoolEntry(api="http://svc", trial_id=5, worker_id="w1", study="s", number=2, result=RESULT))
    client = Client("http://svc", "tok", transport=httpx.MockTransport(unauthorized_service), max_backoff_s=0.01)
    out = io.StringIO()
    assert make_worker(client, ["unused"], spool.root, out).run() == 1
    text = out.getvalue()
    assert "does not accept this worker's token" in text and "another database" in text and "--db" in text
    assert "revoked" in text and "autotune token create --role worker" in text
    assert "1 result(s) not delivered" in text and str(spool.root) in text
    assert len(spool.pending()) == 1  # kept for the service on the right database


# --- --idle-exit without a service --------------------------------------------------------------------


def test_idle_exit_counts_time_without_a_reachable_service(tmp_path: Path) -> None:
    api = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    out = io.StringIO()
    worker = make_worker(Client(api, retry_for_s=None, max_backoff_s=0.1), ["unused"], tmp_path / "spool", out,
                         idle_exit_s=1.0)
    assert worker.run() == UNREACHABLE_EXIT
    text = out.getvalue()
    assert re.search(rf"could not reach the autotune service at {re.escape(api)} for \d+ s \(ConnectError", text), text
    assert "--idle-exit 1 s ran out" in text and "exiting after 0 trial(s)" in text


@pytest.mark.slow
def test_the_worker_command_exits_non_zero_when_no_service_answers(tmp_path: Path) -> None:
    api = f"http://127.0.0.1:{free_port()}"
    done = subprocess.run([*CLI, "worker", "--api", api, "--idle-exit", "1", "--spool-dir", str(tmp_path / "spool")],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "300"},
                          check=False)
    assert done.returncode == UNREACHABLE_EXIT, done.stdout + done.stderr
    assert f"could not reach the autotune service at {api}" in done.stdout
    assert f"spool    {tmp_path / 'spool'}" in done.stdout


def test_the_worker_retry_budget_comes_from_its_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """$AUTOTUNE_WORKER_RETRY_S sets how long one lease call or complete retries a service that
    does not answer (the default otherwise); a value that is not a positive number is refused."""
    monkeypatch.delenv(RETRY_ENV, raising=False)
    assert service_retry_s(LEASE_RETRY_S) == LEASE_RETRY_S == 10.0 and service_retry_s(COMPLETE_RETRY_S) == 10.0
    monkeypatch.setenv(RETRY_ENV, " 2.5 ")
    assert service_retry_s(LEASE_RETRY_S) == service_retry_s(COMPLETE_RETRY_S) == 2.5
    for bad in ("0", "-1", "soon", "nan", "inf"):
        monkeypatch.setenv(RETRY_ENV, bad)
        with pytest.raises(ValueError, match=RETRY_ENV):
            service_retry_s(LEASE_RETRY_S)


def test_the_worker_command_refuses_a_bad_retry_budget(tmp_path: Path) -> None:
    done = subprocess.run([*CLI, "worker", "--api", f"http://127.0.0.1:{free_port()}", "--idle-exit", "1",
                           "--spool-dir", str(tmp_path / "spool")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "300", RETRY_ENV: "soon"}, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"${RETRY_ENV} must be a positive number of seconds, not 'soon'" in done.stderr


# --- the real service, killed mid-probe ---------------------------------------------------------------


def stored_windows(db: Path, study: str) -> list[float]:
    import optuna

    trial = optuna.load_study(study_name=study, storage=f"sqlite:///{db}").trials[0]
    windows: list[float] = trial.user_attrs["measurement"]["window_throughputs"]  # the probe's fields, one attr
    return windows


@pytest.mark.slow
def test_a_service_killed_mid_probe_gets_the_result_from_the_spool(processes: Processes, tmp_path: Path,
                                                                   tiny_datasets: Any) -> None:
    """SIGKILL the service while the probe's timed windows run; restart it on the same database
    once the worker has given up completing and kept the result in its spool. The trial ends
    COMPLETE with the throughput the worker measured, every timed window in it."""
    db = tmp_path / "autotune.db"
    service = LiveService(processes, db).start()
    # 600 samples: 8 windows of 18 steps, the last seven run well after the first window's report
    service.submit(small_spec("outage", n_trials=1, samples=600, probe={"windows": 8},
                              pruning={"enabled": False}))
    spool = tmp_path / "spool"
    worker = start_worker(processes, service.url, "--study", "outage", "--max-trials", "1", "--spool-dir", str(spool),
                          "--worker-id", "outage-w",
                          # its complete gives up on the killed service after 2 s, not 10: the same spooling, sooner
                          env={"COLUMNS": "300", "AUTOTUNE_WORKER_RETRY_S": "2"})
    wait_until(lambda: probe_children(worker.pid), 60, "a probe child")
    wait_until(lambda: reports_stored(db) >= 1, 60, "the first timed window's report")
    assert service.proc is not None
    os.killpg(service.proc.pid, signal.SIGKILL)  # mid-probe: the other windows run without a service
    service.proc.wait()
    wait_until(lambda: "kept in" in log_text(worker), 120, "the worker to keep the result in its spool")
    (kept,) = Spool(spool).pending()
    assert kept.measured and kept.worker_id == "outage-w"
    service.start()  # same database, same port
    assert worker.wait(timeout=120) == 0, log_text(worker)[-3000:]
    log = log_text(worker)
    assert "spooled result of trial 0 of outage (id" in log and "delivered → COMPLETE" in log, log[-3000:]
    (trial,) = service.trials("outage")
    assert trial["state"] == "COMPLETE" and trial["worker_id"] == "outage-w", trial
    printed = re.search(r"trial 0 \([\d.]+ s\): ([\d,.]+) samples/s", log)
    assert printed is not None
    assert f"{trial['throughput_samples_per_s']:,.1f}" == printed.group(1)  # the worker's measurement
    assert trial["throughput_samples_per_s"] == kept.result["throughput_samples_per_s"]
    windows = stored_windows(db, "outage")
    assert len(windows) == 8 and min(windows) > 0
    # an outage that reached into the timed windows would stall one for seconds (a window is ~0.3 s)
    assert min(windows) > 0.2 * sorted(windows)[4], windows
    # delivered: the worker removes its file just after the service's answer (the trial shows COMPLETE first)
    wait_until(lambda: Spool(spool).pending() == [], 60, "the delivered result to leave the spool")
    assert Spool(spool).rejected() == []
