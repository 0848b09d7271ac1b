"""The tables the CLI and the demo print: studies, trials and a recommendation (rich)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rich.markup import escape as rich_escape
from rich.table import Table

from autotune.contract.views import LOST_TO_RERUN, UNNEEDED, stopped_unneeded

LOST_LABEL = "lost (to be re-run)"  # how the CLI names a LOST_TO_RERUN trial
UNNEEDED_LABEL = "stopped (not needed)"  # an UNNEEDED re-measurement: not pruned for its config

if TYPE_CHECKING:
    from autotune.contract.views import Recommendation, StudyInfo, TrialInfo


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


# Short names for the trial tables (the caption spells them out).
KNOB_ABBREVIATIONS = {"batch_size": "bs", "accum_steps": "acc", "inverse_loss_frequency": "ilf", "checkpoint": "ckpt",
                      "num_workers": "nw", "prefetch_factor": "pf", "fused_optimizer": "fused", "step_graph": "sgraph",
                      "cudnn_benchmark": "cudnn", "pin_memory": "pin", "persistent_workers": "persist",
                      "bucket_cap_mb": "bucket", "no_sync_accumulation": "nosync", "static_graph": "static",
                      "gradient_as_bucket_view": "gabv", "nccl_nsocks_perthread": "nsocks",
                      "nccl_socket_nthreads": "sockthr", "nccl_min_nchannels": "nchan"}
KNOBS_LEGEND = "bs batch_size · acc accum_steps · ilf inverse_loss_frequency · ckpt checkpoint · nw num_workers · " \
               "pf prefetch_factor"


def format_knobs(params: Mapping[str, Any]) -> str:
    """Compact knob values: ``bs=8 acc=2 ilf=4 bf16 ckpt=block fused nw=1 pf=2``."""
    parts = []
    for name, value in params.items():
        short = KNOB_ABBREVIATIONS.get(name, name)
        if name == "precision":
            parts.append(str(value))
        elif isinstance(value, bool):
            if value:
                parts.append(short)
        else:
            parts.append(f"{short}={value}")
    return " ".join(parts) or "(defaults)"


def studies_table(studies: list[StudyInfo]) -> Table:
    table = Table(title="studies")
    table.add_column("study", no_wrap=True)
    table.add_column("state", no_wrap=True)
    table.add_column("hardware")
    table.add_column("trials", justify="right", no_wrap=True)
    table.add_column("outcomes")
    table.add_column("best", justify="right", no_wrap=True)
    for s in studies:
        c = s.counts
        outcomes = " · ".join(f"{n} {label}" for state, label in (("COMPLETE", "complete"), ("PRUNED", "pruned"),
                                                                  ("FAIL", "failed"), ("REPEAT", "repeated"),
                                                                  (LOST_TO_RERUN, LOST_LABEL),
                                                                  (UNNEEDED, UNNEEDED_LABEL),
                                                                  ("RUNNING", "running"))
                              if (n := c.get(state, 0))) or "-"
        best = s.best or {}
        speedup, energy = best.get("speedup"), best.get("energy_ratio")
        shown = "-" if speedup is None else f"{speedup:.2f}×"
        if best.get("chosen_by") == "energy" and energy is not None:  # picked by energy: its ratio first
            shown = f"{energy:.2f}× energy"
        if best and not best.get("certified"):
            shown = "keep baseline" if best.get("outcome") != "not_judged" else "not judged"
        searched = f"{sum(c.values()) - s.remeasures}/{s.spec.n_trials}"  # baseline seeds and search trials
        if s.remeasures:
            searched += f" +{s.remeasures} re-measures"
        table.add_row(s.name, s.state, s.spec.hardware, searched, outcomes, shown)
    return table


def trials_table(trials: list[TrialInfo], title: str) -> Table:
    table = Table(title=title, caption=KNOBS_LEGEND)
    metric = next((t.quality_metric for t in trials if t.quality_metric), "val_nrmse")
    quality = "NRMSE" if metric == "val_nrmse" else metric  # a language model's loss is not an NRMSE
    energy = any(t.energy_j_per_sample is not None for t in trials)  # a GPU study: its J/sample
    numbers = ("#", "samples/s", quality, *(("J/sample",) if energy else ()))
    for column in ("#", "state", "samples/s", quality, *(("J/sample",) if energy else ()), "feasible", "failure"):
        table.add_column(column, justify="right" if column in numbers else "left", no_wrap=True)
    table.add_column("params")
    colors = {"COMPLETE": "green", "FAIL": "red", "PRUNED": "yellow", "REPEAT": "blue", "RUNNING": "cyan"}
    for t in sorted(trials, key=lambda t: t.number):
        state = f"[{colors.get(t.state, 'white')}]{t.state}[/]"
        feasible = {True: "yes", False: "no", None: "-"}[t.feasible]
        failure = t.failure["kind"] if t.failure else ""
        round_ = f", round {t.remeasure_round + 1}" if t.remeasure_round else ""
        role = " [cyan](baseline)[/]" if t.is_baseline else \
            f" [cyan](re-measure of {t.remeasure_of}{round_})[/]" if t.role == "remeasure" else \
            f" [cyan](warm start from {t.warm_start_from})[/]" if t.warm_start_from else \
            f" [cyan](starting point {t.starting_point + 1})[/]" if t.starting_point is not None else \
            f" [cyan](same as {t.repeat_of}, not run)[/]" if t.repeat_of is not None else \
            f" [cyan](the baseline's config: a repeat of trial {t.baseline_repeat_of})[/]" \
            if t.baseline_repeat_of is not None else ""
        params = (format_knobs(t.params) if t.params or t.role != "remeasure" else "") + role
        if t.prune_reason and t.state == "PRUNED":
            failure = "pruned"
            if stopped_unneeded(t.prune_reason):  # stopped for the verdict, not for its config
                failure, feasible = "not needed", "-"
        if t.to_rerun:
            failure += " (to be re-run)"
        table.add_row(str(t.number), state, _num(t.throughput_samples_per_s, ",.1f"), _num(t.quality, ".4f"),
                      *((_num(t.energy_j_per_sample, ".4g"),) if energy else ()), feasible, failure, params)
    return table


def verdict_line(info: StudyInfo) -> str:
    """One line on where the study's verdict stands (`autotune status`, the demo's progress)."""
    best = info.best
    if not best:
        if info.state == "running":
            return "verdict: not yet (the search and the re-measurement of its top configs come first)"
        return f"verdict: none ({info.message})" if info.message else "verdict: none"
    if best.get("certified"):
        speed = best.get("speedup")
        low, high = best.get("speedup_ci_low"), best.get("speedup_ci_high")
        interval = f" (interval {low:.2f}–{high:.2f}×)" if low is not None and high is not None else ""
        return (f"verdict: CERTIFIED trial {best['trial_number']}, {speed:.2f}×{interval} the baseline, quality no "
                f"worse (`autotune best {info.name}`)")
    return f"verdict: keep the baseline ({best.get('outcome')}): {best.get('reason', '')}"


def verdict_table(rec: Recommendation) -> Table:
    """The decision rule's inputs, one row per config: runs, throughput (geometric mean) and its
    spread, quality mean and sd, the speedup's interval and the status."""
    name = "NRMSE" if rec.quality_metric == "val_nrmse" else rec.quality_metric
    table = Table(title=f"the verdict's inputs ({rec.rounds_run} of at most {rec.max_rounds} rounds, "
                        f"{rec.remeasure_probes} re-measure probes)")
    for column in ("trial", "role", "n", "samples/s", "sd(log)", name, f"sd({name})", "speedup (interval)",
                   "status"):
        table.add_column(column, justify="right" if column not in ("role", "status") else "left", no_wrap=True)
    colors = {"certified": "green", "rejected": "red", "undecided": "yellow", "failed": "red", "stopped": "white",
              "baseline": "cyan"}
    for row in rec.configs:
        interval = "-" if row.speedup is None else f"{row.speedup:.2f}×"
        if row.speedup_ci_low is not None and row.speedup_ci_high is not None:
            interval += f" ({row.speedup_ci_low:.2f}–{row.speedup_ci_high:.2f})"
        table.add_row(str(row.trial_number), row.role, str(row.n), _num(row.throughput_samples_per_s, ",.1f"),
                      _num(row.throughput_sd_log, ".3f"), _num(row.quality_mean, ".4f"), _num(row.quality_sd, ".2g"),
                      interval, f"[{colors.get(row.status, 'white')}]{row.status}[/]")
    return table


def recommendation_table(rec: Recommendation) -> Table:
    if not rec.certified:
        return _keep_baseline_table(rec)
    picked = " (lowest energy per sample)" if rec.chosen_by == "energy" else ""
    table = Table(title=f"CERTIFIED: recommended config of {rec.study}: trial {rec.trial_number}{picked}",
                  show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("[green]verdict[/]", f"[green]{rich_escape(rec.verdict)}[/]")
    base_thr = rec.baseline_throughput_samples_per_s
    table.add_row("throughput", f"{rec.throughput_samples_per_s:,.1f} samples/s"
                  + ("" if base_thr is None else f" (baseline {base_thr:,.1f})"))
    if rec.throughput_ci_low is not None and rec.throughput_ci_high is not None:
        table.add_row("95% CI", f"{rec.throughput_ci_low:,.1f} – {rec.throughput_ci_high:,.1f} samples/s "
                      + (f"(over its {rec.remeasure_rounds} re-measurements: runs are the unit)" if rec.remeasured
                         and rec.remeasure_rounds >= 2 else "(over the trial's windows)"))
    if len(rec.round_throughputs) >= 2:
        table.add_row("re-measurements", ", ".join(f"{r:,.1f}" for r in rec.round_throughputs)
                      + " samples/s (round by round)")
    speedup = "-" if rec.speedup is None else f"{rec.speedup:.2f}× over the baseline"
    if rec.speedup is not None and rec.speedup_ci_low is not None and rec.speedup_ci_high is not None:
        speedup += f" (95% CI {rec.speedup_ci_low:.2f}–{rec.speedup_ci_high:.2f}×)"
    if rec.baseline_remeasured:
        speedup += ", both re-measured at the same budget"
    table.add_row("speedup", speedup)
    if rec.beats_baseline is False and rec.chosen_by == "throughput":
        table.add_row("[red]verdict[/]", f"[red]{rich_escape(rec.verdict)}[/]")
    if rec.energy_j_per_sample is not None:
        energy = f"{rec.energy_j_per_sample:.4g} J/sample"
        if rec.baseline_energy_j_per_sample is not None:
            energy += f" (baseline {rec.baseline_energy_j_per_sample:.4g})"
        table.add_row("energy", energy + (f" · {rec.energy_method}" if rec.energy_method else ""))
        if rec.energy_verdict:
            bad = rec.saves_energy is False and rec.chosen_by == "energy"
            table.add_row("[red]energy verdict[/]" if bad else "energy ratio",
                          f"[red]{rich_escape(rec.energy_verdict)}[/]" if bad else rich_escape(rec.energy_verdict))
    name = "val NRMSE" if rec.quality_metric == "val_nrmse" else rec.quality_metric
    if rec.baseline_quality is None or rec.quality is None:
        quality_vs = ""
    else:
        spread = f" ± {rec.baseline_quality_std:.4f}" if rec.baseline_quality_std is not None else ""
        seeds = f" over {rec.baseline_seeds} seed{'s' if rec.baseline_seeds != 1 else ''}" if rec.baseline_seeds else ""
        quality_vs = (f" (baseline {rec.baseline_quality:.4f}{spread}{seeds}, "
                      f"{rec.quality - rec.baseline_quality:+.4f})")
    budget = " at the re-measure budget" if rec.quality_budget == "remeasure" else ""
    table.add_row(name, ("-" if rec.quality is None else f"{rec.quality:.4f}") + quality_vs + budget)
    if rec.quality_budget == "remeasure" and rec.search_quality is not None:
        table.add_row(f"{name} (search)", f"{rec.search_quality:.4f} in the search's shorter probe")
    if rec.gate_quality is not None:
        side = "<=" if rec.quality_direction == "minimize" else ">="
        table.add_row("quality gate", f"{name} {side} {rec.gate_quality:.4f}")
    table.add_row("peak memory", "n/a (not measured on this device)" if rec.peak_mem_reserved_bytes is None
                  else f"{rec.peak_mem_reserved_bytes / 2**30:.2f} GiB reserved")
    for note in [*rec.measurement_notes, *rec.caveats]:
        table.add_row("[yellow]note[/]", rich_escape(note))
    for knob, value in rec.config.items():
        table.add_row(f"  {knob}", json.dumps(value))
    return table


def _keep_baseline_table(rec: Recommendation) -> Table:
    """No certified pick: the verdict, why, and the fastest uncertified candidate (not the config to use)."""
    table = Table(title=f"verdict of {rec.study}: KEEP THE BASELINE ({rec.outcome})", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("[yellow]why[/]", f"[yellow]{rich_escape(rec.reason)}[/]")
    base = rec.baseline_throughput_samples_per_s
    table.add_row("baseline", f"trial {rec.trial_number}" + ("" if base is None else f", {base:,.1f} samples/s"))
    row = rec.uncertified
    if row is not None:
        speed = "" if row.speedup is None else f", {row.speedup:.2f}×"
        if row.speedup_ci_low is not None and row.speedup_ci_high is not None:
            speed += f" (interval {row.speedup_ci_low:.2f}–{row.speedup_ci_high:.2f}×)"
        table.add_row("fastest uncertified", f"trial {row.trial_number} ({row.status}{speed}, {row.n} runs): "
                      f"`autotune best {rec.study} --uncertified`")
    for note in rec.caveats:
        table.add_row("[yellow]note[/]", rich_escape(note))
    return table
