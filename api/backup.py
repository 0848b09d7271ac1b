"""`autotune db backup OUT`: a consistent copy of a live SQLite database.

A plain `cp` misses the commits still in the WAL file. `backup_sqlite` uses SQLite's online backup
API (one read transaction: a snapshot as of one commit while the service keeps writing) and
renames the checked copy onto OUT, so OUT is never half-written. PostgreSQL has its own tool:
`pg_dump_command` builds the command line to suggest.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import sqlite3
import tempfile
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

# What the summary counts in the copy: each label from the first of its tables that exists
# (the service's studies, else Optuna's; Optuna's trials, baseline seeds and re-measurements included).
COUNTED = {"studies": ("autotune_studies", "studies"), "trials": ("trials",)}


class BackupRefused(ValueError):
    """The backup cannot run as asked (the message says what to do instead); nothing was written."""


class BackupFailed(RuntimeError):
    """SQLite failed while copying or checking; OUT was left as it was."""


@dataclass(frozen=True)
class BackupResult:
    source: Path
    out: Path
    size_bytes: int
    counts: dict[str, int] = field(default_factory=dict)  # label of COUNTED -> rows, for the tables present

    def describe(self) -> str:
        """E.g. "copied autotune.db → backups/a.db (1.2 MiB: 3 studies, 41 trials)"."""
        rows = ", ".join(f"{n} {label}" for label, n in self.counts.items())
        return f"copied {self.source} → {self.out} ({_size(self.size_bytes)}{': ' + rows if rows else ''})"


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def _safe(url: str) -> str:
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url.split("@")[-1]


def pg_dump_command(url: str, out: str | Path) -> str:
    """A pg_dump command line (custom format, for pg_restore) for the database of `url`, without
    its password (libpq reads it from PGPASSWORD or ~/.pgpass)."""
    parsed = make_url(url)
    # URL.set(password=None) keeps the password: build the URL anew, without it and without the driver
    libpq_url = URL.create(parsed.get_backend_name(), username=parsed.username, host=parsed.host, port=parsed.port,
                           database=parsed.database, query=parsed.query)
    target = libpq_url.render_as_string(hide_password=False)
    return f"pg_dump --format=custom --file {shlex.quote(str(out))} {shlex.quote(target)}"


def sqlite_file(url: str, out: str | Path = "autotune.dump") -> Path:
    """The database file of a SQLite URL (relative paths from the working directory, as SQLite
    opens them). Raises BackupRefused for another database (for PostgreSQL: the pg_dump command
    that would write `out`), an in-memory or URI-form one."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise BackupRefused(f"not a database URL: {url!r} (e.g. sqlite:///./autotune.db)") from None
    backend = parsed.get_backend_name()
    if backend == "postgresql":
        raise BackupRefused(f"{_safe(url)} is a PostgreSQL database: `autotune db backup` copies SQLite files "
                            f"only. Use pg_dump, e.g.\n  {pg_dump_command(url, out)}\n(the password comes from "
                            f"PGPASSWORD or ~/.pgpass; restore with: pg_restore --dbname URL {shlex.quote(str(out))})")
    if backend != "sqlite":
        raise BackupRefused(f"{_safe(url)}: `autotune db backup` copies SQLite databases only; use your "
                            f"database's own backup tool for {backend}")
    database = parsed.database or ""
    if database in ("", ":memory:") or database.startswith("file:"):
        raise BackupRefused(f"{url!r} is not a SQLite file path; give --db sqlite:///PATH/TO/autotune.db")
    return Path(database)


def _counts(connection: sqlite3.Connection) -> dict[str, int]:
    tables = {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    counts = {}
    for label, candidates in COUNTED.items():
        table = next((t for t in candidates if t in tables), None)
        if table is not None:
            counts[label] = int(connection.execute(f'SELECT count(*) FROM "{table}"').fetchone()[0])
    return counts


def backup_sqlite(url: str, out: str | Path, *, force: bool = False, busy_timeout_s: float = 30.0) -> BackupResult:
    """Copy the SQLite database of `url` to `out` with SQLite's online backup.

    Safe while the service runs: the copy holds every transaction committed before it started
    (WAL included) and none half. `out`'s folders are created; an existing `out` is replaced
    only with `force`. The copy is a standalone file (rollback journal, no -wal beside it),
    checked with `PRAGMA quick_check` before it takes `out`'s name; it is readable by its owner
    only (it holds the tokens' hashes). Raises BackupRefused (bad input, nothing written) or
    BackupFailed.
    """
    source = sqlite_file(url, out)
    out = Path(out)
    if not source.is_file():
        raise BackupRefused(f"no SQLite database at {source} (from {_safe(url)}); check --db / AUTOTUNE_DB_URL")
    if out.is_dir():
        raise BackupRefused(f"{out} is a folder; give the backup's file name, e.g. {out / 'autotune-backup.db'}")
    if out.exists() or out.is_symlink():
        if out.resolve() == source.resolve():
            raise BackupRefused(f"{out} is the database itself; give another file name")
        if not force:
            raise BackupRefused(f"{out} exists; pass --force to replace it, or give another file name")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BackupRefused(f"cannot create the folder {out.parent} ({e.strerror or e})") from None

    # mode=rw: a missing file is an error rather than a new empty database.
    source_uri = f"file:{urllib.parse.quote(source.resolve().as_posix())}?mode=rw"
    fd, partial_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent)
    os.close(fd)
    partial = Path(partial_name)
    try:
        try:
            with contextlib.closing(sqlite3.connect(source_uri, uri=True, timeout=busy_timeout_s)) as src, \
                    contextlib.closing(sqlite3.connect(partial, timeout=busy_timeout_s)) as dst:
                src.backup(dst)  # pages=-1: the whole database in one step, i.e. one read transaction
                dst.execute("PRAGMA journal_mode=DELETE")  # a single self-contained file (the service re-enables WAL)
                check = dst.execute("PRAGMA quick_check").fetchone()[0]
                if check != "ok":
                    raise BackupFailed(f"the copy of {source} failed SQLite's check: {check}")
                counts = _counts(dst)
        except sqlite3.Error as e:
            raise BackupFailed(f"copying {source} failed ({type(e).__name__}: {e})") from None
        if out.exists() and not force:  # appeared while copying
            raise BackupRefused(f"{out} appeared while copying; pass --force to replace it")
        os.replace(partial, out)
    finally:
        for leftover in (partial, Path(f"{partial}-journal"), Path(f"{partial}-wal"), Path(f"{partial}-shm")):
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()
    return BackupResult(source=source, out=out, size_bytes=out.stat().st_size, counts=counts)
