"""Handing results in: the spool's delivery rounds of the lease loop, the complete of a trial,
and what the worker says about each (`Deliveries`).

The result is written to the spool first (`autotune.worker.spool`), then POST /complete
(retried COMPLETE_RETRY_S, or $AUTOTUNE_WORKER_RETRY_S) if the service still shows the lease's
service id (else it waits in the spool for that service: `autotune.worker.spool.misplaced`); the
file is removed once the service has it. Not delivered, it stays in the spool and the lease loop
delivers it when the service answers. Only the folder of the service answering (and the top,
for an unknown service's) is read."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from autotune.contract.results import ANOTHER_LEASE, TrialLease
from autotune.worker.client import Client, ServiceUnavailable
from autotune.worker.options import service_retry_s
from autotune.worker.progress import summarize_result
from autotune.worker.results import TrialRun
from autotune.worker.spool import (
    Delivery,
    Services,
    Spool,
    SpoolEntry,
    deliver,
    deliver_entries,
    misplaced,
    service_identity,
    services_named,
    spool_command,
)

log = logging.getLogger(__name__)

# A last complete after SIGINT/SIGTERM retries this long, then the worker exits anyway (the
# result stays in the spool; the service's reaper fails the trial as "lost" later).
FINAL_COMPLETE_RETRY_S = 20.0
# A complete retries this long; then its result waits in the spool and the lease loop (which
# needs the service anyway) delivers it when the service answers. $AUTOTUNE_WORKER_RETRY_S
# overrides it (autotune.worker.options.service_retry_s).
COMPLETE_RETRY_S = 10.0
SPOOL_RETRY_S = 2.0  # one spooled result's delivery from the lease loop: short, the loop comes back
# A spooled result the service would not take yet (a 401, a trial it does not know) is offered again after this
SPOOL_RECHECK_S = 60.0


class Deliveries:
    """One lease loop's side of the spool: which service answers (`service_id`), the delivery
    rounds, the complete of each trial, and the lines the worker says about them."""

    def __init__(self, spool: Spool, client: Client, console: Console, worker_id: str,
                 stop_event: threading.Event) -> None:
        self.spool = spool
        self.client = client
        self.console = console
        self.worker_id = worker_id
        self.stop_event = stop_event  # the worker's: set by a signal (a wait for the service ends with it)
        self.service_id: str | None = None  # the service's id as of the last lease (GET /v1/health; None: unknown)
        self._spool_later: dict[Path, float] = {}  # spooled results the service would not take yet → when to retry
        self._spool_said: set[tuple[Path, str]] = set()  # (file, why) kept-notices said once
        self._later_for: str | None = None  # the service id that `_spool_later` was decided by
        self._elsewhere_for: str | None = None  # the service id other services' results were last counted for

    def offer_again(self) -> None:
        """Offer every spooled result at the next round (the service was away: maybe another one answers now)."""
        self._spool_later.clear()

    def learn_service_id(self, lease: TrialLease | None = None) -> str | None:
        """Keep the id of the service that made `lease` (the lease names it: `TrialLease.service_id`),
        else ask the service for its id (GET /v1/health: an older service's lease names none);
        None (unknown: its results are matched by URL, study and lease token) when the service
        shows none or does not answer now. Never the id of before: a restart may have changed it."""
        if lease is not None and lease.service_id:
            self.service_id = lease.service_id
            return self.service_id
        try:
            self.service_id = service_identity(self.client, SPOOL_RETRY_S)
        except ServiceUnavailable as e:
            log.warning("could not ask the service for its id (%s): this trial's result is matched by URL", e)
            self.service_id = None
        return self.service_id

    def _services(self, service_id: str | None) -> Services:
        """The spool folders this worker reads for a service that shows `service_id`: that
        service's and the top (an unknown service's, and an older worker's); all where the id is
        unknown (matched by URL)."""
        return None if service_id is None else (service_id, None)

    def deliver_spool(self, retry_for_s: float | None = SPOOL_RETRY_S) -> bool:
        """Hand in the spooled results of this service, oldest first (`autotune.worker.spool.deliver_entries`),
        each only if it belongs here: the service shows the entry's service id, and its study
        holds the trial (`autotune.worker.spool.misplaced`). Only this service's folder of the spool
        (and its top) is read; the results of other services leased at this URL (the service
        restarted on another database) are counted in one line, once per service answering.
        False when the service could not be reached (the rest wait for the next round). A
        result the service would not take yet (401, a trial it does not know, another
        service's) is offered again after SPOOL_RECHECK_S; a 401 ends the round (no other
        delivery would fare better)."""
        pending = self.spool.pending(self.client.base_url, self._services(self.service_id))
        if not pending and self.service_id == self._elsewhere_for:
            return True
        try:
            current = service_identity(self.client, retry_for_s)
        except ServiceUnavailable:
            return False
        if current != self._later_for:  # another service answers now: what the last one would not take may go in
            self._spool_later.clear()
            self._later_for = current
        if current != self._elsewhere_for:
            self._elsewhere_for = current
            self._say_elsewhere(current)
        if current != self.service_id:
            pending = self.spool.pending(self.client.base_url, self._services(current))
        now = time.monotonic()
        entries = [e for e in pending if e.path is None or self._spool_later.get(e.path, 0.0) <= now]
        for entry, outcome in deliver_entries(self.spool, self.client, entries, current, retry_for_s):
            self._say_delivery(entry, outcome, spooled=True)
            if outcome.status == "unreachable":
                return False
            if outcome.status == "kept" and entry.path is not None:
                self._spool_later[entry.path] = now + SPOOL_RECHECK_S
                if outcome.unauthorized:
                    break
        return True

    def _say_elsewhere(self, current: str | None) -> None:
        """One line on the results in the spool that were leased at this URL from another service
        than `current` (its folder is not read by the delivery rounds): they wait for it."""
        if current is None:
            return
        elsewhere = [e for e in self.spool.pending(self.client.base_url) if e.service_id not in (None, current)
                     and e.path is not None and e.path.parent != self.spool.root]  # the top's are said one by one
        if elsewhere:
            self.console.print(f"  [yellow]{len(elsewhere)} spooled result(s) of {escape(services_named(elsewhere))} "
                               f"wait for that service[/]: the service at {escape(self.client.base_url)} is service "
                               f"{escape(current)} now (another database); they are delivered when theirs answers "
                               f"there again: {escape(spool_command(self.spool.root))}")

    def deliver_instead(self, lease: TrialLease) -> bool:
        """True when `lease` is a trial this worker must not run: its result is in the spool (the
        service handed back the lease it still holds; the result is delivered instead), or was
        just delivered from the spool (the lease came back before the delivery ended it). A
        spooled result of the same trial id in another study or service is another trial's, and
        so is one of another lease (its lease token is not this lease's: a backup of the database
        holds the same service id, study and trial number): this lease is run, and the kept
        result waits for the service it was leased from."""
        label = f"trial {lease.number} of {lease.study} (id {lease.trial_id})"
        if self.spool.settled(self.client.base_url, self.worker_id, lease.trial_id, lease.study, lease.number,
                              self.service_id, lease_token=lease.lease_token):
            self.console.print(f"  {escape(label)}: its result was delivered from the spool just now: "
                               "not run again (a lease of it handed out before the delivery)")
            self.stop_event.wait(1.0)  # the service ends the lease with the delivery; should it not, ask later
            return True
        entry = next((e for e in self.spool.pending(self.client.base_url, self._services(self.service_id))
                      if e.worker_id == self.worker_id and
                      e.is_lease(lease.trial_id, lease.study, lease.number, self.service_id, lease.lease_token)),
                     None)
        if entry is None:
            return False
        self.console.print(f"  {escape(entry.label)}: measured already, its result is in the spool: delivering it "
                           "instead of running the trial again")
        with self.spool.claim(entry) as mine:
            if mine:
                self._say_delivery(entry, deliver(self.spool, self.client, entry, service_retry_s(COMPLETE_RETRY_S),
                                                  interruptible=True), spooled=True)
        if entry.path is not None and entry.path.exists():
            self.stop_event.wait(1.0)  # still not taken: the loop tries again, without running it
        return True

    def _say_delivery(self, entry: SpoolEntry, outcome: Delivery, spooled: bool) -> None:
        """One line on what became of a result (`spooled`: an earlier result from the spool)."""
        what = f"spooled result of {entry.label}" if spooled else f"trial {entry.number}"
        where = escape(str(outcome.path)) if outcome.path is not None else "memory only: the spool could not be written"
        if outcome.status == "delivered":
            assert outcome.info is not None
            info = outcome.info
            feasible = {True: " · feasible", False: " · infeasible", None: ""}[info.feasible] \
                if info.state == "COMPLETE" else ""
            prefix = f"  {what} delivered" if spooled else f"  trial {entry.number}"
            self.console.print(f"{prefix} → {info.state}{feasible}")
        elif outcome.status == "already":
            self.console.print(f"  {what}: {escape(outcome.message)}; nothing more to deliver")
        elif outcome.status == "rejected" and outcome.path is None and not entry.measured:
            self.console.print(f"  {what}: not ours any more, dropped ({escape(outcome.message)})")
        elif outcome.status == "rejected":
            self.console.print(f"  [red]{what} not taken by the service[/]: {escape(outcome.message)}. The "
                               f"measurement is kept in {where}")
        elif outcome.status == "unreachable":
            if not spooled:
                self.console.print(f"  [yellow]{what}: the service did not answer[/] ({escape(outcome.message)}); "
                                   f"the result is kept in {where} and delivered when the service at "
                                   f"{escape(self.client.base_url)} answers again")
        else:  # kept
            key = (outcome.path or Path(), outcome.message)
            if key not in self._spool_said:
                self._spool_said.add(key)
                self.console.print(f"  [red]{what}: not delivered[/]: {escape(outcome.message)}. The result is kept "
                                   f"in {where}; it is offered again every {SPOOL_RECHECK_S:.0f} s")

    def say_spool_left(self) -> None:
        """Before exiting: what the spool still holds, and where."""
        pending = self.spool.pending(self.client.base_url)
        if pending:
            self.console.print(f"[yellow]{len(pending)} result(s) not delivered[/], kept in "
                               f"{escape(str(self.spool.root))} ({escape(', '.join(e.label for e in pending[:5]))}"
                               f"{', …' if len(pending) > 5 else ''}): a worker started with --spool-dir "
                               f"{escape(str(self.spool.root))} delivers them when the service at "
                               f"{escape(self.client.base_url)} answers ({escape(spool_command(self.spool.root))})")

    # --- one trial ------------------------------------------------------------------------------

    def entry(self, run: TrialRun, result: dict[str, Any]) -> SpoolEntry:
        """`run`'s result as a spool entry (its file, if written ahead already)."""
        lease = run.lease
        entry = SpoolEntry(api=self.client.base_url, trial_id=lease.trial_id, worker_id=self.worker_id,
                           study=lease.study, number=lease.number, result=result, service_id=run.service_id,
                           lease_token=lease.lease_token)
        if self.spool.path_of(entry).exists():
            entry.path = self.spool.path_of(entry)  # written ahead (`write_ahead`)
        return entry

    def write_ahead(self, run: TrialRun, result: dict[str, Any]) -> None:
        """Spool the child's result the moment it arrives: the worker may die (SIGKILL, OOM)
        before it completes the trial; the next worker on this spool then delivers it. The
        complete that follows rewrites the same file with the final result."""
        try:
            self.spool.put(self.entry(run, result))
        except OSError as e:
            log.warning("could not write trial %d's result to the spool %s: %s", run.lease.trial_id,
                        self.spool.root, e)

    def complete(self, run: TrialRun, result: dict[str, Any], interrupted: bool = False) -> None:
        """Spool the result (write-ahead), then hand it in if the service is still the one that
        leased the trial (its id: a restart on another database during the probe goes unseen
        while the calls' retries last); the spool file goes once the service has it. After a
        signal (`interrupted`) the complete retries FINAL_COMPLETE_RETRY_S, uninterruptibly."""
        lease = run.lease
        retry = FINAL_COMPLETE_RETRY_S if interrupted else service_retry_s(COMPLETE_RETRY_S)
        self.console.print(f"  trial {lease.number} ({run.elapsed_s:.1f} s): {summarize_result(result)}")
        for note in result.get("measurement_notes") or ():
            self.console.print(f"  [yellow]trial {lease.number}: {escape(str(note))}[/]")
        entry = self.entry(run, result)
        try:
            self.spool.put(entry)
        except OSError as e:
            self.console.print(f"  [yellow]trial {lease.number}: could not write the spool "
                               f"{escape(str(self.spool.root))} ({escape(str(e))})[/]: the result is only in "
                               "memory until the service takes it; point --spool-dir at a writable directory")
        interruptible = not interrupted
        outcome: Delivery | None = None
        if entry.service_id is not None:
            try:
                outcome = misplaced(self.client, entry, service_identity(self.client, retry, interruptible), retry)
            except ServiceUnavailable as e:
                outcome = Delivery("unreachable", str(e), path=entry.path)
        outcome = outcome or deliver(self.spool, self.client, entry, retry, interruptible=interruptible)
        self._say_delivery(entry, outcome, spooled=False)

    def keep_dropped(self, run: TrialRun, result: dict[str, Any]) -> None:
        """A trial that is no longer ours (`run.dropped`): no complete. A measurement the child
        finished anyway is never thrown away: it waits in the spool for the service that leased it
        when this one does not know the trial or holds another lease of it (another database:
        `autotune.worker.spool.misplaced`), else it goes to rejected/; a failure record written
        ahead (it measured nothing) is removed."""
        lease = run.lease
        assert run.dropped is not None
        self.console.print(f"  trial {lease.number}: dropped: {escape(run.dropped)}")
        entry = self.entry(run, result)
        if run.result is not None and entry.measured:
            foreign = "not leased by this service" in run.dropped or ANOTHER_LEASE in run.dropped
            try:
                where = str(self.spool.put(entry) if foreign else self.spool.reject(entry, run.dropped))
            except OSError as e:
                where = f"nowhere (the spool could not be written: {e})"
            self.console.print(f"  trial {lease.number}: its result is kept in {escape(where)}"
                               + (f", for {escape(entry.home)}" if foreign else ""))
        else:
            self.spool.remove(entry)
