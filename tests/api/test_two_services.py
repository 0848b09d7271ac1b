"""Two service processes on one PostgreSQL database (issue 36: no per-process cache that
another process can make stale). Each `TuningService` keeps its own caches (study contexts,
the gate, the pruning summary, the verdict replayed, the retry book, Optuna's trial cache); leases are taken from
one and completed through the other, reports go to either, and at the end both must give
the same answers: trials, front, verdict, counts, and what pruning compares with."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from service_helpers import lease, make_settings, probe_result, tuning_service

from autotune.api.main import create_app


@pytest.fixture
def two(pg_url: str) -> Iterator[tuple[TestClient, TestClient]]:
    with TestClient(create_app(make_settings(pg_url))) as a, TestClient(create_app(make_settings(pg_url))) as b:
        yield a, b


def test_two_service_processes_agree_on_everything(two: tuple[TestClient, TestClient]) -> None:
    a, b = two
    r = a.post("/v1/studies", json={"name": "s", "sampler": "tpe", "seed": 0, "n_trials": 8, "baseline_seeds": 2,
                                    "space": {"params": {"batch_size": {"choices": [4, 8, 16, 32]},
                                                         "accum_steps": {"choices": [1, 2]}}},
                                    "remeasure": {"top_k": 1, "windows": 5}})
    assert r.status_code == 201, r.text
    noise = itertools.cycle((1.0, 1.02, 0.98, 1.01, 0.99))
    leased: list[int] = []
    for i in itertools.count():
        first, other = (a, b) if i % 2 == 0 else (b, a)
        got = lease(first, f"w{i % 3}")
        if got is None:
            if lease(other, f"w{i % 3}") is None:
                break
            continue
        leased.append(got["trial_id"])
        # a report through either process: its pruning summary must know every complete so far
        r = other.post(f"/v1/trials/{got['trial_id']}/report",
                       json={"worker_id": f"w{i % 3}", "step": 1, "metrics": {"loss": 0.5, "samples": 40}})
        assert r.status_code == 200, r.text
        # a re-measurement the verdict still needs is never stopped, whichever process replayed the verdict
        assert got["role"] != "remeasure" or r.json()["prune"] is False, r.json()
        size = got["config"].get("batch_size", 4) * got["config"].get("accum_steps", 1)
        result = probe_result(got["config"], throughput=100.0 * size ** 0.5 * next(noise), nrmse=0.1)
        r = other.post(f"/v1/trials/{got['trial_id']}/complete", json={"worker_id": f"w{i % 3}", "result": result})
        assert r.status_code == 200, r.text
        assert i < 200, "the study never finished"
    assert len(leased) == len(set(leased))  # no trial leased twice
    for path in ("/v1/studies/s", "/v1/studies/s/trials", "/v1/studies/s/pareto", "/v1/studies/s/best?format=json"):
        assert a.get(path).json() == b.get(path).json(), path
    assert a.get("/v1/studies/s").json()["state"] == "finished"
    # what pruning compares with: the same in both, whichever process saw which complete
    services = [tuning_service(c.app) for c in (a, b)]  # type: ignore[arg-type]
    summaries = [svc._summary(svc._ctx(svc._record("s"))) for svc in services]
    assert summaries[0].learned == summaries[1].learned and summaries[0].learned
    assert summaries[0].best_feasible_throughput == summaries[1].best_feasible_throughput is not None
    assert len(summaries[0].baseline_curves) == len(summaries[1].baseline_curves) == 2
    # the verdict each replayed (what a re-measurement's report is judged by): the same in both
    replays = [svc._verdict_so_far(svc._ctx(svc._record("s"))) for svc in services]
    assert replays[0].status == replays[1].status and replays[0].status and not replays[0].pending
