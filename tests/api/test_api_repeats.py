"""No duplicate probes: a drawn config (compared normalised) that was measured already, is in
flight or is the baseline's is never leased: the sampler's repeat is told the earlier trial's
result (`repeat_of`; a running twin's once it is in), costs no GPU time, and stays out of the
front, the re-measurements and the recommendation's candidates."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from service_helpers import StudyFactory, complete, lease, make_settings, probe_result, trials_of

from autotune.api.db import utcnow
from autotune.api.main import create_app
from autotune.api.service import TuningService

SPACE = {"name": "two", "params": {"batch_size": {"choices": [4, 8]}}}  # two configurations in all


def _run_study(client: TestClient, name: str) -> list[dict[str, Any]]:
    """Lease and complete every trial the study hands out; the leases, in order."""
    leased = []
    while (got := lease(client, "w", study=name)) is not None:
        leased.append(got)
        complete(client, got, "w", throughput=100.0 * got["config"].get("batch_size", 2), nrmse=0.1)
    return leased


@pytest.fixture
def backend(db_url: str) -> Iterator[TestClient]:
    """A service on each database backend (SQLite, PostgreSQL)."""
    with TestClient(create_app(make_settings(db_url))) as c:
        yield c


def test_repeated_draws_are_told_not_run(backend: TestClient) -> None:
    client = backend
    r = client.post("/v1/studies", json={"name": "rep", "space": SPACE, "sampler": "tpe", "n_trials": 1 + 10,
                                         "seed": 0, "baseline_seeds": 1, "remeasure": {"top_k": 0}})
    assert r.status_code == 201, r.text
    leased = _run_study(client, "rep")
    trials = {t["number"]: t for t in client.get("/v1/studies/rep/trials").json()["data"]}
    assert len(trials) == 11
    repeats = [t for t in trials.values() if t["repeat_of"] is not None]
    assert all(t["state"] == ("REPEAT" if t["repeat_of"] is not None else "COMPLETE") for t in trials.values())
    ran = {got["number"] for got in leased}
    assert repeats, "TPE over two configurations drew one again within 10 trials"
    assert ran.isdisjoint(t["number"] for t in repeats)  # a repeat was never leased: no worker ran it
    for t in repeats:
        original = trials[t["repeat_of"]]
        assert original["repeat_of"] is None and original["number"] in ran and original["number"] < t["number"]
        assert t["params"] == original["params"] and original["values"] is not None
        # nothing was measured for a repeat: Optuna holds it PRUNED without values
        assert t["values"] is None and t["throughput_samples_per_s"] is None and t["worker_id"] is None
    # no configuration runs twice, not even the last draw's (a repeat then ends the ask: nothing handed out)
    search = [got for got in leased if got["role"] == "search"]
    configs = [got["config"]["batch_size"] for got in search]
    assert sorted(configs) == [4, 8]
    front_numbers = {t["number"] for t in client.get("/v1/studies/rep/pareto").json()["data"]}
    assert front_numbers and front_numbers.isdisjoint(t["number"] for t in repeats)
    best = client.get("/v1/studies/rep/best?format=json").json()
    # the fastest candidate: the recommendation, or the uncertified pick when the baseline is kept
    pick = best if trials[best["trial_number"]]["role"] == "search" else best.get("uncertified")
    assert pick is not None and pick["config"]["batch_size"] == 8 and trials[pick["trial_number"]]["repeat_of"] is None


def test_a_users_own_points_run_as_given(client: TestClient, make_study: StudyFactory) -> None:
    # points the user listed are run even when they repeat one: only the sampler's draws are answered
    make_study("mine", space=SPACE, sampler="tpe", n_trials=1 + 2, seed=0,
               starting_points=[{"batch_size": 8}, {"batch_size": 8}])
    leased = _run_study(client, "mine")
    assert [got["config"]["batch_size"] for got in leased if got["role"] == "search"] == [8, 8]
    trials = client.get("/v1/studies/mine/trials").json()["data"]
    assert all(t["repeat_of"] is None for t in trials)


def test_the_trials_table_marks_a_repeat() -> None:
    from rich.console import Console

    from autotune.cli.tables import trials_table
    from autotune.contract.views import TrialInfo

    trials = [TrialInfo(trial_id=1, number=1, state="COMPLETE", params={"batch_size": 8}),
              TrialInfo(trial_id=2, number=2, state="REPEAT", params={"batch_size": 8}, repeat_of=1)]
    console = Console(width=200, record=True)
    console.print(trials_table(trials, "t"))
    lines = console.export_text().splitlines()
    assert any(line.startswith("│ 2 ") and "same as 1, not run" in line for line in lines)
    assert any(line.startswith("│ 1 ") and "not run" not in line for line in lines)


# --- no duplicate probes: a drawn config measured, in flight or the baseline's is never leased ---------------


def _state(client: TestClient, name: str) -> str:
    state: str = client.get(f"/v1/studies/{name}").json()["state"]
    return state


def _search_configs(leased: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [got["config"] for got in leased if got["role"] == "search"]


def test_config_key_normalises() -> None:
    from autotune.api.repeats import config_key as _config_key

    assert _config_key({"batch_size": 8}, {}) == _config_key({"batch_size": 8.0, "num_workers": 0}, {})
    assert _config_key({}, {}) != _config_key({"batch_size": 8}, {})  # the preset's batch size is unknown
    assert _config_key({}, {"batch_size": 8}) == _config_key({"batch_size": 8}, {"batch_size": 8})
    assert _config_key({"batch_size": 4}, {"batch_size": 8}) != _config_key({}, {"batch_size": 8})


@pytest.mark.parametrize("sampler", ["tpe", "grid"])
def test_a_draw_of_the_baselines_config_is_not_leased(client: TestClient, make_study: StudyFactory,
                                                      sampler: str) -> None:
    make_study("base", space=SPACE, sampler=sampler, n_trials=1 + 8, seed=0, baseline={"batch_size": 8})
    leased = _run_study(client, "base")
    assert _search_configs(leased) == [{"batch_size": 4}]  # 8 is the baseline's: measured by the baseline seed
    assert _state(client, "base") == "finished"
    trials = trials_of(client, "base")
    told = [t for t in trials.values() if t["role"] == "search" and t["config"]["batch_size"] == 8]
    assert told, "the sampler drew the baseline's config"
    for t in told:
        assert t["baseline_repeat_of"] == 0 and t["repeat_of"] == 0 and t["worker_id"] is None
        assert t["state"] == "REPEAT" and t["throughput_samples_per_s"] is None and t["values"] is None
    front = {t["number"] for t in client.get("/v1/studies/base/pareto").json()["data"]}
    assert front.isdisjoint(t["number"] for t in told)


def test_configs_that_normalise_alike_are_one_config(client: TestClient, make_study: StudyFactory) -> None:
    # num_workers 0 is the default: a draw of it is the baseline's config {} (a knob left out)
    make_study("dflt", space={"params": {"num_workers": {"choices": [0, 1]}}}, sampler="tpe", n_trials=1 + 8, seed=1)
    leased = _run_study(client, "dflt")
    assert _search_configs(leased) == [{"num_workers": 1}]
    assert _state(client, "dflt") == "finished"
    # the baseline leaves the batch size to the preset, and ran it at ups/tiny's 4 (its effective config says
    # so): a draw of batch_size 4 trains what the baseline trained
    make_study("preset", space=SPACE, sampler="tpe", n_trials=1 + 8, seed=2)
    base = lease(client, "w", study="preset")
    assert base is not None and base["role"] == "baseline" and "batch_size" not in base["config"]
    r = client.post(f"/v1/trials/{base['trial_id']}/complete", json={"worker_id": "w", "result": probe_result(
        {**base["config"], "batch_size": 4, "accum_steps": 2, "lr": 0.003})})
    assert r.status_code == 200, r.text
    leased = _run_study(client, "preset")
    assert _search_configs(leased) == [{"batch_size": 8}]
    assert _state(client, "preset") == "finished"


def test_a_draw_of_a_running_trials_config_is_not_leased(backend: TestClient) -> None:
    client = backend
    service: TuningService = client.app.state.service  # type: ignore[attr-defined]
    r = client.post("/v1/studies", json={"name": "run", "space": SPACE, "sampler": "tpe", "n_trials": 1 + 8,
                                         "seed": 0, "baseline_seeds": 1, "remeasure": {"top_k": 0}})
    assert r.status_code == 201, r.text
    base = lease(client, "w0", study="run")
    assert base is not None and base["role"] == "baseline"
    complete(client, base, "w0")
    first, second = lease(client, "w1", study="run"), lease(client, "w2", study="run")
    assert first is not None and second is not None
    assert first["config"] != second["config"]  # the second worker never gets the first one's config
    assert lease(client, "w3", study="run") is None  # both configs in flight: every draw is a repeat
    trials = trials_of(client, "run")
    told = [t for t in trials.values() if t["repeat_of"] is not None]
    assert told, "TPE over two configurations drew a running one again"
    # told at once, never leased: REPEAT (Optuna PRUNED, no values), the twin still running
    assert all(t["state"] == "REPEAT" and t["worker_id"] is None and t["values"] is None for t in told)
    assert {t["repeat_of"] for t in told} <= {first["number"], second["number"]}
    # the reaper fails the silent workers' trials only
    later = utcnow() + timedelta(seconds=service.settings.lease_grace_s + 5)
    assert sorted(service.reap_stale(later)) == sorted([first["trial_id"], second["trial_id"]])
    # the lost trials are re-run (same configs), not the repeats
    retries = [lease(client, "w4", study="run"), lease(client, "w5", study="run")]
    assert all(r is not None and r["number"] > max(trials) for r in retries)
    assert sorted(r["config"]["batch_size"] for r in retries if r is not None) == [4, 8]
    for r, worker in zip(retries, ["w4", "w5"], strict=True):
        assert r is not None
        complete(client, r, worker, throughput=100.0 * r["config"]["batch_size"])
    leased = _run_study(client, "run")  # what budget is left: every draw repeats a measured config
    assert _search_configs(leased) == []
    assert _state(client, "run") == "finished"
    trials = trials_of(client, "run")
    assert sorted(t["config"]["batch_size"] for t in trials.values() if t["state"] == "COMPLETE"
                  and t["role"] == "search") == [4, 8]


@pytest.mark.parametrize("sampler", ["tpe", "random"])
def test_a_tiny_space_finishes_without_a_duplicate_lease(client: TestClient, make_study: StudyFactory,
                                                         sampler: str) -> None:
    # 2 configurations, 24 search trials (more than MAX_REPEATS draws in a row are repeats), two workers
    make_study("tiny", space=SPACE, sampler=sampler, n_trials=1 + 24, seed=3)
    leased: list[dict[str, Any]] = []
    for _ in range(20):
        if _state(client, "tiny") == "finished":
            break
        pairs = [(worker, lease(client, worker, study="tiny")) for worker in ("w1", "w2")]
        for worker, got in pairs:
            if got is not None:
                leased.append(got)
                complete(client, got, worker, throughput=10.0 * got["config"].get("batch_size", 1))
    assert _state(client, "tiny") == "finished"
    configs = [c["batch_size"] for c in _search_configs(leased)]
    assert sorted(configs) == [4, 8]  # each configuration ran once
    trials = trials_of(client, "tiny")
    assert len(trials) == 25
    assert sorted(t["state"] for t in trials.values()) == ["COMPLETE"] * 3 + ["REPEAT"] * 22
    assert all((t["repeat_of"] is not None) == (t["state"] == "REPEAT") for t in trials.values())
