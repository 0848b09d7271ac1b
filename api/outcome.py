"""How a worker's ProbeResult becomes the outcome of an Optuna trial.

The mapping is explicit (one place, one function):

* ``result["failure"]`` set           → FAIL, user attrs failure_kind / failure_message
* ``result["stopped_early"]``         → PRUNED (pruned or stopped by the service; no values)
* otherwise                           → COMPLETE with values in the study's objective order,
  provided both throughput_samples_per_s (> 0) and val_nrmse are finite numbers: the
  gate and the recommendation need both, whichever objectives the study optimises.
  Otherwise FAIL with kind "error" saying which value was bad.

Every outcome carries the measurement user attrs (config, device, torch version, warm-up,
spread, memory, data wait, samples, worker, knob notes, failure kind or None).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from autotune.protocol import OBJECTIVES, StudySpec

# ProbeResult fields copied verbatim into user attrs
RESULT_ATTRS = ("device", "torch_version", "warmup_s", "throughput_spread", "peak_mem_reserved_bytes",
                "peak_mem_allocated_bytes", "data_wait_fraction", "samples_trained", "throughput_samples_per_s",
                "val_nrmse")
MAX_MESSAGE = 2000


@dataclass(frozen=True)
class TrialOutcome:
    state: Literal["COMPLETE", "FAIL", "PRUNED"]
    values: list[float] | None
    attrs: dict[str, Any]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _failure(failure: Any) -> tuple[str, str]:
    """(kind, message) of a ProbeResult failure record, tolerating malformed ones."""
    if isinstance(failure, Mapping):
        kind = str(failure.get("kind") or "error")[:50]
        message = str(failure.get("message") or "")
    else:
        kind, message = "error", str(failure)
    return kind, message[:MAX_MESSAGE]


def probe_outcome(result: Mapping[str, Any], spec: StudySpec, worker_id: str) -> TrialOutcome:
    """The trial outcome for `result` (ProbeResult.to_dict()) reported by `worker_id`."""
    attrs: dict[str, Any] = {k: result.get(k) for k in RESULT_ATTRS}
    attrs["worker_id"] = worker_id
    knobs = result.get("knobs")
    attrs["knobs"] = dict(knobs) if isinstance(knobs, Mapping) else {}
    attrs["stopped_early"] = bool(result.get("stopped_early"))
    config = result.get("config")
    if isinstance(config, Mapping) and config:  # the effective config; otherwise keep the leased one
        attrs["config"] = dict(config)
    attrs["failure_kind"] = None
    attrs["failure_message"] = None

    if result.get("failure"):
        kind, message = _failure(result["failure"])
        attrs.update(failure_kind=kind, failure_message=message)
        return TrialOutcome("FAIL", None, attrs)
    if result.get("stopped_early"):
        return TrialOutcome("PRUNED", None, attrs)

    throughput = _number(result.get("throughput_samples_per_s"))
    nrmse = _number(result.get("val_nrmse"))
    problems = []
    if throughput is None or throughput <= 0:
        problems.append(f"throughput_samples_per_s is {result.get('throughput_samples_per_s')!r}")
    if nrmse is None:
        problems.append(f"val_nrmse is {result.get('val_nrmse')!r}")
    if problems:
        attrs.update(failure_kind="error", failure_message="the probe reported no failure but "
                     + " and ".join(problems) + " (need finite numbers)")
        return TrialOutcome("FAIL", None, attrs)
    assert throughput is not None and nrmse is not None
    measured = {"throughput_samples_per_s": throughput, "val_nrmse": nrmse}
    values = [measured[OBJECTIVES[o][0]] for o in spec.objectives]
    return TrialOutcome("COMPLETE", values, attrs)
