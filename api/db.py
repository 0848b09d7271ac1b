"""The service's own tables and the engine/session that reach them.

Optuna owns its tables (``studies``, ``trials``, ...) in the same database; ours are
prefixed ``autotune_`` so the two schemas never collide. All models live in this module,
so a later Alembic migration can target ``Base.metadata`` (with its own version table:
Optuna's schema already uses the default ``alembic_version``).

Tables:

* ``autotune_studies``: one row per study: the submitted spec, the resolved search space
  (frozen at creation, so editing a YAML file later cannot change a running study), the
  hardware class and the state (running | stopped).
* ``autotune_leases``: one row per trial handed to a worker. ``trial_id`` (Optuna's global
  trial id) is the primary key, so a trial can never be handed out twice; a partial unique
  index allows at most one *active* lease per worker.
* ``autotune_reports``: intermediate metrics a worker reported for a trial, with the prune
  decision the service answered (and its reason).
* ``autotune_workers``: every worker seen, with its hardware and when it was last heard from.

Engines: SQLite files run in WAL mode with a busy timeout (readers never block the single
writer; a writer waits instead of failing with "database is locked").
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import JSON, Boolean, DateTime, Engine, ForeignKey, Index, Integer, String, create_engine, event, text
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

STUDY_STATES = ("running", "stopped")
LEASE_STATES = ("active", "done")
LEASE_OUTCOMES = ("completed", "lost")


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


def is_sqlite(url: str) -> bool:
    return url.startswith("sqlite")


def sqlite_engine_kwargs(busy_timeout_s: float) -> dict[str, Any]:
    """Engine arguments for SQLite: the driver-level busy timeout (seconds)."""
    return {"connect_args": {"timeout": busy_timeout_s}}


def install_sqlite_pragmas(engine: Engine, busy_timeout_s: float) -> None:
    """Run the WAL/busy-timeout pragmas on every new connection of `engine` (a SQLite engine).

    journal_mode=WAL persists in the database file; busy_timeout and synchronous are
    per connection. synchronous=NORMAL is safe in WAL mode (a power cut may lose the
    last commits, never corrupt the file).
    """

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute("PRAGMA foreign_keys=ON")
        finally:
            cursor.close()


def make_engine(url: str, busy_timeout_s: float = 30.0) -> Engine:
    """An engine for `url`; SQLite gets WAL mode and a busy timeout, other databases a pool."""
    if is_sqlite(url):
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
        self.engine = make_engine(url, busy_timeout_s)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def create_tables(self) -> None:
        """Create the service tables that do not exist yet (Alembic replaces this later)."""
        Base.metadata.create_all(self.engine)

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
