"""The service verbs of `autotune`: serve, worker, submit, status, best, demo (help, errors, output)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from live_service import SMALL_SPACE, LiveService, Processes, free_port, log_text, small_spec, start_worker
from typer.testing import CliRunner

from autotune.cli.main import app
from autotune.worker import loop as worker_loop
from autotune.worker.hardware import surely_no_gpu

VERBS = ["serve", "worker", "submit", "status", "stop", "best", "report", "probe", "demo", "tune"]


def invoke(*args: str) -> Any:
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, autotune_data_dir: Any) -> Iterator[tuple[LiveService, str]]:
    """A service with one finished 3-trial study ("cli"): the baseline, a search draw of the
    baseline's own config (a repeat of it, never a candidate) and one candidate, the gate wide
    open (these tests are about the CLI's wiring, not the tiny model's quality)."""
    tmp = tmp_path_factory.mktemp("cli-service")
    processes = Processes(tmp)
    try:
        service = LiveService(processes, tmp / "autotune.db").start()
        service.submit(small_spec("cli", n_trials=3, gate={"abs_tol": 1.0}, pruning={"enabled": False}))
        worker = start_worker(processes, service.url, "--study", "cli", "--idle-exit", "2")
        assert worker.wait(timeout=90) == 0, log_text(worker)[-3000:]
        yield service, "cli"
    finally:
        processes.stop_all()


@pytest.mark.parametrize("verb", VERBS)
def test_every_verb_has_help(verb: str) -> None:
    result = invoke(verb, "--help")
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.stdout and verb in result.stdout


def test_the_app_lists_every_verb() -> None:
    result = invoke("--help")
    assert result.exit_code == 0
    for verb in VERBS:
        assert verb in result.stdout


def write_spec(tmp_path: Path, spec: dict[str, Any]) -> str:
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"n_trials": 0}, "n_trials: Input should be greater than or equal to 1"),
        ({"name": "bad name!"}, "name: String should match pattern"),
        ({"sampler": "annealing"}, "sampler: Input should be"),
        ({"space": {"params": {"batch_sise": {"choices": [2]}}}}, "space.params.batch_sise: unknown knob"),
        # the space's own paths, once each: a misplaced knob and a bare list say how to write them
        ({"space": {"batch_size": {"choices": [2]}}}, "space.batch_size: a knob at the space's top level; "
                                                      "searched knobs go under 'params'"),
        ({"space": {"space": "h100"}}, "study.yaml: space: a space inside the space; write space: NAME"),
        ({"space": {"colour": "red"}}, "space.colour: unknown key; allowed: name, description, params, fixed"),
        ({"space": {"params": {"batch_size": [2, 4]}}}, "space.params.batch_size: expected a mapping with 'choices' "
                                                        "or 'low'/'high', got a list: write {choices: [2, 4]}"),
        ({"space": "nosuch"}, "study.yaml: space: no search space 'nosuch'; known: "),  # said once, not space.space
        ({"space": [2, 4]}, "space: expected a name from search_spaces/ (e.g. 'cpu', 'h100') or an inline mapping "
                            "with 'params', got list"),
        ({"baseline": {"precision": "fp7"}}, "baseline.precision: 'fp7' is not allowed"),
        ({"colour": "red"}, "colour: Extra inputs are not permitted"),
    ],
)
def test_submit_of_a_bad_spec_exits_2_naming_the_field(tmp_path: Path, change: dict[str, Any], expected: str) -> None:
    spec = {**small_spec("bad"), **change}
    port = free_port()  # nothing listens: a local validation error comes first
    result = invoke("submit", write_spec(tmp_path, spec), "--api", f"http://127.0.0.1:{port}")
    assert result.exit_code == 2, result.output
    assert expected in result.stderr


def test_submit_of_a_missing_file_or_a_non_mapping_exits_2(tmp_path: Path) -> None:
    result = invoke("submit", str(tmp_path / "nope.yaml"))
    assert result.exit_code == 2 and "no such file" in result.stderr
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    result = invoke("submit", str(path))
    assert result.exit_code == 2 and "expected a mapping" in result.stderr


def test_an_unreachable_service_is_a_clear_error() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    for args in (["status"], ["status", "x"], ["best", "x"]):
        result = invoke(*args, "--api", url)
        assert result.exit_code == 1, result.output
        assert f"cannot reach the autotune service at {url}: start it with `autotune serve`" in result.stderr


@pytest.mark.slow  # the module's live service and finished study take ~25 s to set up
def test_submit_creates_a_study_and_reports_server_side_errors(live: tuple[LiveService, str], tmp_path: Path) -> None:
    service, _ = live
    path = write_spec(tmp_path, small_spec("submitted", n_trials=3))
    result = invoke("submit", path, "--api", service.url, "--token", service.admin_token)
    assert result.exit_code == 0, result.output
    assert "created study submitted (running)" in result.stdout
    assert service.get("/v1/studies/submitted")["spec"]["n_trials"] == 3

    # a space reaching batches its probe budget cannot time: created, with a note at submit and in status
    wide = {**SMALL_SPACE, "params": {**SMALL_SPACE["params"], "batch_size": {"choices": [2, 4, 16]}}}
    (wide_dir := tmp_path / "wide").mkdir()
    result = invoke("submit", write_spec(wide_dir, small_spec("wide", space=wide)), "--api", service.url,
                    "--token", service.admin_token)
    assert result.exit_code == 0, result.output
    note = ("note: probe.samples 64 times at most 6 samples per optimizer step (batch_size × accum_steps); the "
            "space draws up to 16 (e.g. 16 × 1): such configs fail as trials before training. Use probe.samples "
            ">= 160 to time them all, or narrow the space")
    assert note in result.stderr
    result = invoke("status", "wide", "--api", service.url, "--token", service.admin_token)
    assert result.exit_code == 0 and note in result.stdout, result.output

    result = invoke("submit", path, "--api", service.url, "--token", service.admin_token)  # the name is taken
    assert result.exit_code == 1
    assert "study 'submitted' already exists" in result.stderr

    # valid locally, refused by the service (a grid sampler cannot search a float range): 422 → exit 2
    spec = small_spec("grid", sampler="grid", space={"params": {"lr": {"low": 1e-4, "high": 1e-3}}})
    result = invoke("submit", write_spec(tmp_path, spec), "--api", service.url, "--token", service.admin_token)
    assert result.exit_code == 2, result.output
    assert "space.params.lr" in result.stderr or "params.lr" in result.stderr


@pytest.mark.slow  # the module's live service and finished study take ~25 s to set up
def test_submit_without_the_right_token_exits_1_saying_how_to_get_one(live: tuple[LiveService, str],
                                                                     tmp_path: Path) -> None:
    service, _ = live
    path = write_spec(tmp_path, small_spec("unauthorized"))
    result = invoke("submit", path, "--api", service.url)  # no token
    assert result.exit_code == 1, result.output
    assert "needs an admin token" in result.stderr and "autotune token create --role admin" in result.stderr
    result = invoke("submit", path, "--api", service.url, "--token", service.worker_token)  # wrong role
    assert result.exit_code == 1, result.output
    assert "is a worker token" in result.stderr and "autotune token create --role admin" in result.stderr
    result = CliRunner().invoke(app, ["submit", path, "--api", service.url],  # AUTOTUNE_TOKEN works like --token
                                env={"COLUMNS": "200", "AUTOTUNE_TOKEN": service.admin_token})
    assert result.exit_code == 0, result.output


@pytest.mark.slow  # the module's live service and finished study take ~25 s to set up
def test_the_token_can_come_from_a_file_off_the_command_line(live: tuple[LiveService, str], tmp_path: Path) -> None:
    service, _ = live
    path = write_spec(tmp_path, small_spec("from-file"))
    token_file = tmp_path / "admin.token"
    token_file.write_text(service.admin_token + "\n")
    token_file.chmod(0o600)  # a token file others may read is refused (tests/worker/test_worker_secrets.py)
    result = CliRunner().invoke(app, ["submit", path, "--api", service.url, "--token-file", str(token_file)],
                                env={"COLUMNS": "200", "AUTOTUNE_TOKEN": service.worker_token})  # the file wins
    assert result.exit_code == 0, result.output
    assert service.get("/v1/studies/from-file")["name"] == "from-file"
    (tmp_path / "empty.token").write_text("\n")
    (tmp_path / "empty.token").chmod(0o600)
    result = invoke("submit", path, "--api", service.url, "--token-file", str(tmp_path / "empty.token"))
    assert result.exit_code == 2 and "the file is empty" in result.stderr
    result = invoke("submit", path, "--api", service.url, "--token-file", str(tmp_path / "missing.token"))
    assert result.exit_code == 2 and "cannot read it" in result.stderr
    result = invoke("submit", path, "--api", service.url, "--token", "x", "--token-file", str(token_file))
    assert result.exit_code == 2 and "give the token one way" in result.stderr
    assert "shows in `ps`" in " ".join(invoke("worker", "--help").stdout.split())  # the help says why


@pytest.mark.slow  # the module's live service and finished study take ~25 s to set up
def test_status_lists_studies_and_a_studys_trials(live: tuple[LiveService, str]) -> None:
    service, study = live
    result = invoke("status", "--api", service.url)
    assert result.exit_code == 0, result.output
    assert study in result.stdout and "finished" in result.stdout and "3/3" in result.stdout

    result = invoke("status", study, "--api", service.url)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert f"study {study}: finished · 3 of 3 trials (" in out  # baseline seeds and search against n_trials
    assert f"study {study}: finished" in out
    for header in ("state", "samples/s", "NRMSE", "feasible", "failure", "params"):
        assert header in out
    assert out.count("COMPLETE") + out.count("REPEAT") == 3  # a draw that repeated a config: REPEAT, not run
    assert "(baseline)" in out and "bs=" in out

    result = invoke("status", "nope", "--api", service.url)
    assert result.exit_code == 1
    assert "no study named 'nope'" in result.stderr


@pytest.mark.slow  # the module's live service and finished study take ~25 s to set up
def test_best_prints_yaml_and_json(live: tuple[LiveService, str]) -> None:
    """best exits 0 only for a certified pick; without one it prints the baseline's config and exits 1."""
    service, study = live
    result = invoke("best", study, "--format", "json", "--api", service.url)
    data = json.loads(result.stdout)
    assert isinstance(data["certified"], bool) and data["reason"]
    assert result.exit_code == (0 if data["certified"] else 1), result.output
    assert data["study"] == study and data["throughput_samples_per_s"] > 0

    result = invoke("best", study, "--api", service.url)
    assert result.exit_code == (0 if data["certified"] else 1), result.output
    assert result.stdout.startswith(f"# autotune verdict for study {study}")
    assert ("CERTIFIED" if data["certified"] else "KEEP THE BASELINE") in result.stdout.split("\n")[0]
    config = yaml.safe_load(result.stdout)
    assert isinstance(config, dict) and config == data["config"]
    header = result.stdout.split("\n")
    assert any(line.startswith("# val_nrmse:") and "baseline val_nrmse:" in line for line in header)
    assert any(line.startswith("# peak memory reserved:") for line in header)
    if not data["certified"]:
        assert "no certified pick" in result.stderr
        result = invoke("best", study, "--uncertified", "--api", service.url)
        assert result.exit_code == 1 and result.stdout.startswith("# UNCERTIFIED")

    result = invoke("best", study, "--format", "toml", "--api", service.url)
    assert result.exit_code == 2 and "allowed: yaml | json" in result.stderr
    result = invoke("best", "nope", "--api", service.url)
    assert result.exit_code == 2 and "no study named" in result.stderr


@pytest.mark.slow  # the module's live service and finished study take ~25 s to set up
def test_best_before_any_result_exits_1_with_the_reason(live: tuple[LiveService, str], tmp_path: Path) -> None:
    service, _ = live
    service.submit(small_spec("empty", n_trials=1, hardware="NVIDIA H100 80GB HBM3"))
    result = invoke("best", "empty", "--api", service.url)
    assert result.exit_code == 1
    assert "no recommendation yet" in result.stderr


def test_the_database_commands_load_the_service_without_its_web_application() -> None:
    """`autotune db` and `autotune token` reach api/ for the database, its tokens and backups
    only; `autotune serve` adds the web application (fastapi, Optuna). In a fresh process,
    since this one has imported them all already."""
    code = ("import sys\n"
            "from autotune.cli.seam import service\n"
            "api = service()\n"
            "assert api.auth.TokenStore and api.db.MigrationError and api.backup\n"
            "assert not {'autotune.api.main', 'fastapi', 'optuna'} & set(sys.modules), \\\n"
            "    'the web application was imported'\n"
            "assert service(app=True).main.run_server and {'fastapi', 'optuna'} <= set(sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]


def test_worker_refuses_an_unknown_device() -> None:
    result = invoke("worker", "--device", "tpu")
    assert result.exit_code == 2
    assert "unknown device 'tpu'" in result.stderr
    result = invoke("worker", "--device", "cuda:x")  # printed as typed: ":x:" is no emoji, "[...]" no markup
    assert result.exit_code == 2
    assert "--device cuda:x: expected cuda:N or cuda:N,M,... (GPU indices)" in result.stderr


@pytest.mark.skipif(not surely_no_gpu(), reason="this host has a GPU's device files")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:0,1"])
def test_a_worker_asked_for_cuda_on_a_host_without_a_gpu_is_refused_before_it_starts_anything(
        device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Said at once: the fork server (which imports torch, 4 CPU-seconds) was started first and a
    child forked from it to find out."""
    def no_fork_server(options: Any) -> None:
        raise AssertionError("a fork server was started")

    monkeypatch.setattr(worker_loop, "start_fork_server", no_fork_server)
    result = invoke("worker", "--device", device, "--gpus-per-trial", "2" if "," in device else "1")
    assert result.exit_code == 2, result.output
    assert f"--device {device}: CUDA is not available on this host; use --device cpu" in result.stderr


def test_worker_refuses_a_study_name_and_a_spool_it_could_never_use(tmp_path: Path) -> None:
    """Said before the worker leases anything (a bad name was pydantic's error dump at the first
    lease; an unwritable spool was said only when a result could not be written to it)."""
    result = invoke("worker", "--study", "bad name!", "--api", f"http://127.0.0.1:{free_port()}")
    assert result.exit_code == 2, result.output
    assert "--study 'bad name!': not a study name" in result.stderr and "validation error" not in result.output
    (tmp_path / "a-file").write_text("")
    spool = tmp_path / "a-file" / "spool"
    result = invoke("worker", "--spool-dir", str(spool), "--api", f"http://127.0.0.1:{free_port()}")
    assert result.exit_code == 2, result.output
    assert f"--spool-dir {spool}: cannot write there (Not a directory)" in result.stderr
    writable = tmp_path / "spool"
    result = invoke("worker", "--spool-dir", str(writable), "--api", f"http://127.0.0.1:{free_port()}",
                    "--idle-exit", "0", "--cold-start")
    assert result.exit_code == 3, result.output  # past the checks: the service does not answer
    assert writable.is_dir() and list(writable.iterdir()) == []  # the check leaves nothing behind


@pytest.mark.slow  # the module's live service and finished study take ~25 s to set up
def test_report_writes_html_and_valid_pngs(live: tuple[LiveService, str], tmp_path: Path) -> None:
    service, study = live
    out = tmp_path / "report"
    result = invoke("report", study, "--out", str(out), "--api", service.url)
    assert result.exit_code == 0, result.output
    page = (out / "report.html").read_text()
    assert f"autotune report: {study}" in page and "(baseline)" in page
    for name in ("pareto", "progress"):
        data = (out / f"{name}.png").read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000
        assert f'src="{name}.png"' in page
    for name in ("importances", "failures"):  # a 3-trial study without failures: no empty axes, a sentence why
        assert not (out / f"{name}.png").exists() and f"{name}.png is left out" in page
    assert result.stdout.startswith("Verdict: ")  # the headline first

    result = invoke("report", "nope", "--out", str(tmp_path / "x"), "--api", service.url)
    assert result.exit_code == 1 and "no study named 'nope'" in result.stderr


@pytest.mark.slow  # the module's live service and finished study take ~25 s to set up
def test_stop_stops_a_study_and_keeps_its_data(live: tuple[LiveService, str]) -> None:
    service, _ = live
    service.submit(small_spec("stopme", n_trials=3))
    token = service.admin_token
    result = invoke("stop", "stopme", "--api", service.url, "--token", token)
    assert result.exit_code == 0, result.output
    assert "study stopme: stopped" in result.stdout and "its data is kept" in result.stdout
    assert service.get("/v1/studies/stopme")["state"] == "stopped"
    again = invoke("stop", "stopme", "--api", service.url, "--token", token)  # stopping a stopped study: no change
    assert again.exit_code == 0 and "stopped" in again.stdout
    missing = invoke("stop", "nope", "--api", service.url, "--token", token)
    assert missing.exit_code == 1 and "no study named 'nope'" in missing.stderr
    unauthorised = invoke("stop", "stopme", "--api", service.url)
    assert unauthorised.exit_code == 1 and unauthorised.stderr


@pytest.mark.slow  # the module's live service and finished study take ~25 s to set up
def test_serve_on_a_busy_port_fails_before_touching_the_database(live: tuple[LiveService, str],
                                                                   tmp_path: Path) -> None:
    service, _ = live
    port = service.url.rsplit(":", 1)[1]
    db = tmp_path / "new.db"
    result = invoke("serve", "--db", f"sqlite:///{db}", "--port", port, "--no-auth")
    assert result.exit_code == 2, result.output
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr and "--port" in result.stderr
    assert not db.exists()  # neither created nor migrated


def test_a_url_that_is_not_an_autotune_service_says_so(tmp_path: Path) -> None:
    """--api pointing at another web server: a message naming the problem and the fix, no HTML."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Page(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status = 200 if self.path.startswith("/v1/studies") else 404
            body = b"<html><body><h1>Some other app</h1></body></html>"
            self.send_response(status)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        for args in (("status",), ("status", "s"), ("best", "s")):
            result = invoke(*args, "--api", url)
            assert result.exit_code == 1, result.output
            assert "is not an autotune service" in result.stderr and "--api" in result.stderr, result.stderr
            assert "<html" not in result.output and "Traceback" not in result.output
    finally:
        server.shutdown()
