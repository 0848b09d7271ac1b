"""The decision rule: is a config faster than the baseline and no worse? Pure functions.

A candidate is *certified* when both halves hold at the same sample budget: speed, the interval
of its speedup (the ratio of geometric-mean throughputs; Welch's interval on the difference of
mean log throughputs, each config keeping its own run-to-run variance) lies above 1; quality,
non-inferiority with margin Δ = max(abs_tol, k · σ_b): the one-sided upper bound of its mean
quality minus the baseline's (> 0 is worse) lies below Δ, on seed-matched differences where
rounds share seeds (`paired`), else with pooled variances (`shared_spread`). It is *rejected*
when either half is shown the other way, *undecided* otherwise (measured again). Runs (probe
processes) are the unit of replication, never windows. Each test runs at a level spent from the
study's 1 − confidence over its candidates (Bonferroni) and its looks (a quadratic spending
function, `look_alpha`), so the chance of certifying a config that is not faster, or not as
good, stays at most 1 − confidence. Standard library only: the service, the CLI and the
benchmarks share it.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

MIN_RUNS = 2  # a config's own run-to-run spread needs two runs
MIN_BASELINE_RUNS = 3  # the baseline's seed spread at the judged budget: at least three seeds

Status = Literal["certified", "rejected", "undecided"]


# --- Student's t, without scipy ---------------------------------------------------------------

def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (Lentz's method)."""
    tiny, eps = 1e-300, 3e-14
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= c * d
        if abs(c * d - 1.0) < eps:
            break
    return h


def _incomplete_beta(a: float, b: float, x: float) -> float:
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_fraction(a, b, x) / a
    return 1.0 - front * _beta_fraction(b, a, 1.0 - x) / b


def t_cdf(t: float, dof: float) -> float:
    """P(T ≤ t) for Student's t with `dof` (> 0, real) degrees of freedom."""
    dof = min(dof, 1e6)  # beyond, the normal distribution to many digits
    tail = 0.5 * _incomplete_beta(dof / 2.0, 0.5, dof / (dof + t * t))
    return 1.0 - tail if t > 0 else tail


@functools.lru_cache(maxsize=4096)
def t_ppf(p: float, dof: float) -> float:
    """The p-quantile of Student's t (bisection on `t_cdf`; `dof` may be fractional: Welch).
    Remembered: each view of a study judges its candidates again from the same runs (the
    bisection's 120 steps were half the CPU of `GET /v1/studies/NAME`)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must lie in (0, 1), not {p}")
    low, high = -1e4, 1e4
    for _ in range(120):
        mid = (low + high) / 2.0
        if t_cdf(mid, dof) < p:
            low = mid
        else:
            high = mid
    return (low + high) / 2.0


# --- the pieces of the rule --------------------------------------------------------------------

@dataclass(frozen=True)
class Sample:
    """Runs of one config: n, mean, sample sd (0 with one run)."""

    n: int
    mean: float
    sd: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Sample:
        if not values:
            raise ValueError("no runs")
        return cls(len(values), statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0)


@dataclass(frozen=True)
class Difference:
    """mean(a) − mean(b) with Welch's standard error and degrees of freedom."""

    value: float
    se: float
    dof: float

    def bounds(self, alpha: float) -> tuple[float, float]:
        """The (1 − 2α) two-sided interval: each end is a one-sided bound at level α."""
        half = t_ppf(1.0 - alpha, self.dof) * self.se if self.se > 0 else 0.0
        return self.value - half, self.value + half


def welch(a: Sample, b: Sample) -> Difference:
    va, vb = a.sd ** 2 / a.n, b.sd ** 2 / b.n
    se2 = va + vb
    if se2 <= 0.0:
        return Difference(a.mean - b.mean, 0.0, math.inf)
    parts = (va ** 2 / (a.n - 1) if a.n > 1 else 0.0) + (vb ** 2 / (b.n - 1) if b.n > 1 else 0.0)
    dof = se2 ** 2 / parts if parts > 0 else math.inf
    return Difference(a.mean - b.mean, math.sqrt(se2), max(1.0, dof))


def shared_spread(a: Sample, b: Sample) -> Difference:
    """mean(a) − mean(b) for quality, whose seed-to-seed spread is a property of the model and the
    budget that configs of one training share: the two samples' variances are pooled (Student's
    t, n_a + n_b − 2 degrees of freedom), so a candidate's two or three runs borrow the
    baseline's estimate of it; where the candidate's own runs spread more than the pooled
    estimate (a numerically noisier config), its own variance is used for its side."""
    dof = a.n + b.n - 2
    if dof < 1:
        return welch(a, b)
    pooled = ((a.n - 1) * a.sd ** 2 + (b.n - 1) * b.sd ** 2) / dof
    se2 = max(pooled, a.sd ** 2) / a.n + pooled / b.n
    return Difference(a.mean - b.mean, math.sqrt(se2), float(dof))


def paired(diffs: Sequence[float]) -> Difference:
    """The mean of seed-matched differences, with its standard error and n − 1 degrees of freedom."""
    d = Sample.of(diffs)
    return Difference(d.mean, d.sd / math.sqrt(d.n), float(max(1, d.n - 1)))


def look_alpha(alpha: float, look: int, looks: int) -> float:
    """The share of `alpha` spent at look `look` (1-based) of at most `looks`: α (2j − 1) / L²."""
    if looks < 1 or not 1 <= look <= looks:
        raise ValueError(f"look {look} of {looks}")
    return alpha * (2 * look - 1) / looks ** 2


def level_at(confidence: float, candidates: int, look: int, looks: int) -> float:
    """The one-sided level of each half's test for one candidate at one look."""
    return look_alpha((1.0 - confidence) / 2.0, look, looks) / max(1, candidates)


@dataclass(frozen=True)
class Judgement:
    """What the rule made of one candidate against the baseline at one look."""

    status: Status
    reason: str
    ratio: float | None = None  # the candidate's metric over the baseline's (geometric means)
    ratio_low: float | None = None
    ratio_high: float | None = None
    quality_diff: float | None = None  # > 0: worse
    quality_low: float | None = None
    quality_high: float | None = None
    margin: float | None = None
    alpha: float | None = None


def judge(cand_metric: Sequence[float], base_metric: Sequence[float], cand_quality: Sequence[float],
          base_quality: Sequence[float], *, alpha: float, abs_tol: float, k: float,
          quality_direction: str = "minimize", higher_is_better: bool = True, metric: str = "speedup",
          quality_pairs: Sequence[tuple[float, float]] | None = None) -> Judgement:
    """Judge a candidate from its runs and the baseline's at one budget.

    `*_metric`: each run's throughput (or energy per sample with higher_is_better False; all
    > 0); `*_quality`: each run's quality metric; `alpha`: each half's one-sided level
    (`level_at`). `quality_pairs`: (candidate, baseline) quality of runs with the same probe
    seed; when given, the quality half tests their differences (`paired`) and the baseline's
    `base_quality` only sets the margin."""
    if any(v <= 0 or not math.isfinite(v) for v in [*cand_metric, *base_metric]):
        raise ValueError("throughputs must be finite and > 0")
    if len(cand_metric) < MIN_RUNS or len(base_metric) < MIN_RUNS:
        return Judgement("undecided", f"needs {MIN_RUNS} runs of each config (has {len(cand_metric)} and "
                                      f"{len(base_metric)} of the baseline)", alpha=alpha)
    speed = welch(Sample.of([math.log(v) for v in cand_metric]), Sample.of([math.log(v) for v in base_metric]))
    low, high = speed.bounds(alpha)
    ratio, ratio_low, ratio_high = math.exp(speed.value), math.exp(low), math.exp(high)
    better = low > 0 if higher_is_better else high < 0
    worse = high < 0 if higher_is_better else low > 0
    out: dict[str, float | None] = {"ratio": ratio, "ratio_low": ratio_low, "ratio_high": ratio_high,
                                    "alpha": alpha}
    interval = f"{ratio:.2f}× (interval {ratio_low:.2f}–{ratio_high:.2f}×)"
    matched = len(quality_pairs) if quality_pairs is not None else len(cand_quality)
    if len(base_quality) < MIN_BASELINE_RUNS or matched < MIN_RUNS:
        quality_state: Status = "undecided"
        runs = "seed-matched runs" if quality_pairs is not None else "runs"
        quality_why = (f"quality needs {MIN_BASELINE_RUNS} baseline runs and {MIN_RUNS} {runs} of the config at "
                       f"this budget (has {len(base_quality)} and {matched})")
    else:
        sign = 1.0 if quality_direction == "minimize" else -1.0
        base = Sample.of([sign * q for q in base_quality])
        diff = (paired([sign * (c - b) for c, b in quality_pairs]) if quality_pairs is not None
                else shared_spread(Sample.of([sign * q for q in cand_quality]), base))
        what_diff = f"seed-matched difference (n={matched})" if quality_pairs is not None else "difference"
        margin = max(abs_tol, k * base.sd)
        q_low, q_high = diff.bounds(alpha)
        out.update(quality_diff=diff.value, quality_low=q_low, quality_high=q_high, margin=margin)
        if q_high < margin:
            quality_state = "certified"
            quality_why = (f"quality no worse: {what_diff} {diff.value:+.4g} (bound {q_high:+.4g}) within the "
                           f"margin {margin:.4g}")
        elif q_low > margin:
            quality_state = "rejected"
            quality_why = (f"quality worse: {what_diff} {diff.value:+.4g} (at least {q_low:+.4g}) beyond the "
                           f"margin {margin:.4g}")
        else:
            quality_state = "undecided"
            quality_why = (f"quality not yet shown no worse: {what_diff} {diff.value:+.4g} (bound {q_high:+.4g}) "
                           f"against the margin {margin:.4g}")
    what = "faster" if higher_is_better else "less energy per sample"
    if worse:
        return Judgement("rejected", f"not {what}: {metric} {interval} lies below parity" if higher_is_better
                         else f"uses more energy: ratio {interval} lies above 1", **out)  # type: ignore[arg-type]
    if quality_state == "rejected":
        return Judgement("rejected", quality_why, **out)  # type: ignore[arg-type]
    if better and quality_state == "certified":
        return Judgement("certified", f"{what}: {metric} {interval}; {quality_why}", **out)  # type: ignore[arg-type]
    speed_why = f"{metric} {interval}" + ("" if better else " not yet beyond the noise")
    return Judgement("undecided", f"{speed_why}; {quality_why}", **out)  # type: ignore[arg-type]


def wilson(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of a rate (the calibration benchmark's)."""
    if n == 0:
        return 0.0, 1.0
    z = -_normal_ppf((1.0 - confidence) / 2.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _normal_ppf(p: float) -> float:
    return statistics.NormalDist().inv_cdf(p)
