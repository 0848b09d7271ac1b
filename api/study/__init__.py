"""The study's logic, in one package: roles, retries, the gate, candidates, the re-measurement,
the front, the verdict, and the wire views. Pure functions over a study's trials.

    trials          roles, states, retries, measurements, baselines
    feasibility     the quality gate and each trial's feasibility
    front           candidates and their ranking
    remeasure       the verdict's rounds (the rule: autotune/contract/verdict.py)
    pareto          the front at re-measured values
    recommendation  the verdict: the certified pick, or keep the baseline
    views           TrialInfo for the API, the CLI and the report
    pruning, prune_rules   early stopping of running trials
    samplers        the Optuna samplers, the gate as their constraint

Roles (user attr ``role``): the study's first `baseline_seeds` trials are *baseline* runs of
the user's config (probe seeds seed, seed+1, …), then *search* trials, then, once the search
is done, *remeasure* trials (user attrs ``remeasure_of``: the trial number re-measured, and
``remeasure_round``: 0, 1, …), the verdict's rounds (`remeasurement`).

Retries: a trial *lost* with its worker (Optuna FAIL, failure_kind "lost": the reaper saw no
heartbeat) is re-run as a new trial of the same role, config and probe, carrying user attrs
``retry_of`` (the lost trial's number) and ``attempt`` (2, 3, …), up to spec.max_retries
times. Everything about retries is derived from those attrs (`retries`): a lost trial that
has a retry is *superseded* (its retry stands for it: it is left out of the counts, the
failures and the baseline), one that may still be retried is *pending*, and the phases
wait for pending ones as for running ones. Retries are not configurations: the study's
budget (n_trials) counts first attempts only.

Gate (autotune.contract.gate): a completed trial is feasible iff its quality q (the study's metric:
val_nrmse for ups, val_loss for gpt, `StudySpec.quality_metric`) is within the gate,
q ≤ μ + max(abs_tol, k·σ) over the baseline seeds' q (q ≥ μ − max(...) for a metric to
maximize), and, with max_memory_gb, its peak reserved memory fits. Until every baseline has
finished, feasibility is unknown (None). `quality_name` is the metric's name shown to users
(the spec's, else the one the trials reported): a language model's loss is never called NRMSE.

Failed probes are Optuna FAIL (api/outcome.py), draws that repeat a config PRUNED with
repeat_of; every view here reads `service_state` (FAIL, REPEAT).

Candidates and the front (one definition everywhere: API, CLI, report, YAML; Optuna holds
every trial's own measurement and the verdict beside them): the *candidates* are the feasible search trials that ran,
less any whose config is the baseline's (`baseline_repeat_of`: the user's own config drawn
again measures the baseline, it is not a finding). Baseline seeds are the reference, never a
candidate. The front is the non-dominated candidates, each at its re-measured value where
one exists (`front_values`).

The verdict (`remeasurement`, `recommend`; the rule is autotune/contract/verdict.py, the reasoning
docs/measurement.md "The verdict"): once the search is done, the top_k distinct candidates and
the baseline are re-measured in sequential, interleaved rounds until each candidate is
certified (faster beyond the noise and no worse) or rejected, or the round limit is reached.
A candidate's runs are its re-measurements; the baseline's are its re-measurements and, at
the search's budget (samples_factor 1), its seeds. The recommendation is the fastest
certified candidate; without one it is the baseline's own config (certified False) with the
fastest uncertified candidate beside it. Throughputs are geometric means over runs. There is
no recommendation while the verdict runs; with re-measurement off (remeasure.top_k 0)
nothing is judged (outcome not_judged).

Energy (the objective "energy": GPU joules per sample over the probe's timed windows, the
user attr ``energy_j_per_sample``): the front and the values Optuna holds take it like any
objective (a re-measured candidate's energy is the mean over its rounds: every round trains
the same samples). What picks the recommendation (`chosen_by`): throughput whenever it is an
objective (``[throughput, quality, energy]`` recommends the fastest, as without energy), the
lowest energy per sample when energy is and throughput is not (``[energy, quality]``): then
the top_k candidates by lowest energy are re-measured with the baseline, the verdict judges
energy per sample (lower is better) in place of throughput, and the pick is the certified
candidate with the lowest energy per sample. Whenever the pick and the baseline measured
energy, the recommendation carries both, their ratio (pick over baseline: below 1 uses less
energy per sample) with a Welch 95 % interval over runs (`_energy_ratio`), and a sentence on
it (`energy_verdict`); an energy-picked recommendation's speedup is the ratio of geometric-mean
throughputs, without an interval. ConfigVerdict's speedup fields hold the judged metric's
ratio: the energy ratio in an energy-picked study.
"""

from __future__ import annotations

from autotune.api.study.feasibility import baseline_summary, gate_nrmse, gate_quality, is_feasible
from autotune.api.study.front import candidates, chosen_by, remeasure_key, search_done
from autotune.api.study.pareto import front_values, pareto_front
from autotune.api.study.recommendation import NoRecommendation, baseline_failed_message, recommend, verdict_rows
from autotune.api.study.remeasure import Remeasurement, remeasurement
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
    "verdict_rows",
]
