"""`autotune serve` names the database it opens in its first line, and what it holds: a
restart on the wrong database (a new, empty SQLite file in another directory) is seen at once."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from fastapi.testclient import TestClient
from service_helpers import free_port

from autotune.api.main import create_app, database_line
from autotune.api.settings import Settings


def first_line_of_serve(db_url: str, cwd: Path) -> str:
    """The first line `autotune serve` writes (then it is stopped)."""
    proc = subprocess.Popen([sys.executable, "-m", "autotune.cli", "serve", "--db", db_url, "--port", str(free_port()),
                             "--no-auth"], cwd=cwd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 60
        line = ""
        while not line and time.monotonic() < deadline:
            line = proc.stderr.readline().strip()
        return line
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_the_first_line_names_a_new_sqlite_file_by_its_absolute_path(tmp_path: Path) -> None:
    line = first_line_of_serve("sqlite:///relative.db", tmp_path)  # relative to the directory serve runs in
    assert f"database {tmp_path / 'relative.db'}: a new file, created empty" in line, line


def test_an_existing_database_says_how_many_studies_it_holds(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'a.db'}"
    assert database_line(url) == f"database {tmp_path / 'a.db'}: a new file, created empty"
    with TestClient(create_app(Settings(db_url=url, auth=False))) as client:
        assert database_line(url) == f"database {tmp_path / 'a.db'}: 0 studies (empty)"
        assert client.post("/v1/studies", json={"name": "s"}).status_code == 201
    assert database_line(url) == f"database {tmp_path / 'a.db'}: 1 study"
    assert not (tmp_path / "other.db").exists()
    database_line(f"sqlite:///{tmp_path / 'other.db'}")
    assert not (tmp_path / "other.db").exists()  # reading the line creates nothing
