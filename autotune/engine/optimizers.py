"""The user's optimizer step: several optimizers as one, the optimizer knobs, gradient clipping.

A workload (or a caller of `autotune.apply`) hands over its own optimizer, or several at once (a
Muon + AdamW hybrid: `muon_adamw`). `Optimizers` steps, zeroes and checkpoints them as one, and
the knobs act on those same objects, in place: ``fused_optimizer`` sets the groups' ``fused`` /
``foreach`` flags where the optimizer has them (`apply_fused_optimizer`), ``compile_optimizer``
compiles every optimizer's step with each lr as a device tensor (`compile_optimizer_step`,
`lr_to_tensor`), and `clip_gradients` clips on the device, after fp16's GradScaler unscaled the
gradients. A knob that cannot act is recorded inactive with the reason. Imports torch: only the
probe and `autotune.apply` use it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from autotune.contract.config import TrainConfig
from autotune.contract.errors import ProbeError

Notes = dict[str, str]

MUON_MIN_TORCH = "2.9"  # the first release with torch.optim.Muon


class Optimizers:
    """Several optimizers stepped, zeroed and checkpointed as one (each keeps its own
    parameter groups and state). `param_groups` is the list of every optimizer's groups, the
    same dicts: a schedule that writes ``group["lr"]`` reaches them all."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        if not optimizers:
            raise ValueError("Optimizers needs at least one optimizer")
        for opt in optimizers:
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"expected torch.optim.Optimizer objects, got {type(opt).__name__}")
        self.optimizers = list(optimizers)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    @property
    def state(self) -> dict[Any, Any]:
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    @property
    def name(self) -> str:
        return " + ".join(type(opt).__name__ for opt in self.optimizers)

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        states = state["optimizers"]
        if len(states) != len(self.optimizers):
            raise ValueError(f"a state of {len(states)} optimizers for {len(self.optimizers)}")
        for opt, opt_state in zip(self.optimizers, states, strict=True):
            opt.load_state_dict(opt_state)

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter(self.optimizers)

    def __len__(self) -> int:
        return len(self.optimizers)

    def __repr__(self) -> str:
        return f"Optimizers({self.name})"


OptimizerLike = torch.optim.Optimizer | Optimizers | Sequence[torch.optim.Optimizer]


def as_optimizers(value: Any, model: nn.Module | None = None, where: str = "the optimizer") -> Optimizers:
    """`value` (an optimizer, an `Optimizers`, or a sequence of optimizers) as `Optimizers`.
    With `model`: a parameter stepped by two optimizers is an error (it would be updated twice)
    and a trainable parameter stepped by none is an error too (it would silently not train)."""
    if isinstance(value, Optimizers):
        opts = value
    elif isinstance(value, torch.optim.Optimizer):
        opts = Optimizers([value])
    elif isinstance(value, (list, tuple)) and value and all(isinstance(o, torch.optim.Optimizer) for o in value):
        opts = Optimizers(value)
    else:
        raise TypeError(f"{where}: expected a torch.optim.Optimizer or a list of them, got {type(value).__name__}")
    if model is not None:
        seen: dict[int, str] = {}
        for opt in opts:
            for group in opt.param_groups:
                for p in group["params"]:
                    if id(p) in seen:
                        raise ValueError(f"{where}: a parameter is stepped by both {seen[id(p)]} and "
                                         f"{type(opt).__name__}; give each parameter to one optimizer")
                    seen[id(p)] = type(opt).__name__
        missing = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ValueError(f"{where}: {len(missing)} trainable parameters are in no optimizer ({shown}); "
                             "give every trainable parameter to an optimizer, or set requires_grad=False")
    return opts


def all_params(optimizers: Optimizers) -> list[torch.Tensor]:
    return [p for group in optimizers.param_groups for p in group["params"]]


# -- building -----------------------------------------------------------------------------

def adamw(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over every trainable parameter: what a workload trains with unless it says otherwise."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay)


def muon_available() -> bool:
    return hasattr(torch.optim, "Muon")


def is_muon_matrix(name: str, param: torch.Tensor, module: nn.Module) -> bool:
    """Muon's share of a model: the weight matrix of an nn.Linear layer. Biases, norms,
    embeddings and free parameters (latent queries, positional tables) stay with AdamW."""
    return isinstance(module, nn.Linear) and name == "weight" and param.ndim == 2


def muon_adamw(model: nn.Module, lr: float, weight_decay: float, *, muon_lr: float | None = None,
               momentum: float = 0.95, betas: tuple[float, float] = (0.9, 0.999),
               adjust_lr_fn: str = "match_rms_adamw") -> Optimizers:
    """The hybrid: ``torch.optim.Muon`` for the nn.Linear weight matrices, AdamW for every
    other trainable parameter. ``adjust_lr_fn="match_rms_adamw"`` scales Muon's update to
    AdamW's RMS, so one learning rate serves both (`muon_lr` sets Muon's apart)."""
    if not muon_available():
        raise ProbeError("unsupported", f"the Muon + AdamW optimizer needs torch.optim.Muon (torch >= "
                                        f"{MUON_MIN_TORCH}); installed {torch.__version__}: upgrade torch, or use "
                                        "an AdamW preset")
    matrices: list[nn.Parameter] = []
    rest: list[nn.Parameter] = []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if p.requires_grad:
                (matrices if is_muon_matrix(name, p, module) else rest).append(p)
    if not matrices:
        raise ProbeError("unsupported", "Muon + AdamW: the model has no nn.Linear weight matrices for Muon")
    muon = torch.optim.Muon(matrices, lr=muon_lr if muon_lr is not None else lr, weight_decay=weight_decay,
                            momentum=momentum, adjust_lr_fn=adjust_lr_fn)
    if not rest:
        return Optimizers([muon])
    return Optimizers([muon, torch.optim.AdamW(rest, lr=lr, weight_decay=weight_decay, betas=betas)])


# -- the fused_optimizer knob ---------------------------------------------------------------

def _takes(opt: torch.optim.Optimizer, name: str) -> bool:
    return name in inspect.signature(type(opt).__init__).parameters


def _check_fused(opt: torch.optim.Optimizer, device: torch.device) -> str | None:
    """Why `opt`'s class cannot run fused on `device` (None: it can): built once, on a
    throwaway parameter, with the same hyper-parameters."""
    accepted = inspect.signature(type(opt).__init__).parameters
    defaults = {k: v for k, v in opt.defaults.items() if k in accepted and k not in ("fused", "foreach", "lr")}
    probe_param = torch.zeros(1, device=device, requires_grad=True)
    try:
        cls: Any = type(opt)
        cls([probe_param], lr=0.1, **defaults, fused=True)
    except (RuntimeError, ValueError, TypeError) as e:
        return str(e).splitlines()[0][:200]
    return None


def apply_fused_optimizer(optimizers: Optimizers, config: TrainConfig, device: torch.device, notes: Notes) -> None:
    """Set ``fused`` (``fused_optimizer=true``: one kernel for the whole update) or ``foreach``
    (false: multi-tensor kernels) on every parameter group of each optimizer that has the
    flags, in place. The optimizers must not have stepped. An optimizer without the flags is
    recorded as inactive for this knob, with its name."""
    fused = config.fused_optimizer
    parts = []
    for opt in optimizers:
        name = type(opt).__name__
        has_fused, has_foreach = _takes(opt, "fused"), _takes(opt, "foreach")
        if not (has_fused or has_foreach):
            parts.append(f"{name}: inactive ({name} has no fused or foreach implementation)")
            continue
        if opt.state:
            raise ProbeError("unsupported", f"fused_optimizer: {name} has stepped already; set the knob before "
                                            "the first step")
        fused_here = fused and has_fused
        if fused_here:
            why = _check_fused(opt, device)
            if why is not None:
                raise ProbeError("unsupported", f"fused_optimizer=true: {name} cannot run fused on {device.type} "
                                                f"({why}); set fused_optimizer: false")
        for group in [*opt.param_groups, opt.defaults]:  # defaults: for groups added later
            if has_fused:
                group["fused"] = fused_here
            if has_foreach:
                group["foreach"] = not fused_here
        if fused_here:
            # what the constructor sets for a fused optimizer: GradScaler then hands it the
            # scale and the inf flag instead of unscaling the gradients itself
            opt._step_supports_amp_scaling = True  # type: ignore[attr-defined]
        if fused and not has_fused:
            parts.append(f"{name} foreach (inactive: {name} has no fused implementation)")
        else:
            parts.append(f"{name} {'fused' if fused_here else 'foreach'}")
    notes["fused_optimizer"] = "; ".join(parts)


# -- learning rates as device tensors -------------------------------------------------------

def lr_to_tensor(optimizers: Optimizers, device: torch.device, capturable: bool) -> list[torch.Tensor]:
    """Make each group's learning rate a 0-dim tensor on `device` (kept where it is one
    already), so that a compiled or captured step reads it on the device and a schedule
    writes into it in place. With `capturable`, Adam-family groups (those with a
    ``capturable`` flag) keep their step counters on the device as well (a graph or compiled
    step that read them on the host would freeze them). Returns the tensors, in
    `param_groups` order. Call before the first step."""
    tensors = []
    for group in optimizers.param_groups:
        if capturable and "capturable" in group:
            group["capturable"] = True
        lr = group["lr"]
        if not isinstance(lr, torch.Tensor):
            lr = torch.tensor(float(lr), device=device)
            group["lr"] = lr
        tensors.append(lr)
    return tensors


def set_lr(group: dict[str, Any], value: float) -> None:
    """Set a parameter group's learning rate: in place where it is a tensor (a captured graph
    or a compiled step reads that tensor), else as the float it is."""
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        lr.fill_(value)
    else:
        group["lr"] = value


# -- the compile_optimizer knob ---------------------------------------------------------------

def compile_blocker(config: TrainConfig) -> str | None:
    """Why ``compile_optimizer`` cannot act with these knobs (None: it can)."""
    if config.precision == "fp16":
        return "inactive: fp16's GradScaler decides on the host whether each optimizer steps"
    return None


def compile_optimizer_step(optimizers: Optimizers, config: TrainConfig, device: torch.device, notes: Notes,
                           backend: str = "inductor") -> Callable[[], None] | None:
    """``compile_optimizer=true``: one function that steps every optimizer, compiled with
    torch.compile (learning rates as device tensors first, so a schedule does not recompile
    it). Returns it, or None where the knob is off or inactive (recorded in `notes`)."""
    if not config.compile_optimizer:
        notes["compile_optimizer"] = "off"
        return None
    why = compile_blocker(config)
    if why is not None:
        notes["compile_optimizer"] = why
        return None
    lr_to_tensor(optimizers, device, capturable=True)  # foreach Adam reads a tensor lr only when capturable
    members = list(optimizers)

    def step_all() -> None:
        for opt in members:
            opt.step()

    notes["compile_optimizer"] = f"on: {optimizers.name} step compiled ({backend}); learning rates as device tensors"
    compiled: Callable[[], None] = torch.compile(step_all, backend=backend)
    return compiled


# -- gradient clipping ------------------------------------------------------------------------

def clip_gradients(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale the gradients of `params` so their global L2 norm is at most `max_norm`; returns
    the norm before clipping (a device tensor). No host sync: the scale factor
    min(1, max_norm / norm) is computed and applied on the device, so a CUDA graph captures it."""
    return torch.nn.utils.clip_grad_norm_(params, max_norm)  # foreach kernels where the device has them
