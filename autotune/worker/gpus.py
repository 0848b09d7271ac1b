"""The worker's GPU groups: ``--device`` split into groups of ``--gpus-per-trial`` devices, one
lease loop each (`plan_groups`). ``--device cuda:0,1,2,3 --gpus-per-trial 2`` makes two groups
(GPUs 0,1 and 2,3), each with its own trials; ``--device cpu --gpus-per-trial 2`` runs 2 gloo
processes per trial (tests, smoke runs)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from autotune.engine.fork_server import without_secrets

COUNT_SCRIPT = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"


@dataclass(frozen=True)
class DeviceGroup:
    """The devices one lease loop runs its trials on.

    `devices` are torch device strings as the worker sees them (``cuda:2``, ``cpu``); a
    CPU group of N processes repeats ``cpu`` N times. `name` goes into the worker id."""

    devices: tuple[str, ...]

    @property
    def world_size(self) -> int:
        return len(self.devices)

    @property
    def is_cuda(self) -> bool:
        return self.devices[0].startswith("cuda")

    @property
    def name(self) -> str:
        if not self.is_cuda:
            return "cpu" if self.world_size == 1 else f"cpu-x{self.world_size}"
        if self.world_size == 1:
            return self.devices[0]
        return "cuda:" + ",".join(d.partition(":")[2] for d in self.devices)

    def visible_devices(self, environ: Mapping[str, str] | None = None) -> str:
        """CUDA_VISIBLE_DEVICES for this group's ranks: its GPUs in the numbering of the
        worker's own CUDA_VISIBLE_DEVICES, when the worker has one."""
        env = os.environ if environ is None else environ
        outer = [v.strip() for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        indices = [int(d.partition(":")[2]) for d in self.devices]
        return ",".join(outer[i] if i < len(outer) else str(i) for i in indices) if outer else \
            ",".join(map(str, indices))


def plan_groups(device: str, gpus_per_trial: int, cuda_count: Callable[[], int] | None = None) -> list[DeviceGroup]:
    """Split `device` (``cpu``, ``cuda``, ``cuda:N`` or ``cuda:0,1,...``) into groups of
    `gpus_per_trial` devices. ``cpu`` is one group of `gpus_per_trial` gloo processes;
    ``cuda`` means the current GPU for one GPU per trial, every visible GPU otherwise
    (`cuda_count` counts them). Raises ValueError naming the fix."""
    if gpus_per_trial < 1:
        raise ValueError(f"--gpus-per-trial {gpus_per_trial}: must be >= 1")
    if device == "cpu":
        return [DeviceGroup(("cpu",) * gpus_per_trial)]
    if device == "cuda" and gpus_per_trial == 1:
        return [DeviceGroup(("cuda",))]
    if device == "cuda":
        count = cuda_count() if cuda_count is not None else visible_cuda_count()
        if count == 0:
            raise ValueError("--device cuda: CUDA is not available on this host (no GPU visible); use --device cpu")
        indices = list(range(count))
    elif device.startswith("cuda:"):
        try:
            indices = [int(part) for part in device[5:].split(",")]
        except ValueError:
            raise ValueError(f"--device {device}: expected cuda:N or cuda:N,M,... (GPU indices)") from None
        if len(set(indices)) != len(indices) or min(indices) < 0:
            raise ValueError(f"--device {device}: each GPU index once, none negative")
    else:
        raise ValueError(f"unknown device {device!r}; use cpu, cuda, cuda:N or cuda:N,M,...")
    if not indices or len(indices) % gpus_per_trial:
        raise ValueError(f"--device {device} holds {len(indices)} GPU(s), not a multiple of --gpus-per-trial "
                         f"{gpus_per_trial}: list a multiple of {gpus_per_trial} GPUs (e.g. cuda:0,1 for 2)")
    return [DeviceGroup(tuple(f"cuda:{i}" for i in indices[k:k + gpus_per_trial]))
            for k in range(0, len(indices), gpus_per_trial)]



def visible_cuda_count() -> int:
    """How many GPUs this host shows (in a short-lived child: the worker never touches CUDA)."""
    proc = subprocess.run([sys.executable, "-c", COUNT_SCRIPT], capture_output=True, text=True, timeout=300,
                          check=False, env=without_secrets(os.environ))
    try:
        return int(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return 0

