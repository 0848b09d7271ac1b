"""autotune: find the fastest PyTorch training configuration that keeps model quality.

``autotune.apply(config, model, optimizer=..., train_loader=..., loss_fn=...)`` applies a
recommended config to your own training loop, and ``autotune.load_config("best.yaml")``
reads one (autotune/engine/apply.py). ``autotune.tune(spec)`` tunes a study on this machine and
returns its verdict (autotune/cli/local.py, `autotune tune`), and ``autotune.Client(url, token=...)``
talks to a running service (submit, status, best, stop). They are imported on first use:
``import autotune`` does not import torch (the service and the worker read the package
without it).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    import importlib

    if name in ("Client", "ApiError"):  # a running service from Python (submit, status, best, stop)
        return getattr(importlib.import_module("autotune.worker.client"), name)
    if name in ("tune", "TuneError"):  # tunes on this machine: service, workers, verdict (autotune tune)
        return getattr(importlib.import_module("autotune.cli.local"), name)
    if name in ("apply", "load_config", "Prepared", "ApplyError"):
        module = importlib.import_module("autotune.engine.apply")  # callable: autotune.apply(...) is apply(...)
        return module if name == "apply" else getattr(module, name)
    raise AttributeError(f"module 'autotune' has no attribute {name!r}")
