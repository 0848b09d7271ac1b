"""How a probe's sample budget splits into warm-up steps, timed windows and an untimed tail
(`plan_steps`): torch-free, so the service can refuse a study whose baseline its probes
could not time (api/study/admission.py) before any worker runs one."""

from __future__ import annotations

from autotune.contract.config import ConfigError

MIN_WINDOWS = 5


def plan_steps(samples: int, effective_batch: int, warmup_steps: int, windows: int,
               inverse_loss_frequency: int, warmup_periods: int = 2) -> tuple[int, int, int, int]:
    """Split the sample budget into (total steps, warm-up steps, windows, steps per window).

    The warm-up holds at least `warmup_periods` inverse-loss periods, so that each step kind
    is warm before the windows (under step_graph: run eagerly, captured and replayed).
    Windows hold a whole number of inverse-loss periods where possible, so every window
    has the same mix of cheap and expensive steps. Leftover steps train untimed at the end.
    """
    total = samples // effective_batch
    warm = max(warmup_steps, warmup_periods * inverse_loss_frequency)
    timed = total - warm
    if timed < MIN_WINDOWS:
        need = (warm + MIN_WINDOWS) * effective_batch
        raise ConfigError("samples", f"{samples} samples at effective batch {effective_batch} leave {max(timed, 0)} "
                                     f"timed steps after {warm} warm-up steps; need >= {MIN_WINDOWS}: "
                                     f"use samples >= {need} or a smaller batch_size × accum_steps")
    n_windows = min(max(windows, MIN_WINDOWS), timed)
    per = timed // n_windows
    if per >= inverse_loss_frequency:
        per -= per % inverse_loss_frequency
    return total, warm, n_windows, per
