"""A drawn config that was measured already is not run again: the sampler's repeat is told the
earlier trial's result (`repeat_of`), costs no GPU time, and stays out of the front, the
re-measurements and the recommendation's candidates."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from service_helpers import StudyFactory, complete, lease, make_settings

from api.main import create_app

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
    assert len(trials) == 11 and all(t["state"] == "COMPLETE" for t in trials.values())
    repeats = [t for t in trials.values() if t["repeat_of"] is not None]
    ran = {got["number"] for got in leased}
    assert repeats, "TPE over two configurations drew one again within 10 trials"
    assert ran.isdisjoint(t["number"] for t in repeats)  # a repeat was never leased: no worker ran it
    for t in repeats:
        original = trials[t["repeat_of"]]
        assert original["repeat_of"] is None and original["number"] in ran and original["number"] < t["number"]
        assert t["params"] == original["params"] and t["values"] == original["values"]
        assert t["worker_id"] is None
    # only the last draw may run a measured configuration again (nothing left to hand out otherwise)
    search = [got for got in leased if got["role"] == "search"]
    configs = [got["config"]["batch_size"] for got in search]
    assert len(set(configs[:-1])) == len(configs[:-1]) and len(search) <= 3
    front_numbers = {t["number"] for t in client.get("/v1/studies/rep/pareto").json()["data"]}
    assert front_numbers and front_numbers.isdisjoint(t["number"] for t in repeats)
    best = client.get("/v1/studies/rep/best?format=json").json()
    assert best["config"]["batch_size"] == 8 and trials[best["trial_number"]]["repeat_of"] is None


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

    from autotune.protocol import TrialInfo
    from autotune.tables import trials_table

    trials = [TrialInfo(trial_id=1, number=1, state="COMPLETE", params={"batch_size": 8}),
              TrialInfo(trial_id=2, number=2, state="COMPLETE", params={"batch_size": 8}, repeat_of=1)]
    console = Console(width=200, record=True)
    console.print(trials_table(trials, "t"))
    lines = console.export_text().splitlines()
    assert any(line.startswith("│ 2 ") and "same as 1, not run" in line for line in lines)
    assert any(line.startswith("│ 1 ") and "not run" not in line for line in lines)
