"""Benchmark: GPU energy per training sample, as the probe measures it, and a study that minimizes it.

Four steps; the first three need a GPU (one ≤ 10-minute command each, or two together), the
last reads their files anywhere:

1. ``counter``: what NVML's readings are worth over a probe's windows. Under a steady bf16
   matrix-product load (and idle before it) a thread polls the total-energy counter
   (``nvmlDeviceGetTotalEnergyConsumption``) and the power reading (``nvmlDeviceGetPowerUsage``)
   every millisecond: how often each one changes, and how far the counter's energy and the
   integrated power readings (the probe's two methods) differ over windows of 0.1–3 s.
2. ``probes``: the ``ups`` full preset's baseline (the study default on a GPU host: the preset's
   fp32 eager 12 × 4 with the research's data pipeline, 8 workers, prefetch 4) and the fast
   stack the h100 space starts from (`autotune.contract.starting.auto_points`: step graph, bf16, fused
   and compiled AdamW, 48 × 1, ...), each probed ``--repeats`` times in a fresh process
   (`probe_configs.run_one`, as a worker runs it): throughput and energy per sample.
3. ``study``: the real service (SQLite) and one real worker on the GPU, a short study with
   objectives [energy, quality] (``--objectives``) on the h100 space (baseline seeds, search, re-measurement of the
   top configs with the baseline), then its trials, front, recommendation (JSON and YAML) and
   what Optuna holds (directions, metric names, values: the dashboard's view).
4. ``analyze``: one JSON document of the three and a PNG (energy per sample against throughput).

    python bench/energy.py counter --out /tmp/energy/counter.json
    python bench/energy.py probes  --out /tmp/energy/probes.json --repeats 2
    python bench/energy.py study   --dir /tmp/energy/study --budget-s 515
    python bench/energy.py study   --dir /tmp/energy/study3 --budget-s 530 --n-trials 4 --top-k 1 \\
        --objectives throughput quality energy
    python bench/energy.py analyze --counter /tmp/energy/counter.json --probes /tmp/energy/probes.json \\
        --study /tmp/energy/study /tmp/energy/study3 --out bench/results/energy_h100.json \\
        --png bench/results/energy_h100.png
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from studylib import environment, free_port, hardware_class, pyplot, wait_healthy

CLI = [sys.executable, "-m", "autotune.cli"]
STUDY = "energy-bench"
BASELINE = {"num_workers": 8, "prefetch_factor": 4}  # StudySpec.baseline_config() on a GPU host
WINDOWS_S = (0.1, 0.3, 1.0, 3.0)


def fast_stack(preset: str = "full") -> dict[str, Any]:
    """The first starting point of the h100 space for the baseline (its effective config)."""
    from autotune.contract.registry import get_workload
    from autotune.contract.space import load_space
    from autotune.contract.starting import auto_points

    d = get_workload("ups", preset).defaults
    effective = {**BASELINE, "batch_size": d.batch_size, "accum_steps": d.accum_steps}
    return auto_points(load_space("h100"), effective)[0]


# --- 1. the counter ------------------------------------------------------------------------------


def _poll(telemetry: Any, stop: threading.Event, rows: list[tuple[float, int | None, float | None]]) -> None:
    while not stop.is_set():
        rows.append((time.monotonic(), telemetry.energy_mj(), telemetry.power_w()))
        time.sleep(0.001)


def _changes(rows: list[tuple[float, Any]]) -> list[float]:
    """Intervals (s) between the times a reading changed value."""
    times = [t for (t, v), (_, prev) in zip(rows[1:], rows[:-1], strict=True) if v != prev]
    return [b - a for a, b in itertools.pairwise(times)]


def _quantiles(values: list[float]) -> dict[str, float] | None:
    if len(values) < 2:
        return None
    q = statistics.quantiles(values, n=10)
    return {"median": statistics.median(values), "p10": q[0], "p90": q[-1], "n": len(values)}


def counter(args: argparse.Namespace) -> None:
    import torch

    from autotune.engine.gpu_telemetry import GpuTelemetry, counter_joules, power_integral_joules

    dev = torch.device("cuda")
    telemetry = GpuTelemetry.open(dev)
    if telemetry is None:
        raise SystemExit("no NVML telemetry on this device")
    rows: list[tuple[float, int | None, float | None]] = []
    stop = threading.Event()
    poller = threading.Thread(target=_poll, args=(telemetry, stop, rows), daemon=True)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    poller.start()
    time.sleep(args.idle_s)
    load_start = time.monotonic()
    products = 0
    while time.monotonic() - load_start < args.seconds:
        for _ in range(20):
            torch.mm(a, b)  # the load
        products += 20
        torch.cuda.synchronize()
    load_end = time.monotonic()
    time.sleep(0.5)
    stop.set()
    poller.join()
    energy_rows = [(t, e) for t, e, _ in rows if e is not None]
    power_rows = [(t, p) for t, _, p in rows if p is not None]
    idle = [p for t, p in power_rows if t < load_start]
    windows: dict[str, Any] = {}
    for length in WINDOWS_S:
        diffs, by_counter = [], []
        start = load_start + 0.5  # past the clocks' ramp
        while start + length <= load_end:
            end = start + length
            first = next((e for t, e in energy_rows if t >= start), None)
            last = next((e for t, e in energy_rows if t >= end), None)
            joules = counter_joules(first, last)
            integral = power_integral_joules([(t, p) for t, p in power_rows if start - 1 <= t <= end + 1], start, end)
            if joules and integral:
                diffs.append(integral / joules - 1)
                by_counter.append(joules / length)
            start = end
        windows[f"{length:g}"] = {"windows": len(diffs),
                                  "power_integral_over_counter_minus_1": _quantiles(diffs),
                                  "counter_watts": _quantiles(by_counter)}
    total = counter_joules(next((e for t, e in energy_rows if t >= load_start), None),
                           next((e for t, e in energy_rows if t >= load_end), None))
    doc = {"benchmark": "energy.counter", "environment": environment("cuda"), "polls": len(rows),
           "poll_interval_s": (rows[-1][0] - rows[0][0]) / max(1, len(rows) - 1),
           "energy_counter": energy_rows[0][1] is not None if energy_rows else False,
           "counter_update_interval_s": _quantiles(_changes(energy_rows)),
           "power_update_interval_s": _quantiles(_changes(power_rows)),
           "idle_w": statistics.median(idle) if idle else None,
           "load": {"seconds": load_end - load_start, "products": products,
                    "tflops": products * 2 * 8192**3 / (load_end - load_start) / 1e12,
                    "counter_joules": total, "counter_watts": total / (load_end - load_start) if total else None},
           "windows": windows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps({k: v for k, v in doc.items() if k != "environment"}, indent=1))


# --- 2. probes -----------------------------------------------------------------------------------


def probes(args: argparse.Namespace) -> None:
    from probe_configs import run_one

    configs = {"baseline": dict(BASELINE), "fast-stack": fast_stack(args.preset)}
    env = dict(os.environ)
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-"))
    env["PYTHONUNBUFFERED"] = "1"
    subprocess.run([sys.executable, "-c", f"from autotune.contract.registry import get_workload; "
                    f"get_workload('ups', {args.preset!r}).datasets(0)"], check=True, env=env)
    probe_args = argparse.Namespace(workload="ups", preset=args.preset, device="cuda", samples=None,
                                    timeout=args.timeout)
    doc: dict[str, Any] = {"benchmark": "energy.probes", "environment": environment("cuda"), "preset": args.preset,
                           "configs": configs, "runs": []}
    for rep in range(args.repeats):  # interleaved: a host that drifts favours neither
        for name, config in configs.items():
            r = run_one(config, probe_args, env)
            r.update(name=name, repeat=rep)
            doc["runs"].append(r)
            print(f"{name:12s} rep {rep}: {r.get('throughput_samples_per_s') or 0:9.1f} samples/s  "
                  f"{r.get('energy_j_per_sample') or float('nan'):.4f} J/sample ({r.get('energy_method')})  "
                  f"nrmse {r.get('quality') or float('nan'):.4f}  {r.get('failure') or ''}", flush=True)
            Path(args.out).write_text(json.dumps(doc, indent=1))


# --- 3. a study ----------------------------------------------------------------------------------


def study_spec(hardware: str, args: argparse.Namespace) -> dict[str, Any]:
    return {"name": STUDY, "workload": "ups", "preset": args.preset, "space": "h100", "hardware": hardware,
            "objectives": args.objectives, "n_trials": args.n_trials, "sampler": "tpe", "seed": args.seed,
            "probe": {"samples": args.samples, "timeout_s": 240}, "baseline_seeds": args.baseline_seeds,
            "remeasure": {"top_k": args.top_k, "rounds": 1, "samples_factor": 2.0, "windows": 8}}


def study(args: argparse.Namespace) -> None:
    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    db = out / "study.db"
    port = free_port()
    api = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "AUTOTUNE_AUTH": "false"}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(subprocess.Popen([*CLI, "serve", "--db", f"sqlite:///{db}", "--port", str(port)],
                                      stdout=(out / "service.log").open("wb"), stderr=subprocess.STDOUT, env=env))
        http = httpx.Client(base_url=api, timeout=30)
        wait_healthy(http, procs[0])
        refused = http.post("/v1/studies", json={**study_spec("cpu", args), "name": "energy-on-cpu"})
        spec = study_spec(hardware_class("cuda"), args)
        created = http.post("/v1/studies", json=spec)
        if created.status_code != 201:
            raise SystemExit(f"study refused: {created.text}")
        started = time.time()
        procs.append(subprocess.Popen([*CLI, "worker", "--api", api, "--device", "cuda", "--study", STUDY,
                                       "--idle-exit", "15"],
                                      stdout=(out / "worker.log").open("wb"), stderr=subprocess.STDOUT, env=env))
        info: dict[str, Any] = {}
        while time.time() - started < args.budget_s:
            time.sleep(5)
            info = http.get(f"/v1/studies/{STUDY}").json()
            print(f"[{time.time() - started:5.0f} s] {info['state']} {info['counts']}", flush=True)
            if info["state"] == "finished" or procs[-1].poll() is not None:
                break
        wall = time.time() - started
        if info.get("state") != "finished":
            http.delete(f"/v1/studies/{STUDY}")
        procs[-1].wait(timeout=120)
        best = http.get(f"/v1/studies/{STUDY}/best")
        doc = {"environment": environment("cuda"), "spec": spec, "wall_s": wall,
               "cpu_refusal": {"status": refused.status_code, "body": refused.json()},
               "study": http.get(f"/v1/studies/{STUDY}").json(),
               "trials": http.get(f"/v1/studies/{STUDY}/trials").json()["data"],
               "pareto": http.get(f"/v1/studies/{STUDY}/pareto").json()["data"],
               "best": best.json(), "best_status": best.status_code,
               "best_yaml": http.get(f"/v1/studies/{STUDY}/best", params={"format": "yaml"}).text,
               "optuna": optuna_view(db)}
        (out / "study.json").write_text(json.dumps(doc, indent=1))
        print(f"{len(doc['trials'])} trials in {wall:.0f} s; {doc['study']['counts']}; best: {best.status_code}")
        print(doc["best_yaml"])
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()


def optuna_view(db: Path) -> dict[str, Any]:
    """What the Optuna dashboard reads: directions, metric names, each trial's values, its best trials."""
    import optuna

    st = optuna.load_study(study_name=STUDY, storage=f"sqlite:///{db}")
    return {"directions": [d.name for d in st.directions], "metric_names": st.metric_names,
            "values": {t.number: t.values for t in st.trials},
            "best_trials": [t.number for t in st.best_trials]}


# --- 4. analysis ---------------------------------------------------------------------------------


def _summary(runs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    ok = [r for r in runs if r.get("name") == name and not r.get("failure") and r.get("throughput_samples_per_s")]
    energy = [r["energy_j_per_sample"] for r in ok if r.get("energy_j_per_sample") is not None]
    watts = [r["energy_j_per_sample"] * r["throughput_samples_per_s"] for r in ok
             if r.get("energy_j_per_sample") is not None]
    spread = [(max(w) - min(w)) / statistics.fmean(w) for r in ok if len(w := r.get("window_energy_j_per_sample")
                                                                              or []) >= 2]
    return {"runs": len(ok), "throughput": [r["throughput_samples_per_s"] for r in ok], "energy_j_per_sample": energy,
            "mean_watts": watts, "window_energy_spread": spread, "methods": sorted({str(r.get("energy_method"))
                                                                                   for r in ok}),
            "quality": [r.get("quality") for r in ok]}


def analyze(args: argparse.Namespace) -> None:
    doc: dict[str, Any] = {"benchmark": "energy", "date": time.strftime("%Y-%m-%d")}
    if args.counter:
        doc["counter"] = json.loads(Path(args.counter).read_text())
    if args.probes:
        probes_doc = json.loads(Path(args.probes).read_text())
        doc["probes"] = probes_doc
        summary = {name: _summary(probes_doc["runs"], name) for name in probes_doc["configs"]}
        base, fast = summary.get("baseline"), summary.get("fast-stack")
        if base and fast and base["energy_j_per_sample"] and fast["energy_j_per_sample"]:
            summary["fast_over_baseline"] = {
                "throughput": statistics.fmean(fast["throughput"]) / statistics.fmean(base["throughput"]),
                "energy_j_per_sample": (statistics.fmean(fast["energy_j_per_sample"])
                                        / statistics.fmean(base["energy_j_per_sample"]))}
        doc["probe_summary"] = summary
    studies = [json.loads((Path(d) / "study.json").read_text()) for d in args.study or []]
    for study_doc in studies:  # what each study recommended, in a line
        best = study_doc.get("best") or {}
        study_doc["summary"] = {
            "objectives": study_doc["spec"]["objectives"], "state": study_doc["study"]["state"],
            "counts": study_doc["study"]["counts"], "wall_s": study_doc["wall_s"],
            **{k: best.get(k) for k in ("trial_number", "chosen_by", "throughput_samples_per_s",
                                        "baseline_throughput_samples_per_s", "speedup", "speedup_ci_low",
                                        "speedup_ci_high", "energy_j_per_sample", "baseline_energy_j_per_sample",
                                        "energy_ratio", "energy_ratio_ci_low", "energy_ratio_ci_high",
                                        "energy_verdict", "baseline_remeasured", "caveats")},
            "front": [t["number"] for t in study_doc["pareto"]],
            "optuna_best_trials": study_doc["optuna"]["best_trials"]}
    doc["studies"] = studies
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps({"probes": doc.get("probe_summary"), "studies": [s["summary"] for s in studies]}, indent=1))
    if args.png:
        _plot(doc, Path(args.png))


def _plot(doc: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5))
    probe_styles: tuple[tuple[str, dict[str, Any]], ...] = (
        ("baseline", {"marker": "*", "s": 220, "c": "#264653"}),
        ("fast-stack", {"marker": "D", "s": 80, "c": "#6a4c93"}))
    for name, style in probe_styles:
        runs = [r for r in doc.get("probes", {}).get("runs", []) if r.get("name") == name
                and r.get("energy_j_per_sample") is not None]
        if runs:
            ax.scatter([r["throughput_samples_per_s"] for r in runs], [r["energy_j_per_sample"] for r in runs],
                       label=f"probe: {name} ({len(runs)} runs)", zorder=5, **style)
    studies = doc.get("studies") or [{}]
    trials = [t for s in studies for t in s.get("trials", [])]
    trial_styles: tuple[tuple[str, bool | None, dict[str, Any], str], ...] = (
        ("search", True, {"c": "#2a9d8f", "marker": "o"}, "study: feasible search trial"),
        ("search", False, {"c": "#e76f51", "marker": "x"}, "study: infeasible search trial"),
        ("baseline", None, {"c": "#264653", "marker": "+", "s": 90}, "study: baseline seed"),
        ("remeasure", None, {"c": "#e9c46a", "marker": "s"}, "study: re-measurement"))
    for role, feasible, style, label in trial_styles:
        pts = [t for t in trials if t["role"] == role and t.get("energy_j_per_sample") is not None
               and t.get("throughput_samples_per_s") and t["state"] == "COMPLETE"
               and (feasible is None or t.get("feasible") is feasible)]
        if pts:
            ax.scatter([t["throughput_samples_per_s"] for t in pts], [t["energy_j_per_sample"] for t in pts],
                       label=label, **style)
    for s in studies:
        best = s.get("best") or {}
        if best.get("energy_j_per_sample") is not None:
            ax.scatter([best["throughput_samples_per_s"]], [best["energy_j_per_sample"]], marker="o", s=260,
                       facecolors="none", edgecolors="k", zorder=6,
                       label=f"pick of [{', '.join(s['spec']['objectives'])}] (re-measured)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    from matplotlib.ticker import FuncFormatter

    def tick(value: float, _: int) -> str:  # 1, 2 and 5 of each decade, plainly
        return f"{value:g}" if f"{value:.0e}"[0] in "125" else ""

    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(FuncFormatter(tick))
        axis.set_minor_formatter(FuncFormatter(tick))
    ax.set_xlabel("throughput (samples/s)")
    ax.set_ylabel("GPU energy per training sample (J)")
    env = (doc.get("probes") or studies[0]).get("environment", {})
    ax.set_title(f"ups full: energy against speed ({env.get('gpu', '?')}, torch {env.get('torch', '?')})",
                 fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("counter")
    c.add_argument("--out", required=True)
    c.add_argument("--seconds", type=float, default=8.0)
    c.add_argument("--idle-s", type=float, default=2.0)
    pr = sub.add_parser("probes")
    pr.add_argument("--out", required=True)
    pr.add_argument("--preset", default="full")
    pr.add_argument("--repeats", type=int, default=2)
    pr.add_argument("--timeout", type=float, default=300.0)
    s = sub.add_parser("study")
    s.add_argument("--dir", required=True)
    s.add_argument("--preset", default="full")
    s.add_argument("--budget-s", type=float, default=515.0, help="then the study is stopped (DELETE)")
    s.add_argument("--n-trials", type=int, default=5, help="baseline seeds + search trials")
    s.add_argument("--baseline-seeds", type=int, default=2)
    s.add_argument("--samples", type=int, default=9600)
    s.add_argument("--top-k", type=int, default=2)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--objectives", nargs="+", default=["energy", "quality"])
    a = sub.add_parser("analyze")
    a.add_argument("--counter")
    a.add_argument("--probes")
    a.add_argument("--study", nargs="*", help="study directories (each holding study.json)")
    a.add_argument("--out", required=True)
    a.add_argument("--png")
    args = p.parse_args()
    commands: dict[str, Callable[[argparse.Namespace], None]] = {"counter": counter, "probes": probes, "study": study,
                                                                 "analyze": analyze}
    commands[args.command](args)


if __name__ == "__main__":
    main()
