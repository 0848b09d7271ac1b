"""Benchmark: the calibration of the service's verdict on planted truth (real service, real HTTP).

The verdict (`Recommendation.certified`, autotune/contract/verdict.py) says whether a study's pick is
faster than the baseline beyond the noise and no worse in quality. This harness asks how often
it is right when the truth is known: it starts the real service once
(``python -m autotune.cli serve --db URL --port P``, as bench/service_load.py does), creates
one study per scenario and seed, and lets one (or two) simulated workers loop

    POST /v1/trials/lease → POST /v1/trials/{id}/complete

until the study's state is "finished" (a 204 while it is not: a short sleep, then lease again).
No probe runs: each completion answers from the scenario's known truth for the leased config
and probe (`Truth.result`)::

    throughput = speed(config) × exp(N(0, cv(config)))        per-config run-to-run spread
    quality    = quality(config) + sd(budget) · (√0.8 · z_seed + √0.2 · z_own)
                                                                budget = the lease's probe samples
                                                                / the study's (search) samples
    sd(budget) = 0.002 at the search budget, 0.1 beyond it (samples > the search's)

z_seed ~ N(0, 1) is shared by every run of one probe seed at one budget (a real training's
seed sets its initial weights and data order for every config alike: 80 % of the quality's
variance here, as on the CPU demo, where the baseline's seeds spread 0.013 in NRMSE and a
config tracked it round by round within 0.004), z_own ~ N(0, 1) is the run's own. The noise
is seeded by (the scenario's seed, the trial number; z_seed by the probe seed and the budget),
so a run is reproducible (and a seed draws the same noise in every scenario: they differ by
their truth alone). The
studies search a 16-config inline space (fused_optimizer × batch_size × accum_steps ×
inverse_loss_frequency) with TPE seeded by the seed, 12 trials (3 baseline seeds), probe
samples 1000, remeasure top_k 2 and the service's defaults otherwise. The planted winner is
"fused_optimizer: true" (every config with it; the baseline has it off). Scenarios (`SCENARIOS`):

  aa         A/A: every config the same speed (13 % spread) and quality; target: certified ≤ 5 %
  win2       fused 2.0× faster (2 % spread; the others 15 %), equal quality; target: the winner
             certified ≥ 90 %
  win15      the same at 1.5×
  win2-long  win2 re-measured at twice the search's samples (remeasure.samples_factor 2), where
             the quality's seed spread is 0.1: how much power a longer judged budget costs
  loss       win2's speeds, the fused configs' quality worse by 3σ at the judged budget, with
             gate.abs_tol 0 (the non-inferiority margin is then k·σ = 2σ; with the default
             abs_tol of 0.01 a 3σ = 0.006 loss is inside the margin, i.e. not a loss by the
             study's own definition); target: the fused config not certified ≥ 95 %
  loss-tol   the same at the default abs_tol (0.01), the loss abs_tol + 3σ (3σ beyond the margin)
  aa-tol0    A/A with gate.abs_tol 0 (the margin 2σ of the seeds): a candidate whose search quality
             came out 2σ below the baseline's mean by chance takes the quality-headroom slot
             (remeasure.quality_headroom) as a third candidate; target: certified ≤ 5 % (not in the
             default set)
  aa-2gpu    A/A on two workers of one host whose GPUs differ by 5 % (every config's spread 2 %): the
             faster GPU's probes end first, so it leases the next trial; does who-runs-what bias a
             ratio enough to certify nothing? target: certified ≤ 5 % (not in the default set)

Per scenario: the certified rate with its 95 % Wilson interval, the rate at which the planted
winner is certified, the rate at which the pick (the recommended config; the baseline's own
when nothing was certified) is the planted winner, the mean re-measure probes spent, the
outcomes (Recommendation.outcome; "no recommendation" when /best answered 404 after the study
finished) and the wall time.

    python bench/verdict.py                                   # every scenario, 100 seeds
    python bench/verdict.py --seeds 20 --scenarios aa,win2,loss --out /tmp/verdict.json
    python bench/verdict.py --db postgresql          # a fresh database on $AUTOTUNE_TEST_PG_URL's server
    python bench/verdict.py --seeds 100 --resume     # go on where a killed run of the same settings stopped
    python bench/verdict.py --report bench/results/verdict.json   # its table and PNG again, nothing run

Writes the raw JSON (every study's recommendation, its configs with their planted truth and its
trials) to --out (default bench/results/verdict.json), a PNG next to it (the rates with their
intervals and the targets) and prints a markdown table. Each study is also appended to
<out>.partial.jsonl as it ends (removed once the JSON is written): --resume keeps those of a
run that was killed, when its settings and the service's code (commit, changed service files)
are the same. Exit status 0 whatever the rates (a calibration run reports, it does not judge);
1 when a study did not finish. The committed results/verdict.json is that JSON split
(bench/resultfiles.py): the summaries, each study's outcome in verdict.raw.json.gz; its
recommendations, configs and trials are left out (a run writes them again).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from resultfiles import load
from service_load import PG_ADMIN_URL, Server, bearer, create_tokens, fake_result, fresh_database
from studylib import code_version, environment, finish_run, pyplot

from autotune.contract.protocol import GateSpec

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
OUT = RESULTS / "verdict.json"

SPACE: dict[str, Any] = {"params": {"fused_optimizer": {"choices": [False, True]}, "batch_size": {"choices": [8, 16]},
                                    "accum_steps": {"choices": [1, 2]},
                                    "inverse_loss_frequency": {"choices": [1, 2]}}}
BASELINE: dict[str, Any] = {"fused_optimizer": False, "batch_size": 8, "accum_steps": 1, "inverse_loss_frequency": 1}
SPEED = 100.0  # samples/s of every config that is not the planted winner (the baseline's)
QUALITY = 1.0  # val_nrmse of every config without a planted loss (far from 0: the noise never makes it negative)
SD_SEARCH = 0.002  # the quality's seed spread at the search's budget …
SD_LONG = 0.1  # … and at any longer one (samples > the search's)
SEED_SHARE = 0.8  # the share of the quality's variance a probe seed sets for every config (z_seed)
DEFAULT_ABS_TOL = GateSpec().abs_tol  # the quality gate's tolerance unless a study sets it (0.01)
DEFAULT_SCENARIOS = "aa,win2,win15,win2-long,loss,loss-tol"
Z95 = 1.959963984540054


@dataclass(frozen=True)
class Scenario:
    """A planted truth: how fast and how good each config is, and what a right verdict does."""

    name: str
    description: str
    win: float = 1.0  # speed of a fused_optimizer config over the others'
    cv_fused: float = 0.13  # run-to-run spread (sd of log throughput) of a fused config …
    cv_other: float = 0.13  # … and of the others (the baseline's)
    loss_sigmas: float = 0.0  # a fused config's quality worse by this many σ at the judged budget …
    loss_abs_tol: bool = False  # … plus the gate's abs_tol (beyond the margin, not inside it)
    samples_factor: float = 1.0  # remeasure.samples_factor
    abs_tol: float | None = None  # gate.abs_tol (None: the service's default)
    expect: str = "no certification"  # "winner certified" | "no certification" | "winner not certified"
    target: str = "certified ≤ 5 %"
    # two GPUs of one host, unequal: worker i's throughputs × (1 + gpu_gap)^i, and its probes take
    # probe_s / that factor of wall time, so the faster GPU is back first and leases next (None: --workers)
    gpu_gap: float = 0.0
    probe_s: float = 0.0
    workers: int | None = None

    def __post_init__(self) -> None:
        assert self.expect in ("winner certified", "no certification", "winner not certified"), self.expect

    @property
    def has_winner(self) -> bool:
        """Whether some config differs (the fused ones): an A/A study has no planted winner."""
        return self.win != 1.0 or self.quality_loss != 0.0

    @property
    def judged_sd(self) -> float:
        """σ: the quality's seed spread at the budget the verdict judges (the re-measurement's)."""
        return quality_sd(self.samples_factor)

    @property
    def quality_loss(self) -> float:
        tol = (DEFAULT_ABS_TOL if self.abs_tol is None else self.abs_tol) if self.loss_abs_tol else 0.0
        return tol + self.loss_sigmas * self.judged_sd

    def remeasure(self) -> dict[str, Any]:
        out: dict[str, Any] = {"top_k": 2}
        if self.samples_factor != 1.0:
            out["samples_factor"] = self.samples_factor
        return out

    def target_met(self, summary: dict[str, Any]) -> bool:
        if self.expect == "winner certified":
            return bool(summary["winner_certified"]["rate"] >= 0.90)
        if self.expect == "winner not certified":
            return bool(summary["winner_certified"]["rate"] <= 0.05)
        return bool(summary["certified"]["rate"] <= 0.05)


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("aa", "A/A: every config the same speed (13 % spread) and quality"),
    Scenario("aa-tol0", "A/A with gate.abs_tol 0 (margin 2σ of the seeds): a candidate's lucky search quality "
             "takes the quality-headroom slot (remeasure.quality_headroom)", abs_tol=0.0),
    Scenario("aa-2gpu", "A/A on two workers whose GPUs differ by 5 % (2 % spread; the faster one's probes end "
             "first, so it leases next)", cv_fused=0.02, cv_other=0.02, gpu_gap=0.05, probe_s=0.04, workers=2),
    Scenario("win2", "fused 2.0× faster (2 % spread; the others 15 %), equal quality", win=2.0, cv_fused=0.02,
             cv_other=0.15, expect="winner certified", target="winner certified ≥ 90 %"),
    Scenario("win15", "fused 1.5× faster (2 % spread; the others 15 %), equal quality", win=1.5, cv_fused=0.02,
             cv_other=0.15, expect="winner certified", target="winner certified ≥ 90 %"),
    Scenario("win2-long", "win2, re-measured at 2× the search's samples (quality spread 0.1 there)", win=2.0,
             cv_fused=0.02, cv_other=0.15, samples_factor=2.0, expect="winner certified",
             target="winner certified ≥ 90 %"),
    Scenario("loss", "win2's speeds, fused quality worse by 3σ; gate.abs_tol 0 (margin 2σ)", win=2.0,
             cv_fused=0.02, cv_other=0.15, loss_sigmas=3.0, abs_tol=0.0, expect="winner not certified",
             target="winner not certified ≥ 95 %"),
    Scenario("loss-tol", "win2's speeds, fused quality worse by abs_tol + 3σ (default abs_tol 0.01)", win=2.0,
             cv_fused=0.02, cv_other=0.15, loss_sigmas=3.0, loss_abs_tol=True, expect="winner not certified",
             target="winner not certified ≥ 95 %"),
)}


def quality_sd(budget: float) -> float:
    """The quality's seed spread at `budget` (probe samples over the search's)."""
    return SD_SEARCH if budget <= 1.0 + 1e-9 else SD_LONG


def is_winner(config: dict[str, Any] | None) -> bool:
    """Whether `config` is the planted winner (fused_optimizer on)."""
    return bool(config and config.get("fused_optimizer") is True)


@dataclass(frozen=True)
class Truth:
    """A scenario's truth for one study (its seed): the answer to a lease."""

    scenario: Scenario
    seed: int
    study_samples: int

    def speed(self, config: dict[str, Any]) -> float:
        return SPEED * (self.scenario.win if is_winner(config) else 1.0)

    def cv(self, config: dict[str, Any]) -> float:
        return self.scenario.cv_fused if is_winner(config) else self.scenario.cv_other

    def quality(self, config: dict[str, Any]) -> float:
        return QUALITY + (self.scenario.quality_loss if is_winner(config) else 0.0)

    def gpu(self, worker_index: int) -> float:
        """Worker `worker_index`'s GPU: its throughputs' factor (scenario.gpu_gap)."""
        return float((1.0 + self.scenario.gpu_gap) ** worker_index)

    def run(self, lease: dict[str, Any], worker_index: int = 0) -> dict[str, Any]:
        """The planted measurement of a leased trial on worker `worker_index`'s GPU: its throughput and
        quality, and what they came from."""
        config, samples = lease["config"], lease["probe"]["samples"] or self.study_samples
        budget = samples / self.study_samples
        z_speed, z_own = np.random.default_rng([self.seed, lease["number"]]).standard_normal(2)
        seed = int(lease["probe"]["seed"])
        z_seed = np.random.default_rng([self.seed, seed, round(budget * 1000), 7]).standard_normal()
        z_quality = math.sqrt(SEED_SHARE) * z_seed + math.sqrt(1.0 - SEED_SHARE) * z_own
        return {"number": lease["number"], "role": lease["role"], "config": config, "samples": samples,
                "probe_seed": lease["probe"]["seed"], "budget": budget,
                "throughput": self.speed(config) * self.gpu(worker_index) * math.exp(self.cv(config) * float(z_speed)),
                "quality": self.quality(config) + quality_sd(budget) * float(z_quality),
                "truth": {"speed": self.speed(config), "cv": self.cv(config), "quality": self.quality(config),
                          "quality_sd": quality_sd(budget)}}

    def result(self, lease: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
        """The completion body's result: bench/service_load.py's minimal valid one with the planted values."""
        import random

        out = fake_result(lease, random.Random(0))
        out.update(throughput_samples_per_s=run["throughput"], val_nrmse=run["quality"], quality=run["quality"],
                   quality_metric="val_nrmse")
        return out


def study_spec(name: str, scenario: Scenario, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    remeasure = scenario.remeasure()
    if args.remeasure_windows is not None:
        remeasure["windows"] = args.remeasure_windows
    spec: dict[str, Any] = {"name": name, "workload": "ups", "preset": "tiny", "space": SPACE,
                            "hardware": args.hardware, "n_trials": args.n_trials, "sampler": "tpe", "seed": seed,
                            "baseline": BASELINE, "baseline_seeds": 3, "probe": {"samples": args.samples},
                            "remeasure": remeasure}
    if scenario.abs_tol is not None:
        spec["gate"] = {"abs_tol": scenario.abs_tol}
    return spec


# --- one study ------------------------------------------------------------------------------------

@dataclass
class StudyRun:
    """What the simulated workers of one study did."""

    runs: list[dict[str, Any]] = field(default_factory=list)  # one per completed trial (Truth.run)
    errors: Counter[str] = field(default_factory=Counter)
    error_examples: list[str] = field(default_factory=list)  # the first few error answers, verbatim
    lock: threading.Lock = field(default_factory=threading.Lock)


def worker(client: httpx.Client, name: str, worker_id: str, hardware: str, truth: Truth, state: StudyRun,
           deadline: float, index: int = 0) -> str:
    """Lease → complete for study `name` until it is finished, as worker `index` (its GPU:
    `Truth.gpu`); its final state ("timeout" past `deadline`)."""
    while time.monotonic() < deadline:
        try:
            r = client.post("/v1/trials/lease", json={"worker_id": worker_id, "hardware": hardware, "study": name})
        except httpx.HTTPError as e:
            state.errors[f"lease:{type(e).__name__}"] += 1
            time.sleep(0.1)
            continue
        if r.status_code == 204:
            info = client.get(f"/v1/studies/{name}")
            study_state = info.json()["state"] if info.status_code == 200 else f"http {info.status_code}"
            if study_state != "running":
                return str(study_state)
            time.sleep(0.05)
            continue
        if r.status_code != 200:
            state.errors[f"lease:{r.status_code}"] += 1
            if len(state.error_examples) < 5:
                state.error_examples.append(f"lease: {r.status_code} {r.text[:500]}")
            time.sleep(0.2)
            continue
        lease = r.json()
        if lease["study"] != name:  # the service hands a worker the trial it holds, whatever study it asks for
            raise RuntimeError(f"worker {worker_id} asked for a trial of {name} and was given trial {lease['number']} "
                               f"of {lease['study']}")
        run = truth.run(lease, index)
        if truth.scenario.probe_s:  # the probe's wall time on this GPU: the faster one is back first
            time.sleep(truth.scenario.probe_s / truth.gpu(index))
        body = {"worker_id": worker_id, "result": truth.result(lease, run)}
        for attempt in range(10):  # complete is idempotent for the worker that holds the trial
            try:
                r = client.post(f"/v1/trials/{lease['trial_id']}/complete", json=body)
            except httpx.HTTPError as e:
                state.errors[f"complete:{type(e).__name__}"] += 1
                time.sleep(0.1 * (attempt + 1))
                continue
            if r.status_code != 200:
                state.errors[f"complete:{r.status_code}"] += 1
                if len(state.error_examples) < 5:
                    state.error_examples.append(f"complete trial {lease['number']} ({lease['role']}): "
                                                f"{r.status_code} {r.text[:500]}")
                if r.status_code in (404, 409, 422):
                    break
                time.sleep(0.1 * (attempt + 1))
                continue
            with state.lock:
                state.runs.append({**run, "worker": worker_id})
            break
    return "timeout"


def run_study(base: str, tokens: dict[str, str], scenario: Scenario, seed: int, args: argparse.Namespace,
              tag: str) -> dict[str, Any]:
    """Create one study, drive it to its end with args.workers simulated workers, read its verdict."""
    name = f"verdict-{scenario.name}-s{seed}-{tag}"
    truth = Truth(scenario, seed, args.samples)
    with httpx.Client(base_url=base, headers=bearer(tokens, "admin"), timeout=120.0) as client, \
            httpx.Client(base_url=base, headers=bearer(tokens, "worker"), timeout=120.0) as worker_client:
        t0 = time.perf_counter()
        r = client.post("/v1/studies", json=study_spec(name, scenario, seed, args))
        if r.status_code != 201:
            raise RuntimeError(f"creating study {name} failed: {r.status_code} {r.text}")
        state = StudyRun()
        deadline = time.monotonic() + args.study_timeout_s
        workers = scenario.workers or args.workers
        with ThreadPoolExecutor(workers) as pool:
            # a worker id per study: a worker that holds a lease is handed that trial again, whichever
            # study its lease asks for, so concurrent studies must not share an id
            ends = list(pool.map(lambda i: worker(worker_client, name, f"{name}-w{i}", args.hardware, truth, state,
                                                  deadline, i), range(workers)))
        wall = time.perf_counter() - t0
        if "timeout" in ends:  # stop it: nothing leases its trials any more
            client.delete(f"/v1/studies/{name}")
        info = client.get(f"/v1/studies/{name}").json()
        best = client.get(f"/v1/studies/{name}/best")
        trials = client.get(f"/v1/studies/{name}/trials").json()["data"]
    return study_record(truth, name, info, best, trials, state, ends, wall)


def compact(value: Any) -> Any:
    """`value` for the JSON: floats to 6 significant digits, None-valued keys left out (600 studies' raw
    records stay a few MB)."""
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {k: compact(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [compact(v) for v in value]
    return value


def keyed(rec: dict[str, Any] | None, configs: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The recommendation with each ConfigVerdict's config (every knob, defaults included) named by the
    study's key for it ("c0", …: the trial config whose knobs it holds)."""
    if rec is None:
        return None

    def key(full: dict[str, Any]) -> Any:
        return next((k for k, c in configs.items() if c.items() <= full.items()), full)

    out = dict(rec, configs=[dict(row, config=key(row.get("config") or {})) for row in rec.get("configs", [])])
    if rec.get("uncertified"):
        out["uncertified"] = dict(rec["uncertified"], config=key(rec["uncertified"].get("config") or {}))
    return out


def study_record(truth: Truth, name: str, info: dict[str, Any], best: httpx.Response,
                 trials: list[dict[str, Any]], state: StudyRun, ends: list[str], wall: float) -> dict[str, Any]:
    """One study's outcome, its recommendation, its configs with their planted truth, and its trials (each
    run as the service stored it, with the probe the worker was leased)."""
    scenario, seed = truth.scenario, truth.seed
    rec: dict[str, Any] | None = best.json() if best.status_code == 200 else None
    if rec is not None:
        outcome, message = rec.get("outcome", "?"), rec.get("reason", "")
    else:
        outcome = "no recommendation"
        try:
            message = str(best.json().get("detail", best.text))
        except ValueError:
            message = best.text
    certified = bool(rec and rec.get("certified"))
    pick = rec["config"] if rec else None
    uncertified = (rec or {}).get("uncertified") or {}
    # the config the verdict ranked first: the pick when certified, else the fastest uncertified candidate
    top = pick if certified else (uncertified.get("config") or None)
    candidates = [c for c in (rec or {}).get("configs", []) if c.get("role") == "candidate"]
    planted = {r["number"]: r for r in state.runs}
    # the planted winner's row in the verdict: a certified one, else the fastest
    winners = sorted((c for c in candidates if is_winner(c.get("config"))),
                     key=lambda c: (c.get("status") != "certified", -(c.get("speedup") or 0.0)))
    key_of: dict[str, str] = {}  # each distinct config once per study ("c0", "c1", …), the trials name it
    for t in trials:
        key_of.setdefault(json.dumps(t.get("config"), sort_keys=True), f"c{len(key_of)}")
    configs = {key: json.loads(config) for config, key in key_of.items()}
    remeasures = sum(t.get("role") == "remeasure" for t in trials)
    # a self-check: every trial holds what this study's worker sent for it
    mismatched = [t["number"] for t in trials if t["number"] in planted and t.get("state") == "COMPLETE"
                  and (t.get("throughput_samples_per_s"), t.get("quality"))
                  != (planted[t["number"]]["throughput"], planted[t["number"]]["quality"])]
    return {
        "scenario": scenario.name, "seed": seed, "study": name, "state": info.get("state"),
        "finished": info.get("state") == "finished", "workers_ended": ends, "wall_s": round(wall, 3),
        "mismatched_trials": mismatched, "errors": dict(state.errors),
        "error_examples": state.error_examples, "counts": info.get("counts"),
        "certified": certified, "outcome": outcome, "message": message,
        "winner_certified": certified and is_winner(pick), "pick_is_winner": is_winner(pick),
        "top_is_winner": is_winner(top),
        "winner_status": winner_status(winners[0]) if winners else "not re-measured",
        "winner_judged": any(is_winner(c.get("config")) for c in candidates)
        or any(t.get("role") == "remeasure" and is_winner(t.get("config")) for t in trials),
        "remeasure_probes": (rec or {}).get("remeasure_probes", 0), "remeasure_trials": remeasures,
        "rounds_run": (rec or {}).get("rounds_run"), "speedup": (rec or {}).get("speedup"),
        "speedup_ci": [(rec or {}).get("speedup_ci_low"), (rec or {}).get("speedup_ci_high")],
        "pick": pick, "recommendation": compact(keyed(rec, configs)),
        "configs": configs, "truth": {key: {"speed": truth.speed(c), "cv": truth.cv(c), "quality": truth.quality(c)}
                                      for key, c in configs.items()},
        "trials": [compact({"number": t["number"], "role": t.get("role"), "state": t.get("state"),
                            "config": key_of.get(json.dumps(t.get("config"), sort_keys=True)),
                            "throughput": t.get("throughput_samples_per_s"), "quality": t.get("quality"),
                            "feasible": t.get("feasible"), "remeasure_of": t.get("remeasure_of"),
                            "remeasure_round": t.get("remeasure_round"), "repeat_of": t.get("repeat_of"),
                            "baseline_repeat_of": t.get("baseline_repeat_of"),
                            "samples": planted.get(t["number"], {}).get("samples"),
                            "probe_seed": planted.get(t["number"], {}).get("probe_seed")}) for t in trials],
    }


def winner_status(row: dict[str, Any]) -> str:
    """A planted winner's ConfigVerdict in a few words: its status, and for an undecided one what held it
    back (the speedup's interval not above 1, the quality bound not below the margin, or no quality test)."""
    status = str(row.get("status"))
    if status != "undecided":
        return status
    low, bound, margin = row.get("speedup_ci_low"), row.get("quality_diff_ci_high"), row.get("quality_margin")
    held = [] if low is not None and low > 1 else ["speed"]
    if bound is None or margin is None:
        held.append("quality not tested")
    elif bound >= margin:
        held.append("quality")
    return f"undecided ({', '.join(held) or '?'})"


# --- summaries ------------------------------------------------------------------------------------

def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion k / n (95 % by default)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (0.0 if k == 0 else centre - half), (1.0 if k == n else centre + half)


def rate(flags: list[bool]) -> dict[str, Any]:
    k, n = sum(flags), len(flags)
    low, high = wilson(k, n)
    return {"k": k, "n": n, "rate": k / n if n else 0.0, "ci95": [round(low, 4), round(high, 4)]}


def summarize(scenario: Scenario, studies: list[dict[str, Any]]) -> dict[str, Any]:
    out = {
        "scenario": scenario.name, "description": scenario.description, "target": scenario.target,
        "settings": asdict(scenario), "quality_loss": scenario.quality_loss, "has_winner": scenario.has_winner,
        "studies": len(studies),
        "finished": sum(s["finished"] for s in studies),
        "certified": rate([s["certified"] for s in studies]),
        "winner_certified": rate([s["winner_certified"] for s in studies]),
        "pick_is_winner": rate([s["pick_is_winner"] for s in studies]),
        "top_is_winner": rate([s["top_is_winner"] for s in studies]),
        "winner_judged": rate([s["winner_judged"] for s in studies]),
        "remeasure_probes_mean": float(np.mean([s["remeasure_probes"] for s in studies])) if studies else None,
        "remeasure_trials_mean": float(np.mean([s["remeasure_trials"] for s in studies])) if studies else None,
        "outcomes": dict(Counter(s["outcome"] for s in studies).most_common()),
        "winner_status": dict(Counter(s["winner_status"] for s in studies).most_common()),
        "wall_s": round(sum(s["wall_s"] for s in studies), 2),
        "wall_s_per_study": round(float(np.mean([s["wall_s"] for s in studies])), 3) if studies else None,
    }
    out["target_met"] = scenario.target_met(out)
    return out


def pct(r: dict[str, Any]) -> str:
    low, high = r["ci95"]
    return f"{100 * r['rate']:.0f} % ({100 * low:.0f}–{100 * high:.0f})"


def markdown_table(summaries: list[dict[str, Any]]) -> str:
    lines = ["| scenario | studies | certified (95 % CI) | winner certified (95 % CI) | pick = winner | "
             "winner re-measured | re-measure probes (mean) | outcomes | target | met | wall |",
             "|---|---:|---|---|---:|---:|---:|---|---|---|---:|"]
    for s in summaries:
        winner = s["has_winner"]  # an A/A study has none: its winner columns say nothing
        outcomes = ", ".join(f"{k} {v}" for k, v in s["outcomes"].items())
        cells = [s["scenario"], str(s["studies"]), pct(s["certified"]),
                 pct(s["winner_certified"]) if winner else "n/a",
                 f"{100 * s['pick_is_winner']['rate']:.0f} %" if winner else "n/a",
                 f"{100 * s['winner_judged']['rate']:.0f} %" if winner else "n/a",
                 f"{s['remeasure_probes_mean']:.1f}", outcomes, s["target"], "yes" if s["target_met"] else "**no**",
                 f"{s['wall_s']:.0f} s"]
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


TARGET_BAR = {"winner certified": 1, "winner not certified": 1, "no certification": 0}  # the bar a target is about


def plot(summaries: list[dict[str, Any]], path: Path) -> None:
    """Per scenario: the certified rate, the planted winner's certified rate and the pick-is-winner rate,
    each with its 95 % Wilson interval (an A/A scenario has no winner: one bar); the target dashed over
    the bar it is about."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6.5, 2.0 + 1.6 * len(summaries)), 4.8))
    x = np.arange(len(summaries))
    bars = (("certified", "certified (any config)", "#7f9fbf"),
            ("winner_certified", "planted winner certified", "#d9822b"),
            ("pick_is_winner", "pick = planted winner", "#9fbf7f"))
    width = 0.8 / len(bars)
    for i, (key, label, color) in enumerate(bars):
        shown = [s for s in summaries if i == 0 or s["has_winner"]]
        at = np.array([x[summaries.index(s)] for s in shown]) + (i - 1) * width
        rates = np.array([s[key]["rate"] for s in shown])
        lows = np.array([s[key]["ci95"][0] for s in shown])
        highs = np.array([s[key]["ci95"][1] for s in shown])
        ax.bar(at, 100 * rates, width, label=label, color=color,
               yerr=100 * np.vstack([rates - lows, highs - rates]), capsize=3, error_kw={"linewidth": 1})
    for i, s in enumerate(summaries):
        expect = s["settings"]["expect"]
        level = 90 if expect == "winner certified" else 5
        centre = x[i] + (TARGET_BAR[expect] - 1) * width
        ax.hlines(level, centre - 0.75 * width, centre + 0.75 * width, colors="black", linestyles="dashed",
                  linewidth=1.2, zorder=3, label="target" if i == 0 else None)
    ax.set_xticks(x, [f"{s['scenario']}\n(n={s['studies']})" for s in summaries])
    ax.set_xlim(-0.6, len(summaries) - 0.4)
    ax.set_ylabel("studies (%)")
    ax.set_ylim(0, 110)
    ax.set_title("Verdict calibration on planted truth\n(bars: rate over studies, 95 % Wilson interval)", fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), fontsize=8, ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


# --- main -----------------------------------------------------------------------------------------

@contextlib.contextmanager
def database(db: str, workdir: Path) -> Iterator[str]:
    """--db: "sqlite" (a fresh file in the run's temporary directory), "postgresql" (a fresh database on
    the server of $AUTOTUNE_TEST_PG_URL, dropped afterwards) or a SQLAlchemy URL, used as it is."""
    if db in ("sqlite", "postgresql"):
        with fresh_database(db, workdir) as url:
            yield url
    else:
        yield db


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=100, help="studies per scenario (seeds first-seed …)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--scenarios", default=DEFAULT_SCENARIOS, help=f"comma-separated, of {', '.join(SCENARIOS)}")
    p.add_argument("--workers", type=int, default=1, choices=(1, 2), help="simulated workers per study")
    p.add_argument("--parallel", type=int, default=2, help="studies run at once (one service for all)")
    p.add_argument("--n-trials", type=int, default=12)
    p.add_argument("--samples", type=int, default=1000, help="the studies' probe samples (the search budget)")
    p.add_argument("--hardware", default="cpu", help="the studies' hardware class (a GPU name: auto starting points)")
    p.add_argument("--remeasure-windows", type=int, default=None, help="remeasure.windows (default: not sent, i.e. "
                   "the study's probe.windows)")
    p.add_argument("--db", default="sqlite", help="sqlite (a fresh file in a temporary directory), postgresql (a "
                   f"fresh database on the server of $AUTOTUNE_TEST_PG_URL, now {PG_ADMIN_URL}, dropped afterwards) "
                   "or a SQLAlchemy URL used as it is, e.g. postgresql+psycopg://postgres@127.0.0.1:5432/verdict")
    p.add_argument("--study-timeout-s", type=float, default=300.0)
    p.add_argument("--out", type=Path, default=OUT, help="the JSON; the PNG goes next to it")
    p.add_argument("--resume", action="store_true", help="keep the studies a killed run of the same settings "
                   "and service code recorded (<out>.partial.jsonl) and run only the others")
    p.add_argument("--report", type=Path, default=None, help="print the table and redraw the PNG of an earlier "
                   "run's JSON (nothing is run)")
    args = p.parse_args(argv)
    names = [s for s in args.scenarios.split(",") if s]
    unknown = [s for s in names if s not in SCENARIOS]
    if unknown or not names:
        p.error(f"--scenarios: unknown {', '.join(unknown) or '(none given)'}; the scenarios are "
                f"{', '.join(SCENARIOS)}")
    args.scenario_list = [SCENARIOS[s] for s in names]
    return args


def shown_path(path: Path) -> str:
    """`path` relative to the repository when it lies in it (the JSON names no one's home), else absolute."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def progress_line(s: dict[str, Any], done: int, of: int) -> str:
    speedup = "" if s["speedup"] is None else f", speedup {s['speedup']:.2f}"
    pick = "fused" if s["pick_is_winner"] else "not fused"
    if s["pick"] == BASELINE:
        pick = "the baseline's"
    elif SCENARIOS[s["scenario"]].has_winner:
        pick = "the planted winner" if s["pick_is_winner"] else "not the planted winner"
    errors = "".join(f"\n   error: {example}" for example in s["error_examples"][:2])
    return (f"[{s['scenario']} {done}/{of}] seed {s['seed']}: {s['state']}, certified {s['certified']} "
            f"({s['outcome']}), pick {pick}{speedup}, {s['remeasure_trials']} re-measure trials, "
            f"{s['wall_s']:.1f} s{errors}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report is not None:  # table and plot of an earlier run's JSON, nothing run
        doc = load(args.report)  # the committed one is split (bench/resultfiles.py); its summaries are in it
        plot(doc["summaries"], args.report.with_suffix(".png"))
        print(markdown_table(doc["summaries"]))
        return 0
    if threading.current_thread() is not threading.main_thread():
        return run(args)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # SIGTERM: stop the service too
    try:
        return run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_jobs(args: argparse.Namespace, jobs: list[tuple[Scenario, int]], seeds: list[int], tag: str,
             studies: list[dict[str, Any]], partial: Path) -> str:
    """Run `jobs` (scenario, seed) on one service, appending each study to `studies` and `partial`;
    the tail of the service's log."""
    with tempfile.TemporaryDirectory(prefix="autotune-verdict-") as tmp, database(args.db, Path(tmp)) as db_url:
        tokens = create_tokens(db_url)
        server = Server(db_url, "cli", Path(tmp) / "service.log")
        try:
            server.wait_ready()
            print(f"service at {server.url} on {db_url.split('@')[-1]}; {len(jobs)} studies "
                  f"({len(args.scenario_list)} scenarios × {len(seeds)} seeds"
                  f"{f', {len(studies)} from an earlier run' if studies else ''}), {args.workers} worker(s) each, "
                  f"{args.parallel} at once", flush=True)
            done = Counter(s["scenario"] for s in studies)
            with ThreadPoolExecutor(args.parallel) as pool, partial.open("a") as log:
                futures = [pool.submit(run_study, server.url, tokens, sc, seed, args, tag) for sc, seed in jobs]
                try:
                    for future in as_completed(futures):
                        study = future.result()
                        studies.append(study)
                        log.write(json.dumps(study, separators=(",", ":")) + "\n")
                        log.flush()
                        done[study["scenario"]] += 1
                        print(progress_line(study, done[study["scenario"]], len(seeds)), flush=True)
                except BaseException:  # SIGTERM, ^C, a study's error: the studies not started are not run
                    pool.shutdown(wait=True, cancel_futures=True)
                    raise
        finally:
            server.stop()
        return server.log_tail(60)


RESUME_KEYS = ("workers", "n_trials", "samples", "hardware", "remeasure_windows")  # what makes studies comparable


SERVICE_CODE = ("api/", "autotune/contract/protocol.py", "autotune/contract/results.py", "autotune/contract/views.py",
                "autotune/contract/verdict.py", "autotune/contract/space.py",
                "autotune/contract/config.py")


def service_code(code: dict[str, Any]) -> tuple[Any, list[str]]:
    """What of `code_version` decides the service's answers: the commit and its changed service files."""
    return code.get("commit"), sorted(f for f in code.get("changed_files", []) if f.startswith(SERVICE_CODE))


def partial_records(path: Path, args: argparse.Namespace, code: dict[str, Any]) -> list[dict[str, Any]]:
    """The studies an earlier run of the same settings and service code recorded in `path` (--resume)."""
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        return []
    header, records = lines[0], lines[1:]
    want = {k: getattr(args, k) for k in RESUME_KEYS}
    if header.get("settings") != want or service_code(header.get("code") or {}) != service_code(code):
        raise SystemExit(f"--resume: {path} was written with other settings or service code "
                         f"({header.get('settings')}, {header.get('code')}; now {want}, {code}): run without --resume")
    return records


def run(args: argparse.Namespace) -> int:
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    tag = uuid.uuid4().hex[:6]  # study names of their own on a database used before (--db)
    t_start = time.perf_counter()
    code = code_version()  # the service's code as it starts (others may edit the tree during a long run)
    # every study is appended here as it ends: a run that is killed keeps them (--resume goes on from there)
    partial = args.out.with_suffix(".partial.jsonl")
    partial.parent.mkdir(parents=True, exist_ok=True)
    names = {sc.name for sc in args.scenario_list}
    studies = [s for s in (partial_records(partial, args, code) if args.resume else [])
               if s["scenario"] in names and s["seed"] in seeds]
    if not args.resume or not partial.exists():
        partial.write_text(json.dumps({"settings": {k: getattr(args, k) for k in RESUME_KEYS}, "code": code}) + "\n")
    have = {(s["scenario"], s["seed"]) for s in studies}
    jobs = [(sc, seed) for sc in args.scenario_list for seed in seeds if (sc.name, seed) not in have]
    log_tail = ""
    if jobs:
        log_tail = run_jobs(args, jobs, seeds, tag, studies, partial)
    studies.sort(key=lambda s: (list(SCENARIOS).index(s["scenario"]), s["seed"]))
    summaries = [summarize(sc, [s for s in studies if s["scenario"] == sc.name]) for sc in args.scenario_list]
    png = args.out.with_suffix(".png")
    settings = {k: v for k, v in vars(args).items() if k not in ("scenario_list", "out", "db")}
    settings |= {"out": shown_path(args.out), "png": shown_path(png), "seeds": seeds, "space": SPACE,
                 "baseline": BASELINE, "db": args.db.split("@")[-1], "speed": SPEED, "quality": QUALITY,
                 "quality_sd_search": SD_SEARCH, "quality_sd_longer": SD_LONG,
                 "quality_seed_share": SEED_SHARE}
    doc = {"benchmark": "verdict", "environment": environment("cpu") | code, "settings": settings,
           "wall_s": round(time.perf_counter() - t_start, 2), "summaries": summaries, "studies": studies}
    status = finish_run(args.out, doc, png, lambda: plot(summaries, png), markdown_table(summaries), studies, log_tail)
    partial.unlink(missing_ok=True)  # the studies are in args.out now
    return status


if __name__ == "__main__":
    sys.exit(main())
