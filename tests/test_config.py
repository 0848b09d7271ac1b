"""autotune.config: knob validation, cross-knob rules and --config parsing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.config import KNOBS, ConfigError, TrainConfig, load_config_arg, parse_config


def test_defaults_parse_to_the_default_config() -> None:
    assert parse_config({}) == TrainConfig()
    assert parse_config(None) == TrainConfig()
    assert parse_config({k.name: k.default for k in KNOBS.values()}) == TrainConfig()


def test_values_are_kept_and_coerced() -> None:
    cfg = parse_config({"precision": "bf16", "checkpoint": "selective", "batch_size": 8.0, "bucket_cap_mb": 50,
                        "num_workers": 2, "prefetch_factor": 4, "persistent_workers": True, "lr": 1})
    assert (cfg.precision, cfg.checkpoint, cfg.num_workers, cfg.prefetch_factor) == ("bf16", "selective", 2, 4)
    assert cfg.batch_size == 8 and type(cfg.batch_size) is int
    assert cfg.bucket_cap_mb == 50.0 and type(cfg.bucket_cap_mb) is float
    assert cfg.lr == 1.0 and type(cfg.lr) is float
    assert cfg.persistent_workers is True


def test_unknown_knob_names_it_and_suggests_the_close_one() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"checkpont": "block"})
    assert info.value.knob == "checkpont"
    text = str(info.value)
    assert text.startswith("checkpont:")
    assert "did you mean 'checkpoint'?" in text
    for name in KNOBS:
        assert name in text  # the known knobs are listed


def test_unknown_knob_without_a_close_match_still_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"zzzz": 1})
    assert info.value.knob == "zzzz"
    assert "did you mean" not in str(info.value)
    assert "known knobs: precision, cudnn_benchmark" in str(info.value)


@pytest.mark.parametrize(
    ("raw", "knob", "expected"),
    [
        ({"precision": "fp64"}, "precision", "allowed: fp32 | tf32 | bf16 | fp16 | fp8"),
        ({"checkpoint": "blk"}, "checkpoint", "allowed: none | block | attn | mlp | selective"),
        ({"compile": "max"}, "compile", "none | default | reduce-overhead | max-autotune | max-autotune-no-cudagraphs"),
        ({"precision": 16}, "precision", "expected a string"),
        ({"batch_size": "8"}, "batch_size", "allowed: int in [1, 65536] or null"),
        ({"batch_size": 8.5}, "batch_size", "expected an integer"),
        ({"batch_size": 0}, "batch_size", "too small; allowed: int in [1, 65536] or null"),
        ({"accum_steps": 2000}, "accum_steps", "too large; allowed: int in [1, 1024] or null"),
        ({"num_workers": True}, "num_workers", "expected an integer"),
        ({"num_workers": -1}, "num_workers", "allowed: int in [0, 256]"),
        ({"pin_memory": "yes"}, "pin_memory", "expected true or false"),
        ({"fused_optimizer": 1}, "fused_optimizer", "expected true or false"),
        ({"bucket_cap_mb": 0}, "bucket_cap_mb", "allowed: float in [0.001, 4096.0]"),
        ({"bucket_cap_mb": "25"}, "bucket_cap_mb", "expected a number"),
        ({"inverse_loss_frequency": 0}, "inverse_loss_frequency", "allowed: int in [1, 1000]"),
        ({"lr": -1.0}, "lr", "allowed: float >= 0.0 or null"),
        ({"precision": None}, "precision", "must not be null"),
    ],
)
def test_bad_type_or_value_names_the_knob_and_what_is_allowed(raw: dict, knob: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    assert info.value.knob == knob
    assert str(info.value).startswith(f"{knob}: ")
    assert expected in str(info.value)


def test_nullable_knobs_accept_null() -> None:
    cfg = parse_config({"batch_size": None, "accum_steps": None, "lr": None, "prefetch_factor": None})
    assert cfg == TrainConfig()


def test_prefetch_factor_needs_workers() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"prefetch_factor": 2})
    assert info.value.knob == "prefetch_factor"
    assert "num_workers" in str(info.value)
    assert parse_config({"prefetch_factor": 2, "num_workers": 1}).prefetch_factor == 2


def test_persistent_workers_needs_workers() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"persistent_workers": True, "num_workers": 0})
    assert info.value.knob == "persistent_workers"
    assert "num_workers" in str(info.value)
    assert parse_config({"persistent_workers": True, "num_workers": 2}).persistent_workers is True
    assert parse_config({"persistent_workers": False}).persistent_workers is False


def test_resolve_fills_only_the_unset_preset_defaults() -> None:
    with pytest.raises(ValueError, match="resolve"):
        _ = TrainConfig().effective_batch
    cfg = TrainConfig(batch_size=2).resolve(batch_size=4, accum_steps=3, lr=0.1)
    assert (cfg.batch_size, cfg.accum_steps, cfg.lr, cfg.effective_batch) == (2, 3, 0.1, 6)
    assert TrainConfig(lr=0.5).resolve(4, 2, 0.1).lr == 0.5


def test_load_config_arg_inline_json() -> None:
    assert load_config_arg(' {"precision": "bf16", "batch_size": 8} ') == {"precision": "bf16", "batch_size": 8}
    assert load_config_arg("{}") == {}
    with pytest.raises(ConfigError) as info:
        load_config_arg('{"precision": ')
    assert info.value.knob == "config"
    assert "not valid JSON" in str(info.value)


def test_load_config_arg_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "trial.yaml"
    path.write_text("precision: bf16\ncheckpoint: block\nbatch_size: 8\nfused_optimizer: true\nlr: 1.0e-3\n")
    raw = load_config_arg(str(path))
    assert raw == {"precision": "bf16", "checkpoint": "block", "batch_size": 8, "fused_optimizer": True, "lr": 1e-3}
    cfg = parse_config(raw)
    assert (cfg.precision, cfg.checkpoint, cfg.batch_size, cfg.fused_optimizer) == ("bf16", "block", 8, True)


def test_load_config_arg_json_file_and_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "trial.json"
    path.write_text(json.dumps({"compile": "default"}))
    assert load_config_arg(str(path)) == {"compile": "default"}
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config_arg(str(empty)) == {}


def test_load_config_arg_rejects_missing_files_and_non_mappings(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="neither a JSON object nor an existing file"):
        load_config_arg(str(tmp_path / "missing.yaml"))
    listing = tmp_path / "list.yaml"
    listing.write_text("- precision\n- bf16\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config_arg(str(listing))
