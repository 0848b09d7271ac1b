"""Hostile input, issue 35: a reported config, and the verdict's numbers.

* D3: a trial's stored config feeds later leases (the baseline's re-measurement, the starting
  points) and best.yaml, so a result cannot put anything into it that was not leased: keys
  that are not knobs are refused, and so is a knob the lease left to the preset at another
  value than the preset's (a lease of ``{accum_steps: 1}`` completed with ``lr: 5.0``). A
  plugin workload's preset values are what its study's first completed baseline ran; until
  that one is in, such knobs are not kept.
* D6: no speedup in the verdict is infinite or NaN: extreme throughputs within the bounds,
  runs spread too widely for a finite interval, and out-of-bound numbers stored before the
  service refused them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import yaml
from fastapi import FastAPI
from fastapi.testclient import TestClient
from service_helpers import StudyFactory, lease, probe_result

from autotune.api.outcome import PRESET_VALUES, config_differences, config_key_problems, preset_values
from autotune.contract.registry import BUILTIN, registered_workloads
from autotune.contract.results import MAX_THROUGHPUT, MIN_THROUGHPUT, CompleteRequest, TrialResult

JSON = {"content-type": "application/json"}
UPS_TINY = {"batch_size": 4, "accum_steps": 2, "lr": 3e-3}
SPACE = {"params": {"fused_optimizer": {"choices": [False, True]}}}


def _complete(client: TestClient, got: dict[str, Any], config: dict[str, Any], worker_id: str = "w1",
              **result: Any) -> httpx.Response:
    return client.post(f"/v1/trials/{got['trial_id']}/complete", headers=JSON,
                       content=json.dumps({"worker_id": worker_id, "result": probe_result(config, **result)}))


def _config_error(response: httpx.Response) -> str:
    assert response.status_code == 422, f"{response.status_code}: {response.text[:500]}"
    (error,) = response.json()["detail"]
    assert error["loc"] == ["body", "result", "config"], error
    return str(error["msg"])


# --- D3: the reported config ------------------------------------------------------------------------


def test_a_config_with_foreign_keys_or_other_preset_values_is_refused_and_never_reaches_a_lease(
        client: TestClient, make_study: StudyFactory) -> None:
    """Issue 35's case: the lease {accum_steps: 1} completed with batch_size 64, lr 5.0 and rm_rf.
    Refused (the trial stays leased); the honest result, the preset's values filled in, is
    kept, and the baseline's re-measurements and best.yaml carry the preset's lr, never 5.0."""
    make_study("s", baseline={"accum_steps": 1}, space=SPACE, n_trials=2, seed=0,
               starting_points=[{"fused_optimizer": True}],
               remeasure={"top_k": 1, "rounds": 2, "max_rounds": 2})
    base = lease(client, "w1")
    assert base is not None and base["role"] == "baseline" and base["config"] == {"accum_steps": 1}
    msg = _config_error(_complete(client, base, {"accum_steps": 1, "batch_size": 64, "lr": 5.0, "rm_rf": "/"}))
    assert "unknown keys 'rm_rf'" in msg and "leave config out" in msg
    msg = _config_error(_complete(client, base, {"accum_steps": 1, "batch_size": 64, "lr": 5.0}))
    assert "batch_size (leased null: the preset's 4, reported 64)" in msg
    assert "lr (leased null: the preset's 0.003, reported 5.0)" in msg and "ups/tiny" in msg
    assert "accum_steps (" not in msg  # leased 1, reported 1: not named
    assert _config_error(_complete(client, base, {"accum_steps": 2, "batch_size": 4, "lr": 3e-3})).startswith(
        "result.config: not the config trial")  # a leased knob: the lease's value, not the preset's
    honest = {"accum_steps": 1, "batch_size": 4, "lr": 0.003}  # what a probe of ups/tiny reports
    r = _complete(client, base, honest)
    assert r.status_code == 200 and r.json()["config"] == {**honest, "effective_batch": 8}, r.text

    leases = []
    while (got := lease(client, "w2")) is not None:
        leases.append(got)
        if got["role"] == "search" and got["config"].get("lr") is None:
            msg = _config_error(_complete(client, got, {**got["config"], "lr": 5.0}, worker_id="w2"))
            assert "lr (leased null: the preset's 0.003, reported 5.0)" in msg
        fast = got["config"].get("fused_optimizer") is True
        r = _complete(client, got, got["config"], worker_id="w2", throughput=200.0 if fast else 100.0)
        assert r.status_code == 200, r.text
    assert client.get("/v1/studies/s").json()["state"] == "finished"
    again = [got["config"] for got in leases if got["role"] == "remeasure" and not got["config"].get("fused_optimizer")]
    assert again and all(config == honest for config in again)  # the baseline re-measured as it ran
    assert all(got["config"].get("lr") in (None, 0.003) and got["config"].get("batch_size") in (None, 4)
               for got in leases)
    text = client.get("/v1/studies/s/best", params={"format": "yaml"}).text
    best = yaml.safe_load(text)
    assert best.get("lr") in (None, 0.003) and best.get("batch_size") in (None, 4) and "rm_rf" not in text


def test_a_config_of_the_preset_itself_and_nulls_are_accepted(client: TestClient, make_study: StudyFactory) -> None:
    make_study("s")
    base = lease(client, "w1")
    assert base is not None and base["config"] == {}
    r = _complete(client, base, {"batch_size": None, "lr": None})  # a failure's config: the leased one, nulls kept
    assert r.status_code == 200, r.text
    make_study("t")
    got = lease(client, "w1", study="t")
    assert got is not None
    r = _complete(client, got, {**UPS_TINY, "lr": 3e-3 * (1 + 1e-12), "bucket_cap_mb": 25})
    assert r.status_code == 200 and r.json()["config"]["batch_size"] == 4, r.text


@pytest.fixture
def plugin_known(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The service knows a plugin workload by name only (its presets' values are in its module)."""
    monkeypatch.setenv("AUTOTUNE_WORKLOADS", "toyplug")
    registered_workloads.cache_clear()
    yield
    monkeypatch.undo()
    registered_workloads.cache_clear()


def test_a_plugins_preset_knobs_are_not_kept_from_a_report(client: TestClient, make_study: StudyFactory,
                                                           plugin_known: None) -> None:
    """The service cannot check a plugin preset's batch size or lr: the result completes, but
    the trial keeps what was leased (the preset's, filled in again by every later probe)."""
    make_study("p", workload="toyplug", preset="x", quality={"metric": "val_nrmse"})
    got = client.post("/v1/trials/lease", json={"worker_id": "w", "hardware": "cpu", "workloads": ["toyplug"]}).json()
    assert got["config"] == {}
    r = _complete(client, got, {"batch_size": 64, "lr": 5.0, "precision": "fp32"}, worker_id="w")
    assert r.status_code == 200 and r.json()["config"] == {"precision": "fp32", "effective_batch": 8}, r.text


@pytest.mark.parametrize(("reported", "problem"), [
    ({"rm_rf": "/"}, "unknown keys 'rm_rf'"),
    ({f"k{i:02d}": 0 for i in range(12)}, "'k09' and 2 more"),
    ({"effective_batch": True}, "effective_batch True is not a positive integer"),
    ({"effective_batch": "8"}, "effective_batch '8' is not a positive integer"),
    ({"effective_batch": 0}, "effective_batch 0 is not a positive integer"),
])
def test_config_key_problems(reported: dict[str, Any], problem: str) -> None:
    assert problem in "; ".join(config_key_problems(reported))


def test_knobs_and_effective_batch_are_no_problem() -> None:
    assert config_key_problems({**UPS_TINY, "precision": "bf16", "effective_batch": 8}) == []


def test_preset_knobs_are_compared_with_the_presets_values() -> None:
    preset = preset_values("ups", "tiny")
    assert preset == UPS_TINY
    assert config_differences({}, {**UPS_TINY, "lr": 3e-3 * (1 + 1e-12)}, preset) == []
    assert config_differences({}, {"lr": 0.01}, preset) == ["lr (leased null: the preset's 0.003, reported 0.01)"]
    assert config_differences({"lr": 0.01}, {"lr": 0.01}, preset) == []  # leased: the lease's value
    assert config_differences({}, {"lr": 0.01}, None) == []  # unknown preset: not compared (and not kept)
    assert preset_values("toyplug", "x") is None


@pytest.mark.parametrize(("workload", "preset"), sorted(PRESET_VALUES))
def test_the_services_preset_values_are_the_workloads(workload: str, preset: str) -> None:
    from autotune.contract.registry import get_workload  # imports torch and the workload's module

    d = get_workload(workload, preset).defaults
    assert PRESET_VALUES[(workload, preset)] == {"batch_size": d.batch_size, "accum_steps": d.accum_steps, "lr": d.lr}


def test_every_builtin_preset_has_its_values() -> None:
    assert set(PRESET_VALUES) == {(name, p) for name, entry in BUILTIN.items() for p in entry.presets or ()}


# --- D6: a finite verdict -----------------------------------------------------------------------------

Truth = Callable[[dict[str, Any]], float]  # lease -> throughput


def _numbers(value: Any) -> Iterator[float]:
    if isinstance(value, float):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _numbers(v)
    elif isinstance(value, list):
        for v in value:
            yield from _numbers(v)


def _verdict_study(make_study: StudyFactory, **remeasure: Any) -> None:
    make_study("s", space=SPACE, baseline={"fused_optimizer": False}, baseline_seeds=2, n_trials=3, seed=0,
               starting_points=[{"fused_optimizer": True}],
               remeasure={"top_k": 1, "rounds": 2, "max_rounds": 2, **remeasure})


def _drive(client: TestClient, truth: Truth, send: Callable[[dict[str, Any], float], None]) -> None:
    for _ in range(40):
        got = lease(client, "w1")
        if got is None:
            assert client.get("/v1/studies/s").json()["state"] == "finished"
            return
        send(got, truth(got))
    raise AssertionError("the study did not finish")


def _finite_verdict(client: TestClient) -> dict[str, Any]:
    """/best answers (200, or 404 with a reason), every number in it finite, no inf in its words."""
    r = client.get("/v1/studies/s/best")
    assert r.status_code in (200, 404), r.text
    best: dict[str, Any] = r.json()
    assert all(math.isfinite(v) for v in _numbers(best)), best
    words = json.dumps(best, ensure_ascii=False).lower()
    assert "inf×" not in words and "nan×" not in words and "inf–" not in words
    assert client.get("/v1/studies/s/best", params={"format": "yaml"}).status_code == r.status_code
    return best


def _by_http(client: TestClient) -> Callable[[dict[str, Any], float], None]:
    def send(got: dict[str, Any], throughput: float) -> None:
        r = _complete(client, got, got["config"], throughput=throughput)
        assert r.status_code == 200, r.text
    return send


def test_extreme_throughputs_within_the_bounds_give_a_finite_speedup(client: TestClient,
                                                                     make_study: StudyFactory) -> None:
    _verdict_study(make_study)
    fast = MAX_THROUGHPUT * 0.999
    _drive(client, lambda got: fast if got["config"].get("fused_optimizer") else MIN_THROUGHPUT, _by_http(client))
    best = _finite_verdict(client)
    assert best["certified"] is True and best["speedup"] == pytest.approx(fast / MIN_THROUGHPUT, rel=1e-6)
    assert "beyond the noise" in best["verdict"]


def test_runs_too_spread_for_a_finite_interval_leave_the_candidate_undecided(client: TestClient,
                                                                             make_study: StudyFactory) -> None:
    """Two runs a billion-fold apart at confidence 0.999: the interval's bound overflows a float
    (an OverflowError in the verdict, a 500, before the guard)."""
    _verdict_study(make_study, confidence=0.999)

    def truth(got: dict[str, Any]) -> float:
        if not got["config"].get("fused_optimizer"):
            return 100.0
        return MIN_THROUGHPUT if got["role"] == "remeasure" and got["probe"]["seed"] % 2 == 0 else 9e8
    _drive(client, truth, _by_http(client))
    best = _finite_verdict(client)
    row = next(c for c in best["configs"] if c["role"] == "candidate")
    assert row["status"] == "undecided" and row["speedup"] is None and "spread too widely" in row["reason"]


def test_out_of_bound_throughputs_stored_before_give_no_infinite_speedup(app: FastAPI, client: TestClient,
                                                                         make_study: StudyFactory) -> None:
    """Trials stored before the bounds (issue 35: 1e-300 against 1.7e308 read "inf×") are left
    out of the verdict's ratios. The results go in behind the route's validation."""
    _verdict_study(make_study)
    service = app.state.service

    def send(got: dict[str, Any], throughput: float) -> None:
        fields = {"config": got["config"], "throughput_samples_per_s": throughput, "val_nrmse": 0.1,
                  "quality_metric": "val_nrmse"}
        service.complete(got["trial_id"], CompleteRequest.model_construct(
            worker_id="w1", result=TrialResult.model_construct(**fields)))
    _drive(client, lambda got: 1.7e308 if got["config"].get("fused_optimizer") else 1e-300, send)
    best = _finite_verdict(client)
    assert best.get("certified") is not True


def test_a_plugins_preset_knobs_are_held_to_what_its_first_baseline_ran(client: TestClient,
                                                                        make_study: StudyFactory,
                                                                        plugin_known: None) -> None:
    """The service never imports a plugin, so its first completed baseline says what the preset's
    batch size, accumulation and lr are; every later result of the study is held to them."""
    make_study("p", workload="toyplug", preset="x", quality={"metric": "val_nrmse"}, baseline_seeds=2)
    body = {"worker_id": "w", "hardware": "cpu", "workloads": ["toyplug"]}
    first = client.post("/v1/trials/lease", json=body).json()
    second = client.post("/v1/trials/lease", json={**body, "worker_id": "w2"}).json()
    ran = {"batch_size": 16, "accum_steps": 2, "lr": 1e-3}
    assert _complete(client, first, {**ran, "precision": "fp32"}, worker_id="w").status_code == 200
    r = _complete(client, second, {**ran, "lr": 5.0, "precision": "fp32"}, worker_id="w2")
    assert r.status_code == 422 and "lr (leased null: the preset's 0.001, reported 5.0)" in r.text, r.text
    r = _complete(client, second, {**ran, "precision": "fp32"}, worker_id="w2")
    assert r.status_code == 200 and r.json()["config"]["lr"] == 1e-3, r.text  # checked, so kept
