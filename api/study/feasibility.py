"""The quality gate over the baseline seeds, and each trial's feasibility (quality and memory)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from autotune.api.study.trials import (
    GIB,
    TrialRecord,
    baselines,
    completed,
    finite,
    first_attempts,
    metric,
    retries,
    service_state,
)
from autotune.contract.gate import BaselineStats, Gate
from autotune.contract.gate import is_feasible as gate_feasible
from autotune.contract.protocol import StudySpec


@dataclass(frozen=True)
class BaselineSummary:
    quality: BaselineStats | None  # the baseline seeds' quality metric
    throughput: float | None  # mean over the completed seeds
    finished: bool  # every baseline seed has finished
    failures: list[str]


def baseline_summary(spec: StudySpec, trials: Sequence[TrialRecord]) -> BaselineSummary:
    """The baseline seeds' results. `finished` once every seed has run and none is running or
    lost with a retry still to come (the gate must not be set from fewer seeds than it will have)."""
    state = retries(spec, trials)
    seeds = baselines(trials)
    runs = [t for t in seeds if not state.superseded(t)]
    done = [t for t in runs if completed(t)]
    nrmses = [v for t in done if (v := metric(t, spec, "quality")) is not None]
    thrs = [v for t in done if (v := metric(t, spec, "throughput_samples_per_s")) is not None]
    failures = [f"trial {t.number}: {service_state(t)}"
                + (f" ({t.user_attrs.get('failure_kind')}: {t.user_attrs.get('failure_message')})"
                   if t.user_attrs.get("failure_kind") else "") for t in runs if t.finished and not completed(t)]
    return BaselineSummary(quality=BaselineStats.from_values(nrmses) if nrmses else None,
                           throughput=statistics.fmean(thrs) if thrs else None,
                           finished=len(first_attempts(seeds)) >= spec.baseline_seeds
                           and all(state.settled(t) for t in runs),
                           failures=failures)


def gate_quality(spec: StudySpec, trials: Sequence[TrialRecord]) -> float | None:
    """The worst quality a feasible trial may have (the largest when minimizing, the smallest
    when maximizing); None until every baseline seed has finished (or when none completed)."""
    summary = baseline_summary(spec, trials)
    if not summary.finished or summary.quality is None:
        return None
    return Gate(spec.gate.abs_tol, spec.gate.k).threshold(summary.quality, spec.quality_direction)


gate_nrmse = gate_quality  # the name from before quality was generalised (api/service.py and api/studies.py use it)


def fits_memory(trial: TrialRecord, spec: StudySpec) -> bool:
    peak = finite(trial.user_attrs.get("peak_mem_reserved_bytes"))
    return spec.max_memory_gb is None or peak is None or peak / GIB <= spec.max_memory_gb


def is_feasible(trial: TrialRecord, spec: StudySpec, gate: float | None) -> bool | None:
    """True/False once both the gate and the trial's outcome are known, else None."""
    if gate is None or not trial.finished:
        return None
    quality = metric(trial, spec, "quality")
    return (completed(trial) and bool(gate_feasible(quality, gate, spec.quality_direction))
            and fits_memory(trial, spec))
