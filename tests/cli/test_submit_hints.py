"""`autotune submit`'s hints (issue 23, item 8), against a real service on a real port.

* the printed worker command takes the study: its --study, the --device of its hardware
  class, --gpus-per-trial when > 1, and --allow-workload for a workload that is not built in
  (NAME for an installed entry point, NAME=module:attr where this machine knows the path);
  the command printed for a built-in CPU study is run as printed and takes a trial;
* a spec without `hardware` is named a CPU study at submit;
* a spec without `hardware` whose preset or knobs need a GPU is refused (exit 2) naming the
  field and both fixes, and nothing is created; with hardware: cpu written out it is accepted.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from live_service import LiveService, Processes, log_text, small_spec, start_worker
from typer.testing import CliRunner

from autotune.cli.main import app
from autotune.contract.registry import ENTRY_POINT_GROUP, ENV_VAR, registered_workloads
from autotune.worker.options import WorkerOptions

H100 = "NVIDIA H100 80GB HBM3"
ENTRY_POINT_WL = "hintwl"  # an installed plugin (entry point), never run here
ENV_WL = "hintenv"  # known through AUTOTUNE_WORKLOADS only
ENV_TARGET = "hint_pkg.workload:HintWorkload"
NO_HARDWARE_NOTE = "no `hardware` in the spec: this is a CPU study; workers with GPUs will not take it"


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, autotune_data_dir: Any) -> Iterator[LiveService]:
    """A service that knows both plugin workloads by name (the service never imports one)."""
    tmp = tmp_path_factory.mktemp("submit-hints")
    processes = Processes(tmp)
    try:
        yield LiveService(processes, tmp / "autotune.db", env={ENV_VAR: f"{ENTRY_POINT_WL},{ENV_WL}"}).start()
    finally:
        processes.stop_all()


@pytest.fixture
def plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process (the submitting machine) has `hintwl` installed as an entry point and
    names `hintenv` with its import path in AUTOTUNE_WORKLOADS."""
    site = tmp_path / "site"
    info = site / "hintwl_plugin-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hintwl-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{ENTRY_POINT_WL} = hintwl_module:Workload\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv(ENV_VAR, f"{ENV_WL}={ENV_TARGET}")
    registered_workloads.cache_clear()
    yield
    registered_workloads.cache_clear()


def submit(service: LiveService, tmp_path: Path, spec: dict[str, Any]) -> Any:
    path = tmp_path / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return CliRunner().invoke(app, ["submit", str(path), "--api", service.url, "--token", service.admin_token],
                              env={"COLUMNS": "200"})


def worker_command(stdout: str) -> list[str]:
    """The printed worker command's arguments after `autotune worker`."""
    line = next(line for line in stdout.splitlines() if line.startswith("start workers: "))
    argv = shlex.split(line.removeprefix("start workers: "))
    assert argv[:2] == ["autotune", "worker"], line
    return argv[2:]


def option(argv: list[str], name: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == name]


@pytest.mark.slow  # a worker and its probe, on the module's live service: scheduled with the slow tests
def test_a_builtin_cpu_study_gets_a_worker_command_that_takes_it(service: LiveService, tmp_path: Path) -> None:
    result = submit(service, tmp_path, small_spec("hint-cpu", n_trials=1))
    assert result.exit_code == 0, result.output
    argv = worker_command(result.stdout)
    assert option(argv, "--study") == ["hint-cpu"] and option(argv, "--device") == ["cpu"]
    assert option(argv, "--api") == [service.url]
    assert "--allow-workload" not in argv and "--gpus-per-trial" not in argv  # built in, one process
    assert "no `hardware`" not in result.output  # hardware: cpu was written out

    # run as printed (plus a thread limit and an exit condition): it takes the study's trial
    processes = Processes(tmp_path)
    try:
        worker = start_worker(processes, service.url, *argv, "--max-trials", "1")
        assert worker.wait(timeout=120) == 0, log_text(worker)[-3000:]
    finally:
        processes.stop_all()
    assert "▶ trial 0 of hint-cpu" in log_text(worker)
    assert [t["state"] for t in service.trials("hint-cpu")] == ["COMPLETE"]


def test_a_plugin_study_gets_allow_workload(service: LiveService, tmp_path: Path, plugins: None) -> None:
    result = submit(service, tmp_path, small_spec("hint-entry-point", workload=ENTRY_POINT_WL, preset="any"))
    assert result.exit_code == 0, result.output
    argv = worker_command(result.stdout)
    assert option(argv, "--allow-workload") == [ENTRY_POINT_WL] and option(argv, "--device") == ["cpu"]
    assert f"the package that registers {ENTRY_POINT_WL!r}" in result.stdout
    assert ENTRY_POINT_WL in WorkerOptions(allow_workloads=tuple(option(argv, "--allow-workload"))).allowed_workloads()

    result = submit(service, tmp_path, small_spec("hint-env", workload=ENV_WL, preset="any"))
    assert result.exit_code == 0, result.output
    argv = worker_command(result.stdout)
    assert option(argv, "--allow-workload") == [f"{ENV_WL}={ENV_TARGET}"]
    options = WorkerOptions(allow_workloads=tuple(option(argv, "--allow-workload")))
    assert options.allowed_workloads() == (ENV_WL,) and options.workload_paths() == {ENV_WL: ENV_TARGET}


def test_a_gpu_study_gets_a_cuda_worker_with_its_gpus_per_trial(service: LiveService, tmp_path: Path) -> None:
    # 80 samples: 5 warm-up and 5 timed steps of 2 ranks × 4 (fewer is refused: the baseline could not be timed)
    result = submit(service, tmp_path, small_spec("hint-gpu", samples=80, hardware=H100, gpus_per_trial=2))
    assert result.exit_code == 0, result.output
    argv = worker_command(result.stdout)
    assert option(argv, "--device") == ["cuda"] and option(argv, "--gpus-per-trial") == ["2"]
    assert f"on a host whose GPU is named {H100!r} exactly" in result.stdout


def test_a_spec_without_hardware_is_named_a_cpu_study(service: LiveService, tmp_path: Path) -> None:
    spec = small_spec("hint-implicit")
    del spec["hardware"]
    result = submit(service, tmp_path, spec)
    assert result.exit_code == 0, result.output
    assert NO_HARDWARE_NOTE in result.stderr
    assert f"hardware: {H100}" in result.stderr and "hardware class" in result.stderr  # how to make it a GPU study
    assert "hardware cpu" in result.stdout
    assert option(worker_command(result.stdout), "--device") == ["cpu"]
    assert service.get("/v1/studies/hint-implicit")["spec"]["hardware"] == "cpu"


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"preset": "full"}, "preset 'full' of workload 'ups' is sized for a GPU"),
        ({"workload": "gpt", "preset": "full"}, "preset 'full' of workload 'gpt' is sized for a GPU"),
        ({"space": "h100", "baseline": None}, "space 'h100' searches GPU-only values (compile=reduce-overhead, "
                                              "precision=tf32/fp8, step_graph=true, cudnn_benchmark=true); space "
                                              "'h100' fixes GPU-only values (pin_memory=true)"),
        ({"baseline": {"batch_size": 4, "accum_steps": 1, "step_graph": True}},
         "the baseline sets GPU-only values (step_graph=true)"),
    ],
)
def test_a_spec_without_hardware_that_needs_a_gpu_is_refused(service: LiveService, tmp_path: Path,
                                                             change: dict[str, Any], named: str) -> None:
    spec = {**small_spec("hint-refused"), **change}
    del spec["hardware"]
    if spec["baseline"] is None:
        del spec["baseline"]
    result = submit(service, tmp_path, spec)
    assert result.exit_code == 2, result.output
    message = " ".join(result.stderr.split())
    assert "hardware: not set, so this would be a CPU study (the default)" in message
    assert named in message
    assert f"hardware: {H100}" in message
    if "space" in change:  # fp8 cannot run on a CPU at all
        assert "write hardware: cpu and drop what a CPU cannot run (space.params.precision: fp8:" in message
    else:
        assert "write hardware: cpu to run it on CPU workers anyway" in message
    response = httpx.get(f"{service.url}/v1/studies/hint-refused", timeout=10)
    assert response.status_code == 404  # nothing was created


def test_hardware_cpu_written_out_runs_a_gpu_preset_on_cpus(service: LiveService, tmp_path: Path) -> None:
    result = submit(service, tmp_path, small_spec("hint-full-on-cpu", preset="full"))  # hardware: cpu
    assert result.exit_code == 0, result.output
    assert "no `hardware`" not in result.output
    assert service.get("/v1/studies/hint-full-on-cpu")["spec"]["preset"] == "full"
