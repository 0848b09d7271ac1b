"""A spooled result goes only to the service and study it was leased from, and a trial whose
result was just delivered is not run again (issue 35: D2, D4), with the real service and a real
worker in subprocesses: the service is killed mid-probe and restarted on another database (a
backup taken before any study: the same tokens and service id), or on the same one.

The in-process half, `Worker` against a scripted service, is tests/worker/test_spool_identity.py;
this slow half is a module of its own so that pytest-xdist (which hands out whole modules) runs
the two side by side.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from live_service import (
    LiveService,
    Processes,
    leased_trial_ids,
    log_text,
    probe_children,
    reports_stored,
    small_spec,
    start_worker,
    wait_until,
)

from autotune.api.backup import backup_sqlite
from autotune.worker.spool import Spool

# The worker's calls give up on the killed service after 2 s instead of 10 (AUTOTUNE_WORKER_RETRY_S): the
# complete keeps its result in the spool, the lease call says the service does not answer; the same steps, sooner
WORKER_ENV = {"COLUMNS": "400", "AUTOTUNE_WORKER_RETRY_S": "2"}


def kill(service: LiveService) -> None:
    assert service.proc is not None
    os.killpg(service.proc.pid, signal.SIGKILL)
    service.proc.wait()


def away(worker: subprocess.Popen[bytes]) -> int:
    """How many outages the worker has seen (its lease calls failing: a line each)."""
    return " ".join(log_text(worker).split()).count(" does not answer (")


def back_on_the_original_database(service: LiveService, a_db: Path, spool: Path, kept: Any,
                                  worker: subprocess.Popen[bytes]) -> None:
    """Restart the service on the kept result's own database (a backup has the same id: the
    worker offers its spool again once it has seen the service away, its lease calls failing):
    the kept measurement goes into trial 0 of rel, and the worker ran each trial once."""
    outages = away(worker)
    kill(service)
    service.db_url = f"sqlite:///{a_db}"
    wait_until(lambda: away(worker) > outages, 60, "the worker to see the service away")
    service.start()
    wait_until(lambda: service.trials("rel")[0]["state"] == "COMPLETE", 120, "rel's trial 0 to get its result")
    (ours,) = service.trials("rel")
    assert ours["throughput_samples_per_s"] == kept.result["throughput_samples_per_s"]  # the spooled measurement
    # delivered: the worker removes its file just after the service's answer (the trial shows COMPLETE first)
    wait_until(lambda: Spool(spool).pending() == [], 60, "the delivered result to leave the spool")
    assert Spool(spool).rejected() == []
    assert leased_trial_ids(worker) == [1, 1]  # trial 1 of each database, each run once
    assert worker.poll() is None


def kept_mid_probe(processes: Processes, tmp_path: Path, a_db: Path, b_db: Path,
                   env: dict[str, str] | None = None) -> tuple[LiveService, Path, subprocess.Popen[bytes], Any]:
    """A service on a.db with b.db its backup taken before any study; study 'rel' (600 samples),
    its trial 0 (id 1) leased to worker 'w', and the service killed mid-probe: the worker keeps
    the measurement in its spool. (service, spool folder, worker, the kept entry)."""
    service = LiveService(processes, a_db, env=env).start()
    backup_sqlite(service.db_url, b_db)
    service.submit(small_spec("rel", samples=600, n_trials=1, probe={"windows": 8}, pruning={"enabled": False}))
    spool = tmp_path / "spool"
    worker = start_worker(processes, service.url, "--spool-dir", str(spool), "--worker-id", "w",
                          env=WORKER_ENV)
    wait_until(lambda: probe_children(worker.pid), 60, "a probe child")
    wait_until(lambda: reports_stored(a_db) >= 1, 60, "the first timed window's report")
    kill(service)  # mid-probe: the result cannot go in
    wait_until(lambda: "kept in" in log_text(worker), 120, "the worker to keep the result in its spool")
    (kept,) = Spool(spool).pending()
    assert (kept.study, kept.number, kept.trial_id) == ("rel", 0, 1) and kept.measured and kept.service_id
    return service, spool, worker, kept


@pytest.mark.slow
@pytest.mark.parametrize("auth", [True, False], ids=["tokens", "no-auth"])
def test_a_service_restarted_on_a_backup_never_gets_another_studys_result(processes: Processes, tmp_path: Path,
                                                                          tiny_datasets: Any, auth: bool) -> None:
    """Issue 35, D2. The service runs on a.db; b.db is a backup of it taken before any study (the
    same tokens, the same service id). The worker measures trial 0 of 'rel' (id 1); the service is
    killed before the result goes in and restarted on b.db, where study 'other' (the same spec:
    the same first config) gets trial id 1, leased to this worker. The worker runs that trial
    and keeps rel's measurement in its spool, naming where it belongs; once the service is back
    on a.db, the measurement goes into 'rel'."""
    a_db, b_db = tmp_path / "a.db", tmp_path / "b.db"
    service, spool, worker, kept = kept_mid_probe(processes, tmp_path, a_db, b_db,
                                                  None if auth else {"AUTOTUNE_AUTH": "false"})

    service.db_url = f"sqlite:///{b_db}"  # the backup: same tokens, no study
    service.start()
    service.submit(small_spec("other", samples=64, n_trials=1))
    wait_until(lambda: "▶ trial 0 of other (id 1)" in log_text(worker), 120, "the worker to run other's trial 0")
    wait_until(lambda: service.trials("other")[0]["state"] == "COMPLETE", 120, "other's trial 0 to complete")
    (theirs,) = service.trials("other")
    assert theirs["throughput_samples_per_s"] != kept.result["throughput_samples_per_s"]  # its own measurement
    # the worker removes B's own write-ahead file just after its complete: wait for that, then one is left
    wait_until(lambda: len(Spool(spool).pending()) == 1, 60, "the spool to hold the kept result alone")
    (still,) = Spool(spool).pending()
    assert still.result == kept.result and Spool(spool).rejected() == []
    # the worker offers its spool when it is idle (or after the outage it saw): it names where the result belongs
    where = f"belongs to service {kept.service_id} at {service.url}, study 'rel', trial 0 (id 1)"
    wait_until(lambda: where in " ".join(log_text(worker).split()), 90, "the worker to say where the result belongs")
    assert Spool(spool).pending() != [] and Spool(spool).rejected() == []  # still kept, not delivered

    back_on_the_original_database(service, a_db, spool, kept, worker)


@pytest.mark.slow
def test_a_backup_with_a_study_of_the_same_name_never_gets_the_originals_result(processes: Processes, tmp_path: Path,
                                                                                 tiny_datasets: Any) -> None:
    """Issue 35, D2, the same name. As above, but the backup gets a study also named 'rel' (another
    probe size), whose trial 0 is id 1 too, leased to the same worker: service id, study, trial
    number and id all match. Only the lease token differs: B's trial is run by the worker and
    completed with its own measurement (never the kept one, measured at 600 samples for A's
    spec), A's measurement stays kept naming where it belongs, and goes into A's trial once
    the service is back on a.db."""
    a_db, b_db = tmp_path / "a.db", tmp_path / "b.db"
    service, spool, worker, kept = kept_mid_probe(processes, tmp_path, a_db, b_db)
    assert kept.lease_token

    service.db_url = f"sqlite:///{b_db}"  # the backup: same tokens, same service id, no study
    service.start()
    service.submit(small_spec("rel", samples=64, n_trials=1))  # the same name
    wait_until(lambda: any(t["state"] != "RUNNING" for t in service.trials("rel")), 120, "B's trial 0 of rel to finish")
    (theirs,) = service.trials("rel")
    assert theirs["trial_id"] == 1 and theirs["state"] == "COMPLETE", theirs
    assert theirs["throughput_samples_per_s"] != kept.result["throughput_samples_per_s"]  # its own measurement
    where = f"it belongs to service {kept.service_id} at {service.url}, study 'rel', trial 0 (id 1)"
    wait_until(lambda: where in " ".join(log_text(worker).split()), 90, "the worker to say where the result belongs")
    # the worker removes B's own write-ahead file just after its complete: wait for that, then one is left
    wait_until(lambda: len(Spool(spool).pending()) == 1, 60, "the spool to hold the kept result alone")
    (still,) = Spool(spool).pending()
    assert still.result == kept.result and Spool(spool).rejected() == []  # kept, not delivered, not rejected

    back_on_the_original_database(service, a_db, spool, kept, worker)


@pytest.mark.slow
@pytest.mark.parametrize("start", ["warm", "cold"])
def test_after_a_restart_the_delivered_trial_is_not_run_again(processes: Processes, tmp_path: Path,
                                                              tiny_datasets: Any, start: str) -> None:
    """Issue 35, D4. The service is killed mid-probe and stays away until the worker's lease calls
    fail; restarted on the same database, it answers the worker's lease with the trial the
    worker holds (its lease still active), and the worker then delivers that trial's spooled
    result. It must not run the trial again: each trial id runs once."""
    db = tmp_path / "autotune.db"
    service = LiveService(processes, db).start()
    service.submit(small_spec("again", n_trials=2, samples=600, probe={"windows": 8}, pruning={"enabled": False}))
    spool = tmp_path / "spool"
    worker = start_worker(processes, service.url, "--study", "again", "--max-trials", "2", "--spool-dir", str(spool),
                          *(["--cold-start"] if start == "cold" else []), env=WORKER_ENV)
    wait_until(lambda: probe_children(worker.pid), 60, "a probe child")
    wait_until(lambda: reports_stored(db) >= 1, 60, "the first timed window's report")
    kill(service)
    wait_until(lambda: "kept in" in log_text(worker), 120, "the worker to keep the result in its spool")
    # the lease loop's delivery round, then a whole lease call fail: the worker sees the service away
    wait_until(lambda: away(worker) > 0, 60, "the worker to see the service away")
    service.start()
    assert worker.wait(timeout=180) == 0, log_text(worker)[-3000:]
    log = log_text(worker)
    assert "answers again" in log and "delivered → COMPLETE" in log, log[-3000:]
    assert "its result was delivered from the spool just now: not run again" in log  # the lease came back first
    ids = leased_trial_ids(worker)
    assert len(ids) == len(set(ids)) == 2, log[-3000:]  # no trial run twice
    assert "dropped" not in log
    assert [t["state"] for t in service.trials("again")] == ["COMPLETE", "COMPLETE"]
