"""The wire contract between the service, workers and clients (pydantic models).

The service (`api/`) and the worker (`autotune/worker/loop.py`) both import these models, so
the protocol is written down once. Routes, all under /v1:

  POST   /v1/studies                 StudySpec            → 201 StudyInfo
  GET    /v1/studies                                      → StudyList
  GET    /v1/studies/{name}                               → StudyInfo
  DELETE /v1/studies/{name}          (stop leasing; data is kept) → StudyInfo
  GET    /v1/studies/{name}/trials                        → TrialList
  GET    /v1/studies/{name}/pareto                        → TrialList (the non-dominated completed trials)
  GET    /v1/studies/{name}/best?format=json|yaml         → Recommendation
  POST   /v1/trials/lease            LeaseRequest         → 200 TrialLease | 204 nothing to do
  POST   /v1/trials/{id}/heartbeat   HeartbeatRequest     → HeartbeatReply
  POST   /v1/trials/{id}/report      ReportRequest        → ReportReply
  POST   /v1/trials/{id}/complete    CompleteRequest      → TrialInfo
  GET    /v1/health                                       → {"status": "ok", ...}

A trial's calls (heartbeat, report, complete) are answered alike when the trial is not the
caller's: 404 when no such trial exists; 409 "cannot <verb> trial N: it is leased to worker
'w1', not 'w2'" (or its lease was reaped: no heartbeat within the grace period, or it was
never leased by this service) with the fix "stop running it and lease a new trial"; 409
"cannot <verb> trial N: it is already completed" once its result is in. The one exception:
the worker that completed it repeating its complete (a network retry) gets the stored
TrialInfo again, 200, and nothing changes. A heartbeat says "stop" (200) only to the worker
that holds the trial: its study was stopped, or the trial finished meanwhile.

Lease tokens: every lease has a random token (`TrialLease.lease_token`; the same one when a
worker gets its own active lease back), and the lease names the service that made it
(`TrialLease.service_id`, as GET /v1/health shows it). A worker sends the token back with the
trial's heartbeat, report and complete; a call that carries one is taken only for the lease
holding that token, else 409 "cannot <verb> trial N: ... another lease of trial N ..." (trial
ids restart at 1 in every database, and a backup keeps its database's service id: the same
id, study, number and worker may be another lease, of another database or a restored copy).
Nothing is stored then: the worker keeps the result in its spool, for the service it was
leased from. A call without a token (an older worker), or for a lease made before tokens, gets
the checks above only. A complete repeated after success with the same token is idempotent.

complete's result is validated (`TrialResult`): a wrong type or range (throughput
"fast", a NaN quality, a failure kind no worker sends, a throughput outside the physical
bounds MIN_THROUGHPUT to MAX_THROUGHPUT), a measurement without throughput or quality, or
a config other than the leased one (a key that is no knob, a knob the lease left to the
preset at another value than the preset's) is a 422 naming the field; nothing changes and
the trial stays leased to its worker, so a corrected complete goes through. Result keys
the model does not know are accepted and ignored (a newer worker may send more). No number
of any request is a boolean or a string (``"n_trials": true`` is refused, not taken as 1).

A study runs `baseline_seeds` baseline trials (role "baseline"; the search waits for them:
they set the quality gate), then search trials (role "search") up to n_trials in all, then
re-measures its top feasible configs with a longer probe (role "remeasure"). A lease's probe
is the trial's own (baseline seeds and re-measurements differ from the study's probe).

This module imports pydantic, the config/space validators and the workload registry only
(no torch, no fastapi).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    FieldSerializationInfo,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    StrictBool,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_serializer,
    model_validator,
)

from autotune.contract.config import ConfigError, check_hardware, parse_config
from autotune.contract.errors import FAILURE_KINDS
from autotune.contract.registry import UnknownWorkloadError, check_workload
from autotune.contract.space import Space, SpaceError, load_space, parse_space, validate_for
from autotune.contract.starting import check_points

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
# Free text that names something (worker ids, hardware classes): printable, no control characters
# (PostgreSQL text cannot hold NUL; a newline in an id breaks logs and tables).
TEXT_PATTERN = r"^[^\x00-\x1f\x7f]+$"


def _no_control_characters(value: str) -> str:
    if re.search(r"[\x00-\x1f\x7f]", value):
        raise ValueError("must not contain control characters (NUL, tab, newline, ...): use printable text")
    return value


Text = Annotated[str, AfterValidator(_no_control_characters), Field(json_schema_extra={"pattern": TEXT_PATTERN})]


def _not_coerced(value: Any) -> Any:
    """Refuse what pydantic's lax mode would turn into a number: a boolean (``true`` is 1) or
    text (``"1"``). Anything else is left to the field's type, so an int stays a valid float
    (``samples_factor: 2`` in a YAML study file) and 20.0 a valid int."""
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got the boolean {str(value).lower()}: write the number itself")
    if isinstance(value, (str, bytes)):
        raise ValueError(f"expected a number, got the string {value!r}: write the number without quotes")
    return value


# Numbers of the requests (a study spec, a lease, a report): no boolean or string taken for one.
Int = Annotated[int, BeforeValidator(_not_coerced)]
Number = Annotated[float, BeforeValidator(_not_coerced)]
SAMPLERS = ("tpe", "nsga2", "random", "grid", "gp")
# objective → (the measurement it reads, its direction). "quality" is the workload's quality
# metric (val_nrmse for ups, val_loss for gpt); its direction is the study's
# (`StudySpec.quality_direction`), "minimize" here is the default. "val_nrmse" is accepted as
# an alias of "quality" (studies written before quality was generalised). "energy" is the GPU
# energy per training sample over the probe's timed windows (ProbeResult.energy_j_per_sample,
# joules; every GPU of the trial): a GPU study's alone (a CPU has no energy counter).
OBJECTIVES = {
    "throughput": ("throughput_samples_per_s", "maximize"),
    "quality": ("quality", "minimize"),
    "energy": ("energy_j_per_sample", "minimize"),
}
OBJECTIVE_ALIASES = {"val_nrmse": "quality"}


# The source research's data pipeline (its starting point ran 8 workers with prefetch 4).
RESEARCH_GPU_DATA_PIPELINE: dict[str, Any] = {"num_workers": 8, "prefetch_factor": 4}

Objective = Literal["throughput", "quality", "energy"]
DEFAULT_OBJECTIVES: tuple[Objective, ...] = ("throughput", "quality")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ProbeSpec(Strict):
    """How every trial of a study is measured (identical for all its trials)."""

    samples: Int | None = Field(None, ge=1, le=10_000_000, description="training samples per probe (None: preset's)")
    seed: Int = Field(0, ge=0, le=2**31 - 1, description="weights and sample-order seed")
    windows: Int = Field(8, ge=5, le=100, description="timed windows")
    warmup_steps: Int = Field(5, ge=1, le=10_000, description="optimizer steps excluded from timing")
    timeout_s: Number = Field(900.0, gt=0, le=86_400, description="hard limit per probe, compile included")


class GateSpec(Strict):
    """Quality gate (autotune.contract.gate) on the study's quality metric q: feasible iff
    q <= μ + max(abs_tol, k·σ) (a metric to minimize; q >= μ − max(abs_tol, k·σ) for one to
    maximize), with μ, σ the mean and sample standard deviation of the baseline's q over its
    seeds."""

    abs_tol: Number = Field(0.01, ge=0, le=10)
    k: Number = Field(2.0, ge=0, le=100, description="widen the gate to k × the baseline's seed spread")


class PruningSpec(Strict):
    """Early stopping of running trials (api.study.prune_rules.PruneRules)."""

    enabled: StrictBool = True
    rho: Number = Field(0.5, gt=0, le=1, description="prune when slower than rho × the best feasible (and not better)")
    loss_margin: Number = Field(0.5, ge=0, le=100, description="prune when the loss exceeds the baseline's by this "
                                                                "fraction (predicts a gate failure)")
    min_fraction: Number = Field(0.3, ge=0, le=1, description="… only after this fraction of the sample budget")


class RemeasureSpec(Strict):
    """The verdict: once the search is done, the top configs and the baseline are measured again
    in interleaved rounds until each config is decided (autotune.contract.verdict; docs/measurement.md,
    *The verdict*). Every round runs the baseline and the undecided configs once each, with the
    round's own probe seed; a config is *certified* when its speedup's interval lies above 1 and
    its quality is non-inferior to the baseline's at the same budget, *rejected* when either is
    shown worse, and measured again otherwise, up to max_rounds."""

    top_k: Int = Field(2, ge=0, le=100, description="distinct configs re-measured (0 disables the verdict)")
    samples_factor: Number = Field(1.0, ge=1, le=100, description="probe samples × this factor; 1 (the default) "
                                  "re-measures at the search's budget, so the baseline seeds count as runs of "
                                  "the baseline and quality is judged where the gate was set")
    windows: Int | None = Field(None, ge=5, le=100, description="timed windows of a re-measurement (None: the "
                                "study's probe.windows)")
    seed_offset: Int = Field(1000, ge=0, le=2**30, description="round r's probe seed: probe.seed + this + r")
    rounds: Int = Field(3, ge=1, le=20, description="rounds before the first decision (at least 2: a config's "
                        "own run-to-run spread needs two runs; 3 by default, where Welch's interval keeps its "
                        "level: with two runs a candidate's spread is often underestimated by chance)")
    max_rounds: Int | None = Field(None, ge=2, le=20, description="the most rounds (None: what fits in a third of "
                                   "the study's probes, n_trials / (3 × (top_k + 1)), at least 2 and at most 10)")
    confidence: Number = Field(0.95, ge=0.5, le=0.999, description="1 − the chance of certifying a config that is not "
                              "faster or not as good, over every config and round: split evenly between the "
                              "speed and the quality test")

    def round_limit(self, n_trials: int) -> int:
        """The most rounds a study runs (`max_rounds`, else derived from the study's size)."""
        if self.max_rounds is not None:
            return max(self.max_rounds, self.min_rounds)
        derived = n_trials // (3 * (self.top_k + 1))
        return max(self.min_rounds, min(10, derived))

    @property
    def min_rounds(self) -> int:
        """Rounds before the first decision: at least 2 (a config's own spread), and 3 when the
        re-measurement runs at a longer budget than the search (samples_factor > 1), where the
        baseline's seeds do not count and its quality spread needs three runs."""
        return max(2, self.rounds, 3 if self.samples_factor > 1 else 2)


class QualitySpec(Strict):
    """The study's quality metric: its name (as the workload's ProbeResult.quality_metric names
    it) and direction. Default: the workload's own, for a built-in workload (the registry
    knows it without importing); for a plugin workload the direction is "minimize" unless
    given here, and the name is taken from the first result a worker reports. A result
    naming another metric or direction fails its trial (kind "error") with the fix."""

    metric: str | None = Field(None, pattern=NAME_PATTERN, description="e.g. val_nrmse, val_loss, val_accuracy")
    direction: Literal["minimize", "maximize"] = "minimize"


class StudySpec(Strict):
    """What a user submits to start a study."""

    name: str = Field(..., pattern=NAME_PATTERN, description="slug: letters, digits, '_', '-', '.'")
    workload: str = Field("ups", pattern=NAME_PATTERN)
    preset: str = Field("tiny", pattern=NAME_PATTERN)
    space: str | dict[str, Any] = Field("cpu", description="a name from search_spaces/ or an inline space")
    objectives: list[Objective] = Field(default_factory=lambda: list(DEFAULT_OBJECTIVES),
                                        description="throughput, quality (val_nrmse: an alias) and/or energy "
                                                    "(GPU joules per sample, minimized; GPU studies only), e.g. "
                                                    "[throughput, quality, energy] or [energy, quality]")
    quality: QualitySpec | None = Field(None, description="the quality metric and its direction (default: the "
                                                          "workload's; see QualitySpec)")
    probe: ProbeSpec = Field(default_factory=lambda: ProbeSpec())
    n_trials: Int = Field(20, ge=1, le=100_000, description="baseline seeds + search trials (at least the "
                                                              "baseline seeds run); re-measurements come on top")
    sampler: Literal["tpe", "nsga2", "random", "grid", "gp"] = "tpe"
    hardware: Text = Field("cpu", min_length=1, max_length=200,
                          description="hardware class: 'cpu' or the GPU name a worker reports")
    baseline: dict[str, Any] | None = Field(None, description="the user's current config; enqueued first, "
                                                              "run with baseline_seeds seeds (default: the "
                                                              "research's starting point, see baseline_config)")
    baseline_seeds: Int = Field(3, ge=1, le=10, description="baseline runs (probe seeds seed, seed+1, …); the "
                                                            "search starts once they are done")
    starting_points: Literal["auto", "none"] | list[dict[str, Any]] = Field(
        "auto", description="the first search trials (autotune.contract.starting): 'auto' (GPU studies with tpe, "
                            "nsga2 or gp: the fast stack derived from the baseline: CUDA graphs, bf16, fused AdamW, "
                            "accumulation folded into the micro-batch, …), 'none', or a list of partial "
                            "configs of the space's parameters (the sampler draws the rest)")
    max_memory_gb: Number | None = Field(None, gt=0, description="peak reserved memory limit (GiB): "
                                                                 "a trial above it is infeasible")
    gate: GateSpec = Field(default_factory=lambda: GateSpec())
    pruning: PruningSpec = Field(default_factory=lambda: PruningSpec())
    remeasure: RemeasureSpec = Field(default_factory=lambda: RemeasureSpec())
    max_retries: Int = Field(2, ge=0, le=10, description="a trial lost with its worker (no heartbeat within the "
                                                          "grace period) is re-run as a new trial, same config and "
                                                          "probe, up to this many times; then it stays failed")
    seed: Int | None = Field(None, ge=0, le=2**32 - 1, description="sampler seed (0 to 2^32 - 1)")
    gpus_per_trial: Int = Field(1, ge=1, le=64, description="GPUs (world size) of every probe of the study, "
                                                            "baselines included: > 1 runs DDP/FSDP2 over N ranks "
                                                            "on one host; only workers started with the same "
                                                            "--gpus-per-trial get its trials (cpu: gloo processes)")
    _workload_checked: bool = PrivateAttr(False)

    @field_validator("objectives", mode="before")
    @classmethod
    def _objective_aliases(cls, v: Any) -> Any:
        if isinstance(v, list):
            return [OBJECTIVE_ALIASES.get(o, o) if isinstance(o, str) else o for o in v]
        return v

    @field_validator("objectives")
    @classmethod
    def _objectives(cls, v: list[Objective]) -> list[Objective]:
        if len(set(v)) != len(v) or not v:
            raise ValueError("objectives must be a non-empty list without repeats")
        return v

    @field_validator("baseline")
    @classmethod
    def _baseline(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            try:
                parse_config(v)
            except ConfigError as e:
                raise ValueError(f"baseline.{e}") from None
        return v

    @model_validator(mode="after")
    def _energy_needs_a_gpu(self) -> StudySpec:
        if "energy" in self.objectives and self.hardware == "cpu":
            raise ValueError("objectives: energy is measured by the GPU's energy counter (NVML) over the probe's "
                             "timed windows, and a study of hardware 'cpu' runs on no GPU: drop energy from "
                             "objectives, or set hardware to the GPU name your workers report (e.g. 'NVIDIA H100 "
                             "80GB HBM3': `autotune worker` prints it)")
        return self

    @model_validator(mode="after")
    def _space(self) -> StudySpec:
        try:
            space = self.resolved_space()
            validate_for(space, self.hardware, self.gpus_per_trial)
        except SpaceError as e:
            raise ValueError(f"space.{e}") from None
        if self.baseline is not None:
            try:
                check_hardware(self.baseline, self.hardware)
            except ConfigError as e:
                raise ValueError(f"baseline.{e}") from None
        if isinstance(self.starting_points, list):
            if self.sampler == "grid":
                raise ValueError("starting_points: the grid sampler runs every config of the space in its own "
                                 'order; drop starting_points (or use "auto"/"none"), or pick another sampler')
            try:
                check_points(space, self.starting_points)
            except SpaceError as e:
                raise ValueError(str(e)) from None
        return self

    @model_validator(mode="after")
    def _workload(self, info: ValidationInfo) -> StudySpec:
        """workload and preset must be registered (autotune.workloads). Checked once per spec
        (pydantic reruns this when the spec is put into a StudyInfo), and skipped for a spec read
        back from storage (validation context {"stored": True}): the study exists already, and
        whether a worker may run its workload is that worker's allow-list's decision."""
        stored = isinstance(info.context, dict) and info.context.get("stored")
        if not (self._workload_checked or stored):
            try:
                entry = check_workload(self.workload, self.preset)
            except UnknownWorkloadError as e:
                raise ValueError(f"{e.field}: {e}") from None
            if self.quality is None:  # the workload's own metric (a plugin's: named by its first result)
                self.quality = QualitySpec(metric=entry.quality_metric,
                                           direction=entry.quality_direction or "minimize")  # type: ignore[arg-type]
        self._workload_checked = True
        return self

    @property
    def quality_metric(self) -> str | None:
        """The quality metric's name; None for a plugin workload until its first result names it.
        A stored spec from before quality was generalised (no `quality`) is the ups NRMSE."""
        return "val_nrmse" if self.quality is None else self.quality.metric

    @property
    def quality_direction(self) -> Literal["minimize", "maximize"]:
        return "minimize" if self.quality is None else self.quality.direction

    def objective_directions(self) -> list[str]:
        """"maximize" / "minimize" per objective, in order (quality: the study's direction)."""
        return [self.quality_direction if o == "quality" else OBJECTIVES[o][1] for o in self.objectives]

    def objective_metric_names(self, quality_metric: str | None = None) -> list[str]:
        """Names of the objectives for Optuna (its dashboard): the quality objective is named by
        the metric (`quality_metric` when the spec does not know it yet, else "quality")."""
        name = self.quality_metric or quality_metric or "quality"
        return [name if o == "quality" else OBJECTIVES[o][0] for o in self.objectives]

    def baseline_config(self) -> dict[str, Any]:
        """The baseline's knobs: `baseline` when given, else the source research's starting
        point — the preset's batch × accumulation (ups/full: 12 × 4), fp32 without TF32, no
        compile, no checkpointing, inverse losses every step, and on GPU hosts its data
        pipeline (8 workers, prefetch 4). A CPU study keeps the loader in-process: eight
        workers on a laptop would measure the laptop, not the job."""
        if self.baseline is not None:
            return dict(self.baseline)
        if self.hardware == "cpu":
            return {}
        return dict(RESEARCH_GPU_DATA_PIPELINE)

    def resolved_space(self) -> Space:
        if isinstance(self.space, str):
            return load_space(self.space)  # a name only: never a path (specs come over the network)
        return parse_space(self.space)


class StudyInfo(BaseModel):
    name: str
    state: Literal["running", "stopped", "finished"]
    spec: StudySpec
    counts: dict[str, int] = Field(default_factory=dict, description="trials by state")
    remeasures: int = Field(0, description="of the trials in counts, the verdict's re-measurements (on top of "
                                           "spec.n_trials, which counts the baseline seeds and search trials)")
    failures: dict[str, int] = Field(default_factory=dict, description="failed trials by failure kind")
    retried: int = Field(0, description="lost trials re-run as a new trial (not in counts nor failures: "
                                        "their retry stands for them)")
    best: dict[str, Any] | None = None
    message: str | None = Field(None, description="why the study has no recommendation, when it cannot get one")


class StudyList(BaseModel):
    data: list[StudyInfo]
    count: int


# A lease's token as a worker sends it back (`TrialLease.lease_token`: 32 hex digits today)
LeaseToken = Annotated[str, Field(strict=True, min_length=1, max_length=64, pattern=r"^[0-9A-Za-z_-]+$")]
# The words of the 409 for a call that names another lease of the trial than the service's
# (`autotune.worker.spool.deliver` keeps such a result in the spool, for the service that leased it)
ANOTHER_LEASE = "another lease of trial"


class LeaseCall(Strict):
    """A trial's call (heartbeat, report, complete): it may name its lease by the lease's token."""

    lease_token: LeaseToken | None = Field(
        None, description="the token of the lease this call is for (TrialLease.lease_token): when given, the call "
                          "is taken only for the lease holding it (409 otherwise: a lease of another database, or a "
                          "restored copy). Left out: the older checks")

    @model_serializer(mode="wrap")
    def _token_when_known(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """On the wire, lease_token only when there is one: an older service forbids fields it does not know."""
        data: dict[str, Any] = handler(self)
        if data.get("lease_token", "") is None:
            del data["lease_token"]
        return data


class LeaseRequest(Strict):
    worker_id: Text = Field(..., min_length=1, max_length=200)
    hardware: Text = Field(..., min_length=1, max_length=200)
    study: str | None = Field(None, pattern=NAME_PATTERN)
    workloads: list[Annotated[str, Field(pattern=NAME_PATTERN)]] | None = Field(
        None, max_length=100, description="the workloads this worker runs (its --allow-workload list): studies of "
                                          "other workloads are not offered to it (None: any)")
    gpus_per_trial: Int = Field(1, ge=1, le=64, description="the GPUs this worker runs each trial on (its "
                                                            "--gpus-per-trial): only studies of that gpus_per_trial "
                                                            "are offered to it")


class TrialLease(BaseModel):
    trial_id: int
    study: str
    number: int
    params: dict[str, Any]
    config: dict[str, Any] = Field(..., description="the full knob config the probe runs (fixed + params)")
    workload: str
    preset: str
    probe: ProbeSpec
    is_baseline: bool = False
    role: Literal["baseline", "search", "remeasure"] = "search"
    lease_token: str | None = Field(None, description="this lease's token, made with it (the same when the worker "
                                                      "gets its active lease back): send it with the trial's "
                                                      "heartbeat, report and complete (None: an older service)")
    service_id: str | None = Field(None, description="the id of the service that made the lease (GET /v1/health's "
                                                     "service_id; None: an older service, or none recorded)")


class HeartbeatRequest(LeaseCall):
    worker_id: Text = Field(..., min_length=1, max_length=200)


class HeartbeatReply(BaseModel):
    action: Literal["continue", "stop"]
    reason: str | None = None


class ReportRequest(LeaseCall):
    worker_id: Text = Field(..., min_length=1, max_length=200)
    step: Int = Field(..., ge=0, le=2**31 - 1, description="optimizer steps so far (a 32-bit database integer)")
    metrics: dict[str, float]  # lax: a client that cannot write NaN in JSON sends "nan" (a loss gone bad)


class ReportReply(BaseModel):
    prune: bool
    reason: str | None = None


# The failure kinds a worker may report: the probe's (autotune/contract/errors.py) and the worker's own,
# "refused" (a workload off its allow-list, or not installed) and "interrupted" (SIGTERM/SIGINT).
# "lost" is the service's alone (the reaper's verdict on a silent worker).
ReportedFailureKind = Literal["oom", "nan", "timeout", "unsupported", "error", "refused", "interrupted"]
WORKER_FAILURE_KINDS = ("refused", "interrupted")
assert set(get_args(ReportedFailureKind)) == {*FAILURE_KINDS, *WORKER_FAILURE_KINDS}, \
    "ReportedFailureKind and autotune.contract.errors.FAILURE_KINDS disagree"

# Numbers of a result. Strict: a string ("12.5", "fast") or a boolean is not a number here,
# where pydantic's lax mode would convert the first and accept the second as 1.
Finite = Annotated[float, Field(strict=True, allow_inf_nan=False)]
NonNegative = Annotated[float, Field(strict=True, allow_inf_nan=False, ge=0)]
Count = Annotated[int, Field(strict=True, ge=0)]
# a telemetry reading (GPU clock, page faults, ...): any number, NaN included (an odd counter is
# still a reading); kept for the analysis, never judged
Reading = Annotated[float, Field(strict=True)]
# The physical bounds of a measured throughput (samples/s): a probe times at least one sample
# within its timeout (at most 86,400 s: over 1e-5 samples/s), and no training loop runs a
# billion samples a second. A number outside is no measurement, and the verdict's ratios of two
# such numbers overflow (1e-300 against 1.7e308 read "inf×", issue 35). Energy per sample gets
# the same ceiling (a GJ per sample).
MIN_THROUGHPUT = 1e-6
MAX_THROUGHPUT = 1e9
MAX_ENERGY_J_PER_SAMPLE = 1e9
Throughput = Annotated[float, Field(strict=True, allow_inf_nan=False, ge=0, lt=MAX_THROUGHPUT)]
Energy = Annotated[float, Field(strict=True, allow_inf_nan=False, ge=0, lt=MAX_ENERGY_J_PER_SAMPLE)]


class ProbeFailure(BaseModel):
    """A result's failure record: `kind` says what went wrong, `message` says it to a person.
    Other keys are kept (a distributed probe names the failing rank in "rank")."""

    model_config = ConfigDict(extra="allow")

    kind: ReportedFailureKind = Field(..., description="oom | nan | timeout | unsupported | error (the probe's); "
                                                       "refused | interrupted (the worker's: the trial is re-run)")
    message: Annotated[str, Field(strict=True)]


class TrialResult(BaseModel):
    """What a worker hands in to complete a trial: `autotune.engine.probe.ProbeResult.to_dict()`.

    Every field is typed and range-checked, so a malformed result is a 422 naming the field
    rather than a trial failed for a bad payload (a baseline that "fails" because of a typo
    would fail the whole study's gate). Measurements are finite numbers, throughputs, times
    and byte counts are not negative, counts are non-negative integers, the failure kind is
    one a worker reports. Every field is optional, as a worker that could not measure sends
    little (`autotune.worker.minimal_result`); what completing a trial needs on top
    (throughput and quality unless it failed or stopped early) is checked by
    `CompleteRequest`. Keys this model does not declare are accepted and ignored: a newer
    worker may send fields this service does not know yet, and must still be able to complete.
    A dump holds only the keys that were given (`exclude_unset`): the result goes on the wire
    as the worker built it."""

    model_config = ConfigDict(extra="allow")

    workload: str | None = None
    preset: str | None = None
    config: dict[str, Any] | None = Field(None, description="the effective config the probe ran (the leased one "
                                                            "with the preset's defaults filled in, and the derived "
                                                            "effective_batch); must be the leased config: "
                                                            "knobs and effective_batch only")
    device: str | None = None
    torch_version: str | None = None
    throughput_samples_per_s: Throughput | None = Field(None, description="timed samples per second (a "
                                                        f"measurement's: {MIN_THROUGHPUT:g} to {MAX_THROUGHPUT:g})")
    throughput_spread: NonNegative | None = Field(None, description="(max - min) / throughput over the windows")
    window_throughputs: list[Throughput] | None = None
    raw_window_throughputs: list[Throughput] | None = None
    val_nrmse: Annotated[float, Field(strict=True, allow_inf_nan=False, ge=0)] | None = Field(
        None, description="older workers' quality field (NRMSE workloads)")
    quality_metric: Text | None = Field(None, max_length=200, description="the quality metric's name, e.g. val_nrmse")
    quality: Finite | None = Field(None, description="the workload's quality metric on the validation set")
    quality_direction: Literal["minimize", "maximize"] | None = None
    warmup_s: NonNegative | None = None
    setup_s: NonNegative | None = None
    setup_phases: dict[str, NonNegative] | None = None
    process_start_s: Finite | None = None
    train_s: NonNegative | None = None
    peak_mem_reserved_bytes: Count | None = None
    peak_mem_allocated_bytes: Count | None = None
    data_wait_fraction: NonNegative | None = None
    window_data_wait_s: list[NonNegative] | None = None
    window_gpu: list[dict[str, Reading | None]] | None = None
    energy_j_per_sample: Energy | None = Field(None, description="GPU joules per sample over the timed "
                                                    "windows, every GPU of the trial (None on a CPU)")
    window_energy_j_per_sample: list[Energy] | None = None
    gpu_energy_j_per_sample: list[Energy] | None = Field(None, description="each GPU's share, rank order")
    energy_method: Literal["nvml_total_energy", "power_integral"] | None = None
    window_host: list[dict[str, Reading | None]] | None = None
    epoch_micro_batches: Count | None = None
    epoch_boundaries: list[dict[str, Any]] | None = None
    epoch_cost_s: NonNegative | None = None
    traced_steps: Count | None = None
    compile_workers: dict[str, Any] | None = None
    host_cpu: str | None = None
    measurement_notes: list[Annotated[str, Field(strict=True)]] | None = None
    loss_curve: list[tuple[Count, Finite]] | None = Field(None, description="[samples, loss] per timed window")
    samples_trained: Count | None = None
    steps: Count | None = None
    warmup_steps: Count | None = None
    window_steps: Count | None = None
    inverse_steps: Count | None = None
    world_size: Annotated[int, Field(strict=True, ge=1)] | None = None
    knobs: dict[str, Annotated[str, Field(strict=True)]] | None = Field(None, description="what each knob did")
    stopped_early: StrictBool = Field(False, description="pruned, or stopped by the service: no values")
    failure: ProbeFailure | None = Field(None, description="set when the probe failed: {kind, message}")

    def as_dict(self) -> dict[str, Any]:
        """The result as the worker sent it (given keys only, unknown ones included), validated."""
        return self.model_dump(mode="json", exclude_unset=True)


class CompleteRequest(LeaseCall):
    worker_id: Text = Field(..., min_length=1, max_length=200)
    result: TrialResult = Field(..., description="ProbeResult.to_dict(); failure set when it failed")

    @model_validator(mode="after")
    def _measured(self) -> CompleteRequest:
        """A result that neither failed nor stopped early is a measurement: it needs both numbers
        the gate and the recommendation read. Without them the trial would fail for a payload
        the worker can fix, not for its config."""
        result = self.result
        if result.failure is None and not result.stopped_early:
            if result.throughput_samples_per_s is None:
                raise ValueError("result.throughput_samples_per_s: missing; a result without a failure that was not "
                                 "stopped early must carry its throughput (a probe that could not measure reports "
                                 "failure: {kind, message})")
            if result.throughput_samples_per_s < MIN_THROUGHPUT:
                raise ValueError(f"result.throughput_samples_per_s: {result.throughput_samples_per_s!r} samples/s is "
                                 f"below the physical bound of {MIN_THROUGHPUT:g} (a probe times at least one sample "
                                 "within its timeout); report what the probe timed, or failure: {kind, message} "
                                 "when it timed nothing")
            if result.quality is None and result.val_nrmse is None:
                raise ValueError("result.quality: missing; a result without a failure that was not stopped early "
                                 "must carry its quality metric (quality, or val_nrmse from older workers; a probe "
                                 "that could not validate reports failure: {kind, message})")
        return self

    @field_serializer("result", mode="wrap")
    def _given_keys(self, result: TrialResult, handler: SerializerFunctionWrapHandler,
                    info: FieldSerializationInfo) -> dict[str, Any]:
        """On the wire, only the keys the worker gave (no nulls for every field it left out)."""
        return result.model_dump(mode=info.mode, exclude_unset=True)


class TrialInfo(BaseModel):
    trial_id: int
    number: int
    state: str
    params: dict[str, Any]
    config: dict[str, Any] | None = None
    values: list[float] | None = None
    throughput_samples_per_s: float | None = None
    val_nrmse: float | None = Field(None, description="the quality metric when it is val_nrmse (else None)")
    quality: float | None = Field(None, description="the study's quality metric (see quality_metric)")
    quality_metric: str | None = None
    energy_j_per_sample: float | None = Field(None, description="GPU joules per sample (None: not measured)")
    feasible: bool | None = None
    failure: dict[str, str] | None = None
    worker_id: str | None = None
    is_baseline: bool = False
    role: Literal["baseline", "search", "remeasure"] = "search"
    prune_reason: str | None = None
    remeasure_of: int | None = Field(None, description="the trial number a remeasure trial re-measures")
    remeasure_round: int | None = Field(None, description="a remeasure trial's round (0, 1, …)")
    starting_point: int | None = Field(None, description="which of the study's starting points this search "
                                                         "trial ran (0 = the first; None: the sampler's draw)")
    repeat_of: int | None = Field(None, description="the measured trial whose params the sampler drew again: this "
                                                    "trial was told its result and not run")
    baseline_repeat_of: int | None = Field(None, description="the baseline trial whose config this search trial "
                                             "drew: it measures the baseline again and is never a candidate")
    feasibility_note: str | None = Field(None, description="how `feasible` was judged when not by the study's gate "
                                         "(a re-measurement: against the baseline at its own budget, or not judged)")
    duration_s: float | None = None
    attempt: int = Field(1, description="1 for a first run; k for the (k-1)-th retry of a lost trial")
    retry_of: int | None = Field(None, description="the lost trial number this trial re-runs")
    retried_as: int | None = Field(None, description="the trial number that re-runs this lost trial")


class TrialList(BaseModel):
    data: list[TrialInfo]
    count: int


class ConfigVerdict(BaseModel):
    """One config's part in the verdict (autotune.contract.verdict): its runs at the judged budget and what
    the decision rule made of them. The baseline's row has no speedup or quality difference."""

    trial_number: int = Field(..., description="the search trial (or the baseline's first seed) it stands for")
    role: Literal["baseline", "candidate"]
    status: Literal["baseline", "certified", "rejected", "undecided", "failed", "stopped"] = Field(
        ..., description="certified: faster and no worse beyond the noise; rejected: shown slower or worse; "
        "undecided: neither yet; failed: a run failed; stopped: no longer measured (slower than a certified config)")
    reason: str = ""
    config: dict[str, Any] = Field(default_factory=dict)
    n: int = Field(0, description="runs at the judged budget (a candidate's search trial is not one of them: "
                                  "it was chosen for its speed)")
    throughput_samples_per_s: float | None = Field(None, description="geometric mean over the runs")
    throughput_sd_log: float | None = Field(None, description="sample sd of log throughput over the runs (about the "
                                            "relative run-to-run spread)")
    throughputs: list[float] = Field(default_factory=list, description="each run's throughput")
    quality_mean: float | None = None
    quality_sd: float | None = None
    qualities: list[float] = Field(default_factory=list)
    speedup: float | None = Field(None, description="the judged metric's ratio over the baseline's (throughput; "
                                  "energy per sample in an energy-picked study) with its interval")
    speedup_ci_low: float | None = None
    speedup_ci_high: float | None = None
    quality_diff: float | None = Field(None, description="mean quality minus the baseline's, signed so that > 0 is "
                                       "worse")
    quality_diff_ci_high: float | None = Field(None, description="the upper end of that difference's interval")
    quality_margin: float | None = Field(None, description="the non-inferiority margin: max(abs_tol, k × the "
                                         "baseline's sd at this budget)")
    alpha: float | None = Field(None, description="the one-sided level each test used at the last look (the study's "
                                "error rate spent over configs and looks)")


class Recommendation(BaseModel):
    study: str
    config: dict[str, Any]
    trial_number: int
    throughput_samples_per_s: float
    val_nrmse: float | None = Field(None, description="quality when the metric is val_nrmse (ups); else None")
    baseline_throughput_samples_per_s: float | None
    baseline_val_nrmse: float | None = None
    speedup: float | None
    gate_nrmse: float | None = None
    quality_metric: str = Field("val_nrmse", description="the name of the study's quality metric")
    quality_direction: Literal["minimize", "maximize"] = "minimize"
    quality: float | None = Field(None, description="the recommended config's quality metric")
    baseline_quality: float | None = Field(None, description="the mean of the baseline seeds' quality metric")
    baseline_quality_std: float | None = None
    gate_quality: float | None = Field(None, description="the gate: the worst quality a feasible trial may have")
    peak_mem_reserved_bytes: int | None = None
    throughput_ci_low: float | None = Field(None, description="95 % confidence interval of the throughput")
    throughput_ci_high: float | None = None
    remeasured: bool = False
    remeasure_rounds: int = Field(0, description="the re-measurements the throughput pools (0: the search trial's own)")
    round_throughputs: list[float] = Field(default_factory=list, description="each re-measurement's own throughput, "
                                           "round by round (empty: not re-measured): how much the config's speed "
                                           "varied from process to process")
    baseline_val_nrmse_std: float | None = None
    baseline_seeds: int = 0
    measurement_notes: list[str] = Field(default_factory=list, description="what qualifies the recommended "
                                         "throughput's measurement (e.g. the GPU was throttled during it)")
    speedup_ci_low: float | None = Field(None, description="95 % confidence interval of the speedup (the ratio), "
                                         "from the run-to-run spread of the baseline's and the pick's runs")
    speedup_ci_high: float | None = None
    beats_baseline: bool | None = Field(None, description="the speedup's interval lies above 1 (False: no config "
                                        "beat the baseline beyond the noise; None: no interval)")
    verdict: str = Field("", description="one sentence: the speedup, its interval, and whether it is beyond noise")
    quality_budget: Literal["search", "remeasure"] = Field(
        "search", description="the sample budget `quality` and `gate_quality` are at: the re-measurement's "
        "(judged against the baseline re-measured at that budget) or the search probe's")
    search_quality: float | None = Field(None, description="the pick's quality in its search trial (short probe)")
    search_gate_quality: float | None = Field(None, description="the gate at the search's sample budget (from "
                                              "the baseline seeds), which judged every search trial")
    search_throughput_samples_per_s: float | None = Field(None, description="the pick's search-trial throughput")
    caveats: list[str] = Field(default_factory=list, description="what qualifies the recommendation itself (not "
                               "re-measured, quality not judged at the re-measure budget, how the speedup's "
                               "interval was formed)")
    baseline_remeasured: bool = Field(False, description="the baseline was re-measured with the pick: the speedup "
                                      "and quality compare the two at the same budget")
    chosen_by: Literal["throughput", "energy"] = Field(
        "throughput", description="what picked the config among the candidates: the fastest (a study with a "
        "throughput objective, or with neither) or the lowest energy per sample (energy without throughput)")
    energy_j_per_sample: float | None = Field(None, description="the pick's GPU joules per sample (pooled over its "
                                              "re-measurements); None where not measured")
    baseline_energy_j_per_sample: float | None = Field(None, description="the baseline's, at the same budget as "
                                                       "the speedup's baseline")
    energy_ratio: float | None = Field(None, description="the pick's energy per sample over the baseline's "
                                       "(below 1: less energy per sample)")
    energy_ratio_ci_low: float | None = Field(None, description="95 % interval of the energy ratio, formed like the "
                                              "speedup's")
    energy_ratio_ci_high: float | None = None
    saves_energy: bool | None = Field(None, description="the energy ratio's interval lies below 1 (None: no "
                                      "interval)")
    energy_method: str | None = Field(None, description="nvml_total_energy | power_integral")
    energy_verdict: str = Field("", description="one sentence on the energy ratio (empty: not measured)")
    certified: bool = Field(False, description="the pick is faster beyond the noise and its quality no worse than "
                            "the baseline's (autotune.contract.verdict); False: `config` is the baseline's own")
    outcome: Literal["certified", "no_win", "undecided", "not_judged"] = Field(
        "not_judged", description="certified; no_win: every candidate was rejected; undecided: the re-measure budget "
        "ran out before a candidate was decided; not_judged: re-measurement is off (remeasure.top_k 0)")
    reason: str = Field("", description="why the verdict is what it is, in one sentence")
    configs: list[ConfigVerdict] = Field(default_factory=list, description="the decision rule's inputs, baseline "
                                         "first: n, mean and sd per config")
    rounds_run: int = Field(0, description="re-measure rounds run")
    max_rounds: int = Field(0, description="the most rounds the study may run (remeasure.round_limit)")
    remeasure_probes: int = Field(0, description="re-measure probes run (the verdict's cost)")
    uncertified: ConfigVerdict | None = Field(None, description="the fastest candidate that was not certified (what "
                                              "`autotune best --uncertified` prints)")

    def energy_lines(self) -> list[str]:
        """The energy in words (the YAML header, the report): the pick's J/sample, the baseline's
        and their ratio with its interval; nothing when the pick has none."""
        if self.energy_j_per_sample is None:
            return []
        method = f" ({self.energy_method})" if self.energy_method else ""
        lines = [f"energy: {self.energy_j_per_sample:.4g} J/sample{method}"]
        if self.baseline_energy_j_per_sample is not None:
            same = " at the same budget" if self.baseline_remeasured else ""
            ratio = "n/a" if self.energy_ratio is None else f"{self.energy_ratio:.2f}x"
            if self.energy_ratio_ci_low is not None and self.energy_ratio_ci_high is not None:
                ratio += f", 95% CI {self.energy_ratio_ci_low:.2f}-{self.energy_ratio_ci_high:.2f}x"
            lines.append(f"baseline energy: {self.baseline_energy_j_per_sample:.4g} J/sample{same} "
                         f"(pick / baseline {ratio})")
        return lines
