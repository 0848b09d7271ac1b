"""The tuning service: studies and the trial lifecycle (lease → heartbeat/report → complete),
plus the stale-lease reaper. Routes call this; it owns every transaction.

Concurrency contract:

* Calls that ask or tell Optuna (lease, complete, the reaper) run under the lock of the
  study they touch (`TuningService._study_lock`), so within a process no two asks/tells of
  one study interleave (its sampler is not thread safe) while other studies go on. A lease
  also holds the asking worker's lock, so "does it hold a lease? else create one" is atomic
  per worker. Reports and heartbeats write only the service tables and take no lock: they
  check and refresh the lease in one conditional UPDATE, so a reaped or completed lease is
  seen atomically (409). Study creation keeps the process-wide `lock`.
* Pruning reads no report of the study: a report is judged on the trial's own reports (kept in
  memory per running trial) against a per-study summary (best feasible throughput and curve,
  the baseline seeds' mean curve) updated at complete time and built once per process from
  the trials. Another service process's completes reach it only when it is rebuilt (restart).
  A trial is never handed out twice; beyond the locks, the database guarantees it: the
  lease table's primary key is the trial id, a partial unique index allows one active
  lease per worker, and on PostgreSQL lease creation locks the study rows (SELECT ... FOR
  UPDATE), which serialises the trial count and the baseline choice across service processes.
* Optuna's storage commits its own transactions on its own connections. A unit of work
  therefore calls Optuna first and writes the service tables last: on SQLite (one writer at
  a time) a service transaction holding the write lock while Optuna waits for it would
  stall until the busy timeout. If the process dies between the two, the next call repairs
  it: a finished trial with an active lease counts as completed, a RUNNING trial without a
  lease is failed as "lost" by the reaper.
* Reads take no lock.

Crash recovery: a lease is heartbeated at lease time, by every heartbeat and every report.
The reaper (`reap_stale`, every reaper_interval_s) fails the trial of a lease silent for
lease_grace_s as Optuna FAIL, failure_kind "lost" (FAIL: the samplers ignore it; a silent
worker says nothing about the config), and ends the lease: the zombie's late calls get
409, heartbeat included. A lost trial is re-run as a new trial with the same role, config and
probe (user attrs retry_of, attempt), handed out before anything else, up to
spec.max_retries times (see api/study); retries do not count toward n_trials. All of it
is derived from the trials' user attrs, so a restarted service goes on where the old one
stopped; after a start, every lease gets one full grace period to heartbeat again (a
service outage is not a worker's silence).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from pydantic import ValidationError
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from autotune.api import crud
from autotune.api.db import Database, as_naive_utc, utcnow
from autotune.api.errors import Conflict, Invalid, NotFound, ServiceError
from autotune.api.optuna_bridge import OptunaBridge, StudyContext, StudyExists, check_sampler_fits
from autotune.api.outcome import (
    PRESET_KNOBS,
    config_differences,
    config_key_problems,
    config_to_store,
    preset_values,
    probe_outcome,
)
from autotune.api.settings import Settings
from autotune.api.study import (
    NoRecommendation,
    TrialRecord,
    attempt_of,
    baseline_failed_message,
    baseline_summary,
    completed,
    counts_by_state,
    current,
    failures_by_kind,
    front_infos,
    gate_nrmse,
    is_feasible,
    may_retry,
    metric,
    recommend,
    remeasure_key,
    remeasurement,
    retried_as,
    role,
    search_done,
    trial_info,
    trial_infos,
)
from autotune.api.study.prune_rules import Decision
from autotune.api.study.pruning import StudySummary, TrialReports, curve_of, decide
from autotune.contract.config import KNOBS, knobs_of
from autotune.contract.protocol import (
    ANOTHER_LEASE,
    CompleteRequest,
    HeartbeatReply,
    HeartbeatRequest,
    LeaseRequest,
    ProbeSpec,
    Recommendation,
    ReportReply,
    ReportRequest,
    StudyInfo,
    StudySpec,
    TrialInfo,
    TrialLease,
)
from autotune.contract.space import SpaceError, parse_space
from autotune.contract.starting import MAX_POINTS
from autotune.contract.starting import resolve as resolve_starting_points

log = logging.getLogger(__name__)
STORED = {"stored": True}  # StudySpec validation context for specs read back from the database


def _spec(record: crud.StudyRecord) -> StudySpec:
    """The stored spec; if it no longer validates as stored (a space file changed or vanished),
    validate it against the space frozen at creation. Validated as stored: a workload that was
    uninstalled from this host since must not make the study unreadable."""
    try:
        return StudySpec.model_validate(record.spec, context=STORED)
    except ValidationError:
        return StudySpec.model_validate({**record.spec, "space": record.space}, context=STORED)


def _context(record: crud.StudyRecord) -> StudyContext:
    return StudyContext(name=record.name, spec=_spec(record), space=parse_space(record.space))


@dataclass(frozen=True)
class Plan:
    """The next trial of a study (`TuningService._plan`): its role, a fixed config (None: sample
    the space), fixed params (the retry of a lost search trial), its user attrs, and the
    study's count of configurations so far (first attempts: retries do not count)."""

    role: str
    config: dict[str, Any] | None
    attrs: dict[str, Any]
    configs: int
    params: dict[str, Any] | None = None


@dataclass
class _RetryBook:
    """Per study, the lost trials whose fate is known for good: retried (trial id → the retry's
    number) or never to be retried. Both only ever grow, so caching them is safe across service
    processes; everything else is read from the database on each lease."""

    retried: dict[int, int] = field(default_factory=dict)
    final: set[int] = field(default_factory=set)


def _not_for(spec: StudySpec, request: LeaseRequest) -> tuple[str, str] | None:
    """Why a study's trials are not for the leasing worker, as (request field, message with the
    fix); None when they are. The worker would refuse a workload off its --allow-workload list,
    and a probe must span the study's number of GPUs."""
    if request.workloads is not None and spec.workload not in request.workloads:
        return "workloads", (f"study {spec.name!r} runs workload {spec.workload!r}, which this worker does not run "
                             f"(it runs: {', '.join(request.workloads) or 'none'}); start the worker with "
                             f"--allow-workload {spec.workload}, or pick another study")
    if spec.gpus_per_trial != request.gpus_per_trial:
        return "gpus_per_trial", (f"study {spec.name!r} runs each trial on {spec.gpus_per_trial} GPU(s) "
                                  f"(gpus_per_trial) and this worker on {request.gpus_per_trial}; start the worker "
                                  f"with --gpus-per-trial {spec.gpus_per_trial}, or pick another study")
    return None


def _not_yours(trial_id: int, lease: crud.LeaseRecord | None, worker_id: str, verb: str) -> Conflict | None:
    """The 409 that heartbeat, report and complete all give `worker_id` for a trial it may not
    act on (`verb`: what it tried); None when it holds the trial's active lease.

    One answer for the three calls, so a worker needs one rule: 409 means the trial is not its
    own any more, stop the probe and lease a new trial. (A heartbeat once said "stop" here
    instead, which a worker had to tell apart from a stopped study.) A finished trial says so
    whoever asks, "already completed", before any other reason: naming the worker that holds
    it would send the reader looking for a second worker that was never there."""
    if lease is not None and not lease.active and lease.outcome == "completed":
        return Conflict(f"cannot {verb} trial {trial_id}: it is already completed (by worker {lease.worker_id!r}); "
                        "its result stands, nothing more is taken for it: lease a new trial")
    if lease is None:
        why = "it was not leased by this service"
    elif not lease.active:
        why = ("its lease was reaped: no heartbeat within the grace period, the trial is marked FAIL (lost)"
               if lease.outcome == "lost" else f"its lease ended ({lease.outcome})")
    elif lease.worker_id != worker_id:
        why = f"it is leased to worker {lease.worker_id!r}, not {worker_id!r}"
    else:
        return None
    return Conflict(f"cannot {verb} trial {trial_id}: {why}; stop running it and lease a new trial")


PRESET_RAN_ATTR = "preset_ran"  # user attr of a plugin study's baseline: the preset's knobs as it ran them


def _preset_knobs_ran(leased: Mapping[str, Any] | None, reported: Any) -> dict[str, Any]:
    """The knobs the lease left to the preset (PRESET_KNOBS, None or absent in `leased`), as the
    probe reported running them."""
    if not isinstance(reported, Mapping):
        return {}
    leased = leased or {}
    return {k: reported[k] for k in PRESET_KNOBS if leased.get(k) is None and reported.get(k) is not None}


def _another_lease(trial_id: int, lease: crud.LeaseRecord | None, token: str | None, verb: str) -> Conflict | None:
    """The 409 for a call whose lease token (`token`) is not the token of the trial's lease: it
    was leased from another database (a backup keeps the service id, and trial ids restart at 1:
    the same id, study, number and worker may be another lease) or a restored copy. None when
    the call carries no token (an older worker: the other checks only), the trial has no lease
    here (`_not_yours` says so), or the tokens are the same. A lease from before tokens (None)
    holds no token: a call that carries one is for another lease."""
    if token is None or lease is None or lease.token == token:
        return None
    what = "this result was measured for" if verb == "complete" else "this call is for"
    fate = ("nothing is stored. The worker keeps the result in its spool, for the service, study and trial it "
            "was leased from, and delivers it when that service answers" if verb == "complete" else
            "stop running it and lease a new trial (a finished probe's result waits in the worker's spool for the "
            "service it was leased from)")
    return Conflict(f"cannot {verb} trial {trial_id}: {what} {ANOTHER_LEASE} {trial_id} than the one this service "
                    "holds (another database, or a restored copy of this one: trial ids restart at 1 in every "
                    f"database, and a backup keeps its service id); {fate}")


class TuningService:
    """Studies and trials on one database (service tables + Optuna storage)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.db = Database(settings.db_url, settings.sqlite_busy_timeout_s)
        self.db.create_tables()
        self.bridge = OptunaBridge(settings.db_url, settings.sqlite_busy_timeout_s)
        self.lock = threading.RLock()  # study creation only; the trial lifecycle takes per-study locks
        self.lock_factory: Callable[[], Any] = threading.RLock
        self._study_locks: dict[str, Any] = {}
        self._worker_locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self._contexts: dict[str, StudyContext] = {}  # a study's spec and space never change
        self._gates: dict[str, float | None] = {}  # the gate, once every baseline seed has finished
        self._remeasures_created: set[str] = set()  # studies whose re-measure trials all exist
        self._starting: dict[str, list[dict[str, Any]]] = {}  # per study: its starting points (contract.starting)
        self._summaries: dict[str, StudySummary] = {}  # per study: what pruning compares with
        self._reports: dict[int, TrialReports] = {}  # per running trial: its own reports
        self._roles: dict[int, str] = {}  # trial id -> role, for running trials leased by this process
        self._leased_configs: dict[int, dict[str, Any]] = {}  # trial id -> its leased config (same trials)
        self._retry_books: dict[str, _RetryBook] = {}  # per study, see _RetryBook
        self.started_at = utcnow()  # the reaper gives every lease one grace period after this
        self._service_id: str | None = None  # the database's identity (crud.service_id), once read

    def _study_lock(self, name: str) -> Any:
        with self._locks_guard:
            lock = self._study_locks.get(name)
            if lock is None:
                lock = self._study_locks[name] = self.lock_factory()
            return lock

    def _worker_lock(self, worker_id: str) -> Any:
        with self._locks_guard:
            lock = self._worker_locks.get(worker_id)
            if lock is None:
                lock = self._worker_locks[worker_id] = threading.Lock()
            return lock

    def _ctx(self, record: crud.StudyRecord) -> StudyContext:
        ctx = self._contexts.get(record.name)
        if ctx is None:
            ctx = self._contexts[record.name] = _context(record)
        return ctx

    def _gate(self, ctx: StudyContext) -> float | None:
        """The study's quality gate (see api/study). Cached once every baseline seed has
        finished (finished trials never change); until then read from the study (the baseline
        phase is short: a few trials)."""
        if ctx.name in self._gates:
            return self._gates[ctx.name]
        trials = self.bridge.trials(ctx.name)
        if not baseline_summary(ctx.spec, trials).finished:
            return None
        gate = self._gates[ctx.name] = gate_nrmse(ctx.spec, trials)
        return gate

    def _summary(self, ctx: StudyContext) -> StudySummary:
        """The study's pruning summary: kept up to date by `_learn` at complete time, and brought up
        to date from the study whenever its count of finished trials is not the one the summary
        last saw (completes through another service process: no process prunes on a stale
        summary). One cached Optuna read per call; the trials are read only after a change."""
        with self._locks_guard:
            summary = self._summaries.setdefault(ctx.name, StudySummary(total_samples=ctx.spec.probe.samples))
        finished = self.bridge.n_finished(ctx.name)
        if summary.finished != finished:
            gate = self._gate(ctx)
            trials = self.bridge.trials(ctx.name)
            with self._locks_guard:  # report threads: each trial learned once
                for trial in trials:
                    self._learn(ctx, summary, trial, gate)
                summary.finished = max(summary.finished, finished)
        return summary

    @staticmethod
    def _learn(ctx: StudyContext, summary: StudySummary, trial: TrialRecord, gate: float | None) -> None:
        if not completed(trial) or trial.number in summary.learned:
            return
        summary.learned.add(trial.number)
        curve = curve_of(trial.user_attrs.get("loss_curve"))
        if role(trial) == "baseline":
            samples = trial.user_attrs.get("samples_trained")
            summary.add_baseline(curve, samples if isinstance(samples, int) else None)
        elif role(trial) == "search" and is_feasible(trial, ctx.spec, gate):
            throughput = metric(trial, ctx.spec, "throughput_samples_per_s")
            if throughput is not None:
                summary.add_feasible(throughput, curve, metric(trial, ctx.spec, "energy_j_per_sample"))

    def _role_of(self, trial_id: int) -> str:
        known = self._roles.get(trial_id)
        if known is None:
            trial = self.bridge.get_trial(trial_id)
            known = role(trial) if trial is not None else "search"
            self._roles[trial_id] = known
        return known

    def close(self) -> None:
        self.bridge.close()
        self.db.dispose()

    # --- studies -------------------------------------------------------------------------------

    def create_study(self, spec: StudySpec) -> StudyInfo:
        """Create the Optuna study and the service row. Raises Conflict if the name is taken,
        Invalid if the sampler cannot search the space."""
        space = spec.resolved_space()
        try:
            check_sampler_fits(spec, space)
        except SpaceError as e:
            raise Invalid(e.field, str(e)) from e
        ctx = StudyContext(name=spec.name, spec=spec, space=space)
        with self.lock:
            with self.db.read() as session:
                if crud.get_study(session, spec.name) is not None:
                    raise Conflict(f"study {spec.name!r} already exists; choose another name "
                                   f"(or DELETE /v1/studies/{spec.name} only stops it: data is kept)")
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
            best: dict[str, Any] | None = recommend(record.name, ctx.spec, trials).model_dump(mode="json")
        except NoRecommendation as e:
            best = None
            if state != "running":
                message = str(e)
        return StudyInfo(name=record.name, state=state, spec=ctx.spec, counts=counts_by_state(trials),
                         remeasures=sum(role(t) == "remeasure" for t in current(trials)),
                         failures=failures_by_kind(trials), retried=len(retried_as(trials)), best=best,
                         message=message)

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
        spec = _spec(self._record(name))
        return trial_infos(self.bridge.trials(name), spec)

    def pareto(self, name: str) -> list[TrialInfo]:
        spec = _spec(self._record(name))
        trials = self.bridge.trials(name)
        return front_infos(trials, spec)

    def best(self, name: str) -> Recommendation:
        spec = _spec(self._record(name))
        try:
            return recommend(name, spec, self.bridge.trials(name))
        except NoRecommendation as e:
            raise NotFound(str(e)) from e

    # --- trials --------------------------------------------------------------------------------

    def _trial_view(self, ctx: StudyContext, trial: TrialRecord) -> TrialInfo:
        return trial_info(trial, ctx.spec, self._gate(ctx))

    def _lease_reply(self, ctx: StudyContext, trial: TrialRecord, token: str | None) -> TrialLease:
        config = trial.user_attrs.get("config")
        probe = trial.user_attrs.get("probe")
        return TrialLease(trial_id=trial.trial_id, study=ctx.name, number=trial.number, params=trial.params,
                          config=config if isinstance(config, dict) else {}, workload=ctx.spec.workload,
                          preset=ctx.spec.preset,
                          probe=ProbeSpec.model_validate(probe) if isinstance(probe, dict) else ctx.spec.probe,
                          is_baseline=role(trial) == "baseline", role=role(trial),  # type: ignore[arg-type]
                          lease_token=token, service_id=self._service_id)

    def _identity(self, session: Session) -> str | None:
        """The database's service id (`crud.service_id`), read once: it never changes."""
        if self._service_id is None:
            self._service_id = crud.service_id(session)
        return self._service_id

    def _pending_retries(self, ctx: StudyContext) -> tuple[list[TrialRecord], int]:
        """(the study's lost trials that wait for a retry, by number; how many retries exist).
        One light query when nothing was lost lately (the failed trials' ids); the retry links
        are read only while some lost trial's fate is open. Called under the study's lock."""
        book = self._retry_books.setdefault(ctx.name, _RetryBook())
        open_ids = [i for i in self.bridge.failed_trial_ids(ctx.name) if i not in book.retried and i not in book.final]
        pending: list[TrialRecord] = []
        if open_ids:
            links = {lost: number for number, lost in self.bridge.user_attr_values(ctx.name, "retry_of").items()
                     if isinstance(lost, int)}
            for trial_id in open_ids:
                trial = self.bridge.get_trial(trial_id)
                if trial is None:
                    continue
                if trial.number in links:
                    book.retried[trial_id] = links[trial.number]
                elif may_retry(ctx.spec, trial):
                    pending.append(trial)
                else:
                    book.final.add(trial_id)
        return sorted(pending, key=lambda t: t.number), len(book.retried)

    @staticmethod
    def _retry_plan(lost: TrialRecord, configs: int) -> Plan:
        """Re-run `lost`: same role, probe (seed included) and config; a search trial's params
        are enqueued again, so the sampler sees the same point."""
        attrs: dict[str, Any] = {"retry_of": lost.number, "attempt": attempt_of(lost) + 1}
        for key in ("probe", "baseline_seed", "remeasure_of", "remeasure_round", "starting_point"):
            if key in lost.user_attrs:
                attrs[key] = lost.user_attrs[key]
        trial_role = role(lost)
        if trial_role == "search":
            return Plan("search", None, attrs, configs, params=dict(lost.params))
        config = lost.user_attrs.get("config")
        knobs = knobs_of(config)
        return Plan(trial_role, knobs, attrs, configs)

    def _plan(self, ctx: StudyContext, created: int) -> Plan | None:
        """What the study's next trial is, given `created` trials so far, or None when it has
        nothing to hand out now. Retries of lost trials first; then the baselines; no search
        trial before every baseline seed has finished for good (the gate must exist); search
        trials up to max_trials configurations (retries not counted); re-measurements once the
        search is done. Called under the study's lock."""
        spec = ctx.spec
        pending, n_retries = self._pending_retries(ctx)
        configs = created - n_retries
        if pending:
            return self._retry_plan(pending[0], configs)
        if configs < spec.baseline_seeds:
            probe = spec.probe.model_copy(update={"seed": spec.probe.seed + configs})
            return Plan("baseline", spec.baseline_config(), {"probe": probe.model_dump(mode="json"),
                                                              "baseline_seed": configs}, configs)
        if ctx.name not in self._gates:
            self._gate(ctx)
            if ctx.name not in self._gates:
                return None  # a baseline seed is still running (or lost, its retry to come)
        if self._gates[ctx.name] is None:
            return None  # every baseline failed: nothing can be judged (the study says so)
        if configs < self.bridge.max_trials(ctx):
            index = configs - spec.baseline_seeds
            points = self._starting_points(ctx) if index < MAX_POINTS else []
            if index < len(points):
                return Plan("search", None, {"starting_point": index}, configs, params=points[index])
            return Plan("search", None, {}, configs)
        if ctx.name in self._remeasures_created:
            return None
        trials = self.bridge.trials(ctx.name)
        if not search_done(spec, trials, self.bridge.max_trials(ctx)):
            return None
        rm = remeasurement(spec, trials, self._gates[ctx.name])
        if not rm.next_round:  # the verdict is in: nothing more to re-measure
            if not rm.pending:
                self._remeasures_created.add(ctx.name)
            return None
        round_ = rm.rounds_done
        already = {remeasure_key(t) for t in trials}
        todo = [t for t in rm.next_round if (t.number, round_) not in already]
        if not todo:
            return None  # the round's trials all exist: wait for them before deciding the next
        target = todo[0]
        samples = spec.probe.samples or target.user_attrs.get("samples_trained")
        factor = spec.remeasure.samples_factor
        probe = spec.probe.model_copy(update={
            "samples": min(10_000_000, round(samples * factor)) if isinstance(samples, int) and samples else None,
            "windows": spec.remeasure.windows or spec.probe.windows,
            "seed": spec.probe.seed + spec.remeasure.seed_offset + round_,
            "timeout_s": min(86_400.0, spec.probe.timeout_s * factor)})
        config = target.user_attrs.get("config")
        knobs = knobs_of(config)
        return Plan("remeasure", knobs, {  # the effective config, less derived fields (effective_batch)
            "probe": probe.model_dump(mode="json"), "remeasure_of": target.number, "remeasure_round": round_}, configs)

    def _starting_points(self, ctx: StudyContext) -> list[dict[str, Any]]:
        """The study's starting points, derived once per process from its first finished
        baseline's effective config (what the probe ran: the preset's batch included)."""
        points = self._starting.get(ctx.name)
        if points is None:
            baseline = ctx.spec.baseline_config()
            for trial in self.bridge.trials(ctx.name):
                config = trial.user_attrs.get("config")
                if role(trial) == "baseline" and completed(trial) and isinstance(config, dict):
                    baseline = knobs_of(config)
                    break
            points = self._starting[ctx.name] = resolve_starting_points(
                ctx.spec.starting_points, ctx.space, baseline, ctx.spec.hardware, ctx.spec.sampler)
        return points

    def lease_trial(self, request: LeaseRequest) -> TrialLease | None:
        """The trial `request.worker_id` should run next, or None when there is nothing to do.

        Idempotent per worker: a worker holding an active lease gets that trial back. Only
        running studies of exactly the worker's hardware class are considered (oldest first;
        only `request.study` when given, NotFound if it does not exist), and of those only the
        ones whose workload the worker runs and whose gpus_per_trial equals the worker's (a
        pinned study that fails either is Invalid, naming the field and the worker option that
        fixes it). A study hands out its
        baseline seeds first, nothing else until they have all finished (the gate), then search
        trials up to n_trials in all, then the re-measurements of its top configs; the retries
        of lost trials before anything else (`_plan`).
        """
        now = utcnow()
        # The worker's lock makes "holds a lease already? else create one" atomic for one worker.
        # Lock order: worker lock, then study lock, then a database connection: no transaction
        # (pooled connection) is held while waiting for a study's lock, or a complete holding
        # that lock could wait for a connection forever (pool exhausted by waiting leases).
        with self._worker_lock(request.worker_id):
            with self.db.transaction() as session:
                if request.study is not None:
                    pinned = crud.get_study(session, request.study)
                    if pinned is None:
                        raise NotFound(f"no study named {request.study!r}; GET /v1/studies lists them")
                    mismatch = _not_for(self._ctx(pinned).spec, request)
                    if mismatch is not None:
                        raise Invalid(*mismatch)
                service_id = self._identity(session)
                held = crud.active_lease_of_worker(session, request.worker_id)
                if held is not None:
                    record = crud.get_study(session, held.study_name)
                    trial = self.bridge.get_trial(held.trial_id)
                    assert record is not None and trial is not None, "a lease always names a study and a trial"
                    crud.see_worker(session, request.worker_id, now, request.hardware)
                    return self._lease_reply(self._ctx(record), trial, held.token)
                candidates = crud.leasable_studies(session, request.hardware, request.study, for_update=False)
                if not candidates:
                    crud.see_worker(session, request.worker_id, now, request.hardware)
                    return None
            for candidate in candidates:
                ctx = self._ctx(candidate)
                if _not_for(ctx.spec, request) is not None:
                    continue  # not offered: this worker does not run its workload, or not at its world size
                with self._study_lock(ctx.name), self.db.transaction() as session:
                    # PostgreSQL: the study row stays locked until the lease is in, which serialises
                    # the trial count and the baseline choice across service processes
                    record = crud.get_study(session, ctx.name, for_update=True)
                    if record is None or record.state != "running":
                        continue
                    created = self.bridge.n_trials(ctx.name)
                    plan = self._plan(ctx, created)
                    if plan is None:
                        continue
                    attrs = plan.attrs
                    try:
                        asked = self.bridge.ask(ctx, baseline_config=plan.config, created=plan.configs,
                                                role=plan.role, attrs={**attrs, "worker_id": request.worker_id},
                                                params=plan.params)
                    except SpaceError:
                        log.exception("study %s: could not draw a config; trial failed", ctx.name)
                        continue
                    if asked is None:  # every draw repeated a config measured or in flight: told, none to run
                        if self.bridge.n_trials(ctx.name) >= self.bridge.max_trials(ctx):
                            self._publish_front(ctx)  # repeats used up the search: the verdict may be in
                        continue
                    try:
                        token = crud.add_lease(session, asked.trial_id, ctx.name, asked.number, request.worker_id,
                                               now)
                        session.flush()  # the database guards (primary key, one active lease per worker) fire here
                    except IntegrityError as e:  # another service process leased to this worker meanwhile
                        self.bridge.finish(ctx, asked.trial_id, "FAIL", attrs={
                            "failure_kind": "lost", "failure_message": "lease refused: the worker already holds one"})
                        raise Conflict(f"worker {request.worker_id!r} already holds a lease; ask again") from e
                    crud.see_worker(session, request.worker_id, now, request.hardware)
                self._roles[asked.trial_id] = asked.role
                self._leased_configs[asked.trial_id] = dict(asked.config)
                retry = f", retry of trial {attrs['retry_of']}" if "retry_of" in attrs else ""
                log.info("leased trial %d of %s to %s (%s%s)", asked.number, ctx.name, request.worker_id, asked.role,
                         retry)
                probe = ProbeSpec.model_validate(attrs["probe"]) if "probe" in attrs else ctx.spec.probe
                return TrialLease(trial_id=asked.trial_id, study=ctx.name, number=asked.number, params=asked.params,
                                  config=asked.config, workload=ctx.spec.workload, preset=ctx.spec.preset,
                                  probe=probe, is_baseline=asked.is_baseline,
                                  role=asked.role,  # type: ignore[arg-type]
                                  lease_token=token, service_id=service_id)
            with self.db.transaction() as session:
                crud.see_worker(session, request.worker_id, now, request.hardware)
            return None

    def _lease_of(self, session: Session, trial_id: int) -> crud.LeaseRecord | None:
        """The lease of `trial_id`; NotFound when no such trial exists at all."""
        lease = crud.get_lease(session, trial_id)
        if lease is None and self.bridge.get_trial(trial_id) is None:
            raise NotFound(f"no trial with id {trial_id}")
        return lease

    def _refresh_lease(self, trial_id: int, worker_id: str, now: datetime,
                       token: str | None = None) -> crud.StudyRecord | None:
        """Check that `worker_id` holds the active lease of `trial_id` (the one of `token`, when
        given) and refresh it, in one conditional UPDATE (a report is as good as a heartbeat);
        the lease's study, or None when the lease is not (or no longer) this worker's. One short
        write transaction: the callers read Optuna's storage only after it has ended (see `report`)."""
        with self.db.transaction() as session:
            study_name = crud.touch_active_lease(session, trial_id, worker_id, now, token)
            if study_name is None:
                return None
            crud.see_worker(session, worker_id, now)
            record = crud.get_study(session, study_name)
        assert record is not None, "a lease always names a study"
        return record

    def _refusal(self, trial_id: int, worker_id: str, verb: str, token: str | None = None) -> ServiceError:
        """Why `worker_id` may not `verb` the trial, after `_refresh_lease` found no active lease
        of it: NotFound (no such trial), or the Conflict of `_another_lease` or `_not_yours`."""
        with self.db.read() as session:
            try:
                lease = self._lease_of(session, trial_id)
            except NotFound as e:
                return e
        return _another_lease(trial_id, lease, token, verb) or _not_yours(trial_id, lease, worker_id, verb) or Conflict(
            f"cannot {verb} trial {trial_id}: its lease changed meanwhile; stop running it and lease a new trial")

    def heartbeat(self, trial_id: int, request: HeartbeatRequest) -> HeartbeatReply:
        """Record that the worker still runs the trial; say stop when it should not go on (its
        study was stopped, or the trial finished meanwhile). A trial the worker does not hold is
        the 409 report and complete give (`_not_yours`), not a "stop"."""
        record = self._refresh_lease(trial_id, request.worker_id, utcnow(), request.lease_token)
        if record is None:
            raise self._refusal(trial_id, request.worker_id, "heartbeat", request.lease_token)
        if record.state == "stopped":
            return HeartbeatReply(action="stop", reason=f"study {record.name!r} was stopped")
        trial = self.bridge.get_trial(trial_id)
        if trial is not None and trial.finished:
            return HeartbeatReply(action="stop", reason=f"trial {trial_id} already finished ({trial.state})")
        return HeartbeatReply(action="continue")

    def report(self, trial_id: int, request: ReportRequest) -> ReportReply:
        """Store an intermediate report and say whether the trial should stop (prune).

        Two short transactions on the service tables, and the decision between them: nothing
        reaches Optuna's storage while a write transaction is open. (On SQLite a write holds the
        file's one write lock; reading Optuna's cached storage meanwhile waits for its lock, which
        a lease in another thread holds while it writes a trial: a cycle only SQLite's busy
        timeout would break, after 30 s.)"""
        now = utcnow()
        record = self._refresh_lease(trial_id, request.worker_id, now, request.lease_token)
        if record is None:
            raise self._refusal(trial_id, request.worker_id, "report on", request.lease_token)
        study_name = record.name
        if record.state == "stopped":
            decision = Decision(True, f"study {study_name!r} was stopped", "stopped")
        else:
            # the trial's own reports come from a per-trial cache; the study's side from the per-study
            # summary kept at complete time: no report of the study is read
            ctx = self._ctx(record)
            reports = self._reports.setdefault(trial_id, TrialReports())
            reports.add(request.step, request.metrics)
            reference = self._summary(ctx).reference() if self._role_of(trial_id) == "search" else None
            decision = decide(reports, reference, ctx.spec)
            if decision.prune:
                log.info("trial %d of %s: prune (%s)", trial_id, study_name, decision.reason)
        with self.db.transaction() as session:
            crud.add_report(session, trial_id, study_name, request.step, request.metrics, now, decision.prune,
                            decision.reason)
        return ReportReply(prune=decision.prune, reason=decision.reason)

    def _check_config(self, ctx: StudyContext, trial_id: int, reported: Any) -> dict[str, Any] | None:
        """The config to keep for a result's `reported` config (None: keep the leased one), or
        Invalid (422, nothing changed) when it is not the config the trial was leased with: its
        numbers would be filed under a config that was not measured, and a trial's config feeds
        later leases (re-measurements, starting points) and best.yaml.

        Refused: keys that are neither knobs nor derived fields (`config_key_problems`), a knob
        other than the leased one, and a knob the lease left to the preset at another value than
        the preset's (`config_differences`; the preset's values: `preset_values`, for the
        built-in workloads). What is kept: `config_to_store`. No config (or an empty one) keeps
        the leased config, as before."""
        if not isinstance(reported, dict) or not reported:
            return None
        problems = config_key_problems(reported)
        if problems:
            raise Invalid("result.config", f"result.config: {'; '.join(problems)}. A config holds the knobs "
                          f"(autotune.contract.config: {', '.join(KNOBS)}) and the derived effective_batch: send the "
                          "probe's config as it reported it, or leave config out")
        leased = self._leased_config(trial_id)
        preset = preset_values(ctx.spec.workload, ctx.spec.preset)
        if preset is None:  # a plugin workload: what its first completed baseline ran with the preset's knobs
            preset = self._preset_ran(ctx)
        differences = config_differences(leased, reported, preset)
        if differences:
            raise Invalid("result.config", f"result.config: not the config trial {trial_id} was leased with: it "
                          f"differs in {'; '.join(differences)}. Send the result of the leased config "
                          "(TrialLease.config; knobs it leaves out are at their defaults, batch_size, accum_steps "
                          f"and lr at the preset's: {ctx.spec.workload}/{ctx.spec.preset}), or leave config out")
        return config_to_store(leased, reported, preset)

    def _leased_config(self, trial_id: int) -> dict[str, Any]:
        """The config `trial_id` was leased with (kept by this process, else its user attr)."""
        leased = self._leased_configs.get(trial_id)
        if leased is None:
            trial = self.bridge.get_trial(trial_id)
            config = trial.user_attrs.get("config") if trial is not None else None
            leased = config if isinstance(config, dict) else {}
        return leased

    def _preset_ran(self, ctx: StudyContext) -> dict[str, Any] | None:
        """A plugin workload's preset values of the knobs a lease leaves to the preset (batch_size,
        accum_steps, lr), as its first completed baseline seed ran them (user attr
        PRESET_RAN_ATTR); None before one is in. The service never imports a plugin, so this is
        the only way it knows them; every later result is held to them."""
        for trial in self.bridge.trials(ctx.name):
            ran = trial.user_attrs.get(PRESET_RAN_ATTR)
            if role(trial) == "baseline" and completed(trial) and isinstance(ran, dict) and ran:
                return dict(ran)
        return None

    def complete(self, trial_id: int, request: CompleteRequest) -> TrialInfo:
        """Finish the trial with the worker's ProbeResult (see api/outcome.py for the mapping).

        Idempotent: the same worker completing a trial it already completed (with the same lease
        token, or none) gets the stored TrialInfo back and nothing changes (the first result
        stands). 409 (`_another_lease`) for a result whose lease token is not the lease's, before
        anything else: it was measured for a lease of another database (or a restored copy),
        whatever the worker and trial id. 409 (`_not_yours`) for a trial finished otherwise,
        held by another worker, or whose lease was reaped. A result
        for another config than the leased one is Invalid (422) and changes nothing: the trial
        stays leased to the worker, whose corrected complete goes through. (A malformed result
        never gets here: the route's validation answers 422, `autotune.contract.protocol.TrialResult`.)
        """
        now = utcnow()
        result = request.result.as_dict()
        with self.db.read() as session:
            lease = self._lease_of(session, trial_id)
            if lease is not None:
                record = crud.get_study(session, lease.study_name)
        if lease is None:  # never leased here
            refusal = _not_yours(trial_id, None, request.worker_id, "complete")
            assert refusal is not None
            raise refusal
        assert record is not None
        ctx = self._ctx(record)
        with self._study_lock(ctx.name):
            with self.db.read() as session:  # re-read under the study's lock: a reap or complete may have won
                lease = self._lease_of(session, trial_id)
                other = _another_lease(trial_id, lease, request.lease_token, "complete")
                if other is not None:
                    raise other
                if (lease is not None and lease.worker_id == request.worker_id and not lease.active
                        and lease.outcome == "completed"):
                    trial = self.bridge.get_trial(trial_id)
                    assert trial is not None
                    return self._trial_view(ctx, trial)
                refusal = _not_yours(trial_id, lease, request.worker_id, "complete")
                if refusal is not None:
                    raise refusal
                pruned_because = crud.prune_reason(session, trial_id) if request.result.stopped_early else None
            reported = result.get("config")
            config = self._check_config(ctx, trial_id, reported)
            if config is not None:
                result["config"] = config
            ran = _preset_knobs_ran(self._leased_config(trial_id), reported)
            # a trial finished already (a crash between tell and the lease update) is left as it is: repair
            trial_role = self._role_of(trial_id)
            gate = self._gate(ctx)
            outcome = probe_outcome(result, ctx.spec, request.worker_id, gate, baseline=trial_role == "baseline")
            if outcome.state == "PRUNED":
                outcome.attrs["prune_reason"] = pruned_because or "stopped early by the worker"
            if ran and trial_role == "baseline" and preset_values(ctx.spec.workload, ctx.spec.preset) is None:
                outcome.attrs[PRESET_RAN_ATTR] = ran  # what a plugin's preset is: later results must match it
            trial, told = self.bridge.finish_once(ctx, trial_id, outcome.state, outcome.values, outcome.attrs)
            log.info("trial %d of %s (%s): %s", trial.number, ctx.name, trial_role, trial.state)
            metric = result.get("quality_metric")
            if told and outcome.state == "COMPLETE" and isinstance(metric, str):
                self.bridge.name_quality_metric(ctx, metric)  # a plugin's metric, known from its result
            self._reports.pop(trial_id, None)
            self._roles.pop(trial_id, None)
            self._leased_configs.pop(trial_id, None)
            summary = self._summaries.get(ctx.name)
            if trial_role == "baseline":
                gate = self._gate(ctx)  # set once the last baseline seed is in
            if summary is not None and told:  # a repair (told before a crash) is in the summary already
                with self._locks_guard:
                    self._learn(ctx, summary, trial, gate)
            if told and (trial_role == "remeasure" or self.bridge.n_trials(ctx.name) >= self.bridge.max_trials(ctx)):
                self._publish_front(ctx)  # the search is done: the verdict may be in
            with self.db.transaction() as session:
                crud.finish_lease(session, trial_id, "completed", now)
                crud.see_worker(session, request.worker_id, now)
            return self._trial_view(ctx, trial)

    def _publish_front(self, ctx: StudyContext) -> None:
        """Once the study's re-measurement has settled, store the verdict beside the trials in
        Optuna (study user attr autotune_recommendation: `autotune best`'s answer), for whoever
        reads the study with Optuna's tools. The trials' values stay what was measured.
        Called under the study's lock."""
        trials = self.bridge.trials(ctx.name)
        if remeasurement(ctx.spec, trials, gate_nrmse(ctx.spec, trials)).pending:
            return
        try:
            verdict = recommend(ctx.name, ctx.spec, trials)
        except NoRecommendation:
            return
        self.bridge.set_recommendation(ctx, verdict.model_dump(mode="json"))

    # --- the reaper ----------------------------------------------------------------------------

    def _lost_attrs(self, ctx: StudyContext, trial: TrialRecord, why: str) -> dict[str, Any]:
        """The failure attrs of `trial`, lost because `why`: the message says whether it will be
        re-run, or that its attempts are used up (naming every attempt's trial number)."""
        attempt = attempt_of(trial)
        limit = ctx.spec.max_retries
        if attempt <= limit:
            message = f"{why}; it will be re-run as a new trial (attempt {attempt + 1} of {limit + 1})"
        else:
            back = self.bridge.user_attr_values(ctx.name, "retry_of")  # trial number -> the number it re-runs
            chain = [trial.number]
            while isinstance(previous := back.get(chain[-1]), int) and previous not in chain:
                chain.append(previous)
            numbers = ", ".join(f"#{n}" for n in reversed(chain))
            times = "once" if attempt == 1 else f"{attempt} times"
            message = (f"lost {times} (trials {numbers}; max_retries {limit}), not retried again: last time {why}. "
                       "Check the workers' logs (killed? out of host memory? network?) or raise max_retries")
        return {"failure_kind": "lost", "failure_message": message}

    def reap_stale(self, now: datetime | None = None) -> list[int]:
        """Fail the trials of stale leases (no heartbeat for lease_grace_s at `now`, default: now)
        as "lost" and end those leases; also fail RUNNING trials that have no lease at all (the
        service died between creating and leasing them) once they are that old. A lost trial is
        re-run by the next lease (`_plan`) while spec.max_retries allows. Nothing is stale
        within lease_grace_s of this service's start: after a restart the workers get one
        grace period to heartbeat again. Returns the trial ids failed. Safe to call at any
        time, from any thread."""
        now = as_naive_utc(now) if now is not None else utcnow()
        grace = timedelta(seconds=self.settings.lease_grace_s)
        reaped: list[int] = []
        if now - grace < self.started_at:
            return reaped
        with self.db.read() as session:
            stale = crud.stale_leases(session, now - grace)
            records = {r.name: r for r in crud.list_studies(session)}
            leased = {name: crud.leased_trial_ids(session, name) for name in records}
        for lease in stale:
            ctx = self._ctx(records[lease.study_name])
            with self._study_lock(ctx.name):
                with self.db.read() as session:  # a complete or a heartbeat may have come in meanwhile
                    current = crud.get_lease(session, lease.trial_id)
                if current is None or not current.active or current.heartbeat_at >= now - grace:
                    continue
                trial = self.bridge.get_trial(lease.trial_id)
                if trial is not None and not trial.finished:
                    silent = (now - current.heartbeat_at).total_seconds()
                    why = (f"worker {lease.worker_id} stopped heartbeating "
                           f"(last heartbeat {silent:.0f} s ago; grace {grace.total_seconds():.0f} s)")
                    attrs = self._lost_attrs(ctx, trial, why)
                    self.bridge.tell(ctx, trial, "FAIL", attrs=attrs)
                    reaped.append(lease.trial_id)
                    log.warning("trial %d of %s lost: %s", lease.trial_number, ctx.name, attrs["failure_message"])
                with self.db.transaction() as session:
                    crud.finish_lease(session, lease.trial_id, "lost", now)
                self._leased_configs.pop(lease.trial_id, None)
        # Optuna's datetimes are naive local time: compare them with a local cutoff.
        local_cutoff = datetime.now() + (now - utcnow()) - grace
        for name, record in records.items():
            for trial_id in self.bridge.running_started_before(name, local_cutoff):
                if trial_id in leased[name]:
                    continue
                with self._study_lock(name):
                    trial = self.bridge.get_trial(trial_id)
                    if trial is None or trial.finished:
                        continue
                    ctx = self._ctx(record)
                    self.bridge.tell(ctx, trial, "FAIL", attrs=self._lost_attrs(
                        ctx, trial, "the trial was created but never leased (the service stopped in between)"))
                reaped.append(trial_id)
        return reaped


class Reaper:
    """A daemon thread calling `service.reap_stale()` every `interval_s` seconds until stopped."""

    def __init__(self, service: TuningService, interval_s: float) -> None:
        self._service = service
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="autotune-reaper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._service.reap_stale()
            except Exception:  # the reaper must outlive a bad sweep (e.g. the database restarting)
                log.exception("stale-lease sweep failed; retrying in %.0f s", self._interval_s)
