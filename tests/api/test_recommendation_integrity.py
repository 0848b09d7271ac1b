"""Recommendation integrity (issue 23): the baseline is the reference and never a candidate, a
search trial that draws the baseline's config is recognised, the speedup carries an interval
on the ratio and only a speedup beyond the noise is certified (else the baseline's config is
kept), quality is compared at one sample budget, and Optuna (what its dashboard shows) holds
the same front and best as the service."""

from __future__ import annotations

import io
import itertools
import statistics
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from optuna.study import StudyDirection
from optuna_dashboard._pareto_front import get_pareto_front_trials
from rich.console import Console
from service_helpers import StudyFactory, complete, lease, probe_result, tuning_service

from autotune.cli.tables import recommendation_table
from autotune.contract.views import Recommendation

ONE_KNOB = {"params": {"batch_size": {"choices": [4, 8, 16]}}, "fixed": {}}


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


NOISE = (1.0, 1.01, 0.99, 1.004, 0.996, 1.007, 0.993, 1.002)  # each run its own throughput


def _remeasure_all(client: TestClient, measured: dict[int, tuple[float, float]],
                   quality_noise: tuple[float, ...] = (0.0,)) -> dict[int, list[tuple[float, float]]]:
    """Lease and complete every re-measurement until the study has finished: target number ->
    (throughput, quality), each run's throughput scaled by the next NOISE factor and its quality
    shifted by the next `quality_noise` term. Returns what each target's runs sent, in order."""
    noise, shift = itertools.cycle(NOISE), itertools.cycle(quality_noise)
    sent: dict[int, list[tuple[float, float]]] = {}
    while (got := lease(client, "w")) is not None:  # the worker that began round 0 (a round stays on one worker)
        assert got["role"] == "remeasure"
        target = _trial(client, got["trial_id"])["remeasure_of"]
        throughput, quality = measured[target]
        run = (throughput * next(noise), quality + next(shift))
        sent.setdefault(target, []).append(run)
        _finish(client, got, "w", *run)
    assert client.get("/v1/studies/s").json()["state"] == "finished"
    return sent


def _geomean(runs: list[tuple[float, float]], *seeds: float) -> float:
    """The geometric mean of the runs' throughputs (and of `seeds`, the baseline seeds' throughputs)."""
    return statistics.geometric_mean([*seeds, *(r[0] for r in runs)])


def test_a_search_trial_that_draws_the_baseline_config_is_a_repeat_of_the_baseline(
        app: FastAPI, client: TestClient, make_study: StudyFactory) -> None:
    """The grid holds the baseline's own config: the search trial that draws it measures (or is
    told) the baseline again. It is marked so, it is never a candidate even when it measures
    fastest; Optuna holds what it measured (a real run of the baseline's config)."""
    make_study("s", space=ONE_KNOB, sampler="grid", n_trials=4, baseline={"batch_size": 4})
    base = lease(client, "b")
    assert base is not None and base["params"] == {"batch_size": 4}  # a baseline carries its params
    _finish(client, base, "b", 100.0, 0.1)
    ran = {}
    while (got := lease(client, "w")) is not None:
        assert got["role"] == "search"
        speed = 300.0 if got["config"]["batch_size"] == 4 else 150.0  # the baseline's config "wins" by luck
        ran[_finish(client, got, "w", speed, 0.1)["number"]] = got["config"]["batch_size"]
    assert {8, 16} <= set(ran.values())  # (a service that leases the baseline's config runs 4 as well)
    trials = {t["number"]: t for t in client.get("/v1/studies/s/trials").json()["data"]}
    (repeat,) = [t for t in trials.values() if t["role"] == "search" and t["config"]["batch_size"] == 4]
    assert repeat["baseline_repeat_of"] == base["number"]
    assert all(trials[n]["baseline_repeat_of"] is None for n, size in ran.items() if size != 4)
    best = client.get("/v1/studies/s/best").json()  # not judged (top_k 0): the baseline is kept
    assert best["trial_number"] == base["number"] and best["outcome"] == "not_judged"
    assert best["uncertified"]["trial_number"] != repeat["number"]  # the fastest *candidate*: 150, not 300
    assert best["uncertified"]["config"]["batch_size"] in (8, 16)
    assert repeat["number"] not in [t["number"] for t in client.get("/v1/studies/s/pareto").json()["data"]]
    stored = {t.number: t for t in tuning_service(app).bridge.trials("s")}
    if repeat["number"] in ran:  # a worker ran it: Optuna holds its own measurement
        assert stored[repeat["number"]].values == [300.0, 0.1]
    else:  # told, not run: no values
        assert stored[repeat["number"]].state == "PRUNED" and stored[repeat["number"]].values is None


def test_a_baseline_seed_that_measures_fastest_is_not_recommended_after_remeasurement(
        client: TestClient, make_study: StudyFactory) -> None:
    """Three baseline seeds on a noisy host, one of them the fastest run of the study; the
    re-measured search config measures about the baseline's speed. Nothing is certified: the
    baseline's config is kept (its first seed stands for it, not the seed that ran fastest), the
    search config is named uncertified, and the verdict says the speedup is within the noise."""
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
    assert client.get("/v1/studies/s/best").status_code == 404  # being re-measured: no verdict yet
    r = client.get("/v1/studies/s/best")
    assert "re-measured" in r.json()["detail"] and f"trial {search[0]}" in r.json()["detail"]
    sent = _remeasure_all(client, {search[0]: (104.0, 0.1), 0: (100.0, 0.1)})
    best = client.get("/v1/studies/s/best").json()
    assert best["certified"] is False and best["outcome"] == "undecided" and best["rounds_run"] == 2
    assert best["trial_number"] == 0 and best["speedup"] == 1.0 and best["beats_baseline"] is False
    assert [r["trial_number"] for r in best["configs"] if r["role"] == "candidate"] == [search[0]]
    assert best["configs"][0]["n"] == 5  # the three seeds and two re-measurements: the same budget
    row = best["uncertified"]
    assert row["trial_number"] == search[0] and row["n"] == 2
    assert row["speedup"] == pytest.approx(_geomean(sent[search[0]]) / _geomean(sent[0], 100.0, 130.0, 90.0))
    assert row["speedup_ci_low"] < 1.0 < row["speedup_ci_high"]  # the seeds spread ±20 %: within the noise
    assert "remeasure.max_rounds" in best["verdict"] and "quieter host" in best["verdict"]
    yaml_text = client.get("/v1/studies/s/best", params={"format": "yaml"}).text
    assert "KEEP THE BASELINE (undecided)" in yaml_text


def test_a_clear_win_has_an_interval_above_one(client: TestClient, make_study: StudyFactory) -> None:
    make_study("s", baseline_seeds=2, n_trials=3, seed=0, remeasure={"top_k": 1, "rounds": 2, "windows": 5})
    for i, speed in enumerate((100.0, 102.0)):
        got = lease(client, f"b{i}")
        assert got is not None
        _finish(client, got, f"b{i}", speed, 0.1)
    got = lease(client, "w")
    assert got is not None
    pick = _finish(client, got, "w", 300.0, 0.1)["number"]
    sent = _remeasure_all(client, {pick: (290.0, 0.1), 0: (101.0, 0.1)})
    best = client.get("/v1/studies/s/best").json()
    assert best["certified"] is True and best["trial_number"] == pick
    assert best["beats_baseline"] is True and best["speedup_ci_low"] > 2.5
    # its re-measurements over the baseline's seeds and re-measurements (all at the search's budget)
    assert best["speedup"] == pytest.approx(_geomean(sent[pick]) / _geomean(sent[0], 100.0, 102.0))
    assert "faster beyond the noise" in best["verdict"]


def test_quality_at_the_longer_budget_is_judged_against_the_baseline_at_that_budget(
        client: TestClient, make_study: StudyFactory) -> None:
    """At twice the samples every config overfits (its loss rises): the pick's re-measured loss
    would fail the short probe's gate, but the baseline re-measured at the same budget rises as
    much, so the pick keeps its quality. A config whose loss rises much more than the
    baseline's does not, and is not recommended although faster. (The baseline's seeds are not
    at that budget: its three re-measurements are what quality is judged against.)"""
    make_study("s", baseline_seeds=1, n_trials=3, seed=0,
               remeasure={"top_k": 2, "windows": 5, "samples_factor": 2.0, "max_rounds": 3})
    base = lease(client, "b")
    assert base is not None
    _finish(client, base, "b", 100.0, 0.100)  # the gate at the search budget: 0.110
    fast, faster = [], []
    for speed, out in ((200.0, fast), (250.0, faster)):
        got = lease(client, "w")
        assert got is not None
        out.append(_finish(client, got, "w", speed, 0.105)["number"])
    sent = _remeasure_all(client, {0: (100.0, 0.200), fast[0]: (200.0, 0.205), faster[0]: (250.0, 0.400)},
                          quality_noise=(0.0, 0.0005, -0.0005, 0.0003))
    best = client.get("/v1/studies/s/best").json()
    assert best["certified"] is True and best["rounds_run"] == 3  # quality needs 3 baseline runs at this budget
    assert best["trial_number"] == fast[0] and best["quality_budget"] == "remeasure"
    base_quality = statistics.fmean(q for _, q in sent[0])
    assert best["quality"] == pytest.approx(statistics.fmean(q for _, q in sent[fast[0]]))
    assert best["search_quality"] == pytest.approx(0.105)
    assert best["baseline_quality"] == pytest.approx(base_quality)
    assert best["gate_quality"] == pytest.approx(base_quality + 0.01)  # margin: abs_tol (the spread is smaller)
    assert best["search_gate_quality"] == pytest.approx(0.110)
    rows = {r["trial_number"]: r for r in best["configs"]}
    assert rows[faster[0]]["status"] == "rejected" and "quality worse" in rows[faster[0]]["reason"]
    trials = client.get("/v1/studies/s/trials").json()["data"]
    for t in trials:
        if t["role"] == "remeasure" and t["remeasure_of"] == fast[0]:
            assert t["feasible"] is True and "no worse than the baseline's at this budget" in t["feasibility_note"]
        if t["role"] == "remeasure" and t["remeasure_of"] == faster[0]:
            assert t["feasible"] is False and "worse than the baseline's" in t["feasibility_note"]
    front = [t["number"] for t in client.get("/v1/studies/s/pareto").json()["data"]]
    assert front == [fast[0]]  # the faster config is out at the re-measure budget
    console = Console(width=300, record=True, file=io.StringIO())
    console.print(recommendation_table(Recommendation.model_validate(best)))
    shown = console.export_text()
    assert "at the re-measure budget" in shown and "0.1050 in the search's shorter probe" in shown


def test_without_a_baseline_remeasurement_quality_is_not_judged_and_every_view_says_so(
        client: TestClient, make_study: StudyFactory) -> None:
    """Every re-measurement of the baseline fails: the baseline has one run at the judged budget
    (its seed), too few to judge anything against, so nothing is certified and the re-measured
    candidate's quality stays undecided in every view."""
    make_study("s", baseline_seeds=1, n_trials=2, seed=0, remeasure={"top_k": 1, "windows": 5, "rounds": 2})
    base = lease(client, "b")
    assert base is not None
    _finish(client, base, "b", 100.0, 0.1)
    got = lease(client, "w")
    assert got is not None
    pick = _finish(client, got, "w", 200.0, 0.1)["number"]
    throughputs = iter(NOISE)
    while (got := lease(client, "r")) is not None:
        if _trial(client, got["trial_id"])["remeasure_of"] == 0:
            complete(client, got, "r", throughput=None, nrmse=None, failure={"kind": "oom", "message": "OOM"})
        else:
            _finish(client, got, "r", 190.0 * next(throughputs), 0.3)
    assert client.get("/v1/studies/s").json()["state"] == "finished"
    best = client.get("/v1/studies/s/best").json()
    assert best["certified"] is False and best["outcome"] == "undecided" and best["trial_number"] == 0
    assert best["configs"][0]["n"] == 1  # the baseline: its seed alone
    row = best["uncertified"]
    assert row["trial_number"] == pick and row["n"] == 2 and row["quality_diff"] is None
    assert "needs 2 runs" in row["reason"]
    views = [t for t in client.get("/v1/studies/s/trials").json()["data"]
             if t["role"] == "remeasure" and t["remeasure_of"] == pick]
    assert len(views) == 2
    for view in views:
        assert view["feasible"] is None and view["feasibility_note"].startswith("quality not yet decided")


def test_optuna_holds_what_was_measured_and_the_verdict(app: FastAPI, client: TestClient,
                                                      make_study: StudyFactory) -> None:
    """Read with Optuna's own API, as the dashboard reads it: every COMPLETE trial's values are
    what its probe measured (baseline seeds and re-measurements included, their role in user
    attrs, feasibility as Optuna constraints), no value is a placeholder or overwritten, the
    dashboard's own Pareto computation holds only measured points, and the service's verdict
    is stored beside them; baseline and re-measurement trials carry their params."""
    import optuna

    make_study("s", space=ONE_KNOB, sampler="grid", n_trials=4, baseline={"batch_size": 4}, seed=0,
               remeasure={"top_k": 2, "windows": 5, "rounds": 2})
    base = lease(client, "b")
    assert base is not None
    sent_by_trial = {base["trial_id"]: (100.0, 0.10)}
    _finish(client, base, "b", 100.0, 0.10)
    speeds = {8: (300.0, 0.105), 16: (250.0, 0.104), 4: (120.0, 0.10)}
    numbers = {}
    while (got := lease(client, "w")) is not None and got["role"] == "search":
        size = got["config"]["batch_size"]
        sent_by_trial[got["trial_id"]] = speeds[size]
        numbers[size] = _finish(client, got, "w", *speeds[size])["number"]
    assert got is not None and got["role"] == "remeasure"  # the search is done: round 0 began
    sent_by_trial[got["trial_id"]] = (200.0, 0.105)
    _finish(client, got, "w", 200.0, 0.105)  # round 0 starts with the fastest search config
    # the 300 config regresses to 200 when re-measured, the 250 one holds
    _remeasure_all(client, {numbers[8]: (200.0, 0.105), numbers[16]: (240.0, 0.104), 0: (100.0, 0.10)})
    best = client.get("/v1/studies/s/best?format=json").json()
    assert best["certified"] is True and best["trial_number"] == numbers[16]
    study = optuna.load_study(study_name="s", storage=tuning_service(app).bridge.storage.url)  # stock Optuna
    stored = study.get_trials(deepcopy=False)
    listed = {t["number"]: t for t in client.get("/v1/studies/s/trials").json()["data"]}
    for t in stored:
        if t.state.name != "COMPLETE":
            assert t.values is None
            continue
        measured = t.user_attrs["measurement"]
        assert t.values == [measured["throughput_samples_per_s"], measured["quality"]]
        info = listed[t.number]
        assert t.values == [info["throughput_samples_per_s"], info["quality"]]
        if info["trial_id"] in sent_by_trial:
            assert t.values == list(sent_by_trial[info["trial_id"]])
        assert t.user_attrs["role"] in ("baseline", "search", "remeasure")
        assert len(t.constraints) == 1  # feasibility as Optuna's own constraint
    roles = {t.user_attrs["role"] for t in stored if t.state.name == "COMPLETE"}
    assert roles == {"baseline", "search", "remeasure"}
    # the dashboard's own front: measured points only (each a trial's own values)
    dashboard_front = get_pareto_front_trials(stored, [StudyDirection.MAXIMIZE, StudyDirection.MINIMIZE])
    assert dashboard_front and all(t.values == [t.user_attrs["measurement"]["throughput_samples_per_s"],
                                                t.user_attrs["measurement"]["quality"]] for t in dashboard_front)
    assert study.user_attrs["autotune_recommendation"]["trial_number"] == best["trial_number"]
    assert study.user_attrs["autotune_recommendation"]["certified"] is True
    remeasures = [t for t in stored if t.user_attrs.get("role") == "remeasure"]
    assert len(remeasures) == 3 * best["rounds_run"] == 6  # 2 configs and the baseline, 2 rounds
    for t in remeasures:
        target = next(x for x in stored if x.number == t.user_attrs["remeasure_of"])
        assert t.params == target.params == {"batch_size": target.user_attrs["config"]["batch_size"]}


def test_an_undecided_verdict_names_the_half_left_open_and_its_fix(client: TestClient,
                                                                   make_study: StudyFactory) -> None:
    """Seen on an H100 (bench/results/gpu_quickstart_wheel_h100.json): a config 28× faster whose
    quality was worse by a little more than the margin, not shown either way within the rounds.
    The verdict says that its speed was decided and its quality was not, and names the fixes that
    fit (more rounds, or a wider gate.abs_tol if that difference is acceptable), not a quieter host."""
    make_study("s", baseline_seeds=3, n_trials=5, seed=0,
               remeasure={"top_k": 1, "rounds": 2, "windows": 5}, gate={"abs_tol": 0.01, "k": 0.0})
    for i, quality in enumerate((0.100, 0.105, 0.095)):
        got = lease(client, f"b{i}")
        assert got is not None
        _finish(client, got, f"b{i}", 100.0 * NOISE[i], quality)
    search = []
    for speed in (300.0, 250.0):
        got = lease(client, "w")
        assert got is not None and got["role"] == "search"
        search.append(_finish(client, got, "w", speed, 0.1)["number"])
    # the fastest is 3x faster every time; its quality is 0.012 worse, give or take 0.006
    _remeasure_all(client, {search[0]: (300.0, 0.112), 0: (100.0, 0.1)}, quality_noise=(0.006, -0.006, 0.0, 0.004))
    best = client.get("/v1/studies/s/best").json()
    assert best["outcome"] == "undecided" and best["certified"] is False, best["verdict"]
    row = best["uncertified"]
    assert row["speedup_ci_low"] > 2.0  # the speed is decided
    assert row["quality_diff_ci_high"] > row["quality_margin"]  # the quality is not
    verdict = best["verdict"]
    assert f"The fastest undecided, trial {search[0]}: its val_nrmse was not shown no worse; speedup " in verdict, \
        verdict
    assert "remeasure.max_rounds" in verdict and "widen gate.abs_tol" in verdict and "quieter host" not in verdict
