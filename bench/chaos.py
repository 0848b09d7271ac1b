"""Benchmark: a real study on the CPU while workers and the service are killed with SIGKILL.

For each backend (a fresh SQLite file, a fresh PostgreSQL database) this starts the real
service (``autotune serve``, loopback without tokens, a short lease grace) and ``--workers``
real workers (``autotune worker --device cpu --threads 1``, all on one spool directory, as
workers on one host share the default spool), submits a study of ``--n-trials`` trials on the
``ups`` tiny preset (pruning off: every trial's outcome is a full measurement), and then,
at seeded random moments (a gap of ``--gap`` seconds, uniform), kills with SIGKILL either the
service (its process group) or one worker (the worker process alone, as the OOM killer would;
its probe child dies with it) — by default a third of the kills hit the service, in a seeded
order (``--victims``) — and restarts it after ``--down`` seconds (uniform) —
the service on the same database and port, a worker with the same command (a new process:
a new default worker id). ``--kills`` kills in all; then the study runs to its end.

Afterwards it reads the study's trials from the service and every worker's log and spool, and
counts:

requested          the study's n_trials (configurations)
completed          configurations with a COMPLETE trial
lost               configurations without any (a lost trial not re-run, or still running)
duplicated         configurations with two COMPLETE trials, or a trial leased by two workers
lost leases re-run trials failed as "lost" (a killed worker's lease, reaped after the grace
                   period, or a trial a killed service created but never leased) whose
                   re-run was handed out: the service's recovery, not a loss
measurements       probes that finished with a result (a worker's "trial N (X s): … samples/s"
                   line, a spooled result delivered, or a file left in a spool)
discarded          measurements the database does not hold and no spool keeps: the number
                   that must be 0
kept, not in DB    measurements in a spool (pending, or rejected/ with the service's reason)

    python bench/chaos.py                                    # both backends, ~4 min on 2 cores
    python bench/chaos.py --backends sqlite --kills 1 --n-trials 3 --out /tmp/chaos.json

Writes one JSON document (environment, settings, per backend: the counts, every kill, every
trial) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import httpx
from service_load import fresh_database, pg_server_version
from studylib import environment, free_port, http

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "autotune.cli"]
STUDY = "chaos"
SPACE: dict[str, Any] = {"name": "chaos", "params": {"batch_size": {"choices": [2, 4, 8]},
                                                     "inverse_loss_frequency": {"choices": [1, 2, 4]},
                                                     "lr": {"low": 1.0e-4, "high": 1.0e-2, "log": True}},
                         "fixed": {"accum_steps": 1}}
LEASED = re.compile(r"▶ trial (\d+) of (\S+) \(id (\d+)\)")
MEASURED = re.compile(r"^  trial (\d+) \(([\d.]+) s\): ([\d,.]+) samples/s ·", re.M)
SPOOLED = re.compile(r"spooled result of trial (\d+) of (\S+) \(id (\d+)\) delivered")


class Proc:
    """One role (the service, or a worker slot) across its restarts: each start a new process,
    in its own session, its log appended to one file."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str]) -> None:
        self.name, self.argv, self.log_path, self.env = name, argv, log_path, env
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            log.write(f"\n=== start {self.starts} ===\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "300", **self.env})
        self.starts += 1

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self, group: bool) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(self.proc.pid, signal.SIGKILL)
            else:
                os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


def wait_healthy(url: str, service: Proc, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not service.alive():
            raise SystemExit(f"the service exited; its log:\n{service.log_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if http().get(f"{url}/v1/health", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise SystemExit("the service did not answer /v1/health")


def study_spec(args: argparse.Namespace) -> dict[str, Any]:
    return {"name": STUDY, "hardware": "cpu", "space": SPACE, "baseline": {"batch_size": 4, "accum_steps": 1},
            "n_trials": args.n_trials, "sampler": "random", "seed": args.seed, "baseline_seeds": 1,
            "max_retries": 5, "pruning": {"enabled": False}, "remeasure": {"top_k": 0},
            "probe": {"samples": args.samples, "windows": 5, "warmup_steps": 5}}


def chains(trials: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Trials grouped by configuration: a first attempt and its retries (retry_of → number)."""
    by_number = {t["number"]: t for t in trials}

    def root(t: dict[str, Any]) -> int:
        seen = set()
        while t.get("retry_of") is not None and t["retry_of"] in by_number and t["number"] not in seen:
            seen.add(t["number"])
            t = by_number[t["retry_of"]]
        return int(t["number"])

    groups: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for t in trials:
        groups[root(t)].append(t)
    return groups


def spool_files(spool: Path) -> dict[str, list[dict[str, Any]]]:
    def read(folder: Path) -> list[dict[str, Any]]:
        out = []
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
            with contextlib.suppress(ValueError, OSError):
                out.append(json.loads(path.read_text()))
        return out

    return {"pending": read(spool), "rejected": read(spool / "rejected")}


def count(trials: list[dict[str, Any]], logs: dict[str, str], spool: Path, n_trials: int) -> dict[str, Any]:
    """The checks of the module docstring, from the trials, the workers' logs and the spool."""
    groups = chains([t for t in trials if t.get("repeat_of") is None])
    completed = [root for root, ts in groups.items() if any(t["state"] == "COMPLETE" for t in ts)]
    doubled = [root for root, ts in groups.items() if sum(t["state"] == "COMPLETE" for t in ts) > 1]
    finished_otherwise = [root for root, ts in groups.items() if root not in completed and any(
        t["state"] in ("PRUNED", "FAIL") and (t.get("failure") or {}).get("kind") not in ("lost", "interrupted",
                                                                                          "refused")
        for t in ts)]
    lost = [root for root in groups if root not in completed and root not in finished_otherwise]
    rerun = [t["number"] for t in trials if t["state"] == "FAIL" and (t.get("failure") or {}).get("kind") == "lost"
             and t.get("retried_as") is not None]
    # who leased what, and which probes ended with a measurement (per worker log, in order)
    leased_by: dict[int, set[str]] = defaultdict(set)
    measured: dict[int, list[float]] = defaultdict(list)  # trial id → throughputs the workers printed
    via_spool: set[int] = set()
    for name, text in logs.items():
        for start, process_log in enumerate(text.split("=== start ")):
            current: int | None = None
            for line in process_log.splitlines():
                if (m := LEASED.search(line)) is not None:
                    current = int(m.group(3))
                    leased_by[current].add(f"{name}#{start}")
                elif (m := MEASURED.match(line)) is not None and current is not None:
                    measured[current].append(float(m.group(3).replace(",", "")))
                elif (m := SPOOLED.search(line)) is not None:
                    via_spool.add(int(m.group(3)))
    files = spool_files(spool)
    kept = {int(e["trial_id"]): e for e in files["pending"] + files["rejected"]
            if not (e["result"].get("failure") or e["result"].get("stopped_early"))}
    by_id = {t["trial_id"]: t for t in trials}
    in_db, discarded, kept_only = [], [], []
    for trial_id in sorted(set(measured) | via_spool | set(kept)):
        t = by_id.get(trial_id) or {}
        stored = t.get("state") == "COMPLETE" and isinstance(t.get("throughput_samples_per_s"), float)
        if stored and (trial_id not in measured or any(abs(x - t["throughput_samples_per_s"]) < 0.06  # printed .1f
                                                       for x in measured[trial_id])):
            in_db.append(trial_id)
        elif trial_id in kept:
            kept_only.append(trial_id)
        else:
            discarded.append(trial_id)
    return {"requested": n_trials, "configurations": len(groups), "completed": len(completed),
            "finished_otherwise": len(finished_otherwise), "lost": len(lost), "lost_configurations": lost,
            "duplicated": len(doubled) + sum(len(w) > 1 for w in leased_by.values()),
            "completed_twice": doubled, "leased_twice": sorted(i for i, w in leased_by.items() if len(w) > 1),
            "lost_leases_rerun": len(rerun), "trials": len(trials),
            "states": dict(Counter(t["state"] for t in trials)),
            "failures": dict(Counter((t.get("failure") or {}).get("kind") for t in trials if t.get("failure"))),
            "measurements": len(in_db) + len(kept_only) + len(discarded),
            "measurements_in_db": len(in_db), "measurements_delivered_from_spool": len(via_spool),
            "measurements_discarded": len(discarded), "discarded_trial_ids": discarded,
            "measurements_kept_not_in_db": len(kept_only), "spool_left": {k: len(v) for k, v in files.items()}}


def run_backend(backend: str, args: argparse.Namespace, workdir: Path, rng: random.Random) -> dict[str, Any]:
    out = workdir / backend
    out.mkdir(parents=True, exist_ok=True)
    spool = out / "spool"
    with fresh_database(backend, out) as db_url:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        service = Proc("service", [*CLI, "serve", "--db", db_url, "--port", str(port)], out / "service.log",
                       {"AUTOTUNE_AUTH": "false", "AUTOTUNE_LEASE_GRACE_S": str(args.grace_s),
                        "AUTOTUNE_REAPER_INTERVAL_S": "1"})
        workers = [Proc(f"worker{i}", [*CLI, "worker", "--api", url, "--study", STUDY, "--threads", "1",
                                       "--heartbeat", "1", "--idle-exit", "300", "--spool-dir", str(spool)],
                        out / f"worker{i}.log", {}) for i in range(args.workers)]
        kills: list[dict[str, Any]] = []
        exits: list[dict[str, Any]] = []  # workers that exited by themselves (none should)
        # the victims' kinds in the proportions of --victims, in a seeded order
        services = round(args.kills * args.victims.count("service") / len(args.victims))
        plan = ["service"] * services + ["worker"] * (args.kills - services)
        rng.shuffle(plan)
        started = time.monotonic()
        try:
            service.start()
            wait_healthy(url, service)
            http().post(f"{url}/v1/studies", json=study_spec(args), timeout=60).raise_for_status()
            for w in workers:
                w.start()
            next_kill = time.monotonic() + rng.uniform(*args.gap)
            deadline = time.monotonic() + args.budget_s
            finished = False
            while time.monotonic() < deadline:
                now = time.monotonic()
                if len(kills) < args.kills and now >= next_kill:
                    kind = plan[len(kills)]
                    victim = service if kind == "service" else rng.choice(workers)
                    down = rng.uniform(*args.down)
                    victim.kill9(group=victim is service)
                    kills.append({"t_s": round(now - started, 2), "victim": victim.name, "down_s": round(down, 2)})
                    print(f"[{backend}] {now - started:6.1f} s: kill -9 {victim.name}, back in {down:.1f} s",
                          flush=True)
                    time.sleep(down)
                    victim.start()
                    if victim is service:
                        wait_healthy(url, service)
                    next_kill = time.monotonic() + rng.uniform(*args.gap)
                    continue
                if len(kills) >= args.kills:
                    with contextlib.suppress(httpx.HTTPError):
                        if http().get(f"{url}/v1/studies/{STUDY}", timeout=5).json().get("state") == "finished":
                            finished = True
                            break
                for w in workers:
                    if not w.alive():  # exited by itself (it should not): start it again, say so
                        print(f"[{backend}] {w.name} exited ({w.proc.returncode if w.proc else '?'}); restarting",
                              flush=True)
                        exits.append({"t_s": round(now - started, 2), "worker": w.name,
                                      "code": w.proc.returncode if w.proc else None})
                        w.start()
                time.sleep(0.5)
            wall = time.monotonic() - started
            trials = http().get(f"{url}/v1/studies/{STUDY}/trials", timeout=60).json()["data"]
        finally:
            codes = {w.name: w.stop() for w in workers}
            service.stop(signal.SIGINT)
        logs = {w.name: w.log_text() for w in workers}
        tracebacks = sum(text.count("Traceback") for text in logs.values())
        result = {"backend": backend, "finished": finished, "wall_s": round(wall, 1),
                  **count(trials, logs, spool, args.n_trials),
                  "kills": kills, "service_kills": sum(k["victim"] == "service" for k in kills),
                  "worker_kills": sum(k["victim"] != "service" for k in kills), "workers_exited": exits,
                  "worker_exit_codes": codes, "worker_tracebacks": tracebacks,
                  "trial_list": [{k: t.get(k) for k in ("trial_id", "number", "state", "worker_id", "role",
                                                        "throughput_samples_per_s", "failure", "retry_of",
                                                        "retried_as")} for t in trials]}
        return result


COLUMNS = ("backend", "requested", "completed", "lost", "duplicated", "lost_leases_rerun", "measurements",
           "measurements_delivered_from_spool", "measurements_discarded", "measurements_kept_not_in_db")


def table(runs: list[dict[str, Any]]) -> str:
    head = ("| backend | workers | kills (service / worker) | trials requested | completed | lost | duplicated | "
            "lost leases re-run | measurements | delivered from a spool | discarded | kept, not in DB | wall |")
    lines = [head, "|---|" + "---:|" * 12]
    for r in runs:
        lines.append(f"| {r['backend']} | {r['workers']} | {r['service_kills'] + r['worker_kills']} "
                     f"({r['service_kills']} / {r['worker_kills']}) | {r['requested']} | {r['completed']} | "
                     f"{r['lost']} | {r['duplicated']} | {r['lost_leases_rerun']} | {r['measurements']} | "
                     f"{r['measurements_delivered_from_spool']} | {r['measurements_discarded']} | "
                     f"{r['measurements_kept_not_in_db']} | {r['wall_s']:.0f} s |")
    return "\n".join(lines)


def pair(text: str) -> tuple[float, float]:
    low, _, high = text.partition(",")
    return float(low), float(high or low)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="sqlite,postgresql")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--n-trials", type=int, default=10)
    parser.add_argument("--samples", type=int, default=160, help="training samples per probe")
    parser.add_argument("--kills", type=int, default=6, help="kills per backend")
    parser.add_argument("--victims", default="service,worker,worker",
                        help="the kills' victims in proportion (the default: a third the service, two thirds a "
                             "worker, in a seeded order; which worker is drawn at random)")
    parser.add_argument("--gap", type=pair, default=(3.0, 9.0), help="seconds between kills: LOW,HIGH")
    parser.add_argument("--down", type=pair, default=(0.5, 3.0), help="seconds a victim stays down: LOW,HIGH")
    parser.add_argument("--grace-s", type=float, default=20.0, help="the service's lease grace period")
    parser.add_argument("--budget-s", type=float, default=600.0, help="give up on a backend after this long")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "chaos.json")
    args = parser.parse_args()
    args.victims = [v.strip() for v in args.victims.split(",") if v.strip()]
    if not args.victims or set(args.victims) - {"service", "worker"}:
        parser.error("--victims: a comma-separated list of service and worker")
    rng = random.Random(args.seed)
    runs = []
    with tempfile.TemporaryDirectory(prefix="chaos-") as tmp:
        for backend in args.backends.split(","):
            run = run_backend(backend, args, Path(tmp), rng)
            run["workers"] = args.workers
            runs.append(run)
            print(json.dumps({k: run[k] for k in (*COLUMNS, "kills", "states", "failures")}), flush=True)
    doc = {"environment": {**environment("cpu"), "postgresql": pg_server_version()
                           if "postgresql" in args.backends else None},
           "settings": {k: v for k, v in vars(args).items() if k != "out"}, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(table(runs))
    bad = [r["backend"] for r in runs if r["measurements_discarded"] or r["duplicated"] or r["lost"]
           or not r["finished"]]
    if bad:
        raise SystemExit(f"chaos: measurements discarded, trials duplicated or lost, or the study unfinished on "
                         f"{', '.join(bad)}; see {args.out}")


if __name__ == "__main__":
    main()
