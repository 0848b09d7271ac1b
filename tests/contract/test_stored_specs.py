"""Specs read back (from the database, or in a newer service's reply) against specs submitted."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from autotune.contract.protocol import StudySpec
from autotune.contract.views import StudyInfo


def test_a_later_versions_fields_are_dropped_when_read_back_and_refused_when_submitted() -> None:
    later = StudySpec(name="s", workload="ups").model_dump(mode="json")
    later["remeasure"]["a_later_knob"] = 3  # a field a newer service stores and sends
    later["a_later_section"] = {"x": 1}
    with pytest.raises(ValidationError, match="a_later_knob"):
        StudySpec.model_validate(later)  # submitted: a typo is named, not ignored
    spec = StudySpec.model_validate(later, context={"stored": True})
    assert spec.remeasure.top_k == 2 and "a_later_knob" not in spec.remeasure.model_dump()
    info = StudyInfo.model_validate({"name": "s", "state": "running", "spec": later}, context={"stored": True})
    assert info.spec.name == "s"  # what a client one release behind reads from /v1/studies/s
