"""The study's logic, in one package: pure functions over a study's trials.

    trials          roles, states, retries, measurements, baselines
    feasibility     the quality gate and each trial's feasibility
    front           candidates and their ranking
    remeasure       the verdict's rounds (the rule: autotune/contract/verdict.py)
    pareto          the front at re-measured values
    recommendation  the verdict: the certified pick, or keep the baseline
    views           TrialInfo for the API, the CLI and the report
    pruning, prune_rules   early stopping of running trials
    samplers        the Optuna samplers, the gate as their constraint

Roles (user attr ``role``): baseline seeds, then search trials, then the verdict's remeasure
rounds. A trial lost with its worker is re-run as a new trial (user attrs ``retry_of``,
``attempt``); retries do not count toward n_trials. The reasoning: docs/measurement.md.
"""

from __future__ import annotations

from autotune.api.study.feasibility import baseline_summary, gate_nrmse, gate_quality, is_feasible
from autotune.api.study.front import candidates, chosen_by, remeasure_key, search_done
from autotune.api.study.pareto import front_values, pareto_front
from autotune.api.study.recommendation import NoRecommendation, baseline_failed_message, recommend, verdict_rows
from autotune.api.study.remeasure import Remeasurement, remeasurement, unneeded
from autotune.api.study.trials import (
    TrialRecord,
    attempt_of,
    baseline_repeat_of,
    completed,
    counts_by_state,
    current,
    failures_by_kind,
    is_lost,
    is_repeat,
    may_retry,
    metric,
    quality_name,
    retried_as,
    retry_of,
    role,
    service_state,
)
from autotune.api.study.views import front_infos, trial_info, trial_infos

__all__ = [
    "NoRecommendation",
    "Remeasurement",
    "TrialRecord",
    "attempt_of",
    "baseline_failed_message",
    "baseline_repeat_of",
    "baseline_summary",
    "candidates",
    "chosen_by",
    "completed",
    "counts_by_state",
    "current",
    "failures_by_kind",
    "front_infos",
    "front_values",
    "gate_nrmse",
    "gate_quality",
    "is_feasible",
    "is_lost",
    "is_repeat",
    "may_retry",
    "metric",
    "pareto_front",
    "quality_name",
    "recommend",
    "remeasure_key",
    "remeasurement",
    "retried_as",
    "retry_of",
    "role",
    "search_done",
    "service_state",
    "trial_info",
    "trial_infos",
    "unneeded",
    "verdict_rows",
]
