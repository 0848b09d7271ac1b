"""The language-model knobs in the contract: declared once, defaults that change nothing, errors that
name the knob and the fix, and the hardware rules a CPU study's spec and space are checked by."""

from __future__ import annotations

from typing import Any

import pytest

from autotune.contract.config import (
    ATTENTION_BACKENDS,
    HARDWARE_KNOBS,
    HF_ATTN_IMPLEMENTATIONS,
    INDUCTOR_TUNINGS,
    KNOBS,
    LR_SCALINGS,
    ConfigError,
    TrainConfig,
    check_hardware,
    parse_config,
)
from autotune.contract.space import SpaceError, parse_space, validate_for

LM_KNOBS = {"attention_backend": ("auto", ATTENTION_BACKENDS),
            "hf_attn_implementation": ("auto", HF_ATTN_IMPLEMENTATIONS), "liger_kernels": (False, (False, True)),
            "inductor_tuning": ("none", INDUCTOR_TUNINGS), "lr_scaling": ("none", LR_SCALINGS)}


@pytest.mark.parametrize("name", sorted(LM_KNOBS))
def test_each_lm_knob_is_declared_once_with_a_default_that_changes_nothing(name: str) -> None:
    default, choices = LM_KNOBS[name]
    knob = KNOBS[name]
    assert knob.default == default and getattr(TrainConfig(), name) == default and knob.choices == choices
    assert knob.doc and parse_config({name: default}) == TrainConfig()
    for value in choices:
        assert getattr(parse_config({name: value}), name) == value


@pytest.mark.parametrize(("raw", "expected"), [
    ({"attention_backend": "flash2"}, "allowed: auto | flash | efficient | cudnn | math"),
    ({"hf_attn_implementation": "flash_attention_2"}, "allowed: auto | sdpa | eager | flex_attention"),
    ({"liger_kernels": "yes"}, "expected true or false"),
    ({"inductor_tuning": "max-autotune"}, "allowed: none | coordinate_descent | max_autotune_gemm | "
                                          "max_autotune_gemm+coordinate_descent"),
    ({"lr_scaling": "cubic"}, "allowed: none | linear | sqrt"),
])
def test_a_bad_lm_knob_value_names_the_knob_and_what_is_allowed(raw: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    assert info.value.knob == next(iter(raw)) and expected in str(info.value)


def test_a_misspelt_lm_knob_is_suggested() -> None:
    with pytest.raises(ConfigError, match="did you mean 'attention_backend'"):
        parse_config({"attention_backends": "math"})


@pytest.mark.parametrize(("values", "knob", "fix"), [
    ({"attention_backend": "efficient"}, "attention_backend", "use auto, flash (torch's CPU flash kernel) or math"),
    ({"attention_backend": "cudnn"}, "attention_backend", "use auto, flash"),
    ({"liger_kernels": True}, "liger_kernels", "set liger_kernels false, or run the study on a GPU"),
])
def test_a_cpu_study_refuses_what_only_a_gpu_runs(values: dict[str, Any], knob: str, fix: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_hardware(values, "cpu")
    assert info.value.knob == knob and fix in str(info.value)
    check_hardware(values, "NVIDIA H100 80GB HBM3")
    for ok in ({"attention_backend": "math"}, {"attention_backend": "flash"}, {"liger_kernels": False}):
        check_hardware(ok, "cpu")
    assert knob in HARDWARE_KNOBS


def test_a_cpu_space_may_not_search_a_gpu_only_choice() -> None:
    space = parse_space({"name": "lm", "params": {"attention_backend": {"choices": ["auto", "math", "efficient"]},
                                                  "liger_kernels": {"choices": [False, True]},
                                                  "lr_scaling": {"choices": ["none", "sqrt"]},
                                                  "inductor_tuning": {"choices": ["none", "coordinate_descent"]}}})
    with pytest.raises(SpaceError) as info:
        validate_for(space, "cpu")
    assert "params.attention_backend" in str(info.value) and "drop it from the choices" in str(info.value)
    validate_for(space, "NVIDIA H100 80GB HBM3")
    cpu = parse_space({"name": "lm", "params": {"attention_backend": {"choices": ["auto", "math"]},
                                                "lr_scaling": {"choices": ["none", "linear", "sqrt"]}},
                       "fixed": {"liger_kernels": True}})
    with pytest.raises(SpaceError, match=r"fixed\.liger_kernels"):
        validate_for(cpu, "cpu")
