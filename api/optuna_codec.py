"""How the service's trials are written to Optuna's storage and read back (`OptunaBridge`'s helpers).

A trial's probe measurement (the ProbeResult fields) is one user attr, ``measurement`` (a dict:
one write instead of thirty), read back flattened into `TrialRecord.user_attrs`; stored values
are JSON-safe (no NaN). Fixed params (a retry, a starting point, a grid configuration) go through
the space's own `suggest` by a trial whose every answer is given (`FixedParams`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import FrozenTrial

from autotune.api.outcome import RESULT_ATTRS
from autotune.api.study.trials import TrialRecord
from autotune.contract.space import Param

# The user attr holding a trial's probe measurement, and the result fields stored in it
MEASUREMENT_ATTR = "measurement"
MEASURED = frozenset((*RESULT_ATTRS, "knobs", "stopped_early", "quality"))


def flatten(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """User attrs as the service reads them: the measurement's fields beside the others."""
    measurement = attrs.get(MEASUREMENT_ATTR)
    if not isinstance(measurement, dict):
        return dict(attrs)
    flat = {k: v for k, v in attrs.items() if k != MEASUREMENT_ATTR}
    for key, value in measurement.items():
        flat.setdefault(key, value)
    return flat


def to_record(trial: FrozenTrial, trial_id: int) -> TrialRecord:
    """The service's view of an Optuna trial (Optuna types do not leave the bridge)."""
    return TrialRecord(trial_id=trial_id, number=trial.number, state=trial.state.name,
                       params=dict(trial.params), values=list(trial.values) if trial.values is not None else None,
                       user_attrs=flatten(trial.user_attrs), datetime_start=trial.datetime_start,
                       datetime_complete=trial.datetime_complete)


def distribution(param: Param) -> BaseDistribution:
    """The Optuna distribution `autotune.contract.space.suggest` draws `param` from."""
    if param.choices is not None:
        return CategoricalDistribution(list(param.choices))
    assert param.low is not None and param.high is not None
    if param.is_int:
        return IntDistribution(int(param.low), int(param.high), step=int(param.step or 1), log=param.log)
    return FloatDistribution(float(param.low), float(param.high), step=param.step, log=param.log)


def json_safe(value: Any) -> Any:
    """`value` with every non-finite float replaced by None (recursively)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


class MissingParam(KeyError):
    """Fixed params that leave out a parameter the space draws."""


class FixedParams:
    """A trial whose every suggestion is given (`autotune.contract.space.suggest` over known params)."""

    def __init__(self, given: Mapping[str, Any]) -> None:
        self._given = dict(given)
        self.params: dict[str, Any] = {}

    def _get(self, name: str) -> Any:
        if name not in self._given:
            raise MissingParam(name)
        self.params[name] = self._given[name]
        return self._given[name]

    def suggest_categorical(self, name: str, choices: Any) -> Any:
        return self._get(name)

    def suggest_int(self, name: str, low: int, high: int, *, step: int = 1, log: bool = False) -> int:
        value: int = self._get(name)
        return value

    def suggest_float(self, name: str, low: float, high: float, *, step: float | None = None,
                      log: bool = False) -> float:
        value: float = self._get(name)
        return value
