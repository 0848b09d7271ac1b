"""How a probe's time is read: the window clock (`Clock`: CUDA events on a GPU, the host clock on
a CPU, where every op is synchronous), the ranks' meeting points at window boundaries
(`RankSync`), and the Chrome trace of the warm-up's last steps (`start_trace`). The plan (the
sample budget split into warm-up steps, timed windows and an untimed tail) is
`autotune.contract.steps.plan_steps`.

Windows hold equal steps, and a whole number of inverse-loss periods where possible, so every
window has the same mix of cheap and expensive steps; the warm-up is never timed.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch


class Clock:
    """Window timer: CUDA events on a GPU, the host clock on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def start(self) -> Any:
        """A point on the device's timeline, now (no sync)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start: Any, end: Any, wait: bool = True) -> float:
        """Seconds from point `start` to point `end`; `wait`: sync on `end` first (else it must
        be done already, e.g. a later point was synced on)."""
        if not self.cuda:
            return float(end - start)
        if wait:
            end.synchronize()  # sync: the window's kernels must finish before reading the events
        return float(start.elapsed_time(end)) / 1e3

    def stop(self, started: Any) -> float:
        """Seconds since `started`. On a GPU this waits for the window's work (a sync point)."""
        return self.seconds(started, self.start())


class RankSync:
    """The collectives a probe of several ranks needs at window boundaries (no-ops for one
    rank). Each returns a host value, so each is a CPU–GPU sync point on a GPU (NCCL reduces
    device tensors, gloo host ones): they run between windows, never inside one."""

    def __init__(self, device: torch.device, world: int) -> None:
        self.world = world
        self.device = device if device.type == "cuda" else torch.device("cpu")

    def _reduce(self, value: float, op: Any) -> float:
        tensor = torch.tensor([value], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(tensor, op=op)
        return float(tensor.item())

    def barrier(self) -> None:
        if self.world > 1:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # sync: this rank's previous work is done
            self._reduce(0.0, torch.distributed.ReduceOp.SUM)

    def max(self, value: float) -> float:
        return value if self.world == 1 else self._reduce(value, torch.distributed.ReduceOp.MAX)

    def mean(self, value: float) -> float:
        return value if self.world == 1 else self._reduce(value, torch.distributed.ReduceOp.SUM) / self.world

    def gather(self, value: float | None) -> list[float | None]:
        """Every rank's `value` (None: it has none), in rank order, on every rank."""
        if self.world == 1:
            return [value]
        tensor = torch.zeros(self.world, dtype=torch.float64, device=self.device)
        tensor[torch.distributed.get_rank()] = math.nan if value is None else value
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
        return [None if math.isnan(v) else v for v in tensor.tolist()]

    def from_rank0(self, flag: bool) -> bool:
        if self.world == 1:
            return flag
        tensor = torch.tensor([1.0 if flag else 0.0], dtype=torch.float64, device=self.device)
        torch.distributed.broadcast(tensor, src=0)
        return bool(tensor.item())


TRACE_STEP, TRACE_DATA = "autotune.step", "autotune.data"  # the traced steps' named ranges


def start_trace(device: torch.device) -> torch.profiler.profile:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities)
    profiler.start()
    return profiler


def stop_trace(profiler: torch.profiler.profile, device: torch.device, path: str) -> None:
    """Stop `profiler` once the traced steps' GPU work is done, and write its Chrome trace."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # sync: the traced steps' kernels belong in the trace
    profiler.stop()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    profiler.export_chrome_trace(path)
