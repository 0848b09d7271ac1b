"""How a worker's ProbeResult becomes the outcome of an Optuna trial (`probe_outcome`), and the
checks of a reported config against the leased one.

One explicit mapping: a failure is Optuna FAIL with failure_kind / failure_message (Optuna holds
only what was measured: no placeholder values); stopped early is PRUNED; otherwise COMPLETE with
values in objective order, provided throughput, quality (and energy, where it is an objective) are
usable, else FAIL "error". Failures that say nothing about the config (lost, refused, interrupted)
are re-run (`retriable`). A completed trial carries the constraint the samplers learn (≤ 0
feasible). It never raises on a stored or older result.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from autotune.contract.config import KNOBS, ConfigError
from autotune.contract.gate import constraint_value
from autotune.contract.protocol import OBJECTIVES, StudySpec

# ProbeResult fields copied verbatim into user attrs
RESULT_ATTRS = ("device", "torch_version", "cuda_version", "driver_version", "gpu_count", "model_fingerprint",
                "warmup_s", "throughput_spread", "peak_mem_reserved_bytes",
                "peak_mem_allocated_bytes", "data_wait_fraction", "samples_trained", "throughput_samples_per_s",
                "val_nrmse", "window_throughputs", "raw_window_throughputs", "epoch_cost_s", "window_data_wait_s",
                "window_gpu", "window_host", "host_cpu", "compile_workers",
                "measurement_notes", "loss_curve", "quality_metric", "energy_j_per_sample",
                "window_energy_j_per_sample", "gpu_energy_j_per_sample", "energy_method")
MAX_MESSAGE = 2000
# Failures that say nothing about the trial's config: the worker refused its workload (not on
# its allow-list, or not installed there), or was interrupted (SIGTERM/SIGINT: a preemption).
# Like a lost trial they stay Optuna FAIL and are re-run by another worker (`retriable`).
NOT_ABOUT_THE_CONFIG = ("refused", "interrupted")
RETRIED_KINDS = ("lost", *NOT_ABOUT_THE_CONFIG)  # the reaper's, and the failures told as Optuna FAIL


def lost(state: str, attrs: Mapping[str, Any]) -> bool:
    """A trial (its Optuna state name and user attrs) that failed not because of its config: its
    worker went silent (the reaper: "lost"), did not run its workload ("refused") or was stopped
    by a signal ("interrupted"). Such a trial is re-run by another worker (`retriable`)."""
    return state == "FAIL" and attrs.get("failure_kind") in RETRIED_KINDS


def attempt(attrs: Mapping[str, Any]) -> int:
    """1 for a first run, k for the (k-1)-th retry of a lost trial."""
    value = attrs.get("attempt")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1


def retriable(spec: StudySpec, state: str, attrs: Mapping[str, Any]) -> bool:
    """A lost trial whose attempts are not used up (retried at most spec.max_retries times)."""
    return lost(state, attrs) and attempt(attrs) <= spec.max_retries


GIB = 2**30
CONSTRAINT_ATTR = "constraint"  # the user attr holding the gate constraint the samplers read (api/study/samplers.py)


def quality_mismatch(result: Mapping[str, Any], spec: StudySpec) -> str | None:
    """Why `result`'s quality cannot be judged by `spec`'s gate (another metric or direction), or None."""
    metric, direction = result.get("quality_metric"), result.get("quality_direction")
    if spec.quality_metric is not None and isinstance(metric, str) and metric != spec.quality_metric:
        return (f"the workload reported quality metric {metric!r} but the study gates on {spec.quality_metric!r}; "
                f"submit a study with quality: {{metric: {metric}}} (or fix the workload's quality_metric)")
    if isinstance(direction, str) and direction != spec.quality_direction:
        return (f"the workload's quality metric {metric!r} is to {direction} but the study's is to "
                f"{spec.quality_direction}; submit a study with quality: {{direction: {direction}}}")
    return None


def no_energy_message(result: Mapping[str, Any]) -> str:
    """Why a result cannot be valued by a study with the energy objective, and the fix."""
    device = result.get("device") or "the worker's device"
    return (f"the study minimizes energy but the probe measured none on {device} (energy_j_per_sample is "
            f"{result.get('energy_j_per_sample')!r}): energy is read from NVML (the GPU's total-energy counter, else "
            "its power readings). Install nvidia-ml-py where the worker runs and check that `nvidia-smi -q -d "
            "POWER` shows a power draw; or drop energy from the study's objectives")


def failed_attrs(kind: str, message: str) -> dict[str, Any]:
    return {"failure_kind": kind, "failure_message": message[:MAX_MESSAGE]}


def memory_constraint(peak_reserved_bytes: Any, spec: StudySpec) -> float | None:
    """peak reserved GiB − max_memory_gb (≤ 0 fits); None without a limit or a measurement."""
    peak = _number(peak_reserved_bytes)
    if spec.max_memory_gb is None or peak is None:
        return None
    return peak / GIB - spec.max_memory_gb


def constraint_of(quality: float | None, peak_reserved_bytes: Any, spec: StudySpec, gate: float | None
                  ) -> float | None:
    """The constraint a completed trial is told with; None when neither the gate nor a memory limit applies."""
    parts = [c for c in (constraint_value(quality, gate, spec.quality_direction) if gate is not None else None,
                         memory_constraint(peak_reserved_bytes, spec)) if c is not None]
    return max(parts) if parts else None


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


# The knobs a probe fills in from the workload preset when the config leaves them null
# (`autotune.contract.config.TrainConfig.resolve`): a result reports the preset's values for these then.
PRESET_KNOBS = ("batch_size", "accum_steps", "lr")
# Their values in the built-in workloads' presets (TrainingDefaults in autotune/workloads/ups and
# gpt), written down here because the service never imports a workload (torch);
# tests/api/test_hostile_config.py holds them to the workloads' own. A reported config is checked
# against them: a result cannot slip another learning rate into a config that later leases
# (the baseline's re-measurement, the starting points) and best.yaml are built from.
PRESET_VALUES: dict[tuple[str, str], dict[str, Any]] = {
    ("ups", "tiny"): {"batch_size": 4, "accum_steps": 2, "lr": 3e-3},
    ("ups", "tiny-muon"): {"batch_size": 4, "accum_steps": 2, "lr": 3e-3},
    ("ups", "full"): {"batch_size": 12, "accum_steps": 4, "lr": 5e-4},
    ("ups", "full-muon"): {"batch_size": 12, "accum_steps": 4, "lr": 5e-4},
    ("gpt", "tiny"): {"batch_size": 8, "accum_steps": 2, "lr": 3e-3},
    ("gpt", "full"): {"batch_size": 16, "accum_steps": 2, "lr": 6e-4},
    ("gpt", "medium"): {"batch_size": 8, "accum_steps": 4, "lr": 6e-4},
}
# What a reported config may hold besides the knobs: the probe's derived fields.
DERIVED_CONFIG_KEYS = ("effective_batch",)


def preset_values(workload: str, preset: str) -> dict[str, Any] | None:
    """PRESET_KNOBS' values in a built-in workload's preset; None where the service cannot know
    them (a plugin workload: only its own module, which the service never imports, says)."""
    values = PRESET_VALUES.get((workload, preset))
    return dict(values) if values is not None else None


PRESET_RAN_ATTR = "preset_ran"  # user attr of a plugin study's baseline: the preset's knobs as it ran them


def preset_knobs_ran(leased: Mapping[str, Any] | None, reported: Any) -> dict[str, Any]:
    """The knobs the lease left to the preset (PRESET_KNOBS, None or absent in `leased`), as the
    probe reported running them."""
    if not isinstance(reported, Mapping):
        return {}
    leased = leased or {}
    return {k: reported[k] for k in PRESET_KNOBS if leased.get(k) is None and reported.get(k) is not None}


def config_key_problems(reported: Mapping[str, Any]) -> list[str]:
    """What a reported config holds that no config holds, one line each (empty: nothing): keys
    that are neither knobs (`autotune.contract.config.KNOBS`) nor derived fields, and an effective_batch
    that is not a positive integer. Such a key would be stored with the trial's config."""
    unknown = sorted(str(k) for k in reported if k not in KNOBS and k not in DERIVED_CONFIG_KEYS)
    out = [f"unknown keys {', '.join(repr(k[:100]) for k in unknown[:10])}"
           + (f" and {len(unknown) - 10} more" if len(unknown) > 10 else "")] if unknown else []
    batch = reported.get("effective_batch", 1)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        out.append(f"effective_batch {batch!r} is not a positive integer")
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    return bool(a == b) and type(a) is type(b)


def config_differences(leased: Mapping[str, Any], reported: Mapping[str, Any],
                       preset: Mapping[str, Any] | None = None) -> list[str]:
    """Where a result's `reported` config departs from the `leased` one, one line per knob
    (empty: the same config).

    Both are normalised through the knob table first (`autotune.contract.config`): a knob left out is
    at its default, values are coerced to the knob's type (25 and 25.0 are one bucket size).
    The probe reports its effective config, so a knob the lease left null for the preset
    (PRESET_KNOBS) comes back with the preset's value: it must be `preset`'s (`preset_values`),
    and may be any valid value where the preset's are not known (None). Keys that are not
    knobs are not compared (`config_key_problems` refuses them)."""
    def value(source: Mapping[str, Any], name: str) -> tuple[Any, str | None]:
        knob = KNOBS[name]
        if name not in source:
            return knob.default, None
        try:
            return knob.check(source[name]), None
        except ConfigError as e:
            return source[name], e.message

    out = []
    for name in KNOBS:
        want, _ = value(leased, name)
        got, problem = value(reported, name)
        if problem is not None:
            out.append(f"{name} (leased {want!r}, reported {got!r}: {problem})")
        elif want is None and name in PRESET_KNOBS:  # null (or left out) in a report too: the preset's
            if preset is not None and got is not None and not _same(KNOBS[name].check(preset[name]), got):
                out.append(f"{name} (leased null: the preset's {preset[name]!r}, reported {got!r})")
        elif not _same(want, got):
            out.append(f"{name} (leased {want!r}, reported {got!r})")
    return out


def config_to_store(leased: Mapping[str, Any], reported: Mapping[str, Any],
                    preset: Mapping[str, Any] | None) -> dict[str, Any]:
    """The config a trial keeps from a report that passed `config_key_problems` and
    `config_differences`: the reported one (the effective config the probe ran), less the
    preset knobs the lease left null where the preset's values are unknown (`preset` None):
    those were not checked, and the trial's config feeds later leases and best.yaml. Left out,
    they stay the preset's: every later probe fills them in again."""
    return {k: v for k, v in reported.items()
            if preset is not None or k not in PRESET_KNOBS or leased.get(k) is not None}


def probe_outcome(result: Mapping[str, Any], spec: StudySpec, worker_id: str, gate: float | None = None,
                  baseline: bool = False) -> TrialOutcome:
    """The trial outcome for `result` (ProbeResult.to_dict()) reported by `worker_id`; `gate`:
    the study's quality threshold when known; `baseline`: the trial is a baseline seed."""
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
        attrs.update(failed_attrs(kind, message))
        return TrialOutcome("FAIL", None, attrs)
    if result.get("stopped_early"):
        return TrialOutcome("PRUNED", None, attrs)

    mismatch = quality_mismatch(result, spec)
    if mismatch:
        attrs.update(failed_attrs("error", mismatch))
        return TrialOutcome("FAIL", None, attrs)
    throughput = _number(result.get("throughput_samples_per_s"))
    quality_key = "quality" if result.get("quality") is not None else "val_nrmse"  # older workers: val_nrmse
    nrmse = _number(result.get(quality_key))
    attrs["quality"] = nrmse
    if not isinstance(attrs.get("quality_metric"), str):
        attrs["quality_metric"] = spec.quality_metric or "val_nrmse"
    problems = []
    if throughput is None or throughput <= 0:
        problems.append(f"throughput_samples_per_s is {result.get('throughput_samples_per_s')!r}")
    if nrmse is None:
        problems.append(f"{attrs['quality_metric']} is {result.get(quality_key)!r}")
    if problems:
        attrs.update(failed_attrs("error", "the probe reported no failure but " + " and ".join(problems)
                                  + " (need finite numbers)"))
        return TrialOutcome("FAIL", None, attrs)
    assert throughput is not None and nrmse is not None
    energy = _number(result.get("energy_j_per_sample"))
    if "energy" in spec.objectives and (energy is None or energy <= 0):
        attrs.update({"failure_kind": "error", "failure_message": no_energy_message(result)})
        return TrialOutcome("FAIL", None, attrs)
    measured = {"throughput_samples_per_s": throughput, "quality": nrmse, "energy_j_per_sample": energy or 0.0}
    values = [measured[OBJECTIVES[o][0]] for o in spec.objectives]
    constraint = constraint_of(None if baseline else nrmse, result.get("peak_mem_reserved_bytes"), spec,
                               None if baseline else gate)
    if baseline and constraint is None:
        constraint = 0.0
    if constraint is not None:
        attrs[CONSTRAINT_ATTR] = constraint
    return TrialOutcome("COMPLETE", values, attrs)
