"""Judging a study's trials: quality gate, wire views, the recommendation. Pure functions.

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

Gate (autotune.gate): a completed trial is feasible iff its quality q (the study's metric:
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

The verdict (`remeasurement`, `recommend`; the rule is autotune/verdict.py, the reasoning
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

import dataclasses
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from api.optuna_bridge import TrialRecord
from api.outcome import attempt, lost, retriable
from autotune.config import KNOBS, normalised
from autotune.gate import BaselineStats, Estimate, Gate
from autotune.gate import is_feasible as gate_feasible
from autotune.protocol import OBJECTIVES, ConfigVerdict, Recommendation, StudySpec, TrialInfo
from autotune.recommendation import recommendation_yaml, uncertified_yaml  # noqa: F401 (the route imports them here)
from autotune.verdict import Judgement, Sample, judge, level_at, t_ppf, welch

GIB = 2**30
# The range within which a throughput or an energy per sample takes part in the verdict. The
# service refuses a measured throughput outside [MIN_THROUGHPUT, MAX_THROUGHPUT) (autotune.protocol),
# but a trial stored before may hold anything, and an energy per sample has no floor there: out of
# this range the ratio of two values overflows (1e-300 against 1.7e308 read "inf×", issue 35).
RATIO_RANGE = (1e-12, 1e12)


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
    """A draw that repeated a config measured, in flight or failed: never run (OptunaBridge.ask)."""
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
    report and the recommendation all use this one."""
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
    """The configs to re-measure: the top_k *distinct* candidates by throughput, fastest first
    (by energy per sample, lowest first, where energy picks: `chosen_by`; a config drawn twice
    is re-measured once, for its first trial), then the baseline (its first completed seed), so
    that every re-measured config is compared with the baseline at the same sample budget, in
    the same interleaved rounds. Nothing when no candidate is feasible."""
    if spec.remeasure.top_k <= 0 or gate is None:
        return []
    targets: list[TrialRecord] = []
    seen: list[dict[str, Any] | None] = []
    for _, t in ranked_candidates(spec, trials, gate):
        config = knob_config(t)
        if config is not None and config in seen:
            continue
        seen.append(config)
        targets.append(t)
        if len(targets) == spec.remeasure.top_k:
            break
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
    """The trial's finite per-window values of `key` (window_throughputs, window_energy_j_per_sample),
    none above RATIO_RANGE (a trial stored before the service bounded them)."""
    windows = trial.user_attrs.get(key)
    if not isinstance(windows, list):
        return []
    return [float(v) for v in windows if isinstance(v, (int, float)) and math.isfinite(v) and v <= RATIO_RANGE[1]]


@dataclass(frozen=True)
class Remeasurement:
    """Where a study's verdict stands (`remeasurement`): the re-measure rounds so far, replayed
    from the trials, and each candidate's status (autotune.verdict)."""

    targets: list[TrialRecord]  # the configs re-measured: distinct candidates best first, then the baseline
    runs: dict[int, list[TrialRecord]]  # target number -> its completed re-measurements, round by round
    dropped: dict[int, str]  # target number -> why it is out (a re-measurement failed for good)
    pending: bool  # the verdict is not finished: a round is to be created or is running (or the search is on)
    baseline: int | None  # the baseline target's number
    base_runs: list[TrialRecord]  # the baseline's runs at the judged budget (its seeds, with factor 1)
    status: dict[int, str]  # candidate number -> certified | rejected | undecided | failed | stopped
    judgements: dict[int, Judgement]  # candidate number -> its latest judgement
    rounds_done: int  # rounds whose every run has settled
    round_limit: int
    next_round: list[TrialRecord]  # the targets of round `rounds_done`, in creation order (empty: finished)
    probes: int  # re-measure trials that ran (retries of lost ones not counted twice)

    def judged(self, spec: StudySpec, number: int) -> bool | None:
        """Whether target `number`'s quality held at the judged budget: False once its quality
        half was rejected (or a run failed, or did not fit max_memory_gb), True once it was
        certified, None while undecided."""
        if number in self.dropped:
            return False
        j = self.judgements.get(number)
        if j is None or j.margin is None or j.quality_high is None or j.quality_low is None:
            return None
        if j.quality_low > j.margin or not all(fits_memory(r, spec) for r in self.runs.get(number, [])):
            return False
        return True if j.quality_high < j.margin else None

    @property
    def unjudged(self) -> str | None:
        return None


def _by(spec: StudySpec) -> tuple[str, bool]:
    """(the metric the verdict compares, whether higher is better): throughput, or energy per sample."""
    by = chosen_by(spec)
    return RANK_METRIC[by], by == "throughput"


def _values(runs: Sequence[TrialRecord], spec: StudySpec, name: str) -> list[float]:
    """The runs' `name`; a throughput or energy only within RATIO_RANGE (0 is no measurement)."""
    low, high = RATIO_RANGE
    return [v for r in runs if (v := metric(r, spec, name)) is not None and (name == "quality" or low <= v <= high)]


def _judge(cand_metric: Sequence[float], base_metric: Sequence[float], cand_quality: Sequence[float],
           base_quality: Sequence[float], *, alpha: float, metric: str, **kw: Any) -> Judgement:
    """`judge`, with every ratio finite: where the runs spread so widely that the interval of the
    ratio overflows a float (a few runs at wildly different speeds), the candidate is undecided,
    and no number that is not finite stands in the verdict."""
    try:
        j = judge(cand_metric, base_metric, cand_quality, base_quality, alpha=alpha, metric=metric, **kw)
    except OverflowError:
        return Judgement("undecided", f"{metric}: the runs spread too widely for a finite interval; more rounds "
                                      "(or steadier hosts) are needed", alpha=alpha)
    if any(v is not None and not math.isfinite(v) for v in (j.ratio, j.ratio_low, j.ratio_high)):
        return dataclasses.replace(j, ratio=_finite(j.ratio), ratio_low=_finite(j.ratio_low),
                                   ratio_high=_finite(j.ratio_high))
    return j


def _geomean(values: Sequence[float]) -> float | None:
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else None


def _seed_pairs(spec: StudySpec, settled: dict[tuple[int, int], TrialRecord], cand: int, base: int,
                rounds: int) -> list[tuple[float, float]]:
    """(candidate, baseline) quality of the rounds both completed: one probe seed a round."""
    pairs = []
    for r in range(rounds):
        c, b = settled.get((cand, r)), settled.get((base, r))
        if c is None or b is None or not completed(c) or not completed(b):
            continue
        qc, qb = metric(c, spec, "quality"), metric(b, spec, "quality")
        if qc is not None and qb is not None:
            pairs.append((qc, qb))
    return pairs


def remeasurement(spec: StudySpec, trials: Sequence[TrialRecord], gate: float | None) -> Remeasurement:
    """Replay the study's verdict from its trials (module docstring; autotune.verdict).

    Round r runs the baseline and every candidate still undecided after round r − 1, once
    each, with probe seed probe.seed + seed_offset + r (even rounds in rank order, the baseline
    last; odd rounds reversed, so a drifting host favours none). From round `remeasure.min_rounds`
    on, each undecided candidate is judged after its round, at the level `level_at` spends
    on that look; a candidate slower than a certified one stops. The verdict ends when no
    candidate is undecided or after `round_limit` rounds. The runs judged: a candidate's
    re-measurements (its search trial was chosen for its speed: the winner's curse), the
    baseline's re-measurements and, when re-measuring at the search's budget
    (samples_factor 1), its seeds; quality is compared round by round (the rounds both
    completed: one probe seed each), the baseline's runs setting the margin."""
    targets = remeasure_targets(spec, trials, gate)
    state = retries(spec, trials)
    rs = spec.remeasure
    limit = rs.round_limit(spec.n_trials)
    base = baseline_target(trials)
    base_number = base.number if base is not None and any(t.number == base.number for t in targets) else None
    cands = [t for t in targets if t.number != base_number]
    settled: dict[tuple[int, int], TrialRecord] = {}
    probes = 0
    for t in trials:
        key = remeasure_key(t)
        if key is not None and state.settled(t):
            settled[key] = t
        if key is not None and t.finished and not state.superseded(t):
            probes += 1
    fixed = []
    if rs.samples_factor == 1.0:
        fixed = [t for t in baselines(trials) if completed(t) and not state.superseded(t)]
    runs: dict[int, list[TrialRecord]] = {}
    dropped: dict[int, str] = {}
    status = {c.number: "undecided" for c in cands}
    judgements: dict[int, Judgement] = {}
    name, higher = _by(spec)
    looks = limit - rs.min_rounds + 1
    next_round: list[TrialRecord] = []
    rounds_done = 0
    for r in range(limit if cands else 0):
        planned = [c for c in cands if status[c.number] == "undecided"]
        if not planned:
            break
        order = [*planned, *([base] if base is not None and base_number is not None else [])]
        order = order if r % 2 == 0 else order[::-1]
        if not all((t.number, r) in settled for t in order):
            next_round = order
            break
        for t in order:
            run = settled[(t.number, r)]
            if completed(run) and metric(run, spec, name) is not None:
                runs.setdefault(t.number, []).append(run)
            elif t.number != base_number:
                kind = run.user_attrs.get("failure_kind") or service_state(run).lower()
                dropped.setdefault(t.number, f"its re-measurement (trial {run.number}) failed ({kind})")
                status[t.number] = "failed"
        rounds_done = r + 1
        if rounds_done < rs.min_rounds:
            continue
        look = rounds_done - rs.min_rounds + 1
        alpha = level_at(rs.confidence, len(cands), look, looks)
        base_runs = [*fixed, *runs.get(base_number, [])] if base_number is not None else fixed
        for c in planned:
            if status[c.number] != "undecided":
                continue
            mine = runs.get(c.number, [])
            if not all(fits_memory(m, spec) for m in mine):
                status[c.number] = "rejected"
                judgements[c.number] = Judgement("rejected", f"a re-measurement's peak memory exceeds max_memory_gb "
                                                             f"({spec.max_memory_gb} GiB)")
                continue
            j = _judge(_values(mine, spec, name), _values(base_runs, spec, name), _values(mine, spec, "quality"),
                      _values(base_runs, spec, "quality"), alpha=alpha, abs_tol=spec.gate.abs_tol, k=spec.gate.k,
                      quality_direction=spec.quality_direction, higher_is_better=higher,
                      metric="speedup" if higher else "energy ratio",
                      quality_pairs=None if base_number is None else
                      _seed_pairs(spec, settled, c.number, base_number, rounds_done))
            judgements[c.number] = j
            status[c.number] = j.status
        sign = 1.0 if higher else -1.0
        best = max((sign * g for n, s in status.items() if s == "certified"
                    and (g := _geomean(_values(runs.get(n, []), spec, name))) is not None), default=None)
        if best is not None:
            for c in cands:
                g = _geomean(_values(runs.get(c.number, []), spec, name))
                if status[c.number] == "undecided" and g is not None and sign * g < best:
                    status[c.number] = "stopped"
    base_runs = [*fixed, *runs.get(base_number, [])] if base_number is not None else fixed
    pending = rs.top_k > 0 and (not targets or bool(next_round))
    return Remeasurement(targets=targets, runs=runs, dropped=dropped, pending=pending, baseline=base_number,
                         base_runs=base_runs, status=status, judgements=judgements, rounds_done=rounds_done,
                         round_limit=limit, next_round=next_round, probes=probes)


def front_values(spec: StudySpec, trials: Sequence[TrialRecord]) -> dict[int, list[float]]:
    """Trial number -> the objective values (the spec's order) of every candidate on which the
    front is computed: a feasible search trial at its re-measured value where it has one (the
    geometric-mean throughput and the mean quality of its re-measurements). A candidate whose
    re-measurement failed, or whose quality the verdict showed worse, is left out."""
    gate = gate_quality(spec, trials)
    rm = remeasurement(spec, trials, gate)
    out: dict[int, list[float]] = {}
    for t in candidates(spec, trials, gate):
        if t.number in rm.dropped or rm.judged(spec, t.number) is False:
            continue
        runs = rm.runs.get(t.number) or [t]
        throughput = _geomean(_values(runs, spec, "throughput_samples_per_s"))
        quality = _values(runs, spec, "quality")
        energy = _pooled_energy(runs, spec)
        if throughput is None or not quality or ("energy" in spec.objectives and energy is None):
            continue
        measured = {"throughput_samples_per_s": throughput, "quality": statistics.fmean(quality),
                    "energy_j_per_sample": energy}
        out[t.number] = [float(measured[OBJECTIVES[o][0]] or 0.0) for o in spec.objectives]
    return out


def _config_verdict(spec: StudySpec, target: TrialRecord, runs: Sequence[TrialRecord], role_: str, status: str,
                    judgement: Judgement | None, reason: str = "") -> ConfigVerdict:
    """One row of the verdict's inputs (Recommendation.configs)."""
    thr = _values(runs, spec, "throughput_samples_per_s")
    qual = _values(runs, spec, "quality")
    logs = [math.log(v) for v in thr]
    j = judgement
    return ConfigVerdict(
        trial_number=target.number, role=role_, status=status, reason=reason or (j.reason if j else ""),  # type: ignore[arg-type]
        config=knob_config(target) or {}, n=len(thr), throughput_samples_per_s=_geomean(thr),
        throughput_sd_log=statistics.stdev(logs) if len(logs) > 1 else None, throughputs=thr,
        quality_mean=statistics.fmean(qual) if qual else None,
        quality_sd=statistics.stdev(qual) if len(qual) > 1 else None, qualities=qual,
        speedup=j.ratio if j else None, speedup_ci_low=j.ratio_low if j else None,
        speedup_ci_high=j.ratio_high if j else None, quality_diff=j.quality_diff if j else None,
        quality_diff_ci_high=j.quality_high if j else None, quality_margin=j.margin if j else None,
        alpha=j.alpha if j else None)


def verdict_rows(spec: StudySpec, trials: Sequence[TrialRecord], rm: Remeasurement) -> list[ConfigVerdict]:
    """The decision rule's inputs, the baseline first, then the candidates in rank order."""
    rows = []
    base = next((t for t in rm.targets if t.number == rm.baseline), None)
    if base is not None:
        rows.append(_config_verdict(spec, base, rm.base_runs, "baseline", "baseline", None,
                                    f"{len(rm.base_runs)} runs at the judged budget"))
    for t in rm.targets:
        if t.number == rm.baseline:
            continue
        status = rm.status.get(t.number, "undecided")
        why = rm.dropped.get(t.number, "") if status == "failed" else \
            ("slower than a certified config: no longer measured" if status == "stopped" else "")
        rows.append(_config_verdict(spec, t, rm.runs.get(t.number, []), "candidate", status,
                                    rm.judgements.get(t.number), why))
    return rows


def recommend(study_name: str, spec: StudySpec, trials: Sequence[TrialRecord]) -> Recommendation:
    """The study's verdict once its re-measurement has finished: the fastest certified candidate
    (the lowest energy per sample where energy picks: `chosen_by`), or, when none was
    certified, the baseline's own config with certified False and the fastest uncertified
    candidate beside it. With re-measurement off (remeasure.top_k 0) nothing is judged: the
    baseline's config again, the search's fastest candidate as the uncertified one. Raises
    NoRecommendation while there is nothing to say yet, or when the baseline failed."""
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
    _, higher = _by(spec)
    scored_pool = ranked_candidates(spec, trials, gate)
    search_over = search_done(spec, trials, spec.n_trials)
    if not scored_pool and not search_over:
        what = "a throughput" if by == "throughput" else "an energy per sample"
        raise NoRecommendation(f"study {study_name!r} has no feasible search trial with {what} yet "
                               "(baseline seeds are the reference, never a recommendation)")
    rm = remeasurement(spec, trials, gate)
    qname = quality_name(spec, trials)
    if scored_pool and rm.pending:
        score0, first = scored_pool[0]
        so_far = (f"the fastest search trial so far is trial {first.number} at {score0:,.1f} samples/s"
                  if by == "throughput" else
                  f"the search trial with the lowest energy so far is trial {first.number} at {score0:.4g} J/sample")
        raise NoRecommendation(
            f"study {study_name!r} has no verdict yet: its top configs and the baseline are being re-measured "
            f"(round {rm.rounds_done + 1} of at most {rm.round_limit}; {rm.probes} re-measurements so far); {so_far}")
    base = baseline_target(trials)
    assert base is not None
    rows = verdict_rows(spec, trials, rm)
    base_runs = rm.base_runs or [t for t in runs if completed(t) and not retries(spec, trials).superseded(t)]
    certified = [r for r in rows if r.status == "certified"]
    sign = 1.0 if higher else -1.0
    caveats: list[str] = []
    if certified:
        pick_row = max(certified, key=lambda r: (sign * (r.throughput_samples_per_s or 0.0)
                                                 if higher else sign * _energy_of(rm, r, spec), -r.trial_number))
        outcome = "certified"
        reason = (f"trial {pick_row.trial_number} is certified: {rm.judgements[pick_row.trial_number].reason} "
                  f"(after {rm.rounds_done} round{'s' if rm.rounds_done != 1 else ''})")
    else:
        pick_row = None
        if spec.remeasure.top_k <= 0:
            outcome = "not_judged"
            reason = ("nothing was judged: re-measurement is off (remeasure.top_k 0), so no config was shown faster "
                      "beyond the noise; keep the baseline config, or turn re-measurement on")
        elif not scored_pool:
            outcome = "no_win"
            reason = (f"no search trial kept the baseline's {qname} (none passed the quality gate); keep the baseline "
                      "config, or widen the search")
        elif any(r.status == "undecided" for r in rows):
            outcome = "undecided"
            reason = (f"no config was certified within the re-measure budget ({rm.rounds_done} rounds of at most "
                      f"{rm.round_limit}): the fastest was neither shown faster and no worse nor shown otherwise; keep "
                      "the baseline config, or raise remeasure.max_rounds or measure on a quieter host")
        else:
            outcome = "no_win"
            whys = "; ".join(f"trial {r.trial_number}: {r.reason}" for r in rows if r.role == "candidate")
            reason = f"no config beat the baseline: {whys}; keep the baseline config"
    # the fastest uncertified candidate (what --uncertified prints)
    others = [r for r in rows if r.role == "candidate" and r.status != "certified" and r.n > 0]
    uncertified = max(others, key=lambda r: sign * (r.throughput_samples_per_s or 0.0)) if others else None
    if uncertified is None and pick_row is None and scored_pool:
        _, top = scored_pool[0]
        uncertified = _config_verdict(spec, top, [top], "candidate", "undecided", None,
                                      "not re-measured: the search's own measurement, flattered by being the fastest "
                                      "of many (winner's curse)")
    chosen = next(t for t in trials if t.number == (pick_row.trial_number if pick_row else base.number))
    pick_runs = rm.runs.get(chosen.number, []) if pick_row else base_runs
    base_row = rows[0] if rows and rows[0].role == "baseline" else _config_verdict(
        spec, base, base_runs, "baseline", "baseline", None)
    j = rm.judgements.get(chosen.number) if pick_row else None
    thr = (pick_row.throughput_samples_per_s if pick_row else base_row.throughput_samples_per_s) \
        or metric(chosen, spec, "throughput_samples_per_s") or 0.0
    base_thr = base_row.throughput_samples_per_s
    ci = _run_interval(_values(pick_runs, spec, "throughput_samples_per_s"))
    if ci is None:  # one run: the interval over its windows (which leaves out the run-to-run spread)
        windows = [w for r in pick_runs for w in _windows(r)]
        ci = Estimate.for_rate(windows) if len(windows) >= 2 else None
    run = pick_runs[-1] if pick_runs else chosen
    notes = [str(n) for n in run.user_attrs.get("measurement_notes") or []]
    energy = _energy_ratio(pick_runs, base_runs, spec) if pick_row else None
    saves = None if energy is None or energy[2] is None else energy[2] < 1.0
    methods = sorted({str(m) for r in [*pick_runs, *base_runs] if (m := r.user_attrs.get("energy_method"))})
    peak = run.user_attrs.get("peak_mem_reserved_bytes")
    quality = (pick_row.quality_mean if pick_row else base_row.quality_mean)
    base_quality = base_row.quality_mean if base_row.quality_mean is not None else summary.quality.mean
    base_sd = base_row.quality_sd if base_row.quality_sd is not None else summary.quality.std
    margin = j.margin if j is not None and j.margin is not None else None
    qsign = 1.0 if spec.quality_direction == "minimize" else -1.0
    gate_used = base_quality + qsign * margin if margin is not None else gate
    nrmse = qname == "val_nrmse"
    config = chosen.user_attrs.get("config") or {}
    if spec.remeasure.top_k <= 0 and scored_pool:
        caveats.append("not re-measured (remeasure.top_k is 0): the search's own measurements, and the fastest of many "
                       "noisy measurements is flattered by its luck (winner's curse)")
    return Recommendation(
        study=study_name, config={k: v for k, v in config.items() if k in KNOBS}, trial_number=chosen.number,
        throughput_samples_per_s=thr, val_nrmse=quality if nrmse else None,
        baseline_throughput_samples_per_s=base_thr, baseline_val_nrmse=base_quality if nrmse else None,
        speedup=j.ratio if j and higher else (1.0 if pick_row is None else _ratio_of(thr, base_thr)),
        gate_nrmse=gate_used if nrmse else None,
        quality_metric=qname, quality_direction=spec.quality_direction, quality=quality,
        baseline_quality=base_quality, baseline_quality_std=base_sd, gate_quality=gate_used,
        peak_mem_reserved_bytes=int(peak) if isinstance(peak, (int, float)) and not isinstance(peak, bool) else None,
        throughput_ci_low=ci.low if ci else None, throughput_ci_high=ci.high if ci else None,
        remeasured=bool(pick_row), remeasure_rounds=len(pick_runs) if pick_row else 0,
        round_throughputs=_values(pick_runs, spec, "throughput_samples_per_s") if pick_row else [],
        baseline_val_nrmse_std=base_sd if nrmse else None, baseline_seeds=len(base_runs),
        measurement_notes=notes, caveats=caveats,
        speedup_ci_low=j.ratio_low if j and higher else None, speedup_ci_high=j.ratio_high if j and higher else None,
        beats_baseline=bool(pick_row) if higher else None,
        verdict=_verdict_sentence(outcome, reason, j if higher else None),
        quality_budget="remeasure" if spec.remeasure.samples_factor > 1 else "search",
        search_quality=metric(chosen, spec, "quality"), search_gate_quality=gate,
        search_throughput_samples_per_s=metric(chosen, spec, "throughput_samples_per_s"),
        baseline_remeasured=rm.baseline is not None and bool(rm.runs.get(rm.baseline)),
        chosen_by=by, energy_j_per_sample=_pooled_energy(pick_runs, spec) if pick_row else None,
        baseline_energy_j_per_sample=_pooled_energy(base_runs, spec),
        energy_ratio=energy[0] if energy else None, energy_ratio_ci_low=energy[1] if energy else None,
        energy_ratio_ci_high=energy[2] if energy else None, saves_energy=saves,
        energy_method=" + ".join(methods) or None,
        energy_verdict=_energy_sentence(energy, saves) if energy else "",
        certified=bool(pick_row), outcome=outcome, reason=reason, configs=rows,  # type: ignore[arg-type]
        rounds_run=rm.rounds_done, max_rounds=rm.round_limit, remeasure_probes=rm.probes, uncertified=uncertified,
    )


def _ratio_of(pick: float | None, base: float | None) -> float | None:
    """The pick's throughput over the baseline's (an energy-picked verdict's speedup, no interval)."""
    return pick / base if pick and base else None


def _run_interval(throughputs: Sequence[float]) -> Estimate | None:
    """The 95 % interval of a config's throughput from its runs (the unit of replication):
    Student t on the mean log throughput, around the geometric mean; None with fewer than 2 runs."""
    if len(throughputs) < 2:
        return None
    logs = Sample.of([math.log(v) for v in throughputs])
    half = t_ppf(0.975, logs.n - 1) * logs.sd / math.sqrt(logs.n)
    return Estimate(math.exp(logs.mean), math.exp(logs.mean - half), math.exp(logs.mean + half), logs.n)


def _energy_of(rm: Remeasurement, row: ConfigVerdict, spec: StudySpec) -> float:
    return _geomean(_values(rm.runs.get(row.trial_number, []), spec, "energy_j_per_sample")) or math.inf


def _energy_ratio(pick: Sequence[TrialRecord], base: Sequence[TrialRecord], spec: StudySpec
                  ) -> tuple[float, float | None, float | None] | None:
    """The pick's energy per sample over the baseline's (geometric means) with a Welch 95 % interval."""
    p, b = _values(pick, spec, "energy_j_per_sample"), _values(base, spec, "energy_j_per_sample")
    if not p or not b:
        return None
    ratio = (_geomean(p) or 0.0) / (_geomean(b) or 1.0)
    if len(p) < 2 or len(b) < 2:
        return ratio, None, None
    d = welch(Sample.of([math.log(v) for v in p]), Sample.of([math.log(v) for v in b]))
    low, high = d.bounds(0.025)
    try:
        return ratio, math.exp(low), math.exp(high)
    except OverflowError:  # the runs spread too widely for a finite interval: the ratio alone
        return ratio, None, None


def _energy_sentence(energy: tuple[float, float | None, float | None], saves: bool | None) -> str:
    ratio, low, high = energy
    if low is None or high is None:
        return f"{ratio:.2f}× the baseline's energy per sample; no confidence interval (fewer than 2 runs a side)"
    interval = f"{ratio:.2f}× (95 % CI {low:.2f}–{high:.2f}×) the baseline's energy per sample"
    if saves:
        return f"{interval}: less energy beyond the noise"
    if low > 1.0:
        return f"{interval}: more energy beyond the noise"
    return f"{interval}: not told apart from the baseline's beyond the noise"


def _verdict_sentence(outcome: str, reason: str, j: Judgement | None) -> str:
    """One sentence: the speedup with its interval and whether it is certified."""
    if outcome == "certified" and j is not None and j.ratio is not None:
        return (f"{j.ratio:.2f}× (interval {j.ratio_low:.2f}–{j.ratio_high:.2f}×) the baseline's throughput, "
                "certified: faster beyond the noise and no worse")
    if outcome == "certified":
        return "certified: " + reason
    return reason


def _pooled_energy(runs: Sequence[TrialRecord], spec: StudySpec) -> float | None:
    """Energy per sample of one measurement, or several re-measurements' pooled: their energy
    over their samples, the mean of their values (every run of a config trains the same
    samples); None when a run has none (a figure without it would be too low)."""
    values = [metric(r, spec, "energy_j_per_sample") for r in runs]
    if not values or any(v is None for v in values):
        return None
    return statistics.fmean(v for v in values if v is not None)


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
