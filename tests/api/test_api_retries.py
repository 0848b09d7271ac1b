"""Retries of lost trials: the plan (retries first, budget, the baseline gate, exhaustion), the
views, and that nothing about them lives only in one service process's memory.

Leases go stale by calling `reap_stale(now=...)` with a moment past the grace period: no test
sleeps.
"""

from __future__ import annotations

import statistics
from datetime import timedelta
from pathlib import Path
from typing import Any

import optuna
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from rich.console import Console
from service_helpers import StudyFactory, complete, lease, make_settings, trials_of, tuning_service
from sqlalchemy import update

from autotune.api.db import LeaseRow, utcnow
from autotune.api.main import create_app
from autotune.cli.demo import progress_text
from autotune.cli.tables import studies_table, trials_table
from autotune.contract.views import StudyInfo, TrialList


def _reap(app: FastAPI) -> list[int]:
    """Reap as if every lease had been silent for longer than the grace period."""
    service = tuning_service(app)
    return service.reap_stale(utcnow() + timedelta(seconds=service.settings.lease_grace_s + 5))


def _optuna_state(app: FastAPI, trial_id: int) -> str:
    trial = tuning_service(app).bridge.get_trial(trial_id)
    assert trial is not None
    return trial.state


def test_max_retries_is_validated(client: TestClient) -> None:
    r = client.post("/v1/studies", json={"name": "s", "max_retries": 11})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "max_retries"]
    assert client.post("/v1/studies", json={"name": "s"}).json()["spec"]["max_retries"] == 2


def test_a_lost_search_trial_is_retried_first_without_using_the_budget(backend_app: FastAPI) -> None:
    with TestClient(backend_app) as client:
        _lost_search_trial_is_retried(backend_app, client)


def _lost_search_trial_is_retried(app: FastAPI, client: TestClient) -> None:
    r = client.post("/v1/studies", json={"name": "s", "n_trials": 4, "sampler": "random", "seed": 3,
                                         "baseline_seeds": 1, "remeasure": {"top_k": 0}})
    assert r.status_code == 201, r.text
    base = lease(client, "w0")
    assert base is not None and base["role"] == "baseline"
    complete(client, base, "w0")
    lost, other = lease(client, "w1"), lease(client, "w2")
    assert lost is not None and other is not None
    complete(client, other, "w2")
    assert _reap(app) == [lost["trial_id"]]
    assert _optuna_state(app, lost["trial_id"]) == "FAIL"  # invisible to the samplers: not a verdict on the config
    # until its re-run is leased, the lost trial is shown as lost, not as a failure of the study
    study = client.get("/v1/studies/s").json()
    assert study["counts"] == {"COMPLETE": 2, "LOST": 1} and study["failures"] == {} and study["retried"] == 0
    assert trials_of(client)[lost["number"]]["to_rerun"] is True
    shown = _shown(client)  # what `autotune tune`'s progress line, `studies` and `status` print
    assert "1 lost (to be re-run)" in shown and "0 failed" in shown and "lost (to be re-run)" in shown

    retry = lease(client, "w3")  # the retry comes before a new search trial
    assert trials_of(client)[lost["number"]]["to_rerun"] is False
    assert client.get("/v1/studies/s").json()["counts"] == {"COMPLETE": 2, "RUNNING": 1}
    assert retry is not None and retry["trial_id"] != lost["trial_id"]
    assert (retry["role"], retry["params"], retry["config"], retry["probe"]) == \
        (lost["role"], lost["params"], lost["config"], lost["probe"])
    fresh = lease(client, "w4")  # the last configuration of the budget: the retry did not use one up
    assert fresh is not None and fresh["role"] == "search"
    assert lease(client, "w5") is None  # 4 configurations handed out (5 trials)
    complete(client, retry, "w3", throughput=321.0)
    complete(client, fresh, "w4")

    trials = trials_of(client)
    assert len(trials) == 5
    assert trials[lost["number"]]["state"] == "FAIL" and trials[lost["number"]]["failure"]["kind"] == "lost"
    assert "will be re-run" in trials[lost["number"]]["failure"]["message"]
    assert trials[lost["number"]]["retried_as"] == retry["number"]
    again = trials[retry["number"]]
    assert (again["retry_of"], again["attempt"], again["state"]) == (lost["number"], 2, "COMPLETE")
    assert again["throughput_samples_per_s"] == 321.0
    study = client.get("/v1/studies/s").json()
    # each configuration once: the lost attempt is not a failure of the study, nor a missing trial
    assert study["state"] == "finished" and study["counts"] == {"COMPLETE": 4}
    assert study["failures"] == {} and study["retried"] == 1


def _shown(client: TestClient) -> str:
    """The study's progress line (`autotune tune`, the demo), its row in `autotune studies` and its
    trials table (`autotune status`), as printed."""
    info = StudyInfo.model_validate(client.get("/v1/studies/s").json())
    trials = TrialList.model_validate(client.get("/v1/studies/s/trials").json()).data
    console = Console(record=True, width=250)
    console.print(progress_text(info))
    console.print(studies_table([info]))
    console.print(trials_table(trials, "trials"))
    return console.export_text()


def test_retries_keep_their_order_and_come_before_baseline_seeds(app: FastAPI, client: TestClient,
                                                                 make_study: StudyFactory) -> None:
    make_study("s", baseline_seeds=3, n_trials=4)
    first, second = lease(client, "w1"), lease(client, "w2")
    assert first is not None and second is not None
    assert sorted(_reap(app)) == sorted([first["trial_id"], second["trial_id"]])
    got = [lease(client, f"w{i}") for i in (3, 4, 5)]
    assert all(g is not None for g in got)
    # the lost seeds 0 and 1 again (same probe seeds), oldest first, then seed 2
    seeds = [g["probe"]["seed"] for g in got]  # type: ignore[index]
    assert seeds == [first["probe"]["seed"], second["probe"]["seed"], first["probe"]["seed"] + 2]
    assert [g["role"] for g in got] == ["baseline"] * 3  # type: ignore[index]
    assert [trials_of(client)[g["number"]]["retry_of"] for g in got] == [  # type: ignore[index]
        first["number"], second["number"], None]


def test_the_gate_waits_for_a_lost_baseline_seed_and_its_retry(app: FastAPI, client: TestClient,
                                                               make_study: StudyFactory) -> None:
    make_study("s", baseline_seeds=2, n_trials=4)
    seed0, seed1 = lease(client, "w1"), lease(client, "w2")
    assert seed0 is not None and seed1 is not None
    complete(client, seed1, "w2", nrmse=0.1)
    assert _reap(app) == [seed0["trial_id"]]
    # seed 0 is lost but will be re-run: the gate is not set from seed 1 alone
    best = client.get("/v1/studies/s/best")
    assert best.status_code == 404 and f"waiting for trials [{seed0['number']}]" in best.json()["detail"]
    retry = lease(client, "w3")
    assert retry is not None and retry["role"] == "baseline" and retry["probe"] == seed0["probe"]
    assert lease(client, "w4") is None  # no search trial while the retried seed runs
    complete(client, retry, "w3", nrmse=0.3)
    search = lease(client, "w4")
    assert search is not None and search["role"] == "search"
    complete(client, search, "w4", nrmse=0.1, throughput=500.0)
    rec = client.get("/v1/studies/s/best").json()
    assert rec["baseline_seeds"] == 2 and rec["baseline_val_nrmse"] == pytest.approx(0.2)


def test_retries_exhausted_leave_the_trial_failed_for_good(app: FastAPI, client: TestClient,
                                                           make_study: StudyFactory) -> None:
    make_study("s", n_trials=1, max_retries=1)
    first = lease(client, "w1")
    assert first is not None
    assert _reap(app) == [first["trial_id"]]
    assert client.get("/v1/studies/s").json()["counts"] == {"LOST": 1}  # a retry is still to come
    retry = lease(client, "w2")
    assert retry is not None
    assert _reap(app) == [retry["trial_id"]]
    assert lease(client, "w3") is None  # attempts used up: nothing more to run
    trials = trials_of(client)
    assert [t["state"] for t in trials.values()] == ["FAIL", "FAIL"]
    final = trials[retry["number"]]["failure"]["message"]
    assert final.startswith(f"lost 2 times (trials #{first['number']}, #{retry['number']}; max_retries 1)")
    assert "worker w2 stopped heartbeating" in final and trials[retry["number"]]["retried_as"] is None
    study = client.get("/v1/studies/s").json()
    assert study["state"] == "finished" and "every baseline run failed" in study["message"]
    assert study["counts"] == {"FAIL": 1} and study["failures"] == {"lost": 1} and study["retried"] == 1


def test_without_retries_a_lost_trial_is_lost_once(app: FastAPI, client: TestClient,
                                                    make_study: StudyFactory) -> None:
    make_study("s", n_trials=1, max_retries=0)
    first = lease(client, "w1")
    assert first is not None
    _reap(app)
    assert lease(client, "w2") is None
    assert trials_of(client)[0]["failure"]["message"].startswith("lost once (trials #0; max_retries 0)")


@pytest.mark.parametrize("sampler", ["tpe", "grid"])
def test_a_search_retry_asks_the_sampler_for_the_same_point(app: FastAPI, client: TestClient,
                                                            make_study: StudyFactory, sampler: str) -> None:
    space = {"params": {"batch_size": {"choices": [2, 4, 8]}}, "fixed": {"accum_steps": 1}}
    make_study("s", sampler=sampler, space=space, n_trials=4, seed=1)
    base = lease(client, "w0")
    assert base is not None
    complete(client, base, "w0")
    lost = lease(client, "w1")
    assert lost is not None
    _reap(app)
    retry = lease(client, "w2")
    assert retry is not None and retry["params"] == lost["params"] and retry["config"] == lost["config"]
    rest = [lease(client, f"w{i}") for i in (3, 4)]
    assert all(r is not None for r in rest) and lease(client, "w9") is None
    if sampler == "grid":  # the retry did not use up a grid point: the three points, each once
        sizes = sorted(r["params"]["batch_size"] for r in (retry, *rest))  # type: ignore[index]
        assert sizes == [2, 4, 8]


def test_a_repeated_complete_tells_optuna_once(app: FastAPI, client: TestClient, make_study: StudyFactory) -> None:
    make_study("s", n_trials=2)
    base = lease(client, "w0")
    assert base is not None
    service = tuning_service(app)
    first = complete(client, base, "w0", nrmse=0.1)
    told = service.bridge.get_trial(base["trial_id"])
    summary = service._summaries.get("s")
    seeds = len(summary.baseline_curves) if summary is not None else None
    assert complete(client, base, "w0", nrmse=0.1) == first  # a network retry of the same call
    again = service.bridge.get_trial(base["trial_id"])
    assert again == told  # same values, attrs and completion time: Optuna was told once
    if summary is not None:
        assert len(summary.baseline_curves) == seeds


def test_a_complete_after_a_crash_between_tell_and_lease_update_is_a_repair(app: FastAPI, client: TestClient,
                                                                            make_study: StudyFactory) -> None:
    make_study("s", n_trials=2)
    base = lease(client, "w0")
    assert base is not None
    service = tuning_service(app)
    ctx = service._ctx(service._record("s"))
    service.bridge.finish(ctx, base["trial_id"], "COMPLETE", [100.0, 0.1],
                          {"failure_kind": None, "throughput_samples_per_s": 100.0, "quality": 0.1})
    _, told = service.bridge.finish_once(ctx, base["trial_id"], "COMPLETE", [1.0, 9.0])
    assert told is False
    info = complete(client, base, "w0", throughput=5.0)  # the worker's retry finds the trial told already
    assert info["state"] == "COMPLETE" and info["throughput_samples_per_s"] == 100.0
    assert lease(client, "w0") is not None  # the lease was ended: the worker gets new work


def test_a_restarted_service_retries_what_the_old_one_lost(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/t.db"
    old = create_app(make_settings(url))
    with TestClient(old) as client:
        assert client.post("/v1/studies", json={"name": "s", "baseline_seeds": 1, "n_trials": 2}).status_code == 201
        lost = lease(client, "w1")
        assert lost is not None
        _reap(old)
    new = create_app(make_settings(url))
    with TestClient(new) as client:
        retry = lease(client, "w2")  # nothing lived only in the old process's memory
        assert retry is not None and trials_of(client)[retry["number"]]["retry_of"] == lost["number"]


class _Crash(Exception):
    """The service process dying: nothing after the raise runs."""


@pytest.mark.parametrize("victim", ["baseline", "search"])
def test_a_crash_right_after_a_trial_is_created_leaves_a_study_that_finishes(
        db_url: str, monkeypatch: pytest.MonkeyPatch, victim: str) -> None:
    """The service dies just after the first commit of a new trial (before anything else of that
    trial or its lease is written). After the restart the trial is failed as never leased and
    re-run in its own role: a baseline seed as the baseline (so the gate comes to exist), a
    search trial as a search trial; then the study runs to its end."""
    spec = {"name": "s", "baseline_seeds": 1, "n_trials": 2, "sampler": "random", "seed": 0,
            "remeasure": {"top_k": 0}, "pruning": {"enabled": False}}
    old = create_app(make_settings(db_url))
    with TestClient(old) as client:
        assert client.post("/v1/studies", json=spec).status_code == 201
        if victim == "search":
            base = lease(client, "w0")
            assert base is not None and base["role"] == "baseline"
            complete(client, base, "w0")
        # a baseline seed is made from a template (storage.create_new_trial), a search trial by study.ask
        owner: Any = tuning_service(old).bridge.storage if victim == "baseline" else optuna.Study
        method = "create_new_trial" if victim == "baseline" else "ask"
        create = getattr(owner, method)

        def create_then_die(*args: Any, **kwargs: Any) -> Any:
            create(*args, **kwargs)
            raise _Crash

        monkeypatch.setattr(owner, method, create_then_die)
        with pytest.raises(_Crash):
            lease(client, "w1")
        monkeypatch.undo()  # the restarted service runs as it should
        (orphan,) = [t for t in trials_of(client).values() if t["state"] == "RUNNING"]

    new = create_app(make_settings(db_url))
    with TestClient(new) as client:
        assert orphan["role"] == victim  # what the trial says it is, read back by the restarted service
        assert _reap(new) == [orphan["trial_id"]]
        failed = trials_of(client)[orphan["number"]]
        assert failed["state"] == "FAIL" and "never leased" in failed["failure"]["message"]
        retry = lease(client, "w2")
        assert retry is not None and retry["role"] == victim
        assert trials_of(client)[retry["number"]]["retry_of"] == orphan["number"]
        complete(client, retry, "w2")
        while (got := lease(client, "w3")) is not None:
            complete(client, got, "w3")
        study = client.get("/v1/studies/s").json()
        assert study["state"] == "finished", study
        roles = [t["role"] for t in trials_of(client).values() if t["state"] == "COMPLETE"]
        assert sorted(roles) == ["baseline", "search"], roles


def test_after_a_restart_every_lease_gets_one_grace_period(tmp_path: Path) -> None:
    """A service that was down longer than the grace period does not reap the leases of
    workers that were alive all along: they get one grace period to heartbeat again."""
    url = f"sqlite:///{tmp_path}/t.db"
    with TestClient(create_app(make_settings(url))) as client:
        assert client.post("/v1/studies", json={"name": "s", "baseline_seeds": 1}).status_code == 201
        held = lease(client, "w1")
        assert held is not None
    new = create_app(make_settings(url))
    service = tuning_service(new)
    grace = timedelta(seconds=service.settings.lease_grace_s)
    with service.db.transaction() as session:  # the last heartbeat came long before the restart
        session.execute(update(LeaseRow).values(heartbeat_at=utcnow() - 10 * grace))
    with TestClient(new) as client:
        assert service.reap_stale(utcnow()) == []
        before_beat = utcnow()
        r = client.post(f"/v1/trials/{held['trial_id']}/heartbeat", json={"worker_id": "w1"})
        assert r.json()["action"] == "continue"
        assert before_beat + grace > service.started_at + grace  # past the startup grace, and the beat is fresh:
        assert service.reap_stale(before_beat + grace) == []
        assert service.reap_stale(utcnow() + grace + timedelta(seconds=5)) == [held["trial_id"]]


def test_a_lost_remeasurement_is_retried_and_the_study_waits_for_it(app: FastAPI, client: TestClient,
                                                                     make_study: StudyFactory) -> None:
    make_study("s", n_trials=2, remeasure={"top_k": 1, "windows": 5, "rounds": 2})
    base = lease(client, "w0")
    assert base is not None
    complete(client, base, "w0", nrmse=0.1, throughput=100.0)
    search = lease(client, "w1")
    assert search is not None
    complete(client, search, "w1", nrmse=0.1, throughput=200.0)
    lost = lease(client, "w2")  # round 0's candidate first; then w2 goes silent
    assert lost is not None and lost["role"] == "remeasure" and not lost["is_baseline"]
    _reap(app)
    assert client.get("/v1/studies/s").json()["state"] == "running"  # the re-measurement is still to come
    retry = lease(client, "w3")
    assert retry is not None and (retry["role"], retry["config"], retry["probe"]) == \
        (lost["role"], lost["config"], lost["probe"])
    trials = trials_of(client)
    assert (trials[retry["number"]]["remeasure_of"], trials[retry["number"]]["remeasure_round"]) == \
        (search["number"], 0)  # the retry re-runs round 0 ...
    complete(client, retry, "w3", nrmse=0.1, throughput=190.0)
    base_again = lease(client, "w3")  # ... which re-measures the baseline too, at the same budget
    assert base_again is not None and trials_of(client)[base_again["number"]]["remeasure_round"] == 0
    complete(client, base_again, "w3", nrmse=0.1, throughput=95.0)
    assert client.get("/v1/studies/s").json()["state"] == "running"  # ... and round 1 is still to come
    for _ in range(2):  # round 1: the baseline, then the pick (the reverse order)
        second = lease(client, "w4")
        assert second is not None and trials_of(client)[second["number"]]["remeasure_round"] == 1
        is_pick = trials_of(client)[second["number"]]["remeasure_of"] == search["number"]
        complete(client, second, "w4", nrmse=0.1, throughput=190.0 if is_pick else 95.0)
    study = client.get("/v1/studies/s").json()
    assert study["state"] == "finished" and study["best"]["remeasured"] is True
    best = study["best"]
    assert best["certified"] is True and best["trial_number"] == search["number"]
    assert best["throughput_samples_per_s"] == pytest.approx(190.0) and best["remeasure_rounds"] == 2
    # the lost attempt is not a run: two rounds of two configs, the baseline's seed beside its two re-measurements
    assert best["rounds_run"] == 2 and best["remeasure_probes"] == 4
    assert best["configs"][0]["throughputs"] == [100.0, 95.0, 95.0]
    assert best["speedup"] == pytest.approx(190.0 / statistics.geometric_mean([100.0, 95.0, 95.0]))


# --- workloads a worker does not run ---------------------------------------------------------


def test_a_worker_is_offered_only_the_workloads_it_runs(client: TestClient) -> None:
    assert client.post("/v1/studies", json={"name": "s", "baseline_seeds": 1}).status_code == 201
    body = {"worker_id": "w", "hardware": "cpu", "workloads": ["other"]}
    assert client.post("/v1/trials/lease", json=body).status_code == 204  # the ups study is not offered
    r = client.post("/v1/trials/lease", json={**body, "study": "s"})
    assert r.status_code == 422
    detail = r.json()["detail"][0]
    assert detail["loc"] == ["body", "workloads"]
    assert "runs workload 'ups'" in detail["msg"] and "--allow-workload ups" in detail["msg"]
    assert trials_of(client) == {}  # nothing was created for a worker that cannot run it
    r = client.post("/v1/trials/lease", json={**body, "workloads": ["other", "ups"]})
    assert r.status_code == 200 and r.json()["workload"] == "ups"


@pytest.mark.parametrize("failure", [
    {"kind": "refused", "message": "workload 'ups' is allowed but not installed on this worker"},
    {"kind": "interrupted", "message": "worker interrupted by SIGTERM"}])
def test_a_refused_or_interrupted_trial_is_not_taught_to_the_sampler_and_is_rerun(
        client: TestClient, app: FastAPI, failure: dict[str, str]) -> None:
    assert client.post("/v1/studies", json={"name": "s", "baseline_seeds": 1}).status_code == 201
    first = lease(client, "old-worker")
    assert first is not None
    view = complete(client, first, "old-worker", failure=failure, throughput=None, nrmse=None)
    assert view["state"] == "FAIL" and view["failure"]["kind"] == failure["kind"]
    assert _optuna_state(app, first["trial_id"]) == "FAIL"  # not COMPLETE with worst-case values
    again = lease(client, "good-worker")
    assert again is not None and again["role"] == "baseline" and again["config"] == first["config"]
    assert again["probe"] == first["probe"]  # the same seed: the same measurement, re-run
    complete(client, again, "good-worker")
    trials = trials_of(client)
    assert trials[first["number"]]["retried_as"] == again["number"]
    info = client.get("/v1/studies/s").json()
    assert info["counts"].get("COMPLETE") == 1 and info["failures"] == {} and info["retried"] == 1


def test_a_retry_and_a_grid_draw_are_made_in_one_commit(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A retry of a lost search trial (and a grid configuration) is one trial row set in one
    commit, never Optuna's enqueue + ask (two commits: a service killed in between left a
    WAITING trial that a later draw took, spending a configuration of the budget on a repeat)."""
    monkeypatch.setattr(optuna.Study, "enqueue_trial", lambda *_a, **_k: pytest.fail("enqueue + ask: two commits"))
    for sampler in ("random", "grid"):
        name = f"s-{sampler}"
        with TestClient(create_app(make_settings(db_url))) as client:
            spec = {"name": name, "baseline_seeds": 1, "n_trials": 3, "sampler": sampler, "seed": 0,
                    "space": {"params": {"batch_size": {"choices": [8, 16, 32]}}}, "remeasure": {"top_k": 0}}
            assert client.post("/v1/studies", json=spec).status_code == 201
            base = lease(client, "w0", study=name)
            assert base is not None
            complete(client, base, "w0")
            lost = lease(client, "w1", study=name)
            assert lost is not None and lost["role"] == "search"
            assert _reap(client.app) == [lost["trial_id"]]  # type: ignore[arg-type]
            retry = lease(client, "w2", study=name)
            assert retry is not None and retry["config"] == lost["config"] and retry["params"] == lost["params"]
            assert trials_of(client, name)[retry["number"]]["retry_of"] == lost["number"]
            complete(client, retry, "w2")
            while (got := lease(client, "w3", study=name)) is not None:
                complete(client, got, "w3")
            states = [t["state"] for t in trials_of(client, name).values()]
            assert states.count("REPEAT") == 0 and "WAITING" not in states, states


def test_a_crash_between_enqueue_and_ask_of_a_starting_point_spends_nothing(
        db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's starting point leaves params to the sampler: Optuna's enqueue + ask. A service
    killed between the two leaves a WAITING trial; the restarted service plans the same point,
    takes that trial instead of enqueueing another, and the study's budget is spent on runs."""
    spec = {"name": "s", "baseline_seeds": 1, "n_trials": 3, "sampler": "random", "seed": 0, "space": "cpu",
            "starting_points": [{"batch_size": 32}], "remeasure": {"top_k": 0}, "pruning": {"enabled": False}}
    old = create_app(make_settings(db_url))
    with TestClient(old) as client:
        assert client.post("/v1/studies", json=spec).status_code == 201
        base = lease(client, "w0")
        assert base is not None
        complete(client, base, "w0")

        def die(*_a: Any, **_k: Any) -> Any:
            raise _Crash

        monkeypatch.setattr(optuna.Study, "ask", die)
        with pytest.raises(_Crash):
            lease(client, "w1")
        monkeypatch.undo()
        assert [t["state"] for t in trials_of(client).values()] == ["COMPLETE", "WAITING"]
    with TestClient(create_app(make_settings(db_url))) as client:
        point = lease(client, "w1")
        assert point is not None and point["config"]["batch_size"] == 32
        assert trials_of(client)[point["number"]]["starting_point"] == 0 and point["number"] == 1  # the WAITING one
        complete(client, point, "w1")
        while (got := lease(client, "w2")) is not None:
            complete(client, got, "w2")
        trials = trials_of(client)
        assert [t["state"] for t in trials.values()].count("WAITING") == 0
        assert sum(t["state"] in ("COMPLETE", "REPEAT") for t in trials.values()) == 3
        assert [t["starting_point"] for t in trials.values()].count(0) == 1
