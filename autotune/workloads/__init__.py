"""Registry of built-in workloads, looked up by name."""

from __future__ import annotations

from collections.abc import Callable

from autotune.workloads.base import TrainingDefaults, Workload

_BUILTIN: dict[str, str] = {"ups": "autotune.workloads.ups:UPSWorkload"}


class UnknownWorkloadError(ValueError):
    pass


def workload_names() -> list[str]:
    return sorted(_BUILTIN)


def get_workload(name: str, preset: str) -> Workload:
    """Instantiate workload `name` at `preset`; raises UnknownWorkloadError / ValueError with the fix."""
    target = _BUILTIN.get(name)
    if target is None:
        raise UnknownWorkloadError(f"unknown workload {name!r}; installed: {', '.join(workload_names())}")
    module_name, attr = target.split(":")
    import importlib

    factory: Callable[[str], Workload] = getattr(importlib.import_module(module_name), attr)
    return factory(preset)


__all__ = ["TrainingDefaults", "UnknownWorkloadError", "Workload", "get_workload", "workload_names"]
