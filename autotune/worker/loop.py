"""The worker: lease a trial, run its probe in a child process, report, complete; repeat.

One worker serves one device, or several GPU groups (autotune.worker.gpus), each with its own
lease loop (a thread; worker id suffixed with the group) and its own trials. The worker leases
only studies whose ``gpus_per_trial`` equals its own. The loop of one group (`Worker.run`):

spool     first, results not yet delivered are handed in, at the worker's start and around every
          lease (autotune.worker.delivery, autotune.worker.spool).
lease     POST /v1/trials/lease with the worker's hardware class, its allow-list and the study, if
          given. 204: nothing to do: wait with backoff (capped at IDLE_BACKOFF_CAP_S); exit after
          `idle_exit_s`. Unreachable (connection refused, timeouts, 5xx): retried in slices of
          LEASE_RETRY_S (or $AUTOTUNE_WORKER_RETRY_S: `service_retry_s`), the time counting toward
          `idle_exit_s`; a worker that gives up so exits with UNREACHABLE_EXIT. A lease whose
          result lies in the spool (the same lease token), or was just delivered from it, is not
          run again: the spooled result is delivered.
          While idle it names, once per distinct set, the running studies it cannot take and why
          (autotune.worker.allow).
trial     refuse, probe, monitor, complete (autotune.worker.trial).

Resilience: every call retries connection errors and 5xx, so a worker outlives a service restart,
and no result is lost meanwhile: it waits in the spool, also across a kill of the worker.
SIGINT/SIGTERM: the running child is killed, its trial completed as failed, kind "interrupted"
(the service re-runs it on another worker: a preemption says nothing about the config), and the
worker exits 128 + signal."""

from __future__ import annotations

import contextlib
import logging
import re
import signal
import threading
import time
from types import FrameType

from rich.console import Console
from rich.markup import escape

from autotune.contract.protocol import NAME_PATTERN
from autotune.contract.registry import export_workload_paths, registered_workloads
from autotune.contract.results import LeaseRequest, TrialLease
from autotune.engine.fork_server import ForkServer
from autotune.worker.allow import SkipNotice, skipped_studies
from autotune.worker.child import ProbeProcess
from autotune.worker.client import Client, Conflict, Invalid, NotFound, ServiceUnavailable, Unauthorized
from autotune.worker.cpu_share import CpuShare, claim_cpu_share, omp_threads_cap
from autotune.worker.delivery import Deliveries
from autotune.worker.detect import detect_hardware, start_fork_server
from autotune.worker.gpus import DeviceGroup, plan_groups
from autotune.worker.hardware import Hardware, surely_no_gpu
from autotune.worker.options import WorkerOptions, default_worker_id, service_retry_s
from autotune.worker.results import TrialRun
from autotune.worker.spool import Spool, default_spool_dir, services_named, spool_command, unauthorized_hint
from autotune.worker.trial import TrialRunner

log = logging.getLogger(__name__)

IDLE_BACKOFF_START_S = 0.5
IDLE_BACKOFF_CAP_S = 5.0
# One lease call retries this long; the loop calls again (counting --idle-exit meanwhile).
# $AUTOTUNE_WORKER_RETRY_S overrides it (autotune.worker.options.service_retry_s).
LEASE_RETRY_S = 10.0
UNREACHABLE_EXIT = 3  # --idle-exit ran out while the service could not be reached
# An idle worker rereads the studies this often to name the running ones it cannot take.
SKIPPED_RECHECK_S = 60.0
SKIPPED_LIST_RETRY_S = 2.0  # the listing is a hint: a service that does not answer soon is not waited for


class Worker:
    """The lease → probe → complete loop of one device group (see the module docstring): the
    lease loop and the signals here; the spool and the complete in `deliveries`, one trial's run
    in `trials`."""

    def __init__(self, options: WorkerOptions, hardware: Hardware, client: Client | None = None,
                 console: Console | None = None, group: DeviceGroup | None = None,
                 worker_id_suffix: str | None = None, fork_server: ForkServer | None = None,
                 cpu_share: CpuShare | None = None) -> None:
        self.options = options
        self.cpu_share = cpu_share  # this worker's share of the host's cores (`claim_cpu_share`; None: --threads)
        self.hardware = hardware
        self.group = group or DeviceGroup((hardware.device,) * options.gpus_per_trial)
        base = options.worker_id or default_worker_id(hardware.device if self.group.world_size == 1
                                                      else self.group.name)
        self.worker_id = f"{base}-{worker_id_suffix}" if worker_id_suffix else base
        self.show_status = True  # a live status line (off when several groups share the console)
        self.stop_event = threading.Event()
        self.client = client or Client(options.api, options.token, retry_for_s=None, cancel=self.stop_event)
        self._console = console or Console(soft_wrap=True, highlight=False, emoji=False)
        self.spool = Spool(options.spool_dir or default_spool_dir())
        self.signal_name: str | None = None
        self.signal_number: int | None = None
        self.allowed = options.allowed_workloads()
        export_workload_paths(options.workload_paths())  # the children resolve NAME=module:attr entries
        self.trials_done = 0
        self.skip_notice = SkipNotice()  # shared by the loops of one process (run_worker)
        self.deliveries = Deliveries(self.spool, self.client, self._console, self.worker_id, self.stop_event)
        self.trials = TrialRunner(options, hardware, self.group, self.worker_id, self.client, self._console,
                                  self.deliveries, lambda: self.signal_name, fork_server, cpu_share)

    @property
    def console(self) -> Console:
        return self._console

    @console.setter
    def console(self, console: Console) -> None:
        """Say everything on `console` from now on (the deliveries and the trials too)."""
        self._console = self.deliveries.console = self.trials.console = console

    @property
    def current(self) -> ProbeProcess | None:
        """The probe child running now, if any."""
        return self.trials.current

    # --- signals --------------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self.signal_name is not None:  # a second signal: stop waiting for anything
            raise KeyboardInterrupt
        self.signal_number = signum
        self.signal_name = signal.Signals(signum).name
        self.stop_event.set()

    # --- the loop -------------------------------------------------------------------------------

    def announce(self) -> None:
        hw = self.hardware
        if hw.device.startswith("cuda"):
            mem = f", {hw.memory_bytes / 2**30:.1f} GiB" if hw.memory_bytes else ""
            device = f"GPU {hw.device_name}{mem} ({hw.device})"
        else:
            device = hw.device_name
        if self.group.world_size > 1:
            kind = "GPUs" if self.group.is_cuda else "gloo processes on the cpu"
            device = f"{device} · {self.group.world_size} {kind} per trial ({self.group.name})"
        self.console.print(f"[bold]autotune worker[/] {self.worker_id}")
        self.console.print(f"  device   {device}")
        cpu = f" · {escape(hw.cpu_model)}, {hw.cpu_count} cores" if hw.cpu_model else ""  # host-bound configs follow it
        self.console.print(f"  hardware class [bold]{hw.hardware_class}[/] · torch {hw.torch_version} · "
                           f"host {hw.hostname}{cpu}")
        threads = self.options.threads or ("core share" if self.cpu_share is not None else "torch default")
        self.console.print(f"  service  {self.client.base_url} · study {self.options.study or 'any'} · "
                           f"threads {threads} · heartbeat {self.options.heartbeat_s:g} s")
        if self.cpu_share is not None:
            try:
                self.trials.shown_share = share = self.cpu_share.current()
            except OSError as e:  # said; each probe tries the registry again
                self.console.print(f"  [yellow]cpu: the CPU workers' registry {escape(str(self.cpu_share.root))} "
                                   f"failed ({escape(str(e))})[/]")
            else:
                self.console.print(f"  cpu: {share.describe(omp_threads_cap())} · the CPU workers of this host "
                                   f"split its cores, again before each probe (registry "
                                   f"{escape(str(self.cpu_share.root))}; --threads N: no share)")
        missing = [name for name in self.allowed if name not in registered_workloads()]
        note = f" [yellow](not installed here: {escape(', '.join(missing))}; their trials are refused)[/]" \
            if missing else ""
        self.console.print(f"  workloads {escape(', '.join(self.allowed) or 'none')} (--allow-workload){note}")
        self.console.print(f"  spool    {escape(str(self.spool.root))} (results not yet delivered; --spool-dir)")
        pending = self.spool.pending()
        mine = [e for e in pending if e.api == self.client.base_url]
        if mine:
            self.console.print(f"  [yellow]{len(mine)} undelivered result(s) for this service in the spool[/] "
                               f"({escape(', '.join(e.label for e in mine[:5]))}{', …' if len(mine) > 5 else ''}): "
                               "delivering them before any new trial")
        others = [e for e in pending if e.api != self.client.base_url]
        if others:  # one line: which services, and the command that shows them
            names = escape(services_named(others))
            self.console.print(f"  {len(others)} spooled result(s) for other services ({names}) are left for workers "
                               f"with that --api: {escape(spool_command(self.spool.root))}")

    def run(self) -> int:
        """Serve trials until told to stop; the exit status (128 + signal when interrupted,
        UNREACHABLE_EXIT when --idle-exit ran out without a reachable service)."""
        self.announce()
        idle_since: float | None = None
        unreachable_since: float | None = None  # when the lease calls started failing
        delay = IDLE_BACKOFF_START_S
        waiting_shown = False
        skips_checked: float | None = None  # when the running studies were last read (None: this idle spell: not yet)
        request = LeaseRequest(worker_id=self.worker_id, hardware=self.hardware.hardware_class,
                               study=self.options.study, workloads=list(self.allowed),
                               gpus_per_trial=self.group.world_size)
        try:
            while not self.stop_event.is_set():
                if self.options.max_trials is not None and self.trials_done >= self.options.max_trials:
                    # the last results first: wait for the service as long as --idle-exit allows (default: until
                    # it answers or a signal comes), as a worker's complete always did
                    self.deliveries.deliver_spool(retry_for_s=self.options.idle_exit_s)
                    self.console.print(f"done: {self.trials_done} trial(s) (--max-trials)")
                    self.deliveries.say_spool_left()
                    return 0
                if unreachable_since is None:  # a service that does not answer is not asked twice per round
                    self.deliveries.deliver_spool()
                budget = service_retry_s(LEASE_RETRY_S)
                if self.options.idle_exit_s is not None:
                    idle = 0.0 if idle_since is None else time.monotonic() - idle_since
                    budget = min(budget, max(0.5, self.options.idle_exit_s - idle))
                asked = time.monotonic()
                try:
                    lease = self.client.lease(request, retry_for_s=budget, interruptible=True)
                except ServiceUnavailable as e:
                    if self.stop_event.is_set():
                        break  # interrupted while the service was away
                    now = time.monotonic()
                    if unreachable_since is None:  # once an outage: what the worker does until it is over
                        self.console.print(f"the service at {escape(self.client.base_url)} does not answer "
                                           f"({escape(e.cause)}): asking again until it does; results wait in the "
                                           "spool")
                    unreachable_since = unreachable_since or asked
                    idle_since = idle_since or asked
                    if self.options.idle_exit_s is not None and now - idle_since >= self.options.idle_exit_s:
                        self.console.print(
                            f"[bold red]error:[/] could not reach the autotune service at "
                            f"{escape(self.client.base_url)} for {now - unreachable_since:.0f} s "
                            f"({escape(e.cause)}); --idle-exit {self.options.idle_exit_s:g} s ran out: exiting "
                            f"after {self.trials_done} trial(s). Check that the service runs (autotune serve) "
                            "and that --api names its address")
                        self.deliveries.say_spool_left()
                        return UNREACHABLE_EXIT
                    continue  # the lease call waited (its backoff) already
                except Conflict as e:  # the service refused a second lease for this worker: ask again
                    log.warning("lease refused: %s", e.message)
                    self.stop_event.wait(1.0)
                    continue
                except (NotFound, Unauthorized, Invalid) as e:
                    message = unauthorized_hint(self.client.base_url, f"HTTP {e.status_code}: {e.message}") \
                        if isinstance(e, Unauthorized) else e.message
                    self.console.print(f"[bold red]error:[/] the service refused the lease: {escape(message)}")
                    self.deliveries.say_spool_left()
                    return 2 if isinstance(e, Invalid) else 1
                if lease is not None:
                    self.deliveries.learn_service_id(lease)
                if unreachable_since is not None:
                    self.console.print(f"the service at {escape(self.client.base_url)} answers again (away "
                                       f"{time.monotonic() - unreachable_since:.0f} s)")
                    unreachable_since = None
                    self.deliveries.offer_again()  # maybe another service (database) now: offer everything again
                    self.deliveries.deliver_spool()
                if lease is not None and self.deliveries.deliver_instead(lease):
                    continue  # measured already: its spooled result went in (or waits for the service)
                if lease is None:
                    now = time.monotonic()
                    if idle_since is None:
                        idle_since = now
                    if not waiting_shown:
                        self.console.print("waiting for trials…")
                        waiting_shown = True
                    if skips_checked is None or now - skips_checked >= SKIPPED_RECHECK_S:
                        skips_checked = now
                        self.show_skipped_studies()
                    idle = now - idle_since
                    if self.options.idle_exit_s is not None and idle >= self.options.idle_exit_s:
                        self.console.print(f"idle for {idle:.0f} s: exiting after {self.trials_done} trial(s)")
                        self.deliveries.say_spool_left()
                        return 0
                    wait = delay
                    if self.options.idle_exit_s is not None:
                        wait = min(wait, max(0.05, self.options.idle_exit_s - idle))
                    self.stop_event.wait(wait)
                    delay = min(delay * 2, IDLE_BACKOFF_CAP_S)
                    continue
                idle_since, delay, waiting_shown, skips_checked = None, IDLE_BACKOFF_START_S, False, None
                self.run_trial(lease)
                self.trials_done += 1
        except KeyboardInterrupt:
            if self.current is not None:
                self.current.finish()
        if self.signal_number is not None:
            self.console.print(f"stopped by {self.signal_name} after {self.trials_done} trial(s)")
            self.deliveries.say_spool_left()
            return 128 + self.signal_number
        return 0

    def show_skipped_studies(self) -> None:
        """Say which running studies the service will not offer this worker, and why; each
        distinct set once (`SkipNotice`). A hint only: when the studies cannot be read (the
        service is away, an older service, a test's fake client), it says nothing."""
        try:
            path = "/v1/studies" if self.options.study is None else f"/v1/studies/{self.options.study}"
            reply = self.client.request("GET", path, retry_for_s=SKIPPED_LIST_RETRY_S).json()
            studies = reply.get("data") if self.options.study is None else [reply]
        except Exception as e:  # a hint must never stop the worker
            log.debug("could not read the studies for the idle hint: %s", e)
            return
        skipped = skipped_studies(studies, self.hardware.hardware_class, self.allowed, self.group.world_size,
                                  self.options.study)
        if not self.skip_notice.fresh(skipped):
            return
        count = f"{len(skipped)} running stud{'y' if len(skipped) == 1 else 'ies'}"
        self.console.print(f"[yellow]{count} this worker cannot take[/] (its hardware class "
                           f"{escape(repr(self.hardware.hardware_class))}, gpus_per_trial {self.group.world_size}):")
        for s in skipped:
            self.console.print(f"  {escape(s.name)} (hardware {escape(repr(s.hardware))}): {escape(s.reason)}")

    # --- what the lease loop hands on -----------------------------------------------------------

    def run_trial(self, lease: TrialLease) -> TrialRun:
        """Run `lease`'s probe in a child, forward reports and heartbeats, then complete it."""
        return self.trials.run(lease, live=self.show_status)

    def learn_service_id(self, lease: TrialLease | None = None) -> str | None:
        """The id of the service that made `lease` (`Deliveries.learn_service_id`)."""
        return self.deliveries.learn_service_id(lease)

    def _deliver_instead(self, lease: TrialLease) -> bool:
        """True when `lease` must not run: its result is (or was just) delivered from the spool."""
        return self.deliveries.deliver_instead(lease)


def run_worker(options: WorkerOptions, console: Console | None = None) -> int:
    """Detect the hardware, install the signal handlers and serve trials (the `autotune worker` verb).

    One lease loop per device group (`plan_groups`): with one group it runs on the main thread;
    with several, each runs on its own thread (worker id suffixed with its group), the main
    thread forwarding SIGINT/SIGTERM to all of them. Each loop counts its own --max-trials and
    --idle-exit. Exit status: the first non-zero loop status, else 0. Raises ValueError when a
    device cannot be used, the devices do not split into groups, $AUTOTUNE_WORKER_RETRY_S is
    not a number of seconds, --study is not a study name or the spool cannot be written."""
    service_retry_s(LEASE_RETRY_S)  # a bad value is refused before anything starts
    if options.study is not None and not re.match(NAME_PATTERN, options.study):
        raise ValueError(f"--study {options.study!r}: not a study name (a letter or digit, then letters, digits, "
                         "'_', '.' or '-', at most 64); `autotune status` lists the studies")
    Spool(options.spool_dir or default_spool_dir()).check_writable()
    groups = plan_groups(options.device, options.gpus_per_trial)
    if groups[0].is_cuda and surely_no_gpu():  # said before a fork server imports torch to find out
        raise ValueError(f"--device {options.device}: CUDA is not available on this host; use --device cpu")
    cpu_share = claim_cpu_share(options)  # --device cpu without --threads: this worker's share of the host's cores
    server = start_fork_server(options)  # from the main thread, which lives as long as the worker
    try:
        if len(groups) == 1:
            group = groups[0]
            hardware = detect_hardware(group.devices[0], server)
            worker = Worker(options, hardware, console=console, group=group, fork_server=server, cpu_share=cpu_share)
            worker.install_signal_handlers()
            try:
                return worker.run()
            finally:
                worker.client.close()
        console = console or Console(soft_wrap=True, highlight=False, emoji=False)
        workers = []
        notice = SkipNotice()  # the loops see the same studies: say which they cannot take once, not once per loop
        for group in groups:
            worker = Worker(options, detect_hardware(group.devices[0], server), console=console, group=group,
                            worker_id_suffix=group.name if options.worker_id else None, fork_server=server)
            worker.show_status = False
            worker.skip_notice = notice
            workers.append(worker)
        return _run_loops(workers)
    finally:
        if server is not None:
            server.close()
        if cpu_share is not None:
            cpu_share.close()


def _run_loops(workers: list[Worker]) -> int:
    """Run several lease loops on threads until they all return; signals reach every loop.
    The probe children are started from the loops' threads, which live until their loop
    ends (a child's PR_SET_PDEATHSIG fires when the thread that started it exits)."""
    codes: dict[int, int] = {}

    def on_signal(signum: int, frame: FrameType | None) -> None:
        second = any(w.signal_name is not None for w in workers)
        for w in workers:
            with contextlib.suppress(KeyboardInterrupt):  # Worker's own "second signal" reaction
                w._on_signal(signum, frame)
        if second:
            raise KeyboardInterrupt  # the main thread kills every running probe (below)

    def serve(index: int, worker: Worker) -> None:
        try:
            codes[index] = worker.run()
        finally:
            worker.client.close()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)
    threads = [threading.Thread(target=serve, args=(i, w), name=f"worker-{w.group.name}", daemon=True)
               for i, w in enumerate(workers)]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(timeout=0.5)  # short joins: the main thread keeps handling signals
    except KeyboardInterrupt:  # a second signal: stop waiting, kill every running probe
        for w in workers:
            if w.current is not None:
                w.current.finish()
        return 128 + (workers[0].signal_number or signal.SIGINT)
    nonzero = [codes.get(i, 1) for i in range(len(workers)) if codes.get(i, 1) != 0]
    return nonzero[0] if nonzero else 0
