"""Does where the scheduler puts the training loop explain a host-bound config's spread?

A host-bound config's short probes differ by 13-24 % from process to process on one host
(bench/README.md, probe fidelity), and a process stays fast or slow for its whole life. One
candidate cause that lasts a process's life: the loop thread sharing a physical core (an SMT
sibling, or the same logical CPU) with busy DataLoader workers.

This runs short probes of one config (the studies' own length), alternating two variants:
  base      the scheduler places every thread as it likes (what a study does)
  isolated  the loop thread (the probe process's main thread) alone on one physical core: it
            gets one logical CPU, and every other thread of the process and its children (the
            DataLoader workers) is kept off that core and its SMT siblings (re-applied every
            sampling tick, so respawned workers follow)
While each probe runs, it samples every thread of the probe's process tree (/proc: state and
last CPU) and records per probe: how often the loop thread was runnable, how often it shared its
physical core with another runnable thread of the tree, how many CPUs it visited, and how often
it was on the CPU the isolated variant gives it (`loop_cpu`, `loop_on_loop_cpu`). These
cover the process's whole life (start-up, data, warm-up and the timed windows), not the timed
windows alone: the probe's own per-window readings (window_host) are the ones to read for those.

Usage, on a GPU host (repository on PYTHONPATH):
  python bench/cpu_placement.py --config JSON --rounds 3 --out OUT.jsonl
(--preset tiny --device cpu: a CPU smoke run)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TICK_S = 0.02


def siblings() -> dict[int, set[int]]:
    """Each logical CPU's SMT siblings (itself included)."""
    out: dict[int, set[int]] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        f = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        text = f.read_text().strip() if f.exists() else str(cpu)
        ids: set[int] = set()
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            ids.update(range(int(lo), int(hi or lo) + 1))
        out[cpu] = ids
    return out


def tree(pid: int) -> list[int]:
    """`pid` and its descendants."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            with contextlib.suppress(OSError):  # the task ended meanwhile
                todo.extend(int(c) for c in (task / "children").read_text().split())
    return found


def threads(pids: list[int]) -> list[tuple[int, int, str, int]]:
    """(pid, tid, state, last CPU) of every thread of `pids`."""
    rows = []
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                stat = (task / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            rows.append((pid, int(task.name), fields[0], int(fields[36])))
    return rows


def run_probe(config: str, variant: str, preset: str, device: str, sib: dict[int, set[int]]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "autotune.cli", "probe", "--preset", preset, "--device", device, "--config", config,
           "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    cpus = sorted(sib)
    loop_cpu = cpus[-1]  # the loop thread's own CPU, its core kept free of the other threads
    rest = set(cpus) - sib[loop_cpu]
    samples = runnable = shared = on_own = 0
    visited: set[int] = set()
    last = None
    migrations = 0
    while proc.poll() is None:
        rows = threads(tree(proc.pid))
        if variant == "isolated":
            for _, tid, _, _ in rows:
                with contextlib.suppress(OSError):  # the thread ended meanwhile
                    os.sched_setaffinity(tid, {loop_cpu} if tid == proc.pid else rest)
        main = next((r for r in rows if r[1] == proc.pid), None)
        if main is not None:
            samples += 1
            visited.add(main[3])
            on_own += main[3] == loop_cpu
            migrations += last is not None and main[3] != last
            last = main[3]
            if main[2] == "R":
                runnable += 1
                core = sib.get(main[3], {main[3]})
                shared += any(r[2] == "R" and r[3] in core for r in rows if r[1] != proc.pid)
        time.sleep(TICK_S)
    out, err = proc.communicate()
    if not out.strip():
        raise SystemExit(f"probe printed nothing (exit {proc.returncode}): {err[-2000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    return {"variant": variant, "throughput": result.get("throughput_samples_per_s"),
            "window_throughputs": result.get("window_throughputs"), "failure": result.get("failure"),
            "samples": samples, "loop_runnable": runnable / max(samples, 1),
            "loop_core_shared": shared / max(runnable, 1), "loop_cpus_visited": len(visited),
            "loop_migrations": migrations, "loop_cpu": loop_cpu, "loop_on_loop_cpu": on_own / max(samples, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="the config's knobs, inline JSON")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="full")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    sib = siblings()
    out = Path(args.out)
    with out.open("a") as f:
        f.write(json.dumps({"topology": {str(k): sorted(v) for k, v in sib.items()}}) + "\n")
    rows = []
    for r in range(args.rounds):
        for variant in ("base", "isolated"):
            row = {"round": r, **run_probe(args.config, variant, args.preset, args.device, sib)}
            rows.append(row)
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"[round {r + 1}] {variant}: {row['throughput'] or 0:.0f} samples/s, loop runnable "
                  f"{row['loop_runnable']:.0%}, its core shared {row['loop_core_shared']:.0%}, "
                  f"{row['loop_cpus_visited']} CPUs", flush=True)
    for variant in ("base", "isolated"):
        t = [r["throughput"] for r in rows if r["variant"] == variant and r["throughput"]]
        if t:
            median = statistics.median(t)
            print(f"{variant}: median {median:.0f}, spread {(max(t) - min(t)) / median:.1%}")


if __name__ == "__main__":
    main()
