"""`autotune spool deliver`: a spool's pending results handed to a real service over HTTP (an
app on a SQLite file, served by uvicorn in a thread), under the worker's rules, by the
service's id; results of other services are left alone."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from service_helpers import free_port, probe_result, serve
from typer.testing import CliRunner, Result

from autotune.cli.main import app as cli
from autotune.contract.results import LeaseRequest, TrialLease
from autotune.worker.client import Client
from autotune.worker.spool import Spool, SpoolEntry


def deliver(url: str, spool: Spool) -> Result:
    return CliRunner().invoke(cli, ["spool", "deliver", "--api", url, "--spool-dir", str(spool.root)],
                              env={"COLUMNS": "250"})


def spooled(spool: Spool, lease: TrialLease, worker_id: str, service_id: str | None, api: str,
            **result: Any) -> SpoolEntry:
    entry = SpoolEntry(api=api, trial_id=lease.trial_id, worker_id=worker_id, study=lease.study,
                       number=lease.number, result=probe_result(**result), service_id=service_id,
                       lease_token=lease.lease_token)
    spool.put(entry)
    return entry


def test_deliver_hands_in_this_services_results_by_its_id_and_leaves_the_others(app: FastAPI, tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool")
    with serve(app) as url, Client(url) as service:
        for name in ("rel", "ref", "oth"):  # one study each: a study leases its baseline alone first
            service.submit({"name": name, "n_trials": 2, "baseline_seeds": 1, "remeasure": {"top_k": 0}})
        ours, refused, theirs = (service.lease(LeaseRequest(worker_id=w, hardware="cpu", study=name))
                                 for w, name in (("w1", "rel"), ("w2", "ref"), ("w3", "oth")))
        assert ours is not None and refused is not None and theirs is not None
        sid = service.health()["service_id"]
        # leased at the address the service had then: the id says it is this service's
        spooled(spool, ours, "w1", sid, "http://old-address:8000", config=ours.config, throughput=321.0)
        wrong = {**refused.config, "precision": "bf16" if refused.config.get("precision") != "bf16" else "fp16"}
        spooled(spool, refused, "w2", sid, url, config=wrong)  # another config than the leased one: 422
        lost = TrialLease(**{**theirs.model_dump(), "study": "gone"})  # a study this service does not hold
        spooled(spool, lost, "w3", sid, url, config=theirs.config)
        other = spooled(spool, theirs, "w3", str(uuid.uuid4()), url, config=theirs.config, throughput=999.0)

        result = deliver(url, spool)
        assert result.exit_code == 1, result.output  # one of this service's results is still pending
        out = " ".join(result.stdout.split())
        assert f"delivered trial {ours.number} of rel (id {ours.trial_id}), worker w1, 321.0 samples/s → COMPLETE" \
            in out
        assert f"refused trial {refused.number} of ref (id {refused.trial_id}), worker w2" in out
        assert "it differs in precision" in out and "kept in " in out and "/rejected/" in out
        assert f"kept trial {lost.number} of gone (id {lost.trial_id}), worker w3" in out
        assert "has no study 'gone'" in out
        assert f"service {sid} at {url}: 3 pending result(s)" in out
        assert "1 delivered, 1 refused (kept in rejected/), 1 still pending" in out
        assert "1 result(s) of other services left alone (autotune spool list --spool-dir" in out

        (done,), (failed,), (untouched,) = (service.trials(name).data for name in ("rel", "ref", "oth"))
        assert done.state == "COMPLETE" and done.throughput_samples_per_s == 321.0
        assert failed.state == "FAIL"  # its lease ended by a failure record naming the refusal
        assert untouched.state == "RUNNING"  # the other service's result never went in
        pending = {(e.study, e.service_id) for e in spool.pending()}
        assert pending == {("gone", sid), ("oth", other.service_id)}
        (rejected,) = spool.rejected()
        assert rejected.worker_id == "w2" and "422" in (rejected.reason or "")

        again = deliver(url, spool)  # what is left is not this service's to take: nothing changes
        assert again.exit_code == 1 and "0 delivered, 0 refused (kept in rejected/), 1 still pending" in \
            " ".join(again.stdout.split())
        assert len(spool.pending()) == 2


def test_deliver_of_an_unknown_service_id_by_url_and_a_clean_finish(app: FastAPI, tmp_path: Path) -> None:
    """A result spooled before the service's id was known is matched by URL; with nothing left
    the exit status is 0. No service answering: exit 1, the spool untouched."""
    spool = Spool(tmp_path / "spool")
    with serve(app) as url, Client(url) as service:
        service.submit({"name": "rel", "n_trials": 2, "baseline_seeds": 1, "remeasure": {"top_k": 0}})
        lease = service.lease(LeaseRequest(worker_id="w1", hardware="cpu", study="rel"))
        assert lease is not None
        entry = spooled(spool, lease, "w1", None, url, config=lease.config, throughput=55.0)
        assert entry.path is not None and entry.path.parent == spool.root
        result = deliver(url, spool)
        assert result.exit_code == 0, result.output
        assert "1 delivered, 0 refused (kept in rejected/), 0 still pending" in " ".join(result.stdout.split())
        assert spool.pending() == [] and service.trials("rel").data[0].throughput_samples_per_s == 55.0
    nobody = f"http://127.0.0.1:{free_port()}"
    spooled(spool, lease, "w1", None, nobody, config=lease.config)
    down = deliver(nobody, spool)
    assert down.exit_code == 1 and "cannot reach the autotune service" in down.stderr
    assert len(spool.pending()) == 1
