"""The decision rule's statistics (autotune/contract/verdict.py), from known values."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from autotune.contract.verdict import Sample, judge, level_at, look_alpha, t_cdf, t_ppf, welch, wilson


@pytest.mark.parametrize(("p", "dof", "expected"), [
    (0.975, 1, 12.7062), (0.975, 2, 4.3027), (0.975, 3, 3.1824), (0.975, 10, 2.2281), (0.95, 5, 2.0150),
    (0.995, 4, 4.6041), (0.975, 1e9, 1.95996), (0.5, 7, 0.0)])
def test_t_quantiles_match_the_tables(p: float, dof: float, expected: float) -> None:
    assert t_ppf(p, dof) == pytest.approx(expected, abs=2e-4)
    assert t_cdf(t_ppf(p, dof), dof) == pytest.approx(p, abs=1e-9)


def test_welch_degrees_of_freedom_follow_satterthwaite() -> None:
    a, b = [1.0, 1.2, 0.9, 1.4], [2.0, 2.1]
    d = welch(Sample.of(a), Sample.of(b))
    va, vb = statistics.variance(a) / 4, statistics.variance(b) / 2
    assert d.se == pytest.approx(math.sqrt(va + vb))
    assert d.dof == pytest.approx((va + vb) ** 2 / (va ** 2 / 3 + vb ** 2 / 1))


def test_the_spending_sums_to_alpha_and_spends_little_early() -> None:
    assert sum(look_alpha(0.025, j, 6) for j in range(1, 7)) == pytest.approx(0.025)
    assert look_alpha(0.025, 1, 6) < look_alpha(0.025, 6, 6)
    assert level_at(0.95, 2, 1, 1) == pytest.approx(0.0125)


def test_a_noisy_baseline_does_not_hide_a_plain_2x() -> None:
    """The runs behind the issue: a host-bound baseline spread 26 %, the pick within 2 %."""
    j = judge([12560, 12386], [7750, 7559, 5953, 6439], [1.0, 1.0], [1.0, 1.0, 1.0], alpha=0.0125, abs_tol=0.01,
              k=2.0)
    assert j.status == "certified" and j.ratio_low is not None and j.ratio_low > 1.3
    pooled = statistics.stdev([math.log(v) for v in (7750, 7559, 5953, 6439)])  # one spread for both
    assert j.ratio_high is not None and j.ratio_high / j.ratio_low < math.exp(2 * 3.2 * pooled)


def test_quality_is_judged_with_all_runs_against_the_spread_at_that_budget() -> None:
    """The causal-LM case: at the longer budget the baseline's seeds spread 0.098; the pick is no worse."""
    base, pick = [1.246, 1.050, 1.147], [1.093, 1.029, 1.104]
    j = judge([200.0, 201.0, 199.0], [100.0, 101.0, 99.0], pick, base, alpha=0.025, abs_tol=0.01, k=2.0)
    assert j.margin == pytest.approx(2 * statistics.stdev(base))
    assert j.status == "certified", j.reason
    worse = [q + 0.5 for q in base]  # 5 sd worse
    assert judge([200.0, 201.0, 199.0], [100.0, 101.0, 99.0], worse, base, alpha=0.025, abs_tol=0.01,
                 k=2.0).status == "rejected"


def test_seed_matched_runs_judge_quality_on_their_differences() -> None:
    """The CPU demo's study: the baseline's seeds spread 0.013 in NRMSE, and a config that trains
    the same model with the inverse losses every 4 steps tracks it seed by seed, 0.010 worse
    (within the margin 2σ). Its four rounds' unmatched means cannot show that at the last look's
    level; their seed-matched differences do."""
    base = [0.4371, 0.4142, 0.4576, 0.4322, 0.4351, 0.4326, 0.4432]  # 3 search seeds, then rounds 0-3
    pick = [0.4395, 0.4479, 0.4475, 0.4493]  # rounds 0-3
    speed = ([480.0, 475.0, 418.0, 435.0], [188.0, 185.0, 189.0, 198.0, 186.0, 189.0, 189.0])
    unmatched = judge(*speed, pick, base, alpha=0.0094, abs_tol=0.01, k=2.0)
    assert unmatched.status == "undecided" and "not yet shown no worse" in unmatched.reason
    pairs = list(zip(pick, base[3:], strict=True))  # round r of each: one probe seed
    matched = judge(*speed, pick, base, alpha=0.0094, abs_tol=0.01, k=2.0, quality_pairs=pairs)
    assert matched.status == "certified" and "seed-matched difference (n=4)" in matched.reason, matched.reason
    assert matched.quality_diff == pytest.approx(statistics.fmean(p - b for p, b in pairs))
    assert matched.margin == unmatched.margin == pytest.approx(2 * statistics.stdev(base))  # all the baseline's runs
    # a config that tracks the baseline but is worse beyond the margin in every round is rejected
    worse = [b + 0.04 for b in base[3:]]
    assert judge(*speed, worse, base, alpha=0.0094, abs_tol=0.01, k=2.0,
                 quality_pairs=list(zip(worse, base[3:], strict=True))).status == "rejected"
    one = judge(*speed, pick, base, alpha=0.0094, abs_tol=0.01, k=2.0, quality_pairs=[(pick[0], base[3])])
    assert one.status == "undecided" and "2 seed-matched runs" in one.reason  # one pair has no spread


def test_seed_matched_quality_keeps_its_level_at_the_margin() -> None:
    """A candidate exactly at the margin (worse by abs_tol), seed effects shared, its own noise
    0.004: certified no more often than the test's level (2.5 %), over 2 000 simulated studies."""
    rng = random.Random(1)
    hits = 0
    for _ in range(2000):
        seeds = [rng.gauss(0, 0.05) for _ in range(4)]
        base = [0.4 + s + rng.gauss(0, 0.0005) for s in seeds]
        pick = [0.41 + s + rng.gauss(0, 0.004) for s in seeds]
        j = judge([200.0, 201.0, 199.0, 200.0], [100.0, 101.0, 99.0, 100.0], pick, base, alpha=0.025, abs_tol=0.01,
                  k=0.0, quality_pairs=list(zip(pick, base, strict=True)))
        hits += j.status == "certified"
    assert hits / 2000 < 0.035


def test_too_few_runs_are_undecided_and_a_slower_config_is_rejected() -> None:
    assert judge([200.0], [100.0, 101.0], [0.1], [0.1] * 3, alpha=0.025, abs_tol=0.01, k=2).status == "undecided"
    assert judge([200.0, 201.0], [100.0, 101.0], [0.1] * 2, [0.1] * 2, alpha=0.025, abs_tol=0.01,
                 k=2).status == "undecided"  # quality needs three baseline runs
    slow = judge([50.0, 51.0], [100.0, 101.0, 99.0], [0.1] * 2, [0.1] * 3, alpha=0.025, abs_tol=0.01, k=2)
    assert slow.status == "rejected" and "below parity" in slow.reason


def test_energy_is_judged_lower_is_better() -> None:
    j = judge([0.5, 0.51], [1.0, 1.02, 0.99], [0.1] * 2, [0.1] * 3, alpha=0.025, abs_tol=0.01, k=2,
              higher_is_better=False, metric="energy ratio")
    assert j.status == "certified" and j.ratio == pytest.approx(0.5, rel=0.05)


def test_an_aa_comparison_is_rarely_certified() -> None:
    """A rough check of the level: equal configs, 13 % spread, 3 vs 4 runs, one look."""
    rng = random.Random(0)
    hits = 0
    for _ in range(400):
        a = [100 * math.exp(rng.gauss(0, 0.13)) for _ in range(3)]
        b = [100 * math.exp(rng.gauss(0, 0.13)) for _ in range(4)]
        hits += judge(a, b, [0.1, 0.1], [0.1] * 4, alpha=0.025, abs_tol=0.01, k=2).status == "certified"
    assert hits / 400 < 0.05


def test_wilson_interval() -> None:
    low, high = wilson(0, 100)
    assert low == 0.0 and high == pytest.approx(0.037, abs=0.002)
    low, high = wilson(95, 100)
    assert low < 0.95 < high
