"""Alembic migrations of the service tables (migrations/, api/db.py), on SQLite and PostgreSQL.

The cycle upgrade → downgrade to base → upgrade works with Optuna's tables in the same
database and never touches them (nor their ``alembic_version``); the migrated schema equals
the models; a database made by the old create_all path is adopted; concurrent upgrades
take turns; `autotune db ...` works from any directory.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from service_helpers import make_settings
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.pool import NullPool
from typer.testing import CliRunner

from autotune.api.db import (
    LEGACY_REVISION,
    MIGRATIONS_DIR,
    VERSION_TABLE,
    Base,
    StudyRow,
    current_schema_revision,
    downgrade_schema,
    head_revision,
    migration_options,
    upgrade_schema,
    utcnow,
)
from autotune.api.main import create_app
from autotune.cli.main import app as cli_app

REPO = Path(__file__).resolve().parents[2]
MODEL_TABLES = set(Base.metadata.tables)


def table_names(url: str) -> set[str]:
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return set(inspect(conn).get_table_names())
    finally:
        engine.dispose()


def scalar(url: str, sql: str) -> Any:
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return conn.execute(text(sql)).scalar()
    finally:
        engine.dispose()


def schema_diff(url: str) -> list[Any]:
    """What autogenerate would change to make the database match the models (Optuna's tables excluded)."""
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts=migration_options(engine.dialect.name))
            return list(compare_metadata(context, Base.metadata))
    finally:
        engine.dispose()


def make_optuna_study(url: str) -> set[str]:
    """An Optuna storage with one study and one trial in `url`; Optuna's table names."""
    storage = optuna.storages.RDBStorage(url)
    study = optuna.create_study(storage=storage, study_name="optuna-own")
    study.enqueue_trial({"x": 1.0})
    study.optimize(lambda t: t.suggest_float("x", 0, 2), n_trials=1)
    storage.engine.dispose()
    return table_names(url)


def test_the_model_tables_are_the_service_tables() -> None:
    assert {"autotune_studies", "autotune_leases", "autotune_reports", "autotune_workers",
            "autotune_tokens", "autotune_service"} == MODEL_TABLES
    assert head_revision() == "0004"


@pytest.mark.parametrize("with_optuna", [False, True], ids=["alone", "beside-optuna"])
def test_upgrade_downgrade_upgrade_leaves_optuna_alone(empty_db_url: str, with_optuna: bool) -> None:
    optuna_tables = make_optuna_study(empty_db_url) if with_optuna else set()
    optuna_version = scalar(empty_db_url, "SELECT version_num FROM alembic_version") if with_optuna else None

    assert upgrade_schema(empty_db_url) == (None, "0004")
    assert table_names(empty_db_url) == MODEL_TABLES | {VERSION_TABLE} | optuna_tables
    assert scalar(empty_db_url, f"SELECT version_num FROM {VERSION_TABLE}") == "0004"
    assert upgrade_schema(empty_db_url) == ("0004", "0004")  # idempotent
    assert schema_diff(empty_db_url) == []

    assert downgrade_schema(empty_db_url, "base") == ("0004", None)
    assert table_names(empty_db_url) == {VERSION_TABLE} | optuna_tables  # only the (empty) version table is left
    assert scalar(empty_db_url, f"SELECT count(*) FROM {VERSION_TABLE}") == 0

    assert upgrade_schema(empty_db_url) == (None, "0004")
    assert table_names(empty_db_url) == MODEL_TABLES | {VERSION_TABLE} | optuna_tables
    assert schema_diff(empty_db_url) == []
    if with_optuna:
        assert scalar(empty_db_url, "SELECT version_num FROM alembic_version") == optuna_version
        assert optuna.load_study(study_name="optuna-own", storage=empty_db_url).trials[0].params == {"x": 1.0}


def test_the_migrated_schema_equals_the_models_and_a_gap_would_show(empty_db_url: str) -> None:
    upgrade_schema(empty_db_url)
    assert schema_diff(empty_db_url) == []
    downgrade_schema(empty_db_url, "0001")  # without the tokens table: the comparison must notice
    diff = schema_diff(empty_db_url)
    assert ("add_table", "autotune_tokens") in [(d[0], d[1].name) for d in diff
                                                if isinstance(d, tuple) and d[0] == "add_table"]


def test_a_database_made_by_create_all_is_adopted(empty_db_url: str, caplog: pytest.LogCaptureFixture) -> None:
    engine = create_engine(empty_db_url, poolclass=NullPool)
    legacy = [t for name, t in Base.metadata.tables.items() if name not in ("autotune_tokens", "autotune_service")]
    Base.metadata.create_all(engine, tables=legacy)  # what the service did before migrations
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE autotune_leases DROP COLUMN token"))  # a lease token's column came with 0004
        conn.execute(StudyRow.__table__.insert().values(name="old", spec={}, space={}, hardware="cpu",
                                                         state="running", created_at=utcnow()))
    engine.dispose()

    with caplog.at_level("WARNING", logger="autotune.api.db"):
        assert upgrade_schema(empty_db_url) == (LEGACY_REVISION, "0004")
    assert "predate migrations" in caplog.text and f"revision {LEGACY_REVISION}" in caplog.text
    assert "autotune_tokens" in table_names(empty_db_url)
    assert scalar(empty_db_url, "SELECT name FROM autotune_studies") == "old"
    assert schema_diff(empty_db_url) == []


def test_lease_tokens_upgrade_keeps_old_leases_without_one_and_downgrade_keeps_the_indexes(
        empty_db_url: str) -> None:
    """0004 adds autotune_leases.token: a lease made before it keeps NULL ("from before tokens");
    the downgrade drops the column and leaves the table's indexes (one active lease per worker) as 0003 made them."""
    upgrade_schema(empty_db_url, "0003")
    indexes = {i["name"]: i["unique"] for i in _leases_indexes(empty_db_url)}
    engine = create_engine(empty_db_url, poolclass=NullPool)
    with engine.begin() as conn:
        conn.execute(StudyRow.__table__.insert().values(name="old", spec={}, space={}, hardware="cpu",
                                                         state="running", created_at=utcnow()))
        conn.execute(text("INSERT INTO autotune_leases (trial_id, study_name, trial_number, worker_id, state, "
                          "leased_at, heartbeat_at) VALUES (1, 'old', 0, 'w', 'active', :t, :t)"), {"t": utcnow()})
    engine.dispose()
    assert upgrade_schema(empty_db_url) == ("0003", "0004")
    assert scalar(empty_db_url, "SELECT count(*) FROM autotune_leases WHERE token IS NULL") == 1
    assert schema_diff(empty_db_url) == []
    assert downgrade_schema(empty_db_url, "0003") == ("0004", "0003")
    assert "token" not in {c["name"] for c in _leases_columns(empty_db_url)}
    assert {i["name"]: i["unique"] for i in _leases_indexes(empty_db_url)} == indexes
    assert indexes["uq_autotune_leases_active_worker"]
    assert scalar(empty_db_url, "SELECT worker_id FROM autotune_leases WHERE trial_id = 1") == "w"


def _leases_indexes(url: str) -> list[Any]:
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return list(inspect(conn).get_indexes("autotune_leases"))
    finally:
        engine.dispose()


def _leases_columns(url: str) -> list[Any]:
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return list(inspect(conn).get_columns("autotune_leases"))
    finally:
        engine.dispose()


def _upgrade_after(barrier: Any, url: str, results: Any) -> None:
    barrier.wait()
    try:
        results.put(str(upgrade_schema(url)))
    except Exception as e:  # reported: the test's assertion shows it
        results.put(f"{type(e).__name__}: {e}")


def test_concurrent_upgrades_from_several_processes_take_turns(empty_db_url: str) -> None:
    """Service processes starting together on one database: every upgrade succeeds, the schema is made once."""
    processes = 4
    ctx = multiprocessing.get_context("fork")  # the children start with everything imported: a real race
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_upgrade_after, args=(barrier, empty_db_url, results)) for _ in range(processes)]
    for proc in procs:
        proc.start()
    outcomes = sorted(results.get(timeout=60) for _ in procs)
    for proc in procs:
        proc.join(timeout=30)
    assert outcomes == sorted([str((None, "0004"))] + [str(("0004", "0004"))] * (processes - 1)), outcomes
    assert scalar(empty_db_url, f"SELECT count(*) FROM {VERSION_TABLE}") == 1


def test_the_service_upgrades_at_start(empty_sqlite_url: str) -> None:
    assert current_schema_revision(empty_sqlite_url) is None
    create_app(make_settings(empty_sqlite_url))
    assert current_schema_revision(empty_sqlite_url) == head_revision()


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "autotune.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "200"})


def test_autotune_db_upgrade_works_from_any_directory(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/cli.db"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = run_cli("db", "upgrade", "--db", url, cwd=elsewhere)
    assert done.returncode == 0, done.stderr
    assert "→ 0004" in done.stdout
    assert current_schema_revision(url) == "0004"
    done = run_cli("db", "current", "--db", url, cwd=elsewhere)
    assert done.returncode == 0 and done.stdout.strip() == "0004 (head)", done.stdout + done.stderr


def test_autotune_db_downgrade_current_and_errors(empty_db_url: str) -> None:
    runner = CliRunner()
    assert runner.invoke(cli_app, ["db", "upgrade", "--db", empty_db_url]).exit_code == 0
    result = runner.invoke(cli_app, ["db", "downgrade", "0001", "--db", empty_db_url])
    assert result.exit_code == 0 and "0004 → 0001" in result.stdout, result.output
    result = runner.invoke(cli_app, ["db", "current", "--db", empty_db_url])
    assert "0001 (newest: 0004; run `autotune db upgrade`)" in result.stdout
    result = runner.invoke(cli_app, ["db", "downgrade", "nope", "--db", empty_db_url])
    assert result.exit_code == 1 and "Can't locate revision identified by 'nope'" in result.stderr
    result = runner.invoke(cli_app, ["db", "downgrade", "base", "--db", empty_db_url])
    assert result.exit_code == 0 and table_names(empty_db_url) == {VERSION_TABLE}
    result = runner.invoke(cli_app, ["db", "current", "--db", empty_db_url])
    assert result.stdout.startswith("none (no autotune tables yet)")


def test_an_unreachable_database_is_a_clear_cli_error() -> None:
    url = "postgresql+psycopg://nobody@127.0.0.1:1/none?connect_timeout=2"
    result = CliRunner().invoke(cli_app, ["db", "upgrade", "--db", url])
    assert result.exit_code == 1
    assert "the database failed (OperationalError" in result.stderr and "check --db / AUTOTUNE_DB_URL" in result.stderr


@pytest.mark.parametrize("command", [["db", "current"], ["db", "upgrade"], ["token", "list"]])
def test_a_database_url_that_does_not_parse_is_bad_input(command: list[str]) -> None:
    """Exit 2 (bad input) with an example URL; it was exit 1, "the database failed"."""
    result = CliRunner().invoke(cli_app, [*command, "--db", "nosuch"])
    assert result.exit_code == 2, result.output
    assert "--db / AUTOTUNE_DB_URL: Could not parse SQLAlchemy URL" in result.stderr
    assert "e.g. sqlite:///./autotune.db" in result.stderr


def test_the_migrations_are_packaged_inside_autotune() -> None:
    """The repository keeps migrations/ and api/ at the top level; the package holds them as
    autotune.migrations and autotune.api (links), so the wheel installs no top-level package of
    theirs (tests/deploy/test_wheel.py installs one)."""
    from setuptools import find_packages

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    assert MIGRATIONS_DIR == REPO / "migrations" and (MIGRATIONS_DIR / "env.py").is_file()
    assert (REPO / "autotune" / "migrations").resolve() == MIGRATIONS_DIR
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = set(find_packages(str(REPO), include=config["packages"]["find"]["include"]))
    assert {"autotune.migrations", "autotune.migrations.versions", "autotune.api"} <= packages
    assert not {"api", "migrations"} & packages
    assert "script.py.mako" in config["package-data"]["autotune.migrations"]
