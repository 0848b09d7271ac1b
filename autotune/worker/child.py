"""The probe child as the worker sees it (`ProbeProcess`): started in its own process group,
its stdout protocol lines read on a thread, its stderr kept as a tail, and killed as a group.

One probe is `python -m autotune.engine.probe_child` (see probe_child.py for the stdin/stdout
protocol), forked from the worker's fork server when it runs exactly what the server serves
(`autotune.engine.fork_server`), else started cold. A group of N > 1 devices runs
`python -m autotune.engine.distributed` instead: a launcher that imports torch once and forks N
ranks, with the job in a job directory (a stop request is its stop file; a kill ends the
launcher's group and every rank's)."""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import queue
import signal
import subprocess
import threading
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import IO, Any

from autotune.engine.distributed import kill_ranks, request_stop
from autotune.engine.fork_server import ForkedChild, ForkServer, ForkServerError, without_secrets
from autotune.engine.probe_child import ChildJob
from autotune.worker.cpu_share import pin_process

log = logging.getLogger(__name__)

STDERR_TAIL_CHARS = 1500


class ProbeProcess:
    """One running probe child: its stdout protocol lines arrive on `events`, its stderr
    is kept as a tail. The child leads its own process group; `kill` ends the whole group
    (DataLoader workers, compile workers), so no orphans remain.

    With a `job_dir` the child is a distributed launcher (`autotune.engine.distributed`): the job
    is in the directory (not on stdin), a stop request is its stop file, and a kill also ends
    the process group of every rank (each rank leads its own session)."""

    def __init__(self, argv: list[str], job: ChildJob, env: Mapping[str, str], job_dir: Path | None = None,
                 server: ForkServer | None = None, events: queue.Queue[tuple[str, Any]] | None = None,
                 cpus: Collection[int] | None = None) -> None:
        self.events: queue.Queue[tuple[str, Any]] = events if events is not None else queue.Queue()
        self._stderr: collections.deque[str] = collections.deque(maxlen=200)
        self.job_dir = job_dir
        self.proc = self._start(argv, env, server)
        if cpus:  # before the job is written: the child waits for it, and its torch threads come later
            pin_process(self.proc.pid, cpus)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        if job_dir is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write(job.to_json().encode())  # small: fits the pipe buffer, never blocks
                self.proc.stdin.close()
            except BrokenPipeError:
                pass  # the child died at once; its exit status tells why
        self._out = threading.Thread(target=self._read_stdout, args=(self.proc.stdout,), daemon=True,
                                     name=f"probe-{self.proc.pid}-stdout")
        self._err = threading.Thread(target=self._read_stderr, args=(self.proc.stderr,), daemon=True,
                                     name=f"probe-{self.proc.pid}-stderr")
        self._out.start()
        self._err.start()

    def _start(self, argv: list[str], env: Mapping[str, str], server: ForkServer | None
               ) -> subprocess.Popen[bytes] | ForkedChild:
        """Fork the child from `server` when it runs exactly what the server serves (the probe
        child, in the server's environment); else, or when the server cannot, start it cold."""
        if (server is not None and self.job_dir is None and argv[:1] == [server.python]
                and without_secrets(env) == server.env):
            first = server.down is None
            try:
                return server.popen(argv[1:])
            except ForkServerError as exc:
                if first:  # said once: later trials start cold without a word
                    log.warning("the fork server cannot start probes (%s): they start cold from now on", exc)
        return subprocess.Popen(argv, stdin=subprocess.PIPE if self.job_dir is None else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=without_secrets(env),
                                start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read_stdout(self, stream: IO[bytes]) -> None:
        for raw in stream:
            line = raw.decode("utf-8", "replace").strip()
            if not line:
                continue
            try:
                message = json.loads(line)
            except ValueError:
                self._stderr.append(f"[stdout] {line}")
                continue
            kind = message.get("type") if isinstance(message, dict) else None
            if kind == "report" and isinstance(message.get("metrics"), dict):
                self.events.put(("report", message))
            elif kind == "progress" and isinstance(message.get("phase"), str):
                self.events.put(("progress", message))
            elif kind == "result" and isinstance(message.get("result"), dict):
                self.events.put(("result", message["result"]))
            else:
                self._stderr.append(f"[stdout] {line}")
        self.events.put(("eof", None))

    def _read_stderr(self, stream: IO[bytes]) -> None:
        for raw in stream:
            line = raw.decode("utf-8", "replace").rstrip()
            self._stderr.append(line)
            log.debug("probe %d: %s", self.proc.pid, line)

    def stderr_tail(self, chars: int = STDERR_TAIL_CHARS) -> str:
        if self.proc.poll() is not None:
            self._err.join(timeout=1.0)  # let the reader take the last lines
        text = "\n".join(self._stderr).strip()
        return text[-chars:]

    def poll(self) -> int | None:
        return self.proc.poll()

    def signal_child(self, signum: int) -> None:
        """Send `signum` to the child only (not its DataLoader workers)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signum)

    def request_stop(self) -> None:
        """Ask the probe to stop at its next window boundary (prune): SIGTERM to a single
        child; the stop file of a distributed one (its launcher takes SIGTERM as "kill")."""
        if self.job_dir is not None:
            request_stop(self.job_dir)
        else:
            self.signal_child(signal.SIGTERM)

    def kill_group(self) -> None:
        """SIGKILL the child's whole process group, and every rank's of a distributed probe
        (harmless when they are already gone)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.job_dir is not None:
            kill_ranks(self.job_dir)

    def stop(self, grace_s: float) -> None:
        """SIGTERM the child, give it `grace_s` to exit, then SIGKILL its group; reap it."""
        self.signal_child(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace_s)
        self.finish()

    def finish(self) -> int:
        """Kill what is left of the group, reap the child, let the readers drain; its exit status."""
        self.kill_group()
        returncode = self.proc.wait()
        if self.job_dir is not None:
            kill_ranks(self.job_dir)  # a rank whose pid file appeared while the launcher died
        self._out.join(timeout=5.0)
        self._err.join(timeout=5.0)
        return returncode


def kill_after(child: ProbeProcess, grace_s: float) -> None:
    """Wait `grace_s` for `child` to exit (it was asked to stop), then kill its group."""
    try:
        child.proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        log.warning("probe %d did not stop within %.0f s of SIGTERM: killing it", child.pid, grace_s)
        child.kill_group()
