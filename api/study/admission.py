"""What the service refuses when a study is created that the spec alone cannot say: a sampler
that cannot search the space, a probe budget too small to time the baseline, and a quality metric
a built-in workload never reports. The last two would otherwise be found by a worker, as a failed
baseline. What costs trials without stopping the study (searched configs the budget cannot time)
is a note on the study (`admission_notes`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from autotune.api.errors import Invalid
from autotune.api.outcome import preset_values
from autotune.api.study.samplers import check_sampler_fits
from autotune.api.study.trials import batch_per_step
from autotune.contract.config import KNOBS, ConfigError
from autotune.contract.protocol import StudySpec
from autotune.contract.registry import BUILTIN
from autotune.contract.space import Space, SpaceError
from autotune.contract.steps import MIN_WINDOWS, plan_steps


def check_admission(spec: StudySpec, space: Space) -> None:
    """Raise Invalid naming the field when the study could not run as written: a sampler that
    cannot search `space` (`check_sampler_fits`), then the checks below."""
    try:
        check_sampler_fits(spec, space)
    except SpaceError as e:
        raise Invalid(e.field, str(e)) from e
    check_quality_metric(spec)
    check_baseline_timed(spec)


def check_quality_metric(spec: StudySpec) -> None:
    """A built-in workload reports one quality metric, with one direction: a study naming
    another could complete no trial. (A plugin's is known only from its first result.)"""
    entry = BUILTIN.get(spec.workload)
    if entry is None or entry.quality_metric is None or spec.quality is None:
        return
    metric, direction = spec.quality.metric, spec.quality.direction
    own = f"quality: {{metric: {entry.quality_metric}, direction: {entry.quality_direction}}}"
    if metric is not None and metric != entry.quality_metric:
        raise Invalid("quality.metric", f"quality.metric: workload {spec.workload!r} reports "
                                        f"{entry.quality_metric!r}, never {metric!r}: write {own}, or leave "
                                        "quality out (the workload's own is the default)")
    if entry.quality_direction is not None and direction != entry.quality_direction:
        raise Invalid("quality.direction", f"quality.direction: workload {spec.workload!r}'s "
                                           f"{entry.quality_metric} is to {entry.quality_direction}, not "
                                           f"{direction}: write {own}, or leave quality out")


def check_baseline_timed(spec: StudySpec) -> None:
    """Raise Invalid (field probe.samples) when `spec.probe.samples` leaves the baseline fewer
    timed steps than a probe needs (`plan_steps`). Checked where the service knows the
    baseline's batch × accumulation (its config, else a built-in preset's) and its warm-up:
    not for the preset's own sample budget, a plugin preset's batch or a step graph's warm-up
    (which depends on whether the graph can act where the probe runs)."""
    samples = spec.probe.samples
    config = spec.baseline_config()
    if samples is None or config.get("step_graph"):
        return
    per_step = batch_per_step(config, preset_values(spec.workload, spec.preset))
    if per_step is None:
        return
    frequency = config.get("inverse_loss_frequency") or KNOBS["inverse_loss_frequency"].default
    ranks = f" on each of {spec.gpus_per_trial} ranks" if spec.gpus_per_trial > 1 else ""
    try:
        plan_steps(samples, per_step * spec.gpus_per_trial, spec.probe.warmup_steps, spec.probe.windows, frequency)
    except ConfigError as e:
        raise Invalid("probe.samples", f"probe.samples: the baseline ({per_step} samples per optimizer step{ranks}) "
                                       f"could not be timed: {e.message}") from None


def admission_notes(spec: StudySpec, space: Space) -> list[str]:
    """What the study will spend trials on that cannot succeed, said where the user reads it
    (StudyInfo.notes: `autotune submit` and `autotune status` print them)."""
    note = untimed_configs_note(spec, space)
    return [note] if note else []


def _int_values(space: Space, knob: str, fallback: Any) -> Sequence[int]:
    """The values `knob` can take in `space` (searched, fixed, else `fallback`), ints >= 1 only,
    ascending. An int range stays a `range` (batch_size 1..65536 × accum_steps 1..1024 was
    listed in full at every view of the study: 13 ms each)."""
    param = space.params.get(knob)
    if param is not None and param.choices is None and param.is_int and param.low is not None \
            and param.high is not None and int(param.low) >= 1:
        return range(int(param.low), int(param.high) + 1, int(param.step or 1))
    try:
        values = param.values() if param is not None else [space.fixed.get(knob, fallback)]
    except SpaceError:  # a float range: not a count
        return []
    return sorted({v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 1})


def untimed_configs_note(spec: StudySpec, space: Space) -> str | None:
    """When `space` can draw batch_size × accum_steps larger than `spec.probe.samples` can time
    (`plan_steps`, at the shortest warm-up the space allows), a note naming the largest product
    that is timed, the space's largest, and the budget that times all of them. Such configs fail
    as trials before any training (the sampler learns them as infeasible); the baseline's own
    budget is refused at creation instead (`check_baseline_timed`). No note for the preset's own
    budget (probe.samples unset): the service does not know it."""
    samples = spec.probe.samples
    preset = preset_values(spec.workload, spec.preset) or {}
    batches = _int_values(space, "batch_size", preset.get("batch_size"))
    accums = _int_values(space, "accum_steps", preset.get("accum_steps"))
    periods = _int_values(space, "inverse_loss_frequency", KNOBS["inverse_loss_frequency"].default)
    if samples is None or not batches or not accums or not periods:
        return None
    ranks = spec.gpus_per_trial
    shortest = max(spec.probe.warmup_steps, 2 * periods[0])
    timed_at_most = samples // (shortest + MIN_WINDOWS) // ranks  # per GPU; more leaves < MIN_WINDOWS timed steps
    largest = batches[-1] * accums[-1]
    if largest <= timed_at_most:
        return None
    needed = largest * ranks * (max(spec.probe.warmup_steps, 2 * periods[-1]) + MIN_WINDOWS)
    examples = sorted({(b, a) for b in batches[-3:] for a in accums[-3:] if b * a > timed_at_most},
                      key=lambda ba: (-ba[0] * ba[1], -ba[0]))[:3]
    shown = ", ".join(f"{b} × {a}" for b, a in examples)
    per_gpu = f" per GPU ({ranks} per trial)" if ranks > 1 else ""
    return (f"probe.samples {samples} times at most {timed_at_most} samples per optimizer step{per_gpu} "
            f"(batch_size × accum_steps); the space draws up to {largest} (e.g. {shown}): such configs fail as "
            f"trials before training. Use probe.samples >= {needed} to time them all, or narrow the space")
