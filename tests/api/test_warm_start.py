"""Warm starts through the service: a study that names an earlier one (or 'auto') tries the earlier
study's certified pick and front first, right after its baseline, measured again, and says so."""

from __future__ import annotations

import itertools
import math
from typing import Any

from fastapi.testclient import TestClient
from service_helpers import StudyFactory, complete, lease

SPACE = {"params": {"fused_optimizer": {"choices": [False, True]}, "batch_size": {"choices": [8, 16]},
                    "accum_steps": {"choices": [1, 2]}}}
BASE = {"fused_optimizer": False, "batch_size": 8, "accum_steps": 2}
COMMON: dict[str, Any] = {"space": SPACE, "baseline": BASE, "starting_points": "none", "sampler": "random"}
WIN = {"fused_optimizer": True, "batch_size": 16, "accum_steps": 1}  # the planted truth: 2x, same quality


def _answer(client: TestClient, study: str, got: dict[str, Any], worker: str, z: float) -> None:
    config = got["config"]
    win = all(config.get(k) == v for k, v in WIN.items())
    throughput = (200.0 if win else 100.0) * math.exp((0.02 if win else 0.15) * z)
    complete(client, got, worker, throughput=throughput, nrmse=0.1 + 0.001 * (got["probe"]["seed"] % 3))


def _finish(client: TestClient, study: str, limit: int = 200) -> None:
    """Answer every lease of `study` from the planted truth until it is finished."""
    noise = itertools.cycle([-1.0, 1.0, 0.3, -0.3, 0.8, -0.8])
    for i in itertools.count():
        assert i < limit, "the study did not finish"
        got = lease(client, f"w{i}", study=study)
        if got is None:
            if client.get(f"/v1/studies/{study}").json()["state"] == "finished":
                return
            continue
        _answer(client, study, got, f"w{i}", next(noise))


def _first_search(client: TestClient, study: str) -> dict[str, Any]:
    worker = f"x-{study}"  # a worker per study: one that holds a trial gets it back when it asks again
    base = lease(client, worker, study=study)
    assert base is not None and base["role"] == "baseline"
    complete(client, base, worker, throughput=100.0, nrmse=0.1)
    got = lease(client, worker, study=study)
    assert got is not None and got["role"] == "search"
    return got


def test_a_warm_start_tries_the_earlier_studys_pick_first_and_says_so(client: TestClient,
                                                                      make_study: StudyFactory) -> None:
    # study 'a', finished with its planted win certified (one earlier study serves every case below)
    make_study("a", n_trials=8, baseline_seeds=3, seed=0, **COMMON, remeasure={"top_k": 1, "max_rounds": 4})
    _finish(client, "a")
    best = client.get("/v1/studies/a/best").json()
    assert best["certified"] is True and {k: best["config"][k] for k in WIN} == WIN

    for name, warm_start in (("named", ["a"]), ("auto", "auto")):
        make_study(name, n_trials=6, seed=7, **COMMON, warm_start=warm_start)
        got = _first_search(client, name)
        assert {k: got["config"][k] for k in WIN} == WIN, name  # a's certified pick, right after the baseline
        complete(client, got, f"x-{name}", throughput=210.0, nrmse=0.1)  # measured again here: its own numbers
        trials = client.get(f"/v1/studies/{name}/trials").json()["data"]
        assert trials[1]["warm_start_from"] == "a" and trials[1]["starting_point"] == 0
        assert trials[1]["throughput_samples_per_s"] == 210.0  # never the earlier study's measurement
        assert trials[0]["warm_start_from"] is None

    # without a warm start, or 'auto' for another preset (a is the tiny preset's): the sampler draws first
    for name, extra in (("cold", {}), ("other-preset", {"preset": "full", "warm_start": "auto"})):
        make_study(name, n_trials=6, seed=7, **{**COMMON, **extra})
        _first_search(client, name)
        trials = client.get(f"/v1/studies/{name}/trials").json()["data"]
        assert trials[1]["warm_start_from"] is None and trials[1]["starting_point"] is None, name


def test_a_warm_start_naming_an_unknown_study_or_itself_is_refused(client: TestClient) -> None:
    r = client.post("/v1/studies", json={"name": "b", **COMMON, "warm_start": ["nope"]})
    assert r.status_code == 422 and "nope" in r.text and "warm_start" in r.text
    r = client.post("/v1/studies", json={"name": "b", **COMMON, "warm_start": ["b"]})
    assert r.status_code == 422 and "is this study" in r.text
