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
    python bench/regression_check.py --device cuda --spec my_gpu_study.yaml --out ...   # a GPU host
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
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


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _check(path: Path, device: str, rounds: int, threads: int | None) -> dict[str, Any]:
    argv = [*CLI, "check", str(path), "--device", device, "--rounds", str(rounds), "--json"]
    if threads:
        argv += ["--threads", str(threads)]
    t0 = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    out: dict[str, Any] = {"exit_code": done.returncode, "wall_s": round(time.monotonic() - t0, 1)}
    try:
        out["report"] = json.loads(done.stdout)
    except json.JSONDecodeError:
        out["stderr_tail"] = done.stderr[-2000:]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--spec", default=None, help="a study spec (YAML) instead of the CPU demo's job")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="CPU: torch threads per check probe")
    p.add_argument("--slowed", default=json.dumps(SLOWED), help="the slowed pick's knobs (JSON)")
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
    t0 = time.monotonic()
    tuned = subprocess.run([*CLI, "tune", "spec.yaml", "--workdir", str(work / "tune"), "--out", "best.yaml"],
                           cwd=work, capture_output=True, text=True, check=False)
    result["tune"] = {"exit_code": tuned.returncode, "wall_s": round(time.monotonic() - t0, 1),
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
    _log("check, unchanged host")
    result["unchanged"] = _check(best, args.device, args.rounds, args.threads)
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    slowed = work / "slowed.yaml"
    pick = yaml.safe_load(text)
    slowed.write_text(header + "\n" + yaml.safe_dump({**pick, **json.loads(args.slowed)}, sort_keys=False))
    _log(f"check, pick slowed to {args.slowed}")
    result["slowed"] = _check(slowed, args.device, args.rounds, args.threads)
    result["slowed"]["knobs"] = json.loads(args.slowed)
    for name in ("unchanged", "slowed"):
        r = result[name]
        rep = r.get("report") or {}
        _log(f"{name}: exit {r['exit_code']} ({rep.get('status')}) in {r['wall_s']} s: {rep.get('reason')}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    ok = result["unchanged"]["exit_code"] == 0 and result["slowed"]["exit_code"] == 1
    _log("both as expected" if ok else "NOT as expected")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
