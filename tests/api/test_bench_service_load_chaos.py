"""bench/service_load.py --kills with the chaos of issue 35 (deliverables 7 and 8): simulated
workers that heartbeat, some of which first complete with a config other than the leased one,
and a kill -9 of the service mid-study (restarted on the same database and port). Run tiny on
PostgreSQL, the script's own checks must hold (it exits non-zero otherwise): nothing lost,
duplicated or discarded, every mismatched complete refused and none of its values stored.

The checks themselves are tested on hand-built database rows and fleet records, so that a
duplicate, a lost trial, a discarded measurement or a stored mismatch *would* be counted."""

from __future__ import annotations

import json
import sys
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT, run_bench
from sqlalchemy import Engine

from autotune.api.outcome import config_differences, config_key_problems, preset_values

sys.path.insert(0, str(ROOT / "bench"))
import service_load  # a bench script (bench/ is not a package)
from service_load import Chaos, config_checks, discarded_measurements, kill_checks, mismatched_config

T0 = datetime(2026, 11, 27, 12, 0, 0)


@pytest.mark.slow
def test_heartbeats_mismatches_and_a_service_kill_lose_duplicate_and_discard_nothing(tmp_path: Path,
                                                                                      pg_admin: Engine) -> None:
    """4 workers, 10 configurations, a quarter of the attempts killed mid-probe, a third of the
    completes mismatched first (and the 3 baselines'), one kill -9 of the service down for 1 s.
    Grace 3 s with a 1 s backoff cap: a restart on a busy 2-core host takes 1-3 s, and a worker
    must get its retried complete in within the grace that the restarted service gives every
    lease (a 10 s cap, the real worker's, needs a longer grace: the benchmark's own runs)."""
    out = tmp_path / "chaos.json"
    run_bench("service_load.py", "--kills", "--backends", "postgresql", "--workers", "4", "--trials", "10",
              "--kill-rate", "0.25", "--max-retries", "10", "--probe-range", "0.4", "1.0", "--grace-s", "3",
              "--reaper-interval-s", "0.5", "--heartbeat-s", "0.3", "--mismatch-rate", "0.3", "--kill-service", "1",
              "--down-range", "1", "1", "--max-backoff-s", "1", "--out", str(out), timeout=180)
    run = json.loads(out.read_text())["run"]
    c = run["checks"]
    assert c["ok"] and c["study_finished"] and c["configurations"] == 10, c
    assert run["counts"]["lost"] == 0 and run["counts"]["duplicated"] == 0, c
    assert run["counts"]["measurements_discarded"] == 0 and c["measurements"] >= 10, c
    # every mismatched complete refused (422, the config check), none stored; the baselines' included
    assert c["mismatched_sent"] >= 3 and c["mismatched_refused"] == c["mismatched_sent"], c
    assert set(c["mismatched_by_status"]) == {"422"} and c["mismatched_stored"] == 0, c
    assert "preset-left lr set" in c["mismatched_by_kind"], c
    # every trial a worker got a lease for holds the leased config; the rest (a lease answer that
    # died with the service, or never leased) are orphans the reaper failed, never COMPLETE
    assert c["stored_config_differs_from_lease"] == 0 and c["unseen_unexplained"] == 0, c
    assert c["configs_checked"] + c["trials_no_worker_saw"] == c["trials"], c
    assert c["server_errors_5xx"] == 0 and run["server"]["log_tracebacks"] == 0
    # heartbeats were sent and answered; the service was killed once and came back
    assert run["heartbeats"]["answered"] > 0 and run["latency_ms"]["heartbeat"]["p50"] is not None
    (restart,) = run["service_restarts"]
    assert c["service_kills"] == 1 and run["server"]["incarnations"] == 2
    assert restart["restart_to_first_lease_s"] is not None and restart["restart_to_first_complete_s"] is not None
    assert c["kills"] == c["kills_recovered"]


# --- the checks, on hand-built inputs ----------------------------------------------------------------

def _trial(tid: int, number: int, state: str = "COMPLETE", worker: str | None = "w1", throughput: float = 100.0,
           config: dict[str, Any] | None = None, **attrs: Any) -> dict[str, Any]:
    a: dict[str, Any] = {"role": "search", "worker_id": worker, "config": config or {"batch_size": 8, "lr": 0.001}}
    if state == "COMPLETE":
        a["throughput_samples_per_s"] = throughput
    return {"trial_id": tid, "number": number, "state": state, "attrs": {**a, **attrs}}


def _lease(tid: int, number: int, worker: str, start_s: float, end_s: float | None,
           outcome: str = "completed") -> dict[str, Any]:
    return {"trial_id": tid, "number": number, "worker": worker, "state": "active" if end_s is None else "ended",
            "outcome": None if end_s is None else outcome, "leased_at": T0 + timedelta(seconds=start_s),
            "finished_at": None if end_s is None else T0 + timedelta(seconds=end_s)}


def _world() -> tuple[dict[str, Any], Chaos]:
    """Two configurations, each leased once and completed by the worker that leased it, and the
    fleet's matching records: every check holds."""
    config = {"batch_size": 8, "lr": 0.001}
    trials = {1: _trial(1, 0, worker="w1", throughput=101.0, config=config),
              2: _trial(2, 1, worker="w2", throughput=202.0, config=config)}
    leases = {1: _lease(1, 0, "w1", 0, 1), 2: _lease(2, 1, "w2", 0, 1)}
    chaos = Chaos()
    for tid, w, thr in ((1, "w1", 101.0), (2, "w2", 202.0)):
        chaos.leases[tid].append(w)
        chaos.completed[tid].append(w)
        chaos.lease_configs[tid] = dict(config)
        chaos.measurements[(tid, w)] = thr
    return {"trials": trials, "leases": leases, "trials_with_two_lease_rows": 0}, chaos


def test_the_checks_hold_on_a_clean_run() -> None:
    db, chaos = _world()
    c = kill_checks(db, chaos, n_trials=2)["checks"]
    assert c["ok"], c
    assert (c["lost"], c["duplicated"], c["measurements_discarded"], c["mismatched_stored"]) == (0, 0, 0, 0)


def test_a_config_completed_twice_is_a_duplicate() -> None:
    db, chaos = _world()
    # trial 2 was failed as lost and retried by trial 3, and both ended COMPLETE: one config, two results
    db["trials"][3] = _trial(3, 2, worker="w3", retry_of=1)
    db["leases"][3] = _lease(3, 2, "w3", 2, 3)
    chaos.leases[3].append("w3")
    chaos.lease_configs[3] = {"batch_size": 8, "lr": 0.001}
    c = kill_checks(db, chaos, n_trials=2)["checks"]
    assert c["slots_completed_twice"] == 1 and c["duplicated"] >= 1 and not c["ok"]


def test_a_trial_leased_to_two_workers_or_held_twice_is_a_duplicate() -> None:
    db, chaos = _world()
    chaos.leases[1].append("w2")  # the service handed trial 1 to w2 as well
    c = kill_checks(db, chaos, n_trials=2)["checks"]
    assert c["trials_leased_to_two_workers"] == 1 and c["duplicated"] == 1 and not c["ok"]

    db, chaos = _world()
    db["leases"][2] = _lease(2, 1, "w1", 0.5, 1.5)  # w1 holds trials 1 and 2 at once, both leases answered
    chaos.leases[2] = ["w1"]
    c = kill_checks(db, chaos, n_trials=2)["checks"]
    assert c["overlapping_leases_of_one_worker"] == 1 and c["duplicated"] == 1 and not c["ok"]


def test_an_orphan_lease_is_told_apart_from_a_trial_held_twice() -> None:
    """The service committed a lease of trial 3 to w1 but was killed before answering: w1 never
    saw it and leased trial 1; the orphan overlaps until the reaper ends it (lost, retried)."""
    db, chaos = _world()
    db["trials"][3] = _trial(3, 2, state="FAIL", worker=None, failure_kind="lost")
    db["trials"][4] = _trial(4, 3, worker="w2", throughput=303.0, retry_of=2)
    db["leases"][3] = _lease(3, 2, "w1", -0.5, 5, outcome="lost")
    db["leases"][4] = _lease(4, 3, "w2", 6, 7)
    for tid in (4,):
        chaos.leases[tid].append("w2")
        chaos.lease_configs[tid] = {"batch_size": 8, "lr": 0.001}
        chaos.measurements[(tid, "w2")] = 303.0
    c = kill_checks(db, chaos, n_trials=3)["checks"]
    assert c["orphan_leases"] == 1 and c["orphan_lease_overlaps"] == 1
    assert c["overlapping_leases_of_one_worker"] == 0 and c["duplicated"] == 0 and c["lost"] == 0, c
    # the orphan's config was never seen by a worker: not checked, and explained
    assert c["trials_no_worker_saw"] == 1 and c["configs_checked"] == 3 and c["unseen_unexplained"] == 0, c
    assert c["ok"], c


def test_a_trial_no_worker_saw_is_explained_only_as_an_orphan_that_never_completed() -> None:
    db, chaos = _world()
    del chaos.lease_configs[2]  # the database holds trial 2 leased to w2 and COMPLETE; w2 never saw it
    chaos.leases.pop(2)
    c = kill_checks(db, chaos, n_trials=2)["checks"]
    assert c["trials_no_worker_saw"] == 1 and c["unseen_unexplained"] == 1 and not c["ok"], c


def test_a_trial_never_completed_is_lost() -> None:
    db, chaos = _world()
    db["trials"][2] = _trial(2, 1, state="FAIL", failure_kind="lost")  # failed as lost, never retried
    db["leases"][2]["outcome"] = "lost"
    c = kill_checks(db, chaos, n_trials=2)["checks"]
    assert c["lost_trials"] == 1 and c["slots_without_a_complete_trial"] == 1 and c["lost"] == 1 and not c["ok"]


def test_a_measurement_the_database_does_not_hold_is_discarded() -> None:
    db, chaos = _world()
    chaos.measurements[(2, "w2")] = 999.0  # w2 measured 999; the database holds 202
    db["trials"][1]["attrs"]["worker_id"] = "w9"  # trial 1 completed under another worker's name
    discarded = discarded_measurements(db["trials"], chaos.measurements)
    assert [(d["trial_id"], d["worker"]) for d in discarded] == [(1, "w1"), (2, "w2")]
    chaos.measurements[(7, "w3")] = 1.0  # a trial the database does not have
    assert len(discarded_measurements(db["trials"], chaos.measurements)) == 3
    assert not kill_checks(db, chaos, n_trials=2)["checks"]["ok"]


def test_a_stored_mismatch_and_an_accepted_one_are_counted() -> None:
    db, chaos = _world()
    bad, kind = mismatched_config(chaos.lease_configs[1], "unknown_key")
    chaos.mismatches.append({"trial_id": 1, "worker": "w1", "kind": kind, "config": bad, "status": 422})
    chaos.mismatches.append({"trial_id": 2, "worker": "w2", "kind": "knob", "config": {"batch_size": 4}, "status": 422})
    c = config_checks(db["trials"], chaos.lease_configs, chaos.mismatches)
    assert (c["mismatched_sent"], c["mismatched_refused"], c["mismatched_stored"]) == (2, 2, 0)
    assert c["stored_config_differs_from_lease"] == 0 and c["mismatched_by_status"] == {"422": 2}

    db["trials"][1]["attrs"]["config"] = dict(bad)  # the service kept the mismatched config
    chaos.mismatches[1]["status"] = 200  # and took the other mismatched complete
    c = config_checks(db["trials"], chaos.lease_configs, chaos.mismatches)
    assert c["mismatched_stored"] == 1 and c["stored_config_differs_from_lease"] == 1
    assert c["mismatched_accepted"] == 1 and c["mismatched_refused"] == 1
    assert not kill_checks(db, chaos, n_trials=2)["checks"]["ok"]


@pytest.mark.parametrize("lease", [{"batch_size": 8, "accum_steps": 1},  # a baseline: lr left to the preset
                                   {"batch_size": 4, "accum_steps": 2, "lr": 0.0007}])
@pytest.mark.parametrize("kind", service_load.MISMATCH_KINDS)
def test_every_mismatch_kind_is_a_mismatch_by_the_services_own_rules(lease: dict[str, Any], kind: str) -> None:
    bad, _ = mismatched_config(lease, kind)
    assert not service_load.same_config(bad, lease)
    assert config_key_problems(bad) or config_differences(lease, bad, preset_values("ups", "tiny"))


def test_recovery_after_a_service_restart_is_measured_from_the_fleets_records() -> None:
    # 4 leases/s for 10 s, the service killed at 10, restarted at 12, ready at 13; the first lease
    # at 13.5, the rate back from 14 on (4/s), the first complete at 13.8
    leases = [i / 4 for i in range(40)] + [13.5] + [14 + i / 4 for i in range(40)]
    (r,) = service_load.service_recoveries([{"killed_at": 10.0, "restarted_at": 12.0, "ready_at": 13.0}], leases,
                                           [5.0, 13.8])
    assert r["down_s"] == 2.0 and r["start_s"] == 1.0
    assert r["restart_to_first_lease_s"] == 1.5 and r["ready_to_first_lease_s"] == 0.5
    assert r["restart_to_first_complete_s"] == pytest.approx(1.8)
    assert r["lease_rate_before_per_s"] == 4.0 and r["restart_to_throughput_back_s"] == 1.5


def test_the_service_kill_plan_is_seeded_and_mid_study() -> None:
    plan = service_load.service_kill_plan(3, 400, seed=0, down_range=(1.0, 3.0), jitter_s=0.5)
    assert plan == service_load.service_kill_plan(3, 400, seed=0, down_range=(1.0, 3.0), jitter_s=0.5)
    assert [p["after_completes"] for p in plan] == sorted(p["after_completes"] for p in plan)
    assert all(0 < p["after_completes"] < 400 and 1.0 <= p["down_s"] <= 3.0 and 0 <= p["delay_s"] <= 0.5
               for p in plan)


def test_a_search_trial_created_without_its_attrs_still_counts_as_a_configuration() -> None:
    """The service killed between Optuna's ask and writing the trial's attrs: a RUNNING trial
    with no role, never leased; the reaper fails it as lost and a retry re-runs it. It is one of
    the study's configurations (the service reads a trial without a role as a search trial)."""
    db, chaos = _world()
    db["trials"][3] = {"trial_id": 3, "number": 2, "state": "FAIL", "attrs": {"failure_kind": "lost"}}
    db["trials"][4] = _trial(4, 3, worker="w2", throughput=303.0, retry_of=2)
    db["leases"][4] = _lease(4, 3, "w2", 2, 3)
    chaos.leases[4].append("w2")
    chaos.lease_configs[4] = {"batch_size": 8, "lr": 0.001}
    chaos.measurements[(4, "w2")] = 303.0
    c = kill_checks(db, chaos, n_trials=3)["checks"]
    assert c["configurations"] == 3 and c["never_leased"] == 1 and c["lost"] == 0 and c["ok"], c
    assert service_load.trial_role({"attrs": {"is_baseline": True}}) == "baseline"


def test_a_draw_told_repeat_takes_a_configuration_and_is_counted_lost() -> None:
    """A search trial the service told REPEAT of an in-flight one (PRUNED, repeat_of, never
    leased) spends a configuration of the budget on nothing measured: lost, and named."""
    db, chaos = _world()
    db["trials"][3] = {"trial_id": 3, "number": 2, "state": "PRUNED",
                       "attrs": {"role": "search", "repeat_of": 1, "config": {"batch_size": 8, "lr": 0.001}}}
    c = kill_checks(db, chaos, n_trials=3)["checks"]
    assert c["repeats"] == 1 and c["repeat_examples"][0]["repeat_of"] == 1
    assert c["lost"] == 1 and c["never_leased"] == 1 and not c["ok"], c
