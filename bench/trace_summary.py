"""Where a step's time goes, from the Chrome trace of `autotune probe --trace`.

The probe traces the last warm-up steps (torch.profiler), each step in a named range
("autotune.step", its data wait in "autotune.data"). Per trace this prints and writes (--out):

- steps traced, the median host time of a step and of its data wait;
- the CUDA runtime calls the host made, per step, by name (count and milliseconds): launches
  (cudaLaunchKernel, cudaGraphLaunch, ...) and the calls that wait for the GPU
  (cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize, a synchronous
  cudaMemcpy), which serialise host and GPU;
- the GPU's side over the traced span: kernel and copy time per step, and the fraction of
  the span in which a kernel ran (the union of the kernels' intervals);
- the host's heaviest torch operations per step (count and inclusive milliseconds): where a
  host-bound step spends its time (autograd's gradient accumulation, the optimizer's
  Python-side loop, graph launches, ...).

On a GPU the profiler writes each named range twice, once for the host and once for the GPU
stream ("gpu_user_annotation"); steps are counted on the host side only.

A step whose host time is close to its GPU time, with a sync in it, alternates host and GPU;
a GPU busy fraction well below 1 with a host step time near the span's means the host (or
what it waits on) bounds the step.

    python bench/trace_summary.py TRACE.json [TRACE.json ...] [--out summary.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

STEP, DATA = "autotune.step", "autotune.data"  # autotune/engine/timing.py's TRACE_STEP, TRACE_DATA
GPU_RANGE = "gpu_user_annotation"  # the profiler's GPU-side copy of a record_function range
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Microseconds covered by the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def summarize(path: Path, top_ops: int = 12) -> dict[str, Any]:
    events = [e for e in json.loads(path.read_text()).get("traceEvents", []) if e.get("ph") == "X"]
    host = [e for e in events if e.get("cat") != GPU_RANGE]  # a GPU's copy of a named range is not a step
    steps = [e for e in host if e.get("name") == STEP]
    if not steps:
        raise SystemExit(f"{path}: no {STEP!r} ranges; was it written by `autotune probe --trace`?")
    data = [e for e in host if e.get("name") == DATA]
    begin = min(e["ts"] for e in steps + data)
    end = max(e["ts"] + e["dur"] for e in steps)
    n = len(steps)

    runtime: dict[str, dict[str, float]] = {}
    for e in events:
        if e.get("cat") == "cuda_runtime" and begin <= e["ts"] < end:
            row = runtime.setdefault(e["name"], {"calls": 0.0, "ms": 0.0})
            row["calls"] += 1
            row["ms"] += e["dur"] / 1000
    per_step = {name: {"calls": round(v["calls"] / n, 2), "ms": round(v["ms"] / n, 4)}
                for name, v in sorted(runtime.items(), key=lambda kv: -kv[1]["ms"])}
    syncs = sum(v["calls"] for name, v in runtime.items() if name in SYNC_CALLS) / n

    # The GPU runs the last steps' kernels after the host has moved on: every kernel the traced
    # steps launched counts, and the span runs until the last of them ends.
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel" and e["ts"] >= begin]
    copies = [e["dur"] for e in events if e.get("cat") in ("gpu_memcpy", "gpu_memset") and e["ts"] >= begin]
    span_us = max([end, *(b for _, b in kernels)]) - begin

    ops: dict[str, dict[str, float]] = {}
    for e in events:
        if (e.get("cat") in ("cpu_op", "user_annotation") and e["name"] not in (STEP, DATA)
                and begin <= e["ts"] < end):  # torch's ops and its own named ranges (Optimizer.step, ...)
            row = ops.setdefault(e["name"], {"calls": 0.0, "ms": 0.0})
            row["calls"] += 1
            row["ms"] += e["dur"] / 1000
    heaviest = sorted(ops.items(), key=lambda kv: -kv[1]["ms"])[:top_ops]
    return {
        "trace": path.name, "steps": n, "span_ms": span_us / 1000,
        "step_host_ms": statistics.median(e["dur"] for e in steps) / 1000,
        "data_wait_ms": statistics.median(e["dur"] for e in data) / 1000 if data else None,
        "runtime_per_step": per_step, "syncs_per_step": syncs,
        "kernels_per_step": len(kernels) / n,
        "kernel_ms_per_step": sum(b - a for a, b in kernels) / 1000 / n,
        "copy_ms_per_step": sum(copies) / 1000 / n,
        "gpu_busy_fraction": _union_us(kernels) / span_us if kernels and span_us > 0 else None,
        "host_ops_per_step": {name: {"calls": round(v["calls"] / n, 2), "ms": round(v["ms"] / n, 4)}
                              for name, v in heaviest},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, help="write the summaries as JSON here")
    args = parser.parse_args()
    rows = [summarize(p) for p in args.traces]
    for r in rows:
        busy = "-" if r["gpu_busy_fraction"] is None else f"{r['gpu_busy_fraction']:.0%}"
        data = "-" if r["data_wait_ms"] is None else f"{r['data_wait_ms']:.2f}"
        print(f"{r['trace']}: {r['steps']} steps over {r['span_ms']:.1f} ms; a step's host time "
              f"{r['step_host_ms']:.2f} ms (data wait {data} ms); GPU: {r['kernels_per_step']:.0f} kernels, "
              f"{r['kernel_ms_per_step']:.2f} ms per step, busy {busy}; syncs per step {r['syncs_per_step']:.1f}")
        for title, listed in (("CUDA runtime", list(r["runtime_per_step"].items())[:8]),
                            ("host ops (inclusive)", list(r["host_ops_per_step"].items()))):
            print(f"  {title}:")
            for name, v in listed:
                print(f"    {name[:60]:<60} {v['calls']:>7.1f} calls {v['ms']:>9.3f} ms per step")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
