"""The hot path (lease, report, complete) without full-study reads: replies built from data in
hand, the gate cached per study, the TPE sampler's per-ask view of the trials, batched attrs."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from service_helpers import StudyFactory, complete, lease

from api import crud
from api.optuna_bridge import OptunaBridge
from api.service import TuningService


def _service(app: FastAPI) -> TuningService:
    service: TuningService = app.state.service
    return service


def test_replies_match_what_the_study_stores(client: TestClient, make_study: StudyFactory) -> None:
    """lease and complete build their replies without reading the trial back: they must say
    exactly what GET /trials says afterwards (gate and feasibility included)."""
    make_study("s", sampler="tpe", n_trials=8, baseline_seeds=2)
    base = lease(client, "w0")
    assert base is not None and base["is_baseline"]
    early = lease(client, "w1")  # the second seed, completed first: the gate is not known yet
    assert early is not None and early["is_baseline"]
    replies = {early["trial_id"]: complete(client, early, "w1", throughput=90.0, nrmse=0.1)}
    assert replies[early["trial_id"]]["feasible"] is None
    replies[base["trial_id"]] = complete(client, base, "w0", throughput=100.0, nrmse=0.1)
    for i, nrmse in enumerate([0.1, 0.5, 0.1]):
        got = lease(client, f"w{i + 2}")
        assert got is not None and got["config"] and not got["is_baseline"]
        replies[got["trial_id"]] = complete(client, got, f"w{i + 2}", throughput=120.0 + i, nrmse=nrmse)
    stored = {t["trial_id"]: t for t in client.get("/v1/studies/s/trials").json()["data"]}
    for trial_id, reply in replies.items():
        want = stored[trial_id]
        if trial_id == early["trial_id"]:  # feasibility is judged when asked: the gate came later
            want = {**want, "feasible": None}
        assert reply == want
    assert [stored[t]["feasible"] for t in replies][1:] == [True, True, False, True]


def test_complete_writes_attrs_values_and_state_in_one_transaction(app: FastAPI, client: TestClient,
                                                                   make_study: StudyFactory,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    make_study("s")
    got = lease(client, "w1")
    assert got is not None
    bridge = _service(app).bridge
    calls: list[Any] = []
    original = OptunaBridge._upsert_user_attrs
    monkeypatch.setattr(OptunaBridge, "_upsert_user_attrs",
                        lambda self, session, trial_id, attrs: calls.append(dict(attrs))
                        or original(self, session, trial_id, attrs))
    monkeypatch.setattr(bridge.storage, "set_trial_user_attr",
                        lambda *_a, **_k: pytest.fail("one attribute per transaction"))
    complete(client, got, "w1")
    assert len(calls) == 1 and {"device", "worker_id", "knobs", "failure_kind"} <= set(calls[0])


def test_report_reads_no_study_history(client: TestClient, make_study: StudyFactory,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    make_study("s")
    got = lease(client, "w1")
    assert got is not None
    monkeypatch.setattr(crud, "study_reports", lambda *_a: pytest.fail("report read every report of the study"))
    for step in range(3):
        r = client.post(f"/v1/trials/{got['trial_id']}/report",
                        json={"worker_id": "w1", "step": step, "metrics": {"loss": 0.5}})
        assert r.status_code == 200 and r.json()["prune"] is False


def test_report_on_a_completed_trial_is_409(client: TestClient, make_study: StudyFactory) -> None:
    make_study("s")
    got = lease(client, "w1")
    assert got is not None
    complete(client, got, "w1")
    r = client.post(f"/v1/trials/{got['trial_id']}/report", json={"worker_id": "w1", "step": 1, "metrics": {}})
    assert r.status_code == 409 and "completed" in r.json()["detail"]
    r = client.post("/v1/trials/9999/report", json={"worker_id": "w1", "step": 1, "metrics": {}})
    assert r.status_code == 404


def test_tpe_sampler_view_follows_the_study(app: FastAPI, client: TestClient, make_study: StudyFactory) -> None:
    """The TPE sampler reads the trials once per ask from a view kept in the process; after
    leases, completes and a failure the view must hold what the storage holds."""
    make_study("s", sampler="tpe", n_trials=20)
    service = _service(app)
    base = lease(client, "w")
    assert base is not None
    complete(client, base, "w")
    running = []
    for i in range(12):
        got = lease(client, f"w{i}")
        assert got is not None
        running.append((got, f"w{i}"))
        if i % 3 == 2:  # keep a few running (constant liar), finish the others
            first, worker = running.pop(0)
            complete(client, first, worker, failure={"kind": "oom", "message": "x"} if i == 5 else None)
    handle = service.bridge._handles["s"]
    assert handle.snapshot is not None
    study_id = service.bridge.study_id("s")
    with handle.snapshot.scope():
        view = handle.snapshot.get_all_trials(study_id, deepcopy=False)
    stored = [t for t in service.bridge.trials("s") if t.user_attrs.get("role") != "baseline"]
    # the sampler's view: the search trials only (a baseline seed is not one of its draws)
    assert [(t.number, t.state.name, t.params) for t in view] == [(t.number, t.state, t.params) for t in stored]
    # the failed trial is told COMPLETE (worst values, failed constraint) so that the sampler learns from it
    assert {t.state.name for t in view} == {"COMPLETE", "RUNNING"}
    assert any(t.user_attrs.get("failure_kind") == "oom" and t.state.name == "COMPLETE" for t in view)


def test_heartbeat_and_report_keep_a_lease_alive_without_the_study_lock(app: FastAPI, client: TestClient,
                                                                       make_study: StudyFactory) -> None:
    make_study("s")
    got = lease(client, "w1")
    assert got is not None
    lock = _service(app)._study_lock("s")
    assert lock.acquire(timeout=1)
    try:  # another thread would hold the lock while it asks or tells: beats and reports go on
        beat = client.post(f"/v1/trials/{got['trial_id']}/heartbeat", json={"worker_id": "w1"}).json()
        assert beat["action"] == "continue"
        r = client.post(f"/v1/trials/{got['trial_id']}/report", json={"worker_id": "w1", "step": 1, "metrics": {}})
        assert r.status_code == 200
    finally:
        lock.release()
