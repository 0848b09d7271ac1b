"""Lease tokens (issue 35, D2): every lease has a random token, and a call that carries one is
taken only for the lease holding it.

Trial ids restart at 1 in every database, and a backup keeps the service id of the database it
was copied from: a service restarted on a backup taken before any study, where a study of the
same name is submitted, holds a trial with the same id, study, number and even worker as the
one a worker measured on the original. Only the lease token tells the two leases apart. A call
without a token (an older worker) gets the older checks only; a complete repeated after success
with the same token is idempotent.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.testclient import TestClient
from service_helpers import StudyFactory, lease, make_settings, probe_result
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from autotune.api.backup import backup_sqlite
from autotune.api.main import create_app

TOKEN = re.compile(r"[0-9a-f]{32}")


def post_complete(client: TestClient, got: dict[str, Any], worker_id: str = "w1", token: Any = None,
                  **result: Any) -> Any:
    body: dict[str, Any] = {"worker_id": worker_id, "result": probe_result(got["config"], **result)}
    if token is not None:
        body["lease_token"] = token
    return client.post(f"/v1/trials/{got['trial_id']}/complete", json=body)


def trial_row(client: TestClient, study: str, trial_id: int) -> dict[str, Any]:
    row: dict[str, Any] = next(t for t in client.get(f"/v1/studies/{study}/trials").json()["data"]
                               if t["trial_id"] == trial_id)
    return row


def another_lease_message(trial_id: int) -> str:
    return f"this result was measured for another lease of trial {trial_id}"


def test_a_lease_has_a_token_the_same_when_handed_back_and_names_its_service(
        client: TestClient, make_study: StudyFactory) -> None:
    make_study("s", baseline_seeds=2)
    first = lease(client, "w1")
    again = lease(client, "w1")  # the worker's own active lease, handed back
    other = lease(client, "w2")
    assert first is not None and again is not None and other is not None
    assert TOKEN.fullmatch(first["lease_token"])
    assert again["trial_id"] == first["trial_id"] and again["lease_token"] == first["lease_token"]
    assert other["lease_token"] != first["lease_token"]
    service_id = client.get("/v1/health").json()["service_id"]
    assert first["service_id"] == again["service_id"] == service_id


def test_complete_with_another_leases_token_is_refused_and_changes_nothing(
        client: TestClient, make_study: StudyFactory) -> None:
    make_study("s")
    got = lease(client, "w1")
    assert got is not None
    wrong = "0" * 32
    r = post_complete(client, got, token=wrong, throughput=999.0)
    assert r.status_code == 409, r.text
    detail = r.json()["detail"]
    trial_id = got["trial_id"]
    assert detail.startswith(f"cannot complete trial {trial_id}: {another_lease_message(trial_id)}"), detail
    assert "another database, or a restored copy" in detail and "nothing is stored" in detail
    assert "keeps the result in its spool" in detail  # what the worker does with it
    assert trial_row(client, "s", trial_id)["state"] == "RUNNING"  # nothing stored, the lease still the worker's

    r = post_complete(client, got, token=got["lease_token"], throughput=50.0)
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "COMPLETE" and r.json()["throughput_samples_per_s"] == 50.0


def test_complete_with_its_token_is_idempotent_and_another_token_never_gets_the_stored_answer(
        client: TestClient, make_study: StudyFactory) -> None:
    make_study("s")
    got = lease(client, "w1")
    assert got is not None
    first = post_complete(client, got, token=got["lease_token"], throughput=50.0)
    again = post_complete(client, got, token=got["lease_token"], throughput=999.0,
                          failure={"kind": "oom", "message": "x"})
    assert first.status_code == again.status_code == 200, again.text
    # the same answer (duration_s aside: test_api_trials.py's idempotence test covers it)
    assert {k: v for k, v in again.json().items() if k != "duration_s"} == \
        {k: v for k, v in first.json().items() if k != "duration_s"}
    # the same worker and trial id with another lease's token: not "already completed" (a worker would
    # take that for its own result delivered), but another lease
    r = post_complete(client, got, token="f" * 32, throughput=777.0)
    assert r.status_code == 409 and another_lease_message(got["trial_id"]) in r.json()["detail"], r.text
    assert trial_row(client, "s", got["trial_id"])["throughput_samples_per_s"] == 50.0


def test_complete_without_a_token_gets_the_checks_of_before(client: TestClient, make_study: StudyFactory) -> None:
    make_study("s", baseline_seeds=2)
    got = lease(client, "w1")
    assert got is not None
    r = post_complete(client, got, worker_id="w2")  # another worker: the older refusal
    assert r.status_code == 409 and "leased to worker 'w1', not 'w2'" in r.json()["detail"], r.text
    r = post_complete(client, got, throughput=50.0)
    assert r.status_code == 200 and r.json()["state"] == "COMPLETE", r.text
    again = post_complete(client, got, throughput=999.0)  # a retry without the token: idempotent as before
    assert again.status_code == 200 and again.json()["throughput_samples_per_s"] == 50.0


def test_heartbeat_and_report_with_another_leases_token_are_refused(client: TestClient,
                                                                      make_study: StudyFactory) -> None:
    make_study("s")
    got = lease(client, "w1")
    assert got is not None
    trial_id, token = got["trial_id"], got["lease_token"]
    for verb, body in (("heartbeat", {}), ("report", {"step": 1, "metrics": {"loss": 0.5}})):
        r = client.post(f"/v1/trials/{trial_id}/{verb}", json={"worker_id": "w1", "lease_token": "1" * 32, **body})
        assert r.status_code == 409, r.text
        assert f"another lease of trial {trial_id}" in r.json()["detail"], r.text
        r = client.post(f"/v1/trials/{trial_id}/{verb}", json={"worker_id": "w1", "lease_token": token, **body})
        assert r.status_code == 200, r.text
        r = client.post(f"/v1/trials/{trial_id}/{verb}", json={"worker_id": "w1", **body})  # an older worker
        assert r.status_code == 200, r.text


def test_a_malformed_token_is_a_422(client: TestClient, make_study: StudyFactory) -> None:
    make_study("s")
    got = lease(client, "w1")
    assert got is not None
    for bad in (7, "", "a b", "x" * 65):
        r = post_complete(client, got, token=bad)
        assert r.status_code == 422, (bad, r.text)
        assert r.json()["detail"][0]["loc"] == ["body", "lease_token"]
    assert trial_row(client, "s", got["trial_id"])["state"] == "RUNNING"


def test_a_lease_from_before_tokens_takes_calls_without_one_only(app: FastAPI, client: TestClient,
                                                               make_study: StudyFactory, sqlite_url: str) -> None:
    """A lease made before migration 0004 has no token (NULL): handed back without one; a call
    that carries a token is for another lease."""
    make_study("s")
    got = lease(client, "w1")
    assert got is not None
    engine = create_engine(sqlite_url, poolclass=NullPool)
    with engine.begin() as conn:
        conn.execute(text("UPDATE autotune_leases SET token = NULL"))
    engine.dispose()
    again = lease(client, "w1")
    assert again is not None and again["trial_id"] == got["trial_id"] and again["lease_token"] is None
    r = post_complete(client, got, token=got["lease_token"])
    assert r.status_code == 409 and another_lease_message(got["trial_id"]) in r.json()["detail"], r.text
    assert post_complete(client, got, throughput=50.0).status_code == 200


def test_a_backup_with_a_study_of_the_same_name_does_not_take_the_originals_result(tmp_path: Path) -> None:
    """The fault-injection run's case, in one process: b.db is a backup of a.db taken before any
    study (the same service id). Both get a study 'rel'; worker w leases trial 0 (id 1) of each.
    A's result, sent to B with A's lease token, is refused; B takes its own; A takes A's."""
    a_url, b_url = f"sqlite:///{tmp_path}/a.db", f"sqlite:///{tmp_path}/b.db"
    with TestClient(create_app(make_settings(a_url))) as a:
        backup_sqlite(a_url, tmp_path / "b.db")
        assert a.post("/v1/studies", json={"name": "rel", "baseline_seeds": 1, "remeasure": {"top_k": 0},
                                           "probe": {"samples": 600}}).status_code == 201
        ours = lease(a, "w")
    with TestClient(create_app(make_settings(b_url))) as b:
        assert b.post("/v1/studies", json={"name": "rel", "baseline_seeds": 1, "remeasure": {"top_k": 0},
                                           "probe": {"samples": 80}}).status_code == 201
        theirs = lease(b, "w")
        assert ours is not None and theirs is not None
        assert (theirs["trial_id"], theirs["study"], theirs["number"], theirs["service_id"]) == \
            (ours["trial_id"], ours["study"], ours["number"], ours["service_id"])  # nothing else tells them apart
        assert theirs["lease_token"] != ours["lease_token"]
        r = post_complete(b, ours, worker_id="w", token=ours["lease_token"], throughput=111.0)
        assert r.status_code == 409 and another_lease_message(ours["trial_id"]) in r.json()["detail"], r.text
        assert trial_row(b, "rel", theirs["trial_id"])["state"] == "RUNNING"
        r = post_complete(b, theirs, worker_id="w", token=theirs["lease_token"], throughput=222.0)
        assert r.status_code == 200 and r.json()["throughput_samples_per_s"] == 222.0, r.text
    with TestClient(create_app(make_settings(a_url))) as a:
        r = post_complete(a, ours, worker_id="w", token=ours["lease_token"], throughput=111.0)
        assert r.status_code == 200 and r.json()["throughput_samples_per_s"] == 111.0, r.text
