"""The step_graph knob (autotune/engine/step_graph.py): where it cannot act it says why, and on a GPU
the replayed graph trains exactly as the eager step does, and the probe replays it."""

from __future__ import annotations

import pytest
import torch
from helpers import CPU, micro_batches, resolved

from autotune.contract.config import TrainConfig, parse_config
from autotune.contract.registry import Workload
from autotune.contract.steps import plan_steps
from autotune.engine import step_graph
from autotune.engine.knobs import Schedule, Trainer, build_optimizer
from autotune.engine.optimizers import Optimizers, lr_to_tensor, muon_adamw, set_lr
from autotune.engine.probe import ProbeSettings, run_probe

CUDA = torch.device("cuda", 0)



@pytest.mark.parametrize(("knobs", "device", "world", "why"), [
    ({}, CPU, 1, "inactive on cpu: CUDA graphs need a CUDA device"),
    ({}, CUDA, 2, "inactive with several ranks"),
    ({"compile": "reduce-overhead"}, CUDA, 1, "compile=reduce-overhead captures CUDA graphs of its own"),
    ({"compile": "max-autotune"}, CUDA, 1, "compile=max-autotune captures CUDA graphs of its own"),
    ({"precision": "fp16"}, CUDA, 1, "GradScaler"),
    ({"compile": "default", "precision": "bf16"}, CUDA, 1, None),
    ({"compile": "max-autotune-no-cudagraphs"}, CUDA, 1, None),
])
def test_setting_blocker_names_why_the_knob_cannot_act(knobs: dict, device: torch.device, world: int,
                                                       why: str | None) -> None:
    got = step_graph.setting_blocker(TrainConfig(step_graph=True, **knobs), device, world)
    assert got == why if why is None else why in (got or "")


def test_an_optimizer_without_a_capturable_mode_or_with_state_is_named() -> None:
    params = [torch.nn.Parameter(torch.ones(2))]
    sgd = torch.optim.SGD(params, lr=0.1)
    why = step_graph.blocker(TrainConfig(), CUDA, 1, [sgd]) or ""
    assert "SGD has no capturable mode" in why and "compile_optimizer: true" in why  # names the fix
    assert step_graph.blocker(TrainConfig(), CUDA, 1, [sgd], compiled_step=True) is None  # the compiled step can
    adamw = torch.optim.AdamW(params, lr=0.1)
    assert step_graph.blocker(TrainConfig(), CUDA, 1, [adamw]) is None
    params[0].grad = torch.ones(2)
    adamw.step()
    assert "has state already" in (step_graph.blocker(TrainConfig(), CUDA, 1, [adamw]) or "")


def test_a_hybrid_is_captured_only_where_every_optimizer_can_be() -> None:
    muon = torch.optim.Muon([torch.nn.Parameter(torch.ones(2, 3))], lr=0.1)
    adamw = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    assert "Muon has no capturable mode" in (step_graph.blocker(TrainConfig(), CUDA, 1, [muon, adamw]) or "")
    assert step_graph.blocker(TrainConfig(), CUDA, 1, [muon, adamw], compiled_step=True) is None


def test_capturable_optimizer_keeps_its_lr_in_a_tensor_the_schedule_writes_into() -> None:
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=0.5)
    lr_to_tensor(Optimizers([opt]), CPU, capturable=True)
    group = opt.param_groups[0]
    lr = group["lr"]
    assert group["capturable"] is True and isinstance(lr, torch.Tensor) and float(lr) == 0.5
    set_lr(group, 0.25)
    assert group["lr"] is lr and float(lr) == 0.25  # in place: a captured graph reads this tensor
    plain = {"lr": 0.5}
    set_lr(plain, 0.25)
    assert plain["lr"] == 0.25


def test_a_changed_micro_batch_shape_is_refused_with_the_fix() -> None:
    static = step_graph._static_like({"x": torch.zeros(4, 3), "y": (torch.zeros(4), torch.zeros(4))})
    step_graph._copy_into(static, {"x": torch.ones(4, 3), "y": (torch.ones(4), torch.full((4,), 2.0))})
    assert float(static["x"].sum()) == 12 and float(static["y"][1].sum()) == 8
    with pytest.raises(ValueError, match=r"micro-batch 0\['x'\] changed from \(4, 3\).* to \(2, 3\).*drop_last"):
        step_graph._copy_into(static, {"x": torch.ones(2, 3), "y": (torch.ones(4), torch.ones(4))}, "micro-batch 0")


def test_on_cpu_the_knob_is_recorded_inactive_and_training_is_unchanged(make_trainer: object, tiny: Workload,
                                                                        train_items: list) -> None:
    assert parse_config({"step_graph": True}).step_graph is True
    settings = ProbeSettings(samples=160)  # 20 steps: 5 warm-up, 8 windows of 1, 7 untimed
    off = run_probe(tiny, {"batch_size": 4, "inverse_loss_frequency": 2}, settings=settings)
    on = run_probe(tiny, {"batch_size": 4, "inverse_loss_frequency": 2, "step_graph": True}, settings=settings)
    assert on.failure is None and on.knobs["step_graph"] == "inactive on cpu: CUDA graphs need a CUDA device"
    assert off.knobs["step_graph"] == "off"
    assert on.warmup_steps == off.warmup_steps  # no extra warm-up where no graph is captured
    assert on.loss_curve == off.loss_curve and on.val_nrmse == off.val_nrmse  # the same training, step for step


def test_a_capturing_probe_warms_each_step_kind_up_to_its_replay() -> None:
    plain = plan_steps(10_000, 10, 5, 8, 4)
    graphed = plan_steps(10_000, 10, 5, 8, 4, step_graph.EAGER_RUNS + 2)
    assert plain[1] == 8 and graphed[1] == 4 * (step_graph.EAGER_RUNS + 2)


# ---------------------------------------------------------------------------------------------
# on a GPU (skipped without one)


def _train(tiny: Workload, train_items: list, steps: int, **knobs: object) -> tuple[Trainer, list[float], dict]:
    cfg = resolved(tiny, batch_size=4, accum_steps=2, inverse_loss_frequency=2, **knobs)
    torch.manual_seed(0)
    with CUDA:
        model = tiny.build_model()
    notes: dict[str, str] = {}
    opt = build_optimizer(model, cfg, tiny.defaults.weight_decay, notes)
    # both trainers use AdamW's capturable arithmetic (its bias corrections on the device), so
    # what differs is eager against replayed alone: a parameter whose gradient is noise (a key
    # bias) would otherwise amplify the two arithmetics' rounding through Adam's normalisation
    lr_to_tensor(Optimizers([opt]), CUDA, capturable=True)
    trainer = Trainer(model, opt, cfg, CUDA, notes, schedule=Schedule(steps * 8))
    batches = [{k: v.to(CUDA) for k, v in b.items()} for b in micro_batches(train_items, 4)]
    losses = [float(trainer.step(batches)) for _ in range(steps)]
    return trainer, losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_replayed_steps_train_as_the_eager_steps_do(tiny: Workload, train_items: list, fused: bool) -> None:
    """12 steps (2 micro-batches each, inverse losses every 2nd, the LR schedule moving every
    step): the graphed trainer's losses and weights match the eager one's."""
    eager, eager_losses, eager_params = _train(tiny, train_items, 12, fused_optimizer=fused)
    graphed, graphed_losses, graphed_params = _train(tiny, train_items, 12, fused_optimizer=fused, step_graph=True)
    assert eager.graph is None and graphed.graph is not None
    assert sorted(graphed.graph.graphs) == [False, True]
    assert graphed.graph.replays == 12 - 2 * step_graph.EAGER_RUNS  # each kind: eager runs, then replays
    assert graphed.inverse_steps == eager.inverse_steps == 6
    assert eager_losses[-1] < eager_losses[0]  # it trains: not a comparison of two frozen models
    torch.testing.assert_close(torch.tensor(graphed_losses), torch.tensor(eager_losses), rtol=1e-4, atol=1e-5)
    for name, value in eager_params.items():
        torch.testing.assert_close(graphed_params[name], value, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("compile_mode", ["none", "default"])
def test_a_probe_replays_its_steps_from_graphs(tiny: Workload, compile_mode: str) -> None:
    r = run_probe(tiny, {"precision": "bf16", "compile": compile_mode, "step_graph": True,
                         "inverse_loss_frequency": 2, "pin_memory": True, "num_workers": 2,
                         "persistent_workers": True}, device="cuda",  # a pin-memory thread beside the capture
                  settings=ProbeSettings(samples=1280))
    assert r.failure is None, r.failure
    assert r.knobs["step_graph"].startswith("on:"), r.knobs
    assert f"; {r.steps - 2 * step_graph.EAGER_RUNS} of {r.steps} steps replayed from 2 graphs" in r.knobs["step_graph"]
    assert r.warmup_steps >= 2 * (step_graph.EAGER_RUNS + 2)
    assert r.val_nrmse is not None and r.loss_curve[-1][1] < r.loss_curve[0][1]


def _train_hybrid(tiny: Workload, train_items: list, steps: int, **knobs: object) -> tuple[Trainer, list[float],
                                                                                             dict]:
    """The research job's step on the tiny model: Muon + AdamW, clipping at 0.5, its optimizer
    step compiled (compile_optimizer), the schedule moving every step."""
    cfg = resolved(tiny, batch_size=4, accum_steps=2, inverse_loss_frequency=2, compile_optimizer=True, **knobs)
    torch.manual_seed(0)
    with CUDA:
        model = tiny.build_model()
    notes: dict[str, str] = {}
    opts = muon_adamw(model, cfg.lr or 0.0, 0.03)
    torch._dynamo.reset()
    trainer = Trainer(model, opts, cfg, CUDA, notes, schedule=Schedule(steps * 8), clip_norm=0.5)
    batches = [{k: v.to(CUDA) for k, v in b.items()} for b in micro_batches(train_items, 4)]
    losses = [float(trainer.step(batches)) for _ in range(steps)]
    return trainer, losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.gpu
def test_the_hybrid_step_with_clipping_is_captured_and_trains_as_the_compiled_eager_step(
        tiny: Workload, train_items: list) -> None:
    """Muon (Newton-Schulz included) + AdamW, clipping and the schedule, captured through the
    compiled optimizer step: 12 replayed-or-eager steps match the eager ones."""
    eager, eager_losses, eager_params = _train_hybrid(tiny, train_items, 12)
    graphed, graphed_losses, graphed_params = _train_hybrid(tiny, train_items, 12, step_graph=True)
    assert eager.graph is None and eager.compiled_step is not None
    assert graphed.graph is not None and graphed.graph.replays == 12 - 2 * step_graph.EAGER_RUNS
    assert eager_losses[-1] < eager_losses[0]
    assert graphed.last_grad_norm is not None and float(graphed.last_grad_norm) > 0.5  # clipping acted
    torch.testing.assert_close(torch.tensor(graphed_losses), torch.tensor(eager_losses), rtol=1e-3, atol=1e-4)
    for name, value in eager_params.items():
        torch.testing.assert_close(graphed_params[name], value, rtol=1e-3, atol=1e-4, msg=name)


@pytest.mark.gpu
def test_a_muon_probe_replays_its_steps_from_graphs() -> None:
    """The tiny-muon probe with its hybrid step captured trains as the same config without the
    graph (the compiled optimizer step alone): the same validation NRMSE."""
    knobs = {"precision": "bf16", "compile": "default", "compile_optimizer": True, "inverse_loss_frequency": 2,
             "fused_optimizer": True}
    settings = ProbeSettings(samples=1280)
    r = run_probe("ups", {**knobs, "step_graph": True}, preset="tiny-muon", device="cuda", settings=settings)
    assert r.failure is None, r.failure
    assert r.knobs["step_graph"].startswith("on:") and "Muon + AdamW" in r.knobs["step_graph"], r.knobs
    assert "steps replayed from 2 graphs" in r.knobs["step_graph"]
    assert r.knobs["compile_optimizer"].startswith("on: Muon + AdamW")
    eager = run_probe("ups", knobs, preset="tiny-muon", device="cuda", settings=settings)
    assert eager.failure is None and eager.knobs["step_graph"] == "off"
    assert r.val_nrmse == pytest.approx(eager.val_nrmse, rel=2e-3)
    without = run_probe("ups", {"precision": "bf16", "compile": "default", "step_graph": True},
                        preset="tiny-muon", device="cuda", settings=ProbeSettings(samples=640))
    assert without.failure is None and "Muon has no capturable mode" in without.knobs["step_graph"]
