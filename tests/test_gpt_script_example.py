"""examples/gpt_script: a standalone nanoGPT-style script, and the glue that tunes it (docs/tutorial.md, part 2).

* the script as written trains without autotune (never imports it) and its loss falls;
* the workload plugin (named by an import path, as AUTOTUNE_WORKLOADS does) makes a probe
  train with the script's own optimizer (AdamW, two groups), clipping (max norm 1) and LR
  schedule (its get_lr over the probe's samples);
* ``train.py --config`` adopts a config through autotune.apply: the optimizer stays the
  script's, apply's step clips and steps it, the script's micro-batches have the config's size;
* the glue line counts of the tutorial and the README, and the marked lines the tutorial
  shows, are the files'.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import autotune
from autotune.contract.registry import ENV_VAR, registered_workloads
from autotune.engine.probe import ProbeSettings, run_probe

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "gpt_script"
TRAIN = EXAMPLE / "gpt_script" / "train.py"
WORKLOAD = EXAMPLE / "gpt_script" / "workload.py"
TUTORIAL = ROOT / "docs" / "tutorial.md"
TARGET = "gpt_script.workload:ScriptWorkload"



@pytest.fixture
def script(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The example package importable (as PYTHONPATH=examples/gpt_script does) and its script module."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    import gpt_script.train

    yield gpt_script.train
    gpt_script.train.use_size("tiny")  # the module stays imported: the next test starts at the default size


def test_the_script_trains_without_autotune() -> None:
    code = ("import runpy, sys; sys.argv = ['train.py', '--max-iters', '60']; "
            f"runpy.run_path({str(TRAIN)!r}, run_name='__main__'); "
            "assert not any(m == 'autotune' or m.startswith('autotune.') for m in sys.modules), 'autotune imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    losses = [float(v) for v in re.findall(r"^iter \d+: loss (\d+\.\d+), lr", done.stdout, flags=re.MULTILINE)]
    vals = [float(v) for v in re.findall(r"^step \d+: val loss (\d+\.\d+)", done.stdout, flags=re.MULTILINE)]
    assert len(losses) == 3 and len(vals) == 2, done.stdout
    assert losses[0] > losses[1] > losses[2], losses  # logged with .item() every 20 iterations
    assert vals[1] < vals[0] - 1.0, vals


def test_a_probe_trains_with_the_scripts_optimizer_clipping_and_schedule(
        monkeypatch: pytest.MonkeyPatch, script: Any) -> None:
    assert f'gpt-script = "{TARGET}"' in (EXAMPLE / "pyproject.toml").read_text()  # the entry point names the same
    monkeypatch.setenv(ENV_VAR, f"gpt-script={TARGET}")
    registered_workloads.cache_clear()
    try:
        result = run_probe("gpt-script", {"batch_size": 8, "accum_steps": 2}, preset="tiny",
                           settings=ProbeSettings(samples=512, windows=5, warmup_steps=3))
    finally:
        monkeypatch.delenv(ENV_VAR)
        registered_workloads.cache_clear()
    assert result.failure is None, result.failure
    assert result.quality_metric == "val_loss" and result.quality is not None and result.quality < 3.0
    knobs = result.knobs
    assert re.fullmatch(r"AdamW \(\d+ tensors in 2 groups\)", knobs["optimizer"]), knobs["optimizer"]
    assert knobs["grad_clip"].startswith("max norm 1 "), knobs["grad_clip"]
    assert "ScriptWorkload.lr_multiplier" in knobs["lr"], knobs["lr"]

    from gpt_script.workload import ScriptWorkload

    wl = ScriptWorkload("tiny")  # the schedule is the script's get_lr, stretched over [0, 1]
    assert wl.lr_multiplier(0.0) == pytest.approx(script.get_lr(0) / script.learning_rate)
    assert wl.lr_multiplier(0.5) == pytest.approx(script.get_lr(script.max_iters / 2) / script.learning_rate)
    assert wl.lr_multiplier(1.0) == pytest.approx(script.min_lr / script.learning_rate)


def test_the_char_size_is_nanogpts_shakespeare_char_shape_in_the_workload_and_the_loop(script: Any) -> None:
    from gpt_script.workload import ScriptWorkload

    tiny = sum(p.numel() for p in ScriptWorkload("tiny").build_model().parameters())
    wl = ScriptWorkload("char")  # the preset is the script's --size
    params = sum(p.numel() for p in wl.build_model().parameters())
    assert tiny < 200_000 and 10.6e6 < params < 10.8e6, (tiny, params)  # 6 layers of 384
    assert wl.defaults.batch_size == 64 and wl.defaults.lr == pytest.approx(1e-3)
    batch = wl.sample_batch(3, torch.Generator().manual_seed(0), torch.device("cpu"))
    assert batch["x"].shape == batch["y"].shape == (3, 256)
    assert script.get_batch("val")[0].shape == (64, 256)  # the loop's evaluation batches follow the size too
    assert script.min_lr == pytest.approx(1e-4)
    with pytest.raises(ValueError, match=r"unknown size \(preset\) 'huge' for gpt_script; known: tiny, char"):
        ScriptWorkload("huge")
    with pytest.raises(SystemExit):
        script.main(["--size", "huge"])


def test_apply_runs_a_config_in_the_script_on_its_own_optimizer(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, script: Any,
        capsys: pytest.CaptureFixture[str]) -> None:
    import autotune.engine.apply as apply_module

    seen: dict[str, Any] = {}

    def spy(config: Any, model: torch.nn.Module, **kwargs: Any) -> Any:
        prepared = apply_module.apply(config, model, **kwargs)
        seen.update(kwargs, model=model, prepared=prepared)
        return prepared

    monkeypatch.setattr(autotune, "apply", spy)
    config = tmp_path / "best.yaml"
    config.write_text("batch_size: 8\naccum_steps: 2\n")
    val_loss = script.main(["--config", str(config), "--max-iters", "20"])

    prepared, optimizer = seen["prepared"], seen["optimizer"]
    assert prepared.optimizer is optimizer  # the script's configure_optimizers output, kept
    assert isinstance(optimizer, torch.optim.AdamW) and len(optimizer.param_groups) == 2
    assert [g["weight_decay"] for g in optimizer.param_groups] == [script.weight_decay, 0.0]
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.95)
    assert seen["grad_clip_norm"] == 1.0 and prepared.trainer.last_grad_norm is not None  # apply's step clipped
    assert prepared.config.batch_size == 8 and prepared.accum_steps == 2
    # 8 × 2 = the script's 16 sequences per iteration: the same 20 iterations, each one optimizer step
    assert prepared.optimizer_steps == 20
    p = optimizer.param_groups[0]["params"][0]
    assert float(optimizer.state[p]["step"]) == 20
    assert optimizer.param_groups[0]["lr"] == pytest.approx(script.get_lr(20, 20))  # the script's last lr write
    out = capsys.readouterr().out
    assert "20 iterations of 8 x 2 sequences" in out
    first = float(re.search(r"^step 0: val loss (\d+\.\d+)", out, flags=re.MULTILINE).group(1))  # type: ignore[union-attr]
    assert val_loss < first - 0.5, out


def test_apply_scales_the_iterations_to_the_scripts_samples(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, script: Any,
        capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "best.yaml"
    config.write_text('{"batch_size": 4, "accum_steps": 1}')
    script.main(["--config", str(config), "--max-iters", "4"])
    assert "16 iterations of 4 x 1 sequences" in capsys.readouterr().out  # 4 × 16 sequences = 16 × 4


def test_the_tutorial_counts_and_shows_the_glue_as_it_is() -> None:
    text = TUTORIAL.read_text()
    marked = [line for line in TRAIN.read_text().splitlines() if line.rstrip().endswith("# autotune")]
    lines = len(WORKLOAD.read_text().splitlines())
    assert f"# {len(marked)}: the apply path" in text
    assert f"# {lines}: the whole workload" in text and f"a {lines}-line file" in text
    for line in marked:  # the tutorial shows every marked line, verbatim
        assert line in text, line
    workloads = " ".join((ROOT / "docs" / "workloads.md").read_text().split())  # where the README points for it
    assert f"a {lines}-line workload file and {len(marked)} marked lines" in workloads
