"""Whether a study's probes can time its baseline: a budget too small for the baseline's
effective batch is refused when the study is created, not after a worker's failed baseline."""

from __future__ import annotations

from autotune.api.errors import Invalid
from autotune.api.outcome import preset_values
from autotune.contract.config import KNOBS, ConfigError
from autotune.contract.protocol import StudySpec
from autotune.contract.steps import plan_steps


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
    preset = preset_values(spec.workload, spec.preset) or {}
    batch, accum = (config.get(k) or preset.get(k) for k in ("batch_size", "accum_steps"))
    if batch is None or accum is None:
        return
    frequency = config.get("inverse_loss_frequency") or KNOBS["inverse_loss_frequency"].default
    ranks = f" on {spec.gpus_per_trial} ranks" if spec.gpus_per_trial > 1 else ""
    try:
        plan_steps(samples, batch * accum * spec.gpus_per_trial, spec.probe.warmup_steps, spec.probe.windows,
                   frequency)
    except ConfigError as e:
        raise Invalid("probe.samples", f"probe.samples: the baseline ({batch} × {accum}{ranks}) could not be "
                                       f"timed: {e.message}") from None
