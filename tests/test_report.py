"""The study report on constructed API answers (the report is under test, not the service)."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image
import pytest

from autotune.protocol import Recommendation, StudyInfo, StudySpec, TrialInfo
from autotune.report import best_so_far, importances, pareto_front, write_report


def trial(number: int, tp: float | None, nrmse: float | None, feasible: bool | None, state: str = "COMPLETE",
          baseline: bool = False, failure: dict[str, str] | None = None, **params: object) -> TrialInfo:
    return TrialInfo(trial_id=100 + number, number=number, state=state, params=dict(params),
                     throughput_samples_per_s=tp, val_nrmse=nrmse, feasible=feasible, is_baseline=baseline,
                     role="baseline" if baseline else "search", failure=failure)


@pytest.fixture
def study() -> StudyInfo:
    spec = StudySpec(name="s", space="cpu")
    return StudyInfo(name="s", state="finished", spec=spec, counts={"COMPLETE": 7, "FAIL": 1},
                     failures={"oom": 1})


@pytest.fixture
def trials() -> list[TrialInfo]:
    return [
        trial(0, 100.0, 0.50, True, baseline=True),
        trial(1, 150.0, 0.52, True, batch_size=8, precision="fp32"),
        trial(2, 300.0, 0.90, False, batch_size=32, precision="fp32"),
        trial(3, 120.0, 0.45, True, batch_size=4, precision="bf16"),
        trial(4, None, None, None, state="FAIL", failure={"kind": "oom", "message": "out of memory"},
              batch_size=32, precision="bf16"),
        trial(5, 140.0, 0.60, False, batch_size=16, precision="bf16"),
        trial(6, 200.0, 0.51, True, batch_size=16, precision="fp32"),
        trial(7, 90.0, 0.70, False, batch_size=4, precision="fp32"),
    ]


def test_pareto_front_keeps_only_non_dominated_candidates(trials: list[TrialInfo]) -> None:
    """Not the baseline (the reference), not the faster infeasible trial 2: candidates only."""
    assert [t.number for t in pareto_front(trials)] == [3, 6]


def test_best_so_far_tracks_feasible_speedup(trials: list[TrialInfo]) -> None:
    curve = dict(best_so_far(trials))
    assert curve[0] is None  # the baseline is the reference, not a finding
    assert curve[1] == pytest.approx(1.5)
    assert curve[2] == pytest.approx(1.5)  # infeasible, even though faster
    assert curve[6] == pytest.approx(2.0)
    assert curve[7] == pytest.approx(2.0)


def test_importances_need_enough_trials(study: StudyInfo, trials: list[TrialInfo]) -> None:
    assert importances(study, trials) == {}  # 6 completed search trials rank noise
    many = [trial(10 + i, 100.0 + 10 * i * (1 + (i % 2)), 0.5, True, batch_size=[4, 8, 16, 32][i % 4],
                  precision=["fp32", "bf16"][i % 2]) for i in range(20)]
    imp = importances(study, many)
    assert set(imp) == {"throughput", "quality"}
    assert set(imp["throughput"]) == {"batch_size", "precision"}
    assert sum(imp["throughput"].values()) == pytest.approx(1.0)


def test_write_report_produces_html_and_images(study: StudyInfo, trials: list[TrialInfo], tmp_path: Path) -> None:
    rec = Recommendation(study="s", config={"batch_size": 16}, trial_number=6, throughput_samples_per_s=200.0,
                         certified=True, outcome="certified",
                         val_nrmse=0.51, baseline_throughput_samples_per_s=100.0, baseline_val_nrmse=0.5,
                         speedup=2.0, gate_nrmse=0.51, speedup_ci_low=1.8, speedup_ci_high=2.2,
                         verdict="2.00× (95 % CI 1.80–2.20×) the baseline's throughput: faster beyond the noise")
    files = write_report(study, trials, rec, tmp_path / "out")
    page = files.html.read_text()
    assert "2.00× the baseline" in page and "oom: out of memory" in page
    for path in files.figures.values():
        image = matplotlib.image.imread(path)  # a decodable PNG, not just a file
        assert image.shape[0] > 100 and image.shape[1] > 100


def test_report_without_recommendation_or_trials(study: StudyInfo, tmp_path: Path) -> None:
    files = write_report(study, [], None, tmp_path)
    assert "No verdict yet" in files.html.read_text()
    assert all(p.stat().st_size > 0 for p in files.figures.values())


def test_a_report_names_the_studys_own_metric_and_its_direction(tmp_path: Path) -> None:
    """An accuracy study (maximize): the page and the front use val_accuracy, never NRMSE."""
    spec = StudySpec(name="acc", space="cpu", quality={"metric": "val_accuracy", "direction": "maximize"})
    study = StudyInfo(name="acc", state="finished", spec=spec, counts={"COMPLETE": 3})

    def acc_trial(number: int, tp: float, accuracy: float, feasible: bool, **params: object) -> TrialInfo:
        return TrialInfo(trial_id=number, number=number, state="COMPLETE", params=dict(params),
                         throughput_samples_per_s=tp, quality=accuracy, quality_metric="val_accuracy",
                         feasible=feasible, is_baseline=number == 0, role="baseline" if number == 0 else "search")

    trials = [acc_trial(0, 100.0, 0.90, True), acc_trial(1, 200.0, 0.80, False, batch_size=8),
              acc_trial(2, 150.0, 0.95, True, batch_size=4), acc_trial(3, 120.0, 0.85, True, batch_size=16)]
    assert [t.number for t in pareto_front(trials, "maximize")] == [2]  # higher accuracy is better
    assert [t.number for t in pareto_front(trials)] == [3, 2]  # the same points, minimized: neither dominates
    rec = Recommendation(study="acc", config={"batch_size": 4}, trial_number=2, throughput_samples_per_s=150.0,
                         baseline_throughput_samples_per_s=100.0, speedup=1.5, quality_metric="val_accuracy",
                         quality_direction="maximize", quality=0.95, baseline_quality=0.90, gate_quality=0.89,
                         certified=True, outcome="certified")
    page = write_report(study, trials, rec, tmp_path).html.read_text()
    assert "val_accuracy 0.9500 (baseline 0.9000, gate ≥ 0.8900)" in page
    assert "<th>val_accuracy</th>" in page and "NRMSE" not in page


def test_a_report_without_a_certified_pick_says_keep_the_baseline(study: StudyInfo, trials: list[TrialInfo],
                                                                   tmp_path: Path) -> None:
    rec = Recommendation(study="s", config={}, trial_number=0, throughput_samples_per_s=100.0,
                         baseline_throughput_samples_per_s=100.0, speedup=1.0, certified=False, outcome="undecided",
                         reason="no config was certified within the re-measure budget")
    page = write_report(study, trials, rec, tmp_path / "out").html.read_text()
    assert "Verdict: keep the baseline" in page and "within the re-measure budget" in page
    assert "CERTIFIED" not in page
