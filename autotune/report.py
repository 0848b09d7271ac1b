"""`autotune report`: a study's results as report.html plus PNG figures.

Figures (matplotlib, written next to report.html):

pareto.png        throughput (energy per sample where energy picks the recommendation:
                  objectives [energy, quality]) vs the study's quality metric (validation
                  NRMSE for ups, validation loss for gpt, ...) of every completed search trial; feasible
                  (passes the quality gate) and infeasible marked apart, the baseline seeds
                  as one entry, the gate drawn, and the front the service computes (GET
                  /pareto: candidates only, at their re-measured values) connected, with the
                  recommendation marked: an infeasible point is never on the line
progress.png      best feasible speedup so far, by trial number, over the same baseline
                  throughput as the recommendation's speedup, which is drawn with its
                  interval (where energy picks: the lowest energy per sample so far over the
                  baseline's, and the recommendation's energy ratio with its interval)
energy.png        only when the trials measured GPU energy: energy per sample (J) vs
                  throughput of every completed trial, feasible and infeasible apart, the
                  baseline seeds, the front's points and the recommendation
importances.png   parameter importances (optuna.importance, fANOVA by default) for
                  throughput, the quality metric and (an objective) energy, over the completed search trials,
                  only from MIN_IMPORTANCE_TRIALS of them (fewer rank noise); the count is
                  on the plot
failures.png      trials by final state and failed trials by failure kind

The report works from the REST API's answers only (study, trials, recommendation), so it
runs anywhere the service is reachable.
"""

from __future__ import annotations

import html
import json
import logging
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from autotune.protocol import Recommendation, StudyInfo, TrialInfo

log = logging.getLogger(__name__)

# Importances from fewer completed search trials rank noise: a knob that did nothing can come
# out above the one that changed quality (seen at 10 trials), so they are not drawn.
MIN_IMPORTANCE_TRIALS = 20


@dataclass(frozen=True)
class ReportFiles:
    html: Path
    figures: dict[str, Path]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    return plt


def quality_of(t: TrialInfo) -> float | None:
    """The trial's quality metric (`quality`; `val_nrmse` from a service older than the field)."""
    return t.quality if t.quality is not None else t.val_nrmse


def quality_label(study: StudyInfo, trials: list[TrialInfo]) -> str:
    """The study's quality metric as users read it: "NRMSE" for val_nrmse, else its own name."""
    name = study.spec.quality_metric or next((t.quality_metric for t in trials if t.quality_metric), None)
    return "NRMSE" if name in (None, "val_nrmse") else str(name)


def _completed(trials: list[TrialInfo]) -> list[TrialInfo]:
    return [t for t in trials if t.state == "COMPLETE" and t.throughput_samples_per_s and quality_of(t) is not None]


def candidates(trials: list[TrialInfo]) -> list[TrialInfo]:
    """The trials the front and the recommendation are made of: feasible search trials that ran,
    less any that drew the baseline's config (api/results.py `candidates`)."""
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
    (api/results.py `chosen_by`)."""
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


def importances(study: StudyInfo, trials: list[TrialInfo]) -> dict[str, dict[str, float]]:
    """Parameter importances per objective, from the completed trials' searched params.

    Rebuilds an in-memory Optuna study from the trials (with the space's distributions) and
    runs optuna.importance on it. Empty when fewer than 3 trials vary.
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
    rows = [t for t in _completed(trials) if t.role == "search" and not t.is_baseline and t.params
            and t.repeat_of is None]
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


def _plot_pareto(study: StudyInfo, trials: list[TrialInfo], gate: float | None, path: Path,
                 front: list[TrialInfo] | None = None, recommendation: Recommendation | None = None) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    energy_x = chosen_by(study, recommendation) == "energy"  # [energy, quality]: energy against quality

    def x(t: TrialInfo | Recommendation) -> float | None:
        return t.energy_j_per_sample if energy_x else t.throughput_samples_per_s

    done = [t for t in _completed(trials) if t.role != "remeasure" and x(t) is not None]  # re-measurements: at
    # their config's front point
    label_q = quality_label(study, trials)
    direction = study.spec.quality_direction
    for feasible, style, label in ((True, dict(c="#2a9d8f", marker="o"), "search trial: feasible"),
                                   (False, dict(c="#e76f51", marker="x"), "search trial: infeasible"),
                                   (None, dict(c="#999999", marker="."), "search trial: not judged yet")):
        pts = [t for t in done if t.feasible is feasible and not t.is_baseline]
        if pts:
            ax.scatter([x(t) for t in pts], [quality_of(t) for t in pts], label=label, **style)
    seeds = [t for t in done if t.is_baseline]
    if seeds:  # one legend entry for every seed
        ax.scatter([x(t) for t in seeds], [quality_of(t) for t in seeds], marker="*", s=200,
                   c="#264653", label=f"baseline ({len(seeds)} seed{'s' if len(seeds) != 1 else ''})", zorder=5)
    objectives = tuple(study.spec.objectives)
    line = sorted((t for t in (front if front is not None else pareto_front(trials, direction, objectives))
                   if x(t) is not None), key=lambda t: x(t) or 0.0)
    if line:
        searched = {t.number: t for t in done}
        moved = [(searched[t.number], t) for t in line if t.number in searched
                 and (x(searched[t.number]), quality_of(searched[t.number])) != (x(t), quality_of(t))]
        for old, new in moved:  # a re-measured config: from its search point to where its re-measurement put it
            ax.annotate("", xy=(x(new), quality_of(new)), xytext=(x(old), quality_of(old)),
                        arrowprops=dict(arrowstyle="->", color="#6a4c93", lw=0.8, alpha=0.7))
        ax.plot([x(t) for t in line], [quality_of(t) for t in line], "k--", lw=0.8,
                marker="s", mfc="none", ms=9,
                label="front" + (" (arrows: search → re-measured value)" if moved else "")
                + (" (of 3 objectives: energy too)" if len(objectives) == 3 else ""))
    if recommendation is not None and x(recommendation) is not None:
        rq = recommendation.quality if recommendation.quality is not None else recommendation.val_nrmse
        ax.scatter([x(recommendation)], [rq], marker="D", s=90, facecolors="none",
                   edgecolors="#6a4c93", linewidths=2, label=f"recommended (trial {recommendation.trial_number})",
                   zorder=6)
    side = "≤" if direction == "minimize" else "≥"
    search_gate = recommendation.search_gate_quality if recommendation is not None else None
    if search_gate is not None and gate is not None and search_gate != gate:  # the pick judged at its re-measurement
        ax.axhline(search_gate, color="#e9c46a", lw=1.2, label=f"quality gate, search probe ({side} {search_gate:.4f})")
        ax.axhline(gate, color="#e9c46a", lw=1.2, ls=":",
                   label=f"quality gate, re-measure probe ({side} {gate:.4f})")
    elif gate is not None:
        ax.axhline(gate, color="#e9c46a", lw=1.2, label=f"quality gate ({label_q} {side} {gate:.4f})")
    ax.set_xlabel("GPU energy per sample (J, lower is better)" if energy_x else
                  "throughput (samples/s, higher is better)")
    ax.set_ylabel(f"validation {label_q} ({'lower' if direction == 'minimize' else 'higher'} is better)"
                  if label_q == "NRMSE" else f"{label_q} ({'lower' if direction == 'minimize' else 'higher'} "
                  "is better)")
    ax.set_title(f"{study.name}: {'energy' if energy_x else 'speed'} vs quality")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_progress(study: StudyInfo, trials: list[TrialInfo], path: Path,
                   recommendation: Recommendation | None = None) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    if chosen_by(study, recommendation) == "energy":
        _energy_progress(ax, study, trials, recommendation)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return
    base = baseline_throughput(trials, recommendation)
    points = [(n, s) for n, s in best_so_far(trials, base) if s is not None]
    if points:
        ax.step([p[0] for p in points], [p[1] for p in points], where="post", color="#264653",
                label="best search trial so far (its own probe)")
        ax.scatter([p[0] for p in points], [p[1] for p in points], s=10, color="#264653")
    else:
        ax.text(0.5, 0.5, "no feasible trial yet", ha="center", va="center", transform=ax.transAxes)
    r = recommendation
    if r is not None and r.speedup is not None:
        ax.axhline(r.speedup, color="#6a4c93", lw=1.2,
                   label=f"recommended: {r.speedup:.2f}×" + (" (re-measured)" if r.remeasured else ""))
        if r.speedup_ci_low is not None and r.speedup_ci_high is not None:
            ax.axhspan(r.speedup_ci_low, r.speedup_ci_high, color="#6a4c93", alpha=0.15, label="its 95 % interval")
    ax.axhline(1.0, color="#999999", lw=0.8)
    ax.set_xlabel("trial number")
    ax.set_ylabel("speedup (×)")
    ax.set_title(f"{study.name}: best so far, over the baseline's "
                 + (f"{base:,.1f} samples/s" if base else "throughput"), fontsize=10)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _energy_progress(ax: Any, study: StudyInfo, trials: list[TrialInfo], r: Recommendation | None) -> None:
    """progress.png where energy picks: the lowest energy per sample so far over the baseline's."""
    base = baseline_energy(trials, r)
    points = [(n, v) for n, v in lowest_energy_so_far(trials, base) if v is not None]
    if points:
        ax.step([p[0] for p in points], [p[1] for p in points], where="post", color="#264653",
                label="lowest-energy search trial so far (its own probe)")
        ax.scatter([p[0] for p in points], [p[1] for p in points], s=10, color="#264653")
    else:
        ax.text(0.5, 0.5, "no feasible trial with an energy reading yet", ha="center", va="center",
                transform=ax.transAxes)
    if r is not None and r.energy_ratio is not None:
        ax.axhline(r.energy_ratio, color="#6a4c93", lw=1.2,
                   label=f"recommended: {r.energy_ratio:.2f}×" + (" (re-measured)" if r.remeasured else ""))
        if r.energy_ratio_ci_low is not None and r.energy_ratio_ci_high is not None:
            ax.axhspan(r.energy_ratio_ci_low, r.energy_ratio_ci_high, color="#6a4c93", alpha=0.15,
                       label="its 95 % interval")
    ax.axhline(1.0, color="#999999", lw=0.8)
    ax.set_xlabel("trial number")
    ax.set_ylabel("energy per sample / baseline's (lower is better)")
    ax.set_title(f"{study.name}: lowest energy so far, over the baseline's "
                 + (f"{base:.4g} J/sample" if base else "energy per sample"), fontsize=10)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def _plot_energy(study: StudyInfo, trials: list[TrialInfo], path: Path, front: list[TrialInfo] | None,
                 recommendation: Recommendation | None) -> None:
    """energy.png: energy per sample against throughput (every completed trial that measured both)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    done = [t for t in _completed(trials) if t.role != "remeasure" and t.energy_j_per_sample is not None]
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
                   s=200, c="#264653", label=f"baseline ({len(seeds)} seed{'s' if len(seeds) != 1 else ''})",
                   zorder=5)
    points = [t for t in front or [] if t.energy_j_per_sample is not None and t.throughput_samples_per_s]
    if points:
        ax.scatter([t.throughput_samples_per_s for t in points], [t.energy_j_per_sample for t in points],
                   marker="s", s=81, facecolors="none", edgecolors="k", label="front (the service's)", zorder=4)
    r = recommendation
    if r is not None and r.energy_j_per_sample is not None:
        ax.scatter([r.throughput_samples_per_s], [r.energy_j_per_sample], marker="D", s=90, facecolors="none",
                   edgecolors="#6a4c93", linewidths=2, label=f"recommended (trial {r.trial_number})", zorder=6)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("throughput (samples/s, higher is better)")
    ax.set_ylabel("GPU energy per sample (J, lower is better)")
    ax.set_title(f"{study.name}: energy vs speed", fontsize=10)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_importances(study: StudyInfo, imp: dict[str, dict[str, float]], path: Path, label: str = "NRMSE",
                      count: int = 0) -> None:
    plt = _pyplot()
    panels = [("throughput", "throughput"), ("quality", label)]
    if "energy" in study.spec.objectives:
        panels.append(("energy", "energy per sample"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8))
    for ax, (objective, title) in zip(axes, panels, strict=True):
        values = imp.get(objective, {})
        if values:
            names = list(values)[::-1]
            ax.barh(names, [values[n] for n in names], color="#2a9d8f")
        else:
            ax.text(0.5, 0.5, f"not shown: {count} completed search trial{'s' if count != 1 else ''},\n"
                    f"importances need {MIN_IMPORTANCE_TRIALS}", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"importance for {title}")
    fig.suptitle(f"from {count} completed search trials", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_failures(study: StudyInfo, trials: list[TrialInfo], path: Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    states = Counter(t.state for t in trials)
    axes[0].bar(list(states), list(states.values()), color="#264653")
    axes[0].set_title("trials by state")
    kinds = Counter((t.failure or {}).get("kind", "unknown") for t in trials if t.state == "FAIL")
    if kinds:
        axes[1].bar(list(kinds), list(kinds.values()), color="#e76f51")
    else:
        axes[1].text(0.5, 0.5, "no failures", ha="center", va="center", transform=axes[1].transAxes)
    axes[1].set_title("failed trials by kind")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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


def write_report(study: StudyInfo, trials: list[TrialInfo], recommendation: Recommendation | None,
                 out: Path, front: list[TrialInfo] | None = None) -> ReportFiles:
    """Write report.html and the PNGs into `out` (created if missing); `front`: the service's
    GET /pareto (default: computed from `trials` the same way, without re-measured values)."""
    out.mkdir(parents=True, exist_ok=True)
    gate = (recommendation.gate_quality if recommendation.gate_quality is not None
            else recommendation.gate_nrmse) if recommendation else None
    label = quality_label(study, trials)
    side = "≤" if study.spec.quality_direction == "minimize" else "≥"
    names = ["pareto", "progress", "importances", "failures"]
    energy = any(t.energy_j_per_sample is not None for t in trials)
    if energy:
        names.append("energy")
    figures = {name: out / f"{name}.png" for name in names}
    _plot_pareto(study, trials, gate, figures["pareto"], front, recommendation)
    if energy:
        _plot_energy(study, trials, figures["energy"], front, recommendation)
    _plot_progress(study, trials, figures["progress"], recommendation)
    searched = [t for t in _completed(trials) if t.role == "search" and not t.is_baseline and t.repeat_of is None]
    _plot_importances(study, importances(study, trials), figures["importances"], label, len(searched))
    _plot_failures(study, trials, figures["failures"])

    esc = html.escape
    rows = []
    for t in sorted(trials, key=lambda t: t.number):
        feasible = {True: "yes", False: "no", None: "–"}[t.feasible]
        failure = f"{t.failure.get('kind')}: {t.failure.get('message', '')}" if t.failure else ""
        rows.append(
            f"<tr><td>{t.number}{' (baseline)' if t.is_baseline else ''}</td><td>{esc(t.state)}</td>"
            f"<td>{_fmt(t.throughput_samples_per_s, ',.1f')}</td><td>{_fmt(quality_of(t), '.4f')}</td>"
            + (f"<td>{_fmt(t.energy_j_per_sample, '.4g')}</td>" if energy else "")
            + f"<td>{feasible}</td><td>{esc(failure[:200])}</td><td><code>{esc(json.dumps(t.params))}</code></td></tr>")
    if recommendation and not recommendation.certified:
        r = recommendation
        fastest = r.uncertified
        rec = (f"<p class=verdict><b>Verdict: keep the baseline</b> ({esc(r.outcome)}). {esc(r.reason)}</p>"
               + (f"<p>The fastest uncertified candidate is trial {fastest.trial_number} ({esc(fastest.status)}): not "
                  f"the config to train with (<code>autotune best --uncertified</code> prints it).</p>"
                  if fastest is not None else "")
               + _verdict_inputs(r) + "".join(f"<p><i>{esc(c)}</i></p>" for c in r.caveats))
    elif recommendation:
        r = recommendation
        quality = r.quality if r.quality is not None else r.val_nrmse
        baseline_quality = r.baseline_quality if r.baseline_quality is not None else r.baseline_val_nrmse
        rec = (f"<p class=verdict><b>Verdict: CERTIFIED</b>, trial {r.trial_number}: {esc(r.verdict)}</p>"
               f"<p>Trial {r.trial_number}: <b>{r.throughput_samples_per_s:,.1f} samples/s</b>"
               f" ({_fmt(r.speedup, '.2f')}× the baseline's {_fmt(r.baseline_throughput_samples_per_s, ',.1f')}),"
               f" {esc(label)} {_fmt(quality, '.4f')} (baseline {_fmt(baseline_quality, '.4f')},"
               f" gate {side} {_fmt(gate, '.4f')}).</p>"
               + (f"<p>Picked by the lowest GPU energy per sample among the candidates (objectives "
                  f"{esc(', '.join(study.spec.objectives))}).</p>" if r.chosen_by == "energy" else "")
               + (f"<p><b>{esc(r.verdict)}</b></p>" if r.verdict else "")
               + "".join(f"<p>{esc(line)}</p>" for line in r.energy_lines())
               + (f"<p><b>{esc(r.energy_verdict)}</b></p>" if r.energy_verdict else "")
               + "".join(f"<p><i>{esc(c)}</i></p>" for c in r.caveats)
               + _verdict_inputs(r) + f"<pre>{esc(json.dumps(r.config, indent=2))}</pre>")
    else:
        rec = ("<p>No verdict yet: the baseline or the search has not finished, or the re-measurement of its top "
               "configs is still running (<code>autotune best</code> says which).</p>")
    energy_section = ('\n<h2>Energy vs speed</h2><img src="energy.png" alt="GPU energy per sample against '
                      'throughput">') if energy else ""
    energy_head = "<th>J/sample</th>" if energy else ""
    space_name = study.spec.resolved_space().name
    counts = ", ".join(f"{k}: {v}" for k, v in study.counts.items()) or "none"
    failures = ", ".join(f"{k}: {v}" for k, v in study.failures.items()) or "none"
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>autotune report: {esc(study.name)}</title>
<style>body{{font-family:sans-serif;max-width:1000px;margin:2em auto}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 6px;font-size:13px}}img{{max-width:100%}}</style></head><body>
<h1>autotune report: {esc(study.name)}</h1>
<p>workload <b>{esc(study.spec.workload)}/{esc(study.spec.preset)}</b> · space <b>{esc(space_name)}</b>
· hardware <b>{esc(study.spec.hardware)}</b> · sampler {esc(study.spec.sampler)} · state {esc(study.state)}</p>
<p>trials by state: {esc(counts)} · failures by kind: {esc(failures)}</p>
<h2>Verdict</h2>{rec}
<h2>{'Energy' if chosen_by(study, recommendation) == 'energy' else 'Speed'} vs quality</h2>
<img src="pareto.png" alt="Pareto front">{energy_section}
<h2>Best so far</h2><img src="progress.png" alt="best feasible speedup by trial">
<h2>Parameter importances</h2><img src="importances.png" alt="parameter importances">
<h2>Failures</h2><img src="failures.png" alt="trials by state and failure kind">
<h2>Trials</h2><table><tr><th>#</th><th>state</th><th>samples/s</th><th>{esc(label)}</th>{energy_head}<th>feasible</th>
<th>failure</th><th>params</th></tr>{''.join(rows)}</table>
</body></html>
"""
    path = out / "report.html"
    path.write_text(page)
    return ReportFiles(html=path, figures=figures)
