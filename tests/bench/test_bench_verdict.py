"""bench/verdict.py, small: the verdict on planted truth through the real service (a subprocess on
a SQLite file, real HTTP, a simulated worker answering every lease from the scenario's truth).

Two seeds each of the A/A study (nothing differs), the 2× win (fused_optimizer 2× faster, equal
quality) and the quality loss (the fused configs 3σ worse): every study must finish, the wins
must certify the fused config, the A/A studies must certify nothing and the loss studies must
not certify the fused config. The truth model itself (reproducible noise, its spread by budget)
and the Wilson interval are checked without the service."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import verdict  # a bench script (bench/ is not a package)

SCENARIOS = ("aa", "win2", "loss")
SEEDS = 2


@pytest.fixture(scope="module")
def calibration(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Any]]:
    """The script's exit status and its JSON, for 2 seeds of each scenario (one service for all)."""
    out = tmp_path_factory.mktemp("verdict") / "verdict.json"
    code = verdict.main(["--seeds", str(SEEDS), "--scenarios", ",".join(SCENARIOS), "--parallel", "2",
                         "--study-timeout-s", "120", "--out", str(out)])
    return code, json.loads(out.read_text())


def _studies(doc: dict[str, Any], scenario: str) -> list[dict[str, Any]]:
    studies = [s for s in doc["studies"] if s["scenario"] == scenario]
    assert len(studies) == SEEDS, (scenario, len(studies))
    return studies


def _why(s: dict[str, Any]) -> str:
    rec = s["recommendation"] or {}
    return (f"{s['study']}: certified {s['certified']}, outcome {s['outcome']}, pick {s['pick']}, speedup "
            f"{s['speedup']} {s['speedup_ci']}, reason {rec.get('reason') or s['message']!r}, "
            f"errors {s['errors']} {s['error_examples'][:1]}")


@pytest.mark.slow
def test_every_study_finishes_through_the_service(calibration: tuple[int, dict[str, Any]]) -> None:
    code, doc = calibration
    assert [s["scenario"] for s in doc["summaries"]] == list(SCENARIOS)
    for s in doc["studies"]:
        assert s["finished"] and not s["errors"] and not s["mismatched_trials"], _why(s)
        assert s["recommendation"] is not None, _why(s)  # /best answers 200 once a study has finished
        roles = [t["role"] for t in s["trials"]]
        assert roles.count("baseline") == 3, s["trials"]
        # every trial ran to its end, or was a draw of a config measured already (REPEAT: never run)
        assert all(t["state"] == "COMPLETE" or (t["state"] == "REPEAT" and t["role"] == "search")
                   for t in s["trials"]), s["trials"]
        # every trial names one of the study's configs (with its planted truth); every one leased, its probe
        assert s["configs"].keys() == s["truth"].keys(), s["truth"]
        assert all(t["config"] in s["configs"] for t in s["trials"]), s["trials"]
        assert all("samples" in t for t in s["trials"] if "repeat_of" not in t), s["trials"]
    assert code == 0
    assert Path(doc["settings"]["png"]).stat().st_size > 0


@pytest.mark.slow
def test_a_true_2x_win_is_certified(calibration: tuple[int, dict[str, Any]]) -> None:
    _, doc = calibration
    for s in _studies(doc, "win2"):
        assert s["certified"] and verdict.is_winner(s["pick"]) and s["outcome"] == "certified", _why(s)
        assert s["speedup_ci"][0] is not None and s["speedup_ci"][0] > 1, _why(s)


@pytest.mark.slow
def test_a_true_quality_loss_is_not_certified(calibration: tuple[int, dict[str, Any]]) -> None:
    _, doc = calibration
    for s in _studies(doc, "loss"):
        assert not s["winner_certified"], _why(s)


@pytest.mark.slow
def test_nothing_is_certified_when_nothing_differs(calibration: tuple[int, dict[str, Any]]) -> None:
    _, doc = calibration
    for s in _studies(doc, "aa"):
        assert not s["certified"] and s["outcome"] != "certified", _why(s)


def test_the_planted_truth_is_reproducible_and_spreads_by_budget() -> None:
    loss = verdict.SCENARIOS["loss"]
    truth = verdict.Truth(loss, seed=7, study_samples=1000)
    fused = {**verdict.BASELINE, "fused_optimizer": True}

    def lease(number: int, config: dict[str, Any], samples: int) -> dict[str, Any]:
        return {"number": number, "role": "search", "config": config, "probe": {"samples": samples, "seed": 0},
                "workload": "ups", "preset": "tiny"}

    first = truth.run(lease(5, fused, 1000))
    assert first == truth.run(lease(5, fused, 1000))  # seeded by (seed, trial number)
    assert first["throughput"] != truth.run(lease(6, fused, 1000))["throughput"]
    assert truth.speed(fused) == 2 * truth.speed(verdict.BASELINE)
    assert truth.quality(fused) - truth.quality(verdict.BASELINE) == pytest.approx(3 * verdict.SD_SEARCH)
    assert first["truth"]["quality_sd"] == verdict.SD_SEARCH
    assert truth.run(lease(5, fused, 2000))["truth"]["quality_sd"] == verdict.SD_LONG  # a longer budget
    # the spreads over many trial numbers are the planted ones
    runs = [truth.run(lease(n, verdict.BASELINE, 1000)) for n in range(2000)]
    logs = [math.log(r["throughput"] / 100.0) for r in runs]
    assert sum(x * x for x in logs) / len(logs) == pytest.approx(loss.cv_other ** 2, rel=0.1)
    body = truth.result(lease(5, fused, 1000), first)
    assert body["config"] == fused and body["quality"] == body["val_nrmse"] == first["quality"]


def test_two_unequal_gpus_scale_their_workers_throughputs() -> None:
    scenario = verdict.SCENARIOS["aa-2gpu"]
    truth = verdict.Truth(scenario, seed=3, study_samples=1000)
    lease = {"number": 4, "role": "remeasure", "config": verdict.BASELINE, "probe": {"samples": 1000, "seed": 1}}
    slow, fast = truth.run(lease, 0), truth.run(lease, 1)
    assert scenario.workers == 2 and truth.gpu(0) == 1.0 and truth.gpu(1) == pytest.approx(1.05)
    assert fast["throughput"] == pytest.approx(slow["throughput"] * 1.05)  # the same draw, on the faster GPU
    assert fast["quality"] == slow["quality"]  # the GPU changes the speed only


def test_wilson_interval() -> None:
    assert verdict.wilson(0, 100) == (0.0, pytest.approx(0.0370, abs=1e-4))
    low, high = verdict.wilson(90, 100)
    assert (low, high) == (pytest.approx(0.8256, abs=1e-4), pytest.approx(0.9448, abs=1e-4))
    assert verdict.wilson(0, 0) == (0.0, 1.0)
