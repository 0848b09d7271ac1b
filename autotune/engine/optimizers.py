"""The user's optimizer step: several optimizers as one, the optimizer knobs, gradient clipping.

A workload (or a caller of `autotune.apply`) hands over its own optimizer, or several at once (a
Muon + AdamW hybrid: `muon_adamw`). `Optimizers` steps, zeroes and checkpoints them as one, and
the knobs act on those same objects, in place: ``fused_optimizer`` sets the groups' ``fused`` /
``foreach`` flags where the optimizer has them, and with them what the optimizer's constructor
sets for that choice, GradScaler's AMP contract included (`apply_fused_optimizer`,
`FusedContract`), ``compile_optimizer``
compiles every optimizer's step with each lr as a device tensor (`compile_optimizer_step`,
`lr_to_tensor`), and `clip_gradients` clips on the device, after fp16's GradScaler unscaled the
gradients. A knob that cannot act is recorded inactive with the reason. Imports torch: only the
probe and `autotune.apply` use it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
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


def _built_like(opt: torch.optim.Optimizer, device: torch.device, fused: bool) -> torch.optim.Optimizer:
    """An optimizer of `opt`'s class over one throwaway parameter on `device`, with the same
    hyper-parameters, built ``fused`` (else ``foreach``): what its constructor makes of that
    choice. Raises what the constructor raises."""
    accepted = inspect.signature(type(opt).__init__).parameters
    kwargs = {k: v for k, v in opt.defaults.items() if k in accepted and k not in ("fused", "foreach", "lr")}
    if "fused" in accepted:
        kwargs["fused"] = fused
    if "foreach" in accepted:
        kwargs["foreach"] = not fused
    cls: Any = type(opt)
    built: torch.optim.Optimizer = cls([torch.zeros(1, device=device, requires_grad=True)], lr=0.1, **kwargs)
    return built


@dataclass(frozen=True)
class ConstructorChoice:
    """What an optimizer's constructor sets outside its parameter groups for one choice of
    fused / foreach: `flags`, the plain attributes on the optimizer itself, and `step`, the
    dtype of a fresh state's step counter and whether it lives on the parameter's device (else
    on the host); None where the constructor makes no state."""

    flags: dict[str, Any]
    step: tuple[torch.dtype, bool] | None

    @classmethod
    def of(cls, built: torch.optim.Optimizer) -> ConstructorChoice:
        flags = {k: v for k, v in vars(built).items() if isinstance(v, (bool, int, float, str, type(None)))}
        param = built.param_groups[0]["params"][0]
        step = built.state[param].get("step") if param in built.state else None
        return cls(flags, (step.dtype, step.device == param.device) if isinstance(step, torch.Tensor) else None)


_ABSENT = object()


@dataclass(frozen=True)
class FusedContract:
    """What `opt`'s class sets beside the ``fused`` / ``foreach`` group flags, for each choice,
    so that a knob that flips the flags in place can flip the rest with them. torch's
    constructors with fused=True (torch/optim/adam.py, adamw.py, sgd.py, adagrad.py) set
    ``_step_supports_amp_scaling`` (GradScaler then hands the step its scale and inf flag instead
    of unscaling the gradients itself; a foreach step handed them fails "Expected grad_scale and
    found_inf to be None"), SGD and Adagrad ``_need_device_dtype_check_for_fused`` (the first
    fused step checks the parameters), and Adagrad makes its step counters at construction:
    float32 on the parameter's device for fused, on the host for foreach. Read off throwaway
    optimizers of the same class (`of`), so another class's own flags follow too."""

    fused: ConstructorChoice | None  # None: the class cannot be built fused on this device
    foreach: ConstructorChoice

    def keep(self, opt: torch.optim.Optimizer) -> None:
        """Set `opt`'s own flags, and its fresh step counters, as its constructor would have for
        its groups' flags: fused where every group is fused, else foreach (GradScaler scales an
        optimizer as one: with a foreach group it must unscale the gradients itself)."""
        fused = self.fused is not None and all(group.get("fused") for group in opt.param_groups)
        chosen, other = (self.fused, self.foreach) if fused else (self.foreach, self.fused or self.foreach)
        assert chosen is not None
        for name in chosen.flags.keys() | other.flags.keys():
            if chosen.flags.get(name, _ABSENT) == other.flags.get(name, _ABSENT):
                continue  # not the choice's: whatever the optimizer holds stays
            if name in chosen.flags:
                setattr(opt, name, chosen.flags[name])
            else:
                opt.__dict__.pop(name, None)
        if chosen.step is None:
            return
        dtype, on_param_device = chosen.step
        for group in opt.param_groups:
            for p in group["params"]:
                step = opt.state[p].get("step") if p in opt.state else None
                if isinstance(step, torch.Tensor) and not step.requires_grad and float(step) == 0.0:
                    opt.state[p]["step"] = torch.zeros((), dtype=dtype, device=p.device if on_param_device else "cpu")


def _has_stepped(opt: torch.optim.Optimizer) -> bool:
    """Whether `opt` holds state from a step (or a loaded checkpoint): any state beyond the
    zero step counters some constructors make (Adagrad: with its accumulators at their start)."""
    for state in opt.state.values():
        step = state.get("step")
        if step is None or float(step) != 0.0:
            return True
    return False


def apply_fused_optimizer(optimizers: Optimizers, config: TrainConfig, device: torch.device, notes: Notes) -> None:
    """Set ``fused`` (``fused_optimizer=true``: one kernel for the whole update) or ``foreach``
    (false: multi-tensor kernels) on every parameter group of each optimizer that has the
    flags, in place, and with them what the optimizer's constructor sets for that choice (its
    `FusedContract`: e.g. GradScaler's ``_step_supports_amp_scaling``, on for fused, off for
    foreach); a later ``load_state_dict`` whose groups bring other flags keeps the contract
    too. The optimizers must not have stepped. An optimizer without the flags is recorded as
    inactive for this knob, with its name."""
    fused = config.fused_optimizer
    parts = []
    for opt in optimizers:
        name = type(opt).__name__
        has_fused, has_foreach = _takes(opt, "fused"), _takes(opt, "foreach")
        if not (has_fused or has_foreach):
            parts.append(f"{name}: inactive ({name} has no fused or foreach implementation)")
            continue
        if _has_stepped(opt):
            raise ProbeError("unsupported", f"fused_optimizer: {name} has stepped already; set the knob before "
                                            "the first step")
        fused_here = fused and has_fused
        contract = _fused_contract(opt, device, fused_here)
        for group in [*opt.param_groups, opt.defaults]:  # defaults: for groups added later
            if has_fused:
                group["fused"] = fused_here
            if has_foreach:
                group["foreach"] = not fused_here
        contract.keep(opt)
        _keep_after_loading(opt, contract)
        if fused and not has_fused:
            parts.append(f"{name} foreach (inactive: {name} has no fused implementation)")
        else:
            parts.append(f"{name} {'fused' if fused_here else 'foreach'}")
    notes["fused_optimizer"] = "; ".join(parts)


def _fused_contract(opt: torch.optim.Optimizer, device: torch.device, fused: bool) -> FusedContract:
    """`opt`'s `FusedContract` on `device`; with `fused`, refused (naming the knob) where its
    class cannot run fused there."""
    name = type(opt).__name__
    fused_choice = None
    if _takes(opt, "fused"):
        try:
            fused_built = _built_like(opt, device, fused=True)
            fused_choice = ConstructorChoice.of(fused_built)  # before the step below changes its flags
            _step_once(fused_built)
        except (RuntimeError, ValueError, TypeError) as e:
            if fused:
                why = str(e).splitlines()[0][:200]
                raise ProbeError("unsupported", f"fused_optimizer=true: {name} cannot run fused on {device.type} "
                                                f"({why}); set fused_optimizer: false") from None
    try:
        foreach_choice = ConstructorChoice.of(_built_like(opt, device, fused=False))
    except (RuntimeError, ValueError, TypeError) as e:
        why = str(e).splitlines()[0][:200]
        raise ProbeError("unsupported", f"fused_optimizer=false: {name} cannot run foreach on {device.type} "
                                        f"({why}); set fused_optimizer: true") from None
    return FusedContract(fused_choice, foreach_choice)


def _step_once(built: torch.optim.Optimizer) -> None:
    """One step of a throwaway optimizer, on zero gradients: some classes check whether their
    fused kernel runs on the device only at the first step (torch's fused Adagrad: CPU only)."""
    for group in built.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    built.step()


_CONTRACT_HOOK = "_autotune_fused_contract_hook"  # the handle of the hook below, on the optimizer


def _keep_after_loading(opt: torch.optim.Optimizer, contract: FusedContract) -> None:
    """Keep `contract` after ``opt.load_state_dict``, which takes the checkpoint's group flags
    (a checkpoint saved foreach, loaded into the fused optimizer of a ``fused_optimizer=true``
    config, would otherwise keep GradScaler's scale going to a foreach step). One hook per
    optimizer: applying again replaces it."""
    old = getattr(opt, _CONTRACT_HOOK, None)
    if old is not None:
        old.remove()
    handle = opt.register_load_state_dict_post_hook(contract.keep)
    setattr(opt, _CONTRACT_HOOK, handle)


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
