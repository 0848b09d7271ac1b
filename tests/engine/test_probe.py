"""autotune.engine.probe: measurement, determinism, early stopping and failure records."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
import torch

import autotune.engine.probe as probe_module
from autotune.contract.config import DISTRIBUTED_KNOBS, ConfigError
from autotune.contract.errors import FAILURE_KINDS
from autotune.contract.registry import UnknownWorkloadError, Workload
from autotune.contract.steps import plan_steps
from autotune.engine.knobs import ProbeError
from autotune.engine.probe import ProbeSettings, classify_exception, run_probe
from autotune.engine.result import ProbeResult
from autotune.workloads.ups import UPSWorkload

SAMPLES = 96  # 12 steps at the tiny preset's 4 × 2: 5 warm-up + 7 windows of 1 step



@pytest.fixture(scope="module")
def default_result(tiny: Workload) -> ProbeResult:
    return run_probe("ups", {}, preset="tiny", settings=ProbeSettings(samples=SAMPLES))


def test_default_probe_succeeds_and_measures(default_result: ProbeResult) -> None:
    r = default_result
    assert r.failure is None and r.ok and not r.stopped_early
    assert (r.workload, r.preset, r.quality_metric) == ("ups", "tiny", "val_nrmse")
    assert r.device.startswith("cpu") and r.torch_version == torch.__version__
    assert r.config["effective_batch"] == 8 and r.config["batch_size"] == 4 and r.config["accum_steps"] == 2
    assert r.throughput_samples_per_s is not None and r.throughput_samples_per_s > 0
    assert len(r.window_throughputs) >= 5
    assert all(t > 0 for t in r.window_throughputs)
    assert r.throughput_samples_per_s == pytest.approx(statistics.harmonic_mean(r.window_throughputs))
    assert r.throughput_spread == pytest.approx(
        (max(r.window_throughputs) - min(r.window_throughputs)) / r.throughput_samples_per_s)
    assert r.val_nrmse is not None and math.isfinite(r.val_nrmse) and r.val_nrmse > 0
    assert r.warmup_s is not None and r.warmup_s > 0
    assert r.setup_s is not None and r.setup_s > 0 and r.train_s is not None and r.train_s > 0
    assert r.data_wait_fraction is not None and 0 <= r.data_wait_fraction <= 1
    # per window: host seconds blocked on data, never more than the window lasted (CPU: host clock)
    assert len(r.window_data_wait_s) == len(r.window_throughputs)
    for wait, throughput in zip(r.window_data_wait_s, r.window_throughputs, strict=True):
        assert 0 <= wait <= r.window_steps * r.config["effective_batch"] / throughput * 1.05 + 1e-3
    assert r.window_gpu == [] and r.measurement_notes == []  # no GPU: no telemetry, nothing to qualify
    # the training loop's thread per window (Linux), and the CPU it ran on
    assert len(r.window_host) == len(r.window_throughputs)
    for window in r.window_host:
        assert window["busy_fraction"] is not None and 0 < window["busy_fraction"] <= 1
        assert min(window["minor_faults"], window["involuntary_switches"], window["voluntary_switches"]) >= 0
    # the whole host during each window (/proc/stat counts in 10-ms ticks: a window shorter than
    # one tick may read none)
    host = [w["host_busy_fraction"] for w in r.window_host if w["host_busy_fraction"] is not None]
    assert host and all(0 <= h <= 1 for h in host) and max(host) > 0  # this probe's own loop was busy
    assert r.host_cpu
    assert r.peak_mem_reserved_bytes is not None and r.peak_mem_reserved_bytes > 0
    assert r.steps == SAMPLES // 8 and r.warmup_steps == 5 and r.window_steps == 1
    assert r.samples_trained == r.steps * r.config["effective_batch"] == SAMPLES
    # 24 micro-batches inside one epoch of 56: no epoch start to amortize
    assert r.epoch_micro_batches == 56 and r.epoch_boundaries == [] and r.epoch_cost_s is None
    assert r.raw_window_throughputs == r.window_throughputs
    assert r.inverse_steps == r.steps  # inverse_loss_frequency 1


def test_epoch_starts_are_measured_and_counted_at_a_long_runs_rate(tiny: Workload) -> None:
    """A DataLoader that restarts its worker every epoch: each epoch start is recorded where it
    happened, and the windows carry the mean stall once per epoch's micro-batches instead of
    where the starts fell (autotune/engine/epoch_cost.py)."""
    r = run_probe(tiny, {"num_workers": 1, "persistent_workers": False}, settings=ProbeSettings(samples=480))
    assert r.failure is None, r.failure
    # 60 steps of 2 micro-batches: 5 warm-up, 8 windows of 6, 7 untimed; epochs of 56 micro-batches
    assert (r.warmup_steps, r.window_steps, len(r.window_throughputs)) == (5, 6, 8)
    assert r.epoch_micro_batches == 56
    assert [(b["micro_batch"], b["window"]) for b in r.epoch_boundaries] == [(56, 3), (112, None)]
    for b in r.epoch_boundaries:
        assert 0 <= b["excess_s"] <= b["stall_s"]
    assert r.epoch_cost_s == pytest.approx(statistics.fmean(b["excess_s"] for b in r.epoch_boundaries))
    # each window gave back the stall it timed and took cost × 12/56
    samples = r.window_steps * 8
    timed_excess = [r.epoch_boundaries[0]["excess_s"] if w == 3 else 0.0 for w in range(8)]
    for raw, amortized, excess in zip(r.raw_window_throughputs, r.window_throughputs, timed_excess, strict=True):
        assert samples / amortized == pytest.approx(samples / raw - excess + r.epoch_cost_s * 12 / 56)
    assert r.throughput_samples_per_s == pytest.approx(statistics.harmonic_mean(r.window_throughputs))
    assert ProbeResult.from_dict(json.loads(json.dumps(r.to_dict()))).epoch_boundaries == r.epoch_boundaries


def test_a_probe_inside_its_first_epoch_says_a_restart_is_not_in_its_throughput(tiny: Workload) -> None:
    restarting = run_probe(tiny, {"num_workers": 1, "persistent_workers": False},
                           settings=ProbeSettings(samples=SAMPLES))  # 24 micro-batches of an epoch's 56
    assert restarting.failure is None and restarting.epoch_boundaries == []
    assert any("inside one DataLoader epoch (24 of 56 micro-batches)" in n for n in restarting.measurement_notes)
    kept = run_probe(tiny, {"num_workers": 1, "persistent_workers": True}, settings=ProbeSettings(samples=SAMPLES))
    assert kept.failure is None and kept.measurement_notes == []  # persistent workers: nothing restarts


def test_loss_curve_has_one_point_per_window(default_result: ProbeResult) -> None:
    r = default_result
    eff = r.config["effective_batch"]
    assert len(r.loss_curve) == 1 + len(r.window_throughputs)
    samples = [s for s, _ in r.loss_curve]
    assert samples[0] == r.warmup_steps * eff
    assert samples == [(r.warmup_steps + i * r.window_steps) * eff for i in range(len(samples))]
    assert all(math.isfinite(loss) and loss > 0 for _, loss in r.loss_curve)


def test_knob_notes_cover_every_applied_knob(default_result: ProbeResult) -> None:
    expected = {"precision", "cudnn_benchmark", "checkpoint", "compile", "bucket_cap_mb", "fused_optimizer",
                "num_workers", "pin_memory", "accum_steps", "inverse_loss_frequency"}
    assert expected <= set(default_result.knobs)
    assert default_result.knobs["compile"] == "none (eager)"
    # a single-process probe: every distributed knob is recorded, as inactive
    assert default_result.world_size == 1
    assert all(default_result.knobs[k].endswith("(inactive: world size 1)") for k in DISTRIBUTED_KNOBS)
    assert default_result.knobs["checkpoint"] == "none"


class RecordingWorkload(UPSWorkload):
    """The real tiny workload, observed: keeps every model it builds and what it evaluates."""

    def __init__(self) -> None:
        super().__init__("tiny")
        self.built: list[tuple[torch.nn.Module, dict[str, torch.Tensor]]] = []
        self.evaluated: list[dict[str, torch.Tensor]] = []

    def build_model(self) -> torch.nn.Module:
        model = super().build_model()
        self.built.append((model, _state(model)))
        return model

    def evaluate(self, model: torch.nn.Module, val: Any, device: torch.device) -> float:
        self.evaluated.append(_state(model))
        return super().evaluate(model, val, device)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_validation_uses_the_trained_weights(tiny_datasets: Any) -> None:
    wl = RecordingWorkload()
    result = run_probe(wl, {}, settings=ProbeSettings(samples=SAMPLES))
    assert result.ok
    assert len(wl.built) == 2 and len(wl.evaluated) == 1  # the trained model, then the fresh eager reference
    trained, initial = wl.built[0]
    reference, _ = wl.built[1]
    assert _same_state(wl.evaluated[0], _state(trained))  # the reference holds the trained weights
    assert not _same_state(wl.evaluated[0], initial)
    assert not reference.training  # evaluated in eval mode
    assert result.val_nrmse == wl.evaluate(trained, tiny_datasets[1], torch.device("cpu"))


def test_seed_sets_the_initial_weights(tiny_datasets: Any) -> None:
    def stop(step: int, metrics: dict[str, float]) -> bool:
        return True  # after the first window: the initial weights are all this test needs

    initial = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        wl = RecordingWorkload()
        run_probe(wl, {}, settings=ProbeSettings(samples=SAMPLES, seed=seed), on_report=stop)
        initial[name] = wl.built[0][1]
    assert _same_state(initial["a"], initial["b"])
    assert not _same_state(initial["a"], initial["c"])


def test_result_round_trips_through_json(default_result: ProbeResult) -> None:
    data = json.loads(json.dumps(default_result.to_dict()))
    assert data["loss_curve"][0] == list(default_result.loss_curve[0])
    again = ProbeResult.from_dict({**data, "unknown_future_field": 1})
    assert again == default_result


def test_same_seed_and_config_are_deterministic(default_result: ProbeResult, tiny: Workload) -> None:
    again = run_probe(tiny, {}, settings=ProbeSettings(samples=SAMPLES))
    assert again.loss_curve == default_result.loss_curve
    assert again.val_nrmse == default_result.val_nrmse
    other_seed = run_probe(tiny, {}, settings=ProbeSettings(samples=SAMPLES, seed=1))
    assert other_seed.loss_curve != default_result.loss_curve


def test_samples_trained_depends_only_on_the_effective_batch(tiny: Workload) -> None:
    results = [run_probe(tiny, {"batch_size": b, "accum_steps": a}, settings=ProbeSettings(samples=100))
               for b, a in [(4, 2), (8, 1), (2, 4)]]
    for r in results:
        assert r.failure is None, r.failure
        assert r.config["effective_batch"] == 8
        assert r.steps == 12  # 100 samples round down to whole optimizer steps
        assert r.samples_trained == r.steps * 8 == 96


def test_on_report_can_stop_the_probe_early(tiny: Workload, default_result: ProbeResult) -> None:
    reports: list[tuple[int, dict[str, float]]] = []

    def on_report(step: int, metrics: dict[str, float]) -> bool:
        reports.append((step, metrics))
        return len(reports) == 2

    r = run_probe(tiny, {}, settings=ProbeSettings(samples=SAMPLES), on_report=on_report)
    assert r.failure is None
    assert r.stopped_early and not r.ok
    assert r.val_nrmse is None
    assert len(reports) == 2
    assert r.steps == r.warmup_steps + 2 * r.window_steps < default_result.steps
    assert r.samples_trained == r.steps * 8
    step, metrics = reports[-1]
    assert step == r.steps
    assert set(metrics) == {"samples", "loss", "throughput", "window"}
    assert metrics["samples"] == step * 8 and metrics["window"] == 1
    assert len(r.window_throughputs) == 2


def test_on_report_is_called_once_per_window(tiny: Workload) -> None:
    steps: list[int] = []

    def on_report(step: int, metrics: dict[str, float]) -> bool:
        steps.append(step)
        return False

    r = run_probe(tiny, {}, settings=ProbeSettings(samples=SAMPLES), on_report=on_report)
    assert r.ok
    assert steps == [r.warmup_steps + (i + 1) * r.window_steps for i in range(len(r.window_throughputs))]


def test_too_few_samples_is_a_config_error(tiny: Workload) -> None:
    with pytest.raises(ConfigError) as info:
        run_probe(tiny, {}, settings=ProbeSettings(samples=79))  # 9 steps < 5 warm-up + 5 timed
    assert info.value.knob == "samples"
    assert "use samples >= 80" in str(info.value)
    with pytest.raises(ConfigError, match="samples >= 168"):  # warm-up grows with inverse_loss_frequency
        run_probe(tiny, {"inverse_loss_frequency": 8}, settings=ProbeSettings(samples=150))


@pytest.mark.parametrize(("samples", "eff", "warmup", "windows", "freq"),
                         [(96, 8, 5, 8, 1), (1536, 8, 5, 8, 1), (1536, 8, 5, 8, 4), (800, 16, 5, 5, 3),
                          (2000, 1, 10, 7, 7)])
def test_plan_steps_splits_the_budget(samples: int, eff: int, warmup: int, windows: int, freq: int) -> None:
    total, warm, n_windows, per = plan_steps(samples, eff, warmup, windows, freq)
    assert total == samples // eff
    assert warm == max(warmup, 2 * freq)
    assert 5 <= n_windows <= max(windows, 5)
    assert per >= 1 and warm + n_windows * per <= total
    if total - warm >= n_windows * freq:
        assert per % freq == 0  # every window has the same mix of step kinds


def test_unknown_workload_and_preset(tiny: Workload) -> None:
    with pytest.raises(UnknownWorkloadError, match=r"unknown workload .nope.; installed: (.*, )?ups"):
        run_probe("nope", {})
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        run_probe("ups", {}, preset="huge")
    with pytest.raises(ConfigError):
        run_probe(tiny, {"precision": "fp64"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_cuda_without_a_gpu_is_a_config_error(tiny: Workload) -> None:
    with pytest.raises(ConfigError) as info:
        run_probe(tiny, {}, device="cuda", settings=ProbeSettings(samples=SAMPLES))
    assert info.value.knob == "device"


# ---------------------------------------------------------------------------------------------
# failures


def test_exploding_learning_rate_fails_as_nan(tiny: Workload) -> None:
    r = run_probe(tiny, {"lr": 1e30}, settings=ProbeSettings(samples=SAMPLES))
    assert r.failure is not None
    assert r.failure["kind"] == "nan"
    assert "non-finite loss" in r.failure["message"]
    assert r.val_nrmse is None and r.throughput_samples_per_s is None
    assert r.steps == r.warmup_steps  # detected at the end of warm-up
    assert r.samples_trained == r.steps * 8
    assert r.knobs["compile"] == "none (eager)"  # notes are kept on failure


def test_a_nan_failure_quotes_the_lr_that_ran(tiny: Workload) -> None:
    """With lr_scaling the failure names the scaled lr the step ran, not the leased one."""
    d = tiny.defaults
    cfg = {"lr": 1e30, "batch_size": d.batch_size * 2, "accum_steps": d.accum_steps, "lr_scaling": "linear"}
    r = run_probe(tiny, cfg, settings=ProbeSettings(samples=SAMPLES * 2))  # the same steps at twice the batch
    assert r.failure is not None and r.failure["kind"] == "nan"
    assert r.failure["message"].endswith("lr=2e+30 (1e+30 × 2, lr_scaling linear)"), r.failure["message"]


OOM_SCRIPT = textwrap.dedent("""
    import json, resource
    import torch
    import autotune.engine.probe as probe

    def vm_size():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024

    limit = vm_size() + int(1.5 * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    result = probe.run_probe("ups", {"batch_size": 20000, "accum_steps": 1}, preset="tiny",
                             settings=probe.ProbeSettings(samples=20000 * 10))
    print(json.dumps({"failure": result.failure, "steps": result.steps}))
""")


def test_out_of_memory_fails_as_oom(tiny_datasets: Any) -> None:
    """A batch far beyond a 1.5 GiB address-space limit: the probe records oom instead of crashing."""
    env = dict(os.environ)
    assert "AUTOTUNE_DATA_DIR" in env  # the subprocess reuses the session's data cache
    proc = subprocess.run([sys.executable, "-c", OOM_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["failure"]["kind"] == "oom", out
    assert out["steps"] == 0


def test_timeout_fails_as_timeout(tiny: Workload) -> None:
    r = run_probe(tiny, {}, settings=ProbeSettings(samples=SAMPLES, timeout_s=1e-4))
    assert r.failure is not None
    assert r.failure["kind"] == "timeout"
    assert "0.0001 s budget" in r.failure["message"]
    assert r.val_nrmse is None


class _ShiftedClock:
    """The `time` module as autotune.engine.probe sees it, its perf_counter moved forward by `offset`
    seconds: a report can outlast a probe's budget without the test waiting the budget out."""

    def __init__(self) -> None:
        self.offset = 0.0

    def perf_counter(self) -> float:
        return time.perf_counter() + self.offset

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def test_timeout_is_checked_between_steps(tiny: Workload, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first window's report outlasts the budget: the probe stops after the next step."""
    # generous: setup and warm-up take far less even on a loaded machine (12 s was not always
    # enough for them when the report slept the budget out); the report then moves the probe's
    # clock past the budget (a report that took budget + 1 s), so nothing is waited out
    budget = 600.0
    clock = _ShiftedClock()
    monkeypatch.setattr(probe_module, "time", clock)

    def slow_report(step: int, metrics: dict[str, float]) -> bool:
        if metrics["window"] == 0:
            clock.offset += budget + 1.0  # outlast the budget
        return False

    r = run_probe(tiny, {}, settings=ProbeSettings(samples=8 * 40, timeout_s=budget), on_report=slow_report)
    assert clock.offset > budget  # the first window was reported
    assert r.failure is not None and r.failure["kind"] == "timeout"
    assert "during window 2/" in r.failure["message"]
    assert r.steps == r.warmup_steps + r.window_steps + 1 < 40
    assert r.samples_trained == r.steps * 8
    assert r.val_nrmse is None


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "oom"),
        (MemoryError(), "oom"),
        (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"), "oom"),
        (RuntimeError("CUDA error: out of memory"), "oom"),
        (ProbeError("nan", "non-finite loss"), "nan"),
        (ProbeError("unsupported", "fp8 needs a GPU"), "unsupported"),
        (ValueError("something else"), "error"),
        (RuntimeError(), "error"),
    ],
)
def test_classify_exception(exc: BaseException, kind: str) -> None:
    got_kind, message = classify_exception(exc)
    assert got_kind == kind
    assert got_kind in FAILURE_KINDS
    assert message
    if isinstance(exc, ProbeError):
        assert message == exc.message
    else:
        assert message.startswith(type(exc).__name__)


# ---------------------------------------------------------------------------------------------
# on a GPU (skipped without one)


@pytest.mark.gpu
def test_probe_on_cuda(tiny: Workload) -> None:
    r = run_probe(tiny, {"pin_memory": True, "precision": "bf16"}, device="cuda",
                  settings=ProbeSettings(samples=SAMPLES))
    assert r.failure is None, r.failure
    assert r.device == torch.cuda.get_device_name()
    assert r.knobs["pin_memory"] == "true"
    assert r.peak_mem_allocated_bytes is not None and r.peak_mem_allocated_bytes > 0
    assert r.val_nrmse is not None and math.isfinite(r.val_nrmse)
    # what the GPU did in each timed window, read from NVML
    assert len(r.window_gpu) == len(r.window_throughputs)
    for window in r.window_gpu:
        assert window["sm_clock_mhz"] is not None and window["sm_clock_mhz"] > 100
        assert window["temperature_c"] is not None and 0 < window["temperature_c"] < 120
        assert window["throttled_fraction"] is None or 0 <= window["throttled_fraction"] <= 1
        assert window["utilization_percent"] is not None and 0 <= window["utilization_percent"] <= 100
    assert len(r.window_host) == len(r.window_throughputs)


@pytest.mark.gpu
def test_tf32_probe_on_cuda_turns_tf32_on(tiny: Workload) -> None:
    r = run_probe(tiny, {"precision": "tf32"}, device="cuda", settings=ProbeSettings(samples=SAMPLES))
    assert r.failure is None, r.failure
    assert r.knobs["precision"] == "tf32: TF32 on"
    assert torch.backends.cuda.matmul.allow_tf32 is True
