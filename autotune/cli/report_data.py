"""What the report computes from the REST API's answers alone (study, trials, recommendation),
so it runs anywhere the service is reachable: the candidates and their front, the best so far,
the verdict's re-measured points and quality bound, parameter importances, and the small
formatting helpers the page and the figures share."""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from autotune.contract.views import ConfigVerdict, Recommendation, StudyInfo, TrialInfo

log = logging.getLogger(__name__)

# Importances from fewer completed search trials rank noise: a knob that did nothing can come
# out above the one that changed quality (seen at 10 trials), so they are not drawn.
MIN_IMPORTANCE_TRIALS = 20


def quality_of(t: TrialInfo) -> float | None:
    """The trial's quality metric (`quality`; `val_nrmse` from a service older than the field)."""
    return t.quality if t.quality is not None else t.val_nrmse


def quality_label(study: StudyInfo, trials: list[TrialInfo]) -> str:
    """The study's quality metric as users read it: "NRMSE" for val_nrmse, else its own name."""
    name = study.spec.quality_metric or next((t.quality_metric for t in trials if t.quality_metric), None)
    return "NRMSE" if name in (None, "val_nrmse") else str(name)


def measured(t: TrialInfo) -> bool:
    return t.state == "COMPLETE" and bool(t.throughput_samples_per_s) and quality_of(t) is not None


def completed(trials: list[TrialInfo]) -> list[TrialInfo]:
    return [t for t in trials if measured(t)]


def candidates(trials: list[TrialInfo]) -> list[TrialInfo]:
    """The trials the front and the recommendation are made of: feasible search trials that ran,
    less any that drew the baseline's config (api/study `candidates`)."""
    return [t for t in completed(trials) if t.role == "search" and not t.is_baseline and t.feasible
            and t.repeat_of is None and t.baseline_repeat_of is None]


def pareto_front(trials: list[TrialInfo], direction: str = "minimize",
                 objectives: tuple[str, ...] = ("throughput", "quality")) -> list[TrialInfo]:
    """Candidates (`candidates`) not dominated in `objectives` (max throughput, best quality in
    `direction`, least energy per sample), by throughput. The service's GET /pareto is the same
    set at re-measured values; this is the fallback for answers without it."""
    def point(t: TrialInfo) -> list[float] | None:
        """Each objective's value, larger is better."""
        values = {"throughput": t.throughput_samples_per_s, "quality": quality_of(t), "energy": t.energy_j_per_sample}
        signs = {"throughput": 1.0, "quality": -1.0 if direction == "minimize" else 1.0, "energy": -1.0}
        out = [values[o] for o in objectives]
        return None if any(v is None for v in out) else [signs[o] * float(v or 0.0) for o, v in
                                                           zip(objectives, out, strict=True)]

    points = [(t, p) for t in candidates(trials) if (p := point(t)) is not None]
    front = [t for t, p in points
             if not any(all(x >= y for x, y in zip(q, p, strict=True)) and q != p for _, q in points)]
    return sorted(front, key=lambda t: t.throughput_samples_per_s or 0.0)


def chosen_by(study: StudyInfo, recommendation: Recommendation | None = None) -> str:
    """What picks the study's recommendation: "energy" ([energy, quality]) or "throughput"
    (api/study `chosen_by`)."""
    if recommendation is not None:
        return recommendation.chosen_by
    objectives = study.spec.objectives
    return "energy" if "energy" in objectives and "throughput" not in objectives else "throughput"


def baseline_energy(trials: list[TrialInfo], recommendation: Recommendation | None = None) -> float | None:
    """The baseline energy per sample ratios are over: the recommendation's, else the mean of the seeds'."""
    if recommendation is not None and recommendation.baseline_energy_j_per_sample:
        return recommendation.baseline_energy_j_per_sample
    seeds = [t.energy_j_per_sample for t in trials if t.is_baseline and t.state == "COMPLETE"
             and t.energy_j_per_sample]
    return sum(seeds) / len(seeds) if seeds else None


def _running_best(trials: list[TrialInfo], base: float | None, value_of: Callable[[TrialInfo], float | None],
                  better: Callable[[float, float], float]) -> list[tuple[int, float | None]]:
    """(trial number, the `better` of value / `base` among the candidates up to it)."""
    eligible = {t.number for t in candidates(trials)}
    best: float | None = None
    out = []
    for t in sorted(trials, key=lambda t: t.number):
        value = value_of(t)
        if base and t.number in eligible and value:
            best = value / base if best is None else better(best, value / base)
        out.append((t.number, best))
    return out


def lowest_energy_so_far(trials: list[TrialInfo], base: float | None) -> list[tuple[int, float | None]]:
    """(trial number, the lowest energy per sample over `base` among the candidates up to it)."""
    return _running_best(trials, base, lambda t: t.energy_j_per_sample, min)


def baseline_throughput(trials: list[TrialInfo], recommendation: Recommendation | None = None) -> float | None:
    """The baseline throughput speedups are over: the recommendation's (the baseline re-measured
    with the pick, or its seeds' mean), else the mean of the completed baseline seeds."""
    if recommendation is not None and recommendation.baseline_throughput_samples_per_s:
        return recommendation.baseline_throughput_samples_per_s
    seeds = [t.throughput_samples_per_s for t in trials if t.is_baseline and t.state == "COMPLETE"
             and t.throughput_samples_per_s]
    return sum(seeds) / len(seeds) if seeds else None


def best_so_far(trials: list[TrialInfo], base: float | None = None) -> list[tuple[int, float | None]]:
    """(trial number, best speedup over `base` (default: `baseline_throughput`) among the
    candidates up to it)."""
    return _running_best(trials, base or baseline_throughput(trials), lambda t: t.throughput_samples_per_s, max)


@dataclass(frozen=True)
class RemeasuredPoint:
    """A re-measured config at the values the verdict judges it on: the geometric-mean
    throughput and the mean quality of its runs at the judged budget (and its energy per sample,
    the runs' mean, None where a run has none)."""

    number: int  # the search trial it stands for, or the baseline's first completed seed
    role: Literal["baseline", "candidate"]
    n: int  # runs the point pools (the baseline's: its seeds too at samples_factor 1)
    remeasures: int  # of them, re-measure trials
    throughput_samples_per_s: float
    quality: float
    energy_j_per_sample: float | None
    status: str | None  # the verdict's (certified, rejected, ...); None: not judged yet


def _geomean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def remeasured_points(study: StudyInfo, trials: list[TrialInfo],
                      recommendation: Recommendation | None = None) -> list[RemeasuredPoint]:
    """Every config the verdict re-measured, aggregated the way the verdict aggregates
    (api/study `remeasurement`): throughput the geometric mean and quality the mean of a
    config's completed re-measurements; the baseline's runs are its re-measurements and, at the
    search's budget (remeasure.samples_factor 1), its seeds. Where the recommendation carries the
    verdict's inputs (`configs`) their numbers are taken as they are, with their status. The
    baseline first, then the candidates by number; the baseline only once it was re-measured."""
    baseline_numbers = {t.number for t in trials if t.is_baseline}
    runs: dict[int, list[TrialInfo]] = {}
    for t in trials:
        if t.role == "remeasure" and t.remeasure_of is not None and measured(t):
            runs.setdefault(t.remeasure_of, []).append(t)
    seeds = [t for t in completed(trials) if t.is_baseline and t.retried_as is None]

    def energy_of(pooled: list[TrialInfo]) -> float | None:
        values = [t.energy_j_per_sample for t in pooled]
        return statistics.fmean(v for v in values if v is not None) if values and None not in values else None

    points: dict[int, RemeasuredPoint] = {}
    for number, mine in runs.items():
        base = number in baseline_numbers
        pooled = [*seeds, *mine] if base and study.spec.remeasure.samples_factor == 1.0 else mine
        points[number] = RemeasuredPoint(
            number=number, role="baseline" if base else "candidate", n=len(pooled), remeasures=len(mine),
            throughput_samples_per_s=_geomean([t.throughput_samples_per_s or 0.0 for t in pooled]),
            quality=statistics.fmean(quality_of(t) or 0.0 for t in pooled), energy_j_per_sample=energy_of(pooled),
            status=None)
    if recommendation is not None:
        _take_verdict_rows(recommendation, points)
    return sorted(points.values(), key=lambda p: (p.role != "baseline", p.number))


def _take_verdict_rows(r: Recommendation, points: dict[int, RemeasuredPoint]) -> None:
    """Put the verdict's own numbers (`Recommendation.configs`) into `points`, by trial number."""
    for row in r.configs:
        if not row.n or row.throughput_samples_per_s is None or row.quality_mean is None:
            continue
        known = points.get(row.trial_number)
        if row.role == "baseline" and not (r.baseline_remeasured or known is not None):
            continue  # its seeds alone: drawn as the seeds
        energy = (r.baseline_energy_j_per_sample if row.role == "baseline"
                  else r.energy_j_per_sample if r.certified and row.trial_number == r.trial_number
                  else known.energy_j_per_sample if known is not None else None)
        points[row.trial_number] = RemeasuredPoint(
            number=row.trial_number, role=row.role, n=row.n, remeasures=known.remeasures if known else row.n,
            throughput_samples_per_s=row.throughput_samples_per_s, quality=row.quality_mean,
            energy_j_per_sample=energy, status=None if row.role == "baseline" else row.status)


def search_gate(recommendation: Recommendation | None) -> float | None:
    """The quality gate that judged every search trial (feasible or not): the baseline seeds' mean
    + max(abs_tol, k·σ) at the search's budget (`search_gate_quality`; from a service older than
    that field, `gate_quality`, which was that gate)."""
    r = recommendation
    if r is None:
        return None
    if r.search_gate_quality is not None:
        return r.search_gate_quality
    return r.gate_quality if r.gate_quality is not None else r.gate_nrmse


@dataclass(frozen=True)
class VerdictBound:
    """What the verdict tested a certified pick's quality against, as a quality level: the
    baseline's mean at the judged budget + the margin Δ = max(abs_tol, k · its sd) (signed by the
    quality's direction). The rule holds the upper bound of the pick's quality difference from
    the baseline below Δ, so the pick's mean lies below this level with room to spare."""

    quality: float  # Recommendation.gate_quality
    baseline_quality: float
    margin: float
    baseline_runs: int


def verdict_bound(recommendation: Recommendation | None) -> VerdictBound | None:
    """The certified pick's `VerdictBound`; None without a certified pick, or when the
    recommendation's gate is the search's own (nothing judged at another level)."""
    r = recommendation
    if r is None or not r.certified or r.gate_quality is None or r.baseline_quality is None:
        return None
    if r.search_gate_quality is None or r.gate_quality == r.search_gate_quality:
        return None  # one gate (or a service older than search_gate_quality: gate_quality is the gate)
    row = config_row(r, r.trial_number, "candidate")
    margin = row.quality_margin if row is not None and row.quality_margin is not None else \
        abs(r.gate_quality - r.baseline_quality)
    base = config_row(r, None, "baseline")
    return VerdictBound(r.gate_quality, r.baseline_quality, margin, base.n if base is not None else r.baseline_seeds)


def config_row(r: Recommendation, number: int | None, role: str) -> ConfigVerdict | None:
    return next((c for c in r.configs if c.role == role and (number is None or c.trial_number == number)), None)


def importances(study: StudyInfo, trials: list[TrialInfo]) -> dict[str, dict[str, float]]:
    """Parameter importances per objective, from the completed trials' searched params.

    Rebuilds an in-memory Optuna study from the trials (with the space's distributions) and
    runs optuna.importance on it. Empty below MIN_IMPORTANCE_TRIALS completed search trials
    (`searched`), or when no parameter could be ranked.
    """
    import optuna
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no "study created in memory" chatter

    space = study.spec.resolved_space()
    dists: dict[str, Any] = {}
    for p in space.params.values():
        if p.choices is not None:
            dists[p.name] = CategoricalDistribution(list(p.choices))
        elif p.is_int:
            dists[p.name] = IntDistribution(int(p.low or 0), int(p.high or 0), log=p.log)
        else:
            dists[p.name] = FloatDistribution(float(p.low or 0), float(p.high or 0), log=p.log)
    rows = [t for t in searched(trials) if t.params]
    if len(rows) < MIN_IMPORTANCE_TRIALS:
        return {}
    names = sorted({k for t in rows for k in t.params if k in dists})
    if not names:
        return {}
    out: dict[str, dict[str, float]] = {}
    objectives: list[tuple[str, Any, Literal["minimize", "maximize"]]] = [
        ("throughput", lambda t: t.throughput_samples_per_s, "maximize"),
        ("quality", quality_of, study.spec.quality_direction)]
    if "energy" in study.spec.objectives:
        objectives.append(("energy", lambda t: t.energy_j_per_sample, "minimize"))
    for objective, value_of, direction in objectives:
        if any(value_of(t) is None for t in rows):
            continue
        st = optuna.create_study(direction=direction)
        for t in rows:
            params = {k: v for k, v in t.params.items() if k in names}
            st.add_trial(optuna.trial.create_trial(params=params, distributions={k: dists[k] for k in params},
                                                   value=float(value_of(t) or 0.0)))
        try:
            out[objective] = dict(optuna.importance.get_param_importances(st))
        except (RuntimeError, ValueError) as e:  # e.g. every trial has the same params
            log.info("no importances for %s: %s", objective, e)
    return out


def searched(trials: list[TrialInfo]) -> list[TrialInfo]:
    """The completed search trials that ran (not a repeat of another): what importances rank."""
    return [t for t in completed(trials) if t.role == "search" and not t.is_baseline and t.repeat_of is None]


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def fmt(value: float | None, spec: str) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)
