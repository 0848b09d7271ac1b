"""Energy as an objective through the service (issue 25): a GPU study with objectives
[throughput, quality, energy] or [energy, quality] gets three (or two) Optuna values per trial,
directions and metric names the dashboard reads, a front over every objective, pruning that
keeps a slow but thrifty trial, and a recommendation that reports the pick's and the
baseline's energy per sample with their ratio and its interval: the fastest certified candidate
when throughput is an objective, the lowest energy per sample with [energy, quality] (judged
like the speed: below the baseline's beyond the noise, else the baseline is kept). A CPU study
cannot ask for energy, and a result without energy fails a study that minimizes it."""

from __future__ import annotations

import itertools
import statistics
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from optuna.study import StudyDirection
from optuna_dashboard._pareto_front import get_pareto_front_trials
from rich.console import Console
from service_helpers import StudyFactory, lease, probe_result, trials_of, tuning_service

from autotune.cli.report import write_report
from autotune.cli.tables import recommendation_table, studies_table, trials_table
from autotune.contract.views import Recommendation, StudyInfo, TrialInfo

GPU = "NVIDIA H100 80GB HBM3"
KNOB = {"params": {"batch_size": {"choices": [8, 16]}}, "fixed": {}}  # the baseline runs batch 4


def _result(got: dict[str, Any], throughput: float, quality: float, energy: float | None) -> dict[str, Any]:
    """A fake GPU result: three windows around the throughput and the energy per sample."""
    result = {**probe_result(got["config"], throughput=throughput, nrmse=quality),
              "window_throughputs": [throughput * f for f in (0.99, 1.0, 1.01)], "device": GPU}
    if energy is not None:
        result.update(energy_j_per_sample=energy, window_energy_j_per_sample=[energy * f for f in (1.02, 1.0, 0.98)],
                      gpu_energy_j_per_sample=[energy], energy_method="nvml_total_energy")
    return result


def _finish(client: TestClient, got: dict[str, Any], worker: str, throughput: float, quality: float,
            energy: float | None) -> dict[str, Any]:
    r = client.post(f"/v1/trials/{got['trial_id']}/complete",
                    json={"worker_id": worker, "result": _result(got, throughput, quality, energy)})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _lease(client: TestClient, worker: str) -> dict[str, Any]:
    got = lease(client, worker, hardware=GPU)
    assert got is not None
    return got


NOISE = (1.0, 1.01, 0.99, 1.004, 0.996, 1.007, 0.993)  # each run its own throughput and energy


def _remeasure_all(client: TestClient, measured: dict[int, tuple[float, float, float]], noisy: bool = False
                   ) -> dict[int, list[tuple[float, float, float]]]:
    """Lease and complete every re-measurement until the study has finished: target number ->
    (throughput, quality, energy), each run's throughput and energy scaled by the next NOISE
    factor when `noisy`. Returns what each target's runs sent, in order."""
    noise = itertools.cycle(NOISE if noisy else (1.0,))
    sent: dict[int, list[tuple[float, float, float]]] = {}
    while (got := lease(client, "r", hardware=GPU)) is not None:
        assert got["role"] == "remeasure"
        target = next(t for t in client.get("/v1/studies/s/trials").json()["data"]
                      if t["trial_id"] == got["trial_id"])["remeasure_of"]
        throughput, quality, energy = measured[target]
        f = next(noise)
        run = (throughput * f, quality, energy / f)
        sent.setdefault(target, []).append(run)
        _finish(client, got, "r", *run)
    assert client.get("/v1/studies/s").json()["state"] == "finished"
    return sent


def _geomean(values: list[float]) -> float:
    return statistics.geometric_mean(values)


def test_a_cpu_study_asking_for_energy_is_refused_with_the_fix(client: TestClient) -> None:
    r = client.post("/v1/studies", json={"name": "s", "objectives": ["energy", "quality"]})
    assert r.status_code == 422
    message = str(r.json())
    assert "energy" in message and "hardware 'cpu'" in message
    assert "drop energy from objectives, or set hardware to the GPU name" in message
    assert client.get("/v1/studies").json()["count"] == 0  # nothing created
    ok = client.post("/v1/studies", json={"name": "g", "hardware": GPU, "objectives": ["energy", "quality"]})
    assert ok.status_code == 201, ok.text


def _three_objective_study(client: TestClient, make_study: StudyFactory, **spec: Any) -> dict[int, int]:
    """Baseline (batch 4) at 100 samples/s and 1.0 J/sample, then the grid: batch 8 the fastest at
    0.5 J/sample, batch 16 slower but the thriftiest. Returns batch size -> trial number."""
    make_study("s", hardware=GPU, space=KNOB, sampler="grid", n_trials=3, baseline={"batch_size": 4}, seed=0,
               **spec)
    base = _lease(client, "b")
    _finish(client, base, "b", 100.0, 0.10, 1.0)
    measured = {8: (300.0, 0.105, 0.5), 16: (250.0, 0.104, 0.3)}
    numbers = {4: base["number"]}
    for _ in measured:
        got = _lease(client, "w")
        size = got["config"]["batch_size"]
        numbers[size] = _finish(client, got, "w", *measured[size])["number"]
    return numbers


def test_three_objectives_reach_optuna_the_front_and_the_recommendation(
        app: FastAPI, client: TestClient, make_study: StudyFactory) -> None:
    numbers = _three_objective_study(client, make_study, objectives=["throughput", "quality", "energy"],
                                     remeasure={"top_k": 2, "windows": 5})
    sent = _remeasure_all(client, {numbers[8]: (290.0, 0.105, 0.52), numbers[16]: (245.0, 0.104, 0.31),
                                   numbers[4]: (101.0, 0.10, 1.02)}, noisy=True)
    study = tuning_service(app).bridge.storage  # Optuna's RDBStorage, as the dashboard reads it
    study_id = study.get_study_id_from_name("s")
    assert study.get_study_directions(study_id) == [StudyDirection.MAXIMIZE, StudyDirection.MINIMIZE,
                                                    StudyDirection.MINIMIZE]
    names = study.get_study_system_attrs(study_id).get("study:metric_names")
    assert names == ["throughput_samples_per_s", "val_nrmse", "energy_j_per_sample"]
    trials = trials_of(client)
    assert trials[numbers[16]]["energy_j_per_sample"] == pytest.approx(0.3)
    assert trials[numbers[16]]["values"] == [250.0, pytest.approx(0.104), pytest.approx(0.3)]
    # the slower, thriftier config is on the front of three objectives (with two it would be dominated), each
    # at its re-measured values: the geometric mean throughput, the mean quality and energy per sample
    expected = {n: [pytest.approx(_geomean([r[0] for r in sent[n]])), pytest.approx(q),
                    pytest.approx(statistics.fmean(r[2] for r in sent[n]))]
                for n, q in ((numbers[8], 0.105), (numbers[16], 0.104))}
    front = {t["number"]: t["values"] for t in client.get("/v1/studies/s/pareto").json()["data"]}
    assert front == expected
    # Optuna holds every trial's own three measured values (the baseline seed's too): no placeholders
    stored = study.get_all_trials(study_id, deepcopy=False)
    for t in stored:
        if t.state.name == "COMPLETE":
            assert list(t.values) == trials[t.number]["values"]
    assert list(next(t for t in stored if t.number == numbers[4]).values) == [100.0, pytest.approx(0.10), 1.0]
    dashboard = get_pareto_front_trials(stored, study.get_study_directions(study_id))
    assert dashboard and all(t.values == trials[t.number]["values"] for t in dashboard)
    best = client.get("/v1/studies/s/best").json()
    assert best["certified"] is True
    assert best["chosen_by"] == "throughput" and best["trial_number"] == numbers[8]  # the fastest
    pick_energy = [r[2] for r in sent[numbers[8]]]
    base_energy = [1.0, *(r[2] for r in sent[numbers[4]])]  # its seed is at the same budget: samples_factor 1
    assert best["energy_j_per_sample"] == pytest.approx(statistics.fmean(pick_energy))
    assert best["baseline_energy_j_per_sample"] == pytest.approx(statistics.fmean(base_energy))
    assert best["energy_ratio"] == pytest.approx(_geomean(pick_energy) / _geomean(base_energy))
    assert best["energy_ratio_ci_low"] < best["energy_ratio"] < best["energy_ratio_ci_high"] < 1.0
    assert best["saves_energy"] is True and "less energy beyond the noise" in best["energy_verdict"]
    assert best["energy_method"] == "nvml_total_energy"
    yaml_text = client.get("/v1/studies/s/best", params={"format": "yaml"}).text
    assert f"# energy: {best['energy_j_per_sample']:.4g} J/sample (nvml_total_energy)" in yaml_text
    assert (f"# baseline energy: {best['baseline_energy_j_per_sample']:.4g} J/sample at the same budget "
            f"(pick / baseline {best['energy_ratio']:.2f}x, 95% CI") in yaml_text
    console = Console(file=StringIO(), width=200)
    console.print(recommendation_table(Recommendation.model_validate(best)))
    console.print(trials_table([TrialInfo.model_validate(t) for t in trials.values()], "trials"))
    console.print(studies_table([StudyInfo.model_validate(client.get("/v1/studies/s").json())]))
    printed = console.file.getvalue()  # type: ignore[attr-defined]
    assert (f"{best['energy_j_per_sample']:.4g} J/sample (baseline {best['baseline_energy_j_per_sample']:.4g}) "
            "· nvml_total_energy") in printed and "J/sample" in printed
    assert best["speedup"] == pytest.approx(_geomean([r[0] for r in sent[numbers[8]]])
                                            / _geomean([100.0, *(r[0] for r in sent[numbers[4]])]))
    assert f"{best['speedup']:.2f}×" in printed  # the studies table: the speedup (throughput picked)


def test_energy_and_quality_recommends_the_lowest_energy_per_sample(
        client: TestClient, make_study: StudyFactory) -> None:
    """[energy, quality]: the thriftiest candidate is re-measured (top_k 1: not the fastest) and,
    its energy per sample judged lower than the baseline's beyond the noise, certified and
    recommended, with its energy ratio and interval; its speed is still given."""
    numbers = _three_objective_study(client, make_study, objectives=["energy", "quality"],
                                     remeasure={"top_k": 1, "windows": 5})
    assert client.get("/v1/studies/s/best").status_code == 404  # being re-measured
    assert "lowest energy so far is trial" in client.get("/v1/studies/s/best").json()["detail"]
    targets = []
    noise = iter(NOISE)
    energies: dict[int, list[float]] = {numbers[16]: [], numbers[4]: [1.0]}  # the baseline's seed counts
    while (got := lease(client, "r", hardware=GPU)) is not None:
        target = next(t for t in client.get("/v1/studies/s/trials").json()["data"]
                      if t["trial_id"] == got["trial_id"])["remeasure_of"]
        targets.append(target)
        throughput, quality, energy = {numbers[16]: (245.0, 0.104, 0.31), numbers[4]: (101.0, 0.10, 1.0)}[target]
        energy *= next(noise)
        energies[target].append(energy)
        _finish(client, got, "r", throughput, quality, energy)
    # the lowest energy, then the baseline; the second round in reverse; the third as the first
    assert targets == [numbers[16], numbers[4], numbers[4], numbers[16], numbers[16], numbers[4]]
    best = client.get("/v1/studies/s/best").json()
    assert best["certified"] is True and best["outcome"] == "certified"
    assert best["chosen_by"] == "energy" and best["trial_number"] == numbers[16]
    ratio = _geomean(energies[numbers[16]]) / _geomean(energies[numbers[4]])
    assert best["energy_ratio"] == pytest.approx(ratio) and best["saves_energy"] is True
    assert best["energy_ratio_ci_low"] < ratio < best["energy_ratio_ci_high"] < 1.0
    pick = next(r for r in best["configs"] if r["trial_number"] == numbers[16])
    assert pick["status"] == "certified" and "energy ratio" in pick["reason"]  # judged on energy, not speed
    assert pick["throughput_samples_per_s"] == pytest.approx(245.0)
    yaml_text = client.get("/v1/studies/s/best", params={"format": "yaml"}).text
    assert f"CERTIFIED, trial {numbers[16]} (the lowest energy per sample among the certified)" in yaml_text
    front = [t["number"] for t in client.get("/v1/studies/s/pareto").json()["data"]]
    assert front == [numbers[16]]  # batch 8: more energy, worse quality
    console = Console(file=StringIO(), width=200)
    console.print(studies_table([StudyInfo.model_validate(client.get("/v1/studies/s").json())]))
    assert f"{ratio:.2f}× energy" in console.file.getvalue()  # type: ignore[attr-defined]


def test_no_config_that_saves_energy_beyond_the_noise_says_so(client: TestClient, make_study: StudyFactory) -> None:
    """[energy, quality] on a noisy baseline: the candidate's energy is not told apart from the
    baseline's within the rounds allowed, so nothing is certified: the baseline's config is kept
    and the candidate named uncertified, its energy ratio within the noise."""
    make_study("s", hardware=GPU, space=KNOB, sampler="grid", n_trials=4, baseline={"batch_size": 4}, seed=0,
               objectives=["energy", "quality"], baseline_seeds=2, remeasure={"top_k": 1, "windows": 5})
    for i, energy in enumerate((1.0, 1.3)):  # a noisy baseline
        _finish(client, _lease(client, f"b{i}"), f"b{i}", 100.0, 0.10, energy)
    numbers = {}
    for _ in range(2):
        got = _lease(client, "w")
        assert got["role"] == "search"
        numbers[got["config"]["batch_size"]] = _finish(client, got, "w", 100.0, 0.10, 1.1)["number"]
    first = min(numbers.values())  # both grid points use as much energy: the first is re-measured
    _remeasure_all(client, {first: (100.0, 0.10, 1.1), 0: (100.0, 0.10, 1.15)}, noisy=True)
    best = client.get("/v1/studies/s/best").json()
    assert best["certified"] is False and best["outcome"] == "undecided" and best["rounds_run"] == 3
    assert best["trial_number"] == 0 and best["config"] == {"batch_size": 4}  # the baseline's own
    assert best["energy_ratio"] is None and best["saves_energy"] is None  # no pick: nothing to compare
    row = best["uncertified"]
    assert row["trial_number"] == first and row["status"] == "undecided"
    assert "energy ratio" in row["reason"] and "not yet beyond the noise" in row["reason"]
    text = client.get("/v1/studies/s/best", params={"format": "yaml"}).text
    assert "KEEP THE BASELINE (undecided)" in text
    console = Console(file=StringIO(), width=200)
    console.print(studies_table([StudyInfo.model_validate(client.get("/v1/studies/s").json())]))
    assert "keep baseline" in console.file.getvalue()  # type: ignore[attr-defined]


def test_a_result_without_energy_fails_a_study_that_minimizes_it(client: TestClient,
                                                                  make_study: StudyFactory) -> None:
    """The worker measured no energy (no NVML reading): the trial fails with the fix, as a
    failure that says nothing about its config (Optuna FAIL: no sampler learns from it)."""
    make_study("s", hardware=GPU, space=KNOB, sampler="grid", n_trials=2, baseline={"batch_size": 4},
               objectives=["throughput", "quality", "energy"])
    base = _lease(client, "b")
    view = _finish(client, base, "b", 100.0, 0.1, None)
    assert view["state"] == "FAIL" and view["failure"]["kind"] == "error"
    assert "measured none on NVIDIA H100" in view["failure"]["message"]
    assert "install nvidia-ml-py" in view["failure"]["message"].lower()
    assert "every baseline run failed" in client.get("/v1/studies/s/best").json()["detail"]


def test_a_study_without_the_energy_objective_keeps_energy_as_a_measurement(client: TestClient,
                                                                           make_study: StudyFactory) -> None:
    make_study("s", hardware=GPU, space=KNOB, sampler="grid", n_trials=2, baseline={"batch_size": 4})
    _finish(client, _lease(client, "b"), "b", 100.0, 0.1, 0.9)
    got = _lease(client, "w")
    view = _finish(client, got, "w", 200.0, 0.1, None)  # a worker without NVML: fine for this study
    assert view["state"] == "COMPLETE" and view["values"] == [200.0, pytest.approx(0.1)]
    best = client.get("/v1/studies/s/best").json()
    assert best["energy_j_per_sample"] is None and best["energy_verdict"] == ""
    assert "energy" not in client.get("/v1/studies/s/best", params={"format": "yaml"}).text.split("\nprecision")[0]


def _report(client: TestClient, got: dict[str, Any], worker: str, step: int, samples: float, throughput: float,
            energy: float) -> dict[str, Any]:
    body = {"worker_id": worker, "step": step, "metrics": {"samples": samples, "loss": 0.5, "throughput": throughput,
                                                         "energy_j_per_sample": energy}}
    r = client.post(f"/v1/trials/{got['trial_id']}/report", json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_pruning_keeps_a_slow_trial_that_uses_less_energy(client: TestClient, make_study: StudyFactory) -> None:
    make_study("s", hardware=GPU, space={"params": {"batch_size": {"choices": [8, 16, 32]}}}, sampler="grid",
               n_trials=4, baseline={"batch_size": 4}, objectives=["throughput", "quality", "energy"],
               probe={"samples": 1000})
    curve = [[100, 0.5], [300, 0.5], [1000, 0.5]]
    for worker, throughput, energy in (("b", 100.0, 1.0), ("w", 1000.0, 0.5)):
        got = _lease(client, worker)
        r = client.post(f"/v1/trials/{got['trial_id']}/complete", json={"worker_id": worker, "result": {
            **_result(got, throughput, 0.1, energy), "loss_curve": curve}})
        assert r.status_code == 200, r.text
    thrifty, wasteful = _lease(client, "w"), _lease(client, "w2")
    for step in (1, 2):  # a tenth of the best's speed and the same loss: dominated unless it saves energy
        assert not _report(client, thrifty, "w", step, 100.0 * step, 100.0, 0.2)["prune"]
    _report(client, wasteful, "w2", 1, 100.0, 100.0, 0.9)
    reply = _report(client, wasteful, "w2", 2, 200.0, 100.0, 0.9)
    assert reply["prune"] and "its energy 0.9 J/sample is no lower than that trial's 0.5" in reply["reason"]


def test_the_report_shows_energy(client: TestClient, make_study: StudyFactory, tmp_path: Path) -> None:
    numbers = _three_objective_study(client, make_study, objectives=["energy", "quality"],
                                     remeasure={"top_k": 1, "windows": 5})
    _remeasure_all(client, {numbers[16]: (245.0, 0.104, 0.31), numbers[4]: (101.0, 0.10, 1.0)})
    study = StudyInfo.model_validate(client.get("/v1/studies/s").json())
    trials = [TrialInfo.model_validate(t) for t in client.get("/v1/studies/s/trials").json()["data"]]
    front = [TrialInfo.model_validate(t) for t in client.get("/v1/studies/s/pareto").json()["data"]]
    rec = Recommendation.model_validate(client.get("/v1/studies/s/best").json())
    files = write_report(study, trials, rec, tmp_path, front)
    assert set(files.figures) == {"pareto", "progress", "energy"}  # too few trials for importances, no failure
    assert set(files.left_out) == {"importances", "failures"}
    assert all(p.stat().st_size > 0 for p in files.figures.values())
    page = files.html.read_text()
    assert "<th>J/sample</th>" in page and "Energy vs quality" in page and 'src="energy.png"' in page
    assert "Picked by the lowest GPU energy per sample" in page
    assert "energy: 0.31 J/sample (nvml_total_energy)" in page and "baseline energy: 1 J/sample" in page


def test_a_larger_batch_that_saves_energy_is_judged_at_the_remeasure_budget(
        client: TestClient, make_study: StudyFactory) -> None:
    """[energy, quality] with remeasure.larger_batch_quality "remeasure": batch 16 uses the least energy
    per sample but trails the baseline's loss at the search's budget (the gate refuses it); it is
    re-measured beside the feasible batch 8, its quality judged at the longer budget, and picked."""
    make_study("s", hardware=GPU, space={**KNOB, "fixed": {"accum_steps": 1}}, sampler="grid", n_trials=4,
               baseline={"batch_size": 4, "accum_steps": 1}, seed=0, objectives=["energy", "quality"], baseline_seeds=2,
               remeasure={"top_k": 1, "windows": 5, "samples_factor": 8, "larger_batch_quality": "remeasure"})
    for i, energy in enumerate((1.0, 1.02)):
        _finish(client, _lease(client, f"b{i}"), f"b{i}", 100.0, 0.10, energy)
    numbers = {}
    for _ in range(2):
        got = _lease(client, "w")
        big = got["config"]["batch_size"] == 16
        numbers[got["config"]["batch_size"]] = _finish(client, got, "w", 100.0, 0.20 if big else 0.10,
                                                       0.6 if big else 0.9)["number"]
    sent = _remeasure_all(client, {numbers[16]: (100.0, 0.10, 0.6), numbers[8]: (100.0, 0.10, 0.9),
                                   0: (100.0, 0.10, 1.0)}, noisy=True)
    assert set(sent) == {0, numbers[8], numbers[16]}  # the refused batch 16 was re-measured too
    best = client.get("/v1/studies/s/best").json()
    assert best["certified"] is True and best["config"] == {"batch_size": 16, "accum_steps": 1}, best["reason"]
    assert best["quality_budget"] == "remeasure" and best["energy_ratio"] == pytest.approx(0.6, rel=0.05)
