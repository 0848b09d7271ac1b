"""Search spaces: which knobs a study searches, over which values, under which rules.

A space is YAML (files in `search_spaces/`, or inline in a study spec)::

    name: cpu
    description: knobs that matter on a CPU host
    params:
      batch_size: {choices: [4, 8, 16]}           # categorical
      lr: {low: 1.0e-4, high: 3.0e-3, log: true}   # float range
      num_workers: {low: 0, high: 2}               # int range (ints given → int knob)
      prefetch_factor: {choices: [2, 4], when: {num_workers: [1, 2]}}   # conditional
    fixed:
      pin_memory: false

Every name is a knob of `autotune.config.KNOBS`; every value is checked by that knob; a
conditional parameter (`when`) is sampled only when its condition holds, otherwise the
knob keeps its default, which is how "prefetch only with workers > 0" is expressed.
`validate_for(space, hardware, world_size)` adds the hardware rules (fp8 needs a GPU of
compute capability >= 8.9, bucket_cap_mb only with world size > 1).

`suggest(space, trial)` draws a configuration through any object with Optuna's
``suggest_categorical/suggest_int/suggest_float`` (this module does not import optuna).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import yaml

from autotune.config import KNOBS, ConfigError, check_rules, parse_config

# The named spaces: $AUTOTUNE_SPACES_DIR, else the repository's search_spaces/ (editable
# installs and checkouts; the Docker image sets the variable).
SPACES_DIR = Path(os.environ.get("AUTOTUNE_SPACES_DIR") or Path(__file__).resolve().parent.parent / "search_spaces")


class SpaceError(ValueError):
    """A search space is malformed. `field` is a dotted path to the bad entry."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Param:
    name: str
    choices: tuple[Any, ...] | None = None
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    when: dict[str, tuple[Any, ...]] = field(default_factory=dict)

    @property
    def is_int(self) -> bool:
        return KNOBS[self.name].type is int

    def values(self) -> list[Any]:
        """Every value this parameter can take (ranges: only for int ranges)."""
        if self.choices is not None:
            return list(self.choices)
        if self.is_int and self.low is not None and self.high is not None:
            step = int(self.step or 1)
            return list(range(int(self.low), int(self.high) + 1, step))
        raise SpaceError(f"params.{self.name}", "a float range has no finite list of values (grid needs choices)")


@dataclass(frozen=True)
class Space:
    name: str
    params: dict[str, Param]
    fixed: dict[str, Any]
    description: str = ""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "description": self.description, "params": {}, "fixed": self.fixed}
        for p in self.params.values():
            d: dict[str, Any] = {}
            if p.choices is not None:
                d["choices"] = list(p.choices)
            else:
                d.update(low=p.low, high=p.high)
                if p.log:
                    d["log"] = True
                if p.step is not None:
                    d["step"] = p.step
            if p.when:
                d["when"] = {k: list(v) for k, v in p.when.items()}
            out["params"][p.name] = d
        return out

    def grid(self) -> list[dict[str, Any]]:
        """Every configuration of the space (for the grid sampler and small spaces)."""
        names = list(self.params)
        configs, seen = [], set()
        for combo in itertools.product(*(self.params[n].values() for n in names)):
            values = dict(zip(names, combo, strict=True))
            active = {n: v for n, v in values.items() if _active(self.params[n], values)}
            key = tuple(sorted(active.items()))
            if key not in seen:
                seen.add(key)
                configs.append(active)
        return configs


class TrialLike(Protocol):
    def suggest_categorical(self, name: str, choices: Any) -> Any: ...
    def suggest_int(self, name: str, low: int, high: int, *, step: int = 1, log: bool = False) -> int: ...
    def suggest_float(self, name: str, low: float, high: float, *, step: float | None = None,
                      log: bool = False) -> float: ...


def _active(param: Param, values: dict[str, Any]) -> bool:
    return all(values.get(k) in allowed for k, allowed in param.when.items())


def _check_value(knob: str, value: Any, where: str) -> Any:
    try:
        return KNOBS[knob].check(value)
    except ConfigError as e:
        raise SpaceError(where, e.message) from None


def parse_space(data: Any, name: str | None = None) -> Space:
    """Validate a space mapping (from YAML or JSON). Raises SpaceError naming the bad field."""
    if not isinstance(data, dict):
        raise SpaceError("space", f"expected a mapping with 'params', got {type(data).__name__}")
    unknown = set(data) - {"name", "description", "params", "fixed"}
    if unknown:
        raise SpaceError(f"space.{sorted(unknown)[0]}", "unknown key; allowed: name, description, params, fixed")
    raw_params = data.get("params") or {}
    if not isinstance(raw_params, dict) or not raw_params:
        raise SpaceError("params", "a space needs at least one searched parameter (a mapping knob -> spec)")
    params: dict[str, Param] = {}
    for knob, spec in raw_params.items():
        where = f"params.{knob}"
        if knob not in KNOBS:
            raise SpaceError(where, f"unknown knob; known knobs: {', '.join(KNOBS)}")
        if not isinstance(spec, dict):
            raise SpaceError(where, "expected a mapping with 'choices' or 'low'/'high'")
        extra = set(spec) - {"choices", "low", "high", "log", "step", "when"}
        if extra:
            raise SpaceError(f"{where}.{sorted(extra)[0]}", "unknown key; allowed: choices, low, high, log, step, when")
        when_raw = spec.get("when") or {}
        if not isinstance(when_raw, dict):
            raise SpaceError(f"{where}.when", "expected a mapping knob -> list of values")
        when: dict[str, tuple[Any, ...]] = {}
        for cond_knob, allowed in when_raw.items():
            if cond_knob not in params:
                raise SpaceError(f"{where}.when.{cond_knob}", "a condition must name a searched parameter "
                                                               "declared above this one")
            allowed = allowed if isinstance(allowed, list) else [allowed]
            when[cond_knob] = tuple(_check_value(cond_knob, v, f"{where}.when.{cond_knob}") for v in allowed)
        if "choices" in spec:
            if set(spec) & {"low", "high", "log", "step"}:
                raise SpaceError(where, "give either 'choices' or 'low'/'high', not both")
            choices = spec["choices"]
            if not isinstance(choices, list) or not choices:
                raise SpaceError(f"{where}.choices", "expected a non-empty list")
            checked = tuple(_check_value(knob, v, f"{where}.choices") for v in choices)
            if len(set(map(repr, checked))) != len(checked):
                raise SpaceError(f"{where}.choices", "duplicate values")
            params[knob] = Param(knob, choices=checked, when=when)
        elif "low" in spec and "high" in spec:
            if KNOBS[knob].type not in (int, float):
                raise SpaceError(where, f"{knob} is not numeric; use choices: [{KNOBS[knob].allowed()}]")
            low = _check_value(knob, spec["low"], f"{where}.low")
            high = _check_value(knob, spec["high"], f"{where}.high")
            if low is None or high is None or low > high:
                raise SpaceError(where, f"need low <= high, got low={low!r} high={high!r}")
            log = bool(spec.get("log", False))
            if log and low <= 0:
                raise SpaceError(f"{where}.low", "a log range needs low > 0")
            params[knob] = Param(knob, low=low, high=high, log=log, step=spec.get("step"), when=when)
        else:
            raise SpaceError(where, "expected 'choices: [...]' or both 'low' and 'high'")
    fixed_raw = data.get("fixed") or {}
    if not isinstance(fixed_raw, dict):
        raise SpaceError("fixed", "expected a mapping knob -> value")
    fixed: dict[str, Any] = {}
    for knob, value in fixed_raw.items():
        if knob not in KNOBS:
            raise SpaceError(f"fixed.{knob}", f"unknown knob; known knobs: {', '.join(KNOBS)}")
        if knob in params:
            raise SpaceError(f"fixed.{knob}", "is also a searched parameter; keep one")
        fixed[knob] = _check_value(knob, value, f"fixed.{knob}")
    space = Space(name=str(data.get("name") or name or "inline"), params=params, fixed=fixed,
                  description=str(data.get("description") or ""))
    _check_every_combination_rules(space)
    return space


def _check_every_combination_rules(space: Space) -> None:
    """Each cross-knob rule must hold for every value a parameter can take while active."""
    defaults = {k: v.default for k, v in KNOBS.items()}
    for p in space.params.values():
        if p.choices is None:
            continue
        for value in p.choices:
            # the parameter is active: its conditions hold, other knobs at fixed/default values
            probe = {**defaults, **space.fixed, **{k: v[0] for k, v in p.when.items()}, p.name: value}
            try:
                check_rules(probe)
            except ConfigError as e:
                hint = " (add a 'when' condition, e.g. when: {num_workers: [1, 2]})" if e.knob == p.name else ""
                raise SpaceError(f"params.{p.name}", f"value {value!r} breaks a rule: {e.message}{hint}") from None


def validate_for(space: Space, hardware: str, world_size: int = 1) -> None:
    """Hardware rules: raise SpaceError when the space cannot run on `hardware`."""
    precisions = set(space.params["precision"].choices or ()) if "precision" in space.params else set()
    if space.fixed.get("precision"):
        precisions.add(space.fixed["precision"])
    if "fp8" in precisions and hardware == "cpu":
        raise SpaceError("params.precision", "fp8 needs a CUDA GPU with compute capability >= 8.9; "
                                              "this study's hardware is cpu: drop fp8")
    if world_size <= 1 and "bucket_cap_mb" in space.params:
        raise SpaceError("params.bucket_cap_mb", "DDP bucket size only matters with world size > 1; "
                                                  "remove it or run trials on several GPUs")


def load_space(name_or_path: str) -> Space:
    """A space by name (a file in search_spaces/) or by path to a YAML file."""
    path = Path(name_or_path)
    if not path.suffix:
        path = SPACES_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in SPACES_DIR.glob("*.yaml"))
        raise SpaceError("space", f"no search space {name_or_path!r}; known: {', '.join(known)} "
                                  "(or give a path to a YAML file, or an inline mapping)")
    return parse_space(yaml.safe_load(path.read_text()), name=path.stem)


def space_names() -> list[str]:
    return sorted(p.stem for p in SPACES_DIR.glob("*.yaml"))


def suggest(space: Space, trial: TrialLike) -> dict[str, Any]:
    """Draw one configuration: the fixed knobs plus every active parameter, validated."""
    values: dict[str, Any] = {}
    for p in space.params.values():  # declaration order: conditions refer to earlier params
        if not _active(p, values):
            continue
        if p.choices is not None:
            values[p.name] = trial.suggest_categorical(p.name, list(p.choices))
        elif p.is_int:
            assert p.low is not None and p.high is not None
            values[p.name] = trial.suggest_int(p.name, int(p.low), int(p.high), step=int(p.step or 1), log=p.log)
        else:
            assert p.low is not None and p.high is not None
            values[p.name] = trial.suggest_float(p.name, float(p.low), float(p.high), step=p.step, log=p.log)
    config = {**space.fixed, **values}
    parse_config(config)  # every drawn config must pass the knob rules
    return config
