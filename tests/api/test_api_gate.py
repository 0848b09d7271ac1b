"""Multi-objective search under a quality gate, through the API with fake ProbeResults:
baseline seeds and the gate, constraints the sampler learns, failed trials, memory limit,
re-measurement of the top configs."""

from __future__ import annotations

import io
import statistics
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from optuna.samplers._base import _CONSTRAINTS_KEY
from rich.console import Console
from service_helpers import StudyFactory, complete, lease, probe_result

from api.service import TuningService
from autotune.gate import FAILED_CONSTRAINT
from autotune.protocol import Recommendation
from autotune.samplers import CONSTRAINT_ATTR
from autotune.tables import recommendation_table

BASE_NRMSE = [0.10, 0.12, 0.14]  # mean 0.12, std 0.02 → gate 0.12 + max(0.01, 2 × 0.02) = 0.16


def _service(app: FastAPI) -> TuningService:
    service: TuningService = app.state.service
    return service


def _run_baselines(client: TestClient, nrmses: list[float], throughputs: list[float] | None = None) -> None:
    leases = [lease(client, f"b{i}") for i in range(len(nrmses))]
    assert all(x is not None and x["role"] == "baseline" for x in leases)
    seeds = [x["probe"]["seed"] for x in leases]  # type: ignore[index]
    assert seeds == [seeds[0] + i for i in range(len(nrmses))]
    assert lease(client, "other") is None  # withheld until every seed is done
    for i, (got, nrmse) in enumerate(zip(leases, nrmses, strict=True)):
        assert lease(client, "other") is None
        complete(client, got, f"b{i}", nrmse=nrmse,  # type: ignore[arg-type]
                 throughput=throughputs[i] if throughputs else 100.0)


def _run(client: TestClient, worker: str, **result: Any) -> dict[str, Any]:
    got = lease(client, worker)
    assert got is not None and got["role"] == "search"
    return complete(client, got, worker, **result)


def test_gate_from_three_baseline_seeds(app: FastAPI, client: TestClient, make_study: StudyFactory) -> None:
    make_study("s", baseline_seeds=3, n_trials=10, seed=0)
    _run_baselines(client, BASE_NRMSE, [90.0, 100.0, 110.0])
    gate = statistics.fmean(BASE_NRMSE) + max(0.01, 2.0 * statistics.stdev(BASE_NRMSE))
    ok = _run(client, "w1", throughput=300.0, nrmse=0.155)  # inside the widened gate (> mean + abs_tol)
    bad = _run(client, "w2", throughput=400.0, nrmse=0.17)
    assert ok["feasible"] is True and bad["feasible"] is False
    best = client.get("/v1/studies/s/best").json()
    assert best["gate_nrmse"] == pytest.approx(gate)
    assert best["trial_number"] == ok["number"] and best["speedup"] == pytest.approx(3.0)  # over the seeds' mean
    assert best["baseline_val_nrmse"] == pytest.approx(0.12) and best["baseline_val_nrmse_std"] == pytest.approx(0.02)
    assert best["baseline_seeds"] == 3 and best["remeasured"] is False
    # the sampler learns the gate as a constraint (≤ 0 feasible)
    trials = {t.number: t for t in _service(app).bridge.trials("s")}
    assert trials[ok["number"]].user_attrs[CONSTRAINT_ATTR] == pytest.approx(0.155 - gate)
    assert trials[bad["number"]].user_attrs[CONSTRAINT_ATTR] == pytest.approx(0.17 - gate)


def test_a_failed_trial_teaches_the_sampler_but_stays_fail(app: FastAPI, client: TestClient,
                                                          make_study: StudyFactory) -> None:
    make_study("s", sampler="tpe", n_trials=10, seed=0)
    _run_baselines(client, [0.1])
    failed = _run(client, "w1", throughput=None, nrmse=None, failure={"kind": "oom", "message": "CUDA OOM"})
    assert failed["state"] == "FAIL" and failed["feasible"] is False and failed["values"] is None
    assert failed["failure"] == {"kind": "oom", "message": "CUDA OOM"}
    # Optuna: COMPLETE with worst-case values and the failed constraint (stored for the sampler too)
    stored = _service(app).bridge.storage.get_trial(failed["trial_id"])
    assert stored.state.name == "COMPLETE" and stored.values == [0.0, 10.0]
    assert stored.user_attrs[CONSTRAINT_ATTR] == FAILED_CONSTRAINT
    assert stored.system_attrs[_CONSTRAINTS_KEY] == [FAILED_CONSTRAINT]
    assert stored.user_attrs["failure_kind"] == "oom" and stored.user_attrs["failure_message"] == "CUDA OOM"
    # every view of the service says FAIL and leaves it out
    study = client.get("/v1/studies/s").json()
    assert study["counts"] == {"COMPLETE": 1, "FAIL": 1} and study["failures"] == {"oom": 1}
    listed = {t["number"]: t for t in client.get("/v1/studies/s/trials").json()["data"]}
    assert listed[failed["number"]]["state"] == "FAIL" and listed[failed["number"]]["feasible"] is False
    assert client.get("/v1/studies/s/pareto").json()["data"] == []  # the baseline is no candidate
    assert client.get("/v1/studies/s/best").status_code == 404


def test_over_memory_is_infeasible(app: FastAPI, client: TestClient, make_study: StudyFactory) -> None:
    make_study("s", n_trials=10, max_memory_gb=0.5)  # the fake results reserve 1 GiB
    _run_baselines(client, [0.1])
    got = _run(client, "w1", throughput=500.0, nrmse=0.1)
    assert got["feasible"] is False
    trial = _service(app).bridge.storage.get_trial(got["trial_id"])
    assert trial.user_attrs[CONSTRAINT_ATTR] == pytest.approx(0.5)  # 1 GiB − 0.5
    r = client.get("/v1/studies/s/best")
    assert r.status_code == 404


def _complete_with_windows(client: TestClient, got: dict[str, Any], worker: str, throughput: float,
                           windows: list[float], nrmse: float = 0.1) -> dict[str, Any]:
    result = {**probe_result(got["config"], throughput=throughput, nrmse=nrmse), "window_throughputs": windows}
    r = client.post(f"/v1/trials/{got['trial_id']}/complete", json={"worker_id": worker, "result": result})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_top_configs_are_remeasured_and_the_recommendation_uses_them(client: TestClient,
                                                                     make_study: StudyFactory) -> None:
    make_study("s", n_trials=5, seed=0, probe={"samples": 100, "seed": 7},
               remeasure={"top_k": 2, "samples_factor": 2.5, "windows": 12, "seed_offset": 1000})
    _run_baselines(client, [0.1])
    measured = {}
    for i, thr in enumerate([300.0, 250.0, 200.0, 400.0]):  # the last one fails the gate
        got = lease(client, f"w{i}")
        assert got is not None
        info = _complete_with_windows(client, got, f"w{i}", thr, [thr * 0.98, thr, thr * 1.02],
                                      nrmse=0.5 if thr == 400.0 else 0.1)
        measured[thr] = info["number"]
    assert client.get("/v1/studies/s").json()["state"] == "running"  # the re-measurements are to come
    first, second, third = lease(client, "r1"), lease(client, "r2"), lease(client, "r3")
    assert lease(client, "r4") is None  # top_k = 2, and the baseline
    assert first is not None and second is not None and third is not None
    assert {first["role"], second["role"], third["role"]} == {"remeasure"}
    assert first["probe"]["samples"] == 250 and first["probe"]["windows"] == 12 and first["probe"]["seed"] == 1007
    assert third["probe"] == first["probe"]  # the baseline at the same budget and seed
    trials = {t["trial_id"]: t for t in client.get("/v1/studies/s/trials").json()["data"]}
    assert [trials[x["trial_id"]]["remeasure_of"] for x in (first, second, third)] == [
        measured[300.0], measured[250.0], 0]  # fastest first, then the baseline
    base_params = next(t["params"] for t in trials.values() if t["number"] == 0)
    assert trials[third["trial_id"]]["params"] == base_params  # the baseline's: its knobs the space could draw
    assert trials[first["trial_id"]]["params"] == trials[next(
        i for i, t in trials.items() if t["number"] == measured[300.0])]["params"]  # a re-measurement's: its target's
    by_target = {trials[x["trial_id"]]["remeasure_of"]: (x, w) for x, w in ((first, "r1"), (second, "r2"),
                                                                             (third, "r3"))}
    got, worker = by_target[0]
    _complete_with_windows(client, got, worker, 100.0, [99.0, 100.0, 101.0, 100.0])
    # winner's curse: the 300 config re-measures at 240, the 250 one holds at 260
    got, worker = by_target[measured[300.0]]
    original = next(t for t in trials.values() if t["number"] == measured[300.0])
    assert got["config"] == {k: v for k, v in original["config"].items() if k != "effective_batch"}  # knobs only
    _complete_with_windows(client, got, worker, 240.0, [235.0, 240.0, 245.0, 240.0])
    assert client.get("/v1/studies/s").json()["state"] == "running"
    got, worker = by_target[measured[250.0]]
    _complete_with_windows(client, got, worker, 260.0, [255.0, 260.0, 265.0, 260.0])
    study = client.get("/v1/studies/s").json()
    assert study["state"] == "finished" and study["counts"] == {"COMPLETE": 8}
    best = client.get("/v1/studies/s/best").json()
    assert best["trial_number"] == measured[250.0] and best["throughput_samples_per_s"] == 260.0
    assert best["remeasured"] is True and best["baseline_remeasured"] is True
    assert best["throughput_ci_low"] < 260.0 < best["throughput_ci_high"]
    assert best["speedup"] == pytest.approx(2.6)
    assert best["beats_baseline"] is True and best["speedup_ci_low"] > 1.0


def test_remeasure_rounds_interleave_and_the_recommendation_pools_them(client: TestClient,
                                                                       make_study: StudyFactory) -> None:
    """Two rounds over the top 2: every config once, then every config again in reverse order,
    and each config's throughput pools its rounds' windows. Here the host slows down steadily
    while they run (5 % per re-measurement: a drift of minutes, as on the H100 hosts in
    bench/README.md) and B is truly 1 % faster than A. In plain rotation (A B A B) A would run
    first in both rounds and look 4.5 % faster; in A B B A the drift reaches both alike."""
    make_study("s", n_trials=3, seed=0, probe={"samples": 100},
               remeasure={"top_k": 2, "windows": 5, "rounds": 2})
    _run_baselines(client, [0.1])
    numbers = [_complete_with_windows(client, got, "w", thr, [thr] * 3)["number"]
               for thr in (300.0, 280.0) if (got := lease(client, "w")) is not None]
    a, b = numbers
    order, leases = [], []
    for i in range(6):
        got = lease(client, f"r{i}")
        assert got is not None and got["role"] == "remeasure"
        trial = next(t for t in client.get("/v1/studies/s/trials").json()["data"] if t["trial_id"] == got["trial_id"])
        order.append((trial["remeasure_of"], trial["remeasure_round"]))
        leases.append(got)
    assert lease(client, "r6") is None  # 2 configs and the baseline × 2 rounds
    assert order == [(a, 0), (b, 0), (0, 0), (0, 1), (b, 1), (a, 1)]  # round by round, the second in reverse
    true_speed = {a: 300.0, b: 303.0, 0: 100.0}
    measured: dict[int, list[float]] = {a: [], b: [], 0: []}
    for i, (got, (number, _)) in enumerate(zip(leases, order, strict=True)):
        assert client.get("/v1/studies/s").json()["state"] == "running"  # every round counts
        windows = [true_speed[number] * (1 - 0.05 * i)] * 5  # the host slows by 5 % per re-measurement
        measured[number] += windows
        _complete_with_windows(client, got, f"r{i}", windows[0], windows)
    study = client.get("/v1/studies/s").json()
    assert study["state"] == "finished"
    best = client.get("/v1/studies/s/best").json()
    assert best["trial_number"] == b and best["remeasured"] is True and best["remeasure_rounds"] == 2
    assert best["throughput_samples_per_s"] == pytest.approx(statistics.harmonic_mean(measured[b]))
    assert best["throughput_ci_low"] < best["throughput_samples_per_s"] < best["throughput_ci_high"]
    # each round's own rate, round by round; they differ by more than the windows' interval: a note says so
    assert best["round_throughputs"] == pytest.approx([303.0 * 0.95, 303.0 * 0.80])
    assert best["throughput_ci_high"] < 303.0 * 0.95 and best["throughput_ci_low"] > 303.0 * 0.80
    (note,) = [n for n in best["measurement_notes"] if "re-measurements ran at" in n]
    assert "288, 242 samples/s, 17 % apart" in note and "remeasure.rounds" in note
    rotation = {n: statistics.harmonic_mean([true_speed[n] * (1 - 0.05 * i)
                                             for i in ((0, 3) if n == a else (1, 4))]) for n in (a, b)}
    assert rotation[a] > 1.04 * rotation[b]  # what plain rotation (A B base A B base) would have recommended: A
    console = Console(width=300, record=True, file=io.StringIO())
    console.print(recommendation_table(Recommendation.model_validate(best)))  # what `autotune best`/the demo show
    shown = console.export_text()
    assert "(re-measured twice with a longer probe)" in shown
    assert "re-measurements" in shown and "287.8, 242.4 samples/s (round by round)" in shown, shown


def test_a_config_whose_remeasure_round_fails_is_not_recommended(client: TestClient,
                                                                 make_study: StudyFactory) -> None:
    make_study("s", n_trials=3, seed=0, probe={"samples": 100}, remeasure={"top_k": 2, "windows": 5, "rounds": 2})
    _run_baselines(client, [0.1])
    numbers = [_complete_with_windows(client, got, "w", thr, [thr] * 3)["number"]
               for thr in (300.0, 280.0) if (got := lease(client, "w")) is not None]
    for i in range(6):
        got = lease(client, f"r{i}")
        assert got is not None
        trial = next(t for t in client.get("/v1/studies/s/trials").json()["data"] if t["trial_id"] == got["trial_id"])
        if (trial["remeasure_of"], trial["remeasure_round"]) == (numbers[0], 1):  # the faster config OOMs once
            complete(client, got, f"r{i}", throughput=None, nrmse=None,
                     failure={"kind": "oom", "message": "CUDA out of memory"})
        else:
            _complete_with_windows(client, got, f"r{i}", 300.0, [300.0] * 5)
    best = client.get("/v1/studies/s/best").json()
    assert best["trial_number"] == numbers[1] and best["remeasure_rounds"] == 2
    assert best["round_throughputs"] == [300.0, 300.0]  # rounds that agree: no note about them
    assert not [n for n in best["measurement_notes"] if "re-measurements ran at" in n]


def test_without_remeasurement_the_ci_comes_from_the_trial(client: TestClient, make_study: StudyFactory) -> None:
    make_study("s", n_trials=2)
    _run_baselines(client, [0.1])
    got = lease(client, "w1")
    assert got is not None
    _complete_with_windows(client, got, "w1", 200.0, [190.0, 200.0, 210.0])
    best = client.get("/v1/studies/s/best").json()
    assert best["remeasured"] is False and best["throughput_ci_low"] < 200.0 < best["throughput_ci_high"]
    assert client.get("/v1/studies/s").json()["state"] == "finished"
