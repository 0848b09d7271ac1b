"""One leased trial, from the lease to its complete (`TrialRunner`): refuse, take the cores, start
the probe child and its courier, monitor the child, and hand the result to the deliveries.

refuse    a workload off the allow-list or not installed here: completed at once as failed
          (autotune.worker.allow).
probe     the child (autotune.worker.child) with a hard limit of the study's probe.timeout_s plus a
          small grace; a CPU worker's probe waits for its share of the cores first
          (autotune.worker.cpu_share), heartbeats keeping the lease meanwhile.
monitor   drains the child's stdout (its report lines and its result) and acts on the service's
          decisions (autotune.worker.courier): prune → SIGTERM the child: it stops at the next window
          and its result says stopped_early, or SIGKILL after a grace and a partial result is built
          from the reports; stop → kill the child, complete the trial as failed; 409 → the trial is no
          longer ours: the child is stopped, a result it gave anyway is kept in the spool. A child
          that dies without a result, hangs past the hard limit, or is interrupted becomes a failure
          record; the worker itself goes on."""

from __future__ import annotations

import queue
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from autotune.contract.results import TrialLease
from autotune.engine.distributed import JOB_DIR_ENV, collect_failure, prepare_job_dir
from autotune.engine.fork_server import ForkServer
from autotune.engine.probe_child import ChildJob
from autotune.worker.allow import refusal
from autotune.worker.child import ProbeProcess, kill_after
from autotune.worker.client import Client
from autotune.worker.courier import Courier
from autotune.worker.cpu_share import CoreShare, CpuShare, format_cores, omp_threads_cap
from autotune.worker.delivery import Deliveries
from autotune.worker.gpus import DeviceGroup
from autotune.worker.hardware import Hardware
from autotune.worker.options import WorkerOptions, child_environment, hard_timeout_grace_s
from autotune.worker.progress import format_params, progress_text
from autotune.worker.results import TrialRun, final_result, minimal_result

PRUNE_GRACE_S = 5.0  # a pruned child gets this long to stop at a window boundary and print its result
KILL_GRACE_S = 2.0  # SIGTERM → SIGKILL when the child's result is not wanted


class TrialRunner:
    """Runs the leased trials of one lease loop on its device group, one at a time (`run`).

    `interrupted` tells the signal the worker got (its name), if any; `current` is the probe
    child running now (a second signal kills it from outside)."""

    def __init__(self, options: WorkerOptions, hardware: Hardware, group: DeviceGroup, worker_id: str,
                 client: Client, console: Console, deliveries: Deliveries, interrupted: Callable[[], str | None],
                 fork_server: ForkServer | None = None, cpu_share: CpuShare | None = None) -> None:
        self.options = options
        self.hardware = hardware
        self.group = group
        self.worker_id = worker_id
        self.client = client
        self.console = console
        self.deliveries = deliveries
        self.interrupted = interrupted
        self.fork_server = fork_server  # where its probe children are forked from (None: started cold)
        self.cpu_share = cpu_share  # this worker's share of the host's cores (None: --threads, or not a CPU worker)
        self.allowed = options.allowed_workloads()
        self.shown_share: CoreShare | None = None  # the core share last said on the console
        self.current: ProbeProcess | None = None

    def run(self, lease: TrialLease, live: bool = True) -> TrialRun:
        """Run `lease`'s probe in a child, forward reports and heartbeats, then complete it
        (`live`: one status line on a terminal console, updated as the probe goes)."""
        run = TrialRun(lease, service_id=self.deliveries.service_id)
        baseline = " [cyan](baseline)[/]" if lease.is_baseline else \
            " [cyan](re-measure)[/]" if lease.role == "remeasure" else ""
        self.console.print(f"▶ trial {lease.number} of {lease.study} (id {lease.trial_id}){baseline}: "
                           f"{format_params(lease.params)}")
        refused = refusal(lease.workload, self.allowed)
        if refused is not None:  # the complete prints the refusal
            self._complete(run, minimal_result(lease, self.hardware, {"kind": "refused", "message": refused}))
            return run
        world = self.group.world_size
        share = self._take_cores(run) if self.cpu_share is not None and self.interrupted() is None else None
        threads = share.probe_threads(world, omp_threads_cap()) if share is not None else self.options.threads
        job = ChildJob(workload=lease.workload, preset=lease.preset, config=dict(lease.config),
                       device=self.hardware.device if world == 1 else ("cuda" if self.group.is_cuda else "cpu"),
                       probe=lease.probe, threads=threads, world_size=world)
        if self.interrupted() is None and run.dropped is None and run.stop_reason is None:
            tail = self._probe(run, job, share, threads, live)
        else:  # interrupted between lease and start (or while it waited for its cores), or stopped by the service then
            run.interrupted_by = self.interrupted()
            tail = ""
        if run.dropped:
            self.deliveries.keep_dropped(run, final_result(run, self.hardware, tail))
            return run
        self._complete(run, final_result(run, self.hardware, tail))
        return run

    def _complete(self, run: TrialRun, result: dict[str, Any]) -> None:
        self.deliveries.complete(run, result, interrupted=self.interrupted() is not None)

    def _probe(self, run: TrialRun, job: ChildJob, share: CoreShare | None, threads: int | None,
               live: bool) -> str:
        """Start the child (and, first, its courier), follow it to its end; its stderr tail."""
        lease, world = run.lease, self.group.world_size
        job_dir: Path | None = None
        # one probe: the threads go in its job (its environment stays the fork server's)
        env = child_environment(threads if world > 1 else self.options.threads)
        argv = self.options.child_argv
        if world > 1:
            job_dir = prepare_job_dir(job.to_json())
            env[JOB_DIR_ENV] = str(job_dir)
            if self.group.is_cuda:
                env["CUDA_VISIBLE_DEVICES"] = self.group.visible_devices()
            argv = self.options.launch_argv
        # the heartbeats start first: a worker's first probe waits for its fork server's preload
        # (seconds; minutes on a loaded host or a slow disk), and the lease must hold meanwhile
        events: queue.Queue[tuple[str, Any]] = queue.Queue()
        courier = Courier(self.client, lease.trial_id, self.worker_id, self.options.heartbeat_s,
                          wake=lambda: events.put(("wake", None)), lease_token=lease.lease_token)
        run.courier = courier.start()
        try:
            child = ProbeProcess(argv, job, env, job_dir=job_dir, server=self.fork_server, events=events,
                                 cpus=share.cpus if share is not None else None)
        except BaseException:
            courier.close()
            self._release_cores()
            raise
        self.current = child
        try:
            if self.console.is_terminal and live:
                with self.console.status("") as status:
                    self._monitor(run, child, courier, lambda text: status.update(text))
            else:
                self._monitor(run, child, courier, None)
        finally:
            run.returncode = child.finish()
            self._release_cores()
            self.current = None
            courier.close()
            if job_dir is not None:
                run.rank_failure = collect_failure(job_dir)
                shutil.rmtree(job_dir, ignore_errors=True)
        tail = child.stderr_tail()
        if courier.dropped:
            self.console.print(f"  trial {lease.number}: {courier.dropped} report(s) not delivered while the "
                               "service was away (the result holds every timed window)")
        return tail

    def _take_cores(self, run: TrialRun) -> CoreShare | None:
        """Wait until this worker's share of the host's cores is free (`CpuShare.acquire`) and hold
        it for the probe; while it waits, heartbeats keep the lease. None when a signal came, or the
        service said stop or not ours (noted on `run`) meanwhile. The probe's time limit starts
        once it has its cores."""
        assert self.cpu_share is not None
        lease = run.lease
        courier: Courier | None = None

        def waiting(share: CoreShare) -> None:
            nonlocal courier
            self.console.print(f"  trial {lease.number}: waiting for CPU{'s' if len(share.cpus) != 1 else ''} "
                               f"{format_cores(share.cpus)} (another CPU worker's probe on this host runs there)")
            courier = Courier(self.client, lease.trial_id, self.worker_id, self.options.heartbeat_s,
                              lease_token=lease.lease_token).start()

        def cut_short() -> bool:
            if self.interrupted() is not None:
                return True
            if courier is None:
                return False
            _, stop, conflict = courier.decisions()
            return stop is not None or conflict is not None

        try:
            share = self.cpu_share.acquire(stop=cut_short, on_wait=waiting)
        except OSError as e:  # the registry cannot be read or written: run this probe unpinned
            share = None
            self.console.print(f"  [yellow]trial {lease.number}: the CPU workers' registry "
                               f"{escape(str(self.cpu_share.root))} failed ({escape(str(e))}): this probe runs "
                               "on every core, at torch's default threads[/]")
        finally:
            if courier is not None:
                courier.close()
        if courier is not None:
            _, stop, conflict = courier.decisions()
            if conflict is not None:
                run.dropped = f"the service says the trial is no longer ours ({conflict})"
            elif stop is not None:
                run.stop_reason = stop
                self.console.print(f"  trial {lease.number}: the service said stop ({escape(stop)})")
        if share is not None and (run.dropped is not None or run.stop_reason is not None):
            self._release_cores()
            return None
        if share is not None:
            if share != self.shown_share:
                self.shown_share = share
                self.console.print(f"  cpu: now {share.describe(omp_threads_cap())} (CPU workers on this host "
                                   "started or stopped)")
            run.started = time.monotonic()
        return share

    def _release_cores(self) -> None:
        if self.cpu_share is not None:
            self.cpu_share.release()

    def _monitor(self, run: TrialRun, child: ProbeProcess, courier: Courier,
                 show: Callable[[str], None] | None) -> None:
        """Follow the child until it exits or must be stopped. Nothing here waits on the service
        (the courier does): the child's stdout is drained as fast as it comes."""
        lease = run.lease
        timeout = lease.probe.timeout_s
        hard_deadline = run.started + timeout + hard_timeout_grace_s(timeout)
        eof = False
        while True:
            signal_name = self.interrupted()
            if signal_name is not None:
                run.interrupted_by = signal_name
                child.stop(KILL_GRACE_S)
                return
            now = time.monotonic()
            if now >= hard_deadline:
                run.timed_out = True
                child.stop(KILL_GRACE_S)
                return
            if not self._act(run, child, courier):
                return
            if show is not None:  # a terminal: one live line
                last = run.reports[-1]["metrics"].get("throughput") if run.reports else None
                speed = f" · last window {last:,.1f} samples/s" if isinstance(last, (int, float)) else ""
                show(progress_text(lease, run.elapsed_s, run.progress) + speed)
            try:
                kind, payload = child.events.get(timeout=0.2)
            except queue.Empty:
                if child.poll() is not None and not eof:
                    # exited, but a grandchild may hold the pipe open: end the group so EOF comes
                    child.kill_group()
                continue
            if kind == "progress":
                phase = payload.get("phase")
                if show is None and phase != "window" and (run.progress or {}).get("phase") != phase:
                    # a log: one line per phase (a terminal's live line shows every window)
                    self.console.print(f"  {escape(progress_text(lease, run.elapsed_s, payload))}", highlight=False)
                run.progress = payload
            elif kind == "report":
                run.reports.append(payload)
                if run.prune_reason is None:
                    courier.post(payload)
            elif kind == "result":
                run.result = payload
                self.deliveries.write_ahead(run, final_result(run, self.hardware, ""))
            elif kind == "eof":
                eof = True
                run.child_ended = time.monotonic()
                run.returncode = child.finish()
                return

    def _act(self, run: TrialRun, child: ProbeProcess, courier: Courier) -> bool:
        """Carry out what the service decided (the courier's `decisions`); False when the child
        has been stopped for good (409: no longer ours; heartbeat: stop)."""
        prune, stop, conflict = courier.decisions()
        if conflict is not None:
            run.dropped = f"the service says the trial is no longer ours ({conflict})"
            child.stop(KILL_GRACE_S)
            return False
        if stop is not None:
            run.stop_reason = stop
            self.console.print(f"  trial {run.lease.number}: the service said stop ({escape(stop)})")
            child.stop(KILL_GRACE_S)
            return False
        if prune is not None and run.prune_reason is None:
            step, reason = prune
            run.prune_reason = reason
            self.console.print(f"  trial {run.lease.number}: pruned at step {step} ({escape(reason)})")
            # The child stops at its next window boundary and prints a stopped_early result;
            # a separate thread escalates to SIGKILL after the grace period.
            child.request_stop()
            threading.Thread(target=kill_after, args=(child, PRUNE_GRACE_S), daemon=True).start()
        return True
