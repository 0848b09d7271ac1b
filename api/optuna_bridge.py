"""Everything that touches Optuna: studies, samplers, ask/tell, trial reads.

Optuna types do not leave this module: trials come out as `TrialRecord` (a frozen
dataclass). Optuna's RDBStorage lives in the same database as the service tables and
commits its own transactions, so the service calls the bridge *before* it writes its own
tables in a unit of work (see api/service.py).

Thread safety: reads are safe from any thread (one shared `_CachedStorage`, which locks
internally). `create_study`, `ask` and `tell` mutate a study and its sampler; the service
calls them under its process-wide lock, never concurrently.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import optuna
from optuna.exceptions import DuplicatedStudyError, ExperimentalWarning, UpdateFinishedTrialError
from optuna.samplers import BaseSampler, NSGAIISampler, RandomSampler, TPESampler
from optuna.storages import RDBStorage
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from api.db import install_sqlite_pragmas, is_sqlite, sqlite_engine_kwargs
from autotune.protocol import OBJECTIVES, StudySpec
from autotune.space import Space, SpaceError, suggest

log = logging.getLogger(__name__)

FINISHED_STATES = ("COMPLETE", "FAIL", "PRUNED")
# A grid larger than this is refused at study creation: enumerating it would stall the service.
MAX_GRID_COMBINATIONS = 1_000_000


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


@dataclass(frozen=True)
class StudyContext:
    """What the bridge needs to know about a study (from the service's studies table)."""

    name: str
    spec: StudySpec
    space: Space


@dataclass
class _Handle:
    study: optuna.Study
    grid: list[dict[str, Any]] | None = None  # grid sampler: the shuffled, de-duplicated configurations
    lock: threading.Lock = field(default_factory=threading.Lock)


def _record(trial: FrozenTrial) -> TrialRecord:
    return TrialRecord(trial_id=trial._trial_id, number=trial.number, state=trial.state.name,
                       params=dict(trial.params), values=list(trial.values) if trial.values is not None else None,
                       user_attrs=dict(trial.user_attrs), datetime_start=trial.datetime_start,
                       datetime_complete=trial.datetime_complete)


def directions(spec: StudySpec) -> list[StudyDirection]:
    """Optuna directions in the spec's objective order (throughput maximize, val_nrmse minimize)."""
    return [StudyDirection[OBJECTIVES[o][1].upper()] for o in spec.objectives]


def metric_names(spec: StudySpec) -> list[str]:
    """The names of the values Optuna stores, in objective order (e.g. throughput_samples_per_s)."""
    return [OBJECTIVES[o][0] for o in spec.objectives]


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
    """The sampler the spec names. Grid studies use RandomSampler: their configs are enqueued."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExperimentalWarning)
        if spec.sampler == "tpe":
            # group=True: the space may be conditional (prefetch_factor only with workers > 0)
            return TPESampler(multivariate=True, group=True, constant_liar=True, seed=seed)
        if spec.sampler == "nsga2":
            return NSGAIISampler(seed=seed)
        if spec.sampler == "gp":
            from optuna.samplers import GPSampler  # torch is imported on first use only

            return GPSampler(seed=seed)
        return RandomSampler(seed=seed)  # random, and grid (configs come from the enqueued grid)


def _engine_kwargs(url: str, busy_timeout_s: float) -> dict[str, Any]:
    return sqlite_engine_kwargs(busy_timeout_s) if is_sqlite(url) else {"pool_pre_ping": True}


class OptunaBridge:
    """Optuna studies on the service's database URL."""

    def __init__(self, url: str, busy_timeout_s: float = 30.0) -> None:
        rdb = RDBStorage(url, engine_kwargs=_engine_kwargs(url, busy_timeout_s))
        if is_sqlite(url):
            install_sqlite_pragmas(rdb.engine, busy_timeout_s)
            rdb.engine.dispose()  # pooled connections from table creation predate the pragmas
        self._rdb = rdb
        # One shared cache for every Study object of this process (load_study would wrap anew).
        self.storage = optuna.storages.get_storage(rdb)
        self._handles: dict[str, _Handle] = {}
        self._handles_lock = threading.Lock()

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
            self._handles[ctx.name] = _Handle(study)

    def delete_study(self, name: str) -> None:
        with self._handles_lock:
            self._handles.pop(name, None)
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
                handle = self._handles[ctx.name] = _Handle(study)
            return handle

    def _grid(self, ctx: StudyContext, handle: _Handle) -> list[dict[str, Any]]:
        with handle.lock:
            if handle.grid is None:
                grid = ctx.space.grid()
                random.Random(ctx.spec.seed or 0).shuffle(grid)  # same order in every process
                handle.grid = grid
            return handle.grid

    def n_trials(self, name: str) -> int:
        """Every trial the study ever created, whatever its state."""
        return self.storage.get_n_trials(self.storage.get_study_id_from_name(name))

    def max_trials(self, ctx: StudyContext) -> int:
        """How many trials the study may hand out: n_trials, or fewer when a grid runs out."""
        if ctx.spec.sampler == "grid":
            return min(ctx.spec.n_trials, 1 + len(self._grid(ctx, self._handle(ctx))))
        return ctx.spec.n_trials

    # --- trials --------------------------------------------------------------------------------

    def ask(self, ctx: StudyContext, baseline_config: Mapping[str, Any] | None = None) -> AskedTrial:
        """Create the next trial. With `baseline_config`, the trial is the baseline: no suggestion
        (its values may lie outside the space), user attr is_baseline=True. Otherwise the space
        is sampled (grid: the next grid configuration). The config is stored as user attr
        "config". A config that fails the knob rules is told FAIL and SpaceError is raised."""
        handle = self._handle(ctx)
        study = handle.study
        if baseline_config is not None:
            trial = study.ask()
            config = dict(baseline_config)
        else:
            if ctx.spec.sampler == "grid":
                grid = self._grid(ctx, handle)
                index = self.n_trials(ctx.name) - 1  # trial 0 is the baseline
                study.enqueue_trial(grid[index % len(grid)], user_attrs={"grid_index": index})
            trial = study.ask()
            try:
                config = suggest(ctx.space, trial)
            except ValueError as e:  # ConfigError/SpaceError: the space let through a bad combination
                self.set_user_attrs(trial._trial_id, {"failure_kind": "unsupported", "failure_message": str(e)})
                study.tell(trial.number, state=TrialState.FAIL)
                raise SpaceError("space", f"drew a config that breaks a knob rule: {e}") from e
        is_baseline = baseline_config is not None
        self.set_user_attrs(trial._trial_id, {"is_baseline": is_baseline, "config": config})
        return AskedTrial(trial_id=trial._trial_id, number=trial.number, params=dict(trial.params),
                          config=config, is_baseline=is_baseline)

    def set_user_attrs(self, trial_id: int, attrs: Mapping[str, Any]) -> None:
        """Set user attrs on an unfinished trial (non-finite floats become None: JSON has no NaN)."""
        for key, value in attrs.items():
            self.storage.set_trial_user_attr(trial_id, key, json_safe(value))

    def tell(self, ctx: StudyContext, trial: TrialRecord, state: str, values: list[float] | None = None,
             attrs: Mapping[str, Any] | None = None) -> TrialRecord:
        """Finish `trial`: set `attrs` first (a finished trial cannot change), then the state
        (COMPLETE with values in objective order, FAIL or PRUNED). Returns the finished trial.
        Telling an already finished trial changes nothing."""
        if trial.finished:
            return trial
        try:
            if attrs:
                self.set_user_attrs(trial.trial_id, attrs)
            self._handle(ctx).study.tell(trial.number, values=values if state == "COMPLETE" else None,
                                         state=TrialState[state])
        except UpdateFinishedTrialError:
            log.info("trial %s of %s finished meanwhile; leaving it as it is", trial.number, ctx.name)
        finished = self.get_trial(trial.trial_id)
        assert finished is not None
        return finished

    def get_trial(self, trial_id: int) -> TrialRecord | None:
        """The trial with Optuna's global id `trial_id`, or None if there is none."""
        try:
            return _record(self.storage.get_trial(trial_id))
        except KeyError:
            return None

    def trials(self, name: str) -> list[TrialRecord]:
        """Every trial of the study, by number."""
        study_id = self.storage.get_study_id_from_name(name)
        return [_record(t) for t in self.storage.get_all_trials(study_id, deepcopy=False)]

    def pareto(self, name: str) -> list[TrialRecord]:
        """The non-dominated completed trials (Optuna's best_trials), by number."""
        study = optuna.study.Study(study_name=name, storage=self.storage, sampler=RandomSampler())
        return sorted((_record(t) for t in study.best_trials), key=lambda t: t.number)


def json_safe(value: Any) -> Any:
    """`value` with every non-finite float replaced by None (recursively)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
