"""The documented Python client of a running service (`from autotune import Client`): submit (a spec,
its dict or a YAML file), status, best, stop, over real HTTP."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from fastapi import FastAPI
from service_helpers import serve

from autotune import Client
from autotune.worker.client import Invalid, NotFound


def test_submit_status_best_stop(app: FastAPI, tmp_path: Path) -> None:
    spec = {"name": "py", "n_trials": 3, "baseline_seeds": 1, "space": {"params": {"batch_size": {"choices": [4, 8]}}}}
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(spec))
    with serve(app) as url, Client(url) as service:
        created = service.submit(str(tmp_path / "study.yaml"))
        assert created.name == "py" and created.state == "running" and created.spec.n_trials == 3
        assert service.submit({**spec, "name": "py2"}).name == "py2"
        assert service.status("py").counts == {}
        with pytest.raises(NotFound):
            service.best("py")  # no verdict before any trial
        assert service.stop("py").state == "stopped" and service.status("py").state == "stopped"
        with pytest.raises(Invalid) as bad:
            service.submit({**spec, "name": "py3", "n_trials": "many"})
        assert "n_trials" in bad.value.message  # named before anything was sent


def test_the_package_names_the_client_without_importing_torch() -> None:
    import subprocess
    import sys

    code = ("import sys, autotune\nfrom autotune import Client, ApiError\n"
            "assert Client.__module__ == 'autotune.worker.client' and issubclass(ApiError, Exception)\n"
            "assert 'torch' not in sys.modules and 'fastapi' not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
