"""The worker protocol: lease → heartbeat / report → complete (see autotune/contract/protocol.py).

Every route needs a worker (or admin) token. The token is not tied to a worker id: a
worker token may act for any worker (workers are trusted alike; the token keeps others out).

heartbeat, report and complete answer a trial that is not the caller's the same way: 404 when
no such trial exists, 409 when it is held by another worker, its lease was reaped or it was
never leased here ("cannot <verb> trial N: <why>; stop running it and lease a new trial"),
409 "cannot <verb> trial N: it is already completed ..." once its result is in. A worker
needs one rule: 409 = the trial is no longer its own; stop the probe, lease the next one.
The one 200 after completion is the completing worker repeating its complete (a network
retry): it gets the stored TrialInfo, nothing changes. A heartbeat's "stop" is an
instruction to the trial's holder (its study was stopped, or the trial finished meanwhile).

A call that carries a lease token (`TrialLease.lease_token`) is taken only for the lease holding
that token: another token is a 409 "... another lease of trial N ..." before anything else (a
lease of another database or a restored copy, whose trial ids are the same); nothing is stored.

complete validates its result (`autotune.contract.protocol.TrialResult`): a malformed one, or one
whose config is not the leased config, is a 422 naming the field; nothing changes and the
trial stays leased to the worker, so a corrected complete goes through.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Path, Response, status

from autotune.api.deps import ServiceDep, WorkerAuth
from autotune.contract.protocol import (
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
