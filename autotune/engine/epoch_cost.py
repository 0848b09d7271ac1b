"""A DataLoader epoch's start, paid at the rate a long run pays it.

Each epoch begins with a stall (refilling the prefetch queues and, without persistent workers,
restarting them). A long run pays it once an epoch, but a short probe's timed windows hold a
whole number of stalls wherever the boundaries fall. So the probe measures what each boundary
cost over a typical fetch (on a GPU the time the GPU idled across it, `Boundary.gpu_gap_s`: work
queued ahead covers part of the host's stall; on a CPU the host's stall) and moves it: each
window gives back the cost it timed and takes the mean cost in proportion to its micro-batches.
Pure functions, no I/O: the probe and the benchmarks share them.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Boundary:
    """An epoch start after the first: `micro_batch` is the index (from 0) of the micro-batch
    whose fetch began the epoch, `stall_s` the host seconds that fetch took, `gpu_gap_s` the
    seconds the GPU idled across it (None: not measured, on a CPU or for an unforeseen start)."""

    micro_batch: int
    stall_s: float
    gpu_gap_s: float | None = None

    @property
    def cost_s(self) -> float:
        """The seconds the start added to the loop: the GPU's idle time where it is known, else
        the host's stall."""
        return self.stall_s if self.gpu_gap_s is None else self.gpu_gap_s


@dataclass(frozen=True)
class EpochCosts:
    """What the epoch starts cost: per boundary its cost over a typical fetch (`excess_s`,
    never negative), their mean (`cost_s`), and per timed window the excess it timed."""

    excess_s: list[float]
    cost_s: float
    window_excess_s: list[float]
    typical_fetch_s: float
    window_of: list[int | None]  # the window each boundary fell in (None: warm-up or after the windows)


def epoch_costs(spans: Sequence[tuple[int, int]], waits: Sequence[float],
                boundaries: Sequence[Boundary]) -> EpochCosts | None:
    """The costs of `boundaries` (`Boundary.cost_s`), given the timed windows' micro-batch spans
    ([first, end)) and the host seconds each window waited for data. A typical fetch is the
    median over the windows of their wait without the boundaries' host stalls (the waits are
    host time), per remaining micro-batch. None: no boundary (the probe ran inside one epoch;
    it cannot tell what an epoch start costs)."""
    if not boundaries:
        return None
    if len(spans) != len(waits):
        raise ValueError(f"{len(spans)} window spans but {len(waits)} data waits")
    window_of = [next((w for w, (lo, hi) in enumerate(spans) if lo <= b.micro_batch < hi), None) for b in boundaries]
    per_fetch = []
    for w, ((lo, hi), wait) in enumerate(zip(spans, waits, strict=True)):
        inside = [b.stall_s for b, at in zip(boundaries, window_of, strict=True) if at == w]
        fetches = hi - lo - len(inside)
        if fetches > 0:
            per_fetch.append(max(wait - sum(inside), 0.0) / fetches)
    typical = statistics.median(per_fetch) if per_fetch else 0.0
    excess = [max(b.cost_s - typical, 0.0) for b in boundaries]
    window_excess = [sum(e for e, at in zip(excess, window_of, strict=True) if at == w) for w in range(len(spans))]
    return EpochCosts(excess_s=excess, cost_s=statistics.fmean(excess), window_excess_s=window_excess,
                      typical_fetch_s=typical, window_of=window_of)


def amortized_seconds(seconds: Sequence[float], spans: Sequence[tuple[int, int]], window_excess_s: Sequence[float],
                      cost_s: float, epoch_micro_batches: int) -> list[float] | None:
    """Each window's seconds with the epoch starts' excess it timed replaced by `cost_s` per
    `epoch_micro_batches` of its micro-batches. None where a window would be left with no
    time at all: its excess was not time the window's clock saw (it cannot be moved)."""
    if epoch_micro_batches <= 0:
        raise ValueError(f"epoch_micro_batches must be positive, got {epoch_micro_batches}")
    if any(s - e <= 0 for s, e in zip(seconds, window_excess_s, strict=True)):
        return None
    return [s - e + cost_s * (hi - lo) / epoch_micro_batches
            for s, (lo, hi), e in zip(seconds, spans, window_excess_s, strict=True)]


def gpu_idle_summary(boundaries: Sequence[Boundary]) -> str | None:
    """How much of the host's stall the GPU idled, e.g. "the GPU idled 204 of the host's 299 ms"
    (the means over the boundaries whose GPU gap is known; None: none is). The rest of the stall
    was covered by the work queued ahead of it."""
    known = [(b.gpu_gap_s, b.stall_s) for b in boundaries if b.gpu_gap_s is not None]
    if not known:
        return None
    gap, stall = statistics.fmean(g for g, _ in known), statistics.fmean(s for _, s in known)
    return f"the GPU idled {gap * 1e3:.0f} of the host's {stall * 1e3:.0f} ms"
