"""The wire views of trials (TrialInfo) for the API, the CLI and the report."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from autotune.api.study.feasibility import gate_quality, is_feasible
from autotune.api.study.front import remeasure_key
from autotune.api.study.pareto import front_values, pareto_front
from autotune.api.study.remeasure import remeasurement
from autotune.api.study.trials import (
    TrialRecord,
    attempt_of,
    baseline_target,
    completed,
    knob_config,
    may_retry,
    metric,
    quality_name,
    retried_as,
    retry_of,
    role,
    service_state,
)
from autotune.contract.protocol import OBJECTIVES, StudySpec
from autotune.contract.views import TrialInfo


def trial_info(trial: TrialRecord, spec: StudySpec, gate: float | None, retry: int | None = None,
               quality_metric: str | None = None, context: TrialContext | None = None) -> TrialInfo:
    """The wire view of `trial`; `retry`: the number of the trial that re-runs it (a lost trial);
    `quality_metric`: the study's metric name (default: `quality_name` of this trial); `context`:
    what the study's other trials say about it (its params when it is a baseline or a
    re-measurement, a re-measurement's gate, the baseline's config)."""
    name = quality_metric or quality_name(spec, [trial])
    quality = metric(trial, spec, "quality")
    attrs = trial.user_attrs
    failure = None
    if attrs.get("failure_kind"):
        failure = {"kind": str(attrs["failure_kind"]), "message": str(attrs.get("failure_message") or "")}
    config = attrs.get("config")
    remeasure_of = attrs.get("remeasure_of")
    starting_point = attrs.get("starting_point")
    repeat_of = attrs.get("repeat_of")
    prune_reason = attrs.get("prune_reason")
    feasible = is_feasible(trial, spec, gate)
    note = None
    params = trial.params
    base_repeat = None
    if context is not None:
        params = context.params(trial)
        base_repeat = context.baseline_repeat_of(trial)
        if role(trial) == "remeasure" and trial.finished:
            feasible, note = context.remeasure_feasibility(trial, spec)
    measured = [metric(trial, spec, OBJECTIVES[o][0]) for o in spec.objectives]
    return TrialInfo(
        trial_id=trial.trial_id, number=trial.number, state=service_state(trial), params=params,
        config=config if isinstance(config, dict) else None,
        values=measured if completed(trial) and all(v is not None for v in measured) else None,  # type: ignore[arg-type]
        throughput_samples_per_s=metric(trial, spec, "throughput_samples_per_s"),
        val_nrmse=quality if name == "val_nrmse" else None, quality=quality, quality_metric=name,
        energy_j_per_sample=metric(trial, spec, "energy_j_per_sample"), feasible=feasible, failure=failure,
        worker_id=attrs.get("worker_id"), is_baseline=role(trial) == "baseline", role=role(trial),  # type: ignore[arg-type]
        prune_reason=str(prune_reason) if prune_reason else None,
        remeasure_of=int(remeasure_of) if isinstance(remeasure_of, int) else None,
        remeasure_round=key[1] if (key := remeasure_key(trial)) else None,
        starting_point=starting_point if isinstance(starting_point, int) else None,
        warm_start_from=str(attrs["warm_start_from"]) if attrs.get("warm_start_from") else None,
        repeat_of=repeat_of if isinstance(repeat_of, int) else None, baseline_repeat_of=base_repeat,
        feasibility_note=note, duration_s=trial.duration_s,
        attempt=attempt_of(trial), retry_of=retry_of(trial), retried_as=retry,
        to_rerun=retry is None and may_retry(spec, trial),
    )


class TrialContext:
    """What a trial's view needs from the rest of its study: the params a baseline or a
    re-measurement stands for (the search's knobs, from its config or its target's), the gate at
    the re-measure budget, and the baseline's config (a search trial that drew it)."""

    def __init__(self, spec: StudySpec, trials: Sequence[TrialRecord], gate: float | None) -> None:
        self._trials = trials
        self._by_number = {t.number: t for t in trials}
        self._names = sorted({k for t in trials if role(t) == "search" for k in t.params})
        self._base = baseline_target(trials)
        self._base_config = knob_config(self._base) if self._base is not None else None
        self._rm = remeasurement(spec, trials, gate) if any(role(t) == "remeasure" for t in trials) else None

    def params(self, trial: TrialRecord) -> dict[str, Any]:
        if role(trial) == "remeasure":
            target = self._by_number.get(trial.user_attrs.get("remeasure_of", -1))
            if target is not None and role(target) == "search":
                return dict(target.params)
        if role(trial) != "search" and not trial.params:  # stored before the bridge set them
            config = trial.user_attrs.get("config")
            if isinstance(config, dict):
                return {k: config[k] for k in self._names if k in config}
        return dict(trial.params)

    def baseline_repeat_of(self, trial: TrialRecord) -> int | None:
        if role(trial) != "search" or self._base is None or self._base_config is None:
            return None
        return self._base.number if knob_config(trial) == self._base_config else None

    def remeasure_feasibility(self, trial: TrialRecord, spec: StudySpec) -> tuple[bool | None, str | None]:
        """A re-measurement's feasibility: its config's quality as the verdict judged it at this
        budget (against the baseline's runs there), None while undecided."""
        rm = self._rm
        if not completed(trial):
            return False, None
        of = trial.user_attrs.get("remeasure_of")
        if rm is None or not isinstance(of, int):
            return None, "not judged yet"
        if of == rm.baseline:
            return True, "the baseline's own run at the judged budget"
        judged = rm.judged(spec, of)
        status = rm.status.get(of, "undecided")
        if judged is None:
            return None, f"quality not yet decided by the verdict (trial {of}: {status})"
        side = "no worse than" if judged else "worse than"
        return judged, f"judged by the verdict: quality {side} the baseline's at this budget (trial {of}: {status})"


def trial_infos(trials: Sequence[TrialRecord], spec: StudySpec, all_trials: Sequence[TrialRecord] | None = None
                ) -> list[TrialInfo]:
    """Views of `trials`; the gate comes from `all_trials` (default: `trials`)."""
    every = all_trials if all_trials is not None else trials
    gate = gate_quality(spec, every)
    links = retried_as(every)
    name = quality_name(spec, every)
    context = TrialContext(spec, every, gate)
    return [trial_info(t, spec, gate, links.get(t.number), name, context) for t in trials]


def front_infos(trials: Sequence[TrialRecord], spec: StudySpec) -> list[TrialInfo]:
    """The front's trials (`pareto_front`), each shown at the values the front was computed on:
    a re-measured config at its re-measured throughput and quality."""
    values = front_values(spec, trials)
    names = [OBJECTIVES[o][0] for o in spec.objectives]
    infos = []
    for info in trial_infos(pareto_front(trials, spec), spec, all_trials=trials):
        point = dict(zip(names, values[info.number], strict=True))
        update: dict[str, Any] = {"values": values[info.number]}
        if "throughput_samples_per_s" in point:
            update["throughput_samples_per_s"] = point["throughput_samples_per_s"]
        if "energy_j_per_sample" in point:
            update["energy_j_per_sample"] = point["energy_j_per_sample"]
        if "quality" in point:
            update["quality"] = point["quality"]
            if info.quality_metric == "val_nrmse":
                update["val_nrmse"] = point["quality"]
        infos.append(info.model_copy(update=update))
    return infos
