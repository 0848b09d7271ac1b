"""`surely_no_gpu`: a host without a GPU runtime's device files is answered without torch.

* the rule on a folder standing in for /dev: empty, it says no GPU; any one of NVIDIA's, ROCm's,
  WSL2's or Jetson's device files makes it ask torch; a folder that is not there, too;
* on this host it never says "no GPU" where torch sees one;
* `autotune tune`'s device choice (`local_devices`) on a host without them: CPU workers, or the
  refusal of a spec naming a GPU, and torch never imported (it was 2-3 CPU-seconds a command).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autotune.worker.hardware import surely_no_gpu


@pytest.mark.skipif(sys.platform != "linux", reason="the rule reads Linux device files")
def test_no_device_file_means_no_gpu_and_any_one_means_ask_torch(tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("null", "tty0", "nvme0n1"):  # what every host has, a disk's name included
        (dev / name).write_text("")
    assert surely_no_gpu(str(dev))
    for name in ("nvidiactl", "nvidia0", "nvidia3", "nvidia-uvm", "kfd", "dxg", "nvhost-ctrl-gpu", "nvmap"):
        (dev / name).write_text("")
        assert not surely_no_gpu(str(dev)), name
        (dev / name).unlink()
    assert surely_no_gpu(str(dev))
    assert not surely_no_gpu(str(tmp_path / "no-such-dev"))


def test_it_never_says_no_gpu_where_torch_sees_one() -> None:
    assert not (surely_no_gpu() and torch.cuda.is_available())


LOCAL_DEVICES = """
import sys
from autotune.cli.local import TuneError, local_devices
print(local_devices(None, None).devices, local_devices("cpu", 3).devices)
try:
    local_devices("NVIDIA No Such GPU", None)
except TuneError as e:
    print("refused:", e)
print("torch imported:", "torch" in sys.modules)
"""


@pytest.mark.skipif(not surely_no_gpu(), reason="this host has a GPU's device files: torch is asked")
def test_tune_chooses_cpu_workers_without_importing_torch_where_there_is_no_gpu() -> None:
    done = subprocess.run([sys.executable, "-c", LOCAL_DEVICES], capture_output=True, text=True, timeout=120,
                          check=True)
    assert done.stdout.splitlines() == [
        "('cpu', 'cpu') ('cpu', 'cpu', 'cpu')",
        "refused: the spec's hardware is 'NVIDIA No Such GPU', and this host has no CUDA GPU: tune on a host with "
        "that GPU, or set hardware: cpu",
        "torch imported: False"], done.stdout + done.stderr
