"""The GPU benchmarks' drivers, run small on a CPU so that they cannot go stale unnoticed
between GPU sessions (their figures come from the same code on a lent GPU): probe_configs.py
with report_probe.py, and pruning.py's study and analysis."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import run_bench

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
    _run("pruning.py", ["study", "--dir", str(run), "--budget-s", "90", "--device", "cpu", "--space", "cpu",
                        "--preset", "tiny", "--samples", "1024", "--n-trials", "5"], tmp_path)
    out = tmp_path / "pruning.json"
    _run("pruning.py", ["analyze", "--dir", str(run), "--out", str(out)], tmp_path)
    doc = json.loads(out.read_text())
    summary = doc["summary"]
    assert summary["trials"] == len(doc["trials"]) >= 5 and summary["failed"] == 0
    assert len(summary["baseline_nrmse"]) == 3 and summary["gate_nrmse"] > 0
    assert summary["pruned"] == len(doc["pruned"]) and summary["gpu_s_spent"] > 0
