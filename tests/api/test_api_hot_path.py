"""The hot path (lease, report, complete) without full-study reads: replies built from data in
hand, the gate cached per study, the measurement written as one attr, the sampler reading Optuna's storage."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from service_helpers import StudyFactory, complete, lease, tuning_service

from autotune.api import crud


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


def test_complete_writes_the_measurement_as_one_attr(app: FastAPI, client: TestClient, make_study: StudyFactory,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Optuna's public API writes one user attr per transaction: the probe's measurement (thirty
    fields) goes into one, and attrs the lease wrote already are not written again."""
    make_study("s")
    got = lease(client, "w1")
    assert got is not None
    bridge = tuning_service(app).bridge
    keys: list[str] = []
    original = bridge.storage.set_trial_user_attr
    monkeypatch.setattr(bridge.storage, "set_trial_user_attr",
                        lambda trial_id, key, value: keys.append(key) or original(trial_id, key, value))
    complete(client, got, "w1")
    assert "measurement" in keys and "worker_id" not in keys and len(keys) <= 6, keys
    stored = bridge.storage.get_trial(got["trial_id"])
    measured = set(stored.user_attrs["measurement"])
    assert {"device", "knobs", "throughput_samples_per_s", "window_throughputs"} <= measured
    record = bridge.get_trial(got["trial_id"])
    assert record is not None and record.user_attrs["device"] == stored.user_attrs["measurement"]["device"]


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


def test_the_sampler_reads_what_the_storage_holds(app: FastAPI, client: TestClient,
                                                 make_study: StudyFactory) -> None:
    """The TPE sampler reads the study through Optuna's own storage (no view of autotune's):
    after leases, completes and a failure, its trials are the storage's, a failed probe FAIL
    without values, every completed trial with its measured values."""
    import optuna

    make_study("s", sampler="tpe", n_trials=20)
    service = tuning_service(app)
    base = lease(client, "w")
    assert base is not None
    complete(client, base, "w", throughput=80.0)
    running = []
    for i in range(12):
        got = lease(client, f"w{i}")
        assert got is not None
        running.append((got, f"w{i}"))
        if i % 3 == 2:  # keep a few running (constant liar), finish the others
            first, worker = running.pop(0)
            complete(client, first, worker, throughput=100.0 + i,
                     failure={"kind": "oom", "message": "x"} if i == 5 else None)
    seen = service.bridge._handles["s"].study.get_trials(deepcopy=False)
    stored = optuna.load_study(study_name="s", storage=service.bridge.storage.url).get_trials(deepcopy=False)
    assert [(t.number, t.state, t.params, t.values) for t in seen] == \
        [(t.number, t.state, t.params, t.values) for t in stored]
    # TPE may draw a config already tried: that draw is PRUNED at once as a repeat (no values)
    assert {t.state.name for t in stored} - {"PRUNED"} == {"COMPLETE", "RUNNING", "FAIL"}
    for t in stored:
        if t.state.name == "PRUNED":
            assert "repeat_of" in t.user_attrs and t.values is None
    failed = [t for t in stored if t.state.name == "FAIL"]
    assert len(failed) == 1 and failed[0].values is None and failed[0].user_attrs["failure_kind"] == "oom"
    for t in stored:
        if t.state.name == "COMPLETE":
            assert t.values == [t.user_attrs["measurement"]["throughput_samples_per_s"],
                                t.user_attrs["measurement"]["quality"]]


def test_heartbeat_and_report_keep_a_lease_alive_without_the_study_lock(app: FastAPI, client: TestClient,
                                                                       make_study: StudyFactory) -> None:
    make_study("s")
    got = lease(client, "w1")
    assert got is not None
    lock = tuning_service(app)._study_lock("s")
    assert lock.acquire(timeout=1)
    try:  # another thread would hold the lock while it asks or tells: beats and reports go on
        beat = client.post(f"/v1/trials/{got['trial_id']}/heartbeat", json={"worker_id": "w1"}).json()
        assert beat["action"] == "continue"
        r = client.post(f"/v1/trials/{got['trial_id']}/report", json={"worker_id": "w1", "step": 1, "metrics": {}})
        assert r.status_code == 200
    finally:
        lock.release()
