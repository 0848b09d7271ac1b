"""Benchmark (issue 39, item 4, the measured half): a warm start's savings on a real job, and
`autotune check` on an unchanged host and on a deliberately slowed pick.

bench/warm_start.py measures the warm start on planted truth (simulated probes, many seeds);
bench/regression_check.py measures `check` on the CPU demo's job. This script does both on one
host with real probes, through the commands a user runs, in one work directory (one SQLite
database, so a later study can name an earlier one):

  A   `autotune tune` a first study of the job (sampler seed --seed): its verdict and best.yaml;
  B'  a second study of the same job, `warm_start: [A]` (sampler seed --seed + 1000);
  B   the same study cold (`warm_start: none`), the same sampler seed, n_trials and probe seeds.
      B' runs before B by default (--order): whatever the host warms up (caches, clocks) helps
      the cold study, not the warm one. Each study gets a fresh worker (one per GPU; --workers 1).
  C   `autotune check A/best.yaml --json` unchanged (it should hold: exit 0), then the same file
      with the pick's knobs replaced by the recorded baseline's own (--slowed; its record still
      claims the certified speedup): it should say "regressed" (exit 1). bench/regression_check.py's
      functions.

The job on a GPU (default): the `gpt` workload's tiny preset (a byte-level GPT, 2 blocks of width
64, context 64: a launch-bound step) with the user's baseline 8 × 2 in fp32, eager, and a space
of 48 configs that all keep its effective batch of 16 (GPT_TINY_GPU_SPACE: precision, the step
graph, batch 8 × 2 or 16 × 1, fused AdamW, the auxiliary loss every 1 or 4 steps; no
torch.compile, whose cold compiles would take most of a 9-minute budget). The gate accepts a val_loss
up to 0.08 above the baseline's (`gate.abs_tol`; the default margin is 2 × the baseline's seed spread,
~0.05 here) and the verdict runs up to 6 rounds: these 512-step runs end ±0.03 apart from seed to seed,
and a config's run with the baseline's seed is no closer to it (another precision takes another
trajectory), so at the default margin and 3 rounds the first H200 run (2026-11-29) certified one
study of three, with 16–21× speedups measured in all three. `starting_points:
none` (--starting-points): with the fast stack tried first in both studies, B and B' would start
alike and the warm start's own effect would not show; `auto` measures the two together. On a
CPU (--device cpu, the smoke run) the job is the CPU demo's: ups tiny on the `ups-tiny-cpu` space.

What is measured, per study, from the service's trial records (the database, read after each
study: `StudyService` of autotune.api, as `autotune status` and `best` read it):
  * GPU-seconds: every trial's lease-to-complete wall time (TrialInfo.duration_s: the probe and
    the worker's handling of it, the GPU held), summed over the trials running before a moment
    (one GPU: the trials one after the other). REPEAT draws are never run and cost ~0 s.
  * to the pick: the GPU-s until the trial that first measured the eventual certified pick
    completed (`gpu_s_to_pick`; "not reached" where nothing was certified), and to the end
    of the study (`gpu_s`: baseline seeds, search, warm-start points, the verdict's re-measure
    rounds: when the certified pick is certified);
  * to the target: the GPU-s until the study first measured a feasible config at least
    --target-fraction (0.9) of the fastest search throughput either second study measured:
    B's own pick can be a slower config found early, so this compares B and B' on one yardstick;
  * certified or not, the pick (the space's knobs), its speedup with its 95 % interval, whether
    it is A's pick, the trials by role and how many came from the warm start (warm_start_from).

Writes --out (JSON; rewritten after each phase, so a timeout still leaves what was measured),
a PNG next to it (a 256-colour palette image) and prints a markdown summary. Every phase is
bounded by --deadline-s (from the script's start; the checks keep --check-reserve-s of it):
a study past its share is stopped (SIGTERM: `autotune tune` stops its workers and service)
and recorded unfinished.

    python bench/warm_start_gpu.py --device cuda --out bench/results/warm_start_h200.json    # <= 560 s (--deadline-s)
    python bench/warm_start_gpu.py --device cpu --out /tmp/ws_cpu.json   # the CPU smoke: 14 min on a busy 2-core host
    python bench/warm_start_gpu.py --report bench/results/warm_start_h200.json               # table and PNG again

A host without matplotlib and Pillow gets no PNG (the run says so): draw it from the JSON with --report.

Exit status: 0 when A was certified, B and B' finished, and both checks answered as expected
(0 and 1); 1 otherwise (the JSON says what happened).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import resultfiles
import yaml
from regression_check import BASELINE, CLI, check_both, run_bounded
from studylib import code_version, environment, pyplot

ROOT = Path(__file__).resolve().parents[1]
B_SEED_OFFSET = 1000  # the second studies' sampler seed: --seed + 1000 (B cold does not replay A's draws)

# The gpt tiny preset on one GPU: every config keeps the baseline's effective batch (8 × the preset's
# accum 2, or 16 × 1), so each trains the same optimizer steps at the probe's fixed samples and the
# quality gate stays within reach; what differs is how fast a step runs.
GPT_TINY_GPU_SPACE: dict[str, Any] = {
    "name": "gpt-tiny-gpu",
    "description": "gpt tiny on one GPU at its effective batch of 16, no torch.compile",
    "params": {
        "precision": {"choices": ["fp32", "tf32", "bf16"]},
        "step_graph": {"choices": [False, True]},
        "batch_size": {"choices": [8, 16]},
        "accum_steps": {"choices": [1], "when": {"batch_size": [16]}},  # batch 8 keeps the preset's accum 2
        "fused_optimizer": {"choices": [False, True]},
        "inverse_loss_frequency": {"choices": [1, 4]},
    },
}
GPU_SPEC: dict[str, Any] = {
    "workload": "gpt", "preset": "tiny", "space": GPT_TINY_GPU_SPACE, "sampler": "tpe", "n_trials": 10,
    "baseline": {"batch_size": 8, "accum_steps": 2}, "baseline_seeds": 3, "probe": {"samples": 8192},
    "gate": {"abs_tol": 0.08}, "remeasure": {"top_k": 2, "max_rounds": 6}, "starting_points": "none",
}
# the CPU smoke: bench/regression_check.py's DEMO_SPEC job (ups tiny, ups-tiny-cpu), smaller
CPU_SPEC: dict[str, Any] = {
    "workload": "ups", "preset": "tiny", "space": "ups-tiny-cpu", "hardware": "cpu", "sampler": "tpe",
    "n_trials": 6, "baseline_seeds": 3, "probe": {"samples": 384}, "remeasure": {"top_k": 2, "max_rounds": 3},
    "starting_points": "none",
}
DEVICE_DEFAULTS: dict[str, dict[str, float]] = {  # per device kind: seconds
    "cuda": {"deadline_s": 560.0, "study_budget_s": 150.0, "check_reserve_s": 120.0},
    "cpu": {"deadline_s": 1500.0, "study_budget_s": 420.0, "check_reserve_s": 300.0},
}
GROUPS = ("first", "warm", "cold")
LABEL = {"first": "A: first study", "warm": "B': second, warm from A", "cold": "B: second, cold"}
TRACE = {"baseline": "b", "search": "s", "remeasure": "r"}
END_RESERVE_S = 8.0  # kept at the deadline for the JSON, the table and the PNG


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- the studies ------------------------------------------------------------------------------------

def study_spec(base: dict[str, Any], name: str, seed: int, warm_start: Any, args: argparse.Namespace) -> dict[str, Any]:
    spec = json.loads(json.dumps(base))  # a deep copy
    spec |= {"name": name, "seed": seed, "warm_start": warm_start}
    if args.n_trials is not None:
        spec["n_trials"] = args.n_trials
    if args.samples is not None:
        spec["probe"] = {**spec.get("probe", {}), "samples": args.samples}
    if args.starting_points is not None:
        spec["starting_points"] = args.starting_points
    return spec


def tune(spec: dict[str, Any], work: Path, budget_s: float, env: dict[str, str] | None = None,
         workers: int = 1) -> dict[str, Any]:
    """`autotune tune` one study in `work` (its database shared by every study), bounded by `budget_s`
    (in `env`, else this process's environment), with `workers` local workers (`tune` gives each a
    GPU of its own where there are that many)."""
    name = spec["name"]
    (work / f"{name}.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    best = work / f"{name}.best.yaml"
    argv = [*CLI, "tune", f"{name}.yaml", "--workdir", str(work / "tune"), "--out", best.name,
            "--workers", str(workers)]
    _log(f"tune {name} (at most {budget_s:.0f} s)")
    done = run_bounded(argv, budget_s, cwd=work, grace_s=40.0, env=env)
    (work / f"{name}.tune.log").write_text(done.stdout + ("\n--- stderr ---\n" + done.stderr if done.stderr else ""))
    out: dict[str, Any] = {"exit_code": done.returncode, "wall_s": done.wall_s, "timed_out": done.timed_out,
                           "verdict_line": next((ln for ln in done.stdout.splitlines() if ln.startswith("verdict")),
                                                None)}
    if done.returncode not in (0, 1):
        out["stdout_tail"] = done.stdout[-2500:]
        out["stderr_tail"] = done.stderr[-1500:]
    if best.exists():
        out["best_yaml"] = str(best)
    _log(f"tune {name}: exit {done.returncode} in {done.wall_s:.0f} s; {out['verdict_line']}")
    return out


def read_study(db_url: str, name: str) -> dict[str, Any]:
    """The study as the service sees it: its state, every trial (TrialInfo, with its start and
    completion from the Optuna record) and the verdict (None: none yet)."""
    from autotune.api.errors import NotFound
    from autotune.api.settings import Settings
    from autotune.api.studies import StudyService

    svc = StudyService(Settings(db_url=db_url))
    try:
        info = svc.get_study(name)
        infos = {t.number: t.model_dump(mode="json") for t in svc.list_trials(name)}
        records = svc.bridge.trials(name)
        try:
            rec: dict[str, Any] | None = svc.best(name).model_dump(mode="json")
        except NotFound:
            rec = None
    finally:
        svc.close()
    starts = [r.datetime_start for r in records if r.datetime_start is not None]
    t0 = min(starts) if starts else None

    def rel(t: datetime | None) -> float | None:
        return None if t is None or t0 is None else round((t - t0).total_seconds(), 3)

    trials = []
    for r in sorted(records, key=lambda r: r.number):
        t = infos.get(r.number, {})
        trials.append({"number": r.number, "state": t.get("state", r.state), "role": t.get("role"),
                       "params": t.get("params") or {}, "config": t.get("config"),
                       "throughput": t.get("throughput_samples_per_s"), "quality": t.get("quality"),
                       "feasible": t.get("feasible"), "failure": t.get("failure"),
                       "warm_start_from": t.get("warm_start_from"), "starting_point": t.get("starting_point"),
                       "remeasure_of": t.get("remeasure_of"), "remeasure_round": t.get("remeasure_round"),
                       "repeat_of": t.get("repeat_of"), "prune_reason": t.get("prune_reason"),
                       "start_s": rel(r.datetime_start), "end_s": rel(r.datetime_complete),
                       "duration_s": None if t.get("duration_s") is None else round(float(t["duration_s"]), 3)})
    return {"state": info.state, "counts": info.counts, "trials": trials, "recommendation": rec}


def gpu_s_until(trials: list[dict[str, Any]], moment: float | None) -> float | None:
    """GPU-seconds spent by `moment` (seconds from the study's first trial; None: not reached):
    each trial's lease-to-complete interval, cut at `moment` (exact for one worker or several)."""
    if moment is None:
        return None
    total = 0.0
    for t in trials:
        if t["start_s"] is None:
            continue
        end = t["end_s"] if t["end_s"] is not None else moment
        total += max(0.0, min(end, moment) - t["start_s"])
    return round(total, 2)


def space_knobs(trial: dict[str, Any]) -> dict[str, Any]:
    return dict(sorted((trial.get("params") or {}).items()))


def summarize(group: str, study: dict[str, Any], run: dict[str, Any], first_pick: dict[str, Any] | None
              ) -> dict[str, Any]:
    """The study's figures (see the module docstring)."""
    trials = study["trials"]
    rec = study["recommendation"] or {}
    certified = bool(rec.get("certified"))
    by_number = {t["number"]: t for t in trials}
    pick_trial = by_number.get(rec.get("trial_number", -1)) if certified else None
    pick = space_knobs(pick_trial) if pick_trial else None
    # the first completed measurement of the pick's config (its search trial, or a warm-start point)
    firsts = sorted((t for t in trials if t["state"] == "COMPLETE" and t["role"] == "search"
                     and pick is not None and space_knobs(t) == pick and t["end_s"] is not None),
                    key=lambda t: t["end_s"])
    first = firsts[0] if firsts else None
    ran = [t for t in trials if t["state"] != "REPEAT"]
    ran_by_end = sorted((t for t in ran if t["end_s"] is not None), key=lambda t: t["end_s"])
    end = max((t["end_s"] for t in ran_by_end), default=None)
    roles: dict[str, int] = {}
    for t in ran:
        key = "warm" if t.get("warm_start_from") else str(t["role"])
        roles[key] = roles.get(key, 0) + 1
    trace = "".join("." if t["state"] == "REPEAT" else
                    ("w" if t.get("warm_start_from") else TRACE.get(str(t["role"]), "?")).upper()
                    if pick is not None and space_knobs(t) == pick else
                    ("w" if t.get("warm_start_from") else TRACE.get(str(t["role"]), "?"))
                    for t in sorted(trials, key=lambda t: (t["start_s"] is None, t["start_s"] or 0.0, t["number"])))
    base_cv: dict[str, Any] = next((c for c in rec.get("configs") or [] if c.get("role") == "baseline"), {})
    out: dict[str, Any] = {
        "group": group, "label": LABEL[group], "state": study["state"], "finished": study["state"] == "finished",
        "certified": certified, "outcome": rec.get("outcome", "no recommendation"), "reason": rec.get("reason"),
        "pick_trial": rec.get("trial_number") if certified else None, "pick": pick,
        "pick_config": rec.get("config") if certified else None,
        "pick_from_warm_start": None if first is None else first.get("warm_start_from"),
        "same_pick_as_a": None if pick is None or first_pick is None else pick == first_pick,
        "speedup": rec.get("speedup") if certified else None,
        "speedup_ci": [rec.get("speedup_ci_low"), rec.get("speedup_ci_high")] if certified else None,
        "pick_throughput": rec.get("throughput_samples_per_s") if certified else None,
        "baseline_throughput": base_cv.get("throughput_samples_per_s") or rec.get("baseline_throughput_samples_per_s"),
        "quality_metric": rec.get("quality_metric"), "pick_quality": rec.get("quality") if certified else None,
        "baseline_quality": rec.get("baseline_quality"),
        "uncertified_best": None if certified or not rec.get("uncertified") else {
            "trial": rec["uncertified"].get("trial_number"), "status": rec["uncertified"].get("status"),
            "speedup": rec["uncertified"].get("speedup")},
        "rounds_run": rec.get("rounds_run"), "remeasure_probes": rec.get("remeasure_probes"),
        "trials_run": len(ran), "repeats": len(trials) - len(ran), "by_role": roles,
        "warm_points": sum(bool(t.get("warm_start_from")) for t in trials),
        "pick_first_measured_trial": None if first is None else first["number"],
        "pick_first_measured_probe": None if first is None else 1 + ran_by_end.index(first),
        "gpu_s_to_pick": gpu_s_until(trials, None if first is None else first["end_s"]),
        "wall_s_to_pick": None if first is None else first["end_s"],
        "gpu_s": gpu_s_until(trials, end) if end is not None else 0.0,
        "gpu_s_search": round(sum(t["duration_s"] or 0.0 for t in ran if t["role"] in ("baseline", "search")), 2),
        "study_wall_s": end, "trace": trace,
        "provenance": rec.get("provenance"), "tune": run, "trials": trials,
    }
    return out


def add_targets(rows: dict[str, dict[str, Any]], fraction: float) -> float | None:
    """Set each study's GPU-s to the first feasible measured config at least `fraction` of the
    fastest search throughput B or B' measured (the shared yardstick); returns that target."""
    seconds = [rows[g] for g in ("warm", "cold") if g in rows]
    fastest = max((t["throughput"] for r in seconds for t in r["trials"] if t["role"] == "search"
                   and t["state"] == "COMPLETE" and t["feasible"] and t["throughput"]), default=None)
    if fastest is None:
        return None
    target = fraction * fastest
    for r in rows.values():
        hits = sorted((t for t in r["trials"] if t["role"] == "search" and t["state"] == "COMPLETE" and t["feasible"]
                       and (t["throughput"] or 0.0) >= target and t["end_s"] is not None), key=lambda t: t["end_s"])
        r["target_trial"] = hits[0]["number"] if hits else None
        r["gpu_s_to_target"] = gpu_s_until(r["trials"], hits[0]["end_s"]) if hits else None
    return round(target, 1)


def comparison(rows: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    warm, cold = rows.get("warm"), rows.get("cold")
    if warm is None or cold is None:
        return None

    def ratio(key: str) -> float | None:
        w, c = warm.get(key), cold.get(key)
        return None if w is None or c is None or c == 0 else round(w / c, 3)

    return {"warm_over_cold_gpu_s_to_pick": ratio("gpu_s_to_pick"),
            "warm_over_cold_gpu_s_to_target": ratio("gpu_s_to_target"),
            "warm_over_cold_gpu_s": ratio("gpu_s"),
            "gpu_s_saved_to_pick": None if warm.get("gpu_s_to_pick") is None or cold.get("gpu_s_to_pick") is None
            else round(cold["gpu_s_to_pick"] - warm["gpu_s_to_pick"], 1),
            "both_certified": bool(warm["certified"] and cold["certified"]),
            "same_pick": None if warm["pick"] is None or cold["pick"] is None else warm["pick"] == cold["pick"]}


# --- the report -------------------------------------------------------------------------------------

def _num(v: Any, fmt: str = ".0f") -> str:
    return "not reached" if v is None else format(v, fmt)


def _knobs(pick: dict[str, Any] | None) -> str:
    if not pick:
        return "–"
    return ", ".join(f"{k} {'on' if v is True else 'off' if v is False else v}" for k, v in pick.items())


def markdown(doc: dict[str, Any]) -> str:
    env = doc.get("environment", {})
    s = doc["settings"]
    lines = [f"**{env.get('gpu', '?')}**, torch {env.get('torch', '?')}; {s['spec']['workload']} "
             f"{s['spec']['preset']}, {s['space_size']} configs, n_trials {s['spec']['n_trials']}, "
             f"{s['spec']['probe'].get('samples')} samples/probe, starting_points {s['spec'].get('starting_points')}, "
             f"wall {doc.get('wall_s', 0):.0f} s", "",
             "| study | trials run (b/s/w/r) | certified | pick | speedup [95 % CI] | pick first measured: probe # "
             "| GPU-s to it | GPU-s to the target | GPU-s to the end |",
             "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for g in GROUPS:
        r = doc["studies"].get(g)
        if r is None:
            continue
        br = r["by_role"]
        roles = f"{r['trials_run']} ({br.get('baseline', 0)}/{br.get('search', 0)}/{br.get('warm', 0)}/" \
                f"{br.get('remeasure', 0)})"
        ci = r.get("speedup_ci") or [None, None]
        speed = "–" if r["speedup"] is None else f"{r['speedup']:.2f}× [{_num(ci[0], '.2f')}–{_num(ci[1], '.2f')}]"
        cert = ("yes" if r["certified"] else f"no ({r['outcome']})") + ("" if r["finished"] else ", unfinished")
        warm = f" (warm start from {r['pick_from_warm_start']})" if r.get("pick_from_warm_start") else ""
        same = " = A's" if r.get("same_pick_as_a") and g != "first" else ""
        lines.append(f"| {r['label']} | {roles} | {cert} | {_knobs(r['pick'])}{same} | {speed} | "
                     f"{_num(r['pick_first_measured_probe'])}{warm} | {_num(r['gpu_s_to_pick'], '.1f')} | "
                     f"{_num(r.get('gpu_s_to_target'), '.1f')} | {_num(r['gpu_s'], '.1f')} |")
    c = doc.get("comparison")
    w, k = doc["studies"].get("warm"), doc["studies"].get("cold")
    if c and w and k:
        def both(key: str) -> str:
            ratio = "n/a" if c[f"warm_over_cold_{key}"] is None else f"{c[f'warm_over_cold_{key}']:.2f}"
            return (f"B' {_num(w.get(key), '.1f')}, B {_num(k.get(key), '.1f')} GPU-s "
                    f"({_num(None if w.get(key) is None else w[key] / 60, '.2f')} against "
                    f"{_num(None if k.get(key) is None else k[key] / 60, '.2f')} GPU-min; warm / cold {ratio})")

        lines += ["", f"To the certified pick's first measurement: {both('gpu_s_to_pick')}. To the target "
                      f"(≥ {s['target_fraction']:.0%} of the fastest search throughput either measured, "
                      f"{_num(doc.get('target_throughput'), '.0f')} samples/s): {both('gpu_s_to_target')}. To the end: "
                      f"{both('gpu_s')}. Same pick: {c['same_pick']}."]
    ch = doc.get("checks")
    if ch:
        lines.append("")
        if ch.get("skipped"):
            lines.append(f"checks: skipped ({ch['skipped']})")
        for key, expect in (("unchanged", 0), ("slowed", 1)):
            r = ch.get(key)
            if r:
                rep = r.get("report") or {}
                ci = rep.get("speedup_ci") or [None, None]
                lines.append(f"- `autotune check` {key}: exit {r['exit_code']} (expected {expect}), "
                             f"{rep.get('status', '?')}, {_num(rep.get('speedup'), '.2f')}× "
                             f"[{_num(ci[0], '.2f')}–{_num(ci[1], '.2f')}] in {r['wall_s']:.0f} s: {rep.get('reason')}")
    return "\n".join(lines)


COLORS = {"first": "#7f9fbf", "warm": "#4f9f4f", "cold": "#d9822b"}


def plot(doc: dict[str, Any], path: Path) -> None:
    """Left: GPU-s to the pick's first measurement, to the target and to the end, per study (not
    reached: a bar at the end's height marked n/r). Right: best feasible search throughput so far
    against GPU-s."""
    plt = pyplot()
    rows = [(g, doc["studies"][g]) for g in GROUPS if g in doc["studies"]]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    keys = (("gpu_s_to_pick", "to the certified pick's\nfirst measurement"), ("gpu_s_to_target", "to the target"),
            ("gpu_s", "to the study's end"))
    width = 0.8 / max(1, len(rows))
    for i, (g, r) in enumerate(rows):
        xs = [k + (i - (len(rows) - 1) / 2) * width for k in range(len(keys))]
        vals = [r.get(key) for key, _ in keys]
        top = r.get("gpu_s") or 0.0
        for x, v in zip(xs, vals, strict=True):  # not reached: a hatched outline at the end's height
            ax.bar(x, top if v is None else v, width, color="none" if v is None else COLORS[g],
                   edgecolor=COLORS[g] if v is None else "black", hatch="//" if v is None else None, linewidth=0.6)
        for x, v in zip(xs, vals, strict=True):
            ax.text(x, (v if v is not None else top), "n/r" if v is None else f"{v:.0f}", ha="center",
                    va="bottom", fontsize=7)
    ax.set_xticks(range(len(keys)), [label for _, label in keys], fontsize=8)
    ax.set_ylabel("GPU-seconds (probe wall, summed)")
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(facecolor=COLORS[g], edgecolor="black", label=LABEL[g]) for g, _ in rows], fontsize=7,
              loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=len(rows))
    ax.set_title("GPU-seconds (hatched, n/r: not reached)", fontsize=9)
    for g, r in rows:
        pts = sorted((t for t in r["trials"] if t["end_s"] is not None), key=lambda t: t["end_s"])
        best, xs, ys = 0.0, [], []
        for t in pts:
            if t["role"] == "search" and t["state"] == "COMPLETE" and t["feasible"] and t["throughput"]:
                best = max(best, float(t["throughput"]))
            spent = gpu_s_until(r["trials"], t["end_s"])
            if best and spent is not None:
                xs.append(spent)
                ys.append(best)
        if xs:
            ax2.step(xs, ys, where="post", color=COLORS[g], label=LABEL[g])
    if doc.get("target_throughput"):
        ax2.axhline(doc["target_throughput"], color="grey", linestyle=":", linewidth=1, label="target")
    ax2.set_xlabel("GPU-seconds")
    ax2.set_ylabel("best feasible search throughput (samples/s)")
    if ax2.get_lines():
        ax2.legend(fontsize=7)
    ax2.set_title("best so far", fontsize=9)
    env = doc.get("environment", {})
    s = doc["settings"]
    fig.suptitle(f"Warm start on {env.get('gpu', '?')}: {s['spec']['workload']} {s['spec']['preset']}, "
                 f"{s['space_size']} configs, n_trials {s['spec']['n_trials']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    from PIL import Image

    Image.open(path).convert("RGB").quantize(256).save(path, optimize=True)


# --- the run ----------------------------------------------------------------------------------------

def space_size(spec: dict[str, Any]) -> int | None:
    from autotune.contract.space import load_space, parse_space

    try:
        space = load_space(spec["space"]) if isinstance(spec["space"], str) else parse_space(spec["space"])
        return len(space.grid())
    except Exception:  # a range knob: no grid, its size is not counted
        return None


def host_environment(device: str) -> dict[str, Any]:
    """studylib.environment without a CUDA context in this process (the probes' GPU stays theirs):
    the GPU's name and driver from nvidia-smi; torch's CUDA version and the rest come from study
    A's provenance once it has one (`add_provenance`)."""
    env = environment("cpu") | {"device": device, "gpu": None if device != "cpu" else "cpu"}
    if device != "cpu":
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader",
                     "-i", device.partition(":")[2] or "0"]
            line = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip()
            if line:
                name, driver, memory = (part.strip() for part in line.split(",")[:3])
                env |= {"gpu": name, "driver": driver, "gpu_memory": memory}
    return env


def add_provenance(env: dict[str, Any], provenance: dict[str, Any] | None) -> None:
    """Fill the environment's gaps from a study's provenance (what its probes ran on)."""
    p = provenance or {}
    for key, field in (("gpu", "device"), ("torch", "torch_version"), ("cuda", "cuda_version"),
                       ("driver", "driver_version")):
        if env.get(key) is None and p.get(field) is not None:
            env[key] = p[field]
    if p.get("torch_version") is not None:
        env["probe_torch"] = p["torch_version"]


def write(doc: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    tmp.replace(out)


def copy_db(db: Path, dest: Path) -> None:
    src = sqlite3.connect(db)
    try:
        dst = sqlite3.connect(dest)
        try:
            src.backup(dst)
        finally:
            dst.close()
    finally:
        src.close()


def run(args: argparse.Namespace) -> int:
    t_start = time.monotonic()
    kind = "cpu" if args.device == "cpu" else "cuda"
    args.deadline_s = args.deadline_s or DEVICE_DEFAULTS[kind]["deadline_s"]
    deadline = t_start + args.deadline_s
    study_budget = args.study_budget_s or DEVICE_DEFAULTS[kind]["study_budget_s"]
    reserve = args.check_reserve_s if args.check_reserve_s is not None else DEVICE_DEFAULTS[kind]["check_reserve_s"]
    base = yaml.safe_load(Path(args.spec).read_text()) if args.spec else (CPU_SPEC if kind == "cpu" else GPU_SPEC)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="warm-start-gpu-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    db = work / "tune" / "autotune.db"
    db_url = f"sqlite:///{db}"
    tag = uuid.uuid4().hex[:4]
    names = {"first": f"ws-{tag}-a", "warm": f"ws-{tag}-b-warm", "cold": f"ws-{tag}-b-cold"}
    warm_start: Any = [names["first"]] if args.warm_start == "named" else "auto"
    specs = {"first": study_spec(base, names["first"], args.seed, "none", args),
             "warm": study_spec(base, names["warm"], args.seed + B_SEED_OFFSET, warm_start, args),
             "cold": study_spec(base, names["cold"], args.seed + B_SEED_OFFSET, "none", args)}
    out = Path(args.out)
    png = out.with_suffix(".png")
    doc: dict[str, Any] = {
        "benchmark": "warm_start_gpu", "argv": sys.argv[1:],
        "environment": host_environment(args.device) | code_version(),
        "settings": {"device": args.device, "spec": {k: v for k, v in specs["cold"].items() if k != "name"},
                     "space_size": space_size(specs["cold"]), "names": names, "warm_start": warm_start,
                     "order": args.order, "seed_a": args.seed, "seed_b": args.seed + B_SEED_OFFSET,
                     "deadline_s": args.deadline_s, "study_budget_s": study_budget, "check_reserve_s": reserve,
                     "check_rounds": args.rounds, "slowed": args.slowed, "target_fraction": args.target_fraction,
                     "workdir": str(work), "png": str(png), "workers": 1},
        "phases": [], "studies": {},
    }
    _log(f"work directory {work}; deadline {args.deadline_s:.0f} s; studies {', '.join(names.values())}")
    rows: dict[str, dict[str, Any]] = doc["studies"]

    def left() -> float:
        return deadline - time.monotonic()

    def phase(group: str, budget: float) -> None:
        if budget < 20.0:
            doc["phases"].append({"phase": group, "skipped": f"{budget:.0f} s left of the deadline"})
            _log(f"skip {group}: {budget:.0f} s left")
            return
        t0 = time.monotonic()
        ran = tune(specs[group], work, budget)
        try:
            study = read_study(db_url, names[group])
        except Exception as e:  # the study was never created (the tune failed at once)
            doc["phases"].append({"phase": group, "tune": ran, "error": f"{type(e).__name__}: {e}"})
            return
        first_pick = rows["first"]["pick"] if "first" in rows else None
        rows[group] = summarize(group, study, ran, first_pick)
        doc["phases"].append({"phase": group, "wall_s": round(time.monotonic() - t0, 1)})

    def save() -> None:
        doc["wall_s"] = round(time.monotonic() - t_start, 1)
        if any(g in rows for g in ("warm", "cold")):
            doc["target_throughput"] = add_targets(rows, args.target_fraction)
        doc["comparison"] = comparison(rows)
        write(doc, out)

    code = 1
    try:
        phase("first", min(study_budget, left() - reserve - END_RESERVE_S))
        a = rows.get("first")
        if a is not None:
            add_provenance(doc["environment"], a.get("provenance"))
        save()
        if a is None or not a["finished"]:
            doc["phases"].append({"phase": "second studies", "skipped": "study A did not finish: nothing to warm "
                                                                        "start from"})
        else:
            order = ("warm", "cold") if args.order == "warm-first" else ("cold", "warm")
            for i, group in enumerate(order):
                share = (left() - reserve - END_RESERVE_S) / (len(order) - i)
                phase(group, min(study_budget, share))
                save()
        best = Path(a["tune"]["best_yaml"]) if a and a["certified"] and a["tune"].get("best_yaml") else None
        if best is None:
            doc["checks"] = {"skipped": "study A has no certified pick to check"}
        elif left() - END_RESERVE_S < 30.0:
            doc["checks"] = {"skipped": f"{left():.0f} s left of the deadline"}
        else:
            slowed: dict[str, Any] | str = BASELINE if args.slowed == BASELINE else json.loads(args.slowed)
            t0 = time.monotonic()
            doc["checks"] = {"best_yaml": best.read_text(), **check_both(
                best, work, args.device, args.rounds, args.threads, slowed, deadline - END_RESERVE_S)}
            doc["phases"].append({"phase": "checks", "wall_s": round(time.monotonic() - t0, 1)})
        save()
        ok = (a is not None and a["certified"] and all(rows.get(g, {}).get("finished") for g in ("warm", "cold"))
              and bool(doc["checks"].get("as_expected")))
        code = 0 if ok else 1
    finally:
        save()
        if args.copy_db and db.exists():
            with contextlib.suppress(Exception):
                copy_db(db, Path(args.copy_db))
        if rows:
            try:
                plot(doc, png)
            except Exception as e:  # no matplotlib or Pillow on this host: draw it elsewhere with --report
                print(f"no PNG ({type(e).__name__}: {e}); draw it with --report {out}")
        print()
        print(markdown(doc))
        print(f"\nwrote {out}" + (f" and {png}" if png.exists() else "") + f" ({time.monotonic() - t_start:.0f} s)")
    return code


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--device", default="cuda", help="cuda (a GPU host) or cpu (the smoke run)")
    p.add_argument("--spec", default=None, help="a base study spec (YAML) instead of the device's default job; "
                                                "name, seed and warm_start are set per study")
    p.add_argument("--n-trials", type=int, default=None, help="override the spec's n_trials")
    p.add_argument("--samples", type=int, default=None, help="override the spec's probe samples")
    p.add_argument("--starting-points", choices=["none", "auto"], default=None,
                   help="override the spec's starting_points (default spec: none)")
    p.add_argument("--warm-start", choices=["named", "auto"], default="named",
                   help="B' names A (warm_start: [A]) or takes warm_start: auto")
    p.add_argument("--order", choices=["warm-first", "cold-first"], default="warm-first")
    p.add_argument("--seed", type=int, default=0, help="A's sampler seed; B and B' get seed + 1000")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of each `autotune check`")
    p.add_argument("--threads", type=int, default=None, help="CPU: torch threads per check probe")
    p.add_argument("--slowed", default=BASELINE, help="the slowed pick's knobs (JSON), or 'baseline': the recorded "
                                                      "baseline's own")
    p.add_argument("--target-fraction", type=float, default=0.9)
    p.add_argument("--deadline-s", type=float, default=None, help="the whole run's wall-clock limit (cuda 560, cpu "
                                                                   "1500)")
    p.add_argument("--study-budget-s", type=float, default=None, help="each study's limit (cuda 150, cpu 420)")
    p.add_argument("--check-reserve-s", type=float, default=None,
                   help="kept for the two checks when the studies are given their time (cuda 120, cpu 300)")
    p.add_argument("--workdir", default=None, help="the work directory (default: a fresh temporary one)")
    p.add_argument("--copy-db", default=None, help="copy the studies' SQLite database here at the end")
    p.add_argument("--out", required=False, default=None)
    p.add_argument("--report", type=Path, default=None, help="print the table and draw the PNG of this JSON again")
    p.add_argument("--png", type=Path, default=None, help="with --report: where to draw it (default: beside the JSON)")
    args = p.parse_args(argv)
    if args.report is not None:
        doc = resultfiles.load(args.report)
        plot(doc, args.png or args.report.with_suffix(".png"))
        print(markdown(doc))
        return 0
    if args.out is None:
        p.error("--out is required")
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # SIGTERM: stop the running command too
    try:
        return run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
