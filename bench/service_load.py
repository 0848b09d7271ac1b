"""Benchmark: the service under many simulated workers (real HTTP, real database).

For every backend (a fresh SQLite file, a fresh PostgreSQL database), sampler (random,
tpe) and worker count (1, 16, 64 by default) this starts the real service in a subprocess
(``python -m autotune.cli serve --db URL --port P``), creates one study with a small inline
space and ``n_trials`` equal to the level's trial count, and lets N concurrent simulated
workers (asyncio + httpx, one client and one worker_id each) loop

    lease → one report → complete (a fake ProbeResult: random throughput and NRMSE)

until the study has handed out every trial (lease answers 204). Every call's latency and
the lease→complete round trip (minus the simulated probe time, with --probe-ms) are measured
on the client; errors are counted by kind (HTTP status or exception), and "database is
locked" is looked for in every response body and in the server's log. Afterwards it checks
that no trial went to two workers (or was leased twice) and that every leased trial was
completed, against the study's own counts and trial list.

With the default --probe-ms 0 the workers never pause: the service runs saturated, and by
Little's law the round trip is about workers / (trials per second). --probe-ms P makes each
worker wait P ms between lease and report (starts spread over one P) to model a fleet whose
probes take time, i.e. the latency a worker sees when the service is not the bottleneck.

    python bench/service_load.py                                  # ~5 min on 2 cores
    python bench/service_load.py --backends sqlite --samplers tpe --workers 16 --trials 400
    python bench/service_load.py --workers 64 --trials 128 --probe-ms 20000 --samplers tpe \
        --out bench/results/service_load_paced.json
    python bench/service_load.py --server instrumented --out bench/results/service_load_profile.json

While a worker "probes" (--probe-ms > 0, and always with --kills) it heartbeats its trial
(POST /v1/trials/{id}/heartbeat) every --heartbeat-s, the first beat at a random point within
one interval (a fleet's heartbeat clocks are not aligned with its leases), one try per beat as
the worker's courier does; heartbeat calls, their errors and latency percentiles are reported.

``--kills`` (see its section below and bench/README.md) adds crash recovery under load:
simulated workers that die mid-probe (the reaper re-leases their trials after the lease
grace); ``--mismatch-rate`` workers that first complete with a config other than the leased
one (a knob changed, an unknown key added, or lr changed: the preset's on a baseline lease,
which leaves lr to the preset), which must be refused (4xx) before their correct complete
goes in, and none of whose values may be stored; and ``--kill-service N``: N kill -9 of the
service's process group at seeded moments, each restarted on the same database and port
after a seeded downtime, while the workers retry as the real worker does (backoff, and a
result whose complete did not get through waits in a per-slot spool and is re-sent: no
measurement is ever dropped). Afterwards: lost, duplicated and discarded (a measurement a
worker made that the database does not hold) must all be 0, and the recovery from each
restart (to the first lease, the first complete, the fleet's lease rate back) is measured.

    python bench/service_load.py --kills --workers 32 --trials 500 --kill-service 3 \
        --out bench/results/service_load_chaos_pg.json

``--server instrumented`` runs the same service (``api.main.run_server``) from this file
with timers patched around the service's per-study locks, its methods, the Optuna bridge, the
samplers and every SQL statement/commit, so each call's server time can be split into
lock wait, sampler, Optuna storage, service SQL and the rest (see `profile_summary`).

Writes one JSON document (environment, settings, per-run summaries and per-trial raw
latencies), a PNG (p99 round trip and trials/s against workers, lease latency against
trial number), and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import itertools
import json
import math
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from studylib import free_port, http, pyplot

# the real worker's retry budgets (autotune/worker/delivery.py, loop.py), which the simulated workers of --kills follow
from autotune.worker.delivery import COMPLETE_RETRY_S, SPOOL_RETRY_S
from autotune.worker.loop import LEASE_RETRY_S

# a mismatched complete is retried through an outage until the service answers it (a 422 is its verdict)
MISMATCH_RETRY_S = 120.0

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PG_ADMIN_URL = os.environ.get("AUTOTUNE_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
LOCKED = "database is locked"
HARDWARE = "bench"
# lr is a float range so that no draw repeats a measured config: the service tells a repeat the
# earlier trial's result without a lease (OptunaBridge.ask), and every trial here is to be leased
SPACE: dict[str, Any] = {"params": {"batch_size": {"choices": [4, 8, 16, 32]}, "accum_steps": {"choices": [1, 2]},
                                    "lr": {"low": 1.0e-4, "high": 1.0e-2, "log": True}}}
CALLS = ("lease", "report", "complete", "round_trip")


# --- the service under test ----------------------------------------------------------------------

def proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` (Linux /proc), None when unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


class Server:
    """The service in its own process (own session), its log in a file."""

    def __init__(self, db_url: str, mode: str, log_path: Path, env: dict[str, str] | None = None,
                 port: int | None = None) -> None:
        self.port = port or free_port()  # a port: a restart of a killed service on the same address
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        if mode == "cli":
            cmd = [sys.executable, "-m", "autotune.cli", "serve", "--db", db_url, "--port", str(self.port)]
        else:
            cmd = [sys.executable, str(Path(__file__).resolve()), "_serve-instrumented", db_url, str(self.port)]
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 60.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the service exited ({self.proc.returncode}):\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if http().get(f"{self.url}/v1/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"the service did not answer /v1/health within {timeout:.0f} s:\n{self.log_tail()}")

    def cpu_s(self) -> float | None:
        return proc_cpu_s(self.proc.pid)

    def log_text(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # uvicorn shuts down gracefully (lifespan: reaper, engines)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


def create_tokens(db_url: str) -> dict[str, str]:
    """An admin and a worker token on the database, made as `autotune token create` makes them
    (its token store, which migrates the database first), in this process: two fresh
    processes cost more than a run's trials. role → secret; {} when this autotune has no
    tokens (a service without auth)."""
    try:
        from autotune.api.auth import TokenStore
    except ImportError as e:
        if e.name not in ("api", "api.auth", "autotune.api", "autotune.api.auth"):
            raise
        return {}  # an autotune from before tokens
    store = TokenStore.open(db_url)
    try:
        return {role: store.create(role, f"bench-{role}")[0] for role in ("admin", "worker")}
    finally:
        store.close()


def bearer(tokens: dict[str, str], role: str) -> dict[str, str]:
    """The Authorization header for `role` ({} without auth)."""
    return {"Authorization": f"Bearer {tokens[role]}"} if role in tokens else {}


def pg_psycopg_url(sqlalchemy_url: str) -> str:
    return sqlalchemy_url.replace("postgresql+psycopg://", "postgresql://", 1)


@contextlib.contextmanager
def fresh_database(backend: str, workdir: Path) -> Iterator[str]:
    """A SQLAlchemy URL on a new, empty database: a SQLite file, or a PostgreSQL database that
    is dropped afterwards."""
    if backend == "sqlite":
        path = workdir / f"bench-{uuid.uuid4().hex[:8]}.db"
        yield f"sqlite:///{path}"
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        return
    import psycopg

    name = f"autotune_bench_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_psycopg_url(PG_ADMIN_URL), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        base, _, _ = PG_ADMIN_URL.rpartition("/")
        yield f"{base}/{name}"
    finally:
        with psycopg.connect(pg_psycopg_url(PG_ADMIN_URL), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def pg_server_version() -> str | None:
    try:
        import psycopg

        with psycopg.connect(pg_psycopg_url(PG_ADMIN_URL), autocommit=True, connect_timeout=3) as conn:
            row = conn.execute("SELECT version()").fetchone()
            settings: dict[str, str] = dict(conn.execute("SELECT name, setting FROM pg_settings WHERE name IN "
                                         "('synchronous_commit', 'fsync', 'max_connections', 'shared_buffers')"
                                         ).fetchall())
        return f"{row[0] if row else '?'} ({', '.join(f'{k}={v}' for k, v in sorted(settings.items()))})"
    except Exception as e:
        return f"unreachable ({type(e).__name__}: {e})"


# --- simulated workers ---------------------------------------------------------------------------

@dataclass
class Level:
    """What one run (backend × sampler × worker count) observed on the client side."""

    trials: list[dict[str, Any]] = field(default_factory=list)  # one per completed trial
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))  # call → ms
    errors: Counter[str] = field(default_factory=Counter)  # "lease:503", "complete:ReadTimeout", ...
    locked_in_responses: int = 0
    leases: dict[int, list[str]] = field(default_factory=lambda: defaultdict(list))  # trial_id → workers
    completed: dict[int, str] = field(default_factory=dict)  # trial_id → worker that completed it
    gave_up: list[str] = field(default_factory=list)
    heartbeat_replies: Counter[str] = field(default_factory=Counter)  # "continue", "stop", "409"


def fake_result(lease: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """A ProbeResult.to_dict() as a worker would send it, without running anything."""
    return {"workload": lease["workload"], "preset": lease["preset"], "config": lease["config"], "device": "cpu",
            "torch_version": "bench", "throughput_samples_per_s": rng.uniform(50.0, 500.0),
            "val_nrmse": rng.uniform(0.05, 0.2), "failure": None, "stopped_early": False}


def lease_token_of(lease: dict[str, Any]) -> dict[str, str]:
    """{"lease_token": T} when the lease carried a token (a service with lease tokens), else {}: a
    worker sends it back with the trial's heartbeats, reports and complete, as the real worker
    does (a service without tokens refuses the unknown field)."""
    token = lease.get("lease_token")
    return {"lease_token": token} if isinstance(token, str) and token else {}


async def timed_post(client: Any, stats: Level | Chaos, call: str, path: str,
                     body: dict[str, Any]) -> Any:
    """POST `body`, recording its latency (ms) under `call` and any error by kind in `stats`;
    None when the request itself failed (connection, timeout)."""
    import httpx

    t0 = time.perf_counter()
    try:
        response = await client.post(path, json=body)
    except httpx.HTTPError as e:
        stats.errors[f"{call}:{type(e).__name__}"] += 1
        return None
    # a 204 (nothing left to lease) does no sampling: kept apart so it does not flatter lease latency
    stats.latencies["lease_204" if call == "lease" and response.status_code == 204 else call].append(
        (time.perf_counter() - t0) * 1e3)
    if response.status_code >= 400:
        stats.errors[f"{call}:{response.status_code}"] += 1
    return response


async def heartbeat_loop(client: Any, stats: Level | Chaos, trial_id: int, worker_id: str, interval_s: float,
                         rng: random.Random, stop: asyncio.Event, token: dict[str, str] | None = None) -> str | None:
    """Heartbeat `trial_id` every `interval_s` until `stop` is set, the first beat at a random
    point within one interval (a fleet's heartbeat clocks are not aligned with its leases). One
    try per beat: a beat that gets no answer is counted (timed_post) and the next one comes at
    the interval, as the worker's courier does. Returns "409" when the service answered that the
    trial is no longer this worker's, "stop" on a stop reply (both end the loop), else None.
    `token`: {"lease_token": ...} when the lease carried one (`lease_token_of`), sent with each beat."""
    wait = rng.uniform(0, interval_s)
    while True:
        try:
            await asyncio.wait_for(stop.wait(), timeout=wait)
            return None
        except asyncio.TimeoutError:
            pass
        r = await timed_post(client, stats, "heartbeat", f"/v1/trials/{trial_id}/heartbeat",
                             {"worker_id": worker_id, **(token or {})})
        if r is not None and r.status_code == 409:
            stats.heartbeat_replies["409"] += 1
            return "409"
        if r is not None and r.status_code == 200:
            action = str(r.json().get("action"))
            stats.heartbeat_replies[action] += 1
            if action == "stop":
                return "stop"
        wait = interval_s


async def run_worker(index: int, base_url: str, level: Level, rng: random.Random, probe_s: float,
                     max_errors: int = 50, headers: dict[str, str] | None = None, heartbeat_s: float = 0.0) -> None:
    import httpx

    worker_id = f"bench-w{index:03d}"

    async def post(client: httpx.AsyncClient, call: str, path: str, body: dict[str, Any]) -> httpx.Response | None:
        response = await timed_post(client, level, call, path, body)
        if response is not None and response.status_code >= 400 and LOCKED in response.text:
            level.locked_in_responses += 1
        return response

    consecutive = 0
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    # verify=False: plain HTTP, no TLS; the default client loads the CA bundle, ~18 ms of CPU that
    # blocks the event loop all 64 workers share (with staggered starts it inflated the latencies
    # of whatever calls were in flight). The client is made before the staggered start.
    async with httpx.AsyncClient(base_url=base_url, timeout=120.0, limits=limits, verify=False,
                                 headers=headers) as client:
        if probe_s > 0:  # simulated probes: start the workers spread over one probe time, as a real fleet runs
            await asyncio.sleep(rng.uniform(0, probe_s))
        while consecutive < max_errors:
            t_start = time.perf_counter()
            slept = 0.0
            r = await post(client, "lease", "/v1/trials/lease", {"worker_id": worker_id, "hardware": HARDWARE})
            if r is None or r.status_code not in (200, 204):
                consecutive += 1
                await asyncio.sleep(0.05 * consecutive)
                continue
            if r.status_code == 204:  # the study handed out all its trials
                return
            lease_ms = level.latencies["lease"][-1]
            lease = r.json()
            trial_id = lease["trial_id"]
            token = lease_token_of(lease)
            level.leases[trial_id].append(worker_id)
            if probe_s > 0:
                t0 = time.perf_counter()
                stop = asyncio.Event()
                beats = (asyncio.create_task(heartbeat_loop(client, level, trial_id, worker_id, heartbeat_s,
                                                            random.Random(rng.getrandbits(32)), stop, token))
                         if heartbeat_s > 0 else None)
                await asyncio.sleep(probe_s)
                stop.set()
                if beats is not None:
                    await beats
                slept = time.perf_counter() - t0
            result = fake_result(lease, rng)
            t0 = time.perf_counter()
            r = await post(client, "report", f"/v1/trials/{trial_id}/report",
                           {"worker_id": worker_id, "step": 0, **token,
                            "metrics": {"loss": rng.uniform(0.1, 1.0),
                                        "throughput_samples_per_s": result["throughput_samples_per_s"]}})
            report_ms = (time.perf_counter() - t0) * 1e3 if r is not None and r.status_code == 200 else None
            complete_ms = None
            for attempt in range(10):  # complete is idempotent for the same worker
                t0 = time.perf_counter()
                r = await post(client, "complete", f"/v1/trials/{trial_id}/complete",
                               {"worker_id": worker_id, "result": result, **token})
                if r is not None and r.status_code == 200:
                    complete_ms = (time.perf_counter() - t0) * 1e3
                    break
                await asyncio.sleep(0.05 * (attempt + 1))
            if complete_ms is None:
                consecutive += 1
                continue
            consecutive = 0
            level.completed[trial_id] = worker_id
            rtt_ms = (time.perf_counter() - t_start - slept) * 1e3  # the simulated probe time excluded
            level.latencies["round_trip"].append(rtt_ms)
            level.trials.append({"trial_id": trial_id, "number": lease["number"], "worker": index,
                                 "lease_ms": round(lease_ms, 3),
                                 "report_ms": None if report_ms is None else round(report_ms, 3),
                                 "complete_ms": round(complete_ms, 3), "round_trip_ms": round(rtt_ms, 3),
                                 "done_s": round(time.perf_counter(), 4)})
        level.gave_up.append(worker_id)


async def drive(base_url: str, workers: int, level: Level, seed: int, probe_s: float,
                headers: dict[str, str] | None = None, heartbeat_s: float = 0.0) -> None:
    await asyncio.gather(*(run_worker(i, base_url, level, random.Random(seed * 1000 + i), probe_s, headers=headers,
                                      heartbeat_s=heartbeat_s)
                           for i in range(workers)))


# --- one run ---------------------------------------------------------------------------------------

def percentiles(values: list[float]) -> dict[str, float | int | None]:
    import numpy as np

    if not values:
        return {"n": 0, "p50": None, "p90": None, "p99": None, "max": None, "mean": None}
    a = np.asarray(values)
    return {"n": len(values), "p50": round(float(np.percentile(a, 50)), 3),
            "p90": round(float(np.percentile(a, 90)), 3), "p99": round(float(np.percentile(a, 99)), 3),
            "max": round(float(a.max()), 3), "mean": round(float(a.mean()), 3)}


def lease_by_trial_number(trials: list[dict[str, Any]], buckets: int = 10) -> list[dict[str, Any]]:
    """Median lease latency per band of trial numbers (TPE's ask grows with the trials it has seen)."""
    import numpy as np

    if not trials:
        return []
    top = max(t["number"] for t in trials) + 1
    width = max(1, -(-top // buckets))
    out = []
    for start in range(0, top, width):
        ms = [t["lease_ms"] for t in trials if start <= t["number"] < start + width]
        if ms:
            out.append({"from": start, "to": start + width - 1, "n": len(ms),
                        "p50_ms": round(float(np.percentile(ms, 50)), 3)})
    return out


def run_level(backend: str, sampler: str, workers: int, n_trials: int, args: argparse.Namespace,
              workdir: Path) -> dict[str, Any]:

    tag = f"{backend}-{sampler}-{workers}w"
    print(f"== {tag}: {n_trials} trials", flush=True)
    with fresh_database(backend, workdir) as db_url:
        tokens = create_tokens(db_url)
        server = Server(db_url, args.server, workdir / f"{tag}.log")
        try:
            server.wait_ready()
            base = server.url
            study = f"load-{sampler}-{workers}w"
            spec = {"name": study, "space": SPACE, "hardware": HARDWARE, "n_trials": n_trials, "sampler": sampler,
                    "seed": args.seed, "baseline": {"batch_size": 8, "accum_steps": 1}}
            r = http().post(f"{base}/v1/studies", json=spec, timeout=60, headers=bearer(tokens, "admin"))
            if r.status_code != 201:
                raise RuntimeError(f"creating the study failed: {r.status_code} {r.text}")
            if args.server == "instrumented":
                http().get(f"{base}/bench/profile", timeout=30)  # drop the study creation's records
            level = Level()
            cpu_server0, cpu_client0 = server.cpu_s(), time.process_time()
            t0 = time.perf_counter()
            asyncio.run(drive(base, workers, level, args.seed, args.probe_ms / 1e3, bearer(tokens, "worker"),
                              heartbeat_s=args.heartbeat_s))
            wall = time.perf_counter() - t0
            cpu_server = (server.cpu_s() or 0.0) - (cpu_server0 or 0.0)
            cpu_client = time.process_time() - cpu_client0
            info = http().get(f"{base}/v1/studies/{study}", timeout=60).json()
            trial_list = http().get(f"{base}/v1/studies/{study}/trials", timeout=60).json()["data"]
            profile = http().get(f"{base}/bench/profile", timeout=60).json() if args.server == "instrumented" else None
        finally:
            server.stop()
        log = server.log_text()
    for t in level.trials:
        t["done_s"] = round(t["done_s"] - t0, 4)

    # exactly-once checks
    multi = {tid: ws for tid, ws in level.leases.items() if len(set(ws)) > 1}
    repeated = {tid: ws for tid, ws in level.leases.items() if len(ws) > 1}
    lost = sorted(set(level.leases) - set(level.completed))
    by_id = {t["trial_id"]: t for t in trial_list}
    not_complete = sorted(tid for tid in level.leases if by_id.get(tid, {}).get("state") != "COMPLETE")
    wrong_worker = sorted(tid for tid, w in level.completed.items() if by_id.get(tid, {}).get("worker_id") != w)
    repeats = sorted(tid for tid, t in by_id.items() if t.get("repeat_of") is not None)  # told, never leased
    never_leased = sorted(set(by_id) - set(level.leases) - set(repeats))
    counts = info.get("counts", {})
    # n_trials counts the baseline and search configs; the study then re-measures its top ones (more trials)
    configs = [t for t in trial_list if t.get("role") in ("baseline", "search")]
    ok = (not multi and not repeated and not lost and not not_complete and not wrong_worker and not never_leased
          and not repeats and len(configs) == n_trials and counts.get("COMPLETE") == len(trial_list)
          and sum(counts.values()) == len(trial_list) and not level.gave_up)
    run = {
        "backend": backend, "sampler": sampler, "workers": workers, "n_trials": n_trials, "server": args.server,
        "probe_ms": args.probe_ms, "wall_s": round(wall, 3),
        "trials_per_s": round(len(level.completed) / wall, 3) if wall > 0 else None,
        "calls_per_s": round(sum(len(level.latencies[c]) for c in (*CALLS[:3], "lease_204", "heartbeat")) / wall, 3)
        if wall > 0 else None,
        "latency_ms": {c: percentiles(level.latencies[c]) for c in (*CALLS, "lease_204", "heartbeat")},
        "heartbeats": {"interval_s": args.heartbeat_s if args.probe_ms > 0 else None,
                       "answered": len(level.latencies["heartbeat"]),
                       "errors": sum(v for k, v in level.errors.items() if k.startswith("heartbeat:")),
                       "replies": dict(level.heartbeat_replies)},
        "errors": dict(sorted(level.errors.items())), "errors_total": sum(level.errors.values()),
        "database_locked": {"responses": level.locked_in_responses, "server_log": log.count(LOCKED)},
        "server_log": {"errors": sum(" ERROR " in line for line in log.splitlines()),
                       "warnings": sum(" WARNING " in line for line in log.splitlines()),
                       "tracebacks": log.count("Traceback")},
        "checks": {"ok": ok, "leased": len(level.leases), "completed": len(level.completed),
                   "duplicate_leases": len(multi), "re_leased": len(repeated), "lost": len(lost),
                   "not_complete_in_study": len(not_complete), "wrong_worker": len(wrong_worker),
                   "never_leased": len(never_leased), "repeats": len(repeats), "workers_gave_up": len(level.gave_up),
                   "study_counts": counts, "study_trials": len(trial_list), "configurations": len(configs),
                   "examples": {"duplicate": list(multi.items())[:5], "lost": lost[:10]}},
        "cpu_s": {"server": round(cpu_server, 3), "client": round(cpu_client, 3)},
        "cpu_util": {"server": round(cpu_server / wall, 3), "client": round(cpu_client / wall, 3)},
        "lease_ms_by_trial_number": lease_by_trial_number(level.trials),
        "trials": sorted(level.trials, key=lambda t: t["number"]),
    }
    if profile is not None:
        run["profile"] = profile_summary(profile, n_trials)
    lat = run["latency_ms"]
    print(f"   {run['trials_per_s']} trials/s, round trip p50 {lat['round_trip']['p50']} p99 "
          f"{lat['round_trip']['p99']} ms, lease p99 {lat['lease']['p99']} ms, errors {run['errors_total']}, "
          f"locked {run['database_locked']}, checks {'ok' if ok else 'FAILED'}, cpu {run['cpu_s']}", flush=True)
    return run


# --- crash recovery under load (--kills) ----------------------------------------------------------

KILLS_OUT = RESULTS / "service_load_kills_pg.json"
# the kinds of mismatched config a --mismatch-rate worker sends first, in rotation (`mismatched_config`)
MISMATCH_KINDS = ("knob", "unknown_key", "lr")
THROUGHPUT_BACK = 0.8  # the fleet's lease rate is "back" at this fraction of its rate before the kill
THROUGHPUT_WINDOW_S = 5.0  # over this window (forward from each candidate moment)
PRE_KILL_WINDOW_S = 10.0  # the rate before a service kill: over this window before it


@dataclass
class Chaos:
    """What the simulated fleet of one --kills run did, seen from the client side."""

    leases: dict[int, list[str]] = field(default_factory=lambda: defaultdict(list))  # trial_id → workers
    completed: dict[int, list[str]] = field(default_factory=lambda: defaultdict(list))  # trial_id → workers (200)
    refused: list[dict[str, Any]] = field(default_factory=list)  # a live worker's call answered 409
    kills: list[dict[str, Any]] = field(default_factory=list)  # {worker, trial_id, number, at}
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))  # call → ms
    errors: Counter[str] = field(default_factory=Counter)
    done_times: list[float] = field(default_factory=list)  # unix time of every successful complete
    workers_started: int = 0
    lease_times: list[float] = field(default_factory=list)  # unix time of every successful lease (200)
    lease_configs: dict[int, dict[str, Any]] = field(default_factory=dict)  # trial_id → the config its lease gave
    heartbeat_replies: Counter[str] = field(default_factory=Counter)  # "continue", "stop", "409"
    # mismatched completes: {trial_id, worker, kind, config, status (None: never answered)}
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    # what the workers measured: (trial_id, worker) → the throughput in the result they made
    measurements: dict[tuple[int, str], float] = field(default_factory=dict)
    # per worker slot, results whose complete got no answer yet (the worker's spool; a replacement inherits it)
    spools: dict[int, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    spooled: int = 0  # results that went to a spool
    restarts: list[dict[str, Any]] = field(default_factory=list)  # one per kill -9 of the service
    spool_deadline: float | None = None  # monotonic: after the study, spooled results are offered until then


def mismatched_config(config: dict[str, Any], kind: str) -> tuple[dict[str, Any], str]:
    """A config that is not `config` (a lease's), and what was changed: "knob" changes batch_size,
    "unknown_key" adds a key no config has, "lr" changes lr: where the lease leaves lr to the
    preset (the baselines) to a value no preset has, else the leased lr × 1.5."""
    if kind == "knob":
        return {**config, "batch_size": 16 if config.get("batch_size") == 4 else 4}, "knob batch_size changed"
    if kind == "unknown_key":
        return {**config, "bench_not_a_knob": 1}, "unknown key added"
    if kind != "lr":
        raise ValueError(f"unknown mismatch kind {kind!r}")
    lr = config.get("lr")
    if lr is None:
        return {**config, "lr": 0.0123}, "preset-left lr set"
    return {**config, "lr": float(lr) * 1.5}, "leased lr changed"


async def chaos_worker(slot: int, generation: int, base_url: str, headers: dict[str, str], chaos: Chaos,
                       rng: random.Random, args: argparse.Namespace, done: asyncio.Event,
                       spawn: Callable[[int, int], None]) -> None:
    """One simulated worker: lease → "probe" (sleep, heartbeating) with one report → complete,
    until the study is finished. With probability args.kill_rate per trial it dies mid-probe:
    it never calls again, and a replacement with a new worker id starts in its slot.

    As the real worker (autotune/worker/loop.py, delivery.py, client.py): a call that gets no answer
    (connection refused or reset, a timeout) or a 5xx is retried with exponential backoff from
    0.25 s capped at args.max_backoff_s, a lease for LEASE_RETRY_S at a time, a complete for
    COMPLETE_RETRY_S; a result whose complete got no answer goes to the slot's spool, which
    is handed in first at every turn of the lease loop (SPOOL_RETRY_S a try) and after the
    study finished. No measurement is dropped. A 409 (heartbeat, report or complete) means
    the trial is no longer the worker's: it stops and leases the next (counted as refused).
    A worker drawn by args.mismatch_rate (and every baseline lease, the only ones that leave
    lr to the preset, when the rate is above 0) first completes with `mismatched_config`,
    then with the leased config."""
    import httpx

    worker_id = f"bench-w{slot:03d}-g{generation}"
    chaos.workers_started += 1
    limits = httpx.Limits(max_connections=2, max_keepalive_connections=2)  # a heartbeat beside the main call
    spool = chaos.spools[slot]

    async def call(client: httpx.AsyncClient, name: str, path: str, body: dict[str, Any],
                   budget_s: float) -> httpx.Response | None:
        """POST until an answer below 500, retrying the rest with backoff; None past `budget_s`."""
        delay, t0 = 0.25, time.monotonic()
        while True:
            r = await timed_post(client, chaos, name, path, body)
            if r is not None and r.status_code < 500:
                return r
            if time.monotonic() - t0 + delay > budget_s:
                return None
            await asyncio.sleep(delay)
            delay = min(2 * delay, args.max_backoff_s)

    async def deliver(client: httpx.AsyncClient, entry: dict[str, Any], budget_s: float) -> bool:
        """Complete entry's trial with its result: True once the service answered (taken or refused)."""
        trial_id = entry["trial_id"]
        r = await call(client, "complete", f"/v1/trials/{trial_id}/complete", entry["body"], budget_s)
        if r is None:
            return False
        if r.status_code == 200:
            chaos.completed[trial_id].append(entry["worker"])
            chaos.done_times.append(time.time())
        else:  # 409: no longer the worker's (the measurement is discarded); 422: its (leased) config refused
            chaos.refused.append({"worker": entry["worker"], "trial_id": trial_id, "call": "complete",
                                  "status": r.status_code, "detail": r.text[:300]})
        return True

    async def deliver_spool(client: httpx.AsyncClient, budget_s: float) -> None:
        for entry in list(spool):
            if not await deliver(client, entry, budget_s):
                return  # the service is away: the rest waits too
            spool.remove(entry)

    async def probe_wait(seconds: float, beats: asyncio.Task[str | None] | None) -> str | None:
        """Sleep `seconds` of the probe; returns early with the heartbeat's "409"/"stop"."""
        if beats is None:
            await asyncio.sleep(seconds)
            return None
        finished, _ = await asyncio.wait({beats}, timeout=seconds)
        return beats.result() if finished else None

    lo, hi = args.probe_range
    mismatches_sent = 0
    async with httpx.AsyncClient(base_url=base_url, timeout=120.0, limits=limits, verify=False,
                                 headers=headers) as client:
        if generation == 0:
            await asyncio.sleep(rng.uniform(0, hi))  # a fleet does not start in lockstep
        while not done.is_set():
            if spool:  # the spool first, as the worker's lease loop
                await deliver_spool(client, SPOOL_RETRY_S)
            r = await call(client, "lease", "/v1/trials/lease", {"worker_id": worker_id, "hardware": HARDWARE},
                           LEASE_RETRY_S)
            if r is None:
                continue
            if r.status_code == 204:  # nothing now (baselines running, retries not reaped yet): poll again
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(done.wait(), timeout=rng.uniform(0.3, 0.7))
                continue
            if r.status_code != 200:  # a 4xx: counted by timed_post; should not happen
                await asyncio.sleep(0.5)
                continue
            lease = r.json()
            trial_id = lease["trial_id"]
            token = lease_token_of(lease)
            chaos.leases[trial_id].append(worker_id)
            chaos.lease_times.append(time.time())
            chaos.lease_configs[trial_id] = dict(lease["config"])
            probe_s = rng.uniform(lo, hi)
            killed = rng.random() < args.kill_rate
            mismatch = None
            if args.mismatch_rate > 0 and (lease["role"] == "baseline" or rng.random() < args.mismatch_rate):
                mismatch = "lr" if lease["role"] == "baseline" else \
                    MISMATCH_KINDS[(slot + generation + mismatches_sent) % len(MISMATCH_KINDS)]
            stop = asyncio.Event()
            beats = (asyncio.create_task(heartbeat_loop(client, chaos, trial_id, worker_id, args.heartbeat_s,
                                                        random.Random(rng.getrandbits(32)), stop, token))
                     if args.heartbeat_s > 0 else None)
            if killed:
                await asyncio.sleep(rng.uniform(0, probe_s))  # killed mid-probe: no call ever again
                if beats is not None:
                    beats.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await beats
                chaos.kills.append({"worker": worker_id, "trial_id": trial_id, "number": lease["number"],
                                    "role": lease["role"], "at": time.time()})
                spawn(slot, generation + 1)
                return
            lost = await probe_wait(probe_s / 2, beats)
            if lost is None:
                r = await timed_post(client, chaos, "report", f"/v1/trials/{trial_id}/report",
                                     {"worker_id": worker_id, "step": 0, "metrics": {"loss": rng.uniform(0.1, 1.0)},
                                      **token})
                if r is not None and r.status_code == 409:
                    lost = "report 409"
            if lost is None:
                lost = await probe_wait(probe_s / 2, beats)
            stop.set()
            if beats is not None:
                await beats
            if lost is not None:  # the trial is not this worker's any more: stop, lease the next
                chaos.refused.append({"worker": worker_id, "trial_id": trial_id, "call": f"probe ({lost})"})
                continue
            result = fake_result(lease, rng)
            chaos.measurements[(trial_id, worker_id)] = result["throughput_samples_per_s"]
            path = f"/v1/trials/{trial_id}/complete"
            if mismatch is not None:
                config, what = mismatched_config(lease["config"], mismatch)
                mismatches_sent += 1
                # retried until answered, outages included: every mismatched complete gets its verdict
                r = await call(client, "complete_mismatch", path,
                               {"worker_id": worker_id, "result": {**result, "config": config}, **token},
                               MISMATCH_RETRY_S)
                chaos.mismatches.append({"trial_id": trial_id, "worker": worker_id, "kind": what, "config": config,
                                         "status": None if r is None else r.status_code})
            entry = {"trial_id": trial_id, "worker": worker_id,
                     "body": {"worker_id": worker_id, "result": result, **token}}
            if not await deliver(client, entry, COMPLETE_RETRY_S):
                spool.append(entry)
                chaos.spooled += 1
        # what still waits in the spool goes in, however late (a refusal then counts it discarded)
        while spool and (chaos.spool_deadline is None or time.monotonic() < chaos.spool_deadline):
            await deliver_spool(client, COMPLETE_RETRY_S)


def service_kill_plan(kills: int, n_trials: int, seed: int, down_range: tuple[float, float],
                      jitter_s: float) -> list[dict[str, Any]]:
    """When to kill -9 the service and for how long to leave it down, seeded: the k-th kill
    (k = 1..kills) once about k/(kills+1) of the trials are complete (± a quarter step), then
    after a further 0..jitter_s s (a moment within the calls in flight); down for a draw from
    down_range seconds before the restart."""
    rng = random.Random(seed * 7919 + 17)
    plan = []
    for k in range(kills):
        fraction = (k + 1 + rng.uniform(-0.25, 0.25)) / (kills + 1)
        plan.append({"after_completes": max(1, round(fraction * n_trials)),
                     "delay_s": round(rng.uniform(0, jitter_s), 3),
                     "down_s": round(rng.uniform(*down_range), 3)})
    return plan


async def drive_chaos(base_url: str, study: str, tokens: dict[str, str], args: argparse.Namespace,
                      chaos: Chaos, service_kills: list[dict[str, Any]] | None = None,
                      restart: Callable[[int, float], dict[str, Any]] | None = None) -> bool:
    """Run args.workers slots of simulated workers until the study is finished (True) or
    args.timeout_s passes (False). With `service_kills` (`service_kill_plan`) the service is
    killed and restarted by `restart(k, down_s)` (blocking: run on a thread) at each planned
    moment; its records go to chaos.restarts."""
    import httpx

    done = asyncio.Event()
    tasks: set[asyncio.Task[None]] = set()
    headers = bearer(tokens, "worker")

    def spawn(slot: int, generation: int) -> None:
        rng = random.Random(args.seed * 1_000_003 + slot * 1009 + generation)
        task = asyncio.create_task(chaos_worker(slot, generation, base_url, headers, chaos, rng, args, done, spawn))
        tasks.add(task)

    async def killer() -> None:
        assert restart is not None
        for k, step in enumerate(service_kills or []):
            while len(chaos.done_times) < step["after_completes"]:
                if done.is_set():
                    return
                await asyncio.sleep(0.05)
            await asyncio.sleep(step["delay_s"])
            if done.is_set():
                return
            chaos.restarts.append({**await asyncio.to_thread(restart, k, step["down_s"]), "plan": step})

    for slot in range(args.workers):
        spawn(slot, 0)
    killing = asyncio.create_task(killer()) if service_kills else None
    deadline = time.monotonic() + args.timeout_s
    finished = False
    async with httpx.AsyncClient(base_url=base_url, timeout=60.0, verify=False) as client:
        while time.monotonic() < deadline:
            await asyncio.sleep(1.0)
            if killing is not None and killing.done() and killing.exception() is not None:
                break  # a restart failed: the run cannot go on
            with contextlib.suppress(httpx.HTTPError, ValueError):
                info = (await client.get(f"/v1/studies/{study}")).json()
                if info.get("state") == "finished":
                    finished = True
                    break
    chaos.spool_deadline = time.monotonic() + 60.0
    done.set()
    await asyncio.gather(*tasks)
    if killing is not None:
        await killing  # raises what a failed restart raised
    return finished


def db_rows(db_url: str, study: str) -> dict[str, Any]:
    """The study's trials (Optuna's tables) and leases (ours), read straight from PostgreSQL."""
    import psycopg

    with psycopg.connect(pg_psycopg_url(db_url), autocommit=True) as conn:
        trials = conn.execute(
            "SELECT t.trial_id, t.number, t.state::text FROM trials t JOIN studies s ON s.study_id = t.study_id "
            "WHERE s.study_name = %s ORDER BY t.number", (study,)).fetchall()
        attrs = conn.execute(
            "SELECT a.trial_id, a.key, a.value_json FROM trial_user_attributes a JOIN trials t "
            "ON t.trial_id = a.trial_id JOIN studies s ON s.study_id = t.study_id WHERE s.study_name = %s AND a.key "
            "IN ('retry_of', 'attempt', 'failure_kind', 'failure_message', 'role', 'worker_id', 'remeasure_of', "
            "'config', 'measurement', 'is_baseline', 'repeat_of')",
            (study,)).fetchall()
        leases = conn.execute(
            "SELECT trial_id, trial_number, worker_id, state, outcome, leased_at, finished_at FROM autotune_leases "
            "WHERE study_name = %s", (study,)).fetchall()
        lease_rows_per_trial = conn.execute(
            "SELECT count(*) FROM (SELECT trial_id FROM autotune_leases WHERE study_name = %s GROUP BY trial_id "
            "HAVING count(*) > 1) d", (study,)).fetchone()
    by_id: dict[int, dict[str, Any]] = {tid: {"trial_id": tid, "number": n, "state": st, "attrs": {}}
                                        for tid, n, st in trials}
    for tid, key, value in attrs:
        by_id[tid]["attrs"][key] = json.loads(value)
    for t in by_id.values():  # the measured fields (throughput, ...) live in one attr: read beside the others
        measurement = t["attrs"].pop("measurement", None)  # as api/optuna_codec.py's flatten
        for key, value in (measurement if isinstance(measurement, dict) else {}).items():
            t["attrs"].setdefault(key, value)
    return {"trials": by_id, "leases": {r[0]: {"trial_id": r[0], "number": r[1], "worker": r[2], "state": r[3],
                                               "outcome": r[4], "leased_at": r[5], "finished_at": r[6]}
                                        for r in leases},
            "trials_with_two_lease_rows": int(lease_rows_per_trial[0]) if lease_rows_per_trial else -1}


def overlapping_lease_pairs(leases: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Pairs of one worker's leases that overlap in time (a worker holding two trials at once)."""
    by_worker: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for lease in leases:
        by_worker[lease["worker"]].append(lease)
    pairs = []
    for rows in by_worker.values():
        rows.sort(key=lambda r: r["leased_at"])
        for a, b in itertools.pairwise(rows):
            if a["finished_at"] is None or b["leased_at"] < a["finished_at"]:
                pairs.append((a, b))
    return pairs


def overlapping_leases(leases: list[dict[str, Any]]) -> int:
    """How many pairs of one worker's leases overlap in time (`overlapping_lease_pairs`)."""
    return len(overlapping_lease_pairs(leases))


def same_config(a: Any, b: Any) -> bool:
    """Two configs are one: the same keys, equal values (floats to 1e-12, relative)."""
    if not isinstance(a, dict) or not isinstance(b, dict) or set(a) != set(b):
        return False
    for k, va in a.items():
        vb = b[k]
        if isinstance(va, float) or isinstance(vb, float):
            if isinstance(va, bool) or isinstance(vb, bool) or not isinstance(va, (int, float)) \
                    or not isinstance(vb, (int, float)) or not math.isclose(va, vb, rel_tol=1e-12, abs_tol=0.0):
                return False
        elif va != vb or type(va) is not type(vb):
            return False
    return True


def config_checks(trials: dict[int, dict[str, Any]], lease_configs: dict[int, dict[str, Any]],
                  mismatches: list[dict[str, Any]]) -> dict[str, Any]:
    """Every stored trial's config (user attr "config") against the config its lease gave, and
    what the mismatched completes got: refused (4xx; by status), accepted (2xx: a product bug),
    unanswered; stored (a trial holding a mismatched complete's config: must be 0)."""
    differs = [{"trial_id": tid, "leased": cfg, "stored": trials[tid]["attrs"].get("config")}
               for tid, cfg in sorted(lease_configs.items())
               if tid in trials and not same_config(trials[tid]["attrs"].get("config"), cfg)]
    missing = sorted(tid for tid in lease_configs if tid not in trials)
    stored = [m for m in mismatches if m["trial_id"] in trials
              and same_config(trials[m["trial_id"]]["attrs"].get("config"), m["config"])]
    statuses = Counter(str(m["status"]) for m in mismatches)
    return {"configs_checked": len(lease_configs) - len(missing), "leased_trials_missing": len(missing),
            "stored_config_differs_from_lease": len(differs), "differs_examples": differs[:5],
            "mismatched_sent": len(mismatches),
            "mismatched_refused": sum(1 for m in mismatches if m["status"] is not None and 400 <= m["status"] < 500),
            "mismatched_accepted": sum(1 for m in mismatches if m["status"] is not None and m["status"] < 400),
            "mismatched_unanswered": sum(1 for m in mismatches if m["status"] is None),
            "mismatched_by_status": dict(sorted(statuses.items())),
            "mismatched_by_kind": dict(sorted(Counter(m["kind"] for m in mismatches).items())),
            "mismatched_stored": len(stored), "stored_examples": stored[:5]}


def discarded_measurements(trials: dict[int, dict[str, Any]],
                           measurements: dict[tuple[int, str], float]) -> list[dict[str, Any]]:
    """The measurements a worker made that the database does not hold: its trial is not
    COMPLETE, or completed by another worker, or with another throughput."""
    out = []
    for (tid, worker), throughput in sorted(measurements.items()):
        t = trials.get(tid)
        stored = t["attrs"].get("throughput_samples_per_s") if t is not None else None
        held = (t is not None and t["state"] == "COMPLETE" and t["attrs"].get("worker_id") == worker
                and isinstance(stored, (int, float)) and math.isclose(stored, throughput, rel_tol=1e-12))
        if not held:
            out.append({"trial_id": tid, "worker": worker, "throughput": throughput,
                        "state": t["state"] if t is not None else None,
                        "stored_worker": t["attrs"].get("worker_id") if t is not None else None})
    return out


def trial_role(t: dict[str, Any]) -> str:
    """A trial's role as the service reads it (api/study `role`): its "role" attr, else
    baseline when is_baseline, else search. A search trial whose service was killed between
    Optuna's ask and writing its attrs has none of them (baselines and re-measurements are
    created with theirs in one commit), and the service re-runs it as a search trial."""
    value = t["attrs"].get("role")
    if value in ("baseline", "search", "remeasure"):
        return str(value)
    return "baseline" if t["attrs"].get("is_baseline") else "search"


def kill_checks(db: dict[str, Any], chaos: Chaos, n_trials: int) -> dict[str, Any]:
    """Exactly-once and recovery checks from the database (see the --kills section of
    bench/README.md). A *slot* is one configuration: a first attempt and its chain of retries."""
    trials: dict[int, dict[str, Any]] = db["trials"]
    leases: dict[int, dict[str, Any]] = db["leases"]
    by_number = {t["number"]: t for t in trials.values()}

    def root(t: dict[str, Any]) -> int:
        seen = set()
        while isinstance(of := t["attrs"].get("retry_of"), int) and of in by_number and of not in seen:
            seen.add(of)
            t = by_number[of]
        return int(t["number"])

    slots: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for t in trials.values():
        slots[root(t)].append(t)
    retried = {t["attrs"]["retry_of"] for t in trials.values() if isinstance(t["attrs"].get("retry_of"), int)}
    complete_per_slot = {r: sum(t["state"] == "COMPLETE" for t in ts) for r, ts in slots.items()}
    lost = sorted(t["number"] for t in trials.values()
                  if t["state"] != "COMPLETE" and not (t["state"] == "FAIL" and t["number"] in retried))
    configs = [r for r in slots if trial_role(by_number[r]) in ("baseline", "search")]
    two_workers = {tid: ws for tid, ws in chaos.leases.items() if len(set(ws)) > 1}
    completed_twice = {tid: ws for tid, ws in chaos.completed.items() if len(set(ws)) > 1}
    # a trial the service created but never leased (killed in between): the reaper fails it as lost
    # after one grace from the restart, and a retry re-runs it
    never_leased = sorted(t["number"] for t in trials.values() if t["trial_id"] not in leases)
    # A lease the service committed whose answer never reached the worker (the service killed in
    # between) is an orphan: the worker, not knowing it, leases again, so its two lease rows
    # overlap until the reaper ends the orphan. Not a trial held twice; counted apart.
    seen = {(tid, w) for tid, ws in chaos.leases.items() for w in ws}
    orphans = sorted(tid for tid, x in leases.items() if (tid, x["worker"]) not in seen)
    pairs = overlapping_lease_pairs(list(leases.values()))
    overlaps = [(a["trial_id"], b["trial_id"], a["worker"]) for a, b in pairs
                if (a["trial_id"], a["worker"]) in seen and (b["trial_id"], b["worker"]) in seen]

    recoveries = []
    unrecovered = []
    for kill in chaos.kills:
        killed = trials.get(kill["trial_id"])
        lease = leases.get(kill["trial_id"])
        chain = sorted(slots[root(killed)], key=lambda x: x["number"]) if killed is not None else []
        winner = next((x for x in chain if x["state"] == "COMPLETE"), None)
        retry = next((x for x in chain if x["attrs"].get("retry_of") == kill["number"]), None)
        retry_lease = leases.get(retry["trial_id"]) if retry is not None else None
        ok = (killed is not None and killed["state"] == "FAIL" and killed["attrs"].get("failure_kind") == "lost"
              and lease is not None and lease["outcome"] == "lost" and lease["worker"] == kill["worker"]
              and winner is not None and winner["attrs"].get("worker_id") != kill["worker"] and retry is not None)
        if not ok:
            unrecovered.append({"kill": {k: v for k, v in kill.items() if k != "at"}, "trial": killed, "lease_outcome":
                                lease["outcome"] if lease else None})
            continue
        killed_at = datetime.fromtimestamp(kill["at"], timezone.utc).replace(tzinfo=None)
        winner_lease = leases[winner["trial_id"]]  # type: ignore[index]
        recoveries.append({
            "number": kill["number"], "role": kill["role"], "retry": retry["number"],  # type: ignore[index]
            "attempts": len(chain),
            "kill_to_reaped_s": round((lease["finished_at"] - killed_at).total_seconds(), 3)
            if lease is not None and lease["finished_at"] else None,
            "kill_to_retry_leased_s": round((retry_lease["leased_at"] - killed_at).total_seconds(), 3)
            if retry_lease else None,
            "kill_to_completed_s": round((winner_lease["finished_at"] - killed_at).total_seconds(), 3)
            if winner_lease and winner_lease["finished_at"] else None})
    discarded = discarded_measurements(trials, chaos.measurements)
    configs_check = config_checks(trials, chaos.lease_configs, chaos.mismatches)
    # a trial no worker ever got a lease answer for (an orphan, or never leased) has no leased
    # config to check; it must be one of those two and must not be COMPLETE (nobody ran it)
    unseen = [t for tid, t in trials.items() if tid not in chaos.lease_configs]
    explained = set(orphans) | {by_number[n]["trial_id"] for n in never_leased}
    configs_check["trials_no_worker_saw"] = len(unseen)
    configs_check["unseen_unexplained"] = sum(1 for t in unseen
                                              if t["trial_id"] not in explained or t["state"] == "COMPLETE")
    server_errors = {k: v for k, v in chaos.errors.items() if k.rsplit(":", 1)[-1].startswith("5")}
    checks = {
        "trials": len(trials), "configurations": len(configs), "n_trials": n_trials,
        "slots_without_a_complete_trial": sum(1 for c in complete_per_slot.values() if c == 0),
        "slots_completed_twice": sum(1 for c in complete_per_slot.values() if c > 1),
        "lost_trials": len(lost), "lost_examples": lost[:10],
        "trials_with_two_lease_rows": db["trials_with_two_lease_rows"],
        "trials_leased_to_two_workers": len(two_workers), "trials_completed_by_two_workers": len(completed_twice),
        "overlapping_leases_of_one_worker": len(overlaps), "overlap_examples": overlaps[:5],
        "orphan_leases": len(orphans), "orphan_lease_overlaps": len(pairs) - len(overlaps),
        "never_leased": len(never_leased),
        # a draw the service told REPEAT (PRUNED, repeat_of: never run) takes one configuration of the
        # budget; the space's float lr makes a real repeat all but impossible, so here it is counted lost
        "repeats": sum(1 for t in trials.values() if t["attrs"].get("repeat_of") is not None),
        "repeat_examples": [{"number": t["number"], "repeat_of": t["attrs"]["repeat_of"], "state": t["state"]}
                            for t in trials.values() if t["attrs"].get("repeat_of") is not None][:5],
        "never_leased_examples": [{"number": n, "state": by_number[n]["state"], "attrs": sorted(by_number[n]["attrs"])}
                                  for n in never_leased[:5]],
        "kills": len(chaos.kills), "kills_recovered": len(recoveries), "kills_unrecovered": len(unrecovered),
        "unrecovered_examples": unrecovered[:5],
        "retries": len(retried), "lost_leases": sum(1 for x in leases.values() if x["outcome"] == "lost"),
        "live_workers_refused": len(chaos.refused), "refused_examples": chaos.refused[:5],
        "still_active_leases": sum(1 for x in leases.values() if x["state"] == "active"),
        "measurements": len(chaos.measurements), "measurements_spooled": chaos.spooled,
        "measurements_still_spooled": sum(len(s) for s in chaos.spools.values()),
        "measurements_discarded": len(discarded), "discarded_examples": discarded[:5],
        "server_errors_5xx": sum(server_errors.values()),
        **configs_check,
    }
    # configurations lost: none of its attempts COMPLETE, or one of them failed and was never retried
    lost_slots = {r for r, c in complete_per_slot.items() if c == 0} | {root(by_number[n]) for n in lost}
    checks["lost"] = len(lost_slots)
    checks["duplicated"] = (checks["slots_completed_twice"] + max(0, checks["trials_with_two_lease_rows"])
                            + checks["trials_leased_to_two_workers"] + checks["trials_completed_by_two_workers"]
                            + checks["overlapping_leases_of_one_worker"])
    checks["ok"] = (checks["lost"] == 0 and checks["duplicated"] == 0 and checks["trials_with_two_lease_rows"] == 0
                    and checks["kills_unrecovered"] == 0 and len(configs) == n_trials
                    and checks["still_active_leases"] == 0 and checks["measurements_discarded"] == 0
                    and checks["stored_config_differs_from_lease"] == 0 and checks["leased_trials_missing"] == 0
                    and checks["unseen_unexplained"] == 0
                    and checks["mismatched_stored"] == 0 and checks["mismatched_accepted"] == 0
                    and checks["mismatched_unanswered"] == 0 and checks["server_errors_5xx"] == 0)
    return {"checks": checks, "recoveries": recoveries}


def first_after(times: list[float], t: float) -> float | None:
    return min((x for x in times if x >= t), default=None)


def service_recoveries(restarts: list[dict[str, Any]], lease_times: list[float],
                       done_times: list[float]) -> list[dict[str, Any]]:
    """Per kill -9 of the service: seconds from the restart (the new process started) and from
    ready (/v1/health answers) to the first successful lease and complete, and to the fleet's
    lease rate being back: the first lease after the restart from which the leases of the next
    THROUGHPUT_WINDOW_S reach THROUGHPUT_BACK of the rate over the PRE_KILL_WINDOW_S before the
    kill (None when it never is, or nothing was leased before the kill)."""
    leases = sorted(lease_times)
    out = []
    previous_ready = min(leases, default=0.0)
    for r in restarts:
        killed, restarted, ready = r["killed_at"], r["restarted_at"], r["ready_at"]
        since = max(killed - PRE_KILL_WINDOW_S, previous_ready)
        before = sum(1 for x in leases if since <= x < killed)
        rate_before = before / (killed - since) if killed > since else 0.0
        back = None
        if rate_before > 0:
            need = THROUGHPUT_BACK * rate_before * THROUGHPUT_WINDOW_S
            for x in (x for x in leases if x >= restarted):
                if sum(1 for y in leases if x <= y < x + THROUGHPUT_WINDOW_S) >= need:
                    back = x
                    break
        first_lease, first_done = first_after(leases, restarted), first_after(done_times, restarted)

        def after(t: float | None, since: float) -> float | None:
            return None if t is None else round(t - since, 3)

        out.append({"down_s": round(restarted - killed, 3), "start_s": round(ready - restarted, 3),
                    "restart_to_first_lease_s": after(first_lease, restarted),
                    "restart_to_first_complete_s": after(first_done, restarted),
                    "ready_to_first_lease_s": after(first_lease, ready),
                    "ready_to_first_complete_s": after(first_done, ready),
                    "lease_rate_before_per_s": round(rate_before, 2),
                    "restart_to_throughput_back_s": after(back, restarted)})
        previous_ready = ready
    return out


def run_kills(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """One --kills run on a fresh database of args.backends[0]; returns the JSON document's run."""

    backend = args.backends.split(",")[0]
    if backend != "postgresql":
        raise SystemExit("--kills reads its checks from PostgreSQL: use --backends postgresql")
    sampler = args.samplers.split(",")[0]
    workers, n_trials = int(args.workers), int(args.trials)
    args.workers = workers
    print(f"== kills: {backend}/{sampler}, {workers} workers, {n_trials} trials, kill rate {args.kill_rate}, "
          f"grace {args.grace_s} s, reaper {args.reaper_interval_s} s, heartbeat {args.heartbeat_s} s, "
          f"mismatch rate {args.mismatch_rate}, service kills {args.kill_service}", flush=True)
    env = {"AUTOTUNE_LEASE_GRACE_S": str(args.grace_s), "AUTOTUNE_REAPER_INTERVAL_S": str(args.reaper_interval_s)}
    study = f"kills-{sampler}-{workers}w"
    plan = service_kill_plan(args.kill_service, n_trials, args.seed, tuple(args.down_range), args.probe_range[1])
    with fresh_database(backend, workdir) as db_url:
        tokens = create_tokens(db_url)
        servers = [Server(db_url, args.server, workdir / "kills.log", env=env)]
        cpu = [0.0]
        chaos = Chaos()

        def restart(k: int, down_s: float) -> dict[str, Any]:
            """kill -9 the service's process group; after down_s, start it again on the same
            database and port; return when it answers /v1/health."""
            old = servers[-1]
            cpu[0] += (old.cpu_s() or 0.0) - (cpu0 if len(servers) == 1 else 0.0)
            os.killpg(old.proc.pid, signal.SIGKILL)
            killed_at = time.time()
            old.proc.wait(timeout=30)
            old.stop()  # closes its log (the process is gone)
            time.sleep(down_s)
            new = Server(db_url, args.server, workdir / f"kills-restart{k + 1}.log", env=env, port=old.port)
            restarted_at = time.time()
            servers.append(new)
            new.wait_ready(timeout=120)
            print(f"   service killed at {killed_at - t0:.1f} s, restarted after {restarted_at - killed_at:.1f} s, "
                  f"ready {time.time() - restarted_at:.1f} s later", flush=True)
            return {"killed_at": killed_at, "restarted_at": restarted_at, "ready_at": time.time(),
                    "completes_before": len(chaos.done_times)}

        try:
            servers[0].wait_ready()
            spec = {"name": study, "space": SPACE, "hardware": HARDWARE, "n_trials": n_trials, "sampler": sampler,
                    "seed": args.seed, "baseline": {"batch_size": 8, "accum_steps": 1},
                    "max_retries": args.max_retries}
            r = http().post(f"{servers[0].url}/v1/studies", json=spec, timeout=60, headers=bearer(tokens, "admin"))
            if r.status_code != 201:
                raise RuntimeError(f"creating the study failed: {r.status_code} {r.text}")
            cpu0 = servers[0].cpu_s() or 0.0
            t0 = time.time()
            finished = asyncio.run(drive_chaos(servers[0].url, study, tokens, args, chaos, plan, restart))
            wall = time.time() - t0
            cpu[0] += (servers[-1].cpu_s() or 0.0) - (cpu0 if len(servers) == 1 else 0.0)
            info = http().get(f"{servers[-1].url}/v1/studies/{study}", timeout=60).json()
        finally:
            servers[-1].stop()
        log = "\n".join(s.log_text() for s in servers)
        db = db_rows(db_url, study)
    judged = kill_checks(db, chaos, n_trials)
    checks = judged["checks"]
    checks["study_finished"] = finished
    checks["study_counts"] = info.get("counts")
    checks["study_retried"] = info.get("retried")
    checks["service_kills"] = len(chaos.restarts)
    checks["ok"] = checks["ok"] and finished and len(chaos.restarts) == args.kill_service
    recoveries = judged["recoveries"]
    reaped_s = [r["kill_to_reaped_s"] for r in recoveries if r["kill_to_reaped_s"] is not None]
    leased_s = [r["kill_to_retry_leased_s"] for r in recoveries if r["kill_to_retry_leased_s"] is not None]
    completed_s = [r["kill_to_completed_s"] for r in recoveries if r["kill_to_completed_s"] is not None]
    restarts = service_recoveries(chaos.restarts, chaos.lease_times, chaos.done_times)

    def over(key: str) -> dict[str, float | int | None]:
        return percentiles([x[key] for x in restarts if x[key] is not None])

    cpu_s = cpu[0]
    run = {
        "backend": backend, "sampler": sampler, "workers": workers, "n_trials": n_trials,
        "kill_rate": args.kill_rate, "probe_s": list(args.probe_range), "lease_grace_s": args.grace_s,
        "reaper_interval_s": args.reaper_interval_s, "max_retries": args.max_retries,
        "heartbeat_s": args.heartbeat_s, "mismatch_rate": args.mismatch_rate, "max_backoff_s": args.max_backoff_s,
        "service_kills_planned": plan, "service_down_s": list(args.down_range),
        "wall_s": round(wall, 1), "configs_per_s": round(n_trials / wall, 2) if wall > 0 else None,
        "workers_started": chaos.workers_started, "checks": checks,
        "counts": {k: checks[k] for k in ("lost", "duplicated", "measurements_discarded", "mismatched_sent",
                                          "mismatched_refused", "mismatched_stored")},
        "recovery_s": {"kill_to_reaped": percentiles(reaped_s), "kill_to_retry_leased": percentiles(leased_s),
                       "kill_to_completed": percentiles(completed_s)},
        "service_recovery_s": {k: over(k) for k in ("restart_to_first_lease_s", "restart_to_first_complete_s",
                                                    "ready_to_first_lease_s", "restart_to_throughput_back_s",
                                                    "start_s")},
        "service_restarts": [{**x, "killed_at_s": round(r["killed_at"] - t0, 3),
                              "ready_at_s": round(r["ready_at"] - t0, 3), "plan": r["plan"],
                              "completes_before": r["completes_before"]}
                             for x, r in zip(restarts, chaos.restarts, strict=True)],
        "latency_ms": {c: percentiles(chaos.latencies[c])
                       for c in ("lease", "lease_204", "report", "heartbeat", "complete", "complete_mismatch")},
        "heartbeats": {"answered": len(chaos.latencies["heartbeat"]),
                       "errors": sum(v for k, v in chaos.errors.items() if k.startswith("heartbeat:")),
                       "replies": dict(chaos.heartbeat_replies)},
        "errors": dict(sorted(chaos.errors.items())),
        "server": {"cpu_s": round(cpu_s, 1), "cpu_util": round(cpu_s / wall, 3) if wall > 0 else None,
                   "incarnations": len(servers),
                   "log_errors": sum(" ERROR " in line for line in log.splitlines()),
                   "log_tracebacks": log.count("Traceback"),
                   "log_lost_warnings": sum(" lost: " in line for line in log.splitlines())},
        "recoveries": recoveries,
        "kills": [{**k, "at_s": round(k["at"] - t0, 3)} for k in chaos.kills],
        "mismatches": [{k: v for k, v in m.items()} for m in chaos.mismatches],
        "completions_s": [round(t - t0, 3) for t in sorted(chaos.done_times)],
        "leases_s": [round(t - t0, 3) for t in sorted(chaos.lease_times)],
    }
    rec = run["recovery_s"]
    srec = run["service_recovery_s"]
    print(f"   {wall:.0f} s, {len(chaos.kills)} worker kills ({len(recoveries)} recovered), kill→retry leased p50 "
          f"{rec['kill_to_retry_leased']['p50']} s max {rec['kill_to_retry_leased']['max']} s; "
          f"{len(chaos.restarts)} service kills, restart→first lease max {srec['restart_to_first_lease_s']['max']} s; "
          f"lost {checks['lost']}, duplicated {checks['duplicated']}, discarded {checks['measurements_discarded']}, "
          f"mismatched {checks['mismatched_sent']} sent / {checks['mismatched_refused']} refused / "
          f"{checks['mismatched_stored']} stored; heartbeats {run['heartbeats']}; "
          f"checks {'ok' if checks['ok'] else 'FAILED'}", flush=True)
    return run


def plot_kills(run: dict[str, Any], path: Path) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    done = run["completions_s"]
    axes[0].plot(done, range(1, len(done) + 1), lw=1.2, label="completed trials")
    for i, k in enumerate(run["kills"]):
        axes[0].axvline(k["at_s"], color="#e76f51", lw=0.6, alpha=0.6, label="worker killed" if i == 0 else None)
    for i, r in enumerate(run.get("service_restarts", [])):
        axes[0].axvspan(r["killed_at_s"], r["ready_at_s"], color="#264653", alpha=0.25,
                        label="service killed → ready again" if i == 0 else None)
    title = f"{run['n_trials']} trials, {run['workers']} workers, {len(run['kills'])} worker kills"
    if run.get("service_restarts"):
        title += f", {len(run['service_restarts'])} service kills"
    axes[0].set(xlabel="time (s)", ylabel="completed trials", title=title)
    axes[0].legend(fontsize=8)
    if not run["recoveries"] and run.get("service_restarts"):  # no worker killed: each restart's recovery
        restarts = run["service_restarts"]
        keys = (("restart_to_first_lease_s", "restart → first lease"),
                ("restart_to_first_complete_s", "restart → first complete"),
                ("restart_to_throughput_back_s", f"restart → lease rate back ({THROUGHPUT_BACK:.0%})"))
        width = 0.8 / len(keys)
        for j, (key, label) in enumerate(keys):
            axes[1].bar([i + j * width for i in range(len(restarts))], [r[key] or 0.0 for r in restarts], width,
                        label=label)
        axes[1].set_xticks([i + width for i in range(len(restarts))],
                           [f"kill {i + 1} (down {r['down_s']:.1f} s)" for i, r in enumerate(restarts)])
        axes[1].set(ylabel="seconds after the restart", title="recovery from each kill -9 of the service")
        axes[1].legend(fontsize=8)
    else:
        plot_worker_recoveries(axes[1], run)
    for ax in axes:
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"autotune service under kills ({run['backend']}, {run['sampler']} sampler, "
                 f"{environment_cache.get('cpu_count')} CPUs)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_worker_recoveries(ax: Any, run: dict[str, Any]) -> None:
    """Histograms of kill → reaped, → retry leased, → retry completed over the killed workers' trials."""
    reaped = [r["kill_to_reaped_s"] for r in run["recoveries"] if r.get("kill_to_reaped_s") is not None]
    leased = [r["kill_to_retry_leased_s"] for r in run["recoveries"] if r["kill_to_retry_leased_s"] is not None]
    completed = [r["kill_to_completed_s"] for r in run["recoveries"] if r["kill_to_completed_s"] is not None]
    top = max([*reaped, *leased, *completed, run["lease_grace_s"] + run["reaper_interval_s"]]) + 1
    bins = [i * top / 40 for i in range(41)]
    ax.hist(reaped, bins=bins, alpha=0.6, label="kill → trial failed as lost (reaped)")
    ax.hist(leased, bins=bins, alpha=0.6, label="kill → retry leased")
    ax.hist(completed, bins=bins, alpha=0.5, label="kill → retry completed")
    ax.axvline(run["lease_grace_s"], color="grey", ls=":", label=f"lease grace {run['lease_grace_s']:g} s")
    ax.set(xlabel="seconds after the kill", ylabel="killed trials", title="recovery of each killed worker's trial")
    ax.legend(fontsize=8)


def kills_tables(run: dict[str, Any]) -> str:
    """The markdown rows of one --kills run (bench/README.md's tables)."""
    c = run["checks"]
    rec, srec, lat = run["recovery_s"], run["service_recovery_s"], run["latency_ms"]

    def pair(d: dict[str, Any], a: str = "p50", b: str = "max") -> str:
        return f"{fmt(d[a])} / {fmt(d[b])}"

    hb = run["heartbeats"]
    lines = [
        "| backend | workers | trials | grace / reaper s | worker kills | recovered | kill → retry leased p50 / p90 / "
        "max s | service kills | restart → first lease / complete, max s | restart → lease rate back, max s | "
        "lost | duplicated | discarded | mismatched sent / refused / stored | heartbeats (errors) · p50 / p99 ms | "
        "wall s |",
        "|---|---:|---:|---|---:|---:|---|---:|---|---|---:|---:|---:|---|---|---:|",
        f"| {run['backend']} | {run['workers']} | {c['configurations']}/{run['n_trials']} | "
        f"{run['lease_grace_s']:g} / {run['reaper_interval_s']:g} | {c['kills']} | {c['kills_recovered']} | "
        f"{fmt(rec['kill_to_retry_leased']['p50'])} / {fmt(rec['kill_to_retry_leased']['p90'])} / "
        f"{fmt(rec['kill_to_retry_leased']['max'])} | {c['service_kills']} | "
        f"{fmt(srec['restart_to_first_lease_s']['max'])} / {fmt(srec['restart_to_first_complete_s']['max'])} | "
        f"{fmt(srec['restart_to_throughput_back_s']['max'])} | {c['lost']} | {c['duplicated']} | "
        f"{c['measurements_discarded']} | {c['mismatched_sent']} / {c['mismatched_refused']} / "
        f"{c['mismatched_stored']} | {hb['answered']} ({hb['errors']}) · {pair(lat['heartbeat'], 'p50', 'p99')} | "
        f"{run['wall_s']} |"]
    if run["service_restarts"]:
        lines += ["", "| service kill | at s | down s | start s | restart → first lease s | → first complete s | "
                      "→ lease rate back s | lease rate before /s |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for i, r in enumerate(run["service_restarts"], 1):
            lines.append(f"| {i} | {r['killed_at_s']:.1f} | {r['down_s']:.1f} | {r['start_s']:.1f} | "
                         f"{fmt(r['restart_to_first_lease_s'], '.2f')} | {fmt(r['restart_to_first_complete_s'], '.2f')}"
                         f" | {fmt(r['restart_to_throughput_back_s'], '.2f')} | {r['lease_rate_before_per_s']} |")
    return "\n".join(lines)


def main_kills(args: argparse.Namespace, png: Path) -> int:
    env = environment()
    environment_cache.update(env)
    with tempfile.TemporaryDirectory(prefix="autotune-bench-") as tmp:
        run = run_kills(args, Path(tmp))
        if args.keep_logs:
            args.keep_logs.mkdir(parents=True, exist_ok=True)
            for log in Path(tmp).glob("*.log"):
                (args.keep_logs / log.name).write_bytes(log.read_bytes())
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    doc: dict[str, Any] = {"environment": env, "settings": settings, "run": run}
    if args.append and args.out.exists():  # one more run in the same document: "runs", each with its settings
        old = json.loads(args.out.read_text())
        earlier = old.get("runs") or [{"label": old["settings"].get("label"), "settings": old["settings"],
                                       "run": old["run"]}]
        doc = {"environment": env, "runs": [*earlier, {"label": args.label, "settings": settings, "run": run}]}
    elif args.append:
        doc = {"environment": env, "runs": [{"label": args.label, "settings": settings, "run": run}]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    plot_kills(run, png)
    c = run["checks"]
    print("\n" + kills_tables(run))
    print(f"\nwrote {args.out} and {png}; checks {'ok' if c['ok'] else 'FAILED'}")
    return 0 if c["ok"] else 1


# --- the instrumented server (--server instrumented) -------------------------------------------

_REQUEST: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("bench_request", default=None)
_PROFILE_LOCK = threading.Lock()
_RECORDS: list[dict[str, Any]] = []
_THREAD = threading.local()


def _current() -> dict[str, Any] | None:
    """The record of the service call running on this thread (the request's, or the reaper's)."""
    return getattr(_THREAD, "record", None) or _REQUEST.get()


def _add(key: str, dt: float) -> None:
    record = _current()
    if record is not None:
        parts = record.setdefault("parts", {})
        parts[key] = parts.get(key, 0.0) + dt
        counts = record.setdefault("counts", {})
        counts[key] = counts.get(key, 0) + 1


def _timed(key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            _add(key, time.perf_counter() - t0)

    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


class _TimedRLock:
    """A service lock (the per-study locks), timing the outermost acquire (wait) and the time it is held."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._local = threading.local()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        t0 = time.perf_counter()
        got = self._lock.acquire(blocking, timeout)
        if got:
            depth = getattr(self._local, "depth", 0)
            if depth == 0:
                now = time.perf_counter()
                _add("lock_wait", now - t0)
                self._local.since = now
            self._local.depth = depth + 1
        return got

    def release(self) -> None:
        self._local.depth -= 1
        if self._local.depth == 0:
            _add("lock_held", time.perf_counter() - self._local.since)
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _instrument_engine(engine: Any, name: str) -> None:
    from sqlalchemy import event

    @event.listens_for(engine, "before_cursor_execute")
    def _before(conn: Any, *_a: Any) -> None:
        conn.info.setdefault("bench_t0", []).append(time.perf_counter())

    @event.listens_for(engine, "after_cursor_execute")
    def _after(conn: Any, *_a: Any) -> None:
        _add(f"sql.{name}", time.perf_counter() - conn.info["bench_t0"].pop())

    dialect = engine.dialect
    dialect.do_commit = _timed(f"commit.{name}", dialect.do_commit)
    dialect.do_rollback = _timed(f"rollback.{name}", dialect.do_rollback)
    dialect.do_ping = _timed(f"ping.{name}", dialect.do_ping)  # pool_pre_ping: one round trip per checkout


def serve_instrumented(db_url: str, port: int) -> None:
    """`api.main.run_server` with timers around the service's parts; GET /bench/profile returns
    (and clears) one record per service call: {op, t_app, parts: {component: seconds}}."""
    sys.path.insert(0, str(ROOT))
    import optuna
    from optuna.storages import RDBStorage

    import autotune.api.main
    import autotune.api.optuna_bridge
    from autotune.api import service as service_module

    svc = service_module.TuningService
    original_init = svc.__init__

    def init(self: Any, settings: Any) -> None:
        original_init(self, settings)
        self.lock = _TimedRLock()
        self.lock_factory = _TimedRLock  # the per-study locks (lease, complete, reaper)
        _instrument_engine(self.db.engine, "service")
        _instrument_engine(self.bridge.storage.engine, "optuna")

    svc.__init__ = init  # type: ignore[method-assign]
    for op in ("lease_trial", "report", "complete", "heartbeat"):
        setattr(svc, op, _timed(f"service.{op}", getattr(svc, op)))
    original_reap = svc.reap_stale

    def reap_stale(self: Any, now: Any = None) -> Any:
        _THREAD.record = record = {"op": "reap", "t_app": 0.0}
        t0 = time.perf_counter()
        try:
            return original_reap(self, now)
        finally:
            record["t_app"] = time.perf_counter() - t0
            _THREAD.record = None
            with _PROFILE_LOCK:
                _RECORDS.append(record)

    svc.reap_stale = reap_stale  # type: ignore[method-assign]
    bridge = autotune.api.optuna_bridge.OptunaBridge
    for name in ("ask", "tell", "finish", "get_trial", "trials", "n_trials", "max_trials", "set_user_attrs"):
        setattr(bridge, name, _timed(f"bridge.{name}", getattr(bridge, name)))
    autotune.api.optuna_bridge.suggest = _timed("space.suggest", autotune.api.optuna_bridge.suggest)
    optuna.study.Study.ask = _timed("optuna.study_ask", optuna.study.Study.ask)  # type: ignore[method-assign]
    for cls in (optuna.samplers.TPESampler, optuna.samplers.RandomSampler):
        for name in ("infer_relative_search_space", "sample_relative", "sample_independent", "before_trial",
                     "after_trial"):
            setattr(cls, name, _timed("optuna.sampler", getattr(cls, name)))
    for name in ("create_new_trial", "set_trial_param", "set_trial_user_attr", "set_trial_state_values",
                 "get_all_trials", "get_trial", "get_n_trials"):
        setattr(RDBStorage, name, _timed(f"rdb.{name}", getattr(RDBStorage, name)))

    original_create_app = autotune.api.main.create_app
    ops = {"/v1/trials/lease": "lease"}

    def create_app(settings: Any = None) -> Any:
        app = original_create_app(settings)

        async def timed_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            path = scope["path"]
            if path == "/bench/profile":
                with _PROFILE_LOCK:
                    body = json.dumps(_RECORDS).encode()
                    _RECORDS.clear()
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"application/json")]})
                await send({"type": "http.response.body", "body": body})
                return
            op = ops.get(path) or path.rsplit("/", 1)[-1]
            record: dict[str, Any] = {"op": op}
            token = _REQUEST.set(record)
            t0 = time.perf_counter()
            try:
                await app(scope, receive, send)
            finally:
                record["t_app"] = time.perf_counter() - t0
                _REQUEST.reset(token)
                if op in ("lease", "report", "complete", "heartbeat"):
                    with _PROFILE_LOCK:
                        _RECORDS.append(record)

        return timed_app

    autotune.api.main.create_app = create_app  # type: ignore[assignment]
    autotune.api.main.run_server(db_url, "127.0.0.1", port)


PROFILE_PARTS = ("t_app", "outside_service", "lock_wait", "lock_held", "optuna.study_ask", "optuna.sampler",
                 "space.suggest", "bridge.ask", "bridge.n_trials", "bridge.set_user_attrs", "bridge.get_trial",
                 "bridge.tell", "bridge.finish", "bridge.trials", "sql.optuna", "commit.optuna", "sql.service",
                 "commit.service",
                 "rollback.service", "rollback.optuna", "ping.service", "ping.optuna", "rdb.get_all_trials",
                 "rdb.create_new_trial", "db_total", "python_under_lock")
DB_PARTS = ("sql.optuna", "commit.optuna", "rollback.optuna", "ping.optuna", "sql.service", "commit.service",
            "rollback.service", "ping.service")


def _part(r: dict[str, Any], key: str) -> float:
    """Seconds of component `key` in profile record `r` (a few are derived)."""
    parts = r.get("parts", {})
    if key == "t_app":
        return float(r["t_app"])
    if key == "outside_service":  # parsing, validation, threadpool wait, response: ASGI time outside the method
        service = next((v for k, v in parts.items() if k.startswith("service.")), None)
        return float(r["t_app"]) - float(service) if service is not None else 0.0
    if key == "db_total":  # time spent waiting on the database driver (statements, commits, pings)
        return sum(float(parts.get(k, 0.0)) for k in DB_PARTS)
    if key == "python_under_lock":  # lock held minus the database time: Python (ORM, Optuna, pydantic)
        return _part(r, "lock_held") - _part(r, "db_total")
    return float(parts.get(key, 0.0))


def profile_summary(records: list[dict[str, Any]], n_trials: int) -> dict[str, Any]:
    """Per op: mean and p99 ms of each component, and the mean per quarter of the run (growth)."""
    import numpy as np

    out: dict[str, Any] = {}
    for op in ("lease", "report", "complete", "reap"):
        recs = [r for r in records if r["op"] == op]
        if not recs:
            continue

        keys = [k for k in PROFILE_PARTS if any(_part(r, k) for r in recs)]
        summary: dict[str, Any] = {"n": len(recs)}
        for k in keys:
            ms = np.array([_part(r, k) * 1e3 for r in recs])
            summary[k] = {"mean": round(float(ms.mean()), 3), "p50": round(float(np.percentile(ms, 50)), 3),
                          "p99": round(float(np.percentile(ms, 99)), 3)}
        quarters = np.array_split(np.arange(len(recs)), 4) if len(recs) >= 4 else []
        summary["by_quarter_mean_ms"] = {
            k: [round(float(np.mean([_part(recs[i], k) for i in q])) * 1e3, 3) for q in quarters]
            for k in ("t_app", "lock_wait", "lock_held", "optuna.sampler", "db_total", "python_under_lock")
            if k in keys}
        summary["sql_statements_mean"] = {
            k: round(float(np.mean([r.get("counts", {}).get(k, 0) for r in recs])), 2)
            for k in ("sql.optuna", "sql.service", "commit.optuna", "commit.service")}
        out[op] = summary
    return out


# --- environment, outputs --------------------------------------------------------------------------

def environment() -> dict[str, Any]:
    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    def git(*a: str) -> str | None:
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
            "platform": platform.platform(), "cpu_count": os.cpu_count(), "python": sys.version.split()[0],
            "packages": {d: version(d) for d in ("optuna", "sqlalchemy", "fastapi", "uvicorn", "starlette",
                                                 "pydantic", "httpx", "psycopg", "numpy")},
            "sqlite": __import__("sqlite3").sqlite_version, "postgres_server": pg_server_version(),
            "git_commit": git("rev-parse", "HEAD"), "git_dirty": bool(git("status", "--porcelain", "--", "api"))}


def fmt(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def markdown_table(runs: list[dict[str, Any]]) -> str:
    head = ("| backend | sampler | workers | trials | trials/s | lease p50/p99 ms | report p50/p99 ms | "
            "complete p50/p99 ms | round trip p50/p99 ms | server CPU | errors | db locked (resp/log) | dup leases | "
            "lost |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in runs:
        lat = r["latency_ms"]
        pair = {c: f"{fmt(lat[c]['p50'])} / {fmt(lat[c]['p99'])}" for c in CALLS}
        errors = ", ".join(f"{k}×{v}" for k, v in r["errors"].items()) or "0"
        c = r["checks"]
        lines.append(f"| {r['backend']} | {r['sampler']} | {r['workers']} | {c['completed']}/{r['n_trials']} | "
                     f"{fmt(r['trials_per_s'])} | {pair['lease']} | {pair['report']} | {pair['complete']} | "
                     f"{pair['round_trip']} | {fmt(r['cpu_util']['server'], '.2f')} | {errors} | "
                     f"{r['database_locked']['responses']}/{r['database_locked']['server_log']} | "
                     f"{c['duplicate_leases']} | "
                     f"{c['lost'] + c['not_complete_in_study']} |")
    return "\n".join(lines)


def targets(runs: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in runs:
        if r["backend"] == "postgresql" and r["workers"] == 64:
            # the target is per call (lease, report, complete); the round trip is three calls
            p99 = r["latency_ms"]["round_trip"]["p99"]
            worst_call, worst = max(((c, r["latency_ms"][c]["p99"] or 0.0) for c in CALLS[:3]), key=lambda x: x[1])
            load = f"paced ({r['probe_ms']:.0f} ms probes)" if r["probe_ms"] else "back-to-back"
            out.append(f"PostgreSQL/{r['sampler']} at 64 workers, {load}: worst call p99 {fmt(worst)} ms "
                       f"({worst_call}) → per-call target p99 < 50 ms {'MET' if worst < 50 else 'MISSED'}; "
                       f"round-trip p99 {fmt(p99)} ms")
        if r["backend"] == "sqlite" and r["workers"] == 16:
            locked = r["database_locked"]
            n = locked["responses"] + locked["server_log"]
            out.append(f"SQLite/{r['sampler']} at 16 workers: 'database is locked' {n} times "
                       f"→ target {'MET' if n == 0 else 'MISSED'}")
    return out


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    from matplotlib.ticker import ScalarFormatter

    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    series: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        series[(r["backend"], r["sampler"])].append(r)
    for (backend, sampler), rs in sorted(series.items()):
        rs = sorted(rs, key=lambda r: r["workers"])
        style = "-" if backend == "postgresql" else "--"
        marker = "o" if sampler == "tpe" else "s"
        label = f"{backend} / {sampler}"
        xs = [r["workers"] for r in rs]
        axes[0].plot(xs, [r["latency_ms"]["round_trip"]["p99"] for r in rs], style, marker=marker, label=label)
        axes[1].plot(xs, [r["trials_per_s"] for r in rs], style, marker=marker, label=label)
        solo = min(rs, key=lambda r: r["workers"])  # the fewest workers: least queueing, closest to service time
        lease = [(t["number"], t["lease_ms"]) for t in solo["trials"]]
        if lease:
            import numpy as np

            lease.sort()
            n = np.array([x for x, _ in lease])
            ms = np.array([y for _, y in lease])
            k = max(1, len(ms) // 25)
            axes[2].plot(n[k - 1:] if k > 1 else n, np.convolve(ms, np.ones(k) / k, mode="valid"), style,
                         label=f"{label} ({solo['workers']} w)")
    axes[0].axhline(50, color="grey", lw=0.8, ls=":", label="target p99 50 ms")
    axes[0].set(xscale="log", yscale="log", xlabel="concurrent workers", ylabel="p99 lease→complete round trip (ms)",
                title="p99 round trip")
    axes[1].set(xscale="log", xlabel="concurrent workers", ylabel="completed trials / s", title="throughput")
    axes[2].set(yscale="log", xlabel="trial number", ylabel="lease latency (ms, running mean)",
                title="lease latency vs trial number (fewest workers)")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes[:2]:
        ax.set_xticks(sorted({r["workers"] for r in runs}))
        ax.get_xaxis().set_major_formatter(ScalarFormatter())
    cpu = environment_cache.get("cpu_count")
    probe = {r["probe_ms"] for r in runs}
    think = "zero think time" if probe == {0.0} else f"simulated probe {', '.join(f'{p:.0f}' for p in probe)} ms"
    fig.suptitle(f"autotune service load: fake workers over HTTP ({cpu} CPUs, {think})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


environment_cache: dict[str, Any] = {}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_serve-instrumented"]:
        serve_instrumented(argv[1], int(argv[2]))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default=None, help="comma-separated: sqlite, postgresql (default: both; "
                                                    "--kills: postgresql)")
    p.add_argument("--samplers", default=None, help="comma-separated samplers (default: random,tpe; --kills: random)")
    p.add_argument("--workers", default=None, help="comma-separated worker counts (default: 1,16,64; --kills: 64)")
    p.add_argument("--trials", default=None,
                   help="trials per worker count (one value, or one per count; default 100,250,500, which keeps "
                        "the whole run (2 backends × 2 samplers × 3 levels) under ~5 min on 2 cores; --kills: 2000)")
    kills = p.add_argument_group("crash recovery under load (--kills)")
    kills.add_argument("--kills", action="store_true",
                       help="one run of --workers simulated workers that die at random mid-probe (never calling "
                            "again; a replacement with a new worker id starts), checked from the database: no "
                            "duplicate lease, no lost trial, every killed worker's trial retried and completed")
    kills.add_argument("--kill-rate", type=float, default=0.02, help="probability that a worker dies during a trial")
    kills.add_argument("--probe-range", type=float, nargs=2, default=(0.2, 0.6), metavar=("MIN_S", "MAX_S"),
                       help="simulated probe time, uniform (seconds)")
    kills.add_argument("--grace-s", type=float, default=5.0, help="the service's lease grace (AUTOTUNE_LEASE_GRACE_S)")
    kills.add_argument("--reaper-interval-s", type=float, default=1.0, help="AUTOTUNE_REAPER_INTERVAL_S")
    kills.add_argument("--max-retries", type=int, default=5, help="the study's max_retries")
    kills.add_argument("--timeout-s", type=float, default=1800.0, help="give up when the study is not finished by then")
    kills.add_argument("--mismatch-rate", type=float, default=None,
                       help="probability per trial that a worker first completes with a config other than the "
                            "leased one (it must be refused; then the right one goes in); above 0, every baseline "
                            "lease is also mismatched (preset-left lr). Default: 0.05 with --kills, else 0")
    kills.add_argument("--kill-service", type=int, default=0, metavar="N",
                       help="kill -9 the service's process group N times at seeded moments and restart it on the "
                            "same database and port (default 0)")
    kills.add_argument("--down-range", type=float, nargs=2, default=(1.0, 3.0), metavar=("MIN_S", "MAX_S"),
                       help="how long the killed service stays down before its restart, uniform (seconds)")
    kills.add_argument("--max-backoff-s", type=float, default=10.0,
                       help="the workers' retry backoff cap (the real worker's: 10 s)")
    kills.add_argument("--append", action="store_true",
                       help="add this run to --out's document (a list \"runs\", each with its settings and --label)")
    kills.add_argument("--label", default=None, help="the run's name in an --append document")
    p.add_argument("--probe-ms", type=float, default=0.0, help="simulated probe time between lease and report")
    p.add_argument("--heartbeat-s", type=float, default=None,
                   help="heartbeat interval while a trial is probed (0: none). Default: 5 s, the worker's default "
                        "(with --probe-ms > 0); --kills: min(5, --grace-s / 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server", choices=("cli", "instrumented"), default="cli",
                   help="cli: `python -m autotune.cli serve`; instrumented: the same service with timers")
    p.add_argument("--out", type=Path, default=None,
                   help=f"default: {RESULTS / 'service_load.json'}; --kills: {KILLS_OUT}")
    p.add_argument("--png", type=Path, default=None, help="default: --out with .png")
    p.add_argument("--keep-logs", type=Path, default=None, help="copy the server logs into this directory")
    args = p.parse_args(argv)
    mode_defaults = ({"backends": "postgresql", "samplers": "random", "workers": "64", "trials": "2000",
                      "out": KILLS_OUT} if args.kills else
                     {"backends": "sqlite,postgresql", "samplers": "random,tpe", "workers": "1,16,64",
                      "trials": "100,250,500", "out": RESULTS / "service_load.json"})
    for key, value in mode_defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.heartbeat_s is None:
        args.heartbeat_s = min(5.0, args.grace_s / 4) if args.kills else 5.0
    if args.mismatch_rate is None:
        args.mismatch_rate = 0.05 if args.kills else 0.0
    if args.kills:
        return main_kills(args, args.png or args.out.with_suffix(".png"))
    backends = [b for b in args.backends.split(",") if b]
    samplers = [s for s in args.samplers.split(",") if s]
    levels = [int(w) for w in args.workers.split(",")]
    trials = [int(t) for t in args.trials.split(",")]
    if len(trials) == 1:
        trials *= len(levels)
    if len(trials) != len(levels):
        p.error("--trials needs one value or one per --workers value")
    png = args.png or args.out.with_suffix(".png")

    env = environment()
    environment_cache.update(env)
    print(f"environment: {json.dumps({k: env[k] for k in ('cpu_count', 'python', 'packages', 'postgres_server')})}")
    runs = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="autotune-bench-") as tmp:
        workdir = Path(tmp)
        for backend in backends:
            for sampler in samplers:
                for workers, n in zip(levels, trials, strict=True):
                    runs.append(run_level(backend, sampler, workers, n, args, workdir))
        if args.keep_logs:
            args.keep_logs.mkdir(parents=True, exist_ok=True)
            for log in workdir.glob("*.log"):
                (args.keep_logs / log.name).write_bytes(log.read_bytes())
    total = time.perf_counter() - started
    doc = {"environment": env, "settings": {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                                            "space": SPACE, "hardware": HARDWARE, "total_s": round(total, 1)},
           "targets": targets(runs), "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    plot(runs, png)
    print()
    print(markdown_table(runs))
    print()
    for line in doc["targets"]:
        print(f"- {line}")
    failed = [f"{r['backend']}/{r['sampler']}/{r['workers']} workers" for r in runs if not r["checks"]["ok"]]
    print(f"\nwrote {args.out} and {png} ({total:.0f} s); checks "
          + (f"FAILED in {', '.join(failed)} (see their checks in the JSON)" if failed else "ok"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
