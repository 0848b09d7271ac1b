"""Candidates (feasible search trials that ran, not the baseline's config again) and their ranking."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

from autotune.api.study.feasibility import baseline_summary, fits_memory, is_feasible
from autotune.api.study.trials import (
    TrialRecord,
    baseline_repeat_of,
    baseline_target,
    completed,
    first_attempts,
    has_larger_batch,
    is_repeat,
    knob_config,
    metric,
    retries,
    role,
)
from autotune.contract.protocol import StudySpec


def candidates(spec: StudySpec, trials: Sequence[TrialRecord], gate: float | None) -> list[TrialRecord]:
    """The trials a recommendation may name: feasible search trials that ran (not a repeat of
    another trial, not the baseline's config drawn again). Baseline seeds never are: a
    baseline that happens to measure fastest is the baseline, not a finding."""
    return [t for t in trials if role(t) == "search" and not is_repeat(t) and is_feasible(t, spec, gate)
            and baseline_repeat_of(t, trials) is None]


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


def rank_sign(spec: StudySpec) -> float:
    """−1 where the ranking metric is better higher (throughput), +1 where lower (energy): sign × score
    sorts best first, and a is better than b when sign × a < sign × b."""
    return -1.0 if chosen_by(spec) == "throughput" else 1.0


def ranked_candidates(spec: StudySpec, trials: Sequence[TrialRecord], gate: float | None
                      ) -> list[tuple[float, TrialRecord]]:
    """(score, trial) of the candidates that have the ranking metric (`chosen_by`), best first:
    the fastest, or the lowest energy per sample; ties by trial number."""
    by, sign = chosen_by(spec), rank_sign(spec)
    ranked = [(v, t) for t in candidates(spec, trials, gate) if (v := metric(t, spec, RANK_METRIC[by])) is not None]
    return sorted(ranked, key=lambda c: (sign * c[0], c[1].number))


def deferred_candidates(spec: StudySpec, trials: Sequence[TrialRecord], gate: float | None
                        ) -> list[tuple[float, TrialRecord]]:
    """(score, trial) of the search trials whose quality the study judges at the re-measure budget
    instead (remeasure.larger_batch_quality "remeasure"), best first by the ranking metric
    (`chosen_by`: the fastest, or the lowest energy per sample): completed, within the memory
    limit, a larger effective batch than the baseline's (`has_larger_batch`), and refused by the
    gate at the search's budget. Only those better than every candidate are of use
    (`remeasure_targets`). Empty under the default ("search")."""
    if spec.remeasure.larger_batch_quality != "remeasure" or gate is None:
        return []
    by, sign = chosen_by(spec), rank_sign(spec)
    out = [(v, t) for t in trials
           if role(t) == "search" and completed(t) and not is_repeat(t) and fits_memory(t, spec)
           and is_feasible(t, spec, gate) is False and baseline_repeat_of(t, trials) is None
           and has_larger_batch(t, trials) and (v := metric(t, spec, RANK_METRIC[by])) is not None]
    return sorted(out, key=lambda c: (sign * c[0], c[1].number))


SCORE_TIE = 0.02  # deferred configs within 2 % of the best one's search score count as equally good


def deferred_order(spec: StudySpec, deferred: Sequence[tuple[float, TrialRecord]]
                   ) -> list[tuple[float, TrialRecord]]:
    """The order in which deferred configs are re-measured: those within SCORE_TIE of the best one
    (its throughput, or its energy per sample) first, the one whose search quality came closest to
    the gate leading (two lr rules on one larger batch run at one speed, and the one nearer the
    gate is the likelier to pass it at the re-measure budget); then the rest, best first.
    `deferred`: best first (`deferred_candidates`)."""
    if not deferred:
        return []
    sign, best = rank_sign(spec), deferred[0][0]
    tied = [c for c in deferred if sign * c[0] <= sign * best + SCORE_TIE * abs(best)]
    quality_sign = 1.0 if spec.quality_direction == "minimize" else -1.0

    def closeness(c: tuple[float, TrialRecord]) -> float:
        quality = metric(c[1], spec, "quality")
        return quality_sign * quality if quality is not None else float("inf")

    return [*sorted(tied, key=closeness), *deferred[len(tied):]]  # a stable sort: equal ones stay best first


def headroom(spec: StudySpec, trials: Sequence[TrialRecord], gate: float) -> Callable[[TrialRecord], bool]:
    """Whether a trial's search quality beat the baseline seeds' mean by at least the gate's margin
    (the gate's distance from that mean, on the better side): a config likely to be shown no worse
    than the baseline at the verdict's first look (`remeasure_targets`)."""
    base = baseline_summary(spec, trials).quality
    sign = 1.0 if spec.quality_direction == "minimize" else -1.0

    def clears(trial: TrialRecord) -> bool:
        quality = metric(trial, spec, "quality")
        return base is not None and quality is not None and sign * (quality - base.mean) <= -abs(gate - base.mean)

    return clears


def remeasure_targets(spec: StudySpec, trials: Sequence[TrialRecord], gate: float | None) -> list[TrialRecord]:
    """The configs to re-measure: the top_k *distinct* candidates by throughput, fastest first
    (by energy per sample, lowest first, where energy picks: `chosen_by`; a config drawn twice
    is re-measured once, for its first trial); then, under remeasure.quality_headroom (the default)
    and when none of those has quality headroom (`headroom`), the fastest distinct candidate
    that has; then, under remeasure.larger_batch_quality
    "remeasure", up to top_k distinct larger-batch configs the gate refused at the search's budget
    that ran faster than the fastest candidate (used less energy per sample than the thriftiest,
    where energy picks) (`deferred_candidates`: their quality is judged at the re-measure budget;
    among equally good ones the nearest the gate first: `deferred_order`),
    then the baseline (its first completed seed), so that every
    re-measured config is compared with the baseline at the same sample budget, in the same
    interleaved rounds. Nothing when there is nothing to re-measure."""
    if spec.remeasure.top_k <= 0 or gate is None:
        return []
    targets: list[TrialRecord] = []
    seen: list[dict[str, Any] | None] = []

    def take(pool: Sequence[tuple[float, TrialRecord]], limit: int) -> None:
        taken = 0
        for _, t in pool:
            if taken == limit:
                break
            config = knob_config(t)
            if config is not None and config in seen:
                continue
            seen.append(config)
            targets.append(t)
            taken += 1

    ranked = ranked_candidates(spec, trials, gate)
    take(ranked, spec.remeasure.top_k)
    if spec.remeasure.quality_headroom:
        clears = headroom(spec, trials, gate)
        if not any(clears(t) for t in targets):
            take([c for c in ranked if clears(c[1])], 1)
    lead, sign = (ranked[0][0] if ranked else None), rank_sign(spec)  # the best candidate's score
    take(deferred_order(spec, [(v, t) for v, t in deferred_candidates(spec, trials, gate)
                               if lead is None or sign * v < sign * lead]), spec.remeasure.top_k)
    base = baseline_target(trials)
    return [*targets, base] if targets and base is not None else targets
