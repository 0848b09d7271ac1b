"""bench/cpu_placement.py on a CPU, tiny preset: the isolated variant really keeps the probe's
loop thread on its own CPU (and the base variant leaves placement to the scheduler)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import run_bench


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux CPU affinity and at least 2 CPUs")
def test_isolated_probes_run_their_loop_on_its_own_cpu(tmp_path: Path) -> None:
    out = tmp_path / "placement.jsonl"
    run_bench("cpu_placement.py", "--config", '{"batch_size": 8, "num_workers": 1}', "--rounds", "1", "--out",
              str(out), "--preset", "tiny", "--device", "cpu", timeout=240)
    topology, base, isolated = (json.loads(line) for line in out.read_text().splitlines())
    assert set(topology["topology"]) == {str(c) for c in os.sched_getaffinity(0)}
    assert (base["variant"], isolated["variant"]) == ("base", "isolated")
    assert base["throughput"] > 0 and isolated["throughput"] > 0 and isolated["failure"] is None
    assert isolated["samples"] > 10
    # pinned from the first sampling tick on: at most the ticks before it ran elsewhere
    assert isolated["loop_on_loop_cpu"] > 0.9 and isolated["loop_migrations"] <= 1
