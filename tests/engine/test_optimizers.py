"""The user's optimizer step (autotune/engine/optimizers.py, the Trainer, the probe): several optimizers
stepped as one, the optimizer knobs acting on the user's objects in place, gradient clipping,
and a workload's own optimizer, clipping and LR schedule in the probe."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from helpers import CPU, micro_batches, resolved
from torch import nn

from autotune.contract.config import TrainConfig
from autotune.contract.errors import ProbeError
from autotune.contract.registry import Workload, get_workload
from autotune.contract.workload import TrainingDefaults
from autotune.engine.knobs import Schedule, Trainer, build_optimizer
from autotune.engine.optimizers import (
    Optimizers,
    apply_fused_optimizer,
    as_optimizers,
    compile_optimizer_step,
    muon_adamw,
)
from autotune.engine.probe import ProbeSettings, run_probe
from autotune.workloads.ups import UPSWorkload


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.LayerNorm(12), nn.ReLU(), nn.Linear(12, 3))


def test_the_hybrid_gives_muon_the_linear_weights_and_adamw_the_rest() -> None:
    model = small_model()
    opts = muon_adamw(model, lr=1e-2, weight_decay=0.03)
    muon, adamw = opts.optimizers
    assert type(muon) is torch.optim.Muon and type(adamw) is torch.optim.AdamW
    assert [p.shape for p in muon.param_groups[0]["params"]] == [(12, 6), (3, 12)]
    assert sorted(tuple(p.shape) for p in adamw.param_groups[0]["params"]) == [(3,), (12,), (12,), (12,)]
    assert len(opts.param_groups) == 2 and opts.name == "Muon + AdamW"
    # one parameter per optimizer, every trainable parameter in one: checked
    as_optimizers(opts, model)


def test_a_parameter_in_two_optimizers_or_in_none_is_refused() -> None:
    model = small_model()
    params = list(model.parameters())
    with pytest.raises(ValueError, match="stepped by both SGD and AdamW"):
        as_optimizers([torch.optim.SGD(params, lr=0.1), torch.optim.AdamW(params[:1])], model)
    with pytest.raises(ValueError, match=r"2 trainable parameters are in no optimizer \(3.weight, 3.bias\)"):
        as_optimizers(torch.optim.SGD(params[:-2], lr=0.1), model)
    with pytest.raises(TypeError, match=r"expected a torch\.optim\.Optimizer"):
        as_optimizers("adam")


def test_fused_optimizer_sets_the_flags_in_place_and_names_muon_inactive() -> None:
    model = small_model()
    opts = muon_adamw(model, lr=1e-2, weight_decay=0.0)
    muon, adamw = opts.optimizers
    notes: dict[str, str] = {}
    apply_fused_optimizer(opts, TrainConfig(fused_optimizer=True), CPU, notes)
    assert opts.optimizers == [muon, adamw]  # the same objects
    assert adamw.param_groups[0]["fused"] is True and adamw.param_groups[0]["foreach"] is False
    assert "fused" not in muon.param_groups[0]
    assert notes["fused_optimizer"] == ("Muon: inactive (Muon has no fused or foreach implementation); "
                                        "AdamW fused")
    apply_fused_optimizer(opts, TrainConfig(fused_optimizer=False), CPU, notes)
    assert adamw.param_groups[0]["fused"] is False and adamw.param_groups[0]["foreach"] is True


def test_the_fused_flag_changes_what_the_optimizer_runs() -> None:
    """fused=True in place makes AdamW call its fused kernel (torch._fused_adamw_), foreach not."""
    calls: list[str] = []
    real = torch._fused_adamw_

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append("fused")
        return real(*args, **kwargs)

    for fused in (False, True):
        model = small_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        apply_fused_optimizer(Optimizers([opt]), TrainConfig(fused_optimizer=fused), CPU, {})
        model(torch.randn(4, 6)).square().mean().backward()
        calls.clear()
        torch._fused_adamw_ = spy  # type: ignore[assignment]
        try:
            opt.step()
        finally:
            torch._fused_adamw_ = real  # type: ignore[assignment]
        assert calls == (["fused"] if fused else [])


def test_an_optimizer_that_cannot_fuse_is_refused_naming_the_knob() -> None:
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    with pytest.raises(ProbeError, match="has stepped already"):
        apply_fused_optimizer(Optimizers([opt]), TrainConfig(fused_optimizer=True), CPU, {})


def _norm(params: list[torch.Tensor]) -> float:
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params])))


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_the_clipped_norm_is_what_the_optimizer_saw(tiny: Workload, train_items: list, precision: str) -> None:
    """With clipping at 0.05 (below the tiny model's gradient norm) the optimizer sees gradients
    of norm 0.05, in fp32 and with fp16's GradScaler (unscaled before clipping: clipping the
    scaled gradients would hand the optimizer a norm 0.05 / scale)."""
    cfg = resolved(tiny, precision=precision, accum_steps=2, batch_size=4)
    torch.manual_seed(0)
    model = tiny.build_model()
    opt = build_optimizer(model, cfg, 0.0, {})
    params = [p for g in opt.param_groups for p in g["params"]]
    seen: list[float] = []
    opt.register_step_pre_hook(lambda optimizer, args, kwargs: seen.append(_norm(params)))
    trainer = Trainer(model, opt, cfg, CPU, {}, clip_norm=0.05)
    for _ in range(3):
        trainer.step(micro_batches(train_items, 4))
    assert trainer.last_grad_norm is not None and float(trainer.last_grad_norm) > 0.05  # it did clip
    assert len(seen) == 3 and seen == pytest.approx([0.05] * 3, rel=1e-3)
    other = copy.deepcopy(model)
    loose = Trainer(other, build_optimizer(other, cfg, 0.0, {}), cfg, CPU, {}, clip_norm=1e6)
    loose.step(micro_batches(train_items, 4))
    assert loose.last_grad_norm is not None and float(loose.last_grad_norm) < 1e6  # a loose bound leaves them be


def test_a_hybrid_trains_through_the_trainer_and_muon_changes_the_step(tiny: Workload, train_items: list) -> None:
    """The Trainer steps Muon and AdamW together; the weights differ from AdamW alone's."""
    cfg = resolved(tiny, batch_size=4, accum_steps=2)
    results = {}
    for name in ("adamw", "muon"):
        torch.manual_seed(0)
        model = tiny.build_model()
        opt = build_optimizer(model, cfg, 0.0, {}) if name == "adamw" else muon_adamw(model, cfg.lr or 0.0, 0.0)
        trainer = Trainer(model, opt, cfg, CPU, {}, schedule=Schedule(10 * 8))
        losses = [float(trainer.step(micro_batches(train_items, 4))) for _ in range(10)]
        assert losses[-1] < losses[0]
        results[name] = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert not torch.allclose(results["adamw"], results["muon"])


def test_compile_optimizer_compiles_the_step_and_trains_as_the_eager_step(tiny: Workload,
                                                                           train_items: list) -> None:
    """The compiled step (dynamo, the eager backend: no C++ build in the suite) makes the lrs
    device tensors, follows the schedule through them and trains as the eager step does."""
    cfg = resolved(tiny, batch_size=4, accum_steps=2)
    weights = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = tiny.build_model()
        initial = torch.cat([p.detach().flatten() for p in model.parameters()])
        opts = muon_adamw(model, cfg.lr or 0.0, 0.03)
        notes: dict[str, str] = {}
        knobs = TrainConfig(**{**cfg.to_dict(), "compile_optimizer": compiled})
        torch._dynamo.reset()
        trainer = Trainer(model, opts, knobs, CPU, notes, schedule=Schedule(6 * 8), compile_backend="eager")
        trainer.step(micro_batches(train_items, 4))
        weights[compiled] = torch.cat([p.detach().flatten() for p in model.parameters()])  # after one step
        for _ in range(5):
            trainer.step(micro_batches(train_items, 4))
        lrs = [g["lr"] for g in opts.param_groups]
        if compiled:
            assert trainer.compiled_step is not None and notes["compile_optimizer"].startswith("on: Muon + AdamW")
            assert all(isinstance(lr, torch.Tensor) for lr in lrs)
            # the schedule wrote into the tensors: the last step's factor, not the base lr
            factor = trainer.schedule.factor(trainer.samples_seen) if trainer.schedule else 1.0
            assert float(lrs[0]) == pytest.approx((cfg.lr or 0.0) * factor, rel=1e-5)
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # dynamo compiled the step
        else:
            assert trainer.compiled_step is None and notes["compile_optimizer"] == "off"
            assert all(isinstance(lr, float) for lr in lrs)
    # the same step to within rounding: Muon's update is bf16 (Newton-Schulz), and with a tensor
    # lr the eager backend scales it in bf16 before adding it (a float lr: in fp32); 0.08 % of
    # the step here, where a different step would differ by its whole size
    moved = torch.linalg.vector_norm(weights[False] - initial)
    assert float(torch.linalg.vector_norm(weights[True] - weights[False]) / moved) < 0.005


def test_compile_optimizer_is_inactive_with_fp16() -> None:
    notes: dict[str, str] = {}
    opts = Optimizers([torch.optim.AdamW(small_model().parameters())])
    assert compile_optimizer_step(opts, TrainConfig(compile_optimizer=True, precision="fp16"), CPU, notes) is None
    assert "fp16's GradScaler" in notes["compile_optimizer"]


def test_a_loop_that_writes_its_lr_as_a_float_reaches_the_device_tensor(tiny: Workload,
                                                                        train_items: list) -> None:
    """Where the knobs keep the lr in a device tensor (compile_optimizer here), a loop that
    writes ``group["lr"] = value`` (nanoGPT's schedule, old LR schedulers) still sets what the
    step reads."""
    cfg = TrainConfig(**{**resolved(tiny, batch_size=4, accum_steps=2).to_dict(), "compile_optimizer": True})
    torch.manual_seed(0)
    model = tiny.build_model()
    opt = build_optimizer(model, cfg, 0.0, {})
    torch._dynamo.reset()
    trainer = Trainer(model, opt, cfg, CPU, {}, compile_backend="eager")
    tensor = opt.param_groups[0]["lr"]
    seen: list[float] = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(float(o.param_groups[0]["lr"])))
    for value in (0.5e-3, 0.25e-3):
        opt.param_groups[0]["lr"] = value  # the user's schedule, as a float
        trainer.step(micro_batches(train_items, 4))
    assert opt.param_groups[0]["lr"] is tensor and seen == pytest.approx([0.5e-3, 0.25e-3])


# -- a workload's own step in the probe -------------------------------------------------------


class OwnStepWorkload(UPSWorkload):
    """The tiny ups job with its own optimizer (SGD, two parameter groups), clipping and LR
    schedule; records what the optimizer saw at every step."""

    seen: list[tuple[list[float], float]]

    def __init__(self, preset: str = "tiny") -> None:
        super().__init__(preset)
        self.seen = []

    @property
    def defaults(self) -> TrainingDefaults:
        return TrainingDefaults(batch_size=4, accum_steps=1, lr=0.05, samples=96, grad_clip_norm=0.5)

    def build_optimizers(self, model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
        matrices = [p for p in model.parameters() if p.ndim >= 2]
        rest = [p for p in model.parameters() if p.ndim < 2]
        assert config.lr is not None
        opt = torch.optim.SGD([{"params": matrices}, {"params": rest, "lr": config.lr / 10}], lr=config.lr,
                              momentum=0.9)
        params = matrices + rest
        opt.register_step_pre_hook(lambda o, a, k: self.seen.append(
            ([float(g["lr"]) for g in o.param_groups], _norm([p for p in params if p.grad is not None]))))
        return opt

    def lr_multiplier(self, progress: float) -> float:
        return 1.0 - 0.5 * progress  # linear decay to half


def test_the_probe_runs_the_workloads_own_step(autotune_data_dir: Any) -> None:
    wl = OwnStepWorkload()
    result = run_probe(wl, {"fused_optimizer": True}, settings=None)
    assert result.failure is None, result.failure
    assert result.knobs["optimizer"] == "SGD (59 tensors in 2 groups)"
    assert result.knobs["fused_optimizer"] == "SGD fused"
    assert result.knobs["grad_clip"] == "max norm 0.5 (global L2, on the device)"
    assert "OwnStepWorkload.lr_multiplier" in result.knobs["lr"]
    steps = result.steps
    assert len(wl.seen) == steps == 24
    for i, (lrs, norm) in enumerate(wl.seen):
        factor = 1.0 - 0.5 * ((i + 1) * 4 / 96)  # the samples seen by the end of step i, over the budget
        assert lrs == pytest.approx([0.05 * factor, 0.005 * factor])  # both groups, the workload's schedule
        assert norm <= 0.5 * (1 + 1e-4)  # clipped before the optimizer saw it


def test_the_muon_preset_trains_with_the_hybrid_and_clipping(autotune_data_dir: Any) -> None:
    wl = get_workload("ups", "tiny-muon")
    assert wl.grad_clip_norm == 1.0 and get_workload("ups", "tiny").grad_clip_norm is None
    result = run_probe(wl, {"fused_optimizer": True, "batch_size": 8, "accum_steps": 1},
                       settings=ProbeSettings(samples=256, windows=5, warmup_steps=2))
    assert result.failure is None, result.failure
    assert result.knobs["optimizer"].startswith("Muon (") and ", AdamW (" in result.knobs["optimizer"]
    assert result.knobs["fused_optimizer"].startswith("Muon: inactive")
    assert result.knobs["grad_clip"].startswith("max norm 1 ")
    assert result.quality is not None
