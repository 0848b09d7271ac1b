"""bench/tuning.py on a CPU, tiny preset: a strategy's study runs in two chunks with its
database carried between them (the second chunk resumes it, re-running the trial the first
one cut off), and `analyze` reads it back; the fidelity and cache-states runs of a given
config, and `analyze` of theirs. The GPU numbers come from the same code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from helpers import ROOT, run_bench


def _run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return run_bench("tuning.py", *args, timeout=240)



GIVEN = '{"batch_size": 8, "accum_steps": 1}'
# the given config's short probe: 24 steps of 8, 5 of them warm-up, 8 windows of 2 steps; the 2× long
# run: 48 steps, 8 windows of 5 (its --fine run: 16 windows of 2, the short probe's size)
SHORT = 192
BUDGET_S = 8  # a chunk's worker time in the resume test


@pytest.mark.slow
def test_a_strategy_resumes_from_its_database(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "autotune"
    # a chunk's budget counts from its worker's start: the worker leases its first trial a second
    # after it starts (a CPU worker imports no torch before its first lease; under 6 s with six
    # busy loops beside it on 2 cores); the baseline's probe (16384 samples: about a minute on an
    # idle core) outlasts the budget (tuning.py takes at least 6 s)
    chunk = ["chunk", "--strategy", "autotune", "--dir", str(run), "--device", "cpu", "--preset", "tiny",
             "--space", "cpu", "--samples", "16384", "--total-gpu-s", "120",
             "--inductor-cache", str(tmp_path / "inductor"), "--budget-s", str(BUDGET_S)]
    _run(chunk, tmp_path)  # ends mid-trial: that trial is cut off (interrupted)
    storage = f"sqlite:///{run / 'study.db'}"
    first = optuna.load_study(study_name="tuning-autotune", storage=storage).get_trials(deepcopy=False)
    cut = [t for t in first if t.user_attrs.get("failure_kind") == "interrupted"]
    assert cut, [(t.number, t.state.name) for t in first]

    _run(chunk, tmp_path)  # its worker's first lease re-runs the cut-off trial
    state = json.loads((run / "state.json").read_text())
    assert len(state["chunks"]) == 2 and state["spec"]["preset"] == "tiny"
    assert state["chunks"][0]["inductor_cache_warm"] is False  # the strategy's own cache started empty
    trials = optuna.load_study(study_name="tuning-autotune", storage=storage).get_trials(deepcopy=False)
    assert len(trials) > len(first)  # the same study went on
    retried = {t.user_attrs.get("retry_of") for t in trials}
    assert all(t.number in retried for t in cut)  # every cut-off trial was run again

    out = tmp_path / "summary.json"
    _run(["analyze", "--dir", str(tmp_path / "runs"), "--out", str(out)], tmp_path)
    summary = json.loads(out.read_text())["summary"]["autotune"]
    spans = [c["end"] - c["start"] for c in state["chunks"]]
    assert summary["trials"] == len(trials) and summary["gpu_s_used"] == pytest.approx(sum(spans))
    # each chunk ran its budget (the first was cut off at it), then ended its probe within the
    # SIGTERM wait (a torch import and a report on a loaded host: seconds, at most 60)
    assert BUDGET_S <= spans[0] <= BUDGET_S + 60 and spans[1] <= BUDGET_S + 60
    assert summary["failed_by_kind"].get("interrupted", 0) >= len(cut)


@pytest.mark.slow
def test_fidelity_sets_a_short_probe_against_a_longer_run_in_rounds_and_under_a_deadline(tmp_path: Path) -> None:
    """Probe fidelity of a given config (the GPU runs measure the studies' top configs; which configs a
    CPU chunk finds feasible is up to the CPU's speed): short probe against a 2× longer run."""
    runs = tmp_path / "runs"
    runs.mkdir()  # no strategy's study here: a given config has none to be set against
    fidelity = tmp_path / "fidelity.json"
    # (2 interleaved rounds, after a priming probe that fills the compile cache)
    _run(["fidelity", "--config", GIVEN, "--samples", str(SHORT), "--factor", "2", "--rounds", "2", "--prime",
          "--out", str(fidelity), "--device", "cpu", "--preset", "tiny"], tmp_path)
    doc = json.loads(fidelity.read_text())
    assert len(doc["prime"]) == 1 and doc["prime"][0]["probe"]["samples_trained"] == SHORT
    pair, again = doc["configs"]
    assert (pair["round"], again["round"]) == (0, 1)
    assert pair["strategy"] == "given" and pair["config"]["batch_size"] == 8
    assert (pair["short"]["samples_trained"], pair["long"]["samples_trained"]) == (SHORT, 2 * SHORT)
    assert pair["short"]["window_gpu"] == [] and pair["short"]["started"] < pair["long"]["started"]
    assert doc["prime"][0]["probe"]["started"] < pair["short"]["started"] < again["short"]["started"]
    # mirrored rounds (the default): the second round runs its long run first
    assert doc["order"] == "mirrored" and (pair["first"], again["first"]) == ("short", "long")
    assert pair["long"]["started"] < again["long"]["started"] < again["short"]["started"]

    # under a deadline no pair starts that would end after it: here, none after the first (the
    # deadline is shorter than any pair), and the run says where it stopped
    cut = tmp_path / "fidelity_cut.json"
    stopped = _run(["fidelity", "--config", GIVEN, "--samples", str(SHORT), "--factor", "2", "--rounds", "3",
                    "--deadline-s", "1", "--fine", "16", "--out", str(cut), "--device", "cpu", "--preset", "tiny"],
                   tmp_path)
    cut_doc = json.loads(cut.read_text())
    assert [p["round"] for p in cut_doc["configs"]] == [0]
    assert cut_doc["stopped"]["round"] == 1 and "stopped before round 2" in stopped.stdout
    # --fine: the long run once more, in windows the short probe's size, after the long one
    (fine_pair,) = cut_doc["configs"]
    short, long, fine = (fine_pair[side] for side in ("short", "long", "fine"))
    assert (len(short["window_throughputs"]), len(long["window_throughputs"])) == (8, 8)
    assert len(fine["window_throughputs"]) == 16 and fine["samples_trained"] == long["samples_trained"] == 2 * SHORT
    assert fine["window_steps"] == short["window_steps"] < long["window_steps"]
    assert short["started"] < long["started"] < fine["started"]

    out = tmp_path / "summary.json"
    _run(["analyze", "--dir", str(runs), "--out", str(out), "--fidelity", str(fidelity), str(cut)], tmp_path)
    analysis = json.loads(out.read_text())
    (fine_row,) = analysis["fidelity_fine"]
    assert fine_row["fine_windows"] == 16 and fine_row["fine_over_long"] > 0 and fine_row["early_over_late"] > 0
    row = analysis["fidelity"][0]
    assert len(analysis["fidelity"]) == 3
    assert row["strategy"] == "given" and row["short_over_long"] > 0 and row["study_over_long"] is None
    assert row["long_min_sm_clock_mhz"] is None and row["short_max_throttled_fraction"] is None  # no GPU here
    assert 0 < row["short_max_host_busy_fraction"] <= 1  # the host's CPUs, read by the probe
    (medians,) = analysis["fidelity_medians"]
    assert medians["rounds"] == 2 and medians["median_short_over_median_long"] > 0


@pytest.mark.slow
def test_cache_states_give_a_cold_probe_a_fresh_cache_and_a_warm_one_its_predecessors(tmp_path: Path) -> None:
    """A cold probe gets a fresh TorchInductor cache, a warm one the cache of the probe before it."""
    runs = tmp_path / "runs"
    runs.mkdir()  # no strategy's study here: the repeats are read on their own
    states = tmp_path / "cache_states.json"
    _run(["cache-states", "--config", GIVEN, "--samples", str(SHORT), "--sequence", "cold,warm,cold",
          "--out", str(states), "--device", "cpu", "--preset", "tiny"], tmp_path)
    probes = json.loads(states.read_text())["configs"][0]["probes"]
    assert [p["state"] for p in probes] == ["cold", "warm", "cold"]
    assert probes[0]["cache"] == probes[1]["cache"] != probes[2]["cache"]
    assert all(p["samples_trained"] == SHORT and p["host_cpu"] and p["window_host"] for p in probes)
    out = tmp_path / "summary.json"
    _run(["analyze", "--dir", str(runs), "--out", str(out), "--repeats", str(states)], tmp_path)
    (repeats,) = json.loads(out.read_text())["repeats"]
    assert repeats["n"] == 3 and [p["label"] for p in repeats["probes"]] == ["cold", "warm", "cold"]
    assert repeats["spread"] >= 0 and repeats["median"] in [p["throughput"] for p in repeats["probes"]]


def _probe_record(windows: list[float], waits: list[float], **more: object) -> dict[str, object]:
    return {"window_throughputs": windows, "window_data_wait_s": waits, "samples_trained": 19200, **more}


def test_epoch_rates_amortize_a_recorded_probe_and_estimate_an_older_one() -> None:
    """bench/tuning.py's fidelity reading: a probe that recorded its epoch starts gives both
    rates; for an older one the amortized rate is rebuilt from where its epoch start fell and
    its windows' data waits."""
    sys.path.insert(0, str(ROOT / "bench"))
    import tuning

    from autotune.contract.gate import window_rate

    config = {"batch_size": 48, "accum_steps": 1, "inverse_loss_frequency": 4}
    # the full preset: 19 200 samples at 48 = 400 steps, 8 warm-up, 8 windows of 48 (whole
    # inverse-loss periods); epochs of 234 micro-batches (11 200 samples), so the one epoch start
    # falls in window 5 (micro-batches 200-248)
    samples = 48 * 48
    seconds = [0.4] * 8
    seconds[4] = 0.6
    waits = [0.048] * 8
    waits[4] = 0.247  # 1 ms a fetch; the epoch start's fetch took 0.2 s
    older = tuning.epoch_rates(_probe_record([samples / s for s in seconds], waits), config, lambda: 11200)
    excess = 0.2 - 0.001
    amortized = [s - (excess if w == 4 else 0.0) + excess * 48 / 234 for w, s in enumerate(seconds)]
    assert older["how"] == "estimated"
    assert older["raw"] == pytest.approx(8 * samples / sum(seconds))
    assert older["amortized"] == pytest.approx(8 * samples / sum(amortized))

    # a long run's windows each hold epoch starts already: taken as timed
    every = tuning.epoch_rates(_probe_record([5000.0] * 8, [0.3] * 8, samples_trained=192000), config, lambda: 11200)
    assert every == {"raw": pytest.approx(5000.0), "amortized": pytest.approx(5000.0), "how": "as timed"}

    recorded = tuning.epoch_rates(_probe_record([5900.0] * 8, waits, raw_window_throughputs=[5880.0] * 7 + [3920.0]),
                                  config, lambda: 11200)
    assert recorded == {"raw": pytest.approx(window_rate([5880.0] * 7 + [3920.0])[0]),
                        "amortized": pytest.approx(5900.0), "how": "probe"}


def _pair(strategy: str, number: int, short: float, long: float, how: str = "probe", run: str = "r.json",
          raw_short: float | None = None) -> dict[str, object]:
    raw = raw_short or short
    return {"run": run, "strategy": strategy, "number": number, "short": short, "long": long,
            "short_over_long": short / long, "short_raw": raw, "long_raw": long, "short_amortized": short,
            "long_amortized": long, "short_how": how}


def test_the_loop_threads_cpu_per_step_is_read_from_the_windows_and_set_against_each_pair() -> None:
    """A window of 10 steps of 48 samples at 4 800 samples/s lasts 0.1 s: 10 ms a step, of which a
    loop thread busy 0.4 of the time spends 4 ms on a CPU. Pairs whose throughput ratio is the
    inverse of their loop-CPU ratio agree exactly; the per-config correlation follows them."""
    sys.path.insert(0, str(ROOT / "bench"))
    import tuning

    probe = {"window_steps": 10, "raw_window_throughputs": [4800.0, 4800.0, 2400.0],
             "window_host": [{"busy_fraction": 0.4}, {"busy_fraction": 0.4}, {"busy_fraction": 0.5}]}
    assert tuning.loop_cpu_ms_per_step(probe, 48) == pytest.approx(4.0)  # median of 4, 4, 10 ms
    assert tuning.loop_cpu_ms_per_step({"window_host": [], "raw_window_throughputs": [1.0]}, 48) is None
    assert tuning.loop_cpu_ms_per_step(probe, None) is None
    assert tuning._effective_batch({"batch_size": 24, "accum_steps": 2}) == 48
    assert tuning._effective_batch({"compile": "default"}) is None

    pairs = [{**_pair("oracle", 19, 1000.0 * ratio, 1000.0), "short_loop_cpu_ms_per_step": 4.0 / ratio,
              "long_loop_cpu_ms_per_step": 4.0} for ratio in (0.8, 0.9, 1.0, 1.1)]
    pairs.append({**_pair("oracle", 5, 1000.0, 1000.0), "short_loop_cpu_ms_per_step": None,
                  "long_loop_cpu_ms_per_step": 4.0})  # no telemetry on one side: left out
    loop = tuning.fidelity_loop_cpu(pairs)
    assert loop is not None and loop["pairs"] == 4
    assert loop["median_abs_difference"] == pytest.approx(0.0, abs=1e-9)
    assert loop["per_config"] == [{"strategy": "oracle", "number": 19, "pairs": 4, "pearson_r": pytest.approx(1.0)}]
    assert tuning.fidelity_loop_cpu(pairs[-1:]) is None


def test_fidelity_bias_pools_the_pairs_of_probes_that_recorded_their_epoch_starts() -> None:
    """The pooled reading: the median short/long ratio over the pairs measured by the probe as it
    now measures (older pairs, whose epoch starts were only estimated, are left out), with a
    reproducible bootstrap interval that holds the median, and per config."""
    sys.path.insert(0, str(ROOT / "bench"))
    import tuning

    ratios = [0.90, 0.96, 0.99, 1.00, 1.01, 1.04, 1.10]
    pairs = [_pair("autotune", 3 if i < 4 else 4, 1000.0 * r, 1000.0) for i, r in enumerate(ratios)]
    pairs.append(_pair("oracle", 5, 2000.0, 1000.0, how="estimated"))  # an older run's pair: not pooled
    bias = tuning.fidelity_bias(pairs)
    assert bias is not None and bias["pairs"] == 7
    assert bias["median_short_over_long"] == pytest.approx(1.00)
    low, high = bias["ci95"]
    assert min(ratios) <= low <= 1.00 <= high <= max(ratios)
    assert tuning.fidelity_bias(pairs) == bias  # seeded: the same pairs give the same interval
    assert [(c["number"], c["pairs"]) for c in bias["per_config"]] == [(3, 4), (4, 3)]
    assert bias["per_config"][0]["median_short_over_long"] == pytest.approx(0.975)
    assert tuning.fidelity_bias([p for p in pairs if p["short_how"] == "estimated"]) is None
    # apart by how the short probe treated TorchInductor's compile pool: config 3's last two pairs
    # come from the probe that starts it at setup
    pairs[2]["compile_pool"] = pairs[3]["compile_pool"] = "setup"
    split = tuning.fidelity_bias(pairs)["per_config_and_pool"]
    assert [(c["number"], c["compile_pool"], c["pairs"]) for c in split] == [
        (3, "torch", 2), (3, "setup", 2), (4, "torch", 3)]
    assert split[1]["median_short_over_long"] == pytest.approx(0.995)
    assert [tuning.compile_pool_mode(p) for p in (
        {}, {"compile_workers": None}, {"compile_workers": {"workers": 16, "wait_s": 0.1}},
        {"compile_workers": {"workers": 16, "wait_s": 0.1, "ready_wait_s": 0.0}})] == [
        "torch", "torch", "after warm-up", "setup"]

    # the per-run medians: as the probes reported (amortized), and as timed
    rounds = [_pair("autotune", 3, 950.0, 1000.0, raw_short=1050.0), _pair("autotune", 3, 970.0, 1000.0,
                                                                            raw_short=1070.0)]
    (medians,) = tuning.fidelity_medians(rounds)
    assert medians["median_short_over_median_long"] == pytest.approx(0.96)
    assert medians["raw_median_short_over_median_long"] == pytest.approx(1.06)


def test_a_config_measured_with_an_override_is_reported_apart_from_the_studys() -> None:
    """`fidelity --override` measures a study's config with some knobs changed: its pairs group
    under a name of their own, and the study's throughput (of the config as found) is not set
    against their long runs."""
    sys.path.insert(0, str(ROOT / "bench"))
    import tuning

    def side(rate: float) -> dict[str, object]:
        return _probe_record([rate] * 5, [0.0] * 5, raw_window_throughputs=[rate] * 5, warmup_s=5.0)

    found = {"strategy": "autotune", "number": 3, "round": 0, "config": {"compile": "reduce-overhead"},
             "short": side(90.0), "long": side(100.0)}
    graph = {**found, "config": {"compile": "default", "step_graph": True},
             "override": {"step_graph": True, "compile": "default"}, "short": side(120.0), "long": side(121.0)}
    results = {"autotune": {"rows": [{"number": 3, "throughput": 95.0}]}}
    pairs = tuning.fidelity_summary([("f.json", {"configs": [found, graph]})], results)
    assert [p["strategy"] for p in pairs] == ["autotune", "autotune + compile=default step_graph=True"]
    assert pairs[0]["study_over_long"] == pytest.approx(0.95) and pairs[1]["study_over_long"] is None
    medians = tuning.fidelity_medians([{**p, "round": 0} for p in pairs] + [{**p, "round": 1} for p in pairs])
    assert sorted((m["strategy"], round(m["median_short_over_median_long"], 3)) for m in medians) == [
        ("autotune", 0.9), ("autotune + compile=default step_graph=True", round(120 / 121, 3))]
