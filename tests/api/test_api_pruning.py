"""api.pruning.decide: the one place that decides whether a running trial stops early."""

from __future__ import annotations

import math

from api.pruning import decide


def test_finite_loss_keeps_the_trial() -> None:
    assert not decide(1, 10, {"loss": 0.3}, []).prune
    assert not decide(1, 10, {"throughput": 5.0}, []).prune  # no loss reported: nothing to judge


def test_non_finite_loss_prunes_with_a_reason() -> None:
    for loss in (math.nan, math.inf, -math.inf):
        decision = decide(1, 7, {"loss": loss}, [])
        assert decision.prune and decision.reason is not None and "step 7" in decision.reason
