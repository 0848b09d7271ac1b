"""The quality gate: which trials keep the model's quality.

With μ and σ the mean and sample standard deviation of the baseline seeds' quality metric q
(the workload's: NRMSE for `ups`, validation loss for `gpt`), a trial is *feasible* iff it
completed and

    q ≤ μ + max(abs_tol, k · σ)      for a metric to minimize (the default)
    q ≥ μ − max(abs_tol, k · σ)      for a metric to maximize (an accuracy)

so the gate never rejects what is only the baseline's own seed noise. Samplers learn it as an
Optuna constraint: ``constraint_value`` ≤ 0 when feasible, and a failed trial gets a large
positive value so its region is avoided rather than ignored. Pure functions, no I/O: the
service and the reports share them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

FAILED_CONSTRAINT = 1.0e3  # constraint value of a trial that produced no quality value (OOM, crash, …)
DIRECTIONS = ("minimize", "maximize")


@dataclass(frozen=True)
class BaselineStats:
    """The quality metric of the baseline over its seeds."""

    mean: float
    std: float  # sample standard deviation (0 with one seed)
    n: int

    @classmethod
    def from_values(cls, values: Sequence[float]) -> BaselineStats:
        finite = [v for v in values if v is not None and math.isfinite(v)]
        if not finite:
            raise ValueError("the baseline has no finite quality value: the gate cannot be set")
        std = statistics.stdev(finite) if len(finite) > 1 else 0.0
        return cls(mean=statistics.fmean(finite), std=std, n=len(finite))


@dataclass(frozen=True)
class Gate:
    abs_tol: float = 0.01
    k: float = 2.0

    def threshold(self, baseline: BaselineStats, direction: str = "minimize") -> float:
        """The worst quality a feasible trial may have: the largest when minimizing, the smallest
        when maximizing."""
        _check_direction(direction)
        sign = 1.0 if direction == "minimize" else -1.0
        return baseline.mean + sign * max(self.abs_tol, self.k * baseline.std)

    def margin(self, baseline: BaselineStats) -> float:
        """How far above the baseline mean the gate lies (the larger of the two terms)."""
        return max(self.abs_tol, self.k * baseline.std)


def _check_direction(direction: str) -> None:
    if direction not in DIRECTIONS:
        raise ValueError(f"quality direction {direction!r} is not one of {', '.join(DIRECTIONS)}")


def constraint_value(quality: float | None, threshold: float, direction: str = "minimize") -> float:
    """Optuna constraint: ≤ 0 feasible; how far `quality` is on the wrong side of the threshold
    otherwise; FAILED_CONSTRAINT without a quality value."""
    _check_direction(direction)
    if quality is None or not math.isfinite(quality):
        return FAILED_CONSTRAINT
    return quality - threshold if direction == "minimize" else threshold - quality


def is_feasible(quality: float | None, threshold: float | None, direction: str = "minimize") -> bool | None:
    """True/False once the gate is known; None while the baseline has not finished."""
    if threshold is None:
        return None
    return quality is not None and math.isfinite(quality) and constraint_value(quality, threshold, direction) <= 0


def window_rate(rates: Sequence[float]) -> tuple[float, float]:
    """A probe's throughput from its windows' rates (windows of equal work): the timed work over
    the timed seconds, i.e. the rates' harmonic mean, and the spread (max − min) / that rate.
    The probe, a pruned trial's partial result and the benchmarks all count it this way."""
    rate = statistics.harmonic_mean(rates)
    return rate, (max(rates) - min(rates)) / rate


@dataclass(frozen=True)
class Estimate:
    """A mean with a confidence interval (Student t over repeated measurements)."""

    mean: float
    low: float
    high: float
    n: int

    @classmethod
    def for_rate(cls, rates: Sequence[float], confidence: float = 0.95) -> Estimate:
        """The rate of equal-work windows with a CI that contains it.

        A probe's throughput is its timed work over its timed seconds: the harmonic mean of the
        windows' rates (autotune.engine.probe). The interval is the Student-t interval of the mean time
        per unit of work, inverted (when that interval reaches zero time, the upper bound is
        the fastest window).
        """
        if not rates or any(r <= 0 for r in rates):
            raise ValueError("rates must be positive")
        times = cls.from_values([1.0 / r for r in rates], confidence)
        high = 1.0 / times.low if times.low > 0 else max(rates)
        return cls(1.0 / times.mean, 1.0 / times.high, high, times.n)

    @classmethod
    def from_values(cls, values: Sequence[float], confidence: float = 0.95) -> Estimate:
        if not values:
            raise ValueError("no values")
        mean = statistics.fmean(values)
        if len(values) < 2:
            return cls(mean, mean, mean, len(values))
        half = t_quantile(confidence, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
        return cls(mean, mean - half, mean + half, len(values))


def t_quantile(confidence: float, dof: int) -> float:
    """Two-sided Student-t quantile (scipy when available, else a table for 95 %)."""
    try:
        from scipy.stats import t

        return float(t.ppf(0.5 + confidence / 2, dof))
    except ImportError:  # pragma: no cover - scipy ships with optuna's extras on most installs
        table = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
        return table.get(dof, 1.96)
