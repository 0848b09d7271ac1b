"""PDE trajectory data for the `ups` workload: generated on first use, cached as float16.

The cache file name carries a hash of everything that determines its content, and it is
written atomically (temp file + rename), so workers on one host can share it safely.
Train/validation split: the last `val_fraction` of each physics family's trajectories
(fixed, by index) are held out.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from autotune.workloads.ups.solver import PHYSICS, grid, random_initial_fields, solve

log = logging.getLogger(__name__)

SOLVER_VERSION = 1  # bump when the solver's output changes, so old caches are not reused


@dataclass(frozen=True)
class DataSpec:
    """What trajectories to generate."""

    n_points: int  # grid points N
    traj_per_physics: int
    n_snapshots: int
    t_final: float = 2.0
    dt: float = 2e-3
    val_fraction: float = 0.125
    seed: int = 1234

    def cache_key(self) -> str:
        text = json.dumps({**asdict(self), "solver": SOLVER_VERSION}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_dir() -> Path:
    """Where generated data lives: $AUTOTUNE_DATA_DIR, else ~/.cache/autotune/data."""
    env = os.environ.get("AUTOTUNE_DATA_DIR")
    return Path(env) if env else Path.home() / ".cache" / "autotune" / "data"


def generate(spec: DataSpec) -> tuple[np.ndarray, np.ndarray]:
    """Solve every trajectory. Returns (fields (T, S, 2, N) float16, physics id (T,) int8)."""
    rng = np.random.default_rng(spec.seed)
    parts, ids = [], []
    for pid, physics in enumerate(PHYSICS):
        initial = random_initial_fields(rng, spec.traj_per_physics, spec.n_points)
        speed = rng.uniform(-1.0, 1.0, size=spec.traj_per_physics)
        traj = solve(physics, initial, spec.t_final, spec.n_snapshots, spec.dt, speed=speed)
        parts.append(traj.astype(np.float16))
        ids.append(np.full(spec.traj_per_physics, pid, dtype=np.int8))
    return np.concatenate(parts), np.concatenate(ids)


def load_or_generate(spec: DataSpec) -> tuple[np.ndarray, np.ndarray]:
    """Return the trajectories for `spec`, from the cache when present."""
    path = cache_dir() / f"ups-{spec.cache_key()}.npz"
    if path.is_file():
        with np.load(path) as f:
            return f["fields"], f["physics"]
    log.info("generating PDE data %s -> %s", spec, path)
    fields, physics = generate(spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npz.tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, fields=fields, physics=physics)
        os.replace(tmp, path)  # atomic: concurrent generators write identical content
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return fields, physics


def split_indices(physics: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Fixed split by trajectory: the last `val_fraction` of each family is validation."""
    train, val = [], []
    for pid in np.unique(physics):
        idx = np.flatnonzero(physics == pid)
        n_val = max(1, round(len(idx) * val_fraction))
        train.append(idx[:-n_val])
        val.append(idx[-n_val:])
    return np.concatenate(train), np.concatenate(val)


class PairDataset(Dataset):
    """(state at t, state at t+1) pairs from a set of trajectories.

    Each item: ``u`` (2, N) input on the grid, ``q`` (Q,) query coordinates, ``y`` (2, Q)
    the next state at those coordinates. The queries of item i depend only on (seed, i),
    so the samples a probe trains on do not depend on batch size or worker count.
    With ``n_queries=None`` every grid point is queried (validation).
    """

    def __init__(self, fields: np.ndarray, traj_idx: np.ndarray, n_queries: int | None, seed: int) -> None:
        self.fields = fields  # float16, kept compact; converted per item
        self.traj_idx = traj_idx
        self.n_snapshots = fields.shape[1]
        self.n_points = fields.shape[-1]
        self.n_queries = n_queries
        self.seed = seed
        self.x = grid(self.n_points).astype(np.float32)

    def __len__(self) -> int:
        return len(self.traj_idx) * (self.n_snapshots - 1)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        traj = self.traj_idx[i // (self.n_snapshots - 1)]
        t = i % (self.n_snapshots - 1)
        u = self.fields[traj, t].astype(np.float32)
        nxt = self.fields[traj, t + 1].astype(np.float32)
        if self.n_queries is None:
            q_idx = np.arange(self.n_points)
        else:
            rng = np.random.default_rng((self.seed, i))
            q_idx = np.sort(rng.choice(self.n_points, size=self.n_queries, replace=False))
        return {
            "u": torch.from_numpy(u),
            "q": torch.from_numpy(self.x[q_idx]),
            "y": torch.from_numpy(np.ascontiguousarray(nxt[:, q_idx])),
        }
