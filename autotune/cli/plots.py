"""The report's figures (matplotlib, files only): pareto.png, progress.png, energy.png,
importances.png and failures.png, each described by the function that draws it. A figure with
nothing to draw is a `Plot` without one, with the sentence report.html shows in its place."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from autotune.cli.report_data import (
    MIN_IMPORTANCE_TRIALS,
    RemeasuredPoint,
    baseline_energy,
    baseline_throughput,
    best_so_far,
    chosen_by,
    completed,
    importances,
    lowest_energy_so_far,
    pareto_front,
    plural,
    quality_label,
    quality_of,
    remeasured_points,
    search_gate,
    searched,
    verdict_bound,
)
from autotune.contract.views import Recommendation, StudyInfo, TrialInfo


@dataclass(frozen=True)
class Plot:
    """A figure (matplotlib) or, when there is nothing to draw, why it is left out."""

    figure: Any | None
    why: str = ""


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    return plt


def _integer_axis(axis: Any) -> None:
    """Whole numbers only on an axis of trial numbers or trial counts."""
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


_STATUS_STYLE = {"certified": "#6a4c93", "rejected": "#e76f51", "undecided": "#999999", "failed": "#e76f51",
                 "stopped": "#999999", None: "#999999"}


def pareto_figure(study: StudyInfo, trials: list[TrialInfo], recommendation: Recommendation | None = None,
                  front: list[TrialInfo] | None = None) -> Plot:
    """pareto.png: throughput (energy per sample where energy picks the recommendation:
    objectives [energy, quality]) vs the study's quality metric (validation NRMSE for ups,
    validation loss for gpt, ...) of every completed search trial at its own probe, feasible and
    infeasible marked apart (judged by the quality gate from the baseline seeds, drawn and
    labelled as such); the baseline seeds as one entry and, once re-measured, the baseline as the
    verdict measured it (geometric-mean throughput and mean quality of its runs:
    `remeasured_points`); each re-measured candidate at its re-measured point, an arrow from its
    search trial; the front the service computes (GET /pareto: candidates only, at their
    re-measured values) connected; the verdict marked (the certified pick, or the baseline kept)
    and, for a certified pick, the verdict's quality bound (the baseline's mean + the margin Δ
    its quality difference was tested against). Left out while no trial has completed."""
    r = recommendation
    energy_x = chosen_by(study, r) == "energy"  # [energy, quality]: energy against quality

    def x(t: TrialInfo | Recommendation) -> float | None:
        return t.energy_j_per_sample if energy_x else t.throughput_samples_per_s

    def px(p: RemeasuredPoint) -> float | None:
        return p.energy_j_per_sample if energy_x else p.throughput_samples_per_s

    done = [t for t in completed(trials) if t.role != "remeasure" and x(t) is not None]  # re-measurements: at
    # their config's re-measured point
    remeasured = [p for p in remeasured_points(study, trials, r) if px(p) is not None]
    if not done and not remeasured:
        what = "an energy per sample" if energy_x else "a throughput"
        return Plot(None, f"no trial has completed with {what} and a quality yet, so there is no point to draw.")
    plt = pyplot()
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
                   c="#264653", label=f"baseline: {plural(len(seeds), 'seed')}", zorder=5)
    searched_at = {t.number: t for t in done}
    for p in remeasured:
        if p.role == "baseline":
            seeds_in = p.n - p.remeasures
            runs = (f"{plural(seeds_in, 'seed')} + {plural(p.remeasures, 're-measurement')}" if seeds_in > 0
                    else plural(p.remeasures, "re-measurement"))
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
    """progress.png: the best feasible speedup so far, by trial number (integer ticks), over the
    same baseline throughput as the recommendation's speedup, which is drawn with its interval
    (where energy picks: the lowest energy per sample so far over the baseline's, and the
    recommendation's energy ratio with its interval). Left out while no search trial is a
    candidate."""
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
    plt = pyplot()
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
    """energy.png, drawn only when the trials measured GPU energy: energy per sample (J) against
    throughput of every completed trial that measured both, feasible and infeasible apart, the
    baseline seeds, the front's points and the recommendation."""
    done = [t for t in completed(trials) if t.role != "remeasure" and t.energy_j_per_sample is not None]
    if not done:
        return Plot(None, "no completed trial measured GPU energy and a throughput.")
    plt = pyplot()
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
                   s=200, c="#264653", label=f"baseline: {plural(len(seeds), 'seed')}", zorder=5)
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
    """importances.png: parameter importances (optuna.importance, fANOVA by default), one panel
    per objective that has them (throughput, the quality metric, energy where it is an
    objective), the count of completed search trials on the plot; left out below
    MIN_IMPORTANCE_TRIALS of them (fewer rank noise) or when nothing could be ranked. `imp`:
    `importances` already computed."""
    count = len(searched(trials))
    if count < MIN_IMPORTANCE_TRIALS:
        return Plot(None, f"{plural(count, 'completed search trial')}, and importances from fewer than "
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
    plt = pyplot()
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
        return Plot(None, f"none of the {plural(len(trials), 'trial')} failed." if trials
                    else "no trial has run yet.")
    plt = pyplot()
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
