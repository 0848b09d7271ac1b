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

The recommendation is the fastest feasible config: among the re-measured configs (throughput
= the timed samples over the timed seconds of all its re-measure runs' windows, which hold
equal steps, with the CI over those windows) and the baseline when re-measurement happened,
else among every feasible trial (CI over the trial's own windows). A config one of whose
re-measurements failed is not recommended.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from api.optuna_bridge import TrialRecord
from api.outcome import NOT_ABOUT_THE_CONFIG
from autotune.config import KNOBS
from autotune.gate import BaselineStats, Estimate, Gate, window_rate
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
    """`name` (throughput_samples_per_s | quality) of a trial: its objective value, else its user
    attr (quality: ``quality``, or ``val_nrmse`` of a trial stored before the generic field).
    None for a failed trial (its told values are the worst case, not a measurement)."""
    if trial.user_attrs.get("failure_kind"):
        return None
    if name == "val_nrmse":
        name = "quality"
    objective_names = [OBJECTIVES[o][0] for o in spec.objectives]
    if trial.values is not None and name in objective_names:
        return _finite(trial.values[objective_names.index(name)])
    if name == "quality" and trial.user_attrs.get("quality") is None:
        return _finite(trial.user_attrs.get("val_nrmse"))
    return _finite(trial.user_attrs.get(name))


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
               quality_metric: str | None = None) -> TrialInfo:
    """The wire view of `trial`; `retry`: the number of the trial that re-runs it (a lost trial);
    `quality_metric`: the study's metric name (default: `quality_name` of this trial)."""
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
    failed = service_state(trial) == "FAIL"
    return TrialInfo(
        trial_id=trial.trial_id, number=trial.number, state=service_state(trial), params=trial.params,
        config=config if isinstance(config, dict) else None,
        values=None if failed else trial.values,
        throughput_samples_per_s=metric(trial, spec, "throughput_samples_per_s"),
        val_nrmse=quality if name == "val_nrmse" else None, quality=quality, quality_metric=name,
        feasible=is_feasible(trial, spec, gate), failure=failure,
        worker_id=attrs.get("worker_id"), is_baseline=role(trial) == "baseline", role=role(trial),  # type: ignore[arg-type]
        prune_reason=str(prune_reason) if prune_reason else None,
        remeasure_of=int(remeasure_of) if isinstance(remeasure_of, int) else None,
        remeasure_round=key[1] if (key := remeasure_key(trial)) else None,
        starting_point=starting_point if isinstance(starting_point, int) else None,
        repeat_of=repeat_of if isinstance(repeat_of, int) else None, duration_s=trial.duration_s,
        attempt=attempt_of(trial), retry_of=retry_of(trial), retried_as=retry,
    )


def trial_infos(trials: Sequence[TrialRecord], spec: StudySpec, all_trials: Sequence[TrialRecord] | None = None
                ) -> list[TrialInfo]:
    """Views of `trials`; the gate comes from `all_trials` (default: `trials`)."""
    every = all_trials if all_trials is not None else trials
    gate = gate_quality(spec, every)
    links = retried_as(every)
    name = quality_name(spec, every)
    return [trial_info(t, spec, gate, links.get(t.number), name) for t in trials]


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


def pareto_front(trials: Sequence[TrialRecord], spec: StudySpec) -> list[TrialRecord]:
    """The non-dominated completed trials (failed ones and repeats excluded), by number."""
    signs = [1.0 if direction == "maximize" else -1.0 for direction in spec.objective_directions()]
    points = [(t, [s * v for s, v in zip(signs, t.values, strict=True)]) for t in trials
              if completed(t) and not is_repeat(t) and t.values is not None and all(math.isfinite(v) for v in t.values)]

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


def remeasure_targets(spec: StudySpec, trials: Sequence[TrialRecord], gate: float | None) -> list[TrialRecord]:
    """The top_k feasible search trials by throughput (the configs to re-measure), fastest first."""
    if spec.remeasure.top_k <= 0 or gate is None:
        return []
    ranked = [(thr, t) for t in trials if role(t) == "search" and not is_repeat(t) and is_feasible(t, spec, gate)
              and (thr := metric(t, spec, "throughput_samples_per_s")) is not None]
    ranked.sort(key=lambda c: (-c[0], c[1].number))
    return [t for _, t in ranked[:spec.remeasure.top_k]]


def baseline_failed_message(study_name: str, spec: StudySpec, trials: Sequence[TrialRecord]) -> str | None:
    """A message when every baseline seed finished without a result (the gate cannot be set)."""
    summary = baseline_summary(spec, trials)
    if summary.finished and summary.quality is None:
        return (f"study {study_name!r} cannot recommend anything: every baseline run failed "
                f"({'; '.join(summary.failures)}); the quality gate needs the baseline's "
                f"{quality_name(spec, trials)}. "
                "Fix the baseline config (spec.baseline) and submit a new study")
    return None


def _windows(trial: TrialRecord) -> list[float]:
    windows = trial.user_attrs.get("window_throughputs")
    if not isinstance(windows, list):
        return []
    return [float(v) for v in windows if isinstance(v, (int, float)) and math.isfinite(v)]


def recommend(study_name: str, spec: StudySpec, trials: Sequence[TrialRecord]) -> Recommendation:
    """The fastest feasible config (see the module docstring). Raises NoRecommendation when there is none yet."""
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
    gate = gate_quality(spec, trials)
    remeasured: dict[int, list[TrialRecord]] = {}
    dropped: set[int] = set()
    state = retries(spec, trials)
    for t in trials:
        key = remeasure_key(t)
        if key is not None and state.settled(t):
            if completed(t) and metric(t, spec, "throughput_samples_per_s") is not None:
                remeasured.setdefault(key[0], []).append(t)
            else:
                dropped.add(key[0])  # failed to reproduce (or lost for good): not recommended
    # (original trial, the measurements whose throughput counts)
    candidates = [(t, remeasured.get(t.number, [t])) for t in trials if role(t) != "remeasure" and not is_repeat(t)
                  and is_feasible(t, spec, gate) and t.number not in dropped]
    if remeasured:
        candidates = [c for c in candidates if c[0].number in remeasured or role(c[0]) == "baseline"]
    scored = [(thr, orig, runs) for orig, runs in candidates if (thr := _pooled_throughput(runs, spec)) is not None]
    if not scored:
        raise NoRecommendation(f"study {study_name!r} has no feasible completed trial with a throughput yet")
    throughput, best, runs = max(scored, key=lambda c: (c[0], -c[1].number))
    run = runs[-1]  # the latest measurement: its notes and peak memory
    windows = [w for r in runs for w in _windows(r)]
    ci = Estimate.for_rate(windows) if len(windows) >= 2 else None  # throughput: the windows' rate
    rounds = sorted(runs, key=lambda r: ((remeasure_key(r) or (0, 0))[1], r.number)) if run is not best else []
    round_rates = [thr for r in rounds if (thr := metric(r, spec, "throughput_samples_per_s")) is not None]
    notes = [str(n) for n in run.user_attrs.get("measurement_notes") or []]
    if ci is not None and len(round_rates) >= 2 and (min(round_rates) < ci.low or max(round_rates) > ci.high):
        notes.append(_rounds_note(round_rates, throughput))
    config = best.user_attrs.get("config") or {}
    peak = run.user_attrs.get("peak_mem_reserved_bytes") or best.user_attrs.get("peak_mem_reserved_bytes")
    base_thr = summary.throughput
    assert summary.quality is not None
    name = quality_name(spec, trials)
    nrmse = name == "val_nrmse"  # the val_nrmse fields are set for NRMSE only: a loss is not an NRMSE
    quality = metric(best, spec, "quality")
    return Recommendation(
        study=study_name, config={k: v for k, v in config.items() if k in KNOBS}, trial_number=best.number,
        throughput_samples_per_s=throughput, val_nrmse=quality if nrmse else None,
        baseline_throughput_samples_per_s=base_thr, baseline_val_nrmse=summary.quality.mean if nrmse else None,
        speedup=throughput / base_thr if base_thr else None, gate_nrmse=gate if nrmse else None,
        quality_metric=name, quality_direction=spec.quality_direction, quality=quality,
        baseline_quality=summary.quality.mean, baseline_quality_std=summary.quality.std, gate_quality=gate,
        peak_mem_reserved_bytes=int(peak) if isinstance(peak, (int, float)) and not isinstance(peak, bool) else None,
        throughput_ci_low=ci.low if ci else None, throughput_ci_high=ci.high if ci else None,
        remeasured=run is not best, remeasure_rounds=len(runs) if run is not best else 0,
        round_throughputs=round_rates,
        baseline_val_nrmse_std=summary.quality.std if nrmse else None,
        baseline_seeds=summary.quality.n,
        measurement_notes=notes,
    )


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


def recommendation_yaml(rec: Recommendation) -> str:
    """The recommended config as YAML that `autotune probe --config FILE` reads, with the
    numbers behind it as a comment header."""
    lines = [f"# autotune recommendation for study {rec.study}: trial {rec.trial_number}",
             f"# throughput: {rec.throughput_samples_per_s:.1f} samples/s"]
    if rec.baseline_throughput_samples_per_s is not None:
        speedup = f"{rec.speedup:.2f}x" if rec.speedup is not None else "n/a"
        lines.append(f"# baseline throughput: {rec.baseline_throughput_samples_per_s:.1f} samples/s "
                     f"(speedup {speedup})")
    name = rec.quality_metric
    side = "<=" if rec.quality_direction == "minimize" else ">="
    gate = f" (gate: {side} {rec.gate_quality:.6g})" if rec.gate_quality is not None else ""
    base = "n/a" if rec.baseline_quality is None else f"{rec.baseline_quality:.6g}"
    if rec.baseline_quality_std is not None and rec.baseline_seeds > 1:
        base += f" ± {rec.baseline_quality_std:.2g} over {rec.baseline_seeds} seeds"
    value = "n/a" if rec.quality is None else f"{rec.quality:.6g}"
    lines.append(f"# {name}: {value}{gate}; baseline {name}: {base}")
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
