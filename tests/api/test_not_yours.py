"""One answer for a trial that is not the caller's: heartbeat, report and complete all give
404 for no such trial, the same 409 for a trial held by another worker or whose lease was
reaped, and 409 "already completed" for a finished one (the completing worker's repeated
complete excepted: 200, the stored TrialInfo). A heartbeat's 200 "stop" is left for the
trial's holder (a stopped study). On SQLite and PostgreSQL."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

from fastapi import FastAPI
from fastapi.testclient import TestClient
from service_helpers import complete, lease, probe_result

from autotune.api.db import utcnow
from autotune.api.service import TuningService

VERBS = {"heartbeat": "heartbeat", "report": "report on", "complete": "complete"}
STOP = "stop running it and lease a new trial"


def _calls(client: TestClient, trial_id: int, worker_id: str, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """heartbeat, report and complete of `trial_id` by `worker_id`: the three responses."""
    bodies = {"heartbeat": {"worker_id": worker_id},
              "report": {"worker_id": worker_id, "step": 1, "metrics": {"loss": 0.5}},
              "complete": {"worker_id": worker_id, "result": probe_result(config)}}
    return {call: client.post(f"/v1/trials/{trial_id}/{call}", json=body) for call, body in bodies.items()}


def _one_answer(responses: dict[str, Any], trial_id: int) -> str:
    """Asserts all three are 409 with the same message but for the verb ("cannot <verb> trial
    N: <why>"); returns the shared <why>."""
    whys = set()
    for call, r in responses.items():
        assert r.status_code == 409, (call, r.status_code, r.text)
        detail = r.json()["detail"]
        match = re.fullmatch(rf"cannot {VERBS[call]} trial {trial_id}: (.+)", detail)
        assert match, (call, detail)
        whys.add(match.group(1))
    assert len(whys) == 1, whys
    return whys.pop()


def _trial(client: TestClient) -> dict[str, Any]:
    trials = client.get("/v1/studies/s/trials").json()["data"]
    assert len(trials) == 1, trials
    out: dict[str, Any] = trials[0]
    return out


def _study(client: TestClient) -> dict[str, Any]:
    r = client.post("/v1/studies", json={"name": "s", "baseline_seeds": 1, "remeasure": {"top_k": 0}})
    assert r.status_code == 201, r.text
    got = lease(client, "w1")
    assert got is not None
    return got


def test_a_trial_held_by_another_worker_gets_one_409_from_all_three(backend_client: TestClient) -> None:
    client = backend_client
    got = _study(client)
    why = _one_answer(_calls(client, got["trial_id"], "w2", got["config"]), got["trial_id"])
    assert why == f"it is leased to worker 'w1', not 'w2'; {STOP}"
    # nothing changed for the holder
    assert _trial(client)["state"] == "RUNNING"
    beat = client.post(f"/v1/trials/{got['trial_id']}/heartbeat", json={"worker_id": "w1"})
    assert beat.status_code == 200 and beat.json() == {"action": "continue", "reason": None}
    assert complete(client, got, "w1")["state"] == "COMPLETE"


def test_a_reaped_lease_gets_the_same_409_from_all_three(backend_app: FastAPI, backend_client: TestClient) -> None:
    client = backend_client
    got = _study(client)
    service: TuningService = backend_app.state.service
    later = utcnow() + timedelta(seconds=service.settings.lease_grace_s + 5)
    assert service.reap_stale(later) == [got["trial_id"]]
    why = _one_answer(_calls(client, got["trial_id"], "w1", got["config"]), got["trial_id"])
    assert why.startswith("its lease was reaped: no heartbeat within the grace period") and why.endswith(STOP)
    trial = _trial(client)
    assert trial["state"] == "FAIL" and trial["failure"]["kind"] == "lost"  # the late result changed nothing


def test_a_completed_trial_is_already_completed_for_everyone(backend_client: TestClient) -> None:
    """A finished trial says "already completed", whoever asks (the worker that completed it
    is not told the trial belongs to another worker); the completing worker's repeated
    complete is the one 200: the stored TrialInfo, nothing changed."""
    client = backend_client
    got = _study(client)
    first = complete(client, got, "w1", throughput=50.0)
    for worker in ("w2", "w1"):
        responses = _calls(client, got["trial_id"], worker, got["config"])
        if worker == "w1":
            again = responses.pop("complete")
            assert again.status_code == 200 and again.json() == first  # a network retry: harmless
        why = _one_answer(responses, got["trial_id"])
        assert why.startswith("it is already completed (by worker 'w1')"), why
        assert "leased to" not in why
    assert _trial(client)["throughput_samples_per_s"] == 50.0


def test_an_unknown_trial_is_404_for_all_three(backend_client: TestClient) -> None:
    for call, r in _calls(backend_client, 4242, "w1").items():
        assert r.status_code == 404 and "no trial with id 4242" in r.json()["detail"], (call, r.text)


def test_a_stopped_study_still_tells_its_holder_to_stop(client: TestClient) -> None:
    """A stopped study is an instruction to the trial's holder (200 stop, the report says
    prune); to any other worker the trial is still not its own (409)."""
    got = _study(client)
    assert client.delete("/v1/studies/s").status_code == 200
    beat = client.post(f"/v1/trials/{got['trial_id']}/heartbeat", json={"worker_id": "w1"})
    assert beat.status_code == 200 and beat.json() == {"action": "stop", "reason": "study 's' was stopped"}
    report = client.post(f"/v1/trials/{got['trial_id']}/report",
                         json={"worker_id": "w1", "step": 1, "metrics": {"loss": 0.5}})
    assert report.status_code == 200 and report.json()["prune"] is True
    why = _one_answer(_calls(client, got["trial_id"], "w2", got["config"]), got["trial_id"])
    assert why == f"it is leased to worker 'w1', not 'w2'; {STOP}"
