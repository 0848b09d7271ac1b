"""Benchmark: what pruning saves on a real study, and whether it ever pruned a winner.

Three steps, each small enough for one ≤ 10-minute GPU command (the study's database and
trial list travel between them as files):

1. ``study``: starts the real service (SQLite file) and one real worker on the GPU, submits a
   study of the ``ups`` full preset on the ``h100`` space with pruning on (the defaults:
   ρ = 0.5, loss margin 0.5, after 30 % of the samples), lets it run for ``--budget-s``
   seconds, stops it, and writes every trial (``trials.json``) next to the database.
2. ``rerun``: runs every pruned trial's configuration to completion with ``autotune probe``
   in a fresh process, with the study's probe settings (samples, seed, windows), as the
   worker would have, and records its result and wall time (``rerun.json``).
3. ``analyze``: GPU time the study spent, GPU time the pruned trials would have cost had
   they run to the end (their re-run wall time) and so the time saved; and whether a pruned
   trial, run to completion, is feasible under the study's gate and on the final Pareto
   front (completed trials ∪ re-run pruned trials), or faster than the best feasible trial.

    python bench/pruning.py study   --dir /tmp/prune --budget-s 480 --device cuda
    python bench/pruning.py rerun   --dir /tmp/prune --budget-s 480 --device cuda
    python bench/pruning.py analyze --dir /tmp/prune --out bench/results/pruning_h100.json
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

import httpx
from studylib import environment, free_port, hardware_class, pyplot, run_cli, wait_healthy

CLI = [sys.executable, "-m", "autotune.cli"]
STUDY = "pruning-bench"


def study(args: argparse.Namespace) -> None:
    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    db = out / "study.db"
    port = free_port()
    api = f"http://127.0.0.1:{port}"
    # a loopback service of the benchmark's own: no tokens needed
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "AUTOTUNE_AUTH": "false"}
    procs: list[subprocess.Popen[bytes]] = []
    log = (out / "service.log").open("wb")
    wlog = (out / "worker.log").open("wb")
    try:
        procs.append(subprocess.Popen([*CLI, "serve", "--db", f"sqlite:///{db}", "--port", str(port)],
                                      stdout=log, stderr=subprocess.STDOUT, env=env))
        http = httpx.Client(base_url=api, timeout=30)
        wait_healthy(http, procs[0])
        space: Any = args.space
        if Path(args.space).suffix in (".yaml", ".yml"):
            import yaml

            space = yaml.safe_load(Path(args.space).read_text())
        spec = {"name": STUDY, "workload": "ups", "preset": args.preset, "space": space,
                "hardware": hardware_class(args.device), "n_trials": args.n_trials, "sampler": "tpe", "seed": args.seed,
                "probe": {"samples": args.samples, "timeout_s": 300}, "baseline_seeds": 3,
                "pruning": {"enabled": True}, "remeasure": {"top_k": 0}}
        created = http.post("/v1/studies", json=spec)
        created.raise_for_status()
        started = time.time()
        procs.append(subprocess.Popen([*CLI, "worker", "--api", api, "--device", args.device, "--study", STUDY,
                                       "--idle-exit", "10"],
                                      stdout=wlog, stderr=subprocess.STDOUT, env=env))
        finished = False
        while time.time() - started < args.budget_s:
            time.sleep(args.poll_s)
            info = http.get(f"/v1/studies/{STUDY}").json()
            print(f"[{time.time() - started:5.0f} s] {info['state']} {info['counts']}", flush=True)
            finished = info["state"] == "finished"
            if finished or procs[-1].poll() is not None:
                break
        http.delete(f"/v1/studies/{STUDY}")
        if finished and procs[-1].poll() is None:
            procs[-1].terminate()  # every trial is in: nothing to deliver, no need to wait out its --idle-exit
        procs[-1].wait(timeout=120)
        trials = http.get(f"/v1/studies/{STUDY}/trials").json()["data"]
        info = http.get(f"/v1/studies/{STUDY}").json()
        (out / "trials.json").write_text(json.dumps({"environment": environment(args.device), "spec": spec,
                                                     "study": info, "wall_s": time.time() - started,
                                                     "trials": trials}, indent=1))
        print(f"{len(trials)} trials in {time.time() - started:.0f} s; {info['counts']}")
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()


def _pruned(trials: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [t for t in trials if t.get("prune_reason") and t.get("config")]


def rerun(args: argparse.Namespace) -> None:
    out = Path(args.dir)
    document = json.loads((out / "trials.json").read_text())
    probe = document["spec"]["probe"]
    path = out / "rerun.json"
    done: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {"runs": []}
    seen = {r["number"] for r in done["runs"]}
    started = time.time()
    for trial in _pruned(document["trials"]):
        if trial["number"] in seen:
            continue
        if time.time() - started > args.budget_s:
            print("budget spent; run `rerun` again for the rest")
            break
        config = {k: v for k, v in trial["config"].items() if k != "effective_batch"}
        cmd = ["probe", "--json", "--workload", "ups", "--preset", document["spec"]["preset"],
               "--device", args.device, "--config", json.dumps(config), "--samples", str(probe["samples"]),
               "--seed", "0"]
        t0 = time.time()
        proc = run_cli(cmd, timeout=600)
        wall = time.time() - t0
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        result = json.loads(lines[-1]) if lines else {"failure": {"kind": "error", "message": proc.stderr[-1500:]}}
        run = {"number": trial["number"], "config": config, "wall_s": wall,
               "throughput_samples_per_s": result.get("throughput_samples_per_s"),
               "val_nrmse": result.get("val_nrmse"), "failure": result.get("failure"),
               "warmup_s": result.get("warmup_s")}
        done["runs"].append(run)
        path.write_text(json.dumps(done, indent=1))
        print(f"trial {trial['number']}: {run['throughput_samples_per_s']} samples/s, NRMSE {run['val_nrmse']}, "
              f"{wall:.0f} s (pruned run: {trial.get('duration_s')} s)", flush=True)


def _dominates(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """a = (throughput, nrmse) dominates b: at least as fast and as good, better in one."""
    return a[0] >= b[0] and a[1] <= b[1] and a != b


def analyze(args: argparse.Namespace) -> None:
    from autotune.contract.gate import BaselineStats, Gate

    out = Path(args.dir)
    document = json.loads((out / "trials.json").read_text())
    trials = document["trials"]
    reruns = {r["number"]: r for r in json.loads((out / "rerun.json").read_text())["runs"]} \
        if (out / "rerun.json").exists() else {}
    spec = document["spec"]
    baseline = [t["val_nrmse"] for t in trials if t["role"] == "baseline" and t["val_nrmse"] is not None]
    stats = BaselineStats.from_values(baseline)
    gate = Gate(abs_tol=0.01, k=2.0).threshold(stats)
    base_tp = statistics.median(t["throughput_samples_per_s"] for t in trials
                                if t["role"] == "baseline" and t["throughput_samples_per_s"])
    completed = [t for t in trials if t["state"] == "COMPLETE" and not t.get("prune_reason")
                 and t["throughput_samples_per_s"] and t["val_nrmse"] is not None]
    pruned = _pruned(trials)
    points = {t["number"]: (t["throughput_samples_per_s"], t["val_nrmse"]) for t in completed}
    for number, r in reruns.items():
        if r["throughput_samples_per_s"] and r["val_nrmse"] is not None and not r.get("failure"):
            points[number] = (r["throughput_samples_per_s"], r["val_nrmse"])
    feasible = {n: p for n, p in points.items() if p[1] <= gate}
    front = sorted(n for n, p in feasible.items() if not any(_dominates(q, p) for q in feasible.values()))
    best_completed = max((p[0] for n, p in feasible.items() if n not in reruns), default=None)
    # The trial running when the benchmark stopped the study was killed by that stop: not study cost.
    stopped = [t["number"] for t in trials if (t.get("failure") or {}).get("message", "").startswith("stopped by")]
    spent = sum(t["duration_s"] or 0.0 for t in trials if t["number"] not in stopped)
    pruned_rows = []
    for t in pruned:
        r = reruns.get(t["number"])
        row = {"number": t["number"], "reason": t["prune_reason"], "pruned_run_s": t["duration_s"],
               "config": t["config"]}
        if r:
            point = points.get(t["number"])
            row.update({"full_run_s": r["wall_s"], "saved_s": r["wall_s"] - (t["duration_s"] or 0.0),
                        "full_throughput": r["throughput_samples_per_s"], "full_val_nrmse": r["val_nrmse"],
                        "full_failure": r.get("failure"),
                        "feasible": point is not None and point[1] <= gate,
                        "on_final_front": t["number"] in front,
                        "beats_best_feasible": bool(point and point[1] <= gate and best_completed
                                                    and point[0] > best_completed)})
        pruned_rows.append(row)
    rerun_rows = [r for r in pruned_rows if "full_run_s" in r]
    saved = sum(r["saved_s"] for r in rerun_rows)
    summary = {
        "trials": len(trials), "completed": len(completed), "pruned": len(pruned), "pruned_rerun": len(rerun_rows),
        "failed": sum(1 for t in trials if t["state"] == "FAIL"),
        "gate_nrmse": gate, "baseline_nrmse": baseline, "baseline_throughput": base_tp,
        "killed_by_benchmark_stop": stopped, "gpu_s_spent": spent, "gpu_s_saved_by_pruning": saved,
        "saved_fraction": saved / (spent + saved) if spent + saved else None,
        "pruned_on_final_front": [r["number"] for r in rerun_rows if r["on_final_front"]],
        "pruned_feasible": [r["number"] for r in rerun_rows if r["feasible"]],
        "pruned_beating_best_feasible": [r["number"] for r in rerun_rows if r["beats_best_feasible"]],
        "final_front": front, "best_feasible_completed_throughput": best_completed,
        "best_speedup": best_completed / base_tp if best_completed else None,
    }
    result = {"environment": document["environment"], "spec": spec, "summary": summary, "pruned": pruned_rows,
              "trials": trials, "reruns": list(reruns.values())}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(summary, indent=1))
    if args.png:
        _plot(points, feasible, front, reruns, gate, base_tp, Path(args.png))


def _plot(points: dict[int, tuple[float, float]], feasible: dict[int, tuple[float, float]], front: list[int],
          reruns: dict[int, Any], gate: float, base_tp: float, path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n, (tp, q) in points.items():
        rerun_point = n in reruns
        ax.scatter(tp / base_tp, q, marker="x" if rerun_point else "o",
                   color="tab:red" if rerun_point else ("tab:blue" if n in feasible else "tab:gray"), s=40)
        ax.annotate(str(n), (tp / base_tp, q), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.axhline(gate, color="k", lw=0.8, ls="--", label=f"gate {gate:.3f}")
    ax.scatter([], [], marker="x", color="tab:red", label="pruned, re-run to completion")
    ax.scatter([], [], marker="o", color="tab:blue", label="completed, feasible")
    ax.scatter([], [], marker="o", color="tab:gray", label="completed, infeasible")
    ax.set_xlabel("speedup over the baseline (×)")
    ax.set_ylabel("val NRMSE")
    ax.set_yscale("log")
    ax.set_title("Pruned trials run to completion vs the study's trials")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="step", required=True)
    for name in ("study", "rerun"):
        p = sub.add_parser(name)
        p.add_argument("--dir", required=True)
        p.add_argument("--budget-s", type=float, default=480)
        p.add_argument("--device", default="cuda")
    s = sub.choices["study"]
    s.add_argument("--space", default="bench/configs/pruning_space.yaml",
                   help="a space name, or a YAML file sent inline")
    s.add_argument("--preset", default="full")
    s.add_argument("--samples", type=int, default=9600)
    s.add_argument("--n-trials", type=int, default=60)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--poll-s", type=float, default=5.0, help="seconds between two looks at the study's state")
    a = sub.add_parser("analyze")
    a.add_argument("--dir", required=True)
    a.add_argument("--out", required=True)
    a.add_argument("--png")
    args = parser.parse_args()
    {"study": study, "rerun": rerun, "analyze": analyze}[args.step](args)


if __name__ == "__main__":
    main()
