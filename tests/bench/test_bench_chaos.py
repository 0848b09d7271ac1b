"""bench/chaos.py run small on the CPU: a study on SQLite with two real workers and one kill -9
(seeded), so that the chaos benchmark cannot go stale unnoticed. The script itself exits
non-zero when a measurement was discarded, a trial duplicated or lost, or the study did not
finish; the test reads its JSON as well."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_bench

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("victims", ["service", "worker"])
def test_chaos_kills_once_and_nothing_is_lost_duplicated_or_discarded(tmp_path: Path, victims: str) -> None:
    out = tmp_path / "chaos.json"
    # a lease grace of 5 s (the script's default: 20 s) for a killed worker's trial to be re-run: the
    # workers heartbeat every second, and a restarted service gives every lease one grace from its start
    run_bench("chaos.py", "--backends", "sqlite", "--workers", "2", "--n-trials", "3", "--samples", "120",
              "--kills", "1", "--victims", victims, "--gap", "4,6", "--down", "1,1", "--grace-s", "5",
              "--budget-s", "400", "--out", str(out), cwd=tmp_path, timeout=600)
    (run,) = json.loads(out.read_text())["runs"]
    assert run["finished"] and run["backend"] == "sqlite"
    assert len(run["kills"]) == 1 and run["kills"][0]["victim"].startswith(victims)
    assert run["requested"] == 3 and run["completed"] == 3
    assert run["lost"] == 0 and run["duplicated"] == 0
    assert run["measurements"] >= 3 and run["measurements_discarded"] == 0
    assert run["measurements_in_db"] >= 3
    assert run["worker_tracebacks"] == 0
    assert {t["state"] for t in run["trial_list"]} <= {"COMPLETE", "FAIL"}
