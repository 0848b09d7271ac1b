"""Short-lived children of the worker: hardware detection (`detect_hardware`) and other
``python ...`` helpers (`run_python`), forked from the worker's fork server when it can, and
the fork server itself (`start_fork_server`).

The worker never initialises CUDA nor imports torch: a CUDA context made in the worker would
stay with it for its whole life, next to each probe's own."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping

from autotune.contract.registry import export_workload_paths
from autotune.engine.fork_server import ForkServer, ForkServerError, without_secrets
from autotune.worker.hardware import Hardware, detect_cpu, installed_torch_version
from autotune.worker.options import WorkerOptions, child_environment

log = logging.getLogger(__name__)

DETECT_SCRIPT = ("import json, sys\n"
                 "from autotune.worker.hardware import detect\n"
                 "try:\n"
                 "    print(json.dumps(detect(sys.argv[1]).to_dict()))\n"
                 "except ValueError as e:\n"
                 "    print(e, file=sys.stderr)\n"
                 "    sys.exit(2)\n")


def run_python(args: list[str], server: ForkServer | None = None, timeout_s: float | None = 300.0,
               env: Mapping[str, str] | None = None, preloaded: bool = False) -> tuple[int, str, str]:
    """``python ARGS`` in a short-lived child (forked from `server` when it can and `env`, if
    given, is the server's; else started cold in `env`, default this process's, without the
    worker's secrets): its (exit status, stdout, stderr). Raises subprocess.TimeoutExpired past
    `timeout_s` (None: no limit). A forked one does not wait for the server's whole preload
    (torch is there), unless `preloaded`: a child that runs a probe imports torch._dynamo on its
    first optimizer step, and forked before the preload it would import it while the server
    does too (1.2-1.7 CPU-seconds more on a 2-core host)."""
    if server is not None and server.down is None and (env is None or without_secrets(env) == server.env):
        try:
            child = server.popen(args, preloaded=preloaded)
        except ForkServerError as exc:
            log.warning("the fork server cannot start children (%s): they start cold from now on", exc)
        else:
            assert child.stdin is not None and child.stdout is not None and child.stderr is not None
            child.stdin.close()
            streams = (child.stdout, child.stderr)
            texts = ["", ""]

            def read(index: int) -> None:
                texts[index] = streams[index].read().decode("utf-8", "replace")

            readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(2)]
            for reader in readers:
                reader.start()
            try:
                code = child.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                raise
            finally:
                for reader in readers:
                    reader.join(timeout=5.0)
                for stream in streams:
                    stream.close()
            return code, texts[0], texts[1]
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout_s, check=False,
                          env=without_secrets(os.environ if env is None else env))
    return proc.returncode, proc.stdout, proc.stderr


def detect_hardware(device: str, server: ForkServer | None = None) -> Hardware:
    """`autotune.worker.hardware.detect(device)` run in a short-lived child process (forked from the
    worker's `server` when there is one: it has imported torch already).

    Asking torch about a GPU creates a CUDA context that would stay with the worker for its
    whole life, next to each probe's own; the worker itself therefore never initialises CUDA
    (nor imports torch). The CPU needs no question for torch but its version, which the
    installed distribution records: it is detected here, and a CPU worker leases at once,
    while its fork server is still importing torch (one that exits at once, e.g. refused a
    pinned study, stops that import midway). Raises ValueError when the device cannot be used."""
    version = installed_torch_version() if device == "cpu" else None
    if version is not None:
        return detect_cpu(version)
    code, out, err = run_python(["-c", DETECT_SCRIPT, device], server)
    if code != 0:
        lines = err.strip().splitlines()
        raise ValueError(lines[-1] if lines else f"hardware detection for {device!r} failed (exit code {code})")
    return Hardware(**json.loads(out.strip().splitlines()[-1]))


def start_fork_server(options: WorkerOptions) -> ForkServer | None:
    """The worker's fork server (`autotune.engine.fork_server`), started in the environment its probe
    children get, or None: warm starts off (--cold-start), not Linux, several GPUs per trial
    (the distributed launcher starts cold, with its group's GPUs, and forks its ranks itself), or the
    server could not be started (said; the children start cold)."""
    if not options.warm_start or options.gpus_per_trial != 1 or not sys.platform.startswith("linux"):
        return None
    export_workload_paths(options.workload_paths())  # in the environment the server (and each child) reads
    try:
        return ForkServer(child_environment(options.threads)).start()
    except OSError as exc:
        log.warning("the fork server did not start (%s): probes start cold", exc)
        return None

