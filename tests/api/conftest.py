"""Fixtures for the service tests: a fresh app per test on a real database file.

* ``client``: a TestClient (lifespan running) on a SQLite file in tmp_path.
* ``db_url``: parametrised over SQLite and PostgreSQL, for the tests that must hold on both;
  ``backend_app`` and ``backend_client`` are the service on it.
  PostgreSQL gets a fresh database per test on the server named by AUTOTUNE_TEST_PG_URL
  (default postgresql+psycopg://postgres@127.0.0.1:5432/postgres); without a reachable
  server those cases are skipped with a message saying how to enable them, except under
  AUTOTUNE_REQUIRE_PG=1 (set by .ci/run), where they fail.
* A test's database is already at the schema head: a copy of one database per backend that
  the service migrated once per session (migrating costs more than most tests: ~0.5 s on
  SQLite, more on PostgreSQL). The service's own upgrade at start then finds nothing to do.
  ``empty_db_url`` and ``empty_sqlite_url`` are databases with no tables at all, for the
  migration tests (tests/api/test_migrations.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from service_helpers import StudyFactory, make_settings
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url

from autotune.api.main import create_app

PG_ADMIN_URL = os.environ.get("AUTOTUNE_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")


def _migrate(url: str) -> None:
    """Bring a database to the schema head as the service does at start (its tables and
    Optuna's), and close every connection to it."""
    with TestClient(create_app(make_settings(url))):
        pass


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite file at the schema head, its write-ahead log folded in (a plain copy is whole)."""
    path = tmp_path_factory.mktemp("template") / "template.db"
    _migrate(f"sqlite:///{path}")
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return path


@pytest.fixture
def empty_sqlite_url(tmp_path: Path) -> str:
    """A SQLite file that does not exist yet."""
    return f"sqlite:///{tmp_path}/empty.db"


@pytest.fixture
def sqlite_url(tmp_path: Path, sqlite_template: Path) -> str:
    """A SQLite file of this test's own, at the schema head."""
    path = tmp_path / "t.db"
    shutil.copyfile(sqlite_template, path)
    return f"sqlite:///{path}"


@pytest.fixture
def app(sqlite_url: str) -> FastAPI:
    return create_app(make_settings(sqlite_url))


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app) as c:
        yield c


@pytest.fixture(scope="session")
def pg_admin() -> Iterator[Engine]:
    """An AUTOCOMMIT engine on the PostgreSQL server's maintenance database (skip if unreachable)."""
    engine = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as e:
        engine.dispose()
        if os.environ.get("AUTOTUNE_REQUIRE_PG") == "1":  # CI (.ci/run) must run the PostgreSQL cases
            pytest.fail(f"PostgreSQL is required (AUTOTUNE_REQUIRE_PG=1) but not reachable at "
                        f"{make_url(PG_ADMIN_URL).render_as_string(hide_password=True)} ({type(e).__name__}: {e})")
        pytest.skip(f"PostgreSQL not reachable at {make_url(PG_ADMIN_URL).render_as_string(hide_password=True)} "
                    f"({type(e).__name__}); start PostgreSQL there or set AUTOTUNE_TEST_PG_URL to a server URL "
                    "(e.g. postgresql+psycopg://postgres@127.0.0.1:5432/postgres) to run the PostgreSQL cases")
    yield engine
    engine.dispose()


@contextlib.contextmanager
def _pg_database(pg_admin: Engine, template: str | None = None) -> Iterator[str]:
    """A new database (a copy of `template`, or empty) for as long as the block runs; its URL."""
    name = f"autotune_test_{uuid.uuid4().hex[:12]}"
    with pg_admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else "")))
    try:
        yield make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with pg_admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture(scope="session")
def pg_template(pg_admin: Engine) -> Iterator[str]:
    """The name of a PostgreSQL database at the schema head, with no connection open to it (so
    that CREATE DATABASE ... TEMPLATE can copy it)."""
    with _pg_database(pg_admin) as url:
        _migrate(url)
        yield str(make_url(url).database)


@pytest.fixture
def empty_pg_url(pg_admin: Engine) -> Iterator[str]:
    """A fresh, empty database for one test; dropped afterwards."""
    with _pg_database(pg_admin) as url:
        yield url


@pytest.fixture
def pg_url(pg_admin: Engine, pg_template: str) -> Iterator[str]:
    """A database of this test's own at the schema head; dropped afterwards."""
    with _pg_database(pg_admin, pg_template) as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest) -> str:
    """A database of each backend the service supports, at the schema head."""
    url: str = request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")
    return url


@pytest.fixture
def backend_app(db_url: str) -> FastAPI:
    """The service on each backend (a SQLite file, a fresh PostgreSQL database: ``db_url``)."""
    return create_app(make_settings(db_url))


@pytest.fixture
def backend_client(backend_app: FastAPI) -> Iterator[TestClient]:
    """A client of ``backend_app`` (lifespan running): what a backend cannot store must be a 4xx
    there too (PostgreSQL: 32-bit integer ids, no NUL in text)."""
    with TestClient(backend_app) as c:
        yield c


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_db_url(request: pytest.FixtureRequest) -> str:
    """An empty database of each backend (no tables), for the migration tests."""
    url: str = request.getfixturevalue("empty_sqlite_url" if request.param == "sqlite" else "empty_pg_url")
    return url


@pytest.fixture
def make_study(client: TestClient) -> StudyFactory:
    """make_study(name="s", **spec) -> the created StudyInfo (asserts 201); baseline_seeds 1 and
    remeasure.top_k 0 unless given."""

    def make(name: str = "s", **spec: Any) -> dict[str, Any]:
        # one baseline seed and no re-measurement unless a test is about them (fewer trials, same counts)
        spec = {"baseline_seeds": 1, "remeasure": {"top_k": 0}, **spec}
        r = client.post("/v1/studies", json={"name": name, **spec})
        assert r.status_code == 201, r.text
        body: dict[str, Any] = r.json()
        return body

    return make
