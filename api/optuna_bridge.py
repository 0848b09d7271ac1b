"""Everything that touches Optuna: studies, samplers, ask/tell, trial reads.

Optuna types do not leave this module: trials come out as `TrialRecord` (a frozen
dataclass). Optuna's RDBStorage lives in the same database as the service tables and
commits its own transactions, so the service calls the bridge *before* it writes its own
tables in a unit of work (see api/service.py).

Thread safety: reads are safe from any thread (one shared `_CachedStorage`, which locks
internally). `create_study`, `ask` and `tell` mutate a study and its sampler; the service
calls them for one study under that study's lock, never concurrently.

Writes are batched: the user attrs of a trial are written in one transaction (one multi-row
upsert), not one transaction per attribute as `storage.set_trial_user_attr` would.

What Optuna holds is what its samplers and its dashboard are shown, so it follows autotune's
one definition of the front (api/results.py): a trial's measurement is in its user attrs
(throughput_samples_per_s, quality, ...), and its Optuna *values* are that measurement only for
a candidate (a feasible search trial that is not the baseline's config drawn again); every
other trial is told the worst-case values (`projected_values`): baseline seeds, re-measurements,
infeasible and failed trials, so none of them is ever on the dashboard's front or its "best
trials". Once a study's re-measurement has settled, each re-measured candidate's values are
replaced by its re-measured ones (`set_front_values`), or by the worst case when its
re-measurement failed or its quality failed the gate at that budget: the dashboard's front is
then `autotune best`'s. Baseline seeds and re-measurements carry the params of the config they
ran (where the value lies in the space), and the samplers never see them (`_SamplerView`):
they are not draws of the search.

No configuration is probed twice by the search: a draw of a config already measured, in flight
or the baseline's is a *repeat* (user attr repeat_of), told its twin's outcome and never leased
(`OptunaBridge.ask`).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import random
import re
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, cast, overload

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.exceptions import DuplicatedStudyError, ExperimentalWarning, UpdateFinishedTrialError
from optuna.samplers import BaseSampler
from optuna.storages import BaseStorage, RDBStorage
from optuna.storages._rdb import models as rdb_models
from optuna.storages._rdb.storage import _create_scoped_session
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy import func, select
from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect

from api.db import install_sqlite_pragmas, is_sqlite, sqlite_engine_kwargs
from autotune.config import normalised
from autotune.protocol import NAME_PATTERN, StudySpec
from autotune.samplers import CONSTRAINT_ATTR, make_sampler
from autotune.space import Param, Space, SpaceError, params_of, suggest

log = logging.getLogger(__name__)

FINISHED_STATES = ("COMPLETE", "FAIL", "PRUNED")
# A grid larger than this is refused at study creation: enumerating it would stall the service.
MAX_GRID_COMBINATIONS = 1_000_000
# A drawn search trial whose config is one measured, in flight or the baseline's is not run
# (`OptunaBridge.ask`); at most this many such draws per ask, then the ask hands out nothing.
MAX_REPEATS = 20
# user attr of a drawn trial held (RUNNING, never leased) until the in-flight trial it repeats has
# finished for good (`OptunaBridge._settle_repeats`): true while held, false once told
HELD_ATTR = "repeat_pending"
# lease-specific user attrs not carried over to a repeat
REPEAT_DROPPED_ATTRS = ("worker_id", "starting_point", "retry_of", "attempt", "grid_index", "remeasure_of",
                        "remeasure_round", "probe", "prune_reason")


class StudyExists(Exception):
    """An Optuna study of that name is already in the storage."""


@dataclass(frozen=True)
class TrialRecord:
    """One Optuna trial, by value."""

    trial_id: int
    number: int
    state: str  # TrialState name: RUNNING | WAITING | COMPLETE | PRUNED | FAIL
    params: dict[str, Any]
    values: list[float] | None
    user_attrs: dict[str, Any]
    datetime_start: datetime | None
    datetime_complete: datetime | None

    @property
    def finished(self) -> bool:
        return self.state in FINISHED_STATES

    @property
    def duration_s(self) -> float | None:
        if self.datetime_start is None or self.datetime_complete is None:
            return None
        return (self.datetime_complete - self.datetime_start).total_seconds()


@dataclass(frozen=True)
class AskedTrial:
    """A trial just created for a worker: its params and the full config the probe runs."""

    trial_id: int
    number: int
    params: dict[str, Any]
    config: dict[str, Any]
    is_baseline: bool
    role: str = "search"


@dataclass(frozen=True)
class StudyContext:
    """What the bridge needs to know about a study (from the service's studies table)."""

    name: str
    spec: StudySpec
    space: Space


NOT_SEARCH_ROLES = ("baseline", "remeasure")


def _sampler_sees(trial: FrozenTrial) -> bool:
    """A search trial: baseline seeds and re-measurements are not draws of the sampler."""
    return trial.user_attrs.get("role") not in NOT_SEARCH_ROLES


class _SamplerView:
    """The storage a study's sampler reads: Optuna's, less the baseline and re-measurement
    trials (their worst-case values would teach it that the baseline's config is bad)."""

    def __init__(self, base: Any) -> None:
        self._base = base

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)

    def get_all_trials(self, study_id: int, deepcopy: bool = True, states: Any = None) -> list[FrozenTrial]:
        trials: list[FrozenTrial] = self._base.get_all_trials(study_id, deepcopy=deepcopy, states=states)
        return [t for t in trials if _sampler_sees(t)]


class _AskSnapshot:
    """The storage a TPE study's sampler sees: Optuna's shared storage, except `get_all_trials`
    within `scope()` (one ask, under the study's lock), answered from a view of the study's
    trials kept in this process.

    Optuna re-reads every unfinished trial from the database on each `get_all_trials` (the
    running trials may change), and one TPE ask with constant_liar asks three times: for
    waiting trials, for the search space and, uncached, for the liars; with 64 trials running
    that was most of a lease. A running trial changes only when its ask sets its params (done
    before the ask returns) and when it finishes; this process finishes its trials through
    the bridge, which calls `finished()`. So the view reads, per ask, only the trials created
    since the last read and those finished since (one query), and everything once every
    FULL_REFRESH_S (trials that another service process finished; until then they count as
    running, i.e. as constant-liar liars). Answers within one ask come from one read; the trial
    being asked is not in it, which constant_liar filters out anyway."""

    FULL_REFRESH_S = 60.0

    def __init__(self, base: Any, backend: RDBStorage) -> None:
        self._base = base
        self._backend = backend
        self._view: dict[int, FrozenTrial] | None = None  # trial id -> trial
        self._refreshed = 0.0
        self._dirty: set[int] = set()  # finished (or popped) since the last read
        self._memo: list[FrozenTrial] | None = None
        self._in_scope = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        self._in_scope, self._memo = True, None
        try:
            yield
        finally:
            self._in_scope, self._memo = False, None

    def finished(self, trial_id: int) -> None:
        self._dirty.add(trial_id)

    def _read(self, study_id: int) -> list[FrozenTrial]:
        now = time.monotonic()
        if self._view is None or now - self._refreshed > self.FULL_REFRESH_S:
            self._view = {t._trial_id: t for t in self._base.get_all_trials(study_id, deepcopy=False)}
            self._refreshed = now
        else:
            newest = max(self._view, default=-1)
            fresh = self._backend._get_trials(study_id, states=None, included_trial_ids=set(self._dirty),
                                              trial_id_greater_than=newest)
            self._view.update((t._trial_id, t) for t in fresh)
        self._dirty.clear()
        return sorted(self._view.values(), key=lambda t: t.number)

    def get_all_trials(self, study_id: int, deepcopy: bool = True, states: Any = None) -> list[FrozenTrial]:
        if not self._in_scope:
            trials: list[FrozenTrial] = self._base.get_all_trials(study_id, deepcopy=deepcopy, states=states)
            return [t for t in trials if _sampler_sees(t)]
        if self._memo is None:
            self._memo = self._read(study_id)
        trials = [t for t in self._memo if _sampler_sees(t)]
        if states is not None:
            trials = [t for t in trials if t.state in states]
        return copy.deepcopy(trials) if deepcopy else list(trials)

    def set_trial_state_values(self, trial_id: int, state: TrialState, values: Any = None) -> bool:
        self._dirty.add(trial_id)  # a waiting trial popped, or a trial failed: read it again
        self._memo = None
        ok: bool = self._base.set_trial_state_values(trial_id, state, values)
        return ok


@dataclass
class _Handle:
    study: optuna.Study
    snapshot: _AskSnapshot | None = None  # TPE studies: one trial read per ask (see _AskSnapshot)
    grid: list[dict[str, Any]] | None = None  # grid sampler: the shuffled, de-duplicated configurations
    lock: threading.Lock = field(default_factory=threading.Lock)


def _record(trial: FrozenTrial) -> TrialRecord:
    return TrialRecord(trial_id=trial._trial_id, number=trial.number, state=trial.state.name,
                       params=dict(trial.params), values=list(trial.values) if trial.values is not None else None,
                       user_attrs=dict(trial.user_attrs), datetime_start=trial.datetime_start,
                       datetime_complete=trial.datetime_complete)


def directions(spec: StudySpec) -> list[StudyDirection]:
    """Optuna directions in the spec's objective order (throughput maximize; quality: the study's
    quality direction, StudySpec.quality_direction)."""
    return [StudyDirection[d.upper()] for d in spec.objective_directions()]


def metric_names(spec: StudySpec) -> list[str]:
    """The names of the values Optuna stores, in objective order: throughput_samples_per_s and the
    quality metric's own name (val_nrmse, val_loss, ...; "quality" for a plugin workload whose
    metric the spec does not name)."""
    return spec.objective_metric_names()


def check_sampler_fits(spec: StudySpec, space: Space) -> None:
    """Raise SpaceError when the spec's sampler cannot search `space` (grid over a float range,
    or a grid too large to enumerate)."""
    if spec.sampler != "grid":
        return
    size = 1
    for p in space.params.values():
        size *= len(p.values())  # raises SpaceError for a float range, naming the parameter
    if size > MAX_GRID_COMBINATIONS:
        raise SpaceError("sampler", f"the grid has {size} combinations (limit {MAX_GRID_COMBINATIONS}); "
                                    "use sampler tpe, nsga2 or random, or fewer choices")


def build_sampler(spec: StudySpec, seed: int | None) -> BaseSampler:
    """The sampler the spec names (autotune.samplers.make_sampler: the gate is a constraint
    read from the trial's user attr ``constraint``). Grid studies use RandomSampler: their
    configs are enqueued."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExperimentalWarning)
        # Optuna 5 deprecates constraints_func (for Trial.set_constraint, which ask/tell by trial id
        # cannot use); it still reads the same stored constraints
        warnings.simplefilter("ignore", FutureWarning)
        return make_sampler(spec.sampler, seed)


class _BufferedSystemAttrs:
    """A storage stand-in for a sampler's `after_trial`: system attrs it sets (the constraints)
    are kept here and written in the finishing transaction, not one transaction each."""

    def __init__(self, base: Any) -> None:
        self._base = base
        self.attrs: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)

    def set_trial_system_attr(self, trial_id: int, key: str, value: Any) -> None:
        self.attrs[key] = value


def _distribution(param: Param) -> BaseDistribution:
    """The Optuna distribution `autotune.space.suggest` draws `param` from."""
    if param.choices is not None:
        return CategoricalDistribution(list(param.choices))
    assert param.low is not None and param.high is not None
    if param.is_int:
        return IntDistribution(int(param.low), int(param.high), step=int(param.step or 1), log=param.log)
    return FloatDistribution(float(param.low), float(param.high), step=param.step, log=param.log)


def projected_values(spec: StudySpec, attrs: Mapping[str, Any], values: list[float] | None) -> list[float] | None:
    """The values Optuna is told for a finished trial with user attrs `attrs` (see the module
    docstring): its measurement for a candidate, the worst case for every other trial."""
    if values is None:
        return None
    from api.outcome import worst_values  # api.outcome imports nothing of this module

    constraint = attrs.get(CONSTRAINT_ATTR)
    if (attrs.get("role") in NOT_SEARCH_ROLES or attrs.get("baseline_repeat_of") is not None
            or (isinstance(constraint, (int, float)) and constraint > 0)):
        return worst_values(spec)
    return values


def _engine_kwargs(url: str, busy_timeout_s: float) -> dict[str, Any]:
    # No pool_pre_ping: Optuna checks a connection out for every storage call (~10 per lease), and
    # a ping is a round trip each. A connection that died (database restart) fails one call, which
    # invalidates the pool; clients retry 5xx. pool_recycle bounds idle-connection age instead.
    return sqlite_engine_kwargs(busy_timeout_s) if is_sqlite(url) else {"pool_recycle": 1800, "pool_size": 10,
                                                                         "max_overflow": 20}


_OPTUNA_SCHEMA_HEAD: list[str] = []  # the installed Optuna's schema revision, read once per process


def _open_rdb(url: str, busy_timeout_s: float) -> RDBStorage:
    """Optuna's storage on `url`, its schema checked against the installed Optuna. Optuna's own
    check reads its migration scripts from disk on every open (~0.3 s); the head they name is
    fixed for the process, so it is read once and each open compares one row with it. A schema
    that differs is opened again with Optuna's check, which raises its own advice (`optuna
    storage upgrade`)."""
    kwargs = _engine_kwargs(url, busy_timeout_s)
    rdb = RDBStorage(url, engine_kwargs=kwargs, skip_compatibility_check=True)
    if not _OPTUNA_SCHEMA_HEAD:
        _OPTUNA_SCHEMA_HEAD.append(rdb.get_head_version())
    if rdb.get_current_version() != _OPTUNA_SCHEMA_HEAD[0]:
        rdb.engine.dispose()
        rdb = RDBStorage(url, engine_kwargs=kwargs)
    return rdb


class OptunaBridge:
    """Optuna studies on the service's database URL."""

    def __init__(self, url: str, busy_timeout_s: float = 30.0) -> None:
        rdb = _open_rdb(url, busy_timeout_s)
        if is_sqlite(url):
            install_sqlite_pragmas(rdb.engine, busy_timeout_s)
            rdb.engine.dispose()  # pooled connections from table creation predate the pragmas
        self._rdb = rdb
        # One shared cache for every Study object of this process (load_study would wrap anew).
        self.storage = optuna.storages.get_storage(rdb)
        self._handles: dict[str, _Handle] = {}
        self._handles_lock = threading.Lock()
        self._study_ids: dict[str, int] = {}  # name -> Optuna study id (fixed for a study's life)

    def close(self) -> None:
        self._rdb.engine.dispose()

    # --- studies -------------------------------------------------------------------------------

    def create_study(self, ctx: StudyContext) -> None:
        """Create the Optuna study: directions and metric names from the objectives; the spec as
        user attrs (for the dashboard). Raises StudyExists."""
        try:
            study = optuna.create_study(study_name=ctx.name, storage=self.storage, directions=directions(ctx.spec),
                                        sampler=build_sampler(ctx.spec, ctx.spec.seed))
        except DuplicatedStudyError as e:
            raise StudyExists(ctx.name) from e
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ExperimentalWarning)
            study.set_metric_names(metric_names(ctx.spec))
        study.set_user_attr("autotune_spec", ctx.spec.model_dump(mode="json"))
        with self._handles_lock:
            self._handles[ctx.name] = self._new_handle(ctx, study)

    def name_quality_metric(self, ctx: StudyContext, metric: str) -> bool:
        """Name the quality objective after `metric` where the study's spec could not (a plugin
        workload's metric is known from its first result): Optuna's metric names, and so the
        dashboard, then say e.g. ``val_loss`` instead of ``quality``. Returns whether it renamed."""
        if ctx.spec.quality_metric or not re.fullmatch(NAME_PATTERN, metric):
            return False
        study = self._handle(ctx).study
        names = metric_names(ctx.spec)
        if study.metric_names != names:  # renamed already (by this process or another)
            return False
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ExperimentalWarning)
            study.set_metric_names(ctx.spec.objective_metric_names(metric))
        return True

    def delete_study(self, name: str) -> None:
        with self._handles_lock:
            self._handles.pop(name, None)
            self._study_ids.pop(name, None)
        optuna.delete_study(study_name=name, storage=self.storage)

    def exists(self, name: str) -> bool:
        try:
            self.storage.get_study_id_from_name(name)
        except KeyError:
            return False
        return True

    def _handle(self, ctx: StudyContext) -> _Handle:
        with self._handles_lock:
            handle = self._handles.get(ctx.name)
            if handle is None:
                # A sampler made in a fresh process with the study's seed would repeat the draws of
                # the first process; offset the seed by the trials already made (still reproducible).
                seed = None if ctx.spec.seed is None else ctx.spec.seed + self.n_trials(ctx.name)
                study = optuna.load_study(study_name=ctx.name, storage=self.storage,
                                          sampler=build_sampler(ctx.spec, seed))
                handle = self._handles[ctx.name] = self._new_handle(ctx, study)
            return handle

    def _new_handle(self, ctx: StudyContext, study: optuna.Study) -> _Handle:
        if ctx.spec.sampler != "tpe":
            study._storage = cast(BaseStorage, _SamplerView(self.storage))  # duck-typed, as below
            return _Handle(study)
        snapshot = _AskSnapshot(self.storage, self._rdb)
        study._storage = cast(BaseStorage, snapshot)  # a stand-in (duck-typed); only this Study object reads through it
        return _Handle(study, snapshot=snapshot)

    def _grid(self, ctx: StudyContext, handle: _Handle) -> list[dict[str, Any]]:
        with handle.lock:
            if handle.grid is None:
                grid = ctx.space.grid()
                random.Random(ctx.spec.seed or 0).shuffle(grid)  # same order in every process
                handle.grid = grid
            return handle.grid

    def study_id(self, name: str) -> int:
        """Optuna's id of the study `name` (KeyError if there is none); cached."""
        study_id = self._study_ids.get(name)
        if study_id is None:
            study_id = self._study_ids[name] = self.storage.get_study_id_from_name(name)
        return study_id

    def n_trials(self, name: str) -> int:
        """Every trial the study ever created, whatever its state: one COUNT on the trials table
        (Optuna's get_n_trials would re-read every unfinished trial)."""
        study_id = self.study_id(name)
        with _create_scoped_session(self._rdb.scoped_session) as session:
            count = session.scalar(select(func.count(rdb_models.TrialModel.trial_id))
                                   .where(rdb_models.TrialModel.study_id == study_id))
        return int(count or 0)

    def max_trials(self, ctx: StudyContext) -> int:
        """How many baseline + search trials the study may hand out: n_trials (at least the
        baseline seeds), or fewer when a grid runs out. Re-measurements come on top."""
        seeds = ctx.spec.baseline_seeds
        if ctx.spec.sampler == "grid":
            return max(seeds, min(ctx.spec.n_trials, seeds + len(self._grid(ctx, self._handle(ctx)))))
        return max(seeds, ctx.spec.n_trials)

    # --- trials --------------------------------------------------------------------------------

    @overload
    def ask(self, ctx: StudyContext, baseline_config: Mapping[str, Any], attrs: Mapping[str, Any] | None = None,
            created: int | None = None, role: str | None = None,
            params: Mapping[str, Any] | None = None) -> AskedTrial: ...

    @overload
    def ask(self, ctx: StudyContext, baseline_config: None = None, attrs: Mapping[str, Any] | None = None,
            created: int | None = None, role: str | None = None,
            params: Mapping[str, Any] | None = None) -> AskedTrial | None: ...

    def ask(self, ctx: StudyContext, baseline_config: Mapping[str, Any] | None = None,
            attrs: Mapping[str, Any] | None = None, created: int | None = None,
            role: str | None = None, params: Mapping[str, Any] | None = None) -> AskedTrial | None:
        """Create the next trial. With `baseline_config` (a fixed config), nothing is suggested (its
        values may lie outside the space) and the trial's role is `role` (default baseline:
        user attr is_baseline=True). Otherwise a search trial: with `params` (the retry of a
        lost search trial, or a user's starting point) those values are enqueued and suggested
        again, so the trial has the same params and config, and it runs whatever it repeats;
        without, the space is sampled (grid: the next grid configuration).

        No duplicate probes: a sampled (or grid) draw whose config is one the study has measured
        or is measuring is not handed out (`_twins`: configs compared normalised, so two params
        that make the same training are one config). Such a draw is a *repeat* (user attr
        repeat_of; no worker ever runs it; it counts toward n_trials like any draw), and the
        space is sampled again:

        * the config of a search trial that completed with a measurement: told that trial's
          result at once (`_tell_repeat`), so the sampler sees the point again;
        * the baseline's config: told the first completed baseline seed's result, marked
          baseline_repeat_of (and repeat_of) that seed. Its Optuna values are what a run of the
          baseline's config as a search trial is told, the worst case (`projected_values`:
          the baseline measures the baseline, never a candidate), so the sampler learns the
          point is no finding;
        * the config of a search trial in flight (RUNNING, or lost with a retry to come): the
          drawn trial is *held*: it stays RUNNING with user attrs repeat_of and repeat_pending,
          is never leased (the reaper passes it over, `running_started_before`), and is told
          its twin's outcome once the twin has finished for good (`_settle_repeats`, from
          `finish_once`): its measurement, its failure or its pruning, following the twin's
          retries if it is lost. Until then the sampler sees it as one more running trial.

        Failed and pruned configs are not twins: a draw of one runs again. A draw is tried at
        most MAX_REPEATS times per ask and never beyond n_trials; when the last one allowed is
        still a repeat, the ask returns None: nothing to hand out (the caller leases nothing;
        the next ask samples again, so a study whose every remaining draw is a repeat uses up
        its budget and finishes). The handed-out config is stored as user attr "config",
        together with `attrs` and "role" (one write). `created`: the study's count of
        configurations (first attempts, retries not counted) before this ask, when the caller
        knows it. A config that fails the knob rules is told as a failed trial ("unsupported":
        COMPLETE with worst-case values and the failed constraint, see api/outcome.py) and
        SpaceError is raised."""
        from api.outcome import failed_attrs, worst_values  # api.outcome imports nothing of this module

        handle = self._handle(ctx)
        study = handle.study
        if baseline_config is not None:
            return self._create_fixed(ctx, study, dict(baseline_config), role or "baseline", attrs)
        role = "search"
        check = params is None  # the sampler's draw or the grid's next configuration (may repeat one)
        twins: dict[str, tuple[str, FrozenTrial]] = {}
        preset: dict[str, Any] = {}
        if check:
            trials = self.storage.get_all_trials(self.study_id(ctx.name), deepcopy=False)
            self._settle_repeats(ctx, trials)  # held repeats whose twin finished meanwhile (another process)
            twins, preset = self._twins(ctx, trials)
        configs = self._created(ctx, created)
        # draws this ask may spend on repeats: each counts toward n_trials
        allowed = min(MAX_REPEATS, self.max_trials(ctx) - configs)
        repeats = held = 0
        while True:
            if params is not None:
                study.enqueue_trial(dict(params))
            elif ctx.spec.sampler == "grid":
                grid = self._grid(ctx, handle)
                # the first baseline_seeds trials are the baseline; each repeat used one configuration
                index = configs + repeats - ctx.spec.baseline_seeds
                study.enqueue_trial(grid[index % len(grid)], user_attrs={"grid_index": index})
            with handle.snapshot.scope() if handle.snapshot is not None else contextlib.nullcontext():
                trial = study.ask()
                try:
                    config = suggest(ctx.space, trial)
                except ValueError as e:  # ConfigError/SpaceError: the space let through a bad combination
                    self.finish(ctx, trial._trial_id, "COMPLETE", worst_values(ctx.spec), {
                        **(attrs or {}), "role": role, "is_baseline": False,
                        **failed_attrs("unsupported", str(e))})
                    raise SpaceError("space", f"drew a config that breaks a knob rule: {e}") from e
            twin = twins.get(_config_key(config, preset)) if check else None
            if twin is None:
                break
            kind, twin_trial = twin
            if kind == "running":
                self._hold_repeat(ctx, trial, twin_trial, config)
                held += 1
            else:
                self._tell_repeat(ctx, trial._trial_id, trial.number, twin_trial, config, baseline=kind == "baseline")
            repeats += 1
            if repeats >= allowed:
                break
        if held:  # a twin finished by another service process while this ask held its repeat
            self._settle_repeats(ctx)
        if twin is not None:  # the last draw allowed repeated one too
            log.info("study %s: %d draw(s) repeated a config measured or in flight; nothing to hand out now",
                     ctx.name, repeats)
            return None
        self.set_user_attrs(trial._trial_id, {**(attrs or {}), "is_baseline": False, "role": role, "config": config})
        return AskedTrial(trial_id=trial._trial_id, number=trial.number, params=dict(trial.params),
                          config=config, is_baseline=False, role=role)

    def _create_fixed(self, ctx: StudyContext, study: optuna.Study, config: dict[str, Any], role: str,
                      attrs: Mapping[str, Any] | None) -> AskedTrial:
        """Create a baseline or re-measurement trial of `config` as one row set in one commit:
        RUNNING, with the params of its config (those the space could draw: `params_of`, so
        that Optuna's tables and its dashboard show them) and its user attrs (role,
        is_baseline, config, `attrs`). A service that dies right after still leaves a trial
        that says what it is: the reaper fails it as never leased and the next lease re-runs
        it in its role. (Written one by one, a crash between the trial's row and its role left
        a trial read as a search trial: the baseline counted as created but never ran, so the
        study had no gate and handed out nothing more.) No sampler is asked: the config is fixed."""
        params = params_of(ctx.space, normalised(config))  # a knob left out: its default
        is_baseline = role == "baseline"
        user_attrs = {key: json_safe(value) for key, value in
                      {**(attrs or {}), "is_baseline": is_baseline, "role": role, "config": config}.items()}
        template = FrozenTrial(number=0, trial_id=0, state=TrialState.RUNNING, value=None,
                               datetime_start=datetime.now(), datetime_complete=None, params=params,
                               distributions={name: _distribution(ctx.space.params[name]) for name in params},
                               user_attrs=user_attrs, system_attrs={}, intermediate_values={})
        trial_id = self.storage.create_new_trial(study._study_id, template_trial=template)
        number = self.storage.get_trial_number_from_id(trial_id)
        return AskedTrial(trial_id=trial_id, number=number, params=params, config=config,
                          is_baseline=is_baseline, role=role)

    def _created(self, ctx: StudyContext, created: int | None) -> int:
        """The study's configurations so far: `created` when the caller knows it, else counted."""
        return self.n_trials(ctx.name) if created is None else created

    def _twins(self, ctx: StudyContext, trials: list[FrozenTrial]
               ) -> tuple[dict[str, tuple[str, FrozenTrial]], dict[str, Any]]:
        """The configs a draw must not probe again, by `_config_key`, each with its twin:
        ("baseline", the first completed baseline seed), ("measured", the first search trial that
        completed with a measurement: not a failure, not a repeat) or ("running", a search trial
        in flight: RUNNING and not a held repeat, or lost with a retry to come), in that order
        of precedence; and the preset's values of the knobs the baseline left to the preset
        (what it ran says them). A search trial's config is the one it was leased, the space's
        fixed knobs and its params (its stored config is the effective one once it ran); the
        baseline's is the spec's baseline config, or what it ran. Pruned and failed search trials
        are no twins: their configs may run again."""
        from api.outcome import PRESET_KNOBS, retriable

        trials = sorted(trials, key=lambda t: t.number)
        base = next((t for t in trials if t.state == TrialState.COMPLETE and t.user_attrs.get("role") == "baseline"
                     and not t.user_attrs.get("failure_kind") and isinstance(t.user_attrs.get("config"), dict)), None)
        preset: dict[str, Any] = {}
        found: dict[str, tuple[str, FrozenTrial]] = {}
        if base is not None:
            leased, ran = normalised(ctx.spec.baseline_config()), normalised(base.user_attrs["config"])
            preset = {k: ran[k] for k in PRESET_KNOBS if leased.get(k) is None and ran.get(k) is not None}
            for config in (ctx.spec.baseline_config(), base.user_attrs["config"]):
                found.setdefault(_config_key(config, preset), ("baseline", base))
        rank = {"baseline": 0, "measured": 1, "running": 2}
        retried = {t.user_attrs.get("retry_of") for t in trials}
        for t in trials:
            attrs = t.user_attrs
            if attrs.get("role", "search") != "search" or attrs.get("is_baseline") or "repeat_of" in attrs:
                continue
            if t.state == TrialState.COMPLETE and not attrs.get("failure_kind") and t.values is not None:
                kind = "measured"
            elif ((t.state == TrialState.RUNNING and isinstance(attrs.get("config"), dict))
                  or (t.state == TrialState.FAIL and t.number not in retried and retriable(ctx.spec, "FAIL", attrs))):
                kind = "running"
            else:
                continue
            key = _config_key({**ctx.space.fixed, **t.params}, preset)
            if key not in found or rank[kind] < rank[found[key][0]]:
                found[key] = (kind, t)
        return found, preset

    def _hold_repeat(self, ctx: StudyContext, trial: optuna.Trial, twin: FrozenTrial,
                     config: Mapping[str, Any]) -> None:
        """Hold a drawn trial that repeats the config of `twin`, a trial in flight: it stays
        RUNNING, never leased, until `_settle_repeats` tells it `twin`'s outcome."""
        self.set_user_attrs(trial._trial_id, {"is_baseline": False, "role": "search", "config": dict(config),
                                              "repeat_of": twin.number, HELD_ATTR: True})
        log.info("study %s: trial %d drew the config of trial %d, still in flight: not run, told that trial's "
                 "outcome once it is in", ctx.name, trial.number, twin.number)

    def _tell_repeat(self, ctx: StudyContext, trial_id: int, number: int, twin: FrozenTrial,
                     config: Mapping[str, Any], baseline: bool = False, held: bool = False) -> None:
        """Finish a drawn trial that repeats `twin`'s config with `twin`'s outcome, without
        running it: the sampler sees the same point again (as it would from a re-run), and no
        GPU time goes into a configuration already measured (re-measurement is the `remeasure`
        phase's job). A measured twin's result is told COMPLETE; a held repeat's twin may also
        have failed or been pruned, and the repeat then ends the same way (a twin lost for
        good: Optuna FAIL with its attempt, so the repeat is not retried either). `baseline`:
        `twin` is a baseline seed (user attr baseline_repeat_of; Optuna is told the worst
        case, `projected_values`); `held`: the trial was held (`_hold_repeat`)."""
        from api.outcome import worst_values

        state = twin.state.name
        dropped = REPEAT_DROPPED_ATTRS + (("baseline_seed",) if baseline else ())
        kept = {k: v for k, v in twin.user_attrs.items() if k not in dropped}
        for key in {"FAIL": ("attempt",), "PRUNED": ("prune_reason",)}.get(state, ()):
            if key in twin.user_attrs:
                kept[key] = twin.user_attrs[key]
        attrs = {**kept, "role": "search", "is_baseline": False, "config": kept.get("config", dict(config)),
                 "repeat_of": twin.number}
        if baseline:
            attrs["baseline_repeat_of"] = twin.number
        if held:
            attrs[HELD_ATTR] = False
        values = None
        if state == "COMPLETE":
            values = list(twin.values) if twin.values is not None else worst_values(ctx.spec)
        self.finish(ctx, trial_id, state, values, attrs)
        what = "the baseline's config" if baseline else "the config"
        log.info("study %s: trial %d drew %s of trial %d: told that trial's outcome (%s), not run",
                 ctx.name, number, what, twin.number, state)

    def _held_ids(self, name: str, among: list[int] | None = None) -> list[int]:
        """Ids of the study's held repeats (`_hold_repeat`), of `among` when given: one light query."""
        trial, attr = rdb_models.TrialModel, rdb_models.TrialUserAttributeModel
        query = select(trial.trial_id).join(attr, attr.trial_id == trial.trial_id).where(
            trial.study_id == self.study_id(name), trial.state == TrialState.RUNNING, attr.key == HELD_ATTR,
            attr.value_json == json.dumps(True))
        if among is not None:
            query = query.where(trial.trial_id.in_(among))
        with _create_scoped_session(self._rdb.scoped_session) as session:
            return list(session.scalars(query).all())

    def _settle_repeats(self, ctx: StudyContext, trials: list[FrozenTrial] | None = None) -> None:
        """Tell each held repeat of the study whose twin has finished for good that twin's
        outcome (`_tell_repeat`). The twin is followed through its retries: the last attempt
        stands for it, and one lost with a retry to come, or still running, keeps the repeat
        held. `trials`: the study's trials, when the caller has just read them. Called under
        the study's lock: by `finish_once` for every search trial it finishes (one light query
        when nothing is held), by `ask`, and for the reaper's tell of a held repeat."""
        from api.outcome import retriable

        if trials is None:
            if not self._held_ids(ctx.name):
                return
            trials = self.storage.get_all_trials(self.study_id(ctx.name), deepcopy=False)
        held = [t for t in trials if t.state == TrialState.RUNNING and t.user_attrs.get(HELD_ATTR) is True]
        if not held:
            return
        by_number, retried_as = _attempts(trials)
        for repeat in held:
            twin = _last_attempt(by_number, retried_as, repeat.user_attrs.get("repeat_of"))
            if (twin is None or not twin.state.is_finished()
                    or (twin.state == TrialState.FAIL and retriable(ctx.spec, twin.state.name, twin.user_attrs))):
                continue
            config = repeat.user_attrs.get("config")
            self._tell_repeat(ctx, repeat._trial_id, repeat.number, twin, config if isinstance(config, dict) else {},
                              held=True)

    def set_user_attrs(self, trial_id: int, attrs: Mapping[str, Any]) -> None:
        """Set user attrs on an unfinished trial (non-finite floats become None: JSON has no NaN),
        all in one transaction. Raises UpdateFinishedTrialError if the trial is finished."""
        if not attrs:
            return
        with _create_scoped_session(self._rdb.scoped_session, True) as session:
            trial = rdb_models.TrialModel.find_or_raise_by_id(trial_id, session)
            self._rdb.check_trial_is_updatable(trial_id, cast(TrialState, trial.state))  # the column's value
            self._upsert_user_attrs(session, trial_id, attrs)

    def _upsert_user_attrs(self, session: Any, trial_id: int, attrs: Mapping[str, Any]) -> None:
        """One multi-row upsert of user attrs (PostgreSQL, SQLite), else Optuna's one-by-one."""
        if not attrs:
            return
        rdb = self._rdb
        model = rdb_models.TrialUserAttributeModel
        safe = {key: json_safe(value) for key, value in attrs.items()}
        dialect = rdb.engine.name
        if dialect in ("postgresql", "sqlite"):
            rows = [{"trial_id": trial_id, "key": key, "value_json": json.dumps(value)} for key, value in safe.items()]
            insert = (pg_dialect if dialect == "postgresql" else sqlite_dialect).insert(model).values(rows)
            session.execute(insert.on_conflict_do_update(index_elements=[model.trial_id, model.key],
                                                         set_={"value_json": insert.excluded.value_json}))
        else:
            for key, value in safe.items():
                rdb._set_trial_attr_without_commit(session, model, trial_id, key, value)

    def tell(self, ctx: StudyContext, trial: TrialRecord, state: str, values: list[float] | None = None,
             attrs: Mapping[str, Any] | None = None) -> TrialRecord:
        """Finish `trial`: set `attrs` first (a finished trial cannot change), then the state
        (COMPLETE with values in objective order, FAIL or PRUNED). Returns the finished trial.
        Telling an already finished trial changes nothing."""
        if trial.finished:
            return trial
        return self.finish(ctx, trial.trial_id, state, values, attrs)

    def finish(self, ctx: StudyContext, trial_id: int, state: str, values: list[float] | None = None,
               attrs: Mapping[str, Any] | None = None) -> TrialRecord:
        """`tell` by trial id: one read (the sampler's after_trial needs the trial), then attrs,
        values and state in one write. Returns the finished trial built from what is in hand.
        A trial finished already is returned as it is."""
        return self.finish_once(ctx, trial_id, state, values, attrs)[0]

    def finish_once(self, ctx: StudyContext, trial_id: int, state: str, values: list[float] | None = None,
                    attrs: Mapping[str, Any] | None = None) -> tuple[TrialRecord, bool]:
        """`finish`, also saying whether this call told Optuna (False: the trial had finished
        already, e.g. a complete repeated after a crash between the tell and the lease update;
        nothing was changed). A search trial finished (or found finished) here settles the held
        repeats of its config (`_settle_repeats`). A held repeat is told only its twin's outcome:
        any other tell of it (the reaper's "never leased") settles it if its twin is in, and
        otherwise changes nothing (False)."""
        handle = self._handle(ctx)
        study = handle.study
        if handle.snapshot is not None:  # the caller holds the study's lock: the next ask reads it again
            handle.snapshot.finished(trial_id)
        told = TrialState[state]
        values = [float(v) for v in values] if values is not None and told == TrialState.COMPLETE else None
        frozen = self.storage.get_trial(trial_id)
        if frozen.state.is_finished():
            if _may_be_twin(frozen.user_attrs):  # a crash may have come between its tell and its repeats'
                self._settle_repeats(ctx)
            return _record(frozen), False
        if frozen.user_attrs.get(HELD_ATTR) is True and (attrs or {}).get(HELD_ATTR) is not False:
            self._settle_repeats(ctx)
            return _record(self.storage.get_trial(trial_id)), False
        merged = {**frozen.user_attrs, **(attrs or {})}
        if told == TrialState.COMPLETE and merged.get("role", "search") == "search" and not merged.get("failure_kind"):
            base = self._baseline_number(ctx, merged.get("config"))
            if base is not None:
                attrs = {**(attrs or {}), "baseline_repeat_of": base}
                merged["baseline_repeat_of"] = base
        values = projected_values(ctx.spec, merged, values)
        study._thread_local.cached_all_trials = None
        done_at = datetime.now()  # naive local time, as Optuna stores it
        # the sampler's after_trial reads the trial's constraint (a user attr set below) and stores
        # it as a system attr: let it see the new attrs, and write what it sets in our transaction
        told_frozen = copy.copy(frozen)
        told_frozen.user_attrs = {**frozen.user_attrs, **{k: json_safe(v) for k, v in (attrs or {}).items()}}
        buffered = _BufferedSystemAttrs(study._storage)
        try:
            try:
                study._storage = buffered  # type: ignore[assignment]
                try:
                    study.sampler.after_trial(study, told_frozen, told, values)
                finally:
                    study._storage = buffered._base
            finally:
                # attrs, values and state in one transaction (Optuna's tell takes one per attr, plus one)
                with _create_scoped_session(self._rdb.scoped_session, True) as session:
                    row = rdb_models.TrialModel.find_or_raise_by_id(trial_id, session, for_update=True)
                    self._rdb.check_trial_is_updatable(trial_id, cast(TrialState, row.state))  # the column's value
                    self._upsert_user_attrs(session, trial_id, attrs or {})
                    for key, value in buffered.attrs.items():
                        self._rdb._set_trial_attr_without_commit(session, rdb_models.TrialSystemAttributeModel,
                                                                 trial_id, key, value)
                    for objective, value in enumerate(values or []):
                        self._rdb._set_trial_value_without_commit(session, row, objective, value)
                    row.state = told
                    row.datetime_complete = done_at
        except UpdateFinishedTrialError:
            log.info("trial %s of %s finished meanwhile; leaving it as it is", trial_id, ctx.name)
            finished = self.get_trial(trial_id)
            assert finished is not None
            return finished, False
        if _may_be_twin(merged):
            self._settle_repeats(ctx)
        user_attrs = dict(frozen.user_attrs)
        user_attrs.update({k: json_safe(v) for k, v in (attrs or {}).items()})
        return TrialRecord(trial_id=trial_id, number=frozen.number, state=told.name, params=dict(frozen.params),
                           values=values, user_attrs=user_attrs, datetime_start=frozen.datetime_start,
                           datetime_complete=done_at), True

    def _baseline_number(self, ctx: StudyContext, config: Any) -> int | None:
        """The number of the study's first completed baseline seed when `config` normalises to its
        config (a search trial that drew the user's own config), else None."""
        if not isinstance(config, dict):
            return None
        for t in self.storage.get_all_trials(self.study_id(ctx.name), deepcopy=False, states=(TrialState.COMPLETE,)):
            attrs = t.user_attrs
            config_attr = attrs.get("config")
            if attrs.get("role") == "baseline" and not attrs.get("failure_kind") and isinstance(config_attr, dict):
                return t.number if normalised(config_attr) == normalised(config) else None
        return None

    def set_front_values(self, ctx: StudyContext, values: Mapping[int, list[float] | None]) -> None:
        """Replace the Optuna values of finished trials (trial number -> values in objective
        order; None: the worst case): a re-measured candidate's, once the study's re-measurement
        has settled (see the module docstring). Optuna offers no update of a finished trial, so
        this writes its value rows directly; the measurement itself stays in the user attrs,
        which is what the service reads (a service process's cache may keep the old values)."""
        if not values:
            return
        from api.outcome import worst_values

        worst = worst_values(ctx.spec)
        study_id = self.study_id(ctx.name)
        model = rdb_models.TrialModel
        with _create_scoped_session(self._rdb.scoped_session, True) as session:
            for number, vs in values.items():
                row = session.scalars(select(model).where(model.study_id == study_id, model.number == number)).one()
                for objective, value in enumerate(worst if vs is None else vs):
                    stored, value_type = rdb_models.TrialValueModel.value_to_stored_repr(float(value))
                    found = rdb_models.TrialValueModel.find_by_trial_and_objective(row, objective, session)
                    if found is None:
                        session.add(rdb_models.TrialValueModel(trial_id=row.trial_id, objective=objective,
                                                               value=stored, value_type=value_type))
                    else:
                        found.value, found.value_type = stored, value_type

    def get_trial(self, trial_id: int) -> TrialRecord | None:
        """The trial with Optuna's global id `trial_id`, or None if there is none."""
        try:
            return _record(self.storage.get_trial(trial_id))
        except KeyError:
            return None

    def running_started_before(self, name: str, cutoff: datetime) -> list[int]:
        """Ids of the study's RUNNING trials started before `cutoff` (naive local time, as Optuna
        stores it): one light query, no trial loading (the reaper runs it every few seconds).
        A held repeat (`_hold_repeat`: never leased by design) is left out while its twin is in
        flight (running, or lost with a retry to come, as far as this can tell without the
        study's spec: a lost twin whose retries are used up is settled when it is told lost);
        once the twin has finished it is listed, and the reaper's tell of it settles it
        (`finish_once`): a repeat whose twin's outcome was not told to it (a crash in between)
        is so told after the lease grace."""
        from api.outcome import lost
        model = rdb_models.TrialModel
        cutoff_utc = cutoff.astimezone(timezone.utc).replace(tzinfo=None)  # the column holds naive UTC
        with _create_scoped_session(self._rdb.scoped_session) as session:
            ids = list(session.scalars(select(model.trial_id).where(
                model.study_id == self.study_id(name), model.state == TrialState.RUNNING,
                model._datetime_start_utc < cutoff_utc).order_by(model.trial_id)).all())
        held = set(self._held_ids(name, ids)) if ids else set()
        if held:
            trials = self.storage.get_all_trials(self.study_id(name), deepcopy=False)
            by_number, retried_as = _attempts(trials)
            waiting = set()
            for t in trials:
                if t._trial_id in held:
                    twin = _last_attempt(by_number, retried_as, t.user_attrs.get("repeat_of"))
                    if twin is None or not twin.state.is_finished() or lost(twin.state.name, twin.user_attrs):
                        waiting.add(t._trial_id)
            ids = [i for i in ids if i not in waiting]
        return ids

    def failed_trial_ids(self, name: str) -> list[int]:
        """Ids of the study's Optuna FAIL trials (the service fails only lost trials so: failed
        probes are told COMPLETE), by id: one light query, run on every lease."""
        model = rdb_models.TrialModel
        with _create_scoped_session(self._rdb.scoped_session) as session:
            ids = session.scalars(select(model.trial_id).where(
                model.study_id == self.study_id(name), model.state == TrialState.FAIL).order_by(model.trial_id)).all()
        return list(ids)

    def user_attr_values(self, name: str, key: str) -> dict[int, Any]:
        """Trial number → the value of user attr `key`, for the study's trials that have it (one query)."""
        trial, attr = rdb_models.TrialModel, rdb_models.TrialUserAttributeModel
        with _create_scoped_session(self._rdb.scoped_session) as session:
            rows = session.execute(select(trial.number, attr.value_json).join(attr, attr.trial_id == trial.trial_id)
                                   .where(trial.study_id == self.study_id(name), attr.key == key)).all()
        return {int(number): json.loads(value) for number, value in rows}

    def trials(self, name: str) -> list[TrialRecord]:
        """Every trial of the study, by number."""
        study_id = self.storage.get_study_id_from_name(name)
        return [_record(t) for t in self.storage.get_all_trials(study_id, deepcopy=False)]



def _may_be_twin(attrs: Mapping[str, Any]) -> bool:
    """A search trial that is not a repeat: one a held repeat may wait for (`_settle_repeats`)."""
    return attrs.get("role", "search") == "search" and "repeat_of" not in attrs


def _config_key(config: Mapping[str, Any], preset: Mapping[str, Any]) -> str:
    """What makes two configs one (`OptunaBridge._twins`): every knob normalised
    (`autotune.config.normalised`: a knob left out is at its default, 25 and 25.0 are one
    value), and a knob left to the workload's preset (batch_size, accum_steps, lr: None) at the
    preset's value where `preset` knows it."""
    knobs = normalised(config)
    for name, value in preset.items():
        if knobs.get(name) is None:
            knobs[name] = value
    return json.dumps(json_safe(knobs), sort_keys=True, default=str)


def _attempts(trials: list[FrozenTrial]) -> tuple[dict[int, FrozenTrial], dict[int, int]]:
    """(trial number → trial; lost trial number → the number of its retry)."""
    retried_as = {of: t.number for t in trials
                  if isinstance(of := t.user_attrs.get("retry_of"), int) and not isinstance(of, bool)}
    return {t.number: t for t in trials}, retried_as


def _last_attempt(by_number: Mapping[int, FrozenTrial], retried_as: Mapping[int, int], number: Any
                  ) -> FrozenTrial | None:
    """The trial that stands for trial `number`: itself, or its last retry."""
    trial = by_number.get(number) if isinstance(number, int) else None
    seen: set[int] = set()
    while trial is not None and trial.number in retried_as and trial.number not in seen:
        seen.add(trial.number)
        trial = by_number.get(retried_as[trial.number])
    return trial


def json_safe(value: Any) -> Any:
    """`value` with every non-finite float replaced by None (recursively)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
