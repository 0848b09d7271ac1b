"""Summarise a `probe_configs.py` result file: a markdown table and a PNG.

    python bench/report_probe.py bench/results/probe_full_h100_final.json --png bench/results/probe_full_h100_final.png

Per config: median throughput over its repeats, run-to-run spread ((max-min)/median over
repeats), the within-run window spread of each repeat, speedup over the first config,
warm-up per repeat (first = cold compile cache, later = warm), NRMSE, peak memory, and the
fixed overhead (process start → training loop, compile excluded).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from resultfiles import load
from studylib import pyplot


def summarise(doc: dict) -> list[dict]:
    rows: dict[str, dict] = {}
    for r in doc["runs"]:
        row = rows.setdefault(r["name"], {"name": r["name"], "runs": []})
        row["runs"].append(r)
    out = []
    for row in rows.values():
        ok = [r for r in row["runs"] if r.get("throughput_samples_per_s")]
        failed = [r for r in row["runs"] if r.get("failure")]
        entry = {"name": row["name"], "n": len(ok), "failure": failed[0]["failure"] if failed and not ok else None}
        if ok:
            tps = [r["throughput_samples_per_s"] for r in ok]
            med = statistics.median(tps)
            entry.update(
                throughput=med,
                run_to_run=(max(tps) - min(tps)) / med if len(tps) > 1 else None,
                window_spread=[r["throughput_spread"] for r in ok],
                warmup=[r["warmup_s"] for r in ok],
                nrmse=[r["val_nrmse"] for r in ok],
                mem_gib=max(r["peak_mem_reserved_bytes"] for r in ok) / 2**30,
                overhead=[(r.get("process_start_s") or 0) + r["setup_s"] for r in ok],
                data_wait=statistics.median(r["data_wait_fraction"] for r in ok),
            )
        out.append(entry)
    return out


def markdown(rows: list[dict]) -> str:
    base = next((r["throughput"] for r in rows if r.get("throughput")), None)
    lines = ["| config | samples/s (median) | × first | run-to-run | window spread | warm-up s (cold → warm) "
             "| val NRMSE | peak reserved GiB | overhead s | data wait |",
             "|---|---:|---:|---:|---:|---|---|---:|---:|---:|"]
    for r in rows:
        if not r.get("throughput"):
            kind = r["failure"]["kind"] if r.get("failure") else "-"
            lines.append(f"| {r['name']} | failed: {kind} | | | | | | | | |")
            continue
        rr = "-" if r["run_to_run"] is None else f"{r['run_to_run']:.1%}"
        lines.append(
            f"| {r['name']} | {r['throughput']:,.0f} | {r['throughput'] / base:.1f} | {rr} | "
            f"{' / '.join(f'{s:.0%}' for s in r['window_spread'])} | "
            f"{' → '.join(f'{w:.1f}' for w in r['warmup'])} | "
            f"{' / '.join(f'{v:.3f}' for v in r['nrmse'])} | {r['mem_gib']:.2f} | "
            f"{' / '.join(f'{o:.1f}' for o in r['overhead'])} | {r['data_wait']:.1%} |")
    return "\n".join(lines)


def plot(rows: list[dict], doc: dict, path: Path) -> None:
    plt = pyplot()

    ok = [r for r in rows if r.get("throughput")]
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(ok) + 1.5))
    names = [r["name"] for r in ok]
    for i, r in enumerate(ok):
        runs = [x["throughput_samples_per_s"] for x in doc["runs"]
                if x["name"] == r["name"] and x.get("throughput_samples_per_s")]
        ax.barh(i, r["throughput"], color="#4c72b0")
        ax.plot(runs, [i] * len(runs), "k|", markersize=14)
    ax.set_yticks(range(len(ok)), names)
    ax.invert_yaxis()
    ax.set_xlabel("samples/s (bar: median of repeats; ticks: each repeat)")
    ax.set_title(f"ups/{doc['preset']} probes on {doc['device']} (torch {doc['torch']}, {doc['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path)
    p.add_argument("--png", type=Path, default=None)
    args = p.parse_args()
    doc = load(args.results)  # its raw fields too (bench/resultfiles.py)
    rows = summarise(doc)
    print(markdown(rows))
    if args.png:
        plot(rows, doc, args.png)


if __name__ == "__main__":
    main()
