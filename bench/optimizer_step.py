"""The user's optimizer step on the GPU: the `ups` Muon + AdamW preset beside the AdamW one,
and a probe against the same config run through `autotune.apply` in a plain loop.

Two subcommands (repository root):

``loop``   a probe of one config (a fresh process, as a worker runs it), then the same config
           through ``autotune.apply`` in a plain training loop timed by wall clock (another
           fresh process), then the probe again; the probes' throughputs over the loop's, and
           every number. The loop is what a user writes: the workload's model on the device,
           its own optimizer(s) (`Workload.build_optimizers`: Muon + AdamW for ``full-muon``),
           a shuffling DataLoader (drop_last), ``autotune.apply`` with the workload's clipping
           and an LR schedule over the run's samples, then ``prepared.step`` batch after batch
           for --seconds of wall clock after --warmup-steps optimizer steps (compile, graph
           capture: excluded). Wall clock from a synchronize to a synchronize.

               python bench/optimizer_step.py loop --preset full-muon --device cuda \\
                   --config '{"precision": "bf16", ...}' --seconds 60 --out L.json

``table``  the README table (markdown) and a bar chart from `probe_configs.py` results of the
           two presets (bench/configs/optimizer_step.json) and the loop files:

               python bench/optimizer_step.py table --probes A.json B.json --loops L.json \\
                   --png results/optimizer_step_h100.png

The knob matrix itself is `probe_configs.py` over bench/configs/optimizer_step.json, once per
preset (bench/README.md, "The user's optimizer step").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from resultfiles import load
from studylib import run_cli

HERE = Path(__file__).resolve().parent


def probe_once(workload: str, preset: str, device: str, config: dict[str, Any], env: dict[str, str],
               samples: int | None, timeout: float) -> dict[str, Any]:
    """One probe in a process of its own, as a worker runs it (`autotune probe --json`, forked by
    studylib.run_cli); its result, or a failure record."""
    cmd = ["probe", "--json", "--workload", workload, "--preset", preset, "--device", device,
           "--config", json.dumps(config)]
    if samples:
        cmd += ["--samples", str(samples)]
    proc = run_cli(cmd, env=env, timeout=timeout)
    try:
        result: dict[str, Any] = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return {"failure": {"kind": "error", "message": proc.stderr[-2000:]}}
    return result


def loop_once(args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "_loop", "--workload", args.workload, "--preset",
           args.preset, "--device", args.device, "--config", args.config, "--seconds", str(args.seconds),
           "--warmup-steps", str(args.warmup_steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"failure": proc.stderr[-3000:]}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def plain_loop(workload: str, preset: str, device: str, config: dict[str, Any], seconds: float,
               warmup_steps: int) -> dict[str, Any]:
    """The user's loop with the config applied (the module docstring); throughput by wall clock."""
    import torch
    from torch.utils.data import DataLoader

    import autotune
    from autotune.contract.config import parse_config
    from autotune.contract.registry import get_workload

    wl = get_workload(workload, preset)
    cfg = parse_config(config).resolve(wl.defaults.batch_size, wl.defaults.accum_steps, wl.defaults.lr)
    dev = torch.device(device)
    train, _ = wl.datasets(0)
    torch.manual_seed(0)
    with dev:
        model = wl.build_model()
    optimizer = wl.build_optimizers(model, cfg)  # the job's own optimizer(s), as its script builds them
    loader = DataLoader(train, batch_size=cfg.batch_size or 1, shuffle=True, drop_last=True)
    budget = int(seconds * 20000)  # the schedule's length in samples: longer than the run, so the lr stays sane
    prepared = autotune.apply(cfg, model, optimizer=optimizer, train_loader=loader, device=dev,
                              grad_clip_norm=wl.grad_clip_norm, total_samples=budget, quiet=True)
    assert prepared.train_loader is not None
    accum = prepared.accum_steps

    def batches() -> Any:
        while True:  # epoch after epoch
            yield from prepared.train_loader  # type: ignore[union-attr]

    stream = batches()
    t0 = time.perf_counter()
    for _ in range(warmup_steps * accum):  # compile, CUDA-graph capture, allocator growth: not timed
        prepared.step(next(stream))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)  # sync: the warm-up's kernels are done before the clock starts
    warmup_s = time.perf_counter() - t0
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:  # host clock only inside: no sync per step
        for _ in range(accum):
            prepared.step(next(stream))
        steps += 1
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)  # sync: every launched step has finished
    elapsed = time.perf_counter() - start
    samples = steps * (cfg.batch_size or 1) * accum
    return {"throughput_samples_per_s": samples / elapsed, "seconds": elapsed, "steps": steps, "samples": samples,
            "warmup_s": warmup_s, "warmup_steps": warmup_steps, "notes": prepared.notes,
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__}


def cmd_loop(args: argparse.Namespace) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-"))  # shared: the first compiles cold
    config = json.loads(args.config)
    # the workload's data once, outside every timed run
    subprocess.run([sys.executable, "-c", f"from autotune.contract.registry import get_workload; "
                    f"get_workload({args.workload!r}, {args.preset!r}).datasets(0)"], check=True, env=env)
    runs: list[dict[str, Any]] = []
    for kind in ("probe", "loop", "probe"):  # mirrored: a drift of the host lands on both sides
        r = (probe_once(args.workload, args.preset, args.device, config, env, args.samples, args.timeout)
             if kind == "probe" else loop_once(args, env))
        r["kind"] = kind
        runs.append(r)
        print(f"{kind}: {r.get('throughput_samples_per_s') or r.get('failure')}", flush=True)
    probes = [r["throughput_samples_per_s"] for r in runs if r["kind"] == "probe" and r.get("throughput_samples_per_s")]
    loops = [r["throughput_samples_per_s"] for r in runs if r["kind"] == "loop" and r.get("throughput_samples_per_s")]
    doc = {"benchmark": "optimizer_step loop", "date": time.strftime("%Y-%m-%d"), "workload": args.workload,
           "preset": args.preset, "config": config, "seconds": args.seconds, "runs": runs,
           "probe_over_loop": statistics.mean(probes) / loops[0] if probes and loops else None}
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"probe / loop: {doc['probe_over_loop']}")


def _medians(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per config name: median throughput over its repeats, its NRMSE, and what the optimizer knobs did."""
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r["name"] for r in doc["runs"] if "name" in r):
        ok = [r for r in doc["runs"] if r.get("name") == name and r.get("throughput_samples_per_s")]
        failed = [r for r in doc["runs"] if r.get("name") == name and r.get("failure")]
        if ok:
            knobs = ok[0].get("knobs", {})
            out[name] = {"throughput": statistics.median(r["throughput_samples_per_s"] for r in ok),
                         "quality": statistics.median(r["quality"] for r in ok if r.get("quality") is not None),
                         "runs": len(ok), "step_graph": knobs.get("step_graph", ""),
                         "compile_optimizer": knobs.get("compile_optimizer", "")}
        elif failed:
            out[name] = {"failure": failed[0]["failure"]}
    return out


def cmd_table(args: argparse.Namespace) -> None:
    docs = [load(p) for p in args.probes]  # each whole (bench/resultfiles.py)
    table = {doc["preset"]: _medians(doc) for doc in docs}
    presets = list(table)
    names = list(dict.fromkeys(n for t in table.values() for n in t))
    base = {p: table[p].get(names[0], {}).get("throughput") for p in presets}
    lines = ["| config | " + " | ".join(f"{p}: samples/s (× baseline), NRMSE" for p in presets) + " |",
             "|---|" + "---|" * len(presets)]
    for name in names:
        cells = []
        for p in presets:
            row = table[p].get(name)
            if row is None:
                cells.append("")
            elif "failure" in row:
                cells.append(f"failed: {row['failure'].get('kind')}")
            else:
                ratio = f" ({row['throughput'] / base[p]:.1f}×)" if base[p] else ""
                graph = " (graph inactive)" if row["step_graph"].startswith("inactive") and "step_graph" in name else ""
                cells.append(f"{row['throughput']:,.0f}{ratio}, {row['quality']:.4f}{graph}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for path in args.loops or []:
        loop = load(path)
        probes = [r["throughput_samples_per_s"] for r in loop["runs"] if r["kind"] == "probe"
                  and r.get("throughput_samples_per_s")]
        loops = [r["throughput_samples_per_s"] for r in loop["runs"] if r["kind"] == "loop"
                 and r.get("throughput_samples_per_s")]
        if probes and loops:
            lines.append(f"\n{loop['preset']}, apply loop ({loop['seconds']:g} s wall clock): "
                         f"probes {', '.join(f'{p:,.0f}' for p in probes)} samples/s, loop {loops[0]:,.0f}: "
                         f"probe / loop {loop['probe_over_loop']:.3f}")
    print("\n".join(lines))
    if args.png:
        sys.path.insert(0, str(HERE))
        from studylib import pyplot

        plt = pyplot()
        fig, ax = plt.subplots(figsize=(10, 4.8))
        width = 0.8 / len(presets)
        for i, p in enumerate(presets):
            values = [table[p].get(n, {}).get("throughput") or 0 for n in names]
            ax.barh([y + i * width for y in range(len(names))], values, height=width, label=p)
        ax.set_yticks([y + width * (len(presets) - 1) / 2 for y in range(len(names))], names)
        ax.invert_yaxis()
        ax.set_xlabel("samples/s (median of a config's probes; 0 = failed)")
        ax.set_title(f"ups, {docs[0].get('device', '?')}, torch {docs[0].get('torch', '?')}: AdamW (full) and "
                     "Muon + AdamW (full-muon)", fontsize=10)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("loop", "_loop"):
        p = sub.add_parser(name)
        p.add_argument("--workload", default="ups")
        p.add_argument("--preset", default="full-muon")
        p.add_argument("--device", default="cuda")
        p.add_argument("--config", required=True, help="knobs as inline JSON")
        p.add_argument("--seconds", type=float, default=60.0, help="the loop's timed wall clock")
        p.add_argument("--warmup-steps", type=int, default=30, help="optimizer steps before the clock starts")
        p.add_argument("--samples", type=int, default=None, help="the probes' sample budget (default: the preset's)")
        p.add_argument("--timeout", type=float, default=600.0)
        p.add_argument("--out", type=Path, default=None)
    t = sub.add_parser("table")
    t.add_argument("--probes", nargs="+", required=True, help="probe_configs.py result files, one per preset")
    t.add_argument("--loops", nargs="*", default=None, help="`loop` result files")
    t.add_argument("--png", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.command == "_loop":
        print(json.dumps(plain_loop(args.workload, args.preset, args.device, json.loads(args.config), args.seconds,
                                    args.warmup_steps)))
    elif args.command == "loop":
        if args.out is None:
            parser.error("loop needs --out")
        cmd_loop(args)
    else:
        cmd_table(args)


if __name__ == "__main__":
    main()
