"""The workload registry: the training jobs autotune can probe, looked up by name, never by a
module path taken from a request.

Names come from the built-ins (`BUILTIN`: ``ups``, ``gpt``), from installed packages' entry
points (group ``autotune.workloads``; their presets are known only once loaded), and from
``AUTOTUNE_WORKLOADS`` (``NAME=module:attr``, or a bare ``NAME`` that only makes the name known
to the service): the worker sets it from its ``--allow-workload`` options, so its probe children
resolve the same names. The service's 422 for an unknown workload or preset is a convenience;
the security boundary is the worker's allow-list, which refuses any other lease without
importing what it names. Nothing is imported (no torch, no workload module) until
`get_workload` is called: the service and the worker read the registry without them.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

from autotune.contract.workload import TrainingDefaults, Workload

ENTRY_POINT_GROUP = "autotune.workloads"
ENV_VAR = "AUTOTUNE_WORKLOADS"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # protocol.NAME_PATTERN (a slug)
_TARGET = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")  # module.path:attr


@dataclass(frozen=True)
class WorkloadEntry:
    """One registered workload: where its factory lives and which presets it has."""

    name: str
    target: str  # "module:attr" of a factory `(preset) -> Workload` (a Workload subclass)
    presets: tuple[str, ...] | None  # None: not known before loading (entry-point workloads)
    builtin: bool
    quality_metric: str | None = None  # None: not known before loading (the first probe result names it)
    quality_direction: str | None = None  # "minimize" | "maximize"; None: not known before loading
    source: str = "builtin"  # builtin | entry_point | environment (AUTOTUNE_WORKLOADS)


BUILTIN: dict[str, WorkloadEntry] = {
    "ups": WorkloadEntry("ups", "autotune.workloads.ups:UPSWorkload", ("tiny", "full", "tiny-muon", "full-muon"),
                         builtin=True,
                         quality_metric="val_nrmse", quality_direction="minimize"),
    "gpt": WorkloadEntry("gpt", "autotune.workloads.gpt:GPTWorkload", ("tiny", "full", "medium"), builtin=True,
                         quality_metric="val_loss", quality_direction="minimize"),
}


def parse_workload_option(value: str) -> tuple[str, str]:
    """``NAME=module:attr`` (or a bare ``NAME``: target "") → (name, target); ValueError with the fix."""
    name, _, target = value.partition("=")
    name, target = name.strip(), target.strip()
    if not _NAME.match(name):
        raise ValueError(f"workload name {name!r} is not a slug (letters, digits, '_', '-', '.'): "
                         "write NAME=module.path:attr, e.g. my-wl=my_pkg.workload:MyWorkload")
    if target and not _TARGET.match(target):
        raise ValueError(f"workload target {target!r} of {name!r} is not an import path module.path:attr, "
                         "e.g. my_pkg.workload:MyWorkload")
    return name, target


def workload_paths(options: tuple[str, ...] | list[str]) -> dict[str, str]:
    """NAME → module:attr of the ``NAME=module:attr`` entries of a worker's --allow-workload
    options (plain names are skipped); ValueError with the fix for a malformed entry, including
    a bare ``module:attr`` (a study names a workload by a slug, so the operator names it)."""
    paths: dict[str, str] = {}
    for option in options:
        if "=" not in option:
            if ":" in option:
                raise ValueError(f"--allow-workload {option}: name the workload, as studies will: "
                                 f"--allow-workload NAME={option} (NAME: the study's `workload`)")
            continue
        name, target = parse_workload_option(option)
        if not target:
            raise ValueError(f"--allow-workload {option}: give an import path after '=': NAME=module.path:attr")
        paths[name] = target
    return paths


def export_workload_paths(paths: dict[str, str]) -> None:
    """Add NAME=module:attr workloads to AUTOTUNE_WORKLOADS of this process (its probe children
    inherit it) and reread the registry. Imports nothing."""
    if not paths:
        return
    current = environment_workloads()
    current_text = {name: f"{name}={e.target}" if e.target else name for name, e in current.items()}
    current_text.update({name: f"{name}={target}" for name, target in paths.items()})
    os.environ[ENV_VAR] = ",".join(current_text.values())
    registered_workloads.cache_clear()


def environment_workloads(value: str | None = None) -> dict[str, WorkloadEntry]:
    """The workloads named in AUTOTUNE_WORKLOADS (or `value`): ``NAME=module:attr`` or ``NAME``
    entries, comma-separated. Nothing is imported."""
    text = os.environ.get(ENV_VAR, "") if value is None else value
    entries: dict[str, WorkloadEntry] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, target = parse_workload_option(item)
        entries[name] = WorkloadEntry(name, target, None, builtin=False, source="environment")
    return entries


class UnknownWorkloadError(ValueError):
    """A workload or preset name that the registry does not have; the message lists the known ones."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field  # "workload" or "preset"


@functools.cache
def registered_workloads() -> dict[str, WorkloadEntry]:
    """Every workload of this Python environment: the built-ins, then the entry points of
    group ``autotune.workloads``, then AUTOTUNE_WORKLOADS (an earlier source's name wins).
    Read once per process (entry points are scanned, not loaded);
    `registered_workloads.cache_clear()` rereads them."""
    entries = dict(BUILTIN)
    for point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if point.name not in entries:
            entries[point.name] = WorkloadEntry(point.name, point.value, None, builtin=False, source="entry_point")
    for name, entry in environment_workloads().items():
        entries.setdefault(name, entry)
    return entries


def workload_names() -> list[str]:
    """The names of every registered workload (built-in and installed), sorted."""
    return sorted(registered_workloads())


def builtin_workload_names() -> list[str]:
    return sorted(BUILTIN)


def check_workload(name: str, preset: str | None = None) -> WorkloadEntry:
    """The registry entry of `name`; raises UnknownWorkloadError when the workload is not
    registered, or when `preset` is given and the workload's known presets lack it."""
    entries = registered_workloads()
    entry = entries.get(name)
    if entry is None:
        raise UnknownWorkloadError("workload", f"unknown workload {name!r}; installed: {', '.join(entries)} "
                                               f"(other packages add workloads under the entry-point group "
                                               f"{ENTRY_POINT_GROUP!r}; a worker's --allow-workload "
                                               f"NAME=module:attr and the environment variable {ENV_VAR}=NAME "
                                               f"name others)")
    if preset is not None and entry.presets is not None and preset not in entry.presets:
        raise UnknownWorkloadError("preset", f"unknown preset {preset!r} for workload {name!r}; "
                                             f"known: {', '.join(entry.presets)}")
    return entry


def _load_factory(entry: WorkloadEntry) -> Callable[[str], Workload]:
    if entry.builtin:
        module_name, attr = entry.target.split(":")
        factory: Callable[[str], Workload] = getattr(importlib.import_module(module_name), attr)
        return factory
    if entry.source == "environment":
        if not entry.target:
            raise UnknownWorkloadError("workload", f"workload {entry.name!r} is only a name here ({ENV_VAR}); "
                                                   f"give its import path: {ENV_VAR}={entry.name}=module.path:attr "
                                                   f"(a worker: --allow-workload {entry.name}=module.path:attr)")
        module_name, attr = entry.target.split(":")
        target: Callable[[str], Workload] = getattr(importlib.import_module(module_name), attr)
        return target
    for point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP, name=entry.name):
        loaded: Callable[[str], Workload] = point.load()
        return loaded
    raise UnknownWorkloadError("workload", f"workload {entry.name!r} is no longer installed")


def get_workload(name: str, preset: str) -> Workload:
    """Instantiate workload `name` at `preset` (imports its module); raises UnknownWorkloadError
    / ValueError with the fix."""
    return _load_factory(check_workload(name, preset))(preset)


__all__ = ["BUILTIN", "ENTRY_POINT_GROUP", "ENV_VAR", "TrainingDefaults", "UnknownWorkloadError", "Workload",
           "WorkloadEntry", "builtin_workload_names", "check_workload", "environment_workloads",
           "export_workload_paths", "get_workload", "parse_workload_option", "registered_workloads",
           "workload_names", "workload_paths"]
