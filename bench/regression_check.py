"""Benchmark: does `autotune check` keep a certified pick that still holds and catch one that does not?

One run, on this host, through the CLI a user runs:

1. `autotune tune` a study of the CPU demo's job (ups tiny, the `ups-tiny-cpu` space, 3 baseline
   seeds, TPE, the verdict's re-measure rounds) and keep its best.yaml (a certified pick);
2. `autotune check best.yaml --json` on the same host, unchanged: the pick should hold (exit 0);
3. the same best.yaml with the pick's knobs replaced by a slowed config (by default the
   baseline's own: a stack change that lost the whole win), its record left as certified:
   `autotune check` should say it regressed (exit 1) and by how much.

Each check runs `--rounds` interleaved rounds of fresh probe processes. The JSON holds the
study's verdict, both checks' reports, their exit codes and wall times.

    python bench/regression_check.py --out bench/results/regression_check_cpu.json
    python bench/regression_check.py --device cuda --spec my_gpu_study.yaml --slowed baseline --out ...   # a GPU host

bench/warm_start_gpu.py imports `check`, `slowed_copy`, `check_both` and `run_bounded` from here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

CLI = [sys.executable, "-m", "autotune.cli"]
DEMO_SPEC: dict[str, Any] = {
    "name": "regression-check", "workload": "ups", "preset": "tiny", "space": "ups-tiny-cpu", "hardware": "cpu",
    "sampler": "tpe", "seed": 0, "n_trials": 9, "baseline_seeds": 3, "probe": {"samples": 832},
    "remeasure": {"top_k": 2, "max_rounds": 4},
}
SLOWED = {"batch_size": 4, "accum_steps": 2, "inverse_loss_frequency": 1}  # the ups tiny baseline's own
BASELINE = "baseline"  # --slowed baseline: the pick's knobs replaced by the recorded baseline's, whatever the job


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclass
class Done:
    """A command run by `run_bounded`: its exit status (None: it had to be killed), output and wall time."""

    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float
    timed_out: bool


def run_bounded(argv: list[str], timeout_s: float | None = None, cwd: Path | None = None,
                stop: signal.Signals = signal.SIGTERM, grace_s: float = 30.0,
                env: dict[str, str] | None = None) -> Done:
    """Run `argv` in its own process group (in `env`, else this process's environment); past
    `timeout_s` send it `stop` (autotune tune and check clean up on SIGTERM: workers, service,
    probe children), then after `grace_s` SIGKILL its group. Output is captured (text)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            text=True, start_new_session=True, env=env)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, stop)
        try:
            out, err = proc.communicate(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
    except BaseException:  # interrupted ourselves: stop the command (it cleans up), then leave nothing behind
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, stop)
        try:
            proc.wait(timeout=min(grace_s, 15.0))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        raise
    return Done(proc.returncode, out or "", err or "", round(time.monotonic() - t0, 1), timed_out)


def check(path: Path, device: str, rounds: int, threads: int | None, timeout_s: float | None = None) -> dict[str, Any]:
    """`autotune check PATH --json`: its exit code, wall time and report (stderr's tail where it printed none)."""
    argv = [*CLI, "check", str(path), "--device", device, "--rounds", str(rounds), "--json"]
    if threads:
        argv += ["--threads", str(threads)]
    done = run_bounded(argv, timeout_s, grace_s=10.0)
    out: dict[str, Any] = {"exit_code": done.returncode, "wall_s": done.wall_s}
    if done.timed_out:
        out["timed_out"] = True
    try:
        out["report"] = json.loads(done.stdout)
    except json.JSONDecodeError:
        out["stderr_tail"] = done.stderr[-2000:]
    return out


def slowed_copy(best: Path, out: Path, knobs: dict[str, Any] | str = BASELINE) -> dict[str, Any]:
    """Write `out`: `best` (a certified pick's best.yaml) with the pick's knobs replaced by `knobs`
    (BASELINE: the recorded baseline's own, from its `# autotune-check:` record), its header and
    record left as they are, so the file still claims the certified speedup. Returns the knobs set."""
    from autotune.contract.recommendation import read_check_record

    text = best.read_text()
    if knobs == BASELINE:
        record = read_check_record(text) or {}
        knobs = dict((record.get("check") or {}).get("baseline_config") or {})
        if not knobs:
            raise ValueError(f"{best}: no baseline config in its check record")
    assert isinstance(knobs, dict)
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    pick = yaml.safe_load(text)
    out.write_text(header + "\n" + yaml.safe_dump({**pick, **knobs}, sort_keys=False))
    return knobs


def check_both(best: Path, work: Path, device: str, rounds: int, threads: int | None,
               slowed: dict[str, Any] | str = BASELINE, deadline: float | None = None) -> dict[str, Any]:
    """Check `best` unchanged, then a copy slowed to `slowed` (slowed_copy), within `deadline`
    (time.monotonic(); the first check gets half the time left). {"unchanged", "slowed",
    "as_expected": unchanged exit 0 and slowed exit 1}."""
    result: dict[str, Any] = {}

    def left(share: float) -> float | None:
        return None if deadline is None else max(1.0, (deadline - time.monotonic()) * share)

    _log("check, unchanged host")
    result["unchanged"] = check(best, device, rounds, threads, left(0.5))
    path = work / "slowed.yaml"
    knobs = slowed_copy(best, path, slowed)
    _log(f"check, pick slowed to {'the baseline' if slowed == BASELINE else json.dumps(knobs)}")
    result["slowed"] = check(path, device, rounds, threads, left(1.0))
    result["slowed"]["knobs"] = knobs
    result["slowed"]["slowed_to"] = slowed if isinstance(slowed, str) else "given"
    for name in ("unchanged", "slowed"):
        r = result[name]
        rep = r.get("report") or {}
        _log(f"{name}: exit {r['exit_code']} ({rep.get('status')}) in {r['wall_s']} s: {rep.get('reason')}")
    result["as_expected"] = result["unchanged"]["exit_code"] == 0 and result["slowed"]["exit_code"] == 1
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--spec", default=None, help="a study spec (YAML) instead of the CPU demo's job")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="CPU: torch threads per check probe")
    p.add_argument("--slowed", default=json.dumps(SLOWED),
                   help="the slowed pick's knobs (JSON), or 'baseline': the recorded baseline's own")
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="regression-check-"))
    work.mkdir(parents=True, exist_ok=True)
    spec = yaml.safe_load(Path(args.spec).read_text()) if args.spec else DEMO_SPEC
    (work / "spec.yaml").write_text(yaml.safe_dump(spec))
    result: dict[str, Any] = {"benchmark": "regression_check", "argv": sys.argv[1:], "spec": spec,
                              "environment": {"python": platform.python_version(), "host": platform.node(),
                                              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}}
    _log(f"tune {spec['name']} in {work}")
    tuned = run_bounded([*CLI, "tune", "spec.yaml", "--workdir", str(work / "tune"), "--out", "best.yaml"], cwd=work)
    result["tune"] = {"exit_code": tuned.returncode, "wall_s": tuned.wall_s,
                      "verdict": next((line for line in tuned.stdout.splitlines() if line.startswith("verdict")), None)}
    best = work / "best.yaml"
    if tuned.returncode != 0 or not best.exists():
        _log(f"no certified pick (exit {tuned.returncode}): nothing to check")
        result["tune"]["stdout_tail"] = tuned.stdout[-3000:]
        Path(args.out).write_text(json.dumps(result, indent=1))
        return 1
    text = best.read_text()
    result["best_yaml"] = text
    _log(f"certified: {text.splitlines()[1]}")
    slowed: dict[str, Any] | str = BASELINE if args.slowed == BASELINE else json.loads(args.slowed)
    result |= check_both(best, work, args.device, args.rounds, args.threads, slowed)
    ok = result.pop("as_expected")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    _log("both as expected" if ok else "NOT as expected")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
