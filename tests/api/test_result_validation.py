"""complete validates its result (autotune.contract.results.TrialResult, CompleteRequest): a malformed
result, or one for another config than the leased one, is a 422 naming the field; nothing
changes and the trial stays leased to its worker, whose corrected complete then goes through.
On SQLite and PostgreSQL. What the current worker sends keeps passing (the last tests)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from service_helpers import complete, lease, probe_result

from autotune.api.outcome import config_differences
from autotune.contract.results import CompleteRequest, TrialLease, TrialResult

JSON = {"content-type": "application/json"}

# (what is wrong, the result's changes to a good one, the loc the 422 names)
MALFORMED: list[tuple[str, dict[str, Any], list[Any]]] = [
    ("a word for a throughput", {"throughput_samples_per_s": "fast"}, ["throughput_samples_per_s"]),
    ("a numeric string", {"throughput_samples_per_s": "12.5"}, ["throughput_samples_per_s"]),
    ("a NaN throughput", {"throughput_samples_per_s": float("nan")}, ["throughput_samples_per_s"]),
    ("an infinite throughput", {"throughput_samples_per_s": float("inf")}, ["throughput_samples_per_s"]),
    ("a negative throughput", {"throughput_samples_per_s": -1.0}, ["throughput_samples_per_s"]),
    ("a boolean throughput", {"throughput_samples_per_s": True}, ["throughput_samples_per_s"]),
    ("a NaN NRMSE", {"val_nrmse": float("nan")}, ["val_nrmse"]),
    ("an infinite quality", {"val_nrmse": None, "quality": float("-inf")}, ["quality"]),
    ("a negative count", {"samples_trained": -5}, ["samples_trained"]),
    ("a fractional count", {"steps": 2.5}, ["steps"]),
    ("negative memory", {"peak_mem_reserved_bytes": -1}, ["peak_mem_reserved_bytes"]),
    ("a loss curve of words", {"loss_curve": [[1, "low"]]}, ["loss_curve", 0, 1]),
    ("stopped_early as text", {"stopped_early": "yes"}, ["stopped_early"]),
    ("a failure kind no worker sends", {"failure": {"kind": "boom", "message": "x"}}, ["failure", "kind"]),
    ("the service's own failure kind", {"failure": {"kind": "lost", "message": "x"}}, ["failure", "kind"]),
    ("a failure without a message", {"failure": {"kind": "oom"}}, ["failure", "message"]),
    ("a bare string for a failure", {"failure": "it broke"}, ["failure"]),
    ("no throughput, no failure", {"throughput_samples_per_s": None}, ["throughput_samples_per_s"]),
    ("no quality, no failure", {"val_nrmse": None}, ["quality"]),
    ("a config that is not a mapping", {"config": ["bf16"]}, ["config"]),
]


def _study(client: TestClient, **spec: Any) -> None:
    r = client.post("/v1/studies", json={"name": "s", "baseline_seeds": 1, "remeasure": {"top_k": 0}, **spec})
    assert r.status_code == 201, r.text


def _post_complete(client: TestClient, trial_id: int, result: dict[str, Any], worker_id: str = "w1") -> Any:
    # json.dumps writes NaN and Infinity as JSON tokens, as Python's json (and a careless client) do
    body = json.dumps({"worker_id": worker_id, "result": result})
    return client.post(f"/v1/trials/{trial_id}/complete", content=body, headers=JSON)


def _error_at(response: Any, loc: list[Any]) -> str:
    """The message of the 422 error at `loc` (under body.result); fails naming what was answered."""
    assert response.status_code == 422, f"{response.status_code}: {response.text[:500]}"
    for error in response.json()["detail"]:
        if error["loc"] == ["body", "result", *loc]:
            assert error["msg"], error
            return str(error["msg"])
    raise AssertionError(f"no error at {loc}: {response.json()['detail']}")


def _still_leased(client: TestClient, got: dict[str, Any], worker_id: str = "w1") -> None:
    """The trial is RUNNING, still leased to `worker_id` (its lease comes back), and alive."""
    trials = client.get("/v1/studies/s/trials").json()["data"]
    assert [(t["trial_id"], t["state"]) for t in trials] == [(got["trial_id"], "RUNNING")], trials
    assert lease(client, worker_id) == got
    beat = client.post(f"/v1/trials/{got['trial_id']}/heartbeat", json={"worker_id": worker_id})
    assert beat.status_code == 200 and beat.json()["action"] == "continue", beat.text
    study = client.get("/v1/studies/s").json()
    assert study["counts"] == {"RUNNING": 1} and study["failures"] == {}


def test_a_malformed_result_is_422_naming_the_field_and_changes_nothing(backend_client: TestClient) -> None:
    """The baseline of issue 26: {"throughput_samples_per_s": "fast"} failed the trial (kind
    error) and with it the study's gate. Now each malformed result is refused before anything
    changes, and the worker's corrected result completes the same trial."""
    client = backend_client
    _study(client)
    got = lease(client, "w1")
    assert got is not None and got["role"] == "baseline"
    good = probe_result(got["config"], throughput=120.0, nrmse=0.1)
    for what, change, loc in MALFORMED:
        message = _error_at(_post_complete(client, got["trial_id"], {**good, **change}), loc)
        assert message.startswith(("Input should be", "Field required", f"Value error, result.{loc[-1]}: missing")), \
            (what, message)
    _still_leased(client, got)

    info = complete(client, got, "w1", throughput=120.0, nrmse=0.1)
    assert info["state"] == "COMPLETE" and info["throughput_samples_per_s"] == 120.0 and info["feasible"] is True
    assert client.get("/v1/studies/s").json()["counts"] == {"COMPLETE": 1}


def test_a_422_detail_reads_as_field_and_fix(client: TestClient) -> None:
    """The detail names the field and says what it should be, without echoing the payload."""
    _study(client)
    got = lease(client, "w1")
    assert got is not None
    r = _post_complete(client, got["trial_id"], {**probe_result(got["config"]), "throughput_samples_per_s": "fast"})
    assert r.json()["detail"] == [{"loc": ["body", "result", "throughput_samples_per_s"],
                                   "msg": "Input should be a valid number", "type": "float_type"}]
    r = _post_complete(client, got["trial_id"], {**probe_result(got["config"]), "val_nrmse": None})
    message = _error_at(r, ["quality"])
    assert "must carry its quality metric" in message and "failure: {kind, message}" in message
    failure = {"kind": "x", "message": ""}
    r = _post_complete(client, got["trial_id"], {**probe_result(got["config"]), "failure": failure})
    assert "'oom', 'nan', 'timeout', 'unsupported', 'error', 'refused' or 'interrupted'" in _error_at(
        r, ["failure", "kind"])


def test_a_result_for_another_config_is_422_naming_the_knobs(backend_client: TestClient) -> None:
    """A result whose config is not the leased one (after filling in defaults) would file its
    numbers under a config that was not measured: 422 naming every differing knob, nothing
    changes, and the result of the leased config then completes the trial."""
    client = backend_client
    _study(client, baseline={"batch_size": 8, "accum_steps": 2, "num_workers": 1, "prefetch_factor": 2})
    got = lease(client, "w1")
    assert got is not None
    leased = got["config"]
    wrong = {**leased, "precision": "bf16", "batch_size": 16, "num_workers": 1}
    r = _post_complete(client, got["trial_id"], probe_result(wrong))
    message = _error_at(r, ["config"])
    assert "precision (leased 'fp32', reported 'bf16')" in message and "batch_size (leased 8, reported 16)" in message
    assert "num_workers" not in message and "prefetch_factor" not in message  # the same: not named
    assert "TrialLease.config" in message
    r = _post_complete(client, got["trial_id"], probe_result({"batch_size": 8, "accum_steps": 2}))  # left out
    message = _error_at(r, ["config"])
    assert "num_workers (leased 1, reported 0)" in message and "prefetch_factor (leased 2, reported None)" in message
    _still_leased(client, got)

    # the probe's effective config: every knob, the preset's lr filled in, effective_batch derived
    effective = {"precision": "fp32", "cudnn_benchmark": False, "bucket_cap_mb": 25, "lr": 0.003, **leased}
    r = _post_complete(client, got["trial_id"], probe_result(effective))
    assert r.status_code == 200 and r.json()["state"] == "COMPLETE", r.text
    assert r.json()["config"] == {**effective, "effective_batch": 8}  # what the probe ran is what is kept


@pytest.mark.parametrize("reported", [
    {},  # nothing to compare: the leased config stands
    {"precision": "fp32", "bucket_cap_mb": 25, "effective_batch": 8},  # defaults, an int for a float knob
    {"batch_size": 12, "accum_steps": 4, "lr": 0.001},  # the preset's, filled in by the probe
    {"a_newer_workers_knob": False},  # not a knob of this service: not compared
])
def test_configs_that_are_the_leased_one(reported: dict[str, Any]) -> None:
    assert config_differences({"bucket_cap_mb": 25.0, "num_workers": 0}, reported) == []


def test_config_differences_name_the_knob_and_both_values() -> None:
    assert config_differences({"batch_size": 8}, {"batch_size": 9, "lr": 0.1}) == [
        "batch_size (leased 8, reported 9)"]  # lr: the preset's, any value
    assert config_differences({"lr": 0.1}, {"lr": 0.2}) == ["lr (leased 0.1, reported 0.2)"]
    assert config_differences({}, {"precision": "fp64"}) == [
        "precision (leased 'fp32', reported 'fp64': 'fp64' is not allowed; allowed: fp32 | tf32 | bf16 | fp16 | fp8)"]
    assert config_differences({}, {"compile": "none", "step_graph": True}) == [
        "step_graph (leased False, reported True)"]


def test_unknown_result_keys_are_accepted_and_ignored(client: TestClient) -> None:
    """A newer worker may send fields this service does not know yet: they pass (not stored)."""
    _study(client)
    got = lease(client, "w1")
    assert got is not None
    r = _post_complete(client, got["trial_id"], {**probe_result(got["config"]), "a_newer_field": {"x": [1, 2]}})
    assert r.status_code == 200 and r.json()["state"] == "COMPLETE", r.text


def test_what_the_worker_sends_passes_and_goes_on_the_wire_as_built() -> None:
    """The current worker's results (autotune.worker.results: the probe's, minimal_result's failures,
    partial_result's stopped_early) validate, and the client's dump is the dict it was given:
    no field added, none changed."""
    from autotune.engine.result import ProbeResult
    from autotune.worker.hardware import Hardware
    from autotune.worker.results import TrialRun, minimal_result, partial_result

    lease_ = TrialLease(trial_id=1, study="s", number=0, params={}, config={"batch_size": 8}, workload="ups",
                        preset="tiny", probe={"samples": 80})  # type: ignore[arg-type]
    hardware = Hardware(device="cpu", device_name="cpu (test)", hardware_class="cpu", torch_version="0.0-test",
                        memory_bytes=None, hostname="h", cpu_model="test cpu", cpu_count=2)
    measured = ProbeResult(workload="ups", preset="tiny", config={"batch_size": 8, "effective_batch": 8},
                           device="cpu", torch_version="0.0", throughput_samples_per_s=100.0,
                           throughput_spread=0.1, window_throughputs=[99.0, 101.0], val_nrmse=0.2, quality=0.2,
                           warmup_s=1.0, setup_s=0.5, setup_phases={"model": 0.1}, process_start_s=0.3,
                           train_s=2.0, peak_mem_reserved_bytes=0, data_wait_fraction=0.0,
                           window_data_wait_s=[0.0, 0.0], window_gpu=[{"sm_clock_mhz": None}],
                           window_host=[{"busy_fraction": 0.9, "minor_faults": 3}],
                           epoch_boundaries=[{"micro_batch": 4, "stall_s": 0.1, "gpu_gap_s": None}],
                           compile_workers={"workers": 2, "wait_s": 0.1}, host_cpu="x", loss_curve=[(8, 0.5)],
                           samples_trained=80, steps=10, knobs={"precision": "fp32"}).to_dict()
    run = TrialRun(lease_, reports=[{"step": 3, "metrics": {"samples": 24, "loss": 0.5, "throughput": 90.0}}])
    results = [measured,
               minimal_result(lease_, hardware, {"kind": "timeout", "message": "probe exceeded its hard limit"}),
               minimal_result(lease_, hardware, {"kind": "refused", "message": "not on the allow-list"}),
               minimal_result(lease_, hardware, {"kind": "interrupted", "message": "worker interrupted by SIGTERM"}),
               partial_result(run, hardware)]
    for result in results:
        wire = CompleteRequest(worker_id="w", result=result).model_dump(mode="json")  # autotune/worker/client.py
        assert wire == {"worker_id": "w", "result": json.loads(json.dumps(result))}
        assert TrialResult.model_validate(result).as_dict() == wire["result"]
