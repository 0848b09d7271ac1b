"""What the service refuses when a study is created that the spec alone cannot say: a sampler
that cannot search the space, a probe budget too small to time the baseline, and a quality metric
a built-in workload never reports. The last two would otherwise be found by a worker, as a failed
baseline."""

from __future__ import annotations

from autotune.api.errors import Invalid
from autotune.api.outcome import preset_values
from autotune.api.study.samplers import check_sampler_fits
from autotune.api.study.trials import batch_per_step
from autotune.contract.config import KNOBS, ConfigError
from autotune.contract.protocol import StudySpec
from autotune.contract.registry import BUILTIN
from autotune.contract.space import Space, SpaceError
from autotune.contract.steps import plan_steps


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
