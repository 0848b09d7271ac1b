"""What does the edge of a timed window cost a host-bound config?

A short probe times 8 windows of about 100 steps; a run 10× longer times 8 windows of about
1 000. If closing a window (a CPU–GPU sync, the NVML and /proc readings, the losses brought to
the host) slows the steps that come after it, the short probe pays that 10× as often per step.
Fidelity runs hint at it for the most host-bound config (bench/README.md, probe fidelity:
the long run in windows the short probe's size read 5 % below the same run in 8 windows), but
across processes, where a host-bound config's speed drifts by 10-20 %.

This measures it inside one process, so that drift cancels: the probe's own training
(autotune.probe.build_training) of one config, warmed up once, then blocks of the same number
of steps, each timed one of four ways:
  one       one window over the block: an event before, an event after, one sync
  windows   the block in windows of --per steps, each closed as the probe closes a window:
            sync, NVML and /proc readings, the window's losses to the host
  sync      the same windows closed by the sync alone
  events    the same windows marked by events alone, one sync at the block's end
A round runs every variant once, in reverse order on odd rounds (mirrored, so a host that
slows down steadily favours none). Each variant's rate is its samples over its timed seconds
summed over the rounds; `over_one` is each variant's rate over the `one` rate, and
`paired_over_one` the median of its per-round ratios to that round's `one` block.

Usage, on a GPU host (repository on PYTHONPATH):
  python bench/window_cost.py --config JSON --rounds 6 --out OUT.jsonl
(--preset tiny --device cpu: a CPU smoke run; on a CPU every variant times with the host clock)
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from autotune.config import parse_config
from autotune.gpu_telemetry import GpuTelemetry, window_stats
from autotune.host_telemetry import ThreadUsage, cpu_model
from autotune.host_telemetry import window_stats as host_window_stats
from autotune.probe import Clock, ProbeSettings, build_training, plan_steps
from autotune.workloads import get_workload

VARIANTS = ("one", "windows", "sync", "events")


def run_block(variant: str, windows: int, per: int, step: Callable[[], torch.Tensor], clock: Clock,
              telemetry: GpuTelemetry | None) -> dict[str, Any]:
    """`windows` × `per` steps timed as `variant`; the block's timed seconds and each window's."""
    if variant == "one":
        start = clock.start()
        for _ in range(windows * per):
            step()
        return {"seconds": clock.stop(start), "window_s": []}
    if variant == "events":
        points = [clock.start()]
        for _ in range(windows):
            for _ in range(per):
                step()
            points.append(clock.start())
        if clock.cuda:
            points[-1].synchronize()  # sync: once, at the block's end
        window_s = [clock.seconds(a, b, wait=False) for a, b in itertools.pairwise(points)]
        return {"seconds": sum(window_s), "window_s": window_s}
    window_s = []
    for _ in range(windows):  # windows / sync: each window closed with a sync, as the probe's are
        readings = variant == "windows"
        gpu0 = telemetry.read() if telemetry and readings else None
        host0 = ThreadUsage.read() if readings else None
        start = clock.start()
        losses = [step() for _ in range(per)]
        window_s.append(clock.stop(start))
        if readings:  # what the probe reads at a window's end (and then drops here)
            host1 = ThreadUsage.read()
            if host0 and host1:
                host_window_stats(host0, host1)
            if telemetry and gpu0:
                window_stats(gpu0, telemetry.read())
            if not bool(torch.isfinite(torch.stack(losses).cpu()).all()):
                raise SystemExit("non-finite loss")
    return {"seconds": sum(window_s), "window_s": window_s}


def summarize(blocks: list[dict[str, Any]], samples_per_step: int) -> dict[str, Any]:
    """Per variant: samples over timed seconds summed over its blocks, its ratio to `one`, and
    the median over rounds of its block's rate over that round's `one` block."""
    rates, paired = {}, {}
    for variant in VARIANTS:
        own = [b for b in blocks if b["variant"] == variant]
        if own:
            rates[variant] = sum(b["steps"] for b in own) * samples_per_step / sum(b["seconds"] for b in own)
    one = {b["round"]: b["rate"] for b in blocks if b["variant"] == "one"}
    for variant in rates:
        ratios = [b["rate"] / one[b["round"]] for b in blocks if b["variant"] == variant and b["round"] in one]
        paired[variant] = statistics.median(ratios) if ratios else None
    return {"rates": rates, "over_one": {v: r / rates["one"] for v, r in rates.items()} if "one" in rates else {},
            "paired_over_one": paired}


def measure(config: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    wl = get_workload("ups", args.preset)
    d = wl.defaults
    knobs = {k: v for k, v in config.items() if k != "effective_batch"}
    cfg = parse_config(knobs).resolve(d.batch_size, d.accum_steps, d.lr)
    dev = torch.device(args.device)
    if dev.type == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device()) if dev.index is None else dev
        torch.cuda.set_device(dev)
    eff = cfg.effective_batch
    per = args.per or plan_steps(d.samples, eff, ProbeSettings().warmup_steps, ProbeSettings().windows,
                                 cfg.inverse_loss_frequency)[3]  # the short probe's window
    warm = max(args.warmup_steps, 2 * cfg.inverse_loss_frequency)
    total = warm + args.rounds * len(VARIANTS) * args.windows * per
    notes: dict[str, str] = {}
    training = build_training(wl, cfg, dev, ProbeSettings(samples=total * eff), notes, total)
    trainer, data = training.trainer, training.data

    accum = cfg.accum_steps
    assert accum is not None  # resolved

    def step() -> torch.Tensor:
        return trainer.step([data.next() for _ in range(accum)])

    try:
        t0 = time.perf_counter()
        for _ in range(warm):
            step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)  # sync: warm-up ends when its kernels have finished
        warmup_s = time.perf_counter() - t0
        gc.collect()
        gc.freeze()  # as the probe does before its timed windows
        clock, telemetry = Clock(dev), GpuTelemetry.open(dev)
        blocks = []
        for r in range(args.rounds):
            for variant in (VARIANTS[::-1] if r % 2 else VARIANTS):
                block = run_block(variant, args.windows, per, step, clock, telemetry)
                steps = args.windows * per
                blocks.append({"round": r, "variant": variant, "steps": steps, **block,
                               "rate": steps * eff / block["seconds"]})
                print(f"[round {r + 1}] {variant:8s} {blocks[-1]['rate']:8.0f} samples/s", flush=True)
    finally:
        gc.unfreeze()
        data.close()
    return {"config": config, "per": per, "windows": args.windows, "warmup_s": warmup_s,
            "samples_per_step": eff, "blocks": blocks, **summarize(blocks, eff)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", action="append", required=True, help="a config's knobs as JSON (repeatable)")
    p.add_argument("--preset", default="full")
    p.add_argument("--device", default="cuda")
    p.add_argument("--rounds", type=int, default=6, help="blocks per variant")
    p.add_argument("--windows", type=int, default=5, help="windows per block")
    p.add_argument("--per", type=int, help="steps per window (default: the short probe's, for --preset)")
    p.add_argument("--warmup-steps", type=int, default=16)
    p.add_argument("--out", required=True, help="JSON lines: the environment, then one line per config")
    args = p.parse_args(argv)
    out = Path(args.out)
    env = {"torch": torch.__version__, "device": args.device, "host_cpu": cpu_model(),
           "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    out.write_text(json.dumps({"environment": env}) + "\n")
    for text in args.config:
        result = measure(json.loads(text), args)
        with out.open("a") as f:
            f.write(json.dumps(result) + "\n")
        print("rate over one-window blocks: " + ", ".join(
            f"{v} {result['over_one'][v]:.3f} (paired {result['paired_over_one'][v]:.3f})" for v in result["over_one"]),
            flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
