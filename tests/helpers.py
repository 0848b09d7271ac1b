"""Small helpers shared by the tests (importable because pytest puts tests/ on sys.path)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import default_collate

from autotune.config import TrainConfig
from autotune.workloads import Workload

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parent.parent


def run_bench(script: str, *args: str, cwd: Path | None = None,
              timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run bench/`script` with `args` in a fresh Python process (the repository on its path) and
    require it to exit 0; its output is in the assertion message otherwise."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def micro_batches(items: list[dict[str, torch.Tensor]], batch_size: int) -> list[dict[str, torch.Tensor]]:
    """Cut `items` into consecutive micro-batches of `batch_size` (collated like a DataLoader)."""
    return [default_collate(items[i:i + batch_size]) for i in range(0, len(items), batch_size)]


def resolved(workload: Workload, **knobs: Any) -> TrainConfig:
    """A TrainConfig with the given knobs and the workload preset's defaults for the rest."""
    d = workload.defaults
    return TrainConfig(**knobs).resolve(d.batch_size, d.accum_steps, d.lr)


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter's gradient (all parameters must have one)."""
    out = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} has no gradient"
        out[name] = p.grad.detach().clone()
    return out
