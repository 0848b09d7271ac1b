"""Benchmark: DDP on two GPUs of one host against one GPU, as the worker launches probes.

Runs the `ups` probe of one realistic config (bf16 autocast, fused AdamW, micro-batch 48 per
GPU, eager by default) on 1 GPU and on 2 GPUs, with gradient accumulation 1 and 4, and on 2
GPUs with DDP bucket_cap_mb ∈ {1, 25, 100} (plus accumulation 4 without no_sync, to show
what skipping the all-reduce of the inner micro-batches is worth). Every probe runs in a fresh
process exactly as `autotune worker` starts it: the single-GPU child
(``python -m autotune.engine.probe_child``, job on stdin) or, for 2 GPUs, the distributed launcher
(``python -m autotune.engine.distributed``, job directory, CUDA_VISIBLE_DEVICES = the group), through
the worker's own `ProbeProcess`. Every probe trains the same number of samples (global).

Writes JSON (environment, every ProbeResult, the table) and a PNG next to it, and prints
the table. Scaling efficiency = 2-GPU throughput / (2 × 1-GPU throughput at the same
accumulation).

    python bench/ddp.py --out bench/results/ddp_h200.json                  # 2 GPUs (cuda:0,1)
    python bench/ddp.py --device cpu --preset tiny --out /tmp/ddp_cpu.json  # smoke test: gloo, CPU
    python bench/ddp.py --only 1gpu-accum4,2gpu-accum4-bucket25 --out F.json  # some cases only

The defaults keep a 2×H200 run under ~9 minutes (9 probes of 17 280 samples each, eager; the
dataset is generated once before the first probe). ``--compile default`` compiles every
probe (slower warm-up, kept apart from the throughput).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

from studylib import pyplot

from autotune.contract.protocol import ProbeSpec
from autotune.engine.distributed import JOB_DIR_ENV, collect_failure, launch_argv, prepare_job_dir
from autotune.engine.probe_child import ChildJob
from autotune.worker.child import ProbeProcess
from autotune.worker.gpus import DeviceGroup
from autotune.worker.options import CHILD_MODULE, child_environment

BUCKETS = (1.0, 25.0, 100.0)
ACCUMS = (1, 4)


def cases(base: dict[str, Any]) -> list[dict[str, Any]]:
    """(name, gpus, config) of every probe: the 1-GPU references first, then the 2-GPU grid."""
    out: list[dict[str, Any]] = []
    for accum in ACCUMS:
        out.append({"name": f"1gpu-accum{accum}", "gpus": 1, "accum": accum, "bucket_cap_mb": None,
                    "config": {**base, "accum_steps": accum}})
    for accum in ACCUMS:
        for bucket in BUCKETS:
            out.append({"name": f"2gpu-accum{accum}-bucket{bucket:g}", "gpus": 2, "accum": accum,
                        "bucket_cap_mb": bucket, "no_sync": True,
                        "config": {**base, "accum_steps": accum, "bucket_cap_mb": bucket}})
    out.append({"name": "2gpu-accum4-bucket25-sync-every-micro-batch", "gpus": 2, "accum": 4, "bucket_cap_mb": 25.0,
                "no_sync": False, "config": {**base, "accum_steps": 4, "bucket_cap_mb": 25.0,
                                             "no_sync_accumulation": False}})
    return out


def run_like_worker(job: ChildJob, group: DeviceGroup, threads: int | None, timeout_s: float) -> dict[str, Any]:
    """Run one probe as the worker does (fresh process, ProbeProcess) and return its result."""
    env = child_environment(threads)
    job_dir = None
    if group.world_size > 1:
        job_dir = prepare_job_dir(job.to_json())
        env[JOB_DIR_ENV] = str(job_dir)
        if group.is_cuda:
            env["CUDA_VISIBLE_DEVICES"] = group.visible_devices()
        argv = launch_argv()
    else:
        argv = [sys.executable, "-m", CHILD_MODULE]
    started = time.perf_counter()
    child = ProbeProcess(argv, job, env, job_dir=job_dir)
    result: dict[str, Any] | None = None
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            try:
                kind, payload = child.events.get(timeout=0.5)
            except queue.Empty:
                continue
            if kind == "result":
                result = payload
            elif kind == "eof":
                break
    finally:
        child.finish()
    if job_dir is not None:
        if result is None:
            result = collect_failure(job_dir)
        shutil.rmtree(job_dir, ignore_errors=True)
    if result is None:
        why = "timed out" if time.monotonic() >= deadline else f"exited {child.proc.returncode} without a result"
        result = {"failure": {"kind": "error", "message": f"probe {why}; stderr tail:\n{child.stderr_tail()}"}}
    result["wall_s"] = round(time.perf_counter() - started, 2)
    return result


def prepare_data(workload: str, preset: str) -> float:
    """Generate (or load) the dataset once, before any timed probe; returns seconds. In this
    process (torch is imported here already): the probes read the cache it writes."""
    from autotune.contract.registry import get_workload

    t0 = time.perf_counter()
    get_workload(workload, preset).datasets(0)
    return time.perf_counter() - t0


def environment(device: str) -> dict[str, Any]:
    import torch  # only for the record

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if device == "cuda" else []
    return {"host": socket.gethostname(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "gpus": gpus, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add the scaling efficiency of every 2-GPU row against the 1-GPU row of its accumulation."""
    single = {r["accum"]: r["throughput"] for r in rows if r["gpus"] == 1 and r["throughput"]}
    for r in rows:
        ref = single.get(r["accum"])
        r["scaling_efficiency"] = round(r["throughput"] / (2 * ref), 4) if r["gpus"] == 2 and ref and \
            r["throughput"] else None
    return rows


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(11, 4.8))
    names = [r["name"] for r in rows]
    values = [r["throughput"] or 0.0 for r in rows]
    colors = ["#888888" if r["gpus"] == 1 else "#1f77b4" if r.get("no_sync", True) else "#d62728" for r in rows]
    bars = ax.bar(range(len(rows)), values, color=colors)
    for bar, r in zip(bars, rows, strict=True):
        label = f"{r['scaling_efficiency']:.0%}" if r.get("scaling_efficiency") is not None else \
            ("FAIL" if r["failure"] else "")
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    for accum in ACCUMS:
        ref = next((r["throughput"] for r in rows if r["gpus"] == 1 and r["accum"] == accum and r["throughput"]), None)
        if ref:
            ax.axhline(2 * ref, ls="--", lw=0.8, color="#555555")
            ax.annotate(f"2 × 1 GPU, accum {accum}", (len(rows) - 0.5, 2 * ref), ha="right", va="bottom", fontsize=7)
    ax.set_xticks(range(len(rows)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("global samples/s (median window)")
    ax.set_title(title + "  (label: scaling efficiency = 2-GPU / (2 × 1-GPU))", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda: GPUs 0 and 1 (NCCL); cpu: gloo processes (smoke test)")
    p.add_argument("--gpus", default="0,1", help="the two GPU indices of the 2-GPU group (cuda)")
    p.add_argument("--workload", default="ups")
    p.add_argument("--preset", default="full")
    p.add_argument("--batch-size", type=int, default=None, help="micro-batch per GPU (default: 48; cpu: 4)")
    p.add_argument("--samples", type=int, default=None,
                   help="global training samples per probe (default: 17280 on cuda, 384 on cpu)")
    p.add_argument("--compile", default="none", help="compile mode of every probe (none | default | ...)")
    p.add_argument("--num-workers", type=int, default=None, help="DataLoader workers per rank (default: 4; cpu: 0)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: torch's; cpu: 1)")
    p.add_argument("--timeout", type=float, default=240.0, help="per probe, seconds")
    p.add_argument("--budget", type=float, default=500.0, help="start no probe after this many seconds")
    p.add_argument("--only", default=None,
                   help="comma-separated case names to run (default: all; e.g. 1gpu-accum1,2gpu-accum1-bucket25)")
    p.add_argument("--out", type=Path, required=True, help="JSON path; the PNG goes next to it")
    args = p.parse_args()

    cuda = args.device == "cuda"
    batch = args.batch_size or (48 if cuda else 4)
    samples = args.samples or (17_280 if cuda else 384)
    workers = args.num_workers if args.num_workers is not None else (4 if cuda else 0)
    threads = args.threads or (None if cuda else 1)
    base: dict[str, Any] = {"precision": "bf16", "fused_optimizer": True, "batch_size": batch,
                            "compile": args.compile, "num_workers": workers}
    if workers > 0:
        base.update(prefetch_factor=4, persistent_workers=True)
    if cuda:
        base["pin_memory"] = True
    first, second = (int(i) for i in args.gpus.split(","))
    groups = {1: DeviceGroup((f"cuda:{first}",) if cuda else ("cpu",)),
              2: DeviceGroup((f"cuda:{first}", f"cuda:{second}") if cuda else ("cpu", "cpu"))}
    probe = ProbeSpec(samples=samples, windows=8, warmup_steps=5, timeout_s=args.timeout)

    todo = cases(base)
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = sorted(set(wanted) - {c["name"] for c in todo})
        if unknown:
            p.error(f"--only: no case named {', '.join(unknown)}; the cases are {', '.join(c['name'] for c in todo)}")
        todo = [c for c in todo if c["name"] in wanted]

    t_start = time.perf_counter()
    data_s = prepare_data(args.workload, args.preset)
    print(f"dataset ready in {data_s:.1f} s", flush=True)
    rows: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for case in todo:
        if time.perf_counter() - t_start > args.budget:
            print(f"budget of {args.budget:g} s spent: skipping {case['name']}", flush=True)
            continue
        group = groups[case["gpus"]]
        job = ChildJob(workload=args.workload, preset=args.preset, config=case["config"],
                       device=group.devices[0] if group.world_size == 1 else ("cuda" if cuda else "cpu"),
                       probe=probe, threads=threads, world_size=group.world_size)
        result = run_like_worker(job, group, threads, args.timeout + 60)
        failure = result.get("failure")
        row = {k: case[k] for k in ("name", "gpus", "accum", "bucket_cap_mb")} | {
            "no_sync": case.get("no_sync", True),
            "throughput": result.get("throughput_samples_per_s"), "spread": result.get("throughput_spread"),
            "val_nrmse": result.get("val_nrmse"), "warmup_s": result.get("warmup_s"), "wall_s": result.get("wall_s"),
            "peak_mem_gib": round(result["peak_mem_reserved_bytes"] / 2**30, 2)
            if result.get("peak_mem_reserved_bytes") else None,
            "samples_trained": result.get("samples_trained"), "failure": failure}
        rows.append(row)
        results.append({"case": case["name"], "result": result})
        thr = f"{row['throughput']:,.0f} samples/s" if row["throughput"] else "-"
        print(f"{case['name']:<46} {thr:>18}  wall {row['wall_s']:.1f} s"
              + (f"  FAIL {failure.get('kind')}: {str(failure.get('message'))[:200]}" if failure else ""), flush=True)
    summarize(rows)
    elapsed = time.perf_counter() - t_start
    doc = {"benchmark": "ddp", "environment": environment(args.device), "device": args.device,
           "workload": args.workload, "preset": args.preset, "base_config": base,
           "probe": probe.model_dump(mode="json"),
           "data_s": round(data_s, 1), "elapsed_s": round(elapsed, 1), "rows": rows, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1, default=str))
    png = args.out.with_suffix(".png")
    hw = ", ".join(sorted(set(doc["environment"]["gpus"]))) or "cpu (gloo)"
    plot(rows, png, f"{args.workload}/{args.preset} · {hw} · bf16, fused AdamW, {batch}/GPU, compile {args.compile}")
    print()
    print(f"{'case':<46} {'samples/s':>10} {'spread':>7} {'eff.':>6} {'NRMSE':>7} {'mem GiB':>8}")
    for r in rows:
        eff = f"{r['scaling_efficiency']:.0%}" if r["scaling_efficiency"] is not None else ""
        thr = f"{r['throughput']:,.0f}" if r["throughput"] else "FAIL"
        spread = f"{r['spread']:.1%}" if r["spread"] is not None else ""
        nrmse = f"{r['val_nrmse']:.4f}" if r["val_nrmse"] is not None else ""
        mem = f"{r['peak_mem_gib']:.2f}" if r["peak_mem_gib"] is not None else ""
        print(f"{r['name']:<46} {thr:>10} {spread:>7} {eff:>6} {nrmse:>7} {mem:>8}")
    print(f"\n{len(rows)} probes in {elapsed:.0f} s; wrote {args.out} and {png}")
    return 0 if rows and not any(r["failure"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
