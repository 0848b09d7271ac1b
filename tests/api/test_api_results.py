"""Trials list, Pareto front and the recommendation (JSON and YAML) with the quality gate.

The `study` fixture runs without re-measurement (make_study's remeasure.top_k 0): nothing is
judged, so /best keeps the baseline's config (outcome "not_judged") and names the search's
fastest candidate as the uncertified one. tests/api/test_verdict.py covers certified picks."""

from __future__ import annotations

import io
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient
from rich.console import Console
from service_helpers import StudyFactory, complete, lease

from autotune.cli.tables import recommendation_table
from autotune.contract.config import KNOBS, normalised, parse_config
from autotune.contract.views import Recommendation

# (throughput, val_nrmse) for the baseline and three trials; gate abs_tol 0.01 → nrmse <= 0.11
BASELINE = (100.0, 0.10)
FAST_OK = (200.0, 0.105)  # feasible, on the front
FASTEST_BAD = (300.0, 0.20)  # on the front (fastest), but fails the gate
DOMINATED = (150.0, 0.12)  # dominated by FAST_OK


def _run(client: TestClient, worker: str, measured: tuple[float, float]) -> dict[str, Any]:
    got = lease(client, worker)
    assert got is not None
    return complete(client, got, worker, throughput=measured[0], nrmse=measured[1])


@pytest.fixture
def study(client: TestClient, make_study: StudyFactory) -> dict[str, dict[str, Any]]:
    make_study("s", n_trials=10, seed=0, baseline={"batch_size": 4})
    return {"baseline": _run(client, "w0", BASELINE), "fast_ok": _run(client, "w1", FAST_OK),
            "fastest_bad": _run(client, "w2", FASTEST_BAD), "dominated": _run(client, "w3", DOMINATED)}


def test_no_recommendation_before_the_baseline(client: TestClient, make_study: StudyFactory) -> None:
    make_study("s", baseline_seeds=2)
    r = client.get("/v1/studies/s/best")
    assert r.status_code == 404 and "baseline" in r.json()["detail"]
    base = lease(client, "w0")
    other = lease(client, "w1")  # the second baseline seed
    assert base is not None and other is not None and other["role"] == "baseline"
    assert lease(client, "w2") is None  # no search trial before the gate exists
    complete(client, other, "w1", throughput=500.0)
    r = client.get("/v1/studies/s/best")
    assert r.status_code == 404 and "have not all finished" in r.json()["detail"]
    trials = client.get("/v1/studies/s/trials").json()["data"]
    assert [t["feasible"] for t in trials] == [None, None]  # no gate before every baseline seed is done
    complete(client, base, "w0", failure={"kind": "oom", "message": "boom"})
    r = client.get("/v1/studies/s/best")  # one seed is enough for a gate, but the baseline is not a candidate
    assert r.status_code == 404 and "never a recommendation" in r.json()["detail"]
    _run(client, "w2", FAST_OK)
    r = client.get("/v1/studies/s/best")  # a feasible candidate: not judged (top_k 0), the baseline is kept
    best = r.json()
    assert r.status_code == 200 and best["baseline_seeds"] == 1 and best["outcome"] == "not_judged"
    assert best["certified"] is False and best["trial_number"] == 1  # the first baseline seed that completed
    assert best["uncertified"]["trial_number"] == 2


def test_every_baseline_failing_is_said_clearly(client: TestClient, make_study: StudyFactory) -> None:
    make_study("s", baseline_seeds=2)
    for w in ("w0", "w1"):
        got = lease(client, w)
        assert got is not None
        complete(client, got, w, failure={"kind": "oom", "message": "boom"})
    assert lease(client, "w2") is None  # nothing can be judged without a gate
    r = client.get("/v1/studies/s/best")
    assert r.status_code == 404 and "every baseline run failed" in r.json()["detail"] and "oom" in r.json()["detail"]
    study = client.get("/v1/studies/s").json()
    assert study["state"] == "finished" and study["best"] is None
    assert "every baseline run failed" in study["message"]
    assert study["counts"] == {"FAIL": 2} and study["failures"] == {"oom": 2}


def test_trials_carry_the_gate(client: TestClient, study: dict[str, dict[str, Any]]) -> None:
    trials = client.get("/v1/studies/s/trials").json()
    assert trials["count"] == 4
    by_number = {t["number"]: t for t in trials["data"]}
    assert by_number[0]["is_baseline"] and by_number[0]["feasible"] is True
    assert by_number[1]["feasible"] is True
    assert by_number[2]["feasible"] is False
    assert by_number[3]["feasible"] is False
    assert all(t["worker_id"] == f"w{t['number']}" for t in trials["data"])


def test_pareto(client: TestClient, study: dict[str, dict[str, Any]]) -> None:
    """The front holds candidates only: not the baseline (the reference) nor the faster
    trial that fails the gate."""
    front = client.get("/v1/studies/s/pareto").json()
    assert front["count"] == 1
    assert [(t["number"], t["feasible"]) for t in front["data"]] == [(1, True)]


def test_best_json(client: TestClient, study: dict[str, dict[str, Any]]) -> None:
    """Not re-measured, so not judged: the baseline's own config, and the fastest candidate
    beside it with its search measurement (flattered by the winner's curse, the caveat says)."""
    best = client.get("/v1/studies/s/best").json()
    assert best["study"] == "s" and best["certified"] is False and best["outcome"] == "not_judged"
    assert "remeasure.top_k 0" in best["reason"] and best["verdict"] == best["reason"]
    assert best["trial_number"] == study["baseline"]["number"] == 0
    assert best["throughput_samples_per_s"] == pytest.approx(BASELINE[0]) and best["val_nrmse"] == BASELINE[1]
    assert best["baseline_throughput_samples_per_s"] == pytest.approx(BASELINE[0])  # a geometric mean of one run
    assert best["baseline_val_nrmse"] == BASELINE[1]
    assert best["speedup"] == 1.0 and best["remeasured"] is False and best["beats_baseline"] is False
    assert best["gate_nrmse"] == pytest.approx(0.11)
    assert best["peak_mem_reserved_bytes"] == 2**30
    assert set(best["config"]) <= set(KNOBS)  # effective_batch is not a knob: left out
    assert best["config"] == {k: v for k, v in study["baseline"]["config"].items() if k in KNOBS}
    assert best["config"]["batch_size"] == 4
    assert best["rounds_run"] == 0 and best["remeasure_probes"] == 0
    assert any("winner's curse" in c for c in best["caveats"])
    # the fastest feasible candidate (not the faster FASTEST_BAD, which fails the gate)
    fastest = best["uncertified"]
    assert fastest["trial_number"] == study["fast_ok"]["number"] and fastest["status"] == "undecided"
    assert fastest["throughput_samples_per_s"] == pytest.approx(FAST_OK[0]) and fastest["n"] == 1
    assert fastest["config"] == normalised(study["fast_ok"]["config"])  # every knob, defaults filled in
    assert "not re-measured" in fastest["reason"]
    assert client.get("/v1/studies/s").json()["best"] == best


def test_best_yaml_is_a_config_file(client: TestClient, study: dict[str, dict[str, Any]]) -> None:
    r = client.get("/v1/studies/s/best", params={"format": "yaml"})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/yaml")
    assert r.text.startswith("# autotune verdict for study s: KEEP THE BASELINE (not_judged)")
    assert "# throughput: 100.0 samples/s; baseline 100.0 samples/s" in r.text
    config = yaml.safe_load(r.text)
    assert config == client.get("/v1/studies/s/best").json()["config"] == {"batch_size": 4}  # the baseline's
    parse_config(config)  # `autotune probe --config best.yaml` accepts it
    assert client.get("/v1/studies/s/best", params={"format": "xml"}).status_code == 422


def test_the_recommendation_carries_the_notes_on_its_measurement(client: TestClient,
                                                                  make_study: StudyFactory) -> None:
    """A certified pick whose last re-measurement ran on a throttled GPU says so, in JSON, in the
    YAML header and in `autotune best`."""
    make_study("s", n_trials=2, seed=0, baseline={"batch_size": 4}, remeasure={"top_k": 1, "rounds": 2})
    _run(client, "w0", BASELINE)
    pick = _run(client, "w1", FAST_OK)["number"]
    note = "the driver held the GPU's clocks down (power or heat) during the timed windows: window 3 30%"
    noise = iter([1.0, 0.99, 1.01, 1.005])  # distinct runs: each config has a spread
    while (got := lease(client, "r")) is not None:
        assert got["role"] == "remeasure"
        trials = client.get("/v1/studies/s/trials").json()["data"]
        is_pick = next(t for t in trials if t["trial_id"] == got["trial_id"])["remeasure_of"] == pick
        late = is_pick and any(t["role"] == "remeasure" and t["remeasure_of"] == pick and t["state"] == "COMPLETE"
                               for t in trials)
        complete(client, got, "r", throughput=(FAST_OK[0] if is_pick else BASELINE[0]) * next(noise),
                 nrmse=BASELINE[1], notes=[note] if late else [])  # the pick's second round was throttled
    best = client.get("/v1/studies/s/best").json()
    assert best["certified"] is True and best["trial_number"] == pick and best["measurement_notes"] == [note]
    assert f"# note: {note}" in client.get("/v1/studies/s/best", params={"format": "yaml"}).text
    console = Console(width=300, record=True, file=io.StringIO())
    console.print(recommendation_table(Recommendation.model_validate(best)))
    assert "window 3 30%" in console.export_text()


def test_the_baseline_is_never_recommended_even_when_it_measures_fastest(client: TestClient,
                                                                         make_study: StudyFactory) -> None:
    """A baseline seed that happens to be fastest is the reference, not a finding: the only
    candidate judged is the search config, and as it did not beat the baseline the verdict keeps
    the baseline's config (its first seed stands for it) and names that candidate uncertified."""
    make_study("s", baseline_seeds=2, n_trials=3, remeasure={"top_k": 1, "rounds": 2, "max_rounds": 2})
    for worker in ("w0", "w1"):
        got = lease(client, worker)
        assert got is not None and got["role"] == "baseline"
        complete(client, got, worker, throughput=100.0 if worker == "w0" else 104.0, nrmse=0.1)
    _run(client, "w2", (98.0, 0.1))
    noise = iter([1.0, 1.02, 0.99, 1.01])
    while (got := lease(client, "r")) is not None:
        assert got["role"] == "remeasure"
        target = next(t for t in client.get("/v1/studies/s/trials").json()["data"]
                      if t["trial_id"] == got["trial_id"])["remeasure_of"]
        complete(client, got, "r", throughput=(102.0 if target == 0 else 98.0) * next(noise), nrmse=0.1)
    assert client.get("/v1/studies/s").json()["state"] == "finished"
    best = client.get("/v1/studies/s/best").json()
    assert best["certified"] is False and best["outcome"] == "no_win"
    assert best["reason"].startswith("no config beat the baseline: trial 2: not faster")
    assert best["trial_number"] == 0 and best["speedup"] == 1.0 and best["beats_baseline"] is False
    assert [r["trial_number"] for r in best["configs"]] == [0, 2]  # the baseline's row, then the one candidate
    assert best["configs"][0]["n"] == 4  # both seeds and both re-measurements: the same budget
    fastest = best["uncertified"]
    assert fastest["trial_number"] == 2 and fastest["n"] == 2 and fastest["status"] == "rejected"
    assert fastest["speedup_ci_high"] < 1.0  # shown slower than the baseline's runs (the fastest seed among them)
    text = client.get("/v1/studies/s/best", params={"format": "yaml"}).text
    assert f"KEEP THE BASELINE ({best['outcome']})" in text and "trial 0" in text


def test_single_objective_study(client: TestClient, make_study: StudyFactory) -> None:
    make_study("s", objectives=["throughput"])
    base = _run(client, "w0", BASELINE)
    assert base["values"] == [BASELINE[0]] and base["val_nrmse"] == BASELINE[1]
    _run(client, "w1", FASTEST_BAD)
    ok = _run(client, "w2", FAST_OK)["number"]
    front = client.get("/v1/studies/s/pareto").json()["data"]
    assert [t["number"] for t in front] == [ok]  # the fastest candidate: the faster trial 1 fails the gate
    best = client.get("/v1/studies/s/best").json()  # not re-measured: the baseline is kept, ok beside it
    assert best["trial_number"] == base["number"] and best["uncertified"]["trial_number"] == ok
