"""The worker protocol: lease → heartbeat / report → complete (see autotune/protocol.py)."""

from __future__ import annotations

from fastapi import APIRouter, Response, status

from api.deps import ServiceDep
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

router = APIRouter(prefix="/trials", tags=["trials"])


@router.post("/lease", response_model=TrialLease,
             responses={204: {"description": "no trial to run now for this hardware (or study)"}})
def lease_trial(request: LeaseRequest, service: ServiceDep) -> TrialLease | Response:
    """The next trial for this worker (its active one again if it holds one); 204 when there is none."""
    lease = service.lease_trial(request)
    if lease is None:
        return Response(status_code=status.HTTP_204_NO_CONTENT)
    return lease


@router.post("/{trial_id}/heartbeat", response_model=HeartbeatReply)
def heartbeat(trial_id: int, request: HeartbeatRequest, service: ServiceDep) -> HeartbeatReply:
    """continue, or stop (study stopped, trial no longer leased to this worker)."""
    return service.heartbeat(trial_id, request)


@router.post("/{trial_id}/report", response_model=ReportReply)
def report(trial_id: int, request: ReportRequest, service: ServiceDep) -> ReportReply:
    """Store intermediate metrics; the reply says whether to prune. 409 if the trial is not leased to this worker."""
    return service.report(trial_id, request)


@router.post("/{trial_id}/complete", response_model=TrialInfo)
def complete(trial_id: int, request: CompleteRequest, service: ServiceDep) -> TrialInfo:
    """Finish the trial with its ProbeResult; repeating it from the same worker is harmless."""
    return service.complete(trial_id, request)
