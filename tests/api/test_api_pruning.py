"""Pruning on report: api.study.pruning.decide over a per-trial report cache and a per-study summary,
and the decision stored on the report row and the trial."""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi import FastAPI
from fastapi.testclient import TestClient
from service_helpers import StudyFactory, complete, lease, probe_result
from sqlalchemy import select

from autotune.api.db import ReportRow
from autotune.api.service import TuningService
from autotune.api.study.pruning import StudySummary, TrialReports, decide
from autotune.contract.protocol import StudySpec

SPEC = StudySpec(name="s", probe={"samples": 1000})


def _reports(*points: tuple[float, float, float]) -> TrialReports:
    reports = TrialReports()
    for i, (samples, loss, throughput) in enumerate(points):
        reports.add(i, {"samples": samples, "loss": loss, "throughput": throughput})
    return reports


def test_finite_loss_keeps_the_trial() -> None:
    assert not decide(_reports((100, 0.3, 50.0)), None, SPEC).prune
    assert not decide(TrialReports(), None, SPEC).prune  # no loss reported: nothing to judge


def test_non_finite_loss_prunes_with_a_reason() -> None:
    for loss in (math.nan, math.inf):
        decision = decide(_reports((100, 0.5, 50.0), (200, loss, 50.0)), None, SPEC)
        assert decision.prune and decision.reason is not None and "diverged" in decision.reason


def test_slow_and_worse_than_the_best_feasible_prunes() -> None:
    summary = StudySummary(total_samples=1000)
    summary.add_feasible(200.0, [(100.0, 0.5), (300.0, 0.3), (1000.0, 0.1)])
    slow_worse = _reports((100, 0.6, 40.0), (200, 0.5, 45.0), (300, 0.45, 42.0))
    decision = decide(slow_worse, summary.reference(), SPEC)
    assert decision.prune and decision.rule == "dominated" and "cannot reach the front" in (decision.reason or "")
    fast = _reports((100, 0.6, 400.0), (200, 0.5, 390.0), (300, 0.45, 410.0))
    assert not decide(fast, summary.reference(), SPEC).prune
    disabled = SPEC.model_copy(update={"pruning": SPEC.pruning.model_copy(update={"enabled": False})})
    assert not decide(slow_worse, summary.reference(), disabled).prune


def test_loss_far_above_the_baseline_predicts_a_gate_failure() -> None:
    summary = StudySummary(total_samples=1000)
    summary.add_baseline([(100.0, 0.5), (500.0, 0.2)], None)
    summary.add_baseline([(100.0, 0.7), (500.0, 0.4)], None)  # mean curve: 0.6 → 0.3
    decision = decide(_reports((100, 0.7, 50.0), (400, 0.9, 50.0)), summary.reference(), SPEC)
    assert decision.prune and decision.rule == "gate"


def _report(client: TestClient, got: dict[str, Any], worker: str, step: int, samples: float, loss: float,
            throughput: float) -> dict[str, Any]:
    body = {"worker_id": worker, "step": step, "metrics": {"samples": samples, "loss": loss, "throughput": throughput}}
    r = client.post(f"/v1/trials/{got['trial_id']}/report", content=json.dumps(body),  # NaN allowed on the wire
                    headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_a_slow_trial_is_pruned_and_the_reason_is_stored(app: FastAPI, client: TestClient,
                                                          make_study: StudyFactory) -> None:
    make_study("s", probe={"samples": 1000}, n_trials=10)
    curve = [[100, 0.5], [300, 0.3], [1000, 0.1]]
    base = lease(client, "w0")
    assert base is not None
    client.post(f"/v1/trials/{base['trial_id']}/complete", json={"worker_id": "w0", "result": {
        **probe_result(base["config"], throughput=100.0, nrmse=0.1), "loss_curve": curve}}).raise_for_status()
    fast = lease(client, "w1")
    assert fast is not None
    client.post(f"/v1/trials/{fast['trial_id']}/complete", json={"worker_id": "w1", "result": {
        **probe_result(fast["config"], throughput=200.0, nrmse=0.1), "loss_curve": curve}}).raise_for_status()

    slow = lease(client, "w2")
    assert slow is not None
    assert _report(client, slow, "w2", 1, 100, 0.6, 40.0)["prune"] is False  # one window: not judged yet
    reply = _report(client, slow, "w2", 2, 300, 0.45, 42.0)
    assert reply["prune"] is True and "cannot reach the front" in reply["reason"]
    info = complete(client, slow, "w2", stopped_early=True)
    assert info["state"] == "PRUNED" and info["prune_reason"] == reply["reason"]
    listed = {t["number"]: t for t in client.get("/v1/studies/s/trials").json()["data"]}
    assert listed[slow["number"]]["prune_reason"] == reply["reason"]

    service: TuningService = app.state.service
    with service.db.read() as session:
        rows = session.scalars(select(ReportRow).where(ReportRow.trial_id == slow["trial_id"])
                               .order_by(ReportRow.id)).all()
        assert [(r.prune, r.prune_reason) for r in rows] == [(False, None), (True, reply["reason"])]

    nan = lease(client, "w3")
    assert nan is not None
    reply = _report(client, nan, "w3", 1, 100, math.nan, 500.0)
    assert reply["prune"] is True and "diverged" in reply["reason"]


def test_baselines_are_never_pruned_for_speed(client: TestClient, make_study: StudyFactory) -> None:
    make_study("s", probe={"samples": 1000}, baseline_seeds=2)
    base = lease(client, "w0")
    assert base is not None
    for step in range(1, 4):
        assert _report(client, base, "w0", step, 100 * step, 0.5, 1.0)["prune"] is False
