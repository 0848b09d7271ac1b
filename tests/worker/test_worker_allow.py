"""No remote code execution: a study names a workload; only the worker decides what runs.

* the registry (autotune.workloads): built-in workloads and their presets, workloads other
  packages register under the entry-point group ``autotune.workloads`` (found, not
  imported), no torch on the service's and the worker's import path;
* `refusal`: a workload must be on the worker's allow-list (``--allow-workload``, default:
  the built-ins) and installed on its host;
* live: a real service and real workers. A lease naming a workload that is not allowed, or
  allowed but not installed, is completed as failed with kind "refused" and a message
  saying how to allow it; no probe runs and the workload's module is never imported, by
  the worker, its children or the service. A positive control (a worker that allows and
  has the plugin) shows that the same module *is* imported when a probe runs it. The live
  workers run side by side, each a Python start of its own; the control writes its own
  marker file and generates into its own data folder, so what it does is told apart.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from live_service import LiveService, Processes, log_text, small_spec, start_worker, wait_until

from autotune.contract.registry import (
    BUILTIN,
    ENTRY_POINT_GROUP,
    ENV_VAR,
    UnknownWorkloadError,
    check_workload,
    export_workload_paths,
    get_workload,
    registered_workloads,
    workload_names,
    workload_paths,
)
from autotune.worker.allow import refusal
from autotune.worker.options import WorkerOptions

PLUGIN = "fakewl"
PLUGIN_MODULE = "fakewl_module"
# Importing the plugin's module leaves a marker file: the proof of who imported it, and when.
PLUGIN_SOURCE = '''
import os
import re
import pathlib

pathlib.Path(os.environ["FAKEWL_MARKER"]).write_text(f"imported by pid {os.getpid()}")


class FakeWorkload:
    """Not a real workload: a probe of it fails, after importing this module."""

    def __init__(self, preset):
        self.preset = preset
'''


def write_module(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{PLUGIN_MODULE}.py").write_text(PLUGIN_SOURCE)
    return directory


def write_plugin(directory: Path) -> Path:
    """`directory` as an installed distribution that registers workload `fakewl`."""
    write_module(directory)
    info = directory / "fakewl_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakewl-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{PLUGIN} = {PLUGIN_MODULE}:FakeWorkload\n")
    return directory


# --- the registry --------------------------------------------------------------------------------


def test_the_builtin_presets_are_the_workloads_own() -> None:
    from autotune.workloads import gpt, ups

    assert BUILTIN["ups"].presets == tuple(ups.PRESETS) and BUILTIN["gpt"].presets == tuple(gpt.PRESETS)
    assert workload_names() == ["gpt", "ups"]
    for name, module in (("ups", ups), ("gpt", gpt)):
        for preset in module.PRESETS:
            workload = get_workload(name, preset)
            assert workload.preset == preset
            # the registry's name-level metadata is the workload's own (the service reads it without importing)
            assert (BUILTIN[name].quality_metric, BUILTIN[name].quality_direction) == (
                workload.quality_metric, workload.quality_direction)


def test_unknown_workloads_and_presets_name_the_field_and_the_known_ones() -> None:
    with pytest.raises(UnknownWorkloadError) as info:
        check_workload("nope", "tiny")
    assert info.value.field == "workload" and "installed: ups, gpt" in str(info.value)
    with pytest.raises(UnknownWorkloadError) as info:
        check_workload("ups", "huge")
    assert info.value.field == "preset" and "known: tiny, full" in str(info.value)
    with pytest.raises(UnknownWorkloadError):
        get_workload("os.path:join", "tiny")  # a name, never a module path


def test_the_registry_the_protocol_and_the_worker_import_no_torch() -> None:
    code = ("import sys, autotune.workloads, autotune.contract.protocol, autotune.contract.results, "
            "autotune.contract.views, autotune.worker\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "assert 'autotune.workloads.ups' not in sys.modules, 'a workload module was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.fixture
def installed_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The fake plugin installed on sys.path of this process (the registry reread)."""
    marker = tmp_path / "imported"
    monkeypatch.setenv("FAKEWL_MARKER", str(marker))
    monkeypatch.syspath_prepend(str(write_plugin(tmp_path / "site")))
    registered_workloads.cache_clear()
    yield marker
    registered_workloads.cache_clear()
    sys.modules.pop(PLUGIN_MODULE, None)


def test_entry_point_workloads_are_found_without_being_imported(installed_plugin: Path) -> None:
    entry = check_workload(PLUGIN, "any-preset")  # presets unknown before loading: any name passes
    assert entry.target == f"{PLUGIN_MODULE}:FakeWorkload" and entry.presets is None and not entry.builtin
    assert PLUGIN in workload_names()
    assert not installed_plugin.exists() and PLUGIN_MODULE not in sys.modules
    workload: Any = get_workload(PLUGIN, "p1")  # a probe child does this, for an allowed workload only
    assert workload.preset == "p1" and installed_plugin.exists()


def test_a_stored_spec_is_read_back_whatever_is_installed_now() -> None:
    """A study keeps working when its workload's package leaves the service host: specs read
    from storage are validated with context {"stored": True}, which skips the registry."""
    from pydantic import ValidationError

    from autotune.contract.protocol import StudySpec
    from autotune.contract.views import StudyInfo

    with pytest.raises(ValidationError, match="unknown workload 'gone'"):
        StudySpec.model_validate({"name": "s", "workload": "gone"})
    spec = StudySpec.model_validate({"name": "s", "workload": "gone"}, context={"stored": True})
    assert StudyInfo(name="s", state="running", spec=spec).spec.workload == "gone"  # not checked again


def test_import_path_workloads_are_the_operators_and_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--allow-workload NAME=module:attr: the worker allows NAME and exports the path to its probe
    children through AUTOTUNE_WORKLOADS; nothing is imported until a probe loads it."""
    marker = tmp_path / "imported"
    monkeypatch.setenv("FAKEWL_MARKER", str(marker))
    monkeypatch.syspath_prepend(str(write_module(tmp_path / "site")))
    monkeypatch.delenv(ENV_VAR, raising=False)
    options = WorkerOptions(allow_workloads=("ups", f"mine={PLUGIN_MODULE}:FakeWorkload"))
    assert options.allowed_workloads() == ("ups", "mine")
    assert options.workload_paths() == {"mine": f"{PLUGIN_MODULE}:FakeWorkload"}
    try:
        export_workload_paths(options.workload_paths())
        assert os.environ[ENV_VAR] == f"mine={PLUGIN_MODULE}:FakeWorkload"
        entry = check_workload("mine", "p")
        assert entry.source == "environment" and entry.presets is None and refusal("mine", ("mine",)) is None
        assert not marker.exists()
        workload: Any = get_workload("mine", "p")  # what the probe child does
        assert workload.preset == "p" and marker.exists()
    finally:
        monkeypatch.delenv(ENV_VAR, raising=False)
        registered_workloads.cache_clear()
        sys.modules.pop(PLUGIN_MODULE, None)


def test_malformed_import_path_options_say_how_to_write_them(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=re.escape("--allow-workload NAME=my_pkg.mod:Cls")):
        workload_paths(["my_pkg.mod:Cls"])  # a study names a slug: the operator names the workload
    with pytest.raises(ValueError, match="not an import path"):
        workload_paths(["mine=not a path"])
    with pytest.raises(ValueError, match="not a slug"):
        workload_paths(["../x=pkg:attr"])
    # a bare name in AUTOTUNE_WORKLOADS makes the name known (the service) but cannot be loaded
    monkeypatch.setenv(ENV_VAR, "named-only")
    registered_workloads.cache_clear()
    try:
        assert check_workload("named-only", "any").target == ""
        with pytest.raises(UnknownWorkloadError, match="only a name here"):
            get_workload("named-only", "any")
    finally:
        monkeypatch.delenv(ENV_VAR)
        registered_workloads.cache_clear()


def test_the_worker_cli_refuses_a_bare_import_path() -> None:
    done = subprocess.run([sys.executable, "-m", "autotune.cli", "worker", "--api", "http://127.0.0.1:9",
                           "--allow-workload", "my_pkg.mod:Cls", "--max-trials", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "NAME=my_pkg.mod:Cls" in " ".join((done.stdout + done.stderr).split())


# --- the allow-list ------------------------------------------------------------------------------


def test_the_default_allow_list_is_the_builtin_workloads() -> None:
    assert WorkerOptions().allowed_workloads() == ("gpt", "ups")
    assert WorkerOptions(allow_workloads=("a", "b")).allowed_workloads() == ("a", "b")
    assert WorkerOptions(allow_workloads=()).allowed_workloads() == ()


def test_refusal_names_the_workload_and_the_fix(installed_plugin: Path) -> None:
    assert refusal("ups", ("ups",)) is None
    assert refusal(PLUGIN, ("ups", PLUGIN)) is None
    message = refusal(PLUGIN, ("ups",))
    assert message is not None and "'fakewl' is not allowed" in message and "--allow-workload fakewl" in message
    message = refusal("ups", ())
    assert message is not None and "allowed: none" in message
    message = refusal("elsewhere", ("elsewhere",))
    assert message is not None and "not installed" in message and ENTRY_POINT_GROUP in message
    assert not installed_plugin.exists()


# --- live: a real service and real workers ----------------------------------------------------------


def _pythonpath(*dirs: Path) -> str:
    return os.pathsep.join([*map(str, dirs), *filter(None, [os.environ.get("PYTHONPATH")])])


def _refused_trial(service: LiveService, study: str, worker: subprocess.Popen[bytes]) -> dict[str, Any]:
    """The study's one trial once the worker (--max-trials 1) has finished it; it must be refused."""
    assert worker.wait(timeout=180) == 0, log_text(worker)[-3000:]
    trials = service.trials(study)
    assert len(trials) == 1, trials
    trial = trials[0]
    assert trial["state"] == "FAIL" and trial["failure"]["kind"] == "refused", (trial, log_text(worker)[-3000:])
    assert "refused" in log_text(worker)
    # not a failure of the study: another worker re-runs it (until then it counts as lost, to be re-run)
    info = service.get(f"/v1/studies/{study}")
    assert info["failures"] == {} and info["counts"] == {"LOST": 1} and trial["to_rerun"] is True
    return trial


@pytest.mark.slow
def test_workers_get_only_workloads_they_allow_and_refuse_what_they_lack(processes: Processes, tmp_path: Path) -> None:
    marker = tmp_path / "plugin-imported"
    control_marker = tmp_path / "plugin-imported-by-the-control"
    plugin_site = write_plugin(tmp_path / "plugin-site")  # the plugin, installed
    module_only = write_module(tmp_path / "module-only")  # its module, importable but not registered
    empty_data = tmp_path / "data"
    empty_data.mkdir()
    base_env = {"FAKEWL_MARKER": str(marker), "AUTOTUNE_DATA_DIR": str(empty_data)}
    # the service knows the plugin's name (it accepts the studies); it never imports it
    service = LiveService(processes, tmp_path / "autotune.db",
                          env={**base_env, "PYTHONPATH": _pythonpath(plugin_site)}).start()
    for name, workload, preset in (("ups-study", "ups", "tiny"), ("plugin-a", PLUGIN, "p"),
                                   ("plugin-b", PLUGIN, "p"), ("plugin-c", PLUGIN, "p")):
        service.submit(small_spec(name, n_trials=2, workload=workload, preset=preset))
    assert service.post("/v1/studies", small_spec("x", workload="not-installed")).status_code == 422

    def worker(study: str, *allow: str, pythonpath: Path | None = None,
               env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        env = {**base_env, **({"PYTHONPATH": _pythonpath(pythonpath)} if pythonpath else {}), **(env or {})}
        args = [arg for name in allow for arg in ("--allow-workload", name)]
        return start_worker(processes, service.url, "--study", study, "--max-trials", "1", *args,
                            log_name=f"worker-{study}.log", env=env)

    # every worker at once: each works on a study (or on none) of its own
    # a worker is offered only studies of the workloads it allows: pinned to another one, it is told why
    not_allowed_builtin = worker("ups-study", PLUGIN)  # allows only the plugin
    not_allowed_plugin = worker("plugin-a", pythonpath=plugin_site)  # has it, default allow-list
    # unpinned, it is simply not offered them (and waits)
    idle = start_worker(processes, service.url, "--allow-workload", "none-such", "--idle-exit", "2",
                        log_name="worker-idle.log", env=base_env)
    # allowed but not installed here: offered, and refused by the worker itself (its own boundary)
    not_installed = worker("plugin-b", PLUGIN, pythonpath=module_only)  # allows it, has only the module
    # the control: a worker that allows and has the plugin runs its probe, which imports it (its
    # own marker file and data folder)
    control_data = tmp_path / "control-data"
    control_data.mkdir()
    runs_it = worker("plugin-c", PLUGIN, pythonpath=plugin_site,
                     env={"FAKEWL_MARKER": str(control_marker), "AUTOTUNE_DATA_DIR": str(control_data)})

    for proc, study, workload, allowed in ((not_allowed_builtin, "ups-study", "ups", PLUGIN),
                                           (not_allowed_plugin, "plugin-a", PLUGIN, "gpt, ups")):
        assert proc.wait(timeout=120) == 2, log_text(proc)[-3000:]
        text = " ".join(log_text(proc).split())  # rich wraps long lines
        assert f"runs workload '{workload}', which this worker does not run (it runs: {allowed})" in text, text
        assert f"--allow-workload {workload}" in text
        assert service.trials(study) == []  # nothing was leased, so nothing is failed
    assert idle.wait(timeout=120) == 0 and "idle for" in log_text(idle), log_text(idle)[-3000:]
    assert service.trials("ups-study") == [] and service.trials("plugin-a") == []
    assert list(empty_data.iterdir()) == []  # no probe ran: the ups data was never generated

    message = _refused_trial(service, "plugin-b", not_installed)["failure"]["message"]
    assert "'fakewl' is allowed but not installed" in message and ENTRY_POINT_GROUP in message

    # nobody imported the plugin's module: not the service, not a worker, not a probe child
    assert not marker.exists(), marker.read_text()

    # the control ran a probe of the plugin: its probe child (not the worker) imported the module
    assert runs_it.wait(timeout=180) == 0, log_text(runs_it)[-3000:]
    wait_until(lambda: control_marker.exists(), 10, "the probe child's import of the plugin")
    importer = control_marker.read_text()
    assert importer.startswith("imported by pid ") and importer != f"imported by pid {runs_it.pid}", importer
    trial = service.trials("plugin-c")[0]
    assert trial["state"] == "FAIL" and trial["failure"]["kind"] != "refused", trial
    assert not marker.exists(), marker.read_text()  # and still nobody else
