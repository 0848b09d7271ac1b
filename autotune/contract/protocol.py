"""The study spec: what a user submits to start a study (`StudySpec` and its parts), and the
field types every wire model shares.

The wire contract between the service (`api/`), the workers and clients is written once, as
pydantic models the service and the worker both import: this module (the spec),
`autotune.contract.results` (a trial's calls: lease, heartbeat, report, complete and its result)
and `autotune.contract.views` (what the service answers about studies and trials). The routes,
all under /v1, are listed in docs/service.md. No number of any request is a boolean or a
string (``"n_trials": true`` is refused, not taken as 1).

A study runs `baseline_seeds` baseline trials (role "baseline": they set the quality gate),
then search trials (role "search") up to n_trials in all, then re-measures its top feasible
configs (role "remeasure", the verdict). Imports pydantic, the config/space validators and
the workload registry only (no torch, no fastapi).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    ValidationInfo,
    field_validator,
    model_validator,
)

from autotune.contract.config import ConfigError, check_hardware, parse_config
from autotune.contract.registry import UnknownWorkloadError, check_workload
from autotune.contract.space import SPACE_ROOT, Space, SpaceError, load_space, parse_space, validate_for
from autotune.contract.starting import check_points

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
MAX_WARM_STUDIES = 10  # studies a warm start may name
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
    """What a person or a program submits: an unknown field is an error that names it (a typo is not
    ignored). Read back, with context {"stored": True} (from the database, or in a reply of a newer
    service), a record is taken as the release that wrote it meant it: an unknown field is a later
    release's and is dropped (a client one release behind its service still reads its studies), and
    a field added since takes `STORED_DEFAULTS`, the behaviour from before it existed, where that
    differs from its default (an upgrade does not re-judge a stored study)."""

    model_config = ConfigDict(extra="forbid")
    STORED_DEFAULTS: ClassVar[dict[str, Any]] = {}

    @model_validator(mode="before")
    @classmethod
    def _as_stored(cls, data: Any, info: ValidationInfo) -> Any:
        if isinstance(data, dict) and (info.context or {}).get("stored"):
            return {**cls.STORED_DEFAULTS, **{key: value for key, value in data.items() if key in cls.model_fields}}
        return data


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
    quality_headroom: bool = Field(True, description="also re-measure the fastest candidate whose search quality "
                                   "beat the baseline's mean by the gate's own margin, when none of the top_k did: "
                                   "the fastest configs often sit near the gate, where a few rounds cannot show them "
                                   "no worse, while a slower one clearly better is decided in the first look")
    STORED_DEFAULTS: ClassVar[dict[str, Any]] = {"quality_headroom": False}  # studies stored before it: off
    larger_batch_quality: Literal["search", "remeasure"] = Field(
        "search", description="where a config whose effective batch (batch_size × accum_steps) is larger than the "
        "baseline's is judged on quality: 'search' (the default), by the gate at the search's budget like every "
        "config; 'remeasure', at the re-measurement's longer budget (samples_factor ≥ 2): such a config that the "
        "gate refused (or that trailed the baseline's loss) at the search's budget is re-measured beside the top_k "
        "when it was faster, since a larger batch takes fewer optimizer steps over the same samples and catches up "
        "with training length")

    @model_validator(mode="after")
    def _larger_batch_quality(self) -> RemeasureSpec:
        if self.larger_batch_quality == "remeasure" and (self.samples_factor < 2 or self.top_k == 0):
            raise ValueError("larger_batch_quality 'remeasure' judges a larger batch's quality at the re-measure "
                             f"budget, which needs re-measurement on (top_k ≥ 1, here {self.top_k}) at a longer "
                             f"budget than the search's (samples_factor ≥ 2, here {self.samples_factor:g}): set "
                             "samples_factor to 8 or more (a larger batch's loss catches up over more steps), or "
                             "leave larger_batch_quality 'search'")
        return self

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
    warm_start: Literal["auto", "none"] | list[Annotated[str, Field(pattern=NAME_PATTERN)]] = Field(
        "none", description="earlier studies whose certified picks and front configs this study tries first, "
                            "after its baseline and before its own starting points (autotune.contract.starting."
                            "warm_points): their names, 'auto' (every finished study of the same workload, "
                            "preset and hardware class, newest first; where both record a model fingerprint it "
                            "must match), or 'none'. Their configs are measured again here, never reused")
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

    @field_validator("space", mode="before")
    @classmethod
    def _space_shape(cls, v: Any) -> Any:
        if not isinstance(v, (str, dict)):
            raise ValueError(f"expected a name from search_spaces/ (e.g. 'cpu', 'h100') or an inline mapping with "
                             f"'params', got {type(v).__name__}")
        return v

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
    def _warm_start(self) -> StudySpec:
        if isinstance(self.warm_start, list):
            if not self.warm_start:
                raise ValueError('warm_start: an empty list; name earlier studies, or use "auto" or "none"')
            if len(self.warm_start) > MAX_WARM_STUDIES:
                raise ValueError(f"warm_start: {len(self.warm_start)} studies; at most {MAX_WARM_STUDIES}")
            if self.name in self.warm_start:
                raise ValueError(f"warm_start: {self.name!r} is this study; name earlier studies")
        if self.warm_start != "none" and self.sampler == "grid":
            raise ValueError("warm_start: the grid sampler runs every config of the space in its own order; set "
                             'warm_start: "none", or pick another sampler')
        return self

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
            raise ValueError(str(e) if e.field == SPACE_ROOT else f"space.{e}") from None
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
