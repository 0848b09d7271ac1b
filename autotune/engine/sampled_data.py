"""A job's own data path: micro-batches from the workload's ``sample_batch`` instead of a DataLoader.

Many language-model scripts never build a DataLoader: nanoGPT's ``get_batch`` draws random
windows of a token tensor and copies them to the GPU itself. A probe that fed such a job through
a DataLoader would time a data path the job does not have (worker processes and a prefetch
queue that overlap what the job's own loop does in line), so a workload that defines
``sample_batch(batch_size, generator, device)`` is trained on exactly that: `SampledBatches`
calls it in the training loop's thread, as the job's own loop does, and its host time is the
probe's data wait. The DataLoader knobs do not act then: `note_inactive_loader_knobs` says so.
"""

from __future__ import annotations

import torch

from autotune.contract.config import TrainConfig
from autotune.contract.workload import Workload
from autotune.engine.epoch_cost import Boundary
from autotune.engine.knobs import shown_value

# The knobs that shape a DataLoader: nothing of theirs runs when the job samples its own batches.
LOADER_KNOBS = ("num_workers", "prefetch_factor", "pin_memory", "persistent_workers")


def has_own_data_path(workload: Workload) -> bool:
    """True when the workload samples its own micro-batches (overrides ``sample_batch``)."""
    return type(workload).sample_batch is not Workload.sample_batch


def sampling_generator(seed: int, rank: int) -> torch.Generator:
    """The CPU generator a rank's ``sample_batch`` draws from: the probe's seed (every probe of a
    study draws the same batches in the same order), a distinct stream per rank."""
    return torch.Generator().manual_seed(seed * 1_000_003 + rank)


def note_inactive_loader_knobs(config: TrainConfig, notes: dict[str, str], workload: Workload) -> None:
    """Record each DataLoader knob as inactive, naming the reason."""
    why = f"inactive: {type(workload).__name__}.sample_batch makes the batches, no DataLoader"
    for knob in LOADER_KNOBS:
        notes[knob] = f"{shown_value(getattr(config, knob))} ({why})"


class SampledBatches:
    """Micro-batches from ``workload.sample_batch``, with the interface the probe reads of an
    `autotune.engine.knobs.EpochIterator` (``next``, ``pulled``, ``resolved_boundaries``,
    ``close``). There are no epochs: nothing restarts, so no epoch start is costed."""

    def __init__(self, workload: Workload, batch_size: int, generator: torch.Generator,
                 device: torch.device) -> None:
        self.workload = workload
        self.batch_size = batch_size
        self.generator = generator
        self.device = device
        self.pulled = 0  # micro-batches handed out

    def next(self) -> dict[str, torch.Tensor]:
        batch = self.workload.sample_batch(self.batch_size, self.generator, self.device)
        if not isinstance(batch, dict) or not batch:
            raise TypeError(f"{type(self.workload).__name__}.sample_batch returned {type(batch).__name__}: return a "
                            "dict of tensors on the device, e.g. {'x': x, 'y': y}")
        self.pulled += 1
        # a tensor already on the device is returned as it is (no copy); one left on the host is
        # moved, as the job's own loop would have to before its forward
        return {k: v.to(self.device) for k, v in batch.items()}

    def resolved_boundaries(self) -> list[Boundary]:
        return []

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"SampledBatches({type(self.workload).__name__}, batch_size={self.batch_size}, pulled={self.pulled})"


def describe(workload: Workload) -> str:
    """The data path's note in a probe's knob notes."""
    return f"{type(workload).__name__}.sample_batch (the job's own data path, in the training loop's thread)"


