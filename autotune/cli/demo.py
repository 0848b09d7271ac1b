"""`autotune demo`: the whole system on one machine without a GPU, in a few minutes.

1. create an admin and a worker token in a SQLite file in the work directory
   (`autotune token create`), then start `autotune serve` on it with auth on (log: serve.log);
2. submit a study (admin token): workload ups, preset tiny, space ups-tiny-cpu (DEMO_SPACE), TPE, hardware cpu;
3. start N `autotune worker --device cpu` processes (logs: worker-N.log; worker token in
   AUTOTUNE_TOKEN), each with cores // N torch threads (at most OMP_NUM_THREADS, if set) so they
   do not thrash one another;
4. show progress until the study is finished; print the Pareto front (throughput vs
   NRMSE), the recommended config with its speedup over the baseline, and the command
   that opens the Optuna dashboard on the same database.

Everything it started is stopped on the way out (normal end, error or Ctrl-C): workers
first (SIGTERM; each fails its running trial as interrupted), then the service.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from types import FrameType

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from autotune.cli.common import make_console, make_folder, say_error
from autotune.cli.report_data import quality_label
from autotune.cli.tables import LOST_LABEL, UNNEEDED_LABEL, recommendation_table, trials_table, verdict_table
from autotune.contract.protocol import ProbeSpec, RemeasureSpec, StudySpec
from autotune.contract.views import LOST_TO_RERUN, UNNEEDED, Recommendation, StudyInfo
from autotune.worker.client import ApiError, Client, NotFound, ServiceUnavailable
from autotune.worker.cpu_share import omp_threads_cap

HEALTH_TIMEOUT_S = 90.0
STOP_GRACE_S = 25.0  # a worker may spend up to 20 s completing its interrupted trial
POLL_S = 1.0
FINISHED = ("COMPLETE", "PRUNED", "FAIL", "REPEAT", UNNEEDED)


def worker_threads(workers: int) -> int:
    """Torch threads for each of `workers` local CPU workers: the cores shared out, at most an
    OMP_NUM_THREADS of this process's environment (the operator's, or a test suite's, ceiling,
    which a worker's own core share keeps too: autotune.worker.cpu_share.omp_threads_cap)."""
    return max(1, min((os.cpu_count() or 1) // workers, omp_threads_cap() or os.cpu_count() or 1))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Processes:
    """The processes the demo started, each in its own process group, with its log file."""

    def __init__(self) -> None:
        self.started: list[tuple[str, subprocess.Popen[bytes], Path]] = []

    def start(self, name: str, argv: list[str], log_path: Path,
              env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """`argv` in a process group of its own, its output appended to `log_path` after a line
        naming the run: a resumed `autotune tune` keeps the interrupted run's log above its own."""
        with open(log_path, "ab") as log:  # the child keeps its own handle
            stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
            log.write(f"--- {name} started {stamp}: {' '.join(argv)}\n".encode())
            log.flush()
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.started.append((name, proc, log_path))
        return proc

    def stop_all(self) -> None:
        """SIGTERM every group (latest first: workers before the service), then SIGKILL stragglers."""
        for _, proc, _ in reversed(self.started):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=STOP_GRACE_S)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Treat SIGTERM like Ctrl-C while the demo runs, so its cleanup runs either way."""

    def raise_interrupt(_signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


BASELINE_SEEDS = 3  # the verdict judges quality against at least three baseline seeds
REMEASURE_TOP_K = 2
REMEASURE_MAX_ROUNDS = 4
# search_spaces/ups-tiny-cpu.yaml: configs at the preset's effective batch, some of them real CPU wins
# (bench/results/cpu_demo_win.json), so the demo's verdict has something true to certify
DEMO_SPACE = "ups-tiny-cpu"


# The fewest probe samples that leave enough timed steps for the cpu space's largest effective
# batch (32 × 2) with inverse losses every 4 steps: (8 warm-up + 5) × 64. The tiny preset trains 3072.
MIN_SAMPLES = 832


def demo_spec(name: str, trials: int, samples: int | None = None) -> StudySpec:
    """`trials` search trials after BASELINE_SEEDS baseline runs (n_trials counts both), then the
    verdict: the top REMEASURE_TOP_K distinct feasible configs and the baseline re-measured in
    rounds until each is decided (at most REMEASURE_MAX_ROUNDS). `samples`: each
    probe's training samples (None: the tiny preset's 3072)."""
    if samples is not None and samples < MIN_SAMPLES:
        raise ValueError(f"{samples} is too few: a demo probe needs at least {MIN_SAMPLES} samples (the cpu "
                         f"space's largest effective batch of 64 for 8 warm-up and 5 timed steps)")
    return StudySpec(name=name, workload="ups", preset="tiny", space=DEMO_SPACE, n_trials=BASELINE_SEEDS + trials,
                     sampler="tpe", hardware="cpu", probe=ProbeSpec(samples=samples, timeout_s=300.0), seed=0,
                     baseline_seeds=BASELINE_SEEDS,
                     remeasure=RemeasureSpec(top_k=REMEASURE_TOP_K, max_rounds=REMEASURE_MAX_ROUNDS))


class DemoError(Exception):
    """A step of the demo failed; the message says which and where to look."""


def create_token(cli: list[str], db_url: str, role: str, name: str) -> str:
    """A new token of `role` in the demo's database (`autotune token create`, which also creates the tables)."""
    done = subprocess.run([*cli, "token", "create", "--role", role, "--name", name, "--db", db_url],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    if done.returncode != 0:
        raise DemoError(f"`autotune token create --role {role}` failed (exit {done.returncode}): "
                        f"{done.stderr.strip()[-2000:]}")
    return done.stdout.strip()


def wait_for_health(client: Client, serve: subprocess.Popen[bytes], log_path: Path) -> str | None:
    """None once /v1/health answers; else why not."""
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while time.monotonic() < deadline:
        if serve.poll() is not None:
            return f"the service exited with code {serve.returncode}; {log_path}:\n{log_tail(log_path)}"
        try:
            client.health(retry_for_s=0.0)
            return None
        except ServiceUnavailable:
            time.sleep(0.2)
    return f"the service did not answer /v1/health within {HEALTH_TIMEOUT_S:.0f} s; see {log_path}"


def other_counts(c: dict[str, int]) -> list[str]:
    """The counts shown after complete, pruned and failed, where there are any: repeats, lost trials
    to be re-run, re-measurements stopped as not needed."""
    return [f"{c[state]} {label}" for state, label in (("REPEAT", "repeated (not run)"), (LOST_TO_RERUN, LOST_LABEL),
                                                       (UNNEEDED, UNNEEDED_LABEL)) if c.get(state)]


def progress_text(info: StudyInfo) -> str:
    c = info.counts
    parts = [f"{c.get('COMPLETE', 0)} complete", f"{c.get('PRUNED', 0)} pruned", f"{c.get('FAIL', 0)} failed",
             *other_counts(c), f"{c.get('RUNNING', 0)} running"]
    best = info.best or {}
    if best.get("certified") and best.get("speedup") is not None:
        parts.append(f"certified {best['speedup']:.2f}× the baseline (trial {best['trial_number']})")
    elif best:
        parts.append(f"no certified pick ({best.get('outcome')})")
    return " · ".join(parts)


def run_demo(workdir: Path, trials: int = 12, workers: int = 2, port: int = 0, samples: int | None = None,
             console: Console | None = None) -> int:
    """Run the demo; the exit status (0: the study finished with completed trials)."""
    name = f"demo-{datetime.now():%Y%m%d-%H%M%S}"
    spec = demo_spec(name, trials, samples)  # a bad argument fails here, before anything is made
    console = console or make_console(highlight=False, soft_wrap=True)
    workdir = make_folder(workdir, "--workdir")
    db_path = workdir / "autotune.db"
    port = port or free_port()
    api = f"http://127.0.0.1:{port}"
    threads = worker_threads(workers)
    cli = [sys.executable, "-m", "autotune.cli"]
    db_url = f"sqlite:///{db_path}"
    processes = Processes()
    client: Client | None = None
    started = time.monotonic()
    try:
        with sigterm_as_interrupt():
            console.print(f"[bold]autotune demo[/] in {workdir}")
            # auth stays on: the demo gets its own tokens, named after its study (the database is reused)
            admin_token = create_token(cli, db_url, "admin", f"{name}-admin")
            worker_token = create_token(cli, db_url, "worker", f"{name}-worker")
            console.print(f"tokens    {name}-admin, {name}-worker (`autotune token list --db {db_url}`)")
            client = Client(api, admin_token, retry_for_s=10.0)
            serve_log = workdir / "serve.log"
            serve = processes.start("service", [*cli, "serve", "--db", db_url, "--port", str(port)], serve_log,
                                    env={"AUTOTUNE_AUTH": "true"})
            problem = wait_for_health(client, serve, serve_log)
            if problem:
                say_error(problem, console)
                return 1
            console.print(f"service   {api} (database {db_path}, log {serve_log.name})")
            client.create_study(spec)
            budget = f"{samples} samples" if samples else "the preset's samples"
            console.print(f"study     {name}: ups/tiny, space {DEMO_SPACE}, {BASELINE_SEEDS} baseline seeds + {trials} "
                          f"search trials + the verdict (top {REMEASURE_TOP_K} and the baseline re-measured, up to "
                          f"{REMEASURE_MAX_ROUNDS} rounds), TPE sampler, hardware cpu, "
                          f"probes of {budget}")
            worker_procs = []
            for i in range(workers):
                log_path = workdir / f"worker-{i + 1}.log"
                worker_procs.append(processes.start(f"worker-{i + 1}", [
                    *cli, "worker", "--api", api, "--study", name, "--device", "cpu", "--idle-exit", "30",
                    "--threads", str(threads), "--heartbeat", "2"], log_path, env={"AUTOTUNE_TOKEN": worker_token}))
            console.print(f"workers   {workers} × `autotune worker --device cpu --threads {threads}` "
                          f"(logs worker-N.log)")
            total = BASELINE_SEEDS + trials + 2 * (REMEASURE_TOP_K + 1)  # grows if the verdict needs more rounds
            finished = follow(client, name, total, worker_procs, serve, console)
            if finished is None:
                return 1
            return report(client, finished, db_path, time.monotonic() - started, console)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping the workers and the service[/]")
        return 130
    except ServiceUnavailable as e:
        say_error(f"{e}; see {workdir / 'serve.log'}", console)
        return 1
    except (DemoError, ApiError) as e:
        say_error(str(e), console)
        return 1
    finally:
        if client is not None:
            client.close()
        processes.stop_all()


def eta_text(elapsed_s: float, done: int, total: int) -> str:
    """" · ETA ~N min" at the pace so far (trials finish one by one; the verdict may add rounds)."""
    if done <= 0 or done >= total:
        return ""
    left = elapsed_s / done * (total - done)
    return f" · ETA ~{left / 60:.0f} min" if left >= 90 else f" · ETA ~{left:.0f} s"


def follow(client: Client, name: str, trials: int, worker_procs: list[subprocess.Popen[bytes]],
           serve: subprocess.Popen[bytes], console: Console) -> StudyInfo | None:
    """Show progress until the study is finished; None (after a message) when it cannot finish.
    A terminal gets a live progress bar, a log file one line per finished trial."""
    columns = (TextColumn("trials"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.description}"))
    progress = Progress(*columns, console=console, transient=False, disable=not console.is_terminal)
    task = progress.add_task("starting", total=trials)
    shown = -1
    started = time.monotonic()
    with progress:
        while True:
            info = client.get_study(name)
            done = sum(info.counts.get(s, 0) for s in FINISHED)
            trials = max(trials, done + info.counts.get("RUNNING", 0))  # more verdict rounds than the least
            if info.state != "running":
                trials = done
            text = progress_text(info) + eta_text(time.monotonic() - started, done, trials)
            progress.update(task, completed=done, total=trials, description=text)
            if not console.is_terminal and done != shown:
                console.print(escape(f"[{done:>{len(str(trials))}}/{trials}] ") + text)
                shown = done
            if info.state in ("finished", "stopped"):
                return info
            if serve.poll() is not None:
                console.print(f"[bold red]error:[/] the service exited with code {serve.returncode}")
                return None
            if all(p.poll() is not None for p in worker_procs):
                codes = ", ".join(str(p.returncode) for p in worker_procs)
                console.print(f"[bold red]error:[/] every worker exited (codes {codes}) before the study finished;"
                              " see worker-N.log")
                return None
            time.sleep(POLL_S)


def summary_line(info: StudyInfo, elapsed_s: float) -> str:
    """The study's outcome counts, as `tune` and the demo print them when it ends."""
    c = info.counts
    return (f"study {info.name} {info.state} in {elapsed_s:.0f} s: {c.get('COMPLETE', 0)} complete, "
            f"{c.get('PRUNED', 0)} pruned, {c.get('FAIL', 0)} failed"
            + (f" ({', '.join(f'{n} {k}' for k, n in info.failures.items())})" if info.failures else "")
            + "".join(f", {part}" for part in other_counts(c))
            # a run still going in a study finished with its verdict (every baseline and search trial
            # done) is a re-measure round started ahead: told to stop at its next report
            + (f"; {c['RUNNING']} re-measure run(s) still stopping (not needed)"
               if info.state == "finished" and not info.message and c.get("RUNNING") else ""))


def report(client: Client, info: StudyInfo, db_path: Path, elapsed_s: float, console: Console) -> int:
    """Print the Pareto front, the recommendation and the dashboard command."""
    console.print("\n" + summary_line(info, elapsed_s))
    pareto = client.pareto(info.name).data
    pareto.sort(key=lambda t: -(t.throughput_samples_per_s or 0.0))
    rec: Recommendation | None
    try:
        rec, missing = client.best(info.name), None
    except NotFound as e:  # the study has no verdict (its baseline failed)
        rec, missing = None, e.message
    label = quality_label(info, pareto)  # a language model's loss is not an NRMSE
    quality = "val NRMSE" if label == "NRMSE" else label
    better = "higher" if info.spec.quality_direction == "maximize" else "lower"
    title = f"Pareto front: throughput (higher is better) vs {quality} ({better} is better)"
    if pareto:
        console.print(trials_table(pareto, title))
    else:
        console.print(f"{title}: empty, no search trial completed inside the quality gate")
    if rec is None:
        console.print(f"[yellow]no verdict:[/] {missing}")
    else:
        console.print(verdict_table(rec))
        console.print(recommendation_table(rec))
        if rec.certified:
            console.print(f"[bold green]verdict: CERTIFIED[/] trial {rec.trial_number}: {escape(rec.verdict)}")
        else:
            console.print(f"[bold yellow]verdict: keep the baseline[/] ({rec.outcome}): {escape(rec.reason)}")
    console.print(f"\nopen the Optuna dashboard: optuna-dashboard sqlite:///{db_path}", soft_wrap=True)
    if info.state != "finished" or info.counts.get("COMPLETE", 0) == 0:
        console.print("[bold red]error:[/] the study did not finish with completed trials")
        return 1
    return 0
