"""Fixtures shared by every test (tests/api/conftest.py adds the service's own).

* Generated PDE data goes to one session-scoped temporary directory (``AUTOTUNE_DATA_DIR``),
  so it is generated once per session, never in the home directory, and subprocesses
  started by tests inherit the same cache.
* Tests marked ``gpu`` are skipped when CUDA is not available.
* ``processes``: the subprocesses a test starts (tests/live_service.py), all stopped after it;
  ``module_processes``: those a whole module shares (a service its tests each submit their own
  study to), stopped after its last test.
* The process-global torch switches that knobs set (TF32, matmul precision,
  cudnn.benchmark) are restored after every test, so no test leaks into another.
* Torch runs one intra-op thread in every test process and every process a test starts
  (OMP_NUM_THREADS=1, inherited), as a worker's `--threads 1` probes do. The models here are
  tiny, and `make test` runs one test process per core: with torch's default of a thread per
  core, each process's OpenMP threads spin for cores the other holds (a 320-sample CPU probe
  took 25 s so on a busy 2-core host, 2.6 s with one thread). Tests that set threads on
  purpose (a worker's `--threads`, a distributed probe's ranks) still pass their own.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported: see the docstring

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import CPU, resolved
from live_service import Processes
from torch.utils.data import Dataset

from autotune.contract.registry import Workload, get_workload
from autotune.engine.knobs import Trainer, build_optimizer

torch.set_num_threads(1)  # should torch have been imported before this file (a plugin)

pytest_plugins = ("cpu_by_module",)  # --cpu-by-module PATH: the CPU seconds of each test module


@pytest.fixture(scope="session", autouse=True)
def autotune_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    path = tmp_path_factory.mktemp("autotune-data")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AUTOTUNE_DATA_DIR", str(path))
        yield path


@pytest.fixture(autouse=True)
def worker_spool(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test's workers (in-process or started as subprocesses, which inherit the
    environment) spool into a folder of their own: never the user's ~/.local/state, and never
    a folder another test (or another xdist process) writes the same trial ids into."""
    path = tmp_path_factory.mktemp("spool")
    monkeypatch.setenv("AUTOTUNE_SPOOL_DIR", str(path))
    return path


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    """The test's subprocesses (services, workers), each in its own session with a log in
    tmp_path; every one still running is stopped after the test, whatever its outcome."""
    procs = Processes(tmp_path)
    try:
        yield procs
    finally:
        procs.stop_all()


@pytest.fixture(scope="module")
def module_processes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Processes]:
    """Subprocesses a module's tests share, logging into a folder of the module's own; every one
    still running is stopped after the module's last test. Shared because a start is not free:
    `autotune serve` takes about 2 CPU-seconds to a healthy /v1/health with its tokens (3-4 on
    a slow host), which tests that each submit a study of their own need not pay each."""
    procs = Processes(tmp_path_factory.mktemp("module-processes"))
    try:
        yield procs
    finally:
        procs.stop_all()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the tests for pytest-xdist. `make test` runs ``-n auto --dist loadscope``: each test
    process takes a whole module (or class) at a time, so a module-scoped fixture (a live
    service, a finished study) is set up once, by one process. The modules holding a slow test
    come first, in their files' order, and each module's tests stay in their file's order: the
    processes start on the long modules side by side and the short ones fill the end.

    (Not ``--dist loadgroup`` with ``xdist_group`` marks: with pytest 9.2, pytest-xdist 3.8's
    group suffix no longer reaches the node ids, and a group's tests went to both processes,
    each setting up the fixture.)

    GPU tests are skipped without a GPU."""
    slow_modules = {item.nodeid.split("::")[0] for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow_modules)  # stable: file order kept
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is false)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def restore_torch_flags() -> Iterator[None]:
    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
        torch.backends.cudnn.benchmark,
    )
    yield
    (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, precision,
     torch.backends.cudnn.benchmark) = saved
    torch.set_float32_matmul_precision(precision)


@pytest.fixture(scope="session")
def tiny() -> Workload:
    return get_workload("ups", "tiny")


@pytest.fixture(scope="session")
def tiny_datasets(tiny: Workload, autotune_data_dir: Any) -> tuple[Dataset, Dataset]:
    return tiny.datasets(0)


@pytest.fixture(scope="session")
def train_items(tiny_datasets: tuple[Dataset, Dataset]) -> list[dict[str, torch.Tensor]]:
    """The first 8 training samples (a fixed set every accumulation split can share)."""
    train, _ = tiny_datasets
    return [train[i] for i in range(8)]


MakeTrainer = Callable[..., tuple[torch.nn.Module, Trainer, dict[str, str]]]


@pytest.fixture
def make_trainer(tiny: Workload) -> MakeTrainer:
    """make_trainer(**knobs) -> (model, trainer, notes): a seeded tiny model with an AdamW Trainer."""

    def make(seed: int = 0, **knobs: Any) -> tuple[torch.nn.Module, Trainer, dict[str, str]]:
        cfg = resolved(tiny, **knobs)
        torch.manual_seed(seed)
        model = tiny.build_model()
        notes: dict[str, str] = {}
        optimizer = build_optimizer(model, cfg, tiny.defaults.weight_decay, notes)
        return model, Trainer(model, optimizer, cfg, CPU, notes), notes

    return make
