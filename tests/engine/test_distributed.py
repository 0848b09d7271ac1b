"""Multi-process probes (autotune.engine.distributed, DDP in autotune.engine.knobs, --gpus-per-trial in the worker).

Everything runs on the CPU with gloo: two real processes stand in for two GPUs. The slow
tests launch real N-rank probes of the tiny preset (a few seconds each on two cores).
"""

from __future__ import annotations

import gc
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from live_service import is_alive, wait_until
from rich.console import Console
from worker_fakes import HARDWARE, FakeClient

import autotune.worker.trial as trial_module
from autotune.contract.config import DISTRIBUTED_KNOBS, TrainConfig
from autotune.contract.protocol import ProbeSpec, StudySpec
from autotune.contract.registry import ENV_VAR, get_workload, registered_workloads
from autotune.contract.results import LeaseRequest, TrialLease
from autotune.contract.space import SpaceError, load_space, parse_space, validate_for
from autotune.engine.distributed import (
    JOB_DIR_ENV,
    collect_failure,
    launch_argv,
    nccl_environment,
    prepare_job_dir,
    rank_pids,
)
from autotune.engine.knobs import (
    EpochIterator,
    ProbeError,
    StreamSampler,
    Trainer,
    apply_ddp,
    build_loader,
    build_optimizer,
)
from autotune.engine.probe import ProbeSettings, run_probe
from autotune.engine.probe_child import ChildJob
from autotune.engine.result import ProbeResult
from autotune.worker.child import ProbeProcess
from autotune.worker.gpus import DeviceGroup, plan_groups
from autotune.worker.loop import Worker
from autotune.worker.options import WorkerOptions, child_environment
from autotune.workloads.ups import UPSWorkload

CPU = torch.device("cpu")



# --- groups, sampler slices, knobs, spaces and the protocol (fast) ---------------------------------


def test_devices_split_into_groups_of_gpus_per_trial() -> None:
    assert plan_groups("cuda:0,1,2,3", 2) == [DeviceGroup(("cuda:0", "cuda:1")), DeviceGroup(("cuda:2", "cuda:3"))]
    assert plan_groups("cuda", 2, cuda_count=lambda: 4)[1].name == "cuda:2,3"
    assert plan_groups("cuda:3", 1) == [DeviceGroup(("cuda:3",))]
    assert plan_groups("cpu", 2) == [DeviceGroup(("cpu", "cpu"))] and plan_groups("cpu", 2)[0].name == "cpu-x2"
    with pytest.raises(ValueError, match="not a multiple of --gpus-per-trial 2"):
        plan_groups("cuda:0,1,2", 2)
    with pytest.raises(ValueError, match="each GPU index once"):
        plan_groups("cuda:0,0", 2)
    # the ranks see the group's GPUs in the numbering of the worker's own CUDA_VISIBLE_DEVICES
    group = DeviceGroup(("cuda:2", "cuda:3"))
    assert group.visible_devices({}) == "2,3"
    assert group.visible_devices({"CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == "6,7"


def test_rank_slices_of_the_stream_are_the_single_process_batches() -> None:
    single = list(StreamSampler(40, batch_size=8, seed=3))
    ranks = [list(StreamSampler(40, batch_size=4, seed=3, rank=r, world=2)) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == len(single) // 2
    for k in range(len(single) // 8):  # micro-batch k of one process = rank 0's k-th slice + rank 1's
        assert single[8 * k:8 * k + 8] == ranks[0][4 * k:4 * k + 4] + ranks[1][4 * k:4 * k + 4]


def test_distributed_knobs_are_inactive_at_world_size_one(tiny: Any) -> None:
    notes: dict[str, str] = {}
    model = tiny.build_model()
    assert apply_ddp(model, TrainConfig(parallel="fsdp2", static_graph=True, nccl_min_nchannels=4), notes) is model
    assert set(DISTRIBUTED_KNOBS) <= set(notes)
    assert notes["parallel"] == "fsdp2 (inactive: world size 1)"
    assert notes["static_graph"] == "true (inactive: world size 1)"
    assert notes["nccl_min_nchannels"] == "4 (inactive: world size 1)"


def test_nccl_knobs_become_launch_environment_variables() -> None:
    config = TrainConfig(nccl_nsocks_perthread=4, nccl_socket_nthreads=2).to_dict()
    assert nccl_environment(config) == {"NCCL_NSOCKS_PERTHREAD": "4", "NCCL_SOCKET_NTHREADS": "2"}
    assert nccl_environment(TrainConfig().to_dict()) == {}


@pytest.mark.parametrize("knob,spec", [("bucket_cap_mb", {"choices": [1, 25]}),
                                       ("no_sync_accumulation", {"choices": [False, True]}),
                                       ("parallel", {"choices": ["ddp", "fsdp2"]}),
                                       ("nccl_min_nchannels", {"choices": [2, 8]})])
def test_spaces_declare_distributed_knobs_only_for_several_gpus(knob: str, spec: dict[str, Any]) -> None:
    space = parse_space({"params": {knob: spec}})
    validate_for(space, "NVIDIA H100 80GB HBM3", world_size=2)
    with pytest.raises(SpaceError, match="gpus_per_trial >= 2") as info:
        validate_for(space, "NVIDIA H100 80GB HBM3", world_size=1)
    assert info.value.field == f"params.{knob}"
    # a fixed value is harmless at world size 1: the probe records it as inactive
    validate_for(parse_space({"params": {"batch_size": {"choices": [4]}}, "fixed": {knob: spec["choices"][0]}}), "cpu")


def test_the_h100x2_space_is_for_two_gpus_only() -> None:
    space = load_space("h100x2")
    validate_for(space, "NVIDIA H100 80GB HBM3", world_size=2)
    with pytest.raises(SpaceError):
        validate_for(space, "NVIDIA H100 80GB HBM3", world_size=1)
    spec = StudySpec(name="x2", workload="ups", preset="full", space="h100x2", hardware="NVIDIA H100 80GB HBM3",
                     gpus_per_trial=2)
    assert spec.gpus_per_trial == 2
    with pytest.raises(ValueError, match="gpus_per_trial >= 2"):
        StudySpec(name="x1", workload="ups", preset="full", space="h100x2", hardware="NVIDIA H100 80GB HBM3")
    assert LeaseRequest(worker_id="w", hardware="cpu").gpus_per_trial == 1
    with pytest.raises(ValueError):
        LeaseRequest(worker_id="w", hardware="cpu", gpus_per_trial=0)


def test_the_earliest_rank_failure_is_the_cause(tmp_path: Path) -> None:
    def record(rank: int, at: float, message: str) -> None:
        result = {"failure": {"kind": "error", "message": message, "rank": str(rank)}}
        (tmp_path / f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "time": at, "result": result}))

    assert collect_failure(tmp_path) is None
    record(0, 20.0, "Connection closed by peer")  # the echo of rank 1's failure
    record(1, 10.0, "the real cause")
    (tmp_path / "rank-2.json").write_text("{torn")
    failure = collect_failure(tmp_path)
    assert failure is not None and failure["failure"]["message"] == "the real cause"


def test_one_worker_runs_a_lease_loop_per_group_and_signals_reach_them_all() -> None:
    from autotune.worker.loop import _run_loops

    clients = [FakeClient(), FakeClient()]
    quiet = Console(file=io.StringIO())
    workers = [Worker(WorkerOptions(worker_id="host", gpus_per_trial=2), HARDWARE, client=c,  # type: ignore[arg-type]
                      console=quiet, group=g, worker_id_suffix=g.name)
               for c, g in zip(clients, plan_groups("cuda:0,1,2,3", 2), strict=True)]
    assert [w.worker_id for w in workers] == ["host-cuda:0,1", "host-cuda:2,3"]
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    timer = threading.Timer(1.0, os.kill, args=(os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        assert _run_loops(workers) == 128 + signal.SIGTERM
    finally:
        timer.cancel()
        for signum, handler in saved.items():
            signal.signal(signum, handler)
    for client, w in zip(clients, workers, strict=True):  # each loop asked for trials of 2 GPUs, as itself
        requests = [call[1] for call in client.calls if call[0] == "lease"]
        assert requests and all(r.gpus_per_trial == 2 and r.worker_id == w.worker_id for r in requests)


# --- DDP for real: two gloo processes --------------------------------------------------------------


def _ddp_steps(rank: int, world: int, port: int, out: str, data_dir: str) -> None:
    """One rank: one optimizer step of the tiny model under DDP for each (accum, no_sync)
    case, counting the all-reduces with a communication hook; rank 0 saves the parameters."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), AUTOTUNE_DATA_DIR=data_dir)
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    wl = get_workload("ups", "tiny")
    train, _ = wl.datasets(0)
    report: dict[str, Any] = {}
    for accum, no_sync in ((2, True), (4, True), (4, False)):
        config = TrainConfig(batch_size=2, accum_steps=accum, lr=1e-3, no_sync_accumulation=no_sync,
                             bucket_cap_mb=1000.0)
        notes: dict[str, str] = {}
        torch.manual_seed(0)
        model = wl.build_model()
        ddp = apply_ddp(model, config, notes, CPU)
        calls = [0]

        def counting_hook(state, bucket, calls=calls):  # type: ignore[no-untyped-def]  # DDP reads annotations
            calls[0] += 1
            return default_hooks.allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, counting_hook)
        trainer = Trainer(ddp, build_optimizer(model, config, 0.0, notes), config, CPU, notes, parallel=ddp,
                          world=world)
        data = EpochIterator(build_loader(train, config, CPU, 0, notes, rank, world), CPU)
        trainer.step([data.next() for _ in range(accum)])
        report[f"{accum}-{no_sync}"] = calls[0]
        if rank == 0:
            torch.save(model.state_dict(), Path(out) / f"params-{accum}-{no_sync}.pt")
    try:  # DDP's static graph breaks under no_sync (pytorch/pytorch#143580): refused before it is built
        apply_ddp(wl.build_model(), TrainConfig(accum_steps=2, static_graph=True), {}, CPU)
    except ProbeError as e:
        report["static_graph_with_no_sync"] = e.kind
    if rank == 0:
        (Path(out) / "calls.json").write_text(json.dumps(report))
    # tear down in order: the last DDP wrapper (its reducer holds the group) before the group, and
    # the group only once both ranks are done with it (a rank that tore down early has aborted
    # its peer in gloo's threads: "terminate called without an active exception")
    del ddp, trainer, data
    gc.collect()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_step_like_one_process_and_no_sync_skips_all_reduces(
        tmp_path: Path, tiny: Any, tiny_datasets: Any, autotune_data_dir: Path) -> None:
    from live_service import free_port

    torch.multiprocessing.start_processes(_ddp_steps, args=(2, free_port(), str(tmp_path), str(autotune_data_dir)),
                                          nprocs=2, start_method="spawn")
    calls = json.loads((tmp_path / "calls.json").read_text())
    # no_sync: one synchronising backward per optimizer step, whatever the accumulation
    assert calls["2-True"] == calls["4-True"] >= 1
    assert calls["4-False"] == 4 * calls["4-True"]
    assert calls["static_graph_with_no_sync"] == "unsupported"
    # 2 ranks × micro-batch 2 = one process with micro-batch 4: the same parameters after a step
    train, _ = tiny_datasets
    for accum in (2, 4):
        config = TrainConfig(batch_size=4, accum_steps=accum, lr=1e-3)
        notes: dict[str, str] = {}
        torch.manual_seed(0)
        model = tiny.build_model()
        trainer = Trainer(model, build_optimizer(model, config, 0.0, notes), config, CPU, notes)
        data = EpochIterator(build_loader(train, config, CPU, 0, notes), CPU)
        trainer.step([data.next() for _ in range(accum)])
        for no_sync in (True, False) if accum == 4 else (True,):
            ranked = torch.load(tmp_path / f"params-{accum}-{no_sync}.pt")
            for name, value in model.state_dict().items():
                torch.testing.assert_close(ranked[name], value, rtol=1e-5, atol=1e-6, msg=name)


# --- the launcher: probes, failures, prunes and kills ----------------------------------------------


class RankOneFails(UPSWorkload):
    """The tiny ups workload, except that rank 1 fails while building its model."""

    def build_model(self) -> torch.nn.Module:
        if os.environ.get("RANK") == "1":
            raise RuntimeError("rank one refuses to build its model")
        return super().build_model()


def rank_one_fails(preset: str) -> RankOneFails:
    return RankOneFails(preset)


def job_processes(job_root: Path) -> list[int]:
    """Pids of every live process whose job directory lies under `job_root`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(v.startswith(f"{JOB_DIR_ENV}={job_root}".encode()) for v in environ) and is_alive(int(entry.name)):
            pids.append(int(entry.name))
    return pids


def lease(workload: str = "ups", samples: int = 64, prune_at: int | None = None) -> TrialLease:
    return TrialLease(trial_id=3, study="s", number=0, params={}, config={"batch_size": 2, "accum_steps": 2},
                      workload=workload, preset="tiny", probe=ProbeSpec(samples=samples, windows=5, warmup_steps=2,
                                                                        timeout_s=120))


def two_rank_worker(client: FakeClient, **options: Any) -> Worker:
    opts = WorkerOptions(worker_id="w2", heartbeat_s=30.0, gpus_per_trial=2, threads=1, **options)
    return Worker(opts, HARDWARE, client=client, console=Console(file=open(os.devnull, "w")))  # type: ignore[arg-type]


@pytest.fixture
def job_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Job directories of this test go under tmp_path (so its processes can be found)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


@pytest.mark.slow
def test_a_two_rank_probe_reports_global_throughput_and_stops_when_pruned(job_root: Path, tiny_datasets: Any,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # the ranks stop themselves at their next window: that is under test, not the kill that
    # follows a slow stop (3 processes on a loaded 2-core host may need more than 5 s)
    monkeypatch.setattr(trial_module, "PRUNE_GRACE_S", 60.0)
    client = FakeClient(prune_at=0)  # prune at the first report: rank 0 stops every rank at that window
    run = two_rank_worker(client).run_trial(lease(samples=800))
    [result] = client.completed
    assert result["failure"] is None and result["stopped_early"] is True and run.prune_reason == "test prune"
    assert result["world_size"] == 2 and result["config"]["effective_batch"] == 2 * 2 * 2
    assert result["knobs"]["parallel"] == "ddp: 2 ranks (gloo)"
    assert 1 <= len(result["window_throughputs"]) < 5 and result["samples_trained"] < 800
    # rank 0 alone reports; none after the prune (a heartbeat comes too where the trial outlasts heartbeat_s)
    assert [c[0] for c in client.calls if c[0] != "heartbeat"] == ["report", "complete"]
    assert job_processes(job_root) == [] and list(job_root.glob("autotune-job-*")) == []


@pytest.mark.slow
def test_a_two_rank_probe_amortizes_the_epoch_starts_of_every_rank(job_root: Path, tiny_datasets: Any) -> None:
    """Each rank restarts its worker at the same micro-batches; the windows take the slowest
    rank's stall (a collective per window, which every rank must reach alike)."""
    client = FakeClient()
    config = {"batch_size": 8, "accum_steps": 1, "num_workers": 1, "persistent_workers": False}
    two_rank_worker(client).run_trial(lease(samples=480).model_copy(update={"config": config}))
    [result] = client.completed
    assert result["failure"] is None, result["failure"]
    # a rank's epoch: 224 samples over 2 ranks × micro-batch 8 = 14 micro-batches; 30 per rank
    # (30 steps: 2 warm-up, 5 windows of 5, 3 untimed: one epoch start in a window, one after them)
    assert result["epoch_micro_batches"] == 14
    assert [b["micro_batch"] for b in result["epoch_boundaries"]] == [14, 28]
    assert [b["window"] for b in result["epoch_boundaries"]] == [2, None]
    assert result["epoch_cost_s"] > 0
    assert len(result["raw_window_throughputs"]) == len(result["window_throughputs"]) == 5
    assert result["throughput_samples_per_s"] == pytest.approx(statistics.harmonic_mean(result["window_throughputs"]))


@pytest.mark.slow
def test_an_fsdp2_probe_of_two_ranks_trains_like_one_process_with_twice_the_batch(
        job_root: Path, tiny: Any, tiny_datasets: Any) -> None:
    """Sharded over 2 ranks, gathered for validation on rank 0: the same quality as one process."""
    client = FakeClient()
    two = lease(samples=96).model_copy(update={"config": {"batch_size": 2, "accum_steps": 2, "parallel": "fsdp2"}})
    two_rank_worker(client).run_trial(two)
    [result] = client.completed
    assert result["failure"] is None and result["world_size"] == 2, result["failure"]
    assert result["knobs"]["parallel"].startswith("fsdp2: fully_shard on 2 blocks + root, 2 ranks")
    assert result["knobs"]["bucket_cap_mb"] == "25 (inactive: parallel=fsdp2)"
    one = run_probe(tiny, {"batch_size": 4, "accum_steps": 2},
                    settings=ProbeSettings(samples=96, windows=5, warmup_steps=2))
    assert result["samples_trained"] == one.samples_trained == 96
    assert result["val_nrmse"] == pytest.approx(one.val_nrmse, rel=1e-5)


@pytest.mark.slow
def test_a_rank_that_raises_fails_the_trial_with_its_record(job_root: Path, tiny_datasets: Any,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "rankfail=test_distributed:rank_one_fails")
    here = Path(__file__).resolve().parent  # this module, and tests/ for the helpers it imports
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(here), str(here.parent), os.environ.get("PYTHONPATH", "")]))
    registered_workloads.cache_clear()
    client = FakeClient()
    started = time.monotonic()
    try:
        two_rank_worker(client, allow_workloads=("rankfail",)).run_trial(lease(workload="rankfail"))
    finally:
        registered_workloads.cache_clear()
    [result] = client.completed
    assert result["failure"]["kind"] == "error" and result["failure"]["rank"] == "1"
    assert result["failure"]["message"] == "rank 1 of 2: RuntimeError: rank one refuses to build its model"
    assert time.monotonic() - started < 60  # rank 0, blocked in DDP's first broadcast, was ended at once
    assert job_processes(job_root) == []


@pytest.mark.slow
def test_no_rank_outlives_a_killed_worker_or_a_killed_probe(job_root: Path, tiny_datasets: Any) -> None:
    job = ChildJob(workload="ups", preset="tiny", config={"batch_size": 2, "accum_steps": 1}, device="cpu",
                   probe={"samples": 100_000, "windows": 5, "warmup_steps": 2}, threads=1, world_size=2)
    # 1. the probe killed by its worker (prune grace over, timeout, stop): launcher and ranks end
    job_dir = prepare_job_dir(job.to_json())
    child = ProbeProcess(launch_argv(), job, {**child_environment(1), JOB_DIR_ENV: str(job_dir)}, job_dir=job_dir)
    wait_until(lambda: len(rank_pids(job_dir)) == 2, 60, "both ranks to start")
    child.finish()
    wait_until(lambda: job_processes(job_root) == [], 10, "every rank to end")
    # 2. the worker itself killed with SIGKILL: the launcher dies with it, the ranks with the launcher
    job_dir = prepare_job_dir(job.to_json())
    fake_worker = subprocess.Popen(
        [sys.executable, "-c", "import os, subprocess, sys, time\n"
                               "from autotune.worker.options import child_environment\n"
                               f"env = {{**child_environment(1), {JOB_DIR_ENV!r}: {str(job_dir)!r}}}\n"
                               f"subprocess.Popen({launch_argv()!r}, env=env, start_new_session=True)\n"
                               "time.sleep(600)"])
    try:
        wait_until(lambda: len(rank_pids(job_dir)) == 2, 60, "both ranks to start")
        ranks = rank_pids(job_dir)
        assert all(is_alive(pid) for pid in ranks)
        fake_worker.send_signal(signal.SIGKILL)
        fake_worker.wait()
        wait_until(lambda: job_processes(job_root) == [], 15, "the launcher and the ranks to die with the worker")
    finally:
        fake_worker.kill()
        for pid in job_processes(job_root):
            os.kill(pid, signal.SIGKILL)


# --- through a real service ------------------------------------------------------------------------


@pytest.mark.slow
def test_a_two_process_worker_runs_only_studies_of_its_world_size(tmp_path: Path, tiny_datasets: Any) -> None:
    from live_service import LiveService, Processes, log_text, small_spec, start_worker

    processes = Processes(tmp_path)
    try:
        service = LiveService(processes, tmp_path / "autotune.db").start()
        # bucket_cap_mb: not the baseline's 25 (a drawn twin of the baseline is told its result, not run)
        spec = small_spec("two-ranks", n_trials=2, samples=96, gpus_per_trial=2,
                          space={"params": {"batch_size": {"choices": [2]},
                                            "bucket_cap_mb": {"choices": [1.0, 5.0]}},
                                 "fixed": {"accum_steps": 2}},
                          baseline={"batch_size": 2, "accum_steps": 2})
        assert service.submit(spec)["spec"]["gpus_per_trial"] == 2
        # a one-GPU worker is offered nothing, and pinned to the study is told the fix
        one = {"worker_id": "one-gpu", "hardware": "cpu"}
        assert service.post("/v1/trials/lease", one, role="worker").status_code == 204
        pinned = service.post("/v1/trials/lease", {**one, "study": "two-ranks"}, role="worker")
        assert pinned.status_code == 422 and "--gpus-per-trial 2" in pinned.text and "gpus_per_trial" in pinned.text
        worker = start_worker(processes, service.url, "--device", "cpu", "--gpus-per-trial", "2", "--max-trials", "2")
        assert worker.wait(timeout=120) == 0, log_text(worker)
        trials = service.trials("two-ranks")
        assert [t["state"] for t in trials] == ["COMPLETE", "COMPLETE"], log_text(worker)
        assert all(t["worker_id"].endswith("-cpu-x2") and t["throughput_samples_per_s"] > 0 for t in trials)
        assert trials[0]["config"]["effective_batch"] == 2 * 2 * 2  # batch 2 per rank × accum 2 × 2 ranks
    finally:
        processes.stop_all()


@pytest.mark.gpu
@pytest.mark.slow
def test_a_two_gpu_nccl_probe_measures_global_throughput(job_root: Path) -> None:
    """Two GPUs of this host under NCCL, through the worker (skipped without 2 GPUs)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    hardware = HARDWARE.__class__(**{**HARDWARE.to_dict(), "hardware_class": torch.cuda.get_device_name(0),
                                     "device": "cuda:0"})
    client = FakeClient()
    options = WorkerOptions(worker_id="w-gpu", heartbeat_s=30.0, gpus_per_trial=2)
    worker = Worker(options, hardware, client=client, console=Console(file=io.StringIO()),  # type: ignore[arg-type]
                    group=DeviceGroup(("cuda:0", "cuda:1")))
    config = {"batch_size": 8, "accum_steps": 2, "precision": "bf16", "bucket_cap_mb": 5.0}
    worker.run_trial(lease(samples=640).model_copy(update={"config": config}))
    [result] = client.completed
    assert result["failure"] is None, result["failure"]
    assert result["world_size"] == 2 and result["knobs"]["parallel"] == "ddp: 2 ranks (nccl)"
    assert result["throughput_samples_per_s"] > 0 and result["val_nrmse"] is not None
    assert job_processes(job_root) == []


MUON_SAMPLES = 56  # 7 steps of 2 ranks × 2 × 2: 2 warm-up + 5 windows of 1 (Muon over FSDP2 is slow on a CPU)


@pytest.fixture(scope="module")
def muon_one_process(tiny_datasets: Any) -> ProbeResult:
    """The tiny-muon probe in one process with twice the micro-batch: what both parallel modes must match."""
    return run_probe("ups", {"batch_size": 4, "accum_steps": 2}, preset="tiny-muon",
                     settings=ProbeSettings(samples=MUON_SAMPLES, windows=5, warmup_steps=2))


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_the_muon_hybrid_with_clipping_over_two_ranks_trains_like_one_process(
        job_root: Path, tiny_datasets: Any, muon_one_process: ProbeResult, parallel: str) -> None:
    """The research job's step (Muon + AdamW, clipping at 1.0) under DDP and FSDP2: the ranks
    run exactly the workload's step, so the quality is one process's with twice the batch."""
    client = FakeClient()
    two = lease(samples=MUON_SAMPLES).model_copy(update={"preset": "tiny-muon", "config": {
        "batch_size": 2, "accum_steps": 2, "parallel": parallel}})
    two_rank_worker(client).run_trial(two)
    [result] = client.completed
    assert result["failure"] is None and result["world_size"] == 2, result["failure"]
    assert result["knobs"]["parallel"].startswith(parallel)
    assert result["knobs"]["optimizer"].startswith("Muon (") and result["knobs"]["grad_clip"].startswith("max norm 1")
    one = muon_one_process
    assert one.failure is None and result["samples_trained"] == one.samples_trained == MUON_SAMPLES
    assert result["val_nrmse"] == pytest.approx(one.val_nrmse, rel=1e-3)
