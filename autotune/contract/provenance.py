"""Where a recommendation's numbers come from: the fingerprints that say what was measured (the
model's parameter names and shapes, the study's search space) and the comparison of the runs
behind a verdict (`mixed_runs`: a pick and a baseline measured under different torch versions
or GPUs make a mixed study).

No torch here (tests/test_imports.py): the probe hands `model_fingerprint` the parameters'
names and shapes (autotune/engine/probe.py), the service hands `space_fingerprint` the study's
parsed space, and a later check can recompute either from the same inputs and compare.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from autotune.contract.space import Space

FINGERPRINT_HEX = 16  # hex digits kept of the sha256 (64 bits: a label, not a security boundary)

# The environment one run was measured in: its ProbeResult fields (user attrs on the service),
# in the order best.yaml names them. A verdict's runs that disagree on one of these make a
# mixed study (`mixed_runs`); None (an older worker, a CPU without CUDA) agrees with anything.
RUN_FIELDS = ("torch_version", "cuda_version", "driver_version", "device", "gpu_count", "model_fingerprint")


def digest(value: Any) -> str:
    """A short stable hash of a JSON-able value: sha256 of its canonical JSON (keys sorted, no
    spaces), the first FINGERPRINT_HEX hex digits."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()[:FINGERPRINT_HEX]


def model_fingerprint(parameters: Iterable[tuple[str, Sequence[int]]]) -> str:
    """The fingerprint of a model from its parameters' (name, shape), in registration order
    (`[(n, tuple(p.shape)) for n, p in model.named_parameters()]`): the same architecture and
    sizes give the same fingerprint whatever the weights, dtype or device; a renamed, added or
    resized layer gives another."""
    return digest([[str(name), [int(d) for d in shape]] for name, shape in parameters])


def normalized_space(space: Space) -> dict[str, Any]:
    """What a search space searches, normalized: its params (ranges and choices as parsed, their
    conditions) and fixed knobs, sorted by name; its name and description are left out (a named
    space and the same space inline are one space)."""
    spec = space.to_dict()
    params = {name: spec["params"][name] for name in sorted(spec["params"])}
    return {"params": params, "fixed": {k: spec["fixed"][k] for k in sorted(spec["fixed"])}}


def space_fingerprint(space: Space) -> str:
    """The fingerprint of a study's search space (`normalized_space`)."""
    return digest(normalized_space(space))


def mixed_runs(runs: Sequence[tuple[str, int, Mapping[str, Any]]]) -> list[str]:
    """What the runs behind a verdict disagree on, one line per field of RUN_FIELDS: `runs` are
    (role, trial number, the run's measurement), e.g. ("baseline", 0, user_attrs). Empty: every
    run that recorded a field recorded the same value."""
    lines = []
    for name in RUN_FIELDS:
        seen: dict[str, dict[str, list[int]]] = {}  # value -> role -> trial numbers
        for role, number, attrs in runs:
            value = attrs.get(name)
            if value is not None:
                seen.setdefault(str(value), {}).setdefault(role, []).append(number)
        if len(seen) > 1:
            lines.append(f"{name} differs: " + "; ".join(
                f"{value!r} ({', '.join(_trials(role, numbers) for role, numbers in roles.items())})"
                for value, roles in seen.items()))
    return lines


def _trials(role: str, numbers: list[int]) -> str:
    return f"{role} trial{'s' if len(numbers) > 1 else ''} {', '.join(map(str, sorted(numbers)))}"
