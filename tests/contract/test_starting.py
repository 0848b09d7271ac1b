"""Starting points (autotune.contract.starting): the fast stack derived from a baseline and a space,
and the validation of a user's own points."""

from __future__ import annotations

from typing import Any

import pytest

from autotune.contract.config import parse_config
from autotune.contract.space import SpaceError, load_space, parse_space
from autotune.contract.starting import MAX_POINTS, auto_points, check_points, resolve

# what the ups full preset's baseline probe reports as its effective config (the preset's 12 × 4)
UPS_FULL_BASELINE: dict[str, Any] = {
    "precision": "fp32", "cudnn_benchmark": False, "checkpoint": "none", "compile": "none",
    "fused_optimizer": False, "batch_size": 12, "accum_steps": 4, "num_workers": 8, "prefetch_factor": 4,
    "pin_memory": False, "persistent_workers": False, "inverse_loss_frequency": 1, "lr": 0.0005}
FAST = {"precision": "bf16", "fused_optimizer": True, "compile_optimizer": True, "cudnn_benchmark": True,
        "checkpoint": "none", "batch_size": 48, "accum_steps": 1, "num_workers": 8, "prefetch_factor": 4,
        "persistent_workers": True}


def test_fast_stack_for_the_h100_space() -> None:
    points = auto_points(load_space("h100"), UPS_FULL_BASELINE)
    assert points == [
        {**FAST, "compile": "default", "step_graph": True, "inverse_loss_frequency": 4},
        {**FAST, "compile": "reduce-overhead", "inverse_loss_frequency": 4},
        {**FAST, "compile": "reduce-overhead", "inverse_loss_frequency": 1},
        {**FAST, "compile": "default", "step_graph": False, "inverse_loss_frequency": 4},
    ]
    for point in points:  # every point is a config the space could draw, passing the knob rules
        parse_config({**load_space("h100").fixed, **point})


def test_persistent_workers_only_where_the_baseline_has_workers() -> None:
    points = auto_points(load_space("h100"), {**UPS_FULL_BASELINE, "num_workers": 0})
    assert points and all(p["num_workers"] == 0 and "persistent_workers" not in p for p in points)
    for point in points:
        parse_config({**load_space("h100").fixed, **point})


@pytest.mark.parametrize(("batch", "accum", "want"), [
    (12, 4, (48, 1)),  # folded into one micro-batch
    (96, 4, (192, 2)),  # 384 > the largest micro-batch: the least accumulation that keeps the product
    (24, 1, (24, 1)),  # nothing to fold
])
def test_accumulation_folds_into_the_micro_batch(batch: int, accum: int, want: tuple[int, int]) -> None:
    points = auto_points(load_space("h100"), {**UPS_FULL_BASELINE, "batch_size": batch, "accum_steps": accum})
    assert {(p["batch_size"], p["accum_steps"]) for p in points} == {want}


@pytest.mark.parametrize(("batch", "accum", "want"), [
    (16, 2, (24, 1)),  # 32 is no product of 12, 24, 48 and 1, 2: the largest below it, least accumulation
    (10, 1, None),  # nothing at or below 10: the sampler draws the batch (the baseline's accumulation kept)
])
def test_an_effective_batch_the_space_cannot_make_folds_below_it(batch: int, accum: int,
                                                                  want: tuple[int, int] | None) -> None:
    space = parse_space({"name": "s", "params": {
        "batch_size": {"choices": [12, 24, 48]}, "accum_steps": {"choices": [1, 2]},
        "compile": {"choices": ["none", "default"]}}})
    points = auto_points(space, {"batch_size": batch, "accum_steps": accum, "compile": "none"})
    assert points
    got = {(p.get("batch_size"), p.get("accum_steps")) for p in points}
    assert got == {want if want else (None, accum)}


def test_the_h100_space_keeps_the_gpt_full_baselines_batch() -> None:
    # the gpt full preset's 16 × 2: its fast stack runs 32 × 1, the baseline's effective batch
    points = auto_points(load_space("h100"), {**UPS_FULL_BASELINE, "batch_size": 16, "accum_steps": 2})
    assert {(p["batch_size"], p["accum_steps"]) for p in points} == {(32, 1)}


def test_values_the_space_lacks_are_left_to_the_sampler() -> None:
    space = parse_space({"name": "s", "params": {
        "batch_size": {"choices": [16, 32]}, "compile": {"choices": ["none", "default"]},
        "num_workers": {"choices": [0, 2]}, "prefetch_factor": {"choices": [2, 4], "when": {"num_workers": [2]}}}})
    points = auto_points(space, {"batch_size": 12, "accum_steps": 4, "compile": "none", "num_workers": 8,
                                 "prefetch_factor": 4})
    # batch 48 and 8 workers are not in the space (nor is prefetch, whose condition then is open),
    # reduce-overhead neither: the one point left is compile default; the rest is drawn
    assert points == [{"compile": "default"}]


def test_no_point_repeats_the_baseline() -> None:
    space = parse_space({"name": "s", "params": {"precision": {"choices": ["fp32", "bf16"]}}})
    assert auto_points(space, {"precision": "bf16"}) == []
    assert auto_points(space, {"precision": "fp32"}) == [{"precision": "bf16"}]


def test_auto_only_for_gpu_studies_with_a_model_based_sampler() -> None:
    space = load_space("h100")
    assert len(resolve("auto", space, UPS_FULL_BASELINE, "NVIDIA H100 80GB HBM3", "tpe")) == 4
    assert resolve("auto", space, UPS_FULL_BASELINE, "NVIDIA H100 80GB HBM3", "random") == []
    assert resolve("auto", space, UPS_FULL_BASELINE, "cpu", "tpe") == []
    assert resolve("none", space, UPS_FULL_BASELINE, "NVIDIA H100 80GB HBM3", "tpe") == []
    mine = [{"compile": "default", "batch_size": 96}]
    assert resolve(mine, space, UPS_FULL_BASELINE, "cpu", "random") == mine


@pytest.mark.parametrize(("points", "field", "fix"), [
    ({"compile": "default"}, "starting_points", "a list"),
    ([{"lr": 0.001}], "starting_points[0].lr", "not a parameter of the space"),
    ([{"compile": "default"}, {"batch_size": 100}], "starting_points[1].batch_size", "use one of [12, 16, 24"),
    ([{}], "starting_points[0]", "non-empty mapping"),
    ([{"persistent_workers": True}], "starting_points[0].persistent_workers", "num_workers"),
    ([{"compile": "default"}] * (MAX_POINTS + 1), "starting_points", f"at most {MAX_POINTS}"),
])
def test_bad_points_are_named(points: Any, field: str, fix: str) -> None:
    with pytest.raises(SpaceError) as e:
        check_points(load_space("h100"), points)
    assert e.value.field == field and fix in e.value.message


def test_the_trials_table_names_the_starting_points() -> None:
    from rich.console import Console

    from autotune.cli.tables import trials_table
    from autotune.contract.views import TrialInfo

    trials = [TrialInfo(trial_id=1, number=1, state="COMPLETE", params={"compile": "reduce-overhead"},
                        starting_point=0),
              TrialInfo(trial_id=2, number=2, state="COMPLETE", params={"compile": "none"})]
    console = Console(width=200, record=True)
    console.print(trials_table(trials, "t"))
    lines = console.export_text().splitlines()
    assert any("starting point 1" in line and line.startswith("│ 1 ") for line in lines)
    assert any(line.startswith("│ 2 ") and "starting point" not in line for line in lines)
