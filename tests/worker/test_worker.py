"""autotune.engine.probe_child (the stdin/stdout protocol) and autotune.worker's handling of its child.

The worker tests run `Worker.run_trial` in-process against a scripted fake client, with
fake child programs (a crash, a SIGKILL, a hang, a child that ignores SIGTERM, ...), so
every way a probe can end is exercised in a fraction of a second each.
"""

from __future__ import annotations

import io
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from live_service import is_alive, wait_until
from rich.console import Console
from worker_fakes import HARDWARE, FakeClient, fake_child, make_lease

from autotune.engine.probe_child import ChildJob
from autotune.worker import trial as trial_module
from autotune.worker.child import ProbeProcess
from autotune.worker.client import Conflict, ServiceUnavailable
from autotune.worker.detect import detect_hardware
from autotune.worker.hardware import detect
from autotune.worker.loop import Worker
from autotune.worker.options import WorkerOptions, child_environment, hard_timeout_grace_s
from autotune.worker.results import describe_exit

RESULT_KEYS = {"workload", "preset", "config", "device", "torch_version", "failure"}


def tiny_job(**probe: Any) -> ChildJob:
    settings = {"samples": 40, "windows": 5, "warmup_steps": 5, "timeout_s": 120.0, **probe}
    return ChildJob(workload="ups", preset="tiny", config={"batch_size": 4, "accum_steps": 1}, device="cpu",
                    probe=settings, threads=1)


def run_child(job: ChildJob | str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    text = job if isinstance(job, str) else job.to_json()
    return subprocess.run([sys.executable, "-m", "autotune.engine.probe_child"], input=text, capture_output=True,
                          text=True,
                          timeout=timeout, env=child_environment(1), check=False)


# --- the child protocol ----------------------------------------------------------------------------


def test_child_writes_report_lines_then_one_result_line(tiny_datasets: Any) -> None:
    proc = run_child(tiny_job())
    assert proc.returncode == 0, proc.stderr[-3000:]
    every = [json.loads(line) for line in proc.stdout.splitlines()]  # every stdout line is JSON
    progress = [m for m in every if m["type"] == "progress"]
    messages = [m for m in every if m["type"] != "progress"]
    kinds = [m["type"] for m in messages]
    assert kinds == ["report"] * 5 + ["result"]
    # where the probe is, for the worker to show: its phases in order, samples never going back
    phases = [m["phase"] for m in progress]
    assert phases[:3] == ["setup", "warm-up", "timed windows"] and phases.count("window") == 5, phases
    assert phases[-1] == "validation" and every[-1]["type"] == "result", phases
    samples = [m["samples"] for m in progress if "samples" in m]
    assert samples == sorted(samples) and samples[-1] == 40 and all(m["total_samples"] == 40 for m in progress[1:])
    assert all(isinstance(m["eta_s"], float) for m in progress if m["phase"] == "window")
    steps = [m["step"] for m in messages[:-1]]
    assert steps == sorted(steps) and steps[-1] == 10
    assert set(messages[0]["metrics"]) == {"samples", "loss", "throughput", "window"}
    result = messages[-1]["result"]
    assert set(result) >= RESULT_KEYS
    assert result["failure"] is None and not result["stopped_early"]
    assert result["throughput_samples_per_s"] > 0 and result["val_nrmse"] > 0
    assert result["samples_trained"] == 40


def test_child_turns_a_config_the_probe_refuses_into_a_failure_result() -> None:
    job = tiny_job(samples=8)  # 2 steps: fewer than warm-up + 5 timed windows
    proc = run_child(job)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])["result"]
    assert set(result) >= RESULT_KEYS
    assert result["failure"]["kind"] == "error"
    assert "samples: 8 samples at effective batch 4" in result["failure"]["message"]


def test_child_rejects_a_malformed_job_with_exit_2() -> None:
    proc = run_child("not json")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "bad job on stdin" in proc.stderr


def test_child_stops_at_a_window_boundary_on_sigterm(tiny_datasets: Any) -> None:
    # ~1000 steps: many seconds, so SIGTERM lands mid-probe; in windows of 9 steps, so the
    # window boundary it stops at comes soon after
    job = tiny_job(samples=4000, windows=100)
    proc = subprocess.Popen([sys.executable, "-m", "autotune.engine.probe_child"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=child_environment(1))
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(job.to_json())
    proc.stdin.close()
    try:
        first = json.loads(proc.stdout.readline())
        while first["type"] == "progress":  # where the probe is (setup, warm-up, ...): then the first window
            first = json.loads(proc.stdout.readline())
        assert first["type"] == "report"
        proc.send_signal(signal.SIGTERM)
        rest = [json.loads(line) for line in proc.stdout]
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    assert rest[-1]["type"] == "result"
    result = rest[-1]["result"]
    assert result["stopped_early"] is True and result["failure"] is None
    assert result["samples_trained"] < 4000
    assert result["window_steps"] == 9 and len(result["window_throughputs"]) < 100  # stopped at a window's end
    assert result["steps"] == result["warmup_steps"] + len(result["window_throughputs"]) * 9


# --- the worker's side: a fake service and fake children -------------------------------------------


def make_worker(client: FakeClient, argv: list[str], heartbeat_s: float = 5.0, **options: Any) -> Worker:
    options.setdefault("spool_dir", Path(argv[-1]).parent / "spool")  # beside the fake child, in the test's tmp_path
    opts = WorkerOptions(worker_id="w1", heartbeat_s=heartbeat_s, child_argv=argv, **options)
    return Worker(opts, HARDWARE, client=client, console=Console(file=open(os.devnull, "w")))  # type: ignore[arg-type]


REPORTS = """
import json, sys, time
for step in (7, 9, 11):
    print(json.dumps({"type": "report", "step": step, "metrics": {"samples": step * 4, "loss": 0.5,
                                                                  "throughput": 100.0 + step, "window": 0}}),
          flush=True)
"""


def test_the_worker_shows_one_line_per_phase_of_the_probe(tmp_path: Path) -> None:
    """Not on a terminal (a log): one line per phase, with samples and the ETA; no line per window."""
    argv = fake_child(tmp_path, """
import json
for phase, info in [("setup", {}), ("warm-up", {"steps": 5, "samples": 0, "total_samples": 320}),
                    ("timed windows", {"windows": 2, "samples": 40, "total_samples": 320, "warmup_s": 1.5}),
                    ("window", {"window": 1, "windows": 2, "samples": 80, "total_samples": 320, "eta_s": 12.0}),
                    ("window", {"window": 2, "windows": 2, "samples": 120, "total_samples": 320, "eta_s": 10.0}),
                    ("untimed tail", {"samples": 120, "total_samples": 320, "eta_s": 10.0}),
                    ("validation", {"samples": 320, "total_samples": 320})]:
    print(json.dumps({"type": "progress", "phase": phase, **info}), flush=True)
print(json.dumps({"type": "result", "result": {"workload": "ups", "preset": "tiny", "config": {}, "device": "cpu",
      "torch_version": "x", "throughput_samples_per_s": 5.0, "val_nrmse": 0.5, "failure": None}}), flush=True)
""")
    out = io.StringIO()
    worker = make_worker(FakeClient(), argv)
    worker.console = Console(file=out, width=200)
    worker.run_trial(make_lease())
    lines = [line.strip() for line in out.getvalue().splitlines() if ": " in line and "trial" in line]
    shown = [line for line in lines if any(p in line for p in ("setup", "warm-up", "timed", "tail", "validation"))]
    assert len(shown) == 5 and not any("timed window 1" in line for line in lines), lines
    assert "warm-up (5 steps: compile, autotuning) · 0 of 320 samples" in shown[1]
    assert "timed windows (2; warm-up took 1.5 s) · 40 of 320 samples" in shown[2]
    assert "untimed tail · 120 of 320 samples · training ETA 10 s" in shown[3]


def test_the_childs_result_is_completed_as_is(tmp_path: Path) -> None:
    argv = fake_child(tmp_path, REPORTS + """
print("stray library chatter on stdout", flush=True)
print(json.dumps({"type": "result", "result": {"workload": "ups", "preset": "tiny", "config": {}, "device": "cpu",
      "torch_version": "x", "throughput_samples_per_s": 5.0, "val_nrmse": 0.5, "failure": None}}), flush=True)
""")
    client = FakeClient()
    make_worker(client, argv).run_trial(make_lease())
    assert [c[0] for c in client.calls] == ["report", "report", "report", "complete"]
    assert client.completed == [{"workload": "ups", "preset": "tiny", "config": {}, "device": "cpu",
                                 "torch_version": "x", "throughput_samples_per_s": 5.0, "val_nrmse": 0.5,
                                 "failure": None}]


def test_a_crashing_child_becomes_an_error_with_its_exit_code_and_stderr(tmp_path: Path) -> None:
    argv = fake_child(tmp_path, """
import sys
print("Traceback: something broke in the probe", file=sys.stderr)
sys.exit(3)
""")
    client = FakeClient()
    make_worker(client, argv).run_trial(make_lease())
    (result,) = client.completed
    assert set(result) >= RESULT_KEYS
    assert result["workload"] == "ups" and result["config"] == {"batch_size": 4} and result["device"] == "cpu (test)"
    assert result["failure"]["kind"] == "error"
    assert "probe process exited with code 3" in result["failure"]["message"]
    assert "something broke in the probe" in result["failure"]["message"]


def test_a_child_killed_by_sigkill_is_reported_with_the_signal(tmp_path: Path) -> None:
    argv = fake_child(tmp_path, REPORTS + """
import os, signal
os.kill(os.getpid(), signal.SIGKILL)
""")
    client = FakeClient()
    make_worker(client, argv).run_trial(make_lease())
    (result,) = client.completed
    assert result["failure"]["kind"] == "error"
    assert "killed by signal 9 (SIGKILL: possibly the OOM killer)" in result["failure"]["message"]


def test_a_hanging_child_is_killed_at_the_hard_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pid_file = tmp_path / "grandchild.pid"

    def grace_until_the_grandchild_runs(timeout_s: float) -> float:
        """The grace lasts until the child has started and forked its grandchild (seconds on a
        loaded host, a few milliseconds on a quiet one), and no longer."""
        wait_until(lambda: pid_file.is_file() and pid_file.read_text().strip(), 60, "the child's grandchild")
        return 0.0

    monkeypatch.setattr(trial_module, "hard_timeout_grace_s", grace_until_the_grandchild_runs)
    monkeypatch.setattr(trial_module, "KILL_GRACE_S", 0.2)  # SIGTERM is ignored: SIGKILL follows it
    argv = fake_child(tmp_path, """
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a hang that even ignores SIGTERM
pid = os.fork()  # a grandchild in the same process group: it must not survive either
if pid == 0:
    time.sleep(120)
    os._exit(0)
open(os.environ["GRANDCHILD_FILE"], "w").write(str(pid))
time.sleep(120)
""")
    monkeypatch.setenv("GRANDCHILD_FILE", str(pid_file))
    client = FakeClient()
    started = time.monotonic()
    make_worker(client, argv).run_trial(make_lease(timeout_s=0.5))
    assert time.monotonic() - started < 30
    (result,) = client.completed
    assert result["failure"]["kind"] == "timeout"
    assert "hard limit of 0.5 s" in result["failure"]["message"]
    grandchild = int(pid_file.read_text())
    assert not is_alive(grandchild)


def test_prune_stops_the_child_and_completes_a_partial_stopped_early_result(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trial_module, "PRUNE_GRACE_S", 0.3)
    argv = fake_child(tmp_path, """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # does not stop by itself: the worker must SIGKILL it
""" + REPORTS + """
time.sleep(120)
""")
    client = FakeClient(prune_at=9)
    make_worker(client, argv).run_trial(make_lease())
    assert [c for c in client.calls if c[0] == "report"] == [("report", 7), ("report", 9)]  # none after prune
    (result,) = client.completed
    assert result["stopped_early"] is True and result["failure"] is None
    assert result["window_throughputs"] == [107.0, 109.0, 111.0]
    assert result["throughput_samples_per_s"] == pytest.approx(statistics.harmonic_mean([107.0, 109.0, 111.0]))
    assert set(result) >= RESULT_KEYS


def test_a_pruned_child_that_stops_cleanly_has_its_own_result_marked_stopped_early(tmp_path: Path) -> None:
    argv = fake_child(tmp_path, """
import json, signal, sys, time
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
print(json.dumps({"type": "report", "step": 7, "metrics": {"throughput": 10.0, "loss": 1.0}}), flush=True)
while not stop:
    time.sleep(0.01)
print(json.dumps({"type": "result", "result": {"workload": "ups", "preset": "tiny", "config": {}, "device": "cpu",
      "torch_version": "x", "throughput_samples_per_s": 10.0, "failure": None, "stopped_early": True}}), flush=True)
""")
    client = FakeClient(prune_at=0)
    make_worker(client, argv).run_trial(make_lease())
    (result,) = client.completed
    assert result["stopped_early"] is True and result["throughput_samples_per_s"] == 10.0


def test_heartbeat_stop_kills_the_child_and_fails_the_trial(tmp_path: Path) -> None:
    argv = fake_child(tmp_path, "import time\ntime.sleep(120)\n")
    client = FakeClient(heartbeat="stop", complete_error=Conflict(409, "already finished", "POST", "/x"))
    started = time.monotonic()
    make_worker(client, argv, heartbeat_s=0.2).run_trial(make_lease())  # a 409 on complete is tolerated
    assert time.monotonic() - started < 10
    assert ("heartbeat", 7) in client.calls and client.calls[-1] == ("complete", 7)
    client = FakeClient(heartbeat="stop")
    make_worker(client, argv, heartbeat_s=0.2).run_trial(make_lease())
    (result,) = client.completed
    assert result["failure"] == {"kind": "error", "message": "stopped by the service: study 'x' was stopped"}


def test_a_409_on_report_drops_the_trial_without_completing(tmp_path: Path) -> None:
    argv = fake_child(tmp_path, REPORTS + "time.sleep(120)\n")
    client = FakeClient(report_error=Conflict(409, "the lease was reaped", "POST", "/v1/trials/7/report"))
    run = make_worker(client, argv).run_trial(make_lease())
    assert run.dropped and "the lease was reaped" in run.dropped
    assert [c[0] for c in client.calls] == ["report"]


def test_reports_are_skipped_while_the_service_is_away(tmp_path: Path) -> None:
    argv = fake_child(tmp_path, REPORTS + """
print(json.dumps({"type": "result", "result": {"workload": "ups", "preset": "tiny", "config": {}, "device": "cpu",
      "torch_version": "x", "failure": None}}), flush=True)
""")
    client = FakeClient(report_error=ServiceUnavailable("http://fake", "ConnectError"))
    make_worker(client, argv).run_trial(make_lease())
    assert len(client.completed) == 1


def test_the_loop_exits_after_max_trials_and_after_idle_exit(tmp_path: Path) -> None:
    argv = fake_child(tmp_path, """
import json
print(json.dumps({"type": "result", "result": {"workload": "ups", "preset": "tiny", "config": {}, "device": "cpu",
      "torch_version": "x", "failure": None}}), flush=True)
""")
    client = FakeClient(leases=[make_lease(trial_id=1), make_lease(trial_id=2), make_lease(trial_id=3)])
    assert make_worker(client, argv, max_trials=2).run() == 0
    assert [c for c in client.calls if c[0] == "complete"] == [("complete", 1), ("complete", 2)]
    client = FakeClient(leases=[make_lease(trial_id=4)])
    started = time.monotonic()
    assert make_worker(client, argv, idle_exit_s=0.5).run() == 0
    assert time.monotonic() - started < 10
    assert client.calls[-1][0] == "lease" and ("complete", 4) in client.calls


def test_child_environment_shares_the_compile_cache_and_limits_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("AUTOTUNE_INDUCTOR_CACHE_DIR", "/tmp/inductor-here")
    env = child_environment(2)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == "/tmp/inductor-here"
    assert env["OMP_NUM_THREADS"] == "2"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/already/set")
    assert child_environment(None)["TORCHINDUCTOR_CACHE_DIR"] == "/already/set"
    assert "OMP_NUM_THREADS" not in child_environment(None, base={})


def test_exit_descriptions_and_grace() -> None:
    assert describe_exit(-9) == "probe process killed by signal 9 (SIGKILL: possibly the OOM killer)"
    assert describe_exit(-11) == "probe process killed by signal 11 (SIGSEGV)"
    assert describe_exit(1) == "probe process exited with code 1 without a result"
    assert 5.0 <= hard_timeout_grace_s(1.0) <= hard_timeout_grace_s(900.0) <= 30.0


def test_probe_process_kill_group_leaves_no_orphans(tmp_path: Path) -> None:
    argv = fake_child(tmp_path, """
import os, subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(grandchild.pid, file=sys.stderr, flush=True)
time.sleep(120)
""")
    child = ProbeProcess(argv, tiny_job(), child_environment(None))
    deadline = time.monotonic() + 20
    while not child.stderr_tail().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    grandchild = int(child.stderr_tail().split()[-1])
    assert is_alive(grandchild)
    child.stop(0.2)
    assert child.poll() is not None
    deadline = time.monotonic() + 5
    while is_alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not is_alive(grandchild)


def test_hardware_is_detected_in_a_child_process_and_the_cpu_without_torch() -> None:
    hardware = detect_hardware("cpu")
    assert hardware.hardware_class == "cpu" and hardware.torch_version == torch.__version__
    assert hardware == detect("cpu")  # as torch itself answers it
    # the worker process never imports torch: the CPU's only question for it, the version, is
    # answered by its installed distribution
    code = ("import sys; from autotune.worker.detect import detect_hardware; h = detect_hardware('cpu'); "
            "print(h.torch_version, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == [torch.__version__, "False"], out.stderr
    with pytest.raises(ValueError, match="unknown device 'tpu'"):  # any other device: asked in a child
        detect_hardware("tpu")
