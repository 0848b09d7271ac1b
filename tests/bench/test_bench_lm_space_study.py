"""bench/lm_space_study.py's parts that need no study (its two studies take minutes even on a CPU:
its CPU smoke command is in the module docstring): the widened space is the plain one plus the LM
knobs the device can run, and is a valid space; the anytime curve and its value at equal GPU time
are read from the trials' lease-to-complete times."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import lm_space_study as bench  # a bench script (bench/ is not a package)

from autotune.contract.config import ATTENTION_BACKENDS, INDUCTOR_TUNINGS, LR_SCALINGS
from autotune.contract.space import load_space, parse_space


def test_the_widened_h100_space_is_the_plain_one_plus_every_lm_knob_and_parses() -> None:
    plain = load_space("h100").to_dict()
    wide = bench.widened("h100", "cuda", hf=False)
    assert {k: v for k, v in wide["params"].items() if k in plain["params"]} == plain["params"]
    assert wide["fixed"] == plain["fixed"]
    added = set(wide["params"]) - set(plain["params"])
    assert added == {"attention_backend", "inductor_tuning", "lr_scaling"}
    assert wide["params"]["attention_backend"]["choices"] == list(ATTENTION_BACKENDS)
    assert wide["params"]["inductor_tuning"] == {"choices": list(INDUCTOR_TUNINGS),
                                                 "when": {"compile": ["default", "reduce-overhead"]}}
    assert wide["params"]["lr_scaling"]["choices"] == list(LR_SCALINGS)
    parse_space(wide)  # the service would take it: every cross-knob rule holds for every draw
    assert bench.combinations(wide) == bench.combinations("h100") * len(ATTENTION_BACKENDS) * len(
        INDUCTOR_TUNINGS) * len(LR_SCALINGS)


def test_the_tuning_flags_act_only_on_the_compile_modes_the_space_holds() -> None:
    space = {"name": "s", "params": {"compile": {"choices": ["none", "default"]}}}
    wide = bench.widened(space, "cuda", hf=False)
    assert wide["params"]["inductor_tuning"]["when"] == {"compile": ["default"]}  # reduce-overhead is never drawn
    parse_space(wide)
    eager = bench.widened({"name": "s", "params": {"compile": {"choices": ["none"]}}}, "cuda", hf=False)
    assert "inductor_tuning" not in eager["params"]  # nothing compiled: the flags could not act


def test_on_a_cpu_the_cuda_only_backends_are_left_out_and_a_hf_model_gets_its_knobs() -> None:
    wide = bench.widened(bench.CPU_SPACE, "cpu", hf=True)
    assert "efficient" not in wide["params"]["attention_backend"]["choices"]
    assert "cudnn" not in wide["params"]["attention_backend"]["choices"]
    assert "inductor_tuning" not in wide["params"]  # no compile in the space: it could not act
    assert wide["params"]["hf_attn_implementation"]["choices"] == ["auto", "sdpa", "eager"]
    assert "liger_kernels" not in wide["params"]  # CUDA kernels
    assert bench.CPU_SPACE["params"].keys() <= wide["params"].keys()
    assert "attention_backend" not in bench.CPU_SPACE["params"]  # the plain space is not changed in place
    parse_space(wide)


def _trial(number: int, role: str, start: float, end: float, throughput: float | None, feasible: bool = True,
           state: str = "COMPLETE") -> dict[str, object]:
    return {"number": number, "role": role, "state": state, "start_s": start, "end_s": end,
            "throughput": throughput, "feasible": feasible}


def test_the_anytime_curve_counts_feasible_search_trials_against_gpu_seconds() -> None:
    trials = [_trial(0, "baseline", 0, 10, 100.0), _trial(1, "search", 10, 15, 300.0),
              _trial(2, "search", 15, 30, 900.0, feasible=False),  # faster but fails the gate
              _trial(3, "search", 30, 32, 200.0), _trial(4, "search", 32, 40, 500.0),
              _trial(5, "remeasure", 40, 45, 800.0)]
    curve = bench.anytime(trials)
    assert curve == [[15.0, 300.0], [40.0, 500.0]]
    assert bench.best_at(curve, 14.0) is None
    assert bench.best_at(curve, 39.0) == 300.0
    assert bench.best_at(curve, 40.0) == 500.0


def test_the_outside_jobs_study_takes_the_lm_knobs_on_request() -> None:
    import argparse

    import gpt_script_verdict

    args = argparse.Namespace(job="hf_causal_lm", device="cuda", study="hf-lm", preset=None, samples=4096, windows=8,
                              warmup_steps=None, probe_timeout_s=120.0, n_trials=6, top_k=1, max_rounds=3, seed=0,
                              no_compile=False, lm_knobs=False)
    plain = gpt_script_verdict.study_spec(args, "NVIDIA H200")["space"]
    args.lm_knobs = True
    wide = gpt_script_verdict.study_spec(args, "NVIDIA H200")["space"]
    assert set(wide["params"]) - set(plain["params"]) == {"attention_backend", "inductor_tuning", "lr_scaling",
                                                         "hf_attn_implementation", "liger_kernels"}
    assert wide["fixed"] == plain["fixed"] == {"precision": "bf16"}
    parse_space(wide)


def _doc(gpu: str = "NVIDIA H200", samples: int = 6144) -> dict[str, Any]:
    settings = {"device": "cuda", "workload": "gpt", "preset": "full", "samples": samples, "n_trials": 14, "seed": 0,
                "study_budget_s": 540.0, "spaces": {"plain": "h100", "widened": {"name": "h100-lm"}}}
    return {"argv": ["--only", "plain"], "environment": {"gpu": gpu}, "settings": settings, "studies": {}}


def test_a_study_run_alone_joins_the_other_from_the_same_settings_and_gpu(tmp_path: Path) -> None:
    out = tmp_path / "lm.json"
    assert bench.earlier_studies(_doc(), out, "plain") == {}  # no earlier run: this study alone
    first = _doc()
    first["studies"] = {"plain": {"anytime": [[10.0, 300.0], [50.0, 500.0]], "gpu_s": 60.0, "finished": True}}
    out.write_text(json.dumps(first))
    second = _doc()
    second["studies"] = bench.earlier_studies(second, out, "widened")
    assert set(second["studies"]) == {"plain"} and second["earlier_argv"] == ["--only", "plain"]
    second["studies"]["widened"] = {"anytime": [[20.0, 800.0]], "gpu_s": 45.0, "finished": True}
    bench.compare(second)
    assert second["equal_gpu_s"] == 45.0
    assert second["studies"]["plain"]["best_at_equal_gpu_s"] == 300.0
    assert second["studies"]["widened"]["best_at_equal_gpu_s"] == 800.0
    assert set(bench.earlier_studies(_doc(), out, "plain")) == set()  # running plain again replaces it
    alone = _doc()
    alone["studies"] = {"plain": first["studies"]["plain"]}
    out.write_text(json.dumps(alone))  # only the study this run replaces (resumed, say): no settings to match
    assert bench.earlier_studies(_doc(samples=8192), out, "plain") == {}
    out.write_text(json.dumps(second))
    for other, says in ((_doc(samples=8192), "its samples is 6144"),
                        (_doc(gpu="NVIDIA H100 80GB HBM3"), "one kind of GPU")):
        with pytest.raises(SystemExit, match=says):
            bench.earlier_studies(other, out, "widened")


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "bench" / "configs").glob("lm_*.yaml")))
def test_the_committed_spec_files_make_valid_studies_of_their_space_and_baseline(name: str) -> None:
    """--spec FILE: its keys go into both studies' spec (mappings merged into the defaults), its space is
    the plain study's; the committed files make a study the service takes, on a GPU's hardware class."""
    from autotune.contract.protocol import StudySpec

    overrides = bench.load_overrides(str(ROOT / "bench" / "configs" / name))
    space = overrides.pop("space")
    timeout_s = overrides.get("probe", {}).get("timeout_s", 180.0)  # a file may raise it (a long cold compile)
    spec = bench.merged({"name": "s", "workload": "gpt", "preset": "full", "hardware": "NVIDIA H200", "space": space,
                         "probe": {"samples": 6144, "timeout_s": 180.0}}, overrides)
    study = StudySpec.model_validate(spec)
    assert study.sampler == "grid"
    assert {k: study.baseline_config()[k] for k in overrides["baseline"]} == overrides["baseline"]  # the file's own
    assert study.probe.timeout_s == timeout_s and study.probe.samples == overrides["probe"]["samples"]  # merged
    assert study.n_trials == study.baseline_seeds + bench.combinations(space)  # the grid, and no more


@pytest.mark.parametrize(("text", "fix"), [("- a list", "a mapping of study-spec keys"),
                                           ("name: x", "'name' is the benchmark's own"),
                                           ("a: [", "cannot read it")])
def test_a_spec_file_that_cannot_be_used_is_refused_with_the_fix(tmp_path: Path, text: str, fix: str) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit, match=fix):
        bench.load_overrides(str(path))


def test_studies_of_different_spec_files_are_not_compared(tmp_path: Path) -> None:
    out = tmp_path / "lm.json"
    first = _doc()  # written before --spec existed: no "spec" in its settings, the same as an empty one
    first["studies"] = {"plain": {"anytime": [], "gpu_s": 1.0, "finished": True}}
    out.write_text(json.dumps(first))
    assert set(bench.earlier_studies(_doc() | {"settings": _doc()["settings"] | {"spec": {}}}, out, "widened")) \
        == {"plain"}
    other = _doc()
    other["settings"]["spec"] = {"sampler": "grid"}
    with pytest.raises(SystemExit, match=r"its spec is \{\}"):
        bench.earlier_studies(other, out, "widened")


def test_a_machine_without_the_required_gpu_runs_nothing_and_says_what_it_has(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--require-gpu: a lent machine of the wrong kind exits 3 before any study, naming its GPU."""
    out = tmp_path / "lm.json"
    code = bench.main(["--device", "cpu", "--only", "plain", "--require-gpu", "H200", "--workdir", str(tmp_path / "w"),
                       "--out", str(out)])
    assert code == 3 and not out.exists() and not (tmp_path / "w" / "tune").exists()
    assert "--require-gpu H200: this machine's GPU is cpu; nothing run" in capsys.readouterr().err
