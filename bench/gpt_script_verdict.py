"""Benchmark: does the verdict's certified speedup hold in an outside script's own loop?

Two outside scripts, written without autotune and tuned through their glue (``--job``):

* ``gpt_script`` (the default): examples/gpt_script (docs/tutorial.md, part 2), a nanoGPT-style
  script (`gpt-script`, preset tiny), its 77-line glue; baseline the script as written, 16 × 1 fp32.
* ``hf_causal_lm``: examples/hf_causal_lm (docs/huggingface.md), a Hugging Face user's script
  (`hf-causal-lm`): a Llama built from a LlamaConfig, AdamW without decay on biases and norms,
  clipping at 1.0, get_linear_schedule_with_warmup, its own get_batch; on a GPU the preset
  ``gpu`` (``--size gpu``: hidden 512, 10 layers, 32.2 M parameters, blocks of 256) and as the
  baseline what the plain loop runs there, as an HF user would today: bf16 autocast, sdpa
  attention, eager, torch's default AdamW, 16 × 1; on a CPU the preset ``tiny``, fp32.

One run, on one host:

1. **The study.** `autotune serve` on a SQLite file (loopback, no tokens), a study of the job's
   workload on this hardware class, the script's own defaults as the baseline (3 seeds), a GPU
   space that holds the fast stack (compile modes, the step graph, bf16, fused AdamW, the
   compiled optimizer step, micro-batch × accumulation; for the HF job also the model's own
   activation checkpointing), `starting_points: auto`, then TPE, then the verdict's interleaved
   re-measure rounds; one `autotune worker --device cuda --allow-workload NAME` until the study is
   finished. `autotune best --format json` (certified, speedup and interval, `configs`: the
   rule's inputs) and the YAML are kept; without a certified pick, also the fastest uncertified
   candidate (`best --uncertified`).
2. **The script's own loop.** The script's `main()` (what ``python -m gpt_script.train`` /
   ``python -m hf_causal_lm.train --size gpu`` runs), without and with ``--config best.yaml`` (and
   the uncertified candidate), several fresh processes each, interleaved (A B C, C B A, ...). The
   script is not edited: the child imports it and wraps module-level names that `main()` looks
   up at each call. gpt_script: `get_lr` (called once at the top of every iteration: the clock
   marks, with a device synchronize, at the end of the warm-up, half-way and at the end),
   `get_batch` (counts the training samples between the marks) and `estimate_loss` (its
   evaluations are timed and left out of the training rate; the loop rate with them is reported
   too). hf_causal_lm: `get_linear_schedule_with_warmup` (the scheduler it returns is stepped
   once at the end of every iteration: its `step` marks the clock as `get_lr` does), `get_batch`
   (counts) and `val_loss` (timed and left out). Steady state only: the first fifth of the
   iterations (at least --warmup-iters) are warm-up (compile, CUDA-graph capture, allocator growth).
3. **The comparison.** The loop's speedup is the ratio of geometric means over the repeats
   (as the verdict's), with a Welch 95 % interval from autotune.contract.verdict; it agrees with the
   verdict when the two speedups are within 10 % of each other.

Everything lands in one JSON (environment, the job, the spec, the trials, the verdict, the loop
runs, the comparison) and a markdown summary is printed; `plot` draws the PNG.

    python bench/gpt_script_verdict.py run --device cuda --out $OUT/gpt_script_verdict_h100.json \
        --png $OUT/gpt_script_verdict_h100.png
    python bench/gpt_script_verdict.py run --job hf_causal_lm --device cuda --shared-inductor-cache \
        --out $OUT/hf_causal_lm_verdict_h200.json ...
    python bench/gpt_script_verdict.py loop --from results/gpt_script_verdict_h100.json --out ...   # loop only
    python bench/gpt_script_verdict.py plot --json F.json --png F.png
    python bench/gpt_script_verdict.py run --device cpu --samples 256 --windows 5 --n-trials 5 ...   # CPU smoke test

It installs nothing: the job's package must be registered (``pip install ./examples/gpt_script``,
``pip install ./examples/hf_causal_lm``); if it is not, the run names it by import path
(AUTOTUNE_WORKLOADS for the service, ``--allow-workload NAME=module:attr`` for the worker) with
the example's folder on PYTHONPATH, and the JSON says so.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trace_summary import DATA as TRACE_DATA
from trace_summary import STEP as TRACE_STEP

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "autotune.cli"]
STUDY = "gpt-script-verdict"
AGREE = 0.10  # the loop's speedup and the verdict's agree when within 10 % of each other

# The GPU space: what the fast stack (autotune/contract/starting.py) needs, for a script that feeds
# itself (get_batch, no DataLoader: num_workers and pinning would measure a data path the
# script does not have) and has no checkpointable blocks and no auxiliary loss.
GPU_SPACE: dict[str, Any] = {
    "name": "gpt-script-gpu",
    "params": {
        "compile": {"choices": ["none", "default", "reduce-overhead"]},
        "precision": {"choices": ["fp32", "tf32", "bf16"]},
        "batch_size": {"choices": [8, 16, 32]},
        "accum_steps": {"choices": [1, 2]},
        "fused_optimizer": {"choices": [False, True]},
        "compile_optimizer": {"choices": [False, True]},
        "step_graph": {"choices": [False, True], "when": {"compile": ["none", "default"]}},
        "cudnn_benchmark": {"choices": [False, True]},
    },
}
CPU_SPACE: dict[str, Any] = {  # the CPU smoke test's: the example study's space
    "name": "gpt-script-cpu",
    "params": {"batch_size": {"choices": [8, 16]}, "accum_steps": {"choices": [1, 2]},
               "fused_optimizer": {"choices": [False, True]}},
}
# The HF job's GPU space: the fast stack at the baseline's precision (bf16, fixed: an HF user on an
# H100/H200 trains in bf16 today), micro-batch × accumulation around the script's 16 × 1, and the
# HF model's own activation checkpointing (whole decoder layers, or selective). No DataLoader knobs
# (the script's get_batch is the data path), no cudnn (no convolution), no auxiliary loss.
HF_GPU_SPACE: dict[str, Any] = {
    "name": "hf-causal-lm-gpu",
    "params": {
        "compile": {"choices": ["none", "default", "reduce-overhead"]},
        "batch_size": {"choices": [16, 32, 64]},
        "accum_steps": {"choices": [1, 2]},
        "checkpoint": {"choices": ["none", "block"]},
        "fused_optimizer": {"choices": [False, True]},
        "compile_optimizer": {"choices": [False, True]},
        # no step_graph: the HF Llama's step does not capture as a CUDA graph (cudaErrorStreamCaptureInvalidated
        # on an H200, torch 2.11, transformers 5.24; the probe fails it as unsupported), and reduce-overhead
        # graphs its forward and backward already
    },
    "fixed": {"precision": "bf16"},
}
HF_CPU_SPACE: dict[str, Any] = {  # the CPU smoke test's: the example study's space
    "name": "hf-causal-lm-cpu",
    "params": {"batch_size": {"choices": [8, 16]}, "accum_steps": {"choices": [1, 2]},
               "checkpoint": {"choices": ["none", "block"]}},
}


@dataclass(frozen=True)
class Job:
    """One outside script: its package and registration, its study, and how its loop is timed."""

    key: str  # --job
    workload: str  # the name its package's entry point registers
    package: str  # examples/<package>: put on PYTHONPATH when the package is not installed
    target: str  # module:attr, the registration by import path
    script: str  # the module whose main() is the loop
    presets: dict[str, str]  # device type -> preset
    spaces: dict[str, dict[str, Any]]  # device type ("cpu", else "cuda") -> the study's space
    baselines: dict[str, dict[str, Any]]  # device type -> the baseline: what the loop runs as written there
    steps_flag: str  # main()'s option for its iteration count
    size_flag: str | None = None  # main()'s option naming the preset's size
    instrument: str = ""  # the name of this module's function that wraps the script's functions

    @property
    def example(self) -> Path:
        return ROOT / "examples" / self.package

    def preset(self, device: str) -> str:
        return self.presets["cpu" if device == "cpu" else "cuda"]

    def space(self, device: str) -> dict[str, Any]:
        return json.loads(json.dumps(self.spaces["cpu" if device == "cpu" else "cuda"]))

    def baseline(self, device: str) -> dict[str, Any]:
        return dict(self.baselines["cpu" if device == "cpu" else "cuda"])

    def loop_argv(self, preset: str) -> list[str]:
        return [self.size_flag, preset] if self.size_flag else []


JOBS: dict[str, Job] = {
    "gpt_script": Job(
        key="gpt_script", workload="gpt-script", package="gpt_script", target="gpt_script.workload:ScriptWorkload",
        script="gpt_script.train", presets={"cpu": "tiny", "cuda": "tiny"},
        spaces={"cpu": CPU_SPACE, "cuda": GPU_SPACE},
        baselines={"cpu": {"batch_size": 16, "accum_steps": 1}, "cuda": {"batch_size": 16, "accum_steps": 1}},
        steps_flag="--max-iters", size_flag="--size", instrument="instrument_gpt_script"),
    "hf_causal_lm": Job(
        key="hf_causal_lm", workload="hf-causal-lm", package="hf_causal_lm", target="hf_causal_lm.workload:Llama",
        script="hf_causal_lm.train", presets={"cpu": "tiny", "cuda": "gpu"},
        spaces={"cpu": HF_CPU_SPACE, "cuda": HF_GPU_SPACE},
        # the plain loop autocasts to bf16 on a GPU (train.bf16), fp32 on a CPU; eager, torch's AdamW
        baselines={"cpu": {"batch_size": 16, "accum_steps": 1},
                   "cuda": {"precision": "bf16", "batch_size": 16, "accum_steps": 1}},
        steps_flag="--max-steps", size_flag="--size", instrument="instrument_hf_causal_lm"),
}


def job_of(data: dict[str, Any], given: str | None = None) -> Job:
    """The job a run's JSON was made for (runs before --job: gpt_script), or the one given."""
    return JOBS[given or data.get("job") or "gpt_script"]


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


# --- the workload's registration ----------------------------------------------------------------

def registration(job: Job) -> tuple[str, dict[str, str], str]:
    """(the worker's --allow-workload value, extra environment, how the job's workload is registered)."""
    env: dict[str, str] = {}
    if importlib.util.find_spec(job.package) is None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(job.example), os.environ.get("PYTHONPATH", "")]))
    from autotune.contract.registry import registered_workloads

    entry = registered_workloads().get(job.workload)
    if entry is not None and entry.source == "entry_point":
        return job.workload, env, "entry point (installed package)"
    env["AUTOTUNE_WORKLOADS"] = f"{job.workload}={job.target}"
    return f"{job.workload}={job.target}", env, f"import path ({job.target}; the package is not installed)"


def study_spec(args: argparse.Namespace, hardware: str, job: Job | None = None) -> dict[str, Any]:
    job = job or JOBS[args.job]
    space = job.space(args.device)
    if args.device != "cpu" and args.no_compile:
        space["params"].pop("compile")
        if "step_graph" in space["params"]:
            space["params"]["step_graph"].pop("when", None)
    if getattr(args, "lm_knobs", False):  # issue 40's knobs in the job's space (bench/lm_space_study.py's widening)
        from lm_space_study import widened

        space = widened(space, args.device, hf=job.key == "hf_causal_lm")
    probe: dict[str, Any] = {"samples": args.samples, "windows": args.windows, "timeout_s": args.probe_timeout_s}
    if args.warmup_steps:
        probe["warmup_steps"] = args.warmup_steps
    remeasure: dict[str, Any] = {"top_k": args.top_k, "max_rounds": args.max_rounds}
    return {"name": args.study, "workload": job.workload, "preset": args.preset or job.preset(args.device),
            "hardware": hardware, "space": space, "baseline": job.baseline(args.device), "baseline_seeds": 3,
            "starting_points": "auto", "sampler": "tpe", "seed": args.seed, "n_trials": args.n_trials,
            "probe": probe, "remeasure": remeasure, "max_retries": 1}


# --- 1. the study ---------------------------------------------------------------------------------

def run_study(args: argparse.Namespace, work: Path, hardware: str, deadline: float) -> dict[str, Any]:
    import httpx
    from studylib import free_port, wait_healthy

    allow, extra_env, how = registration(JOBS[args.job])
    port = free_port()
    api = f"http://127.0.0.1:{port}"
    # the benchmark's own loopback service: no tokens; a short grace re-runs a lost trial soon
    env = {**os.environ, **extra_env, "PYTHONUNBUFFERED": "1", "AUTOTUNE_AUTH": "false",
           "AUTOTUNE_LEASE_GRACE_S": "30", "AUTOTUNE_REAPER_INTERVAL_S": "2",
           "AUTOTUNE_INDUCTOR_CACHE_DIR": str(work / "inductor-study"), "AUTOTUNE_API": api}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # set, it would win over the study's own cache (autotune.worker.options)
    spec = study_spec(args, hardware)
    db = work / "study.db"
    service = subprocess.Popen([*CLI, "serve", "--db", f"sqlite:///{db}", "--port", str(port)],
                               stdout=(work / "service.log").open("wb"), stderr=subprocess.STDOUT, env=env,
                               start_new_session=True)
    worker: subprocess.Popen[bytes] | None = None
    http = httpx.Client(base_url=api, timeout=60)
    out: dict[str, Any] = {"spec": spec, "registration": how, "allow_workload": allow}
    try:
        wait_healthy(http, service)
        created = http.post("/v1/studies", json=spec)
        if created.status_code != 201:
            raise SystemExit(f"study refused ({created.status_code}): {created.text}")
        start = time.time()
        cmd = [*CLI, "worker", "--api", api, "--device", args.device, "--study", spec["name"],
               "--allow-workload", allow, "--idle-exit", "60", "--spool-dir", str(work / "spool")]
        if args.device == "cpu":
            cmd += ["--threads", str(args.threads)]
        worker = subprocess.Popen(cmd, stdout=(work / "worker.log").open("wb"), stderr=subprocess.STDOUT,
                                  env=env, start_new_session=True)
        _log(f"study {spec['name']}: worker {worker.pid} on {args.device}; workload registered by {how}")
        state, seen = "running", -1
        while time.time() < deadline:
            try:
                worker.wait(timeout=3.0)
                break
            except subprocess.TimeoutExpired:
                pass
            info = http.get(f"/v1/studies/{spec['name']}").json()
            state = info["state"]
            done = sum(v for k, v in info["counts"].items() if k not in ("running", "waiting", "pending"))
            if done != seen:
                seen = done
                _log(f"  {state}: {info['counts']}")
            if state == "finished":
                break
        stopped_early = state != "finished"
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)  # ends its probe, reports the trial as interrupted
            try:
                worker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
        out["study_s"] = time.time() - start
        info = http.get(f"/v1/studies/{spec['name']}").json()
        out["study_info"] = info
        out["stopped_by_deadline"] = stopped_early
        trials = http.get(f"/v1/studies/{spec['name']}/trials").json()["data"]
        out["trials"] = [_trial_summary(t) for t in trials]
        out["trial_s"] = _phase_seconds(trials)
        # the verdict, as the CLI prints it: exit 0 certified, 1 no certified pick
        best_env = {**env, "AUTOTUNE_API": api}
        js = subprocess.run([*CLI, "best", spec["name"], "--format", "json"], capture_output=True, text=True,
                            env=best_env, timeout=60)
        out["best_exit"] = js.returncode
        out["best_stderr"] = js.stderr[-2000:]
        try:
            out["best"] = json.loads(js.stdout)
        except json.JSONDecodeError:
            out["best"] = None
            out["best_stdout"] = js.stdout[-2000:]
        ym = subprocess.run([*CLI, "best", spec["name"], "--format", "yaml"], capture_output=True, text=True,
                            env=best_env, timeout=60)
        out["best_yaml"] = ym.stdout
        (work / "best.yaml").write_text(ym.stdout)
        if out["best"] is not None and not out["best"].get("certified"):
            un = subprocess.run([*CLI, "best", spec["name"], "--uncertified", "--format", "yaml"],
                                capture_output=True, text=True, env=best_env, timeout=60)
            out["uncertified_yaml"] = un.stdout
            if un.stdout.strip() and "no uncertified candidate" not in un.stdout:
                (work / "uncertified.yaml").write_text(un.stdout)
        status = subprocess.run([*CLI, "status", spec["name"]], capture_output=True, text=True,
                                env={**best_env, "COLUMNS": "200"}, timeout=60)
        out["status_text"] = status.stdout[-6000:]
        try:
            out["probe_data_wait"] = probe_data_wait(db)
        except Exception as e:  # a report, never a reason to lose the run
            out["probe_data_wait_error"] = repr(e)
    finally:
        if worker is not None and worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
        service.terminate()
        try:
            service.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(service.pid, signal.SIGKILL)
        out["worker_log_tail"] = _tail(work / "worker.log")
        out["service_log_tail"] = _tail(work / "service.log", 2000)
    return out


def probe_data_wait(db: Path) -> dict[str, dict[str, float]]:
    """Per trial (number, as a string): the probe's data wait over its timed windows, as a fraction
    and in ms per optimizer step (its fetches of the step's micro-batches, the blocking copies'
    wait for the GPU included), read from the study's SQLite file (Optuna's user attributes)."""
    import sqlite3

    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = con.execute("SELECT t.number, a.key, a.value_json FROM trials t JOIN trial_user_attributes a "
                           "ON a.trial_id = t.trial_id WHERE a.key IN ('measurement', 'data_wait_fraction', "
                           "'throughput_samples_per_s', 'config')").fetchall()
    finally:
        con.close()
    attrs: dict[int, dict[str, Any]] = {}
    for number, key, value in rows:
        if key == "measurement":  # today's layout: the probe's measurement in one user attribute
            attrs.setdefault(number, {}).update({k: v for k, v in (json.loads(value) or {}).items()
                                                 if k in ("data_wait_fraction", "throughput_samples_per_s")})
        else:  # older studies: one attribute each
            attrs.setdefault(number, {})[key] = json.loads(value)
    out: dict[str, dict[str, float]] = {}
    for number, a in attrs.items():
        frac, thr, cfg = a.get("data_wait_fraction"), a.get("throughput_samples_per_s"), a.get("config") or {}
        if isinstance(frac, (int, float)) and isinstance(thr, (int, float)) and thr > 0:
            per_step = (cfg.get("batch_size") or 16) * (cfg.get("accum_steps") or 1)
            out[str(number)] = {"fraction": frac, "ms_per_step": 1e3 * frac * per_step / thr,
                                "step_ms": 1e3 * per_step / thr}
    return out


def _trial_summary(t: dict[str, Any]) -> dict[str, Any]:
    keys = ("number", "state", "role", "config", "throughput_samples_per_s", "quality", "feasible", "failure",
            "prune_reason", "starting_point", "repeat_of", "baseline_repeat_of", "remeasure_of", "remeasure_round",
            "duration_s", "feasibility_note", "attempt", "retry_of")
    return {k: t.get(k) for k in keys}


def _phase_seconds(trials: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds of trial wall time by role (search includes the starting points)."""
    phases: dict[str, float] = {}
    for t in trials:
        d = t.get("duration_s")
        if isinstance(d, (int, float)):
            phases[t.get("role") or "search"] = phases.get(t.get("role") or "search", 0.0) + d
    return phases


# --- 2. the script's own loop -----------------------------------------------------------------------

class LoopClock:
    """The timing state of one loop run: marks at three iteration boundaries (the end of the
    warm-up, half-way, the end), each after a device synchronize (every launched step has then
    finished: the host clock times the GPU's work too); the training samples fetched between the
    first and the last; the evaluations' time inside that window; the host time of the batches'
    sampling, of their copies to the device and of autotune.apply's step."""

    def __init__(self, warmup_iters: int, cuda: bool, windows: int = 0,
                 handoff: Callable[[], None] | None = None, breakdown: bool = True) -> None:
        import torch

        self.warmup_iters = warmup_iters
        # windows > 0: the timed iterations also in that many equal windows, each timed between
        # synchronized marks; handoff() runs at every window edge, after one window's end mark and
        # before the next one's start (bench/probe_loop_gap.py --same-process hands the GPU to a
        # probe there), so the time it takes is in no window
        self.windows, self.handoff = windows, handoff
        self.edges: list[int] = []
        self.edge_set: frozenset[int] = frozenset()  # the check every iteration makes: O(1)
        # breakdown: the host time of the batches' sampling, their copies and apply's step, each
        # timed apart (a few clock reads an iteration); off, the loop runs the script's calls as written
        self.breakdown = breakdown
        self.window_s: list[float] = []
        self.window_samples: list[int] = []
        self._open: tuple[float, int, float] | None = None  # (start, samples, eval_s) of the open window
        self.owner = threading.get_ident()  # the loop's thread: a probe in another thread calls the originals
        self.device = torch.device("cuda" if cuda else "cpu")
        self.sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
        self.marks: dict[int, float] = {}
        self.samples, self.half_samples = 0, 0
        self.eval_s, self.half_eval_s = 0.0, 0.0
        self.batch_host_s, self.batch_copy_s, self.step_s = 0.0, 0.0, 0.0
        self.inside = False  # between the first and the last mark
        self.evaluating = False  # inside the script's evaluation (its batches are not training samples)
        self.iters: int | None = None
        self.k0 = self.mid = 0
        self.trace_path: str | None = None  # --trace: a Chrome trace of the warm-up's last iterations
        self.trace_iters = 0
        self.profiler: Any = None

    def only_mine(self, original: Callable[..., Any], wrapper: Callable[..., Any]) -> Callable[..., Any]:
        """wrapper when the loop's thread calls, else the script's own function untouched (a probe
        interleaved with the loop in one process imports the same module and calls its functions)."""

        def dispatch(*a: Any, **kw: Any) -> Any:
            return (wrapper if threading.get_ident() == self.owner else original)(*a, **kw)

        return dispatch

    def traced(self, name: str) -> Any:
        """A named range for the trace (autotune.step, autotune.data: bench/trace_summary.py reads
        them), or nothing while no profiler runs."""
        if self.profiler is None:
            return contextlib.nullcontext()
        import torch

        return torch.profiler.record_function(name)

    def _trace(self, it: float) -> None:
        """With --trace: profile iterations [k0 - 2 - n, k0 - 2), the warm-up's last but two."""
        if self.trace_path is None or self.iters is None:
            return
        first = self.k0 - 2 - self.trace_iters
        if it == first and self.profiler is None and first > 0:
            from autotune.engine.timing import start_trace

            self.profiler = start_trace(self.device)
        elif it == self.k0 - 2 and self.profiler is not None:
            from autotune.engine.timing import stop_trace

            stop_trace(self.profiler, self.device, self.trace_path)
            self.profiler = None

    def plan(self, iters: int) -> None:
        """The iteration count main() settled on (scaled with --config), once."""
        if self.iters is None:
            self.k0 = min(max(self.warmup_iters, iters // 5), iters - 2)
            self.iters, self.mid = iters, self.k0 + (iters - self.k0) // 2
            if self.windows:
                span = iters - self.k0
                if span < self.windows:
                    raise SystemExit(f"{span} timed iterations cannot make {self.windows} windows: "
                                     "raise the iterations")
                self.edges = [self.k0 + round(j * span / self.windows) for j in range(self.windows + 1)]
                self.edge_set = frozenset(self.edges)

    def boundary(self, it: float) -> None:
        """Iteration boundary `it` (the script's own count): mark the clock at the three."""
        self._trace(it)
        if it in (self.k0, self.mid, self.iters):
            self.sync()
            self.marks[int(it)] = time.perf_counter()
            if it == self.k0:
                self.inside = True
            elif it == self.mid:
                self.half_samples, self.half_eval_s = self.samples, self.eval_s
            else:
                self.inside = False
        if it in self.edge_set:
            self._window_edge(int(it))

    def _window_edge(self, it: int) -> None:
        self.sync()
        now = time.perf_counter()
        if self._open is not None:
            t0, samples0, eval0 = self._open
            self.window_s.append(now - t0 - (self.eval_s - eval0))  # evaluations left out, as in train_s
            self.window_samples.append(self.samples - samples0)
            self._open = None
        if self.handoff is not None:
            self.handoff()
        if it != self.edges[-1]:
            self._open = (time.perf_counter(), self.samples, self.eval_s)

    def counting(self) -> bool:
        return self.inside and not self.evaluating

    def count(self, samples: int, host_s: float, copy_s: float) -> None:
        self.samples += samples
        self.batch_host_s += host_s
        self.batch_copy_s += copy_s

    def evaluation(self, fn: Callable[..., Any], *a: Any, **kw: Any) -> float:
        """The script's evaluation, timed inside the window (left out of the training rate)."""
        self.evaluating = True
        try:
            if not self.inside:
                return float(fn(*a, **kw))
            self.sync()
            t0 = time.perf_counter()
            value = float(fn(*a, **kw))  # a Python float: its .item()s synchronized already
            self.eval_s += time.perf_counter() - t0
            return value
        finally:
            self.evaluating = False


def instrument_gpt_script(script: Any, clock: LoopClock) -> None:
    """gpt_script.train: get_lr (called at the top of every iteration) marks, get_batch("train")
    counts, estimate_loss is timed."""
    get_lr, get_batch, estimate_loss = script.get_lr, script.get_batch, script.estimate_loss

    def timed_get_lr(it: float, max_iters: int = script.max_iters) -> float:
        clock.plan(max_iters)
        clock.boundary(it)
        return get_lr(it, max_iters)  # type: ignore[no-any-return]

    def counted_get_batch(split: str, n: int | None = None, device: str = script.device,
                          generator: Any = None) -> Any:
        n = n or script.batch_size  # the size's, read when called (main() sets it after this wrapping)
        if not (split == "train" and clock.counting()):
            with clock.traced(TRACE_DATA):
                return get_batch(split, n, device, generator)
        if not clock.breakdown:
            clock.count(n, 0.0, 0.0)
            return get_batch(split, n, device, generator)
        # the same call in two timed parts: the windows sampled on the host (get_batch onto "cpu",
        # where its .to() is a no-op), then the script's own two copies, x.to(device), y.to(device)
        # (blocking: each waits for the work queued on the GPU before it)
        t0 = time.perf_counter()
        x, y = get_batch(split, n, "cpu", generator)
        t1 = time.perf_counter()
        moved = x.to(device), y.to(device)
        clock.count(n, t1 - t0, time.perf_counter() - t1)
        return moved

    def timed_estimate_loss(*a: Any, **kw: Any) -> float:
        return clock.evaluation(estimate_loss, *a, **kw)

    script.get_lr, script.get_batch, script.estimate_loss = (
        clock.only_mine(get_lr, timed_get_lr), clock.only_mine(get_batch, counted_get_batch),
        clock.only_mine(estimate_loss, timed_estimate_loss))


def instrument_hf_causal_lm(script: Any, clock: LoopClock) -> None:
    """hf_causal_lm.train: the scheduler get_linear_schedule_with_warmup returns is stepped once at
    the end of every iteration (plain loop and --config alike): its step() marks; get_batch counts
    (the training batches: not those of val_loss), val_loss is timed."""
    factory, get_batch, val_loss = script.get_linear_schedule_with_warmup, script.get_batch, script.val_loss

    def marked_factory(optimizer: Any, num_warmup_steps: int, num_training_steps: int, *a: Any, **kw: Any) -> Any:
        scheduler = factory(optimizer, num_warmup_steps, num_training_steps, *a, **kw)
        clock.plan(num_training_steps)
        step, done = scheduler.step, [0]

        def marked_step(*sa: Any, **skw: Any) -> Any:
            out = step(*sa, **skw)
            done[0] += 1  # iterations finished
            clock.boundary(done[0])
            return out

        scheduler.step = marked_step
        return scheduler

    def counted_get_batch(ids: Any, n: int, block_size: int, generator: Any = None,
                          device: str = script.device) -> Any:
        if not clock.counting():
            with clock.traced(TRACE_DATA):
                return get_batch(ids, n, block_size, generator, device)
        if not clock.breakdown:
            clock.count(n, 0.0, 0.0)
            return get_batch(ids, n, block_size, generator, device)
        # the same call in two timed parts: the windows sampled on the host (get_batch onto "cpu",
        # where its .to() is a no-op), then its copy to the device (blocking: it waits for the work
        # queued on the GPU before it); a tensor the batch holds twice (labels = input_ids) moved once
        t0 = time.perf_counter()
        batch = get_batch(ids, n, block_size, generator, "cpu")
        t1 = time.perf_counter()
        moved: dict[int, Any] = {}
        for value in batch.values():
            if id(value) not in moved:
                moved[id(value)] = value.to(device)
        out = {key: moved[id(value)] for key, value in batch.items()}
        clock.count(n, t1 - t0, time.perf_counter() - t1)
        return out

    def timed_val_loss(*a: Any, **kw: Any) -> float:
        return clock.evaluation(val_loss, *a, **kw)

    script.get_linear_schedule_with_warmup, script.get_batch, script.val_loss = (
        clock.only_mine(factory, marked_factory), clock.only_mine(get_batch, counted_get_batch),
        clock.only_mine(val_loss, timed_val_loss))


# the script's module-level names each instrument_* function wraps (time_loop puts them back)
INSTRUMENTED = {"gpt_script": ("get_lr", "get_batch", "estimate_loss"),
                "hf_causal_lm": ("get_linear_schedule_with_warmup", "get_batch", "val_loss")}


def time_loop(job: Job, preset: str, max_iters: int, warmup_iters: int, config: str | None = None,
              trace: str | None = None, trace_iters: int = 8, windows: int = 0,
              handoff: Callable[[], None] | None = None, breakdown: bool = True) -> dict[str, Any]:
    """One timed run of the script's main(), its functions wrapped for the run and restored after it:
    a process may time the loop again. windows, handoff: LoopClock's (bench/probe_loop_gap.py
    --same-process interleaves the loop's windows with a probe's)."""
    import torch

    from autotune.engine.apply import Prepared

    script = importlib.import_module(job.script)
    cuda = script.device == "cuda"
    clock = LoopClock(warmup_iters, cuda, windows, handoff, breakdown)
    clock.trace_path, clock.trace_iters = trace, trace_iters
    originals = {name: getattr(script, name) for name in INSTRUMENTED[job.key]}
    step = Prepared.step
    t_start = time.perf_counter()
    globals()[job.instrument](script, clock)
    if config and breakdown:  # the host time of autotune.apply's step (the script as written never imports autotune)

        def timed_step(self: Any, batch: Any) -> Any:
            if not clock.inside:
                with clock.traced(TRACE_STEP):
                    return step(self, batch)
            t0 = time.perf_counter()
            out = step(self, batch)
            clock.step_s += time.perf_counter() - t0
            return out

        Prepared.step = clock.only_mine(step, timed_step)  # type: ignore[method-assign]
    argv = [job.steps_flag, str(max_iters), *job.loop_argv(preset)]
    argv += ["--config", config] if config else []
    try:
        val_loss = script.main(argv)
    finally:
        for name, fn in originals.items():
            setattr(script, name, fn)
        Prepared.step = step  # type: ignore[method-assign]
    total_s = time.perf_counter() - t_start
    k0, mid, end = clock.k0, clock.mid, clock.iters
    assert end is not None, f"{job.script}.main() never reached the instrumented iteration count"
    m = clock.marks
    window = m[end] - m[k0]
    train_s = window - clock.eval_s
    first = (m[mid] - m[k0]) - clock.half_eval_s
    second = (m[end] - m[mid]) - (clock.eval_s - clock.half_eval_s)
    second_samples = clock.samples - clock.half_samples
    windowed: dict[str, Any] = {}
    if clock.window_s:  # the marks span the handoffs too: the windows' own sums time the training
        train_s = sum(clock.window_s)
        window = train_s + clock.eval_s
        half = len(clock.window_s) // 2
        first, second = sum(clock.window_s[:half]), sum(clock.window_s[half:])
        clock.samples, clock.half_samples = sum(clock.window_samples), sum(clock.window_samples[:half])
        second_samples = clock.samples - clock.half_samples
        windowed["window_samples_per_s"] = [n / t for n, t in zip(clock.window_samples, clock.window_s, strict=True)]
    return {**windowed,
        "job": job.key, "argv": argv,
        "config": config, "max_iters_arg": max_iters, "iterations": end, "warmup_iterations": k0,
        "timed_iterations": end - k0, "samples": clock.samples, "window_s": window, "eval_s": clock.eval_s,
        "train_s": train_s, "train_samples_per_s": clock.samples / train_s,
        "loop_samples_per_s": clock.samples / window,
        "halves_samples_per_s": [clock.half_samples / first, second_samples / second],
        "main_s": total_s, "warmup_s": m[k0] - t_start, "final_val_loss": val_loss,
        # host milliseconds per timed iteration: sampling the windows, the blocking copies (with the
        # wait for the GPU), autotune.apply's step (with --config), and the rest (the plain path's own
        # forward/backward/clip/step, the lr writes, the loss logging)
        "per_iteration_ms": {
            "get_batch_host": 1e3 * clock.batch_host_s / (end - k0),
            "get_batch_copy": 1e3 * clock.batch_copy_s / (end - k0),
            "apply_step": 1e3 * clock.step_s / (end - k0) if config and breakdown else None,
            "rest": 1e3 * (train_s - clock.batch_host_s - clock.batch_copy_s - clock.step_s) / (end - k0),
            "total": 1e3 * train_s / (end - k0)},
        "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}


def loop_child(args: argparse.Namespace) -> None:
    """In a fresh process: the script's main() with timing wrapped around its own functions."""
    result = time_loop(JOBS[args.job], args.preset, args.max_iters, args.warmup_iters, args.config, args.trace,
                       args.trace_iters)
    Path(args.result).write_text(json.dumps(result))


def run_loops(args: argparse.Namespace, work: Path, configs: dict[str, str | None], deadline: float
              ) -> list[dict[str, Any]]:
    """The script's loop per config (name -> best.yaml path or None for the script as written),
    `repeats` fresh processes each, interleaved, while the deadline allows."""
    job = JOBS[args.job]
    _, extra_env, _ = registration(job)
    # the loops' own inductor cache (a cold first compile, in the warm-up), or with
    # --shared-inductor-cache the study's: a user's loop after a study on the same host finds the
    # study's kernels in torch's default cache (the study's is its own only to keep studies apart)
    cache = work / ("inductor-study" if args.shared_inductor_cache else "inductor-loop")
    env = {**os.environ, **extra_env, "PYTHONUNBUFFERED": "1", "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    if args.device == "cpu":  # as the worker runs its CPU probes (--threads): a busy host's cores oversubscribed
        env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    preset = args.preset or job.preset(args.device)
    names = list(configs)
    runs: list[dict[str, Any]] = []
    took: dict[str, float] = {}
    for r in range(args.repeats):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            expected = took.get(name, args.first_run_s)
            if time.time() + expected * 1.3 + 10 > deadline:
                _log(f"  loop {name} repeat {r}: skipped, {deadline - time.time():.0f} s left (needs ~{expected:.0f})")
                continue
            result_path = work / f"loop-{name}-{r}.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "_loop", "--job", job.key, "--preset", preset,
                   "--max-iters", str(args.loop_iters), "--warmup-iters", str(args.warmup_iters),
                   "--result", str(result_path)]
            if configs[name]:
                cmd += ["--config", str(configs[name])]
            t0 = time.time()
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(work),
                                      timeout=max(10.0, deadline - time.time() - 5))
                code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
            except subprocess.TimeoutExpired as e:
                code, stdout, stderr = -9, str(e.stdout or ""), "timed out"
            wall = time.time() - t0
            took[name] = wall
            run: dict[str, Any] = {"name": name, "repeat": r, "process_wall_s": wall, "exit": code}
            if code == 0 and result_path.exists():
                run.update(json.loads(result_path.read_text()))
                _log(f"  loop {name} repeat {r}: {run['train_samples_per_s']:,.0f} samples/s training "
                     f"({run['loop_samples_per_s']:,.0f} with its evaluations), {run['iterations']} iterations, "
                     f"process {wall:.1f} s")
            else:
                run["failure"] = (stderr or "")[-3000:]
                _log(f"  loop {name} repeat {r}: FAILED (exit {code}): {(stderr or '')[-400:]}")
            run["stdout_tail"] = stdout[-600:]
            runs.append(run)
    return runs


# --- 3. the comparison ------------------------------------------------------------------------------

def _geomean(values: list[float]) -> float | None:
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else None


def loop_ratio(pick: list[float], base: list[float]) -> dict[str, Any]:
    """The ratio of geometric means with a Welch 95 % interval (autotune.contract.verdict, α = 0.025 a side)."""
    from autotune.contract.verdict import Sample, welch

    out: dict[str, Any] = {"speedup": None, "ci_low": None, "ci_high": None, "n_pick": len(pick), "n_base": len(base)}
    gp, gb = _geomean(pick), _geomean(base)
    if gp is None or gb is None:
        return out
    out["speedup"] = gp / gb
    if len(pick) >= 2 and len(base) >= 2:
        d = welch(Sample.of([math.log(v) for v in pick]), Sample.of([math.log(v) for v in base]))
        low, high = d.bounds(0.025)
        out["ci_low"], out["ci_high"] = math.exp(low), math.exp(high)
    return out


def compare(data: dict[str, Any]) -> dict[str, Any]:
    """The verdict's speedup beside the loop's, per compared config."""
    best = (data.get("study") or {}).get("best") or {}
    rows = {r["trial_number"]: r for r in best.get("configs") or []}
    base_row = next((r for r in rows.values() if r["role"] == "baseline"), None)
    runs = [r for r in data.get("loops") or [] if "train_samples_per_s" in r]

    def rates(name: str, key: str = "train_samples_per_s") -> list[float]:
        return [r[key] for r in runs if r["name"] == name]

    base_rates = rates("baseline")
    study = data.get("study") or {}
    waits = study.get("probe_data_wait") or {}
    trials = study.get("trials") or []

    def probe_wait(target: int | None) -> dict[str, float | None]:
        """The probe's data wait and step time (ms per optimizer step), median over the verdict's
        runs of `target`: its re-measurements (the baseline: its seeds too)."""
        if target is None:
            return {"data_wait_ms": None, "step_ms": None}
        numbers = [t["number"] for t in trials if t.get("remeasure_of") == target
                   or (base_row is not None and target == base_row["trial_number"] and t.get("role") == "baseline")]
        got = [waits[str(n)] for n in numbers if str(n) in waits]
        if not got:
            return {"data_wait_ms": None, "step_ms": None}
        return {"data_wait_ms": statistics.median(g["ms_per_step"] for g in got),
                "step_ms": statistics.median(g["step_ms"] for g in got)}

    def per_iteration(name: str) -> dict[str, float | None]:
        parts = [r["per_iteration_ms"] for r in runs if r["name"] == name and r.get("per_iteration_ms")]
        keys = ("get_batch_host", "get_batch_copy", "apply_step", "rest", "total")
        return {k: (statistics.median(vals) if (vals := [p[k] for p in parts if p.get(k) is not None]) else None)
                for k in keys}
    out: dict[str, Any] = {"agree_within": AGREE, "baseline": {
        "probe_samples_per_s": base_row["throughput_samples_per_s"] if base_row else None,
        "probe_runs": base_row["n"] if base_row else None,
        "loop_train_samples_per_s": _geomean(base_rates), "loop_runs": len(base_rates),
        "loop_with_eval_samples_per_s": _geomean(rates("baseline", "loop_samples_per_s")),
        "loop_val_loss": _mean([r.get("final_val_loss") for r in runs if r["name"] == "baseline"]),
        "loop_ms_per_iteration": per_iteration("baseline"),
        "probe_ms_per_step": probe_wait(base_row["trial_number"] if base_row else None),
        "samples_per_iteration": next((r["samples"] // r["timed_iterations"] for r in runs
                                       if r["name"] == "baseline"), None)}}
    picks: list[tuple[str, dict[str, Any] | None]] = []
    if best.get("certified"):
        picks.append(("pick", rows.get(best.get("trial_number"))))
    else:
        picks.append(("best_yaml", None))  # the baseline's own config through apply
        un = best.get("uncertified")
        if un:
            picks.append(("uncertified", rows.get(un["trial_number"], un)))
    for name in dict.fromkeys(r["name"] for r in runs):
        if name.startswith("trial") and name[5:].isdigit():
            picks.append((name, rows.get(int(name[5:]))))
    for name, row in picks:
        mine = rates(name)
        lr = loop_ratio(mine, base_rates)
        lw = loop_ratio(rates(name, "loop_samples_per_s"), rates("baseline", "loop_samples_per_s"))
        verdict_speedup = row.get("speedup") if row else None
        entry: dict[str, Any] = {
            "trial_number": row.get("trial_number") if row else None, "status": row.get("status") if row else None,
            "config": row.get("config") if row else None,
            "probe_samples_per_s": row.get("throughput_samples_per_s") if row else None,
            "probe_runs": row.get("n") if row else None,
            "verdict_speedup": verdict_speedup, "verdict_ci_low": row.get("speedup_ci_low") if row else None,
            "verdict_ci_high": row.get("speedup_ci_high") if row else None,
            "probe_quality": row.get("quality_mean") if row else None,
            "loop_train_samples_per_s": _geomean(mine), "loop_runs": len(mine),
            "loop_speedup": lr["speedup"], "loop_ci_low": lr["ci_low"], "loop_ci_high": lr["ci_high"],
            "loop_with_eval_speedup": lw["speedup"],
            "loop_val_loss": _mean([r.get("final_val_loss") for r in runs if r["name"] == name]),
            "loop_ms_per_iteration": per_iteration(name),
            "probe_ms_per_step": probe_wait(row.get("trial_number") if row else None),
            "samples_per_iteration": next((r["samples"] // r["timed_iterations"] for r in runs if r["name"] == name),
                                          None),
            "loop_over_verdict": None, "agree": None}
        if verdict_speedup and lr["speedup"]:
            entry["loop_over_verdict"] = lr["speedup"] / verdict_speedup
            entry["agree"] = abs(entry["loop_over_verdict"] - 1.0) <= AGREE
        out[name] = entry
    return out


def _mean(values: list[Any]) -> float | None:
    vals = [v for v in values if isinstance(v, (int, float))]
    return statistics.fmean(vals) if vals else None


def _fmt(v: Any, spec: str = ",.0f") -> str:
    return "n/a" if v is None else format(v, spec)


def markdown(data: dict[str, Any]) -> str:
    env = data.get("environment", {})
    study = data.get("study") or {}
    best = study.get("best") or {}
    cmp_ = data.get("comparison") or {}
    job = job_of(data)
    spec = study.get("spec") or {}
    lines = [f"### {job.workload} (preset {spec.get('preset')}): the verdict against the script's own loop "
             f"({env.get('gpu')}, torch {env.get('torch')}, {env.get('date')})", ""]
    loop_env = data.get("loop_environment")
    if loop_env:
        lines += [f"(The loop timings ran later, on {loop_env.get('gpu')} host {loop_env.get('host')}, "
                  f"{loop_env.get('date')}.)", ""]
    if best:
        lines.append(f"Verdict: **{best.get('outcome')}**"
                     f"{' (certified)' if best.get('certified') else ' (not certified)'}; {best.get('verdict')}")
        lines.append(f"Rounds {best.get('rounds_run')} of at most {best.get('max_rounds')}, "
                     f"{best.get('remeasure_probes')} re-measurements; study {study.get('study_s', 0):.0f} s "
                     f"({len(study.get('trials') or [])} trials).")
    else:
        lines.append(f"No verdict (best exit {study.get('best_exit')}): {study.get('best_stderr', '')[-300:]}")
    lines += ["", "| config | probe samples/s (runs) | loop samples/s, training (runs) | verdict speedup [interval] "
                  "| loop speedup [95 % interval] | loop / verdict | agree ≤ 10 % |",
              "|---|---:|---:|---:|---:|---:|---|"]
    b = cmp_.get("baseline") or {}
    space = ((study.get("spec") or {}).get("space") or {}).get("params") or {}
    shown = set(space) | {"batch_size", "accum_steps"}
    base_cfg = spec.get("baseline") or {}
    as_written = f"{base_cfg.get('batch_size', 16)} × {base_cfg.get('accum_steps', 1)}" + (
        f", {base_cfg['precision']}" if base_cfg.get("precision") else "")
    lines.append(f"| baseline (script as written, {as_written}) | {_fmt(b.get('probe_samples_per_s'))} "
                 f"({b.get('probe_runs')}) | {_fmt(b.get('loop_train_samples_per_s'))} ({b.get('loop_runs')}) "
                 "| 1 | 1 | | |")
    for name in [n for n in cmp_ if n not in ("agree_within", "baseline")]:
        e = cmp_[name]
        label = {"pick": "certified pick", "best_yaml": "best.yaml (the baseline's config, through apply)",
                 "uncertified": "fastest uncertified"}.get(name, "another candidate")
        if e.get("trial_number") is not None:
            label += f" (trial {e['trial_number']}, {e.get('status')})"
        vs = (f"{e['verdict_speedup']:.2f}× [{_fmt(e.get('verdict_ci_low'), '.2f')}–"
              f"{_fmt(e.get('verdict_ci_high'), '.2f')}]" if e.get("verdict_speedup") else "n/a")
        ls = (f"{e['loop_speedup']:.2f}× [{_fmt(e.get('loop_ci_low'), '.2f')}–{_fmt(e.get('loop_ci_high'), '.2f')}]"
              if e.get("loop_speedup") else "n/a")
        agree = "n/a" if e.get("agree") is None else ("yes" if e["agree"] else "**no**")
        lines.append(f"| {label} | {_fmt(e.get('probe_samples_per_s'))} ({e.get('probe_runs')}) | "
                     f"{_fmt(e.get('loop_train_samples_per_s'))} ({e.get('loop_runs')}) | {vs} | {ls} | "
                     f"{_fmt(e.get('loop_over_verdict'), '.3f')} | {agree} |")
        if e.get("config"):
            knobs = {k: v for k, v in e["config"].items() if k in shown}
            lines.append(f"|  its config | `{json.dumps(knobs)}` | | | | | |")
    lines += ["", "Where an iteration's host time goes in the script's loop (ms, median over the runs; the copies "
                  "block until the GPU's queued work is done):", "",
              "| config | samples / iteration | get_batch: sampling | get_batch: copies (+ GPU wait) "
              "| autotune.apply step | rest | total | probe: data wait (sample_batch) | probe: step |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in [n for n in cmp_ if n != "agree_within"]:
        e = cmp_[name]
        ms = e.get("loop_ms_per_iteration") or {}
        spi = e.get("samples_per_iteration")
        probe = e.get("probe_samples_per_s")
        pw = e.get("probe_ms_per_step") or {}
        probe_ms = pw.get("step_ms") or (1e3 * spi / probe if spi and probe else None)
        lines.append(f"| {name} | {spi} | {_fmt(ms.get('get_batch_host'), '.3f')} | "
                     f"{_fmt(ms.get('get_batch_copy'), '.3f')} | {_fmt(ms.get('apply_step'), '.3f')} | "
                     f"{_fmt(ms.get('rest'), '.3f')} | {_fmt(ms.get('total'), '.3f')} | "
                     f"{_fmt(pw.get('data_wait_ms'), '.3f')} | {_fmt(probe_ms, '.3f')} |")
    return "\n".join(lines)


# --- the commands ------------------------------------------------------------------------------------

def loop_configs(study: dict[str, Any], work: Path, candidates: bool) -> dict[str, str | None]:
    """What the loop times: name -> a config file for --config (None: the script as written).
    The certified pick's best.yaml; without one, best.yaml (the baseline's own config, through
    apply) and the fastest uncertified candidate; with `candidates`, every other re-measured
    candidate too (its config as the verdict's row holds it)."""
    import yaml

    from autotune.contract.config import KNOBS

    best = study.get("best") or {}
    configs: dict[str, str | None] = {"baseline": None}
    if not best:
        return configs
    (work / "best.yaml").write_text(study.get("best_yaml") or "{}\n")
    if best.get("certified"):
        configs["pick"] = str(work / "best.yaml")
        shown = {best.get("trial_number")}
    else:
        configs["best_yaml"] = str(work / "best.yaml")
        un = study.get("uncertified_yaml") or ""
        shown = set()
        if best.get("uncertified") and "no uncertified candidate" not in un:
            (work / "uncertified.yaml").write_text(un)
            configs["uncertified"] = str(work / "uncertified.yaml")
            shown = {best["uncertified"]["trial_number"]}
    if candidates:
        for row in best.get("configs") or []:
            if row["role"] == "candidate" and row["n"] > 0 and row["trial_number"] not in shown:
                path = work / f"trial{row['trial_number']}.yaml"
                path.write_text(yaml.safe_dump({k: v for k, v in row["config"].items() if k in KNOBS},
                                               sort_keys=False))
                configs[f"trial{row['trial_number']}"] = str(path)
    return configs


def cmd_run(args: argparse.Namespace) -> None:
    t_begin = time.time()
    deadline = t_begin + args.deadline_s
    from studylib import environment, hardware_class

    out_path = Path(args.out)
    job = JOBS[args.job]
    args.study = args.study or (STUDY if job.key == "gpt_script" else f"{job.workload}-verdict")
    work = Path(args.workdir or tempfile.mkdtemp(prefix=f"{job.workload}-verdict-"))
    work.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {"benchmark": "gpt_script_verdict", "job": job.key, "argv": sys.argv[1:],
                            "environment": environment(args.device)}
    hardware = hardware_class(args.device)
    _log(f"{hardware}; work dir {work}; deadline in {args.deadline_s:.0f} s")
    study_deadline = min(deadline - args.loop_reserve_s, t_begin + args.study_budget_s)
    data["study"] = run_study(args, work, hardware, study_deadline)
    _write_json(out_path, data)
    if args.copy_db:
        shutil.copy(work / "study.db", Path(args.copy_db))
    best = data["study"].get("best")
    _log(f"verdict: {None if best is None else best.get('verdict')}")
    configs = loop_configs(data["study"], work, args.candidates)
    if args.repeats > 0:
        data["loops"] = run_loops(args, work, configs, deadline - 15)
    data["comparison"] = compare(data)
    data["elapsed_s"] = time.time() - t_begin
    _write_json(out_path, data)
    if args.png:
        _plot_if_possible(data, Path(args.png))
    print(markdown(data))


def cmd_loop(args: argparse.Namespace) -> None:
    """The loop timings alone, from an earlier run's JSON (its best.yaml / uncertified YAML)."""
    t_begin = time.time()
    from resultfiles import load
    from studylib import environment

    data = load(getattr(args, "from"))  # whole: its raw fields too (bench/resultfiles.py)
    job = job_of(data, args.job)
    study = data.get("study") or {}
    args.job, data["job"] = job.key, job.key
    args.preset = args.preset or (study.get("spec") or {}).get("preset")
    work = Path(args.workdir or tempfile.mkdtemp(prefix=f"{job.workload}-loop-"))
    work.mkdir(parents=True, exist_ok=True)
    configs = loop_configs(study, work, args.candidates)
    data["loop_environment"] = environment(args.device)
    data["loops"] = run_loops(args, work, configs, t_begin + args.deadline_s - 15)
    data["comparison"] = compare(data)
    _write_json(Path(args.out), data)
    if args.png:
        _plot_if_possible(data, Path(args.png))
    print(markdown(data))


def _plot_if_possible(data: dict[str, Any], png: Path) -> None:
    """The PNG after a run, whose JSON is written already: a host without matplotlib (a lent GPU's)
    still prints the summary; `plot --json` draws it later elsewhere."""
    try:
        plot(data, png)
    except ImportError as e:
        _log(f"no PNG ({e}): draw it later from the JSON with `plot --json OUT.json --png {png.name}`")


def plot(data: dict[str, Any], png: Path) -> None:
    """Left: the verdict's inputs (each run's probe throughput per config, its geometric mean, the
    status and interval). Right: the script's own loop per config (each process), the probe's
    geometric mean beside it."""
    from studylib import pyplot

    plt = pyplot()
    best = (data.get("study") or {}).get("best") or {}
    rows = best.get("configs") or []
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5.5))
    colours = {"baseline": "tab:gray", "certified": "tab:green", "rejected": "tab:red", "undecided": "tab:orange",
               "failed": "black", "stopped": "tab:purple"}
    labels = []
    for i, r in enumerate(rows):
        ys = r.get("throughputs") or []
        xs = [i + (j - (len(ys) - 1) / 2) * 0.06 for j in range(len(ys))]
        c = colours.get(r["status"], "tab:blue")
        a.scatter(xs, ys, color=c, s=22, zorder=3)
        if r.get("throughput_samples_per_s"):
            a.hlines(r["throughput_samples_per_s"], i - 0.3, i + 0.3, color=c, lw=2)
        label = f"{r['role']} (trial {r['trial_number']})\n{r['status']}, {r['n']} runs"
        if r.get("speedup"):
            label += f"\n{r['speedup']:.2f}× [{r.get('speedup_ci_low') or 0:.2f}–{r.get('speedup_ci_high') or 0:.2f}]"
        labels.append(label)
    a.set_xticks(range(len(rows)), labels, fontsize=8)
    a.set_xlim(-0.6, max(len(rows), 1) - 0.4)
    a.set_ylabel("probe samples/s (each run; bar: geometric mean)")
    a.set_ylim(bottom=0)
    a.set_title(f"the verdict's inputs: {best.get('outcome', 'no verdict')}", fontsize=10)
    runs = [r for r in data.get("loops") or [] if "train_samples_per_s" in r]
    names = list(dict.fromkeys(r["name"] for r in runs))
    cmp_ = data.get("comparison") or {}
    labels = []
    for i, name in enumerate(names):
        ys = [r["train_samples_per_s"] for r in runs if r["name"] == name]
        ws = [r["loop_samples_per_s"] for r in runs if r["name"] == name]
        b.scatter([i - 0.08] * len(ys), ys, color="tab:blue", s=22, zorder=3,
                  label="loop, training only" if i == 0 else None)
        b.scatter([i + 0.08] * len(ws), ws, color="tab:cyan", s=22, marker="x", zorder=3,
                  label="loop, with its evaluations" if i == 0 else None)
        e = cmp_.get(name) or {}
        probe = e.get("probe_samples_per_s")
        if probe:
            b.hlines(probe, i - 0.3, i + 0.3, color="tab:green", lw=2, label="probe (the verdict's geometric mean)"
                     if i == 0 else None)
        text = {"pick": "certified pick", "best_yaml": "best.yaml\n(the baseline's)",
                "uncertified": "uncertified"}.get(name, name)
        if e.get("loop_speedup"):
            text += f"\nloop {e['loop_speedup']:.2f}×"
        if e.get("verdict_speedup"):
            text += f"\nverdict {e['verdict_speedup']:.2f}×"
        labels.append(text)
    b.set_xticks(range(len(names)), labels, fontsize=8)
    b.set_xlim(-0.6, max(len(names), 1) - 0.4)
    b.set_ylim(bottom=0)
    b.set_ylabel("samples/s in the script's own loop (each process)")
    job = job_of(data)
    preset = ((data.get("study") or {}).get("spec") or {}).get("preset")
    size = f" {job.size_flag} {preset}" if job.size_flag and preset else ""
    b.set_title(f"python -m {job.script}{size} [--config], steady state", fontsize=10)
    if names:
        b.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.07), ncol=3, frameon=False)
    env = data.get("environment", {})
    fig.suptitle(f"{job.workload} on {env.get('gpu')} (torch {env.get('torch')}, {env.get('date')})", fontsize=11)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def cmd_plot(args: argparse.Namespace) -> None:
    from resultfiles import load

    data = load(args.json)  # whole: its raw fields too (bench/resultfiles.py); --update writes it whole
    if args.db:  # the probes' data wait, from the study's SQLite file (runs that did not record it)
        data["study"]["probe_data_wait"] = probe_data_wait(Path(args.db))
        data["comparison"] = compare(data)
        if args.update:
            _write_json(Path(args.json), data)
    plot(data, Path(args.png))
    print(markdown(data))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)

    def loop_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--device", default="cuda")
        p.add_argument("--threads", type=int, default=1, help="CPU only: torch threads per probe and loop run")
        p.add_argument("--repeats", type=int, default=3, help="fresh processes per config, interleaved")
        p.add_argument("--loop-iters", type=int, default=3000,
                       help="the script's iterations at its own batch (--max-iters; hf_causal_lm: --max-steps)")
        p.add_argument("--preset", default=None, help="the job's preset (default: the job's for the device: "
                       "gpt_script tiny; hf_causal_lm tiny on a CPU, gpu on a GPU); the loop runs its size")
        p.add_argument("--shared-inductor-cache", action="store_true",
                       help="the loops compile with the study's TorchInductor cache (default: their own, cold)")
        p.add_argument("--warmup-iters", type=int, default=100, help="iterations left out at least (else a fifth)")
        p.add_argument("--first-run-s", type=float, default=60.0, help="a config's first loop run's expected wall")
        p.add_argument("--deadline-s", type=float, default=560.0, help="stop starting work after this; JSON written")
        p.add_argument("--workdir", default=None)
        p.add_argument("--out", required=True)
        p.add_argument("--png", default=None)
        p.add_argument("--candidates", action="store_true", help="time every re-measured candidate's loop too")

    r = sub.add_parser("run", help="the study, then the loop timings")
    loop_options(r)
    r.add_argument("--job", choices=JOBS, default="gpt_script", help="the outside script (module docstring)")
    r.add_argument("--study", default=None, help=f"the study's name (default: {STUDY}, or WORKLOAD-verdict)")
    r.add_argument("--samples", type=int, default=16384, help="training samples per probe")
    r.add_argument("--windows", type=int, default=8)
    r.add_argument("--warmup-steps", type=int, default=None)
    r.add_argument("--probe-timeout-s", type=float, default=240.0)
    r.add_argument("--n-trials", type=int, default=12, help="baseline seeds + search trials")
    r.add_argument("--top-k", type=int, default=2)
    r.add_argument("--max-rounds", type=int, default=4)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--no-compile", action="store_true", help="keep compile modes out of the space")
    r.add_argument("--lm-knobs", action="store_true", help="add the LM knobs to the job's space: attention_backend, "
                   "inductor_tuning, lr_scaling (+ hf_attn_implementation, liger_kernels for the HF job)")
    r.add_argument("--study-budget-s", type=float, default=420.0, help="the study's most wall time")
    r.add_argument("--loop-reserve-s", type=float, default=90.0, help="kept for the loop timings at least")
    r.add_argument("--copy-db", default=None, help="copy the study's SQLite file here")
    r.set_defaults(func=cmd_run)

    lp = sub.add_parser("loop", help="the loop timings alone, from an earlier run's JSON")
    loop_options(lp)
    lp.add_argument("--from", required=True)
    lp.add_argument("--job", choices=JOBS, default=None, help="default: the run's (its JSON's job, else gpt_script)")
    lp.set_defaults(func=cmd_loop)

    p = sub.add_parser("plot")
    p.add_argument("--json", required=True)
    p.add_argument("--png", required=True)
    p.add_argument("--db", default=None, help="the study's SQLite file: add the probes' data wait")
    p.add_argument("--update", action="store_true", help="with --db: write the completed JSON back")
    p.set_defaults(func=cmd_plot)

    c = sub.add_parser("_loop", help=argparse.SUPPRESS)  # the child: one timed run of the script's main()
    c.add_argument("--job", choices=JOBS, default="gpt_script")
    c.add_argument("--preset", default="tiny")
    c.add_argument("--max-iters", type=int, required=True)
    c.add_argument("--warmup-iters", type=int, default=100)
    c.add_argument("--config", default=None)
    c.add_argument("--result", required=True)
    c.add_argument("--trace", default=None, help="a Chrome trace of the warm-up's last iterations (with --config)")
    c.add_argument("--trace-iters", type=int, default=8)
    c.set_defaults(func=loop_child)

    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
