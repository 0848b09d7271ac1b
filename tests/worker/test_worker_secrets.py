"""The worker's secrets stay the worker's (issue 35, item 6).

* No process a worker starts sees its token (AUTOTUNE_TOKEN): probe children started cold or
  forked from the fork server, the distributed launcher, the hardware detection. A probe runs
  workload code. Fake children report their environment; a real worker's probe child is read
  through /proc/PID/environ while it runs.
* The SQLite files `token create` and `serve` make (and their -wal/-shm) are 0600.
* A token file of this user that its group or others may read is refused (exit status 2,
  naming `chmod 600 FILE`).
"""

from __future__ import annotations

import io
import os
import sqlite3
import stat
from pathlib import Path
from typing import Any

import pytest
from live_service import LiveService, Processes, probe_children, small_spec, start_worker, wait_until
from rich.console import Console
from typer.testing import CliRunner
from worker_fakes import HARDWARE, FakeClient, fake_child, make_lease

from autotune.api.auth import TokenStore
from autotune.cli.common import resolve_token
from autotune.cli.main import app
from autotune.engine import fork_server
from autotune.engine.fork_server import ForkServer
from autotune.worker.detect import run_python
from autotune.worker.loop import Worker
from autotune.worker.options import WorkerOptions, child_environment

TOKEN = "secret-worker-token-for-the-test"
REPORT_ENV = """
import json, os
token = os.environ.get("AUTOTUNE_TOKEN")
print(json.dumps({"type": "result", "result": {"workload": "ups", "preset": "tiny", "config": {}, "device": "cpu",
      "torch_version": "x", "throughput_samples_per_s": 1.0, "val_nrmse": 0.5, "failure": None,
      "measurement_notes": ["token seen: " + repr(token)]}}), flush=True)
"""


@pytest.fixture
def token_env(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("AUTOTUNE_TOKEN", TOKEN)
    return TOKEN


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw.split(b"\0") if item)


# --- no child sees the token ------------------------------------------------------------------------------


def test_the_childrens_environment_and_the_fork_servers_leave_the_token_out(token_env: str) -> None:
    env = child_environment(1)
    assert "AUTOTUNE_TOKEN" not in env and env["OMP_NUM_THREADS"] == "1"
    assert "AUTOTUNE_TOKEN" not in child_environment(None, {"AUTOTUNE_TOKEN": TOKEN, "PATH": "/bin"})
    assert "AUTOTUNE_TOKEN" not in ForkServer({"AUTOTUNE_TOKEN": TOKEN, "PATH": "/bin"}).env


def test_a_cold_probe_and_a_distributed_launcher_run_without_the_token(tmp_path: Path, token_env: str) -> None:
    """The probe child started cold and the launcher of a multi-process trial: each reports the token it sees."""
    argv = fake_child(tmp_path, REPORT_ENV)
    for options in (WorkerOptions(worker_id="w1", child_argv=argv, warm_start=False),
                    WorkerOptions(worker_id="w2", launch_argv=argv, gpus_per_trial=2, threads=1)):
        client = FakeClient()
        out = io.StringIO()
        worker = Worker(options, HARDWARE, client=client, console=Console(file=out, width=300))  # type: ignore[arg-type]
        worker.run_trial(make_lease())
        (result,) = client.completed
        assert result["measurement_notes"] == ["token seen: None"], out.getvalue()


def test_a_short_lived_helper_child_runs_without_the_token(token_env: str) -> None:
    code, out, _ = run_python(["-c", "import os; print(os.environ.get('AUTOTUNE_TOKEN'))"])
    assert (code, out.strip()) == (0, "None")


@pytest.mark.slow
def test_a_forked_probe_runs_without_the_token(token_env: str) -> None:
    """The fork server is started with the children's environment: a child it forks has no token either."""
    server = ForkServer(child_environment(1)).start()
    try:
        code, out, err = run_python(["-c", "import os; print(os.environ.get('AUTOTUNE_TOKEN'))"], server,
                                    env=child_environment(1))
        assert (code, out.strip()) == (0, "None"), err
        assert server.proc is not None and "AUTOTUNE_TOKEN" not in environ_of(server.proc.pid)
    finally:
        server.close()


# --- the real worker: its probe child, read through /proc --------------------------------------------------


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.slow
@pytest.mark.parametrize("start", ["warm", "cold"])
def test_a_real_workers_probe_child_has_no_token_and_the_database_is_private(
        processes: Processes, tmp_path: Path, tiny_datasets: Any, start: str) -> None:
    """`autotune serve` on a new SQLite file: the file and its -wal/-shm are 0600 (under umask
    022). A worker started with AUTOTUNE_TOKEN runs a probe; while it runs, the child's
    environment (and the fork server's) holds no token, the worker's own does."""
    old_umask = os.umask(0o022)
    try:
        db = tmp_path / "autotune.db"
        service = LiveService(processes, db).start()
    finally:
        os.umask(old_umask)
    for path in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
        assert mode(path) == 0o600, f"{path.name} is {mode(path):04o}"
    service.submit(small_spec("secrets", n_trials=1, samples=600, probe={"windows": 8},
                              pruning={"enabled": False}))
    worker = start_worker(processes, service.url, "--study", "secrets", "--max-trials", "1",
                          "--spool-dir", str(tmp_path / "spool"), *(["--cold-start"] if start == "cold" else []))
    children = wait_until(lambda: probe_children(worker.pid), 60, "a probe child")
    assert environ_of(worker.pid)["AUTOTUNE_TOKEN"] == service.worker_token  # the worker has it ...
    for pid in children:
        assert "AUTOTUNE_TOKEN" not in environ_of(pid)  # ... its probe does not
    servers = fork_server.probe_children(worker.pid, fork_server.MODULE)
    assert (len(servers) == 1) == (start == "warm")
    for pid in servers:
        assert "AUTOTUNE_TOKEN" not in environ_of(pid)
    assert worker.wait(timeout=120) == 0


# --- the database files ------------------------------------------------------------------------------------


def test_token_create_makes_a_database_only_its_owner_reads(tmp_path: Path) -> None:
    old_umask = os.umask(0o022)
    try:
        url = f"sqlite:///{tmp_path}/cli.db"
        result = CliRunner().invoke(app, ["token", "create", "--role", "admin", "--db", url])
        assert result.exit_code == 0, result.output
        assert mode(tmp_path / "cli.db") == 0o600
        store = TokenStore.open(f"sqlite:///{tmp_path}/store.db")  # what `serve` and the CLI open
        try:
            store.create("worker")
            with sqlite3.connect(tmp_path / "store.db") as conn:  # a reader keeps the -wal and -shm files
                conn.execute("SELECT count(*) FROM autotune_tokens").fetchone()
                store.create("admin")
                for name in ("store.db", "store.db-wal", "store.db-shm"):
                    assert mode(tmp_path / name) == 0o600, name
        finally:
            store.close()
    finally:
        os.umask(old_umask)


def test_an_existing_database_file_keeps_its_mode(tmp_path: Path) -> None:
    path = tmp_path / "mine.db"
    path.touch()
    path.chmod(0o640)  # its owner's choice
    TokenStore.open(f"sqlite:///{path}").close()
    assert mode(path) == 0o640


# --- the token file -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("file_mode", [0o644, 0o640, 0o604, 0o620], ids=lambda m: f"{m:04o}")
def test_a_token_file_others_may_access_is_refused_with_the_fix(tmp_path: Path, file_mode: int) -> None:
    token_file = tmp_path / "worker.token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(file_mode)
    result = CliRunner().invoke(app, ["worker", "--api", "http://127.0.0.1:9", "--token-file", str(token_file),
                                      "--idle-exit", "1", "--cold-start"], env={"COLUMNS": "300"})
    assert result.exit_code == 2, result.output
    said = " ".join(result.stderr.split())
    assert f"chmod 600 {token_file}" in said and f"mode {file_mode:04o}" in said, said
    assert TOKEN not in result.output


def test_a_token_file_only_its_owner_reads_is_taken(tmp_path: Path) -> None:
    token_file = tmp_path / "worker.token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    assert resolve_token(None, token_file) == TOKEN
    token_file.chmod(0o400)
    assert resolve_token(None, token_file) == TOKEN


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the file to another user")
def test_a_token_file_of_another_account_is_judged_by_its_owner(tmp_path: Path) -> None:
    """A Secret mounted for the pod's group (0440, owned by root) or a Docker secret bind-mounted from the
    host (another uid): chmod 600 would lock this user out, so its mode is not this user's to fix."""
    token_file = tmp_path / "worker.token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o644)
    os.chown(token_file, 65534, -1)
    assert resolve_token(None, token_file) == TOKEN
