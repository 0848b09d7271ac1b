"""bench/probe_loop_gap.py, small on a CPU: one config of the gpt_script job timed by
`autotune probe` and by the script's own loop (bench/gpt_script_verdict.py's loop child), each in
a fresh process, both traced once; the JSON holds each run, the ratio to the loop and both
traces' summaries (the loop's steps named as the probe names them, so one reader sums both)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import probe_loop_gap as gap  # a bench script (bench/ is not a package)


def test_probe_and_loop_are_timed_and_both_traces_summarized(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("batch_size: 8\naccum_steps: 1\nfused_optimizer: true\n")
    out = tmp_path / "gap.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "probe_loop_gap.py"), "--job", "gpt_script", "--device", "cpu",
         "--config", str(config), "--samples", "256", "--variants", "probe,loop", "--repeats", "1",
         "--loop-iters", "40", "--loop-warmup-iters", "12", "--trace-warmup", "8", "--trace-steps", "3",
         "--timeout", "120", "--workdir", str(tmp_path / "work"), "--trace-dir", str(tmp_path / "traces"),
         "--cpus", "0", "--out", str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(out.read_text())
    runs = {r["variant"]: r for r in doc["runs"]}
    assert set(runs) == {"probe-traced", "loop"}  # the first repeat's probe is the traced one
    assert runs["probe-traced"]["warmup_steps"] == 8 and runs["probe-traced"]["samples"] == 256
    assert len(runs["probe-traced"]["window_throughputs"]) >= 5
    # the script keeps its samples under a config: batch 8 against its own 16 runs twice the iterations
    assert runs["loop"]["iterations"] == 80 and runs["loop"]["per_iteration_ms"]["apply_step"] > 0
    assert doc["settings"]["cpus"] == [0]  # the harness, its fork server and the loop ran on CPU 0 only
    assert doc["summary"]["loop"]["over_loop"] == 1.0
    assert doc["summary"]["probe-traced"]["over_loop"] > 0
    # the loop traced 3 warm-up iterations with the probe's range names: one reader for both
    assert doc["traces"]["loop"]["steps"] == 3 and doc["traces"]["probe"]["steps"] == 3
    assert doc["traces"]["loop"]["data_wait_ms"] is not None
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == [
        "gpt_script_loop.trace.json.gz", "gpt_script_probe.trace.json.gz"]
    assert "| loop |" in done.stdout and "loop trace: 3 steps" in done.stdout


def test_the_ratio_to_the_loop_has_its_interval_once_both_sides_have_two_runs() -> None:
    runs = [{"variant": "probe", "throughput": t} for t in (100.0, 104.0)] + [
        {"variant": "loop", "throughput": t} for t in (98.0, 102.0)] + [{"variant": "probe-long", "throughput": 90.0}]
    summary = gap.summary(runs)
    low, high = summary["probe"]["ci95"]
    assert low < summary["probe"]["geomean_over_loop"] < high
    assert abs(summary["probe"]["geomean_over_loop"] - (100 * 104) ** 0.5 / (98 * 102) ** 0.5) < 1e-9
    assert "ci95" not in summary["probe-long"]  # one run: no spread of its own
    assert summary["probe-long"]["over_loop"] == 90.0 / 100.0


def test_cpus_take_tasksets_list_form_and_refuse_what_the_host_lacks() -> None:
    assert gap.cpu_list("0") == {0}
    assert gap.cpu_list("0-0,0") == {0}
    for bad, says in (("a-b", "expected CPU numbers"), ("100000", "name some of those")):
        try:
            gap.cpu_list(bad)
        except SystemExit as exc:
            assert says in str(exc)
        else:
            raise AssertionError(f"--cpus {bad} was taken")
