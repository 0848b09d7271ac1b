"""The worker's own boundary, whatever the service sends: which workloads it runs (`refusal`),
and which running studies the service will not offer it, and why (`skipped_studies`).

A lease naming a workload that is not on the worker's allow-list (``--allow-workload``, default:
the built-in workloads) or not installed here is completed at once as failed, kind "refused".
Nothing the lease names is imported: the check reads the registry's names, and only a probe
child of an allowed, installed workload imports its module. An ``--allow-workload
NAME=module:attr`` entry allows NAME and defines it for this worker's children (the operator's
import path, never the service's)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from autotune.contract.registry import ENTRY_POINT_GROUP, registered_workloads


def refusal(workload: str, allowed: tuple[str, ...]) -> str | None:
    """Why this worker will not run a trial of `workload`, or None when it will: the workload
    must be on the allow-list and installed here. Reads registry names only (imports nothing
    the lease names): a study must not make a worker run code its operator did not allow."""
    if workload not in allowed:
        return (f"workload {workload!r} is not allowed on this worker (allowed: {', '.join(allowed) or 'none'}); "
                f"start the worker with --allow-workload {workload} to run it")
    installed = registered_workloads()
    if workload not in installed:
        return (f"workload {workload!r} is allowed but not installed on this worker (installed: "
                f"{', '.join(sorted(installed))}); install the package that registers it under the entry-point "
                f"group {ENTRY_POINT_GROUP!r} on this host, or name its code: --allow-workload "
                f"{workload}=module.path:attr")
    return None


# --- running studies this worker cannot take ------------------------------------------------------


@dataclass(frozen=True)
class SkippedStudy:
    """A running study whose trials the service does not offer this worker, and why (with the fix)."""

    name: str
    hardware: str
    reason: str


def _hardware_reason(study_hardware: str, hardware_class: str) -> str:
    if study_hardware == "cpu":
        return (f"a CPU study, and this worker's hardware class is {hardware_class!r}: CPU studies go to workers "
                f"started with --device cpu (a spec without `hardware` is a CPU study; submit it with "
                f"hardware: {hardware_class} to run it on this GPU)")
    if hardware_class == "cpu":
        return ("a GPU study, and this worker runs on the cpu: start a worker with --device cuda on a host with "
                "that GPU (its hardware class must be the study's `hardware` exactly)")
    return (f"this worker's GPU is {hardware_class!r}: a worker takes only the studies whose `hardware` is its "
            "GPU's name exactly; start one on that GPU, or submit a study with this GPU's name")


def skipped_studies(studies: Any, hardware_class: str, allowed: tuple[str, ...], gpus_per_trial: int,
                    study: str | None = None) -> list[SkippedStudy]:
    """The running studies of a GET /v1/studies reply (`studies`: its ``data``, read as plain
    JSON, so a spec naming a space or workload unknown here is still read) that the service
    will not offer a worker of `hardware_class`, allow-list `allowed` and `gpus_per_trial`
    (only `study` when the worker is pinned to one), each with why and the fix."""
    skipped: list[SkippedStudy] = []
    for info in studies if isinstance(studies, list) else ():
        if not isinstance(info, dict) or info.get("state") != "running" or not isinstance(info.get("spec"), dict):
            continue
        name, spec = str(info.get("name")), info["spec"]
        if study is not None and name != study:
            continue
        hardware = str(spec.get("hardware", "cpu"))
        workload = str(spec.get("workload", "ups"))
        world = spec.get("gpus_per_trial", 1)
        if hardware != hardware_class:
            reason = _hardware_reason(hardware, hardware_class)
        elif workload not in allowed:
            reason = (f"workload {workload!r} is not on this worker's allow-list ({', '.join(allowed) or 'none'}): "
                      f"start the worker with --allow-workload {workload}")
        elif world != gpus_per_trial:
            reason = (f"each trial runs on {world} GPU(s) (gpus_per_trial) and this worker's on {gpus_per_trial}: "
                      f"start a worker with --gpus-per-trial {world}")
        else:
            continue
        skipped.append(SkippedStudy(name, hardware, reason))
    return skipped


class SkipNotice:
    """What a worker process last said about the running studies it cannot take: each distinct
    set is said once, however often the idle loops poll (shared by the lease loops of one
    worker, which see the same studies)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._shown: frozenset[str] | None = None

    def fresh(self, skipped: list[SkippedStudy]) -> bool:
        """True when `skipped` is non-empty and not the set last said (which it now becomes)."""
        key = frozenset(s.name for s in skipped)
        with self._lock:
            if not key or key == self._shown:
                return False
            self._shown = key
            return True

