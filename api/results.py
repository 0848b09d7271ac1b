"""Judging a study's trials: quality gate, wire views, the recommendation. Pure functions.

Gate (DESIGN.md): a completed trial is feasible iff its val_nrmse <= the baseline's
val_nrmse + gate.abs_tol. Until the baseline has completed, feasibility is unknown (None).
The recommendation is the fastest feasible completed trial, the baseline included, with
its speedup over the baseline.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import yaml

from api.optuna_bridge import TrialRecord
from autotune.config import KNOBS
from autotune.protocol import OBJECTIVES, Recommendation, StudySpec, TrialInfo


class NoRecommendation(Exception):
    """There is nothing to recommend yet; the message says why and what to wait for."""


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def metric(trial: TrialRecord, spec: StudySpec, name: str) -> float | None:
    """`name` (throughput_samples_per_s | val_nrmse) of a trial: its objective value, else its user attr."""
    objective_names = [OBJECTIVES[o][0] for o in spec.objectives]
    if trial.values is not None and name in objective_names:
        return _finite(trial.values[objective_names.index(name)])
    return _finite(trial.user_attrs.get(name))


def baseline_of(trials: Sequence[TrialRecord]) -> TrialRecord | None:
    """The baseline trial (user attr is_baseline, the study's first trial)."""
    return next((t for t in trials if t.user_attrs.get("is_baseline")), None)


def gate_nrmse(spec: StudySpec, trials: Sequence[TrialRecord]) -> float | None:
    """The largest val_nrmse a feasible trial may have; None until the baseline has completed."""
    baseline = baseline_of(trials)
    if baseline is None or baseline.state != "COMPLETE":
        return None
    nrmse = metric(baseline, spec, "val_nrmse")
    return None if nrmse is None else nrmse + spec.gate.abs_tol


def is_feasible(trial: TrialRecord, spec: StudySpec, gate: float | None) -> bool | None:
    """True/False once both the gate and the trial's outcome are known, else None."""
    if gate is None or not trial.finished:
        return None
    nrmse = metric(trial, spec, "val_nrmse")
    return trial.state == "COMPLETE" and nrmse is not None and nrmse <= gate


def trial_info(trial: TrialRecord, spec: StudySpec, gate: float | None) -> TrialInfo:
    attrs = trial.user_attrs
    failure = None
    if attrs.get("failure_kind"):
        failure = {"kind": str(attrs["failure_kind"]), "message": str(attrs.get("failure_message") or "")}
    config = attrs.get("config")
    return TrialInfo(
        trial_id=trial.trial_id, number=trial.number, state=trial.state, params=trial.params,
        config=config if isinstance(config, dict) else None,
        values=trial.values, throughput_samples_per_s=metric(trial, spec, "throughput_samples_per_s"),
        val_nrmse=metric(trial, spec, "val_nrmse"), feasible=is_feasible(trial, spec, gate), failure=failure,
        worker_id=attrs.get("worker_id"), is_baseline=bool(attrs.get("is_baseline")), duration_s=trial.duration_s,
    )


def trial_infos(trials: Sequence[TrialRecord], spec: StudySpec, all_trials: Sequence[TrialRecord] | None = None
                ) -> list[TrialInfo]:
    """Views of `trials`; the gate comes from `all_trials` (default: `trials`)."""
    gate = gate_nrmse(spec, all_trials if all_trials is not None else trials)
    return [trial_info(t, spec, gate) for t in trials]


def counts_by_state(trials: Sequence[TrialRecord]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for t in trials:
        counts[t.state] = counts.get(t.state, 0) + 1
    return counts


def failures_by_kind(trials: Sequence[TrialRecord]) -> dict[str, int]:
    failures: dict[str, int] = {}
    for t in trials:
        if t.state == "FAIL":
            kind = str(t.user_attrs.get("failure_kind") or "error")
            failures[kind] = failures.get(kind, 0) + 1
    return failures


def recommend(study_name: str, spec: StudySpec, trials: Sequence[TrialRecord]) -> Recommendation:
    """The fastest feasible completed trial. Raises NoRecommendation when there is none yet."""
    baseline = baseline_of(trials)
    if baseline is None:
        raise NoRecommendation(f"study {study_name!r} has no recommendation yet: its baseline trial has not been "
                               "leased; start a worker with the study's hardware class")
    if baseline.state != "COMPLETE":
        why = {"FAIL": "failed", "PRUNED": "was pruned"}.get(baseline.state, "is still running")
        failure = f" ({baseline.user_attrs.get('failure_kind')}: {baseline.user_attrs.get('failure_message')})" \
            if baseline.state == "FAIL" else ""
        raise NoRecommendation(f"study {study_name!r} has no recommendation yet: the baseline (trial "
                               f"{baseline.number}) {why}{failure}; the quality gate needs its val_nrmse")
    gate = gate_nrmse(spec, trials)
    candidates = [(thr, t) for t in trials if is_feasible(t, spec, gate)
                  and (thr := metric(t, spec, "throughput_samples_per_s")) is not None]
    if not candidates:
        raise NoRecommendation(f"study {study_name!r} has no feasible completed trial with a throughput yet")
    throughput, best = max(candidates, key=lambda c: (c[0], -c[1].number))
    base_thr = metric(baseline, spec, "throughput_samples_per_s")
    config = best.user_attrs.get("config") or {}
    peak = best.user_attrs.get("peak_mem_reserved_bytes")
    return Recommendation(
        study=study_name, config={k: v for k, v in config.items() if k in KNOBS}, trial_number=best.number,
        throughput_samples_per_s=throughput, val_nrmse=metric(best, spec, "val_nrmse") or 0.0,
        baseline_throughput_samples_per_s=base_thr, baseline_val_nrmse=metric(baseline, spec, "val_nrmse"),
        speedup=throughput / base_thr if base_thr else None, gate_nrmse=gate,
        peak_mem_reserved_bytes=int(peak) if isinstance(peak, (int, float)) and not isinstance(peak, bool) else None,
    )


def recommendation_yaml(rec: Recommendation) -> str:
    """The recommended config as YAML that `autotune probe --config FILE` reads, with the
    numbers behind it as a comment header."""
    lines = [f"# autotune recommendation for study {rec.study}: trial {rec.trial_number}",
             f"# throughput: {rec.throughput_samples_per_s:.1f} samples/s"]
    if rec.baseline_throughput_samples_per_s is not None:
        speedup = f"{rec.speedup:.2f}x" if rec.speedup is not None else "n/a"
        lines.append(f"# baseline throughput: {rec.baseline_throughput_samples_per_s:.1f} samples/s "
                     f"(speedup {speedup})")
    gate = f" (gate: <= {rec.gate_nrmse:.6g})" if rec.gate_nrmse is not None else ""
    lines.append(f"# val_nrmse: {rec.val_nrmse:.6g}{gate}; baseline val_nrmse: "
                 f"{'n/a' if rec.baseline_val_nrmse is None else f'{rec.baseline_val_nrmse:.6g}'}")
    if rec.peak_mem_reserved_bytes is not None:
        lines.append(f"# peak memory reserved: {rec.peak_mem_reserved_bytes / 2**30:.2f} GiB")
    body = yaml.safe_dump(rec.config, sort_keys=False, default_flow_style=False) if rec.config else "{}\n"
    return "\n".join(lines) + "\n" + body
