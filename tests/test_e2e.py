"""End to end: the real service (uvicorn on a free port, SQLite) and real worker processes.

What must hold whatever happens to a probe: every trial ends in a finished state with a
reason, no trial is run by two workers, and a worker outlives its child, a service restart
and a service that is not up yet. Probes use a small inline space (micro-batches of 2-4)
and one torch thread, so each takes a few seconds including process start.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from live_service import (
    CLI,
    LiveService,
    Processes,
    free_port,
    is_alive,
    leased_trial_ids,
    log_text,
    probe_children,
    small_spec,
    start_worker,
    wait_until,
)

from autotune.cli.demo import BASELINE_SEEDS
from autotune.engine.compile_workers import children, cmdline

pytestmark = pytest.mark.slow
LONG_PROBE = 4000  # samples: ~1000-2000 steps, long enough to act on a probe mid-run


@pytest.fixture(scope="module")
def service(module_processes: Processes, tiny_datasets: Any) -> LiveService:
    """One service for the module's tests: each submits a study of its own name and starts its
    workers with `--study` (a test's workers never see another's trials)."""
    return LiveService(module_processes, module_processes.log_dir / "autotune.db").start()


def trial_by_number(service: LiveService, study: str, number: int) -> dict[str, Any]:
    return next(t for t in service.trials(study) if t["number"] == number)


def finished(service: LiveService, study: str, number: int) -> dict[str, Any] | None:
    trials = [t for t in service.trials(study) if t["number"] == number]
    return trials[0] if trials and trials[0]["state"] in ("COMPLETE", "FAIL", "PRUNED") else None


def test_two_workers_finish_a_study_without_running_a_trial_twice(service: LiveService,
                                                                  processes: Processes) -> None:
    # 2 baseline seeds + 2 search trials, the fastest feasible one re-measured; pruning on
    service.submit(small_spec("e2e", n_trials=4, sampler="tpe", baseline_seeds=2,
                              remeasure={"top_k": 1, "windows": 5}))
    workers = [start_worker(processes, service.url, "--study", "e2e", "--idle-exit", "3", "--worker-id", wid,
                            log_name=f"{wid}.log") for wid in ("e2e-a", "e2e-b")]
    for w in workers:  # a generous bound, not a speed check: a busy 2-core host runs these several times slower
        assert w.wait(timeout=300) == 0, log_text(w)[-3000:]

    study = service.get("/v1/studies/e2e")
    assert study["state"] == "finished"
    trials = service.trials("e2e")
    roles = [t["role"] for t in trials]
    assert roles[:2] == ["baseline", "baseline"] and roles[2:4] == ["search"] * 2
    feasible_search = [t for t in trials if t["role"] == "search" and t["feasible"]]
    rounds = [t for t in trials if t["role"] == "remeasure"]
    if feasible_search:  # the verdict: the pick and the baseline, round by round (at least 3 rounds)
        assert roles[4:] == ["remeasure"] * len(rounds) and len(rounds) >= 6 and len(rounds) % 2 == 0
    else:
        assert rounds == []
    # a trial may be pruned (slow and no better than the best feasible): with its reason
    # a draw of a config measured already is REPEAT (not run)
    assert all(t["state"] == "COMPLETE" or (t["state"] == "PRUNED" and t["prune_reason"])
               or (t["state"] == "REPEAT" and t["repeat_of"] is not None) for t in trials), \
        [(t["number"], t["role"], t["state"], t["failure"], t["prune_reason"]) for t in trials]
    assert all(t["state"] == "COMPLETE" for t in trials if t["role"] != "search")
    ran = [t for t in trials if t["repeat_of"] is None]  # a draw of a config measured already is told, not run
    assert {t["worker_id"] for t in ran} <= {"e2e-a", "e2e-b"}
    leased = {w: leased_trial_ids(p) for w, p in zip(("a", "b"), workers, strict=True)}
    assert len(leased["a"]) + len(leased["b"]) == len(ran)  # each trial leased exactly once
    assert set(leased["a"]) | set(leased["b"]) == {t["trial_id"] for t in ran}
    for t in ran:  # ... and completed by the worker that leased it
        assert t["trial_id"] in leased[t["worker_id"][-1]]
    pareto = service.get("/v1/studies/e2e/pareto")
    if not feasible_search:  # the baseline is never on the front nor the recommendation
        assert pareto["count"] == 0
        return
    best = service.get("/v1/studies/e2e/best")
    assert best["throughput_samples_per_s"] > 0 and best["speedup"] > 0 and best["reason"]
    assert best["rounds_run"] == len(rounds) // 2 and best["remeasure_probes"] == len(rounds)
    base_row, cand_row = best["configs"]  # the rule's inputs: the baseline's runs (its 2 seeds too) and the pick's
    assert base_row["role"] == "baseline" and base_row["n"] == 2 + best["rounds_run"]
    assert cand_row["trial_number"] in {t["number"] for t in feasible_search} and cand_row["n"] == best["rounds_run"]
    if best["certified"]:
        assert best["trial_number"] == cand_row["trial_number"] and best["speedup_ci_low"] > 1.0
    else:  # the baseline's own config, and the candidate beside it
        assert best["trial_number"] == trials[0]["number"] and best["uncertified"]["trial_number"] == cand_row[
            "trial_number"]


def test_a_killed_probe_child_fails_its_trial_and_the_worker_goes_on(service: LiveService,
                                                                     processes: Processes) -> None:
    # two baseline seeds: with one, killing it would leave the study without a gate (nothing more to run)
    service.submit(small_spec("killed", n_trials=3, samples=LONG_PROBE, baseline_seeds=2))
    worker = start_worker(processes, service.url, "--study", "killed", "--idle-exit", "1")
    first = wait_until(lambda: probe_children(worker.pid), 60, "the first probe child")[0]
    assert first not in children(worker.pid)  # forked by the worker's fork server (warm start, the default)
    time.sleep(1.0)  # mid-probe
    os.kill(first, signal.SIGKILL)

    trial = wait_until(lambda: finished(service, "killed", 0), 30, "trial 0 to finish")
    assert trial["state"] == "FAIL"
    assert trial["failure"]["kind"] == "error"
    assert "killed by signal 9 (SIGKILL" in trial["failure"]["message"]

    # the worker goes on: a new child for the next trial; stopping the study stops it
    wait_until(lambda: [p for p in probe_children(worker.pid) if p != first], 60, "the next probe child")
    service.delete("/v1/studies/killed")
    trial = wait_until(lambda: finished(service, "killed", 1), 30, "trial 1 to be stopped")
    assert trial["state"] == "FAIL"
    assert trial["failure"]["message"].startswith("stopped by the service")
    assert worker.wait(timeout=30) == 0, log_text(worker)[-3000:]  # idle: the study is stopped
    assert probe_children(worker.pid) == []


def test_a_probe_past_its_timeout_fails_with_kind_timeout(service: LiveService, processes: Processes) -> None:
    service.submit(small_spec("slow", n_trials=1, samples=LONG_PROBE, probe={"timeout_s": 1.0}))
    worker = start_worker(processes, service.url, "--study", "slow", "--max-trials", "1")
    assert worker.wait(timeout=60) == 0, log_text(worker)[-3000:]
    trial = trial_by_number(service, "slow", 0)
    assert trial["state"] == "FAIL"
    assert trial["failure"]["kind"] == "timeout", trial["failure"]
    assert "1 s" in trial["failure"]["message"]


def test_sigterm_to_a_worker_mid_probe_fails_its_trial_as_interrupted(service: LiveService,
                                                                      processes: Processes) -> None:
    service.submit(small_spec("term", n_trials=2, samples=LONG_PROBE))
    worker = start_worker(processes, service.url, "--study", "term", "--cold-start")
    child = wait_until(lambda: probe_children(worker.pid), 60, "a probe child")[0]
    # --cold-start: `python -m autotune.engine.probe_child`, the worker's own child
    assert child in children(worker.pid)
    time.sleep(0.5)
    with open(f"/proc/{worker.pid}/maps") as maps:  # torch (and CUDA) live in the child only
        assert "libtorch" not in maps.read()
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 128 + signal.SIGTERM, log_text(worker)[-3000:]
    assert not is_alive(child)
    trial = trial_by_number(service, "term", 0)
    assert trial["state"] == "FAIL"
    # a preemption says nothing about the config: kind "interrupted", re-run by the next worker
    assert trial["failure"] == {"kind": "interrupted", "message": "worker interrupted by SIGTERM"}


def test_a_worker_waits_for_the_service_and_survives_its_restart(processes: Processes, tmp_path: Path,
                                                                 tiny_datasets: Any) -> None:
    service = LiveService(processes, tmp_path / "autotune.db")
    worker = start_worker(processes, service.url, "--max-trials", "2")  # any cpu study
    wait_until(lambda: "retrying" in log_text(worker), 30, "the worker to retry")
    service.start()
    # a first probe that outlasts the stop and restart below (a few seconds, the child's start included);
    # no pruning: a short probe's loss curve may prune the second trial, and both must complete
    service.submit(small_spec("restart", n_trials=2, samples=800, pruning={"enabled": False}))
    wait_until(lambda: probe_children(worker.pid), 60, "a probe child")
    service.stop()  # mid-probe: reports, heartbeats and maybe the complete find no service
    time.sleep(1.0)
    service.start()
    assert worker.wait(timeout=300) == 0, log_text(worker)[-3000:]
    trials = service.trials("restart")
    assert [t["state"] for t in trials] == ["COMPLETE", "COMPLETE"], [t["failure"] for t in trials]


def test_the_demo_runs_a_study_and_stops_everything_it_started(tmp_path: Path, tiny_datasets: Any) -> None:
    workdir = tmp_path / "demo"
    port = free_port()
    trials = 2  # the fewest the CLI takes, on the fewest samples: the wiring, not the search, is under test
    proc = subprocess.run([*CLI, "demo", "--workdir", str(workdir), "--trials", str(trials), "--workers", "2",
                           "--port", str(port), "--samples", "832"], capture_output=True, text=True, timeout=600,
                          check=False,
                          env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    # a progress line as trials finish, then the counts: every baseline seed and search trial finished
    assert re.search(r"^\[ *\d+/\d+\] \d+ complete", out, flags=re.MULTILINE), out[-3000:]
    counts = re.search(r"finished in \d+ s: (\d+) complete, (\d+) pruned, (\d+) failed"
                       r"(?:, (\d+) repeated \(not run\))?", out)
    assert counts, out[-3000:]
    complete, pruned, failed, repeated = (int(n or 0) for n in counts.groups())
    assert failed == 0 and complete >= BASELINE_SEEDS and complete + pruned + repeated >= BASELINE_SEEDS + trials, \
        counts.group(0)
    assert "Pareto front" in out
    # the verdict: a certified pick, or keep the baseline (e.g. every search trial pruned): both are answers
    assert "verdict: CERTIFIED" in out or "verdict: keep the baseline" in out, out[-3000:]
    assert f"optuna-dashboard sqlite:///{workdir.resolve()}/autotune.db" in out
    assert "probes of 832 samples" in out
    assert {p.name for p in workdir.iterdir()} >= {"autotune.db", "serve.log", "worker-1.log", "worker-2.log"}
    leftovers = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
                 if f"127.0.0.1:{port}" in cmdline(pid) or str(workdir) in cmdline(pid)]
    assert leftovers == []


def test_the_summary_names_the_studys_own_metric_and_says_when_its_front_is_empty(service: LiveService) -> None:
    """`autotune tune`/`demo`'s summary of a language-model study: its front is titled with val_loss (it
    said "val NRMSE" over a val_loss column), and a front with no trial in it says so instead of
    printing an empty table (a study whose every search trial was pruned)."""
    from rich.console import Console

    from autotune.cli.demo import report
    from autotune.worker.client import Client

    service.submit({"name": "lm-summary", "workload": "gpt", "preset": "tiny", "hardware": "cpu", "n_trials": 2})
    console = Console(record=True, width=200)
    with Client(service.url, service.admin_token) as client:
        code = report(client, client.get_study("lm-summary"), Path("autotune.db"), 1.0, console)
    text = console.export_text()
    assert "Pareto front: throughput (higher is better) vs val_loss (lower is better): empty, no search trial " \
           "completed inside the quality gate" in text, text
    assert "NRMSE" not in text and "┏" not in text.split("no verdict")[0], text  # no table before the verdict line
    assert code == 1  # a study that has not finished is no answer
