"""Helpers shared by the benchmarks that run real studies (pruning.py, tuning.py, service_load.py):
a free port, the hardware class a worker on a device reports, the run's environment, and
waiting for a freshly started service."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import time
from typing import Any

import httpx

from autotune.host_telemetry import cpu_model


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def hardware_class(device: str) -> str:
    """What a worker on `device` reports as its hardware class: "cpu", or the GPU's name."""
    if device == "cpu":
        return "cpu"
    import torch

    return str(torch.cuda.get_device_name(torch.device(device)))


def environment(device: str) -> dict[str, Any]:
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "device": device,
            "gpu": hardware_class(device), "host": platform.node(), "cpu": cpu_model(), "cpu_count": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def wait_healthy(http: httpx.Client, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    """Return once GET /v1/health answers 200; exit if the service process dies or never does."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the service exited with {proc.returncode}; see its log")
        try:
            if http.get("/v1/health").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("the service did not become healthy")


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend (benchmarks write PNGs, never open windows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
