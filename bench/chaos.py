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

``--restart-elsewhere``: a restart onto *another database with the same tokens* (issue 35,
deliverable 8). Database B is a copy of A made before any study (SQLite: `autotune db backup`'s
online backup; PostgreSQL: CREATE DATABASE ... TEMPLATE), after the admin and worker tokens
were made in A: B has the same tokens and the same service id, and its trial ids restart at 1.
The service runs with auth on; the workers (the worker token, no --study) share one spool.

    A        study ``rel`` (--n-trials) on A; once a trial is in and the workers hold leases,
             kill -9 the service
    B        after --down s, the service on B (same port, same tokens); on B a study of the SAME
             name ``rel`` (the same spec, seed included, so the same configs, trial ids and
             numbers: as many trials as A had made) and, once B's ``rel`` has made them, a study
             ``other``; the workers run there until B has a result in, ``other`` a trial and a
             worker a lease (at most --elsewhere-s s); kill -9 the service
    A again  after --down s, the service on A again, until ``rel`` finishes; the workers stop
    read     B's trials, from a service on B without workers; the lease tokens of both databases

At each kill and start the harness writes a line into every worker's log ("### chaos: service
on B started"), so every "▶ trial" line is attributed to the database it was leased from (a
lease's "trial N (X s): … samples/s" line follows its own "▶" line, whenever it comes), and a
spool snapshot every 0.5 s attributes each spooled result to its database by its lease token.
It counts (`count_elsewhere`):

misdelivered       a COMPLETE stored in A or B whose throughput is a measurement of its worker
                   for a lease of another database, study or trial, and of none for its own
                   (exact values from the spool snapshots where one holds it, else the log's,
                   printed to 0.1): must be 0
re-run             a "▶ trial" of a database and trial id that the same worker process had
                   measured or delivered before: must be 0
unmatched          a stored COMPLETE whose throughput no measurement of its worker gives: 0
misattributed      a "▶ trial" line whose database's trial of that id is not its worker's: 0
twin leases        leases of a study, trial id and number that the worker had measured for
                   the other database (the hazard: the service tells them apart by the token)
409 another lease  the workers' lines quoting the service's "another lease of trial" refusal

and, with the default run's checks (`count`) per database and study: lost, duplicated and
discarded for A's ``rel`` (which must end complete), discarded for B's studies (left
unfinished), and the spool's files left at the end with the database, study and trial each
belongs to.

    python bench/chaos.py --restart-elsewhere                # both backends, ~2 min on 2 cores
    python bench/chaos.py --restart-elsewhere --repeats 3    # the committed results/chaos_elsewhere.json
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
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
from service_load import fresh_database, pg_server_version
from studylib import environment, free_port, http

from autotune.worker.spool import Spool

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


def study_spec(args: argparse.Namespace, name: str = STUDY, n_trials: int | None = None,
               seed: int | None = None) -> dict[str, Any]:
    return {"name": name, "hardware": "cpu", "space": SPACE, "baseline": {"batch_size": 4, "accum_steps": 1},
            "n_trials": args.n_trials if n_trials is None else n_trials, "sampler": "random",
            "seed": args.seed if seed is None else seed, "baseline_seeds": 1,
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

    # the top (results of a service not known yet, and the layout before per-service folders) and
    # each service's folder (autotune.worker.spool: <spool>/<service_id>/, its rejected/ inside)
    folders = [spool, *Spool(spool).service_folders()]
    return {"pending": [e for f in folders for e in read(f)],
            "rejected": [e for f in folders for e in read(f / "rejected")]}


def count(trials: list[dict[str, Any]], logs: dict[str, str], spool: Path, n_trials: int,
          files: dict[str, list[dict[str, Any]]] | None = None) -> dict[str, Any]:
    """The checks of the module docstring, from the trials, the workers' logs and the spool
    (`files`: the spool's files as `spool_files` reads them, if given: some of them only)."""
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
    files = spool_files(spool) if files is None else files
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


# --- --restart-elsewhere: a restart onto another database with the same tokens -------------------

REL, OTHER = "rel", "other"
MARK = "### chaos: service on {db} {what}"
PHASE = re.compile(r"^### chaos: service on (\S+) (started|killed)")
START = re.compile(r"^=== start (\d+) ===")
BANNER = re.compile(r"^autotune worker (\S+)\s*$")
KEPT = re.compile(r"^  trial (\d+): its result is kept in ")
ANOTHER_LEASE = "another lease of trial"  # the service's 409 for a result of another lease (autotune.contract.results)
LOG_TOLERANCE = 0.06  # a worker's log prints a throughput to 0.1


def log_events(logs: dict[str, str]) -> list[dict[str, Any]]:
    """The workers' logs as events, each log in its order: ``leased`` (a "▶ trial" line: of the
    database whose service the last marker line said started), ``measured`` (the throughput line
    of the lease before it, whenever it comes: a probe goes on while the service changes),
    ``kept`` (that lease's result kept in the spool after the service dropped the lease: a
    measurement too), ``delivered`` (a spooled result handed in: to the database then up). Each
    names the worker (the log), its process (start) and worker id, the database, study, trial id
    and number; ``measured`` its throughput."""
    events: list[dict[str, Any]] = []
    for name, text in logs.items():
        db: str | None = None
        process, worker_id = -1, None
        current: dict[str, Any] | None = None
        for line in text.splitlines():
            if (m := PHASE.match(line)) is not None:
                db = m.group(1) if m.group(2) == "started" else db
                continue
            if (m := START.match(line)) is not None:
                process, worker_id, current = int(m.group(1)), None, None
                continue
            if worker_id is None and (m := BANNER.match(line)) is not None:
                worker_id = m.group(1)
                continue
            base = {"worker": name, "process": process, "worker_id": worker_id}
            if (m := LEASED.search(line)) is not None:
                current = {"db": db, "study": m.group(2), "trial_id": int(m.group(3)), "number": int(m.group(1))}
                events.append({**base, "kind": "leased", **current})
            elif (m := MEASURED.match(line)) is not None and current is not None \
                    and int(m.group(1)) == current["number"]:
                events.append({**base, "kind": "measured", **current,
                               "throughput": float(m.group(3).replace(",", ""))})
            elif (m := KEPT.match(line)) is not None and current is not None and int(m.group(1)) == current["number"]:
                events.append({**base, "kind": "kept", **current})
            elif (m := SPOOLED.search(line)) is not None:
                events.append({**base, "kind": "delivered", "db": db, "study": m.group(2),
                               "trial_id": int(m.group(3)), "number": int(m.group(1))})
    return events


def database_log(logs: dict[str, str], db: str, study: str) -> dict[str, str]:
    """The workers' logs cut to one database's study (what `count` reads): its "▶ trial" lines,
    their measurements and the deliveries of its results, per worker process."""
    out: dict[str, list[str]] = defaultdict(list)
    processes: dict[str, int] = {}
    for e in log_events(logs):
        if processes.get(e["worker"]) != e["process"]:
            processes[e["worker"]] = e["process"]
            out[e["worker"]].append(f"\n=== start {e['process']} ===")
        if (e["db"], e["study"]) != (db, study):
            continue
        if e["kind"] == "leased":
            out[e["worker"]].append(f"▶ trial {e['number']} of {study} (id {e['trial_id']})")
        elif e["kind"] == "measured":
            out[e["worker"]].append(f"  trial {e['number']} (0.0 s): {e['throughput']} samples/s · measured")
        elif e["kind"] == "delivered":
            out[e["worker"]].append(f"  spooled result of trial {e['number']} of {study} (id {e['trial_id']}) "
                                    "delivered")
    return {name: "\n".join(lines) + "\n" for name, lines in out.items()}


def token_homes(leases: dict[str, list[dict[str, Any]]]) -> dict[str, tuple[str, str, int]]:
    """Lease token → (database, study, trial id), from the databases' lease tables."""
    return {row["token"]: (db, row["study"], int(row["trial_id"])) for db, rows in leases.items() for row in rows
            if row.get("token")}


def spool_measurement(entry: dict[str, Any]) -> float | None:
    result = entry.get("result") or {}
    x = result.get("throughput_samples_per_s")
    return float(x) if isinstance(x, (int, float)) and not result.get("failure") else None


def count_elsewhere(logs: dict[str, str], trials: dict[str, dict[str, list[dict[str, Any]]]],
                    leases: dict[str, list[dict[str, Any]]], snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """Misdelivered results and re-run trials of a restart onto another database (the module
    docstring), from the workers' logs with their marker lines, each database's trials per study
    (``trials[db][study]``, as GET /v1/studies/{study}/trials lists them), each database's lease
    rows (trial_id, study, number, worker_id, token) and the spool files seen while it ran."""
    events = log_events(logs)
    homes = token_homes(leases)
    measurements = [{"source": "log", "worker_id": e["worker_id"], "home": (e["db"], e["study"], e["trial_id"]),
                     "throughput": e["throughput"]} for e in events if e["kind"] == "measured"]
    unplaced = []  # spooled measurements whose lease token no database holds for their trial
    for entry in snapshots:
        x = spool_measurement(entry)
        if x is None:
            continue
        home = homes.get(entry.get("lease_token") or "")
        if home is None or home[1:] != (entry.get("study"), entry.get("trial_id")):
            unplaced.append({k: entry.get(k) for k in ("worker_id", "study", "trial_id", "number")})
            continue
        measurements.append({"source": "spool", "worker_id": entry.get("worker_id"), "home": home, "throughput": x})
    misdelivered, unmatched, checked = [], [], 0
    for db, studies in trials.items():
        for study, listed in studies.items():
            for t in listed:
                x, worker = t.get("throughput_samples_per_s"), t.get("worker_id")
                if t.get("state") != "COMPLETE" or not isinstance(x, (int, float)) or not worker:
                    continue
                checked += 1
                mine = [m for m in measurements if m["worker_id"] == worker]
                exact = [m for m in mine if m["source"] == "spool" and abs(m["throughput"] - x) <= 1e-9 * max(1.0, x)]
                matches = exact or [m for m in mine
                                    if m["source"] == "log" and abs(m["throughput"] - x) < LOG_TOLERANCE]
                where = (db, study, t["trial_id"])
                stored = {"db": db, "study": study, "trial_id": t["trial_id"], "number": t.get("number"),
                          "worker_id": worker, "throughput": x}
                if any(m["home"] == where for m in matches):
                    continue
                if matches:
                    misdelivered.append({**stored, "measured_for": sorted({
                        f"{m['home'][0]}/{m['home'][1]}/id {m['home'][2]} ({m['source']})" for m in matches})})
                else:
                    unmatched.append(stored)
    # per worker process: a lease of a trial it measured or delivered already; leases of a twin
    owner = {(db, study, t["trial_id"]): t.get("worker_id") for db, studies in trials.items()
             for study, listed in studies.items() for t in listed}
    done: set[tuple[Any, ...]] = set()
    measured_for: dict[tuple[Any, ...], set[str | None]] = defaultdict(set)  # (process, study, id, number) → dbs
    rerun: list[dict[str, Any]] = []
    misattributed: list[dict[str, Any]] = []
    twins, runs = 0, Counter[str | None]()
    for e in events:
        process = (e["worker"], e["process"])
        key = (*process, e["db"], e["trial_id"])
        if e["kind"] == "leased":
            runs[e["db"]] += 1
            if key in done:
                rerun.append({k: e[k] for k in ("worker", "process", "worker_id", "db", "study", "trial_id", "number")})
            if owner.get((e["db"], e["study"], e["trial_id"]), "?") != e["worker_id"]:
                misattributed.append({k: e[k] for k in ("worker", "worker_id", "db", "study", "trial_id", "number")})
            twins += bool(measured_for[(*process, e["study"], e["trial_id"], e["number"])] - {e["db"]})
        else:
            done.add(key)
            if e["kind"] != "delivered":
                measured_for[(*process, e["study"], e["trial_id"], e["number"])].add(e["db"])
    return {"misdelivered": len(misdelivered), "misdelivered_list": misdelivered, "re_run": len(rerun),
            "re_run_list": rerun, "unmatched": len(unmatched), "unmatched_list": unmatched,
            "misattributed": len(misattributed), "misattributed_list": misattributed,
            "completes_checked": checked, "leases_run": dict(runs), "twin_leases": twins,
            "another_lease_refusals": sum(text.count(ANOTHER_LEASE) for text in logs.values()),
            "measurements_logged": sum(m["source"] == "log" for m in measurements),
            "measurements_spooled_seen": sum(m["source"] == "spool" for m in measurements),
            "spooled_unplaced": unplaced}


class SpoolWatch:
    """Every result file in a spool (pending and rejected/), read every `every_s` s by a thread:
    a result delivered at once lies there for a moment, one kept until it is delivered."""

    def __init__(self, spool: Path, every_s: float = 0.5) -> None:
        self.spool, self.every_s = spool, every_s
        self.seen: dict[tuple[Any, ...], dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spool-watch", daemon=True)

    def start(self) -> SpoolWatch:
        self._thread.start()
        return self

    def snap(self) -> None:
        for folder, entries in spool_files(self.spool).items():
            for e in entries:
                key = (e.get("worker_id"), e.get("lease_token"), e.get("trial_id"), spool_measurement(e))
                self.seen.setdefault(key, {**e, "folder": folder})

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.snap()

    def stop(self) -> list[dict[str, Any]]:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.snap()
        return list(self.seen.values())


def study_state(url: str, study: str) -> str | None:
    with contextlib.suppress(httpx.HTTPError, ValueError):
        state: str | None = http().get(f"{url}/v1/studies/{study}", timeout=5).json().get("state")
        return state
    return None


def make_tokens(db_url: str) -> dict[str, str]:
    """An admin and a worker token in the database (as `autotune token create` makes them, which
    migrates it first: its tables and its service id); role → secret."""
    from autotune.api.auth import TokenStore

    store = TokenStore.open(db_url)
    try:
        return {role: store.create(role, f"chaos-{role}")[0] for role in ("admin", "worker")}
    finally:
        store.close()


@contextlib.contextmanager
def database_copy(backend: str, db_url: str, workdir: Path) -> Iterator[str]:
    """A copy of the database of `db_url` (no connection open to it), removed afterwards: SQLite's
    online backup (`autotune db backup`), or a PostgreSQL database made with it as TEMPLATE."""
    from sqlalchemy.engine import make_url

    if backend == "sqlite":
        from autotune.api.backup import backup_sqlite

        path = workdir / f"copy-{uuid.uuid4().hex[:8]}.db"
        backup_sqlite(db_url, path)
        try:
            yield f"sqlite:///{path}"
        finally:
            for suffix in ("", "-wal", "-shm"):
                Path(f"{path}{suffix}").unlink(missing_ok=True)
        return
    import psycopg

    url = make_url(db_url)
    name = f"{url.database}_copy"
    admin = url.set(database="postgres", drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{url.database}"')
    try:
        yield url.set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def lease_rows(db_url: str) -> list[dict[str, Any]]:
    """The database's lease rows: trial_id, study, number, worker_id, token (None from an autotune
    before lease tokens), outcome."""
    from sqlalchemy import create_engine, inspect, text

    engine = create_engine(db_url)
    try:
        token = "token" if "token" in {c["name"] for c in inspect(engine).get_columns("autotune_leases")} else "NULL"
        with engine.connect() as conn:
            rows = conn.execute(text(f"SELECT trial_id, study_name, trial_number, worker_id, {token}, outcome "
                                     "FROM autotune_leases ORDER BY trial_id")).all()
    finally:
        engine.dispose()
    return [{"trial_id": r[0], "study": r[1], "number": r[2], "worker_id": r[3], "token": r[4], "outcome": r[5]}
            for r in rows]


def run_elsewhere(backend: str, args: argparse.Namespace, workdir: Path, rng: random.Random) -> dict[str, Any]:
    """--restart-elsewhere on one backend (the module docstring)."""
    out = workdir / backend
    out.mkdir(parents=True, exist_ok=True)
    with fresh_database(backend, out) as url_a:
        tokens = make_tokens(url_a)  # before the copy: B holds the same tokens and service id
        with database_copy(backend, url_a, out) as url_b:
            return _elsewhere(backend, args, out, {"A": url_a, "B": url_b}, tokens, rng)


def _elsewhere(backend: str, args: argparse.Namespace, out: Path, urls: dict[str, str], tokens: dict[str, str],
               rng: random.Random) -> dict[str, Any]:
    spool = out / "spool"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"AUTOTUNE_AUTH": "true", "AUTOTUNE_LEASE_GRACE_S": str(args.grace_s), "AUTOTUNE_REAPER_INTERVAL_S": "1"}
    services = {db: Proc(f"service on {db}", [*CLI, "serve", "--db", u, "--port", str(port)],
                         out / f"service_{db}.log", env) for db, u in urls.items()}
    workers = [Proc(f"worker{i}", [*CLI, "worker", "--api", url, "--threads", "1", "--heartbeat", "1",
                                   "--idle-exit", "300", "--spool-dir", str(spool)],
                    out / f"worker{i}.log", {"AUTOTUNE_TOKEN": tokens["worker"]}) for i in range(args.workers)]
    admin = {"Authorization": f"Bearer {tokens['admin']}"}
    phases: list[dict[str, Any]] = []
    exits: list[dict[str, Any]] = []
    n_trials = {"A": {REL: args.n_trials}, "B": {REL: 0, OTHER: args.n_trials}}
    started = time.monotonic()
    deadline = started + args.budget_s
    watch = SpoolWatch(spool)

    def note(what: str, **extra: Any) -> None:
        """A marker line in every worker's log, written before the start it announces (after a kill)."""
        elapsed = time.monotonic() - started
        phases.append({"t_s": round(elapsed, 2), "event": what, **extra})
        for w in workers:
            with w.log_path.open("a") as log:
                log.write(f"\n{what} at {elapsed:.1f} s\n")
        print(f"[{backend}] {elapsed:6.1f} s: {what}", flush=True)

    def start(db: str) -> None:
        note(MARK.format(db=db, what="started"))
        services[db].start()
        wait_healthy(url, services[db])

    def kill(db: str) -> None:
        services[db].kill9(group=True)
        pause = rng.uniform(*args.down)
        note(MARK.format(db=db, what="killed"), down_s=round(pause, 2))
        time.sleep(pause)

    def submit(name: str, trials: int, seed: int) -> None:
        http().post(f"{url}/v1/studies", json=study_spec(args, name, trials, seed), headers=admin,
                    timeout=60).raise_for_status()

    def listed(study: str) -> list[dict[str, Any]]:
        try:
            data: list[dict[str, Any]] = http().get(f"{url}/v1/studies/{study}/trials", timeout=10).json()["data"]
            return data
        except (httpx.HTTPError, ValueError, KeyError):
            return []

    def states(*studies: str) -> Counter[str]:
        return Counter(t["state"] for study in studies for t in listed(study))

    def wait(condition: Callable[[], bool], timeout: float) -> bool:
        end = min(time.monotonic() + timeout, deadline)
        while True:
            if condition():
                return True
            if time.monotonic() >= end:
                return False
            for w in workers:
                if not w.alive():  # exited by itself (it should not): start it again, say so
                    print(f"[{backend}] {w.name} exited ({w.proc.returncode if w.proc else '?'}); restarting",
                          flush=True)
                    exits.append({"t_s": round(time.monotonic() - started, 2), "worker": w.name,
                                  "code": w.proc.returncode if w.proc else None})
                    w.start()
            time.sleep(0.5)

    def health() -> str | None:
        sid: str | None = http().get(f"{url}/v1/health", timeout=10).json().get("service_id")
        return sid

    finished, wall = False, 0.0
    service_ids: dict[str, str | None] = {}
    trials_a: list[dict[str, Any]] = []
    waits: dict[str, bool] = {}
    try:
        watch.start()
        start("A")
        service_ids["A"] = health()
        submit(REL, args.n_trials, args.seed)
        for w in workers:
            w.start()
        # A: a result in and a lease held; then, for up to 10 s, a lease per worker; a lease held at the kill
        waits["A"] = wait(lambda: (c := states(REL))["COMPLETE"] >= 1 and c["RUNNING"] >= 1, args.budget_s)
        wait(lambda: states(REL)["RUNNING"] >= args.workers, 10)
        time.sleep(rng.uniform(0.0, 1.0))
        waits["A"] &= wait(lambda: states(REL)["RUNNING"] >= 1, args.budget_s)
        made = max(len(listed(REL)), 2)
        kill("A")
        # B: the same tokens and service id; a study of the same name (the same spec: the same configs,
        # trial ids and numbers, as many as A made), then another
        start("B")
        service_ids["B"] = health()
        n_trials["B"][REL] = made
        submit(REL, made, args.seed)
        on_b = time.monotonic()
        wait(lambda: len(listed(REL)) >= made, args.elsewhere_s)
        submit(OTHER, args.n_trials, args.seed + 1)
        waits["B"] = wait(lambda: len(listed(OTHER)) >= 1 and (c := states(REL, OTHER))["COMPLETE"] >= 1
                          and c["RUNNING"] >= 1, args.elsewhere_s - (time.monotonic() - on_b))
        time.sleep(rng.uniform(0.0, 1.0))
        kill("B")
        start("A")
        finished = wait(lambda: study_state(url, REL) == "finished", args.budget_s)
        wall = time.monotonic() - started
        trials_a = listed(REL)
    finally:
        codes = {w.name: w.stop() for w in workers}
        for service in services.values():
            service.stop(signal.SIGINT)
        snapshots = watch.stop()
    # B's trials, from a service on B without workers
    phases.append({"t_s": round(time.monotonic() - started, 2), "event": "read B (no workers)"})
    services["B"].start()
    try:
        wait_healthy(url, services["B"])
        trials_b = {REL: listed(REL), OTHER: listed(OTHER)}
    finally:
        services["B"].stop(signal.SIGINT)
    leases = {db: lease_rows(u) for db, u in urls.items()}
    logs = {w.name: w.log_text() for w in workers}
    trials = {"A": {REL: trials_a}, "B": trials_b}
    homes = token_homes(leases)
    left = spool_files(spool)
    studies = {}
    for db, by_study in trials.items():
        for study, listing in by_study.items():
            files = {folder: [e for e in entries if homes.get(e.get("lease_token") or "", ("", "", 0))[:2]
                              == (db, study)] for folder, entries in left.items()}
            studies[f"{db}/{study}"] = count(listing, database_log(logs, db, study), spool, n_trials[db][study], files)
    kept_at_end = []
    for folder, entries in left.items():
        for e in entries:
            home = homes.get(e.get("lease_token") or "")
            kept_at_end.append({"folder": folder, "belongs_to": f"{home[0]}/{home[1]}" if home else None,
                                "study": e.get("study"), "trial_id": e.get("trial_id"), "number": e.get("number"),
                                "worker_id": e.get("worker_id"), "throughput": spool_measurement(e),
                                "reason": e.get("reason")})
    a_rel = studies[f"A/{REL}"]
    return {"backend": backend, "scenario": "restart-elsewhere", "finished": finished, "wall_s": round(wall, 1),
            "service_ids": service_ids,
            "same_service_id": service_ids.get("A") is not None and service_ids.get("A") == service_ids.get("B"),
            "conditions_met": waits, **a_rel, **count_elsewhere(logs, trials, leases, snapshots),
            "studies": {name: {k: v for k, v in c.items()} for name, c in studies.items()},
            "b_completed": {study: studies[f"B/{study}"]["completed"] for study in (REL, OTHER)},
            "b_discarded": sum(studies[f"B/{study}"]["measurements_discarded"] for study in (REL, OTHER)),
            "kept_at_end": kept_at_end,
            "kept_at_end_for": dict(Counter(k["belongs_to"] for k in kept_at_end if k["throughput"] is not None)),
            "phases": phases, "workers_exited": exits, "worker_exit_codes": codes,
            "worker_tracebacks": sum(text.count("Traceback") for text in logs.values()),
            "spool_seen": [{k: e.get(k) for k in ("folder", "worker_id", "study", "trial_id", "number", "reason")}
                           | {"throughput": spool_measurement(e),
                              "belongs_to": "/".join(map(str, homes.get(e.get("lease_token") or "", ())[:2])) or None}
                           for e in snapshots],
            "trial_list": {f"{db}/{study}": [{k: t.get(k) for k in ("trial_id", "number", "state", "worker_id",
                                                                    "throughput_samples_per_s", "failure",
                                                                    "retry_of", "retried_as")} for t in listing]
                           for db, by_study in trials.items() for study, listing in by_study.items()}}


def elsewhere_table(runs: list[dict[str, Any]]) -> str:
    head = ("| backend | workers | A's rel: trials requested | completed | lost | duplicated | discarded | "
            "B: completed (rel / other) | discarded | twin leases | 409 another lease | misdelivered | re-run | "
            "kept at the end (for A / for B) | wall |")
    lines = [head, "|---|" + "---:|" * 14]
    for r in runs:
        kept = r["kept_at_end_for"]
        name = f"{r['backend']} #{r['repeat']}" if any(x.get("repeat", 1) > 1 for x in runs) else r["backend"]
        lines.append(f"| {name} | {r['workers']} | {r['requested']} | {r['completed']} | {r['lost']} | "
                     f"{r['duplicated']} | {r['measurements_discarded']} | {r['b_completed'][REL]} / "
                     f"{r['b_completed'][OTHER]} | {r['b_discarded']} | {r['twin_leases']} | "
                     f"{r['another_lease_refusals']} | {r['misdelivered']} | {r['re_run']} | "
                     f"{sum(v for k, v in kept.items() if k and k.startswith('A/'))} / "
                     f"{sum(v for k, v in kept.items() if k and k.startswith('B/'))} | {r['wall_s']:.0f} s |")
    return "\n".join(lines)


COLUMNS = ("backend", "requested", "completed", "lost", "duplicated", "lost_leases_rerun", "measurements",
           "measurements_delivered_from_spool", "measurements_discarded", "measurements_kept_not_in_db")


ELSEWHERE_COLUMNS = ("backend", "same_service_id", "requested", "completed", "lost", "duplicated",
                     "measurements_discarded", "b_completed", "b_discarded", "twin_leases", "another_lease_refusals",
                     "misdelivered", "re_run", "unmatched", "misattributed", "kept_at_end_for")


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
    parser.add_argument("--samples", type=int, default=None,
                        help="training samples per probe (default: 160; with --restart-elsewhere 1000, so that a "
                             "probe lasts seconds and the kills land during probes)")
    parser.add_argument("--kills", type=int, default=6, help="kills per backend")
    parser.add_argument("--victims", default="service,worker,worker",
                        help="the kills' victims in proportion (the default: a third the service, two thirds a "
                             "worker, in a seeded order; which worker is drawn at random)")
    parser.add_argument("--gap", type=pair, default=(3.0, 9.0), help="seconds between kills: LOW,HIGH")
    parser.add_argument("--down", type=pair, default=(0.5, 3.0), help="seconds a victim stays down: LOW,HIGH")
    parser.add_argument("--grace-s", type=float, default=20.0, help="the service's lease grace period")
    parser.add_argument("--budget-s", type=float, default=600.0, help="give up on a backend after this long")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--restart-elsewhere", action="store_true",
                        help="instead of the kills above: restart the service onto a copy of its database (the same "
                             "tokens and service id) mid-study, run studies there (one of the same name), restart it "
                             "back, and count misdelivered results and re-run trials (see the module docstring); "
                             "--kills, --victims and --gap do not apply")
    parser.add_argument("--elsewhere-s", type=float, default=90.0,
                        help="--restart-elsewhere: the longest the service stays on the copy")
    parser.add_argument("--repeats", type=int, default=1,
                        help="--restart-elsewhere: runs per backend (each on a new database and copy)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep the services' and workers' logs and the spool in this directory (default: a "
                             "temporary one, removed)")
    parser.add_argument("--out", type=Path, default=None,
                        help="the JSON written (default: bench/results/chaos.json, with --restart-elsewhere "
                             "bench/results/chaos_elsewhere.json)")
    args = parser.parse_args()
    if args.samples is None:
        args.samples = 1000 if args.restart_elsewhere else 160
    if args.out is None:
        args.out = ROOT / "bench" / "results" / ("chaos_elsewhere.json" if args.restart_elsewhere else "chaos.json")
    args.victims = [v.strip() for v in args.victims.split(",") if v.strip()]
    if not args.victims or set(args.victims) - {"service", "worker"}:
        parser.error("--victims: a comma-separated list of service and worker")
    rng = random.Random(args.seed)
    runs = []
    with contextlib.ExitStack() as stack:
        tmp = str(args.workdir) if args.workdir is not None else stack.enter_context(
            tempfile.TemporaryDirectory(prefix="chaos-"))
        for backend in args.backends.split(","):
            if args.restart_elsewhere:
                for repeat in range(1, args.repeats + 1):
                    run = run_elsewhere(backend, args, Path(tmp) / f"run{repeat}" if args.repeats > 1 else Path(tmp),
                                        rng)
                    run["workers"], run["repeat"] = args.workers, repeat
                    runs.append(run)
                    print(json.dumps({k: run[k] for k in (*ELSEWHERE_COLUMNS, "states", "failures")}), flush=True)
                continue
            run = run_backend(backend, args, Path(tmp), rng)
            run["workers"] = args.workers
            runs.append(run)
            print(json.dumps({k: run[k] for k in (*COLUMNS, "kills", "states", "failures")}), flush=True)
    doc = {"environment": {**environment("cpu"), "postgresql": pg_server_version()
                           if "postgresql" in args.backends else None},
           "settings": {k: v for k, v in vars(args).items() if k not in ("out", "workdir")}, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    if args.restart_elsewhere:
        print(elsewhere_table(runs))
        bad = [r["backend"] for r in runs if not r["finished"] or not r["same_service_id"] or any(
            r[k] for k in ("lost", "duplicated", "measurements_discarded", "b_discarded", "misdelivered", "re_run",
                           "unmatched", "misattributed"))]
        if bad:
            raise SystemExit(f"chaos --restart-elsewhere: a result misdelivered, a trial re-run, a measurement "
                             f"unmatched or discarded, a trial of A's study lost or duplicated, or the study "
                             f"unfinished on {', '.join(bad)}; see {args.out}")
        return
    print(table(runs))
    bad = [r["backend"] for r in runs if r["measurements_discarded"] or r["duplicated"] or r["lost"]
           or not r["finished"]]
    if bad:
        raise SystemExit(f"chaos: measurements discarded, trials duplicated or lost, or the study unfinished on "
                         f"{', '.join(bad)}; see {args.out}")


if __name__ == "__main__":
    main()
