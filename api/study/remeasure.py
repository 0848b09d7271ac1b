"""The verdict's re-measurement: which configs run again, round by round, and when each is decided
(the rule itself: autotune/contract/verdict.py; the reasoning: docs/measurement.md, "The verdict")."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autotune.api.study.feasibility import fits_memory, is_feasible
from autotune.api.study.front import RANK_METRIC, chosen_by, remeasure_key, remeasure_targets
from autotune.api.study.trials import (
    TrialRecord,
    baseline_target,
    baselines,
    completed,
    finite,
    metric,
    retries,
    service_state,
)
from autotune.contract.protocol import StudySpec
from autotune.contract.verdict import Judgement, judge, level_at
from autotune.contract.views import UNNEEDED_REASON

# The range within which a throughput or an energy per sample takes part in the verdict. The
# service refuses a measured throughput outside [MIN_THROUGHPUT, MAX_THROUGHPUT) (autotune.contract.results),
# but a trial stored before may hold anything, and an energy per sample has no floor there: out of
# this range the ratio of two values overflows (1e-300 against 1.7e308 read "inf×", issue 35).
RATIO_RANGE = (1e-12, 1e12)


def windows_of(trial: TrialRecord, key: str = "window_throughputs") -> list[float]:
    """The trial's finite per-window values of `key` (window_throughputs, window_energy_j_per_sample),
    none above RATIO_RANGE (a trial stored before the service bounded them)."""
    windows = trial.user_attrs.get(key)
    if not isinstance(windows, list):
        return []
    return [float(v) for v in windows if isinstance(v, (int, float)) and math.isfinite(v) and v <= RATIO_RANGE[1]]


@dataclass(frozen=True)
class Remeasurement:
    """Where a study's verdict stands (`remeasurement`): the re-measure rounds so far, replayed
    from the trials, and each candidate's status (autotune.contract.verdict)."""

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
    deferred: frozenset[int] = frozenset()  # candidates the gate refused at the search's budget, their
    # quality judged at the re-measure budget (remeasure.larger_batch_quality "remeasure")

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


def judged_metric(spec: StudySpec) -> tuple[str, bool]:
    """(the metric the verdict compares, whether higher is better): throughput, or energy per sample."""
    by = chosen_by(spec)
    return RANK_METRIC[by], by == "throughput"


def run_values(runs: Sequence[TrialRecord], spec: StudySpec, name: str) -> list[float]:
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
        return dataclasses.replace(j, ratio=finite(j.ratio), ratio_low=finite(j.ratio_low),
                                   ratio_high=finite(j.ratio_high))
    return j


def geomean(values: Sequence[float]) -> float | None:
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
    """Replay the study's verdict from its trials (module docstring; autotune.contract.verdict).

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
    # a target the gate refused can only be a deferred larger batch (front.deferred_candidates)
    deferred = frozenset(c.number for c in cands if is_feasible(c, spec, gate) is False)
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
    name, higher = judged_metric(spec)
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
            j = _judge(run_values(mine, spec, name), run_values(base_runs, spec, name),
                       run_values(mine, spec, "quality"), run_values(base_runs, spec, "quality"), alpha=alpha,
                       abs_tol=spec.gate.abs_tol, k=spec.gate.k, quality_direction=spec.quality_direction,
                       higher_is_better=higher, metric="speedup" if higher else "energy ratio",
                       quality_pairs=None if base_number is None else
                       _seed_pairs(spec, settled, c.number, base_number, rounds_done))
            judgements[c.number] = j
            status[c.number] = j.status
        sign = 1.0 if higher else -1.0
        best = max((sign * g for n, s in status.items() if s == "certified"
                    and (g := geomean(run_values(runs.get(n, []), spec, name))) is not None), default=None)
        if best is not None:
            for c in cands:
                g = geomean(run_values(runs.get(c.number, []), spec, name))
                if status[c.number] == "undecided" and g is not None and sign * g < best:
                    status[c.number] = "stopped"
    base_runs = [*fixed, *runs.get(base_number, [])] if base_number is not None else fixed
    pending = rs.top_k > 0 and (not targets or bool(next_round))
    return Remeasurement(targets=targets, runs=runs, dropped=dropped, pending=pending, baseline=base_number,
                         base_runs=base_runs, status=status, judgements=judgements, rounds_done=rounds_done,
                         round_limit=limit, next_round=next_round, probes=probes, deferred=deferred)


def pooled_energy(runs: Sequence[TrialRecord], spec: StudySpec) -> float | None:
    """Energy per sample of one measurement, or several re-measurements' pooled: their energy
    over their samples, the mean of their values (every run of a config trains the same
    samples); None when a run has none (a figure without it would be too low)."""
    values = [metric(r, spec, "energy_j_per_sample") for r in runs]
    if not values or any(v is None for v in values):
        return None
    return statistics.fmean(v for v in values if v is not None)


def unneeded(rm: Remeasurement, number: int, round_: int) -> str | None:
    """Why a running re-measurement of target `number` in round `round_` no longer counts for the
    verdict `rm` (replayed from the study's trials), or None while it may. A round started ahead of
    the verdict on another worker (api.leasing.round_for) can outlive it: the verdict is in, or its
    config was decided in an earlier round. Rounds are judged in order on runs that never change,
    so a config once decided stays decided, and no later run is read (`remeasurement`)."""
    if not rm.targets:
        return None
    if not rm.pending:
        return f"{UNNEEDED_REASON}the verdict is in after {rm.rounds_done} re-measure round(s)"
    if round_ >= rm.rounds_done and number != rm.baseline and rm.status.get(number, "undecided") != "undecided":
        return (f"{UNNEEDED_REASON}trial {number}'s config was decided ({rm.status[number]}) after "
                f"{rm.rounds_done} re-measure round(s)")
    return None
