"""Warm probe starts: one process per worker imports torch once, then forks a probe child per trial.

A cold probe child spends seconds importing torch and torch._dynamo before its first step. The
fork server (``python -m autotune.engine.fork_server``) imports them once (`PRELOAD`), then forks
a child per request that runs exactly what ``python -m MODULE ARGS`` (or ``-c CODE``) would. It
forks from its only thread and never computes with torch or initialises CUDA first (each child
creates its own context; `preload` checks), freezes its objects out of the children's
collections (``gc.freeze``), and runs with the children's environment, never the worker's
secrets (`SECRET_ENV`).

Protocol, over a Unix SOCK_SEQPACKET pair the worker creates (`ForkServer`): a request is one
JSON object ``{"argv": [...], "preloaded": bool}`` with the child's stdin, stdout, stderr and an
answer socket attached (SCM_RIGHTS); the server answers ``{"pid": PID}``, then ``{"exit": CODE}``
on that socket, says ``{"ready": true}`` once on the control socket when every module is
imported, and reaps a child only after the worker closed its answer socket (a pid the worker
signals is never another process's). A child leads its own session and dies with the server,
the server with the worker. When the server cannot start or has died, `popen` raises
`ForkServerError` and the worker starts its children cold.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Mapping
from typing import IO, Any, NoReturn

log = logging.getLogger("autotune.engine.fork_server")

MODULE = "autotune.engine.fork_server"
# What every probe imports: torch, torch._dynamo (torch.optim imports it on an optimizer's first
# use), the probe and the built-in workloads. Never a module that starts a thread or touches CUDA.
PRELOAD = ("torch", "torch._dynamo", "autotune.engine.probe", "autotune.engine.probe_child", "autotune.worker.hardware",
           "autotune.workloads")
NVML_CHECK_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"
PARENT_POLL_S = 0.5
MAX_MESSAGE = 1 << 16  # a request holds an argv: a -c script at most
SPAWN_TIMEOUT_S = 300.0  # the first request waits for the preload (a few seconds; minutes on a slow disk)
# The worker's secrets, which no process it starts inherits: a probe runs workload code (possibly
# a plugin's), which has no business with the service's bearer token.
SECRET_ENV = ("AUTOTUNE_TOKEN",)


def without_secrets(env: Mapping[str, str]) -> dict[str, str]:
    """`env` less the worker's secrets (`SECRET_ENV`): the environment of any child of a worker."""
    return {name: value for name, value in env.items() if name not in SECRET_ENV}


class ForkServerError(RuntimeError):
    """The fork server could not start a child (it never started, died, or refused): start it cold."""


# --- the server --------------------------------------------------------------------------------------


def preload(modules: tuple[str, ...] = PRELOAD) -> None:
    """Import `modules`, checking after each that the process may still fork safely: one
    thread, and no CUDA context. Raises RuntimeError naming what broke that rule."""
    import importlib

    for name in modules:
        importlib.import_module(name)
        threads = threading.active_count()
        if threads != 1:
            raise RuntimeError(f"importing {name} started {threads - 1} thread(s): forking is not safe")
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            raise RuntimeError(f"importing {name} initialised CUDA: a forked child could not use the GPU")


def _exit_code(pid: int) -> int | None:
    """The exit status of child `pid` if it has ended (it stays a zombie: WNOWAIT), as Popen's returncode."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return -signal.SIGKILL  # already reaped: cannot happen while we hold it; say "killed"
    if info is None:
        return None
    return -info.si_status if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED) else info.si_status


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # the worker closed its end: it no longer wants to know
        sock.send(json.dumps(message).encode())


def _run_child(argv: list[str], stdio: list[int], inherited: list[int]) -> NoReturn:
    """In the forked child: take over `stdio` as fds 0-2, lead a new session, run `argv` as
    ``python ARGV`` would (``-m MODULE ...`` or ``-c CODE ...``), exit with its status. Never returns."""

    def child() -> int:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the server's handlers, back to an interpreter's
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd in inherited:
            with contextlib.suppress(OSError):
                os.close(fd)
        for target, fd in enumerate(stdio):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.pop(NVML_CHECK_ENV, None)
        return _run_argv(argv)

    exit_forked(child)


def exit_forked(body: Callable[[], int]) -> NoReturn:
    """End a forked child as an interpreter ends: run `body`, then exit with its status (a
    SystemExit's code, its message on stderr; 1 and the traceback for any other exception),
    after the exit functions (compile-worker pools, ...) and a flush of stdout and stderr.
    Never returns (os._exit: nothing of the parent's runs on in the child)."""
    code = 1
    try:
        code = body()
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if stop.code is not None and not isinstance(stop.code, int):
            print(stop.code, file=sys.stderr)
    except BaseException:  # whatever it was, the child reports it and exits
        traceback.print_exc()
        code = 1
    finally:
        import atexit

        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
        os._exit(code)


def _run_argv(argv: list[str]) -> int:
    """Run ``python ARGV`` in this process: ``-m MODULE ARG...`` or ``-c CODE ARG...``."""
    import runpy

    if len(argv) >= 2 and argv[0] == "-m":
        from autotune.engine.probe_child import set_process_name

        set_process_name(argv[1].rpartition(".")[2])  # ps shows the server's command line: comm says which
        sys.argv = [argv[1], *argv[2:]]
        with warnings.catch_warnings():  # it was preloaded: run afresh as __main__, as `python -m` would
            warnings.filterwarnings("ignore", message=".*found in sys.modules", category=RuntimeWarning)
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return 0
    if len(argv) >= 2 and argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        return 0
    raise SystemExit(f"autotune.engine.fork_server: cannot run {argv!r}: give -m MODULE or -c CODE")


def serve(control: socket.socket, parent_pid: int, modules: tuple[str, ...] = PRELOAD) -> int:
    """The server's loop (see the module docstring). Returns when the worker closes the control
    socket or dies."""
    from autotune.engine.probe_child import PARENT_PID_ENV, set_parent_death_signal

    set_parent_death_signal()
    if os.getppid() != parent_pid:
        return 1  # the worker died before the signal was armed
    os.environ[PARENT_PID_ENV] = str(os.getpid())  # the children die with this server
    os.environ[NVML_CHECK_ENV] = "1"
    preload(modules[:1])  # torch, before any request: everything a child runs needs it
    later = list(modules[1:])  # imported one at a time while no request waits (a worker's first
    # request, its hardware detection, needs torch only and need not wait for torch._dynamo)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select through the wakeup fd
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker decides; Ctrl-C is for it
    children: dict[int, socket.socket] = {}  # running or not yet released → its answer socket
    ended: set[int] = set()  # whose exit the worker was told
    while True:
        waiting: list[socket.socket | int] = [control, wake_r, *(children[pid] for pid in ended)]
        readable, _, _ = select.select(waiting, [], [], 0.0 if later else PARENT_POLL_S)
        if os.getppid() != parent_pid:
            return 1
        if later and not readable:
            preload((later.pop(0),))
            if not later:
                _send(control, {"ready": True})  # every module imported (ForkServer.wait_ready)
            continue
        if wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 512)
        for pid in [pid for pid in children if pid not in ended]:
            code = _exit_code(pid)
            if code is not None:
                _send(children[pid], {"exit": code})
                ended.add(pid)
        for pid in [pid for pid in ended if children[pid] in readable]:
            with contextlib.suppress(OSError):
                children[pid].recv(16)  # EOF: released
            children.pop(pid).close()
            ended.discard(pid)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)  # reap it now that the worker no longer names it
        if control in readable:
            try:
                message, fds, _, _ = socket.recv_fds(control, MAX_MESSAGE, 4)
            except OSError:
                return 0
            if not message:
                return 0  # the worker closed the socket: it is done
            if len(fds) != 4:
                for fd in fds:
                    os.close(fd)
                log.error("a request without its 4 file descriptors: ignored")
                continue
            answer = socket.socket(fileno=fds[3])
            try:
                request = json.loads(message)
                argv, preloaded = request["argv"], bool(request.get("preloaded", True))
            except (ValueError, KeyError, TypeError, AttributeError):
                for fd in fds[:3]:
                    os.close(fd)
                _send(answer, {"error": "bad request"})
                answer.close()
                continue
            if preloaded and later:  # a probe: it would import the rest itself, and the server again after
                preload(tuple(later))
                later.clear()
                _send(control, {"ready": True})
            inherited = [control.fileno(), wake_r, wake_w, fds[3], *(s.fileno() for s in children.values())]
            gc.freeze()  # the preloaded objects: no collection in the child traverses (or copies) them
            pid = os.fork()
            if pid == 0:
                _run_child([str(a) for a in argv], fds[:3], inherited)
            for fd in fds[:3]:
                os.close(fd)
            children[pid] = answer
            _send(answer, {"pid": pid})


def main() -> int:
    """``python -m autotune.engine.fork_server FD PARENT_PID``: serve the worker PARENT_PID on socket FD.
    (No logging set up here: a child's own would be a no-op after it.)"""
    fd, parent_pid = int(sys.argv[1]), int(sys.argv[2])
    with socket.socket(fileno=fd) as control:
        try:
            return serve(control, parent_pid)
        except Exception as exc:  # the preload failed: the worker starts its children cold
            print(f"autotune.engine.fork_server: stopping: {exc}", file=sys.stderr)
            return 1


def probe_children(worker_pid: int, module: str = "autotune.engine.probe_child") -> list[int]:
    """The running children of worker `worker_pid` that run `module` (Linux /proc; [] elsewhere):
    started cold, its own children with `module` on their command line; forked, its fork
    server's children, which show the server's command line but are named after the module's
    last part (`_run_argv` sets it as they start: a child forked a moment ago may not show yet)."""
    from autotune.engine.compile_workers import children, cmdline, process_name, process_stat

    found = []
    for pid in children(worker_pid):
        line = cmdline(pid)
        if module in line:
            found.append(pid)
        elif MODULE in line:
            found += [p for p in children(pid) if process_name(p) == module.rpartition(".")[2][:15]]
    return [p for p in found if (process_stat(p) or ["Z"])[0] != "Z"]


# --- the worker's side -------------------------------------------------------------------------------


class ForkedChild:
    """A child forked by the server, handled as a `subprocess.Popen` with stdin, stdout and
    stderr pipes is (pid, stdin/stdout/stderr, poll, wait, returncode). It is not this
    process's child: its exit status comes from the server."""

    def __init__(self, argv: list[str], pid: int, answers: socket.socket,
                 stdin: IO[bytes], stdout: IO[bytes], stderr: IO[bytes]) -> None:
        self.args = argv
        self.pid = pid
        self.stdin: IO[bytes] | None = stdin
        self.stdout: IO[bytes] | None = stdout
        self.stderr: IO[bytes] | None = stderr
        self.returncode: int | None = None
        self._answers = answers
        self._lock = threading.Lock()

    def _settle(self, timeout: float | None) -> int | None:
        """The exit status once known, waiting up to `timeout` s for it (None: no limit). Another
        thread waiting already: this one waits for it as long (poll: not at all), as Popen's do."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not (self._lock.acquire(blocking=False) if timeout == 0 else
                self._lock.acquire(timeout=-1 if timeout is None else timeout)):
            return self.returncode
        try:
            if self.returncode is not None:
                return self.returncode
            self._answers.settimeout(None if deadline is None else max(0.0, deadline - time.monotonic()))
            try:
                data = self._answers.recv(MAX_MESSAGE)
            except (TimeoutError, BlockingIOError):
                return None
            except OSError:
                data = b""
            try:
                code = int(json.loads(data)["exit"]) if data else None
            except (ValueError, KeyError, TypeError):
                code = None
            if code is None:  # the server died: so did the child (it dies with the server)
                log.warning("the fork server ended while probe %d ran: the probe was killed with it", self.pid)
                code = -signal.SIGKILL
            self.returncode = code
            self._answers.close()  # release: the server may now reap it
            return code
        finally:
            self._lock.release()

    def poll(self) -> int | None:
        return self._settle(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._settle(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code


class ForkServer:
    """The worker's fork server (see the module docstring): `start` launches it with the
    children's environment `env`; `popen` forks a child. Thread-safe (the lease loops of
    a worker share one). Close it when the worker ends (its children should have ended)."""

    def __init__(self, env: Mapping[str, str], python: str = sys.executable) -> None:
        self.env = without_secrets(env)
        self.python = python
        self.proc: subprocess.Popen[bytes] | None = None
        self._control: socket.socket | None = None
        self._lock = threading.Lock()
        self._stderr: collections.deque[str] = collections.deque(maxlen=40)
        self.down: str | None = None  # why it stopped serving, once it has: later requests fail at once

    def start(self) -> ForkServer:
        """Start the server (returns at once: it preloads in the background; the first
        request waits for it). Call it from a thread that lives as long as the worker
        (PR_SET_PDEATHSIG fires when the thread that started the server ends)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen([self.python, "-m", MODULE, str(theirs.fileno()), str(os.getpid())],
                                         pass_fds=[theirs.fileno()], env=self.env, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        self._control = ours
        assert self.proc.stderr is not None
        threading.Thread(target=self._read_stderr, args=(self.proc.stderr,), daemon=True,
                         name="fork-server-stderr").start()
        return self

    def _read_stderr(self, stream: IO[bytes]) -> None:
        for raw in stream:
            line = raw.decode("utf-8", "replace").rstrip()
            self._stderr.append(line)
            log.debug("fork server: %s", line)

    def wait_ready(self, timeout_s: float = SPAWN_TIMEOUT_S) -> bool:
        """Wait until the server has imported every module it preloads (it serves requests
        before: they fork with what it has so far). False if it did not within `timeout_s`
        or is down."""
        if self._control is None:
            return False
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline and not self.why_down():
                self._control.settimeout(min(1.0, max(0.0, deadline - time.monotonic())))
                try:
                    data = self._control.recv(MAX_MESSAGE)
                except TimeoutError:
                    continue
                except OSError:
                    return False
                if not data:
                    return False
                with contextlib.suppress(ValueError, TypeError):
                    if json.loads(data).get("ready"):
                        return True
            return False
        finally:
            if self._control is not None:
                self._control.settimeout(None)

    def why_down(self) -> str:
        """Why the server is not usable (its exit status and last lines), or "" while it runs."""
        if self.proc is None:
            return "it was not started"
        code = self.proc.poll()
        if code is None:
            return ""
        tail = " | ".join(line for line in self._stderr if line.strip())[-600:]
        return f"it exited with status {code}" + (f": {tail}" if tail else "")

    def popen(self, argv: list[str], timeout_s: float = SPAWN_TIMEOUT_S, preloaded: bool = True) -> ForkedChild:
        """Fork a child running ``python ARGV`` (``["-m", MODULE, ...]`` or ``["-c", CODE, ...]``),
        with stdin, stdout and stderr pipes to this process: once every preloaded module is
        imported, or with `preloaded` False at once, with what is (torch at least). Raises
        ForkServerError when the server cannot (start the child cold then)."""
        if self.down is not None:
            raise ForkServerError(self.down)
        if self._control is None or self.proc is None:
            raise ForkServerError("the fork server was not started")
        try:
            return self._popen(argv, timeout_s, preloaded)
        except ForkServerError as exc:
            self.down = str(exc)
            raise

    def _popen(self, argv: list[str], timeout_s: float, preloaded: bool) -> ForkedChild:
        assert self._control is not None
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        stderr_r, stderr_w = os.pipe()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        theirs_fds = [stdin_r, stdout_w, stderr_w, theirs.fileno()]
        keep = [stdin_w, stdout_r, stderr_r]
        try:
            with self._lock:
                try:
                    socket.send_fds(self._control, [json.dumps({"argv": argv, "preloaded": preloaded}).encode()],
                                   theirs_fds)
                except OSError as exc:
                    raise ForkServerError(f"the fork server does not take requests ({exc}); "
                                          f"{self.why_down() or 'it is still running'}") from exc
        except BaseException:
            for fd in keep:
                os.close(fd)
            ours.close()
            raise
        finally:
            for fd in theirs_fds[:3]:
                os.close(fd)
            theirs.close()
        deadline = time.monotonic() + timeout_s
        data = b""
        while not data:
            ours.settimeout(min(1.0, max(0.0, deadline - time.monotonic())))
            try:
                data = ours.recv(MAX_MESSAGE)
                if not data:
                    break  # EOF: the server dropped the request (it died)
            except TimeoutError:
                if self.why_down() or time.monotonic() >= deadline:
                    break
        try:
            pid = int(json.loads(data)["pid"]) if data else None
        except (ValueError, KeyError, TypeError):
            pid = None
        if pid is None:
            for fd in keep:
                os.close(fd)
            ours.close()
            why = self.why_down() or (f"no answer within {timeout_s:.0f} s" if not data else data.decode()[:200])
            raise ForkServerError(f"the fork server did not start the child: {why}")
        ours.settimeout(None)
        return ForkedChild(argv, pid, ours, os.fdopen(stdin_w, "wb"), os.fdopen(stdout_r, "rb"),
                           os.fdopen(stderr_r, "rb"))

    def close(self) -> None:
        """End the server (when the worker ends: its probes have ended). It holds nothing worth
        a goodbye, and may be busy importing: closed and terminated at once."""
        if self._control is not None:
            self._control.close()
            self._control = None
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.terminate()
            try:
                self.proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


if __name__ == "__main__":
    sys.exit(main())
