"""autotune.engine.epoch_cost: a DataLoader epoch start, moved from the window that timed it to every
window at the rate a long run pays it."""

from __future__ import annotations

import pytest

from autotune.engine.epoch_cost import Boundary, amortized_seconds, epoch_costs, gpu_idle_summary

# four windows of 10 micro-batches each; epochs of 25 micro-batches
SPANS = [(5, 15), (15, 25), (25, 35), (35, 45)]


def test_a_boundary_gives_its_stall_back_and_every_window_takes_its_share() -> None:
    waits = [0.10, 0.10, 0.10 + 0.29, 0.10]  # 10 ms a fetch; window 3's boundary fetch took 300 ms
    boundaries = [Boundary(30, 0.30)]
    costs = epoch_costs(SPANS, waits, boundaries)
    assert costs is not None
    assert costs.typical_fetch_s == pytest.approx(0.01)
    assert costs.window_of == [2]
    assert costs.excess_s == pytest.approx([0.29]) and costs.cost_s == pytest.approx(0.29)
    assert costs.window_excess_s == pytest.approx([0, 0, 0.29, 0])

    seconds = [1.0, 1.0, 1.29, 1.0]
    adjusted = amortized_seconds(seconds, SPANS, costs.window_excess_s, costs.cost_s, 25)
    assert adjusted == pytest.approx([1.0 + 0.29 * 10 / 25] * 4)  # no outlier left
    # in all: 40 timed micro-batches pay 40/25 epoch starts, not the 1 the windows happened to time
    assert sum(adjusted) - sum(seconds) == pytest.approx(0.29 * (40 / 25 - 1))


def test_on_a_gpu_the_time_it_idled_is_charged_not_the_host_stall() -> None:
    """The host's 300 ms stall left the GPU idle for 210 ms (queued work ran through the rest):
    the window gives back and every window takes 210 ms over a typical fetch, while the typical
    fetch is still the window's host wait without the host's stall."""
    waits = [0.10, 0.10, 0.10 + 0.29, 0.10]
    costs = epoch_costs(SPANS, waits, [Boundary(30, 0.30, gpu_gap_s=0.21)])
    assert costs is not None
    assert costs.typical_fetch_s == pytest.approx(0.01)  # (0.39 - 0.30) / 9, not (0.39 - 0.21) / 9
    assert costs.excess_s == pytest.approx([0.20]) and costs.cost_s == pytest.approx(0.20)
    assert costs.window_excess_s == pytest.approx([0, 0, 0.20, 0])
    adjusted = amortized_seconds([1.0, 1.0, 1.20, 1.0], SPANS, costs.window_excess_s, costs.cost_s, 25)
    assert adjusted == pytest.approx([1.0 + 0.20 * 10 / 25] * 4)


def test_an_unknown_gpu_gap_falls_back_to_the_host_stall() -> None:
    waits = [0.10, 0.10, 0.10 + 0.29, 0.10]
    assert Boundary(30, 0.30).cost_s == 0.30 and Boundary(30, 0.30, 0.0).cost_s == 0.0
    costs = epoch_costs(SPANS, waits, [Boundary(30, 0.30), Boundary(55, 0.41, gpu_gap_s=0.11)])
    assert costs is not None
    assert costs.excess_s == pytest.approx([0.29, 0.10])  # the stall where no gap is known, else the gap
    assert costs.cost_s == pytest.approx(0.195)
    # a gap that queued work covered entirely costs nothing
    covered = epoch_costs(SPANS, waits, [Boundary(30, 0.30, gpu_gap_s=0.0)])
    assert covered is not None and covered.excess_s == [0.0] and covered.typical_fetch_s == pytest.approx(0.01)


def test_the_gpu_idle_summary_says_how_much_of_the_stall_the_gpu_idled() -> None:
    assert gpu_idle_summary([Boundary(30, 0.299, gpu_gap_s=0.204)]) == "the GPU idled 204 of the host's 299 ms"
    # the means over the boundaries whose gap is known; none known (a CPU): nothing to say
    assert gpu_idle_summary([Boundary(30, 0.3, 0.2), Boundary(55, 0.9), Boundary(80, 0.2, 0.1)]) == (
        "the GPU idled 150 of the host's 250 ms")
    assert gpu_idle_summary([Boundary(30, 0.3)]) is None and gpu_idle_summary([]) is None


def test_boundaries_outside_the_windows_set_the_cost_but_give_nothing_back() -> None:
    waits = [0.1, 0.1, 0.1, 0.1]
    costs = epoch_costs(SPANS, waits, [Boundary(2, 0.21), Boundary(50, 0.41)])  # warm-up, untimed tail
    assert costs is not None
    assert costs.window_of == [None, None]
    assert costs.cost_s == pytest.approx((0.20 + 0.40) / 2)
    assert costs.window_excess_s == [0, 0, 0, 0]
    adjusted = amortized_seconds([1.0] * 4, SPANS, costs.window_excess_s, costs.cost_s, 25)
    assert adjusted == pytest.approx([1.0 + 0.3 * 10 / 25] * 4)


def test_a_fetch_no_slower_than_usual_costs_nothing() -> None:
    costs = epoch_costs(SPANS, [0.1] * 4, [Boundary(20, 0.005)])
    assert costs is not None and costs.excess_s == [0.0] and costs.cost_s == 0.0
    assert amortized_seconds([1.0] * 4, SPANS, costs.window_excess_s, 0.0, 25) == [1.0] * 4


def test_no_boundary_means_no_estimate() -> None:
    assert epoch_costs(SPANS, [0.1] * 4, []) is None


def test_a_stall_the_window_did_not_wait_out_is_not_moved() -> None:
    # the window's clock saw less time than the host's stall: nothing to give back from
    assert amortized_seconds([0.2, 1.0], SPANS[:2], [0.3, 0.0], 0.3, 25) is None


def test_bad_input_names_the_problem() -> None:
    with pytest.raises(ValueError, match="4 window spans but 3 data waits"):
        epoch_costs(SPANS, [0.1] * 3, [Boundary(20, 0.3)])
    with pytest.raises(ValueError, match="epoch_micro_batches must be positive"):
        amortized_seconds([1.0] * 4, SPANS, [0.0] * 4, 0.1, 0)
