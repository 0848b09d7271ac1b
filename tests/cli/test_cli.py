"""autotune.cli.probe_cmd: `autotune probe` output, exit codes and input errors."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from autotune.cli import common
from autotune.cli.main import app
from autotune.cli.probe_cmd import print_probe_result
from autotune.contract.config import KNOBS
from autotune.engine.result import ProbeResult

RESULT_KEYS = {"throughput_samples_per_s", "throughput_spread", "val_nrmse", "warmup_s", "peak_mem_reserved_bytes",
               "data_wait_fraction", "config", "device", "failure"}
FAST = ["--samples", "80"]  # 10 steps of the tiny preset: 5 warm-up + 5 windows


def invoke(*args: str, env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(app, list(args), env=env)



@pytest.fixture(scope="module")
def probe_json(tiny_datasets: Any) -> subprocess.CompletedProcess[str]:
    """`autotune probe --json` of the FAST probe, in a real process: the tests that need a probe's JSON share it."""
    return subprocess.run([sys.executable, "-m", "autotune.cli", "probe", "--json", *FAST], capture_output=True,
                          text=True, timeout=120, check=False)


def test_probe_json_prints_exactly_one_object(probe_json: subprocess.CompletedProcess[str]) -> None:
    """A real process: nothing but the JSON object may reach stdout."""
    proc = probe_json
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 1
    data = json.loads(lines[0])
    assert isinstance(data, dict)
    assert set(data) >= RESULT_KEYS
    assert data["failure"] is None
    assert data["throughput_samples_per_s"] > 0 and data["val_nrmse"] > 0 and data["warmup_s"] > 0
    assert data["device"].startswith("cpu")
    assert data["config"]["effective_batch"] == 8 and data["config"]["precision"] == "fp32"
    assert data["samples_trained"] == 80


def test_probe_prints_a_table_without_json(tiny_datasets: Any) -> None:
    result = invoke("probe", *FAST, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "probe: ups/tiny on cpu" in result.stdout
    assert "samples/s" in result.stdout and "val_nrmse" in result.stdout
    assert "80 in 10 steps" in result.stdout


def test_the_table_shows_the_gpu_windows_and_the_measurement_notes(
        probe_json: subprocess.CompletedProcess[str]) -> None:
    """What a GPU probe adds (autotune.engine.gpu_telemetry) reaches the table: clock, temperature and power
    ranges over the windows, and each note. Rendered from a real CPU probe's result (`autotune
    probe --json`'s) with a GPU's window readings put in (CI has no GPU)."""
    assert probe_json.returncode == 0, probe_json.stderr[-3000:]
    result = ProbeResult.from_dict(json.loads(probe_json.stdout))
    table = render(result)
    assert "MHz" not in table  # a CPU: no GPU telemetry, but the loop thread's own readings and the CPU
    assert "loop thread busy" in table and "page faults" in table and result.host_cpu and result.host_cpu in table
    assert "host CPUs busy" in table  # read from this host's /proc/stat
    assert "none (an epoch is 56 micro-batches)" in table  # FAST's probe stays inside one epoch
    result.window_gpu = [{"sm_clock_mhz": c, "temperature_c": t, "power_w": 600.0, "throttled_fraction": f,
                          "utilization_percent": u} for c, t, f, u in ((1980, 60, 0.0, 97), (1410, 84, 0.4, 55))]
    result.window_host = [{"busy_fraction": b, "minor_faults": 1200, "involuntary_switches": 3, "voluntary_switches": 9,
                           "host_busy_fraction": h} for b, h in ((0.91, 0.25), (0.995, 0.4))]
    result.measurement_notes = ["the driver held the GPU's clocks down (power or heat): window 2 40%"]
    result.epoch_boundaries = [{"micro_batch": 234, "stall_s": 0.24, "excess_s": 0.22, "window": 4},
                               {"micro_batch": 468, "stall_s": 0.21, "excess_s": 0.20, "window": None}]
    result.epoch_micro_batches, result.epoch_cost_s = 234, 0.21
    table = render(result)
    assert "2 (1 in the windows), 210 ms each; counted once per 234 micro-batches" in table
    assert "1410–1980 MHz SM, 60–84 °C, 600 W, 55–97 % busy" in table
    assert "loop thread busy 91%–100%, 2,400 page faults, 6 preemptions, 18 sleeps, host CPUs busy 25%–40%" in table
    assert "window 2 40%" in table


def render(result: ProbeResult) -> str:
    console = Console(width=250, record=True, file=io.StringIO())
    print_probe_result(result, console)
    return console.export_text()


def test_unknown_knob_is_a_usage_error() -> None:
    result = invoke("probe", "--config", '{"checkpont": "block"}')
    assert result.exit_code == 2
    assert result.stdout == ""
    assert "checkpont: unknown knob (did you mean 'checkpoint'?)" in result.stderr
    assert "known knobs: " + ", ".join(KNOBS) in result.stderr


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ('{"checkpoint": "blk"}', "checkpoint: 'blk' is not allowed; allowed: none | block | attn | mlp | selective"),
        ('{"bucket_cap_mb": 0}', "bucket_cap_mb: 0.0 is too small; allowed: float in [0.001, 4096.0]"),
        ('{"prefetch_factor": 2}', "prefetch_factor: only applies with num_workers > 0"),
        ('{"precision": ', "config: not valid JSON"),
    ],
)
def test_bad_value_is_a_usage_error(config: str, expected: str) -> None:
    result = invoke("probe", "--config", config)
    assert result.exit_code == 2
    assert expected in result.stderr
    assert result.stdout == ""


def test_too_few_samples_is_a_usage_error() -> None:
    result = invoke("probe", "--samples", "16")
    assert result.exit_code == 2
    assert "samples: 16 samples at effective batch 8" in result.stderr


def test_a_demo_on_too_few_samples_is_a_usage_error_before_anything_is_made(tmp_path: Path) -> None:
    result = invoke("demo", "--samples", "100", "--workdir", str(tmp_path / "demo"))
    assert result.exit_code == 2
    assert "--samples: 100 is too few" in result.stderr and "at least 832 samples" in result.stderr
    assert not (tmp_path / "demo").exists()


@pytest.mark.parametrize("device", ["tpu", "cuda:x"])
def test_a_device_torch_cannot_name_is_a_usage_error(device: str) -> None:
    result = invoke("probe", "--device", device)
    assert result.exit_code == 2, result.output
    assert f"device: '{device}' is not a device; use cpu, cuda or cuda:N" in result.stderr


def test_a_usage_error_prints_its_message_as_written() -> None:
    """Brackets and colons in a message are text: rich would take "[a, b]" for markup and
    ":x:" for an emoji."""
    message = "spec.yaml: write {choices: [fp32, bf16]} for cuda:x: here"
    with common.err.capture() as printed:
        assert common.usage_error(message).exit_code == 2
    assert printed.get() == f"error: {message}\n"


def test_every_console_of_the_command_line_reads_emoji_codes_as_text() -> None:
    """Each command's console comes from `common.make_console` (emoji codes off): a console
    made elsewhere printed a device "cuda:x:" as "cuda❌"."""
    printed = common.make_console(record=True, width=200)
    printed.print("--device cuda:x: :thumbs_up:")
    assert printed.export_text() == "--device cuda:x: :thumbs_up:\n"
    cli = Path(common.__file__).parent
    made_elsewhere = [f"{path.name}:{n}" for path in sorted(cli.glob("*.py")) if path.name != "common.py"
                      for n, line in enumerate(path.read_text().splitlines(), 1) if "Console(" in line]
    assert made_elsewhere == []


def test_a_config_file_that_is_not_yaml_and_a_trace_path_that_cannot_be_made_are_usage_errors(
        tmp_path: Path) -> None:
    """Both said before the probe runs (a YAML error was a traceback; a bad --trace failed the
    probe after it had trained)."""
    (tmp_path / "bad.yaml").write_text("batch_size: [1\n")
    result = invoke("probe", "--config", str(tmp_path / "bad.yaml"))
    assert result.exit_code == 2, result.output
    assert f"config: {tmp_path / 'bad.yaml'}: not valid YAML (while parsing a flow sequence" in result.stderr
    (tmp_path / "a-file").write_text("")
    result = invoke("probe", "--trace", str(tmp_path / "a-file" / "trace.json"))
    assert result.exit_code == 2, result.output
    assert f"--trace {tmp_path / 'a-file' / 'trace.json'}: cannot make its folder (" in result.stderr
    assert "probe:" not in result.stderr  # no progress line: nothing ran


def test_unknown_workload_is_a_usage_error() -> None:
    result = invoke("probe", "--workload", "nope")
    assert result.exit_code == 2
    assert "unknown workload 'nope'; installed: ups" in result.stderr


def test_config_from_a_yaml_file(tmp_path: Path, tiny_datasets: Any) -> None:
    path = tmp_path / "trial.yaml"
    path.write_text("checkpoint: block\nbatch_size: 8\naccum_steps: 1\nfused_optimizer: true\n")
    result = invoke("probe", "--json", "--config", str(path), *FAST)
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["failure"] is None
    assert data["config"]["checkpoint"] == "block" and data["config"]["batch_size"] == 8
    assert data["config"]["accum_steps"] == 1 and data["config"]["fused_optimizer"] is True
    assert data["knobs"]["checkpoint"] == "block on 2 blocks"
    assert data["knobs"]["fused_optimizer"] == "AdamW fused"


def test_fp8_on_cpu_exits_1_with_the_failure_in_json() -> None:
    result = invoke("probe", "--json", "--config", '{"precision": "fp8"}', *FAST)
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert data["failure"]["kind"] == "unsupported"
    assert "CUDA" in data["failure"]["message"]
    assert data["throughput_samples_per_s"] is None
    table = invoke("probe", "--config", '{"precision": "fp8"}', *FAST, env={"COLUMNS": "200"})
    assert table.exit_code == 1
    assert "unsupported: fp8 training needs a CUDA GPU" in table.stdout


def test_list_knobs_lists_every_knob() -> None:
    result = invoke("probe", "--list-knobs", env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for knob in KNOBS.values():
        assert knob.name in result.stdout
        assert knob.allowed() in result.stdout


def test_list_knobs_lists_every_knob_when_piped() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.run([sys.executable, "-m", "autotune.cli", "probe", "--list-knobs"], capture_output=True,
                          text=True, env=env, timeout=60, check=False)
    assert proc.returncode == 0
    missing = [name for name in KNOBS if name not in proc.stdout]
    assert missing == []


def test_probe_trace_records_the_last_warm_up_steps_and_bench_reads_it(
        tmp_path: Path, probe_json: subprocess.CompletedProcess[str]) -> None:
    """--trace writes a Chrome trace of the warm-up's last steps (at most half of them), each in
    a named range, and leaves the timed windows and the sample budget as they were;
    bench/trace_summary.py finds the same steps in it."""
    trace = tmp_path / "traces" / "probe.json"
    result = invoke("probe", "--json", "--samples", "160", "--warmup-steps", "8", "--trace", str(trace),
                    "--trace-steps", "6")
    assert result.exit_code == 0, result.output
    probed = json.loads(result.stdout)
    assert probed["traced_steps"] == 4  # 6 asked, half of the 8 warm-up steps given
    assert probed["samples_trained"] == 160 and len(probed["window_throughputs"]) == 8  # 8 warm-up, 8 timed, 4 more
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e.get("name") == "autotune.step" for e in events) == 4
    assert sum(e.get("name") == "autotune.data" for e in events) == 4
    summary = tmp_path / "summary.json"
    subprocess.run([sys.executable, str(Path(__file__).resolve().parents[2] / "bench" / "trace_summary.py"), str(trace),
                    "--out", str(summary)], check=True, capture_output=True)
    (row,) = json.loads(summary.read_text())
    assert row["steps"] == 4 and row["step_host_ms"] > 0 and row["gpu_busy_fraction"] is None  # a CPU: no kernels

    assert json.loads(probe_json.stdout)["traced_steps"] == 0  # a probe without --trace traces nothing
