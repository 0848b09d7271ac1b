"""Judging a study's trials: quality gate, wire views, the recommendation. Pure functions.

Roles (user attr ``role``): the study's first `baseline_seeds` trials are *baseline* runs of
the user's config (probe seeds seed, seed+1, …), then *search* trials, then, once the search
is done, *remeasure* trials (user attrs ``remeasure_of``: the trial number re-measured, and
``remeasure_round``: 0, 1, … up to spec.remeasure.rounds - 1; every target's round r is
created before any target's round r + 1, so the rounds interleave, and every other round runs
its targets in reverse: `remeasure_plan`).

Retries: a trial *lost* with its worker (Optuna FAIL, failure_kind "lost": the reaper saw no
heartbeat) is re-run as a new trial of the same role, config and probe, carrying user attrs
``retry_of`` (the lost trial's number) and ``attempt`` (2, 3, …), up to spec.max_retries
times. Everything about retries is derived from those attrs (`retries`): a lost trial that
has a retry is *superseded* (its retry stands for it: it is left out of the counts, the
failures and the baseline), one that may still be retried is *pending*, and the phases
wait for pending ones as for running ones. Retries are not configurations: the study's
budget (n_trials) counts first attempts only.

Gate (autotune.gate): a completed trial is feasible iff its quality q (the study's metric:
val_nrmse for ups, val_loss for gpt, `StudySpec.quality_metric`) is within the gate,
q ≤ μ + max(abs_tol, k·σ) over the baseline seeds' q (q ≥ μ − max(...) for a metric to
maximize), and, with max_memory_gb, its peak reserved memory fits. Until every baseline has
finished, feasibility is unknown (None). `quality_name` is the metric's name shown to users
(the spec's, else the one the trials reported): a language model's loss is never called NRMSE.

Failed probes are told to Optuna as COMPLETE with worst-case values (api/outcome.py); every
view here reads `service_state`, which says FAIL for them.

Candidates and the front (one definition everywhere: API, CLI, report, YAML, and the values
Optuna holds for its dashboard): the *candidates* are the feasible search trials that ran,
less any whose config is the baseline's (`baseline_repeat_of`: the user's own config drawn
again measures the baseline, it is not a finding). Baseline seeds are the reference, never a
candidate. The front is the non-dominated candidates, each at its re-measured value where
one exists (`front_values`).

Re-measurement (`remeasurement`): once the search is done, the top_k candidates by throughput
*and the baseline* are re-measured with a longer probe, in interleaved rounds. A re-measured
config's quality is judged against the baseline re-measured at the same budget (a longer
probe trains further: its loss is not comparable with a gate set at the short budget); a
config whose re-measurement failed, or whose re-measured quality fails that gate, is out.

The recommendation (`recommend`) is the fastest re-measured candidate still in; its throughput
pools its rounds' windows (the timed samples over the timed seconds), and its speedup is over
the baseline's re-measured throughput, with a 95 % interval on the ratio from the run-to-run
spread (`speedup_interval`). When that interval reaches 1, `verdict` says that no config beat
the baseline beyond the noise. There is no recommendation while the re-measurement runs;
with re-measurement off (remeasure.top_k 0) it is the fastest candidate, with a note.

Energy (the objective "energy": GPU joules per sample over the probe's timed windows, the
user attr ``energy_j_per_sample``): the front and the values Optuna holds take it like any
objective (a re-measured candidate's energy is the mean over its rounds: every round trains
the same samples). What picks the recommendation (`chosen_by`): throughput whenever it is an
objective (``[throughput, quality, energy]`` recommends the fastest, as without energy), the
lowest energy per sample when energy is and throughput is not (``[energy, quality]``): then
the top_k candidates by lowest energy are re-measured with the baseline, and the pick is the
re-measured candidate still in with the lowest pooled energy per sample. Whenever the pick
and the baseline measured energy, the recommendation carries both, their ratio (pick over
baseline: below 1 uses less energy per sample) with a 95 % interval formed as the speedup's
(`ratio_interval`), and a sentence on it (`energy_verdict`); the speedup and its interval are
given in either case.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import yaml

from api.optuna_bridge import TrialRecord
from api.outcome import NOT_ABOUT_THE_CONFIG
from autotune.config import KNOBS, normalised
from autotune.gate import BaselineStats, Estimate, Gate, t_quantile, window_rate
from autotune.gate import is_feasible as gate_feasible
from autotune.protocol import OBJECTIVES, Recommendation, StudySpec, TrialInfo

GIB = 2**30


class NoRecommendation(Exception):
    """There is nothing to recommend yet; the message says why and what to wait for."""


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def role(trial: TrialRecord) -> str:
    value = trial.user_attrs.get("role")
    if value in ("baseline", "search", "remeasure"):
        return str(value)
    return "baseline" if trial.user_attrs.get("is_baseline") else "search"


def service_state(trial: TrialRecord) -> str:
    """The state the service shows: FAIL for a failed probe told COMPLETE to teach the sampler."""
    if trial.state == "COMPLETE" and trial.user_attrs.get("failure_kind"):
        return "FAIL"
    return trial.state


def completed(trial: TrialRecord) -> bool:
    return service_state(trial) == "COMPLETE"


RETRIED_KINDS = ("lost", *NOT_ABOUT_THE_CONFIG)  # the reaper's, and the failures told as Optuna FAIL


def is_lost(trial: TrialRecord) -> bool:
    """Failed not because of its config: its worker went silent (the reaper: "lost"), did not
    run its workload ("refused") or was stopped by a signal ("interrupted"). Such a trial is
    re-run by another worker (`may_retry`)."""
    return trial.state == "FAIL" and trial.user_attrs.get("failure_kind") in RETRIED_KINDS


def attempt_of(trial: TrialRecord) -> int:
    """1 for a first run, k for the (k-1)-th retry of a lost trial."""
    value = trial.user_attrs.get("attempt")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1


def retry_of(trial: TrialRecord) -> int | None:
    """The number of the lost trial this trial re-runs (None: a first attempt)."""
    value = trial.user_attrs.get("retry_of")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def may_retry(spec: StudySpec, trial: TrialRecord) -> bool:
    """A lost trial whose attempts are not used up (retried at most spec.max_retries times)."""
    return is_lost(trial) and attempt_of(trial) <= spec.max_retries


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
    trial. Optuna's values are not read first: they are what the samplers and the dashboard are
    shown (`optuna_values`), which for a trial that is not a candidate is the worst case."""
    if trial.user_attrs.get("failure_kind"):
        return None
    if name == "val_nrmse":
        name = "quality"
    attr = trial.user_attrs.get(name)
    if name == "quality" and attr is None:
        attr = trial.user_attrs.get("val_nrmse")
    if attr is not None:
        return _finite(attr)
    objective_names = [OBJECTIVES[o][0] for o in spec.objectives]
    if trial.values is not None and name in objective_names:
        return _finite(trial.values[objective_names.index(name)])
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


gate_nrmse = gate_quality  # the name from before quality was generalised (api/service.py uses it)


def fits_memory(trial: TrialRecord, spec: StudySpec) -> bool:
    peak = _finite(trial.user_attrs.get("peak_mem_reserved_bytes"))
    return spec.max_memory_gb is None or peak is None or peak / GIB <= spec.max_memory_gb


def is_feasible(trial: TrialRecord, spec: StudySpec, gate: float | None) -> bool | None:
    """True/False once both the gate and the trial's outcome are known, else None."""
    if gate is None or not trial.finished:
        return None
    quality = metric(trial, spec, "quality")
    return (completed(trial) and bool(gate_feasible(quality, gate, spec.quality_direction))
            and fits_memory(trial, spec))


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
        repeat_of=repeat_of if isinstance(repeat_of, int) else None, baseline_repeat_of=base_repeat,
        feasibility_note=note, duration_s=trial.duration_s,
        attempt=attempt_of(trial), retry_of=retry_of(trial), retried_as=retry,
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
        """A re-measurement's feasibility, judged against the baseline at its own budget."""
        rm = self._rm
        if rm is None or rm.gate is None:
            why = rm.unjudged if rm is not None and rm.unjudged else \
                "the baseline's re-measurement at this budget has not finished"
            return None, f"not judged: {why}"
        if not completed(trial):
            return False, None
        quality = metric(trial, spec, "quality")
        side = "≤" if spec.quality_direction == "minimize" else "≥"
        ok = bool(gate_feasible(quality, rm.gate, spec.quality_direction)) and fits_memory(trial, spec)
        return ok, f"judged at the re-measure budget: gate {side} {rm.gate:.6g} (the baseline re-measured)"


def trial_infos(trials: Sequence[TrialRecord], spec: StudySpec, all_trials: Sequence[TrialRecord] | None = None
                ) -> list[TrialInfo]:
    """Views of `trials`; the gate comes from `all_trials` (default: `trials`)."""
    every = all_trials if all_trials is not None else trials
    gate = gate_quality(spec, every)
    links = retried_as(every)
    name = quality_name(spec, every)
    context = TrialContext(spec, every, gate)
    return [trial_info(t, spec, gate, links.get(t.number), name, context) for t in trials]


def counts_by_state(trials: Sequence[TrialRecord]) -> dict[str, int]:
    """Trials by the state the service shows; a lost trial that was retried is left out (its
    retry counts for it), so each configuration counts once."""
    counts: dict[str, int] = {}
    for t in current(trials):
        state = service_state(t)
        counts[state] = counts.get(state, 0) + 1
    return counts


def failures_by_kind(trials: Sequence[TrialRecord]) -> dict[str, int]:
    """Failed trials by kind; a lost trial that was retried is not a failure of the study."""
    failures: dict[str, int] = {}
    for t in current(trials):
        if service_state(t) == "FAIL":
            kind = str(t.user_attrs.get("failure_kind") or "error")
            failures[kind] = failures.get(kind, 0) + 1
    return failures


def is_repeat(trial: TrialRecord) -> bool:
    """A drawn trial told an earlier trial's measurement instead of running (OptunaBridge.ask)."""
    return "repeat_of" in trial.user_attrs


def knob_config(trial: TrialRecord) -> dict[str, Any] | None:
    """The trial's config (the effective one once it ran), every knob normalised
    (`autotune.config.normalised`); None without one."""
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


def candidates(spec: StudySpec, trials: Sequence[TrialRecord], gate: float | None) -> list[TrialRecord]:
    """The trials a recommendation may name: feasible search trials that ran (not a repeat of
    another trial, not the baseline's config drawn again). Baseline seeds never are: a
    baseline that happens to measure fastest is the baseline, not a finding."""
    return [t for t in trials if role(t) == "search" and not is_repeat(t) and is_feasible(t, spec, gate)
            and baseline_repeat_of(t, trials) is None]


def pareto_front(trials: Sequence[TrialRecord], spec: StudySpec) -> list[TrialRecord]:
    """The front: the non-dominated candidates (feasible search trials, `candidates`), each at
    its re-measured value where it has one (`front_values`), by number. The API, the CLI, the
    report and the values Optuna holds for the dashboard (`optuna_values`) all use this one."""
    signs = [1.0 if direction == "maximize" else -1.0 for direction in spec.objective_directions()]
    values = front_values(spec, trials)
    points = [(t, [s * v for s, v in zip(signs, vs, strict=True)]) for t in trials
              if (vs := values.get(t.number)) is not None]

    def dominates(a: list[float], b: list[float]) -> bool:
        return all(x >= y for x, y in zip(a, b, strict=True)) and any(x > y for x, y in zip(a, b, strict=True))

    return sorted((t for t, p in points if not any(dominates(q, p) for _, q in points)), key=lambda t: t.number)


def search_done(spec: StudySpec, trials: Sequence[TrialRecord], max_trials: int) -> bool:
    """Every baseline and search configuration the study may have is created and settled
    (finished, and no lost one waits for a retry; retries do not count toward max_trials)."""
    first = [t for t in trials if role(t) != "remeasure"]
    state = retries(spec, first)
    return len(first_attempts(first)) >= max_trials and all(t.finished for t in first) and not state.pending


def remeasure_key(trial: TrialRecord) -> tuple[int, int] | None:
    """(the trial re-measured, the round) of a remeasure trial; None for other trials. A trial
    from before rounds existed is round 0."""
    of, round_ = trial.user_attrs.get("remeasure_of"), trial.user_attrs.get("remeasure_round", 0)
    if role(trial) != "remeasure" or not isinstance(of, int) or not isinstance(round_, int):
        return None
    return of, round_


def remeasure_plan(spec: StudySpec, targets: Sequence[TrialRecord]) -> list[tuple[TrialRecord, int]]:
    """Every (target, round) the study re-measures, in creation order: round by round, every
    other round in reverse (A B C, C B A, A B C, …). Over each pair of rounds every target's
    re-measurements then sit at the same mean place in the sequence, so a host whose speed
    drifts steadily while they run favours none of them; in plain rotation (A B C A B C) the
    first target would always run before the others and gain from a host that slows down."""
    return [(t, r) for r in range(spec.remeasure.rounds) for t in (targets if r % 2 == 0 else targets[::-1])]


def chosen_by(spec: StudySpec) -> Literal["throughput", "energy"]:
    """What ranks the candidates for re-measurement and the recommendation: throughput, unless
    the study minimizes energy and does not optimise throughput (see the module docstring)."""
    return "energy" if "energy" in spec.objectives and "throughput" not in spec.objectives else "throughput"


RANK_METRIC = {"throughput": "throughput_samples_per_s", "energy": "energy_j_per_sample"}


def ranked_candidates(spec: StudySpec, trials: Sequence[TrialRecord], gate: float | None
                      ) -> list[tuple[float, TrialRecord]]:
    """(score, trial) of the candidates that have the ranking metric (`chosen_by`), best first:
    the fastest, or the lowest energy per sample; ties by trial number."""
    by = chosen_by(spec)
    sign = -1.0 if by == "throughput" else 1.0
    ranked = [(v, t) for t in candidates(spec, trials, gate) if (v := metric(t, spec, RANK_METRIC[by])) is not None]
    return sorted(ranked, key=lambda c: (sign * c[0], c[1].number))


def remeasure_targets(spec: StudySpec, trials: Sequence[TrialRecord], gate: float | None) -> list[TrialRecord]:
    """The configs to re-measure: the top_k candidates by throughput, fastest first (by energy
    per sample, lowest first, where energy picks: `chosen_by`), then the baseline (its first
    completed seed), so that every re-measured config is compared with the baseline at the
    same sample budget, in the same interleaved rounds. Nothing when no candidate is feasible."""
    if spec.remeasure.top_k <= 0 or gate is None:
        return []
    targets = [t for _, t in ranked_candidates(spec, trials, gate)[:spec.remeasure.top_k]]
    base = baseline_target(trials)
    return [*targets, base] if targets and base is not None else targets


def baseline_failed_message(study_name: str, spec: StudySpec, trials: Sequence[TrialRecord]) -> str | None:
    """A message when every baseline seed finished without a result (the gate cannot be set)."""
    summary = baseline_summary(spec, trials)
    if summary.finished and summary.quality is None:
        return (f"study {study_name!r} cannot recommend anything: every baseline run failed "
                f"({'; '.join(summary.failures)}); the quality gate needs the baseline's "
                f"{quality_name(spec, trials)}. "
                "Fix the baseline config (spec.baseline) and submit a new study")
    return None


def _windows(trial: TrialRecord, key: str = "window_throughputs") -> list[float]:
    """The trial's finite per-window values of `key` (window_throughputs, window_energy_j_per_sample)."""
    windows = trial.user_attrs.get(key)
    if not isinstance(windows, list):
        return []
    return [float(v) for v in windows if isinstance(v, (int, float)) and math.isfinite(v)]


@dataclass(frozen=True)
class Remeasurement:
    """Where a study's re-measurement stands (`remeasurement`)."""

    targets: list[TrialRecord]  # the configs re-measured: candidates best first (`chosen_by`), then the baseline
    runs: dict[int, list[TrialRecord]]  # target number -> its completed re-measurements, round by round
    dropped: dict[int, str]  # target number -> why it is out (a re-measurement failed for good)
    pending: bool  # a planned re-measurement has not settled (or the search is still on)
    baseline: int | None  # the baseline target's number
    gate: float | None  # the gate at the re-measure budget (from the baseline's re-measurement)
    unjudged: str | None  # why quality at the re-measure budget is not judged (gate None)

    def judged(self, spec: StudySpec, number: int) -> bool | None:
        """Whether target `number`'s re-measured quality passes the gate at its own budget
        (the mean over its rounds, and each round's peak memory); None when not judged."""
        runs = self.runs.get(number)
        if not runs or self.gate is None:
            return None
        quality = [q for r in runs if (q := metric(r, spec, "quality")) is not None]
        return (bool(quality) and bool(gate_feasible(statistics.fmean(quality), self.gate, spec.quality_direction))
                and all(fits_memory(r, spec) for r in runs))


def remeasurement(spec: StudySpec, trials: Sequence[TrialRecord], gate: float | None) -> Remeasurement:
    """The re-measurements of the study's targets. A re-measured config is judged against the
    baseline re-measured at the same sample budget: the gate there is the baseline's
    re-measured quality (mean over its rounds) widened by the same tolerance as the search's
    gate, with the baseline seeds' spread (every re-measurement runs one seed, so its rounds
    do not show a seed spread). The longer probe may train a model to a better (or, when it
    overfits, a worse) quality: a gate set at the short budget would judge it by the wrong
    yardstick. Without a baseline re-measurement the re-measured quality is not judged."""
    targets = remeasure_targets(spec, trials, gate)
    state = retries(spec, trials)
    runs: dict[int, list[TrialRecord]] = {}
    dropped: dict[int, str] = {}
    settled: set[tuple[int, int]] = set()
    for t in trials:
        key = remeasure_key(t)
        if key is None or not state.settled(t):
            continue
        settled.add(key)
        if completed(t) and metric(t, spec, "throughput_samples_per_s") is not None:
            runs.setdefault(key[0], []).append(t)
        else:
            kind = t.user_attrs.get("failure_kind") or service_state(t).lower()
            dropped.setdefault(key[0], f"its re-measurement (trial {t.number}) failed ({kind})")
    for number in runs:
        runs[number].sort(key=lambda r: ((remeasure_key(r) or (0, 0))[1], r.number))
    pending = spec.remeasure.top_k > 0 and (
        not targets or any((t.number, r) not in settled for t, r in remeasure_plan(spec, targets)))
    base = baseline_target(trials)
    base_number = base.number if base is not None and any(t.number == base.number for t in targets) else None
    gate_long, unjudged = None, None
    if base_number is not None:
        quality = [q for r in runs.get(base_number, []) if (q := metric(r, spec, "quality")) is not None]
        seeds = baseline_summary(spec, trials).quality
        if quality and seeds is not None:
            stats = BaselineStats(mean=statistics.fmean(quality), std=seeds.std, n=seeds.n)
            gate_long = Gate(spec.gate.abs_tol, spec.gate.k).threshold(stats, spec.quality_direction)
        elif base_number in dropped:
            why = dropped[base_number].removeprefix("its ")
            unjudged = (f"the baseline's {why}: quality at the re-measure budget is not judged "
                        "(the re-measured configs keep the search's verdict)")
    return Remeasurement(targets=targets, runs=runs, dropped=dropped, pending=pending, baseline=base_number,
                         gate=gate_long, unjudged=unjudged)


def front_values(spec: StudySpec, trials: Sequence[TrialRecord]) -> dict[int, list[float]]:
    """Trial number -> the objective values (the spec's order) of every candidate on which the
    front is computed: a feasible search trial at its re-measured value where it has one (the
    pooled throughput and mean quality of its rounds). A candidate whose re-measurement failed,
    or whose re-measured quality fails the gate at its budget, is left out."""
    gate = gate_quality(spec, trials)
    rm = remeasurement(spec, trials, gate)
    out: dict[int, list[float]] = {}
    for t in candidates(spec, trials, gate):
        if t.number in rm.dropped or rm.judged(spec, t.number) is False:
            continue
        runs = rm.runs.get(t.number) or [t]
        throughput = _pooled_throughput(runs, spec)
        quality = [q for r in runs if (q := metric(r, spec, "quality")) is not None]
        energy = _pooled_energy(runs, spec)
        if throughput is None or not quality or ("energy" in spec.objectives and energy is None):
            continue
        measured = {"throughput_samples_per_s": throughput, "quality": statistics.fmean(quality),
                    "energy_j_per_sample": energy}
        out[t.number] = [float(measured[OBJECTIVES[o][0]] or 0.0) for o in spec.objectives]
    return out


@dataclass(frozen=True)
class Speedup:
    """A ratio (a speedup, or an energy ratio) with its 95 % confidence interval (`ratio_interval`)."""

    ratio: float
    low: float | None
    high: float | None
    basis: str  # how the interval was formed, for the notes


def speedup_interval(pick: Sequence[TrialRecord], base: Sequence[TrialRecord],
                     groups: Sequence[Sequence[TrialRecord]], spec: StudySpec) -> Speedup | None:
    """The pick's throughput over the baseline's, with a 95 % interval on the ratio (`ratio_interval`)."""
    return ratio_interval(pick, base, groups, spec, "throughput_samples_per_s")


def ratio_interval(pick: Sequence[TrialRecord], base: Sequence[TrialRecord], groups: Sequence[Sequence[TrialRecord]],
                   spec: StudySpec, name: str) -> Speedup | None:
    """The pick's `name` (throughput_samples_per_s: a speedup; energy_j_per_sample: an energy
    ratio) over the baseline's, with a 95 % interval on the ratio.

    Each probe run (a process) is one measurement: the log of its value varies from run to run
    with the host's state, far more than its windows do. That run-to-run spread is pooled over
    every config measured more than once (`groups`: the baseline seeds, each re-measured
    config's rounds), assuming the host's noise is the same relative size for all of them, and
    the interval on log(ratio) is Student-t with the pooled degrees of freedom:
    ± t · s · √(1/n_pick + 1/n_base). With no config run twice the run-to-run spread is unknown
    and the interval falls back to the windows of each side's runs (it is then too narrow,
    and the notes say so)."""
    pooled = _pooled_throughput if name == "throughput_samples_per_s" else _pooled_energy
    pick_value, base_value = pooled(pick, spec), pooled(base, spec)
    if pick_value is None or not base_value:
        return None
    ratio = pick_value / base_value
    squares, dof, runs_pooled, configs = 0.0, 0, 0, 0
    for group in groups:
        logs = [math.log(v) for r in group if (v := metric(r, spec, name)) and v > 0]
        if len(logs) >= 2:
            mean = statistics.fmean(logs)
            squares += sum((x - mean) ** 2 for x in logs)
            dof += len(logs) - 1
            runs_pooled, configs = runs_pooled + len(logs), configs + 1
    if dof > 0:
        half = t_quantile(0.95, dof) * math.sqrt(squares / dof) * math.sqrt(1 / len(pick) + 1 / len(base))
        basis = f"run-to-run spread pooled over {runs_pooled} runs of {configs} configs ({dof} degrees of freedom)"
    else:
        halves = []
        for runs in (pick, base):
            if name == "throughput_samples_per_s":
                windows = [w for r in runs for w in _windows(r)]
                est = Estimate.for_rate(windows) if len(windows) >= 2 else None
            else:
                windows = [w for r in runs for w in _windows(r, "window_energy_j_per_sample")]
                est = Estimate.from_values(windows) if len(windows) >= 2 else None
            if est is None:
                return Speedup(ratio, None, None, "no interval: a side has fewer than 2 timed windows")
            if est.low <= 0:
                return Speedup(ratio, None, None, "no interval: a side's windows vary too much")
            halves.append(math.log(est.high / est.low) / 2)
        half = math.hypot(*halves)
        basis = ("the windows of one run per side: no config was run twice, so the run-to-run spread is not "
                 "in this interval (run more baseline_seeds or remeasure.rounds)")
    return Speedup(ratio, ratio * math.exp(-half), ratio * math.exp(half), basis)


def recommend(study_name: str, spec: StudySpec, trials: Sequence[TrialRecord]) -> Recommendation:
    """The fastest candidate that kept its quality at the re-measure budget, or the one with
    the lowest energy per sample where energy picks (`chosen_by`; see the module docstring).
    Raises NoRecommendation when there is none yet, or none at all."""
    runs = baselines(trials)
    if not runs:
        raise NoRecommendation(f"study {study_name!r} has no recommendation yet: its baseline trial has not been "
                               "leased; start a worker with the study's hardware class")
    failed = baseline_failed_message(study_name, spec, trials)
    if failed:
        raise NoRecommendation(failed)
    summary = baseline_summary(spec, trials)
    if not summary.finished:
        state = retries(spec, trials)
        waiting = [t.number for t in runs if not t.finished or state.is_pending(t)]
        raise NoRecommendation(f"study {study_name!r} has no recommendation yet: the baseline runs "
                               f"({len(runs)}/{spec.baseline_seeds} started; waiting for trials {waiting}) have not "
                               f"all finished; the quality gate needs their {quality_name(spec, trials)}")
    assert summary.quality is not None
    gate = gate_quality(spec, trials)
    by = chosen_by(spec)
    scored_pool = ranked_candidates(spec, trials, gate)
    if not scored_pool:
        what = "a throughput" if by == "throughput" else "an energy per sample"
        raise NoRecommendation(f"study {study_name!r} has no feasible search trial with {what} yet "
                               "(baseline seeds are the reference, never a recommendation)")
    rm = remeasurement(spec, trials, gate)
    name = quality_name(spec, trials)
    caveats: list[str] = []
    if spec.remeasure.top_k > 0:
        if rm.pending:
            score0, first = scored_pool[0]
            done = sum(len(v) for v in rm.runs.values()) + len(rm.dropped)
            so_far = (f"the fastest search trial so far is trial {first.number} at {score0:,.1f} samples/s"
                      if by == "throughput" else
                      f"the search trial with the lowest energy so far is trial {first.number} at {score0:.4g} "
                      "J/sample")
            raise NoRecommendation(
                f"study {study_name!r} has no recommendation yet: its top configs and the baseline are being "
                f"re-measured with a longer probe ({done} of {len(remeasure_plan(spec, rm.targets)) or '?'} "
                f"re-measurements settled); {so_far}, not yet re-measured")
        ranked = []
        for target in rm.targets:
            if target.number == rm.baseline or target.number in rm.dropped or not rm.runs.get(target.number):
                continue
            if rm.judged(spec, target.number) is False:
                continue
            if (score := _score(rm.runs[target.number], spec, by)) is not None:
                ranked.append((score, target, rm.runs[target.number]))
        if not ranked:
            why = "; ".join([f"trial {n}: {w}" for n, w in rm.dropped.items() if n != rm.baseline]
                            + [f"trial {t.number}: its re-measured {name} fails the gate at the re-measure budget"
                               for t in rm.targets if t.number != rm.baseline and rm.judged(spec, t.number) is False])
            kept = "speed" if by == "throughput" else "energy per sample"
            raise NoRecommendation(f"study {study_name!r} has nothing to recommend: no re-measured config kept its "
                                   f"{kept} and quality ({why}); keep the baseline config, or widen the search")
        if rm.unjudged:
            caveats.append(rm.unjudged)
    else:
        ranked = [(score, t, [t]) for score, t in scored_pool]
        best_of = "the fastest" if by == "throughput" else "the lowest energy"
        caveats.append("not re-measured (remeasure.top_k is 0): this is the search's own measurement of the config, "
                       f"and {best_of} of many noisy measurements is flattered by its luck (winner's curse)")
    sign = 1.0 if by == "throughput" else -1.0
    _, best, pick_runs = max(ranked, key=lambda c: (sign * c[0], -c[1].number))
    throughput = _pooled_throughput(pick_runs, spec)
    assert throughput is not None  # a candidate's runs completed with a throughput
    remeasured = pick_runs[0] is not best
    base_runs = rm.runs.get(rm.baseline, []) if remeasured and rm.baseline is not None else []
    seeds = [t for t in runs if completed(t) and not retries(spec, trials).superseded(t)]
    if not base_runs:
        base_runs = seeds
    groups = [seeds] + [rm.runs[t.number] for t in rm.targets if t.number in rm.runs]
    speed = speedup_interval(pick_runs, base_runs, groups, spec)
    run = pick_runs[-1]  # the latest measurement: its notes and peak memory
    windows = [w for r in pick_runs for w in _windows(r)]
    ci = Estimate.for_rate(windows) if len(windows) >= 2 else None  # throughput: the windows' rate
    round_rates = [thr for r in pick_runs if (thr := metric(r, spec, "throughput_samples_per_s")) is not None] \
        if remeasured else []
    notes = [str(n) for n in run.user_attrs.get("measurement_notes") or []]
    if ci is not None and len(round_rates) >= 2 and (min(round_rates) < ci.low or max(round_rates) > ci.high):
        notes.append(_rounds_note(round_rates, throughput))
    energy = ratio_interval(pick_runs, base_runs, groups, spec, "energy_j_per_sample")
    if speed is not None and energy is not None and speed.basis == energy.basis:
        caveats.append(f"speedup and energy ratio intervals: {speed.basis}")
    else:
        caveats += [f"{what} interval: {ratio.basis}" for what, ratio in (("speedup", speed), ("energy ratio", energy))
                    if ratio is not None]
    saves = None if energy is None or energy.high is None else energy.high < 1.0
    methods = sorted({str(m) for r in [*pick_runs, *base_runs] if (m := r.user_attrs.get("energy_method"))})
    config = best.user_attrs.get("config") or {}
    peak = run.user_attrs.get("peak_mem_reserved_bytes") or best.user_attrs.get("peak_mem_reserved_bytes")
    base_thr = _pooled_throughput(base_runs, spec)
    judged_long = remeasured and rm.gate is not None
    quality_runs = pick_runs if judged_long else [best]
    qualities = [q for r in quality_runs if (q := metric(r, spec, "quality")) is not None]
    quality = statistics.fmean(qualities) if qualities else None
    base_quality = summary.quality.mean
    if judged_long:
        base_q = [q for r in base_runs if (q := metric(r, spec, "quality")) is not None]
        base_quality = statistics.fmean(base_q) if base_q else base_quality
    gate_used = rm.gate if judged_long else gate
    nrmse = name == "val_nrmse"  # the val_nrmse fields are set for NRMSE only: a loss is not an NRMSE
    beats = None if speed is None or speed.low is None else speed.low > 1.0
    return Recommendation(
        study=study_name, config={k: v for k, v in config.items() if k in KNOBS}, trial_number=best.number,
        throughput_samples_per_s=throughput, val_nrmse=quality if nrmse else None,
        baseline_throughput_samples_per_s=base_thr, baseline_val_nrmse=base_quality if nrmse else None,
        speedup=speed.ratio if speed else None, gate_nrmse=gate_used if nrmse else None,
        quality_metric=name, quality_direction=spec.quality_direction, quality=quality,
        baseline_quality=base_quality, baseline_quality_std=summary.quality.std, gate_quality=gate_used,
        peak_mem_reserved_bytes=int(peak) if isinstance(peak, (int, float)) and not isinstance(peak, bool) else None,
        throughput_ci_low=ci.low if ci else None, throughput_ci_high=ci.high if ci else None,
        remeasured=remeasured, remeasure_rounds=len(pick_runs) if remeasured else 0,
        round_throughputs=round_rates,
        baseline_val_nrmse_std=summary.quality.std if nrmse else None,
        baseline_seeds=summary.quality.n,
        measurement_notes=notes, caveats=caveats,
        speedup_ci_low=speed.low if speed else None, speedup_ci_high=speed.high if speed else None,
        beats_baseline=beats, verdict=_verdict(speed, beats),
        quality_budget="remeasure" if judged_long else "search",
        search_quality=metric(best, spec, "quality"), search_gate_quality=gate,
        search_throughput_samples_per_s=metric(best, spec, "throughput_samples_per_s"),
        baseline_remeasured=bool(remeasured and rm.baseline is not None and rm.runs.get(rm.baseline)),
        chosen_by=by, energy_j_per_sample=_pooled_energy(pick_runs, spec),
        baseline_energy_j_per_sample=_pooled_energy(base_runs, spec),
        energy_ratio=energy.ratio if energy else None, energy_ratio_ci_low=energy.low if energy else None,
        energy_ratio_ci_high=energy.high if energy else None, saves_energy=saves,
        energy_method=" + ".join(methods) or None, energy_verdict=_energy_verdict(energy, saves, by),
    )


def _score(runs: Sequence[TrialRecord], spec: StudySpec, by: str) -> float | None:
    """What ranks re-measured configs (`chosen_by`): the pooled throughput, or energy per sample."""
    return _pooled_throughput(runs, spec) if by == "throughput" else _pooled_energy(runs, spec)


NOISE_ADVICE = ("keep the baseline config; to tell smaller differences apart, re-measure more "
                "(remeasure.rounds, baseline_seeds) or measure on a quieter host")


def _verdict(speed: Speedup | None, beats: bool | None) -> str:
    """One sentence: whether the pick beat the baseline beyond the noise."""
    if speed is None:
        return "the speedup is unknown: the baseline has no throughput"
    if beats is None:
        return f"{speed.ratio:.2f}× the baseline's throughput; no confidence interval ({speed.basis})"
    interval = f"{speed.ratio:.2f}× (95 % CI {speed.low:.2f}–{speed.high:.2f}×)"
    if beats:
        return f"{interval} the baseline's throughput: faster beyond the noise"
    return f"no config beat the baseline beyond the noise: {interval}; {NOISE_ADVICE}"


def _energy_verdict(energy: Speedup | None, saves: bool | None, by: str) -> str:
    """One sentence on the pick's energy per sample against the baseline's ("" unless both were measured)."""
    if energy is None:
        return ""
    if energy.low is None or energy.high is None:
        return f"{energy.ratio:.2f}× the baseline's energy per sample; no confidence interval ({energy.basis})"
    interval = f"{energy.ratio:.2f}× (95 % CI {energy.low:.2f}–{energy.high:.2f}×) the baseline's energy per sample"
    if saves:
        return f"{interval}: less energy beyond the noise"
    if energy.low > 1.0:
        return f"{interval}: more energy beyond the noise"
    if by == "energy":
        return f"no config used less energy per sample than the baseline beyond the noise: {interval}; {NOISE_ADVICE}"
    return f"{interval}: not told apart from the baseline's beyond the noise"


def _rounds_note(rates: Sequence[float], pooled: float) -> str:
    """Said when a config's re-measurements differ by more than the interval over their windows
    (which sees the spread inside each process, not between processes)."""
    spread = (max(rates) - min(rates)) / pooled
    return (f"its {len(rates)} re-measurements ran at {', '.join(f'{r:,.0f}' for r in rates)} samples/s, "
            f"{spread * 100:.0f} % apart: more than the 95 % interval over their windows, which leaves out how much "
            f"the host's speed varies from process to process; configs closer than that are ranked by the host's "
            f"state at the time (more remeasure.rounds pool more of it)")


def _pooled_throughput(runs: Sequence[TrialRecord], spec: StudySpec) -> float | None:
    """One measurement's throughput; several re-measurements' pooled: the timed samples over the
    timed seconds of all their windows (every run of a config is one probe, so its windows hold
    equal samples), else, without stored windows, their throughputs' median."""
    values = [v for r in runs if (v := metric(r, spec, "throughput_samples_per_s")) is not None]
    if len(runs) == 1 or not values:
        return values[0] if values else None
    windows = [_windows(r) for r in runs]
    if all(windows):
        return window_rate([w for ws in windows for w in ws])[0]
    return statistics.median(values)


def _pooled_energy(runs: Sequence[TrialRecord], spec: StudySpec) -> float | None:
    """Energy per sample of one measurement, or several re-measurements' pooled: their energy
    over their samples, the mean of their values (every run of a config trains the same
    samples); None when a run has none (a figure without it would be too low)."""
    values = [metric(r, spec, "energy_j_per_sample") for r in runs]
    if not values or any(v is None for v in values):
        return None
    return statistics.fmean(v for v in values if v is not None)


def recommendation_yaml(rec: Recommendation) -> str:
    """The recommended config as YAML that `autotune probe --config FILE` reads, with the
    numbers behind it as a comment header."""
    picked = " (the lowest energy per sample among the candidates)" if rec.chosen_by == "energy" else ""
    lines = [f"# autotune recommendation for study {rec.study}: trial {rec.trial_number}{picked}",
             f"# throughput: {rec.throughput_samples_per_s:.1f} samples/s"]
    if rec.baseline_throughput_samples_per_s is not None:
        speedup = f"{rec.speedup:.2f}x" if rec.speedup is not None else "n/a"
        if rec.speedup_ci_low is not None and rec.speedup_ci_high is not None:
            speedup += f", 95% CI {rec.speedup_ci_low:.2f}-{rec.speedup_ci_high:.2f}x"
        same = " at the same budget" if rec.baseline_remeasured else ""
        lines.append(f"# baseline throughput: {rec.baseline_throughput_samples_per_s:.1f} samples/s{same} "
                     f"(speedup {speedup})")
    if rec.beats_baseline is False and rec.chosen_by == "throughput":
        lines.append(f"# WARNING: {rec.verdict}")
    lines += [f"# {line}" for line in rec.energy_lines()]
    if rec.saves_energy is False and rec.chosen_by == "energy":
        lines.append(f"# WARNING: {rec.energy_verdict}")
    name = rec.quality_metric
    side = "<=" if rec.quality_direction == "minimize" else ">="
    gate = f" (gate: {side} {rec.gate_quality:.6g})" if rec.gate_quality is not None else ""
    base = "n/a" if rec.baseline_quality is None else f"{rec.baseline_quality:.6g}"
    if rec.baseline_quality_std is not None and rec.baseline_seeds > 1:
        base += f" ± {rec.baseline_quality_std:.2g} over {rec.baseline_seeds} seeds"
    value = "n/a" if rec.quality is None else f"{rec.quality:.6g}"
    budget = " (re-measured, against the baseline re-measured at that budget)" if rec.quality_budget == "remeasure" \
        else ""
    lines.append(f"# {name}: {value}{gate}; baseline {name}: {base}{budget}")
    if rec.quality_budget == "remeasure" and rec.search_quality is not None:
        lines.append(f"# {name} in the search's shorter probe: {rec.search_quality:.6g}")
    if rec.throughput_ci_low is not None and rec.throughput_ci_high is not None:
        lines.append(f"# throughput 95% CI: {rec.throughput_ci_low:.1f}–{rec.throughput_ci_high:.1f} samples/s"
                     f"{' (re-measured)' if rec.remeasured else ''}")
    lines.append("# peak memory reserved: " + ("n/a (not measured on this device)" if rec.peak_mem_reserved_bytes
                                                is None else f"{rec.peak_mem_reserved_bytes / 2**30:.2f} GiB"))
    lines += [f"# note: {note}" for note in rec.measurement_notes]
    if rec.config and rec.config.get("lr") is not None:
        lines.append("# lr: the probes' (the workload preset's); autotune.apply keeps your optimizer's lr "
                     "unless use_config_lr=True")
    body = yaml.safe_dump(rec.config, sort_keys=False, default_flow_style=False) if rec.config else "{}\n"
    return "\n".join(lines) + "\n" + body


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
