"""What a study hands out next (`Planner.plan`), and whether its trials suit a worker (`not_for`).

The order: retries of lost trials first, then the baseline seeds, then (once the gate exists)
search trials up to max_trials configurations, starting points first, then the re-measurement
rounds. Everything is derived from the trials, so a restarted service plans where the old one
stopped; the planner only caches what has settled for good.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from autotune.api.optuna_bridge import OptunaBridge, StudyContext
from autotune.api.study import (
    TrialRecord,
    attempt_of,
    completed,
    may_retry,
    remeasure_key,
    remeasurement,
    role,
    search_done,
)
from autotune.contract.config import knobs_of
from autotune.contract.protocol import StudySpec
from autotune.contract.results import LeaseRequest
from autotune.contract.starting import MAX_POINTS, warm_points
from autotune.contract.starting import resolve as resolve_starting_points

WARM_START_ATTR = "autotune_warm_start"  # study user attr: the warm start's points, fixed once resolved


@dataclass(frozen=True)
class Plan:
    """The next trial of a study (`Planner.plan`): its role, a fixed config (None: sample
    the space), fixed params (the retry of a lost search trial), its user attrs, and the
    study's count of configurations so far (first attempts: retries do not count)."""

    role: str
    config: dict[str, Any] | None
    attrs: dict[str, Any]
    configs: int
    params: dict[str, Any] | None = None


@dataclass
class RetryBook:
    """Per study, the lost trials whose fate is known for good: retried (trial id → the retry's
    number) or never to be retried. Both only ever grow, so caching them is safe across service
    processes; everything else is read from the database on each lease."""

    retried: dict[int, int] = field(default_factory=dict)
    final: set[int] = field(default_factory=set)


def not_for(spec: StudySpec, request: LeaseRequest) -> tuple[str, str] | None:
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


def retry_plan(lost: TrialRecord, configs: int) -> Plan:
    """Re-run `lost`: same role, probe (seed included) and config; a search trial's params
    are enqueued again, so the sampler sees the same point."""
    attrs: dict[str, Any] = {"retry_of": lost.number, "attempt": attempt_of(lost) + 1}
    for key in ("probe", "baseline_seed", "remeasure_of", "remeasure_round", "starting_point", "warm_start_from"):
        if key in lost.user_attrs:
            attrs[key] = lost.user_attrs[key]
    trial_role = role(lost)
    if trial_role == "search":
        return Plan("search", None, attrs, configs, params=dict(lost.params))
    config = lost.user_attrs.get("config")
    knobs = knobs_of(config)
    return Plan(trial_role, knobs, attrs, configs)


# How long a re-measure round stays its worker's after that worker completed a trial of the study
# without holding a lease: the moment between a worker's complete and its next lease
ROUND_HOLD_S = 2.0


def round_for(trials: list[TrialRecord], next_round: list[TrialRecord], rounds_done: int, round_limit: int,
              worker_id: str | None, busy: Callable[[], set[str]]) -> tuple[int, TrialRecord] | None:
    """The re-measure round and target `worker_id` runs next, or None. A round runs on one worker,
    so that it compares its configs on one GPU: GPUs of one host differ by a few percent, and a
    candidate whose runs all landed on the faster one would read that gap as a speedup. The worker
    that started a round (its latest trial's) keeps it while it holds a lease of the study or
    completed one within `ROUND_HOLD_S` (`busy()`); another worker takes the next round meanwhile,
    with the configs undecided now (`next_round`: round `rounds_done`'s; an odd round runs them in
    reverse), so N workers run N rounds at once, each on its GPU. Otherwise the round is anyone's
    (its worker finished, died, or stopped asking). The rounds end at `round_limit`; a round
    started before the verdict dropped a config does not run that config."""
    ranked = next_round if rounds_done % 2 == 0 else next_round[::-1]  # rank order, the baseline last
    by_round: dict[int, list[TrialRecord]] = {}
    for t in trials:
        key = remeasure_key(t)
        if key is not None:
            by_round.setdefault(key[1], []).append(t)
    free: tuple[int, TrialRecord] | None = None
    holding: set[str] | None = None
    for round_ in range(rounds_done, round_limit):
        started = by_round.get(round_, [])
        have = {key[0] for t in started if (key := remeasure_key(t)) is not None}
        todo = [t for t in (ranked if round_ % 2 == 0 else ranked[::-1]) if t.number not in have]
        if not todo:
            continue
        starter = max(started, key=lambda t: t.number).user_attrs.get("worker_id") if started else None
        if starter is not None and starter == worker_id:
            return round_, todo[0]  # this worker's own round first
        if free is None:
            if starter is not None and holding is None:
                holding = busy()
            if starter is None or (holding is not None and starter not in holding):
                free = (round_, todo[0])
    return free


class Planner:
    """Plans each study's next trial for one service process. Its caches hold only what never
    changes once known (retry fates, starting points, re-measure rounds all created); they are
    keyed per study and filled by events, so no time-to-live applies. Called under the study's
    lock (`TuningService._study_lock`)."""

    def __init__(self, bridge: OptunaBridge, gates: Mapping[str, float | None],
                 gate: Callable[[StudyContext], float | None]) -> None:
        self.bridge = bridge
        self._gates = gates  # the service's gate cache: a study is in it once its gate is settled
        self._gate = gate  # settles it when it can (`TuningService._gate`)
        self._remeasures_created: set[str] = set()  # studies whose re-measure trials all exist
        # per study: its starting points (contract.starting), each with the study it warm-starts from
        self._starting: dict[str, list[tuple[dict[str, Any], str | None]]] = {}
        self._retry_books: dict[str, RetryBook] = {}  # per study, see RetryBook

    def pending_retries(self, ctx: StudyContext) -> tuple[list[TrialRecord], int]:
        """(the study's lost trials that wait for a retry, by number; how many retries exist).
        One light query when nothing was lost lately (the failed trials' ids); the retry links
        are read only while some lost trial's fate is open."""
        book = self._retry_books.setdefault(ctx.name, RetryBook())
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

    def plan(self, ctx: StudyContext, created: int, worker_id: str | None = None,
             busy: Callable[[], set[str]] = set) -> Plan | None:
        """What the study's next trial is, given `created` trials so far, for `worker_id`, or None
        when it has nothing to hand out now. Retries of lost trials first; then the baselines; no
        search trial before every baseline seed has finished for good (the gate must exist);
        search trials up to max_trials configurations (retries not counted); re-measurements once
        the search is done, each round on one worker (`round_for`; `busy`: the workers holding a
        lease of the study or that completed one within `ROUND_HOLD_S`)."""
        spec = ctx.spec
        pending, n_retries = self.pending_retries(ctx)
        configs = created - n_retries
        if pending:
            return retry_plan(pending[0], configs)
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
            points = self.starting_points(ctx) if index < MAX_POINTS else []
            if index < len(points):
                point, origin = points[index]
                attrs: dict[str, Any] = {"starting_point": index}
                if origin is not None:
                    attrs["warm_start_from"] = origin
                return Plan("search", None, attrs, configs, params=point)
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
        found = round_for(trials, rm.next_round, rm.rounds_done, rm.round_limit, worker_id, busy)
        if found is None:
            return None  # every round that may run now is started by another worker that is still on it
        round_, target = found
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

    def starting_points(self, ctx: StudyContext) -> list[tuple[dict[str, Any], str | None]]:
        """The study's starting points, each with the earlier study it warm-starts from (None: the
        study's own), derived once from its first finished baseline's effective config (what the
        probe ran: the preset's batch included): the warm start's points first
        (`contract.starting.warm_points`), then the spec's `starting_points`, at most MAX_POINTS.
        The warm start's are kept in the study (WARM_START_ATTR) when first resolved, so a
        restarted or second service process hands out the same points though more studies may
        have finished since."""
        points = self._starting.get(ctx.name)
        if points is None:
            baseline = ctx.spec.baseline_config()
            fingerprint = None
            for trial in self.bridge.trials(ctx.name):
                config = trial.user_attrs.get("config")
                if role(trial) == "baseline" and completed(trial) and isinstance(config, dict):
                    baseline = knobs_of(config)
                    fingerprint = (trial.user_attrs.get("measurement") or {}).get("model_fingerprint")
                    break
            warm = self._warm_points(ctx, baseline, fingerprint)
            own = resolve_starting_points(ctx.spec.starting_points, ctx.space, baseline, ctx.spec.hardware,
                                          ctx.spec.sampler)
            taken = [point for point, _ in warm]
            points = [*warm, *((p, None) for p in own if p not in taken)][:MAX_POINTS]
            self._starting[ctx.name] = points
        return points

    def _warm_points(self, ctx: StudyContext, baseline: dict[str, Any],
                     fingerprint: str | None) -> list[tuple[dict[str, Any], str | None]]:
        if ctx.spec.warm_start == "none":
            return []
        stored = self.bridge.study_attr(ctx.name, WARM_START_ATTR)
        if isinstance(stored, list):
            return [(dict(p["params"]), p.get("from")) for p in stored]
        found = warm_points(ctx.space, baseline, self.bridge.warm_start_sources(ctx, fingerprint))
        self.bridge.set_study_attr(ctx, WARM_START_ATTR, [{"params": p, "from": origin} for p, origin in found])
        return [(p, origin) for p, origin in found]
