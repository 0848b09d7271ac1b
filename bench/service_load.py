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
import json
import os
import platform
import random
import signal
import socket
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

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PG_ADMIN_URL = os.environ.get("AUTOTUNE_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
LOCKED = "database is locked"
HARDWARE = "bench"
SPACE: dict[str, Any] = {"params": {"batch_size": {"choices": [4, 8, 16, 32]}, "accum_steps": {"choices": [1, 2]}}}
CALLS = ("lease", "report", "complete", "round_trip")


# --- the service under test ----------------------------------------------------------------------

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` (Linux /proc), None when unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


class Server:
    """The service in its own process (own session), its log in a file."""

    def __init__(self, db_url: str, mode: str, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        if mode == "cli":
            cmd = [sys.executable, "-m", "autotune.cli", "serve", "--db", db_url, "--port", str(self.port)]
        else:
            cmd = [sys.executable, str(Path(__file__).resolve()), "_serve-instrumented", db_url, str(self.port)]
        self._log = log_path.open("wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 60.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the service exited ({self.proc.returncode}):\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/v1/health", timeout=2).status_code == 200:
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
            settings = dict(conn.execute("SELECT name, setting FROM pg_settings WHERE name IN "
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


def fake_result(lease: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """A ProbeResult.to_dict() as a worker would send it, without running anything."""
    return {"workload": lease["workload"], "preset": lease["preset"], "config": lease["config"], "device": "cpu",
            "torch_version": "bench", "throughput_samples_per_s": rng.uniform(50.0, 500.0),
            "val_nrmse": rng.uniform(0.05, 0.2), "failure": None, "stopped_early": False}


async def run_worker(index: int, base_url: str, level: Level, rng: random.Random, probe_s: float,
                     max_errors: int = 50) -> None:
    import httpx

    worker_id = f"bench-w{index:03d}"

    async def post(client: httpx.AsyncClient, call: str, path: str, body: dict[str, Any]) -> httpx.Response | None:
        t0 = time.perf_counter()
        try:
            response = await client.post(path, json=body)
        except httpx.HTTPError as e:
            level.errors[f"{call}:{type(e).__name__}"] += 1
            return None
        # a 204 (nothing left to lease) does no sampling: kept apart so it does not flatter lease latency
        level.latencies["lease_204" if call == "lease" and response.status_code == 204 else call].append(
            (time.perf_counter() - t0) * 1e3)
        if response.status_code >= 400:
            level.errors[f"{call}:{response.status_code}"] += 1
            if LOCKED in response.text:
                level.locked_in_responses += 1
        return response

    consecutive = 0
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    # verify=False: plain HTTP, no TLS; the default client loads the CA bundle, ~18 ms of CPU that
    # blocks the event loop all 64 workers share (with staggered starts it inflated the latencies
    # of whatever calls were in flight). The client is made before the staggered start.
    async with httpx.AsyncClient(base_url=base_url, timeout=120.0, limits=limits, verify=False) as client:
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
            level.leases[trial_id].append(worker_id)
            if probe_s > 0:
                t0 = time.perf_counter()
                await asyncio.sleep(probe_s)
                slept = time.perf_counter() - t0
            result = fake_result(lease, rng)
            t0 = time.perf_counter()
            r = await post(client, "report", f"/v1/trials/{trial_id}/report",
                           {"worker_id": worker_id, "step": 0,
                            "metrics": {"loss": rng.uniform(0.1, 1.0),
                                        "throughput_samples_per_s": result["throughput_samples_per_s"]}})
            report_ms = (time.perf_counter() - t0) * 1e3 if r is not None and r.status_code == 200 else None
            complete_ms = None
            for attempt in range(10):  # complete is idempotent for the same worker
                t0 = time.perf_counter()
                r = await post(client, "complete", f"/v1/trials/{trial_id}/complete",
                               {"worker_id": worker_id, "result": result})
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


async def drive(base_url: str, workers: int, level: Level, seed: int, probe_s: float) -> None:
    await asyncio.gather(*(run_worker(i, base_url, level, random.Random(seed * 1000 + i), probe_s)
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
    import httpx

    tag = f"{backend}-{sampler}-{workers}w"
    print(f"== {tag}: {n_trials} trials", flush=True)
    with fresh_database(backend, workdir) as db_url:
        server = Server(db_url, args.server, workdir / f"{tag}.log")
        try:
            server.wait_ready()
            base = server.url
            study = f"load-{sampler}-{workers}w"
            spec = {"name": study, "space": SPACE, "hardware": HARDWARE, "n_trials": n_trials, "sampler": sampler,
                    "seed": args.seed, "baseline": {"batch_size": 8, "accum_steps": 1}}
            r = httpx.post(f"{base}/v1/studies", json=spec, timeout=60)
            if r.status_code != 201:
                raise RuntimeError(f"creating the study failed: {r.status_code} {r.text}")
            if args.server == "instrumented":
                httpx.get(f"{base}/bench/profile", timeout=30)  # drop the study creation's records
            level = Level()
            cpu_server0, cpu_client0 = server.cpu_s(), time.process_time()
            t0 = time.perf_counter()
            asyncio.run(drive(base, workers, level, args.seed, args.probe_ms / 1e3))
            wall = time.perf_counter() - t0
            cpu_server = (server.cpu_s() or 0.0) - (cpu_server0 or 0.0)
            cpu_client = time.process_time() - cpu_client0
            info = httpx.get(f"{base}/v1/studies/{study}", timeout=60).json()
            trial_list = httpx.get(f"{base}/v1/studies/{study}/trials", timeout=60).json()["data"]
            profile = httpx.get(f"{base}/bench/profile", timeout=60).json() if args.server == "instrumented" else None
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
    never_leased = sorted(set(by_id) - set(level.leases))
    counts = info.get("counts", {})
    ok = (not multi and not repeated and not lost and not not_complete and not wrong_worker and not never_leased
          and counts.get("COMPLETE") == n_trials and sum(counts.values()) == n_trials and not level.gave_up)
    run = {
        "backend": backend, "sampler": sampler, "workers": workers, "n_trials": n_trials, "server": args.server,
        "probe_ms": args.probe_ms, "wall_s": round(wall, 3),
        "trials_per_s": round(len(level.completed) / wall, 3) if wall > 0 else None,
        "calls_per_s": round(sum(len(level.latencies[c]) for c in (*CALLS[:3], "lease_204")) / wall, 3)
        if wall > 0 else None,
        "latency_ms": {c: percentiles(level.latencies[c]) for c in (*CALLS, "lease_204")},
        "errors": dict(sorted(level.errors.items())), "errors_total": sum(level.errors.values()),
        "database_locked": {"responses": level.locked_in_responses, "server_log": log.count(LOCKED)},
        "server_log": {"errors": sum(" ERROR " in line for line in log.splitlines()),
                       "warnings": sum(" WARNING " in line for line in log.splitlines()),
                       "tracebacks": log.count("Traceback")},
        "checks": {"ok": ok, "leased": len(level.leases), "completed": len(level.completed),
                   "duplicate_leases": len(multi), "re_leased": len(repeated), "lost": len(lost),
                   "not_complete_in_study": len(not_complete), "wrong_worker": len(wrong_worker),
                   "never_leased": len(never_leased), "workers_gave_up": len(level.gave_up),
                   "study_counts": counts, "study_trials": len(trial_list),
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

    import api.main
    import api.optuna_bridge
    from api import service as service_module

    svc = service_module.TuningService
    original_init = svc.__init__

    def init(self: Any, settings: Any) -> None:
        original_init(self, settings)
        self.lock = _TimedRLock()
        self.lock_factory = _TimedRLock  # the per-study locks (lease, complete, reaper)
        _instrument_engine(self.db.engine, "service")
        _instrument_engine(self.bridge._rdb.engine, "optuna")

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
    bridge = api.optuna_bridge.OptunaBridge
    for name in ("ask", "tell", "finish", "get_trial", "trials", "n_trials", "max_trials", "set_user_attrs"):
        setattr(bridge, name, _timed(f"bridge.{name}", getattr(bridge, name)))
    api.optuna_bridge.suggest = _timed("space.suggest", api.optuna_bridge.suggest)
    optuna.study.Study.ask = _timed("optuna.study_ask", optuna.study.Study.ask)  # type: ignore[method-assign]
    for cls in (optuna.samplers.TPESampler, optuna.samplers.RandomSampler):
        for name in ("infer_relative_search_space", "sample_relative", "sample_independent", "before_trial",
                     "after_trial"):
            setattr(cls, name, _timed("optuna.sampler", getattr(cls, name)))
    for name in ("create_new_trial", "set_trial_param", "set_trial_user_attr", "set_trial_state_values",
                 "get_all_trials", "get_trial", "get_n_trials"):
        setattr(RDBStorage, name, _timed(f"rdb.{name}", getattr(RDBStorage, name)))

    original_create_app = api.main.create_app
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

    api.main.create_app = create_app  # type: ignore[assignment]
    api.main.run_server(db_url, "127.0.0.1", port)


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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
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
    p.add_argument("--backends", default="sqlite,postgresql", help="comma-separated: sqlite, postgresql")
    p.add_argument("--samplers", default="random,tpe", help="comma-separated samplers")
    p.add_argument("--workers", default="1,16,64", help="comma-separated worker counts")
    p.add_argument("--trials", default="100,250,500",
                   help="trials per worker count (one value, or one per count); the default keeps the whole "
                        "run (2 backends × 2 samplers × 3 levels) under ~5 min on 2 cores")
    p.add_argument("--probe-ms", type=float, default=0.0, help="simulated probe time between lease and report")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server", choices=("cli", "instrumented"), default="cli",
                   help="cli: `python -m autotune.cli serve`; instrumented: the same service with timers")
    p.add_argument("--out", type=Path, default=RESULTS / "service_load.json")
    p.add_argument("--png", type=Path, default=None, help="default: --out with .png")
    p.add_argument("--keep-logs", type=Path, default=None, help="copy the server logs into this directory")
    args = p.parse_args(argv)
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
    print(f"\nwrote {args.out} and {png} ({total:.0f} s)")
    return 0 if all(r["checks"]["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
