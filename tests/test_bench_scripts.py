"""The GPU benchmarks' drivers, run small on a CPU so that they cannot go stale unnoticed
between GPU sessions (their figures come from the same code on a lent GPU): probe_configs.py
with report_probe.py, pruning.py's study and analysis, window_cost.py, host_speed.py, warmup_length.sh,
compile_pool.sh, host_top.py, probe_speed.py, step_graph.py, ddp.py and optimizer_step.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, run_bench

pytestmark = pytest.mark.slow


def _run(script: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return run_bench(script, *args, cwd=cwd)


def test_probe_configs_probes_each_config_in_its_own_process_and_reports_them(tmp_path: Path) -> None:
    out = tmp_path / "probes.json"
    _run("probe_configs.py", ["--preset", "tiny", "--device", "cpu", "--samples", "640", "--repeats", "1",
                              "--configs", '{"small": {"batch_size": 8}, "large": {"batch_size": 16}}',
                              "--out", str(out)], tmp_path)
    runs = json.loads(out.read_text())["runs"]
    assert [(r["name"], r["config"]["batch_size"]) for r in runs] == [("small", 8), ("large", 16)]
    assert all(r["failure"] is None and r["throughput_samples_per_s"] > 0 and r["samples_trained"] == 640
               for r in runs)
    png = tmp_path / "probes.png"
    table = _run("report_probe.py", [str(out), "--png", str(png)], tmp_path).stdout
    assert "| small |" in table and "| large |" in table and png.stat().st_size > 0


def test_pruning_study_runs_on_the_service_and_is_analyzed(tmp_path: Path) -> None:
    run = tmp_path / "study"
    # the budget is a ceiling only: the study ends when its 5 trials are done, however slow the host
    _run("pruning.py", ["study", "--dir", str(run), "--budget-s", "280", "--device", "cpu", "--space", "cpu",
                        "--preset", "tiny", "--samples", "1024", "--n-trials", "5"], tmp_path)
    out = tmp_path / "pruning.json"
    _run("pruning.py", ["analyze", "--dir", str(run), "--out", str(out)], tmp_path)
    doc = json.loads(out.read_text())
    summary = doc["summary"]
    assert summary["trials"] == len(doc["trials"]) >= 5 and summary["failed"] == 0
    assert len(summary["baseline_nrmse"]) == 3 and summary["gate_nrmse"] > 0
    assert summary["pruned"] == len(doc["pruned"]) and summary["gpu_s_spent"] > 0


def test_window_cost_times_the_same_steps_each_way_in_mirrored_rounds(tmp_path: Path) -> None:
    out = tmp_path / "window_cost.jsonl"
    _run("window_cost.py", ["--config", '{"batch_size": 8, "accum_steps": 1}', "--preset", "tiny", "--device", "cpu",
                            "--rounds", "2", "--windows", "3", "--per", "4", "--out", str(out)], tmp_path)
    env, result = (json.loads(line) for line in out.read_text().splitlines())
    assert env["environment"]["device"] == "cpu"
    blocks = result["blocks"]
    order = ["one", "windows", "sync", "events"]
    assert [b["variant"] for b in blocks] == order + order[::-1]  # the second round mirrored
    assert all(b["steps"] == 12 and b["seconds"] > 0 for b in blocks)
    # every variant but `one` times each window, and the windows add up to the block
    for b in blocks:
        assert len(b["window_s"]) == (0 if b["variant"] == "one" else 3)
        assert b["window_s"] == [] or abs(sum(b["window_s"]) - b["seconds"]) < 1e-9
    assert result["over_one"]["one"] == 1.0 and set(result["paired_over_one"]) == set(order)
    assert result["rates"]["windows"] == 2 * 12 * 8 / sum(b["seconds"] for b in blocks if b["variant"] == "windows")


def test_host_speed_samples_the_host_and_sets_each_probe_beside_it(tmp_path: Path) -> None:
    speed = tmp_path / "speed.jsonl"
    _run("host_speed.py", ["sample", "--seconds", "0.5", "--every", "0.05", "--chunk", "1000", "--out", str(speed)],
         tmp_path)
    samples = [json.loads(line) for line in speed.read_text().splitlines()]
    assert len(samples) >= 5 and all(s["s"] > 0 for s in samples)
    assert [s["t"] for s in samples] == sorted(s["t"] for s in samples)
    # a fidelity run's probes, by when they ran: one over the first samples, one after them all
    t0, t1 = samples[0]["t"], samples[-1]["t"]
    probe = {"throughput_samples_per_s": 100.0}
    doc = {"prime": [{"probe": {**probe, "started": t0, "wall_s": t1 - t0}}],
           "configs": [{"round": 0, "short": {**probe, "started": t1 + 10, "wall_s": 1.0},
                        "long": {**probe, "started": t0, "wall_s": (t1 - t0) / 2}}]}
    fidelity = tmp_path / "fidelity.json"
    fidelity.write_text(json.dumps(doc))
    lines = _run("host_speed.py", ["beside", "--speed", str(speed), "--fidelity", str(fidelity)], tmp_path).stdout
    prime, short, long = lines.splitlines()
    assert prime.startswith("prime") and "host chunk" in prime and " ms (second half " in prime
    assert short.startswith("short  round 0") and "host chunk - (second half -)" in short  # no sample then
    assert long.startswith("long   round 0") and "host chunk -" not in long


def test_warmup_length_times_the_same_windows_later_in_the_process(tmp_path: Path) -> None:
    out = tmp_path / "warmup.jsonl"
    env = {**os.environ, "PRESET": "tiny", "DEVICE": "cpu", "SAMPLES": "320", "PYTHONPATH": str(ROOT),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "warmup_length.sh"), str(out), '{"batch_size": 8}', "1", "20"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["variant"], r["round"]) for r in rows] == [("prime", -1), ("default", 0), ("late", 0)]
    prime, default, late = (r["result"] for r in rows)
    assert prime["warmup_steps"] == default["warmup_steps"] < late["warmup_steps"] == 20
    # the same timed windows, later: as many windows of as many steps
    assert (late["window_steps"], len(late["window_throughputs"])) == (
        default["window_steps"], len(default["window_throughputs"]))
    assert late["samples_trained"] == 320 + (20 - default["warmup_steps"]) * default["config"]["effective_batch"]


def test_compile_pool_runs_its_three_variants(tmp_path: Path) -> None:
    out = tmp_path / "pool.jsonl"
    env = {**os.environ, "PRESET": "tiny", "DEVICE": "cpu", "SAMPLES": "320", "PYTHONPATH": str(ROOT),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "TOP": "1"}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "compile_pool.sh"), str(out), '{"batch_size": 8}', "1"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["variant"], r["round"]) for r in rows] == [
        ("prime", -1), ("keep", 0), ("quiesce", 0), ("threads1", 0)]
    for r in rows:
        assert r["result"]["failure"] is None and r["result"]["samples_trained"] == 320
        assert all(w["host_busy_fraction"] is not None for w in r["result"]["window_host"])
    assert "keep 0" in proc.stdout and "host busy" in proc.stdout
    for variant, rnd in [("prime", -1), ("keep", 0), ("quiesce", 0), ("threads1", 0)]:  # TOP=1: under host_top
        summary = json.loads((tmp_path / f"pool.top.{variant}.{rnd}.jsonl").read_text().splitlines()[-1])
        assert any(r["relation"] == "self" and "autotune.cli probe" in r["command"] for r in summary["summary"])


def test_host_top_names_the_processes_and_threads_that_used_the_cpus(tmp_path: Path) -> None:
    """A command whose child process spins and whose own second thread spins: both are seen,
    as the command's descendant and as a thread of it, with the CPU time they used."""
    out = tmp_path / "top.jsonl"
    script = ("import subprocess, sys, threading, time\n"
              "def spin(s):\n    t = time.time()\n    while time.time() - t < s: pass\n"
              "threading.Thread(target=spin, args=(2.5,), name='spinner').start()\n"
              "subprocess.run([sys.executable, '-c', 'import time\\nt = time.time()\\n"
              "while time.time() - t < 2.5: pass'])\n")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "host_top.py"), "--out", str(out),
                           "--interval", "0.5", "--", sys.executable, "-c", script],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    samples, summary = lines[:-1], lines[-1]["summary"]
    child = [r for r in summary if r["relation"] == "descendant"]
    assert child and child[0]["cpu_s"] >= 1.0, summary
    command = next(r["pid"] for r in summary if r["relation"] == "self")
    assert any(t["pid"] == command and t["tid"] != command and t["cpus"] >= 0.5  # the spinning thread
               for s in samples for t in s["threads"]), samples
    assert any(s["host_busy_cpus"] >= 1.0 for s in samples)
    assert "CPU-s  descendant" in proc.stderr


def test_host_speed_maps_every_cpu_and_times_one_cpu_as_others_spin(tmp_path: Path) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    out = _run("host_speed.py", ["map", "--seconds", "0.3", "--every", "0.05", "--chunk", "2000",
                                 "--out", str(tmp_path / "map.jsonl")], tmp_path).stdout
    rows = [json.loads(line) for line in (tmp_path / "map.jsonl").read_text().splitlines()]
    sweeps = {r["sweep"] for r in rows}
    assert len(sweeps) >= 2 and all(sorted(r["cpu"] for r in rows if r["sweep"] == s) == cpus for s in sweeps)
    assert "slowest/fastest CPU within a sweep" in out and all(f"{c:3d}  " in out for c in cpus)
    out = _run("host_speed.py", ["scaling", "--levels", "1,2", "--hold", "0.2", "--rounds", "2", "--chunk", "2000",
                                 "--cpu", str(cpus[0]), "--out", str(tmp_path / "scaling.jsonl")], tmp_path).stdout
    rows = [json.loads(line) for line in (tmp_path / "scaling.jsonl").read_text().splitlines()]
    assert [(r["round"], r["busy_cpus"]) for r in rows] == [(0, 1), (0, 2), (1, 2), (1, 1)]  # mirrored
    assert all(r["pieces"] > 0 and r["median_s"] > 0 for r in rows) and "1 busy CPUs" in out
    assert not [p for p in subprocess.run(["pgrep", "-f", "while True: pass"], capture_output=True,
                                          text=True).stdout.split()]  # the spinners are gone


def test_probe_speed_times_fixed_host_work_around_each_probe_process(tmp_path: Path) -> None:
    out = tmp_path / "speed.jsonl"
    proc = _run("probe_speed.py", ["--config", '{"batch_size": 8}', "--preset", "tiny", "--device", "cpu",
                                   "--samples", "320", "--runs", "2", "--out", str(out)], tmp_path)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["run"], r["prime"]) for r in rows] == [(0, True), (1, False)]
    assert rows[0]["started"] < rows[0]["ended"] <= rows[1]["started"] < rows[1]["ended"]
    for r in rows:
        assert r["failure"] is None and r["throughput"] > 0
        assert all(r[side][k] > 0 for side in ("before", "after") for k in ("python_ms", "copy_ms", "dispatch_us"))
        assert "launch_us" not in r["before"]  # a CPU run launches no CUDA kernels
        assert r["loop_cpu_ms_per_step"] > 0
    assert "run 1: " in proc.stdout and "(before/after)" in proc.stdout


def test_step_graph_pairs_each_config_off_and_on(tmp_path: Path) -> None:
    out = tmp_path / "graph.jsonl"
    printed = _run("step_graph.py", ["--preset", "tiny", "--device", "cpu", "--samples", "320", "--out", str(out),
                                     "--config", '{"batch_size": 8}'], tmp_path).stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["knobs"]["step_graph"] for r in rows] == [False, True]
    assert rows[0]["step_graph"] == "off" and rows[1]["step_graph"].startswith("inactive on cpu")
    assert all(r["failure"] is None and r["throughput"] > 0 for r in rows) and "samples/s, NRMSE" in printed
    assert rows[0]["val_nrmse"] == rows[1]["val_nrmse"]  # inactive: the same training
    sys.path.insert(0, str(ROOT / "bench"))
    from step_graph import graphed  # the bench script (bench/ is not a package)

    assert graphed({"compile": "reduce-overhead", "batch_size": 8}) == {"compile": "default", "batch_size": 8,
                                                                         "step_graph": True}
    assert graphed({"compile": "none"}) == {"compile": "none", "step_graph": True}


def test_ddp_runs_one_and_two_rank_probes_as_the_worker_launches_them(tmp_path: Path) -> None:
    out = tmp_path / "ddp.json"
    _run("ddp.py", ["--device", "cpu", "--preset", "tiny", "--only", "1gpu-accum1,2gpu-accum1-bucket25",
                    "--out", str(out)], tmp_path)
    doc = json.loads(out.read_text())
    assert [(r["name"], r["gpus"]) for r in doc["rows"]] == [("1gpu-accum1", 1), ("2gpu-accum1-bucket25", 2)]
    one, two = (r["result"] for r in doc["results"])
    assert (one["world_size"], two["world_size"]) == (1, 2) and two["knobs"]["parallel"] == "ddp: 2 ranks (gloo)"
    assert two["config"]["bucket_cap_mb"] == 25.0 and one["samples_trained"] == two["samples_trained"] == 384
    single, pair = doc["rows"]
    assert pair["scaling_efficiency"] == pytest.approx(pair["throughput"] / (2 * single["throughput"]), abs=1e-4)
    assert out.with_suffix(".png").stat().st_size > 0
    refused = subprocess.run([sys.executable, str(ROOT / "bench" / "ddp.py"), "--only", "3gpu", "--out",
                              str(tmp_path / "x.json")], capture_output=True, text=True, cwd=tmp_path,
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120, check=False)
    assert refused.returncode == 2 and "--only: no case named 3gpu; the cases are 1gpu-accum1," in refused.stderr


def test_optimizer_step_runs_the_probe_and_the_apply_loop_and_tables_them(tmp_path: Path) -> None:
    """The user's-step benchmark on a CPU: probe_configs.py for both ups optimizers, then
    optimizer_step.py's mirrored probe / apply loop / probe and its table and chart."""
    configs = '{"baseline": {"batch_size": 4, "accum_steps": 2}, "b8": {"batch_size": 8, "accum_steps": 1}}'
    probes = []
    for preset in ("tiny", "tiny-muon"):
        out = tmp_path / f"{preset}.json"
        _run("probe_configs.py", ["--preset", preset, "--device", "cpu", "--samples", "320", "--repeats", "1",
                                  "--configs", configs, "--out", str(out)], tmp_path)
        probes.append(str(out))
    loop = tmp_path / "loop.json"
    _run("optimizer_step.py", ["loop", "--preset", "tiny-muon", "--device", "cpu", "--samples", "320",
                               "--config", '{"batch_size": 8, "accum_steps": 1}', "--seconds", "1",
                               "--warmup-steps", "2", "--out", str(loop)], tmp_path)
    doc = json.loads(loop.read_text())
    assert [r["kind"] for r in doc["runs"]] == ["probe", "loop", "probe"]
    looped = doc["runs"][1]
    assert looped["steps"] > 0 and looped["throughput_samples_per_s"] > 0
    assert looped["notes"]["grad_clip"].startswith("max norm 1 ")  # the workload's clipping, through apply
    assert looped["notes"]["fused_optimizer"].startswith("Muon: inactive")  # the workload's own hybrid
    assert doc["probe_over_loop"] > 0
    png = tmp_path / "step.png"
    table = _run("optimizer_step.py", ["table", "--probes", *probes, "--loops", str(loop), "--png", str(png)],
                 tmp_path).stdout
    assert "| baseline | " in table and "| b8 | " in table and "tiny-muon: samples/s" in table
    assert "tiny-muon, apply loop" in table and png.stat().st_size > 0
