"""The workload registry: the training jobs autotune can probe, looked up by name.

A study names a workload and a preset (`StudySpec.workload`, `.preset`); a worker's probe
child builds it with `get_workload`. A name resolves through this registry only, never to
a module path taken from a request:

* the built-in workloads (`BUILTIN`): ``ups``;
* workloads other installed packages register under the entry-point group
  ``autotune.workloads`` (``[project.entry-points."autotune.workloads"]
  mine = "my_pkg.workload:MyWorkload"``); their presets are not known until the workload
  is loaded, so only their names are checked before a probe runs.

The service rejects a study naming a workload or preset it does not know (422 naming
``workload`` or ``preset``). That is a convenience, not the security boundary: a worker
runs only the workloads on its allow-list (``autotune worker --allow-workload NAME``,
default: the built-ins) and refuses any other lease without importing anything it names
(see autotune/worker.py).

This module imports neither torch nor any workload module until `get_workload` is called:
the service and the worker read the registry without them.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass

from autotune.workloads.base import TrainingDefaults, Workload

ENTRY_POINT_GROUP = "autotune.workloads"


@dataclass(frozen=True)
class WorkloadEntry:
    """One registered workload: where its factory lives and which presets it has."""

    name: str
    target: str  # "module:attr" of a factory `(preset) -> Workload` (a Workload subclass)
    presets: tuple[str, ...] | None  # None: not known before loading (entry-point workloads)
    builtin: bool


BUILTIN: dict[str, WorkloadEntry] = {
    "ups": WorkloadEntry("ups", "autotune.workloads.ups:UPSWorkload", ("tiny", "full"), builtin=True),
}


class UnknownWorkloadError(ValueError):
    """A workload or preset name that the registry does not have; the message lists the known ones."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field  # "workload" or "preset"


@functools.cache
def registered_workloads() -> dict[str, WorkloadEntry]:
    """Every workload of this Python environment: the built-ins, then the entry points of
    group ``autotune.workloads`` (a built-in name wins). Read once per process (entry points
    are scanned, not loaded); `registered_workloads.cache_clear()` rereads them."""
    entries = dict(BUILTIN)
    for point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if point.name not in entries:
            entries[point.name] = WorkloadEntry(point.name, point.value, None, builtin=False)
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
        raise UnknownWorkloadError("workload", f"unknown workload {name!r}; installed: {', '.join(sorted(entries))} "
                                               f"(other packages add workloads under the entry-point group "
                                               f"{ENTRY_POINT_GROUP!r})")
    if preset is not None and entry.presets is not None and preset not in entry.presets:
        raise UnknownWorkloadError("preset", f"unknown preset {preset!r} for workload {name!r}; "
                                             f"known: {', '.join(entry.presets)}")
    return entry


def _load_factory(entry: WorkloadEntry) -> Callable[[str], Workload]:
    if entry.builtin:
        module_name, attr = entry.target.split(":")
        factory: Callable[[str], Workload] = getattr(importlib.import_module(module_name), attr)
        return factory
    for point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP, name=entry.name):
        loaded: Callable[[str], Workload] = point.load()
        return loaded
    raise UnknownWorkloadError("workload", f"workload {entry.name!r} is no longer installed")


def get_workload(name: str, preset: str) -> Workload:
    """Instantiate workload `name` at `preset` (imports its module); raises UnknownWorkloadError
    / ValueError with the fix."""
    return _load_factory(check_workload(name, preset))(preset)


__all__ = ["BUILTIN", "ENTRY_POINT_GROUP", "TrainingDefaults", "UnknownWorkloadError", "Workload", "WorkloadEntry",
           "builtin_workload_names", "check_workload", "get_workload", "registered_workloads", "workload_names"]
