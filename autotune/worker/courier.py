"""The courier: one trial's reports and heartbeats carried to the service on a thread of its own,
so that the monitor (autotune.worker.trial) never waits on the network.

A heartbeat goes every `heartbeat_s`; its reply may say stop, a report's reply may say prune, and
a 409 says the trial is no longer this worker's: those are the courier's `decisions`, which the
monitor acts on (the child is only ever handled there). While the service is away the courier
keeps at most MAX_PENDING_REPORTS reports, dropping the oldest: a prune decision comes late, the
probe's timed windows (measured in the child) are never touched."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from autotune.worker.client import ApiError, Client, Conflict, ServiceUnavailable

log = logging.getLogger(__name__)

# Reports the courier keeps while the service is away (the oldest are dropped beyond this).
MAX_PENDING_REPORTS = 8
COURIER_CLOSE_S = 2.0  # after the probe, the courier gets this long to hand in what it holds
AWAY_PAUSE_S = 1.0  # the courier's pause between two tries while the service is away (each try has its budget)


class Courier:
    """Carries one trial's reports and heartbeats to the service, on a thread of its own.

    The monitor must keep draining the child's stdout whatever the service does: `post` never
    blocks, it queues the report, keeping at most `max_pending` (the oldest are dropped and
    counted: a late prune is fine, a stalled monitor is not). Decisions (`decisions`: prune,
    stop, conflict) are set here and acted on by the monitor, which `wake` nudges.

    While the service is away a report is retried (kept at the head of the queue) after each
    failed try's budget plus AWAY_PAUSE_S; heartbeats go on at their interval. `close` gives
    the queue COURIER_CLOSE_S to reach a service that answers, then abandons the thread
    (whatever it would still send is not wanted). No retry library for this: a report's retry
    must give way to heartbeats and to `close` (the lease bounds it), which a queue and one
    condition do; each call's own backoff is the Client's."""

    def __init__(self, client: Client, trial_id: int, worker_id: str, heartbeat_s: float,
                 wake: Callable[[], None] = lambda: None, max_pending: int = MAX_PENDING_REPORTS,
                 lease_token: str | None = None) -> None:
        self.client = client
        self.trial_id = trial_id
        self.worker_id = worker_id
        # the lease's token goes with every call (the service takes them only for that lease); none: not sent
        self._token_kw: dict[str, Any] = {"lease_token": lease_token} if lease_token is not None else {}
        self.heartbeat_s = heartbeat_s
        self.budget_s = min(heartbeat_s, 5.0)  # one call's retries
        self.wake = wake
        self.max_pending = max_pending
        self._cond = threading.Condition()
        self._pending: collections.deque[dict[str, Any]] = collections.deque()
        self._closing = False
        self._done = False
        self._away = False  # the last call did not reach the service
        self._retry_at = 0.0
        self._abort = threading.Event()  # ends the call in flight (close, while the service is away)
        self.sent = 0  # reports the service took
        self.dropped = 0  # reports dropped: the queue was full, or the service refused them
        self.peak_pending = 0
        self.heartbeats = 0
        self.prune: tuple[int, str] | None = None  # (step, reason): the service said prune
        self.stop: str | None = None  # the heartbeat said stop (why)
        self.conflict: str | None = None  # 409: the trial is no longer ours (the service's words)
        self._thread = threading.Thread(target=self._run, name=f"courier-{trial_id}", daemon=True)

    def start(self) -> Courier:
        self._thread.start()
        return self

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._pending)

    def decisions(self) -> tuple[tuple[int, str] | None, str | None, str | None]:
        """(prune, stop, conflict) as decided so far."""
        with self._cond:
            return self.prune, self.stop, self.conflict

    def post(self, report: dict[str, Any]) -> None:
        """Queue `report` for the service; never blocks."""
        with self._cond:
            if self._done or self.prune is not None:
                return  # pruned or no longer ours: reports are not wanted any more
            self._pending.append(report)
            while len(self._pending) > self.max_pending:
                self._pending.popleft()
                self.dropped += 1
            self.peak_pending = max(self.peak_pending, len(self._pending))
            self._cond.notify()

    def close(self, wait_s: float | None = None) -> None:
        """Stop: hand in the queued reports while the service answers, for up to `wait_s`
        (default COURIER_CLOSE_S); a call still retrying for a service that is away is
        abandoned at once."""
        wait_s = COURIER_CLOSE_S if wait_s is None else wait_s
        with self._cond:
            self._closing = True
            if self._away:
                self._abort.set()
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(wait_s)
        self._abort.set()
        with self._cond:
            self._done = True
            self.dropped += len(self._pending)
            self._pending.clear()

    def _next(self, next_heartbeat: float) -> tuple[str, dict[str, Any] | None]:
        """Wait for the next thing to send: ("heartbeat", None), ("report", r) or ("end", None)."""
        with self._cond:
            while True:
                if self._done:
                    return "end", None
                now = time.monotonic()
                if self._closing:
                    if self._pending and not self._away and self.prune is None:
                        return "report", self._pending.popleft()
                    return "end", None
                if now >= next_heartbeat:
                    return "heartbeat", None
                if self._pending and now >= self._retry_at:
                    return "report", self._pending.popleft()
                until = next_heartbeat if not self._pending else min(next_heartbeat, self._retry_at)
                self._cond.wait(max(0.0, until - now))

    def _run(self) -> None:
        next_heartbeat = time.monotonic() + self.heartbeat_s
        while True:
            what, report = self._next(next_heartbeat)
            if what == "end":
                return
            if what == "heartbeat":
                next_heartbeat = time.monotonic() + self.heartbeat_s
                self._heartbeat()
            else:
                assert report is not None
                self._report(report)

    def _decide(self, **decision: Any) -> None:
        with self._cond:
            for name, value in decision.items():
                if getattr(self, name) is None:
                    setattr(self, name, value)
            if self.stop is not None or self.conflict is not None:
                self._done = True
            self.dropped += len(self._pending)
            self._pending.clear()
        self.wake()

    def _unreachable(self, what: str, error: ServiceUnavailable) -> None:
        with self._cond:
            if not self._away:
                log.warning("%s for trial %d waits: %s (the probe goes on; reports are kept, at most %d)",
                            what, self.trial_id, error, self.max_pending)
            self._away = True
            self._retry_at = time.monotonic() + AWAY_PAUSE_S

    def _reached(self) -> None:
        with self._cond:
            if self._away:
                log.warning("the service takes trial %d's reports and heartbeats again", self.trial_id)
            self._away = False

    def _heartbeat(self) -> None:
        try:
            reply = self.client.heartbeat(self.trial_id, self.worker_id, retry_for_s=self.budget_s,
                                          interruptible=True, cancel=self._abort, **self._token_kw)
        except ServiceUnavailable as e:
            self._unreachable("the heartbeat", e)
            return
        except Conflict as e:
            self._decide(conflict=e.message)
            return
        except ApiError as e:
            log.warning("heartbeat for trial %d refused: %s", self.trial_id, e)
            return
        self._reached()
        self.heartbeats += 1
        if reply.action == "stop":
            self._decide(stop=reply.reason or "the service said stop")

    def _report(self, report: dict[str, Any]) -> None:
        metrics = {k: float(v) for k, v in report["metrics"].items() if isinstance(v, (int, float))}
        step = int(report["step"])
        try:
            reply = self.client.report(self.trial_id, self.worker_id, step, metrics, retry_for_s=self.budget_s,
                                       interruptible=True, cancel=self._abort, **self._token_kw)
        except ServiceUnavailable as e:
            with self._cond:  # back at the head of the queue, if the queue has room
                if not self._done and self.prune is None and len(self._pending) < self.max_pending:
                    self._pending.appendleft(report)
                else:
                    self.dropped += 1
            self._unreachable("a report", e)
            return
        except Conflict as e:
            self._decide(conflict=e.message)
            return
        except ApiError as e:
            log.warning("report for trial %d refused: %s", self.trial_id, e)
            with self._cond:
                self.dropped += 1
            return
        self._reached()
        with self._cond:
            self.sent += 1
        if reply.prune:
            self._decide(prune=(step, reply.reason or "pruned"))
