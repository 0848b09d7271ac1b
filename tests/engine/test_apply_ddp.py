"""autotune.apply on a user's DDP job (autotune/engine/apply.py `distribute`, docs/apply-ddp.md).

Two real gloo processes on the CPU stand in for two GPUs (torch.multiprocessing, as in
tests/engine/test_distributed.py). Each rank runs every case and reports what it saw on the
user's objects: the DDP's bucket cap and how many buckets a synchronising backward all-reduces,
whether each .grad is a view into DDP's bucket, the static graph, how many all-reduces one
optimizer step makes with and without no_sync, and how far the parameters are from plain DDP's
after the same steps."""

from __future__ import annotations

import gc
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from autotune.engine.apply import apply

MIB = 1024 * 1024


def user_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))


def mse(model: nn.Module, batch: Any, with_aux: bool) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def micro_batches(rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank-local data (each rank its own samples: the all-reduce matters)."""
    generator = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(2, 16, generator=generator), torch.randn(2, 1, generator=generator)) for _ in range(n)]


def adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0, foreach=True)


def plain_ddp(rank: int, accum: int, steps: int) -> list[torch.Tensor]:
    """The parameters after `steps` optimizer steps of the textbook DDP loop (default DDP, an
    all-reduce after every micro-batch, loss / accum)."""
    model = user_model()
    ddp = DistributedDataParallel(model)
    opt = adamw(model)
    data = micro_batches(rank, accum * steps)
    for step in range(steps):
        for batch in data[step * accum:(step + 1) * accum]:
            (mse(ddp, batch, False) / accum).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def full(p: torch.Tensor) -> torch.Tensor:
    """A parameter as one tensor (FSDP2's are sharded DTensors)."""
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()


def distance(params: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    return max(float((full(p) - r).abs().max()) for p, r in zip(params, reference, strict=True))


def count_all_reduces(ddp: DistributedDataParallel) -> list[int]:
    """A comm hook that counts the buckets DDP all-reduces (then all-reduces them as DDP would)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    calls = [0]

    def counting_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP reads the hook's annotations
        calls[0] += 1
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, counting_hook)
    return calls


def train(rank: int, config: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer | None,
          steps: int) -> dict[str, Any]:
    """apply `config` to the user's objects and run `steps` optimizer steps; what DDP did."""
    prepared = apply({"batch_size": 2, **config}, model, optimizer=optimizer, lr=0.01, loss_fn=mse, quiet=True)
    accum = prepared.accum_steps
    ddp = prepared.parallel
    seen: dict[str, Any] = {"notes": prepared.notes, "wrapper": type(ddp).__name__,
                            "is_the_users": ddp is model, "all_reduces_per_step": []}
    calls = count_all_reduces(ddp) if isinstance(ddp, DistributedDataParallel) else [0]
    storages: list[int] = []

    def grad_storages(opt: Any, args: Any, kwargs: Any) -> None:  # before the update: the all-reduced grads
        grads = [p.grad for p in prepared.module.parameters() if p.grad is not None]
        storages.append(len({g.untyped_storage().data_ptr() for g in grads}))

    if isinstance(ddp, DistributedDataParallel):
        for opt in prepared.optimizers:
            opt.register_step_pre_hook(grad_storages)
    last = 0
    for batch in micro_batches(rank, accum * steps):
        if prepared.step(batch) is not None:  # an optimizer step: the all-reduces since the last one
            seen["all_reduces_per_step"].append(calls[0] - last)
            last = calls[0]
    seen["grad_storages"] = storages
    if isinstance(ddp, DistributedDataParallel):
        seen.update(bucket_bytes_cap=ddp.bucket_bytes_cap, gradient_as_bucket_view=ddp.gradient_as_bucket_view,
                    static_graph=ddp.static_graph)
    params = list(prepared.module.parameters())
    seen["distance_to_plain_ddp"] = distance(params, plain_ddp(rank, accum, steps))
    seen["parameters"] = [full(p).flatten()[:8].tolist() for p in params]  # the ranks' replicas agree
    return seen


def _ranks(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    report: dict[str, Any] = {}
    # a plain model: apply wraps it in DDP with the knobs; no_sync all-reduces the last micro-batch only
    model = user_model()
    report["plain"] = train(rank, {"accum_steps": 4, "bucket_cap_mb": 0.004, "gradient_as_bucket_view": True,
                                   "no_sync_accumulation": True, "nccl_min_nchannels": 4}, model, adamw(model), 2)
    model = user_model()
    report["sync_every_micro_batch"] = train(rank, {"accum_steps": 4, "bucket_cap_mb": 0.004,
                                                    "no_sync_accumulation": False}, model, adamw(model), 2)
    model = user_model()
    report["one_bucket"] = train(rank, {"accum_steps": 1, "bucket_cap_mb": 25.0}, model, adamw(model), 2)
    model = user_model()
    report["static_graph"] = train(rank, {"accum_steps": 2, "static_graph": True, "no_sync_accumulation": False},
                                   model, adamw(model), 2)
    # the user's own DDP: kept; static_graph set in place before its first forward; the bucket cap cannot change
    users_ddp = DistributedDataParallel(user_model())
    report["users_ddp"] = train(rank, {"accum_steps": 2, "static_graph": True, "bucket_cap_mb": 4.0,
                                       "no_sync_accumulation": False}, users_ddp, adamw(users_ddp), 2)
    # parallel: fsdp2 shards where apply builds the optimizer; with the user's optimizer DDP stands in
    model = user_model()
    loader = DataLoader(TensorDataset(torch.randn(8, 16), torch.randn(8, 1)), batch_size=2, shuffle=True)
    report["fsdp2_own_optimizer"] = {"notes": apply({"parallel": "fsdp2", "batch_size": 2}, model,
                                                    optimizer=adamw(model), train_loader=loader, loss_fn=mse,
                                                    quiet=True).notes}
    report["fsdp2"] = train(rank, {"parallel": "fsdp2", "accum_steps": 2}, user_model(), None, 2)
    (Path(out) / f"rank-{rank}.json").write_text(json.dumps(report))
    # tear down once both ranks are done with the group (see test_distributed.py's _ddp_steps)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def _launch(port: int, out: str) -> None:
    """The ranks' launcher, as autotune.engine.distributed's: import once, then fork the ranks
    from this process's only thread (two spawned ranks would each import torch, and torch's first
    optimizer imports torch._dynamo: seconds each on a small machine)."""
    adamw(user_model())
    assert threading.active_count() == 1, "fork the ranks from a process of one thread"
    torch.multiprocessing.start_processes(_ranks, args=(2, port, out), nprocs=2, start_method="fork")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from live_service import free_port

    out = tmp_path_factory.mktemp("apply-ddp")
    launcher = torch.multiprocessing.get_context("spawn").Process(target=_launch, args=(free_port(), str(out)))
    launcher.start()
    launcher.join(timeout=120)
    if launcher.is_alive():
        launcher.kill()
        launcher.join()
    assert launcher.exitcode == 0, f"the ranks failed (exit code {launcher.exitcode}): see their stderr above"
    return [json.loads((out / f"rank-{rank}.json").read_text()) for rank in range(2)]


def test_a_plain_model_is_wrapped_in_ddp_with_the_configs_bucket_cap_and_bucket_views(ranks: list[Any]) -> None:
    for seen in ranks:
        plain, one_bucket = seen["plain"], seen["one_bucket"]
        assert plain["wrapper"] == "DistributedDataParallel" and not plain["is_the_users"]
        assert plain["bucket_bytes_cap"] == int(0.004 * MIB) and one_bucket["bucket_bytes_cap"] == 25 * MIB
        # DDP starts with one bucket and rebuilds its buckets by the cap after the first iteration: from
        # then on a small cap splits the gradients into several all-reduces per synchronising backward
        buckets = plain["all_reduces_per_step"][-1]
        assert plain["all_reduces_per_step"][0] == 1 and buckets > 1
        assert one_bucket["all_reduces_per_step"] == [1, 1]
        # gradient_as_bucket_view: every .grad is a view into its bucket's storage, not a tensor of its own
        assert plain["gradient_as_bucket_view"] is True and one_bucket["gradient_as_bucket_view"] is False
        assert plain["grad_storages"] == [1, buckets]
        assert one_bucket["grad_storages"] == [6, 6]
        notes = plain["notes"]
        assert notes["parallel"] == "ddp: 2 ranks (gloo)"
        assert notes["bucket_cap_mb"] == "0.004: DDP's gradient buckets of 0.00399971 MiB"
        assert notes["gradient_as_bucket_view"].startswith("true: each parameter's .grad is a view")
        assert notes["nccl_min_nchannels"] == "4 (inactive: the process group's backend is gloo, not NCCL)"


def test_no_sync_all_reduces_only_the_last_micro_batch(ranks: list[Any]) -> None:
    for seen in ranks:
        once, every = seen["plain"], seen["sync_every_micro_batch"]
        buckets = once["all_reduces_per_step"][-1]  # of 4 micro-batches, one synchronising backward
        assert once["all_reduces_per_step"] == [1, buckets]
        assert every["all_reduces_per_step"] == [1 + 3 * buckets, 4 * buckets]  # the first backward: one bucket
        assert once["notes"]["no_sync_accumulation"].startswith("true: all-reduce on the last micro-batch")
        assert every["notes"]["no_sync_accumulation"] == "false: all-reduce after every micro-batch"


def test_static_graph_is_set_on_the_ddp(ranks: list[Any]) -> None:
    for seen in ranks:
        assert seen["static_graph"]["static_graph"] is True and seen["plain"]["static_graph"] is False
        assert seen["static_graph"]["notes"]["static_graph"].startswith("true: DDP static_graph")


def test_the_users_ddp_is_kept_and_adjusted_where_ddp_allows(ranks: list[Any]) -> None:
    for seen in ranks:
        users = seen["users_ddp"]
        assert users["is_the_users"] and users["static_graph"] is True
        assert users["bucket_bytes_cap"] == 25 * MIB  # a constructor argument: not applied, with the fix
        notes = users["notes"]
        assert notes["static_graph"] == "true: set on your DDP before its first forward"
        assert notes["bucket_cap_mb"].startswith("4 not applied: your DDP was built with 25 MiB buckets")
        assert "pass the plain module (your_ddp.module)" in notes["bucket_cap_mb"]
        assert notes["gradient_as_bucket_view"] == "false (your DDP's already)"
        assert notes["parallel"] == "ddp: your DistributedDataParallel, 2 ranks (gloo)"


def test_fsdp2_shards_only_where_apply_builds_the_optimizer(ranks: list[Any]) -> None:
    for seen in ranks:
        assert seen["fsdp2"]["wrapper"] == "FSDPSequential"
        assert seen["fsdp2"]["notes"]["parallel"] == "fsdp2: fully_shard on 0 blocks + root, 2 ranks (gloo)"
        assert seen["fsdp2"]["notes"]["bucket_cap_mb"] == "25 (inactive: parallel=fsdp2)"
        own_optimizer = seen["fsdp2_own_optimizer"]["notes"]
        assert own_optimizer["parallel"].startswith("fsdp2 not applied: fully_shard replaces the parameters your "
                                                    "optimizer holds")
        assert own_optimizer["parallel"].endswith("; ddp: 2 ranks (gloo)")
        # a loader without a DistributedSampler is kept, and noted: every rank reads every sample
        assert own_optimizer["sampler"].startswith("RandomSampler kept, so every rank reads every sample")


def test_every_case_trains_like_plain_ddp(ranks: list[Any]) -> None:
    for seen in ranks:
        for case in ("plain", "sync_every_micro_batch", "one_bucket", "static_graph", "users_ddp", "fsdp2"):
            assert seen[case]["distance_to_plain_ddp"] < 1e-6, case
            assert seen[case]["parameters"] == ranks[0][case]["parameters"], case  # the replicas agree


def test_one_process_keeps_every_distributed_knob_inactive() -> None:
    model = user_model()
    prepared = apply({"batch_size": 2, "bucket_cap_mb": 4.0, "static_graph": True}, model, optimizer=adamw(model),
                     loss_fn=mse, quiet=True)
    assert prepared.parallel is None and prepared.model is model
    assert prepared.notes["bucket_cap_mb"] == "4 (inactive: one process: no torch.distributed process group of " \
                                              "several ranks)"
