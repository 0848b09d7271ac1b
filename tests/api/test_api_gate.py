"""Multi-objective search under a quality gate, through the API with fake ProbeResults:
baseline seeds and the gate, constraints the sampler learns, failed trials, memory limit,
re-measurement of the top configs."""

from __future__ import annotations

import io
import itertools
import math
import statistics
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from rich.console import Console
from service_helpers import StudyFactory, complete, lease, probe_result, tuning_service

from autotune.api import service as service_module
from autotune.api.study.samplers import CONSTRAINT_ATTR
from autotune.cli.demo import progress_text, summary_line
from autotune.cli.tables import recommendation_table, studies_table, trials_table
from autotune.contract.views import Recommendation, StudyInfo, TrialList

BASE_NRMSE = [0.10, 0.12, 0.14]  # mean 0.12, std 0.02 → gate 0.12 + max(0.01, 2 × 0.02) = 0.16


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
    assert best["gate_nrmse"] == pytest.approx(gate) and best["search_gate_quality"] == pytest.approx(gate)
    # not re-measured (top_k 0): not judged; the baseline is kept and the feasible candidate (not the faster
    # trial that fails the gate) is the uncertified one
    assert best["outcome"] == "not_judged" and best["trial_number"] == 0 and best["speedup"] == 1.0
    assert best["uncertified"]["trial_number"] == ok["number"]
    assert best["baseline_throughput_samples_per_s"] == pytest.approx(statistics.geometric_mean([90.0, 100.0, 110.0]))
    assert best["baseline_val_nrmse"] == pytest.approx(0.12) and best["baseline_val_nrmse_std"] == pytest.approx(0.02)
    assert best["baseline_seeds"] == 3 and best["remeasured"] is False
    assert best["configs"] == []  # nothing judged: no rule inputs
    # the sampler learns the gate as a constraint (≤ 0 feasible)
    trials = {t.number: t for t in tuning_service(app).bridge.trials("s")}
    assert trials[ok["number"]].user_attrs[CONSTRAINT_ATTR] == pytest.approx(0.155 - gate)
    assert trials[bad["number"]].user_attrs[CONSTRAINT_ATTR] == pytest.approx(0.17 - gate)


def test_a_failed_probe_is_optuna_fail_and_its_config_is_not_run_again(app: FastAPI, client: TestClient,
                                                                       make_study: StudyFactory) -> None:
    """Nothing was measured: Optuna FAIL, no values, no constraint (no placeholder numbers); every
    view of the service says FAIL; a later draw of the config (an OOM says something about it)
    is a repeat, never leased again."""
    make_study("s", space={"params": {"batch_size": {"choices": [4, 8]}}}, sampler="tpe", n_trials=10, seed=0)
    _run_baselines(client, [0.1])
    leased = lease(client, "w1")
    assert leased is not None and leased["role"] == "search"
    failed = complete(client, leased, "w1", throughput=None, nrmse=None,
                      failure={"kind": "oom", "message": "CUDA OOM"})
    assert failed["state"] == "FAIL" and failed["feasible"] is False and failed["values"] is None
    assert failed["failure"] == {"kind": "oom", "message": "CUDA OOM"}
    stored = tuning_service(app).bridge.storage.get_trial(failed["trial_id"])
    assert stored.state.name == "FAIL" and stored.values is None and stored.constraints == {}
    assert CONSTRAINT_ATTR not in stored.user_attrs
    assert stored.user_attrs["failure_kind"] == "oom" and stored.user_attrs["failure_message"] == "CUDA OOM"
    # every view of the service says FAIL and leaves it out
    study = client.get("/v1/studies/s").json()
    assert study["counts"] == {"COMPLETE": 1, "FAIL": 1} and study["failures"] == {"oom": 1}
    listed = {t["number"]: t for t in client.get("/v1/studies/s/trials").json()["data"]}
    assert listed[failed["number"]]["state"] == "FAIL" and listed[failed["number"]]["feasible"] is False
    assert client.get("/v1/studies/s/pareto").json()["data"] == []  # the baseline is no candidate
    assert client.get("/v1/studies/s/best").status_code == 404
    oom_size = leased["config"]["batch_size"]
    while (got := lease(client, "w2")) is not None:
        assert got["config"]["batch_size"] != oom_size  # the OOM config never runs again
        complete(client, got, "w2")
    listed = client.get("/v1/studies/s/trials").json()["data"]
    assert [t["repeat_of"] for t in listed if t["config"].get("batch_size") == oom_size and t["state"] == "REPEAT"]


def test_over_memory_is_infeasible(app: FastAPI, client: TestClient, make_study: StudyFactory) -> None:
    make_study("s", n_trials=10, max_memory_gb=0.5)  # the fake results reserve 1 GiB
    _run_baselines(client, [0.1])
    got = _run(client, "w1", throughput=500.0, nrmse=0.1)
    assert got["feasible"] is False
    trial = tuning_service(app).bridge.storage.get_trial(got["trial_id"])
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


def _report(client: TestClient, got: dict[str, Any], worker: str) -> dict[str, Any]:
    r = client.post(f"/v1/trials/{got['trial_id']}/report", json={
        "worker_id": worker, "step": 3, "metrics": {"loss": 0.5}, "lease_token": got["lease_token"]})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _where(client: TestClient, study: str, got: dict[str, Any]) -> tuple[int, int]:
    trials = client.get(f"/v1/studies/{study}/trials").json()["data"]
    trial = next(t for t in trials if t["trial_id"] == got["trial_id"])
    return trial["remeasure_of"], trial["remeasure_round"]


def test_top_configs_are_remeasured_and_the_recommendation_uses_them(client: TestClient,
                                                                     make_study: StudyFactory) -> None:
    """The top 2 configs and the baseline are re-measured with a longer probe (2.5 × the samples:
    the baseline's seeds are not at that budget, so only its re-measurements count, and quality
    needs three of them: three rounds), all at the round's seed; the recommendation is judged on
    the re-measurements alone (the winner's curse: the fastest search trial re-measures slower)."""
    make_study("s", n_trials=5, seed=0, probe={"samples": 100, "seed": 7},
               remeasure={"top_k": 2, "samples_factor": 2.5, "windows": 12, "seed_offset": 1000, "max_rounds": 4})
    _run_baselines(client, [0.1])
    measured = {}
    for i, thr in enumerate([300.0, 250.0, 200.0, 400.0]):  # the last one fails the gate
        got = lease(client, f"w{i}")
        assert got is not None
        info = _complete_with_windows(client, got, f"w{i}", thr, [thr * 0.98, thr, thr * 1.02],
                                      nrmse=0.5 if thr == 400.0 else 0.1)
        measured[thr] = info["number"]
    assert client.get("/v1/studies/s").json()["state"] == "running"  # the re-measurements are to come
    assert client.get("/v1/studies/s/best").status_code == 404  # no verdict while they run
    # winner's curse: the 300 config re-measures at 240, the 250 one holds at 260; each run its own noise
    truth = {0: 100.0, measured[300.0]: 240.0, measured[250.0]: 260.0}
    noise = itertools.cycle([1.0, 0.995, 1.004, 0.998, 1.002])
    sent: dict[int, list[float]] = {n: [] for n in truth}
    seeds: dict[int, int] = {}
    leases = []
    while (got := lease(client, "r1")) is not None:  # one worker: its rounds one after another
        leases.append(got)
        trial = next(t for t in client.get("/v1/studies/s/trials").json()["data"] if t["trial_id"] == got["trial_id"])
        seeds[trial["remeasure_round"]] = got["probe"]["seed"]
        thr = truth[trial["remeasure_of"]] * next(noise)
        sent[trial["remeasure_of"]].append(thr)
        _complete_with_windows(client, got, "r1", thr, [thr * 0.99, thr, thr * 1.01, thr])
    first, second, third = leases[:3]  # round 0: top_k = 2, and the baseline
    assert {first["role"], second["role"], third["role"]} == {"remeasure"}
    assert first["probe"]["samples"] == 250 and first["probe"]["windows"] == 12 and first["probe"]["seed"] == 1007
    assert third["probe"] == second["probe"] == first["probe"]  # the baseline at the same budget and seed
    trials = {t["trial_id"]: t for t in client.get("/v1/studies/s/trials").json()["data"]}
    assert [trials[x["trial_id"]]["remeasure_of"] for x in (first, second, third)] == [
        measured[300.0], measured[250.0], 0]  # fastest first, then the baseline
    assert {trials[x["trial_id"]]["remeasure_round"] for x in (first, second, third)} == {0}
    base_params = next(t["params"] for t in trials.values() if t["number"] == 0)
    assert trials[third["trial_id"]]["params"] == base_params  # the baseline's: its knobs the space could draw
    assert trials[first["trial_id"]]["params"] == trials[next(
        i for i, t in trials.items() if t["number"] == measured[300.0])]["params"]  # a re-measurement's: its target's
    original = next(t for t in trials.values() if t["number"] == measured[300.0])
    assert first["config"] == {k: v for k, v in original["config"].items() if k != "effective_batch"}  # knobs only
    study = client.get("/v1/studies/s").json()
    assert study["state"] == "finished"
    rounds = len(sent[0])
    assert rounds == 3  # two rounds give the baseline 2 runs at this budget: quality needs 3
    assert seeds == {r: 1007 + r for r in range(rounds)}  # each round its own seed
    assert study["counts"] == {"COMPLETE": 5 + 3 * rounds}
    best = client.get("/v1/studies/s/best").json()
    assert best["certified"] is True and best["rounds_run"] == rounds and best["remeasure_probes"] == 3 * rounds
    assert best["trial_number"] == measured[250.0]
    assert best["throughput_samples_per_s"] == pytest.approx(statistics.geometric_mean(sent[measured[250.0]]))
    assert best["remeasured"] is True and best["baseline_remeasured"] is True and best["quality_budget"] == "remeasure"
    assert best["round_throughputs"] == pytest.approx(sent[measured[250.0]])
    assert best["throughput_ci_low"] < best["throughput_samples_per_s"] < best["throughput_ci_high"]
    assert best["baseline_seeds"] == rounds  # the baseline's runs at the judged budget: its re-measurements only
    assert best["speedup"] == pytest.approx(statistics.geometric_mean(sent[measured[250.0]])
                                            / statistics.geometric_mean(sent[0]))
    assert best["beats_baseline"] is True and best["speedup_ci_low"] > 1.0
    # the 300 config is judged at its re-measured speed, not its search trial's
    row = next(r for r in best["configs"] if r["trial_number"] == measured[300.0])
    assert row["throughput_samples_per_s"] == pytest.approx(statistics.geometric_mean(sent[measured[300.0]]))
    assert row["n"] == rounds and row["status"] == "certified"


def test_each_round_runs_on_one_worker_and_other_workers_run_the_next_rounds(
        client: TestClient, make_study: StudyFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """A re-measure round compares its configs on one worker's GPU (api.leasing.round_for): GPUs of
    one host differ by a few percent, so a candidate whose runs all landed on the faster GPU would
    read the gap as a speedup. The worker that started a round gets its next trial; another worker
    meanwhile starts the next round (the configs undecided now), so two workers run two rounds at
    once; a round whose worker holds no lease and completed none lately is anyone's."""
    make_study("t", n_trials=2, seed=0, probe={"samples": 100}, baseline_seeds=1,
               remeasure={"top_k": 1, "windows": 5, "max_rounds": 3})
    base = lease(client, "w", study="t")
    assert base is not None and base["role"] == "baseline"
    complete(client, base, "w", nrmse=0.1, throughput=100.0)
    search = lease(client, "w", study="t")
    assert search is not None and search["role"] == "search"
    complete(client, search, "w", nrmse=0.1, throughput=200.0)

    def where(got: dict[str, Any]) -> tuple[int, int]:
        return _where(client, "t", got)

    a0 = lease(client, "A", study="t")  # A starts round 0: the candidate first
    b1 = lease(client, "B", study="t")  # round 0 is A's while A is on it: B starts round 1 (reversed)
    assert a0 is not None and b1 is not None
    assert (where(a0), where(b1)) == ((search["number"], 0), (0, 1))
    assert a0["probe"]["seed"] + 1 == b1["probe"]["seed"]  # each round its own seed, as before
    complete(client, a0, "A", nrmse=0.1, throughput=200.0)
    complete(client, b1, "B", nrmse=0.1, throughput=100.0)
    b1_next = lease(client, "B", study="t")  # B gets its own round
    assert b1_next is not None and where(b1_next) == (search["number"], 1)
    a0_next = lease(client, "A", study="t")
    assert a0_next is not None and where(a0_next) == (0, 0)
    c2 = lease(client, "C", study="t")  # rounds 0 and 1 are on A and B: C starts round 2
    assert c2 is not None and where(c2)[1] == 2
    assert lease(client, "D", study="t") is None  # max_rounds 3: no round left to start
    complete(client, b1_next, "B", nrmse=0.1, throughput=201.0)
    complete(client, a0_next, "A", nrmse=0.1, throughput=99.0)
    complete(client, c2, "C", nrmse=0.1, throughput=100.0 if where(c2)[0] == 0 else 200.0)
    # C holds no lease, but completed a trial a moment ago: the round stays C's (leasing.ROUND_HOLD_S), as
    # between any worker's complete and its next lease
    assert lease(client, "D", study="t") is None
    monkeypatch.setattr(service_module, "ROUND_HOLD_S", 0.0)  # the moment has passed: the round is anyone's
    while (got := lease(client, "D", study="t")) is not None:
        complete(client, got, "D", nrmse=0.1, throughput=100.0 if where(got)[0] == 0 else 202.0)
    trials = [t for t in client.get("/v1/studies/t/trials").json()["data"] if t["role"] == "remeasure"]
    workers: dict[int, set[str]] = {}
    for t in trials:
        workers.setdefault(t["remeasure_round"], set()).add(t["worker_id"])
    assert workers == {0: {"A"}, 1: {"B"}, 2: {"C", "D"}}
    assert client.get("/v1/studies/t").json()["state"] == "finished"


def test_remeasure_rounds_interleave_and_the_recommendation_pools_them(client: TestClient,
                                                                       make_study: StudyFactory) -> None:
    """Two rounds over the top 2: every config once, then, once that round is in, every config
    again in reverse order, and each config is judged on its rounds together (the geometric
    mean). Here the host slows down steadily while they run (5 % per re-measurement: a drift of
    minutes, as on the H100 hosts in bench/README.md) and B is truly 1 % faster than A. In plain
    rotation (A B A B) A would run first in both rounds and look 4.5 % faster; in A B B A the
    drift reaches both alike, and B is the pick."""
    make_study("s", n_trials=3, seed=0, probe={"samples": 100},
               remeasure={"top_k": 2, "windows": 5, "rounds": 2})
    _run_baselines(client, [0.1])
    numbers = [_complete_with_windows(client, got, "w", thr, [thr] * 3)["number"]
               for thr in (300.0, 280.0) if (got := lease(client, "w")) is not None]
    a, b = numbers
    true_speed = {a: 300.0, b: 303.0, 0: 100.0}
    measured: dict[int, list[float]] = {a: [], b: [], 0: []}
    order = []
    i = 0
    for round_ in range(2):
        for _ in range(3):  # one worker a round (api.leasing.round_for), one trial after another
            got = lease(client, f"r{round_}")
            assert got is not None and got["role"] == "remeasure"
            assert client.get("/v1/studies/s").json()["state"] == "running"  # every round counts
            trial = next(t for t in client.get("/v1/studies/s/trials").json()["data"]
                         if t["trial_id"] == got["trial_id"])
            order.append((trial["remeasure_of"], trial["remeasure_round"]))
            windows = [true_speed[trial["remeasure_of"]] * (1 - 0.05 * i)] * 5  # the host slows by 5 % per run
            measured[trial["remeasure_of"]].append(windows[0])
            _complete_with_windows(client, got, f"r{round_}", windows[0], windows)
            i += 1
    assert lease(client, "r6") is None  # 2 configs and the baseline × 2 rounds
    assert order == [(a, 0), (b, 0), (0, 0), (0, 1), (b, 1), (a, 1)]  # round by round, the second in reverse
    study = client.get("/v1/studies/s").json()
    assert study["state"] == "finished"
    best = client.get("/v1/studies/s/best").json()
    assert best["certified"] is True and best["trial_number"] == b
    assert best["remeasured"] is True and best["remeasure_rounds"] == 2
    assert best["throughput_samples_per_s"] == pytest.approx(statistics.geometric_mean(measured[b]))
    assert best["throughput_ci_low"] < best["throughput_samples_per_s"] < best["throughput_ci_high"]
    # each round's own rate, round by round; the CI is over the runs (the unit), not their windows: the drift
    # between the two runs widens it beyond both (Student t with 1 degree of freedom: 12.706)
    assert best["round_throughputs"] == pytest.approx([303.0 * 0.95, 303.0 * 0.80])
    logs = [math.log(v) for v in measured[b]]
    half = 12.7062 * statistics.stdev(logs) / math.sqrt(2)
    assert best["throughput_ci_low"] == pytest.approx(math.exp(statistics.fmean(logs) - half), rel=1e-4)
    assert best["throughput_ci_high"] == pytest.approx(math.exp(statistics.fmean(logs) + half), rel=1e-4)
    assert best["throughput_ci_low"] < 303.0 * 0.80 and best["throughput_ci_high"] > 303.0 * 0.95
    rows = {r["trial_number"]: r for r in best["configs"]}
    assert rows[a]["throughput_samples_per_s"] == pytest.approx(statistics.geometric_mean(measured[a]))
    assert rows[a]["throughput_samples_per_s"] < rows[b]["throughput_samples_per_s"]  # A B B A: B ahead, as true
    assert rows[a]["status"] == "stopped"  # not yet decided, and slower than the certified B: no longer measured
    assert rows[0]["n"] == 3  # the baseline: its seed (the same budget) and its two rounds
    rotation = {n: statistics.geometric_mean([true_speed[n] * (1 - 0.05 * i)
                                              for i in ((0, 3) if n == a else (1, 4))]) for n in (a, b)}
    assert rotation[a] > 1.04 * rotation[b]  # what plain rotation (A B base A B base) would have recommended: A
    console = Console(width=300, record=True, file=io.StringIO())
    console.print(recommendation_table(Recommendation.model_validate(best)))  # what `autotune best`/the demo show
    shown = console.export_text()
    assert "(over its 2 re-measurements: runs are the unit)" in shown
    assert "re-measurements" in shown and "287.8, 242.4 samples/s (round by round)" in shown, shown


def test_a_config_whose_remeasure_round_fails_is_not_recommended(client: TestClient,
                                                                 make_study: StudyFactory) -> None:
    make_study("s", n_trials=3, seed=0, probe={"samples": 100}, remeasure={"top_k": 2, "windows": 5, "rounds": 2})
    _run_baselines(client, [0.1])
    numbers = [_complete_with_windows(client, got, "w", thr, [thr] * 3)["number"]
               for thr in (300.0, 280.0) if (got := lease(client, "w")) is not None]
    noise = itertools.cycle([1.0, 1.01, 0.99])
    sent: dict[int, list[float]] = {}
    for _ in range(6):
        got = lease(client, "r")  # one worker: a round runs on the worker that started it
        assert got is not None
        trial = next(t for t in client.get("/v1/studies/s/trials").json()["data"] if t["trial_id"] == got["trial_id"])
        target = trial["remeasure_of"]
        if (target, trial["remeasure_round"]) == (numbers[0], 1):  # the faster config OOMs once
            complete(client, got, "r", throughput=None, nrmse=None,
                     failure={"kind": "oom", "message": "CUDA out of memory"})
        else:
            thr = (100.0 if target == 0 else 300.0) * next(noise)
            sent.setdefault(target, []).append(thr)
            _complete_with_windows(client, got, "r", thr, [thr] * 5)
    assert lease(client, "r") is None and client.get("/v1/studies/s").json()["state"] == "finished"
    best = client.get("/v1/studies/s/best").json()
    assert best["certified"] is True and best["trial_number"] == numbers[1] and best["remeasure_rounds"] == 2
    assert best["round_throughputs"] == pytest.approx(sent[numbers[1]])
    failed = next(r for r in best["configs"] if r["trial_number"] == numbers[0])
    assert failed["status"] == "failed" and "failed (oom)" in failed["reason"]


def test_without_remeasurement_nothing_is_judged_and_the_ci_comes_from_the_kept_baseline(
        client: TestClient, make_study: StudyFactory) -> None:
    """remeasure.top_k 0: no config is judged, so none is certified: the baseline's config is
    kept, its throughput's CI from its own run's windows, and the search's fastest candidate is
    named beside it, unjudged."""
    make_study("s", n_trials=2)
    base = lease(client, "w0")
    assert base is not None
    _complete_with_windows(client, base, "w0", 100.0, [95.0, 100.0, 105.0])
    got = lease(client, "w1")
    assert got is not None
    _complete_with_windows(client, got, "w1", 200.0, [190.0, 200.0, 210.0])
    assert client.get("/v1/studies/s").json()["state"] == "finished"
    best = client.get("/v1/studies/s/best").json()
    assert best["outcome"] == "not_judged" and best["certified"] is False and best["remeasured"] is False
    assert best["trial_number"] == base["number"]
    assert best["throughput_ci_low"] < 100.0 < best["throughput_ci_high"] < 190.0
    assert best["uncertified"]["trial_number"] == got["number"]
    assert best["uncertified"]["throughput_samples_per_s"] == pytest.approx(200.0)


def test_a_round_started_ahead_of_the_verdict_is_pruned_once_the_verdict_is_in(
        client: TestClient, make_study: StudyFactory) -> None:
    """Three workers run rounds 0, 1 and 2 at once (api.leasing.round_for). Rounds 0 and 1 decide
    the verdict, so round 2 no longer counts: its next report is answered "prune" with the reason,
    and the trial ends PRUNED, read by nothing (the verdict stays the one of rounds 0 and 1) and
    run again by no one. While the verdict is open, its reports are answered "go on"."""
    make_study("t", n_trials=2, seed=0, probe={"samples": 100}, baseline_seeds=1,
               remeasure={"top_k": 1, "windows": 5, "rounds": 2, "max_rounds": 4})
    complete(client, lease(client, "w", study="t") or {}, "w", nrmse=0.1, throughput=100.0)
    search = lease(client, "w", study="t")
    assert search is not None and search["role"] == "search"
    complete(client, search, "w", nrmse=0.1, throughput=200.0)
    noise = itertools.cycle([1.0, 1.01, 0.99, 1.02])

    def run(got: dict[str, Any], worker: str) -> None:
        thr = (100.0 if _where(client, "t", got)[0] == 0 else 200.0) * next(noise)
        _complete_with_windows(client, got, worker, thr, [thr] * 5)

    a, b, c = (lease(client, w, study="t") for w in "ABC")
    assert a is not None and b is not None and c is not None
    assert [_where(client, "t", got)[1] for got in (a, b, c)] == [0, 1, 2]
    assert _report(client, c, "C") == {"prune": False, "reason": None}  # undecided: every round counts
    for got, worker in ((a, "A"), (b, "B")):
        run(got, worker)
        rest = lease(client, worker, study="t")  # the worker's own round goes on: its other config
        assert rest is not None and _where(client, "t", rest)[1] == _where(client, "t", got)[1]
        run(rest, worker)
    reply = _report(client, c, "C")
    assert reply["prune"] is True and reply["reason"] == "not needed: the verdict is in after 2 re-measure round(s)"
    # the study is finished while C's run stops: `tune`'s last line says that run is not needed
    ending = summary_line(StudyInfo.model_validate(client.get("/v1/studies/t").json()), 9.0)
    assert ending.startswith("study t finished in 9 s: 6 complete, 0 pruned, 0 failed") and \
        ending.endswith("; 1 re-measure run(s) still stopping (not needed)"), ending
    info = complete(client, c, "C", stopped_early=True)
    assert info["state"] == "PRUNED" and info["prune_reason"] == reply["reason"]
    best = client.get("/v1/studies/t/best").json()
    assert best["certified"] is True and best["trial_number"] == search["number"] and best["remeasure_rounds"] == 2
    assert lease(client, "C", study="t") is None and client.get("/v1/studies/t").json()["state"] == "finished"
    # counted apart from the configs pruned for their speed or quality
    info = StudyInfo.model_validate(client.get("/v1/studies/t").json())
    assert info.counts.get("UNNEEDED") == 1 and "PRUNED" not in info.counts, info.counts
    console = Console(record=True, width=250)  # as `autotune tune`'s progress line, `studies`, `status` print it
    console.print(progress_text(info))
    console.print(studies_table([info]))
    console.print(trials_table(TrialList.model_validate(client.get("/v1/studies/t/trials").json()).data, "trials"))
    shown = console.export_text()
    assert "0 pruned" in shown and shown.count("1 stopped (not needed)") == 2, shown
    row = next(line for line in shown.split("trials")[-1].splitlines() if "not needed" in line)  # its row in the table
    assert "PRUNED" in row and " no " not in row, row  # feasibility is not judged on a run stopped for the verdict


def test_a_config_decided_in_a_round_stops_its_later_rounds_while_another_config_goes_on(
        client: TestClient, make_study: StudyFactory) -> None:
    """Two candidates: the faster one shows worse quality in rounds 0 and 1 (rejected), the other
    runs as fast as the baseline (undecided). Round 2, started ahead on another worker, stops the
    rejected config's run ("prune", why) and keeps the undecided one's and the baseline's."""
    make_study("u", n_trials=3, seed=0, probe={"samples": 100}, baseline_seeds=1,
               remeasure={"top_k": 2, "windows": 5, "rounds": 2, "max_rounds": 5, "quality_headroom": False})
    complete(client, lease(client, "w", study="u") or {}, "w", nrmse=0.1, throughput=100.0)
    fast = lease(client, "w", study="u")
    assert fast is not None
    complete(client, fast, "w", nrmse=0.1, throughput=300.0)
    even = lease(client, "w", study="u")
    assert even is not None
    complete(client, even, "w", nrmse=0.1, throughput=101.0)
    noise = itertools.cycle([1.0, 1.05, 0.95, 1.04, 0.97])

    def run(got: dict[str, Any], worker: str) -> None:
        target = _where(client, "u", got)[0]
        thr = {0: 100.0, fast["number"]: 300.0, even["number"]: 100.0}[target] * next(noise)
        _complete_with_windows(client, got, worker, thr, [thr] * 5, nrmse=0.5 if target == fast["number"] else 0.1)

    firsts = {w: lease(client, w, study="u") for w in "ABC"}
    assert [_where(client, "u", got)[1] for got in firsts.values() if got] == [0, 1, 2]
    later = [firsts["C"]]  # round 2's runs, all on C, leased as C goes
    for worker in "AB":
        got = firsts[worker]
        while got is not None and _where(client, "u", got)[1] < 2:
            run(got, worker)
            got = lease(client, worker, study="u")
        if got is not None:  # the worker went on to a later round: leave it running
            later.append(got)
    assert "being re-measured" in client.get("/v1/studies/u/best").json()["detail"]  # the even one is undecided
    c = later[0]
    assert c is not None
    replies = {}
    while c is not None and _where(client, "u", c)[1] == 2:
        target = _where(client, "u", c)[0]
        replies[target] = _report(client, c, "C")
        if replies[target]["prune"]:
            complete(client, c, "C", stopped_early=True)
        else:
            run(c, "C")
        c = lease(client, "C", study="u")
    assert replies[fast["number"]]["prune"] is True
    assert replies[fast["number"]]["reason"] == (f"not needed: trial {fast['number']}'s config was decided (rejected) "
                                                 "after 2 re-measure round(s)")
    assert not replies[even["number"]]["prune"] and not replies[0]["prune"]
