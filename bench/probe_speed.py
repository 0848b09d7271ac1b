"""Is a slow probe process slow at everything? (bench/README.md, probe fidelity)

Some short probes of a host-bound config run slow from their first timed window to their
last, with the training-loop thread as busy as in a fast one: the same host work takes longer
in them. This runs one config's probe in N fresh processes, one after another, and in each
process times fixed host work in the thread that then trains, before the probe (after torch
is imported) and after it:
  python_ms  pure-Python integer work (host_speed.chunk), the median of 5
  copy_ms    copying a 64 MiB buffer (memory bandwidth), the median of 5
  dispatch_us  one tiny CPU tensor op through PyTorch's dispatcher (1000 of them), the median of 5
  launch_us  one tiny CUDA kernel's launch, host side (1000 of them), the median of 5 (CUDA only)
Each process also records its loop thread's CPU milliseconds per step in the probe's windows
(`loop_cpu_ms_per_step`), its transparent huge pages after the probe (`anon_huge_kib`, from
/proc/self/smaps_rollup) and the host's steal fraction in the windows.
If the slow processes are slow at these too, their host runs them slower (their CPU, their
memory, their neighbours); if not, it is something in the process's training state.

Usage (repository root, a GPU host; the first run compiles and is marked "prime"):
  python bench/probe_speed.py --config JSON --runs 8 --out F.jsonl [--preset full --device cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from host_speed import chunk

COPY_BYTES = 64 << 20


OPS = 1000


def _per_op_us(x: Any, sync: Any) -> float:
    """Host microseconds per `x.add_(1)`, over OPS of them (the queue drained first)."""
    sync()
    t0 = time.perf_counter()
    for _ in range(OPS):
        x.add_(1)
    return (time.perf_counter() - t0) / OPS * 1e6


def calibrate(device: str) -> dict[str, float]:
    """Fixed host work, timed in this thread: the median of 5 of each."""
    import torch

    src = bytearray(COPY_BYTES)
    cpu_x = torch.zeros(1)
    gpu_x = torch.zeros(1, device="cuda") if device == "cuda" else None
    py, copy, dispatch, launch = [], [], [], []
    for _ in range(5):
        py.append(chunk(100_000) * 1e3)
        t0 = time.perf_counter()
        bytes(src)
        copy.append((time.perf_counter() - t0) * 1e3)
        dispatch.append(_per_op_us(cpu_x, lambda: None))
        if gpu_x is not None:
            launch.append(_per_op_us(gpu_x, torch.cuda.synchronize))
    if gpu_x is not None:
        torch.cuda.synchronize()
    out = {"python_ms": round(statistics.median(py), 3), "copy_ms": round(statistics.median(copy), 3),
           "dispatch_us": round(statistics.median(dispatch), 3)}
    if launch:
        out["launch_us"] = round(statistics.median(launch), 3)
    return out


def anon_huge_kib() -> int | None:
    """This process's anonymous memory in transparent huge pages, KiB (Linux), else None."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def child(args: argparse.Namespace) -> None:
    import torch  # noqa: F401  (imported before the first calibration: its import is not what is timed)
    from tuning import loop_cpu_ms_per_step

    from autotune.config import parse_config
    from autotune.probe import ProbeSettings, run_probe

    before = calibrate(args.device)
    settings = ProbeSettings(samples=args.samples) if args.samples else ProbeSettings()
    result = run_probe("ups", parse_config(json.loads(args.config)), preset=args.preset, device=args.device,
                       settings=settings)
    after = calibrate(args.device)
    steal = [float(v) for w in result.window_host if (v := w.get("host_steal_fraction")) is not None]
    gpu = [float(v) for w in result.window_gpu if (v := w.get("utilization_percent")) is not None]
    loop = [float(v) for w in result.window_host if (v := w.get("busy_fraction")) is not None]
    print(json.dumps({"throughput": result.throughput_samples_per_s, "failure": result.failure,
                      "window_throughputs": result.window_throughputs, "before": before, "after": after,
                      "median_gpu_utilization": statistics.median(gpu) if gpu else None,
                      "median_loop_busy": statistics.median(loop) if loop else None,
                      "warmup_s": result.warmup_s, "compile_workers": result.compile_workers,
                      "loop_cpu_ms_per_step": loop_cpu_ms_per_step(
                          {"window_host": result.window_host, "raw_window_throughputs": result.raw_window_throughputs},
                          result.config.get("effective_batch")),
                      "median_steal": statistics.median(steal) if steal else None,
                      "anon_huge_kib": anon_huge_kib()}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the config, as JSON")
    parser.add_argument("--runs", type=int, default=8, help="processes, the first of them the priming one")
    parser.add_argument("--out", type=Path, help="JSON lines, one per process (required unless --child)")
    parser.add_argument("--preset", default="full")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--samples", type=int, help="the probe's samples (default: the preset's)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        json.loads(args.config)
    except json.JSONDecodeError as e:
        parser.error(f"--config is not JSON ({e}); give it as '{{\"batch_size\": 24}}'")
    if args.child:
        child(args)
        return
    if args.out is None:
        parser.error("--out F.jsonl is required")
    cmd = [sys.executable, __file__, "--child", "--config", args.config, "--preset", args.preset,
           "--device", args.device] + (["--samples", str(args.samples)] if args.samples else [])
    with args.out.open("w") as out:
        for i in range(args.runs):
            started = time.time()
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0 or not proc.stdout.strip():
                raise SystemExit(f"run {i}: the probe process failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
            row: dict[str, Any] = {"run": i, "prime": i == 0, "started": started, "ended": time.time(),
                                   **json.loads(proc.stdout.strip().splitlines()[-1])}
            out.write(json.dumps(row) + "\n")
            out.flush()
            b, a = row["before"], row["after"]
            print(f"run {i}{' (prime)' if i == 0 else ''}: {row['throughput'] or 0:.0f} samples/s, GPU busy "
                  f"{row['median_gpu_utilization']} %, loop {row['loop_cpu_ms_per_step']} ms/step, python "
                  f"{b['python_ms']}/{a['python_ms']} ms, copy {b['copy_ms']}/{a['copy_ms']} ms, dispatch "
                  f"{b['dispatch_us']}/{a['dispatch_us']} us, launch {b.get('launch_us')}/{a.get('launch_us')} us "
                  f"(before/after), THP {row['anon_huge_kib']} KiB", flush=True)


if __name__ == "__main__":
    main()
