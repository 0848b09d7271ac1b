"""`autotune check best.yaml`: does a certified pick still hold on this host?

A recommended config is a claim about one GPU, one torch and one driver. `check` measures the
pick against its recorded baseline again, here: interleaved rounds (baseline then pick, then
the other way round), each run a fresh `autotune probe` process at the study's judged budget
and the round's seed, as the study's re-measure rounds ran; the same decision rule
(autotune.contract.verdict.judge) forms the speedup's interval and the seed-matched quality
difference. The pick *holds* when its new interval reaches the recorded one and its quality
is not shown worse, and the new interval shows the pick faster than the baseline beyond this
host's noise; it *regressed* when the new interval lies wholly below the recorded one (or below
parity), or its quality is shown worse than the baseline's beyond the study's margin; otherwise
it is *undecided* (too noisy here to tell: an exit 0 never rests on noise). Exit status: 0 holds,
1 regressed (by how much, and which provenance field changed), 2 bad input, 3 no answer (the
baseline's probe failed, or undecided). docs/regression-check.md.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer

from autotune.cli.common import usage_error

HOLDS, REGRESSED, BAD_INPUT, NOT_MEASURED = 0, 1, 2, 3
PROVENANCE_FIELDS = ("torch_version", "cuda_version", "driver_version", "device", "gpu_count", "model_fingerprint")


@dataclass
class Run:
    """One probe process of the check."""

    role: str  # baseline | pick
    round: int
    seed: int
    throughput: float | None = None
    quality: float | None = None
    failure: dict[str, str] | None = None
    environment: dict[str, Any] = field(default_factory=dict)


@dataclass
class CheckReport:
    status: str  # holds | regressed | undecided | not_measured
    reason: str
    recorded: dict[str, Any]
    speedup: float | None = None
    speedup_ci: tuple[float | None, float | None] = (None, None)
    quality_diff: float | None = None
    quality_bound: float | None = None
    quality_margin: float | None = None
    changed: dict[str, list[Any]] = field(default_factory=dict)  # provenance field -> [recorded, now]
    runs: list[Run] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return {"holds": HOLDS, "regressed": REGRESSED}.get(self.status, NOT_MEASURED)


def load_best(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the pick's config, its check record) from a best.yaml; ValueError naming the fix."""
    import yaml

    from autotune.contract.recommendation import read_check_record

    if not path.is_file():
        raise ValueError(f"{path}: no such file; write one with `autotune best STUDY --format yaml > best.yaml`")
    text = path.read_text()
    try:
        record = read_check_record(text)
        config = yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ValueError(f"{path}: not a best.yaml autotune wrote ({e})") from None
    if record is None:
        kept = "KEEP THE BASELINE" in text.split("\n", 1)[0]
        raise ValueError(f"{path}: " + ("its verdict kept the baseline: there is no certified pick to check" if kept
                                        else "no `# autotune-check:` record; write the file with `autotune best STUDY "
                                             "--format yaml` from a service of this version"))
    if not isinstance(config, dict) or not isinstance(record.get("check"), dict):
        raise ValueError(f"{path}: the config or its check record is malformed; write it again with `autotune best`")
    return config, record


def probe_once(workload: str, preset: str, config: dict[str, Any], inputs: dict[str, Any], seed: int, device: str,
               threads: int | None, timeout_s: float | None) -> dict[str, Any]:
    """One fresh `autotune probe --json` process (the probe path a worker's child runs); its result."""
    argv = [sys.executable, "-m", "autotune.cli", "probe", "--workload", workload, "--preset", preset,
            "--device", device, "--config", json.dumps(config), "--seed", str(seed),
            "--windows", str(inputs.get("windows", 8)), "--warmup-steps", str(inputs.get("warmup_steps", 5)), "--json"]
    if inputs.get("samples"):
        argv += ["--samples", str(inputs["samples"])]
    if timeout_s:
        argv += ["--timeout", str(timeout_s)]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    env.pop("AUTOTUNE_TOKEN", None)  # a probe never sees a token
    done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    try:
        result: dict[str, Any] = json.loads(done.stdout)
    except json.JSONDecodeError:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"failure": {"kind": "error", "message": f"autotune probe exited {done.returncode}: "
                                                        + " | ".join(tail)}}
    return result


def measure(config: dict[str, Any], record: dict[str, Any], device: str, rounds: int, threads: int | None = None,
            timeout_s: float | None = None, say: Any = None) -> list[Run]:
    """Interleaved rounds of the baseline and the pick (round r: seed check.seed + r; the order
    alternates, so neither always runs first on a warming host)."""
    inputs = record["check"]
    workload, preset = record["provenance"].get("workload"), record["provenance"].get("preset")
    runs = []
    for r in range(rounds):
        order = [("baseline", inputs.get("baseline_config") or {}), ("pick", config)]
        for role, knobs in order if r % 2 == 0 else order[::-1]:
            seed = int(inputs.get("seed", 1000)) + r
            out = probe_once(str(workload), str(preset), knobs, inputs, seed, device, threads, timeout_s)
            run = Run(role, r, seed, out.get("throughput_samples_per_s"), out.get("quality"), out.get("failure"),
                      {k: out.get(k) for k in PROVENANCE_FIELDS})
            runs.append(run)
            if say is not None:
                shown = (f"{run.throughput:,.1f} samples/s, {record.get('quality_metric')} {run.quality:.5g}"
                         if run.failure is None and run.throughput else f"FAILED ({(run.failure or {}).get('kind')})")
                say(f"round {r + 1}/{rounds}: {role:8s} {shown}")
            if run.failure is not None:
                return runs
    return runs


def decide(record: dict[str, Any], runs: list[Run]) -> CheckReport:
    """Judge the runs as the study's verdict did, and compare with the recorded speedup."""
    from autotune.contract.verdict import judge

    inputs = record["check"]
    recorded = {"speedup": record.get("speedup"), "speedup_ci": record.get("speedup_ci"), "study": record.get("study"),
                "trial": record.get("trial")}
    report = CheckReport("not_measured", "", recorded, runs=runs)
    failed = next((r for r in runs if r.failure is not None or not r.throughput), None)
    if failed is not None and failed.role == "baseline":
        report.reason = f"the baseline's probe failed ({_failure(failed)}): nothing to compare the pick with"
        return report
    report.changed = _changed(record.get("provenance") or {}, runs)
    if failed is not None:
        report.status = "regressed"
        report.reason = f"the pick's probe failed on this host ({_failure(failed)})" + _changes(report.changed)
        return report
    pick = [r for r in runs if r.role == "pick"]
    base = [r for r in runs if r.role == "baseline"]
    by_seed = {r.seed: r for r in base}
    pairs: list[tuple[float, float]] = []  # (pick, baseline) quality of the runs with the same seed
    for p in pick:
        twin = by_seed.get(p.seed)
        if p.quality is not None and twin is not None and twin.quality is not None:
            pairs.append((float(p.quality), float(twin.quality)))
    alpha = (1.0 - float(inputs.get("confidence", 0.95))) / 2.0  # each half one-sided: one candidate, one look
    # the study's margin came from all its baseline runs; the check's three never narrow it
    abs_tol = max(float(inputs.get("abs_tol", 0.01)), float(inputs.get("quality_margin") or 0.0))
    j = judge([float(r.throughput or 0.0) for r in pick], [float(r.throughput or 0.0) for r in base],
              [q for q, _ in pairs], [b for _, b in pairs], alpha=alpha, abs_tol=abs_tol,
              k=float(inputs.get("k", 2.0)), quality_direction=str(record.get("quality_direction", "minimize")),
              quality_pairs=pairs)
    report.speedup, report.speedup_ci = j.ratio, (j.ratio_low, j.ratio_high)
    report.quality_diff, report.quality_bound, report.quality_margin = j.quality_diff, j.quality_high, j.margin
    rec, (rec_low, _) = record.get("speedup"), record.get("speedup_ci") or (None, None)
    now = f"{j.ratio:.2f}× (interval {j.ratio_low:.2f}–{j.ratio_high:.2f}×)" if j.ratio is not None else "n/a"
    then = (f"{rec:.2f}× (interval {rec_low:.2f}–{record['speedup_ci'][1]:.2f}×)"
            if rec is not None and rec_low is not None else "n/a")
    by_much = f", {(j.ratio / rec - 1) * 100:+.0f} %" if j.ratio and rec else ""
    quality_worse = j.quality_low is not None and j.margin is not None and j.quality_low > j.margin
    slower = j.ratio_high is not None and ((rec_low is not None and j.ratio_high < rec_low) or j.ratio_high < 1.0)
    if slower or quality_worse:
        report.status = "regressed"
        what = [f"speedup {now} against the recorded {then}{by_much}"] if slower else []
        if quality_worse:
            what.append(f"quality worse: {record.get('quality_metric')} difference {j.quality_diff:+.4g} (at least "
                        f"{j.quality_low:+.4g}) beyond the margin {j.margin:.4g}")
        report.reason = "; ".join(what) + _changes(report.changed)
    elif j.ratio_low is not None and j.ratio_low > 1.0:
        report.status = "holds"
        note = "" if j.status == "certified" else f" (on this host in {len(pick)} rounds: {j.reason})"
        report.reason = f"speedup {now}, within reach of the recorded {then}{note}" + _changes(report.changed)
    else:  # neither shown slower nor shown faster than the baseline: the spread here is too wide to say
        report.status = "undecided"
        report.reason = (f"speedup {now} on this host against the recorded {then}: {len(pick)} rounds here do not "
                         "show the pick faster than its baseline beyond their own noise, nor slower than recorded; "
                         "run again with more --rounds, on a host with nothing else running"
                         + _changes(report.changed))
    return report


def _failure(run: Run) -> str:
    f = run.failure or {"kind": "error", "message": "no throughput"}
    return f"{f.get('kind')}: {str(f.get('message'))[:200]}"


def _changed(recorded: dict[str, Any], runs: list[Run]) -> dict[str, list[Any]]:
    """Provenance fields whose value on this host differs from the recorded one (read from the
    pick's runs, else the baseline's)."""
    ours = next((r.environment for r in runs if r.role == "pick"), None) or (runs[0].environment if runs else {})
    return {k: [recorded.get(k), ours.get(k)] for k in PROVENANCE_FIELDS
            if recorded.get(k) is not None and ours.get(k) is not None and recorded.get(k) != ours.get(k)}


def _changes(changed: dict[str, list[Any]]) -> str:
    if not changed:
        return "; nothing in the provenance changed"
    return "; changed since it was certified: " + ", ".join(f"{k} {a} → {b}" for k, (a, b) in changed.items())


def check(
    best_file: Annotated[Path, typer.Argument(metavar="BEST_YAML", help="A certified pick: `autotune best STUDY "
                                                                        "--format yaml` wrote it.")],
    device: Annotated[str, typer.Option(help="Where to probe: cpu, cuda or cuda:N.")] = "cpu",
    rounds: Annotated[int, typer.Option(help="Interleaved rounds (a baseline and a pick run each); 3 or more "
                                             "judge quality too.", min=2, max=20)] = 3,
    threads: Annotated[int | None, typer.Option(help="CPU: torch threads per probe.", min=1)] = None,
    timeout: Annotated[float | None, typer.Option(help="Soft time limit of each probe (s).", min=1)] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object (for CI systems).")] = False,
) -> None:
    """Measure a certified pick against its recorded baseline again on this host, and say
    whether its speedup still holds.

    Exit status: 0 it holds; 1 it regressed (by how much, and which of torch, CUDA, driver, GPU
    or model changed since); 2 bad input; 3 no answer: the baseline's probe failed, or the rounds
    here were too noisy to tell (run again with more --rounds).
    """
    try:
        config, record = load_best(best_file)
    except ValueError as e:
        raise usage_error(str(e)) from None
    if int(record["check"].get("gpus_per_trial", 1)) > 1:
        raise usage_error(f"{best_file}: the pick ran on {record['check']['gpus_per_trial']} GPUs per probe; "
                          "`autotune check` probes one process: check it with a study on this host instead")
    hardware = record["check"].get("hardware", "cpu")
    if hardware != "cpu" and device == "cpu":
        raise usage_error(f"{best_file}: the pick was certified on {hardware}; give --device cuda (a CPU "
                          "check would compare something else)")

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    say(f"checking {best_file} (study {record.get('study')}, trial {record.get('trial')}) on {device}: "
        f"{rounds} interleaved rounds")
    runs = measure(config, record, device, rounds, threads, timeout, say)
    report = decide(record, runs)
    if json_out:
        out = asdict(report)
        out["exit_code"] = report.exit_code
        print(json.dumps(out, indent=1, default=lambda v: None if isinstance(v, float) and math.isnan(v) else v))
    else:
        print(f"{report.status.upper().replace('_', ' ')}: {report.reason}")
    raise typer.Exit(code=report.exit_code)
