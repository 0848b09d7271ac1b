"""Probe start: a probe child started cold against one forked by the worker's fork server.

Each run is one probe child, started exactly as `autotune worker` starts it
(`autotune.worker.child.ProbeProcess`, the worker's child environment): *cold* runs
``python -m autotune.engine.probe_child``, *warm* forks it from a `autotune.engine.fork_server.ForkServer`
that imported torch once. The modes alternate, so host drift falls on both. Per run:

  overhead_s   process start → first training step, compile excluded: the probe's own
               ``process_start_s + setup_s`` (a forked child's process starts at the fork);
  wall_s       spawn → the result line, as the worker waits for it;
  phases       the probe's ``setup_phases`` (where its setup time went).

The server's preload (its start → every module imported) is paid once per worker, while the
worker leases its first trial. Medians per mode, warm-up excluded (`--skip` first runs).

    python bench/probe_start.py --device cuda --preset full --samples 1920 --repeats 5 \\
        --out bench/results/probe_start_h100.json --png bench/results/probe_start_h100.png
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from studylib import environment, pyplot

from autotune.contract.protocol import ProbeSpec
from autotune.engine.fork_server import ForkedChild, ForkServer
from autotune.engine.probe_child import ChildJob
from autotune.worker.child import ProbeProcess
from autotune.worker.options import CHILD_MODULE, child_environment

MODES = ("cold", "warm")


def run_once(job: ChildJob, env: dict[str, str], server: ForkServer | None, timeout_s: float) -> dict[str, Any]:
    """One probe child, as the worker runs it; its timings."""
    started = time.perf_counter()
    child = ProbeProcess([sys.executable, "-m", CHILD_MODULE], job, env, server=server)
    forked = isinstance(child.proc, ForkedChild)
    result: dict[str, Any] | None = None
    try:
        deadline = started + timeout_s
        while True:
            kind, payload = child.events.get(timeout=max(0.1, deadline - time.perf_counter()))
            if kind == "result":
                result = payload
            if kind == "eof":
                break
    except queue.Empty:
        pass
    wall = time.perf_counter() - started
    child.finish()
    if result is None or result.get("failure"):
        raise SystemExit(f"the probe failed: {result and result.get('failure')}\n{child.stderr_tail()}")
    return {"forked": forked, "wall_s": round(wall, 3),
            "overhead_s": round((result.get("process_start_s") or 0.0) + result["setup_s"], 3),
            "process_start_s": result.get("process_start_s"), "setup_s": result["setup_s"],
            "phases": result.get("setup_phases") or {}, "throughput": result["throughput_samples_per_s"]}


def summarize(runs: list[dict[str, Any]], skip: int) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for mode in MODES:
        kept = [r for r in runs if r["mode"] == mode and r["repeat"] >= skip]
        summary[mode] = {key: round(statistics.median(r[key] for r in kept), 3) for key in ("overhead_s", "wall_s")}
        summary[mode]["runs"] = len(kept)
        phases = sorted({p for r in kept for p in r["phases"]})
        summary[mode]["phases"] = {p: round(statistics.median(r["phases"].get(p, 0.0) for r in kept), 3)
                                   for p in phases}
    summary["overhead_saved_s"] = round(summary["cold"]["overhead_s"] - summary["warm"]["overhead_s"], 3)
    summary["wall_saved_s"] = round(summary["cold"]["wall_s"] - summary["warm"]["wall_s"], 3)
    return summary


def plot(data: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    for i, mode in enumerate(MODES):
        runs = [r for r in data["runs"] if r["mode"] == mode and r["repeat"] >= data["skip"]]
        ax.scatter([r["overhead_s"] for r in runs], [i] * len(runs), label=mode, s=40)
        ax.axvline(data["summary"][mode]["overhead_s"], color=f"C{i}", linestyle=":", linewidth=1)
    ax.set_yticks(range(len(MODES)), [f"{m} start" for m in MODES])
    ax.set_xlabel("process start → first training step (s)")
    ax.set_xlim(left=0)
    ax.set_title(f"probe start, {data['env'].get('gpu', data['device'])}, {data['preset']} preset",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workload", default="ups")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--samples", type=int, default=80)
    parser.add_argument("--config", default="{}", help="the probed config, JSON (default: the workload's)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode (alternating)")
    parser.add_argument("--skip", type=int, default=1, help="first runs per mode left out of the medians")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per probe child")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=None, help="the results file (JSON)")
    parser.add_argument("--png", type=Path, default=None)
    parser.add_argument("--replot", type=Path, default=None, help="only draw --png from this results file")
    args = parser.parse_args()
    if args.replot:
        if not args.png:
            parser.error("--replot needs --png")
        plot(json.loads(args.replot.read_text()), args.png)
        return 0
    if args.out is None:
        parser.error("--out is required")
    if args.repeats <= args.skip:
        parser.error("--repeats must exceed --skip")
    env = child_environment(args.threads)
    job = ChildJob(workload=args.workload, preset=args.preset, config=json.loads(args.config), device=args.device,
                   probe=ProbeSpec(samples=args.samples, seed=0), threads=args.threads)
    began = time.perf_counter()
    server = ForkServer(env).start()
    try:
        if not server.wait_ready(args.timeout):  # the preload, paid once per worker
            raise SystemExit(f"the fork server did not get ready: {server.why_down() or 'too slow'}")
        preload_s = time.perf_counter() - began
        runs = []
        for repeat in range(args.repeats):
            for mode in MODES:
                run = run_once(job, env, server if mode == "warm" else None, args.timeout)
                if run["forked"] != (mode == "warm"):
                    raise SystemExit(f"a {mode} run was {'forked' if run['forked'] else 'started cold'}: "
                                     f"{server.down or 'the environment differs from the server'}")
                runs.append({"mode": mode, "repeat": repeat, **run})
                print(f"{mode:5s} #{repeat}: overhead {run['overhead_s']:.2f} s, wall {run['wall_s']:.2f} s",
                      flush=True)
    finally:
        server.close()
    data = {"device": args.device, "workload": args.workload, "preset": args.preset, "samples": args.samples,
            "config": json.loads(args.config), "threads": args.threads, "repeats": args.repeats, "skip": args.skip,
            "server_preload_s": round(preload_s, 3), "env": environment(args.device), "runs": runs}
    data["summary"] = summarize(runs, args.skip)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    s = data["summary"]
    print(f"median overhead: cold {s['cold']['overhead_s']:.2f} s, warm {s['warm']['overhead_s']:.2f} s "
          f"(saved {s['overhead_saved_s']:.2f} s a trial); server preload {preload_s:.2f} s once")
    if args.png:
        try:
            plot(data, args.png)
        except ImportError:  # a GPU host without matplotlib: draw it later with --replot
            print(f"matplotlib is not installed: no {args.png}; run with --replot {args.out} --png {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
