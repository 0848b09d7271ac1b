"""The stale-lease reaper: a thread that runs `TuningService.reap_stale` every reaper_interval_s,
and the failure attrs of a lost trial (`lost_attrs`).

A lease silent for lease_grace_s (no heartbeat, no report) has its trial failed as Optuna FAIL,
failure_kind "lost", and ends: the zombie's late calls get 409. FAIL, because a silent worker says
nothing about the config (the samplers ignore it); the next lease re-runs the trial while
spec.max_retries allows (api/leasing.py).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol

from autotune.api.optuna_bridge import OptunaBridge, StudyContext
from autotune.api.study import TrialRecord, attempt_of

log = logging.getLogger(__name__)


def lost_attrs(bridge: OptunaBridge, ctx: StudyContext, trial: TrialRecord, why: str) -> dict[str, Any]:
    """The failure attrs of `trial`, lost because `why`: the message says whether it will be
    re-run, or that its attempts are used up (naming every attempt's trial number)."""
    attempt = attempt_of(trial)
    limit = ctx.spec.max_retries
    if attempt <= limit:
        message = f"{why}; it will be re-run as a new trial (attempt {attempt + 1} of {limit + 1})"
    else:
        back = bridge.user_attr_values(ctx.name, "retry_of")  # trial number -> the number it re-runs
        chain = [trial.number]
        while isinstance(previous := back.get(chain[-1]), int) and previous not in chain:
            chain.append(previous)
        numbers = ", ".join(f"#{n}" for n in reversed(chain))
        times = "once" if attempt == 1 else f"{attempt} times"
        message = (f"lost {times} (trials {numbers}; max_retries {limit}), not retried again: last time {why}. "
                   "Check the workers' logs (killed? out of host memory? network?) or raise max_retries")
    return {"failure_kind": "lost", "failure_message": message}


class Reapable(Protocol):
    def reap_stale(self) -> list[int]: ...


class Reaper:
    """A daemon thread calling `service.reap_stale()` (`TuningService.reap_stale`) every
    `interval_s` seconds until stopped."""

    def __init__(self, service: Reapable, interval_s: float) -> None:
        self._service = service
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="autotune-reaper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._service.reap_stale()
            except Exception:  # the reaper must outlive a bad sweep (e.g. the database restarting)
                log.exception("stale-lease sweep failed; retrying in %.0f s", self._interval_s)
