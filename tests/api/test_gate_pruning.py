"""Gate arithmetic, pruning decisions on constructed curves, and the constrained sampler."""

from __future__ import annotations

import math
import statistics

import optuna
import pytest

from autotune.api.study.prune_rules import PruneRules, Reference, decide, loss_at
from autotune.api.study.samplers import CONSTRAINT_ATTR, make_sampler, stored_constraint
from autotune.contract.gate import FAILED_CONSTRAINT, BaselineStats, Estimate, Gate, constraint_value, is_feasible

# -- gate ---------------------------------------------------------------------------------


def test_gate_uses_abs_tol_when_seeds_agree() -> None:
    stats = BaselineStats.from_values([0.50, 0.50, 0.50])
    assert stats.std == 0.0
    assert Gate(abs_tol=0.01, k=2).threshold(stats) == pytest.approx(0.51)


def test_gate_widens_to_the_baselines_seed_spread() -> None:
    stats = BaselineStats.from_values([0.48, 0.50, 0.52])  # sample std 0.02
    assert stats.mean == pytest.approx(0.50) and stats.std == pytest.approx(0.02)
    assert Gate(abs_tol=0.01, k=2).threshold(stats) == pytest.approx(0.54)
    assert Gate(abs_tol=0.05, k=2).threshold(stats) == pytest.approx(0.55)  # abs_tol larger again


def test_gate_ignores_non_finite_seeds_and_needs_one() -> None:
    assert BaselineStats.from_values([0.5, math.nan]).n == 1
    with pytest.raises(ValueError, match="no finite quality value"):
        BaselineStats.from_values([math.nan])


def test_a_metric_to_maximize_gates_from_below() -> None:
    """quality_direction "maximize" (an accuracy): feasible iff q >= μ − max(abs_tol, k·σ)."""
    stats = BaselineStats.from_values([0.88, 0.90, 0.92])  # sample std 0.02
    gate = Gate(abs_tol=0.01, k=2)
    assert gate.threshold(stats, "maximize") == pytest.approx(0.86)
    assert constraint_value(0.87, 0.86, "maximize") == pytest.approx(-0.01)  # above the floor: feasible
    assert constraint_value(0.85, 0.86, "maximize") == pytest.approx(0.01)
    assert is_feasible(0.87, 0.86, "maximize") is True and is_feasible(0.85, 0.86, "maximize") is False
    assert is_feasible(0.85, 0.86) is True  # the same numbers, minimized
    assert constraint_value(None, 0.86, "maximize") == FAILED_CONSTRAINT
    with pytest.raises(ValueError, match="not one of minimize, maximize"):
        gate.threshold(stats, "bigger")


def test_constraint_value_and_feasibility() -> None:
    assert constraint_value(0.50, 0.51) == pytest.approx(-0.01)
    assert constraint_value(0.53, 0.51) == pytest.approx(0.02)
    assert constraint_value(None, 0.51) == FAILED_CONSTRAINT
    assert constraint_value(math.inf, 0.51) == FAILED_CONSTRAINT
    assert is_feasible(0.51, 0.51) is True and is_feasible(0.52, 0.51) is False
    assert is_feasible(None, 0.51) is False and is_feasible(0.3, None) is None


def test_estimate_confidence_interval() -> None:
    e = Estimate.from_values([100.0, 102.0, 98.0])
    assert e.mean == pytest.approx(100.0)
    assert e.low < 100.0 < e.high
    assert e.high - e.mean == pytest.approx(4.303 * 2.0 / math.sqrt(3), rel=1e-3)  # t(0.975, 2) · s / √n
    assert Estimate.from_values([5.0]).low == 5.0


# -- pruning ------------------------------------------------------------------------------

BASELINE = [(100, 1.0), (200, 0.8), (300, 0.6), (400, 0.5), (500, 0.45)]
BEST = [(100, 0.9), (200, 0.7), (300, 0.55), (400, 0.45), (500, 0.40)]
REF = Reference(best_feasible_throughput=1000.0, best_feasible_curve=BEST, baseline_curve=BASELINE,
                total_samples=500)


def test_loss_at_interpolates_within_the_curve() -> None:
    assert loss_at(BASELINE, 250) == pytest.approx(0.7)
    assert loss_at(BASELINE, 100) == pytest.approx(1.0)
    assert loss_at(BASELINE, 50) is None and loss_at(BASELINE, 600) is None


def test_nan_loss_prunes_at_once() -> None:
    d = decide([(100, math.nan)], [500.0], REF)
    assert d.prune and d.rule == "diverged" and "nan" in (d.reason or "")


def test_a_growing_loss_is_divergence() -> None:
    d = decide([(100, 0.5), (200, 0.4), (300, 1.5)], [900.0, 900.0], REF)
    assert d.prune and d.rule == "diverged"


def test_slow_and_no_better_cannot_reach_the_front() -> None:
    curve = [(100, 0.95), (200, 0.75)]  # worse than BEST at equal samples
    d = decide(curve, [300.0, 320.0], REF)  # median 310 < 0.5 × 1000
    assert d.prune and d.rule == "dominated" and "cannot reach the front" in (d.reason or "")


def test_slow_but_better_quality_is_kept() -> None:
    curve = [(100, 0.85), (200, 0.65)]  # better than BEST at equal samples: may be on the front
    assert not decide(curve, [300.0, 320.0], REF).prune


def test_the_objectives_decide_what_a_slow_trial_is_worth() -> None:
    better = [(100, 0.85), (200, 0.65)]  # better loss than BEST, and slow
    # throughput alone: a better loss cannot make it the fastest
    d = decide(better, [300.0, 320.0], REF, PruneRules(quality_counts=False))
    assert d.prune and d.rule == "dominated" and "only objective" in (d.reason or "")
    # quality alone: speed is no reason to stop it, whatever its loss
    worse = [(100, 0.95), (200, 0.75)]
    assert not decide(worse, [300.0, 320.0], REF, PruneRules(throughput_counts=False)).prune
    # through the service's rules: a study's objectives set both switches
    from autotune.api.study.pruning import rules_for
    from autotune.contract.protocol import StudySpec

    only_speed = rules_for(StudySpec(name="s", objectives=["throughput"]))
    assert (only_speed.throughput_counts, only_speed.quality_counts) == (True, False)
    both = rules_for(StudySpec(name="s"))
    assert (both.throughput_counts, both.quality_counts) == (True, True)


def test_fast_enough_is_kept_and_one_window_is_not_enough() -> None:
    curve = [(100, 0.95), (200, 0.75)]
    assert not decide(curve, [600.0, 620.0], REF).prune  # above rho × best
    assert not decide(curve[:1], [300.0], REF).prune  # one window is not stable yet


def test_loss_far_above_the_baseline_predicts_a_gate_failure() -> None:
    fast = [(100, 1.2), (200, 1.25), (300, 1.3)]  # fast (not dominated) but 117 % above baseline at 300
    d = decide(fast, [5000.0, 5000.0, 5000.0], REF)
    assert d.prune and d.rule == "gate" and "predicts a gate failure" in (d.reason or "")
    # the same curve before min_fraction of the budget is not judged yet
    assert not decide(fast[:1], [5000.0], REF, PruneRules(min_fraction=0.3)).prune


def test_no_reference_yet_keeps_everything_but_nan() -> None:
    assert not decide([(100, 5.0), (200, 4.0)], [1.0, 1.0], Reference()).prune


# -- the constrained sampler --------------------------------------------------------------


def _synthetic_study(seed: int, n_trials: int, constrained: bool = True) -> list[bool]:
    """A synthetic tuning problem shaped like ours, with a known infeasible region.

    Throughput grows with batch size, reduced precision and workers; NRMSE grows with batch
    size and fp16 breaks it. Infeasible (NRMSE above 0.16): batch >= 128, or fp16 — the
    fastest corner of the space, so an unconstrained search is drawn into it. Returns per
    trial whether it landed in the infeasible region.
    """
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = make_sampler("tpe", seed=seed, constraints_func=stored_constraint if constrained else None)
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=sampler)
    infeasible = []
    for _ in range(n_trials):
        trial = study.ask()
        batch = trial.suggest_categorical("batch", [8, 16, 32, 64, 128, 256])
        precision = trial.suggest_categorical("precision", ["fp32", "bf16", "fp16"])
        workers = trial.suggest_categorical("workers", [0, 2, 4, 8])
        throughput = batch**0.5 * (1.0 if precision == "fp32" else 1.5) * (1 + workers / 8)
        nrmse = 0.1 + 0.0005 * batch + (0.5 if precision == "fp16" else 0.0)
        violation = nrmse - 0.16
        trial.set_user_attr(CONSTRAINT_ATTR, violation)
        infeasible.append(violation > 0)
        study.tell(trial, [throughput, nrmse])
    return infeasible


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_constrained_sampler_lands_in_the_infeasible_region_less_often_as_it_learns(seed: int) -> None:
    """The default sampler learns the gate: fewer infeasible trials in a study's second half
    than in its first (which holds the random start-up trials)."""
    infeasible = _synthetic_study(seed, n_trials=60)
    first, second = sum(infeasible[:30]), sum(infeasible[30:])
    assert second < first, (first, second)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_gate_constraint_keeps_tpe_out_of_the_infeasible_region(seed: int) -> None:
    """Same problem, same seed: without the constraint the sampler lands there more often."""
    constrained = sum(_synthetic_study(seed, n_trials=60))
    unconstrained = sum(_synthetic_study(seed, n_trials=60, constrained=False))
    assert constrained < unconstrained, (constrained, unconstrained)


def test_unknown_sampler_is_refused() -> None:
    with pytest.raises(ValueError, match="allowed: tpe"):
        make_sampler("cmaes")


def test_rate_ci_is_the_inverted_interval_of_the_time_per_sample() -> None:
    rates = [7700.0, 7740.0, 7710.0, 7750.0, 6090.0, 7700.0, 7740.0, 7710.0]  # one epoch-boundary stall
    e = Estimate.for_rate(rates)
    assert e.mean == pytest.approx(statistics.harmonic_mean(rates))  # total work over total time
    assert e.mean < statistics.median(rates)  # the stall counts, as it does in a long run
    times = Estimate.from_values([1 / r for r in rates])
    assert (e.low, e.high) == (pytest.approx(1 / times.high), pytest.approx(1 / times.low))
    assert e.low <= e.mean <= e.high
    wild = Estimate.for_rate([1.0, 1000.0])  # the time interval reaches 0: bounded by the fastest window
    assert wild.high == 1000.0 and wild.low <= wild.mean
    with pytest.raises(ValueError, match="positive"):
        Estimate.for_rate([0.0, 1.0])


def test_default_baseline_is_the_research_starting_point() -> None:
    from autotune.contract.config import parse_config
    from autotune.contract.protocol import StudySpec

    gpu = StudySpec(name="g", space="h100", hardware="NVIDIA H100 80GB HBM3", preset="full").baseline_config()
    assert gpu == {"num_workers": 8, "prefetch_factor": 4}
    cfg = parse_config(gpu)  # fp32, no compile, no checkpointing, inverse losses every step by default
    assert (cfg.precision, cfg.compile, cfg.checkpoint, cfg.inverse_loss_frequency) == ("fp32", "none", "none", 1)
    assert StudySpec(name="c").baseline_config() == {}  # CPU: the loader stays in-process
    assert StudySpec(name="u", baseline={"batch_size": 8}).baseline_config() == {"batch_size": 8}


# --- the quality metric of a study (autotune.contract.protocol.StudySpec.quality, api/outcome.py) ----------


def _result(**overrides: object) -> dict[str, object]:
    return {"throughput_samples_per_s": 100.0, "quality": 1.5, "quality_metric": "val_loss",
            "quality_direction": "minimize", "failure": None, "stopped_early": False, **overrides}


def test_a_study_gates_on_its_workloads_metric() -> None:
    from autotune.contract.protocol import StudySpec

    ups = StudySpec(name="a", objectives=["throughput", "val_nrmse"])  # the old objective name still works
    assert ups.objectives == ["throughput", "quality"] and ups.quality_metric == "val_nrmse"
    assert ups.objective_metric_names() == ["throughput_samples_per_s", "val_nrmse"]
    gpt = StudySpec(name="b", workload="gpt")
    assert (gpt.quality_metric, gpt.quality_direction) == ("val_loss", "minimize")
    assert gpt.objective_metric_names() == ["throughput_samples_per_s", "val_loss"]
    acc = StudySpec(name="c", quality={"metric": "val_accuracy", "direction": "maximize"})
    assert acc.objective_directions() == ["maximize", "maximize"]
    # a spec stored before quality existed reads back as the ups NRMSE
    old = StudySpec.model_validate({"name": "d", "objectives": ["throughput", "val_nrmse"]}, context={"stored": True})
    assert old.quality is None and old.quality_metric == "val_nrmse" and old.quality_direction == "minimize"


def test_the_outcome_reads_the_generic_quality_and_refuses_another_metric() -> None:
    from autotune.api.outcome import probe_outcome
    from autotune.contract.protocol import StudySpec

    gpt = StudySpec(name="b", workload="gpt")
    outcome = probe_outcome(_result(), gpt, "w", gate=1.6)
    assert outcome.state == "COMPLETE" and outcome.values == [100.0, 1.5]
    assert outcome.attrs["quality"] == 1.5 and outcome.attrs["quality_metric"] == "val_loss"
    assert outcome.attrs[CONSTRAINT_ATTR] == pytest.approx(-0.1)
    wrong = probe_outcome(_result(quality_metric="val_nrmse"), gpt, "w", gate=1.6)
    assert wrong.attrs["failure_kind"] == "error" and "quality: {metric: val_nrmse}" in wrong.attrs["failure_message"]
    assert wrong.state == "FAIL" and wrong.values is None  # nothing usable was measured: no placeholder values
    flipped = probe_outcome(_result(quality_direction="maximize"), gpt, "w", gate=1.6)
    assert flipped.attrs["failure_kind"] == "error" and "direction: maximize" in flipped.attrs["failure_message"]
    # an older worker sends val_nrmse only: it still counts for an NRMSE study
    ups = StudySpec(name="a")
    legacy = probe_outcome({"throughput_samples_per_s": 5.0, "val_nrmse": 0.2, "failure": None}, ups, "w")
    assert legacy.values == [5.0, 0.2] and legacy.attrs["quality_metric"] == "val_nrmse"
    acc = StudySpec(name="c", quality={"metric": "val_accuracy", "direction": "maximize"})
    above = probe_outcome(_result(quality=0.9, quality_metric="val_accuracy", quality_direction="maximize"), acc,
                          "w", gate=0.86)
    assert above.attrs[CONSTRAINT_ATTR] == pytest.approx(-0.04)  # above the floor: feasible
