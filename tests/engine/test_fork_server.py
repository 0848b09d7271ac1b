"""autotune.engine.fork_server: a worker's probe children forked from a process that imported torch once.

One server (a real ``python -m autotune.engine.fork_server`` process) serves the module; its children
are real forks. The worker-level behaviours (a killed worker's probes die, SIGTERM, the kill of
a probe child, timeouts) run through `autotune worker` in tests/test_e2e.py and
tests/test_recovery.py, whose workers fork their probes so."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from live_service import is_alive, wait_until

from autotune.engine.compile_workers import children
from autotune.engine.fork_server import ForkedChild, ForkServer, ForkServerError, probe_children
from autotune.engine.probe_child import ChildJob
from autotune.worker.child import ProbeProcess
from autotune.worker.detect import detect_hardware, run_python, start_fork_server
from autotune.worker.options import CHILD_MODULE, WorkerOptions, child_environment


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    server = ForkServer(child_environment(1)).start()
    assert server.wait_ready(120), server.why_down()  # every module imported (before: torch at least)
    yield server
    server.close()


def run(server: ForkServer, code: str, *args: str, stdin: bytes = b"") -> tuple[ForkedChild, str, str]:
    child = server.popen(["-c", code, *args])
    assert child.stdin is not None and child.stdout is not None and child.stderr is not None
    child.stdin.write(stdin)
    child.stdin.close()
    out, err = child.stdout.read().decode(), child.stderr.read().decode()
    child.wait(timeout=60)
    return child, out, err


def test_a_forked_child_starts_with_torch_imported_in_the_servers_environment(server: ForkServer) -> None:
    child, out, err = run(server, textwrap.dedent("""
        import gc, json, os, sys
        print(json.dumps({"preloaded": [m in sys.modules for m in ("torch", "torch._dynamo", "autotune.engine.probe")],
                          "frozen": gc.get_freeze_count(), "tracked": len(gc.get_objects()),
                          "argv": sys.argv, "stdin": sys.stdin.read(), "ppid": os.getppid(),
                          "leads_session": os.getsid(0) == os.getpid(), "omp": os.environ.get("OMP_NUM_THREADS"),
                          "parent_env": os.environ.get("AUTOTUNE_PARENT_PID"),
                          "nvml": os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")}))
        print("to stderr", file=sys.stderr)
        sys.exit(3)"""), "an-arg", stdin=b"the job")
    assert child.returncode == 3 and err == "to stderr\n"
    seen = json.loads(out)
    assert seen["preloaded"] == [True, True, True]  # what a cold child would spend seconds importing
    # the server froze what it preloaded before it forked: the child's collections leave it alone
    assert seen["frozen"] > 100_000 and seen["tracked"] < seen["frozen"] / 10, seen
    assert seen["argv"] == ["-c", "an-arg"] and seen["stdin"] == "the job"
    assert server.proc is not None and seen["ppid"] == server.proc.pid  # forked by the server ...
    assert seen["parent_env"] == str(server.proc.pid)  # ... and it dies with it (probe_child.watch_parent)
    assert seen["leads_session"]  # the worker kills its process group
    assert seen["omp"] == "1"  # child_environment(1): the server's environment is the children's
    assert seen["nvml"] is None  # the server's own CUDA check setting is not passed on


def test_exit_status_poll_wait_and_signals_read_as_a_popen_childs(server: ForkServer) -> None:
    child, _, err = run(server, "raise SystemExit('no good')")
    assert child.returncode == 1 and "no good" in err
    child, _, err = run(server, "raise ValueError('boom')")
    assert child.returncode == 1 and "ValueError: boom" in err
    child, _, _ = run(server, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert child.returncode == -signal.SIGKILL
    sleeper = server.popen(["-c", "import time; time.sleep(60)"])
    assert sleeper.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.wait(timeout=0.2)
    assert is_alive(sleeper.pid)  # not released: the server has not reaped it
    os.killpg(sleeper.pid, signal.SIGTERM)
    assert sleeper.wait(timeout=30) == -signal.SIGTERM
    wait_until(lambda: not os.path.exists(f"/proc/{sleeper.pid}"), 10, "the server to reap the released child")


def test_a_probe_is_forked_after_the_whole_preload_and_a_short_script_at_once() -> None:
    """Asked for both the moment it starts, a fresh server forks the short script (preloaded
    False: the worker's hardware detection) as soon as torch is in, and the probe (preloaded,
    the default) only once every module is: forked earlier, the probe would import
    torch._dynamo and the rest itself, and the server again after it."""
    fresh = ForkServer(child_environment(1)).start()
    try:
        seen = "import sys; print(all(m in sys.modules for m in ('torch._dynamo', 'autotune.workloads')))"
        script = fresh.popen(["-c", seen], preloaded=False)
        probe = fresh.popen(["-c", seen])
        outputs = []
        for child in (script, probe):
            assert child.stdin is not None and child.stdout is not None
            child.stdin.close()
            outputs.append(child.stdout.read().decode().strip())
            assert child.wait(timeout=120) == 0
        assert outputs == ["False", "True"]
    finally:
        fresh.close()


def test_a_short_lived_child_past_its_limit_is_killed(server: ForkServer) -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        run_python(["-c", "import os, time; print(os.getpid(), flush=True); time.sleep(60)"], server, timeout_s=1.0)
    assert server.proc is not None
    assert not [p for p in children(server.proc.pid) if is_alive(p)]  # killed, and released to be reaped
    assert run_python(["-c", "print('next')"], server) == (0, "next\n", "")  # the server serves on


def test_the_worker_forks_its_probe_children_and_detects_its_hardware_through_the_server(
        server: ForkServer, tiny_datasets: Any) -> None:
    assert detect_hardware("cpu", server).device == "cpu"  # (the CPU: asked of no child, see test_worker)
    with pytest.raises(ValueError, match="unknown device 'tpu'"):  # a device torch is asked about: a forked child
        detect_hardware("tpu", server)
    job = ChildJob(workload="ups", preset="tiny", config={"batch_size": 4, "accum_steps": 1},
                   probe={"samples": 40, "windows": 5, "warmup_steps": 5}, threads=1)
    # the server's environment: child_environment(1) when it started (a worker's never changes; a test's
    # spool folder does)
    child = ProbeProcess([sys.executable, "-m", CHILD_MODULE], job, server.env, server=server)
    assert isinstance(child.proc, ForkedChild)
    # ps shows the server's command line for it: its name says which it is (set as it starts)
    wait_until(lambda: probe_children(os.getpid()) == [child.pid], 10, "the forked child to name itself")
    events: list[tuple[str, Any]] = []
    while not events or events[-1][0] != "eof":
        events.append(child.events.get(timeout=120))
    assert child.proc.wait(timeout=30) == 0, child.stderr_tail()
    assert child.finish() == 0 and child.stderr_tail() == ""  # nothing said on stderr: no warning, no error
    result = next(payload for kind, payload in events if kind == "result")
    assert result["failure"] is None and result["throughput_samples_per_s"] > 0, result
    assert "report" in [kind for kind, _ in events]


def test_a_child_the_server_does_not_serve_starts_cold(server: ForkServer) -> None:
    job = ChildJob(workload="ups", preset="tiny", config={})
    other_env = {**server.env, "AUTOTUNE_SOMETHING_ELSE": "1"}
    child = ProbeProcess([sys.executable, "-c", "import sys; sys.stdin.read()"], job, other_env, server=server)
    assert isinstance(child.proc, subprocess.Popen)  # not the probe child's module
    assert child.proc.wait(timeout=30) == 0
    child.finish()
    child = ProbeProcess([sys.executable, "-m", CHILD_MODULE], job, other_env, server=server)
    assert isinstance(child.proc, subprocess.Popen)  # another environment than the server's
    child.finish()
    assert start_fork_server(WorkerOptions(warm_start=False)) is None  # --cold-start
    assert start_fork_server(WorkerOptions(gpus_per_trial=2)) is None  # the distributed launcher starts cold


def test_a_dead_server_kills_its_children_and_the_worker_starts_probes_cold(tmp_path: Path) -> None:
    server = ForkServer(child_environment(1)).start()
    try:
        sleeper = server.popen(["-c", "from autotune.engine.probe_child import watch_parent\nwatch_parent()\n"
                                      "import time\ntime.sleep(60)"])
        assert server.proc is not None
        os.kill(server.proc.pid, signal.SIGKILL)
        assert sleeper.wait(timeout=10) == -signal.SIGKILL  # said so: the server is gone, and the child with it
        wait_until(lambda: not is_alive(sleeper.pid), 10, "the dead server's child to exit")
        with pytest.raises(ForkServerError, match="exited with status -9"):
            server.popen(["-c", "pass"])
        job = ChildJob(workload="ups", preset="tiny", config={})
        child = ProbeProcess([sys.executable, "-c", "import sys; sys.stdin.read()"], job, server.env, server=server)
        assert isinstance(child.proc, subprocess.Popen) and child.proc.wait(timeout=30) == 0
        child.finish()
    finally:
        server.close()


def test_the_server_ends_with_its_worker_and_takes_the_probes_with_it(tmp_path: Path) -> None:
    script = textwrap.dedent("""
        import json, sys, time
        from autotune.engine.fork_server import ForkServer
        from autotune.worker.options import child_environment
        server = ForkServer(child_environment(1)).start()
        child = server.popen(["-c", "from autotune.engine.probe_child import watch_parent\\nwatch_parent()\\n"
                                    "import time\\ntime.sleep(60)"])
        print(json.dumps({"server": server.proc.pid, "child": child.pid}), flush=True)
        time.sleep(60)""")
    worker = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout is not None
        pids = json.loads(worker.stdout.readline())
        assert is_alive(pids["server"]) and is_alive(pids["child"])
        worker.kill()  # SIGKILL: the worker cannot clean up
        worker.wait()
        started = time.monotonic()
        wait_until(lambda: not is_alive(pids["server"]) and not is_alive(pids["child"]), 10,
                   "the killed worker's fork server and probe to exit")
        assert time.monotonic() - started < 10
    finally:
        if worker.poll() is None:
            worker.kill()


def test_a_preload_that_starts_a_thread_is_refused(tmp_path: Path) -> None:
    (tmp_path / "threaded.py").write_text("import threading, time\n"
                                          "threading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n")
    code = "from autotune.engine.fork_server import preload; preload(('threaded',))"
    done = subprocess.run([sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])})
    assert done.returncode != 0 and "started 1 thread(s): forking is not safe" in done.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("compile_mode", ["none", "reduce-overhead"])
def test_a_forked_probe_trains_on_the_gpu(server: ForkServer, compile_mode: str, tiny_datasets: Any) -> None:
    # the server imported torch without creating a CUDA context: each child makes its own (and
    # its own compile workers and CUDA graphs)
    child, out, err = run(server, "import torch; print(torch.ones(2, device='cuda').sum().item())")
    assert child.returncode == 0 and out.strip() == "2.0", err
    assert detect_hardware("cuda:0", server).device == "cuda:0"
    job = ChildJob(workload="ups", preset="tiny", config={"batch_size": 8, "compile": compile_mode},
                   device="cuda:0", probe={"samples": 400, "windows": 5, "warmup_steps": 5}, threads=1)
    probe = ProbeProcess([sys.executable, "-m", CHILD_MODULE], job, server.env, server=server)
    assert isinstance(probe.proc, ForkedChild)
    events: list[tuple[str, Any]] = []
    while not events or events[-1][0] != "eof":
        events.append(probe.events.get(timeout=300))
    assert probe.proc.wait(timeout=60) == 0, probe.stderr_tail()
    probe.finish()
    result = next(payload for kind, payload in events if kind == "result")
    assert result["failure"] is None and result["throughput_samples_per_s"] > 0, (result["failure"],
                                                                                 probe.stderr_tail())
    assert result["device"] != "cpu" and "cpu (" not in result["device"]
