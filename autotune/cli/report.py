"""`autotune report`: a study's results as report.html plus PNG figures.

report.html opens with the verdict (`headline`): the certified pick with its speedup and the
speedup's interval, or "keep the baseline" with the reason; no verdict yet while the study runs.

Figures (matplotlib, written next to report.html). A figure with nothing to draw is not
written: report.html says in one sentence why it is left out (`ReportFiles.left_out`).

pareto.png        throughput (energy per sample where energy picks the recommendation:
                  objectives [energy, quality]) vs the study's quality metric (validation
                  NRMSE for ups, validation loss for gpt, ...) of every completed search trial at
                  its own probe, feasible and infeasible marked apart (judged by the quality
                  gate from the baseline seeds, drawn and labelled as such); the baseline seeds
                  as one entry and, once re-measured, the baseline as the verdict measured it
                  (geometric-mean throughput and mean quality of its runs: `remeasured_points`);
                  each re-measured candidate at its re-measured point, an arrow from its search
                  trial; the front the service computes (GET /pareto: candidates only, at their
                  re-measured values) connected; the verdict marked (the certified pick, or the
                  baseline kept) and, for a certified pick, the verdict's quality bound (the
                  baseline's mean + the margin Δ its quality difference was tested against).
                  Left out while no trial has completed.
progress.png      best feasible speedup so far, by trial number (integer ticks), over the same
                  baseline throughput as the recommendation's speedup, which is drawn with its
                  interval (where energy picks: the lowest energy per sample so far over the
                  baseline's, and the recommendation's energy ratio with its interval). Left
                  out while no search trial is a candidate.
energy.png        only when the trials measured GPU energy: energy per sample (J) vs
                  throughput of every completed trial, feasible and infeasible apart, the
                  baseline seeds, the front's points and the recommendation
importances.png   parameter importances (optuna.importance, fANOVA by default) for
                  throughput, the quality metric and (an objective) energy, over the completed
                  search trials; left out below MIN_IMPORTANCE_TRIALS of them (fewer rank
                  noise); the count is on the plot
failures.png      trials by final state and failed trials by failure kind; left out when no
                  trial failed

The report works from the REST API's answers only (study, trials, recommendation), so it
runs anywhere the service is reachable.
"""

from __future__ import annotations

import html
import json
import logging
import math
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from autotune.contract.protocol import ConfigVerdict, Recommendation, StudyInfo, TrialInfo

log = logging.getLogger(__name__)

# Importances from fewer completed search trials rank noise: a knob that did nothing can come
# out above the one that changed quality (seen at 10 trials), so they are not drawn.
MIN_IMPORTANCE_TRIALS = 20


@dataclass(frozen=True)
class ReportFiles:
    html: Path
    figures: dict[str, Path]  # the figures written, by name (pareto, progress, ...)
    left_out: dict[str, str] = field(default_factory=dict)  # a figure not written → why, one sentence
    headline: str = ""  # the verdict in one line: report.html's first line


@dataclass(frozen=True)
class Plot:
    """A figure (matplotlib) or, when there is nothing to draw, why it is left out."""

    figure: Any | None
    why: str = ""


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    return plt


def _integer_axis(axis: Any) -> None:
    """Whole numbers only on an axis of trial numbers or trial counts."""
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def quality_of(t: TrialInfo) -> float | None:
    """The trial's quality metric (`quality`; `val_nrmse` from a service older than the field)."""
    return t.quality if t.quality is not None else t.val_nrmse


def quality_label(study: StudyInfo, trials: list[TrialInfo]) -> str:
    """The study's quality metric as users read it: "NRMSE" for val_nrmse, else its own name."""
    name = study.spec.quality_metric or next((t.quality_metric for t in trials if t.quality_metric), None)
    return "NRMSE" if name in (None, "val_nrmse") else str(name)


def _measured(t: TrialInfo) -> bool:
    return t.state == "COMPLETE" and bool(t.throughput_samples_per_s) and quality_of(t) is not None


def _completed(trials: list[TrialInfo]) -> list[TrialInfo]:
    return [t for t in trials if _measured(t)]


def candidates(trials: list[TrialInfo]) -> list[TrialInfo]:
    """The trials the front and the recommendation are made of: feasible search trials that ran,
    less any that drew the baseline's config (api/study `candidates`)."""
    return [t for t in _completed(trials) if t.role == "search" and not t.is_baseline and t.feasible
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


# --- the verdict's view: re-measured points, gates, the headline ---------------------------------

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
        if t.role == "remeasure" and t.remeasure_of is not None and _measured(t):
            runs.setdefault(t.remeasure_of, []).append(t)
    seeds = [t for t in _completed(trials) if t.is_baseline and t.retried_as is None]

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
    row = _row(r, r.trial_number, "candidate")
    margin = row.quality_margin if row is not None and row.quality_margin is not None else \
        abs(r.gate_quality - r.baseline_quality)
    base = _row(r, None, "baseline")
    return VerdictBound(r.gate_quality, r.baseline_quality, margin, base.n if base is not None else r.baseline_seeds)


def _row(r: Recommendation, number: int | None, role: str) -> ConfigVerdict | None:
    return next((c for c in r.configs if c.role == role and (number is None or c.trial_number == number)), None)


def _headline(study: StudyInfo, r: Recommendation | None) -> tuple[str, str]:
    """(the verdict in a few words, the sentence behind it)."""
    if r is None:
        return ("No verdict yet", study.message or "the baseline or the search has not finished, or the "
                "re-measurement of its top configs is still running (autotune best says which)")
    if not r.certified:
        return f"Verdict: keep the baseline ({r.outcome.replace('_', ' ')})", r.reason or r.verdict
    row = _row(r, r.trial_number, "candidate")
    if r.chosen_by == "energy":
        ratio = row.speedup if row is not None and row.speedup is not None else r.energy_ratio
        low = row.speedup_ci_low if row is not None and row.speedup is not None else r.energy_ratio_ci_low
        high = row.speedup_ci_high if row is not None and row.speedup is not None else r.energy_ratio_ci_high
        what = "the baseline's energy per sample"
    else:
        ratio, low, high, what = r.speedup, r.speedup_ci_low, r.speedup_ci_high, "the baseline's throughput"
    interval = f" (interval {low:.2f}–{high:.2f}×)" if low is not None and high is not None else " (no interval)"
    title = f"Verdict: trial {r.trial_number}, certified: {_fmt(ratio, '.2f')}× {what}{interval}"
    return title, r.reason or r.verdict


def headline(study: StudyInfo, recommendation: Recommendation | None) -> str:
    """The report's first line: the certified pick with its speedup (energy ratio where energy
    picks) and that ratio's interval, or "keep the baseline" with the reason, or no verdict yet."""
    title, why = _headline(study, recommendation)
    return f"{title}: {why}" if why else title


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
    return [t for t in _completed(trials) if t.role == "search" and not t.is_baseline and t.repeat_of is None]


# --- figures ------------------------------------------------------------------------------------

_STATUS_STYLE = {"certified": "#6a4c93", "rejected": "#e76f51", "undecided": "#999999", "failed": "#e76f51",
                 "stopped": "#999999", None: "#999999"}


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def pareto_figure(study: StudyInfo, trials: list[TrialInfo], recommendation: Recommendation | None = None,
                  front: list[TrialInfo] | None = None) -> Plot:
    """pareto.png (the module docstring); left out while no trial has completed."""
    r = recommendation
    energy_x = chosen_by(study, r) == "energy"  # [energy, quality]: energy against quality

    def x(t: TrialInfo | Recommendation) -> float | None:
        return t.energy_j_per_sample if energy_x else t.throughput_samples_per_s

    def px(p: RemeasuredPoint) -> float | None:
        return p.energy_j_per_sample if energy_x else p.throughput_samples_per_s

    done = [t for t in _completed(trials) if t.role != "remeasure" and x(t) is not None]  # re-measurements: at
    # their config's re-measured point
    remeasured = [p for p in remeasured_points(study, trials, r) if px(p) is not None]
    if not done and not remeasured:
        what = "an energy per sample" if energy_x else "a throughput"
        return Plot(None, f"no trial has completed with {what} and a quality yet, so there is no point to draw.")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    label_q = quality_label(study, trials)
    direction = study.spec.quality_direction
    side = "≤" if direction == "minimize" else "≥"
    for feasible, style, label in ((True, dict(c="#2a9d8f", marker="o"), "search trial: feasible"),
                                   (False, dict(c="#e76f51", marker="x"), "search trial: infeasible"),
                                   (None, dict(c="#999999", marker="."), "search trial: not judged yet")):
        pts = [t for t in done if t.feasible is feasible and not t.is_baseline]
        if pts:
            ax.scatter([x(t) for t in pts], [quality_of(t) for t in pts], label=label, **style)
    seeds = [t for t in done if t.is_baseline]
    if seeds:  # one legend entry for every seed
        ax.scatter([x(t) for t in seeds], [quality_of(t) for t in seeds], marker="*", s=200,
                   c="#264653", label=f"baseline: {_plural(len(seeds), 'seed')}", zorder=5)
    searched_at = {t.number: t for t in done}
    for p in remeasured:
        if p.role == "baseline":
            seeds_in = p.n - p.remeasures
            runs = (f"{_plural(seeds_in, 'seed')} + {_plural(p.remeasures, 're-measurement')}" if seeds_in > 0
                    else _plural(p.remeasures, "re-measurement"))
            ax.scatter([px(p)], [p.quality], marker="*", s=320, facecolors="none", edgecolors="#264653",
                       linewidths=1.5, zorder=6, label=f"baseline as the verdict measured it ({runs})")
    moved = set()
    for status in dict.fromkeys(p.status for p in remeasured if p.role == "candidate"):
        group = [p for p in remeasured if p.role == "candidate" and p.status == status]
        ax.scatter([px(p) for p in group], [p.quality for p in group], marker="o", s=70, facecolors="none",
                   edgecolors=_STATUS_STYLE.get(status, "#999999"), linewidths=1.5, zorder=5,
                   label=f"re-measured candidate: {status or 'not judged yet'}")
        for p in group:
            old = searched_at.get(p.number)
            if old is not None:  # from its search point to where its re-measurement put it
                moved.add(p.number)
                ax.annotate("", xy=(px(p), p.quality), xytext=(x(old), quality_of(old)),
                            arrowprops=dict(arrowstyle="->", color="#6a4c93", lw=0.8, alpha=0.7))
    objectives = tuple(study.spec.objectives)
    line = sorted((t for t in (front if front is not None else pareto_front(trials, direction, objectives))
                   if x(t) is not None), key=lambda t: x(t) or 0.0)
    if line:
        for new in line:  # a front point re-measured but not among the points above (no verdict yet)
            old = searched_at.get(new.number)
            if old is not None and new.number not in moved and (x(old), quality_of(old)) != (x(new), quality_of(new)):
                ax.annotate("", xy=(x(new), quality_of(new)), xytext=(x(old), quality_of(old)),
                            arrowprops=dict(arrowstyle="->", color="#6a4c93", lw=0.8, alpha=0.7))
        ax.plot([x(t) for t in line], [quality_of(t) for t in line], "k--", lw=0.8,
                marker="s", mfc="none", ms=9,
                label=("front (the service's: re-measured values where re-measured)" if front is not None
                       else "front (search values)") + (", of 3 objectives: energy too" if len(objectives) == 3
                                                        else ""))
    if r is not None and r.certified and x(r) is not None:
        rq = r.quality if r.quality is not None else r.val_nrmse
        ax.scatter([x(r)], [rq], marker="D", s=110, facecolors="none", edgecolors="#6a4c93", linewidths=2,
                   label=f"recommended: trial {r.trial_number}, certified", zorder=7)
    elif r is not None:  # the baseline kept: at the baseline's point as the verdict measured it
        bx = r.baseline_energy_j_per_sample if energy_x else r.baseline_throughput_samples_per_s
        bq = r.baseline_quality if r.baseline_quality is not None else r.baseline_val_nrmse
        if bx is not None and bq is not None:
            ax.scatter([bx], [bq], marker="D", s=110, facecolors="none", edgecolors="#264653", linewidths=2,
                       label=f"verdict: keep the baseline ({r.outcome.replace('_', ' ')})", zorder=7)
    gate = search_gate(r)
    if gate is not None:
        ax.axhline(gate, color="#e9c46a", lw=1.2,
                   label=f"quality gate {label_q} {side} {gate:.4f}: judged the search trials")
    bound = verdict_bound(r)
    if bound is not None:
        ax.axhline(bound.quality, color="#6a4c93", lw=1.0, ls=":",
                   label=f"verdict's bound {side} {bound.quality:.4f}: the baseline's mean "
                         f"{'+' if direction == 'minimize' else '−'} Δ {bound.margin:.3g}")
    ax.set_xlabel("GPU energy per sample (J, lower is better)" if energy_x else
                  "throughput (samples/s, higher is better)")
    ax.set_ylabel(f"validation {label_q} ({'lower' if direction == 'minimize' else 'higher'} is better)"
                  if label_q == "NRMSE" else f"{label_q} ({'lower' if direction == 'minimize' else 'higher'} "
                  "is better)")
    ax.set_title(f"{study.name}: {'energy' if energy_x else 'speed'} vs quality")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    return Plot(fig)


def progress_figure(study: StudyInfo, trials: list[TrialInfo], recommendation: Recommendation | None = None) -> Plot:
    """progress.png (the module docstring); left out while no search trial is a candidate."""
    energy = chosen_by(study, recommendation) == "energy"
    if energy:
        base = baseline_energy(trials, recommendation)
        curve = lowest_energy_so_far(trials, base)
    else:
        base = baseline_throughput(trials, recommendation)
        curve = best_so_far(trials, base)
    searching = {t.number for t in trials if t.role != "remeasure"}  # the curve ends with the search
    points = [(n, v) for n, v in curve if v is not None and n in searching]
    if not points:
        if not base:
            why = "the baseline has no " + ("energy per sample" if energy else "throughput") + " yet"
        else:
            why = "no search trial has passed the quality gate yet" + (" with an energy reading" if energy else "")
        return Plot(None, f"{why}, so there is no best-so-far curve.")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    r = recommendation
    ax.step([p[0] for p in points], [p[1] for p in points], where="post", color="#264653",
            label=("lowest-energy" if energy else "best") + " search trial so far (its own probe)")
    ax.scatter([p[0] for p in points], [p[1] for p in points], s=10, color="#264653")
    ratio = (r.energy_ratio, r.energy_ratio_ci_low, r.energy_ratio_ci_high) if r is not None and energy else \
        (r.speedup, r.speedup_ci_low, r.speedup_ci_high) if r is not None else (None, None, None)
    if r is not None and ratio[0] is not None:
        what = "recommended" if r.certified else "kept: the baseline"
        ax.axhline(ratio[0], color="#6a4c93", lw=1.2,
                   label=f"{what}: {ratio[0]:.2f}×" + (" (re-measured)" if r.remeasured else ""))
        if ratio[1] is not None and ratio[2] is not None:
            ax.axhspan(ratio[1], ratio[2], color="#6a4c93", alpha=0.15, label="its interval")
    ax.axhline(1.0, color="#999999", lw=0.8)
    ax.set_xlabel("trial number")
    _integer_axis(ax.xaxis)
    if energy:
        ax.set_ylabel("energy per sample / baseline's (lower is better)")
        ax.set_title(f"{study.name}: lowest energy so far, over the baseline's "
                     + (f"{base:.4g} J/sample" if base else "energy per sample"), fontsize=10)
    else:
        ax.set_ylabel("speedup (×)")
        ax.set_title(f"{study.name}: best so far, over the baseline's "
                     + (f"{base:,.1f} samples/s" if base else "throughput"), fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return Plot(fig)


def energy_figure(study: StudyInfo, trials: list[TrialInfo], front: list[TrialInfo] | None,
                  recommendation: Recommendation | None) -> Plot:
    """energy.png: energy per sample against throughput (every completed trial that measured both)."""
    done = [t for t in _completed(trials) if t.role != "remeasure" and t.energy_j_per_sample is not None]
    if not done:
        return Plot(None, "no completed trial measured GPU energy and a throughput.")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for feasible, style, label in ((True, dict(c="#2a9d8f", marker="o"), "search trial: feasible"),
                                   (False, dict(c="#e76f51", marker="x"), "search trial: infeasible"),
                                   (None, dict(c="#999999", marker="."), "search trial: not judged yet")):
        pts = [t for t in done if t.feasible is feasible and not t.is_baseline]
        if pts:
            ax.scatter([t.throughput_samples_per_s for t in pts], [t.energy_j_per_sample for t in pts], label=label,
                       **style)
    seeds = [t for t in done if t.is_baseline]
    if seeds:
        ax.scatter([t.throughput_samples_per_s for t in seeds], [t.energy_j_per_sample for t in seeds], marker="*",
                   s=200, c="#264653", label=f"baseline: {_plural(len(seeds), 'seed')}", zorder=5)
    points = [t for t in front or [] if t.energy_j_per_sample is not None and t.throughput_samples_per_s]
    if points:
        ax.scatter([t.throughput_samples_per_s for t in points], [t.energy_j_per_sample for t in points],
                   marker="s", s=81, facecolors="none", edgecolors="k", label="front (the service's)", zorder=4)
    r = recommendation
    if r is not None and r.certified and r.energy_j_per_sample is not None:
        ax.scatter([r.throughput_samples_per_s], [r.energy_j_per_sample], marker="D", s=90, facecolors="none",
                   edgecolors="#6a4c93", linewidths=2, label=f"recommended: trial {r.trial_number}, certified",
                   zorder=6)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("throughput (samples/s, higher is better)")
    ax.set_ylabel("GPU energy per sample (J, lower is better)")
    ax.set_title(f"{study.name}: energy vs speed", fontsize=10)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return Plot(fig)


def importances_figure(study: StudyInfo, trials: list[TrialInfo],
                       imp: dict[str, dict[str, float]] | None = None) -> Plot:
    """importances.png, one panel per objective that has importances; left out below
    MIN_IMPORTANCE_TRIALS completed search trials or when nothing could be ranked. `imp`:
    `importances` already computed."""
    count = len(searched(trials))
    if count < MIN_IMPORTANCE_TRIALS:
        return Plot(None, f"{_plural(count, 'completed search trial')}, and importances from fewer than "
                          f"{MIN_IMPORTANCE_TRIALS} rank noise (a knob that did nothing can come out on top).")
    imp = importances(study, trials) if imp is None else imp
    label = quality_label(study, trials)
    wanted = [("throughput", "throughput"), ("quality", label)]
    if "energy" in study.spec.objectives:
        wanted.append(("energy", "energy per sample"))
    panels = [(o, t) for o, t in wanted if imp.get(o)]
    missing = [t for o, t in wanted if not imp.get(o)]
    if not panels:
        return Plot(None, f"optuna could not rank the parameters over the {count} completed search trials (every "
                          "trial drew the same values, or a value is missing).")
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
    for ax, (objective, title) in zip(axes[0], panels, strict=True):
        values = imp[objective]
        names = list(values)[::-1]
        ax.barh(names, [values[n] for n in names], color="#2a9d8f")
        ax.set_title(f"importance for {title}")
    fig.suptitle(f"from {count} completed search trials" + (f"; none for {' or '.join(missing)} (a trial without "
                                                               "its value, or nothing to rank)" if missing else ""),
                 fontsize=9)
    fig.tight_layout()
    return Plot(fig)


def failures_figure(trials: list[TrialInfo]) -> Plot:
    """failures.png: trials by state and failed trials by kind; left out when none failed."""
    failed = [t for t in trials if t.state == "FAIL"]
    if not failed:
        return Plot(None, f"none of the {_plural(len(trials), 'trial')} failed." if trials
                    else "no trial has run yet.")
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    states = Counter(t.state for t in trials)
    axes[0].bar(list(states), list(states.values()), color="#264653")
    axes[0].set_title("trials by state")
    kinds = Counter((t.failure or {}).get("kind", "unknown") for t in failed)
    axes[1].bar(list(kinds), list(kinds.values()), color="#e76f51")
    axes[1].set_title("failed trials by kind")
    for ax in axes:
        _integer_axis(ax.yaxis)
    fig.tight_layout()
    return Plot(fig)


def _verdict_inputs(r: Recommendation) -> str:
    """The decision rule's inputs as an HTML table: n, mean and sd per config, and each status."""
    if not r.configs:
        return ""
    esc = html.escape
    rows = "".join(
        f"<tr><td>{c.trial_number}</td><td>{esc(c.role)}</td><td>{c.n}</td>"
        f"<td>{_fmt(c.throughput_samples_per_s, ',.1f')}</td><td>{_fmt(c.throughput_sd_log, '.3f')}</td>"
        f"<td>{_fmt(c.quality_mean, '.4f')}</td>"
        f"<td>{_fmt(c.quality_sd, '.2g')}</td><td>{_fmt(c.speedup, '.2f')}"
        + (f" ({c.speedup_ci_low:.2f}–{c.speedup_ci_high:.2f})" if c.speedup_ci_low is not None
           and c.speedup_ci_high is not None else "")
        + f"</td><td>{esc(c.status)}</td><td>{esc(c.reason)}</td></tr>" for c in r.configs)
    return (f"<p>The verdict's inputs ({r.rounds_run} of at most {r.max_rounds} rounds, {r.remeasure_probes} "
            "re-measure probes; docs/measurement.md, <i>The verdict</i>):</p><table><tr><th>trial</th><th>role</th>"
            "<th>n</th><th>samples/s (geometric mean)</th><th>sd(log)</th><th>quality</th><th>sd</th>"
            f"<th>speedup (interval)</th><th>status</th><th>why</th></tr>{rows}</table>")


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def trial_role(t: TrialInfo) -> str:
    """The trial's part in the study in words (the trials table): baseline seed, search trial,
    "re-measure of #N, round k" (k from 1), a repeat that never ran, a retry."""
    if t.role == "remeasure":
        of = f"#{t.remeasure_of}" if t.remeasure_of is not None else "?"
        text = f"re-measure of {of}" + (f", round {t.remeasure_round + 1}" if t.remeasure_round is not None else "")
    elif t.is_baseline or t.role == "baseline":
        text = "baseline"
    else:
        text = "search"
        if t.repeat_of is not None:
            text += f": repeat of #{t.repeat_of}, not run"
        elif t.baseline_repeat_of is not None:
            text += f": the baseline's config (repeats #{t.baseline_repeat_of}), never a candidate"
        elif t.starting_point is not None:
            text += f": starting point {t.starting_point + 1}"
    if t.retry_of is not None:
        text += f"; retry of #{t.retry_of} (attempt {t.attempt})"
    if t.retried_as is not None:
        text += f"; lost, re-run as #{t.retried_as}"
    return text


_SECTIONS = {"progress": ("Best so far", "best feasible speedup by trial"),
             "importances": ("Parameter importances", "parameter importances"),
             "failures": ("Failures", "trials by state and failure kind")}


def _figure_html(name: str, files: dict[str, Path], left_out: dict[str, str], alt: str, caption: str = "") -> str:
    if name in files:
        return f'<img src="{name}.png" alt="{html.escape(alt)}">' + (f"<p class=caption>{caption}</p>" if caption
                                                                       else "")
    return f"<p class=left-out>{name}.png is left out: {html.escape(left_out[name])}</p>"


def _pareto_caption(study: StudyInfo, trials: list[TrialInfo], r: Recommendation | None) -> str:
    """What pareto.png's gate lines and re-measured points are, in words."""
    esc = html.escape
    label = esc(quality_label(study, trials))
    side = "≤" if study.spec.quality_direction == "minimize" else "≥"
    parts = []
    gate = search_gate(r)
    if gate is not None:
        parts.append(f"The quality gate ({label} {side} {gate:.4f}: the baseline seeds' mean + max(abs_tol, k·σ)) "
                     "judged every search trial at its own probe: feasible or infeasible.")
    if remeasured_points(study, trials, r):
        budget = (f" at {study.spec.remeasure.samples_factor:g}× the search's samples"
                  if study.spec.remeasure.samples_factor > 1 else "")
        parts.append(f"A re-measured config is drawn where the verdict puts it{budget}: the geometric mean of its "
                     f"runs' throughput and the mean of their {label}, an arrow from its search trial; the verdict "
                     "judges re-measured configs against the baseline's runs, not against the gate.")
    bound = verdict_bound(r)
    if bound is not None:
        parts.append(f"The dotted line ({label} {side} {bound.quality:.4f}) is the baseline's mean over its "
                     f"{_plural(bound.baseline_runs, 'run')} ({bound.baseline_quality:.4f}) shifted by the margin "
                     f"Δ {bound.margin:.3g}: the upper bound of the pick's {label} difference from the baseline lay "
                     "within Δ.")
    return " ".join(parts)


def _verdict_html(study: StudyInfo, trials: list[TrialInfo], r: Recommendation | None) -> str:
    """The Verdict section's body (the headline above it says the verdict itself)."""
    esc = html.escape
    if r is None:
        return ""
    label = quality_label(study, trials)
    side = "≤" if study.spec.quality_direction == "minimize" else "≥"
    if not r.certified:
        fastest = r.uncertified
        return ((f"<p>The fastest uncertified candidate is trial {fastest.trial_number} ({esc(fastest.status)}): not "
                 f"the config to train with (<code>autotune best --uncertified</code> prints it).</p>"
                 if fastest is not None else "")
                + _verdict_inputs(r) + "".join(f"<p><i>{esc(c)}</i></p>" for c in r.caveats))
    quality = r.quality if r.quality is not None else r.val_nrmse
    baseline_quality = r.baseline_quality if r.baseline_quality is not None else r.baseline_val_nrmse
    bound = verdict_bound(r)
    shift = "+" if study.spec.quality_direction == "minimize" else "−"
    gate = (f"the verdict's bound {side} {bound.quality:.4f}, the baseline's mean {shift} Δ {bound.margin:.3g}; "
            f"the search's gate {side} {_fmt(search_gate(r), '.4f')}" if bound is not None
            else f"gate {side} {_fmt(search_gate(r), '.4f')}")
    return (f"<p>Trial {r.trial_number}: <b>{r.throughput_samples_per_s:,.1f} samples/s</b>"
            f" ({_fmt(r.speedup, '.2f')}× the baseline's {_fmt(r.baseline_throughput_samples_per_s, ',.1f')}),"
            f" {esc(label)} {_fmt(quality, '.4f')} (baseline {_fmt(baseline_quality, '.4f')}, {esc(gate)}).</p>"
            + (f"<p>Picked by the lowest GPU energy per sample among the candidates (objectives "
               f"{esc(', '.join(study.spec.objectives))}).</p>" if r.chosen_by == "energy" else "")
            + (f"<p><b>{esc(r.verdict)}</b></p>" if r.verdict else "")
            + "".join(f"<p>{esc(line)}</p>" for line in r.energy_lines())
            + (f"<p><b>{esc(r.energy_verdict)}</b></p>" if r.energy_verdict else "")
            + "".join(f"<p><i>{esc(c)}</i></p>" for c in r.caveats)
            + _verdict_inputs(r) + f"<pre>{esc(json.dumps(r.config, indent=2))}</pre>")


def write_report(study: StudyInfo, trials: list[TrialInfo], recommendation: Recommendation | None,
                 out: Path, front: list[TrialInfo] | None = None) -> ReportFiles:
    """Write report.html and the PNGs that have something to draw into `out` (created if
    missing; a figure left out is removed from it, so an earlier report's stays no longer);
    `front`: the service's GET /pareto (default: computed from `trials` the same way, without
    re-measured values)."""
    out.mkdir(parents=True, exist_ok=True)
    r = recommendation
    label = quality_label(study, trials)
    energy = any(t.energy_j_per_sample is not None for t in trials)
    plots = {"pareto": pareto_figure(study, trials, r, front)}
    if energy:
        plots["energy"] = energy_figure(study, trials, front, r)
    plots["progress"] = progress_figure(study, trials, r)
    plots["importances"] = importances_figure(study, trials)
    plots["failures"] = failures_figure(trials)
    figures: dict[str, Path] = {}
    left_out: dict[str, str] = {}
    for name, plot in plots.items():
        path = out / f"{name}.png"
        if plot.figure is None:
            left_out[name] = plot.why
            path.unlink(missing_ok=True)
            continue
        plot.figure.savefig(path, dpi=110)
        _pyplot().close(plot.figure)
        figures[name] = path

    esc = html.escape
    pick = r.trial_number if r is not None and r.certified else None
    rows = []
    for t in sorted(trials, key=lambda t: t.number):
        feasible = {True: "yes", False: "no", None: "–"}[t.feasible]
        note = f' title="{esc(t.feasibility_note)}"' if t.feasibility_note else ""
        failure = f"{t.failure.get('kind')}: {t.failure.get('message', '')}" if t.failure else ""
        kind = "remeasure" if t.role == "remeasure" else "repeat" if t.state == "REPEAT" else \
            "baseline" if t.is_baseline else "pick" if t.number == pick else ""
        role = trial_role(t) + (" · the recommended config" if t.number == pick else "")
        rows.append(
            f"<tr{f' class={kind}' if kind else ''}><td>{t.number}{' (baseline)' if t.is_baseline else ''}</td>"
            f"<td>{esc(role)}</td><td>{esc(t.state)}</td>"
            f"<td>{_fmt(t.throughput_samples_per_s, ',.1f')}</td><td>{_fmt(quality_of(t), '.4f')}</td>"
            + (f"<td>{_fmt(t.energy_j_per_sample, '.4g')}</td>" if energy else "")
            + f"<td{note}>{feasible}</td><td>{esc(failure[:200])}</td>"
            f"<td><code>{esc(json.dumps(t.params))}</code></td></tr>")
    title, why = _headline(study, r)
    energy_section = ("\n<h2>Energy vs speed</h2>" + _figure_html("energy", figures, left_out, "GPU energy per sample "
                                                                  "against throughput")) if energy else ""
    energy_head = "<th>J/sample</th>" if energy else ""
    space_name = study.spec.resolved_space().name
    counts = ", ".join(f"{k}: {v}" for k, v in study.counts.items()) or "none"
    failures = ", ".join(f"{k}: {v}" for k, v in study.failures.items()) or "none"
    sections = "".join(f"\n<h2>{head}</h2>" + _figure_html(name, figures, left_out, alt)
                       for name, (head, alt) in _SECTIONS.items())
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>autotune report: {esc(study.name)}</title>
<style>body{{font-family:sans-serif;max-width:1000px;margin:2em auto}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 6px;font-size:13px}}img{{max-width:100%}}
tr.remeasure{{background:#f1ecf7}}tr.repeat{{color:#888}}tr.baseline{{background:#eef3f4}}
tr.pick{{font-weight:bold}}.left-out,.caption{{color:#555;font-size:14px}}</style></head><body>
<h1 class=headline>{esc(title)}</h1>
<p class=verdict>{esc(why)}</p>
<p>autotune report: <b>{esc(study.name)}</b> · workload <b>{esc(study.spec.workload)}/{esc(study.spec.preset)}</b>
· space <b>{esc(space_name)}</b> · hardware <b>{esc(study.spec.hardware)}</b> · sampler {esc(study.spec.sampler)}
· state {esc(study.state)}</p>
<p>trials by state: {esc(counts)} · failures by kind: {esc(failures)}</p>
<h2>Verdict</h2>{_verdict_html(study, trials, r)}
<h2>{'Energy' if chosen_by(study, r) == 'energy' else 'Speed'} vs quality</h2>
{_figure_html("pareto", figures, left_out, "Pareto front", _pareto_caption(study, trials, r))}{energy_section}{sections}
<h2>Trials</h2><table><tr><th>#</th><th>role</th><th>state</th><th>samples/s</th><th>{esc(label)}</th>{energy_head}
<th>feasible</th><th>failure</th><th>params</th></tr>{''.join(rows)}</table>
</body></html>
"""
    path = out / "report.html"
    path.write_text(page)
    return ReportFiles(html=path, figures=figures, left_out=left_out, headline=headline(study, r))
