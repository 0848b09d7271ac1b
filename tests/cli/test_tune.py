"""`autotune tune SPEC`: one command tunes on one machine (embedded service, local workers,
progress, verdict, best.yaml); Ctrl-C stops it cleanly and the same command resumes the study;
a study of that name with another spec is refused; `autotune.tune(spec)` returns the verdict."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from autotune.cli.demo import STOP_GRACE_S

SPEC: dict[str, Any] = {
    "name": "tiny-tune", "sampler": "grid", "seed": 0, "n_trials": 3, "baseline_seeds": 1,
    "space": {"params": {"batch_size": {"choices": [4, 8]}}, "fixed": {"accum_steps": 1}},
    "baseline": {"batch_size": 4, "accum_steps": 1},
    "probe": {"samples": 160, "windows": 5, "warmup_steps": 5}, "remeasure": {"top_k": 1, "max_rounds": 2},
}
CLI = [sys.executable, "-m", "autotune.cli", "tune"]


def _tune(tmp_path: Path, *args: str, log: str = "tune.log") -> subprocess.Popen[bytes]:
    with open(tmp_path / log, "wb") as out:
        return subprocess.Popen([*CLI, "spec.yaml", "--workers", "1", *args], cwd=tmp_path, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_interruptible)


def _interruptible() -> None:
    """In the child before exec: SIGINT back to its default. A test process may run with SIGINT
    ignored (a pytest-xdist worker can), and a Python started with SIGINT ignored installs no
    KeyboardInterrupt handler: Ctrl-C would then be lost, as for a job a script starts with `&`."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _leased(workdir: Path) -> list[str]:
    """Every "▶ trial" line the workers of every run printed (one per lease)."""
    return [line for log in sorted(workdir.glob("worker-*.log")) for line in log.read_text().splitlines()
            if "▶ trial" in line]


@pytest.mark.slow  # ~70 s on 2 cores: real probes, interrupted once and resumed
def test_tune_runs_is_interrupted_resumes_and_answers(tmp_path: Path) -> None:
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(SPEC))
    first = _tune(tmp_path)
    deadline = time.monotonic() + 180
    while not re.search(r"^\[ *[1-9]\d*/\d+\] [1-9]", (tmp_path / "tune.log").read_text(), flags=re.MULTILINE):
        assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "tune.log").read_text()
        time.sleep(0.3)
    os.killpg(first.pid, signal.SIGINT)  # Ctrl-C in the terminal: the whole group
    # the designed worst case: each of the worker and the service gets STOP_GRACE_S to stop (under load)
    assert first.wait(timeout=2 * STOP_GRACE_S + 30) == 130, (tmp_path / "tune.log").read_text()
    assert "run the same command again to resume" in (tmp_path / "tune.log").read_text()
    assert not (tmp_path / "best.yaml").exists()
    workdir = tmp_path / "autotune-work"
    assert (workdir / "admin.token").stat().st_mode & 0o077 == 0  # the tokens kept for the rerun are private
    leased_before = _leased(workdir)

    second = _tune(tmp_path, log="resume.log")
    code = second.wait(timeout=400)
    out = (tmp_path / "resume.log").read_text()
    assert "study     tiny-tune: resumed (running)" in out, out
    best = (tmp_path / "best.yaml").read_text()
    assert best.startswith("# autotune verdict for study tiny-tune: ")
    certified = "verdict: CERTIFIED" in out
    assert code == (0 if certified else 1), out  # 0 only for a certified pick
    assert ("CERTIFIED" in best.splitlines()[0]) == certified
    leases = _leased(workdir)
    assert leases[:len(leased_before)] == leased_before  # the interrupted run's log is kept above the resumed one's
    assert len(leases) > len(leased_before)  # the resumed run ran the rest
    assert (workdir / "worker-1.log").read_text().count("--- worker-1 started ") == 2
    ids = [re.search(r"\(id (\d+)\)", line).group(1) for line in leases]  # type: ignore[union-attr]
    interrupted = len(ids) - len(set(ids))
    assert interrupted <= 1, leases  # only a trial interrupted by the Ctrl-C runs again (as its retry, a new id)
    # the interrupted trial is lost, to be re-run: the progress never shows it as a failure
    assert not re.search(r"\b[1-9]\d* failed", out), out

    # finished: the same command answers at once, the same way
    third = _tune(tmp_path, log="again.log")
    assert third.wait(timeout=120) == code
    assert "resumed (finished)" in (tmp_path / "again.log").read_text()
    assert _leased(workdir) == leases

    # the same name with another spec is refused, naming the fix
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump({**SPEC, "n_trials": 4}))
    other = _tune(tmp_path, log="other.log")
    assert other.wait(timeout=120) == 2
    assert "with another spec: give this one another name (--name) or another --workdir" in \
        (tmp_path / "other.log").read_text()

    # the Python API: the finished study's verdict
    (tmp_path / "spec0.yaml").write_text(yaml.safe_dump(SPEC))
    done = subprocess.run([sys.executable, "-c", "import autotune, yaml; "
                           "v = autotune.tune(yaml.safe_load(open('spec0.yaml')), workers=1, out=None); "
                           "print('VERDICT', v.certified, v.study)"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"VERDICT {certified} tiny-tune" in done.stdout


def test_the_progress_line_estimates_the_time_left() -> None:
    from autotune.cli.demo import eta_text

    assert eta_text(60.0, 3, 9) == " · ETA ~2 min"  # 20 s a trial, 6 to go
    assert eta_text(10.0, 2, 4) == " · ETA ~10 s"
    assert eta_text(5.0, 0, 4) == "" and eta_text(5.0, 4, 4) == ""  # nothing to go on, or nothing left


def test_local_workers_share_the_cores_at_most_omp_num_threads_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """`autotune tune` and `autotune demo` give each local CPU worker cores // N torch threads,
    at most an OMP_NUM_THREADS of their environment (as a worker's own core share keeps it)."""
    from autotune.cli.demo import worker_threads

    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert (worker_threads(1), worker_threads(2), worker_threads(3), worker_threads(16)) == (8, 4, 2, 1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert (worker_threads(1), worker_threads(2)) == (1, 1)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert (worker_threads(1), worker_threads(4)) == (3, 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "x")  # not a number: no ceiling
    assert worker_threads(1) == 8


def test_a_spec_without_hardware_is_checked_against_this_hosts_gpu(tmp_path: Path) -> None:
    """`autotune tune` on a GPU host: a spec that leaves `hardware` out takes the host's GPU
    before it is validated, so a GPU space (fp8 among its precisions) is not refused as a CPU
    study's. (The GPU's name comes from the host; here it is given.)"""
    import typer

    from autotune.cli.study_cmds import _load_spec

    (tmp_path / "study.yaml").write_text(yaml.safe_dump({"name": "gpu-job", "workload": "gpt", "space": "h100"}))
    with pytest.raises(typer.Exit):  # taken as a CPU study, the h100 space's fp8 is refused
        _load_spec(tmp_path / "study.yaml", None, check_cpu=False)
    spec, implicit = _load_spec(tmp_path / "study.yaml", None, host_hardware=lambda: "NVIDIA H100 80GB HBM3")
    assert implicit and spec.hardware == "NVIDIA H100 80GB HBM3" and spec.space == "h100"


def test_a_spec_naming_a_workload_given_by_allow_workload_is_accepted(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`autotune tune SPEC --allow-workload NAME=module:attr`: NAME is known before the spec is
    checked (it was refused as an unknown workload). The tuning itself is not under test here."""
    from typer.testing import CliRunner

    import autotune.cli.local as local
    from autotune.cli.main import app

    seen = []
    monkeypatch.setattr(local, "run_tune", lambda spec, *a, **k: (seen.append(spec), (0, None))[1])
    from autotune.contract.registry import registered_workloads

    monkeypatch.setenv("AUTOTUNE_WORKLOADS", "")  # restored after the test, as the registry's cache
    registered_workloads.cache_clear()
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump({**SPEC, "workload": "my-wl", "hardware": "cpu"}))
    refused = CliRunner().invoke(app, ["tune", str(tmp_path / "spec.yaml")])
    assert refused.exit_code == 2 and "unknown workload 'my-wl'" in refused.output
    given = CliRunner().invoke(app, ["tune", str(tmp_path / "spec.yaml"), "--allow-workload",
                                     "my-wl=my_pkg.workload:MyWorkload"])
    assert given.exit_code == 0, given.output
    assert [s.workload for s in seen] == ["my-wl"]
    monkeypatch.undo()
    registered_workloads.cache_clear()  # the registry as the environment has it again


def test_a_spec_for_a_gpu_this_host_lacks_exits_2_with_the_reason(tmp_path: Path) -> None:
    """A spec whose `hardware` names a GPU this host does not have: exit status 2 and one line
    saying why (it was a traceback), before a service or worker starts or the workdir is made."""
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump({**SPEC, "hardware": "NVIDIA No Such GPU"}))
    done = subprocess.run([*CLI, "spec.yaml", "--workdir", "work"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "error: the spec's hardware is 'NVIDIA No Such GPU'" in output and "Traceback" not in output
    assert not (tmp_path / "work").exists()


@pytest.mark.parametrize("command", ["tune", "demo"])
def test_a_workdir_that_cannot_be_made_exits_2_naming_it(tmp_path: Path, command: str) -> None:
    """--workdir under a file, or a file itself: exit status 2 and one line naming it (it was a
    traceback), before a service starts."""
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(SPEC))
    (tmp_path / "a-file").write_text("")
    spec = ["spec.yaml"] if command == "tune" else []
    for workdir, why in (("a-file/work", "Not a directory"), ("a-file", "a file of that name is in the way")):
        done = subprocess.run([*CLI[:-1], command, *spec, "--workdir", workdir], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120, check=False)
        output = done.stdout + done.stderr
        assert done.returncode == 2, output
        assert f"error: --workdir {tmp_path / workdir}: cannot make it a directory ({why})" in output, output
        assert "Traceback" not in output and not (tmp_path / "a-file" / "serve.log").exists()



def test_an_out_path_that_cannot_take_best_yaml_exits_2_before_the_study(tmp_path: Path) -> None:
    """best.yaml is written at the end: a path under a file, or a directory, was a traceback after
    the whole study had run; now exit 2 before a service starts."""
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(SPEC))
    (tmp_path / "a-file").write_text("")
    (tmp_path / "a-dir").mkdir()
    for out, said in (("a-file/best.yaml", f"--out's folder {tmp_path / 'a-file'}: cannot make it a directory "
                                           "(a file of that name is in the way)"),
                      ("a-dir", "--out a-dir is a directory: name the file to write, e.g. a-dir/best.yaml")):
        done = subprocess.run([*CLI, "spec.yaml", "--workdir", "work", "--out", out], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120, check=False)
        output = done.stdout + done.stderr
        assert done.returncode == 2, output
        assert f"error: {said}" in output and "Traceback" not in output, output
        assert not (tmp_path / "work" / "serve.log").exists()  # no service was started


def test_the_python_api_names_the_file_and_the_field_of_a_bad_spec(tmp_path: Path) -> None:
    """`autotune.tune(spec)` with a spec it cannot read: TuneError with code 2 (bad input) naming
    the file and the field, as `autotune tune` says it (it was pydantic's ValidationError, or a
    TypeError for a file that is not a mapping), before anything is made."""
    from autotune import TuneError, tune

    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    (tmp_path / "broken.yaml").write_text("name: [unclosed\n")
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({**SPEC, "n_trials": 0}))
    cases: list[tuple[Any, str]] = [
        (tmp_path / "missing.yaml", f"{tmp_path / 'missing.yaml'}: no such file; give a YAML or JSON study spec"),
        (tmp_path / "list.yaml", f"{tmp_path / 'list.yaml'}: expected a mapping of study fields"),
        (str(tmp_path / "broken.yaml"), f"{tmp_path / 'broken.yaml'}: not valid YAML/JSON"),
        (tmp_path / "bad.yaml", f"{tmp_path / 'bad.yaml'}: n_trials: Input should be greater than or equal to 1"),
        ({**SPEC, "hardware": "cpu", "sampler": "annealing"}, "the spec: sampler: Input should be"),
        (["not", "a", "spec"], "the spec is a list: give a StudySpec, a dict of its fields or a YAML/JSON file's path"),
    ]
    for spec, said in cases:
        with pytest.raises(TuneError) as caught:
            tune(spec, workdir=tmp_path / "work", out=None)
        assert caught.value.code == 2 and str(caught.value).startswith(said), (spec, str(caught.value))
    assert not (tmp_path / "work").exists()
