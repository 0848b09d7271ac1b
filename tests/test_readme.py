"""The README's examples stay valid as the code changes."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from autotune.config import KNOBS
from autotune.protocol import StudySpec

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def test_the_readme_study_spec_validates() -> None:
    block = re.search(r"A study spec \(`autotune.protocol.StudySpec`\):\n\n```yaml\n(.*?)```", README, re.S)
    assert block, "the README lost its study-spec example"
    spec = StudySpec.model_validate(yaml.safe_load(block.group(1)))
    assert spec.space == "h100" and spec.baseline_seeds == 3


def test_the_readme_shows_the_two_commands_and_every_verb() -> None:
    assert "make demo" in README and "make test" in README
    for verb in ("serve", "worker", "submit", "status", "best", "report", "probe"):
        assert f"autotune {verb}" in README, verb


def test_the_readme_probe_example_uses_real_knobs() -> None:
    example = re.search(r"--config '(\{.*?\})'", README)
    assert example
    assert set(yaml.safe_load(example.group(1))) <= set(KNOBS)
