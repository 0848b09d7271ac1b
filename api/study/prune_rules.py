"""Multi-objective pruning: stop a running trial that cannot matter.

Optuna cannot prune multi-objective trials, so the service decides on every report with `decide`,
a pure function of curves and a reason for each decision: the trial **diverged**; it **cannot
reach the front** (slower than ρ × the best feasible trial and no better in loss, or in energy, at
equal samples; by energy alone in a study without a throughput objective); or it **predicts a gate
failure** (its loss exceeds the baseline's at equal samples by more than loss_margin).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

Curve = Sequence[tuple[float, float]]


@dataclass(frozen=True)
class PruneRules:
    rho: float = 0.5  # slower than rho × the best feasible throughput …
    min_windows: int = 2  # … judged on at least this many windows
    loss_margin: float = 0.5  # loss above the baseline's by this fraction predicts a gate failure
    min_fraction: float = 0.3  # … but only after this fraction of the sample budget
    divergence_factor: float = 3.0  # loss grown to this multiple of its own minimum
    throughput_counts: bool = True  # throughput is an objective: a slow trial may be pruned
    quality_counts: bool = True  # quality is an objective: a slow trial with a better loss is kept
    energy_counts: bool = False  # energy is an objective: a slow trial with a lower energy is kept


@dataclass(frozen=True)
class Reference:
    """What a running trial is compared with (None where not known yet)."""

    best_feasible_throughput: float | None = None
    best_feasible_curve: Curve | None = None
    baseline_curve: Curve | None = None
    total_samples: int | None = None
    best_feasible_energy: float | None = None  # the fastest feasible trial's energy per sample
    lowest_feasible_energy: float | None = None  # the lowest energy per sample of a feasible trial …
    lowest_energy_curve: Curve | None = None  # … and that trial's loss curve


@dataclass(frozen=True)
class Decision:
    prune: bool
    reason: str | None = None
    rule: str | None = None


KEEP = Decision(False)


def loss_at(curve: Curve, samples: float) -> float | None:
    """The curve's loss at `samples` by linear interpolation; None outside its range."""
    points = sorted(curve)
    if not points or samples < points[0][0] or samples > points[-1][0]:
        return None
    for (s0, l0), (s1, l1) in itertools.pairwise(points):
        if s0 <= samples <= s1:
            return l0 if s1 == s0 else l0 + (l1 - l0) * (samples - s0) / (s1 - s0)
    return points[-1][1]


def _no_lower(energy: float | None, reference: float | None) -> bool:
    """The trial's energy per sample is known and no lower than `reference` (False when either
    is unknown: it might be lower)."""
    return energy is not None and reference is not None and energy >= reference


def decide(curve: Curve, throughputs: Sequence[float], ref: Reference, rules: PruneRules = PruneRules(),
           energy: float | None = None) -> Decision:
    """Prune or keep a trial given its loss curve and window throughputs so far, and its energy
    per sample over its windows so far (J; None where not measured)."""
    if not curve:
        return KEEP
    samples, loss = curve[-1]
    if not math.isfinite(loss):
        return Decision(True, f"training loss is {loss} at {samples:.0f} samples: the trial diverged", "diverged")
    best_loss = min(v for _, v in curve)
    if len(curve) >= 3 and best_loss > 0 and loss > rules.divergence_factor * best_loss:
        return Decision(True, f"loss {loss:.4g} at {samples:.0f} samples is {loss / best_loss:.1f}× its best "
                              f"({best_loss:.4g}): diverging", "diverged")

    if (rules.throughput_counts and ref.best_feasible_throughput and ref.best_feasible_curve
            and len(throughputs) >= rules.min_windows):
        stable = statistics.median(throughputs)
        ref_loss = loss_at(ref.best_feasible_curve, samples)
        slow = (f"throughput {stable:,.1f} samples/s is below {rules.rho:g} × the best feasible "
                f"{ref.best_feasible_throughput:,.1f}")
        thrifty = rules.energy_counts and not _no_lower(energy, ref.best_feasible_energy)
        if stable < rules.rho * ref.best_feasible_throughput and not thrifty:
            no_lower = (f", its energy {energy:.4g} J/sample is no lower than that trial's "
                        f"{ref.best_feasible_energy:.4g}" if rules.energy_counts else "")
            if not rules.quality_counts:
                only = "" if rules.energy_counts else ", and throughput is the study's only objective"
                return Decision(True, f"{slow}{no_lower}{only}: it cannot be the fastest", "dominated")
            if ref_loss is not None and loss >= ref_loss:
                return Decision(True, f"{slow}{no_lower}, and its loss {loss:.4g} at {samples:.0f} samples is no "
                                      f"better than that trial's {ref_loss:.4g}: it cannot reach the front",
                                "dominated")
    elif (not rules.throughput_counts and rules.energy_counts and ref.lowest_feasible_energy
          and ref.lowest_energy_curve and energy is not None and len(throughputs) >= rules.min_windows
          and energy > ref.lowest_feasible_energy / rules.rho):
        wasteful = (f"energy {energy:.4g} J/sample is above the lowest feasible {ref.lowest_feasible_energy:.4g} / "
                    f"{rules.rho:g}")
        ref_loss = loss_at(ref.lowest_energy_curve, samples)
        if not rules.quality_counts:
            return Decision(True, f"{wasteful}, and energy is the study's only objective: it cannot use the least",
                            "dominated")
        if ref_loss is not None and loss >= ref_loss:
            return Decision(True, f"{wasteful}, and its loss {loss:.4g} at {samples:.0f} samples is no better than "
                                  f"that trial's {ref_loss:.4g}: it cannot reach the front", "dominated")

    if ref.baseline_curve and ref.total_samples and samples >= rules.min_fraction * ref.total_samples:
        base = loss_at(ref.baseline_curve, samples)
        if base is not None and base > 0 and loss > base * (1 + rules.loss_margin):
            return Decision(True, f"loss {loss:.4g} at {samples:.0f} samples exceeds the baseline's {base:.4g} by "
                                  f"{loss / base - 1:.0%} (> {rules.loss_margin:.0%}): predicts a gate failure",
                            "gate")
    return KEEP
