"""Everything that touches Optuna: studies, samplers, ask/tell, trial reads, through Optuna's
public API only.

Optuna holds the truth: every COMPLETE trial's values are what its probe measured, with its
role and its feasibility (the constraint the samplers read) in user attrs; a failed probe is
FAIL, a stopped one or a repeated draw PRUNED (api/repeats.py); the service's verdict is stored
beside the trials. Optuna types do not leave the bridge and its helpers (api/optuna_codec.py):
trials come out as `TrialRecord`. Optuna commits on its own connections, so the service calls
the bridge before it writes its own tables; per study, `ask` and `finish` run under the
service's study lock.
"""

from __future__ import annotations

import logging
import random
import re
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, overload

import optuna
from optuna.exceptions import DuplicatedStudyError, ExperimentalWarning, UpdateFinishedTrialError
from optuna.samplers import RandomSampler
from optuna.storages import RDBStorage
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from autotune.api.db import install_sqlite_pragmas, is_sqlite, sqlite_engine_kwargs
from autotune.api.optuna_codec import (
    MEASURED,
    MEASUREMENT_ATTR,
    FixedParams,
    MissingParam,
    distribution,
    flatten,
    json_safe,
    to_record,
)
from autotune.api.outcome import failed_attrs
from autotune.api.repeats import config_key, log_repeat, repeat_attrs, twins
from autotune.api.study.samplers import CONSTRAINT_ATTR, build_sampler
from autotune.api.study.trials import TrialRecord
from autotune.contract.config import normalised
from autotune.contract.protocol import NAME_PATTERN, StudySpec
from autotune.contract.space import Space, SpaceError, params_of, suggest

log = logging.getLogger(__name__)

# A drawn search trial whose config is one measured, in flight or the baseline's is not run
# (`OptunaBridge.ask`); at most this many such draws per ask, then the ask hands out nothing.
MAX_REPEATS = 20
# The system attr Optuna's constrained samplers store a trial's constraints in (their after_trial,
# from constraints_func), and optuna-dashboard reads feasibility from; the bridge writes it itself
# for the samplers that take no constraints (random, grid)
OPTUNA_CONSTRAINTS_KEY = "constraints"
UNCONSTRAINED_SAMPLERS = ("random", "grid")
RECOMMENDATION_ATTR = "autotune_recommendation"  # study user attr: the service's verdict, once settled


class StudyExists(Exception):
    """An Optuna study of that name is already in the storage."""


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


@dataclass
class _Handle:
    study: optuna.Study
    study_id: int
    sampling: bool = False  # the study's own sampler is set (`_handle`); a reader has RandomSampler
    grid: list[dict[str, Any]] | None = None  # grid sampler: the shuffled, de-duplicated configurations
    lock: threading.Lock = field(default_factory=threading.Lock)


def directions(spec: StudySpec) -> list[StudyDirection]:
    """Optuna directions in the spec's objective order (throughput maximize; quality: the study's
    quality direction, StudySpec.quality_direction)."""
    return [StudyDirection[d.upper()] for d in spec.objective_directions()]


def metric_names(spec: StudySpec) -> list[str]:
    """The names of the values Optuna stores, in objective order: throughput_samples_per_s and the
    quality metric's own name (val_nrmse, val_loss, ...; "quality" for a plugin workload whose
    metric the spec does not name)."""
    return spec.objective_metric_names()


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
        # Optuna's RDBStorage: writes of user attrs and single-trial reads go to it; every Study
        # object made on it reads the study's trials through Optuna's own cache
        self.storage = rdb
        self._handles: dict[str, _Handle] = {}
        self._handles_lock = threading.Lock()
        self._ids: dict[tuple[int, int], int] = {}  # (study id, trial number) -> trial id: fixed at creation

    def close(self) -> None:
        self.storage.engine.dispose()

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
            self._handles[ctx.name] = _Handle(study, self.storage.get_study_id_from_name(ctx.name), sampling=True)

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

    def set_recommendation(self, ctx: StudyContext, recommendation: Mapping[str, Any]) -> None:
        """Store the service's verdict beside the trials (study user attr RECOMMENDATION_ATTR),
        for whoever reads the study with Optuna's own tools."""
        self._handle(ctx).study.set_user_attr(RECOMMENDATION_ATTR, json_safe(dict(recommendation)))

    def recommendation(self, name: str) -> dict[str, Any] | None:
        """The verdict stored by `set_recommendation`, if any."""
        value = self._reader(name).study.user_attrs.get(RECOMMENDATION_ATTR)
        return value if isinstance(value, dict) else None

    def warm_start_sources(self, ctx: StudyContext, model_fingerprint: str | None = None
                           ) -> list[tuple[str, list[dict[str, Any]]]]:
        """Each source study of `ctx`'s warm start with its configs to try first: its certified
        pick, then its other candidates that were not shown slower or worse (certified, undecided,
        stopped), fastest first. The studies named in the spec, in its order, or for "auto" every
        other study with a verdict of the same workload, preset and hardware class, newest first
        (where both sides record a model fingerprint, it must match). Read through Optuna's
        public API: the spec and the verdict are study user attrs."""
        spec = ctx.spec
        if spec.warm_start == "none":
            return []
        summaries = {s.study_name: s for s in optuna.get_all_study_summaries(self.storage, include_best_trial=False)}
        if spec.warm_start == "auto":
            def same_job(attrs: Mapping[str, Any]) -> bool:
                other = attrs.get("autotune_spec") or {}
                return (isinstance(other, dict) and other.get("workload") == spec.workload
                        and other.get("preset") == spec.preset and other.get("hardware") == spec.hardware)

            names = [s.study_name for s in sorted(summaries.values(), reverse=True,
                                                  key=lambda s: (s.datetime_start is not None, s.datetime_start))
                     if s.study_name != ctx.name and same_job(s.user_attrs)]
        else:
            names = [n for n in spec.warm_start if n in summaries]
        sources = []
        for name in names:
            rec = summaries[name].user_attrs.get(RECOMMENDATION_ATTR)
            if not isinstance(rec, dict):
                continue  # no verdict yet: nothing known to start from
            theirs = (rec.get("provenance") or {}).get("model_fingerprint")
            if spec.warm_start == "auto" and model_fingerprint and theirs and theirs != model_fingerprint:
                continue  # another model under the same workload name
            configs = [rec["config"]] if rec.get("certified") and isinstance(rec.get("config"), dict) else []
            front = [c for c in rec.get("configs") or [] if isinstance(c, dict) and c.get("role") == "candidate"
                     and c.get("status") in ("certified", "undecided", "stopped") and isinstance(c.get("config"), dict)]
            front.sort(key=lambda c: -(c.get("speedup") or 0.0))
            configs += [c["config"] for c in front]
            if configs:
                sources.append((name, configs))
        return sources

    def study_attr(self, name: str, key: str) -> Any:
        """A study user attr, read fresh from the storage (another service process may have set it)."""
        return optuna.load_study(study_name=name, storage=self.storage, sampler=RandomSampler()).user_attrs.get(key)

    def set_study_attr(self, ctx: StudyContext, key: str, value: Any) -> None:
        self._handle(ctx).study.set_user_attr(key, json_safe(value))

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

    def _reader(self, name: str) -> _Handle:
        """The process's Study object for `name` (KeyError if there is none): a reader until
        `_handle` gives it the study's sampler."""
        with self._handles_lock:
            handle = self._handles.get(name)
            if handle is None:
                study_id = self.storage.get_study_id_from_name(name)  # KeyError: no such study
                study = optuna.load_study(study_name=name, storage=self.storage, sampler=RandomSampler())
                handle = self._handles[name] = _Handle(study, study_id)
            return handle

    def _handle(self, ctx: StudyContext) -> _Handle:
        """`_reader`, with the study's own sampler. A sampler made in a fresh process with the
        study's seed would repeat the draws of the first process; its seed is offset by the
        trials already made (still reproducible)."""
        handle = self._reader(ctx.name)
        if not handle.sampling:
            with handle.lock:
                if not handle.sampling:
                    seed = None if ctx.spec.seed is None else ctx.spec.seed + self.n_trials(ctx.name)
                    handle.study.sampler = build_sampler(ctx.spec, seed)
                    handle.sampling = True
        return handle

    def _grid(self, ctx: StudyContext, handle: _Handle) -> list[dict[str, Any]]:
        with handle.lock:
            if handle.grid is None:
                grid = ctx.space.grid()
                random.Random(ctx.spec.seed or 0).shuffle(grid)  # same order in every process
                handle.grid = grid
            return handle.grid

    def study_id(self, name: str) -> int:
        """Optuna's id of the study `name` (KeyError if there is none)."""
        return self._reader(name).study_id

    def _frozen(self, name: str, states: tuple[TrialState, ...] | None = None) -> list[FrozenTrial]:
        return self._reader(name).study.get_trials(deepcopy=False, states=states)

    def _id(self, study_id: int, number: int) -> int:
        """The trial id of trial `number` of the study (one query the first time, then kept: it
        never changes)."""
        key = (study_id, number)
        trial_id = self._ids.get(key)
        if trial_id is None:
            trial_id = self._ids[key] = self.storage.get_trial_id_from_study_id_trial_number(study_id, number)
        return trial_id

    def _records(self, name: str, frozen: list[FrozenTrial]) -> list[TrialRecord]:
        study_id = self.study_id(name)
        return [to_record(t, self._id(study_id, t.number)) for t in frozen]

    def n_trials(self, name: str) -> int:
        """Every trial the study ever created, whatever its state, less WAITING ones (enqueued and
        never asked: what a service killed between the two left, `_ask_starting_point`)."""
        return len(self._frozen(name, (TrialState.RUNNING, TrialState.COMPLETE, TrialState.PRUNED,
                                       TrialState.FAIL)))

    def n_finished(self, name: str) -> int:
        """The study's finished trials (COMPLETE, PRUNED or FAIL)."""
        return len(self._frozen(name, (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)))

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
        lost search trial, or a user's starting point) the trial is made with those params in
        one commit (`_create_search`), so it has the same params and config, and it runs
        whatever it repeats; without, the space is sampled (grid: the next grid configuration,
        made the same way).

        No duplicate probes: a sampled (or grid) draw of a config the study measured, is measuring
        or saw fail for a reason of its own is a *repeat* (api/repeats.py): told PRUNED at once, it
        counts toward n_trials like any draw, and the space is sampled again. The samplers see the
        twin itself (measured, or running as a constant liar).

        A draw is tried at most MAX_REPEATS times per ask and never beyond n_trials; when the
        last one allowed is still a repeat, the ask returns None: nothing to hand out (the
        caller leases nothing; the next ask samples again, so a study whose every remaining
        draw is a repeat uses up its budget and finishes). The handed-out config is stored as
        user attr "config", with `attrs` and "role". `created`: the study's count of
        configurations (first attempts, retries not counted) before this ask, when the caller
        knows it. A config that fails the knob rules is told as a failed trial ("unsupported":
        Optuna FAIL) and SpaceError is raised."""
        handle = self._handle(ctx)
        if baseline_config is not None:
            return self._create_fixed(ctx, handle, dict(baseline_config), role or "baseline", attrs)
        role = "search"
        drawn_attrs = {"is_baseline": False, "role": role}  # a repeat's: no worker, none of the lease's attrs
        base_attrs = {**(attrs or {}), **drawn_attrs}
        if params is not None:  # a retry or a starting point: those params, whatever they repeat
            try:
                config, drawn = self._config_of(ctx, handle, params, base_attrs)
            except MissingParam:
                if "starting_point" in base_attrs:  # a user's point: the sampler draws the rest
                    return self._ask_starting_point(ctx, handle, params, base_attrs)
                # the retry of a trial the sampler never finished drawing: a new draw
            else:
                return self._create_search(ctx, handle, drawn, {**base_attrs, "config": config},
                                           TrialState.RUNNING)
        known, preset = twins(ctx.spec, ctx.space, self._frozen(ctx.name))
        configs = self.n_trials(ctx.name) if created is None else created
        # draws this ask may spend on repeats: each counts toward n_trials
        allowed = min(MAX_REPEATS, self.max_trials(ctx) - configs)
        repeats = 0
        while True:
            if ctx.spec.sampler == "grid":
                # the first baseline_seeds trials are the baseline; each repeat used one configuration
                index = configs + repeats - ctx.spec.baseline_seeds
                grid = self._grid(ctx, handle)
                grid_attrs = {**base_attrs, "grid_index": index}
                config, drawn = self._config_of(ctx, handle, grid[index % len(grid)], grid_attrs)
                twin = known.get(config_key(config, preset))
                if twin is None:
                    return self._create_search(ctx, handle, drawn, {**grid_attrs, "config": config},
                                               TrialState.RUNNING)
                self._create_search(ctx, handle, drawn, {**drawn_attrs, "grid_index": index,
                                                         **repeat_attrs(twin, config)}, TrialState.PRUNED)
                log_repeat(ctx.name, twin)
            else:
                trial = handle.study.ask()  # the sampler's draw: one trial, its params set as drawn
                trial_id = self._id(handle.study_id, trial.number)
                try:
                    config = suggest(ctx.space, trial)
                except ValueError as e:  # ConfigError/SpaceError: the space let through a bad combination
                    self.finish(ctx, trial_id, "FAIL", None, {**base_attrs, **failed_attrs("unsupported", str(e))})
                    raise SpaceError("space", f"drew a config that breaks a knob rule: {e}") from e
                twin = known.get(config_key(config, preset))
                if twin is None:
                    self.set_user_attrs(trial_id, {**base_attrs, "config": config})
                    return AskedTrial(trial_id=trial_id, number=trial.number, params=dict(trial.params),
                                      config=config, is_baseline=False, role=role)
                self.finish(ctx, trial_id, "PRUNED", None, {**drawn_attrs, **repeat_attrs(twin, config)})
                log_repeat(ctx.name, twin)
            repeats += 1
            if repeats >= allowed:  # the last draw allowed repeated one too: nothing to hand out now
                log.info("study %s: %d draw(s) repeated a config measured or in flight; nothing to hand out now",
                         ctx.name, repeats)
                return None

    def _ask_starting_point(self, ctx: StudyContext, handle: _Handle, params: Mapping[str, Any],
                            attrs: Mapping[str, Any]) -> AskedTrial:
        """A starting point that leaves params to the sampler: Optuna's enqueue_trial (a WAITING
        trial with those params) and ask (which takes it and draws the rest). They are two
        commits: a service killed in between leaves the WAITING trial, which is not counted
        (`n_trials`), so the restarted service plans the same point again and takes that trial
        instead of enqueueing another."""
        point = attrs["starting_point"]
        waiting = [t for t in self._frozen(ctx.name, (TrialState.WAITING,))
                   if t.user_attrs.get("starting_point") == point]
        if not waiting:
            handle.study.enqueue_trial(dict(params), user_attrs={"starting_point": point})
        trial = handle.study.ask()
        trial_id = self._id(handle.study_id, trial.number)
        try:
            config = suggest(ctx.space, trial)
        except ValueError as e:
            self.finish(ctx, trial_id, "FAIL", None, {**attrs, **failed_attrs("unsupported", str(e))})
            raise SpaceError("space", f"drew a config that breaks a knob rule: {e}") from e
        self.set_user_attrs(trial_id, {**attrs, "config": config})
        return AskedTrial(trial_id=trial_id, number=trial.number, params=dict(trial.params), config=config,
                          is_baseline=False, role="search")

    def _config_of(self, ctx: StudyContext, handle: _Handle, params: Mapping[str, Any],
                   attrs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The config and the params the space draws from fixed `params`; MissingParam when they leave
        an active parameter out; params that break a knob rule make a failed trial
        ("unsupported") and raise SpaceError."""
        fixed = FixedParams(params)
        try:
            config = suggest(ctx.space, fixed)
        except ValueError as e:
            self._create_search(ctx, handle, {}, {**attrs, **failed_attrs("unsupported", str(e))}, TrialState.FAIL)
            raise SpaceError("space", f"a config that breaks a knob rule: {e}") from e
        return config, dict(fixed.params)

    def _create_search(self, ctx: StudyContext, handle: _Handle, params: Mapping[str, Any],
                       attrs: Mapping[str, Any], state: TrialState) -> AskedTrial:
        """Create a search trial of known params in one commit (Optuna's create_new_trial from a
        template: params, user attrs and state together): RUNNING for a retry, a starting point
        or a grid configuration, PRUNED for a grid draw that repeats a config, FAIL for params
        that break a knob rule. (Optuna's enqueue_trial + ask take two commits: a service killed
        in between left a WAITING trial that a later draw took, spending a configuration.)"""
        trial_id, number = self._create(ctx, handle, params, attrs, state)
        config = attrs.get("config")
        return AskedTrial(trial_id=trial_id, number=number, params=dict(params),
                          config=dict(config) if isinstance(config, dict) else {}, is_baseline=False, role="search")

    def _create_fixed(self, ctx: StudyContext, handle: _Handle, config: dict[str, Any], role: str,
                      attrs: Mapping[str, Any] | None) -> AskedTrial:
        """Create a baseline or re-measurement trial of `config` as one row set in one commit
        (Optuna's create_new_trial from a template): RUNNING, with the params of its config
        (those the space could draw: `params_of`, so that Optuna's tables and its dashboard
        show them) and its user attrs (role, is_baseline, config, `attrs`). A service that dies
        right after still leaves a trial that says what it is: the reaper fails it as never
        leased and the next lease re-runs it in its role. No sampler is asked: the config is
        fixed."""
        params = params_of(ctx.space, normalised(config))  # a knob left out: its default
        is_baseline = role == "baseline"
        user_attrs = {**(attrs or {}), "is_baseline": is_baseline, "role": role, "config": config}
        trial_id, number = self._create(ctx, handle, params, user_attrs, TrialState.RUNNING)
        return AskedTrial(trial_id=trial_id, number=number, params=params, config=config,
                          is_baseline=is_baseline, role=role)

    def _create(self, ctx: StudyContext, handle: _Handle, params: Mapping[str, Any], attrs: Mapping[str, Any],
                state: TrialState) -> tuple[int, int]:
        """(trial id, number) of a trial made with `params`, user `attrs` and `state` in one commit
        (Optuna's create_new_trial from a template)."""
        now = datetime.now()
        template = FrozenTrial(number=0, trial_id=0, state=state, value=None, datetime_start=now,
                               datetime_complete=now if state != TrialState.RUNNING else None, params=dict(params),
                               distributions={name: distribution(ctx.space.params[name]) for name in params},
                               user_attrs={key: json_safe(value) for key, value in attrs.items()},
                               system_attrs={}, intermediate_values={})
        trial_id = self.storage.create_new_trial(handle.study_id, template_trial=template)
        number = self.storage.get_trial_number_from_id(trial_id)
        self._ids[(handle.study_id, number)] = trial_id
        return trial_id, number

    def set_user_attrs(self, trial_id: int, attrs: Mapping[str, Any],
                       stored: Mapping[str, Any] | None = None) -> None:
        """Set user attrs on an unfinished trial (non-finite floats become None: JSON has no NaN);
        the measurement's fields go into one attr (MEASUREMENT_ATTR). `stored`: the trial's user
        attrs as read, to skip what is unchanged. Raises UpdateFinishedTrialError if the trial is
        finished."""
        safe = {key: json_safe(value) for key, value in attrs.items()}
        measured = {k: v for k, v in safe.items() if k in MEASURED}
        writes = {k: v for k, v in safe.items() if k not in MEASURED}
        if measured:
            before = (stored or {}).get(MEASUREMENT_ATTR)
            writes[MEASUREMENT_ATTR] = {**(before if isinstance(before, dict) else {}), **measured}
        for key, value in writes.items():
            if stored is not None and key in stored and stored[key] == value:
                continue
            self.storage.set_trial_user_attr(trial_id, key, value)

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
        """`tell` by trial id. Returns the finished trial. A trial finished already is returned
        as it is."""
        return self.finish_once(ctx, trial_id, state, values, attrs)[0]

    def finish_once(self, ctx: StudyContext, trial_id: int, state: str, values: list[float] | None = None,
                    attrs: Mapping[str, Any] | None = None) -> tuple[TrialRecord, bool]:
        """`finish`, also saying whether this call told Optuna (False: the trial had finished
        already, e.g. a complete repeated after a crash between the tell and the lease update,
        or told by another service process meanwhile; nothing was changed). The user attrs are
        written first, then `study.tell` (whose sampler hook stores the constraint) sets the
        values and the state: a crash in between leaves the trial RUNNING with its attrs, and
        the worker's retried complete (or the reaper) finishes it. (Whether a search trial ran
        the baseline's config is the service's one rule, api/study `baseline_repeat_of`.)"""
        handle = self._handle(ctx)
        told = TrialState[state]
        values = [float(v) for v in values] if values is not None and told == TrialState.COMPLETE else None
        frozen = self.storage.get_trial(trial_id)
        if frozen.state.is_finished():
            return to_record(frozen, trial_id), False
        attrs = dict(attrs or {})
        merged = {**flatten(frozen.user_attrs), **attrs}
        constraint = merged.get(CONSTRAINT_ATTR)
        try:
            self.set_user_attrs(trial_id, attrs, stored=frozen.user_attrs)
            if (told == TrialState.COMPLETE and ctx.spec.sampler in UNCONSTRAINED_SAMPLERS
                    and isinstance(constraint, (int, float)) and not isinstance(constraint, bool)):
                self.storage.set_trial_system_attr(trial_id, OPTUNA_CONSTRAINTS_KEY, [float(constraint)])
            handle.study.tell(frozen.number, values, state=told)
        except (UpdateFinishedTrialError, ValueError) as e:
            finished = self.storage.get_trial(trial_id)
            if not finished.state.is_finished():
                raise
            log.info("trial %s of %s finished meanwhile; leaving it as it is (%s)", trial_id, ctx.name, e)
            return to_record(finished, trial_id), False
        return to_record(self.storage.get_trial(trial_id), trial_id), True

    def get_trial(self, trial_id: int) -> TrialRecord | None:
        """The trial with Optuna's global id `trial_id`, or None if there is none."""
        try:
            return to_record(self.storage.get_trial(trial_id), trial_id)
        except KeyError:
            return None

    def running_started_before(self, name: str, cutoff: datetime) -> list[int]:
        """Ids of the study's RUNNING trials started before `cutoff` (naive local time, as Optuna
        reports it), by id (the reaper runs it every few seconds)."""
        study_id = self.study_id(name)
        return sorted(self._id(study_id, t.number) for t in self._frozen(name, (TrialState.RUNNING,))
                      if t.datetime_start is not None and t.datetime_start < cutoff)

    def failed_trial_ids(self, name: str) -> list[int]:
        """Ids of the study's Optuna FAIL trials, by id (run on every lease: Optuna's cache holds
        finished trials, so this reads only the unfinished ones)."""
        study_id = self.study_id(name)
        return sorted(self._id(study_id, t.number) for t in self._frozen(name, (TrialState.FAIL,)))

    def user_attr_values(self, name: str, key: str) -> dict[int, Any]:
        """Trial number → the value of user attr `key`, for the study's trials that have it."""
        return {t.number: t.user_attrs[key] for t in self.trials(name) if key in t.user_attrs}

    def trials(self, name: str) -> list[TrialRecord]:
        """Every trial of the study, by number."""
        return self._records(name, self._frozen(name))
