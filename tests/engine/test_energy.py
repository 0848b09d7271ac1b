"""GPU energy per sample (autotune.engine.gpu_telemetry, autotune.engine.probe): the arithmetic from counter
readings and from power samples, the meter over a fake NVML (the only stand-in: the boundary
where the driver would answer), the probe's fields and reports with that fake on a CPU, and
the pruning rules of a study that minimizes energy. The readings of a real GPU are
bench/energy.py's (bench/results/energy_h100.json)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

import autotune.engine.probe as probe_module
from autotune.api.study.prune_rules import PruneRules, Reference, decide
from autotune.contract.protocol import StudySpec
from autotune.contract.results import TrialResult
from autotune.engine.gpu_telemetry import (
    ENERGY_METHODS,
    NVML_CALLS,
    EnergyMeter,
    GpuTelemetry,
    counter_joules,
    power_integral_joules,
    summarize_energy,
)
from autotune.engine.probe import ProbeSettings, run_probe
from autotune.engine.result import ProbeResult

# --- the arithmetic ------------------------------------------------------------------------------


def test_counter_readings_give_joules() -> None:
    assert counter_joules(1_000_000, 1_250_500) == pytest.approx(250.5)  # millijoules in, joules out
    assert counter_joules(5, 5) == 0.0


@pytest.mark.parametrize(("start", "end"), [(None, 10), (10, None), (2_000, 1_000)])
def test_a_missing_or_reset_counter_is_no_measurement(start: int | None, end: int | None) -> None:
    assert counter_joules(start, end) is None  # a driver reload starts the counter again: never a guess


def test_constant_power_integrates_to_power_times_time() -> None:
    samples = [(t / 10, 300.0) for t in range(0, 21)]  # 300 W for 2 s, every 0.1 s
    assert power_integral_joules(samples, 0.0, 2.0) == pytest.approx(600.0)
    assert power_integral_joules(samples, 0.5, 1.5) == pytest.approx(300.0)  # a window inside the samples


def test_a_power_ramp_integrates_by_trapezoids() -> None:
    samples = [(0.0, 100.0), (1.0, 300.0), (2.0, 300.0)]
    assert power_integral_joules(samples, 0.0, 2.0) == pytest.approx(200.0 + 300.0)
    # window edges between samples are interpolated: 0.5 s at 150-200 W (87.5 J) + 0.5 s at 200-300 W (125 J)
    assert power_integral_joules(samples, 0.25, 1.0) == pytest.approx(0.75 * (150 + 300) / 2)


def test_power_before_the_first_and_after_the_last_sample_is_held() -> None:
    assert power_integral_joules([(1.0, 200.0)], 0.0, 3.0) == pytest.approx(600.0)  # one sample: held throughout
    assert power_integral_joules([(1.0, 100.0), (2.0, 300.0)], 0.0, 3.0) == pytest.approx(100 + 200 + 300)


@pytest.mark.parametrize("samples", [[], [(0.0, float("nan"))], [(0.0, -5.0)]])
def test_no_usable_power_sample_is_no_measurement(samples: list[tuple[float, float]]) -> None:
    assert power_integral_joules(samples, 0.0, 1.0) is None
    assert power_integral_joules([(0.0, 100.0)], 1.0, 1.0) is None  # an empty window


def test_energy_per_sample_is_the_windows_energy_over_their_samples() -> None:
    """Two GPUs, three windows of 480 samples each (all ranks'): the figure is every GPU's energy
    over every window's samples, each window's is its own, each GPU's share sums to the total."""
    joules = [[120.0, 130.0], [118.0, 122.0], [130.0, 140.0]]
    energy = summarize_energy(joules, [480, 480, 480], ["nvml_total_energy", "nvml_total_energy"])
    assert energy is not None
    assert energy.j_per_sample == pytest.approx(760.0 / 1440)
    assert energy.window_j_per_sample == pytest.approx([250 / 480, 240 / 480, 270 / 480])
    assert energy.gpu_j_per_sample == pytest.approx([368 / 1440, 392 / 1440])
    assert sum(energy.gpu_j_per_sample) == pytest.approx(energy.j_per_sample)
    assert energy.method == "nvml_total_energy"


def test_the_weaker_method_of_any_gpu_names_the_figure() -> None:
    energy = summarize_energy([[1.0, 1.0]], [10], ["nvml_total_energy", "power_integral"])
    assert energy is not None and energy.method == "power_integral"


@pytest.mark.parametrize(("joules", "methods"), [
    ([[1.0, None]], ["nvml_total_energy", "nvml_total_energy"]),  # a GPU without a reading in a window
    ([[1.0]], [None]),  # a rank without a meter
    ([], ["nvml_total_energy"]),  # no window
    ([[1.0, 2.0]], ["nvml_total_energy"]),  # readings of more GPUs than meters
    ([[-1.0]], ["power_integral"]),
])
def test_a_figure_that_would_leave_out_a_gpu_or_a_window_is_none(joules: list[list[float | None]],
                                                                   methods: list[str | None]) -> None:
    assert summarize_energy(joules, [10] * len(joules), methods) is None


# --- the meter over a fake NVML ------------------------------------------------------------------


class FakeNvml:
    """The NVML calls autotune makes, answered from scripted values (nvidia-ml-py's names)."""

    NVML_CLOCK_SM = 1
    NVML_TEMPERATURE_GPU = 0

    def __init__(self, energy_mj: list[int] | None = None, power_mw: list[int] | None = None) -> None:
        self.energy = list(energy_mj) if energy_mj is not None else None
        self.power = list(power_mw) if power_mw is not None else None

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:
        if self.energy is None:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return self.energy.pop(0) if len(self.energy) > 1 else self.energy[0]

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        if self.power is None:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return self.power.pop(0) if len(self.power) > 1 else self.power[0]

    def __getattr__(self, name: str) -> Any:  # clocks, temperature, violations, utilization: unsupported
        def unsupported(*args: Any) -> Any:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return unsupported


def test_energy_is_read_by_the_calls_nvidia_ml_py_has() -> None:
    pynvml = pytest.importorskip("pynvml")
    assert "nvmlDeviceGetTotalEnergyConsumption" in NVML_CALLS
    assert all(hasattr(pynvml, name) for name in NVML_CALLS)


def test_a_gpu_with_an_energy_counter_is_metered_by_it() -> None:
    nvml = FakeNvml(energy_mj=[0, 5_000, 5_000, 7_500, 100], power_mw=[300_000])
    meter = EnergyMeter.open(GpuTelemetry(nvml, "h"))
    assert meter is not None and meter.method == "nvml_total_energy"  # open read the counter once (0)
    meter.start()
    assert meter.stop() == pytest.approx(0.0)  # 5 000 → 5 000 mJ: an idle window
    meter.start()
    assert meter.stop() is None  # 7 500 → 100 mJ: the driver reloaded in between, no measurement


def test_the_counter_window_is_the_difference_of_its_two_reads() -> None:
    nvml = FakeNvml(energy_mj=[1_000, 1_000, 61_000, 61_000, 181_000])
    meter = EnergyMeter.open(GpuTelemetry(nvml, "h"))
    assert meter is not None
    meter.start()
    assert meter.stop() == pytest.approx(60.0)
    meter.start()
    assert meter.stop() == pytest.approx(120.0)


def test_without_a_counter_power_samples_are_integrated() -> None:
    """The fallback: power readings (mW) sampled while the window runs, on a fake clock."""
    now = [0.0]
    nvml = FakeNvml(power_mw=[200_000, 200_000, 400_000, 400_000, 400_000])
    meter = EnergyMeter.open(GpuTelemetry(nvml, "h"), clock=lambda: now[0], threaded=False)
    assert meter is not None and meter.method == "power_integral"  # open read the power once
    meter.start()  # 200 W at t = 0
    now[0] = 1.0
    meter.sample()  # 400 W at t = 1
    now[0] = 2.0
    assert meter.stop() == pytest.approx((200 + 400) / 2 + 400)  # 400 W at t = 2


def test_the_power_sampling_thread_runs_while_a_window_does() -> None:
    meter = EnergyMeter.open(GpuTelemetry(FakeNvml(power_mw=[250_000]), "h"), interval_s=0.001)
    assert meter is not None
    meter.start()
    import time

    time.sleep(0.05)
    joules = meter.stop()
    assert joules is not None and 250 * 0.04 < joules < 250 * 0.5
    meter.close()  # idempotent


def test_a_gpu_that_answers_neither_reading_has_no_meter() -> None:
    assert EnergyMeter.open(GpuTelemetry(FakeNvml(), "h")) is None
    assert EnergyMeter.open(None) is None
    with pytest.raises(ValueError, match="not one of"):
        EnergyMeter(GpuTelemetry(FakeNvml(), "h"), "guess")


# --- the probe, with the fake NVML at the boundary -----------------------------------------------


class FakeTelemetry(GpuTelemetry):
    """A GpuTelemetry over a fake NVML whose energy counter has gone up 40 J at every read: every
    window (a read at its start and one at its end) then takes 40 J."""

    def __init__(self) -> None:
        super().__init__(FakeNvml(energy_mj=[0]), "h")
        self.total = 0

    def energy_mj(self) -> int | None:
        self.total += 40_000
        return self.total


@pytest.mark.slow
def test_a_probe_records_energy_per_sample_per_window_and_reports_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU the probe opens no telemetry; with the fake one it meters every window: 40 J
    per window of 8 samples (one step of the tiny preset) is 5 J/sample, in every report too."""
    monkeypatch.setattr(probe_module.GpuTelemetry, "open", classmethod(lambda cls, device: FakeTelemetry()))
    monkeypatch.setattr(probe_module, "ENERGY_NOTE_S", 1e6)  # timed windows this short: a note
    reports: list[dict[str, float]] = []

    def on_report(step: int, metrics: dict[str, float]) -> bool:
        reports.append(metrics)
        return False

    r = run_probe("ups", {}, preset="tiny", settings=ProbeSettings(samples=96), on_report=on_report)
    assert r.ok and r.energy_method == "nvml_total_energy"
    assert r.energy_j_per_sample == pytest.approx(40.0 / (r.window_steps * 8))
    assert r.window_energy_j_per_sample == pytest.approx([r.energy_j_per_sample] * len(r.window_throughputs))
    assert r.gpu_energy_j_per_sample == pytest.approx([r.energy_j_per_sample])
    # each report: the windows' so far (here every window's is the same)
    assert [m["energy_j_per_sample"] for m in reports] == pytest.approx(r.window_energy_j_per_sample)
    assert any("energy per sample: the timed windows lasted" in n for n in r.measurement_notes)
    again = ProbeResult.from_dict(json.loads(json.dumps(r.to_dict())))
    assert again.energy_j_per_sample == r.energy_j_per_sample
    TrialResult.model_validate(r.to_dict())  # the service takes it


@pytest.mark.slow
def test_a_cpu_probe_has_no_energy(tiny: Any) -> None:
    r = run_probe("ups", {}, preset="tiny", settings=ProbeSettings(samples=96))
    assert r.ok and r.energy_j_per_sample is None and r.energy_method is None
    assert r.window_energy_j_per_sample == [] and r.gpu_energy_j_per_sample == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_probe_measures_energy() -> None:
    r = run_probe("ups", {}, preset="tiny", device="cuda", settings=ProbeSettings(samples=96))
    assert r.ok and r.energy_method in ENERGY_METHODS
    assert r.energy_j_per_sample is not None and r.energy_j_per_sample > 0
    assert len(r.window_energy_j_per_sample) == len(r.window_throughputs)


# --- wire models ---------------------------------------------------------------------------------


def test_a_result_with_a_negative_or_unknown_energy_is_refused() -> None:
    with pytest.raises(ValueError, match="energy_j_per_sample"):
        TrialResult.model_validate({"energy_j_per_sample": -0.1})
    with pytest.raises(ValueError, match="energy_method"):
        TrialResult.model_validate({"energy_method": "guessed"})


def test_energy_is_an_objective_to_minimize_named_by_its_measurement() -> None:
    spec = StudySpec(name="s", hardware="NVIDIA H100 80GB HBM3", space="h100",
                     objectives=["throughput", "quality", "energy"])
    assert spec.objective_directions() == ["maximize", "minimize", "minimize"]
    assert spec.objective_metric_names() == ["throughput_samples_per_s", "val_nrmse", "energy_j_per_sample"]


def test_a_cpu_study_cannot_minimize_energy() -> None:
    with pytest.raises(ValueError, match="hardware to the GPU name"):
        StudySpec(name="s", objectives=["energy", "quality"])


# --- pruning a study that minimizes energy -------------------------------------------------------

CURVE = [(100.0, 1.0), (200.0, 0.8), (300.0, 0.6)]


def test_a_slow_trial_that_uses_less_energy_is_kept_when_energy_counts() -> None:
    ref = Reference(best_feasible_throughput=1000.0, best_feasible_curve=CURVE, best_feasible_energy=0.10)
    slow = [100.0, 100.0]
    three = PruneRules(energy_counts=True)
    assert decide(CURVE, slow, ref, PruneRules()).prune  # two objectives: slower and no better loss
    assert not decide(CURVE, slow, ref, three, energy=0.05).prune  # thriftier: might be on the front
    assert not decide(CURVE, slow, ref, three).prune  # no energy readings: it might be thriftier
    verdict = decide(CURVE, slow, ref, three, energy=0.2)
    assert verdict.prune and verdict.rule == "dominated" and "no lower than that trial's 0.1" in (verdict.reason or "")


def test_an_energy_study_prunes_a_wasteful_trial_not_a_slow_one() -> None:
    """[energy, quality]: speed is no objective; energy above the lowest feasible / ρ with no better loss is."""
    ref = Reference(best_feasible_throughput=1000.0, best_feasible_curve=CURVE, lowest_feasible_energy=0.1,
                    lowest_energy_curve=CURVE)
    rules = PruneRules(throughput_counts=False, energy_counts=True, rho=0.5)
    assert not decide(CURVE, [10.0, 10.0], ref, rules, energy=0.15).prune  # slow, within 1/ρ
    assert not decide(CURVE, [10.0], ref, rules, energy=0.3).prune  # one window: too early to judge
    verdict = decide(CURVE, [10.0, 10.0], ref, rules, energy=0.3)
    assert verdict.prune and "above the lowest feasible 0.1" in (verdict.reason or "")
    better = [(100.0, 0.9), (200.0, 0.7), (300.0, 0.5)]
    assert not decide(better, [10.0, 10.0], ref, rules, energy=0.3).prune  # a better loss: kept
    only = PruneRules(throughput_counts=False, quality_counts=False, energy_counts=True)
    assert decide(better, [10.0, 10.0], ref, only, energy=0.3).prune


# --- the benchmark harness (bench/energy.py) -----------------------------------------------------


def test_the_energy_benchmark_analyzes_its_committed_runs_again(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/energy.py analyze, on the raw documents inside bench/results/energy_h100.json (the
    GPU steps need a GPU; its raw fields are in energy_h100.raw.json.gz, bench/resultfiles.py):
    the summary it writes is the committed one, and it draws the PNG."""
    from helpers import ROOT, run_bench

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    from resultfiles import load  # a bench module (bench/ is not a package)

    committed = load(ROOT / "bench" / "results" / "energy_h100.json")
    (tmp_path / "counter.json").write_text(json.dumps(committed["counter"]))
    (tmp_path / "probes.json").write_text(json.dumps(committed["probes"]))
    dirs = []
    for i, study in enumerate(committed["studies"]):
        (tmp_path / f"study{i}").mkdir()
        (tmp_path / f"study{i}" / "study.json").write_text(json.dumps({k: v for k, v in study.items()
                                                                        if k != "summary"}))
        dirs.append(str(tmp_path / f"study{i}"))
    run_bench("energy.py", "analyze", "--counter", str(tmp_path / "counter.json"), "--probes",
              str(tmp_path / "probes.json"), "--study", *dirs, "--out", str(tmp_path / "out.json"),
              "--png", str(tmp_path / "out.png"))
    again = json.loads((tmp_path / "out.json").read_text())
    assert again["probe_summary"] == committed["probe_summary"]
    assert [s["summary"] for s in again["studies"]] == [s["summary"] for s in committed["studies"]]
    assert (tmp_path / "out.png").stat().st_size > 0
    from energy import fast_stack  # the bench script (bench/ is not a package)

    assert fast_stack() == committed["probes"]["configs"]["fast-stack"]
