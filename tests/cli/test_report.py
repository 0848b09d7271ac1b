"""The study report on constructed API answers (the report is under test, not the service)."""

from __future__ import annotations

import math
import statistics
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest
from live_service import free_port

from autotune.cli.plots import failures_figure, pareto_figure, progress_figure
from autotune.cli.report import write_report
from autotune.cli.report_data import best_so_far, importances, pareto_front, remeasured_points
from autotune.contract.protocol import StudySpec
from autotune.contract.views import ConfigVerdict, Recommendation, StudyInfo, TrialInfo


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
    """Nothing to draw: no figure is written (no empty axes), and the page says why for each."""
    files = write_report(study, [], None, tmp_path)
    page = files.html.read_text()
    assert _body(page).startswith("<h1 class=headline>No verdict yet</h1>")
    assert files.figures == {} and not list(tmp_path.glob("*.png"))
    assert "pareto.png is left out: no trial has completed with a throughput and a quality yet" in page
    assert "progress.png is left out: the baseline has no throughput yet" in page
    assert "importances.png is left out: 0 completed search trials" in page
    assert "failures.png is left out: no trial has run yet." in page
    assert "<img" not in page


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


def _body(page: str) -> str:
    return page.split("<body>", 1)[1].lstrip()


def _geomean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def remeasure(number: int, of: int, round_: int, tp: float, nrmse: float) -> TrialInfo:
    return TrialInfo(trial_id=100 + number, number=number, state="COMPLETE", params={}, throughput_samples_per_s=tp,
                     val_nrmse=nrmse, feasible=True, role="remeasure", remeasure_of=of, remeasure_round=round_)


BASE_RUNS = [(100.0, 0.50), (110.0, 0.52), (90.0, 0.48)]  # the seeds: trials 0-2
BASE_REMEASURES = [(120.0, 0.49), (125.0, 0.50), (118.0, 0.51)]
PICK_REMEASURES = [(170.0, 0.50), (180.0, 0.51), (175.0, 0.505)]


@pytest.fixture
def verdict_trials() -> list[TrialInfo]:
    """Three seeds, three search trials and a repeat, then three rounds re-measuring trial 5 and
    the baseline (trial 0): the pick's search trial (200/s) flattered it, the re-measured
    baseline (~110/s) is faster than its seeds' mean."""
    seeds = [trial(i, tp, q, True, baseline=True) for i, (tp, q) in enumerate(BASE_RUNS)]
    search = [trial(3, 150.0, 0.51, True, batch_size=8), trial(4, 300.0, 0.90, False, batch_size=32),
              trial(5, 200.0, 0.505, True, batch_size=16),
              TrialInfo(trial_id=106, number=6, state="REPEAT", params={"batch_size": 16}, repeat_of=5)]
    rounds = []
    number = 7
    for r in range(3):
        for of, runs in ((5, PICK_REMEASURES), (0, BASE_REMEASURES))[:: 1 if r % 2 == 0 else -1]:
            rounds.append(remeasure(number, of, r, *runs[r]))
            number += 1
    return [*seeds, *search, *rounds]


@pytest.fixture
def certified() -> Recommendation:
    """What the service's verdict says of `verdict_trials`: trial 5 certified against the
    baseline's six runs (its seeds count at samples_factor 1)."""
    base = [*BASE_RUNS, *BASE_REMEASURES]
    base_tp, base_q = _geomean([tp for tp, _ in base]), statistics.fmean(q for _, q in base)
    pick_tp, pick_q = _geomean([tp for tp, _ in PICK_REMEASURES]), statistics.fmean(q for _, q in PICK_REMEASURES)
    speedup = pick_tp / base_tp
    rows = [ConfigVerdict(trial_number=0, role="baseline", status="baseline", n=6, throughput_samples_per_s=base_tp,
                          quality_mean=base_q),
            ConfigVerdict(trial_number=5, role="candidate", status="certified", n=3, throughput_samples_per_s=pick_tp,
                          quality_mean=pick_q, speedup=speedup, speedup_ci_low=1.2, speedup_ci_high=1.9,
                          quality_margin=0.01)]
    return Recommendation(study="s", config={"batch_size": 16}, trial_number=5, throughput_samples_per_s=pick_tp,
                          val_nrmse=pick_q, quality=pick_q, baseline_throughput_samples_per_s=base_tp,
                          baseline_quality=base_q, baseline_val_nrmse=base_q, speedup=speedup, speedup_ci_low=1.2,
                          speedup_ci_high=1.9, gate_quality=base_q + 0.01, gate_nrmse=base_q + 0.01,
                          search_gate_quality=0.54, certified=True, outcome="certified", remeasured=True,
                          baseline_remeasured=True, configs=rows, rounds_run=3, max_rounds=4,
                          reason="trial 5 is certified: faster: speedup 1.59× (interval 1.20–1.90×); quality no worse")


def test_remeasured_points_aggregate_like_the_verdict(study: StudyInfo, verdict_trials: list[TrialInfo],
                                                      certified: Recommendation) -> None:
    """Geometric-mean throughput and mean quality; the baseline's runs are its seeds and its
    re-measurements (samples_factor 1). From the trials alone and from the verdict's rows alike."""
    base = [*BASE_RUNS, *BASE_REMEASURES]
    for rec in (None, certified):
        baseline, pick = remeasured_points(study, verdict_trials, rec)
        assert (baseline.role, baseline.number, baseline.n, baseline.remeasures) == ("baseline", 0, 6, 3)
        assert baseline.throughput_samples_per_s == pytest.approx(_geomean([tp for tp, _ in base]))
        assert baseline.quality == pytest.approx(statistics.fmean(q for _, q in base))
        assert (pick.role, pick.number, pick.n) == ("candidate", 5, 3)
        assert pick.throughput_samples_per_s == pytest.approx(_geomean([tp for tp, _ in PICK_REMEASURES]))
        assert pick.status == (None if rec is None else "certified")


def test_pareto_draws_the_baseline_remeasured_and_the_gates_the_verdict_used(
        study: StudyInfo, verdict_trials: list[TrialInfo], certified: Recommendation) -> None:
    fig = pareto_figure(study, verdict_trials, certified).figure
    ax = fig.axes[0]
    points = {c.get_label(): c.get_offsets().tolist() for c in ax.collections}
    baseline = next(v for k, v in points.items() if k.startswith("baseline as the verdict measured it"))
    assert baseline == [[pytest.approx(certified.baseline_throughput_samples_per_s),
                         pytest.approx(certified.baseline_quality)]]
    assert "baseline as the verdict measured it (3 seeds + 3 re-measurements)" in points
    assert points["re-measured candidate: certified"] == [[pytest.approx(certified.throughput_samples_per_s),
                                                           pytest.approx(certified.quality)]]
    assert points["recommended: trial 5, certified"] == points["re-measured candidate: certified"]
    assert len([c for c in ax.get_children() if type(c).__name__ == "Annotation"]) == 1  # search 5 → re-measured 5
    lines = {line.get_label(): line.get_ydata()[0] for line in ax.get_lines() if line.get_label()[0] != "_"}
    assert lines["quality gate NRMSE ≤ 0.5400: judged the search trials"] == pytest.approx(0.54)
    bound = next(k for k in lines if k.startswith("verdict's bound"))
    assert lines[bound] == pytest.approx(certified.gate_quality) and "the baseline's mean + Δ 0.01" in bound
    assert not any("re-measure probe" in k for k in lines)
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_a_kept_baseline_draws_only_the_search_gate(study: StudyInfo, verdict_trials: list[TrialInfo],
                                                    certified: Recommendation) -> None:
    rows = [certified.configs[0], certified.configs[1].model_copy(update={"status": "undecided"})]
    kept = certified.model_copy(update={
        "certified": False, "outcome": "undecided", "trial_number": 0, "configs": rows, "gate_quality": 0.54,
        "throughput_samples_per_s": certified.baseline_throughput_samples_per_s, "quality": certified.baseline_quality,
        "speedup": 1.0, "speedup_ci_low": None, "speedup_ci_high": None})
    fig = pareto_figure(study, verdict_trials, kept).figure
    ax = fig.axes[0]
    labels = [c.get_label() for c in ax.collections] + [line.get_label() for line in ax.get_lines()]
    assert "verdict: keep the baseline (undecided)" in labels and "re-measured candidate: undecided" in labels
    assert not any(k.startswith(("verdict's bound", "recommended")) for k in labels)
    assert [k for k in labels if "gate" in k] == ["quality gate NRMSE ≤ 0.5400: judged the search trials"]
    import matplotlib.pyplot as plt

    plt.close(fig)


def _integer_ticks(axis: object, low: float, high: float) -> list[float]:
    ticks = [t for t in axis.get_majorticklocs() if low - 1e-9 <= t <= high + 1e-9]  # type: ignore[attr-defined]
    assert len(ticks) >= 2
    return ticks


def test_trial_number_and_count_axes_have_integer_ticks(study: StudyInfo) -> None:
    """Two candidates (trials 1 and 2): matplotlib would tick 1.0, 1.2, ... 2.0 without the locator."""
    trials = [trial(0, 100.0, 0.5, True, baseline=True), trial(1, 150.0, 0.5, True, batch_size=8),
              trial(2, 180.0, 0.5, True, batch_size=16),
              trial(3, None, None, None, state="FAIL", failure={"kind": "oom", "message": "x"}, batch_size=32)]
    fig = progress_figure(study, trials).figure
    ax = fig.axes[0]
    ticks = _integer_ticks(ax.xaxis, *ax.get_xlim())
    assert all(t == int(t) for t in ticks)
    fig.canvas.draw()
    assert all(label.get_text().lstrip("−-").isdigit() for label in ax.get_xticklabels() if label.get_text())
    failures = failures_figure(trials).figure  # one failure: counts 0 and 1, not 0.2, 0.4, ...
    for ax in failures.axes:
        assert all(t == int(t) for t in _integer_ticks(ax.yaxis, *ax.get_ylim()))
    import matplotlib.pyplot as plt

    plt.close(fig)
    plt.close(failures)


def test_a_plot_below_its_threshold_is_left_out_with_a_sentence(study: StudyInfo, verdict_trials: list[TrialInfo],
                                                                certified: Recommendation, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "importances.png").write_bytes(b"an earlier report's")  # not left behind to contradict the page
    files = write_report(study, verdict_trials, certified, out)
    page = files.html.read_text()
    assert set(files.figures) == {"pareto", "progress"}
    assert not (out / "importances.png").exists() and not (out / "failures.png").exists()
    assert ("importances.png is left out: 3 completed search trials, and importances from fewer than 20 rank "
            "noise") in page
    assert "failures.png is left out: none of the 13 trials failed." in page
    assert 'src="importances.png"' not in page and 'src="failures.png"' not in page
    assert files.left_out.keys() == {"importances", "failures"}


def test_failures_png_is_written_when_a_trial_failed(study: StudyInfo, trials: list[TrialInfo],
                                                    tmp_path: Path) -> None:
    files = write_report(study, trials, None, tmp_path)
    assert (tmp_path / "failures.png").exists() and 'src="failures.png"' in files.html.read_text()
    assert not (tmp_path / "importances.png").exists()


def test_the_headline_is_the_verdict_and_the_table_marks_remeasures(
        study: StudyInfo, verdict_trials: list[TrialInfo], certified: Recommendation, tmp_path: Path) -> None:
    files = write_report(study, verdict_trials, certified, tmp_path)
    page = files.html.read_text()
    title = "Verdict: trial 5, certified: 1.59× the baseline&#x27;s throughput (interval 1.20–1.90×)"
    assert _body(page).startswith(f"<h1 class=headline>{title}</h1>\n<p class=verdict>trial 5 is certified")
    assert files.headline.startswith("Verdict: trial 5, certified: 1.59× the baseline's throughput "
                                     "(interval 1.20–1.90×): trial 5 is certified")
    assert page.count("<tr class=remeasure>") == 6
    assert "re-measure of #5, round 1" in page and "re-measure of #0, round 3" in page
    assert "<tr class=repeat>" in page and "search: repeat of #5, not run" in page
    assert "search · the recommended config" in page
    assert "the verdict&#x27;s bound ≤ " in page and "the search&#x27;s gate ≤ 0.5400" in page


def test_a_kept_baseline_is_the_headline(study: StudyInfo, trials: list[TrialInfo], tmp_path: Path) -> None:
    rec = Recommendation(study="s", config={}, trial_number=0, throughput_samples_per_s=100.0,
                         baseline_throughput_samples_per_s=100.0, speedup=1.0, certified=False, outcome="no_win",
                         reason="no config beat the baseline: trial 6: not faster; keep the baseline config")
    files = write_report(study, trials, rec, tmp_path)
    assert _body(files.html.read_text()).startswith(
        "<h1 class=headline>Verdict: keep the baseline (no win)</h1>\n<p class=verdict>no config beat the baseline")
    assert files.headline == ("Verdict: keep the baseline (no win): no config beat the baseline: trial 6: not "
                              "faster; keep the baseline config")


def test_importances_png_is_written_from_enough_search_trials(study: StudyInfo, tmp_path: Path) -> None:
    many = [trial(0, 100.0, 0.5, True, baseline=True)] + [
        trial(1 + i, 100.0 + 10 * i * (1 + (i % 2)), 0.5 + 0.01 * (i % 3), True, batch_size=[4, 8, 16, 32][i % 4],
              precision=["fp32", "bf16"][i % 2]) for i in range(20)]
    files = write_report(study, many, None, tmp_path)
    assert "importances" in files.figures and 'src="importances.png"' in files.html.read_text()
    assert matplotlib.image.imread(files.figures["importances"]).shape[0] > 100


def test_a_report_folder_that_cannot_be_made_exits_2_before_the_service_is_asked(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "report"
    port = free_port()  # nothing listens: asking the service would be exit 1, "cannot reach"
    done = subprocess.run([sys.executable, "-m", "autotune.cli", "report", "s1", "--out", str(out), "--api", f"http://127.0.0.1:{port}"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"error: --out {out}: cannot make it a directory (Not a directory)" in done.stderr
