"""The contract on every backend (SQLite file, PostgreSQL), through a real uvicorn server:
concurrent leases never hand out one trial twice, and a study runs end to end."""

from __future__ import annotations

import json
import ssl
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from service_helpers import make_settings, probe_result, serve

from autotune.api.main import create_app
from autotune.contract.config import normalised

N_WORKERS = 50


def _lease_all(base_url: str, worker_ids: list[str]) -> list[httpx.Response]:
    """POST /v1/trials/lease for every worker id at once (one thread and connection each). The
    service speaks plain HTTP: each client gets a bare TLS context it never uses, as
    autotune.worker.client does, not httpx's default one (the CA bundle loaded: ~33 ms of CPU
    per client, 170 clients per backend here). The leases are answered one after another, so the
    last waits for all the others (the whole test takes 12-17 s on an idle 2-core host; one request
    passed 60 s once on oversubscribed cores): the timeout ends a hung test, it does not time the
    service."""
    barrier = threading.Barrier(len(worker_ids))

    def one(worker_id: str) -> httpx.Response:
        with httpx.Client(base_url=base_url, timeout=300, verify=ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)) as http:
            barrier.wait()  # release every request together
            return http.post("/v1/trials/lease", json={"worker_id": worker_id, "hardware": "cpu"})

    with ThreadPoolExecutor(len(worker_ids)) as pool:
        return list(pool.map(one, worker_ids))


def test_concurrent_leases_never_share_a_trial(db_url: str) -> None:
    app = create_app(make_settings(db_url))
    with serve(app) as base_url:
        # budget to spare: a draw of a config already in flight is held, not leased, and counts toward n_trials
        httpx.post(f"{base_url}/v1/studies", json={"name": "race", "n_trials": 2 * N_WORKERS}).raise_for_status()
        workers = [f"w{i:02d}" for i in range(N_WORKERS)]
        # the 3 baseline seeds first: nothing else is handed out until they are all done
        first = _lease_all(base_url, workers)
        assert sorted(r.status_code for r in first) == [200] * 3 + [204] * (N_WORKERS - 3)
        baselines = {w: r.json() for w, r in zip(workers, first, strict=True) if r.status_code == 200}
        assert sorted(b["number"] for b in baselines.values()) == [0, 1, 2]
        assert all(b["role"] == "baseline" and b["is_baseline"] for b in baselines.values())
        assert sorted(b["probe"]["seed"] for b in baselines.values()) == [0, 1, 2]
        with httpx.Client(base_url=base_url, timeout=60) as http:
            for w, b in baselines.items():
                http.post(f"/v1/trials/{b['trial_id']}/complete",
                          json={"worker_id": w, "result": probe_result(b["config"])}).raise_for_status()
        replies = _lease_all(base_url, workers)
        assert [r.status_code for r in replies] == [200] * N_WORKERS, [r.text for r in replies if r.status_code != 200]
        leases = [r.json() for r in replies]
        assert len({x["trial_id"] for x in leases}) == N_WORKERS
        assert min(x["number"] for x in leases) == 3 and len({x["number"] for x in leases}) == N_WORKERS
        assert len({json.dumps(normalised(x["config"]), sort_keys=True) for x in leases}) == N_WORKERS  # no twins
        assert sum(x["is_baseline"] for x in leases) == 0

        # the same workers asking again, all at once, get their own trial back
        again = _lease_all(base_url, workers)
        assert [r.json()["trial_id"] for r in again] == [x["trial_id"] for x in leases]
        study = httpx.get(f"{base_url}/v1/studies/race").json()
        # RUNNING: the leased trials, and any held draw of a config in flight (never leased)
        assert study["counts"]["COMPLETE"] == 3 and study["counts"]["RUNNING"] >= N_WORKERS


def test_one_worker_asking_many_times_at_once_gets_one_trial(db_url: str) -> None:
    app = create_app(make_settings(db_url))
    with serve(app) as base_url:
        httpx.post(f"{base_url}/v1/studies", json={"name": "dup", "n_trials": 100}).raise_for_status()
        replies = _lease_all(base_url, ["w1"] * 10 + ["w2"] * 10)
        assert all(r.status_code == 200 for r in replies)
        ids = Counter((r.json()["trial_id"], r.json()["study"]) for r in replies)
        assert sorted(ids.values()) == [10, 10]
        assert httpx.get(f"{base_url}/v1/studies/dup").json()["counts"] == {"RUNNING": 2}


def test_a_study_end_to_end(db_url: str) -> None:
    """Baseline, search, then the verdict: the fastest feasible config and the baseline
    re-measured in two rounds (the second only once the first is in), and the config certified."""
    app = create_app(make_settings(db_url))
    with serve(app) as base_url, httpx.Client(base_url=base_url, timeout=60) as http:
        assert http.get("/v1/health").json()["db"] == db_url.split(":")[0].split("+")[0]
        assert http.post("/v1/studies", json={"name": "e2e", "n_trials": 4, "seed": 1, "baseline_seeds": 1,
                                                      "remeasure": {"top_k": 1}}).status_code == 201
        assert http.post("/v1/studies", json={"name": "e2e"}).status_code == 409

        def run(expected_number: int | None, throughput: float, nrmse: float) -> dict[str, Any]:
            got: dict[str, Any] = http.post("/v1/trials/lease", json={"worker_id": "w", "hardware": "cpu"}).json()
            tid = got["trial_id"]
            assert http.post(f"/v1/trials/{tid}/heartbeat", json={"worker_id": "w"}).json()["action"] == "continue"
            reply = http.post(f"/v1/trials/{tid}/report", json={"worker_id": "w", "step": 5, "metrics": {"loss": 1.0}})
            assert reply.json()["prune"] is False
            result = probe_result(got["config"], throughput=throughput, nrmse=nrmse)
            info: dict[str, Any] = http.post(f"/v1/trials/{tid}/complete",
                                             json={"worker_id": "w", "result": result}).json()
            assert info["state"] == "COMPLETE" and (expected_number is None or info["number"] == expected_number)
            return info

        measured: list[tuple[float, float]] = [(100.0, 0.1), (180.0, 0.105), (250.0, 0.3), (90.0, 0.1)]
        for i, (throughput, nrmse) in enumerate(measured):
            run(i, throughput, nrmse)
        assert http.get("/v1/studies/e2e").json()["state"] == "running"  # the verdict is to come
        assert http.get("/v1/studies/e2e/best").status_code == 404
        # round 0: trial 1 (the fastest feasible) then the baseline; round 1 reversed; round 2 as round 0
        remeasured = [(1, 178.0, 0.1), (0, 99.0, 0.1), (0, 101.5, 0.1), (1, 183.0, 0.101), (1, 181.0, 0.1),
                      (0, 100.5, 0.1)]
        for number, throughput, nrmse in remeasured:
            info = run(None, throughput, nrmse)
            assert (info["role"], info["remeasure_of"]) == ("remeasure", number)
        assert http.post("/v1/trials/lease", json={"worker_id": "w", "hardware": "cpu"}).status_code == 204
        study = http.get("/v1/studies/e2e").json()
        assert study["state"] == "finished" and study["counts"] == {"COMPLETE": 10}
        best = http.get("/v1/studies/e2e/best").json()
        assert best["certified"] is True and best["trial_number"] == 1 and best["rounds_run"] == 3
        speedup = (178.0 * 183.0 * 181.0) ** (1 / 3) / (100.0 * 99.0 * 101.5 * 100.5) ** (1 / 4)  # geometric means
        assert abs(best["speedup"] - speedup) < 1e-9 and best["speedup_ci_low"] > 1.0
        # the front: candidates only (not the baseline 0, not the infeasible 2), 1 at its re-measured values
        front = {t["number"]: t for t in http.get("/v1/studies/e2e/pareto").json()["data"]}
        assert set(front) == {1, 3}
        assert abs(front[1]["throughput_samples_per_s"] - (178.0 * 183.0 * 181.0) ** (1 / 3)) < 1e-9
