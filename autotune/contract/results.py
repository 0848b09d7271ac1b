"""A trial's calls between a worker and the service, as pydantic models: the lease (LeaseRequest →
TrialLease), heartbeat, report, and complete (CompleteRequest, carrying the probe's TrialResult).

A call may name its lease by the lease's token (`LeaseCall.lease_token`): one that names another
lease of the trial (another database, a restored copy) is refused with a 409 (ANOTHER_LEASE) and
the worker keeps the result in its spool. A result is typed and range-checked field by field, so a
malformed one is a 422 naming the field (the trial stays leased, a corrected complete goes
through) rather than a trial failed for a typo; keys it does not declare are accepted and ignored,
since a newer worker may send more.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    FieldSerializationInfo,
    SerializerFunctionWrapHandler,
    StrictBool,
    field_serializer,
    model_serializer,
    model_validator,
)

from autotune.contract.errors import FAILURE_KINDS
from autotune.contract.protocol import NAME_PATTERN, Int, ProbeSpec, Strict, Text

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
    """What a worker hands in to complete a trial: `autotune.engine.result.ProbeResult.to_dict()`.

    Every field is typed and range-checked, so a malformed result is a 422 naming the field
    rather than a trial failed for a bad payload (a baseline that "fails" because of a typo
    would fail the whole study's gate). Measurements are finite numbers, throughputs, times
    and byte counts are not negative, counts are non-negative integers, the failure kind is
    one a worker reports. Every field is optional, as a worker that could not measure sends
    little (`autotune.worker.results.minimal_result`); what completing a trial needs on top
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
    # provenance (Recommendation.provenance); left out by older workers
    cuda_version: Annotated[str, Field(strict=True, max_length=100)] | None = Field(
        None, description="torch.version.cuda (None: a CPU build of torch)")
    driver_version: Annotated[str, Field(strict=True, max_length=100)] | None = Field(
        None, description="the NVIDIA driver's version from NVML (None: no GPU or no NVML)")
    gpu_count: Count | None = Field(None, description="GPUs the probe ran on (0 on a CPU)")
    model_fingerprint: Annotated[str, Field(strict=True, max_length=100)] | None = Field(
        None, description="autotune.contract.provenance.model_fingerprint of the model the probe built")
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
