"""No configuration is probed twice by the search: which configs a draw must not run (`twins`).

A draw of a config already measured, in flight, the baseline's, or one that failed for a reason
of its own (oom, unsupported) is a *repeat*: `OptunaBridge.ask` tells it PRUNED at once with user
attr ``repeat_of`` (`repeat_attrs`; no values: nothing was measured for it) and never leases it.
No GPU time goes into a config measured or in flight; re-measurement is the remeasure phase's job.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from optuna.trial import FrozenTrial, TrialState

from autotune.api.optuna_codec import json_safe
from autotune.api.outcome import PRESET_KNOBS, retriable
from autotune.contract.config import normalised
from autotune.contract.protocol import StudySpec
from autotune.contract.space import Space

log = logging.getLogger(__name__)

# Failures that say something about the config whatever the run: a draw of it is a repeat
CONFIG_FAILURES = ("oom", "unsupported")


def twins(spec: StudySpec, space: Space, trials: list[FrozenTrial]
          ) -> tuple[dict[str, tuple[str, FrozenTrial]], dict[str, Any]]:
    """The configs a draw must not probe again, by `config_key`, each with its twin:
    ("baseline", the first completed baseline seed), ("measured", the first search trial that
    completed with a measurement), ("running", a search trial in flight: RUNNING, or lost
    with a retry to come) or ("failed", a search trial that failed for a reason of its own:
    CONFIG_FAILURES), in that order of precedence; and the preset's values of the knobs the
    baseline left to the preset (what it ran says them). A search trial's config is the one
    it was leased, the space's fixed knobs and its params; the baseline's is the spec's
    baseline config, or what it ran. Pruned search trials and other failures are no twins:
    their configs may run again."""
    trials = sorted(trials, key=lambda t: t.number)
    base = next((t for t in trials if t.state == TrialState.COMPLETE and t.user_attrs.get("role") == "baseline"
                 and isinstance(t.user_attrs.get("config"), dict)), None)
    preset: dict[str, Any] = {}
    found: dict[str, tuple[str, FrozenTrial]] = {}
    if base is not None:
        leased, ran = normalised(spec.baseline_config()), normalised(base.user_attrs["config"])
        preset = {k: ran[k] for k in PRESET_KNOBS if leased.get(k) is None and ran.get(k) is not None}
        for config in (spec.baseline_config(), base.user_attrs["config"]):
            found.setdefault(config_key(config, preset), ("baseline", base))
    rank = {"baseline": 0, "measured": 1, "running": 2, "failed": 3}
    retried = {t.user_attrs.get("retry_of") for t in trials}
    for t in trials:
        attrs = t.user_attrs
        if attrs.get("role", "search") != "search" or attrs.get("is_baseline") or "repeat_of" in attrs:
            continue
        if t.state == TrialState.COMPLETE:
            kind = "measured"
        elif ((t.state == TrialState.RUNNING and isinstance(attrs.get("config"), dict))
              or (t.state == TrialState.FAIL and t.number not in retried and retriable(spec, "FAIL", attrs))):
            kind = "running"
        elif t.state == TrialState.FAIL and attrs.get("failure_kind") in CONFIG_FAILURES:
            kind = "failed"
        else:
            continue
        key = config_key({**space.fixed, **t.params}, preset)
        if key not in found or rank[kind] < rank[found[key][0]]:
            found[key] = (kind, t)
    return found, preset


def repeat_attrs(twin: tuple[str, FrozenTrial], config: Mapping[str, Any]) -> dict[str, Any]:
    """The user attrs of a draw that repeats the config of `twin` (its kind and trial): never run,
    PRUNED without values (nothing was measured for it), repeat_of its twin (and
    baseline_repeat_of when the twin is a baseline seed)."""
    kind, trial = twin
    attrs: dict[str, Any] = {"config": dict(config), "repeat_of": trial.number}
    if kind == "baseline":
        attrs["baseline_repeat_of"] = trial.number
    return attrs


def log_repeat(study: str, twin: tuple[str, FrozenTrial]) -> None:
    kind, trial = twin
    what = {"baseline": "the baseline's config", "measured": "a config measured", "running": "a config in flight",
            "failed": "a config that failed"}[kind]
    log.info("study %s: a draw repeated %s (trial %d): not run", study, what, trial.number)


def config_key(config: Mapping[str, Any], preset: Mapping[str, Any]) -> str:
    """What makes two configs one (`twins`): every knob normalised
    (`autotune.contract.config.normalised`: a knob left out is at its default, 25 and 25.0 are one
    value), and a knob left to the workload's preset (batch_size, accum_steps, lr: None) at the
    preset's value where `preset` knows it."""
    knobs = normalised(config)
    for name, value in preset.items():
        if knobs.get(name) is None:
            knobs[name] = value
    return json.dumps(json_safe(knobs), sort_keys=True, default=str)
