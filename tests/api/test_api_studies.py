"""Studies over REST: create, list, get, stop; validation errors name the field; health."""

from __future__ import annotations

import subprocess
import sys
import uuid
from typing import Any

import pytest
from fastapi.testclient import TestClient
from service_helpers import StudyFactory, lease

import autotune
from autotune.contract.config import ConfigError
from autotune.contract.steps import plan_steps


def _error(client: TestClient, spec: dict[str, Any], status: int = 422) -> list[dict[str, Any]]:
    r = client.post("/v1/studies", json=spec)
    assert r.status_code == status, r.text
    detail: list[dict[str, Any]] = r.json()["detail"]
    return detail


def test_create_list_get(client: TestClient, make_study: StudyFactory) -> None:
    info = make_study("first", n_trials=3)
    assert info["name"] == "first" and info["state"] == "running"
    assert info["spec"]["space"] == "cpu" and info["spec"]["n_trials"] == 3
    assert info["counts"] == {} and info["failures"] == {} and info["best"] is None
    make_study("second", sampler="random", seed=3)

    listed = client.get("/v1/studies").json()
    assert listed["count"] == 2
    assert [s["name"] for s in listed["data"]] == ["first", "second"]
    got = client.get("/v1/studies/second").json()
    assert got["spec"]["sampler"] == "random" and got["spec"]["seed"] == 3


def test_duplicate_name_is_409(client: TestClient, make_study: StudyFactory) -> None:
    make_study("dup")
    r = client.post("/v1/studies", json={"name": "dup"})
    assert r.status_code == 409
    assert "already exists" in r.json()["detail"]


@pytest.mark.parametrize(("spec", "loc", "words"), [
    ({"space": {"params": {"foo": {"choices": [1, 2]}}}}, ["space", "params", "foo"], "unknown knob"),
    ({"space": {"params": {"precision": {"choices": ["fp32", "fp8"]}}}}, ["space", "params", "precision"], "fp8"),
    ({"space": {"params": {"num_workers": {"choices": [0, 1]}, "prefetch_factor": {"choices": [2, 4]}}}},
     ["space", "params", "prefetch_factor"], "when"),
    ({"space": "nope"}, ["space"], "no search space"),  # the space as a whole: its field once
    ({"space": "../cpu"}, ["space"], "no paths"),
    ({"space": {"batch_size": {"choices": [2]}}}, ["space", "batch_size"], "searched knobs go under 'params'"),
    # a built-in workload's metric is known: another could complete no trial
    ({"workload": "gpt", "quality": {"metric": "val_nrmse"}}, ["quality", "metric"],
     "workload 'gpt' reports 'val_loss', never 'val_nrmse': write quality: {metric: val_loss, direction: minimize}"),
    ({"quality": {"metric": "val_nrmse", "direction": "maximize"}}, ["quality", "direction"],
     "workload 'ups''s val_nrmse is to minimize, not maximize"),
    ({"baseline": {"batchsize": 8}}, ["baseline", "batchsize"], "did you mean 'batch_size'"),
    ({"n_trials": 0}, ["n_trials"], "greater than or equal to 1"),
    ({"sampler": "cmaes"}, ["sampler"], "tpe"),
])
def test_bad_spec_is_422_naming_the_field(client: TestClient, spec: dict[str, Any], loc: list[str],
                                          words: str) -> None:
    detail = _error(client, {"name": "bad", **spec})
    assert len(detail) == 1
    assert detail[0]["loc"] == ["body", *loc]
    assert words in detail[0]["msg"]
    assert client.get("/v1/studies").json()["count"] == 0


@pytest.mark.parametrize("name", ["../x", "a/b", "", ".hidden", "x" * 65])
def test_bad_name_is_422(client: TestClient, name: str) -> None:
    detail = _error(client, {"name": name})
    assert detail[0]["loc"] == ["body", "name"]


@pytest.mark.parametrize(("spec", "need"), [
    ({"probe": {"samples": 79}}, 80),  # ups tiny's 4 × 2: 5 warm-up steps + 5 timed, 8 samples each
    ({"probe": {"samples": 159}, "baseline": {"batch_size": 16, "accum_steps": 1}}, 160),
    ({"probe": {"samples": 167}, "baseline": {"inverse_loss_frequency": 8}}, 168),  # a warm-up of 2 periods: 16 steps
    ({"probe": {"samples": 159}, "gpus_per_trial": 2}, 160),  # each of 2 ranks trains 4 × 2 per step
])
def test_a_probe_budget_that_cannot_time_the_baseline_is_422(client: TestClient, make_study: StudyFactory,
                                                             spec: dict[str, Any], need: int) -> None:
    """The baseline's batch × accumulation (its config's, else the preset's) and warm-up against
    probe.samples, as a probe plans them: one sample short is refused, naming the budget that
    works; that budget is accepted."""
    detail = _error(client, {"name": "short", **spec})
    assert detail[0]["loc"] == ["body", "probe", "samples"]
    assert "could not be timed" in detail[0]["msg"] and f"use samples >= {need}" in detail[0]["msg"]
    enough = {**spec, "probe": {"samples": need}}
    assert make_study("enough", **enough)["spec"]["probe"]["samples"] == need


@pytest.mark.parametrize(("samples", "timed", "untimed"), [(80, 8, "16 × 2, 16 × 1, 8 × 2"), (319, 31, "16 × 2")])
def test_a_space_that_draws_configs_the_budget_cannot_time_gets_a_note(
        client: TestClient, make_study: StudyFactory, samples: int, timed: int, untimed: str) -> None:
    """The study is created (its baseline, ups tiny's 4 × 2, is timed) with a note naming the
    largest batch × accumulation its probes time, which is exactly where a probe starts
    refusing, and the budget that times the whole space; at that budget the note is gone."""
    space = {"params": {"batch_size": {"choices": [4, 8, 16]}, "accum_steps": {"choices": [1, 2]}}}
    info = make_study("wide", space=space, probe={"samples": samples})
    assert info["notes"] == [
        f"probe.samples {samples} times at most {timed} samples per optimizer step (batch_size × accum_steps); "
        f"the space draws up to 32 (e.g. {untimed}): such configs fail as trials before training. "
        "Use probe.samples >= 320 to time them all, or narrow the space"]
    assert client.get("/v1/studies/wide").json()["notes"] == info["notes"]
    plan_steps(samples, timed, 5, 8, 1)  # the probe's own plan (warm-up 5 steps): `timed` is timed, one more is not
    with pytest.raises(ConfigError, match="need >= 5"):
        plan_steps(samples, timed + 1, 5, 8, 1)
    assert make_study("all-timed", space=space, probe={"samples": 320})["notes"] == []


@pytest.mark.parametrize(("batch", "accum"), [
    ({"low": 4, "high": 16, "step": 4}, {"low": 1, "high": 2}),  # 4, 8, 12, 16 × 1, 2
    ({"low": 2, "high": 20, "step": 6}, {"low": 1, "high": 3, "step": 2}),  # 2, 8, 14, 20 × 1, 3: high off the step
])
def test_an_int_range_gets_the_note_its_values_as_choices_get(make_study: StudyFactory, batch: dict[str, int],
                                                              accum: dict[str, int]) -> None:
    """The note reads an int range by its bounds and step (it listed every value at each view of
    the study), and says what the same values given as choices get it to say."""
    def choices(r: dict[str, int]) -> dict[str, list[int]]:
        return {"choices": list(range(r["low"], r["high"] + 1, r.get("step", 1)))}

    as_range = make_study("ranged", space={"params": {"batch_size": batch, "accum_steps": accum}},
                          probe={"samples": 80})["notes"]
    as_choices = make_study("listed", space={"params": {"batch_size": choices(batch), "accum_steps": choices(accum)}},
                            probe={"samples": 80})["notes"]
    assert as_range == as_choices and len(as_range) == 1


def test_the_widest_ranges_the_knobs_allow_get_their_note(make_study: StudyFactory) -> None:
    widest = {"batch_size": {"low": 1, "high": 65536}, "accum_steps": {"low": 1, "high": 1024}}
    assert make_study("widest", space={"params": widest}, probe={"samples": 80})["notes"] == [
        "probe.samples 80 times at most 8 samples per optimizer step (batch_size × accum_steps); the space draws "
        "up to 67108864 (e.g. 65536 × 1024, 65535 × 1024, 65534 × 1024): such configs fail as trials before "
        "training. Use probe.samples >= 671088640 to time them all, or narrow the space"]


def test_grid_over_a_float_range_is_422(client: TestClient) -> None:
    detail = _error(client, {"name": "g", "sampler": "grid",
                             "space": {"params": {"lr": {"low": 1e-4, "high": 1e-2, "log": True}}}})
    assert detail[0]["loc"] == ["body", "space", "params", "lr"]
    assert detail[0]["msg"].startswith("space.params.lr: ") and "grid needs choices" in detail[0]["msg"]


@pytest.mark.parametrize("body", [b"{not json", b"[]", b'{"name": 5}'])
def test_malformed_bodies_are_422_not_500(client: TestClient, body: bytes) -> None:
    r = client.post("/v1/studies", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422
    assert r.json()["detail"]


def test_unknown_study_is_404_naming_it(client: TestClient) -> None:
    for path in ("/v1/studies/ghost", "/v1/studies/ghost/trials", "/v1/studies/ghost/pareto",
                 "/v1/studies/ghost/best"):
        r = client.get(path)
        assert r.status_code == 404, path
        assert "ghost" in r.json()["detail"]
    r = client.delete("/v1/studies/ghost")
    assert r.status_code == 404 and "ghost" in r.json()["detail"]


def test_delete_stops_and_keeps_data(client: TestClient, make_study: StudyFactory) -> None:
    make_study("s", n_trials=5)
    held = lease(client, "w1")
    assert held is not None
    r = client.delete("/v1/studies/s")
    assert r.status_code == 200 and r.json()["state"] == "stopped"
    assert client.delete("/v1/studies/s").json()["state"] == "stopped"  # stopping again is harmless

    beat = client.post(f"/v1/trials/{held['trial_id']}/heartbeat", json={"worker_id": "w1"}).json()
    assert beat["action"] == "stop" and "stopped" in beat["reason"]
    assert lease(client, "w2") is None  # no more leases
    report = client.post(f"/v1/trials/{held['trial_id']}/report",
                         json={"worker_id": "w1", "step": 1, "metrics": {"loss": 0.5}}).json()
    assert report["prune"] is True
    # the data is kept: the trial is still there and its worker may still hand in its result
    assert client.get("/v1/studies/s/trials").json()["count"] == 1
    r = client.post(f"/v1/trials/{held['trial_id']}/complete",
                    json={"worker_id": "w1", "result": {"stopped_early": True, "config": {}}})
    assert r.status_code == 200 and r.json()["state"] == "PRUNED"
    assert client.get("/v1/studies/s").json()["state"] == "stopped"


def test_health(client: TestClient) -> None:
    reply = client.get("/v1/health").json()
    service_id = reply.pop("service_id")
    assert reply == {"status": "ok", "db": "sqlite", "version": autotune.__version__}
    assert str(uuid.UUID(service_id)) == service_id  # the identity made with the tables
    assert client.get("/v1/health").json()["service_id"] == service_id


def test_service_import_path_is_torch_free() -> None:
    code = "import sys, api.main; assert 'torch' not in sys.modules, 'api imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
