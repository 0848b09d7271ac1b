"""The worker protocol over REST: lease, heartbeat, report, complete, the reaper, the trial cap."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from service_helpers import StudyFactory, complete, lease, probe_result, tuning_service

from autotune.api import crud
from autotune.api.db import utcnow
from autotune.contract.config import parse_config


def _beat(client: TestClient, trial_id: int, worker_id: str) -> dict[str, Any]:
    r = client.post(f"/v1/trials/{trial_id}/heartbeat", json={"worker_id": worker_id})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _report(client: TestClient, trial_id: int, worker_id: str, loss: Any, step: int = 1) -> Any:
    body = json.dumps({"worker_id": worker_id, "step": step, "metrics": {"loss": loss}})  # json allows NaN
    return client.post(f"/v1/trials/{trial_id}/report", content=body, headers={"content-type": "application/json"})


def test_lease_204_without_a_matching_study(client: TestClient, make_study: StudyFactory) -> None:
    assert lease(client, "w1") is None
    make_study("gpu-study", hardware="NVIDIA H100 80GB HBM3", space="h100")
    assert lease(client, "w1", hardware="cpu") is None  # wrong hardware class
    assert lease(client, "w1", hardware="NVIDIA H100") is None  # exact string only
    got = lease(client, "w2", hardware="NVIDIA H100 80GB HBM3")
    assert got is not None and got["study"] == "gpu-study"


def test_lease_of_a_named_study(client: TestClient, make_study: StudyFactory) -> None:
    r = client.post("/v1/trials/lease", json={"worker_id": "w", "hardware": "cpu", "study": "ghost"})
    assert r.status_code == 404 and "ghost" in r.json()["detail"]
    make_study("a")
    make_study("b")
    got = lease(client, "w", study="b")
    assert got is not None and got["study"] == "b"


def test_first_trial_is_the_baseline_then_the_space(client: TestClient, make_study: StudyFactory) -> None:
    make_study("s", baseline={"batch_size": 8, "accum_steps": 2}, probe={"samples": 160, "seed": 3})
    base = lease(client, "w1")
    assert base is not None
    assert base["is_baseline"] and base["number"] == 0
    # a baseline carries the params of its config that the space could draw (a knob left out: at its default)
    assert base["config"] == {"batch_size": 8, "accum_steps": 2}
    assert base["params"]["batch_size"] == 8 and base["params"]["accum_steps"] == 2
    assert base["params"]["fused_optimizer"] is False and base["params"]["precision"] == "fp32"
    assert base["workload"] == "ups" and base["preset"] == "tiny"
    assert base["probe"]["samples"] == 160 and base["probe"]["seed"] == 3
    assert base["role"] == "baseline"

    assert lease(client, "w2") is None  # the search waits for the baseline (the gate)
    complete(client, base, "w1")
    other = lease(client, "w2")
    assert other is not None and not other["is_baseline"] and other["number"] == 1 and other["role"] == "search"
    assert other["config"]["pin_memory"] is False  # the space's fixed knobs
    assert set(other["params"]) <= set(other["config"])
    parse_config(other["config"])  # a valid config


def test_lease_is_idempotent_per_worker(client: TestClient, make_study: StudyFactory) -> None:
    make_study("s")
    first = lease(client, "w1")
    assert lease(client, "w1") == first
    assert lease(client, "w2") is None  # the baseline runs
    complete(client, first, "w1")  # type: ignore[arg-type]
    second = lease(client, "w2")
    assert second is not None and second["trial_id"] != first["trial_id"]  # type: ignore[index]


def test_heartbeat_report_complete(client: TestClient, make_study: StudyFactory) -> None:
    make_study("s")
    got = lease(client, "w1")
    assert got is not None
    tid = got["trial_id"]
    assert _beat(client, tid, "w1") == {"action": "continue", "reason": None}
    assert _report(client, tid, "w1", 0.5).json() == {"prune": False, "reason": None}

    info = complete(client, got, "w1", throughput=123.0, nrmse=0.2)
    assert info["state"] == "COMPLETE" and info["is_baseline"] and info["worker_id"] == "w1"
    assert info["values"] == [123.0, 0.2]
    assert info["throughput_samples_per_s"] == 123.0 and info["val_nrmse"] == 0.2
    assert info["feasible"] is True  # the baseline passes its own gate
    assert info["config"]["effective_batch"] == 8 and info["failure"] is None
    assert info["duration_s"] is not None and info["duration_s"] >= 0

    beat = client.post(f"/v1/trials/{tid}/heartbeat", json={"worker_id": "w1"})  # tests/api/test_not_yours.py
    assert beat.status_code == 409 and "already completed" in beat.json()["detail"]
    counts = client.get("/v1/studies/s").json()["counts"]
    assert counts == {"COMPLETE": 1}


def test_user_attrs_land_in_optuna(app: FastAPI, client: TestClient, make_study: StudyFactory) -> None:
    make_study("s")
    got = lease(client, "w1")
    assert got is not None
    complete(client, got, "w1", notes=["the driver held the GPU's clocks down"])
    trial = tuning_service(app).bridge.get_trial(got["trial_id"])
    assert trial is not None
    attrs = trial.user_attrs
    for key in ("config", "device", "torch_version", "warmup_s", "throughput_spread", "peak_mem_reserved_bytes",
                "peak_mem_allocated_bytes", "data_wait_fraction", "samples_trained", "worker_id", "failure_kind",
                "knobs", "is_baseline"):
        assert key in attrs, key
    assert attrs["worker_id"] == "w1" and attrs["failure_kind"] is None and attrs["is_baseline"] is True
    assert attrs["window_data_wait_s"] == [0.01]  # per-window data wait, kept for the analysis
    assert attrs["window_gpu"][0]["throttled_fraction"] == 0.3  # and what the GPU did in each window
    assert attrs["measurement_notes"] == ["the driver held the GPU's clocks down"]


@pytest.mark.parametrize("loss", [float("nan"), float("inf"), "nan", "-inf"])
def test_non_finite_loss_prunes(client: TestClient, make_study: StudyFactory, loss: Any) -> None:
    make_study("s")
    got = lease(client, "w1")
    assert got is not None
    reply = _report(client, got["trial_id"], "w1", loss).json()
    assert reply["prune"] is True and "loss" in reply["reason"]


def test_zombie_report_is_409(client: TestClient, make_study: StudyFactory) -> None:
    make_study("s")
    got = lease(client, "w1")
    assert got is not None
    r = _report(client, got["trial_id"], "w2", 0.5)
    assert r.status_code == 409 and "w1" in r.json()["detail"]
    complete(client, got, "w1")
    r = _report(client, got["trial_id"], "w1", 0.5)
    assert r.status_code == 409 and "completed" in r.json()["detail"]
    assert _report(client, 999, "w1", 0.5).status_code == 404


def test_unknown_trial_is_404(client: TestClient) -> None:
    r = client.post("/v1/trials/999/heartbeat", json={"worker_id": "w"})
    assert r.status_code == 404 and "999" in r.json()["detail"]
    r = client.post("/v1/trials/999/complete", json={"worker_id": "w", "result": probe_result()})
    assert r.status_code == 404
    assert client.post("/v1/trials/abc/heartbeat", json={"worker_id": "w"}).status_code == 422


def test_failure_is_fail_with_kind(client: TestClient, make_study: StudyFactory) -> None:
    make_study("s")
    base = lease(client, "w1")
    assert base is not None
    complete(client, base, "w1")
    other = lease(client, "w2")
    assert other is not None
    info = complete(client, other, "w2", throughput=None, nrmse=None,
                    failure={"kind": "oom", "message": "CUDA out of memory"})
    assert info["state"] == "FAIL" and info["values"] is None
    assert info["failure"] == {"kind": "oom", "message": "CUDA out of memory"}
    assert info["feasible"] is False
    study = client.get("/v1/studies/s").json()
    assert study["counts"] == {"COMPLETE": 1, "FAIL": 1} and study["failures"] == {"oom": 1}


def test_stopped_early_is_pruned(client: TestClient, make_study: StudyFactory) -> None:
    make_study("s")
    got = lease(client, "w1")
    assert got is not None
    info = complete(client, got, "w1", stopped_early=True)
    assert info["state"] == "PRUNED" and info["values"] is None and info["failure"] is None


@pytest.mark.parametrize("result", [
    # (a throughput of 0 is refused with 422 now, below the physical bound: tests/api/test_hostile_limits.py)
    {"throughput_samples_per_s": 10.0, "quality": 0.1, "quality_metric": "val_loss"},  # another metric
])
def test_unusable_results_fail_as_error_not_500(client: TestClient, make_study: StudyFactory,
                                                result: dict[str, Any]) -> None:
    """A well-formed result that is no usable measurement fails its trial; a malformed one is a
    422 that changes nothing (tests/api/test_result_validation.py)."""
    make_study("s")
    got = lease(client, "w1")
    assert got is not None
    r = client.post(f"/v1/trials/{got['trial_id']}/complete",
                    content=json.dumps({"worker_id": "w1", "result": result}),
                    headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "FAIL" and r.json()["failure"]["kind"] == "error"


def test_complete_is_idempotent_and_guarded(client: TestClient, make_study: StudyFactory) -> None:
    make_study("s")
    got = lease(client, "w1")
    assert got is not None
    first = complete(client, got, "w1", throughput=50.0)
    again = complete(client, got, "w1", throughput=999.0, failure={"kind": "oom", "message": "x"})
    assert again == first  # nothing changed
    r = client.post(f"/v1/trials/{got['trial_id']}/complete", json={"worker_id": "w2", "result": probe_result()})
    assert r.status_code == 409 and "w1" in r.json()["detail"]
    assert client.get("/v1/studies/s/trials").json()["data"][0]["throughput_samples_per_s"] == 50.0


def test_n_trials_cap_and_finished(client: TestClient, make_study: StudyFactory) -> None:
    make_study("s", n_trials=3)
    leases = [lease(client, "w0")]
    complete(client, leases[0], "w0")  # type: ignore[arg-type]
    leases += [lease(client, f"w{i}") for i in range(1, 3)]
    assert all(x is not None for x in leases)
    assert lease(client, "w9") is None  # every trial counts, running ones included
    assert client.get("/v1/studies/s").json()["state"] == "running"
    complete(client, leases[1], "w1", failure={"kind": "nan", "message": "loss is nan"})  # type: ignore[arg-type]
    assert lease(client, "w0") is None  # failed trials count too
    complete(client, leases[2], "w2", stopped_early=True)  # type: ignore[arg-type]
    study = client.get("/v1/studies/s").json()
    assert study["state"] == "finished"
    assert study["counts"] == {"COMPLETE": 1, "FAIL": 1, "PRUNED": 1}


def test_reaper_fails_stale_leases(app: FastAPI, client: TestClient, make_study: StudyFactory) -> None:
    make_study("s", baseline_seeds=3)  # two baseline seeds run at once
    got = lease(client, "w1")
    fresh = lease(client, "w2")
    assert got is not None and fresh is not None
    service = tuning_service(app)
    grace = service.settings.lease_grace_s
    assert service.reap_stale(utcnow()) == []  # nothing is stale yet
    later = utcnow() + timedelta(seconds=grace + 5)  # neither worker heartbeats until then
    assert sorted(service.reap_stale(later)) == sorted([got["trial_id"], fresh["trial_id"]])
    assert service.reap_stale(later) == []  # already reaped

    trials = {t["trial_id"]: t for t in client.get("/v1/studies/s/trials").json()["data"]}
    lost = trials[got["trial_id"]]
    assert lost["state"] == "FAIL" and lost["failure"]["kind"] == "lost"
    assert "worker w1 stopped heartbeating" in lost["failure"]["message"]
    study = client.get("/v1/studies/s").json()  # lost, not failed: each is re-run as a new trial
    assert study["failures"] == {} and study["counts"] == {"LOST": 2}

    beat = client.post(f"/v1/trials/{got['trial_id']}/heartbeat", json={"worker_id": "w1"})
    assert beat.status_code == 409 and "reaped" in beat.json()["detail"]
    r = client.post(f"/v1/trials/{got['trial_id']}/complete", json={"worker_id": "w1", "result": probe_result()})
    assert r.status_code == 409 and "reaped" in r.json()["detail"]
    nxt = lease(client, "w1")  # the worker can go on with a new trial
    assert nxt is not None and nxt["trial_id"] not in trials


def test_heartbeats_keep_a_lease_alive(app: FastAPI, client: TestClient, make_study: StudyFactory) -> None:
    make_study("s")
    got = lease(client, "w1")
    assert got is not None
    service = tuning_service(app)
    grace = service.settings.lease_grace_s
    # a heartbeat "now" keeps the lease fresh at any moment less than the grace period later
    _beat(client, got["trial_id"], "w1")
    assert service.reap_stale(utcnow() + timedelta(seconds=grace - 5)) == []


def test_reaper_fails_trials_that_were_never_leased(app: FastAPI, client: TestClient,
                                                    make_study: StudyFactory) -> None:
    make_study("s")
    service = tuning_service(app)
    # simulate a crash between Optuna's ask and the lease row
    from autotune.api.optuna_bridge import StudyContext
    from autotune.contract.protocol import StudySpec

    spec = StudySpec(name="s")
    orphan = service.bridge.ask(StudyContext("s", spec, spec.resolved_space()), baseline_config={})
    assert service.reap_stale(utcnow()) == []  # too young to be judged
    assert service.reap_stale(utcnow() + timedelta(seconds=service.settings.lease_grace_s + 5)) == [orphan.trial_id]
    trial = service.bridge.get_trial(orphan.trial_id)
    assert trial is not None and trial.state == "FAIL" and trial.user_attrs["failure_kind"] == "lost"


def test_grid_sampler_walks_the_deduplicated_grid(client: TestClient, make_study: StudyFactory) -> None:
    space = {"params": {"num_workers": {"choices": [0, 1]},
                        "prefetch_factor": {"choices": [2, 4], "when": {"num_workers": [1]}}}}
    make_study("g", sampler="grid", space=space, n_trials=10)
    got = [lease(client, "w0")]
    complete(client, got[0], "w0")  # type: ignore[arg-type]
    got += [lease(client, f"w{i}") for i in range(1, 4)]
    # baseline + 3 grid points: {0}, {1, 2}, {1, 4}; {0} is the baseline's own config (num_workers 0 is the
    # default), told the baseline's result and not leased
    assert got[3] is None
    configs = [x["config"] for x in got[1:3]]  # type: ignore[index]
    assert sorted(map(json.dumps, configs)) == sorted(map(json.dumps, [
        {"num_workers": 1, "prefetch_factor": 2}, {"num_workers": 1, "prefetch_factor": 4}]))
    (told,) = [t for t in client.get("/v1/studies/g/trials").json()["data"] if t["baseline_repeat_of"] is not None]
    assert told["params"] == {"num_workers": 0} and told["worker_id"] is None
    for i, x in enumerate(got[1:3], start=1):
        complete(client, x, f"w{i}")  # type: ignore[arg-type]
    assert client.get("/v1/studies/g").json()["state"] == "finished"


@pytest.mark.parametrize("sampler", ["tpe", "nsga2", "random"])
def test_samplers_draw_valid_configs(client: TestClient, make_study: StudyFactory, sampler: str) -> None:
    make_study("s", sampler=sampler, seed=1)
    for i in range(4):
        got = lease(client, f"w{i}")
        assert got is not None
        parse_config(got["config"])
        complete(client, got, f"w{i}", throughput=100.0 + i)


def test_the_database_refuses_a_second_active_lease_per_worker(app: FastAPI, client: TestClient,
                                                                make_study: StudyFactory,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard behind the lock: if the service's own check missed an active lease (another
    service process leasing to the same worker), the unique index refuses it, the new trial
    is failed, and the worker gets a 409 it can retry."""
    make_study("s", baseline_seeds=2)
    first = lease(client, "w1")
    assert first is not None
    monkeypatch.setattr(crud, "active_lease_of_worker", lambda *_args: None)
    r = client.post("/v1/trials/lease", json={"worker_id": "w1", "hardware": "cpu"})
    assert r.status_code == 409 and "already holds a lease" in r.json()["detail"]
    trials = client.get("/v1/studies/s/trials").json()["data"]
    assert [t["state"] for t in trials] == ["RUNNING", "FAIL"]
    monkeypatch.undo()
    assert lease(client, "w1") == first
