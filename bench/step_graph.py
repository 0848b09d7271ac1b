"""The step graph, paired: each config's probe with ``step_graph`` off and on, in one process.

For each --config (inline JSON knobs) this runs the probe as given (``step_graph: false``)
and then with ``step_graph: true`` (where the config names a CUDA-graph compile mode,
reduce-overhead or max-autotune, the graphed run uses compile ``default`` instead: the step
graph replaces those modes' graphs). One JSON line per probe: the knobs, the throughput,
validation quality, the failure if any and what the probe's notes say the knob did (on, with
the steps replayed, or inactive and why). The same seed and samples on both sides, so a
graph that trains as the eager step does shows the same validation NRMSE.

Usage (repository root; a GPU host, or --device cpu for a smoke run where the graph is inactive):
  python bench/step_graph.py --preset full --device cuda --samples 9600 \\
      --config '{"precision": "fp8", "compile": "none", "batch_size": 48}' --out F.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from autotune.contract.config import parse_config
from autotune.engine.probe import ProbeSettings, run_probe
from autotune.engine.step_graph import CUDA_GRAPH_COMPILE_MODES


def graphed(knobs: dict[str, Any]) -> dict[str, Any]:
    """`knobs` with the step graph on (and a compile mode it can run under)."""
    out = {**knobs, "step_graph": True}
    if out.get("compile") in CUDA_GRAPH_COMPILE_MODES:
        out["compile"] = "default"
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action="append", required=True, help="knobs as inline JSON; repeatable")
    parser.add_argument("--workload", default="ups")
    parser.add_argument("--preset", default="full")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--samples", type=int, help="the probe's samples (default: the preset's)")
    parser.add_argument("--out", type=Path, required=True, help="JSON lines, one per probe")
    args = parser.parse_args(argv)
    configs = []
    for text in args.config:
        try:
            knobs = json.loads(text)
            parse_config(knobs)
        except (json.JSONDecodeError, ValueError) as e:
            parser.error(f"--config {text!r}: {e}")
        configs.append({**knobs, "step_graph": False})
    settings = ProbeSettings(samples=args.samples) if args.samples else ProbeSettings()
    with args.out.open("w") as out:
        for knobs in configs:
            for side in (knobs, graphed(knobs)):
                r = run_probe(args.workload, side, preset=args.preset, device=args.device, settings=settings)
                row = {"workload": args.workload, "preset": args.preset, "knobs": side,
                       "throughput": r.throughput_samples_per_s, "val_nrmse": r.val_nrmse, "failure": r.failure,
                       "step_graph": r.knobs.get("step_graph"), "device": r.device}
                out.write(json.dumps(row) + "\n")
                out.flush()
                print(f"{json.dumps(side)}: {r.throughput_samples_per_s or 0:.0f} samples/s, NRMSE "
                      f"{r.val_nrmse if r.val_nrmse is None else round(r.val_nrmse, 4)}; step_graph "
                      f"{row['step_graph']}" + (f"; FAILED {r.failure['kind']}: {r.failure['message']}"
                                                 if r.failure else ""), flush=True)


if __name__ == "__main__":
    main()
