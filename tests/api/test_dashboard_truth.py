"""bench/dashboard_truth.py: a study stored by the service, read with the stock Optuna API as
optuna-dashboard reads it, holds what was measured (and the check would see a placeholder)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from fastapi.testclient import TestClient
from service_helpers import complete, lease, make_settings
from sqlalchemy import create_engine, text

from autotune.api.main import create_app

ROOT = Path(__file__).resolve().parents[2]


def _check(db_url: str, tmp_path: Path) -> tuple[int, dict]:  # type: ignore[type-arg]
    out = tmp_path / "truth.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "dashboard_truth.py"), "--db", db_url, "--out",
                           str(out), "--png", str(tmp_path / "dashboard.png")],
                          capture_output=True, text=True, timeout=240, check=False)
    assert out.exists(), proc.stdout + proc.stderr
    return proc.returncode, json.loads(out.read_text())


def test_the_dashboard_reads_measured_points_only(tmp_path: Path) -> None:
    db_url = f"sqlite:///{tmp_path / 'autotune.db'}"
    with TestClient(create_app(make_settings(db_url))) as client:
        r = client.post("/v1/studies", json={"name": "s", "sampler": "random", "seed": 0, "n_trials": 6,
                                             "baseline_seeds": 1, "remeasure": {"top_k": 0},
                                             "space": {"params": {"batch_size": {"choices": [4, 8, 16]}}}})
        assert r.status_code == 201, r.text
        i = 0
        while (got := lease(client, "w")) is not None:
            size = got["config"].get("batch_size", 4)
            if size == 16:
                complete(client, got, "w", throughput=None, nrmse=None, failure={"kind": "oom", "message": "x"})
            else:
                complete(client, got, "w", throughput=50.0 * size + i, nrmse=0.1 + 0.001 * i)
            i += 1
    code, truth = _check(db_url, tmp_path)
    assert code == 0 and truth["ok"] and truth["problems"] == [], truth
    assert truth["states"]["COMPLETE"] >= 2 and truth["states"].get("FAIL", 0) + truth["states"].get("PRUNED", 0) >= 1
    assert truth["verdict"]["outcome"] == "not_judged"
    assert truth["front"] and truth["throughput_range"][0] > 0  # no placeholder (0, 10) point
    # a placeholder value, as an older service stored for every trial that was not a candidate
    engine = create_engine(db_url)
    with engine.begin() as connection:
        connection.execute(text("UPDATE trial_values SET value = 0.0 WHERE objective = 0 AND trial_id = 1"))
    engine.dispose()
    code, truth = _check(db_url, tmp_path)
    assert code == 1 and any("trial 0" in p and "not its measurement" in p for p in truth["problems"]), truth
