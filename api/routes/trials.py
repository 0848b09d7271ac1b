"""The worker protocol: lease → heartbeat / report → complete (see autotune/protocol.py).

Every route needs a worker (or admin) token. The token is not tied to a worker id: a
worker token may act for any worker (workers are trusted alike; the token keeps others out).
"""

from __future__ import annotations

from fastapi import APIRouter, Path, Response, status

from api.deps import ServiceDep, WorkerAuth
from autotune.protocol import (
    CompleteRequest,
    HeartbeatReply,
    HeartbeatRequest,
    LeaseRequest,
    ReportReply,
    ReportRequest,
    TrialInfo,
    TrialLease,
)

# Optuna's trial ids are database integers: a larger id cannot exist (and would overflow the driver)
TrialId = Path(..., ge=0, le=2**31 - 1, description="the trial's id (TrialLease.trial_id)")
router = APIRouter(prefix="/trials", tags=["trials"],
                   responses={401: {"description": "no valid token (missing, unknown or revoked)"},
                              403: {"description": "the token's role may not do this"}})


@router.post("/lease", response_model=TrialLease,
             responses={204: {"description": "no trial to run now for this hardware (or study)"}})
def lease_trial(request: LeaseRequest, service: ServiceDep, _caller: WorkerAuth) -> TrialLease | Response:
    """The next trial for this worker (its active one again if it holds one); 204 when there is none."""
    lease = service.lease_trial(request)
    if lease is None:
        return Response(status_code=status.HTTP_204_NO_CONTENT)
    return lease


@router.post("/{trial_id}/heartbeat", response_model=HeartbeatReply)
def heartbeat(request: HeartbeatRequest, service: ServiceDep, _caller: WorkerAuth,
              trial_id: int = TrialId) -> HeartbeatReply:
    """continue, or stop (study stopped, trial no longer leased to this worker)."""
    return service.heartbeat(trial_id, request)


@router.post("/{trial_id}/report", response_model=ReportReply)
def report(request: ReportRequest, service: ServiceDep, _caller: WorkerAuth, trial_id: int = TrialId) -> ReportReply:
    """Store intermediate metrics; the reply says whether to prune. 409 if the trial is not leased to this worker."""
    return service.report(trial_id, request)


@router.post("/{trial_id}/complete", response_model=TrialInfo)
def complete(request: CompleteRequest, service: ServiceDep, _caller: WorkerAuth, trial_id: int = TrialId) -> TrialInfo:
    """Finish the trial with its ProbeResult; repeating it from the same worker is harmless."""
    return service.complete(trial_id, request)
