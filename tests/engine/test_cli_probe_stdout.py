"""stdout carries only the result, whatever the workload prints.

`autotune probe --json` prints exactly one JSON object on stdout, and the probe child
(`python -m autotune.engine.probe_child`) writes only its JSON-line protocol there, even when the
workload prints: from its model's constructor (Python's print, a raw write to file
descriptor 1 and C's buffered printf) and from its dataset's ``__getitem__`` in a DataLoader worker process. All of
that goes to stderr instead (autotune/engine/stdout_guard.py; the child: `claim_stdout`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.engine.probe_child import ChildJob

PRINTY = '''
"""A workload that prints wherever a user's code may print."""

import ctypes
import os
import sys

import torch
from torch import nn
from torch.utils.data import Dataset

from autotune.contract.workload import TrainingDefaults, Workload

print("PRINTY imported", flush=True)
libc = ctypes.CDLL(None) if sys.platform.startswith("linux") else None


class Points(Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.rand(n, 4, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        print(f"PRINTY getitem {i} pid={os.getpid()}")  # no flush: a worker's buffered stdout
        return {"x": self.x[i], "y": self.y[i]}


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)
        print(f"PRINTY model with {sum(p.numel() for p in self.parameters())} parameters pid={os.getpid()}")
        os.write(1, b"PRINTY raw write to fd 1\\n")  # below Python's sys.stdout, as C code writes
        if libc is not None:  # C's own buffered stdout (fully buffered on a pipe)
            libc.printf(b"PRINTY libc printf\\n")

    def forward(self, batch: dict, with_aux: bool = True) -> dict:
        loss = nn.functional.mse_loss(self.net(batch["x"]), batch["y"])
        return {"total": loss}


class Printy(Workload):
    name = "printy"
    quality_metric = "val_loss"

    def __init__(self, preset: str) -> None:
        if preset != "tiny":
            raise ValueError(f"unknown preset {preset!r} for workload 'printy'; known: tiny")
        self.preset = preset

    @property
    def defaults(self) -> TrainingDefaults:
        return TrainingDefaults(batch_size=4, accum_steps=1, lr=1e-2, samples=48)

    def build_model(self) -> nn.Module:
        return Model()

    def datasets(self, seed: int) -> tuple[Dataset, Dataset]:
        return Points(64, seed=1), Points(16, seed=2)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, val: Dataset, device: torch.device) -> float:
        assert isinstance(val, Points)
        return float(nn.functional.mse_loss(model.net(val.x.to(device)), val.y.to(device)))
'''

PROBE = ["--samples", "48", "--windows", "5", "--warmup-steps", "5"]  # 12 steps of batch 4: 5 warm-up + 7 timed


@pytest.fixture
def printy_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a process that knows workload `printy` (a module in tmp_path)."""
    (tmp_path / "printy_workload.py").write_text(PRINTY)
    env = dict(os.environ)
    env["AUTOTUNE_WORKLOADS"] = "printy=printy_workload:Printy"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    env.pop("PYTHONUNBUFFERED", None)  # piped stdout is block-buffered, as it is for a user's pipe
    return env


def assert_the_workload_printed_to_stderr(stderr: str) -> None:
    assert "PRINTY imported" in stderr
    assert "PRINTY raw write to fd 1" in stderr
    if sys.platform.startswith("linux"):
        assert "PRINTY libc printf" in stderr
    model = re.search(r"PRINTY model with \d+ parameters pid=(\d+)", stderr)
    assert model, stderr[-3000:]
    workers = {pid for pid in re.findall(r"PRINTY getitem \d+ pid=(\d+)", stderr)}
    assert workers and model.group(1) not in workers, "the items are loaded in a DataLoader worker process"


def test_probe_json_prints_one_object_on_stdout_whatever_the_workload_prints(printy_env: dict[str, str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "autotune.cli", "probe", "--workload", "printy", "--preset", "tiny",
                           "--device", "cpu", "--config", '{"num_workers": 1}', *PROBE, "--json"],
                          capture_output=True, text=True, env=printy_env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PRINTY" not in proc.stdout
    assert len(proc.stdout.strip().splitlines()) == 1, proc.stdout[:3000]
    data = json.loads(proc.stdout)
    assert isinstance(data, dict)
    assert data["failure"] is None
    assert data["workload"] == "printy" and data["config"]["num_workers"] == 1
    assert data["samples_trained"] == 48 and data["throughput_samples_per_s"] > 0
    assert_the_workload_printed_to_stderr(proc.stderr)


def test_probe_table_alone_is_on_stdout(printy_env: dict[str, str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "autotune.cli", "probe", "--workload", "printy",
                           "--config", '{"num_workers": 1}', *PROBE],
                          capture_output=True, text=True, env={**printy_env, "COLUMNS": "200"}, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PRINTY" not in proc.stdout
    assert "probe: printy/tiny on cpu" in proc.stdout and "48 in 12 steps" in proc.stdout
    assert_the_workload_printed_to_stderr(proc.stderr)


def test_probe_child_protocol_is_unharmed_by_a_printing_workload(printy_env: dict[str, str]) -> None:
    """The worker's probe child points fd 1 at stderr before it imports anything of the workload."""
    job = ChildJob(workload="printy", preset="tiny", config={"num_workers": 1}, device="cpu",
                   probe={"samples": 48, "windows": 5, "warmup_steps": 5, "timeout_s": 120.0}, threads=1)
    proc = subprocess.run([sys.executable, "-m", "autotune.engine.probe_child"], input=job.to_json(),
                          capture_output=True,
                          text=True, env=printy_env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    messages = [json.loads(line) for line in proc.stdout.splitlines()]  # every stdout line is protocol
    assert [m["type"] for m in messages if m["type"] != "progress"] == ["report"] * 5 + ["result"]
    result = messages[-1]["result"]
    assert result["failure"] is None and result["samples_trained"] == 48
    assert_the_workload_printed_to_stderr(proc.stderr)
