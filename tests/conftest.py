"""Shared fixtures for the probe-engine tests.

* Generated PDE data goes to one session-scoped temporary directory (``AUTOTUNE_DATA_DIR``),
  so it is generated once per session, never in the home directory, and subprocesses
  started by tests inherit the same cache.
* Tests marked ``gpu`` are skipped when CUDA is not available.
* The process-global torch switches that knobs set (TF32, matmul precision,
  cudnn.benchmark) are restored after every test, so no test leaks into another.
* Torch runs one intra-op thread in every test process and every process a test starts
  (OMP_NUM_THREADS=1, inherited), as a worker's `--threads 1` probes do. The models here are
  tiny, and `make test` runs one test process per core: with torch's default of a thread per
  core, each process's OpenMP threads spin for cores the other holds (a 320-sample CPU probe
  took 25 s so on a busy 2-core host, 2.6 s with one thread). Tests that set threads on
  purpose (a worker's `--threads`, torchrun's ranks) still pass their own.
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
from torch.utils.data import Dataset

from autotune.knobs import Trainer, build_optimizer
from autotune.workloads import Workload, get_workload

torch.set_num_threads(1)  # should torch have been imported before this file (a plugin)


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


def _module_fixtures(item: pytest.Item) -> list[str]:
    """The fixtures of `item` set up once per module (or class): the tests sharing one must run in
    one test process, or each process sets it up again."""
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.items() if info is not None else []
    return [name for name, fixturedefs in defs if fixturedefs and fixturedefs[-1].scope in ("module", "class")]


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order and group the tests for pytest-xdist (`make test` runs ``-n auto --dist loadgroup``):

    * the tests of a module that share a module-scoped fixture form one group, run by one test
      process, so the fixture (a live service, a finished study) is set up once;
    * slow tests (and groups holding one) come first, each kind in its files' order: the test
      processes take the next test or group as they get free, so the long ones start at once,
      side by side, and the short ones fill the gaps at the end.

    GPU tests are skipped without a GPU."""
    grouped = {item.nodeid: item.module.__name__ for item in items
               if item.module is not None and _module_fixtures(item)}
    slow_groups = {grouped[item.nodeid] for item in items if item.nodeid in grouped and "slow" in item.keywords}
    for item in items:
        if item.nodeid in grouped:
            item.add_marker(pytest.mark.xdist_group(grouped[item.nodeid]))
    items.sort(key=lambda item: not ("slow" in item.keywords or grouped.get(item.nodeid) in slow_groups))
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
