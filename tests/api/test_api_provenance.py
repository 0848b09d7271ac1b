"""Provenance through the service: results carrying the probe's environment (torch, CUDA and
driver versions, the GPU and its count, the model fingerprint) reach /best's JSON and YAML
with the study's workload, preset and search-space fingerprint; the pick's and the
baseline's runs disagreeing make a mixed study; results of older workers still complete."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import yaml
from fastapi.testclient import TestClient
from service_helpers import StudyFactory, lease, probe_result

from autotune.contract.provenance import space_fingerprint
from autotune.contract.space import parse_space

SPACE = {"params": {"fused_optimizer": {"choices": [False, True]}, "batch_size": {"choices": [8]}}}
COMMON: dict[str, Any] = {"space": SPACE, "baseline": {"fused_optimizer": False, "batch_size": 8},
                          "starting_points": "none", "sampler": "random", "n_trials": 4, "baseline_seeds": 3,
                          "seed": 0, "remeasure": {"top_k": 1, "max_rounds": 6}}
H100 = {"torch_version": "2.5.1+cu124", "cuda_version": "12.4", "driver_version": "550.54.15",
        "device": "NVIDIA H100 80GB HBM3", "gpu_count": 1, "model_fingerprint": "0123456789abcdef",
        "host_cpu": "AMD EPYC 9654"}
Env = Callable[[dict[str, Any]], dict[str, Any]]  # lease -> the provenance fields its result carries


def _drive(client: TestClient, env: Env) -> None:
    """Answer every lease (the fused config 2× the baseline's throughput, the same quality) with
    the fields `env` gives, until the study finishes."""
    noise = itertools.cycle([-1.0, 1.0, 0.3, -0.3, 0.8, -0.8])
    for i in itertools.count():
        assert i < 100, "the study did not finish"
        got = lease(client, "w")  # one worker: a round runs on the worker that started it
        if got is None:
            assert client.get("/v1/studies/s").json()["state"] == "finished"
            return
        z = next(noise)
        fast = bool(got["config"].get("fused_optimizer"))
        result = {**probe_result(got["config"], throughput=(200.0 if fast else 100.0) * math.exp(0.02 * z),
                                 nrmse=0.1 + 0.001 * z), **env(got)}
        r = client.post(f"/v1/trials/{got['trial_id']}/complete", json={"worker_id": "w", "result": result})
        assert r.status_code == 200, r.text


def _trials(client: TestClient) -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = client.get("/v1/studies/s/trials").json()["data"]
    return data


def test_best_json_and_yaml_carry_the_provenance(client: TestClient, make_study: StudyFactory) -> None:
    make_study("s", **COMMON)
    _drive(client, lambda got: H100)
    best = client.get("/v1/studies/s/best").json()
    assert best["certified"] is True and best["speedup"] > 1.5 and best["speedup_ci_low"] > 1.0
    prov = best["provenance"]
    assert {k: prov[k] for k in H100} == H100
    assert (prov["workload"], prov["preset"]) == ("ups", "tiny")
    assert prov["space_fingerprint"] == space_fingerprint(parse_space(SPACE))
    assert prov["mixed"] == [] and not any("mixed" in c for c in best["caveats"])
    # the environment is read from the pick's last run; the baseline run is the baseline's last
    trials = _trials(client)
    pick_runs = [t["number"] for t in trials if t["remeasure_of"] == best["trial_number"]]
    base_runs = [t["number"] for t in trials if t["is_baseline"] or t["remeasure_of"] == 0]
    assert prov["source_trial"] == max(pick_runs) and prov["baseline_trial"] == max(base_runs)
    assert client.get("/v1/studies/s").json()["best"]["provenance"] == prov

    text = client.get("/v1/studies/s/best", params={"format": "yaml"}).text
    assert "# provenance: workload ups, preset tiny; torch 2.5.1+cu124, CUDA 12.4, driver 550.54.15\n" in text
    assert "# device: NVIDIA H100 80GB HBM3 x 1 GPU; host CPU AMD EPYC 9654\n" in text
    assert f"# fingerprints: model 0123456789abcdef, search space {prov['space_fingerprint']}\n" in text
    assert f"# environment read from trial {prov['source_trial']}; baseline run: trial {prov['baseline_trial']}" \
        in text
    assert f"{best['speedup']:.2f}× (interval {best['speedup_ci_low']:.2f}–" in text  # the certified speedup, its CI
    assert yaml.safe_load(text) == best["config"]


def test_a_pick_and_a_baseline_measured_apart_make_a_mixed_study(client: TestClient,
                                                                   make_study: StudyFactory) -> None:
    make_study("s", **COMMON)
    a100 = {**H100, "torch_version": "2.6.0+cu126", "device": "NVIDIA A100-SXM4-80GB"}
    _drive(client, lambda got: a100 if got["config"].get("fused_optimizer") else H100)
    best = client.get("/v1/studies/s/best").json()
    mixed = best["provenance"]["mixed"]
    assert [line.split(" differs")[0] for line in mixed] == ["torch_version", "device"]
    base = [t["number"] for t in _trials(client) if t["is_baseline"] or t["remeasure_of"] == 0]
    assert mixed[0].startswith(f"torch_version differs: '2.5.1+cu124' (baseline trials {', '.join(map(str, base))}); "
                               "'2.6.0+cu126' (pick trials ")
    assert best["provenance"]["device"] == "NVIDIA A100-SXM4-80GB"  # the pick's run's
    caveat = next(c for c in best["caveats"] if c.startswith("mixed study"))
    assert "NVIDIA A100-SXM4-80GB" in caveat
    assert f"# caveat: {caveat}" in client.get("/v1/studies/s/best", params={"format": "yaml"}).text


def test_results_of_older_workers_still_complete(client: TestClient, make_study: StudyFactory) -> None:
    """Without the new fields (a worker older than them): accepted, and the provenance holds
    what they did record (torch version, device) and the service's own (workload, space)."""
    make_study("s", n_trials=2)
    for _ in range(3):
        got = lease(client, "w")
        if got is None:
            break
        result = probe_result(got["config"])
        assert "cuda_version" not in result and "model_fingerprint" not in result
        r = client.post(f"/v1/trials/{got['trial_id']}/complete", json={"worker_id": "w", "result": result})
        assert r.status_code == 200, r.text
    prov = client.get("/v1/studies/s/best").json()["provenance"]
    assert (prov["torch_version"], prov["device"], prov["workload"]) == ("0.0-test", "cpu (test)", "ups")
    assert prov["cuda_version"] is None and prov["driver_version"] is None and prov["gpu_count"] is None
    assert prov["model_fingerprint"] is None and prov["space_fingerprint"] and prov["mixed"] == []
    text = client.get("/v1/studies/s/best", params={"format": "yaml"}).text
    assert "CUDA n/a, driver n/a" in text and "fingerprints: model n/a, search space " in text
