"""Recommendation integrity (issue 23): the baseline is the reference and never the pick, a
search trial that draws the baseline's config is recognised, the speedup carries an interval
on the ratio and says when it is within the noise, quality is compared at one sample budget,
and Optuna (what its dashboard shows) holds the same front and best as the service."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from optuna.study import StudyDirection
from optuna_dashboard._pareto_front import get_pareto_front_trials
from service_helpers import StudyFactory, complete, lease, probe_result

from api.service import TuningService

ONE_KNOB = {"params": {"batch_size": {"choices": [4, 8, 16]}}, "fixed": {}}


def _service(app: FastAPI) -> TuningService:
    service: TuningService = app.state.service
    return service


def _finish(client: TestClient, got: dict[str, Any], worker: str, throughput: float, quality: float,
            windows: list[float] | None = None) -> dict[str, Any]:
    result = {**probe_result(got["config"], throughput=throughput, nrmse=quality),
              "window_throughputs": windows if windows is not None else [throughput * f for f in (0.99, 1.0, 1.01)]}
    r = client.post(f"/v1/trials/{got['trial_id']}/complete", json={"worker_id": worker, "result": result})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _trial(client: TestClient, trial_id: int) -> dict[str, Any]:
    return next(t for t in client.get("/v1/studies/s/trials").json()["data"] if t["trial_id"] == trial_id)


def _remeasure_all(client: TestClient, measured: dict[int, tuple[float, float]]) -> None:
    """Lease and complete every re-measurement: target number -> (throughput, quality)."""
    while (got := lease(client, "r")) is not None:
        assert got["role"] == "remeasure"
        throughput, quality = measured[_trial(client, got["trial_id"])["remeasure_of"]]
        _finish(client, got, "r", throughput, quality)


def test_a_search_trial_that_draws_the_baseline_config_is_a_repeat_of_the_baseline(
        app: FastAPI, client: TestClient, make_study: StudyFactory) -> None:
    """The grid holds the baseline's own config: the search trial that runs it measures the
    baseline again. It is marked so, it is never a candidate even when it measures fastest,
    and Optuna is told the worst case for it (so the dashboard's front leaves it out)."""
    make_study("s", space=ONE_KNOB, sampler="grid", n_trials=4, baseline={"batch_size": 4})
    base = lease(client, "b")
    assert base is not None and base["params"] == {"batch_size": 4}  # a baseline carries its params
    _finish(client, base, "b", 100.0, 0.1)
    numbers = {}
    for _ in range(3):
        got = lease(client, "w")
        assert got is not None and got["role"] == "search"
        speed = 300.0 if got["config"]["batch_size"] == 4 else 150.0  # the baseline's config "wins" by luck
        numbers[got["config"]["batch_size"]] = _finish(client, got, "w", speed, 0.1)["number"]
    trials = {t["number"]: t for t in client.get("/v1/studies/s/trials").json()["data"]}
    assert trials[numbers[4]]["baseline_repeat_of"] == base["number"]
    assert trials[numbers[8]]["baseline_repeat_of"] is None
    best = client.get("/v1/studies/s/best").json()
    assert best["trial_number"] != numbers[4] and best["config"]["batch_size"] != 4
    assert numbers[4] not in [t["number"] for t in client.get("/v1/studies/s/pareto").json()["data"]]
    stored = {t.number: t for t in _service(app).bridge.trials("s")}
    assert stored[numbers[4]].values == [0.0, 10.0]  # the worst case: never on the dashboard's front
    assert stored[numbers[4]].user_attrs["throughput_samples_per_s"] == 300.0  # the measurement is kept


def test_a_baseline_seed_that_measures_fastest_is_not_recommended_after_remeasurement(
        client: TestClient, make_study: StudyFactory) -> None:
    """Three baseline seeds on a noisy host, one of them the fastest run of the study; the
    re-measured search configs measure about the baseline's speed. The service recommends a
    search config, and says it did not beat the baseline beyond the noise."""
    make_study("s", baseline_seeds=3, n_trials=5, seed=0, remeasure={"top_k": 1, "rounds": 2, "windows": 5})
    seeds = [lease(client, f"b{i}") for i in range(3)]
    for i, (got, speed) in enumerate(zip(seeds, (100.0, 130.0, 90.0), strict=True)):
        assert got is not None
        _finish(client, got, f"b{i}", speed, 0.1)
    search = []
    for speed in (110.0, 105.0):
        got = lease(client, "w")
        assert got is not None and got["role"] == "search"
        search.append(_finish(client, got, "w", speed, 0.1)["number"])
    assert client.get("/v1/studies/s/best").status_code == 404  # being re-measured: no pick yet
    r = client.get("/v1/studies/s/best")
    assert "re-measured" in r.json()["detail"] and f"trial {search[0]}" in r.json()["detail"]
    _remeasure_all(client, {search[0]: (104.0, 0.1), 0: (100.0, 0.1)})
    best = client.get("/v1/studies/s/best").json()
    assert best["trial_number"] == search[0] and best["remeasured"] and best["baseline_remeasured"]
    assert best["speedup"] == pytest.approx(1.04)
    assert best["speedup_ci_low"] < 1.0 < best["speedup_ci_high"]  # the seeds spread ±20 %: within the noise
    assert best["beats_baseline"] is False and "no config beat the baseline beyond the noise" in best["verdict"]
    assert "remeasure.rounds" in best["verdict"] and "quieter host" in best["verdict"]
    yaml_text = client.get("/v1/studies/s/best", params={"format": "yaml"}).text
    assert "# WARNING: no config beat the baseline beyond the noise" in yaml_text


def test_a_clear_win_has_an_interval_above_one(client: TestClient, make_study: StudyFactory) -> None:
    make_study("s", baseline_seeds=2, n_trials=3, seed=0, remeasure={"top_k": 1, "rounds": 2, "windows": 5})
    for i, speed in enumerate((100.0, 102.0)):
        got = lease(client, f"b{i}")
        assert got is not None
        _finish(client, got, f"b{i}", speed, 0.1)
    got = lease(client, "w")
    assert got is not None
    pick = _finish(client, got, "w", 300.0, 0.1)["number"]
    _remeasure_all(client, {pick: (290.0, 0.1), 0: (101.0, 0.1)})
    best = client.get("/v1/studies/s/best").json()
    assert best["beats_baseline"] is True and best["speedup_ci_low"] > 2.5
    assert best["speedup"] == pytest.approx(290.0 / 101.0)
    assert "faster beyond the noise" in best["verdict"]


def test_quality_at_the_longer_budget_is_judged_against_the_baseline_at_that_budget(
        client: TestClient, make_study: StudyFactory) -> None:
    """At twice the samples every config overfits (its loss rises): the pick's re-measured loss
    would fail the short probe's gate, but the baseline re-measured at the same budget rises as
    much, so the pick keeps its quality. A config whose loss rises much more than the
    baseline's does not, and is not recommended although faster."""
    make_study("s", baseline_seeds=1, n_trials=3, seed=0, remeasure={"top_k": 2, "windows": 5})
    base = lease(client, "b")
    assert base is not None
    _finish(client, base, "b", 100.0, 0.100)  # the gate at the search budget: 0.110
    fast, faster = [], []
    for speed, out in ((200.0, fast), (250.0, faster)):
        got = lease(client, "w")
        assert got is not None
        out.append(_finish(client, got, "w", speed, 0.105)["number"])
    _remeasure_all(client, {0: (100.0, 0.200), fast[0]: (200.0, 0.205), faster[0]: (250.0, 0.400)})
    best = client.get("/v1/studies/s/best").json()
    assert best["trial_number"] == fast[0] and best["quality_budget"] == "remeasure"
    assert best["quality"] == pytest.approx(0.205) and best["search_quality"] == pytest.approx(0.105)
    assert best["baseline_quality"] == pytest.approx(0.200) and best["gate_quality"] == pytest.approx(0.210)
    trials = client.get("/v1/studies/s/trials").json()["data"]
    remeasures = {t["remeasure_of"]: t for t in trials if t["role"] == "remeasure"}
    assert remeasures[fast[0]]["feasible"] is True and "re-measure budget" in remeasures[fast[0]]["feasibility_note"]
    assert remeasures[faster[0]]["feasible"] is False
    front = [t["number"] for t in client.get("/v1/studies/s/pareto").json()["data"]]
    assert front == [fast[0]]  # the faster config is out at the re-measure budget
    yaml_text = client.get("/v1/studies/s/best", params={"format": "yaml"}).text
    assert "against the baseline re-measured at that budget" in yaml_text and "shorter probe: 0.105" in yaml_text


def test_without_a_baseline_remeasurement_quality_is_not_judged_and_every_view_says_so(
        client: TestClient, make_study: StudyFactory) -> None:
    make_study("s", baseline_seeds=1, n_trials=2, seed=0, remeasure={"top_k": 1, "windows": 5})
    base = lease(client, "b")
    assert base is not None
    _finish(client, base, "b", 100.0, 0.1)
    got = lease(client, "w")
    assert got is not None
    pick = _finish(client, got, "w", 200.0, 0.1)["number"]
    while (got := lease(client, "r")) is not None:
        if _trial(client, got["trial_id"])["remeasure_of"] == 0:
            complete(client, got, "r", throughput=None, nrmse=None, failure={"kind": "oom", "message": "OOM"})
        else:
            _finish(client, got, "r", 190.0, 0.3)
    best = client.get("/v1/studies/s/best").json()
    assert best["trial_number"] == pick and best["quality_budget"] == "search"
    assert any("not judged" in c for c in best["caveats"])
    view = next(t for t in client.get("/v1/studies/s/trials").json()["data"]
                if t["role"] == "remeasure" and t["remeasure_of"] == pick)
    assert view["feasible"] is None and view["feasibility_note"].startswith("not judged")


def test_optuna_holds_the_same_front_and_best_as_the_service(app: FastAPI, client: TestClient,
                                                             make_study: StudyFactory) -> None:
    """What the stock optuna-dashboard computes from the stored trials (its own Pareto-front
    function) is the service's front, at the re-measured values, with the pick on it; baseline
    and re-measurement trials carry their params."""
    make_study("s", space=ONE_KNOB, sampler="grid", n_trials=4, baseline={"batch_size": 4}, seed=0,
               remeasure={"top_k": 2, "windows": 5})
    base = lease(client, "b")
    assert base is not None
    _finish(client, base, "b", 100.0, 0.10)
    speeds = {8: (300.0, 0.105), 16: (250.0, 0.104), 4: (120.0, 0.10)}
    numbers = {}
    for _ in speeds:
        got = lease(client, "w")
        assert got is not None and got["role"] == "search"
        size = got["config"]["batch_size"]
        numbers[size] = _finish(client, got, "w", *speeds[size])["number"]
    # the 300 config regresses to 200 when re-measured, the 250 one holds
    _remeasure_all(client, {numbers[8]: (200.0, 0.105), numbers[16]: (240.0, 0.104), 0: (100.0, 0.10)})
    best = client.get("/v1/studies/s/best").json()
    assert best["trial_number"] == numbers[16]
    service_front = {t["number"]: t["values"] for t in client.get("/v1/studies/s/pareto").json()["data"]}
    assert service_front == {numbers[16]: [240.0, pytest.approx(0.104)]}
    storage = _service(app).bridge._rdb  # uncached, as the dashboard reads it (optuna_dashboard: RDBStorage)
    stored = storage.get_all_trials(storage.get_study_id_from_name("s"), deepcopy=False)
    dashboard_front = get_pareto_front_trials(stored, [StudyDirection.MAXIMIZE, StudyDirection.MINIMIZE])
    assert {t.number for t in dashboard_front} == set(service_front)
    assert [list(t.values) for t in dashboard_front] == [[240.0, pytest.approx(0.104)]]
    remeasures = [t for t in stored if t.user_attrs.get("role") == "remeasure"]
    assert len(remeasures) == 3
    for t in remeasures:
        target = next(x for x in stored if x.number == t.user_attrs["remeasure_of"])
        assert t.params == target.params == {"batch_size": target.user_attrs["config"]["batch_size"]}
