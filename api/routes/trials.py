"""The worker protocol: lease → heartbeat / report → complete (autotune/contract/results.py).

Every route needs a worker (or admin) token, not tied to a worker id. heartbeat, report and
complete answer a trial that is not the caller's the same way (api/ownership.py): 404 for no such
trial, 409 for one that is no longer its own (the worker stops the probe and leases the next one).
A complete repeated by its worker gets the stored TrialInfo; a malformed result, or one of another
config, is a 422 that changes nothing.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Path, Response, status

from autotune.api.deps import ServiceDep, WorkerAuth
from autotune.contract.results import (
    CompleteRequest,
    HeartbeatReply,
    HeartbeatRequest,
    LeaseRequest,
    ReportReply,
    ReportRequest,
    TrialLease,
)
from autotune.contract.views import TrialInfo

# Optuna's trial ids are database integers: a larger id cannot exist (and would overflow the driver)
TrialId = Path(..., ge=0, le=2**31 - 1, description="the trial's id (TrialLease.trial_id)")
router = APIRouter(prefix="/trials", tags=["trials"],
                   responses={401: {"description": "no valid token (missing, unknown or revoked)"},
                              403: {"description": "the token's role may not do this"}})
# heartbeat, report and complete: the answers for a trial that is not the caller's (see the module docstring)
NOT_YOURS: dict[int | str, dict[str, Any]] = {
    404: {"description": "no trial with this id"},
    409: {"description": "the trial is not this worker's: held by another worker, its lease reaped, already "
                         "completed, or the call's lease_token is another lease's (the detail says which); stop it "
                         "and lease a new trial"}}


@router.post("/lease", response_model=TrialLease,
             responses={204: {"description": "no trial to run now for this hardware (or study)"}})
def lease_trial(request: LeaseRequest, service: ServiceDep, _caller: WorkerAuth) -> TrialLease | Response:
    """The next trial for this worker (its active one again if it holds one); 204 when there is none."""
    lease = service.lease_trial(request)
    if lease is None:
        return Response(status_code=status.HTTP_204_NO_CONTENT)
    return lease


@router.post("/{trial_id}/heartbeat", response_model=HeartbeatReply, responses=NOT_YOURS)
def heartbeat(request: HeartbeatRequest, service: ServiceDep, _caller: WorkerAuth,
              trial_id: int = TrialId) -> HeartbeatReply:
    """continue, or stop (the study was stopped, or the trial finished meanwhile). 409 if the trial is not
    leased to this worker, as report and complete."""
    return service.heartbeat(trial_id, request)


@router.post("/{trial_id}/report", response_model=ReportReply, responses=NOT_YOURS)
def report(request: ReportRequest, service: ServiceDep, _caller: WorkerAuth, trial_id: int = TrialId) -> ReportReply:
    """Store intermediate metrics; the reply says whether to prune. 409 if the trial is not leased to this worker."""
    return service.report(trial_id, request)


@router.post("/{trial_id}/complete", response_model=TrialInfo,
             responses=NOT_YOURS)  # 422 (FastAPI's validation error): a malformed result, or another config
def complete(request: CompleteRequest, service: ServiceDep, _caller: WorkerAuth, trial_id: int = TrialId) -> TrialInfo:
    """Finish the trial with its ProbeResult; repeating it from the same worker is harmless. 422 names the bad
    field of a malformed result (or the config keys that differ from the leased config); the trial stays
    leased, so send the corrected result."""
    return service.complete(trial_id, request)
