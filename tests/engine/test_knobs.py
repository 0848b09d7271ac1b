"""autotune.engine.knobs: every knob family applied for real, and proof that it changed what ran."""

from __future__ import annotations

import gc
import itertools
import math
import time
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.utils._pytree as pytree
from helpers import CPU, grads, micro_batches, resolved
from torch._dynamo.eval_frame import OptimizedModule
from torch._dynamo.utils import counters
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, Dataset, IterableDataset

import autotune.workloads.ups.model as ups_model
from autotune.contract.config import TrainConfig
from autotune.contract.registry import Workload
from autotune.engine.knobs import (
    EpochIterator,
    ProbeError,
    Schedule,
    StreamSampler,
    Trainer,
    apply_backend_flags,
    apply_checkpointing,
    apply_compile,
    apply_ddp,
    apply_fp8,
    build_loader,
    build_optimizer,
    fp8_supported,
    lr_factor,
)
from autotune.engine.probe import ProbeSettings, run_probe
from autotune.workloads.ups import UPSWorkload

# ---------------------------------------------------------------------------------------------
# gradient accumulation


@pytest.mark.parametrize("with_inverse", [True, False], ids=["inverse-losses", "forward-loss-only"])
def test_accumulation_2x4_matches_1x8(make_trainer: Any, train_items: list, with_inverse: bool) -> None:
    """Same 8 samples in fp32: 4 micro-batches of 2 give the gradients of 1 batch of 8."""
    results = []
    for batch_size, accum in [(2, 4), (8, 1)]:
        model, trainer, notes = make_trainer(batch_size=batch_size, accum_steps=accum, inverse_loss_frequency=2)
        assert notes["accum_steps"].startswith(f"{accum} (loss scaled by 1/{accum})")
        trainer.step_index = 0 if with_inverse else 1  # inverse losses run on even steps only
        assert trainer.with_inverse() is with_inverse
        batches = micro_batches(train_items, batch_size)
        assert len(batches) == accum
        loss = trainer.accumulate(batches)
        results.append((float(loss), grads(model)))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_a == pytest.approx(loss_b, rel=1e-5)
    assert any(float(g.abs().max()) > 1e-4 for g in grads_b.values())  # not a vacuous comparison
    for name in grads_b:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-4, atol=1e-6, msg=name)


def test_accumulate_does_not_step_and_step_clears_gradients(make_trainer: Any, train_items: list) -> None:
    model, trainer, _ = make_trainer()
    before = [p.detach().clone() for p in model.parameters()]
    trainer.accumulate(micro_batches(train_items, 4))
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert trainer.step_index == 0
    trainer.optimizer_step()
    assert trainer.step_index == 1
    assert all(p.grad is None for p in model.parameters())
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


# ---------------------------------------------------------------------------------------------
# activation checkpointing

CHECKPOINTED = {"block": "_block", "attn": "_attn", "mlp": "_mlp", "selective": "_block"}


def _model(tiny: Workload, mode: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = tiny.build_model()
    if mode != "none":
        notes: dict[str, str] = {}
        assert apply_checkpointing(model, mode, notes) == tiny.spec.model.depth  # type: ignore[attr-defined]
        assert notes["checkpoint"] == f"{mode} on {tiny.spec.model.depth} blocks"  # type: ignore[attr-defined]
    return model


def _saved_for_backward_bytes(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[int, torch.Tensor]:
    """Bytes of the distinct storages autograd saves for backward during one forward."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()  # saved tensors stay alive, so live addresses are distinct
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(batch, True)["total"]
    return sum(storages.values()), loss


class _LiveStorages(TorchDispatchMode):
    """Records every storage an op creates; after a forward, the ones still alive are what it retained
    for backward (this also sees what selective checkpointing keeps in its own cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[tuple[StorageWeakRef, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                self.refs.append((StorageWeakRef(s), s.nbytes()))
        return out

    def live_bytes(self) -> int:
        gc.collect()
        return sum({ref.cdata: n for ref, n in self.refs if not ref.expired()}.values())


def _retained_bytes(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    mode = _LiveStorages()
    with mode:
        loss = model(batch, True)["total"]
    retained = mode.live_bytes()
    del loss
    return retained


@pytest.mark.parametrize("mode", ["none", *CHECKPOINTED])
def test_checkpoint_mode_calls_torch_checkpoint_on_its_sublayer(
        tiny: Workload, train_items: list, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    real = ups_model.checkpoint
    calls: list[tuple[str, bool]] = []

    def counting_checkpoint(fn: Any, *args: Any, **kwargs: Any) -> Any:  # observes, then runs the real one
        calls.append((fn.__name__, "context_fn" in kwargs))
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(ups_model, "checkpoint", counting_checkpoint)
    model = _model(tiny, mode)
    model(micro_batches(train_items, 8)[0], True)["total"].backward()
    depth = tiny.spec.model.depth  # type: ignore[attr-defined]
    if mode == "none":
        assert calls == []
    else:
        assert calls == [(CHECKPOINTED[mode], mode == "selective")] * depth
    calls.clear()
    with torch.no_grad():  # nothing to recompute without autograd: checkpoint is skipped
        model(micro_batches(train_items, 8)[0], True)
    assert calls == []


def test_checkpoint_block_saves_less_for_backward_than_none(tiny: Workload, train_items: list) -> None:
    batch = micro_batches(train_items, 8)[0]
    none_bytes, _ = _saved_for_backward_bytes(_model(tiny, "none"), batch)
    block_bytes, _ = _saved_for_backward_bytes(_model(tiny, "block"), batch)
    assert 0 < block_bytes < none_bytes


@pytest.mark.parametrize("mode", ["attn", "mlp", "selective"])
def test_other_checkpoint_modes_save_less_and_keep_gradients(tiny: Workload, train_items: list, mode: str) -> None:
    batch = micro_batches(train_items, 8)[0]
    base = _model(tiny, "none")
    none_bytes, loss = _saved_for_backward_bytes(base, batch)
    loss.backward()
    model = _model(tiny, mode)
    mode_bytes, mode_loss = _saved_for_backward_bytes(model, batch)
    mode_loss.backward()
    assert 0 < mode_bytes < none_bytes
    assert float(mode_loss.detach()) == pytest.approx(float(loss.detach()), rel=1e-6)
    expected = grads(base)
    for name, g in grads(model).items():
        torch.testing.assert_close(g, expected[name], msg=name)


def test_retained_activation_bytes_order_block_selective_none(tiny: Workload, train_items: list) -> None:
    """Counting every storage still alive after the forward: block keeps the least, selective keeps
    the matmul outputs (more than block), and both keep less than no checkpointing."""
    batch = micro_batches(train_items, 8)[0]
    retained = {mode: _retained_bytes(_model(tiny, mode), batch) for mode in ("none", "block", "selective")}
    assert retained["block"] < retained["selective"] < retained["none"]


def test_checkpoint_needs_checkpointable_blocks() -> None:
    with pytest.raises(ProbeError) as info:
        apply_checkpointing(torch.nn.Linear(4, 4), "block", {})
    assert info.value.kind == "unsupported"
    assert apply_checkpointing(torch.nn.Linear(4, 4), "none", {}) == 0


# ---------------------------------------------------------------------------------------------
# inverse_loss_frequency


def test_inverse_losses_run_on_one_step_in_four(make_trainer: Any, train_items: list) -> None:
    model, trainer, notes = make_trainer(inverse_loss_frequency=4)
    assert notes["inverse_loss_frequency"] == "inverse losses on 1 step in 4"
    seen: list[tuple[int, bool, frozenset]] = []
    model.register_forward_hook(lambda m, args, out: seen.append((trainer.step_index, args[1], frozenset(out))))
    batches = micro_batches(train_items, 4)
    steps = 10
    for _ in range(steps):
        trainer.step(batches)
    assert trainer.inverse_steps == math.ceil(steps / 4) == 3
    assert len(seen) == steps * len(batches)
    inverse_steps = {step for step, flag, _ in seen if flag}
    assert inverse_steps == {0, 4, 8}
    for step, flag, keys in seen:
        assert ("inv_encode" in keys and "inv_decode" in keys) is flag, step
        assert "forward" in keys and "total" in keys


def test_probe_counts_inverse_steps(tiny: Workload) -> None:
    result = run_probe(tiny, {"inverse_loss_frequency": 4}, settings=ProbeSettings(samples=8 * 14))
    assert result.failure is None, result.failure
    assert result.steps == 14
    assert result.inverse_steps == math.ceil(result.steps / 4) == 4
    assert result.warmup_steps == 8  # both step kinds warm up: max(5, 2 × 4)


# ---------------------------------------------------------------------------------------------
# compile


@pytest.fixture
def fresh_dynamo() -> Any:
    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()


def test_compile_none_is_eager(tiny: Workload) -> None:
    model = tiny.build_model()
    notes: dict[str, str] = {}
    assert apply_compile(model, "none", notes) is model
    assert notes["compile"] == "none (eager)"


def test_compile_goes_through_dynamo(make_trainer: Any, train_items: list, fresh_dynamo: Any) -> None:
    batches = micro_batches(train_items, 4)
    _, eager_trainer, _ = make_trainer(compile="none")
    eager_loss = eager_trainer.step(batches)

    model, trainer, notes = make_trainer(compile="default")
    compiled = apply_compile(model, "default", notes, backend="eager")
    assert isinstance(compiled, OptimizedModule)
    assert compiled._orig_mod is model
    assert notes["compile"] == "default (eager)"
    assert fresh_dynamo["frames"]["ok"] == 0
    loss = Trainer(compiled, trainer.optimizer, trainer.config, CPU, notes).step(batches)
    assert fresh_dynamo["frames"]["ok"] >= 1
    assert fresh_dynamo["stats"]["unique_graphs"] >= 1
    assert fresh_dynamo["stats"]["calls_captured"] > 0
    assert float(loss) == pytest.approx(float(eager_loss), rel=1e-5)


@pytest.mark.parametrize(("mode", "marks_per_step"), [("reduce-overhead", 2), ("default", 0), ("none", 0)])
def test_reduce_overhead_marks_each_cudagraph_step(make_trainer: Any, train_items: list,
                                                   monkeypatch: pytest.MonkeyPatch, mode: str,
                                                   marks_per_step: int) -> None:
    real = torch.compiler.cudagraph_mark_step_begin
    marks: list[None] = []

    def counting_mark() -> None:
        marks.append(None)
        real()

    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", counting_mark)
    _, trainer, _ = make_trainer(compile=mode)
    assert trainer.cudagraphs is (mode == "reduce-overhead")
    for _ in range(2):
        loss = trainer.step(micro_batches(train_items, 4))
    assert math.isfinite(float(loss))
    assert len(marks) == 2 * marks_per_step


class _PointwiseOperator(torch.nn.Module):
    """A stand-in for the ups model with its interface (the batch's ``u``, ``q`` and ``y``;
    ``predict(u, q)`` for validation): u read at the queried points, then a residual linear map
    of the fields at each point. Its forward and backward lower to 3 C++ kernels (the linear
    layers stay ATen calls), the tiny ups model's to 69 (a C++ build each: about 100
    CPU-seconds with a cold TorchInductor cache; an MLP with a GELU here took 7, ~2 each)."""

    def __init__(self, n_points: int, n_fields: int) -> None:
        super().__init__()
        self.n_points = n_points
        self.fc = torch.nn.Linear(n_fields, n_fields)

    def predict(self, u: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        idx = (q * (self.n_points / (2 * math.pi))).round().long().clamp_(0, self.n_points - 1)
        x = torch.gather(u, 2, idx.unsqueeze(1).expand(-1, u.shape[1], -1)).transpose(1, 2)  # (B, Q, C)
        return (x + self.fc(x)).transpose(1, 2)

    def forward(self, batch: dict[str, torch.Tensor], with_inverse: bool = True) -> dict[str, torch.Tensor]:
        loss = torch.nn.functional.mse_loss(self.predict(batch["u"], batch["q"]), batch["y"])
        return {"forward": loss, "total": loss}


class _SmallGraphWorkload(UPSWorkload):
    """The tiny ups workload (its data, training defaults, AdamW, validation NRMSE) training
    `_PointwiseOperator`: what the compile knob does to a probe, at a fraction of the C++ builds."""

    def build_model(self) -> torch.nn.Module:
        return _PointwiseOperator(self.spec.model.n_points, self.spec.model.n_fields)


@pytest.mark.slow
def test_probe_compiled_with_inductor(tiny_datasets: Any, fresh_dynamo: Any) -> None:
    """compile=default in a probe: dynamo captures the model, AOT autograd compiles its
    backward, TorchInductor lowers both to C++; the compiled probe trains as the eager one.
    (The ups model itself goes through dynamo in test_compile_goes_through_dynamo.)"""
    small = _SmallGraphWorkload("tiny")
    settings = ProbeSettings(samples=80)  # 10 steps: 5 warm-up + 5 windows of 1
    eager = run_probe(small, {}, settings=settings)
    assert eager.failure is None, eager.failure
    assert fresh_dynamo["frames"]["ok"] == 0  # nothing compiled without the knob
    result = run_probe(small, {"compile": "default"}, settings=settings)
    assert result.failure is None, result.failure
    assert result.knobs["compile"] == "default (inductor)"
    assert fresh_dynamo["frames"]["ok"] >= 1
    assert fresh_dynamo["aot_autograd"]["ok"] >= 1  # the backward was compiled too
    assert sum(fresh_dynamo["inductor"].values()) > 0  # inductor (not just dynamo) handled the graphs
    assert result.steps == 10 and result.samples_trained == 80
    assert result.throughput_samples_per_s is not None and result.throughput_samples_per_s > 0
    assert result.val_nrmse is not None
    assert result.val_nrmse == pytest.approx(eager.val_nrmse, rel=1e-2)
    assert result.loss_curve[-1][1] < eager.loss_curve[0][1]  # it trained: not two untrained models compared


# ---------------------------------------------------------------------------------------------
# precision


def _fc1_output_dtypes(model: torch.nn.Module, trainer: Trainer, batches: list) -> set[torch.dtype]:
    dtypes: set[torch.dtype] = set()
    fc1 = model.blocks[0].mlp.fc1  # type: ignore[index,union-attr]
    handle = fc1.register_forward_hook(lambda m, args, out: dtypes.add(out.dtype))
    loss = trainer.accumulate(batches)
    handle.remove()
    assert loss.dtype == torch.float32 and math.isfinite(float(loss))
    return dtypes


@pytest.mark.parametrize(("precision", "dtype"), [("fp32", torch.float32), ("tf32", torch.float32),
                                                  ("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_precision_sets_the_forward_dtype(make_trainer: Any, train_items: list, precision: str,
                                          dtype: torch.dtype) -> None:
    model, trainer, notes = make_trainer(precision=precision)
    assert _fc1_output_dtypes(model, trainer, micro_batches(train_items, 4)) == {dtype}
    if precision in ("bf16", "fp16"):
        assert notes["precision"].startswith(f"{precision}: autocast {dtype}")
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights stay fp32


def test_fp16_scales_the_loss_with_a_grad_scaler(make_trainer: Any, train_items: list) -> None:
    batches = micro_batches(train_items, 4)
    model32, trainer32, _ = make_trainer(precision="fp32")
    assert trainer32.scaler is None
    trainer32.accumulate(batches)
    model16, trainer16, notes = make_trainer(precision="fp16")
    assert isinstance(trainer16.scaler, torch.amp.GradScaler)
    assert notes["precision"].endswith("+ GradScaler")
    scale = trainer16.scaler.get_scale()
    assert scale > 1
    trainer16.accumulate(batches)
    norm32 = torch.cat([g.flatten() for g in grads(model32).values()]).norm()
    norm16 = torch.cat([g.flatten() for g in grads(model16).values()]).norm()
    assert float(norm16 / norm32) == pytest.approx(scale, rel=0.01)  # the backward ran on the scaled loss
    trainer16.optimizer_step()  # unscales before AdamW: the step stays finite
    assert all(torch.isfinite(p).all() for p in model16.parameters())


def test_bf16_has_no_grad_scaler(make_trainer: Any) -> None:
    _, trainer, _ = make_trainer(precision="bf16")
    assert trainer.scaler is None and trainer.autocast_dtype == torch.bfloat16


@pytest.mark.parametrize(("precision", "allow_tf32", "matmul_precision"),
                         [("fp32", False, "highest"), ("tf32", True, "high"), ("bf16", False, "highest")])
def test_tf32_switches(precision: str, allow_tf32: bool, matmul_precision: str) -> None:
    # start from the opposite state, so the test sees the switch being set
    torch.backends.cuda.matmul.allow_tf32 = not allow_tf32
    torch.backends.cudnn.allow_tf32 = not allow_tf32
    torch.set_float32_matmul_precision("highest" if allow_tf32 else "high")
    notes: dict[str, str] = {}
    apply_backend_flags(TrainConfig(precision=precision), CPU, notes)
    assert torch.backends.cuda.matmul.allow_tf32 is allow_tf32
    assert torch.backends.cudnn.allow_tf32 is allow_tf32
    assert torch.get_float32_matmul_precision() == matmul_precision
    if precision != "bf16":
        assert notes["precision"] == f"{precision}: TF32 {'on' if allow_tf32 else 'off'} (no effect on cpu)"


def test_fp8_is_unsupported_on_cpu(tiny: Workload) -> None:
    reason = fp8_supported(CPU)
    assert reason is not None and "CUDA" in reason
    with pytest.raises(ProbeError) as info:
        apply_fp8(tiny.build_model(), TrainConfig(precision="fp8"), CPU, {})
    assert info.value.kind == "unsupported"
    model = tiny.build_model()
    assert apply_fp8(model, TrainConfig(precision="bf16"), CPU, {}) is model
    result = run_probe(tiny, {"precision": "fp8"}, settings=ProbeSettings(samples=80))
    assert result.failure is not None
    assert result.failure["kind"] == "unsupported"
    assert result.failure["message"] == reason
    assert result.steps == 0 and result.val_nrmse is None


# ---------------------------------------------------------------------------------------------
# fused optimizer


def test_fused_optimizer_knob(make_trainer: Any, train_items: list) -> None:
    batches = micro_batches(train_items, 4)
    params = {}
    for fused in (True, False):
        model, trainer, notes = make_trainer(fused_optimizer=fused)
        defaults = trainer.optimizer.defaults
        assert isinstance(trainer.optimizer, torch.optim.AdamW)
        if fused:
            assert defaults["fused"] is True and not defaults["foreach"]
            assert notes["fused_optimizer"] == "AdamW fused"
        else:
            assert defaults["foreach"] is True and not defaults["fused"]
            assert notes["fused_optimizer"] == "AdamW foreach"
        trainer.step(batches)
        params[fused] = [p.detach().clone() for p in model.parameters()]
    for a, b in zip(params[True], params[False], strict=True):  # both implementations take the same step
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# data loading


class _Indices(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"i": torch.tensor(i)}


def test_build_loader_worker_knobs(tiny: Workload) -> None:
    notes: dict[str, str] = {}
    cfg = resolved(tiny, num_workers=2, prefetch_factor=3, persistent_workers=True)
    loader = build_loader(_Indices(10), cfg, CPU, 0, notes)
    assert (loader.num_workers, loader.prefetch_factor, loader.persistent_workers) == (2, 3, True)
    assert loader.batch_size == tiny.defaults.batch_size
    assert isinstance(loader.sampler, StreamSampler)
    assert notes["num_workers"] == "2"
    default = build_loader(_Indices(10), resolved(tiny, num_workers=1), CPU, 0, {})
    assert (default.prefetch_factor, default.persistent_workers) == (2, False)  # torch's defaults
    no_workers = build_loader(_Indices(10), resolved(tiny), CPU, 0, {})
    assert no_workers.num_workers == 0 and no_workers.prefetch_factor is None


def test_pin_memory_is_inactive_on_cpu(tiny: Workload) -> None:
    notes: dict[str, str] = {}
    loader = build_loader(_Indices(10), resolved(tiny, pin_memory=True), CPU, 0, notes)
    assert loader.pin_memory is False
    assert notes["pin_memory"] == "false (inactive on cpu)"
    assert EpochIterator(loader, CPU).non_blocking is False
    notes = {}
    build_loader(_Indices(10), resolved(tiny, pin_memory=False), CPU, 0, notes)
    assert notes["pin_memory"] == "false"


def _stream(n: int, batch_size: int, seed: int, epochs: int) -> list[list[int]]:
    sampler = StreamSampler(n, batch_size, seed)
    return [list(sampler) for _ in range(epochs)]


def test_stream_sampler_order_does_not_depend_on_batch_size() -> None:
    n = 10
    by3 = _stream(n, 3, seed=7, epochs=5)
    by5 = _stream(n, 5, seed=7, epochs=6)
    for epochs, batch in ((by3, 3), (by5, 5)):
        for epoch in epochs:
            assert len(epoch) % batch == 0 and len(epoch) >= n  # whole batches, nothing dropped
    flat3 = [i for e in by3 for i in e]
    flat5 = [i for e in by5 for i in e]
    common = min(len(flat3), len(flat5))
    assert common >= 4 * n
    assert flat3[:common] == flat5[:common]
    for k in range(common // n):  # the stream is a sequence of permutations
        assert sorted(flat3[k * n:(k + 1) * n]) == list(range(n))
    perms = {tuple(flat3[k * n:(k + 1) * n]) for k in range(common // n)}
    assert len(perms) == common // n  # each permutation is fresh
    assert _stream(n, 3, seed=8, epochs=1) != by3[:1]  # the seed decides the order
    assert len(StreamSampler(n, 3, 0)) == 12


def test_epoch_iterator_continues_the_stream_across_epochs(tiny: Workload) -> None:
    n, batch = 10, 3
    loader = build_loader(_Indices(n), resolved(tiny, batch_size=batch), CPU, 5, {})
    data = EpochIterator(loader, CPU)
    got = [data.next()["i"].tolist() for _ in range(10)]
    assert all(len(b) == batch for b in got)
    assert data.epochs == 3  # 12 samples = 4 batches per epoch
    expected = [i for e in _stream(n, batch, seed=5, epochs=3) for i in e][:30]
    assert [i for b in got for i in b] == expected
    # the epoch starts after the first, at the micro-batch that began each, with the fetch's host time
    assert data.pulled == 10
    assert [b.micro_batch for b in data.boundaries] == [4, 8]
    assert all(b.stall_s > 0 for b in data.boundaries)


@pytest.mark.parametrize("workers", [0, 1], ids=["in-process", "restarting-worker"])
def test_epoch_iterator_foresees_the_fetches_that_begin_an_epoch(tiny: Workload, workers: int) -> None:
    """The fetches foreseen to begin an epoch (those a GPU brackets with CUDA events) are exactly
    the ones that did; on a CPU no GPU gap is measured, the host's stall stands."""
    knobs = {"num_workers": 1, "persistent_workers": False} if workers else {}
    loader = build_loader(_Indices(10), resolved(tiny, batch_size=3, **knobs), CPU, 5, {})
    data = EpochIterator(loader, CPU)
    for _ in range(13):  # 4 micro-batches an epoch: epochs begin at 0, 4, 8 and 12
        data.next()
    assert data.predicted == [b.micro_batch for b in data.boundaries] == [4, 8, 12]
    assert data.resolved_boundaries() == data.boundaries
    assert all(b.gpu_gap_s is None and b.stall_s > 0 for b in data.boundaries)


class _Counting(IterableDataset):
    def __iter__(self) -> Any:
        return ({"i": torch.tensor(i)} for i in range(3))


def test_epoch_iterator_without_a_length_does_not_foresee_epoch_starts() -> None:
    data = EpochIterator(DataLoader(_Counting(), batch_size=2), CPU)  # 2 micro-batches an epoch, no len()
    got = [data.next()["i"].tolist() for _ in range(5)]
    assert got == [[0, 1], [2], [0, 1], [2], [0, 1]]
    assert [b.micro_batch for b in data.boundaries] == [2, 4]  # still recorded, with their host stall
    assert data.predicted == []
    assert all(b.gpu_gap_s is None for b in data.resolved_boundaries())


class _SlowStart(_Indices):
    """Sample 0 takes `delay` seconds to load: each epoch of a sequential loader starts with a stall."""

    def __init__(self, n: int, delay: float) -> None:
        super().__init__(n)
        self.delay = delay

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if i == 0:
            time.sleep(self.delay)
        return super().__getitem__(i)


@pytest.mark.gpu
def test_epoch_iterator_measures_how_long_the_gpu_idled_across_an_epoch_start() -> None:
    """Work queued on the GPU before an epoch start runs through part of its stall: the GPU gap
    (CUDA events around the fetch) is the rest, never more than the host's stall."""
    cuda = torch.device("cuda", 0)
    data = EpochIterator(DataLoader(_SlowStart(4, 0.2), batch_size=2), cuda)  # 2 micro-batches an epoch
    x = torch.randn(8192, 8192, device=cuda)
    (x @ x).sum().item()  # cuBLAS set up, the GPU idle
    data.next()
    data.next()
    for _ in range(4):  # tens of ms of queued work: the host runs ahead of it into the epoch start
        x @ x
    data.next()
    assert data.predicted == [2] and [b.micro_batch for b in data.boundaries] == [2]
    (boundary,) = data.resolved_boundaries()
    assert boundary.gpu_gap_s is not None
    assert 0 <= boundary.gpu_gap_s < boundary.stall_s + 1e-3
    assert boundary.gpu_gap_s < boundary.stall_s - 5e-3  # the queued matmuls covered part of the stall


def test_probe_loss_does_not_depend_on_workers(tiny: Workload) -> None:
    settings = ProbeSettings(samples=240)  # 30 steps of 1 micro-batch of 8: crosses a DataLoader epoch (224 samples)
    base = run_probe(tiny, {"batch_size": 8, "accum_steps": 1}, settings=settings)
    workers = run_probe(tiny, {"batch_size": 8, "accum_steps": 1, "num_workers": 2, "prefetch_factor": 3,
                               "persistent_workers": True}, settings=settings)
    assert base.failure is None and workers.failure is None
    assert workers.knobs["num_workers"] == "2"
    assert workers.loss_curve == base.loss_curve
    assert workers.val_nrmse == base.val_nrmse


# ---------------------------------------------------------------------------------------------
# cudnn.benchmark and bucket_cap_mb


@pytest.mark.parametrize("benchmark", [True, False])
def test_cudnn_benchmark_switch(benchmark: bool) -> None:
    torch.backends.cudnn.benchmark = not benchmark
    notes: dict[str, str] = {}
    apply_backend_flags(TrainConfig(cudnn_benchmark=benchmark), CPU, notes)
    assert torch.backends.cudnn.benchmark is benchmark
    assert notes["cudnn_benchmark"] == f"{str(benchmark).lower()} (no effect on cpu)"


def test_probe_sets_cudnn_benchmark(tiny: Workload) -> None:
    torch.backends.cudnn.benchmark = False
    result = run_probe(tiny, {"cudnn_benchmark": True}, settings=ProbeSettings(samples=80))
    assert result.failure is None
    assert torch.backends.cudnn.benchmark is True


def test_bucket_cap_mb_is_recorded_inactive(tiny: Workload) -> None:
    model = tiny.build_model()
    notes: dict[str, str] = {}
    assert apply_ddp(model, TrainConfig(bucket_cap_mb=100.0), notes) is model
    assert notes["bucket_cap_mb"] == "100 (inactive: world size 1)"
    result = run_probe(tiny, {"bucket_cap_mb": 100.0}, settings=ProbeSettings(samples=80))
    assert result.failure is None
    assert "inactive" in result.knobs["bucket_cap_mb"]
    assert result.knobs["bucket_cap_mb"].startswith("100 ")


def test_lr_factor_warms_up_then_decays_to_the_final_fraction() -> None:
    assert lr_factor(0.0, 0.1, 0.1) < 0.01
    assert lr_factor(0.05, 0.1, 0.1) == pytest.approx(0.5)
    assert lr_factor(0.1, 0.1, 0.1) == pytest.approx(1.0)
    assert lr_factor(1.0, 0.1, 0.1) == pytest.approx(0.1)
    values = [lr_factor(p / 100, 0.1, 0.1) for p in range(10, 101)]
    assert all(a >= b for a, b in itertools.pairwise(values))  # monotone decay after warm-up


def test_schedule_follows_samples_not_steps(tiny: Workload, train_items: list) -> None:
    """Two splits of the same effective batch see the same learning rate after each step."""
    lrs = {}
    for batch_size, accum in ((2, 4), (8, 1)):
        cfg = resolved(tiny, batch_size=batch_size, accum_steps=accum)
        torch.manual_seed(0)
        model = tiny.build_model()
        notes: dict[str, str] = {}
        opt = build_optimizer(model, cfg, 0.0, notes)
        trainer = Trainer(model, opt, cfg, CPU, notes, schedule=Schedule(total_samples=800))
        seen = []
        for _ in range(3):
            trainer.step(micro_batches(train_items, batch_size))
            seen.append(opt.param_groups[0]["lr"])
        lrs[(batch_size, accum)] = seen
    assert lrs[(2, 4)] == pytest.approx(lrs[(8, 1)])
    assert lrs[(8, 1)][0] < lrs[(8, 1)][1]  # still warming up: the rate changed between steps


def test_reduce_overhead_with_accumulation_keeps_gradients_allocated(make_trainer: Any, train_items: list,
                                                                    fresh_dynamo: Any) -> None:
    """CUDA graphs + accumulation: .grad stays our own tensor across micro-batches and steps."""
    model, trainer, _ = make_trainer(compile="reduce-overhead", batch_size=4, accum_steps=2)
    assert trainer.keep_grads
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    before = {n: p.grad.data_ptr() for n, p in model.named_parameters()}
    trainer.step(micro_batches(train_items, 4))
    assert all(p.grad is not None for p in model.parameters())  # zeroed, not set to None
    assert {n: p.grad.data_ptr() for n, p in model.named_parameters()} == before
    _, plain, _ = make_trainer(compile="none", batch_size=4, accum_steps=2)
    assert not plain.keep_grads
