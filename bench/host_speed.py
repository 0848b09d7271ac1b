"""A speedometer for the host's CPU: how fast one thread runs, sampled over time.

A host-bound config runs at the speed of the host's single thread (bench/README.md, probe
fidelity), and on the lent hosts that speed seems to drift from minute to minute. This runs a
fixed piece of pure-Python work (--chunk iterations) every --every seconds on one CPU and
records when it ran and how long it took; `beside` then sets each probe of a fidelity run
beside the host's speed while it ran (the median sample over the probe's `started` to
`started + wall_s`, and over its second half, where a short probe's timed windows fall).
At about 5 ms of work every 100 ms it takes about a twentieth of one CPU.

Usage (repository root):
  python bench/host_speed.py sample --seconds 600 --cpu 15 --out SPEED.jsonl &   # beside a run
  python bench/host_speed.py beside --speed SPEED.jsonl --fidelity FIDELITY.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
    args = p.parse_args(argv)
    if args.step == "sample":
        sample(args)
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
