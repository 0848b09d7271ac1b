"""examples/hf_causal_lm: an HF user's script (a config-built Llama, a plain loop or the HF
Trainer) and the glue that tunes it (docs/huggingface.md).

* the workload plugin, named by an import path as AUTOTUNE_WORKLOADS does, makes a probe train the
  script's Llama with its clipping and schedule, the checkpoint knob on the model's own switch;
* ``train --config`` runs a config through autotune.apply in the loop, ``train --trainer
  --config`` through the Trainer's arguments;
* the glue counts in docs/huggingface.md are the files'.
"""

from __future__ import annotations

import math
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from autotune.contract.registry import ENV_VAR, registered_workloads
from autotune.engine.probe import ProbeSettings, run_probe

ROOT = Path(__file__).resolve().parent.parent.parent
EXAMPLE = ROOT / "examples" / "hf_causal_lm"
WORKLOAD = EXAMPLE / "hf_causal_lm" / "workload.py"
TRAIN = EXAMPLE / "hf_causal_lm" / "train.py"
TARGET = "hf_causal_lm.workload:Llama"


@pytest.fixture
def script(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The example package importable (as PYTHONPATH=examples/hf_causal_lm does) and its script."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    import hf_causal_lm.train

    return hf_causal_lm.train


def test_a_probe_trains_the_scripts_llama_with_its_clipping_and_schedule(monkeypatch: pytest.MonkeyPatch,
                                                                         script: Any) -> None:
    assert f'hf-causal-lm = "{TARGET}"' in (EXAMPLE / "pyproject.toml").read_text()  # the entry point names the same
    monkeypatch.setenv(ENV_VAR, f"hf-causal-lm={TARGET}")
    registered_workloads.cache_clear()
    try:
        result = run_probe("hf-causal-lm", {"batch_size": 8, "checkpoint": "block"}, preset="tiny",
                           settings=ProbeSettings(samples=160))
    finally:
        monkeypatch.delenv(ENV_VAR)
        registered_workloads.cache_clear()
    assert result.failure is None, result.failure
    assert result.quality_metric == "val_loss" and result.quality is not None
    assert result.quality < math.log(len(script.vocab))  # it learned something of the grammar
    knobs = result.knobs
    assert knobs["checkpoint"].startswith("block on 2 decoder layers of LlamaForCausalLM"), knobs["checkpoint"]
    assert knobs["grad_clip"].startswith("max norm 1 ") and knobs["optimizer"] == "AdamW (21 tensors in 2 groups)"
    assert "lr_multiplier" in knobs["lr"], knobs["lr"]

    assert knobs["data"].startswith("Llama.sample_batch"), knobs["data"]  # the script's own get_batch
    assert "inactive" in knobs["num_workers"]

    from hf_causal_lm.workload import Llama

    wl = Llama("tiny")  # the schedule is the script's get_linear_schedule_with_warmup, over [0, 1]
    assert wl.lr_multiplier(0.05) == pytest.approx(0.5) and wl.lr_multiplier(0.55) == pytest.approx(0.5)
    assert wl.lr_multiplier(1.0) == 0.0


def test_the_loop_runs_a_config_through_apply(tmp_path: Path, script: Any, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "best.yaml"
    config.write_text("batch_size: 8\naccum_steps: 1\ncheckpoint: block\nfused_optimizer: true\n")
    loss = script.main(["--config", str(config), "--max-steps", "3"])
    out = capsys.readouterr().out
    assert "6 steps of 8 x 1 blocks" in out  # 8 blocks a step: twice the steps, the script's samples
    assert math.isfinite(loss) and "step 6: val loss" in out


def test_the_trainer_runs_a_config_through_its_arguments(tmp_path: Path, script: Any,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "best.yaml"
    config.write_text("batch_size: 8\naccum_steps: 2\ncheckpoint: block\n")
    loss = script.main(["--trainer", "--config", str(config), "--max-steps", "2"])
    assert math.isfinite(loss) and "step 2: val loss" in capsys.readouterr().out


def test_the_docs_count_the_glue_as_it_is() -> None:
    docs = (ROOT / "docs" / "huggingface.md").read_text()
    counts = {}
    for command in re.findall(r"^((?:grep|wc) .+?)\s+# (\d+):", docs, flags=re.MULTILINE):
        done = subprocess.run(command[0], shell=True, cwd=ROOT, capture_output=True, text=True, check=False)
        counts[command[0]] = (int(done.stdout.strip()), int(command[1]))
    assert len(counts) == 3 and all(got == said for got, said in counts.values()), counts
    marked = [line for line in TRAIN.read_text().splitlines() if line.rstrip().endswith("# autotune")]
    assert sum("training_arguments" in line for line in marked) == 2  # the Trainer's share: 3 lines, 2 naming it
    lines = WORKLOAD.read_text().splitlines()
    glue = "\n".join(lines[next(i for i, line in enumerate(lines) if line.startswith("class ")):])
    assert glue in docs  # the workload the page shows is the file's


def test_the_gpu_size_is_a_llama_of_25_to_60_million_parameters_trained_as_the_plain_loop(script: Any) -> None:
    """The preset gpu (bench/gpt_script_verdict.py --job hf_causal_lm): the script's --size gpu, built
    on the meta device here (nothing allocated); its defaults are the plain loop's batch."""
    import torch
    from hf_causal_lm.workload import Llama

    wl = Llama("gpu")
    with torch.device("meta"):
        model = wl.build_model()
    n = sum(p.numel() for p in model.parameters())
    assert 25e6 <= n <= 60e6, n
    assert model.hf.config._attn_implementation == "sdpa" and wl.block_size == 256
    size = script.SIZES["gpu"]
    assert (wl.defaults.batch_size, wl.defaults.accum_steps, wl.defaults.lr) == (size.batch_size, size.accum_steps,
                                                                                 size.learning_rate)
    assert script.bf16 == (script.device == "cuda")  # the loop autocasts to bf16 on a GPU: a study's baseline bf16
