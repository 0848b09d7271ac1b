"""autotune.engine.metrics: NRMSE on known arrays."""

from __future__ import annotations

import math

import pytest
import torch

from autotune.engine.metrics import nrmse, nrmse_per_sample


def _true() -> torch.Tensor:
    return torch.linspace(-1.0, 2.0, 3 * 2 * 8, dtype=torch.float64).reshape(3, 2, 8) + 0.5


def test_nrmse_of_a_ten_percent_scaling_is_one_tenth() -> None:
    true = _true()
    assert nrmse(1.1 * true, true) == pytest.approx(0.1, abs=1e-12)
    assert nrmse(0.9 * true, true) == pytest.approx(0.1, abs=1e-12)


def test_nrmse_of_a_perfect_prediction_is_zero() -> None:
    true = _true()
    assert nrmse(true.clone(), true) == 0.0


def test_nrmse_per_sample_is_per_sample_and_field() -> None:
    true = torch.ones(2, 3, 4, dtype=torch.float64)
    pred = true.clone()
    pred[1, 2] = 3.0  # ‖2·1‖ / ‖1‖ = 2 for this one (sample, field)
    per = nrmse_per_sample(pred, true)
    assert per.shape == (2, 3)
    expected = torch.zeros(2, 3, dtype=torch.float64)
    expected[1, 2] = 2.0
    torch.testing.assert_close(per, expected)
    assert nrmse(pred, true) == pytest.approx(2.0 / 6)


def test_nrmse_is_computed_in_float64() -> None:
    true = torch.full((1, 1, 4), 1000.0, dtype=torch.float16)
    pred = true + 1.0  # exactly representable in fp16: 1001
    per = nrmse_per_sample(pred, true)
    assert per.dtype == torch.float64
    assert float(per) == pytest.approx(1e-3, rel=1e-12)


def test_nrmse_of_a_zero_target_is_finite() -> None:
    true = torch.zeros(1, 1, 4)
    assert math.isfinite(nrmse(torch.zeros(1, 1, 4), true))
    assert nrmse(torch.zeros(1, 1, 4), true) == 0.0


def test_nrmse_rejects_a_shape_mismatch() -> None:
    with pytest.raises(ValueError, match=r"pred \(2, 3\) and true \(3, 2\) differ in shape"):
        nrmse(torch.zeros(2, 3), torch.zeros(3, 2))
    with pytest.raises(ValueError):
        nrmse_per_sample(torch.zeros(1, 2, 4), torch.zeros(1, 2, 5))
