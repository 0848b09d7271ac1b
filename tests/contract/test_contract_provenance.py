"""Provenance (autotune.contract.provenance): the model and search-space fingerprints, the runs'
comparison (a mixed study), the wire form of the probe's new fields (older results still
parse) and best.yaml's provenance lines. The probe's side: tests/engine/test_probe_provenance.py;
the service's: tests/api/test_api_provenance.py."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from autotune.contract.provenance import (
    FINGERPRINT_HEX,
    digest,
    mixed_runs,
    model_fingerprint,
    normalized_space,
    space_fingerprint,
)
from autotune.contract.recommendation import provenance_lines, recommendation_yaml
from autotune.contract.results import CompleteRequest, TrialResult
from autotune.contract.space import load_space, parse_space
from autotune.contract.views import Provenance, Recommendation

PARAMS = [("embed.weight", (64, 16)), ("blocks.0.attn.weight", (16, 16)), ("head.bias", (3,))]


def test_model_fingerprint_is_stable_and_sees_names_shapes_and_order() -> None:
    fp = model_fingerprint(PARAMS)
    assert fp == model_fingerprint(list(PARAMS)) == model_fingerprint([(n, list(s)) for n, s in PARAMS])
    assert len(fp) == FINGERPRINT_HEX and int(fp, 16) >= 0
    assert fp == "4cce61c9efe45d6b"  # pinned: stored fingerprints are compared later, the hash must not drift
    assert model_fingerprint([*PARAMS[:2], ("head.bias", (4,))]) != fp  # a resized layer
    assert model_fingerprint([("embedding.weight", (64, 16)), *PARAMS[1:]]) != fp  # a renamed one
    assert model_fingerprint(PARAMS[::-1]) != fp  # another registration order: another model
    assert model_fingerprint([*PARAMS, ("extra.weight", (1,))]) != fp


def test_digest_is_canonical_json() -> None:
    assert digest({"a": 1, "b": [1, 2]}) == digest({"b": [1, 2], "a": 1})
    assert digest({"a": 1}) != digest({"a": 1.5})
    with pytest.raises(ValueError):
        digest({"a": float("nan")})


def test_space_fingerprint_is_what_is_searched() -> None:
    named = load_space("cpu")
    inline = parse_space({**named.to_dict(), "name": "mine", "description": "the same, inline"})
    assert space_fingerprint(named) == space_fingerprint(inline)  # name and description are not searched
    two = {"batch_size": {"choices": [4, 8]}, "lr": {"low": 1e-4, "high": 3e-3, "log": True}}
    assert space_fingerprint(parse_space({"params": two})) == space_fingerprint(
        parse_space({"params": dict(reversed(two.items()))}))  # declaration order: the same space
    other = parse_space({"params": {"batch_size": {"choices": [4, 8]}}})
    assert space_fingerprint(other) != space_fingerprint(named)
    assert space_fingerprint(parse_space({"params": {"batch_size": {"choices": [4, 16]}}})) != space_fingerprint(other)
    assert space_fingerprint(parse_space({"params": {"batch_size": {"choices": [4, 8]}},
                                          "fixed": {"pin_memory": True}})) != space_fingerprint(other)
    assert normalized_space(other) == {"params": {"batch_size": {"choices": [4, 8]}}, "fixed": {}}


def test_mixed_runs_name_what_differs_and_ignore_what_was_not_recorded() -> None:
    same = {"torch_version": "2.5.1", "device": "NVIDIA H100", "gpu_count": 1, "model_fingerprint": "ab"}
    assert mixed_runs([("baseline", 0, same), ("pick", 3, dict(same))]) == []
    assert mixed_runs([("baseline", 0, same), ("pick", 3, {"torch_version": None})]) == []  # an older worker
    lines = mixed_runs([("baseline", 0, same), ("baseline", 1, same),
                        ("pick", 3, {**same, "torch_version": "2.6.0", "device": "NVIDIA A100"}),
                        ("pick", 4, {**same, "gpu_count": 2})])
    assert lines == ["torch_version differs: '2.5.1' (baseline trials 0, 1, pick trial 4); '2.6.0' (pick trial 3)",
                     "device differs: 'NVIDIA H100' (baseline trials 0, 1, pick trial 4); 'NVIDIA A100' (pick trial 3)",
                     "gpu_count differs: '1' (baseline trials 0, 1, pick trial 3); '2' (pick trial 4)"]


def _measured(**extra: Any) -> dict[str, Any]:
    """A result as an older worker sent it: no provenance fields."""
    return {"workload": "ups", "preset": "tiny", "device": "cpu (test)", "torch_version": "2.4.0",
            "throughput_samples_per_s": 100.0, "quality": 0.1, "quality_metric": "val_nrmse", **extra}


def test_results_without_the_new_fields_still_parse() -> None:
    old = TrialResult.model_validate(_measured())
    assert old.cuda_version is None and old.driver_version is None and old.gpu_count is None
    assert old.model_fingerprint is None
    assert "cuda_version" not in old.as_dict()  # a dump holds what the worker gave
    CompleteRequest.model_validate({"worker_id": "w", "result": _measured()})


def test_results_carry_the_new_fields_typed() -> None:
    new = TrialResult.model_validate(_measured(cuda_version="12.4", driver_version="550.54.15", gpu_count=2,
                                               model_fingerprint="0123456789abcdef"))
    assert (new.cuda_version, new.driver_version, new.gpu_count, new.model_fingerprint) == (
        "12.4", "550.54.15", 2, "0123456789abcdef")
    for bad in ({"gpu_count": "2"}, {"gpu_count": -1}, {"cuda_version": 12.4}, {"model_fingerprint": 5}):
        with pytest.raises(ValidationError) as e:
            TrialResult.model_validate(_measured(**bad))
        assert next(iter(bad)) in str(e.value)


BASE_REC: dict[str, Any] = {"study": "s", "config": {"batch_size": 8}, "trial_number": 5,
                            "throughput_samples_per_s": 200.0, "baseline_throughput_samples_per_s": 100.0,
                            "speedup": 2.0, "quality": 0.1, "baseline_quality": 0.1, "certified": True,
                            "outcome": "certified", "verdict": "2.00× (interval 1.80–2.20×) the baseline's "
                            "throughput, certified"}


def test_a_stored_recommendation_without_provenance_still_parses() -> None:
    rec = Recommendation.model_validate(BASE_REC)
    assert rec.provenance == Provenance()
    text = recommendation_yaml(rec)  # every field n/a, still a config file
    assert "# provenance: workload n/a, preset n/a; torch n/a, CUDA n/a, driver n/a" in text
    assert yaml.safe_load(text) == {"batch_size": 8}


def test_best_yaml_names_the_provenance() -> None:
    prov = Provenance(workload="ups", preset="full", torch_version="2.5.1", cuda_version="12.4",
                      driver_version="550.54.15", device="NVIDIA H100 80GB HBM3", gpu_count=2,
                      host_cpu="AMD EPYC", model_fingerprint="aaaa", space_fingerprint="bbbb", source_trial=9,
                      baseline_trial=7)
    rec = Recommendation.model_validate({**BASE_REC, "provenance": prov.model_dump()})
    text = recommendation_yaml(rec)
    assert provenance_lines(prov) == [
        "provenance: workload ups, preset full; torch 2.5.1, CUDA 12.4, driver 550.54.15",
        "device: NVIDIA H100 80GB HBM3 x 2 GPUs; host CPU AMD EPYC",
        "fingerprints: model aaaa, search space bbbb",
        "environment read from trial 9; baseline run: trial 7"]
    for line in provenance_lines(prov):
        assert f"# {line}\n" in text
    assert "2.00× (interval 1.80–2.20×)" in text  # the certified speedup with its interval
    assert yaml.safe_load(text) == {"batch_size": 8}
    cpu = provenance_lines(Provenance(device="cpu (x86_64, 2 cores)", gpu_count=0, source_trial=3, baseline_trial=3))
    assert cpu[1] == "device: cpu (x86_64, 2 cores) (CPU study)" and cpu[3] == "environment read from trial 3"
