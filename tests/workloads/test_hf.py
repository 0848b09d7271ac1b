"""Hugging Face causal LMs as workloads (autotune/workloads/hf.py), the checkpoint knob on their own
switch (autotune.engine.knobs.apply_checkpointing), and `autotune.apply` on an HF model with the
user's AdamW and LR scheduler. Tiny models built from configs: nothing is downloaded."""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest
import torch
import torch.utils._pytree as pytree
from helpers import CPU
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import default_collate

transformers = pytest.importorskip("transformers")

from autotune.engine.apply import ApplyError, apply  # noqa: E402
from autotune.engine.hf_checkpointing import hf_models  # noqa: E402
from autotune.engine.knobs import apply_checkpointing  # noqa: E402
from autotune.engine.optimizers import as_optimizers  # noqa: E402
from autotune.engine.probe import ProbeSettings, run_probe  # noqa: E402
from autotune.workloads import TrainingDefaults  # noqa: E402
from autotune.workloads.hf import (  # noqa: E402
    CausalLMModule,
    HFCausalLM,
    TokenBlocks,
    TokenRows,
    causal_lm_loss,
    causal_lm_workload,
    decay_param_groups,
    hf_adamw,
    token_datasets,
    validation_loss,
)

VOCAB, BLOCK, LAYERS = 64, 16, 2
_n = torch.arange(4096)
TOKENS = (_n * 7 + _n // 64) % VOCAB  # a pattern a tiny model learns in a few steps


def llama() -> nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))


def gpt2() -> nn.Module:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=LAYERS, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0))


def mlps(model: nn.Module) -> list[nn.Module]:
    hf = model.hf if isinstance(model, CausalLMModule) else model
    layers = hf.model.layers if hasattr(hf, "model") else hf.transformer.h
    return [layer.mlp for layer in layers]


def count_mlp_calls(model: nn.Module, calls: list[bool]) -> None:
    """Record each MLP forward (grad mode on: in training or its recomputation in backward).
    The forward itself is wrapped: the recomputation inside torch's checkpoint skips module hooks."""
    for mlp in mlps(model):
        forward = mlp.forward

        def counted(*args: Any, _forward: Callable[..., Any] = forward, **kwargs: Any) -> Any:
            calls.append(torch.is_grad_enabled())
            return _forward(*args, **kwargs)

        mlp.forward = counted  # type: ignore[method-assign]


DEFAULTS = TrainingDefaults(batch_size=4, accum_steps=2, lr=3e-2, samples=128, weight_decay=0.1)
TinyLlama = causal_lm_workload("tiny-llama", llama, TOKENS, block_size=BLOCK, defaults=DEFAULTS)
SETTINGS = ProbeSettings(samples=80)  # 10 steps: 5 of warm-up, 5 timed


class CountingLlama(TinyLlama):  # type: ignore[misc,valid-type]
    """Counts its training models' MLP forwards (the probe builds a fresh model to validate)."""

    calls: ClassVar[list[bool]] = []

    def hf_model(self) -> nn.Module:
        model = super().hf_model()
        count_mlp_calls(model, CountingLlama.calls)
        return model


def batch_of(n: int, start: int = 0) -> dict[str, torch.Tensor]:
    ds = TokenBlocks(TOKENS, BLOCK)
    return default_collate([ds[i] for i in range(start, start + n)])  # type: ignore[no-any-return]


# -- the workload ------------------------------------------------------------------------------------

def test_the_helper_builds_a_workload_of_blocks_with_the_hf_model_inside() -> None:
    wl = TinyLlama("default")
    assert isinstance(wl, HFCausalLM) and wl.name == "tiny-llama" and wl.quality_metric == "val_loss"
    assert wl.defaults == DEFAULTS
    with pytest.raises(ValueError, match="unknown preset 'tiny' for workload 'tiny-llama'; known: default"):
        TinyLlama("tiny")
    train, val = wl.datasets(0)
    assert len(val) == 409 // BLOCK and len(train) == (4096 - 409 - BLOCK) // BLOCK + 1  # the last 10 % validate
    item = val[1]
    assert item["input_ids"].dtype == torch.long and torch.equal(item["input_ids"], item["labels"])
    assert torch.equal(item["input_ids"], TOKENS[4096 - 409 + BLOCK:4096 - 409 + 2 * BLOCK])  # disjoint blocks
    torch.manual_seed(0)
    model = wl.build_model()
    assert isinstance(model, CausalLMModule) and isinstance(model.hf, transformers.LlamaForCausalLM)
    batch = batch_of(2)
    loss = model(batch, True)["total"]
    own = model.hf(**batch).loss  # the HF model's own loss
    assert float(loss.detach()) == pytest.approx(float(own.detach()), rel=1e-6)
    torch.manual_seed(0)
    assert model.state_dict().keys() == wl.build_model().state_dict().keys()  # what the probe loads back
    assert all(key.startswith("hf.") for key in model.state_dict())


def test_the_probe_trains_and_validates_the_hf_model() -> None:
    wl = TinyLlama("default")
    result = run_probe(wl, {}, settings=ProbeSettings(samples=128))
    assert result.failure is None, result.failure
    assert result.knobs["optimizer"] == "AdamW (21 tensors in 2 groups)"  # decay and no-decay
    torch.manual_seed(0)
    untrained = validation_loss(wl.build_model(), wl.datasets(0)[1], CPU)
    assert untrained == pytest.approx(math.log(VOCAB), rel=0.05)
    assert result.quality is not None and result.quality < 0.5 * untrained  # it learned the pattern


def test_a_schedule_and_stride_given_to_the_helper_are_the_workloads() -> None:
    Wl = causal_lm_workload("halving", llama, lambda: (TOKENS[:2048], TOKENS[2048:]), block_size=BLOCK,
                            defaults={"a": DEFAULTS}, train_stride=1, lr_multiplier=lambda p: 1 - p / 2)
    wl = Wl("a")
    assert wl.lr_multiplier(1.0) == 0.5
    train, val = wl.datasets(0)
    assert len(train) == 2048 - BLOCK + 1 and len(val) == 2048 // BLOCK  # every window / disjoint blocks
    result = run_probe(wl, {}, settings=SETTINGS)
    assert result.failure is None and "Workload.lr_multiplier" in result.knobs["lr"]


def test_a_jobs_own_sampler_given_to_the_helper_makes_the_probes_batches() -> None:
    """sample_batch=: the job's get_batch (random windows, made on the device) is the probe's data
    path, every micro-batch drawn from the probe's generator; the DataLoader knobs are noted
    inactive and the validation set is still the blocks of the tokens. Without it, the class
    does not override Workload.sample_batch (the probe feeds a DataLoader)."""
    from autotune.engine.sampled_data import has_own_data_path

    calls: list[tuple[int, str]] = []

    def get_batch(n: int, generator: torch.Generator, device: torch.device) -> dict[str, torch.Tensor]:
        calls.append((n, str(device)))
        starts = torch.randint(len(TOKENS) - 409 - BLOCK, (n,), generator=generator)
        x = torch.stack([TOKENS[s:s + BLOCK] for s in starts]).to(device)
        return {"input_ids": x, "labels": x}

    Sampled = causal_lm_workload("sampled", llama, TOKENS, block_size=BLOCK, defaults=DEFAULTS, sample_batch=get_batch)
    wl = Sampled("default")
    assert has_own_data_path(wl) and not has_own_data_path(TinyLlama("default"))
    batch = wl.sample_batch(3, torch.Generator().manual_seed(0), CPU)
    assert set(batch) == {"input_ids", "labels"} and batch["input_ids"].shape == (3, BLOCK)
    calls.clear()
    result = run_probe(wl, {"num_workers": 2}, settings=SETTINGS)
    assert result.failure is None, result.failure
    assert calls == [(DEFAULTS.batch_size, "cpu")] * (80 // DEFAULTS.batch_size)  # every micro-batch, and no other
    assert result.knobs["data"].startswith("SampledWorkload.sample_batch"), result.knobs["data"]
    assert result.knobs["num_workers"].startswith("2 (inactive: SampledWorkload.sample_batch")
    untrained = math.log(VOCAB)
    assert result.quality is not None and result.quality < 0.5 * untrained  # validated on the blocks: it learned


def test_rows_without_labels_learn_from_their_input_ids_and_skip_the_padding() -> None:
    rows = [{"input_ids": [5, 6, 7, 0], "attention_mask": [1, 1, 1, 0], "text": "x"},
            {"input_ids": [1, 2, 3, 4], "attention_mask": [1, 1, 1, 1], "text": "y"}]
    train, val = token_datasets((rows, rows), BLOCK)
    assert isinstance(train, TokenRows)
    first = train[0]
    assert set(first) == {"input_ids", "attention_mask", "labels"}  # the text column left out
    assert first["labels"].tolist() == [5, 6, 7, -100]
    with pytest.raises(TypeError, match=r"pass \(train, val\)"):
        token_datasets(rows, BLOCK)  # type: ignore[arg-type]
    # validation: the mean over the scored tokens alone (2 + 3 next tokens: not the padding)
    torch.manual_seed(0)
    model = llama()
    got = validation_loss(model, val, CPU)
    batch = default_collate([val[0], val[1]])
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    labels = batch["labels"][:, 1:]
    expected = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
    assert got == pytest.approx(float(expected), rel=1e-6)
    assert int((labels != -100).sum()) == 5


def test_validation_loss_is_the_mean_over_every_token_in_fp32() -> None:
    torch.manual_seed(0)
    model = llama()
    val = TokenBlocks(TOKENS[:5 * BLOCK], BLOCK)
    with torch.no_grad():  # equal blocks: the mean of the HF model's per-block means
        expected = sum(float(model(**default_collate([val[i]])).loss) for i in range(len(val))) / len(val)
    model.train()
    assert validation_loss(model, val, CPU, batch_size=2) == pytest.approx(expected, rel=1e-5)
    assert model.training  # left as it was


def test_weight_decay_spares_biases_and_norms_and_counts_a_tied_weight_once() -> None:
    torch.manual_seed(0)
    for build in (llama, gpt2):
        model = CausalLMModule(build())
        decay, no_decay = decay_param_groups(model, 0.1)
        names = {id(p): n for n, p in model.named_parameters()}
        decayed = {names[id(p)] for p in decay["params"]}
        spared = {names[id(p)] for p in no_decay["params"]}
        assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
        assert spared and all(n.endswith("bias") or "norm" in n or ".ln_" in n for n in spared), spared
        assert all(p.ndim == 2 for p in decay["params"]) and any("embed" in n or "wte" in n for n in decayed)
        as_optimizers(hf_adamw(model, 1e-3, 0.1), model)  # every trainable parameter in exactly one group
    assert model.hf.lm_head.weight is model.hf.transformer.wte.weight  # GPT-2 ties them: counted once above


# -- the checkpoint knob on the HF model's own switch --------------------------------------------------

class _LiveStorages(TorchDispatchMode):
    """Every storage an op creates; after a forward, those still alive are what it kept for
    backward (selective checkpointing's own cache too: tests/engine/test_knobs.py has the same)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[tuple[StorageWeakRef, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.refs.append((StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes()))
        return out

    def live_bytes(self) -> int:
        gc.collect()
        return sum({ref.cdata: n for ref, n in self.refs if not ref.expired()}.values())


def _retained_bytes(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[int, torch.Tensor]:
    """Bytes of the storages the forward leaves alive for backward, and its loss."""
    mode = _LiveStorages()
    with mode:
        loss = model(batch, True)["total"]
    return mode.live_bytes(), loss


@pytest.mark.parametrize("build", [llama, gpt2])
def test_the_knob_drives_the_hf_models_gradient_checkpointing(build: Callable[[], nn.Module]) -> None:
    batch = batch_of(4)
    seen = {}
    for mode in ("none", "block", "selective", "none"):
        torch.manual_seed(0)
        model = CausalLMModule(build()).train()
        if mode == "none" and seen:  # after block: "none" turns the model's checkpointing off again
            apply_checkpointing(model, "block", {})
        notes: dict[str, str] = {}
        assert apply_checkpointing(model, mode, notes) == (0 if mode == "none" else LAYERS)
        name = type(model.hf).__name__
        assert notes["checkpoint"] == {
            "none": f"none: gradient checkpointing off on {name}",
            "block": f"block on 2 decoder layers of {name} (gradient_checkpointing_enable, use_reentrant=False)",
            "selective": f"selective on 2 decoder layers of {name} (gradient_checkpointing_enable, "
                         "use_reentrant=False; matmul and attention outputs kept)"}[mode]
        calls: list[bool] = []
        count_mlp_calls(model, calls)
        saved, loss = _retained_bytes(model, batch)
        forward_calls = len(calls)
        loss.backward()
        assert forward_calls == LAYERS
        assert len(calls) == LAYERS * (1 if mode == "none" else 2)  # recomputed in backward, or not
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        if mode in seen:
            assert saved == seen[mode][0]
        seen[mode] = (saved, float(loss.detach()), grads)
    assert seen["block"][0] < seen["selective"][0] < seen["none"][0]  # selective keeps the matmul outputs
    for mode in ("block", "selective"):
        assert seen[mode][1] == pytest.approx(seen["none"][1], rel=1e-6)
        for n, g in seen["none"][2].items():
            torch.testing.assert_close(seen[mode][2][n], g, msg=n)


def test_only_the_outermost_hf_model_is_switched() -> None:
    model = CausalLMModule(llama())
    assert hf_models(model) == [model.hf]  # not the LlamaModel inside it


def test_attn_and_mlp_checkpointing_are_refused_naming_what_hf_can_do() -> None:
    with pytest.raises(Exception, match="checkpoints whole decoder layers") as info:
        apply_checkpointing(llama(), "mlp", {})
    assert "use block" in str(info.value) and "selective" in str(info.value)
    result = run_probe(TinyLlama("default"), {"checkpoint": "attn"}, settings=SETTINGS)
    assert result.failure is not None and result.failure["kind"] == "unsupported"
    assert "not the attn sub-layer alone; use block" in result.failure["message"]
    with pytest.raises(ApplyError, match="whole decoder layers") as refused:
        apply({"checkpoint": "attn"}, llama(), lr=1e-3, loss_fn=causal_lm_loss, quiet=True)
    assert refused.value.knob == "checkpoint"


@pytest.mark.filterwarnings("ignore:.*gradient_checkpointing_enable.*deprecated:FutureWarning")
def test_a_factory_that_turns_checkpointing_on_leaves_it_to_the_knob() -> None:
    def checkpointed() -> nn.Module:
        model = llama()
        model.gradient_checkpointing_enable()
        return model

    wl = causal_lm_workload("ckpt", checkpointed, TOKENS, block_size=BLOCK, defaults=DEFAULTS)("default")
    model = wl.build_model()
    calls: list[bool] = []
    count_mlp_calls(model, calls)
    model.train()
    model(batch_of(2), True)["total"].backward()
    assert len(calls) == LAYERS  # no recomputation: the probe's checkpoint=none is none


@pytest.mark.filterwarnings("ignore:.*gradient_checkpointing_enable.*deprecated:FutureWarning")
def test_apply_with_checkpoint_none_turns_off_what_the_users_hf_model_had_on() -> None:
    model = llama()
    model.gradient_checkpointing_enable()  # the user's own model, checkpointing on
    prepared = apply({"checkpoint": "none"}, model, lr=1e-3, loss_fn=causal_lm_loss, quiet=True)
    assert "gradient checkpointing off" in prepared.notes["checkpoint"], prepared.notes["checkpoint"]
    calls: list[bool] = []
    count_mlp_calls(model, calls)
    model.train()
    causal_lm_loss(model, batch_of(2), True).backward()
    assert len(calls) == LAYERS  # each layer ran once: nothing recomputed in backward


@pytest.fixture
def counted() -> Iterator[list[bool]]:
    CountingLlama.calls = []
    yield CountingLlama.calls


@pytest.mark.parametrize("mode", ["none", "block", "selective"])
def test_the_probe_recomputes_the_hf_layers_under_the_knob(counted: list[bool], mode: str) -> None:
    result = run_probe(CountingLlama("default"), {"checkpoint": mode}, settings=SETTINGS)
    assert result.failure is None, result.failure
    micro_batches = result.steps * DEFAULTS.accum_steps
    assert result.steps == 80 // 8
    assert sum(counted) == micro_batches * LAYERS * (1 if mode == "none" else 2)  # validation runs without grad
    assert result.knobs["checkpoint"].startswith("none" if mode == "none" else f"{mode} on 2 decoder layers")


def test_the_probe_loss_is_the_same_with_and_without_checkpointing() -> None:
    qualities = [run_probe(TinyLlama("default"), {"checkpoint": mode}, settings=SETTINGS).quality
                 for mode in ("none", "block")]
    assert qualities[0] is not None and qualities[1] == pytest.approx(qualities[0], rel=1e-4)


# -- autotune.apply on an HF model, with the user's optimizer and LR scheduler -----------------------

def linear_warmup(opt: torch.optim.Optimizer) -> Any:
    return transformers.get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=8)


def reference_run(schedule: Callable[[torch.optim.Optimizer], Any], steps: int,
                  device: str = "cpu") -> tuple[dict[str, torch.Tensor], list[float]]:
    """A plain HF loop: one batch of 4 per step, foreach AdamW, the scheduler after each step."""
    torch.manual_seed(0)
    model = llama().to(device)
    opt = hf_adamw(model, 1e-2, 0.1)
    sched = schedule(opt)
    lrs: list[float] = []
    for i in range(steps):
        lrs.append(float(opt.param_groups[0]["lr"]))
        batch = {k: v.to(device) for k, v in batch_of(4, 4 * i).items()}
        causal_lm_loss(model, batch).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return {n: p.detach().to("cpu").clone() for n, p in model.named_parameters()}, lrs


def applied_run(config: dict[str, Any], schedule: Callable[[torch.optim.Optimizer], Any], steps: int,
                device: str = "cpu") -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], Any]:
    """The same job through autotune.apply: micro-batches of 2 × accumulation 2, the user's
    scheduler made before apply, as HF scripts do."""
    torch.manual_seed(0)
    model = llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = hf_adamw(model, 1e-2, 0.1)
    sched = schedule(opt)
    prepared = apply({"batch_size": 2, "accum_steps": 2, **config}, model, optimizer=opt, device=device,
                     loss_fn=causal_lm_loss, quiet=True)
    assert prepared.optimizer is opt
    for i in range(steps):
        for half in range(2):
            if prepared.step(batch_of(2, 4 * i + 2 * half)) is not None:
                sched.step()
    assert prepared.optimizer_steps == steps
    after = {n: p.detach().to("cpu").clone() for n, p in model.named_parameters()}
    return before, after, prepared


CPU_KNOBS = {"checkpoint": "block", "fused_optimizer": True}


def test_apply_on_an_hf_model_keeps_a_zero_lr_schedule_acting() -> None:
    before, after, prepared = applied_run(CPU_KNOBS, lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.0),
                                          3)
    assert prepared.notes["fused_optimizer"] == "AdamW fused" and prepared.notes["checkpoint"].startswith("block on 2")
    for n, p in before.items():
        assert torch.equal(after[n], p), n  # lr 0 at every step: nothing moved


def test_apply_on_an_hf_model_follows_the_users_linear_warmup() -> None:
    steps = 4
    expected, lrs = reference_run(linear_warmup, steps)
    assert lrs == pytest.approx([0.0, 5e-3, 1e-2, 1e-2 * 5 / 6])
    torch.manual_seed(0)
    model = llama()
    opt = hf_adamw(model, 1e-2, 0.1)
    seen: list[float] = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(float(o.param_groups[0]["lr"])))
    sched = linear_warmup(opt)
    prepared = apply({"batch_size": 2, "accum_steps": 2, **CPU_KNOBS}, model, optimizer=opt, loss_fn=causal_lm_loss,
                     quiet=True)
    for i in range(steps * 2):
        if prepared.step(batch_of(2, 2 * i)) is not None:
            sched.step()
    assert seen == pytest.approx(lrs)  # the lr each optimizer step ran with: the scheduler's
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[n], rtol=1e-4, atol=1e-5, msg=n)


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", [{"step_graph": True}, {"compile_optimizer": True},
                                   {"step_graph": True, "compile_optimizer": True, "checkpoint": "block"}],
                         ids=["step_graph", "compile_optimizer", "both+checkpoint"])
def test_the_users_schedule_acts_under_the_step_graph_and_the_compiled_step(knobs: dict[str, Any]) -> None:
    """On a GPU, where the lr becomes a device tensor that a captured or compiled step reads."""
    zero = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.0)  # noqa: E731
    before, after, prepared = applied_run(knobs, zero, 6, device="cuda")
    if "step_graph" in knobs:
        assert prepared.notes["step_graph"].startswith("on"), prepared.notes["step_graph"]
    if "compile_optimizer" in knobs:
        assert prepared.notes["compile_optimizer"].startswith("on"), prepared.notes["compile_optimizer"]
    for n, p in before.items():
        assert torch.equal(after[n], p), n
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference in fp32, as the config's precision
    expected, _ = reference_run(linear_warmup, 6, device="cuda")
    _, after, _ = applied_run(knobs, linear_warmup, 6, device="cuda")
    for n, p in expected.items():  # the warm-up and decay followed: the plain loop's weights
        torch.testing.assert_close(after[n], p, rtol=1e-3, atol=1e-4, msg=n)
