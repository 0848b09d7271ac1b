"""Whether a running trial should stop early, from what its worker reported.

Optuna's `Trial.report`/`should_prune` raise for multi-objective studies, so the decision
is ours and lives here, in one pure function. Today's rule: a non-finite training loss
(NaN/inf) prunes at once, since that trial can only end as a failure. Multi-objective
pruning against the study's history (a later issue) extends `decide` without changing
its callers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from api.crud import ReportRecord


@dataclass(frozen=True)
class PruneDecision:
    prune: bool
    reason: str | None = None


KEEP = PruneDecision(prune=False)


def decide(trial_id: int, step: int, metrics: Mapping[str, float], history: Sequence[ReportRecord]) -> PruneDecision:
    """Prune or keep trial `trial_id` after it reported `metrics` at `step`.

    `history` holds the reports the rule needs, oldest first, this one included. Today's rule
    needs none, so the service passes only the current report (reading every report of the
    study on every call made reports slower as the study grew); a rule that compares a trial
    with its peers should get them from a cheap per-study summary kept by the service, not
    from a full read. Pure: no I/O, no side effects.
    """
    loss = metrics.get("loss")
    if loss is not None and not math.isfinite(loss):
        return PruneDecision(prune=True, reason=f"training loss is {loss} at step {step}: the trial diverged")
    return KEEP
