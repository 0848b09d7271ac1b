"""The service's own tables, the engine and sessions that reach them, and schema upgrades.

Our tables are prefixed ``autotune_`` beside Optuna's in the same database; Alembic
(``migrations/``) sees only them, with its own version table. The lease table's primary key (the
trial id) and a partial unique index (one active lease per worker) make a double lease impossible
whatever the service processes do. `upgrade_schema` migrates under a lock, so processes starting
together migrate once. SQLite runs in WAL mode with a busy timeout, its file created 0600.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    JSON,
    Boolean,
    Connection,
    DateTime,
    Engine,
    ForeignKey,
    Index,
    Integer,
    String,
    create_engine,
    event,
    inspect,
    make_url,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker
from sqlalchemy.pool import NullPool

if TYPE_CHECKING:
    from alembic.config import Config

log = logging.getLogger(__name__)

STUDY_STATES = ("running", "stopped")
LEASE_STATES = ("active", "done")
LEASE_OUTCOMES = ("completed", "lost")
TOKEN_ROLES = ("worker", "admin")

TABLE_PREFIX = "autotune_"  # every service table (and only those) has it
VERSION_TABLE = "autotune_alembic_version"  # Optuna's schema owns the default `alembic_version`
# migrations/ lies next to the api package: in the source tree and in an installed wheel alike
MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
LEGACY_REVISION = "0001"  # the schema `Base.metadata.create_all` made before migrations existed
# pg_advisory_xact_lock key held while a database is migrated (any constant unique to autotune)
PG_MIGRATION_LOCK_KEY = 0x6175_746F_7475_6E65 & 0x7FFF_FFFF_FFFF_FFFF
# Alembic's `context` and `op` are module globals: one migration at a time per process
_MIGRATING = threading.Lock()


def utcnow() -> datetime:
    """Naive UTC now: every timestamp in the service tables is naive UTC (SQLite drops time zones)."""
    return datetime.now(timezone.utc).replace(tzinfo=None)


def as_naive_utc(moment: datetime) -> datetime:
    """`moment` as naive UTC (aware datetimes are converted, naive ones are taken as UTC)."""
    if moment.tzinfo is not None:
        return moment.astimezone(timezone.utc).replace(tzinfo=None)
    return moment


class Base(DeclarativeBase):
    pass


class StudyRow(Base):
    __tablename__ = "autotune_studies"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON, nullable=False)
    space: Mapped[dict[str, Any]] = mapped_column(JSON, nullable=False)
    hardware: Mapped[str] = mapped_column(String(200), nullable=False, index=True)
    state: Mapped[str] = mapped_column(String(16), nullable=False, default="running")
    created_at: Mapped[datetime] = mapped_column(DateTime, nullable=False)
    stopped_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)


class LeaseRow(Base):
    __tablename__ = "autotune_leases"
    __table_args__ = (
        # At most one active lease per worker, enforced by the database (not only by the service's lock).
        Index("uq_autotune_leases_active_worker", "worker_id", unique=True,
              sqlite_where=text("state = 'active'"), postgresql_where=text("state = 'active'")),
        Index("ix_autotune_leases_state_heartbeat", "state", "heartbeat_at"),
    )

    trial_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    study_name: Mapped[str] = mapped_column(ForeignKey("autotune_studies.name"), nullable=False, index=True)
    trial_number: Mapped[int] = mapped_column(Integer, nullable=False)
    worker_id: Mapped[str] = mapped_column(String(200), nullable=False)
    state: Mapped[str] = mapped_column(String(16), nullable=False, default="active")
    outcome: Mapped[str | None] = mapped_column(String(16), nullable=True)
    leased_at: Mapped[datetime] = mapped_column(DateTime, nullable=False)
    heartbeat_at: Mapped[datetime] = mapped_column(DateTime, nullable=False)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    # a random UUID4 hex made with the lease (migration 0004), handed to the worker with it; a result
    # that carries a token is taken only for the lease holding it (None: a lease from before tokens)
    token: Mapped[str | None] = mapped_column(String(32), nullable=True)


class ReportRow(Base):
    __tablename__ = "autotune_reports"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    trial_id: Mapped[int] = mapped_column(ForeignKey("autotune_leases.trial_id"), nullable=False, index=True)
    study_name: Mapped[str] = mapped_column(String(64), nullable=False, index=True)
    step: Mapped[int] = mapped_column(Integer, nullable=False)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON, nullable=False)
    at: Mapped[datetime] = mapped_column(DateTime, nullable=False)
    prune: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)
    prune_reason: Mapped[str | None] = mapped_column(String(2000), nullable=True)


class WorkerRow(Base):
    __tablename__ = "autotune_workers"

    worker_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    hardware: Mapped[str] = mapped_column(String(200), nullable=False)
    last_seen: Mapped[datetime] = mapped_column(DateTime, nullable=False)


class TokenRow(Base):
    __tablename__ = "autotune_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(64), nullable=False, unique=True, index=True)
    role: Mapped[str] = mapped_column(String(16), nullable=False)
    token_sha256: Mapped[str] = mapped_column(String(64), nullable=False, unique=True, index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, nullable=False)
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)


class ServiceRow(Base):
    __tablename__ = "autotune_service"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)  # always 1: one row
    service_id: Mapped[str] = mapped_column(String(36), nullable=False)
    created_at: Mapped[datetime] = mapped_column(DateTime, nullable=False)


def is_sqlite(url: str) -> bool:
    return url.startswith("sqlite")


def create_sqlite_file(url: str) -> None:
    """Create the database file of a SQLite `url` with mode 0600 if it does not exist yet.

    SQLite would create it with 0644 (less the umask): readable by every user of the host,
    while it holds the token hashes and every study. SQLite creates the -wal and -shm files
    with the mode of the database file, so they are 0600 too. An existing file is left as it
    is (its owner chose its mode); in-memory and URI databases are not files made here."""
    if not is_sqlite(url):
        return
    parsed = make_url(url)
    path = parsed.database
    if not path or path == ":memory:" or path.startswith("file:") or parsed.query.get("uri"):
        return
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        pass
    except OSError as e:  # a missing folder, no permission: SQLite's own open says so with the URL
        log.debug("could not create %s: %s", path, e)


def sqlite_engine_kwargs(busy_timeout_s: float) -> dict[str, Any]:
    """Engine arguments for SQLite: the driver-level busy timeout (seconds)."""
    return {"connect_args": {"timeout": busy_timeout_s}}


def enable_wal(dbapi_connection: Any, busy_timeout_s: float) -> None:
    """Give a new SQLite connection its busy timeout and put its database in WAL mode, waiting
    up to `busy_timeout_s` for other connections.

    The switch needs the exclusive lock, and SQLite answers "database is locked" at once, without
    the busy handler, when another connection is writing to a database still in rollback mode
    (several processes opening a new file together). So the pragma is retried until the deadline.
    """
    deadline = time.monotonic() + busy_timeout_s
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
        while True:
            try:
                cursor.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() >= deadline:
                    raise
            time.sleep(0.01)
    finally:
        cursor.close()


def install_sqlite_pragmas(engine: Engine, busy_timeout_s: float) -> None:
    """Run the WAL/busy-timeout pragmas on every new connection of `engine` (a SQLite engine).

    journal_mode=WAL persists in the database file; busy_timeout and synchronous are
    per connection. synchronous=NORMAL is safe in WAL mode (a power cut may lose the
    last commits, never corrupt the file).
    """

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_connection: Any, _record: Any) -> None:
        enable_wal(dbapi_connection, busy_timeout_s)
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute("PRAGMA foreign_keys=ON")
        finally:
            cursor.close()


def make_engine(url: str, busy_timeout_s: float = 30.0) -> Engine:
    """An engine for `url`; SQLite gets WAL mode and a busy timeout, other databases a pool."""
    if is_sqlite(url):
        create_sqlite_file(url)
        engine = create_engine(url, **sqlite_engine_kwargs(busy_timeout_s))
        install_sqlite_pragmas(engine, busy_timeout_s)
        return engine
    # No pool_pre_ping (a round trip per checkout, i.e. per call): a connection that died with a
    # database restart fails one call and invalidates the pool; clients retry 5xx.
    return create_engine(url, pool_recycle=1800, pool_size=10, max_overflow=20)


class Database:
    """The engine and session factory for the service tables.

    `transaction()` is the only way the service writes: it commits when the block ends and
    rolls back on any exception; `read()` never writes. CRUD helpers (api/crud.py) take the
    session and never commit.
    """

    def __init__(self, url: str, busy_timeout_s: float = 30.0) -> None:
        self.url = url
        self.busy_timeout_s = busy_timeout_s
        self.engine = make_engine(url, busy_timeout_s)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def upgrade(self) -> None:
        """Bring the service tables to the newest migration (see `upgrade_schema`); idempotent."""
        upgrade_schema(self.url, busy_timeout_s=self.busy_timeout_s)

    def create_tables(self) -> None:
        """The old name of `upgrade` (the tables are made by the migrations now)."""
        self.upgrade()

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        """One unit of work: commit on success, roll back on error, always close."""
        with self._sessions() as session, session.begin():
            yield session

    @contextmanager
    def read(self) -> Iterator[Session]:
        """A session for reads only: whatever it did is rolled back when the block ends."""
        with self._sessions() as session:
            try:
                yield session
            finally:
                session.rollback()

    def ping(self) -> None:
        with self.engine.connect() as connection:
            connection.execute(text("SELECT 1"))

    def dispose(self) -> None:
        self.engine.dispose()


# --- migrations (Alembic, migrations/) -------------------------------------------------------------


class MigrationError(Exception):
    """The database cannot be migrated (unknown revision, or a migration failed); the message says why."""


def is_service_table(name: str | None) -> bool:
    return name is not None and name.startswith(TABLE_PREFIX) and name != VERSION_TABLE


def include_name(name: str | None, type_: str, _parent_names: Any) -> bool:
    """Alembic's reflection filter: only the service tables are looked at (never Optuna's)."""
    return is_service_table(name) if type_ == "table" else True


def include_object(obj: Any, name: str | None, type_: str, _reflected: bool, _compare_to: Any) -> bool:
    """Alembic's object filter: service tables and what belongs to them."""
    if type_ == "table":
        return is_service_table(name)
    table = getattr(obj, "table", None)
    return table is None or is_service_table(table.name)


def migration_options(dialect: str) -> dict[str, Any]:
    """The `context.configure` options every migration run (and every schema comparison) uses."""
    return {"target_metadata": Base.metadata, "version_table": VERSION_TABLE, "include_name": include_name,
            "include_object": include_object, "render_as_batch": dialect == "sqlite", "compare_type": True}


def alembic_config(connection: Connection | None = None) -> Config:
    """An Alembic Config on `MIGRATIONS_DIR`; `connection` (if given) is the one env.py migrates."""
    from alembic.config import Config

    if not (MIGRATIONS_DIR / "env.py").is_file():
        raise MigrationError(f"the migrations are missing: {MIGRATIONS_DIR}/env.py not found; reinstall autotune "
                             "(`pip install -e .` in the source tree)")
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def _migration_engine(url: str, busy_timeout_s: float) -> Engine:
    """A pool-less engine for one migration run. SQLite: the driver's own transaction handling
    is off so that `begin()` emits BEGIN IMMEDIATE (the write lock, taken before anything is
    read) and DDL runs inside the transaction; foreign keys stay off, as batch migrations need."""
    if not is_sqlite(url):
        return create_engine(url, poolclass=NullPool)
    create_sqlite_file(url)
    engine = create_engine(url, poolclass=NullPool, **sqlite_engine_kwargs(busy_timeout_s))

    @event.listens_for(engine, "connect")
    def _autocommit_driver(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        enable_wal(dbapi_connection, busy_timeout_s)

    @event.listens_for(engine, "begin")
    def _begin_immediate(connection: Connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


@contextmanager
def migration_connection(url: str, busy_timeout_s: float = 30.0) -> Iterator[Connection]:
    """A connection inside one transaction that holds the database's migration lock; commits
    when the block ends, rolls back on error. Another process migrating the same database
    waits for it (PostgreSQL: advisory lock; SQLite: the write lock, up to the busy timeout),
    another thread of this process for the process's lock (taken first: no deadlock)."""
    engine = _migration_engine(url, busy_timeout_s)
    try:
        with _MIGRATING, engine.begin() as connection:
            if connection.dialect.name == "postgresql":
                connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": PG_MIGRATION_LOCK_KEY})
            yield connection
    finally:
        engine.dispose()


def schema_revision(connection: Connection) -> str | None:
    """The revision the service tables are at (None: no version row, e.g. an empty database)."""
    from alembic.runtime.migration import MigrationContext

    context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
    return context.get_current_revision()


def head_revision() -> str:
    """The newest migration's revision."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "migrations/versions has no revision"
    return head


def _run_alembic(connection: Connection, action: str, revision: str) -> None:
    from alembic import command
    from alembic.util import CommandError

    try:
        getattr(command, action)(alembic_config(connection), revision)
    except CommandError as e:
        raise MigrationError(f"cannot {action} the autotune tables to {revision!r}: {e}") from e


def _adopt_legacy_tables(connection: Connection) -> None:
    """Stamp a database whose service tables predate the migrations (made by create_all)."""
    if "autotune_studies" in inspect(connection).get_table_names() and schema_revision(connection) is None:
        log.warning("the autotune tables in this database predate migrations (no row in %s): adopting them as "
                    "revision %s, then upgrading", VERSION_TABLE, LEGACY_REVISION)
        _run_alembic(connection, "stamp", LEGACY_REVISION)


def upgrade_schema(url: str, revision: str = "head", busy_timeout_s: float = 30.0) -> tuple[str | None, str | None]:
    """Migrate the service tables of `url` up to `revision`; (revision before, revision after).

    Idempotent, and safe when several processes do it at once (they take turns). Never
    touches Optuna's tables. Raises MigrationError when it cannot.
    """
    with migration_connection(url, busy_timeout_s) as connection:
        _adopt_legacy_tables(connection)
        before = schema_revision(connection)
        _run_alembic(connection, "upgrade", revision)
        after = schema_revision(connection)
    if before != after:
        log.info("autotune tables migrated from %s to %s", before or "an empty database", after)
    return before, after


def downgrade_schema(url: str, revision: str, busy_timeout_s: float = 30.0) -> tuple[str | None, str | None]:
    """Migrate the service tables of `url` down to `revision` ("base": drop them all; their data
    is lost); (revision before, revision after). Optuna's tables are left alone."""
    with migration_connection(url, busy_timeout_s) as connection:
        before = schema_revision(connection)
        _run_alembic(connection, "downgrade", revision)
        after = schema_revision(connection)
    return before, after


def current_schema_revision(url: str, busy_timeout_s: float = 30.0) -> str | None:
    """The revision the service tables of `url` are at (None: not migrated yet)."""
    create_sqlite_file(url)  # SQLite makes a missing file: as one of ours (0600)
    engine = create_engine(url, poolclass=NullPool, **(sqlite_engine_kwargs(busy_timeout_s) if is_sqlite(url) else {}))
    try:
        with engine.connect() as connection:
            return schema_revision(connection)
    finally:
        engine.dispose()
