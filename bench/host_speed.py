"""A speedometer for the host's CPU: how fast one thread runs, sampled over time.

A host-bound config runs at the speed of the host's single thread (bench/README.md, probe
fidelity), and on the lent hosts that speed seems to drift from minute to minute. This runs a
fixed piece of pure-Python work (--chunk iterations) every --every seconds on one CPU and
records when it ran and how long it took; `beside` then sets each probe of a fidelity run
beside the host's speed while it ran (the median sample over the probe's `started` to
`started + wall_s`, and over its second half, where a short probe's timed windows fall).
At about 5 ms of work every 100 ms it takes about a twentieth of one CPU.

Two more ask where and when the host is slow:
  map      the same work on every CPU in turn, sweep after sweep: is one CPU slower than
           the others (a busy neighbour on its physical core), or the whole host at times?
  scaling  the work on one CPU while 0, 1, 3, 7, ... other CPUs spin (this process's own
           load): does one thread slow down as more of the host's cores get busy (clocks
           that fall with the number of active cores)?

Usage (repository root):
  python bench/host_speed.py sample --seconds 600 --cpu 15 --out SPEED.jsonl &   # beside a run
  python bench/host_speed.py beside --speed SPEED.jsonl --fidelity FIDELITY.json
  python bench/host_speed.py map --seconds 60 --out MAP.jsonl
  python bench/host_speed.py scaling --hold 3 --rounds 3 --out SCALING.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def chunk(n: int) -> float:
    """Seconds one thread takes for `n` iterations of fixed integer work."""
    t0 = time.perf_counter()
    x = 0
    for i in range(n):
        x = (x + i * i) % 1_000_003
    return time.perf_counter() - t0


def beside(samples: list[dict[str, float]], doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Each probe of a fidelity run (`doc`: its priming probes, then each pair's sides) with the
    median sample's seconds over the probe's span and over its second half (None: no sample)."""
    def median_s(t0: float, t1: float) -> float | None:
        inside = [x["s"] for x in samples if t0 <= x["t"] <= t1]
        return statistics.median(inside) if inside else None

    probes = [("prime", None, p["probe"]) for p in doc.get("prime", [])]
    probes += [(side, c["round"], c[side]) for c in doc["configs"] for side in ("short", "long", "fine") if side in c]
    rows = []
    for side, rnd, probe in probes:
        t0, wall = probe["started"], probe["wall_s"]
        rows.append({"side": side, "round": rnd, "throughput": probe["throughput_samples_per_s"],
                     "chunk_s": median_s(t0, t0 + wall), "second_half_chunk_s": median_s(t0 + wall / 2, t0 + wall)})
    return rows


def sample(args: argparse.Namespace) -> None:
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    end = time.time() + args.seconds
    with Path(args.out).open("w") as f:
        while time.time() < end:
            t = time.time()
            f.write(json.dumps({"t": t, "s": chunk(args.chunk)}) + "\n")
            f.flush()
            time.sleep(max(0.0, args.every - (time.time() - t)))


def cpu_map(args: argparse.Namespace) -> None:
    """Each allowed CPU in turn, `--chunk` iterations on each, a sweep every `--every` s."""
    cpus = sorted(os.sched_getaffinity(0))
    end, sweep = time.time() + args.seconds, 0
    rows: list[dict[str, float]] = []
    with Path(args.out).open("w") as f:
        while time.time() < end:
            t = time.time()
            for cpu in cpus:
                os.sched_setaffinity(0, {cpu})
                chunk(args.chunk // 10)  # settle on the CPU (its caches) before the timed piece
                row = {"t": time.time(), "sweep": sweep, "cpu": cpu, "s": chunk(args.chunk)}
                rows.append(row)
                f.write(json.dumps(row) + "\n")
            f.flush()
            sweep += 1
            time.sleep(max(0.0, args.every - (time.time() - t)))
    os.sched_setaffinity(0, set(cpus))
    print(map_summary(rows))


def map_summary(rows: list[dict[str, float]]) -> str:
    """Per CPU: the median piece and its 10th-90th percentiles (ms), then per sweep the
    fastest and slowest CPU's piece: which of the two spreads dominates tells CPU from time."""
    def pct(xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    lines = ["cpu  median ms  p10   p90"]
    for cpu in sorted({int(r["cpu"]) for r in rows}):
        ms = [r["s"] * 1e3 for r in rows if r["cpu"] == cpu]
        lines.append(f"{cpu:3d}  {statistics.median(ms):9.3f}  {pct(ms, 0.1):.3f} {pct(ms, 0.9):.3f}")
    sweeps: dict[int, list[float]] = {}
    for r in rows:
        sweeps.setdefault(int(r["sweep"]), []).append(r["s"] * 1e3)
    within = [max(v) / min(v) for v in sweeps.values() if len(v) > 1]
    medians = [statistics.median(v) for v in sweeps.values()]
    if within:
        lines.append(f"{len(sweeps)} sweeps: slowest/fastest CPU within a sweep, median "
                     f"{statistics.median(within):.3f}; sweep medians {min(medians):.3f}-{max(medians):.3f} ms "
                     f"(slowest/fastest "
                     f"{max(medians) / min(medians):.3f})")
    return "\n".join(lines)


SPIN = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass"


def scaling(args: argparse.Namespace) -> None:
    """The piece on `--cpu` while k-1 other CPUs spin, k from `--levels`, `--rounds` times,
    the levels mirrored every other round."""
    cpus = sorted(os.sched_getaffinity(0))
    others = [c for c in cpus if c != args.cpu]
    levels = [k for k in (int(x) for x in args.levels.split(",")) if 1 <= k <= len(cpus)]
    os.sched_setaffinity(0, {args.cpu})
    results: dict[int, list[float]] = {}
    with Path(args.out).open("w") as f:
        for rnd in range(args.rounds):
            for k in levels if rnd % 2 == 0 else levels[::-1]:
                spinners = [subprocess.Popen([sys.executable, "-c", SPIN, str(c)]) for c in others[:k - 1]]
                try:
                    time.sleep(0.3)  # let them start spinning
                    end, pieces = time.time() + args.hold, []
                    while time.time() < end:
                        pieces.append(chunk(args.chunk))
                        time.sleep(0.01)
                finally:
                    for p in spinners:
                        p.kill()
                    for p in spinners:
                        p.wait()
                row = {"round": rnd, "busy_cpus": k, "median_s": statistics.median(pieces), "pieces": len(pieces)}
                results.setdefault(k, []).append(row["median_s"])
                f.write(json.dumps(row) + "\n")
                f.flush()
    base = statistics.median(results[levels[0]])
    for k in levels:
        m = statistics.median(results[k])
        print(f"{k:3d} busy CPUs: median piece {m * 1e3:.3f} ms ({m / base:.3f} of {levels[0]})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="step", required=True)
    s = sub.add_parser("sample", help="sample the host's single-thread speed")
    s.add_argument("--seconds", type=float, required=True, help="how long to sample")
    s.add_argument("--every", type=float, default=0.1, help="seconds between samples")
    s.add_argument("--chunk", type=int, default=50_000, help="iterations per sample (about 4-6 ms on the lent hosts)")
    s.add_argument("--cpu", type=int, help="pin to this CPU (default: where the scheduler puts it)")
    s.add_argument("--out", required=True, help="JSON lines: one per sample, {t: epoch seconds, s: seconds}")
    b = sub.add_parser("beside", help="each probe of a fidelity run beside the host's speed while it ran")
    b.add_argument("--speed", required=True, help="the samples (sample --out)")
    b.add_argument("--fidelity", required=True, help="a tuning.py fidelity run's JSON, from the same host")
    m = sub.add_parser("map", help="every CPU in turn, sweep after sweep")
    m.add_argument("--seconds", type=float, required=True, help="how long to sweep")
    m.add_argument("--every", type=float, default=0.25, help="seconds between sweeps")
    m.add_argument("--chunk", type=int, default=20_000, help="iterations per CPU per sweep")
    m.add_argument("--out", required=True, help="JSON lines: one per piece, {t, sweep, cpu, s}")
    c = sub.add_parser("scaling", help="one CPU's speed as more CPUs spin")
    c.add_argument("--cpu", type=int, default=0, help="the CPU that is timed")
    c.add_argument("--levels", default="1,2,4,8,12,16", help="busy CPUs, the timed one included")
    c.add_argument("--hold", type=float, default=3.0, help="seconds at each level")
    c.add_argument("--rounds", type=int, default=3)
    c.add_argument("--chunk", type=int, default=20_000, help="iterations per piece")
    c.add_argument("--out", required=True, help="JSON lines: one per level and round")
    args = p.parse_args(argv)
    if args.step == "sample":
        sample(args)
        return 0
    if args.step == "map":
        cpu_map(args)
        return 0
    if args.step == "scaling":
        scaling(args)
        return 0
    samples = [json.loads(line) for line in Path(args.speed).read_text().splitlines() if line.strip()]
    for row in beside(samples, json.loads(Path(args.fidelity).read_text())):
        ms = {k: "-" if row[k] is None else f"{row[k] * 1e3:.2f} ms" for k in ("chunk_s", "second_half_chunk_s")}
        print(f"{row['side']:6s} round {row['round'] if row['round'] is not None else '-'}: "
              f"{row['throughput'] or 0:8.0f} samples/s; host chunk {ms['chunk_s']} (second half "
              f"{ms['second_half_chunk_s']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
