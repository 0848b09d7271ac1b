"""Benchmark: probe a set of configurations, each several times, each in a process of its own.

Every probe runs as `python -m autotune.cli probe --json` in its own process, as a worker
runs it: forked from a fork server that imported torch once (studylib.run_cli;
AUTOTUNE_WARM_START=0: a fresh interpreter each), so CUDA context creation and compile are
all real. The
inductor cache directory is shared between the runs of this benchmark: the first run of
a compiled config is a cold compile, later runs of it hit the warm cache.

    python bench/probe_configs.py --preset full --device cuda --repeats 2 --out results.json

Writes one JSON document (environment + every ProbeResult) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from studylib import run_cli

# The configurations of the probe-engine issue, on the `full` preset. The data pipeline is
# the source research's starting point (8 workers, prefetch 4) in all of them.
DATA = {"num_workers": 8, "prefetch_factor": 4, "pin_memory": True, "persistent_workers": True}
DEFAULT_CONFIGS: dict[str, dict] = {
    "fp32-eager-12x4": {**DATA, "precision": "fp32", "compile": "none", "batch_size": 12, "accum_steps": 4},
    "bf16-compile-48x1-fused": {**DATA, "precision": "bf16", "compile": "default", "batch_size": 48,
                                "accum_steps": 1, "fused_optimizer": True},
    "bf16-reduce-overhead-48x1-fused": {**DATA, "precision": "bf16", "compile": "reduce-overhead",
                                        "batch_size": 48, "accum_steps": 1, "fused_optimizer": True},
    "bf16-compile-48x1-fused-ckpt-block": {**DATA, "precision": "bf16", "compile": "default", "batch_size": 48,
                                           "accum_steps": 1, "fused_optimizer": True, "checkpoint": "block"},
}


def run_one(config: dict, args: argparse.Namespace, env: dict[str, str]) -> dict:
    cmd = ["probe", "--json", "--workload", args.workload, "--preset", args.preset, "--device", args.device,
           "--config", json.dumps(config)]
    if args.samples:
        cmd += ["--samples", str(args.samples)]
    t0 = time.perf_counter()
    try:
        proc = run_cli(cmd, env=env, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"failure": {"kind": "timeout", "message": f"no result within {args.timeout} s"},
                "wall_s": time.perf_counter() - t0}
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"failure": {"kind": "error", "message": proc.stderr[-2000:]}, "wall_s": wall}
    result = json.loads(lines[-1])
    result["wall_s"] = wall
    if result.get("failure"):
        result["stderr_tail"] = proc.stderr[-2000:]
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="ups")
    p.add_argument("--preset", default="full")
    p.add_argument("--device", default="cuda")
    p.add_argument("--samples", type=int, default=None)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300.0, help="per probe, seconds")
    p.add_argument("--budget", type=float, default=540.0, help="stop starting probes after this many seconds")
    p.add_argument("--configs", type=str, default=None,
                   help="JSON {name: config} or @file.json; default: the issue's four")
    p.add_argument("--only", nargs="*", default=None, help="run only these config names")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()

    if args.configs and args.configs.startswith("@"):
        configs = json.loads(Path(args.configs[1:]).read_text())
    else:
        configs = json.loads(args.configs) if args.configs else DEFAULT_CONFIGS
    if args.only:
        configs = {k: v for k, v in configs.items() if k in args.only}
    env = dict(os.environ)
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-"))
    env["PYTHONUNBUFFERED"] = "1"

    # Generate the workload's data once, outside every timed probe (here: the probes read the cache it writes).
    from autotune.contract.registry import get_workload

    get_workload(args.workload, args.preset).datasets(0)

    import torch  # only for the environment record

    doc: dict = {
        "benchmark": "probe_configs",
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "workload": args.workload, "preset": args.preset, "repeats": args.repeats,
        "runs": [],
    }
    started = time.perf_counter()
    for name, config in configs.items():
        config = dict(config)
        repeats = config.pop("_repeats", args.repeats)  # a config may ask for its own repeat count
        for rep in range(repeats):
            if time.perf_counter() - started > args.budget:
                doc["runs"].append({"name": name, "repeat": rep, "skipped": "benchmark time budget spent"})
                continue
            r = run_one(config, args, env)
            r.update(name=name, repeat=rep)
            doc["runs"].append(r)
            tp, fail = r.get("throughput_samples_per_s"), r.get("failure")
            print(f"{name:40s} rep {rep}: {(f'{tp:.1f} samples/s') if tp else '-':>18s} "
                  f"warmup {r.get('warmup_s') or 0:6.1f} s  nrmse {r.get('val_nrmse') or float('nan'):.4f} "
                  f"spread {r.get('throughput_spread') or 0:.1%} {fail or ''}", flush=True)
            args.out.write_text(json.dumps(doc, indent=1))  # keep partial results
    print("\nsummary (median of repeats):")
    for name in configs:
        tps = [r["throughput_samples_per_s"] for r in doc["runs"]
               if r.get("name") == name and r.get("throughput_samples_per_s")]
        if tps:
            rr = (max(tps) - min(tps)) / statistics.median(tps)
            print(f"  {name:40s} {statistics.median(tps):9.1f} samples/s  run-to-run {rr:.1%}")
    args.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
