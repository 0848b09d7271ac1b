"""autotune.engine.compile_workers: TorchInductor's compile-worker pool, started as TorchInductor
starts it when a process loads its first Triton kernel, is quiesced (its worker processes exit) and comes back for a
later job. Real processes: the sidecar and its forked workers, found through /proc."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from autotune.engine.compile_workers import children, cpu_seconds, note, quiesce_compile_workers, summary

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="workers are found through /proc (Linux)")

# TorchInductor's own start-up of the pool (torch/_dynamo/backends/inductor.py → maybe_warm_pool,
# less its "is Triton installed" check: the pool is what is under test, not Triton; this
# machine's CPU build has no Triton kernels to load), then the
# probe's quiesce, then a compile job after it.
SCRIPT = r"""
import json, os, time
import torch._inductor.config as config
config.compile_threads = 3
from torch._inductor.async_compile import AsyncCompile
from autotune.engine.compile_workers import children, quiesce_compile_workers

AsyncCompile.warm_pool()
AsyncCompile.wakeup()
pool = AsyncCompile.process_pool()
sidecar = pool.process.pid
deadline = time.time() + 60
while len(children(sidecar)) < 3 and time.time() < deadline:
    time.sleep(0.05)
before = len(children(sidecar))
done = quiesce_compile_workers(timeout_s=60)
after = len(children(sidecar))
later = pool.submit(os.getpid).result(timeout=60)  # a compile after the windows: the pool comes back
print(json.dumps({"before": before, "done": done, "after": after, "later_pid": later,
                  "sidecar": sidecar, "again": len(children(sidecar))}))
"""


def test_the_compile_pool_is_quiesced_and_comes_back_for_a_later_job() -> None:
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "3"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["before"] == 3  # one sidecar, three forked workers
    done = r["done"]
    assert done["workers"] == 3 and done["left"] == 0 and r["after"] == 0
    assert done["worker_cpu_s"] >= 0 and done["wait_s"] >= 0
    assert r["later_pid"] != r["sidecar"] and r["again"] >= 1  # a worker of a new pool ran it


def test_without_a_pool_nothing_is_done() -> None:
    assert quiesce_compile_workers() is None  # this process never compiled
    assert summary(None) == "-" and note(None) is None
    assert summary({"workers": 0, "worker_cpu_s": 0, "wait_s": 0, "left": 0}) == "-"


def test_the_table_says_what_was_stopped_and_a_note_says_what_was_left() -> None:
    stopped = {"workers": 16, "worker_cpu_s": 4.5, "wait_s": 0.31, "left": 0}
    assert summary(stopped) == "16 stopped after the warm-up in 0.31 s (4.5 CPU-s used)"
    assert summary({**stopped, "ready_wait_s": 2.5}).endswith("used), 2.5 s waited for them to start")
    assert note(stopped) is None  # nothing qualifies the windows
    late = {"workers": 16, "worker_cpu_s": 4.5, "wait_s": 30, "left": 2}
    assert summary(late).endswith("; 2 still running")
    assert note(late) == ("2 of TorchInductor's 16 compile workers ran beside the timed windows: still running "
                          "30 s after they were asked to stop; on a host-bound config they may slow it")
    refused = {**late, "left": 16, "wait_s": 0.0, "error": "no such message"}
    assert "torch refused to quiesce them (no such message)" in (note(refused) or "")


def test_children_and_cpu_seconds_read_real_processes() -> None:
    code = "import time\nwhile time.process_time() < 0.5: pass\ntime.sleep(60)"  # half a CPU-second, then idle
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(2)]
    try:
        deadline = time.time() + 30
        while any(cpu_seconds(p.pid) < 0.3 for p in procs) and time.time() < deadline:
            time.sleep(0.05)
        assert set(children(os.getpid())) >= {p.pid for p in procs}
        assert all(cpu_seconds(p.pid) >= 0.3 for p in procs)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert not {p.pid for p in procs} & set(children(os.getpid()))  # reaped: gone from /proc
    assert cpu_seconds(procs[0].pid) == 0.0


PROBE_SCRIPT = r"""
import json, sys, time
import torch._inductor.config as config
config.compile_threads = 2
from torch._inductor.async_compile import AsyncCompile
from autotune.engine.compile_workers import children
from autotune.contract.config import parse_config
from autotune.engine.probe import ProbeSettings, run_probe

AsyncCompile.warm_pool()  # as loading a first Triton kernel starts it on a GPU host
AsyncCompile.wakeup()
sidecar = AsyncCompile.process_pool().process.pid
deadline = time.time() + 60
while len(children(sidecar)) < 2 and time.time() < deadline:
    time.sleep(0.05)
# 10 steps of 16: 5 warm-up + 5 windows of 1
settings = ProbeSettings(samples=160, windows=5, quiesce_compile_workers=sys.argv[1] == "quiesce")
r = run_probe("ups", parse_config({"batch_size": 16, "accum_steps": 1}), preset="tiny", device="cpu", settings=settings)
from autotune.cli.probe_cmd import print_probe_result
from rich.console import Console
console = Console(record=True, width=200)
print_probe_result(r, console)
print(json.dumps({"ok": r.ok, "compile_workers": r.compile_workers, "notes": r.measurement_notes,
                  "table": console.export_text(),
                  "alive_after": len(children(sidecar))}))
"""


@pytest.mark.parametrize("mode", ["quiesce", "keep"])
def test_a_probe_stops_the_compile_workers_before_its_windows_unless_told_to_keep_them(mode: str) -> None:
    # one intra-op thread, as a worker's probe children run: two spin for cores the pool's processes hold
    out = subprocess.run([sys.executable, "-c", PROBE_SCRIPT, mode], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "2"})
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["ok"]
    if mode == "quiesce":
        assert r["compile_workers"]["workers"] == 2 and r["compile_workers"]["left"] == 0
        assert r["alive_after"] == 0
        assert re.search(r"compile workers\s+│ 2 stopped after the warm-up in", r["table"]), r["table"]
    else:
        assert r["compile_workers"] is None and r["alive_after"] == 2
        assert re.search(r"compile workers\s+│ - ", r["table"]), r["table"]
    assert not any("compile workers" in n for n in r["notes"])  # none left beside the windows: nothing to note


EARLY_SCRIPT = r"""
import json, sys
import torch._inductor.config as config
from torch._inductor.async_compile import AsyncCompile
from autotune.engine.compile_workers import children, quiesce_compile_workers, start_compile_pool

if sys.argv[1] == "early":  # the probe's way: started at setup, waited for, then quiesced
    sidecar = start_compile_pool()
    done = quiesce_compile_workers(timeout_s=120, wait_ready=True)
else:  # a sidecar started but never asked for workers: up, idle, nothing to wait for
    AsyncCompile.warm_pool()
    sidecar = AsyncCompile.process_pool().process.pid
    done = quiesce_compile_workers(timeout_s=120, wait_ready=True)
print(json.dumps({"sidecar": sidecar, "done": done, "after": len(children(sidecar)) if sidecar else None}))
"""


def _early(mode: str, **env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", EARLY_SCRIPT, mode], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "3", **env})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_pool_started_early_is_waited_for_until_its_workers_are_up_then_stopped() -> None:
    r = _early("early")
    done = r["done"]
    assert r["sidecar"] and done["workers"] == 3 and done["left"] == 0 and r["after"] == 0
    assert done["sidecar_cpu_s"] > 0.2  # its start-up: importing torch, in the sidecar, not beside the windows
    assert done["ready_wait_s"] > 0 and done["wait_s"] >= 0


def test_an_idle_sidecar_short_of_workers_is_not_waited_for_until_the_timeout() -> None:
    done = _early("idle")["done"]
    assert done["workers"] == 0 and done["left"] == 0
    assert done["ready_wait_s"] < 100  # it went idle once up: the 120 s timeout was not waited out


@pytest.mark.parametrize("env", [{"TORCH_WARM_POOL": "0"}, {"TORCHINDUCTOR_COMPILE_THREADS": "1"}])
def test_no_pool_is_started_where_torchinductor_would_start_none(env: dict[str, str]) -> None:
    r = _early("early", **env)
    assert r["sidecar"] is None and r["done"] is None
