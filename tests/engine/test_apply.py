"""autotune.apply: a tuned config on the user's own model, optimizer, DataLoader and loss.

Each test shows that an applied knob changed what runs (not only what is recorded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

import autotune
from autotune.contract.config import ConfigError
from autotune.engine.apply import ApplyError, Prepared, apply, load_config
from autotune.workloads.gpt.model import GPTModel, GPTSpec


def user_objects(n: int = 48, batch_size: int = 4) -> tuple[nn.Module, torch.optim.Optimizer, DataLoader]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    data = TensorDataset(torch.randn(n, 8), torch.randn(n, 1))
    loader = DataLoader(data, batch_size=batch_size, shuffle=True)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.95)), loader


def mse(model: nn.Module, batch: Any, with_aux: bool) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x).float(), y)


def test_autotune_apply_is_callable_and_lazy() -> None:
    model, opt, loader = user_objects()
    prepared = autotune.apply({}, model, optimizer=opt, train_loader=loader, loss_fn=mse)
    assert isinstance(prepared, Prepared) and prepared.config.batch_size == 4 and prepared.config.accum_steps == 1
    assert prepared.config.lr == 0.01  # the user's optimizer's lr


def test_load_config_reads_the_best_yaml_with_its_comment_header(tmp_path: Path) -> None:
    path = tmp_path / "best.yaml"
    path.write_text("# autotune recommendation for study s: trial 3\n# throughput: 10 samples/s\n"
                    "batch_size: 16\naccum_steps: 2\nprecision: bf16\n")
    cfg = load_config(path)
    assert (cfg.batch_size, cfg.accum_steps, cfg.precision) == (16, 2, "bf16")
    with pytest.raises(ValueError, match="autotune best STUDY --format yaml"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ValueError, match="unknown knob"):
        load_config({"batchsize": 3})


def test_loop_rate_counts_the_loops_own_wall_clock_after_the_warm_up_beside_the_studys_figure(
        tmp_path: Path) -> None:
    import time

    from autotune.engine.apply import LOOP_RATE_WARMUP_STEPS

    best = tmp_path / "best.yaml"
    best.write_text("# autotune verdict for study s: CERTIFIED, trial 3\n"
                    "# throughput: 1234.5 samples/s; baseline 600.0 samples/s (geometric means over their runs)\n"
                    "batch_size: 4\naccum_steps: 2\n")
    model, opt, loader = user_objects(n=200)
    prepared = apply(best, model, optimizer=opt, train_loader=loader, loss_fn=mse)
    assert prepared.probe_samples_per_s == 1234.5
    batches = iter(prepared.train_loader or [])
    pause = 0.02
    for step in range(1, LOOP_RATE_WARMUP_STEPS + 6):
        for _ in range(2):  # accum_steps 2: two micro-batches of 4 per optimizer step
            prepared.step(next(batches))
        if step <= LOOP_RATE_WARMUP_STEPS:
            assert prepared.loop_rate() is None  # the warm-up's steps are left out
        time.sleep(pause)  # the loop's own work outside `step` (logging, evaluation) counts
    rate = prepared.loop_rate()
    assert rate is not None
    assert (rate.first_step, rate.last_step) == (LOOP_RATE_WARMUP_STEPS + 1, LOOP_RATE_WARMUP_STEPS + 5)
    assert rate.samples == 5 * 2 * 4 and rate.seconds >= 5 * pause
    assert rate.samples_per_s == rate.samples / rate.seconds and rate.over_probe == rate.samples_per_s / 1234.5
    text = str(rate)
    assert f"optimizer steps {LOOP_RATE_WARMUP_STEPS + 1}-{LOOP_RATE_WARMUP_STEPS + 5}" in text
    assert "the study's probe measured 1,234.5 for this config" in text
    # a config given as a mapping (or a best.yaml without its header) has no figure to set beside it
    plain = apply({"batch_size": 4}, user_objects()[0], lr=1e-3, loss_fn=mse)
    assert plain.probe_samples_per_s is None
    best.write_text("batch_size: 4\n")
    assert apply(best, user_objects()[0], lr=1e-3, loss_fn=mse).probe_samples_per_s is None


def test_the_loader_is_rebuilt_with_the_data_pipeline_knobs() -> None:
    model, opt, loader = user_objects()
    prepared = apply({"batch_size": 8, "num_workers": 2, "prefetch_factor": 4, "persistent_workers": True,
                      "pin_memory": True}, model, optimizer=opt, train_loader=loader, loss_fn=mse)
    new = prepared.train_loader
    assert new is not None and new is not loader
    assert (new.batch_size, new.num_workers, new.prefetch_factor, new.persistent_workers) == (8, 2, 4, True)
    assert new.pin_memory is False and "inactive on cpu" in prepared.notes["pin_memory"]
    assert isinstance(new.sampler, RandomSampler) and new.dataset is loader.dataset  # shuffling kept
    first = next(iter(new))
    assert first[0].shape == (8, 8)


def test_the_optimizer_is_made_fused_in_place_keeping_its_hyper_parameters() -> None:
    model, opt, loader = user_objects()
    prepared = apply({"fused_optimizer": True}, model, optimizer=opt, loss_fn=mse, train_loader=loader)
    assert prepared.optimizer is opt  # the caller's reference stays the one that steps
    assert all(g["fused"] is True and g["foreach"] is False for g in opt.param_groups)
    assert opt.param_groups[0]["betas"] == (0.8, 0.95) and opt.param_groups[0]["lr"] == 0.01
    assert prepared.notes["fused_optimizer"] == "AdamW fused"
    before = [p.detach().clone() for p in model.parameters()]
    for batch in prepared.train_loader or []:
        prepared.step(batch)
    assert opt.state and not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    plain = apply({}, user_objects()[0], lr=1e-3, loss_fn=mse)  # no optimizer: AdamW foreach from the knobs
    assert isinstance(plain.optimizer, torch.optim.AdamW)
    assert plain.optimizer.param_groups[0]["foreach"] is True and plain.optimizer.param_groups[0]["lr"] == 1e-3


def test_an_optimizer_with_state_is_refused() -> None:
    model, opt, loader = user_objects()
    mse(model, next(iter(loader)), False).backward()
    opt.step()
    with pytest.raises(ApplyError, match="has stepped already; set the knob before the first step") as info:
        apply({"fused_optimizer": True}, model, optimizer=opt, loss_fn=mse)
    assert info.value.knob == "fused_optimizer"


def test_compile_wraps_the_model_and_keeps_the_plain_module() -> None:
    model, opt, _ = user_objects()
    prepared = apply({"compile": "default"}, model, optimizer=opt, loss_fn=mse)
    assert isinstance(prepared.model, torch._dynamo.eval_frame.OptimizedModule)
    assert prepared.module is model and prepared.model._orig_mod is model  # type: ignore[attr-defined]


def test_checkpointing_is_set_on_the_blocks_and_refused_without_them() -> None:
    model = GPTModel(GPTSpec(vocab=32, context=8, dim=16, depth=2, heads=2))
    apply({"checkpoint": "block"}, model, lr=1e-3)
    assert [b.checkpoint for b in model.blocks] == ["block", "block"]  # type: ignore[union-attr]
    with pytest.raises(ApplyError, match="no checkpointable blocks") as info:
        apply({"checkpoint": "block"}, user_objects()[0], lr=1e-3, loss_fn=mse)
    assert info.value.knob == "checkpoint" and isinstance(info.value, ConfigError)  # one error hierarchy
    assert str(info.value).count("checkpoint:") == 1  # the knob named once
    assert "`checkpoint` attribute" in str(info.value)  # and how to make a block checkpointable


def test_autocast_dtype_is_what_the_forward_sees() -> None:
    model, opt, loader = user_objects()
    seen: list[torch.dtype] = []

    def loss_fn(m: nn.Module, batch: Any, with_aux: bool) -> torch.Tensor:
        out = m(batch[0])
        seen.append(out.dtype)
        return nn.functional.mse_loss(out.float(), batch[1])

    prepared = apply({"precision": "bf16"}, model, optimizer=opt, train_loader=loader, loss_fn=loss_fn)
    prepared.step(next(iter(prepared.train_loader or [])))
    assert seen == [torch.bfloat16]
    fp32 = apply({"batch_size": 4}, user_objects()[0], lr=1e-3, loss_fn=loss_fn)
    fp32.step(next(iter(loader)))
    assert seen[-1] == torch.float32


def test_accumulation_and_inverse_loss_frequency_count_steps() -> None:
    model, opt, loader = user_objects(n=96)
    aux_flags: list[bool] = []

    def loss_fn(m: nn.Module, batch: Any, with_aux: bool) -> torch.Tensor:
        aux_flags.append(with_aux)
        return mse(m, batch, with_aux)

    prepared = apply({"accum_steps": 3, "inverse_loss_frequency": 2}, model, optimizer=opt, train_loader=loader,
                     loss_fn=loss_fn)
    before = [p.detach().clone() for p in model.parameters()]
    results = []
    for batch in prepared.train_loader or []:
        results.append(prepared.step(batch))
        if len(results) == 2:  # two micro-batches in: nothing has run yet, weights unchanged
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert [r is not None for r in results] == [False, False, True] * 8
    assert prepared.optimizer_steps == 8
    # the auxiliary term runs on optimizer steps 0, 2, 4, 6: every micro-batch of those steps
    assert aux_flags == ([True] * 3 + [False] * 3) * 4
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_a_workload_model_trains_with_the_default_loss() -> None:
    torch.manual_seed(0)
    model = GPTModel(GPTSpec(vocab=32, context=8, dim=16, depth=1, heads=2))
    prepared = apply({"batch_size": 4, "accum_steps": 1}, model, lr=1e-2)
    batch = {"x": torch.randint(0, 32, (4, 8)), "y": torch.randint(0, 32, (4, 8))}
    losses = [float(prepared.step(batch)) for _ in range(20)]  # type: ignore[arg-type]
    assert losses[-1] < losses[0]


def test_step_graph_on_a_cpu_is_recorded_inactive_and_the_loop_trains_eagerly() -> None:
    model, opt, loader = user_objects()
    prepared = apply({"step_graph": True}, model, optimizer=opt, train_loader=loader, loss_fn=mse)
    assert prepared.notes["step_graph"] == "inactive on cpu: CUDA graphs need a CUDA device"
    assert prepared.trainer.graph is None and isinstance(prepared.optimizer.param_groups[0]["lr"], float)
    losses = [prepared.step(batch) for batch in prepared.train_loader]
    assert all(loss is not None and torch.isfinite(loss) for loss in losses) and prepared.trainer.step_index == 12


def test_the_configs_lr_is_applied_only_when_asked() -> None:
    model, opt, loader = user_objects()  # the user's lr: 0.01
    kept = apply({"lr": 5e-4, "batch_size": 4}, model, optimizer=opt, train_loader=loader, loss_fn=mse, quiet=True)
    assert opt.param_groups[0]["lr"] == 0.01 and kept.config.lr == 0.01
    assert kept.notes["lr"] == ("0.0005 in the config not applied: your optimizer's lr (0.01) kept "
                                "(use_config_lr=True applies the config's)")
    model, opt, loader = user_objects()
    used = apply({"lr": 5e-4}, model, optimizer=opt, train_loader=loader, loss_fn=mse, use_config_lr=True,
                 quiet=True)
    assert opt.param_groups[0]["lr"] == 5e-4 and used.config.lr == 5e-4
    model, opt, _ = user_objects()
    with pytest.raises(ApplyError, match="the config has no lr"):
        apply({}, model, optimizer=opt, loss_fn=mse, use_config_lr=True)
    with pytest.raises(ApplyError, match="4 trainable parameters are in no optimizer") as e:
        apply({}, model, optimizer=user_objects()[1], loss_fn=mse)  # another model's optimizer
    assert e.value.knob == "optimizer"


def test_a_hybrid_of_the_callers_optimizers_steps_as_one_with_clipping() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    muon = torch.optim.Muon([model[0].weight, model[2].weight], lr=0.02)
    adamw = torch.optim.AdamW([model[0].bias, model[2].bias], lr=1e-3)
    loader = DataLoader(TensorDataset(torch.randn(32, 8), torch.randn(32, 1)), batch_size=4)
    seen: list[float] = []
    muon.register_step_pre_hook(lambda o, a, k: seen.append(float(torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(p.grad) for p in model.parameters()])))))
    prepared = apply({"fused_optimizer": True}, model, optimizer=[muon, adamw], train_loader=loader, loss_fn=mse,
                     grad_clip_norm=0.01, quiet=True)
    assert prepared.optimizer == [muon, adamw] and prepared.optimizers.optimizers == [muon, adamw]
    assert prepared.notes["fused_optimizer"] == ("Muon: inactive (Muon has no fused or foreach implementation); "
                                                 "AdamW fused")
    assert prepared.notes["grad_clip"] == "max norm 0.01 (global L2, on the device)"
    for batch in prepared.train_loader or []:
        prepared.step(batch)
    assert len(seen) == 8 and seen == pytest.approx([0.01] * 8, rel=1e-3)  # both optimizers saw clipped grads
    assert muon.state and adamw.state


def test_a_model_without_the_protocol_needs_a_loss_fn() -> None:
    model, opt, loader = user_objects()
    with pytest.raises(ApplyError, match=r"Sequential.forward does not take \(batch, with_aux\): pass loss_fn=") as e:
        apply({}, model, optimizer=opt, train_loader=loader)
    assert e.value.knob == "loss_fn"


def test_without_a_loader_the_first_step_checks_the_micro_batch_size(capsys: pytest.CaptureFixture[str]) -> None:
    model, opt, _ = user_objects()
    prepared = apply({"batch_size": 8, "num_workers": 2}, model, optimizer=opt, loss_fn=mse)
    assert prepared.train_loader is None
    assert prepared.notes["num_workers"] == "2 not applied: no train_loader to rebuild"
    with pytest.raises(ApplyError, match="the config's micro-batch is 8 samples and step got 4") as e:
        prepared.step((torch.randn(4, 8), torch.randn(4, 1)))
    assert e.value.knob == "batch_size"
    prepared.step((torch.randn(8, 8), torch.randn(8, 1)))  # the size it asked for
    assert prepared.optimizer_steps == 1
    err = capsys.readouterr().err  # what could not act, printed once by apply
    assert err.count("autotune.apply: knobs that could not act here") == 1 and "num_workers: 2 not applied" in err
    assert "bucket_cap_mb" not in err  # the multi-process knobs at their defaults: nothing to say


def test_a_loop_that_writes_its_own_lr_keeps_scheduling_the_step() -> None:
    """nanoGPT-style: the loop writes group["lr"] before each step; the optimizer it holds is
    the one that steps, so the writes reach it."""
    model, opt, loader = user_objects()
    seen: list[float] = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(float(o.param_groups[0]["lr"])))
    prepared = apply({"batch_size": 4}, model, optimizer=opt, train_loader=loader, loss_fn=mse, quiet=True)
    for it, batch in enumerate(prepared.train_loader or []):
        for group in opt.param_groups:
            group["lr"] = 0.01 / (it + 1)
        prepared.step(batch)
    assert seen == pytest.approx([0.01 / (i + 1) for i in range(12)])
