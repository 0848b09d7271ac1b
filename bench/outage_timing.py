"""Benchmark: does a service outage change what a probe measures, or how long its trial takes?

Each run starts the real service (``autotune serve``, SQLite, loopback without tokens) and one
real worker (``autotune worker --device cpu --threads 1``, the CLI's default heartbeat of 5 s),
and submits a study of one trial (its baseline: a fixed config of the ``ups`` tiny preset), so
every run measures the same config. Two modes, interleaved (up, outage, up, outage, …) so
that a drift of the host hits both alike:

up       the service answers throughout.
outage   ``--outage-after`` seconds after the probe child starts, the service is killed
         (SIGKILL: its process group); it is restarted on the same database and port once
         the worker has reached its complete (its "trial N (X s)" line), or ``--max-down``
         seconds after the probe ended. So the probe's timed windows, its end and whatever
         the worker does after it all fall into the outage, as in a long one.

Per run it records what the probe measured, as stored by the service (Optuna's user attrs:
throughput, its windows, warm-up), the probe child's wall time (from its start to its exit,
read from /proc every 20 ms), and the worker's trial time (its "trial N (X s)" line: lease to
the start of complete). The *lag* = trial time − child wall time is what the worker spent on
the trial beyond the probe itself: with reports forwarded inline it grew with every report the
outage made retry. Medians over the repeats, per mode.

    python bench/outage_timing.py --label after --out bench/results/outage_timing.json
    cd /path/to/older/checkout && PYTHONPATH=$PWD python /path/to/bench/outage_timing.py --label before ...

(The service and the worker run as ``python -m autotune.cli`` from the current directory:
it decides which checkout is measured.)

``--label`` names the code measured; a run adds (or replaces) that label's section of --out, so
two checkouts of the worker can be measured into one file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from studylib import environment, free_port, http, wait_healthy

from autotune.engine.fork_server import probe_children

CLI = [sys.executable, "-m", "autotune.cli"]
CHILD_MODULE = "autotune.engine.probe_child"
TRIAL_LINE = re.compile(r"trial (\d+) \(([\d.]+) s\):")


def probe_child(worker_pid: int) -> int | None:
    """The worker's probe child, forked by its fork server or started cold."""
    kids = probe_children(worker_pid, CHILD_MODULE)
    return kids[0] if kids else None


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Service:
    """`autotune serve` on one SQLite file and port; killable and restartable."""

    def __init__(self, db_url: str, port: int, log_path: Path) -> None:
        self.db_url, self.port, self.log_path = db_url, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, wait: bool = True) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen([*CLI, "serve", "--db", self.db_url, "--port", str(self.port)],
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1", "AUTOTUNE_AUTH": "false"})
        if wait:
            with httpx.Client(base_url=self.url, timeout=5) as http:
                wait_healthy(http, self.proc)

    def healthy(self) -> bool:
        try:
            return http().get(f"{self.url}/v1/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def spec(name: str, args: argparse.Namespace) -> dict[str, Any]:
    config = {"batch_size": args.batch_size, "accum_steps": 1}
    return {"name": name, "hardware": "cpu", "n_trials": 1, "sampler": "random", "seed": 0, "baseline_seeds": 1,
            "space": {"name": "one", "params": {"batch_size": {"choices": [args.batch_size]}},
                      "fixed": {"accum_steps": 1}},
            "baseline": config, "pruning": {"enabled": False}, "remeasure": {"top_k": 0},
            "probe": {"samples": args.samples, "windows": args.windows, "warmup_steps": 5}}


def stored_result(db_url: str, study: str) -> dict[str, Any]:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    trial = optuna.load_study(study_name=study, storage=db_url).trials[0]
    attrs = {**trial.user_attrs, **(trial.user_attrs.get("measurement") or {})}  # the probe's fields: one attr
    return {"state": trial.state.name, "failure_kind": attrs.get("failure_kind"),
            "throughput_samples_per_s": attrs.get("throughput_samples_per_s"),
            "window_throughputs": attrs.get("window_throughputs"), "warmup_s": attrs.get("warmup_s")}


def one_run(mode: str, index: int, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    run_dir = workdir / f"{mode}-{index}"
    run_dir.mkdir()
    service = Service(f"sqlite:///{run_dir / 'autotune.db'}", free_port(), run_dir / "service.log")
    service.start()
    name = f"outage-{mode}-{index}"
    worker: subprocess.Popen[bytes] | None = None
    try:
        http().post(f"{service.url}/v1/studies", json=spec(name, args), timeout=30).raise_for_status()
        worker_log = run_dir / "worker.log"
        with worker_log.open("wb") as log:
            worker = subprocess.Popen([*CLI, "worker", "--api", service.url, "--study", name, "--threads", "1",
                                       "--max-trials", "1"], stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200",
                                           "AUTOTUNE_SPOOL_DIR": str(run_dir / "spool")})
        deadline = time.monotonic() + 120
        child = None
        while child is None:
            if time.monotonic() > deadline or worker.poll() is not None:
                raise SystemExit(f"{mode} run {index}: no probe child appeared; see {worker_log}")
            child = probe_child(worker.pid)
            time.sleep(0.02)
        child_started = time.monotonic()
        killed_at = restarting = restarted_at = child_wall = None
        # one loop, nothing in it blocks: the child's end is seen within a poll whatever the service does
        while child_wall is None or (mode == "outage" and restarted_at is None):
            now = time.monotonic()
            if child_wall is None and not alive(child):
                child_wall = now - child_started
            if mode == "outage" and killed_at is None and now - child_started >= args.outage_after:
                service.kill()
                killed_at = now - child_started
            if mode == "outage" and killed_at is not None and restarting is None and child_wall is not None \
                    and (TRIAL_LINE.search(worker_log.read_text(errors="replace"))
                         or now - child_started - child_wall >= args.max_down):
                service.start(wait=False)
                restarting = now - child_started
            if restarting is not None and restarted_at is None and service.healthy():
                restarted_at = time.monotonic() - child_started
            if now - child_started > 600:
                raise SystemExit(f"{mode} run {index}: the probe did not end within 600 s")
            time.sleep(0.02)
        code = worker.wait(timeout=300)
        log_text = worker_log.read_text(errors="replace")
        trial_line = TRIAL_LINE.search(log_text)
        if code != 0 or trial_line is None:
            raise SystemExit(f"{mode} run {index}: the worker exited {code}:\n{log_text[-3000:]}")
        result = stored_result(service.db_url, name)
        trial_s = float(trial_line.group(2))
        assert child_wall is not None
        return {"mode": mode, "repeat": index, **result, "child_wall_s": round(child_wall, 3),
                "trial_s": trial_s, "lag_s": round(trial_s - child_wall, 3),
                "service_killed_at_s": None if killed_at is None else round(killed_at, 3),
                "service_restarted_at_s": None if restarting is None else round(restarting, 3),
                "service_back_at_s": None if restarted_at is None else round(restarted_at, 3)}
    finally:
        if worker is not None and worker.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGTERM)
            worker.wait(timeout=30)
        if service.proc is not None and service.proc.poll() is None:
            service.kill()


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in ("up", "outage"):
        mine = [r for r in runs if r["mode"] == mode]
        if not mine:
            continue
        thr = [r["throughput_samples_per_s"] for r in mine if isinstance(r["throughput_samples_per_s"], float)]
        spreads = [(max(w) - min(w)) / statistics.median(w) for r in mine if (w := r["window_throughputs"])]
        out[mode] = {"runs": len(mine), "complete": sum(r["state"] == "COMPLETE" for r in mine),
                     "throughput_median": round(statistics.median(thr), 1) if thr else None,
                     "throughput_min_max": [round(min(thr), 1), round(max(thr), 1)] if thr else None,
                     "window_spread_median": round(statistics.median(spreads), 3) if spreads else None,
                     "child_wall_s_median": round(statistics.median(r["child_wall_s"] for r in mine), 2),
                     "trial_s_median": round(statistics.median(r["trial_s"] for r in mine), 2),
                     "lag_s_median": round(statistics.median(r["lag_s"] for r in mine), 2),
                     "lag_s_max": round(max(r["lag_s"] for r in mine), 2)}
    if "up" in out and "outage" in out and out["up"]["throughput_median"] and out["outage"]["throughput_median"]:
        out["outage_over_up_throughput"] = round(out["outage"]["throughput_median"] / out["up"]["throughput_median"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", type=int, default=1200, help="training samples per probe")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--outage-after", type=float, default=3.0, help="seconds after the probe child starts")
    parser.add_argument("--max-down", type=float, default=90.0,
                        help="restart the service at the latest this long after the probe ended")
    parser.add_argument("--modes", default="up,outage", help="comma-separated: up, outage")
    parser.add_argument("--keep", type=Path, default=None, help="keep every run's database and logs in this directory")
    parser.add_argument("--label", default="current", help="names the code measured (a section of --out)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/outage_timing.json"))
    args = parser.parse_args()

    import autotune

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped benchmark still stops its processes
    runs = []
    with tempfile.TemporaryDirectory(prefix="outage-timing-") as tmp:
        workdir = Path(tmp) if args.keep is None else args.keep
        workdir.mkdir(parents=True, exist_ok=True)
        for index in range(args.repeats):
            for mode in args.modes.split(","):
                run = one_run(mode, index, args, workdir)
                print(json.dumps(run), flush=True)
                runs.append(run)
    doc: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {}
    doc.setdefault("description", "one CPU probe per run (ups tiny, batch 4, 1 thread) with the service up, and "
                                  "with the service killed mid-probe and restarted; see bench/outage_timing.py")
    doc[args.label] = {"environment": environment("cpu"), "autotune": str(Path(autotune.__file__).parent),
                       "settings": {k: v for k, v in vars(args).items() if k not in ("out", "label", "keep")},
                       "summary": summarize(runs), "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc[args.label]["summary"], indent=1))


if __name__ == "__main__":
    main()
