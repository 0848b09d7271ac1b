"""autotune.workloads.ups.data: cached generation, the fixed split and deterministic samples."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import autotune.workloads.ups.data as ups_data
from autotune.contract.registry import Workload, get_workload
from autotune.workloads.ups.data import DataSpec, PairDataset, cache_dir, load_or_generate, split_indices

SMALL = DataSpec(n_points=16, traj_per_physics=3, n_snapshots=3)


@pytest.fixture
def counted_generate(monkeypatch: pytest.MonkeyPatch) -> list[DataSpec]:
    """Observe calls to the real generator."""
    calls: list[DataSpec] = []
    real = ups_data.generate

    def counting(spec: DataSpec) -> Any:
        calls.append(spec)
        return real(spec)

    monkeypatch.setattr(ups_data, "generate", counting)
    return calls


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AUTOTUNE_DATA_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("AUTOTUNE_DATA_DIR")
    assert cache_dir() == Path.home() / ".cache" / "autotune" / "data"


def test_session_data_is_cached_in_the_session_dir(tiny_datasets: Any, autotune_data_dir: Path) -> None:
    assert os.environ["AUTOTUNE_DATA_DIR"] == str(autotune_data_dir)
    assert len(list(autotune_data_dir.glob("ups-*.npz"))) == 1


def test_cache_is_created_then_reused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                      counted_generate: list[DataSpec]) -> None:
    monkeypatch.setenv("AUTOTUNE_DATA_DIR", str(tmp_path / "data"))
    fields, physics = load_or_generate(SMALL)
    assert counted_generate == [SMALL]
    path = tmp_path / "data" / f"ups-{SMALL.cache_key()}.npz"
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temp file left behind
    with np.load(path) as f:
        assert f["fields"].dtype == np.float16  # compact on disk
        assert f["physics"].dtype == np.int8
        np.testing.assert_array_equal(f["fields"], fields)
    assert fields.shape == (6, 3, 2, 16)
    assert physics.tolist() == [0, 0, 0, 1, 1, 1]
    mtime = path.stat().st_mtime_ns

    again, physics_again = load_or_generate(SMALL)
    assert counted_generate == [SMALL]  # not generated a second time
    assert path.stat().st_mtime_ns == mtime
    np.testing.assert_array_equal(again, fields)
    np.testing.assert_array_equal(physics_again, physics)

    other = DataSpec(n_points=16, traj_per_physics=3, n_snapshots=3, seed=99)
    assert other.cache_key() != SMALL.cache_key()
    load_or_generate(other)
    assert counted_generate == [SMALL, other]
    assert (tmp_path / "data" / f"ups-{other.cache_key()}.npz").is_file()


def test_generation_is_deterministic() -> None:
    a, pa = ups_data.generate(SMALL)
    b, pb = ups_data.generate(SMALL)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(pa, pb)
    assert a.dtype == np.float16 and np.isfinite(a).all()


def test_split_is_disjoint_fixed_and_per_family() -> None:
    physics = np.repeat(np.array([0, 1], dtype=np.int8), 16)
    train, val = split_indices(physics, 0.125)
    assert set(train).isdisjoint(val)
    assert sorted([*train, *val]) == list(range(32))
    assert val.tolist() == [14, 15, 30, 31]  # the last eighth of each family
    train2, val2 = split_indices(physics, 0.125)
    np.testing.assert_array_equal(train, train2)
    np.testing.assert_array_equal(val, val2)
    _, tiny_val = split_indices(np.zeros(3, dtype=np.int8), 0.01)
    assert len(tiny_val) == 1  # every family holds at least one trajectory out


def test_workload_split_does_not_depend_on_the_seed(tiny: Workload) -> None:
    train0, val0 = tiny.datasets(0)
    train1, val1 = tiny.datasets(1)
    assert isinstance(train0, PairDataset) and isinstance(val0, PairDataset)
    assert set(train0.traj_idx.tolist()).isdisjoint(val0.traj_idx.tolist())
    np.testing.assert_array_equal(train0.traj_idx, train1.traj_idx)  # type: ignore[attr-defined]
    np.testing.assert_array_equal(val0.traj_idx, val1.traj_idx)  # type: ignore[attr-defined]
    assert len(train0) == 28 * 8 and len(val0) == 4 * 8


def test_pair_dataset_items_are_deterministic(tiny: Workload) -> None:
    first, _ = tiny.datasets(0)
    second, _ = get_workload("ups", "tiny").datasets(0)
    other_seed, _ = tiny.datasets(1)
    differs = 0
    for i in (0, 1, 17, 100, len(first) - 1):
        a, b = first[i], second[i]
        for key in ("u", "q", "y"):
            assert torch.equal(a[key], b[key]), (i, key)
        assert a["q"].shape == (16,) and a["y"].shape == (2, 16) and a["u"].shape == (2, 32)
        assert (torch.diff(a["q"]) > 0).all()  # sorted, distinct grid points
        differs += not torch.equal(a["q"], other_seed[i]["q"])
        assert torch.equal(a["u"], other_seed[i]["u"])  # the seed picks queries, not samples
    assert differs > 0


def test_pair_dataset_targets_are_the_next_snapshot(tiny_datasets: Any) -> None:
    train, val = tiny_datasets
    item = train[9]  # trajectory 1, snapshot 1 → 2
    idx = np.rint(item["q"].numpy() * 32 / (2 * np.pi)).astype(int)
    expected = train.fields[train.traj_idx[1], 2].astype(np.float32)[:, idx]
    np.testing.assert_array_equal(item["y"].numpy(), expected)
    full = val[0]
    assert full["y"].shape == (2, 32)
    assert torch.equal(full["y"], val[1]["u"])  # on the full grid, a target is the next input
