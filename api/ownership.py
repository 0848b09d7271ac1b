"""Who may act on a leased trial: the 409 rule of heartbeat, report and complete, written once.

A worker needs one rule: 409 means the trial is no longer its own, so it stops the probe and
leases a new trial. Every refusal text below ends by saying so (`STOP`).
"""

from __future__ import annotations

from autotune.api import crud
from autotune.api.errors import Conflict
from autotune.contract.results import ANOTHER_LEASE

STOP = "stop running it and lease a new trial"  # what every 409 of a running trial asks of the worker


def not_yours(trial_id: int, lease: crud.LeaseRecord | None, worker_id: str, verb: str) -> Conflict | None:
    """The 409 that heartbeat, report and complete all give `worker_id` for a trial it may not
    act on (`verb`: what it tried); None when it holds the trial's active lease.

    A finished trial says so whoever asks, "already completed", before any other reason:
    naming the worker that holds it would send the reader looking for a second worker that
    was never there."""
    if lease is not None and not lease.active and lease.outcome == "completed":
        return Conflict(f"cannot {verb} trial {trial_id}: it is already completed (by worker {lease.worker_id!r}); "
                        "its result stands, nothing more is taken for it: lease a new trial")
    if lease is None:
        why = "it was not leased by this service"
    elif not lease.active:
        why = ("its lease was reaped: no heartbeat within the grace period, the trial is marked FAIL (lost)"
               if lease.outcome == "lost" else f"its lease ended ({lease.outcome})")
    elif lease.worker_id != worker_id:
        why = f"it is leased to worker {lease.worker_id!r}, not {worker_id!r}"
    else:
        return None
    return Conflict(f"cannot {verb} trial {trial_id}: {why}; {STOP}")


def another_lease(trial_id: int, lease: crud.LeaseRecord | None, token: str | None, verb: str) -> Conflict | None:
    """The 409 for a call whose lease token (`token`) is not the token of the trial's lease: it
    was leased from another database (a backup keeps the service id, and trial ids restart at 1:
    the same id, study, number and worker may be another lease) or a restored copy. None when
    the call carries no token (an older worker: the other checks only), the trial has no lease
    here (`not_yours` says so), or the tokens are the same. A lease from before tokens (None)
    holds no token: a call that carries one is for another lease."""
    if token is None or lease is None or lease.token == token:
        return None
    what = "this result was measured for" if verb == "complete" else "this call is for"
    fate = ("nothing is stored. The worker keeps the result in its spool, for the service, study and trial it "
            "was leased from, and delivers it when that service answers" if verb == "complete" else
            f"{STOP} (a finished probe's result waits in the worker's spool for the service it was leased from)")
    return Conflict(f"cannot {verb} trial {trial_id}: {what} {ANOTHER_LEASE} {trial_id} than the one this service "
                    "holds (another database, or a restored copy of this one: trial ids restart at 1 in every "
                    f"database, and a backup keeps its service id); {fate}")


def refusal(trial_id: int, lease: crud.LeaseRecord | None, worker_id: str, verb: str,
            token: str | None = None) -> Conflict:
    """Why `worker_id` may not `verb` the trial whose lease (`lease`, read just now) it was found
    not to hold: the Conflict of `another_lease`, else of `not_yours`, else (the lease changed
    between the check and this read) a lease that changed meanwhile."""
    return (another_lease(trial_id, lease, token, verb) or not_yours(trial_id, lease, worker_id, verb)
            or Conflict(f"cannot {verb} trial {trial_id}: its lease changed meanwhile; {STOP}"))
