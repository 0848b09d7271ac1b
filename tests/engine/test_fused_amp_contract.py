"""The fused_optimizer knob flips the user's optimizer between fused and foreach in place
(autotune/engine/optimizers.py `apply_fused_optimizer`), and with the group flags what the
optimizer's constructor sets beside them: GradScaler's ``_step_supports_amp_scaling`` (a fused
step takes the scale and the inf flag, a foreach step must not), SGD's and Adagrad's
``_need_device_dtype_check_for_fused``, and Adagrad's step counters, made at construction.

Real torch, no mocks: fp16 autocast, ``torch.amp.GradScaler("cpu")`` and fused AdamW / SGD /
Adagrad all run on the CPU in this torch, so the CPU tests take the real GradScaler path; the
GPU test repeats it on CUDA, where fused Adagrad keeps its step counters on the device."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from autotune.contract.config import TrainConfig
from autotune.engine.apply import ApplyError, apply
from autotune.engine.optimizers import Optimizers, apply_fused_optimizer

CPU = torch.device("cpu")
FUSED_CLASSES = [torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, torch.optim.Adagrad]


def linear_model(device: torch.device = CPU) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).to(device)


def mse(model: nn.Module, batch: Any, with_aux: bool) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x).float(), y)


def batches(n: int, device: torch.device = CPU) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=generator).to(device), torch.randn(4, 1, generator=generator).to(device))
            for _ in range(n)]


def scaled_steps(model: nn.Module, opt: torch.optim.Optimizer, data: list[Any], device: torch.device) -> None:
    """The plain fp16 loop: autocast, GradScaler, one optimizer step per batch."""
    scaler = torch.amp.GradScaler(device.type)
    for batch in data:
        with torch.autocast(device.type, dtype=torch.float16):
            loss = mse(model, batch, False)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)


def own_flags(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The plain attributes on the optimizer itself (what a constructor sets outside the groups)."""
    return {k: v for k, v in vars(opt).items()
            if isinstance(v, (bool, int, float, str, type(None))) and not k.startswith("_autotune")}


def step_counters(opt: torch.optim.Optimizer) -> list[tuple[torch.dtype, str]]:
    return [(s["step"].dtype, s["step"].device.type) for s in opt.state.values() if "step" in s]


@pytest.mark.parametrize("fused_before", [True, False], ids=["fused-to-foreach", "foreach-to-fused"])
def test_fp16_apply_steps_the_users_optimizer_through_gradscaler_like_one_built_that_way(fused_before: bool) -> None:
    """The issue: AdamW(fused=True) + {fused_optimizer: false, precision: fp16} kept the AMP
    flag, and GradScaler handed the foreach step its scale ("Expected grad_scale and found_inf
    to be None"). Both ways, the flipped optimizer now trains as one built with the knob's flag."""
    model = linear_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=fused_before)
    prepared = apply({"fused_optimizer": not fused_before, "precision": "fp16", "batch_size": 4}, model,
                     optimizer=opt, loss_fn=mse, quiet=True)
    assert prepared.notes["fused_optimizer"] == f"AdamW {'foreach' if fused_before else 'fused'}"
    data = batches(3)
    for batch in data:
        assert prepared.step(batch) is not None
    assert getattr(opt, "_step_supports_amp_scaling", False) is (not fused_before)
    reference = linear_model()
    built = torch.optim.AdamW(reference.parameters(), lr=0.01, fused=not fused_before,
                              foreach=fused_before)
    scaled_steps(reference, built, data, CPU)
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs)


@pytest.mark.parametrize("cls", FUSED_CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("fused_before", [True, False], ids=["fused-to-foreach", "foreach-to-fused"])
def test_the_flip_leaves_what_the_constructor_would_have_built(cls: Any, fused_before: bool) -> None:
    """Every class torch builds fused: its own flags and its fresh state (Adagrad's step
    counters) after the flip equal a fresh optimizer built with the other flag, and a real fp16
    GradScaler step runs on it (Adagrad, whose constructor makes state, is no longer refused as
    'stepped')."""
    model = linear_model()
    opt = cls(model.parameters(), lr=0.01, fused=fused_before)
    notes: dict[str, str] = {}
    apply_fused_optimizer(Optimizers([opt]), TrainConfig(fused_optimizer=not fused_before), CPU, notes)
    fresh = cls(linear_model().parameters(), lr=0.01, fused=not fused_before, foreach=fused_before)
    assert own_flags(opt) == own_flags(fresh)
    assert step_counters(opt) == step_counters(fresh)
    assert all(g["fused"] is (not fused_before) and g["foreach"] is fused_before for g in opt.param_groups)
    before = [p.detach().clone() for p in model.parameters()]
    scaled_steps(model, opt, batches(2), CPU)
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_a_fused_step_handed_an_inf_by_gradscaler_skips_the_update() -> None:
    """foreach → fused: GradScaler now hands the fused kernel its inf flag (the contract is
    read, not only set): an inf gradient leaves the parameters as they were."""
    model = linear_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=True)
    apply_fused_optimizer(Optimizers([opt]), TrainConfig(fused_optimizer=True), CPU, {})
    scaler = torch.amp.GradScaler("cpu")
    with torch.autocast("cpu", dtype=torch.float16):
        loss = mse(model, batches(1)[0], False)
    scaler.scale(loss).backward()
    first = next(model.parameters())
    assert first.grad is not None
    first.grad[0, 0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert "grad_scale" not in vars(opt)  # GradScaler passed them as attributes and took them back


@pytest.mark.parametrize("fused_knob", [True, False], ids=["knob-fused", "knob-foreach"])
def test_a_checkpoint_with_the_other_flags_keeps_the_contract(fused_knob: bool) -> None:
    """load_state_dict takes the checkpoint's group flags: the contract follows them, so the
    fp16 loop keeps stepping (a foreach checkpoint loaded under fused_optimizer=true used to
    keep GradScaler's scale going to a foreach step)."""
    model = linear_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    apply_fused_optimizer(Optimizers([opt]), TrainConfig(fused_optimizer=fused_knob), CPU, {})
    saved_model = linear_model()
    saved_as = torch.optim.AdamW(saved_model.parameters(), lr=0.01, fused=not fused_knob, foreach=fused_knob)
    scaled_steps(saved_model, saved_as, batches(1), CPU)
    opt.load_state_dict(saved_as.state_dict())
    assert opt.param_groups[0]["fused"] is (not fused_knob)
    assert getattr(opt, "_step_supports_amp_scaling", False) is (not fused_knob)
    scaled_steps(model, opt, batches(2), CPU)


def test_applying_the_knob_again_keeps_one_load_hook() -> None:
    opt = torch.optim.AdamW(linear_model().parameters(), lr=0.01)
    for fused in (True, False, True):
        apply_fused_optimizer(Optimizers([opt]), TrainConfig(fused_optimizer=fused), CPU, {})
    assert len(opt._optimizer_load_state_dict_post_hooks) == 1


def test_a_stepped_adagrad_is_still_refused_naming_the_knob() -> None:
    model = linear_model()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.01)
    mse(model, batches(1)[0], False).backward()
    opt.step()
    with pytest.raises(ApplyError, match="Adagrad has stepped already") as info:
        apply({"fused_optimizer": True}, model, optimizer=opt, loss_fn=mse, quiet=True)
    assert info.value.knob == "fused_optimizer"


@pytest.mark.gpu
@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adagrad], ids=lambda c: c.__name__)
@pytest.mark.parametrize("fused_before", [True, False], ids=["fused-to-foreach", "foreach-to-fused"])
def test_fp16_on_cuda_trains_the_flipped_optimizer_like_one_built_that_way(cls: Any, fused_before: bool) -> None:
    """On CUDA, through apply: GradScaler's contract and Adagrad's step counters (made on the
    host for foreach) follow the flip, and the steps match an optimizer built with the knob's
    flag. torch's fused Adagrad runs on the CPU only, which its constructor does not check
    (its first step does): apply refuses it, naming the knob."""
    cuda = torch.device("cuda")
    model = linear_model(cuda)
    opt = cls(model.parameters(), lr=0.01, fused=fused_before)
    knobs = {"fused_optimizer": not fused_before, "precision": "fp16", "batch_size": 4}
    if cls is torch.optim.Adagrad and not fused_before:
        with pytest.raises(ApplyError, match="Adagrad cannot run fused on cuda") as info:
            apply(knobs, model, optimizer=opt, loss_fn=mse, device=cuda, quiet=True)
        assert info.value.knob == "fused_optimizer"
        return
    apply(knobs, model, optimizer=opt, loss_fn=mse, device=cuda, quiet=True)
    reference = linear_model(cuda)
    built = cls(reference.parameters(), lr=0.01, fused=not fused_before, foreach=fused_before)
    assert own_flags(opt) == own_flags(built) and step_counters(opt) == step_counters(built)
    data = batches(3, cuda)
    scaled_steps(model, opt, data, cuda)
    scaled_steps(reference, built, data, cuda)
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs)
