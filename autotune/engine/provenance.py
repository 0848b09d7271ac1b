"""What a probe records about where it ran, beyond the device name and torch version: the CUDA
and driver versions and the fingerprint of the model it built (ProbeResult.cuda_version,
driver_version, model_fingerprint; Recommendation.provenance). Read once during setup, never
in the timed windows. The hash itself is autotune.contract.provenance's (no torch there), so
the service and a later check compute it the same way.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from autotune.contract.provenance import model_fingerprint as fingerprint_of

log = logging.getLogger(__name__)

PROC_DRIVER_VERSION = Path("/proc/driver/nvidia/version")


def model_fingerprint(model: torch.nn.Module) -> str:
    """The fingerprint of `model`'s parameter names and shapes (global shapes under FSDP2: a
    DTensor's shape is the full parameter's)."""
    return fingerprint_of((name, tuple(p.shape)) for name, p in model.named_parameters())


def cuda_version() -> str | None:
    """The CUDA version torch was built with (None: a CPU build)."""
    return torch.version.cuda


def driver_version(device: torch.device) -> str | None:
    """The NVIDIA driver's version on a CUDA device: NVML's answer, else the kernel module's
    (/proc/driver/nvidia/version); None on a CPU or where neither answers. Never raises."""
    if device.type != "cuda":
        return None
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception as e:  # not installed, no driver library, an old NVML
        log.debug("driver version from NVML: %s", e)
    try:
        match = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", PROC_DRIVER_VERSION.read_text())
        return match.group(1) if match else None
    except OSError:
        return None
