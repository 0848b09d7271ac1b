"""bench/lm_knobs.py's accounting, without probing (its CPU smoke is by hand, its runs on a GPU): the model
FLOPs per token of the gpt workload (N, the mtp head, the attention term), the peak by GPU name, the
configs it probes, the summary (ratio, MFU, an inactive knob said so, the quality mark), the combined
config's choice, and the palette PNG."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT
from PIL import Image

sys.path.insert(0, str(ROOT / "bench"))
import lm_knobs  # a bench script (bench/ is not a package)


def test_the_gpt_flop_model_counts_the_matmuls_the_mtp_head_and_the_attention() -> None:
    fm = lm_knobs.flop_model("gpt", "tiny")  # dim 64, depth 2, heads 2, context 64, byte vocabulary 256
    d, layers, vocab, seq = 64, 2, 256, 64
    assert fm["n_matmul"] == layers * 12 * d * d + d * vocab  # qkv, out, fc1, fc2 per block; the LM head
    assert fm["n_aux"] == d * d + d * vocab  # the mtp head: its MLP's matmul and its projection
    assert fm["aux_positions_fraction"] == (seq - 1) / seq  # it predicts t+2 at positions 0..T-2
    assert fm["attention_layers"] == layers and fm["sequence_length"] == seq
    assert fm["attention_per_token"] == 12 * layers * d * seq  # PaLM: H·Dh = d, not halved
    assert fm["flop_counter"]["forward_matmul_per_token"] == fm["flop_counter"]["two_n"] == 2 * fm["n_matmul"]
    assert fm["hf"] == []
    full = lm_knobs.flops_per_token(fm, 1.0)
    assert full == 6 * fm["n_matmul"] + fm["attention_per_token"] + 6 * fm["n_aux"] * (seq - 1) / seq
    assert lm_knobs.flops_per_token(fm, 0.25) < full


@pytest.mark.parametrize(("gpu", "tflops"), [("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H200", 989.4),
                                             ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H200 NVL", 835.5)])
def test_the_peak_comes_from_the_gpus_name(gpu: str, tflops: float) -> None:
    assert lm_knobs.peak_of(gpu, None)[0] == tflops * 1e12
    assert lm_knobs.peak_of("NVIDIA L4", None)[0] is None
    assert lm_knobs.peak_of("NVIDIA L4", 121.0)[0] == 121e12


def test_the_configs_are_base_each_knob_value_alone_and_the_batch_arm() -> None:
    knobs = lm_knobs.parse_knobs(None, hf=False, own_attn=None)
    assert "liger_kernels" not in knobs and "hf_attn_implementation" not in knobs
    hf = lm_knobs.parse_knobs(None, hf=True, own_attn="sdpa")
    assert hf["hf_attn_implementation"] == ["eager", "flex_attention"] and hf["liger_kernels"] == [True]
    picked = lm_knobs.parse_knobs(["attention_backend=flash,cudnn", "lr_scaling"], hf=False, own_attn=None)
    specs = lm_knobs.single_configs({"batch_size": 32, "accum_steps": 1}, picked, [2])
    assert list(specs) == ["base", "attention_backend=flash", "attention_backend=cudnn", "batch×2 lr_scaling=none",
                           "batch×2 lr_scaling=linear", "batch×2 lr_scaling=sqrt"]
    assert specs["batch×2 lr_scaling=sqrt"]["config"] == {"batch_size": 64, "accum_steps": 1, "lr_scaling": "sqrt"}
    with pytest.raises(SystemExit):
        lm_knobs.parse_knobs(["attention_backend=fast"], hf=False, own_attn=None)


def _run(name: str, tp: float, quality: float, notes: dict[str, str] | None = None) -> dict[str, Any]:
    return {"name": name, "round": 0, "throughput_samples_per_s": tp, "quality": quality, "quality_metric": "val_loss",
            "steps": 100, "inverse_steps": 100, "warmup_s": 30.0, "knobs": notes or {}, "failure": None,
            "config": {"effective_batch": 32, "lr": 6e-4}}


def _doc() -> dict[str, Any]:
    fm = {"sequence_length": 512, "dense_per_token": 150e6, "attention_per_token": 25e6, "attention_halved": 12.5e6,
          "aux_per_token_when_run": 2e6, "n_matmul": 25e6, "n_aux": 0.4e6, "aux_head": "mtp",
          "aux_positions_fraction": 0.998, "attention_calls": [], "attention_layers": 8, "params_total": 26e6}
    base = {"batch_size": 32, "accum_steps": 1}
    knobs = {"attention_backend": ["cudnn", "math"], "lr_scaling": ["linear"]}
    return {"workload": "gpt", "preset": "full", "repeats": 1, "samples": None, "base": base,
            "preset_effective_batch": 32, "environment": {"gpu": "NVIDIA H200", "torch": "2.11"},
            "flops": fm, "peak_flops": 989.4e12, "peak_source": "test", "quality_direction": "minimize",
            "quality_tol": 0.01, "configs": lm_knobs.single_configs(base, knobs, [2, 4]), "combined": None,
            "runs": [_run("base", 3000, 1.50),
                     _run("attention_backend=cudnn", 3300, 1.50, {"attention_backend": "cudnn: limited to ..."}),
                     _run("attention_backend=math", 3600, 1.50,
                          {"attention_backend": "math (inactive: torch has no math kernel)"}),
                     _run("batch×2 lr_scaling=linear", 3600, 1.505, {"lr_scaling": "linear: × 2"}),
                     _run("batch×4 lr_scaling=linear", 4000, 1.60, {"lr_scaling": "linear: × 4"}),
                     {"name": "base", "round": 1, "failure": {"kind": "oom", "message": "out of memory"},
                      "wall_s": 3.0}]}


def test_the_summary_gives_ratio_mfu_quality_and_says_an_inactive_knob() -> None:
    doc = _doc()
    rows = {r["name"]: r for r in lm_knobs.summarize(doc)}
    base = rows["base"]
    assert base["probes"] == 1 and base["failed"] == 1 and base["status"] == "base"
    assert base["mfu"] == pytest.approx((150e6 + 25e6 + 2e6) * 3000 * 512 / 989.4e12)
    assert rows["attention_backend=cudnn"]["ratio"] == pytest.approx(1.1)
    assert rows["attention_backend=math"]["status"] == "inactive"
    assert rows["batch×4 lr_scaling=linear"]["quality_ok"] is False
    table = lm_knobs.table(doc)
    assert "**INACTIVE** attention_backend: math" in table and "1.6000 ✗" in table


def test_the_combined_config_takes_what_helped_active_and_within_the_quality_tolerance() -> None:
    changes, why = lm_knobs.choose_combined(_doc(), min_gain=0.02, tol=0.01)
    # math is faster but inactive; batch×4 is faster but worse; batch×2 linear is within 0.01
    assert changes == {"attention_backend": "cudnn", "batch_size": 64, "lr_scaling": "linear"}
    assert len(why) == 2


def test_the_chart_is_a_palette_png(tmp_path: Path) -> None:
    png = tmp_path / "knobs.png"
    lm_knobs.plot(_doc(), png)
    assert Image.open(png).mode == "P"
