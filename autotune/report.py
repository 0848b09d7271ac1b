"""`autotune report`: a study's results as report.html plus PNG figures.

Figures (matplotlib, written next to report.html):

pareto.png        throughput vs the study's quality metric (validation NRMSE for ups,
                  validation loss for gpt, ...) of every completed trial; feasible
                  (passes the quality gate) and infeasible marked apart, the baseline
                  starred, the gate drawn, the Pareto front connected
progress.png      best feasible speedup over the baseline so far, by trial number
importances.png   parameter importances (optuna.importance, fANOVA by default) for
                  throughput and for the quality metric, over the completed trials
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.protocol import Recommendation, StudyInfo, TrialInfo

log = logging.getLogger(__name__)


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


def pareto_front(trials: list[TrialInfo], direction: str = "minimize") -> list[TrialInfo]:
    """Completed trials not dominated in (max throughput, best quality in `direction`), by throughput."""
    done = _completed(trials)
    sign = 1.0 if direction == "minimize" else -1.0
    front = []
    for t in done:
        q = sign * (quality_of(t) or 0.0)
        assert t.throughput_samples_per_s is not None
        dominated = any(
            o.throughput_samples_per_s is not None
            and o.throughput_samples_per_s >= t.throughput_samples_per_s and sign * (quality_of(o) or 0.0) <= q
            and (o.throughput_samples_per_s > t.throughput_samples_per_s or sign * (quality_of(o) or 0.0) < q)
            for o in done)
        if not dominated:
            front.append(t)
    return sorted(front, key=lambda t: t.throughput_samples_per_s or 0.0)


def best_so_far(trials: list[TrialInfo]) -> list[tuple[int, float | None]]:
    """(trial number, best feasible speedup over the baseline among trials up to it)."""
    baseline = next((t for t in trials if t.is_baseline and t.state == "COMPLETE"), None)
    base = baseline.throughput_samples_per_s if baseline else None
    best: float | None = None
    out = []
    for t in sorted(trials, key=lambda t: t.number):
        if base and t.feasible and t.throughput_samples_per_s:
            speedup = t.throughput_samples_per_s / base
            best = speedup if best is None else max(best, speedup)
        out.append((t.number, best))
    return out


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
    rows = [t for t in _completed(trials) if not t.is_baseline and t.params]
    if len(rows) < 3:
        return {}
    names = sorted({k for t in rows for k in t.params if k in dists})
    if not names:
        return {}
    out: dict[str, dict[str, float]] = {}
    for objective, value_of in (("throughput", lambda t: t.throughput_samples_per_s), ("quality", quality_of)):
        st = optuna.create_study(direction="maximize" if objective == "throughput" else
                                 study.spec.quality_direction)
        for t in rows:
            params = {k: v for k, v in t.params.items() if k in names}
            st.add_trial(optuna.trial.create_trial(params=params, distributions={k: dists[k] for k in params},
                                                   value=float(value_of(t) or 0.0)))
        try:
            out[objective] = dict(optuna.importance.get_param_importances(st))
        except (RuntimeError, ValueError) as e:  # e.g. every trial has the same params
            log.info("no importances for %s: %s", objective, e)
    return out


def _plot_pareto(study: StudyInfo, trials: list[TrialInfo], gate: float | None, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    done = _completed(trials)
    label_q = quality_label(study, trials)
    direction = study.spec.quality_direction
    for feasible, style, label in ((True, dict(c="#2a9d8f", marker="o"), "feasible"),
                                   (False, dict(c="#e76f51", marker="x"), "infeasible"),
                                   (None, dict(c="#999999", marker="."), "not judged yet")):
        pts = [t for t in done if t.feasible is feasible and not t.is_baseline]
        if pts:
            ax.scatter([t.throughput_samples_per_s for t in pts], [quality_of(t) for t in pts], label=label, **style)
    for t in done:
        if t.is_baseline:
            ax.scatter([t.throughput_samples_per_s], [quality_of(t)], marker="*", s=250, c="#264653",
                       label="baseline", zorder=5)
    front = pareto_front(trials, direction)
    if len(front) > 1:
        ax.plot([t.throughput_samples_per_s for t in front], [quality_of(t) for t in front], "k--", lw=0.8,
                label="Pareto front")
    side = "≤" if direction == "minimize" else "≥"
    if gate is not None:
        ax.axhline(gate, color="#e9c46a", lw=1.2, label=f"quality gate ({label_q} {side} {gate:.4f})")
    ax.set_xlabel("throughput (samples/s, higher is better)")
    ax.set_ylabel(f"validation {label_q} ({'lower' if direction == 'minimize' else 'higher'} is better)"
                  if label_q == "NRMSE" else f"{label_q} ({'lower' if direction == 'minimize' else 'higher'} "
                  "is better)")
    ax.set_title(f"{study.name}: speed vs quality")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_progress(study: StudyInfo, trials: list[TrialInfo], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    points = [(n, s) for n, s in best_so_far(trials) if s is not None]
    if points:
        ax.step([p[0] for p in points], [p[1] for p in points], where="post", color="#264653")
        ax.scatter([p[0] for p in points], [p[1] for p in points], s=10, color="#264653")
    else:
        ax.text(0.5, 0.5, "no feasible trial yet", ha="center", va="center", transform=ax.transAxes)
    ax.axhline(1.0, color="#999999", lw=0.8)
    ax.set_xlabel("trial number")
    ax.set_ylabel("best feasible speedup (×)")
    ax.set_title(f"{study.name}: best so far")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_importances(study: StudyInfo, imp: dict[str, dict[str, float]], path: Path, label: str = "NRMSE"
                      ) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    for ax, (objective, title) in zip(axes, (("throughput", "throughput"), ("quality", label)), strict=True):
        values = imp.get(objective, {})
        if values:
            names = list(values)[::-1]
            ax.barh(names, [values[n] for n in names], color="#2a9d8f")
        else:
            ax.text(0.5, 0.5, "too few trials", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"importance for {title}")
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


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def write_report(study: StudyInfo, trials: list[TrialInfo], recommendation: Recommendation | None,
                 out: Path) -> ReportFiles:
    """Write report.html and the PNGs into `out` (created if missing)."""
    out.mkdir(parents=True, exist_ok=True)
    gate = (recommendation.gate_quality if recommendation.gate_quality is not None
            else recommendation.gate_nrmse) if recommendation else None
    label = quality_label(study, trials)
    side = "≤" if study.spec.quality_direction == "minimize" else "≥"
    figures = {name: out / f"{name}.png" for name in ("pareto", "progress", "importances", "failures")}
    _plot_pareto(study, trials, gate, figures["pareto"])
    _plot_progress(study, trials, figures["progress"])
    _plot_importances(study, importances(study, trials), figures["importances"], label)
    _plot_failures(study, trials, figures["failures"])

    esc = html.escape
    rows = []
    for t in sorted(trials, key=lambda t: t.number):
        feasible = {True: "yes", False: "no", None: "–"}[t.feasible]
        failure = f"{t.failure.get('kind')}: {t.failure.get('message', '')}" if t.failure else ""
        rows.append(
            f"<tr><td>{t.number}{' (baseline)' if t.is_baseline else ''}</td><td>{esc(t.state)}</td>"
            f"<td>{_fmt(t.throughput_samples_per_s, ',.1f')}</td><td>{_fmt(quality_of(t), '.4f')}</td>"
            f"<td>{feasible}</td><td>{esc(failure[:200])}</td><td><code>{esc(json.dumps(t.params))}</code></td></tr>")
    if recommendation:
        r = recommendation
        quality = r.quality if r.quality is not None else r.val_nrmse
        baseline_quality = r.baseline_quality if r.baseline_quality is not None else r.baseline_val_nrmse
        rec = (f"<p>Trial {r.trial_number}: <b>{r.throughput_samples_per_s:,.1f} samples/s</b>"
               f" ({_fmt(r.speedup, '.2f')}× the baseline's {_fmt(r.baseline_throughput_samples_per_s, ',.1f')}),"
               f" {esc(label)} {_fmt(quality, '.4f')} (baseline {_fmt(baseline_quality, '.4f')},"
               f" gate {side} {_fmt(gate, '.4f')}).</p>"
               f"<pre>{esc(json.dumps(r.config, indent=2))}</pre>")
    else:
        rec = "<p>No recommendation yet: no completed trial passes the quality gate.</p>"
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
<h2>Recommendation</h2>{rec}
<h2>Speed vs quality</h2><img src="pareto.png" alt="Pareto front">
<h2>Best so far</h2><img src="progress.png" alt="best feasible speedup by trial">
<h2>Parameter importances</h2><img src="importances.png" alt="parameter importances">
<h2>Failures</h2><img src="failures.png" alt="trials by state and failure kind">
<h2>Trials</h2><table><tr><th>#</th><th>state</th><th>samples/s</th><th>{esc(label)}</th><th>feasible</th>
<th>failure</th><th>params</th></tr>{''.join(rows)}</table>
</body></html>
"""
    path = out / "report.html"
    path.write_text(page)
    return ReportFiles(html=path, figures=figures)
