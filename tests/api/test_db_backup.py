"""`autotune db backup OUT`: a consistent copy of a live SQLite database (WAL included), and a
pointer to pg_dump for PostgreSQL."""

from __future__ import annotations

import contextlib
import shutil
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from autotune.api.backup import pg_dump_command
from autotune.cli.main import app


def invoke(*args: str, env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(app, ["db", "backup", *args], env={"COLUMNS": "200", **(env or {})})


def count(path: Path, table: str) -> int:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return int(conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0])


@pytest.fixture
def live_db(tmp_path: Path) -> Iterator[tuple[Path, sqlite3.Connection]]:
    """A WAL database like the service's (Optuna's studies/trials tables): 2 trials checkpointed
    into the main file, then 10 more committed but still only in the -wal, the writer kept open
    (as a running service would be) so nothing checkpoints them."""
    path = tmp_path / "autotune.db"
    writer = sqlite3.connect(path, isolation_level=None)
    assert writer.execute("PRAGMA journal_mode=WAL").fetchone()[0] == "wal"
    writer.execute("PRAGMA wal_autocheckpoint=0")
    writer.execute("CREATE TABLE studies (study_id INTEGER PRIMARY KEY, study_name TEXT, n_trials INTEGER)")
    writer.execute("CREATE TABLE trials (trial_id INTEGER PRIMARY KEY, study_id INTEGER, value REAL)")
    writer.execute("INSERT INTO studies VALUES (1, 'demo', 0)")

    def add_trial(value: float) -> None:
        writer.execute("BEGIN IMMEDIATE")
        writer.execute("INSERT INTO trials (study_id, value) VALUES (1, ?)", (value,))
        writer.execute("UPDATE studies SET n_trials = n_trials + 1 WHERE study_id = 1")
        writer.execute("COMMIT")

    for i in range(2):
        add_trial(float(i))
    writer.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    for i in range(2, 12):
        add_trial(float(i))
    assert (tmp_path / "autotune.db-wal").stat().st_size > 0
    try:
        yield path, writer
    finally:
        writer.close()


def test_backup_copies_what_is_still_in_the_wal_where_a_file_copy_loses_it(
        live_db: tuple[Path, sqlite3.Connection], tmp_path: Path) -> None:
    path, _writer = live_db
    naive = tmp_path / "naive.db"
    shutil.copy(path, naive)  # what `cp autotune.db` does
    assert count(naive, "trials") == 2  # the 10 newest trials were only in the -wal: lost

    out = tmp_path / "backups" / "nested" / "copy.db"  # folders are created
    result = invoke(str(out), "--db", f"sqlite:///{path}")
    assert result.exit_code == 0, result.output
    assert count(out, "trials") == 12
    assert "1 studies, 12 trials" in result.output and str(out) in result.output
    assert not Path(f"{out}-wal").exists()  # a standalone file
    with contextlib.closing(sqlite3.connect(out)) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert [p.name for p in out.parent.iterdir()] == ["copy.db"]  # no temporary file left


def test_backup_is_a_snapshot_while_the_database_is_written(live_db: tuple[Path, sqlite3.Connection],
                                                            tmp_path: Path) -> None:
    """Each write adds a trial and bumps studies.n_trials in one transaction: a consistent copy
    has them equal, however the copy and the writes interleave."""
    path, _ = live_db
    stop = threading.Event()

    def write() -> None:
        with contextlib.closing(sqlite3.connect(path, isolation_level=None, timeout=10)) as conn:
            while not stop.is_set():
                conn.execute("BEGIN IMMEDIATE")
                conn.execute("INSERT INTO trials (study_id, value) VALUES (1, 0.5)")
                conn.execute("UPDATE studies SET n_trials = n_trials + 1 WHERE study_id = 1")
                conn.execute("COMMIT")

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    try:
        for i in range(3):
            out = tmp_path / f"copy{i}.db"
            assert invoke(str(out), "--db", f"sqlite:///{path}").exit_code == 0
            with contextlib.closing(sqlite3.connect(out)) as conn:
                n_trials = conn.execute("SELECT n_trials FROM studies").fetchone()[0]
                assert n_trials == conn.execute("SELECT count(*) FROM trials").fetchone()[0] >= 12
    finally:
        stop.set()
        thread.join(timeout=10)


def test_backup_refuses_to_overwrite_without_force(live_db: tuple[Path, sqlite3.Connection], tmp_path: Path) -> None:
    path, _ = live_db
    out = tmp_path / "copy.db"
    out.write_text("an older backup")
    result = invoke(str(out), "--db", f"sqlite:///{path}")
    assert result.exit_code == 2
    assert "exists" in result.output and "--force" in result.output
    assert out.read_text() == "an older backup"

    result = invoke(str(out), "--db", f"sqlite:///{path}", "--force")
    assert result.exit_code == 0, result.output
    assert count(out, "trials") == 12

    result = invoke(str(path), "--db", f"sqlite:///{path}", "--force")  # onto the database itself: never
    assert result.exit_code == 2 and "the database itself" in result.output
    assert count(path, "trials") == 12


def test_backup_uses_AUTOTUNE_DB_URL_and_never_creates_a_missing_database(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.db"
    result = invoke(str(tmp_path / "copy.db"), env={"AUTOTUNE_DB_URL": f"sqlite:///{missing}"})
    assert result.exit_code == 2
    assert "no SQLite database at" in result.output and str(missing) in result.output
    assert not missing.exists() and not (tmp_path / "copy.db").exists()


def test_backup_of_postgresql_points_to_pg_dump_without_the_password(tmp_path: Path) -> None:
    url = "postgresql+psycopg://alice:s3cret@dbhost:5433/autotune"
    out = tmp_path / "x.dump"
    result = invoke(str(out), "--db", url)
    assert result.exit_code == 2
    assert f"pg_dump --format=custom --file {out} postgresql://alice@dbhost:5433/autotune" in result.output
    assert "pg_restore" in result.output
    assert "s3cret" not in result.output
    assert not out.exists()
    assert pg_dump_command(url, "my backups/a.dump") == (
        "pg_dump --format=custom --file 'my backups/a.dump' postgresql://alice@dbhost:5433/autotune")


def test_db_backup_has_help() -> None:
    result = CliRunner().invoke(app, ["db", "backup", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "OUT" in result.output and "--force" in result.output and "--db" in result.output
