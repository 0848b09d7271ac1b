"""The built-in `gpt` workload: generated text, a causal model, the mtp auxiliary loss,
quality = validation loss."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from autotune.contract.registry import BUILTIN, check_workload, get_workload
from autotune.engine.probe import ProbeSettings, run_probe
from autotune.workloads.gpt import PRESETS, GPTWorkload
from autotune.workloads.gpt.data import TextSpec, TokenWindows, generate_text, load_or_generate
from autotune.workloads.gpt.model import GPTModel, GPTSpec


def test_the_text_is_deterministic_ascii_and_structured() -> None:
    a, b = generate_text(5000, seed=7), generate_text(5000, seed=7)
    assert a == b and len(a) == 5000 and generate_text(5000, seed=8) != a
    text = a.decode("ascii")
    lines = text.splitlines()[:-1]  # the last line may be cut
    sums = [line for line in lines if " + " in line]
    assert sums and all(int(x) + int(y) == int(z) for x, y, z in
                        (line.rstrip(".").replace("+", "=").split("=") for line in sums))


def test_text_is_cached_under_the_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOTUNE_DATA_DIR", str(tmp_path))
    spec = TextSpec(train_bytes=3000, val_bytes=1000)
    train, val = load_or_generate(spec)
    assert len(train) == 3000 and len(val) == 1000 and len(list(tmp_path.glob("gpt-*.bin"))) == 2
    assert bytes(train) == generate_text(3000, spec.seed) and bytes(val) != bytes(train[:1000])
    again, _ = load_or_generate(spec)  # read back, not regenerated
    assert (again == train).all()


def test_windows_are_next_token_pairs() -> None:
    tokens = torch.arange(100, dtype=torch.uint8).numpy()
    ds = TokenWindows(tokens, context=10)
    assert len(ds) == 9
    item = ds[2]
    assert item["x"].tolist() == list(range(20, 30)) and item["y"].tolist() == list(range(21, 31))


def test_attention_is_causal_and_mtp_is_the_auxiliary_term() -> None:
    torch.manual_seed(0)
    model = GPTModel(GPTSpec(vocab=64, context=16, dim=32, depth=2, heads=2)).eval()
    x = torch.randint(0, 64, (2, 16))
    changed = x.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 64
    with torch.no_grad():
        h1, h2 = model.hidden(x), model.hidden(changed)
    assert torch.allclose(h1[:, :10], h2[:, :10], atol=1e-6) and not torch.allclose(h1[:, 10:], h2[:, 10:])
    batch = {"x": x, "y": torch.randint(0, 64, (2, 16))}
    with_aux, without = model(batch, True), model(batch, False)
    assert "mtp" in with_aux and "mtp" not in without
    expected = with_aux["lm"] + 0.3 * with_aux["mtp"]
    assert float(with_aux["total"].detach()) == pytest.approx(float(expected.detach()), rel=1e-5)
    assert float(without["total"].detach()) == pytest.approx(float(without["lm"].detach()))


def test_it_is_a_builtin_with_its_quality_metric() -> None:
    entry = check_workload("gpt", "full")
    assert BUILTIN["gpt"] is entry and entry.presets == tuple(PRESETS)
    assert (entry.quality_metric, entry.quality_direction) == ("val_loss", "minimize")
    wl = get_workload("gpt", "tiny")
    assert isinstance(wl, GPTWorkload) and (wl.quality_metric, wl.aux_loss_name) == ("val_loss", "mtp")
    params = sum(p.numel() for p in get_workload("gpt", "full").build_model().parameters())
    assert 20e6 < params < 50e6
    medium = get_workload("gpt", "medium")  # GPT-2 small's shape: 12 blocks 768 wide over 1024 tokens
    model = medium.build_model()
    assert 80e6 < sum(p.numel() for p in model.parameters()) < 95e6
    assert medium.spec.model.context == 1024 and medium.spec.text == PRESETS["full"].text  # full's text, one cache


@pytest.mark.slow
def test_a_tiny_probe_reports_validation_loss_not_nrmse() -> None:
    result = run_probe("gpt", {"inverse_loss_frequency": 2}, preset="tiny",
                       settings=ProbeSettings(samples=512, warmup_steps=4, windows=5))
    assert result.failure is None, result.failure
    assert result.quality_metric == "val_loss" and result.quality_direction == "minimize"
    assert result.val_nrmse is None  # a language model's loss is never called NRMSE
    assert result.quality is not None and 0 < result.quality < math.log(256)  # better than uniform bytes
    assert result.inverse_steps == result.steps // 2
    assert result.loss_curve[-1][1] < result.loss_curve[0][1]
