"""The Optuna study the service creates carries the quality metric's own name and direction
(what the dashboard labels its axes with, and what the sampler optimises)."""

from __future__ import annotations

from collections.abc import Iterator

import optuna
import pytest
from fastapi.testclient import TestClient
from optuna.study import StudyDirection

from autotune.contract.registry import registered_workloads


@pytest.fixture
def toyacc_known(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The service knows the name of a workload only the workers have (by module:attr)."""
    monkeypatch.setenv("AUTOTUNE_WORKLOADS", "toyacc")
    registered_workloads.cache_clear()  # the registry reads the environment once
    yield
    monkeypatch.undo()
    registered_workloads.cache_clear()


@pytest.mark.parametrize(("spec", "names", "directions"), [
    ({"name": "u", "workload": "ups"}, ["throughput_samples_per_s", "val_nrmse"], ["MAXIMIZE", "MINIMIZE"]),
    ({"name": "g", "workload": "gpt"}, ["throughput_samples_per_s", "val_loss"], ["MAXIMIZE", "MINIMIZE"]),
    ({"name": "a", "workload": "toyacc", "preset": "p", "quality": {"metric": "val_accuracy", "direction": "maximize"}},
     ["throughput_samples_per_s", "val_accuracy"], ["MAXIMIZE", "MAXIMIZE"]),
])
def test_the_optuna_study_is_named_and_directed_by_the_quality_metric(
        client: TestClient, sqlite_url: str, toyacc_known: None,
        spec: dict[str, object], names: list[str], directions: list[str]) -> None:
    r = client.post("/v1/studies", json=spec)
    assert r.status_code == 201, r.text
    study = optuna.load_study(study_name=str(spec["name"]), storage=sqlite_url)
    assert study.metric_names == names
    assert [d.name for d in study.directions] == directions
    assert all(isinstance(d, StudyDirection) for d in study.directions)


def test_a_plugins_quality_objective_is_named_by_its_first_result(client: TestClient, sqlite_url: str,
                                                                   toyacc_known: None) -> None:
    """A plugin workload's metric is unknown when its study is created ("quality"); the first
    result names it, and Optuna (the dashboard) says val_loss from then on."""
    from service_helpers import probe_result

    r = client.post("/v1/studies", json={"name": "p", "workload": "toyacc", "preset": "p", "n_trials": 2})
    assert r.status_code == 201, r.text
    study = optuna.load_study(study_name="p", storage=sqlite_url)
    assert study.metric_names == ["throughput_samples_per_s", "quality"]
    got = client.post("/v1/trials/lease", json={"worker_id": "w", "hardware": "cpu", "workloads": ["toyacc"]})
    assert got.status_code == 200, got.text
    trial = got.json()
    result = {**probe_result(trial["config"]), "workload": "toyacc", "preset": "p", "val_nrmse": None,
              "quality_metric": "val_loss", "quality": 0.7}
    done = client.post(f"/v1/trials/{trial['trial_id']}/complete", json={"worker_id": "w", "result": result})
    assert done.status_code == 200, done.text
    study = optuna.load_study(study_name="p", storage=sqlite_url)
    assert study.metric_names == ["throughput_samples_per_s", "val_loss"]
