"""The service as a process: SQLite settings, the reaper in the app's lifespan, run_server."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from service_helpers import free_port, lease, make_settings
from sqlalchemy import text

from autotune.api.db import make_engine
from autotune.api.main import create_app
from autotune.api.service import TuningService


def test_sqlite_runs_in_wal_mode_with_a_busy_timeout(app: FastAPI, sqlite_url: str) -> None:
    service: TuningService = app.state.service
    path = sqlite_url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    for engine in (service.db.engine, service.bridge.storage.engine):  # ours and Optuna's
        with engine.connect() as conn:
            assert conn.execute(text("PRAGMA busy_timeout")).scalar() == 30_000
            assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"


def test_switching_a_new_file_to_wal_waits_for_a_writer_instead_of_failing(tmp_path: Path) -> None:
    """SQLite refuses the WAL switch at once, busy handler or not, while another connection writes
    to a file still in rollback mode (processes opening a new database together): the service's
    engines wait for it."""
    path = tmp_path / "new.db"
    writer = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    writer.execute("CREATE TABLE t (x)")
    writer.execute("BEGIN IMMEDIATE")
    writer.execute("INSERT INTO t VALUES (1)")
    plain = sqlite3.connect(path, timeout=5)  # what the driver alone does
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        plain.execute("PRAGMA journal_mode=WAL")
    plain.close()
    release = threading.Timer(0.3, writer.execute, args=("COMMIT",))
    release.start()
    engine = make_engine(f"sqlite:///{path}", busy_timeout_s=10)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
            assert conn.execute(text("SELECT count(*) FROM t")).scalar() == 1  # it waited for the commit
    finally:
        release.join()
        engine.dispose()
        writer.close()


def test_the_lifespan_runs_the_reaper(sqlite_url: str) -> None:
    app = create_app(make_settings(sqlite_url, lease_grace_s=0.3, reaper_interval_s=0.1))
    with TestClient(app) as client:
        assert client.post("/v1/studies", json={"name": "s"}).status_code == 201
        got = lease(client, "w1")
        assert got is not None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            trial = client.get("/v1/studies/s/trials").json()["data"][0]
            if trial["state"] == "FAIL":
                break
            time.sleep(0.1)
        assert trial["state"] == "FAIL" and trial["failure"]["kind"] == "lost"


def test_run_server_serves_the_api(tmp_path: Path) -> None:
    port = free_port()
    code = f"from autotune.api.main import run_server; run_server('sqlite:///{tmp_path}/s.db', '127.0.0.1', {port})"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=1).json()
                break
            except httpx.TransportError:
                assert proc.poll() is None, proc.communicate()[0].decode()[-3000:]
                assert time.monotonic() < deadline, "the server did not come up in 30 s"
                time.sleep(0.1)
        assert health["status"] == "ok" and health["db"] == "sqlite"
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    assert (tmp_path / "s.db").is_file()
