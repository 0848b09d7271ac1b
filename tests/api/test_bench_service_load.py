"""bench/service_load.py, small: the service under concurrent simulated workers on SQLite and
PostgreSQL, and crash recovery with workers killed mid-probe. The script's own exactly-once
checks must hold (every config leased once and completed by the worker that leased it, none
lost, no repeat told instead of leased), so a change to the service that breaks them, or a
change that leaves the benchmark's checks stale, fails here rather than on the next GPU-less
benchmark run."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import run_bench
from sqlalchemy import Engine

pytestmark = pytest.mark.slow


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return run_bench("service_load.py", *args)  # requires exit 0 (every check of the script held)


def test_concurrent_workers_get_every_config_exactly_once(tmp_path: Path, pg_admin: Engine) -> None:
    out = tmp_path / "load.json"
    proc = _run(["--backends", "sqlite,postgresql", "--samplers", "random,tpe", "--workers", "4", "--trials", "30",
                 "--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "checks ok" in proc.stdout
    runs = json.loads(out.read_text())["runs"]
    assert {(r["backend"], r["sampler"]) for r in runs} == {(b, s) for b in ("sqlite", "postgresql")
                                                            for s in ("random", "tpe")}
    for r in runs:
        c = r["checks"]
        assert c["ok"] and c["configurations"] == 30 and c["repeats"] == 0, (r["backend"], r["sampler"], c)
        assert c["leased"] == c["completed"] == c["study_trials"]  # the re-measurements too
        assert r["database_locked"] == {"responses": 0, "server_log": 0}


def test_killed_workers_trials_are_retried_and_completed(tmp_path: Path, pg_admin: Engine) -> None:
    out = tmp_path / "kills.json"
    proc = _run(["--kills", "--backends", "postgresql", "--workers", "4", "--trials", "30", "--kill-rate", "0.25",
                 "--probe-range", "0.2", "0.5", "--grace-s", "2", "--reaper-interval-s", "0.5", "--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    c = json.loads(out.read_text())["run"]["checks"]
    assert c["ok"] and c["kills"] >= 1 and c["kills_recovered"] == c["kills"], c
    assert c["lost_trials"] == 0 and c["trials_leased_to_two_workers"] == 0 and c["configurations"] == 30
