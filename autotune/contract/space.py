"""Search spaces: which knobs a study searches, over which values, under which rules.

A space is YAML (``search_spaces/<name>.yaml``, or inline in a study spec)::

    name: cpu
    description: knobs that matter on a CPU host
    params:
      batch_size: {choices: [4, 8, 16]}           # categorical
      lr: {low: 1.0e-4, high: 3.0e-3, log: true}   # float range
      num_workers: {low: 0, high: 2}               # int range (ints given → int knob)
      prefetch_factor: {choices: [2, 4], when: {num_workers: [1, 2]}}   # conditional
    fixed:
      pin_memory: false

Every name is a knob of `autotune.contract.config.KNOBS` and every value is checked by it; a
conditional parameter is sampled only when its condition holds (else the knob keeps its
default). `parse_space` rejects a space that can draw a config breaking a cross-knob rule,
`validate_for` adds the hardware rules, `load_space` takes names only, never paths (a spec
comes over the network), and `suggest` draws through Optuna's ``suggest_*`` interface without
importing optuna.
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import yaml

from autotune.contract.config import (
    DISTRIBUTED_KNOBS,
    HARDWARE_KNOBS,
    KNOBS,
    RULE_KNOBS,
    ConfigError,
    check_hardware,
    check_rules,
    parse_config,
)

# The named spaces: $AUTOTUNE_SPACES_DIR, else the repository's search_spaces/ (editable
# installs and checkouts; the Docker image sets the variable).
SPACES_DIR = Path(os.environ.get("AUTOTUNE_SPACES_DIR") or Path(__file__).resolve().parent.parent / "search_spaces")
SPACE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"  # a named space is SPACES_DIR/<name>.yaml, never a path
MAX_CHOICES = 1000  # values of one categorical parameter (Optuna stores them with every trial)
MAX_COMBINATIONS = 100_000  # distinct draws of the rule and condition knobs checked by parse_space


SPACE_ROOT = "space"  # a SpaceError's field for the space as a whole (other fields are paths inside it)


class SpaceError(ValueError):
    """A search space is malformed. `field` is a dotted path to the bad entry inside the space
    (``params.batch_size.choices``), or SPACE_ROOT for the space as a whole."""

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


def _can_take(param: Param, value: Any) -> bool:
    """Whether `param` can be drawn at `value`."""
    if param.choices is not None:
        return value in param.choices
    assert param.low is not None and param.high is not None
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if not param.low <= value <= param.high:
        return False
    return not (param.is_int and param.step is not None and (value - param.low) % param.step != 0)


def _parse_when(where: str, when_raw: Any, params: dict[str, Param]) -> dict[str, tuple[Any, ...]]:
    if not isinstance(when_raw, dict):
        raise SpaceError(f"{where}.when", "expected a mapping knob -> list of values")
    when: dict[str, tuple[Any, ...]] = {}
    for cond_knob, allowed in when_raw.items():
        cond_where = f"{where}.when.{cond_knob}"
        if cond_knob not in params:
            raise SpaceError(cond_where, "a condition must name a searched parameter declared above this one")
        allowed = allowed if isinstance(allowed, list) else [allowed]
        if not allowed:
            raise SpaceError(cond_where, "an empty list of values never holds; list the values that activate it")
        values = tuple(_check_value(cond_knob, v, cond_where) for v in allowed)
        for value in values:
            if not _can_take(params[cond_knob], value):
                raise SpaceError(cond_where, f"{cond_knob} never takes the value {value!r} in this space")
        when[cond_knob] = values
    return when


def _parse_range(knob: str, where: str, spec: dict[str, Any], when: dict[str, tuple[Any, ...]]) -> Param:
    """A low/high parameter: numeric knob, low <= high, log a boolean (then low > 0), step a
    positive number (an integer for an int knob), not both log and step (Optuna's rule)."""
    if KNOBS[knob].type not in (int, float):
        raise SpaceError(where, f"{knob} is not numeric; use choices: [{KNOBS[knob].allowed()}]")
    low = _check_value(knob, spec["low"], f"{where}.low")
    high = _check_value(knob, spec["high"], f"{where}.high")
    if low is None or high is None or low > high:
        raise SpaceError(where, f"need low <= high, got low={low!r} high={high!r}")
    log = spec.get("log", False)
    if not isinstance(log, bool):
        raise SpaceError(f"{where}.log", f"expected true or false, got {log!r}")
    if log and low <= 0:
        raise SpaceError(f"{where}.low", "a log range needs low > 0")
    step = spec.get("step")
    if step is not None:
        if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step) or step <= 0:
            raise SpaceError(f"{where}.step", f"expected a positive number, got {step!r}")
        if KNOBS[knob].type is int:
            if not float(step).is_integer():
                raise SpaceError(f"{where}.step", f"{knob} is an integer knob: the step must be a whole number, "
                                                  f"got {step!r}")
            step = int(step)
        if log:
            raise SpaceError(f"{where}.step", "a log range cannot have a step (Optuna samples log ranges "
                                              "continuously); drop one of log and step")
    return Param(knob, low=low, high=high, log=log, step=step, when=when)


def _parse_param(knob: Any, spec: Any, params: dict[str, Param]) -> Param:
    where = f"params.{knob}"
    if knob not in KNOBS:
        raise SpaceError(where, f"unknown knob; known knobs: {', '.join(KNOBS)}")
    if isinstance(spec, list):
        raise SpaceError(where, f"expected a mapping with 'choices' or 'low'/'high', got a list: write "
                                f"{{choices: {json.dumps(spec)[:200]}}}")
    if not isinstance(spec, dict):
        raise SpaceError(where, f"expected a mapping with 'choices' or 'low'/'high', got {type(spec).__name__}")
    extra = set(spec) - {"choices", "low", "high", "log", "step", "when"}
    if extra:
        raise SpaceError(f"{where}.{sorted(map(str, extra))[0]}", "unknown key; allowed: choices, low, high, log, "
                                                                  "step, when")
    when = _parse_when(where, spec.get("when") or {}, params)
    if "choices" in spec:
        if set(spec) & {"low", "high", "log", "step"}:
            raise SpaceError(where, "give either 'choices' or 'low'/'high', not both")
        choices = spec["choices"]
        if not isinstance(choices, list) or not choices:
            raise SpaceError(f"{where}.choices", "expected a non-empty list")
        if len(choices) > MAX_CHOICES:
            raise SpaceError(f"{where}.choices", f"{len(choices)} values; at most {MAX_CHOICES} (use low/high for "
                                                 "a numeric range)")
        checked = tuple(_check_value(knob, v, f"{where}.choices") for v in choices)
        if len(set(map(repr, checked))) != len(checked):
            raise SpaceError(f"{where}.choices", "duplicate values")
        return Param(knob, choices=checked, when=when)
    if "low" in spec and "high" in spec:
        return _parse_range(knob, where, spec, when)
    raise SpaceError(where, "expected 'choices: [...]' or both 'low' and 'high'")


def parse_space(data: Any, name: str | None = None) -> Space:
    """Validate a space mapping (from YAML or JSON). Raises SpaceError naming the bad field.

    Checks every name against the knobs, every value against its knob, the shape of each
    parameter (choices, or low/high with log/step), the `when` conditions, the fixed values,
    and that no configuration the space can draw breaks a cross-knob rule
    (`_check_drawable_combinations`)."""
    if not isinstance(data, dict):
        raise SpaceError(SPACE_ROOT, f"expected a mapping with 'params', got {type(data).__name__}")
    unknown = sorted(map(str, set(data) - {"name", "description", "params", "fixed"}))
    if unknown:
        knobs = [key for key in unknown if key in KNOBS]
        if knobs:  # `space: {batch_size: ...}`: the knobs one level too high
            raise SpaceError(knobs[0], f"a knob at the space's top level; searched knobs go under 'params' and "
                                       f"fixed ones under 'fixed', e.g. params: {{{knobs[0]}: {{choices: [...]}}}}")
        if "space" in unknown:  # `space: {space: h100}`: a space nested in the space
            raise SpaceError("space", "a space inside the space; write space: NAME (e.g. space: h100) or the "
                                      "space itself as space: {params: {...}, fixed: {...}}")
        raise SpaceError(unknown[0], "unknown key; allowed: name, description, params, fixed")
    for key in ("name", "description"):
        if data.get(key) is not None and not isinstance(data[key], str):
            raise SpaceError(key, f"expected a string, got {type(data[key]).__name__}")
    raw_params = data.get("params") or {}
    if not isinstance(raw_params, dict) or not raw_params:
        raise SpaceError("params", "a space needs at least one searched parameter (a mapping knob -> spec)")
    params: dict[str, Param] = {}
    for knob, spec in raw_params.items():
        params[knob] = _parse_param(knob, spec, params)
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
    _check_drawable_combinations(space)
    return space


def _representatives(param: Param, read_by_conditions: set[Any]) -> list[Any]:
    """The values of `param` that the rules and conditions can tell apart: every choice; for a
    range its ends, 0 when inside it (the rules compare num_workers with 0) and every value a
    `when` condition names that the range can take."""
    if param.choices is not None:
        return list(param.choices)
    assert param.low is not None and param.high is not None
    values = [param.low, param.high, *([0] if param.low <= 0 <= param.high else []),
              *sorted((v for v in read_by_conditions if _can_take(param, v)), key=repr)]
    return list(dict.fromkeys(values))


def _check_drawable_combinations(space: Space) -> None:
    """Every configuration the space can draw must pass the cross-knob rules
    (`autotune.contract.config.check_rules`): a parameter whose values break a rule for some value
    of another needs a `when` condition (e.g. prefetch_factor only when num_workers > 0).

    Walks the parameters in declaration order (the order `suggest` draws them), keeping the
    distinct partial draws of the knobs that matter: the rules' knobs (RULE_KNOBS) and the
    knobs `when` conditions read, each forgotten after its last reader. Raises SpaceError
    naming the parameter (or fixed value) that breaks a rule, with a combination that does."""
    params = list(space.params.values())
    read_by: dict[str, set[Any]] = {}  # knob -> the values conditions on it name
    last_reader: dict[str, int] = {}  # knob -> index of the last parameter whose condition reads it
    for index, p in enumerate(params):
        for knob, allowed in p.when.items():
            read_by.setdefault(knob, set()).update(v for v in allowed if v is not None)
            last_reader[knob] = index
    tracked = set(RULE_KNOBS) | set(read_by)
    states: set[tuple[tuple[str, Any], ...]] = {()}
    for index, p in enumerate(params):
        if p.name not in tracked:
            continue
        values = _representatives(p, read_by.get(p.name, set()))
        if len(states) * len(values) > MAX_COMBINATIONS:
            raise SpaceError("params", f"more than {MAX_COMBINATIONS} combinations of the parameters that rules and "
                                       "'when' conditions read; use fewer values in them")
        drawn: set[tuple[tuple[str, Any], ...]] = set()
        for state in states:
            if _active(p, dict(state)):
                drawn.update((*state, (p.name, v)) for v in values)
            else:
                drawn.add(state)
        keep = {k for k in tracked if k in RULE_KNOBS or last_reader.get(k, -1) > index}
        states = {tuple(item for item in state if item[0] in keep) for state in drawn}
    base = {**{k: v.default for k, v in KNOBS.items()}, **space.fixed}
    for state in sorted(states, key=repr):
        drawn_values = dict(state)
        try:
            check_rules({**base, **drawn_values})
        except ConfigError as e:
            raise SpaceError(*_rule_violation(space, drawn_values, e)) from None


def _rule_violation(space: Space, drawn: dict[str, Any], error: ConfigError) -> tuple[str, str]:
    """(field, message) for a drawable combination that breaks a rule: the message shows the
    other knobs involved (drawn, fixed or at their default) and how to guard the parameter."""
    shown = []
    for knob in RULE_KNOBS:
        if knob == error.knob or (knob not in drawn and knob not in error.message):
            continue
        if knob in drawn:
            shown.append(f"{knob}={drawn[knob]!r}")
        elif knob in space.fixed:
            shown.append(f"{knob}={space.fixed[knob]!r} (fixed)")
        else:
            shown.append(f"{knob}={KNOBS[knob].default!r} (its default)")
    context = f"the space can draw it with {', '.join(shown)}" if shown else "the space can draw it"
    if error.knob in space.params:
        field, hint = f"params.{error.knob}", ""
        names = list(space.params)
        workers = space.params.get("num_workers")
        if workers is not None and error.knob in ("prefetch_factor", "persistent_workers"):
            positive = [str(v) for v in workers.choices or () if v]
            example = f"when: {{num_workers: [{', '.join(positive)}]}}" if positive else \
                "when: {num_workers: [...]} listing the values > 0"
            order = "" if names.index("num_workers") < names.index(error.knob) else \
                f", and declare num_workers above {error.knob}"
            hint = f" (add a condition: {example}{order})"
        elif error.knob in ("prefetch_factor", "persistent_workers"):
            hint = (" (fix num_workers >= 1 under 'fixed', or search num_workers above it and add "
                    "when: {num_workers: [...]} listing the values > 0)")
        return field, f"{context}: {error.message}{hint}"
    return f"fixed.{error.knob}", f"{context}: {error.message}"


def validate_for(space: Space, hardware: str, world_size: int = 1) -> None:
    """Hardware rules: raise SpaceError when the space cannot run on `hardware` with trials of
    `world_size` processes (a study's gpus_per_trial). The distributed knobs
    (`autotune.contract.config.DISTRIBUTED_KNOBS`: bucket_cap_mb, parallel, gradient_as_bucket_view,
    static_graph, no_sync_accumulation, the NCCL variables) may be searched only when
    world_size > 1: at world size 1 they would change nothing but the sampler's data. A fixed
    value is accepted at any world size (a single-process probe records it as inactive), so
    one space file can pin them for the multi-GPU studies that share it."""
    for knob in (k for k in HARDWARE_KNOBS if k in space.params):
        for value in space.params[knob].choices or ():
            try:
                check_hardware({knob: value}, hardware)
            except ConfigError as e:
                raise SpaceError(f"params.{knob}", f"{value}: {e.message} (drop it from the choices)") from None
    try:
        check_hardware(space.fixed, hardware)
    except ConfigError as e:
        raise SpaceError(f"fixed.{e.knob}", e.message) from None
    if world_size <= 1:
        for knob in DISTRIBUTED_KNOBS:
            if knob in space.params:
                raise SpaceError(f"params.{knob}", f"{knob} only matters with world size > 1 (a trial on "
                                                   "several GPUs); remove it, or run the study's trials on "
                                                   "several GPUs (gpus_per_trial >= 2)")


def load_space(name: str) -> Space:
    """The named space: ``SPACES_DIR/<name>.yaml``. Names only (letters, digits, '_', '-'):
    never a path, so a request cannot make the service read another file."""
    if not isinstance(name, str) or not re.fullmatch(SPACE_NAME_PATTERN, name):
        raise SpaceError(SPACE_ROOT, f"{name!r} is not a space name: give a name from search_spaces/ (letters, "
                                     f"digits, '_', '-'; no paths or extensions; known: {', '.join(space_names())}) "
                                     "or an inline mapping")
    path = SPACES_DIR / f"{name}.yaml"
    if not path.is_file():
        raise SpaceError(SPACE_ROOT, f"no search space {name!r}; known: {', '.join(space_names())} "
                                     "(or give an inline mapping)")
    try:
        data = copy.deepcopy(_space_yaml(path.read_text()))
    except yaml.YAMLError as e:
        raise SpaceError(SPACE_ROOT, f"search_spaces/{path.name} is not valid YAML ({e})") from None
    return parse_space(data, name=name)


@functools.lru_cache(maxsize=64)
def _space_yaml(text: str) -> Any:
    """A space file's YAML, parsed once per text (the file is read every time, so an edit is
    seen at once). Each view of a study validates its stored spec, which names its space:
    parsing the file was a third of `GET /v1/studies/NAME`."""
    return yaml.safe_load(text)


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


def params_of(space: Space, config: Mapping[str, Any]) -> dict[str, Any]:
    """The space's params as `config` sets them: each active param whose value the space could
    draw (a config from outside the space, like a user's baseline, keeps only those)."""
    return {p.name: config[p.name] for p in space.params.values()
            if p.name in config and _active(p, dict(config)) and _can_take(p, config[p.name])}
