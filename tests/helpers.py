"""Small helpers shared by the tests (importable because pytest puts tests/ on sys.path)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import default_collate

from autotune.contract.config import TrainConfig
from autotune.contract.registry import Workload
from autotune.engine.compile_workers import children

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parent.parent


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children first, then theirs), found through /proc."""
    found, frontier = [], [pid]
    while frontier:
        below = [child for parent in frontier for child in children(parent)]
        found += below
        frontier = below
    return found


def run_bench(script: str, *args: str, cwd: Path | None = None,
              timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run bench/`script` with `args` in a fresh Python process (the repository on its path) and
    require it to exit 0; its output is in the assertion message otherwise. Past `timeout` s
    the script and everything it started (services, workers, probes, whatever their session)
    are killed, and the test fails with the script's output so far."""
    argv = [sys.executable, str(ROOT / "bench" / script), *args]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for pid in [proc.pid, *descendants(proc.pid)]:  # read before any dies: orphans leave the tree
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise AssertionError(f"bench/{script} ran past {timeout:.0f} s: killed with everything it started\n"
                                 + out[-3000:] + err[-3000:]) from None
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


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


def section(text: str, heading: str) -> str:
    """The body of the Markdown section `## heading...` of `text`, up to the next `## `."""
    match = re.search(rf"^## {re.escape(heading)}.*?$(.*?)(?=^## |\Z)", text, flags=re.MULTILINE | re.DOTALL)
    assert match, f"the text lost its section {heading!r}"
    return match.group(1)


def bash_blocks(text: str) -> list[str]:
    """The bodies of the ```bash fences of a Markdown text, in order."""
    return re.findall(r"^```bash\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


COMPOSE_VARIABLE = re.compile(r"\$(?:\$|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:-|:\?)(?P<arg>[^}]*))?\})")


def compose_substitute(text: str, env: dict[str, str]) -> str:
    """Compose's variable interpolation in one string: ${VAR}, ${VAR:-default}, ${VAR:?error};
    `$$` is a literal `$`."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, arg = match.group("name", "op", "arg")
        if env.get(name):
            return env[name]
        if op == ":?":
            raise ValueError(f"required variable {name} is missing: {arg}")
        return arg if op == ":-" else ""

    return COMPOSE_VARIABLE.sub(replace, text)
