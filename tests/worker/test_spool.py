"""autotune.worker.spool: the worker's undelivered results on disk, and what each reply of the service
does to them (a real `Client` over a mock transport, so the service's status codes and words
are read as the worker reads them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from autotune.worker.client import Client
from autotune.worker.spool import SPOOL_ENV, Spool, SpoolEntry, belongs_to, default_spool_dir, deliver

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


# --- a folder per service identity ---------------------------------------------------------------------


def of(service_id: str | None, trial_id: int = 7, api: str = API, token: str | None = None) -> SpoolEntry:
    return SpoolEntry(api=api, trial_id=trial_id, worker_id="w1", study="s", number=3, result=dict(RESULT),
                      service_id=service_id, lease_token=token)


def test_each_service_has_its_own_folder_and_an_unknown_one_stays_at_the_top(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    a, b, unknown = of("svc-A"), of("svc-B", trial_id=8), of(None, trial_id=9)
    assert spool.put(a).parent == tmp_path / "svc-A" and spool.put(b).parent == tmp_path / "svc-B"
    assert spool.put(unknown).parent == tmp_path  # a lease made before the service's id was known
    # a worker of service A reads A's folder and the top, never B's
    assert [e.trial_id for e in spool.pending(API, services=("svc-A", None))] == [7, 9]
    assert [e.trial_id for e in spool.pending(services=("svc-B",))] == [8]
    assert sorted(e.trial_id for e in spool.pending()) == [7, 8, 9]  # everything, for `autotune spool list`
    # rejected and settled go to the service's folder too
    assert spool.reject(a, "HTTP 409: reaped").parent == tmp_path / "svc-A" / "rejected"
    assert [e.trial_id for e in spool.rejected(("svc-B", None))] == [] and len(spool.rejected()) == 1
    spool.settle(b)
    assert (tmp_path / "svc-B" / "settled" / b.filename).exists()
    assert spool.settled(API, "w1", 8, "s", 3, "svc-B") and not spool.settled(API, "w1", 8, "s", 3, "svc-A")
    assert spool.settled_notes(("svc-B",)) and not spool.settled_notes(("svc-A", None))


def test_a_service_id_that_is_no_plain_name_gets_a_hashed_folder(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    for sid in ("../../etc", "rejected", "settled", "a/b", ".hidden"):
        folder = spool.folder(sid)
        assert folder.parent == tmp_path and folder.name.startswith("service-"), sid
        spool.put(of(sid))
    assert len(spool.service_folders()) == 5 and {e.service_id for e in spool.pending()} == {
        "../../etc", "rejected", "settled", "a/b", ".hidden"}
    assert not (tmp_path.parent / "etc").exists() and spool.folder("0f6c2e9e-uuid") == tmp_path / "0f6c2e9e-uuid"


def flat(spool: Spool, entry: SpoolEntry, folder: str = "") -> Path:
    """`entry` where a worker of before the service folders wrote it: the top (or its rejected/)."""
    path = spool.root / folder / entry.filename
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(entry.to_json())
    return path


def test_the_flat_layout_of_older_workers_is_read_and_delivered(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    old = flat(spool, of("svc-A", token="t" * 32))
    refused = flat(spool, of("svc-A", trial_id=5), "rejected")
    (spool.settled_dir).mkdir()
    (spool.settled_dir / of("svc-A", trial_id=6).filename).touch()  # an older worker's settled note
    assert [e.path for e in spool.pending(API, services=("svc-A", None))] == [old]  # found by service A's worker
    assert [e.path for e in spool.rejected(("svc-A", None))] == [refused]
    assert spool.settled(API, "w1", 6, "s", 3, "svc-A")
    (entry,) = spool.pending()
    seen: list[dict[str, Any]] = []
    with client_for(200, seen=seen) as client:
        assert deliver(spool, client, entry, retry_for_s=0.05).status == "delivered"
    assert not old.exists() and seen[0]["lease_token"] == "t" * 32 and spool.pending() == []
    assert spool.settled(API, "w1", 7, "s", 3, "svc-A", lease_token="t" * 32)  # noted in A's folder now
    assert (tmp_path / "svc-A" / "settled").is_dir()


def test_the_inventory_tells_pending_settled_and_rejected_apart(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    waiting, leftover, refused = of("svc-A", 1), of("svc-A", 2), of(None, 3)
    for e in (waiting, leftover, refused):
        spool.put(e)
    spool.settle(leftover)  # delivered, its file not removed yet (a worker killed in between)
    spool.reject(refused, "HTTP 422: another config")
    states = {row.entry.trial_id: row.state for row in spool.inventory()}
    assert states == {1: "pending", 2: "settled", 3: "rejected"}
    assert [row.entry.trial_id for row in spool.inventory(("svc-A",))] == [1, 2]


def test_prune_removes_only_empty_folders(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    gone, kept = of("svc-A"), of("svc-B")
    spool.put(gone)
    spool.settle(gone)
    spool.put(kept)
    spool.remove(gone)
    for note in spool.settled_notes(("svc-A",)):
        note.unlink()
    spool.prune()
    assert not (tmp_path / "svc-A").exists() and kept.path is not None and kept.path.exists()
    spool.put(of("svc-A"))  # a worker writing into a pruned folder makes it again
    assert len(spool.pending()) == 2


def test_belongs_to_goes_by_service_id_and_by_url_where_an_id_is_unknown() -> None:
    assert belongs_to(of("svc-A"), API, "svc-A")
    assert belongs_to(of("svc-A", api="http://old-address:8000"), API, "svc-A")  # the id names the database
    assert not belongs_to(of("svc-B"), API, "svc-A")
    assert belongs_to(of(None), API + "/", "svc-A") and not belongs_to(of(None, api="http://x"), API, "svc-A")
    assert belongs_to(of("svc-B"), API, None)  # an older service shows no id: by URL


def test_a_worker_delivers_its_services_folder_and_names_the_others_in_one_line(tmp_path: Path) -> None:
    """The service at API is svc-B. The spool also holds a result of svc-A leased at the same URL
    (the service was restarted on another database) and one of svc-C at another URL: the worker
    delivers B's, does not offer A's or C's, and names each group in one line with the command
    that lists them."""
    import io

    from rich.console import Console

    from autotune.worker.hardware import Hardware
    from autotune.worker.loop import Worker
    from autotune.worker.options import WorkerOptions

    spool = Spool(tmp_path / "spool")
    ours, same_url, elsewhere = of("svc-B", 7), of("svc-A", 8), of("svc-C", 9, api="http://other:8000")
    for e in (ours, same_url, elsewhere):
        spool.put(e)
    completes: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/health":
            return httpx.Response(200, json={"status": "ok", "db": "sqlite", "version": "t", "service_id": "svc-B"})
        if path == "/v1/trials/lease":
            return httpx.Response(204)
        if path == "/v1/studies/s/trials":
            return httpx.Response(200, json={"data": [{"trial_id": 7, "number": 3, "state": "RUNNING", "params": {}}],
                                             "count": 1})
        if path.endswith("/complete"):
            completes.append(int(path.split("/")[3]))
            return httpx.Response(200, json=INFO)
        return httpx.Response(404, json={"detail": "no"})

    client = Client(API, "tok", transport=httpx.MockTransport(handler), max_backoff_s=0.01)
    out = io.StringIO()
    hardware = Hardware(hardware_class="cpu", device="cpu", device_name="cpu (test)", memory_bytes=None,
                        torch_version="x", hostname="h", cpu_count=2)
    worker = Worker(WorkerOptions(worker_id="w1", child_argv=["unused"], spool_dir=spool.root, idle_exit_s=0.3),
                    hardware, client=client, console=Console(file=out, width=400))
    assert worker.run() == 0
    text = out.getvalue()
    assert completes == [7] and [e.trial_id for e in spool.pending()] == [8, 9]
    command = f"autotune spool list --spool-dir {spool.root}"
    (other,) = [line for line in text.splitlines() if "other services" in line]
    assert "1 spooled result(s) for other services (service svc-C at http://other:8000)" in other
    assert other.endswith(command)
    (waits,) = [line for line in text.splitlines() if "wait for that service" in line]
    assert "1 spooled result(s) of service svc-A at http://svc:8000 wait for that service" in waits
    assert "is service svc-B now" in waits and waits.endswith(command)
    # never offered one by one (a worker of before the folders said "not delivered: it belongs to ..." for each)
    assert "spooled result of trial 3 of s (id 8)" not in text and "spooled result of trial 3 of s (id 9)" not in text
    assert "spooled result of trial 3 of s (id 7) delivered → COMPLETE" in text
