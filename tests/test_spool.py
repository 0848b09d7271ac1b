"""autotune.spool: the worker's undelivered results on disk, and what each reply of the service
does to them (a real `Client` over a mock transport, so the service's status codes and words
are read as the worker reads them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from autotune.client import Client
from autotune.spool import SPOOL_ENV, Spool, SpoolEntry, default_spool_dir, deliver

API = "http://svc:8000"
RESULT = {"workload": "ups", "preset": "tiny", "config": {"batch_size": 4}, "device": "cpu", "torch_version": "x",
          "throughput_samples_per_s": 123.5, "window_throughputs": [120.0, 125.0, 126.0], "val_nrmse": 0.1,
          "failure": None, "stopped_early": False}
INFO = {"trial_id": 7, "number": 3, "state": "COMPLETE", "params": {"batch_size": 4}, "feasible": True}


def entry(trial_id: int = 7, worker_id: str = "host-123-cpu", api: str = API) -> SpoolEntry:
    return SpoolEntry(api=api, trial_id=trial_id, worker_id=worker_id, study="s", number=3, result=dict(RESULT))


def client_for(status: int, detail: Any = None, seen: list[dict[str, Any]] | None = None) -> Client:
    def handler(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append({"path": request.url.path, **json.loads(request.content)})
        if status == 200:
            return httpx.Response(200, json=INFO)
        return httpx.Response(status, json={"detail": detail})

    return Client(API, "tok", transport=httpx.MockTransport(handler), max_backoff_s=0.01)


def test_the_default_spool_is_state_that_outlives_the_worker(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(SPOOL_ENV, raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert default_spool_dir() == tmp_path / "state" / "autotune" / "spool"
    monkeypatch.setenv(SPOOL_ENV, str(tmp_path / "mine"))
    assert default_spool_dir() == tmp_path / "mine"


def test_put_writes_one_whole_file_per_trial_and_worker(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool")
    path = spool.put(entry())
    assert path.parent == spool.root and path.name.startswith("trial-7-") and path.suffix == ".json"
    assert [p.name for p in spool.root.iterdir()] == [path.name]  # no temp file left behind
    data = json.loads(path.read_text())
    assert data["result"] == RESULT and data["worker_id"] == "host-123-cpu" and data["api"] == API
    spool.put(entry())  # the same trial, service and worker again: one file
    spool.put(entry(worker_id="other"))  # another worker's (a restarted worker with a new id): its own file
    assert len(list(spool.root.glob("*.json"))) == 2
    (pending,) = [e for e in spool.pending(API) if e.worker_id == "host-123-cpu"]
    assert pending.result == RESULT and pending.path == path and pending.label == "trial 3 of s (id 7)"
    assert pending.measured
    assert spool.pending("http://another:8000") == []
    assert spool.find(API, 7, "host-123-cpu") is not None and spool.find(API, 8, "host-123-cpu") is None


def test_a_file_that_is_not_an_entry_is_skipped_and_left_alone(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    (tmp_path / "trial-1-broken.json").write_text("{not json")
    spool.put(entry())
    assert [e.trial_id for e in spool.pending()] == [7]
    assert (tmp_path / "trial-1-broken.json").exists()


def test_reject_keeps_the_result_with_its_reason_and_never_overwrites(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    first = entry()
    spool.put(first)
    moved = spool.reject(first, "HTTP 409: its lease was reaped")
    assert moved.parent == spool.rejected_dir and spool.pending() == []
    data = json.loads(moved.read_text())
    assert data["reason"] == "HTTP 409: its lease was reaped" and data["result"] == RESULT and data["rejected_at"]
    second = entry()
    spool.put(second)
    spool.reject(second, "again")
    assert len(spool.rejected()) == 2


def test_claim_holds_a_file_against_a_second_deliverer(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    mine = entry()
    spool.put(mine)
    with spool.claim(mine) as first, spool.claim(spool.pending()[0]) as second:
        assert first and not second
    spool.remove(mine)
    with spool.claim(mine) as gone:
        assert not gone


@pytest.mark.parametrize(("status", "detail", "outcome", "where"), [
    (200, None, "delivered", "gone"),
    # a re-delivery after a lost reply: the service keeps the first
    (409, "cannot complete trial 7: it is already completed (by worker 'host-123-cpu'); its result stands, "
          "nothing more is taken for it: lease a new trial", "already", "gone"),
    (409, "cannot complete trial 7: it is already completed; lease a new trial", "already", "gone"),
    # someone else's result stands: ours is kept aside, not deleted
    (409, "cannot complete trial 7: it is already completed (by worker 'elsewhere'); its result stands",
     "rejected", "rejected"),
    (409, "cannot complete trial 7: its lease was reaped: no heartbeat within the grace period, the trial is "
          "marked FAIL (lost); stop running it and lease a new trial", "rejected", "rejected"),
    (409, "cannot complete trial 7: it is leased to worker 'b', not 'host-123-cpu'; lease a new trial",
     "rejected", "rejected"),
    (422, [{"loc": ["body", "result", "quality"], "msg": "missing"}], "rejected", "rejected"),
    # the service does not know the trial or the token: another database? kept for the right one
    (409, "cannot complete trial 7: it was not leased by this service; lease a new trial", "kept", "pending"),
    (404, "trial 7 not found", "kept", "pending"),
    (401, "invalid or revoked token", "kept", "pending"),
    (503, "database unavailable", "unreachable", "pending"),
])
def test_each_reply_of_the_service_decides_where_the_result_goes(tmp_path: Path, status: int, detail: Any,
                                                                 outcome: str, where: str) -> None:
    spool = Spool(tmp_path)
    spooled = entry()
    path = spool.put(spooled)
    seen: list[dict[str, Any]] = []
    with client_for(status, detail, seen) as client:
        delivery = deliver(spool, client, spooled, retry_for_s=0.05)
    assert delivery.status == outcome, delivery
    # sent as the worker that measured it, with the result as spooled
    assert seen[0]["path"] == "/v1/trials/7/complete" and seen[0]["worker_id"] == "host-123-cpu"
    assert seen[0]["result"]["throughput_samples_per_s"] == 123.5
    if where == "gone":
        assert not path.exists() and spool.rejected() == []
    elif where == "pending":
        assert path.exists() and delivery.path == path
    else:
        (rejected,) = spool.rejected()
        assert not path.exists() and delivery.path == rejected.path
        assert rejected.result == RESULT and str(status) in (rejected.reason or "")
    if status == 422:  # the lease is ended by a failure record naming the refusal: the trial is not run again
        assert len(seen) == 2 and seen[1]["path"] == "/v1/trials/7/complete"
        assert seen[1]["result"]["failure"]["kind"] == "error" and "refused" in seen[1]["result"]["failure"]["message"]
    else:
        assert all(not request["result"].get("failure") for request in seen)
    if status == 401:
        assert delivery.unauthorized
        assert "another database" in delivery.message and "--db" in delivery.message
        assert "revoked" in delivery.message and "autotune token create --role worker" in delivery.message
    if status == 409 and where == "pending":
        assert "another database" in delivery.message


def test_an_unreachable_service_keeps_the_result(tmp_path: Path) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    spool = Spool(tmp_path)
    spooled = entry()
    path = spool.put(spooled)
    with Client(API, transport=httpx.MockTransport(refuse), max_backoff_s=0.01) as client:
        delivery = deliver(spool, client, spooled, retry_for_s=0.05)
    assert delivery.status == "unreachable" and "cannot reach the autotune service" in delivery.message
    assert path.exists() and spool.pending()[0].result == RESULT


def test_a_failure_record_the_service_will_not_take_is_dropped_not_kept(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    interrupted = {"kind": "interrupted", "message": "worker interrupted by SIGTERM"}
    failed = SpoolEntry(api=API, trial_id=7, worker_id="w1", study="s", number=3,
                        result={**RESULT, "failure": interrupted})
    path = spool.put(failed)
    assert not failed.measured
    with client_for(409, "cannot complete trial 7: its lease was reaped; lease a new trial") as client:
        delivery = deliver(spool, client, failed, retry_for_s=0.05)
    assert delivery.status == "rejected" and delivery.path is None
    assert not path.exists() and spool.rejected() == []  # it measured nothing: nothing to keep
