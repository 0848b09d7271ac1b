"""bench/gpt_script_verdict.py, its parts that need no service: the jobs' studies (the gpt_script
job's spec unchanged from the H200 run's, the HF job's baseline the plain loop's bf16 on a GPU and
its space's fast stack) and the HF loop's instrumentation, in one short run of the script's
main() in a fresh process as the benchmark runs it (its iteration marks from the scheduler, its
training samples from get_batch, val_loss timed and left out).

The whole benchmark (service, study, loops) takes minutes on a CPU: its CPU smoke run is in the
module docstring, not here."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import gpt_script_verdict as bench  # a bench script (bench/ is not a package)

from autotune.contract.config import parse_config
from autotune.contract.space import parse_space
from autotune.contract.starting import auto_points


def _args(**kw: object) -> argparse.Namespace:
    """run's options at their defaults, with `kw`."""
    base = {"job": "gpt_script", "device": "cuda", "study": bench.STUDY, "preset": None, "samples": 16384,
            "windows": 8, "warmup_steps": None, "probe_timeout_s": 240.0, "n_trials": 12, "top_k": 2,
            "max_rounds": 4, "seed": 0, "no_compile": False}
    return argparse.Namespace(**{**base, **kw})


def test_the_gpt_script_jobs_study_is_the_one_its_h200_result_ran() -> None:
    result = json.loads((ROOT / "bench" / "results" / "gpt_script_verdict_h200_sampled.json").read_text())
    ran = result["study"]["spec"]
    args = _args(samples=24576, n_trials=10, max_rounds=4)  # its argv's
    assert bench.study_spec(args, ran["hardware"]) == ran


def test_the_hf_jobs_gpu_baseline_is_the_plain_loops_and_its_space_holds_the_compiled_stack() -> None:
    spec = bench.study_spec(_args(job="hf_causal_lm", study="hf"), "NVIDIA H200")
    assert (spec["workload"], spec["preset"]) == ("hf-causal-lm", "gpu")
    assert spec["baseline"] == {"precision": "bf16", "batch_size": 16, "accum_steps": 1}  # train.bf16 on a GPU
    space = parse_space(spec["space"])
    assert space.fixed == {"precision": "bf16"}
    baseline = parse_config(spec["baseline"]).to_dict()
    points = auto_points(space, baseline)
    # no step graph: the HF Llama's step does not capture on a GPU (the space's comment), so two points
    assert points[0] == {"compile": "default", "batch_size": 16, "accum_steps": 1, "checkpoint": "none",
                         "fused_optimizer": True, "compile_optimizer": True}
    assert [p["compile"] for p in points] == ["default", "reduce-overhead"]
    assert "step_graph" not in spec["space"]["params"]
    cpu = bench.study_spec(_args(job="hf_causal_lm", device="cpu"), "cpu")
    assert cpu["preset"] == "tiny" and cpu["baseline"] == {"batch_size": 16, "accum_steps": 1}  # fp32 on a CPU
    assert bench.JOBS["hf_causal_lm"].loop_argv("gpu") == ["--size", "gpu"]


@pytest.mark.slow
def test_the_hf_loop_is_timed_between_the_schedulers_steps(tmp_path: Path) -> None:
    """The script's 60 steps at 16 become 120 at the config's 8 (about 9 s, most of it imports): a fifth
    of warm-up, the rest timed, the val_loss at steps 50 and 100 timed and left out, its batches not
    counted; autotune.apply's step timed. The plain loop's path (the same wrappers, no apply) runs in
    the CPU smoke run."""
    pytest.importorskip("transformers")
    config = "batch_size: 8\naccum_steps: 1\ncheckpoint: block\n"
    (tmp_path / "best.yaml").write_text(config)
    cmd = [sys.executable, str(ROOT / "bench" / "gpt_script_verdict.py"), "_loop", "--job", "hf_causal_lm",
           "--preset", "tiny", "--max-iters", "60", "--warmup-iters", "5", "--result", str(tmp_path / "r.json"),
           "--config", str(tmp_path / "best.yaml")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "examples" / "hf_causal_lm")]),
           "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    r = json.loads((tmp_path / "r.json").read_text())
    steps, batch = 120, 8
    assert r["argv"][:4] == ["--max-steps", "60", "--size", "tiny"]
    assert (r["iterations"], r["warmup_iterations"], r["timed_iterations"]) == (steps, steps // 5, steps - steps // 5)
    assert r["samples"] == (steps - steps // 5) * batch  # training batches only: not val_loss's 32
    assert r["eval_s"] > 0 and r["train_s"] < r["window_s"]  # the evaluations, left out
    assert r["train_samples_per_s"] > 0 and all(v > 0 for v in r["halves_samples_per_s"])
    ms = r["per_iteration_ms"]
    assert ms["apply_step"] > 0 and ms["total"] > 0
