"""What a worker runs on, and the hardware class that decides which studies it may serve.

Throughputs measured on different GPUs are not comparable, so a study names one hardware
class and only workers of that class get its trials. The class is ``cpu`` or the CUDA
device name (e.g. ``NVIDIA H100 80GB HBM3``).
"""

from __future__ import annotations

import glob
import os
import platform
import socket
import sys
from dataclasses import asdict, dataclass
from typing import Any

from autotune.engine.host_telemetry import cpu_model


@dataclass(frozen=True)
class Hardware:
    hardware_class: str
    device: str
    device_name: str
    memory_bytes: int | None
    torch_version: str
    hostname: str
    cpu_count: int | None
    cpu_model: str | None = None  # host-bound configs run at the speed of this CPU

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        mem = f", {self.memory_bytes / 2**30:.0f} GiB" if self.memory_bytes else ""
        cpu = f", {self.cpu_model}" if self.cpu_model else ""
        return f"{self.device_name}{mem} on {self.hostname}{cpu} (torch {self.torch_version})"


def installed_torch_version() -> str | None:
    """torch's version as its installed distribution records it (the string torch.__version__
    holds), without importing torch; None where torch is not an installed distribution."""
    import importlib.metadata

    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


# The device files through which a GPU runtime that torch.cuda can use reaches its devices on Linux:
# NVIDIA's driver (/dev/nvidiactl, /dev/nvidiaN), ROCm (/dev/kfd: a ROCm build of torch answers to
# torch.cuda), WSL2's GPU (/dev/dxg) and NVIDIA Jetson's integrated GPU (/dev/nvhost-*, /dev/nvmap).
GPU_DEVICE_FILES = ("nvidia*", "kfd", "dxg", "nvhost-*", "nvmap")


def surely_no_gpu(dev: str = "/dev") -> bool:
    """True where this host certainly has no GPU for torch.cuda: Linux, with none of
    `GPU_DEVICE_FILES` in `dev`. Answered without importing torch (2-3 CPU-seconds); False, so
    ask torch, on any other system or where `dev` cannot be read."""
    if sys.platform != "linux" or not os.path.isdir(dev):
        return False
    return not any(glob.glob(os.path.join(glob.escape(dev), pattern)) for pattern in GPU_DEVICE_FILES)


def detect_cpu(torch_version: str) -> Hardware:
    """The CPU device: no question for torch but its version, so no torch import."""
    name = f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    return Hardware(hardware_class="cpu", device="cpu", device_name=name, memory_bytes=None,
                    torch_version=torch_version, hostname=socket.gethostname(), cpu_count=os.cpu_count(),
                    cpu_model=cpu_model())


def detect(device: str = "cpu") -> Hardware:
    """Inspect `device` (cpu, cuda, cuda:N). Imports torch."""
    import torch

    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: CUDA is not available on this host; use --device cpu")
        dev = torch.device(device)
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return Hardware(hardware_class=props.name, device=f"cuda:{index}", device_name=props.name,
                        memory_bytes=props.total_memory, torch_version=torch.__version__,
                        hostname=socket.gethostname(), cpu_count=os.cpu_count(), cpu_model=cpu_model())
    if device != "cpu":
        raise ValueError(f"unknown device {device!r}; use cpu, cuda or cuda:N")
    return detect_cpu(torch.__version__)
