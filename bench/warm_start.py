"""Benchmark: what a warm start saves, on planted truth (real service, real HTTP, simulated probes).

A second study of the same job can name the first (``warm_start: [first]``, docs/studies.md
"Warm starts"): right after its baseline seeds it tries the first study's certified pick and
front configs, each measured again. This harness measures what that saves against a second
study that starts cold, at the same settings (n_trials, remeasure, sampler, sampler seed).

It reuses bench/verdict.py's machinery: the real service (``python -m autotune.cli serve`` on a
fresh SQLite file), studies created over HTTP, and one simulated worker per study that loops
lease → complete and answers each lease from a planted truth (`verdict.Truth.run`: the config's
speed × exp(N(0, cv)), the quality 1.0 with verdict.py's budget-dependent seed noise, equal for
every config). No probe runs. The planted job (`SPACES`):

  full   fused_optimizer × batch_size {8,16,32,64} × accum_steps {1,2,4} × inverse_loss_frequency
         {1,2}: 48 configs; the winner is fused_optimizer true AND batch_size 32 AND accum_steps 2
         (2 configs of 48), 2× faster with a 2 % spread; every other config (the baseline's
         included) 1× with a 15 % (host-like) spread
  tiny   fused_optimizer × batch_size {8,16} × accum_steps {1,2}: 8 configs, the winner fused
         AND batch 16 AND accum 2 (the suite's small run)

Each probe a worker runs costs simulated GPU-seconds: samples / measured throughput + a fixed
per-probe overhead (--probe-overhead-s, start-up and warm-up). "GPU-seconds" is their sum over
every trial the service handed out (baseline seeds, search, warm-start points, re-measurements)
until the study finished; a draw the service ended as REPEAT was never run and costs nothing.

Per seed s: study A (cold, sampler seed s), then, once A has its verdict, study B (cold, sampler
seed 1000 + s) and study B' (warm_start: [A], the same sampler seed and planted noise as B) at
once. Per study: certified or not, the pick, GPU-seconds to its end, the probe (and GPU-seconds)
at which the winner was first measured, its trials as one character each (`trace`). Summary per
group (first / cold / warm): the certified and winner-found rates, the median and IQR of the
GPU-seconds to the end, to a certified pick (not reached where nothing was certified) and to the
winner's first measurement (not reached where it never was), the probes; and warm / cold ratios.

    python bench/warm_start.py --seeds 20 --out bench/results/warm_start.json
    python bench/warm_start.py --space tiny --seeds 1 --n-trials 8 --out /tmp/ws.json   # the suite's
    python bench/warm_start.py --report bench/results/warm_start.json   # table and PNG again, nothing run

Writes the JSON to --out, a PNG next to it, and prints a markdown table. Exit status 1 when a
study did not finish, 0 otherwise (whatever the savings).
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import verdict  # bench/verdict.py: the planted truth, the simulated worker
from service_load import Server, bearer, create_tokens, fresh_database
from studylib import code_version, environment, finish_run, pyplot

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "warm_start.json"
B_SEED_OFFSET = 1000  # the second studies' sampler seed: 1000 + the first's


@dataclass(frozen=True)
class Job:
    """A planted job: the space, the baseline, and the winning region (knob values all set)."""

    space: dict[str, Any]
    baseline: dict[str, Any]
    winner: tuple[tuple[str, Any], ...]

    @property
    def knobs(self) -> list[str]:
        return list(self.space["params"])

    @property
    def size(self) -> int:
        return math.prod(len(p["choices"]) for p in self.space["params"].values())

    @property
    def winners(self) -> int:
        """How many configs of the space lie in the winning region."""
        return self.size // math.prod(len(self.space["params"][k]["choices"]) for k, _ in self.winner)

    def is_winner(self, config: dict[str, Any] | None) -> bool:
        return config is not None and all(config.get(k) == v for k, v in self.winner)

    def knobs_of(self, config: dict[str, Any] | None) -> dict[str, Any] | None:
        """`config` as the space's knobs alone (a trial's config holds every knob, defaults included)."""
        return None if config is None else {k: config.get(k) for k in self.knobs}


SPACES: dict[str, Job] = {
    "full": Job({"params": {"fused_optimizer": {"choices": [False, True]}, "batch_size": {"choices": [8, 16, 32, 64]},
                            "accum_steps": {"choices": [1, 2, 4]}, "inverse_loss_frequency": {"choices": [1, 2]}}},
                {"fused_optimizer": False, "batch_size": 8, "accum_steps": 1, "inverse_loss_frequency": 1},
                (("fused_optimizer", True), ("batch_size", 32), ("accum_steps", 2))),
    "tiny": Job({"params": {"fused_optimizer": {"choices": [False, True]}, "batch_size": {"choices": [8, 16]},
                            "accum_steps": {"choices": [1, 2]}}},
                {"fused_optimizer": False, "batch_size": 8, "accum_steps": 1},
                (("fused_optimizer", True), ("batch_size", 16), ("accum_steps", 2))),
}

SCENARIO = verdict.Scenario("warm", "the winning region 2.0× faster (2 % spread; every other config 1× with 15 %), "
                            "equal quality", win=2.0, cv_fused=0.02, cv_other=0.15, expect="winner certified",
                            target="n/a")


@dataclass(frozen=True)
class JobTruth(verdict.Truth):
    """verdict.Truth with the job's winning region in place of "fused_optimizer on"."""

    job: Job = SPACES["full"]

    def speed(self, config: dict[str, Any]) -> float:
        return verdict.SPEED * (self.scenario.win if self.job.is_winner(config) else 1.0)

    def cv(self, config: dict[str, Any]) -> float:
        return self.scenario.cv_fused if self.job.is_winner(config) else self.scenario.cv_other

    def quality(self, config: dict[str, Any]) -> float:
        return verdict.QUALITY  # equal quality: the noise (verdict.Truth.run) alone differs


def probe_cost(run: dict[str, Any], overhead_s: float) -> float:
    """Simulated GPU-seconds of one probe: its samples at its measured throughput, plus the overhead."""
    return overhead_s + float(run["samples"]) / float(run["throughput"])


# --- one study ------------------------------------------------------------------------------------

def study_spec(name: str, job: Job, seed: int, args: argparse.Namespace, warm_from: str | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"name": name, "workload": "ups", "preset": "tiny", "space": job.space,
                            "hardware": "cpu", "n_trials": args.n_trials, "sampler": args.sampler, "seed": seed,
                            "baseline": job.baseline, "baseline_seeds": 3, "probe": {"samples": args.samples},
                            "remeasure": {"top_k": 2}}
    if warm_from is not None:
        spec["warm_start"] = [warm_from]
    return spec


TRACE = {"baseline": "b", "search": "s", "remeasure": "r"}


def trace(job: Job, trials: list[dict[str, Any]]) -> str:
    """The study's trials in number order, one character each: b baseline, s search, w a warm-start
    point, r re-measurement, . a REPEAT draw (not run), ? anything else; upper case: the planted winner."""
    out = []
    for t in sorted(trials, key=lambda t: t["number"]):
        if t.get("state") == "REPEAT":
            out.append(".")
            continue
        c = "w" if t.get("warm_start_from") else TRACE.get(str(t.get("role")), "?")
        out.append(c.upper() if job.is_winner(t.get("config")) else c)
    return "".join(out)


def run_study(base: str, tokens: dict[str, str], job: Job, group: str, seed: int, sampler_seed: int,
              args: argparse.Namespace, name: str, warm_from: str | None) -> dict[str, Any]:
    """Create one study, drive it to its end with one simulated worker, and record what it cost."""
    truth = JobTruth(SCENARIO, sampler_seed, args.samples, job)
    with httpx.Client(base_url=base, headers=bearer(tokens, "admin"), timeout=120.0) as client, \
            httpx.Client(base_url=base, headers=bearer(tokens, "worker"), timeout=120.0) as worker_client:
        t0 = time.perf_counter()
        r = client.post("/v1/studies", json=study_spec(name, job, sampler_seed, args, warm_from))
        if r.status_code != 201:
            raise RuntimeError(f"creating study {name} failed: {r.status_code} {r.text}")
        state = verdict.StudyRun()
        end = verdict.worker(worker_client, name, f"{name}-w0", "cpu", truth, state,
                             time.monotonic() + args.study_timeout_s)
        wall = time.perf_counter() - t0
        if end == "timeout":
            client.delete(f"/v1/studies/{name}")
        info = client.get(f"/v1/studies/{name}").json()
        best = client.get(f"/v1/studies/{name}/best")
        trials = client.get(f"/v1/studies/{name}/trials").json()["data"]
    rec: dict[str, Any] | None = best.json() if best.status_code == 200 else None
    certified = bool(rec and rec.get("certified"))
    pick = job.knobs_of(rec["config"]) if rec and certified else None
    # what a warm start from this study tries first (api/optuna_bridge.py warm_start_sources): the
    # certified pick, else the fastest candidate not shown slower or worse
    front = sorted((c for c in (rec or {}).get("configs") or [] if c.get("role") == "candidate"
                    and c.get("status") in ("certified", "undecided", "stopped")),
                   key=lambda c: -(c.get("speedup") or 0.0))
    first_tried = pick or (job.knobs_of(front[0]["config"]) if front else None)
    # GPU-seconds: every probe the worker ran, in the order it ran them (one worker: the lease order)
    costs = [probe_cost(run, args.probe_overhead_s) for run in state.runs]
    cumulative = np.cumsum(costs).tolist() if costs else []
    winner_at = next((i for i, run in enumerate(state.runs) if job.is_winner(run["config"])), None)
    search = sorted((t for t in trials if t.get("role") == "search" and t.get("state") != "REPEAT"),
                    key=lambda t: t["number"])
    first_search = search[0] if search else None
    roles = Counter(run["role"] for run in state.runs)
    return verdict.compact({
        "group": group, "seed": seed, "sampler_seed": sampler_seed, "study": name, "warm_start": warm_from,
        "state": info.get("state"), "finished": info.get("state") == "finished", "wall_s": round(wall, 2),
        "errors": dict(state.errors) or None, "error_examples": state.error_examples[:2] or None,
        "certified": certified, "outcome": (rec or {}).get("outcome", "no recommendation"),
        "winner_certified": certified and job.is_winner(pick), "pick": pick, "first_tried": first_tried,
        "speedup": (rec or {}).get("speedup"),
        "probes": len(state.runs), "probes_by_role": dict(roles),
        "gpu_s": round(cumulative[-1], 2) if cumulative else 0.0,
        "gpu_s_search": round(sum(c for c, run in zip(costs, state.runs, strict=True)
                                  if run["role"] in ("baseline", "search")), 2),
        "winner_probe": None if winner_at is None else winner_at + 1,
        "winner_trial": None if winner_at is None else state.runs[winner_at]["number"],
        "gpu_s_to_winner": None if winner_at is None else round(cumulative[winner_at], 2),
        "winner_probes": sum(job.is_winner(run["config"]) for run in state.runs),
        "warm_points": sum(bool(t.get("warm_start_from")) for t in trials),
        "first_search": None if first_search is None else {
            "number": first_search["number"], "config": job.knobs_of(first_search.get("config")),
            "warm_start_from": first_search.get("warm_start_from"),
            "is_winner": job.is_winner(first_search.get("config"))},
        "trace": trace(job, trials),
    })


def run_seed(base: str, tokens: dict[str, str], job: Job, seed: int, args: argparse.Namespace,
             tag: str) -> list[dict[str, Any]]:
    """Study A (cold), then B (cold) and B' (warm from A) at once, B and B' with the same sampler seed."""
    first = f"ws-{seed}-a-{tag}"
    a = run_study(base, tokens, job, "first", seed, seed, args, first, None)
    b_seed = B_SEED_OFFSET + seed
    with ThreadPoolExecutor(2) as pool:
        cold = pool.submit(run_study, base, tokens, job, "cold", seed, b_seed, args, f"ws-{seed}-b-{tag}", None)
        warm = pool.submit(run_study, base, tokens, job, "warm", seed, b_seed, args, f"ws-{seed}-bw-{tag}", first)
        rows = [a, cold.result(), warm.result()]
    rows[2]["source_winner_certified"] = a["winner_certified"]
    return rows


# --- summaries ------------------------------------------------------------------------------------

GROUPS = ("first", "cold", "warm")
GROUP_LABEL = {"first": "A: first study (cold)", "cold": "B: second study, cold",
               "warm": "B': second study, warm from A"}


def quantiles(values: list[float]) -> dict[str, float | None]:
    """Median and IQR of `values`, math.inf standing for "not reached" (actual sample values, no
    interpolation between a finite value and inf); None for inf in the JSON."""
    if not values:
        return {"median": None, "q25": None, "q75": None}
    arr = np.array(values, dtype=float)

    def q(p: float) -> float | None:
        x = float(np.quantile(arr, p, method="inverted_cdf"))
        return None if math.isinf(x) else round(x, 2)

    return {"median": q(0.5), "q25": q(0.25), "q75": q(0.75)}


def summarize(group: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    inf = math.inf
    return {
        "group": group, "label": GROUP_LABEL[group], "studies": len(rows),
        "finished": sum(bool(r["finished"]) for r in rows),
        "certified": verdict.rate([bool(r["certified"]) for r in rows]),
        "winner_certified": verdict.rate([bool(r["winner_certified"]) for r in rows]),
        "winner_found": verdict.rate([r.get("winner_probe") is not None for r in rows]),
        "gpu_s": quantiles([r["gpu_s"] for r in rows]),
        "gpu_s_to_certified": quantiles([r["gpu_s"] if r["certified"] else inf for r in rows]),
        "gpu_s_to_winner": quantiles([r.get("gpu_s_to_winner", inf) for r in rows]),
        "winner_probe": quantiles([r.get("winner_probe", inf) for r in rows]),
        "probes": quantiles([r["probes"] for r in rows]),
        "outcomes": dict(Counter(r["outcome"] for r in rows).most_common()),
    }


def ratios(rows: list[dict[str, Any]], by: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """warm / cold: the ratio of the medians, and the paired seeds (B and B' of one seed share their
    sampler seed and planted noise)."""
    cold, warm = by["cold"], by["warm"]

    def ratio(key: str) -> float | None:
        c, w = cold[key]["median"], warm[key]["median"]
        return None if c is None or w is None or c == 0 else round(w / c, 3)

    pairs = [(c, w) for c in rows if c["group"] == "cold" for w in rows
             if w["group"] == "warm" and w["seed"] == c["seed"]]
    inf = math.inf
    return {
        "median_gpu_s": ratio("gpu_s"), "median_gpu_s_to_certified": ratio("gpu_s_to_certified"),
        "median_gpu_s_to_winner": ratio("gpu_s_to_winner"), "median_probes": ratio("probes"),
        "pairs": len(pairs),
        "warm_winner_sooner": sum(w.get("gpu_s_to_winner", inf) < c.get("gpu_s_to_winner", inf) for c, w in pairs),
        "cold_winner_sooner": sum(c.get("gpu_s_to_winner", inf) < w.get("gpu_s_to_winner", inf) for c, w in pairs),
        "only_warm_certified_winner": sum(bool(w["winner_certified"] and not c["winner_certified"]) for c, w in pairs),
        "only_cold_certified_winner": sum(bool(c["winner_certified"] and not w["winner_certified"]) for c, w in pairs),
        "warm_with_source_winner": sum(bool(w.get("source_winner_certified")) for _, w in pairs),
        # the seeds where A had certified the winner (what a warm start can hand on) and the others
        "source_winner": paired(pairs, True), "no_source_winner": paired(pairs, False),
    }


def paired(pairs: list[tuple[dict[str, Any], dict[str, Any]]], source_winner: bool) -> dict[str, Any]:
    """Cold and warm over the seeds where A had (or had not) certified the winner."""
    inf = math.inf
    chosen = [(c, w) for c, w in pairs if bool(w.get("source_winner_certified")) == source_winner]
    out: dict[str, Any] = {"seeds": len(chosen)}
    for name, i in (("cold", 0), ("warm", 1)):
        out[f"{name}_winner_certified"] = sum(bool(p[i]["winner_certified"]) for p in chosen)
        out[f"{name}_gpu_s_to_winner"] = quantiles([p[i].get("gpu_s_to_winner", inf) for p in chosen])["median"]
        out[f"{name}_winner_probe"] = quantiles([p[i].get("winner_probe", inf) for p in chosen])["median"]
        out[f"{name}_gpu_s"] = quantiles([p[i]["gpu_s"] for p in chosen])["median"]
    return out


def fmt_q(q: dict[str, Any]) -> str:
    def one(x: Any) -> str:
        return "not reached" if x is None else f"{x:.0f}"

    if q["median"] is None and q["q25"] is None:
        return "not reached"
    return f"{one(q['median'])} ({one(q['q25'])}–{one(q['q75'])})"


def markdown_table(doc: dict[str, Any]) -> str:
    lines = ["| study | n | certified (95 % CI) | the winner certified (95 % CI) | winner measured | "
             "GPU-s to the end, median (IQR) | GPU-s to a certified pick | GPU-s to the winner's first probe | "
             "probe # of it | probes |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for s in doc["summaries"]:
        lines.append(f"| {s['label']} | {s['studies']} | {verdict.pct(s['certified'])} | "
                     f"{verdict.pct(s['winner_certified'])} | "
                     f"{s['winner_found']['k']}/{s['winner_found']['n']} | {fmt_q(s['gpu_s'])} | "
                     f"{fmt_q(s['gpu_s_to_certified'])} | {fmt_q(s['gpu_s_to_winner'])} | "
                     f"{fmt_q(s['winner_probe'])} | {fmt_q(s['probes'])} |")
    r = doc["ratios"]

    def x(v: Any) -> str:
        return "n/a" if v is None else f"{v:.2f}"

    lines.append("")
    lines.append(f"warm / cold, medians: GPU-s to the end {x(r['median_gpu_s'])}, to a certified pick "
                 f"{x(r['median_gpu_s_to_certified'])}, to the winner's first probe {x(r['median_gpu_s_to_winner'])}, "
                 f"probes {x(r['median_probes'])}. Paired seeds ({r['pairs']}): warm reached the winner sooner in "
                 f"{r['warm_winner_sooner']}, cold in {r['cold_winner_sooner']}; only warm certified it in "
                 f"{r['only_warm_certified_winner']}, only cold in {r['only_cold_certified_winner']}; "
                 f"A had certified it for {r['warm_with_source_winner']} of the warm studies.")
    for key, what in (("source_winner", "where A had certified the winner"),
                      ("no_source_winner", "where A had not")):
        p = r.get(key)
        if p:
            def m(v: Any) -> str:
                return "not reached" if v is None else f"{v:.0f}"

            lines.append(f"Seeds {what} ({p['seeds']}): the winner certified cold {p['cold_winner_certified']}, "
                         f"warm {p['warm_winner_certified']}; median GPU-s to its first probe cold "
                         f"{m(p['cold_gpu_s_to_winner'])}, warm {m(p['warm_gpu_s_to_winner'])} (probe # "
                         f"{m(p['cold_winner_probe'])} vs {m(p['warm_winner_probe'])}); to the end cold "
                         f"{m(p['cold_gpu_s'])}, warm {m(p['warm_gpu_s'])}.")
    return "\n".join(lines)


COLORS = {"first": "#7f9fbf", "cold": "#d9822b", "warm": "#4f9f4f"}


def plot(doc: dict[str, Any], path: Path) -> None:
    """Per group, each study as a dot (not reached: a cross at the top), the median as a bar: the
    GPU-seconds to the winner's first probe, to a certified pick, and to the study's end."""
    plt = pyplot()
    rows = doc["studies"]
    panels = (("gpu_s_to_winner", "to the winner's first probe"), ("certified_at", "to a certified pick"),
              ("gpu_s", "to the study's end"))
    fig, axes = plt.subplots(1, 3, figsize=(11, 4.2), sharey=True)
    top = max([r["gpu_s"] for r in rows] or [1.0]) * 1.08
    rng = np.random.default_rng(0)
    for ax, (key, title) in zip(axes, panels, strict=True):
        for i, group in enumerate(GROUPS):
            grp = [r for r in rows if r["group"] == group]
            vals = [r["gpu_s"] if key == "certified_at" and r["certified"] else
                    (None if key == "certified_at" else r.get(key)) for r in grp]
            jitter = rng.uniform(-0.15, 0.15, len(vals))
            got = [(i + j, v) for j, v in zip(jitter, vals, strict=True) if v is not None]
            missed = [i + j for j, v in zip(jitter, vals, strict=True) if v is None]
            if got:
                ax.scatter(*zip(*got, strict=True), s=14, color=COLORS[group], alpha=0.8)
            if missed:
                ax.scatter(missed, [top] * len(missed), marker="x", s=18, color=COLORS[group])
            finite = [v for v in vals if v is not None]
            if finite and len(finite) * 2 > len(vals):  # the median is reached
                med = float(np.quantile(np.array(finite + [math.inf] * len(missed)), 0.5, method="inverted_cdf"))
                ax.hlines(med, i - 0.3, i + 0.3, colors="black", linewidth=1.5)
        ax.set_xticks(range(len(GROUPS)), ["A\n(cold)", "B\n(cold)", "B'\n(warm from A)"])
        ax.set_title(f"GPU-seconds {title}", fontsize=9)
        ax.set_xlim(-0.6, len(GROUPS) - 0.4)
    axes[0].set_ylabel("simulated GPU-seconds (× = not reached)")
    s = doc["settings"]
    fig.suptitle(f"Warm start on planted truth: {s['space_size']} configs, {s['winner_configs']} in the 2× winning "
                 f"region; {len(s['seeds'])} seeds, n_trials {s['n_trials']}, {s['sampler']} (bar: median)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


# --- main -----------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=20, help="seeds (each: A, then B and B')")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--space", choices=sorted(SPACES), default="full")
    p.add_argument("--n-trials", type=int, default=24, help="every study's n_trials (3 baseline seeds included)")
    p.add_argument("--samples", type=int, default=1000, help="probe samples (the search budget)")
    p.add_argument("--sampler", default="tpe", choices=("tpe", "random", "nsga2", "gp"))
    p.add_argument("--probe-overhead-s", type=float, default=5.0, help="simulated GPU-seconds every probe costs on "
                   "top of samples / throughput (start-up, warm-up)")
    p.add_argument("--parallel", type=int, default=1, help="seeds run at once (each runs B and B' at once)")
    p.add_argument("--study-timeout-s", type=float, default=300.0)
    p.add_argument("--out", type=Path, default=OUT, help="the JSON; the PNG goes next to it")
    p.add_argument("--report", type=Path, default=None, help="print the table and redraw the PNG of an earlier "
                   "run's JSON (nothing is run)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report is not None:  # the summaries again from the studies' rows (the JSON rewritten), table, PNG
        doc = json.loads(args.report.read_text())
        rows = doc["studies"]
        by = {g: summarize(g, [r for r in rows if r["group"] == g]) for g in GROUPS}
        doc |= {"summaries": [by[g] for g in GROUPS], "ratios": ratios(rows, by)}
        args.report.write_text(json.dumps(doc, separators=(",", ":")))
        plot(doc, args.report.with_suffix(".png"))
        print(markdown_table(doc))
        return 0
    if threading.current_thread() is not threading.main_thread():
        return run(args)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # SIGTERM: stop the service too
    try:
        return run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace) -> int:
    job = SPACES[args.space]
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    tag = uuid.uuid4().hex[:6]
    t_start = time.perf_counter()
    code = code_version()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="autotune-warm-start-") as tmp, \
            fresh_database("sqlite", Path(tmp)) as db_url:
        tokens = create_tokens(db_url)
        server = Server(db_url, "cli", Path(tmp) / "service.log")
        try:
            server.wait_ready()
            print(f"service at {server.url}; {len(seeds)} seeds × 3 studies, space {args.space} ({job.size} configs, "
                  f"{job.winners} winning), n_trials {args.n_trials}, {args.sampler}", flush=True)
            with ThreadPoolExecutor(args.parallel) as pool:
                futures = [pool.submit(run_seed, server.url, tokens, job, seed, args, tag) for seed in seeds]
                for future in futures:
                    got = future.result()
                    rows.extend(got)
                    print("  ".join(f"[seed {r['seed']} {r['group']}] {r['trace']} certified {r['certified']}, "
                                    f"{r['gpu_s']:.0f} GPU-s, winner at {r.get('gpu_s_to_winner', '-')}"
                                    for r in got), flush=True)
            log_tail = server.log_tail(60)
        finally:
            server.stop()
    by = {g: summarize(g, [r for r in rows if r["group"] == g]) for g in GROUPS}
    png = args.out.with_suffix(".png")
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "report", "first_seed")}
    settings |= {"seeds": seeds, "out": verdict.shown_path(args.out), "png": verdict.shown_path(png),
                 "space": job.space, "space_size": job.size, "baseline": job.baseline,
                 "winner": dict(job.winner), "winner_configs": job.winners, "win": SCENARIO.win,
                 "cv_winner": SCENARIO.cv_fused, "cv_other": SCENARIO.cv_other, "speed": verdict.SPEED,
                 "quality": verdict.QUALITY, "baseline_seeds": 3, "remeasure": {"top_k": 2}, "workers": 1,
                 "second_sampler_seed": f"{B_SEED_OFFSET} + seed", "db": "sqlite"}
    doc = {"benchmark": "warm_start", "environment": environment("cpu") | code, "settings": settings,
           "wall_s": round(time.perf_counter() - t_start, 1), "summaries": [by[g] for g in GROUPS],
           "ratios": ratios(rows, by), "studies": rows}
    return finish_run(args.out, doc, png, lambda: plot(doc, png), markdown_table(doc), rows, log_tail)


if __name__ == "__main__":
    sys.exit(main())
