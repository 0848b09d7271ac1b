"""Helpers shared by the service tests (tests/api is on sys.path while they run)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.testclient import TestClient
from live_service import free_port

from autotune.api.service import TuningService
from autotune.api.settings import Settings

StudyFactory = Callable[..., dict[str, Any]]  # the make_study fixture: make_study(name, **spec) -> StudyInfo


def make_settings(db_url: str, **overrides: Any) -> Settings:
    """Settings for a test app: auth off (these tests are about the service's logic; tests/api/test_auth.py
    covers auth) and a long reaper interval (tests call reap_stale() themselves)."""
    return Settings(db_url=db_url, **{"reaper_interval_s": 3600.0, "auth": False, **overrides})


def tuning_service(app: FastAPI) -> TuningService:
    """The app's TuningService (what the routes call), for a test to reach past the HTTP API."""
    service: TuningService = app.state.service
    return service


@contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """Run `app` with a real uvicorn server on a free port in a thread; yields its base URL."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=20)


def probe_result(config: dict[str, Any] | None = None, throughput: float | None = 100.0, nrmse: float | None = 0.1,
                 failure: dict[str, str] | None = None, stopped_early: bool = False,
                 notes: list[str] | None = None) -> dict[str, Any]:
    """A fake ProbeResult.to_dict() (the API is under test here, not the probe)."""
    return {
        "workload": "ups", "preset": "tiny", "config": {**(config or {}), "effective_batch": 8},
        "device": "cpu (test)", "torch_version": "0.0-test", "throughput_samples_per_s": throughput,
        "throughput_spread": 0.02, "window_throughputs": [], "val_nrmse": nrmse, "quality_metric": "val_nrmse",
        "warmup_s": 1.5, "setup_s": 0.1, "process_start_s": 0.5, "train_s": 3.0, "peak_mem_reserved_bytes": 2**30,
        "peak_mem_allocated_bytes": 2**29, "data_wait_fraction": 0.01, "window_data_wait_s": [0.01],
        "window_gpu": [{"sm_clock_mhz": 1410, "temperature_c": 80, "power_w": 690.0, "throttled_fraction": 0.3}],
        "measurement_notes": notes or [], "loss_curve": [[1, 0.5]],
        "samples_trained": 80, "steps": 10, "warmup_steps": 5, "window_steps": 1, "inverse_steps": 10,
        "knobs": {"precision": "fp32 (TF32 off)"}, "stopped_early": stopped_early, "failure": failure,
    }


def trials_of(client: TestClient, study: str = "s") -> dict[int, dict[str, Any]]:
    """GET /v1/studies/{study}/trials: the study's trials by their number."""
    return {t["number"]: t for t in client.get(f"/v1/studies/{study}/trials").json()["data"]}


def lease(client: TestClient, worker_id: str, hardware: str = "cpu", study: str | None = None) -> dict[str, Any] | None:
    """POST /v1/trials/lease: the TrialLease, or None on 204."""
    body: dict[str, Any] = {"worker_id": worker_id, "hardware": hardware}
    if study is not None:
        body["study"] = study
    r = client.post("/v1/trials/lease", json=body)
    if r.status_code == 204:
        assert r.content == b""
        return None
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def complete(client: TestClient, lease_: dict[str, Any], worker_id: str, **result: Any) -> dict[str, Any]:
    """Complete a leased trial with a fake result built from its config; asserts 200."""
    r = client.post(f"/v1/trials/{lease_['trial_id']}/complete",
                    json={"worker_id": worker_id, "result": probe_result(lease_["config"], **result)})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out
