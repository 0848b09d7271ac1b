"""Whether a running trial should stop early, from what its worker reported.

`decide` applies `api.study.prune_rules.decide` to the trial's own reports (`TrialReports`, a
small per-trial cache) against a `Reference` from a per-study `StudySummary` that the service keeps
in memory and updates when a trial completes: no report of the study is ever read.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from autotune.api.study import prune_rules as rules_
from autotune.contract.protocol import StudySpec

KEEP = rules_.KEEP
PruneDecision = rules_.Decision


def curve_of(value: Any) -> list[tuple[float, float]]:
    """A stored loss curve ([[samples, loss], …]) as finite (samples, loss) pairs."""
    points: list[tuple[float, float]] = []
    if isinstance(value, list):
        for p in value:
            if (isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(x, (int, float)) for x in p)
                    and math.isfinite(p[0]) and math.isfinite(p[1])):
                points.append((float(p[0]), float(p[1])))
    return points


def mean_curve(curves: Sequence[Sequence[tuple[float, float]]]) -> list[tuple[float, float]]:
    """The pointwise mean of `curves` at the first curve's sample counts (interpolated)."""
    curves = [c for c in curves if c]
    if not curves:
        return []
    out = []
    for samples, _ in sorted(curves[0]):
        losses = [v for c in curves if (v := rules_.loss_at(c, samples)) is not None]
        if losses:
            out.append((samples, statistics.fmean(losses)))
    return out


@dataclass
class StudySummary:
    """What running trials are compared with; updated at complete time, never from reports.
    `learned`: the numbers of the trials in it; `finished`: the study's finished trials when it
    was last brought up to date (a complete through another service process shows as a change)."""

    total_samples: int | None = None
    best_feasible_throughput: float | None = None
    best_feasible_curve: list[tuple[float, float]] | None = None
    best_feasible_energy: float | None = None
    lowest_feasible_energy: float | None = None
    lowest_energy_curve: list[tuple[float, float]] | None = None
    baseline_curves: list[list[tuple[float, float]]] = field(default_factory=list)
    baseline_batch: int | None = None  # samples per optimizer step and GPU of the first baseline seed learned
    learned: set[int] = field(default_factory=set)
    finished: int = -1
    _baseline_mean: list[tuple[float, float]] | None = None

    def add_baseline(self, curve: list[tuple[float, float]], samples: int | None, batch: int | None = None) -> None:
        if self.baseline_batch is None:
            self.baseline_batch = batch
        if curve:
            self.baseline_curves.append(curve)
            self._baseline_mean = None
        if self.total_samples is None and samples:
            self.total_samples = samples

    def add_feasible(self, throughput: float, curve: list[tuple[float, float]], energy: float | None = None) -> None:
        """A feasible search trial's throughput, loss curve and energy per sample (None: not measured)."""
        if curve and (self.best_feasible_throughput is None or throughput > self.best_feasible_throughput):
            self.best_feasible_throughput, self.best_feasible_curve = throughput, curve
            self.best_feasible_energy = energy
        if curve and energy is not None and (self.lowest_feasible_energy is None
                                             or energy < self.lowest_feasible_energy):
            self.lowest_feasible_energy, self.lowest_energy_curve = energy, curve

    def reference(self) -> rules_.Reference:
        if self._baseline_mean is None:
            self._baseline_mean = mean_curve(self.baseline_curves)
        return rules_.Reference(best_feasible_throughput=self.best_feasible_throughput,
                                best_feasible_curve=self.best_feasible_curve,
                                baseline_curve=self._baseline_mean or None, total_samples=self.total_samples,
                                best_feasible_energy=self.best_feasible_energy,
                                lowest_feasible_energy=self.lowest_feasible_energy,
                                lowest_energy_curve=self.lowest_energy_curve)


@dataclass
class TrialReports:
    """A running trial's own reports so far (kept in memory by the service)."""

    curve: list[tuple[float, float]] = field(default_factory=list)
    throughputs: list[float] = field(default_factory=list)
    energy: float | None = None  # J/sample of the windows so far (GPU probes), as last reported
    # its quality is judged at the re-measure budget, not by the search's gate (remeasure.larger_batch_quality
    # "remeasure" and a larger effective batch than the baseline's): no prune for trailing the baseline's loss
    quality_deferred: bool = False

    def add(self, step: int, metrics: Mapping[str, float]) -> None:
        loss = metrics.get("loss")
        if loss is not None:
            self.curve.append((float(metrics.get("samples", step)), float(loss)))
        throughput = metrics.get("throughput")
        if throughput is not None and math.isfinite(throughput):
            self.throughputs.append(float(throughput))
        energy = metrics.get("energy_j_per_sample")
        if energy is not None and math.isfinite(energy):
            self.energy = float(energy)


def rules_for(spec: StudySpec) -> rules_.PruneRules:
    p = spec.pruning
    return rules_.PruneRules(rho=p.rho, loss_margin=p.loss_margin, min_fraction=p.min_fraction,
                             throughput_counts="throughput" in spec.objectives,
                             quality_counts="quality" in spec.objectives,
                             energy_counts="energy" in spec.objectives)


def decide(reports: TrialReports, reference: rules_.Reference | None, spec: StudySpec) -> rules_.Decision:
    """Prune or keep a trial given its reports so far. `reference` None: only divergence is judged
    (baseline and re-measure runs are never pruned for being slow). Pure."""
    if not spec.pruning.enabled:
        return KEEP
    ref = reference or rules_.Reference()
    if reports.quality_deferred:  # the loss-margin rule predicts a gate this trial is not judged by
        ref = dataclasses.replace(ref, baseline_curve=None)
    return rules_.decide(reports.curve, reports.throughputs, ref, rules_for(spec), reports.energy)
