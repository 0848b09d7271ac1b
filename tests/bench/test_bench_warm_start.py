"""bench/warm_start.py, small: one seed on the tiny planted job (8 configs) through the real service
(a subprocess on a SQLite file, real HTTP, a simulated worker answering every lease from the
planted truth): study A cold, then B cold and B' warm from A. The JSON's shape, the GPU-seconds'
accounting, and that B' tries A's pick (or its fastest front config) first, right after its
baseline, saying where it came from, while B does not. The planted truth and the summaries'
"not reached" are checked without the service."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT, run_bench

sys.path.insert(0, str(ROOT / "bench"))
import warm_start  # a bench script (bench/ is not a package)

OVERHEAD_S = 5.0


@pytest.fixture(scope="module")
def doc(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("warm_start") / "warm_start.json"
    run_bench("warm_start.py", "--space", "tiny", "--seeds", "1", "--first-seed", "3", "--n-trials", "8",
              "--probe-overhead-s", str(OVERHEAD_S), "--out", str(out), timeout=120)
    return dict(json.loads(out.read_text()))


def _by_group(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    rows = doc["studies"]
    assert sorted(r["group"] for r in rows) == ["cold", "first", "warm"], rows
    return {r["group"]: r for r in rows}


@pytest.mark.slow
def test_the_json_has_every_study_and_its_summary(doc: dict[str, Any]) -> None:
    assert doc["benchmark"] == "warm_start"
    assert doc["settings"]["space_size"] == 8 and doc["settings"]["winner_configs"] == 1
    assert doc["settings"]["n_trials"] == 8 and doc["settings"]["seeds"] == [3]
    assert [s["group"] for s in doc["summaries"]] == list(warm_start.GROUPS)
    for s in doc["summaries"]:
        assert s["studies"] == s["finished"] == 1, s
        assert s["certified"]["n"] == 1 and s["gpu_s"]["median"] is not None, s
    assert doc["ratios"]["pairs"] == 1 and doc["ratios"]["median_gpu_s"] is not None
    assert Path(doc["settings"]["png"]).stat().st_size > 0
    for r in doc["studies"]:
        assert r["finished"] and "errors" not in r, r
        assert r["trace"].startswith("bbb") and r["probes_by_role"]["baseline"] == 3, r
        # every trial the service handed out was run and paid for; a REPEAT draw ('.') was not
        assert r["probes"] == len(r["trace"]) - r["trace"].count(".") == sum(r["probes_by_role"].values()), r
        assert r["gpu_s"] >= r["probes"] * OVERHEAD_S, r
        if "winner_probe" in r:  # the winner's first probe: its place in the trace, its cost within the total
            ran = r["trace"].replace(".", "")
            assert ran[r["winner_probe"] - 1].isupper() and not any(c.isupper() for c in ran[:r["winner_probe"] - 1])
            assert r["winner_probe"] * OVERHEAD_S <= r["gpu_s_to_winner"] <= r["gpu_s"], r
        else:
            assert not any(c.isupper() for c in r["trace"]), r


@pytest.mark.slow
def test_the_warm_study_tries_the_earlier_pick_first_and_the_cold_one_does_not(doc: dict[str, Any]) -> None:
    by = _by_group(doc)
    first, cold, warm = by["first"], by["cold"], by["warm"]
    assert warm["warm_start"] == first["study"] and "warm_start" not in cold
    assert warm["sampler_seed"] == cold["sampler_seed"] != first["sampler_seed"]
    assert "first_tried" in first, first  # A has a verdict with a candidate to start from
    # right after the 3 baseline seeds: A's certified pick, else its fastest front config, measured again
    assert warm["first_search"]["number"] == 3, warm
    assert warm["first_search"]["warm_start_from"] == first["study"], warm
    assert warm["first_search"]["config"] == first["first_tried"], (warm, first)
    assert warm["trace"][3] in "wW" and warm["warm_points"] >= 1, warm
    assert "warm_start_from" not in cold["first_search"], cold
    assert "w" not in cold["trace"].lower() and cold["warm_points"] == 0, cold
    if first["winner_certified"]:  # A knew the winner: B' measures it at its 4th probe
        assert first["pick"] == first["first_tried"]
        assert warm["first_search"]["is_winner"] and warm["winner_probe"] == 4, warm


def test_the_planted_job_and_its_truth() -> None:
    full, tiny = warm_start.SPACES["full"], warm_start.SPACES["tiny"]
    assert (full.size, full.winners, tiny.size, tiny.winners) == (48, 2, 8, 1)
    assert not full.is_winner(full.baseline) and not full.is_winner(None)
    win = {**full.baseline, **dict(full.winner)}
    assert full.is_winner(win) and full.is_winner({**win, "inverse_loss_frequency": 2})
    truth = warm_start.JobTruth(warm_start.SCENARIO, 7, 1000, full)
    assert truth.speed(win) == 2 * truth.speed(full.baseline) and truth.cv(win) < truth.cv(full.baseline)
    assert truth.quality(win) == truth.quality(full.baseline)
    lease = {"number": 4, "role": "search", "config": win, "probe": {"samples": 1000, "seed": 0}}
    run = truth.run(lease)
    assert run == truth.run(lease)  # reproducible: seeded by (sampler seed, trial number)
    assert warm_start.probe_cost(run, 5.0) == pytest.approx(5.0 + 1000 / run["throughput"])


def test_quantiles_say_not_reached() -> None:
    assert warm_start.quantiles([1.0, 2.0, 3.0, 4.0]) == {"median": 2.0, "q25": 1.0, "q75": 3.0}
    assert warm_start.quantiles([1.0, math.inf, math.inf]) == {"median": None, "q25": 1.0, "q75": None}
    assert warm_start.fmt_q({"median": None, "q25": None, "q75": None}) == "not reached"
