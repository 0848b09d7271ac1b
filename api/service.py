"""The trial lifecycle: lease → heartbeat/report → complete. Routes call this; it owns every
transaction. Studies are api/studies.py, what runs next api/leasing.py, the 409 rule
api/ownership.py, the stale-lease reaper api/reaper.py.

Concurrency: a study's asks and tells (lease, complete, the reaper) run under that study's lock,
as its sampler is not thread safe; a lease also holds the worker's lock. Heartbeats and reports
take no lock: one conditional UPDATE checks and refreshes the lease. Optuna commits on its own
connections, so a unit of work calls Optuna first and writes the service tables last; the next
call or the reaper repairs a crash in between.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from autotune.api import crud
from autotune.api.db import as_naive_utc, utcnow
from autotune.api.errors import Conflict, Invalid, NotFound, ServiceError
from autotune.api.leasing import ROUND_HOLD_S, Planner, not_for
from autotune.api.optuna_bridge import StudyContext
from autotune.api.outcome import (
    PRESET_RAN_ATTR,
    config_differences,
    config_key_problems,
    config_to_store,
    preset_knobs_ran,
    preset_values,
    probe_outcome,
)
from autotune.api.ownership import another_lease, not_yours, refusal
from autotune.api.reaper import lost_attrs
from autotune.api.settings import Settings
from autotune.api.studies import StudyService
from autotune.api.study import (
    NoRecommendation,
    Remeasurement,
    TrialRecord,
    baseline_summary,
    completed,
    gate_nrmse,
    is_feasible,
    metric,
    recommend,
    remeasure_key,
    remeasurement,
    role,
    trial_info,
    unneeded,
)
from autotune.api.study.prune_rules import Decision
from autotune.api.study.pruning import StudySummary, TrialReports, curve_of, decide
from autotune.api.study.trials import baseline_batch, batch_per_step
from autotune.contract.config import KNOBS
from autotune.contract.protocol import ProbeSpec
from autotune.contract.results import (
    CompleteRequest,
    HeartbeatReply,
    HeartbeatRequest,
    LeaseRequest,
    ReportReply,
    ReportRequest,
    TrialLease,
)
from autotune.contract.space import SpaceError
from autotune.contract.views import TrialInfo

log = logging.getLogger(__name__)


class TuningService(StudyService):
    """Studies and trials on one database (service tables + Optuna storage).

    The per-process caches below hold what only ever settles, keyed per study or trial and
    filled or dropped by events (a trial leased or finished, the count of finished trials
    changing), never by age: there is no time-to-live, so no TTL-cache library fits them."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.lock_factory: Callable[[], Any] = threading.RLock
        self._study_locks: dict[str, Any] = {}
        self._worker_locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self._gates: dict[str, float | None] = {}  # the gate, once every baseline seed has finished
        self._summaries: dict[str, StudySummary] = {}  # per study: what pruning compares with
        self._reports: dict[int, TrialReports] = {}  # per running trial: its own reports
        # per study: the verdict replayed at a count of finished trials (`_verdict_so_far`)
        self._replays: dict[str, tuple[int, Remeasurement]] = {}
        self._roles: dict[int, str] = {}  # trial id -> role, for running trials leased by this process
        self._leased_configs: dict[int, dict[str, Any]] = {}  # trial id -> its leased config (same trials)
        self._planner = Planner(self.bridge, self._gates, self._gate)  # what each study runs next
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
            summary.add_baseline(curve, samples if isinstance(samples, int) else None, baseline_batch(trial))
        elif role(trial) == "search" and is_feasible(trial, ctx.spec, gate):
            throughput = metric(trial, ctx.spec, "throughput_samples_per_s")
            if throughput is not None:
                summary.add_feasible(throughput, curve, metric(trial, ctx.spec, "energy_j_per_sample"))

    def _larger_batch(self, ctx: StudyContext, trial_id: int, summary: StudySummary) -> bool:
        """Whether a running search trial's quality is judged at the re-measure budget
        (remeasure.larger_batch_quality "remeasure"): its leased config's samples per optimizer step
        (a knob left null: the preset's) above the baseline's (api.study.front.deferred_candidates)."""
        if ctx.spec.remeasure.larger_batch_quality != "remeasure" or summary.baseline_batch is None:
            return False
        preset = preset_values(ctx.spec.workload, ctx.spec.preset) or self._preset_ran(ctx)
        mine = batch_per_step(self._leased_config(trial_id), preset)
        return mine is not None and mine > summary.baseline_batch

    def _role_of(self, trial_id: int) -> str:
        known = self._roles.get(trial_id)
        if known is None:
            trial = self.bridge.get_trial(trial_id)
            known = role(trial) if trial is not None else "search"
            self._roles[trial_id] = known
        return known

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
        of lost trials before anything else (`Planner.plan`).
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
                    mismatch = not_for(self._ctx(pinned).spec, request)
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
                if not_for(ctx.spec, request) is not None:
                    continue  # not offered: this worker does not run its workload, or not at its world size
                with self._study_lock(ctx.name), self.db.transaction() as session:
                    # PostgreSQL: the study row stays locked until the lease is in, which serialises
                    # the trial count and the baseline choice across service processes
                    record = crud.get_study(session, ctx.name, for_update=True)
                    if record is None or record.state != "running":
                        continue
                    created = self.bridge.n_trials(ctx.name)
                    plan = self._planner.plan(ctx, created, request.worker_id,
                                              busy=partial(crud.lease_holders, session, ctx.name,
                                                           now - timedelta(seconds=ROUND_HOLD_S)))
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
        of it: NotFound (no such trial), or the Conflict of `ownership.refusal`."""
        with self.db.read() as session:
            try:
                lease = self._lease_of(session, trial_id)
            except NotFound as e:
                return e
        return refusal(trial_id, lease, worker_id, verb, token)

    def heartbeat(self, trial_id: int, request: HeartbeatRequest) -> HeartbeatReply:
        """Record that the worker still runs the trial; say stop when it should not go on (its
        study was stopped, or the trial finished meanwhile). A trial the worker does not hold is
        the 409 report and complete give (`not_yours`), not a "stop"."""
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
            reports = self._reports.get(trial_id)
            trial_role = self._role_of(trial_id)
            search = trial_role == "search"
            summary = self._summary(ctx) if search else None
            if reports is None:
                reports = self._reports.setdefault(trial_id, TrialReports(
                    quality_deferred=summary is not None and self._larger_batch(ctx, trial_id, summary)))
            reports.add(request.step, request.metrics)
            reference = summary.reference() if summary is not None else None
            decision = decide(reports, reference, ctx.spec)
            if not decision.prune and trial_role == "remeasure" and (why := self._unneeded(ctx, trial_id)):
                decision = Decision(True, why, "unneeded")
            if decision.prune:
                log.info("trial %d of %s: prune (%s)", trial_id, study_name, decision.reason)
        with self.db.transaction() as session:
            crud.add_report(session, trial_id, study_name, request.step, request.metrics, now, decision.prune,
                            decision.reason)
        return ReportReply(prune=decision.prune, reason=decision.reason)

    def _verdict_so_far(self, ctx: StudyContext) -> Remeasurement:
        """The study's verdict replayed from its trials (api.study.remeasure), read again whenever its
        count of finished trials is not the one last replayed (completes through another service
        process included): one cached Optuna read per call while nothing finished."""
        finished = self.bridge.n_finished(ctx.name)
        with self._locks_guard:
            known = self._replays.get(ctx.name)
        if known is not None and known[0] == finished:
            return known[1]
        rm = remeasurement(ctx.spec, self.bridge.trials(ctx.name), self._gate(ctx))
        with self._locks_guard:
            self._replays[ctx.name] = (finished, rm)
        return rm

    def _unneeded(self, ctx: StudyContext, trial_id: int) -> str | None:
        """Why the running re-measurement `trial_id` no longer counts (api.study.remeasure.unneeded):
        its report is answered "prune", so a round started ahead of the verdict on another worker
        stops at its next window instead of running to its end."""
        trial = self.bridge.get_trial(trial_id)
        key = remeasure_key(trial) if trial is not None else None
        return None if key is None else unneeded(self._verdict_so_far(ctx), *key)

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
        stands). 409 (`another_lease`) for a result whose lease token is not the lease's, before
        anything else: it was measured for a lease of another database (or a restored copy),
        whatever the worker and trial id. 409 (`not_yours`) for a trial finished otherwise,
        held by another worker, or whose lease was reaped. A result
        for another config than the leased one is Invalid (422) and changes nothing: the trial
        stays leased to the worker, whose corrected complete goes through. (A malformed result
        never gets here: the route's validation answers 422, `autotune.contract.results.TrialResult`.)
        """
        now = utcnow()
        result = request.result.as_dict()
        with self.db.read() as session:
            lease = self._lease_of(session, trial_id)
            if lease is not None:
                record = crud.get_study(session, lease.study_name)
        if lease is None:  # never leased here
            refused = not_yours(trial_id, None, request.worker_id, "complete")
            assert refused is not None
            raise refused
        assert record is not None
        ctx = self._ctx(record)
        with self._study_lock(ctx.name):
            with self.db.read() as session:  # re-read under the study's lock: a reap or complete may have won
                lease = self._lease_of(session, trial_id)
                other = another_lease(trial_id, lease, request.lease_token, "complete")
                if other is not None:
                    raise other
                if (lease is not None and lease.worker_id == request.worker_id and not lease.active
                        and lease.outcome == "completed"):
                    trial = self.bridge.get_trial(trial_id)
                    assert trial is not None
                    return self._trial_view(ctx, trial)
                refused = not_yours(trial_id, lease, request.worker_id, "complete")
                if refused is not None:
                    raise refused
                pruned_because = crud.prune_reason(session, trial_id) if request.result.stopped_early else None
            reported = result.get("config")
            config = self._check_config(ctx, trial_id, reported)
            if config is not None:
                result["config"] = config
            ran = preset_knobs_ran(self._leased_config(trial_id), reported)
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
            verdict = recommend(ctx.name, ctx.spec, trials, ctx.space)
        except NoRecommendation:
            return
        self.bridge.set_recommendation(ctx, verdict.model_dump(mode="json"))

    # --- the reaper (its thread: api/reaper.py) ------------------------------------------------

    def reap_stale(self, now: datetime | None = None) -> list[int]:
        """Fail the trials of stale leases (no heartbeat for lease_grace_s at `now`, default: now)
        as "lost" and end those leases; also fail RUNNING trials that have no lease at all (the
        service died between creating and leasing them) once they are that old. A lost trial is
        re-run by the next lease (`Planner.plan`) while spec.max_retries allows. Nothing is stale
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
                    attrs = lost_attrs(self.bridge, ctx, trial, why)
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
                    why = "the trial was created but never leased (the service stopped in between)"
                    self.bridge.tell(ctx, trial, "FAIL", attrs=lost_attrs(self.bridge, ctx, trial, why))
                reaped.append(trial_id)
        return reaped
