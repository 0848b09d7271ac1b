"""The built-in workloads (``ups``, ``gpt``), and the names a plugin's workload is written
against: ``from autotune.workloads import Workload, TrainingDefaults`` (defined in
autotune/contract/workload.py; the registry is autotune/contract/registry.py)."""

from autotune.contract.workload import TrainingDefaults, Workload

__all__ = ["TrainingDefaults", "Workload"]
