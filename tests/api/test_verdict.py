"""The verdict through the service (fake ProbeResults over the API): sequential re-measure
rounds, per-config spread, quality at the judged budget, certified or not, and what /best
says in each case."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient
from service_helpers import StudyFactory, complete, lease

Truth = Callable[[dict[str, Any], int], tuple[float, float]]  # (lease, index) -> (throughput, quality)


def _drive(client: TestClient, truth: Truth, limit: int = 200) -> list[dict[str, Any]]:
    """Answer every lease from `truth` until the service hands out nothing; the leases, in order."""
    leases = []
    for i in itertools.count():
        assert i < limit, "the study did not finish"
        got = lease(client, "w")  # one worker: a round runs on the worker that started it
        if got is None:
            if client.get("/v1/studies/s").json()["state"] == "finished":
                return leases
            continue
        throughput, quality = truth(got, i)
        complete(client, got, "w", throughput=throughput, nrmse=quality)
        leases.append(got)
    return leases


def _trials(client: TestClient) -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = client.get("/v1/studies/s/trials").json()["data"]
    return data


# the space's one knob that matters: a fused optimizer is faster
SPACE = {"params": {"fused_optimizer": {"choices": [False, True]}, "batch_size": {"choices": [8]}}}
BASE = {"fused_optimizer": False, "batch_size": 8}  # a draw of it measures the baseline: one candidate
COMMON: dict[str, Any] = {"space": SPACE, "baseline": BASE, "starting_points": "none", "sampler": "random"}


def _noisy(base_cv: float, ratio: float, pick_cv: float, quality: Callable[[dict[str, Any]], float]) -> Truth:
    """A host-bound baseline (spread base_cv) and a fused config `ratio` times faster (spread pick_cv)."""
    noise = itertools.cycle([-1.0, 1.0, 0.3, -0.3, 0.8, -0.8])

    def truth(got: dict[str, Any], _: int) -> tuple[float, float]:
        z = next(noise)
        if got["config"].get("fused_optimizer"):
            return 100.0 * ratio * math.exp(pick_cv * z), quality(got)
        return 100.0 * math.exp(base_cv * z), 0.1 + 0.002 * z
    return truth


def test_a_true_win_over_a_noisy_baseline_is_certified_and_decided_configs_stop(
        client: TestClient, make_study: StudyFactory) -> None:
    make_study("s", n_trials=6, baseline_seeds=3, seed=0, **COMMON,
               remeasure={"top_k": 2, "max_rounds": 6})
    leases = _drive(client, _noisy(0.2, 2.0, 0.02, lambda got: 0.1 + 0.001 * (got["probe"]["seed"] % 3)))
    trials = _trials(client)
    rounds = [t for t in trials if t["role"] == "remeasure"]
    assert rounds, "re-measured"
    # each round's seed is its own (probe.seed + seed_offset + round), and the same for every config in it
    for t in rounds:
        got = next(x for x in leases if x["trial_id"] == t["trial_id"])
        assert got["probe"]["seed"] == 1000 + t["remeasure_round"]
        assert got["probe"]["samples"] is None or got["probe"]["samples"] == got["probe"]["samples"]
    best = client.get("/v1/studies/s/best").json()
    assert best["certified"] is True and best["outcome"] == "certified"
    assert best["config"]["fused_optimizer"] is True
    assert best["speedup"] == pytest.approx(2.0, rel=0.1) and best["speedup_ci_low"] > 1.0
    base_row = best["configs"][0]
    assert base_row["role"] == "baseline" and base_row["n"] >= 3 + 2  # its seeds count: the same budget
    pick_row = next(r for r in best["configs"] if r["trial_number"] == best["trial_number"])
    assert pick_row["status"] == "certified" and pick_row["n"] == best["rounds_run"]
    assert pick_row["throughput_sd_log"] < base_row["throughput_sd_log"]  # each config its own spread
    # the study stopped measuring once decided: fewer rounds than allowed
    assert best["rounds_run"] < best["max_rounds"] == 6
    assert best["remeasure_probes"] == len(rounds)
    text = client.get("/v1/studies/s/best", params={"format": "yaml"}).text
    assert "CERTIFIED" in text and yaml.safe_load(text)["fused_optimizer"] is True


def test_a_study_with_no_win_keeps_the_baseline_config_and_names_the_fastest_uncertified(
        client: TestClient, make_study: StudyFactory) -> None:
    make_study("s", n_trials=6, baseline_seeds=3, seed=0, **COMMON,
               remeasure={"top_k": 2, "max_rounds": 3})
    _drive(client, _noisy(0.15, 0.95, 0.15, lambda got: 0.1))  # truly no faster
    best = client.get("/v1/studies/s/best").json()
    assert best["certified"] is False and best["outcome"] in ("undecided", "no_win")
    base = next(t for t in _trials(client) if t["role"] == "baseline")
    assert best["trial_number"] == base["number"] and best["config"]["fused_optimizer"] is False
    assert best["uncertified"]["config"]["fused_optimizer"] is True
    assert best["rounds_run"] == 3  # undecided: measured until the budget was spent
    text = client.get("/v1/studies/s/best", params={"format": "yaml"}).text
    assert "KEEP THE BASELINE" in text and yaml.safe_load(text)["fused_optimizer"] is False


def test_a_faster_config_with_worse_quality_is_rejected(client: TestClient, make_study: StudyFactory) -> None:
    # the gate at the search budget lets it through (0.1 + max(0.01, 2 sd)); its runs show it worse than the margin
    make_study("s", n_trials=6, baseline_seeds=3, seed=0, **COMMON,
               gate={"abs_tol": 0.01, "k": 2.0}, remeasure={"top_k": 2, "max_rounds": 6})
    truth = _noisy(0.02, 2.0, 0.02, lambda got: 0.1 + 0.1 if got["role"] == "remeasure" else 0.105)
    _drive(client, truth)
    best = client.get("/v1/studies/s/best").json()
    assert best["certified"] is False and best["outcome"] == "no_win"
    rows = [r for r in best["configs"] if r["role"] == "candidate"]
    assert rows and all(r["status"] == "rejected" for r in rows)
    assert "quality worse" in rows[0]["reason"]


def test_a_duplicate_config_is_remeasured_once(client: TestClient, make_study: StudyFactory) -> None:
    """top_k takes distinct configs: two search trials of one config are one target."""
    make_study("s", n_trials=6, baseline_seeds=3, seed=0, **COMMON,
               remeasure={"top_k": 2, "max_rounds": 2})
    _drive(client, _noisy(0.2, 2.0, 0.02, lambda got: 0.1))
    configs = [tuple(sorted(r["config"].items())) for r in client.get("/v1/studies/s/best").json()["configs"]]
    assert len(configs) == len(set(configs))



# three candidates: two fast ones whose quality sits at the gate, and a slower one clearly better
HEADROOM_SPACE = {"params": {"inverse_loss_frequency": {"choices": [1, 2, 4, 8]}}}
HEADROOM_TRUTH = {1: (100.0, 0.100, 0.100), 2: (200.0, 0.108, 0.116), 4: (190.0, 0.108, 0.116),
                  8: (150.0, 0.085, 0.085)}


def _headroom_truth(got: dict[str, Any], i: int) -> tuple[float, float]:
    """(throughput, quality) by inverse_loss_frequency: speed, search quality, re-measured quality."""
    speed, search, remeasured = HEADROOM_TRUTH[got["config"]["inverse_loss_frequency"]]
    z = (-1.0, 1.0, 0.3, -0.3, 0.8, -0.8)[i % 6]
    return speed * math.exp(0.02 * z), (remeasured if got["role"] == "remeasure" else search) + 0.002 * z


@pytest.mark.parametrize("headroom", [True, False])
def test_a_slower_config_with_clear_quality_headroom_is_remeasured_and_certified(
        client: TestClient, make_study: StudyFactory, headroom: bool) -> None:
    """The two fastest pass the gate at the search's budget by a hair and re-measure worse; the third
    beat the baseline's quality by more than the gate's margin. remeasure.quality_headroom (the
    default) re-measures it too, and it is certified; without it the study keeps the baseline."""
    make_study("s", n_trials=7, baseline_seeds=3, seed=0, space=HEADROOM_SPACE, baseline={"inverse_loss_frequency": 1},
               starting_points="none", sampler="grid", gate={"abs_tol": 0.01, "k": 2.0},
               remeasure={"top_k": 2, "max_rounds": 4, "quality_headroom": headroom})
    _drive(client, _headroom_truth)
    searched = {t["config"]["inverse_loss_frequency"] for t in _trials(client) if t["role"] == "search"}
    assert {2, 4, 8} <= searched, searched  # every candidate ran in the search
    remeasured = {t["config"]["inverse_loss_frequency"] for t in _trials(client) if t["role"] == "remeasure"}
    best = client.get("/v1/studies/s/best").json()
    fast = [r for r in best["configs"] if r["role"] == "candidate" and r["config"]["inverse_loss_frequency"] in (2, 4)]
    assert len(fast) == 2 and all(r["status"] in ("rejected", "undecided") for r in fast), fast  # re-measured worse
    if headroom:
        assert remeasured == {1, 2, 4, 8}
        assert best["certified"] is True and best["config"]["inverse_loss_frequency"] == 8
        assert best["speedup"] == pytest.approx(1.5, rel=0.05) and best["speedup_ci_low"] > 1.0
    else:
        assert remeasured == {1, 2, 4}
        assert best["certified"] is False and best["config"]["inverse_loss_frequency"] == 1


def test_a_study_stored_before_quality_headroom_keeps_its_verdict() -> None:
    """A spec read back from storage without remeasure.quality_headroom (stored before the field
    existed) reads it off, so an upgrade does not re-judge a finished study; a new spec has it on."""
    from autotune.contract.protocol import StudySpec

    stored = StudySpec(name="s", workload="ups").model_dump(mode="json")
    assert stored["remeasure"]["quality_headroom"] is True  # what a new study stores
    del stored["remeasure"]["quality_headroom"]
    assert StudySpec.model_validate(stored, context={"stored": True}).remeasure.quality_headroom is False
    assert StudySpec.model_validate(stored).remeasure.quality_headroom is True  # a new submission: the default
