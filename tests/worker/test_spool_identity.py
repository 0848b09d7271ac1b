"""A spooled result goes only to the service and study it was leased from, and a trial whose
result was just delivered is not run again (issue 35: D2, D4).

Trial ids restart at 1 in every database: a service restarted on another database file (a
backup taken before any study, same tokens, or --no-auth) holds another trial under the id of a
spooled result. These tests run `Worker` in-process against a scripted service over HTTP
(a real `Client` on httpx's MockTransport); tests/worker/test_spool_restart.py runs the real
service and a real worker in subprocesses and restarts the service on another database, or on
the same one.
"""

from __future__ import annotations

import io
import json
import re
import sqlite3
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from rich.console import Console
from worker_fakes import HARDWARE, fake_child

from autotune.api.db import upgrade_schema
from autotune.api.main import create_app
from autotune.api.settings import Settings
from autotune.contract.protocol import ProbeSpec
from autotune.contract.results import LeaseRequest, TrialLease
from autotune.worker import delivery as delivery_module
from autotune.worker import loop as worker_module
from autotune.worker.client import Client
from autotune.worker.loop import Worker
from autotune.worker.options import WorkerOptions
from autotune.worker.spool import Spool, SpoolEntry

RESULT = {"workload": "ups", "preset": "tiny", "config": {"batch_size": 4}, "device": "cpu", "torch_version": "x",
          "throughput_samples_per_s": 5.0, "window_throughputs": [5.0, 5.0, 5.0], "val_nrmse": 0.5, "failure": None}
OURS = {**RESULT, "throughput_samples_per_s": 111.0}  # the spooled measurement (of study "rel")
THEIRS = {**RESULT, "throughput_samples_per_s": 222.0}  # what a probe of the other study measures


class FakeService:
    """A service over HTTP (httpx.MockTransport) with the real routes' answers: its id, its
    studies' trials (trial id -> (study, number)), leases handed out in turn, the completes it
    took; every call is refused (connection error) for `down_s` from the first."""

    def __init__(self, service_id: str, trials: dict[int, tuple[str, int]], leases: list[int] | None = None,
                 down_s: float = 0.0, refuse: int | None = None, tokens: dict[int, str] | None = None) -> None:
        self.service_id = service_id
        self.trials = trials
        self.tokens = tokens or {}  # trial id -> its lease's token here (none: a service of before tokens)
        self.completes: list[dict[str, Any]] = []  # every complete's body, as sent
        self.leases = list(leases or [])
        self.down_s = down_s
        self.first: float | None = None
        self.refuse = refuse  # a complete of a measurement answered 422 (another config), then failure records taken
        self.completed: dict[int, dict[str, Any]] = {}
        self.calls: list[str] = []
        self.lock = threading.Lock()

    def client(self) -> Client:
        return Client("http://svc", "tok", transport=httpx.MockTransport(self.handle), max_backoff_s=0.01)

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.first = self.first or time.monotonic()
        if time.monotonic() < self.first + self.down_s:
            raise httpx.ConnectError("connection refused", request=request)
        path = request.url.path
        with self.lock:
            self.calls.append(f"{request.method} {path}")
        if path == "/v1/health":
            return httpx.Response(200, json={"status": "ok", "db": "sqlite", "version": "t",
                                             "service_id": self.service_id})
        if path == "/v1/trials/lease":
            if not self.leases:
                return httpx.Response(204)
            trial_id = self.leases.pop(0)
            study, number = self.trials[trial_id]
            lease = TrialLease(trial_id=trial_id, study=study, number=number, params={"batch_size": 4},
                               config={"batch_size": 4}, workload="ups", preset="tiny",
                               probe=ProbeSpec(samples=40, timeout_s=60), lease_token=self.tokens.get(trial_id))
            return httpx.Response(200, json=lease.model_dump(mode="json"))
        listing = re.fullmatch(r"/v1/studies/([^/]+)/trials", path)
        if listing:
            data = [{"trial_id": i, "number": n, "state": "RUNNING", "params": {}}
                    for i, (s, n) in self.trials.items() if s == listing.group(1)]
            if not data:
                return httpx.Response(404, json={"detail": f"study {listing.group(1)!r} not found"})
            return httpx.Response(200, json={"data": data, "count": len(data)})
        call = re.fullmatch(r"/v1/trials/(\d+)/(\w+)", path)
        assert call is not None, path
        trial_id, verb = int(call.group(1)), call.group(2)
        if trial_id not in self.trials:
            return httpx.Response(404, json={"detail": f"trial {trial_id} not found"})
        body = json.loads(request.content)
        if verb == "heartbeat":
            return httpx.Response(200, json={"action": "continue"})
        if verb == "report":
            return httpx.Response(200, json={"prune": False})
        self.completes.append(body)
        if "lease_token" in body and body["lease_token"] != self.tokens.get(trial_id):  # checked first, as the service
            return httpx.Response(409, json={"detail": f"cannot complete trial {trial_id}: this result was measured "
                                                       f"for another lease of trial {trial_id} than the one this "
                                                       "service holds (another database, ...); nothing is stored"})
        if trial_id in self.completed:
            return httpx.Response(409, json={"detail": f"cannot complete trial {trial_id}: it is already completed "
                                                       f"(by worker {body['worker_id']!r}); its result stands"})
        if self.refuse == trial_id and not body["result"].get("failure"):
            return httpx.Response(422, json={"detail": "result.config: not the leased config (batch_size: 8 != 4)"})
        self.completed[trial_id] = body["result"]
        study, number = self.trials[trial_id]
        return httpx.Response(200, json={"trial_id": trial_id, "number": number, "params": {},
                                         "state": "FAIL" if body["result"].get("failure") else "COMPLETE"})


def spooled(spool: Spool, service_id: str | None, study: str = "rel", trial_id: int = 1, number: int = 0,
            token: str | None = None) -> Path:
    """A result in the spool as a worker leaves it, of service `service_id` (None: an older worker's
    file, without one) and lease token `token`. The file is written as JSON, so a worker of any
    version reads it."""
    path = spool.put(SpoolEntry(api="http://svc", trial_id=trial_id, worker_id="w1", study=study, number=number,
                                result=OURS, lease_token=token))
    path.write_text(json.dumps({**json.loads(path.read_text()), "service_id": service_id}))
    return path


def run_worker(service: FakeService, spool: Spool, argv: list[str], idle_exit_s: float) -> str:
    out = io.StringIO()
    options = WorkerOptions(worker_id="w1", child_argv=argv, spool_dir=spool.root, idle_exit_s=idle_exit_s)
    worker = Worker(options, HARDWARE, client=service.client(), console=Console(file=out, width=400))
    assert worker.run() == 0, out.getvalue()
    return out.getvalue()


def probe_printing(tmp_path: Path, result: dict[str, Any]) -> list[str]:
    """A fake probe that notes it ran (tmp_path/ran) and prints `result`."""
    return fake_child(tmp_path, f"""
import json
open({str(tmp_path / 'ran')!r}, "a").write("ran\\n")
print(json.dumps({{"type": "result", "result": {result!r}}}), flush=True)
""")


# --- D2: only to the service and study it was leased from ----------------------------------------------


def test_a_spooled_result_waits_for_the_service_it_was_leased_from(tmp_path: Path) -> None:
    """The service answers at the same URL but is another one (another database, the same
    tokens): its trial 1 is another study's. The result is not handed to it, and the worker
    says where it belongs."""
    spool = Spool(tmp_path / "spool")
    path = spooled(spool, "svc-A")
    service = FakeService("svc-B", {1: ("other", 0)})
    text = run_worker(service, spool, ["unused"], idle_exit_s=0.3)
    assert service.completed == {}
    assert [e.path for e in spool.pending()] == [path] and spool.rejected() == []
    said = " ".join(text.split())
    assert "spooled result of trial 0 of rel (id 1): not delivered" in said, text
    assert "belongs to service svc-A at http://svc, study 'rel', trial 0 (id 1)" in said
    assert "is now service svc-B (another database" in said


def test_a_restored_copy_with_the_same_id_does_not_get_another_studys_trial(tmp_path: Path) -> None:
    """A backup of the database (same service id) holds no study 'rel'; its trial 1 is trial 0 of
    'other', leased to this worker. The worker runs that trial and completes it with its own
    measurement; the spooled one of 'rel' stays in the spool, for the service it came from."""
    spool = Spool(tmp_path / "spool")
    path = spooled(spool, "svc-A")
    service = FakeService("svc-A", {1: ("other", 0)}, leases=[1])
    text = run_worker(service, spool, probe_printing(tmp_path, THEIRS), idle_exit_s=0.5)
    assert (tmp_path / "ran").exists()
    assert service.completed == {1: THEIRS}  # its own measurement, never the spooled one of 'rel'
    (kept,) = spool.pending()
    assert kept.path == path and kept.result == OURS and kept.study == "rel"
    said = " ".join(text.split())
    assert "▶ trial 0 of other (id 1)" in said
    assert "belongs to service svc-A at http://svc, study 'rel', trial 0 (id 1)" in said
    assert "has no study 'rel'" in said


def test_a_spooled_result_is_not_matched_to_another_trial_number(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool")
    spooled(spool, None, study="rel", trial_id=1, number=0)  # spooled by an older worker: no service id
    service = FakeService("svc-B", {1: ("rel", 3)})  # a study of the same name, where id 1 is trial 3
    text = run_worker(service, spool, ["unused"], idle_exit_s=0.3)
    assert service.completed == {} and len(spool.pending()) == 1
    assert "has trial id 1 as trial 3 of study 'rel'" in " ".join(text.split())


def test_a_spooled_result_of_the_same_service_and_study_is_delivered(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool")
    spooled(spool, "svc-A")
    service = FakeService("svc-A", {1: ("rel", 0)})
    text = run_worker(service, spool, ["unused"], idle_exit_s=0.3)
    assert service.completed == {1: OURS} and spool.pending() == []
    assert "spooled result of trial 0 of rel (id 1) delivered → COMPLETE" in text
    assert ["lease_token" in body for body in service.completes] == [False]  # none known: none sent (older services)


def test_a_spooled_result_of_another_lease_of_the_same_trial_is_kept_and_the_lease_is_run(tmp_path: Path) -> None:
    """A backup taken before any study: the same service id, and a study 'rel' of the same name whose
    trial 0 has id 1 too, leased to this worker. Only the lease token tells that the spooled result
    of rel's trial 0 is another lease's: it is not delivered (the service refuses it), nor delivered
    instead of running the lease; the worker runs the lease and completes it with its own
    measurement; the spooled one stays kept (not rejected), naming where it belongs."""
    spool = Spool(tmp_path / "spool")
    path = spooled(spool, "svc-A", token="a" * 32)
    service = FakeService("svc-A", {1: ("rel", 0)}, leases=[1], tokens={1: "b" * 32})
    text = run_worker(service, spool, probe_printing(tmp_path, THEIRS), idle_exit_s=0.5)
    assert (tmp_path / "ran").exists(), text
    assert service.completed == {1: THEIRS}  # its own measurement, never the spooled one of the other lease
    assert [body.get("lease_token") for body in service.completes][-1] == "b" * 32
    assert "a" * 32 in [body.get("lease_token") for body in service.completes]  # offered with its own token
    (kept,) = spool.pending()
    assert kept.path == path and kept.result == OURS and spool.rejected() == []
    said = " ".join(text.split())
    assert "▶ trial 0 of rel (id 1)" in said
    assert "measured already" not in said
    assert ("it belongs to service svc-A at http://svc, study 'rel', trial 0 (id 1); the service at http://svc "
            "holds trial id 1 under another lease") in said, said


def test_a_spooled_result_of_the_same_lease_is_delivered_instead_of_running_it(tmp_path: Path) -> None:
    """The lease handed back is the one the spooled result was measured for (its token): delivered, not run."""
    spool = Spool(tmp_path / "spool")
    spooled(spool, "svc-A", token="a" * 32)
    service = FakeService("svc-A", {1: ("rel", 0)}, leases=[1], tokens={1: "a" * 32})
    client = service.client()
    # the lease comes before the spool's delivery round (the service was away at the worker's start)
    out = io.StringIO()
    worker = Worker(WorkerOptions(worker_id="w1", child_argv=probe_printing(tmp_path, THEIRS), spool_dir=spool.root,
                                  idle_exit_s=0.5), HARDWARE, client=client, console=Console(file=out, width=400))
    got = client.lease(LeaseRequest(worker_id="w1", hardware="cpu"))
    assert got is not None and got.lease_token == "a" * 32
    worker.learn_service_id(got)
    assert worker._deliver_instead(got)
    assert not (tmp_path / "ran").exists() and service.completed == {1: OURS} and spool.pending() == []
    assert "measured already, its result is in the spool: delivering it" in " ".join(out.getvalue().split())


def test_a_refused_result_says_what_became_of_the_trial(tmp_path: Path) -> None:
    """422: the trial is failed (kind error) and the service does not re-run it: the rejected file
    and the console say so, not that the service re-runs it."""
    spool = Spool(tmp_path / "spool")
    spooled(spool, "svc-A", study="rel")
    service = FakeService("svc-A", {1: ("rel", 0)}, refuse=1)
    text = run_worker(service, spool, ["unused"], idle_exit_s=0.3)
    assert service.completed[1]["failure"]["kind"] == "error"
    (rejected,) = spool.rejected()
    assert rejected.result == OURS
    assert "completed as failed (kind error" in (rejected.reason or "") and "does not re-run it" in rejected.reason
    said = " ".join(text.split())
    assert "does not re-run it" in said and "re-runs or has re-run" not in said


# --- D4: a trial whose result was just delivered is not run again ------------------------------------------


def test_a_lease_handed_back_before_its_spooled_result_went_in_is_not_run(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The service restarts while the worker holds trial 1's result in its spool; the worker's lease
    call reaches the restarted service first, which hands back trial 1 (its lease is still
    active); then the worker delivers its spool, trial 1's result included. The lease it holds
    names a finished trial: it must not run it."""
    monkeypatch.setattr(worker_module, "LEASE_RETRY_S", 0.2)
    spool = Spool(tmp_path / "spool")
    spooled(spool, "svc-A", study="s")
    # away longer than the first delivery round (SPOOL_RETRY_S): then a lease call fails, and the next gets trial 1
    service = FakeService("svc-A", {1: ("s", 0)}, leases=[1], down_s=delivery_module.SPOOL_RETRY_S + 0.5)
    text = run_worker(service, spool, probe_printing(tmp_path, THEIRS), idle_exit_s=delivery_module.SPOOL_RETRY_S + 2)
    assert not (tmp_path / "ran").exists(), text
    assert service.completed == {1: OURS} and spool.pending() == []
    said = " ".join(text.split())
    assert "answers again" in said and "spooled result of trial 0 of s (id 1) delivered → COMPLETE" in said, said
    assert "trial 0 of s (id 1): its result was delivered from the spool just now: not run again" in said
    assert "▶ trial" not in said


def test_another_worker_on_the_spool_delivering_it_counts_too(tmp_path: Path) -> None:
    """The settled note is on disk: a lease whose trial another worker of this spool delivered is not run."""
    spool = Spool(tmp_path / "spool")
    spooled(spool, "svc-A", study="s")
    (entry,) = spool.pending()
    spool.settle(entry)
    spool.remove(entry)
    assert spool.settled("http://svc", "w1", 1, "s", 0, "svc-A")
    assert not spool.settled("http://svc", "w1", 1, "other", 0, "svc-A")  # another study's trial 1
    assert not spool.settled("http://svc", "w1", 1, "s", 0, "svc-B")  # another service's
    service = FakeService("svc-A", {1: ("s", 0)}, leases=[1])
    run_worker(service, spool, probe_printing(tmp_path, THEIRS), idle_exit_s=1.5)
    assert not (tmp_path / "ran").exists() and service.completed == {}


# --- the service's identity ------------------------------------------------------------------------------


def health_of(url: str) -> dict[str, Any]:
    with TestClient(create_app(Settings(db_url=url, auth=False, reaper_interval_s=3600.0))) as client:
        reply: dict[str, Any] = client.get("/v1/health").json()
        return reply


def test_each_database_has_its_own_service_id_and_a_restart_keeps_it(tmp_path: Path) -> None:
    first, second = f"sqlite:///{tmp_path}/a.db", f"sqlite:///{tmp_path}/b.db"
    a = health_of(first)["service_id"]
    assert str(uuid.UUID(a)) == a
    assert health_of(first)["service_id"] == a  # restarted on the same database: the same service
    assert health_of(second)["service_id"] != a  # another database: another service
    old = f"sqlite:///{tmp_path}/old.db"
    upgrade_schema(old, "0002")  # a database of before the identity: the upgrade gives it one
    with sqlite3.connect(tmp_path / "old.db") as conn:
        assert "autotune_service" not in {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
    upgrade_schema(old)
    assert health_of(old)["service_id"] not in (None, a)
