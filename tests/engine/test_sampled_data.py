"""A job's own data path (Workload.sample_batch): the probe trains on the job's batches, never a DataLoader."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, default_collate

from autotune.contract.registry import Workload
from autotune.engine.probe import ProbeSettings, run_probe
from autotune.engine.sampled_data import LOADER_KNOBS, has_own_data_path
from autotune.workloads.ups import UPSWorkload

SAMPLES = 96  # 12 steps at the tiny preset's 4 × 2: 5 warm-up + 7 windows of 1 step


class Untouchable(Dataset):
    """A training set the probe must not read: the job samples its own batches."""

    def __init__(self, inner: Dataset) -> None:
        self.inner = inner
        self.reads = 0

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> Any:
        self.reads += 1
        return self.inner[i]


class SamplingWorkload(UPSWorkload):
    """The tiny UPS job with its own data path: random training items, drawn in the loop."""

    def __init__(self) -> None:
        super().__init__("tiny")
        self.calls: list[tuple[int, torch.device]] = []
        self.drawn: list[torch.Tensor] = []
        self.train: Untouchable | None = None
        self.source: Dataset | None = None

    def datasets(self, seed: int) -> tuple[Dataset, Dataset]:
        train, val = super().datasets(seed)
        self.source = train
        self.train = Untouchable(train)
        return self.train, val

    def sample_batch(self, batch_size: int, generator: torch.Generator, device: torch.device) -> dict[str, Any]:
        assert self.source is not None
        index = torch.randint(len(self.source), (batch_size,), generator=generator)  # type: ignore[arg-type]
        self.calls.append((batch_size, device))
        self.drawn.append(index)
        batch = default_collate([self.source[int(i)] for i in index])
        return {k: v.to(device) for k, v in batch.items()}


def test_a_workload_says_whether_it_has_its_own_data_path(tiny: Workload) -> None:
    assert not has_own_data_path(tiny)
    assert has_own_data_path(SamplingWorkload())
    with pytest.raises(NotImplementedError, match="DataLoader"):
        tiny.sample_batch(4, torch.Generator(), torch.device("cpu"))


def test_the_probe_trains_on_the_jobs_own_batches_and_no_dataloader(tiny: Workload) -> None:
    wl = SamplingWorkload()
    result = run_probe(wl, {"num_workers": 2, "pin_memory": True}, settings=ProbeSettings(samples=SAMPLES))
    assert result.ok, result.failure
    micro_batches = result.steps * result.config["accum_steps"]
    assert len(wl.calls) == micro_batches  # one call per micro-batch the probe trained
    assert {size for size, _ in wl.calls} == {result.config["batch_size"]}
    assert all(device.type == "cpu" for _, device in wl.calls)
    assert wl.train is not None and wl.train.reads == 0  # the training set was never read through a DataLoader
    for knob in LOADER_KNOBS:  # set off their defaults, and said not to act
        assert "inactive" in result.knobs[knob] and "sample_batch" in result.knobs[knob], result.knobs[knob]
    assert "SamplingWorkload.sample_batch" in result.knobs["data"]
    assert result.epoch_micro_batches is None and result.epoch_boundaries in (None, [])
    assert result.raw_window_throughputs == result.window_throughputs  # no epoch starts to amortize
    assert result.quality is not None and result.quality > 0
    # the loop's sampling is the probe's data wait (host time in the training thread)
    assert result.data_wait_fraction is not None and 0 < result.data_wait_fraction <= 1


def test_the_probes_seed_sets_the_sampled_batches() -> None:
    runs = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        wl = SamplingWorkload()
        result = run_probe(wl, {}, settings=ProbeSettings(samples=SAMPLES, seed=seed))
        assert result.ok, result.failure
        runs[name] = (torch.cat(wl.drawn), result.quality)
    assert torch.equal(runs["a"][0], runs["b"][0]) and runs["a"][1] == runs["b"][1]  # same seed: same batches
    assert not torch.equal(runs["a"][0], runs["c"][0])  # another seed draws others


def test_a_sample_batch_that_returns_no_dict_is_a_failure_naming_the_fix() -> None:
    class Tuples(SamplingWorkload):
        def sample_batch(self, batch_size: int, generator: torch.Generator, device: torch.device) -> Any:
            batch = super().sample_batch(batch_size, generator, device)
            return tuple(batch.values())

    result = run_probe(Tuples(), {}, settings=ProbeSettings(samples=SAMPLES))
    assert result.failure is not None
    assert "return a dict of tensors" in result.failure["message"]
