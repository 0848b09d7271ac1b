"""`autotune report`: a study's results as report.html plus PNG figures (autotune/cli/plots.py;
a figure with nothing to draw is left out and the page says why in one sentence).

report.html opens with the verdict (`headline`): the certified pick with its speedup and the
speedup's interval, or "keep the baseline" with the reason; no verdict yet while the study runs."""

from __future__ import annotations

import html
import json
from dataclasses import dataclass, field
from pathlib import Path

from autotune.cli.plots import (
    energy_figure,
    failures_figure,
    importances_figure,
    pareto_figure,
    progress_figure,
    pyplot,
)
from autotune.cli.report_data import (
    chosen_by,
    config_row,
    fmt,
    plural,
    quality_label,
    quality_of,
    remeasured_points,
    search_gate,
    verdict_bound,
)
from autotune.contract.views import Recommendation, StudyInfo, TrialInfo


@dataclass(frozen=True)
class ReportFiles:
    html: Path
    figures: dict[str, Path]  # the figures written, by name (pareto, progress, ...)
    left_out: dict[str, str] = field(default_factory=dict)  # a figure not written → why, one sentence
    headline: str = ""  # the verdict in one line: report.html's first line


def _headline(study: StudyInfo, r: Recommendation | None) -> tuple[str, str]:
    """(the verdict in a few words, the sentence behind it)."""
    if r is None:
        return ("No verdict yet", study.message or "the baseline or the search has not finished, or the "
                "re-measurement of its top configs is still running (autotune best says which)")
    if not r.certified:
        return f"Verdict: keep the baseline ({r.outcome.replace('_', ' ')})", r.reason or r.verdict
    row = config_row(r, r.trial_number, "candidate")
    if r.chosen_by == "energy":
        ratio = row.speedup if row is not None and row.speedup is not None else r.energy_ratio
        low = row.speedup_ci_low if row is not None and row.speedup is not None else r.energy_ratio_ci_low
        high = row.speedup_ci_high if row is not None and row.speedup is not None else r.energy_ratio_ci_high
        what = "the baseline's energy per sample"
    else:
        ratio, low, high, what = r.speedup, r.speedup_ci_low, r.speedup_ci_high, "the baseline's throughput"
    interval = f" (interval {low:.2f}–{high:.2f}×)" if low is not None and high is not None else " (no interval)"
    title = f"Verdict: trial {r.trial_number}, certified: {fmt(ratio, '.2f')}× {what}{interval}"
    return title, r.reason or r.verdict


def headline(study: StudyInfo, recommendation: Recommendation | None) -> str:
    """The report's first line: the certified pick with its speedup (energy ratio where energy
    picks) and that ratio's interval, or "keep the baseline" with the reason, or no verdict yet."""
    title, why = _headline(study, recommendation)
    return f"{title}: {why}" if why else title


def _verdict_inputs(r: Recommendation) -> str:
    """The decision rule's inputs as an HTML table: n, mean and sd per config, and each status."""
    if not r.configs:
        return ""
    esc = html.escape
    rows = "".join(
        f"<tr><td>{c.trial_number}</td><td>{esc(c.role)}</td><td>{c.n}</td>"
        f"<td>{fmt(c.throughput_samples_per_s, ',.1f')}</td><td>{fmt(c.throughput_sd_log, '.3f')}</td>"
        f"<td>{fmt(c.quality_mean, '.4f')}</td>"
        f"<td>{fmt(c.quality_sd, '.2g')}</td><td>{fmt(c.speedup, '.2f')}"
        + (f" ({c.speedup_ci_low:.2f}–{c.speedup_ci_high:.2f})" if c.speedup_ci_low is not None
           and c.speedup_ci_high is not None else "")
        + f"</td><td>{esc(c.status)}</td><td>{esc(c.reason)}</td></tr>" for c in r.configs)
    return (f"<p>The verdict's inputs ({r.rounds_run} of at most {r.max_rounds} rounds, {r.remeasure_probes} "
            "re-measure probes; docs/measurement.md, <i>The verdict</i>):</p><table><tr><th>trial</th><th>role</th>"
            "<th>n</th><th>samples/s (geometric mean)</th><th>sd(log)</th><th>quality</th><th>sd</th>"
            f"<th>speedup (interval)</th><th>status</th><th>why</th></tr>{rows}</table>")


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
        elif t.warm_start_from:
            text += f": warm start from study {t.warm_start_from}"
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
                     f"{plural(bound.baseline_runs, 'run')} ({bound.baseline_quality:.4f}) shifted by the margin "
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
            f"the search's gate {side} {fmt(search_gate(r), '.4f')}" if bound is not None
            else f"gate {side} {fmt(search_gate(r), '.4f')}")
    return (f"<p>Trial {r.trial_number}: <b>{r.throughput_samples_per_s:,.1f} samples/s</b>"
            f" ({fmt(r.speedup, '.2f')}× the baseline's {fmt(r.baseline_throughput_samples_per_s, ',.1f')}),"
            f" {esc(label)} {fmt(quality, '.4f')} (baseline {fmt(baseline_quality, '.4f')}, {esc(gate)}).</p>"
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
        pyplot().close(plot.figure)
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
            f"<td>{fmt(t.throughput_samples_per_s, ',.1f')}</td><td>{fmt(quality_of(t), '.4f')}</td>"
            + (f"<td>{fmt(t.energy_j_per_sample, '.4g')}</td>" if energy else "")
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
    # Built by hand rather than with a template engine: one page, every value from the service goes
    # through html.escape (numbers through format), and jinja2 is no dependency of the project (it
    # only comes with torch), so the report needs nothing more than the client does.
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
