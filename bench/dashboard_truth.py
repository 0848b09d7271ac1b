"""Check: what the Optuna dashboard reads from an autotune study is what was measured.

Runs `autotune demo` (a real CPU study through the service, workers and verdict) into
--workdir, unless --db names an existing study database, then reads the study with the stock
Optuna API, as optuna-dashboard does, and checks:

* every COMPLETE trial's values equal its own measurement (user attr ``measurement``:
  throughput_samples_per_s and the quality metric), whatever its role (baseline seed, search,
  re-measurement); no trial has a value outside what some probe measured;
* every FAIL or PRUNED trial has no values (a failed probe, a repeated draw never run);
* the study's Pareto front (``study.best_trials``, Optuna's own computation, constraints
  honoured) holds measured points only;
* the service's verdict is stored beside them (study user attr ``autotune_recommendation``).

Then, when a Chromium is installed (Debian: ``apt-get install chromium``), it starts
``optuna-dashboard`` on the database and saves a headless screenshot of the study page
(--png). Writes the checks as JSON (--out) and exits 1 when one fails.

    python bench/dashboard_truth.py                     # ~3 min on 2 cores (the demo)
    python bench/dashboard_truth.py --db sqlite:///demo-work/autotune.db
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
from studylib import free_port

ROOT = Path(__file__).resolve().parents[1]
CHROMIUMS = ("chromium", "chromium-browser", "google-chrome")


def run_demo(workdir: Path) -> str:
    """Run `autotune demo` into `workdir`; the database URL it wrote."""
    proc = subprocess.run([sys.executable, "-m", "autotune.cli", "demo", "--workdir", str(workdir)],
                          capture_output=True, text=True, timeout=1200, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"autotune demo failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return f"sqlite:///{(workdir / 'autotune.db').resolve()}"


def check(db_url: str) -> dict[str, Any]:
    """The checks above, on the newest study of `db_url`."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    summaries = optuna.get_all_study_summaries(storage=db_url)
    name = max(summaries, key=lambda s: s.datetime_start or datetime.min).study_name
    study = optuna.load_study(study_name=name, storage=db_url)
    trials = study.get_trials(deepcopy=False)
    metric = study.metric_names[1] if study.metric_names else "quality"
    problems: list[str] = []
    measured_points = set()
    roles: dict[str, int] = {}
    for t in trials:
        if t.state.name == "COMPLETE":
            m = t.user_attrs.get("measurement") or {}
            own = [m.get("throughput_samples_per_s"), m.get("quality")]
            measured_points.add(tuple(own))
            role = str(t.user_attrs.get("role", "search"))
            roles[role] = roles.get(role, 0) + 1
            if t.values is None or list(t.values[:2]) != own:
                problems.append(f"trial {t.number} ({role}): values {t.values} are not its measurement {own}")
        elif t.state.name in ("FAIL", "PRUNED") and t.values is not None:
            problems.append(f"trial {t.number} ({t.state.name}): values {t.values} though nothing was measured")
    front = study.best_trials
    for t in front:
        if tuple(t.values[:2]) not in measured_points:
            problems.append(f"front trial {t.number}: {t.values} is not a measured point")
    verdict = study.user_attrs.get("autotune_recommendation")
    if not isinstance(verdict, dict):
        problems.append("no autotune_recommendation on the study")
    states: dict[str, int] = {}
    for t in trials:
        states[t.state.name] = states.get(t.state.name, 0) + 1
    values = [t.values for t in trials if t.values is not None]
    return {"study": name, "metric_names": study.metric_names, "trials": len(trials), "states": states,
            "complete_by_role": roles, "front": [{"number": t.number, "values": t.values,
                                                  "role": t.user_attrs.get("role")} for t in front],
            "throughput_range": [min(v[0] for v in values), max(v[0] for v in values)] if values else None,
            f"{metric}_range": [min(v[1] for v in values), max(v[1] for v in values)] if values else None,
            "verdict": {k: verdict.get(k) for k in ("outcome", "certified", "trial_number", "speedup")}
            if isinstance(verdict, dict) else None,
            "problems": problems, "ok": not problems}


def screenshot(db_url: str, png: Path) -> str | None:
    """A headless Chromium screenshot of the study's dashboard page; None (and why) without one."""
    chromium = next((c for c in CHROMIUMS if shutil.which(c)), None)
    dashboard = shutil.which("optuna-dashboard") or str(Path(sys.executable).with_name("optuna-dashboard"))
    if chromium is None or not Path(dashboard).exists():
        return f"no screenshot: {'no Chromium installed' if chromium is None else 'no optuna-dashboard'}"
    port = free_port()
    server = subprocess.Popen([dashboard, db_url, "--host", "127.0.0.1", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/api/studies", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        png.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as profile:
            subprocess.run([chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                            f"--user-data-dir={profile}", "--window-size=1400,1100", "--virtual-time-budget=20000",
                            f"--screenshot={png}", f"http://127.0.0.1:{port}/dashboard/studies/1"],
                           capture_output=True, timeout=120, check=True)
        return None
    finally:
        server.terminate()
        server.wait(timeout=10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", help="an existing study database (default: run `autotune demo`)")
    parser.add_argument("--workdir", type=Path, default=None, help="the demo's work directory (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "dashboard_truth.json")
    parser.add_argument("--png", type=Path, default=ROOT / "docs" / "img" / "dashboard.png")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        db_url = args.db or run_demo(args.workdir or Path(tmp) / "demo")
        result = check(db_url)
        result["screenshot"] = screenshot(db_url, args.png) or str(args.png.relative_to(ROOT)
                                                                   if args.png.is_relative_to(ROOT) else args.png)
    result["date"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("study", "states", "complete_by_role", "ok", "problems", "screenshot")},
                     indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
