"""Reads and writes of the service tables. Every helper takes a Session and never commits.

The caller (api/service.py, api/studies.py) owns the transaction. ORM rows never leave this module:
reads return frozen dataclasses.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import and_, or_, select, update
from sqlalchemy.orm import Session

from autotune.api.db import LeaseRow, ReportRow, ServiceRow, StudyRow, WorkerRow


@dataclass(frozen=True)
class StudyRecord:
    name: str
    spec: dict[str, Any]
    space: dict[str, Any]
    hardware: str
    state: str
    created_at: datetime
    stopped_at: datetime | None


@dataclass(frozen=True)
class LeaseRecord:
    trial_id: int
    study_name: str
    trial_number: int
    worker_id: str
    state: str
    outcome: str | None
    leased_at: datetime
    heartbeat_at: datetime
    finished_at: datetime | None
    token: str | None = None  # the lease's token (None: a lease from before tokens, migration 0004)

    @property
    def active(self) -> bool:
        return self.state == "active"


@dataclass(frozen=True)
class ReportRecord:
    trial_id: int
    step: int
    metrics: dict[str, float]
    at: datetime


def _study(row: StudyRow) -> StudyRecord:
    return StudyRecord(name=row.name, spec=dict(row.spec), space=dict(row.space), hardware=row.hardware,
                       state=row.state, created_at=row.created_at, stopped_at=row.stopped_at)


def _lease(row: LeaseRow) -> LeaseRecord:
    return LeaseRecord(trial_id=row.trial_id, study_name=row.study_name, trial_number=row.trial_number,
                       worker_id=row.worker_id, state=row.state, outcome=row.outcome, leased_at=row.leased_at,
                       heartbeat_at=row.heartbeat_at, finished_at=row.finished_at, token=row.token)


# Non-finite floats are not valid JSON (PostgreSQL's json type rejects NaN): stored as strings.
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def encode_metrics(metrics: dict[str, float]) -> dict[str, Any]:
    return {k: v if math.isfinite(v) else str(v) for k, v in metrics.items()}


def decode_metrics(stored: dict[str, Any]) -> dict[str, float]:
    return {k: _NON_FINITE[v] if isinstance(v, str) and v in _NON_FINITE else float(v) for k, v in stored.items()}


# --- studies -----------------------------------------------------------------------------------

def add_study(session: Session, name: str, spec: dict[str, Any], space: dict[str, Any], hardware: str,
              now: datetime) -> None:
    session.add(StudyRow(name=name, spec=spec, space=space, hardware=hardware, state="running", created_at=now))


def get_study(session: Session, name: str, *, for_update: bool = False) -> StudyRecord | None:
    """The study named `name`; with `for_update`, its row stays locked until the transaction ends
    (SELECT ... FOR UPDATE on PostgreSQL; SQLite ignores it and relies on its single writer)."""
    query = select(StudyRow).where(StudyRow.name == name)
    if for_update:
        query = query.with_for_update()
    row = session.scalars(query).one_or_none()
    return _study(row) if row is not None else None


def list_studies(session: Session) -> list[StudyRecord]:
    return [_study(r) for r in session.scalars(select(StudyRow).order_by(StudyRow.created_at, StudyRow.name))]


def leasable_studies(session: Session, hardware: str, name: str | None = None, *,
                     for_update: bool = True) -> list[StudyRecord]:
    """Running studies of exactly this hardware class (oldest first), rows locked FOR UPDATE
    unless `for_update` is False.

    The lock serialises lease creation per study across service processes on PostgreSQL.
    """
    query = select(StudyRow).where(StudyRow.state == "running", StudyRow.hardware == hardware)
    if name is not None:
        query = query.where(StudyRow.name == name)
    query = query.order_by(StudyRow.created_at, StudyRow.name)
    if for_update:
        query = query.with_for_update()
    return [_study(r) for r in session.scalars(query)]


def set_study_state(session: Session, name: str, state: str, now: datetime) -> None:
    session.execute(update(StudyRow).where(StudyRow.name == name)
                    .values(state=state, stopped_at=now if state == "stopped" else None))


# --- leases ------------------------------------------------------------------------------------

def get_lease(session: Session, trial_id: int) -> LeaseRecord | None:
    row = session.get(LeaseRow, trial_id)
    return _lease(row) if row is not None else None


def active_lease_of_worker(session: Session, worker_id: str) -> LeaseRecord | None:
    row = session.scalars(select(LeaseRow).where(LeaseRow.worker_id == worker_id, LeaseRow.state == "active")
                          ).one_or_none()
    return _lease(row) if row is not None else None


def new_lease_token() -> str:
    """A lease's token: a random UUID4, 32 hex digits (what `autotune.contract.results.LeaseToken` takes)."""
    return uuid.uuid4().hex


def add_lease(session: Session, trial_id: int, study_name: str, trial_number: int, worker_id: str,
              now: datetime) -> str:
    """Add an active lease; its token (new, random: the worker sends it back with the trial's calls)."""
    token = new_lease_token()
    session.add(LeaseRow(trial_id=trial_id, study_name=study_name, trial_number=trial_number, worker_id=worker_id,
                         state="active", leased_at=now, heartbeat_at=now, token=token))
    return token


def touch_lease(session: Session, trial_id: int, now: datetime) -> None:
    session.execute(update(LeaseRow).where(LeaseRow.trial_id == trial_id).values(heartbeat_at=now))


def touch_active_lease(session: Session, trial_id: int, worker_id: str, now: datetime,
                       token: str | None = None) -> str | None:
    """Refresh the heartbeat of `trial_id`'s lease if it is active and held by `worker_id` (and,
    when `token` is given, holds that token), in one conditional UPDATE (atomic against a
    concurrent reap or complete: the row is locked until the transaction ends). Returns the
    lease's study name, or None when nothing matched."""
    query = update(LeaseRow).where(LeaseRow.trial_id == trial_id, LeaseRow.worker_id == worker_id,
                                   LeaseRow.state == "active")
    if token is not None:
        query = query.where(LeaseRow.token == token)
    result = session.execute(query.values(heartbeat_at=now).returning(LeaseRow.study_name))
    return result.scalar_one_or_none()


def finish_lease(session: Session, trial_id: int, outcome: str, now: datetime) -> None:
    session.execute(update(LeaseRow).where(LeaseRow.trial_id == trial_id, LeaseRow.state == "active")
                    .values(state="done", outcome=outcome, finished_at=now))


def stale_leases(session: Session, heartbeat_before: datetime) -> list[LeaseRecord]:
    """Active leases whose last heartbeat is older than `heartbeat_before`."""
    query = select(LeaseRow).where(LeaseRow.state == "active", LeaseRow.heartbeat_at < heartbeat_before)
    return [_lease(r) for r in session.scalars(query.order_by(LeaseRow.trial_id))]


def leased_trial_ids(session: Session, study_name: str) -> set[int]:
    """Every trial of the study that was ever leased (active or done)."""
    return set(session.scalars(select(LeaseRow.trial_id).where(LeaseRow.study_name == study_name)))


def lease_holders(session: Session, study_name: str, completed_since: datetime) -> set[str]:
    """The workers holding an active lease of the study, or that completed one of its trials at or
    after `completed_since`."""
    query = select(LeaseRow.worker_id).where(LeaseRow.study_name == study_name, or_(
        LeaseRow.state == "active", and_(LeaseRow.outcome == "completed", LeaseRow.finished_at >= completed_since)))
    return set(session.scalars(query))


def active_leases(session: Session, study_name: str) -> list[LeaseRecord]:
    query = select(LeaseRow).where(LeaseRow.study_name == study_name, LeaseRow.state == "active")
    return [_lease(r) for r in session.scalars(query)]


# --- reports -----------------------------------------------------------------------------------

def add_report(session: Session, trial_id: int, study_name: str, step: int, metrics: dict[str, float],
               now: datetime, prune: bool = False, prune_reason: str | None = None) -> None:
    session.add(ReportRow(trial_id=trial_id, study_name=study_name, step=step, metrics=encode_metrics(metrics),
                          at=now, prune=prune, prune_reason=prune_reason[:2000] if prune_reason else None))


def prune_reason(session: Session, trial_id: int) -> str | None:
    """The reason of the trial's latest report answered with prune, if any (one indexed query)."""
    return session.scalars(select(ReportRow.prune_reason).where(ReportRow.trial_id == trial_id, ReportRow.prune)
                           .order_by(ReportRow.id.desc()).limit(1)).first()


def study_reports(session: Session, study_name: str) -> list[ReportRecord]:
    """Every intermediate report of the study, oldest first."""
    query = select(ReportRow).where(ReportRow.study_name == study_name).order_by(ReportRow.id)
    return [ReportRecord(trial_id=r.trial_id, step=r.step, metrics=decode_metrics(r.metrics), at=r.at)
            for r in session.scalars(query)]


# --- workers -----------------------------------------------------------------------------------

def see_worker(session: Session, worker_id: str, now: datetime, hardware: str | None = None) -> None:
    """Record that `worker_id` was heard from (and its hardware, when the call says it)."""
    row = session.get(WorkerRow, worker_id)
    if row is None:
        if hardware is None:
            return
        session.add(WorkerRow(worker_id=worker_id, hardware=hardware, last_seen=now))
        return
    row.last_seen = now
    if hardware is not None:
        row.hardware = hardware


def service_id(session: Session) -> str | None:
    """The service's identity (the UUID of ``autotune_service``, made with the tables); None when
    the row is missing (tables made by hand): workers then match spooled results by URL only."""
    return session.scalar(select(ServiceRow.service_id).where(ServiceRow.id == 1))
