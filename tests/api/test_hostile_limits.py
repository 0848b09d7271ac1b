"""Hostile input, issue 35: JSON depth, numbers that are not numbers, numbers beyond physics.

* D1: JSON nested a few hundred levels deep (within the size limit) anywhere in a body is
  answered 422 naming the depth limit, before the app parses it; it was a 500 ("Maximum
  serialization depth exceeded") and a dropped connection on trial complete.
* D5: a boolean or a string is not a number, in a study spec (``"n_trials": true`` was 1,
  ``"gpus_per_trial": "1"`` 1), a lease, a report or a result; an int still is a float
  (``samples_factor: 2`` in a YAML study file).
* D6: a measured throughput lies within [MIN_THROUGHPUT, MAX_THROUGHPUT) samples/s (and an
  energy per sample below its ceiling): outside, 422 naming the bound, and the trial stays
  leased for the corrected result.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import ValidationError
from service_helpers import StudyFactory, lease, probe_result, serve

from autotune.api.limits import MAX_JSON_DEPTH, json_depth
from autotune.contract.protocol import StudySpec
from autotune.contract.results import MAX_THROUGHPUT, MIN_THROUGHPUT

JSON = {"content-type": "application/json"}
DEEP = "@@deep@@"  # where _body puts the nested arrays


def _body(payload: dict[str, Any], depth: int) -> bytes:
    """`payload` as JSON, with arrays nested `depth` deep where it holds DEEP."""
    return json.dumps(payload).replace(json.dumps(DEEP), "[" * depth + "]" * depth).encode()


def _error_at(response: httpx.Response, loc: list[Any]) -> str:
    """The message of the 422 error at `loc`; fails naming what was answered."""
    assert response.status_code == 422, f"{response.status_code}: {response.text[:500]}"
    for error in response.json()["detail"]:
        if error["loc"] == loc:
            return str(error["msg"])
    raise AssertionError(f"no error at {loc}: {response.text[:1000]}")


def _leased(client: TestClient, make_study: StudyFactory) -> dict[str, Any]:
    make_study("s")
    got = lease(client, "w1")
    assert got is not None
    return got


def _complete(client: TestClient, trial_id: int, result: dict[str, Any]) -> httpx.Response:
    # json.dumps, not httpx's encoder: a float like 1.7e308 goes as written
    return client.post(f"/v1/trials/{trial_id}/complete", content=json.dumps({"worker_id": "w1", "result": result}),
                       headers=JSON)


# --- D1: JSON depth -------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["compile_workers", "an_unknown_key", "failure"])
def test_deep_json_in_a_result_is_422_naming_the_limit_and_the_trial_stays_leased(
        client: TestClient, make_study: StudyFactory, where: str) -> None:
    got = _leased(client, make_study)
    result = probe_result(got["config"])
    result[where] = {"x": DEEP} if where == "compile_workers" else DEEP
    for trial_id in (got["trial_id"], 2**31 - 1):  # refused before the trial is looked up
        r = client.post(f"/v1/trials/{trial_id}/complete", headers=JSON,
                        content=_body({"worker_id": "w1", "result": result}, 300))
        assert f"over the limit of {MAX_JSON_DEPTH} levels" in _error_at(r, ["body"])
    r = client.post(f"/v1/trials/{got['trial_id']}/complete", json={"worker_id": "w1",
                                                                     "result": probe_result(got["config"])})
    assert r.status_code == 200 and r.json()["state"] == "COMPLETE", r.text


def test_the_depth_limit_is_exact_and_counts_no_brackets_inside_strings(client: TestClient) -> None:
    # {"name", "baseline": {"x": [[...]]}}: the object, the baseline, then the arrays
    at_limit = _body({"name": "d", "baseline": {"x": DEEP}}, MAX_JSON_DEPTH - 2)
    assert "unknown knob" in _error_at(client.post("/v1/studies", content=at_limit, headers=JSON),
                                       ["body", "baseline", "x"])  # parsed and validated by the app
    over = _body({"name": "d", "baseline": {"x": DEEP}}, MAX_JSON_DEPTH - 1)
    assert f"JSON nested {MAX_JSON_DEPTH + 1} levels deep" in _error_at(
        client.post("/v1/studies", content=over, headers=JSON), ["body"])
    brackets = json.dumps({"worker_id": "[{" * 90 + '\\"]', "hardware": "cpu"})  # text, not structure
    assert client.post("/v1/trials/lease", content=brackets, headers=JSON).status_code == 204


@pytest.mark.parametrize(("body", "depth"), [
    (b"1", 0), (b'"[[["', 0), (b"[[1], {}]", 2), (b'{"a": "x\\"[[", "b": [["]"]]}', 3),
    (b'["\\\\", [1]]', 2), (b'["unterminated [[[[', 1), (b"]]][[", 0),
])
def test_json_depth(body: bytes, depth: int) -> None:
    assert json_depth(body) == depth


def test_json_depth_takes_linear_time_on_hostile_strings() -> None:
    """Quotes and backslashes arranged against a backtracking string pattern: a MiB in well
    under a second (a quadratic scan would take hours)."""
    for body in (b'"' + b'a\\"' * 350_000 + b"\\", b'"\\' * 500_000, b"[" * 2**20):
        start = time.perf_counter()
        json_depth(body)
        assert time.perf_counter() - start < 5.0


def test_a_real_server_answers_deep_json_and_keeps_serving(app: FastAPI) -> None:
    body = _body({"worker_id": "w", "result": {"compile_workers": {"x": DEEP}}}, 1000)
    with serve(app) as url:
        r = httpx.post(f"{url}/v1/trials/1/complete", content=body, headers=JSON, timeout=30)
        assert r.status_code == 422 and "over the limit" in r.json()["detail"][0]["msg"]
        assert httpx.get(f"{url}/v1/health", timeout=10).status_code == 200


# --- D5: no boolean or string taken for a number --------------------------------------------------


@pytest.mark.parametrize(("spec", "loc"), [
    ({"n_trials": True}, ["n_trials"]),
    ({"gpus_per_trial": "1"}, ["gpus_per_trial"]),
    ({"baseline_seeds": False}, ["baseline_seeds"]),
    ({"seed": "7"}, ["seed"]),
    ({"max_retries": True}, ["max_retries"]),
    ({"max_memory_gb": True}, ["max_memory_gb"]),
    ({"max_memory_gb": "40"}, ["max_memory_gb"]),
    ({"probe": {"windows": True}}, ["probe", "windows"]),
    ({"probe": {"samples": "100"}}, ["probe", "samples"]),
    ({"probe": {"timeout_s": "60"}}, ["probe", "timeout_s"]),
    ({"gate": {"k": True}}, ["gate", "k"]),
    ({"gate": {"abs_tol": "0.01"}}, ["gate", "abs_tol"]),
    ({"pruning": {"rho": "0.5"}}, ["pruning", "rho"]),
    ({"pruning": {"min_fraction": True}}, ["pruning", "min_fraction"]),
    ({"remeasure": {"top_k": True}}, ["remeasure", "top_k"]),
    ({"remeasure": {"samples_factor": "2"}}, ["remeasure", "samples_factor"]),
    ({"remeasure": {"max_rounds": True}}, ["remeasure", "max_rounds"]),
    ({"remeasure": {"confidence": "0.9"}}, ["remeasure", "confidence"]),
])
def test_a_boolean_or_string_for_a_number_in_a_spec_is_422(client: TestClient, spec: dict[str, Any],
                                                           loc: list[str]) -> None:
    msg = _error_at(client.post("/v1/studies", json={"name": "t", **spec}), ["body", *loc])
    assert "expected a number" in msg
    assert client.get("/v1/studies").json()["count"] == 0


def test_a_string_for_a_switch_is_422(client: TestClient) -> None:
    assert _error_at(client.post("/v1/studies", json={"name": "t", "pruning": {"enabled": "false"}}),
                     ["body", "pruning", "enabled"])


def test_ints_for_floats_and_whole_floats_for_ints_still_validate(client: TestClient) -> None:
    r = client.post("/v1/studies", json={"name": "n", "n_trials": 20.0, "max_memory_gb": 40, "gate": {"abs_tol": 0},
                                         "probe": {"timeout_s": 60}, "remeasure": {"samples_factor": 2}})
    assert r.status_code == 201, r.text
    spec = client.get("/v1/studies/n").json()["spec"]
    assert spec["n_trials"] == 20 and spec["remeasure"]["samples_factor"] == 2.0 and spec["max_memory_gb"] == 40.0


YAML_STUDY = """
name: from-yaml
workload: ups
preset: tiny
space: cpu
n_trials: 12
probe: {samples: 256, timeout_s: 600}
gate: {abs_tol: 0, k: 2}
max_memory_gb: 8
pruning: {enabled: true, rho: 1, loss_margin: 1}
remeasure: {top_k: 1, samples_factor: 2, rounds: 3}
"""


def test_a_yaml_study_file_with_ints_for_floats_validates() -> None:
    data = yaml.safe_load(YAML_STUDY)
    spec = StudySpec.model_validate(data)
    assert spec.remeasure.samples_factor == 2.0 and spec.gate.abs_tol == 0.0 and spec.pruning.rho == 1.0
    with pytest.raises(ValidationError, match="expected a number, got the boolean true"):
        StudySpec.model_validate({**data, "n_trials": yaml.safe_load("yes")})  # YAML 1.1: a boolean


@pytest.mark.parametrize("path", sorted(Path(__file__).parents[2].glob("examples/*/study.yaml")))
def test_the_example_study_files_validate(path: Path) -> None:
    StudySpec.model_validate(yaml.safe_load(path.read_text()), context={"stored": True})  # their plugins aside


@pytest.mark.parametrize(("path", "body", "loc"), [
    ("/v1/trials/lease", {"worker_id": "w", "hardware": "cpu", "gpus_per_trial": True}, ["body", "gpus_per_trial"]),
    ("/v1/trials/lease", {"worker_id": "w", "hardware": "cpu", "gpus_per_trial": "2"}, ["body", "gpus_per_trial"]),
    ("/v1/trials/1/report", {"worker_id": "w", "step": True, "metrics": {}}, ["body", "step"]),
    ("/v1/trials/1/report", {"worker_id": "w", "step": "3", "metrics": {}}, ["body", "step"]),
])
def test_a_boolean_or_string_for_a_number_from_a_worker_is_422(client: TestClient, path: str, body: dict[str, Any],
                                                               loc: list[str]) -> None:
    assert "expected a number" in _error_at(client.post(path, json=body), loc)


@pytest.mark.parametrize(("field", "value"), [
    ("throughput_samples_per_s", True), ("throughput_samples_per_s", "12.5"), ("val_nrmse", "0.1"),
    ("peak_mem_reserved_bytes", True), ("world_size", "1"), ("stopped_early", "false"),
])
def test_a_boolean_or_string_for_a_number_or_switch_in_a_result_is_422(client: TestClient, make_study: StudyFactory,
                                                             field: str, value: Any) -> None:
    got = _leased(client, make_study)
    assert _error_at(_complete(client, got["trial_id"], {**probe_result(got["config"]), field: value}),
                     ["body", "result", field])


# --- D6: measured numbers within physical bounds --------------------------------------------------


@pytest.mark.parametrize(("field", "value", "words"), [
    ("throughput_samples_per_s", 1.7e308, "less than 1000000000"),
    ("throughput_samples_per_s", MAX_THROUGHPUT, "less than 1000000000"),
    ("throughput_samples_per_s", 1e-300, f"below the physical bound of {MIN_THROUGHPUT:g}"),
    ("throughput_samples_per_s", 0.0, f"below the physical bound of {MIN_THROUGHPUT:g}"),
    ("window_throughputs", [100.0, 1e12], "less than 1000000000"),
    ("energy_j_per_sample", 1e300, "less than 1000000000"),
])
def test_a_throughput_beyond_physics_is_422_naming_the_bound(client: TestClient, make_study: StudyFactory,
                                                             field: str, value: Any, words: str) -> None:
    got = _leased(client, make_study)
    r = _complete(client, got["trial_id"], {**probe_result(got["config"]), field: value})
    assert r.status_code == 422, r.text
    assert any(words in error["msg"] and error["loc"][:3] == ["body", "result", field]
               for error in r.json()["detail"]), r.text
    # nothing changed: the trial is still the worker's, and a measurement within the bounds completes it
    r = _complete(client, got["trial_id"], probe_result(got["config"], throughput=MIN_THROUGHPUT))
    assert r.status_code == 200 and r.json()["throughput_samples_per_s"] == MIN_THROUGHPUT, r.text


def test_a_failed_or_stopped_result_needs_no_throughput(client: TestClient, make_study: StudyFactory) -> None:
    got = _leased(client, make_study)
    r = _complete(client, got["trial_id"], probe_result(got["config"], throughput=0.0, nrmse=None,
                                                        failure={"kind": "oom", "message": "CUDA out of memory"}))
    assert r.status_code == 200 and r.json()["failure"]["kind"] == "oom", r.text
