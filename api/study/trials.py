"""A study's trials as the service reads them: roles, states, retries, measurements, baselines."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from autotune.api.outcome import PRESET_RAN_ATTR, attempt, lost, retriable
from autotune.contract.config import normalised
from autotune.contract.protocol import OBJECTIVES, StudySpec
from autotune.contract.views import LOST_TO_RERUN, UNNEEDED, stopped_unneeded

GIB = 2**30

FINISHED_STATES = ("COMPLETE", "FAIL", "PRUNED")


@dataclass(frozen=True)
class TrialRecord:
    """One Optuna trial, by value (user attrs with the measurement flattened in)."""

    trial_id: int
    number: int
    state: str  # TrialState name: RUNNING | WAITING | COMPLETE | PRUNED | FAIL
    params: dict[str, Any]
    values: list[float] | None
    user_attrs: dict[str, Any]
    datetime_start: datetime | None
    datetime_complete: datetime | None

    @property
    def finished(self) -> bool:
        return self.state in FINISHED_STATES

    @property
    def duration_s(self) -> float | None:
        if self.datetime_start is None or self.datetime_complete is None:
            return None
        return (self.datetime_complete - self.datetime_start).total_seconds()



def finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def role(trial: TrialRecord) -> str:
    value = trial.user_attrs.get("role")
    if value in ("baseline", "search", "remeasure"):
        return str(value)
    return "baseline" if trial.user_attrs.get("is_baseline") else "search"


def service_state(trial: TrialRecord) -> str:
    """The state the service shows: Optuna's, except REPEAT for a draw that repeated a config
    (PRUNED in Optuna, user attr repeat_of: never run), and FAIL for a failed probe that an
    older service stored as COMPLETE with worst-case values."""
    if trial.state == "COMPLETE" and trial.user_attrs.get("failure_kind"):
        return "FAIL"
    if trial.state == "PRUNED" and "repeat_of" in trial.user_attrs:
        return "REPEAT"
    return trial.state


def completed(trial: TrialRecord) -> bool:
    return service_state(trial) == "COMPLETE"


def is_lost(trial: TrialRecord) -> bool:
    """Failed not because of its config (api.outcome.lost): re-run by another worker (`may_retry`)."""
    return lost(trial.state, trial.user_attrs)


def attempt_of(trial: TrialRecord) -> int:
    """1 for a first run, k for the (k-1)-th retry of a lost trial."""
    return attempt(trial.user_attrs)


def retry_of(trial: TrialRecord) -> int | None:
    """The number of the lost trial this trial re-runs (None: a first attempt)."""
    value = trial.user_attrs.get("retry_of")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def may_retry(spec: StudySpec, trial: TrialRecord) -> bool:
    """A lost trial whose attempts are not used up (retried at most spec.max_retries times)."""
    return retriable(spec, trial.state, trial.user_attrs)


def retried_as(trials: Sequence[TrialRecord]) -> dict[int, int]:
    """Lost trial number → the number of the trial that re-runs it."""
    return {of: t.number for t in trials if (of := retry_of(t)) is not None}


@dataclass(frozen=True)
class Retries:
    """The study's lost trials and their retries, derived from the trials' user attrs."""

    retried_as: dict[int, int]  # superseded lost trial number → its retry's number
    pending: list[TrialRecord]  # lost trials to re-run that have no retry yet, by number

    def superseded(self, trial: TrialRecord) -> bool:
        return trial.number in self.retried_as

    def is_pending(self, trial: TrialRecord) -> bool:
        return any(p.number == trial.number for p in self.pending)

    def settled(self, trial: TrialRecord) -> bool:
        """Finished for good: finished, neither superseded by a retry nor waiting for one."""
        return trial.finished and not self.superseded(trial) and not self.is_pending(trial)


def retries(spec: StudySpec, trials: Sequence[TrialRecord]) -> Retries:
    links = retried_as(trials)
    pending = [t for t in trials if t.number not in links and may_retry(spec, t)]
    return Retries(retried_as=links, pending=sorted(pending, key=lambda t: t.number))


def current(trials: Sequence[TrialRecord]) -> list[TrialRecord]:
    """The trials that are not superseded by a retry (each configuration once)."""
    links = retried_as(trials)
    return [t for t in trials if t.number not in links]


def first_attempts(trials: Sequence[TrialRecord]) -> list[TrialRecord]:
    """The trials that are not retries: one per configuration the study handed out."""
    return [t for t in trials if retry_of(t) is None]


def metric(trial: TrialRecord, spec: StudySpec, name: str) -> float | None:
    """`name` (throughput_samples_per_s | quality | energy_j_per_sample) of a trial as its probe measured it: its user
    attr (quality: ``quality``, or ``val_nrmse`` of a trial stored before the generic field),
    else its objective value (a trial stored before the measurement attrs). None for a failed
    trial. The user attrs come first: an older service stored placeholder values in Optuna."""
    if trial.user_attrs.get("failure_kind"):
        return None
    if name == "val_nrmse":
        name = "quality"
    attr = trial.user_attrs.get(name)
    if name == "quality" and attr is None:
        attr = trial.user_attrs.get("val_nrmse")
    if attr is not None:
        return finite(attr)
    objective_names = [OBJECTIVES[o][0] for o in spec.objectives]
    if trial.values is not None and name in objective_names:
        return finite(trial.values[objective_names.index(name)])
    return None


def quality_name(spec: StudySpec, trials: Sequence[TrialRecord] = ()) -> str:
    """The study's quality metric name: the spec's, else the first one a trial reported (a
    plugin workload's spec may not know it), else "quality"."""
    if spec.quality_metric:
        return spec.quality_metric
    for t in trials:
        reported = t.user_attrs.get("quality_metric")
        if isinstance(reported, str) and reported and not t.user_attrs.get("failure_kind"):
            return reported
    return "quality"


def baselines(trials: Sequence[TrialRecord]) -> list[TrialRecord]:
    return [t for t in trials if role(t) == "baseline"]


def baseline_of(trials: Sequence[TrialRecord]) -> TrialRecord | None:
    """The first baseline trial."""
    return next(iter(baselines(trials)), None)


def counts_by_state(spec: StudySpec, trials: Sequence[TrialRecord]) -> dict[str, int]:
    """Trials by the state the service shows; a lost trial that was retried is left out (its
    retry counts for it), so each configuration counts once, and one whose retry is still to
    be leased counts as `LOST_TO_RERUN`, not as FAIL, and a re-measurement the verdict stopped
    as no longer needed (`unneeded`) as `UNNEEDED`, not as PRUNED."""
    counts: dict[str, int] = {}
    for t in current(trials):
        state = LOST_TO_RERUN if may_retry(spec, t) else service_state(t)
        if state == "PRUNED" and stopped_unneeded(t.user_attrs.get("prune_reason")):
            state = UNNEEDED
        counts[state] = counts.get(state, 0) + 1
    return counts


def failures_by_kind(spec: StudySpec, trials: Sequence[TrialRecord]) -> dict[str, int]:
    """Failed trials by kind; a lost trial that was retried, or will be, is not a failure of the study."""
    failures: dict[str, int] = {}
    for t in current(trials):
        if service_state(t) == "FAIL" and not may_retry(spec, t):
            kind = str(t.user_attrs.get("failure_kind") or "error")
            failures[kind] = failures.get(kind, 0) + 1
    return failures


def is_repeat(trial: TrialRecord) -> bool:
    """A draw that repeated a config measured, in flight or failed: never run (OptunaBridge.ask)."""
    return "repeat_of" in trial.user_attrs


def knob_config(trial: TrialRecord) -> dict[str, Any] | None:
    """The trial's config (the effective one once it ran), every knob normalised
    (`autotune.contract.config.normalised`); None without one."""
    config = trial.user_attrs.get("config")
    return normalised(config) if isinstance(config, dict) else None


def baseline_target(trials: Sequence[TrialRecord]) -> TrialRecord | None:
    """The baseline seed that stands for the baseline config: the first completed one."""
    return next((t for t in baselines(trials) if completed(t) and knob_config(t) is not None), None)


def baseline_repeat_of(trial: TrialRecord, trials: Sequence[TrialRecord]) -> int | None:
    """The baseline trial number when `trial` is a search trial whose config is the baseline's
    (a draw of the user's own config: a repeat of the baseline, never a candidate), else None."""
    if role(trial) != "search":
        return None
    base = baseline_target(trials)
    config = knob_config(trial)
    if base is None or config is None:
        return None
    return base.number if config == knob_config(base) else None


def batch_per_step(config: Mapping[str, Any] | None, preset: Mapping[str, Any] | None = None) -> int | None:
    """The samples one optimizer step trains on one GPU, batch_size × accum_steps, from a config
    (a knob it leaves null: `preset`'s value); None when either is not known."""
    if not isinstance(config, Mapping):
        return None

    def count(name: str) -> int | None:
        v = config.get(name) if config.get(name) is not None else (preset or {}).get(name)
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else None

    batch, accum = count("batch_size"), count("accum_steps")
    return batch * accum if batch is not None and accum is not None else None


def has_larger_batch(trial: TrialRecord, trials: Sequence[TrialRecord]) -> bool:
    """`trial`'s effective batch (`batch_per_step` of the config it ran) is known and larger than
    the baseline's (its first completed seed's): fewer optimizer steps over the same samples."""
    base = baseline_target(trials)
    mine = batch_per_step(trial.user_attrs.get("config"))
    return mine is not None and (theirs := baseline_batch(base)) is not None and mine > theirs


def baseline_batch(base: TrialRecord | None) -> int | None:
    """A completed baseline seed's samples per optimizer step and GPU: its config's, the preset's
    knobs from what it reported running (a plugin workload's first seed: PRESET_RAN_ATTR)."""
    if base is None:
        return None
    ran = base.user_attrs.get(PRESET_RAN_ATTR)
    return batch_per_step(base.user_attrs.get("config"), ran if isinstance(ran, Mapping) else None)
