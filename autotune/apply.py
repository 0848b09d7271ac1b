"""Apply a tuned config to your own training loop: ``autotune.apply``.

A study recommends a config (``autotune best STUDY --format yaml > best.yaml``). `apply`
puts it on *your* objects, through the same knob functions the probe uses
(autotune/knobs.py), in the same order, so your loop runs what was measured::

    import autotune

    prepared = autotune.apply("best.yaml", model, optimizer=optimizer, train_loader=loader,
                              device="cuda", loss_fn=lambda model, batch, with_aux: ...)
    for batch in prepared.train_loader:
        loss = prepared.step(batch)          # None until accum_steps micro-batches are in

What each knob does to your objects:

* precision: TF32 switches (fp32/tf32), autocast dtype (bf16, fp16 + GradScaler), fp8
  (torchao Float8Linear, CUDA only) — `step` runs the forward under `prepared.autocast()`;
* checkpoint: sets ``checkpoint`` on every module that has that attribute (your blocks decide
  what it means, as the workloads' blocks do: see autotune/workloads/ups/model.py `Block`);
  ``none`` for a model without such blocks;
* compile: ``prepared.model`` is the torch.compile'd module (``prepared.module`` the plain
  one, whose state_dict has clean keys);
* fused_optimizer: your optimizer is rebuilt with ``fused=True`` (or ``foreach=True``) on the
  same parameter groups and hyper-parameters (it must not have stepped yet); without an
  optimizer, AdamW is built (lr from the config or `lr`);
* batch_size, num_workers, prefetch_factor, pin_memory, persistent_workers: your DataLoader is
  rebuilt on the same dataset, sampler (shuffling), collate_fn and drop_last;
* accum_steps, inverse_loss_frequency: `step` accumulates gradients over accum_steps
  micro-batches (each loss scaled by 1/accum_steps) and passes ``with_aux`` to your loss
  function on one optimizer step in inverse_loss_frequency (your expensive optional loss term
  runs only then);
* step_graph (CUDA, one process): after two eager runs of each step kind, `step` replays the
  whole step (your loss function's forward and backward, the optimizer) as one CUDA graph.
  Your loss function must then be capturable (no host synchronisation such as ``.item()``)
  and every micro-batch the same shape (``drop_last=True``); the optimizer's lr becomes a
  device tensor, which torch's LR schedulers write into in place (autotune/step_graph.py).

Knobs that act only across several processes (bucket_cap_mb, parallel, ...) are recorded as
inactive; `prepared.notes` says what every knob did.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from autotune.config import ConfigError, TrainConfig, load_config_arg, parse_config
from autotune.knobs import (
    Notes,
    ProbeError,
    Schedule,
    Trainer,
    apply_backend_flags,
    apply_checkpointing,
    apply_compile,
    apply_fp8,
    build_optimizer,
    loader_options,
)

LossFn = Callable[[nn.Module, Any, bool], torch.Tensor]


class ApplyError(ConfigError):
    """A config that cannot be applied to these objects: `knob` names the knob, the message the fix."""


def load_config(source: str | Path | Mapping[str, Any] | TrainConfig) -> TrainConfig:
    """A validated TrainConfig from a YAML/JSON file (``autotune best --format yaml`` writes
    one; its comment header is ignored), inline JSON, a mapping, or a TrainConfig."""
    if isinstance(source, TrainConfig):
        return source
    if isinstance(source, Mapping):
        return parse_config(source)
    text = str(source)
    if not text.strip().startswith("{") and not Path(text).is_file():
        raise ConfigError("config", f"{text!r} is not a file: write one with "
                                    "`autotune best STUDY --format yaml > best.yaml`")
    return parse_config(load_config_arg(text))


@contextlib.contextmanager
def _as_apply_error(knob: str) -> Iterator[None]:
    """The knob functions raise the probe's ProbeError (a failure kind); here it is the user's
    config that does not fit their objects: ApplyError naming `knob`."""
    try:
        yield
    except ProbeError as e:
        raise ApplyError(knob, e.message) from None


def _default_loss(model: nn.Module, batch: Any, with_aux: bool) -> torch.Tensor:
    """The workload protocol: ``model(batch, with_aux)["total"]``."""
    return model(batch, with_aux)["total"]  # type: ignore[no-any-return]


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """`batch` (tensors in dicts, tuples and lists) on `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device, non_blocking) for v in batch)
    return batch


def rebuild_loader(loader: DataLoader, config: TrainConfig, device: torch.device, notes: Notes) -> DataLoader:
    """`loader` again with the config's batch size and data-pipeline knobs (`loader_options`),
    keeping its dataset, sampler, collate_fn, drop_last, worker_init_fn and generator."""
    if loader.batch_size is None:
        raise ApplyError("batch_size", "the DataLoader has a custom batch_sampler; pass one built with "
                         "batch_size=... (and sampler=... for custom ordering) so autotune can rebuild it")
    assert config.batch_size is not None
    return DataLoader(loader.dataset, batch_size=config.batch_size, sampler=loader.sampler,
                      collate_fn=loader.collate_fn, drop_last=loader.drop_last,
                      worker_init_fn=loader.worker_init_fn, generator=loader.generator,
                      **loader_options(config, device, notes))


def rebuild_optimizer(optimizer: torch.optim.Optimizer, fused: bool, notes: Notes) -> torch.optim.Optimizer:
    """The same optimizer class on the same parameter groups and hyper-parameters, with
    ``fused=True`` (one kernel) or ``foreach=True``. The optimizer must not have stepped."""
    if optimizer.state:
        raise ApplyError("fused_optimizer", "the optimizer has state already; apply the config before training")
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted and k not in ("fused", "foreach")}
    groups = [{k: v for k, v in g.items() if k not in ("fused", "foreach")} for g in optimizer.param_groups]
    try:
        kind: dict[str, Any] = {"fused": True} if fused else {"foreach": True}
        rebuilt = type(optimizer)(groups, **defaults, **kind)
    except (TypeError, RuntimeError) as e:
        raise ApplyError("fused_optimizer", f"{str(fused).lower()}: {type(optimizer).__name__} cannot be built "
                                            f"that way ({e}); use Adam, AdamW or SGD, or set fused_optimizer: "
                                            "false") from None
    notes["fused_optimizer"] = f"{type(optimizer).__name__} {'fused' if fused else 'foreach'}"
    return rebuilt


@dataclass
class Prepared:
    """Your objects with the config applied (see the module docstring)."""

    config: TrainConfig
    device: torch.device
    model: nn.Module  # what to call in the loop (compiled when asked)
    module: nn.Module  # the plain module (checkpointing/fp8 applied, not compiled): save its state_dict
    optimizer: torch.optim.Optimizer
    trainer: Trainer
    train_loader: DataLoader | None = None
    notes: Notes = field(default_factory=dict)
    _pending: list[Any] = field(default_factory=list)

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        return self.trainer.scaler

    @property
    def accum_steps(self) -> int:
        assert self.config.accum_steps is not None
        return self.config.accum_steps

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The config's autocast context (a no-op for fp32/tf32)."""
        return self.trainer.autocast()

    @property
    def with_aux(self) -> bool:
        """Whether the current optimizer step runs the expensive optional loss term."""
        return self.trainer.with_inverse()

    @property
    def optimizer_steps(self) -> int:
        return self.trainer.step_index

    def step(self, batch: Any) -> torch.Tensor | None:
        """Add one micro-batch (moved to the device); once accum_steps are in, run forward and
        backward on each (under autocast, GradScaler for fp16, loss / accum_steps) and one
        optimizer step. Returns that step's mean loss (detached), else None."""
        self._pending.append(to_device(batch, self.device, non_blocking=self.device.type == "cuda"))
        if len(self._pending) < self.accum_steps:
            return None
        batches, self._pending = self._pending, []
        return self.trainer.step(batches)


def apply(config: str | Path | Mapping[str, Any] | TrainConfig, model: nn.Module, *,
          optimizer: torch.optim.Optimizer | None = None, train_loader: DataLoader | None = None,
          loss_fn: LossFn | None = None, device: str | torch.device = "cpu", lr: float | None = None,
          weight_decay: float = 0.0, total_samples: int | None = None, warmup_fraction: float = 0.05,
          final_lr_fraction: float = 0.1) -> Prepared:
    """Apply `config` to your model, optimizer and DataLoader, in the probe's knob order.

    `loss_fn(model, batch, with_aux) -> scalar loss`; default: ``model(batch, with_aux)["total"]``
    (the workload protocol). batch_size / accum_steps / lr that the config leaves unset keep
    your loader's batch size, 1, and your optimizer's lr (or `lr`); an lr in the config replaces
    the lr of every parameter group. `total_samples`: follow
    autotune's LR schedule (warm-up, then cosine to `final_lr_fraction`) over that many samples,
    as the probe did; None keeps the learning rate constant (drive your own scheduler on
    `prepared.optimizer`). Raises ConfigError / ApplyError naming the knob and the fix.
    """
    cfg = load_config(config)
    dev = torch.device(device)
    base_lr = lr if lr is not None else (optimizer.param_groups[0]["lr"] if optimizer is not None else None)
    batch = train_loader.batch_size if train_loader is not None and train_loader.batch_size else 1
    if cfg.lr is None and base_lr is None:
        raise ApplyError("lr", "the config has no lr and there is no optimizer to take it from; pass lr=...")
    cfg = cfg.resolve(batch, 1, float(cfg.lr if cfg.lr is not None else base_lr))  # type: ignore[arg-type]
    notes: Notes = {}
    apply_backend_flags(cfg, dev, notes)  # 1
    with _as_apply_error("checkpoint"):  # 2
        if cfg.checkpoint != "none":
            apply_checkpointing(model, cfg.checkpoint, notes)
    model.to(dev)  # 3
    with _as_apply_error("precision"):  # 4
        model = apply_fp8(model, cfg, dev, notes)
    plain = model
    compiled = apply_compile(model, cfg.compile, notes)  # 5
    notes["bucket_cap_mb"] = "inactive: one process"  # 6 (DDP: not applied by autotune.apply)
    if optimizer is None:  # 7
        opt: torch.optim.Optimizer = build_optimizer(plain, cfg, weight_decay, notes)
    else:
        opt = rebuild_optimizer(optimizer, cfg.fused_optimizer, notes)
        if cfg.lr is not None and cfg.lr != base_lr:
            for group in opt.param_groups:
                group["lr"] = cfg.lr
    loader = rebuild_loader(train_loader, cfg, dev, notes) if train_loader is not None else None  # 8
    schedule = Schedule(total_samples, warmup_fraction, final_lr_fraction) if total_samples else None
    trainer = Trainer(compiled, opt, cfg, dev, notes, schedule=schedule)  # 9
    trainer.loss_fn = loss_fn or _default_loss
    return Prepared(config=cfg, device=dev, model=compiled, module=plain, optimizer=opt, trainer=trainer,
                    train_loader=loader, notes=notes)


class _CallableModule(types.ModuleType):
    """`autotune.apply(...)` calls `apply` (this module is also importable as autotune.apply)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Prepared:
        return apply(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["ApplyError", "LossFn", "Prepared", "apply", "load_config", "rebuild_loader", "rebuild_optimizer",
           "to_device"]
