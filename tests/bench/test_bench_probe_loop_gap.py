"""bench/probe_loop_gap.py, small on a CPU: one config of the gpt_script job timed by
`autotune probe` and by the script's own loop (bench/gpt_script_verdict.py's loop child), each in
a fresh process, both traced once; the JSON holds each run, the ratio to the loop and both
traces' summaries (the loop's steps named as the probe names them, so one reader sums both)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import probe_loop_gap as gap  # a bench script (bench/ is not a package)


@pytest.mark.slow
def test_probe_and_loop_are_timed_and_both_traces_summarized(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("batch_size: 8\naccum_steps: 1\nfused_optimizer: true\n")
    out = tmp_path / "gap.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "probe_loop_gap.py"), "--job", "gpt_script", "--device", "cpu",
         "--config", str(config), "--samples", "256", "--variants", "probe,loop", "--repeats", "1",
         "--loop-iters", "40", "--loop-warmup-iters", "12", "--trace-warmup", "8", "--trace-steps", "3",
         "--timeout", "120", "--workdir", str(tmp_path / "work"), "--trace-dir", str(tmp_path / "traces"),
         "--cpus", "0", "--out", str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(out.read_text())
    runs = {r["variant"]: r for r in doc["runs"]}
    assert set(runs) == {"probe-traced", "loop"}  # the first repeat's probe is the traced one
    assert runs["probe-traced"]["warmup_steps"] == 8 and runs["probe-traced"]["samples"] == 256
    assert len(runs["probe-traced"]["window_throughputs"]) >= 5
    # the script keeps its samples under a config: batch 8 against its own 16 runs twice the iterations
    assert runs["loop"]["iterations"] == 80 and runs["loop"]["per_iteration_ms"]["apply_step"] > 0
    assert doc["settings"]["cpus"] == [0]  # the harness, its fork server and the loop ran on CPU 0 only
    assert doc["summary"]["loop"]["over_loop"] == 1.0
    assert doc["summary"]["probe-traced"]["over_loop"] > 0
    # the loop traced 3 warm-up iterations with the probe's range names: one reader for both
    assert doc["traces"]["loop"]["steps"] == 3 and doc["traces"]["probe"]["steps"] == 3
    assert doc["traces"]["loop"]["data_wait_ms"] is not None
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == [
        "gpt_script_loop.trace.json.gz", "gpt_script_probe.trace.json.gz"]
    assert "| loop |" in done.stdout and "loop trace: 3 steps" in done.stdout


def test_the_ratio_to_the_loop_has_its_interval_once_both_sides_have_two_runs() -> None:
    runs = [{"variant": "probe", "throughput": t} for t in (100.0, 104.0)] + [
        {"variant": "loop", "throughput": t} for t in (98.0, 102.0)] + [{"variant": "probe-long", "throughput": 90.0}]
    summary = gap.summary(runs)
    low, high = summary["probe"]["ci95"]
    assert low < summary["probe"]["geomean_over_loop"] < high
    assert abs(summary["probe"]["geomean_over_loop"] - (100 * 104) ** 0.5 / (98 * 102) ** 0.5) < 1e-9
    assert "ci95" not in summary["probe-long"]  # one run: no spread of its own
    assert summary["probe-long"]["over_loop"] == 90.0 / 100.0


def test_cpus_take_tasksets_list_form_and_refuse_what_the_host_lacks() -> None:
    assert gap.cpu_list("0") == {0}
    assert gap.cpu_list("0-0,0") == {0}
    for bad, says in (("a-b", "expected CPU numbers"), ("100000", "name some of those")):
        try:
            gap.cpu_list(bad)
        except SystemExit as exc:
            assert says in str(exc)
        else:
            raise AssertionError(f"--cpus {bad} was taken")


def test_three_sides_of_a_reduce_overhead_config_on_a_gpu_are_refused_before_anything_runs(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("batch_size: 16\ncompile: reduce-overhead\n")
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "probe_loop_gap.py"), "--job", "hf_causal_lm", "--device", "cuda",
         "--config", str(config), "--same-process", "--sides", "loop,probe,probe", "--workdir", str(tmp_path / "w"),
         "--out", str(tmp_path / "gap.json")], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 1 and done.stderr.strip() == gap.THREE_GRAPH_TREES, done.stderr[-2000:]
    assert not (tmp_path / "gap.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("sides", ["loop,probe", "loop,probe,probe"])
def test_same_process_windows_take_turns_and_each_second_side_window_meets_the_first_sides_around_it(
        tmp_path: Path, sides: str) -> None:
    repeats = 1
    config = tmp_path / "config.yaml"
    config.write_text("batch_size: 8\naccum_steps: 1\n")
    out = tmp_path / "gap.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "probe_loop_gap.py"), "--job", "gpt_script", "--device", "cpu",
         "--config", str(config), "--samples", "256", "--windows", "5", "--repeats", str(repeats), "--loop-iters",
         "40", "--loop-warmup-iters", "8", "--timeout", "120", "--workdir", str(tmp_path / "work"),
         "--same-process", "--sides", sides, "--batch-windows", "2", "--out", str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    kinds = sides.split(",")
    positions = ("first", "second", "third")[:len(kinds)]
    assert [(r["variant"], r["side"], r["repeat"]) for r in doc["runs"]] == [
        x for r in range(repeats) for x in zip(kinds, positions, [r] * len(kinds), strict=True)]
    assert {r["process"] for r in doc["runs"]} == {"same"} and doc["settings"]["same_process"]
    by_side = {me: [r for r in doc["runs"] if r["side"] == me] for me in positions}

    def windows(run: dict) -> list[float]:
        return run.get("window_throughputs") or run["window_samples_per_s"]

    # the first side times one window more than the later ones (which sit between its windows)
    assert [len(windows(r)) for r in by_side["first"]] == [6] * repeats
    for me in positions[1:]:
        assert [len(windows(r)) for r in by_side[me]] == [5] * repeats
        assert [r["samples"] for r in by_side[me]] == [256] * repeats
    # the loop ran its own iterations (batch 8 against its 16: twice 40) and counted its own batches
    # only (a probe in another thread calls the same get_batch)
    assert [r["iterations"] for r in by_side["first"]] == [80] * repeats
    logs = [[math.log(windows(b)[i] / math.sqrt(windows(a)[i] * windows(a)[i + 1])) for i in range(5)]
            for a, b in zip(by_side["first"], by_side["second"], strict=True)]
    pairs = doc["summary"]["pairs"]
    assert pairs["runs"] == repeats and pairs["windows"] == 5 * repeats and pairs["batches"] == 2 * repeats
    assert pairs["per_run"] == pytest.approx([math.exp(sum(xs) / 5) for xs in logs])
    assert pairs["ci95"][0] < pairs["geomean"] < pairs["ci95"][1]
    if len(kinds) == 2:
        assert "pairs_all" not in doc["summary"]
        whats = ["probe / loop"]
    else:  # every pair of sides, each window of the later side against the earlier one's around it
        whats = ["probe (second) / loop (first)", "probe (third) / loop (first)",
                 "probe (third) / probe (second) (A/A)"]
        assert [x["what"] for x in doc["summary"]["pairs_all"]] == whats
        a_a = doc["summary"]["pairs_all"][2]
        logs = [[math.log(windows(b)[i] / math.sqrt(windows(a)[i] * windows(a)[i + 1])) for i in range(4)]
                for a, b in zip(by_side["second"], by_side["third"], strict=True)]
        assert a_a["windows"] == 4 * repeats and a_a["per_run"] == pytest.approx([math.exp(sum(xs) / 4) for xs in logs])
    for what in whats:
        assert f"{what}, windows interleaved in one process ({repeats} runs" in done.stdout


def test_batch_means_cut_each_runs_window_ratios_and_drop_a_short_tail() -> None:
    def run(repeat: int, probe: list[float], loop: list[float]) -> list[dict]:
        return [{"variant": "probe", "repeat": repeat, "window_throughputs": probe},
                {"variant": "loop", "repeat": repeat, "window_samples_per_s": loop}]

    # run 0: probe windows 2× the loop's, then 1×, 2×, 1×, 2× (a tail of one); run 1: 1× throughout
    runs = run(0, [2, 1, 2, 1, 2], [1, 1, 1, 1, 1, 1]) + run(1, [3, 3, 3, 3], [3, 3, 3, 3, 3])
    got = gap.pair_ratio(runs, batch=2)
    assert got["windows"] == 9 and got["batches"] == 4  # 2 from run 0 (its fifth window is a short tail), 2 from run 1
    assert got["geomean"] == pytest.approx(2 ** 0.25)  # batch means log2/2, log2/2, 0, 0
    assert got["per_run"] == pytest.approx([2 ** 0.6, 1.0])
    assert got["lag1_autocorrelation"] < 0  # run 0 alternates
    assert gap.pair_ratio(run(0, [1, 1], [1, 1, 1]), batch=2) is None  # one batch: no interval


def test_with_the_loop_second_the_ratio_is_still_probe_over_loop() -> None:
    runs = [{"variant": "probe", "side": "first", "repeat": 0, "window_throughputs": [2, 2, 2, 2, 2]},
            {"variant": "loop", "side": "second", "repeat": 0, "window_samples_per_s": [1, 1, 1, 1]}]
    assert gap.pair_ratio(runs, batch=2)["geomean"] == pytest.approx(2.0)


def test_the_baton_hands_the_turn_over_and_never_waits_on_a_side_that_ended() -> None:
    baton, order = gap.Baton(["loop", "probe"]), []

    def loop() -> None:
        for i in range(3):
            order.append(f"loop {i}")
            baton.pass_to("loop")
        baton.end("loop")

    thread = threading.Thread(target=loop)
    thread.start()
    baton.wait("probe")
    for i in range(5):  # two turns more than the loop takes: the last ones run alone
        order.append(f"probe {i}")
        baton.pass_to("probe")
    baton.end("probe")
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert order == ["loop 0", "probe 0", "loop 1", "probe 1", "loop 2", "probe 2", "probe 3", "probe 4"]


def test_three_sides_take_turns_in_order_and_skip_those_that_ended() -> None:
    baton, order = gap.Baton(["a", "b", "c"]), []
    turns = {"a": 3, "b": 1, "c": 2}

    def side(me: str) -> None:
        baton.wait(me)
        for i in range(turns[me]):
            order.append(f"{me}{i}")
            baton.pass_to(me)
        baton.end(me)

    threads = [threading.Thread(target=side, args=(me,)) for me in ("c", "b")]  # started out of turn order
    for thread in threads:
        thread.start()
    side("a")
    for thread in threads:
        thread.join(timeout=10)
        assert not thread.is_alive()
    assert order == ["a0", "b0", "c0", "a1", "c1", "a2"]


def test_three_sides_give_every_pair_its_ratio_named_by_position() -> None:
    runs = [{"variant": "loop", "side": "first", "repeat": 0, "process": "same", "throughput": 1.0,
             "window_samples_per_s": [1.0] * 6},
            {"variant": "probe", "side": "second", "repeat": 0, "process": "same", "throughput": 2.0,
             "window_throughputs": [2.0] * 5},
            {"variant": "probe", "side": "third", "repeat": 0, "process": "same", "throughput": 3.0,
             "window_throughputs": [3.0] * 5}]
    got = gap.summary(runs, batch=2)
    assert got["pairs"]["what"] == "probe / loop" and got["pairs"]["geomean"] == pytest.approx(2.0)
    ratios = {x["what"]: x["geomean"] for x in got["pairs_all"]}
    assert ratios == pytest.approx({"probe (second) / loop (first)": 2.0, "probe (third) / loop (first)": 3.0,
                                    "probe (third) / probe (second) (A/A)": 1.5})
    assert gap.ratio_name(("probe", "loop"), ("second", "third"), named=True) == "probe (second) / loop (third)"
    assert "pairs_all" not in gap.summary(runs[:2], batch=2)


def test_sides_are_two_or_three_of_loop_and_probe() -> None:
    import argparse

    assert gap.sides_arg("loop,probe,probe") == "loop,probe,probe"
    for bad in ("probe", "loop,probe,probe,probe", "loop,prob"):
        with pytest.raises(argparse.ArgumentTypeError, match="two or three of loop and probe"):
            gap.sides_arg(bad)


def test_time_loop_puts_back_the_functions_it_wrapped(monkeypatch) -> None:
    import gpt_script_verdict as verdict

    from autotune.engine.apply import Prepared

    monkeypatch.syspath_prepend(str(ROOT / "examples" / "gpt_script"))
    try:
        _time_loop_twice(verdict, Prepared, monkeypatch)
    finally:  # imported here, gone after: registration()'s find_spec must not find the package in later tests
        for name in ("gpt_script.train", "gpt_script"):
            sys.modules.pop(name, None)


def _time_loop_twice(verdict, Prepared, monkeypatch) -> None:
    import gpt_script.train as script

    job = verdict.JOBS["gpt_script"]
    before = {name: getattr(script, name) for name in verdict.INSTRUMENTED["gpt_script"]}
    step = Prepared.step
    monkeypatch.setattr(script, "device", "cpu")
    for _ in range(2):
        got = verdict.time_loop(job, "tiny", 24, 8)
        assert got["iterations"] == 24 and got["samples"] == 16 * (24 - got["warmup_iterations"])
        assert {name: getattr(script, name) for name in before} == before and Prepared.step is step
