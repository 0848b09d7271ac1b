"""Where a probe and the job's own loop part (issue 38, item 2): one config of an outside job
(examples/gpt_script or examples/hf_causal_lm, as bench/gpt_script_verdict.py runs them), timed
by `autotune probe` as a worker runs it and by the script's own loop through `autotune.apply`,
in fresh processes, interleaved, with one inductor cache (the first run compiles cold, in its
warm-up), and each side traced once.

Per repeat, in turn:
  probe       `autotune probe --json` at the study's samples, windows and warm-up (a worker's probe);
  probe-long  the same at --long-factor × the samples and --long-warmup warm-up steps: windows
              that long make a window boundary's cost (the queue drained, the first step's launch
              latency) --long-factor times smaller, and later steps are further from the compiles;
  loop        the script's main() with --config, timed as gpt_script_verdict.py times it
              (train samples/s between synchronized marks, evaluations left out), and its host
              milliseconds per iteration (sampling, copies, autotune.apply's step, the rest).
The first repeat's probe also writes a Chrome trace of its last warm-up steps (--trace-warmup
warm-up steps, so those runs are recorded as `probe-traced`), and the first loop one of the
warm-up's last iterations; bench/trace_summary.py sums both (host ms per step, the CUDA
runtime calls per step, syncs, the GPU's kernel time and busy fraction, the heaviest host ops).

    python bench/probe_loop_gap.py --job hf_causal_lm --from bench/results/hf_causal_lm_verdict_h200.json \\
        --device cuda --out gap_hf.json --trace-dir traces/

--same-process: --repeats runs, each a probe and a loop in one fresh process with their timed
windows taking turns (loop window 1, probe window 1, loop window 2, ..., loop window n + 1; the
loop in a thread, only the side holding the turn running; --sides probe,loop swaps the threads,
--sides probe,probe is the harness's A/A run: two probes, whose ratio should be 1; --sides
loop,probe,probe takes three turns, the loop's and two probes' (each but the last side in a thread),
so the probe against the loop and the A/A come from the same spells). On a shared host the speed
moves in spells of a fraction of a second to seconds (the picks' runs spread ±20 % across processes
and across back-to-back runs in one process alike); windows a few tenths of a second apart share
more of a spell, so each window of a later side is set against the two windows of an earlier one
around it. The summary adds `pairs` (pair_ratio: batch means of the windows' log ratios, a t
interval over them; the second side against the first) and, with three sides, `pairs_all` (every
pair of sides). No traces in this mode.

The config: the run's certified pick (`comparison.pick.config`), or --config FILE; the samples,
windows and warm-up: the run's study's, unless given. Writes --out (JSON, rewritten after each
run) and prints a table. Exit 1 when a run failed.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml
from gpt_script_verdict import JOBS, loop_ratio, registration, time_loop
from resultfiles import load
from studylib import code_version, environment, run_cli
from trace_summary import summarize

HERE = Path(__file__).resolve().parent


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def cpu_list(text: str) -> set[int]:
    """"2-5" or "2,3,7" (taskset's list form) as a set of CPU numbers; SystemExit naming the fix
    when it names none or a CPU this host lacks."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            low, _, high = part.strip().partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise SystemExit(f"--cpus {text!r}: expected CPU numbers like 2-5 or 2,3") from None
    have = os.sched_getaffinity(0)
    if not cpus or not cpus <= have:
        raise SystemExit(f"--cpus {text!r}: this process may run on CPUs {sorted(have)}; name some of those")
    return cpus


def probe_run(args: argparse.Namespace, variant: str, config: Path, env: dict[str, str],
              trace: Path | None) -> dict[str, Any]:
    samples = args.samples * (args.long_factor if variant == "probe-long" else 1)
    warmup = args.long_warmup if variant == "probe-long" else args.trace_warmup if trace else args.warmup_steps
    argv = ["probe", "--workload", args.workload, "--preset", args.preset, "--device", args.device,
            "--config", str(config), "--samples", str(samples), "--windows", str(args.windows),
            "--warmup-steps", str(warmup), "--timeout", str(args.timeout), "--json"]
    if trace:
        argv += ["--trace", str(trace), "--trace-steps", str(args.trace_steps)]
    t0 = time.time()
    done = run_cli(argv, env=env, timeout=args.timeout + 60)
    run: dict[str, Any] = {"variant": variant, "samples": samples, "warmup_steps": warmup, "exit": done.returncode,
                           "process_wall_s": time.time() - t0}
    try:
        res = json.loads(done.stdout)
    except json.JSONDecodeError:
        run["failure"] = (done.stderr or done.stdout)[-2000:]
        return run
    wins = res.get("window_throughputs") or []
    run.update(throughput=res.get("throughput_samples_per_s"), window_throughputs=wins,
               window_data_wait_s=res.get("window_data_wait_s"), warmup_s=res.get("warmup_s"),
               steps=res.get("steps"), failure=res.get("failure"), notes=res.get("notes"))
    return run


def loop_run(args: argparse.Namespace, config: Path, env: dict[str, str], work: Path, r: int,
             trace: Path | None) -> dict[str, Any]:
    result = work / f"loop-{r}.json"
    cmd = [sys.executable, str(HERE / "gpt_script_verdict.py"), "_loop", "--job", args.job, "--preset", args.preset,
           "--max-iters", str(args.loop_iters), "--warmup-iters", str(args.loop_warmup_iters),
           "--config", str(config), "--result", str(result)]
    if trace:
        cmd += ["--trace", str(trace), "--trace-iters", str(args.trace_steps)]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(work), timeout=args.timeout + 120)
    run: dict[str, Any] = {"variant": "loop", "exit": proc.returncode, "process_wall_s": time.time() - t0}
    if proc.returncode == 0 and result.exists():
        got = json.loads(result.read_text())
        run.update({k: got.get(k) for k in ("train_samples_per_s", "halves_samples_per_s", "per_iteration_ms",
                                            "iterations", "warmup_iterations", "final_val_loss")})
        run["throughput"] = got.get("train_samples_per_s")
    else:
        run["failure"] = proc.stderr[-2000:]
    return run


class Baton:
    """Sides taking turns on one GPU, in the order given: pass_to hands the turn to the next side
    that has not ended and blocks until the turn comes back (at once when no other side is left);
    a side that ends hands the turn on and never waits again."""

    def __init__(self, order: list[str]) -> None:
        self.order = list(order)
        self.turn = self.order[0]
        self.ended: set[str] = set()
        self.cv = threading.Condition()

    def _next(self, me: str) -> str:
        i = self.order.index(me)
        for other in self.order[i + 1:] + self.order[:i]:
            if other not in self.ended:
                return other
        return me

    def wait(self, me: str) -> None:
        with self.cv:
            self.cv.wait_for(lambda: self.turn == me)

    def pass_to(self, me: str) -> None:
        with self.cv:
            self.turn = self._next(me)
            self.cv.notify_all()
            self.cv.wait_for(lambda: self.turn == me)

    def end(self, me: str) -> None:
        with self.cv:
            self.ended.add(me)
            if self.turn == me:
                self.turn = self._next(me)
            self.cv.notify_all()


def cudagraph_trees_in_every_thread() -> None:
    """Give this thread TorchInductor's CUDA-graph-tree registries: the module makes them for the
    thread that imports it only, and a compile under mode="reduce-overhead" in another thread fails
    `assert torch._C._is_key_in_tls(...)` (pytorch/pytorch#123177). Each thread gets its own, as the
    module's threading.local intends; a bench-only workaround (torch's private module)."""
    from collections import defaultdict

    import torch
    from torch._inductor import cudagraph_trees

    local = cudagraph_trees.local
    if not hasattr(local, "tree_manager_containers"):
        # as the module does at import: the registries, and their TLS stash for autograd's threads
        local.tree_manager_containers = {}
        local.tree_manager_locks = defaultdict(threading.Lock)
        torch._C._stash_obj_in_tls("tree_manager_containers", local.tree_manager_containers)
        torch._C._stash_obj_in_tls("tree_manager_locks", local.tree_manager_locks)


KINDS = ("loop", "probe")
POSITIONS = ("first", "second", "third")


# the HF pick's three-sided run on an H100 (torch 2.11.0+cu130, 2026-12-06) died with SIGSEGV after its compiles
THREE_GRAPH_TREES = ("--sides with three sides and compile: reduce-overhead on a GPU: three threads each replaying "
                     "TorchInductor's CUDA-graph trees crashed the process (SIGSEGV, HF pick on an H100, torch 2.11); "
                     "run two sides (loop,probe and probe,probe) instead")


def sides_arg(text: str) -> str:
    """--sides: two or three of loop and probe, comma-separated (e.g. loop,probe or loop,probe,probe)."""
    kinds = text.split(",")
    if not 2 <= len(kinds) <= len(POSITIONS) or any(k not in KINDS for k in kinds):
        raise argparse.ArgumentTypeError(f"{text!r}: give two or three of loop and probe, comma-separated "
                                         "(loop,probe; probe,loop; probe,probe; loop,probe,probe)")
    return text


def interleaved(args: argparse.Namespace, job: Any, cfg: Any, settings: Any) -> list[dict[str, Any]]:
    """Two or three runs in one process, their timed windows taking turns (--sides FIRST,SECOND[,THIRD]).
    Every side but the last runs in a thread of its own; each sets up and warms up in turn (one
    compiles at a time), the first first; then first window 1, second window 1, (third window 1,)
    first window 2, ..., the last side's window n, first window n + 1, so that every window of a
    later side sits between two windows of every earlier one. Each side times its windows between
    its own synchronized marks and hands the turn on between them (at every window edge; a side
    whose fellows have ended goes on alone); only the side holding the turn runs. The default
    puts the loop first and the probe second; probe,loop swaps their threads; probe,probe is the
    harness's A/A run; loop,probe,probe measures the probe against the loop and the harness's A/A
    in the same spells. Returns a record per side, in order."""
    import dataclasses

    from autotune.engine.probe import run_probe

    kinds = dict(zip(POSITIONS, args.sides.split(","), strict=False))
    order = list(kinds)
    baton = Baton(order)
    got: dict[str, dict[str, Any]] = {}

    def run_side(me: str, windows: int) -> dict[str, Any]:
        if kinds[me] == "loop":
            loop = time_loop(job, args.preset, args.loop_iters, args.loop_warmup_iters, args.config, windows=windows,
                             handoff=lambda: baton.pass_to(me),
                             breakdown=False)  # the script's calls as written: no clock reads inside them
            return {"variant": "loop", "throughput": loop["train_samples_per_s"],
                    **{k: loop.get(k) for k in ("window_samples_per_s", "halves_samples_per_s", "per_iteration_ms",
                                                "iterations", "warmup_iterations", "final_val_loss")}}

        def turns(phase: str, info: dict[str, Any]) -> None:
            if phase in ("timed windows", "window"):  # before the first window, after each (outside the timing)
                baton.pass_to(me)

        # windows of the same length on every side: n + 1 of them take proportionally more samples
        mine = dataclasses.replace(settings, windows=windows, samples=settings.samples * windows // args.windows)
        probe = run_probe(job.workload, cfg, preset=args.preset, device=args.device, settings=mine,
                          on_progress=turns).to_dict()  # what `autotune probe --json` prints
        return {"variant": "probe", "samples": mine.samples, "warmup_steps": mine.warmup_steps,
                "throughput": probe.get("throughput_samples_per_s"),
                **{k: probe.get(k) for k in ("window_throughputs", "steps", "failure", "notes")}}

    def side(me: str) -> None:
        if me != order[-1]:
            cudagraph_trees_in_every_thread()
        baton.wait(me)  # the earlier sides' set-ups and warm-ups first: one compiles at a time
        try:
            got[me] = run_side(me, args.windows + 1 if me == order[0] else args.windows)
        except BaseException as exc:  # reported with the run; the other sides go on
            got[me] = {"variant": kinds[me], "failure": f"{type(exc).__name__}: {exc}"}
        finally:
            baton.end(me)

    cudagraph_trees_in_every_thread()
    threads = [threading.Thread(target=side, args=(me,), name=me, daemon=True) for me in order[:-1]]
    for thread in threads:
        thread.start()
    side(order[-1])
    for thread in threads:
        thread.join()
    return [{**got[me], "side": me} for me in order]


def paired_child(args: argparse.Namespace) -> None:
    """In a fresh process: one interleaved run, both sides written to --result as JSON lines."""
    from autotune.contract.config import parse_config
    from autotune.engine.probe import ProbeSettings

    job = JOBS[args.job]
    cfg = parse_config(yaml.safe_load(Path(args.config).read_text()))
    settings = ProbeSettings(samples=args.samples, windows=args.windows, warmup_steps=args.warmup_steps,
                             timeout_s=args.timeout)
    t0 = time.time()
    runs = interleaved(args, job, cfg, settings)
    wall = time.time() - t0
    Path(args.result).write_text("".join(json.dumps({**run, "wall_s": wall}, default=str) + "\n" for run in runs))


def paired_runs(args: argparse.Namespace, config: Path, env: dict[str, str], work: Path,
                deadline: float) -> list[dict[str, Any]]:
    """--repeats interleaved runs, each paired_child in a fresh process, until the deadline."""
    runs: list[dict[str, Any]] = []
    took = 0.0
    for r in range(args.repeats):
        if time.time() + took * 1.2 > deadline:
            _log(f"interleaved run {r}: skipped, {deadline - time.time():.0f} s left (the last took {took:.0f})")
            break
        result = work / f"paired-{r}.jsonl"
        result.unlink(missing_ok=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), "_paired", "--job", args.job, "--preset", args.preset,
               "--device", args.device, "--config", str(config), "--samples", str(args.samples), "--windows",
               str(args.windows), "--warmup-steps", str(args.warmup_steps), "--timeout", str(args.timeout),
               "--loop-iters", str(args.loop_iters), "--loop-warmup-iters", str(args.loop_warmup_iters),
               "--sides", args.sides, "--result", str(result)]
        t0 = time.time()
        failure = None
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(work),
                                  timeout=max(10.0, deadline - time.time()))
            if proc.returncode != 0:
                failure = f"exit {proc.returncode}: {proc.stderr[-2000:]}"
        except subprocess.TimeoutExpired:
            failure = "timed out (the deadline)"
        took = time.time() - t0
        got = [json.loads(line) for line in result.read_text().splitlines()] if result.exists() else []
        runs += [{**run, "repeat": r, "process": "same", "process_wall_s": took} for run in got]
        if failure:
            runs.append({"variant": "interleaved", "repeat": r, "failure": failure})
    return runs


def pair_ratio(runs: list[dict[str, Any]], batch: int = 10, earlier: str = "first", later: str = "second",
               named: bool = False) -> dict[str, Any] | None:
    """The interleaved windows' ratio of two sides: probe over loop (two probes: the later over the
    earlier, the harness's A/A). Each window of the `later` side is set against the two windows of
    the `earlier` side around it (their geometric mean: a drift linear in time cancels). The
    windows' log ratios are cut, run by run, into consecutive batches of `batch` (batch means: a
    spell of the host's speed spans neighbouring windows, so single windows are not independent,
    batches of them nearly are); the ratio is the geometric mean over the batches with a one-sample
    t 95 % interval (autotune.contract.verdict.paired). Also: each run's geometric mean and the
    lag-1 autocorrelation of the window log ratios (near 0: the batches are independent enough).
    None without two batches. Runs without a `side` are the loop first, the probe second. `named`:
    the ratio's name gives each side's position (runs of three sides)."""
    from autotune.contract.verdict import paired

    sides: dict[int, dict[str, tuple[str, list[float]]]] = {}
    for run in runs:
        windows = run.get("window_throughputs") or run.get("window_samples_per_s")
        if windows and not run.get("failure") and run.get("variant") in KINDS:
            me = run.get("side") or ("first" if run["variant"] == "loop" else "second")
            sides.setdefault(run["repeat"], {})[me] = (run["variant"], windows)
    per_run: list[float] = []
    logs: list[list[float]] = []
    kinds: tuple[str, str] | None = None
    for _, s in sorted(sides.items()):
        if earlier not in s or later not in s:
            continue
        (first_kind, first), (second_kind, second) = s[earlier], s[later]
        kinds = (first_kind, second_kind)
        # probe over loop, whichever side the probe took
        sign = -1.0 if second_kind == "loop" and first_kind == "probe" else 1.0
        run_logs = [sign * math.log(second[i] / math.sqrt(first[i] * first[i + 1]))
                    for i in range(min(len(second), len(first) - 1))]
        if run_logs:
            logs.append(run_logs)
            per_run.append(math.exp(statistics.fmean(run_logs)))
    means = [statistics.fmean(xs[i:i + batch]) for xs in logs for i in range(0, len(xs) - batch + 1, batch)]
    if len(means) < 2 or kinds is None:
        return None
    d = paired(means)
    low, high = d.bounds(0.025)
    flat = [x for xs in logs for x in xs]
    mean = statistics.fmean(flat)
    spread = sum((x - mean) ** 2 for x in flat)
    lag1 = sum((a - mean) * (b - mean) for xs in logs for a, b in itertools.pairwise(xs)) / spread if spread else 0.0
    return {"what": ratio_name(kinds, (earlier, later), named), "sides": [earlier, later],
            "runs": len(per_run), "windows": len(flat), "batch": batch, "batches": len(means),
            "per_run": per_run, "geomean": math.exp(d.value), "ci95": [math.exp(low), math.exp(high)],
            "window_log_sd": statistics.stdev(flat), "lag1_autocorrelation": lag1,
            "window_ratios": [[math.exp(x) for x in xs] for xs in logs]}


def ratio_name(kinds: tuple[str, str], positions: tuple[str, str], named: bool = False) -> str:
    """What pair_ratio's ratio is, in words: "probe / loop", "second probe / first probe (A/A)",
    or `named`, with each side's position: "probe (third) / loop (first)"."""
    (k1, k2), (p1, p2) = kinds, positions
    if not named:
        return f"{p2} {k2} / {p1} {k1} (A/A)" if k1 == k2 else "probe / loop"
    if k1 == k2:
        return f"{k2} ({p2}) / {k1} ({p1}) (A/A)"
    return f"probe ({p2 if k2 == 'probe' else p1}) / loop ({p1 if k1 == 'loop' else p2})"


def summary(runs: list[dict[str, Any]], batch: int = 10) -> dict[str, Any]:
    by: dict[str, list[float]] = {}
    for run in runs:
        if run.get("throughput"):
            by.setdefault(run["variant"], []).append(run["throughput"])
    out: dict[str, Any] = {v: {"median": statistics.median(xs), "runs": xs} for v, xs in by.items()}
    loop = out.get("loop", {}).get("median")
    for v, row in out.items():
        row["over_loop"] = row["median"] / loop if loop else None
        if v != "loop" and len(row["runs"]) > 1 and len(by.get("loop", [])) > 1:
            # the ratio of geometric means with its 95 % interval: the verdict's speed test, as
            # gpt_script_verdict.py compares a pick's loop with the baseline's
            ratio = loop_ratio(row["runs"], by["loop"])
            row.update(geomean_over_loop=ratio["speedup"], ci95=[ratio["ci_low"], ratio["ci_high"]])
    if runs and all(run.get("process") == "same" for run in runs if run.get("throughput")):
        pairs = pair_ratio(runs, batch)
        if pairs:
            out["pairs"] = pairs
        if any(run.get("side") == "third" for run in runs):  # three sides: every pair of them
            more = [pair_ratio(runs, batch, a, b, named=True) for a, b in itertools.combinations(POSITIONS, 2)]
            out["pairs_all"] = [x for x in more if x]
    return out


def table(doc: dict[str, Any]) -> str:
    lines = [f"**{doc['environment'].get('gpu') or doc['environment'].get('device')}**, {doc['job']}, config "
             f"{doc['config_source']}", "", "| run | samples/s (median) | runs | / loop (median; geomean [95 % CI]) |",
             "|---|---:|---:|---:|"]
    for v, row in doc["summary"].items():
        if v in ("pairs", "pairs_all"):
            continue
        ratio = f"{row['over_loop']:.3f}" if row.get("over_loop") else "–"
        if row.get("ci95"):
            ratio += f" (geomean {row['geomean_over_loop']:.3f} [{row['ci95'][0]:.3f}–{row['ci95'][1]:.3f}])"
        lines.append(f"| {v} | {row['median']:,.0f} | {len(row['runs'])} | {ratio} |")
    summ = doc["summary"]
    for pairs in summ.get("pairs_all") or ([summ["pairs"]] if summ.get("pairs") else []):
        what = pairs.get("what") or ("second probe / first probe (A/A)" if doc["settings"].get("sides") == "probe,probe"
                                     else "probe / loop")
        lines.append(f"\n{what}, windows interleaved in one process ({pairs['runs']} runs, {pairs['windows']} "
                     f"window pairs, {pairs['batches']} batches of {pairs['batch']}): geomean {pairs['geomean']:.3f} "
                     f"[{pairs['ci95'][0]:.3f}–{pairs['ci95'][1]:.3f}] (t over the batch means, 95 %); per run "
                     f"{', '.join(f'{x:.3f}' for x in pairs['per_run'])}; a window's log ratio sd "
                     f"{pairs['window_log_sd']:.3f}, lag-1 autocorrelation {pairs['lag1_autocorrelation']:.2f}")
    for side, tr in doc.get("traces", {}).items():
        if "error" in tr:
            lines.append(f"\n{side} trace: {tr['error']}")
            continue
        lines.append(f"\n{side} trace: {tr['steps']} steps, host {tr['step_host_ms']:.3f} ms/step "
                     f"(data {tr['data_wait_ms'] or 0:.3f}), kernels {tr['kernel_ms_per_step']:.3f} ms/step, "
                     f"GPU busy {tr['gpu_busy_fraction'] or 0:.2f}, syncs/step {tr['syncs_per_step']:.2f}, "
                     f"span {tr['span_ms'] / max(1, tr['steps']):.3f} ms/step")
        for name, row in list(tr["runtime_per_step"].items())[:5]:
            lines.append(f"  runtime {name}: {row['calls']} calls, {row['ms']:.3f} ms")
        for name, row in list(tr["host_ops_per_step"].items())[:8]:
            lines.append(f"  op {name}: {row['calls']} calls, {row['ms']:.3f} ms")
    return "\n".join(lines)


def child_main(argv: list[str]) -> None:
    c = argparse.ArgumentParser(prog="probe_loop_gap.py _paired")
    c.add_argument("--job", choices=JOBS, required=True)
    for name in ("--preset", "--device", "--config", "--result"):
        c.add_argument(name, required=True)
    for name in ("--samples", "--windows", "--warmup-steps", "--loop-iters", "--loop-warmup-iters"):
        c.add_argument(name, type=int, required=True)
    c.add_argument("--timeout", type=float, required=True)
    c.add_argument("--sides", type=sides_arg, default="loop,probe")
    paired_child(c.parse_args(argv))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_paired"]:  # the child of --same-process
        child_main(argv[1:])
        # its result is written: leave without the interpreter's teardown, which on a loaded
        # 2-core host aborted 2 of 8 CPU runs after both sides had finished ("terminate called
        # without an active exception", exit -6) and so failed a finished run
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", choices=JOBS, required=True)
    p.add_argument("--from", dest="source", default=None, help="a gpt_script_verdict.py JSON: its pick and study")
    p.add_argument("--config", default=None, help="a config file instead of the run's pick")
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", default=None)
    p.add_argument("--samples", type=int, default=None)
    p.add_argument("--windows", type=int, default=None)
    p.add_argument("--warmup-steps", type=int, default=None)
    p.add_argument("--long-factor", type=int, default=3)
    p.add_argument("--long-warmup", type=int, default=30)
    p.add_argument("--trace-warmup", type=int, default=20, help="the traced probe's warm-up steps")
    p.add_argument("--trace-steps", type=int, default=8)
    p.add_argument("--trace-dir", default=None, help="keep the two traces here (gzipped)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--variants", type=lambda v: v.split(","), default=["probe", "probe-long", "loop"],
                   help="which runs each repeat makes (comma-separated: probe, probe-long, loop)")
    p.add_argument("--no-trace", action="store_true", help="trace nothing (the first repeat traces by default)")
    p.add_argument("--loop-iters", type=int, default=300)
    p.add_argument("--loop-warmup-iters", type=int, default=60)
    p.add_argument("--timeout", type=float, default=150.0)
    p.add_argument("--deadline-s", type=float, default=540.0)
    p.add_argument("--workdir", default=None)
    p.add_argument("--cpus", default=None,
                   help="run this process and every probe and loop it starts on these CPUs only (e.g. 2-5 or "
                        "2,3): a host-bound config's speed moves with the cores a process lands on")
    p.add_argument("--same-process", action="store_true",
                   help="a probe and a loop in one process, their windows taking turns, --repeats times (module "
                        "docstring); no traces")
    p.add_argument("--sides", type=sides_arg, default="loop,probe",
                   help="with --same-process: the sides in their turn order, each but the last in a thread "
                        "(module docstring): loop,probe; probe,loop; probe,probe (the harness's A/A run); "
                        "loop,probe,probe (both in the same spells)")
    p.add_argument("--batch-windows", type=int, default=10,
                   help="with --same-process: window ratios per batch mean (the interval's unit)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    t_begin = time.time()
    if args.cpus:
        os.sched_setaffinity(0, cpu_list(args.cpus))  # inherited by the fork server, its probes and the loops
    job = JOBS[args.job]
    args.workload = job.workload
    work = Path(args.workdir or tempfile.mkdtemp(prefix="gap-"))
    work.mkdir(parents=True, exist_ok=True)
    study_probe: dict[str, Any] = {}
    config: dict[str, Any] = {}
    source = "--config"
    if args.source:
        data = load(args.source)
        spec = (data.get("study") or {}).get("spec") or {}
        study_probe = spec.get("probe") or {}
        args.preset = args.preset or spec.get("preset")
        config = ((data.get("comparison") or {}).get("pick") or {}).get("config") or {}
        source = f"the certified pick of {Path(args.source).name}"
    if args.config:
        config = yaml.safe_load(Path(args.config).read_text())
        source = args.config
    if not config:
        raise SystemExit("no config: give --config FILE, or --from a run with a certified pick")
    if args.same_process and args.device != "cpu" and len(args.sides.split(",")) == 3 \
            and config.get("compile") == "reduce-overhead":
        raise SystemExit(THREE_GRAPH_TREES)
    args.preset = args.preset or job.preset(args.device)
    args.samples = args.samples or study_probe.get("samples") or 4096
    args.windows = args.windows or study_probe.get("windows") or 8
    args.warmup_steps = args.warmup_steps or study_probe.get("warmup_steps") or 5
    path = work / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    _, extra_env, how = registration(job)
    env = {**os.environ, **extra_env, "PYTHONUNBUFFERED": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor")}  # one cache: the first run compiles cold
    traces = {"probe": work / "probe.trace.json", "loop": work / "loop.trace.json"}
    doc: dict[str, Any] = {"benchmark": "probe_loop_gap", "job": args.job, "argv": sys.argv[1:],
                           "config_source": source, "config": config, "registration": how,
                           "settings": {**{k: getattr(args, k) for k in ("preset", "samples", "windows", "warmup_steps",
                                                                           "batch_windows", "sides",
                                                                           "long_factor", "long_warmup", "trace_warmup",
                                                                           "trace_steps", "repeats", "loop_iters",
                                                                           "loop_warmup_iters")},
                                        "cpus": sorted(os.sched_getaffinity(0)) if args.cpus else None},
                           "environment": environment(args.device), "code": code_version(), "runs": []}
    out = Path(args.out)
    failed = False
    if args.same_process:
        doc["settings"]["same_process"] = True
        doc["runs"] = paired_runs(args, path, env, work, t_begin + args.deadline_s - 15)
        for run in doc["runs"]:
            failed |= bool(run.get("failure"))
            _log(f"{run['variant']} {run.get('repeat', '')}: {run.get('throughput') or 0:,.0f} samples/s"
                 + (f" FAILED {str(run['failure'])[-300:]}" if run.get("failure") else ""))
        args.repeats, args.no_trace = 0, True  # the pairs were the repeats; nothing was traced
    for r in range(args.repeats):
        order = [v for v in ("probe", "probe-long", "loop") if v in args.variants]
        for variant in order if r % 2 == 0 else order[::-1]:
            if time.time() - t_begin > args.deadline_s - 60:
                _log(f"{variant} {r}: skipped (deadline)")
                continue
            trace = (traces["loop" if variant == "loop" else "probe"]
                     if r == 0 and variant != "probe-long" and not args.no_trace else None)
            try:
                run = (loop_run(args, path, env, work, r, trace) if variant == "loop"
                       else probe_run(args, variant, path, env, trace))
            except subprocess.TimeoutExpired:
                run = {"variant": variant, "failure": "timed out"}
            if trace and run["variant"] == "probe":
                run["variant"] = "probe-traced"
            run["repeat"] = r
            failed |= bool(run.get("failure"))
            _log(f"{run['variant']} {r}: {run.get('throughput') or 0:,.0f} samples/s"
                 + (f" FAILED {str(run['failure'])[-300:]}" if run.get("failure") else ""))
            doc["runs"].append(run)
            doc["summary"] = summary(doc["runs"], args.batch_windows)
            out.write_text(json.dumps(doc, indent=1, default=str))
    doc["traces"] = {}
    for side, tr in traces.items() if not args.no_trace else []:
        try:
            doc["traces"][side] = summarize(tr)
        except (OSError, SystemExit, ValueError, KeyError) as exc:
            doc["traces"][side] = {"error": str(exc)[:300]}
        if args.trace_dir and tr.exists():
            Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
            with tr.open("rb") as src, gzip.open(Path(args.trace_dir) / f"{args.job}_{tr.name}.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
    doc["summary"] = summary(doc["runs"], args.batch_windows)
    doc["wall_s"] = time.time() - t_begin
    out.write_text(json.dumps(doc, indent=1, default=str))
    print(table(doc))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
