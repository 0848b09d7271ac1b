"""Starting points: the first search trials of a study, before the sampler draws its own.

A sampler starts blind, and in a space of half a million configs a short study may never land
on the few that matter, while the knobs' effects on a GPU are known. So a GPU study with a
model-based sampler (tpe, nsga2, gp) starts from the *fast stack* derived from its baseline and
space (`auto_points`):

1. the baseline with compile default and the whole step as one CUDA graph (``step_graph``),
   bf16 (else tf32), fused AdamW, ``compile_optimizer``, cudnn benchmark, no activation
   checkpointing, persistent DataLoader workers, accumulation folded into the micro-batch
   (the effective batch kept; where the space cannot draw it, the largest one below it: at
   the same samples a smaller batch takes more optimizer steps, a larger one fewer, and the
   gate rejects what ends worse) and the inverse loss every 4th step;
2. the same with compile reduce-overhead instead of the step graph;
3. that with the baseline's inverse-loss frequency, in case skipping it costs quality;
4. the first with no CUDA graph at all, in case graphs break this model.

Each point takes only values the space can draw, must pass the knob rules, and is dropped when
it repeats an earlier point or the baseline; the gate judges them like any trial.
`StudySpec.starting_points`: "auto" (the above; nothing for CPU studies or the random and grid
samplers), "none", or the user's own partial configs (`check_points`).

A warm start (`StudySpec.warm_start`) puts earlier studies' certified picks and front configs
before those points (`warm_points`): each projected onto this study's space (the values it can
draw), measured again like any trial (an earlier study's numbers are never reused: another
torch, GPU or model would make them wrong).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from autotune.contract.config import ConfigError, parse_config
from autotune.contract.space import Space, SpaceError, _active, _can_take

MAX_POINTS = 20
MODEL_BASED_SAMPLERS = ("tpe", "nsga2", "gp")
# knob → preferred values, first one the space can draw wins
FAST_STACK: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("precision", ("bf16", "tf32")),
    ("fused_optimizer", (True,)),
    ("compile_optimizer", (True,)),
    ("cudnn_benchmark", (True,)),
    ("checkpoint", ("none",)),
    ("persistent_workers", (True,)),  # only where the baseline has workers (the knob's condition)
)
AUX_EVERY = 4  # the research's tier-3 inverse-loss frequency


def _drawable(space: Space, wanted: Mapping[str, Any]) -> dict[str, Any]:
    """The values of `wanted` the space can draw, for the parameters active under them (in
    declaration order: conditions refer to earlier parameters). The rest is the sampler's."""
    values: dict[str, Any] = {}
    for p in space.params.values():
        if p.name in wanted and _active(p, values) and _can_take(p, wanted[p.name]):
            values[p.name] = wanted[p.name]
    return values


def _prefer(space: Space, point: dict[str, Any], knob: str, preferred: Sequence[Any]) -> None:
    param = space.params.get(knob)
    if param is not None:
        for value in preferred:
            if _can_take(param, value):
                point[knob] = value
                return


def _fold_accumulation(space: Space, point: dict[str, Any], baseline: Mapping[str, Any]) -> None:
    """batch × accum → the largest micro-batch the space has with the same product; where no
    pair of the space's values makes that product, the pair with the largest product below it
    (the least accumulation first). A 16 × 2 baseline in a space of micro-batches 12, 24, 48, …
    thus starts at 24 × 1: on a GPU every starting point of such a study once drew its batch
    at random, 48 to 384, and failed the gate (bench/README.md, language-model knobs)."""
    batch, accum = baseline.get("batch_size"), baseline.get("accum_steps", 1)
    if not isinstance(batch, int) or not isinstance(accum, int) or "batch_size" not in space.params:
        return
    effective = batch * accum
    accum_param = space.params.get("accum_steps")
    candidates = [accum]
    if accum_param is not None and accum_param.choices is not None:
        candidates = sorted(accum_param.values())
    batch_param = space.params["batch_size"]
    pairs = [(effective // a, a) for a in candidates if effective % a == 0 and _can_take(batch_param, effective // a)]
    if not pairs and batch_param.choices is not None:
        below = [(b * a, -a, b) for a in candidates for b in batch_param.values()
                 if isinstance(b, int) and b * a <= effective]
        if below:
            _, neg_accum, micro = max(below)
            pairs = [(micro, -neg_accum)]
    if pairs:
        point["batch_size"], a = pairs[0]
        if accum_param is not None:
            point["accum_steps"] = a


def auto_points(space: Space, baseline: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The fast stack (module docstring) for `baseline`, the baseline's effective config (as its
    probe reported it: the preset's batch and accumulation included)."""
    fast = dict(baseline)
    for knob, preferred in FAST_STACK:
        _prefer(space, fast, knob, preferred)
    _fold_accumulation(space, fast, baseline)
    graphs = {**fast, "compile": "reduce-overhead"}
    aux = {**graphs, "inverse_loss_frequency": AUX_EVERY}
    # first, the whole step as one CUDA graph (autotune/engine/step_graph.py) where the space has it:
    # a step bound by per-parameter host work then keeps the GPU busy (bench/README.md, step
    # graph; the user's optimizer step); last, no CUDA graph at all, in case graphs break the model
    step_graph = {**aux, "compile": "default", "step_graph": True}
    return _usable(space, [step_graph, aux, graphs, {**aux, "compile": "default", "step_graph": False}], baseline)


def _usable(space: Space, candidates: Sequence[Mapping[str, Any]], baseline: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Drawable parts of `candidates` that pass the knob rules, without repeats of each other or
    of the baseline."""
    return [point for point, _ in _usable_tagged(space, [(c, None) for c in candidates], baseline)]


def _usable_tagged(space: Space, candidates: Sequence[tuple[Mapping[str, Any], Any]],
                   baseline: Mapping[str, Any]) -> list[tuple[dict[str, Any], Any]]:
    """`_usable` for (candidate, tag) pairs: each point kept with its tag."""
    seen = [_drawable(space, baseline)]
    points = []
    for wanted, tag in candidates:
        point = _drawable(space, wanted)
        if not point or point in seen:  # empty: nothing to start from, the sampler's own draw
            continue
        try:
            parse_config({**space.fixed, **point})
        except ConfigError:
            continue
        seen.append(point)
        points.append((point, tag))
    return points


def warm_points(space: Space, baseline: Mapping[str, Any],
                sources: Sequence[tuple[str, Sequence[Mapping[str, Any]]]]) -> list[tuple[dict[str, Any], str]]:
    """The warm start's points, in order: each source study's configs (its certified pick first,
    then its front) as the values this space can draw, with the study each came from. A point
    is dropped when nothing of it can be drawn, it is the baseline, it repeats an earlier point,
    or it breaks the knob rules; at most MAX_POINTS."""
    tagged = [(config, study) for study, configs in sources for config in configs]
    return _usable_tagged(space, tagged, baseline)[:MAX_POINTS]


def check_points(space: Space, points: Any) -> list[dict[str, Any]]:
    """A user's starting points: a list of at most MAX_POINTS mappings of the space's parameters
    to values it can draw. Raises SpaceError naming the entry and the fix."""
    if not isinstance(points, list):
        raise SpaceError("starting_points", 'expected "auto", "none" or a list of partial configs')
    if len(points) > MAX_POINTS:
        raise SpaceError("starting_points", f"{len(points)} points; at most {MAX_POINTS}")
    for i, point in enumerate(points):
        where = f"starting_points[{i}]"
        if not isinstance(point, dict) or not point:
            raise SpaceError(where, "expected a non-empty mapping knob -> value")
        for knob, value in point.items():
            param = space.params.get(knob)
            if param is None:
                known = ", ".join(space.params) or "none"
                raise SpaceError(f"{where}.{knob}", f"not a parameter of the space {space.name!r} (its parameters: "
                                                    f"{known}); a fixed knob is already in every trial")
            if not _can_take(param, value):
                allowed = (f"one of {list(param.choices)}" if param.choices is not None
                           else f"a value in [{param.low:g}, {param.high:g}]")
                raise SpaceError(f"{where}.{knob}", f"{value!r} cannot be drawn from this space: use {allowed}")
        try:
            parse_config({**space.fixed, **point})
        except ConfigError as e:
            raise SpaceError(f"{where}.{e.knob}", e.message) from None
    return [dict(p) for p in points]


def resolve(setting: str | list[dict[str, Any]], space: Space, baseline: Mapping[str, Any], hardware: str,
            sampler: str) -> list[dict[str, Any]]:
    """The study's starting points (see the module docstring) once its baseline has run."""
    if setting == "none":
        return []
    if setting == "auto":
        if hardware == "cpu" or sampler not in MODEL_BASED_SAMPLERS:
            return []
        return auto_points(space, baseline)
    return check_points(space, setting)
