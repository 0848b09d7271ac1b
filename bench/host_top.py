"""Which processes and threads use the host's CPUs while a command runs (Linux /proc).

    python bench/host_top.py --out top.jsonl [--interval 1] -- COMMAND ...

Runs COMMAND, and every `--interval` seconds reads every process's and every thread's CPU
ticks. Writes one JSON line per interval (``t`` seconds since the start, the host's busy
CPUs, and the processes and threads that used at least 0.05 CPU in it, each with its pid,
parent, name and where it stands to COMMAND: ``self``, ``descendant`` or ``other``), then a
last line ``{"summary": ...}`` with each process's CPU-seconds over the whole run. COMMAND's
stdout passes through, so ``autotune probe --json`` output can be piped on; the summary goes
to stderr. It answers questions such as "what else ran beside a probe's timed windows?"
(bench/README.md, probe fidelity). A process that starts and ends between two samples is
not seen, and one that ends loses its last interval's ticks: it sees the long-lived ones.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from autotune.compile_workers import process_stat
from autotune.host_telemetry import host_cpu_ticks

TICKS = os.sysconf("SC_CLK_TCK")
PROC = Path("/proc")


def host_ticks() -> tuple[int, int]:
    """(busy, total) ticks of all CPUs since boot (autotune.host_telemetry's reading of /proc/stat)."""
    ticks = host_cpu_ticks()
    if ticks is None:
        raise SystemExit("host_top.py needs Linux /proc/stat")
    busy, _steal, total = ticks
    return busy, total


def name_of(path: Path) -> str:
    try:
        return path.joinpath("comm").read_text().strip()
    except OSError:
        return "?"


def command_of(pid: str) -> str:
    try:
        raw = PROC.joinpath(pid, "cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").replace("\n", " ").strip()[:160]


def snapshot() -> tuple[dict[int, dict], dict[tuple[int, int], dict]]:
    """Every process (pid → ticks, parent, name) and every thread ((pid, tid) → ticks, name)."""
    procs: dict[int, dict] = {}
    threads: dict[tuple[int, int], dict] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        fields = process_stat(entry.name)
        if not fields:
            continue
        pid = int(entry.name)
        procs[pid] = {"ticks": int(fields[11]) + int(fields[12]), "ppid": int(fields[1]),
                      "name": name_of(entry)}
        try:
            tids = [t.name for t in entry.joinpath("task").iterdir()]
        except OSError:
            continue
        if len(tids) < 2:
            continue
        for tid in tids:
            stat = process_stat(f"{entry.name}/task/{tid}")
            if stat:
                threads[(pid, int(tid))] = {"ticks": int(stat[11]) + int(stat[12]),
                                            "name": name_of(entry / "task" / tid)}
    return procs, threads


def relation(pid: int, root: int, procs: dict[int, dict]) -> str:
    seen: set[int] = set()
    while pid and pid not in seen:
        if pid == root:
            return "self" if not seen else "descendant"
        seen.add(pid)
        pid = procs.get(pid, {}).get("ppid", 0)
    return "other"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON lines, one per interval")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --, e.g. -- python -m autotune.cli probe ...")
    if not PROC.joinpath("stat").exists():
        parser.error("needs Linux /proc")
    t0 = time.monotonic()
    child = subprocess.Popen(command)
    totals: dict[int, dict] = {}
    last_procs, last_threads = snapshot()
    last_host = host_ticks()
    ncpu = os.cpu_count() or 1
    with args.out.open("w") as out:
        while True:
            done = child.poll() is not None
            if not done:
                time.sleep(args.interval)
            procs, threads = snapshot()
            host = host_ticks()
            span = max(host[1] - last_host[1], 1)
            # total ticks over all CPUs in the interval: a process's share × ncpu is CPUs used
            rows = []
            for pid, p in procs.items():
                used = p["ticks"] - last_procs.get(pid, {"ticks": 0})["ticks"]  # a new process: all of it
                rel = relation(pid, child.pid, procs)
                total = totals.setdefault(pid, {"name": p["name"], "relation": rel, "cpu_s": 0.0,
                                                "command": command_of(str(pid))})
                total["cpu_s"] += used / TICKS
                if used * ncpu / span >= 0.05:
                    rows.append({"pid": pid, "ppid": p["ppid"], "name": p["name"], "relation": rel,
                                 "cpus": round(used * ncpu / span, 3)})
            thread_rows = []
            for key, th in threads.items():
                used = th["ticks"] - last_threads.get(key, {"ticks": 0})["ticks"]
                if used * ncpu / span >= 0.05 and relation(key[0], child.pid, procs) != "other":
                    thread_rows.append({"pid": key[0], "tid": key[1], "name": th["name"],
                                        "cpus": round(used * ncpu / span, 3)})
            out.write(json.dumps({
                "t": round(time.monotonic() - t0, 2),
                "host_busy_cpus": round((host[0] - last_host[0]) * ncpu / span, 3),
                "processes": sorted(rows, key=lambda r: -r["cpus"]),
                "threads": sorted(thread_rows, key=lambda r: -r["cpus"]),
            }) + "\n")
            out.flush()
            last_procs, last_threads, last_host = procs, threads, host
            if done:
                break
        busy = sorted(({"pid": pid, **v, "cpu_s": round(v["cpu_s"], 2)} for pid, v in totals.items()
                       if v["cpu_s"] >= 0.1), key=lambda r: -r["cpu_s"])
        out.write(json.dumps({"summary": busy, "wall_s": round(time.monotonic() - t0, 2)}) + "\n")
    for row in busy[:25]:
        print(f"{row['cpu_s']:8.2f} CPU-s  {row['relation']:10s} {row['pid']:7d} {row['name']:16s} "
              f"{row['command'][:90]}", file=sys.stderr)
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
