"""remeasure.larger_batch_quality: a config with a larger effective batch than the baseline's trails
the baseline's loss over a short probe (fewer optimizer steps over the same samples) and catches up
with training length. With "remeasure", the gate's refusal at the search's budget does not end it:
it is re-measured (when faster than every candidate) and judged on quality at the re-measure budget,
and the loss-margin pruner leaves it alone. Planted truth through the service (fake ProbeResults
over the API): a true larger-batch win is certified only under "remeasure"; one that stays worse at
the long budget is rejected there too."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from service_helpers import StudyFactory, complete, lease, probe_result

from autotune.api.study.recommendation import DEFERRED_NOTE
from autotune.api.study.trials import batch_per_step
from autotune.contract.protocol import RemeasureSpec

SAMPLES, FACTOR = 1024, 8
SPACE = {"params": {"batch_size": {"choices": [8, 32]}}, "fixed": {"accum_steps": 1}}


def _study(make_study: StudyFactory, larger_batch_quality: str) -> None:
    make_study("s", n_trials=4, baseline_seeds=3, seed=0, space=SPACE, baseline={"batch_size": 8, "accum_steps": 1},
               starting_points=[{"batch_size": 32}], sampler="random", probe={"samples": SAMPLES},
               remeasure={"top_k": 1, "samples_factor": FACTOR, "max_rounds": 4,
                          "larger_batch_quality": larger_batch_quality})


Answer = Callable[[dict[str, Any], bool, float], tuple[float, float]]  # (lease, long budget, noise) -> speed, quality


def _answer_until_finished(client: TestClient, answer: Answer) -> list[dict[str, Any]]:
    """Lease and complete every trial until the study finishes, each with `answer`'s throughput and
    quality for its config (told whether it ran at the re-measure budget, and a noise z); the leases."""
    noise = itertools.cycle([-1.0, 1.0, 0.3, -0.3, 0.8, -0.8])
    leases: list[dict[str, Any]] = []
    for i in itertools.count():
        assert i < 100, "the study did not finish"
        got = lease(client, "w")  # one worker: a round runs on the worker that started it
        if got is None:
            if client.get("/v1/studies/s").json()["state"] == "finished":
                return leases
            continue
        throughput, quality = answer(got, (got["probe"]["samples"] or 0) >= SAMPLES * FACTOR, next(noise))
        complete(client, got, "w", throughput=throughput, nrmse=quality)
        leases.append(got)
    raise AssertionError("unreachable")


def _drive(client: TestClient, long_quality_gap: float) -> list[dict[str, Any]]:
    """Batch 32 runs twice as fast as batch 8; at the search's samples its quality is 0.1 worse than
    the baseline's (the gate refuses it), at the re-measure budget `long_quality_gap` worse."""
    def answer(got: dict[str, Any], long: bool, z: float) -> tuple[float, float]:
        big = got["config"]["batch_size"] == 32
        gap = (long_quality_gap if long else 0.1) if big else 0.0
        return (200.0 if big else 100.0) * math.exp(0.02 * z), 0.1 + 0.002 * z + gap

    return _answer_until_finished(client, answer)


def test_a_larger_batch_the_gate_refused_is_judged_at_the_remeasure_budget_and_certified(
        client: TestClient, make_study: StudyFactory) -> None:
    _study(make_study, "remeasure")
    leases = _drive(client, long_quality_gap=0.0)
    big = [g for g in leases if g["config"]["batch_size"] == 32]
    assert {g["probe"]["samples"] for g in big} == {SAMPLES, SAMPLES * FACTOR}  # searched, then re-measured long
    best = client.get("/v1/studies/s/best").json()
    assert best["certified"] is True and best["outcome"] == "certified"
    assert best["config"]["batch_size"] == 32 and best["speedup"] == pytest.approx(2.0, rel=0.1)
    assert best["quality_budget"] == "remeasure"
    assert best["search_quality"] > best["search_gate_quality"]  # the search's gate refused it
    row = next(r for r in best["configs"] if r["trial_number"] == best["trial_number"])
    assert row["status"] == "certified" and row["reason"].startswith(DEFERRED_NOTE)
    assert any("judged at the re-measure budget" in c and "refused it" in c for c in best["caveats"])
    assert any("check it at your own run's length" in c for c in best["caveats"])


def test_by_default_the_gate_at_the_search_budget_decides_and_nothing_is_remeasured(
        client: TestClient, make_study: StudyFactory) -> None:
    _study(make_study, "search")
    leases = _drive(client, long_quality_gap=0.0)
    assert not [g for g in leases if g["role"] == "remeasure"]  # no feasible candidate: nothing to re-measure
    best = client.get("/v1/studies/s/best").json()
    assert best["certified"] is False and best["outcome"] == "no_win" and best["config"]["batch_size"] == 8
    assert "none passed the quality gate" in best["reason"]


def test_a_larger_batch_still_worse_at_the_remeasure_budget_is_rejected(
        client: TestClient, make_study: StudyFactory) -> None:
    _study(make_study, "remeasure")
    _drive(client, long_quality_gap=0.05)
    best = client.get("/v1/studies/s/best").json()
    assert best["certified"] is False and best["outcome"] == "no_win" and best["config"]["batch_size"] == 8
    row = next(r for r in best["configs"] if r["role"] == "candidate")
    assert row["config"]["batch_size"] == 32 and row["status"] == "rejected"
    assert row["reason"].startswith(DEFERRED_NOTE) and "quality worse" in row["reason"]


def test_a_larger_batch_left_undecided_says_where_its_quality_was_judged_once_and_what_would_decide_it(
        client: TestClient, make_study: StudyFactory) -> None:
    _study(make_study, "remeasure")
    _drive(client, long_quality_gap=0.004)  # inside the margin 0.01 on average, not yet bounded there in 4 rounds
    best = client.get("/v1/studies/s/best").json()
    assert best["outcome"] == "undecided" and best["config"]["batch_size"] == 8
    reason = best["reason"]
    assert reason.startswith("no config was certified within the re-measure budget (4 rounds of at most 4). "
                             "The fastest undecided, trial "), reason
    assert ": its val_nrmse was not shown no worse; speedup 2." in reason, reason
    assert reason.count("judged at the re-measure budget") == 1 and "(refused" not in reason, reason
    assert reason.endswith("Keep the baseline config, or raise remeasure.max_rounds, or widen gate.abs_tol if a "
                           "val_nrmse difference of +0.0053 is acceptable to you"), reason


def _report(client: TestClient, got: dict[str, Any], worker: str, step: int, samples: float, loss: float) -> bool:
    body = {"worker_id": worker, "step": step, "metrics": {"samples": samples, "loss": loss, "throughput": 200.0}}
    r = client.post(f"/v1/trials/{got['trial_id']}/report", content=json.dumps(body),
                    headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    prune: bool = r.json()["prune"]
    return prune


@pytest.mark.parametrize("larger_batch_quality", ["search", "remeasure"])
def test_the_loss_margin_pruner_leaves_a_deferred_larger_batch_alone(
        client: TestClient, make_study: StudyFactory, larger_batch_quality: str) -> None:
    make_study("s", n_trials=6, baseline_seeds=1, seed=0, space=SPACE, baseline={"batch_size": 8, "accum_steps": 1},
               starting_points=[{"batch_size": 32}], sampler="random", probe={"samples": 1000},
               remeasure={"top_k": 1, "samples_factor": FACTOR, "larger_batch_quality": larger_batch_quality})
    base = lease(client, "w0")
    assert base is not None and base["role"] == "baseline"
    client.post(f"/v1/trials/{base['trial_id']}/complete", json={"worker_id": "w0", "result": {
        **probe_result(base["config"], throughput=100.0, nrmse=0.1),
        "loss_curve": [[100, 0.5], [500, 0.3], [1000, 0.2]]}}).raise_for_status()
    big = lease(client, "w1")
    assert big is not None and big["config"]["batch_size"] == 32
    # at 40 % of the samples its loss is twice the baseline's: the rule that predicts a gate failure
    pruned = _report(client, big, "w1", 1, 400, 0.7)
    assert pruned is (larger_batch_quality == "search")


def test_larger_batch_quality_remeasure_needs_a_longer_remeasure_budget() -> None:
    with pytest.raises(ValidationError, match="samples_factor to 8 or more"):
        RemeasureSpec(larger_batch_quality="remeasure")
    with pytest.raises(ValidationError, match="top_k ≥ 1, here 0"):
        RemeasureSpec(larger_batch_quality="remeasure", samples_factor=8, top_k=0)
    assert RemeasureSpec(larger_batch_quality="remeasure", samples_factor=8).larger_batch_quality == "remeasure"


def test_samples_per_step_come_from_the_config_or_the_preset() -> None:
    assert batch_per_step({"batch_size": 16, "accum_steps": 2}) == 32
    assert batch_per_step({"batch_size": 16, "accum_steps": None}, {"accum_steps": 4}) == 64
    unknown: list[Callable[[], int | None]] = [
        lambda: batch_per_step({"batch_size": 16}), lambda: batch_per_step(None),
        lambda: batch_per_step({"batch_size": True, "accum_steps": 1})]
    assert [f() for f in unknown] == [None, None, None]


@pytest.mark.parametrize(("sqrt_speedup", "remeasured"), [(2.02, "linear"), (2.4, "sqrt")])
def test_of_two_equally_fast_deferred_configs_the_one_nearer_the_gate_is_remeasured(
        client: TestClient, make_study: StudyFactory, sqrt_speedup: float, remeasured: str) -> None:
    """Two lr rules on one larger batch (top_k 1): the sqrt one measures 1 % faster but its search loss
    is further from the gate; within api.study.front.SCORE_TIE the linear one, nearer the gate, is
    re-measured. Clearly faster (20 %), the sqrt one is, whatever its search loss."""
    space = {"params": {"batch_size": {"choices": [8, 32]}, "lr_scaling": {"choices": ["linear", "sqrt"]}},
             "fixed": {"accum_steps": 1}}
    make_study("s", n_trials=7, baseline_seeds=3, seed=0, space=space,
               baseline={"batch_size": 8, "accum_steps": 1, "lr_scaling": "linear"}, starting_points="none",
               sampler="grid", probe={"samples": SAMPLES},
               remeasure={"top_k": 1, "samples_factor": FACTOR, "max_rounds": 2, "larger_batch_quality": "remeasure"})
    def answer(got: dict[str, Any], long: bool, z: float) -> tuple[float, float]:
        big, rule = got["config"]["batch_size"] == 32, got["config"].get("lr_scaling")
        speed = (sqrt_speedup if rule == "sqrt" else 2.0) if big else 1.0
        gap = ((0.3 if rule == "sqrt" else 0.1) if not long else 0.0) if big else 0.0
        return 100.0 * speed * math.exp(0.005 * z), 0.1 + 0.002 * z + gap

    leases = _answer_until_finished(client, answer)
    again = {g["config"]["lr_scaling"] for g in leases if g["role"] == "remeasure" and g["config"]["batch_size"] == 32}
    assert again == {remeasured}
