"""Starting points through the API: a GPU study's first search trials are the fast stack
derived from the baseline's effective config; a user's own points come first on any study;
bad points are refused with the field named."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.testclient import TestClient
from service_helpers import StudyFactory, complete, lease, probe_result

from autotune.api.service import TuningService

GPU = "NVIDIA H100 80GB HBM3"
UPS_FULL_EFFECTIVE = {"batch_size": 12, "accum_steps": 4, "num_workers": 8, "prefetch_factor": 4,
                      "compile": "none", "precision": "fp32", "checkpoint": "none", "fused_optimizer": False,
                      "cudnn_benchmark": False, "persistent_workers": False, "inverse_loss_frequency": 1}


def _complete_as(client: TestClient, got: dict[str, Any], worker: str, config: dict[str, Any]) -> None:
    r = client.post(f"/v1/trials/{got['trial_id']}/complete",
                    json={"worker_id": worker, "result": probe_result(config, nrmse=0.1)})
    assert r.status_code == 200, r.text


def _attrs(app: FastAPI, name: str) -> dict[int, dict[str, Any]]:
    service: TuningService = app.state.service
    return {t.number: t.user_attrs for t in service.bridge.trials(name)}


def test_gpu_study_starts_from_the_fast_stack(app: FastAPI, client: TestClient, make_study: StudyFactory) -> None:
    make_study("gpu", hardware=GPU, space="h100", preset="full", n_trials=6, seed=0)
    base = lease(client, "w", hardware=GPU)
    assert base is not None and base["role"] == "baseline"
    _complete_as(client, base, "w", UPS_FULL_EFFECTIVE)  # what a real probe of the full preset reports
    configs = []
    for _ in range(5):
        got = lease(client, "w", hardware=GPU)
        assert got is not None and got["role"] == "search"
        configs.append(got["config"])
        complete(client, got, "w", throughput=1000.0, nrmse=0.1)
    fast = {"precision": "bf16", "fused_optimizer": True, "compile_optimizer": True, "batch_size": 48,
            "accum_steps": 1, "checkpoint": "none"}
    # step_graph is a parameter only where compile is none or default (the h100 space's condition)
    assert [(c["compile"], c["inverse_loss_frequency"], c.get("step_graph")) for c in configs[:4]] == [
        ("default", 4, True), ("reduce-overhead", 4, None), ("reduce-overhead", 1, None), ("default", 4, False)]
    for c in configs[:4]:
        assert {k: c[k] for k in fast} == fast and c["num_workers"] == 8  # the baseline's data pipeline kept
    attrs = _attrs(app, "gpu")
    assert [attrs[n].get("starting_point") for n in range(1, 6)] == [0, 1, 2, 3, None]  # then the sampler's own
    listed = client.get("/v1/studies/gpu/trials").json()["data"]
    assert [t["starting_point"] for t in listed] == [None, 0, 1, 2, 3, None]  # the API says which trial was which


def test_random_search_has_no_automatic_starting_points(app: FastAPI, client: TestClient,
                                                        make_study: StudyFactory) -> None:
    make_study("rnd", hardware=GPU, space="h100", preset="full", sampler="random", n_trials=3, seed=3)
    base = lease(client, "w", hardware=GPU)
    assert base is not None
    _complete_as(client, base, "w", UPS_FULL_EFFECTIVE)
    got = lease(client, "w", hardware=GPU)
    assert got is not None and got["role"] == "search"
    assert "starting_point" not in _attrs(app, "rnd")[1]


def test_own_points_come_first(app: FastAPI, client: TestClient, make_study: StudyFactory) -> None:
    mine = [{"batch_size": 32, "precision": "bf16"}, {"batch_size": 4, "checkpoint": "block"}]
    make_study("cpu", space="cpu", n_trials=4, seed=1, starting_points=mine)
    base = lease(client, "w")
    assert base is not None and base["role"] == "baseline"
    complete(client, base, "w")
    for point in mine:
        got = lease(client, "w")
        assert got is not None and got["role"] == "search"
        assert {k: got["config"][k] for k in point} == point  # the rest was drawn by the sampler
        complete(client, got, "w")
    assert [_attrs(app, "cpu")[n].get("starting_point") for n in (1, 2)] == [0, 1]


def test_bad_points_are_refused(client: TestClient) -> None:
    spec = {"name": "bad", "space": "cpu", "starting_points": [{"batch_size": 5}]}
    r = client.post("/v1/studies", json=spec)
    assert r.status_code == 422 and "starting_points[0].batch_size" in r.text and "[4, 8, 16, 32]" in r.text
    r = client.post("/v1/studies", json={**spec, "sampler": "grid", "starting_points": [{"batch_size": 8}]})
    assert r.status_code == 422 and "grid sampler" in r.text
    r = client.post("/v1/studies", json={**spec, "starting_points": "some"})
    assert r.status_code == 422 and "starting_points" in r.text
