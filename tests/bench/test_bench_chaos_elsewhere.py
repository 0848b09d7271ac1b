"""bench/chaos.py --restart-elsewhere (issue 35, deliverable 8) run small on the CPU: the service
killed mid-study and restarted on a copy of its SQLite database (the same tokens and service id),
where a study of the same name hands out the same trial ids, numbers and configs, then back on
the first database. With one worker the hazard comes every run: it holds the first database's
result of trial id N while the copy leases it trial id N of the study of the same name. The
script exits non-zero on a misdelivered result, a re-run trial or a discarded measurement; the
test reads its JSON as well.

The counting itself (`count_elsewhere`) is tested on hand-built logs, trials, lease rows and
spool files, so that a misdelivery and a re-run *would* be counted."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT, run_bench

sys.path.insert(0, str(ROOT / "bench"))
from chaos import count_elsewhere  # a bench script (bench/ is not a package)


@pytest.mark.slow
def test_a_restart_onto_a_copy_of_the_database_misdelivers_and_reruns_nothing(tmp_path: Path) -> None:
    out = tmp_path / "chaos_elsewhere.json"
    run_bench("chaos.py", "--restart-elsewhere", "--backends", "sqlite", "--workers", "1", "--n-trials", "3",
              "--samples", "600", "--down", "1,1", "--grace-s", "10", "--elsewhere-s", "40", "--budget-s", "200",
              "--out", str(out), cwd=tmp_path, timeout=300)
    (run,) = json.loads(out.read_text())["runs"]
    assert run["scenario"] == "restart-elsewhere" and run["backend"] == "sqlite"
    assert run["finished"] and run["same_service_id"] and run["conditions_met"] == {"A": True, "B": True}
    assert [p["event"] for p in run["phases"]][:5] == [f"### chaos: service on {db} {what}" for db, what in (
        ("A", "started"), ("A", "killed"), ("B", "started"), ("B", "killed"), ("A", "started"))]
    assert run["misdelivered"] == 0 and run["re_run"] == 0
    assert run["measurements_discarded"] == 0 and run["b_discarded"] == 0
    assert run["unmatched"] == 0 and run["misattributed"] == 0
    assert run["requested"] == 3 and run["completed"] == 3 and run["lost"] == 0 and run["duplicated"] == 0
    assert run["leases_run"]["A"] >= 2 and run["leases_run"]["B"] >= 2 and run["completes_checked"] >= 4
    # the hazard happened: the worker leased on the copy a trial id and number of `rel` that it had measured on A
    assert run["twin_leases"] >= 1
    assert run["worker_tracebacks"] == 0


# --- the counting, on hand-built inputs ----------------------------------------------------------

def log(*lines: str) -> str:
    return "\n".join(lines) + "\n"


A_UP, A_DOWN = "### chaos: service on A started at 0.0 s", "### chaos: service on A killed at 9.0 s"
B_UP, B_DOWN = "### chaos: service on B started at 10.0 s", "### chaos: service on B killed at 19.0 s"
A_AGAIN = "### chaos: service on A started at 20.0 s"


def scenario() -> dict[str, Any]:
    """One worker: trial id 2 of rel on A is in flight at the kill, measured (300.0) while B is up and
    kept; B leases it trial id 2 of its rel (a twin: another lease), measured 250.0 and completed
    there; back on A, the kept result is delivered. Everything where it belongs."""
    logs = {"worker0": log(
        A_UP, "", "=== start 0 ===", "autotune worker w0",
        "▶ trial 0 of rel (id 1) (baseline): batch_size=4",
        "  trial 0 (5.0 s): 200.0 samples/s · NRMSE 0.9 · warm-up 0.1 s",
        "  trial 0 → COMPLETE · feasible",
        "▶ trial 1 of rel (id 2): batch_size=8",
        A_DOWN, B_UP,
        "  trial 1 (2.0 s): 300.0 samples/s · NRMSE 1.0 · warm-up 0.1 s",
        "  trial 1: not delivered: ... The result is kept in /spool/trial-2-aaaa.json",
        "▶ trial 0 of rel (id 1) (baseline): batch_size=4",
        "  trial 0 (2.0 s): 210.0 samples/s · NRMSE 0.9 · warm-up 0.1 s",
        "▶ trial 1 of rel (id 2): batch_size=8",
        "  trial 1 (2.0 s): 250.0 samples/s · NRMSE 1.0 · warm-up 0.1 s",
        "  trial 1 → COMPLETE · feasible",
        B_DOWN, A_AGAIN,
        "  trial 1 of rel (id 2): measured already, its result is in the spool: delivering it instead",
        "  spooled result of trial 1 of rel (id 2) delivered → COMPLETE · feasible",
        "waiting for trials…")}

    def trial(trial_id: int, x: float) -> dict[str, Any]:
        return {"trial_id": trial_id, "number": trial_id - 1, "state": "COMPLETE", "worker_id": "w0",
                "throughput_samples_per_s": x}

    trials = {"A": {"rel": [trial(1, 200.0), trial(2, 300.0)]}, "B": {"rel": [trial(1, 210.0), trial(2, 250.0)],
                                                                      "other": []}}
    leases = {db: [{"trial_id": i, "study": "rel", "number": i - 1, "worker_id": "w0", "token": f"{db}{i}"}
                   for i in (1, 2)] for db in ("A", "B")}
    snapshots = [{"worker_id": "w0", "study": "rel", "trial_id": 2, "number": 1, "lease_token": "A2",
                  "result": {"throughput_samples_per_s": 300.0123}, "folder": "pending"}]
    trials["A"]["rel"][1]["throughput_samples_per_s"] = 300.0123  # as the spool held it, exactly
    return {"logs": logs, "trials": trials, "leases": leases, "snapshots": snapshots}


def test_count_elsewhere_counts_nothing_when_every_result_is_where_it_was_leased() -> None:
    counts = count_elsewhere(**scenario())
    assert counts["misdelivered"] == 0 and counts["re_run"] == 0
    assert counts["unmatched"] == 0 and counts["misattributed"] == 0 and counts["spooled_unplaced"] == []
    assert counts["completes_checked"] == 4 and counts["leases_run"] == {"A": 2, "B": 2}
    assert counts["twin_leases"] == 2  # B's trial ids 1 and 2 of rel: the worker had measured both on A
    assert counts["measurements_logged"] == 4 and counts["measurements_spooled_seen"] == 1


def test_count_elsewhere_counts_a_result_stored_in_another_databases_trial() -> None:
    # B's trial id 2 holds A's measurement of trial id 2 (the kept result delivered to the twin lease)
    s = scenario()
    s["trials"]["B"]["rel"][1]["throughput_samples_per_s"] = 300.0123
    counts = count_elsewhere(**s)
    assert counts["misdelivered"] == 1 and counts["re_run"] == 0
    (wrong,) = counts["misdelivered_list"]
    assert (wrong["db"], wrong["study"], wrong["trial_id"]) == ("B", "rel", 2)
    assert wrong["measured_for"] == ["A/rel/id 2 (spool)"]
    # the same from the log alone (printed to 0.1), when no spool snapshot caught the file
    s = scenario()
    s["snapshots"] = []
    s["trials"]["A"]["rel"][1]["throughput_samples_per_s"] = 300.01
    s["trials"]["B"]["rel"][1]["throughput_samples_per_s"] = 300.03
    counts = count_elsewhere(**s)
    assert counts["misdelivered"] == 1 and counts["misdelivered_list"][0]["measured_for"] == ["A/rel/id 2 (log)"]
    # another study: B's `other` holds a result of A's trial id 2
    s = scenario()
    s["trials"]["B"]["other"] = [{"trial_id": 2, "number": 0, "state": "COMPLETE", "worker_id": "w0",
                                  "throughput_samples_per_s": 300.0123}]
    counts = count_elsewhere(**s)
    assert counts["misdelivered"] == 1 and counts["misdelivered_list"][0]["study"] == "other"
    # a value no measurement of its worker gives is unmatched, not misdelivered
    s = scenario()
    s["trials"]["B"]["rel"][0]["throughput_samples_per_s"] = 999.0
    counts = count_elsewhere(**s)
    assert counts["misdelivered"] == 0 and counts["unmatched"] == 1


def test_count_elsewhere_counts_a_lease_run_again_after_its_measurement_or_delivery() -> None:
    base = scenario()
    # back on A, trial id 2 leased and run again after its kept result was delivered
    s = copy.deepcopy(base)
    s["logs"]["worker0"] += log("▶ trial 1 of rel (id 2): batch_size=8",
                                "  trial 1 (2.0 s): 280.0 samples/s · NRMSE 1.0 · warm-up 0.1 s")
    counts = count_elsewhere(**s)
    assert counts["re_run"] == 1 and counts["misdelivered"] == 0
    assert counts["re_run_list"][0] == {"worker": "worker0", "process": 0, "worker_id": "w0", "db": "A",
                                        "study": "rel", "trial_id": 2, "number": 1}
    # on B, the twin of a trial B had completed already: B's own trial run again
    s = copy.deepcopy(base)
    s["logs"]["worker0"] = s["logs"]["worker0"].replace(B_DOWN, "▶ trial 1 of rel (id 2): batch_size=8\n" + B_DOWN)
    counts = count_elsewhere(**s)
    assert counts["re_run"] == 1 and counts["re_run_list"][0]["db"] == "B"
    # a new process of the worker (another worker id) leasing it is not a re-run by that process
    s = copy.deepcopy(base)
    s["logs"]["worker0"] += log("", "=== start 1 ===", "autotune worker w0b", "▶ trial 1 of rel (id 2): batch_size=8")
    counts = count_elsewhere(**s)
    assert counts["re_run"] == 0 and counts["misattributed"] == 1  # A's trial id 2 is w0's, not w0b's
