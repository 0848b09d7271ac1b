"""What becomes of one leased trial: `TrialRun` records what happened while its child ran, and
`final_result` turns that into the result the trial is completed with (the child's own, or a
failure record, or a partial result built from a pruned child's reports)."""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from typing import Any

from autotune.contract.gate import window_rate
from autotune.contract.results import TrialLease
from autotune.worker.courier import Courier
from autotune.worker.hardware import Hardware
from autotune.worker.options import hard_timeout_grace_s


@dataclass
class TrialRun:
    """What happened to one leased trial while its child ran."""

    lease: TrialLease
    service_id: str | None = None  # the id of the service that leased it (None: unknown)
    started: float = field(default_factory=time.monotonic)
    reports: list[dict[str, Any]] = field(default_factory=list)
    result: dict[str, Any] | None = None
    returncode: int | None = None
    prune_reason: str | None = None
    stop_reason: str | None = None  # the service said stop (heartbeat)
    interrupted_by: str | None = None  # SIGINT / SIGTERM name
    timed_out: bool = False
    dropped: str | None = None  # why the trial is no longer ours (no complete)
    rank_failure: dict[str, Any] | None = None  # a distributed probe's earliest rank failure record
    courier: Courier | None = None  # carried its reports and heartbeats
    child_ended: float | None = None  # monotonic time the monitor saw the child's stdout end
    progress: dict[str, Any] | None = None  # the probe's last progress message (phase, samples, ETA)

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started



def describe_exit(returncode: int) -> str:
    """Why a child ended without a result, in words."""
    if returncode < 0:
        number = -returncode
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        hint = ": possibly the OOM killer" if number == signal.SIGKILL else ""
        return f"probe process killed by signal {number} ({name}{hint})"
    if returncode == 0:
        return "probe process exited (code 0) without printing a result"
    return f"probe process exited with code {returncode} without a result"



def minimal_result(lease: TrialLease, hardware: Hardware, failure: dict[str, str] | None,
                   **fields: Any) -> dict[str, Any]:
    """A ProbeResult dict for a trial whose child gave none: workload, preset, config, device,
    torch_version and the failure always present."""
    from autotune.engine.result import ProbeResult  # no torch: a plain record

    result = ProbeResult(workload=lease.workload, preset=lease.preset, config=dict(lease.config),
                         device=hardware.device_name, torch_version=hardware.torch_version, failure=failure)
    for name, value in fields.items():
        setattr(result, name, value)
    return result.to_dict()


def partial_result(run: TrialRun, hardware: Hardware) -> dict[str, Any]:
    """A stopped_early result from the reports a pruned child sent before it was killed."""
    throughputs = [float(r["metrics"]["throughput"]) for r in run.reports if "throughput" in r["metrics"]]
    curve = [(int(r["metrics"].get("samples", 0)), float(r["metrics"]["loss"])) for r in run.reports
             if "loss" in r["metrics"]]
    fields: dict[str, Any] = {"stopped_early": True, "window_throughputs": throughputs, "loss_curve": curve}
    if throughputs:
        rate, spread = window_rate(throughputs)  # as the probe's own (autotune.engine.probe)
        fields.update(throughput_samples_per_s=rate, throughput_spread=spread)
    if run.reports:
        last = run.reports[-1]
        fields.update(steps=int(last["step"]), samples_trained=int(last["metrics"].get("samples", 0)))
    return minimal_result(run.lease, hardware, None, **fields)


def final_result(run: TrialRun, hardware: Hardware, stderr_tail: str) -> dict[str, Any]:
    """The result to complete `run`'s trial with. The child's own result wins when it gave
    one (marked stopped_early if the trial was pruned); otherwise, by precedence: the worker
    was interrupted, the service said stop, the hard timeout, pruned (a partial result from
    the reports), a rank of a distributed probe failed (its record), the child died."""

    def failed(kind: str, message: str) -> dict[str, Any]:
        return minimal_result(run.lease, hardware, {"kind": kind, "message": message})

    if run.result is not None:
        if run.prune_reason is not None and not run.result.get("failure"):
            return {**run.result, "stopped_early": True}
        return run.result
    if run.interrupted_by:
        return failed("interrupted", f"worker interrupted by {run.interrupted_by}")
    if run.stop_reason:
        return failed("error", f"stopped by the service: {run.stop_reason}")
    if run.timed_out:
        timeout = run.lease.probe.timeout_s
        return failed("timeout", f"probe exceeded its hard limit of {timeout:g} s "
                                 f"(+{hard_timeout_grace_s(timeout):g} s grace) and was killed")
    if run.prune_reason is not None:
        return partial_result(run, hardware)
    if run.rank_failure is not None:  # a rank failed: the launcher ended the others; its record says why
        return run.rank_failure
    why = describe_exit(run.returncode if run.returncode is not None else -1)
    return failed("error", f"{why}; stderr tail:\n{stderr_tail}" if stderr_tail else why)
