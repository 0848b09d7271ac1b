"""The front: the non-dominated candidates, each at its re-measured values where it has them."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from autotune.api.study.feasibility import gate_quality
from autotune.api.study.front import candidates
from autotune.api.study.remeasure import geomean, pooled_energy, remeasurement, run_values
from autotune.api.study.trials import TrialRecord
from autotune.contract.protocol import OBJECTIVES, StudySpec


def pareto_front(trials: Sequence[TrialRecord], spec: StudySpec) -> list[TrialRecord]:
    """The front: the non-dominated candidates (feasible search trials, `candidates`), each at
    its re-measured value where it has one (`front_values`), by number. The API, the CLI, the
    report and the recommendation all use this one."""
    signs = [1.0 if direction == "maximize" else -1.0 for direction in spec.objective_directions()]
    values = front_values(spec, trials)
    points = [(t, [s * v for s, v in zip(signs, vs, strict=True)]) for t in trials
              if (vs := values.get(t.number)) is not None]

    def dominates(a: list[float], b: list[float]) -> bool:
        return all(x >= y for x, y in zip(a, b, strict=True)) and any(x > y for x, y in zip(a, b, strict=True))

    return sorted((t for t, p in points if not any(dominates(q, p) for _, q in points)), key=lambda t: t.number)


def front_values(spec: StudySpec, trials: Sequence[TrialRecord]) -> dict[int, list[float]]:
    """Trial number -> the objective values (the spec's order) of every candidate on which the
    front is computed: a feasible search trial at its re-measured value where it has one (the
    geometric-mean throughput and the mean quality of its re-measurements). A candidate whose
    re-measurement failed, or whose quality the verdict showed worse, is left out."""
    gate = gate_quality(spec, trials)
    rm = remeasurement(spec, trials, gate)
    out: dict[int, list[float]] = {}
    for t in candidates(spec, trials, gate):
        if t.number in rm.dropped or rm.judged(spec, t.number) is False:
            continue
        runs = rm.runs.get(t.number) or [t]
        throughput = geomean(run_values(runs, spec, "throughput_samples_per_s"))
        quality = run_values(runs, spec, "quality")
        energy = pooled_energy(runs, spec)
        if throughput is None or not quality or ("energy" in spec.objectives and energy is None):
            continue
        measured = {"throughput_samples_per_s": throughput, "quality": statistics.fmean(quality),
                    "energy_j_per_sample": energy}
        out[t.number] = [float(measured[OBJECTIVES[o][0]] or 0.0) for o in spec.objectives]
    return out
