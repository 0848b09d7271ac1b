"""bench/cpu_placement.py on a CPU, tiny preset: the isolated variant really keeps the probe's
loop thread on its own CPU (and the base variant leaves placement to the scheduler)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux CPU affinity and at least 2 CPUs")
def test_isolated_probes_run_their_loop_on_its_own_cpu(tmp_path: Path) -> None:
    out = tmp_path / "placement.jsonl"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "cpu_placement.py"), "--config",
                           '{"batch_size": 8, "num_workers": 1}', "--rounds", "1", "--out", str(out),
                           "--preset", "tiny", "--device", "cpu"],
                          capture_output=True, text=True, timeout=240, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    topology, base, isolated = (json.loads(line) for line in out.read_text().splitlines())
    assert set(topology["topology"]) == {str(c) for c in os.sched_getaffinity(0)}
    assert (base["variant"], isolated["variant"]) == ("base", "isolated")
    assert base["throughput"] > 0 and isolated["throughput"] > 0 and isolated["failure"] is None
    assert isolated["samples"] > 10
    # pinned from the first sampling tick on: at most the ticks before it ran elsewhere
    assert isolated["loop_on_loop_cpu"] > 0.9 and isolated["loop_migrations"] <= 1
