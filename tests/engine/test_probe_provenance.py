"""The probe's provenance (autotune.engine.provenance): the model fingerprint of what the
workload builds, the CUDA and driver versions, and a real CPU probe that records them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import autotune.engine.provenance as provenance
from autotune.contract.provenance import model_fingerprint as fingerprint_of
from autotune.contract.registry import Workload
from autotune.contract.results import TrialResult
from autotune.engine.probe import ProbeSettings, run_probe
from autotune.engine.provenance import driver_version, model_fingerprint


def _build(wl: Workload, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return wl.build_model()


def test_the_fingerprint_of_a_built_model_is_stable_and_sees_a_resized_layer(tiny: Workload) -> None:
    first, second = _build(tiny), _build(tiny)
    fp = model_fingerprint(first)
    assert fp == model_fingerprint(second) == model_fingerprint(_build(tiny, seed=1))  # weights do not count
    assert fp == fingerprint_of((n, tuple(p.shape)) for n, p in first.named_parameters())
    # resize one Linear layer: another model
    name, layer = next((n, m) for n, m in second.named_modules() if isinstance(m, torch.nn.Linear))
    parent = second.get_submodule(name.rpartition(".")[0]) if "." in name else second
    setattr(parent, name.rpartition(".")[2], torch.nn.Linear(layer.in_features, layer.out_features + 1))
    assert model_fingerprint(second) != fp


def test_no_driver_version_on_a_cpu_and_the_kernel_modules_without_nvml(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    assert driver_version(torch.device("cpu")) is None
    version = tmp_path / "version"
    version.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"
                       "GCC version:  gcc version 12.3.0\n")
    monkeypatch.setattr(provenance, "PROC_DRIVER_VERSION", version)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # no nvidia-ml-py: NVML does not answer
    assert driver_version(torch.device("cuda", 0)) == "550.54.15"
    monkeypatch.setattr(provenance, "PROC_DRIVER_VERSION", tmp_path / "absent")
    assert driver_version(torch.device("cuda", 0)) is None


def test_a_cpu_probe_records_its_provenance(tiny: Workload) -> None:
    r = run_probe("ups", {"batch_size": 4, "accum_steps": 1}, preset="tiny",
                  settings=ProbeSettings(samples=40, warmup_steps=2, windows=5))
    assert r.ok
    assert r.torch_version == torch.__version__ and r.cuda_version == torch.version.cuda
    assert r.driver_version is None and r.gpu_count == 0 and r.device.startswith("cpu")
    assert r.model_fingerprint == model_fingerprint(_build(tiny))  # the model the probe built, by the same hash
    sent = TrialResult.model_validate(r.to_dict()).as_dict()  # the wire form keeps them
    assert sent["model_fingerprint"] == r.model_fingerprint and sent["gpu_count"] == 0
    assert "cuda_version" in sent and "driver_version" in sent
