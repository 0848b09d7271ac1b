"""The study half of the service: create, read and stop studies, and their views.

`StudyService` owns the two stores (the service tables and Optuna's storage) and each study's
context; `TuningService` (api/service.py) builds the trial lifecycle on it. Reads take no lock.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from pydantic import ValidationError

from autotune.api import crud
from autotune.api.db import Database, utcnow
from autotune.api.errors import Conflict, Invalid, NotFound
from autotune.api.optuna_bridge import OptunaBridge, StudyContext, StudyExists
from autotune.api.settings import Settings
from autotune.api.study import (
    NoRecommendation,
    TrialRecord,
    baseline_failed_message,
    counts_by_state,
    current,
    failures_by_kind,
    front_infos,
    gate_nrmse,
    recommend,
    remeasurement,
    retried_as,
    role,
    search_done,
    trial_infos,
)
from autotune.api.study.admission import admission_notes, check_admission
from autotune.contract.protocol import StudySpec
from autotune.contract.space import parse_space
from autotune.contract.views import Recommendation, StudyInfo, TrialInfo

log = logging.getLogger(__name__)
STORED = {"stored": True}  # StudySpec validation context for specs read back from the database


def stored_spec(record: crud.StudyRecord) -> StudySpec:
    """The stored spec; if it no longer validates as stored (a space file changed or vanished),
    validate it against the space frozen at creation. Validated as stored: a workload that was
    uninstalled from this host since must not make the study unreadable."""
    try:
        return StudySpec.model_validate(record.spec, context=STORED)
    except ValidationError:
        return StudySpec.model_validate({**record.spec, "space": record.space}, context=STORED)


def _context(record: crud.StudyRecord) -> StudyContext:
    return StudyContext(name=record.name, spec=stored_spec(record), space=parse_space(record.space))


class StudyService:
    """Studies on one database (service tables + Optuna storage)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.db = Database(settings.db_url, settings.sqlite_busy_timeout_s)
        self.db.create_tables()
        self.bridge = OptunaBridge(settings.db_url, settings.sqlite_busy_timeout_s)
        self.lock = threading.RLock()  # study creation only; the trial lifecycle takes per-study locks
        self._contexts: dict[str, StudyContext] = {}  # a study's spec and space never change

    def _ctx(self, record: crud.StudyRecord) -> StudyContext:
        ctx = self._contexts.get(record.name)
        if ctx is None:
            ctx = self._contexts[record.name] = _context(record)
        return ctx

    def close(self) -> None:
        self.bridge.close()
        self.db.dispose()

    def create_study(self, spec: StudySpec) -> StudyInfo:
        """Create the Optuna study and the service row. Raises Conflict if the name is taken,
        Invalid if the study could not run as written (`check_admission`: a sampler that cannot
        search the space, a baseline its probes could not time, a metric the workload never reports)."""
        space = spec.resolved_space()
        check_admission(spec, space)
        ctx = StudyContext(name=spec.name, spec=spec, space=space)
        with self.lock:
            with self.db.read() as session:
                if crud.get_study(session, spec.name) is not None:
                    raise Conflict(f"study {spec.name!r} already exists; choose another name "
                                   f"(or DELETE /v1/studies/{spec.name} only stops it: data is kept)")
                if isinstance(spec.warm_start, list):
                    unknown = [n for n in spec.warm_start if crud.get_study(session, n) is None]
                    if unknown:
                        raise Invalid("warm_start", f"no study named {', '.join(map(repr, unknown))} in this "
                                                    "service: name studies GET /v1/studies lists, or use "
                                                    '"auto" (every earlier study of this workload, preset and '
                                                    "hardware)")
            try:
                self.bridge.create_study(ctx)
            except StudyExists as e:
                raise Conflict(f"an Optuna study named {spec.name!r} already exists in this database "
                               "(not created by this service); choose another name") from e
            try:
                with self.db.transaction() as session:
                    crud.add_study(session, spec.name, spec.model_dump(mode="json"), space.to_dict(), spec.hardware,
                                   utcnow())
            except Exception:
                self.bridge.delete_study(spec.name)  # keep the two stores consistent
                raise
        log.info("created study %s (%s sampler, %d trials, hardware %s)", spec.name, spec.sampler, spec.n_trials,
                 spec.hardware)
        return self.get_study(spec.name)

    def _record(self, name: str) -> crud.StudyRecord:
        with self.db.read() as session:
            record = crud.get_study(session, name)
        if record is None:
            raise NotFound(f"no study named {name!r}; GET /v1/studies lists them")
        return record

    def _study_info(self, record: crud.StudyRecord) -> StudyInfo:
        ctx = self._ctx(record)
        trials = self.bridge.trials(record.name)
        state: Any = record.state
        failed = baseline_failed_message(record.name, ctx.spec, trials)
        if state == "running" and (failed or self._finished(ctx, trials)):
            state = "finished"
        message = failed
        try:
            best: dict[str, Any] | None = recommend(record.name, ctx.spec, trials, ctx.space).model_dump(mode="json")
        except NoRecommendation as e:
            best = None
            if state != "running":
                message = str(e)
        return StudyInfo(name=record.name, state=state, spec=ctx.spec, counts=counts_by_state(ctx.spec, trials),
                         remeasures=sum(role(t) == "remeasure" for t in current(trials)),
                         failures=failures_by_kind(ctx.spec, trials), retried=len(retried_as(trials)), best=best,
                         message=message, notes=admission_notes(ctx.spec, ctx.space))

    def _finished(self, ctx: StudyContext, trials: list[TrialRecord]) -> bool:
        """Every baseline and search trial finished, and the verdict too: no re-measure round is
        to be created or running (none of them lost with a retry still to come)."""
        if not search_done(ctx.spec, trials, self.bridge.max_trials(ctx)):
            return False
        return not remeasurement(ctx.spec, trials, gate_nrmse(ctx.spec, trials)).next_round

    def get_study(self, name: str) -> StudyInfo:
        return self._study_info(self._record(name))

    def list_studies(self) -> list[StudyInfo]:
        with self.db.read() as session:
            records = crud.list_studies(session)
        return [self._study_info(r) for r in records]

    def stop_study(self, name: str) -> StudyInfo:
        """Stop leasing the study's trials; heartbeats of its running trials answer stop. Data is kept.
        Stopping a stopped study changes nothing."""
        with self.db.transaction() as session:
            record = crud.get_study(session, name)
            if record is None:
                raise NotFound(f"no study named {name!r}; GET /v1/studies lists them")
            if record.state != "stopped":
                crud.set_study_state(session, name, "stopped", utcnow())
                log.info("stopped study %s", name)
        return self.get_study(name)

    def list_trials(self, name: str) -> list[TrialInfo]:
        spec = stored_spec(self._record(name))
        return trial_infos(self.bridge.trials(name), spec)

    def pareto(self, name: str) -> list[TrialInfo]:
        spec = stored_spec(self._record(name))
        trials = self.bridge.trials(name)
        return front_infos(trials, spec)

    def best(self, name: str) -> Recommendation:
        ctx = self._ctx(self._record(name))
        try:
            return recommend(name, ctx.spec, self.bridge.trials(name), ctx.space)
        except NoRecommendation as e:
            raise NotFound(str(e)) from e
