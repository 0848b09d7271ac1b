"""autotune.contract.config and autotune.contract.space: knob validation, cross-knob and hardware rules,
--config parsing, and the validation of search spaces (shape, conditions, every drawable
combination, names instead of paths)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from autotune.contract import space as space_module
from autotune.contract.config import KNOBS, ConfigError, TrainConfig, check_hardware, load_config_arg, parse_config
from autotune.contract.space import (
    MAX_CHOICES,
    MAX_COMBINATIONS,
    Space,
    SpaceError,
    load_space,
    parse_space,
    space_names,
    suggest,
    validate_for,
)


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


@pytest.mark.parametrize(("raw", "knob"), [
    ({"lr": float("nan")}, "lr"),
    ({"lr": float("inf")}, "lr"),
    ({"bucket_cap_mb": float("-inf")}, "bucket_cap_mb"),
    ({"batch_size": float("inf")}, "batch_size"),
])
def test_non_finite_numbers_are_rejected(raw: dict[str, Any], knob: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    assert info.value.knob == knob
    assert "finite" in str(info.value) or "integer" in str(info.value)


def test_a_knob_name_that_is_not_a_string_is_an_unknown_knob() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({1: 2})  # type: ignore[dict-item]
    assert info.value.knob == "1" and "unknown knob" in str(info.value)


def test_fp8_needs_a_gpu() -> None:
    with pytest.raises(ConfigError) as info:
        check_hardware({"precision": "fp8"}, "cpu")
    assert info.value.knob == "precision"
    assert "CUDA GPU" in str(info.value) and "bf16" in str(info.value)
    check_hardware({"precision": "fp8"}, "NVIDIA H100 80GB HBM3")  # the probe checks the capability
    check_hardware({"precision": "bf16"}, "cpu")


# --- search spaces ---------------------------------------------------------------------------------


def _space_error(data: dict[str, Any]) -> SpaceError:
    with pytest.raises(SpaceError) as info:
        parse_space(data)
    return info.value


def test_the_named_spaces_are_valid_on_their_hardware() -> None:
    assert {"cpu", "h100"} <= set(space_names())
    validate_for(load_space("cpu"), "cpu")
    validate_for(load_space("h100"), "NVIDIA H100 80GB HBM3")
    with pytest.raises(SpaceError) as info:
        validate_for(load_space("h100"), "cpu")  # it searches fp8
    assert info.value.field == "params.precision" and "fp8" in str(info.value)


@pytest.mark.parametrize("name", ["/etc/passwd", "../x.yaml", "cpu.yaml", "..", ".", "a/b", "~/x", "C:\\x", "",
                                  "cpu\n", "../../etc/passwd", "search_spaces/cpu", "x" * 65])
def test_a_space_is_loaded_by_name_never_by_path(name: str) -> None:
    with pytest.raises(SpaceError) as info:
        load_space(name)
    assert info.value.field == "space"
    assert "not a space name" in str(info.value) and "no paths" in str(info.value)


def test_a_named_space_is_read_again_when_its_file_changes_and_callers_cannot_change_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """load_space parses a file's text once (each view of a study parsed it again); an edit is
    seen at once, even one of the same size within the clock's tick, an invalid file is refused,
    and a caller that changes the Space it got changes nobody else's."""
    monkeypatch.setattr(space_module, "SPACES_DIR", tmp_path)
    path = tmp_path / "mine.yaml"
    path.write_text("params:\n  batch_size: {choices: [4, 8]}\nfixed: {accum_steps: 1}\n")
    first = load_space("mine")
    assert first.params["batch_size"].choices == (4, 8)
    first.fixed["accum_steps"] = 99  # a caller's own copy
    assert load_space("mine").fixed == {"accum_steps": 1}
    path.write_text("params:\n  batch_size: {choices: [2, 8]}\nfixed: {accum_steps: 1}\n")  # same size, at once
    assert load_space("mine").params["batch_size"].choices == (2, 8)
    path.write_text("params: [unclosed\n")
    with pytest.raises(SpaceError, match=r"search_spaces/mine\.yaml is not valid YAML"):
        load_space("mine")


def test_an_unknown_space_name_lists_the_known_ones() -> None:
    with pytest.raises(SpaceError, match="no search space 'nope'; known: cpu, h100"):
        load_space("nope")


@pytest.mark.parametrize(("spec", "field", "words"), [
    ({"batch_size": {"low": 2, "high": 8, "step": 0}}, "params.batch_size.step", "positive number"),
    ({"batch_size": {"low": 2, "high": 8, "step": -2}}, "params.batch_size.step", "positive number"),
    ({"batch_size": {"low": 2, "high": 8, "step": "2"}}, "params.batch_size.step", "positive number"),
    ({"batch_size": {"low": 2, "high": 8, "step": 0.5}}, "params.batch_size.step", "whole number"),
    ({"lr": {"low": 1e-4, "high": 1e-2, "step": float("nan")}}, "params.lr.step", "positive number"),
    ({"lr": {"low": 1e-4, "high": 1e-2, "log": "yes"}}, "params.lr.log", "true or false"),
    ({"lr": {"low": 1e-4, "high": 1e-2, "log": True, "step": 1e-3}}, "params.lr.step", "log range cannot have a step"),
    ({"lr": {"low": 0.0, "high": 1e-2, "log": True}}, "params.lr.low", "log range needs low > 0"),
    ({"lr": {"low": 1e-2, "high": 1e-4}}, "params.lr", "low <= high"),
    ({"lr": {"low": 0.0, "high": float("inf")}}, "params.lr.high", "finite"),
    ({"precision": {"low": 1, "high": 2}}, "params.precision", "not numeric"),
    ({"bucket_cap_mb": {"choices": [0]}}, "params.bucket_cap_mb.choices", "too small"),
    ({"bucket_cap_mb": {"low": -1.0, "high": 8.0}}, "params.bucket_cap_mb.low", "too small"),
    ({"precision": {"choices": ["fp64"]}}, "params.precision.choices", "allowed: fp32 | tf32 | bf16 | fp16 | fp8"),
    ({"batch_size": {"choices": list(range(1, MAX_CHOICES + 2))}}, "params.batch_size.choices", "at most"),
    ({"batch_size": {"choices": [2, 2.0]}}, "params.batch_size.choices", "duplicate"),
    ({"batch_size": {"choices": [2], "low": 1}}, "params.batch_size", "not both"),
    ({"batch_size": {"choice": [2]}}, "params.batch_size.choice", "unknown key"),
    ({"batchsize": {"choices": [2]}}, "params.batchsize", "unknown knob"),
    ({"batch_size": [2, 4]}, "params.batch_size", "expected a mapping"),
    ({"num_workers": {"choices": [0, 2]}, "prefetch_factor": {"choices": [2], "when": {"num_workers": []}}},
     "params.prefetch_factor.when.num_workers", "never holds"),
    ({"num_workers": {"choices": [0, 2]}, "prefetch_factor": {"choices": [2], "when": {"num_workers": [4]}}},
     "params.prefetch_factor.when.num_workers", "never takes the value 4"),
    ({"num_workers": {"low": 0, "high": 8, "step": 2},
      "prefetch_factor": {"choices": [2], "when": {"num_workers": [3]}}},
     "params.prefetch_factor.when.num_workers", "never takes the value 3"),
    ({"prefetch_factor": {"choices": [2], "when": {"num_workers": [1]}}, "num_workers": {"choices": [0, 1]}},
     "params.prefetch_factor.when.num_workers", "declared above"),
])
def test_a_malformed_parameter_names_its_field(spec: dict[str, Any], field: str, words: str) -> None:
    error = _space_error({"params": spec})
    assert error.field == field
    assert words in str(error)


@pytest.mark.parametrize(("data", "field", "words"), [
    ({"params": {}}, "params", "at least one"),
    ({"params": {"batch_size": {"choices": [2]}}, "fixed": {"precison": "bf16"}}, "fixed.precison", "unknown knob"),
    ({"params": {"batch_size": {"choices": [2]}}, "fixed": {"lr": float("nan")}}, "fixed.lr", "finite"),
    ({"params": {"batch_size": {"choices": [2]}}, "fixed": {"batch_size": 4}}, "fixed.batch_size", "keep one"),
    ({"params": {"batch_size": {"choices": [2]}}, "extra": 1}, "extra", "unknown key"),
    ({"batch_size": {"choices": [2]}}, "batch_size", "searched knobs go under 'params'"),  # the knob one level up
    ({"params": {"batch_size": [2, 4]}}, "params.batch_size", "got a list: write {choices: [2, 4]}"),
    ({"params": {"batch_size": {"choices": [2]}}, "name": 5}, "name", "expected a string"),
])
def test_a_malformed_space_names_its_field(data: dict[str, Any], field: str, words: str) -> None:
    error = _space_error(data)
    assert error.field == field
    assert words in str(error)


# Spaces whose every draw passes the cross-knob rules, and spaces that can draw a config that
# breaks one (prefetch_factor / persistent_workers need num_workers > 0): (params, fixed, field).
RULE_CASES: list[tuple[dict[str, Any], dict[str, Any], str | None]] = [
    ({"num_workers": {"choices": [0, 1]}, "prefetch_factor": {"choices": [2, 4], "when": {"num_workers": [1]}}},
     {}, None),
    ({"num_workers": {"choices": [1, 2]}, "prefetch_factor": {"choices": [2, 4]}}, {}, None),  # never 0 workers
    ({"num_workers": {"low": 1, "high": 8}, "prefetch_factor": {"low": 1, "high": 4}}, {}, None),
    ({"num_workers": {"low": 0, "high": 8}, "prefetch_factor": {"choices": [2], "when": {"num_workers": [4, 8]}},
      "persistent_workers": {"choices": [False, True], "when": {"num_workers": [4, 8]}}}, {}, None),
    ({"batch_size": {"choices": [2, 4]}}, {"num_workers": 2, "prefetch_factor": 2, "persistent_workers": True}, None),
    ({"persistent_workers": {"choices": [False]}}, {}, None),
    ({"num_workers": {"choices": [0, 2]}, "batch_size": {"choices": [4, 8], "when": {"num_workers": [2]}},
      "prefetch_factor": {"choices": [2], "when": {"batch_size": [4]}}}, {}, None),  # guarded through batch_size
    # broken:
    ({"num_workers": {"choices": [0, 1]}, "prefetch_factor": {"choices": [2, 4]}}, {}, "params.prefetch_factor"),
    ({"num_workers": {"low": 0, "high": 2}, "prefetch_factor": {"low": 1, "high": 4}}, {}, "params.prefetch_factor"),
    ({"prefetch_factor": {"low": 1, "high": 4}}, {}, "params.prefetch_factor"),
    ({"num_workers": {"low": 0, "high": 8}, "prefetch_factor": {"choices": [2], "when": {"num_workers": [0, 4]}}},
     {}, "params.prefetch_factor"),
    ({"persistent_workers": {"choices": [False, True]}}, {}, "params.persistent_workers"),
    ({"batch_size": {"choices": [2, 4]}}, {"prefetch_factor": 2}, "fixed.prefetch_factor"),
    ({"num_workers": {"choices": [0, 2]}}, {"persistent_workers": True}, "fixed.persistent_workers"),
    ({"num_workers": {"choices": [0, 2]}, "batch_size": {"choices": [4, 8], "when": {"num_workers": [0]}},
      "prefetch_factor": {"choices": [2], "when": {"batch_size": [4]}}}, {}, "params.prefetch_factor"),
]


class RandomTrial:
    """Draws like an Optuna trial, at random: enough to sample a space many times quickly."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def suggest_categorical(self, name: str, choices: Any) -> Any:
        return self.rng.choice(list(choices))

    def suggest_int(self, name: str, low: int, high: int, *, step: int = 1, log: bool = False) -> int:
        return self.rng.choice([low, high, *range(low, high + 1, step)])

    def suggest_float(self, name: str, low: float, high: float, *, step: float | None = None,
                      log: bool = False) -> float:
        return self.rng.uniform(low, high)


def _draw_many(space: Space, n: int = 300) -> int:
    """Draw `n` configs; the number that `suggest` rejected for breaking a knob rule."""
    rng, broken = random.Random(0), 0
    for _ in range(n):
        try:
            suggest(space, RandomTrial(rng))
        except ConfigError:
            broken += 1
    return broken


@pytest.mark.parametrize(("params", "fixed", "field"), RULE_CASES)
def test_a_space_that_can_draw_a_rule_breaking_config_is_rejected(params: dict[str, Any], fixed: dict[str, Any],
                                                                  field: str | None,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    data = {"params": params, "fixed": fixed}
    if field is None:
        space = parse_space(data)
        assert _draw_many(space) == 0  # the check is sound: every draw of an accepted space is valid
        return
    error = _space_error(data)
    assert error.field == field
    assert "only applies with num_workers > 0" in str(error)
    assert "num_workers=0" in str(error)  # the combination that breaks it
    if field.startswith("params."):
        assert "when" in str(error)
    # the check is not overcautious: without it, the space really draws broken configs
    monkeypatch.setattr("autotune.contract.space._check_drawable_combinations", lambda _space: None)
    assert _draw_many(parse_space(data)) > 0


def test_the_hint_says_to_declare_num_workers_first_when_it_comes_later() -> None:
    error = _space_error({"params": {"prefetch_factor": {"choices": [2]}, "num_workers": {"choices": [0, 2]}}})
    assert error.field == "params.prefetch_factor"
    assert "when: {num_workers: [2]}" in str(error) and "declare num_workers above prefetch_factor" in str(error)


def test_too_many_condition_combinations_are_refused_not_enumerated() -> None:
    params = {"num_workers": {"choices": list(range(0, 257))},
              "batch_size": {"choices": list(range(1, MAX_CHOICES + 1))},
              "prefetch_factor": {"choices": [2], "when": {"num_workers": [1], "batch_size": [4]}}}
    error = _space_error({"params": params})
    assert error.field == "params" and f"more than {MAX_COMBINATIONS}" in str(error)


def test_fp8_and_bucket_cap_rules_name_the_field() -> None:
    with pytest.raises(SpaceError) as info:
        validate_for(parse_space({"params": {"precision": {"choices": ["bf16", "fp8"]}}}), "cpu")
    assert info.value.field == "params.precision" and "fp8" in str(info.value)
    with pytest.raises(SpaceError) as info:
        validate_for(parse_space({"params": {"batch_size": {"choices": [2]}}, "fixed": {"precision": "fp8"}}), "cpu")
    assert info.value.field == "fixed.precision"
    with pytest.raises(SpaceError) as info:
        validate_for(parse_space({"params": {"bucket_cap_mb": {"choices": [25, 100]}}}), "NVIDIA H100")
    assert info.value.field == "params.bucket_cap_mb" and "world size > 1" in str(info.value)
    validate_for(parse_space({"params": {"precision": {"choices": ["bf16", "fp8"]}}}), "NVIDIA H100")
