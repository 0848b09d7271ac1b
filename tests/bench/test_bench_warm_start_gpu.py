"""bench/warm_start_gpu.py's accounting, without running a study (its runs take minutes: a GPU run on
a lent machine, a CPU smoke by hand): the GPU-seconds to a moment from the trials' lease-to-complete
intervals, the certified pick's first measurement, the warm-start points, the shared target, the
summary table and the palette PNG; and bench/regression_check.py's slowed copy of a best.yaml."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from helpers import ROOT
from PIL import Image

sys.path.insert(0, str(ROOT / "bench"))
import regression_check  # bench scripts (bench/ is not a package)
import warm_start_gpu as wsg

FAST = {"batch_size": 16, "accum_steps": 1, "step_graph": True}
SLOW = {"batch_size": 8, "step_graph": False}
MID = {"batch_size": 8, "step_graph": True}


def _trial(number: int, role: str, start: float, end: float | None, params: dict[str, Any], *,
           state: str = "COMPLETE", throughput: float | None = None, warm: str | None = None) -> dict[str, Any]:
    return {"number": number, "role": role, "state": state, "params": params, "throughput": throughput,
            "feasible": True if throughput else None, "warm_start_from": warm, "start_s": start, "end_s": end,
            "duration_s": None if end is None else end - start}


def _study(warm: bool) -> dict[str, Any]:
    """3 baseline seeds (10 s each), then warm: A's pick as a warm point (5 s), a search trial (5 s);
    cold: a slower search trial, then the fast one; a REPEAT draw; two re-measurements of the pick."""
    trials = [_trial(i, "baseline", 10.0 * i, 10.0 * (i + 1), {}, throughput=100.0) for i in range(3)]
    if warm:
        trials += [_trial(3, "search", 30.0, 35.0, FAST, throughput=900.0, warm="a"),
                   _trial(4, "search", 35.0, 40.0, MID, throughput=500.0)]
        pick = 3
    else:
        trials += [_trial(3, "search", 30.0, 35.0, MID, throughput=500.0),
                   _trial(4, "search", 35.0, 40.0, FAST, throughput=880.0)]
        pick = 4
    trials += [_trial(5, "search", 40.0, 40.0, SLOW, state="REPEAT"),
               _trial(6, "remeasure", 40.0, 45.0, FAST, throughput=910.0),
               _trial(7, "remeasure", 45.0, 50.0, FAST, throughput=905.0)]
    rec = {"certified": True, "trial_number": pick, "speedup": 9.0, "speedup_ci_low": 8.0, "speedup_ci_high": 10.0,
           "outcome": "certified", "config": {**FAST, "lr": 0.003}, "quality_metric": "val_loss",
           "configs": [{"role": "baseline", "throughput_samples_per_s": 100.0}]}
    return {"state": "finished", "trials": trials, "recommendation": rec}


def test_gpu_seconds_are_the_intervals_cut_at_the_moment() -> None:
    trials = [_trial(0, "baseline", 0.0, 10.0, {}), _trial(1, "search", 10.0, 15.0, {}),
              _trial(2, "search", 12.0, None, {}, state="RUNNING")]  # a second worker's, still running
    assert wsg.gpu_s_until(trials, None) is None
    assert wsg.gpu_s_until(trials, 5.0) == 5.0
    assert wsg.gpu_s_until(trials, 15.0) == 10.0 + 5.0 + 3.0


def test_the_warm_study_measures_the_pick_first_and_the_figures_say_so(tmp_path: Path) -> None:
    a = wsg.summarize("first", _study(warm=False), {"exit_code": 0}, None)
    warm = wsg.summarize("warm", _study(warm=True), {"exit_code": 0}, a["pick"])
    cold = wsg.summarize("cold", _study(warm=False), {"exit_code": 0}, a["pick"])
    assert warm["certified"] and warm["pick"] == dict(sorted(FAST.items())) and warm["same_pick_as_a"]
    assert warm["pick_from_warm_start"] == "a" and warm["warm_points"] == 1 and cold["warm_points"] == 0
    assert warm["pick_first_measured_probe"] == 4 and cold["pick_first_measured_probe"] == 5
    assert warm["gpu_s_to_pick"] == 35.0 and cold["gpu_s_to_pick"] == 40.0
    assert warm["gpu_s"] == cold["gpu_s"] == 50.0 and warm["trials_run"] == 7 and warm["repeats"] == 1
    assert warm["by_role"] == {"baseline": 3, "warm": 1, "search": 1, "remeasure": 2}
    assert warm["trace"] == "bbbWs.RR" and cold["trace"] == "bbbsS.RR"
    assert warm["speedup_ci"] == [8.0, 10.0] and warm["baseline_throughput"] == 100.0
    rows = {"first": a, "warm": warm, "cold": cold}
    target = wsg.add_targets(rows, 0.9)
    assert target == 810.0 and warm["gpu_s_to_target"] == 35.0 and cold["gpu_s_to_target"] == 40.0
    c = wsg.comparison(rows)
    assert c is not None and c["warm_over_cold_gpu_s_to_pick"] == 0.875 and c["gpu_s_saved_to_pick"] == 5.0
    assert c["same_pick"] and c["warm_over_cold_gpu_s"] == 1.0
    doc = {"environment": {"gpu": "NVIDIA H200", "torch": "2.11.0"}, "wall_s": 100.0, "studies": rows,
           "settings": {"spec": {"workload": "gpt", "preset": "tiny", "n_trials": 10, "probe": {"samples": 8192},
                                 "starting_points": "none"}, "space_size": 48, "target_fraction": 0.9},
           "target_throughput": target, "comparison": c,
           "checks": {"unchanged": {"exit_code": 0, "wall_s": 60.0, "report": {"status": "holds", "speedup": 8.7,
                                                                               "speedup_ci": [7.0, 10.0]}},
                      "slowed": {"exit_code": 1, "wall_s": 70.0, "report": {"status": "regressed", "speedup": 1.0}}}}
    table = wsg.markdown(doc)
    assert "| B': second, warm from A |" in table and "(warm start from a)" in table and "0.88" in table
    assert "unchanged: exit 0 (expected 0), holds" in table and "slowed: exit 1 (expected 1), regressed" in table
    png = tmp_path / "ws.png"
    wsg.plot(json.loads(json.dumps(doc)), png)
    with Image.open(png) as image:
        assert image.mode == "P"


def test_a_study_without_a_certified_pick_reaches_nothing() -> None:
    study = _study(warm=False)
    study["recommendation"] = {"certified": False, "outcome": "undecided", "trial_number": 0,
                               "uncertified": {"trial_number": 4, "status": "undecided", "speedup": 8.8}}
    row = wsg.summarize("cold", study, {"exit_code": 1}, None)
    assert row["pick"] is None and row["gpu_s_to_pick"] is None and row["speedup"] is None
    assert row["uncertified_best"] == {"trial": 4, "status": "undecided", "speedup": 8.8}
    assert row["trace"] == "bbbss.rr" and row["gpu_s"] == 50.0


def test_the_slowed_copy_keeps_the_record_and_takes_the_baselines_knobs(tmp_path: Path) -> None:
    baseline = {"batch_size": 8, "accum_steps": 2, "step_graph": False}
    record = {"check": {"baseline_config": baseline}, "speedup": 9.0}
    best = tmp_path / "best.yaml"
    best.write_text("# autotune verdict for study a: CERTIFIED, trial 3\n"
                    f"# autotune-check: {json.dumps(record)}\nbatch_size: 16\naccum_steps: 1\nstep_graph: true\n"
                    "lr: 0.003\n")
    knobs = regression_check.slowed_copy(best, tmp_path / "slowed.yaml")
    text = (tmp_path / "slowed.yaml").read_text()
    assert knobs == baseline
    assert "# autotune-check: " in text and "CERTIFIED" in text.splitlines()[0]
    assert "batch_size: 8\naccum_steps: 2\nstep_graph: false\nlr: 0.003" in text
    assert regression_check.slowed_copy(best, tmp_path / "s2.yaml", {"step_graph": False}) == {"step_graph": False}
    assert "batch_size: 16" in (tmp_path / "s2.yaml").read_text()
