"""A real service and real workers in subprocesses, for the end-to-end tests.

`LiveService` runs ``python -m autotune.cli serve`` on a SQLite file and a free port, with
auth on: it creates an admin and a worker token in its database (`admin_token`,
`worker_token`, `headers(role)`), in this process through the token store ``autotune token
create`` uses (`api.auth.TokenStore`: no CLI start per token; the CLI itself is tested in
tests/api/test_auth.py); its REST shortcuts send them.
`start_worker` runs ``python -m autotune.cli worker``; given a LiveService's URL it passes
that service's worker token (AUTOTUNE_TOKEN). Every process starts in its own session
(process group) and `Processes.stop_all` ends them all, workers first (SIGTERM, so each
kills its probe child), so a failing test leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx

from autotune.engine import fork_server
from autotune.engine.compile_workers import children

T = TypeVar("T")
CLI = [sys.executable, "-m", "autotune.cli"]
# One HTTP client for every call of the test process: httpx's module-level functions build a
# client, TLS context included, per call (25-40 ms of CPU, many times a second in a polling
# wait). No keep-alive: each request opens its own connection, as a fresh client's would (a
# service restart leaves no stale connection behind).
HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))
CHILD_MODULE = "autotune.engine.probe_child"

# A search space whose probes take a few seconds on one CPU thread: micro-batches of 2-4,
# no accumulation, so (5 warm-up + 5 timed) steps need only 40 samples.
SMALL_SPACE: dict[str, Any] = {
    "name": "small",
    "params": {"batch_size": {"choices": [2, 4]}, "inverse_loss_frequency": {"choices": [1, 2]}},
    "fixed": {"accum_steps": 1},
}
SMALL_BASELINE = {"batch_size": 4, "accum_steps": 1}


def small_spec(name: str, n_trials: int = 2, samples: int = 64, **overrides: Any) -> dict[str, Any]:
    """A study spec on the small space (random sampler: no startup trials to wait for)."""
    spec: dict[str, Any] = {"name": name, "space": SMALL_SPACE, "baseline": SMALL_BASELINE, "n_trials": n_trials,
                            "sampler": "random", "seed": 0, "hardware": "cpu",
                            "probe": {"samples": samples, "windows": 5, "warmup_steps": 5},
                            "baseline_seeds": 1, "remeasure": {"top_k": 0}}
    for key, value in overrides.items():
        if key == "probe":
            spec["probe"].update(value)
        else:
            spec[key] = value
    return spec


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_until(predicate: Callable[[], T | None], timeout: float, what: str, interval: float = 0.1) -> T:
    """Poll `predicate` until it returns something truthy (that value); fail the test after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def probe_children(worker_pid: int) -> list[int]:
    """The worker's live probe child processes, forked or started cold (found through /proc)."""
    return fork_server.probe_children(worker_pid, CHILD_MODULE)


def is_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Processes:
    """Subprocesses of one test, each in its own session, with a log file each."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, argv: list[str], log_name: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log_path = self.log_dir / log_name
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        proc.log_path = log_path  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen[bytes], grace: float = 15.0) -> int:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                for child in children(proc.pid):  # probe children live in their own sessions
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(child, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            self.stop(proc)


def log_text(proc: subprocess.Popen[bytes]) -> str:
    path: Path = proc.log_path  # type: ignore[attr-defined]
    return path.read_text(errors="replace")


LEASED = re.compile(r"▶ trial (\d+) of (\S+) \(id (\d+)\)")  # the worker's line for each trial it runs


def leased_trial_ids(proc: subprocess.Popen[bytes]) -> list[int]:
    """The trial ids a worker process leased, in order, from its log."""
    return [int(m.group(3)) for m in LEASED.finditer(log_text(proc))]


def reports_stored(db: Path) -> int:
    """How many window reports the service on SQLite file `db` has stored (read beside it)."""
    with sqlite3.connect(db, timeout=5) as conn:
        return int(conn.execute("SELECT count(*) FROM autotune_reports").fetchone()[0])


def lease_ended(db: Path, trial_id: int) -> bool:
    """Whether the lease of `trial_id` has ended (the service on SQLite file `db`, read beside it):
    the reaper fails a trial in Optuna first and ends its lease in a second transaction."""
    with sqlite3.connect(db, timeout=5) as conn:
        row = conn.execute("SELECT state FROM autotune_leases WHERE trial_id = ?", (trial_id,)).fetchone()
    return row is not None and row[0] != "active"


# The LiveService of each URL, so that start_worker(processes, service.url) finds its worker token.
_SERVICES: dict[str, LiveService] = {}


class LiveService:
    """`autotune serve` on `db_path` and `port` with auth on, restartable.

    Its tokens (`admin_token`, `worker_token`) are created on first use, or when the service
    first starts, and survive restarts (they live in the database).
    """

    def __init__(self, processes: Processes, db_path: Path, port: int | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.processes = processes
        self.db_path = db_path
        self.db_url = f"sqlite:///{db_path}"
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self._tokens: dict[str, str] = {}
        _SERVICES[self.url] = self

    def start(self, wait: bool = True) -> LiveService:
        self.proc = self.processes.start([*CLI, "serve", "--db", self.db_url, "--port", str(self.port)], "serve.log",
                                         {"AUTOTUNE_AUTH": "true", **(self.env or {})})
        if wait:
            self.wait_healthy()
            self.ensure_tokens()
        return self

    def ensure_tokens(self) -> dict[str, str]:
        """Create the admin and the worker token (once); role -> token. In this process, through
        the token store the CLI uses (migrating the database first if the service has not)."""
        if not self._tokens:
            from autotune.api.auth import TokenStore

            store = TokenStore.open(self.db_url)
            try:
                self._tokens = {role: store.create(role)[0] for role in ("admin", "worker")}
            finally:
                store.close()
        return self._tokens

    @property
    def admin_token(self) -> str:
        return self.ensure_tokens()["admin"]

    @property
    def worker_token(self) -> str:
        return self.ensure_tokens()["worker"]

    def headers(self, role: str = "admin") -> dict[str, str]:
        """The Authorization header of this service's `role` token (admin or worker)."""
        return {"Authorization": f"Bearer {self.ensure_tokens()[role]}"}

    def healthy(self) -> bool:
        try:
            return HTTP.get(f"{self.url}/v1/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def wait_healthy(self, timeout: float = 60.0) -> None:
        def up() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"the service exited with {self.proc.returncode}:\n{log_text(self.proc)[-3000:]}")
            return self.healthy()

        wait_until(up, timeout, "the service's /v1/health")

    def stop(self) -> None:
        assert self.proc is not None
        self.processes.stop(self.proc)

    # --- REST shortcuts -----------------------------------------------------------------------

    def get(self, path: str) -> Any:
        response = HTTP.get(f"{self.url}{path}", headers=self.headers("admin"), timeout=10)
        response.raise_for_status()
        return response.json()

    def post(self, path: str, body: Any, role: str = "admin", timeout: float = 30) -> httpx.Response:
        """POST with this service's `role` token; the response, whatever its status."""
        return HTTP.post(f"{self.url}{path}", json=body, headers=self.headers(role), timeout=timeout)

    def delete(self, path: str) -> Any:
        """DELETE with the admin token; raises on an error status."""
        response = HTTP.delete(f"{self.url}{path}", headers=self.headers("admin"), timeout=10)
        response.raise_for_status()
        return response.json()

    def submit(self, spec: dict[str, Any]) -> Any:
        response = self.post("/v1/studies", spec)
        assert response.status_code == 201, response.text
        return response.json()

    def trials(self, study: str) -> list[dict[str, Any]]:
        data: list[dict[str, Any]] = self.get(f"/v1/studies/{study}/trials")["data"]
        return data


def start_worker(processes: Processes, api: str, *args: str, log_name: str = "worker.log",
                 env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`autotune worker` with one torch thread and a fast heartbeat. When `api` is a LiveService's
    URL the worker gets its worker token (AUTOTUNE_TOKEN; `env` may override it)."""
    service = _SERVICES.get(api)
    token_env = {"AUTOTUNE_TOKEN": service.worker_token} if service is not None else {}
    return processes.start([*CLI, "worker", "--api", api, "--threads", "1", "--heartbeat", "0.5", *args], log_name,
                           {**token_env, **(env or {})})
